//! The server side of the RDMA phase.
//!
//! [`RdmaServer`] listens on one provider and implements
//! [`crate::server::RdmaPhase`]: `lwio serve` builds it, attaches it with
//! `Server::set_rdma_phase`, and `Server::run` calls [`RdmaPhase::serve`] on
//! a dedicated thread.
//!
//! Each accepted connection gets its own protection domain, CQ and
//! completion channel and runs one `lwio_proto::server::ServerConn` (with
//! the soft provider also its own context under manual progress, so its
//! reactor reads its socket). A fixed set of **reactor** threads
//! ([`super::reactor`], one per core by default) drives the connections:
//! each polls its connections for `busy_poll` after activity
//! (`busy_poll_polled` after a polled completion), then sleeps in
//! `epoll_wait` on their completion channels and on the eventfds that
//! storage workers and the control plane (credit balancing, shutdown) use
//! to wake them. Page-cache I/O runs on the reactor itself (`inline_io`: tmpfs plain
//! calls, else `RWF_NOWAIT`; writes straight from the receive buffer that
//! `ServerAction::FileWriteParts` lends); what would block runs on a small pool of
//! storage threads over the [`crate::fs::backend::Backend`] (io_uring where
//! available). Each round's RDMA Writes and sends are posted as one list.
//!
//! CANCEL (docs/protocol.md §5.9): a storage job carries a cancel flag that
//! `ServerAction::CancelIo` (and the connection closing) raises. A job still
//! queued is not started; one running on io_uring is stopped with
//! `IORING_OP_ASYNC_CANCEL` where the kernel can (`Backend::
//! submit_cancellable`). Inline page-cache I/O cannot be cancelled: it is
//! one non-blocking call, done before the next message is read; a request
//! whose CANCEL came in the same batch is withdrawn by `ServerConn` before
//! its FileRead/FileWrite reaches `dispatch`, so the inline path never
//! starts it.
//!
//! Memory: **the server never exposes memory**. Every region it registers
//! (receive buffers, send/inline buffers, read buffers) has `LOCAL_WRITE` at
//! most — no `REMOTE_*`, no `MW_BIND` — and the server allocates no windows.
//! [`ServerHandle::stats`] counts registrations by access so tests can assert
//! it; a peer's RDMA Write or Read aimed at the server finds no valid key and
//! the provider terminates the connection.
//!
//! Auth: the AUTH Key is resolved through the side channel's negotiate table
//! ([`ServerState::lookup_negotiate_key`]); each Key is accepted **once**
//! (consumed on first use) and only while fresh. The secret is
//! `derive_session_secret(session secret, Key)`. The side-channel session
//! found this way is the only session whose resume keys REGISTER accepts.

use std::collections::{HashMap, VecDeque};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::os::fd::{AsFd, AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lwio_proto::server::{
    CloseReason, DataSource, OpId, RecvBuffer, RecvId, ServerAction, ServerConfig, ServerConn,
    ServerHooks,
};
use lwio_proto::stats::RequestStats;
use lwio_proto::status::*;
use lwio_proto::transport::{CrcPolicy, Instance, WireTransport};
use lwio_proto::wire::auth::derive_session_secret;
use lwio_proto::wire::{Guid, SrvResumeKey, COMMON_HEADER_LEN};
use lwio_proto::NtStatus;
use lwio_rdma::{
    Access, CompChannel, ConnParams, Context, Cq, Mr, Pd, PdCensus, Qp, QpCap, QpInit, QpState,
    RecvWr, SendOp, SendWr, Wc, WcStatus,
};
use tracing::{debug, info, warn};

use super::pool::RecvPool;
use super::reactor::{Domain, DomainSpec, Keep, ReactorStats, Reactors, RingIo, RingJob};
use super::readbuf::{ReadBuffer, ReadSlab, ReadSlabStats, SLOTS as READ_SLOTS};
use super::{io_error_status, Waker};
use crate::fs::backend::Backend;
use crate::fs::table::{Denied, OpenFile, SessionId};
use crate::memobj::MemOp;
use crate::server::{RdmaPhase, ServerState, Shutdown};
use lwio_proto::wrid;
use lwio_rdma::ProviderChoice;

/// Configuration of the RDMA listener.
#[derive(Debug, Clone)]
pub struct RdmaServerOptions {
    pub provider: ProviderChoice,
    /// Device to open (None = the provider's first usable device). With
    /// several devices (e.g. rxe0 and siw0) name the one that owns `listen`.
    pub device: Option<String>,
    /// Where the RDMA listener binds (port 0 = ephemeral).
    pub listen: SocketAddr,
    /// Address advertised in negotiate responses when `listen` is a wildcard
    /// (the client falls back to the side channel's host when this is None).
    pub advertise: Option<IpAddr>,
    /// Protocol limits of each connection (`session_id` is replaced per
    /// connection by a random value).
    pub proto: ServerConfig,
    pub max_connections: usize,
    /// Live connections from one peer IP address (authenticated or not);
    /// further connection requests from it are rejected "busy".
    pub max_connections_per_host: usize,
    /// Registered memory (bytes) across all connections.
    pub max_memory: usize,
    /// Credits across all connections: the pool the balancer grants from.
    pub credit_budget: u32,
    /// Most credits one connection may reach through balancing.
    pub max_credits_per_conn: u16,
    /// Grant more credits to busy connections / reclaim from idle ones.
    pub auto_credits: bool,
    /// A connection idle this long gives its extra credits back.
    pub idle_reclaim: Duration,
    pub storage_threads: usize,
    /// Reactor threads driving the connections (0 = one per core).
    pub reactors: usize,
    /// Do page-cache file I/O on the reactor thread (tmpfs/ramfs: plain
    /// calls; elsewhere `RWF_NOWAIT`, falling back to a storage thread).
    pub inline_io: bool,
    /// A reactor polls a connection this long after its last activity before
    /// it sleeps.
    pub busy_poll: Duration,
    /// After completing a request its client polls for (status block), the
    /// reactor polls that connection this long before it sleeps.
    pub busy_poll_polled: Duration,
    /// Receive buffers from a shared receive pool per reactor and device
    /// (an SRQ) where the device has SRQs, sized by the credits granted;
    /// false: each connection registers its own.
    pub shared_receives: bool,
    /// Soft provider: give each connection its own context with manual
    /// progress (its thread reads its own socket; no engine thread).
    pub conn_contexts: bool,
    /// On shutdown, how long in-flight I/O may take before connections are cut.
    pub shutdown_grace: Duration,
    /// Seed 003's indicate window of each connection: bytes of Sends that
    /// arrive with no receive posted that the provider may hold before it
    /// stops reading that connection (`None`: the provider context's
    /// default). Providers without such buffering ignore it.
    pub recv_window: Option<usize>,
    pub rdma: lwio_rdma::Config,
}

impl Default for RdmaServerOptions {
    fn default() -> Self {
        RdmaServerOptions {
            provider: ProviderChoice::Soft,
            device: None,
            listen: SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 7421),
            advertise: None,
            // Write with immediate completes full reads without a status
            // message; `bind` keeps it only where the device has it.
            proto: ServerConfig {
                use_write_with_imm: true,
                max_message: DEFAULT_MAX_MESSAGE,
                ..ServerConfig::default()
            },
            max_connections: 4096,
            max_connections_per_host: 32,
            max_memory: 512 << 20,
            credit_budget: 4096,
            max_credits_per_conn: 128,
            auto_credits: true,
            idle_reclaim: Duration::from_secs(2),
            storage_threads: 4,
            reactors: 0,
            inline_io: true,
            busy_poll: Duration::from_micros(20),
            busy_poll_polled: Duration::from_micros(100),
            conn_contexts: true,
            shared_receives: true,
            shutdown_grace: Duration::from_secs(10),
            recv_window: Some(128 * 1024),
            rdma: lwio_rdma::Config::default(),
        }
    }
}

/// The largest fragmented message (docs/protocol.md §5.12) a server
/// reassembles by default.
pub const DEFAULT_MAX_MESSAGE: u32 = 16 << 20;

/// Server counters (for tests, `lwio stats` and logs).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ServerStats {
    pub connections: usize,
    pub accepted: u64,
    pub rejected: u64,
    /// Memory regions registered so far.
    pub mrs_registered: u64,
    /// Regions the RDMA provider registered on the server's protection
    /// domains, as it counts them (so the two counts below are read from
    /// where the server's memory really is).
    pub provider_mrs: u64,
    /// Regions the RDMA provider registered with a remote right on the
    /// server's protection domains, live and closed connections alike, as
    /// the provider counts them (`Pd::census`): must be 0.
    pub mrs_remote_access: u64,
    /// Memory windows the provider allocated on the server's domains, as it
    /// counts them: must be 0 (the server never exposes memory).
    pub mws_allocated: u64,
    /// Registrations with a remote right that the server asked for and
    /// refused itself (never happens by construction).
    pub mrs_remote_refused: u64,
    pub registered_bytes: usize,
    pub credits_granted: i64,
    pub auth_ok: u64,
    pub auth_failed: u64,
    pub closed_by_protocol: u64,
    /// Requests (or fragments) a client sent beyond the credits it was
    /// granted; each closes its connection (`CreditOverflow`).
    pub credit_overruns: u64,
    /// File I/Os done by reactors themselves (page-cache fast
    /// path, `inline_io`) rather than by storage threads.
    pub inline_ios: u64,
    /// Credit transactions a client left unanswered past the credit
    /// timeout (a slow client; its connection stays, docs/durability.md).
    pub slow_credit_replies: u64,
    /// Storage I/Os that ended cancelled (CANCEL, or the connection
    /// closing): still queued, or stopped while running on io_uring.
    pub ios_cancelled: u64,
    /// Jobs waiting for a storage thread now.
    pub storage_queue: usize,
    /// Reassembled fragmented messages (of two fragments or more) written
    /// to their files; WRITEs received whole are not counted here.
    pub fragment_writes: u64,
    /// Write calls those took: one `pwritev` each on the connection
    /// thread, or one batch submitted to the storage backend.
    pub fragment_write_calls: u64,
    /// Connections the server terminated, by the NTSTATUS of the reason.
    pub closed_by_status: std::collections::BTreeMap<NtStatus, u64>,
}

enum Control {
    CreditDelta(i32),
    Shutdown,
}

struct ConnEntry {
    /// Its state for metrics: a [`ConnState`].
    state: Arc<std::sync::atomic::AtomicU8>,
    ctl: mpsc::Sender<Control>,
    waker: Arc<Waker>,
    credits: Arc<AtomicUsize>,
    /// The connection's own protection domain, for its census (None: a
    /// reactor domain's, counted once in `Shared::domain_pds`).
    pd: Option<Pd>,
}

pub(super) struct Shared {
    opts: RdmaServerOptions,
    /// The protection domains of the reactors' receive pools (shared by
    /// their connections), for the census.
    pub(super) domain_pds: Mutex<Vec<Pd>>,
    /// The reactors' receive pools.
    pub(super) pools: Mutex<Vec<Arc<RecvPool>>>,
    /// The reactors' read-buffer slabs (for metrics).
    pub(super) read_slabs: Mutex<Vec<Arc<ReadSlab>>>,
    /// Each reactor's counters, by index.
    reactors: Mutex<Vec<Arc<ReactorStats>>>,
    conns: Mutex<HashMap<u64, ConnEntry>>,
    /// Live connections per peer IP address.
    per_host: Mutex<HashMap<IpAddr, usize>>,
    next_conn: AtomicU64,
    consumed_keys: Mutex<HashMap<Guid, Instant>>,
    pub(super) mem_used: AtomicUsize,
    credits_granted: AtomicI64,
    accepted: AtomicU64,
    rejected: AtomicU64,
    mrs: AtomicU64,
    mrs_remote: AtomicU64,
    /// The census of the domains of closed connections (added when their
    /// entry leaves `conns`, under its lock).
    closed_census: Mutex<PdCensus>,
    auth_ok: AtomicU64,
    auth_failed: AtomicU64,
    closed_by_protocol: AtomicU64,
    credit_overruns: AtomicU64,
    inline_ios: AtomicU64,
    slow_credit_replies: AtomicU64,
    ios_cancelled: AtomicU64,
    fragment_writes: AtomicU64,
    fragment_write_calls: AtomicU64,
    closed_by_status: Mutex<std::collections::BTreeMap<NtStatus, u64>>,
    /// Request counters of closed connections and, up to
    /// [`STATS_FLUSH`] behind, of live ones.
    requests: Mutex<RequestStats>,
    /// Jobs queued for the storage threads and not yet taken.
    storage_queued: Arc<AtomicUsize>,
}

/// How long a READ waits for a read buffer when the registered-memory
/// budget is spent before it is answered STATUS_INSUFFICIENT_RESOURCES.
const READ_BUFFER_WAIT: Duration = Duration::from_secs(2);

/// The smallest read region of its own a connection registers (reads up to
/// it take slab slots where there are slabs): what admission reserves for
/// one read, and the smallest region worth keeping as a spare.
const MIN_READ_REGION: usize = 64 << 10;

/// A connection's state, for metrics (published through an `AtomicU8`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
enum ConnState {
    Authenticating = 0,
    Serving = 1,
    Closing = 2,
}

impl ConnState {
    fn from_u8(v: u8) -> ConnState {
        match v {
            0 => ConnState::Authenticating,
            1 => ConnState::Serving,
            _ => ConnState::Closing,
        }
    }
}

/// How often a connection adds its request counters into the server's.
pub(super) const STATS_FLUSH: Duration = Duration::from_millis(50);

pub(super) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Shared {
    /// Nothing registered, accepted or counted yet.
    pub(super) fn new(opts: RdmaServerOptions) -> Shared {
        Shared {
            opts,
            domain_pds: Mutex::new(Vec::new()),
            pools: Mutex::new(Vec::new()),
            read_slabs: Mutex::new(Vec::new()),
            reactors: Mutex::new(Vec::new()),
            conns: Mutex::new(HashMap::new()),
            per_host: Mutex::new(HashMap::new()),
            next_conn: AtomicU64::new(1),
            consumed_keys: Mutex::new(HashMap::new()),
            mem_used: AtomicUsize::new(0),
            credits_granted: AtomicI64::new(0),
            accepted: AtomicU64::new(0),
            rejected: AtomicU64::new(0),
            mrs: AtomicU64::new(0),
            mrs_remote: AtomicU64::new(0),
            closed_census: Mutex::new(PdCensus::default()),
            auth_ok: AtomicU64::new(0),
            auth_failed: AtomicU64::new(0),
            closed_by_protocol: AtomicU64::new(0),
            credit_overruns: AtomicU64::new(0),
            inline_ios: AtomicU64::new(0),
            slow_credit_replies: AtomicU64::new(0),
            ios_cancelled: AtomicU64::new(0),
            fragment_writes: AtomicU64::new(0),
            fragment_write_calls: AtomicU64::new(0),
            closed_by_status: Mutex::new(Default::default()),
            requests: Mutex::new(RequestStats::default()),
            storage_queued: Arc::new(AtomicUsize::new(0)),
        }
    }

    /// Take a per-host slot for `ip`; false if the host is at its cap.
    fn host_acquire(&self, ip: IpAddr) -> bool {
        let mut m = lock(&self.per_host);
        let n = m.entry(ip).or_insert(0);
        if *n >= self.opts.max_connections_per_host {
            if *n == 0 {
                m.remove(&ip);
            }
            return false;
        }
        *n += 1;
        true
    }

    /// Give back a slot taken by [`Shared::host_acquire`].
    fn host_release(&self, ip: IpAddr) {
        let mut m = lock(&self.per_host);
        if let Some(n) = m.get_mut(&ip) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                m.remove(&ip);
            }
        }
    }
}

