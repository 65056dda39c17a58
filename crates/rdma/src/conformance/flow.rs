//! Receive flow control: what a sender meets when the receiver has no
//! receive posted.

use super::*;

pub(super) fn case_flow_control(env: &Env<'_>) -> R {
    if env.server.device().provider != "soft" {
        // siw answers a Send without a posted receive with a Terminate
        // (DDP "no buffer"), IB/RoCE with RNR NAKs: the indicate window is
        // the soft provider's behaviour (seed 003).
        return Err(CaseErr::Skip(
            "receive flow control (indicate window) is a soft-provider receiver feature".into(),
        ));
    }
    let c = env.connect(&params(b""), &params(b""))?;
    let window = crate::soft::qp_stats(&c.s.qp).map(|_| ());
    const N: usize = 48;
    const SIZE: usize = 20_000;
    let cmr = c.c.pd.alloc_mr(N * SIZE, Access::LOCAL_WRITE)?;
    let smr = c.s.pd.alloc_mr(N * SIZE, Access::LOCAL_WRITE)?;
    for i in 0..N {
        cmr.write_at(i * SIZE, &pattern(i as u64 + 500, SIZE))?;
    }
    for i in 0..N {
        c.c.qp.post_send(&[send_wr(
            i as u64,
            SendOp::Send,
            &[cmr.sge(i * SIZE, SIZE as u32)],
        )])?;
    }
    // Let the server run with no receive posted for a while.
    let t = Instant::now();
    while t.elapsed() < Duration::from_millis(300) {
        env.progress();
        std::thread::sleep(Duration::from_millis(1));
    }
    ensure!(
        c.c.qp.state() == QpState::Rts,
        "sender QP torn down: {:?}",
        c.c.qp.state()
    );
    ensure!(
        c.s.qp.state() == QpState::Rts,
        "receiver QP torn down: {:?}",
        c.s.qp.state()
    );
    let mut buf = [Wc::BLANK; 4];
    ensure!(
        c.s.cq.poll(&mut buf)? == 0,
        "receiver completed something with no receive posted"
    );
    if window.is_some() {
        let st = crate::soft::qp_stats(&c.s.qp).unwrap_or_default();
        let w = st.indicate_window;
        ensure!(
            st.anon_peak <= w,
            "anonymous buffering {} > window {w}",
            st.anon_peak
        );
        ensure!(st.anon_peak > 0, "nothing was buffered");
        ensure!(
            st.paused > 0,
            "the receiver never stopped reading (window {w}, {} bytes sent)",
            N * SIZE
        );
    }
    for i in 0..N {
        c.s.qp.post_recv(&[RecvWr {
            wr_id: i as u64,
            sg_list: &[smr.sge(i * SIZE, SIZE as u32)],
        }])?;
    }
    let r = env.wait(&c.s.cq, N)?;
    for (i, w) in r.iter().enumerate() {
        check_ok(w, i as u64, WcOpcode::Recv)?;
        ensure!(
            w.byte_len as usize == SIZE,
            "message {i} byte_len {}",
            w.byte_len
        );
        cmp(
            &format!("message {i}"),
            &read_mr(&smr, i * SIZE, SIZE),
            &pattern(i as u64 + 500, SIZE),
        )?;
    }
    let w = env.wait(&c.c.cq, N)?;
    for (i, w) in w.iter().enumerate() {
        check_ok(w, i as u64, WcOpcode::Send)?;
    }
    if let Some(st) = crate::soft::qp_stats(&c.s.qp) {
        ensure!(
            st.anon_peak <= st.indicate_window,
            "anonymous buffering peaked at {}",
            st.anon_peak
        );
    }
    Ok(())
}
