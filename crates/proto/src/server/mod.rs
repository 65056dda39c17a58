//! Sans-IO per-connection LWIO server state machine.
//!
//! Feed it received message bytes (`handle_recv`), storage completions
//! (`handle_storage_complete`) and timer expiries (`handle_timeout`); take
//! the resulting [`ServerAction`]s with [`ServerConn::poll_action`]. It never
//! touches an RDMA API, a file or a clock itself.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::fragment::{Budget, FragmentError, Reassembler, Reservation};
use crate::wire::common::{Flags, HeaderPacket, HeaderRepr};
use crate::wire::fragment::{FragmentPacket, FragmentRepr, FRAGMENT_HEADER_LEN, OPCODE_FRAGMENT};

use crate::stats::RequestStats;
use crate::status::*;
use crate::wire::auth::{AuthParamsPacket, ENDIAN_64, FEATURE_FLUSH, FEATURE_IMMEDIATE};
use crate::wire::common::{CancelTarget, CompletionMode, Opcode, RequestOp};
use crate::wire::{
    AuthParamsRepr, FidParamsRepr, Guid, IoStatusBlock, RdmaRegion, RequestRepr, SignatureAlg,
    SrvResumeKey, StatusResponse, COMMON_HEADER_LEN, FILE_NO_INTERMEDIATE_BUFFERING, LWIO_REV_ID,
};

mod control;
mod io;
mod recv;

/// Identifies one storage operation issued by a [`ServerConn`].
pub type OpId = u64;

/// Server configuration (docs/protocol.md §10 for defaults).
#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub page_size: u16,
    pub max_rdma_window_size: u32,
    pub max_send_buffer_size: u32,
    /// Payload bytes accepted after the common header.
    pub max_recv_buffer_size: u32,
    /// Upper bound of the initial credit grant.
    pub max_credits: u16,
    /// Backend sector size; VEC_READ's last region must be a multiple.
    pub sector_size: u32,
    /// Complete successful full reads with RDMA write with immediate (this
    /// device sends them), for clients that accept them (FEATURES bit 1).
    pub use_write_with_imm: bool,
    /// Accept the seed's MD5 signature (compatibility mode).
    pub allow_md5: bool,
    /// AUTH must arrive this long after the connection is accepted, else
    /// the connection is closed (`CloseReason::AuthTimeout`).
    pub auth_timeout: Duration,
    /// A credit transaction unanswered this long marks the client slow
    /// ([`ServerConn::slow_credit_replies`]); the connection stays and the
    /// transaction stays open (docs/durability.md §2). A dead peer is the
    /// transport's to detect.
    pub credit_timeout: Duration,
    pub max_fids: usize,
    /// Session id handed to the client in SESSION_ID.
    pub session_id: u64,
    /// The largest fragmented message this server reassembles (AUTH option
    /// MAX_MESSAGE, docs/protocol.md §5.12); 0 = no fragments.
    pub max_message: u32,
    /// Receive memory that partial messages may hold across the server
    /// (shared by its connections); `None`: one message per connection.
    pub fragment_budget: Option<Arc<Budget>>,
    /// Serve FLUSH (offered in the AUTH answer's FEATURES, §5.13): the
    /// embedder performs [`ServerAction::FileSync`].
    pub flush: bool,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            page_size: 4096,
            max_rdma_window_size: 512 * 1024,
            max_send_buffer_size: 16,
            max_recv_buffer_size: 8 * 1024,
            max_credits: 32,
            sector_size: 512,
            use_write_with_imm: false,
            allow_md5: false,
            auth_timeout: Duration::from_secs(10),
            credit_timeout: Duration::from_secs(10),
            max_fids: 1024,
            session_id: 1,
            max_message: 0,
            fragment_budget: None,
            flush: true,
        }
    }
}

