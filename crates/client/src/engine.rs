//! The client data path: one RDMA connection driven by
//! `lwio_proto::client::ClientConn`, which holds every request once (with
//! the engine's `ReqData`: windows, stage, group) from issue until its
//! waiter takes the completion, and owns the requests' timeouts. The engine
//! is its driver: it posts sends and receives, runs the completion queue,
//! feeds the state machine and wakes waiters.
//!
//! Threads: callers issue requests under the engine lock and then wait for
//! their own completion. The state machine encodes each request message
//! straight into a registered send slot (`poll_transmit`; a WRITE's or
//! VEC_WRITE's payload at issue, `write_into`), and the slots are posted
//! together (one post list, one `writev` on the soft provider) when the
//! caller blocks. The
//! thread that blocks first becomes the **driver**: it sleeps on the CQ's
//! completion channel and handles every receive (status responses, the
//! server's delta-credit messages) and send completion — under the soft
//! provider's manual progress it also reads the socket — so the completion
//! it waits for wakes it directly; other waiters sleep on a condition
//! variable and one of them takes over when the driver leaves. A
//! **progress thread** drives only while nobody waits, so an idle client
//! still answers credit transactions. It sleeps on the completion channel
//! and a wake-up eventfd of its own until the next deadline that needs it
//! (`Engine::next_wake`: the state machine's earliest request deadline,
//! and in polling mode a 20 ms status-block scan while polled requests are
//! outstanding); with nothing outstanding, until an event, so an idle
//! client costs no wake-ups. A caller that gives the state machine an
//! earlier deadline than the one it sleeps to wakes it
//! (`Engine::nudge_progress`), and so do `shutdown` and dropping the
//! engine. In polling mode a waiter spins on its
//! own IO_STATUS_BLOCK (`Mr::load_u64`, no receive involved), driving the
//! CQ and yielding the CPU each round; when the spin budget is spent it
//! sends INTERRUPT and sleeps until the server answers.
//!
//! Memory: staged reads of up to a page ([`BOUNCE_SLOT`]) land in an
//! engine-owned bounce area while a slot of it is free, longer ones (and
//! small ones when it is full) in `read_chunk`-sized staging slots, and are
//! copied out. Larger blocking reads of at least
//! `EngineConfig::register_threshold` bytes land **directly in the caller's
//! buffer**: a buffer from [`crate::Client::register_buffer`] is found
//! in the registration cache ([`RegCache`]: page-aligned ranges, LRU, bounded
//! by bytes and entries, released explicitly when the buffer is dropped);
//! any other buffer is registered for the duration of the call only (the
//! call holds its exclusive borrow). Reads below the threshold, and the async
//! API (whose futures can be dropped mid-read), use staging slots and copy.
//! Each read exposes exactly its target range through a memory window bound
//! **one-shot** to that range, invalidated as soon as the request completes;
//! for caller memory the call also waits for the invalidation to complete
//! ([`Engine::fence_group`]) before it returns. The regions' own keys are
//! never sent.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use lwio_proto::client::{
    ClientAction, ClientConfig, ClientConn, ClientError, ClientEvent, Issued, LocalMemory, Mode,
    RemoteBuf, ReqId, StatusBlockArea, VecWrite,
};
use lwio_proto::wire::fragment::FRAGMENT_HEADER_LEN;
use lwio_proto::wire::small::{poll_block_written, POLL_SENTINEL};
use lwio_proto::wire::{Guid, Opcode, RdmaRegion, SrvResumeKey, COMMON_HEADER_LEN};
use lwio_proto::NtStatus;
use lwio_rdma::{
    Access, CompChannel, ConnParams, Context, Cq, Mr, Mw, MwBind, Pd, Qp, QpCap, QpInit, QpState,
    RecvWr, RegBuf, SendOp, SendWr, Wc, WcOpcode, WcStatus,
};
use tracing::{debug, info, warn};

use super::{Completion, Error, Result};
use lwio_proto::wrid;

/// Reads shorter than this always use the bounce area (never caller
/// memory, even registered: not worth a window of their own).
pub const BOUNCE_THRESHOLD: usize = 1024;
/// A bounce slot: staged reads up to a page take one of these before a
/// `read_chunk`-sized staging slot, so small random reads (the 4 KiB of
/// databases and fio) keep [`BOUNCE_SLOTS`] in flight whatever
/// `stage_slots` is (the preload's 16 slots of 512 KiB once held 4 KiB AIO
/// at queue depth 16).
pub const BOUNCE_SLOT: usize = 4096;
const BOUNCE_SLOTS: usize = 64;
const RECV_SLOT: usize = 64;
const AUTH_BUF: usize = 256;
const STATUS_SLOTS: u32 = 256;
/// Request messages posted together at most (one post list).
const SEND_BATCH: usize = 32;
/// Polling mode: how often the progress thread scans the status blocks of
/// outstanding requests while no caller drives.
const POLL_SCAN: Duration = Duration::from_millis(20);

/// In the reason of a connection this client's provider terminated
/// because the server sent what it must not (`Engine::refused_by_us`): a
/// misbehaving server, which the client does not reconnect to.
pub(crate) const REFUSED: &str = "the client refused it and closed the connection";

/// Engine sizing (from `ClientOptions`).
#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub completion: Completion,
    pub credits: u16,
    /// The most credits this client uses at once (see `ClientOptions`).
    pub max_credits: u16,
    /// Largest read per request (staging slot size).
    pub read_chunk: usize,
    pub stage_slots: usize,
    /// Largest write payload per request we are prepared to send.
    pub write_chunk: usize,
    pub send_slots: usize,
    pub poll_spin: Duration,
    /// Interrupt mode: how long a waiter polls the completion queue before
    /// it sleeps (zero: it sleeps at once). See [`Spinner`].
    pub busy_poll: Duration,
    pub op_timeout: Duration,
    pub auth_timeout: Duration,
    /// Blocking reads of at least this many bytes into plain caller memory
    /// register it for the call instead of using staging slots
    /// (`usize::MAX` = never). Reads of at least [`BOUNCE_THRESHOLD`] into a
    /// registered buffer always land in it directly.
    pub register_threshold: usize,
    /// Registration cache bounds (bytes, entries).
    pub reg_cache_bytes: usize,
    pub reg_cache_entries: usize,
}

/// Client counters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClientStats {
    pub credits: u16,
    /// Most requests outstanding at once (since the client started or since
    /// the last `reset_peak`).
    pub max_outstanding: usize,
    /// Times a request was issued with outstanding > credits (must be 0).
    pub credit_violations: u64,
    /// Every credit limit the server set, in order.
    pub credit_history: Vec<u16>,
    pub requests: u64,
    pub windows_bound: u64,
    pub windows_invalidated: u64,
    pub interrupts_sent: u64,
    /// Reads of caller memory whose registration came from the cache.
    pub reg_cache_hits: u64,
    /// Registrations the cache made (at `register_buffer`, or on use after
    /// an eviction).
    pub reg_cache_misses: u64,
    pub reg_cache_evictions: u64,
    /// Caller buffers registered for the duration of one call.
    pub call_registrations: u64,
    /// Write data bytes copied into send slots (a write from a registered
    /// buffer goes out as a send SGE over it instead: 0 bytes).
    pub send_copy_bytes: u64,
    /// Writes sent as one fragmented message (docs/protocol.md §5.12),
    /// and the fragments they took.
    pub fragmented_writes: u64,
    pub fragments_sent: u64,
    pub polled_completions: u64,
    pub interrupt_completions: u64,
    /// INTERRUPTs the server answered (after an I/O completion): a polled
    /// waiter woken by one of these was not woken by its re-poll timer.
    pub interrupts_answered: u64,
    /// Times the progress thread woke up (each turn of its loop: from its
    /// sleep on the completion channel, or from a short nap while a caller
    /// drives). An idle connection stays near zero.
    pub progress_wakeups: u64,
    /// Waits (interrupt mode) whose completion came while the waiting
    /// thread busy-polled, before it would have slept
    /// ([`EngineConfig::busy_poll`]).
    pub busy_poll_hits: u64,
    /// Requests whose op timeout passed before their answer came (the
    /// state machine's `TimedOut`; they stay outstanding until answered),
    /// found by a waiter or by the progress thread.
    pub timed_out: u64,
    /// Of the interrupt completions, reads completed by the server's RDMA
    /// Write with Immediate (ImmediateCookie) rather than a status message.
    pub immediate_completions: u64,
}

/// Where a read's data lands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    Bounce(usize),
    Slot(usize),
    /// Caller memory (registered): nothing to copy out.
    User,
}

/// What the engine keeps with each request, inside the state machine
/// (`ClientConn<ReqData>` holds every request once, outstanding or
/// completed and not yet taken by its waiter).
#[derive(Default)]
struct ReqData {
    /// One-shot windows the server writes through; invalidated when the
    /// request completes.
    windows: Vec<(Mw, u32)>,
    stage: Option<Stage>,
    /// Its waiter gave up: the engine frees the stage at completion.
    abandoned: bool,
    /// Caller-memory group (0 = engine memory); see [`Engine::fence_group`].
    group: u64,
}

/// A request message in its send slot, waiting to be posted: `len` bytes
/// of the slot, then (a fragment of a write from caller memory) `data`.
struct Outgoing {
    slot: u32,
    len: usize,
    data: Option<lwio_rdma::Sge>,
}

/// Registered caller memory a write sends from: the registration and the
/// data's offset in it.
pub struct UserSrc {
    reg: Arc<UserReg>,
    off: usize,
}

impl UserSrc {
    /// The same memory from `off` bytes further on.
    pub fn at(&self, off: usize) -> UserSrc {
        UserSrc {
            reg: self.reg.clone(),
            off: self.off + off,
        }
    }
}

/// A registration of caller memory: the region and, for a cached
/// registration, the memory it covers (kept alive by the entry itself, so a
/// registration can never outlive its memory). Field order matters: the
/// region is deregistered before the memory reference is released.
pub struct UserReg {
    mr: Mr,
    _mem: Option<Arc<RegBuf>>,
}

/// The destination of a read in caller memory.
pub struct UserDst {
    reg: Arc<UserReg>,
    /// Offset of the destination in `reg`.
    off: usize,
    group: u64,
}

impl UserDst {
    pub fn group(&self) -> u64 {
        self.group
    }
}

struct CacheEntry {
    mem: Arc<RegBuf>,
    len: usize,
    reg: Option<Arc<UserReg>>,
    last_use: u64,
}

/// The registration cache of explicitly registered buffers
/// ([`crate::RegisteredBuf`]). Keyed by the buffer's page-aligned
/// start address; an entry covers `start..start + len` (whole pages). The
/// entry holds the memory, so it cannot outlive it; the buffer's drop
/// releases the entry (explicit invalidation). Registrations are bounded by
/// bytes and entries: past either bound the least recently used
/// registration not in use by a read is deregistered (the buffer stays
/// valid and is registered again on its next use).
pub struct RegCache {
    entries: std::collections::BTreeMap<usize, CacheEntry>,
    tick: u64,
    reg_bytes: usize,
    reg_entries: usize,
    max_bytes: usize,
    max_entries: usize,
}

impl RegCache {
    fn new(max_bytes: usize, max_entries: usize) -> RegCache {
        RegCache {
            entries: Default::default(),
            tick: 0,
            reg_bytes: 0,
            reg_entries: 0,
            max_bytes,
            max_entries: max_entries.max(1),
        }
    }

    /// The entry containing `addr..addr + len`, if any.
    fn find(&mut self, addr: usize, len: usize) -> Option<(usize, &mut CacheEntry)> {
        let (&start, e) = self.entries.range_mut(..=addr).next_back()?;
        let end = start.checked_add(e.len)?;
        (addr.checked_add(len)? <= end).then_some((start, e))
    }

    /// Deregister least recently used idle registrations until `extra`
    /// more bytes (and one more entry) fit.
    fn make_room(&mut self, extra: usize, stats: &mut ClientStats) {
        while self.reg_entries > 0
            && (self.reg_entries + 1 > self.max_entries || self.reg_bytes + extra > self.max_bytes)
        {
            let victim = self
                .entries
                .iter()
                .filter(|(_, e)| e.reg.as_ref().is_some_and(|r| Arc::strong_count(r) == 1))
                .min_by_key(|(_, e)| e.last_use)
                .map(|(&k, _)| k);
            let Some(k) = victim else { return };
            if let Some(e) = self.entries.get_mut(&k) {
                e.reg = None;
                self.reg_entries -= 1;
                self.reg_bytes -= e.len;
                stats.reg_cache_evictions += 1;
            }
        }
    }
}

/// The engine's state under its lock: the connection's state machine (every
/// request, with its [`ReqData`]) and the transport resources it drives.
struct Locked {
    conn: ClientConn<ReqData>,
    recv_free: Vec<u32>,
    send_free: Vec<u32>,
    /// Request messages encoded in their send slots, waiting to be posted
    /// (in order): (slot, length).
    send_backlog: VecDeque<Outgoing>,
    /// Caller-memory registrations a posted fragment sends from, by send
    /// slot: kept (with the memory of a cached registration) until that
    /// send completes.
    slot_pins: HashMap<u32, Arc<UserReg>>,
    stage_free: Vec<usize>,
    bounce_free: Vec<usize>,
    mw_free: Vec<Mw>,
    lost: Option<String>,
    /// Posted, not yet completed invalidations of caller-memory windows,
    /// by group.
    inval_pending: HashMap<u64, u32>,
    next_group: u64,
    cache: RegCache,
    auth: Option<std::result::Result<(u64, u16), NtStatus>>,
    stats: ClientStats,
    /// An eventfd signalled at every completion ([`Engine::set_notify`]).
    notify: Option<Arc<std::os::fd::OwnedFd>>,
    /// How the progress thread sleeps now (set by it before it sleeps,
    /// cleared when it wakes or is woken).
    nap: Nap,
}

