//! Reactors: a fixed set of server threads, each driving many RDMA
//! connections (issue 13; SPDK's poll groups, nvmet-rdma's completion
//! threads).
//!
//! A reactor owns an epoll set over its connections' completion channels
//! (with the soft provider also readable when a connection's socket has
//! input) and their wakers (storage completions, credit and shutdown
//! control), plus its own inbox waker. Each round it turns the connections
//! that had an event and the **hot** ones — those with I/O work within
//! `busy_poll` (`busy_poll_polled` after a completion a client polls for) —
//! without sleeping: busy polling after activity is per reactor, and a
//! request is served entirely on the thread that received it. When no
//! connection is hot it arms their CQs (re-polling once to close the race)
//! and sleeps in `epoll_wait` until an event or the next timer. Every
//! [`super::driver::STATS_FLUSH`] it runs each idle connection's timers,
//! credit balancing and counters without touching its queues, in slices
//! of [`TICK_SLICE`] connections or more spread over that period (up to 25
//! of them), so that no round stops for a thousand connections at once.
//!
//! A new connection goes to the reactor with the fewest connections.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use lwio_rdma::Wc;
use rustix::event::epoll::{self, Event, EventData, EventFlags};
use tracing::{info, warn};

use super::driver::{lock, Conn, Shared, STATS_FLUSH};
use super::Waker;

/// The token of a reactor's own waker in its epoll set (connection slots
/// use `2 * slot` and `2 * slot + 1`).
const INBOX: u64 = u64::MAX;
/// The token of its io_uring's eventfd.
const RING: u64 = u64::MAX - 1;
/// The token of its domain `d`'s completion channel: `DOMAIN - d`.
const DOMAIN: u64 = u64::MAX - 2;

/// How a listener's connections get their receives on a reactor.
#[derive(Clone)]
pub(super) struct DomainSpec {
    pub(super) ctx: lwio_rdma::Context,
    /// Soft provider with per-reactor progress: the reactor gets a
    /// manual-progress sibling of `ctx` and reads its connections' sockets.
    pub(super) sibling: bool,
    /// The device has shared receive queues (else: a receive region per
    /// connection, as before).
    pub(super) srq_wr: u32,
    /// Bytes of one receive buffer.
    pub(super) slot: usize,
    /// A Send that finds the SRQ empty waits (the soft provider): the pool
    /// backs first credits with a shared reserve (`pool::idle_reserve`).
    pub(super) overcommit: bool,
}

/// One reactor's resources on one device: a context (the soft provider's
/// own manual-progress one), a protection domain, one completion channel
/// for all its connections' CQs (tagged with the connection id) and the
/// shared receive pool.
pub(super) struct Domain {
    pub(super) ctx: lwio_rdma::Context,
    /// `ctx` is this reactor's: it drives it (`Context::progress`).
    manual: bool,
    pub(super) pd: lwio_rdma::Pd,
    pub(super) chan: lwio_rdma::CompChannel,
    pub(super) pool: Arc<super::pool::RecvPool>,
    /// Read buffers of its connections, by slot size (readbuf.rs).
    pub(super) reads: [Arc<super::readbuf::ReadSlab>; 2],
}

impl Domain {
    fn new(spec: &DomainSpec, shared: &Arc<Shared>) -> Result<Domain, lwio_rdma::Error> {
        let own = if spec.sibling {
            spec.ctx.open_manual_sibling()?
        } else {
            None
        };
        let manual = own.is_some();
        let ctx = own.unwrap_or_else(|| spec.ctx.clone());
        let pd = ctx.alloc_pd()?;
        let srq = pd.create_srq(spec.srq_wr, 1)?;
        let chan = ctx.create_comp_channel()?;
        lock(&shared.domain_pds).push(pd.clone());
        let pool = Arc::new(super::pool::RecvPool::new(
            pd.clone(),
            srq,
            spec.slot,
            shared.clone(),
            spec.overcommit,
        ));
        lock(&shared.pools).push(pool.clone());
        let reads = super::readbuf::SLOTS.map(|slot| {
            Arc::new(super::readbuf::ReadSlab::new(
                pd.clone(),
                shared.clone(),
                slot,
            ))
        });
        lock(&shared.read_slabs).extend(reads.iter().cloned());
        Ok(Domain {
            ctx,
            manual,
            pd,
            chan,
            pool,
            reads,
        })
    }
}

