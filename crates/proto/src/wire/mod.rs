//! Zero-copy views (`Packet<T>`) and parsed representations (`Repr`) of every
//! LWIO structure, laid out as documented in `docs/protocol.md`.
//!
//! Style follows smoltcp: `Packet::new_checked` validates lengths and never
//! panics; getters on a checked packet never panic; `Repr::parse` validates
//! semantics; `Repr::emit` writes into a buffer of at least `buffer_len()`
//! bytes.

use core::fmt;

pub mod auth;
pub mod common;
pub mod control;
pub mod fragment;
pub mod resume;
pub mod small;

pub use auth::{AuthOption, AuthParamsPacket, AuthParamsRepr, SignatureAlg};
pub use common::{Flags, HeaderPacket, HeaderRepr, Opcode, RequestPacket, RequestRepr};
pub use control::{
    AddressBlockRepr, ControlHeaderPacket, ControlHeaderRepr, NegotiateRequestRepr,
    NegotiateResponseRepr, NetAddressRepr,
};
pub use resume::{RequestResumeKeyPacket, RequestResumeKeyRepr, ResumeKeyPacket, SrvResumeKey};
pub use small::{
    FidParamsPacket, FidParamsRepr, IoStatusBlock, IoStatusBlockPacket, RdmaRegion,
    RdmaRegionPacket, StatusResponse, StatusResponsePacket,
};

/// Protocol id / magic: ASCII `LWIO`.
pub const LWIO_MAGIC: [u8; 4] = *b"LWIO";
/// LWIO_REV_ID.
pub const LWIO_REV_ID: u16 = 0x1001;
/// LWIO_CONTROL_OPCODE_NEGOTIATE.
pub const LWIO_CONTROL_OPCODE_NEGOTIATE: u16 = 0xfe;
/// LWIO_MAX_HOST_NAME in WCHARs.
pub const LWIO_MAX_HOST_NAME: usize = 64;
/// LWIO_MAX_PROVIDER_NAME in WCHARs.
pub const LWIO_MAX_PROVIDER_NAME: usize = 32;
/// Size of LWIO_COMMON_HEADER.
pub const COMMON_HEADER_LEN: usize = 56;
/// Size of LWIO_CONTROL_HEADER.
pub const CONTROL_HEADER_LEN: usize = 12;
/// FILE_NO_INTERMEDIATE_BUFFERING create flag.
pub const FILE_NO_INTERMEDIATE_BUFFERING: u32 = 0x8;

/// Wire parsing error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Error {
    /// The buffer is shorter than the structure requires.
    Truncated,
    /// A field has a value the protocol does not allow.
    Malformed,
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Truncated => f.write_str("truncated LWIO structure"),
            Error::Malformed => f.write_str("malformed LWIO structure"),
        }
    }
}

impl std::error::Error for Error {}

/// Result alias for wire operations.
pub type Result<T> = core::result::Result<T, Error>;

/// A GUID/UUID: Data1 u32 LE, Data2 u16 LE, Data3 u16 LE, Data4 raw bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, PartialOrd, Ord)]
pub struct Guid {
    pub data1: u32,
    pub data2: u16,
    pub data3: u16,
    pub data4: [u8; 8],
}

impl Guid {
    pub const LEN: usize = 16;

    /// Parse 16 wire bytes. Returns `None` if `b` is shorter than 16.
    pub fn from_bytes(b: &[u8]) -> Option<Guid> {
        let b = b.get(..16)?;
        let mut data4 = [0u8; 8];
        data4.copy_from_slice(&b[8..16]);
        Some(Guid {
            data1: u32::from_le_bytes([b[0], b[1], b[2], b[3]]),
            data2: u16::from_le_bytes([b[4], b[5]]),
            data3: u16::from_le_bytes([b[6], b[7]]),
            data4,
        })
    }

