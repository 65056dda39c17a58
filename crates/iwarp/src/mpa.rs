//! Sans-IO MPA connection setup ([`MpaHandshake`]), RFC 5044 §7.1 with the
//! RFC 6581 enhancements (IRD/ORD exchange, peer-to-peer RTR).
//!
//! Drive it like quinn-proto: write out [`MpaHandshake::poll_transmit`],
//! feed received bytes to [`MpaHandshake::receive`] (split anywhere; it
//! consumes only the MPA frame and returns how many bytes it used, the rest
//! is FPDU stream), handle [`MpaHandshake::poll_event`], and call
//! [`MpaHandshake::handle_timeout`] at [`MpaHandshake::poll_timeout`].

use std::time::{Duration, Instant};

use crate::tx::OutboundMessage;
use crate::wire::mpa::{
    FrameKind, FramePacket, FrameRepr, IrdOrd, FLAG_CRC, FLAG_ENHANCED, FLAG_MARKERS,
    FRAME_HEADER_LEN, IRD_ORD_LEN, IRD_ORD_MAX, KEY_REP, KEY_REQ, MAX_PRIVATE_DATA,
};
use crate::wire::rdmap::ReadRequest;
use crate::wire::term::{TermError, TermKind};

/// Local CRC policy (RFC 5044 §7.1.2: CRC is used in both directions if
/// either side sets C; siw's `mpa_crc_required`/`mpa_crc_strict`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CrcPolicy {
    /// Do not ask for CRC; use it if the peer asks (siw default).
    #[default]
    Off,
    /// Ask for CRC.
    On,
    /// Do not use CRC; refuse peers that ask (siw `mpa_crc_strict`).
    Forbid,
}

/// Zero-length RDMA operation used as "ready to receive" in P2P mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RtrType {
    /// Zero-length RDMA Write (siw's first choice).
    Write,
    /// Zero-length RDMA Read.
    Read,
    /// Zero-length Send (not offered by siw; never chosen here).
    Send,
}

/// Handshake configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MpaConfig {
    /// MPA revision to request (1 or 2). 2 enables RFC 6581 enhanced mode
    /// (siw default).
    pub revision: u8,
    /// CRC policy.
    pub crc: CrcPolicy,
    /// Desired inbound RDMA Read queue depth.
    pub ird: u16,
    /// Desired outbound RDMA Read queue depth.
    pub ord: u16,
    /// Largest IRD this side can grow to when the peer asks for more
    /// (siw's relaxed IRD negotiation).
    pub max_ird: u16,
    /// Largest ORD this side supports.
    pub max_ord: u16,
    /// Initiator: request peer-to-peer mode (an RTR frame after the reply).
    pub p2p: bool,
    /// Initiator: RTR types offered in P2P mode (siw offers Write and Read).
    pub rtr_write: bool,
    /// See `rtr_write`.
    pub rtr_read: bool,
    /// How long to wait for the peer's frame (siw: initiator 10 s,
    /// responder 5 s).
    pub timeout: Duration,
    /// Largest PD_Length accepted from the peer (RFC: 512).
    pub max_private_data: usize,
}

impl MpaConfig {
    /// siw's defaults for an initiator.
    pub fn initiator_default() -> Self {
        MpaConfig {
            revision: 2,
            crc: CrcPolicy::Off,
            ird: 16,
            ord: 16,
            max_ird: 128,
            max_ord: 128,
            p2p: false,
            rtr_write: true,
            rtr_read: true,
            timeout: Duration::from_secs(10),
            max_private_data: MAX_PRIVATE_DATA,
        }
    }
    /// siw's defaults for a responder.
    pub fn responder_default() -> Self {
        MpaConfig {
            timeout: Duration::from_secs(5),
            ..Self::initiator_default()
        }
    }
}

/// Outcome of a successful handshake.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Negotiated {
    /// CRC on in both directions.
    pub crc: bool,
    /// Revision of the reply.
    pub revision: u8,
    /// RFC 6581 enhanced mode in use.
    pub enhanced: bool,
    /// Local IRD to provision.
    pub ird: u16,
    /// Local ORD to respect.
    pub ord: u16,
    /// P2P: initiator must send this RTR before anything else; responder
    /// must receive one FPDU before sending.
    pub rtr: Option<RtrType>,
    /// Peer set siw's GSO hint.
    pub peer_gso: bool,
}

