//! Wire interoperability of the soft provider with an independent
//! implementation: the sans-IO `lwio-iwarp` stack (modelled on Linux siw)
//! drives one end of a real TCP connection, the soft provider the other.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use lwio_iwarp::fpdu_rx::{FpduConfig, FpduEvent, FpduReceiver};
use lwio_iwarp::mpa::{CrcPolicy as IwCrc, MpaConfig, MpaEvent, MpaHandshake};
use lwio_iwarp::tx::{OutboundMessage, TxConfig, TxState};
use lwio_iwarp::wire::ddp::Kind;
use lwio_rdma::*;

fn ctx(crc: bool) -> Context {
    let cfg = Config {
        mpa_crc: if crc {
            CrcPolicy::Required
        } else {
            CrcPolicy::Off
        },
        ..Config::default()
    };
    provider("soft").unwrap().open(None, &cfg).unwrap()
}

struct Res {
    pd: Pd,
    cq: Cq,
    init: QpInit,
}

fn res(c: &Context) -> Res {
    let pd = c.alloc_pd().unwrap();
    let cq = c.create_cq(64, None).unwrap();
    let init = QpInit::new(&pd, &cq);
    Res { pd, cq, init }
}

fn wait(cq: &Cq, n: usize) -> Vec<Wc> {
    let mut v = Vec::new();
    let t = Instant::now();
    let mut b = [lwio_rdma::Wc::BLANK; 8];
    while v.len() < n {
        let k = cq.poll(&mut b).unwrap();
        v.extend_from_slice(&b[..k]);
        assert!(t.elapsed() < Duration::from_secs(10), "timeout: {v:?}");
        std::thread::sleep(Duration::from_micros(100));
    }
    v
}

/// Drive `h` over `s` until an event; returns it and any bytes read past
/// the handshake.
fn handshake(h: &mut MpaHandshake, s: &mut TcpStream) -> (MpaEvent, Vec<u8>) {
    let mut buf = vec![0u8; 4096];
    let mut pending: Vec<u8> = Vec::new();
    loop {
        while let Some(out) = h.poll_transmit() {
            s.write_all(&out).unwrap();
        }
        if let Some(e) = h.poll_event() {
            return (e, pending);
        }
        if pending.is_empty() {
            let n = s.read(&mut buf).unwrap();
            assert!(n > 0, "peer closed during the handshake");
            pending.extend_from_slice(&buf[..n]);
        }
        let used = h.receive(&pending, Instant::now()).unwrap();
        pending.drain(..used);
        if used == 0 && h.poll_event().is_none() && h.poll_transmit().is_none() {
            let n = s.read(&mut buf).unwrap();
            assert!(n > 0);
            pending.extend_from_slice(&buf[..n]);
        }
    }
}

/// Read FPDUs from `s` with the reference deframer until one full segment
/// arrived; returns (header kind, opcode, last, payload).
fn read_segment(
    s: &mut TcpStream,
    rx: &mut FpduReceiver,
    carry: &mut Vec<u8>,
) -> (Kind, u8, bool, Vec<u8>) {
    let mut payload = Vec::new();
    let mut hdr = None;
    let mut buf = vec![0u8; 65536];
    loop {
        while !carry.is_empty() {
            let (used, ev) = rx
                .poll(carry)
                .expect("reference deframer rejected our FPDU");
            let ev = ev.map(|e| match e {
                FpduEvent::Header { header, .. } => (
                    0,
                    Some((header.ddp, header.opcode as u8, header.last)),
                    Vec::new(),
                ),
                FpduEvent::Payload { data, .. } => (1, None, data.to_vec()),
                FpduEvent::End => (2, None, Vec::new()),
            });
            carry.drain(..used);
            match ev {
                Some((0, h, _)) => hdr = h,
                Some((1, _, d)) => payload.extend_from_slice(&d),
                Some((2, _, _)) => {
                    let (k, o, l) = hdr.expect("header before end");
                    return (k, o, l, payload);
                }
                _ => {
                    if used == 0 {
                        break;
                    }
                }
            }
        }
        let n = s.read(&mut buf).unwrap();
        assert!(n > 0, "soft peer closed");
        carry.extend_from_slice(&buf[..n]);
    }
}

