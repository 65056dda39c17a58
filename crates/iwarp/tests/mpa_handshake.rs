use std::time::{Duration, Instant};

use lwio_iwarp::mpa::*;
use lwio_iwarp::wire::mpa::{IrdOrd, KEY_REP, KEY_REQ};
use lwio_iwarp::wire::term::TermKind;

fn feed_split(h: &mut MpaHandshake, bytes: &[u8], chunk: usize, now: Instant) -> usize {
    let mut used = 0;
    for c in bytes.chunks(chunk.max(1)) {
        let n = h.receive(c, now).unwrap();
        used += n;
        if n < c.len() {
            break;
        }
    }
    used
}

fn run(icfg: MpaConfig, rcfg: MpaConfig, split: usize) -> (Negotiated, Negotiated) {
    let now = Instant::now();
    let mut i = MpaHandshake::initiator(icfg, b"hello", now).unwrap();
    let mut r = MpaHandshake::responder(rcfg, now);
    let req = i.poll_transmit().unwrap();
    assert_eq!(feed_split(&mut r, &req, split, now), req.len());
    let Some(MpaEvent::ConnectRequest { private_data, .. }) = r.poll_event() else {
        panic!("no request")
    };
    assert_eq!(private_data, b"hello");
    let rn = r.accept(b"world!", 8, 8).unwrap();
    let rep = r.poll_transmit().unwrap();
    // Reply followed by FPDU bytes: those are left unconsumed.
    let mut stream = rep.clone();
    stream.extend_from_slice(&[0xde, 0xad]);
    let used = feed_split(&mut i, &stream, split, now);
    assert_eq!(used, rep.len());
    let Some(MpaEvent::Established {
        params,
        private_data,
    }) = i.poll_event()
    else {
        panic!("not established")
    };
    assert_eq!(private_data, b"world!");
    assert!(i.is_established() && r.is_established());
    (params, rn)
}

#[test]
fn siw_default_request_bytes() {
    let i = MpaHandshake::initiator(MpaConfig::initiator_default(), &[], Instant::now());
    let req = i.unwrap().poll_transmit().unwrap();
    let mut expect = KEY_REQ.to_vec();
    expect.extend_from_slice(&[0x10, 0x02, 0x00, 0x04, 0x00, 0x10, 0x00, 0x10]);
    assert_eq!(req, expect);
}

#[test]
fn every_split() {
    for split in 1..80 {
        let (a, b) = run(
            MpaConfig::initiator_default(),
            MpaConfig::responder_default(),
            split,
        );
        assert!(a.enhanced && b.enhanced && !a.crc && !b.crc);
        assert_eq!((a.ird, a.ord, b.ird, b.ord), (16, 16, 16, 8));
    }
}

#[test]
fn crc_negotiation() {
    use CrcPolicy::*;
    for (ip, rp, on) in [
        (Off, Off, false),
        (On, Off, true),
        (Off, On, true),
        (On, On, true),
    ] {
        let mut ic = MpaConfig::initiator_default();
        ic.crc = ip;
        let mut rc = MpaConfig::responder_default();
        rc.crc = rp;
        let (a, b) = run(ic, rc, 7);
        assert_eq!((a.crc, b.crc), (on, on), "{ip:?} {rp:?}");
    }
    // Responder forbids CRC: reject reply without C.
    let now = Instant::now();
    let mut ic = MpaConfig::initiator_default();
    ic.crc = On;
    let mut rc = MpaConfig::responder_default();
    rc.crc = Forbid;
    let mut i = MpaHandshake::initiator(ic, &[], now).unwrap();
    let mut r = MpaHandshake::responder(rc, now);
    assert!(r.receive(&i.poll_transmit().unwrap(), now).is_err());
    let rep = r.poll_transmit().unwrap();
    assert_eq!(rep[16], 0x30); // R + E, no C
    i.receive(&rep, now).unwrap();
    assert!(matches!(i.poll_event(), Some(MpaEvent::Rejected { .. })));
    // Initiator forbids CRC but responder sets C.
    let mut ic = MpaConfig::initiator_default();
    ic.crc = Forbid;
    let mut i = MpaHandshake::initiator(ic, &[], now).unwrap();
    let mut rep = KEY_REP.to_vec();
    rep.extend_from_slice(&[0x50, 2, 0, 4, 0, 1, 0, 1]);
    assert!(i.receive(&rep, now).is_err());
    // Responder dropping a requested CRC is a protocol error.
    let mut ic = MpaConfig::initiator_default();
    ic.crc = On;
    let mut i = MpaHandshake::initiator(ic, &[], now).unwrap();
    rep[16] = 0x10;
    assert!(i.receive(&rep, now).is_err());
}

