//! Smoke test of the `verbs` provider on a real (or soft: rxe/siw) RDMA device.
//!
//! Lists devices, opens `$RDMA_DEV`, and runs a server and a client in one
//! process over rdma_cm on `$RDMA_IP` (ports `$SMOKE_PORT`.., default 7471):
//! connect with private data, send/recv, RDMA Write, RDMA Read, window bind,
//! send with invalidate, a protection failure, reject with private data, and
//! flush on peer disconnect. Prints PASS/FAIL lines and `N passed, M failed`.

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU16, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use lwio_rdma::*;

type R<T> = std::result::Result<T, String>;

fn e<E: std::fmt::Display>(what: &'static str) -> impl Fn(E) -> String {
    move |err| format!("{what}: {err}")
}

static PORT: AtomicU16 = AtomicU16::new(0);

fn next_addr(ip: IpAddr) -> SocketAddr {
    SocketAddr::new(ip, PORT.fetch_add(1, Ordering::Relaxed))
}

/// Wait for one completion (polling, or through `ch` when given).
fn wait_one(cq: &Cq, ch: Option<&CompChannel>, secs: u64) -> R<Wc> {
    let deadline = Instant::now() + Duration::from_secs(secs);
    let mut out = [Wc::BLANK];
    loop {
        let n = match ch {
            Some(ch) => cq
                .wait(ch, &mut out, Some(Duration::from_millis(200)))
                .map_err(e("cq wait"))?,
            None => cq.poll(&mut out).map_err(e("cq poll"))?,
        };
        if n == 1 {
            return Ok(out[0]);
        }
        if Instant::now() > deadline {
            return Err("timed out waiting for a completion".into());
        }
        if ch.is_none() {
            thread::sleep(Duration::from_millis(1));
        }
    }
}

/// `mr[off..off + want.len()]` must equal `want`; else the error `differs`.
fn expect_bytes(mr: &Mr, off: usize, want: &[u8], differs: &str) -> R<()> {
    let mut got = vec![0u8; want.len()];
    mr.read_at(off, &mut got).map_err(e("read_at"))?;
    if got != want {
        return Err(differs.into());
    }
    Ok(())
}

fn expect_ok(wc: Wc, op: WcOpcode, wr_id: u64) -> R<Wc> {
    if wc.status != WcStatus::Success || wc.opcode != op || wc.wr_id != wr_id {
        return Err(format!("expected {op:?} #{wr_id} Success, got {wc:?}"));
    }
    Ok(wc)
}

/// Post a remote access that the peer must refuse, then (if the transport
/// completed it locally, as iWARP does for RDMA Writes) a probe RDMA Read of
/// valid memory: after the peer's Terminate (iWARP) or NAK (IB) the probe
/// cannot succeed. Returns what was observed.
fn expect_refused(qp: &Qp, cq: &Cq, bad: SendWr<'_>, probe: SendWr<'_>) -> R<String> {
    qp.post_send(&[bad]).map_err(e("post bad access"))?;
    let wc = wait_one(cq, None, 15)?;
    if wc.wr_id != bad.wr_id {
        return Err(format!(
            "expected a completion of #{}, got {wc:?}",
            bad.wr_id
        ));
    }
    if wc.status != WcStatus::Success {
        return Ok(format!("bad access completed with {:?}", wc.status));
    }
    // iWARP: a Write completes when sent; the refusal arrives as a Terminate.
    qp.post_send(&[probe]).map_err(e("post probe"))?;
    let wc2 = wait_one(cq, None, 15)?;
    if wc2.status == WcStatus::Success {
        return Err(format!(
            "neither the bad access nor the probe after it failed ({wc:?}, {wc2:?})"
        ));
    }
    Ok(format!(
        "bad access completed locally, probe after it: {:?}, QP {:?}",
        wc2.status,
        qp.state()
    ))
}

struct Side {
    pd: Pd,
    cq: Cq,
    ch: CompChannel,
    qp: Qp,
}

struct Pair {
    srv: Side,
    cli: Side,
    cli_negotiated: Negotiated,
    srv_req_data: Vec<u8>,
}

