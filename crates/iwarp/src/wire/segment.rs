//! The combined DDP + RDMAP header of one DDP segment.

use super::ddp::{self, Kind};
use super::rdmap::{self, control_byte, control_opcode, control_version, Opcode, ReadRequest};
use super::term::{TermError, TermKind};

/// Largest DDP + RDMAP header (untagged + Read Request).
pub const MAX_HDR_LEN: usize = ddp::UNTAGGED_HDR_LEN + rdmap::READ_REQUEST_LEN;

/// DDP + RDMAP header of one segment, as a single `Repr`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentHeader {
    /// RDMAP opcode.
    pub opcode: Opcode,
    /// DDP L flag.
    pub last: bool,
    /// DDP addressing. For Send with Invalidate, `rsvd_ulp` is the STag to
    /// invalidate; otherwise it is sent as 0.
    pub ddp: Kind,
    /// The RDMA Read Request header (opcode `ReadRequest` only).
    pub read_request: Option<ReadRequest>,
}

/// Validate the first two bytes (DDP control, RDMAP control) of a segment
/// and return the full header length. Errors are the exact Terminate
/// classification, checked in siw's order: DDP version, RDMAP version,
/// opcode (reserved opcode or T flag not matching the opcode).
pub fn header_len(ctrl: [u8; 2]) -> Result<usize, TermError> {
    let tagged = ctrl[0] & 0x80 != 0;
    if ctrl[0] & 0x03 != ddp::DDP_VERSION {
        return Err(if tagged {
            TermKind::DdpTaggedInvalidVersion
        } else {
            TermKind::DdpUntaggedInvalidVersion
        }
        .into());
    }
    if control_version(ctrl[1]) != rdmap::RDMAP_VERSION {
        return Err(TermKind::RdmapOpInvalidVersion.into());
    }
    let op = Opcode::from_raw(control_opcode(ctrl[1]))
        .ok_or(TermError::from(TermKind::RdmapOpUnexpectedOpcode))?;
    if op.is_tagged() != tagged {
        return Err(TermKind::RdmapOpUnexpectedOpcode.into());
    }
    let ddp_len = if tagged {
        ddp::TAGGED_HDR_LEN
    } else {
        ddp::UNTAGGED_HDR_LEN
    };
    Ok(ddp_len + op.rdmap_hdr_len())
}

impl SegmentHeader {
    /// Header length (DDP + RDMAP), without MPA's length field.
    pub fn buffer_len(&self) -> usize {
        let d = match self.ddp {
            Kind::Tagged { .. } => ddp::TAGGED_HDR_LEN,
            Kind::Untagged { .. } => ddp::UNTAGGED_HDR_LEN,
        };
        d + self.opcode.rdmap_hdr_len()
    }

    /// Parse a header from the start of `buf` (a DDP segment). Returns the
    /// header and its length; errors carry the Terminate classification.
    pub fn parse(buf: &[u8]) -> Result<(SegmentHeader, usize), TermError> {
        let ctrl = match buf {
            [a, b, ..] => [*a, *b],
            _ => return Err(TermKind::DdpLocalCatastrophic.into()),
        };
        let len = header_len(ctrl)?;
        let hdr = buf
            .get(..len)
            .ok_or(TermError::from(TermKind::DdpLocalCatastrophic))?;
        let p = ddp::Packet::new_checked(hdr)
            .map_err(|_| TermError::from(TermKind::DdpLocalCatastrophic))?;
        let d =
            ddp::Repr::parse(&p).map_err(|_| TermError::from(TermKind::DdpLocalCatastrophic))?;
        // header_len() validated the opcode already.
        let opcode = Opcode::from_raw(control_opcode(ctrl[1]))
            .ok_or(TermError::from(TermKind::RdmapOpUnexpectedOpcode))?;
        let read_request = if opcode == Opcode::ReadRequest {
            let rr = hdr
                .get(ddp::UNTAGGED_HDR_LEN..)
                .and_then(|b| rdmap::ReadRequestPacket::new_checked(b).ok())
                .and_then(|p| ReadRequest::parse(&p).ok())
                .ok_or(TermError::from(TermKind::DdpLocalCatastrophic))?;
            Some(rr)
        } else {
            None
        };
        Ok((
            SegmentHeader {
                opcode,
                last: d.last,
                ddp: d.kind,
                read_request,
            },
            len,
        ))
    }

