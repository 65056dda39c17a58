//! MPA (RFC 5044, updated by RFC 6581): connection setup frames and FPDU
//! framing.
//!
//! ```text
//! MPA Request / Reply frame:
//!  0                   1                   2                   3
//!  0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1
//! +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//! |        Key: "MPA ID Req Frame" or "MPA ID Rep Frame"          |
//! |                          (16 bytes)                           |
//! +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//! |M|C|R|E|G| Res |     Rev       |          PD_Length            |
//! +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//! ~   Private Data (PD_Length bytes; with E set, the first four    ~
//! ~   bytes are the RFC 6581 IRD/ORD words)                        ~
//! ```
//! `E` (0x10 of byte 16) is the enhanced-connection-establishment flag
//! (RFC 6581; siw `MPA_RR_FLAG_ENHANCED`), `G` (0x08) is siw's private
//! "GSO allowed" hint (`MPA_RR_FLAG_GSO_EXP`), carried but not interpreted.
//!
//! ```text
//! RFC 6581 IRD/ORD words (first 4 bytes of private data):
//! +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//! |P|S|          IRD (14)         |W|R|          ORD (14)         |
//! +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//! P = peer-to-peer, S = zero-length Send RTR,
//! W = zero-length RDMA Write RTR, R = zero-length RDMA Read RTR.
//!
//! FPDU:
//! +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//! |        ULPDU_Length           |          ULPDU ...            ~
//! ~                  ... ULPDU  |  PAD (0-3 bytes, zero)          |
//! |                          CRC32c (or 0)                        |
//! ```
//! The CRC covers ULPDU_Length, ULPDU and PAD; it is CRC32c as in iSCSI and
//! goes on the wire least significant byte first (what Linux `crc32c`
//! produces and siw sends). Markers are never used.

use super::{get_u16, put_u16, Error, Result};

/// The 16-byte key of an MPA Request frame.
pub const KEY_REQ: &[u8; 16] = b"MPA ID Req Frame";
/// The 16-byte key of an MPA Reply frame.
pub const KEY_REP: &[u8; 16] = b"MPA ID Rep Frame";
/// Length of the fixed part of an MPA Request/Reply frame.
pub const FRAME_HEADER_LEN: usize = 20;
/// RFC 5044: PD_Length MUST NOT exceed 512.
pub const MAX_PRIVATE_DATA: usize = 512;
/// siw (Linux `RDMA_MAX_PRIVATE_DATA`) refuses a frame whose PD_Length
/// (IRD/ORD words included) exceeds 256 bytes.
pub const SIW_MAX_PRIVATE_DATA: usize = 256;
/// Size of the RFC 6581 IRD/ORD control words.
pub const IRD_ORD_LEN: usize = 4;
/// IRD and ORD are 14-bit fields.
pub const IRD_ORD_MAX: u16 = 0x3fff;
/// Size of the ULPDU_Length field.
pub const MPA_HDR_LEN: usize = 2;
/// Size of the CRC field (always present, zero when CRC is off).
pub const CRC_LEN: usize = 4;
/// Largest ULPDU (ULPDU_Length is 16 bits).
pub const MAX_ULPDU: usize = 0xffff;

/// M flag: markers.
pub const FLAG_MARKERS: u8 = 0x80;
/// C flag: CRC.
pub const FLAG_CRC: u8 = 0x40;
/// R flag: reject.
pub const FLAG_REJECT: u8 = 0x20;
/// Enhanced connection establishment (RFC 6581, siw `MPA_RR_FLAG_ENHANCED`).
pub const FLAG_ENHANCED: u8 = 0x10;
/// siw private: peer may use GSO-sized FPDUs (`MPA_RR_FLAG_GSO_EXP`).
pub const FLAG_GSO: u8 = 0x08;

/// Pad bytes that follow a ULPDU of `ulpdu_len` bytes (the 2-byte length
/// field + ULPDU + pad is a multiple of 4).
#[inline]
pub const fn pad_len(ulpdu_len: usize) -> usize {
    (4 - ((MPA_HDR_LEN + ulpdu_len) & 3)) & 3
}

/// Total on-wire size of an FPDU carrying `ulpdu_len` bytes of ULPDU.
#[inline]
pub const fn fpdu_len(ulpdu_len: usize) -> usize {
    MPA_HDR_LEN + ulpdu_len + pad_len(ulpdu_len) + CRC_LEN
}

