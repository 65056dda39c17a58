//! Connection management: TCP + MPA (RFC 5044) with enhanced connection
//! establishment (RFC 6581: IRD/ORD), markers off, CRC32c negotiated.
//!
//! The handshake runs blocking (with `Config::connect_timeout`) on the
//! calling thread; the established socket is then handed to the engine.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::wire::{
    MpaFrame, MPA_FLAG_CRC, MPA_FLAG_MARKERS, MPA_FLAG_REJECT, MPA_MAX_PD, MPA_REV_ENHANCED,
};
use super::{check_init, create_qp, sys, CtxShared, Established, DEFAULT_IRD_ORD, MAX_IRD_ORD};
use crate::verbs::*;

/// Largest consumer private data (PD_Length minus the IRD/ORD words).
pub const MAX_PRIVATE_DATA: usize = MPA_MAX_PD - 4;

fn eff(v: u8) -> u8 {
    if v == 0 {
        DEFAULT_IRD_ORD
    } else {
        v.min(MAX_IRD_ORD)
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

fn read_frame(s: &mut TcpStream, what: &str) -> Result<MpaFrame> {
    let mut h = [0u8; 20];
    s.read_exact(&mut h).map_err(|e| io_err(what, e))?;
    let (reply, flags, rev, pd_len) = MpaFrame::parse_header(&h).map_err(Error::Handshake)?;
    let mut pd = vec![0u8; pd_len];
    s.read_exact(&mut pd).map_err(|e| io_err(what, e))?;
    MpaFrame::from_parts(reply, flags, rev, &pd).map_err(Error::Handshake)
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
    check_init(init)?;
    let to = ctx.config.connect_timeout;
    let mut s = TcpStream::connect_timeout(&addr, to).map_err(|e| match e.kind() {
        std::io::ErrorKind::TimedOut => Error::Timeout(format!("connect {addr}: {e}")),
        _ => Error::Unreachable(format!("{addr}: {e}")),
    })?;
    s.set_nodelay(true)?;
    s.set_read_timeout(Some(to))?;
    s.set_write_timeout(Some(to))?;
    let want_crc = ctx.config.mpa_crc != CrcPolicy::Off;
    let (ird, ord) = (eff(params.ird), eff(params.ord));
    let req = MpaFrame {
        reply: false,
        flags: if want_crc { MPA_FLAG_CRC } else { 0 },
        rev: MPA_REV_ENHANCED,
        private: params.private_data.clone(),
        ird_ord: Some((ird as u16, ord as u16)),
    };
    s.write_all(&req.encode())
        .map_err(|e| io_err("MPA request", e))?;
    let rep = read_frame(&mut s, "MPA reply")?;
    if !rep.reply {
        return Err(Error::Handshake("peer answered with an MPA request".into()));
    }
    if rep.flags & MPA_FLAG_REJECT != 0 {
        return Err(Error::Rejected {
            private_data: rep.private,
        });
    }
    if rep.flags & MPA_FLAG_MARKERS != 0 {
        return Err(Error::Handshake(
            "peer requires MPA markers (unsupported)".into(),
        ));
    }
    let crc = rep.flags & MPA_FLAG_CRC != 0;
    if ctx.config.mpa_crc == CrcPolicy::Required && !crc {
        return Err(Error::Handshake(
            "peer refused MPA CRC, which we require".into(),
        ));
    }
    let (peer_ird, _peer_ord) = rep
        .ird_ord
        .map(|(i, o)| (i.min(255) as u8, o.min(255) as u8))
        .unwrap_or((DEFAULT_IRD_ORD, DEFAULT_IRD_ORD));
    let ord = ord.min(peer_ird.max(1));
    let est = Established {
        stream: s,
        negotiated: Negotiated {
            peer_private_data: rep.private,
            ird,
            ord,
            mpa_crc: Some(crc),
        },
        crc,
        ird,
        ord,
    };
    create_qp(ctx, init, est)
}

pub struct SoftListener {
    l: TcpListener,
    ctx: Arc<CtxShared>,
}

pub(crate) fn listen(
    ctx: Arc<CtxShared>,
    addr: SocketAddr,
    _backlog: u32,
) -> Result<Arc<dyn ListenerOps>> {
    let l = TcpListener::bind(addr)?;
    l.set_nonblocking(true)?;
    Ok(Arc::new(SoftListener { l, ctx }))
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
            match self.l.accept() {
                Ok((mut s, peer)) => {
                    s.set_nonblocking(false)?;
                    s.set_nodelay(true)?;
                    let to = self.ctx.config.connect_timeout;
                    s.set_read_timeout(Some(to))?;
                    s.set_write_timeout(Some(to))?;
                    match read_frame(&mut s, "MPA request") {
                        Ok(f) if !f.reply => {
                            return Ok(Some(Box::new(SoftConnRequest {
                                s,
                                peer,
                                frame: f,
                                ctx: self.ctx.clone(),
                            })))
                        }
                        Ok(_) => tracing::debug!(%peer, "MPA reply where a request was due"),
                        Err(e) => tracing::debug!(%peer, error = %e, "bad MPA request"),
                    }
                    continue;
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e.into()),
            }
            let ms = match deadline {
                None => -1,
                Some(d) => {
                    let left = d.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Ok(None);
                    }
                    left.as_millis().clamp(1, i32::MAX as u128) as i32
                }
            };
            sys::poll_in(self.l.as_raw_fd(), ms)?;
        }
    }

    fn fd(&self) -> RawFd {
        self.l.as_raw_fd()
    }
}