/// The progress thread's sleep on the completion channel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Nap {
    /// Not asleep on the channel (running a round, or standing by while a
    /// caller drives), or already woken.
    Awake,
    /// Asleep until this deadline or an event.
    Until(Instant),
    /// Asleep until an event: nothing needs a timer.
    Forever,
}

/// The engine. Shared by `Client`, its `File`s and the progress thread.
pub struct Engine {
    pub(crate) cfg: EngineConfig,
    qp: Qp,
    cq: Cq,
    chan: CompChannel,
    pd: Pd,
    recv_mr: Mr,
    send_mr: Mr,
    send_slot: usize,
    /// Send slots in all.
    send_slots: usize,
    /// Windowable memory: [auth buffer | status blocks | bounce | staging].
    win_mr: Mr,
    status_off: usize,
    bounce_off: usize,
    stage_off: usize,
    st: Mutex<Locked>,
    cv: Condvar,
    /// Threads asleep on `cv` (counted under `st`): see
    /// [`Engine::notify_sleepers`].
    cv_sleepers: std::sync::atomic::AtomicUsize,
    stop: AtomicBool,
    progress: Mutex<Option<JoinHandle<()>>>,
    provider: &'static str,
    /// Held by the one thread that sleeps on the completion channel and
    /// processes what arrives (the *driver*): a waiting caller when there
    /// is one, so its completion wakes it directly, else the progress
    /// thread. A flag rather than a mutex: the progress thread keeps the
    /// role while it sleeps without holding the engine.
    driver: AtomicBool,
    /// An eventfd that ends the progress thread's sleep (`nudge_progress`,
    /// `shutdown`, `drop`).
    wake: Arc<std::os::fd::OwnedFd>,
    /// The progress thread's loop turns ([`ClientStats::progress_wakeups`]).
    wakeups: AtomicU64,
    busy_poll_hits: AtomicU64,
    /// How often busy polls end with their reply ([`busy_poll_score`]).
    busy_poll_score: std::sync::atomic::AtomicU32,
    /// Callers that may block (inside `wait`, `issue`, `interrupt`,
    /// `fence_group`); while non-zero the progress thread stands by
    /// instead of taking the driver role.
    waiters: std::sync::atomic::AtomicUsize,
    /// Such calls begun in all: the progress thread standing by takes the
    /// driver role only after a whole nap in which no caller waited.
    waits: AtomicU64,
    /// Set while the progress thread stands by and completions are also
    /// reaped through the notify fd ([`Engine::set_notify`]: the async and
    /// C APIs): the last waiter to leave wakes it, so that nobody's
    /// completions wait for the end of its nap.
    standby_wake: AtomicBool,
    /// Set with `Locked::lost` (never cleared): [`Engine::lost`] checks it
    /// without the lock, on every call of a file.
    is_lost: AtomicBool,
    /// Set by the first file that moved off this lost channel to another
    /// (a failover, docs/reconnect.md): the failover is counted once.
    failed_over: AtomicBool,
}

struct AuthMem<'a>(&'a Mr);

impl LocalMemory for AuthMem<'_> {
    fn read(&self, addr: u64, len: usize) -> Option<Vec<u8>> {
        let off = usize::try_from(addr.checked_sub(self.0.addr())?).ok()?;
        if len > AUTH_BUF || off != 0 {
            return None;
        }
        let mut v = vec![0u8; len];
        self.0.read_at(off, &mut v).ok()?;
        Some(v)
    }
}

fn lock(m: &Mutex<Locked>) -> MutexGuard<'_, Locked> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn client_err(e: ClientError) -> Error {
    match e {
        ClientError::Closed => Error::ConnectionLost("the RDMA connection is closed".into()),
        ClientError::NotAuthenticated => Error::ConnectionLost("not authenticated".into()),
        ClientError::InvalidArgument => {
            Error::InvalidArgument("request cannot be encoded or exceeds negotiated limits".into())
        }
        ClientError::NoStatusBlock => Error::Busy("no free status block".into()),
        ClientError::NoCredits => Error::Busy("no credits".into()),
        ClientError::TransmitPending => Error::Busy("request messages wait for a send slot".into()),
        ClientError::TooManyFragments { fragments, credits } => Error::Busy(format!(
            "a message of {fragments} fragments needs more than the {credits} credits granted"
        )),
    }
}

