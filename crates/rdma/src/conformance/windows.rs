//! Memory windows: unbound, one-shot, bound to ranges.

use super::*;

pub(super) fn case_mw_granularity(env: &Env<'_>) -> R {
    let c = env.connect(&params(b""), &params(b""))?;
    let t = filled(&c.s.pd, 8192, RW | Access::MW_BIND, 11)?;
    let mut want = read_mr(&t, 0, 8192);
    let mw = c.s.pd.alloc_mw()?;
    let (off, len) = (4093usize, 1001usize);
    let key = bind(
        &c,
        &mw,
        &t,
        off as u64,
        len as u64,
        Access::REMOTE_WRITE,
        false,
    )?;
    let data = pattern(12, len);
    write_ok(env, &c, t.addr() + off as u64, key, &data, 20)?;
    want[off..off + len].copy_from_slice(&data);
    cmp("region after a window write", &read_mr(&t, 0, 8192), &want)?;
    // One byte more is refused (and nothing is written).
    expect_violation(
        env,
        &c,
        Attempt::Write {
            addr: t.addr() + off as u64,
            rkey: key,
            len: len + 1,
        },
        &t,
        0,
        8192,
        V_DDP_BOUNDS,
    )
}

pub(super) fn case_mw_one_shot(env: &Env<'_>) -> R {
    need_one_shot(env)?;
    let c = env.connect(&params(b""), &params(b""))?;
    let t = filled(&c.s.pd, 8192, RW | Access::MW_BIND, 13)?;
    let mw = c.s.pd.alloc_mw()?;
    // Read through a one-shot window: the first works, the second fails.
    let key = bind(&c, &mw, &t, 7, 333, Access::REMOTE_READ, true)?;
    let cmr = c.c.pd.alloc_mr(4096, Access::LOCAL_WRITE)?;
    c.c.qp.post_send(&[send_wr(
        1,
        SendOp::Read {
            remote_addr: t.addr() + 7,
            rkey: key,
        },
        &[cmr.sge(0, 333)],
    )])?;
    let w = env.wait(&c.c.cq, 1)?;
    check_ok(&w[0], 1, WcOpcode::RdmaRead)?;
    cmp(
        "one-shot read",
        &read_mr(&cmr, 0, 333),
        &read_mr(&t, 7, 333),
    )?;
    expect_violation(
        env,
        &c,
        Attempt::Read {
            addr: t.addr() + 7,
            rkey: key,
            len: 333,
        },
        &t,
        0,
        8192,
        V_RDMAP_INVALID_STAG,
    )
}

pub(super) fn case_mw_send_inv(env: &Env<'_>) -> R {
    need_send_inv(env)?;
    let c = env.connect(&params(b""), &params(b""))?;
    let t = filled(&c.s.pd, 8192, RW | Access::MW_BIND, 14)?;
    let mw = c.s.pd.alloc_mw()?;
    let key = bind(&c, &mw, &t, 0, 4096, Access::REMOTE_WRITE, false)?;
    write_ok(env, &c, t.addr(), key, &pattern(15, 4096), 30)?;
    c.s.qp.post_recv(&[RecvWr {
        wr_id: 9,
        sg_list: &[],
    }])?;
    c.c.qp
        .post_send(&[send_wr(9, SendOp::SendWithInvalidate { rkey: key }, &[])])?;
    env.wait(&c.c.cq, 1)?;
    let r = env.wait(&c.s.cq, 1)?;
    check_ok(&r[0], 9, WcOpcode::Recv)?;
    ensure!(
        r[0].invalidated_rkey == Some(key),
        "invalidated_rkey {:?}",
        r[0].invalidated_rkey
    );
    expect_violation(
        env,
        &c,
        Attempt::Write {
            addr: t.addr(),
            rkey: key,
            len: 100,
        },
        &t,
        0,
        8192,
        V_DDP_INVALID_STAG,
    )
}
