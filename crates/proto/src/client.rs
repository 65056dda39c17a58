//! Sans-IO LWIO client state machine (one RDMA connection).
//!
//! The caller owns the transport and memory: it carries out
//! [`ClientAction`]s, feeds received messages (`handle_recv`), RDMA-write
//! with immediate completions (`handle_immediate`) and polled status block
//! changes (`status_block_updated`), and reads [`ClientEvent`]s.

use std::collections::{HashMap, HashSet, VecDeque};
use std::ops::Range;
use std::time::{Duration, Instant};

use crate::server::CloseReason;
use crate::status::*;
use crate::wire::auth::{ENDIAN_64, FEATURE_FLUSH, FEATURE_IMMEDIATE};
use crate::wire::common::{CancelTarget, CompletionMode, HeaderPacket, Opcode, RequestOp};
use crate::wire::fragment::{FragmentRepr, FRAGMENT_HEADER_LEN};
use crate::wire::{
    AuthParamsRepr, FidParamsRepr, Guid, RdmaRegion, RequestRepr, SignatureAlg, SrvResumeKey,
    StatusResponse, COMMON_HEADER_LEN, LWIO_REV_ID,
};

/// WRITE and VEC_WRITE, inline and fragmented (operations of any size).
mod writes;

/// Minimum size of the auth buffer; the server's AUTH_PARAMS must fit.
pub const AUTH_BUFFER_MIN: usize = 256;

/// Client-chosen request id: the Cookie in interrupt mode (never 0).
pub type ReqId = u64;

/// A remote-accessible buffer of the client (address + rkey).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteBuf {
    pub addr: u64,
    pub rkey: u32,
}

/// Registered memory holding `slots` 8-byte LWIO_IO_STATUS_BLOCKs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StatusBlockArea {
    pub base: u64,
    pub rkey: u32,
    pub slots: u32,
}

/// Completion mode requested for an I/O.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Interrupt,
    /// Polled, through the status area's own key (`StatusBlockArea::rkey`):
    /// one window over every status block, for the connection's life.
    Polled,
    /// Polled, through this key: a one-shot window the caller bound to
    /// exactly the 8 bytes of the slot [`ClientConn::next_status_slot`]
    /// names, and invalidates when the request completes. The server can
    /// then write that status block once, for this request only (seed 002:
    /// keys bound to byte ranges, one-shot). The slot is not used again
    /// until the caller says the window is gone
    /// ([`ClientConn::release_slot`]): until then the old key could still
    /// reach it, where the provider retires keys only by an invalidation
    /// that completes later (verbs devices).
    PolledWindow(u32),
}

/// A VEC_WRITE's arguments ([`ClientConn::vec_write_into`]). Without
/// `collapse`, `data` holds all `length` bytes; with `collapse`, `data` is
/// the single page repeated over ceil(length / page_size) pages.
#[derive(Debug, Clone, Copy)]
pub struct VecWrite<'d> {
    pub fid: u16,
    pub offset: u64,
    pub page_size: u16,
    pub length: u32,
    pub data: &'d [u8],
    pub collapse: bool,
}

/// Reads local (client) memory; used to fetch the server's AUTH params
/// that the server RDMA-wrote into the auth buffer.
pub trait LocalMemory {
    fn read(&self, addr: u64, len: usize) -> Option<Vec<u8>>;
}

/// Client configuration.
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// Key from the negotiate response.
    pub key: Guid,
    /// Per-session secret bound to `key` (unused for MD5).
    pub secret: Vec<u8>,
    pub signature: SignatureAlg,
    pub page_size: u16,
    pub credits_wanted: u16,
    /// The most credits this client can use at once (its deepest queue).
    /// Of a positive delta, the new credits beyond what it needs now (its
    /// pending requests and the reserved credit, at least
    /// `credits_wanted`, at most this) are reported unused in the CREDIT
    /// reply (seed 000: the upper 32 bits of its Offset), so that the
    /// server takes them back.
    pub max_credits: u16,
    pub max_rdma_window_size: u32,
    pub max_send_buffer_size: u32,
    pub max_recv_buffer_size: u32,
    pub base_sequence: u16,
    /// Where the server writes its AUTH params (≥ 256 bytes).
    pub auth_buffer: RemoteBuf,
    /// Status blocks for polling mode (None: polling unavailable).
    pub status_blocks: Option<StatusBlockArea>,
    /// Tid stamped on requests.
    pub tid: u32,
    /// Receives the caller posted before the connection was established
    /// (on iWARP a Send that finds no posted receive is fatal): the
    /// connection counts them as posted and asks only for the rest.
    pub recvs_preposted: u32,
    /// A request unanswered this long after it was issued times out
    /// ([`ClientEvent::TimedOut`]; it stays outstanding, holding its credit
    /// and buffers, until the server answers). Not an INTERRUPT, which is
    /// answered only after the next I/O completion. A CREDIT reply unanswered
    /// this long closes the connection (`CloseReason::CreditTimeout`): the
    /// credit it holds would never come back. None: no timeouts.
    pub op_timeout: Option<Duration>,
    /// Send writes larger than the server's receive buffer as one
    /// fragmented message (docs/protocol.md §5.12) when the server
    /// announces MAX_MESSAGE.
    pub fragments: bool,
    /// This client's device receives RDMA Writes with Immediate: say so
    /// in AUTH (FEATURES bit 1, docs/protocol.md §5.2), and a server whose
    /// device sends them completes full interrupt-mode reads with one.
    pub accepts_immediate: bool,
}

impl ClientConfig {
    pub fn new(key: Guid, secret: Vec<u8>, auth_buffer: RemoteBuf) -> Self {
        ClientConfig {
            key,
            secret,
            signature: SignatureAlg::HmacSha256,
            page_size: 4096,
            credits_wanted: 8,
            max_credits: 255,
            max_rdma_window_size: 64 * 1024,
            max_send_buffer_size: 8 * 1024,
            max_recv_buffer_size: 16,
            base_sequence: 0,
            auth_buffer,
            status_blocks: None,
            tid: 0,
            recvs_preposted: 0,
            op_timeout: None,
            fragments: true,
            accepts_immediate: false,
        }
    }
}

