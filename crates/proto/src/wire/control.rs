//! Side-channel (discovery phase) structures: LWIO_CONTROL_HEADER,
//! LWIO_NET_ADDRESS, LwioAddressBlk_t, negotiate request and response.

use super::small::fixed_packet;
use super::{
    decode_wchar_field, encode_wchar_field, rd16, rd32, wchar_fits, wr16, wr32, Error, Guid,
    Result, CONTROL_HEADER_LEN, LWIO_CONTROL_OPCODE_NEGOTIATE, LWIO_MAGIC, LWIO_MAX_HOST_NAME,
    LWIO_MAX_PROVIDER_NAME, LWIO_REV_ID,
};

/// Offsets of LWIO_CONTROL_HEADER.
mod field {
    pub const PROTOCOL_ID: usize = 0;
    pub const REV_ID: usize = 4;
    pub const OPCODE: usize = 8;
    pub const LENGTH: usize = 10;
}

fixed_packet!(
    ControlHeaderPacket,
    CONTROL_HEADER_LEN,
    "Zero-copy view of LWIO_CONTROL_HEADER (12 bytes)."
);

impl<T: AsRef<[u8]>> ControlHeaderPacket<T> {
    pub fn protocol_id(&self) -> [u8; 4] {
        let b = self.buffer.as_ref();
        [b[0], b[1], b[2], b[3]]
    }
    pub fn rev_id(&self) -> u32 {
        rd32(self.buffer.as_ref(), field::REV_ID)
    }
    pub fn opcode(&self) -> u16 {
        rd16(self.buffer.as_ref(), field::OPCODE)
    }
    pub fn length(&self) -> u16 {
        rd16(self.buffer.as_ref(), field::LENGTH)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> ControlHeaderPacket<T> {
    pub fn set_protocol_id(&mut self, v: [u8; 4]) {
        self.buffer.as_mut()[field::PROTOCOL_ID..field::PROTOCOL_ID + 4].copy_from_slice(&v);
    }
    pub fn set_rev_id(&mut self, v: u32) {
        wr32(self.buffer.as_mut(), field::REV_ID, v)
    }
    pub fn set_opcode(&mut self, v: u16) {
        wr16(self.buffer.as_mut(), field::OPCODE, v)
    }
    pub fn set_length(&mut self, v: u16) {
        wr16(self.buffer.as_mut(), field::LENGTH, v)
    }
}

/// Parsed LWIO_CONTROL_HEADER. Only the NEGOTIATE opcode exists.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ControlHeaderRepr {
    /// Total length of the packet, header included.
    pub length: u16,
}

impl ControlHeaderRepr {
    pub fn parse<T: AsRef<[u8]>>(p: &ControlHeaderPacket<T>) -> Result<Self> {
        p.check_len()?;
        if p.protocol_id() != LWIO_MAGIC
            || p.rev_id() != u32::from(LWIO_REV_ID)
            || p.opcode() != LWIO_CONTROL_OPCODE_NEGOTIATE
        {
            return Err(Error::Malformed);
        }
        Ok(ControlHeaderRepr { length: p.length() })
    }
    pub const fn buffer_len(&self) -> usize {
        CONTROL_HEADER_LEN
    }
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, p: &mut ControlHeaderPacket<T>) {
        p.set_protocol_id(LWIO_MAGIC);
        p.set_rev_id(u32::from(LWIO_REV_ID));
        p.set_opcode(LWIO_CONTROL_OPCODE_NEGOTIATE);
        p.set_length(self.length);
    }
}

// ---------------------------------------------------------------- addresses

/// Zero-copy view of one LWIO_NET_ADDRESS.
#[derive(Debug, Clone)]
pub struct NetAddressPacket<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> NetAddressPacket<T> {
    pub fn new_unchecked(buffer: T) -> Self {
        NetAddressPacket { buffer }
    }
    pub fn new_checked(buffer: T) -> Result<Self> {
        let p = Self::new_unchecked(buffer);
        p.check_len()?;
        Ok(p)
    }
    /// Checks the fixed part and that the variable bytes (and pad) fit.
    pub fn check_len(&self) -> Result<()> {
        let b = self.buffer.as_ref();
        if b.len() < 4 {
            return Err(Error::Truncated);
        }
        if b.len() < self.total_len() {
            return Err(Error::Truncated);
        }
        Ok(())
    }
    pub fn host_address_len(&self) -> u16 {
        rd16(self.buffer.as_ref(), 0)
    }
    pub fn discriminator_len(&self) -> u16 {
        rd16(self.buffer.as_ref(), 2)
    }
    /// Size on the wire including the alignment pad byte.
    pub fn total_len(&self) -> usize {
        let n = 4 + usize::from(self.host_address_len()) + usize::from(self.discriminator_len());
        n + (n & 1)
    }
    pub fn host_address(&self) -> &[u8] {
        let h = usize::from(self.host_address_len());
        &self.buffer.as_ref()[4..4 + h]
    }
    pub fn discriminator(&self) -> &[u8] {
        let h = usize::from(self.host_address_len());
        let d = usize::from(self.discriminator_len());
        &self.buffer.as_ref()[4 + h..4 + h + d]
    }
}

