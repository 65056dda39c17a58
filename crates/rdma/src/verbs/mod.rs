//! The provider-neutral RDMA verbs API.
//!
//! Every object is a cheap, cloneable (where verbs allow it) handle around a
//! provider object (`Arc<dyn …Ops>`). Consumers only ever see the handle types
//! in this module; providers implement the `*Ops` traits in [`ops`].
//!
//! The model follows the verbs of InfiniBand/iWARP (and the memory-protection
//! model of seed 002):
//!
//! * a [`Context`] is an opened device of a [`Provider`];
//! * a [`Pd`] groups memory registrations, windows and queue pairs: a key of one
//!   PD is never valid on a QP of another;
//! * an [`Mr`] registers a byte range with [`Access`] rights and has a local key
//!   and a remote key (STag). Dropping it deregisters it and invalidates its keys
//!   at once;
//! * an [`Mw`] (memory window) is a remote key that is *bound* to a byte range of
//!   a region by a work request posted on a QP ([`Qp::bind_mw`]), possibly
//!   one-shot, and unbound by local invalidation ([`Qp::invalidate`]) or by the
//!   peer's Send with Invalidate. Each bind issues a new key byte, so a stale
//!   key never matches again;
//! * a [`Cq`] collects [`Wc`] work completions; it can be polled, or armed and
//!   waited on through a [`CompChannel`] whose file descriptor works with
//!   `poll(2)`, epoll and tokio's `AsyncFd`;
//! * a [`Qp`] is a reliable-connected queue pair created by the connection
//!   manager ([`Context::connect`], [`Listener::accept`]).
//!
//! # Memory and `unsafe`
//! Registered memory may be written by the remote peer at any time while a key
//! that covers it is valid. Rust references (`&[u8]`, `&mut [u8]`) to such memory
//! would assert a freedom from concurrent mutation that the network does not
//! respect, so [`Mr`] offers copy-in/copy-out accessors ([`Mr::read_at`],
//! [`Mr::write_at`]), bounds-checked ranged views ([`Mr::slice`],
//! [`Mr::slice_mut`]) with the same copying accessors, volatile word accessors
//! for polled status words ([`MrSlice::load_u64`] says what they do and do not
//! guarantee), and only `unsafe` slice views of a *range*
//! ([`MrSlice::as_slice`], [`MrSliceMut::as_mut_slice`]) for callers that can
//! show that nothing else touches that range while the slice lives.

use std::any::Any;
use std::fmt;
use std::net::SocketAddr;
use std::os::fd::RawFd;
use std::sync::atomic::{fence, Ordering};
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::Duration;

/// A Terminate's error triple (RFC 5040 §7), lwio-iwarp's.
pub use lwio_iwarp::wire::term::TermError;

pub use ops::*;

bitflags::bitflags! {
    /// Access rights of a memory region or window.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    pub struct Access: u32 {
        /// The local HCA/provider may write (receives, RDMA Read sinks).
        const LOCAL_WRITE = 1 << 0;
        /// The peer may RDMA Write into it.
        const REMOTE_WRITE = 1 << 1;
        /// The peer may RDMA Read from it.
        const REMOTE_READ = 1 << 2;
        /// Memory windows may be bound to this region.
        const MW_BIND = 1 << 4;
    }
}

/// The link layer / transport a device speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Transport {
    /// iWARP (RFC 5040/5041/5044) — the soft provider, siw and iWARP NICs.
    Iwarp,
    /// RoCE (v1/v2) — rxe and RoCE NICs.
    Roce,
    /// InfiniBand.
    Infiniband,
    /// Anything else the verbs library reports.
    Other,
}

impl Transport {
    /// The name LWIO's negotiate gives this wire transport (`iwarp`,
    /// `rocev2`, `ib`; docs/protocol.md §2.8), or `None` for one it has no
    /// name for.
    pub fn wire_name(self) -> Option<&'static str> {
        match self {
            Transport::Iwarp => Some("iwarp"),
            Transport::Roce => Some("rocev2"),
            Transport::Infiniband => Some("ib"),
            Transport::Other => None,
        }
    }
}

impl fmt::Display for Transport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Transport::Iwarp => "iWARP",
            Transport::Roce => "RoCE",
            Transport::Infiniband => "InfiniBand",
            Transport::Other => "other",
        })
    }
}

/// How memory windows are realised by a device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MwKind {
    /// Real windows bound by a posted work request, no system call (soft, type-2 NICs).
    Native,
    /// The device has no windows: each bind registers a fresh region over the
    /// range (a system call) and each invalidation deregisters it. The remote
    /// side can still only touch that range, and only until it is invalidated.
    PerRequestRegistration,
}

