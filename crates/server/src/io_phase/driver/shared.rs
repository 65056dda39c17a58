//! What the listeners, reactors and connections share: the server's
//! registered-memory budget, table of live connections, consumed negotiate
//! Keys and counters ([`Shared`]), and [`ServerHandle`], its view for
//! operators and tests ([`ServerStats`]).

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lwio_proto::stats::RequestStats;
use lwio_proto::status::*;
use lwio_proto::wire::Guid;
use lwio_proto::NtStatus;
use lwio_rdma::{Access, Mr, Pd, PdCensus};
use tracing::{debug, warn};

use crate::io_phase::pool::RecvPool;
use crate::io_phase::reactor::ReactorStats;
use crate::io_phase::readbuf::{ReadSlab, ReadSlabStats};
use crate::io_phase::Waker;

use super::conn::{SEND_CHUNK, SEND_SLOT};
use super::options::RdmaServerOptions;

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
    /// FLUSHes run on the reactor thread itself (`inline_when_alone`).
    pub inline_syncs: u64,
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

pub(super) enum Control {
    CreditDelta(i32),
    Shutdown,
}

pub(super) struct ConnEntry {
    /// Its state for metrics: a [`ConnState`].
    pub(super) state: Arc<std::sync::atomic::AtomicU8>,
    pub(super) ctl: mpsc::Sender<Control>,
    pub(super) waker: Arc<Waker>,
    pub(super) credits: Arc<AtomicUsize>,
    /// The connection's own protection domain, for its census (None: a
    /// reactor domain's, counted once in `Shared::domain_pds`).
    pub(super) pd: Option<Pd>,
}

pub(in crate::io_phase) struct Shared {
    pub(super) opts: RdmaServerOptions,
    /// The protection domains of the reactors' receive pools (shared by
    /// their connections), for the census.
    pub(in crate::io_phase) domain_pds: Mutex<Vec<Pd>>,
    /// The reactors' receive pools.
    pub(in crate::io_phase) pools: Mutex<Vec<Arc<RecvPool>>>,
    /// The reactors' read-buffer slabs (for metrics).
    pub(in crate::io_phase) read_slabs: Mutex<Vec<Arc<ReadSlab>>>,
    /// Each reactor's counters, by index.
    pub(super) reactors: Mutex<Vec<Arc<ReactorStats>>>,
    pub(super) conns: Mutex<HashMap<u64, ConnEntry>>,
    /// Live connections per peer IP address.
    pub(super) per_host: Mutex<HashMap<IpAddr, usize>>,
    pub(super) next_conn: AtomicU64,
    pub(super) consumed_keys: Mutex<HashMap<Guid, Instant>>,
    pub(in crate::io_phase) mem_used: AtomicUsize,
    pub(super) credits_granted: AtomicI64,
    pub(super) accepted: AtomicU64,
    pub(super) rejected: AtomicU64,
    pub(super) mrs: AtomicU64,
    pub(super) mrs_remote: AtomicU64,
    /// The census of the domains of closed connections (added when their
    /// entry leaves `conns`, under its lock).
    pub(super) closed_census: Mutex<PdCensus>,
    pub(super) auth_ok: AtomicU64,
    pub(super) auth_failed: AtomicU64,
    pub(super) closed_by_protocol: AtomicU64,
    pub(super) credit_overruns: AtomicU64,
    pub(super) inline_ios: AtomicU64,
    pub(super) inline_syncs: AtomicU64,
    pub(super) slow_credit_replies: AtomicU64,
    pub(super) ios_cancelled: AtomicU64,
    pub(super) fragment_writes: AtomicU64,
    pub(super) fragment_write_calls: AtomicU64,
    pub(super) closed_by_status: Mutex<std::collections::BTreeMap<NtStatus, u64>>,
    /// Request counters of closed connections and, up to
    /// [`STATS_FLUSH`] behind, of live ones.
    pub(super) requests: Mutex<RequestStats>,
    /// Jobs queued for the storage threads and not yet taken.
    pub(super) storage_queued: Arc<AtomicUsize>,
}

