//! Driving the connection: the driver role, the completion queue and the
//! status-block scan, posting sends, feeding the state machine, losing the
//! connection, and the progress thread that drives while nobody waits.

use super::*;

impl Engine {
    pub(super) fn mark_lost(&self, state: &mut EngineState, why: String) {
        if state.lost.is_none() {
            // Flushed receives and a dead QP say nothing of the cause; if
            // this client's provider refused what the server sent, say so.
            let why = self.refused_by_us().unwrap_or(why);
            info!(reason = %why, "RDMA connection lost");
            state.lost = Some(why);
            self.is_lost.store(true, Ordering::Release);
            if let Some(fd) = &state.notify {
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
        self.notify_sleepers(state);
    }

    /// Why the connection broke if this client's RDMA provider refused the
    /// server's traffic and terminated it (an access outside the windows
    /// this client bound — wrong key, out of bounds, a window already used
    /// or invalidated — or an RDMA protocol error). The soft provider
    /// reports the Terminate it sent; a verbs device, the QP's affiliated
    /// asynchronous error (an access violation or an invalid request).
    pub(super) fn refused_by_us(&self) -> Option<String> {
        const ACCESS: &str = "the server tried to write client memory it was not given (a key \
                              or range outside the one-shot windows of its outstanding requests)";
        const PROTOCOL: &str = "the server broke the RDMA protocol";
        if let Some(term) = self.qp.terminate_sent() {
            let code = term.vendor_err();
            let what = if term.is_protection() {
                ACCESS
            } else {
                PROTOCOL
            };
            return Some(format!("{what}; {REFUSED} (iWARP Terminate {code:#06x})"));
        }
        let (what, event) = match self.qp.device_refusal()? {
            lwio_rdma::DeviceRefusal::Access => (ACCESS, "a local access violation"),
            lwio_rdma::DeviceRefusal::InvalidRequest => (PROTOCOL, "an invalid request"),
        };
        Some(format!(
            "{what}; {REFUSED} (the RDMA device reported {event})"
        ))
    }

    /// Carry out the state machine's actions and collect its events.
    pub(super) fn run_actions(&self, state: &mut EngineState) {
        while let Some(a) = state.conn.poll_action() {
            match a {
                ClientAction::PostRecv(n) => {
                    for _ in 0..n {
                        let Some(slot) = state.recv_free.pop() else {
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
                            state.recv_free.push(slot);
                            self.mark_lost(state, format!("posting a receive failed: {}", e.error));
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
                    self.mark_lost(state, format!("{reason:?}"));
                }
            }
        }
        self.fill_send_slots(state);
        // Request messages wait for the caller to block (`wait`, a credit
        // wait, the driver's sleep), so a burst of requests leaves in one
        // post and one system call; before AUTH completes they go at once.
        if !matches!(state.auth, Some(Ok(_))) || state.send_backlog.len() >= SEND_BATCH {
            self.flush_sends(state);
        }
        let mut notify = false;
        while let Some(ev) = state.conn.poll_event() {
            notify = true;
            match ev {
                ClientEvent::Authenticated {
                    session_id,
                    credits,
                    ..
                } => {
                    state.auth = Some(Ok((session_id, credits)));
                    state.stats.credit_history.push(credits);
                }
                ClientEvent::AuthFailed { status } => state.auth = Some(Err(status)),
                ClientEvent::CreditsChanged { credits } => {
                    debug!(credits, "credit limit changed");
                    state.stats.credit_history.push(credits);
                }
                ClientEvent::Completed { req, opcode, .. } => {
                    self.finish_req(state, req, opcode);
                }
                // Its waiter (woken below) returns TimedOut and abandons it.
                ClientEvent::TimedOut { req, opcode } => {
                    debug!(req, ?opcode, "request timed out");
                    state.stats.timed_out += 1;
                }
            }
        }
        if notify {
            self.notify_sleepers(state);
        }
        self.nudge_progress(state);
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
    pub(super) fn next_wake(&self, state: &EngineState, now: Instant) -> Option<Instant> {
        let deadline = state.conn.poll_timeout();
        if state.conn.polled_outstanding() > 0 {
            let scan = now + POLL_SCAN;
            return Some(deadline.map_or(scan, |d| d.min(scan)));
        }
        deadline
    }

    /// Wake the progress thread if it sleeps past what it now has to do
    /// (a request issued while it slept without a deadline). Cheap while it
    /// is awake; an eventfd write at most once per sleep.
    pub(super) fn nudge_progress(&self, state: &mut EngineState) {
        let until = match state.nap {
            ProgressSleep::Awake => return,
            ProgressSleep::Until(t) => Some(t),
            ProgressSleep::Forever => None,
        };
        let Some(next) = self.next_wake(state, Instant::now()) else {
            return;
        };
        if until.is_some_and(|t| t <= next) {
            return;
        }
        state.nap = ProgressSleep::Awake;
        self.wake_progress();
    }

    /// End the progress thread's sleep (now, or its next one).
    pub(super) fn wake_progress(&self) {
        // An eventfd counter: +1, non-blocking (EAGAIN only when it is
        // already readable).
        let _ = rustix::io::write(&*self.wake, &1u64.to_ne_bytes());
    }

    /// Take the driver role if nobody has it.
    pub(super) fn take_driver(&self) -> bool {
        self.driver
            .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_ok()
    }

    pub(super) fn release_driver(&self) {
        self.driver.store(false, Ordering::Release);
    }

    /// One round of the progress thread, which holds the driver role: take
    /// the channel's event (under manual progress, read the sockets), then
    /// process completions until the completion queue is empty *and armed*,
    /// so that the next completion makes the channel readable. False once
    /// the connection is lost.
    pub(super) fn progress_round(&self) -> bool {
        lock(&self.state).nap = ProgressSleep::Awake;
        if let Err(err) = self.chan.wait(Some(Duration::ZERO)) {
            let mut state = lock(&self.state);
            self.mark_lost(&mut state, format!("completion channel failed: {err}"));
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
    pub(super) fn plan_nap(&self) -> Option<Instant> {
        let mut state = lock(&self.state);
        let until = self.next_wake(&state, Instant::now());
        state.nap = until.map_or(ProgressSleep::Forever, ProgressSleep::Until);
        until
    }

    /// Post the request messages issued so far now (as few post calls as
    /// possible: the soft provider writes one post list with one `writev`).
    /// Issuing only queues them (a blocking caller's wait posts them
    /// together); a caller that issues and returns without waiting (POSIX
    /// AIO, whose completions another thread reaps) calls this so they go
    /// on the wire at once.
    pub fn flush(&self) {
        let mut state = lock(&self.state);
        self.flush_sends(&mut state);
    }

    /// The send slot `slot` as a slice, for the state machine to encode a
    /// request message into, and `f`'s result; None if the slot is out of
    /// the send region.
    pub(super) fn with_send_slot<T>(&self, slot: u32, f: impl FnOnce(&mut [u8]) -> T) -> Option<T> {
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
    pub(super) fn fill_send_slots(&self, state: &mut EngineState) {
        while state.conn.transmit_pending() > 0 {
            let Some(slot) = state.send_free.pop() else {
                return;
            };
            let Some(n) = self.with_send_slot(slot, |out| state.conn.poll_transmit(out)) else {
                state.send_free.push(slot);
                return self.mark_lost(state, "a send slot lies outside the send region".into());
            };
            match n {
                Some(len) => state.send_backlog.push_back(Outgoing {
                    slot,
                    len,
                    data: None,
                }),
                None => {
                    state.send_free.push(slot);
                    // The state machine closed the connection (a message
                    // larger than a send slot): carry that out.
                    return self.run_actions(state);
                }
            }
        }
    }

    pub(super) fn flush_sends(&self, state: &mut EngineState) {
        self.fill_send_slots(state);
        while !state.send_backlog.is_empty() {
            let n = state.send_backlog.len().min(SEND_BATCH);
            let batch: Vec<Outgoing> = state.send_backlog.drain(..n).collect();
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
            state.stats.send_posts += 1;
            if let Err(e) = self.qp.post_send(&wrs) {
                // Those before the failed one were posted: their slots come
                // back with their (flushed) completions.
                for o in batch.iter().skip(e.index) {
                    state.send_free.push(o.slot);
                    state.slot_pins.remove(&o.slot);
                }
                self.mark_lost(state, format!("posting a send failed: {}", e.error));
                return;
            }
            self.fill_send_slots(state);
        }
    }

    /// `req` completed (its record waits in the state machine): invalidate
    /// its windows, and drop it when nobody will take it (abandoned, or an
    /// INTERRUPT, whose waiter only watches it leave).
    pub(super) fn finish_req(&self, state: &mut EngineState, req: ReqId, opcode: Opcode) {
        let Some(r) = state.conn.user_mut(req) else {
            return;
        };
        let (windows, group, abandoned) = (std::mem::take(&mut r.windows), r.group, r.abandoned);
        // One-shot windows are already disabled by the server's write (when
        // it happened); invalidate regardless — a short or failed read
        // leaves the window armed otherwise.
        state.stats.windows_invalidated += self.drop_windows(state, windows, group);
        if abandoned {
            if let Some(s) = state.conn.take_done(req).and_then(|d| d.user.stage) {
                free_stage(state, s);
            }
            return;
        }
        if opcode == Opcode::Interrupt {
            state.stats.interrupts_answered += 1;
            state.conn.take_done(req);
        }
        if let Some(fd) = &state.notify {
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
        lock(&self.state).notify = fd;
    }

    pub(super) fn completion(&self, state: &mut EngineState, w: Wc) {
        let v = wrid::value(w.wr_id);
        match wrid::kind(w.wr_id) {
            wrid::RECV => {
                state.recv_free.push(v as u32);
                if !w.is_ok() {
                    self.mark_lost(state, format!("receive completed with {:?}", w.status));
                    return;
                }
                let now = Instant::now();
                match (w.opcode, w.imm) {
                    (WcOpcode::RecvRdmaWithImm, Some(imm)) => {
                        state.stats.interrupt_completions += 1;
                        state.stats.immediate_completions += 1;
                        state.conn.handle_immediate(now, imm);
                    }
                    _ => {
                        let len = (w.byte_len as usize).min(RECV_SLOT);
                        let mut msg = vec![0u8; len];
                        let _ = self.recv_mr.read_at(v as usize * RECV_SLOT, &mut msg);
                        state.stats.interrupt_completions += 1;
                        state.conn.handle_recv(now, &msg, &AuthMem(&self.win_mr));
                    }
                }
            }
            wrid::SEND => {
                state.send_free.push(v as u32);
                state.slot_pins.remove(&(v as u32));
                if !w.is_ok() {
                    self.mark_lost(
                        state,
                        format!("send completed with {:?} ({:#x})", w.status, w.vendor_err),
                    );
                }
            }
            wrid::INVAL_SLOT => {
                // Done (or flushed: the QP is dead, nothing can write).
                state.conn.release_slot(v as u32);
                self.notify_sleepers(state);
                if !w.is_ok() && w.status != WcStatus::WrFlushErr {
                    warn!(status = ?w.status, "status window invalidation failed");
                    self.mark_lost(
                        state,
                        format!("window invalidation completed with {:?}", w.status),
                    );
                }
            }
            _ => {
                if wrid::kind(w.wr_id) == wrid::INVAL && v != 0 {
                    // Done (or flushed: the QP is dead, nothing can write).
                    if let Some(n) = state.inval_pending.get_mut(&v) {
                        *n -= 1;
                        if *n == 0 {
                            state.inval_pending.remove(&v);
                        }
                    }
                    self.notify_sleepers(state);
                }
                if !w.is_ok() && w.status != WcStatus::WrFlushErr {
                    warn!(status = ?w.status, opcode = ?w.opcode, "window operation failed");
                    self.mark_lost(
                        state,
                        format!("window operation completed with {:?}", w.status),
                    );
                }
            }
        }
    }

    /// Check the status blocks of outstanding polled requests.
    pub(super) fn scan_slots(&self, state: &mut EngineState) {
        for slot in state.conn.polled_slots() {
            self.check_slot(state, slot);
        }
    }

    pub(super) fn check_slot(&self, state: &mut EngineState, slot: u32) -> bool {
        let Ok(v) = self.win_mr.load_u64(self.status_off + slot as usize * 8) else {
            return false;
        };
        if !poll_block_written(v) {
            return false;
        }
        let (info, status) = (v as u32, (v >> 32) as u32);
        state.stats.polled_completions += 1;
        state
            .conn
            .status_block_updated(Instant::now(), slot, info, status);
        true
    }

    /// One round as the driver (the caller holds `self.driver`): sleep on
    /// the completion channel up to `timeout` (the soft provider's manual
    /// progress reads the socket in this thread), then process every
    /// completion, status block and action. The completions the wait
    /// returned (0: the queue was armed and empty when it timed out), or
    /// `None` once the connection is lost (completions drained).
    pub(super) fn drive(&self, timeout: Duration) -> Option<usize> {
        let mut wcs = [Wc::BLANK; 32];
        let n = match self.cq.wait(&self.chan, &mut wcs, Some(timeout)) {
            Ok(n) => n,
            Err(err) => {
                let mut state = lock(&self.state);
                self.mark_lost(&mut state, format!("completion channel failed: {err}"));
                return None;
            }
        };
        if n > 0 {
            let mut state = lock(&self.state);
            for w in wcs[..n].iter().copied() {
                self.completion(&mut state, w);
            }
            // Their events (windows invalidated, waiters woken) before the
            // lock goes: a waiter must not find a request done whose
            // windows are still bound.
            self.run_actions(&mut state);
            drop(state);
            self.poll_cq();
        }
        let mut state = lock(&self.state);
        if self.cfg.completion == Completion::Poll {
            self.scan_slots(&mut state);
        }
        state.conn.handle_timeout(Instant::now());
        self.run_actions(&mut state);
        self.flush_sends(&mut state);
        if state.lost.is_none() && self.qp.state() == QpState::Error {
            self.mark_lost(&mut state, "the server closed the connection".into());
        }
        let lost = state.lost.is_some();
        drop(state);
        if lost {
            self.cv.notify_all();
            // Keep draining flushes so resources are accounted, then stop.
            let _ = self.cq.poll(&mut wcs);
            return None;
        }
        Some(n)
    }

    pub(super) fn poll_cq(&self) -> bool {
        let mut wcs = [Wc::BLANK; 32];
        let mut any = false;
        loop {
            let n = match self.cq.poll(&mut wcs) {
                Ok(n) => n,
                Err(e) => {
                    let mut state = lock(&self.state);
                    self.mark_lost(&mut state, format!("completion queue failed: {e}"));
                    return false;
                }
            };
            if n == 0 {
                break;
            }
            any = true;
            let mut state = lock(&self.state);
            for w in wcs[..n].iter().copied() {
                self.completion(&mut state, w);
            }
            self.scan_slots(&mut state);
            self.run_actions(&mut state);
        }
        any
    }

    // ------------------------------------------------------------ issuing
}

/// The progress thread's first nap standing by while callers drive; each
/// further one that finds them still at it is twice as long, up to
/// [`STANDBY_MAX`].
pub(super) const STANDBY_FIRST: Duration = Duration::from_millis(2);
/// The longest nap standing by: a client whose callers keep waiting costs
/// 20 wake-ups a second (a fixed 2 ms nap cost 500: with 256 busy clients
/// on two CPUs, 128,000 a second and a quarter of the machine, issue 13),
/// and one whose callers stopped is driven again within two of them.
pub(super) const STANDBY_MAX: Duration = Duration::from_millis(50);

/// The progress thread: the driver while no caller waits. Between rounds
/// it sleeps on the completion channel and its wake-up eventfd until the
/// next deadline ([`Engine::next_wake`]), holding the driver role but not
/// the engine (dropping the engine wakes it, and it ends). While callers
/// wait (and so drive) it stands by, napping on its eventfd for
/// [`STANDBY_FIRST`] doubling to [`STANDBY_MAX`], and takes the role back
/// after a nap in which no caller waited at all (or at once when the last
/// one leaves while the notify fd is in use: `Engine::standby_wake`).
pub(super) fn progress_loop(
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
                let reapers = lock(&e.state).notify.is_some();
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
            let why = lock(&e.state).lost.clone().unwrap_or_default();
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
pub(super) fn nap_standby(wake: &std::os::fd::OwnedFd, nap: Duration) -> bool {
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
pub(super) fn nap(chan: &CompChannel, wake: &std::os::fd::OwnedFd, until: Option<Instant>) {
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