/// Transport actions for the caller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClientAction {
    /// Post this many additional receive buffers (≥ 16 bytes each).
    PostRecv(u32),
    /// Write the sentinel (`wire::small::POLL_SENTINEL`) into status block `slot` at
    /// `addr` before the request that follows is sent.
    ResetStatusBlock { slot: u32, addr: u64 },
    /// Terminate the connection.
    CloseConnection(CloseReason),
}

/// Application events.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClientEvent {
    /// Authentication done; `server` are the verified server params.
    Authenticated {
        session_id: u64,
        credits: u16,
        server: AuthParamsRepr,
    },
    /// The server refused AUTH (status) — the connection is closed.
    AuthFailed { status: NtStatus },
    /// A request completed. For REGISTER, `information` is the Fid.
    Completed {
        req: ReqId,
        opcode: Opcode,
        information: u32,
        status: NtStatus,
    },
    /// The credit limit changed.
    CreditsChanged { credits: u16 },
    /// `req` was not answered within `ClientConfig::op_timeout`. It stays
    /// outstanding ([`ClientConn::is_timed_out`]); a late answer completes
    /// it as usual.
    TimedOut { req: ReqId, opcode: Opcode },
}

/// Errors of request-issuing calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientError {
    /// All credits are in use (or credit messages are waiting): retry after
    /// a completion.
    NoCredits,
    NotAuthenticated,
    Closed,
    /// Polling requested but no free status block / no area configured.
    NoStatusBlock,
    /// Arguments cannot be encoded or exceed negotiated limits.
    InvalidArgument,
    /// Encoding into the caller's buffer was asked while earlier request
    /// messages still wait for `poll_transmit` (they must leave first).
    TransmitPending,
    /// A fragmented message needs more fragments (each a credit) than the
    /// connection has credits: send less in one message.
    TooManyFragments {
        fragments: u32,
        credits: u16,
    },
}

/// A WRITE or VEC_WRITE sent as one fragmented message (docs/protocol.md
/// §5.12): the request's common header, then its data, cut into
/// fragments that the caller sends back to back, each as one Send of its
/// 16-byte fragment header followed by the bytes [`FragmentedWrite::pieces`]
/// names (from `head`, then from the caller's data: a second SGE, no copy).
#[derive(Debug, Clone)]
pub struct FragmentedWrite {
    pub issued: Issued,
    /// The message's first bytes: the request's common header.
    pub head: [u8; COMMON_HEADER_LEN],
    pub fragments: Vec<FragmentRepr>,
}

impl FragmentedWrite {
    /// Fragment `f`'s data: a range of `head`, then a range of the
    /// write's data.
    pub fn pieces(f: &FragmentRepr) -> (Range<usize>, Range<usize>) {
        let start = f.message_offset as usize;
        let end = start + f.data_length as usize;
        let h = start.min(COMMON_HEADER_LEN)..end.min(COMMON_HEADER_LEN);
        let d = start.saturating_sub(COMMON_HEADER_LEN)..end.saturating_sub(COMMON_HEADER_LEN);
        (h, d)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Idle,
    AuthSent,
    Ready,
    Closed,
}

#[derive(Debug, Clone)]
struct Outstanding<U> {
    opcode: Opcode,
    slot: Option<u32>,
    imm: Option<u32>,
    /// Requested length (reported for immediate completions).
    length: u32,
    /// I/O: how a CANCEL names it (its completion fields).
    target: Option<CancelTarget>,
    /// Credits held beyond the request's own (a fragmented message: one
    /// per fragment after the first, until its status).
    extra_credits: u32,
    /// The caller's data for this request ([`ClientConn::user_mut`]).
    user: U,
    /// When it times out (None: no timeout, or it timed out already).
    deadline: Option<Instant>,
    timed_out: bool,
}

/// An issued request: its id and, when it completes through a polled status
/// block, that block's slot (read under the same call that issued it, so
/// no other completion or issue can have changed it in between).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Issued {
    pub req: ReqId,
    pub slot: Option<u32>,
}

/// A completed request, kept by the connection until the caller takes it
/// ([`ClientConn::take_done`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Done<U> {
    pub opcode: Opcode,
    pub information: u32,
    pub status: NtStatus,
    /// The caller's data for the request.
    pub user: U,
}

/// The LWIO client connection state machine. `U` is the caller's data per
/// request (buffers, windows…): created with `U::default()` when the
/// request is issued, reachable through [`ClientConn::user_mut`] while it is
/// outstanding and once it completed, and handed back by
/// [`ClientConn::take_done`]. The connection holds each request once.
#[derive(Debug)]
pub struct ClientConn<U = ()> {
    cfg: ClientConfig,
    state: State,
    server: Option<AuthParamsRepr>,
    session_id: u64,
    credits: u16,
    recv_posted: u32,
    next_cookie: u64,
    sequence: u16,
    reqs: HashMap<ReqId, Outstanding<U>>,
    /// Sum of the outstanding requests' `extra_credits`.
    extra_held: usize,
    /// Completed requests not yet taken by the caller.
    done: HashMap<ReqId, Done<U>>,
    by_imm: HashMap<u32, ReqId>,
    by_slot: HashMap<u32, ReqId>,
    free_slots: Vec<u32>,
    /// Slots of outstanding [`Mode::PolledWindow`] requests.
    windowed: HashSet<u32>,
    /// Slots whose request completed but whose window the caller has not
    /// released yet ([`ClientConn::release_slot`]).
    fenced: HashSet<u32>,
    pending_credit_msgs: VecDeque<i32>,
    credit_tx: bool,
    /// Requests the caller has waiting for a credit
    /// ([`ClientConn::set_waiting`]).
    waiting: usize,
    /// The most requests pending (held + waiting) since the last request
    /// was stamped: a backlog that cleared only because a credit came back
    /// is still reported in the next hint.
    peak_pending: usize,
    /// The Credits hint of the last request stamped.
    last_hint: u8,
    /// Outstanding INTERRUPT, CANCEL and CREDIT messages.
    control_out: usize,
    /// The highest hint stamped since the last credit delta, and between
    /// the two before (requests stamped just before a delta arrived reach
    /// the server's next look).
    peak_hint_sent: [u8; 2],
    auth_cookie: u64,
    actions: VecDeque<ClientAction>,
    /// Request messages to send, in order ([`ClientConn::poll_transmit`]).
    transmit: VecDeque<Transmit>,
    events: VecDeque<ClientEvent>,
}

