//! One RDMA connection ([`Conn`]): its queue pair, receive and send
//! buffers around one `lwio_proto::server::ServerConn<OpState>` (which
//! keeps each storage operation's [`OpState`]: read buffer, kept receive
//! buffers, cancel flag, ring id, read wait), and what its reactor calls:
//! processing its events, running its timers, arming before a sleep,
//! close and teardown.
//!
//! Its other layers are `impl Conn` blocks of their own: admission
//! (`accept.rs`), control messages and credits (`credits.rs`), completions
//! (`completions.rs`), the actions of the state machine (`actions.rs`) and
//! their file I/O (`fileio.rs`).

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lwio_proto::server::{OpData, OpId, RecvId, ServerAction, ServerConn};
use lwio_proto::wrid;
use lwio_proto::NtStatus;
use lwio_rdma::{CompChannel, Context, Cq, Mr, Pd, Qp, QpState, SendOp, Wc};
use tracing::{debug, info, warn};

use crate::fs::table::{OpenFile, SessionId};
use crate::io_phase::pool::RecvPool;
use crate::io_phase::reactor::RingIo;
use crate::io_phase::readbuf::{ReadBuffer, ReadSlab};
use crate::io_phase::Waker;
use crate::state::ServerState;

use super::inline::InlineMode;
use super::shared::{lock, ConnState, Control, Shared, STATS_FLUSH};
use super::storage::StoragePool;

/// The smallest read region of its own a connection registers (reads up to
/// it take slab slots where there are slabs): what admission reserves for
/// one read, and the smallest region worth keeping as a spare.
pub(super) const MIN_READ_REGION: usize = 64 << 10;

pub(super) struct ReadBuf {
    pub(super) buf: Arc<ReadBuffer>,
    pub(super) writes_inflight: u32,
    pub(super) released: bool,
    pub(super) at_storage: bool,
}

/// What a connection keeps per storage operation, held by its
/// `ServerConn` with the op (`ServerConn<OpState>`): while the op is in
/// flight, and a read's past its completion until the RDMA Writes from
/// its buffer have completed (`maybe_free_buf` takes it back).
#[derive(Default)]
pub(super) struct OpState {
    /// A read's buffer (FileRead).
    pub(super) read: Option<ReadBuf>,
    /// At a storage thread: the job's cancel flag.
    pub(super) cancel: Option<Arc<AtomicBool>>,
    /// On the reactor's io_uring: its ring id.
    pub(super) ring: Option<u64>,
    /// A write from kept receive buffers (a reassembled message's, a
    /// WRITE's) at storage: those buffers, reposted when it completes.
    pub(super) recvs: Option<Vec<RecvId>>,
    /// A READ waiting for the registered-memory budget: since when.
    pub(super) read_wait: Option<Instant>,
}

impl OpState {
    /// Its file I/O is at storage (a storage thread or the ring).
    pub(super) fn at_storage(&self) -> bool {
        self.cancel.is_some() || self.ring.is_some()
    }
}

impl OpData for OpState {
    /// A read buffer outlives its op: the completion's RDMA Writes (and
    /// any still in flight) read from it.
    fn outlives_op(&self) -> bool {
        self.read.is_some()
    }
}

pub(super) const SEND_SLOT: usize = 256;
/// Send slots registered at a time: a connection starts with one chunk
/// (4 KiB) and registers more only when its sends outrun it.
pub(super) const SEND_CHUNK: usize = 16;

/// Where a connection's receive buffers come from.
pub(super) enum RecvSrc {
    /// Its own region, posted on its own QP (devices without SRQs).
    Own(Arc<Mr>),
    /// Its reactor's shared receive pool on this device.
    Pool(Arc<RecvPool>),
    /// Torn down.
    Gone,
}

impl RecvSrc {
    /// Release an own region that was never used (a failed accept).
    pub(super) fn free(self, shared: &Shared) {
        if let RecvSrc::Own(m) = self {
            if let Ok(m) = Arc::try_unwrap(m) {
                shared.unregister(m);
            }
        }
    }
}

