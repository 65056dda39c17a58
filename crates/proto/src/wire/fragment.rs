//! LWIO_FRAGMENT (16 bytes + data): one piece of a message larger than the
//! peer's receive buffer (docs/protocol.md §5.12), after SMB Direct's data
//! transfer message (MS-SMBD §2.2.3: DataOffset, DataLength,
//! RemainingDataLength).
//!
//! | off | size | field |
//! |----:|-----:|-------|
//! | 0   | 4    | DataLength (u32: data bytes after this header) |
//! | 4   | 1    | Opcode = 10 (FRAGMENT) |
//! | 5   | 1    | Flags: 0x01 FIRST, 0x02 LAST |
//! | 6   | 2    | Reserved, 0 |
//! | 8   | 4    | MessageOffset (u32: where the data goes in the message) |
//! | 12  | 4    | RemainingDataLength (u32: message bytes after this fragment) |
//! | 16  | n    | Data |

use super::{Error, Result};

/// Size of the fragment header.
pub const FRAGMENT_HEADER_LEN: usize = 16;
/// The opcode byte of a fragment (offset 4, where a request's opcode is).
pub const OPCODE_FRAGMENT: u8 = 10;

/// Fragment flag bits.
pub mod flags {
    pub const FIRST: u8 = 0x01;
    pub const LAST: u8 = 0x02;
}

mod field {
    use core::ops::Range;
    pub const DATA_LENGTH: Range<usize> = 0..4;
    pub const OPCODE: usize = 4;
    pub const FLAGS: usize = 5;
    pub const RESERVED: Range<usize> = 6..8;
    pub const OFFSET: Range<usize> = 8..12;
    pub const REMAINING: Range<usize> = 12..16;
}

fn u32_at(b: &[u8], r: core::ops::Range<usize>) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[r]);
    u32::from_le_bytes(a)
}

/// A zero-copy view of a fragment.
#[derive(Debug, Clone, Copy)]
pub struct FragmentPacket<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> FragmentPacket<T> {
    /// Check that the header and the DataLength bytes it announces are
    /// there (bytes after them are not part of the fragment).
    pub fn new_checked(buffer: T) -> Result<Self> {
        let b = buffer.as_ref();
        if b.len() < FRAGMENT_HEADER_LEN {
            return Err(Error::Truncated);
        }
        let n = u32_at(b, field::DATA_LENGTH) as usize;
        if b.len() - FRAGMENT_HEADER_LEN < n {
            return Err(Error::Truncated);
        }
        Ok(FragmentPacket { buffer })
    }

    pub fn data_length(&self) -> u32 {
        u32_at(self.buffer.as_ref(), field::DATA_LENGTH)
    }
    pub fn opcode(&self) -> u8 {
        self.buffer.as_ref()[field::OPCODE]
    }
    pub fn flags(&self) -> u8 {
        self.buffer.as_ref()[field::FLAGS]
    }
    pub fn reserved(&self) -> u16 {
        let b = self.buffer.as_ref();
        u16::from_le_bytes([b[field::RESERVED.start], b[field::RESERVED.start + 1]])
    }
    pub fn message_offset(&self) -> u32 {
        u32_at(self.buffer.as_ref(), field::OFFSET)
    }
    pub fn remaining(&self) -> u32 {
        u32_at(self.buffer.as_ref(), field::REMAINING)
    }
    /// The fragment's data.
    pub fn data(&self) -> &[u8] {
        let n = self.data_length() as usize;
        &self.buffer.as_ref()[FRAGMENT_HEADER_LEN..FRAGMENT_HEADER_LEN + n]
    }
}

/// A parsed fragment header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FragmentRepr {
    pub data_length: u32,
    pub first: bool,
    pub last: bool,
    pub message_offset: u32,
    pub remaining: u32,
}