impl Engine {
    /// The configuration this engine was built with.
    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// Connect the RDMA channel to `addr`, authenticate with `key`/`secret`.
    pub fn connect(
        ctx: &Context,
        addr: SocketAddr,
        key: Guid,
        secret: Vec<u8>,
        cfg: EngineConfig,
    ) -> Result<Arc<Engine>> {
        let provider = ctx.device().provider;
        let pd = ctx.alloc_pd()?;
        let chan = ctx.create_comp_channel()?;
        let nrecv = 257usize;
        let send_slots = cfg.send_slots.max(4);
        // Sends, window binds and invalidations of reads (a VEC_READ binds
        // one per page), and in polling mode a status window per request.
        let sq_depth = (send_slots
            + cfg.stage_slots * 8
            + BOUNCE_SLOTS * 2
            + 2 * usize::from(cfg.credits)
            + 64) as u32;
        let cq = ctx.create_cq(sq_depth + nrecv as u32 + 16, Some(&chan))?;
        let recv_mr = pd.alloc_mr(RECV_SLOT * nrecv, Access::LOCAL_WRITE)?;
        let send_slot = (COMMON_HEADER_LEN + cfg.write_chunk).next_multiple_of(64);
        let send_mr = pd.alloc_mr(send_slot * send_slots, Access::empty())?;
        let status_off = AUTH_BUF;
        let bounce_off = status_off + STATUS_SLOTS as usize * 8;
        let bounce_off = bounce_off.next_multiple_of(4096);
        let stage_off = (bounce_off + BOUNCE_SLOTS * BOUNCE_SLOT).next_multiple_of(4096);
        let win_len = stage_off + cfg.read_chunk * cfg.stage_slots;
        // No remote right of its own: the server reaches it only through
        // the one-shot windows bound per request.
        let win_mr = pd.alloc_mr(win_len, Access::LOCAL_WRITE | Access::MW_BIND)?;
        let init = QpInit {
            pd: pd.clone(),
            send_cq: cq.clone(),
            recv_cq: cq.clone(),
            cap: QpCap {
                max_send_wr: sq_depth,
                max_recv_wr: nrecv as u32,
                // A fragment from caller memory: its header in a send
                // slot, its data where it is.
                max_send_sge: 2,
                max_recv_sge: 1,
                max_inline_data: 0,
            },
            sq_sig_all: true,
            recv_window: None,
            srq: None,
        };
        // Receives are posted before the connection is established: on
        // iWARP devices a Send that finds no posted receive is fatal. The
        // state machine asks for its receives later (PostRecv); those are
        // counted as posted by the state machine (`recvs_preposted`).
        let mut recv_free: Vec<u32> = (0..nrecv as u32).rev().collect();
        let prepost = (usize::from(cfg.credits.max(1)) + 1).min(nrecv);
        let pre: Vec<u32> = (0..prepost).filter_map(|_| recv_free.pop()).collect();
        let sges: Vec<[lwio_rdma::Sge; 1]> = pre
            .iter()
            .map(|&slot| [recv_mr.sge(slot as usize * RECV_SLOT, RECV_SLOT as u32)])
            .collect();
        let recvs: Vec<RecvWr<'_>> = pre
            .iter()
            .zip(&sges)
            .map(|(&slot, sge)| RecvWr {
                wr_id: wrid::RECV | u64::from(slot),
                sg_list: sge,
            })
            .collect();
        let qp = ctx
            .connect_with_recvs(addr, &init, &ConnParams::default(), &recvs)
            .map_err(|e| match e {
                lwio_rdma::Error::Unreachable(m) | lwio_rdma::Error::Timeout(m) => {
                    Error::Unreachable(format!("RDMA channel to {addr} ({provider}): {m}"))
                }
                e => e.into(),
            })?;
        // The auth buffer and the status blocks are reachable only through
        // windows: a one-shot window for the server's AUTH params, a
        // persistent one over the status block array.
        let auth_mw = pd.alloc_mw()?;
        let auth_rkey = qp.bind_mw(
            &auth_mw,
            &MwBind {
                mr: &win_mr,
                offset: 0,
                length: AUTH_BUF as u64,
                access: Access::REMOTE_WRITE,
                one_shot: true,
            },
            wrid::BIND,
            true,
        )?;
        // Polling: each request's status block is reachable only through a
        // one-shot window bound to its 8 bytes when it is issued
        // (`Engine::req_mode`), never through a key for the whole area: a
        // server cannot complete a request it was not asked, or one twice.
        let status_area = (cfg.completion == Completion::Poll).then(|| StatusBlockArea {
            base: win_mr.addr() + status_off as u64,
            rkey: 0,
            slots: STATUS_SLOTS,
        });
        let mut ccfg = ClientConfig::new(
            key,
            secret,
            RemoteBuf {
                addr: win_mr.addr(),
                rkey: auth_rkey,
            },
        );
        ccfg.credits_wanted = cfg.credits.max(1);
        ccfg.max_credits = cfg.max_credits.max(1);
        ccfg.max_rdma_window_size = cfg.read_chunk as u32;
        ccfg.max_send_buffer_size = send_slot as u32;
        ccfg.max_recv_buffer_size = RECV_SLOT as u32;
        ccfg.status_blocks = status_area;
        ccfg.tid = std::process::id();
        ccfg.recvs_preposted = pre.len() as u32;
        ccfg.op_timeout = Some(cfg.op_timeout);
        let mut mw_free = Vec::new();
        for _ in 0..(cfg.stage_slots * 4 + BOUNCE_SLOTS) {
            mw_free.push(pd.alloc_mw()?);
        }
        let st = Locked {
            conn: ClientConn::new(ccfg),
            recv_free,
            send_free: (0..send_slots as u32).rev().collect(),
            send_backlog: VecDeque::new(),
            slot_pins: HashMap::new(),
            stage_free: (0..cfg.stage_slots).rev().collect(),
            bounce_free: (0..BOUNCE_SLOTS).rev().collect(),
            mw_free,
            lost: None,
            inval_pending: HashMap::new(),
            next_group: 1,
            cache: RegCache::new(cfg.reg_cache_bytes, cfg.reg_cache_entries),
            auth: None,
            stats: ClientStats::default(),
            notify: None,
            nap: Nap::Awake,
        };
        let wake = Arc::new(
            rustix::event::eventfd(
                0,
                rustix::event::EventfdFlags::NONBLOCK | rustix::event::EventfdFlags::CLOEXEC,
            )
            .map_err(|e| Error::Io(format!("eventfd: {e}")))?,
        );
        let e = Arc::new(Engine {
            cfg,
            qp,
            cq,
            chan,
            pd,
            recv_mr,
            send_mr,
            send_slot,
            send_slots,
            win_mr,
            status_off,
            bounce_off,
            stage_off,
            st: Mutex::new(st),
            cv: Condvar::new(),
            cv_sleepers: std::sync::atomic::AtomicUsize::new(0),
            stop: AtomicBool::new(false),
            progress: Mutex::new(None),
            provider,
            driver: AtomicBool::new(false),
            wake: wake.clone(),
            wakeups: AtomicU64::new(0),
            busy_poll_hits: AtomicU64::new(0),
            busy_poll_score: std::sync::atomic::AtomicU32::new(BUSY_POLL_SCORE_ONE),
            waiters: std::sync::atomic::AtomicUsize::new(0),
            waits: AtomicU64::new(0),
            standby_wake: AtomicBool::new(false),
            is_lost: AtomicBool::new(false),
            failed_over: AtomicBool::new(false),
        });
        let weak = Arc::downgrade(&e);
        let chan = e.chan.clone();
        let t = std::thread::Builder::new()
            .name("lwio-client-progress".into())
            .spawn(move || {
                // Every end of the thread says why (issue 33: a publisher's
                // progress thread once vanished with nothing logged). A
                // panic marks the connection lost, so that no waiter waits
                // for a thread that is gone.
                let w = weak.clone();
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    progress_loop(weak, chan, wake)
                }));
                if let Err(p) = r {
                    let msg = p
                        .downcast_ref::<&str>()
                        .map(|s| s.to_string())
                        .or_else(|| p.downcast_ref::<String>().cloned())
                        .unwrap_or_else(|| "a panic".into());
                    tracing::error!(panic = %msg, "client progress thread ended by a panic");
                    if let Some(e) = w.upgrade() {
                        let mut st = lock(&e.st);
                        e.mark_lost(&mut st, format!("the progress thread panicked: {msg}"));
                    }
                }
            })
            .map_err(|e| Error::Io(format!("cannot start the progress thread: {e}")))?;
        *e.progress.lock().unwrap_or_else(|p| p.into_inner()) = Some(t);
        // AUTH.
        {
            let mut st = lock(&e.st);
            st.conn.start(Instant::now()).map_err(client_err)?;
            e.run_actions(&mut st);
            let deadline = Instant::now() + e.cfg.auth_timeout;
            loop {
                if let Some(r) = st.auth {
                    drop(auth_mw);
                    return match r {
                        Ok((session, credits)) => {
                            info!(%addr, provider, session, credits, "RDMA channel authenticated");
                            drop(st);
                            Ok(e)
                        }
                        Err(status) => {
                            drop(st);
                            e.shutdown();
                            Err(Error::AccessDenied(format!(
                                "the server refused the RDMA authentication ({})",
                                status_text(status)
                            )))
                        }
                    };
                }
                if let Some(l) = &st.lost {
                    let l = l.clone();
                    drop(st);
                    e.shutdown();
                    return Err(Error::ConnectionLost(format!(
                        "during RDMA authentication: {l}"
                    )));
                }
                let now = Instant::now();
                if now >= deadline {
                    drop(st);
                    e.shutdown();
                    return Err(Error::TimedOut("RDMA authentication".into()));
                }
                st = e.cv_wait(st, deadline - now);
            }
        }
    }

    pub fn provider(&self) -> &'static str {
        self.provider
    }

    /// Why this connection is lost (its requests fail with
    /// [`Error::ConnectionLost`]), or `None` while it works as far as the
    /// client has seen. Cheap: no lock while it works.
    pub fn lost(&self) -> Option<String> {
        if !self.is_lost.load(Ordering::Acquire) {
            return None;
        }
        lock(&self.st).lost.clone()
    }

    /// [`Engine::lost`], after asking the provider whether the queue pair
    /// is in the error state (then it is marked lost): for a call that
    /// failed with an RDMA error (posting on a dead queue pair) before the
    /// completions said so. A system call on verbs devices: errors only.
    pub(crate) fn check_lost(&self) -> Option<String> {
        let mut st = lock(&self.st);
        if st.lost.is_none() && self.qp.state() == QpState::Error {
            self.mark_lost(&mut st, "the queue pair is in the error state".into());
        }
        st.lost.clone()
    }

    /// True for the first caller only: it counts (and logs) the failover
    /// of this lost channel's files to another channel.
    pub(crate) fn claim_failover(&self) -> bool {
        !self.failed_over.swap(true, Ordering::AcqRel)
    }

    /// Stop the progress thread and disconnect.
    pub fn shutdown(&self) {
        self.stop.store(true, Ordering::Release);
        self.wake_progress();
        let _ = self.qp.disconnect();
        {
            let mut st = lock(&self.st);
            if st.lost.is_none() {
                st.lost = Some("the client closed the connection".into());
                self.is_lost.store(true, Ordering::Release);
            }
        }
        self.cv.notify_all();
        let t = self
            .progress
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(t) = t {
            if t.thread().id() != std::thread::current().id() {
                let _ = t.join();
            }
        }
    }

    /// The RDMA provider's count of what this connection's protection
    /// domain holds: regions, those with a remote right, windows.
    pub fn census(&self) -> lwio_rdma::PdCensus {
        self.pd.census()
    }

    /// Whether the progress thread runs (it ends only with the engine, a
    /// stop, or a lost connection, and says which in the log).
    pub fn progress_running(&self) -> bool {
        self.progress
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .is_some_and(|t| !t.is_finished())
    }

    pub fn stats(&self) -> ClientStats {
        let st = lock(&self.st);
        let mut s = st.stats.clone();
        s.credits = st.conn.credits();
        s.progress_wakeups = self.wakeups.load(Ordering::Relaxed);
        s.busy_poll_hits = self.busy_poll_hits.load(Ordering::Relaxed);
        s
    }

    /// Restart the `max_outstanding` high-water mark from the current count.
    pub fn reset_peak(&self) {
        let mut st = lock(&self.st);
        st.stats.max_outstanding = st.conn.outstanding();
    }

    /// Whether the server serves FLUSH on this connection.
    pub fn server_flushes(&self) -> bool {
        lock(&self.st).conn.server_flushes()
    }

    pub fn credits(&self) -> u16 {
        lock(&self.st).conn.credits()
    }

    /// Payload limit of one WRITE / VEC_WRITE.
    pub fn max_write(&self) -> usize {
        let st = lock(&self.st);
        let server = st
            .conn
            .server_params()
            .map_or(0, |p| p.max_recv_buffer_size as usize);
        server.min(self.send_slot - COMMON_HEADER_LEN).max(1)
    }

    /// Largest read per request.
    pub fn max_read(&self) -> usize {
        let st = lock(&self.st);
        let server = st
            .conn
            .server_params()
            .map_or(0, |p| p.max_rdma_window_size as usize);
        server.min(self.cfg.read_chunk).max(1)
    }

    /// Largest READ per request into registered caller memory (no staging
    /// slot bounds it): up to the server's MAX_MESSAGE when it announces
    /// one (it serves a READ longer than its window in pieces, with one
    /// status; docs/protocol.md §5.12), else [`Engine::max_read`].
    pub fn max_read_direct(&self) -> usize {
        let m = {
            let st = lock(&self.st);
            st.conn
                .server_params()
                .map_or(0, |p| p.max_message as usize)
        };
        if m > 0 {
            m
        } else {
            self.max_read()
        }
    }

    /// Server page size (for VEC_* and COLLAPSE legality).
    pub fn server_page_size(&self) -> u16 {
        lock(&self.st)
            .conn
            .server_params()
            .map_or(4096, |p| p.page_size)
    }

    pub fn client_page_size(&self) -> u16 {
        4096
    }

    // ------------------------------------------------------------ actions

    fn mark_lost(&self, st: &mut Locked, why: String) {
        if st.lost.is_none() {
            // Flushed receives and a dead QP say nothing of the cause; if
            // this client's provider refused what the server sent, say so.
            let why = self.refused_by_us().unwrap_or(why);
            info!(reason = %why, "RDMA connection lost");
            st.lost = Some(why);
            self.is_lost.store(true, Ordering::Release);
            if let Some(fd) = &st.notify {
                // Wake the completion fd's sleepers too: they find the loss.
                let _ = rustix::io::write(&**fd, &1u64.to_ne_bytes());
            }
        } else if !why.contains("WrFlushErr") {
            // A completion with a real error processed after the flushed
            // receives that reported the loss first (a failed send is
            // completed in queue order, the receives at once): its status
            // says why, so log it too.
            info!(reason = %why, "RDMA connection lost: also");
        }
        self.notify_sleepers(st);
    }

    /// Why the connection broke if this client's RDMA provider refused the
    /// server's traffic and terminated it (an access outside the windows
    /// this client bound — wrong key, out of bounds, a window already used
    /// or invalidated — or an RDMA protocol error). The soft provider
    /// reports the Terminate it sent; other providers give `None`.
    fn refused_by_us(&self) -> Option<String> {
        let term = self.qp.terminate_sent()?;
        let code = term.vendor_err();
        let what = if term.is_protection() {
            "the server tried to write client memory it was not given (a key or range \
             outside the one-shot windows of its outstanding requests)"
        } else {
            "the server broke the RDMA protocol"
        };
        Some(format!("{what}; {REFUSED} (iWARP Terminate {code:#06x})"))
    }

    /// Carry out the state machine's actions and collect its events.
    fn run_actions(&self, st: &mut Locked) {
        while let Some(a) = st.conn.poll_action() {
            match a {
                ClientAction::PostRecv(n) => {
                    for _ in 0..n {
                        let Some(slot) = st.recv_free.pop() else {
                            warn!("no free receive buffer");
                            break;
                        };
                        let sge = [self
                            .recv_mr
                            .sge(slot as usize * RECV_SLOT, RECV_SLOT as u32)];
                        if let Err(e) = self.qp.post_recv(&[RecvWr {
                            wr_id: wrid::RECV | u64::from(slot),
                            sg_list: &sge,
                        }]) {
                            st.recv_free.push(slot);
                            self.mark_lost(st, format!("posting a receive failed: {}", e.error));
                            break;
                        }
                    }
                }
                ClientAction::ResetStatusBlock { slot, addr: _ } => {
                    let off = self.status_off + slot as usize * 8;
                    let _ = self.win_mr.store_u64(off, POLL_SENTINEL);
                }
                ClientAction::CloseConnection(reason) => {
                    let _ = self.qp.disconnect();
                    self.mark_lost(st, format!("{reason:?}"));
                }
            }
        }
        self.fill_send_slots(st);
        // Request messages wait for the caller to block (`wait`, a credit
        // wait, the driver's sleep), so a burst of requests leaves in one
        // post and one system call; before AUTH completes they go at once.
        if !matches!(st.auth, Some(Ok(_))) || st.send_backlog.len() >= SEND_BATCH {
            self.flush_sends(st);
        }
        let mut notify = false;
        while let Some(ev) = st.conn.poll_event() {
            notify = true;
            match ev {
                ClientEvent::Authenticated {
                    session_id,
                    credits,
                    ..
                } => {
                    st.auth = Some(Ok((session_id, credits)));
                    st.stats.credit_history.push(credits);
                }
                ClientEvent::AuthFailed { status } => st.auth = Some(Err(status)),
                ClientEvent::CreditsChanged { credits } => {
                    debug!(credits, "credit limit changed");
                    st.stats.credit_history.push(credits);
                }
                ClientEvent::Completed { req, opcode, .. } => {
                    self.finish_req(st, req, opcode);
                }
                // Its waiter (woken below) returns TimedOut and abandons it.
                ClientEvent::TimedOut { req, opcode } => {
                    debug!(req, ?opcode, "request timed out");
                    st.stats.timed_out += 1;
                }
            }
        }
        if notify {
            self.notify_sleepers(st);
        }
        self.nudge_progress(st);
    }

    /// When the progress thread must run next, asleep on the completion
    /// channel: the earliest request deadline of the state machine (its
    /// `handle_timeout`: a request's op timeout, an unanswered CREDIT
    /// reply), and while polled requests are outstanding the next scan of
    /// their status blocks (a polled completion posts no event). `None`:
    /// only an event needs it — nothing is outstanding, or only an
    /// INTERRUPT, which has no deadline and is answered by a message.
    /// Everything else that needs it is an event on the channel: a
    /// receive (a status response, the server's credit messages, a flushed
    /// receive when the connection breaks), a send, bind or invalidation
    /// completion, and under the soft provider's manual progress any input
    /// or transmit room on its socket.
    fn next_wake(&self, st: &Locked, now: Instant) -> Option<Instant> {
        let deadline = st.conn.poll_timeout();
        if st.conn.polled_outstanding() > 0 {
            let scan = now + POLL_SCAN;
            return Some(deadline.map_or(scan, |d| d.min(scan)));
        }
        deadline
    }

    /// Wake the progress thread if it sleeps past what it now has to do
    /// (a request issued while it slept without a deadline). Cheap while it
    /// is awake; an eventfd write at most once per sleep.
    fn nudge_progress(&self, st: &mut Locked) {
        let until = match st.nap {
            Nap::Awake => return,
            Nap::Until(t) => Some(t),
            Nap::Forever => None,
        };
        let Some(next) = self.next_wake(st, Instant::now()) else {
            return;
        };
        if until.is_some_and(|t| t <= next) {
            return;
        }
        st.nap = Nap::Awake;
        self.wake_progress();
    }

    /// End the progress thread's sleep (now, or its next one).
    fn wake_progress(&self) {
        // An eventfd counter: +1, non-blocking (EAGAIN only when it is
        // already readable).
        let _ = rustix::io::write(&*self.wake, &1u64.to_ne_bytes());
    }

    /// Take the driver role if nobody has it.
    fn take_driver(&self) -> bool {
        self.driver
            .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_ok()
    }

    fn release_driver(&self) {
        self.driver.store(false, Ordering::Release);
    }

    /// One round of the progress thread, which holds the driver role: take
    /// the channel's event (under manual progress, read the sockets), then
    /// process completions until the completion queue is empty *and armed*,
    /// so that the next completion makes the channel readable. False once
    /// the connection is lost.
    fn progress_round(&self) -> bool {
        lock(&self.st).nap = Nap::Awake;
        if let Err(err) = self.chan.wait(Some(Duration::ZERO)) {
            let mut st = lock(&self.st);
            self.mark_lost(&mut st, format!("completion channel failed: {err}"));
            return false;
        }
        loop {
            match self.drive(Duration::ZERO) {
                None => return false,
                // `Cq::wait` armed the queue and found it empty after.
                Some(0) => return true,
                Some(_) => {}
            }
        }
    }

    /// What the progress thread sleeps until ([`Engine::next_wake`]),
    /// recorded for [`Engine::nudge_progress`].
    fn plan_nap(&self) -> Option<Instant> {
        let mut st = lock(&self.st);
        let until = self.next_wake(&st, Instant::now());
        st.nap = until.map_or(Nap::Forever, Nap::Until);
        until
    }

    /// Post the request messages issued so far now (as few post calls as
    /// possible: the soft provider writes one post list with one `writev`).
    /// Issuing only queues them (a blocking caller's wait posts them
    /// together); a caller that issues and returns without waiting (POSIX
    /// AIO, whose completions another thread reaps) calls this so they go
    /// on the wire at once.
    pub fn flush(&self) {
        let mut st = lock(&self.st);
        self.flush_sends(&mut st);
    }

    /// The send slot `slot` as a slice, for the state machine to encode a
    /// request message into, and `f`'s result; None if the slot is out of
    /// the send region.
    fn with_send_slot<T>(&self, slot: u32, f: impl FnOnce(&mut [u8]) -> T) -> Option<T> {
        let mut view = self
            .send_mr
            .slice_mut(slot as usize * self.send_slot, self.send_slot)
            .ok()?;
        // SAFETY: the slice covers this one slot only, not the send region
        // (other slots may be posted and read by the provider meanwhile).
        // The caller took the slot from `send_free` under the engine lock,
        // so no posted send names it (a slot returns to the free list only
        // when its send completes) and it is queued for posting only after
        // `f` returns; the send region is registered without remote access,
        // so no peer writes it: only this thread, through this slice, while
        // the lock (which every user of the free list and of `send_backlog`
        // takes) is held.
        Some(f(unsafe { view.as_mut_slice() }))
    }

    /// Move the state machine's queued request messages into free send
    /// slots (encoded there directly), in order, behind the backlog.
    fn fill_send_slots(&self, st: &mut Locked) {
        while st.conn.transmit_pending() > 0 {
            let Some(slot) = st.send_free.pop() else {
                return;
            };
            let Some(n) = self.with_send_slot(slot, |out| st.conn.poll_transmit(out)) else {
                st.send_free.push(slot);
                return self.mark_lost(st, "a send slot lies outside the send region".into());
            };
            match n {
                Some(len) => st.send_backlog.push_back(Outgoing {
                    slot,
                    len,
                    data: None,
                }),
                None => {
                    st.send_free.push(slot);
                    // The state machine closed the connection (a message
                    // larger than a send slot): carry that out.
                    return self.run_actions(st);
                }
            }
        }
    }

    fn flush_sends(&self, st: &mut Locked) {
        self.fill_send_slots(st);
        while !st.send_backlog.is_empty() {
            let n = st.send_backlog.len().min(SEND_BATCH);
            let batch: Vec<Outgoing> = st.send_backlog.drain(..n).collect();
            let sges: Vec<([lwio_rdma::Sge; 2], usize)> = batch
                .iter()
                .map(|o| {
                    let head = self
                        .send_mr
                        .sge(o.slot as usize * self.send_slot, o.len as u32);
                    match o.data {
                        Some(d) => ([head, d], 2),
                        None => ([head, head], 1),
                    }
                })
                .collect();
            let wrs: Vec<SendWr<'_>> = sges
                .iter()
                .zip(&batch)
                .map(|((sge, n), o)| {
                    SendWr::new(wrid::SEND | u64::from(o.slot), SendOp::Send, &sge[..*n])
                })
                .collect();
            if let Err(e) = self.qp.post_send(&wrs) {
                // Those before the failed one were posted: their slots come
                // back with their (flushed) completions.
                for o in batch.iter().skip(e.index) {
                    st.send_free.push(o.slot);
                    st.slot_pins.remove(&o.slot);
                }
                self.mark_lost(st, format!("posting a send failed: {}", e.error));
                return;
            }
            self.fill_send_slots(st);
        }
    }

    /// `req` completed (its record waits in the state machine): invalidate
    /// its windows, and drop it when nobody will take it (abandoned, or an
    /// INTERRUPT, whose waiter only watches it leave).
    fn finish_req(&self, st: &mut Locked, req: ReqId, opcode: Opcode) {
        let Some(r) = st.conn.user_mut(req) else {
            return;
        };
        let (windows, group, abandoned) = (std::mem::take(&mut r.windows), r.group, r.abandoned);
        // One-shot windows are already disabled by the server's write (when
        // it happened); invalidate regardless — a short or failed read
        // leaves the window armed otherwise.
        st.stats.windows_invalidated += self.drop_windows(st, windows, group);
        if abandoned {
            if let Some(s) = st.conn.take_done(req).and_then(|d| d.user.stage) {
                free_stage(st, s);
            }
            return;
        }
        if opcode == Opcode::Interrupt {
            st.stats.interrupts_answered += 1;
            st.conn.take_done(req);
        }
        if let Some(fd) = &st.notify {
            // An eventfd counter: +1. Non-blocking; a full counter (2^64-2
            // unread completions) cannot happen in practice, and EAGAIN
            // would only mean it is readable already.
            let _ = rustix::io::write(&**fd, &1u64.to_ne_bytes());
        }
    }

    /// Signal `fd` (an eventfd) at every request completion from now on, so
    /// that a caller can sleep in epoll until there is something to reap.
    /// Completions are seen when the engine runs its completion queue: by a
    /// waiting caller, else by the progress thread (interrupt mode).
    pub fn set_notify(&self, fd: Option<Arc<std::os::fd::OwnedFd>>) {
        lock(&self.st).notify = fd;
    }

    fn completion(&self, st: &mut Locked, w: Wc) {
        let v = wrid::value(w.wr_id);
        match wrid::kind(w.wr_id) {
            wrid::RECV => {
                st.recv_free.push(v as u32);
                if !w.is_ok() {
                    self.mark_lost(st, format!("receive completed with {:?}", w.status));
                    return;
                }
                let now = Instant::now();
                match (w.opcode, w.imm) {
                    (WcOpcode::RecvRdmaWithImm, Some(imm)) => {
                        st.stats.interrupt_completions += 1;
                        st.stats.immediate_completions += 1;
                        st.conn.handle_immediate(now, imm);
                    }
                    _ => {
                        let len = (w.byte_len as usize).min(RECV_SLOT);
                        let mut msg = vec![0u8; len];
                        let _ = self.recv_mr.read_at(v as usize * RECV_SLOT, &mut msg);
                        st.stats.interrupt_completions += 1;
                        st.conn.handle_recv(now, &msg, &AuthMem(&self.win_mr));
                    }
                }
            }
            wrid::SEND => {
                st.send_free.push(v as u32);
                st.slot_pins.remove(&(v as u32));
                if !w.is_ok() {
                    self.mark_lost(
                        st,
                        format!("send completed with {:?} ({:#x})", w.status, w.vendor_err),
                    );
                }
            }
            _ => {
                if wrid::kind(w.wr_id) == wrid::INVAL && v != 0 {
                    // Done (or flushed: the QP is dead, nothing can write).
                    if let Some(n) = st.inval_pending.get_mut(&v) {
                        *n -= 1;
                        if *n == 0 {
                            st.inval_pending.remove(&v);
                        }
                    }
                    self.notify_sleepers(st);
                }
                if !w.is_ok() && w.status != WcStatus::WrFlushErr {
                    warn!(status = ?w.status, opcode = ?w.opcode, "window operation failed");
                    self.mark_lost(
                        st,
                        format!("window operation completed with {:?}", w.status),
                    );
                }
            }
        }
    }

    /// Check the status blocks of outstanding polled requests.
    fn scan_slots(&self, st: &mut Locked) {
        for slot in st.conn.polled_slots() {
            self.check_slot(st, slot);
        }
    }

    fn check_slot(&self, st: &mut Locked, slot: u32) -> bool {
        let Ok(v) = self.win_mr.load_u64(self.status_off + slot as usize * 8) else {
            return false;
        };
        if !poll_block_written(v) {
            return false;
        }
        let (info, status) = (v as u32, (v >> 32) as u32);
        st.stats.polled_completions += 1;
        st.conn
            .status_block_updated(Instant::now(), slot, info, status);
        true
    }

    /// One round as the driver (the caller holds `self.driver`): sleep on
    /// the completion channel up to `timeout` (the soft provider's manual
    /// progress reads the socket in this thread), then process every
    /// completion, status block and action. The completions the wait
    /// returned (0: the queue was armed and empty when it timed out), or
    /// `None` once the connection is lost (completions drained).
    fn drive(&self, timeout: Duration) -> Option<usize> {
        let mut wcs = [Wc::BLANK; 32];
        let n = match self.cq.wait(&self.chan, &mut wcs, Some(timeout)) {
            Ok(n) => n,
            Err(err) => {
                let mut st = lock(&self.st);
                self.mark_lost(&mut st, format!("completion channel failed: {err}"));
                return None;
            }
        };
        if n > 0 {
            let mut st = lock(&self.st);
            for w in wcs[..n].iter().copied() {
                self.completion(&mut st, w);
            }
            // Their events (windows invalidated, waiters woken) before the
            // lock goes: a waiter must not find a request done whose
            // windows are still bound.
            self.run_actions(&mut st);
            drop(st);
            self.poll_cq();
        }
        let mut st = lock(&self.st);
        if self.cfg.completion == Completion::Poll {
            self.scan_slots(&mut st);
        }
        st.conn.handle_timeout(Instant::now());
        self.run_actions(&mut st);
        self.flush_sends(&mut st);
        if st.lost.is_none() && self.qp.state() == QpState::Error {
            self.mark_lost(&mut st, "the server closed the connection".into());
        }
        let lost = st.lost.is_some();
        drop(st);
        if lost {
            self.cv.notify_all();
            // Keep draining flushes so resources are accounted, then stop.
            let _ = self.cq.poll(&mut wcs);
            return None;
        }
        Some(n)
    }

    fn poll_cq(&self) -> bool {
        let mut wcs = [Wc::BLANK; 32];
        let mut any = false;
        loop {
            let n = match self.cq.poll(&mut wcs) {
                Ok(n) => n,
                Err(e) => {
                    let mut st = lock(&self.st);
                    self.mark_lost(&mut st, format!("completion queue failed: {e}"));
                    return false;
                }
            };
            if n == 0 {
                break;
            }
            any = true;
            let mut st = lock(&self.st);
            for w in wcs[..n].iter().copied() {
                self.completion(&mut st, w);
            }
            self.scan_slots(&mut st);
            self.run_actions(&mut st);
        }
        any
    }

    // ------------------------------------------------------------ issuing

    /// Wait until a request can be issued and the resources exist, then run
    /// `issue` under the lock.
    fn issue<T>(&self, issue: impl FnMut(&Engine, &mut Locked) -> Option<Result<T>>) -> Result<T> {
        self.issue_when(ClientConn::can_issue, issue)
    }

    /// [`Engine::issue`] once `free` says a credit is free for this kind of
    /// request (INTERRUPT and CANCEL may take the reserved one).
    fn issue_when<T>(
        &self,
        free: fn(&ClientConn<ReqData>) -> bool,
        mut issue: impl FnMut(&Engine, &mut Locked) -> Option<Result<T>>,
    ) -> Result<T> {
        let _waiting = Waiting::new(self);
        let deadline = Instant::now() + self.cfg.op_timeout;
        let mut st = lock(&self.st);
        loop {
            if let Some(l) = &st.lost {
                return Err(Error::ConnectionLost(l.clone()));
            }
            // A credit but not the resources (staging buffer, window, send
            // slot): those come back only when other threads finish their
            // requests, which takes this lock, so never retry without
            // letting go of it (polling once spun here holding it while 32
            // AIO threads waited to give their buffers back).
            let mut short = false;
            if free(&st.conn) {
                if let Some(r) = issue(self, &mut st) {
                    self.issued(&mut st);
                    return r;
                }
                short = true;
            }
            if self.cfg.completion == Completion::Poll {
                self.scan_slots(&mut st);
                self.run_actions(&mut st);
                if !short && free(&st.conn) {
                    continue;
                }
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::TimedOut("waiting for a credit".into()));
            }
            let wait = (deadline - now).min(Duration::from_millis(
                if self.cfg.completion == Completion::Poll {
                    1
                } else {
                    50
                },
            ));
            self.sleep_or_drive(st, wait);
            st = lock(&self.st);
        }
    }

    /// Count a request just issued and carry out its actions.
    fn issued(&self, st: &mut Locked) {
        let out = st.conn.outstanding();
        st.stats.requests += 1;
        st.stats.max_outstanding = st.stats.max_outstanding.max(out);
        if out > usize::from(st.conn.credits()) {
            st.stats.credit_violations += 1;
        }
        self.run_actions(st);
    }

    /// [`Engine::issue`] without waiting: `Ok(None)` when no credit or
    /// resource (staging buffer, window, send slot) is free now. The async
    /// client retries when the next completion frees one. What it issues
    /// is posted at once.
    fn issue_now<T>(
        &self,
        issue: impl FnMut(&Engine, &mut Locked) -> Option<Result<T>>,
    ) -> Result<Option<T>> {
        self.issue_now_when(ClientConn::can_issue, issue)
    }

    /// [`Engine::issue_now`] for a kind of request whose credit `free`
    /// tells (see [`Engine::issue_when`]).
    fn issue_now_when<T>(
        &self,
        free: fn(&ClientConn<ReqData>) -> bool,
        mut issue: impl FnMut(&Engine, &mut Locked) -> Option<Result<T>>,
    ) -> Result<Option<T>> {
        let mut st = lock(&self.st);
        for _ in 0..2 {
            if let Some(l) = &st.lost {
                return Err(Error::ConnectionLost(l.clone()));
            }
            if free(&st.conn) {
                if let Some(r) = issue(self, &mut st) {
                    self.issued(&mut st);
                    self.flush_sends(&mut st);
                    return r.map(Some);
                }
                return Ok(None);
            }
            if self.cfg.completion != Completion::Poll {
                break;
            }
            // Completions polled now may return a credit.
            self.scan_slots(&mut st);
            self.run_actions(&mut st);
        }
        Ok(None)
    }

    /// The completion mode of a request about to be issued under `st`, and
    /// in polling mode the one-shot window bound to exactly the status block
    /// it will use (the caller keeps it with the request's other windows,
    /// invalidated when it completes).
    fn req_mode(&self, st: &mut Locked) -> Result<(Mode, Option<(Mw, u32)>)> {
        if self.cfg.completion == Completion::Interrupt {
            return Ok((Mode::Interrupt, None));
        }
        let (slot, _) = st
            .conn
            .next_status_slot()
            .ok_or_else(|| client_err(ClientError::NoStatusBlock))?;
        let (mw, rkey) = self.bind_window(
            st,
            &self.win_mr,
            self.status_off + slot as usize * 8,
            8,
            false,
        )?;
        Ok((Mode::PolledWindow(rkey), Some((mw, rkey))))
    }

    /// Invalidate and free windows (of a completed request, or of one that
    /// was not issued); returns how many invalidations were posted.
    fn drop_windows(&self, st: &mut Locked, windows: Vec<(Mw, u32)>, group: u64) -> u64 {
        let mut posted = 0;
        for (mw, rkey) in windows {
            if self.qp.invalidate(rkey, wrid::INVAL | group, true).is_ok() {
                posted += 1;
                if group != 0 {
                    *st.inval_pending.entry(group).or_default() += 1;
                }
            }
            st.mw_free.push(mw);
        }
        posted
    }

    /// Keep a status window with its request until the request completes.
    fn keep_window(st: &mut Locked, req: ReqId, w: Option<(Mw, u32)>) {
        if let (Some(w), Some(d)) = (w, st.conn.user_mut(req)) {
            d.windows.push(w);
        }
    }

    /// Bind a window over `off..off + len` of `mr` for one request. One-shot
    /// (the provider retires the key at its first use, where it can) unless
    /// `multi`: a READ longer than the server's window arrives in several
    /// RDMA Writes, so its window stays bound until the request completes
    /// and is invalidated then, like every window.
    fn bind_window(
        &self,
        st: &mut Locked,
        mr: &Mr,
        off: usize,
        len: usize,
        multi: bool,
    ) -> Result<(Mw, u32)> {
        let mw = match st.mw_free.pop() {
            Some(m) => m,
            None => self.pd.alloc_mw()?,
        };
        match self.qp.bind_mw(
            &mw,
            &MwBind {
                mr,
                offset: off as u64,
                length: len as u64,
                access: Access::REMOTE_WRITE,
                one_shot: !multi,
            },
            wrid::BIND,
            true,
        ) {
            Ok(rkey) => {
                st.stats.windows_bound += 1;
                Ok((mw, rkey))
            }
            Err(e) => {
                st.mw_free.push(mw);
                Err(e.into())
            }
        }
    }

    fn stage_off(&self, s: Stage) -> Option<usize> {
        match s {
            Stage::Bounce(i) => Some(self.bounce_off + i * BOUNCE_SLOT),
            Stage::Slot(i) => Some(self.stage_off + i * self.cfg.read_chunk),
            Stage::User => None,
        }
    }

    fn take_stage(&self, st: &mut Locked, len: usize) -> Option<Stage> {
        if len <= BOUNCE_SLOT {
            if let Some(i) = st.bounce_free.pop() {
                return Some(Stage::Bounce(i));
            }
        }
        st.stage_free.pop().map(Stage::Slot)
    }

    /// Issue a READ (or VEC_READ with `vec_pages`) of `len` bytes into a
    /// staging buffer. Returns the request and its stage.
    pub fn issue_read(
        &self,
        fid: u16,
        offset: u64,
        len: usize,
        vec_page: Option<u16>,
    ) -> Result<(ReqId, Stage)> {
        self.issue_read_to(fid, offset, len, vec_page, None)
    }

    /// [`Engine::issue_read`] into caller memory: `dst` (from
    /// [`Engine::user_dst`]) advanced by `at` bytes.
    pub fn issue_read_to(
        &self,
        fid: u16,
        offset: u64,
        len: usize,
        vec_page: Option<u16>,
        dst: Option<(&UserDst, usize)>,
    ) -> Result<(ReqId, Stage)> {
        self.check_read(len, dst)?;
        self.issue(Self::read_issuer(fid, offset, len, vec_page, dst))
    }

    /// [`Engine::issue_read`] if a credit and a staging buffer are free now
    /// (`Ok(None)` if not), without waiting; the request is posted at once.
    pub fn try_issue_read(
        &self,
        fid: u16,
        offset: u64,
        len: usize,
    ) -> Result<Option<(ReqId, Stage)>> {
        self.check_read(len, None)?;
        self.issue_now(Self::read_issuer(fid, offset, len, None, None))
    }

    fn check_read(&self, len: usize, dst: Option<(&UserDst, usize)>) -> Result<()> {
        let max = if dst.is_some() {
            self.max_read_direct()
        } else {
            self.max_read()
        };
        if len == 0 || len > max {
            return Err(Error::InvalidArgument(format!(
                "read of {len} bytes per request"
            )));
        }
        if let Some((d, at)) = dst {
            if d.off.checked_add(at).and_then(|o| o.checked_add(len)) > Some(d.reg.mr.len()) {
                return Err(Error::InvalidArgument("read outside its buffer".into()));
            }
        }
        Ok(())
    }

    /// What issues a READ (or VEC_READ) under the lock: for
    /// [`Engine::issue`] and [`Engine::issue_now`].
    fn read_issuer<'a>(
        fid: u16,
        offset: u64,
        len: usize,
        vec_page: Option<u16>,
        dst: Option<(&'a UserDst, usize)>,
    ) -> impl FnMut(&Engine, &mut Locked) -> Option<Result<(ReqId, Stage)>> + 'a {
        move |e, st| {
            let (stage, mr, off, group) = match dst {
                Some((d, at)) => (Stage::User, &d.reg.mr, d.off + at, d.group),
                None => {
                    let stage = e.take_stage(st, len)?;
                    (stage, &e.win_mr, e.stage_off(stage)?, 0)
                }
            };
            let mut windows = Vec::new();
            let r = (|| -> Result<Issued> {
                let (mode, status) = e.req_mode(st)?;
                windows.extend(status);
                match vec_page {
                    None => {
                        let window = st
                            .conn
                            .server_params()
                            .map_or(0, |p| p.max_rdma_window_size as usize);
                        let (mw, rkey) = e.bind_window(st, mr, off, len, len > window)?;
                        windows.push((mw, rkey));
                        let dst = RemoteBuf {
                            addr: mr.addr() + off as u64,
                            rkey,
                        };
                        st.conn
                            .read(Instant::now(), fid, offset, len as u32, dst, mode)
                            .map_err(client_err)
                    }
                    Some(ps) => {
                        let ps_u = usize::from(ps.max(1));
                        let mut regions = Vec::new();
                        let mut o = 0;
                        while o < len {
                            let l = ps_u.min(len - o);
                            let (mw, rkey) = e.bind_window(st, mr, off + o, l, false)?;
                            windows.push((mw, rkey));
                            regions.push(RdmaRegion {
                                data_va: mr.addr() + (off + o) as u64,
                                data_mh: rkey,
                                length: l as u32,
                            });
                            o += l;
                        }
                        st.conn
                            .vec_read(Instant::now(), fid, offset, len as u32, ps, &regions, mode)
                            .map_err(client_err)
                    }
                }
            })();
            match r {
                Ok(Issued { req, .. }) => {
                    if let Some(d) = st.conn.user_mut(req) {
                        *d = ReqData {
                            windows,
                            stage: Some(stage),
                            abandoned: false,
                            group,
                        };
                    }
                    Some(Ok((req, stage)))
                }
                Err(err) => {
                    e.drop_windows(st, windows, group);
                    free_stage(st, stage);
                    Some(Err(err))
                }
            }
        }
    }

    /// Copy `dst.len()` bytes out of a stage and free it.
    pub fn finish_stage(&self, stage: Stage, dst: &mut [u8]) {
        let Some(off) = self.stage_off(stage) else {
            return;
        };
        if !dst.is_empty() {
            // The request completed and its windows were invalidated: the
            // server can no longer write here, and completion ordering makes
            // the data visible (Mr::read_at copies, no reference is formed).
            let _ = self.win_mr.read_at(off, dst);
        }
        let mut st = lock(&self.st);
        free_stage(&mut st, stage);
        self.notify_sleepers(&mut st);
    }

    pub fn release_stage(&self, stage: Stage) {
        self.finish_stage(stage, &mut []);
    }

    pub fn issue_write(&self, fid: u16, offset: u64, data: &[u8]) -> Result<ReqId> {
        self.issue(Self::in_slot(|conn, mode, out| {
            conn.write_into(Instant::now(), fid, offset, data, mode, out)
        }))
    }

    /// [`Engine::issue_write`] if a credit and a send slot are free now
    /// (`Ok(None)` if not), without waiting; the request is posted at once.
    pub fn try_issue_write(&self, fid: u16, offset: u64, data: &[u8]) -> Result<Option<ReqId>> {
        self.issue_now(Self::in_slot(|conn, mode, out| {
            conn.write_into(Instant::now(), fid, offset, data, mode, out)
        }))
    }

    pub fn issue_vec_write(
        &self,
        fid: u16,
        offset: u64,
        page_size: u16,
        length: u32,
        data: &[u8],
        collapse: bool,
    ) -> Result<ReqId> {
        let v = VecWrite {
            fid,
            offset,
            page_size,
            length,
            data,
            collapse,
        };
        self.issue(Self::in_slot(|conn, mode, out| {
            conn.vec_write_into(Instant::now(), v, mode, out)
        }))
    }

    /// The most write data one fragmented message can carry on this
    /// connection now (a credit and a send slot per fragment); 0 when the
    /// server takes no fragments.
    /// `zero_copy`: the data goes out from registered memory (else each
    /// fragment's data is copied into a send slot, which bounds it).
    pub fn max_write_message(&self, zero_copy: bool) -> usize {
        let st = lock(&self.st);
        let slots = self.send_slots.min(self.fragment_credits(&st));
        st.conn
            .max_fragmented_write(slots as u32, self.fragment_cap(zero_copy))
            .min(u32::MAX - 1) as usize
    }

    /// The most fragments one message may have: the connection's credits,
    /// less one in polling mode, where a waiter's INTERRUPT holds a credit
    /// until the next I/O completion (a message needing every credit would
    /// wait for it, and it for the message).
    fn fragment_credits(&self, st: &Locked) -> usize {
        let c = usize::from(st.conn.credits());
        if self.cfg.completion == Completion::Poll {
            c.saturating_sub(1).max(1)
        } else {
            c
        }
    }

    /// The most data bytes per fragment this engine sends: a send slot's
    /// worth when it copies, else what the server's buffers take.
    fn fragment_cap(&self, zero_copy: bool) -> u32 {
        if zero_copy {
            u32::MAX
        } else {
            u32::try_from(self.send_slot - FRAGMENT_HEADER_LEN).unwrap_or(u32::MAX)
        }
    }

    /// Where `data` lies in registered caller memory (a [`RegisteredBuf`]
    /// in the registration cache), for a write that sends from it without
    /// a copy; `None` if it does not.
    ///
    /// [`RegisteredBuf`]: crate::RegisteredBuf
    ///
    /// With `per_call`, plain memory is registered for this call.
    ///
    /// # Safety
    /// With `per_call`, `data` must stay allocated (and unchanged, or the
    /// server gets what it holds when the device reads it) until
    /// [`Engine::fence_sends`] of the returned source has returned: the
    /// registration does not keep plain memory alive.
    pub unsafe fn write_source(&self, data: &[u8], per_call: bool) -> Result<Option<UserSrc>> {
        // SAFETY: a cache entry's memory is the entry's own `RegBuf`, kept
        // alive by the returned registration whatever becomes of `data`'s
        // borrow; plain memory is the caller's contract above. No window
        // is ever bound over it for a write and the region has no remote
        // right of its own: only the local device reads it, for the sends
        // (`user_dst`'s exclusivity is about remote writes, which cannot
        // happen here).
        let dst = unsafe { self.user_dst(data.as_ptr() as *mut u8, data.len(), per_call)? };
        Ok(dst.map(|d| UserSrc {
            reg: d.reg,
            off: d.off,
        }))
    }

    /// Return once no posted send reads `src`'s registration any more
    /// (every fragment sent from it has completed, or been flushed). If
    /// that takes longer than the operation timeout, the queue pair is
    /// moved to the error state first (the device reads nothing more).
    pub fn fence_sends(&self, src: &UserSrc) {
        let _waiting = Waiting::new(self);
        let deadline = Instant::now() + self.cfg.op_timeout;
        let mut st = lock(&self.st);
        loop {
            if !st.slot_pins.values().any(|r| Arc::ptr_eq(r, &src.reg)) {
                return;
            }
            let now = Instant::now();
            if now >= deadline {
                self.mark_lost(&mut st, "sends from caller memory did not complete".into());
                self.qp.set_error();
                st.slot_pins.retain(|_, r| !Arc::ptr_eq(r, &src.reg));
                return;
            }
            self.sleep_or_drive(st, (deadline - now).min(Duration::from_millis(5)));
            st = lock(&self.st);
        }
    }

    /// WRITE (`vec_page` None) or VEC_WRITE of all of `data` at `offset` as
    /// one fragmented message (docs/protocol.md §5.12): one request, one
    /// status. Each fragment is one Send of its header (and, for the first,
    /// the request's header) from a send slot, then its data: from `src`
    /// (registered caller memory holding `data`) as a second SGE, no copy;
    /// without `src`, copied into the slot. Waits for a credit and a send
    /// slot per fragment.
    pub fn issue_write_message(
        &self,
        fid: u16,
        offset: u64,
        data: &[u8],
        vec_page: Option<u16>,
        src: Option<&UserSrc>,
    ) -> Result<ReqId> {
        let len = u32::try_from(data.len())
            .map_err(|_| Error::InvalidArgument("write larger than 4 GiB".into()))?;
        self.issue(|e, st| {
            e.fill_send_slots(st);
            let cap = e.fragment_cap(src.is_some());
            let n = st.conn.fragments_for(len, cap) as usize;
            if n == 0 || n > e.send_slots {
                return Some(Err(Error::InvalidArgument(format!(
                    "a write of {len} bytes cannot be one message here"
                ))));
            }
            let credits = usize::from(st.conn.credits());
            if n > e.fragment_credits(st) {
                return Some(Err(client_err(ClientError::TooManyFragments {
                    fragments: n as u32,
                    credits: st.conn.credits(),
                })));
            }
            // Every resource first (a credit and a send slot per fragment),
            // then the status window of polling mode: nothing is bound for
            // an attempt that has to wait.
            if st.conn.transmit_pending() > 0
                || st.send_free.len() < n
                || st.conn.credits_held() + n > credits
            {
                return None;
            }
            let (mode, status) = match e.req_mode(st) {
                Ok(m) => m,
                Err(err) => return Some(Err(err)),
            };
            let plan = match st.conn.write_fragmented(
                Instant::now(),
                fid,
                offset,
                len,
                vec_page,
                mode,
                cap,
            ) {
                Ok(p) => p,
                Err(ClientError::NoCredits) => {
                    e.drop_windows(st, status.into_iter().collect(), 0);
                    return None;
                }
                Err(err) => {
                    e.drop_windows(st, status.into_iter().collect(), 0);
                    return Some(Err(client_err(err)));
                }
            };
            for f in &plan.fragments {
                let Some(slot) = st.send_free.pop() else {
                    // Checked above: n slots were free under this lock.
                    e.mark_lost(st, "no send slot for a fragment".into());
                    return Some(Err(Error::ConnectionLost("no send slot".into())));
                };
                let (h, d) = lwio_proto::client::FragmentedWrite::pieces(f);
                let copy = src.is_none();
                let wrote = e.with_send_slot(slot, |out| {
                    let hl = FRAGMENT_HEADER_LEN;
                    let mut used = hl + h.len();
                    if copy {
                        used += d.len();
                    }
                    let out = out.get_mut(..used)?;
                    f.emit(&mut out[..hl]);
                    out[hl..hl + h.len()].copy_from_slice(&plan.head[h.clone()]);
                    if copy {
                        out[hl + h.len()..].copy_from_slice(&data[d.clone()]);
                    }
                    Some(used)
                });
                let Some(Some(used)) = wrote else {
                    st.send_free.push(slot);
                    e.mark_lost(st, "a fragment does not fit its send slot".into());
                    return Some(Err(Error::ConnectionLost("send slot too small".into())));
                };
                let sge = match src {
                    Some(u) if !d.is_empty() => {
                        st.slot_pins.insert(slot, u.reg.clone());
                        Some(u.reg.mr.sge(u.off + d.start, d.len() as u32))
                    }
                    _ => None,
                };
                if copy {
                    st.stats.send_copy_bytes += d.len() as u64;
                }
                st.send_backlog.push_back(Outgoing {
                    slot,
                    len: used,
                    data: sge,
                });
            }
            st.stats.fragmented_writes += 1;
            st.stats.fragments_sent += plan.fragments.len() as u64;
            Self::keep_window(st, plan.issued.req, status);
            Some(Ok(plan.issued.req))
        })
    }

    /// Issue a request whose payload the caller lends (WRITE, VEC_WRITE):
    /// `encode` writes it straight into a free send slot (the data's only
    /// copy). Messages queued before it go to slots first; without a free
    /// slot the issue waits, like one without a credit. For
    /// [`Engine::issue`] and [`Engine::issue_now`].
    fn in_slot(
        mut encode: impl FnMut(
            &mut ClientConn<ReqData>,
            Mode,
            &mut [u8],
        ) -> std::result::Result<(Issued, usize), ClientError>,
    ) -> impl FnMut(&Engine, &mut Locked) -> Option<Result<ReqId>> {
        move |e, st| {
            e.fill_send_slots(st);
            if st.conn.transmit_pending() > 0 || st.send_free.is_empty() {
                return None;
            }
            let slot = st.send_free.pop()?;
            let (mode, status) = match e.req_mode(st) {
                Ok(m) => m,
                Err(err) => {
                    st.send_free.push(slot);
                    return Some(Err(err));
                }
            };
            let r = e
                .with_send_slot(slot, |out| encode(&mut st.conn, mode, out))
                .unwrap_or(Err(ClientError::InvalidArgument));
            match r {
                Ok((issued, len)) => {
                    st.stats.send_copy_bytes += len.saturating_sub(COMMON_HEADER_LEN) as u64;
                    st.send_backlog.push_back(Outgoing {
                        slot,
                        len,
                        data: None,
                    });
                    Self::keep_window(st, issued.req, status);
                    Some(Ok(issued.req))
                }
                Err(err) => {
                    st.send_free.push(slot);
                    e.drop_windows(st, status.into_iter().collect(), 0);
                    Some(Err(client_err(err)))
                }
            }
        }
    }

    pub fn issue_register(&self, key: SrvResumeKey, flags: u32) -> Result<ReqId> {
        self.issue(|_, st| {
            Some(
                st.conn
                    .register(Instant::now(), key, flags)
                    .map_err(client_err),
            )
        })
    }

    /// FLUSH `fid`: fsync (fdatasync with `data_only`) on the server.
    pub fn issue_flush(&self, fid: u16, data_only: bool) -> Result<ReqId> {
        self.issue(|_, st| {
            Some(
                st.conn
                    .flush(Instant::now(), fid, data_only)
                    .map_err(client_err),
            )
        })
    }

    pub fn issue_close(&self, fid: u16) -> Result<ReqId> {
        self.issue(|_, st| Some(st.conn.close_file(Instant::now(), fid).map_err(client_err)))
    }

    /// An ordering barrier on this connection: returns once every RDMA
    /// Write that the server posted on it before it saw this call's
    /// request is placed in this client's memory.
    ///
    /// The request is CLOSE of FID 0, which is never assigned, so the
    /// server answers it at once with STATUS_INVALID_HANDLE and changes
    /// nothing. The answer is a Send on the same connection after those
    /// Writes, and a receive completes only after the Writes before it are
    /// placed (RFC 5040 §5.5; the same on InfiniBand). On iWARP a Write's
    /// own completion at the server means only that it was sent: here the
    /// soft provider places it when one of this client's threads next
    /// reads the connection, which waiting for the answer does.
    pub fn barrier(&self) -> Result<()> {
        let req = self.issue_close(0)?;
        match self.wait(req, None)? {
            (_, lwio_proto::status::STATUS_INVALID_HANDLE) => Ok(()),
            (_, status) => Err(Error::Status {
                what: "CLOSE of FID 0 (the ordering barrier)".into(),
                status,
            }),
        }
    }

    pub fn issue_cancel(&self, fid: u16) -> Result<ReqId> {
        self.issue_when(ClientConn::can_interrupt, |_, st| {
            Some(st.conn.cancel(Instant::now(), fid).map_err(client_err))
        })
    }

    /// [`Engine::issue_cancel`] without waiting (`Ok(None)`: no credit now).
    pub fn try_issue_cancel(&self, fid: u16) -> Result<Option<ReqId>> {
        self.issue_now_when(ClientConn::can_interrupt, |_, st| {
            Some(st.conn.cancel(Instant::now(), fid).map_err(client_err))
        })
    }

    /// CANCEL just the I/O `req` of `fid`; `None` (nothing sent) when it
    /// is no longer outstanding.
    pub fn issue_cancel_request(&self, fid: u16, req: ReqId) -> Result<Option<ReqId>> {
        if !lock(&self.st).conn.is_outstanding(req) {
            return Ok(None);
        }
        self.issue_when(ClientConn::can_interrupt, Self::cancel_issuer(fid, req))
    }

    /// [`Engine::issue_cancel_request`] without waiting: `Ok(None)` when no
    /// credit is free now, `Ok(Some(None))` when `req` is no longer
    /// outstanding.
    pub fn try_issue_cancel_request(&self, fid: u16, req: ReqId) -> Result<Option<Option<ReqId>>> {
        self.issue_now_when(ClientConn::can_interrupt, Self::cancel_issuer(fid, req))
    }

    fn cancel_issuer(
        fid: u16,
        req: ReqId,
    ) -> impl FnMut(&Engine, &mut Locked) -> Option<Result<Option<ReqId>>> {
        move |_, st| {
            if !st.conn.is_outstanding(req) {
                return Some(Ok(None));
            }
            Some(
                st.conn
                    .cancel_request(Instant::now(), fid, req)
                    .map(Some)
                    .map_err(client_err),
            )
        }
    }

    /// Polling mode: ask the server for a message after its next completion
    /// (an INTERRUPT, unless one is outstanding), so that a caller sleeping
    /// on the completion fd is woken even though a polled completion posts
    /// nothing. Never waits; a no-op when no credit is free.
    pub fn arm_interrupt(&self) {
        let mut st = lock(&self.st);
        self.arm_interrupt_locked(&mut st);
        self.flush_sends(&mut st);
    }

    fn arm_interrupt_locked(&self, st: &mut Locked) {
        if st.lost.is_none()
            && st.conn.interrupt_outstanding().is_none()
            && st.conn.can_interrupt()
            && st.conn.interrupt(Instant::now()).is_ok()
        {
            st.stats.interrupts_sent += 1;
            self.run_actions(st);
        }
    }

    /// Send INTERRUPT (or join the one outstanding) and wait until the
    /// server answers it — after the next I/O completion.
    pub fn interrupt(&self) -> Result<()> {
        let existing = lock(&self.st).conn.interrupt_outstanding();
        let req = match existing {
            Some(r) => r,
            None => {
                let r = self.issue_when(ClientConn::can_interrupt, |_, st| {
                    if st.conn.interrupt_outstanding().is_some() {
                        return Some(Err(Error::Busy("INTERRUPT already outstanding".into())));
                    }
                    let r = st.conn.interrupt(Instant::now()).map_err(client_err);
                    if r.is_ok() {
                        st.stats.interrupts_sent += 1;
                    }
                    Some(r)
                });
                match r {
                    Ok(r) => r,
                    Err(Error::Busy(_)) => match lock(&self.st).conn.interrupt_outstanding() {
                        Some(r) => r,
                        None => return Ok(()),
                    },
                    Err(e) => return Err(e),
                }
            }
        };
        // Wait for the interrupt's answer: it is a normal status response.
        let _waiting = Waiting::new(self);
        let deadline = Instant::now() + self.cfg.op_timeout;
        let mut st = lock(&self.st);
        loop {
            // Its completion is dropped as it comes (`finish_req`).
            if st.conn.interrupt_outstanding() != Some(req) {
                return Ok(());
            }
            if let Some(l) = &st.lost {
                return Err(Error::ConnectionLost(l.clone()));
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::TimedOut("INTERRUPT".into()));
            }
            self.sleep_or_drive(st, (deadline - now).min(Duration::from_millis(50)));
            st = lock(&self.st);
        }
    }

    /// The status block slot of an outstanding polled request (None once it
    /// completed, or with interrupts). [`Engine::wait`] and
    /// [`Engine::try_wait`] no longer need it: they look the slot up
    /// themselves, under the lock that also sees the completion.
    pub fn slot_of(&self, req: ReqId) -> Option<u32> {
        if self.cfg.completion != Completion::Poll {
            return None;
        }
        lock(&self.st).conn.slot_of(req)
    }

    /// Wait for a request's completion: (information, status). The status
    /// block to watch (polling) is the request's own, looked up here under
    /// the lock that also sees its completion; `_slot` (what
    /// [`Engine::slot_of`] said) is ignored and kept for source
    /// compatibility.
    pub fn wait(&self, req: ReqId, _slot: Option<u32>) -> Result<(u32, NtStatus)> {
        let _waiting = Waiting::new(self);
        let slot = {
            // Done already (its completion came in a batch)? Then the
            // requests queued since stay queued for the next real wait.
            let mut st = lock(&self.st);
            if let Some(r) = take_done(&mut st, req) {
                return Ok(r);
            }
            self.flush_sends(&mut st);
            st.conn.slot_of(req)
        };
        let spin_until = Instant::now() + self.cfg.poll_spin;
        let mut sleeps = 0u32;
        // Interrupt mode: busy-polled once already in this wait.
        let mut spun = false;
        loop {
            // Polling: watch our own status block without the lock.
            if let (Completion::Poll, Some(s)) = (self.cfg.completion, slot) {
                let v = self
                    .win_mr
                    .load_u64(self.status_off + s as usize * 8)
                    .unwrap_or(0);
                if !poll_block_written(v) && Instant::now() < spin_until {
                    // Progress in this thread: the soft provider's manual
                    // mode places the data and the status block here,
                    // without waking another thread.
                    self.poll_cq();
                    // Yield every round: a server (or anything else) on
                    // this CPU runs at once instead of after our time slice
                    // (measured: 4 KiB QD1 with both ends on one vCPU,
                    // p50 42.5 µs yielding every 64th round, 24.8 µs every
                    // round; unpinned unchanged at 15 µs).
                    std::thread::yield_now();
                    if let Some(r) = self.peek_done(req)? {
                        return Ok(r);
                    }
                    continue;
                }
            }
            let mut st = lock(&self.st);
            if let Some(s) = slot {
                if self.cfg.completion == Completion::Poll && self.check_slot(&mut st, s) {
                    self.run_actions(&mut st);
                }
            }
            if let Some(r) = take_done(&mut st, req) {
                return Ok(r);
            }
            if let Some(l) = &st.lost {
                let l = l.clone();
                self.abandon(&mut st, req);
                return Err(Error::ConnectionLost(l));
            }
            // Its deadline is the state machine's (op timeout from issue).
            let now = Instant::now();
            st.conn.handle_timeout(now);
            self.run_actions(&mut st);
            if st.conn.is_timed_out(req) {
                self.abandon(&mut st, req);
                return Err(Error::TimedOut(format!("request {req}")));
            }
            if !st.conn.is_outstanding(req) {
                return Err(Error::InvalidArgument(format!(
                    "request {req} is not outstanding (taken already, or never issued)"
                )));
            }
            let until = st
                .conn
                .poll_timeout()
                .map_or(Duration::MAX, |t| t.saturating_duration_since(now));
            let mut wait = Duration::from_millis(50);
            if self.cfg.completion == Completion::Poll && slot.is_some() {
                // Spin budget spent: ask to be woken by the next completion.
                self.arm_interrupt_locked(&mut st);
                // Sleep until the INTERRUPT's answer wakes us (it follows
                // the server's next completion). A polled completion itself
                // wakes nobody, and ours may have landed just before the
                // server saw the INTERRUPT, which then waits for a later
                // completion: so the sleep is bounded, 1 ms at first and
                // doubling to 64 ms while nothing comes (a long wait costs
                // a few wake-ups, not one per millisecond; that race costs
                // at most the current step).
                wait = Duration::from_millis(1 << sleeps.min(6));
                sleeps += 1;
            }
            if !spun
                && self.cfg.completion == Completion::Interrupt
                && !self.cfg.busy_poll.is_zero()
            {
                spun = true;
                if let Some(_spinner) = self.busy_poll_turn().then(Spinner::enter).flatten() {
                    drop(st);
                    if let Some(r) = self.busy_poll(req)? {
                        return Ok(r);
                    }
                    continue;
                }
            }
            self.sleep_or_drive(st, wait.min(until));
        }
    }

    /// Interrupt mode, before the first sleep of a wait: poll the
    /// completion queue (under manual progress: the sockets, in this
    /// thread) for up to `busy_poll`, yielding the CPU each round, and
    /// return `req`'s completion if it came meanwhile.
    fn busy_poll(&self, req: ReqId) -> Result<Option<(u32, NtStatus)>> {
        let until = Instant::now() + self.cfg.busy_poll;
        loop {
            self.poll_cq();
            if let Some(r) = self.peek_done(req)? {
                self.busy_poll_hits.fetch_add(1, Ordering::Relaxed);
                self.busy_poll_score(true);
                return Ok(Some(r));
            }
            if Instant::now() >= until {
                self.busy_poll_score(false);
                return Ok(None);
            }
            std::thread::yield_now();
        }
    }

    /// Count a busy poll that ended with its reply (`hit`) or without.
    fn busy_poll_score(&self, hit: bool) {
        let s = self.busy_poll_score.load(Ordering::Relaxed);
        self.busy_poll_score
            .store(busy_poll_score(s, hit), Ordering::Relaxed);
    }

    /// Whether this wait busy-polls: while at least about one poll in
    /// eight ends with its reply ([`busy_poll_score`]); below that (replies
    /// that take longer than the window: deep queues, large or slow I/O),
    /// only every 16th wait polls, so such a connection spends almost
    /// nothing on it and finds out when its replies are fast again.
    fn busy_poll_turn(&self) -> bool {
        busy_poll_turn(
            self.busy_poll_score.load(Ordering::Relaxed),
            self.waits.load(Ordering::Relaxed),
        )
    }

    /// Block for at most `wait`: as the driver if nobody is (the completion
    /// that ends the wait then wakes this thread directly), else on the
    /// condition variable the driver signals.
    fn sleep_or_drive(&self, mut st: MutexGuard<'_, Locked>, wait: Duration) {
        self.flush_sends(&mut st);
        if self.take_driver() {
            drop(st);
            let driving = Driving(self);
            self.drive(wait);
            drop(driving);
            if self.waiters.load(Ordering::Acquire) > 1 {
                // Others wait on the condition variable: one of them takes
                // the driver role now.
                self.cv.notify_all();
            }
            return;
        }
        drop(self.cv_wait(st, wait));
    }

    /// Sleep on `cv` for at most `wait` (counted in `cv_sleepers` while
    /// asleep, under the lock).
    fn cv_wait<'a>(&self, st: MutexGuard<'a, Locked>, wait: Duration) -> MutexGuard<'a, Locked> {
        self.cv_sleepers.fetch_add(1, Ordering::Relaxed);
        let st = self
            .cv
            .wait_timeout(st, wait)
            .unwrap_or_else(|p| p.into_inner())
            .0;
        self.cv_sleepers.fetch_sub(1, Ordering::Relaxed);
        st
    }

    /// Wake the threads asleep on `cv`, if there are any. Only with the
    /// state lock held (`st: &mut Locked`): a sleeper counts itself under
    /// that lock before it sleeps, and `Condvar::wait` releases it only
    /// once the sleeper is on the condition variable, so a notifier that
    /// holds the lock either sees the count or changed the state before
    /// the sleeper looked at it. std's condition variable makes a system
    /// call on every notify, sleepers or not, and this is on every
    /// completion's path (one `futex` per I/O before).
    fn notify_sleepers(&self, _st: &mut Locked) {
        if self.cv_sleepers.load(Ordering::Relaxed) > 0 {
            self.cv.notify_all();
        }
    }

    /// Staging buffers free now for a read of `len` bytes (small reads may
    /// also take a bounce buffer). A caller that reaps its own completions
    /// (the C batch API) issues staged reads only while this is enough:
    /// staging buffers come back only when their reads are finished.
    pub fn free_stages(&self, len: usize) -> usize {
        let st = lock(&self.st);
        st.stage_free.len()
            + if len <= BOUNCE_SLOT {
                st.bounce_free.len()
            } else {
                0
            }
    }

    /// Reads at least this long into unregistered caller memory register it
    /// for the call (and land with no copy); shorter ones are staged.
    pub fn register_threshold(&self) -> usize {
        self.cfg.register_threshold
    }

    /// How this engine reaps completions (polled status blocks or
    /// interrupts).
    pub fn completion_mode(&self) -> Completion {
        self.cfg.completion
    }

    /// The completion of `req` if it has arrived, without blocking. With
    /// `drive`, first runs the completion queue once, as a waiting caller
    /// does; without, only looks (cheap: for the requests after the first
    /// of a batch, whose completions the first one's progress brought in).
    /// The C API's batch reaping uses it.
    /// The status block is looked up as by [`Engine::wait`]; `_slot` is
    /// ignored.
    pub fn try_wait(
        &self,
        req: ReqId,
        _slot: Option<u32>,
        drive: bool,
    ) -> Result<Option<(u32, NtStatus)>> {
        let slot = {
            let mut st = lock(&self.st);
            if let Some(r) = take_done(&mut st, req) {
                return Ok(Some(r));
            }
            self.flush_sends(&mut st);
            st.conn.slot_of(req)
        };
        if drive {
            self.poll_cq();
        }
        let mut st = lock(&self.st);
        if let Some(s) = slot {
            if self.cfg.completion == Completion::Poll && self.check_slot(&mut st, s) {
                self.run_actions(&mut st);
            }
        }
        self.take_done(&mut st, req)
    }

    fn peek_done(&self, req: ReqId) -> Result<Option<(u32, NtStatus)>> {
        match self.st.try_lock() {
            Ok(mut st) => self.take_done(&mut st, req),
            Err(_) => Ok(None),
        }
    }

    /// `req`'s completion if it came; an error (and the request abandoned)
    /// if the connection is lost.
    fn take_done(&self, st: &mut Locked, req: ReqId) -> Result<Option<(u32, NtStatus)>> {
        // Completions the state machine has seen but whose events were not
        // carried out yet (another thread polled them and let go of the
        // lock before `run_actions`): carry them out first, so the request's
        // windows are invalidated (`finish_req`) before its record is taken
        // away. Taking it first left them bound (lwio-e2e-rxe, 1 run in 6).
        self.run_actions(st);
        if let Some(r) = take_done(st, req) {
            return Ok(Some(r));
        }
        if let Some(l) = &st.lost {
            let l = l.clone();
            self.abandon(st, req);
            return Err(Error::ConnectionLost(l));
        }
        Ok(None)
    }

    /// The waiter gives up: the engine frees the request's stage when (if)
    /// it completes. The stage must not be freed by the waiter.
    fn abandon(&self, st: &mut Locked, req: ReqId) {
        if let Some(r) = st.conn.user_mut(req) {
            r.abandoned = true;
        }
    }

    /// A waiter gave up on `req` (async future dropped): free its resources
    /// when it completes.
    pub fn abandon_req(&self, req: ReqId) {
        let mut st = lock(&self.st);
        if let Some(d) = st.conn.take_done(req) {
            if let Some(s) = d.user.stage {
                free_stage(&mut st, s);
            }
            return;
        }
        self.abandon(&mut st, req);
    }

    // ------------------------------------------------------ caller memory

    /// Where a read of `len` bytes at `ptr` lands in caller memory: the
    /// cached registration when the range lies in a
    /// [`crate::RegisteredBuf`], otherwise (if `per_call`) a
    /// registration made now for this call, dropped with the returned value;
    /// `None` when neither applies. Each call gets a new group for
    /// [`Engine::fence_group`].
    ///
    /// # Safety
    /// `ptr..ptr + len` must be memory the caller holds exclusively, with no
    /// Rust reference over it while the read runs: a raw pointer (C
    /// memory, or a [`crate::RegisteredBuf`]'s own pointer under its
    /// `&mut`), since a cached registration's writes do not go through a
    /// pointer derived from any reference the caller holds. It must stay
    /// allocated until `fence_group(dst.group)` has returned and the
    /// returned value is dropped. Use [`Engine::slice_dst`] for a `&mut
    /// [u8]`.
    pub unsafe fn user_dst(
        &self,
        ptr: *mut u8,
        len: usize,
        per_call: bool,
    ) -> Result<Option<UserDst>> {
        // SAFETY: the caller's contract, which is this one's with the cache.
        unsafe { self.caller_dst(ptr, len, per_call, true) }
    }

    /// As [`Engine::user_dst`] for memory behind a `&mut [u8]` that the
    /// caller holds (and does not use) while the read runs: never the
    /// registration cache, only (with `per_call`) a registration of `ptr`
    /// made now, so every write the peer makes goes through a pointer
    /// derived from the caller's reference, which the aliasing model allows
    /// while that reference is not used. `None` otherwise (the caller
    /// stages), also for a slice of a [`crate::RegisteredBuf`].
    ///
    /// # Safety
    /// `ptr` must be derived from a `&mut [u8]` of `len` bytes that the
    /// caller holds exclusively and does not use until
    /// `fence_group(dst.group)` has returned and the returned value is
    /// dropped.
    pub unsafe fn slice_dst(
        &self,
        ptr: *mut u8,
        len: usize,
        per_call: bool,
    ) -> Result<Option<UserDst>> {
        // SAFETY: the caller's contract; without the cache the only
        // registration is of `ptr` itself, which the caller's reference
        // keeps allocated until the group is fenced.
        unsafe { self.caller_dst(ptr, len, per_call, false) }
    }

    /// [`Engine::user_dst`] (`cached`) or [`Engine::slice_dst`].
    ///
    /// # Safety
    /// That of the public function called.
    unsafe fn caller_dst(
        &self,
        ptr: *mut u8,
        len: usize,
        per_call: bool,
        cached: bool,
    ) -> Result<Option<UserDst>> {
        // Caller memory, like the engine's: no remote right of its own, only
        // the windows bound per read.
        let access = Access::LOCAL_WRITE | Access::MW_BIND;
        let mut st = lock(&self.st);
        let group = st.next_group;
        st.next_group += 1;
        let hit = if cached {
            st.cache.find(ptr as usize, len).map(|(k, _)| k)
        } else {
            None
        };
        if let Some(start) = hit {
            st.cache.tick += 1;
            let tick = st.cache.tick;
            let Locked { cache, stats, .. } = &mut *st;
            let need = cache
                .entries
                .get(&start)
                .map_or(0, |e| if e.reg.is_none() { e.len } else { 0 });
            if need > 0 {
                cache.make_room(need, stats);
            }
            let Some(e) = cache.entries.get_mut(&start) else {
                return Err(Error::Io("registration cache entry vanished".into()));
            };
            e.last_use = tick;
            let reg = match &e.reg {
                Some(r) => {
                    stats.reg_cache_hits += 1;
                    r.clone()
                }
                None => {
                    // SAFETY: the memory is the entry's `RegBuf`, and the
                    // registration keeps an `Arc` of it (`UserReg::_mem`),
                    // so it stays allocated for as long as the region exists.
                    // The region's own keys are never sent; the peer reaches
                    // it only through one-shot windows bound by a read into
                    // the buffer, which the read fences before it returns,
                    // and such a read comes only through `user_dst`, whose
                    // contract excludes any Rust reference over the range
                    // meanwhile (a `&mut` slice of the buffer takes
                    // `slice_dst`, which never uses this registration).
                    let mr = unsafe { self.pd.register_raw(e.mem.as_ptr(), e.len, access)? };
                    let r = Arc::new(UserReg {
                        mr,
                        _mem: Some(e.mem.clone()),
                    });
                    e.reg = Some(r.clone());
                    cache.reg_entries += 1;
                    cache.reg_bytes += e.len;
                    stats.reg_cache_misses += 1;
                    r
                }
            };
            return Ok(Some(UserDst {
                reg,
                off: ptr as usize - start,
                group,
            }));
        }
        if !per_call {
            return Ok(None);
        }
        // SAFETY: the caller's contract (exclusively held, allocated until
        // the group is fenced and this registration dropped).
        let mr = unsafe { self.pd.register_raw(ptr, len, access)? };
        st.stats.call_registrations += 1;
        Ok(Some(UserDst {
            reg: Arc::new(UserReg { mr, _mem: None }),
            off: 0,
            group,
        }))
    }

    /// Return once no remote write can reach the caller memory of `group`
    /// any more: every window of the group was invalidated and the
    /// invalidation completed. If a request of the group is still
    /// outstanding (its waiter gave up), or the invalidations do not
    /// complete in time, the queue pair is moved to the error state (no
    /// further remote access is executed) and the connection is lost.
    pub fn fence_group(&self, group: u64) {
        let _waiting = Waiting::new(self);
        let deadline = Instant::now() + self.cfg.op_timeout;
        let mut st = lock(&self.st);
        let kill = |st: &mut Locked, why: &str| {
            self.qp.set_error();
            st.inval_pending.remove(&group);
            if !why.is_empty() {
                self.mark_lost(st, why.into());
            }
        };
        if st.conn.outstanding_users().any(|r| r.group == group) {
            kill(
                &mut st,
                "a read into caller memory did not complete; the connection is closed so that \
                 no late write can reach the buffer",
            );
            return;
        }
        loop {
            if !st.inval_pending.contains_key(&group) {
                return;
            }
            if st.lost.is_some() || self.qp.state() == QpState::Error {
                kill(&mut st, "");
                return;
            }
            let now = Instant::now();
            if now >= deadline {
                kill(&mut st, "invalidating caller-memory windows timed out");
                return;
            }
            self.sleep_or_drive(st, (deadline - now).min(Duration::from_millis(50)));
            st = lock(&self.st);
        }
    }

    /// Add an explicitly registered buffer to the registration cache and
    /// register it. Returns its start address (the cache key).
    pub(crate) fn cache_insert(&self, mem: Arc<RegBuf>) -> Result<usize> {
        let start = mem.as_ptr() as usize;
        let len = mem.len();
        if len > self.cfg.reg_cache_bytes {
            return Err(Error::InvalidArgument(format!(
                "a registered buffer of {len} bytes exceeds the registration cache ({} bytes)",
                self.cfg.reg_cache_bytes
            )));
        }
        let mut st = lock(&self.st);
        st.cache.entries.insert(
            start,
            CacheEntry {
                mem,
                len,
                reg: None,
                last_use: 0,
            },
        );
        drop(st);
        // Register now (so the first read does not pay for it).
        // SAFETY: no read runs here: with `per_call` false and the entry just
        // inserted this takes the cached path, which only registers the
        // entry's own `RegBuf` (kept alive by the entry and the
        // registration's `Arc`) and binds no window; the returned `UserDst`
        // is a fresh group with nothing to fence and is dropped at once. No
        // Rust reference to the buffer exists yet: the `RegisteredBuf` that
        // hands them out is created only after we return.
        let first = unsafe { self.user_dst(start as *mut u8, len, false) };
        match first {
            Ok(_) => Ok(start),
            Err(e) => {
                lock(&self.st).cache.entries.remove(&start);
                Err(e)
            }
        }
    }

    /// Explicit release of a registered buffer: its registration is
    /// deregistered and the entry forgotten.
    pub(crate) fn cache_release(&self, start: usize) {
        let mut st = lock(&self.st);
        if let Some(e) = st.cache.entries.remove(&start) {
            if e.reg.is_some() {
                st.cache.reg_entries -= 1;
                st.cache.reg_bytes -= e.len;
            }
        }
    }
}

