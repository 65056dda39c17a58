//! The queue-pair protocol engine: send queue and FPDU transmission, the
//! receive/placement engine, inbound/outbound RDMA Read queues, anonymous
//! receive buffering (the indicate window) and the error/flush machinery.
//!
//! Everything here runs under the QP's mutex, on whichever thread drives the
//! QP (engine thread, a posting thread, or a manual-progress poller). The
//! engine is sans-socket: it talks to an [`Io`], so tests can feed it bytes
//! split at any boundary.
//!
//! # Placement and memory
//! Incoming payload is written to registered memory through raw pointers
//! only (`read(2)` straight into it, or one `copy_nonoverlapping` from the
//! staging buffer). No Rust reference to registered memory is ever formed on
//! the receive path. The consumer learns about placed data through a
//! completion, pushed under the CQ mutex after the placement (Release) and
//! popped under the same mutex (Acquire).

use std::collections::VecDeque;
use std::io;
use std::sync::Arc;

use super::cq::CqShared;
use super::mem::{MemTable, MrState, SoftMw};
use crate::verbs::*;
use lwio_iwarp::fpdu_rx::{FpduConfig, FpduEvent, FpduReceiver, RxError};
use lwio_iwarp::rx::{DdpRxState, Segment};
use lwio_iwarp::tx::{emit_fpdu_header, Trailer, TxState};
use lwio_iwarp::wire::ddp::Kind as DdpKind;
use lwio_iwarp::wire::mpa::MPA_HDR_LEN;
use lwio_iwarp::wire::rdmap::{
    self, Opcode, ReadRequest, TerminateRepr, QN_READ_REQUEST, QN_SEND, QN_TERMINATE,
};
use lwio_iwarp::wire::segment::SegmentHeader;
use lwio_iwarp::wire::term::{TermError, TermKind};

/// Resolved local SGEs: pieces, the registrations keeping them alive, total length.
type Resolved = (Vec<Piece>, Vec<Arc<MrState>>, u64);

/// Byte-stream access for the engine (a socket, or a test harness).
pub trait Io {
    /// Read up to `len` bytes to `dst`. Ok(0) = end of stream.
    ///
    /// # Safety
    /// `dst..dst+len` must be valid for writes and not covered by a reference.
    unsafe fn read(&mut self, dst: *mut u8, len: usize) -> io::Result<usize>;
    /// Gather-write.
    ///
    /// # Safety
    /// Every iovec must describe memory valid for reads during the call.
    unsafe fn writev(&mut self, iov: &[libc::iovec]) -> io::Result<usize>;
}

/// A socket as an [`Io`].
pub struct SockIo(pub std::os::fd::RawFd);

// SAFETY: both methods forward the caller's guarantees (the trait's
// `# Safety` contract) unchanged to the system call wrappers.
impl Io for SockIo {
    unsafe fn read(&mut self, dst: *mut u8, len: usize) -> io::Result<usize> {
        super::sys::read_raw(self.0, dst, len)
    }
    unsafe fn writev(&mut self, iov: &[libc::iovec]) -> io::Result<usize> {
        super::sys::writev_raw(self.0, iov)
    }
}

/// A contiguous piece of memory (an address, so the core stays `Send`).
#[derive(Clone, Copy, Debug)]
pub struct Piece {
    pub addr: u64,
    pub len: u64,
}

/// Staging buffer size and the payload size from which (CRC off) we read
/// straight into the target memory instead of through the staging buffer.
pub const STAGE: usize = 64 * 1024;
pub const DIRECT_MIN: usize = 4096;
/// Read large payloads straight into registered memory (default). Off, every
/// byte goes through the staging buffer and is copied once; a switch for
/// benchmarks that justify the choice.
pub static DIRECT_PLACEMENT: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(true);

/// How much a header/small read pulls into the staging buffer (CRC off).
pub const HDR_FILL: usize = 1024;
/// Segments with payloads below this mark the stream as small-message
/// traffic (see `Stage::small`).
pub const SMALL_SEG: usize = 16 * 1024;
/// In small-message mode, payloads go direct from this size up.
pub const SMALL_DIRECT_MIN: usize = 32 * 1024;
/// Frames, and bytes, one transmit `sendmsg` may carry.
pub const TX_BATCH: usize = 32;
pub const TX_BATCH_BYTES: usize = 256 * 1024;
/// Segments one `rx_process` call handles before yielding to other QPs.
pub const RX_BUDGET: usize = 256;
/// Under manual progress the thread that drives also consumes the
/// completions: it returns to them after this many segments, so a long
/// stream of placements does not hold back completions already made.
pub const RX_BUDGET_MANUAL: usize = 16;
/// Per-message accounting overhead of an anonymous buffer (so zero-length
/// sends cannot queue without bound).
pub const ANON_OVERHEAD: usize = 64;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Send { inv: Option<u32>, se: bool },
    Write { stag: u32, to: u64 },
    Read { stag: u32, to: u64 },
    Local,
}

struct SendWqe {
    seq: u64,
    wr_id: u64,
    kind: Kind,
    opcode: WcOpcode,
    signaled: bool,
    fence: bool,
    pieces: Vec<Piece>,
    keep: Vec<Arc<MrState>>,
    inline: Option<Arc<[u8]>>,
    len: u64,
    sent: u64,
    started: bool,
    msn: u32,
    /// Every segment built into a frame (the next WR may be framed).
    built: bool,
    /// Fully transmitted (Read: request sent).
    transmitted: bool,
    done: bool,
    status: WcStatus,
    byte_len: u32,
    vendor_err: u32,
}

struct RecvWqe {
    wr_id: u64,
    pieces: Vec<Piece>,
    _keep: Vec<Arc<MrState>>,
    len: u64,
}

struct OrqEntry {
    seq: u64,
    sink_stag: u32,
    sink_to: u64,
    len: u64,
    got: u64,
}

struct IrqEntry {
    mr: Option<Arc<MrState>>,
    src: u64,
    len: u64,
    sent: u64,
    sink_stag: u32,
    sink_to: u64,
    started: bool,
}

struct AnonMsg {
    data: Vec<u8>,
    complete: bool,
    inv: Option<u32>,
    solicited: bool,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Target {
    Recv,
    Anon,
}

struct CurSend {
    /// Bytes of the message received so far.
    mo: u64,
    target: Target,
}

struct TaggedCtx {
    stag: u32,
    next_to: u64,
    end: u64,
    mr: Arc<MrState>,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum FrameOwner {
    Sq { seq: u64, last: bool },
    Irq { last: bool },
    Term,
}

/// One FPDU to send: the header area (ULPDU_Length, DDP/RDMAP header,
/// a Terminate's body) emitted by lwio-iwarp into `hdr`, the payload as
/// pieces of registered memory (or of the inline/staged copy), and
/// lwio-iwarp's pad + CRC trailer.
struct TxFrame {
    hdr: [u8; TX_HDR],
    hdr_len: usize,
    pieces: [Piece; 8],
    npieces: usize,
    trailer: Trailer,
    total: usize,
    written: usize,
    owner: FrameOwner,
    _keep: Option<Arc<MrState>>,
    _inline: Option<Arc<[u8]>>,
    /// CRC on: the payload copied into the frame (the pieces point here).
    _staged: Option<Vec<u8>>,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum RxState {
    /// Feeding the deframer: between segments, in a header or a trailer.
    Frame,
    /// A validated header whose payload has nowhere to go yet (the
    /// indicate window is full): the socket is left unread.
    Place,
    /// The payload of the current segment, to `dest`.
    Payload,
    /// After a fatal error or end of stream: read and drop.
    Discard,
}

#[derive(Clone, Copy, Debug)]
struct Seg {
    tagged: bool,
    last: bool,
    opcode: Opcode,
    stag: u32,
    to: u64,
    inv: u32,
    qn: u32,
    msn: u32,
    mo: u32,
    paylen: usize,
    rr: Option<ReadRequest>,
}

impl Default for Seg {
    /// No segment yet (read only after a header replaced it).
    fn default() -> Seg {
        Seg {
            tagged: false,
            last: false,
            opcode: Opcode::Write,
            stag: 0,
            to: 0,
            inv: 0,
            qn: 0,
            msn: 0,
            mo: 0,
            paylen: 0,
            rr: None,
        }
    }
}

/// The staging (socket) buffer.
struct Stage {
    /// CRC on: every byte is staged (and checksummed) before it is copied.
    all_staged: bool,
    /// The last segment carried a small payload (< `SMALL_SEG`): the stream
    /// is probably many small messages, so refills pull a whole stage (one
    /// `read` for many segments) instead of just a header, and payloads go
    /// direct only from `SMALL_DIRECT_MIN` up.
    small: bool,
    buf: Box<[u8]>,
    start: usize,
    end: usize,
}

impl Stage {
    fn avail(&self) -> usize {
        self.end - self.start
    }

