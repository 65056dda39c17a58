//! Transmit side: segmentation of RDMAP messages into DDP segments / FPDUs.
//!
//! [`TxState`] owns the per-queue MSN counters; [`TxState::segment`]
//! returns a [`Segmenter`] iterator of [`TxSegment`]s. Each segment gives
//! the header bytes (ULPDU_Length + DDP/RDMAP header), the payload range
//! to send from the caller's memory, and a trailer (pad + CRC) computed
//! over the scattered pieces, so the caller can `writev(header, payload
//! pieces..., trailer)` without copying payload.

use crate::wire::ddp::{self, Kind};
use crate::wire::mpa::{self, CRC_LEN, MAX_ULPDU, MPA_HDR_LEN};
use crate::wire::rdmap::{
    Opcode, ReadRequest, TerminatePacket, TerminateRepr, QN_READ_REQUEST, QN_SEND, QN_TERMINATE,
    TERMINATE_HDR_LEN, TERMINATE_MAX_COPIED,
};
use crate::wire::segment::{SegmentHeader, MAX_HDR_LEN};

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
        let hl = h
            .emit(&mut hdr[MPA_HDR_LEN..MPA_HDR_LEN + MAX_HDR_LEN])
            .unwrap_or(0);
        let mut hdr_len = MPA_HDR_LEN + hl;
        if let Some(t) = &self.body {
            let bl = t.buffer_len();
            t.emit(&mut TerminatePacket::new_unchecked(
                &mut hdr[hdr_len..hdr_len + bl],
            ));
            hdr_len += bl;
        }
        let ulpdu = (hdr_len - MPA_HDR_LEN) as u32 + len;
        hdr[..2].copy_from_slice(&(ulpdu as u16).to_be_bytes());
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
        let mut b = [0u8; 7];
        let p = self.pad as usize;
        if crc {
            b[p..p + CRC_LEN].copy_from_slice(&self.crc(payload).to_le_bytes());
        }
        Trailer {
            bytes: b,
            len: (p + CRC_LEN) as u8,
        }
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

/// Pad and CRC bytes of an FPDU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Trailer {
    bytes: [u8; 7],
    len: u8,
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
