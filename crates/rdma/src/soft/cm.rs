//! Connection management: TCP + MPA (RFC 5044) with enhanced connection
//! establishment (RFC 6581: IRD/ORD), markers off, CRC32c negotiated.
//!
//! The MPA state machine is `lwio_iwarp::mpa::MpaHandshake` (siw's
//! behaviour: relaxed IRD/ORD negotiation, reject of marker requests,
//! revision echo, P2P RTR echo); this module only moves its bytes, blocking
//! with `Config::connect_timeout` on the calling thread. Frames are read
//! exactly (header, then PD_Length bytes), so no FPDU byte is consumed
//! before the socket is handed to the engine.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, RawFd};

use rustix::event::epoll::EventFlags;
use std::sync::Arc;
use std::time::{Duration, Instant};

use lwio_iwarp::mpa::{CrcPolicy as MpaCrc, MpaConfig, MpaError, MpaEvent, MpaHandshake};
use lwio_iwarp::wire::mpa::{FramePacket, FRAME_HEADER_LEN, MAX_PRIVATE_DATA as MAX_PD};

use super::{check_init, create_qp, sys, CtxShared, Established, DEFAULT_IRD_ORD, MAX_IRD_ORD};
use crate::verbs::*;

/// Largest consumer private data (PD_Length minus the IRD/ORD words). Linux
/// siw accepts at most 252 (it caps PD_Length at 256).
pub const MAX_PRIVATE_DATA: usize = MAX_PD - 4;

fn eff(v: u8) -> u8 {
    if v == 0 {
        DEFAULT_IRD_ORD
    } else {
        v.min(MAX_IRD_ORD)
    }
}

fn mpa_config(ctx: &CtxShared, ird: u8, ord: u8) -> MpaConfig {
    MpaConfig {
        revision: 2,
        crc: match ctx.config.mpa_crc {
            CrcPolicy::Off => MpaCrc::Off,
            CrcPolicy::Preferred | CrcPolicy::Required => MpaCrc::On,
        },
        ird: ird as u16,
        ord: ord as u16,
        max_ird: MAX_IRD_ORD as u16,
        max_ord: MAX_IRD_ORD as u16,
        p2p: false,
        rtr_write: true,
        rtr_read: true,
        timeout: ctx.config.connect_timeout,
        max_private_data: MAX_PD,
    }
}

fn io_err(what: &str, e: std::io::Error) -> Error {
    match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
            Error::Timeout(format!("{what}: {e}"))
        }
        std::io::ErrorKind::UnexpectedEof => Error::Handshake(format!("{what}: peer closed")),
        _ => Error::Handshake(format!("{what}: {e}")),
    }
}

fn mpa_err(e: MpaError) -> Error {
    match e {
        MpaError::Timeout => Error::Timeout("MPA handshake".into()),
        e => Error::Handshake(e.to_string()),
    }
}

fn flush(h: &mut MpaHandshake, s: &mut TcpStream, what: &str) -> Result<()> {
    while let Some(out) = h.poll_transmit() {
        s.write_all(&out).map_err(|e| io_err(what, e))?;
    }
    Ok(())
}

/// Read one MPA frame exactly (blocking) and feed it to `h`; returns the
/// next event.
fn exchange(h: &mut MpaHandshake, s: &mut TcpStream, what: &str) -> Result<Option<MpaEvent>> {
    let mut hdr = [0u8; FRAME_HEADER_LEN];
    s.read_exact(&mut hdr).map_err(|e| io_err(what, e))?;
    let pd_len = FramePacket::new_unchecked(&hdr[..]).pd_length() as usize;
    let r = h.receive(&hdr, Instant::now()).map_err(mpa_err);
    if r.is_err() || pd_len > MAX_PD {
        let _ = flush(h, s, what);
        r?;
        return Err(Error::Handshake(format!(
            "{what}: PD_Length {pd_len} > 512"
        )));
    }
    let mut pd = vec![0u8; pd_len];
    s.read_exact(&mut pd).map_err(|e| io_err(what, e))?;
    let r = h.receive(&pd, Instant::now()).map_err(mpa_err);
    flush(h, s, what)?;
    r?;
    Ok(h.poll_event())
}

