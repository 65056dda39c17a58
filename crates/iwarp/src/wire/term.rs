//! Terminate error classification (RFC 5040 §7, RFC 5041 §7, RFC 5044 §8,
//! RFC 6581 §9).
//!
//! A Terminate carries a (Layer, Error Type, Error Code) triple. [`TermError`]
//! is the raw triple; [`TermKind`] names every value the RFCs define.

/// Layer field of a Terminate header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Layer {
    /// RDMAP (0).
    Rdmap,
    /// DDP (1).
    Ddp,
    /// Lower layer protocol: MPA (2).
    Llp,
    /// Any other (reserved) value.
    Other(u8),
}

impl Layer {
    /// Raw 4-bit value.
    pub fn to_raw(self) -> u8 {
        match self {
            Layer::Rdmap => 0,
            Layer::Ddp => 1,
            Layer::Llp => 2,
            Layer::Other(v) => v & 0xf,
        }
    }
    /// From the raw 4-bit value.
    pub fn from_raw(v: u8) -> Layer {
        match v & 0xf {
            0 => Layer::Rdmap,
            1 => Layer::Ddp,
            2 => Layer::Llp,
            o => Layer::Other(o),
        }
    }
}

/// RDMAP error types (RFC 5040 §7.1).
pub mod rdmap_etype {
    /// Local catastrophic error.
    pub const CATASTROPHIC: u8 = 0x0;
    /// Remote protection error.
    pub const REMOTE_PROTECTION: u8 = 0x1;
    /// Remote operation error.
    pub const REMOTE_OPERATION: u8 = 0x2;
}

/// RDMAP error codes (RFC 5040 §7.2).
pub mod rdmap_ecode {
    /// Invalid STag (protection).
    pub const INVALID_STAG: u8 = 0x00;
    /// Base or bounds violation (protection).
    pub const BASE_BOUNDS: u8 = 0x01;
    /// Access rights violation (protection).
    pub const ACCESS_RIGHTS: u8 = 0x02;
    /// STag not associated with RDMAP stream (protection).
    pub const STAG_NOT_ASSOCIATED: u8 = 0x03;
    /// TO wrap (protection).
    pub const TO_WRAP: u8 = 0x04;
    /// Invalid RDMAP version (operation).
    pub const INVALID_VERSION: u8 = 0x05;
    /// Unexpected OpCode (operation).
    pub const UNEXPECTED_OPCODE: u8 = 0x06;
    /// Catastrophic error, localized to RDMAP stream (operation).
    pub const CATASTROPHIC_STREAM: u8 = 0x07;
    /// Catastrophic error, global (operation).
    pub const CATASTROPHIC_GLOBAL: u8 = 0x08;
    /// STag cannot be invalidated (protection or operation).
    pub const CANNOT_INVALIDATE: u8 = 0x09;
    /// Unspecified error (protection or operation).
    pub const UNSPECIFIED: u8 = 0xff;
}

/// DDP error types (RFC 5041 §7.2).
pub mod ddp_etype {
    /// Local catastrophic.
    pub const CATASTROPHIC: u8 = 0x0;
    /// Tagged buffer error.
    pub const TAGGED: u8 = 0x1;
    /// Untagged buffer error.
    pub const UNTAGGED: u8 = 0x2;
    /// Reserved for the LLP.
    pub const RSVD_LLP: u8 = 0x3;
}

/// DDP error codes (RFC 5041 §7.2).
pub mod ddp_ecode {
    /// Tagged: invalid STag.
    pub const T_INVALID_STAG: u8 = 0x00;
    /// Tagged: base or bounds violation.
    pub const T_BASE_BOUNDS: u8 = 0x01;
    /// Tagged: STag not associated with DDP stream.
    pub const T_STAG_NOT_ASSOCIATED: u8 = 0x02;
    /// Tagged: TO wrap.
    pub const T_TO_WRAP: u8 = 0x03;
    /// Tagged: invalid DDP version.
    pub const T_INVALID_VERSION: u8 = 0x04;
    /// Untagged: invalid QN.
    pub const UT_INVALID_QN: u8 = 0x01;
    /// Untagged: invalid MSN, no buffer available.
    pub const UT_INVALID_MSN_NO_BUFFER: u8 = 0x02;
    /// Untagged: invalid MSN, MSN range is not valid.
    pub const UT_INVALID_MSN_RANGE: u8 = 0x03;
    /// Untagged: invalid MO.
    pub const UT_INVALID_MO: u8 = 0x04;
    /// Untagged: DDP message too long for available buffer.
    pub const UT_MESSAGE_TOO_LONG: u8 = 0x05;
    /// Untagged: invalid DDP version.
    pub const UT_INVALID_VERSION: u8 = 0x06;
}