fn qp_init(pd: &Pd, cq: &Cq) -> QpInit {
    QpInit::new(pd, cq)
}

/// Connect a fresh server/client pair on the same device.
fn pair(ctx: &Context, ip: IpAddr) -> R<Pair> {
    let addr = next_addr(ip);
    let listener = ctx.listen(addr, 8).map_err(e("listen"))?;
    let sctx = ctx.clone();
    let server = thread::spawn(move || -> R<(Side, Vec<u8>)> {
        let req = listener
            .get_request(Some(Duration::from_secs(20)))
            .map_err(e("get_request"))?
            .ok_or("no connection request within 20 s")?;
        let data = req.private_data().to_vec();
        let pd = sctx.alloc_pd().map_err(e("server pd"))?;
        let ch = sctx.create_comp_channel().map_err(e("channel"))?;
        let cq = sctx.create_cq(256, Some(&ch)).map_err(e("server cq"))?;
        let qp = req
            .accept(
                &qp_init(&pd, &cq),
                &ConnParams {
                    private_data: b"hello-from-server".to_vec(),
                    ird: 4,
                    ord: 4,
                },
            )
            .map_err(e("accept"))?;
        Ok((Side { pd, cq, ch, qp }, data))
    });
    let pd = ctx.alloc_pd().map_err(e("client pd"))?;
    let ch = ctx.create_comp_channel().map_err(e("channel"))?;
    let cq = ctx.create_cq(256, Some(&ch)).map_err(e("client cq"))?;
    let qp = ctx.connect(
        addr,
        &qp_init(&pd, &cq),
        &ConnParams {
            private_data: b"hello-from-client".to_vec(),
            ird: 4,
            ord: 4,
        },
    );
    let srv = server.join().map_err(|_| "server thread panicked")?;
    let qp = qp.map_err(e("connect"))?;
    let (srv, srv_req_data) = srv?;
    let cli_negotiated = qp.negotiated();
    Ok(Pair {
        srv,
        cli: Side { pd, cq, ch, qp },
        cli_negotiated,
        srv_req_data,
    })
}

const LEN: usize = 64 * 1024;
const RW: Access = Access::LOCAL_WRITE
    .union(Access::REMOTE_WRITE)
    .union(Access::REMOTE_READ)
    .union(Access::MW_BIND);

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

fn test_connect(ctx: &Context, ip: IpAddr) -> R<()> {
    let p = pair(ctx, ip)?;
    if p.srv_req_data != b"hello-from-client" {
        return Err(format!("server got private data {:?}", p.srv_req_data));
    }
    if p.cli_negotiated.peer_private_data != b"hello-from-server" {
        return Err(format!("client got private data {:?}", p.cli_negotiated));
    }
    println!(
        "  client negotiated {:?}; server negotiated {:?}; states {:?}/{:?}; {} -> {}",
        p.cli_negotiated,
        p.srv.qp.negotiated(),
        p.cli.qp.state(),
        p.srv.qp.state(),
        p.cli.qp.local_addr(),
        p.cli.qp.peer_addr()
    );
    if p.cli.qp.state() != QpState::Rts || p.srv.qp.state() != QpState::Rts {
        return Err("QPs not in RTS after connect".into());
    }
    Ok(())
}

