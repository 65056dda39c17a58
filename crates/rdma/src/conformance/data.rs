//! Data operations: Send, RDMA Write and Read of every size, Write with
//! immediate, SGE lists, ordering, post lists, unsignaled work, flushes.

use super::*;

pub(super) fn case_send_sizes(env: &Env<'_>) -> R {
    let c = env.connect(&params(b""), &params(b""))?;
    let smr = c.s.pd.alloc_mr(MAXSZ + GUARD, Access::LOCAL_WRITE)?;
    let cmr = c.c.pd.alloc_mr(MAXSZ, Access::LOCAL_WRITE)?;
    for (i, &size) in SIZES.iter().enumerate() {
        let data = pattern(i as u64 + 1, size);
        cmr.write_at(0, &data)?;
        smr.fill(0, size + GUARD, 0xEE)?;
        c.s.qp.post_recv(&[RecvWr {
            wr_id: 100 + i as u64,
            sg_list: &[smr.sge(0, (size + GUARD) as u32)],
        }])?;
        c.c.qp
            .post_send(&[send_wr(i as u64, SendOp::Send, &[cmr.sge(0, size as u32)])])?;
        let w = env.wait(&c.c.cq, 1)?;
        check_ok(&w[0], i as u64, WcOpcode::Send).map_err(|e| format!("size {size}: {e}"))?;
        let r = env.wait(&c.s.cq, 1)?;
        check_ok(&r[0], 100 + i as u64, WcOpcode::Recv).map_err(|e| format!("size {size}: {e}"))?;
        ensure!(
            r[0].byte_len as usize == size,
            "size {size}: byte_len {}",
            r[0].byte_len
        );
        guarded(&smr, 0, &data)?;
    }
    Ok(())
}

pub(super) fn need_send_inv(env: &Env<'_>) -> R {
    let ok = |c: &Context| {
        c.device()
            .caps
            .as_ref()
            .is_some_and(|c| c.send_with_invalidate)
    };
    if !ok(env.server) || !ok(env.client) {
        return Err(CaseErr::Skip("device lacks Send with Invalidate".into()));
    }
    Ok(())
}

pub(super) fn case_send_inv_sizes(env: &Env<'_>) -> R {
    need_send_inv(env)?;
    let c = env.connect(&params(b""), &params(b""))?;
    let smr = c.s.pd.alloc_mr(MAXSZ + GUARD, Access::LOCAL_WRITE)?;
    let wmr = c.s.pd.alloc_mr(4096, RW | Access::MW_BIND)?;
    let mw = c.s.pd.alloc_mw()?;
    let cmr = c.c.pd.alloc_mr(MAXSZ, Access::LOCAL_WRITE)?;
    for (i, &size) in SIZES.iter().enumerate() {
        let key = c.s.qp.bind_mw(
            &mw,
            &MwBind {
                mr: &wmr,
                offset: 0,
                length: 4096,
                access: Access::REMOTE_WRITE,
                one_shot: false,
            },
            900,
            false,
        )?;
        let data = pattern(i as u64 + 7, size);
        cmr.write_at(0, &data)?;
        smr.fill(0, size + GUARD, 0xEE)?;
        c.s.qp.post_recv(&[RecvWr {
            wr_id: i as u64,
            sg_list: &[smr.sge(0, (size + GUARD) as u32)],
        }])?;
        c.c.qp.post_send(&[send_wr(
            i as u64,
            SendOp::SendWithInvalidate { rkey: key },
            &[cmr.sge(0, size as u32)],
        )])?;
        let w = env.wait(&c.c.cq, 1)?;
        check_ok(&w[0], i as u64, WcOpcode::Send).map_err(|e| format!("size {size}: {e}"))?;
        let r = env.wait(&c.s.cq, 1)?;
        check_ok(&r[0], i as u64, WcOpcode::Recv).map_err(|e| format!("size {size}: {e}"))?;
        ensure!(
            r[0].byte_len as usize == size,
            "size {size}: byte_len {}",
            r[0].byte_len
        );
        ensure!(
            r[0].invalidated_rkey == Some(key),
            "size {size}: invalidated_rkey {:?}, want {key:#x}",
            r[0].invalidated_rkey
        );
        guarded(&smr, 0, &data)?;
    }
    Ok(())
}

