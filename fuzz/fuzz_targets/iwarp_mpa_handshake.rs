//! MPA handshake, both roles, fed arbitrary bytes split at a fuzzed point.
#![no_main]
use std::time::Instant;

use libfuzzer_sys::fuzz_target;
use lwio_iwarp::mpa::{MpaConfig, MpaEvent, MpaHandshake};

fuzz_target!(|data: &[u8]| {
    let Some((&split, rest)) = data.split_first() else { return };
    let at = (split as usize).min(rest.len());
    let now = Instant::now();
    let mut r = MpaHandshake::responder(MpaConfig::responder_default(), now);
    if let Ok(n) = r.receive(&rest[..at], now) {
        if n == at {
            let _ = r.receive(&rest[at..], now);
        }
    }
    if let Some(MpaEvent::ConnectRequest { .. }) = r.poll_event() {
        if let Ok(n) = r.accept(b"pd", 4, 4) {
            assert!(n.ird <= 128 && n.ord <= 4);
            assert!(r.poll_transmit().is_some());
        }
    }
    let mut i = MpaHandshake::initiator(MpaConfig::initiator_default(), b"x", now).unwrap();
    let _ = i.poll_transmit();
    let mut used = 0;
    for c in [&rest[..at], &rest[at..]] {
        match i.receive(c, now) {
            Ok(n) => used += n,
            Err(_) => break,
        }
    }
    assert!(used <= rest.len());
    while i.poll_event().is_some() {}
});