impl Negotiated {
    /// Initiator: the RTR message to send first (siw: zero-length Write to
    /// STag 1, TO 0; or a zero-length Read Request with sink STag 0 and
    /// source STag 1). Send it with payload length 0.
    pub fn rtr_message(&self) -> Option<OutboundMessage> {
        match self.rtr? {
            RtrType::Write => Some(OutboundMessage::Write { stag: 1, to: 0 }),
            RtrType::Read => Some(OutboundMessage::ReadRequest(ReadRequest {
                sink_stag: 0,
                sink_to: 0,
                size: 0,
                src_stag: 1,
                src_to: 0,
            })),
            RtrType::Send => Some(OutboundMessage::Send {
                solicited: false,
                invalidate: None,
            }),
        }
    }
}

/// Handshake event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MpaEvent {
    /// Responder: a valid Request arrived; call `accept` or `reject`.
    ConnectRequest {
        /// ULP private data (IRD/ORD words removed).
        private_data: Vec<u8>,
        /// Peer's IRD/ORD words (enhanced mode).
        peer: Option<IrdOrd>,
        /// Peer asked for CRC.
        crc: bool,
        /// Request revision.
        revision: u8,
    },
    /// The connection is in RDMA mode.
    Established {
        /// Negotiated parameters.
        params: Negotiated,
        /// Initiator: the reply's private data (empty for responders).
        private_data: Vec<u8>,
    },
    /// Initiator: the peer rejected (R flag).
    Rejected {
        /// The reply's private data.
        private_data: Vec<u8>,
    },
}

/// Handshake failure.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MpaError {
    /// No frame within the configured time.
    #[error("MPA timeout")]
    Timeout,
    /// Peer violated the protocol or asked for something unsupported.
    /// When `terminate` is set, send that Terminate (with CRC off) before
    /// closing, like siw does.
    #[error("MPA protocol error: {reason}")]
    Protocol {
        /// What went wrong.
        reason: &'static str,
        /// Terminate to send, if any.
        terminate: Option<TermError>,
    },
    /// A local API misuse (bad state or arguments).
    #[error("MPA usage error: {0}")]
    Usage(&'static str),
}

fn proto(reason: &'static str) -> MpaError {
    MpaError::Protocol {
        reason,
        terminate: None,
    }
}

/// Connection role.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Sends the Request.
    Initiator,
    /// Answers with the Reply.
    Responder,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    AwaitFrame,
    AwaitAccept,
    Established,
    Closed,
}

/// Sans-IO MPA handshake for one connection.
#[derive(Debug, Clone)]
pub struct MpaHandshake {
    role: Role,
    cfg: MpaConfig,
    state: State,
    deadline: Instant,
    buf: Vec<u8>,
    out: Vec<Vec<u8>>,
    events: std::collections::VecDeque<MpaEvent>,
    /// Initiator: what we sent. Responder: what we received.
    req_flags: u8,
    req_rev: u8,
    req_io: Option<IrdOrd>,
    negotiated: Option<Negotiated>,
}

impl MpaHandshake {
    /// Start as initiator: queues the Request carrying `private_data`.
    pub fn initiator(
        cfg: MpaConfig,
        private_data: &[u8],
        now: Instant,
    ) -> Result<MpaHandshake, MpaError> {
        if !(1..=2).contains(&cfg.revision) {
            return Err(MpaError::Usage("revision must be 1 or 2"));
        }
        if cfg.ird > IRD_ORD_MAX || cfg.ord > IRD_ORD_MAX {
            return Err(MpaError::Usage("IRD/ORD exceed 14 bits"));
        }
        let io = (cfg.revision == 2).then(|| {
            let mut ord = cfg.ord;
            if cfg.p2p && ord == 0 {
                ord = 1; // siw: a Read RTR needs an ORD slot
            }
            IrdOrd {
                ird: cfg.ird,
                ord,
                p2p: cfg.p2p,
                send_rtr: false,
                write_rtr: cfg.p2p && cfg.rtr_write,
                read_rtr: cfg.p2p && cfg.rtr_read,
            }
        });
        let repr = FrameRepr {
            kind: FrameKind::Request,
            markers: false,
            crc: cfg.crc == CrcPolicy::On,
            reject: false,
            gso: false,
            revision: cfg.revision,
            ird_ord: io,
            private_data,
        };
        let frame = repr
            .to_vec()
            .map_err(|_| MpaError::Usage("private data exceeds 512 bytes"))?;
        let mut h = MpaHandshake::new(Role::Initiator, cfg, now);
        h.req_flags = repr.flags();
        h.req_rev = repr.revision;
        h.req_io = io;
        h.out.push(frame);
        Ok(h)
    }

