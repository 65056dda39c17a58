//! Connections through rdma_cm, and the queue pair.
//!
//! Event channels: one per listener, one per connection. A connection request
//! arrives on its listener's channel; `accept` migrates the new id to a channel
//! of its own. Once established, a connection's channel is registered with the
//! process-wide [`Monitor`] thread, which handles `DISCONNECTED` (QP → error,
//! so posted work requests flush) and device removal.

use std::collections::{HashMap, VecDeque};
use std::ffi::c_void;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::os::fd::RawFd;
use std::ptr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use super::ffi::*;
use super::*;

// ---------------------------------------------------------------------------
// Private data.

/// Marker of lwio's framing of private data on IB/RoCE, where the CM delivers
/// the peer's private data zero-padded to the message's fixed size (56 bytes
/// in a REQ, 196 in a REP, 148 in a REJ): `[MAGIC, len, data…]` lets the
/// receiver recover the exact bytes. iWARP (MPA) carries exact lengths and is
/// not framed, so lwio interoperates with any iWARP peer.
const PD_MAGIC: u8 = 0xA7;

/// Which CM message carries private data (IB/RoCE limits differ per message).
#[derive(Clone, Copy, Debug)]
pub(super) enum PdMsg {
    /// Connection request (IB REQ: 56 bytes after rdma_cm's header).
    Request,
    /// Accept (IB REP: 196 bytes).
    Accept,
    /// Reject (IB REJ: 148 bytes).
    Reject,
}

pub(super) fn frame_private(iwarp: bool, msg: PdMsg, data: &[u8]) -> Result<Vec<u8>> {
    // rdma_conn_param.private_data_len is a u8: 255 on iWARP (MPA itself
    // allows 512). On IB/RoCE the CM message size minus lwio's 2-byte frame.
    let limit = if iwarp {
        255
    } else {
        match msg {
            PdMsg::Request => 54,
            PdMsg::Accept => 194,
            PdMsg::Reject => 146,
        }
    };
    if data.len() > limit {
        return Err(Error::InvalidArgument(format!(
            "{} bytes of private data in a {msg:?}: this transport carries at most {limit}",
            data.len()
        )));
    }
    if iwarp {
        return Ok(data.to_vec());
    }
    let mut v = Vec::with_capacity(data.len() + 2);
    v.push(PD_MAGIC);
    v.push(data.len() as u8);
    v.extend_from_slice(data);
    Ok(v)
}

pub(super) fn unframe_private(iwarp: bool, raw: &[u8]) -> Vec<u8> {
    if !iwarp && raw.len() >= 2 && raw[0] == PD_MAGIC && (raw[1] as usize) <= raw.len() - 2 {
        return raw[2..2 + raw[1] as usize].to_vec();
    }
    raw.to_vec()
}

// ---------------------------------------------------------------------------
// Socket addresses.

fn to_sockaddr(addr: SocketAddr) -> libc::sockaddr_storage {
    // SAFETY: sockaddr_storage is plain data; all-zero is valid.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    match addr {
        SocketAddr::V4(a) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: a.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from(*a.ip()).to_be(),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_in fits in (and is less aligned than) sockaddr_storage.
            unsafe { ptr::write(&mut ss as *mut _ as *mut libc::sockaddr_in, sin) };
        }
        SocketAddr::V6(a) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: a.port().to_be(),
                sin6_flowinfo: a.flowinfo(),
                sin6_addr: libc::in6_addr {
                    s6_addr: a.ip().octets(),
                },
                sin6_scope_id: a.scope_id(),
            };
            // SAFETY: as above.
            unsafe { ptr::write(&mut ss as *mut _ as *mut libc::sockaddr_in6, sin6) };
        }
    }
    ss
}