    /// The 16 wire bytes.
    pub fn to_bytes(&self) -> [u8; 16] {
        let mut out = [0u8; 16];
        out[0..4].copy_from_slice(&self.data1.to_le_bytes());
        out[4..6].copy_from_slice(&self.data2.to_le_bytes());
        out[6..8].copy_from_slice(&self.data3.to_le_bytes());
        out[8..16].copy_from_slice(&self.data4);
        out
    }

    /// Build from a u128 in canonical textual order
    /// (`0x00112233_4455_6677_8899aabbccddeeff`).
    pub const fn from_u128(v: u128) -> Guid {
        let b = v.to_be_bytes();
        Guid {
            data1: u32::from_be_bytes([b[0], b[1], b[2], b[3]]),
            data2: u16::from_be_bytes([b[4], b[5]]),
            data3: u16::from_be_bytes([b[6], b[7]]),
            data4: [b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]],
        }
    }
}

impl fmt::Display for Guid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let d = &self.data4;
        write!(
            f,
            "{:08x}-{:04x}-{:04x}-{:02x}{:02x}-{:02x}{:02x}{:02x}{:02x}{:02x}{:02x}",
            self.data1, self.data2, self.data3, d[0], d[1], d[2], d[3], d[4], d[5], d[6], d[7]
        )
    }
}

// ---- little-endian helpers. Callers guarantee bounds (checked packets). ----

pub(crate) fn rd16(b: &[u8], off: usize) -> u16 {
    u16::from_le_bytes([b[off], b[off + 1]])
}
pub(crate) fn rd32(b: &[u8], off: usize) -> u32 {
    u32::from_le_bytes([b[off], b[off + 1], b[off + 2], b[off + 3]])
}
pub(crate) fn rd64(b: &[u8], off: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[off..off + 8]);
    u64::from_le_bytes(a)
}
pub(crate) fn wr16(b: &mut [u8], off: usize, v: u16) {
    b[off..off + 2].copy_from_slice(&v.to_le_bytes());
}
pub(crate) fn wr32(b: &mut [u8], off: usize, v: u32) {
    b[off..off + 4].copy_from_slice(&v.to_le_bytes());
}
pub(crate) fn wr64(b: &mut [u8], off: usize, v: u64) {
    b[off..off + 8].copy_from_slice(&v.to_le_bytes());
}

/// Decode a fixed-size NUL-padded UTF-16LE field (`bytes.len()` even).
/// Stops at the first NUL. Invalid UTF-16 is replaced (lossy).
pub fn decode_wchar_field(bytes: &[u8]) -> String {
    let units: Vec<u16> = bytes
        .chunks_exact(2)
        .map(|c| u16::from_le_bytes([c[0], c[1]]))
        .take_while(|&u| u != 0)
        .collect();
    String::from_utf16_lossy(&units)
}

/// Encode `s` into a fixed-size WCHAR field of `field.len() / 2` units,
/// NUL padded. Fails if `s` needs more than `units - 1` code units or
/// contains NUL.
pub fn encode_wchar_field(s: &str, field: &mut [u8]) -> Result<()> {
    let units: Vec<u16> = s.encode_utf16().collect();
    if units.len() >= field.len() / 2 || units.contains(&0) {
        return Err(Error::Malformed);
    }
    field.fill(0);
    for (i, u) in units.iter().enumerate() {
        field[2 * i..2 * i + 2].copy_from_slice(&u.to_le_bytes());
    }
    Ok(())
}

/// Check that `s` fits a WCHAR[units] field.
pub fn wchar_fits(s: &str, units: usize) -> bool {
    let n = s.encode_utf16().count();
    n < units && !s.contains('\0')
}

#[cfg(test)]
pub(crate) fn hex(s: &str) -> Vec<u8> {
    let clean: String = s.chars().filter(|c| c.is_ascii_hexdigit()).collect();
    (0..clean.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&clean[i..i + 2], 16).unwrap())
        .collect()
}

#[cfg(test)]
mod tests;
