//! Issuing requests: credits and queueing, memory windows and stages, and
//! each request kind (READ, WRITE, fragmented writes, REGISTER, CLOSE,
//! FLUSH, CANCEL).

use super::*;

impl Engine {
    /// Wait until a request can be issued and the resources exist, then run
    /// `issue` under the lock.
    pub(super) fn issue<T>(
        &self,
        issue: impl FnMut(&Engine, &mut EngineState) -> Option<Result<T>>,
    ) -> Result<T> {
        self.issue_when(ClientConn::can_issue, issue)
    }

    /// [`Engine::issue`] once `free` says a credit is free for this kind of
    /// request (INTERRUPT and CANCEL may take the reserved one).
    pub(super) fn issue_when<T>(
        &self,
        free: fn(&ClientConn<ReqData>) -> bool,
        mut issue: impl FnMut(&Engine, &mut EngineState) -> Option<Result<T>>,
    ) -> Result<T> {
        let _waiting = Waiting::new(self);
        let deadline = Instant::now() + self.cfg.op_timeout;
        let mut state = lock(&self.state);
        // Counted among the requests waiting for a credit (the Credits
        // hint: seed 000) from the first attempt that fails until this
        // one is issued or given up.
        let mut queued = false;
        let r = loop {
            if let Some(l) = &state.lost {
                break Err(Error::ConnectionLost(l.clone()));
            }
            // A credit but not the resources (staging buffer, window, send
            // slot): those come back only when other threads finish their
            // requests, which takes this lock, so never retry without
            // letting go of it (polling once spun here holding it while 32
            // AIO threads waited to give their buffers back).
            let mut short = false;
            if free(&state.conn) {
                // Not waiting any more when its own request is stamped.
                Self::set_queued(&mut state, &mut queued, false);
                if let Some(r) = issue(self, &mut state) {
                    self.issued(&mut state);
                    break r;
                }
                short = true;
            }
            Self::set_queued(&mut state, &mut queued, true);
            if self.cfg.completion == Completion::Poll {
                self.scan_slots(&mut state);
                self.run_actions(&mut state);
                if !short && free(&state.conn) {
                    continue;
                }
            }
            let now = Instant::now();
            if now >= deadline {
                break Err(Error::TimedOut("waiting for a credit".into()));
            }
            let wait = (deadline - now).min(Duration::from_millis(
                if self.cfg.completion == Completion::Poll {
                    1
                } else {
                    50
                },
            ));
            self.sleep_or_drive(state, wait);
            state = lock(&self.state);
        };
        Self::set_queued(&mut state, &mut queued, false);
        r
    }

    /// Count (`on`) or stop counting a caller among the requests waiting
    /// for a credit, which the connection reports in its Credits hint.
    pub(super) fn set_queued(state: &mut EngineState, queued: &mut bool, on: bool) {
        if *queued != on {
            *queued = on;
            let n = state.conn.waiting();
            state
                .conn
                .set_waiting(if on { n + 1 } else { n.saturating_sub(1) });
        }
    }

    /// Count the caller among the requests waiting for a credit until the
    /// guard is dropped: an async future that sleeps until a completion
    /// frees one (a thread blocked in an issue is counted there). It is in
    /// the Credits hint of the requests that go out meanwhile.
    pub(crate) fn credit_waiter(self: &Arc<Self>) -> CreditWaiter {
        let mut queued = false;
        Self::set_queued(&mut lock(&self.state), &mut queued, true);
        CreditWaiter(self.clone())
    }

    /// Count a request just issued and carry out its actions.
    pub(super) fn issued(&self, state: &mut EngineState) {
        let out = state.conn.outstanding();
        state.stats.requests += 1;
        state.stats.max_outstanding = state.stats.max_outstanding.max(out);
        if out > usize::from(state.conn.credits()) {
            state.stats.credit_violations += 1;
        }
        self.run_actions(state);
    }

    /// [`Engine::issue`] without waiting: `Ok(None)` when no credit or
    /// resource (staging buffer, window, send slot) is free now. The async
    /// client retries when the next completion frees one. What it issues
    /// is posted at once.
    pub(super) fn issue_now<T>(
        &self,
        issue: impl FnMut(&Engine, &mut EngineState) -> Option<Result<T>>,
    ) -> Result<Option<T>> {
        self.issue_now_when(ClientConn::can_issue, issue)
    }

