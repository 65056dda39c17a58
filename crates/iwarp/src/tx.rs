//! Transmit side: segmentation of RDMAP messages into DDP segments / FPDUs.
//!
//! [`TxState`] owns the per-queue MSN counters; [`TxState::segment`]
//! returns a [`Segmenter`] iterator of [`TxSegment`]s. Each segment gives
//! the header bytes (ULPDU_Length + DDP/RDMAP header), the payload range
//! to send from the caller's memory, and a trailer (pad + CRC) computed
//! over the scattered pieces, so the caller can `writev(header, payload
//! pieces..., trailer)` without copying payload.
//!
//! Engines that keep their own segmentation and frame queue (the soft
//! provider sizes every segment by one fixed MULPDU and interleaves Read
//! Responses with its send queue one segment at a time) build the same
//! bytes from the parts: [`TxState::start_message`] for MSNs,
//! [`emit_fpdu_header`] for ULPDU_Length + header (+ Terminate body) in
//! their own header array, and [`Trailer::with_crc`] /
//! [`Trailer::without_crc`] for pad and CRC. [`Segmenter`] is built on
//! the same functions.

use crate::wire::ddp::{self, Kind};
use crate::wire::mpa::{self, CRC_LEN, MAX_ULPDU, MPA_HDR_LEN};
use crate::wire::rdmap::{
    Opcode, ReadRequest, TerminatePacket, TerminateRepr, QN_READ_REQUEST, QN_SEND, QN_TERMINATE,
    TERMINATE_HDR_LEN, TERMINATE_MAX_COPIED,
};
use crate::wire::segment::SegmentHeader;

/// Largest header area of a [`TxSegment`]: ULPDU_Length + untagged header +
/// the larger of a Read Request and a Terminate body.
pub const MAX_TX_HDR: usize =
    MPA_HDR_LEN + ddp::UNTAGGED_HDR_LEN + TERMINATE_HDR_LEN + TERMINATE_MAX_COPIED;

/// Transmit configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TxConfig {
    /// CRC negotiated: compute it (otherwise the field is sent as zero).
    pub crc: bool,
    /// Largest FPDU on the wire, ULPDU_Length and CRC included.
    pub max_fpdu: u32,
}

/// Transmit configuration error.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum TxError {
    /// `max_fpdu` too small to carry payload.
    #[error("max_fpdu too small")]
    FpduTooSmall,
    /// Read Request / Terminate with payload.
    #[error("message type carries no payload")]
    UnexpectedPayload,
}

/// Smallest usable `max_fpdu`: the largest data header plus 4 payload
/// bytes and CRC.
pub const MIN_FPDU: u32 = (MPA_HDR_LEN + ddp::UNTAGGED_HDR_LEN + 4 + CRC_LEN) as u32;

impl TxConfig {
    /// siw's sizing: one FPDU fills one TCP segment of `emss` bytes (the
    /// effective MSS), rounded down to a multiple of 8 (siw
    /// `siw_update_tcpseg`), so non-final segments need no pad.
    pub fn from_emss(emss: u32, crc: bool) -> TxConfig {
        let max = (emss & !7).clamp(MIN_FPDU, (MPA_HDR_LEN + MAX_ULPDU + CRC_LEN) as u32 & !7);
        TxConfig { crc, max_fpdu: max }
    }

    /// MULPDU: the largest ULPDU (DDP segment) this configuration emits.
    pub fn mulpdu(&self) -> u32 {
        self.max_fpdu
            .saturating_sub((MPA_HDR_LEN + CRC_LEN) as u32)
            .min(MAX_ULPDU as u32)
    }

    /// Payload bytes per segment for a header of `hdr_len` bytes (a
    /// multiple of 4, so only the final segment may need pad).
    pub fn max_payload(&self, hdr_len: usize) -> u32 {
        self.mulpdu().saturating_sub(hdr_len as u32) & !3
    }
}