pub(in crate::io_phase) struct Conn {
    pub(super) id: u64,
    pub(super) peer: SocketAddr,
    pub(super) qp: Qp,
    pub(super) cq: Cq,
    pub(super) chan: CompChannel,
    pub(super) pd: Pd,
    /// Where its receives come from.
    pub(super) recv: RecvSrc,
    /// Pool mode: the credits it promised the pool, and the buffers it
    /// holds (taken, not yet handed back).
    pub(super) backed: usize,
    pub(super) held: std::collections::HashSet<RecvId>,
    pub(super) recv_slot: usize,
    /// Its send slots, in chunks of [`SEND_CHUNK`].
    pub(super) send_mrs: Vec<Mr>,
    pub(super) send_free: Vec<u32>,
    pub(super) sq_depth: usize,
    pub(super) sq_inflight: usize,
    pub(super) deferred: VecDeque<ServerAction>,
    /// Regions of its own kept for its next reads (larger than a slot).
    pub(super) spare_bufs: Vec<Mr>,
    /// Its reactor's read slots on this device, by size (None: no reactor
    /// domain).
    pub(super) reads: Option<[Arc<ReadSlab>; 2]>,
    /// Memory-object I/O this connection carries for its publisher.
    pub(super) mem: crate::io_phase::memobj_io::PubSide,
    pub(super) files: HashMap<u64, OpenFile>,
    pub(super) next_file: u64,
    pub(super) session: Option<SessionId>,
    pub(super) sconn: ServerConn<OpState>,
    pub(super) shared: Arc<Shared>,
    pub(super) state: Arc<ServerState>,
    pub(super) pool: StoragePool,
    pub(super) done_tx: mpsc::Sender<(OpId, Result<u32, NtStatus>)>,
    pub(super) done_rx: mpsc::Receiver<(OpId, Result<u32, NtStatus>)>,
    pub(super) ctl_rx: mpsc::Receiver<Control>,
    pub(super) waker: Arc<Waker>,
    pub(super) credits_pub: Arc<AtomicUsize>,
    pub(super) state_pub: Arc<std::sync::atomic::AtomicU8>,
    pub(super) credits_reported: i64,
    pub(super) base_credits: u16,
    /// The most credits the client said it can use (learned from a CREDIT
    /// reply that reported some unused): never granted beyond.
    pub(super) client_cap: Option<u16>,
    pub(super) last_io: Instant,
    pub(super) closing: Option<Instant>,
    pub(super) draining: Option<Instant>,
    pub(super) dead: bool,
    /// How the fast path treats each (file handle, write).
    pub(super) inline_mode: HashMap<(u64, bool), InlineMode>,
    /// Its place on its reactor, and the reactor's io_uring (None: file
    /// I/O that would block goes to the storage pool).
    pub(super) slot: usize,
    pub(super) rio: Option<Arc<Mutex<RingIo>>>,
    /// How many connections its reactor drives (None: not on a reactor).
    pub(super) reactor_conns: Option<Arc<AtomicUsize>>,
    /// Reactor bookkeeping: last balancing round, last I/O work, last
    /// polled completion (and the count it saw).
    pub(super) last_tick: Instant,
    pub(super) last_busy: Instant,
    pub(super) last_polled: Instant,
    pub(super) last_polled_count: u64,
    /// Data requests seen at the last balancing round.
    pub(super) requests_balanced: u64,
    /// Work requests of this round of actions, posted together by
    /// `flush_sq`: (wr_id, operation, SGE).
    pub(super) sq_pending: Vec<(u64, SendOp, Option<lwio_rdma::Sge>)>,
    /// The connection's own soft context (declared last: dropped after the
    /// QP, CQ and PD that live in it).
    pub(super) _ctx: Option<Context>,
}

