//! Protection: wrong keys, other PDs, out-of-bounds access, missing
//! rights (each a violation the responder must detect).

use super::*;

/// What the requester attempts.
pub(super) enum Attempt {
    Write { addr: u64, rkey: u32, len: usize },
    Read { addr: u64, rkey: u32, len: usize },
}

/// Run a forbidden access from the client against server memory `target`
/// (`off..off+len` of it checked unchanged), expecting a Terminate at the
/// server and an error completion at the client. `want_vendor` is checked
/// when both ends are soft.
pub(super) fn expect_violation(
    env: &Env<'_>,
    c: &Conn,
    attempt: Attempt,
    target: &Mr,
    off: usize,
    len: usize,
    want_vendor: u32,
) -> R {
    let before = read_mr(target, off, len);
    // The server has a receive posted: it must be flushed when its QP dies.
    c.s.qp.post_recv(&[RecvWr {
        wr_id: 4242,
        sg_list: &[],
    }])?;
    let cmr = c.c.pd.alloc_mr(1 << 16, Access::LOCAL_WRITE)?;
    cmr.write_at(0, &pattern(0xBAD, 1 << 16))?;
    let probe =
        c.s.pd
            .alloc_mr(64, Access::LOCAL_WRITE | Access::REMOTE_READ)?;
    let mut expected = 1;
    match attempt {
        Attempt::Write { addr, rkey, len } => {
            // RDMA Write completes at the requester once sent; the Read
            // posted with it (one list, so it is outstanding before any
            // Terminate can arrive) is answered only if the write was
            // accepted, so the Terminate's error lands on it.
            let wsg = [cmr.sge(0, len as u32)];
            let rsg = [cmr.sge(0, 8)];
            c.c.qp.post_send(&[
                send_wr(
                    1,
                    SendOp::Write {
                        remote_addr: addr,
                        rkey,
                    },
                    &wsg,
                ),
                send_wr(
                    2,
                    SendOp::Read {
                        remote_addr: probe.addr(),
                        rkey: probe.rkey(),
                    },
                    &rsg,
                ),
            ])?;
            expected = 2;
        }
        Attempt::Read { addr, rkey, len } => {
            c.c.qp.post_send(&[send_wr(
                1,
                SendOp::Read {
                    remote_addr: addr,
                    rkey,
                },
                &[cmr.sge(0, len as u32)],
            )])?;
        }
    }
    let w = env.wait(&c.c.cq, expected)?;
    let errs: Vec<&Wc> = w.iter().filter(|w| !w.is_ok()).collect();
    ensure!(!errs.is_empty(), "the forbidden access succeeded: {w:?}");
    let e = errs[0];
    if env.client.device().provider == "soft" {
        ensure!(
            e.status == WcStatus::RemAccessErr,
            "requester completion {e:?}, want RemAccessErr (server {:?}, client {:?})",
            crate::soft::qp_stats(&c.s.qp),
            crate::soft::qp_stats(&c.c.qp)
        );
    } else {
        ensure!(
            matches!(
                e.status,
                WcStatus::RemAccessErr
                    | WcStatus::RemOpErr
                    | WcStatus::RemInvReqErr
                    | WcStatus::WrFlushErr
                    // siw completes the WR it is still transmitting when the
                    // peer's Terminate + close breaks its socket with
                    // LOC_QP_OP_ERR (siw_qp_sq_process); the memory and
                    // QP-state checks below still apply.
                    | WcStatus::LocQpOpErr
            ),
            "requester completion {e:?}"
        );
    }
    if env.both_soft() {
        ensure!(
            e.vendor_err == want_vendor,
            "Terminate code {:#06x}, want {want_vendor:#06x}",
            e.vendor_err
        );
        let st = crate::soft::qp_stats(&c.s.qp).unwrap_or_default();
        ensure!(st.term_sent == 1, "server sent {} Terminates", st.term_sent);
        ensure!(
            c.s.qp.terminate_sent().map(|t| t.vendor_err()) == Some(want_vendor),
            "server's terminate_sent {:?}, want {want_vendor:#06x}",
            c.s.qp.terminate_sent()
        );
        ensure!(
            c.c.qp.terminate_sent().is_none(),
            "the requester, which received the Terminate, says it sent {:?}",
            c.c.qp.terminate_sent()
        );
    }
    env.wait_error(&c.s.qp)?;
    env.wait_error(&c.c.qp)?;
    let r = env.wait(&c.s.cq, 1)?;
    ensure!(
        r[0].wr_id == 4242 && r[0].status == WcStatus::WrFlushErr,
        "server receive {:?}",
        r[0]
    );
    cmp(
        "target memory after the violation",
        &read_mr(target, off, len),
        &before,
    )?;
    Ok(())
}

