//! Bounded property tests: random input never panics; emit → parse round
//! trips; segmenter → receiver round trips.

use std::time::Instant;

use lwio_iwarp::fpdu_rx::{FpduConfig, FpduReceiver};
use lwio_iwarp::mpa::{MpaConfig, MpaHandshake};
use lwio_iwarp::rx::*;
use lwio_iwarp::tx::*;
use lwio_iwarp::wire::ddp::Kind;
use lwio_iwarp::wire::mpa::{FrameKind, FramePacket, FrameRepr, IrdOrd, IrdOrdPacket};
use lwio_iwarp::wire::rdmap::{Opcode, ReadRequest, TerminatePacket, TerminateRepr};
use lwio_iwarp::wire::segment::SegmentHeader;
use lwio_iwarp::wire::term::{TermError, TermKind};
use proptest::prelude::*;

struct Sink(Vec<u8>);
impl Placement for Sink {
    fn check_tagged(&mut self, _: &TaggedSegment) -> Result<(), TermError> {
        Ok(())
    }
    fn place_tagged(&mut self, _: u32, _: u64, d: &[u8]) -> Result<(), TermError> {
        self.0.extend_from_slice(d);
        Ok(())
    }
    fn check_untagged(&mut self, _: &UntaggedSegment) -> Result<(), TermError> {
        Ok(())
    }
    fn place_untagged(&mut self, _: u32, _: u32, _: u32, d: &[u8]) -> Result<(), TermError> {
        self.0.extend_from_slice(d);
        Ok(())
    }
    fn segment_done(&mut self, _: &Segment) -> Result<(), TermError> {
        Ok(())
    }
    fn terminate(&mut self, _: &TerminateRepr) {}
}

fn opcode() -> impl Strategy<Value = Opcode> {
    (0u8..8).prop_map(|v| Opcode::from_raw(v).unwrap())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn random_bytes_never_panic(data in proptest::collection::vec(any::<u8>(), 0..600), split in 0usize..600) {
        if let Ok(p) = FramePacket::new_checked(&data[..]) {
            let _ = FrameRepr::parse(&p);
        }
        if let Ok(p) = TerminatePacket::new_checked(&data[..]) {
            if let Ok(t) = TerminateRepr::parse(&p) {
                let _ = t.copied_ddp();
                let _ = t.copied_read_request();
                let _ = t.to_vec();
            }
        }
        let _ = SegmentHeader::parse(&data);
        let at = split.min(data.len());
        for crc in [false, true] {
            let mut rx = RdmapReceiver::new(FpduConfig { crc, max_ulpdu: 1000 });
            let mut s = Sink(Vec::new());
            let _ = rx.receive(&data[..at], &mut s).and_then(|_| rx.receive(&data[at..], &mut s));
            let mut f = FpduReceiver::new(FpduConfig { crc, ..Default::default() });
            let mut off = 0;
            while off < data.len() {
                match f.poll(&data[off..]) {
                    Ok((n, _)) => { prop_assert!(n > 0); off += n; }
                    Err(_) => break,
                }
            }
        }
        let now = Instant::now();
        let mut r = MpaHandshake::responder(MpaConfig::responder_default(), now);
        let _ = r.receive(&data[..at], now).and_then(|_| r.receive(&data[at..], now));
        let mut i = MpaHandshake::initiator(MpaConfig::initiator_default(), &[], now).unwrap();
        let _ = i.receive(&data[..at], now).and_then(|_| i.receive(&data[at..], now));
    }

    #[test]
    fn segment_header_roundtrip(op in opcode(), last: bool, a: u32, b: u32, c: u32, d: u32, to: u64,
                                rr in any::<(u32, u64, u32, u32, u64)>()) {
        let ddp = if op.is_tagged() { Kind::Tagged { stag: a, to } } else {
            Kind::Untagged { rsvd_ulp: a, qn: b, msn: c, mo: d }
        };
        let h = SegmentHeader { opcode: op, last, ddp,
            read_request: (op == Opcode::ReadRequest).then_some(ReadRequest {
                sink_stag: rr.0, sink_to: rr.1, size: rr.2, src_stag: rr.3, src_to: rr.4 }) };
        let mut buf = [0u8; 64];
        let n = h.emit(&mut buf).unwrap();
        prop_assert_eq!(SegmentHeader::parse(&buf[..n]).unwrap(), (h, n));
    }

    #[test]
    fn frame_roundtrip(req: bool, crc: bool, reject: bool, markers: bool, enhanced: bool,
                       io in any::<(u16, u16, bool, bool, bool, bool)>(),
                       pd in proptest::collection::vec(any::<u8>(), 0..508)) {
        let ird_ord = enhanced.then_some(IrdOrd { ird: io.0 & 0x3fff, ord: io.1 & 0x3fff,
            p2p: io.2, send_rtr: io.3, write_rtr: io.4, read_rtr: io.5 });
        let r = FrameRepr { kind: if req { FrameKind::Request } else { FrameKind::Reply },
            markers, crc, reject, gso: false, revision: if enhanced { 2 } else { 1 }, ird_ord,
            private_data: &pd };
        let v = r.to_vec().unwrap();
        prop_assert_eq!(v.len(), r.buffer_len());
        let p = FramePacket::new_checked(&v[..]).unwrap();
        prop_assert_eq!(FrameRepr::parse(&p).unwrap(), r);
        if let Some(io) = ird_ord {
            prop_assert_eq!(IrdOrd::parse(&IrdOrdPacket::new_checked(&io.to_bytes()[..]).unwrap()).unwrap(), io);
        }
    }

    #[test]
    fn terminate_roundtrip(kind in 0usize..33, seg_len: u16, hdr in proptest::collection::vec(any::<u8>(), 0..60)) {
        let k = TermKind::all().nth(kind).unwrap();
        let t = TerminateRepr::for_segment(k.into(), seg_len, &hdr);
        let v = t.to_vec();
        prop_assert_eq!(TerminateRepr::parse(&TerminatePacket::new_checked(&v[..]).unwrap()).unwrap(), t);
    }

    #[test]
    fn tx_rx_roundtrip(lens in proptest::collection::vec(0u32..3000, 1..6), emss in 28u32..2000,
                       crc: bool, split in 1usize..97, tagged: bool) {
        let cfg = TxConfig::from_emss(emss, crc);
        let mut tx = TxState::new();
        let mut stream = Vec::new();
        let mut all = Vec::new();
        for (i, len) in lens.iter().enumerate() {
            let payload: Vec<u8> = (0..*len).map(|x| (x as usize + i) as u8).collect();
            let msg = if tagged { OutboundMessage::Write { stag: 9, to: 1 << 40 } }
                      else { OutboundMessage::Send { solicited: i % 2 == 0, invalidate: None } };
            for s in tx.segment(&cfg, &msg, *len).unwrap() {
                prop_assert!(s.fpdu_len() <= cfg.max_fpdu as usize);
                let p = &payload[s.payload_offset as usize..(s.payload_offset + s.payload_len) as usize];
                stream.extend_from_slice(&s.to_vec(p, crc));
            }
            all.extend_from_slice(&payload);
        }
        let mut rx = RdmapReceiver::new(FpduConfig { crc, ..Default::default() });
        let mut sink = Sink(Vec::new());
        for c in stream.chunks(split) {
            rx.receive(c, &mut sink).unwrap();
        }
        prop_assert_eq!(sink.0, all);
        if !tagged {
            prop_assert_eq!(rx.ddp_state().expected_msn(0), Some(lens.len() as u32 + 1));
        }
    }
}
