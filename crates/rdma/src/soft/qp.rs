//! The queue-pair protocol engine ([`QpEngine`]), split like Linux siw's
//! `siw_qp.c` / `siw_qp_tx.c` / `siw_qp_rx.c`: here its queues (send,
//! receive, inbound/outbound RDMA Read, anonymous receive buffering under
//! the indicate window), posting, state and the error/flush machinery;
//! transmit in `qp_tx.rs`, receive and placement in `qp_rx.rs`.
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
use super::mem::{read_fences, MemTable, MrState, PlaceKeep, Regions, SoftMw};
use super::srq::SrqBinding;
use crate::verbs::*;
use lwio_iwarp::fpdu_rx::{FpduConfig, FpduEvent, FpduReceiver, RxError};
use lwio_iwarp::rx::{DdpRxState, Segment};
use lwio_iwarp::tx::{emit_fpdu_header, Trailer, TxState};
use lwio_iwarp::wire::ddp::Kind as DdpKind;
use lwio_iwarp::wire::mpa::MPA_HDR_LEN;
use lwio_iwarp::wire::rdmap::{
    self, Opcode, ReadRequest, TerminateRepr, IMMEDIATE_DATA_LEN, QN_READ_REQUEST, QN_SEND,
    QN_TERMINATE,
};
use lwio_iwarp::wire::segment::SegmentHeader;
use lwio_iwarp::wire::term::{TermError, TermKind};

#[path = "qp_rx.rs"]
mod rx;
#[path = "qp_tx.rs"]
mod tx;

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

/// A socket as an [`Io`], borrowed for as long as the engine uses it.
pub struct SockIo<'a>(pub std::os::fd::BorrowedFd<'a>);

// SAFETY: both methods forward the caller's guarantees (the trait's
// `# Safety` contract) unchanged to the system call wrappers, whose contracts
// are the same; the descriptor is borrowed, so it is open for the call.
impl Io for SockIo<'_> {
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
/// The staging buffer's size until a read fills it (and again after
/// `STAGE_QUIET` small reads): what an idle QP holds.
pub const STAGE_MIN: usize = 4096;
pub const STAGE_QUIET: u32 = 256;
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
    Send {
        inv: Option<u32>,
        se: bool,
    },
    /// RDMA Write; with `imm` (value, solicited), followed by an RFC 7306
    /// Immediate Data message carrying it (RDMA Write with Immediate).
    Write {
        stag: u32,
        to: u64,
        imm: Option<(u32, bool)>,
    },
    Read {
        stag: u32,
        to: u64,
    },
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

/// A posted receive (of a QP, or of a shared receive queue).
pub(crate) struct RecvWqe {
    pub(crate) wr_id: u64,
    pub(crate) pieces: Vec<Piece>,
    pub(crate) _keep: Vec<Arc<MrState>>,
    pub(crate) len: u64,
}

/// Resolve local SGEs of domain `pd` needing `need` (besides the key's
/// validity and bounds) to pieces, the registrations keeping them alive,
/// and the total length.
pub(crate) fn resolve_sges(
    table: &MemTable,
    pd: u32,
    sges: &[Sge],
    need: Access,
) -> Result<Resolved, WcStatus> {
    let mut pieces = Vec::with_capacity(sges.len());
    let mut keep = Vec::with_capacity(sges.len());
    let mut len = 0u64;
    for s in sges {
        if s.length == 0 {
            continue;
        }
        let mr = table.local(s, pd, need)?;
        pieces.push(Piece {
            addr: s.addr,
            len: s.length as u64,
        });
        keep.push(mr);
        len += s.length as u64;
    }
    Ok((pieces, keep, len))
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
    /// An Immediate Data message's value (no `data`): completes its
    /// receive as `RecvRdmaWithImm`.
    imm: Option<u32>,
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
    keep: PlaceKeep,
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
    /// The registrations the payload lies in (kept alive, and fenced
    /// while the frame is read from them).
    keep: Regions,
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
    /// Reads in a row that brought less than `STAGE_MIN` (see `fill`).
    quiet: u32,
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
    /// Receives come from this shared receive queue, not `rq`.
    pub srq: Option<SrqBinding>,
}

/// One QP's protocol engine: everything behind the QP's mutex.
pub struct QpEngine {
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
    /// The receive the Send being received goes to, taken from `rq` (or
    /// the SRQ) when the message starts.
    cur_recv: Option<RecvWqe>,
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
    /// The registration (and window) `dest` lies in, for a tagged segment:
    /// every write into it is fenced against revocation (`mem` docs).
    dest_keep: Option<PlaceKeep>,
    /// The start of the payload's last aligned word, held back until the
    /// segment's next bytes complete it (`qp_rx::place_bytes`).
    held: Option<rx::HeldWord>,
    ctl: Box<[u8; TERM_MAX]>,
    /// The payload of an arriving Immediate Data message (RFC 7306).
    imm_in: Box<[u8; IMMEDIATE_DATA_LEN as usize]>,
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

impl QpEngine {
    pub fn new(p: QpParams) -> QpEngine {
        let crc = p.crc;
        QpEngine {
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
            cur_recv: None,
            anon: VecDeque::new(),
            anon_seg_open: false,
            rx: RxState::Frame,
            stage: Stage {
                all_staged: crc,
                small: true,
                buf: vec![0u8; STAGE_MIN].into_boxed_slice(),
                start: 0,
                end: 0,
                quiet: 0,
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
            dest_keep: None,
            held: None,
            dest_off: 0,
            ctl: Box::new([0; TERM_MAX]),
            imm_in: Box::new([0; IMMEDIATE_DATA_LEN as usize]),
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
        resolve_sges(&self.p.table, self.p.pd, sges, need)
    }

    /// The next receive for an arriving Send: from the QP's queue, or from
    /// its SRQ (which, if empty, wakes this QP when receives are posted).
    fn take_recv(&mut self) -> Option<RecvWqe> {
        match &self.p.srq {
            Some(b) => b.take(),
            None => self.rq.pop_front(),
        }
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
                        imm: None,
                    },
                    WcOpcode::RdmaWrite,
                ),
                SendOp::WriteWithImm {
                    remote_addr,
                    rkey,
                    imm,
                } => (
                    Kind::Write {
                        stag: rkey,
                        to: remote_addr,
                        imm: Some((imm, w.solicited)),
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
                // RFC 7306 has Immediate Data, not a Send carrying it.
                SendOp::SendWithImm { .. } => {
                    return Err(err(Error::NotSupported("Send with immediate".into())))
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
        if self.p.srq.is_some() && !wrs.is_empty() {
            return Err(PostError {
                index: 0,
                error: Error::InvalidArgument(
                    "the QP takes its receives from a shared receive queue".into(),
                ),
            });
        }
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
            if self.rq.len() + self.cur_recv.is_some() as usize >= self.p.cap.max_recv_wr as usize {
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
        // Its WRs complete (flushed) below, and a `register_raw` owner may
        // then free their memory: the frame sends from its own copy.
        if let Some(f) = self.txq.front_mut() {
            f.own_payload();
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
        // A receive taken from an SRQ is this QP's now; the SRQ's others
        // are not (verbs: a QP's flush leaves the SRQ alone).
        for r in self
            .cur_recv
            .take()
            .into_iter()
            .chain(std::mem::take(&mut self.rq))
        {
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

    /// The number of posted receives and SQ entries (for tests).
    pub fn queue_lens(&self) -> (usize, usize) {
        (
            self.sq.len(),
            self.rq.len() + self.cur_recv.is_some() as usize,
        )
    }
}