fn test_send_recv_write_read(ctx: &Context, ip: IpAddr) -> Vec<(&'static str, R<()>)> {
    let mut res = Vec::new();
    let p = match pair(ctx, ip) {
        Ok(p) => p,
        Err(err) => return vec![("send/recv", Err(err))],
    };
    let run = || -> R<(Mr, Mr)> {
        let smr = p.srv.pd.alloc_mr(LEN, RW).map_err(e("server mr"))?;
        let cmr = p.cli.pd.alloc_mr(LEN, RW).map_err(e("client mr"))?;
        Ok((smr, cmr))
    };
    let (smr, cmr) = match run() {
        Ok(x) => x,
        Err(err) => return vec![("send/recv", Err(err))],
    };
    // send/recv
    res.push((
        "send/recv",
        (|| {
            let data = pattern(1, 4096);
            cmr.write_at(0, &data).map_err(e("write_at"))?;
            p.srv
                .qp
                .post_recv(&[RecvWr {
                    wr_id: 11,
                    sg_list: &[smr.sge(0, 8192)],
                }])
                .map_err(e("post_recv"))?;
            p.cli
                .qp
                .post_send(&[SendWr::new(12, SendOp::Send, &[cmr.sge(0, 4096)])])
                .map_err(e("post_send"))?;
            expect_ok(wait_one(&p.cli.cq, None, 10)?, WcOpcode::Send, 12)?;
            let wc = expect_ok(
                wait_one(&p.srv.cq, Some(&p.srv.ch), 10)?,
                WcOpcode::Recv,
                11,
            )?;
            if wc.byte_len != 4096 {
                return Err(format!("recv byte_len {}", wc.byte_len));
            }
            expect_bytes(&smr, 0, &data, "received data differs")
        })(),
    ));
    // RDMA Write
    res.push((
        "rdma write",
        (|| {
            let data = pattern(2, LEN / 2);
            cmr.write_at(0, &data).map_err(e("write_at"))?;
            p.cli
                .qp
                .post_send(&[SendWr::new(
                    21,
                    SendOp::Write {
                        remote_addr: smr.addr() + 100,
                        rkey: smr.rkey(),
                    },
                    &[cmr.sge(0, (LEN / 2) as u32)],
                )])
                .map_err(e("post_send"))?;
            expect_ok(wait_one(&p.cli.cq, None, 10)?, WcOpcode::RdmaWrite, 21)?;
            expect_bytes(&smr, 100, &data, "written data differs")
        })(),
    ));
    // RDMA Read
    res.push((
        "rdma read",
        (|| {
            let data = pattern(3, LEN / 4);
            smr.write_at(LEN / 2, &data).map_err(e("write_at"))?;
            cmr.fill(0, LEN, 0).map_err(e("fill"))?;
            p.cli
                .qp
                .post_send(&[SendWr::new(
                    31,
                    SendOp::Read {
                        remote_addr: smr.addr() + (LEN / 2) as u64,
                        rkey: smr.rkey(),
                    },
                    &[cmr.sge(8, (LEN / 4) as u32)],
                )])
                .map_err(e("post_send"))?;
            let wc = expect_ok(wait_one(&p.cli.cq, None, 10)?, WcOpcode::RdmaRead, 31)?;
            if wc.byte_len != (LEN / 4) as u32 {
                return Err(format!("read byte_len {}", wc.byte_len));
            }
            expect_bytes(&cmr, 8, &data, "read data differs")
        })(),
    ));
    // Unsignaled write followed by a signaled one, then a disconnect flush
    res.push((
        "disconnect flushes posted receives",
        (|| {
            for i in 0..3 {
                p.srv
                    .qp
                    .post_recv(&[RecvWr {
                        wr_id: 40 + i,
                        sg_list: &[smr.sge(0, 64)],
                    }])
                    .map_err(e("post_recv"))?;
            }
            p.cli.qp.disconnect().map_err(e("disconnect"))?;
            for i in 0..3 {
                let wc = wait_one(&p.srv.cq, Some(&p.srv.ch), 10)?;
                if wc.status != WcStatus::WrFlushErr || wc.wr_id != 40 + i {
                    return Err(format!("expected flush of #{}, got {wc:?}", 40 + i));
                }
                if wc.opcode != WcOpcode::Recv {
                    return Err(format!("flushed receive has opcode {:?}", wc.opcode));
                }
            }
            let t0 = Instant::now();
            while p.srv.qp.state() != QpState::Error {
                if t0.elapsed() > Duration::from_secs(5) {
                    return Err(format!("server QP state {:?}", p.srv.qp.state()));
                }
                thread::sleep(Duration::from_millis(10));
            }
            // posting after the error completes as flushed
            p.srv
                .qp
                .post_recv(&[RecvWr {
                    wr_id: 49,
                    sg_list: &[smr.sge(0, 64)],
                }])
                .map_err(e("post_recv after error"))?;
            let wc = wait_one(&p.srv.cq, Some(&p.srv.ch), 10)?;
            if wc.status != WcStatus::WrFlushErr || wc.wr_id != 49 {
                return Err(format!("post after error: got {wc:?}"));
            }
            Ok(())
        })(),
    ));
    res
}

