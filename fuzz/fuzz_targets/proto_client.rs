#![no_main]
//! ClientConn fed arbitrary server messages, immediates and status blocks.
use std::time::Instant;

use libfuzzer_sys::fuzz_target;
use lwio_proto::client::*;
use lwio_proto::wire::Guid;

struct Mem<'a>(&'a [u8]);
impl LocalMemory for Mem<'_> {
    fn read(&self, _addr: u64, len: usize) -> Option<Vec<u8>> {
        self.0.get(..len).map(|b| b.to_vec())
    }
}

fuzz_target!(|data: &[u8]| {
    let now = Instant::now();
    let mut cfg = ClientConfig::new(Guid::from_u128(7), b"fuzz".to_vec(), RemoteBuf { addr: 0, rkey: 1 });
    cfg.status_blocks = Some(StatusBlockArea { base: 0x1000, rkey: 2, slots: 4 });
    let mut c = ClientConn::<()>::new(cfg);
    let _ = c.start(now);
    let mem = Mem(data);
    let mut rest = data;
    let mut steps = 0;
    while let Some((&sel, tail)) = rest.split_first() {
        steps += 1;
        if steps > 256 {
            break;
        }
        rest = tail;
        match sel % 5 {
            0 | 1 => {
                let n = if sel % 5 == 0 { 16 } else { usize::from(sel >> 4) };
                let m = rest.get(..n.min(rest.len())).unwrap_or(&[]);
                c.handle_recv(now, m, &mem);
                rest = rest.get(m.len()..).unwrap_or(&[]);
            }
            2 => c.handle_immediate(now, u32::from(sel >> 3)),
            3 => c.status_block_updated(now, u32::from(sel >> 5), 1, u32::from(sel >> 3)),
            _ => {
                // The engine polls with a window per status block
                // (PolledWindow, the slot next_status_slot names).
                let mode = match (sel & 8 != 0, sel & 16 != 0) {
                    (false, _) => Mode::Interrupt,
                    (true, false) => Mode::Polled,
                    (true, true) => {
                        let _ = c.next_status_slot();
                        Mode::PolledWindow(u32::from(sel))
                    }
                };
                if sel & 32 != 0 {
                    // A fragmented WRITE (docs/protocol.md §5.12): its
                    // fragments cover exactly the header and the data.
                    let len = u32::from(sel) * 97;
                    let held = c.credits_held();
                    if let Ok(w) = c.write_fragmented(now, 1, 3, len, None, mode, 700) {
                        let sum: u64 = w.fragments.iter().map(|f| u64::from(f.data_length)).sum();
                        assert_eq!(sum, 56 + u64::from(len));
                        assert_eq!(c.credits_held(), held + w.fragments.len());
                        assert!(c.credits_held() <= usize::from(c.credits()));
                    }
                }
                let _ = c.read(now, 1, 0, 16, RemoteBuf { addr: 0, rkey: 1 }, mode);
                let _ = c.interrupt(now);
            }
        }
        while c.poll_action().is_some() {}
        let mut buf = [0u8; 512];
        while c.poll_transmit(&mut buf).is_some() {}
        // Every completion waits to be taken, once.
        while let Some(ev) = c.poll_event() {
            if let ClientEvent::Completed { req, .. } = ev {
                assert!(c.take_done(req).is_some());
                assert!(c.take_done(req).is_none());
            }
        }
        assert!(c.outstanding() <= usize::from(c.credits()) + 1);
    }
});
