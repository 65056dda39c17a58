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

mod connect;
mod listen;
mod monitor;
mod qp;
mod qp_ops;

pub(in crate::ibv) use connect::*;
pub(in crate::ibv) use listen::*;
pub(in crate::ibv) use monitor::*;
pub(crate) use qp::CmQp;
pub(in crate::ibv) use qp::*;
pub(in crate::ibv) use qp_ops::*;

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
pub(in crate::ibv) struct IdGuard {
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