/// Device capabilities that consumers must respect.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceCaps {
    pub max_mr_size: u64,
    pub max_qp_wr: u32,
    pub max_cqe: u32,
    pub max_sge: u32,
    pub max_inline_data: u32,
    /// Max outstanding inbound RDMA Reads per QP (IRD).
    pub max_ird: u32,
    /// Max outstanding outbound RDMA Reads per QP (ORD).
    pub max_ord: u32,
    /// Largest message (send or RDMA) the device moves.
    pub max_msg_size: u64,
    pub mw_kind: MwKind,
    /// A window can be bound one-shot and the provider itself disables it after
    /// the first remote access completes. When false the consumer must
    /// invalidate after completion to obtain the same guarantee.
    pub one_shot_mw: bool,
    /// RDMA Write with immediate data (RFC 7306 on iWARP, native on IB/RoCE).
    pub write_with_imm: bool,
    /// Send with Invalidate.
    pub send_with_invalidate: bool,
    /// Largest receive queue of a shared receive queue ([`Pd::create_srq`]);
    /// 0 = the device has no SRQs.
    pub max_srq_wr: u32,
    /// Most SGEs of one SRQ receive.
    pub max_srq_sge: u32,
}

/// One device of a provider, as listed by `lwio devices`.
#[derive(Debug, Clone)]
pub struct DeviceInfo {
    /// Provider name (`"soft"`, `"verbs"`).
    pub provider: &'static str,
    /// Device name (`"soft0"`, `"rxe0"`, `"siw0"`, `"mlx5_0"` …).
    pub name: String,
    pub transport: Transport,
    /// IP addresses the device can be reached at, where known.
    pub addresses: Vec<std::net::IpAddr>,
    /// `Ok` when usable; otherwise why not.
    pub usable: Result<(), String>,
    pub caps: Option<DeviceCaps>,
}

/// Who drives the protocol engine of a software provider.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Progress {
    /// An engine thread per context does all the work; completions arrive
    /// without the consumer calling into the provider.
    #[default]
    Auto,
    /// The thread that polls a CQ (or waits on a completion channel, or calls
    /// [`Context::progress`]) does the work. No engine thread, no cross-thread
    /// wake-up: the lowest latency for a busy-polling consumer.
    Manual,
}

/// MPA CRC policy of an iWARP provider.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CrcPolicy {
    /// Ask for CRC32c, accept the peer's wish not to use it.
    Preferred,
    /// Insist on CRC32c; reject peers that refuse it.
    Required,
    /// Do not ask for CRC (the peer may still require it, per RFC 5044 §7.1.2).
    #[default]
    Off,
}

/// Provider configuration. Fields that do not apply to a provider are ignored
/// by it (documented per field).
#[derive(Debug, Clone)]
pub struct Config {
    /// Soft provider: engine threading model. Verbs: ignored (hardware progresses).
    pub progress: Progress,
    /// Soft provider: bytes of anonymous buffering per QP for sends that arrive
    /// before a receive is posted (seed 003's indicate window). When full, the
    /// provider stops reading the socket until receives are posted.
    pub indicate_window: usize,
    /// Soft provider: MPA CRC32c policy.
    pub mpa_crc: CrcPolicy,
    /// Soft provider: maximum ULPDU (payload per FPDU) we send; 0 = derive from the MSS.
    pub mulpdu: usize,
    /// Both: time allowed for connection establishment (MPA / rdma_cm).
    pub connect_timeout: Duration,
    /// Soft provider: a connection whose peer host answers nothing for this
    /// long is dead (TCP keepalive: first probe after a third of it, then
    /// every sixth, 4 probes; and `TCP_USER_TIMEOUT` for unacknowledged
    /// data); the QP goes to the error state. A stopped or slow peer
    /// *process* is not dead: its kernel answers. None: the system's TCP
    /// defaults (no keepalive). Verbs: ignored.
    pub dead_peer_timeout: Option<Duration>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            progress: Progress::Auto,
            indicate_window: 256 * 1024,
            mpa_crc: CrcPolicy::Off,
            mulpdu: 0,
            connect_timeout: Duration::from_secs(10),
            dead_peer_timeout: Some(Duration::from_secs(30)),
        }
    }
}

/// Errors of the verbs API.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("I/O error: {0}")]
    Io(#[from] std::io::Error),
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    #[error("not supported by this provider/device: {0}")]
    NotSupported(String),
    #[error("provider unavailable: {0}")]
    ProviderUnavailable(String),
    #[error("no such device: {0}")]
    NoSuchDevice(String),
    #[error("connection rejected by peer")]
    Rejected {
        /// The private data the peer sent with its reject.
        private_data: Vec<u8>,
    },
    #[error("peer unreachable: {0}")]
    Unreachable(String),
    #[error("timed out: {0}")]
    Timeout(String),
    #[error("connection handshake failed: {0}")]
    Handshake(String),
    #[error("queue pair is in the error state")]
    QpError,
    #[error("work queue full")]
    QueueFull,
    #[error("resource limit: {0}")]
    ResourceExhausted(String),
    #[error("invalid key or access: {0}")]
    Protection(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// A posting error: which work request of a list failed (those before it were posted).
#[derive(Debug, thiserror::Error)]
#[error("work request {index} of the list could not be posted: {error}")]
pub struct PostError {
    pub index: usize,
    #[source]
    pub error: Error,
}

/// A scatter/gather element: `length` bytes at `addr`, covered by the local key `lkey`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sge {
    pub addr: u64,
    pub length: u32,
    pub lkey: u32,
}

/// The operation of a send-queue work request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendOp {
    /// Untagged Send into the peer's next posted receive.
    Send,
    /// Send with immediate data (IB/RoCE only; iWARP has no such operation).
    SendWithImm { imm: u32 },
    /// Send that also invalidates `rkey` at the peer (iWARP SendInv / IB SEND_WITH_INV).
    SendWithInvalidate { rkey: u32 },
    /// RDMA Write of the gathered local data to `remote_addr` under `rkey`.
    Write { remote_addr: u64, rkey: u32 },
    /// RDMA Write that also consumes a receive at the peer carrying `imm`.
    WriteWithImm {
        remote_addr: u64,
        rkey: u32,
        imm: u32,
    },
    /// RDMA Read of `sum(sge.length)` bytes from `remote_addr` under `rkey` into the local SGEs.
    Read { remote_addr: u64, rkey: u32 },
}