#[test]
fn reject_with_private_data() {
    let now = Instant::now();
    let mut i = MpaHandshake::initiator(MpaConfig::initiator_default(), &[], now).unwrap();
    let mut r = MpaHandshake::responder(MpaConfig::responder_default(), now);
    r.receive(&i.poll_transmit().unwrap(), now).unwrap();
    r.poll_event().unwrap();
    r.reject(b"go away").unwrap();
    assert!(r.is_closed());
    let rep = r.poll_transmit().unwrap();
    for split in 1..rep.len() {
        let mut i2 = MpaHandshake::initiator(MpaConfig::initiator_default(), &[], now).unwrap();
        feed_split(&mut i2, &rep, split, now);
        assert_eq!(
            i2.poll_event(),
            Some(MpaEvent::Rejected {
                private_data: b"go away".to_vec()
            })
        );
        assert!(i2.is_closed());
    }
    i.receive(&rep, now).unwrap();
    assert!(r.accept(&[], 1, 1).is_err());
}

#[test]
fn markers_rejected_like_siw() {
    let now = Instant::now();
    let mut r = MpaHandshake::responder(MpaConfig::responder_default(), now);
    let mut req = KEY_REQ.to_vec();
    req.extend_from_slice(&[0x90, 2, 0, 4, 0, 4, 0, 4]);
    assert!(r.receive(&req, now).is_err());
    let rep = r.poll_transmit().unwrap();
    let mut expect = KEY_REP.to_vec();
    expect.extend_from_slice(&[0x30, 2, 0, 4, 0, 0, 0, 0]);
    assert_eq!(rep, expect);
    // Initiator getting M=1 fails without a Terminate.
    let mut i = MpaHandshake::initiator(MpaConfig::initiator_default(), &[], now).unwrap();
    let mut rep = KEY_REP.to_vec();
    rep.extend_from_slice(&[0x90, 2, 0, 4, 0, 4, 0, 4]);
    assert!(matches!(
        i.receive(&rep, now),
        Err(MpaError::Protocol {
            terminate: None,
            ..
        })
    ));
}

#[test]
fn protocol_errors() {
    let now = Instant::now();
    // Bad reply key: Terminate "invalid request/reply".
    let mut i = MpaHandshake::initiator(MpaConfig::initiator_default(), &[], now).unwrap();
    let mut rep = KEY_REQ.to_vec();
    rep.extend_from_slice(&[0x10, 2, 0, 4, 0, 4, 0, 4]);
    match i.receive(&rep, now) {
        Err(MpaError::Protocol {
            terminate: Some(t), ..
        }) => assert_eq!(t.kind(), Some(TermKind::MpaInvalidReqRep)),
        other => panic!("{other:?}"),
    }
    // Rev 1 reply to an enhanced request.
    let mut i = MpaHandshake::initiator(MpaConfig::initiator_default(), &[], now).unwrap();
    let mut rep = KEY_REP.to_vec();
    rep.extend_from_slice(&[0x00, 1, 0, 0]);
    assert!(i.receive(&rep, now).is_err());
    // Bad request key, Rev 3, oversize PD: responder closes without reply.
    for hdr in [[0u8, 1, 0, 0], [0, 3, 0, 0], [0, 1, 2, 1]] {
        let mut r = MpaHandshake::responder(MpaConfig::responder_default(), now);
        let mut req = if hdr[1] == 1 && hdr[2] == 0 {
            KEY_REP.to_vec()
        } else {
            KEY_REQ.to_vec()
        };
        req.extend_from_slice(&hdr);
        assert!(r.receive(&req, now).is_err());
        assert!(r.poll_transmit().is_none());
    }
    // Enhanced without IRD/ORD words → reject.
    let mut r = MpaHandshake::responder(MpaConfig::responder_default(), now);
    let mut req = KEY_REQ.to_vec();
    req.extend_from_slice(&[0x10, 2, 0, 2, 1, 2]);
    assert!(r.receive(&req, now).is_err());
    assert_eq!(r.poll_transmit().unwrap()[16] & 0x20, 0x20);
    // Data before reply.
    let mut r = MpaHandshake::responder(MpaConfig::responder_default(), now);
    let mut req = KEY_REQ.to_vec();
    req.extend_from_slice(&[0x00, 1, 0, 0, 0xff]);
    assert_eq!(r.receive(&req, now).unwrap(), 20);
    assert!(r.receive(&[0xff], now).is_err());
    // Usage errors.
    let mut c = MpaConfig::initiator_default();
    c.revision = 3;
    assert!(MpaHandshake::initiator(c, &[], now).is_err());
    assert!(MpaHandshake::initiator(MpaConfig::initiator_default(), &[0; 509], now).is_err());
    assert!(MpaHandshake::initiator(MpaConfig::initiator_default(), &[0; 508], now).is_ok());
}