fn test_window(ctx: &Context, ip: IpAddr, caps: &DeviceCaps) -> Vec<(&'static str, R<()>)> {
    let mut res = Vec::new();
    let p = match pair(ctx, ip) {
        Ok(p) => p,
        Err(err) => return vec![("window bind", Err(err))],
    };
    let go = || -> R<(Mr, Mr, Mw)> {
        let smr = p.srv.pd.alloc_mr(LEN, RW).map_err(e("server mr"))?;
        let cmr = p.cli.pd.alloc_mr(LEN, RW).map_err(e("client mr"))?;
        let mw = p.srv.pd.alloc_mw().map_err(e("alloc_mw"))?;
        Ok((smr, cmr, mw))
    };
    let (smr, cmr, mw) = match go() {
        Ok(x) => x,
        Err(err) => return vec![("window bind", Err(err))],
    };
    println!(
        "  window kind {:?} (caps say {:?})",
        mw.kind(),
        caps.mw_kind
    );
    let bound = (|| -> R<u32> {
        let rkey = p
            .srv
            .qp
            .bind_mw(
                &mw,
                &MwBind {
                    mr: &smr,
                    offset: 4096,
                    length: 8192,
                    access: Access::REMOTE_WRITE | Access::REMOTE_READ,
                    one_shot: false,
                },
                51,
                true,
            )
            .map_err(e("bind_mw"))?;
        expect_ok(
            wait_one(&p.srv.cq, Some(&p.srv.ch), 10)?,
            WcOpcode::BindMw,
            51,
        )?;
        // write through the window
        let data = pattern(5, 8192);
        cmr.write_at(0, &data).map_err(e("write_at"))?;
        p.cli
            .qp
            .post_send(&[SendWr::new(
                52,
                SendOp::Write {
                    remote_addr: smr.addr() + 4096,
                    rkey,
                },
                &[cmr.sge(0, 8192)],
            )])
            .map_err(e("post_send"))?;
        expect_ok(wait_one(&p.cli.cq, None, 10)?, WcOpcode::RdmaWrite, 52)?;
        expect_bytes(&smr, 4096, &data, "data written through the window differs")?;
        // read back through the window
        cmr.fill(0, 8192, 0).map_err(e("fill"))?;
        p.cli
            .qp
            .post_send(&[SendWr::new(
                53,
                SendOp::Read {
                    remote_addr: smr.addr() + 4096,
                    rkey,
                },
                &[cmr.sge(0, 8192)],
            )])
            .map_err(e("post_send"))?;
        expect_ok(wait_one(&p.cli.cq, None, 10)?, WcOpcode::RdmaRead, 53)?;
        expect_bytes(&cmr, 0, &data, "data read through the window differs")?;
        Ok(rkey)
    })();
    let rkey = match bound {
        Ok(k) => {
            res.push(("window bind + write/read through it", Ok(())));
            k
        }
        Err(err) => {
            res.push(("window bind + write/read through it", Err(err)));
            return res;
        }
    };
    if caps.send_with_invalidate {
        res.push((
            "send with invalidate",
            (|| {
                p.srv
                    .qp
                    .post_recv(&[RecvWr {
                        wr_id: 61,
                        sg_list: &[smr.sge(0, 64)],
                    }])
                    .map_err(e("post_recv"))?;
                p.cli
                    .qp
                    .post_send(&[SendWr::new(
                        62,
                        SendOp::SendWithInvalidate { rkey },
                        &[cmr.sge(0, 16)],
                    )])
                    .map_err(e("post_send"))?;
                expect_ok(wait_one(&p.cli.cq, None, 10)?, WcOpcode::Send, 62)?;
                let wc = expect_ok(
                    wait_one(&p.srv.cq, Some(&p.srv.ch), 10)?,
                    WcOpcode::Recv,
                    61,
                )?;
                if wc.invalidated_rkey != Some(rkey) {
                    if wc.invalidated_rkey.is_none()
                        && caps.mw_kind == MwKind::PerRequestRegistration
                    {
                        // libsiw does not report IBV_WC_WITH_INV (rdma-core 44..)
                        println!("  note: invalidated_rkey not reported by this device's library");
                    } else {
                        return Err(format!(
                            "invalidated_rkey {:?}, want {rkey:#x}",
                            wc.invalidated_rkey
                        ));
                    }
                }
                // the key is dead now: a write through it must be refused
                let before = smr.load_u64(4096).map_err(e("load"))?;
                cmr.fill(100, 8, 0xee).map_err(e("fill"))?;
                let seen = expect_refused(
                    &p.cli.qp,
                    &p.cli.cq,
                    SendWr::new(
                        63,
                        SendOp::Write {
                            remote_addr: smr.addr() + 4096,
                            rkey,
                        },
                        &[cmr.sge(100, 8)],
                    ),
                    SendWr::new(
                        64,
                        SendOp::Read {
                            remote_addr: smr.addr(),
                            rkey: smr.rkey(),
                        },
                        &[cmr.sge(200, 8)],
                    ),
                )?;
                println!("  write through the invalidated key: {seen}");
                if smr.load_u64(4096).map_err(e("load"))? != before {
                    return Err("target memory changed".into());
                }
                Ok(())
            })(),
        ));
    } else {
        println!("SKIP send with invalidate (device lacks it)");
    }
    res
}