/// Request or Reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FrameKind {
    /// "MPA ID Req Frame".
    Request,
    /// "MPA ID Rep Frame".
    Reply,
}

impl FrameKind {
    /// The frame key.
    pub fn key(self) -> &'static [u8; 16] {
        match self {
            FrameKind::Request => KEY_REQ,
            FrameKind::Reply => KEY_REP,
        }
    }
}

/// Zero-copy view of an MPA Request/Reply frame.
#[derive(Debug, Clone)]
pub struct FramePacket<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> FramePacket<T> {
    /// Wrap without checks; getters may panic on short buffers.
    pub fn new_unchecked(buffer: T) -> Self {
        FramePacket { buffer }
    }
    /// Wrap and check that the fixed header and the announced private data
    /// fit in the buffer.
    pub fn new_checked(buffer: T) -> Result<Self> {
        let p = Self::new_unchecked(buffer);
        p.check_len()?;
        Ok(p)
    }
    /// Length check used by `new_checked`.
    pub fn check_len(&self) -> Result<()> {
        let len = self.buffer.as_ref().len();
        if len < FRAME_HEADER_LEN {
            return Err(Error::Truncated);
        }
        if len < FRAME_HEADER_LEN + self.pd_length() as usize {
            return Err(Error::Truncated);
        }
        Ok(())
    }
    /// Unwrap.
    pub fn into_inner(self) -> T {
        self.buffer
    }
    /// The 16-byte key.
    pub fn key(&self) -> &[u8] {
        &self.buffer.as_ref()[0..16]
    }
    /// Raw flags byte (M, C, R, E, G, Res).
    pub fn flags(&self) -> u8 {
        self.buffer.as_ref()[16]
    }
    /// M flag.
    pub fn markers(&self) -> bool {
        self.flags() & FLAG_MARKERS != 0
    }
    /// C flag.
    pub fn crc(&self) -> bool {
        self.flags() & FLAG_CRC != 0
    }
    /// R flag.
    pub fn reject(&self) -> bool {
        self.flags() & FLAG_REJECT != 0
    }
    /// Enhanced mode flag (RFC 6581).
    pub fn enhanced(&self) -> bool {
        self.flags() & FLAG_ENHANCED != 0
    }
    /// Revision.
    pub fn revision(&self) -> u8 {
        self.buffer.as_ref()[17]
    }
    /// PD_Length.
    pub fn pd_length(&self) -> u16 {
        get_u16(self.buffer.as_ref(), 18)
    }
    /// The private data (including any IRD/ORD words).
    pub fn private_data(&self) -> &[u8] {
        let end = FRAME_HEADER_LEN + self.pd_length() as usize;
        &self.buffer.as_ref()[FRAME_HEADER_LEN..end]
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> FramePacket<T> {
    /// Set the key.
    pub fn set_key(&mut self, key: &[u8; 16]) {
        self.buffer.as_mut()[0..16].copy_from_slice(key);
    }
    /// Set the raw flags byte.
    pub fn set_flags(&mut self, flags: u8) {
        self.buffer.as_mut()[16] = flags;
    }
    /// Set the revision.
    pub fn set_revision(&mut self, rev: u8) {
        self.buffer.as_mut()[17] = rev;
    }
    /// Set PD_Length.
    pub fn set_pd_length(&mut self, len: u16) {
        put_u16(self.buffer.as_mut(), 18, len)
    }
    /// Mutable private data.
    pub fn private_data_mut(&mut self) -> &mut [u8] {
        let end = FRAME_HEADER_LEN + self.pd_length() as usize;
        &mut self.buffer.as_mut()[FRAME_HEADER_LEN..end]
    }
}

/// RFC 6581 IRD/ORD and RTR control words.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct IrdOrd {
    /// Inbound RDMA Read queue depth (14 bits).
    pub ird: u16,
    /// Outbound RDMA Read queue depth (14 bits).
    pub ord: u16,
    /// Peer-to-peer connection model requested/confirmed.
    pub p2p: bool,
    /// Zero-length Send as RTR.
    pub send_rtr: bool,
    /// Zero-length RDMA Write as RTR.
    pub write_rtr: bool,
    /// Zero-length RDMA Read as RTR.
    pub read_rtr: bool,
}

/// Zero-copy view of the 4-byte IRD/ORD words.
#[derive(Debug, Clone)]
pub struct IrdOrdPacket<T: AsRef<[u8]>> {
    buffer: T,
}

const P2P: u16 = 0x8000;
const SEND_RTR: u16 = 0x4000;
const WRITE_RTR: u16 = 0x8000;
const READ_RTR: u16 = 0x4000;

impl<T: AsRef<[u8]>> IrdOrdPacket<T> {
    /// Wrap without checks.
    pub fn new_unchecked(buffer: T) -> Self {
        IrdOrdPacket { buffer }
    }
    /// Wrap, checking for 4 bytes.
    pub fn new_checked(buffer: T) -> Result<Self> {
        if buffer.as_ref().len() < IRD_ORD_LEN {
            return Err(Error::Truncated);
        }
        Ok(Self::new_unchecked(buffer))
    }
    /// Raw IRD word (flags + IRD).
    pub fn ird_word(&self) -> u16 {
        get_u16(self.buffer.as_ref(), 0)
    }
    /// Raw ORD word (flags + ORD).
    pub fn ord_word(&self) -> u16 {
        get_u16(self.buffer.as_ref(), 2)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> IrdOrdPacket<T> {
    /// Set the raw IRD word.
    pub fn set_ird_word(&mut self, v: u16) {
        put_u16(self.buffer.as_mut(), 0, v)
    }
    /// Set the raw ORD word.
    pub fn set_ord_word(&mut self, v: u16) {
        put_u16(self.buffer.as_mut(), 2, v)
    }
}

impl IrdOrd {
    /// Parse.
    pub fn parse<T: AsRef<[u8]>>(p: &IrdOrdPacket<T>) -> Result<IrdOrd> {
        let i = p.ird_word();
        let o = p.ord_word();
        Ok(IrdOrd {
            ird: i & IRD_ORD_MAX,
            ord: o & IRD_ORD_MAX,
            p2p: i & P2P != 0,
            send_rtr: i & SEND_RTR != 0,
            write_rtr: o & WRITE_RTR != 0,
            read_rtr: o & READ_RTR != 0,
        })
    }
    /// Always 4.
    pub const fn buffer_len(&self) -> usize {
        IRD_ORD_LEN
    }
    /// Emit (IRD/ORD values are masked to 14 bits).
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, p: &mut IrdOrdPacket<T>) {
        let mut i = self.ird & IRD_ORD_MAX;
        let mut o = self.ord & IRD_ORD_MAX;
        if self.p2p {
            i |= P2P;
        }
        if self.send_rtr {
            i |= SEND_RTR;
        }
        if self.write_rtr {
            o |= WRITE_RTR;
        }
        if self.read_rtr {
            o |= READ_RTR;
        }
        p.set_ird_word(i);
        p.set_ord_word(o);
    }
    /// Emit into a fresh array.
    pub fn to_bytes(&self) -> [u8; 4] {
        let mut b = [0u8; 4];
        self.emit(&mut IrdOrdPacket::new_unchecked(&mut b[..]));
        b
    }
}

/// Parsed MPA Request/Reply frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FrameRepr<'a> {
    /// Request or Reply (from the key).
    pub kind: FrameKind,
    /// M flag.
    pub markers: bool,
    /// C flag.
    pub crc: bool,
    /// R flag.
    pub reject: bool,
    /// siw's GSO hint flag.
    pub gso: bool,
    /// Revision (1 or 2; 0 is accepted on parse like siw does).
    pub revision: u8,
    /// RFC 6581 words; `Some` iff the enhanced flag is set in a Rev 2
    /// frame (emitting sets the flag iff `Some`).
    pub ird_ord: Option<IrdOrd>,
    /// ULP private data (after the IRD/ORD words, if any).
    pub private_data: &'a [u8],
}

impl<'a> FrameRepr<'a> {
    /// Parse a checked frame. Errors: unknown key or enhanced flag without
    /// 4 bytes of private data → `Malformed`; PD_Length > 512 → `Malformed`;
    /// revision > 2 → `Version`.
    pub fn parse<T: AsRef<[u8]> + ?Sized>(p: &FramePacket<&'a T>) -> Result<FrameRepr<'a>> {
        p.check_len()?;
        let kind = if p.key() == KEY_REQ {
            FrameKind::Request
        } else if p.key() == KEY_REP {
            FrameKind::Reply
        } else {
            return Err(Error::Malformed);
        };
        if p.pd_length() as usize > MAX_PRIVATE_DATA {
            return Err(Error::Malformed);
        }
        if p.revision() > 2 {
            return Err(Error::Version);
        }
        let pd: &'a [u8] = {
            let buf: &'a [u8] = T::as_ref(p.buffer);
            let end = FRAME_HEADER_LEN + p.pd_length() as usize;
            buf.get(FRAME_HEADER_LEN..end).ok_or(Error::Truncated)?
        };
        // Like siw, the enhanced flag only means something in Rev 2.
        let (ird_ord, private_data) = if p.enhanced() && p.revision() >= 2 {
            if pd.len() < IRD_ORD_LEN {
                return Err(Error::Malformed);
            }
            let io = IrdOrd::parse(&IrdOrdPacket::new_checked(&pd[..IRD_ORD_LEN])?)?;
            (Some(io), &pd[IRD_ORD_LEN..])
        } else {
            (None, pd)
        };
        Ok(FrameRepr {
            kind,
            markers: p.markers(),
            crc: p.crc(),
            reject: p.reject(),
            gso: p.flags() & FLAG_GSO != 0,
            revision: p.revision(),
            ird_ord,
            private_data,
        })
    }