/// Callbacks into the embedding server.
pub trait ServerHooks {
    /// Per-session secret bound to the negotiate Key, `None` if unknown.
    /// Only a lookup: an AUTH whose signature then fails must not use the
    /// Key up (see [`ServerHooks::auth_verified`]).
    fn session_secret(&mut self, key: &Guid) -> Option<Vec<u8>>;
    /// The AUTH naming `key` carried a valid signature: use the Key up now
    /// (one AUTH per Key). `false` refuses the AUTH (the Key was used in
    /// the meantime, or is gone).
    fn auth_verified(&mut self, key: &Guid) -> bool {
        let _ = key;
        true
    }
    /// Validate a resume key and open the file; returns an opaque file
    /// handle passed back in storage actions, or the failure status.
    fn open_file(
        &mut self,
        resume_key: &SrvResumeKey,
        flags_and_attributes: u32,
    ) -> Result<u64, NtStatus>;
}

/// The embedder's data for one storage operation ([`OpId`]), kept by the
/// [`ServerConn`] with the operation: created with `U::default()` when the
/// operation starts, reachable with [`ServerConn::op_data_mut`] while it is
/// in flight. When it completes the data is dropped with it, unless
/// [`OpData::outlives_op`] says the embedder still needs it (a read buffer
/// that the completion's RDMA Writes read from): then it stays reachable
/// ([`ServerConn::done_data_mut`]) until the embedder takes it back with
/// [`ServerConn::take_done_data`].
pub trait OpData: Default {
    /// Checked when the operation completes: keep the data until
    /// [`ServerConn::take_done_data`] (true), or drop it with the
    /// operation (false).
    fn outlives_op(&self) -> bool {
        false
    }
}

/// No data per operation.
impl OpData for () {}

/// A receive buffer the embedder names in [`ServerConn::handle_recv_in`].
/// `RecvId::MAX` is no buffer (what [`ServerConn::handle_recv`] passes):
/// nothing is kept under it.
pub type RecvId = u64;

/// What the embedder does with the receive buffer of a message it handed
/// to [`ServerConn::handle_recv_in`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecvBuffer {
    /// Done with: post it again.
    Repost,
    /// Kept: a fragment of a message being reassembled, or a WRITE (a
    /// VEC_WRITE without COLLAPSE) whose data it holds, lent to the file
    /// write. It comes back in a [`ServerAction::FileWriteParts`] or
    /// [`ServerAction::RepostRecvs`]; until then the embedder neither
    /// reposts nor reuses it.
    Kept,
}

/// Where the bytes of an RDMA write come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DataSource {
    /// Bytes owned by the action (auth params, status blocks).
    Inline(Vec<u8>),
    /// `len` bytes at `offset` of the read buffer the embedder filled for
    /// storage operation `op` (zero copy).
    ReadBuffer { op: OpId, offset: u32, len: u32 },
}