fn test_window_invalidate(ctx: &Context, ip: IpAddr) -> R<()> {
    let p = pair(ctx, ip)?;
    let smr = p.srv.pd.alloc_mr(LEN, RW).map_err(e("server mr"))?;
    let cmr = p.cli.pd.alloc_mr(LEN, RW).map_err(e("client mr"))?;
    let mw = p.srv.pd.alloc_mw().map_err(e("alloc_mw"))?;
    let rkey = p
        .srv
        .qp
        .bind_mw(
            &mw,
            &MwBind {
                mr: &smr,
                offset: 0,
                length: 4096,
                access: Access::REMOTE_WRITE,
                one_shot: false,
            },
            71,
            false,
        )
        .map_err(e("bind_mw"))?;
    p.srv
        .qp
        .invalidate(rkey, 72, true)
        .map_err(e("invalidate"))?;
    let wc = wait_one(&p.srv.cq, Some(&p.srv.ch), 10)?;
    expect_ok(wc, WcOpcode::LocalInv, 72)?;
    cmr.fill(0, 64, 0xee).map_err(e("fill"))?;
    let seen = expect_refused(
        &p.cli.qp,
        &p.cli.cq,
        SendWr::new(
            73,
            SendOp::Write {
                remote_addr: smr.addr(),
                rkey,
            },
            &[cmr.sge(0, 64)],
        ),
        SendWr::new(
            74,
            SendOp::Read {
                remote_addr: smr.addr() + 8192,
                rkey: smr.rkey(),
            },
            &[cmr.sge(128, 8)],
        ),
    )?;
    expect_bytes(&smr, 0, &[0u8; 64], "target memory changed")?;
    println!("  write after local invalidate: {seen}");
    Ok(())
}