    fn fill(&mut self, io: &mut dyn Io, limit: usize) -> io::Result<usize> {
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        } else if self.end == self.buf.len() {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        let room = (self.buf.len() - self.end).min(limit.max(1));
        // SAFETY: the range is inside our own boxed buffer; no reference to it
        // is live during the call.
        let n = unsafe { io.read(self.buf.as_mut_ptr().add(self.end), room)? };
        self.end += n;
        Ok(n)
    }
}

/// Counters for tests and benchmarks.
#[derive(Debug, Clone, Copy, Default)]
pub struct RxStats {
    /// Payload bytes read straight into registered memory.
    pub direct: u64,
    /// Payload bytes copied once from the staging buffer.
    pub copied: u64,
    /// Current anonymous buffering (bytes incl. per-message overhead).
    pub anon_bytes: usize,
    /// Highest anonymous buffering seen.
    pub anon_peak: usize,
    /// Times the socket was left unread because the indicate window was full.
    pub paused: u64,
    /// This QP's indicate window (bytes).
    pub indicate_window: usize,
    /// Terminates sent / received.
    pub term_sent: u64,
    pub term_recv: u64,
    /// Last Terminate code sent or received (vendor_err packing).
    pub last_term: u32,
}

/// Socket actions the driver must take after a core call.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Shut {
    None,
    /// Close our write side once the pending frames (a Terminate) are out.
    AfterTx,
    /// Close both directions now.
    Now,
    Done,
}

/// Outcome of one drive of the engine.
#[derive(Debug, Default, Clone, Copy)]
pub struct DriveOut {
    pub events: usize,
}

/// Static parameters of a QP.
#[derive(Clone)]
pub struct QpParams {
    pub qpn: u32,
    pub pd: u32,
    pub table: Arc<MemTable>,
    pub scq: Arc<CqShared>,
    pub rcq: Arc<CqShared>,
    pub cap: QpCap,
    pub sq_sig_all: bool,
    pub crc: bool,
    pub max_payload: usize,
    pub ird: u32,
    pub ord: u32,
    pub indicate_window: usize,
    /// Segments one `rx_process` call handles at most.
    pub rx_budget: usize,
}

pub struct QpCore {
    pub p: QpParams,
    pub state: QpState,
    sq: VecDeque<SendWqe>,
    next_seq: u64,
    tx_idx: usize,
    /// Frames built and not yet fully written, in stream order.
    txq: VecDeque<TxFrame>,
    txq_bytes: usize,
    /// Registrations of WRs flushed while frames referencing them may still
    /// be queued; released once the frame queue is empty.
    graveyard: Vec<Arc<MrState>>,
    tx_cur_irq: bool,
    /// Inbound reads (at the front of `irq`) whose responses are all framed.
    irq_built: usize,
    /// Outgoing MSNs per untagged queue: lwio-iwarp's.
    msns: TxState,
    orq: VecDeque<OrqEntry>,
    irq: VecDeque<IrqEntry>,
    term_out: Option<TerminateRepr>,
    pub shut: Shut,
    rq: VecDeque<RecvWqe>,
    anon: VecDeque<AnonMsg>,
    /// The segment being read has its payload destination inside the newest
    /// anonymous message's buffer: that message must stay where it is (not
    /// be handed to a receive and dropped) until the segment is finished.
    anon_seg_open: bool,
    rx: RxState,
    stage: Stage,
    /// MPA deframing (and CRC) of the receive stream: lwio-iwarp's.
    fpdu: FpduReceiver,
    /// DDP/RDMAP validation (queues, MSNs, message offsets): lwio-iwarp's.
    ddp: DdpRxState,
    /// The current segment as validated, committed to `ddp` at its end.
    cur: Option<Segment>,
    seg: Seg,
    /// Payload destinations; `addr == 0` discards `len` bytes.
    dest: Vec<Piece>,
    dest_idx: usize,
    dest_off: u64,
    ctl: Box<[u8; TERM_MAX]>,
    cur_send: Option<CurSend>,
    tagged: Option<TaggedCtx>,
    pub peer_closed: bool,
    /// `rx_process` stopped on its budget with input possibly left.
    pub rx_more: bool,
    pub stats: RxStats,
}

/// Largest Terminate payload kept for reading its error triple: the fixed
/// word, the segment length and the largest copied headers (4 + 2 + 18 +
/// 28), rounded up; a longer payload's rest is dropped.
const TERM_MAX: usize = 64;
const _: () = assert!(TERM_MAX >= rdmap::TERMINATE_HDR_LEN + rdmap::TERMINATE_MAX_COPIED);

/// A frame's header array: lwio-iwarp's largest FPDU header area.
const TX_HDR: usize = lwio_iwarp::tx::MAX_TX_HDR;

/// The header of a tagged segment (RDMA Write, Read Response).
fn tagged(opcode: Opcode, last: bool, stag: u32, to: u64) -> SegmentHeader {
    SegmentHeader {
        opcode,
        last,
        ddp: DdpKind::Tagged { stag, to },
        read_request: None,
    }
}

/// The header of an untagged segment; `inv` is the STag a Send with
/// Invalidate names (0 otherwise).
fn untagged(opcode: Opcode, last: bool, inv: u32, qn: u32, msn: u32, mo: u32) -> SegmentHeader {
    SegmentHeader {
        opcode,
        last,
        ddp: DdpKind::Untagged {
            rsvd_ulp: inv,
            qn,
            msn,
            mo,
        },
        read_request: None,
    }
}

fn wc(wr_id: u64, status: WcStatus, opcode: WcOpcode, qpn: u32) -> Wc {
    Wc {
        wr_id,
        status,
        opcode,
        byte_len: 0,
        imm: None,
        invalidated_rkey: None,
        qp_num: qpn,
        vendor_err: 0,
    }
}

/// Map `[off, off+n)` of a scatter list to pieces.
fn map_pieces(pieces: &[Piece], mut off: u64, mut n: u64, out: &mut Vec<Piece>) {
    for p in pieces {
        if n == 0 {
            break;
        }
        if off >= p.len {
            off -= p.len;
            continue;
        }
        let take = (p.len - off).min(n);
        out.push(Piece {
            addr: p.addr + off,
            len: take,
        });
        n -= take;
        off = 0;
    }
}

/// Copy bytes into a scatter list at `off`.
///
/// # Safety
/// The pieces must describe valid, writable registered memory.
unsafe fn scatter(pieces: &[Piece], off: u64, data: &[u8]) {
    let mut v = Vec::new();
    map_pieces(pieces, off, data.len() as u64, &mut v);
    let mut at = 0usize;
    for p in v {
        std::ptr::copy_nonoverlapping(data.as_ptr().add(at), p.addr as *mut u8, p.len as usize);
        at += p.len as usize;
    }
}

impl QpCore {
    pub fn new(p: QpParams) -> QpCore {
        let crc = p.crc;
        QpCore {
            p,
            state: QpState::Rts,
            sq: VecDeque::new(),
            next_seq: 0,
            tx_idx: 0,
            txq: VecDeque::new(),
            txq_bytes: 0,
            graveyard: Vec::new(),
            tx_cur_irq: false,
            irq_built: 0,
            msns: TxState::new(),
            orq: VecDeque::new(),
            irq: VecDeque::new(),
            term_out: None,
            shut: Shut::None,
            rq: VecDeque::new(),
            anon: VecDeque::new(),
            anon_seg_open: false,
            rx: RxState::Frame,
            stage: Stage {
                all_staged: crc,
                small: true,
                buf: vec![0u8; STAGE].into_boxed_slice(),
                start: 0,
                end: 0,
            },
            fpdu: FpduReceiver::new(FpduConfig {
                crc,
                max_ulpdu: u16::MAX,
            }),
            ddp: DdpRxState::new(),
            cur: None,
            seg: Seg::default(),
            dest: Vec::with_capacity(8),
            dest_idx: 0,
            dest_off: 0,
            ctl: Box::new([0; TERM_MAX]),
            cur_send: None,
            tagged: None,
            peer_closed: false,
            rx_more: false,
            stats: RxStats::default(),
        }
    }