    /// [`Engine::issue_now`] for a kind of request whose credit `free`
    /// tells (see [`Engine::issue_when`]).
    pub(super) fn issue_now_when<T>(
        &self,
        free: fn(&ClientConn<ReqData>) -> bool,
        mut issue: impl FnMut(&Engine, &mut EngineState) -> Option<Result<T>>,
    ) -> Result<Option<T>> {
        let mut state = lock(&self.state);
        for _ in 0..2 {
            if let Some(l) = &state.lost {
                return Err(Error::ConnectionLost(l.clone()));
            }
            if free(&state.conn) {
                if let Some(r) = issue(self, &mut state) {
                    self.issued(&mut state);
                    self.flush_sends(&mut state);
                    return r.map(Some);
                }
                return Ok(None);
            }
            if self.cfg.completion != Completion::Poll {
                break;
            }
            // Completions polled now may return a credit.
            self.scan_slots(&mut state);
            self.run_actions(&mut state);
        }
        Ok(None)
    }

    /// Polling mode, and every free status slot is waiting for its old
    /// window's invalidation to complete: a request waits (as for a credit)
    /// instead of failing.
    pub(super) fn slots_fenced(&self, state: &EngineState) -> bool {
        self.cfg.completion == Completion::Poll
            && state.conn.next_status_slot().is_none()
            && state.conn.fenced_slots() > 0
    }

    /// The completion mode of a request about to be issued under `state`, and
    /// in polling mode the one-shot window bound to exactly the status block
    /// it will use (the caller keeps it with the request's other windows,
    /// invalidated when it completes).
    pub(super) fn req_mode(&self, state: &mut EngineState) -> Result<(Mode, Option<(Mw, u32)>)> {
        if self.cfg.completion == Completion::Interrupt {
            return Ok((Mode::Interrupt, None));
        }
        let (slot, _) = state
            .conn
            .next_status_slot()
            .ok_or_else(|| client_err(ClientError::NoStatusBlock))?;
        let (mw, rkey) = self.bind_window(
            state,
            &self.win_mr,
            self.status_off + slot as usize * 8,
            8,
            false,
        )?;
        state.status_keys.insert(rkey, slot);
        Ok((Mode::PolledWindow(rkey), Some((mw, rkey))))
    }

    /// Invalidate and free windows (of a completed request, or of one that
    /// was not issued); returns how many invalidations were posted.
    pub(super) fn drop_windows(
        &self,
        state: &mut EngineState,
        windows: Vec<(Mw, u32)>,
        group: u64,
    ) -> u64 {
        let mut posted = 0;
        for (mw, rkey) in windows {
            if let Some(slot) = state.status_keys.remove(&rkey) {
                // A status block's window: its slot serves again once the
                // invalidation has completed (`release_slot` at its
                // completion), never while the old key may still reach it.
                if self
                    .qp
                    .invalidate(rkey, wrid::INVAL_SLOT | u64::from(slot), true)
                    .is_ok()
                {
                    posted += 1;
                } else {
                    state.conn.release_slot(slot);
                }
            } else if self.qp.invalidate(rkey, wrid::INVAL | group, true).is_ok() {
                posted += 1;
                if group != 0 {
                    *state.inval_pending.entry(group).or_default() += 1;
                }
            }
            state.mw_free.push(mw);
        }
        posted
    }

    /// Keep a status window with its request until the request completes.
    pub(super) fn keep_window(state: &mut EngineState, req: ReqId, w: Option<(Mw, u32)>) {
        if let (Some(w), Some(d)) = (w, state.conn.user_mut(req)) {
            d.windows.push(w);
        }
    }

