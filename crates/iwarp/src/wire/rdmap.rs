//! RDMAP (RFC 5040): control field, opcodes, RDMA Read Request header,
//! Terminate header; and RFC 7306's Immediate Data message (opcodes 0x8,
//! 0x9: an untagged message on QN 0 whose payload is 8 bytes of data for
//! the receiver's completion; an RDMA Write with Immediate is an RDMA
//! Write followed by one). RFC 7306's atomic operations (0xa, 0xb) stay
//! reserved here, as in siw.
//!
//! ```text
//! RDMAP control field (first RsvdULP byte of the DDP header):
//! +-+-+-+-+-+-+-+-+
//! |RV |Rsv|OpCode |   RV = RDMAP version (01b)
//! +-+-+-+-+-+-+-+-+
//!
//! RDMA Read Request header (28 bytes, DDP payload of QN 1):
//! | Data Sink STag (32) | Data Sink Tagged Offset (64) |
//! | RDMA Read Message Size (32) | Data Source STag (32) |
//! | Data Source Tagged Offset (64) |
//!
//! Terminate header (DDP payload of QN 2):
//! | Layer | EType |  Error Code   |M|D|R|       Reserved          |
//! | DDP Segment Length (16)       | Terminated DDP header ...     ~
//! ~ Terminated RDMA header (Read Request only) ...                ~
//! ```
//! The DDP Segment Length and copied headers are present iff D or R is
//! set; M says the length is valid.

use super::ddp;
use super::term::{Layer, TermError};
use super::{get_u32, get_u64, put_u32, put_u64, Error, Result};

/// RDMAP version spoken here (RV field).
pub const RDMAP_VERSION: u8 = 1;
/// Length of the RDMA Read Request header.
pub const READ_REQUEST_LEN: usize = 28;
/// Length of the fixed Terminate word.
pub const TERMINATE_HDR_LEN: usize = 4;
/// Largest copied-header area (2-byte segment length + untagged DDP header
/// + Read Request header).
pub const TERMINATE_MAX_COPIED: usize = 2 + ddp::UNTAGGED_HDR_LEN + READ_REQUEST_LEN;

/// Untagged queue used by Send messages.
pub const QN_SEND: u32 = 0;
/// Untagged queue used by RDMA Read Requests.
pub const QN_READ_REQUEST: u32 = 1;
/// Untagged queue used by Terminate.
pub const QN_TERMINATE: u32 = 2;

/// RDMAP opcodes (RFC 5040 §4.3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Opcode {
    /// RDMA Write (tagged).
    Write = 0x0,
    /// RDMA Read Request (untagged, QN 1).
    ReadRequest = 0x1,
    /// RDMA Read Response (tagged).
    ReadResponse = 0x2,
    /// Send (QN 0).
    Send = 0x3,
    /// Send with Invalidate (QN 0).
    SendInvalidate = 0x4,
    /// Send with Solicited Event (QN 0).
    SendSe = 0x5,
    /// Send with Solicited Event and Invalidate (QN 0).
    SendSeInvalidate = 0x6,
    /// Terminate (QN 2).
    Terminate = 0x7,
    /// Immediate Data (RFC 7306; QN 0, 8-byte payload, consumes a receive).
    ImmediateData = 0x8,
    /// Immediate Data with Solicited Event (RFC 7306).
    ImmediateDataSe = 0x9,
}

/// Payload length of an Immediate Data message (RFC 7306).
pub const IMMEDIATE_DATA_LEN: u32 = 8;

