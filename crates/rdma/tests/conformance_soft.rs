//! The conformance suite, soft↔soft, under both progress models and with
//! MPA CRC on and off. Every case is its own test so a failure names it.

use std::net::SocketAddr;
use std::sync::OnceLock;

use lwio_rdma::conformance::{self, Outcome};
use lwio_rdma::*;

fn open(progress: Progress, crc: bool) -> Context {
    let cfg = Config {
        progress,
        mpa_crc: if crc {
            CrcPolicy::Required
        } else {
            CrcPolicy::Off
        },
        indicate_window: 64 * 1024,
        ..Config::default()
    };
    provider("soft").unwrap().open(Some("soft0"), &cfg).unwrap()
}

fn pair(progress: Progress, crc: bool) -> &'static (Context, Context) {
    static P: [OnceLock<(Context, Context)>; 4] = [const { OnceLock::new() }; 4];
    let i = (progress == Progress::Manual) as usize * 2 + crc as usize;
    P[i].get_or_init(|| (open(progress, crc), open(progress, crc)))
}

fn run(progress: Progress, crc: bool, name: &str) {
    let (s, c) = pair(progress, crc);
    let addr: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let r = conformance::run_case(s, c, addr, name).unwrap();
    eprintln!("{r} ({:?}, {progress:?}, crc={crc})", r.elapsed);
    // A skip is not a pass: only the cases listed here, for the reason
    // given, may skip on the soft provider, and a listed case that passes
    // must leave the list.
    let known = SOFT_SKIPS.iter().find(|(n, _)| *n == name);
    match (r.outcome, known) {
        (Outcome::Pass, None) => {}
        (Outcome::Pass, Some(_)) => {
            panic!("{name} passes now: take it off SOFT_SKIPS")
        }
        (Outcome::Skip(w), Some((_, why))) => eprintln!("SKIP {name}: {w} (known: {why})"),
        (Outcome::Skip(w), None) => panic!("{name} skipped and is not a known skip: {w}"),
        (Outcome::Fail(w), _) => panic!("{name} ({progress:?}, crc={crc}): {w}"),
    }
}

/// Cases the soft provider skips, and why.
const SOFT_SKIPS: &[(&str, &str)] = &[];