/// Post a zero-byte send from the client and wait for it at the server
/// (everything the client posted before is then placed).
pub(super) fn sync_send(env: &Env<'_>, c: &Conn, wr_id: u64) -> R {
    c.s.qp.post_recv(&[RecvWr {
        wr_id,
        sg_list: &[],
    }])?;
    c.c.qp.post_send(&[send_wr(wr_id, SendOp::Send, &[])])?;
    let w = env.wait(&c.c.cq, 1)?;
    check_ok(&w[0], wr_id, WcOpcode::Send)?;
    let r = env.wait(&c.s.cq, 1)?;
    check_ok(&r[0], wr_id, WcOpcode::Recv)?;
    Ok(())
}

pub(super) fn case_write_sizes(env: &Env<'_>) -> R {
    let c = env.connect(&params(b""), &params(b""))?;
    let smr = c.s.pd.alloc_mr(MAXSZ + 2 * GUARD, RW)?;
    let cmr = c.c.pd.alloc_mr(MAXSZ, Access::LOCAL_WRITE)?;
    for (i, &size) in SIZES.iter().enumerate() {
        let data = pattern(i as u64 + 11, size);
        cmr.write_at(0, &data)?;
        smr.fill(0, size + 2 * GUARD, 0xEE)?;
        c.c.qp.post_send(&[send_wr(
            i as u64,
            SendOp::Write {
                remote_addr: smr.addr() + GUARD as u64,
                rkey: smr.rkey(),
            },
            &[cmr.sge(0, size as u32)],
        )])?;
        let w = env.wait(&c.c.cq, 1)?;
        check_ok(&w[0], i as u64, WcOpcode::RdmaWrite).map_err(|e| format!("size {size}: {e}"))?;
        sync_send(env, &c, 1000 + i as u64)?;
        guarded(&smr, GUARD, &data)?;
    }
    Ok(())
}

pub(super) fn case_read_sizes(env: &Env<'_>) -> R {
    let c = env.connect(&params(b""), &params(b""))?;
    let smr =
        c.s.pd
            .alloc_mr(MAXSZ, Access::LOCAL_WRITE | Access::REMOTE_READ)?;
    let cmr = c.c.pd.alloc_mr(MAXSZ + 2 * GUARD, Access::LOCAL_WRITE)?;
    for (i, &size) in SIZES.iter().enumerate() {
        let data = pattern(i as u64 + 21, size);
        smr.write_at(0, &data)?;
        cmr.fill(0, size + 2 * GUARD, 0xEE)?;
        c.c.qp.post_send(&[send_wr(
            i as u64,
            SendOp::Read {
                remote_addr: smr.addr(),
                rkey: smr.rkey(),
            },
            &[cmr.sge(GUARD, size as u32)],
        )])?;
        let w = env.wait(&c.c.cq, 1)?;
        check_ok(&w[0], i as u64, WcOpcode::RdmaRead).map_err(|e| format!("size {size}: {e}"))?;
        guarded(&cmr, GUARD, &data)?;
    }
    Ok(())
}

pub(super) fn case_write_imm(env: &Env<'_>) -> R {
    let ok = |c: &Context| c.device().caps.as_ref().is_some_and(|c| c.write_with_imm);
    if !ok(env.server) || !ok(env.client) {
        return Err(CaseErr::Skip("caps.write_with_imm is false".into()));
    }
    let c = env.connect(&params(b""), &params(b""))?;
    let smr = c.s.pd.alloc_mr(MAXSZ, RW)?;
    let cmr = c.c.pd.alloc_mr(MAXSZ, Access::LOCAL_WRITE)?;
    for (i, &size) in SIZES.iter().enumerate() {
        let data = pattern(i as u64 + 31, size);
        cmr.write_at(0, &data)?;
        c.s.qp.post_recv(&[RecvWr {
            wr_id: i as u64,
            sg_list: &[],
        }])?;
        c.c.qp.post_send(&[send_wr(
            i as u64,
            SendOp::WriteWithImm {
                remote_addr: smr.addr(),
                rkey: smr.rkey(),
                imm: 0xABCD_0000 + i as u32,
            },
            &[cmr.sge(0, size as u32)],
        )])?;
        env.wait(&c.c.cq, 1)?;
        let r = env.wait(&c.s.cq, 1)?;
        ensure!(
            r[0].is_ok()
                && r[0].opcode == WcOpcode::RecvRdmaWithImm
                && r[0].imm == Some(0xABCD_0000 + i as u32),
            "size {size}: {:?}",
            r[0]
        );
        cmp(&format!("size {size} data"), &read_mr(&smr, 0, size), &data)?;
    }
    Ok(())
}