fn check_pd(p: &ConnParams) -> Result<()> {
    if p.private_data.len() > MAX_PRIVATE_DATA {
        return Err(Error::InvalidArgument(format!(
            "private data of {} bytes > {MAX_PRIVATE_DATA}",
            p.private_data.len()
        )));
    }
    Ok(())
}

pub(crate) fn connect(
    ctx: Arc<CtxShared>,
    addr: SocketAddr,
    init: &QpInit,
    params: &ConnParams,
) -> Result<Arc<dyn QpOps>> {
    check_pd(params)?;
    check_init(&ctx, init)?;
    let to = ctx.config.connect_timeout;
    let mut s = TcpStream::connect_timeout(&addr, to).map_err(|e| match e.kind() {
        std::io::ErrorKind::TimedOut => Error::Timeout(format!("connect {addr}: {e}")),
        _ => Error::Unreachable(format!("{addr}: {e}")),
    })?;
    s.set_nodelay(true)?;
    s.set_read_timeout(Some(to))?;
    s.set_write_timeout(Some(to))?;
    let (ird, ord) = (eff(params.ird), eff(params.ord));
    let mut h = MpaHandshake::initiator(
        mpa_config(&ctx, ird, ord),
        &params.private_data,
        Instant::now(),
    )
    .map_err(mpa_err)?;
    flush(&mut h, &mut s, "MPA request")?;
    let (n, peer_pd) = match exchange(&mut h, &mut s, "MPA reply")? {
        Some(MpaEvent::Established {
            params: n,
            private_data,
        }) => (n, private_data),
        Some(MpaEvent::Rejected { private_data }) => return Err(Error::Rejected { private_data }),
        other => {
            return Err(Error::Handshake(format!(
                "unexpected MPA outcome {other:?}"
            )))
        }
    };
    if ctx.config.mpa_crc == CrcPolicy::Required && !n.crc {
        return Err(Error::Handshake(
            "peer refused MPA CRC, which we require".into(),
        ));
    }
    let (ird, ord) = (n.ird.clamp(1, 255) as u8, n.ord.clamp(1, 255) as u8);
    let est = Established {
        stream: s,
        negotiated: Negotiated {
            peer_private_data: peer_pd,
            ird,
            ord,
            mpa_crc: Some(n.crc),
        },
        crc: n.crc,
        ird,
        ord,
    };
    create_qp(ctx, init, est)
}

/// Connections accepted whose MPA Request has not fully arrived.
struct Pending {
    s: TcpStream,
    peer: SocketAddr,
    buf: Vec<u8>,
    need: usize,
    deadline: Instant,
}

/// Most half-open MPA handshakes kept per listener (oldest dropped first).
const MAX_PENDING: usize = 64;

pub struct SoftListener {
    l: TcpListener,
    ctx: Arc<CtxShared>,
    pending: std::sync::Mutex<Vec<Pending>>,
    /// Level-triggered epoll over the listening socket and the pending
    /// connections: readable when `get_request` may have something.
    ep: std::os::fd::OwnedFd,
}

pub(crate) fn listen(
    ctx: Arc<CtxShared>,
    addr: SocketAddr,
    _backlog: u32,
) -> Result<Arc<dyn ListenerOps>> {
    let l = TcpListener::bind(addr)?;
    l.set_nonblocking(true)?;
    let ep = sys::epoll_create()?;
    sys::epoll_add(&ep, &l, EventFlags::IN, 0)?;
    Ok(Arc::new(SoftListener {
        l,
        ctx,
        pending: std::sync::Mutex::new(Vec::new()),
        ep,
    }))
}

enum Progressed {
    Frame,
    Wait,
    Drop(String),
}

