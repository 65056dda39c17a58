//! The connected queue pair: its state, the work requests it tracks, and
//! teardown.

use super::*;

pub(in crate::ibv) struct Rec {
    pub(in crate::ibv) seq: u64,
    pub(in crate::ibv) wr_id: u64,
    pub(in crate::ibv) op: WcOpcode,
    pub(in crate::ibv) len: u32,
}

#[derive(Default)]
pub(in crate::ibv) struct Track {
    pub(in crate::ibv) next: u64,
    pub(in crate::ibv) pending: VecDeque<Rec>,
}

/// A connected RC queue pair and the rdma_cm id that owns it (the state
/// behind a `VerbsQp` handle, also watched by the CM monitor).
pub(crate) struct CmQp {
    pub(in crate::ibv) ctx: Arc<CtxInner>,
    pub(in crate::ibv) pd: Arc<PdInner>,
    pub(in crate::ibv) send_cq: Arc<CqInner>,
    pub(in crate::ibv) recv_cq: Arc<CqInner>,
    /// Receives come from here (the device's own QP has no receive queue).
    pub(in crate::ibv) srq: Option<Arc<SrqInner>>,
    pub(in crate::ibv) id: *mut rdma_cm_id,
    pub(in crate::ibv) qp: *mut ibv_qp,
    pub(in crate::ibv) qp_num: u32,
    pub(in crate::ibv) sq_sig_all: bool,
    pub(in crate::ibv) state: AtomicU8,
    pub(in crate::ibv) disconnected: AtomicBool,
    /// Posted work requests in order (the device sees sequence numbers as
    /// wr_ids; completions are translated back, which also gives flushed
    /// completions their true opcode).
    pub(in crate::ibv) sq: Mutex<Track>,
    pub(in crate::ibv) rq: Mutex<Track>,
    pub(in crate::ibv) negotiated: Mutex<Negotiated>,
    /// A weak reference to ourselves (for scheduling sweeps).
    pub(in crate::ibv) me: Weak<CmQp>,
    pub(in crate::ibv) local: SocketAddr,
    pub(in crate::ibv) peer: SocketAddr,
    pub(in crate::ibv) token: u64,
    /// Declared last: dropped after the id is destroyed in `drop`.
    pub(in crate::ibv) ch: EventChannel,
}

// SAFETY: the QP and id are used only through thread-safe verbs/rdma_cm
// calls; Rust-side state is atomic or behind mutexes.
unsafe impl Send for CmQp {}
// SAFETY: as above.
unsafe impl Sync for CmQp {}

impl CmQp {
    /// Wrap a freshly created QP (not yet connected). Its completions are
    /// translated from now on; the CM monitor watches it after `activate`.
    pub(in crate::ibv) fn create(parts: QpParts, ch: EventChannel, guard: IdGuard) -> Arc<CmQp> {
        let id = guard.release();
        // SAFETY: id is live with a QP created by rdma_create_qp; its address
        // was resolved (active side) or came with the request (passive side).
        let (qp, local, peer) = unsafe {
            (
                (*id).qp,
                from_sockaddr(&(*id).src_addr),
                from_sockaddr(&(*id).dst_addr),
            )
        };
        // SAFETY: qp is live; qp_num is a plain field.
        let qp_num = unsafe { (*qp).qp_num };
        let core = Arc::new_cyclic(|me| CmQp {
            me: me.clone(),
            ctx: parts.ctx,
            pd: parts.pd,
            send_cq: parts.send_cq,
            recv_cq: parts.recv_cq,
            srq: parts.srq,
            id,
            qp,
            qp_num,
            sq_sig_all: parts.sq_sig_all,
            state: AtomicU8::new(ST_RTS),
            disconnected: AtomicBool::new(false),
            sq: Mutex::new(Track::default()),
            rq: Mutex::new(Track::default()),
            negotiated: Mutex::new(Negotiated::default()),
            local,
            peer,
            token: NEXT_TOKEN.fetch_add(1, Ordering::Relaxed),
            ch,
        });
        lock(&core.send_cq.qps).insert(qp_num, Arc::downgrade(&core));
        lock(&core.recv_cq.qps).insert(qp_num, Arc::downgrade(&core));
        core
    }

    /// The connection is established: hand its CM events to the monitor.
    pub(in crate::ibv) fn activate(self: Arc<Self>) -> Result<Arc<dyn QpOps>> {
        monitor()?.add(&self)?;
        Ok(Arc::new(VerbsQp(self)))
    }

    /// Record that the QP is in the error state. The first time, schedule
    /// sweeps: requests that reached the device after it failed but before
    /// lwio knew (rxe and siw accept such posts and never complete them) are
    /// completed as flushed once the device has had time to flush the rest.
    pub(in crate::ibv) fn mark_error(&self) {
        if self.state.swap(ST_ERROR, Ordering::AcqRel) != ST_ERROR {
            if let Ok(m) = monitor() {
                let w = self.me.clone();
                m.schedule_sweep(Instant::now() + SWEEP_AFTER, w.clone());
                m.schedule_sweep(Instant::now() + SWEEP_AFTER * 4, w);
            }
        }
    }