    // -----------------------------------------------------------------
    // Posting.

    fn resolve(&self, sges: &[Sge], need: Access) -> Result<Resolved, WcStatus> {
        let mut pieces = Vec::with_capacity(sges.len());
        let mut keep = Vec::with_capacity(sges.len());
        let mut len = 0u64;
        for s in sges {
            if s.length == 0 {
                continue;
            }
            let mr = self.p.table.local(s, self.p.pd, need)?;
            pieces.push(Piece {
                addr: s.addr,
                len: s.length as u64,
            });
            keep.push(mr);
            len += s.length as u64;
        }
        Ok((pieces, keep, len))
    }

    pub fn post_send(&mut self, wrs: &[SendWr<'_>]) -> Result<(), PostError> {
        for (index, w) in wrs.iter().enumerate() {
            let err = |error| PostError { index, error };
            if w.sg_list.len() > self.p.cap.max_send_sge as usize {
                return Err(err(Error::InvalidArgument(format!(
                    "{} SGEs > max_send_sge {}",
                    w.sg_list.len(),
                    self.p.cap.max_send_sge
                ))));
            }
            if self.sq.len() >= self.p.cap.max_send_wr as usize {
                return Err(err(Error::QueueFull));
            }
            let (kind, opcode) = match w.op {
                SendOp::Send => (
                    Kind::Send {
                        inv: None,
                        se: w.solicited,
                    },
                    WcOpcode::Send,
                ),
                SendOp::SendWithInvalidate { rkey } => (
                    Kind::Send {
                        inv: Some(rkey),
                        se: w.solicited,
                    },
                    WcOpcode::Send,
                ),
                SendOp::Write { remote_addr, rkey } => (
                    Kind::Write {
                        stag: rkey,
                        to: remote_addr,
                    },
                    WcOpcode::RdmaWrite,
                ),
                SendOp::Read { remote_addr, rkey } => {
                    if w.sg_list.iter().filter(|s| s.length > 0).count() > 1 {
                        return Err(err(Error::NotSupported(
                            "RDMA Read into more than one SGE".into(),
                        )));
                    }
                    (
                        Kind::Read {
                            stag: rkey,
                            to: remote_addr,
                        },
                        WcOpcode::RdmaRead,
                    )
                }
                SendOp::SendWithImm { .. } | SendOp::WriteWithImm { .. } => {
                    return Err(err(Error::NotSupported(
                        "immediate data (not in iWARP RDMAP without RFC 7306)".into(),
                    )))
                }
            };
            let total: u64 = w.sg_list.iter().map(|s| s.length as u64).sum();
            if total > u32::MAX as u64 {
                return Err(err(Error::InvalidArgument(
                    "message larger than 4 GiB".into(),
                )));
            }
            let is_read = matches!(kind, Kind::Read { .. });
            let need = if is_read {
                Access::LOCAL_WRITE
            } else {
                Access::empty()
            };
            let seq = self.next_seq;
            let mut wqe = SendWqe {
                seq,
                wr_id: w.wr_id,
                kind,
                opcode,
                signaled: w.signaled || self.p.sq_sig_all,
                fence: w.fence,
                pieces: Vec::new(),
                keep: Vec::new(),
                inline: None,
                len: total,
                sent: 0,
                started: false,
                msn: 0,
                built: false,
                transmitted: false,
                done: false,
                status: WcStatus::Success,
                byte_len: 0,
                vendor_err: 0,
            };
            if self.state != QpState::Rts {
                self.next_seq += 1;
                self.p
                    .scq
                    .push(wc(w.wr_id, WcStatus::WrFlushErr, opcode, self.p.qpn), true);
                continue;
            }
            if w.inline && !is_read {
                if total > self.p.cap.max_inline_data as u64 {
                    return Err(err(Error::InvalidArgument(format!(
                        "inline {total} bytes > max_inline_data {}",
                        self.p.cap.max_inline_data
                    ))));
                }
                let mut v: Vec<u8> = Vec::with_capacity(total as usize);
                for s in w.sg_list {
                    let at = v.len();
                    // SAFETY: inline data is copied at post time from the
                    // caller's buffer (readable by the verbs contract) by a
                    // raw copy, without forming a reference to it; `v` has
                    // capacity for `total` bytes and `set_len` follows.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            s.addr as *const u8,
                            v.as_mut_ptr().add(at),
                            s.length as usize,
                        );
                        v.set_len(at + s.length as usize);
                    }
                }
                let a: Arc<[u8]> = v.into();
                wqe.pieces = vec![Piece {
                    addr: a.as_ptr() as u64,
                    len: total,
                }];
                wqe.inline = Some(a);
            } else {
                match self.resolve(w.sg_list, need) {
                    Ok((p, k, _)) => {
                        wqe.pieces = p;
                        wqe.keep = k;
                    }
                    Err(st) => {
                        self.next_seq += 1;
                        wqe.done = true;
                        wqe.status = st;
                        self.sq.push_back(wqe);
                        self.local_error();
                        continue;
                    }
                }
            }
            self.next_seq += 1;
            self.sq.push_back(wqe);
        }
        Ok(())
    }