/// An RDMAP message to send.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutboundMessage {
    /// Send (QN 0), optionally solicited and/or invalidating an STag.
    Send {
        /// Solicited event.
        solicited: bool,
        /// STag to invalidate at the peer.
        invalidate: Option<u32>,
    },
    /// RDMA Write to the peer's (stag, to).
    Write {
        /// Sink STag.
        stag: u32,
        /// Sink TO.
        to: u64,
    },
    /// RDMA Read Request (QN 1), no payload.
    ReadRequest(ReadRequest),
    /// RDMA Read Response to the requester's (sink stag, sink to).
    ReadResponse {
        /// Sink STag (from the Read Request).
        stag: u32,
        /// Sink TO.
        to: u64,
    },
    /// Terminate (QN 2); the body is carried in the header area.
    Terminate(TerminateRepr),
}

/// Per-stream transmit state (next MSN per untagged queue).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TxState {
    next_msn: [u32; 3],
}

impl Default for TxState {
    fn default() -> Self {
        Self::new()
    }
}

impl TxState {
    /// Every queue starts at MSN 1.
    pub fn new() -> TxState {
        TxState { next_msn: [1; 3] }
    }

    /// MSN the next message on `qn` will carry.
    pub fn next_msn(&self, qn: u32) -> Option<u32> {
        self.next_msn.get(qn as usize).copied()
    }

    /// Consume the MSN of a new message on untagged queue `qn` (Send,
    /// Read Request or Terminate queue) and return it; `None` (and nothing
    /// consumed) for any other queue number. For engines that segment
    /// themselves; [`TxState::segment`] does this for its messages.
    pub fn start_message(&mut self, qn: u32) -> Option<u32> {
        ((qn as usize) < self.next_msn.len()).then(|| self.take_msn(qn))
    }

    fn take_msn(&mut self, qn: u32) -> u32 {
        let m = &mut self.next_msn[qn as usize];
        let v = *m;
        *m = m.wrapping_add(1);
        v
    }

    /// Segment a message with `payload_len` payload bytes. Consumes an MSN
    /// for untagged messages.
    pub fn segment(
        &mut self,
        cfg: &TxConfig,
        msg: &OutboundMessage,
        payload_len: u32,
    ) -> Result<Segmenter, TxError> {
        if cfg.max_fpdu < MIN_FPDU {
            return Err(TxError::FpduTooSmall);
        }
        let untagged = |qn, msn, rsvd| Kind::Untagged {
            rsvd_ulp: rsvd,
            qn,
            msn,
            mo: 0,
        };
        let mut body = None;
        let header = match *msg {
            OutboundMessage::Send {
                solicited,
                invalidate,
            } => {
                let opcode = match (solicited, invalidate.is_some()) {
                    (false, false) => Opcode::Send,
                    (false, true) => Opcode::SendInvalidate,
                    (true, false) => Opcode::SendSe,
                    (true, true) => Opcode::SendSeInvalidate,
                };
                let msn = self.take_msn(QN_SEND);
                SegmentHeader {
                    opcode,
                    last: false,
                    ddp: untagged(QN_SEND, msn, invalidate.unwrap_or(0)),
                    read_request: None,
                }
            }
            OutboundMessage::Write { stag, to } => SegmentHeader {
                opcode: Opcode::Write,
                last: false,
                ddp: Kind::Tagged { stag, to },
                read_request: None,
            },
            OutboundMessage::ReadResponse { stag, to } => SegmentHeader {
                opcode: Opcode::ReadResponse,
                last: false,
                ddp: Kind::Tagged { stag, to },
                read_request: None,
            },
            OutboundMessage::ReadRequest(rr) => {
                if payload_len != 0 {
                    return Err(TxError::UnexpectedPayload);
                }
                let msn = self.take_msn(QN_READ_REQUEST);
                SegmentHeader {
                    opcode: Opcode::ReadRequest,
                    last: false,
                    ddp: untagged(QN_READ_REQUEST, msn, 0),
                    read_request: Some(rr),
                }
            }
            OutboundMessage::Terminate(t) => {
                if payload_len != 0 {
                    return Err(TxError::UnexpectedPayload);
                }
                body = Some(t);
                let msn = self.take_msn(QN_TERMINATE);
                SegmentHeader {
                    opcode: Opcode::Terminate,
                    last: false,
                    ddp: untagged(QN_TERMINATE, msn, 0),
                    read_request: None,
                }
            }
        };
        Ok(Segmenter {
            header,
            body,
            total: payload_len,
            offset: 0,
            max_payload: cfg.max_payload(header.buffer_len()),
            done: false,
        })
    }
}