/// `req`'s completion, if it came: (information, status). Its stage (if
/// any) stays the caller's, who got it at issue.
fn take_done(st: &mut Locked, req: ReqId) -> Option<(u32, NtStatus)> {
    st.conn.take_done(req).map(|d| (d.information, d.status))
}

fn free_stage(st: &mut Locked, s: Stage) {
    match s {
        Stage::Bounce(i) => st.bounce_free.push(i),
        Stage::Slot(i) => st.stage_free.push(i),
        Stage::User => {}
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        // The progress thread may sleep without a deadline: it wakes, finds
        // the engine gone and ends.
        self.wake_progress();
        let _ = self.qp.disconnect();
    }
}

/// A busy-poll score of 1: every poll ends with its reply.
const BUSY_POLL_SCORE_ONE: u32 = 1024;
/// Below this score (about one poll in eight ending with its reply) a
/// connection polls only on every [`BUSY_POLL_PROBE`]-th wait.
const BUSY_POLL_SCORE_MIN: u32 = BUSY_POLL_SCORE_ONE / 8;
const BUSY_POLL_PROBE: u64 = 16;

/// Threads of this process busy-polling in interrupt mode now.
static SPINNERS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// A place among the threads of the process that busy-poll before they
/// sleep (interrupt mode, [`EngineConfig::busy_poll`]): at most one per CPU
/// this process may run on. More spinners than CPUs would only take turns
/// with the threads (and, on one host, the server) whose work they wait for.
struct Spinner;