impl Opcode {
    /// From the 4-bit field; `None` for reserved values (RFC 7306's
    /// atomic operations 0xa..=0xc included: not supported, like siw).
    pub fn from_raw(v: u8) -> Option<Opcode> {
        Some(match v & 0xf {
            0 => Opcode::Write,
            1 => Opcode::ReadRequest,
            2 => Opcode::ReadResponse,
            3 => Opcode::Send,
            4 => Opcode::SendInvalidate,
            5 => Opcode::SendSe,
            6 => Opcode::SendSeInvalidate,
            7 => Opcode::Terminate,
            8 => Opcode::ImmediateData,
            9 => Opcode::ImmediateDataSe,
            _ => return None,
        })
    }
    /// Whether the message uses the tagged buffer model.
    pub fn is_tagged(self) -> bool {
        matches!(self, Opcode::Write | Opcode::ReadResponse)
    }
    /// Whether this is one of the four Send variants.
    pub fn is_send(self) -> bool {
        matches!(
            self,
            Opcode::Send | Opcode::SendInvalidate | Opcode::SendSe | Opcode::SendSeInvalidate
        )
    }
    /// Whether a Send carries an Invalidate STag.
    pub fn is_invalidate(self) -> bool {
        matches!(self, Opcode::SendInvalidate | Opcode::SendSeInvalidate)
    }
    /// Whether a Send (or Immediate Data) requests a solicited event.
    pub fn is_solicited(self) -> bool {
        matches!(
            self,
            Opcode::SendSe | Opcode::SendSeInvalidate | Opcode::ImmediateDataSe
        )
    }
    /// Whether this is an Immediate Data message (RFC 7306).
    pub fn is_immediate(self) -> bool {
        matches!(self, Opcode::ImmediateData | Opcode::ImmediateDataSe)
    }
    /// Untagged queue number for untagged opcodes.
    pub fn queue(self) -> Option<u32> {
        match self {
            Opcode::Write | Opcode::ReadResponse => None,
            Opcode::ReadRequest => Some(QN_READ_REQUEST),
            Opcode::Terminate => Some(QN_TERMINATE),
            _ => Some(QN_SEND),
        }
    }
    /// Length of the RDMAP header that follows the DDP header.
    pub fn rdmap_hdr_len(self) -> usize {
        match self {
            Opcode::ReadRequest => READ_REQUEST_LEN,
            _ => 0,
        }
    }
}

/// Compose the RDMAP control byte (RV = 1).
pub fn control_byte(op: Opcode) -> u8 {
    (RDMAP_VERSION << 6) | op as u8
}
/// RV field of a control byte.
pub fn control_version(b: u8) -> u8 {
    b >> 6
}
/// Raw opcode field of a control byte.
pub fn control_opcode(b: u8) -> u8 {
    b & 0xf
}

/// Zero-copy view of an RDMA Read Request header.
#[derive(Debug, Clone)]
pub struct ReadRequestPacket<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> ReadRequestPacket<T> {
    /// Wrap without checks.
    pub fn new_unchecked(buffer: T) -> Self {
        ReadRequestPacket { buffer }
    }
    /// Wrap, checking for 28 bytes.
    pub fn new_checked(buffer: T) -> Result<Self> {
        if buffer.as_ref().len() < READ_REQUEST_LEN {
            return Err(Error::Truncated);
        }
        Ok(Self::new_unchecked(buffer))
    }
    /// Data Sink STag.
    pub fn sink_stag(&self) -> u32 {
        get_u32(self.buffer.as_ref(), 0)
    }
    /// Data Sink Tagged Offset.
    pub fn sink_to(&self) -> u64 {
        get_u64(self.buffer.as_ref(), 4)
    }
    /// RDMA Read Message Size.
    pub fn size(&self) -> u32 {
        get_u32(self.buffer.as_ref(), 12)
    }
    /// Data Source STag.
    pub fn src_stag(&self) -> u32 {
        get_u32(self.buffer.as_ref(), 16)
    }
    /// Data Source Tagged Offset.
    pub fn src_to(&self) -> u64 {
        get_u64(self.buffer.as_ref(), 20)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> ReadRequestPacket<T> {
    /// Set Data Sink STag.
    pub fn set_sink_stag(&mut self, v: u32) {
        put_u32(self.buffer.as_mut(), 0, v)
    }
    /// Set Data Sink TO.
    pub fn set_sink_to(&mut self, v: u64) {
        put_u64(self.buffer.as_mut(), 4, v)
    }
    /// Set RDMA Read Message Size.
    pub fn set_size(&mut self, v: u32) {
        put_u32(self.buffer.as_mut(), 12, v)
    }
    /// Set Data Source STag.
    pub fn set_src_stag(&mut self, v: u32) {
        put_u32(self.buffer.as_mut(), 16, v)
    }
    /// Set Data Source TO.
    pub fn set_src_to(&mut self, v: u64) {
        put_u64(self.buffer.as_mut(), 20, v)
    }
}

/// Parsed RDMA Read Request header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ReadRequest {
    /// Data Sink STag (requester's buffer, target of the Read Response).
    pub sink_stag: u32,
    /// Data Sink Tagged Offset.
    pub sink_to: u64,
    /// RDMA Read Message Size.
    pub size: u32,
    /// Data Source STag (responder's buffer).
    pub src_stag: u32,
    /// Data Source Tagged Offset.
    pub src_to: u64,
}

impl ReadRequest {
    /// Parse.
    pub fn parse<T: AsRef<[u8]>>(p: &ReadRequestPacket<T>) -> Result<ReadRequest> {
        if p.buffer.as_ref().len() < READ_REQUEST_LEN {
            return Err(Error::Truncated);
        }
        Ok(ReadRequest {
            sink_stag: p.sink_stag(),
            sink_to: p.sink_to(),
            size: p.size(),
            src_stag: p.src_stag(),
            src_to: p.src_to(),
        })
    }
    /// 28.
    pub const fn buffer_len(&self) -> usize {
        READ_REQUEST_LEN
    }
    /// Emit.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, p: &mut ReadRequestPacket<T>) {
        p.set_sink_stag(self.sink_stag);
        p.set_sink_to(self.sink_to);
        p.set_size(self.size);
        p.set_src_stag(self.src_stag);
        p.set_src_to(self.src_to);
    }
}