/// A send-queue work request.
#[derive(Debug, Clone, Copy)]
pub struct SendWr<'a> {
    pub wr_id: u64,
    pub op: SendOp,
    pub sg_list: &'a [Sge],
    /// Generate a completion on success (errors always complete).
    pub signaled: bool,
    /// Do not start until prior RDMA Reads on this QP have completed.
    pub fence: bool,
    /// Mark the message solicited (wakes a peer armed with `solicited_only`).
    pub solicited: bool,
    /// Copy the payload at post time (≤ `max_inline_data`); the SGE's lkey is then not checked.
    pub inline: bool,
}

impl<'a> SendWr<'a> {
    /// A signalled work request with no flags.
    pub fn new(wr_id: u64, op: SendOp, sg_list: &'a [Sge]) -> Self {
        SendWr {
            wr_id,
            op,
            sg_list,
            signaled: true,
            fence: false,
            solicited: false,
            inline: false,
        }
    }
}

/// A receive-queue work request.
#[derive(Debug, Clone, Copy)]
pub struct RecvWr<'a> {
    pub wr_id: u64,
    pub sg_list: &'a [Sge],
}

/// Parameters of a memory-window bind.
#[derive(Clone, Copy)]
pub struct MwBind<'a> {
    pub mr: &'a Mr,
    /// Byte offset of the window inside the region.
    pub offset: u64,
    /// Length in bytes (any granularity).
    pub length: u64,
    /// The window's own rights (⊆ REMOTE_READ | REMOTE_WRITE); the region must allow them.
    pub access: Access,
    /// Disable the translation once the first remote access through it completes.
    pub one_shot: bool,
}

/// Status of a work completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WcStatus {
    Success,
    /// Local length error (receive too small for the incoming message, …).
    LocLenErr,
    /// Local QP operation error (internal consistency).
    LocQpOpErr,
    /// Local protection error (bad lkey / SGE outside the region / missing LOCAL_WRITE).
    LocProtErr,
    /// Flushed because the QP entered the error state.
    WrFlushErr,
    /// The memory-window bind failed.
    MwBindErr,
    /// The peer found the request invalid.
    RemInvReqErr,
    /// The peer refused access (bad STag, bounds, rights) — a Terminate on iWARP.
    RemAccessErr,
    /// The peer failed to execute the operation.
    RemOpErr,
    /// Transport retries exhausted / connection lost.
    RetryExcErr,
    /// Receiver not ready retries exhausted.
    RnrRetryExcErr,
    /// Fatal provider error.
    FatalErr,
    /// Anything else.
    GeneralErr,
}

/// What completed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WcOpcode {
    Send,
    RdmaWrite,
    RdmaRead,
    BindMw,
    LocalInv,
    /// A receive consumed by a Send.
    Recv,
    /// A receive consumed by an RDMA Write with immediate.
    RecvRdmaWithImm,
}

/// A work completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Wc {
    pub wr_id: u64,
    pub status: WcStatus,
    pub opcode: WcOpcode,
    /// Bytes received (receives) or transferred (RDMA Read).
    pub byte_len: u32,
    pub imm: Option<u32>,
    /// The key the peer invalidated with a Send with Invalidate.
    pub invalidated_rkey: Option<u32>,
    pub qp_num: u32,
    /// Provider-specific detail (for iWARP Terminates: layer/etype/ecode packed as
    /// `layer << 12 | etype << 8 | ecode`).
    pub vendor_err: u32,
}

impl Wc {
    /// A placeholder for the arrays handed to [`Cq::poll`]: entries past
    /// the count `poll` returns are not completions (the error status keeps
    /// an unfilled one from passing for a success).
    pub const BLANK: Wc = Wc {
        wr_id: 0,
        status: WcStatus::GeneralErr,
        opcode: WcOpcode::Send,
        byte_len: 0,
        imm: None,
        invalidated_rkey: None,
        qp_num: 0,
        vendor_err: 0,
    };

    pub fn is_ok(&self) -> bool {
        self.status == WcStatus::Success
    }
}

