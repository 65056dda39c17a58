//! LWIO_AUTH_PARAMS, its options, and the signature (docs/protocol.md §5.2).

use hmac::{Hmac, Mac};
use md5::{Digest, Md5};
use sha2::Sha256;

use super::{rd16, rd32, wr16, wr32, Error, Guid, Result, LWIO_MAGIC};

/// Size of the fixed part of LWIO_AUTH_PARAMS.
pub const AUTH_PARAMS_FIXED_LEN: usize = 30;

pub const OPTION_END: u8 = 0;
pub const OPTION_KEY: u8 = 1;
pub const OPTION_SESSION_ID: u8 = 2;
pub const OPTION_SIGNATURE: u8 = 3;
/// lwio extension (docs/protocol.md §5.12): the largest reassembled
/// fragmented message the sender accepts (u32 LE).
pub const OPTION_MAX_MESSAGE: u8 = 4;
pub const OPTION_MAX_MESSAGE_LENGTH: u8 = 4;
/// lwio extension (docs/protocol.md §5.13): what the sender does beyond
/// the seed, a bit mask (u32 LE, [`FEATURE_FLUSH`], [`FEATURE_IMMEDIATE`]).
pub const OPTION_FEATURES: u8 = 5;
pub const OPTION_FEATURES_LENGTH: u8 = 4;
/// The sender serves FLUSH (opcode 11).
pub const FEATURE_FLUSH: u32 = 1;
/// The sender (a client) accepts read completions by RDMA Write with
/// Immediate: its device receives them (an RFC 7306 Immediate Data message
/// on iWARP, which Linux siw would answer with a Terminate).
pub const FEATURE_IMMEDIATE: u32 = 2;
pub const OPTION_KEY_LENGTH: u8 = 16;
pub const OPTION_SESSION_ID_LENGTH: u8 = 8;
/// MD5 signature length (seed compatibility).
pub const OPTION_SIGNATURE_LENGTH_MD5: u8 = 16;
/// HMAC-SHA256 signature length (lwio default).
pub const OPTION_SIGNATURE_LENGTH_HMAC: u8 = 32;

/// Endian field value: sizeof(ULONG_PTR) on 64-bit.
pub const ENDIAN_64: u16 = 8;

mod field {
    pub const MAGIC: usize = 0;
    pub const REV_ID: usize = 4;
    pub const ENDIAN: usize = 6;
    pub const PAGE_SIZE: usize = 8;
    pub const BASE_SEQUENCE: usize = 10;
    pub const MAX_RDMA_WINDOW: usize = 12;
    pub const MAX_SEND: usize = 16;
    pub const MAX_RECV: usize = 20;
    pub const HEADER_SIZE: usize = 24;
    pub const CREDITS: usize = 26;
    pub const RDMA_READ: usize = 28;
}

/// Signature algorithm, selected by the SIGNATURE option length.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SignatureAlg {
    /// HMAC-SHA256 keyed with the per-session secret (32 bytes, default).
    HmacSha256,
    /// The seed's plain MD5 digest (16 bytes, compatibility only).
    Md5,
}

impl SignatureAlg {
    #[allow(clippy::len_without_is_empty)]
    pub fn len(self) -> u8 {
        match self {
            SignatureAlg::HmacSha256 => OPTION_SIGNATURE_LENGTH_HMAC,
            SignatureAlg::Md5 => OPTION_SIGNATURE_LENGTH_MD5,
        }
    }
    pub fn from_len(len: usize) -> Option<Self> {
        match len {
            32 => Some(SignatureAlg::HmacSha256),
            16 => Some(SignatureAlg::Md5),
            _ => None,
        }
    }
    /// Compute the signature of `signed_bytes`.
    pub fn compute(self, secret: &[u8], signed_bytes: &[u8]) -> Vec<u8> {
        match self {
            SignatureAlg::HmacSha256 => {
                // HMAC accepts keys of any length.
                let mut m = <Hmac<Sha256> as Mac>::new_from_slice(secret)
                    .unwrap_or_else(|_| unreachable_hmac());
                m.update(signed_bytes);
                m.finalize().into_bytes().to_vec()
            }
            SignatureAlg::Md5 => Md5::digest(signed_bytes).to_vec(),
        }
    }
    /// Constant-time verification.
    pub fn verify(self, secret: &[u8], signed_bytes: &[u8], sig: &[u8]) -> bool {
        match self {
            SignatureAlg::HmacSha256 => match <Hmac<Sha256> as Mac>::new_from_slice(secret) {
                Ok(mut m) => {
                    m.update(signed_bytes);
                    m.verify_slice(sig).is_ok()
                }
                Err(_) => false,
            },
            SignatureAlg::Md5 => {
                let d = Md5::digest(signed_bytes);
                d.len() == sig.len() && d.iter().zip(sig).fold(0u8, |a, (x, y)| a | (x ^ y)) == 0
            }
        }
    }
}