/// Zero-copy view of a Terminate header plus copied headers.
#[derive(Debug, Clone)]
pub struct TerminatePacket<T: AsRef<[u8]>> {
    buffer: T,
}

const M_FLAG: u8 = 0x80;
const D_FLAG: u8 = 0x40;
const R_FLAG: u8 = 0x20;

impl<T: AsRef<[u8]>> TerminatePacket<T> {
    /// Wrap without checks.
    pub fn new_unchecked(buffer: T) -> Self {
        TerminatePacket { buffer }
    }
    /// Wrap, checking the fixed word and, if D or R is set, the segment
    /// length field.
    pub fn new_checked(buffer: T) -> Result<Self> {
        let p = Self::new_unchecked(buffer);
        let len = p.buffer.as_ref().len();
        if len < TERMINATE_HDR_LEN {
            return Err(Error::Truncated);
        }
        if (p.flag_d() || p.flag_r()) && len < TERMINATE_HDR_LEN + 2 {
            return Err(Error::Truncated);
        }
        Ok(p)
    }
    fn b(&self) -> &[u8] {
        self.buffer.as_ref()
    }
    /// Layer (4 bits).
    pub fn layer(&self) -> u8 {
        self.b()[0] >> 4
    }
    /// Error type (4 bits).
    pub fn etype(&self) -> u8 {
        self.b()[0] & 0xf
    }
    /// Error code.
    pub fn ecode(&self) -> u8 {
        self.b()[1]
    }
    /// The error triple (layer, etype, ecode) of the fixed word.
    pub fn error(&self) -> TermError {
        TermError::new(Layer::from_raw(self.layer()), self.etype(), self.ecode())
    }
    /// M: DDP Segment Length valid.
    pub fn flag_m(&self) -> bool {
        self.b()[2] & M_FLAG != 0
    }
    /// D: terminated DDP header included.
    pub fn flag_d(&self) -> bool {
        self.b()[2] & D_FLAG != 0
    }
    /// R: terminated RDMA header included.
    pub fn flag_r(&self) -> bool {
        self.b()[2] & R_FLAG != 0
    }
    /// DDP Segment Length (present if D or R).
    pub fn ddp_segment_len(&self) -> u16 {
        super::get_u16(self.b(), 4)
    }
    /// Bytes after the DDP Segment Length (copied headers).
    pub fn copied(&self) -> &[u8] {
        self.b().get(6..).unwrap_or(&[])
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> TerminatePacket<T> {
    /// Set layer, etype, ecode.
    pub fn set_error(&mut self, layer: u8, etype: u8, ecode: u8) {
        let b = self.buffer.as_mut();
        b[0] = (layer << 4) | (etype & 0xf);
        b[1] = ecode;
    }
    /// Set M/D/R (reserved bits cleared).
    pub fn set_flags(&mut self, m: bool, d: bool, r: bool) {
        let b = self.buffer.as_mut();
        b[2] = if m { M_FLAG } else { 0 } | if d { D_FLAG } else { 0 } | if r { R_FLAG } else { 0 };
        b[3] = 0;
    }
    /// Set DDP Segment Length.
    pub fn set_ddp_segment_len(&mut self, v: u16) {
        super::put_u16(self.buffer.as_mut(), 4, v)
    }
}

/// The error triple of a received Terminate payload, `None` if the payload
/// is shorter than the fixed word. Only the fixed word is read: a peer's
/// flags and copied headers are not checked (a receiver that only reports
/// the error needs nothing else, and must not refuse a Terminate over them).
pub fn terminate_error(payload: &[u8]) -> Option<TermError> {
    if payload.len() < TERMINATE_HDR_LEN {
        return None;
    }
    Some(TerminatePacket::new_unchecked(payload).error())
}

/// Parsed Terminate message (header and copied headers).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TerminateRepr {
    /// The error being reported.
    pub error: TermError,
    /// M flag: `ddp_segment_len` is valid.
    pub flag_m: bool,
    /// D flag: a DDP header is copied.
    pub flag_d: bool,
    /// R flag: an RDMAP header is copied.
    pub flag_r: bool,
    /// Length of the offending DDP segment.
    pub ddp_segment_len: u16,
    copied: [u8; TERMINATE_MAX_COPIED - 2],
    copied_len: u8,
}

impl TerminateRepr {
    /// A Terminate without copied headers.
    pub fn new(error: TermError) -> TerminateRepr {
        TerminateRepr {
            error,
            flag_m: false,
            flag_d: false,
            flag_r: false,
            ddp_segment_len: 0,
            copied: [0; TERMINATE_MAX_COPIED - 2],
            copied_len: 0,
        }
    }