/// Queue pair states visible to the consumer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QpState {
    /// Connected; work flows.
    Rts,
    /// Closing in an orderly way (disconnect requested, sends draining).
    Closing,
    /// Error: every outstanding and newly posted request completes with `WrFlushErr`.
    Error,
}

/// Queue-pair sizing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpCap {
    pub max_send_wr: u32,
    pub max_recv_wr: u32,
    pub max_send_sge: u32,
    pub max_recv_sge: u32,
    pub max_inline_data: u32,
}

impl Default for QpCap {
    fn default() -> Self {
        QpCap {
            max_send_wr: 128,
            max_recv_wr: 128,
            max_send_sge: 4,
            max_recv_sge: 4,
            max_inline_data: 64,
        }
    }
}

/// What a new queue pair is made of.
#[derive(Clone)]
pub struct QpInit {
    pub pd: Pd,
    pub send_cq: Cq,
    pub recv_cq: Cq,
    pub cap: QpCap,
    /// Signal every send WR regardless of `SendWr::signaled`.
    pub sq_sig_all: bool,
    /// Receive flow control (seed 003's indicate window) for this QP: the
    /// bytes of Sends that arrived before a receive was posted that the
    /// provider may hold; when full it stops reading the connection until
    /// receives are posted. `None`: the context's `Config::indicate_window`.
    /// The soft provider honours it; verbs devices have no such buffering
    /// (siw answers a Send with no receive with a Terminate, IB/RoCE with
    /// RNR NAKs) and ignore it.
    pub recv_window: Option<usize>,
    /// Take receives from this shared receive queue instead of the QP's
    /// own receive queue (`cap.max_recv_wr`/`max_recv_sge` are then
    /// unused and [`Qp::post_recv`] fails with `InvalidArgument`). The
    /// SRQ must come from the same context (soft) / device (verbs).
    pub srq: Option<Srq>,
}

impl QpInit {
    /// A QP of `pd` whose sends and receives complete on `cq`: default
    /// capabilities, selective signalling, the context's receive window,
    /// its own receive queue. Adjust with struct update syntax, e.g.
    /// `QpInit { srq: Some(srq), ..QpInit::new(&pd, &cq) }`.
    pub fn new(pd: &Pd, cq: &Cq) -> QpInit {
        QpInit {
            pd: pd.clone(),
            send_cq: cq.clone(),
            recv_cq: cq.clone(),
            cap: QpCap::default(),
            sq_sig_all: false,
            recv_window: None,
            srq: None,
        }
    }
}

/// Connection parameters offered by one side.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ConnParams {
    /// Opaque bytes delivered to the peer with the request/accept/reject
    /// (≤ 512 bytes on iWARP minus the enhanced-MPA words; ≤ 56 on RoCE accept).
    pub private_data: Vec<u8>,
    /// Inbound RDMA Read depth we grant (IRD, rdma_cm responder_resources).
    pub ird: u8,
    /// Outbound RDMA Read depth we want (ORD, rdma_cm initiator_depth).
    pub ord: u8,
}

/// What the connection ended up with.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Negotiated {
    /// The peer's private data.
    pub peer_private_data: Vec<u8>,
    pub ird: u8,
    pub ord: u8,
    /// iWARP: whether MPA CRC32c is in use. `None` on other transports.
    pub mpa_crc: Option<bool>,
}

/// Provider traits. Consumers do not need these; providers implement them.
pub mod ops;

mod mr;
pub use mr::{Mr, MrSlice, MrSliceMut, RegBuf};

// ---------------------------------------------------------------------------
// Handles.

/// An RDMA provider (`soft`, `verbs`).
#[derive(Clone)]
pub struct Provider(pub(crate) Arc<dyn ProviderOps>);

impl Provider {
    pub fn name(&self) -> &'static str {
        self.0.name()
    }
    pub fn devices(&self) -> Vec<DeviceInfo> {
        self.0.devices()
    }
    /// Open a device by name; `None` opens the first usable one.
    pub fn open(&self, device: Option<&str>, config: &Config) -> Result<Context> {
        let name = match device {
            Some(d) => d.to_string(),
            None => self
                .devices()
                .into_iter()
                .find(|d| d.usable.is_ok())
                .map(|d| d.name)
                .ok_or_else(|| {
                    Error::NoSuchDevice(format!("{} has no usable device", self.name()))
                })?,
        };
        Ok(Context(self.0.open(&name, config)?))
    }
}

impl fmt::Debug for Provider {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Provider({})", self.name())
    }
}

/// An opened device.
#[derive(Clone)]
pub struct Context(pub(crate) Arc<dyn ContextOps>);

