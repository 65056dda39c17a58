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
use crate::wire::auth::{AuthParamsPacket, ENDIAN_64, FEATURE_FLUSH};
use crate::wire::common::{CancelTarget, CompletionMode, Opcode, RequestOp};
use crate::wire::{
    AuthParamsRepr, FidParamsRepr, Guid, IoStatusBlock, RdmaRegion, RequestRepr, SignatureAlg,
    SrvResumeKey, StatusResponse, COMMON_HEADER_LEN, FILE_NO_INTERMEDIATE_BUFFERING, LWIO_REV_ID,
};

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
    /// Complete successful full reads with RDMA write with immediate.
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

/// Per-connection LWIO server.
#[derive(Debug)]
pub struct ServerConn {
    cfg: ServerConfig,
    state: State,
    auth_deadline: Instant,
    client: Option<AuthParamsRepr>,
    credits: u16,
    outstanding: u32,
    polled_completions: u64,
    data_requests: u64,
    credit_hint: u8,
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
    ops: HashMap<OpId, PendingIo>,
    next_op: OpId,
    actions: VecDeque<ServerAction>,
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
    /// A new connection; AUTH must arrive before `now + auth_timeout`.
    pub fn new(cfg: ServerConfig, now: Instant) -> Self {
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
            largest_message: 0,
            credit_tx: None,
            slow_credit_replies: 0,
            unused_credits_reported: 0,
            interrupt: None,
            fids: BTreeMap::new(),
            next_fid: 1,
            ops: HashMap::new(),
            next_op: 1,
            actions: VecDeque::new(),
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

    /// A fragment: opcode 10 where a request's opcode is, on a connection
    /// whose server takes fragments (elsewhere opcode 10 is unknown, and the
    /// message malformed).
    fn is_fragment(&self, msg: &[u8]) -> bool {
        self.cfg.max_message > 0 && msg.get(4) == Some(&OPCODE_FRAGMENT)
    }

    /// Take one credit for an arriving message (a request or a fragment);
    /// false (and the connection closed) when the client had none left.
    fn take_credit(&mut self) -> bool {
        if u32::from(self.credits) <= self.outstanding {
            self.close(CloseReason::CreditOverflow);
            return false;
        }
        self.outstanding += 1;
        true
    }

    fn recv_fragment(
        &mut self,
        now: Instant,
        buf: RecvId,
        msg: &[u8],
        hooks: &mut dyn ServerHooks,
    ) -> RecvBuffer {
        if self.state == State::Closed {
            return RecvBuffer::Repost;
        }
        if self.state == State::AwaitAuth {
            self.close(CloseReason::ProtocolViolation("fragment before AUTH"));
            return RecvBuffer::Repost;
        }
        self.stats.fragments += 1;
        let parsed = FragmentPacket::new_checked(msg)
            .ok()
            .filter(|p| p.data_length() as usize + FRAGMENT_HEADER_LEN == msg.len())
            .and_then(|p| FragmentRepr::parse(&p).ok());
        let Some(f) = parsed else {
            return self.fragment_violation(FragmentError::Malformed);
        };
        if !self.take_credit() {
            self.reasm.abort();
            self.frag = None;
            return RecvBuffer::Repost;
        }
        let data = FRAGMENT_HEADER_LEN..msg.len();
        if f.first {
            match self.fragment_head(now, &msg[data.clone()], &f) {
                Ok(h) => self.frag = Some(h),
                Err(e) => return self.fragment_violation(e),
            }
        }
        match self.reasm.push(&f, buf, data) {
            Err(rej) => {
                self.frag = None;
                self.close(CloseReason::Fragment(rej.error));
                RecvBuffer::Repost
            }
            Ok(None) => {
                if let Some(h) = self.frag.as_mut() {
                    h.frags += 1;
                }
                RecvBuffer::Kept
            }
            Ok(Some(msg)) => {
                let Some(mut h) = self.frag.take() else {
                    self.close(CloseReason::Fragment(FragmentError::NotStarted));
                    return RecvBuffer::Repost;
                };
                h.frags += 1;
                self.largest_message = self.largest_message.max(h.frags);
                self.stats.messages_reassembled += 1;
                self.write_assembled(h, msg, hooks);
                RecvBuffer::Kept
            }
        }
    }

    fn fragment_violation(&mut self, e: FragmentError) -> RecvBuffer {
        self.reasm.abort();
        self.frag = None;
        self.close(CloseReason::Fragment(e));
        RecvBuffer::Repost
    }

    /// The request in a FIRST fragment's data: a WRITE or a VEC_WRITE
    /// (without COLLAPSE) whose common header lies wholly in this fragment
    /// and whose Length is the rest of the message.
    fn fragment_head(
        &self,
        now: Instant,
        data: &[u8],
        f: &FragmentRepr,
    ) -> Result<FragHead, FragmentError> {
        let hp = HeaderPacket::new_checked(data).map_err(|_| FragmentError::Malformed)?;
        let h = HeaderRepr::parse(&hp).map_err(|_| FragmentError::Malformed)?;
        let opcode = match Opcode::from_u8(h.opcode) {
            Some(o @ (Opcode::Write | Opcode::VecWrite)) => o,
            _ => return Err(FragmentError::Malformed),
        };
        let fl = h.flags;
        if fl.0 & !Flags::ALL != 0 || fl.control() || fl.collapse() {
            return Err(FragmentError::Malformed);
        }
        let total = f.message_length().ok_or(FragmentError::Malformed)?;
        if u64::from(h.length) + COMMON_HEADER_LEN as u64 != u64::from(total) {
            return Err(FragmentError::Malformed);
        }
        let mode = CompletionMode::from_header(&h);
        if let CompletionMode::Interrupt { cookie: 0, .. } = mode {
            return Err(FragmentError::Malformed);
        }
        Ok(FragHead {
            opcode,
            fid: h.fid,
            offset: h.offset,
            mode,
            started: now,
            frags: 0,
        })
    }

    /// A whole fragmented message: one write over the buffers it landed
    /// in, answered by one status that gives back all its credits.
    fn write_assembled(
        &mut self,
        h: FragHead,
        m: crate::fragment::Assembled<RecvId>,
        hooks: &mut dyn ServerHooks,
    ) {
        let _ = hooks;
        self.stats.received(h.opcode);
        self.cur = Some((h.opcode, h.started));
        let extra = h.frags.saturating_sub(1);
        let mut parts = m.parts;
        if let Some((_, r)) = parts.first_mut() {
            r.start = (r.start + COMMON_HEADER_LEN).min(r.end);
        }
        let len = m.len.saturating_sub(COMMON_HEADER_LEN as u32);
        let refuse = |s: &mut Self, st: NtStatus, parts: Vec<(RecvId, Range<usize>)>| {
            s.actions.push_back(ServerAction::RepostRecvs(
                parts.into_iter().map(|(b, _)| b).collect(),
            ));
            s.complete_io(h.mode, 0, st, false);
            s.outstanding = s.outstanding.saturating_sub(extra);
        };
        let file = match self.check_io(h.fid, h.offset, len) {
            Ok(f) => f,
            Err(st) => return refuse(self, st, parts),
        };
        if len == 0 {
            return refuse(self, STATUS_SUCCESS, parts);
        }
        let op = self.new_op(PendingIo {
            opcode: h.opcode,
            started: h.started,
            fid: h.fid,
            kind: IoKind::WriteParts { extra },
            mode: h.mode,
            requested: len,
        });
        self.reservations.insert(op, m.reservation);
        self.actions.push_back(ServerAction::FileWriteParts {
            op,
            fid: h.fid,
            file,
            offset: h.offset,
            parts,
        });
    }

    /// A whole message in buffer `buf`; `kept` becomes `Kept` when a
    /// write's data is lent from it.
    fn recv(
        &mut self,
        now: Instant,
        buf: RecvId,
        kept: &mut RecvBuffer,
        msg: &[u8],
        hooks: &mut dyn ServerHooks,
    ) {
        if self.state == State::Closed {
            return;
        }
        let req = match RequestRepr::parse(msg) {
            Ok(r) => r,
            Err(_) => return self.close(CloseReason::ProtocolViolation("malformed message")),
        };
        let opcode = req.opcode();
        self.stats.received(opcode);
        if matches!(
            opcode,
            Opcode::Read | Opcode::Write | Opcode::VecRead | Opcode::VecWrite
        ) {
            self.data_requests += 1;
        }
        self.cur = Some((opcode, now));
        let mode = req.mode();
        if let CompletionMode::Interrupt { cookie: 0, .. } = mode {
            return self.close(CloseReason::ProtocolViolation("cookie 0"));
        }
        if !self.take_credit() {
            return;
        }
        self.credit_hint = req.credits;
        if self.state == State::AwaitAuth {
            return match req.op {
                RequestOp::Auth {
                    cookie,
                    data_va,
                    data_mh,
                    params,
                } => self.handle_auth(cookie, data_va, data_mh, params, hooks),
                _ => {
                    if let CompletionMode::Interrupt { cookie, .. } = mode {
                        self.send_status(cookie, 0, STATUS_ACCESS_DENIED);
                    }
                    self.close(CloseReason::ProtocolViolation("request before AUTH"))
                }
            };
        }
        match req.op {
            RequestOp::Auth { .. } => self.close(CloseReason::ProtocolViolation("second AUTH")),
            RequestOp::Register { cookie, params } => self.handle_register(cookie, params, hooks),
            RequestOp::Read {
                fid,
                offset,
                length,
                data_va,
                data_mh,
                mode,
            } => self.start_read(fid, offset, length, IoKind::Read { data_va, data_mh }, mode),
            RequestOp::VecRead {
                fid,
                offset,
                length,
                page_size,
                regions,
                mode,
            } => self.handle_vec_read(fid, offset, length, page_size, regions, mode),
            RequestOp::Write {
                fid,
                offset,
                data,
                mode,
            } => {
                if !self.payload_ok(data.len()) {
                    return self.close(CloseReason::PayloadTooLarge);
                }
                *kept = self.write_in_place(fid, offset, buf, msg, data, mode)
            }
            RequestOp::VecWrite {
                fid,
                offset,
                length,
                num_pages,
                page_size,
                collapse,
                data,
                mode,
            } => {
                if !self.payload_ok(data.len()) {
                    return self.close(CloseReason::PayloadTooLarge);
                }
                if !collapse {
                    // Its data is the rest of the message, as a WRITE's.
                    *kept = self.write_in_place(fid, offset, buf, msg, data, mode);
                    return;
                }
                // Longer than a window (up to MAX_MESSAGE): the expansion
                // is server memory, reserved from the fragment budget.
                let reserved = if length > self.cfg.max_rdma_window_size {
                    match self.budget.reserve(length as usize) {
                        Some(r) => Some(r),
                        None => {
                            return self.complete_io(mode, 0, STATUS_INSUFFICIENT_RESOURCES, false)
                        }
                    }
                } else {
                    None
                };
                match self.expand_collapsed(fid, length, num_pages, page_size, data) {
                    Ok(buf) => {
                        if let Some(op) = self.start_write(fid, offset, buf, mode) {
                            if let Some(r) = reserved {
                                self.reservations.insert(op, r);
                            }
                        }
                    }
                    Err(st) => self.complete_io(mode, 0, st, false),
                }
            }
            RequestOp::Close { fid, cookie } => self.handle_close(fid, cookie),
            RequestOp::Cancel { fid, cookie } => self.handle_cancel(now, fid, cookie, None, mode),
            RequestOp::CancelIo {
                fid,
                cookie,
                target,
            } => self.handle_cancel(now, fid, cookie, Some(target), mode),
            RequestOp::Credit { cookie, value } => self.handle_credit(cookie, value),
            RequestOp::Interrupt { cookie } => {
                if self.interrupt.is_some() {
                    self.complete(mode, 0, STATUS_INVALID_DEVICE_REQUEST, false);
                } else {
                    // Answered (and its credit released) by the next I/O completion.
                    self.interrupt = Some((cookie, now));
                }
            }
            RequestOp::Flush { fid, data_only, .. } => self.handle_flush(fid, data_only, mode),
        }
    }

    /// FLUSH (§5.13): the Fid's file synced on the server, answered when
    /// storage is done (`FileSync`). It is in flight like an I/O: a CLOSE
    /// waits for it, a CANCEL may withdraw it before it starts.
    fn handle_flush(&mut self, fid: u16, data_only: bool, mode: CompletionMode) {
        let file = match self.fids.get(&fid) {
            // Not offered: refused as an unknown request would be.
            _ if !self.cfg.flush => {
                return self.complete(mode, 0, STATUS_INVALID_DEVICE_REQUEST, false)
            }
            Some(f) if !f.closing => f.file,
            _ => return self.complete(mode, 0, STATUS_INVALID_HANDLE, false),
        };
        let (opcode, started) = self.cur.unwrap_or((Opcode::Flush, self.now));
        let op = self.new_op(PendingIo {
            opcode,
            started,
            fid,
            kind: IoKind::Sync,
            mode,
            requested: 0,
        });
        self.actions.push_back(ServerAction::FileSync {
            op,
            fid,
            file,
            data_only,
        });
    }

    /// CANCEL (§5.9): ask for the cancellation of every outstanding I/O of
    /// `fid` (`target` None), or of the one sent with `target`'s completion
    /// fields (none if it has completed already). Answered at once.
    ///
    /// An I/O whose FileRead/FileWrite the embedder has not taken yet (the
    /// request and its CANCEL came in one batch) is withdrawn and completed
    /// with STATUS_CANCELLED here: neither the embedder's inline path nor
    /// its storage ever starts it. The others get a `CancelIo`.
    fn handle_cancel(
        &mut self,
        now: Instant,
        fid: u16,
        cookie: u64,
        target: Option<CancelTarget>,
        mode: CompletionMode,
    ) {
        if !self.fid_valid(fid) {
            return self.complete(mode, 0, STATUS_INVALID_HANDLE, false);
        }
        let mut ops: Vec<OpId> = self
            .ops
            .iter()
            .filter(|(_, p)| p.fid == fid && target.is_none_or(|t| t.matches(&p.mode)))
            .map(|(o, _)| *o)
            .collect();
        ops.sort_unstable();
        for op in ops {
            let queued = self.actions.iter().position(|a| match a {
                ServerAction::FileRead { op: o, .. }
                | ServerAction::FileWrite { op: o, .. }
                | ServerAction::FileSync { op: o, .. }
                | ServerAction::FileWriteParts { op: o, .. } => *o == op,
                _ => false,
            });
            match queued {
                Some(i) => {
                    if let Some(ServerAction::FileWriteParts { parts, .. }) = self.actions.remove(i)
                    {
                        self.actions.push_back(ServerAction::RepostRecvs(
                            parts.into_iter().map(|(b, _)| b).collect(),
                        ));
                    }
                    self.handle_storage_complete(now, op, Err(STATUS_CANCELLED));
                }
                None => self.actions.push_back(ServerAction::CancelIo { op }),
            }
        }
        self.send_status(cookie, 0, STATUS_SUCCESS);
        self.outstanding = self.outstanding.saturating_sub(1);
    }

    fn payload_ok(&self, len: usize) -> bool {
        u32::try_from(len).is_ok_and(|l| l <= self.cfg.max_recv_buffer_size)
    }

    fn fid_valid(&self, fid: u16) -> bool {
        self.fids.get(&fid).is_some_and(|f| !f.closing)
    }

    fn handle_auth(
        &mut self,
        cookie: u64,
        data_va: u64,
        data_mh: u32,
        params: &[u8],
        hooks: &mut dyn ServerHooks,
    ) {
        match self.verify_auth(params, hooks) {
            Ok((client, alg, secret)) => {
                let granted = client.credits.clamp(1, self.cfg.max_credits.clamp(1, 255));
                let mine = AuthParamsRepr {
                    rev_id: LWIO_REV_ID,
                    endian: ENDIAN_64,
                    page_size: self.cfg.page_size,
                    base_sequence: client.base_sequence.wrapping_add(1),
                    max_rdma_window_size: self.cfg.max_rdma_window_size,
                    max_send_buffer_size: self.cfg.max_send_buffer_size,
                    max_recv_buffer_size: self.cfg.max_recv_buffer_size,
                    header_size: COMMON_HEADER_LEN as u16,
                    credits: granted,
                    // Seed 000: 1 if the server supports RDMA Read. It
                    // issues RDMA Reads to publishers of memory objects
                    // (a WRITE's data still comes in its request message,
                    // so a client that does not support them is served).
                    rdma_read_supported: 1,
                    // lwio extensions it serves (§5.13).
                    features: if self.cfg.flush { FEATURE_FLUSH } else { 0 },
                    key: client.key,
                    session_id: Some(self.cfg.session_id),
                    signature: None,
                    max_message: self.cfg.max_message,
                };
                let bytes = match mine.to_signed_bytes(alg, &secret) {
                    Ok(b) => b,
                    Err(_) => return self.close(CloseReason::AuthFailed),
                };
                let info = (bytes.len() + 8) as u32;
                self.actions.push_back(ServerAction::RdmaWrite {
                    remote_addr: data_va,
                    rkey: data_mh,
                    data: DataSource::Inline(bytes),
                    imm: None,
                });
                self.send_status(cookie, info, STATUS_SUCCESS);
                self.outstanding = 0;
                self.credits = granted;
                self.client = Some(client);
                self.state = State::Ready;
            }
            Err(()) => {
                self.send_status(cookie, 0, STATUS_ACCESS_DENIED);
                self.close(CloseReason::AuthFailed);
            }
        }
    }

    fn verify_auth(
        &self,
        params: &[u8],
        hooks: &mut dyn ServerHooks,
    ) -> Result<(AuthParamsRepr, SignatureAlg, Vec<u8>), ()> {
        let p = AuthParamsPacket::new_checked(params).map_err(|_| ())?;
        if p.total_len() != Ok(params.len()) {
            return Err(());
        }
        let client = AuthParamsRepr::parse(&p).map_err(|_| ())?;
        if client.rev_id != LWIO_REV_ID
            || usize::from(client.header_size) != COMMON_HEADER_LEN
            || !client.page_size.is_power_of_two()
        {
            return Err(());
        }
        let key = client.key.ok_or(())?;
        let secret = hooks.session_secret(&key).ok_or(())?;
        let (_, alg) = AuthParamsRepr::verify(params, &secret).map_err(|_| ())?;
        if alg == SignatureAlg::Md5 && !self.cfg.allow_md5 {
            return Err(());
        }
        if !hooks.auth_verified(&key) {
            return Err(());
        }
        Ok((client, alg, secret))
    }

    fn handle_register(&mut self, cookie: u64, p: FidParamsRepr, hooks: &mut dyn ServerHooks) {
        let mode = CompletionMode::Interrupt {
            cookie,
            immediate_cookie: 0,
        };
        if p.session_id != self.cfg.session_id {
            return self.complete(mode, 0, STATUS_ACCESS_DENIED, false);
        }
        if self.fids.len() >= self.cfg.max_fids || self.fids.len() >= usize::from(u16::MAX) {
            return self.complete(mode, 0, STATUS_INSUFFICIENT_RESOURCES, false);
        }
        match hooks.open_file(&p.resume_key, p.flags_and_attributes) {
            Ok(file) => {
                let mut fid = self.next_fid;
                while fid == 0 || self.fids.contains_key(&fid) {
                    fid = fid.wrapping_add(1);
                }
                self.next_fid = fid.wrapping_add(1);
                self.fids.insert(
                    fid,
                    FileEntry {
                        file,
                        flags: p.flags_and_attributes,
                        closing: false,
                        inflight: 0,
                    },
                );
                self.complete(mode, u32::from(fid), STATUS_SUCCESS, false);
            }
            Err(st) => {
                let st = if st == STATUS_SUCCESS {
                    STATUS_ACCESS_DENIED
                } else {
                    st
                };
                self.complete(mode, 0, st, false)
            }
        }
    }

    fn handle_close(&mut self, fid: u16, cookie: u64) {
        let mode = CompletionMode::Interrupt {
            cookie,
            immediate_cookie: 0,
        };
        match self.fids.get_mut(&fid) {
            Some(f) if !f.closing => {
                f.closing = true;
                self.maybe_finish_close(fid);
                self.complete(mode, 0, STATUS_SUCCESS, false);
            }
            _ => self.complete(mode, 0, STATUS_INVALID_HANDLE, false),
        }
    }

    fn maybe_finish_close(&mut self, fid: u16) {
        if let Some(f) = self.fids.get(&fid) {
            if f.closing && f.inflight == 0 {
                let file = f.file;
                self.fids.remove(&fid);
                self.actions
                    .push_back(ServerAction::CloseFile { fid, file });
            }
        }
    }

    fn handle_credit(&mut self, cookie: u64, value: i32) {
        let mode = CompletionMode::Interrupt {
            cookie,
            immediate_cookie: 0,
        };
        match self.credit_tx {
            None => self.close(CloseReason::ProtocolViolation("CREDIT without transaction")),
            Some(CreditTx::Positive { n, .. }) => {
                if !(0..=n).contains(&value) {
                    return self.close(CloseReason::ProtocolViolation("bad CREDIT value"));
                }
                self.unused_credits_reported = value as u32;
                self.credit_tx = None;
                self.complete(mode, 0, STATUS_SUCCESS, false);
            }
            Some(CreditTx::Negative { expect, deadline }) => {
                if value != expect {
                    return self.close(CloseReason::ProtocolViolation("CREDIT out of order"));
                }
                self.credits = self.credits.saturating_sub(1).max(1);
                self.credit_tx = if expect == -1 {
                    None
                } else {
                    Some(CreditTx::Negative {
                        expect: expect + 1,
                        deadline,
                    })
                };
                self.complete(mode, 0, LWIO_NOTIFY_CREDIT, false);
            }
        }
    }

    /// Common I/O validation: Fid and offset overflow.
    fn check_io(&self, fid: u16, offset: u64, length: u32) -> Result<u64, NtStatus> {
        let f = match self.fids.get(&fid) {
            Some(f) if !f.closing => f,
            _ => return Err(STATUS_INVALID_HANDLE),
        };
        if offset.checked_add(u64::from(length)).is_none() {
            return Err(STATUS_INVALID_PARAMETER);
        }
        Ok(f.file)
    }

    fn new_op(&mut self, p: PendingIo) -> OpId {
        let op = self.next_op;
        self.next_op = self.next_op.wrapping_add(1).max(1);
        if let Some(f) = self.fids.get_mut(&p.fid) {
            f.inflight += 1;
        }
        self.ops.insert(op, p);
        op
    }

    fn start_read(
        &mut self,
        fid: u16,
        offset: u64,
        length: u32,
        kind: IoKind,
        mode: CompletionMode,
    ) {
        let file = match self.check_io(fid, offset, length) {
            Ok(f) => f,
            Err(st) => return self.complete_io(mode, 0, st, false),
        };
        if length > self.cfg.max_rdma_window_size {
            // Longer than a read buffer: in pieces, when the client may
            // ask for it (the server announced MAX_MESSAGE).
            return match kind {
                IoKind::Read { data_va, data_mh } if length <= self.cfg.max_message => {
                    let (opcode, started) = self.cur.unwrap_or((Opcode::Read, self.now));
                    self.start_big_read(BigRead {
                        fid,
                        file,
                        offset,
                        length,
                        data_va,
                        data_mh,
                        mode,
                        opcode,
                        started,
                        next: 0,
                        inflight: 0,
                        results: BTreeMap::new(),
                        stopped: false,
                    })
                }
                _ => self.complete_io(mode, 0, STATUS_INVALID_PARAMETER, false),
            };
        }
        if length == 0 {
            return self.complete_io(mode, 0, STATUS_SUCCESS, false);
        }
        let (opcode, started) = self.cur.unwrap_or((Opcode::Read, self.now));
        let op = self.new_op(PendingIo {
            opcode,
            started,
            fid,
            kind,
            mode,
            requested: length,
        });
        self.actions.push_back(ServerAction::FileRead {
            op,
            fid,
            file,
            offset,
            len: length,
        });
    }

    fn start_big_read(&mut self, b: BigRead) {
        let id = self.next_big;
        self.next_big = self.next_big.wrapping_add(1).max(1);
        self.big_reads.insert(id, b);
        self.read_pieces(id);
    }

    /// Start pieces of big read `id` while fewer than
    /// [`READ_PIECES_IN_FLIGHT`] are at storage.
    fn read_pieces(&mut self, id: u64) {
        let window = self.cfg.max_rdma_window_size.max(1);
        loop {
            let Some(b) = self.big_reads.get_mut(&id) else {
                return;
            };
            if b.stopped || b.inflight >= READ_PIECES_IN_FLIGHT || b.next >= b.length {
                return;
            }
            let at = b.next;
            let len = window.min(b.length - at);
            b.next += len;
            b.inflight += 1;
            let (fid, file, offset, mode) = (b.fid, b.file, b.offset + u64::from(at), b.mode);
            let (opcode, started) = (b.opcode, b.started);
            let op = self.new_op(PendingIo {
                opcode,
                started,
                fid,
                kind: IoKind::ReadPiece { parent: id, at },
                mode,
                requested: len,
            });
            self.actions.push_back(ServerAction::FileRead {
                op,
                fid,
                file,
                offset,
                len,
            });
        }
    }

    /// A piece of big read `id` came back: its bytes go to the client's
    /// window now; the status goes when the last piece is back (the bytes
    /// read from the start up to the first short or failed piece).
    fn read_piece_done(
        &mut self,
        op: OpId,
        id: u64,
        at: u32,
        asked: u32,
        r: Result<u32, NtStatus>,
    ) {
        let Some(b) = self.big_reads.get_mut(&id) else {
            return;
        };
        b.inflight = b.inflight.saturating_sub(1);
        let r = read_result(r, asked);
        if let Ok(n) = r {
            self.actions.push_back(ServerAction::RdmaWrite {
                remote_addr: b.data_va.wrapping_add(u64::from(at)),
                rkey: b.data_mh,
                data: DataSource::ReadBuffer {
                    op,
                    offset: 0,
                    len: n,
                },
                imm: None,
            });
        }
        if r != Ok(asked) {
            b.stopped = true;
        }
        b.results.insert(at, (asked, r));
        if b.inflight > 0 || (!b.stopped && b.next < b.length) {
            return self.read_pieces(id);
        }
        let Some(b) = self.big_reads.remove(&id) else {
            return;
        };
        let (mut total, mut status) = (0u32, STATUS_SUCCESS);
        for (at, (asked, r)) in &b.results {
            if *at != total {
                break;
            }
            match r {
                Ok(n) => {
                    total += n;
                    if n < asked {
                        break;
                    }
                }
                Err(st) => {
                    if total == 0 {
                        status = *st;
                    }
                    break;
                }
            }
        }
        self.complete_io(b.mode, total, status, false);
    }

    fn handle_vec_read(
        &mut self,
        fid: u16,
        offset: u64,
        length: u32,
        page_size: u16,
        regions: Vec<RdmaRegion>,
        mode: CompletionMode,
    ) {
        let max_regions = (self.cfg.max_recv_buffer_size / 16) as usize;
        if regions.len() > max_regions {
            return self.close(CloseReason::PayloadTooLarge);
        }
        if let Err(st) = self.check_vec_read(length, page_size, &regions) {
            return self.complete_io(mode, 0, st, false);
        }
        self.start_read(fid, offset, length, IoKind::VecRead { regions }, mode)
    }

    fn check_vec_read(
        &self,
        length: u32,
        page_size: u16,
        regions: &[RdmaRegion],
    ) -> Result<(), NtStatus> {
        let ps = u32::from(page_size);
        if ps == 0 {
            return Err(STATUS_INVALID_PARAMETER);
        }
        let want_pages = length.div_ceil(ps) as usize;
        if regions.len() != want_pages || regions.is_empty() {
            return Err(STATUS_INVALID_PARAMETER);
        }
        let (last, mids) = regions.split_last().ok_or(STATUS_INVALID_PARAMETER)?;
        if mids.iter().any(|r| r.length != ps) {
            return Err(STATUS_INVALID_PARAMETER);
        }
        let sector = self.cfg.sector_size.max(1);
        if last.length == 0 || last.length > ps || last.length % sector != 0 {
            return Err(STATUS_INVALID_PARAMETER);
        }
        let total = u64::from(ps) * mids.len() as u64 + u64::from(last.length);
        if total != u64::from(length) {
            return Err(STATUS_INVALID_PARAMETER);
        }
        Ok(())
    }

    fn expand_collapsed(
        &self,
        fid: u16,
        length: u32,
        num_pages: u16,
        page_size: u16,
        page: &[u8],
    ) -> Result<Vec<u8>, NtStatus> {
        let f = match self.fids.get(&fid) {
            Some(f) if !f.closing => f,
            _ => return Err(STATUS_INVALID_HANDLE),
        };
        if f.flags & FILE_NO_INTERMEDIATE_BUFFERING == 0 {
            return Err(STATUS_INVALID_PARAMETER);
        }
        let client_ps = self.client.as_ref().map_or(0, |c| c.page_size);
        let (a, b) = (u32::from(client_ps), u32::from(self.cfg.page_size));
        if a == 0 || b == 0 || (a.max(b) % a.min(b)) != 0 {
            return Err(STATUS_INVALID_PARAMETER);
        }
        let ps = u32::from(page_size);
        if ps == 0 || u32::from(num_pages) != length.div_ceil(ps) || length == 0 {
            return Err(STATUS_INVALID_PARAMETER);
        }
        // A window's worth, or (an lwio extension negotiated with
        // MAX_MESSAGE, docs/protocol.md §5.12) up to MAX_MESSAGE.
        if length > self.cfg.max_rdma_window_size.max(self.cfg.max_message) {
            return Err(STATUS_INVALID_PARAMETER);
        }
        let mut out = Vec::with_capacity(length as usize);
        while out.len() < length as usize {
            let take = page.len().min(length as usize - out.len());
            if take == 0 {
                return Err(STATUS_INVALID_PARAMETER);
            }
            out.extend_from_slice(&page[..take]);
        }
        Ok(out)
    }

    /// A write whose data is the request's own bytes, `data`, the tail of
    /// `msg` (a WRITE's payload, or a VEC_WRITE's without COLLAPSE): lent
    /// from receive buffer `buf` to a one-part `FileWriteParts` (`Kept`),
    /// or — without a buffer (`RecvId::MAX`, [`ServerConn::handle_recv`])
    /// — copied into a `FileWrite`. A write answered at once (refused, or
    /// empty) keeps nothing.
    fn write_in_place(
        &mut self,
        fid: u16,
        offset: u64,
        buf: RecvId,
        msg: &[u8],
        data: &[u8],
        mode: CompletionMode,
    ) -> RecvBuffer {
        if buf == RecvId::MAX {
            self.start_write(fid, offset, data.to_vec(), mode);
            return RecvBuffer::Repost;
        }
        let range = msg.len().saturating_sub(data.len())..msg.len();
        debug_assert!(std::ptr::eq(&msg[range.clone()], data));
        let Some((op, file)) = self.new_write(fid, offset, data.len(), mode) else {
            return RecvBuffer::Repost;
        };
        self.actions.push_back(ServerAction::FileWriteParts {
            op,
            fid,
            file,
            offset,
            parts: vec![(buf, range)],
        });
        RecvBuffer::Kept
    }

    /// A FileWrite of `data`; its op, unless it was answered at once.
    fn start_write(
        &mut self,
        fid: u16,
        offset: u64,
        data: Vec<u8>,
        mode: CompletionMode,
    ) -> Option<OpId> {
        let (op, file) = self.new_write(fid, offset, data.len(), mode)?;
        self.actions.push_back(ServerAction::FileWrite {
            op,
            fid,
            file,
            offset,
            data,
        });
        Some(op)
    }

    /// The op of a write of `len` bytes and its file, unless it was
    /// answered at once: refused (`check_io`), or empty.
    fn new_write(
        &mut self,
        fid: u16,
        offset: u64,
        len: usize,
        mode: CompletionMode,
    ) -> Option<(OpId, u64)> {
        // (At most a message's size, or MAX_MESSAGE for a COLLAPSE
        // expansion: within u32.)
        let len = u32::try_from(len).unwrap_or(u32::MAX);
        let file = match self.check_io(fid, offset, len) {
            Ok(f) => f,
            Err(st) => {
                self.complete_io(mode, 0, st, false);
                return None;
            }
        };
        if len == 0 {
            self.complete_io(mode, 0, STATUS_SUCCESS, false);
            return None;
        }
        let (opcode, started) = self.cur.unwrap_or((Opcode::Read, self.now));
        let op = self.new_op(PendingIo {
            opcode,
            started,
            fid,
            kind: IoKind::Write,
            mode,
            requested: len,
        });
        Some((op, file))
    }

    /// A storage operation finished: `Ok(bytes transferred)` or the failure
    /// status (STATUS_CANCELLED for a cancelled operation). Unknown ops are
    /// ignored.
    pub fn handle_storage_complete(
        &mut self,
        now: Instant,
        op: OpId,
        result: Result<u32, NtStatus>,
    ) {
        let Some(p) = self.ops.remove(&op) else {
            return;
        };
        self.reservations.remove(&op);
        if self.state == State::Closed {
            // After CloseConnection nothing is produced; the embedder
            // releases every buffer and file of the connection itself.
            return;
        }
        // (Also called while a CANCEL is handled: its request comes back.)
        let outer = (self.cur.replace((p.opcode, p.started)), self.now);
        self.now = self.now.max(now);
        self.storage_complete(op, p, result);
        (self.cur, self.now) = outer;
    }

    fn storage_complete(&mut self, op: OpId, p: PendingIo, result: Result<u32, NtStatus>) {
        if let Some(f) = self.fids.get_mut(&p.fid) {
            f.inflight = f.inflight.saturating_sub(1);
        }
        let is_read = matches!(
            p.kind,
            IoKind::Read { .. } | IoKind::VecRead { .. } | IoKind::ReadPiece { .. }
        );
        {
            match p.kind {
                IoKind::ReadPiece { parent, at } => {
                    self.read_piece_done(op, parent, at, p.requested, result)
                }
                IoKind::WriteParts { extra } => {
                    match result {
                        Ok(n) => {
                            self.complete_io(p.mode, n.min(p.requested), STATUS_SUCCESS, false)
                        }
                        Err(st) => self.complete_io(p.mode, 0, normalize(st), false),
                    }
                    self.outstanding = self.outstanding.saturating_sub(extra);
                }
                IoKind::Sync => match result {
                    Ok(_) => self.complete(p.mode, 0, STATUS_SUCCESS, false),
                    Err(st) => self.complete(p.mode, 0, normalize(st), false),
                },
                IoKind::Write => match result {
                    Ok(n) => self.complete_io(p.mode, n.min(p.requested), STATUS_SUCCESS, false),
                    Err(st) => self.complete_io(p.mode, 0, normalize(st), false),
                },
                IoKind::Read { data_va, data_mh } => match read_result(result, p.requested) {
                    Ok(n) => {
                        let imm = self.imm_for(&p.mode, n, p.requested);
                        self.actions.push_back(ServerAction::RdmaWrite {
                            remote_addr: data_va,
                            rkey: data_mh,
                            data: DataSource::ReadBuffer {
                                op,
                                offset: 0,
                                len: n,
                            },
                            imm,
                        });
                        self.complete_io(p.mode, n, STATUS_SUCCESS, imm.is_some());
                    }
                    Err(st) => self.complete_io(p.mode, 0, st, false),
                },
                IoKind::VecRead { ref regions } => match read_result(result, p.requested) {
                    Ok(n) => {
                        let imm = self.imm_for(&p.mode, n, p.requested);
                        let mut off = 0u32;
                        let mut writes = Vec::new();
                        for r in regions {
                            if off >= n {
                                break;
                            }
                            let len = r.length.min(n - off);
                            writes.push((r.data_va, r.data_mh, off, len));
                            off += len;
                        }
                        let last = writes.len().saturating_sub(1);
                        for (i, (va, mh, o, len)) in writes.into_iter().enumerate() {
                            self.actions.push_back(ServerAction::RdmaWrite {
                                remote_addr: va,
                                rkey: mh,
                                data: DataSource::ReadBuffer { op, offset: o, len },
                                imm: if i == last { imm } else { None },
                            });
                        }
                        self.complete_io(p.mode, n, STATUS_SUCCESS, imm.is_some());
                    }
                    Err(st) => self.complete_io(p.mode, 0, st, false),
                },
            }
        }
        if is_read {
            self.actions
                .push_back(ServerAction::ReleaseReadBuffer { op });
        }
        self.maybe_finish_close(p.fid);
    }

    fn imm_for(&self, mode: &CompletionMode, n: u32, requested: u32) -> Option<u32> {
        match *mode {
            CompletionMode::Interrupt {
                immediate_cookie, ..
            } if self.cfg.use_write_with_imm && n == requested && n > 0 => Some(immediate_cookie),
            _ => None,
        }
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