/// A request message waiting to be sent.
#[derive(Debug)]
enum Transmit {
    /// Encoded into the send buffer by `poll_transmit`.
    Request(RequestRepr<'static>),
    /// Encoded at issue (AUTH, and payload the caller only lent).
    Bytes(Vec<u8>),
}

impl<U: Default> ClientConn<U> {
    pub fn new(cfg: ClientConfig) -> Self {
        let free_slots = cfg
            .status_blocks
            .map_or(Vec::new(), |a| (0..a.slots).rev().collect());
        let recv_posted = cfg.recvs_preposted;
        ClientConn {
            sequence: cfg.base_sequence,
            cfg,
            state: State::Idle,
            server: None,
            session_id: 0,
            credits: 1,
            recv_posted,
            next_cookie: 1,
            reqs: HashMap::new(),
            extra_held: 0,
            done: HashMap::new(),
            by_imm: HashMap::new(),
            by_slot: HashMap::new(),
            free_slots,
            windowed: HashSet::new(),
            fenced: HashSet::new(),
            pending_credit_msgs: VecDeque::new(),
            credit_tx: false,
            waiting: 0,
            peak_pending: 0,
            last_hint: 0,
            control_out: 0,
            peak_hint_sent: [0; 2],
            auth_cookie: 0,
            actions: VecDeque::new(),
            transmit: VecDeque::new(),
            events: VecDeque::new(),
        }
    }

    pub fn poll_action(&mut self) -> Option<ClientAction> {
        self.actions.pop_front()
    }
    pub fn poll_event(&mut self) -> Option<ClientEvent> {
        self.events.pop_front()
    }
    pub fn is_authenticated(&self) -> bool {
        self.state == State::Ready
    }
    pub fn is_closed(&self) -> bool {
        self.state == State::Closed
    }
    pub fn session_id(&self) -> u64 {
        self.session_id
    }
    pub fn credits(&self) -> u16 {
        self.credits
    }
    pub fn outstanding(&self) -> usize {
        self.reqs.len()
    }
    /// Credits in use: one per outstanding request, plus one per extra
    /// fragment of each outstanding fragmented message.
    pub fn credits_held(&self) -> usize {
        self.reqs.len() + self.extra_held
    }
    /// Tell the connection how many requests the caller has waiting for a
    /// credit (threads blocked in an issue, queued futures). They count in
    /// the Credits hint of the requests that follow: seed 000, "Credits is
    /// set to the number of pending I/O requests on the client ... a hint
    /// to the server to allocate more credits".
    pub fn set_waiting(&mut self, n: usize) {
        self.waiting = n;
        self.peak_pending = self.peak_pending.max(self.pending());
    }
    /// Requests waiting for a credit ([`ClientConn::set_waiting`]).
    pub fn waiting(&self) -> usize {
        self.waiting
    }
    /// I/O requests pending on the client: the credits held by outstanding
    /// requests plus the requests waiting for one. INTERRUPT, CANCEL and
    /// CREDIT are not counted: they are not I/O, and the one credit they
    /// need at a time is the one a server adds to the hint.
    pub fn pending(&self) -> usize {
        self.credits_held().saturating_sub(self.control_out) + self.waiting
    }
    /// The Credits hint of the last request stamped.
    pub fn last_hint(&self) -> u8 {
        self.last_hint
    }
    /// The credits this client can use now: two per pending request (see
    /// below) and the one kept back for INTERRUPT and CANCEL, at least what it asked
    /// for at AUTH, at most `max_credits`. The pending requests are the
    /// most of the hints sent since the delta before the last one (the
    /// server grants toward the highest it saw), of those pending since
    /// the last hint, and of those pending now. A positive delta's new
    /// credits beyond it are reported unused.
    fn credits_needed(&self) -> i64 {
        let pending = usize::from(self.peak_hint_sent[0].max(self.peak_hint_sent[1]))
            .max(self.peak_pending)
            .max(self.pending());
        // Twice the pending requests (+ the reserved one): headroom for a
        // queue that refills before its completions are counted back (at
        // exactly pending + 1 a QD 8 job lost 3-10 % of its IOPS and its
        // p99 grew, in bench/scale.sh on a quiet machine).
        let need = (2 * pending as i64 + 1).max(i64::from(self.cfg.credits_wanted));
        need.min(i64::from(self.cfg.max_credits.max(1)))
    }
    /// Receives currently posted (target: credits + 1).
    pub fn posted_recvs(&self) -> u32 {
        self.recv_posted
    }
    pub fn server_params(&self) -> Option<&AuthParamsRepr> {
        self.server.as_ref()
    }
    /// True if an I/O request (or REGISTER, CLOSE) can be issued now. With
    /// two credits or more, one is kept back for INTERRUPT and CANCEL
    /// ([`ClientConn::can_interrupt`]): a polled waiter at full queue depth
    /// can still ask to be woken, and a stuck request still be cancelled
    /// (seed 000; docs/protocol.md, "The reserved credit").
    pub fn can_issue(&self) -> bool {
        if !self.can_interrupt() {
            return false;
        }
        let reserve = self.reserved_credits();
        self.credits_held() < usize::from(self.credits) - reserve || self.control_held() >= reserve
    }