impl Context {
    pub fn device(&self) -> &DeviceInfo {
        self.0.device()
    }
    pub fn alloc_pd(&self) -> Result<Pd> {
        Ok(Pd(self.0.alloc_pd()?))
    }
    pub fn create_comp_channel(&self) -> Result<CompChannel> {
        Ok(CompChannel(self.0.create_comp_channel()?))
    }
    pub fn create_cq(&self, depth: u32, channel: Option<&CompChannel>) -> Result<Cq> {
        Ok(Cq(self.0.create_cq(depth, channel, None)?))
    }
    /// A CQ on `channel` that identifies itself by `tag`: when it fires
    /// (after [`Cq::arm`], once per arm), [`CompChannel::take_fired`]
    /// reports `tag`. For one thread serving many connections with one
    /// channel: it learns which CQs to poll instead of polling them all.
    pub fn create_cq_tagged(&self, depth: u32, channel: &CompChannel, tag: u64) -> Result<Cq> {
        Ok(Cq(self.0.create_cq(depth, Some(channel), Some(tag))?))
    }
    pub fn listen(&self, addr: SocketAddr, backlog: u32) -> Result<Listener> {
        Ok(Listener(self.0.listen(addr, backlog)?))
    }
    /// Connect a new RC queue pair to a listener at `addr`.
    pub fn connect(&self, addr: SocketAddr, init: &QpInit, params: &ConnParams) -> Result<Qp> {
        Ok(Qp(self.0.connect(addr, init, params)?))
    }
    /// Connect with `recvs` already posted when the connection is
    /// established (see [`ConnRequest::accept_with_recvs`]).
    pub fn connect_with_recvs(
        &self,
        addr: SocketAddr,
        init: &QpInit,
        params: &ConnParams,
        recvs: &[RecvWr<'_>],
    ) -> Result<Qp> {
        Ok(Qp(self.0.connect_with_recvs(addr, init, params, recvs)?))
    }
    /// Manual progress (see [`Progress::Manual`]).
    pub fn progress(&self) -> Result<usize> {
        self.0.progress()
    }
    /// A new context of the same device and configuration, but with
    /// [`Progress::Manual`]: for a connection that one thread serves alone
    /// (it calls [`Context::progress`]), so no shared progress thread sits
    /// between its socket and its completions. `None` if the provider has
    /// nothing to gain from it (the verbs provider).
    pub fn open_manual_sibling(&self) -> Result<Option<Context>> {
        Ok(self.0.open_manual_sibling()?.map(Context))
    }
}

/// What a protection domain's provider made on it since it was created,
/// counted where the provider registers (for verbs, every `ibv_reg_mr`,
/// the per-request registrations of emulated windows included): so a
/// server can prove it never exposed memory, by asking, not by counting
/// its own intentions.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PdCensus {
    /// Memory regions registered.
    pub mrs: u64,
    /// Of those, registered with a remote right (remote read or write).
    pub mrs_remote: u64,
    /// Memory windows allocated.
    pub mws: u64,
}

impl std::ops::AddAssign for PdCensus {
    fn add_assign(&mut self, o: PdCensus) {
        self.mrs += o.mrs;
        self.mrs_remote += o.mrs_remote;
        self.mws += o.mws;
    }
}

/// A protection domain.
#[derive(Clone)]
pub struct Pd(pub(crate) Arc<dyn PdOps>);

impl Pd {
    /// What the provider has registered and allocated on this domain.
    pub fn census(&self) -> PdCensus {
        self.0.census()
    }

    /// Register a library-owned buffer. The region keeps the buffer alive.
    pub fn register(&self, buf: RegBuf, access: Access) -> Result<Mr> {
        let buf = Arc::new(buf);
        let (addr, len) = (buf.ptr, buf.len);
        let ops = self.0.reg_mr(
            MemRegion {
                addr,
                len,
                owner: Some(buf.clone()),
            },
            access,
        )?;
        Ok(Mr {
            ops,
            addr,
            len,
            _owner: Some(buf),
            local: RwLock::new(()),
        })
    }

    /// Allocate and register a zeroed, page-aligned buffer of `len` bytes.
    pub fn alloc_mr(&self, len: usize, access: Access) -> Result<Mr> {
        self.register(RegBuf::new(len)?, access)
    }

    /// Register caller-owned memory.
    ///
    /// # Safety
    /// `addr..addr+len` must stay allocated (and not be freed or remapped)
    /// until the returned [`Mr`] is dropped *and* every work request and window
    /// that uses it has completed or been invalidated. While a key covering it
    /// is valid the peer may write to it at any time: the caller must not hold
    /// Rust references to that memory across such windows.
    ///
    /// The peer's RDMA Reads through a key covering the memory need nothing
    /// more: once the `Mr`'s drop has returned, the provider no longer reads
    /// the memory for them (a hardware provider stops at deregistration; the
    /// soft provider copies a Read Response's payload while the region is
    /// still registered and terminates the connection for a Read it can no
    /// longer answer).
    pub unsafe fn register_raw(&self, addr: *mut u8, len: usize, access: Access) -> Result<Mr> {
        let ops = self.0.reg_mr(
            MemRegion {
                addr,
                len,
                owner: None,
            },
            access,
        )?;
        Ok(Mr {
            ops,
            addr,
            len,
            _owner: None,
            local: RwLock::new(()),
        })
    }

    pub fn alloc_mw(&self) -> Result<Mw> {
        Ok(Mw(self.0.alloc_mw()?))
    }