pub(super) fn case_multi_sge(env: &Env<'_>) -> R {
    let c = env.connect(&params(b""), &params(b""))?;
    let smr = c.s.pd.alloc_mr(256 * 1024, Access::LOCAL_WRITE)?;
    let cmr = c.c.pd.alloc_mr(256 * 1024, Access::LOCAL_WRITE)?;
    let data = pattern(5, 150_001);
    cmr.write_at(0, &data[..50_000])?;
    cmr.write_at(100_000, &data[50_000..])?;
    smr.fill(0, 256 * 1024, 0xEE)?;
    // Receive into three pieces: [0, 7), [1000, 1000+100000), [200000, 200000+60000).
    c.s.qp.post_recv(&[RecvWr {
        wr_id: 1,
        sg_list: &[
            smr.sge(0, 7),
            smr.sge(1000, 100_000),
            smr.sge(200_000, 60_000),
        ],
    }])?;
    c.c.qp.post_send(&[send_wr(
        1,
        SendOp::Send,
        &[cmr.sge(0, 50_000), cmr.sge(100_000, 100_001)],
    )])?;
    env.wait(&c.c.cq, 1)?;
    let r = env.wait(&c.s.cq, 1)?;
    check_ok(&r[0], 1, WcOpcode::Recv)?;
    ensure!(r[0].byte_len == 150_001, "byte_len {}", r[0].byte_len);
    let mut got = read_mr(&smr, 0, 7);
    got.extend(read_mr(&smr, 1000, 100_000));
    got.extend(read_mr(&smr, 200_000, 150_001 - 100_007));
    cmp("scattered data", &got, &data)?;
    cmp("gap", &read_mr(&smr, 7, 993), &[0xEE; 993])?;
    Ok(())
}

pub(super) fn case_ordering(env: &Env<'_>) -> R {
    let c = env.connect(&params(b""), &params(b""))?;
    const N: usize = 200;
    let slot = 8192;
    let smr = c.s.pd.alloc_mr(N * slot, Access::LOCAL_WRITE)?;
    let cmr = c.c.pd.alloc_mr(N * slot, Access::LOCAL_WRITE)?;
    let sizes: Vec<usize> = (0..N).map(|i| (i * 977) % slot).collect();
    for (i, s) in sizes.iter().enumerate() {
        cmr.write_at(i * slot, &pattern(i as u64 + 100, *s))?;
        c.s.qp.post_recv(&[RecvWr {
            wr_id: i as u64,
            sg_list: &[smr.sge(i * slot, slot as u32)],
        }])?;
    }
    for (i, s) in sizes.iter().enumerate() {
        c.c.qp.post_send(&[send_wr(
            i as u64,
            SendOp::Send,
            &[cmr.sge(i * slot, *s as u32)],
        )])?;
        if i % 64 == 63 {
            // Keep the send queue within its depth.
            let w = env.wait(&c.c.cq, 64)?;
            for (k, w) in w.iter().enumerate() {
                check_ok(w, (i + 1 - 64 + k) as u64, WcOpcode::Send)?;
            }
        }
    }
    env.wait(&c.c.cq, N % 64)?;
    let r = env.wait(&c.s.cq, N)?;
    for (i, w) in r.iter().enumerate() {
        check_ok(w, i as u64, WcOpcode::Recv).map_err(|e| format!("completion {i}: {e}"))?;
        ensure!(
            w.byte_len as usize == sizes[i],
            "message {i}: byte_len {}",
            w.byte_len
        );
        cmp(
            &format!("message {i}"),
            &read_mr(&smr, i * slot, sizes[i]),
            &pattern(i as u64 + 100, sizes[i]),
        )?;
    }
    Ok(())
}