impl Shared {
    /// The counters of reactor `i` (created on first use).
    pub(super) fn reactor_stats(&self, i: usize) -> Arc<ReactorStats> {
        let mut v = lock(&self.reactors);
        while v.len() <= i {
            v.push(Arc::new(ReactorStats::default()));
        }
        v[i].clone()
    }

    /// A connection is gone: its entry leaves, its domain's census stays.
    fn retire(&self, id: u64) {
        let mut conns = lock(&self.conns);
        if let Some(e) = conns.remove(&id) {
            if let Some(pd) = &e.pd {
                *lock(&self.closed_census) += pd.census();
            }
        }
    }

    /// Register server memory: local access only, accounted against the budget.
    pub(super) fn register(&self, pd: &Pd, len: usize, access: Access) -> Result<Mr, NtStatus> {
        let remote = Access::REMOTE_READ | Access::REMOTE_WRITE | Access::MW_BIND;
        if access.intersects(remote) {
            // Never happens by construction; refuse rather than expose.
            self.mrs_remote.fetch_add(1, Ordering::Relaxed);
            warn!(
                ?access,
                "refusing to register server memory with remote access"
            );
            return Err(STATUS_ACCESS_DENIED);
        }
        let prev = self.mem_used.fetch_add(len, Ordering::AcqRel);
        if prev + len > self.opts.max_memory {
            self.mem_used.fetch_sub(len, Ordering::AcqRel);
            debug!(len, used = prev, "registered-memory budget exhausted");
            return Err(STATUS_INSUFFICIENT_RESOURCES);
        }
        match pd.alloc_mr(len, access) {
            Ok(mr) => {
                self.mrs.fetch_add(1, Ordering::Relaxed);
                Ok(mr)
            }
            Err(e) => {
                self.mem_used.fetch_sub(len, Ordering::AcqRel);
                warn!(
                    error = %e,
                    len,
                    "memory registration failed (siw charges registrations to the \
                     locked-memory limit even for root: check `ulimit -l`)"
                );
                Err(STATUS_INSUFFICIENT_RESOURCES)
            }
        }
    }

    /// Receive buffers of `slot` bytes the budget holds beyond what every
    /// connection still to come (up to `max_connections`) needs to be
    /// admitted idle (one receive buffer and one chunk of send slots),
    /// that floor taking at most half the budget: what credits beyond one
    /// may use. (On the soft provider an idle connection costs only a
    /// share of the pool's reserve, `RecvPool::idle_bytes`, and admission
    /// counts that; the floor here stays at a whole buffer so that a storm
    /// of connections gets small initial grants: with the reserve's share
    /// instead, the first few hundred of a thousand took 32 credits each
    /// and the budget ran out before idle reclaim gave them back.)
    pub(super) fn extra_buffers(&self, slot: usize) -> usize {
        let live = lock(&self.conns).len();
        let floor = (self.opts.max_connections.saturating_sub(live)
            * (slot + SEND_SLOT * SEND_CHUNK))
            .min(self.opts.max_memory / 2);
        self.opts
            .max_memory
            .saturating_sub(self.mem_used.load(Ordering::Relaxed))
            .saturating_sub(floor)
            / slot.max(1)
    }

    /// Memory a storage job still holds after its owner let it go: it is
    /// freed when the job ends; no longer counted.
    pub(super) fn forget(&self, len: usize) {
        self.mem_used.fetch_sub(len, Ordering::AcqRel);
    }

    pub(super) fn unregister(&self, mr: Mr) {
        self.mem_used.fetch_sub(mr.len(), Ordering::AcqRel);
        drop(mr);
    }

    /// Whether a negotiate Key was used by an AUTH already.
    fn key_used(&self, key: &Guid) -> bool {
        let g = lock(&self.consumed_keys);
        g.get(key).is_some_and(|exp| *exp > Instant::now())
    }

    /// One-time use of a negotiate Key.
    fn consume_key(&self, key: &Guid, ttl: Duration) -> bool {
        let mut g = lock(&self.consumed_keys);
        let now = Instant::now();
        g.retain(|_, exp| *exp > now);
        if g.contains_key(key) {
            return false;
        }
        g.insert(*key, now + ttl);
        true
    }
}

/// Control and statistics of a running [`RdmaServer`] (cheap to clone).
#[derive(Clone)]
pub struct ServerHandle(Arc<Shared>);

impl std::fmt::Debug for ServerHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ServerHandle({:?})", self.stats())
    }
}

impl ServerHandle {
    pub fn stats(&self) -> ServerStats {
        let s = &self.0;
        let (connections, census) = {
            let conns = lock(&s.conns);
            let mut c = *lock(&s.closed_census);
            for e in conns.values() {
                if let Some(pd) = &e.pd {
                    c += pd.census();
                }
            }
            for pd in lock(&s.domain_pds).iter() {
                c += pd.census();
            }
            (conns.len(), c)
        };
        ServerStats {
            connections,
            accepted: s.accepted.load(Ordering::Relaxed),
            rejected: s.rejected.load(Ordering::Relaxed),
            mrs_registered: s.mrs.load(Ordering::Relaxed),
            provider_mrs: census.mrs,
            mrs_remote_access: census.mrs_remote,
            mws_allocated: census.mws,
            mrs_remote_refused: s.mrs_remote.load(Ordering::Relaxed),
            registered_bytes: s.mem_used.load(Ordering::Relaxed),
            credits_granted: s.credits_granted.load(Ordering::Relaxed),
            auth_ok: s.auth_ok.load(Ordering::Relaxed),
            auth_failed: s.auth_failed.load(Ordering::Relaxed),
            closed_by_protocol: s.closed_by_protocol.load(Ordering::Relaxed),
            credit_overruns: s.credit_overruns.load(Ordering::Relaxed),
            inline_ios: s.inline_ios.load(Ordering::Relaxed),
            slow_credit_replies: s.slow_credit_replies.load(Ordering::Relaxed),
            ios_cancelled: s.ios_cancelled.load(Ordering::Relaxed),
            storage_queue: s.storage_queued.load(Ordering::Relaxed),
            fragment_writes: s.fragment_writes.load(Ordering::Relaxed),
            fragment_write_calls: s.fragment_write_calls.load(Ordering::Relaxed),
            closed_by_status: lock(&s.closed_by_status).clone(),
        }
    }

    /// The shared receive pools, summed.
    pub fn receive_pool(&self) -> super::pool::PoolStats {
        let mut t = super::pool::PoolStats::default();
        for p in lock(&self.0.pools).iter() {
            let s = p.stats();
            t.registered_bytes += s.registered_bytes;
            t.posted += s.posted;
            t.in_use += s.in_use;
            t.promised += s.promised;
            t.starved += s.starved;
        }
        t
    }

    /// The reactors' read-buffer slabs, summed.
    pub fn read_slabs(&self) -> ReadSlabStats {
        let mut t = ReadSlabStats::default();
        for s in lock(&self.0.read_slabs).iter() {
            let u = s.usage();
            t.registered_bytes += u.registered_bytes;
            t.in_use_bytes += u.in_use_bytes;
        }
        t
    }

    /// Each reactor's connections and busy time (nanoseconds).
    pub fn reactors(&self) -> Vec<(usize, u64)> {
        lock(&self.0.reactors)
            .iter()
            .map(|r| {
                (
                    r.connections.load(Ordering::Relaxed),
                    r.busy_ns.load(Ordering::Relaxed),
                )
            })
            .collect()
    }

    pub fn request_stats(&self) -> RequestStats {
        lock(&self.0.requests).clone()
    }

    /// Start a credit transaction of `delta` on every connection (those that
    /// cannot take it — not authenticated, transaction running, out of
    /// range — ignore it). For operators and tests.
    pub fn credit_delta_all(&self, delta: i32) -> usize {
        let g = lock(&self.0.conns);
        for c in g.values() {
            let _ = c.ctl.send(Control::CreditDelta(delta));
            c.waker.wake();
        }
        g.len()
    }

    /// Current credit limits of the live connections.
    /// Live connections by state: (authenticating, serving, closing).
    pub fn connection_states(&self) -> (usize, usize, usize) {
        let mut n = (0, 0, 0);
        for c in lock(&self.0.conns).values() {
            match ConnState::from_u8(c.state.load(Ordering::Relaxed)) {
                ConnState::Authenticating => n.0 += 1,
                ConnState::Serving => n.1 += 1,
                ConnState::Closing => n.2 += 1,
            }
        }
        n
    }

    pub fn connection_credits(&self) -> Vec<usize> {
        lock(&self.0.conns)
            .values()
            .map(|c| c.credits.load(Ordering::Relaxed))
            .collect()
    }
}

/// One listening provider instance: a soft listener or a verbs device.
struct Listening {
    ctx: Context,
    listener: lwio_rdma::Listener,
    /// What negotiate advertises for it.
    instance: Instance,
    /// Connection protocol settings for this device (Write with immediate
    /// where the device has it).
    proto: ServerConfig,
}

/// The RDMA listeners: implements [`RdmaPhase`]. One per provider instance
/// the options select (`auto`: every usable verbs device and the soft
/// provider), all serving the same exports and sharing one budget.
pub struct RdmaServer {
    listeners: Vec<Listening>,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for RdmaServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaServer")
            .field(
                "listeners",
                &self
                    .listeners
                    .iter()
                    .map(|l| l.describe())
                    .collect::<Vec<_>>(),
            )
            .finish()
    }
}

impl Listening {
    fn describe(&self) -> String {
        format!(
            "{} on {} ({} {})",
            self.instance.transport,
            self.listener.local_addr(),
            self.ctx.device().provider,
            self.ctx.device().name
        )
    }
}

/// The wire transport of a local device, as negotiate names it.
pub fn wire_transport(t: lwio_rdma::Transport) -> Option<WireTransport> {
    WireTransport::from_wire_name(t.wire_name()?)
}

impl RdmaServer {
    /// Open the providers the options select and start listening on each.
    ///
    /// * `soft`: the soft provider on `listen`;
    /// * `verbs`: the named `device`, or every usable verbs device;
    /// * `auto`: every usable verbs device, then the soft provider.
    ///
    /// The first listener takes `listen`'s port, the next ones the ports
    /// after it (port 0: each its own ephemeral port). A verbs device
    /// listens on `listen`'s address if it owns it (a specific address
    /// that it does not own skips it), else on its own first address.
    pub fn bind(mut opts: RdmaServerOptions) -> Result<RdmaServer, lwio_rdma::Error> {
        if opts.conn_contexts {
            // Connections get their own contexts (soft provider): the
            // listener's needs no engine thread either.
            opts.rdma.progress = lwio_rdma::Progress::Manual;
        }
        let mut listeners: Vec<Listening> = Vec::new();
        let mut last_err = None;
        let fragment_budget = lwio_proto::fragment::Budget::new(opts.max_memory / 2);
        for (provider, dev) in lwio_rdma::devices_for(opts.provider, opts.device.as_deref()) {
            if let Err(why) = &dev.usable {
                debug!(provider = provider.name(), device = %dev.name, %why, "device not usable; not listening");
                last_err = Some(lwio_rdma::Error::ProviderUnavailable(format!(
                    "{} {}: {why}",
                    provider.name(),
                    dev.name
                )));
                continue;
            }
            let Some(transport) = wire_transport(dev.transport) else {
                debug!(device = %dev.name, transport = %dev.transport, "unknown wire transport; not listening");
                continue;
            };
            let soft = provider.name() == "soft";
            let ip = if soft || !opts.listen.ip().is_unspecified() {
                if !soft && !dev.addresses.contains(&opts.listen.ip()) {
                    debug!(device = %dev.name, listen = %opts.listen, "device does not own the listen address; not listening");
                    continue;
                }
                opts.listen.ip()
            } else {
                match dev.addresses.first() {
                    Some(ip) => *ip,
                    None => {
                        debug!(device = %dev.name, "device has no IP address; not listening");
                        continue;
                    }
                }
            };
            let port = match opts.listen.port() {
                0 => 0,
                p => p.saturating_add(listeners.len() as u16),
            };
            let addr = SocketAddr::new(ip, port);
            let ctx = match provider.open(Some(&dev.name), &opts.rdma) {
                Ok(c) => c,
                Err(e) => {
                    warn!(provider = provider.name(), device = %dev.name, error = %e, "cannot open RDMA device");
                    last_err = Some(e);
                    continue;
                }
            };
            let listener = match ctx.listen(addr, 128) {
                Ok(l) => l,
                Err(e) => {
                    warn!(provider = provider.name(), device = %dev.name, %addr, error = %e, "cannot listen");
                    last_err = Some(e);
                    continue;
                }
            };
            let local = listener.local_addr();
            let mut adv = local;
            if local.ip().is_unspecified() {
                if let Some(ip) = opts.advertise {
                    adv.set_ip(ip);
                }
            }
            let mut instance = Instance::new(transport, adv);
            if transport == WireTransport::Iwarp && soft {
                instance.crc = match opts.rdma.mpa_crc {
                    lwio_rdma::CrcPolicy::Required => CrcPolicy::Required,
                    _ => CrcPolicy::Optional,
                };
            }
            let caps = ctx.device().caps.clone();
            let mut proto = opts.proto.clone();
            // Partial fragmented messages hold receive buffers that are
            // already registered; the budget bounds how much of the
            // server's registered memory they may pin at once.
            proto.fragment_budget = Some(fragment_budget.clone());
            // Write with immediate completes full reads without a status
            // message; only where this device has it.
            proto.use_write_with_imm =
                proto.use_write_with_imm && caps.as_ref().is_some_and(|c| c.write_with_imm);
            let l = Listening {
                ctx,
                listener,
                instance,
                proto,
            };
            info!(listener = %l.describe(), "RDMA listener");
            listeners.push(l);
        }
        if listeners.is_empty() {
            return Err(last_err.unwrap_or_else(|| {
                lwio_rdma::Error::ProviderUnavailable(format!(
                    "no usable RDMA device for provider {}",
                    opts.provider
                ))
            }));
        }
        let shared = Arc::new(Shared::new(opts));
        Ok(RdmaServer { listeners, shared })
    }

