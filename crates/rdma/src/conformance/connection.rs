//! Connection management: reject, private data, IRD/ORD, completion
//! channels, solicited events, shared receive queues, tagged CQs.

use super::*;

pub(super) fn case_reject(env: &Env<'_>) -> R {
    let pd = env.client.alloc_pd()?;
    let cq = env.client.create_cq(16, None)?;
    let init = QpInit::new(&pd, &cq);
    let reason = b"go away: not today".to_vec();
    let (sres, cres) = std::thread::scope(|sc| {
        let h = sc.spawn(|| -> Result<Vec<u8>> {
            let req = env
                .listener
                .get_request(Some(TIMEOUT))?
                .ok_or_else(|| Error::Timeout("no request".into()))?;
            let pd = req.private_data().to_vec();
            req.reject(&reason)?;
            Ok(pd)
        });
        let c = env
            .client
            .connect(env.connect_to, &init, &params(b"may I?"));
        (h.join(), c)
    });
    let seen = match sres {
        Ok(r) => r?,
        Err(_) => fail!("server thread panicked"),
    };
    ensure!(seen == b"may I?", "server saw private data {seen:?}");
    match cres {
        Err(Error::Rejected { private_data }) => {
            ensure!(
                private_data == reason,
                "reject private data {private_data:?}"
            );
            Ok(())
        }
        Err(e) => fail!("expected Rejected, got {e}"),
        Ok(_) => fail!("connection was accepted"),
    }
}

/// The most private data a connection request / accept may carry on a
/// device's transport: RoCE's CM REQ/REP carry 56/196 bytes of which rdma_cm
/// keeps 2 (54 request, 194 accept; 146 reject); MPA allows 512 (RFC 5044
/// §7.1), more than the suite ever sends.
pub(super) fn private_data_caps(t: Transport) -> (usize, usize) {
    match t {
        Transport::Roce | Transport::Infiniband => (54, 194),
        _ => (512, 512),
    }
}

pub(super) fn case_accept_pd(env: &Env<'_>) -> R {
    let (creq, _) = private_data_caps(env.client.device().transport);
    let (sreq, sacc) = private_data_caps(env.server.device().transport);
    let (_, cacc) = private_data_caps(env.client.device().transport);
    let sp = pattern(1, 200.min(sacc).min(cacc));
    let cp = pattern(2, 100.min(creq).min(sreq));
    let c = env.connect(&params(&sp), &params(&cp))?;
    let sn = c.s.qp.negotiated();
    let cn = c.c.qp.negotiated();
    ensure!(
        sn.peer_private_data == cp,
        "server saw {:?}",
        sn.peer_private_data
    );
    ensure!(
        cn.peer_private_data == sp,
        "client saw {:?}",
        cn.peer_private_data
    );
    Ok(())
}

pub(super) fn case_ird_ord(env: &Env<'_>) -> R {
    let sp = ConnParams {
        private_data: vec![],
        ird: 2,
        ord: 16,
    };
    let cp = ConnParams {
        private_data: vec![],
        ird: 8,
        ord: 4,
    };
    let c = env.connect(&sp, &cp)?;
    let sn = c.s.qp.negotiated();
    let cn = c.c.qp.negotiated();
    ensure!(
        cn.ord >= 1 && cn.ord <= sn.ird,
        "client ORD {} > server IRD {}",
        cn.ord,
        sn.ird
    );
    ensure!(
        sn.ord >= 1 && sn.ord <= cn.ird,
        "server ORD {} > client IRD {}",
        sn.ord,
        cn.ird
    );
    if env.both_soft() {
        // siw's relaxed negotiation: the responder lowers its ORD to the
        // initiator's IRD and raises its IRD to the initiator's ORD.
        ensure!(
            (sn.ird, sn.ord, cn.ird, cn.ord) == (4, 8, 8, 4),
            "soft negotiation server {sn:?} client {cn:?}"
        );
        ensure!(
            sn.mpa_crc.is_some() && sn.mpa_crc == cn.mpa_crc,
            "CRC {sn:?} {cn:?}"
        );
    }
    // The client may keep ORD reads in flight: post 2×ORD reads at once.
    let smr =
        c.s.pd
            .alloc_mr(4096, Access::LOCAL_WRITE | Access::REMOTE_READ)?;
    smr.write_at(0, &pattern(4, 4096))?;
    let cmr = c.c.pd.alloc_mr(4096 * 8, Access::LOCAL_WRITE)?;
    let n = (2 * cn.ord as usize).min(8);
    for i in 0..n {
        c.c.qp.post_send(&[send_wr(
            i as u64,
            SendOp::Read {
                remote_addr: smr.addr(),
                rkey: smr.rkey(),
            },
            &[cmr.sge(i * 4096, 4096)],
        )])?;
    }
    let w = env.wait(&c.c.cq, n)?;
    for (i, w) in w.iter().enumerate() {
        check_ok(w, i as u64, WcOpcode::RdmaRead)?;
        cmp("read", &read_mr(&cmr, i * 4096, 4096), &pattern(4, 4096))?;
    }
    Ok(())
}