#[test]
fn ird_ord_and_p2p() {
    let now = Instant::now();
    let mut ic = MpaConfig::initiator_default();
    ic.p2p = true;
    ic.ird = 4;
    ic.ord = 0;
    let mut i = MpaHandshake::initiator(ic.clone(), &[], now).unwrap();
    let req = i.poll_transmit().unwrap();
    // P2P + IRD 4, Write|Read RTR + ORD forced to 1.
    assert_eq!(&req[20..24], &[0x80, 0x04, 0xc0, 0x01]);
    let mut r = MpaHandshake::responder(MpaConfig::responder_default(), now);
    r.receive(&req, now).unwrap();
    match r.poll_event() {
        Some(MpaEvent::ConnectRequest { peer: Some(p), .. }) => {
            assert!(p.p2p && p.write_rtr && p.read_rtr)
        }
        e => panic!("{e:?}"),
    }
    let rn = r.accept(&[], 2, 16).unwrap();
    // ORD lowered to peer IRD (4); IRD raised to peer ORD (1) — already 2.
    assert_eq!((rn.ird, rn.ord, rn.rtr), (2, 4, Some(RtrType::Write)));
    let rep = r.poll_transmit().unwrap();
    assert_eq!(&rep[20..24], &[0x80, 0x02, 0x80, 0x04]);
    i.receive(&rep, now).unwrap();
    let n = i.negotiated().unwrap();
    assert_eq!((n.ird, n.ord, n.rtr), (4, 1, Some(RtrType::Write)));
    assert!(n.rtr_message().is_some());

    // Reply with no matching RTR → Terminate.
    let mut i = MpaHandshake::initiator(ic.clone(), &[], now).unwrap();
    let mut rep = KEY_REP.to_vec();
    rep.extend_from_slice(&[0x10, 2, 0, 4, 0x80, 1, 0x00, 1]);
    match i.receive(&rep, now) {
        Err(MpaError::Protocol {
            terminate: Some(t), ..
        }) => assert_eq!(t.kind(), Some(TermKind::MpaNoMatchingRtr)),
        e => panic!("{e:?}"),
    }
    // Responder ORD beyond our max IRD → insufficient IRD.
    let mut i = MpaHandshake::initiator(ic.clone(), &[], now).unwrap();
    let mut rep = KEY_REP.to_vec();
    let words = IrdOrd {
        ird: 1,
        ord: 1000,
        p2p: true,
        write_rtr: true,
        ..Default::default()
    }
    .to_bytes();
    rep.extend_from_slice(&[0x10, 2, 0, 4]);
    rep.extend_from_slice(&words);
    match i.receive(&rep, now) {
        Err(MpaError::Protocol {
            terminate: Some(t), ..
        }) => assert_eq!(t.kind(), Some(TermKind::MpaInsufficientIrd)),
        e => panic!("{e:?}"),
    }
    // Read RTR when only Read is offered.
    ic.rtr_write = false;
    let mut i = MpaHandshake::initiator(ic, &[], now).unwrap();
    let mut r = MpaHandshake::responder(MpaConfig::responder_default(), now);
    r.receive(&i.poll_transmit().unwrap(), now).unwrap();
    assert_eq!(r.accept(&[], 1, 1).unwrap().rtr, Some(RtrType::Read));
    i.receive(&r.poll_transmit().unwrap(), now).unwrap();
    assert_eq!(i.negotiated().unwrap().rtr, Some(RtrType::Read));
}

#[test]
fn responder_caps_ird_like_siw() {
    let now = Instant::now();
    let mut ic = MpaConfig::initiator_default();
    ic.ord = 1000;
    ic.max_ord = 1000;
    let mut i = MpaHandshake::initiator(ic, &[], now).unwrap();
    let mut r = MpaHandshake::responder(MpaConfig::responder_default(), now);
    r.receive(&i.poll_transmit().unwrap(), now).unwrap();
    let rn = r.accept(&[], 4, 4).unwrap();
    assert_eq!(rn.ird, 128);
    i.receive(&r.poll_transmit().unwrap(), now).unwrap();
    assert_eq!(i.negotiated().unwrap().ord, 128);
}

#[test]
fn rev1_interop() {
    let mut ic = MpaConfig::initiator_default();
    ic.revision = 1;
    let (a, b) = run(ic, MpaConfig::responder_default(), 3);
    assert!(!a.enhanced && !b.enhanced);
    assert_eq!(a.revision, 1);
}

#[test]
fn timeout() {
    let now = Instant::now();
    let mut i = MpaHandshake::initiator(MpaConfig::initiator_default(), &[], now).unwrap();
    let t = i.poll_timeout().unwrap();
    assert_eq!(t, now + Duration::from_secs(10));
    assert!(i.handle_timeout(now + Duration::from_secs(9)).is_ok());
    assert_eq!(
        i.handle_timeout(now + Duration::from_secs(10)),
        Err(MpaError::Timeout)
    );
    assert!(i.is_closed());
    let mut r = MpaHandshake::responder(MpaConfig::responder_default(), now);
    assert_eq!(r.poll_timeout(), Some(now + Duration::from_secs(5)));
    assert_eq!(
        r.receive(&KEY_REQ[..3], now + Duration::from_secs(6)),
        Err(MpaError::Timeout)
    );
}