    /// Emit into `buf` (at least `buffer_len()` bytes); returns the length.
    /// Returns `None` if `buf` is too short or the opcode does not match
    /// the addressing kind.
    pub fn emit(&self, buf: &mut [u8]) -> Option<usize> {
        let len = self.buffer_len();
        let out = buf.get_mut(..len)?;
        let tagged = matches!(self.ddp, Kind::Tagged { .. });
        if tagged != self.opcode.is_tagged() {
            return None;
        }
        let (d, r) = out.split_at_mut(if tagged {
            ddp::TAGGED_HDR_LEN
        } else {
            ddp::UNTAGGED_HDR_LEN
        });
        ddp::Repr {
            last: self.last,
            rsvd_ulp: control_byte(self.opcode),
            kind: self.ddp,
        }
        .emit(&mut ddp::Packet::new_unchecked(d));
        if self.opcode == Opcode::ReadRequest {
            let rr = self.read_request.unwrap_or_default();
            rr.emit(&mut rdmap::ReadRequestPacket::new_unchecked(r));
        }
        Some(len)
    }

    /// Tagged: (STag, TO).
    pub fn tagged(&self) -> Option<(u32, u64)> {
        match self.ddp {
            Kind::Tagged { stag, to } => Some((stag, to)),
            _ => None,
        }
    }

    /// Untagged: (QN, MSN, MO).
    pub fn untagged(&self) -> Option<(u32, u32, u32)> {
        match self.ddp {
            Kind::Untagged { qn, msn, mo, .. } => Some((qn, msn, mo)),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn golden_send_inv() {
        let h = SegmentHeader {
            opcode: Opcode::SendInvalidate,
            last: true,
            ddp: Kind::Untagged {
                rsvd_ulp: 0xabcd_ef01,
                qn: 0,
                msn: 7,
                mo: 0,
            },
            read_request: None,
        };
        let mut b = [0u8; 18];
        assert_eq!(h.emit(&mut b), Some(18));
        assert_eq!(
            b,
            [0x41, 0x44, 0xab, 0xcd, 0xef, 0x01, 0, 0, 0, 0, 0, 0, 0, 7, 0, 0, 0, 0]
        );
        assert_eq!(SegmentHeader::parse(&b).unwrap(), (h, 18));
    }

    #[test]
    fn golden_read_request_segment() {
        // As siw sends it: untagged, last, QN 1, MSN 1, MO 0.
        let h = SegmentHeader {
            opcode: Opcode::ReadRequest,
            last: true,
            ddp: Kind::Untagged {
                rsvd_ulp: 0,
                qn: 1,
                msn: 1,
                mo: 0,
            },
            read_request: Some(ReadRequest {
                sink_stag: 0x100,
                sink_to: 0x2000,
                size: 4096,
                src_stag: 0x200,
                src_to: 0x3000,
            }),
        };
        let mut b = [0u8; MAX_HDR_LEN];
        assert_eq!(h.emit(&mut b), Some(46));
        assert_eq!(&b[..2], &[0x41, 0x41]);
        assert_eq!(&b[6..18], &[0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 0]);
        assert_eq!(SegmentHeader::parse(&b).unwrap(), (h, 46));
        assert!(SegmentHeader::parse(&b[..45]).is_err());
    }

    #[test]
    fn header_errors() {
        use TermKind::*;
        let k = |c: [u8; 2]| header_len(c).unwrap_err().kind().unwrap();
        assert_eq!(k([0xc0, 0x40]), DdpTaggedInvalidVersion);
        assert_eq!(k([0x42, 0x43]), DdpUntaggedInvalidVersion);
        assert_eq!(k([0x41, 0x83]), RdmapOpInvalidVersion);
        // RFC 7306's atomics stay reserved; Immediate Data is untagged.
        assert_eq!(k([0x41, 0x4a]), RdmapOpUnexpectedOpcode);
        assert_eq!(k([0xc1, 0x48]), RdmapOpUnexpectedOpcode);
        assert_eq!(header_len([0x41, 0x48]), Ok(18));
        assert_eq!(k([0xc1, 0x43]), RdmapOpUnexpectedOpcode);
        assert_eq!(k([0x41, 0x40]), RdmapOpUnexpectedOpcode);
        assert_eq!(header_len([0xc1, 0x40]), Ok(14));
        assert_eq!(header_len([0x41, 0x47]), Ok(18));
        assert!(SegmentHeader::parse(&[0x41]).is_err());
        // Mismatched emit.
        let h = SegmentHeader {
            opcode: Opcode::Write,
            last: true,
            ddp: Kind::Untagged {
                rsvd_ulp: 0,
                qn: 0,
                msn: 0,
                mo: 0,
            },
            read_request: None,
        };
        assert_eq!(h.emit(&mut [0u8; 64]), None);
    }
}