    /// The first listener's address.
    pub fn local_addr(&self) -> SocketAddr {
        self.listeners[0].listener.local_addr()
    }

    /// Every listener: its bound address, provider and device name, and
    /// what negotiate advertises for it.
    pub fn listeners(&self) -> Vec<(SocketAddr, &'static str, String, Instance)> {
        self.listeners
            .iter()
            .map(|l| {
                (
                    l.listener.local_addr(),
                    l.ctx.device().provider,
                    l.ctx.device().name.clone(),
                    l.instance,
                )
            })
            .collect()
    }

    pub fn handle(&self) -> ServerHandle {
        ServerHandle(self.shared.clone())
    }
}

impl RdmaPhase for RdmaServer {
    fn endpoints(&self) -> Vec<Instance> {
        self.listeners.iter().map(|l| l.instance).collect()
    }

    fn snapshot(&self) -> Option<crate::metrics::RdmaSnapshot> {
        let h = self.handle();
        Some(crate::metrics::RdmaSnapshot {
            stats: h.stats(),
            requests: h.request_stats(),
            credits: h.connection_credits(),
            credit_budget: self.shared.opts.credit_budget,
            max_connections: self.shared.opts.max_connections,
            reactors: h.reactors(),
            pool: h.receive_pool(),
            read_slabs: h.read_slabs(),
            states: h.connection_states(),
        })
    }

    fn serve(&self, state: Arc<ServerState>, shutdown: Shutdown) {
        let sh = &self.shared;
        // The storage threads do their file I/O themselves (they exist to
        // block on it): one pool, not one in front of the backend's.
        let pool = StoragePool::new(
            sh.opts.storage_threads,
            Arc::new(crate::fs::InlineBackend),
            sh.storage_queued.clone(),
        );
        let n = match sh.opts.reactors {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
            n => n,
        };
        let use_ring = state.backend.kind() == crate::fs::backend::BackendKind::IoUring;
        // Each listener's receives: a shared receive pool per reactor where
        // the device has SRQs (the soft provider always does).
        let specs: Vec<DomainSpec> = self
            .listeners
            .iter()
            .map(|l| {
                let soft = l.ctx.device().provider == "soft";
                let slot = (COMMON_HEADER_LEN + l.proto.max_recv_buffer_size as usize)
                    .next_multiple_of(64);
                let most = (sh.opts.max_memory / slot.max(1)).clamp(64, 1 << 20) as u32;
                let caps = l.ctx.device().caps.as_ref().map_or(0, |c| c.max_srq_wr);
                DomainSpec {
                    ctx: l.ctx.clone(),
                    sibling: soft && sh.opts.conn_contexts,
                    // `caps` is 0 on a verbs device without SRQs
                    // (max_srq 0): a receive region per connection.
                    srq_wr: if sh.opts.shared_receives {
                        most.min(caps)
                    } else {
                        0
                    },
                    slot,
                    overcommit: soft,
                }
            })
            .collect();
        let reactors = match Reactors::start(n, sh, use_ring, &specs) {
            Ok(r) => r,
            Err(e) => {
                warn!(error = %e, "cannot start the RDMA reactors; RDMA phase not serving");
                return;
            }
        };
        while !shutdown.is_triggered() {
            // One listener waits 100 ms; with several, each is polled in
            // turn with a short wait.
            let wait = Duration::from_millis(if self.listeners.len() == 1 { 100 } else { 20 });
            let mut got = None;
            for (li, l) in self.listeners.iter().enumerate() {
                match l.listener.get_request(Some(wait)) {
                    Ok(Some(r)) => {
                        got = Some((li, l, r));
                        break;
                    }
                    Ok(None) => {}
                    Err(e) => {
                        warn!(listener = %l.describe(), error = %e, "RDMA listener failed");
                        std::thread::sleep(Duration::from_millis(50));
                    }
                }
            }
            let Some((li, listening, req)) = got else {
                continue;
            };
            let peer = req.peer_addr();
            // The refusal's reason travels in the MPA reject's private data:
            // the client prints it (not "peer closed").
            let live = lock(&sh.conns).len();
            if live >= sh.opts.max_connections {
                warn!(%peer, limit = sh.opts.max_connections, "RDMA connection limit reached; rejecting");
                sh.rejected.fetch_add(1, Ordering::Relaxed);
                let why = format!(
                    "server busy: {live} connections (limit {})",
                    sh.opts.max_connections
                );
                let _ = req.reject(why.as_bytes());
                continue;
            }
            let ip = peer.ip();
            if !sh.host_acquire(ip) {
                warn!(%peer, limit = sh.opts.max_connections_per_host, "RDMA connection limit per host reached; rejecting");
                sh.rejected.fetch_add(1, Ordering::Relaxed);
                let why = format!(
                    "server busy: {} connections from {ip} (limit {} per host)",
                    sh.opts.max_connections_per_host, sh.opts.max_connections_per_host
                );
                let _ = req.reject(why.as_bytes());
                continue;
            }
            let id = sh.next_conn.fetch_add(1, Ordering::Relaxed);
            let (r, domain) = reactors.pick(li);
            let accepted = Conn::accept(
                id,
                listening,
                req,
                sh.clone(),
                state.clone(),
                pool.clone(),
                domain.as_deref(),
            );
            match accepted {
                Ok((conn, entry)) => {
                    sh.accepted.fetch_add(1, Ordering::Relaxed);
                    lock(&sh.conns).insert(id, entry);
                    reactors.assign(r, conn);
                }
                Err(e) => {
                    reactors.unpick(r);
                    warn!(%peer, error = %e, "cannot accept RDMA connection");
                    sh.rejected.fetch_add(1, Ordering::Relaxed);
                    sh.host_release(ip);
                }
            }
        }
        info!(
            connections = lock(&sh.conns).len(),
            "RDMA phase shutting down: draining connections"
        );
        for c in lock(&sh.conns).values() {
            let _ = c.ctl.send(Control::Shutdown);
            c.waker.wake();
        }
        let deadline = Instant::now() + sh.opts.shutdown_grace + Duration::from_secs(2);
        reactors.finish(deadline);
        info!("RDMA phase stopped");
    }
}

// ------------------------------------------------------------------ storage

enum JobKind {
    Read {
        buf: Arc<ReadBuffer>,
        len: usize,
    },
    Write {
        data: Vec<u8>,
    },
    /// A reassembled message's data: (offset, length) pieces of the
    /// receive region `mr`, in order (buffers kept for the message, not
    /// posted until the job's reply).
    WriteParts {
        iov: Vec<(Arc<Mr>, usize, usize)>,
    },
    /// A FLUSH: fsync, or fdatasync with `data_only`, of the file.
    Sync {
        data_only: bool,
    },
}

struct Job {
    op: OpId,
    /// Also what keeps the file "in use" (`OpenFileTable::in_use`) until
    /// this job has ended: a `Rekey` for another connection waits for it,
    /// so a write of a lost connection is applied or cancelled before any
    /// later write to the file can arrive (docs/reconnect.md, the ordering
    /// rule). Dropped only after the I/O returned, never before.
    file: crate::fs::fdcache::FdRef,
    offset: u64,
    align: u32,
    kind: JobKind,
    cancel: Arc<AtomicBool>,
    reply: mpsc::Sender<(OpId, Result<u32, NtStatus>)>,
    waker: Arc<Waker>,
}

#[derive(Clone)]
struct StoragePool {
    tx: mpsc::SyncSender<Job>,
    /// Jobs sent and not yet taken by a storage thread.
    queued: Arc<AtomicUsize>,
}

impl StoragePool {
    fn new(threads: usize, backend: Arc<dyn Backend>, queued: Arc<AtomicUsize>) -> StoragePool {
        let threads = threads.max(1);
        let (tx, rx) = mpsc::sync_channel::<Job>(threads * 256);
        let rx = Arc::new(Mutex::new(rx));
        for n in 0..threads {
            let rx = rx.clone();
            let backend = backend.clone();
            let taken = queued.clone();
            let r = std::thread::Builder::new()
                .name(format!("lwio-rdma-io-{n}"))
                .spawn(move || loop {
                    let job = match lock(&rx).recv() {
                        Ok(j) => j,
                        Err(_) => return,
                    };
                    taken.fetch_sub(1, Ordering::Relaxed);
                    let res = run_job(&*backend, &job);
                    // Drop the job (its Arc of the read buffer) before the
                    // reply: the reactor takes the buffer back
                    // with Arc::try_unwrap, and a clone still alive here
                    // made that fail and leak the registered-memory budget.
                    let (op, reply, waker) = (job.op, job.reply.clone(), job.waker.clone());
                    drop(job);
                    let _ = reply.send((op, res));
                    waker.wake();
                });
            if let Err(e) = r {
                warn!(error = %e, "cannot start a storage thread");
            }
        }
        StoragePool { tx, queued }
    }
}

/// Test hook, 0 unless a test sets it with [`slow_next_storage_write_for_tests`]
/// (built only with the `testkit` feature).
#[cfg(any(test, feature = "testkit"))]
static SLOW_NEXT_WRITE_MS: AtomicU64 = AtomicU64::new(0);

/// The slowing the test hook asks of the next write, in ms (taken, when
/// `take`); always 0 in a server built without the `testkit` feature.
fn slow_next_write_ms(take: bool) -> u64 {
    #[cfg(any(test, feature = "testkit"))]
    return if take {
        SLOW_NEXT_WRITE_MS.swap(0, Ordering::Relaxed)
    } else {
        SLOW_NEXT_WRITE_MS.load(Ordering::Relaxed)
    };
    #[cfg(not(any(test, feature = "testkit")))]
    {
        let _ = take;
        0
    }
}

/// **Tests only.** Make the next write a storage thread of this process
/// starts take `d` longer and ignore a cancel raised meanwhile: a device
/// whose write, once started, cannot be stopped (the thread-pool backend;
/// an io_uring write already running in the kernel). End-to-end tests use
/// it to have a lost connection's write still running when the client
/// comes back. Nothing outside tests calls it; there is no configuration
/// for it.
#[doc(hidden)]
#[cfg(any(test, feature = "testkit"))]
pub fn slow_next_storage_write_for_tests(d: Duration) {
    SLOW_NEXT_WRITE_MS.store(
        u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1),
        Ordering::Relaxed,
    );
}

/// **Tests only.** Whether the write [`slow_next_storage_write_for_tests`]
/// slows has started.
#[doc(hidden)]
#[cfg(any(test, feature = "testkit"))]
pub fn slow_storage_write_started_for_tests() -> bool {
    SLOW_NEXT_WRITE_MS.load(Ordering::Relaxed) == 0
}

/// A storage job as ring pieces: (iovecs, write, what keeps them alive).
/// `O_DIRECT` (`align` > 1): a write whose bytes are not aligned in memory
/// goes from an aligned copy; offsets and lengths must be aligned already.
fn ring_job(
    offset: u64,
    align: u32,
    kind: JobKind,
) -> Result<(Vec<libc::iovec>, bool, Keep), NtStatus> {
    let bad = |_| STATUS_INVALID_PARAMETER;
    let iov = |addr: usize, len: usize| libc::iovec {
        iov_base: addr as *mut libc::c_void,
        iov_len: len,
    };
    let a = align.max(1) as usize;
    // An aligned copy of `len` bytes, filled by `fill`.
    let bounce = |len: usize, fill: &mut dyn FnMut(&mut [u8])| {
        let mut b = vec![0u8; len + a];
        let pad = b.as_ptr().align_offset(a).min(a);
        fill(&mut b[pad..pad + len]);
        let at = b.as_ptr() as usize + pad;
        (at, b)
    };
    match kind {
        // `dispatch` gives syncs to the pool.
        JobKind::Sync { .. } => Err(STATUS_INVALID_DEVICE_REQUEST),
        JobKind::Read { buf, len } => {
            let len = len.min(buf.len());
            crate::fs::backend::check_alignment(align, offset, buf.addr() as usize, len)
                .map_err(bad)?;
            Ok((vec![iov(buf.addr() as usize, len)], false, Keep::Mr(buf)))
        }
        JobKind::Write { data } => {
            let len = data.len();
            if a > 1 && !(data.as_ptr() as usize).is_multiple_of(a) {
                let (at, b) = bounce(len, &mut |d| d.copy_from_slice(&data));
                crate::fs::backend::check_alignment(align, offset, at, len).map_err(bad)?;
                return Ok((vec![iov(at, len)], true, Keep::Bytes(b)));
            }
            let at = data.as_ptr() as usize;
            crate::fs::backend::check_alignment(align, offset, at, len).map_err(bad)?;
            Ok((vec![iov(at, len)], true, Keep::Bytes(data)))
        }
        JobKind::WriteParts { iov: parts } => {
            for (mr, at, len) in &parts {
                if at.checked_add(*len).is_none_or(|e| e > mr.len()) {
                    return Err(STATUS_INVALID_PARAMETER);
                }
            }
            if a > 1 {
                let total: usize = parts.iter().map(|p| p.2).sum();
                let (at, b) = bounce(total, &mut |d| {
                    let mut o = 0;
                    for (mr, at, len) in &parts {
                        // Pieces checked inside their regions above.
                        let _ = mr.read_at(*at, &mut d[o..o + len]);
                        o += len;
                    }
                });
                crate::fs::backend::check_alignment(align, offset, at, total).map_err(bad)?;
                return Ok((vec![iov(at, total)], true, Keep::Bytes(b)));
            }
            let v = parts
                .iter()
                .map(|(mr, at, len)| iov(mr.addr() as usize + at, *len))
                .collect();
            let mut regions: Vec<Arc<Mr>> = Vec::new();
            for (mr, _, _) in parts {
                if !regions.iter().any(|r| Arc::ptr_eq(r, &mr)) {
                    regions.push(mr);
                }
            }
            Ok((v, true, Keep::Mrs(regions)))
        }
    }
}