pub(super) fn case_channel_wait(env: &Env<'_>) -> R {
    let c = env.connect(&params(b""), &params(b""))?;
    // A second CQ with a channel on the server, for a fresh QP would be
    // needed to route completions; instead, create a channel CQ pair on a new
    // connection.
    drop(c);
    let ch = env.server.create_comp_channel()?;
    let scq = env.server.create_cq(64, Some(&ch))?;
    let spd = env.server.alloc_pd()?;
    let cpd = env.client.alloc_pd()?;
    let ccq = env.client.create_cq(64, None)?;
    let sinit = QpInit::new(&spd, &scq);
    let cinit = QpInit::new(&cpd, &ccq);
    let (sres, cres) = std::thread::scope(|sc| {
        let h = sc.spawn(|| -> Result<Qp> {
            let req = env
                .listener
                .get_request(Some(TIMEOUT))?
                .ok_or_else(|| Error::Timeout("no request".into()))?;
            req.accept(&sinit, &params(b""))
        });
        let c = env.client.connect(env.connect_to, &cinit, &params(b""));
        (h.join(), c)
    });
    let sqp = match sres {
        Ok(r) => r?,
        Err(_) => fail!("accept thread panicked"),
    };
    let cqp = cres?;
    let smr = spd.alloc_mr(4096, Access::LOCAL_WRITE)?;
    let cmr = cpd.alloc_mr(4096, Access::LOCAL_WRITE)?;
    cmr.write_at(0, b"wake up")?;
    sqp.post_recv(&[RecvWr {
        wr_id: 7,
        sg_list: &[smr.sge(0, 4096)],
    }])?;
    // The server blocks in another thread; the client sends after a delay
    // (driving its own context meanwhile).
    let got = std::thread::scope(|sc| {
        let h = sc.spawn(|| {
            let mut out = [Wc::BLANK; 4];
            scq.wait(&ch, &mut out, Some(TIMEOUT))
                .map(|n| out[..n].to_vec())
        });
        std::thread::sleep(Duration::from_millis(30));
        let r = cqp.post_send(&[send_wr(1, SendOp::Send, &[cmr.sge(0, 7)])]);
        let t = Instant::now();
        while !h.is_finished() && t.elapsed() < TIMEOUT {
            let _ = env.client.progress();
            let mut b = [Wc::BLANK; 4];
            let _ = ccq.poll(&mut b);
            std::thread::sleep(Duration::from_micros(200));
        }
        (h.join(), r)
    });
    got.1?;
    let wcs = match got.0 {
        Ok(r) => r?,
        Err(_) => fail!("waiting thread panicked"),
    };
    ensure!(wcs.len() == 1, "channel wait returned {wcs:?}");
    check_ok(&wcs[0], 7, WcOpcode::Recv)?;
    cmp("data", &read_mr(&smr, 0, 7), b"wake up")?;
    // The fd is pollable: arm, send, and poll(2) the fd.
    scq.arm(false)?;
    sqp.post_recv(&[RecvWr {
        wr_id: 8,
        sg_list: &[smr.sge(0, 4096)],
    }])?;
    cqp.post_send(&[send_wr(2, SendOp::Send, &[cmr.sge(0, 7)])])?;
    let t = Instant::now();
    loop {
        let _ = env.client.progress();
        let mut p = libc::pollfd {
            fd: ch.fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one live pollfd.
        let k = unsafe { libc::poll(&mut p, 1, 1) };
        if k > 0 {
            break;
        }
        ensure!(t.elapsed() < TIMEOUT, "channel fd never became readable");
    }
    let w = env.wait(&scq, 1)?;
    check_ok(&w[0], 8, WcOpcode::Recv)?;
    Ok(())
}

pub(super) fn case_solicited(env: &Env<'_>) -> R {
    let ch = env.server.create_comp_channel()?;
    let scq = env.server.create_cq(64, Some(&ch))?;
    let spd = env.server.alloc_pd()?;
    let cpd = env.client.alloc_pd()?;
    let ccq = env.client.create_cq(64, None)?;
    let (sinit, cinit) = (QpInit::new(&spd, &scq), QpInit::new(&cpd, &ccq));
    let (sqp, cqp) = env.connect_qps(&sinit, &cinit, &params(b""), &params(b""))?;
    sqp.post_recv(&[
        RecvWr {
            wr_id: 1,
            sg_list: &[],
        },
        RecvWr {
            wr_id: 2,
            sg_list: &[],
        },
    ])?;
    scq.arm(true)?;
    cqp.post_send(&[send_wr(1, SendOp::Send, &[])])?;
    // An unsolicited receive completes without an event.
    let w = env.wait(&scq, 1)?;
    check_ok(&w[0], 1, WcOpcode::Recv)?;
    let t = Instant::now();
    while t.elapsed() < Duration::from_millis(100) {
        env.progress();
        if ch.wait(Some(Duration::from_millis(5)))? {
            fail!("an unsolicited completion fired a solicited-only arm");
        }
    }
    let mut s = send_wr(2, SendOp::Send, &[]);
    s.solicited = true;
    cqp.post_send(&[s])?;
    let t = Instant::now();
    loop {
        env.progress();
        if ch.wait(Some(Duration::from_millis(5)))? {
            break;
        }
        ensure!(
            t.elapsed() < TIMEOUT,
            "the solicited completion fired no event"
        );
    }
    let w = env.wait(&scq, 1)?;
    check_ok(&w[0], 2, WcOpcode::Recv)?;
    env.wait(&ccq, 2)?;
    Ok(())
}

/// Two server QPs on one shared receive queue and one CQ: Sends from their
/// two peers consume the SRQ's receives in posting order, each completion
/// names the QP that received (its `qp_num`) and the receive's `wr_id`,
/// the bytes land exactly (guard bytes around them untouched), and the
/// SRQ's count drops by one per message. A QP on an SRQ refuses receives
/// of its own.
pub(super) fn case_srq(env: &Env<'_>) -> R {
    let spd = env.server.alloc_pd()?;
    let srq = match spd.create_srq(16, 1) {
        Ok(s) => s,
        Err(Error::NotSupported(w)) => return Err(CaseErr::Skip(w)),
        Err(e) => fail!("create_srq: {e}"),
    };
    let scq = env.server.create_cq(256, None)?;
    let sinit = QpInit {
        srq: Some(srq.clone()),
        ..QpInit::new(&spd, &scq)
    };
    const SLOT: usize = 256;
    let smr = spd.alloc_mr(4 * SLOT, Access::LOCAL_WRITE)?;
    smr.fill(0, 4 * SLOT, 0xEE)?;
    // Posted before the peers can send: on iWARP devices a Send that finds
    // no receive is fatal.
    for i in 0..4 {
        srq.post_recv(&[RecvWr {
            wr_id: 1000 + i as u64,
            sg_list: &[smr.sge(i * SLOT, (SLOT - GUARD) as u32)],
        }])?;
    }
    ensure!(
        srq.posted() == 4,
        "posted() = {} after 4 posts",
        srq.posted()
    );
    let (qa, a) = env.client_to(&sinit)?;
    let (qb, b) = env.client_to(&sinit)?;
    ensure!(
        qa.qp_num() != qb.qp_num(),
        "two QPs with qp_num {}",
        qa.qp_num()
    );
    match qa.post_recv(&[RecvWr {
        wr_id: 1,
        sg_list: &[smr.sge(0, 8)],
    }]) {
        Err(PostError {
            error: Error::InvalidArgument(_),
            ..
        }) => {}
        r => fail!("post_recv on a QP of an SRQ: {r:?}"),
    }
    let cmr_a = a.pd.alloc_mr(SLOT, Access::LOCAL_WRITE)?;
    let cmr_b = b.pd.alloc_mr(SLOT, Access::LOCAL_WRITE)?;
    // (peer, its server QP, length): A, B, A, each waited for in turn.
    let plan: [(&End, &Mr, &Qp, usize); 3] = [
        (&a, &cmr_a, &qa, 20),
        (&b, &cmr_b, &qb, 33),
        (&a, &cmr_a, &qa, 0),
    ];
    for (i, &(peer, cmr, sqp, len)) in plan.iter().enumerate() {
        let data = pattern(50 + i as u64, len);
        cmr.write_at(0, &data)?;
        peer.qp
            .post_send(&[send_wr(i as u64, SendOp::Send, &[cmr.sge(0, len as u32)])])?;
        check_ok(&env.wait(&peer.cq, 1)?[0], i as u64, WcOpcode::Send)?;
        let w = env.wait(&scq, 1)?;
        let want = 1000 + i as u64;
        check_ok(&w[0], want, WcOpcode::Recv).map_err(|e| format!("message {i}: {e}"))?;
        ensure!(
            w[0].qp_num == sqp.qp_num(),
            "message {i}: qp_num {} is not the receiving QP's {}",
            w[0].qp_num,
            sqp.qp_num()
        );
        ensure!(
            w[0].byte_len as usize == len,
            "message {i}: byte_len {} != {len}",
            w[0].byte_len
        );
        guarded(&smr, i * SLOT, &data).map_err(|e| format!("message {i}: {e}"))?;
        ensure!(
            srq.posted() == 3 - i,
            "message {i}: posted() = {}, want {}",
            srq.posted(),
            3 - i
        );
    }
    // The untouched receive's slot is untouched.
    cmp("slot 3", &read_mr(&smr, 3 * SLOT, SLOT), &[0xEE; SLOT])?;
    env.quiet(&scq, Duration::from_millis(20))?;
    Ok(())
}

/// Three CQs on one completion channel, tagged; all armed, completions on
/// the 2nd and 3rd only: `take_fired` yields exactly their two tags (each
/// once), then nothing; the channel fd is no longer readable; re-armed with
/// no new completion, nothing; a new completion on one, just its tag.
pub(super) fn case_tagged_cqs(env: &Env<'_>) -> R {
    let ch = env.server.create_comp_channel()?;
    let tags = [0x11u64, 0, u64::MAX];
    let mut cqs = Vec::new();
    for t in tags {
        match env.server.create_cq_tagged(64, &ch, t) {
            Ok(cq) => cqs.push(cq),
            Err(Error::NotSupported(w)) => return Err(CaseErr::Skip(w)),
            Err(e) => fail!("create_cq_tagged: {e}"),
        }
    }
    // One connection: its server QP sends on CQ 2 and receives on CQ 3;
    // CQ 1 has no QP at all.
    let spd = env.server.alloc_pd()?;
    let sinit = QpInit {
        recv_cq: cqs[2].clone(),
        ..QpInit::new(&spd, &cqs[1])
    };
    let smr = spd.alloc_mr(4096, Access::LOCAL_WRITE)?;
    let ssge = [smr.sge(0, 4096)];
    let recv = |wr_id| RecvWr {
        wr_id,
        sg_list: &ssge,
    };
    let (sqp, c) = env.client_to(&sinit)?;
    sqp.post_recv(&[recv(1)])?;
    let cmr = c.pd.alloc_mr(4096, Access::LOCAL_WRITE)?;
    c.qp.post_recv(&[RecvWr {
        wr_id: 9,
        sg_list: &[cmr.sge(0, 4096)],
    }])?;
    for cq in &cqs {
        cq.arm(false)?;
    }
    let take = |out: &mut Vec<u64>| -> std::result::Result<usize, String> {
        ch.take_fired(out).map_err(|e| format!("take_fired: {e}"))
    };
    let mut got = Vec::new();
    ensure!(take(&mut got)? == 0, "fired before any completion: {got:?}");
    c.qp.post_send(&[send_wr(2, SendOp::Send, &[cmr.sge(0, 100)])])?;
    sqp.post_send(&[send_wr(3, SendOp::Send, &[smr.sge(0, 50)])])?;
    let t = Instant::now();
    while got.len() < 2 && t.elapsed() < TIMEOUT {
        env.progress();
        take(&mut got)?;
        std::thread::sleep(Duration::from_micros(200));
    }
    let mut sorted = got.clone();
    sorted.sort_unstable();
    ensure!(
        sorted == [0, u64::MAX],
        "take_fired yielded {got:?}, want exactly the tags of CQs 2 and 3"
    );
    std::thread::sleep(Duration::from_millis(20));
    env.progress();
    let mut again = Vec::new();
    ensure!(take(&mut again)? == 0, "second call yielded {again:?}");
    let mut p = libc::pollfd {
        fd: ch.fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one live pollfd for the call.
    let k = unsafe { libc::poll(&mut p, 1, 0) };
    ensure!(k == 0, "the channel fd is still readable after take_fired");
    check_ok(&env.wait(&cqs[1], 1)?[0], 3, WcOpcode::Send)?;
    check_ok(&env.wait(&cqs[2], 1)?[0], 1, WcOpcode::Recv)?;
    env.wait(&c.cq, 2)?;
    for cq in &cqs {
        cq.arm(false)?;
    }
    std::thread::sleep(Duration::from_millis(20));
    env.progress();
    ensure!(take(&mut again)? == 0, "re-armed, no completion: {again:?}");
    // One more completion, on CQ 3 only.
    sqp.post_recv(&[recv(4)])?;
    c.qp.post_send(&[send_wr(5, SendOp::Send, &[cmr.sge(0, 10)])])?;
    let t = Instant::now();
    while again.is_empty() && t.elapsed() < TIMEOUT {
        env.progress();
        take(&mut again)?;
        std::thread::sleep(Duration::from_micros(200));
    }
    ensure!(again == [u64::MAX], "after one receive: {again:?}");
    check_ok(&env.wait(&cqs[2], 1)?[0], 4, WcOpcode::Recv)?;
    env.wait(&c.cq, 1)?;
    for (i, cq) in cqs.iter().enumerate() {
        env.quiet(cq, Duration::from_millis(5))
            .map_err(|e| format!("CQ {}: {e}", i + 1))?;
    }
    Ok(())
}