impl Spinner {
    fn enter() -> Option<Spinner> {
        static CPUS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
        let cpus =
            *CPUS.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
        // Not `then_some(Spinner)`: that builds the guard even when no
        // place was taken, and its drop gives back a place never held.
        take_place(&SPINNERS, cpus).then(|| Spinner)
    }
}

impl Drop for Spinner {
    fn drop(&mut self) {
        SPINNERS.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The share of busy polls that ended with their reply, as a moving
/// average (1/8 weight to the newest) scaled to [`BUSY_POLL_SCORE_ONE`].
fn busy_poll_score(score: u32, hit: bool) -> u32 {
    if hit {
        score + (BUSY_POLL_SCORE_ONE - score.min(BUSY_POLL_SCORE_ONE)) / 8
    } else {
        score - score / 8
    }
}

/// [`Engine::busy_poll_turn`]: whether wait number `waits` polls, at
/// `score`.
fn busy_poll_turn(score: u32, waits: u64) -> bool {
    score >= BUSY_POLL_SCORE_MIN || waits.is_multiple_of(BUSY_POLL_PROBE)
}

/// One of `cap` places counted in `count`, if one is free.
fn take_place(count: &std::sync::atomic::AtomicUsize, cap: usize) -> bool {
    if count.fetch_add(1, Ordering::AcqRel) < cap {
        true
    } else {
        count.fetch_sub(1, Ordering::AcqRel);
        false
    }
}

/// Counts a caller inside `wait`/`issue` for as long as it lives.
struct Waiting<'a>(&'a Engine);

impl<'a> Waiting<'a> {
    fn new(e: &'a Engine) -> Waiting<'a> {
        e.waiters.fetch_add(1, Ordering::AcqRel);
        e.waits.fetch_add(1, Ordering::Relaxed);
        Waiting(e)
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        let e = self.0;
        if e.waiters.fetch_sub(1, Ordering::AcqRel) == 1
            && e.standby_wake.load(Ordering::Relaxed)
            && e.standby_wake.swap(false, Ordering::AcqRel)
        {
            // The last caller left while the progress thread stands by and
            // someone reaps through the notify fd: it takes over now.
            e.wake_progress();
        }
    }
}

/// Gives the driver role back when a caller's turn as the driver ends
/// (also by unwinding).
struct Driving<'a>(&'a Engine);

impl Drop for Driving<'_> {
    fn drop(&mut self) {
        self.0.release_driver();
    }
}