/// Why a connection is terminated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CloseReason {
    AuthTimeout,
    AuthFailed,
    /// Client-side: its CREDIT reply went unanswered for `op_timeout`.
    /// (The server never closes for a slow credit reply.)
    CreditTimeout,
    /// Client exceeded its credits.
    CreditOverflow,
    /// WRITE/VEC_WRITE payload or VEC_READ region count above limits.
    PayloadTooLarge,
    /// Malformed message, unknown opcode, bad flags, Cookie 0, …
    ProtocolViolation(&'static str),
    /// A fragment broke the rules of docs/protocol.md §5.12.
    Fragment(FragmentError),
    /// Client-side: the server misbehaved or authentication failed.
    ServerMisbehaved(&'static str),
}

impl CloseReason {
    /// The NTSTATUS the connection is terminated with.
    pub fn status(&self) -> NtStatus {
        match self {
            CloseReason::Fragment(e) => e.status(),
            CloseReason::AuthFailed => STATUS_ACCESS_DENIED,
            CloseReason::PayloadTooLarge => STATUS_INVALID_BUFFER_SIZE,
            CloseReason::AuthTimeout | CloseReason::CreditTimeout => STATUS_IO_TIMEOUT,
            _ => STATUS_INVALID_PARAMETER,
        }
    }
}

/// Output of the server state machine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ServerAction {
    /// Post a send of these bytes.
    Send(Vec<u8>),
    /// RDMA write into client memory; `imm` = RDMA write with immediate.
    RdmaWrite {
        remote_addr: u64,
        rkey: u32,
        data: DataSource,
        imm: Option<u32>,
    },
    /// Read `len` bytes at `offset` of `file` into a buffer kept for `op`;
    /// answer with `handle_storage_complete(op, Ok(bytes_read))`.
    FileRead {
        op: OpId,
        fid: u16,
        file: u64,
        offset: u64,
        len: u32,
    },
    /// Write `data` at `offset`; answer with `Ok(bytes_written)`. The
    /// data is the server's own: a COLLAPSE write's expansion, or a WRITE
    /// that came through [`ServerConn::handle_recv`] (no buffer to lend).
    FileWrite {
        op: OpId,
        fid: u16,
        file: u64,
        offset: u64,
        data: Vec<u8>,
    },
    /// Write data that is still in receive buffers at `offset`: the bytes
    /// are `range` of each receive buffer in `parts` (ranges of the bytes
    /// the embedder passed to `handle_recv_in`), in order — one `pwritev`,
    /// no copy. A reassembled message has a part per fragment; a WRITE (or
    /// VEC_WRITE without COLLAPSE) received whole has one, its data in its
    /// own buffer. When the write is done the embedder reposts every buffer
    /// of `parts` and answers `handle_storage_complete(op,
    /// Ok(bytes_written))`.
    FileWriteParts {
        op: OpId,
        fid: u16,
        file: u64,
        offset: u64,
        parts: Vec<(RecvId, Range<usize>)>,
    },
    /// fsync (`data_only`: fdatasync) `file`; answer with
    /// `handle_storage_complete(op, Ok(0))` or the failure status (a FLUSH).
    FileSync {
        op: OpId,
        fid: u16,
        file: u64,
        data_only: bool,
    },
    /// Receive buffers kept for fragments, now to be posted again (a
    /// message refused before its write).
    RepostRecvs(Vec<RecvId>),
    /// Try to cancel `op` (its FileRead/FileWrite was taken earlier); it
    /// must still be completed (Err(STATUS_CANCELLED) if cancelled, else
    /// its result).
    CancelIo { op: OpId },
    /// The read buffer of `op` is no longer referenced.
    ReleaseReadBuffer { op: OpId },
    /// The file registered as `fid` is closed and has no I/O in flight.
    CloseFile { fid: u16, file: u64 },
    /// Terminate the connection; nothing more will be produced.
    CloseConnection(CloseReason),
}

/// Errors of [`ServerConn::start_credit_delta`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CreditError {
    NotAuthenticated,
    TransactionInProgress,
    /// Delta is 0 or would move credits outside 1..=255.
    OutOfRange,
    Closed,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    AwaitAuth,
    Ready,
    Closed,
}

#[derive(Debug, Clone)]
struct FileEntry {
    file: u64,
    flags: u32,
    closing: bool,
    inflight: usize,
}

#[derive(Debug, Clone)]
enum IoKind {
    Read {
        data_va: u64,
        data_mh: u32,
    },
    VecRead {
        regions: Vec<RdmaRegion>,
    },
    Write,
    /// A FLUSH: no data, answered with its status alone.
    Sync,
    /// A reassembled message's write; it holds `extra` credits beyond its
    /// own (one per fragment after the first).
    WriteParts {
        extra: u32,
    },
    /// One piece of a READ longer than a read buffer (`big_reads[parent]`),
    /// `at` bytes into its window.
    ReadPiece {
        parent: u64,
        at: u32,
    },
}

/// A FLUSH's `FileSync`, held until the writes received before it on the
/// connection (`after`) have reached storage.
#[derive(Debug)]
struct HeldSync {
    op: OpId,
    after: Vec<OpId>,
    action: ServerAction,
}

/// Pieces of one long READ read from storage at once.
const READ_PIECES_IN_FLIGHT: u32 = 4;

/// A READ longer than MaxRdmaWindowSize (an lwio extension, negotiated
/// with MAX_MESSAGE; docs/protocol.md §5.12): read and RDMA-written in
/// pieces of at most a read buffer, a few at a time, answered with one
/// status.
#[derive(Debug, Clone)]
struct BigRead {
    fid: u16,
    file: u64,
    offset: u64,
    length: u32,
    data_va: u64,
    data_mh: u32,
    mode: CompletionMode,
    opcode: Opcode,
    started: Instant,
    /// Where the next piece starts (bytes into the window).
    next: u32,
    inflight: u32,
    /// By piece start: the bytes asked, and what came back.
    results: BTreeMap<u32, (u32, Result<u32, NtStatus>)>,
    /// A piece came back short or failed: no more are started.
    stopped: bool,
}