/// Parsed LWIO_NET_ADDRESS.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct NetAddressRepr {
    pub host_address: Vec<u8>,
    pub discriminator: Vec<u8>,
}

impl NetAddressRepr {
    pub fn parse<T: AsRef<[u8]>>(p: &NetAddressPacket<T>) -> Result<Self> {
        p.check_len()?;
        Ok(NetAddressRepr {
            host_address: p.host_address().to_vec(),
            discriminator: p.discriminator().to_vec(),
        })
    }
    pub fn buffer_len(&self) -> usize {
        let n = 4 + self.host_address.len() + self.discriminator.len();
        n + (n & 1)
    }
    /// Emit into `buf` (at least `buffer_len()` bytes). Fails if a field is
    /// longer than u16::MAX.
    pub fn emit(&self, buf: &mut [u8]) -> Result<()> {
        let h = u16::try_from(self.host_address.len()).map_err(|_| Error::Malformed)?;
        let d = u16::try_from(self.discriminator.len()).map_err(|_| Error::Malformed)?;
        let len = self.buffer_len();
        if buf.len() < len {
            return Err(Error::Truncated);
        }
        wr16(buf, 0, h);
        wr16(buf, 2, d);
        let hs = self.host_address.len();
        buf[4..4 + hs].copy_from_slice(&self.host_address);
        buf[4 + hs..4 + hs + self.discriminator.len()].copy_from_slice(&self.discriminator);
        if len > 4 + hs + self.discriminator.len() {
            buf[len - 1] = 0;
        }
        Ok(())
    }
}

/// Size of the fixed part of LwioAddressBlk_t.
pub const ADDRESS_BLOCK_FIXED_LEN: usize = 2 * LWIO_MAX_PROVIDER_NAME + 2;

/// Zero-copy view of an LwioAddressBlk_t.
#[derive(Debug, Clone)]
pub struct AddressBlockPacket<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> AddressBlockPacket<T> {
    pub fn new_unchecked(buffer: T) -> Self {
        AddressBlockPacket { buffer }
    }
    pub fn new_checked(buffer: T) -> Result<Self> {
        let p = Self::new_unchecked(buffer);
        p.check_len()?;
        Ok(p)
    }
    /// Walks the whole instance table; fails if any entry is truncated.
    pub fn check_len(&self) -> Result<()> {
        self.total_len().map(|_| ())
    }
    pub fn name_raw(&self) -> &[u8] {
        &self.buffer.as_ref()[..2 * LWIO_MAX_PROVIDER_NAME]
    }
    pub fn name(&self) -> String {
        decode_wchar_field(self.name_raw())
    }
    pub fn instance_count(&self) -> u16 {
        rd16(self.buffer.as_ref(), 2 * LWIO_MAX_PROVIDER_NAME)
    }
    /// Iterate the instance table. Each item is a checked view.
    pub fn instances(&self) -> impl Iterator<Item = Result<NetAddressPacket<&[u8]>>> + '_ {
        let mut rest = self
            .buffer
            .as_ref()
            .get(ADDRESS_BLOCK_FIXED_LEN..)
            .unwrap_or(&[]);
        let mut left = if self.buffer.as_ref().len() >= ADDRESS_BLOCK_FIXED_LEN {
            self.instance_count()
        } else {
            0
        };
        core::iter::from_fn(move || {
            if left == 0 {
                return None;
            }
            left -= 1;
            match NetAddressPacket::new_checked(rest) {
                Ok(p) => {
                    let n = p.total_len();
                    let (cur, tail) = rest.split_at(n);
                    rest = tail;
                    Some(Ok(NetAddressPacket::new_unchecked(cur)))
                }
                Err(e) => {
                    left = 0;
                    Some(Err(e))
                }
            }
        })
    }
    /// Size on the wire of the whole block.
    pub fn total_len(&self) -> Result<usize> {
        if self.buffer.as_ref().len() < ADDRESS_BLOCK_FIXED_LEN {
            return Err(Error::Truncated);
        }
        let mut n = ADDRESS_BLOCK_FIXED_LEN;
        for i in self.instances() {
            n += i?.total_len();
        }
        Ok(n)
    }
}

/// Parsed LwioAddressBlk_t (one provider).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct AddressBlockRepr {
    /// Provider name (≤ 31 UTF-16 code units).
    pub name: String,
    pub instances: Vec<NetAddressRepr>,
}