    /// A completed local operation (bind, local invalidate) in SQ order.
    pub fn post_local(&mut self, wr_id: u64, opcode: WcOpcode, signaled: bool) -> Result<()> {
        if self.state == QpState::Error {
            self.p
                .scq
                .push(wc(wr_id, WcStatus::WrFlushErr, opcode, self.p.qpn), true);
            return Ok(());
        }
        if self.sq.len() >= self.p.cap.max_send_wr as usize {
            return Err(Error::QueueFull);
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        self.sq.push_back(SendWqe {
            seq,
            wr_id,
            kind: Kind::Local,
            opcode,
            signaled: signaled || self.p.sq_sig_all,
            fence: false,
            pieces: Vec::new(),
            keep: Vec::new(),
            inline: None,
            len: 0,
            sent: 0,
            started: true,
            msn: 0,
            built: true,
            transmitted: true,
            done: true,
            status: WcStatus::Success,
            byte_len: 0,
            vendor_err: 0,
        });
        self.complete_sq();
        Ok(())
    }

    pub fn bind(&mut self, mw: &SoftMw, b: &MwBind<'_>, wr_id: u64, signaled: bool) -> Result<u32> {
        if self.state == QpState::Error {
            return Err(Error::QpError);
        }
        if self.sq.len() >= self.p.cap.max_send_wr as usize {
            return Err(Error::QueueFull);
        }
        let k = mw.bind(b, self.p.pd, self.p.qpn)?;
        self.post_local(wr_id, WcOpcode::BindMw, signaled)?;
        Ok(k)
    }

    pub fn invalidate(&mut self, rkey: u32, wr_id: u64, signaled: bool) -> Result<()> {
        if self.state == QpState::Error {
            return Err(Error::QpError);
        }
        self.p
            .table
            .invalidate(rkey, self.p.pd, None)
            .map_err(|_| {
                Error::Protection(format!("key {rkey:#x} is not a bound window of this PD"))
            })?;
        self.post_local(wr_id, WcOpcode::LocalInv, signaled)
    }

    pub fn post_recv(&mut self, wrs: &[RecvWr<'_>]) -> Result<(), PostError> {
        for (index, w) in wrs.iter().enumerate() {
            let err = |error| PostError { index, error };
            if w.sg_list.len() > self.p.cap.max_recv_sge as usize {
                return Err(err(Error::InvalidArgument(format!(
                    "{} SGEs > max_recv_sge",
                    w.sg_list.len()
                ))));
            }
            if self.state == QpState::Error {
                self.p.rcq.push(
                    wc(w.wr_id, WcStatus::WrFlushErr, WcOpcode::Recv, self.p.qpn),
                    true,
                );
                continue;
            }
            if self.rq.len() >= self.p.cap.max_recv_wr as usize {
                return Err(err(Error::QueueFull));
            }
            match self.resolve(w.sg_list, Access::LOCAL_WRITE) {
                Ok((pieces, keep, len)) => self.rq.push_back(RecvWqe {
                    wr_id: w.wr_id,
                    pieces,
                    _keep: keep,
                    len,
                }),
                Err(st) => {
                    self.p
                        .rcq
                        .push(wc(w.wr_id, st, WcOpcode::Recv, self.p.qpn), true);
                    self.local_error();
                }
            }
        }
        self.drain_anon();
        Ok(())
    }

    /// The receive engine is between segments (for tests).
    pub fn rx_idle(&self) -> bool {
        self.rx == RxState::Frame && self.fpdu.at_boundary()
    }

    /// Whether a receive-side drive is useful (the socket was left unread).
    pub fn rx_paused(&self) -> bool {
        self.rx == RxState::Place
    }

    /// Deliver buffered (anonymous) messages to posted receives, in order.
    /// A message still arriving moves to a receive only between its
    /// segments; one with a segment half read waits for that segment's end
    /// (`finish_segment` calls this again).
    fn drain_anon(&mut self) {
        while !self.anon.is_empty() && !self.rq.is_empty() {
            if self.anon_seg_open
                && self.anon.len() == 1
                && self.anon.front().is_some_and(|a| !a.complete)
            {
                break;
            }
            let a = self.anon.pop_front().expect("non-empty");
            self.stats.anon_bytes -= a.data.len() + ANON_OVERHEAD;
            let r = self.rq.front().expect("non-empty");
            if a.data.len() as u64 > r.len {
                let r = self.rq.pop_front().expect("non-empty");
                let mut w = wc(r.wr_id, WcStatus::LocLenErr, WcOpcode::Recv, self.p.qpn);
                w.byte_len = a.data.len() as u32;
                self.p.rcq.push(w, true);
                self.fatal(TermKind::DdpUntaggedMessageTooLong, false);
                return;
            }
            // SAFETY: the receive's pieces were validated against live
            // registrations (kept alive by `_keep`) with LOCAL_WRITE; the
            // source is our own heap buffer.
            unsafe { scatter(&r.pieces, 0, &a.data) };
            if a.complete {
                let r = self.rq.pop_front().expect("non-empty");
                let mut w = wc(r.wr_id, WcStatus::Success, WcOpcode::Recv, self.p.qpn);
                w.byte_len = a.data.len() as u32;
                w.invalidated_rkey = a.inv;
                self.p.rcq.push(w, a.solicited);
            } else {
                // The message still arriving continues into this receive.
                if let Some(c) = self.cur_send.as_mut() {
                    c.target = Target::Recv;
                }
                break;
            }
        }
    }

    // -----------------------------------------------------------------
    // Completion and error handling.

    fn complete_sq(&mut self) {
        while let Some(f) = self.sq.front() {
            if !f.done {
                break;
            }
            let w = self.sq.pop_front().expect("non-empty");
            self.tx_idx = self.tx_idx.saturating_sub(1);
            if w.signaled || w.status != WcStatus::Success {
                let mut c = wc(w.wr_id, w.status, w.opcode, self.p.qpn);
                c.byte_len = w.byte_len;
                c.vendor_err = w.vendor_err;
                // Send-side successes never satisfy a solicited-only arm; errors do.
                self.p.scq.push(c, false);
            }
        }
    }

    fn sq_index(&self, seq: u64) -> Option<usize> {
        let first = self.sq.front()?.seq;
        let i = seq.checked_sub(first)? as usize;
        (i < self.sq.len()).then_some(i)
    }

    /// Move to the error state: complete what is done, give `first` to the
    /// oldest unfinished send WR, flush everything else.
    pub fn enter_error(&mut self, first: Option<(WcStatus, u32)>) {
        if self.state == QpState::Error {
            return;
        }
        self.state = QpState::Error;
        let mut first = first;
        // Frames not yet started are dropped; a partly written one is
        // finished (stream integrity for a Terminate) — keep the memory of
        // the WRs about to be flushed alive until it is gone.
        while self.txq.len() > 1 || self.txq.back().is_some_and(|f| f.written == 0) {
            if let Some(f) = self.txq.pop_back() {
                self.txq_bytes -= f.total - f.written;
            }
        }
        for mut w in std::mem::take(&mut self.sq) {
            if !self.txq.is_empty() {
                self.graveyard.append(&mut w.keep);
            }
            if !w.done {
                match first.take() {
                    Some((st, v)) => {
                        w.status = st;
                        w.vendor_err = v;
                    }
                    None => w.status = WcStatus::WrFlushErr,
                }
            }
            if w.signaled || w.status != WcStatus::Success {
                let mut c = wc(w.wr_id, w.status, w.opcode, self.p.qpn);
                c.byte_len = w.byte_len;
                c.vendor_err = w.vendor_err;
                self.p.scq.push(c, true);
            }
        }
        self.tx_idx = 0;
        for r in std::mem::take(&mut self.rq) {
            self.p.rcq.push(
                wc(r.wr_id, WcStatus::WrFlushErr, WcOpcode::Recv, self.p.qpn),
                true,
            );
        }
        self.anon.clear();
        self.stats.anon_bytes = 0;
        self.orq.clear();
        self.irq.clear();
        self.irq_built = 0;
        self.tx_cur_irq = false;
        self.cur_send = None;
        self.tagged = None;
    }

    /// A local error (bad local key): the QP enters the error state and the
    /// connection is closed, so the peer flushes too.
    fn local_error(&mut self) {
        self.enter_error(None);
        self.rx = RxState::Discard;
        if self.shut == Shut::None {
            self.shut = Shut::Now;
        }
    }

    /// Something to transmit or a close to carry out (for posting paths).
    pub fn tx_pending(&self) -> bool {
        !self.txq.is_empty() || self.term_out.is_some() || self.shut == Shut::Now
    }

    /// A local protocol violation by the peer: send a Terminate, enter error,
    /// discard the rest of the stream.
    fn fatal(&mut self, code: impl Into<TermError>, with_hdr: bool) {
        let code: TermError = code.into();
        let hdr = self.fpdu.header_bytes();
        let t = if with_hdr && hdr.len() >= lwio_iwarp::wire::ddp::TAGGED_HDR_LEN {
            TerminateRepr::for_segment(code, self.fpdu.ulpdu_len(), hdr)
        } else {
            TerminateRepr::new(code)
        };
        self.terminate_with(code, &t);
    }

    /// A framing or header error found by the deframer, with its Terminate.
    fn fatal_rx(&mut self, e: RxError) {
        self.terminate_with(e.error, &e.terminate);
    }

    fn terminate_with(&mut self, code: TermError, t: &TerminateRepr) {
        tracing::debug!(qpn = self.p.qpn, ?code, "terminating stream");
        if self.state != QpState::Error {
            self.term_out = Some(*t);
            self.stats.term_sent += 1;
            self.stats.last_term = code.vendor_err();
            if self.shut == Shut::None {
                self.shut = Shut::AfterTx;
            }
        }
        self.enter_error(None);
        self.rx = RxState::Discard;
    }

    /// Orderly disconnect: stop taking send WRs, let the queued ones (and
    /// answers to the peer's reads) go out, then close our direction and
    /// flush whatever is still outstanding (reads awaiting data, receives).
    pub fn disconnect(&mut self) {
        if self.state == QpState::Rts {
            self.state = QpState::Closing;
        }
        self.check_closing();
    }

    fn check_closing(&mut self) {
        if self.state != QpState::Closing {
            return;
        }
        let busy = !self.txq.is_empty()
            || self.term_out.is_some()
            || !self.irq.is_empty()
            || self.sq.iter().any(|w| !w.transmitted);
        if busy {
            return;
        }
        self.enter_error(None);
        self.rx = RxState::Discard;
        if self.shut == Shut::None {
            self.shut = Shut::Now;
        }
    }

    /// The consumer's `set_error`.
    pub fn set_error(&mut self) {
        self.enter_error(None);
        self.rx = RxState::Discard;
        self.txq.clear();
        self.txq_bytes = 0;
        self.graveyard.clear();
        self.term_out = None;
        if self.shut != Shut::Done {
            self.shut = Shut::Now;
        }
    }

    // -----------------------------------------------------------------
    // Transmit.

    /// Emit the header area of `f` for `h` (+ a Terminate's `body`), the
    /// payload being `f`'s pieces, and add the trailer (pad, CRC).
    fn seal_frame(&self, f: &mut TxFrame, h: &SegmentHeader, body: Option<&TerminateRepr>) {
        let payload: usize = f.pieces[..f.npieces].iter().map(|p| p.len as usize).sum();
        f.hdr_len = emit_fpdu_header(h, body, payload, &mut f.hdr)
            .expect("TX_HDR holds every header and max_payload bounds the ULPDU");
        let ulpdu = f.hdr_len - MPA_HDR_LEN + payload;
        f.trailer = if self.p.crc {
            // Copy the payload into the frame once and checksum (and send)
            // that copy: no Rust reference to registered memory is formed,
            // and the bytes checksummed are exactly the bytes sent even if
            // the consumer (or another QP placing into the same region)
            // writes the source meanwhile.
            let mut own: Vec<u8> = Vec::with_capacity(payload);
            for p in &f.pieces[..f.npieces] {
                let at = own.len();
                // SAFETY: the piece lies in a live registration (kept alive
                // by the WR/frame) or the WR's inline buffer, and `own` has
                // capacity for it; `set_len` follows the copy, and only
                // initialised bytes are then exposed.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        p.addr as *const u8,
                        own.as_mut_ptr().add(at),
                        p.len as usize,
                    );
                    own.set_len(at + p.len as usize);
                }
            }
            let t = Trailer::with_crc(ulpdu, &[&f.hdr[..f.hdr_len], &own]);
            if !own.is_empty() {
                f.pieces[0] = Piece {
                    addr: own.as_ptr() as u64,
                    len: own.len() as u64,
                };
                f.npieces = 1;
            }
            f._staged = Some(own);
            t
        } else {
            Trailer::without_crc(ulpdu)
        };
        f.total = f.hdr_len + payload + f.trailer.as_ref().len();
    }