/// The progress thread's first nap standing by while callers drive; each
/// further one that finds them still at it is twice as long, up to
/// [`STANDBY_MAX`].
const STANDBY_FIRST: Duration = Duration::from_millis(2);
/// The longest nap standing by: a client whose callers keep waiting costs
/// 20 wake-ups a second (a fixed 2 ms nap cost 500: with 256 busy clients
/// on two CPUs, 128,000 a second and a quarter of the machine, issue 13),
/// and one whose callers stopped is driven again within two of them.
const STANDBY_MAX: Duration = Duration::from_millis(50);

/// The progress thread: the driver while no caller waits. Between rounds
/// it sleeps on the completion channel and its wake-up eventfd until the
/// next deadline ([`Engine::next_wake`]), holding the driver role but not
/// the engine (dropping the engine wakes it, and it ends). While callers
/// wait (and so drive) it stands by, napping on its eventfd for
/// [`STANDBY_FIRST`] doubling to [`STANDBY_MAX`], and takes the role back
/// after a nap in which no caller waited at all (or at once when the last
/// one leaves while the notify fd is in use: `Engine::standby_wake`).
fn progress_loop(
    weak: std::sync::Weak<Engine>,
    chan: CompChannel,
    wake: Arc<std::os::fd::OwnedFd>,
) {
    // Whether this thread holds the driver role (across its sleep).
    let mut driving = false;
    // Standing by: the next nap, the callers' waits counted at the last
    // look, and whether the last nap was ended by the eventfd.
    let mut standby = STANDBY_FIRST;
    let mut seen_waits = 0u64;
    let mut woken = false;
    loop {
        let Some(e) = weak.upgrade() else {
            debug!("client progress thread ends: the engine is gone");
            return;
        };
        if e.stop.load(Ordering::Acquire) {
            if driving {
                e.release_driver();
            }
            debug!("client progress thread ends: stopped");
            return;
        }
        e.wakeups.fetch_add(1, Ordering::Relaxed);
        if !driving {
            // Callers drive the CQ themselves while they wait: stand by
            // until one whole nap passes without any (they may be between
            // two waits now), so a busy client is not driven by two threads
            // in turn.
            let waits = e.waits.load(Ordering::Acquire);
            let busy = e.waiters.load(Ordering::Acquire) > 0 || (waits != seen_waits && !woken);
            seen_waits = waits;
            if busy || !e.take_driver() {
                let nap = standby;
                standby = (standby * 2).min(STANDBY_MAX);
                let reapers = lock(&e.st).notify.is_some();
                e.standby_wake.store(reapers, Ordering::Release);
                if reapers && busy && e.waiters.load(Ordering::Acquire) == 0 {
                    // The last caller left before the flag was up. (Not
                    // when the driver role was what we missed: its holder
                    // is about to let go, and we nap rather than spin.)
                    e.standby_wake.store(false, Ordering::Release);
                    woken = true;
                    continue;
                }
                drop(e);
                woken = nap_standby(&wake, nap);
                continue;
            }
            standby = STANDBY_FIRST;
            driving = true;
        }
        woken = false;
        if !e.progress_round() {
            e.release_driver();
            let why = lock(&e.st).lost.clone().unwrap_or_default();
            info!(reason = %why, "client progress thread ends: the connection is lost");
            return;
        }
        if e.waiters.load(Ordering::Acquire) > 0 {
            // A caller started waiting meanwhile (on the condition
            // variable, the driver role being taken): hand it over.
            e.release_driver();
            driving = false;
            e.cv.notify_all();
            continue;
        }
        let until = e.plan_nap();
        drop(e);
        nap(&chan, &wake, until);
    }
}