    /// A Terminate for `error` caused by the segment whose DDP header (and
    /// RDMAP Read Request header, if any) is `hdr`, of DDP segment length
    /// `seg_len` (= its ULPDU_Length). Chooses what to copy like siw:
    /// nothing for LLP, catastrophic and version/opcode errors; DDP header
    /// with M and D for DDP errors and RDMAP operation errors; DDP and RDMAP
    /// headers with M, D and R for RDMAP protection errors.
    pub fn for_segment(error: TermError, seg_len: u16, hdr: &[u8]) -> TerminateRepr {
        let mut t = TerminateRepr::new(error);
        if !error.header_reportable() || hdr.is_empty() {
            return t;
        }
        let ddp_len = if hdr[0] & 0x80 != 0 {
            ddp::TAGGED_HDR_LEN
        } else {
            ddp::UNTAGGED_HDR_LEN
        };
        let with_rdmap = error.layer == Layer::Rdmap
            && error.etype == super::term::rdmap_etype::REMOTE_PROTECTION;
        let want = if with_rdmap {
            let op = hdr.get(1).map(|b| control_opcode(*b));
            if op == Some(Opcode::ReadRequest as u8) {
                ddp_len + READ_REQUEST_LEN
            } else {
                ddp_len
            }
        } else {
            ddp_len
        };
        let n = want.min(hdr.len()).min(t.copied.len());
        t.copied[..n].copy_from_slice(&hdr[..n]);
        t.copied_len = n as u8;
        t.flag_m = true;
        t.flag_d = true;
        t.flag_r = with_rdmap;
        t.ddp_segment_len = seg_len;
        t
    }

    /// Copied header bytes (DDP header, then RDMAP header).
    pub fn copied(&self) -> &[u8] {
        &self.copied[..self.copied_len as usize]
    }

    /// The copied DDP header, parsed, if present and well-formed.
    pub fn copied_ddp(&self) -> Option<ddp::Repr> {
        if !self.flag_d {
            return None;
        }
        let p = ddp::Packet::new_checked(self.copied()).ok()?;
        ddp::Repr::parse(&p).ok()
    }

    /// The copied RDMA Read Request header, if present.
    pub fn copied_read_request(&self) -> Option<ReadRequest> {
        if !self.flag_r {
            return None;
        }
        let d = self.copied_ddp()?;
        if control_opcode(d.rsvd_ulp) != Opcode::ReadRequest as u8 {
            return None;
        }
        let rest = self.copied().get(d.buffer_len()..)?;
        ReadRequest::parse(&ReadRequestPacket::new_checked(rest).ok()?).ok()
    }

