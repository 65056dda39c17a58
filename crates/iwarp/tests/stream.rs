//! Transmit → receive round trips over a byte stream split every way.

use std::collections::HashMap;

use lwio_iwarp::fpdu_rx::{FpduConfig, FpduEvent, FpduReceiver};
use lwio_iwarp::rx::*;
use lwio_iwarp::tx::*;
use lwio_iwarp::wire::ddp::Kind;
use lwio_iwarp::wire::rdmap::{Opcode, ReadRequest, TerminateRepr};
use lwio_iwarp::wire::segment::SegmentHeader;
use lwio_iwarp::wire::term::{TermError, TermKind};

#[derive(Default, Debug, PartialEq)]
struct Mem {
    tagged: HashMap<u32, Vec<u8>>,
    recv: Vec<u8>,
    done: Vec<Segment>,
    terms: Vec<TerminateRepr>,
    checks: usize,
    fail_tagged: Option<TermError>,
    fail_untagged: Option<TermError>,
    recv_cap: usize,
}

impl Placement for Mem {
    fn check_tagged(&mut self, seg: &TaggedSegment) -> Result<(), TermError> {
        self.checks += 1;
        if let Some(e) = self.fail_tagged {
            return Err(e);
        }
        let buf = self
            .tagged
            .get(&seg.stag)
            .ok_or(TermError::from(TermKind::DdpTaggedInvalidStag))?;
        if seg.to + seg.len as u64 > buf.len() as u64 {
            return Err(TermKind::DdpTaggedBaseBounds.into());
        }
        Ok(())
    }
    fn place_tagged(&mut self, stag: u32, to: u64, data: &[u8]) -> Result<(), TermError> {
        let b = self.tagged.get_mut(&stag).unwrap();
        b[to as usize..to as usize + data.len()].copy_from_slice(data);
        Ok(())
    }
    fn check_untagged(&mut self, seg: &UntaggedSegment) -> Result<(), TermError> {
        self.checks += 1;
        if let Some(e) = self.fail_untagged {
            return Err(e);
        }
        if seg.qn == 0 && (seg.mo + seg.len) as usize > self.recv_cap {
            return Err(TermKind::DdpUntaggedMessageTooLong.into());
        }
        Ok(())
    }
    fn place_untagged(
        &mut self,
        _qn: u32,
        _msn: u32,
        mo: u32,
        data: &[u8],
    ) -> Result<(), TermError> {
        let end = mo as usize + data.len();
        if self.recv.len() < end {
            self.recv.resize(end, 0);
        }
        self.recv[mo as usize..end].copy_from_slice(data);
        Ok(())
    }
    fn segment_done(&mut self, seg: &Segment) -> Result<(), TermError> {
        self.done.push(*seg);
        Ok(())
    }
    fn terminate(&mut self, term: &TerminateRepr) {
        self.terms.push(*term);
    }
}

const RR: ReadRequest = ReadRequest {
    sink_stag: 1,
    sink_to: 2,
    size: 3,
    src_stag: 4,
    src_to: 5,
};

fn build_stream(crc: bool, emss: u32) -> (Vec<u8>, Vec<u8>, Vec<u8>) {
    let cfg = TxConfig::from_emss(emss, crc);
    let mut tx = TxState::new();
    let send: Vec<u8> = (0..300u32).map(|i| (i * 7) as u8).collect();
    let write: Vec<u8> = (0..157u32).map(|i| (i * 13 + 1) as u8).collect();
    let mut out = Vec::new();
    let mut emit = |msg: OutboundMessage, payload: &[u8], tx: &mut TxState| {
        for s in tx.segment(&cfg, &msg, payload.len() as u32).unwrap() {
            let p =
                &payload[s.payload_offset as usize..(s.payload_offset + s.payload_len) as usize];
            out.extend_from_slice(&s.to_vec(p, crc));
        }
    };
    emit(
        OutboundMessage::Send {
            solicited: true,
            invalidate: Some(0x77),
        },
        &send,
        &mut tx,
    );
    emit(OutboundMessage::Write { stag: 5, to: 3 }, &write, &mut tx);
    emit(OutboundMessage::Write { stag: 5, to: 0 }, &[], &mut tx);
    emit(OutboundMessage::ReadRequest(RR), &[], &mut tx);
    emit(
        OutboundMessage::Send {
            solicited: false,
            invalidate: None,
        },
        &[],
        &mut tx,
    );
    let hdr = [0xc1, 0x40, 0, 0, 0, 9, 0, 0, 0, 0, 0, 0, 0, 0];
    emit(
        OutboundMessage::Terminate(TerminateRepr::for_segment(
            TermKind::DdpTaggedBaseBounds.into(),
            99,
            &hdr,
        )),
        &[],
        &mut tx,
    );
    (out, send, write)
}

