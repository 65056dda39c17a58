//! The queue pair's operations (`QpOps`): posting sends, receives, RDMA
//! Writes and Reads and memory-window binds, polling completions.

use super::*;

pub(in crate::ibv) struct VerbsQp(pub(in crate::ibv) Arc<CmQp>);

pub(in crate::ibv) const EMPTY_SGE: ibv_sge = ibv_sge {
    addr: 0,
    length: 0,
    lkey: 0,
};

pub(in crate::ibv) fn fill_sges(out: &mut [ibv_sge], sg: &[Sge]) {
    for (o, s) in out.iter_mut().zip(sg) {
        *o = ibv_sge {
            addr: s.addr,
            length: s.length,
            lkey: s.lkey,
        };
    }
}

/// Scratch space for building a post: on the stack for up to `N` entries
/// (the common case), on the heap beyond. Pointers into it stay valid as long
/// as the scratch is not moved.
pub(in crate::ibv) enum Scratch<T: Copy, const N: usize> {
    Stack([T; N]),
    Heap(Vec<T>),
}

impl<T: Copy, const N: usize> Scratch<T, N> {
    pub(in crate::ibv) fn new(len: usize, fill: T) -> Self {
        if len <= N {
            Scratch::Stack([fill; N])
        } else {
            Scratch::Heap(vec![fill; len])
        }
    }
    pub(in crate::ibv) fn slice(&mut self, len: usize) -> &mut [T] {
        match self {
            Scratch::Stack(a) => &mut a[..len],
            Scratch::Heap(v) => &mut v[..len],
        }
    }
}

