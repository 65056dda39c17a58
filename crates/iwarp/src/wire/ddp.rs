//! DDP headers (RFC 5041 §4).
//!
//! The view starts right after MPA's ULPDU_Length.
//!
//! ```text
//! Tagged (14 bytes):
//!  0                   1                   2                   3
//! +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//! |T|L| Rsvd  | DV|   RsvdULP     |            STag ...           |
//! +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//! |  ... STag     |             TO (64 bits) ...                  |
//! Untagged (18 bytes):
//! |T|L| Rsvd  | DV|   RsvdULP (40 bits, 8 here + 32 below)        |
//! |  ...          |             QN                                |
//! |  ...          |             MSN                               |
//! |  ...          |             MO                                |
//! ```
//! T = tagged, L = last segment of the message, DV = DDP version (1).
//! The first RsvdULP byte is the RDMAP control field; the 32-bit untagged
//! RsvdULP carries the Invalidate STag of Send with Invalidate.

use super::{get_u32, get_u64, put_u32, put_u64, Error, Result};

/// DDP version spoken here (DV field).
pub const DDP_VERSION: u8 = 1;
/// Tagged DDP header length.
pub const TAGGED_HDR_LEN: usize = 14;
/// Untagged DDP header length.
pub const UNTAGGED_HDR_LEN: usize = 18;

/// The Tagged flag of the DDP control byte.
pub const T_FLAG: u8 = 0x80;
/// The Last flag of the DDP control byte.
pub const L_FLAG: u8 = 0x40;
const RSVD_MASK: u8 = 0x3c;
const DV_MASK: u8 = 0x03;

/// Zero-copy view of a DDP header followed by payload.
#[derive(Debug, Clone)]
pub struct Packet<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> Packet<T> {
    /// Wrap without checks.
    pub fn new_unchecked(buffer: T) -> Self {
        Packet { buffer }
    }
    /// Wrap, checking that the header (tagged or untagged, decided by the
    /// T bit) fits.
    pub fn new_checked(buffer: T) -> Result<Self> {
        let p = Self::new_unchecked(buffer);
        let len = p.buffer.as_ref().len();
        if len < 1 || len < p.header_len() {
            return Err(Error::Truncated);
        }
        Ok(p)
    }
    /// Unwrap.
    pub fn into_inner(self) -> T {
        self.buffer
    }
    fn b(&self) -> &[u8] {
        self.buffer.as_ref()
    }
    /// T flag.
    pub fn tagged(&self) -> bool {
        self.b()[0] & T_FLAG != 0
    }
    /// L flag.
    pub fn last(&self) -> bool {
        self.b()[0] & L_FLAG != 0
    }
    /// Reserved bits (4 bits).
    pub fn rsvd(&self) -> u8 {
        (self.b()[0] & RSVD_MASK) >> 2
    }
    /// DDP version.
    pub fn version(&self) -> u8 {
        self.b()[0] & DV_MASK
    }
    /// First RsvdULP byte (RDMAP control).
    pub fn rsvd_ulp(&self) -> u8 {
        self.b()[1]
    }
    /// Header length given the T flag.
    pub fn header_len(&self) -> usize {
        if self.tagged() {
            TAGGED_HDR_LEN
        } else {
            UNTAGGED_HDR_LEN
        }
    }
    /// Tagged: STag.
    pub fn stag(&self) -> u32 {
        get_u32(self.b(), 2)
    }
    /// Tagged: Tagged Offset.
    pub fn to(&self) -> u64 {
        get_u64(self.b(), 6)
    }
    /// Untagged: 32-bit RsvdULP (Invalidate STag for Send with Invalidate).
    pub fn rsvd_ulp32(&self) -> u32 {
        get_u32(self.b(), 2)
    }
    /// Untagged: Queue Number.
    pub fn qn(&self) -> u32 {
        get_u32(self.b(), 6)
    }
    /// Untagged: Message Sequence Number.
    pub fn msn(&self) -> u32 {
        get_u32(self.b(), 10)
    }
    /// Untagged: Message Offset.
    pub fn mo(&self) -> u32 {
        get_u32(self.b(), 14)
    }
    /// Payload after the DDP header.
    pub fn payload(&self) -> &[u8] {
        &self.b()[self.header_len()..]
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Packet<T> {
    fn bm(&mut self) -> &mut [u8] {
        self.buffer.as_mut()
    }
    /// Set the whole DDP control byte from its fields.
    pub fn set_control(&mut self, tagged: bool, last: bool, version: u8) {
        let mut c = version & DV_MASK;
        if tagged {
            c |= T_FLAG;
        }
        if last {
            c |= L_FLAG;
        }
        self.bm()[0] = c;
    }
    /// Set the L flag.
    pub fn set_last(&mut self, last: bool) {
        let b = &mut self.bm()[0];
        if last {
            *b |= L_FLAG
        } else {
            *b &= !L_FLAG
        }
    }
    /// Set the first RsvdULP byte (RDMAP control).
    pub fn set_rsvd_ulp(&mut self, v: u8) {
        self.bm()[1] = v;
    }
    /// Tagged: set STag.
    pub fn set_stag(&mut self, v: u32) {
        put_u32(self.bm(), 2, v)
    }
    /// Tagged: set TO.
    pub fn set_to(&mut self, v: u64) {
        put_u64(self.bm(), 6, v)
    }
    /// Untagged: set 32-bit RsvdULP.
    pub fn set_rsvd_ulp32(&mut self, v: u32) {
        put_u32(self.bm(), 2, v)
    }
    /// Untagged: set QN.
    pub fn set_qn(&mut self, v: u32) {
        put_u32(self.bm(), 6, v)
    }
    /// Untagged: set MSN.
    pub fn set_msn(&mut self, v: u32) {
        put_u32(self.bm(), 10, v)
    }
    /// Untagged: set MO.
    pub fn set_mo(&mut self, v: u32) {
        put_u32(self.bm(), 14, v)
    }
}

/// Tagged or untagged addressing of a segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Tagged buffer model.
    Tagged {
        /// Steering tag.
        stag: u32,
        /// Tagged offset of the first payload byte.
        to: u64,
    },
    /// Untagged buffer model.
    Untagged {
        /// 32-bit RsvdULP (Invalidate STag for Send with Invalidate).
        rsvd_ulp: u32,
        /// Queue number.
        qn: u32,
        /// Message sequence number.
        msn: u32,
        /// Message offset of the first payload byte.
        mo: u32,
    },
}

/// Parsed DDP header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Repr {
    /// L flag.
    pub last: bool,
    /// First RsvdULP byte (RDMAP control field).
    pub rsvd_ulp: u8,
    /// Addressing.
    pub kind: Kind,
}