fn run_job(backend: &dyn Backend, job: &Job) -> Result<u32, NtStatus> {
    if job.cancel.load(Ordering::Acquire) {
        return Err(STATUS_CANCELLED);
    }
    let never = AtomicBool::new(false);
    let slow = if matches!(job.kind, JobKind::Read { .. } | JobKind::Sync { .. }) {
        0
    } else {
        slow_next_write_ms(true)
    };
    let cancel = if slow > 0 {
        // Started: from here on the write runs to its end (test hook).
        std::thread::sleep(Duration::from_millis(slow));
        &never
    } else {
        &*job.cancel
    };
    let fd = job.file.as_fd();
    let r = match &job.kind {
        JobKind::Sync { data_only } => {
            let r = if *data_only {
                rustix::fs::fdatasync(fd)
            } else {
                rustix::fs::fsync(fd)
            };
            Some(r.map(|()| 0).map_err(std::io::Error::from))
        }
        JobKind::Read { buf, len } => {
            let len = (*len).min(buf.len());
            let Ok(mut view) = buf.slice_mut(0, len) else {
                return Err(STATUS_INVALID_PARAMETER);
            };
            // SAFETY: `buf` belongs to this op alone. A region of its own
            // goes back to the spare pool only once its op is released, its
            // RDMA Writes have completed and it is no longer at storage
            // (`maybe_free_buf`), and `Arc::try_unwrap` proves this job's
            // reference is gone by then; a slab's slot goes back to its slab
            // only when the last `Arc<ReadBuffer>` (this job holds one) is
            // dropped, and other slots of its chunk are disjoint byte ranges
            // (`ReadBuffer::slice_mut` is bounded to this slot's). It is
            // registered LOCAL_WRITE only, so no remote key reaches it and no
            // receive is posted into it; the reactor posts an RDMA Write from
            // it only after this job's reply arrives (and did not do the I/O
            // inline: an op goes either inline or to the pool). So this slice
            // over [0, len) of the buffer is the only access to those bytes
            // while it lives; the Arc keeps the chunk's Mr, and its mapping,
            // alive.
            let slice = unsafe { view.as_mut_slice() };
            let mut ops =
                [crate::fs::backend::IoOp::read(fd, job.offset, slice).aligned(job.align)];
            backend.submit_cancellable(&mut ops, cancel).pop()
        }
        JobKind::Write { data } => {
            // O_DIRECT needs an aligned memory address too. The request's
            // payload is wherever the receive put it, so copy it into an
            // aligned buffer (offset and length alignment are the client's
            // business: unaligned ones fail with INVALID_PARAMETER).
            let a = job.align.max(1) as usize;
            let mut bounce = Vec::new();
            let data: &[u8] = if a > 1 && !(data.as_ptr() as usize).is_multiple_of(a) {
                bounce.resize(data.len() + a, 0u8);
                let pad = bounce.as_ptr().align_offset(a).min(a);
                bounce[pad..pad + data.len()].copy_from_slice(data);
                &bounce[pad..pad + data.len()]
            } else {
                data
            };
            let mut ops =
                [crate::fs::backend::IoOp::write(fd, job.offset, data).aligned(job.align)];
            backend.submit_cancellable(&mut ops, cancel).pop()
        }
        JobKind::WriteParts { iov } => {
            let mut slices: Vec<&[u8]> = Vec::with_capacity(iov.len());
            for (mr, at, len) in iov {
                let (at, len, base) = (*at, *len, mr.addr() as usize);
                if at.checked_add(len).is_none_or(|e| e > mr.len()) {
                    return Err(STATUS_INVALID_PARAMETER);
                }
                // SAFETY: the piece lies in the receive region (checked),
                // in a buffer kept for this message: the reactor
                // reposts it only after this job's reply (`storage_done`),
                // and the region is LOCAL_WRITE only, so neither the
                // provider nor a peer writes it while this shared slice
                // lives; the job's Arc keeps the region mapped even if the
                // connection is torn down meanwhile.
                slices.push(unsafe { std::slice::from_raw_parts((base + at) as *const u8, len) });
            }
            let a = job.align.max(1) as usize;
            if a > 1 {
                // O_DIRECT: one aligned copy, then one write.
                let total: usize = slices.iter().map(|s| s.len()).sum();
                let mut bounce = vec![0u8; total + a];
                let pad = bounce.as_ptr().align_offset(a).min(a);
                let mut o = pad;
                for sl in &slices {
                    bounce[o..o + sl.len()].copy_from_slice(sl);
                    o += sl.len();
                }
                let mut ops =
                    [
                        crate::fs::backend::IoOp::write(fd, job.offset, &bounce[pad..pad + total])
                            .aligned(job.align),
                    ];
                backend.submit_cancellable(&mut ops, cancel).pop()
            } else {
                // One batch: the pieces at consecutive offsets.
                let mut off = job.offset;
                let mut ops: Vec<_> = slices
                    .iter()
                    .map(|sl| {
                        let op = crate::fs::backend::IoOp::write(fd, off, sl);
                        off += sl.len() as u64;
                        op
                    })
                    .collect();
                let want: Vec<usize> = slices.iter().map(|s| s.len()).collect();
                let rs = backend.submit_cancellable(&mut ops, cancel);
                let mut done = 0usize;
                let mut err = None;
                for (r, w) in rs.into_iter().zip(want) {
                    match r {
                        Ok(n) => {
                            done += n;
                            if n < w {
                                break;
                            }
                        }
                        Err(e) => {
                            err = Some(e);
                            break;
                        }
                    }
                }
                // As one write: a failure (ENOSPC after some pieces went
                // in) is the answer, not the bytes before it.
                match err {
                    Some(e) => Some(Err(e)),
                    None => Some(Ok(done)),
                }
            }
        }
    };
    match r {
        Some(Ok(n)) => Ok(u32::try_from(n).unwrap_or(u32::MAX)),
        Some(Err(e)) => {
            debug!(op = job.op, error = %e, "storage operation failed");
            Err(io_error_status(&e))
        }
        None => Err(super::STATUS_UNEXPECTED_IO_ERROR),
    }
}

/// The reactor's fast path for one file and direction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum InlineMode {
    /// tmpfs/ramfs: plain calls (memory copies, never a device wait).
    Memory,
    /// `RWF_NOWAIT`, falling back to the pool on `EAGAIN`.
    NoWait,
    /// Always the pool (`RWF_NOWAIT` refused).
    Off,
}

fn inline_mode_of(fd: std::os::fd::RawFd) -> InlineMode {
    const TMPFS_MAGIC: i64 = 0x0102_1994;
    const RAMFS_MAGIC: i64 = 0x8584_58f6;
    // SAFETY: statfs is plain old data; all-zero bytes are a valid value.
    let mut sfs: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: fstatfs writes into the struct we own; `fd` is an open file.
    if unsafe { libc::fstatfs(fd, &mut sfs) } == 0 {
        #[allow(clippy::unnecessary_cast)]
        let t = sfs.f_type as i64;
        if t == TMPFS_MAGIC || t == RAMFS_MAGIC {
            return InlineMode::Memory;
        }
    }
    InlineMode::NoWait
}

/// The fast path's system call (see `Conn::try_inline`): `Some(n)` when
/// all `len` bytes moved without blocking; `None` = use the storage pool.
///
/// # Safety
/// For a read, `ptr..ptr+len` must be valid for writes and not accessed by
/// anything else during the call; for a write, valid for reads.
unsafe fn inline_io(
    cache: &mut HashMap<(u64, bool), InlineMode>,
    f: &OpenFile,
    fd: RawFd,
    offset: u64,
    ptr: *mut u8,
    len: usize,
    write: bool,
) -> Option<u32> {
    let iov = [libc::iovec {
        iov_base: ptr.cast(),
        iov_len: len,
    }];
    // SAFETY: the caller's contract, for the one piece.
    unsafe { inline_io_iov(cache, f, fd, offset, &iov, len, write) }
}

/// [`inline_io`] of a write gathered from several pieces: one `pwritev2`.
///
/// # Safety
/// Every `iov` piece must be valid for reads during the call; `total` is
/// their summed length.
unsafe fn inline_io_vec(
    cache: &mut HashMap<(u64, bool), InlineMode>,
    f: &OpenFile,
    fd: RawFd,
    offset: u64,
    iov: &[libc::iovec],
    total: usize,
) -> Option<u32> {
    // SAFETY: the caller's contract.
    unsafe { inline_io_iov(cache, f, fd, offset, iov, total, true) }
}

/// # Safety
/// As [`inline_io`], for every piece of `iov` (`total` bytes in all);
/// `fd` is `f`'s descriptor, held open across the call.
unsafe fn inline_io_iov(
    cache: &mut HashMap<(u64, bool), InlineMode>,
    f: &OpenFile,
    fd: RawFd,
    offset: u64,
    iov: &[libc::iovec],
    len: usize,
    write: bool,
) -> Option<u32> {
    if f.direct || len == 0 || iov.len() > 1024 {
        return None;
    }
    let n = u32::try_from(len).ok()?;
    let mode = *cache
        .entry((f.handle, write))
        .or_insert_with(|| inline_mode_of(fd));
    let flags = match mode {
        InlineMode::Off => return None,
        InlineMode::Memory => 0,
        InlineMode::NoWait => libc::RWF_NOWAIT,
    };
    let off = libc::off_t::try_from(offset).ok()?;
    let cnt = iov.len() as libc::c_int;
    // SAFETY: the caller vouches for every piece of `iov`, which lives
    // across the call; `fd` is an open file.
    let r = unsafe {
        if write {
            libc::pwritev2(fd, iov.as_ptr(), cnt, off, flags)
        } else {
            libc::preadv2(fd, iov.as_ptr(), cnt, off, flags)
        }
    };
    if r < 0 {
        if std::io::Error::last_os_error().raw_os_error() == Some(libc::EOPNOTSUPP) {
            // No RWF_NOWAIT here: always the pool for this file.
            cache.insert((f.handle, write), InlineMode::Off);
        }
        // Real errors (and EAGAIN) are left to the pool's attempt, which
        // reports them.
        return None;
    }
    (r as usize == len).then_some(n)
}

/// The status of an I/O whose file's descriptor could not be opened again
/// (docs/descriptor-cache.md): out of descriptors is a resource shortage;
/// anything else (removed, replaced, no longer permitted) means the open
/// file is gone: STATUS_FILE_DELETED, which clients map to ESTALE.
fn reopen_status(f: &OpenFile, e: &lwio_side::error::Error) -> NtStatus {
    debug!(export = %f.export, path = %f.path, "cannot reopen an open file: {}", e.message);
    if e.code == lwio_side::error::ErrorCode::TooManyOpenFiles {
        STATUS_INSUFFICIENT_RESOURCES
    } else {
        STATUS_FILE_DELETED
    }
}

// --------------------------------------------------------------- connection

/// Per-connection hook state: the side-channel session found at AUTH and
/// the files REGISTER opened.
struct Hooks<'a> {
    state: &'a ServerState,
    shared: &'a Shared,
    session: &'a mut Option<SessionId>,
    files: &'a mut HashMap<u64, OpenFile>,
    next_file: &'a mut u64,
    peer: SocketAddr,
    /// Memory objects this connection may carry (docs/memory-objects.md).
    mem: &'a mut super::memobj::PubSide,
}

impl ServerHooks for Hooks<'_> {
    // The Key is looked up here and used up only once the AUTH's signature
    // verified (`auth_verified`): a forged AUTH naming a Key it saw (or
    // guessed) must not burn it for the client that negotiated it.
    fn session_secret(&mut self, key: &Guid) -> Option<Vec<u8>> {
        let Some(n) = self.state.lookup_negotiate_key(key) else {
            info!(peer = %self.peer, %key, "AUTH with an unknown or expired negotiate key");
            return None;
        };
        if self.shared.key_used(key) {
            warn!(peer = %self.peer, %key, "AUTH with an already used negotiate key");
            return None;
        }
        Some(derive_session_secret(&n.session_secret.0, key).to_vec())
    }

    fn auth_verified(&mut self, key: &Guid) -> bool {
        let Some(n) = self.state.lookup_negotiate_key(key) else {
            info!(peer = %self.peer, %key, "negotiate key gone during its AUTH");
            return false;
        };
        let ttl = n.expires.saturating_duration_since(Instant::now()) + Duration::from_secs(1);
        if !self.shared.consume_key(key, ttl) {
            warn!(peer = %self.peer, %key, "AUTH with an already used negotiate key");
            return false;
        }
        *self.session = Some(n.session);
        self.mem.presented(*key, n.session);
        true
    }

    fn open_file(&mut self, rk: &SrvResumeKey, _flags: u32) -> Result<u64, NtStatus> {
        let Some(session) = *self.session else {
            return Err(STATUS_ACCESS_DENIED);
        };
        match self.state.lookup_resume_key(rk, session) {
            Ok(f) => {
                let h = *self.next_file;
                *self.next_file += 1;
                debug!(peer = %self.peer, session, path = %f.path, file = h, "REGISTER");
                self.files.insert(h, f);
                Ok(h)
            }
            Err(d) => {
                info!(peer = %self.peer, session, reason = %d, "REGISTER refused");
                Err(match d {
                    Denied::Unknown => STATUS_INVALID_HANDLE,
                    Denied::Expired | Denied::WrongSession => STATUS_ACCESS_DENIED,
                })
            }
        }
    }
}

struct ReadBuf {
    buf: Arc<ReadBuffer>,
    writes_inflight: u32,
    released: bool,
    at_storage: bool,
}

const SEND_SLOT: usize = 256;
/// Send slots registered at a time: a connection starts with one chunk
/// (4 KiB) and registers more only when its sends outrun it.
const SEND_CHUNK: usize = 16;

/// Where a connection's receive buffers come from.
enum RecvSrc {
    /// Its own region, posted on its own QP (devices without SRQs).
    Own(Arc<Mr>),
    /// Its reactor's shared receive pool on this device.
    Pool(Arc<RecvPool>),
    /// Torn down.
    Gone,
}

impl RecvSrc {
    /// Release an own region that was never used (a failed accept).
    fn free(self, shared: &Shared) {
        if let RecvSrc::Own(m) = self {
            if let Ok(m) = Arc::try_unwrap(m) {
                shared.unregister(m);
            }
        }
    }
}

