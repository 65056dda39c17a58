//! Waiting for completions: INTERRUPT, sleeping or driving, busy polling,
//! taking a completion and abandoning a request.

use super::*;

impl Engine {
    /// Polling mode: ask the server for a message after its next completion
    /// (an INTERRUPT, unless one is outstanding), so that a caller sleeping
    /// on the completion fd is woken even though a polled completion posts
    /// nothing. Never waits; a no-op when no credit is free.
    pub fn arm_interrupt(&self) {
        let mut state = lock(&self.state);
        self.arm_interrupt_locked(&mut state);
        self.flush_sends(&mut state);
    }

    pub(super) fn arm_interrupt_locked(&self, state: &mut EngineState) {
        if state.lost.is_none()
            && state.conn.interrupt_outstanding().is_none()
            && state.conn.can_interrupt()
            && state.conn.interrupt(Instant::now()).is_ok()
        {
            state.stats.interrupts_sent += 1;
            self.run_actions(state);
        }
    }

    /// Send INTERRUPT (or join the one outstanding) and wait until the
    /// server answers it — after the next I/O completion.
    pub fn interrupt(&self) -> Result<()> {
        let existing = lock(&self.state).conn.interrupt_outstanding();
        let req = match existing {
            Some(r) => r,
            None => {
                let r = self.issue_when(ClientConn::can_interrupt, |_, state| {
                    if state.conn.interrupt_outstanding().is_some() {
                        return Some(Err(Error::Busy("INTERRUPT already outstanding".into())));
                    }
                    let r = state.conn.interrupt(Instant::now()).map_err(client_err);
                    if r.is_ok() {
                        state.stats.interrupts_sent += 1;
                    }
                    Some(r)
                });
                match r {
                    Ok(r) => r,
                    Err(Error::Busy(_)) => match lock(&self.state).conn.interrupt_outstanding() {
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
        let mut state = lock(&self.state);
        loop {
            // Its completion is dropped as it comes (`finish_req`).
            if state.conn.interrupt_outstanding() != Some(req) {
                return Ok(());
            }
            if let Some(l) = &state.lost {
                return Err(Error::ConnectionLost(l.clone()));
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::TimedOut("INTERRUPT".into()));
            }
            self.sleep_or_drive(state, (deadline - now).min(Duration::from_millis(50)));
            state = lock(&self.state);
        }
    }

    /// Wait for a request's completion: (information, status). The status
    /// block to watch (polling) is the request's own, looked up here under
    /// the lock that also sees its completion.
    pub fn wait(&self, req: ReqId) -> Result<(u32, NtStatus)> {
        let _waiting = Waiting::new(self);
        let slot = match self.done_before_flush(req) {
            Ok(r) => return Ok(r),
            Err(slot) => slot,
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
            let mut state = lock(&self.state);
            if let Some(s) = slot {
                if self.cfg.completion == Completion::Poll && self.check_slot(&mut state, s) {
                    self.run_actions(&mut state);
                }
            }
            if let Some(r) = take_done(&mut state, req) {
                return Ok(r);
            }
            if let Some(l) = &state.lost {
                let l = l.clone();
                self.abandon(&mut state, req);
                return Err(Error::ConnectionLost(l));
            }
            // Its deadline is the state machine's (op timeout from issue).
            let now = Instant::now();
            state.conn.handle_timeout(now);
            self.run_actions(&mut state);
            if state.conn.is_timed_out(req) {
                self.abandon(&mut state, req);
                // What the request may have waited for: a credit, a send
                // slot, its send, a completion nobody reaped.
                warn!(
                    req,
                    credits = state.conn.credits(),
                    credits_held = state.conn.credits_held(),
                    outstanding = state.conn.outstanding(),
                    unsent = state.conn.transmit_pending() + state.send_backlog.len(),
                    free_send_slots = state.send_free.len(),
                    posted_recvs = state.conn.posted_recvs(),
                    waiters = self.waiters.load(Ordering::Relaxed),
                    driver = self.driver.load(Ordering::Relaxed),
                    "request timed out"
                );
                return Err(Error::TimedOut(format!("request {req}")));
            }
            if !state.conn.is_outstanding(req) {
                return Err(Error::InvalidArgument(format!(
                    "request {req} is not outstanding (taken already, or never issued)"
                )));
            }
            let until = state
                .conn
                .poll_timeout()
                .map_or(Duration::MAX, |t| t.saturating_duration_since(now));
            let mut wait = Duration::from_millis(50);
            if self.cfg.completion == Completion::Poll && slot.is_some() {
                // Spin budget spent: ask to be woken by the next completion.
                self.arm_interrupt_locked(&mut state);
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
                    drop(state);
                    if let Some(r) = self.busy_poll(req)? {
                        return Ok(r);
                    }
                    continue;
                }
            }
            self.sleep_or_drive(state, wait.min(until));
        }
    }

    /// Interrupt mode, before the first sleep of a wait: poll the
    /// completion queue (under manual progress: the sockets, in this
    /// thread) for up to `busy_poll`, yielding the CPU each round, and
    /// return `req`'s completion if it came meanwhile.
    pub(super) fn busy_poll(&self, req: ReqId) -> Result<Option<(u32, NtStatus)>> {
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
    pub(super) fn busy_poll_score(&self, hit: bool) {
        let s = self.busy_poll_score.load(Ordering::Relaxed);
        self.busy_poll_score
            .store(busy_poll_score(s, hit), Ordering::Relaxed);
    }

    /// Whether this wait busy-polls: while at least about one poll in
    /// eight ends with its reply ([`busy_poll_score`]); below that (replies
    /// that take longer than the window: deep queues, large or slow I/O),
    /// only every 16th wait polls, so such a connection spends almost
    /// nothing on it and finds out when its replies are fast again.
    pub(super) fn busy_poll_turn(&self) -> bool {
        busy_poll_turn(
            self.busy_poll_score.load(Ordering::Relaxed),
            self.waits.load(Ordering::Relaxed),
        )
    }

    /// Block for at most `wait`: as the driver if nobody is (the completion
    /// that ends the wait then wakes this thread directly), else on the
    /// condition variable the driver signals.
    pub(super) fn sleep_or_drive(&self, mut state: MutexGuard<'_, EngineState>, wait: Duration) {
        self.flush_sends(&mut state);
        if self.take_driver() {
            drop(state);
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
        drop(self.cv_wait(state, wait));
    }

    /// Sleep on `cv` for at most `wait` (counted in `cv_sleepers` while
    /// asleep, under the lock).
    pub(super) fn cv_wait<'a>(
        &self,
        state: MutexGuard<'a, EngineState>,
        wait: Duration,
    ) -> MutexGuard<'a, EngineState> {
        self.cv_sleepers.fetch_add(1, Ordering::Relaxed);
        let state = self
            .cv
            .wait_timeout(state, wait)
            .unwrap_or_else(|p| p.into_inner())
            .0;
        self.cv_sleepers.fetch_sub(1, Ordering::Relaxed);
        state
    }

    /// Wake the threads asleep on `cv`, if there are any. Only with the
    /// state lock held (`state: &mut EngineState`): a sleeper counts itself under
    /// that lock before it sleeps, and `Condvar::wait` releases it only
    /// once the sleeper is on the condition variable, so a notifier that
    /// holds the lock either sees the count or changed the state before
    /// the sleeper looked at it. std's condition variable makes a system
    /// call on every notify, sleepers or not, and this is on every
    /// completion's path (one `futex` per I/O before).
    pub(super) fn notify_sleepers(&self, _st: &mut EngineState) {
        if self.cv_sleepers.load(Ordering::Relaxed) > 0 {
            self.cv.notify_all();
        }
    }

    /// Staging buffers free now for a read of `len` bytes (small reads may
    /// also take a bounce buffer). A caller that reaps its own completions
    /// (the C batch API) issues staged reads only while this is enough:
    /// staging buffers come back only when their reads are finished.
    pub fn free_stages(&self, len: usize) -> usize {
        let state = lock(&self.state);
        state.stage_free.len()
            + if len <= BOUNCE_SLOT {
                state.bounce_free.len()
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
    /// [`crate::Batch`]'s non-blocking looks use it. The status block is
    /// looked up as by [`Engine::wait`].
    pub fn try_wait(&self, req: ReqId, drive: bool) -> Result<Option<(u32, NtStatus)>> {
        let slot = match self.done_before_flush(req) {
            Ok(r) => return Ok(Some(r)),
            Err(slot) => slot,
        };
        if drive {
            self.poll_cq();
        }
        let mut state = lock(&self.state);
        if let Some(s) = slot {
            if self.cfg.completion == Completion::Poll && self.check_slot(&mut state, s) {
                self.run_actions(&mut state);
            }
        }
        self.take_done(&mut state, req)
    }

    /// The start of a wait: `req`'s completion if it is in already, else
    /// (after posting the requests queued meanwhile) its status block
    /// slot. Done already (its completion came in a batch)? Then the
    /// requests queued since stay queued for the next real wait. Polling,
    /// its status block may be written already, by a progress pass that
    /// placed a burst of completions, which the state machine learns only
    /// when someone reads the block: read here, such a request leaves the
    /// queued requests queued too, so that they go in one post, not one
    /// post (one system call) per request (`lwio bench` 4 KiB QD 32
    /// polled: 6.8 → 3.2 µs of client CPU per read, bench/RESULTS.md).
    fn done_before_flush(&self, req: ReqId) -> std::result::Result<(u32, NtStatus), Option<u32>> {
        let mut state = lock(&self.state);
        if let Some(r) = take_done(&mut state, req) {
            return Ok(r);
        }
        let slot = state.conn.slot_of(req);
        if let (Completion::Poll, Some(s)) = (self.cfg.completion, slot) {
            if self.check_slot(&mut state, s) {
                self.run_actions(&mut state);
                if let Some(r) = take_done(&mut state, req) {
                    return Ok(r);
                }
            }
        }
        self.flush_sends(&mut state);
        Err(slot)
    }

    pub(super) fn peek_done(&self, req: ReqId) -> Result<Option<(u32, NtStatus)>> {
        match self.state.try_lock() {
            Ok(mut state) => self.take_done(&mut state, req),
            Err(_) => Ok(None),
        }
    }

    /// `req`'s completion if it came; an error (and the request abandoned)
    /// if the connection is lost.
    pub(super) fn take_done(
        &self,
        state: &mut EngineState,
        req: ReqId,
    ) -> Result<Option<(u32, NtStatus)>> {
        // Completions the state machine has seen but whose events were not
        // carried out yet (another thread polled them and let go of the
        // lock before `run_actions`): carry them out first, so the request's
        // windows are invalidated (`finish_req`) before its record is taken
        // away. Taking it first left them bound (lwio-e2e-rxe, 1 run in 6).
        self.run_actions(state);
        if let Some(r) = take_done(state, req) {
            return Ok(Some(r));
        }
        if let Some(l) = &state.lost {
            let l = l.clone();
            self.abandon(state, req);
            return Err(Error::ConnectionLost(l));
        }
        Ok(None)
    }

    /// The waiter gives up: the engine frees the request's stage when (if)
    /// it completes. The stage must not be freed by the waiter.
    pub(super) fn abandon(&self, state: &mut EngineState, req: ReqId) {
        if let Some(r) = state.conn.user_mut(req) {
            r.abandoned = true;
        }
    }

    /// A waiter gave up on `req` (async future dropped): free its resources
    /// when it completes.
    pub fn abandon_req(&self, req: ReqId) {
        let mut state = lock(&self.state);
        if let Some(d) = state.conn.take_done(req) {
            if let Some(s) = d.user.stage {
                free_stage(&mut state, s);
            }
            return;
        }
        self.abandon(&mut state, req);
    }

    // ------------------------------------------------------ caller memory
}

/// A busy-poll score of 1: every poll ends with its reply.
pub(super) const BUSY_POLL_SCORE_ONE: u32 = 1024;
/// Below this score (about one poll in eight ending with its reply) a
/// connection polls only on every [`BUSY_POLL_PROBE`]-th wait.
pub(super) const BUSY_POLL_SCORE_MIN: u32 = BUSY_POLL_SCORE_ONE / 8;
pub(super) const BUSY_POLL_PROBE: u64 = 16;

/// Threads of this process busy-polling in interrupt mode now.
static SPINNERS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// A place among the threads of the process that busy-poll before they
/// sleep (interrupt mode, [`EngineConfig::busy_poll`]): at most one per CPU
/// this process may run on. More spinners than CPUs would only take turns
/// with the threads (and, on one host, the server) whose work they wait for.
pub(super) struct Spinner;

impl Spinner {
    pub(super) fn enter() -> Option<Spinner> {
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
pub(super) fn busy_poll_score(score: u32, hit: bool) -> u32 {
    if hit {
        score + (BUSY_POLL_SCORE_ONE - score.min(BUSY_POLL_SCORE_ONE)) / 8
    } else {
        score - score / 8
    }
}

/// [`Engine::busy_poll_turn`]: whether wait number `waits` polls, at
/// `score`.
pub(super) fn busy_poll_turn(score: u32, waits: u64) -> bool {
    score >= BUSY_POLL_SCORE_MIN || waits.is_multiple_of(BUSY_POLL_PROBE)
}

/// One of `cap` places counted in `count`, if one is free.
pub(super) fn take_place(count: &std::sync::atomic::AtomicUsize, cap: usize) -> bool {
    if count.fetch_add(1, Ordering::AcqRel) < cap {
        true
    } else {
        count.fetch_sub(1, Ordering::AcqRel);
        false
    }
}

/// Counts a caller inside `wait`/`issue` for as long as it lives.
pub(super) struct Waiting<'a>(&'a Engine);

impl<'a> Waiting<'a> {
    pub(super) fn new(e: &'a Engine) -> Waiting<'a> {
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
pub(super) struct Driving<'a>(&'a Engine);

impl Drop for Driving<'_> {
    fn drop(&mut self) {
        self.0.release_driver();
    }
}