    /// Bind a window over `off..off + len` of `mr` for one request. One-shot
    /// (the provider retires the key at its first use, where it can) unless
    /// `multi`: a READ longer than the server's window arrives in several
    /// RDMA Writes, so its window stays bound until the request completes
    /// and is invalidated then, like every window.
    pub(super) fn bind_window(
        &self,
        state: &mut EngineState,
        mr: &Mr,
        off: usize,
        len: usize,
        multi: bool,
    ) -> Result<(Mw, u32)> {
        let mw = match state.mw_free.pop() {
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
                state.stats.windows_bound += 1;
                Ok((mw, rkey))
            }
            Err(e) => {
                state.mw_free.push(mw);
                Err(e.into())
            }
        }
    }

    pub(super) fn stage_off(&self, s: Stage) -> Option<usize> {
        match s {
            Stage::Bounce(i) => Some(self.bounce_off + i * BOUNCE_SLOT),
            Stage::Slot(i) => Some(self.stage_off + i * self.cfg.read_chunk),
            Stage::User => None,
        }
    }

    pub(super) fn take_stage(&self, state: &mut EngineState, len: usize) -> Option<Stage> {
        if len <= BOUNCE_SLOT {
            if let Some(i) = state.bounce_free.pop() {
                return Some(Stage::Bounce(i));
            }
        }
        state.stage_free.pop().map(Stage::Slot)
    }

    /// Issue a READ (or VEC_READ with `vec_pages`) of `len` bytes into a
    /// staging buffer. Returns the request and its stage.
    #[cfg(feature = "test-support")]
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

    pub(super) fn check_read(&self, len: usize, dst: Option<(&UserDst, usize)>) -> Result<()> {
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
    pub(super) fn read_issuer<'a>(
        fid: u16,
        offset: u64,
        len: usize,
        vec_page: Option<u16>,
        dst: Option<(&'a UserDst, usize)>,
    ) -> impl FnMut(&Engine, &mut EngineState) -> Option<Result<(ReqId, Stage)>> + 'a {
        move |e, state| {
            if e.slots_fenced(state) {
                return None;
            }
            let (stage, mr, off, group) = match dst {
                Some((d, at)) => (Stage::User, &d.reg.mr, d.off + at, d.group),
                None => {
                    let stage = e.take_stage(state, len)?;
                    (stage, &e.win_mr, e.stage_off(stage)?, 0)
                }
            };
            let mut windows = Vec::new();
            let r = (|| -> Result<Issued> {
                let (mode, status) = e.req_mode(state)?;
                windows.extend(status);
                match vec_page {
                    None => {
                        let window = state
                            .conn
                            .server_params()
                            .map_or(0, |p| p.max_rdma_window_size as usize);
                        let (mw, rkey) = e.bind_window(state, mr, off, len, len > window)?;
                        windows.push((mw, rkey));
                        let dst = RemoteBuf {
                            addr: mr.addr() + off as u64,
                            rkey,
                        };
                        state
                            .conn
                            .read(Instant::now(), fid, offset, len as u32, dst, mode)
                            .map_err(client_err)
                    }
                    Some(ps) => {
                        let ps_u = usize::from(ps.max(1));
                        let mut regions = Vec::new();
                        let mut o = 0;
                        while o < len {
                            let l = ps_u.min(len - o);
                            let (mw, rkey) = e.bind_window(state, mr, off + o, l, false)?;
                            windows.push((mw, rkey));
                            regions.push(RdmaRegion {
                                data_va: mr.addr() + (off + o) as u64,
                                data_mh: rkey,
                                length: l as u32,
                            });
                            o += l;
                        }
                        state
                            .conn
                            .vec_read(Instant::now(), fid, offset, len as u32, ps, &regions, mode)
                            .map_err(client_err)
                    }
                }
            })();
            match r {
                Ok(Issued { req, .. }) => {
                    if let Some(d) = state.conn.user_mut(req) {
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
                    e.drop_windows(state, windows, group);
                    free_stage(state, stage);
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
        let mut state = lock(&self.state);
        free_stage(&mut state, stage);
        self.notify_sleepers(&mut state);
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
        let state = lock(&self.state);
        let slots = self.send_slots.min(self.fragment_credits(&state));
        state
            .conn
            .max_fragmented_write(slots as u32, self.fragment_cap(zero_copy))
            .min(u32::MAX - 1) as usize
    }

    /// The most fragments one message may have: the connection's credits,
    /// less one in polling mode, where a waiter's INTERRUPT holds a credit
    /// until the next I/O completion (a message needing every credit would
    /// wait for it, and it for the message).
    pub(super) fn fragment_credits(&self, state: &EngineState) -> usize {
        let c = usize::from(state.conn.credits());
        if self.cfg.completion == Completion::Poll {
            c.saturating_sub(1).max(1)
        } else {
            c
        }
    }

    /// The most data bytes per fragment this engine sends: a send slot's
    /// worth when it copies, else what the server's buffers take.
    pub(super) fn fragment_cap(&self, zero_copy: bool) -> u32 {
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
        let mut state = lock(&self.state);
        loop {
            if !state.slot_pins.values().any(|r| Arc::ptr_eq(r, &src.reg)) {
                return;
            }
            let now = Instant::now();
            if now >= deadline {
                self.mark_lost(
                    &mut state,
                    "sends from caller memory did not complete".into(),
                );
                self.qp.set_error();
                state.slot_pins.retain(|_, r| !Arc::ptr_eq(r, &src.reg));
                return;
            }
            self.sleep_or_drive(state, (deadline - now).min(Duration::from_millis(5)));
            state = lock(&self.state);
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
        self.issue(|e, state| {
            e.fill_send_slots(state);
            let cap = e.fragment_cap(src.is_some());
            let n = state.conn.fragments_for(len, cap) as usize;
            if n == 0 || n > e.send_slots {
                return Some(Err(Error::InvalidArgument(format!(
                    "a write of {len} bytes cannot be one message here"
                ))));
            }
            let credits = usize::from(state.conn.credits());
            if n > e.fragment_credits(state) {
                return Some(Err(client_err(ClientError::TooManyFragments {
                    fragments: n as u32,
                    credits: state.conn.credits(),
                })));
            }
            // Every resource first (a credit and a send slot per fragment),
            // then the status window of polling mode: nothing is bound for
            // an attempt that has to wait.
            if state.conn.transmit_pending() > 0
                || state.send_free.len() < n
                || state.conn.credits_held() + n > credits
                || e.slots_fenced(state)
            {
                return None;
            }
            let (mode, status) = match e.req_mode(state) {
                Ok(m) => m,
                Err(err) => return Some(Err(err)),
            };
            let plan = match state.conn.write_fragmented(
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
                    e.drop_windows(state, status.into_iter().collect(), 0);
                    return None;
                }
                Err(err) => {
                    e.drop_windows(state, status.into_iter().collect(), 0);
                    return Some(Err(client_err(err)));
                }
            };
            for f in &plan.fragments {
                let Some(slot) = state.send_free.pop() else {
                    // Checked above: n slots were free under this lock.
                    e.mark_lost(state, "no send slot for a fragment".into());
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
                    state.send_free.push(slot);
                    e.mark_lost(state, "a fragment does not fit its send slot".into());
                    return Some(Err(Error::ConnectionLost("send slot too small".into())));
                };
                let sge = match src {
                    Some(u) if !d.is_empty() => {
                        state.slot_pins.insert(slot, u.reg.clone());
                        Some(u.reg.mr.sge(u.off + d.start, d.len() as u32))
                    }
                    _ => None,
                };
                if copy {
                    state.stats.send_copy_bytes += d.len() as u64;
                }
                state.send_backlog.push_back(Outgoing {
                    slot,
                    len: used,
                    data: sge,
                });
            }
            state.stats.fragmented_writes += 1;
            state.stats.fragments_sent += plan.fragments.len() as u64;
            Self::keep_window(state, plan.issued.req, status);
            Some(Ok(plan.issued.req))
        })
    }

    /// Issue a request whose payload the caller lends (WRITE, VEC_WRITE):
    /// `encode` writes it straight into a free send slot (the data's only
    /// copy). Messages queued before it go to slots first; without a free
    /// slot the issue waits, like one without a credit. For
    /// [`Engine::issue`] and [`Engine::issue_now`].
    pub(super) fn in_slot(
        mut encode: impl FnMut(
            &mut ClientConn<ReqData>,
            Mode,
            &mut [u8],
        ) -> std::result::Result<(Issued, usize), ClientError>,
    ) -> impl FnMut(&Engine, &mut EngineState) -> Option<Result<ReqId>> {
        move |e, state| {
            e.fill_send_slots(state);
            if state.conn.transmit_pending() > 0
                || state.send_free.is_empty()
                || e.slots_fenced(state)
            {
                return None;
            }
            let slot = state.send_free.pop()?;
            let (mode, status) = match e.req_mode(state) {
                Ok(m) => m,
                Err(err) => {
                    state.send_free.push(slot);
                    return Some(Err(err));
                }
            };
            let r = e
                .with_send_slot(slot, |out| encode(&mut state.conn, mode, out))
                .unwrap_or(Err(ClientError::InvalidArgument));
            match r {
                Ok((issued, len)) => {
                    state.stats.send_copy_bytes += len.saturating_sub(COMMON_HEADER_LEN) as u64;
                    state.send_backlog.push_back(Outgoing {
                        slot,
                        len,
                        data: None,
                    });
                    Self::keep_window(state, issued.req, status);
                    Some(Ok(issued.req))
                }
                Err(err) => {
                    state.send_free.push(slot);
                    e.drop_windows(state, status.into_iter().collect(), 0);
                    Some(Err(client_err(err)))
                }
            }
        }
    }

    pub fn issue_register(&self, key: SrvResumeKey, flags: u32) -> Result<ReqId> {
        self.issue(|_, state| {
            Some(
                state
                    .conn
                    .register(Instant::now(), key, flags)
                    .map_err(client_err),
            )
        })
    }

    /// FLUSH `fid`: fsync (fdatasync with `data_only`) on the server.
    pub fn issue_flush(&self, fid: u16, data_only: bool) -> Result<ReqId> {
        self.issue(|_, state| {
            Some(
                state
                    .conn
                    .flush(Instant::now(), fid, data_only)
                    .map_err(client_err),
            )
        })
    }

    pub fn issue_close(&self, fid: u16) -> Result<ReqId> {
        self.issue(|_, state| {
            Some(
                state
                    .conn
                    .close_file(Instant::now(), fid)
                    .map_err(client_err),
            )
        })
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
        match self.wait(req)? {
            (_, lwio_proto::status::STATUS_INVALID_HANDLE) => Ok(()),
            (_, status) => Err(Error::Status {
                what: "CLOSE of FID 0 (the ordering barrier)".into(),
                status,
            }),
        }
    }

    pub fn issue_cancel(&self, fid: u16) -> Result<ReqId> {
        self.issue_when(ClientConn::can_interrupt, |_, state| {
            Some(state.conn.cancel(Instant::now(), fid).map_err(client_err))
        })
    }

    /// [`Engine::issue_cancel`] without waiting (`Ok(None)`: no credit now).
    pub fn try_issue_cancel(&self, fid: u16) -> Result<Option<ReqId>> {
        self.issue_now_when(ClientConn::can_interrupt, |_, state| {
            Some(state.conn.cancel(Instant::now(), fid).map_err(client_err))
        })
    }

    /// CANCEL just the I/O `req` of `fid`; `None` (nothing sent) when it
    /// is no longer outstanding.
    pub fn issue_cancel_request(&self, fid: u16, req: ReqId) -> Result<Option<ReqId>> {
        if !lock(&self.state).conn.is_outstanding(req) {
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

    pub(super) fn cancel_issuer(
        fid: u16,
        req: ReqId,
    ) -> impl FnMut(&Engine, &mut EngineState) -> Option<Result<Option<ReqId>>> {
        move |_, state| {
            if !state.conn.is_outstanding(req) {
                return Some(Ok(None));
            }
            Some(
                state
                    .conn
                    .cancel_request(Instant::now(), fid, req)
                    .map(Some)
                    .map_err(client_err),
            )
        }
    }
}

/// A future counted among the requests waiting for a credit
/// ([`Engine::credit_waiter`]); dropping it (the wait ended, or the future
/// was dropped) stops counting it.
pub(crate) struct CreditWaiter(Arc<Engine>);

impl Drop for CreditWaiter {
    fn drop(&mut self) {
        let mut queued = true;
        Engine::set_queued(&mut lock(&self.0.state), &mut queued, false);
    }
}