/// Stand by for `nap` or until `wake` is signalled (consumed): whether it
/// was.
fn nap_standby(wake: &std::os::fd::OwnedFd, nap: Duration) -> bool {
    use rustix::event::{PollFd, PollFlags, Timespec};
    let timeout = Timespec {
        tv_sec: nap.as_secs().try_into().unwrap_or(i64::MAX),
        tv_nsec: nap.subsec_nanos().into(),
    };
    let mut fds = [PollFd::new(wake, PollFlags::IN)];
    let _ = rustix::event::poll(&mut fds, Some(&timeout));
    if fds[0].revents().is_empty() {
        return false;
    }
    let mut count = [0u8; 8];
    let _ = rustix::io::read(wake, &mut count);
    true
}

/// Sleep until `chan` has an event (for the soft provider's manual
/// progress also: its sockets have work), `wake` is signalled, or `until`.
/// The event stays for the next round to take; the wake-up is consumed.
fn nap(chan: &CompChannel, wake: &std::os::fd::OwnedFd, until: Option<Instant>) {
    use rustix::event::{PollFd, PollFlags, Timespec};
    let timeout = until.map(|t| {
        let d = t.saturating_duration_since(Instant::now());
        Timespec {
            tv_sec: d.as_secs().try_into().unwrap_or(i64::MAX),
            tv_nsec: d.subsec_nanos().into(),
        }
    });
    // SAFETY: the descriptor belongs to `chan`, which this thread keeps
    // alive (a clone of the engine's channel) for as long as the borrow
    // lasts: this function.
    let chan_fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(chan.fd()) };
    let mut fds = [
        PollFd::from_borrowed_fd(chan_fd, PollFlags::IN),
        PollFd::new(wake, PollFlags::IN),
    ];
    // EINTR or an error: the next round looks (an error of the channel
    // shows there).
    let _ = rustix::event::poll(&mut fds, timeout.as_ref());
    if !fds[1].revents().is_empty() {
        let mut count = [0u8; 8];
        let _ = rustix::io::read(wake, &mut count);
    }
}

