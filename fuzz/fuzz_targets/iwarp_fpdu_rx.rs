//! FPDU deframer: arbitrary stream, arbitrary chunking; must always make
//! progress and never panic.
#![no_main]
use libfuzzer_sys::fuzz_target;
use lwio_iwarp::fpdu_rx::{FpduConfig, FpduEvent, FpduReceiver};

fuzz_target!(|data: &[u8]| {
    let Some((&ctl, rest)) = data.split_first() else { return };
    let chunk = (ctl as usize % 17) + 1;
    let mut rx = FpduReceiver::new(FpduConfig {
        crc: ctl & 0x80 != 0,
        max_ulpdu: if ctl & 0x40 != 0 { 512 } else { u16::MAX },
    });
    for c in rest.chunks(chunk) {
        let mut off = 0;
        while off < c.len() {
            match rx.poll(&c[off..]) {
                Ok((n, ev)) => {
                    assert!(n > 0 && off + n <= c.len());
                    if let Some(FpduEvent::Payload { data, .. }) = ev {
                        assert!(!data.is_empty());
                    }
                    off += n;
                }
                Err(_) => return,
            }
        }
    }
});
