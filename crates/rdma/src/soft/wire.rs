//! The FPDU-level wire formats of the soft provider's data path (MPA
//! framing, DDP RFC 5041, RDMAP RFC 5040 headers and Terminate), written
//! straight into the engine's header arrays. Connection setup uses
//! `lwio_iwarp::mpa`; `tests/iwarp_interop.rs` checks these encodings
//! against `lwio-iwarp`'s independent parsers. The constants, opcodes and
//! the Terminate table (`TermKind`/`TermError`) are lwio-iwarp's: there is
//! one of each. (What is left here, header emission at fixed offsets and
//! the byte helpers, is to move into lwio-iwarp with the receive and
//! transmit engines: issue 11.)
//!
//! Layouts match Linux siw: the MPA CRC field is always present (zero when
//! CRC is off), the enhanced-mode flag is 0x10 of the flags byte, and a
//! Terminate carries `layer<<4|etype, ecode, M|D|R, 0`, the DDP segment
//! length and the copied headers.

/// RFC 5044: PD_Length ≤ 512. (MPA frames themselves are handled by
/// `lwio_iwarp::mpa`.)
pub const MPA_MAX_PD: usize = 512;

use lwio_iwarp::wire::{ddp, rdmap};

pub const TAGGED_HDR: usize = ddp::TAGGED_HDR_LEN;
pub const UNTAGGED_HDR: usize = ddp::UNTAGGED_HDR_LEN;
pub const READ_REQ_LEN: usize = rdmap::READ_REQUEST_LEN;
/// Largest Terminate payload we accept (4 + 2 + 18 + 28 rounded up).
pub const TERM_MAX: usize = 64;
const _: () = assert!(TERM_MAX >= rdmap::TERMINATE_HDR_LEN + rdmap::TERMINATE_MAX_COPIED);

pub const DDP_T: u8 = ddp::T_FLAG;
pub const DDP_L: u8 = ddp::L_FLAG;
pub const DDP_V1: u8 = ddp::DDP_VERSION;
pub const RDMAP_V1: u8 = rdmap::RDMAP_VERSION << 6;

pub const QN_SEND: u32 = rdmap::QN_SEND;
pub const QN_READ: u32 = rdmap::QN_READ_REQUEST;
pub const QN_TERM: u32 = rdmap::QN_TERMINATE;

/// RDMAP opcodes as the 4-bit field (for matching on the raw header).
pub mod op {
    use lwio_iwarp::wire::rdmap::Opcode;
    pub const WRITE: u8 = Opcode::Write as u8;
    pub const READ_REQ: u8 = Opcode::ReadRequest as u8;
    pub const READ_RESP: u8 = Opcode::ReadResponse as u8;
    pub const SEND: u8 = Opcode::Send as u8;
    pub const SEND_INV: u8 = Opcode::SendInvalidate as u8;
    pub const SEND_SE: u8 = Opcode::SendSe as u8;
    pub const SEND_SE_INV: u8 = Opcode::SendSeInvalidate as u8;
    pub const TERMINATE: u8 = Opcode::Terminate as u8;
}

/// Pad after a ULPDU of `ulpdu_len` bytes (len field + ULPDU + pad ≡ 0 mod 4).
pub const fn pad_len(ulpdu_len: usize) -> usize {
    (4 - ((2 + ulpdu_len) & 3)) & 3
}

pub use lwio_iwarp::wire::term::{TermError, TermKind};

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

/// The error triple of a received Terminate payload (only the fixed word
/// is needed: a peer's copied headers are not checked).
pub fn parse_terminate(p: &[u8]) -> Option<TermError> {
    use lwio_iwarp::wire::rdmap::{TerminatePacket, TERMINATE_HDR_LEN};
    use lwio_iwarp::wire::term::Layer;
    if p.len() < TERMINATE_HDR_LEN {
        return None;
    }
    let t = TerminatePacket::new_unchecked(p);
    Some(TermError::new(
        Layer::from_raw(t.layer()),
        t.etype(),
        t.ecode(),
    ))
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
        use lwio_iwarp::wire::rdmap::TerminateRepr;
        let mut h = [0u8; 16];
        tagged_hdr(&mut h, 100, true, op::WRITE, 0x1234, 99);
        let t = TerminateRepr::for_segment(TermKind::DdpTaggedBaseBounds.into(), 100, &h[2..]);
        let out = t.to_vec();
        assert_eq!(out.len(), 6 + TAGGED_HDR);
        assert_eq!(&out[6..], &h[2..]);
        assert_eq!(
            parse_terminate(&out).and_then(|e| e.kind()),
            Some(TermKind::DdpTaggedBaseBounds)
        );
        assert_eq!(parse_terminate(&out[..3]), None);
    }
}