    /// Start as responder (after TCP accept).
    pub fn responder(cfg: MpaConfig, now: Instant) -> MpaHandshake {
        MpaHandshake::new(Role::Responder, cfg, now)
    }

    fn new(role: Role, cfg: MpaConfig, now: Instant) -> MpaHandshake {
        MpaHandshake {
            role,
            deadline: now.checked_add(cfg.timeout).unwrap_or(now),
            cfg,
            state: State::AwaitFrame,
            buf: Vec::new(),
            out: Vec::new(),
            events: Default::default(),
            req_flags: 0,
            req_rev: 0,
            req_io: None,
            negotiated: None,
        }
    }

    /// Role.
    pub fn role(&self) -> Role {
        self.role
    }

    /// Negotiated parameters once established.
    pub fn negotiated(&self) -> Option<Negotiated> {
        self.negotiated
    }

    /// Whether the connection reached RDMA mode.
    pub fn is_established(&self) -> bool {
        self.state == State::Established
    }

    /// Whether the handshake failed or was rejected.
    pub fn is_closed(&self) -> bool {
        self.state == State::Closed
    }

    /// Next bytes to write to the socket.
    pub fn poll_transmit(&mut self) -> Option<Vec<u8>> {
        if self.out.is_empty() {
            None
        } else {
            Some(self.out.remove(0))
        }
    }

    /// Next event.
    pub fn poll_event(&mut self) -> Option<MpaEvent> {
        self.events.pop_front()
    }

    /// When `handle_timeout` must be called.
    pub fn poll_timeout(&self) -> Option<Instant> {
        (self.state == State::AwaitFrame).then_some(self.deadline)
    }

    /// Fail with `Timeout` if the peer's frame is overdue.
    pub fn handle_timeout(&mut self, now: Instant) -> Result<(), MpaError> {
        if self.state == State::AwaitFrame && now >= self.deadline {
            self.state = State::Closed;
            return Err(MpaError::Timeout);
        }
        Ok(())
    }

    fn fail<T>(&mut self, e: MpaError) -> Result<T, MpaError> {
        self.state = State::Closed;
        Err(e)
    }

    /// Feed received bytes. Returns how many were consumed: only bytes of
    /// the peer's MPA frame are; anything after it belongs to the FPDU
    /// stream. A responder that has received the Request and not yet
    /// replied treats further bytes as a protocol error (siw: EPROTO), as
    /// the initiator must wait for the Reply.
    pub fn receive(&mut self, data: &[u8], now: Instant) -> Result<usize, MpaError> {
        match self.state {
            State::AwaitFrame => {}
            State::AwaitAccept if !data.is_empty() => {
                return self.fail(proto("data before MPA reply"));
            }
            State::Closed => return Err(MpaError::Usage("handshake closed")),
            _ => return Ok(0),
        }
        self.handle_timeout(now)?;
        let mut used = 0;
        if self.buf.len() < FRAME_HEADER_LEN {
            let n = (FRAME_HEADER_LEN - self.buf.len()).min(data.len());
            self.buf.extend_from_slice(&data[..n]);
            used += n;
            if self.buf.len() < FRAME_HEADER_LEN {
                return Ok(used);
            }
            let pd = u16::from_be_bytes([self.buf[18], self.buf[19]]) as usize;
            if pd > self.cfg.max_private_data.min(MAX_PRIVATE_DATA) {
                return self.fail(proto("private data too long"));
            }
        }
        let pd = u16::from_be_bytes([self.buf[18], self.buf[19]]) as usize;
        let total = FRAME_HEADER_LEN + pd;
        let n = (total - self.buf.len()).min(data.len() - used);
        self.buf.extend_from_slice(&data[used..used + n]);
        used += n;
        if self.buf.len() < total {
            return Ok(used);
        }
        let frame = std::mem::take(&mut self.buf);
        match self.role {
            Role::Responder => self.on_request(&frame)?,
            Role::Initiator => self.on_reply(&frame)?,
        }
        Ok(used)
    }