    /// A shared receive queue of up to `max_wr` receives of up to
    /// `max_sge` SGEs each, whose keys must belong to this domain. QPs
    /// created with [`QpInit::srq`] take their receives from it.
    pub fn create_srq(&self, max_wr: u32, max_sge: u32) -> Result<Srq> {
        Ok(Srq(self.0.create_srq(max_wr, max_sge)?))
    }
}

/// A shared receive queue ([`Pd::create_srq`]): receives that any QP bound
/// to it ([`QpInit::srq`]) consumes, in posting order, as Sends arrive on
/// it. A receive completion from an SRQ goes to the receiving QP's receive
/// CQ with that QP's `qp_num` and the SRQ receive's `wr_id`. A QP that
/// fails flushes only a receive it had already taken (a message in
/// progress), never the SRQ's others. Dropping the handle while QPs still
/// use it is safe: they keep it alive.
#[derive(Clone)]
pub struct Srq(pub(crate) Arc<dyn SrqOps>);

impl Srq {
    /// As [`Qp::post_recv`]. A receive whose keys are not of the SRQ's
    /// domain is refused here (`Error::Protection`) by the soft provider;
    /// a device reports it on the QP that takes it.
    pub fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<(), PostError> {
        self.0.post_recv(wrs)
    }
    /// Receives posted and not yet consumed (verbs: posted minus the
    /// receive completions polled from the QPs bound to it).
    pub fn posted(&self) -> usize {
        self.0.posted()
    }
    /// Take back up to `max` receives that no QP has taken yet, the last
    /// posted first, and return their wr_ids: their buffers are the
    /// caller's again. Not a verbs operation: the soft provider does it (a
    /// receive pool shrinks after a burst); devices return none (their
    /// receives stay posted until consumed).
    pub fn withdraw(&self, max: usize) -> Vec<u64> {
        self.0.withdraw(max)
    }
    /// Take back every receive no QP has taken yet whose wr_id `pick`
    /// selects (in posting order), and return their wr_ids; the others
    /// stay posted in their order. As [`Srq::withdraw`], devices return
    /// none. (A pool frees whole regions this way after a burst, without
    /// taking back and posting again the receives it keeps.)
    pub fn withdraw_if(&self, mut pick: impl FnMut(u64) -> bool) -> Vec<u64> {
        self.0.withdraw_if(&mut pick)
    }

    /// Times a Send arrived to find no receive posted and waited for one
    /// (the soft provider buffers it under the QP's indicate window); 0 on
    /// devices, where such a Send is an error or an RNR retry.
    pub fn starved(&self) -> u64 {
        self.0.starved()
    }
}

/// A memory window: a remote key bound to a byte range by [`Qp::bind_mw`].
/// Dropping it deallocates it (and invalidates a bound key).
pub struct Mw(pub(crate) Arc<dyn MwOps>);

impl Mw {
    pub fn rkey(&self) -> u32 {
        self.0.rkey()
    }
    pub fn kind(&self) -> MwKind {
        self.0.kind()
    }
}

impl Drop for Mw {
    fn drop(&mut self) {
        self.0.deallocate();
    }
}

/// A completion queue.
#[derive(Clone)]
pub struct Cq(pub(crate) Arc<dyn CqOps>);

impl Cq {
    /// Poll up to `out.len()` completions (drives progress under [`Progress::Manual`]).
    pub fn poll(&self, out: &mut [Wc]) -> Result<usize> {
        self.0.poll(out)
    }
    /// Request a channel event for the next completion.
    pub fn arm(&self, solicited_only: bool) -> Result<()> {
        self.0.arm(solicited_only)
    }
    /// Poll once; if nothing is there, arm, re-poll (closing the race), and
    /// block on `channel` until an event or `timeout`. Returns the number of
    /// completions written to `out` (0 on timeout).
    pub fn wait(
        &self,
        channel: &CompChannel,
        out: &mut [Wc],
        timeout: Option<Duration>,
    ) -> Result<usize> {
        let deadline = timeout.map(|t| std::time::Instant::now() + t);
        loop {
            let n = self.poll(out)?;
            if n > 0 {
                return Ok(n);
            }
            self.arm(false)?;
            let n = self.poll(out)?;
            if n > 0 {
                return Ok(n);
            }
            let left = match deadline {
                Some(d) => match d.checked_duration_since(std::time::Instant::now()) {
                    Some(l) if !l.is_zero() => Some(l),
                    _ => return Ok(0),
                },
                None => None,
            };
            channel.wait(left)?;
        }
    }
}

/// A completion channel: a pollable file descriptor for CQ events.
#[derive(Clone)]
pub struct CompChannel(pub(crate) Arc<dyn CompChannelOps>);