/// A window must confine the peer to its range at byte granularity.
fn test_window_bounds(ctx: &Context, ip: IpAddr) -> R<()> {
    let p = pair(ctx, ip)?;
    let smr = p.srv.pd.alloc_mr(LEN, RW).map_err(e("server mr"))?;
    let cmr = p.cli.pd.alloc_mr(LEN, RW).map_err(e("client mr"))?;
    let mw = p.srv.pd.alloc_mw().map_err(e("alloc_mw"))?;
    let (off, len) = (4093u64, 1001u64);
    let rkey = p
        .srv
        .qp
        .bind_mw(
            &mw,
            &MwBind {
                mr: &smr,
                offset: off,
                length: len,
                access: Access::REMOTE_WRITE | Access::REMOTE_READ,
                one_shot: false,
            },
            91,
            true,
        )
        .map_err(e("bind_mw"))?;
    expect_ok(
        wait_one(&p.srv.cq, Some(&p.srv.ch), 10)?,
        WcOpcode::BindMw,
        91,
    )?;
    // exactly the window: fine
    cmr.fill(0, 2048, 0x77).map_err(e("fill"))?;
    p.cli
        .qp
        .post_send(&[SendWr::new(
            92,
            SendOp::Write {
                remote_addr: smr.addr() + off,
                rkey,
            },
            &[cmr.sge(0, len as u32)],
        )])
        .map_err(e("post_send"))?;
    expect_ok(wait_one(&p.cli.cq, None, 10)?, WcOpcode::RdmaWrite, 92)?;
    // one byte more: refused, and nothing beyond the window is written
    let edge = (off + len) as usize;
    let before = {
        let mut b = [0u8; 1];
        smr.read_at(edge, &mut b).map_err(e("read_at"))?;
        b[0]
    };
    let seen = expect_refused(
        &p.cli.qp,
        &p.cli.cq,
        SendWr::new(
            93,
            SendOp::Write {
                remote_addr: smr.addr() + off,
                rkey,
            },
            &[cmr.sge(0, len as u32 + 1)],
        ),
        SendWr::new(
            94,
            SendOp::Read {
                remote_addr: smr.addr() + off,
                rkey,
            },
            &[cmr.sge(4096, 8)],
        ),
    )?;
    println!("  write one byte past the window: {seen}");
    let mut b = [0u8; 1];
    smr.read_at(edge, &mut b).map_err(e("read_at"))?;
    if b[0] != before {
        return Err("the byte after the window was written".into());
    }
    Ok(())
}

fn test_protection(ctx: &Context, ip: IpAddr) -> R<()> {
    let p = pair(ctx, ip)?;
    let smr = p.srv.pd.alloc_mr(LEN, RW).map_err(e("server mr"))?;
    let cmr = p.cli.pd.alloc_mr(LEN, RW).map_err(e("client mr"))?;
    cmr.fill(0, 4096, 0x5a).map_err(e("fill"))?;
    p.srv
        .qp
        .post_recv(&[RecvWr {
            wr_id: 81,
            sg_list: &[smr.sge(8192, 64)],
        }])
        .map_err(e("post_recv"))?;
    let bad = smr.rkey() ^ 0x5500;
    let seen = expect_refused(
        &p.cli.qp,
        &p.cli.cq,
        SendWr::new(
            82,
            SendOp::Write {
                remote_addr: smr.addr(),
                rkey: bad,
            },
            &[cmr.sge(0, 4096)],
        ),
        SendWr::new(
            83,
            SendOp::Read {
                remote_addr: smr.addr() + 16384,
                rkey: smr.rkey(),
            },
            &[cmr.sge(8192, 8)],
        ),
    )?;
    println!("  wrong rkey: {seen}");
    expect_bytes(&smr, 0, &[0u8; 4096], "target memory changed")?;
    // the server's QP fails too (iWARP: Terminate; IB: NAK): its receive flushes
    match wait_one(&p.srv.cq, Some(&p.srv.ch), 10) {
        Ok(wc) => println!("  server side: {:?} #{}", wc.status, wc.wr_id),
        Err(err) => println!("  server side: {err}"),
    }
    Ok(())
}

fn test_reject(ctx: &Context, ip: IpAddr) -> R<()> {
    let addr = next_addr(ip);
    let listener = ctx.listen(addr, 8).map_err(e("listen"))?;
    let server = thread::spawn(move || -> R<()> {
        let req = listener
            .get_request(Some(Duration::from_secs(20)))
            .map_err(e("get_request"))?
            .ok_or("no request")?;
        if req.private_data() != b"let-me-in" {
            return Err(format!("request private data {:?}", req.private_data()));
        }
        req.reject(b"go-away").map_err(e("reject"))
    });
    let pd = ctx.alloc_pd().map_err(e("pd"))?;
    let cq = ctx.create_cq(16, None).map_err(e("cq"))?;
    let r = ctx.connect(
        addr,
        &qp_init(&pd, &cq),
        &ConnParams {
            private_data: b"let-me-in".to_vec(),
            ird: 0,
            ord: 0,
        },
    );
    server.join().map_err(|_| "server panicked")??;
    match r {
        Err(Error::Rejected { private_data }) if private_data == b"go-away" => Ok(()),
        Err(other) => Err(format!("connect: {other:?}")),
        Ok(_) => Err("connect succeeded".into()),
    }
}