    fn new_frame(owner: FrameOwner) -> TxFrame {
        TxFrame {
            hdr: [0; TX_HDR],
            hdr_len: 0,
            pieces: [Piece { addr: 0, len: 0 }; 8],
            npieces: 0,
            trailer: Trailer::without_crc(0),
            total: 0,
            written: 0,
            owner,
            _keep: None,
            _inline: None,
            _staged: None,
        }
    }

    /// Build the next frame to send, if any.
    fn next_frame(&mut self) -> Option<TxFrame> {
        if let Some(t) = self.term_out.take() {
            let mut f = Self::new_frame(FrameOwner::Term);
            let msn = self.msns.start_message(QN_TERMINATE).unwrap_or_default();
            let h = untagged(Opcode::Terminate, true, 0, QN_TERMINATE, msn, 0);
            self.seal_frame(&mut f, &h, Some(&t));
            return Some(f);
        }
        if self.state == QpState::Error {
            return None;
        }
        let irq_ready = self.irq.len() > self.irq_built;
        let use_irq = self.tx_cur_irq
            || (irq_ready
                && !self
                    .sq
                    .get(self.tx_idx)
                    .is_some_and(|w| w.started && !w.built));
        if use_irq && irq_ready {
            return Some(self.irq_frame());
        }
        // Skip WRs already framed (local WRs are framed at post time).
        while self.sq.get(self.tx_idx).is_some_and(|w| w.built) {
            self.tx_idx += 1;
        }
        let w = self.sq.get(self.tx_idx)?;
        if !w.started {
            if w.fence && !self.orq.is_empty() {
                return None;
            }
            if matches!(w.kind, Kind::Read { .. }) && self.orq.len() >= self.p.ord.max(1) as usize {
                return None;
            }
        }
        Some(self.sq_frame())
    }

    fn irq_frame(&mut self) -> TxFrame {
        let maxp = self.p.max_payload as u64;
        let e = &mut self.irq[self.irq_built];
        let n = (e.len - e.sent).min(maxp);
        let last = e.sent + n == e.len;
        let mut f = Self::new_frame(FrameOwner::Irq { last });
        let h = tagged(
            Opcode::ReadResponse,
            last,
            e.sink_stag,
            e.sink_to.wrapping_add(e.sent),
        );
        if n > 0 {
            f.pieces[0] = Piece {
                addr: e.src + e.sent,
                len: n,
            };
            f.npieces = 1;
        }
        f._keep = e.mr.clone();
        e.sent += n;
        e.started = true;
        self.tx_cur_irq = !last;
        if last {
            self.irq_built += 1;
        }
        self.seal_frame(&mut f, &h, None);
        f
    }