pub(super) struct Conn {
    id: u64,
    peer: SocketAddr,
    qp: Qp,
    cq: Cq,
    chan: CompChannel,
    pd: Pd,
    /// Where its receives come from.
    recv: RecvSrc,
    /// Pool mode: the credits it promised the pool, and the buffers it
    /// holds (taken, not yet handed back).
    backed: usize,
    held: std::collections::HashSet<RecvId>,
    /// Receive buffers a storage job writes from (a reassembled message's,
    /// a WRITE's), reposted when it completes.
    frag_bufs: HashMap<OpId, Vec<RecvId>>,
    recv_slot: usize,
    /// Its send slots, in chunks of [`SEND_CHUNK`].
    send_mrs: Vec<Mr>,
    send_free: Vec<u32>,
    sq_depth: usize,
    sq_inflight: usize,
    deferred: VecDeque<ServerAction>,
    read_bufs: HashMap<OpId, ReadBuf>,
    /// Regions of its own kept for its next reads (larger than a slot).
    spare_bufs: Vec<Mr>,
    /// Its reactor's read slots on this device, by size (None: no reactor
    /// domain).
    reads: Option<[Arc<ReadSlab>; 2]>,
    cancels: HashMap<OpId, Arc<AtomicBool>>,
    /// Memory-object I/O this connection carries for its publisher.
    mem: super::memobj::PubSide,
    files: HashMap<u64, OpenFile>,
    next_file: u64,
    session: Option<SessionId>,
    sconn: ServerConn,
    shared: Arc<Shared>,
    state: Arc<ServerState>,
    pool: StoragePool,
    done_tx: mpsc::Sender<(OpId, Result<u32, NtStatus>)>,
    done_rx: mpsc::Receiver<(OpId, Result<u32, NtStatus>)>,
    ctl_rx: mpsc::Receiver<Control>,
    waker: Arc<Waker>,
    credits_pub: Arc<AtomicUsize>,
    state_pub: Arc<std::sync::atomic::AtomicU8>,
    credits_reported: i64,
    base_credits: u16,
    /// The most credits the client said it can use (learned from a CREDIT
    /// reply that reported some unused): never granted beyond.
    client_cap: Option<u16>,
    last_io: Instant,
    closing: Option<Instant>,
    draining: Option<Instant>,
    dead: bool,
    /// How the fast path treats each (file handle, write).
    inline_mode: HashMap<(u64, bool), InlineMode>,
    /// Its place on its reactor, and the reactor's io_uring (None: file
    /// I/O that would block goes to the storage pool).
    slot: usize,
    rio: Option<Arc<Mutex<RingIo>>>,
    /// File I/Os on the ring: op → ring id.
    ring_ops: HashMap<OpId, u64>,
    /// READs waiting for the registered-memory budget: since when.
    read_waits: HashMap<OpId, Instant>,
    /// Reactor bookkeeping: last balancing round, last I/O work, last
    /// polled completion (and the count it saw).
    last_tick: Instant,
    last_busy: Instant,
    last_polled: Instant,
    last_polled_count: u64,
    /// Data requests seen at the last balancing round.
    requests_balanced: u64,
    /// Work requests of this round of actions, posted together by
    /// `flush_sq`: (wr_id, operation, SGE).
    sq_pending: Vec<(u64, SendOp, Option<lwio_rdma::Sge>)>,
    /// The connection's own soft context (declared last: dropped after the
    /// QP, CQ and PD that live in it).
    _ctx: Option<Context>,
}

impl Conn {
    fn accept(
        id: u64,
        listening: &Listening,
        req: lwio_rdma::ConnRequest,
        shared: Arc<Shared>,
        state: Arc<ServerState>,
        pool: StoragePool,
        domain: Option<&Domain>,
    ) -> Result<(Conn, ConnEntry), lwio_rdma::Error> {
        let peer = req.peer_addr();
        let mut cfg = listening.proto.clone();
        cfg.session_id = crate::fs::table::random_u64() | 1;
        let nrecv = usize::from(shared.opts.max_credits_per_conn.max(cfg.max_credits)) + 2;
        let sq_depth = 1024usize;
        let recv_slot =
            (COMMON_HEADER_LEN + cfg.max_recv_buffer_size as usize).next_multiple_of(64);
        let nomem = |what: &str| {
            lwio_rdma::Error::ResourceExhausted(format!("{what}: registered-memory budget"))
        };
        let out_of_memory = |req: lwio_rdma::ConnRequest| {
            let why = format!(
                "out of receive memory: {} MiB registered (limit {} MiB)",
                shared.mem_used.load(Ordering::Relaxed).div_ceil(1 << 20),
                shared.opts.max_memory >> 20
            );
            let _ = req.reject(why.as_bytes());
        };
        // Pool mode (the reactor's domain on this device): the receives
        // come from the reactor's shared receive queue; this connection
        // promises the pool the credits it grants, from one (AUTH) up to
        // the initial grant, as far as the budget allows.
        // Admitted only with room for its buffers and one read buffer (a
        // connection that could never read is refused at the door).
        let idle = domain.map_or(recv_slot, |d| d.pool.idle_bytes());
        let need = idle + SEND_SLOT * SEND_CHUNK + MIN_READ_REGION;
        if domain.is_some()
            && shared.mem_used.load(Ordering::Relaxed) + need > shared.opts.max_memory
        {
            out_of_memory(req);
            return Err(nomem("receive buffers"));
        }
        let backed = match domain {
            Some(d) => {
                // The initial grant shrinks as the budget fills (one,
                // plus a sixteenth of the receive buffers the budget has
                // beyond every possible connection's one): a storm of new
                // connections is admitted with fewer credits each rather
                // than refused, and the balancer grants more to the ones
                // that turn busy.
                let extra = shared.extra_buffers(recv_slot) / 16;
                let want = usize::from(cfg.max_credits).min(1 + extra);
                let got = d.pool.reserve(want, 1, true);
                if got == 0 {
                    out_of_memory(req);
                    return Err(nomem("receive buffers"));
                }
                cfg.max_credits = u16::try_from(got).unwrap_or(u16::MAX);
                got
            }
            None => 0,
        };
        // Without a domain, with a provider that has a progress thread
        // (soft): this connection's own context, driven by its reactor
        // alone (the QP joins it at accept).
        let own_ctx = if domain.is_none() && shared.opts.conn_contexts {
            listening.ctx.open_manual_sibling()?
        } else {
            None
        };
        let (ctx, pd, chan) = match domain {
            Some(d) => (&d.ctx, d.pd.clone(), d.chan.clone()),
            None => {
                let ctx = own_ctx.as_ref().unwrap_or(&listening.ctx);
                (ctx, ctx.alloc_pd()?, ctx.create_comp_channel()?)
            }
        };
        let depth = (nrecv + sq_depth + 16) as u32;
        let cq = match domain {
            Some(_) => ctx.create_cq_tagged(depth, &chan, id),
            None => ctx.create_cq(depth, Some(&chan)),
        };
        let release = |backed: usize| {
            if let Some(d) = domain {
                d.pool.release(backed, true);
            }
        };
        let cq = match cq {
            Ok(c) => c,
            Err(e) => {
                release(backed);
                return Err(e);
            }
        };
        let recv = match domain {
            Some(d) => RecvSrc::Pool(d.pool.clone()),
            None => match shared.register(&pd, recv_slot * nrecv, Access::LOCAL_WRITE) {
                Ok(m) => RecvSrc::Own(Arc::new(m)),
                Err(_) => {
                    out_of_memory(req);
                    return Err(nomem("receive buffers"));
                }
            },
        };
        let send_mr = match shared.register(&pd, SEND_SLOT * SEND_CHUNK, Access::empty()) {
            Ok(m) => m,
            Err(_) => {
                recv.free(&shared);
                release(backed);
                out_of_memory(req);
                return Err(nomem("send buffers"));
            }
        };
        let init = QpInit {
            pd: pd.clone(),
            send_cq: cq.clone(),
            recv_cq: cq.clone(),
            cap: QpCap {
                max_send_wr: sq_depth as u32,
                max_recv_wr: if domain.is_some() { 0 } else { nrecv as u32 },
                max_send_sge: 2,
                max_recv_sge: 1,
                max_inline_data: 0,
            },
            sq_sig_all: true,
            recv_window: shared.opts.recv_window,
            srq: domain.map(|d| d.pool.srq().clone()),
        };
        // The receives are posted before the acceptance reaches the
        // client (on its QP, or in the pool by `reserve`): its AUTH may
        // follow the handshake at once, and on iWARP devices (siw, iWARP
        // NICs) a Send that finds no posted receive is fatal (no RNR
        // retry).
        let sges: Vec<[lwio_rdma::Sge; 1]> = match &recv {
            RecvSrc::Own(mr) => (0..nrecv)
                .map(|i| [mr.sge(i * recv_slot, recv_slot as u32)])
                .collect(),
            _ => Vec::new(),
        };
        let recvs: Vec<RecvWr<'_>> = sges
            .iter()
            .enumerate()
            .map(|(i, sge)| RecvWr {
                wr_id: wrid::RECV | i as u64,
                sg_list: sge,
            })
            .collect();
        let qp = match req.accept_with_recvs(&init, &ConnParams::default(), &recvs) {
            Ok(q) => q,
            Err(e) => {
                recv.free(&shared);
                release(backed);
                shared.unregister(send_mr);
                return Err(e);
            }
        };
        let (done_tx, done_rx) = mpsc::channel();
        let (ctl_tx, ctl_rx) = mpsc::channel();
        let waker = Arc::new(Waker::new()?);
        let credits_pub = Arc::new(AtomicUsize::new(1));
        let state_pub = Arc::new(std::sync::atomic::AtomicU8::new(
            ConnState::Authenticating as u8,
        ));
        let now = Instant::now();
        let base_credits = cfg.max_credits;
        info!(conn = id, %peer, qpn = qp.qp_num(), listener = %listening.describe(), "RDMA connection accepted");
        let entry = ConnEntry {
            ctl: ctl_tx,
            waker: waker.clone(),
            credits: credits_pub.clone(),
            state: state_pub.clone(),
            pd: domain.is_none().then(|| pd.clone()),
        };
        let sconn = ServerConn::new(cfg, now);
        let reads = domain.map(|d| {
            for r in &d.reads {
                r.attach();
            }
            d.reads.clone()
        });
        Ok((
            Conn {
                id,
                peer,
                qp,
                cq,
                chan,
                pd,
                recv,
                backed,
                held: Default::default(),
                frag_bufs: HashMap::new(),
                recv_slot,
                send_mrs: vec![send_mr],
                send_free: (0..SEND_CHUNK as u32).rev().collect(),
                sq_depth,
                sq_inflight: 0,
                deferred: VecDeque::new(),
                read_bufs: HashMap::new(),
                spare_bufs: Vec::new(),
                reads,
                cancels: HashMap::new(),
                mem: Default::default(),
                files: HashMap::new(),
                next_file: 1,
                session: None,
                sconn,
                shared,
                state,
                pool,
                done_tx,
                done_rx,
                ctl_rx,
                waker,
                credits_pub,
                state_pub,
                credits_reported: 0,
                base_credits,
                client_cap: None,
                last_io: now,
                closing: None,
                draining: None,
                dead: false,
                inline_mode: HashMap::new(),
                slot: 0,
                rio: None,
                ring_ops: HashMap::new(),
                read_waits: HashMap::new(),
                last_tick: now,
                last_busy: now,
                last_polled: now,
                last_polled_count: 0,
                requests_balanced: 0,
                sq_pending: Vec::new(),
                _ctx: own_ctx,
            },
            entry,
        ))
    }

    /// One turn of this connection on its reactor: control messages,
    /// storage completions, RDMA completions, then the actions they caused.
    /// True if it did any I/O work (the reactor keeps polling a while).
    pub(super) fn turn(&mut self, now: Instant, wcs: &mut [Wc]) -> bool {
        let mut busy = false;
        while let Ok(c) = self.ctl_rx.try_recv() {
            self.control(c);
        }
        while let Ok((op, r)) = self.done_rx.try_recv() {
            busy = true;
            self.storage_done(op, r);
        }
        loop {
            let n = match self.cq.poll(wcs) {
                Ok(n) => n,
                Err(e) => {
                    warn!(conn = self.id, error = %e, "CQ failed; closing");
                    self.dead = true;
                    0
                }
            };
            if n == 0 {
                break;
            }
            busy = true;
            for w in wcs[..n].iter().copied() {
                self.completion(w);
            }
        }
        if busy
            && matches!(self.recv, RecvSrc::Pool(_))
            && self.sconn.credits() < self.base_credits
            && !self.sconn.credit_transaction_active()
        {
            // Woken from idle with one credit: grant now, not at the next
            // balancing round.
            self.balance(now);
        }
        self.tick(now);
        let polled = self.sconn.polled_completions();
        if polled != self.last_polled_count {
            self.last_polled_count = polled;
            self.last_polled = now;
        }
        if busy {
            self.last_busy = now;
        }
        busy
    }

    /// The timed part of a turn (also run alone on idle connections):
    /// protocol timers, credit balancing and counters every
    /// [`STATS_FLUSH`], memory-object work, pending actions.
    pub(super) fn tick(&mut self, now: Instant) {
        let st = if self.closing.is_some() || self.draining.is_some() {
            ConnState::Closing
        } else if self.sconn.is_authenticated() {
            ConnState::Serving
        } else {
            ConnState::Authenticating
        };
        self.state_pub.store(st as u8, Ordering::Relaxed);
        if let Some(t) = self.sconn.poll_timeout() {
            if now >= t {
                let slow = self.sconn.slow_credit_replies();
                self.sconn.handle_timeout(now);
                if self.sconn.slow_credit_replies() > slow {
                    self.shared
                        .slow_credit_replies
                        .fetch_add(1, Ordering::Relaxed);
                    warn!(
                        conn = self.id,
                        peer = %self.peer,
                        timeout = ?self.shared.opts.proto.credit_timeout,
                        "client slow to answer a credit transaction; keeping the connection"
                    );
                }
            }
        }
        if now.duration_since(self.last_tick) >= STATS_FLUSH {
            self.last_tick = now;
            // Files whose handles were closed: let their descriptors go
            // (their Fids answer STATUS_FILE_CLOSED, `file_for`).
            self.files.retain(|_, f| !f.is_closed());
            self.balance(now);
            self.flush_request_stats();
        }
        self.pump_mem();
        self.run_actions();
    }

    /// Whether the reactor should keep polling this connection without
    /// sleeping: `busy_poll` after activity, `busy_poll_polled` after a
    /// completion its client polls for.
    pub(super) fn hot(&self, now: Instant) -> bool {
        now.duration_since(self.last_busy) < self.shared.opts.busy_poll
            || now.duration_since(self.last_polled) < self.shared.opts.busy_poll_polled
    }

    /// Before its reactor sleeps: arm the CQ, then poll once to close the
    /// race with a completion that came in between. False if one did (it
    /// is carried out; the connection stays hot).
    pub(super) fn arm(&mut self, now: Instant, wcs: &mut [Wc]) -> bool {
        if self.cq.arm(false).is_err() {
            self.dead = true;
            return true;
        }
        match self.cq.poll(&mut wcs[..1]) {
            Ok(n) if n > 0 => {
                let w = wcs[0];
                self.completion(w);
                self.last_busy = now;
                self.run_actions();
                false
            }
            Ok(_) => true,
            Err(_) => {
                self.dead = true;
                true
            }
        }
    }