/// A connection's state, for metrics (published through an `AtomicU8`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(super) enum ConnState {
    Authenticating = 0,
    Serving = 1,
    Closing = 2,
}

impl ConnState {
    pub(super) fn from_u8(v: u8) -> ConnState {
        match v {
            0 => ConnState::Authenticating,
            1 => ConnState::Serving,
            _ => ConnState::Closing,
        }
    }
}

/// How often a connection adds its request counters into the server's.
pub(in crate::io_phase) const STATS_FLUSH: Duration = Duration::from_millis(50);

pub(in crate::io_phase) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Shared {
    /// Nothing registered, accepted or counted yet.
    pub(in crate::io_phase) fn new(opts: RdmaServerOptions) -> Shared {
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
            inline_syncs: AtomicU64::new(0),
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
    pub(super) fn host_acquire(&self, ip: IpAddr) -> bool {
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
    pub(super) fn host_release(&self, ip: IpAddr) {
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
    pub(in crate::io_phase) fn reactor_stats(&self, i: usize) -> Arc<ReactorStats> {
        let mut v = lock(&self.reactors);
        while v.len() <= i {
            v.push(Arc::new(ReactorStats::default()));
        }
        v[i].clone()
    }

    /// A connection is gone: its entry leaves, its domain's census stays.
    pub(super) fn retire(&self, id: u64) {
        let mut conns = lock(&self.conns);
        if let Some(e) = conns.remove(&id) {
            if let Some(pd) = &e.pd {
                *lock(&self.closed_census) += pd.census();
            }
        }
    }

    /// Register server memory: local access only, accounted against the budget.
    pub(in crate::io_phase) fn register(
        &self,
        pd: &Pd,
        len: usize,
        access: Access,
    ) -> Result<Mr, NtStatus> {
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

    /// Each live connection's even share of the credit budget: the most
    /// a Credits hint alone can get a connection (the balancer,
    /// `credits.rs`), so that hints, which are the client's word, cannot
    /// take the credits other connections need.
    pub(in crate::io_phase) fn fair_share(&self) -> u16 {
        let live = lock(&self.conns).len().max(1);
        u16::try_from(self.opts.credit_budget as usize / live).unwrap_or(u16::MAX)
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
    pub(in crate::io_phase) fn extra_buffers(&self, slot: usize) -> usize {
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
    pub(in crate::io_phase) fn forget(&self, len: usize) {
        self.mem_used.fetch_sub(len, Ordering::AcqRel);
    }

    pub(in crate::io_phase) fn unregister(&self, mr: Mr) {
        self.mem_used.fetch_sub(mr.len(), Ordering::AcqRel);
        drop(mr);
    }

    /// Whether a negotiate Key was used by an AUTH already.
    pub(super) fn key_used(&self, key: &Guid) -> bool {
        let g = lock(&self.consumed_keys);
        g.get(key).is_some_and(|exp| *exp > Instant::now())
    }

    /// One-time use of a negotiate Key.
    pub(super) fn consume_key(&self, key: &Guid, ttl: Duration) -> bool {
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

/// Control and statistics of a running [`RdmaServer`](super::RdmaServer)
/// (cheap to clone).
#[derive(Clone)]
pub struct ServerHandle(pub(super) Arc<Shared>);

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
            inline_syncs: s.inline_syncs.load(Ordering::Relaxed),
            slow_credit_replies: s.slow_credit_replies.load(Ordering::Relaxed),
            ios_cancelled: s.ios_cancelled.load(Ordering::Relaxed),
            storage_queue: s.storage_queued.load(Ordering::Relaxed),
            fragment_writes: s.fragment_writes.load(Ordering::Relaxed),
            fragment_write_calls: s.fragment_write_calls.load(Ordering::Relaxed),
            closed_by_status: lock(&s.closed_by_status).clone(),
        }
    }

    /// The shared receive pools, summed.
    pub fn receive_pool(&self) -> crate::io_phase::pool::PoolStats {
        let mut t = crate::io_phase::pool::PoolStats::default();
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