fn from_sockaddr(ss: &libc::sockaddr_storage) -> SocketAddr {
    match ss.ss_family as i32 {
        libc::AF_INET => {
            // SAFETY: the family says the storage holds a sockaddr_in.
            let sin = unsafe { &*(ss as *const _ as *const libc::sockaddr_in) };
            SocketAddr::V4(SocketAddrV4::new(
                Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)),
                u16::from_be(sin.sin_port),
            ))
        }
        libc::AF_INET6 => {
            // SAFETY: the family says the storage holds a sockaddr_in6.
            let sin6 = unsafe { &*(ss as *const _ as *const libc::sockaddr_in6) };
            SocketAddr::V6(SocketAddrV6::new(
                Ipv6Addr::from(sin6.sin6_addr.s6_addr),
                u16::from_be(sin6.sin6_port),
                sin6.sin6_flowinfo,
                sin6.sin6_scope_id,
            ))
        }
        _ => SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0),
    }
}

// ---------------------------------------------------------------------------
// Event channels.

pub(super) struct EventChannel {
    lib: &'static Lib,
    ch: *mut rdma_event_channel,
}

// SAFETY: an rdma_event_channel is an fd wrapper usable from any thread.
unsafe impl Send for EventChannel {}
// SAFETY: as above; concurrent rdma_get_cm_event calls are serialised by the
// kernel (each event is delivered once).
unsafe impl Sync for EventChannel {}

/// What lwio keeps of an rdma_cm event (the event itself is acknowledged at once).
pub(super) struct CmEvent {
    pub id: *mut rdma_cm_id,
    pub event: u32,
    pub status: i32,
    pub private_data: Vec<u8>,
    pub responder_resources: u8,
    pub initiator_depth: u8,
}

impl EventChannel {
    fn new(lib: &'static Lib) -> Result<EventChannel> {
        // SAFETY: plain constructor; returns NULL with errno on failure.
        let ch = unsafe { (lib.rdma_create_event_channel)() };
        if ch.is_null() {
            return Err(os_err("rdma_create_event_channel (is rdma_ucm loaded?)"));
        }
        let c = EventChannel { lib, ch };
        set_nonblocking(c.fd())?;
        Ok(c)
    }

    fn fd(&self) -> RawFd {
        // SAFETY: ch is live for our lifetime; fd is a plain field.
        unsafe { (*self.ch).fd }
    }

    /// The next event without blocking.
    fn try_next(&self) -> Result<Option<CmEvent>> {
        let mut ev: *mut rdma_cm_event = ptr::null_mut();
        // SAFETY: ch is live and nonblocking; on success `ev` points to an
        // event owned by librdmacm until rdma_ack_cm_event.
        let r = unsafe { (self.lib.rdma_get_cm_event)(self.ch, &mut ev) };
        if r != 0 {
            let e = std::io::Error::last_os_error();
            return match e.raw_os_error() {
                Some(libc::EAGAIN) | Some(libc::EINTR) => Ok(None),
                _ => Err(Error::Io(std::io::Error::new(
                    e.kind(),
                    format!("rdma_get_cm_event: {e}"),
                ))),
            };
        }
        // SAFETY: ev is live until acked below; private_data points to
        // private_data_len bytes owned by the event (or is NULL).
        let out = unsafe {
            let e = &*ev;
            let pd = if e.conn.private_data.is_null() || e.conn.private_data_len == 0 {
                Vec::new()
            } else {
                std::slice::from_raw_parts(
                    e.conn.private_data as *const u8,
                    e.conn.private_data_len as usize,
                )
                .to_vec()
            };
            CmEvent {
                id: e.id,
                event: e.event,
                status: e.status,
                private_data: pd,
                responder_resources: e.conn.responder_resources,
                initiator_depth: e.conn.initiator_depth,
            }
        };
        dbg_ibv!(
            "cm event {} status {} on channel fd {} (id {:p}), {} bytes of private data, rr/id {}/{}",
            self.lib.event_str(out.event),
            out.status,
            self.fd(),
            out.id,
            out.private_data.len(),
            out.responder_resources,
            out.initiator_depth
        );
        // SAFETY: acknowledges the event obtained above exactly once; nothing
        // borrowed from it is used afterwards (private data was copied).
        unsafe { (self.lib.rdma_ack_cm_event)(ev) };
        Ok(Some(out))
    }