    /// The fds its reactor waits on: the completion channel (with the soft
    /// provider's own context, also readable on socket input) and the
    /// waker that storage threads and the control plane use.
    pub(super) fn fds(&self) -> Vec<(std::os::fd::RawFd, usize)> {
        match self.recv {
            // The reactor's domain channel reports this one's CQ by tag.
            RecvSrc::Pool(_) => vec![(self.waker.fd(), 1)],
            _ => vec![(self.chan.fd(), 0), (self.waker.fd(), 1)],
        }
    }

    /// Consume the readiness of the fds [`Conn::fds`] returned.
    pub(super) fn consume(&self, which: usize) {
        if which == 0 {
            let _ = self.chan.wait(Some(Duration::ZERO));
        } else {
            self.waker.drain();
        }
    }

    pub(super) fn id(&self) -> u64 {
        self.id
    }

    /// Joined a reactor: its slot there and the reactor's io_uring.
    pub(super) fn attach(&mut self, slot: usize, rio: Option<Arc<Mutex<RingIo>>>) {
        self.slot = slot;
        self.rio = rio;
    }

    /// A file I/O on the reactor's ring has finished.
    pub(super) fn ring_done(&mut self, op: OpId, r: Result<u32, NtStatus>) {
        self.ring_ops.remove(&op);
        self.storage_done(op, r);
    }

    /// After [`Conn::teardown`]: the connection leaves the server's table
    /// (its domain's census stays) and frees its per-host slot.
    pub(super) fn release(&mut self) {
        self.shared.retire(self.id);
        self.shared.host_release(self.peer.ip());
    }

    pub(super) fn finished(&mut self, now: Instant) -> bool {
        if self.dead {
            return true;
        }
        if matches!(self.qp.state(), QpState::Error) && self.closing.is_none() {
            debug!(
                conn = self.id,
                "queue pair in error state (peer gone or terminated)"
            );
            self.begin_close(now);
        }
        if let Some(d) = self.draining {
            let idle =
                self.sconn.pending_ops() == 0 && self.deferred.is_empty() && self.sq_inflight == 0;
            if (idle || now >= d) && self.closing.is_none() {
                info!(conn = self.id, "shutdown: connection drained, closing");
                self.begin_close(now);
            }
        }
        if let Some(t) = self.closing {
            let sends_done = self.sq_inflight == 0 || matches!(self.qp.state(), QpState::Error);
            if (sends_done && self.cancels.is_empty() && self.ring_ops.is_empty())
                || now.duration_since(t) > Duration::from_secs(2)
            {
                return true;
            }
        }
        false
    }

    fn begin_close(&mut self, now: Instant) {
        if self.closing.is_none() {
            self.closing = Some(now);
            for c in self.cancels.values() {
                c.store(true, Ordering::Release);
            }
            if let Some(rio) = &self.rio {
                let mut rio = lock(rio);
                for id in self.ring_ops.values() {
                    rio.cancel(*id);
                }
            }
        }
    }

    /// Add this connection's request counters into the server's.
    fn flush_request_stats(&mut self) {
        let st = self.sconn.take_request_stats();
        if !st.is_empty() {
            lock(&self.shared.requests).merge(&st);
        }
    }

    pub(super) fn teardown(&mut self) {
        self.flush_request_stats();
        let _ = self.qp.disconnect();
        // Storage jobs still running hold their read buffer by Arc; they
        // finish into a channel nobody reads. Registered memory is released
        // here (deregistration invalidates keys before the memory goes).
        for (_, b) in self.read_bufs.drain() {
            if b.buf.is_slot() {
                // Back to the slab when the last holder lets go.
                continue;
            }
            let len = b.buf.len();
            match Arc::try_unwrap(b.buf).ok().and_then(ReadBuffer::into_own) {
                Some(mr) => self.shared.unregister(mr),
                // A storage job still holds it; it is freed when the job ends.
                None => {
                    self.shared.mem_used.fetch_sub(len, Ordering::AcqRel);
                }
            }
        }
        for mr in self.spare_bufs.drain(..) {
            self.shared.unregister(mr);
        }
        for slab in self.reads.take().into_iter().flatten() {
            slab.detach();
        }
        for mr in self.mem.teardown(&self.state) {
            self.shared.unregister(mr);
        }
        match std::mem::replace(&mut self.recv, RecvSrc::Gone) {
            RecvSrc::Own(m) => {
                let len = m.len();
                match Arc::try_unwrap(m) {
                    Ok(mr) => self.shared.unregister(mr),
                    // A storage job still writes from it; freed when it ends.
                    Err(_) => self.shared.forget(len),
                }
            }
            RecvSrc::Pool(p) => {
                self.drain_pool_receives(&p);
                // Buffers a storage job of this connection still writes
                // from never come back to the pool (the job keeps their
                // region); the others go back now, and the credits stop
                // being promised.
                let busy: std::collections::HashSet<RecvId> = self
                    .frag_bufs
                    .iter()
                    .filter(|(op, _)| {
                        self.ring_ops.contains_key(op) || self.cancels.contains_key(op)
                    })
                    .flat_map(|(_, b)| b.iter().copied())
                    .collect();
                let back: Vec<RecvId> = self.held.drain().filter(|b| !busy.contains(b)).collect();
                p.give_back(&back);
                p.lose(busy.len());
                p.release(self.backed, self.backed > 0);
                self.backed = 0;
            }
            RecvSrc::Gone => {}
        }
        for m in self.send_mrs.drain(..) {
            self.shared.unregister(m);
        }
        self.shared
            .credits_granted
            .fetch_sub(self.credits_reported, Ordering::AcqRel);
        info!(conn = self.id, peer = %self.peer, files = self.files.len(), "RDMA connection closed");
    }

    /// Pool mode, at teardown (the QP disconnected): the receives of the
    /// shared queue this QP took whose completions still wait in its CQ
    /// become buffers it holds, handed back with the others. On verbs
    /// devices `Srq::posted` counts a receive until its completion is
    /// polled, so one left in a CQ nobody polls any more would count as
    /// posted for good and the pool would post one fewer than its
    /// promises need (an RoCE client's Send then waits in RNR retries).
    fn drain_pool_receives(&mut self, p: &RecvPool) {
        let mut wcs = [Wc::BLANK; 16];
        let mut took = 0;
        while let Ok(n) = self.cq.poll(&mut wcs) {
            if n == 0 {
                break;
            }
            for w in &wcs[..n] {
                if wrid::kind(w.wr_id) == wrid::RECV {
                    p.taken();
                    self.held.insert(wrid::value(w.wr_id));
                    took += 1;
                }
            }
        }
        if took > 0 {
            debug!(
                conn = self.id,
                receives = took,
                "closing: shared receives left in the CQ handed back"
            );
        }
    }

    fn control(&mut self, c: Control) {
        match c {
            Control::CreditDelta(d) => {
                let d = if d > 0 {
                    self.promise(d as usize) as i32
                } else {
                    d
                };
                if d == 0 {
                    return;
                }
                let r = self.sconn.start_credit_delta(Instant::now(), d);
                if r.is_err() && d > 0 {
                    self.unpromise(d as usize);
                }
                debug!(conn = self.id, delta = d, result = ?r, "credit delta requested");
            }
            Control::Shutdown => {
                if self.draining.is_none() {
                    self.draining = Some(Instant::now() + self.shared.opts.shutdown_grace);
                }
            }
        }
    }

    /// Pool mode: promise the pool up to `n` more credits before granting
    /// them (its receives are posted first); how many it took. Own
    /// receive buffers: all of them (they are posted already).
    fn promise(&mut self, n: usize) -> usize {
        match &self.recv {
            RecvSrc::Pool(p) => {
                let n = n.min(self.shared.extra_buffers(self.recv_slot));
                let got = p.reserve(n, 1, self.backed == 0);
                self.backed += got;
                got
            }
            _ => n,
        }
    }

    /// What an idle connection keeps: one credit when its receives come
    /// from the pool (issue 13), else its initial grant (its own buffers
    /// stay registered anyway).
    fn idle_credits(&self) -> u16 {
        match self.recv {
            RecvSrc::Pool(_) => 1,
            _ => self.base_credits,
        }
    }

    /// Undo a [`Conn::promise`] whose grant did not start.
    fn unpromise(&mut self, n: usize) {
        if let RecvSrc::Pool(p) = &self.recv {
            let n = n.min(self.backed);
            self.backed -= n;
            p.release(n, n > 0 && self.backed == 0);
        }
    }

    /// Credit balancing: grant to busy connections from the global budget,
    /// reclaim from idle ones.
    fn balance(&mut self, now: Instant) {
        let credits = self.sconn.credits();
        if usize::from(credits) < self.backed {
            // The client gave credits back: the pool need not back them.
            let n = self.backed - usize::from(credits);
            self.unpromise(n);
        }
        self.credits_pub
            .store(usize::from(credits), Ordering::Relaxed);
        let d = i64::from(credits) - self.credits_reported;
        if d != 0 {
            self.shared.credits_granted.fetch_add(d, Ordering::AcqRel);
            self.credits_reported += d;
        }
        if !self.sconn.is_authenticated()
            || self.sconn.credit_transaction_active()
            || self.draining.is_some()
        {
            return;
        }
        // Credits the client reported it cannot use (its reply to a
        // positive delta): take them back at once and grant no more than it
        // can use from now on, automatic balancing or not (seed 000: no new
        // positive update before a negative one).
        let unused = self.sconn.take_unused_credits();
        if unused > 0 {
            let cap = credits.saturating_sub(unused.min(255) as u16).max(1);
            self.client_cap = Some(cap);
            let delta = -i32::from(credits - cap);
            if delta < 0 && self.sconn.start_credit_delta(now, delta).is_ok() {
                debug!(
                    conn = self.id,
                    delta, cap, "taking back credits the client reported unused"
                );
            }
            return;
        }
        if !self.shared.opts.auto_credits {
            return;
        }
        // Busy: short of credits with requests coming (a connection with
        // no I/O since the last round is not, whatever its last request's
        // hint said: else an idle one at one credit looks busy). Short:
        // its spare credits cannot hold one more request, or one more of
        // the largest fragmented message it sent this round (a client
        // writing 16-fragment messages with 40 credits has two in flight
        // and 8 credits it cannot use).
        let fresh = self.sconn.data_requests() != self.requests_balanced;
        self.requests_balanced = self.sconn.data_requests();
        let active = self.sconn.outstanding() > 0 || fresh;
        let message = self.sconn.take_largest_message().max(1);
        let busy = active
            && (self.sconn.outstanding() + message >= u32::from(credits)
                || u16::from(self.sconn.credit_hint()) >= credits);
        if busy {
            self.last_io = now;
            let max = self
                .shared
                .opts
                .max_credits_per_conn
                .min(255)
                .min(self.client_cap.unwrap_or(255));
            let granted = self.shared.credits_granted.load(Ordering::Acquire);
            let room = i64::from(self.shared.opts.credit_budget) - granted;
            // Back to the initial grant at once (a connection waking from
            // idle holds one credit in pool mode), then 8 at a time, or one
            // more of its largest messages.
            let step = i64::from(self.base_credits.saturating_sub(credits))
                .max(8)
                .max(i64::from(message));
            let want = i64::from(max.saturating_sub(credits)).min(step).min(room);
            let want = if want > 0 {
                self.promise(want as usize) as i64
            } else {
                0
            };
            if want > 0 {
                if self.sconn.start_credit_delta(now, want as i32).is_ok() {
                    debug!(
                        conn = self.id,
                        delta = want,
                        "granting credits to a busy connection"
                    );
                } else {
                    self.unpromise(want as usize);
                }
            }
        } else if self.sconn.outstanding() > 0 {
            self.last_io = now;
        } else if credits > self.idle_credits()
            && now.duration_since(self.last_io) >= self.shared.opts.idle_reclaim
        {
            let delta = -i32::from(credits - self.idle_credits());
            // Idle: its spare read buffers go back too.
            for mr in self.spare_bufs.drain(..) {
                self.shared.unregister(mr);
            }
            if self.sconn.start_credit_delta(now, delta).is_ok() {
                debug!(
                    conn = self.id,
                    delta, "reclaiming credits from an idle connection"
                );
                self.last_io = now;
            }
        }
    }

    fn completion(&mut self, w: Wc) {
        let v = wrid::value(w.wr_id);
        match wrid::kind(w.wr_id) {
            wrid::RECV => {
                if let RecvSrc::Pool(p) = &self.recv {
                    p.taken();
                    self.held.insert(v);
                }
                if !w.is_ok() {
                    if w.status != WcStatus::WrFlushErr {
                        warn!(conn = self.id, status = ?w.status, "receive failed");
                    }
                    if matches!(self.recv, RecvSrc::Pool(_)) {
                        self.repost_recv(v);
                    }
                    return;
                }
                let slot = v as usize;
                let len = (w.byte_len as usize).min(self.recv_slot);
                let Some((mr, at)) = self.recv_buf(v) else {
                    return;
                };
                let Ok(view) = mr.slice(at, len) else {
                    self.repost_recv(v);
                    return;
                };
                if self.closing.is_none() {
                    // SAFETY: the slice covers this slot's received bytes
                    // only, not the receive region (its own or a pool
                    // chunk): the other slots stay posted and the provider
                    // may be placing into them right now. This slot's receive has just completed (polled
                    // here) and is re-posted only below, after the slice is
                    // gone (`handle_recv` keeps nothing that borrows it); the
                    // region is registered LOCAL_WRITE only, so no peer key
                    // reaches it; so nothing writes [at, at+len) while the
                    // slice lives, and the borrowed Mr keeps it mapped.
                    let msg = unsafe { view.as_slice() };
                    let was_auth = self.sconn.is_authenticated();
                    let mut hooks = Hooks {
                        state: &self.state,
                        shared: &self.shared,
                        session: &mut self.session,
                        files: &mut self.files,
                        next_file: &mut self.next_file,
                        peer: self.peer,
                        mem: &mut self.mem,
                    };
                    let kept =
                        self.sconn
                            .handle_recv_in(Instant::now(), slot as RecvId, msg, &mut hooks);
                    if !was_auth && self.sconn.is_authenticated() {
                        self.shared.auth_ok.fetch_add(1, Ordering::Relaxed);
                        self.mem.attach(&self.state, self.waker.clone());
                        info!(conn = self.id, peer = %self.peer, session = ?self.session, credits = self.sconn.credits(), "AUTH ok");
                    }
                    if kept == RecvBuffer::Kept {
                        // A fragment, or a WRITE's data lent to its file
                        // write: the buffer comes back with the write
                        // (FileWriteParts) or a refusal (RepostRecvs), and
                        // is reposted then.
                        return;
                    }
                }
                // Repost: the state machine kept nothing that points into it.
                self.repost_recv(slot as RecvId);
            }
            wrid::SEND => {
                self.sq_inflight = self.sq_inflight.saturating_sub(1);
                self.send_free.push(v as u32);
                if !w.is_ok() && w.status != WcStatus::WrFlushErr {
                    warn!(conn = self.id, status = ?w.status, vendor = w.vendor_err, "send failed");
                }
            }
            wrid::READBUF => {
                self.sq_inflight = self.sq_inflight.saturating_sub(1);
                if !w.is_ok() && w.status != WcStatus::WrFlushErr {
                    warn!(conn = self.id, status = ?w.status, vendor = w.vendor_err, "RDMA write to the client failed");
                }
                if let Some(b) = self.read_bufs.get_mut(&v) {
                    b.writes_inflight = b.writes_inflight.saturating_sub(1);
                }
                self.maybe_free_buf(v);
            }
            super::memobj::WRID_MEMOBJ => {
                self.sq_inflight = self.sq_inflight.saturating_sub(1);
                if let Some(mr) = self.mem.complete(v, w.is_ok()) {
                    self.shared.unregister(mr);
                }
            }
            _ => {}
        }
    }