pub(super) fn case_send_after_writes(env: &Env<'_>) -> R {
    let c = env.connect(&params(b""), &params(b""))?;
    const K: usize = 32;
    let chunk = 33_333;
    let smr = c.s.pd.alloc_mr(K * chunk, RW)?;
    let cmr = c.c.pd.alloc_mr(K * chunk, Access::LOCAL_WRITE)?;
    let data = pattern(77, K * chunk);
    cmr.write_at(0, &data)?;
    c.s.qp.post_recv(&[RecvWr {
        wr_id: 5,
        sg_list: &[],
    }])?;
    let sges: Vec<Sge> = (0..K).map(|i| cmr.sge(i * chunk, chunk as u32)).collect();
    let mut wrs: Vec<SendWr<'_>> = (0..K)
        .map(|i| {
            let mut w = send_wr(
                i as u64,
                SendOp::Write {
                    remote_addr: smr.addr() + (i * chunk) as u64,
                    rkey: smr.rkey(),
                },
                std::slice::from_ref(&sges[i]),
            );
            w.signaled = false;
            w
        })
        .collect();
    wrs.push(send_wr(99, SendOp::Send, &[]));
    c.c.qp.post_send(&wrs)?;
    let r = env.wait(&c.s.cq, 1)?;
    check_ok(&r[0], 5, WcOpcode::Recv)?;
    // The send was placed after every write before it.
    cmp(
        "written data seen at send completion",
        &read_mr(&smr, 0, K * chunk),
        &data,
    )?;
    let w = env.wait(&c.c.cq, 1)?;
    check_ok(&w[0], 99, WcOpcode::Send)?;
    Ok(())
}

pub(super) fn case_post_lists(env: &Env<'_>) -> R {
    let c = env.connect(&params(b""), &params(b""))?;
    const N: usize = 16;
    let smr = c.s.pd.alloc_mr(N * 1024, Access::LOCAL_WRITE)?;
    let cmr = c.c.pd.alloc_mr(N * 1024, Access::LOCAL_WRITE)?;
    let data = pattern(3, N * 1024);
    cmr.write_at(0, &data)?;
    let rs: Vec<Sge> = (0..N).map(|i| smr.sge(i * 1024, 1024)).collect();
    let rwrs: Vec<RecvWr<'_>> = (0..N)
        .map(|i| RecvWr {
            wr_id: i as u64,
            sg_list: std::slice::from_ref(&rs[i]),
        })
        .collect();
    c.s.qp.post_recv(&rwrs)?;
    let ss: Vec<Sge> = (0..N).map(|i| cmr.sge(i * 1024, 1024)).collect();
    let swrs: Vec<SendWr<'_>> = (0..N)
        .map(|i| send_wr(i as u64, SendOp::Send, std::slice::from_ref(&ss[i])))
        .collect();
    c.c.qp.post_send(&swrs)?;
    let w = env.wait(&c.c.cq, N)?;
    for (i, w) in w.iter().enumerate() {
        check_ok(w, i as u64, WcOpcode::Send)?;
    }
    let r = env.wait(&c.s.cq, N)?;
    for (i, w) in r.iter().enumerate() {
        check_ok(w, i as u64, WcOpcode::Recv)?;
    }
    cmp("data", &read_mr(&smr, 0, N * 1024), &data)?;
    Ok(())
}

pub(super) fn case_unsignaled(env: &Env<'_>) -> R {
    let c = env.connect(&params(b""), &params(b""))?;
    let smr = c.s.pd.alloc_mr(10 * 4096, RW)?;
    let cmr = c.c.pd.alloc_mr(10 * 4096, Access::LOCAL_WRITE)?;
    let data = pattern(9, 10 * 4096);
    cmr.write_at(0, &data)?;
    for i in 0..10 {
        let mut w = send_wr(
            i,
            SendOp::Write {
                remote_addr: smr.addr() + i * 4096,
                rkey: smr.rkey(),
            },
            &[],
        );
        let sg = [cmr.sge(i as usize * 4096, 4096)];
        w.sg_list = &sg;
        w.signaled = false;
        c.c.qp.post_send(&[w])?;
    }
    c.s.qp.post_recv(&[RecvWr {
        wr_id: 50,
        sg_list: &[],
    }])?;
    c.c.qp.post_send(&[send_wr(50, SendOp::Send, &[])])?;
    let w = env.wait(&c.c.cq, 1)?;
    check_ok(&w[0], 50, WcOpcode::Send)
        .map_err(|e| format!("only the signalled WR may complete: {e}"))?;
    env.wait(&c.s.cq, 1)?;
    env.quiet(&c.c.cq, Duration::from_millis(50))?;
    cmp(
        "unsignalled writes happened",
        &read_mr(&smr, 0, 10 * 4096),
        &data,
    )?;
    Ok(())
}