impl CompChannel {
    pub fn fd(&self) -> RawFd {
        self.0.fd()
    }
    pub fn wait(&self, timeout: Option<Duration>) -> Result<bool> {
        self.0.wait(timeout)
    }
    /// Without blocking, append to `out` the tags of the CQs made with
    /// [`Context::create_cq_tagged`] on this channel that fired since the
    /// last call (each CQ once per [`Cq::arm`]), and consume the event
    /// readiness of [`CompChannel::fd`]. Returns how many tags were
    /// appended. Use either this or [`CompChannel::wait`] on a channel:
    /// `wait` consumes events without reporting tags. Under
    /// [`Progress::Manual`] (soft) the fd is also readable when the
    /// context's sockets have input: call [`Context::progress`] first.
    pub fn take_fired(&self, out: &mut Vec<u64>) -> Result<usize> {
        self.0.take_fired(out)
    }
}

/// A connection-manager listener.
#[derive(Clone)]
pub struct Listener(pub(crate) Arc<dyn ListenerOps>);

impl Listener {
    pub fn local_addr(&self) -> SocketAddr {
        self.0.local_addr()
    }
    /// The next connection request (blocking up to `timeout`; None = forever).
    pub fn get_request(&self, timeout: Option<Duration>) -> Result<Option<ConnRequest>> {
        Ok(self.0.get_request(timeout)?.map(ConnRequest))
    }
    pub fn fd(&self) -> RawFd {
        self.0.fd()
    }
}

/// An incoming connection request: accept it with a QP, or reject it.
pub struct ConnRequest(pub(crate) Box<dyn ConnRequestOps>);

impl ConnRequest {
    pub fn peer_addr(&self) -> SocketAddr {
        self.0.peer_addr()
    }
    pub fn private_data(&self) -> &[u8] {
        self.0.private_data()
    }
    pub fn peer_ird_ord(&self) -> (u8, u8) {
        self.0.peer_ird_ord()
    }
    pub fn accept(self, init: &QpInit, params: &ConnParams) -> Result<Qp> {
        Ok(Qp(self.0.accept(init, params)?))
    }
    /// Accept with `recvs` already posted when the peer learns of the
    /// acceptance. Use it when the peer may send at once: on iWARP devices a
    /// Send that finds no posted receive is fatal (there is no RNR retry).
    pub fn accept_with_recvs(
        self,
        init: &QpInit,
        params: &ConnParams,
        recvs: &[RecvWr<'_>],
    ) -> Result<Qp> {
        Ok(Qp(self.0.accept_with_recvs(init, params, recvs)?))
    }
    pub fn reject(self, private_data: &[u8]) -> Result<()> {
        self.0.reject(private_data)
    }
}

/// A reliable-connected queue pair.
#[derive(Clone)]
pub struct Qp(pub(crate) Arc<dyn QpOps>);

impl Qp {
    pub fn qp_num(&self) -> u32 {
        self.0.qp_num()
    }
    pub fn state(&self) -> QpState {
        self.0.state()
    }
    pub fn negotiated(&self) -> Negotiated {
        self.0.negotiated()
    }
    pub fn local_addr(&self) -> SocketAddr {
        self.0.local_addr()
    }
    pub fn peer_addr(&self) -> SocketAddr {
        self.0.peer_addr()
    }
    pub fn post_send(&self, wrs: &[SendWr<'_>]) -> Result<(), PostError> {
        self.0.post_send(wrs)
    }
    pub fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<(), PostError> {
        self.0.post_recv(wrs)
    }
    /// Bind `mw` to a range of a region; returns the window's new remote key.
    pub fn bind_mw(&self, mw: &Mw, bind: &MwBind<'_>, wr_id: u64, signaled: bool) -> Result<u32> {
        self.0.bind_mw(mw, bind, wr_id, signaled)
    }
    /// Invalidate a window key locally.
    pub fn invalidate(&self, rkey: u32, wr_id: u64, signaled: bool) -> Result<()> {
        self.0.invalidate(rkey, wr_id, signaled)
    }
    pub fn disconnect(&self) -> Result<()> {
        self.0.disconnect()
    }
    pub fn set_error(&self) {
        self.0.set_error()
    }
    /// The iWARP Terminate this side's provider sent, if it refused the
    /// peer's traffic (a key, range or right it did not grant, or a
    /// protocol error), as `layer << 12 | etype << 8 | ecode`. `None` if it
    /// sent none, or if the provider does not tell (the verbs provider: the
    /// kernel or NIC does not report it).
    pub fn terminate_sent(&self) -> Option<TermError> {
        self.0
            .terminate_sent()
            .map(|c| TermError::from_vendor_err(c.into()))
    }
    /// What a device that does not tell its Terminates (the verbs
    /// provider) reported when it refused the peer's traffic and failed
    /// the QP: `IBV_EVENT_QP_ACCESS_ERR` or `IBV_EVENT_QP_REQ_ERR`. `None`
    /// if it reported neither within a few milliseconds (the event can
    /// follow the flushed completions; ask once, when the QP has failed),
    /// or the provider has [`Qp::terminate_sent`].
    pub fn device_refusal(&self) -> Option<DeviceRefusal> {
        self.0.device_refusal()
    }
}

/// A refusal of the peer's traffic, as a verbs device reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceRefusal {
    /// A local access violation: a key, range or right this side did not
    /// grant (`IBV_EVENT_QP_ACCESS_ERR`).
    Access,
    /// An invalid request: the peer broke the protocol
    /// (`IBV_EVENT_QP_REQ_ERR`).
    InvalidRequest,
}

/// iWARP STag helpers (RFC 5040 §2.1: a 24-bit index and an 8-bit key).
pub mod stag {
    /// The index part.
    pub fn index(stag: u32) -> u32 {
        stag >> 8
    }
    /// The consumer-owned key byte.
    pub fn key(stag: u32) -> u8 {
        stag as u8
    }
    pub fn make(index: u32, key: u8) -> u32 {
        (index << 8) | key as u32
    }
    /// The same index with the next key byte (what every re-bind issues).
    pub fn next_key(stag: u32) -> u32 {
        make(index(stag), key(stag).wrapping_add(1))
    }
}

#[cfg(test)]
mod view_tests {
    use super::*;