/// Iterator over the segments of one message.
#[derive(Debug, Clone)]
pub struct Segmenter {
    header: SegmentHeader,
    body: Option<TerminateRepr>,
    total: u32,
    offset: u32,
    max_payload: u32,
    done: bool,
}

impl Iterator for Segmenter {
    type Item = TxSegment;

    fn next(&mut self) -> Option<TxSegment> {
        if self.done {
            return None;
        }
        let left = self.total - self.offset;
        let len = left.min(self.max_payload);
        let last = len == left;
        let mut h = self.header;
        h.last = last;
        h.ddp = match h.ddp {
            Kind::Tagged { stag, to } => Kind::Tagged {
                stag,
                to: to.wrapping_add(self.offset as u64),
            },
            Kind::Untagged {
                rsvd_ulp, qn, msn, ..
            } => Kind::Untagged {
                rsvd_ulp,
                qn,
                msn,
                mo: self.offset,
            },
        };
        let mut hdr = [0u8; MAX_TX_HDR];
        // Sized by `segment()`: a header of at most MAX_TX_HDR bytes and a
        // ULPDU of at most MAX_ULPDU, so this emits.
        let hdr_len =
            emit_fpdu_header(&h, self.body.as_ref(), len as usize, &mut hdr).unwrap_or(MPA_HDR_LEN);
        let ulpdu = (hdr_len - MPA_HDR_LEN) as u32 + len;
        let seg = TxSegment {
            hdr,
            hdr_len: hdr_len as u8,
            payload_offset: self.offset,
            payload_len: len,
            pad: mpa::pad_len(ulpdu as usize) as u8,
            last,
        };
        self.offset += len;
        self.done = last;
        Some(seg)
    }
}

/// One FPDU to send: `header()`, then payload bytes
/// `[payload_offset, payload_offset + payload_len)` of the message, then
/// `trailer(..)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TxSegment {
    hdr: [u8; MAX_TX_HDR],
    hdr_len: u8,
    /// Offset of this segment's payload in the message payload.
    pub payload_offset: u32,
    /// Payload bytes in this segment.
    pub payload_len: u32,
    /// Pad bytes after the payload.
    pub pad: u8,
    /// L flag (last segment of the message).
    pub last: bool,
}

impl TxSegment {
    /// ULPDU_Length + DDP/RDMAP header (+ Terminate body).
    pub fn header(&self) -> &[u8] {
        &self.hdr[..self.hdr_len as usize]
    }

    /// Total FPDU length on the wire.
    pub fn fpdu_len(&self) -> usize {
        self.hdr_len as usize + self.payload_len as usize + self.pad as usize + CRC_LEN
    }

    /// CRC32c over header, the payload pieces (which must add up to
    /// `payload_len`) and pad.
    pub fn crc(&self, payload: &[&[u8]]) -> u32 {
        let mut c = crc32c::crc32c(self.header());
        for p in payload {
            c = crc32c::crc32c_append(c, p);
        }
        crc32c::crc32c_append(c, &[0u8; 3][..self.pad as usize])
    }

    /// Pad + CRC field, ready to send. With `crc` false the CRC is zero and
    /// `payload` is not read.
    pub fn trailer(&self, crc: bool, payload: &[&[u8]]) -> Trailer {
        let mut t = Trailer::from_pad(self.pad as usize);
        if crc {
            t.set_crc(self.crc(payload));
        }
        t
    }