    /// The next event, waiting until `deadline` (None = forever).
    fn next(&self, deadline: Option<Instant>) -> Result<Option<CmEvent>> {
        loop {
            if let Some(e) = self.try_next()? {
                return Ok(Some(e));
            }
            if !poll_in(self.fd(), deadline)? {
                return self.try_next();
            }
        }
    }
}

impl Drop for EventChannel {
    fn drop(&mut self) {
        // SAFETY: every id on the channel has been destroyed (owners destroy
        // their id before dropping the channel); destroyed once.
        unsafe { (self.lib.rdma_destroy_event_channel)(self.ch) };
    }
}

/// An rdma_cm id destroyed on drop unless released.
struct IdGuard {
    lib: &'static Lib,
    id: *mut rdma_cm_id,
    has_qp: bool,
}

impl IdGuard {
    fn release(mut self) -> *mut rdma_cm_id {
        std::mem::replace(&mut self.id, ptr::null_mut())
    }
}

impl Drop for IdGuard {
    fn drop(&mut self) {
        if self.id.is_null() {
            return;
        }
        // SAFETY: the id (and its QP, if created) belong to this guard only;
        // all its events have been acknowledged (EventChannel acks at once).
        unsafe {
            if self.has_qp {
                (self.lib.rdma_destroy_qp)(self.id);
            }
            (self.lib.rdma_destroy_id)(self.id);
        }
    }
}

fn cm_ret(lib: &'static Lib, what: &str, r: i32) -> Result<()> {
    let _ = lib;
    if r == 0 {
        return Ok(());
    }
    let e = std::io::Error::last_os_error();
    Err(match e.raw_os_error() {
        Some(libc::ECONNREFUSED)
        | Some(libc::ENETUNREACH)
        | Some(libc::EHOSTUNREACH)
        | Some(libc::EADDRNOTAVAIL)
        | Some(libc::ENODEV) => Error::Unreachable(format!("{what}: {e}")),
        Some(libc::ETIMEDOUT) => Error::Timeout(format!("{what}: {e}")),
        Some(libc::EINVAL) => Error::InvalidArgument(format!("{what}: {e}")),
        _ => Error::Io(std::io::Error::new(e.kind(), format!("{what}: {e}"))),
    })
}

fn timeout_ms(ctx: &CtxInner) -> i32 {
    ctx.config
        .connect_timeout
        .as_millis()
        .clamp(1, i32::MAX as u128) as i32
}

/// Wait for `want` on `ch`; other events become errors.
fn expect_event(
    ctx: &CtxInner,
    ch: &EventChannel,
    want: u32,
    deadline: Instant,
    what: &str,
) -> Result<CmEvent> {
    let Some(ev) = ch.next(Some(deadline))? else {
        return Err(Error::Timeout(format!(
            "{what}: no rdma_cm event within {:?}",
            ctx.config.connect_timeout
        )));
    };
    if ev.event == want {
        if ev.status != 0 {
            return Err(Error::Handshake(format!(
                "{what}: {} with status {}",
                ctx.lib.event_str(ev.event),
                ev.status
            )));
        }
        return Ok(ev);
    }
    let name = ctx.lib.event_str(ev.event);
    Err(match ev.event {
        RDMA_CM_EVENT_REJECTED => {
            // iWARP: an MPA Reject reports -ECONNRESET (siw) or
            // -ECONNREFUSED; IB: REJ reason 28 (consumer defined).
            let consumer = if ctx.iwarp {
                ev.status == -libc::ECONNREFUSED || ev.status == -libc::ECONNRESET
            } else {
                ev.status == IB_CM_REJ_CONSUMER_DEFINED
            };
            if consumer {
                Error::Rejected {
                    private_data: unframe_private(ctx.iwarp, &ev.private_data),
                }
            } else {
                Error::Unreachable(format!("{what}: rejected by the CM (status {})", ev.status))
            }
        }
        RDMA_CM_EVENT_ADDR_ERROR | RDMA_CM_EVENT_ROUTE_ERROR | RDMA_CM_EVENT_UNREACHABLE => {
            Error::Unreachable(format!("{what}: {name} (status {})", ev.status))
        }
        _ => Error::Handshake(format!("{what}: unexpected {name} (status {})", ev.status)),
    })
}