pub(super) const V_DDP_INVALID_STAG: u32 = 0x1100;
pub(super) const V_DDP_BOUNDS: u32 = 0x1101;
pub(super) const V_DDP_NOT_ASSOC: u32 = 0x1102;
pub(super) const V_RDMAP_INVALID_STAG: u32 = 0x0100;
pub(super) const V_RDMAP_BOUNDS: u32 = 0x0101;
pub(super) const V_RDMAP_ACCESS: u32 = 0x0102;

pub(super) fn filled(
    pd: &Pd,
    len: usize,
    access: Access,
    seed: u64,
) -> std::result::Result<Mr, CaseErr> {
    let mr = pd.alloc_mr(len, access)?;
    mr.write_at(0, &pattern(seed, len))?;
    Ok(mr)
}

pub(super) fn prot_write_wrong_key(env: &Env<'_>) -> R {
    let c = env.connect(&params(b""), &params(b""))?;
    let t = filled(&c.s.pd, 8192, RW, 1)?;
    let bad = stag::next_key(t.rkey());
    expect_violation(
        env,
        &c,
        Attempt::Write {
            addr: t.addr(),
            rkey: bad,
            len: 4096,
        },
        &t,
        0,
        8192,
        V_DDP_INVALID_STAG,
    )
}

pub(super) fn prot_read_wrong_key(env: &Env<'_>) -> R {
    let c = env.connect(&params(b""), &params(b""))?;
    let t = filled(&c.s.pd, 8192, RW, 2)?;
    let bad = t.rkey() ^ 0x5500;
    expect_violation(
        env,
        &c,
        Attempt::Read {
            addr: t.addr(),
            rkey: bad,
            len: 4096,
        },
        &t,
        0,
        8192,
        V_RDMAP_INVALID_STAG,
    )
}

pub(super) fn prot_other_pd(env: &Env<'_>) -> R {
    let c = env.connect(&params(b""), &params(b""))?;
    let other = env.server.alloc_pd()?;
    let t = filled(&other, 8192, RW, 3)?;
    expect_violation(
        env,
        &c,
        Attempt::Write {
            addr: t.addr(),
            rkey: t.rkey(),
            len: 100,
        },
        &t,
        0,
        8192,
        V_DDP_NOT_ASSOC,
    )
}

/// A region inside a larger buffer so out-of-range bytes are observable.
pub(super) fn region_in(
    pd: &Pd,
    buf: &Mr,
    off: usize,
    len: usize,
    access: Access,
) -> std::result::Result<Mr, CaseErr> {
    // SAFETY: the range lies inside `buf`'s registered, owned memory, which
    // the caller keeps alive longer than the returned region.
    Ok(unsafe { pd.register_raw((buf.addr() as usize + off) as *mut u8, len, access)? })
}

pub(super) fn prot_oob(env: &Env<'_>, write: bool, low: bool) -> R {
    let c = env.connect(&params(b""), &params(b""))?;
    let outer = filled(&c.s.pd, 3 * 4096, Access::LOCAL_WRITE, 4)?;
    let len = 4096;
    let t = region_in(&c.s.pd, &outer, 4096, len, RW)?;
    let (addr, n) = if low {
        (t.addr() - 1, 64)
    } else {
        (t.addr() + 1, len)
    };
    let a = if write {
        Attempt::Write {
            addr,
            rkey: t.rkey(),
            len: n,
        }
    } else {
        Attempt::Read {
            addr,
            rkey: t.rkey(),
            len: n,
        }
    };
    let v = if write { V_DDP_BOUNDS } else { V_RDMAP_BOUNDS };
    expect_violation(env, &c, a, &outer, 0, 3 * 4096, v)
}

pub(super) fn prot_write_oob_low(env: &Env<'_>) -> R {
    prot_oob(env, true, true)
}
pub(super) fn prot_write_oob_high(env: &Env<'_>) -> R {
    prot_oob(env, true, false)
}
pub(super) fn prot_read_oob_low(env: &Env<'_>) -> R {
    prot_oob(env, false, true)
}
pub(super) fn prot_read_oob_high(env: &Env<'_>) -> R {
    prot_oob(env, false, false)
}

/// A write to a region with only REMOTE_READ (`write`), or a read of one
/// with only REMOTE_WRITE.
pub(super) fn prot_missing_right(env: &Env<'_>, write: bool) -> R {
    let c = env.connect(&params(b""), &params(b""))?;
    let (right, seed) = if write {
        (Access::REMOTE_READ, 5)
    } else {
        (Access::REMOTE_WRITE, 6)
    };
    let t = filled(&c.s.pd, 8192, Access::LOCAL_WRITE | right, seed)?;
    let (addr, rkey, len) = (t.addr(), t.rkey(), 512);
    let a = if write {
        Attempt::Write { addr, rkey, len }
    } else {
        Attempt::Read { addr, rkey, len }
    };
    expect_violation(env, &c, a, &t, 0, 8192, V_RDMAP_ACCESS)
}

