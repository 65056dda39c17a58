//! Soft provider: a connection request accepted with a PD and CQs of
//! *another* soft context (not the listener's) yields a QP that lives in
//! that context. The LWIO server gives each connection its own context
//! under manual progress, so one connection's thread reads only its own
//! socket. Checked here: data both ways byte for byte, an RDMA Write into
//! the accepting context's memory, that driving the accepting context alone
//! is enough (the listener's context is never polled), that the listener's
//! context's memory keys do not work on the QP, and that a PD and CQ from
//! two different contexts are refused.

use std::time::Duration;

use lwio_rdma::*;

fn open(progress: Progress) -> Context {
    let cfg = Config {
        progress,
        ..Config::default()
    };
    provider("soft").unwrap().open(None, &cfg).unwrap()
}

fn init(pd: &Pd, cq: &Cq) -> QpInit {
    QpInit {
        pd: pd.clone(),
        send_cq: cq.clone(),
        recv_cq: cq.clone(),
        cap: QpCap::default(),
        sq_sig_all: true,
        recv_window: None,
        srq: None,
    }
}

fn wait_one(cq: &Cq) -> Wc {
    let mut out = [Wc::BLANK; 1];
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        if cq.poll(&mut out).unwrap() == 1 {
            return out[0];
        }
        assert!(std::time::Instant::now() < deadline, "no completion");
        std::thread::yield_now();
    }
}