    /// PD_Length this frame will carry.
    pub fn pd_length(&self) -> usize {
        self.private_data.len()
            + if self.ird_ord.is_some() {
                IRD_ORD_LEN
            } else {
                0
            }
    }

    /// Bytes needed to emit the frame.
    pub fn buffer_len(&self) -> usize {
        FRAME_HEADER_LEN + self.pd_length()
    }

    /// Raw flags byte.
    pub fn flags(&self) -> u8 {
        let mut f = 0;
        if self.markers {
            f |= FLAG_MARKERS;
        }
        if self.crc {
            f |= FLAG_CRC;
        }
        if self.reject {
            f |= FLAG_REJECT;
        }
        if self.ird_ord.is_some() {
            f |= FLAG_ENHANCED;
        }
        if self.gso {
            f |= FLAG_GSO;
        }
        f
    }

    /// Emit into a packet whose buffer is at least `buffer_len()` bytes.
    /// Fails with `Malformed` if the private data exceeds 512 bytes.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, p: &mut FramePacket<T>) -> Result<()> {
        let pd_len = self.pd_length();
        if pd_len > MAX_PRIVATE_DATA {
            return Err(Error::Malformed);
        }
        if p.buffer.as_ref().len() < FRAME_HEADER_LEN + pd_len {
            return Err(Error::Truncated);
        }
        p.set_key(self.kind.key());
        p.set_flags(self.flags());
        p.set_revision(self.revision);
        p.set_pd_length(pd_len as u16);
        let pd = p.private_data_mut();
        let rest = match self.ird_ord {
            Some(io) => {
                let (w, rest) = pd.split_at_mut(IRD_ORD_LEN);
                io.emit(&mut IrdOrdPacket::new_unchecked(w));
                rest
            }
            None => pd,
        };
        rest.copy_from_slice(self.private_data);
        Ok(())
    }