impl AddressBlockRepr {
    pub fn parse<T: AsRef<[u8]>>(p: &AddressBlockPacket<T>) -> Result<Self> {
        p.check_len()?;
        let mut instances = Vec::new();
        for i in p.instances() {
            instances.push(NetAddressRepr::parse(&i?)?);
        }
        Ok(AddressBlockRepr {
            name: p.name(),
            instances,
        })
    }
    pub fn buffer_len(&self) -> usize {
        ADDRESS_BLOCK_FIXED_LEN + self.instances.iter().map(|i| i.buffer_len()).sum::<usize>()
    }
    pub fn emit(&self, buf: &mut [u8]) -> Result<()> {
        if buf.len() < self.buffer_len() {
            return Err(Error::Truncated);
        }
        let count = u16::try_from(self.instances.len()).map_err(|_| Error::Malformed)?;
        encode_wchar_field(&self.name, &mut buf[..2 * LWIO_MAX_PROVIDER_NAME])?;
        wr16(buf, 2 * LWIO_MAX_PROVIDER_NAME, count);
        let mut off = ADDRESS_BLOCK_FIXED_LEN;
        for i in &self.instances {
            i.emit(&mut buf[off..])?;
            off += i.buffer_len();
        }
        Ok(())
    }
}

// ---------------------------------------------------------------- negotiate

/// Offset of ClientName / SrvName.
pub const NEGOTIATE_NAME_OFF: usize = 12;
/// Offset of Key.
pub const NEGOTIATE_KEY_OFF: usize = NEGOTIATE_NAME_OFF + 2 * LWIO_MAX_HOST_NAME;
/// Offset of ResponseLength (request) / Reserved (response).
pub const NEGOTIATE_RESPLEN_OFF: usize = NEGOTIATE_KEY_OFF + 16;
/// Offset of ProviderCount.
pub const NEGOTIATE_COUNT_OFF: usize = NEGOTIATE_RESPLEN_OFF + 2;
/// Offset of ProviderList == size of the fixed part (160).
pub const NEGOTIATE_FIXED_LEN: usize = NEGOTIATE_COUNT_OFF + 2;

/// Zero-copy view of a negotiate request or response (same layout, §2.6/2.7).
#[derive(Debug, Clone)]
pub struct NegotiatePacket<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> NegotiatePacket<T> {
    pub fn new_unchecked(buffer: T) -> Self {
        NegotiatePacket { buffer }
    }
    /// Checks the fixed part, that `Length` is within the buffer and not
    /// below the fixed part, and that the provider list fits within `Length`.
    pub fn new_checked(buffer: T) -> Result<Self> {
        let p = Self::new_unchecked(buffer);
        p.check_len()?;
        Ok(p)
    }
    pub fn check_len(&self) -> Result<()> {
        let b = self.buffer.as_ref();
        if b.len() < NEGOTIATE_FIXED_LEN {
            return Err(Error::Truncated);
        }
        let len = usize::from(self.header().length());
        if len < NEGOTIATE_FIXED_LEN {
            return Err(Error::Malformed);
        }
        if len > b.len() {
            return Err(Error::Truncated);
        }
        let mut n = NEGOTIATE_FIXED_LEN;
        for p in self.providers() {
            n += p?.total_len()?;
        }
        if n > len {
            return Err(Error::Truncated);
        }
        Ok(())
    }
    pub fn header(&self) -> ControlHeaderPacket<&[u8]> {
        ControlHeaderPacket::new_unchecked(&self.buffer.as_ref()[..CONTROL_HEADER_LEN])
    }
    pub fn name(&self) -> String {
        decode_wchar_field(&self.buffer.as_ref()[NEGOTIATE_NAME_OFF..NEGOTIATE_KEY_OFF])
    }
    pub fn key(&self) -> Guid {
        Guid::from_bytes(&self.buffer.as_ref()[NEGOTIATE_KEY_OFF..]).unwrap_or_default()
    }
    /// ResponseLength in a request, Reserved in a response.
    pub fn response_length(&self) -> u16 {
        rd16(self.buffer.as_ref(), NEGOTIATE_RESPLEN_OFF)
    }
    pub fn provider_count(&self) -> u16 {
        rd16(self.buffer.as_ref(), NEGOTIATE_COUNT_OFF)
    }
    /// Iterate the provider list (bounded by the header Length).
    pub fn providers(&self) -> impl Iterator<Item = Result<AddressBlockPacket<&[u8]>>> + '_ {
        let b = self.buffer.as_ref();
        let end = if b.len() >= NEGOTIATE_FIXED_LEN {
            usize::from(rd16(b, 10)).min(b.len())
        } else {
            0
        };
        let mut rest = b.get(NEGOTIATE_FIXED_LEN..end).unwrap_or(&[]);
        let mut left = if end >= NEGOTIATE_FIXED_LEN {
            self.provider_count()
        } else {
            0
        };
        core::iter::from_fn(move || {
            if left == 0 {
                return None;
            }
            left -= 1;
            let p = AddressBlockPacket::new_unchecked(rest);
            match p.total_len() {
                Ok(n) => {
                    let (cur, tail) = rest.split_at(n);
                    rest = tail;
                    Some(Ok(AddressBlockPacket::new_unchecked(cur)))
                }
                Err(e) => {
                    left = 0;
                    Some(Err(e))
                }
            }
        })
    }
}