    /// Post receive buffers `bufs` again.
    fn repost_recvs(&mut self, bufs: impl IntoIterator<Item = RecvId>) {
        for b in bufs {
            self.repost_recv(b);
        }
    }

    /// Post receive buffer `slot` again.
    fn repost_recv(&mut self, slot: RecvId) {
        let mr = match &self.recv {
            RecvSrc::Own(mr) => mr,
            RecvSrc::Pool(p) => {
                if self.held.remove(&slot) {
                    p.give_back(&[slot]);
                }
                return;
            }
            RecvSrc::Gone => return,
        };
        let at = slot as usize * self.recv_slot;
        if at >= mr.len() {
            return;
        }
        let sge = [mr.sge(at, self.recv_slot as u32)];
        let _ = self.qp.post_recv(&[RecvWr {
            wr_id: wrid::RECV | slot,
            sg_list: &sge,
        }]);
    }

    /// The region and offset of receive buffer `id`.
    fn recv_buf(&self, id: RecvId) -> Option<(Arc<Mr>, usize)> {
        match &self.recv {
            RecvSrc::Own(mr) => Some((mr.clone(), id as usize * self.recv_slot)),
            RecvSrc::Pool(p) => p.buf(id),
            RecvSrc::Gone => None,
        }
    }

    /// A write whose data is `parts` of receive buffers (kept, not posted,
    /// since): a reassembled message's fragments, or a WRITE's one buffer.
    /// Written with one `pwritev` from there on this thread when the
    /// page-cache fast path allows, else on the reactor's io_uring (or a storage thread) from the
    /// same buffers; the buffers are reposted once the write is done
    /// (`storage_done`). The fragment counters count messages of several
    /// fragments only.
    fn write_parts(
        &mut self,
        op: OpId,
        file: u64,
        offset: u64,
        parts: Vec<(RecvId, std::ops::Range<usize>)>,
    ) {
        let bufs: Vec<RecvId> = parts.iter().map(|(b, _)| *b).collect();
        let Some(f) = self
            .files
            .get(&file)
            .filter(|f| f.rights.write && !f.is_closed())
            .cloned()
        else {
            // (`file_for` answers the refusal: nothing copied.)
            self.repost_recvs(bufs);
            self.file_for(op, file, true);
            return;
        };
        // Pieces of the receive buffers: (region, start, len), in message
        // order.
        let mut iov: Vec<(Arc<Mr>, usize, usize)> = Vec::with_capacity(parts.len());
        for (b, r) in &parts {
            let place = self.recv_buf(*b);
            let Some((mr, at)) = place.filter(|(mr, at)| {
                r.end <= self.recv_slot && r.start <= r.end && at + r.end <= mr.len()
            }) else {
                self.repost_recvs(bufs);
                self.close_conn("a fragment range outside its receive buffer");
                return;
            };
            if r.end > r.start {
                iov.push((mr, at + r.start, r.len()));
            }
        }
        let frag = u64::from(parts.len() > 1);
        self.shared
            .fragment_writes
            .fetch_add(frag, Ordering::Relaxed);
        if f.mem.is_some() {
            // A memory object (its publisher's connection does the I/O
            // from a copy): the FileWrite way, from a copy.
            let mut data = Vec::with_capacity(iov.iter().map(|p| p.2).sum());
            for (mr, at, len) in &iov {
                let mut piece = vec![0u8; *len];
                if mr.read_at(*at, &mut piece).is_err() {
                    break;
                }
                data.extend_from_slice(&piece);
            }
            self.repost_recvs(bufs);
            let Some(f) = self.file_for(op, file, true) else {
                return;
            };
            self.shared
                .fragment_write_calls
                .fetch_add(frag, Ordering::Relaxed);
            self.dispatch(op, f, offset, JobKind::Write { data });
            return;
        }
        self.last_io = Instant::now();
        let fd = match f.fd() {
            Ok(fd) => fd,
            Err(e) => {
                self.repost_recvs(bufs);
                self.storage_done(op, Err(reopen_status(&f, &e)));
                return;
            }
        };
        let total: usize = iov.iter().map(|p| p.2).sum();
        let inline = if !self.shared.opts.inline_io {
            None
        } else {
            let vecs: Vec<libc::iovec> = iov
                .iter()
                .map(|(mr, at, len)| libc::iovec {
                    iov_base: (mr.addr() as usize + at) as *mut libc::c_void,
                    iov_len: *len,
                })
                .collect();
            // SAFETY: every iovec lies in a receive region (checked
            // above) within a buffer the state machine kept: not posted
            // since its message arrived, so the provider places nothing
            // there, and the region is LOCAL_WRITE only, so no peer key
            // reaches it; the kernel only reads it; `iov` holds an Arc of
            // each region, which keeps it mapped across the call.
            unsafe {
                inline_io_vec(
                    &mut self.inline_mode,
                    &f,
                    fd.as_raw_fd(),
                    offset,
                    &vecs,
                    total,
                )
            }
        };
        if let Some(n) = inline {
            self.shared
                .fragment_write_calls
                .fetch_add(frag, Ordering::Relaxed);
            self.shared.inline_ios.fetch_add(1, Ordering::Relaxed);
            self.repost_recvs(bufs);
            self.storage_done(op, Ok(n));
            return;
        }
        self.shared
            .fragment_write_calls
            .fetch_add(frag, Ordering::Relaxed);
        drop(fd);
        self.frag_bufs.insert(op, bufs);
        self.dispatch(op, f, offset, JobKind::WriteParts { iov });
    }

    fn storage_done(&mut self, op: OpId, r: Result<u32, NtStatus>) {
        self.cancels.remove(&op);
        if let Some(bufs) = self.frag_bufs.remove(&op) {
            self.repost_recvs(bufs);
        }
        if r == Err(STATUS_CANCELLED) {
            self.shared.ios_cancelled.fetch_add(1, Ordering::Relaxed);
        }
        if let Some(b) = self.read_bufs.get_mut(&op) {
            b.at_storage = false;
        }
        self.sconn.handle_storage_complete(Instant::now(), op, r);
        self.maybe_free_buf(op);
    }

    fn maybe_free_buf(&mut self, op: OpId) {
        let free = self
            .read_bufs
            .get(&op)
            .is_some_and(|b| b.released && b.writes_inflight == 0 && !b.at_storage);
        if free {
            if let Some(b) = self.read_bufs.remove(&op) {
                // A slab's slot goes back to it as the last holder drops it.
                if let Some(mr) = Arc::try_unwrap(b.buf).ok().and_then(ReadBuffer::into_own) {
                    // Kept for the next read while the budget has room;
                    // given back when it is three quarters spent. (Not a
                    // region smaller than 64 KiB, taken when a slab could
                    // not grow: no read would take it again.)
                    let used = self.shared.mem_used.load(Ordering::Relaxed);
                    if mr.len() >= MIN_READ_REGION
                        && self.spare_bufs.len() < usize::from(self.sconn.credits()).max(4)
                        && used <= self.shared.opts.max_memory / 4 * 3
                    {
                        self.spare_bufs.push(mr);
                    } else {
                        self.shared.unregister(mr);
                    }
                }
            }
        }
    }

    /// Post the memory-object jobs other connections queued for this one
    /// (it carries their publisher's memory); flushed with the actions.
    fn pump_mem(&mut self) {
        if self.dead || self.closing.is_some() {
            return;
        }
        if self
            .mem
            .overdue(Instant::now(), super::memobj::PUBLISHER_DEADLINE)
        {
            self.close_conn(
                "the publisher left an RDMA operation on its memory object unanswered \
                 past the deadline",
            );
            return;
        }
        let room = self.sq_depth.saturating_sub(self.sq_inflight);
        let (shared, pd) = (&self.shared, &self.pd);
        let n = self.mem.pump(room, &mut self.sq_pending, |len| {
            shared.register(pd, len, Access::LOCAL_WRITE)
        });
        self.sq_inflight += n;
        for mr in self.mem.take_freed() {
            self.shared.unregister(mr);
        }
    }

    fn read_buf_len(&self) -> usize {
        (self.sconn.config().max_rdma_window_size as usize).next_multiple_of(4096)
    }

    fn run_actions(&mut self) {
        loop {
            let a = match self.deferred.pop_front() {
                Some(a) => a,
                None => match self.sconn.poll_action() {
                    Some(a) => a,
                    None => break,
                },
            };
            if let Err(a) = self.action(a) {
                // No send-queue room: wait for completions.
                self.deferred.push_front(a);
                break;
            }
        }
        self.flush_sq();
    }

    fn close_conn(&mut self, why: &str) {
        warn!(conn = self.id, "{why}; closing");
        self.dead = true;
    }

    /// Carry out one action; `Err(action)` = retry later (send queue full).
    fn action(&mut self, a: ServerAction) -> Result<(), ServerAction> {
        if self.dead {
            return Ok(());
        }
        match a {
            ServerAction::Send(bytes) => self.post_inline(bytes, None),
            ServerAction::RdmaWrite {
                remote_addr,
                rkey,
                data: DataSource::Inline(bytes),
                imm,
            } => self.post_inline(bytes, Some((remote_addr, rkey, imm))),
            ServerAction::RdmaWrite {
                remote_addr,
                rkey,
                data: DataSource::ReadBuffer { op, offset, len },
                imm,
            } => {
                if self.sq_inflight >= self.sq_depth {
                    return Err(ServerAction::RdmaWrite {
                        remote_addr,
                        rkey,
                        data: DataSource::ReadBuffer { op, offset, len },
                        imm,
                    });
                }
                let Some(b) = self.read_bufs.get_mut(&op) else {
                    self.close_conn("RDMA write from an unknown read buffer");
                    return Ok(());
                };
                if (offset as usize).saturating_add(len as usize) > b.buf.len() {
                    self.close_conn("RDMA write outside its read buffer");
                    return Ok(());
                }
                let sge = [b.buf.sge(offset as usize, len)];
                let opk = match imm {
                    Some(imm) => SendOp::WriteWithImm {
                        remote_addr,
                        rkey,
                        imm,
                    },
                    None => SendOp::Write { remote_addr, rkey },
                };
                b.writes_inflight += 1;
                self.sq_inflight += 1;
                self.sq_pending
                    .push((wrid::READBUF | op, opk, (len > 0).then_some(sge[0])));
                Ok(())
            }
            ServerAction::FileRead {
                op,
                fid,
                file,
                offset,
                len,
            } => {
                let Some(f) = self.file_for(op, file, false) else {
                    return Ok(());
                };
                // Sized by the read (a power of two from 64 KiB up to the
                // window), so small reads of many connections do not each
                // pin a whole window.
                let want = (len as usize)
                    .max(1)
                    .next_power_of_two()
                    .clamp(MIN_READ_REGION, self.read_buf_len().max(MIN_READ_REGION));
                let spare = self.spare_bufs.iter().position(|m| m.len() >= want);
                let got = match spare.map(|i| self.spare_bufs.swap_remove(i)) {
                    Some(m) => Ok(ReadBuffer::own(m)),
                    None => {
                        // Up to 64 KiB: a slot of the reactor's slab of
                        // the smallest size that holds it (readbuf.rs);
                        // larger, or without slabs: a region of its own.
                        // Tight: a smaller buffer (a read larger than it is
                        // short, and the client reads on).
                        let slabs = self.reads.as_ref();
                        let slab = |k: usize| slabs.ok_or(STATUS_INSUFFICIENT_RESOURCES)?[k].take();
                        let own = |len| {
                            self.shared
                                .register(&self.pd, len, Access::LOCAL_WRITE)
                                .map(ReadBuffer::own)
                        };
                        let size = (len as usize).max(1);
                        if slabs.is_some() && size <= READ_SLOTS[0] {
                            slab(0).or_else(|_| own(READ_SLOTS[0]))
                        } else if slabs.is_some() && size <= READ_SLOTS[1] {
                            slab(1).or_else(|_| own(want)).or_else(|_| slab(0))
                        } else {
                            own(want)
                                .or_else(|_| slab(1))
                                .or_else(|_| own(MIN_READ_REGION))
                                .or_else(|_| slab(0))
                        }
                    }
                };
                let buf = match got {
                    Ok(b) => {
                        self.read_waits.remove(&op);
                        b
                    }
                    Err(st) => {
                        // The budget is spent: wait for buffers to come
                        // back (this connection's or others'), up to
                        // READ_BUFFER_WAIT, then answer the status.
                        let since = *self.read_waits.entry(op).or_insert_with(Instant::now);
                        if since.elapsed() < READ_BUFFER_WAIT {
                            return Err(ServerAction::FileRead {
                                op,
                                fid,
                                file,
                                offset,
                                len,
                            });
                        }
                        self.read_waits.remove(&op);
                        self.sconn
                            .handle_storage_complete(Instant::now(), op, Err(st));
                        return Ok(());
                    }
                };
                let buf = Arc::new(buf);
                self.read_bufs.insert(
                    op,
                    ReadBuf {
                        buf: buf.clone(),
                        writes_inflight: 0,
                        released: false,
                        at_storage: true,
                    },
                );
                let len = (len as usize).min(buf.len());
                self.dispatch(op, f, offset, JobKind::Read { buf, len });
                Ok(())
            }
            ServerAction::FileWrite {
                op,
                fid: _,
                file,
                offset,
                data,
            } => {
                let Some(f) = self.file_for(op, file, true) else {
                    return Ok(());
                };
                self.dispatch(op, f, offset, JobKind::Write { data });
                Ok(())
            }
            ServerAction::FileSync {
                op,
                fid: _,
                file,
                data_only,
            } => {
                // fsync(2) needs an open file, of either direction.
                let write = self.files.get(&file).is_some_and(|f| f.rights.write);
                let Some(f) = self.file_for(op, file, write) else {
                    return Ok(());
                };
                self.dispatch(op, f, 0, JobKind::Sync { data_only });
                Ok(())
            }
            ServerAction::FileWriteParts {
                op,
                fid: _,
                file,
                offset,
                parts,
            } => {
                self.write_parts(op, file, offset, parts);
                Ok(())
            }
            ServerAction::RepostRecvs(bufs) => {
                self.repost_recvs(bufs);
                Ok(())
            }
            ServerAction::CancelIo { op } => {
                if let Some(c) = self.cancels.get(&op) {
                    c.store(true, Ordering::Release);
                }
                if let (Some(id), Some(rio)) = (self.ring_ops.get(&op), &self.rio) {
                    lock(rio).cancel(*id);
                }
                Ok(())
            }
            ServerAction::ReleaseReadBuffer { op } => {
                if let Some(b) = self.read_bufs.get_mut(&op) {
                    b.released = true;
                }
                self.maybe_free_buf(op);
                Ok(())
            }
            ServerAction::CloseFile { fid, file } => {
                if let Some(f) = self.files.remove(&file) {
                    debug!(conn = self.id, fid, path = %f.path, "CLOSE");
                }
                Ok(())
            }
            ServerAction::CloseConnection(reason) => {
                match &reason {
                    CloseReason::AuthFailed => {
                        self.shared.auth_failed.fetch_add(1, Ordering::Relaxed);
                    }
                    CloseReason::CreditOverflow => {
                        self.shared.credit_overruns.fetch_add(1, Ordering::Relaxed);
                        self.shared
                            .closed_by_protocol
                            .fetch_add(1, Ordering::Relaxed);
                    }
                    _ => {
                        self.shared
                            .closed_by_protocol
                            .fetch_add(1, Ordering::Relaxed);
                    }
                }
                *lock(&self.shared.closed_by_status)
                    .entry(reason.status())
                    .or_default() += 1;
                info!(conn = self.id, peer = %self.peer, ?reason, status = format_args!("{:#010x}", reason.status()), "terminating connection");
                self.begin_close(Instant::now());
                Ok(())
            }
        }
    }