fn mem() -> Mem {
    let mut m = Mem {
        recv_cap: 4096,
        ..Default::default()
    };
    m.tagged.insert(5, vec![0; 200]);
    m
}

fn check_result(m: &Mem, send: &[u8], write: &[u8]) {
    assert_eq!(&m.recv[..], send);
    assert_eq!(&m.tagged[&5][3..160], write);
    assert_eq!(m.terms.len(), 1);
    assert_eq!(m.terms[0].error.kind(), Some(TermKind::DdpTaggedBaseBounds));
    assert_eq!(
        m.terms[0].copied_ddp().unwrap().kind,
        Kind::Tagged { stag: 9, to: 0 }
    );
    let lasts: Vec<_> = m.done.iter().filter(|s| s.last()).collect();
    assert_eq!(lasts.len(), 5);
    match lasts[0] {
        Segment::Untagged(u) => {
            assert_eq!(u.opcode, Opcode::SendSeInvalidate);
            assert_eq!(u.inv_stag, Some(0x77));
            assert_eq!(u.msn, 1);
        }
        s => panic!("{s:?}"),
    }
    match lasts[3] {
        Segment::Untagged(u) => {
            assert_eq!(u.read_request.unwrap().src_to, 5);
            assert_eq!(u.msn, 1);
        }
        s => panic!("{s:?}"),
    }
    match lasts[4] {
        Segment::Untagged(u) => assert_eq!(u.msn, 2),
        s => panic!("{s:?}"),
    }
}

#[test]
fn every_split_point_and_chunk_size() {
    for crc in [false, true] {
        let (stream, send, write) = build_stream(crc, 64);
        // Fixed chunk sizes 1, 2, 3, ...
        for chunk in [1usize, 2, 3, 5, 7, 64, 1000] {
            let mut rx = RdmapReceiver::new(FpduConfig {
                crc,
                ..Default::default()
            });
            let mut m = mem();
            for c in stream.chunks(chunk) {
                assert_eq!(rx.receive(c, &mut m).unwrap(), c.len());
            }
            check_result(&m, &send, &write);
            assert!(rx.terminated());
        }
        // Every single split point.
        for at in 0..=stream.len() {
            let mut rx = RdmapReceiver::new(FpduConfig {
                crc,
                ..Default::default()
            });
            let mut m = mem();
            rx.receive(&stream[..at], &mut m).unwrap();
            rx.receive(&stream[at..], &mut m).unwrap();
            check_result(&m, &send, &write);
        }
    }
}

#[test]
fn low_level_events_every_split() {
    let (stream, _, _) = build_stream(true, 64);
    let collect = |chunk: usize| {
        let mut rx = FpduReceiver::new(FpduConfig {
            crc: true,
            ..Default::default()
        });
        let mut hdrs = Vec::new();
        let mut payload = Vec::new();
        let mut ends = 0;
        for c in stream.chunks(chunk) {
            let mut off = 0;
            while off < c.len() {
                let (n, ev) = rx.poll(&c[off..]).unwrap();
                assert!(n > 0);
                off += n;
                match ev {
                    Some(FpduEvent::Header { header, .. }) => hdrs.push(header),
                    Some(FpduEvent::Payload { offset, data }) => {
                        payload.push((hdrs.len(), offset, data.to_vec()))
                    }
                    Some(FpduEvent::End) => ends += 1,
                    None => {}
                }
            }
        }
        assert!(rx.at_boundary());
        let flat: Vec<u8> = payload.iter().flat_map(|p| p.2.clone()).collect();
        (hdrs, flat, ends)
    };
    let reference = collect(stream.len());
    for chunk in 1..40 {
        assert_eq!(collect(chunk), reference);
    }
    assert_eq!(reference.0.len(), reference.2);
}

fn seg(op: Opcode, last: bool, ddp: Kind) -> SegmentHeader {
    SegmentHeader {
        opcode: op,
        last,
        ddp,
        read_request: (op == Opcode::ReadRequest).then(ReadRequest::default),
    }
}
fn ut(qn: u32, msn: u32, mo: u32) -> Kind {
    Kind::Untagged {
        rsvd_ulp: 0,
        qn,
        msn,
        mo,
    }
}