pub(super) fn case_flush_set_error(env: &Env<'_>) -> R {
    let c = env.connect(&params(b""), &params(b""))?;
    let cmr = c.c.pd.alloc_mr(64 * 1024, Access::LOCAL_WRITE)?;
    let smr =
        c.s.pd
            .alloc_mr(4096, Access::LOCAL_WRITE | Access::REMOTE_READ)?;
    for i in 0..8u64 {
        c.c.qp.post_recv(&[RecvWr {
            wr_id: 100 + i,
            sg_list: &[cmr.sge(i as usize * 1024, 1024)],
        }])?;
    }
    // Reads stay outstanding until answered; unsignalled too (errors always complete).
    for i in 0..4u64 {
        let mut w = send_wr(
            i,
            SendOp::Read {
                remote_addr: smr.addr(),
                rkey: smr.rkey(),
            },
            &[],
        );
        let sg = [cmr.sge(32 * 1024 + i as usize * 1024, 1024)];
        w.sg_list = &sg;
        w.signaled = i % 2 == 0;
        c.c.qp.post_send(&[w])?;
    }
    c.c.qp.set_error();
    ensure!(
        c.c.qp.state() == QpState::Error,
        "state {:?} after set_error",
        c.c.qp.state()
    );
    // Posts in the error state complete with a flush too.
    c.c.qp.post_recv(&[RecvWr {
        wr_id: 200,
        sg_list: &[cmr.sge(0, 16)],
    }])?;
    c.c.qp
        .post_send(&[send_wr(201, SendOp::Send, &[cmr.sge(0, 16)])])?;
    // 8 receives + up to 4 reads (those already answered may succeed; an
    // answered unsignalled one completes nothing) + 2 late posts.
    let mut got = env.wait(&c.c.cq, 10)?;
    let t = Instant::now();
    let mut buf = [Wc::BLANK; 8];
    while t.elapsed() < Duration::from_millis(200) {
        let k = c.c.cq.poll(&mut buf).map_err(|e| e.to_string())?;
        got.extend_from_slice(&buf[..k]);
        env.progress();
    }
    let recvs: Vec<&Wc> = got.iter().filter(|w| w.opcode == WcOpcode::Recv).collect();
    ensure!(
        recvs.len() == 9,
        "expected 9 receive completions, got {got:?}"
    );
    for r in &recvs {
        ensure!(
            r.status == WcStatus::WrFlushErr,
            "receive not flushed: {r:?}"
        );
    }
    let mut ids: Vec<u64> = recvs.iter().map(|w| w.wr_id).collect();
    ids.sort();
    ensure!(
        ids == [100, 101, 102, 103, 104, 105, 106, 107, 200],
        "receive ids {ids:?}"
    );
    for w in got.iter().filter(|w| w.opcode != WcOpcode::Recv) {
        ensure!(
            w.status == WcStatus::WrFlushErr || (w.status == WcStatus::Success && w.wr_id < 4),
            "send-side completion {w:?}"
        );
    }
    ensure!(
        got.iter()
            .any(|w| w.wr_id == 201 && w.status == WcStatus::WrFlushErr),
        "send posted in error state not flushed: {got:?}"
    );
    Ok(())
}

pub(super) fn case_flush_disconnect(env: &Env<'_>) -> R {
    let c = env.connect(&params(b""), &params(b""))?;
    let smr = c.s.pd.alloc_mr(8 * 1024, Access::LOCAL_WRITE)?;
    for i in 0..8u64 {
        c.s.qp.post_recv(&[RecvWr {
            wr_id: i,
            sg_list: &[smr.sge(i as usize * 1024, 1024)],
        }])?;
    }
    c.c.qp.disconnect()?;
    let r = env.wait(&c.s.cq, 8)?;
    for (i, w) in r.iter().enumerate() {
        ensure!(
            w.status == WcStatus::WrFlushErr && w.opcode == WcOpcode::Recv && w.wr_id == i as u64,
            "receive {i}: {w:?}"
        );
    }
    env.wait_error(&c.s.qp)?;
    Ok(())
}