/// Post `wrs` as one NULL-terminated list of `ibv_recv_wr` whose wr_ids are
/// `(base + i) | RECV_BIT`, through `post(list, bad)` (an inline
/// `ibv_post_recv` / `ibv_post_srq_recv`). Returns what `post` returned and
/// how many of the list were posted. The list and its SGE arrays live on
/// this frame for the call (receive WQEs are copied at post time; the
/// buffers they describe are registered memory the consumer keeps alive per
/// the API contract).
pub(in crate::ibv) fn post_recv_list(
    iwarp: bool,
    wrs: &[RecvWr<'_>],
    base: u64,
    post: impl FnOnce(*mut ibv_recv_wr, *mut *mut ibv_recv_wr) -> i32,
) -> (i32, usize) {
    let total: usize = wrs.iter().map(|w| w.sg_list.len()).sum();
    let mut sge_buf: Scratch<ibv_sge, 8> = Scratch::new(total, EMPTY_SGE);
    let sges = sge_buf.slice(total);
    let blank = ibv_recv_wr {
        wr_id: 0,
        next: ptr::null_mut(),
        sg_list: ptr::null_mut(),
        num_sge: 0,
    };
    let mut wr_buf: Scratch<ibv_recv_wr, 8> = Scratch::new(wrs.len(), blank);
    let out = wr_buf.slice(wrs.len());
    // siw refuses receives without SGEs: give those one empty SGE (never
    // dereferenced: a zero-length SGE places no data and checks no key).
    let mut empty = EMPTY_SGE;
    let empty_sge: *mut ibv_sge = if iwarp { &mut empty } else { ptr::null_mut() };
    let mut at = 0usize;
    for (i, w) in wrs.iter().enumerate() {
        fill_sges(&mut sges[at..at + w.sg_list.len()], w.sg_list);
        let (sg_list, num_sge) = if w.sg_list.is_empty() {
            (empty_sge, (!empty_sge.is_null()) as i32)
        } else {
            (sges[at..].as_mut_ptr(), w.sg_list.len() as i32)
        };
        out[i] = ibv_recv_wr {
            wr_id: (base + i as u64) | RECV_BIT,
            next: ptr::null_mut(),
            sg_list,
            num_sge,
        };
        at += w.sg_list.len();
    }
    let n = out.len();
    for i in 0..n.saturating_sub(1) {
        let next = &mut out[i + 1] as *mut ibv_recv_wr;
        out[i].next = next;
    }
    let mut bad: *mut ibv_recv_wr = ptr::null_mut();
    let r = post(out.as_mut_ptr(), &mut bad);
    let posted = if r == 0 {
        n
    } else if bad.is_null() {
        0
    } else {
        // SAFETY: bad points into `out` (the provider returns the failing
        // element of the list it was given).
        (unsafe { bad.offset_from(out.as_ptr()) }).clamp(0, n as isize) as usize
    };
    (r, posted)
}

pub(in crate::ibv) fn blank_send_wr() -> ibv_send_wr {
    // SAFETY: ibv_send_wr is plain data (integers and nullable pointers);
    // all-zero is a valid value.
    unsafe { std::mem::zeroed() }
}

/// Validate a bind and return (region, remote access bits).
pub(in crate::ibv) fn check_bind(q: &CmQp, bind: &MwBind<'_>) -> Result<Arc<MrInner>> {
    let mr = (*bind.mr.ops)
        .as_any()
        .downcast_ref::<VerbsMr>()
        .ok_or_else(|| Error::InvalidArgument("region of another provider".into()))?
        .0
        .clone();
    if !Arc::ptr_eq(&mr.pd, &q.pd) {
        return Err(Error::Protection(
            "the region belongs to another protection domain than the QP".into(),
        ));
    }
    let allowed = Access::REMOTE_READ | Access::REMOTE_WRITE;
    if !allowed.contains(bind.access) {
        return Err(Error::InvalidArgument(format!(
            "window access {:?} (only REMOTE_READ | REMOTE_WRITE)",
            bind.access
        )));
    }
    if !mr.access.contains(Access::MW_BIND) {
        return Err(Error::Protection(
            "the region was not registered with MW_BIND".into(),
        ));
    }
    // IBA C10-78: a window granting remote write needs local write on the
    // region; the region needs no remote right of its own (C10-75: MW_BIND
    // only). Native windows are checked by the device as well; emulated
    // ones (a registration of the window's range per bind) only here.
    if bind.access.contains(Access::REMOTE_WRITE) && !mr.access.contains(Access::LOCAL_WRITE) {
        return Err(Error::Protection(format!(
            "a window with REMOTE_WRITE needs LOCAL_WRITE on the region ({:?})",
            mr.access
        )));
    }
    match bind.offset.checked_add(bind.length) {
        Some(end) if end <= mr.len => {}
        _ => {
            return Err(Error::InvalidArgument(format!(
                "window {}+{} outside the region of {} bytes",
                bind.offset, bind.length, mr.len
            )))
        }
    }
    if mr.raw().is_null() {
        return Err(Error::Protection("the region is deregistered".into()));
    }
    Ok(mr)
}

impl QpOps for VerbsQp {
    fn qp_num(&self) -> u32 {
        self.0.qp_num
    }

    fn state(&self) -> QpState {
        let q = &self.0;
        if q.is_error() {
            return QpState::Error;
        }
        // SAFETY: both structs are plain data; all-zero is valid.
        let (mut attr, mut init): (ibv_qp_attr, ibv_qp_init_attr) =
            unsafe { (std::mem::zeroed(), std::mem::zeroed()) };
        // SAFETY: q.qp is live; attr/init live for the call.
        let r = unsafe { (q.ctx.lib.ibv_query_qp)(q.qp, &mut attr, IBV_QP_STATE, &mut init) };
        // (siw does not fill qp_state: it stays 0 = RESET, read as "unknown")
        if r == 0 && matches!(attr.qp_state, IBV_QPS_ERR | IBV_QPS_SQE) {
            q.mark_error();
            return QpState::Error;
        }
        match q.state.load(Ordering::Acquire) {
            ST_RTS if r == 0 && attr.qp_state == IBV_QPS_SQD => QpState::Closing,
            ST_RTS => QpState::Rts,
            ST_CLOSING => QpState::Closing,
            _ => QpState::Error,
        }
    }

    fn negotiated(&self) -> Negotiated {
        lock(&self.0.negotiated).clone()
    }
    fn local_addr(&self) -> SocketAddr {
        self.0.local
    }
    fn peer_addr(&self) -> SocketAddr {
        self.0.peer
    }

    fn post_send(&self, wrs: &[SendWr<'_>]) -> Result<(), PostError> {
        let q = &self.0;
        if wrs.is_empty() {
            return Ok(());
        }
        let total: usize = wrs.iter().map(|w| w.sg_list.len()).sum();
        // Small lists (the common case) are built on the stack.
        let mut sge_buf: Scratch<ibv_sge, 8> = Scratch::new(total, EMPTY_SGE);
        let sges = sge_buf.slice(total);
        let mut wr_buf: Scratch<ibv_send_wr, 4> = Scratch::new(wrs.len(), blank_send_wr());
        let out = wr_buf.slice(wrs.len());
        let mut rec_buf: Scratch<(u64, WcOpcode, u32), 4> =
            Scratch::new(wrs.len(), (0, WcOpcode::Send, 0));
        let recs = rec_buf.slice(wrs.len());
        let mut at = 0usize;
        for (i, w) in wrs.iter().enumerate() {
            let r = &mut out[i];
            fill_sges(&mut sges[at..at + w.sg_list.len()], w.sg_list);
            r.num_sge = w.sg_list.len() as i32;
            r.sg_list = if w.sg_list.is_empty() {
                ptr::null_mut()
            } else {
                // `sges` stays where it is (no reallocation) until the post.
                sges[at..].as_mut_ptr()
            };
            at += w.sg_list.len();
            let mut flags = q.sig_flags(w.signaled);
            if w.fence {
                flags |= IBV_SEND_FENCE;
            }
            if w.solicited {
                flags |= IBV_SEND_SOLICITED;
            }
            if w.inline {
                flags |= IBV_SEND_INLINE;
            }
            r.send_flags = flags;
            let len: u32 = w.sg_list.iter().map(|s| s.length).sum();
            let op = match w.op {
                SendOp::Send => {
                    r.opcode = IBV_WR_SEND;
                    WcOpcode::Send
                }
                SendOp::SendWithImm { imm } => {
                    if q.ctx.iwarp {
                        return Err(PostError {
                            index: i,
                            error: Error::NotSupported("Send with immediate on iWARP".into()),
                        });
                    }
                    r.opcode = IBV_WR_SEND_WITH_IMM;
                    r.imm_data = imm.to_be();
                    WcOpcode::Send
                }
                SendOp::SendWithInvalidate { rkey } => {
                    r.opcode = IBV_WR_SEND_WITH_INV;
                    r.imm_data = rkey;
                    // libsiw (rdma-core 44 and later) takes the key to
                    // invalidate from wr.rdma.rkey; other providers ignore
                    // that field for sends.
                    r.rkey = rkey;
                    WcOpcode::Send
                }
                SendOp::Write { remote_addr, rkey } => {
                    r.opcode = IBV_WR_RDMA_WRITE;
                    r.remote_addr = remote_addr;
                    r.rkey = rkey;
                    WcOpcode::RdmaWrite
                }
                SendOp::WriteWithImm {
                    remote_addr,
                    rkey,
                    imm,
                } => {
                    if q.ctx.iwarp {
                        return Err(PostError {
                            index: i,
                            error: Error::NotSupported(
                                "RDMA Write with immediate on this iWARP device".into(),
                            ),
                        });
                    }
                    r.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
                    r.remote_addr = remote_addr;
                    r.rkey = rkey;
                    r.imm_data = imm.to_be();
                    WcOpcode::RdmaWrite
                }
                SendOp::Read { remote_addr, rkey } => {
                    r.opcode = IBV_WR_RDMA_READ;
                    r.remote_addr = remote_addr;
                    r.rkey = rkey;
                    WcOpcode::RdmaRead
                }
            };
            recs[i] = (w.wr_id, op, len);
        }
        q.post_send_raw(out, recs)
    }

    fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<(), PostError> {
        let q = &self.0;
        if wrs.is_empty() {
            return Ok(());
        }
        if q.srq.is_some() {
            return Err(PostError {
                index: 0,
                error: Error::InvalidArgument(
                    "the QP takes its receives from a shared receive queue".into(),
                ),
            });
        }
        if q.is_error() {
            // as in post_send_raw: complete as flushed ourselves
            for w in wrs {
                q.recv_cq
                    .push_synthetic(q.flush_wc(w.wr_id, WcOpcode::Recv));
            }
            return Ok(());
        }
        let mut t = lock(&q.rq);
        let base = t.next;
        let (r, posted) = post_recv_list(q.ctx.iwarp, wrs, base, |list, bad| {
            // SAFETY: the inline ibv_post_recv: the provider's post_recv on
            // our live QP with the NULL-terminated list `post_recv_list`
            // built (valid for the call, see there); `bad` is its out
            // pointer.
            unsafe { (q.ctx.ops.post_recv)(q.qp, list, bad) }
        });
        for (i, w) in wrs.iter().enumerate().take(posted) {
            t.pending.push_back(Rec {
                seq: base + i as u64,
                wr_id: w.wr_id,
                op: WcOpcode::Recv,
                len: 0,
            });
        }
        t.next = base + posted as u64;
        drop(t);
        if r == 0 {
            return Ok(());
        }
        if q.is_error() || q.disconnected.load(Ordering::Acquire) {
            for w in wrs.iter().skip(posted) {
                q.recv_cq
                    .push_synthetic(q.flush_wc(w.wr_id, WcOpcode::Recv));
            }
            return Ok(());
        }
        Err(PostError {
            index: posted,
            // (libsiw returns negative errnos)
            error: errno_err("ibv_post_recv", r.abs()),
        })
    }

    fn bind_mw(&self, mw: &Mw, bind: &MwBind<'_>, wr_id: u64, signaled: bool) -> Result<u32> {
        let q = &self.0;
        let w = (*mw.0)
            .as_any()
            .downcast_ref::<VerbsMw>()
            .ok_or_else(|| Error::InvalidArgument("window of another provider".into()))?
            .0
            .clone();
        if !Arc::ptr_eq(&w.pd, &q.pd) {
            return Err(Error::Protection(
                "the window belongs to another protection domain than the QP".into(),
            ));
        }
        let mr = check_bind(q, bind)?;
        let addr = mr.addr + bind.offset;
        match w.kind {
            MwKind::Native => {
                let raw_mw = *lock(&w.mw);
                if raw_mw.is_null() {
                    return Err(Error::InvalidArgument("window deallocated".into()));
                }
                let old = w.rkey.load(Ordering::Acquire);
                let new = (old & !0xff) | ((old.wrapping_add(1)) & 0xff);
                let mut r = blank_send_wr();
                r.opcode = IBV_WR_BIND_MW;
                r.send_flags = q.sig_flags(signaled);
                r.bind_mw = ibv_send_wr_bind_mw {
                    mw: raw_mw,
                    rkey: new,
                    bind_info: ibv_mw_bind_info {
                        mr: mr.raw(),
                        addr,
                        length: bind.length,
                        mw_access_flags: access_bits(bind.access) as u32,
                    },
                };
                q.post_send_raw(
                    std::slice::from_mut(&mut r),
                    &[(wr_id, WcOpcode::BindMw, 0)],
                )
                .map_err(|e| e.error)?;
                w.rkey.store(new, Ordering::Release);
                Ok(new)
            }
            MwKind::PerRequestRegistration => {
                if q.is_error() {
                    q.send_cq
                        .push_synthetic(q.flush_wc(wr_id, WcOpcode::BindMw));
                    return Ok(w.rkey.load(Ordering::Acquire));
                }
                if bind.length == 0 {
                    return Err(Error::NotSupported(
                        "zero-length windows without native memory windows".into(),
                    ));
                }
                w.unregister(None);
                let mut acc = bind.access;
                if acc.contains(Access::REMOTE_WRITE) {
                    // verbs require local write with remote write
                    acc |= Access::LOCAL_WRITE;
                }
                let len = usize::try_from(bind.length)
                    .map_err(|_| Error::InvalidArgument("window length".into()))?;
                let raw = q.pd.reg(addr as *mut u8, len, acc)?;
                // SAFETY: raw is the live ibv_mr just registered.
                let rkey = unsafe { (*raw).rkey };
                *lock(&w.reg) = Some(FallbackReg {
                    mr: raw,
                    _region: mr,
                });
                lock(&q.pd.windows).insert(rkey, Arc::downgrade(&w));
                w.rkey.store(rkey, Ordering::Release);
                if signaled || q.sq_sig_all {
                    q.send_cq.push_synthetic(Wc {
                        wr_id,
                        status: WcStatus::Success,
                        opcode: WcOpcode::BindMw,
                        byte_len: 0,
                        imm: None,
                        invalidated_rkey: None,
                        qp_num: q.qp_num,
                        vendor_err: 0,
                    });
                }
                Ok(rkey)
            }
        }
    }

    fn invalidate(&self, rkey: u32, wr_id: u64, signaled: bool) -> Result<()> {
        let q = &self.0;
        if q.ctx.native_mw {
            let mut r = blank_send_wr();
            r.opcode = IBV_WR_LOCAL_INV;
            r.send_flags = q.sig_flags(signaled);
            r.imm_data = rkey;
            return q
                .post_send_raw(
                    std::slice::from_mut(&mut r),
                    &[(wr_id, WcOpcode::LocalInv, 0)],
                )
                .map_err(|e| e.error);
        }
        if q.is_error() {
            q.send_cq
                .push_synthetic(q.flush_wc(wr_id, WcOpcode::LocalInv));
            return Ok(());
        }
        let w = lock(&q.pd.windows).get(&rkey).and_then(Weak::upgrade);
        match w {
            Some(w) if w.unregister(Some(rkey)) => {
                if signaled || q.sq_sig_all {
                    q.send_cq.push_synthetic(Wc {
                        wr_id,
                        status: WcStatus::Success,
                        opcode: WcOpcode::LocalInv,
                        byte_len: 0,
                        imm: None,
                        invalidated_rkey: None,
                        qp_num: q.qp_num,
                        vendor_err: 0,
                    });
                }
                Ok(())
            }
            _ => Err(Error::InvalidArgument(format!(
                "rkey {rkey:#x} is not a bound window of this protection domain"
            ))),
        }
    }

    fn disconnect(&self) -> Result<()> {
        let q = &self.0;
        if q.disconnected.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        let _ = q
            .state
            .compare_exchange(ST_RTS, ST_CLOSING, Ordering::AcqRel, Ordering::Acquire);
        // SAFETY: q.id is live until drop.
        let r = unsafe { (q.ctx.lib.rdma_disconnect)(q.id) };
        if r != 0 {
            // Not connected any more (peer went first): make sure we flush.
            q.modify_err();
            q.mark_error();
        }
        Ok(())
    }

    fn device_refusal(&self) -> Option<DeviceRefusal> {
        let q = &self.0;
        // The event may be queued a little after the flushed completions
        // that made the consumer ask: look again for up to 20 ms (this is
        // asked once, when a connection was lost).
        for i in 0..10 {
            if let Some(ev) = crate::ibv::async_events::qp_refusal(q.ctx.lib, q.ctx.ctx, q.qp) {
                return match ev {
                    IBV_EVENT_QP_ACCESS_ERR => Some(DeviceRefusal::Access),
                    IBV_EVENT_QP_REQ_ERR => Some(DeviceRefusal::InvalidRequest),
                    _ => None,
                };
            }
            if i < 9 {
                std::thread::sleep(Duration::from_millis(2));
            }
        }
        None
    }

    fn set_error(&self) {
        let q = &self.0;
        q.modify_err();
        q.mark_error();
        if !q.disconnected.swap(true, Ordering::AcqRel) {
            // SAFETY: q.id is live until drop.
            unsafe { (q.ctx.lib.rdma_disconnect)(q.id) };
        }
    }
}

// ---------------------------------------------------------------------------
// The CM monitor: one thread, epoll over the channels of established connections.

pub(in crate::ibv) static NEXT_TOKEN: AtomicU64 = AtomicU64::new(1);

/// How long after a QP fails lwio lets the device flush before sweeping.
pub(in crate::ibv) const SWEEP_AFTER: Duration = Duration::from_millis(250);