#[test]
fn ddp_validation_errors() {
    use TermKind::*;
    let s = DdpRxState::new();
    let k = |st: &DdpRxState, h: SegmentHeader, len: u32| st.validate(&h, len).unwrap_err().kind();
    let fresh = [
        (
            seg(Opcode::Send, true, ut(3, 1, 0)),
            0,
            DdpUntaggedInvalidQn,
        ),
        (
            seg(Opcode::Send, true, ut(1, 1, 0)),
            0,
            DdpUntaggedInvalidQn,
        ),
        (seg(Opcode::Send, true, ut(0, 2, 0)), 0, DdpUntaggedMsnRange),
        (
            seg(Opcode::Send, true, ut(0, 1, 4)),
            0,
            DdpUntaggedInvalidMo,
        ),
        (
            seg(Opcode::ReadRequest, true, ut(1, 1, 0)),
            4,
            DdpUntaggedMessageTooLong,
        ),
        (
            seg(Opcode::ReadRequest, false, ut(1, 1, 0)),
            0,
            DdpUntaggedMessageTooLong,
        ),
        (
            seg(Opcode::Terminate, true, ut(2, 1, 0)),
            100,
            DdpUntaggedMessageTooLong,
        ),
        // RFC 7306 Immediate Data: one segment of exactly 8 bytes, on QN 0.
        (
            seg(Opcode::ImmediateData, true, ut(0, 1, 0)),
            4,
            DdpUntaggedMessageTooLong,
        ),
        (
            seg(Opcode::ImmediateDataSe, true, ut(0, 1, 0)),
            9,
            DdpUntaggedMessageTooLong,
        ),
        (
            seg(Opcode::ImmediateData, false, ut(0, 1, 0)),
            8,
            DdpUntaggedMessageTooLong,
        ),
        (
            seg(Opcode::ImmediateData, true, ut(1, 1, 0)),
            8,
            DdpUntaggedInvalidQn,
        ),
        (
            seg(
                Opcode::Write,
                true,
                Kind::Tagged {
                    stag: 1,
                    to: u64::MAX,
                },
            ),
            2,
            DdpTaggedToWrap,
        ),
    ];
    for (h, len, want) in fresh {
        assert_eq!(k(&s, h, len), Some(want), "{h:?}");
    }
    let imm = s
        .validate(&seg(Opcode::ImmediateDataSe, true, ut(0, 1, 0)), 8)
        .unwrap();
    assert!(matches!(imm, Segment::Untagged(u) if u.qn == 0 && u.len == 8 && u.last));
    // In-progress messages.
    let mut s2 = DdpRxState::new();
    let first = s2
        .validate(&seg(Opcode::Send, false, ut(0, 1, 0)), 8)
        .unwrap();
    s2.commit(&first);
    assert_eq!(
        k(&s2, seg(Opcode::Send, true, ut(0, 2, 0)), 0),
        Some(DdpUntaggedMsnRange)
    );
    assert_eq!(
        k(&s2, seg(Opcode::Send, true, ut(0, 1, 4)), 0),
        Some(DdpUntaggedInvalidMo)
    );
    assert_eq!(
        k(&s2, seg(Opcode::SendSe, true, ut(0, 1, 8)), 0),
        Some(RdmapOpUnexpectedOpcode)
    );
    // An Immediate Data message cannot continue an unfinished Send.
    assert_eq!(
        k(&s2, seg(Opcode::ImmediateData, true, ut(0, 1, 8)), 8),
        Some(RdmapOpUnexpectedOpcode)
    );
    // A Read Request may interleave with an unfinished Send.
    assert!(s2
        .validate(&seg(Opcode::ReadRequest, true, ut(1, 1, 0)), 0)
        .is_ok());
    let fin = s2
        .validate(&seg(Opcode::Send, true, ut(0, 1, 8)), 2)
        .unwrap();
    s2.commit(&fin);
    assert_eq!(s2.expected_msn(0), Some(2));
    let w = s2
        .validate(
            &seg(Opcode::Write, false, Kind::Tagged { stag: 1, to: 0 }),
            4,
        )
        .unwrap();
    s2.commit(&w);
    assert_eq!(
        k(
            &s2,
            seg(Opcode::ReadResponse, true, Kind::Tagged { stag: 1, to: 0 }),
            4
        ),
        Some(RdmapOpUnexpectedOpcode)
    );
}