#[derive(Debug, Clone)]
struct PendingIo {
    /// Its opcode and when it arrived (request statistics).
    opcode: Opcode,
    started: Instant,
    fid: u16,
    kind: IoKind,
    mode: CompletionMode,
    requested: u32,
}

/// A credit transaction in progress; `deadline` is when its client counts
/// as slow (None once it has been counted).
#[derive(Debug, Clone, Copy)]
enum CreditTx {
    Positive {
        n: i32,
        deadline: Option<Instant>,
    },
    Negative {
        expect: i32,
        deadline: Option<Instant>,
    },
}

/// The request a fragmented message carries, read from its FIRST fragment.
#[derive(Debug, Clone, Copy)]
struct FragHead {
    opcode: Opcode,
    fid: u16,
    offset: u64,
    mode: CompletionMode,
    /// When its FIRST fragment arrived.
    started: Instant,
    /// Fragments received so far (each holds a credit).
    frags: u32,
}

/// Per-connection LWIO server. `U` is the embedder's data per storage
/// operation ([`OpData`]).
#[derive(Debug)]
pub struct ServerConn<U = ()> {
    cfg: ServerConfig,
    state: State,
    auth_deadline: Instant,
    client: Option<AuthParamsRepr>,
    credits: u16,
    outstanding: u32,
    polled_completions: u64,
    data_requests: u64,
    credit_hint: u8,
    /// The highest Credits hint since the last [`ServerConn::take_peak_hint`].
    peak_hint: u8,
    /// Credits (fragments) of the largest message reassembled since
    /// [`ServerConn::take_largest_message`] last asked.
    largest_message: u32,
    credit_tx: Option<CreditTx>,
    slow_credit_replies: u64,
    unused_credits_reported: u32,
    /// A pending INTERRUPT: its cookie and when it arrived.
    interrupt: Option<(u64, Instant)>,
    fids: BTreeMap<u16, FileEntry>,
    next_fid: u16,
    /// Storage operations in flight, each with the embedder's data.
    ops: HashMap<OpId, (PendingIo, U)>,
    /// The embedder's data of completed operations that outlive them
    /// ([`OpData::outlives_op`]), until [`ServerConn::take_done_data`].
    done: HashMap<OpId, U>,
    next_op: OpId,
    actions: VecDeque<ServerAction>,
    /// FLUSHes waiting for the writes that arrived before them to reach
    /// storage (§5.13): each with the writes it still waits for.
    held_syncs: Vec<HeldSync>,
    stats: RequestStats,
    reasm: Reassembler<RecvId>,
    /// The server-wide bound the reassembler reserves from; also what a
    /// COLLAPSE write longer than a window reserves for its expansion.
    budget: Arc<Budget>,
    frag: Option<FragHead>,
    /// Receive memory held by reassembled messages being written.
    reservations: HashMap<OpId, Reservation>,
    /// READs served in pieces, by id.
    big_reads: HashMap<u64, BigRead>,
    next_big: u64,
    /// The request being answered (its opcode and arrival), and the time
    /// of the event being handled: for the statistics.
    cur: Option<(Opcode, Instant)>,
    now: Instant,
}

impl ServerConn {
    /// A new connection without data per operation; AUTH must arrive
    /// before `now + auth_timeout`.
    pub fn new(cfg: ServerConfig, now: Instant) -> Self {
        Self::with_op_data(cfg, now)
    }
}

impl<U: OpData> ServerConn<U> {
    /// A new connection keeping the embedder's `U` per storage operation;
    /// AUTH must arrive before `now + auth_timeout`.
    pub fn with_op_data(cfg: ServerConfig, now: Instant) -> Self {
        let auth_deadline = now + cfg.auth_timeout;
        let budget = cfg
            .fragment_budget
            .clone()
            .unwrap_or_else(|| Budget::new(cfg.max_message as usize));
        let reasm = Reassembler::new(cfg.max_message, budget.clone());
        ServerConn {
            reasm,
            budget,
            frag: None,
            reservations: HashMap::new(),
            big_reads: HashMap::new(),
            next_big: 1,
            cfg,
            state: State::AwaitAuth,
            auth_deadline,
            client: None,
            credits: 1,
            outstanding: 0,
            polled_completions: 0,
            data_requests: 0,
            credit_hint: 0,
            peak_hint: 0,
            largest_message: 0,
            credit_tx: None,
            slow_credit_replies: 0,
            unused_credits_reported: 0,
            interrupt: None,
            fids: BTreeMap::new(),
            next_fid: 1,
            ops: HashMap::new(),
            done: HashMap::new(),
            next_op: 1,
            actions: VecDeque::new(),
            held_syncs: Vec::new(),
            stats: RequestStats::default(),
            cur: None,
            now,
        }
    }