// ---------------------------------------------------------------------------
// Listener.

struct ListenerCore {
    ctx: Arc<CtxInner>,
    ch: EventChannel,
    id: *mut rdma_cm_id,
    local: SocketAddr,
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

struct VerbsListener(Arc<ListenerCore>);

pub(super) fn listen(
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

struct VerbsConnRequest {
    listener: Arc<ListenerCore>,
    /// NULL once accepted or rejected.
    id: *mut rdma_cm_id,
    peer: SocketAddr,
    private_data: Vec<u8>,
    peer_ird: u8,
    peer_ord: u8,
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

/// `min(ours, peer)`, where a peer value of 0 means "not reported".
fn min_known(ours: u8, peer: u8) -> u8 {
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
pub(super) fn connect(
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

fn connect_once(
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
struct QpParts {
    ctx: Arc<CtxInner>,
    pd: Arc<PdInner>,
    send_cq: Arc<CqInner>,
    recv_cq: Arc<CqInner>,
    srq: Option<Arc<SrqInner>>,
    cap: QpCap,
    sq_sig_all: bool,
}

impl QpParts {
    fn new(ctx: &Arc<CtxInner>, init: &QpInit) -> Result<QpParts> {
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

    fn create_qp(&self, guard: &mut IdGuard) -> Result<()> {
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

const ST_RTS: u8 = 0;
const ST_CLOSING: u8 = 1;
const ST_ERROR: u8 = 2;

/// Marks a receive in the wr_id handed to the device.
const RECV_BIT: u64 = 1 << 63;

struct Rec {
    seq: u64,
    wr_id: u64,
    op: WcOpcode,
    len: u32,
}

#[derive(Default)]
struct Track {
    next: u64,
    pending: VecDeque<Rec>,
}

/// A connected RC queue pair and the rdma_cm id that owns it (the state
/// behind a `VerbsQp` handle, also watched by the CM monitor).
pub(crate) struct CmQp {
    ctx: Arc<CtxInner>,
    pd: Arc<PdInner>,
    send_cq: Arc<CqInner>,
    recv_cq: Arc<CqInner>,
    /// Receives come from here (the device's own QP has no receive queue).
    srq: Option<Arc<SrqInner>>,
    id: *mut rdma_cm_id,
    qp: *mut ibv_qp,
    qp_num: u32,
    sq_sig_all: bool,
    state: AtomicU8,
    disconnected: AtomicBool,
    /// Posted work requests in order (the device sees sequence numbers as
    /// wr_ids; completions are translated back, which also gives flushed
    /// completions their true opcode).
    sq: Mutex<Track>,
    rq: Mutex<Track>,
    negotiated: Mutex<Negotiated>,
    /// A weak reference to ourselves (for scheduling sweeps).
    me: Weak<CmQp>,
    local: SocketAddr,
    peer: SocketAddr,
    token: u64,
    /// Declared last: dropped after the id is destroyed in `drop`.
    ch: EventChannel,
}

// SAFETY: the QP and id are used only through thread-safe verbs/rdma_cm
// calls; Rust-side state is atomic or behind mutexes.
unsafe impl Send for CmQp {}
// SAFETY: as above.
unsafe impl Sync for CmQp {}

impl CmQp {
    /// Wrap a freshly created QP (not yet connected). Its completions are
    /// translated from now on; the CM monitor watches it after `activate`.
    fn create(parts: QpParts, ch: EventChannel, guard: IdGuard) -> Arc<CmQp> {
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
    fn activate(self: Arc<Self>) -> Result<Arc<dyn QpOps>> {
        monitor()?.add(&self)?;
        Ok(Arc::new(VerbsQp(self)))
    }

    /// Record that the QP is in the error state. The first time, schedule
    /// sweeps: requests that reached the device after it failed but before
    /// lwio knew (rxe and siw accept such posts and never complete them) are
    /// completed as flushed once the device has had time to flush the rest.
    fn mark_error(&self) {
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
    fn sweep(&self) {
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

    fn modify_err(&self) {
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
    fn process_cm_events(&self) {
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
    pub(super) fn translate(&self, wc: &ibv_wc) -> Option<Wc> {
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

    fn flush_wc(&self, wr_id: u64, op: WcOpcode) -> Wc {
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

    fn is_error(&self) -> bool {
        self.state.load(Ordering::Acquire) == ST_ERROR
    }

    /// Post prepared send WRs (already linked) with their records.
    ///
    /// `wrs[i].wr_id` is filled with sequence numbers here.
    fn post_send_raw(
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

    fn sig_flags(&self, signaled: bool) -> u32 {
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
    }
}

struct VerbsQp(Arc<CmQp>);

const EMPTY_SGE: ibv_sge = ibv_sge {
    addr: 0,
    length: 0,
    lkey: 0,
};

fn fill_sges(out: &mut [ibv_sge], sg: &[Sge]) {
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
enum Scratch<T: Copy, const N: usize> {
    Stack([T; N]),
    Heap(Vec<T>),
}

impl<T: Copy, const N: usize> Scratch<T, N> {
    fn new(len: usize, fill: T) -> Self {
        if len <= N {
            Scratch::Stack([fill; N])
        } else {
            Scratch::Heap(vec![fill; len])
        }
    }
    fn slice(&mut self, len: usize) -> &mut [T] {
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
pub(super) fn post_recv_list(
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

fn blank_send_wr() -> ibv_send_wr {
    // SAFETY: ibv_send_wr is plain data (integers and nullable pointers);
    // all-zero is a valid value.
    unsafe { std::mem::zeroed() }
}

/// Validate a bind and return (region, remote access bits).
fn check_bind(q: &CmQp, bind: &MwBind<'_>) -> Result<Arc<MrInner>> {
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

static NEXT_TOKEN: AtomicU64 = AtomicU64::new(1);

/// How long after a QP fails lwio lets the device flush before sweeping.
const SWEEP_AFTER: Duration = Duration::from_millis(250);

struct Monitor {
    epfd: RawFd,
    /// Wakes the monitor when a sweep is scheduled.
    evfd: RawFd,
    conns: Mutex<HashMap<u64, Weak<CmQp>>>,
    sweeps: Mutex<Vec<(Instant, Weak<CmQp>)>>,
}

const WAKE_TOKEN: u64 = u64::MAX;

static MONITOR: OnceLock<Result<Monitor, String>> = OnceLock::new();

fn monitor() -> Result<&'static Monitor> {
    MONITOR
        .get_or_init(|| {
            // SAFETY: creates a new epoll fd that lives for the process.
            let epfd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
            if epfd < 0 {
                return Err(format!(
                    "epoll_create1: {}",
                    std::io::Error::last_os_error()
                ));
            }
            // SAFETY: creates a new eventfd that lives for the process.
            let evfd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
            if evfd < 0 {
                return Err(format!("eventfd: {}", std::io::Error::last_os_error()));
            }
            let mut ev = libc::epoll_event {
                events: libc::EPOLLIN as u32,
                u64: WAKE_TOKEN,
            };
            // SAFETY: live epoll fd and eventfd; ev on the stack.
            if unsafe { libc::epoll_ctl(epfd, libc::EPOLL_CTL_ADD, evfd, &mut ev) } < 0 {
                return Err(format!("epoll_ctl: {}", std::io::Error::last_os_error()));
            }
            std::thread::Builder::new()
                .name("lwio-rdmacm".into())
                .spawn(move || monitor_loop(epfd))
                .map_err(|e| format!("spawning the rdma_cm monitor: {e}"))?;
            Ok(Monitor {
                epfd,
                evfd,
                conns: Mutex::new(HashMap::new()),
                sweeps: Mutex::new(Vec::new()),
            })
        })
        .as_ref()
        .map_err(|e| Error::ResourceExhausted(e.clone()))
}

fn monitor_loop(epfd: RawFd) {
    // SAFETY: epoll_event is plain data.
    let mut evs: [libc::epoll_event; 16] = unsafe { std::mem::zeroed() };
    loop {
        let timeout = match MONITOR.get() {
            Some(Ok(m)) => m.run_due_sweeps(),
            _ => 10,
        };
        // SAFETY: epfd is a live epoll fd (never closed); evs is a local buffer.
        let n = unsafe { libc::epoll_wait(epfd, evs.as_mut_ptr(), evs.len() as i32, timeout) };
        if n < 0 {
            if std::io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            tracing::error!("rdma_cm monitor: epoll_wait failed; monitor stops");
            return;
        }
        let Some(Ok(m)) = MONITOR.get() else {
            continue;
        };
        for ev in &evs[..n as usize] {
            let token = ev.u64;
            if token == WAKE_TOKEN {
                let mut v = 0u64;
                // SAFETY: reads 8 bytes into a local from our nonblocking eventfd.
                unsafe { libc::read(m.evfd, &mut v as *mut u64 as *mut c_void, 8) };
                continue;
            }
            dbg_ibv!("monitor: wake-up for connection {token}");
            let core = lock(&m.conns).get(&token).and_then(Weak::upgrade);
            if let Some(core) = core {
                core.process_cm_events();
            }
        }
    }
}

impl Monitor {
    fn schedule_sweep(&self, at: Instant, qp: Weak<CmQp>) {
        lock(&self.sweeps).push((at, qp));
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a local to our eventfd.
        unsafe { libc::write(self.evfd, &one as *const u64 as *const c_void, 8) };
    }

    /// Run the sweeps that are due; returns the epoll timeout (ms) until the
    /// next one, or -1.
    fn run_due_sweeps(&self) -> i32 {
        let now = Instant::now();
        let due: Vec<Weak<CmQp>> = {
            let mut g = lock(&self.sweeps);
            let (due, later): (Vec<_>, Vec<_>) = g.drain(..).partition(|(t, _)| *t <= now);
            *g = later;
            due.into_iter().map(|(_, w)| w).collect()
        };
        for w in due {
            if let Some(q) = w.upgrade() {
                q.sweep();
            }
        }
        let g = lock(&self.sweeps);
        match g.iter().map(|(t, _)| *t).min() {
            None => -1,
            Some(t) => t
                .saturating_duration_since(Instant::now())
                .as_millis()
                .clamp(1, i32::MAX as u128) as i32,
        }
    }

    fn add(&self, core: &Arc<CmQp>) -> Result<()> {
        lock(&self.conns).insert(core.token, Arc::downgrade(core));
        let mut ev = libc::epoll_event {
            events: libc::EPOLLIN as u32,
            u64: core.token,
        };
        // SAFETY: live epoll fd and channel fd; ev on the stack.
        if unsafe { libc::epoll_ctl(self.epfd, libc::EPOLL_CTL_ADD, core.ch.fd(), &mut ev) } < 0 {
            lock(&self.conns).remove(&core.token);
            return Err(os_err("epoll_ctl(rdma_cm channel)"));
        }
        // Events that arrived before registration (a fast peer disconnect).
        core.process_cm_events();
        Ok(())
    }

    fn remove(&self, token: u64, fd: RawFd) {
        // Under the lock, so a concurrent wake-up either already holds a
        // strong reference (and we are not dropping) or finds nothing.
        let mut g = lock(&self.conns);
        if g.remove(&token).is_some() {
            // SAFETY: live epoll fd; fd is the channel's, still open.
            unsafe { libc::epoll_ctl(self.epfd, libc::EPOLL_CTL_DEL, fd, ptr::null_mut()) };
        }
    }
}
