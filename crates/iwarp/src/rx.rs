//! DDP/RDMAP receive semantics: [`DdpRxState`] (pure validation and
//! message bookkeeping), the [`Placement`] trait the provider implements
//! over its memory tables, and [`RdmapReceiver`], which drives an
//! [`FpduReceiver`] and calls [`Placement`] so that every segment is
//! validated *before* any of its payload is written.

use crate::fpdu_rx::{FpduConfig, FpduEvent, FpduReceiver, RxError};
use crate::wire::ddp::Kind;
use crate::wire::rdmap::{
    Opcode, ReadRequest, TerminatePacket, TerminateRepr, IMMEDIATE_DATA_LEN, QN_READ_REQUEST,
    QN_TERMINATE, TERMINATE_HDR_LEN, TERMINATE_MAX_COPIED,
};
use crate::wire::segment::SegmentHeader;
use crate::wire::term::{TermError, TermKind};

/// Number of untagged queues RDMAP uses (0 Send, 1 Read Request,
/// 2 Terminate).
pub const QUEUES: usize = 3;
/// MSN of the first message on every untagged queue (RFC 5041 §5.1).
pub const INITIAL_MSN: u32 = 1;
/// Largest Terminate DDP payload accepted.
pub const MAX_TERMINATE_PAYLOAD: usize = TERMINATE_HDR_LEN + TERMINATE_MAX_COPIED;

/// A validated tagged segment (RDMA Write or Read Response).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TaggedSegment {
    /// Write or ReadResponse.
    pub opcode: Opcode,
    /// Target STag.
    pub stag: u32,
    /// Tagged offset of the first payload byte.
    pub to: u64,
    /// Payload length.
    pub len: u32,
    /// First segment of its message.
    pub first: bool,
    /// Last segment of its message (L flag).
    pub last: bool,
}

/// A validated untagged segment (Send variants, Read Request, Terminate).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UntaggedSegment {
    /// Opcode.
    pub opcode: Opcode,
    /// Queue number (0, 1 or 2).
    pub qn: u32,
    /// Message sequence number.
    pub msn: u32,
    /// Message offset of the first payload byte.
    pub mo: u32,
    /// Payload length.
    pub len: u32,
    /// First segment of its message.
    pub first: bool,
    /// Last segment of its message.
    pub last: bool,
    /// STag to invalidate (Send with Invalidate variants).
    pub inv_stag: Option<u32>,
    /// Read Request header (opcode ReadRequest).
    pub read_request: Option<ReadRequest>,
}

/// A validated segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Segment {
    /// Tagged.
    Tagged(TaggedSegment),
    /// Untagged.
    Untagged(UntaggedSegment),
}

impl Segment {
    /// L flag.
    pub fn last(&self) -> bool {
        match self {
            Segment::Tagged(t) => t.last,
            Segment::Untagged(u) => u.last,
        }
    }
    /// Payload length.
    pub fn len(&self) -> u32 {
        match self {
            Segment::Tagged(t) => t.len,
            Segment::Untagged(u) => u.len,
        }
    }
    /// Whether the payload is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct InProgress {
    opcode: Opcode,
    msn: u32,
    next_mo: u32,
}

/// Per-stream DDP receive state: expected MSN and in-progress message per
/// untagged queue, in-progress tagged message. Pure: `validate` never
/// changes state, `commit` applies a segment once it is complete (CRC ok).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DdpRxState {
    expected_msn: [u32; QUEUES],
    untagged: [Option<InProgress>; QUEUES],
    tagged: Option<Opcode>,
}

impl Default for DdpRxState {
    fn default() -> Self {
        Self::new()
    }
}

impl DdpRxState {
    /// Fresh stream: every queue expects MSN 1.
    pub fn new() -> Self {
        DdpRxState {
            expected_msn: [INITIAL_MSN; QUEUES],
            untagged: [None; QUEUES],
            tagged: None,
        }
    }

    /// MSN the next new message on `qn` must carry.
    pub fn expected_msn(&self, qn: u32) -> Option<u32> {
        self.expected_msn.get(qn as usize).copied()
    }