/// What the rest of the server sees of one reactor.
struct Handle {
    inbox: mpsc::Sender<Conn>,
    /// Its domain on each listener's device (None: no SRQ there).
    domains: Vec<Option<Arc<Domain>>>,
    waker: Arc<Waker>,
    /// Connections it drives (queued to it included).
    load: Arc<AtomicUsize>,
}

/// Counters of one reactor (for metrics).
#[derive(Debug, Default)]
pub struct ReactorStats {
    pub connections: AtomicUsize,
    /// Nanoseconds spent turning connections (not sleeping, not idle
    /// busy-polling rounds that found nothing).
    pub busy_ns: AtomicU64,
}

/// The server's reactors.
pub(super) struct Reactors {
    handles: Vec<Handle>,
    threads: Vec<JoinHandle<()>>,
    closing: Arc<AtomicBool>,
}

impl Reactors {
    /// Start `n` reactor threads (at least one).
    /// With `use_ring`, each reactor does the file I/O that would block
    /// on an io_uring of its own (falling back to the storage pool if the
    /// ring cannot be set up).
    pub(super) fn start(
        n: usize,
        shared: &Arc<Shared>,
        use_ring: bool,
        specs: &[DomainSpec],
    ) -> std::io::Result<Reactors> {
        let closing = Arc::new(AtomicBool::new(false));
        let mut handles = Vec::new();
        let mut threads = Vec::new();
        for i in 0..n.max(1) {
            let (tx, rx) = mpsc::channel();
            let waker = Arc::new(Waker::new()?);
            let load = Arc::new(AtomicUsize::new(0));
            let stats = shared.reactor_stats(i);
            let ep = epoll::create(epoll::CreateFlags::CLOEXEC)?;
            // SAFETY: the waker's fd stays open as long as `waker`, which
            // the reactor thread holds for as long as it uses `ep`.
            let wfd = unsafe { BorrowedFd::borrow_raw(waker.fd()) };
            epoll::add(&ep, wfd, EventData::new_u64(INBOX), EventFlags::IN)?;
            let mut domains = Vec::new();
            for (d, spec) in specs.iter().enumerate() {
                let dom = if spec.srq_wr > 0 {
                    match Domain::new(spec, shared) {
                        Ok(dom) => {
                            // SAFETY: the channel's fd lives as long as the
                            // domain, which the reactor holds as long as `ep`.
                            let cfd = unsafe { BorrowedFd::borrow_raw(dom.chan.fd()) };
                            epoll::add(
                                &ep,
                                cfd,
                                EventData::new_u64(DOMAIN - d as u64),
                                EventFlags::IN,
                            )?;
                            Some(Arc::new(dom))
                        }
                        Err(e) => {
                            warn!(reactor = i, error = %e, "no shared receive queue; each connection registers its own receive buffers");
                            None
                        }
                    }
                } else {
                    None
                };
                domains.push(dom);
            }
            let rio = if use_ring {
                match crate::fs::ring::Ring::new(RING_ENTRIES) {
                    Ok(ring) => {
                        // SAFETY: the ring's eventfd lives as long as the
                        // ring, which the reactor holds as long as `ep`.
                        let rfd = unsafe { BorrowedFd::borrow_raw(ring.fd()) };
                        epoll::add(&ep, rfd, EventData::new_u64(RING), EventFlags::IN)?;
                        Some(Arc::new(Mutex::new(RingIo::new(ring))))
                    }
                    Err(e) => {
                        warn!(reactor = i, error = %e, "no io_uring for this reactor; blocking file I/O goes to the storage threads");
                        None
                    }
                }
            } else {
                None
            };
            let r = Reactor {
                domains: domains.clone(),
                by_id: std::collections::HashMap::new(),
                rio,
                index: i,
                ep,
                inbox: rx,
                waker: waker.clone(),
                load: load.clone(),
                closing: closing.clone(),
                stats,
                slots: Vec::new(),
                free: Vec::new(),
                hot: Vec::new(),
                marked: Vec::new(),
            };
            let t = std::thread::Builder::new()
                .name(format!("lwio-reactor-{i}"))
                .spawn(move || r.run())?;
            handles.push(Handle {
                inbox: tx,
                domains,
                waker,
                load,
            });
            threads.push(t);
        }
        info!(reactors = handles.len(), "RDMA reactors started");
        Ok(Reactors {
            handles,
            threads,
            closing,
        })
    }