fn unreachable_hmac() -> Hmac<Sha256> {
    // HMAC-SHA256 takes keys of any length; fall back to an empty key.
    <Hmac<Sha256> as Mac>::new_from_slice(&[]).expect("HMAC accepts any key length")
}

/// One option TLV (END excluded).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AuthOption<'a> {
    pub code: u8,
    pub data: &'a [u8],
    /// Offset of the OptionCode byte within the params.
    pub offset: usize,
}

/// Zero-copy view of LWIO_AUTH_PARAMS.
#[derive(Debug, Clone)]
pub struct AuthParamsPacket<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> AuthParamsPacket<T> {
    pub fn new_unchecked(buffer: T) -> Self {
        AuthParamsPacket { buffer }
    }
    /// Checks the fixed part and that the option list is terminated by END
    /// within the buffer.
    pub fn new_checked(buffer: T) -> Result<Self> {
        let p = Self::new_unchecked(buffer);
        p.check_len()?;
        Ok(p)
    }
    pub fn check_len(&self) -> Result<()> {
        self.total_len().map(|_| ())
    }
    /// Length of the params through the END byte inclusive.
    pub fn total_len(&self) -> Result<usize> {
        let b = self.buffer.as_ref();
        if b.len() < AUTH_PARAMS_FIXED_LEN {
            return Err(Error::Truncated);
        }
        let mut off = AUTH_PARAMS_FIXED_LEN;
        loop {
            let code = *b.get(off).ok_or(Error::Truncated)?;
            if code == OPTION_END {
                return Ok(off + 1);
            }
            let len = usize::from(*b.get(off + 1).ok_or(Error::Truncated)?);
            let next = off + 2 + len;
            if next > b.len() {
                return Err(Error::Truncated);
            }
            off = next;
        }
    }
    pub fn magic(&self) -> [u8; 4] {
        let b = self.buffer.as_ref();
        [b[field::MAGIC], b[1], b[2], b[3]]
    }
    pub fn rev_id(&self) -> u16 {
        rd16(self.buffer.as_ref(), field::REV_ID)
    }
    pub fn endian(&self) -> u16 {
        rd16(self.buffer.as_ref(), field::ENDIAN)
    }
    pub fn page_size(&self) -> u16 {
        rd16(self.buffer.as_ref(), field::PAGE_SIZE)
    }
    pub fn base_sequence(&self) -> u16 {
        rd16(self.buffer.as_ref(), field::BASE_SEQUENCE)
    }
    pub fn max_rdma_window_size(&self) -> u32 {
        rd32(self.buffer.as_ref(), field::MAX_RDMA_WINDOW)
    }
    pub fn max_send_buffer_size(&self) -> u32 {
        rd32(self.buffer.as_ref(), field::MAX_SEND)
    }
    pub fn max_recv_buffer_size(&self) -> u32 {
        rd32(self.buffer.as_ref(), field::MAX_RECV)
    }
    pub fn header_size(&self) -> u16 {
        rd16(self.buffer.as_ref(), field::HEADER_SIZE)
    }
    pub fn credits(&self) -> u16 {
        rd16(self.buffer.as_ref(), field::CREDITS)
    }
    pub fn rdma_read_supported(&self) -> u16 {
        rd16(self.buffer.as_ref(), field::RDMA_READ)
    }
    /// Options up to (excluding) END. Stops silently at a truncated option
    /// (which `new_checked` rejects).
    pub fn options(&self) -> impl Iterator<Item = AuthOption<'_>> + '_ {
        let b = self.buffer.as_ref();
        let mut off = AUTH_PARAMS_FIXED_LEN;
        core::iter::from_fn(move || {
            let code = *b.get(off)?;
            if code == OPTION_END {
                return None;
            }
            let len = usize::from(*b.get(off + 1)?);
            let data = b.get(off + 2..off + 2 + len)?;
            let o = AuthOption {
                code,
                data,
                offset: off,
            };
            off += 2 + len;
            Some(o)
        })
    }
    /// The params bytes through END (zero-copy).
    pub fn as_params_bytes(&self) -> Result<&[u8]> {
        let n = self.total_len()?;
        Ok(&self.buffer.as_ref()[..n])
    }
    /// The bytes covered by the signature: params through END with the
    /// (single) SIGNATURE option removed. Errors if there is no or more
    /// than one SIGNATURE option.
    pub fn signed_bytes(&self) -> Result<Vec<u8>> {
        let bytes = self.as_params_bytes()?;
        let mut sig = None;
        for o in self.options() {
            if o.code == OPTION_SIGNATURE {
                if sig.is_some() {
                    return Err(Error::Malformed);
                }
                sig = Some((o.offset, 2 + o.data.len()));
            }
        }
        let (at, n) = sig.ok_or(Error::Malformed)?;
        let mut v = Vec::with_capacity(bytes.len() - n);
        v.extend_from_slice(&bytes[..at]);
        v.extend_from_slice(&bytes[at + n..]);
        Ok(v)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> AuthParamsPacket<T> {
    pub fn set_magic(&mut self, v: [u8; 4]) {
        self.buffer.as_mut()[..4].copy_from_slice(&v)
    }
    pub fn set_rev_id(&mut self, v: u16) {
        wr16(self.buffer.as_mut(), field::REV_ID, v)
    }
    pub fn set_endian(&mut self, v: u16) {
        wr16(self.buffer.as_mut(), field::ENDIAN, v)
    }
    pub fn set_page_size(&mut self, v: u16) {
        wr16(self.buffer.as_mut(), field::PAGE_SIZE, v)
    }
    pub fn set_base_sequence(&mut self, v: u16) {
        wr16(self.buffer.as_mut(), field::BASE_SEQUENCE, v)
    }
    pub fn set_max_rdma_window_size(&mut self, v: u32) {
        wr32(self.buffer.as_mut(), field::MAX_RDMA_WINDOW, v)
    }
    pub fn set_max_send_buffer_size(&mut self, v: u32) {
        wr32(self.buffer.as_mut(), field::MAX_SEND, v)
    }
    pub fn set_max_recv_buffer_size(&mut self, v: u32) {
        wr32(self.buffer.as_mut(), field::MAX_RECV, v)
    }
    pub fn set_header_size(&mut self, v: u16) {
        wr16(self.buffer.as_mut(), field::HEADER_SIZE, v)
    }
    pub fn set_credits(&mut self, v: u16) {
        wr16(self.buffer.as_mut(), field::CREDITS, v)
    }
    pub fn set_rdma_read_supported(&mut self, v: u16) {
        wr16(self.buffer.as_mut(), field::RDMA_READ, v)
    }
}

/// The value of a u32 LE option (MAX_MESSAGE, FEATURES) seen for the first
/// time: a wrong length or a second one is malformed.
fn u32_option(data: &[u8], seen: &mut bool) -> Result<u32> {
    let a: [u8; 4] = data.try_into().map_err(|_| Error::Malformed)?;
    if std::mem::replace(seen, true) {
        return Err(Error::Malformed);
    }
    Ok(u32::from_le_bytes(a))
}

/// Parsed LWIO_AUTH_PARAMS. Unknown options are skipped on parse.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct AuthParamsRepr {
    pub rev_id: u16,
    pub endian: u16,
    pub page_size: u16,
    pub base_sequence: u16,
    pub max_rdma_window_size: u32,
    pub max_send_buffer_size: u32,
    pub max_recv_buffer_size: u32,
    pub header_size: u16,
    pub credits: u16,
    pub rdma_read_supported: u16,
    pub key: Option<Guid>,
    pub session_id: Option<u64>,
    /// Raw signature bytes (16 = MD5, 32 = HMAC-SHA256).
    pub signature: Option<Vec<u8>>,
    /// MAX_MESSAGE (lwio extension): the largest fragmented message this
    /// side reassembles; 0 or absent = it receives no fragments.
    pub max_message: u32,
    /// FEATURES (lwio extension): bits of the requests beyond the seed's
    /// that this side serves; 0 or absent = none.
    pub features: u32,
}

impl AuthParamsRepr {
    /// Parse and validate: Magic, option lengths, no duplicate known option,
    /// END present. (RevId/HeaderSize are checked by the state machines.)
    pub fn parse<T: AsRef<[u8]>>(p: &AuthParamsPacket<T>) -> Result<Self> {
        p.check_len()?;
        if p.magic() != LWIO_MAGIC {
            return Err(Error::Malformed);
        }
        let mut r = AuthParamsRepr {
            rev_id: p.rev_id(),
            endian: p.endian(),
            page_size: p.page_size(),
            base_sequence: p.base_sequence(),
            max_rdma_window_size: p.max_rdma_window_size(),
            max_send_buffer_size: p.max_send_buffer_size(),
            max_recv_buffer_size: p.max_recv_buffer_size(),
            header_size: p.header_size(),
            credits: p.credits(),
            rdma_read_supported: p.rdma_read_supported(),
            ..Default::default()
        };
        let mut seen_max_message = false;
        let mut seen_features = false;
        for o in p.options() {
            match o.code {
                OPTION_KEY => {
                    if r.key.is_some() || o.data.len() != usize::from(OPTION_KEY_LENGTH) {
                        return Err(Error::Malformed);
                    }
                    r.key = Guid::from_bytes(o.data);
                }
                OPTION_SESSION_ID => {
                    if r.session_id.is_some()
                        || o.data.len() != usize::from(OPTION_SESSION_ID_LENGTH)
                    {
                        return Err(Error::Malformed);
                    }
                    let mut a = [0u8; 8];
                    a.copy_from_slice(o.data);
                    r.session_id = Some(u64::from_le_bytes(a));
                }
                OPTION_MAX_MESSAGE => r.max_message = u32_option(o.data, &mut seen_max_message)?,
                OPTION_FEATURES => r.features = u32_option(o.data, &mut seen_features)?,
                OPTION_SIGNATURE => {
                    if r.signature.is_some() || SignatureAlg::from_len(o.data.len()).is_none() {
                        return Err(Error::Malformed);
                    }
                    r.signature = Some(o.data.to_vec());
                }
                _ => {}
            }
        }
        Ok(r)
    }