fn parse_negotiate<T: AsRef<[u8]>>(buf: T) -> Result<(String, Guid, u16, Vec<AddressBlockRepr>)> {
    let p = NegotiatePacket::new_checked(buf)?;
    ControlHeaderRepr::parse(&p.header())?;
    let mut providers = Vec::new();
    for b in p.providers() {
        providers.push(AddressBlockRepr::parse(&b?)?);
    }
    Ok((p.name(), p.key(), p.response_length(), providers))
}

fn emit_negotiate(
    name: &str,
    key: &Guid,
    resp_len: u16,
    providers: &[AddressBlockRepr],
    buf: &mut [u8],
) -> Result<usize> {
    let len = NEGOTIATE_FIXED_LEN + providers.iter().map(|p| p.buffer_len()).sum::<usize>();
    let len16 = u16::try_from(len).map_err(|_| Error::Malformed)?;
    let count = u16::try_from(providers.len()).map_err(|_| Error::Malformed)?;
    if buf.len() < len {
        return Err(Error::Truncated);
    }
    ControlHeaderRepr { length: len16 }.emit(&mut ControlHeaderPacket::new_unchecked(&mut *buf));
    encode_wchar_field(name, &mut buf[NEGOTIATE_NAME_OFF..NEGOTIATE_KEY_OFF])?;
    buf[NEGOTIATE_KEY_OFF..NEGOTIATE_RESPLEN_OFF].copy_from_slice(&key.to_bytes());
    wr16(buf, NEGOTIATE_RESPLEN_OFF, resp_len);
    wr16(buf, NEGOTIATE_COUNT_OFF, count);
    let mut off = NEGOTIATE_FIXED_LEN;
    for p in providers {
        p.emit(&mut buf[off..])?;
        off += p.buffer_len();
    }
    Ok(len)
}

/// Parsed negotiate request (client → server over the side channel).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NegotiateRequestRepr {
    pub client_name: String,
    pub key: Guid,
    pub response_length: u16,
    pub providers: Vec<AddressBlockRepr>,
}

impl NegotiateRequestRepr {
    /// Parse from a buffer holding at least `Length` bytes.
    pub fn parse(buf: &[u8]) -> Result<Self> {
        let (client_name, key, response_length, providers) = parse_negotiate(buf)?;
        Ok(NegotiateRequestRepr {
            client_name,
            key,
            response_length,
            providers,
        })
    }
    pub fn buffer_len(&self) -> usize {
        NEGOTIATE_FIXED_LEN + self.providers.iter().map(|p| p.buffer_len()).sum::<usize>()
    }
    /// Emit; returns the number of bytes written. Fails if a name does not
    /// fit its field or the packet exceeds 65535 bytes.
    pub fn emit(&self, buf: &mut [u8]) -> Result<usize> {
        if !wchar_fits(&self.client_name, LWIO_MAX_HOST_NAME) {
            return Err(Error::Malformed);
        }
        emit_negotiate(
            &self.client_name,
            &self.key,
            self.response_length,
            &self.providers,
            buf,
        )
    }
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        let mut v = vec![0u8; self.buffer_len()];
        self.emit(&mut v)?;
        Ok(v)
    }
}

/// Parsed negotiate response (server → client over the side channel).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NegotiateResponseRepr {
    pub server_name: String,
    /// Server-generated key the client echoes in AUTH.
    pub key: Guid,
    pub providers: Vec<AddressBlockRepr>,
}

impl NegotiateResponseRepr {
    pub fn parse(buf: &[u8]) -> Result<Self> {
        let (server_name, key, _reserved, providers) = parse_negotiate(buf)?;
        Ok(NegotiateResponseRepr {
            server_name,
            key,
            providers,
        })
    }
    pub fn buffer_len(&self) -> usize {
        NEGOTIATE_FIXED_LEN + self.providers.iter().map(|p| p.buffer_len()).sum::<usize>()
    }
    pub fn emit(&self, buf: &mut [u8]) -> Result<usize> {
        if !wchar_fits(&self.server_name, LWIO_MAX_HOST_NAME) {
            return Err(Error::Malformed);
        }
        emit_negotiate(&self.server_name, &self.key, 0, &self.providers, buf)
    }
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        let mut v = vec![0u8; self.buffer_len()];
        self.emit(&mut v)?;
        Ok(v)
    }
}
