//! The FPDU-level wire formats of the soft provider's data path (MPA
//! framing, DDP RFC 5041, RDMAP RFC 5040 headers and Terminate), written
//! straight into the engine's header arrays. Connection setup uses
//! `lwio_iwarp::mpa`; `tests/iwarp_interop.rs` checks these encodings
//! against `lwio-iwarp`'s independent parsers.
//!
//! Layouts match Linux siw: the MPA CRC field is always present (zero when
//! CRC is off), the enhanced-mode flag is 0x10 of the flags byte, and a
//! Terminate carries `layer<<4|etype, ecode, M|D|R, 0`, the DDP segment
//! length and the copied headers.

/// RFC 5044: PD_Length ≤ 512. (MPA frames themselves are handled by
/// `lwio_iwarp::mpa`.)
pub const MPA_MAX_PD: usize = 512;

pub const TAGGED_HDR: usize = 14;
pub const UNTAGGED_HDR: usize = 18;
pub const READ_REQ_LEN: usize = 28;
/// Largest Terminate payload we accept (4 + 2 + 18 + 28 rounded up).
pub const TERM_MAX: usize = 64;

pub const DDP_T: u8 = 0x80;
pub const DDP_L: u8 = 0x40;
pub const DDP_V1: u8 = 0x01;
pub const RDMAP_V1: u8 = 0x40;

pub const QN_SEND: u32 = 0;
pub const QN_READ: u32 = 1;
pub const QN_TERM: u32 = 2;

/// RDMAP opcodes.
pub mod op {
    pub const WRITE: u8 = 0;
    pub const READ_REQ: u8 = 1;
    pub const READ_RESP: u8 = 2;
    pub const SEND: u8 = 3;
    pub const SEND_INV: u8 = 4;
    pub const SEND_SE: u8 = 5;
    pub const SEND_SE_INV: u8 = 6;
    pub const TERMINATE: u8 = 7;
}

/// Pad after a ULPDU of `ulpdu_len` bytes (len field + ULPDU + pad ≡ 0 mod 4).
pub const fn pad_len(ulpdu_len: usize) -> usize {
    (4 - ((2 + ulpdu_len) & 3)) & 3
}

/// A Terminate error triple (RFC 5040 §7).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TermCode {
    pub layer: u8,
    pub etype: u8,
    pub ecode: u8,
}

impl TermCode {
    pub const fn new(layer: u8, etype: u8, ecode: u8) -> TermCode {
        TermCode {
            layer,
            etype,
            ecode,
        }
    }
    /// `layer << 12 | etype << 8 | ecode`, as in `Wc::vendor_err`.
    pub fn vendor_err(self) -> u32 {
        ((self.layer as u32 & 0xf) << 12) | ((self.etype as u32 & 0xf) << 8) | self.ecode as u32
    }
    /// Is this a protection error (RDMAP remote protection / DDP tagged buffer)?
    pub fn is_protection(self) -> bool {
        (self.layer == 0 || self.layer == 1) && self.etype == 1
    }
}

/// Named Terminate codes used by the soft provider.
pub mod term {
    use super::TermCode;
    pub const RDMAP_INVALID_STAG: TermCode = TermCode::new(0, 1, 0x00);
    pub const RDMAP_BASE_BOUNDS: TermCode = TermCode::new(0, 1, 0x01);
    pub const RDMAP_ACCESS: TermCode = TermCode::new(0, 1, 0x02);
    pub const RDMAP_NOT_ASSOC: TermCode = TermCode::new(0, 1, 0x03);
    pub const RDMAP_OP_VERSION: TermCode = TermCode::new(0, 2, 0x05);
    pub const RDMAP_OP_OPCODE: TermCode = TermCode::new(0, 2, 0x06);
    pub const RDMAP_OP_CANNOT_INVALIDATE: TermCode = TermCode::new(0, 2, 0x09);
    pub const RDMAP_OP_UNSPECIFIED: TermCode = TermCode::new(0, 2, 0xff);
    pub const DDP_T_INVALID_STAG: TermCode = TermCode::new(1, 1, 0x00);
    pub const DDP_T_BASE_BOUNDS: TermCode = TermCode::new(1, 1, 0x01);
    pub const DDP_T_NOT_ASSOC: TermCode = TermCode::new(1, 1, 0x02);
    pub const DDP_T_VERSION: TermCode = TermCode::new(1, 1, 0x04);
    pub const DDP_UT_INVALID_QN: TermCode = TermCode::new(1, 2, 0x01);
    pub const DDP_UT_MSN_RANGE: TermCode = TermCode::new(1, 2, 0x03);
    pub const DDP_UT_INVALID_MO: TermCode = TermCode::new(1, 2, 0x04);
    pub const DDP_UT_TOO_LONG: TermCode = TermCode::new(1, 2, 0x05);
    pub const DDP_UT_VERSION: TermCode = TermCode::new(1, 2, 0x06);
    pub const MPA_CRC: TermCode = TermCode::new(2, 0, 0x02);
    pub const MPA_INSUFFICIENT_IRD: TermCode = TermCode::new(2, 0, 0x06);
}

