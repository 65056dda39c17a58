//! Listening: the listener's event channel and its connection requests
//! (private data, accept, reject).

use super::*;

pub(in crate::ibv) struct ListenerCore {
    pub(in crate::ibv) ctx: Arc<CtxInner>,
    pub(in crate::ibv) ch: EventChannel,
    pub(in crate::ibv) id: *mut rdma_cm_id,
    pub(in crate::ibv) local: SocketAddr,
}

// SAFETY: the listening id is only used by rdma_cm calls, which are
// thread-safe; it is destroyed once in drop.
unsafe impl Send for ListenerCore {}
// SAFETY: as above.
unsafe impl Sync for ListenerCore {}

impl Drop for ListenerCore {
    fn drop(&mut self) {
        // SAFETY: pending ConnRequests hold an Arc to us, so none is left;
        // the id is destroyed once, before the channel (field drop order).
        unsafe { (self.ctx.lib.rdma_destroy_id)(self.id) };
    }
}

pub(in crate::ibv) struct VerbsListener(pub(in crate::ibv) Arc<ListenerCore>);

pub(in crate::ibv) fn listen(
    ctx: &Arc<CtxInner>,
    addr: SocketAddr,
    backlog: u32,
) -> Result<Arc<dyn ListenerOps>> {
    let lib = ctx.lib;
    let ch = EventChannel::new(lib)?;
    let mut id: *mut rdma_cm_id = ptr::null_mut();
    // SAFETY: ch is live; id receives a new id on success.
    let r = unsafe { (lib.rdma_create_id)(ch.ch, &mut id, ptr::null_mut(), RDMA_PS_TCP) };
    cm_ret(lib, "rdma_create_id", r)?;
    let guard = IdGuard {
        lib,
        id,
        has_qp: false,
    };
    let mut sa = to_sockaddr(addr);
    // SAFETY: id is live; sa is a valid sockaddr of its family on the stack.
    let r = unsafe { (lib.rdma_bind_addr)(id, &mut sa as *mut _ as *mut libc::sockaddr) };
    cm_ret(lib, &format!("rdma_bind_addr({addr})"), r)?;
    // SAFETY: id is live; `verbs` is set by a bind to a device's address.
    let verbs = unsafe { (*id).verbs };
    if !verbs.is_null() && verbs != ctx.ctx {
        return Err(Error::InvalidArgument(format!(
            "{addr} belongs to another RDMA device than {}",
            ctx.info.name
        )));
    }
    // SAFETY: id is live and bound.
    let r = unsafe { (lib.rdma_listen)(id, backlog.min(i32::MAX as u32) as i32) };
    cm_ret(lib, "rdma_listen", r)?;
    // SAFETY: id is live; src_addr is plain data inside it.
    let local = from_sockaddr(unsafe { &(*id).src_addr });
    let id = guard.release();
    Ok(Arc::new(VerbsListener(Arc::new(ListenerCore {
        ctx: ctx.clone(),
        ch,
        id,
        local,
    }))))
}

impl ListenerOps for VerbsListener {
    fn local_addr(&self) -> SocketAddr {
        self.0.local
    }

    fn get_request(
        &self,
        timeout: Option<std::time::Duration>,
    ) -> Result<Option<Box<dyn ConnRequestOps>>> {
        let l = &self.0;
        let lib = l.ctx.lib;
        let deadline = timeout.map(|t| Instant::now() + t);
        loop {
            let Some(ev) = l.ch.next(deadline)? else {
                return Ok(None);
            };
            if ev.event != RDMA_CM_EVENT_CONNECT_REQUEST {
                tracing::debug!("listener: ignoring {}", lib.event_str(ev.event));
                continue;
            }
            // SAFETY: ev.id is the new, live id of this request.
            let verbs = unsafe { (*ev.id).verbs };
            if verbs != l.ctx.ctx {
                tracing::warn!(
                    "listener on {}: rejecting a request that arrived on another device",
                    l.ctx.info.name
                );
                // SAFETY: the request's id is ours to reject and destroy.
                unsafe {
                    (lib.rdma_reject)(ev.id, ptr::null(), 0);
                    (lib.rdma_destroy_id)(ev.id);
                }
                continue;
            }
            // SAFETY: ev.id is live; dst_addr is plain data inside it.
            let peer = from_sockaddr(unsafe { &(*ev.id).dst_addr });
            return Ok(Some(Box::new(VerbsConnRequest {
                listener: l.clone(),
                id: ev.id,
                peer,
                private_data: unframe_private(l.ctx.iwarp, &ev.private_data),
                // rdma_cm reports a request's depths from our point of view:
                // responder_resources = what we may grant = the peer's ORD,
                // initiator_depth = what we may use = the peer's IRD.
                peer_ird: ev.initiator_depth,
                peer_ord: ev.responder_resources,
            })));
        }
    }

    fn fd(&self) -> RawFd {
        self.0.ch.fd()
    }
}

pub(in crate::ibv) struct VerbsConnRequest {
    pub(in crate::ibv) listener: Arc<ListenerCore>,
    /// NULL once accepted or rejected.
    pub(in crate::ibv) id: *mut rdma_cm_id,
    pub(in crate::ibv) peer: SocketAddr,
    pub(in crate::ibv) private_data: Vec<u8>,
    pub(in crate::ibv) peer_ird: u8,
    pub(in crate::ibv) peer_ord: u8,
}