    fn on_request(&mut self, frame: &[u8]) -> Result<(), MpaError> {
        let flags = frame[16];
        let rev = frame[17];
        if &frame[..16] != KEY_REQ {
            return self.fail(proto("bad request key"));
        }
        if rev > 2 {
            return self.fail(proto("unsupported MPA revision"));
        }
        let pd_len = frame.len() - FRAME_HEADER_LEN;
        self.req_flags = flags;
        self.req_rev = rev;
        let enhanced = rev == 2 && flags & FLAG_ENHANCED != 0;
        if enhanced && pd_len < IRD_ORD_LEN {
            self.send_reject(enhanced, &[], false);
            return self.fail(proto("enhanced request without IRD/ORD"));
        }
        if flags & FLAG_MARKERS != 0 {
            // siw: markers are not supported; answer with a reject.
            self.send_reject(enhanced, &[], false);
            return self.fail(proto("peer requested markers"));
        }
        if flags & FLAG_CRC != 0 && self.cfg.crc == CrcPolicy::Forbid {
            self.send_reject(enhanced, &[], true);
            return self.fail(proto("peer requested CRC, CRC forbidden"));
        }
        let p = FramePacket::new_checked(frame).map_err(|_| proto("bad request"))?;
        let repr = match FrameRepr::parse(&p) {
            Ok(r) => r,
            Err(_) => return self.fail(proto("bad request")),
        };
        self.req_io = repr.ird_ord;
        self.state = State::AwaitAccept;
        self.events.push_back(MpaEvent::ConnectRequest {
            private_data: repr.private_data.to_vec(),
            peer: repr.ird_ord,
            crc: repr.crc,
            revision: rev,
        });
        Ok(())
    }

    /// Reply mirroring the request (like siw: same revision, enhanced flag
    /// kept, markers cleared, IRD/ORD words zero).
    fn send_reject(&mut self, enhanced: bool, private_data: &[u8], clear_crc: bool) {
        let repr = FrameRepr {
            kind: FrameKind::Reply,
            markers: false,
            crc: self.req_flags & FLAG_CRC != 0 && !clear_crc,
            reject: true,
            gso: false,
            revision: self.req_rev.min(2),
            ird_ord: enhanced.then(IrdOrd::default),
            private_data,
        };
        if let Ok(v) = repr.to_vec() {
            self.out.push(v);
        }
    }

    /// Responder: accept with `private_data` and the IRD/ORD the ULP wants.
    /// In enhanced mode ORD is lowered to the peer's IRD and IRD is raised
    /// to the peer's ORD (capped at `max_ird`), as siw's relaxed
    /// negotiation does. Queues the Reply and returns the negotiated parameters.
    pub fn accept(
        &mut self,
        private_data: &[u8],
        ird: u16,
        ord: u16,
    ) -> Result<Negotiated, MpaError> {
        if self.state != State::AwaitAccept {
            return Err(MpaError::Usage("accept without a pending request"));
        }
        if ird > self.cfg.max_ird.min(IRD_ORD_MAX) || ord > self.cfg.max_ord.min(IRD_ORD_MAX) {
            return Err(MpaError::Usage("IRD/ORD above device limits"));
        }
        let enhanced = self.req_io.is_some();
        let max_pd = MAX_PRIVATE_DATA - if enhanced { IRD_ORD_LEN } else { 0 };
        if private_data.len() > max_pd {
            return Err(MpaError::Usage("private data too long"));
        }
        let crc = self.req_flags & FLAG_CRC != 0 || self.cfg.crc == CrcPolicy::On;
        let (mut n_ird, mut n_ord) = (ird, ord);
        let mut rtr = None;
        let io = match self.req_io {
            Some(peer) => {
                n_ord = n_ord.min(peer.ird);
                // siw: raise IRD to the peer's ORD, capped at the device
                // maximum; the initiator then lowers its ORD to our IRD.
                n_ird = n_ird.max(peer.ord.min(self.cfg.max_ird));
                let mut io = IrdOrd {
                    ird: n_ird,
                    ord: n_ord,
                    ..Default::default()
                };
                if peer.p2p {
                    io.p2p = true;
                    // siw: prefer Write, then Read; propose Write if neither.
                    if peer.write_rtr || !peer.read_rtr {
                        io.write_rtr = true;
                        rtr = Some(RtrType::Write);
                    } else {
                        io.read_rtr = true;
                        rtr = Some(RtrType::Read);
                    }
                }
                Some(io)
            }
            None => None,
        };
        let repr = FrameRepr {
            kind: FrameKind::Reply,
            markers: false,
            crc,
            reject: false,
            gso: false,
            revision: self.req_rev,
            ird_ord: io,
            private_data,
        };
        let v = repr
            .to_vec()
            .map_err(|_| MpaError::Usage("private data too long"))?;
        self.out.push(v);
        let params = Negotiated {
            crc,
            revision: self.req_rev,
            enhanced,
            ird: n_ird,
            ord: n_ord,
            rtr,
            peer_gso: self.req_flags & crate::wire::mpa::FLAG_GSO != 0,
        };
        self.negotiated = Some(params);
        self.state = State::Established;
        self.events.push_back(MpaEvent::Established {
            params,
            private_data: Vec::new(),
        });
        Ok(params)
    }