    /// Choose the least loaded reactor for a new connection on listener
    /// `l` (counted from now on): its index and its domain there.
    pub(super) fn pick(&self, l: usize) -> (usize, Option<Arc<Domain>>) {
        let (i, h) = self
            .handles
            .iter()
            .enumerate()
            .min_by_key(|(_, h)| h.load.load(Ordering::Relaxed))
            .expect("at least one reactor");
        h.load.fetch_add(1, Ordering::Relaxed);
        (i, h.domains.get(l).cloned().flatten())
    }

    /// The connection picked for reactor `i` was not accepted.
    pub(super) fn unpick(&self, i: usize) {
        self.handles[i].load.fetch_sub(1, Ordering::Relaxed);
    }

    /// Hand a connection to reactor `i` (from [`Reactors::pick`]).
    pub(super) fn assign(&self, i: usize, conn: Conn) {
        let h = &self.handles[i];
        if let Err(mpsc::SendError(c)) = h.inbox.send(conn) {
            // The reactor is gone (it panicked): close here.
            h.load.fetch_sub(1, Ordering::Relaxed);
            warn!(conn = c.id(), "reactor gone; closing the connection");
            let mut c = c;
            c.teardown();
            c.release();
            return;
        }
        h.waker.wake();
    }

    /// Stop taking connections: each reactor exits once its last one has
    /// finished (the caller has asked them to drain), or at `deadline`.
    pub(super) fn finish(self, deadline: Instant) {
        self.closing.store(true, Ordering::Release);
        for h in &self.handles {
            h.waker.wake();
        }
        for (i, t) in self.threads.into_iter().enumerate() {
            while !t.is_finished() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(5));
            }
            if t.is_finished() {
                let _ = t.join();
            } else {
                warn!(reactor = i, "reactor did not finish in time; leaving it");
            }
        }
    }
}

/// Entries of each reactor's io_uring.
const RING_ENTRIES: u32 = 256;

struct Reactor {
    /// Its domain on each listener's device.
    domains: Vec<Option<Arc<Domain>>>,
    /// Slot of each connection by id (the tag of its CQ).
    by_id: std::collections::HashMap<u64, usize>,
    /// Its io_uring for file I/O (None: the storage pool does it).
    rio: Option<Arc<Mutex<RingIo>>>,
    index: usize,
    ep: OwnedFd,
    inbox: mpsc::Receiver<Conn>,
    waker: Arc<Waker>,
    load: Arc<AtomicUsize>,
    closing: Arc<AtomicBool>,
    stats: Arc<ReactorStats>,
    /// Connections by slot (the epoll token is derived from the slot).
    slots: Vec<Option<Conn>>,
    free: Vec<usize>,
    /// Hot slots, and whether each slot is in `hot`.
    hot: Vec<usize>,
    marked: Vec<bool>,
}

/// Borrow a connection's fd for an epoll call.
///
/// # Safety
/// `fd` must stay open for the duration of the borrow.
unsafe fn borrow(fd: RawFd) -> BorrowedFd<'static> {
    // SAFETY: the caller keeps `fd` open while the borrow is used (each
    // call site uses it for one epoll_ctl call, with the connection that
    // owns the fd alive).
    unsafe { BorrowedFd::borrow_raw(fd) }
}

impl Reactor {
    fn adopt(&mut self, c: Conn) {
        let slot = match self.free.pop() {
            Some(s) => s,
            None => {
                self.slots.push(None);
                self.marked.push(false);
                self.slots.len() - 1
            }
        };
        let mut c = c;
        c.attach(slot, self.rio.clone(), self.load.clone());
        let fds = c.fds();
        self.stats.connections.fetch_add(1, Ordering::Relaxed);
        self.by_id.insert(c.id(), slot);
        let id = c.id();
        self.slots[slot] = Some(c);
        for (fd, k) in fds {
            // SAFETY: the connection in `slot` owns `fd` and is alive across
            // this call.
            let bfd = unsafe { borrow(fd) };
            let token = 2 * slot as u64 + k as u64;
            if let Err(e) = epoll::add(&self.ep, bfd, EventData::new_u64(token), EventFlags::IN) {
                warn!(conn = id, error = %e, "cannot watch a connection; closing it");
                self.remove(slot);
                return;
            }
        }
        self.mark_hot(slot);
    }

    fn mark_hot(&mut self, slot: usize) {
        if !self.marked[slot] {
            self.marked[slot] = true;
            self.hot.push(slot);
        }
    }