    /// Validate a segment header with `len` payload bytes against the
    /// stream state. Errors are the exact Terminate classification:
    ///
    /// * untagged QN > 2, or QN not the opcode's queue → DDP Invalid QN;
    /// * MSN not the expected one (new message) or not the in-progress
    ///   message's → DDP Invalid MSN range (siw's choice; "no buffer" is
    ///   for [`Placement::check_untagged`] to return);
    /// * MO not 0 for a new message or not contiguous → DDP Invalid MO
    ///   (siw requires in-order MO, as TCP delivers in order);
    /// * MO + len overflowing, multi-segment or oversized Read Request or
    ///   Terminate, an Immediate Data message (RFC 7306) that is not one
    ///   segment of 8 bytes → DDP Message too long;
    /// * a different opcode continuing an unfinished message of the same
    ///   kind (siw's "packet intersection") → RDMAP Unexpected OpCode;
    /// * TO + len wrapping 2^64 → DDP tagged TO wrap.
    pub fn validate(&self, h: &SegmentHeader, len: u32) -> Result<Segment, TermError> {
        match h.ddp {
            Kind::Tagged { stag, to } => {
                if let Some(op) = self.tagged {
                    if op != h.opcode {
                        return Err(TermKind::RdmapOpUnexpectedOpcode.into());
                    }
                }
                if to.checked_add(len as u64).is_none() {
                    return Err(TermKind::DdpTaggedToWrap.into());
                }
                Ok(Segment::Tagged(TaggedSegment {
                    opcode: h.opcode,
                    stag,
                    to,
                    len,
                    first: self.tagged.is_none(),
                    last: h.last,
                }))
            }
            Kind::Untagged {
                rsvd_ulp,
                qn,
                msn,
                mo,
            } => {
                let q = qn as usize;
                if q >= QUEUES || h.opcode.queue() != Some(qn) {
                    return Err(TermKind::DdpUntaggedInvalidQn.into());
                }
                let first = match self.untagged[q] {
                    Some(ip) => {
                        if msn != ip.msn {
                            return Err(TermKind::DdpUntaggedMsnRange.into());
                        }
                        if ip.opcode != h.opcode {
                            return Err(TermKind::RdmapOpUnexpectedOpcode.into());
                        }
                        if mo != ip.next_mo {
                            return Err(TermKind::DdpUntaggedInvalidMo.into());
                        }
                        false
                    }
                    None => {
                        if msn != self.expected_msn[q] {
                            return Err(TermKind::DdpUntaggedMsnRange.into());
                        }
                        if mo != 0 {
                            return Err(TermKind::DdpUntaggedInvalidMo.into());
                        }
                        true
                    }
                };
                let end = mo
                    .checked_add(len)
                    .ok_or(TermError::from(TermKind::DdpUntaggedMessageTooLong))?;
                if qn == QN_READ_REQUEST && (len != 0 || !h.last) {
                    return Err(TermKind::DdpUntaggedMessageTooLong.into());
                }
                if qn == QN_TERMINATE && (end as usize > MAX_TERMINATE_PAYLOAD || !h.last) {
                    return Err(TermKind::DdpUntaggedMessageTooLong.into());
                }
                // RFC 7306: an Immediate Data message is one segment of
                // exactly 8 bytes.
                if h.opcode.is_immediate() && (end != IMMEDIATE_DATA_LEN || !h.last) {
                    return Err(TermKind::DdpUntaggedMessageTooLong.into());
                }
                Ok(Segment::Untagged(UntaggedSegment {
                    opcode: h.opcode,
                    qn,
                    msn,
                    mo,
                    len,
                    first,
                    last: h.last,
                    inv_stag: h.opcode.is_invalidate().then_some(rsvd_ulp),
                    read_request: h.read_request,
                }))
            }
        }
    }

    /// Apply a complete, validated segment.
    pub fn commit(&mut self, seg: &Segment) {
        match seg {
            Segment::Tagged(t) => {
                self.tagged = if t.last { None } else { Some(t.opcode) };
            }
            Segment::Untagged(u) => {
                let q = u.qn as usize;
                if q >= QUEUES {
                    return;
                }
                if u.last {
                    self.untagged[q] = None;
                    self.expected_msn[q] = u.msn.wrapping_add(1);
                } else {
                    self.untagged[q] = Some(InProgress {
                        opcode: u.opcode,
                        msn: u.msn,
                        next_mo: u.mo.wrapping_add(u.len),
                    });
                }
            }
        }
    }
}

/// What the provider implements over its memory tables and queues.
///
/// For each segment [`RdmapReceiver`] calls, in order: one `check_*` (with
/// the whole segment extent, before any byte is written), zero or more
/// `place_*` chunks, then `segment_done` once the CRC has been verified.
/// An `Err` from any method aborts the stream with that Terminate error.
/// Payload may have been placed before a CRC error is detected (as in
/// siw); placed data only becomes valid with `segment_done`.
pub trait Placement {
    /// Validate a tagged segment: STag valid, associated with this stream
    /// (PD), remote-write access (Write) or an outstanding Read (Read
    /// Response), `[to, to + len)` within bounds. Not called for
    /// zero-length tagged segments (siw never checks those; the P2P RTR is
    /// a zero-length Write to STag 1). Typical errors:
    /// [`TermKind::DdpTaggedInvalidStag`], `DdpTaggedBaseBounds`,
    /// `DdpTaggedStagNotAssociated`.
    fn check_tagged(&mut self, seg: &TaggedSegment) -> Result<(), TermError>;
    /// Write tagged payload at absolute `to`.
    fn place_tagged(&mut self, stag: u32, to: u64, data: &[u8]) -> Result<(), TermError>;
    /// Validate an untagged segment: a posted receive buffer for Sends
    /// (`DdpUntaggedMsnNoBuffer` if none), `mo + len` fits it
    /// (`DdpUntaggedMessageTooLong`); IRD space for Read Requests. Not
    /// called for Terminates.
    fn check_untagged(&mut self, seg: &UntaggedSegment) -> Result<(), TermError>;
    /// Write untagged payload at message offset `mo`.
    fn place_untagged(&mut self, qn: u32, msn: u32, mo: u32, data: &[u8]) -> Result<(), TermError>;
    /// The segment is complete and its CRC verified. `seg.last()` completes
    /// the message (Send: complete the receive WR, invalidate `inv_stag`;
    /// Read Request: queue the Read Response; Read Response: complete the
    /// Read).
    fn segment_done(&mut self, seg: &Segment) -> Result<(), TermError>;
    /// A Terminate arrived (already CRC-checked). The stream is over; do
    /// not answer with a Terminate.
    fn terminate(&mut self, term: &TerminateRepr);
}