    /// Responder: reject with `private_data` (R flag set).
    pub fn reject(&mut self, private_data: &[u8]) -> Result<(), MpaError> {
        if self.state != State::AwaitAccept {
            return Err(MpaError::Usage("reject without a pending request"));
        }
        let enhanced = self.req_io.is_some();
        if private_data.len() + if enhanced { IRD_ORD_LEN } else { 0 } > MAX_PRIVATE_DATA {
            return Err(MpaError::Usage("private data too long"));
        }
        self.send_reject(enhanced, private_data, false);
        self.state = State::Closed;
        Ok(())
    }

    fn on_reply(&mut self, frame: &[u8]) -> Result<(), MpaError> {
        if &frame[..16] != KEY_REP {
            return self.fail(MpaError::Protocol {
                reason: "bad reply key",
                terminate: Some(TermKind::MpaInvalidReqRep.into()),
            });
        }
        let p = FramePacket::new_checked(frame).map_err(|_| proto("bad reply"))?;
        let repr = match FrameRepr::parse(&p) {
            Ok(r) => r,
            Err(crate::wire::Error::Version) => {
                return self.fail(proto("unsupported MPA revision"))
            }
            Err(_) => return self.fail(proto("bad reply")),
        };
        if repr.reject {
            self.state = State::Closed;
            self.events.push_back(MpaEvent::Rejected {
                private_data: repr.private_data.to_vec(),
            });
            return Ok(());
        }
        if repr.markers {
            return self.fail(proto("peer requires markers"));
        }
        let asked = self.req_flags & FLAG_CRC != 0;
        if asked && !repr.crc {
            return self.fail(proto("responder dropped the requested CRC"));
        }
        if repr.crc && self.cfg.crc == CrcPolicy::Forbid {
            return self.fail(proto("responder requires CRC, CRC forbidden"));
        }
        let mut params = Negotiated {
            crc: asked || repr.crc,
            revision: repr.revision,
            enhanced: false,
            ird: self.cfg.ird,
            ord: self.cfg.ord,
            rtr: None,
            peer_gso: repr.gso,
        };
        if let Some(mine) = self.req_io {
            let Some(rep) = repr.ird_ord else {
                return self.fail(proto("reply not in enhanced mode"));
            };
            params.enhanced = true;
            if mine.ird < rep.ord {
                if rep.ord <= self.cfg.max_ird {
                    params.ird = rep.ord;
                } else {
                    return self.fail(MpaError::Protocol {
                        reason: "responder ORD exceeds our IRD",
                        terminate: Some(TermKind::MpaInsufficientIrd.into()),
                    });
                }
            } else {
                params.ird = mine.ird;
            }
            params.ord = mine.ord.min(rep.ird);
            if mine.p2p {
                params.rtr = if mine.write_rtr && rep.write_rtr {
                    Some(RtrType::Write)
                } else if mine.read_rtr && rep.read_rtr {
                    Some(RtrType::Read)
                } else {
                    return self.fail(MpaError::Protocol {
                        reason: "no matching RTR",
                        terminate: Some(TermKind::MpaNoMatchingRtr.into()),
                    });
                };
            }
        }
        self.negotiated = Some(params);
        self.state = State::Established;
        self.events.push_back(MpaEvent::Established {
            params,
            private_data: repr.private_data.to_vec(),
        });
        Ok(())
    }
}