fn reference_initiator(crc: bool) {
    let c = ctx(crc);
    let l = c.listen("127.0.0.1:0".parse().unwrap(), 4).unwrap();
    let addr = l.local_addr();
    let r = res(&c);
    let server = std::thread::spawn(move || {
        let req = l
            .get_request(Some(Duration::from_secs(10)))
            .unwrap()
            .unwrap();
        assert_eq!(req.private_data(), b"from siw-like");
        assert_eq!(req.peer_ird_ord(), (16, 16));
        let qp = req
            .accept(
                &r.init,
                &ConnParams {
                    private_data: b"soft says hi".to_vec(),
                    ird: 4,
                    ord: 4,
                },
            )
            .unwrap();
        (qp, r)
    });
    let mut s = TcpStream::connect(addr).unwrap();
    let mut cfg = MpaConfig::initiator_default();
    cfg.crc = if crc { IwCrc::On } else { IwCrc::Off };
    let mut h = MpaHandshake::initiator(cfg, b"from siw-like", Instant::now()).unwrap();
    let (ev, mut carry) = handshake(&mut h, &mut s);
    let (qp, r) = server.join().unwrap();
    let params = match ev {
        MpaEvent::Established {
            params,
            private_data,
        } => {
            assert_eq!(private_data, b"soft says hi");
            params
        }
        e => panic!("{e:?}"),
    };
    assert_eq!(params.crc, crc);
    assert!(params.enhanced);
    // siw's relaxed negotiation: we raised our IRD (asked 4) to the
    // initiator's ORD (16, within our maximum), so its ORD stays 16.
    assert_eq!(params.ord, 16);
    assert_eq!(qp.negotiated().ird, 16);
    assert_eq!(qp.negotiated().ord, 4, "our ORD ≤ the initiator's IRD");
    assert_eq!(qp.negotiated().mpa_crc, Some(crc));

    // Our Send, Write and Read Request, parsed by the reference deframer.
    let mr = r.pd.alloc_mr(200_000, Access::LOCAL_WRITE).unwrap();
    let data = lwio_rdma::conformance::pattern(1, 100_000);
    mr.write_at(0, &data).unwrap();
    let sg = [mr.sge(0, 100_000)];
    let sg2 = [mr.sge(100_000, 10)];
    qp.post_send(&[
        SendWr::new(1, SendOp::Send, &sg),
        SendWr::new(
            2,
            SendOp::Write {
                remote_addr: 0x1000,
                rkey: 0x4242,
            },
            &sg[..0],
        ),
        SendWr::new(
            3,
            SendOp::Read {
                remote_addr: 0x2000,
                rkey: 0x77,
            },
            &sg2,
        ),
    ])
    .unwrap();
    let mut rx = FpduReceiver::new(FpduConfig {
        crc,
        ..FpduConfig::default()
    });
    let mut got = Vec::new();
    loop {
        let (k, op, last, p) = read_segment(&mut s, &mut rx, &mut carry);
        match k {
            Kind::Untagged {
                qn: 0, msn: 1, mo, ..
            } => {
                assert_eq!(mo as usize, got.len());
                assert_eq!(op, 3, "Send opcode");
                got.extend_from_slice(&p);
                if last {
                    break;
                }
            }
            other => panic!("unexpected segment {other:?}"),
        }
    }
    assert_eq!(got, data);
    let (k, op, last, p) = read_segment(&mut s, &mut rx, &mut carry);
    assert!(
        matches!(
            k,
            Kind::Tagged {
                stag: 0x4242,
                to: 0x1000
            }
        ) && op == 0
            && last
            && p.is_empty()
    );
    let (k, op, last, _) = read_segment(&mut s, &mut rx, &mut carry);
    assert!(
        matches!(k, Kind::Untagged { qn: 1, msn: 1, .. }) && op == 1 && last,
        "{k:?} {op}"
    );

    // A Send and an RDMA Write built by the reference segmenter, to us.
    let rmr =
        r.pd.alloc_mr(300_000, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
            .unwrap();
    qp.post_recv(&[RecvWr {
        wr_id: 9,
        sg_list: &[rmr.sge(0, 150_000)],
    }])
    .unwrap();
    let mut tx = TxState::new();
    let tcfg = TxConfig::from_emss(1460, crc);
    let wdata = lwio_rdma::conformance::pattern(2, 70_001);
    for seg in tx
        .segment(
            &tcfg,
            &OutboundMessage::Write {
                stag: rmr.rkey(),
                to: rmr.addr() + 150_000,
            },
            wdata.len() as u32,
        )
        .unwrap()
    {
        let o = seg.payload_offset as usize;
        s.write_all(&seg.to_vec(&wdata[o..o + seg.payload_len as usize], crc))
            .unwrap();
    }
    let sdata = lwio_rdma::conformance::pattern(3, 123_457);
    for seg in tx
        .segment(
            &tcfg,
            &OutboundMessage::Send {
                solicited: false,
                invalidate: None,
            },
            sdata.len() as u32,
        )
        .unwrap()
    {
        let o = seg.payload_offset as usize;
        s.write_all(&seg.to_vec(&sdata[o..o + seg.payload_len as usize], crc))
            .unwrap();
    }
    let w = wait(&r.cq, 3);
    let recv = w
        .iter()
        .find(|w| w.opcode == WcOpcode::Recv)
        .expect("receive");
    assert!(recv.is_ok() && recv.byte_len == 123_457, "{recv:?}");
    let mut b = vec![0u8; 123_457];
    rmr.read_at(0, &mut b).unwrap();
    assert_eq!(b, sdata);
    let mut b = vec![0u8; 70_001];
    rmr.read_at(150_000, &mut b).unwrap();
    assert_eq!(b, wdata);
}

#[test]
fn reference_initiator_to_soft_responder_crc_off() {
    reference_initiator(false);
}

#[test]
fn reference_initiator_to_soft_responder_crc_on() {
    reference_initiator(true);
}

fn reference_responder(reject: bool) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let c = ctx(false);
    let r = res(&c);
    let client = std::thread::spawn(move || {
        let q = c.connect(
            addr,
            &r.init,
            &ConnParams {
                private_data: b"hello from soft".to_vec(),
                ird: 3,
                ord: 5,
            },
        );
        (q, r, c)
    });
    let (mut s, _) = l.accept().unwrap();
    let mut h = MpaHandshake::responder(MpaConfig::responder_default(), Instant::now());
    let (ev, _) = handshake(&mut h, &mut s);
    match ev {
        MpaEvent::ConnectRequest {
            private_data,
            peer,
            crc,
            revision,
        } => {
            assert_eq!(private_data, b"hello from soft");
            let p = peer.expect("enhanced");
            assert_eq!((p.ird, p.ord), (3, 5));
            assert!(!crc);
            assert_eq!(revision, 2);
        }
        e => panic!("{e:?}"),
    }
    if reject {
        h.reject(b"not now").unwrap();
    } else {
        let n = h.accept(b"welcome", 16, 16).unwrap();
        // Relaxed negotiation: responder ORD lowered to our IRD.
        assert_eq!(n.ord, 3);
    }
    while let Some(out) = h.poll_transmit() {
        s.write_all(&out).unwrap();
    }
    let (q, _r, _c) = client.join().unwrap();
    if reject {
        match q {
            Err(Error::Rejected { private_data }) => assert_eq!(private_data, b"not now"),
            Err(e) => panic!("{e}"),
            Ok(_) => panic!("accepted"),
        }
    } else {
        let qp = q.unwrap();
        let n = qp.negotiated();
        assert_eq!(n.peer_private_data, b"welcome");
        assert_eq!(n.mpa_crc, Some(false));
        assert!(n.ord >= 1 && n.ord <= 5, "{n:?}");
    }
}