macro_rules! cases {
    ($($name:ident),* $(,)?) => {
        mod auto_nocrc { $( #[test] fn $name() { super::run(super::Progress::Auto, false, stringify!($name)); } )* }
        mod auto_crc { $( #[test] fn $name() { super::run(super::Progress::Auto, true, stringify!($name)); } )* }
        mod manual_nocrc { $( #[test] fn $name() { super::run(super::Progress::Manual, false, stringify!($name)); } )* }
        mod manual_crc { $( #[test] fn $name() { super::run(super::Progress::Manual, true, stringify!($name)); } )* }
        #[test]
        fn every_case_is_listed() {
            let mut listed = vec![$(stringify!($name)),*];
            let mut all = conformance::case_names();
            listed.sort();
            all.sort();
            assert_eq!(listed, all);
        }
    };
}

cases!(
    send_recv_sizes,
    send_with_invalidate_sizes,
    rdma_write_sizes,
    rdma_read_sizes,
    write_with_imm,
    recv_scatter_multi_sge,
    ordering_many_posts,
    ordering_send_after_writes,
    post_lists,
    unsignaled_writes,
    flush_on_set_error,
    flush_on_peer_disconnect,
    cm_reject_private_data,
    cm_accept_private_data,
    cm_ird_ord_negotiated,
    cq_channel_blocking_wait,
    cq_arm_solicited_only,
    srq_two_qps_share_receives,
    cq_tagged_channel_reports_fired,
    prot_write_wrong_key,
    prot_read_wrong_key,
    prot_write_other_pd_key,
    prot_write_oob_low,
    prot_write_oob_high,
    prot_read_oob_low,
    prot_read_oob_high,
    prot_write_read_only_region,
    prot_read_write_only_region,
    prot_unbound_window,
    prot_one_shot_window_reused,
    prot_deregistered_region,
    prot_invalidated_window_old_key,
    mw_bind_byte_granularity,
    mw_one_shot,
    mw_send_with_invalidate,
    recv_flow_control_indicate_window,
    pd_census_counts,
    mw_on_region_without_remote_rights,
);

// ---------------------------------------------------------------------------
// Soft-provider behaviour beyond the shared suite.

struct Conn {
    spd: Pd,
    scq: Cq,
    sqp: Qp,
    cpd: Pd,
    ccq: Cq,
    cqp: Qp,
}

fn connect(s: &Context, c: &Context) -> Conn {
    connect_with(s, c, None)
}

/// As `connect`, with the server QP's receive window (`QpInit::recv_window`).
fn connect_with(s: &Context, c: &Context, server_window: Option<usize>) -> Conn {
    let l = s.listen("127.0.0.1:0".parse().unwrap(), 16).unwrap();
    let addr = l.local_addr();
    let (spd, cpd) = (s.alloc_pd().unwrap(), c.alloc_pd().unwrap());
    let (scq, ccq) = (
        s.create_cq(4096, None).unwrap(),
        c.create_cq(4096, None).unwrap(),
    );
    let init = |pd: &Pd, cq: &Cq| QpInit {
        pd: pd.clone(),
        send_cq: cq.clone(),
        recv_cq: cq.clone(),
        cap: QpCap {
            max_send_wr: 512,
            max_recv_wr: 512,
            ..QpCap::default()
        },
        sq_sig_all: false,
        recv_window: None,
        srq: None,
    };
    let si = QpInit {
        recv_window: server_window,
        ..init(&spd, &scq)
    };
    let ci = init(&cpd, &ccq);
    let (sqp, cqp) = std::thread::scope(|sc| {
        let h = sc.spawn(|| {
            let r = l
                .get_request(Some(std::time::Duration::from_secs(10)))
                .unwrap()
                .unwrap();
            r.accept(&si, &ConnParams::default()).unwrap()
        });
        let c = c.connect(addr, &ci, &ConnParams::default()).unwrap();
        (h.join().unwrap(), c)
    });
    Conn {
        spd,
        scq,
        sqp,
        cpd,
        ccq,
        cqp,
    }
}

fn wait(ctxs: &[&Context], cq: &Cq, n: usize) -> Vec<Wc> {
    let mut v = Vec::new();
    let mut b = [lwio_rdma::Wc::BLANK; 32];
    let t = std::time::Instant::now();
    while v.len() < n {
        let k = cq.poll(&mut b[..(n - v.len()).min(32)]).unwrap();
        v.extend_from_slice(&b[..k]);
        if k == 0 {
            for c in ctxs {
                c.progress().unwrap();
            }
            std::thread::yield_now();
        }
        assert!(
            t.elapsed() < std::time::Duration::from_secs(30),
            "timeout after {v:?}"
        );
    }
    v
}

/// Two receives on `qp`: wr 1 for a message of up to `n` bytes of `mr`,
/// then wr 2, which the peer's close is to flush.
fn recv_then_flushed(qp: &Qp, mr: &Mr, n: usize) {
    qp.post_recv(&[
        RecvWr {
            wr_id: 1,
            sg_list: &[mr.sge(0, n as u32)],
        },
        RecvWr {
            wr_id: 2,
            sg_list: &[mr.sge(0, 16)],
        },
    ])
    .unwrap();
}

fn disconnect_drains(progress: Progress) {
    let (s, c) = (open(progress, false), open(progress, false));
    let k = connect(&s, &c);
    let n = (1 << 20) + 3;
    let smr = k.spd.alloc_mr(n, Access::LOCAL_WRITE).unwrap();
    let cmr = k.cpd.alloc_mr(n, Access::LOCAL_WRITE).unwrap();
    let data = conformance::pattern(42, n);
    cmr.write_at(0, &data).unwrap();
    recv_then_flushed(&k.sqp, &smr, n);
    k.cqp
        .post_send(&[SendWr::new(7, SendOp::Send, &[cmr.sge(0, n as u32)])])
        .unwrap();
    // Disconnect at once: the send must still be delivered whole.
    k.cqp.disconnect().unwrap();
    let late = k.cqp.post_send(&[SendWr::new(8, SendOp::Send, &[])]);
    assert!(
        late.is_ok(),
        "posting while closing flushes, it does not fail"
    );
    let w = wait(&[&s, &c], &k.ccq, 2);
    assert_eq!((w[0].wr_id, w[0].status), (7, WcStatus::Success), "{w:?}");
    assert_eq!(
        (w[1].wr_id, w[1].status),
        (8, WcStatus::WrFlushErr),
        "{w:?}"
    );
    let r = wait(&[&s, &c], &k.scq, 2);
    assert_eq!(
        (r[0].wr_id, r[0].status, r[0].byte_len as usize),
        (1, WcStatus::Success, n)
    );
    assert_eq!((r[1].wr_id, r[1].status), (2, WcStatus::WrFlushErr));
    let mut got = vec![0u8; n];
    smr.read_at(0, &mut got).unwrap();
    assert!(got == data, "data differs");
    assert_eq!(k.cqp.state(), QpState::Error);
}

#[test]
fn soft_disconnect_drains_queued_sends_auto() {
    disconnect_drains(Progress::Auto);
}

#[test]
fn soft_disconnect_drains_queued_sends_manual() {
    disconnect_drains(Progress::Manual);
}

/// The peer's last message and its end of stream are both in the socket
/// before the receiver reads: one readiness edge reports both, and no later
/// edge comes, so the receive pass must read on to the end of stream after
/// the message (a read that comes back short stops at the FIN with it still
/// unread). Both ends under manual progress: nothing reads the server's
/// socket until `wait` drives its context, after the client has sent the
/// message and closed. A receive pass that stopped at that short read (the
/// reverted 1774dd6) never flushed the second receive: the wait timed out.
fn end_of_stream_behind_a_message(crc: bool) {
    let (s, c) = (open(Progress::Manual, crc), open(Progress::Manual, crc));
    let k = connect(&s, &c);
    let smr = k.spd.alloc_mr(4096, Access::LOCAL_WRITE).unwrap();
    let cmr = k.cpd.alloc_mr(100, Access::LOCAL_WRITE).unwrap();
    let data = conformance::pattern(7, 100);
    cmr.write_at(0, &data).unwrap();
    recv_then_flushed(&k.sqp, &smr, 4096);
    k.cqp
        .post_send(&[SendWr::new(7, SendOp::Send, &[cmr.sge(0, 100)])])
        .unwrap();
    k.cqp.disconnect().unwrap();
    // The message and the FIN reach the server's socket (loopback) before
    // its first read.
    std::thread::sleep(std::time::Duration::from_millis(200));
    let r = wait(&[&s], &k.scq, 2);
    assert_eq!(
        (r[0].wr_id, r[0].status, r[0].byte_len),
        (1, WcStatus::Success, 100),
        "{r:?}"
    );
    assert_eq!(
        (r[1].wr_id, r[1].status),
        (2, WcStatus::WrFlushErr),
        "{r:?}"
    );
    let mut got = vec![0u8; 100];
    smr.read_at(0, &mut got).unwrap();
    assert_eq!(got, data);
}

#[test]
fn soft_end_of_stream_behind_a_message_is_seen() {
    end_of_stream_behind_a_message(false);
}

#[test]
fn soft_end_of_stream_behind_a_message_is_seen_crc() {
    end_of_stream_behind_a_message(true);
}

/// Several connections on the same two contexts, each driven by its own
/// thread posting sends, writes and reads concurrently with the engine.
fn many_qps(progress: Progress) {
    let (s, c) = (open(progress, true), open(progress, true));
    const QPS: usize = 6;
    const MSGS: usize = 300;
    const SZ: usize = 3000;
    let conns: Vec<Conn> = (0..QPS).map(|_| connect(&s, &c)).collect();
    std::thread::scope(|sc| {
        for (q, k) in conns.iter().enumerate() {
            let (s, c) = (&s, &c);
            sc.spawn(move || {
                let smr = k
                    .spd
                    .alloc_mr(
                        MSGS * SZ,
                        Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
                    )
                    .unwrap();
                let cmr = k.cpd.alloc_mr(2 * MSGS * SZ, Access::LOCAL_WRITE).unwrap();
                let data = conformance::pattern(q as u64, MSGS * SZ);
                cmr.write_at(0, &data).unwrap();
                for i in (0..MSGS).filter(|i| i % 3 != 1) {
                    k.sqp
                        .post_recv(&[RecvWr {
                            wr_id: i as u64,
                            sg_list: &[smr.sge(i * SZ, SZ as u32)],
                        }])
                        .unwrap();
                }
                for i in 0..MSGS {
                    let sg = [cmr.sge(i * SZ, (i * 7) as u32 % SZ as u32)];
                    let op = match i % 3 {
                        0 => SendOp::Send,
                        1 => SendOp::Write {
                            remote_addr: smr.addr() + (i * SZ) as u64,
                            rkey: smr.rkey(),
                        },
                        _ => SendOp::Send,
                    };
                    k.cqp.post_send(&[SendWr::new(i as u64, op, &sg)]).unwrap();
                    if i % 100 == 99 {
                        let w = wait(&[s, c], &k.ccq, 100);
                        assert!(w.iter().all(|w| w.is_ok()), "{w:?}");
                    }
                }
                // Read everything back after the writes/sends landed.
                let sends = (0..MSGS).filter(|i| i % 3 != 1).count();
                let r = wait(&[s, c], &k.scq, sends);
                assert!(r.iter().all(|w| w.is_ok()), "{r:?}");
                k.cqp
                    .post_send(&[SendWr::new(
                        999,
                        SendOp::Read {
                            remote_addr: smr.addr(),
                            rkey: smr.rkey(),
                        },
                        &[cmr.sge(MSGS * SZ, (MSGS * SZ) as u32)],
                    )])
                    .unwrap();
                let w = wait(&[s, c], &k.ccq, 1);
                assert!(w[0].is_ok(), "{w:?}");
                let mut back = vec![0u8; MSGS * SZ];
                cmr.read_at(MSGS * SZ, &mut back).unwrap();
                for i in 0..MSGS {
                    let len = (i * 7) % SZ;
                    assert!(
                        back[i * SZ..i * SZ + len] == data[i * SZ..i * SZ + len],
                        "qp {q} message {i}"
                    );
                }
            });
        }
    });
}

#[test]
fn soft_many_qps_concurrent_auto() {
    many_qps(Progress::Auto);
}

#[test]
fn soft_many_qps_concurrent_manual() {
    many_qps(Progress::Manual);
}

#[test]
fn soft_listener_not_blocked_by_silent_clients() {
    let (s, c) = (open(Progress::Auto, false), open(Progress::Auto, false));
    let l = s.listen("127.0.0.1:0".parse().unwrap(), 16).unwrap();
    let addr = l.local_addr();
    // Connect and say nothing (and one that sends half a request).
    let _silent = std::net::TcpStream::connect(addr).unwrap();
    let mut half = std::net::TcpStream::connect(addr).unwrap();
    std::io::Write::write_all(&mut half, b"MPA ID Req").unwrap();
    std::thread::sleep(std::time::Duration::from_millis(50));
    let pd = c.alloc_pd().unwrap();
    let cq = c.create_cq(16, None).unwrap();
    let init = QpInit {
        pd,
        send_cq: cq.clone(),
        recv_cq: cq,
        cap: QpCap::default(),
        sq_sig_all: false,
        recv_window: None,
        srq: None,
    };
    let t = std::time::Instant::now();
    std::thread::scope(|sc| {
        let h = sc.spawn(|| c.connect(addr, &init, &ConnParams::default()).map(|_| ()));
        let r = l
            .get_request(Some(std::time::Duration::from_secs(5)))
            .unwrap()
            .expect("the real client's request");
        r.reject(b"seen").unwrap();
        assert!(matches!(h.join().unwrap(), Err(Error::Rejected { .. })));
    });
    assert!(
        t.elapsed() < std::time::Duration::from_secs(2),
        "took {:?}",
        t.elapsed()
    );
}

#[test]
fn soft_rejects_objects_of_another_context() {
    let (a, b) = (open(Progress::Manual, false), open(Progress::Manual, false));
    let ch = b.create_comp_channel().unwrap();
    assert!(matches!(
        a.create_cq(8, Some(&ch)),
        Err(Error::InvalidArgument(_))
    ));
    let init = QpInit {
        pd: a.alloc_pd().unwrap(),
        send_cq: b.create_cq(8, None).unwrap(),
        recv_cq: a.create_cq(8, None).unwrap(),
        cap: QpCap::default(),
        sq_sig_all: false,
        recv_window: None,
        srq: None,
    };
    // Refused before any connection attempt (nothing listens there).
    let r = a.connect(
        "127.0.0.1:9".parse().unwrap(),
        &init,
        &ConnParams::default(),
    );
    assert!(matches!(r, Err(Error::InvalidArgument(_))), "{:?}", r.err());
}

fn wait_state(ctxs: &[&Context], qp: &Qp, st: QpState) {
    let t = std::time::Instant::now();
    while qp.state() != st {
        for c in ctxs {
            c.progress().unwrap();
        }
        assert!(
            t.elapsed() < std::time::Duration::from_secs(10),
            "QP stuck in {:?}",
            qp.state()
        );
        std::thread::sleep(std::time::Duration::from_micros(200));
    }
}

#[test]
fn soft_buffered_message_too_long_for_receive() {
    for progress in [Progress::Auto, Progress::Manual] {
        let (s, c) = (open(progress, false), open(progress, false));
        let k = connect(&s, &c);
        let cmr = k.cpd.alloc_mr(1000, Access::LOCAL_WRITE).unwrap();
        let smr = k.spd.alloc_mr(100, Access::LOCAL_WRITE).unwrap();
        k.cqp
            .post_send(&[SendWr::new(1, SendOp::Send, &[cmr.sge(0, 1000)])])
            .unwrap();
        wait(&[&s, &c], &k.ccq, 1);
        // Let the message be buffered anonymously, then post a small receive.
        let t = std::time::Instant::now();
        while soft::qp_stats(&k.sqp).unwrap().anon_bytes == 0 {
            s.progress().unwrap();
            assert!(t.elapsed() < std::time::Duration::from_secs(10));
        }
        k.sqp
            .post_recv(&[RecvWr {
                wr_id: 5,
                sg_list: &[smr.sge(0, 100)],
            }])
            .unwrap();
        let r = wait(&[&s, &c], &k.scq, 1);
        assert_eq!((r[0].wr_id, r[0].status), (5, WcStatus::LocLenErr), "{r:?}");
        wait_state(&[&s, &c], &k.cqp, QpState::Error);
        let st = soft::qp_stats(&k.cqp).unwrap();
        assert_eq!((st.term_recv, st.last_term), (1, 0x1205), "{st:?}");
    }
}

#[test]
fn soft_bad_local_key_closes_the_connection() {
    for progress in [Progress::Auto, Progress::Manual] {
        let (s, c) = (open(progress, false), open(progress, false));
        let k = connect(&s, &c);
        let smr = k.spd.alloc_mr(100, Access::LOCAL_WRITE).unwrap();
        k.sqp
            .post_recv(&[RecvWr {
                wr_id: 1,
                sg_list: &[Sge {
                    addr: smr.addr(),
                    length: 100,
                    lkey: smr.lkey() ^ 0x100,
                }],
            }])
            .unwrap();
        let r = wait(&[&s, &c], &k.scq, 1);
        assert_eq!(
            (r[0].wr_id, r[0].status),
            (1, WcStatus::LocProtErr),
            "{r:?}"
        );
        assert_eq!(k.sqp.state(), QpState::Error);
        wait_state(&[&s, &c], &k.cqp, QpState::Error);
    }
}

#[test]
fn soft_listener_fd_reports_pending_mpa_requests() {
    use lwio_iwarp::mpa::{MpaConfig, MpaHandshake};
    let s = open(Progress::Auto, false);
    let l = s.listen("127.0.0.1:0".parse().unwrap(), 16).unwrap();
    let readable = |ms: i32| {
        let mut p = libc::pollfd {
            fd: l.fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one live pollfd.
        unsafe { libc::poll(&mut p, 1, ms) > 0 }
    };
    let mut h = MpaHandshake::initiator(
        MpaConfig::initiator_default(),
        b"x",
        std::time::Instant::now(),
    )
    .unwrap();
    let frame = h.poll_transmit().unwrap();
    let mut c = std::net::TcpStream::connect(l.local_addr()).unwrap();
    std::io::Write::write_all(&mut c, &frame[..10]).unwrap();
    assert!(readable(1000), "a new connection makes the fd readable");
    // The half request is taken in; nothing to return yet.
    assert!(l
        .get_request(Some(std::time::Duration::from_millis(20)))
        .unwrap()
        .is_none());
    assert!(!readable(0), "nothing new to report");
    std::io::Write::write_all(&mut c, &frame[10..]).unwrap();
    assert!(
        readable(1000),
        "the rest of the request makes the fd readable"
    );
    let r = l
        .get_request(Some(std::time::Duration::ZERO))
        .unwrap()
        .expect("request");
    assert_eq!(r.private_data(), b"x");
    r.reject(b"").unwrap();
}

/// Seed 003's indicate window is a property of each connection: a QP
/// created with `recv_window` buffers at most that much before it stops
/// reading, whatever its context's default, and one created without it
/// keeps the context's.
#[test]
fn soft_indicate_window_per_qp() {
    for progress in [Progress::Auto, Progress::Manual] {
        let (s, c) = (open(progress, false), open(progress, false));
        const N: usize = 12;
        const SIZE: usize = 10_000;
        for window in [Some(24_000), None] {
            let k = connect_with(&s, &c, window);
            let want = window.unwrap_or(64 * 1024);
            let cmr = k.cpd.alloc_mr(N * SIZE, Access::LOCAL_WRITE).unwrap();
            let smr = k.spd.alloc_mr(N * SIZE, Access::LOCAL_WRITE).unwrap();
            for i in 0..N {
                cmr.write_at(i * SIZE, &conformance::pattern(i as u64, SIZE))
                    .unwrap();
                k.cqp
                    .post_send(&[SendWr::new(
                        i as u64,
                        SendOp::Send,
                        &[cmr.sge(i * SIZE, SIZE as u32)],
                    )])
                    .unwrap();
            }
            let t = std::time::Instant::now();
            while t.elapsed() < std::time::Duration::from_millis(200) {
                s.progress().unwrap();
                c.progress().unwrap();
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            let st = lwio_rdma::soft::qp_stats(&k.sqp).unwrap();
            assert_eq!(st.indicate_window, want, "{progress:?} {window:?}");
            assert!(
                st.anon_peak <= want && st.anon_peak > want - SIZE - 64,
                "{progress:?} {window:?}: buffered {} of a window of {want}",
                st.anon_peak
            );
            assert!(st.paused > 0, "{progress:?} {window:?}: never paused");
            for i in 0..N {
                k.sqp
                    .post_recv(&[RecvWr {
                        wr_id: i as u64,
                        sg_list: &[smr.sge(i * SIZE, SIZE as u32)],
                    }])
                    .unwrap();
            }
            let w = wait(&[&s, &c], &k.scq, N);
            for (i, w) in w.iter().enumerate() {
                assert!(w.is_ok() && w.wr_id == i as u64, "{w:?}");
                let mut got = vec![0; SIZE];
                smr.read_at(i * SIZE, &mut got).unwrap();
                assert!(
                    got == conformance::pattern(i as u64, SIZE),
                    "{progress:?} {window:?}: message {i} differs"
                );
            }
        }
    }
}