    /// True if an INTERRUPT or a CANCEL can be issued now: they may take the
    /// credit [`ClientConn::can_issue`] keeps back.
    pub fn can_interrupt(&self) -> bool {
        self.state == State::Ready
            && self.pending_credit_msgs.is_empty()
            && self.credits_held() < usize::from(self.credits)
    }

    /// Credits kept back for INTERRUPT and CANCEL: one when there are two
    /// or more.
    fn reserved_credits(&self) -> usize {
        usize::from(self.credits >= 2)
    }

    /// Outstanding INTERRUPTs and CANCELs (asked only at saturation).
    fn control_held(&self) -> usize {
        self.reqs
            .values()
            .filter(|r| matches!(r.opcode, Opcode::Interrupt | Opcode::Cancel))
            .count()
    }
    /// Slots of outstanding polled requests (the caller polls these).
    pub fn polled_slots(&self) -> Vec<u32> {
        let mut v: Vec<u32> = self.by_slot.keys().copied().collect();
        v.sort_unstable();
        v
    }
    /// How many outstanding requests complete by a status block write
    /// (what [`ClientConn::polled_slots`] lists), without listing them.
    pub fn polled_outstanding(&self) -> usize {
        self.by_slot.len()
    }
    /// The status block slot of an outstanding polled request (None once it
    /// completed, or when it completes by interrupt).
    pub fn slot_of(&self, req: ReqId) -> Option<u32> {
        self.reqs.get(&req).and_then(|o| o.slot)
    }
    /// The caller's data of `req`, outstanding or completed and not taken.
    pub fn user_mut(&mut self, req: ReqId) -> Option<&mut U> {
        match self.reqs.get_mut(&req) {
            Some(o) => Some(&mut o.user),
            None => self.done.get_mut(&req).map(|d| &mut d.user),
        }
    }
    /// The caller's data of every outstanding request.
    pub fn outstanding_users(&self) -> impl Iterator<Item = &U> + '_ {
        self.reqs.values().map(|o| &o.user)
    }
    /// Whether `req` completed and waits to be taken.
    pub fn is_done(&self, req: ReqId) -> bool {
        self.done.contains_key(&req)
    }
    /// Take the completion of `req` (None while it is outstanding, or when
    /// it is unknown or already taken).
    pub fn take_done(&mut self, req: ReqId) -> Option<Done<U>> {
        self.done.remove(&req)
    }
    /// The outstanding INTERRUPT, if any (one at a time).
    pub fn interrupt_outstanding(&self) -> Option<ReqId> {
        self.reqs
            .iter()
            .find_map(|(&r, o)| (o.opcode == Opcode::Interrupt).then_some(r))
    }
    /// The status block slot (and its address) that the next polled request
    /// takes, for a caller that binds a window to it first
    /// ([`Mode::PolledWindow`]); None when every slot is in use.
    pub fn next_status_slot(&self) -> Option<(u32, u64)> {
        let slot = *self.free_slots.last()?;
        Some((slot, self.slot_addr(slot)?))
    }
    /// The window of a completed [`Mode::PolledWindow`] request's slot is
    /// gone (its invalidation completed): the slot may serve again. Other
    /// slots are ignored.
    pub fn release_slot(&mut self, slot: u32) {
        if self.fenced.remove(&slot) {
            self.free_slots.push(slot);
        }
    }
    /// Slots waiting for [`ClientConn::release_slot`].
    pub fn fenced_slots(&self) -> usize {
        self.fenced.len()
    }
    /// Address of a status block slot.
    pub fn slot_addr(&self, slot: u32) -> Option<u64> {
        let a = self.cfg.status_blocks?;
        if slot >= a.slots {
            return None;
        }
        a.base.checked_add(8 * u64::from(slot))
    }

    fn close(&mut self, reason: CloseReason) {
        if self.state != State::Closed {
            self.state = State::Closed;
            self.transmit.clear();
            self.actions
                .push_back(ClientAction::CloseConnection(reason));
        }
    }

    fn top_up_recvs(&mut self) {
        let target = u32::from(self.credits) + 1;
        if self.recv_posted < target && self.state != State::Closed {
            self.actions
                .push_back(ClientAction::PostRecv(target - self.recv_posted));
            self.recv_posted = target;
        }
    }

    fn alloc_cookie(&mut self) -> u64 {
        let mut c = self.next_cookie;
        while c == 0 || self.reqs.contains_key(&c) {
            c = c.wrapping_add(1);
        }
        self.next_cookie = c.wrapping_add(1);
        c
    }

    /// Send AUTH; posts the initial receives.
    pub fn start(&mut self, now: Instant) -> Result<ReqId, ClientError> {
        if self.state != State::Idle {
            return Err(ClientError::InvalidArgument);
        }
        let params = AuthParamsRepr {
            rev_id: LWIO_REV_ID,
            endian: ENDIAN_64,
            page_size: self.cfg.page_size,
            base_sequence: self.cfg.base_sequence,
            max_rdma_window_size: self.cfg.max_rdma_window_size,
            max_send_buffer_size: self.cfg.max_send_buffer_size,
            max_recv_buffer_size: self.cfg.max_recv_buffer_size,
            header_size: COMMON_HEADER_LEN as u16,
            credits: self.cfg.credits_wanted,
            rdma_read_supported: 0,
            key: Some(self.cfg.key),
            session_id: None,
            signature: None,
            // Servers send this client only 16-byte status responses.
            max_message: 0,
            features: if self.cfg.accepts_immediate {
                FEATURE_IMMEDIATE
            } else {
                0
            },
        };
        let bytes = params
            .to_signed_bytes(self.cfg.signature, &self.cfg.secret)
            .map_err(|_| ClientError::InvalidArgument)?;
        self.top_up_recvs();
        let cookie = self.alloc_cookie();
        self.auth_cookie = cookie;
        let op = RequestOp::Auth {
            cookie,
            data_va: self.cfg.auth_buffer.addr,
            data_mh: self.cfg.auth_buffer.rkey,
            params: &bytes,
        };
        self.state = State::AuthSent;
        self.emit_borrowed(now, op, cookie, Opcode::Auth, None, None, None)?;
        Ok(cookie)
    }