fn test_no_listener(ctx: &Context, ip: IpAddr) -> R<()> {
    let addr = next_addr(ip);
    let pd = ctx.alloc_pd().map_err(e("pd"))?;
    let cq = ctx.create_cq(16, None).map_err(e("cq"))?;
    match ctx.connect(addr, &qp_init(&pd, &cq), &ConnParams::default()) {
        Ok(_) => Err("connected to nobody".into()),
        Err(err) => {
            println!("  connect to a port nobody listens on: {err:?}");
            Ok(())
        }
    }
}

/// Receives posted with `accept_with_recvs` / `connect_with_recvs`: the
/// client sends the moment its connect returns, which the server's receive
/// must catch (on iWARP a Send that finds no receive kills the connection);
/// the server's reply lands in the client's pre-posted receive.
fn test_prepost(ctx: &Context, ip: IpAddr) -> R<()> {
    let addr = next_addr(ip);
    let listener = ctx.listen(addr, 8).map_err(e("listen"))?;
    let sctx = ctx.clone();
    let server = thread::spawn(move || -> R<()> {
        let req = listener
            .get_request(Some(Duration::from_secs(20)))
            .map_err(e("get_request"))?
            .ok_or("no request")?;
        let pd = sctx.alloc_pd().map_err(e("pd"))?;
        let cq = sctx.create_cq(64, None).map_err(e("cq"))?;
        let mr = pd.alloc_mr(4096, RW).map_err(e("mr"))?;
        let qp = req
            .accept_with_recvs(
                &qp_init(&pd, &cq),
                &ConnParams::default(),
                &[RecvWr {
                    wr_id: 101,
                    sg_list: &[mr.sge(0, 64)],
                }],
            )
            .map_err(e("accept_with_recvs"))?;
        // The client's Send must find the receive posted above. (The server
        // answers only then: MPA forbids the responder to send before the
        // initiator's first FPDU unless peer-to-peer mode is negotiated.)
        let recv = wait_one(&cq, None, 10)?;
        if !recv.is_ok() || recv.wr_id != 101 {
            return Err(format!("server completion {recv:?}"));
        }
        let mut b = vec![0u8; recv.byte_len as usize];
        mr.read_at(0, &mut b).map_err(e("read_at"))?;
        if b != b"client-first" {
            return Err(format!("server received {b:?}"));
        }
        mr.write_at(64, b"server-reply").map_err(e("write_at"))?;
        qp.post_send(&[SendWr::new(102, SendOp::Send, &[mr.sge(64, 12)])])
            .map_err(e("post_send"))?;
        expect_ok(wait_one(&cq, None, 10)?, WcOpcode::Send, 102)?;
        thread::sleep(Duration::from_millis(200));
        Ok(())
    });
    let pd = ctx.alloc_pd().map_err(e("pd"))?;
    let cq = ctx.create_cq(64, None).map_err(e("cq"))?;
    let mr = pd.alloc_mr(4096, RW).map_err(e("mr"))?;
    let qp = ctx
        .connect_with_recvs(
            addr,
            &qp_init(&pd, &cq),
            &ConnParams::default(),
            &[RecvWr {
                wr_id: 201,
                sg_list: &[mr.sge(0, 64)],
            }],
        )
        .map_err(e("connect_with_recvs"))?;
    mr.write_at(64, b"client-first").map_err(e("write_at"))?;
    qp.post_send(&[SendWr::new(202, SendOp::Send, &[mr.sge(64, 12)])])
        .map_err(e("post_send"))?;
    let mut got = Vec::new();
    while got.len() < 2 {
        got.push(wait_one(&cq, None, 10)?);
    }
    server.join().map_err(|_| "server panicked")??;
    for wc in &got {
        if !wc.is_ok() {
            return Err(format!("client completion {wc:?}"));
        }
    }
    let recv = got
        .iter()
        .find(|w| w.wr_id == 201)
        .ok_or("no receive completion")?;
    let mut b = vec![0u8; recv.byte_len as usize];
    mr.read_at(0, &mut b).map_err(e("read_at"))?;
    if b != b"server-reply" {
        return Err(format!("client received {b:?}"));
    }
    Ok(())
}