impl FragmentRepr {
    /// Validate a fragment on its own: opcode, no unknown flags, reserved
    /// zero, some data, FIRST iff MessageOffset is 0, LAST iff nothing
    /// remains, and a message length that fits in u32.
    pub fn parse<T: AsRef<[u8]>>(p: &FragmentPacket<T>) -> Result<FragmentRepr> {
        let f = p.flags();
        let r = FragmentRepr {
            data_length: p.data_length(),
            first: f & flags::FIRST != 0,
            last: f & flags::LAST != 0,
            message_offset: p.message_offset(),
            remaining: p.remaining(),
        };
        if p.opcode() != OPCODE_FRAGMENT
            || f & !(flags::FIRST | flags::LAST) != 0
            || p.reserved() != 0
            || r.data_length == 0
            || r.first != (r.message_offset == 0)
            || r.last != (r.remaining == 0)
            || r.message_length().is_none()
        {
            return Err(Error::Malformed);
        }
        Ok(r)
    }

    /// Offset + DataLength + RemainingDataLength, if it fits in u32.
    pub fn message_length(&self) -> Option<u32> {
        self.message_offset
            .checked_add(self.data_length)?
            .checked_add(self.remaining)
    }

    pub fn buffer_len(&self) -> usize {
        FRAGMENT_HEADER_LEN
    }

    /// Write the 16-byte header (the data follows it, from the caller).
    pub fn emit(&self, out: &mut [u8]) {
        let out = &mut out[..FRAGMENT_HEADER_LEN];
        out[field::DATA_LENGTH].copy_from_slice(&self.data_length.to_le_bytes());
        out[field::OPCODE] = OPCODE_FRAGMENT;
        out[field::FLAGS] =
            if self.first { flags::FIRST } else { 0 } | if self.last { flags::LAST } else { 0 };
        out[field::RESERVED].fill(0);
        out[field::OFFSET].copy_from_slice(&self.message_offset.to_le_bytes());
        out[field::REMAINING].copy_from_slice(&self.remaining.to_le_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn golden_and_round_trip() {
        let r = FragmentRepr {
            data_length: 3,
            first: true,
            last: false,
            message_offset: 0,
            remaining: 0x0102_0304,
        };
        let mut b = [0u8; 19];
        r.emit(&mut b);
        b[16..].copy_from_slice(b"abc");
        assert_eq!(&b[..16], &[3, 0, 0, 0, 10, 1, 0, 0, 0, 0, 0, 0, 4, 3, 2, 1]);
        let p = FragmentPacket::new_checked(&b[..]).unwrap();
        assert_eq!(FragmentRepr::parse(&p).unwrap(), r);
        assert_eq!(p.data(), b"abc");
        assert!(
            FragmentPacket::new_checked(&b[..18]).is_err(),
            "truncated data"
        );
        assert!(
            FragmentPacket::new_checked(&b[..15]).is_err(),
            "truncated header"
        );
    }

    #[test]
    fn malformed_headers() {
        let ok = FragmentRepr {
            data_length: 1,
            first: false,
            last: true,
            message_offset: 5,
            remaining: 0,
        };
        let bad = |edit: &dyn Fn(&mut [u8; 17])| {
            let mut b = [0u8; 17];
            ok.emit(&mut b);
            edit(&mut b);
            FragmentRepr::parse(&FragmentPacket::new_checked(&b[..]).unwrap())
        };
        assert_eq!(bad(&|_| {}), Ok(ok));
        assert_eq!(bad(&|b| b[4] = 1), Err(Error::Malformed), "opcode");
        assert_eq!(bad(&|b| b[5] = 0x06), Err(Error::Malformed), "unknown flag");
        assert_eq!(bad(&|b| b[6] = 1), Err(Error::Malformed), "reserved");
        assert_eq!(
            bad(&|b| b[5] = 0x03),
            Err(Error::Malformed),
            "FIRST at offset 5"
        );
        assert_eq!(
            bad(&|b| b[5] = 0),
            Err(Error::Malformed),
            "not LAST with 0 left"
        );
        assert_eq!(
            bad(&|b| b[12] = 1),
            Err(Error::Malformed),
            "LAST with bytes left"
        );
        assert_eq!(
            bad(&|b| b[8..12].copy_from_slice(&u32::MAX.to_le_bytes())),
            Err(Error::Malformed),
            "length overflows u32"
        );
        let mut z = [0u8; 16];
        FragmentRepr {
            data_length: 0,
            ..ok
        }
        .emit(&mut z);
        assert_eq!(
            FragmentRepr::parse(&FragmentPacket::new_checked(&z[..]).unwrap()),
            Err(Error::Malformed),
            "empty fragment"
        );
    }
}
