//! Connecting: the active side (resolve, route, connect, private data)
//! and the queue pair's parts (PD, CQs, QP) a connection is made of.

use super::*;

/// `min(ours, peer)`, where a peer value of 0 means "not reported".
pub(in crate::ibv) fn min_known(ours: u8, peer: u8) -> u8 {
    if peer == 0 {
        ours
    } else {
        ours.min(peer)
    }
}

/// Connect, with a fresh cm_id and QP again when the kernel's connect
/// fails with EADDRINUSE: iw_cm's TCP connect (siw, iWARP NICs) picks its
/// own local port, which can collide with a connection still in TIME_WAIT
/// when one host connects to the same peer many times in a row (seen once
/// in a few hundred VM runs). A short, bounded retry; any other error is
/// returned at once.
pub(in crate::ibv) fn connect(
    ctx: &Arc<CtxInner>,
    addr: SocketAddr,
    init: &QpInit,
    params: &ConnParams,
    recvs: &[RecvWr<'_>],
) -> Result<Arc<dyn QpOps>> {
    let mut tries = 0u32;
    loop {
        match connect_once(ctx, addr, init, params, recvs) {
            Err(Error::Io(e)) if e.kind() == std::io::ErrorKind::AddrInUse && tries < 4 => {
                tries += 1;
                tracing::debug!(%addr, tries, error = %e, "RDMA connect: address in use, retrying");
                std::thread::sleep(std::time::Duration::from_millis(20 * u64::from(tries)));
            }
            r => return r,
        }
    }
}

pub(in crate::ibv) fn connect_once(
    ctx: &Arc<CtxInner>,
    addr: SocketAddr,
    init: &QpInit,
    params: &ConnParams,
    recvs: &[RecvWr<'_>],
) -> Result<Arc<dyn QpOps>> {
    let lib = ctx.lib;
    let pdata = frame_private(ctx.iwarp, PdMsg::Request, &params.private_data)?;
    let parts = QpParts::new(ctx, init)?;
    let deadline = Instant::now() + ctx.config.connect_timeout;
    let ch = EventChannel::new(lib)?;
    let mut id: *mut rdma_cm_id = ptr::null_mut();
    // SAFETY: ch is live; id receives a new id.
    let r = unsafe { (lib.rdma_create_id)(ch.ch, &mut id, ptr::null_mut(), RDMA_PS_TCP) };
    cm_ret(lib, "rdma_create_id", r)?;
    let mut guard = IdGuard {
        lib,
        id,
        has_qp: false,
    };
    let mut dst = to_sockaddr(addr);
    // SAFETY: id is live; dst is a valid sockaddr on the stack (copied).
    let r = unsafe {
        (lib.rdma_resolve_addr)(
            id,
            ptr::null_mut(),
            &mut dst as *mut _ as *mut libc::sockaddr,
            timeout_ms(ctx),
        )
    };
    cm_ret(lib, &format!("rdma_resolve_addr({addr})"), r)?;
    expect_event(
        ctx,
        &ch,
        RDMA_CM_EVENT_ADDR_RESOLVED,
        deadline,
        "resolve address",
    )?;
    // SAFETY: id is live; `verbs` is set once the address is resolved.
    let verbs = unsafe { (*id).verbs };
    if verbs != ctx.ctx {
        let other = if verbs.is_null() {
            "no RDMA device".to_string()
        } else {
            // SAFETY: a live context of librdmacm and its device.
            unsafe { cstr_array(&(*(*verbs).device).name) }
        };
        return Err(Error::InvalidArgument(format!(
            "{addr} is reached through {other}, not {}",
            ctx.info.name
        )));
    }
    // SAFETY: id is live with a resolved address.
    let r = unsafe { (lib.rdma_resolve_route)(id, timeout_ms(ctx)) };
    cm_ret(lib, "rdma_resolve_route", r)?;
    expect_event(
        ctx,
        &ch,
        RDMA_CM_EVENT_ROUTE_RESOLVED,
        deadline,
        "resolve route",
    )?;
    parts.create_qp(&mut guard)?;
    let core = CmQp::create(parts, ch, guard);
    // Receives go in before the peer can send.
    VerbsQp(core.clone())
        .post_recv(recvs)
        .map_err(|e| e.error)?;
    let my_ird = ctx.eff_ird(params.ird);
    let my_ord = ctx.eff_ord(params.ord);
    let mut cp = rdma_conn_param {
        private_data: pdata.as_ptr() as *const c_void,
        private_data_len: pdata.len() as u8,
        responder_resources: my_ird,
        initiator_depth: my_ord,
        flow_control: 1,
        retry_count: 7,
        rnr_retry_count: 7,
        srq: 0,
        qp_num: 0,
    };
    // SAFETY: core.id is live with a QP; cp and its private data live for the call.
    let r = unsafe { (lib.rdma_connect)(core.id, &mut cp) };
    cm_ret(lib, &format!("rdma_connect({addr})"), r)?;
    let ev = expect_event(
        ctx,
        &core.ch,
        RDMA_CM_EVENT_ESTABLISHED,
        deadline,
        "connect",
    )?;
    *lock(&core.negotiated) = Negotiated {
        peer_private_data: unframe_private(ctx.iwarp, &ev.private_data),
        // IB: as for requests, from our point of view: responder_resources =
        // the peer's ORD, initiator_depth = the peer's IRD (from its REP).
        // iWARP (iw_cm): our own final depths, swapped (initiator_depth = our
        // IRD, responder_resources = our ORD); the responder grants our ORD.
        ird: if ctx.iwarp {
            min_known(my_ird, ev.initiator_depth)
        } else {
            min_known(my_ird, ev.responder_resources)
        },
        ord: if ctx.iwarp {
            min_known(my_ord, ev.responder_resources)
        } else {
            min_known(my_ord, ev.initiator_depth)
        },
        mpa_crc: None,
    };
    core.activate()
}

// ---------------------------------------------------------------------------
// Queue pair.

/// The verbs objects a new QP is made of, checked against the context.
pub(in crate::ibv) struct QpParts {
    pub(in crate::ibv) ctx: Arc<CtxInner>,
    pub(in crate::ibv) pd: Arc<PdInner>,
    pub(in crate::ibv) send_cq: Arc<CqInner>,
    pub(in crate::ibv) recv_cq: Arc<CqInner>,
    pub(in crate::ibv) srq: Option<Arc<SrqInner>>,
    pub(in crate::ibv) cap: QpCap,
    pub(in crate::ibv) sq_sig_all: bool,
}

impl QpParts {
    pub(in crate::ibv) fn new(ctx: &Arc<CtxInner>, init: &QpInit) -> Result<QpParts> {
        let pd = (*init.pd.0)
            .as_any()
            .downcast_ref::<VerbsPd>()
            .ok_or_else(|| Error::InvalidArgument("PD of another provider".into()))?
            .0
            .clone();
        let cq = |c: &Cq| -> Result<Arc<CqInner>> {
            Ok((*c.0)
                .as_any()
                .downcast_ref::<VerbsCq>()
                .ok_or_else(|| Error::InvalidArgument("CQ of another provider".into()))?
                .0
                .clone())
        };
        let (send_cq, recv_cq) = (cq(&init.send_cq)?, cq(&init.recv_cq)?);
        let srq = match &init.srq {
            None => None,
            Some(s) => Some(
                (*s.0)
                    .as_any()
                    .downcast_ref::<VerbsSrq>()
                    .ok_or_else(|| Error::InvalidArgument("SRQ of another provider".into()))?
                    .0
                    .clone(),
            ),
        };
        // Two lwio contexts of one device share librdmacm's ibv_context, so
        // compare that, not the lwio objects.
        if pd.ctx.ctx != ctx.ctx
            || send_cq.ctx.ctx != ctx.ctx
            || recv_cq.ctx.ctx != ctx.ctx
            || srq.as_ref().is_some_and(|s| s.pd.ctx.ctx != ctx.ctx)
        {
            return Err(Error::InvalidArgument(format!(
                "the PD and CQs must come from the context that connects ({})",
                ctx.info.name
            )));
        }
        Ok(QpParts {
            ctx: ctx.clone(),
            pd,
            send_cq,
            recv_cq,
            srq,
            cap: init.cap,
            sq_sig_all: init.sq_sig_all,
        })
    }

    pub(in crate::ibv) fn create_qp(&self, guard: &mut IdGuard) -> Result<()> {
        let lib = self.ctx.lib;
        // SAFETY: guard.id is live.
        let verbs = unsafe { (*guard.id).verbs };
        if verbs != self.ctx.ctx {
            return Err(Error::InvalidArgument(format!(
                "the rdma_cm id is on another device context than {}",
                self.ctx.info.name
            )));
        }
        let has_srq = self.srq.is_some();
        let mut attr = ibv_qp_init_attr {
            qp_context: ptr::null_mut(),
            send_cq: self.send_cq.cq,
            recv_cq: self.recv_cq.cq,
            srq: self
                .srq
                .as_ref()
                .map_or(ptr::null_mut(), |s| s.srq.cast::<c_void>()),
            // With an SRQ the QP has no receive queue of its own.
            cap: ibv_qp_cap {
                max_send_wr: self.cap.max_send_wr.max(1),
                max_recv_wr: if has_srq {
                    0
                } else {
                    self.cap.max_recv_wr.max(1)
                },
                max_send_sge: self.cap.max_send_sge.max(1),
                max_recv_sge: if has_srq {
                    0
                } else {
                    self.cap.max_recv_sge.max(1)
                },
                max_inline_data: self.cap.max_inline_data,
            },
            qp_type: IBV_QPT_RC,
            sq_sig_all: self.sq_sig_all as i32,
        };
        // SAFETY: the id, PD, CQs and SRQ are live and of the same context
        // (checked; the QP keeps them alive through `CmQp`); attr lives on
        // the stack for the call.
        let r = unsafe { (lib.rdma_create_qp)(guard.id, self.pd.pd, &mut attr) };
        cm_ret(lib, "rdma_create_qp", r).map_err(|e| match e {
            Error::InvalidArgument(m) => Error::ResourceExhausted(format!(
                "{m} (QP caps {:?} exceed the device's?)",
                self.cap
            )),
            e => e,
        })?;
        guard.has_qp = true;
        Ok(())
    }
}

pub(in crate::ibv) const ST_RTS: u8 = 0;
pub(in crate::ibv) const ST_CLOSING: u8 = 1;
pub(in crate::ibv) const ST_ERROR: u8 = 2;

/// Marks a receive in the wr_id handed to the device.
pub(in crate::ibv) const RECV_BIT: u64 = 1 << 63;