    /// Parse raw params bytes (convenience).
    pub fn from_bytes(b: &[u8]) -> Result<Self> {
        Self::parse(&AuthParamsPacket::new_checked(b)?)
    }

    pub fn buffer_len(&self) -> usize {
        AUTH_PARAMS_FIXED_LEN
            + self.key.map_or(0, |_| 18)
            + self.session_id.map_or(0, |_| 10)
            + if self.max_message > 0 { 6 } else { 0 }
            + if self.features > 0 { 6 } else { 0 }
            + self.signature.as_ref().map_or(0, |s| 2 + s.len())
            + 1
    }

    /// Emit: fixed part, then KEY, SESSION_ID, MAX_MESSAGE, FEATURES,
    /// SIGNATURE (those present; MAX_MESSAGE and FEATURES only when not 0),
    /// END.
    pub fn emit(&self, buf: &mut [u8]) -> Result<usize> {
        let len = self.buffer_len();
        if buf.len() < len {
            return Err(Error::Truncated);
        }
        let sig_len = match &self.signature {
            Some(s) => Some(u8::try_from(s.len()).map_err(|_| Error::Malformed)?),
            None => None,
        };
        {
            let mut p = AuthParamsPacket::new_unchecked(&mut *buf);
            p.set_magic(LWIO_MAGIC);
            p.set_rev_id(self.rev_id);
            p.set_endian(self.endian);
            p.set_page_size(self.page_size);
            p.set_base_sequence(self.base_sequence);
            p.set_max_rdma_window_size(self.max_rdma_window_size);
            p.set_max_send_buffer_size(self.max_send_buffer_size);
            p.set_max_recv_buffer_size(self.max_recv_buffer_size);
            p.set_header_size(self.header_size);
            p.set_credits(self.credits);
            p.set_rdma_read_supported(self.rdma_read_supported);
        }
        let mut off = AUTH_PARAMS_FIXED_LEN;
        if let Some(k) = self.key {
            buf[off] = OPTION_KEY;
            buf[off + 1] = OPTION_KEY_LENGTH;
            buf[off + 2..off + 18].copy_from_slice(&k.to_bytes());
            off += 18;
        }
        if let Some(s) = self.session_id {
            buf[off] = OPTION_SESSION_ID;
            buf[off + 1] = OPTION_SESSION_ID_LENGTH;
            buf[off + 2..off + 10].copy_from_slice(&s.to_le_bytes());
            off += 10;
        }
        if self.max_message > 0 {
            buf[off] = OPTION_MAX_MESSAGE;
            buf[off + 1] = OPTION_MAX_MESSAGE_LENGTH;
            buf[off + 2..off + 6].copy_from_slice(&self.max_message.to_le_bytes());
            off += 6;
        }
        if self.features > 0 {
            buf[off] = OPTION_FEATURES;
            buf[off + 1] = OPTION_FEATURES_LENGTH;
            buf[off + 2..off + 6].copy_from_slice(&self.features.to_le_bytes());
            off += 6;
        }
        if let (Some(s), Some(n)) = (&self.signature, sig_len) {
            buf[off] = OPTION_SIGNATURE;
            buf[off + 1] = n;
            buf[off + 2..off + 2 + s.len()].copy_from_slice(s);
            off += 2 + s.len();
        }
        buf[off] = OPTION_END;
        Ok(off + 1)
    }

    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        let mut v = vec![0u8; self.buffer_len()];
        self.emit(&mut v)?;
        Ok(v)
    }