    /// Complete, as flushed, every request of this QP that the device has
    /// not completed by now (see `mark_error`). Device completions that
    /// still arrive for them later find no record and are dropped.
    pub(in crate::ibv) fn sweep(&self) {
        // bring the records up to date with what the device completed
        let drain = |cq: &CqInner| {
            let mut side = lock(&cq.side);
            cq.drain_into(&mut side);
        };
        drain(&self.send_cq);
        drain(&self.recv_cq);
        let sq: Vec<Rec> = lock(&self.sq).pending.drain(..).collect();
        let rq: Vec<Rec> = lock(&self.rq).pending.drain(..).collect();
        if !sq.is_empty() || !rq.is_empty() {
            dbg_ibv!(
                "QP {}: {} send and {} receive requests never completed by the device: flushed",
                self.qp_num,
                sq.len(),
                rq.len()
            );
        }
        self.send_cq
            .push_synthetic_all(sq.into_iter().map(|r| self.flush_wc(r.wr_id, r.op)));
        self.recv_cq
            .push_synthetic_all(rq.into_iter().map(|r| self.flush_wc(r.wr_id, r.op)));
    }

    pub(in crate::ibv) fn modify_err(&self) {
        // SAFETY: ibv_qp_attr is plain data; all-zero is valid.
        let mut attr: ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = IBV_QPS_ERR;
        // SAFETY: self.qp is live until drop; attr lives for the call.
        let r = unsafe { (self.ctx.lib.ibv_modify_qp)(self.qp, &mut attr, IBV_QP_STATE) };
        if r != 0 {
            tracing::debug!("ibv_modify_qp(ERR) failed: {r}");
        }
    }

    /// Handle pending CM events (monitor thread).
    pub(in crate::ibv) fn process_cm_events(&self) {
        loop {
            match self.ch.try_next() {
                Ok(Some(ev)) => match ev.event {
                    RDMA_CM_EVENT_DISCONNECTED | RDMA_CM_EVENT_DEVICE_REMOVAL => {
                        tracing::debug!("QP {}: {}", self.qp_num, self.ctx.lib.event_str(ev.event));
                        self.disconnected.store(true, Ordering::Release);
                        self.modify_err();
                        self.mark_error();
                    }
                    _ => tracing::debug!(
                        "QP {}: ignoring {}",
                        self.qp_num,
                        self.ctx.lib.event_str(ev.event)
                    ),
                },
                Ok(None) => return,
                Err(e) => {
                    tracing::warn!("QP {}: rdma_get_cm_event: {e}", self.qp_num);
                    return;
                }
            }
        }
    }

    /// Translate a device completion of this QP.
    pub(in crate::ibv) fn translate(&self, wc: &ibv_wc) -> Option<Wc> {
        let recv = wc.wr_id & RECV_BIT != 0;
        let seq = wc.wr_id & !RECV_BIT;
        let rec = if let (true, Some(srq)) = (recv, &self.srq) {
            Rec {
                seq,
                wr_id: srq.take(seq)?,
                op: WcOpcode::Recv,
                len: 0,
            }
        } else {
            let mut t = lock(if recv { &self.rq } else { &self.sq });
            loop {
                match t.pending.front() {
                    None => return None,
                    // earlier unsignaled sends, completed silently
                    Some(r) if r.seq < seq => {
                        t.pending.pop_front();
                    }
                    Some(r) if r.seq == seq => break t.pending.pop_front()?,
                    Some(_) => return None,
                }
            }
        };
        let status = map_status(wc.status);
        if status != WcStatus::Success {
            // A failed request moves the QP to the error state.
            self.mark_error();
        }
        let opcode =
            if recv && status == WcStatus::Success && wc.opcode == IBV_WC_RECV_RDMA_WITH_IMM {
                WcOpcode::RecvRdmaWithImm
            } else {
                rec.op
            };
        let ok = status == WcStatus::Success;
        let with_inv = wc.wc_flags & IBV_WC_WITH_INV != 0
            || (recv && self.ctx.rxe_inv_quirk && wc.wc_flags & (1 << 2) != 0);
        let byte_len = match (ok, recv, opcode) {
            (false, _, _) => 0,
            (true, true, _) => wc.byte_len,
            (true, false, WcOpcode::RdmaRead) if wc.byte_len != 0 => wc.byte_len,
            (true, false, WcOpcode::BindMw | WcOpcode::LocalInv) => 0,
            (true, false, _) => rec.len,
        };
        Some(Wc {
            wr_id: rec.wr_id,
            status,
            opcode,
            byte_len,
            imm: (ok && wc.wc_flags & IBV_WC_WITH_IMM != 0).then(|| u32::from_be(wc.imm_data)),
            invalidated_rkey: (ok && with_inv).then_some(wc.imm_data),
            qp_num: self.qp_num,
            vendor_err: if ok { 0 } else { wc.vendor_err },
        })
    }