impl Pending {
    /// Read (without blocking, never past the frame) towards a full Request.
    fn advance(&mut self) -> Progressed {
        loop {
            if self.buf.len() == self.need {
                if self.need == FRAME_HEADER_LEN {
                    let pd = FramePacket::new_unchecked(&self.buf[..]).pd_length() as usize;
                    if pd > MAX_PD {
                        return Progressed::Drop(format!("PD_Length {pd} > 512"));
                    }
                    self.need += pd;
                    if pd > 0 {
                        continue;
                    }
                }
                return Progressed::Frame;
            }
            let mut tmp = [0u8; FRAME_HEADER_LEN + MAX_PD];
            let want = self.need - self.buf.len();
            match (&self.s).read(&mut tmp[..want]) {
                Ok(0) => return Progressed::Drop("closed before its MPA request".into()),
                Ok(n) => self.buf.extend_from_slice(&tmp[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Progressed::Wait,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Progressed::Drop(e.to_string()),
            }
        }
    }
}

impl SoftListener {
    /// Answer-or-queue a complete MPA Request.
    fn request(&self, p: Pending) -> Result<Option<SoftConnRequest>> {
        let Pending {
            mut s, peer, buf, ..
        } = p;
        s.set_nonblocking(false)?;
        let to = self.ctx.config.connect_timeout;
        s.set_read_timeout(Some(to))?;
        s.set_write_timeout(Some(to))?;
        let mut h = MpaHandshake::responder(
            mpa_config(&self.ctx, DEFAULT_IRD_ORD, DEFAULT_IRD_ORD),
            Instant::now(),
        );
        let r = h.receive(&buf, Instant::now()).map_err(mpa_err);
        flush(&mut h, &mut s, "MPA reply")?;
        r?;
        match h.poll_event() {
            Some(MpaEvent::ConnectRequest {
                private_data,
                peer: io,
                crc,
                revision,
            }) => {
                tracing::debug!(%peer, crc, revision, "MPA request");
                Ok(Some(SoftConnRequest {
                    s,
                    peer,
                    h,
                    private_data,
                    ird_ord: io.map(|p| (p.ird.min(255) as u8, p.ord.min(255) as u8)),
                }))
            }
            _ => Ok(None),
        }
    }

    /// Accept what is waiting and advance the half-open handshakes; returns
    /// a complete Request, if any, and the earliest handshake deadline.
    fn step(&self) -> Result<(Option<Pending>, Option<Instant>)> {
        let mut pend = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            match self.l.accept() {
                Ok((s, peer)) => {
                    s.set_nonblocking(true)?;
                    s.set_nodelay(true)?;
                    if pend.len() >= MAX_PENDING {
                        let old = pend.remove(0);
                        sys::epoll_del(&self.ep, &old.s);
                        tracing::debug!(peer = %old.peer, "too many MPA handshakes pending: dropped");
                    }
                    sys::epoll_add(&self.ep, &s, EventFlags::IN, 1)?;
                    pend.push(Pending {
                        s,
                        peer,
                        buf: Vec::with_capacity(FRAME_HEADER_LEN),
                        need: FRAME_HEADER_LEN,
                        deadline: Instant::now() + self.ctx.config.connect_timeout,
                    });
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e.into()),
            }
        }
        let now = Instant::now();
        let ep = &self.ep;
        let mut i = 0;
        while i < pend.len() {
            match pend[i].advance() {
                Progressed::Frame => {
                    let p = pend.remove(i);
                    sys::epoll_del(ep, &p.s);
                    return Ok((Some(p), None));
                }
                Progressed::Drop(why) => {
                    let p = pend.remove(i);
                    sys::epoll_del(ep, &p.s);
                    tracing::debug!(peer = %p.peer, why, "MPA request dropped");
                }
                Progressed::Wait if now >= pend[i].deadline => {
                    let p = pend.remove(i);
                    sys::epoll_del(ep, &p.s);
                    tracing::debug!(peer = %p.peer, "MPA request timed out");
                }
                Progressed::Wait => i += 1,
            }
        }
        Ok((None, pend.iter().map(|p| p.deadline).min()))
    }
}

impl ListenerOps for SoftListener {
    fn local_addr(&self) -> SocketAddr {
        self.l
            .local_addr()
            .unwrap_or_else(|_| SocketAddr::from(([0, 0, 0, 0], 0)))
    }