    /// Emit into a new vector.
    pub fn to_vec(&self) -> Result<Vec<u8>> {
        let mut v = vec![0u8; self.buffer_len()];
        self.emit(&mut FramePacket::new_unchecked(&mut v[..]))?;
        Ok(v)
    }
}

/// Zero-copy view of a complete FPDU.
#[derive(Debug, Clone)]
pub struct FpduPacket<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> FpduPacket<T> {
    /// Wrap without checks.
    pub fn new_unchecked(buffer: T) -> Self {
        FpduPacket { buffer }
    }
    /// Wrap, checking that length field, ULPDU, pad and CRC fit.
    pub fn new_checked(buffer: T) -> Result<Self> {
        let p = Self::new_unchecked(buffer);
        let len = p.buffer.as_ref().len();
        if len < MPA_HDR_LEN || len < p.total_len() {
            return Err(Error::Truncated);
        }
        Ok(p)
    }
    /// ULPDU_Length.
    pub fn ulpdu_len(&self) -> u16 {
        get_u16(self.buffer.as_ref(), 0)
    }
    /// Number of pad bytes.
    pub fn pad_len(&self) -> usize {
        pad_len(self.ulpdu_len() as usize)
    }
    /// Total FPDU length on the wire.
    pub fn total_len(&self) -> usize {
        fpdu_len(self.ulpdu_len() as usize)
    }
    /// The ULPDU (DDP segment).
    pub fn ulpdu(&self) -> &[u8] {
        &self.buffer.as_ref()[MPA_HDR_LEN..MPA_HDR_LEN + self.ulpdu_len() as usize]
    }
    /// The bytes covered by the CRC (length, ULPDU, pad).
    pub fn crc_covered(&self) -> &[u8] {
        &self.buffer.as_ref()[..self.total_len() - CRC_LEN]
    }
    /// The CRC field as transmitted (value of the little-endian bytes).
    pub fn crc(&self) -> u32 {
        let at = self.total_len() - CRC_LEN;
        let b = self.buffer.as_ref();
        u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
    }
    /// CRC32c of the covered bytes.
    pub fn compute_crc(&self) -> u32 {
        crc32c::crc32c(self.crc_covered())
    }
    /// Check the CRC field.
    pub fn verify_crc(&self) -> bool {
        self.crc() == self.compute_crc()
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> FpduPacket<T> {
    /// Set ULPDU_Length.
    pub fn set_ulpdu_len(&mut self, len: u16) {
        put_u16(self.buffer.as_mut(), 0, len)
    }
    /// Mutable ULPDU.
    pub fn ulpdu_mut(&mut self) -> &mut [u8] {
        let end = MPA_HDR_LEN + self.ulpdu_len() as usize;
        &mut self.buffer.as_mut()[MPA_HDR_LEN..end]
    }
    /// Zero the pad and write the CRC field (`crc = false` writes zero).
    pub fn fill_trailer(&mut self, crc: bool) {
        let end = MPA_HDR_LEN + self.ulpdu_len() as usize;
        let pad = self.pad_len();
        self.buffer.as_mut()[end..end + pad].fill(0);
        let v = if crc { self.compute_crc() } else { 0 };
        let at = self.total_len() - CRC_LEN;
        self.buffer.as_mut()[at..at + CRC_LEN].copy_from_slice(&v.to_le_bytes());
    }
}

/// Build a whole FPDU around `ulpdu` (for tests, Terminates, small
/// messages). Fails if `ulpdu` exceeds 65535 bytes.
pub fn build_fpdu(ulpdu: &[u8], crc: bool) -> Result<Vec<u8>> {
    if ulpdu.len() > MAX_ULPDU {
        return Err(Error::Malformed);
    }
    let mut v = vec![0u8; fpdu_len(ulpdu.len())];
    let mut p = FpduPacket::new_unchecked(&mut v[..]);
    p.set_ulpdu_len(ulpdu.len() as u16);
    p.ulpdu_mut().copy_from_slice(ulpdu);
    p.fill_trailer(crc);
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An MPA Request as siw sends it with its defaults (mpa_version 2,
    /// CRC off, no P2P, no GSO) for IRD=ORD=16 and 3 bytes of private data.
    const SIW_REQ: [u8; 27] = [
        b'M', b'P', b'A', b' ', b'I', b'D', b' ', b'R', b'e', b'q', b' ', b'F', b'r', b'a', b'm',
        b'e', // key
        0x10, 0x02, // E flag, Rev 2
        0x00, 0x07, // PD_Length = 4 + 3
        0x00, 0x10, 0x00, 0x10, // IRD 16, ORD 16
        0xaa, 0xbb, 0xcc,
    ];

    #[test]
    fn golden_siw_request() {
        let repr = FrameRepr {
            kind: FrameKind::Request,
            markers: false,
            crc: false,
            reject: false,
            gso: false,
            revision: 2,
            ird_ord: Some(IrdOrd {
                ird: 16,
                ord: 16,
                ..Default::default()
            }),
            private_data: &[0xaa, 0xbb, 0xcc],
        };
        assert_eq!(repr.to_vec().unwrap(), SIW_REQ);
        let p = FramePacket::new_checked(&SIW_REQ[..]).unwrap();
        assert_eq!(FrameRepr::parse(&p).unwrap(), repr);
    }

    #[test]
    fn golden_rev1_reply_reject_crc() {
        let mut b = Vec::from(&KEY_REP[..]);
        b.extend_from_slice(&[0x60, 0x01, 0x00, 0x02, 0x41, 0x42]);
        let p = FramePacket::new_checked(&b[..]).unwrap();
        let r = FrameRepr::parse(&p).unwrap();
        assert_eq!(r.kind, FrameKind::Reply);
        assert!(r.crc && r.reject && !r.markers);
        assert_eq!(r.revision, 1);
        assert_eq!(r.ird_ord, None);
        assert_eq!(r.private_data, b"AB");
        assert_eq!(r.to_vec().unwrap(), b);
    }

    #[test]
    fn p2p_words() {
        let io = IrdOrd {
            ird: 0x3fff,
            ord: 1,
            p2p: true,
            send_rtr: false,
            write_rtr: true,
            read_rtr: true,
        };
        assert_eq!(io.to_bytes(), [0xbf, 0xff, 0xc0, 0x01]);
        let back = IrdOrd::parse(&IrdOrdPacket::new_checked(&io.to_bytes()[..]).unwrap());
        assert_eq!(back.unwrap(), io);
    }

    #[test]
    fn frame_errors() {
        assert_eq!(
            FramePacket::new_checked(&KEY_REQ[..]).unwrap_err(),
            Error::Truncated
        );
        let mut b = Vec::from(&KEY_REQ[..]);
        b.extend_from_slice(&[0x00, 0x01, 0x00, 0x05, 1, 2]);
        assert_eq!(
            FramePacket::new_checked(&b[..]).unwrap_err(),
            Error::Truncated
        );
        let mut b = Vec::from(&b"MPA ID Xyz Frame"[..]);
        b.extend_from_slice(&[0x00, 0x01, 0x00, 0x00]);
        let p = FramePacket::new_checked(&b[..]).unwrap();
        assert_eq!(FrameRepr::parse(&p).unwrap_err(), Error::Malformed);
        let mut b = Vec::from(&KEY_REQ[..]);
        b.extend_from_slice(&[0x00, 0x03, 0x00, 0x00]);
        let p = FramePacket::new_checked(&b[..]).unwrap();
        assert_eq!(FrameRepr::parse(&p).unwrap_err(), Error::Version);
        // Enhanced flag without IRD/ORD words.
        let mut b = Vec::from(&KEY_REQ[..]);
        b.extend_from_slice(&[0x10, 0x02, 0x00, 0x02, 0, 0]);
        let p = FramePacket::new_checked(&b[..]).unwrap();
        assert_eq!(FrameRepr::parse(&p).unwrap_err(), Error::Malformed);
        // PD_Length over 512.
        let mut b = Vec::from(&KEY_REQ[..]);
        b.extend_from_slice(&[0x00, 0x01, 0x02, 0x01]);
        b.resize(20 + 513, 0);
        let p = FramePacket::new_checked(&b[..]).unwrap();
        assert_eq!(FrameRepr::parse(&p).unwrap_err(), Error::Malformed);
        let big = [0u8; 513];
        let r = FrameRepr {
            kind: FrameKind::Request,
            markers: false,
            crc: false,
            reject: false,
            gso: false,
            revision: 1,
            ird_ord: None,
            private_data: &big,
        };
        assert_eq!(r.to_vec().unwrap_err(), Error::Malformed);
    }

    #[test]
    fn pads() {
        assert_eq!(pad_len(0), 2);
        assert_eq!(pad_len(2), 0);
        assert_eq!(pad_len(14), 0);
        assert_eq!(pad_len(15), 3);
        assert_eq!(pad_len(18), 0);
        assert_eq!(pad_len(19), 3);
        assert_eq!(fpdu_len(18), 24);
    }

    #[test]
    fn crc_iscsi_vector() {
        // RFC 3720 B.4: 32 bytes of zeros -> CRC bytes aa 36 91 8a.
        assert_eq!(
            crc32c::crc32c(&[0u8; 32]).to_le_bytes(),
            [0xaa, 0x36, 0x91, 0x8a]
        );
    }

    #[test]
    fn fpdu_build_and_check() {
        let f = build_fpdu(&[1, 2, 3], true).unwrap();
        assert_eq!(f.len(), 2 + 3 + 3 + 4);
        assert_eq!(&f[..8], &[0, 3, 1, 2, 3, 0, 0, 0]);
        let p = FpduPacket::new_checked(&f[..]).unwrap();
        assert!(p.verify_crc());
        assert_eq!(p.ulpdu(), &[1, 2, 3]);
        let f0 = build_fpdu(&[1, 2, 3], false).unwrap();
        assert_eq!(&f0[8..], &[0, 0, 0, 0]);
        assert!(FpduPacket::new_checked(&f[..11]).is_err());
        assert!(FpduPacket::new_checked(&f[..1]).is_err());
    }
}