/// Drives an [`FpduReceiver`] and a [`DdpRxState`], calling [`Placement`].
#[derive(Debug, Clone)]
pub struct RdmapReceiver {
    fpdu: FpduReceiver,
    ddp: DdpRxState,
    cur: Option<Segment>,
    term: [u8; MAX_TERMINATE_PAYLOAD],
    error: Option<RxError>,
    terminated: bool,
}

impl RdmapReceiver {
    /// New receiver at the start of the FPDU stream.
    pub fn new(cfg: FpduConfig) -> Self {
        RdmapReceiver {
            fpdu: FpduReceiver::new(cfg),
            ddp: DdpRxState::new(),
            cur: None,
            term: [0; MAX_TERMINATE_PAYLOAD],
            error: None,
            terminated: false,
        }
    }

    /// DDP state (expected MSNs).
    pub fn ddp_state(&self) -> &DdpRxState {
        &self.ddp
    }

    /// Whether a Terminate has been received.
    pub fn terminated(&self) -> bool {
        self.terminated
    }

    fn fail_segment(&mut self, e: TermError) -> RxError {
        let err = RxError {
            error: e,
            terminate: TerminateRepr::for_segment(
                e,
                self.fpdu.ulpdu_len(),
                self.fpdu.header_bytes(),
            ),
        };
        self.error = Some(err);
        err
    }

    /// Process `input`; returns the bytes consumed (always all of them
    /// unless an error occurs). After an error, every call returns it.
    pub fn receive<P: Placement + ?Sized>(
        &mut self,
        input: &[u8],
        p: &mut P,
    ) -> Result<usize, RxError> {
        if let Some(e) = self.error {
            return Err(e);
        }
        let mut off = 0;
        while off < input.len() {
            let (n, ev) = match self.fpdu.poll(&input[off..]) {
                Ok(x) => x,
                Err(e) => {
                    self.error = Some(e);
                    return Err(e);
                }
            };
            off += n;
            let Some(ev) = ev else { continue };
            if let Err(e) = self.on_event(ev, p) {
                return Err(self.fail_segment(e));
            }
        }
        Ok(off)
    }

    fn on_event<P: Placement + ?Sized>(
        &mut self,
        ev: FpduEvent<'_>,
        p: &mut P,
    ) -> Result<(), TermError> {
        match ev {
            FpduEvent::Header {
                header,
                payload_len,
                ..
            } => {
                let seg = self.ddp.validate(&header, payload_len)?;
                match &seg {
                    Segment::Tagged(t) if t.len > 0 => p.check_tagged(t)?,
                    Segment::Tagged(_) => {}
                    Segment::Untagged(u) if u.qn == QN_TERMINATE => {}
                    Segment::Untagged(u) => p.check_untagged(u)?,
                }
                self.cur = Some(seg);
                Ok(())
            }
            FpduEvent::Payload { offset, data } => match self.cur {
                Some(Segment::Tagged(t)) => {
                    p.place_tagged(t.stag, t.to.wrapping_add(offset as u64), data)
                }
                Some(Segment::Untagged(u)) if u.qn == QN_TERMINATE => {
                    let at = (u.mo as usize).saturating_add(offset as usize);
                    let dst = self
                        .term
                        .get_mut(at..at.saturating_add(data.len()))
                        .ok_or(TermError::from(TermKind::DdpUntaggedMessageTooLong))?;
                    dst.copy_from_slice(data);
                    Ok(())
                }
                Some(Segment::Untagged(u)) => {
                    p.place_untagged(u.qn, u.msn, u.mo.wrapping_add(offset), data)
                }
                None => Err(TermKind::DdpLocalCatastrophic.into()),
            },
            FpduEvent::End => {
                let seg = self
                    .cur
                    .take()
                    .ok_or(TermError::from(TermKind::DdpLocalCatastrophic))?;
                self.ddp.commit(&seg);
                if let Segment::Untagged(u) = &seg {
                    if u.qn == QN_TERMINATE {
                        let len = (u.mo.wrapping_add(u.len) as usize).min(self.term.len());
                        let t = TerminatePacket::new_checked(&self.term[..len])
                            .and_then(|pk| TerminateRepr::parse(&pk))
                            .map_err(|_| TermError::from(TermKind::DdpUntaggedMessageTooLong))?;
                        self.terminated = true;
                        p.terminate(&t);
                        return Ok(());
                    }
                }
                p.segment_done(&seg)
            }
        }
    }
}