#[test]
fn soft_initiator_to_reference_responder_accept() {
    reference_responder(false);
}

#[test]
fn soft_initiator_to_reference_responder_reject() {
    reference_responder(true);
}

/// A raw peer sends half of one RDMA Write segment and stalls; the program
/// deregisters the region meanwhile (the engine thread is in the middle of
/// placing the segment) and takes the memory back. Deregistration returns
/// without waiting for the peer, and once it has returned no byte of the
/// memory changes: the rest of the segment is refused (a Terminate, then the
/// connection closes). Before the fix the engine went on placing the rest
/// into the deregistered memory (issue 31).
#[test]
fn deregistration_while_the_peer_stalls_mid_segment() {
    for crc in [false, true] {
        stalled_segment_then_deregistration(crc);
    }
}

fn stalled_segment_then_deregistration(crc: bool) {
    let c = ctx(crc);
    let l = c.listen("127.0.0.1:0".parse().unwrap(), 4).unwrap();
    let addr = l.local_addr();
    let r = res(&c);
    let server = std::thread::spawn(move || {
        let req = l
            .get_request(Some(Duration::from_secs(10)))
            .unwrap()
            .unwrap();
        (req.accept(&r.init, &ConnParams::default()).unwrap(), r)
    });
    let mut s = TcpStream::connect(addr).unwrap();
    let mut cfg = MpaConfig::initiator_default();
    cfg.crc = if crc { IwCrc::On } else { IwCrc::Off };
    let mut h = MpaHandshake::initiator(cfg, b"", Instant::now()).unwrap();
    let (ev, _carry) = handshake(&mut h, &mut s);
    assert!(matches!(ev, MpaEvent::Established { .. }), "{ev:?}");
    let (qp, r) = server.join().unwrap();

    let len = 48 * 1024;
    let mut mem = vec![0u8; len];
    let base = mem.as_mut_ptr();
    // SAFETY: `mem` outlives the region and the QP (dropped last); the test
    // reads it only with volatile byte loads.
    let mr = unsafe {
        r.pd.register_raw(base, len, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
    }
    .unwrap();
    let data = vec![0xABu8; len];
    let mut tx = TxState::new();
    let segs: Vec<_> = tx
        .segment(
            &TxConfig::from_emss(65_000, crc),
            &OutboundMessage::Write {
                stag: mr.rkey(),
                to: mr.addr(),
            },
            len as u32,
        )
        .unwrap()
        .collect();
    assert_eq!(segs.len(), 1, "one segment");
    let bytes = segs[0].to_vec(&data, crc);
    let half = bytes.len() / 2;
    s.write_all(&bytes[..half]).unwrap();
    let peek = |i: usize| -> u8 {
        // SAFETY: inside `mem`, which is live; a byte load.
        unsafe { base.add(i).read_volatile() }
    };
    let t = Instant::now();
    while peek(len / 4) != 0xAB {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "crc={crc}: first half not placed"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    let t = Instant::now();
    drop(mr);
    assert!(
        t.elapsed() < Duration::from_secs(2),
        "crc={crc}: deregistration waited {:?} for a stalled peer",
        t.elapsed()
    );
    let snapshot: Vec<u8> = (0..len).map(peek).collect();
    assert!(snapshot[len - 64..].iter().all(|&b| b == 0), "crc={crc}");
    // The peer goes on with the rest of the segment; the soft side answers
    // with a Terminate and closes (or, before the fix, placed it silently).
    let _ = s.write_all(&bytes[half..]);
    s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let closed = loop {
        match s.read(&mut buf) {
            Ok(0) => break true,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => break true,
            Err(_) => break false,
        }
    };
    let after: Vec<u8> = (0..len).map(peek).collect();
    let changed = after.iter().zip(&snapshot).filter(|(a, b)| a != b).count();
    assert!(
        changed == 0,
        "crc={crc}: {changed} bytes of the deregistered memory changed after deregistration returned"
    );
    assert!(
        closed && !got.is_empty(),
        "crc={crc}: a Terminate, then the close ({} bytes)",
        got.len()
    );
    drop(qp);
    drop(r);
    drop(mem);
}