    /// The request message for `op`, stamped now (credits hint, sequence).
    /// The hint is the number of I/O requests pending on the client
    /// ([`ClientConn::pending`]), this one included unless it is an
    /// INTERRUPT, CANCEL or CREDIT: those holding credits and those waiting
    /// for one (the most there were since the previous request went out),
    /// at most 255.
    fn repr<'a>(&mut self, op: RequestOp<'a>) -> RequestRepr<'a> {
        let mut r = RequestRepr {
            credits: 0,
            sequence: self.sequence,
            tid: self.cfg.tid,
            op,
        };
        let own = usize::from(!is_control(r.opcode()));
        let pending = (self.pending() + own).max(self.peak_pending);
        self.peak_pending = 0;
        self.last_hint = u8::try_from(pending).unwrap_or(u8::MAX);
        self.peak_hint_sent[0] = self.peak_hint_sent[0].max(self.last_hint);
        r.credits = self.last_hint;
        r
    }

    /// Record an encoded (or encodable) request as outstanding.
    fn record(
        &mut self,
        now: Instant,
        r: &RequestRepr<'_>,
        cookie: ReqId,
        opcode: Opcode,
        slot: Option<u32>,
        imm: Option<u32>,
    ) {
        let target = opcode.is_io().then(|| CancelTarget::of(&r.mode()));
        self.sequence = self.sequence.wrapping_add(1);
        if let (Some(s), Some(addr)) = (slot, slot.and_then(|s| self.slot_addr(s))) {
            self.actions
                .push_back(ClientAction::ResetStatusBlock { slot: s, addr });
            self.by_slot.insert(s, cookie);
        }
        if let Some(i) = imm {
            self.by_imm.insert(i, cookie);
        }
        if is_control(opcode) {
            self.control_out += 1;
        }
        self.reqs.insert(
            cookie,
            Outstanding {
                opcode,
                slot,
                imm,
                length: 0,
                target,
                extra_credits: 0,
                user: U::default(),
                // An INTERRUPT is answered after the next I/O completion,
                // however late: it has no deadline of its own.
                deadline: (opcode != Opcode::Interrupt)
                    .then_some(self.cfg.op_timeout)
                    .flatten()
                    .and_then(|t| now.checked_add(t)),
                timed_out: false,
            },
        );
    }

    /// Record a request and queue it for [`ClientConn::poll_transmit`],
    /// which encodes it into the caller's send buffer.
    fn emit_request(
        &mut self,
        now: Instant,
        op: RequestOp<'static>,
        cookie: ReqId,
        opcode: Opcode,
        slot: Option<u32>,
        imm: Option<u32>,
    ) -> Result<(), ClientError> {
        let r = self.repr(op);
        // Everything but the buffer length that encoding can refuse.
        r.header().map_err(|_| ClientError::InvalidArgument)?;
        self.record(now, &r, cookie, opcode, slot, imm);
        self.transmit.push_back(Transmit::Request(r));
        Ok(())
    }

    /// Record a request whose payload the caller only lends: encoded now,
    /// into `out` (returns its length; the caller sends `out[..len]`) or,
    /// without `out`, into bytes queued for `poll_transmit`.
    #[allow(clippy::too_many_arguments)]
    fn emit_borrowed(
        &mut self,
        now: Instant,
        op: RequestOp<'_>,
        cookie: ReqId,
        opcode: Opcode,
        slot: Option<u32>,
        imm: Option<u32>,
        out: Option<&mut [u8]>,
    ) -> Result<usize, ClientError> {
        let r = self.repr(op);
        let n = match out {
            Some(buf) => {
                // Messages queued before this one leave first.
                if !self.transmit.is_empty() {
                    return Err(ClientError::TransmitPending);
                }
                r.emit(buf).map_err(|_| ClientError::InvalidArgument)?
            }
            None => {
                let b = r.to_bytes().map_err(|_| ClientError::InvalidArgument)?;
                let n = b.len();
                self.transmit.push_back(Transmit::Bytes(b));
                n
            }
        };
        self.record(now, &r, cookie, opcode, slot, imm);
        Ok(n)
    }

    /// Encode the next queued request message into `out` (a send buffer)
    /// and return its length; None when nothing waits. Messages leave in
    /// the order they were issued. A message longer than `out` closes the
    /// connection (`CloseReason::PayloadTooLarge`).
    pub fn poll_transmit(&mut self, out: &mut [u8]) -> Option<usize> {
        let t = self.transmit.pop_front()?;
        let n = match &t {
            Transmit::Request(r) => r.emit(out).ok(),
            Transmit::Bytes(b) => out.get_mut(..b.len()).map(|o| {
                o.copy_from_slice(b);
                b.len()
            }),
        };
        if n.is_none() {
            self.close(CloseReason::PayloadTooLarge);
        }
        n
    }

    /// Request messages waiting for [`ClientConn::poll_transmit`].
    pub fn transmit_pending(&self) -> usize {
        self.transmit.len()
    }

    fn check_issue(&self) -> Result<(), ClientError> {
        self.check_issue_for(Opcode::Read)
    }

    /// [`ClientConn::check_issue`] for a request of `opcode`: INTERRUPT and
    /// CANCEL may take the reserved credit.
    fn check_issue_for(&self, opcode: Opcode) -> Result<(), ClientError> {
        let free = match opcode {
            Opcode::Interrupt | Opcode::Cancel => self.can_interrupt(),
            _ => self.can_issue(),
        };
        match self.state {
            State::Closed => Err(ClientError::Closed),
            State::Idle | State::AuthSent => Err(ClientError::NotAuthenticated),
            State::Ready if !free => Err(ClientError::NoCredits),
            State::Ready => Ok(()),
        }
    }

    /// Allocate cookie / slot / immediate for an I/O.
    fn io_mode(
        &mut self,
        mode: Mode,
    ) -> Result<(ReqId, CompletionMode, Option<u32>, Option<u32>), ClientError> {
        let cookie = self.alloc_cookie();
        match mode {
            Mode::Interrupt => {
                let mut imm = cookie as u32;
                while imm == 0 || self.by_imm.contains_key(&imm) {
                    imm = imm.wrapping_add(1);
                }
                Ok((
                    cookie,
                    CompletionMode::Interrupt {
                        cookie,
                        immediate_cookie: imm,
                    },
                    None,
                    Some(imm),
                ))
            }
            Mode::Polled | Mode::PolledWindow(_) => {
                let area = self.cfg.status_blocks.ok_or(ClientError::NoStatusBlock)?;
                let slot = *self.free_slots.last().ok_or(ClientError::NoStatusBlock)?;
                let ios_va = self.slot_addr(slot).ok_or(ClientError::InvalidArgument)?;
                self.free_slots.pop();
                let ios_mh = match mode {
                    Mode::PolledWindow(k) => {
                        self.windowed.insert(slot);
                        k
                    }
                    _ => area.rkey,
                };
                Ok((
                    cookie,
                    CompletionMode::Polled { ios_va, ios_mh },
                    Some(slot),
                    None,
                ))
            }
        }
    }

    fn control(
        &mut self,
        now: Instant,
        opcode: Opcode,
        make: impl FnOnce(u64) -> RequestOp<'static>,
    ) -> Result<ReqId, ClientError> {
        self.check_issue_for(opcode)?;
        let cookie = self.alloc_cookie();
        self.emit_request(now, make(cookie), cookie, opcode, None, None)?;
        Ok(cookie)
    }

    /// REGISTER a file; completion `information` is the Fid.
    pub fn register(
        &mut self,
        now: Instant,
        resume_key: SrvResumeKey,
        flags_and_attributes: u32,
    ) -> Result<ReqId, ClientError> {
        let session_id = self.session_id;
        self.control(now, Opcode::Register, |cookie| RequestOp::Register {
            cookie,
            params: FidParamsRepr {
                resume_key,
                session_id,
                flags_and_attributes,
            },
        })
    }

    pub fn close_file(&mut self, now: Instant, fid: u16) -> Result<ReqId, ClientError> {
        self.control(now, Opcode::Close, |cookie| RequestOp::Close {
            fid,
            cookie,
        })
    }

    /// FLUSH `fid` (an lwio extension, docs/protocol.md §5.13): fsync, or
    /// fdatasync with `data_only`, of the file on the server; answered when
    /// it is done. `InvalidArgument` when the server did not offer it
    /// ([`ClientConn::server_flushes`]).
    pub fn flush(&mut self, now: Instant, fid: u16, data_only: bool) -> Result<ReqId, ClientError> {
        if !self.server_flushes() {
            return Err(ClientError::InvalidArgument);
        }
        self.control(now, Opcode::Flush, |cookie| RequestOp::Flush {
            fid,
            cookie,
            data_only,
        })
    }

    /// Whether the server serves FLUSH (its AUTH answer offered it).
    pub fn server_flushes(&self) -> bool {
        self.server
            .as_ref()
            .is_some_and(|s| s.features & FEATURE_FLUSH != 0)
    }

    /// CANCEL every outstanding I/O of `fid`.
    pub fn cancel(&mut self, now: Instant, fid: u16) -> Result<ReqId, ClientError> {
        self.control(now, Opcode::Cancel, |cookie| RequestOp::Cancel {
            fid,
            cookie,
        })
    }

    /// CANCEL the one outstanding I/O `req` (of `fid`), named by the
    /// completion fields it was sent with (docs/protocol.md §5.9).
    /// `InvalidArgument` when `req` is not an outstanding I/O (it completed).
    pub fn cancel_request(
        &mut self,
        now: Instant,
        fid: u16,
        req: ReqId,
    ) -> Result<ReqId, ClientError> {
        let target = self
            .reqs
            .get(&req)
            .and_then(|o| o.target)
            .ok_or(ClientError::InvalidArgument)?;
        self.control(now, Opcode::Cancel, |cookie| RequestOp::CancelIo {
            fid,
            cookie,
            target,
        })
    }

    /// Whether `req` is still outstanding (sent, not completed).
    pub fn is_outstanding(&self, req: ReqId) -> bool {
        self.reqs.contains_key(&req)
    }

    /// Ask to be woken by the next I/O completion (one at a time).
    pub fn interrupt(&mut self, now: Instant) -> Result<ReqId, ClientError> {
        if self.reqs.values().any(|r| r.opcode == Opcode::Interrupt) {
            return Err(ClientError::InvalidArgument);
        }
        self.control(now, Opcode::Interrupt, |cookie| RequestOp::Interrupt {
            cookie,
        })
    }

    fn io(
        &mut self,
        now: Instant,
        mode: Mode,
        opcode: Opcode,
        length: u32,
        make: impl FnOnce(CompletionMode) -> RequestOp<'static>,
    ) -> Result<Issued, ClientError> {
        self.check_issue()?;
        let (cookie, cm, slot, imm) = self.io_mode(mode)?;
        let r = self.emit_request(now, make(cm), cookie, opcode, slot, imm);
        if let Some(o) = self.reqs.get_mut(&cookie) {
            o.length = length;
        }
        if r.is_err() {
            if let Some(s) = slot {
                self.slot_unused(s);
            }
        }
        r.map(|_| Issued { req: cookie, slot })
    }

    /// READ `len` bytes at `offset` into `dst`.
    pub fn read(
        &mut self,
        now: Instant,
        fid: u16,
        offset: u64,
        len: u32,
        dst: RemoteBuf,
        mode: Mode,
    ) -> Result<Issued, ClientError> {
        self.io(now, mode, Opcode::Read, len, |m| RequestOp::Read {
            fid,
            offset,
            length: len,
            data_va: dst.addr,
            data_mh: dst.rkey,
            mode: m,
        })
    }

    /// VEC_READ `len` bytes at `offset` scattered over `regions`.
    #[allow(clippy::too_many_arguments)]
    pub fn vec_read(
        &mut self,
        now: Instant,
        fid: u16,
        offset: u64,
        len: u32,
        page_size: u16,
        regions: &[RdmaRegion],
        mode: Mode,
    ) -> Result<Issued, ClientError> {
        if regions.len() > usize::from(u16::MAX) {
            return Err(ClientError::InvalidArgument);
        }
        let regions = regions.to_vec();
        self.io(now, mode, Opcode::VecRead, len, move |m| {
            RequestOp::VecRead {
                fid,
                offset,
                length: len,
                page_size,
                regions,
                mode: m,
            }
        })
    }

    fn check_payload(&self, len: usize) -> Result<(), ClientError> {
        let max = self.server.as_ref().map_or(0, |s| s.max_recv_buffer_size);
        if u32::try_from(len).map_or(true, |l| l > max) {
            return Err(ClientError::InvalidArgument);
        }
        Ok(())
    }

    /// Issue an I/O whose payload the caller lends (see `emit_borrowed`);
    /// the status block slot goes back if encoding fails.
    fn io_borrowed<'d>(
        &mut self,
        now: Instant,
        mode: Mode,
        opcode: Opcode,
        make: impl FnOnce(CompletionMode) -> RequestOp<'d>,
        out: Option<&mut [u8]>,
    ) -> Result<(Issued, usize), ClientError> {
        let (cookie, cm, slot, imm) = self.io_mode(mode)?;
        match self.emit_borrowed(now, make(cm), cookie, opcode, slot, imm, out) {
            Ok(n) => Ok((Issued { req: cookie, slot }, n)),
            Err(e) => {
                if let Some(s) = slot {
                    self.slot_unused(s);
                }
                Err(e)
            }
        }
    }

    /// When [`ClientConn::handle_timeout`] has something to do next: the
    /// earliest deadline of a request that has not timed out yet.
    pub fn poll_timeout(&self) -> Option<Instant> {
        if self.state == State::Closed {
            return None;
        }
        self.reqs.values().filter_map(|o| o.deadline).min()
    }

    /// Time passed: requests unanswered past their deadline time out (a
    /// [`ClientEvent::TimedOut`] each; they stay outstanding), and an
    /// unanswered CREDIT reply closes the connection.
    pub fn handle_timeout(&mut self, now: Instant) {
        if self.state == State::Closed {
            return;
        }
        let mut expired: Vec<(ReqId, Opcode)> = Vec::new();
        for (&req, o) in self.reqs.iter_mut() {
            if o.deadline.is_some_and(|d| d <= now) {
                o.deadline = None;
                o.timed_out = true;
                expired.push((req, o.opcode));
            }
        }
        // By cookie (issue order until cookies wrap): a deterministic order.
        expired.sort_unstable_by_key(|&(req, _)| req);
        for (req, opcode) in expired {
            if opcode == Opcode::Credit {
                return self.close(CloseReason::CreditTimeout);
            }
            self.events.push_back(ClientEvent::TimedOut { req, opcode });
        }
    }

    /// Whether outstanding `req` timed out (its answer may still come).
    pub fn is_timed_out(&self, req: ReqId) -> bool {
        self.reqs.get(&req).is_some_and(|o| o.timed_out)
    }

    /// A slot taken for a request that was not sent: free at once (the
    /// server never saw a key for it).
    fn slot_unused(&mut self, s: u32) {
        self.windowed.remove(&s);
        self.free_slots.push(s);
    }

    fn consume_recv(&mut self) {
        self.recv_posted = self.recv_posted.saturating_sub(1);
    }

    fn finish(&mut self, req: ReqId, information: u32, status: NtStatus) {
        let Some(o) = self.reqs.remove(&req) else {
            return;
        };
        self.extra_held = self.extra_held.saturating_sub(o.extra_credits as usize);
        if is_control(o.opcode) {
            self.control_out = self.control_out.saturating_sub(1);
        }
        if let Some(s) = o.slot {
            self.by_slot.remove(&s);
            if self.windowed.remove(&s) {
                // Its window may still be valid: not reused before the
                // caller releases it.
                self.fenced.insert(s);
            } else {
                self.free_slots.push(s);
            }
        }
        if let Some(i) = o.imm {
            self.by_imm.remove(&i);
        }
        if o.opcode == Opcode::Credit && status == LWIO_NOTIFY_CREDIT {
            self.credits = self.credits.saturating_sub(1).max(1);
            self.events.push_back(ClientEvent::CreditsChanged {
                credits: self.credits,
            });
        }
        if o.opcode == Opcode::Credit
            && self.pending_credit_msgs.is_empty()
            && !self.reqs.values().any(|r| r.opcode == Opcode::Credit)
        {
            self.credit_tx = false;
        }
        if o.opcode != Opcode::Credit {
            self.events.push_back(ClientEvent::Completed {
                req,
                opcode: o.opcode,
                information,
                status,
            });
            self.done.insert(
                req,
                Done {
                    opcode: o.opcode,
                    information,
                    status,
                    user: o.user,
                },
            );
        }
    }

    fn flush_credit_msgs(&mut self, now: Instant) {
        while self.state == State::Ready
            && !self.pending_credit_msgs.is_empty()
            && self.credits_held() < usize::from(self.credits)
        {
            let Some(value) = self.pending_credit_msgs.pop_front() else {
                break;
            };
            let cookie = self.alloc_cookie();
            if self
                .emit_request(
                    now,
                    RequestOp::Credit { cookie, value },
                    cookie,
                    Opcode::Credit,
                    None,
                    None,
                )
                .is_err()
            {
                return self.close(CloseReason::ServerMisbehaved("cannot encode CREDIT"));
            }
        }
    }

    /// A message arrived in one of the posted receive buffers.
    pub fn handle_recv(&mut self, now: Instant, msg: &[u8], mem: &dyn LocalMemory) {
        if self.state == State::Closed {
            return;
        }
        self.consume_recv();
        let s = match StatusResponse::from_bytes(msg) {
            Ok(s) => s,
            Err(_) => {
                return self.close(CloseReason::ServerMisbehaved("malformed status response"))
            }
        };
        if s.is_credit_delta() {
            self.handle_delta(s.credit_delta());
        } else if s.cookie == self.auth_cookie && self.state == State::AuthSent {
            self.handle_auth_done(s, mem);
        } else if self.reqs.contains_key(&s.cookie)
            && !self.by_slot.values().any(|&r| r == s.cookie)
        {
            self.finish(s.cookie, s.ios.information, s.ios.status);
        }
        // Unknown cookies (duplicates) are ignored.
        self.top_up_recvs();
        self.flush_credit_msgs(now);
    }

    /// An RDMA write with immediate data arrived (consumes a receive).
    pub fn handle_immediate(&mut self, now: Instant, imm: u32) {
        if self.state == State::Closed {
            return;
        }
        self.consume_recv();
        if let Some(req) = self.by_imm.get(&imm).copied() {
            // Immediate completion is only used for full successful reads.
            let len = self.reqs.get(&req).map_or(0, |o| o.length);
            self.finish(req, len, STATUS_SUCCESS);
        }
        self.top_up_recvs();
        self.flush_credit_msgs(now);
    }

    /// The caller observed status block `slot` reading (information, status).
    /// The sentinel, a partly placed block (`wire::small::poll_block_written`)
    /// and STATUS_PENDING are ignored.
    pub fn status_block_updated(
        &mut self,
        now: Instant,
        slot: u32,
        information: u32,
        status: NtStatus,
    ) {
        let raw = u64::from(status) << 32 | u64::from(information);
        if !crate::wire::small::poll_block_written(raw)
            || status == STATUS_PENDING
            || self.state == State::Closed
        {
            return;
        }
        if let Some(req) = self.by_slot.get(&slot).copied() {
            self.finish(req, information, status);
            self.flush_credit_msgs(now);
        }
    }

    fn handle_delta(&mut self, delta: i32) {
        if self.state != State::Ready || self.credit_tx || delta == 0 {
            return self.close(CloseReason::ServerMisbehaved("unexpected credit delta"));
        }
        let new = i64::from(self.credits) + i64::from(delta);
        if !(1..=255).contains(&new) {
            return self.close(CloseReason::ServerMisbehaved("credit delta out of range"));
        }
        self.credit_tx = true;
        if delta > 0 {
            self.credits = new as u16;
            self.events.push_back(ClientEvent::CreditsChanged {
                credits: self.credits,
            });
            // Of the `delta` new credits, those above what this client can
            // use (seed 000: "the number of credits allocated by the server
            // that the client did not use"): none when the server granted
            // toward its hint.
            let unused = (new - self.credits_needed()).clamp(0, i64::from(delta));
            self.pending_credit_msgs.push_back(unused as i32);
        } else {
            for v in delta..0 {
                self.pending_credit_msgs.push_back(v);
            }
        }
        // The next delta's window of hints starts now.
        self.peak_hint_sent = [self.last_hint, self.peak_hint_sent[0]];
    }

    fn handle_auth_done(&mut self, s: StatusResponse, mem: &dyn LocalMemory) {
        self.reqs.remove(&s.cookie);
        if s.ios.status != STATUS_SUCCESS {
            self.events.push_back(ClientEvent::AuthFailed {
                status: s.ios.status,
            });
            return self.close(CloseReason::ServerMisbehaved("authentication refused"));
        }
        let len = (s.ios.information as usize).saturating_sub(8);
        // The auth buffer is at least AUTH_BUFFER_MIN bytes; longer params
        // are refused rather than read.
        let verified = (len <= AUTH_BUFFER_MIN)
            .then(|| mem.read(self.cfg.auth_buffer.addr, len))
            .flatten()
            .and_then(|raw| AuthParamsRepr::verify(&raw, &self.cfg.secret).ok());
        let Some((p, alg)) = verified else {
            self.events.push_back(ClientEvent::AuthFailed {
                status: STATUS_ACCESS_DENIED,
            });
            return self.close(CloseReason::ServerMisbehaved("server auth params invalid"));
        };
        let ok = alg == self.cfg.signature
            && p.rev_id == LWIO_REV_ID
            && usize::from(p.header_size) == COMMON_HEADER_LEN
            && p.key == Some(self.cfg.key)
            && p.session_id.is_some()
            && p.credits >= 1
            && p.credits <= 255
            && p.page_size.is_power_of_two();
        if !ok {
            self.events.push_back(ClientEvent::AuthFailed {
                status: STATUS_ACCESS_DENIED,
            });
            return self.close(CloseReason::ServerMisbehaved("server auth params rejected"));
        }
        self.session_id = p.session_id.unwrap_or_default();
        self.credits = p.credits;
        self.state = State::Ready;
        self.server = Some(p.clone());
        self.events.push_back(ClientEvent::Authenticated {
            session_id: self.session_id,
            credits: self.credits,
            server: p,
        });
        self.top_up_recvs();
    }
}

/// INTERRUPT, CANCEL and CREDIT: requests that are not I/O (not counted in
/// the Credits hint).
fn is_control(op: Opcode) -> bool {
    matches!(op, Opcode::Interrupt | Opcode::Cancel | Opcode::Credit)
}