    pub(in crate::ibv) fn flush_wc(&self, wr_id: u64, op: WcOpcode) -> Wc {
        Wc {
            wr_id,
            status: WcStatus::WrFlushErr,
            opcode: op,
            byte_len: 0,
            imm: None,
            invalidated_rkey: None,
            qp_num: self.qp_num,
            vendor_err: 0,
        }
    }

    pub(in crate::ibv) fn is_error(&self) -> bool {
        self.state.load(Ordering::Acquire) == ST_ERROR
    }

    /// Post prepared send WRs (already linked) with their records.
    ///
    /// `wrs[i].wr_id` is filled with sequence numbers here.
    pub(in crate::ibv) fn post_send_raw(
        &self,
        wrs: &mut [ibv_send_wr],
        recs: &[(u64, WcOpcode, u32)],
    ) -> Result<(), PostError> {
        if self.is_error() {
            // Some devices (rxe on Linux 6.1) accept posts in the error state
            // but never complete them: complete them here as flushed.
            self.send_cq
                .push_synthetic_all(recs.iter().map(|&(wr_id, op, _)| self.flush_wc(wr_id, op)));
            return Ok(());
        }
        let mut t = lock(&self.sq);
        let base = t.next;
        for (i, w) in wrs.iter_mut().enumerate() {
            w.wr_id = base + i as u64;
        }
        let n = wrs.len();
        for i in 0..n {
            let next = if i + 1 < n {
                &mut wrs[i + 1] as *mut ibv_send_wr
            } else {
                ptr::null_mut()
            };
            wrs[i].next = next;
        }
        let mut bad: *mut ibv_send_wr = ptr::null_mut();
        // SAFETY: the inline ibv_post_send: the provider's post_send on our
        // live QP with a NULL-terminated list of WRs in `wrs`, whose SGE
        // arrays are owned by the caller's frame for the duration of the
        // call (the provider copies WQEs at post time). `bad` receives a
        // pointer into `wrs` on failure.
        let r = unsafe { (self.ctx.ops.post_send)(self.qp, wrs.as_mut_ptr(), &mut bad) };
        let posted = if r == 0 {
            n
        } else if bad.is_null() {
            0
        } else {
            // SAFETY: bad points into `wrs` (same allocation).
            (unsafe { bad.offset_from(wrs.as_ptr()) }).clamp(0, n as isize) as usize
        };
        for (i, (wr_id, op, len)) in recs.iter().copied().enumerate().take(posted) {
            t.pending.push_back(Rec {
                seq: base + i as u64,
                wr_id,
                op,
                len,
            });
        }
        t.next = base + posted as u64;
        drop(t);
        if r == 0 {
            return Ok(());
        }
        if self.is_error() || self.disconnected.load(Ordering::Acquire) {
            // The device refuses posts in the error state: complete them as
            // flushed, as the API promises.
            self.send_cq.push_synthetic_all(
                recs.iter()
                    .skip(posted)
                    .map(|&(wr_id, op, _)| self.flush_wc(wr_id, op)),
            );
            return Ok(());
        }
        Err(PostError {
            index: posted,
            error: errno_err("ibv_post_send", r.abs()),
        })
    }

    pub(in crate::ibv) fn sig_flags(&self, signaled: bool) -> u32 {
        if signaled || self.sq_sig_all {
            IBV_SEND_SIGNALED
        } else {
            0
        }
    }
}

impl Drop for CmQp {
    fn drop(&mut self) {
        if let Ok(m) = monitor() {
            m.remove(self.token, self.ch.fd());
        }
        let lib = self.ctx.lib;
        {
            let mut m = lock(&self.send_cq.qps);
            if m.get(&self.qp_num).is_some_and(|w| w.strong_count() == 0) {
                m.remove(&self.qp_num);
            }
        }
        {
            let mut m = lock(&self.recv_cq.qps);
            if m.get(&self.qp_num).is_some_and(|w| w.strong_count() == 0) {
                m.remove(&self.qp_num);
            }
        }
        // SAFETY: nothing else uses the id/QP any more (the monitor no longer
        // knows us; all handles are gone). Order: disconnect, destroy the QP,
        // destroy the id; the channel is dropped afterwards (field order).
        unsafe {
            if !self.disconnected.swap(true, Ordering::AcqRel) {
                (lib.rdma_disconnect)(self.id);
            }
            (lib.rdma_destroy_qp)(self.id);
            (lib.rdma_destroy_id)(self.id);
        }
        crate::ibv::async_events::forget_qp(self.qp);
    }
}
