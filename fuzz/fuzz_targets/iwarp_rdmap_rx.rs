//! Full receive path with a Placement that validates like a provider:
//! placements must stay inside the extents it approved.
#![no_main]
use libfuzzer_sys::fuzz_target;
use lwio_iwarp::fpdu_rx::FpduConfig;
use lwio_iwarp::rx::*;
use lwio_iwarp::wire::rdmap::TerminateRepr;
use lwio_iwarp::wire::term::{TermError, TermKind};

#[derive(Default)]
struct P {
    ok_tagged: Option<(u32, u64, u64)>,
    ok_untagged: Option<(u32, u32, u32, u32)>,
}

impl Placement for P {
    fn check_tagged(&mut self, s: &TaggedSegment) -> Result<(), TermError> {
        if s.stag % 3 == 0 {
            return Err(TermKind::DdpTaggedInvalidStag.into());
        }
        self.ok_tagged = Some((s.stag, s.to, s.to + s.len as u64));
        Ok(())
    }
    fn place_tagged(&mut self, stag: u32, to: u64, d: &[u8]) -> Result<(), TermError> {
        let (s, lo, hi) = self.ok_tagged.expect("placed before check");
        assert!(s == stag && to >= lo && to + d.len() as u64 <= hi);
        Ok(())
    }
    fn check_untagged(&mut self, s: &UntaggedSegment) -> Result<(), TermError> {
        if s.mo + s.len > 1 << 16 {
            return Err(TermKind::DdpUntaggedMessageTooLong.into());
        }
        self.ok_untagged = Some((s.qn, s.msn, s.mo, s.mo + s.len));
        Ok(())
    }
    fn place_untagged(&mut self, qn: u32, msn: u32, mo: u32, d: &[u8]) -> Result<(), TermError> {
        let (q, m, lo, hi) = self.ok_untagged.expect("placed before check");
        assert!(q == qn && m == msn && mo >= lo && mo as u64 + d.len() as u64 <= hi as u64);
        Ok(())
    }
    fn segment_done(&mut self, _: &Segment) -> Result<(), TermError> {
        Ok(())
    }
    fn terminate(&mut self, t: &TerminateRepr) {
        let _ = t.copied_ddp();
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&ctl, rest)) = data.split_first() else { return };
    let mut rx = RdmapReceiver::new(FpduConfig {
        crc: ctl & 1 != 0,
        ..Default::default()
    });
    let mut p = P::default();
    for c in rest.chunks((ctl as usize >> 1) + 1) {
        if rx.receive(c, &mut p).is_err() {
            return;
        }
    }
});