/// LLP (MPA) error type.
pub mod llp_etype {
    /// MPA.
    pub const MPA: u8 = 0x0;
}

/// MPA error codes (RFC 5044 §8, RFC 6581 §9).
pub mod llp_ecode {
    /// TCP connection closed, terminated or lost.
    pub const TCP_LOST: u8 = 0x01;
    /// MPA CRC error.
    pub const CRC: u8 = 0x02;
    /// MPA marker and ULPDU length field mismatch.
    pub const MARKER_LENGTH_MISMATCH: u8 = 0x03;
    /// Invalid MPA request or reply frame.
    pub const INVALID_REQ_REP: u8 = 0x04;
    /// Local catastrophic error (RFC 6581).
    pub const LOCAL_CATASTROPHIC: u8 = 0x05;
    /// Insufficient IRD resources (RFC 6581).
    pub const INSUFFICIENT_IRD: u8 = 0x06;
    /// No matching RTR option (RFC 6581).
    pub const NO_MATCHING_RTR: u8 = 0x07;
}

/// The raw (layer, etype, ecode) of a Terminate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TermError {
    /// Layer.
    pub layer: Layer,
    /// 4-bit error type.
    pub etype: u8,
    /// 8-bit error code.
    pub ecode: u8,
}

impl core::fmt::Display for TermError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self.kind() {
            Some(k) => write!(f, "{k:?}"),
            None => write!(
                f,
                "terminate layer {} etype {} ecode {:#04x}",
                self.layer.to_raw(),
                self.etype,
                self.ecode
            ),
        }
    }
}

impl std::error::Error for TermError {}

/// Every Terminate classification the RFCs define.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[allow(missing_docs)]
pub enum TermKind {
    RdmapLocalCatastrophic,
    RdmapProtInvalidStag,
    RdmapProtBaseBounds,
    RdmapProtAccessRights,
    RdmapProtStagNotAssociated,
    RdmapProtToWrap,
    RdmapProtCannotInvalidate,
    RdmapProtUnspecified,
    RdmapOpInvalidVersion,
    RdmapOpUnexpectedOpcode,
    RdmapOpCatastrophicStream,
    RdmapOpCatastrophicGlobal,
    RdmapOpCannotInvalidate,
    RdmapOpUnspecified,
    DdpLocalCatastrophic,
    DdpTaggedInvalidStag,
    DdpTaggedBaseBounds,
    DdpTaggedStagNotAssociated,
    DdpTaggedToWrap,
    DdpTaggedInvalidVersion,
    DdpUntaggedInvalidQn,
    DdpUntaggedMsnNoBuffer,
    DdpUntaggedMsnRange,
    DdpUntaggedInvalidMo,
    DdpUntaggedMessageTooLong,
    DdpUntaggedInvalidVersion,
    MpaTcpLost,
    MpaCrc,
    MpaMarkerLengthMismatch,
    MpaInvalidReqRep,
    MpaLocalCatastrophic,
    MpaInsufficientIrd,
    MpaNoMatchingRtr,
}

const TABLE: &[(TermKind, u8, u8, u8)] = {
    use TermKind::*;
    &[
        (RdmapLocalCatastrophic, 0, 0, 0x00),
        (RdmapProtInvalidStag, 0, 1, 0x00),
        (RdmapProtBaseBounds, 0, 1, 0x01),
        (RdmapProtAccessRights, 0, 1, 0x02),
        (RdmapProtStagNotAssociated, 0, 1, 0x03),
        (RdmapProtToWrap, 0, 1, 0x04),
        (RdmapProtCannotInvalidate, 0, 1, 0x09),
        (RdmapProtUnspecified, 0, 1, 0xff),
        (RdmapOpInvalidVersion, 0, 2, 0x05),
        (RdmapOpUnexpectedOpcode, 0, 2, 0x06),
        (RdmapOpCatastrophicStream, 0, 2, 0x07),
        (RdmapOpCatastrophicGlobal, 0, 2, 0x08),
        (RdmapOpCannotInvalidate, 0, 2, 0x09),
        (RdmapOpUnspecified, 0, 2, 0xff),
        (DdpLocalCatastrophic, 1, 0, 0x00),
        (DdpTaggedInvalidStag, 1, 1, 0x00),
        (DdpTaggedBaseBounds, 1, 1, 0x01),
        (DdpTaggedStagNotAssociated, 1, 1, 0x02),
        (DdpTaggedToWrap, 1, 1, 0x03),
        (DdpTaggedInvalidVersion, 1, 1, 0x04),
        (DdpUntaggedInvalidQn, 1, 2, 0x01),
        (DdpUntaggedMsnNoBuffer, 1, 2, 0x02),
        (DdpUntaggedMsnRange, 1, 2, 0x03),
        (DdpUntaggedInvalidMo, 1, 2, 0x04),
        (DdpUntaggedMessageTooLong, 1, 2, 0x05),
        (DdpUntaggedInvalidVersion, 1, 2, 0x06),
        (MpaTcpLost, 2, 0, 0x01),
        (MpaCrc, 2, 0, 0x02),
        (MpaMarkerLengthMismatch, 2, 0, 0x03),
        (MpaInvalidReqRep, 2, 0, 0x04),
        (MpaLocalCatastrophic, 2, 0, 0x05),
        (MpaInsufficientIrd, 2, 0, 0x06),
        (MpaNoMatchingRtr, 2, 0, 0x07),
    ]
};

