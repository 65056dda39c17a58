//! The soft provider's receive engine under arbitrary schedules: the fuzz
//! target `soft_qp_rx` (fuzz/) and a bounded property test run this.
//!
//! The input picks a sender's traffic (Sends and RDMA Writes of any size,
//! RDMA Read requests), the framing (MPA CRC, segment size), the receiver's
//! indicate window, and a schedule that interleaves delivery of the stream
//! in arbitrary chunks with the posting of receives. Without corruption the
//! oracle is exact: every receive completes in order with its message byte
//! for byte, every Write lands where it was aimed and nowhere else, and the
//! receiver ends idle between segments in RTS. With corruption (a flipped
//! byte) it must not panic and must not write outside the registrations it
//! validated. This is the code that runs (`QpEngine` is what the soft QPs
//! drive), not a model of it.

use std::io;
use std::sync::Arc;

use super::cq::{CqShared, SoftCq};
use super::mem::SoftPd;
use super::qp::{Io, QpEngine, QpParams, RX_BUDGET};
use super::{CtxShared, QpState};
use crate::verbs::*;

/// An in-memory byte stream end.
#[derive(Default)]
pub struct Pipe {
    pub input: Vec<u8>,
    pub pos: usize,
    /// Largest read returned (1 = byte at a time).
    pub chunk: usize,
    /// Largest write accepted per call (0 = everything).
    pub wchunk: usize,
    pub output: Vec<u8>,
}

// SAFETY: `read` writes at most `len` bytes to `dst` (the caller's
// contract) from our own vector; `writev` reads exactly the iovecs the
// caller guarantees readable.
impl Io for Pipe {
    unsafe fn read(&mut self, dst: *mut u8, len: usize) -> io::Result<usize> {
        let n = len.min(self.input.len() - self.pos).min(self.chunk.max(1));
        if n == 0 {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        std::ptr::copy_nonoverlapping(self.input.as_ptr().add(self.pos), dst, n);
        self.pos += n;
        Ok(n)
    }
    unsafe fn writev(&mut self, iov: &[libc::iovec]) -> io::Result<usize> {
        let mut t = 0;
        let cap = if self.wchunk == 0 {
            usize::MAX
        } else {
            // Vary the partial-write size: 1..=wchunk.
            1 + self.output.len() % self.wchunk
        };
        for v in iov {
            let n = v.iov_len.min(cap - t);
            self.output
                .extend_from_slice(std::slice::from_raw_parts(v.iov_base as *const u8, n));
            t += n;
            if t == cap {
                break;
            }
        }
        Ok(t)
    }
}

/// One end: a QP engine with its protection domain and one CQ.
pub struct Side {
    pub core: QpEngine,
    pub pd: Pd,
    pub cq: Arc<CqShared>,
}

/// A context with manual progress (nothing runs behind the test's back).
pub fn ctx() -> Arc<CtxShared> {
    CtxShared::new(Config {
        progress: Progress::Manual,
        indicate_window: 64 * 1024,
        ..Config::default()
    })
    .expect("context")
}

/// A QP engine joined to nothing: bytes go in and out through `Pipe`s.
pub fn side(
    ctx: &Arc<CtxShared>,
    qpn: u32,
    crc: bool,
    max_payload: usize,
    indicate_window: usize,
) -> Side {
    let spd = SoftPd::new(ctx.table.clone());
    let pd_id = spd.id;
    let pd = Pd(Arc::new(spd));
    let cq = Arc::new(CqShared::new(ctx.clone(), 4096, None));
    let core = QpEngine::new(QpParams {
        qpn,
        pd: pd_id,
        table: ctx.table.clone(),
        scq: cq.clone(),
        rcq: cq.clone(),
        cap: QpCap {
            max_send_wr: 512,
            max_recv_wr: 512,
            max_send_sge: 4,
            max_recv_sge: 4,
            max_inline_data: 64,
        },
        sq_sig_all: false,
        crc,
        max_payload,
        ird: 8,
        ord: 8,
        indicate_window,
        rx_budget: RX_BUDGET,
        srq: None,
    });
    Side { core, pd, cq }
}

/// Every completion the CQ holds.
pub fn drain(cq: &Arc<CqShared>) -> Vec<Wc> {
    let c = SoftCq(cq.clone());
    let mut out = Vec::new();
    let mut buf = [crate::verbs::Wc::BLANK; 64];
    loop {
        let n = c.poll(&mut buf).expect("poll");
        if n == 0 {
            return out;
        }
        out.extend_from_slice(&buf[..n]);
    }
}

/// Receive until the input is used up or the engine stops reading (the
/// engine yields every `RX_BUDGET` segments; a full indicate window pauses).
pub fn rx_all(core: &mut QpEngine, p: &mut Pipe) {
    loop {
        core.rx_process(p).expect("rx");
        if !core.rx_more {
            return;
        }
    }
}

/// What the transmit side of `s` has to send now.
pub fn tx_bytes(s: &mut Side) -> Vec<u8> {
    let mut p = Pipe::default();
    s.core.tx_process(&mut p).expect("tx");
    p.output
}

/// Reads the whole region (a copy: the test owns every writer).
pub fn mr_bytes(mr: &Mr) -> Vec<u8> {
    let mut v = vec![0; mr.len()];
    mr.read_at(0, &mut v).expect("read");
    v
}

/// Largest message a generated op carries.
const MAX_OP: usize = 3000;
/// Most ops one input describes.
const MAX_OPS: usize = 16;

struct Input<'a>(&'a [u8]);