fn one(msg: OutboundMessage, payload: &[u8], crc: bool) -> Vec<u8> {
    let cfg = TxConfig::from_emss(1460, crc);
    let mut tx = TxState::new();
    let mut out = Vec::new();
    for s in tx.segment(&cfg, &msg, payload.len() as u32).unwrap() {
        let p = &payload[s.payload_offset as usize..(s.payload_offset + s.payload_len) as usize];
        out.extend_from_slice(&s.to_vec(p, crc));
    }
    out
}

#[test]
fn receiver_errors_produce_terminates() {
    // Unknown STag → DDP tagged invalid STag with the header copied.
    let w = one(OutboundMessage::Write { stag: 42, to: 0 }, b"abcd", false);
    let mut rx = RdmapReceiver::new(FpduConfig::default());
    let mut m = mem();
    let e = rx.receive(&w, &mut m).unwrap_err();
    assert_eq!(e.error.kind(), Some(TermKind::DdpTaggedInvalidStag));
    let t = e.terminate.to_vec();
    assert_eq!(&t[..6], &[0x11, 0x00, 0xc0, 0x00, 0x00, 18]);
    assert_eq!(&t[6..8], &[0xc1, 0x40]);
    assert!(m.tagged[&5].iter().all(|b| *b == 0));
    assert_eq!(rx.receive(&[], &mut m).unwrap_err(), e);
    // Out of bounds: nothing written.
    let w = one(OutboundMessage::Write { stag: 5, to: 198 }, b"abcd", false);
    let mut rx = RdmapReceiver::new(FpduConfig::default());
    let mut m = mem();
    let e = rx.receive(&w, &mut m).unwrap_err();
    assert_eq!(e.error.kind(), Some(TermKind::DdpTaggedBaseBounds));
    assert!(m.tagged[&5].iter().all(|b| *b == 0));
    // Zero-length Write (P2P RTR to STag 1) is not checked.
    let w = one(OutboundMessage::Write { stag: 1, to: 0 }, b"", false);
    let mut rx = RdmapReceiver::new(FpduConfig::default());
    let mut m = mem();
    rx.receive(&w, &mut m).unwrap();
    assert_eq!((m.checks, m.done.len()), (0, 1));
    // No receive buffer.
    let s = one(
        OutboundMessage::Send {
            solicited: false,
            invalidate: None,
        },
        b"xy",
        false,
    );
    let mut rx = RdmapReceiver::new(FpduConfig::default());
    let mut m = mem();
    m.fail_untagged = Some(TermKind::DdpUntaggedMsnNoBuffer.into());
    let e = rx.receive(&s, &mut m).unwrap_err();
    assert_eq!(e.error.kind(), Some(TermKind::DdpUntaggedMsnNoBuffer));
    assert_eq!(e.terminate.buffer_len(), 4 + 2 + 18);
    // Message too long for the posted buffer.
    let mut rx = RdmapReceiver::new(FpduConfig::default());
    let mut m = mem();
    m.recv_cap = 1;
    let e = rx.receive(&s, &mut m).unwrap_err();
    assert_eq!(e.error.kind(), Some(TermKind::DdpUntaggedMessageTooLong));
    // CRC corruption in the payload.
    let mut w = one(OutboundMessage::Write { stag: 5, to: 0 }, b"abcd", true);
    w[17] ^= 0x40;
    let mut rx = RdmapReceiver::new(FpduConfig {
        crc: true,
        ..Default::default()
    });
    let mut m = mem();
    let e = rx.receive(&w, &mut m).unwrap_err();
    assert_eq!(e.error.kind(), Some(TermKind::MpaCrc));
    assert!(m.done.is_empty());
    // Protection error on a Read Request copies DDP + RDMAP headers.
    let rr = one(OutboundMessage::ReadRequest(RR), &[], false);
    let mut rx = RdmapReceiver::new(FpduConfig::default());
    let mut m = mem();
    m.fail_untagged = Some(TermKind::RdmapProtInvalidStag.into());
    let e = rx.receive(&rr, &mut m).unwrap_err();
    assert!(e.terminate.flag_r);
    assert_eq!(e.terminate.copied_read_request().unwrap().src_stag, 4);
    // Unsupported RDMAP version: nothing copied.
    let mut bad = one(OutboundMessage::Write { stag: 5, to: 0 }, b"abcd", false);
    bad[3] = 0x80;
    let mut rx = RdmapReceiver::new(FpduConfig::default());
    let e = rx.receive(&bad, &mut mem()).unwrap_err();
    assert_eq!(e.error.kind(), Some(TermKind::RdmapOpInvalidVersion));
    assert_eq!(e.terminate.buffer_len(), 4);
}
