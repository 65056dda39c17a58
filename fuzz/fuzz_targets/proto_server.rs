#![no_main]
//! ServerConn fed arbitrary messages and events. The input is a script:
//! each step starts with a selector byte; messages are length-prefixed.
//! Optionally a valid AUTH is injected first so the fuzzer reaches the
//! authenticated state. Invariants: no panic, nothing produced after
//! CloseConnection, outstanding ≤ credits, and every receive buffer kept
//! (a fragment's, or a WRITE's whose data is lent to its FileWriteParts)
//! handed back exactly once, with ranges inside the bytes it received.
use std::time::{Duration, Instant};

use libfuzzer_sys::fuzz_target;
use lwio_proto::server::*;
use lwio_proto::status::*;
use lwio_proto::wire::common::RequestOp;
use lwio_proto::wire::{AuthParamsRepr, Guid, RequestRepr, SignatureAlg, SrvResumeKey, LWIO_REV_ID};

const KEY: Guid = Guid::from_u128(7);
const SECRET: &[u8] = b"fuzz";

struct Hooks;
impl ServerHooks for Hooks {
    fn session_secret(&mut self, key: &Guid) -> Option<Vec<u8>> {
        (*key == KEY).then(|| SECRET.to_vec())
    }
    fn open_file(&mut self, rk: &SrvResumeKey, flags: u32) -> Result<u64, NtStatus> {
        if rk.resume_key % 2 == 0 {
            Ok(u64::from(flags))
        } else {
            Err(STATUS_ACCESS_DENIED)
        }
    }
}

fn auth() -> Vec<u8> {
    let p = AuthParamsRepr {
        rev_id: LWIO_REV_ID,
        endian: 8,
        page_size: 4096,
        header_size: 56,
        credits: 4,
        key: Some(KEY),
        ..AuthParamsRepr::default()
    }
    .to_signed_bytes(SignatureAlg::HmacSha256, SECRET)
    .unwrap();
    RequestRepr {
        credits: 1,
        sequence: 0,
        tid: 0,
        op: RequestOp::Auth { cookie: 1, data_va: 0, data_mh: 0, params: &p },
    }
    .to_bytes()
    .unwrap()
}

fuzz_target!(|data: &[u8]| {
    let t0 = Instant::now();
    let cfg = ServerConfig {
        max_recv_buffer_size: 1024,
        use_write_with_imm: data.first().is_some_and(|b| b & 2 != 0),
        session_id: 5,
        // Fragments (§5.12) on: messages up to 4 KiB reassembled.
        max_message: 4096,
        ..ServerConfig::default()
    };
    let mut s = ServerConn::new(cfg, t0);
    let mut hooks = Hooks;
    let mut ops: Vec<OpId> = Vec::new();
    let mut closed = false;
    // Receive buffers the state machine kept (with the length of the
    // message each received), and the next buffer id.
    let mut kept: std::collections::HashMap<u64, usize> = Default::default();
    let mut next_buf = 0u64;
    if data.first().is_some_and(|b| b & 1 != 0) {
        s.handle_recv(t0, &auth(), &mut hooks);
    }
    let mut rest = data.get(1..).unwrap_or(&[]);
    let mut steps = 0;
    while let Some((&sel, tail)) = rest.split_first() {
        steps += 1;
        if steps > 256 {
            break;
        }
        rest = tail;
        match sel % 6 {
            0 | 1 | 2 => {
                let n = usize::from(*rest.first().unwrap_or(&0)).min(rest.len().saturating_sub(1));
                let msg = rest.get(1..1 + n).unwrap_or(&[]);
                let mut m = msg.to_vec();
                // Bias towards well-formed headers: pad to at least 56 bytes.
                if sel % 6 == 1 && m.len() < 56 {
                    m.resize(56, 0);
                    m[5] |= 0x80;
                    m[48] |= 1;
                }
                // Bias towards fragments: opcode 10 where a request's is,
                // DataLength = the bytes after the 16-byte header.
                if sel % 6 == 2 && m.len() >= 16 {
                    let dl = (m.len() - 16) as u32;
                    m[..4].copy_from_slice(&dl.to_le_bytes());
                    m[4] = 10;
                }
                next_buf += 1;
                if s.handle_recv_in(t0, next_buf, &m, &mut hooks) == RecvBuffer::Kept {
                    kept.insert(next_buf, m.len());
                }
                rest = rest.get(1 + n..).unwrap_or(&[]);
            }
            3 => {
                if let Some(op) = ops.pop() {
                    let r = match sel >> 3 {
                        0 => Err(STATUS_CANCELLED),
                        1 => Err(STATUS_DISK_FULL),
                        2 => Ok(0),
                        n => Ok(u32::from(n) * 100),
                    };
                    s.handle_storage_complete(t0, op, r);
                }
            }
            4 => {
                let d = i32::from(sel as i8 >> 3);
                let _ = s.start_credit_delta(t0, d);
            }
            _ => s.handle_timeout(t0 + Duration::from_secs(u64::from(sel))),
        }
        while let Some(a) = s.poll_action() {
            assert!(!closed, "action after CloseConnection: {a:?}");
            match a {
                ServerAction::FileRead { op, .. }
                | ServerAction::FileWrite { op, .. }
                | ServerAction::FileSync { op, .. } => {
                    ops.push(op)
                }
                ServerAction::FileWriteParts { op, parts, .. } => {
                    // Every part is a kept buffer, handed back once, and
                    // lies in the bytes it received.
                    for (b, r) in parts {
                        let len = kept.remove(&b);
                        assert!(len.is_some(), "buffer {b} not kept, or given back twice");
                        assert!(r.start <= r.end && Some(r.end) <= len, "{r:?} outside buffer {b}");
                    }
                    ops.push(op)
                }
                ServerAction::RepostRecvs(bufs) => {
                    for b in bufs {
                        assert!(kept.remove(&b).is_some(), "buffer {b} not kept, or given back twice");
                    }
                }
                ServerAction::CloseConnection(_) => closed = true,
                _ => {}
            }
        }
        assert!(s.is_closed() || s.outstanding() <= u32::from(s.credits()));
        // A partial message keeps at most one buffer per credit it holds.
        assert!(s.is_closed() || kept.len() <= s.outstanding() as usize);
    }
});