    fn sq_frame(&mut self) -> TxFrame {
        let maxp = self.p.max_payload as u64;
        let idx = self.tx_idx;
        let pd_msn;
        {
            let w = &mut self.sq[idx];
            if !w.started {
                w.started = true;
                let q = match w.kind {
                    Kind::Send { .. } => Some(QN_SEND),
                    Kind::Read { .. } => Some(QN_READ_REQUEST),
                    _ => None,
                };
                if let Some(q) = q {
                    w.msn = self.msns.start_message(q).unwrap_or_default();
                }
            }
            pd_msn = w.msn;
        }
        let w = &mut self.sq[idx];
        let mut f;
        match w.kind {
            Kind::Read { stag, to } => {
                f = Self::new_frame(FrameOwner::Sq {
                    seq: w.seq,
                    last: true,
                });
                let (sink_stag, sink_to) = match (w.pieces.first(), w.keep.first()) {
                    (Some(p), Some(k)) => (k.stag, p.addr),
                    _ => (0, 0),
                };
                let mut h = untagged(Opcode::ReadRequest, true, 0, QN_READ_REQUEST, pd_msn, 0);
                h.read_request = Some(ReadRequest {
                    sink_stag,
                    sink_to,
                    size: w.len as u32,
                    src_stag: stag,
                    src_to: to,
                });
                w.sent = w.len;
                w.built = true;
                self.orq.push_back(OrqEntry {
                    seq: w.seq,
                    sink_stag,
                    sink_to,
                    len: w.len,
                    got: 0,
                });
                self.seal_frame(&mut f, &h, None);
            }
            Kind::Send { .. } | Kind::Write { .. } => {
                let n = (w.len - w.sent).min(maxp);
                let last = w.sent + n == w.len;
                f = Self::new_frame(FrameOwner::Sq { seq: w.seq, last });
                let h = match w.kind {
                    Kind::Write { stag, to } => {
                        tagged(Opcode::Write, last, stag, to.wrapping_add(w.sent))
                    }
                    Kind::Send { inv, se } => {
                        let opc = match (inv.is_some(), se) {
                            (false, false) => Opcode::Send,
                            (true, false) => Opcode::SendInvalidate,
                            (false, true) => Opcode::SendSe,
                            (true, true) => Opcode::SendSeInvalidate,
                        };
                        untagged(opc, last, inv.unwrap_or(0), QN_SEND, pd_msn, w.sent as u32)
                    }
                    _ => unreachable!(),
                };
                let mut v = Vec::with_capacity(4);
                map_pieces(&w.pieces, w.sent, n, &mut v);
                for (i, p) in v.into_iter().enumerate().take(8) {
                    f.pieces[i] = p;
                    f.npieces = i + 1;
                }
                // Keep the first registration alive for the frame; the others
                // are kept by the WR, which outlives the frame unless the QP
                // is flushed — then the frame is dropped too (see `drive`).
                f._keep = w.keep.first().cloned();
                f._inline = w.inline.clone();
                w.sent += n;
                w.built = last;
                self.seal_frame(&mut f, &h, None);
            }
            Kind::Local => unreachable!("local WRs are skipped"),
        }
        f
    }

    fn frame_done(&mut self, owner: FrameOwner) {
        match owner {
            FrameOwner::Term => {}
            FrameOwner::Irq { last } => {
                if last {
                    self.irq.pop_front();
                    self.irq_built = self.irq_built.saturating_sub(1);
                }
            }
            FrameOwner::Sq { seq, last } => {
                if !last {
                    return;
                }
                if let Some(i) = self.sq_index(seq) {
                    let w = &mut self.sq[i];
                    w.transmitted = true;
                    if !matches!(w.kind, Kind::Read { .. }) {
                        w.done = true;
                        w.byte_len = w.len as u32;
                    }
                }
                self.complete_sq();
            }
        }
    }

