//! Fixed-size structures: LWIO_FID_PARAMS, LWIO_MSG_STATUS_RESPONSE,
//! LWIO_IO_STATUS_BLOCK, LWIO_RDMA_REGION.

use super::resume::{ResumeKeyPacket, SrvResumeKey, RESUME_KEY_LEN};
use super::{rd32, rd64, wr32, wr64, Error, Result};

macro_rules! fixed_packet {
    ($name:ident, $len:expr, $doc:expr) => {
        #[doc = $doc]
        #[derive(Debug, Clone)]
        pub struct $name<T: AsRef<[u8]>> {
            buffer: T,
        }
        impl<T: AsRef<[u8]>> $name<T> {
            /// Size of the structure on the wire.
            pub const LEN: usize = $len;
            pub fn new_unchecked(buffer: T) -> Self {
                $name { buffer }
            }
            pub fn new_checked(buffer: T) -> Result<Self> {
                let p = Self::new_unchecked(buffer);
                p.check_len()?;
                Ok(p)
            }
            pub fn check_len(&self) -> Result<()> {
                if self.buffer.as_ref().len() < $len {
                    Err(Error::Truncated)
                } else {
                    Ok(())
                }
            }
            pub fn into_inner(self) -> T {
                self.buffer
            }
        }
    };
}
pub(crate) use fixed_packet;

// ----------------------------------------------------------------- FID params

/// Size of LWIO_FID_PARAMS.
pub const FID_PARAMS_LEN: usize = 40;

fixed_packet!(
    FidParamsPacket,
    FID_PARAMS_LEN,
    "Zero-copy view of LWIO_FID_PARAMS (40 bytes)."
);

impl<T: AsRef<[u8]>> FidParamsPacket<T> {
    pub fn resume_key(&self) -> ResumeKeyPacket<&[u8]> {
        ResumeKeyPacket::new_unchecked(&self.buffer.as_ref()[..RESUME_KEY_LEN])
    }
    pub fn session_id(&self) -> u64 {
        rd64(self.buffer.as_ref(), 24)
    }
    pub fn flags_and_attributes(&self) -> u32 {
        rd32(self.buffer.as_ref(), 32)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> FidParamsPacket<T> {
    pub fn resume_key_mut(&mut self) -> ResumeKeyPacket<&mut [u8]> {
        ResumeKeyPacket::new_unchecked(&mut self.buffer.as_mut()[..RESUME_KEY_LEN])
    }
    pub fn set_session_id(&mut self, v: u64) {
        wr64(self.buffer.as_mut(), 24, v)
    }
    pub fn set_flags_and_attributes(&mut self, v: u32) {
        wr32(self.buffer.as_mut(), 32, v)
    }
    pub fn clear_padding(&mut self) {
        wr32(self.buffer.as_mut(), 36, 0)
    }
}

/// Parsed LWIO_FID_PARAMS.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FidParamsRepr {
    pub resume_key: SrvResumeKey,
    pub session_id: u64,
    pub flags_and_attributes: u32,
}

impl FidParamsRepr {
    pub fn parse<T: AsRef<[u8]>>(p: &FidParamsPacket<T>) -> Result<Self> {
        p.check_len()?;
        Ok(FidParamsRepr {
            resume_key: SrvResumeKey::parse(&p.resume_key())?,
            session_id: p.session_id(),
            flags_and_attributes: p.flags_and_attributes(),
        })
    }
    pub const fn buffer_len(&self) -> usize {
        FID_PARAMS_LEN
    }
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, p: &mut FidParamsPacket<T>) {
        self.resume_key.emit(&mut p.resume_key_mut());
        p.set_session_id(self.session_id);
        p.set_flags_and_attributes(self.flags_and_attributes);
        p.clear_padding();
    }
}

// ------------------------------------------------------------ IO status block

/// Size of LWIO_IO_STATUS_BLOCK.
pub const IO_STATUS_BLOCK_LEN: usize = 8;