pub struct SoftConnRequest {
    s: TcpStream,
    peer: SocketAddr,
    frame: MpaFrame,
    ctx: Arc<CtxShared>,
}

impl ConnRequestOps for SoftConnRequest {
    fn peer_addr(&self) -> SocketAddr {
        self.peer
    }
    fn private_data(&self) -> &[u8] {
        &self.frame.private
    }
    fn peer_ird_ord(&self) -> (u8, u8) {
        self.frame
            .ird_ord
            .map(|(i, o)| (i.min(255) as u8, o.min(255) as u8))
            .unwrap_or((DEFAULT_IRD_ORD, DEFAULT_IRD_ORD))
    }

    fn accept(self: Box<Self>, init: &QpInit, params: &ConnParams) -> Result<Arc<dyn QpOps>> {
        check_pd(params)?;
        check_init(init)?;
        let mut me = *self;
        if me.frame.flags & MPA_FLAG_MARKERS != 0 {
            let _ = me.reject_inner(&[]);
            return Err(Error::Handshake(
                "peer requires MPA markers (unsupported)".into(),
            ));
        }
        let policy = me.ctx.config.mpa_crc;
        let crc = me.frame.flags & MPA_FLAG_CRC != 0 || policy != CrcPolicy::Off;
        let (peer_ird, _) = me.peer_ird_ord();
        let ird = eff(params.ird);
        let ord = eff(params.ord).min(peer_ird.max(1));
        let enhanced = me.frame.ird_ord.is_some();
        let rep = MpaFrame {
            reply: true,
            flags: if crc { MPA_FLAG_CRC } else { 0 },
            // Like siw: answer with the Request's revision.
            rev: me.frame.rev,
            private: params.private_data.clone(),
            ird_ord: enhanced.then_some((ird as u16, ord as u16)),
        };
        me.s.write_all(&rep.encode())
            .map_err(|e| io_err("MPA reply", e))?;
        let est = Established {
            stream: me.s,
            negotiated: Negotiated {
                peer_private_data: me.frame.private,
                ird,
                ord,
                mpa_crc: Some(crc),
            },
            crc,
            ird,
            ord,
        };
        create_qp(me.ctx, init, est)
    }

    fn reject(self: Box<Self>, private_data: &[u8]) -> Result<()> {
        let mut me = *self;
        me.reject_inner(private_data)
    }
}

impl SoftConnRequest {
    fn reject_inner(&mut self, private_data: &[u8]) -> Result<()> {
        if private_data.len() > MAX_PRIVATE_DATA {
            return Err(Error::InvalidArgument(
                "reject private data too long".into(),
            ));
        }
        let enhanced = self.frame.ird_ord.is_some();
        let rep = MpaFrame {
            reply: true,
            flags: MPA_FLAG_REJECT,
            rev: self.frame.rev,
            private: private_data.to_vec(),
            ird_ord: enhanced.then_some((0, 0)),
        };
        self.s
            .write_all(&rep.encode())
            .map_err(|e| io_err("MPA reject", e))?;
        let _ = self.s.shutdown(std::net::Shutdown::Write);
        Ok(())
    }
}