    /// The requests served so far: by opcode, latency and error status.
    pub fn request_stats(&self) -> &RequestStats {
        &self.stats
    }

    /// [`ServerConn::request_stats`], handed over and reset (for an
    /// embedder that adds them into its totals now and then).
    pub fn take_request_stats(&mut self) -> RequestStats {
        std::mem::take(&mut self.stats)
    }

    /// Count the answer to the request being handled (`self.cur`).
    fn answered(&mut self, information: u32, status: NtStatus) {
        if let Some((op, started)) = self.cur {
            let bytes = if op.is_io() { information } else { 0 };
            let latency = self.now.saturating_duration_since(started);
            self.stats.completed(op, status, latency, bytes);
        }
    }

    pub fn config(&self) -> &ServerConfig {
        &self.cfg
    }
    pub fn is_authenticated(&self) -> bool {
        self.client.is_some() && self.state != State::Closed
    }
    pub fn is_closed(&self) -> bool {
        self.state == State::Closed
    }
    /// Requests completed through the client's status block (polling
    /// mode) so far: a server may busy-poll while its client does.
    pub fn polled_completions(&self) -> u64 {
        self.polled_completions
    }
    /// Data requests (READ, WRITE, VEC_READ, VEC_WRITE) received so far:
    /// a balancer's sign of a connection in use (credit replies and
    /// INTERRUPTs are not).
    pub fn data_requests(&self) -> u64 {
        self.data_requests
    }