pub(super) fn prot_write_ro(env: &Env<'_>) -> R {
    prot_missing_right(env, true)
}
pub(super) fn prot_read_wo(env: &Env<'_>) -> R {
    prot_missing_right(env, false)
}

pub(super) fn bind(
    c: &Conn,
    mw: &Mw,
    mr: &Mr,
    off: u64,
    len: u64,
    access: Access,
    one_shot: bool,
) -> std::result::Result<u32, CaseErr> {
    Ok(c.s.qp.bind_mw(
        mw,
        &MwBind {
            mr,
            offset: off,
            length: len,
            access,
            one_shot,
        },
        77,
        false,
    )?)
}

pub(super) fn prot_unbound_window(env: &Env<'_>) -> R {
    let c = env.connect(&params(b""), &params(b""))?;
    let t = filled(&c.s.pd, 8192, RW | Access::MW_BIND, 7)?;
    let mw = c.s.pd.alloc_mw()?;
    expect_violation(
        env,
        &c,
        Attempt::Write {
            addr: t.addr(),
            rkey: mw.rkey(),
            len: 100,
        },
        &t,
        0,
        8192,
        V_DDP_INVALID_STAG,
    )
}

pub(super) fn need_one_shot(env: &Env<'_>) -> R {
    if !env
        .server
        .device()
        .caps
        .as_ref()
        .is_some_and(|c| c.one_shot_mw && c.mw_kind == MwKind::Native)
    {
        return Err(CaseErr::Skip(
            "server device has no native one-shot windows".into(),
        ));
    }
    Ok(())
}

/// Write `len` bytes at `addr` under `rkey` and wait until placed.
pub(super) fn write_ok(env: &Env<'_>, c: &Conn, addr: u64, rkey: u32, data: &[u8], wr: u64) -> R {
    let cmr = c.c.pd.alloc_mr(data.len().max(1), Access::LOCAL_WRITE)?;
    cmr.write_at(0, data)?;
    c.c.qp.post_send(&[send_wr(
        wr,
        SendOp::Write {
            remote_addr: addr,
            rkey,
        },
        &[cmr.sge(0, data.len() as u32)],
    )])?;
    let w = env.wait(&c.c.cq, 1)?;
    check_ok(&w[0], wr, WcOpcode::RdmaWrite)?;
    sync_send(env, c, wr + 1)
}

pub(super) fn prot_one_shot_reuse(env: &Env<'_>) -> R {
    need_one_shot(env)?;
    let c = env.connect(&params(b""), &params(b""))?;
    let t = filled(&c.s.pd, 8192, RW | Access::MW_BIND, 8)?;
    let mw = c.s.pd.alloc_mw()?;
    let key = bind(&c, &mw, &t, 100, 1000, Access::REMOTE_WRITE, true)?;
    write_ok(env, &c, t.addr() + 100, key, &pattern(80, 1000), 10)?;
    expect_violation(
        env,
        &c,
        Attempt::Write {
            addr: t.addr() + 100,
            rkey: key,
            len: 10,
        },
        &t,
        0,
        8192,
        V_DDP_INVALID_STAG,
    )
}

pub(super) fn prot_dereg(env: &Env<'_>) -> R {
    let c = env.connect(&params(b""), &params(b""))?;
    let outer = filled(&c.s.pd, 8192, Access::LOCAL_WRITE, 9)?;
    let t = region_in(&c.s.pd, &outer, 0, 8192, RW)?;
    let (addr, rkey) = (t.addr(), t.rkey());
    drop(t);
    expect_violation(
        env,
        &c,
        Attempt::Write {
            addr,
            rkey,
            len: 100,
        },
        &outer,
        0,
        8192,
        V_DDP_INVALID_STAG,
    )
}

pub(super) fn prot_stale_key(env: &Env<'_>) -> R {
    let c = env.connect(&params(b""), &params(b""))?;
    let t = filled(&c.s.pd, 8192, RW | Access::MW_BIND, 10)?;
    let mw = c.s.pd.alloc_mw()?;
    let k1 = bind(&c, &mw, &t, 0, 8192, Access::REMOTE_WRITE, false)?;
    c.s.qp.invalidate(k1, 78, false)?;
    let k2 = bind(&c, &mw, &t, 0, 8192, Access::REMOTE_WRITE, false)?;
    ensure!(k1 != k2, "re-bind reissued the same key {k1:#x}");
    // A native window keeps its STag index and changes the key byte; a
    // device without windows registers a fresh region per bind, so the new
    // key is unrelated. Either way what matters is checked below: the old
    // key no longer works and the memory is unchanged.
    if mw.kind() == MwKind::Native {
        ensure!(
            stag::index(k1) == stag::index(k2),
            "re-bind changed the index"
        );
    }
    expect_violation(
        env,
        &c,
        Attempt::Write {
            addr: t.addr(),
            rkey: k1,
            len: 100,
        },
        &t,
        0,
        8192,
        V_DDP_INVALID_STAG,
    )
}