/// What a client writes into a polled status block before the request that
/// the server completes there: every byte 0xFF (docs/protocol.md §4.1).
pub const POLL_SENTINEL: u64 = u64::MAX;

/// Whether a polled status block, loaded as one little-endian u64, has been
/// written completely by the server.
///
/// RDMA does not make an 8-byte placement atomic: siw places a WRITE as TCP
/// delivers it, so a block split across two segments is half new, half
/// sentinel for a moment (seen in CI: Status 0x00000100, the low byte of
/// STATUS_SUCCESS under the upper bytes of the old sentinel 0x00000103).
/// Providers place a message's bytes in increasing address order, so the
/// block is whole once its last byte, the top byte of Status, is no longer
/// the sentinel's 0xFF. No server completes with a Status whose top byte is
/// 0xFF (severity 3 with facility 0xFxx is not an NTSTATUS anyone issues, and
/// the server's `normalize` never emits one).
pub fn poll_block_written(v: u64) -> bool {
    (v >> 56) as u8 != 0xFF
}

fixed_packet!(
    IoStatusBlockPacket,
    IO_STATUS_BLOCK_LEN,
    "Zero-copy view of LWIO_IO_STATUS_BLOCK (8 bytes)."
);

impl<T: AsRef<[u8]>> IoStatusBlockPacket<T> {
    pub fn information(&self) -> u32 {
        rd32(self.buffer.as_ref(), 0)
    }
    pub fn status(&self) -> u32 {
        rd32(self.buffer.as_ref(), 4)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> IoStatusBlockPacket<T> {
    pub fn set_information(&mut self, v: u32) {
        wr32(self.buffer.as_mut(), 0, v)
    }
    pub fn set_status(&mut self, v: u32) {
        wr32(self.buffer.as_mut(), 4, v)
    }
}

/// Parsed LWIO_IO_STATUS_BLOCK.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct IoStatusBlock {
    pub information: u32,
    pub status: u32,
}

impl IoStatusBlock {
    /// The polled-status "not yet written" sentinel: every byte 0xFF
    /// ([`POLL_SENTINEL`]).
    pub const SENTINEL: IoStatusBlock = IoStatusBlock {
        information: u32::MAX,
        status: u32::MAX,
    };

    pub fn parse<T: AsRef<[u8]>>(p: &IoStatusBlockPacket<T>) -> Result<Self> {
        p.check_len()?;
        Ok(IoStatusBlock {
            information: p.information(),
            status: p.status(),
        })
    }
    pub const fn buffer_len(&self) -> usize {
        IO_STATUS_BLOCK_LEN
    }
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, p: &mut IoStatusBlockPacket<T>) {
        p.set_information(self.information);
        p.set_status(self.status);
    }
    pub fn to_bytes(&self) -> [u8; IO_STATUS_BLOCK_LEN] {
        let mut b = [0u8; IO_STATUS_BLOCK_LEN];
        self.emit(&mut IoStatusBlockPacket::new_unchecked(&mut b[..]));
        b
    }
    /// Parse 8 bytes (convenience).
    pub fn from_bytes(b: &[u8]) -> Result<Self> {
        Self::parse(&IoStatusBlockPacket::new_checked(b)?)
    }
}

// ------------------------------------------------------------ status response

/// Size of LWIO_MSG_STATUS_RESPONSE.
pub const STATUS_RESPONSE_LEN: usize = 16;

fixed_packet!(
    StatusResponsePacket,
    STATUS_RESPONSE_LEN,
    "Zero-copy view of LWIO_MSG_STATUS_RESPONSE (16 bytes)."
);