    /// Whole FPDU in one buffer (`payload` is this segment's payload).
    pub fn to_vec(&self, payload: &[u8], crc: bool) -> Vec<u8> {
        let mut v = Vec::with_capacity(self.fpdu_len());
        v.extend_from_slice(self.header());
        v.extend_from_slice(payload);
        v.extend_from_slice(self.trailer(crc, &[payload]).as_ref());
        v
    }
}

/// Emit the header area of one FPDU into the start of `buf`:
/// ULPDU_Length, the DDP/RDMAP header `h` and, for a Terminate, its
/// `body`, for a segment that carries `payload_len` payload bytes after
/// it. Returns the header area's length (the bytes that precede the
/// payload on the wire; the ULPDU is that minus [`MPA_HDR_LEN`] plus
/// `payload_len`). `None`, with `buf` unspecified, if `buf` is too short,
/// `h` does not emit (see [`SegmentHeader::emit`]) or the ULPDU would not
/// fit ULPDU_Length. Writes only the header area: `buf` may be a reused
/// fixed array.
pub fn emit_fpdu_header(
    h: &SegmentHeader,
    body: Option<&TerminateRepr>,
    payload_len: usize,
    buf: &mut [u8],
) -> Option<usize> {
    let mut at = MPA_HDR_LEN + h.emit(buf.get_mut(MPA_HDR_LEN..)?)?;
    if let Some(t) = body {
        let bl = t.buffer_len();
        t.emit(&mut TerminatePacket::new_unchecked(
            buf.get_mut(at..at + bl)?,
        ));
        at += bl;
    }
    let ulpdu = u16::try_from(at - MPA_HDR_LEN + payload_len).ok()?;
    buf[..MPA_HDR_LEN].copy_from_slice(&ulpdu.to_be_bytes());
    Some(at)
}

/// Pad and CRC bytes of an FPDU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Trailer {
    bytes: [u8; 7],
    len: u8,
}

impl Trailer {
    fn from_pad(pad: usize) -> Trailer {
        Trailer {
            bytes: [0; 7],
            len: (pad + CRC_LEN) as u8,
        }
    }

    fn set_crc(&mut self, crc: u32) {
        let p = self.len as usize - CRC_LEN;
        self.bytes[p..p + CRC_LEN].copy_from_slice(&crc.to_le_bytes());
    }

    /// Trailer of an FPDU whose ULPDU is `ulpdu_len` bytes, CRC off: the
    /// pad and a zero CRC field (siw always sends the field).
    pub fn without_crc(ulpdu_len: usize) -> Trailer {
        Trailer::from_pad(mpa::pad_len(ulpdu_len))
    }

    /// Trailer of an FPDU whose ULPDU is `ulpdu_len` bytes, CRC on: the
    /// pad and the CRC32c over `fpdu`, the FPDU's bytes before the pad in
    /// order (header area and payload, as any number of pieces), then
    /// the pad.
    pub fn with_crc(ulpdu_len: usize, fpdu: &[&[u8]]) -> Trailer {
        let mut t = Trailer::without_crc(ulpdu_len);
        let c = crc_of(fpdu);
        t.set_crc(crc32c::crc32c_append(c, t.pad()));
        t
    }

    /// The pad bytes (zero; 0 to 3 of them).
    pub fn pad(&self) -> &[u8] {
        &self.bytes[..self.len as usize - CRC_LEN]
    }
}

impl AsRef<[u8]> for Trailer {
    fn as_ref(&self) -> &[u8] {
        &self.bytes[..self.len as usize]
    }
}