    /// The open file behind a storage action, if the connection may do
    /// that kind of I/O on it; otherwise the op is completed with the error.
    fn file_for(&mut self, op: OpId, file: u64, write: bool) -> Option<OpenFile> {
        self.last_io = Instant::now();
        let st = match self.files.get(&file) {
            None => STATUS_INVALID_HANDLE,
            // Its handle was closed on the side channel, or its session
            // ended: the Fid is dead on every connection (issue 31).
            Some(f) if f.is_closed() => {
                if let Some(f) = self.files.remove(&file) {
                    debug!(conn = self.id, path = %f.path, file, "Fid of a closed handle");
                }
                STATUS_FILE_CLOSED
            }
            Some(f) if (write && f.rights.write) || (!write && f.rights.read) => {
                return Some(f.clone())
            }
            Some(_) => STATUS_ACCESS_DENIED,
        };
        self.sconn
            .handle_storage_complete(Instant::now(), op, Err(st));
        None
    }

    fn dispatch(&mut self, op: OpId, f: OpenFile, offset: u64, kind: JobKind) {
        if let Some(obj) = &f.mem {
            // A memory object: the publisher's connection does the I/O.
            let kind = match kind {
                JobKind::Read { buf, len } => MemOp::Read { buf, len },
                JobKind::Write { data } => MemOp::Write { data },
                // A memory object is the publisher's memory: no storage
                // to sync.
                JobKind::Sync { .. } => {
                    self.storage_done(op, Ok(0));
                    return;
                }
                // `write_parts` sends memory objects the FileWrite way.
                JobKind::WriteParts { .. } => {
                    self.storage_done(op, Err(STATUS_INVALID_DEVICE_REQUEST));
                    return;
                }
            };
            let reply = (self.done_tx.clone(), self.waker.clone());
            if let Some(r) = super::memobj::submit(obj, op, offset, kind, reply) {
                self.storage_done(op, r);
            }
            return;
        }
        // The descriptor, held (never closed by the cache) until the I/O
        // has returned.
        let fd = match f.fd() {
            Ok(fd) => fd,
            Err(e) => {
                self.storage_done(op, Err(reopen_status(&f, &e)));
                return;
            }
        };
        if let Some(r) = self.try_inline(&f, fd.as_raw_fd(), offset, &kind) {
            self.shared.inline_ios.fetch_add(1, Ordering::Relaxed);
            // Release the read buffer's Arc before `storage_done`, which
            // takes the buffer back with `Arc::try_unwrap`.
            drop(kind);
            self.storage_done(op, Ok(r));
            return;
        }
        let slow_hook = matches!(kind, JobKind::Write { .. } | JobKind::WriteParts { .. })
            && slow_next_write_ms(false) > 0;
        // A sync is one blocking call on the pool (no buffers to hand the
        // ring, and it must not wait behind a ring's batch).
        let ring = self
            .rio
            .clone()
            .filter(|_| !matches!(kind, JobKind::Sync { .. }));
        if let (Some(rio), false) = (ring, slow_hook) {
            let align = if f.direct { f.align } else { 1 };
            let r = ring_job(offset, align, kind).and_then(|(iov, write, keep)| {
                let job = RingJob {
                    conn: self.id,
                    slot: self.slot,
                    op,
                    file: fd,
                    offset,
                    iov,
                    write,
                    keep,
                };
                // SAFETY: `ring_job` built every iovec inside `keep`, which
                // the ring op owns until its completion is reaped. A read
                // buffer is this op's alone while it is at storage (see
                // `run_job`); a write's bytes are a copy or receive buffers
                // kept for the message (reposted only in `storage_done`),
                // registered LOCAL_WRITE only: nothing writes them while
                // the kernel reads them.
                unsafe { lock(&rio).push(job) }
            });
            match r {
                Ok(id) => {
                    self.ring_ops.insert(op, id);
                }
                Err(st) => self.storage_done(op, Err(st)),
            }
            return;
        }
        let cancel = Arc::new(AtomicBool::new(false));
        let job = Job {
            op,
            file: fd,
            offset,
            align: if f.direct { f.align } else { 1 },
            kind,
            cancel: cancel.clone(),
            reply: self.done_tx.clone(),
            waker: self.waker.clone(),
        };
        // Counted before it can be taken (and uncounted), never after.
        self.pool.queued.fetch_add(1, Ordering::Relaxed);
        match self.pool.tx.try_send(job) {
            Ok(()) => {
                self.cancels.insert(op, cancel);
            }
            Err(_) => {
                self.pool.queued.fetch_sub(1, Ordering::Relaxed);
                debug!(conn = self.id, op, "storage queue full");
                if let Some(b) = self.read_bufs.get_mut(&op) {
                    b.at_storage = false;
                }
                self.sconn.handle_storage_complete(
                    Instant::now(),
                    op,
                    Err(STATUS_INSUFFICIENT_RESOURCES),
                );
            }
        }
    }

    /// The page-cache fast path: do the I/O on this thread when it cannot
    /// block on a device. On tmpfs/ramfs a file's data is memory, so plain
    /// `pread`/`pwrite` are memory copies; elsewhere the call carries
    /// `RWF_NOWAIT` and fails with `EAGAIN` instead of blocking (data not
    /// cached, writeback or locks needed). `Some(n)` = done, all of it;
    /// `None` = hand it to the storage pool (which redoes a partial transfer
    /// whole: reads and writes of the same bytes are idempotent). Skipped
    /// for `O_DIRECT` files and when `inline_io` is off; a file system that
    /// refuses `RWF_NOWAIT` is remembered per file and direction.
    fn try_inline(&mut self, f: &OpenFile, fd: RawFd, offset: u64, kind: &JobKind) -> Option<u32> {
        if !self.shared.opts.inline_io {
            return None;
        }
        let (ptr, len, write) = match kind {
            JobKind::Read { buf, len } => (buf.addr() as *mut u8, (*len).min(buf.len()), false),
            JobKind::Write { data } => (data.as_ptr() as *mut u8, data.len(), true),
            // Tried inline before it became a job (`write_parts`); a sync
            // blocks on the device.
            JobKind::WriteParts { .. } | JobKind::Sync { .. } => return None,
        };
        // SAFETY: a read lands in a server read buffer registered with
        // LOCAL_WRITE only (no remote key reaches it) from which no RDMA
        // Write is posted until this op completes, so the kernel's write
        // races with nothing; its length is clamped to the buffer (a slab
        // slot's own bytes: other slots are disjoint, and this one is not
        // given to another read while the Arc in `kind` lives) and that Arc
        // keeps the mapping alive. A write's source is a live
        // Vec in `kind`, only read.
        unsafe { inline_io(&mut self.inline_mode, f, fd, offset, ptr, len, write) }
    }

    /// Post a Send (remote = None) or an RDMA Write of owned bytes.
    fn post_inline(
        &mut self,
        bytes: Vec<u8>,
        remote: Option<(u64, u32, Option<u32>)>,
    ) -> Result<(), ServerAction> {
        let back = |bytes: Vec<u8>| match remote {
            None => ServerAction::Send(bytes),
            Some((remote_addr, rkey, imm)) => ServerAction::RdmaWrite {
                remote_addr,
                rkey,
                data: DataSource::Inline(bytes),
                imm,
            },
        };
        if bytes.len() > SEND_SLOT {
            self.close_conn("outgoing message larger than a send slot");
            return Ok(());
        }
        if self.sq_inflight >= self.sq_depth {
            return Err(back(bytes));
        }
        if self.send_free.is_empty() && self.send_mrs.len() * SEND_CHUNK < self.sq_depth {
            // More sends in flight than slots: one more chunk (within the
            // budget; else the action waits for a slot to come back).
            if let Ok(m) = self
                .shared
                .register(&self.pd, SEND_SLOT * SEND_CHUNK, Access::empty())
            {
                let base = (self.send_mrs.len() * SEND_CHUNK) as u32;
                self.send_mrs.push(m);
                self.send_free
                    .extend((base..base + SEND_CHUNK as u32).rev());
            }
        }
        let Some(slot) = self.send_free.pop() else {
            return Err(back(bytes));
        };
        let Some(mr) = self.send_mrs.get(slot as usize / SEND_CHUNK) else {
            return Ok(());
        };
        let off = (slot as usize % SEND_CHUNK) * SEND_SLOT;
        if mr.write_at(off, &bytes).is_err() {
            self.send_free.push(slot);
            self.close_conn("send slot out of range");
            return Ok(());
        }
        let sge = [mr.sge(off, bytes.len() as u32)];
        let op = match remote {
            None => SendOp::Send,
            Some((remote_addr, rkey, None)) => SendOp::Write { remote_addr, rkey },
            Some((remote_addr, rkey, Some(imm))) => SendOp::WriteWithImm {
                remote_addr,
                rkey,
                imm,
            },
        };
        self.sq_inflight += 1;
        self.sq_pending.push((
            wrid::SEND | u64::from(slot),
            op,
            (!bytes.is_empty()).then_some(sge[0]),
        ));
        Ok(())
    }

    /// Post the work requests queued by this round of actions as one list:
    /// the soft provider sends a whole list (RDMA Writes and statuses of a
    /// batch of requests) with one `writev`.
    fn flush_sq(&mut self) {
        if self.sq_pending.is_empty() {
            return;
        }
        let pending = std::mem::take(&mut self.sq_pending);
        let wrs: Vec<SendWr<'_>> = pending
            .iter()
            .map(|(id, op, sge)| SendWr::new(*id, *op, sge.as_slice()))
            .collect();
        if let Err(e) = self.qp.post_send(&wrs) {
            // Those from the failed one on were not posted: no completion
            // will return their resources.
            for p in &pending[e.index.min(pending.len())..] {
                self.sq_inflight = self.sq_inflight.saturating_sub(1);
                let v = wrid::value(p.0);
                match wrid::kind(p.0) {
                    wrid::SEND => self.send_free.push(v as u32),
                    wrid::READBUF => {
                        if let Some(b) = self.read_bufs.get_mut(&v) {
                            b.writes_inflight = b.writes_inflight.saturating_sub(1);
                        }
                    }
                    _ => {}
                }
            }
            if self.closing.is_none() {
                debug!(conn = self.id, error = %e.error, "posting a send failed (connection gone)");
            }
            self.begin_close(Instant::now());
        }
    }
}

impl RdmaServerOptions {
    /// The RDMA listener options the configuration asks for, listening on
    /// `listen` (`compat_md5_auth` → `proto.allow_md5`, limits, grace).
    pub fn from_config(c: &crate::config::Config, listen: SocketAddr) -> RdmaServerOptions {
        let d = RdmaServerOptions::default();
        RdmaServerOptions {
            provider: c.provider,
            device: c.device.clone(),
            listen,
            shutdown_grace: c.limits.shutdown_grace,
            max_connections: c.limits.max_rdma_connections,
            max_connections_per_host: c.limits.max_rdma_connections_per_host,
            proto: lwio_proto::server::ServerConfig {
                allow_md5: c.compat_md5_auth,
                // A Fid needs a file opened on the session's side channel
                // first: the same bound (at most 65,535, the Fid space).
                max_fids: c
                    .limits
                    .max_open_files_per_session
                    .min(usize::from(u16::MAX)),
                max_recv_buffer_size: c.rdma.max_write_size,
                max_message: c.rdma.max_message,
                auth_timeout: c.rdma.auth_timeout,
                credit_timeout: c.rdma.credit_timeout,
                ..d.proto
            },
            reactors: c.rdma.reactors,
            inline_io: c.rdma.inline_io,
            busy_poll: c.rdma.busy_poll,
            busy_poll_polled: c.rdma.busy_poll_polled,
            conn_contexts: c.rdma.progress == crate::config::ProgressChoice::Connection,
            recv_window: Some(c.rdma.indicate_window as usize),
            rdma: lwio_rdma::Config {
                dead_peer_timeout: Some(c.rdma.dead_peer_timeout),
                ..d.rdma
            },
            ..d
        }
    }
}