    fn remove(&mut self, slot: usize) {
        let Some(mut c) = self.slots[slot].take() else {
            return;
        };
        self.by_id.remove(&c.id());
        for (fd, _) in c.fds() {
            // SAFETY: `c` still owns its fds here (dropped below).
            let _ = epoll::delete(&self.ep, unsafe { borrow(fd) });
        }
        c.teardown();
        c.release();
        self.free.push(slot);
        self.load.fetch_sub(1, Ordering::Relaxed);
        self.stats.connections.fetch_sub(1, Ordering::Relaxed);
    }

    fn run(mut self) {
        let mut evs: Vec<Event> = vec![
            Event {
                flags: EventFlags::empty(),
                data: EventData::new_u64(0),
            };
            256
        ];
        let mut wcs = [Wc::BLANK; 32];
        let mut ready: Vec<usize> = Vec::new();
        let mut done: Vec<RingDone> = Vec::new();
        let mut tags: Vec<u64> = Vec::new();
        let mut next_tick = Instant::now() + STATS_FLUSH;
        let mut tick_at = 0;
        loop {
            while let Ok(c) = self.inbox.try_recv() {
                self.adopt(c);
            }
            let live = self.slots.len() - self.free.len();
            if self.closing.load(Ordering::Acquire) && live == 0 {
                break;
            }
            let now = Instant::now();
            let unsubmitted = self.rio.as_ref().is_some_and(|r| lock(r).has_unsubmitted());
            let ms = if !self.hot.is_empty() || unsubmitted {
                0
            } else {
                let left = next_tick.saturating_duration_since(now);
                // Round up: a 0 ms wait would spin until the timer.
                (left.as_micros().div_ceil(1000)).min(50) as i32
            };
            let n = epoll_wait(&self.ep, &mut evs, ms);
            for ev in &evs[..n] {
                let token = ev.data.u64();
                if token == INBOX {
                    self.waker.drain();
                    continue;
                }
                if token == RING {
                    // Reaped below, every round.
                    continue;
                }
                if token <= DOMAIN && token > DOMAIN - self.domains.len() as u64 {
                    let Some(d) = &self.domains[(DOMAIN - token) as usize] else {
                        continue;
                    };
                    if d.manual {
                        // Read the connections' sockets: completions land
                        // in their CQs, and armed ones fire the channel.
                        if let Err(e) = d.ctx.progress() {
                            warn!(error = %e, "RDMA progress failed");
                        }
                    }
                    tags.clear();
                    let _ = d.chan.take_fired(&mut tags);
                    for t in &tags {
                        if let Some(&slot) = self.by_id.get(t) {
                            ready.push(slot);
                        }
                    }
                    continue;
                }
                let slot = (token / 2) as usize;
                if let Some(c) = self.slots.get(slot).and_then(|c| c.as_ref()) {
                    c.consume_readiness((token % 2) as usize);
                    ready.push(slot);
                }
            }
            if let Some(rio) = &self.rio {
                lock(rio).reap(&mut done);
            }
            for (conn, slot, op, r) in done.drain(..) {
                // The connection may be gone (its slot reused): match ids.
                if let Some(c) = self.slots.get_mut(slot).and_then(|c| c.as_mut()) {
                    if c.id() == conn {
                        c.ring_done(op, r);
                        ready.push(slot);
                    }
                }
            }
            for &s in &ready {
                self.mark_hot(s);
            }
            ready.clear();
            let start = Instant::now();
            let mut worked = false;
            let turn: Vec<usize> = std::mem::take(&mut self.hot);
            for &slot in &turn {
                self.marked[slot] = false;
            }
            for slot in turn {
                let Some(c) = self.slots[slot].as_mut() else {
                    continue;
                };
                let now = Instant::now();
                let busy = c.process_events(now, &mut wcs);
                worked |= busy;
                if c.finished(now) {
                    self.remove(slot);
                } else if busy || c.wants_busy_poll(now) || !c.arm_for_sleep(now, &mut wcs) {
                    self.mark_hot(slot);
                }
            }
            let now = Instant::now();
            if now >= next_tick {
                // In slices: every connection once per STATS_FLUSH, but
                // with hundreds of them no round stops for all at once (a
                // hot request would wait behind the whole tick).
                let n = self.slots.len();
                let slices = (n / TICK_SLICE).clamp(1, 25);
                let from = if tick_at < n { tick_at } else { 0 };
                let to = (from + n.div_ceil(slices)).min(n);
                tick_at = to;
                next_tick = now + STATS_FLUSH / slices as u32;
                for slot in from..to {
                    if self.marked[slot] {
                        continue;
                    }
                    let Some(c) = self.slots[slot].as_mut() else {
                        continue;
                    };
                    // Its CQ stays armed from when it went cold: a
                    // completion of what this tick posts wakes the reactor.
                    c.run_timers(now);
                    if c.finished(now) {
                        self.remove(slot);
                    }
                }
            }
            if let Some(rio) = &self.rio {
                // One io_uring_enter for the file I/O of this round.
                lock(rio).submit();
            }
            if worked {
                let ns = u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX);
                self.stats.busy_ns.fetch_add(ns, Ordering::Relaxed);
            } else if !self.hot.is_empty() {
                // Busy polling with nothing found: let a peer on this CPU run.
                std::thread::yield_now();
            }
        }
        info!(reactor = self.index, "reactor stopped");
    }
}