/// CRC32c over scattered pieces (e.g. an iovec of a whole FPDU minus CRC).
pub fn crc_of(pieces: &[&[u8]]) -> u32 {
    pieces.iter().fold(0, |c, p| crc32c::crc32c_append(c, p))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::term::TermKind;

    #[test]
    fn siw_sizing() {
        let c = TxConfig::from_emss(1460, false);
        assert_eq!(c.max_fpdu, 1456);
        // Write: 2 + 14 header + 4 CRC => 1436 bytes payload.
        assert_eq!(c.max_payload(14), 1436);
        assert_eq!(c.max_payload(18), 1432);
        assert_eq!(TxConfig::from_emss(1, false).max_fpdu, MIN_FPDU);
        assert_eq!(TxConfig::from_emss(1 << 20, false).mulpdu(), 65536 - 6);
    }

    #[test]
    fn write_segments() {
        let c = TxConfig::from_emss(1460, true);
        let mut tx = TxState::new();
        let segs: Vec<_> = tx
            .segment(&c, &OutboundMessage::Write { stag: 5, to: 1000 }, 3000)
            .unwrap()
            .collect();
        assert_eq!(segs.len(), 3);
        assert_eq!(segs[0].payload_len, 1436);
        assert_eq!(segs[0].fpdu_len(), 1456);
        assert!(!segs[0].last && segs[2].last);
        assert_eq!(segs[2].payload_len, 3000 - 2 * 1436);
        assert_eq!(segs[2].pad, 0);
        let (h, _) = SegmentHeader::parse(&segs[1].header()[2..]).unwrap();
        assert_eq!(h.ddp, Kind::Tagged { stag: 5, to: 2436 });
        assert!(!h.last);
    }

    #[test]
    fn send_msn_and_zero_len() {
        let c = TxConfig::from_emss(1460, false);
        let mut tx = TxState::new();
        for expect in 1..4u32 {
            let s: Vec<_> = tx
                .segment(
                    &c,
                    &OutboundMessage::Send {
                        solicited: false,
                        invalidate: None,
                    },
                    0,
                )
                .unwrap()
                .collect();
            assert_eq!(s.len(), 1);
            assert!(s[0].last);
            let (h, _) = SegmentHeader::parse(&s[0].header()[2..]).unwrap();
            assert_eq!(h.untagged(), Some((0, expect, 0)));
            // zero-length send: ULPDU 18, no pad, 24 bytes on the wire.
            assert_eq!(s[0].fpdu_len(), 24);
        }
        assert_eq!(tx.next_msn(0), Some(4));
        assert_eq!(tx.next_msn(1), Some(1));
    }

    #[test]
    fn terminate_as_siw() {
        let c = TxConfig::from_emss(1460, false);
        let mut tx = TxState::new();
        let t = TerminateRepr::new(TermKind::MpaCrc.into());
        let s: Vec<_> = tx
            .segment(&c, &OutboundMessage::Terminate(t), 0)
            .unwrap()
            .collect();
        assert_eq!(
            s[0].to_vec(&[], false),
            [
                0, 22, 0x41, 0x47, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 1, 0, 0, 0, 0, 0x20, 0x02, 0,
                0, 0, 0, 0, 0
            ]
        );
        assert_eq!(
            tx.segment(&c, &OutboundMessage::Terminate(t), 1)
                .unwrap_err(),
            TxError::UnexpectedPayload
        );
        let bad = TxConfig {
            crc: false,
            max_fpdu: 10,
        };
        assert_eq!(
            tx.segment(&bad, &OutboundMessage::Terminate(t), 0)
                .unwrap_err(),
            TxError::FpduTooSmall
        );
    }

    #[test]
    fn parts_build_the_segmenter_bytes() {
        // The soft provider's way: its own array, MSNs and trailers.
        let c = TxConfig::from_emss(1460, true);
        let mut tx = TxState::new();
        let mut own = TxState::new();
        let payload: Vec<u8> = (0..3001u32).map(|i| i as u8).collect();
        let msg = OutboundMessage::Send {
            solicited: true,
            invalidate: Some(0x1234),
        };
        let mut buf = [0xeeu8; 96];
        let msn = own.start_message(QN_SEND).unwrap();
        for s in tx.segment(&c, &msg, payload.len() as u32).unwrap() {
            let off = s.payload_offset as usize;
            let p = &payload[off..off + s.payload_len as usize];
            let h = SegmentHeader {
                opcode: Opcode::SendSeInvalidate,
                last: s.last,
                ddp: Kind::Untagged {
                    rsvd_ulp: 0x1234,
                    qn: QN_SEND,
                    msn,
                    mo: off as u32,
                },
                read_request: None,
            };
            let n = emit_fpdu_header(&h, None, p.len(), &mut buf).unwrap();
            assert_eq!(&buf[..n], s.header());
            let ulpdu = n - MPA_HDR_LEN + p.len();
            // CRC over pieces split anywhere.
            let (p1, p2) = p.split_at(p.len() / 3);
            let t = Trailer::with_crc(ulpdu, &[&buf[..5], &buf[5..n], p1, p2]);
            assert_eq!(t, s.trailer(true, &[p]));
            assert_eq!(t.pad().len(), s.pad as usize);
            assert_eq!(Trailer::without_crc(ulpdu), s.trailer(false, &[]));
        }
        assert_eq!(own.next_msn(QN_SEND), tx.next_msn(QN_SEND));
        assert_eq!(own.start_message(3), None);
        assert_eq!(own.next_msn(QN_READ_REQUEST), Some(1));
    }

    #[test]
    fn fpdu_header_terminate_and_limits() {
        let t = TerminateRepr::new(TermKind::MpaCrc.into());
        let h = SegmentHeader {
            opcode: Opcode::Terminate,
            last: true,
            ddp: Kind::Untagged {
                rsvd_ulp: 0,
                qn: QN_TERMINATE,
                msn: 1,
                mo: 0,
            },
            read_request: None,
        };
        let mut b = [0u8; MAX_TX_HDR];
        let n = emit_fpdu_header(&h, Some(&t), 0, &mut b).unwrap();
        let mut tx = TxState::new();
        let seg = tx
            .segment(
                &TxConfig::from_emss(1460, false),
                &OutboundMessage::Terminate(t),
                0,
            )
            .unwrap()
            .next()
            .unwrap();
        assert_eq!(&b[..n], seg.header());
        // Too short for the body, for the header, for the length field.
        assert_eq!(emit_fpdu_header(&h, Some(&t), 0, &mut b[..n - 1]), None);
        assert_eq!(emit_fpdu_header(&h, None, 0, &mut b[..19]), None);
        assert_eq!(emit_fpdu_header(&h, None, 0, &mut b[..1]), None);
        // ULPDU_Length overflow: 18 + payload must fit 16 bits.
        assert_eq!(emit_fpdu_header(&h, None, MAX_ULPDU - 18, &mut b), Some(20));
        assert_eq!(&b[..2], &[0xff, 0xff]);
        assert_eq!(emit_fpdu_header(&h, None, MAX_ULPDU - 17, &mut b), None);
        // Pads: ULPDU_Length + ULPDU + pad is a multiple of 4.
        for (ulpdu, pad) in [(14, 0), (15, 3), (16, 2), (17, 1), (18, 0)] {
            assert_eq!(Trailer::without_crc(ulpdu).pad().len(), pad);
            assert_eq!(Trailer::without_crc(ulpdu).as_ref(), &[0u8; 7][..pad + 4]);
        }
    }

    #[test]
    fn crc_scattered() {
        let c = TxConfig::from_emss(1460, true);
        let mut tx = TxState::new();
        let s = tx
            .segment(&c, &OutboundMessage::Write { stag: 1, to: 0 }, 7)
            .unwrap()
            .next()
            .unwrap();
        let payload = b"abcdefg";
        let whole = s.to_vec(payload, true);
        let p = mpa::FpduPacket::new_checked(&whole[..]).unwrap();
        assert!(p.verify_crc());
        assert_eq!(
            s.crc(&[&payload[..3], &payload[3..]]),
            crc_of(&[s.header(), payload, &[0u8]])
        );
    }
}