pub fn be16(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([b[at], b[at + 1]])
}
pub fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}
pub fn be64(b: &[u8], at: usize) -> u64 {
    ((be32(b, at) as u64) << 32) | be32(b, at + 4) as u64
}
pub fn put16(b: &mut [u8], at: usize, v: u16) {
    b[at..at + 2].copy_from_slice(&v.to_be_bytes())
}
pub fn put32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_be_bytes())
}
pub fn put64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_be_bytes())
}

/// Write an MPA length + tagged DDP header into `b[..16]`; returns 16.
pub fn tagged_hdr(
    b: &mut [u8],
    ulpdu_len: u16,
    last: bool,
    opcode: u8,
    stag: u32,
    to: u64,
) -> usize {
    put16(b, 0, ulpdu_len);
    b[2] = DDP_T | if last { DDP_L } else { 0 } | DDP_V1;
    b[3] = RDMAP_V1 | opcode;
    put32(b, 4, stag);
    put64(b, 8, to);
    2 + TAGGED_HDR
}

/// Write an MPA length + untagged DDP header into `b[..20]`; returns 20.
#[allow(clippy::too_many_arguments)]
pub fn untagged_hdr(
    b: &mut [u8],
    ulpdu_len: u16,
    last: bool,
    opcode: u8,
    inv_stag: u32,
    qn: u32,
    msn: u32,
    mo: u32,
) -> usize {
    put16(b, 0, ulpdu_len);
    b[2] = if last { DDP_L } else { 0 } | DDP_V1;
    b[3] = RDMAP_V1 | opcode;
    put32(b, 4, inv_stag);
    put32(b, 8, qn);
    put32(b, 12, msn);
    put32(b, 16, mo);
    2 + UNTAGGED_HDR
}

/// An RDMA Read Request header (the DDP payload of QN 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadReq {
    pub sink_stag: u32,
    pub sink_to: u64,
    pub len: u32,
    pub src_stag: u32,
    pub src_to: u64,
}

impl ReadReq {
    pub fn emit(&self, b: &mut [u8]) {
        put32(b, 0, self.sink_stag);
        put64(b, 4, self.sink_to);
        put32(b, 12, self.len);
        put32(b, 16, self.src_stag);
        put64(b, 20, self.src_to);
    }
    pub fn parse(b: &[u8]) -> ReadReq {
        ReadReq {
            sink_stag: be32(b, 0),
            sink_to: be64(b, 4),
            len: be32(b, 12),
            src_stag: be32(b, 16),
            src_to: be64(b, 20),
        }
    }
}

/// Build a Terminate payload for `code` caused by the segment whose MPA
/// length + DDP (+ Read Request) header is `hdr` (may be empty). Returns the
/// payload length written into `out` (≤ TERM_MAX). Which headers are copied
/// follows siw (`lwio_iwarp::wire::rdmap::TerminateRepr::for_segment`).
pub fn terminate_payload(code: TermCode, hdr: &[u8], out: &mut [u8; TERM_MAX]) -> usize {
    use lwio_iwarp::wire::rdmap::TerminateRepr;
    use lwio_iwarp::wire::term::{Layer, TermError};
    out.fill(0);
    let err = TermError::new(Layer::from_raw(code.layer), code.etype, code.ecode);
    let t = if hdr.len() >= 2 + TAGGED_HDR {
        TerminateRepr::for_segment(err, be16(hdr, 0), &hdr[2..])
    } else {
        TerminateRepr::new(err)
    };
    let v = t.to_vec();
    let n = v.len().min(TERM_MAX);
    out[..n].copy_from_slice(&v[..n]);
    n
}

/// The error triple of a received Terminate payload.
pub fn parse_terminate(p: &[u8]) -> Option<TermCode> {
    if p.len() < 4 {
        return None;
    }
    Some(TermCode::new(p[0] >> 4, p[0] & 0xf, p[1]))
}

/// CRC32c over a sequence of byte slices (MPA CRC; sent as a little-endian
/// word like Linux does).
pub fn crc_of(parts: &[&[u8]]) -> u32 {
    let mut c = 0u32;
    for p in parts {
        c = crc32c::crc32c_append(c, p);
    }
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pad() {
        assert_eq!(pad_len(14), 0);
        assert_eq!(pad_len(15), 3);
        assert_eq!(pad_len(18), 0);
        assert_eq!(pad_len(19), 3);
    }

    #[test]
    fn terminate_roundtrip() {
        let mut h = [0u8; 16];
        tagged_hdr(&mut h, 100, true, op::WRITE, 0x1234, 99);
        let mut out = [0u8; TERM_MAX];
        let n = terminate_payload(term::DDP_T_BASE_BOUNDS, &h, &mut out);
        assert_eq!(n, 6 + TAGGED_HDR);
        assert_eq!(parse_terminate(&out[..n]), Some(term::DDP_T_BASE_BOUNDS));
        assert_eq!(term::DDP_T_BASE_BOUNDS.vendor_err(), 0x1101);
    }
}