/// With two devices (`OTHER_IP` = an address of another RDMA device), a
/// connect through this context to that address must fail clearly.
fn test_other_device(ctx: &Context, other: IpAddr) -> R<()> {
    let pd = ctx.alloc_pd().map_err(e("pd"))?;
    let cq = ctx.create_cq(16, None).map_err(e("cq"))?;
    match ctx.connect(next_addr(other), &qp_init(&pd, &cq), &ConnParams::default()) {
        Err(Error::InvalidArgument(m)) => {
            println!("  {m}");
            Ok(())
        }
        Err(other) => Err(format!("expected InvalidArgument, got {other:?}")),
        Ok(_) => Err("connected through the wrong device".into()),
    }
}

fn main() {
    let prov = lwio_rdma::provider("verbs").expect("verbs provider compiled in");
    println!("verbs devices:");
    for d in prov.devices() {
        println!(
            "  {} {} {:?} usable={:?}\n    caps={:?}",
            d.name, d.transport, d.addresses, d.usable, d.caps
        );
    }
    let Ok(dev) = std::env::var("RDMA_DEV") else {
        println!("RDMA_DEV not set: nothing to test");
        println!("0 passed, 0 failed");
        return;
    };
    let ip: IpAddr = std::env::var("RDMA_IP")
        .unwrap_or_else(|_| "127.0.0.1".into())
        .parse()
        .expect("RDMA_IP is an IP address");
    let port: u16 = std::env::var("SMOKE_PORT")
        .ok()
        .and_then(|p| p.parse().ok())
        .unwrap_or(7471);
    PORT.store(port, Ordering::Relaxed);
    let ctx = match prov.open(Some(&dev), &Config::default()) {
        Ok(c) => c,
        Err(err) => {
            println!("FAIL open {dev}: {err}");
            println!("0 passed, 1 failed");
            std::process::exit(1);
        }
    };
    let caps = ctx.device().caps.clone().expect("caps");
    println!(
        "opened {dev} ({}), mw_kind={:?}",
        ctx.device().transport,
        caps.mw_kind
    );
    let (mut pass, mut fail) = (0, 0);
    let mut report = |v: Vec<(&'static str, R<()>)>| {
        for (name, r) in v {
            match r {
                Ok(()) => {
                    pass += 1;
                    println!("PASS {name}");
                }
                Err(err) => {
                    fail += 1;
                    println!("FAIL {name}: {err}");
                }
            }
        }
    };
    report(vec![("connect with private data", test_connect(&ctx, ip))]);
    report(test_send_recv_write_read(&ctx, ip));
    report(vec![(
        "receives posted before connect/accept catch an immediate send",
        test_prepost(&ctx, ip),
    )]);
    report(test_window(&ctx, ip, &caps));
    report(vec![(
        "window confines the peer (byte granularity)",
        test_window_bounds(&ctx, ip),
    )]);
    report(vec![(
        "window local invalidate",
        test_window_invalidate(&ctx, ip),
    )]);
    report(vec![(
        "protection failure (wrong rkey)",
        test_protection(&ctx, ip),
    )]);
    report(vec![("reject with private data", test_reject(&ctx, ip))]);
    report(vec![(
        "connect without listener fails",
        test_no_listener(&ctx, ip),
    )]);
    if let Some(other) = std::env::var("OTHER_IP")
        .ok()
        .and_then(|v| v.parse::<IpAddr>().ok())
    {
        report(vec![(
            "address of another device is refused",
            test_other_device(&ctx, other),
        )]);
    }
    println!("{pass} passed, {fail} failed");
    std::process::exit(if fail == 0 { 0 } else { 1 });
}