    struct NoKeys;
    impl ops::MrOps for NoKeys {
        fn lkey(&self) -> u32 {
            1
        }
        fn rkey(&self) -> u32 {
            2
        }
        fn deregister(&self) {}
    }

    /// A region over an owned buffer, with no provider behind it.
    fn mr(len: usize) -> Mr {
        let buf = Arc::new(RegBuf::new(len).expect("map"));
        Mr {
            ops: Arc::new(NoKeys),
            addr: buf.as_ptr(),
            len,
            _owner: Some(buf),
            local: RwLock::new(()),
        }
    }

    #[test]
    fn slice_bounds_are_errors() {
        let m = mr(64);
        assert!(m.slice(0, 64).is_ok());
        assert!(m.slice(64, 0).is_ok());
        assert!(m.slice(60, 4).is_ok());
        assert!(m.slice(61, 4).is_err(), "past the end");
        assert!(m.slice(65, 0).is_err(), "start past the end");
        assert!(m.slice(usize::MAX, 2).is_err(), "off + len overflows");
        assert!(m.slice(1, usize::MAX).is_err(), "off + len overflows");
        assert!(m.slice_mut(usize::MAX, usize::MAX).is_err());
        let v = m.slice(16, 16).expect("view");
        assert!(v.slice(8, 8).is_ok());
        assert!(v.slice(8, 9).is_err(), "sub-view past the view's end");
        assert!(v.slice(usize::MAX, 1).is_err());
        let mut b = [0u8; 17];
        assert!(v.read_at(0, &mut b).is_err());
        assert!(v.copy_to_slice(&mut b).is_err(), "length mismatch");
        assert!(v.load_u64(12).is_err(), "word past the view's end");
        // SAFETY: the region is local to this test: no provider, no keys,
        // nothing writes it concurrently.
        assert!(v.load_u32(2).is_err(), "misaligned");
        let w = m.slice_mut(16, 16).expect("view");
        assert!(w.write_at(15, &[1, 2]).is_err());
        assert!(w.fill(usize::MAX, 2, 0).is_err());
        assert!(w.store_u64(16, 0).is_err());
        assert!(w.copy_from_slice(&[0; 15]).is_err());
        assert!(m.load_u64(60).is_err());
        assert!(m.store_u32(usize::MAX - 1, 0).is_err());
    }

    #[test]
    fn views_copy_and_stay_in_range() {
        let m = mr(64);
        let w = m.slice_mut(8, 16).expect("view");
        w.fill(0, 16, 0xAA).expect("fill");
        w.write_at(2, &[1, 2, 3]).expect("write");
        w.store_u64(8, 0x0102_0304_0506_0708).expect("store");
        let mut all = [0u8; 64];
        m.read_at(0, &mut all).expect("read");
        assert_eq!(&all[..8], &[0; 8], "nothing before the view written");
        assert_eq!(&all[24..], &[0; 40], "nothing after the view written");
        assert_eq!(&all[8..16], &[0xAA, 0xAA, 1, 2, 3, 0xAA, 0xAA, 0xAA]);
        assert_eq!(&all[16..24], &0x0102_0304_0506_0708u64.to_le_bytes());
        assert_eq!(m.load_u64(16).expect("load"), 0x0102_0304_0506_0708);
        // SAFETY: the region is local to this test: nothing writes it
        // concurrently.
        assert_eq!(w.load_u32(8).expect("load"), 0x0506_0708);
        let v = w.as_view().slice(2, 3).expect("sub-view");
        let mut three = [0u8; 3];
        v.copy_to_slice(&mut three).expect("copy");
        assert_eq!(three, [1, 2, 3]);
        // SAFETY: the region is local to this test: no provider, no keys, no
        // other view writes it while the slice lives.
        assert_eq!(unsafe { v.as_slice() }, &[1, 2, 3]);
        let mut w2 = m.slice_mut(0, 4).expect("view");
        // SAFETY: as above; no other view of [0, 4) exists.
        unsafe { w2.as_mut_slice() }.copy_from_slice(&[9, 9, 9, 9]);
        // SAFETY: as above; the slice `w2` is no longer used.
        assert_eq!(m.load_u32(0).expect("load"), 0x0909_0909);
    }
}
