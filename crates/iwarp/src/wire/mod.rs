//! Zero-copy wire formats, in the style of smoltcp.
//!
//! Every header has a `Packet<T: AsRef<[u8]>>` view with `new_unchecked`,
//! `new_checked` (length checks; never panics on any input), field getters
//! and (for `T: AsMut<[u8]>`) setters, plus a parsed `Repr` with
//! `parse(&Packet) -> Result<Repr>`, `buffer_len()` and `emit(&mut Packet)`.
//!
//! Byte offsets below are relative to the start of the structure each view
//! wraps, which is *not* always the start of the TCP payload:
//!
//! * [`mpa::FramePacket`]: MPA Request/Reply frame (connection setup).
//! * [`mpa::IrdOrdPacket`]: RFC 6581 IRD/ORD + P2P/RTR control words.
//! * [`mpa::FpduPacket`]: a whole FPDU (ULPDU_Length, ULPDU, pad, CRC).
//! * [`ddp::Packet`]: the DDP header (starts right after ULPDU_Length).
//! * [`rdmap::ReadRequestPacket`]: the 28-byte RDMA Read Request header.
//! * [`rdmap::TerminatePacket`]: the Terminate header and copied headers.
//! * [`segment::SegmentHeader`]: DDP + RDMAP headers of one segment as a
//!   single `Repr`, used by the receiver and the segmenter.

pub mod ddp;
pub mod mpa;
pub mod rdmap;
pub mod segment;
pub mod term;

/// Wire parsing error.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// The buffer is shorter than the structure (or a length field in it).
    #[error("truncated buffer")]
    Truncated,
    /// A field holds a value this implementation does not accept.
    #[error("malformed field")]
    Malformed,
    /// Unsupported protocol version (DDP, RDMAP or MPA revision).
    #[error("unsupported version")]
    Version,
}

/// Result alias for wire parsing.
pub type Result<T> = core::result::Result<T, Error>;

#[inline]
pub(crate) fn get_u16(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([b[at], b[at + 1]])
}
#[inline]
pub(crate) fn get_u32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}
#[inline]
pub(crate) fn get_u64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_be_bytes(a)
}
#[inline]
pub(crate) fn put_u16(b: &mut [u8], at: usize, v: u16) {
    b[at..at + 2].copy_from_slice(&v.to_be_bytes());
}
#[inline]
pub(crate) fn put_u32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_be_bytes());
}
#[inline]
pub(crate) fn put_u64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_be_bytes());
}