impl Repr {
    /// Parse; rejects DV != 1 with `Error::Version`.
    pub fn parse<T: AsRef<[u8]>>(p: &Packet<T>) -> Result<Repr> {
        let b = p.buffer.as_ref();
        if b.is_empty() || b.len() < p.header_len() {
            return Err(Error::Truncated);
        }
        if p.version() != DDP_VERSION {
            return Err(Error::Version);
        }
        let kind = if p.tagged() {
            Kind::Tagged {
                stag: p.stag(),
                to: p.to(),
            }
        } else {
            Kind::Untagged {
                rsvd_ulp: p.rsvd_ulp32(),
                qn: p.qn(),
                msn: p.msn(),
                mo: p.mo(),
            }
        };
        Ok(Repr {
            last: p.last(),
            rsvd_ulp: p.rsvd_ulp(),
            kind,
        })
    }
    /// Whether tagged.
    pub fn is_tagged(&self) -> bool {
        matches!(self.kind, Kind::Tagged { .. })
    }
    /// Header length.
    pub fn buffer_len(&self) -> usize {
        if self.is_tagged() {
            TAGGED_HDR_LEN
        } else {
            UNTAGGED_HDR_LEN
        }
    }
    /// Emit the header; the buffer must hold `buffer_len()` bytes.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, p: &mut Packet<T>) {
        p.set_control(self.is_tagged(), self.last, DDP_VERSION);
        p.set_rsvd_ulp(self.rsvd_ulp);
        match self.kind {
            Kind::Tagged { stag, to } => {
                p.set_stag(stag);
                p.set_to(to);
            }
            Kind::Untagged {
                rsvd_ulp,
                qn,
                msn,
                mo,
            } => {
                p.set_rsvd_ulp32(rsvd_ulp);
                p.set_qn(qn);
                p.set_msn(msn);
                p.set_mo(mo);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn golden_tagged() {
        // RDMA Write, last, STag 0x11223344, TO 0x0102030405060708.
        let bytes = [
            0xc1, 0x40, 0x11, 0x22, 0x33, 0x44, 1, 2, 3, 4, 5, 6, 7, 8, 0xee,
        ];
        let p = Packet::new_checked(&bytes[..]).unwrap();
        let r = Repr::parse(&p).unwrap();
        assert_eq!(
            r,
            Repr {
                last: true,
                rsvd_ulp: 0x40,
                kind: Kind::Tagged {
                    stag: 0x1122_3344,
                    to: 0x0102_0304_0506_0708
                }
            }
        );
        assert_eq!(p.payload(), &[0xee]);
        let mut out = [0u8; 14];
        r.emit(&mut Packet::new_unchecked(&mut out[..]));
        assert_eq!(out, bytes[..14]);
    }

    #[test]
    fn golden_untagged() {
        // Send, not last, QN 0, MSN 1, MO 0x1000.
        let bytes = [
            0x01, 0x43, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0x10, 0,
        ];
        let p = Packet::new_checked(&bytes[..]).unwrap();
        let r = Repr::parse(&p).unwrap();
        assert_eq!(
            r.kind,
            Kind::Untagged {
                rsvd_ulp: 0,
                qn: 0,
                msn: 1,
                mo: 0x1000
            }
        );
        assert!(!r.last);
        let mut out = [0u8; 18];
        r.emit(&mut Packet::new_unchecked(&mut out[..]));
        assert_eq!(out, bytes);
    }

    #[test]
    fn errors() {
        assert_eq!(Packet::new_checked(&[][..]).unwrap_err(), Error::Truncated);
        assert_eq!(
            Packet::new_checked(&[0x81u8; 13][..]).unwrap_err(),
            Error::Truncated
        );
        assert_eq!(
            Packet::new_checked(&[0x01u8; 17][..]).unwrap_err(),
            Error::Truncated
        );
        let p = Packet::new_checked(&[0x82u8; 14][..]).unwrap();
        assert_eq!(Repr::parse(&p).unwrap_err(), Error::Version);
    }
}