impl Conn {
    /// Process what woke this connection on its reactor: control messages,
    /// storage completions, RDMA completions, then the actions they caused.
    /// True if it did any I/O work (the reactor keeps polling a while).
    pub(in crate::io_phase) fn process_events(&mut self, now: Instant, wcs: &mut [Wc]) -> bool {
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
        self.run_timers(now);
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

    /// The timed part of [`Conn::process_events`] (also run alone on idle
    /// connections):
    /// protocol timers, credit balancing and counters every
    /// [`STATS_FLUSH`], memory-object work, pending actions.
    pub(in crate::io_phase) fn run_timers(&mut self, now: Instant) {
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
    pub(in crate::io_phase) fn wants_busy_poll(&self, now: Instant) -> bool {
        now.duration_since(self.last_busy) < self.shared.opts.busy_poll
            || now.duration_since(self.last_polled) < self.shared.opts.busy_poll_polled
    }

    /// Before its reactor sleeps: arm the CQ, then poll once to close the
    /// race with a completion that came in between. False if one did (it
    /// is carried out; the connection stays hot).
    pub(in crate::io_phase) fn arm_for_sleep(&mut self, now: Instant, wcs: &mut [Wc]) -> bool {
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
    pub(in crate::io_phase) fn fds(&self) -> Vec<(std::os::fd::RawFd, usize)> {
        match self.recv {
            // The reactor's domain channel reports this one's CQ by tag.
            RecvSrc::Pool(_) => vec![(self.waker.fd(), 1)],
            _ => vec![(self.chan.fd(), 0), (self.waker.fd(), 1)],
        }
    }

    /// Consume the readiness of the fds [`Conn::fds`] returned.
    pub(in crate::io_phase) fn consume_readiness(&self, which: usize) {
        if which == 0 {
            let _ = self.chan.wait(Some(Duration::ZERO));
        } else {
            self.waker.drain();
        }
    }

    pub(in crate::io_phase) fn id(&self) -> u64 {
        self.id
    }

    /// Joined a reactor: its slot there, the reactor's io_uring and its
    /// count of connections.
    pub(in crate::io_phase) fn attach(
        &mut self,
        slot: usize,
        rio: Option<Arc<Mutex<RingIo>>>,
        conns: Arc<AtomicUsize>,
    ) {
        self.slot = slot;
        self.rio = rio;
        self.reactor_conns = Some(conns);
    }

    /// A file I/O on the reactor's ring has finished.
    pub(in crate::io_phase) fn ring_done(&mut self, op: OpId, r: Result<u32, NtStatus>) {
        // (`storage_done` forgets its ring id.)
        self.storage_done(op, r);
    }

    /// After [`Conn::teardown`]: the connection leaves the server's table
    /// (its domain's census stays) and frees its per-host slot.
    pub(in crate::io_phase) fn release(&mut self) {
        self.shared.retire(self.id);
        self.shared.host_release(self.peer.ip());
    }

    pub(in crate::io_phase) fn finished(&mut self, now: Instant) -> bool {
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
            if (sends_done && !self.sconn.op_data_iter_mut().any(|(_, d)| d.at_storage()))
                || now.duration_since(t) > Duration::from_secs(2)
            {
                return true;
            }
        }
        false
    }

    pub(super) fn begin_close(&mut self, now: Instant) {
        if self.closing.is_none() {
            self.closing = Some(now);
            let mut rio = self.rio.as_ref().map(|r| lock(r));
            for (_, d) in self.sconn.op_data_iter_mut() {
                if let Some(c) = &d.cancel {
                    c.store(true, Ordering::Release);
                }
                if let (Some(id), Some(rio)) = (d.ring, rio.as_mut()) {
                    rio.cancel(id);
                }
            }
        }
    }

    /// Add this connection's request counters into the server's.
    pub(super) fn flush_request_stats(&mut self) {
        let st = self.sconn.take_request_stats();
        if !st.is_empty() {
            lock(&self.shared.requests).merge(&st);
        }
    }

    pub(in crate::io_phase) fn teardown(&mut self) {
        self.flush_request_stats();
        let _ = self.qp.disconnect();
        // Storage jobs still running hold their read buffer by Arc; they
        // finish into a channel nobody reads. Registered memory is released
        // here (deregistration invalidates keys before the memory goes).
        let bufs: Vec<ReadBuf> = self
            .sconn
            .op_data_iter_mut()
            .filter_map(|(_, d)| d.read.take())
            .collect();
        for b in bufs {
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
                    .sconn
                    .op_data_iter_mut()
                    .filter(|(_, d)| d.at_storage())
                    .flat_map(|(_, d)| d.recvs.iter().flatten().copied())
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
    pub(super) fn drain_pool_receives(&mut self, p: &RecvPool) {
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
}