impl Input<'_> {
    fn byte(&mut self) -> Option<u8> {
        let (&b, rest) = self.0.split_first()?;
        self.0 = rest;
        Some(b)
    }
    fn u16(&mut self) -> Option<u16> {
        Some(u16::from_le_bytes([self.byte()?, self.byte()?]))
    }
}

/// Runs one input (see the module comment). Panics when an oracle fails.
pub fn soft_qp_rx(data: &[u8]) {
    let mut inp = Input(data);
    let Some(flags) = inp.byte() else { return };
    let crc = flags & 1 != 0;
    let max_payload = [16, 100, 512, 1448, 4000][(flags as usize >> 1) % 5];
    let window = [0, 100, 1_000, 5_000, 64 * 1024][(flags as usize >> 4) % 5];
    let Some(nops) = inp.byte() else { return };
    let nops = nops as usize % (MAX_OPS + 1);
    // (kind, size): 0 Send, 1 Write, 2 Read request.
    // At most `ord` reads: their responses are never fed back, and a read
    // beyond the sender's ORD would hold back everything after it.
    let mut ops = Vec::with_capacity(nops);
    let mut reads = 0;
    for _ in 0..nops {
        let (Some(k), Some(sz)) = (inp.byte(), inp.u16()) else {
            return;
        };
        let mut k = k % 3;
        if k == 2 {
            reads += 1;
            if reads > 8 {
                k = 0;
            }
        }
        ops.push((k, sz as usize % (MAX_OP + 1)));
    }

    let ctx = ctx();
    let mut tx = side(&ctx, 1, crc, max_payload, 64 * 1024);
    let mut rx = side(&ctx, 2, crc, max_payload, window);
    let slots = ops.len().max(1) * MAX_OP;
    let src = crate::conformance::pattern(flags as u64, slots);
    let smr = tx.pd.alloc_mr(slots, Access::LOCAL_WRITE).expect("mr");
    smr.write_at(0, &src).expect("fill");
    let recv_mr = rx.pd.alloc_mr(slots, Access::LOCAL_WRITE).expect("mr");
    let write_mr = rx
        .pd
        .alloc_mr(slots, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
        .expect("mr");
    let read_mr = rx
        .pd
        .alloc_mr(slots, Access::LOCAL_WRITE | Access::REMOTE_READ)
        .expect("mr");
    let mut want_write = vec![0u8; slots];
    let mut sends = Vec::new();
    for (i, &(k, sz)) in ops.iter().enumerate() {
        let off = i * MAX_OP;
        let sg = [smr.sge(off, sz as u32)];
        let op = match k {
            0 => {
                sends.push((i, sz));
                SendOp::Send
            }
            1 => {
                want_write[off..off + sz].copy_from_slice(&src[off..off + sz]);
                SendOp::Write {
                    remote_addr: write_mr.addr() + off as u64,
                    rkey: write_mr.rkey(),
                }
            }
            _ => SendOp::Read {
                remote_addr: read_mr.addr() + off as u64,
                rkey: read_mr.rkey(),
            },
        };
        tx.core
            .post_send(&[SendWr::new(i as u64, op, &sg)])
            .expect("post send");
    }
    let stream = tx_bytes(&mut tx);

    // The schedule: deliver chunks, post receives, maybe flip a byte.
    let mut p = Pipe {
        input: Vec::with_capacity(stream.len()),
        chunk: usize::MAX,
        ..Pipe::default()
    };
    let mut fed = 0;
    let mut posted = 0;
    let mut corrupt = false;
    let post = |rx: &mut Side, i: usize| {
        let (op, _) = sends[i];
        let sg = [recv_mr.sge(op * MAX_OP, MAX_OP as u32)];
        rx.core
            .post_recv(&[RecvWr {
                wr_id: op as u64,
                sg_list: &sg,
            }])
            .expect("post recv");
    };
    while let Some(b) = inp.byte() {
        match b >> 6 {
            0 | 1 => {
                let n = ((b & 0x7f) as usize + 1).min(stream.len() - fed);
                p.input.extend_from_slice(&stream[fed..fed + n]);
                fed += n;
            }
            2 => {
                if posted < sends.len() {
                    post(&mut rx, posted);
                    posted += 1;
                }
            }
            _ => {
                // Flip a bit of the next byte to be delivered.
                if fed < stream.len() && b & 0x3f == 0x3f {
                    let mut c = stream[fed];
                    c ^= 1 << (b & 7);
                    p.input.push(c);
                    fed += 1;
                    corrupt = true;
                } else {
                    p.chunk = (b & 0x3f) as usize + 1;
                }
            }
        }
        rx_all(&mut rx.core, &mut p);
        // Answers (read responses, Terminates) go nowhere; they must be
        // produced without a panic.
        let _ = tx_bytes(&mut rx);
    }
    while posted < sends.len() {
        post(&mut rx, posted);
        posted += 1;
    }
    p.input.extend_from_slice(&stream[fed..]);
    p.chunk = usize::MAX;
    rx_all(&mut rx.core, &mut p);
    let _ = tx_bytes(&mut rx);
    let w = drain(&rx.cq);
    let got_write = mr_bytes(&write_mr);
    if corrupt {
        // No oracle for the data. (Under the fuzzer's AddressSanitizer a
        // write outside live memory aborts the run.)
        return;
    }
    assert_eq!(p.pos, p.input.len(), "receiver left bytes unread");
    assert_eq!(rx.core.state, QpState::Rts, "receiver not in RTS: {w:?}");
    assert!(rx.core.rx_idle(), "receiver stopped mid-segment");
    assert_eq!(w.len(), sends.len(), "receive completions: {w:?}");
    let got = mr_bytes(&recv_mr);
    for (c, &(op, sz)) in w.iter().zip(&sends) {
        assert!(c.is_ok(), "{c:?}");
        assert_eq!((c.wr_id, c.byte_len as usize), (op as u64, sz), "{c:?}");
        let off = op * MAX_OP;
        if got[off..off + sz] != src[off..off + sz] {
            let i = (0..sz).find(|&i| got[off + i] != src[off + i]).unwrap_or(0);
            panic!("send {op} ({sz} bytes): first difference at byte {i}");
        }
    }
    if got_write != want_write {
        let i = (0..slots)
            .find(|&i| got_write[i] != want_write[i])
            .unwrap_or(0);
        panic!("write target differs first at byte {i}");
    }
}