    /// Transmit until the socket is full or nothing is left. Up to
    /// `TX_BATCH` frames (`TX_BATCH_BYTES`) go out in one `sendmsg`.
    pub fn tx_process(&mut self, io: &mut dyn Io) -> io::Result<usize> {
        let mut frames = 0;
        let mut iov: Vec<libc::iovec> = Vec::new();
        loop {
            while self.txq.len() < TX_BATCH && self.txq_bytes < TX_BATCH_BYTES {
                match self.next_frame() {
                    Some(f) => {
                        self.txq_bytes += f.total - f.written;
                        self.txq.push_back(f);
                    }
                    None => break,
                }
            }
            if self.txq.is_empty() {
                break;
            }
            // The iovec list of everything unwritten.
            iov.clear();
            for f in &self.txq {
                let mut skip = f.written;
                let mut push = |base: *const u8, len: usize| {
                    if skip >= len {
                        skip -= len;
                        return;
                    }
                    iov.push(libc::iovec {
                        // SAFETY (pointer arithmetic): skip < len, inside the part.
                        iov_base: unsafe { base.add(skip) } as *mut libc::c_void,
                        iov_len: len - skip,
                    });
                    skip = 0;
                };
                push(f.hdr.as_ptr(), f.hdr_len);
                for p in &f.pieces[..f.npieces] {
                    push(p.addr as *const u8, p.len as usize);
                }
                push(f.trailer.as_ref().as_ptr(), f.trailer.as_ref().len());
            }
            // SAFETY: the iovecs cover the frames' own arrays and payload
            // pieces inside live registrations (kept alive by their WRs, the
            // frames, or the graveyard after a flush) or inline/staged
            // buffers owned by the frames; the kernel only reads them.
            match unsafe { io.writev(&iov) } {
                Ok(mut w) => {
                    self.txq_bytes -= w;
                    while w > 0 {
                        let f = self
                            .txq
                            .front_mut()
                            .expect("written bytes belong to a frame");
                        let rem = f.total - f.written;
                        if w < rem {
                            f.written += w;
                            break;
                        }
                        w -= rem;
                        let owner = f.owner;
                        self.txq.pop_front();
                        frames += 1;
                        self.frame_done(owner);
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
        }
        if self.txq.is_empty() {
            self.graveyard.clear();
            if self.term_out.is_none() && self.shut == Shut::AfterTx {
                self.shut = Shut::Now;
            }
        }
        self.check_closing();
        Ok(frames)
    }

    /// Nothing left to transmit.
    pub fn tx_idle(&self) -> bool {
        self.txq.is_empty() && self.term_out.is_none()
    }

    // -----------------------------------------------------------------
    // Receive.

    /// Process incoming bytes until the stream is drained (WouldBlock),
    /// paused by flow control, or closed. Returns segments processed.
    pub fn rx_process(&mut self, io: &mut dyn Io) -> io::Result<usize> {
        let mut segs = 0;
        self.rx_more = false;
        if self.peer_closed {
            return Ok(0);
        }
        loop {
            if segs >= self.p.rx_budget {
                // Fairness: let other QPs run. The socket may still hold
                // data and no new edge will say so: the driver must come
                // back (see `rx_more`).
                self.rx_more = true;
                return Ok(segs);
            }
            let r = self.rx_step(io);
            match r {
                Ok(true) => segs += 1,
                Ok(false) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(segs),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => {
                    self.peer_closed = true;
                    self.on_eof();
                    return Ok(segs);
                }
                Err(e) => {
                    self.peer_closed = true;
                    tracing::debug!(qpn = self.p.qpn, error = %e, "receive error");
                    self.on_eof();
                    return Ok(segs);
                }
            }
            if self.rx == RxState::Place {
                // Paused (indicate window full): leave the socket unread.
                return Ok(segs);
            }
        }
    }

    fn on_eof(&mut self) {
        self.enter_error(Some((WcStatus::RetryExcErr, 0)).filter(|_| false));
        self.rx = RxState::Discard;
        if self.shut == Shut::None {
            self.shut = Shut::Now;
        }
    }

    fn eof() -> io::Error {
        io::Error::new(io::ErrorKind::UnexpectedEof, "peer closed")
    }

    /// One step; Ok(true) when a segment completed.
    fn rx_step(&mut self, io: &mut dyn Io) -> io::Result<bool> {
        match self.rx {
            RxState::Discard => {
                self.stage.start = self.stage.end;
                if self.stage.fill(io, STAGE)? == 0 {
                    return Err(Self::eof());
                }
                self.stage.start = self.stage.end;
                Ok(false)
            }
            RxState::Place => {
                self.place();
                Ok(false)
            }
            RxState::Payload => {
                if self.fpdu.payload_remaining() > 0 && self.direct_read(io)? {
                    return Ok(false);
                }
                self.rx_frame(io)
            }
            RxState::Frame => self.rx_frame(io),
        }
    }

    /// The current destination piece, skipping filled ones.
    fn dest_piece(&mut self) -> Option<Piece> {
        while let Some(p) = self.dest.get(self.dest_idx) {
            if self.dest_off < p.len {
                return Some(*p);
            }
            self.dest_idx += 1;
            self.dest_off = 0;
        }
        None
    }

    /// Payload straight from the socket into its target (CRC off, nothing
    /// staged, a large enough piece). Returns false when the bytes must go
    /// through the stage instead.
    fn direct_read(&mut self, io: &mut dyn Io) -> io::Result<bool> {
        if self.stage.all_staged
            || self.stage.avail() > 0
            || !DIRECT_PLACEMENT.load(std::sync::atomic::Ordering::Relaxed)
        {
            return Ok(false);
        }
        let Some(p) = self.dest_piece() else {
            return Ok(false);
        };
        let left = (p.len - self.dest_off).min(u64::from(self.fpdu.payload_remaining())) as usize;
        let min = if self.stage.small {
            SMALL_DIRECT_MIN
        } else {
            DIRECT_MIN
        };
        if p.addr == 0 || left < min {
            return Ok(false);
        }
        // SAFETY: `p` lies inside a registration validated for this segment
        // (tagged: STag/PD/rights/bounds checked; receive: lkey with
        // LOCAL_WRITE; anonymous: our own heap buffer, kept in place while
        // `anon_seg_open`) and kept alive by the WR/validation context. The
        // kernel writes it; no Rust reference to it is formed, and the
        // bytes are not read back (no CRC).
        let n = unsafe { io.read((p.addr + self.dest_off) as *mut u8, left)? };
        if n == 0 {
            return Err(Self::eof());
        }
        self.stats.direct += n as u64;
        self.dest_off += n as u64;
        if let Err(e) = self.fpdu.advance_len(n as u32) {
            self.fatal_rx(e);
        }
        Ok(true)
    }

    /// Feed staged bytes to the deframer and act on what it finds.
    fn rx_frame(&mut self, io: &mut dyn Io) -> io::Result<bool> {
        if self.stage.avail() == 0 {
            let limit = if self.stage.all_staged
                || self.stage.small
                || !DIRECT_PLACEMENT.load(std::sync::atomic::Ordering::Relaxed)
            {
                STAGE
            } else if self.rx == RxState::Payload {
                (self.fpdu.payload_remaining() as usize).max(HDR_FILL)
            } else {
                HDR_FILL
            };
            if self.stage.fill(io, limit)? == 0 {
                return Err(Self::eof());
            }
        }
        let input = &self.stage.buf[self.stage.start..self.stage.end];
        let (used, ev) = match self.fpdu.poll(input) {
            Ok(r) => r,
            Err(e) => {
                self.fatal_rx(e);
                return Ok(false);
            }
        };
        match ev {
            None => {
                self.stage.start += used;
                Ok(false)
            }
            Some(FpduEvent::Payload { data, .. }) => {
                let mut data = data;
                while !data.is_empty() {
                    let Some(p) = self.dest.get(self.dest_idx).copied() else {
                        break;
                    };
                    let n = ((p.len - self.dest_off) as usize).min(data.len());
                    if p.addr != 0 && n > 0 {
                        // SAFETY: as in `direct_read`: a validated, live
                        // destination that no Rust reference covers; the
                        // source is our own stage.
                        unsafe {
                            std::ptr::copy_nonoverlapping(
                                data.as_ptr(),
                                (p.addr + self.dest_off) as *mut u8,
                                n,
                            )
                        };
                        self.stats.copied += n as u64;
                    }
                    data = &data[n..];
                    self.dest_off += n as u64;
                    if self.dest_off == p.len {
                        self.dest_idx += 1;
                        self.dest_off = 0;
                    }
                }
                self.stage.start += used;
                Ok(false)
            }
            Some(FpduEvent::Header {
                header,
                ulpdu_len,
                payload_len,
            }) => {
                self.stage.start += used;
                self.on_header(header, ulpdu_len, payload_len);
                Ok(false)
            }
            Some(FpduEvent::End) => {
                self.stage.start += used;
                if let Some(seg) = self.cur.take() {
                    self.ddp.commit(&seg);
                }
                self.finish_segment();
                if self.rx != RxState::Discard {
                    self.rx = RxState::Frame;
                }
                Ok(true)
            }
        }
    }

    /// A segment header: validate it against the stream (lwio-iwarp's
    /// DDP/RDMAP rules), then find where its payload goes.
    fn on_header(&mut self, h: SegmentHeader, ulpdu_len: u16, paylen: u32) {
        let seg = match self.ddp.validate(&h, paylen) {
            Ok(seg) => seg,
            Err(e) => return self.fatal(e, true),
        };
        let mut s = Seg {
            tagged: false,
            last: h.last,
            opcode: h.opcode,
            paylen: paylen as usize,
            rr: h.read_request,
            ..Seg::default()
        };
        match h.ddp {
            DdpKind::Tagged { stag, to } => {
                s.tagged = true;
                s.stag = stag;
                s.to = to;
            }
            DdpKind::Untagged {
                rsvd_ulp,
                qn,
                msn,
                mo,
            } => {
                s.inv = rsvd_ulp;
                s.qn = qn;
                s.msn = msn;
                s.mo = mo;
            }
        }
        self.stage.small = (ulpdu_len as usize) < SMALL_SEG;
        self.seg = s;
        self.cur = Some(seg);
        self.rx = RxState::Place;
        self.place();
    }

    /// Decide where the current segment's payload goes (validating it), or
    /// stay paused.
    fn place(&mut self) {
        self.dest.clear();
        self.dest_idx = 0;
        self.dest_off = 0;
        self.anon_seg_open = false;
        let s = self.seg;
        let n = s.paylen as u64;
        if self.state == QpState::Error {
            self.dest.push(Piece { addr: 0, len: n });
            self.rx = RxState::Payload;
            return;
        }
        if s.tagged {
            match s.opcode {
                Opcode::Write => {
                    if n > 0 {
                        let cont = self
                            .tagged
                            .as_ref()
                            .filter(|c| c.stag == s.stag && c.next_to == s.to);
                        let addr = match cont {
                            Some(c) => {
                                if s.to.checked_add(n).is_none_or(|e| e > c.end)
                                    || !c.mr.valid.load(std::sync::atomic::Ordering::Acquire)
                                {
                                    return self.fatal(TermKind::DdpTaggedBaseBounds, true);
                                }
                                s.to
                            }
                            None => match self.p.table.remote(
                                s.stag,
                                s.to,
                                n,
                                Access::REMOTE_WRITE,
                                self.p.pd,
                                self.p.qpn,
                                false,
                            ) {
                                Ok(r) => {
                                    // The message's validated range: for a
                                    // multi-segment write, later segments must
                                    // stay inside the region/window range.
                                    self.tagged = Some(TaggedCtx {
                                        stag: s.stag,
                                        next_to: s.to,
                                        end: r.end,
                                        mr: r.mr,
                                    });
                                    r.ptr
                                }
                                Err(c) => return self.fatal(c, true),
                            },
                        };
                        if let Some(c) = self.tagged.as_mut() {
                            c.next_to = s.to + n;
                        }
                        self.dest.push(Piece { addr, len: n });
                    }
                }
                Opcode::ReadResponse => {
                    let Some(o) = self.orq.front() else {
                        return self.fatal(TermKind::RdmapOpUnexpectedOpcode, true);
                    };
                    if n > 0 {
                        if s.stag != o.sink_stag {
                            return self.fatal(TermKind::DdpTaggedInvalidStag, true);
                        }
                        if s.to != o.sink_to + o.got || o.got + n > o.len {
                            return self.fatal(TermKind::DdpTaggedBaseBounds, true);
                        }
                        self.dest.push(Piece { addr: s.to, len: n });
                    }
                }
                _ => return self.fatal(TermKind::RdmapOpUnexpectedOpcode, true),
            }
        } else {
            match (s.qn, s.opcode) {
                (
                    QN_SEND,
                    Opcode::Send
                    | Opcode::SendInvalidate
                    | Opcode::SendSe
                    | Opcode::SendSeInvalidate,
                ) => {
                    // MSN and message offset were checked by `DdpRxState`.
                    let target = match &self.cur_send {
                        Some(c) => c.target,
                        None if self.anon.is_empty() && !self.rq.is_empty() => Target::Recv,
                        None => Target::Anon,
                    };
                    match target {
                        Target::Recv => {
                            let r = self.rq.front().expect("receive posted");
                            if s.mo as u64 + n > r.len {
                                let r = self.rq.pop_front().expect("non-empty");
                                let mut w =
                                    wc(r.wr_id, WcStatus::LocLenErr, WcOpcode::Recv, self.p.qpn);
                                w.byte_len = (s.mo as u64 + n) as u32;
                                self.p.rcq.push(w, true);
                                return self.fatal(TermKind::DdpUntaggedMessageTooLong, true);
                            }
                            let mut v = std::mem::take(&mut self.dest);
                            map_pieces(&r.pieces, s.mo as u64, n, &mut v);
                            self.dest = v;
                        }
                        Target::Anon => {
                            let extra = if self.cur_send.is_none() {
                                ANON_OVERHEAD
                            } else {
                                0
                            };
                            if self.stats.anon_bytes + n as usize + extra > self.p.indicate_window {
                                self.stats.paused += 1;
                                self.rx = RxState::Place;
                                return;
                            }
                            if self.cur_send.is_none() {
                                self.anon.push_back(AnonMsg {
                                    data: Vec::new(),
                                    complete: false,
                                    inv: None,
                                    solicited: false,
                                });
                            }
                            self.stats.anon_bytes += n as usize + extra;
                            self.stats.anon_peak = self.stats.anon_peak.max(self.stats.anon_bytes);
                            let a = self.anon.back_mut().expect("anon message");
                            self.anon_seg_open = true;
                            let old = a.data.len();
                            a.data.resize(old + n as usize, 0);
                            if n > 0 {
                                self.dest.push(Piece {
                                    addr: a.data.as_mut_ptr() as u64 + old as u64,
                                    len: n,
                                });
                            }
                        }
                    }
                    if self.cur_send.is_none() {
                        self.cur_send = Some(CurSend { mo: 0, target });
                    }
                }
                (QN_READ_REQUEST, Opcode::ReadRequest) => {
                    if self.irq.len() >= self.p.ird.max(1) as usize {
                        return self.fatal(TermKind::MpaInsufficientIrd, true);
                    }
                    let Some(rr) = s.rr else {
                        return self.fatal(TermKind::RdmapOpUnspecified, true);
                    };
                    let mr = if rr.size > 0 {
                        match self.p.table.remote(
                            rr.src_stag,
                            rr.src_to,
                            rr.size as u64,
                            Access::REMOTE_READ,
                            self.p.pd,
                            self.p.qpn,
                            true,
                        ) {
                            Ok(r) => Some(r.mr),
                            Err(c) => return self.fatal(c, true),
                        }
                    } else {
                        None
                    };
                    self.irq.push_back(IrqEntry {
                        mr,
                        src: rr.src_to,
                        len: rr.size as u64,
                        sent: 0,
                        sink_stag: rr.sink_stag,
                        sink_to: rr.sink_to,
                        started: false,
                    });
                }
                (QN_TERMINATE, Opcode::Terminate) => {
                    let k = (n as usize).min(TERM_MAX);
                    self.ctl.fill(0);
                    if k > 0 {
                        self.dest.push(Piece {
                            addr: self.ctl.as_mut_ptr() as u64,
                            len: k as u64,
                        });
                    }
                    if (n as usize) > k {
                        self.dest.push(Piece {
                            addr: 0,
                            len: n - k as u64,
                        });
                    }
                }
                (q, _) if q > QN_TERMINATE => {
                    return self.fatal(TermKind::DdpUntaggedInvalidQn, true)
                }
                _ => return self.fatal(TermKind::RdmapOpUnexpectedOpcode, true),
            }
        }
        self.rx = RxState::Payload;
    }

    fn finish_segment(&mut self) {
        self.anon_seg_open = false;
        if self.state == QpState::Error {
            return;
        }
        let s = self.seg;
        let n = s.paylen as u64;
        if s.tagged {
            match s.opcode {
                Opcode::Write if s.last => self.tagged = None,
                Opcode::ReadResponse => {
                    let Some(o) = self.orq.front_mut() else {
                        return;
                    };
                    o.got += n;
                    if s.last {
                        let o = self.orq.pop_front().expect("non-empty");
                        if o.got != o.len {
                            return self.fatal(TermKind::DdpTaggedBaseBounds, false);
                        }
                        if let Some(i) = self.sq_index(o.seq) {
                            let w = &mut self.sq[i];
                            w.done = true;
                            w.byte_len = o.len as u32;
                        }
                        self.complete_sq();
                    }
                }
                _ => {}
            }
            return;
        }
        match s.qn {
            QN_SEND => {
                let Some(c) = self.cur_send.as_mut() else {
                    return;
                };
                c.mo += n;
                if !s.last {
                    if c.target == Target::Anon {
                        // A receive posted while this segment was being
                        // read takes the message from here on.
                        self.drain_anon();
                    }
                    return;
                }
                let total = c.mo;
                let target = c.target;
                self.cur_send = None;
                let inv = if s.opcode.is_invalidate() {
                    if self
                        .p
                        .table
                        .invalidate(s.inv, self.p.pd, Some(self.p.qpn))
                        .is_err()
                    {
                        return self.fatal(TermKind::RdmapOpCannotInvalidate, false);
                    }
                    Some(s.inv)
                } else {
                    None
                };
                let solicited = s.opcode.is_solicited();
                match target {
                    Target::Recv => {
                        let r = self.rq.pop_front().expect("receive in progress");
                        let mut w = wc(r.wr_id, WcStatus::Success, WcOpcode::Recv, self.p.qpn);
                        w.byte_len = total as u32;
                        w.invalidated_rkey = inv;
                        self.p.rcq.push(w, solicited);
                    }
                    Target::Anon => {
                        if let Some(a) = self.anon.back_mut() {
                            a.complete = true;
                            a.inv = inv;
                            a.solicited = solicited;
                        }
                        self.drain_anon();
                    }
                }
            }
            QN_TERMINATE => {
                let code = rdmap::terminate_error(&self.ctl[..])
                    .unwrap_or(TermKind::RdmapOpUnspecified.into());
                tracing::debug!(qpn = self.p.qpn, ?code, "terminate received");
                self.stats.term_recv += 1;
                self.stats.last_term = code.vendor_err();
                let st = if code.is_protection() {
                    WcStatus::RemAccessErr
                } else if code.kind() == Some(TermKind::DdpUntaggedMessageTooLong) {
                    WcStatus::RemInvReqErr
                } else {
                    WcStatus::RemOpErr
                };
                self.enter_error(Some((st, code.vendor_err())));
                self.rx = RxState::Discard;
                if self.shut == Shut::None {
                    self.shut = Shut::Now;
                }
            }
            _ => {}
        }
    }

    /// The number of posted receives and SQ entries (for tests).
    pub fn queue_lens(&self) -> (usize, usize) {
        (self.sq.len(), self.rq.len())
    }
}