    /// Current credit limit.
    pub fn credits(&self) -> u16 {
        self.credits
    }
    /// Requests received and not yet completed.
    pub fn outstanding(&self) -> u32 {
        self.outstanding
    }
    /// Last Credits hint received from the client.
    pub fn credit_hint(&self) -> u8 {
        self.credit_hint
    }
    /// The highest Credits hint received since the last call (seed 000:
    /// the number of requests pending on the client), for a balancer that
    /// looks every so often; 0 when no request arrived.
    pub fn take_peak_hint(&mut self) -> u8 {
        std::mem::take(&mut self.peak_hint)
    }
    /// The credits the largest message took since the last call (its
    /// fragments; 0 if no fragmented message arrived): a client whose
    /// spare credits cannot hold another such message is short of them,
    /// however few requests it has outstanding.
    pub fn take_largest_message(&mut self) -> u32 {
        std::mem::take(&mut self.largest_message)
    }
    pub fn credit_transaction_active(&self) -> bool {
        self.credit_tx.is_some()
    }
    /// Credit transactions the client left unanswered for longer than
    /// `credit_timeout` (each counted once; the connection stays).
    pub fn slow_credit_replies(&self) -> u64 {
        self.slow_credit_replies
    }
    /// Value of the client's last CREDIT reply to a positive delta.
    pub fn unused_credits_reported(&self) -> u32 {
        self.unused_credits_reported
    }
    /// The credits the client reported unused since the last call (its
    /// last CREDIT reply to a positive delta), for the embedder to take
    /// back; 0 when there is no new report.
    pub fn take_unused_credits(&mut self) -> u32 {
        std::mem::take(&mut self.unused_credits_reported)
    }
    /// The client's AUTH params once authenticated.
    pub fn client_params(&self) -> Option<&AuthParamsRepr> {
        self.client.as_ref()
    }
    /// Number of live (not closing) Fids.
    pub fn open_fids(&self) -> usize {
        self.fids.values().filter(|f| !f.closing).count()
    }
    /// Storage operations in flight.
    pub fn pending_ops(&self) -> usize {
        self.ops.len()
    }
    /// The embedder's data of storage operation `op`: in flight, or
    /// completed and kept ([`OpData::outlives_op`]) but not yet taken.
    pub fn op_data_mut(&mut self, op: OpId) -> Option<&mut U> {
        match self.ops.get_mut(&op) {
            Some((_, d)) => Some(d),
            None => self.done.get_mut(&op),
        }
    }
    /// The embedder's data of completed operation `op`, kept
    /// ([`OpData::outlives_op`]) and not yet taken.
    pub fn done_data_mut(&mut self, op: OpId) -> Option<&mut U> {
        self.done.get_mut(&op)
    }
    /// Take back the data of completed operation `op` (None while it is
    /// in flight, or when its data was not kept or is already taken).
    pub fn take_done_data(&mut self, op: OpId) -> Option<U> {
        self.done.remove(&op)
    }
    /// The embedder's data of every operation in flight, then of every
    /// completed one kept and not yet taken.
    pub fn op_data_iter_mut(&mut self) -> impl Iterator<Item = (OpId, &mut U)> + '_ {
        self.ops
            .iter_mut()
            .map(|(op, (_, d))| (*op, d))
            .chain(self.done.iter_mut().map(|(op, d)| (*op, d)))
    }
    /// Every registered file (including ones closing with I/O in flight)
    /// as (Fid, file handle): what the embedder must release when the
    /// connection is torn down.
    pub fn registered_files(&self) -> Vec<(u16, u64)> {
        self.fids.iter().map(|(fid, f)| (*fid, f.file)).collect()
    }

    /// Next action to carry out.
    pub fn poll_action(&mut self) -> Option<ServerAction> {
        self.actions.pop_front()
    }

    /// Earliest time `handle_timeout` must be called.
    pub fn poll_timeout(&self) -> Option<Instant> {
        match self.state {
            State::AwaitAuth => Some(self.auth_deadline),
            State::Ready => match self.credit_tx {
                Some(CreditTx::Positive { deadline, .. })
                | Some(CreditTx::Negative { deadline, .. }) => deadline,
                None => None,
            },
            State::Closed => None,
        }
    }

    pub fn handle_timeout(&mut self, now: Instant) {
        match self.state {
            State::AwaitAuth if now >= self.auth_deadline => self.close(CloseReason::AuthTimeout),
            State::Ready => {
                // A late answer is a slow client, not a dead one (a stopped
                // process, CPU steal, a GC pause): count it once, keep the
                // transaction open and the connection up. A dead peer is
                // the transport's to detect (docs/durability.md §2).
                if let Some(
                    CreditTx::Positive { deadline, .. } | CreditTx::Negative { deadline, .. },
                ) = self.credit_tx.as_mut()
                {
                    if deadline.is_some_and(|d| now >= d) {
                        *deadline = None;
                        self.slow_credit_replies += 1;
                    }
                }
            }
            _ => {}
        }
    }

    fn close(&mut self, reason: CloseReason) {
        if self.state != State::Closed {
            self.state = State::Closed;
            self.actions
                .push_back(ServerAction::CloseConnection(reason));
        }
    }

    fn send_status(&mut self, cookie: u64, information: u32, status: NtStatus) {
        if cookie != 0 {
            // (Cookie 0: the server's own credit notification.)
            self.answered(information, status);
        }
        let s = StatusResponse {
            cookie,
            ios: IoStatusBlock {
                information,
                status,
            },
        };
        self.actions
            .push_back(ServerAction::Send(s.to_bytes().to_vec()));
    }

    /// Complete a request: status response, status block, or nothing
    /// (immediate already sent). Releases its credit.
    fn complete(
        &mut self,
        mode: CompletionMode,
        information: u32,
        status: NtStatus,
        imm_sent: bool,
    ) {
        match mode {
            CompletionMode::Interrupt { cookie, .. } => {
                if !imm_sent {
                    self.send_status(cookie, information, status)
                } else {
                    self.answered(information, status);
                }
            }
            CompletionMode::Polled { ios_va, ios_mh } => {
                self.polled_completions += 1;
                self.answered(information, status);
                let b = IoStatusBlock {
                    information,
                    status,
                }
                .to_bytes()
                .to_vec();
                self.actions.push_back(ServerAction::RdmaWrite {
                    remote_addr: ios_va,
                    rkey: ios_mh,
                    data: DataSource::Inline(b),
                    imm: None,
                });
            }
        }
        self.outstanding = self.outstanding.saturating_sub(1);
    }

    /// Complete an I/O request, then answer a pending INTERRUPT.
    fn complete_io(&mut self, mode: CompletionMode, information: u32, status: NtStatus, imm: bool) {
        self.complete(mode, information, status, imm);
        if let Some((cookie, at)) = self.interrupt.take() {
            let io = self.cur.replace((Opcode::Interrupt, at));
            self.send_status(cookie, 0, STATUS_SUCCESS);
            self.cur = io;
            self.outstanding = self.outstanding.saturating_sub(1);
        }
    }

    /// Start a credit transaction (docs/protocol.md §7).
    pub fn start_credit_delta(&mut self, now: Instant, delta: i32) -> Result<(), CreditError> {
        match self.state {
            State::Closed => return Err(CreditError::Closed),
            State::AwaitAuth => return Err(CreditError::NotAuthenticated),
            State::Ready => {}
        }
        if self.credit_tx.is_some() {
            return Err(CreditError::TransactionInProgress);
        }
        let new = i64::from(self.credits) + i64::from(delta);
        if delta == 0 || !(1..=255).contains(&new) {
            return Err(CreditError::OutOfRange);
        }
        let deadline = Some(now + self.cfg.credit_timeout);
        if delta > 0 {
            self.credits = new as u16;
            self.credit_tx = Some(CreditTx::Positive { n: delta, deadline });
        } else {
            self.credit_tx = Some(CreditTx::Negative {
                expect: delta,
                deadline,
            });
        }
        self.send_status(0, delta as u32, LWIO_NOTIFY_CREDIT);
        Ok(())
    }

    /// Process one received message (exactly the bytes received) whose
    /// buffer the embedder reposts at once: a WRITE's data is copied into
    /// a [`ServerAction::FileWrite`]. A fragment (§5.12) cannot be kept
    /// this way: it terminates the connection; an embedder that negotiates
    /// fragments uses [`ServerConn::handle_recv_in`].
    pub fn handle_recv(&mut self, now: Instant, msg: &[u8], hooks: &mut dyn ServerHooks) {
        if self.is_fragment(msg) {
            self.now = now;
            return self.close(CloseReason::ProtocolViolation("fragment without a buffer"));
        }
        let _ = self.handle_recv_in(now, RecvId::MAX, msg, hooks);
    }

    /// Process one received message (exactly the bytes received) that
    /// landed in receive buffer `buf` (not `RecvId::MAX`); the answer says
    /// whether the embedder may post the buffer again now or must keep it:
    /// a fragment of a message being reassembled, or a WRITE whose data is
    /// lent to its [`ServerAction::FileWriteParts`] (ranges in later
    /// actions are offsets into these same `msg` bytes).
    pub fn handle_recv_in(
        &mut self,
        now: Instant,
        buf: RecvId,
        msg: &[u8],
        hooks: &mut dyn ServerHooks,
    ) -> RecvBuffer {
        self.now = now;
        let r = if self.is_fragment(msg) {
            self.recv_fragment(now, buf, msg, hooks)
        } else {
            if self.frag.is_some() && self.state != State::Closed {
                self.reasm.abort();
                self.frag = None;
                self.close(CloseReason::Fragment(FragmentError::Missing));
            }
            let mut kept = RecvBuffer::Repost;
            self.recv(now, buf, &mut kept, msg, hooks);
            kept
        };
        self.cur = None;
        r
    }
}

fn normalize(st: NtStatus) -> NtStatus {
    // Never complete with a value the client treats specially.
    // ... and never with a top byte of 0xFF, which a polling client reads as
    // its sentinel (wire::small::poll_block_written).
    if st == STATUS_SUCCESS || st == STATUS_PENDING || st == LWIO_NOTIFY_CREDIT || st >> 24 == 0xFF
    {
        STATUS_INSUFFICIENT_RESOURCES
    } else {
        st
    }
}

fn read_result(result: Result<u32, NtStatus>, requested: u32) -> Result<u32, NtStatus> {
    match result {
        Ok(0) => Err(STATUS_END_OF_FILE),
        Ok(n) => Ok(n.min(requested)),
        Err(st) => Err(normalize(st)),
    }
}