    /// Parse. Copied bytes beyond 46 are ignored (they cannot be valid).
    pub fn parse<T: AsRef<[u8]>>(p: &TerminatePacket<T>) -> Result<TerminateRepr> {
        let len = p.buffer.as_ref().len();
        if len < TERMINATE_HDR_LEN {
            return Err(Error::Truncated);
        }
        let mut t = TerminateRepr::new(p.error());
        t.flag_m = p.flag_m();
        t.flag_d = p.flag_d();
        t.flag_r = p.flag_r();
        if t.flag_d || t.flag_r {
            if len < TERMINATE_HDR_LEN + 2 {
                return Err(Error::Truncated);
            }
            t.ddp_segment_len = p.ddp_segment_len();
            let c = p.copied();
            let n = c.len().min(t.copied.len());
            t.copied[..n].copy_from_slice(&c[..n]);
            t.copied_len = n as u8;
        }
        Ok(t)
    }

    /// Bytes needed to emit.
    pub fn buffer_len(&self) -> usize {
        if self.flag_d || self.flag_r {
            TERMINATE_HDR_LEN + 2 + self.copied_len as usize
        } else {
            TERMINATE_HDR_LEN
        }
    }

    /// Emit into a buffer of at least `buffer_len()` bytes.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, p: &mut TerminatePacket<T>) {
        p.set_error(
            self.error.layer.to_raw(),
            self.error.etype,
            self.error.ecode,
        );
        p.set_flags(self.flag_m, self.flag_d, self.flag_r);
        if self.flag_d || self.flag_r {
            p.set_ddp_segment_len(self.ddp_segment_len);
            let n = self.copied_len as usize;
            p.buffer.as_mut()[6..6 + n].copy_from_slice(self.copied());
        }
    }

    /// Emit into a new vector.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = vec![0u8; self.buffer_len()];
        self.emit(&mut TerminatePacket::new_unchecked(&mut v[..]));
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::term::TermKind;

    #[test]
    fn opcodes() {
        for v in 0u8..16 {
            match Opcode::from_raw(v) {
                Some(op) => {
                    assert_eq!(op as u8, v);
                    assert_eq!(op.is_tagged(), op.queue().is_none());
                }
                None => assert!(v >= 10),
            }
        }
        assert_eq!(control_byte(Opcode::ImmediateData), 0x48);
        assert_eq!(Opcode::ImmediateDataSe.queue(), Some(QN_SEND));
        assert!(Opcode::ImmediateDataSe.is_solicited() && Opcode::ImmediateData.is_immediate());
        assert!(!Opcode::ImmediateData.is_send() && !Opcode::ImmediateData.is_solicited());
        assert_eq!(control_byte(Opcode::Send), 0x43);
        assert_eq!(control_byte(Opcode::Terminate), 0x47);
        assert_eq!(control_version(0x43), 1);
        assert_eq!(control_opcode(0x43), 3);
        assert!(Opcode::SendSeInvalidate.is_invalidate() && Opcode::SendSe.is_solicited());
    }

    #[test]
    fn golden_read_request() {
        let bytes = [
            0, 0, 0, 1, // sink stag
            0, 0, 0, 0, 0, 0, 0x10, 0, // sink to
            0, 0, 0x20, 0, // size 8192
            0xde, 0xad, 0xbe, 0xef, // src stag
            0, 0, 0, 1, 0, 0, 0, 0, // src to
        ];
        let r = ReadRequest::parse(&ReadRequestPacket::new_checked(&bytes[..]).unwrap()).unwrap();
        assert_eq!(
            r,
            ReadRequest {
                sink_stag: 1,
                sink_to: 0x1000,
                size: 8192,
                src_stag: 0xdead_beef,
                src_to: 1 << 32
            }
        );
        let mut out = [0u8; 28];
        r.emit(&mut ReadRequestPacket::new_unchecked(&mut out[..]));
        assert_eq!(out, bytes);
        assert!(ReadRequestPacket::new_checked(&bytes[..27]).is_err());
    }

    #[test]
    fn golden_terminate_crc() {
        let t = TerminateRepr::new(TermKind::MpaCrc.into());
        assert_eq!(t.to_vec(), [0x20, 0x02, 0x00, 0x00]);
        let back = TerminateRepr::parse(&TerminatePacket::new_checked(&t.to_vec()[..]).unwrap());
        assert_eq!(back.unwrap(), t);
    }