/// Connections one slice of the idle tick covers (at least; see `run`).
const TICK_SLICE: usize = 32;

fn epoll_wait(ep: impl AsFd, out: &mut [Event], ms: i32) -> usize {
    let t = rustix::event::Timespec {
        tv_sec: (ms / 1000).into(),
        tv_nsec: ((ms % 1000) * 1_000_000).into(),
    };
    match epoll::wait(ep, out, Some(&t)) {
        Ok(n) => n,
        Err(rustix::io::Errno::INTR) => 0,
        Err(e) => {
            warn!(error = %e, "epoll_wait failed");
            std::thread::sleep(Duration::from_millis(10));
            0
        }
    }
}

// ------------------------------------------------------------- file I/O

/// What a file I/O on the ring keeps alive until its completion is reaped:
/// the memory the kernel reads or writes (held, never read: dropping it is
/// its only use).
#[allow(dead_code)]
pub(super) enum KeptAlive {
    /// A read buffer.
    Mr(Arc<super::readbuf::ReadBuffer>),
    /// The receive regions a reassembled write is in.
    Mrs(Vec<Arc<lwio_rdma::Mr>>),
    /// A copy of the data (a WRITE's bytes, or an aligned bounce buffer).
    Bytes(Vec<u8>),
    /// Nothing: an fsync touches no memory.
    Nothing,
}

/// A file I/O a connection hands to its reactor's ring.
pub(super) struct RingJob {
    pub(super) conn: u64,
    pub(super) slot: usize,
    pub(super) op: lwio_proto::server::OpId,
    /// The file's descriptor, held until the completion is reaped: the
    /// descriptor cache never closes it under the op.
    pub(super) file: crate::fs::fdcache::FdRef,
    /// Offset of the next byte.
    pub(super) offset: u64,
    /// The pieces still to transfer (pointers into `keep`).
    pub(super) iov: Vec<libc::iovec>,
    pub(super) write: bool,
    /// An fsync (`Some(datasync)`) instead of a transfer: `iov` is empty.
    pub(super) sync: Option<bool>,
    /// Held, never read: it keeps the memory `iov` points into alive.
    #[allow(dead_code)]
    pub(super) keep: KeptAlive,
}

// SAFETY: the raw pointers in `iov` point into `keep`, which the job owns
// and moves with it; nothing else reaches them through the job.
unsafe impl Send for RingJob {}

/// A job on the ring, with its progress.
struct RingOp {
    job: RingJob,
    done: usize,
    cancelled: bool,
}

/// The file I/O of one reactor's connections: its io_uring (issue 13: a
/// page-cache miss costs no thread hand-off), submitted once per round.
pub(super) struct RingIo {
    ring: crate::fs::ring::Ring,
    ops: std::collections::HashMap<u64, RingOp>,
    next: u64,
}

/// A finished file I/O: (connection id, slot, op, result).
pub(super) type RingDone = (
    u64,
    usize,
    lwio_proto::server::OpId,
    Result<u32, lwio_proto::NtStatus>,
);

impl RingIo {
    pub(super) fn new(ring: crate::fs::ring::Ring) -> RingIo {
        RingIo {
            ring,
            ops: std::collections::HashMap::new(),
            next: 1,
        }
    }