    /// Emit with a freshly computed signature (replacing `self.signature`).
    pub fn to_signed_bytes(&self, alg: SignatureAlg, secret: &[u8]) -> Result<Vec<u8>> {
        let mut r = self.clone();
        r.signature = Some(vec![0u8; usize::from(alg.len())]);
        let mut bytes = r.to_bytes()?;
        let signed = AuthParamsPacket::new_checked(&bytes[..])?.signed_bytes()?;
        let sig = alg.compute(secret, &signed);
        // The signature option is emitted last, right before END.
        let end = bytes.len() - 1;
        bytes[end - sig.len()..end].copy_from_slice(&sig);
        Ok(bytes)
    }

    /// Verify the signature of raw params; returns the parsed params and the
    /// algorithm used. `secret` is ignored for MD5.
    pub fn verify(raw: &[u8], secret: &[u8]) -> Result<(AuthParamsRepr, SignatureAlg)> {
        let p = AuthParamsPacket::new_checked(raw)?;
        let r = AuthParamsRepr::parse(&p)?;
        let sig = r.signature.as_ref().ok_or(Error::Malformed)?;
        let alg = SignatureAlg::from_len(sig.len()).ok_or(Error::Malformed)?;
        let signed = p.signed_bytes()?;
        if alg.verify(secret, &signed, sig) {
            Ok((r, alg))
        } else {
            Err(Error::Malformed)
        }
    }
}

/// Derive a per-session secret from a base secret shared over the side
/// channel and the negotiate Key:
/// HMAC-SHA256(base, "lwio-auth-v1" || key bytes).
pub fn derive_session_secret(base: &[u8], key: &Guid) -> [u8; 32] {
    let mut m = <Hmac<Sha256> as Mac>::new_from_slice(base).unwrap_or_else(|_| unreachable_hmac());
    m.update(b"lwio-auth-v1");
    m.update(&key.to_bytes());
    m.finalize().into_bytes().into()
}