/// "STATUS_ACCESS_DENIED (0xc0000022)".
pub fn status_text(s: NtStatus) -> String {
    match lwio_proto::status::name(s) {
        Some(n) => format!("{n} ({s:#010x})"),
        None => format!("NTSTATUS {s:#010x}"),
    }
}

/// Memory objects (docs/memory-objects.md, `crate::publish`): a publication
/// registers its range in the domain of the channel that carries it. Kept
/// apart from the driver above.
impl Engine {
    pub(crate) fn pd(&self) -> &Pd {
        &self.pd
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn busy_poll_places_are_one_per_cpu() {
        let count = std::sync::atomic::AtomicUsize::new(0);
        assert!(take_place(&count, 2));
        assert!(take_place(&count, 2));
        // Full: refused, and the refusal leaves the count as it was.
        assert!(!take_place(&count, 2));
        assert_eq!(count.load(Ordering::Relaxed), 2);
        count.fetch_sub(1, Ordering::AcqRel);
        assert!(take_place(&count, 2));
        assert!(!take_place(&count, 2));
    }

    #[test]
    fn busy_polling_follows_how_often_it_pays() {
        let polls = |score| (0..256u64).filter(|&w| busy_poll_turn(score, w)).count();
        let after = |hits: &[bool]| {
            hits.iter()
                .fold(BUSY_POLL_SCORE_ONE, |s, &h| busy_poll_score(s, h))
        };
        assert_eq!(polls(after(&[])), 256);
        // Two polls in five that catch their reply keep polling on.
        let mix: Vec<bool> = (0..200).map(|i| i % 5 < 2).collect();
        assert_eq!(polls(after(&mix)), 256);
        // One in twenty does not: every 16th wait polls, to find out.
        let rare: Vec<bool> = (0..200).map(|i| i % 20 == 0).collect();
        assert_eq!(polls(after(&rare)), 16);
        // All misses: the score stays within bounds and recovers with hits.
        let s = after(&[false; 1000]);
        assert_eq!(polls(s), 16);
        let back = (0..30).fold(s, |s, _| busy_poll_score(s, true));
        assert_eq!(polls(back), 256);
        assert!(back <= BUSY_POLL_SCORE_ONE);
    }
}