fn run(progress: Progress) {
    let listen_ctx = open(progress);
    let conn_ctx = open(progress);
    let client = open(Progress::Auto);
    let l = listen_ctx
        .listen("127.0.0.1:0".parse().unwrap(), 4)
        .unwrap();
    let addr = l.local_addr();
    let spd = conn_ctx.alloc_pd().unwrap();
    let scq = conn_ctx.create_cq(64, None).unwrap();
    let cpd = client.alloc_pd().unwrap();
    let ccq = client.create_cq(64, None).unwrap();
    let (si, ci) = (init(&spd, &scq), init(&cpd, &ccq));
    // A PD of the listener's context with CQs of another: refused.
    let lpd = listen_ctx.alloc_pd().unwrap();
    let mixed = init(&lpd, &scq);
    let (refused, sqp, cqp) = std::thread::scope(|sc| {
        let h = sc.spawn(|| {
            let r1 = l
                .get_request(Some(Duration::from_secs(10)))
                .unwrap()
                .unwrap()
                .accept(&mixed, &ConnParams::default());
            let q = l
                .get_request(Some(Duration::from_secs(10)))
                .unwrap()
                .unwrap()
                .accept(&si, &ConnParams::default())
                .unwrap();
            (r1.err().map(|e| e.to_string()), q)
        });
        let first = client.connect(addr, &ci, &ConnParams::default());
        let q = client.connect(addr, &ci, &ConnParams::default()).unwrap();
        let (r1, sq) = h.join().unwrap();
        drop(first);
        (r1, sq, q)
    });
    let refused = refused.expect("a PD and CQs of different contexts were accepted");
    assert!(refused.contains("context"), "{refused}");

    let smr = spd
        .alloc_mr(
            8192,
            Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
        )
        .unwrap();
    smr.write_at(0, &[0xeeu8; 8192]).unwrap();
    let cmr = cpd.alloc_mr(8192, Access::LOCAL_WRITE).unwrap();
    let payload: Vec<u8> = (0..5000u32).map(|i| (i * 7 + 3) as u8).collect();
    cmr.write_at(0, &payload).unwrap();

    // Client → server Send, received through the accepting context.
    sqp.post_recv(&[RecvWr {
        wr_id: 1,
        sg_list: &[smr.sge(0, 8192)],
    }])
    .unwrap();
    cqp.post_send(&[SendWr::new(2, SendOp::Send, &[cmr.sge(0, 5000)])])
        .unwrap();
    let w = wait_one(&scq);
    assert!(w.is_ok() && w.wr_id == 1 && w.byte_len == 5000, "{w:?}");
    let mut got = vec![0u8; 5000];
    smr.read_at(0, &mut got).unwrap();
    assert_eq!(got, payload);
    assert!(wait_one(&ccq).is_ok());

    // RDMA Write into the accepting context's region at offset 6000, then a
    // Send on the same stream: once the Send is received (driving only the
    // accepting context), the write before it has been placed.
    smr.write_at(0, &[0xeeu8; 8192]).unwrap();
    sqp.post_recv(&[RecvWr {
        wr_id: 8,
        sg_list: &[smr.sge(0, 16)],
    }])
    .unwrap();
    cqp.post_send(&[
        SendWr::new(
            3,
            SendOp::Write {
                remote_addr: smr.addr() + 6000,
                rkey: smr.rkey(),
            },
            &[cmr.sge(0, 100)],
        ),
        SendWr::new(9, SendOp::Send, &[cmr.sge(0, 0)]),
    ])
    .unwrap();
    let w = wait_one(&scq);
    assert!(w.is_ok() && w.wr_id == 8 && w.byte_len == 0, "{w:?}");
    let mut region = vec![0u8; 8192];
    smr.read_at(0, &mut region).unwrap();
    assert_eq!(&region[6000..6100], &payload[..100]);
    assert!(region[..6000].iter().all(|&b| b == 0xee));
    assert!(region[6100..].iter().all(|&b| b == 0xee));
    assert!(wait_one(&ccq).is_ok() && wait_one(&ccq).is_ok());

    // Server → client.
    cqp.post_recv(&[RecvWr {
        wr_id: 4,
        sg_list: &[cmr.sge(4096, 4096)],
    }])
    .unwrap();
    smr.write_at(0, b"from-conn-ctx").unwrap();
    sqp.post_send(&[SendWr::new(5, SendOp::Send, &[smr.sge(0, 13)])])
        .unwrap();
    let w = wait_one(&ccq);
    assert!(w.is_ok() && w.wr_id == 4 && w.byte_len == 13, "{w:?}");
    let mut b = [0u8; 13];
    cmr.read_at(4096, &mut b).unwrap();
    assert_eq!(&b, b"from-conn-ctx");
    assert!(wait_one(&scq).is_ok());

    // A key of the listener's context means nothing on this QP: the write
    // is refused (reported on the legal Read that follows it) and the
    // listener-context region is untouched.
    let lmr = lpd
        .alloc_mr(4096, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
        .unwrap();
    lmr.write_at(0, &[0x55u8; 4096]).unwrap();
    cqp.post_send(&[
        SendWr::new(
            6,
            SendOp::Write {
                remote_addr: lmr.addr(),
                rkey: lmr.rkey(),
            },
            &[cmr.sge(0, 64)],
        ),
        SendWr::new(
            7,
            SendOp::Read {
                remote_addr: smr.addr(),
                rkey: smr.rkey(),
            },
            &[cmr.sge(0, 8)],
        ),
    ])
    .unwrap();
    // Drive the server side (its context only) until the client sees the
    // rejection.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let mut out = [Wc::BLANK; 4];
    let mut errored = false;
    while !errored && std::time::Instant::now() < deadline {
        let _ = scq.poll(&mut out);
        let n = ccq.poll(&mut out).unwrap();
        errored = out[..n].iter().any(|w| !w.is_ok());
        std::thread::yield_now();
    }
    assert!(
        errored,
        "a write with a foreign context's key was not refused"
    );
    let mut l = vec![0u8; 4096];
    lmr.read_at(0, &mut l).unwrap();
    assert!(
        l.iter().all(|&b| b == 0x55),
        "foreign-context region written"
    );
}

#[test]
fn accept_into_another_context_manual() {
    run(Progress::Manual);
}

#[test]
fn accept_into_another_context_auto() {
    run(Progress::Auto);
}
