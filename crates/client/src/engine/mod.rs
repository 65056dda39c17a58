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

mod issue;
mod memory;
mod progress;
mod wait;

use progress::progress_loop;
use wait::{Waiting, BUSY_POLL_SCORE_ONE};

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
    /// Posts of request messages to the QP (each carries one or more: one
    /// system call on the soft provider). Requests wait for their issuer's
    /// next real wait, so a burst leaves in one post.
    pub send_posts: u64,
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
struct EngineState {
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
    /// Keys of the windows bound over one status block each, with their
    /// slot: their invalidation gives the slot back to the state machine.
    status_keys: HashMap<u32, u32>,
    next_group: u64,
    cache: RegCache,
    auth: Option<std::result::Result<(u64, u16), NtStatus>>,
    stats: ClientStats,
    /// An eventfd signalled at every completion ([`Engine::set_notify`]).
    notify: Option<Arc<std::os::fd::OwnedFd>>,
    /// How the progress thread sleeps now (set by it before it sleeps,
    /// cleared when it wakes or is woken).
    nap: ProgressSleep,
}

/// The progress thread's sleep on the completion channel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ProgressSleep {
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
    state: Mutex<EngineState>,
    cv: Condvar,
    /// Threads asleep on `cv` (counted under `state`): see
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
    /// Set with `EngineState::lost` (never cleared): [`Engine::lost`] checks it
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

fn lock(m: &Mutex<EngineState>) -> MutexGuard<'_, EngineState> {
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
        // Full interrupt-mode reads may complete by RDMA Write with
        // Immediate where this device receives them (rxe, the soft
        // provider; not siw).
        ccfg.accepts_immediate = ctx.device().caps.as_ref().is_some_and(|c| c.write_with_imm);
        let mut mw_free = Vec::new();
        for _ in 0..(cfg.stage_slots * 4 + BOUNCE_SLOTS) {
            mw_free.push(pd.alloc_mw()?);
        }
        let state = EngineState {
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
            status_keys: HashMap::new(),
            next_group: 1,
            cache: RegCache::new(cfg.reg_cache_bytes, cfg.reg_cache_entries),
            auth: None,
            stats: ClientStats::default(),
            notify: None,
            nap: ProgressSleep::Awake,
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
            state: Mutex::new(state),
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
                        let mut state = lock(&e.state);
                        e.mark_lost(&mut state, format!("the progress thread panicked: {msg}"));
                    }
                }
            })
            .map_err(|e| Error::Io(format!("cannot start the progress thread: {e}")))?;
        *e.progress.lock().unwrap_or_else(|p| p.into_inner()) = Some(t);
        // AUTH.
        {
            let mut state = lock(&e.state);
            state.conn.start(Instant::now()).map_err(client_err)?;
            e.run_actions(&mut state);
            let deadline = Instant::now() + e.cfg.auth_timeout;
            loop {
                if let Some(r) = state.auth {
                    drop(auth_mw);
                    return match r {
                        Ok((session, credits)) => {
                            info!(%addr, provider, session, credits, "RDMA channel authenticated");
                            drop(state);
                            Ok(e)
                        }
                        Err(status) => {
                            drop(state);
                            e.shutdown();
                            Err(Error::AccessDenied(format!(
                                "the server refused the RDMA authentication ({})",
                                status_text(status)
                            )))
                        }
                    };
                }
                if let Some(l) = &state.lost {
                    let l = l.clone();
                    drop(state);
                    e.shutdown();
                    return Err(Error::ConnectionLost(format!(
                        "during RDMA authentication: {l}"
                    )));
                }
                let now = Instant::now();
                if now >= deadline {
                    drop(state);
                    e.shutdown();
                    return Err(Error::TimedOut("RDMA authentication".into()));
                }
                state = e.cv_wait(state, deadline - now);
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
        lock(&self.state).lost.clone()
    }

    /// [`Engine::lost`], after asking the provider whether the queue pair
    /// is in the error state (then it is marked lost): for a call that
    /// failed with an RDMA error (posting on a dead queue pair) before the
    /// completions said so. A system call on verbs devices: errors only.
    pub(crate) fn check_lost(&self) -> Option<String> {
        let mut state = lock(&self.state);
        if state.lost.is_none() && self.qp.state() == QpState::Error {
            self.mark_lost(&mut state, "the queue pair is in the error state".into());
        }
        state.lost.clone()
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
            let mut state = lock(&self.state);
            if state.lost.is_none() {
                state.lost = Some("the client closed the connection".into());
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
    #[cfg(feature = "test-support")]
    pub fn census(&self) -> lwio_rdma::PdCensus {
        self.pd.census()
    }

    /// Whether the progress thread runs (it ends only with the engine, a
    /// stop, or a lost connection, and says which in the log).
    #[cfg(feature = "test-support")]
    pub fn progress_running(&self) -> bool {
        self.progress
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .is_some_and(|t| !t.is_finished())
    }

    pub fn stats(&self) -> ClientStats {
        let state = lock(&self.state);
        let mut s = state.stats.clone();
        s.credits = state.conn.credits();
        s.progress_wakeups = self.wakeups.load(Ordering::Relaxed);
        s.busy_poll_hits = self.busy_poll_hits.load(Ordering::Relaxed);
        s
    }

    /// Restart the `max_outstanding` high-water mark from the current count.
    pub fn reset_peak(&self) {
        let mut state = lock(&self.state);
        state.stats.max_outstanding = state.conn.outstanding();
    }

    /// Whether the server serves FLUSH on this connection.
    pub fn server_flushes(&self) -> bool {
        lock(&self.state).conn.server_flushes()
    }

    pub fn credits(&self) -> u16 {
        lock(&self.state).conn.credits()
    }

    /// Payload limit of one WRITE / VEC_WRITE.
    pub fn max_write(&self) -> usize {
        let state = lock(&self.state);
        let server = state
            .conn
            .server_params()
            .map_or(0, |p| p.max_recv_buffer_size as usize);
        server.min(self.send_slot - COMMON_HEADER_LEN).max(1)
    }

    /// Largest read per request.
    pub fn max_read(&self) -> usize {
        let state = lock(&self.state);
        let server = state
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
            let state = lock(&self.state);
            state
                .conn
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
        lock(&self.state)
            .conn
            .server_params()
            .map_or(4096, |p| p.page_size)
    }

    pub fn client_page_size(&self) -> u16 {
        4096
    }

    // ------------------------------------------------------------ actions
}

/// `req`'s completion, if it came: (information, status). Its stage (if
/// any) stays the caller's, who got it at issue.
fn take_done(state: &mut EngineState, req: ReqId) -> Option<(u32, NtStatus)> {
    state.conn.take_done(req).map(|d| (d.information, d.status))
}

fn free_stage(state: &mut EngineState, s: Stage) {
    match s {
        Stage::Bounce(i) => state.bounce_free.push(i),
        Stage::Slot(i) => state.stage_free.push(i),
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
    use super::wait::{busy_poll_score, busy_poll_turn, take_place};
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