    fn get_request(&self, timeout: Option<Duration>) -> Result<Option<Box<dyn ConnRequestOps>>> {
        let deadline = timeout.map(|t| Instant::now() + t);
        loop {
            let (frame, next) = self.step()?;
            if let Some(p) = frame {
                let peer = p.peer;
                match self.request(p) {
                    Ok(Some(r)) => return Ok(Some(Box::new(r))),
                    Ok(None) => tracing::debug!(%peer, "MPA request refused"),
                    Err(e) => tracing::debug!(%peer, error = %e, "bad MPA request"),
                }
                continue;
            }
            let now = Instant::now();
            if deadline.is_some_and(|d| now >= d) {
                return Ok(None);
            }
            let until = match (deadline, next) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            let ms = until.map_or(-1, |u| {
                u.saturating_duration_since(now)
                    .as_millis()
                    .clamp(1, i32::MAX as u128) as i32
            });
            sys::poll_in(&self.ep, ms)?;
        }
    }

    /// An epoll fd (readable: a connection or a pending MPA Request has
    /// input, so `get_request` may return one; half-open handshakes also
    /// need a call after their `connect_timeout` to be reaped).
    fn fd(&self) -> RawFd {
        self.ep.as_raw_fd()
    }
}

pub struct SoftConnRequest {
    s: TcpStream,
    peer: SocketAddr,
    h: MpaHandshake,
    private_data: Vec<u8>,
    ird_ord: Option<(u8, u8)>,
}

impl ConnRequestOps for SoftConnRequest {
    fn peer_addr(&self) -> SocketAddr {
        self.peer
    }
    fn private_data(&self) -> &[u8] {
        &self.private_data
    }
    fn peer_ird_ord(&self) -> (u8, u8) {
        self.ird_ord.unwrap_or((DEFAULT_IRD_ORD, DEFAULT_IRD_ORD))
    }

    fn accept(self: Box<Self>, init: &QpInit, params: &ConnParams) -> Result<Arc<dyn QpOps>> {
        check_pd(params)?;
        // The QP joins the soft context that owns `init`'s PD and CQs, which
        // may be another than the listener's (same provider, same process):
        // a server gives each connection its own context, so under manual
        // progress a connection's thread drives only its own socket (like
        // migrating an rdma_cm id to another event channel).
        let ctx = super::soft_cq(&init.recv_cq)?.ctx().clone();
        check_init(&ctx, init)?;
        let mut me = *self;
        let n =
            me.h.accept(
                &params.private_data,
                eff(params.ird) as u16,
                eff(params.ord) as u16,
            )
            .map_err(mpa_err)?;
        flush(&mut me.h, &mut me.s, "MPA reply")?;
        let (ird, ord) = (n.ird.clamp(1, 255) as u8, n.ord.clamp(1, 255) as u8);
        let est = Established {
            stream: me.s,
            negotiated: Negotiated {
                peer_private_data: me.private_data,
                ird,
                ord,
                mpa_crc: Some(n.crc),
            },
            crc: n.crc,
            ird,
            ord,
        };
        create_qp(ctx, init, est)
    }

    fn reject(self: Box<Self>, private_data: &[u8]) -> Result<()> {
        let mut me = *self;
        if private_data.len() > MAX_PRIVATE_DATA {
            return Err(Error::InvalidArgument(
                "reject private data too long".into(),
            ));
        }
        me.h.reject(private_data).map_err(mpa_err)?;
        flush(&mut me.h, &mut me.s, "MPA reject")?;
        let _ = me.s.shutdown(std::net::Shutdown::Write);
        Ok(())
    }
}