    /// Start `job` (its `iov` all inside its `keep`). Returns the ring id
    /// the connection cancels it by.
    ///
    /// # Safety
    /// Every iovec must lie in memory that `job.keep` keeps alive, and
    /// nothing may write that memory (for a read: nor read it) until the
    /// op's completion comes back from [`RingIo::reap`].
    pub(super) unsafe fn push(&mut self, job: RingJob) -> Result<u64, lwio_proto::NtStatus> {
        let id = self.next;
        self.next += 1;
        let rop = RingOp {
            job,
            done: 0,
            cancelled: false,
        };
        // SAFETY: the caller's contract, passed on; the op (and so `keep`)
        // stays in `self.ops` until its completion is reaped.
        unsafe { self.submit_op(id, &rop) }.map_err(|e| e.status())?;
        self.ops.insert(id, rop);
        Ok(id)
    }

    /// Queue `rop`'s remaining pieces on the ring.
    ///
    /// # Safety
    /// As [`RingIo::push`].
    unsafe fn submit_op(
        &mut self,
        id: u64,
        rop: &RingOp,
    ) -> Result<(), crate::fs::ring::PushError> {
        let j = &rop.job;
        let f = j.file.arc();
        if let Some(datasync) = j.sync {
            return self.ring.fsync(id, f, datasync);
        }
        // SAFETY: the pieces lie in `j.keep` (caller), which lives in
        // `self.ops` until this id is reaped.
        unsafe {
            match (j.write, j.iov.as_slice()) {
                (false, [one]) => {
                    self.ring
                        .read(id, f, one.iov_base as *mut u8, one.iov_len, j.offset)
                }
                (true, [one]) => {
                    self.ring
                        .write(id, f, one.iov_base as *const u8, one.iov_len, j.offset)
                }
                (_, many) => self.ring.writev(id, f, many.to_vec(), j.offset),
            }
        }
    }

    /// Ask the kernel to stop op `id` (it still completes).
    pub(super) fn cancel(&mut self, id: u64) {
        if let Some(r) = self.ops.get_mut(&id) {
            r.cancelled = true;
            self.ring.cancel(id);
        }
    }

    pub(super) fn has_unsubmitted(&mut self) -> bool {
        self.ring.has_unsubmitted()
    }

    /// One `io_uring_enter` for everything this round pushed.
    pub(super) fn submit(&mut self) {
        if let Err(e) = self.ring.submit() {
            warn!(error = %e, "io_uring submit failed");
        }
    }

    /// Take the finished I/Os. A short transfer continues where it
    /// stopped (a read ends at end of file); EINTR/EAGAIN are retried.
    pub(super) fn reap(&mut self, out: &mut Vec<RingDone>) {
        let mut cqes = Vec::new();
        self.ring.reap(&mut cqes);
        for (id, res) in cqes {
            let Some(mut rop) = self.ops.remove(&id) else {
                continue;
            };
            let retry = |rop: &RingOp| !rop.cancelled && rop.job.iov.iter().any(|v| v.iov_len > 0);
            let result = if res == -libc::EINTR || res == -libc::EAGAIN {
                None
            } else if res < 0 {
                let e = std::io::Error::from_raw_os_error(-res);
                Some(Err(super::io_error_status(&e)))
            } else if res == 0 {
                if rop.job.write && retry(&rop) {
                    Some(Err(super::STATUS_UNEXPECTED_IO_ERROR))
                } else {
                    Some(Ok(rop.done))
                }
            } else {
                let mut n = res as usize;
                rop.done += n;
                let j = &mut rop.job;
                j.offset += n as u64;
                while n > 0 && !j.iov.is_empty() {
                    let first = &mut j.iov[0];
                    let k = n.min(first.iov_len);
                    first.iov_base = (first.iov_base as usize + k) as *mut libc::c_void;
                    first.iov_len -= k;
                    n -= k;
                    if first.iov_len == 0 {
                        j.iov.remove(0);
                    }
                }
                if j.iov.is_empty() {
                    Some(Ok(rop.done))
                } else {
                    None
                }
            };
            let result = match result {
                Some(r) => r,
                None if rop.cancelled => Err(lwio_proto::status::STATUS_CANCELLED),
                None => {
                    // SAFETY: the remaining pieces still lie in the op's
                    // own `keep` (advanced within it), and it goes back
                    // into `self.ops` until reaped again.
                    match unsafe { self.submit_op(id, &rop) } {
                        Ok(()) => {
                            self.ops.insert(id, rop);
                            continue;
                        }
                        Err(e) => Err(e.status()),
                    }
                }
            };
            let r = result.map(|n| u32::try_from(n).unwrap_or(u32::MAX));
            out.push((rop.job.conn, rop.job.slot, rop.job.op, r));
        }
    }
}
