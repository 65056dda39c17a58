//! SRV_RESUME_KEY and SRV_REQUEST_RESUME_KEY.

use super::small::fixed_packet;
use super::{rd16, rd64, wr16, wr64, Error, Result};

/// Size of SRV_RESUME_KEY.
pub const RESUME_KEY_LEN: usize = 24;
/// Size of the fixed part of SRV_REQUEST_RESUME_KEY.
pub const REQUEST_RESUME_KEY_FIXED_LEN: usize = 26;

fixed_packet!(
    ResumeKeyPacket,
    RESUME_KEY_LEN,
    "Zero-copy view of SRV_RESUME_KEY (24 bytes)."
);

impl<T: AsRef<[u8]>> ResumeKeyPacket<T> {
    pub fn resume_key(&self) -> u64 {
        rd64(self.buffer.as_ref(), 0)
    }
    pub fn timestamp(&self) -> u64 {
        rd64(self.buffer.as_ref(), 8)
    }
    pub fn pid(&self) -> u64 {
        rd64(self.buffer.as_ref(), 16)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> ResumeKeyPacket<T> {
    pub fn set_resume_key(&mut self, v: u64) {
        wr64(self.buffer.as_mut(), 0, v)
    }
    pub fn set_timestamp(&mut self, v: u64) {
        wr64(self.buffer.as_mut(), 8, v)
    }
    pub fn set_pid(&mut self, v: u64) {
        wr64(self.buffer.as_mut(), 16, v)
    }
}

/// SRV_RESUME_KEY: opaque to the client.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct SrvResumeKey {
    pub resume_key: u64,
    pub timestamp: u64,
    pub pid: u64,
}

impl SrvResumeKey {
    pub fn parse<T: AsRef<[u8]>>(p: &ResumeKeyPacket<T>) -> Result<Self> {
        p.check_len()?;
        Ok(SrvResumeKey {
            resume_key: p.resume_key(),
            timestamp: p.timestamp(),
            pid: p.pid(),
        })
    }
    pub const fn buffer_len(&self) -> usize {
        RESUME_KEY_LEN
    }
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, p: &mut ResumeKeyPacket<T>) {
        p.set_resume_key(self.resume_key);
        p.set_timestamp(self.timestamp);
        p.set_pid(self.pid);
    }
    pub fn to_bytes(&self) -> [u8; RESUME_KEY_LEN] {
        let mut b = [0u8; RESUME_KEY_LEN];
        self.emit(&mut ResumeKeyPacket::new_unchecked(&mut b[..]));
        b
    }
}

/// Zero-copy view of SRV_REQUEST_RESUME_KEY.
#[derive(Debug, Clone)]
pub struct RequestResumeKeyPacket<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> RequestResumeKeyPacket<T> {
    pub fn new_unchecked(buffer: T) -> Self {
        RequestResumeKeyPacket { buffer }
    }
    pub fn new_checked(buffer: T) -> Result<Self> {
        let p = Self::new_unchecked(buffer);
        p.check_len()?;
        Ok(p)
    }
    pub fn check_len(&self) -> Result<()> {
        let b = self.buffer.as_ref();
        if b.len() < REQUEST_RESUME_KEY_FIXED_LEN
            || b.len() < REQUEST_RESUME_KEY_FIXED_LEN + usize::from(self.context_length())
        {
            Err(Error::Truncated)
        } else {
            Ok(())
        }
    }
    pub fn key(&self) -> ResumeKeyPacket<&[u8]> {
        ResumeKeyPacket::new_unchecked(&self.buffer.as_ref()[..RESUME_KEY_LEN])
    }
    pub fn context_length(&self) -> u16 {
        rd16(self.buffer.as_ref(), 24)
    }
    /// The Context bytes (zero-copy).
    pub fn context(&self) -> &[u8] {
        let n = usize::from(self.context_length());
        &self.buffer.as_ref()[REQUEST_RESUME_KEY_FIXED_LEN..REQUEST_RESUME_KEY_FIXED_LEN + n]
    }
    pub fn total_len(&self) -> usize {
        REQUEST_RESUME_KEY_FIXED_LEN + usize::from(self.context_length())
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> RequestResumeKeyPacket<T> {
    pub fn set_context_length(&mut self, v: u16) {
        wr16(self.buffer.as_mut(), 24, v)
    }
}

/// Parsed SRV_REQUEST_RESUME_KEY; Context is the server UNC name in UTF-16LE.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestResumeKeyRepr {
    pub key: SrvResumeKey,
    /// Server UNC name, e.g. `\\storage1`.
    pub server_name: String,
}

impl RequestResumeKeyRepr {
    /// Parse; the Context must be valid UTF-16LE of even length.
    pub fn parse<T: AsRef<[u8]>>(p: &RequestResumeKeyPacket<T>) -> Result<Self> {
        p.check_len()?;
        let ctx = p.context();
        if ctx.len() & 1 != 0 {
            return Err(Error::Malformed);
        }
        let units: Vec<u16> = ctx
            .chunks_exact(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]))
            .collect();
        let server_name = String::from_utf16(&units).map_err(|_| Error::Malformed)?;
        Ok(RequestResumeKeyRepr {
            key: SrvResumeKey::parse(&p.key())?,
            server_name,
        })
    }
    pub fn buffer_len(&self) -> usize {
        REQUEST_RESUME_KEY_FIXED_LEN + 2 * self.server_name.encode_utf16().count()
    }
    /// Emit; fails if the name is longer than 32767 code units.
    pub fn emit(&self, buf: &mut [u8]) -> Result<usize> {
        let len = self.buffer_len();
        let ctx_len =
            u16::try_from(len - REQUEST_RESUME_KEY_FIXED_LEN).map_err(|_| Error::Malformed)?;
        if buf.len() < len {
            return Err(Error::Truncated);
        }
        self.key.emit(&mut ResumeKeyPacket::new_unchecked(
            &mut buf[..RESUME_KEY_LEN],
        ));
        wr16(buf, 24, ctx_len);
        for (i, u) in self.server_name.encode_utf16().enumerate() {
            let o = REQUEST_RESUME_KEY_FIXED_LEN + 2 * i;
            buf[o..o + 2].copy_from_slice(&u.to_le_bytes());
        }
        Ok(len)
    }
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        let mut v = vec![0u8; self.buffer_len()];
        self.emit(&mut v)?;
        Ok(v)
    }
}
