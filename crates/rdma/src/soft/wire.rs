//! The soft provider's names for lwio-iwarp's data-path constants (header
//! lengths, queue numbers, RDMAP opcodes as the 4-bit field for matching),
//! the Terminate table (`TermKind`/`TermError`, lwio-iwarp's) and the
//! reading of a received Terminate's error triple. There is no wire
//! encoding here: connection setup uses `lwio_iwarp::mpa`, the receive
//! path `lwio_iwarp::fpdu_rx` and `rx`, and the transmit path emits every
//! FPDU header, pad and CRC with `lwio_iwarp::tx` (`emit_fpdu_header`,
//! `Trailer`) and takes its MSNs from `TxState` (see `qp.rs`).
//! `tests/iwarp_interop.rs` checks the streams against lwio-iwarp's
//! parsers, `soft::tests::transmit_bytes_match_golden` against the bytes
//! the provider sent before its transmit path moved into lwio-iwarp.

/// RFC 5044: PD_Length ≤ 512. (MPA frames themselves are handled by
/// `lwio_iwarp::mpa`.)
pub const MPA_MAX_PD: usize = lwio_iwarp::wire::mpa::MAX_PRIVATE_DATA;

use lwio_iwarp::wire::{ddp, rdmap};

pub const TAGGED_HDR: usize = ddp::TAGGED_HDR_LEN;
pub const UNTAGGED_HDR: usize = ddp::UNTAGGED_HDR_LEN;
pub const READ_REQ_LEN: usize = rdmap::READ_REQUEST_LEN;
/// Largest Terminate payload we accept (4 + 2 + 18 + 28 rounded up).
pub const TERM_MAX: usize = 64;
const _: () = assert!(TERM_MAX >= rdmap::TERMINATE_HDR_LEN + rdmap::TERMINATE_MAX_COPIED);

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

pub use lwio_iwarp::wire::term::{TermError, TermKind};

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
    fn terminate_roundtrip() {
        use lwio_iwarp::wire::ddp::Kind;
        use lwio_iwarp::wire::rdmap::{Opcode, TerminateRepr};
        use lwio_iwarp::wire::segment::SegmentHeader;
        let mut h = [0u8; TAGGED_HDR];
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
        assert_eq!(out.len(), 6 + TAGGED_HDR);
        assert_eq!(&out[6..], &h);
        assert_eq!(
            parse_terminate(&out).and_then(|e| e.kind()),
            Some(TermKind::DdpTaggedBaseBounds)
        );
        assert_eq!(parse_terminate(&out[..3]), None);
    }
}
