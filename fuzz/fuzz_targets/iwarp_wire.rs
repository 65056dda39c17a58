//! Every wire parser on arbitrary bytes; emit(parse(x)) must parse again
//! to the same value.
#![no_main]
use libfuzzer_sys::fuzz_target;
use lwio_iwarp::wire::mpa::{FpduPacket, FramePacket, FrameRepr};
use lwio_iwarp::wire::rdmap::{TerminatePacket, TerminateRepr};
use lwio_iwarp::wire::segment::SegmentHeader;

fuzz_target!(|data: &[u8]| {
    if let Ok(p) = FramePacket::new_checked(data) {
        if let Ok(r) = FrameRepr::parse(&p) {
            let v = r.to_vec().expect("parsed frame re-emits");
            let p2 = FramePacket::new_checked(&v[..]).expect("checked");
            assert_eq!(FrameRepr::parse(&p2).expect("reparse"), r);
        }
    }
    if let Ok(p) = TerminatePacket::new_checked(data) {
        if let Ok(t) = TerminateRepr::parse(&p) {
            let _ = t.copied_ddp();
            let _ = t.copied_read_request();
            let v = t.to_vec();
            let p2 = TerminatePacket::new_checked(&v[..]).expect("checked");
            assert_eq!(TerminateRepr::parse(&p2).expect("reparse"), t);
        }
    }
    if let Ok((h, n)) = SegmentHeader::parse(data) {
        let mut b = [0u8; 64];
        assert_eq!(h.emit(&mut b), Some(n));
        assert_eq!(SegmentHeader::parse(&b[..n]), Ok((h, n)));
    }
    if let Ok(p) = FpduPacket::new_checked(data) {
        let _ = p.verify_crc();
        let _ = p.ulpdu();
    }
});