    #[test]
    fn golden_terminate_ddp_tagged() {
        // Invalid STag on an RDMA Write segment of length 0x40.
        let hdr = [0xc1, 0x40, 0, 0, 0, 9, 0, 0, 0, 0, 0, 0, 0, 0];
        let t = TerminateRepr::for_segment(TermKind::DdpTaggedInvalidStag.into(), 0x40, &hdr);
        let mut expect = vec![0x11, 0x00, 0xc0, 0x00, 0x00, 0x40];
        expect.extend_from_slice(&hdr);
        assert_eq!(t.to_vec(), expect);
        let back =
            TerminateRepr::parse(&TerminatePacket::new_checked(&expect[..]).unwrap()).unwrap();
        assert_eq!(back, t);
        assert_eq!(
            back.copied_ddp().unwrap().kind,
            ddp::Kind::Tagged { stag: 9, to: 0 }
        );
        assert_eq!(back.copied_read_request(), None);
    }

    #[test]
    fn terminate_rdmap_protection_read_request() {
        let mut hdr = vec![0x41, 0x41, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 0];
        let rr = ReadRequest {
            sink_stag: 5,
            sink_to: 6,
            size: 7,
            src_stag: 8,
            src_to: 9,
        };
        let mut b = [0u8; 28];
        rr.emit(&mut ReadRequestPacket::new_unchecked(&mut b[..]));
        hdr.extend_from_slice(&b);
        let t = TerminateRepr::for_segment(TermKind::RdmapProtInvalidStag.into(), 46, &hdr);
        assert!(t.flag_m && t.flag_d && t.flag_r);
        assert_eq!(t.buffer_len(), 4 + 2 + 46);
        let v = t.to_vec();
        assert_eq!(&v[..4], &[0x01, 0x00, 0xe0, 0x00]);
        let back = TerminateRepr::parse(&TerminatePacket::new_checked(&v[..]).unwrap()).unwrap();
        assert_eq!(back.copied_read_request(), Some(rr));
        // Version errors copy nothing.
        let t = TerminateRepr::for_segment(TermKind::RdmapOpInvalidVersion.into(), 46, &hdr);
        assert_eq!(t.buffer_len(), 4);
        let t = TerminateRepr::for_segment(TermKind::DdpUntaggedInvalidMo.into(), 46, &hdr);
        assert_eq!(t.buffer_len(), 4 + 2 + 18);
        assert!(!t.flag_r);
    }

    #[test]
    fn terminate_error_reads_the_fixed_word_only() {
        use crate::wire::ddp::Kind;
        use crate::wire::segment::SegmentHeader;
        let mut h = [0u8; ddp::TAGGED_HDR_LEN];
        SegmentHeader {
            opcode: Opcode::Write,
            last: true,
            ddp: Kind::Tagged {
                stag: 0x1234,
                to: 99,
            },
            read_request: None,
        }
        .emit(&mut h)
        .expect("tagged header");
        let t = TerminateRepr::for_segment(TermKind::DdpTaggedBaseBounds.into(), 100, &h);
        let out = t.to_vec();
        assert_eq!(out.len(), TERMINATE_HDR_LEN + 2 + ddp::TAGGED_HDR_LEN);
        assert_eq!(&out[6..], &h);
        assert_eq!(
            terminate_error(&out).and_then(|e| e.kind()),
            Some(TermKind::DdpTaggedBaseBounds)
        );
        // D set but the segment length cut off: the triple is still read.
        assert_eq!(
            terminate_error(&out[..4]).and_then(|e| e.kind()),
            Some(TermKind::DdpTaggedBaseBounds)
        );
        assert!(TerminatePacket::new_checked(&out[..4]).is_err());
        assert_eq!(terminate_error(&out[..3]), None);
        assert_eq!(terminate_error(&[]), None);
        // An undefined triple comes back raw.
        let e = terminate_error(&[0x3f, 0xee, 0, 0]).expect("four bytes");
        assert_eq!((e.layer.to_raw(), e.etype, e.ecode), (3, 0xf, 0xee));
        assert_eq!(e.kind(), None);
    }

    #[test]
    fn terminate_errors() {
        assert!(TerminatePacket::new_checked(&[0u8; 3][..]).is_err());
        assert!(TerminatePacket::new_checked(&[0, 0, 0x40, 0, 0][..]).is_err());
        let p = TerminatePacket::new_unchecked(&[0u8, 0, 0x40][..]);
        assert!(TerminateRepr::parse(&p).is_err());
    }
}