impl<T: AsRef<[u8]>> StatusResponsePacket<T> {
    pub fn cookie(&self) -> u64 {
        rd64(self.buffer.as_ref(), 0)
    }
    pub fn ios(&self) -> IoStatusBlockPacket<&[u8]> {
        IoStatusBlockPacket::new_unchecked(&self.buffer.as_ref()[8..16])
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> StatusResponsePacket<T> {
    pub fn set_cookie(&mut self, v: u64) {
        wr64(self.buffer.as_mut(), 0, v)
    }
    pub fn ios_mut(&mut self) -> IoStatusBlockPacket<&mut [u8]> {
        IoStatusBlockPacket::new_unchecked(&mut self.buffer.as_mut()[8..16])
    }
}

/// Parsed LWIO_MSG_STATUS_RESPONSE.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StatusResponse {
    pub cookie: u64,
    pub ios: IoStatusBlock,
}

impl StatusResponse {
    pub fn parse<T: AsRef<[u8]>>(p: &StatusResponsePacket<T>) -> Result<Self> {
        p.check_len()?;
        Ok(StatusResponse {
            cookie: p.cookie(),
            ios: IoStatusBlock::parse(&p.ios())?,
        })
    }
    pub const fn buffer_len(&self) -> usize {
        STATUS_RESPONSE_LEN
    }
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, p: &mut StatusResponsePacket<T>) {
        p.set_cookie(self.cookie);
        self.ios.emit(&mut p.ios_mut());
    }
    pub fn to_bytes(&self) -> [u8; STATUS_RESPONSE_LEN] {
        let mut b = [0u8; STATUS_RESPONSE_LEN];
        self.emit(&mut StatusResponsePacket::new_unchecked(&mut b[..]));
        b
    }
    /// Parse a received message; exactly 16 bytes are required.
    pub fn from_bytes(b: &[u8]) -> Result<Self> {
        if b.len() != STATUS_RESPONSE_LEN {
            return Err(if b.len() < STATUS_RESPONSE_LEN {
                Error::Truncated
            } else {
                Error::Malformed
            });
        }
        Self::parse(&StatusResponsePacket::new_unchecked(b))
    }
    /// True for the server's unsolicited delta-credit message.
    pub fn is_credit_delta(&self) -> bool {
        self.cookie == 0 && self.ios.status == crate::status::LWIO_NOTIFY_CREDIT
    }
    /// The delta-credit value (Information as i32 two's complement).
    pub fn credit_delta(&self) -> i32 {
        self.ios.information as i32
    }
}

// ----------------------------------------------------------------- RDMA region

/// Size of LWIO_RDMA_REGION.
pub const RDMA_REGION_LEN: usize = 16;

fixed_packet!(
    RdmaRegionPacket,
    RDMA_REGION_LEN,
    "Zero-copy view of LWIO_RDMA_REGION (16 bytes)."
);

impl<T: AsRef<[u8]>> RdmaRegionPacket<T> {
    pub fn data_va(&self) -> u64 {
        rd64(self.buffer.as_ref(), 0)
    }
    pub fn data_mh(&self) -> u32 {
        rd32(self.buffer.as_ref(), 8)
    }
    pub fn length(&self) -> u32 {
        rd32(self.buffer.as_ref(), 12)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> RdmaRegionPacket<T> {
    pub fn set_data_va(&mut self, v: u64) {
        wr64(self.buffer.as_mut(), 0, v)
    }
    pub fn set_data_mh(&mut self, v: u32) {
        wr32(self.buffer.as_mut(), 8, v)
    }
    pub fn set_length(&mut self, v: u32) {
        wr32(self.buffer.as_mut(), 12, v)
    }
}

/// Parsed LWIO_RDMA_REGION.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RdmaRegion {
    pub data_va: u64,
    pub data_mh: u32,
    pub length: u32,
}

impl RdmaRegion {
    pub fn parse<T: AsRef<[u8]>>(p: &RdmaRegionPacket<T>) -> Result<Self> {
        p.check_len()?;
        Ok(RdmaRegion {
            data_va: p.data_va(),
            data_mh: p.data_mh(),
            length: p.length(),
        })
    }
    pub const fn buffer_len(&self) -> usize {
        RDMA_REGION_LEN
    }
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, p: &mut RdmaRegionPacket<T>) {
        p.set_data_va(self.data_va);
        p.set_data_mh(self.data_mh);
        p.set_length(self.length);
    }
}