impl TermKind {
    /// All defined kinds.
    pub fn all() -> impl Iterator<Item = TermKind> {
        TABLE.iter().map(|e| e.0)
    }
    /// Raw triple.
    pub fn to_error(self) -> TermError {
        // The table is exhaustive over the enum; the fallback is unreachable.
        TABLE
            .iter()
            .find(|e| e.0 == self)
            .map(|&(_, l, t, c)| TermError {
                layer: Layer::from_raw(l),
                etype: t,
                ecode: c,
            })
            .unwrap_or(TermError {
                layer: Layer::Rdmap,
                etype: 0,
                ecode: 0,
            })
    }
}

impl From<TermKind> for TermError {
    fn from(k: TermKind) -> TermError {
        k.to_error()
    }
}

impl TermError {
    /// Build from raw fields.
    pub fn new(layer: Layer, etype: u8, ecode: u8) -> TermError {
        TermError {
            layer,
            etype: etype & 0xf,
            ecode,
        }
    }
    /// The named kind, if the triple is one the RFCs define.
    pub fn kind(&self) -> Option<TermKind> {
        let l = self.layer.to_raw();
        TABLE
            .iter()
            .find(|e| e.1 == l && e.2 == self.etype && e.3 == self.ecode)
            .map(|e| e.0)
    }
    /// `layer << 12 | etype << 8 | ecode`: the packing verbs providers use
    /// for a Terminate in a work completion's vendor error.
    pub fn vendor_err(&self) -> u32 {
        (u32::from(self.layer.to_raw()) << 12)
            | (u32::from(self.etype & 0xf) << 8)
            | u32::from(self.ecode)
    }
    /// The inverse of [`TermError::vendor_err`].
    pub fn from_vendor_err(v: u32) -> TermError {
        TermError::new(Layer::from_raw((v >> 12) as u8), (v >> 8) as u8, v as u8)
    }
    /// A protection error: RDMAP remote protection, or a DDP tagged buffer
    /// error (a key, range or right the data sink refused).
    pub fn is_protection(&self) -> bool {
        matches!(self.layer, Layer::Rdmap | Layer::Ddp) && self.etype == 1
    }
    /// True when the RFC says the offending DDP header cannot be reported
    /// (layout unknown: version errors, unexpected opcode) or the error is
    /// not tied to a segment (LLP, catastrophic).
    pub fn header_reportable(&self) -> bool {
        use TermKind::*;
        match self.kind() {
            Some(
                RdmapOpInvalidVersion
                | RdmapOpUnexpectedOpcode
                | DdpTaggedInvalidVersion
                | DdpUntaggedInvalidVersion
                | RdmapLocalCatastrophic,
            ) => false,
            _ => !matches!(self.layer, Layer::Llp | Layer::Other(_)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip_all() {
        let mut n = 0;
        for k in TermKind::all() {
            assert_eq!(k.to_error().kind(), Some(k));
            let e = k.to_error();
            assert_eq!(TermError::from_vendor_err(e.vendor_err()), e);
            n += 1;
        }
        assert_eq!(n, 33);
        assert_eq!(TermError::new(Layer::Ddp, 3, 0).kind(), None);
        assert_eq!(Layer::from_raw(7), Layer::Other(7));
        assert_eq!(Layer::Other(7).to_raw(), 7);
        assert!(format!("{}", TermError::new(Layer::Other(9), 1, 2)).contains("layer 9"));
        assert_eq!(format!("{}", TermError::from(TermKind::MpaCrc)), "MpaCrc");
        assert_eq!(
            TermError::from(TermKind::DdpTaggedBaseBounds).vendor_err(),
            0x1101
        );
        assert_eq!(TermError::from(TermKind::MpaCrc).vendor_err(), 0x2002);
        let prot: Vec<TermKind> = TermKind::all()
            .filter(|k| k.to_error().is_protection())
            .collect();
        assert_eq!(prot.len(), 12, "{prot:?}");
        assert!(!TermError::from(TermKind::DdpUntaggedInvalidMo).is_protection());
    }
}