// SAFETY: the id is owned by this request alone until accept/reject.
unsafe impl Send for VerbsConnRequest {}

impl Drop for VerbsConnRequest {
    fn drop(&mut self) {
        if self.id.is_null() {
            return;
        }
        let lib = self.listener.ctx.lib;
        // SAFETY: an unanswered request: reject it and destroy its id (ours).
        unsafe {
            (lib.rdma_reject)(self.id, ptr::null(), 0);
            (lib.rdma_destroy_id)(self.id);
        }
    }
}

impl ConnRequestOps for VerbsConnRequest {
    fn peer_addr(&self) -> SocketAddr {
        self.peer
    }
    fn private_data(&self) -> &[u8] {
        &self.private_data
    }
    fn peer_ird_ord(&self) -> (u8, u8) {
        (self.peer_ird, self.peer_ord)
    }

    fn accept(self: Box<Self>, init: &QpInit, params: &ConnParams) -> Result<Arc<dyn QpOps>> {
        self.accept_with_recvs(init, params, &[])
    }

    fn accept_with_recvs(
        mut self: Box<Self>,
        init: &QpInit,
        params: &ConnParams,
        recvs: &[RecvWr<'_>],
    ) -> Result<Arc<dyn QpOps>> {
        let ctx = self.listener.ctx.clone();
        let lib = ctx.lib;
        // Checks that can fail first: on an early return `self` is dropped,
        // which rejects the request.
        let pdata = frame_private(ctx.iwarp, PdMsg::Accept, &params.private_data)?;
        let parts = QpParts::new(&ctx, init)?;
        let ch = EventChannel::new(lib)?;
        // Declared after `ch`, so on error the id is destroyed before its channel.
        let id = std::mem::replace(&mut self.id, ptr::null_mut());
        let mut guard = IdGuard {
            lib,
            id,
            has_qp: false,
        };
        // SAFETY: id is live; ch is a live channel that outlives the id (the
        // guard, and later the CmQp, destroy the id before the channel).
        let r = unsafe { (lib.rdma_migrate_id)(id, ch.ch) };
        cm_ret(lib, "rdma_migrate_id", r)?;
        parts.create_qp(&mut guard)?;
        // From here the QP is owned by `core` (dropping it on error destroys
        // the QP, then the id, then the channel).
        let core = CmQp::create(parts, ch, guard);
        // Receives go in before the peer can learn of the acceptance.
        VerbsQp(core.clone())
            .post_recv(recvs)
            .map_err(|e| e.error)?;
        // Offer our depths clamped to what the peer asked for where it said
        // (0 = not reported by the transport: leave it to the CM/device).
        //
        // iWARP: the kernel does not tell the initiator the IRD of our MPA
        // reply (its ESTABLISHED event repeats its own depths), so it may keep
        // its full ORD in flight: grant at least the peer's ORD (up to the
        // device limit) so that reads within its ORD never overrun our IRD.
        let ird = if ctx.iwarp {
            ctx.eff_ird(params.ird).max(self.peer_ord).min(ctx.max_ird)
        } else {
            min_known(ctx.eff_ird(params.ird), self.peer_ord)
        };
        let ord = min_known(ctx.eff_ord(params.ord), self.peer_ird);
        let mut cp = rdma_conn_param {
            private_data: pdata.as_ptr() as *const c_void,
            private_data_len: pdata.len() as u8,
            responder_resources: ird,
            initiator_depth: ord,
            flow_control: 1,
            retry_count: 7,
            rnr_retry_count: 7,
            srq: 0,
            qp_num: 0,
        };
        // SAFETY: core.id is live with a QP; cp and the private data it
        // points to live on this frame for the call (copied by the library).
        let r = unsafe { (lib.rdma_accept)(core.id, &mut cp) };
        cm_ret(lib, "rdma_accept", r)?;
        let deadline = Instant::now() + ctx.config.connect_timeout;
        expect_event(
            &ctx,
            &core.ch,
            RDMA_CM_EVENT_ESTABLISHED,
            deadline,
            "accept",
        )?;
        *lock(&core.negotiated) = Negotiated {
            peer_private_data: self.private_data.clone(),
            ird,
            ord,
            mpa_crc: None,
        };
        core.activate()
    }

    fn reject(mut self: Box<Self>, private_data: &[u8]) -> Result<()> {
        let ctx = self.listener.ctx.clone();
        let lib = ctx.lib;
        // (too much private data: `self` is dropped, rejecting without any)
        let pdata = frame_private(ctx.iwarp, PdMsg::Reject, private_data)?;
        let id = std::mem::replace(&mut self.id, ptr::null_mut());
        let _guard = IdGuard {
            lib,
            id,
            has_qp: false,
        };
        // SAFETY: id is live; the private data lives for the call.
        let r = unsafe {
            (lib.rdma_reject)(
                id,
                if pdata.is_empty() {
                    ptr::null()
                } else {
                    pdata.as_ptr() as *const c_void
                },
                pdata.len() as u8,
            )
        };
        cm_ret(lib, "rdma_reject", r)
    }
}

// ---------------------------------------------------------------------------
// Active side.
