//! LWIO_COMMON_HEADER and the client → server request messages.

use super::small::{
    fixed_packet, FidParamsPacket, FidParamsRepr, RdmaRegion, RdmaRegionPacket, FID_PARAMS_LEN,
    RDMA_REGION_LEN,
};
use super::{rd16, rd32, rd64, wr16, wr32, wr64, Error, Result, COMMON_HEADER_LEN};

/// Field offsets of LWIO_COMMON_HEADER (docs/protocol.md §3).
pub mod field {
    pub const LENGTH: usize = 0;
    pub const STATUS: usize = 4;
    pub const OPCODE: usize = 4;
    pub const FLAGS: usize = 5;
    pub const CREDITS: usize = 6;
    pub const MARKER: usize = 7;
    pub const FID: usize = 8;
    pub const SEQUENCE: usize = 10;
    pub const TID: usize = 12;
    pub const OFFSET: usize = 16;
    pub const DATA_VA: usize = 24;
    pub const DATA_MH: usize = 32;
    pub const NUM_PAGES: usize = 32;
    pub const PAGE_SIZE: usize = 34;
    pub const PAD1: usize = 36;
    pub const IOS_MH: usize = 40;
    pub const IMMEDIATE_COOKIE: usize = 40;
    pub const PAD2: usize = 44;
    pub const IOS_VA: usize = 48;
    pub const COOKIE: usize = 48;
}

/// Client → server opcodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Opcode {
    Read = 0,
    Write = 1,
    VecRead = 2,
    VecWrite = 3,
    Close = 4,
    Cancel = 5,
    Auth = 6,
    Register = 7,
    Credit = 8,
    Interrupt = 9,
    /// lwio extension (docs/protocol.md §5.13): fsync/fdatasync of the
    /// Fid's file on the server, offered by the FEATURES option.
    Flush = 11,
}

impl Opcode {
    pub fn from_u8(v: u8) -> Option<Opcode> {
        Some(match v {
            0 => Opcode::Read,
            1 => Opcode::Write,
            2 => Opcode::VecRead,
            3 => Opcode::VecWrite,
            4 => Opcode::Close,
            5 => Opcode::Cancel,
            6 => Opcode::Auth,
            7 => Opcode::Register,
            8 => Opcode::Credit,
            9 => Opcode::Interrupt,
            // 10 is LWIO_FRAGMENT (wire::fragment), not a request.
            11 => Opcode::Flush,
            _ => return None,
        })
    }
    /// READ, WRITE, VEC_READ, VEC_WRITE.
    pub fn is_io(self) -> bool {
        matches!(
            self,
            Opcode::Read | Opcode::Write | Opcode::VecRead | Opcode::VecWrite
        )
    }
}

/// The DataVa values of a FLUSH request (§5.13).
pub struct Flush;

impl Flush {
    /// fsync(2): data and metadata.
    pub const ALL: u64 = 0;
    /// fdatasync(2): data, and the metadata needed to read it back.
    pub const DATA_ONLY: u64 = 1;
}

/// Header flag bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Flags(pub u8);

impl Flags {
    pub const INTERRUPT: u8 = 0x80;
    pub const CONTROL: u8 = 0x40;
    pub const COLLAPSE_IO: u8 = 0x20;
    pub const ALL: u8 = 0xE0;
    pub fn interrupt(self) -> bool {
        self.0 & Self::INTERRUPT != 0
    }
    pub fn control(self) -> bool {
        self.0 & Self::CONTROL != 0
    }
    pub fn collapse(self) -> bool {
        self.0 & Self::COLLAPSE_IO != 0
    }
}

fixed_packet!(
    HeaderPacket,
    COMMON_HEADER_LEN,
    "Zero-copy view of LWIO_COMMON_HEADER (56 bytes)."
);

impl<T: AsRef<[u8]>> HeaderPacket<T> {
    pub fn length(&self) -> u32 {
        rd32(self.buffer.as_ref(), field::LENGTH)
    }
    /// The Status overlay of bytes 4..8.
    pub fn status(&self) -> u32 {
        rd32(self.buffer.as_ref(), field::STATUS)
    }
    pub fn opcode(&self) -> u8 {
        self.buffer.as_ref()[field::OPCODE]
    }
    pub fn flags(&self) -> Flags {
        Flags(self.buffer.as_ref()[field::FLAGS])
    }
    pub fn credits(&self) -> u8 {
        self.buffer.as_ref()[field::CREDITS]
    }
    pub fn marker(&self) -> u8 {
        self.buffer.as_ref()[field::MARKER]
    }
    pub fn fid(&self) -> u16 {
        rd16(self.buffer.as_ref(), field::FID)
    }
    pub fn sequence(&self) -> u16 {
        rd16(self.buffer.as_ref(), field::SEQUENCE)
    }
    pub fn tid(&self) -> u32 {
        rd32(self.buffer.as_ref(), field::TID)
    }
    pub fn offset(&self) -> u64 {
        rd64(self.buffer.as_ref(), field::OFFSET)
    }
    pub fn data_va(&self) -> u64 {
        rd64(self.buffer.as_ref(), field::DATA_VA)
    }
    pub fn data_mh(&self) -> u32 {
        rd32(self.buffer.as_ref(), field::DATA_MH)
    }
    pub fn num_pages(&self) -> u16 {
        rd16(self.buffer.as_ref(), field::NUM_PAGES)
    }
    pub fn page_size(&self) -> u16 {
        rd16(self.buffer.as_ref(), field::PAGE_SIZE)
    }
    pub fn ios_mh(&self) -> u32 {
        rd32(self.buffer.as_ref(), field::IOS_MH)
    }
    pub fn immediate_cookie(&self) -> u32 {
        rd32(self.buffer.as_ref(), field::IMMEDIATE_COOKIE)
    }
    pub fn ios_va(&self) -> u64 {
        rd64(self.buffer.as_ref(), field::IOS_VA)
    }
    pub fn cookie(&self) -> u64 {
        rd64(self.buffer.as_ref(), field::COOKIE)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> HeaderPacket<T> {
    pub fn set_length(&mut self, v: u32) {
        wr32(self.buffer.as_mut(), field::LENGTH, v)
    }
    pub fn set_status(&mut self, v: u32) {
        wr32(self.buffer.as_mut(), field::STATUS, v)
    }
    pub fn set_opcode(&mut self, v: u8) {
        self.buffer.as_mut()[field::OPCODE] = v
    }
    pub fn set_flags(&mut self, v: Flags) {
        self.buffer.as_mut()[field::FLAGS] = v.0
    }
    pub fn set_credits(&mut self, v: u8) {
        self.buffer.as_mut()[field::CREDITS] = v
    }
    pub fn set_marker(&mut self, v: u8) {
        self.buffer.as_mut()[field::MARKER] = v
    }
    pub fn set_fid(&mut self, v: u16) {
        wr16(self.buffer.as_mut(), field::FID, v)
    }
    pub fn set_sequence(&mut self, v: u16) {
        wr16(self.buffer.as_mut(), field::SEQUENCE, v)
    }
    pub fn set_tid(&mut self, v: u32) {
        wr32(self.buffer.as_mut(), field::TID, v)
    }
    pub fn set_offset(&mut self, v: u64) {
        wr64(self.buffer.as_mut(), field::OFFSET, v)
    }
    pub fn set_data_va(&mut self, v: u64) {
        wr64(self.buffer.as_mut(), field::DATA_VA, v)
    }
    pub fn set_data_mh(&mut self, v: u32) {
        wr32(self.buffer.as_mut(), field::DATA_MH, v)
    }
    pub fn set_num_pages(&mut self, v: u16) {
        wr16(self.buffer.as_mut(), field::NUM_PAGES, v)
    }
    pub fn set_page_size(&mut self, v: u16) {
        wr16(self.buffer.as_mut(), field::PAGE_SIZE, v)
    }
    pub fn set_ios_mh(&mut self, v: u32) {
        wr32(self.buffer.as_mut(), field::IOS_MH, v)
    }
    pub fn set_immediate_cookie(&mut self, v: u32) {
        wr32(self.buffer.as_mut(), field::IMMEDIATE_COOKIE, v)
    }
    pub fn set_ios_va(&mut self, v: u64) {
        wr64(self.buffer.as_mut(), field::IOS_VA, v)
    }
    pub fn set_cookie(&mut self, v: u64) {
        wr64(self.buffer.as_mut(), field::COOKIE, v)
    }
    /// Zero both alignment pads.
    pub fn clear_padding(&mut self) {
        wr32(self.buffer.as_mut(), field::PAD1, 0);
        wr32(self.buffer.as_mut(), field::PAD2, 0);
    }
}

/// Parsed LWIO_COMMON_HEADER, field for field (unions kept raw; use the
/// accessor methods for the overlay views).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct HeaderRepr {
    pub length: u32,
    pub opcode: u8,
    pub flags: Flags,
    pub credits: u8,
    pub marker: u8,
    pub fid: u16,
    pub sequence: u16,
    pub tid: u32,
    pub offset: u64,
    pub data_va: u64,
    /// DataMh, or Vec.NumPages | Vec.PageSize << 16.
    pub data_mh: u32,
    /// IosMh or ImmediateCookie.
    pub ios_mh: u32,
    /// IosVa or Cookie.
    pub ios_va: u64,
}

impl HeaderRepr {
    pub fn parse<T: AsRef<[u8]>>(p: &HeaderPacket<T>) -> Result<Self> {
        p.check_len()?;
        Ok(HeaderRepr {
            length: p.length(),
            opcode: p.opcode(),
            flags: p.flags(),
            credits: p.credits(),
            marker: p.marker(),
            fid: p.fid(),
            sequence: p.sequence(),
            tid: p.tid(),
            offset: p.offset(),
            data_va: p.data_va(),
            data_mh: p.data_mh(),
            ios_mh: p.ios_mh(),
            ios_va: p.ios_va(),
        })
    }
    pub const fn buffer_len(&self) -> usize {
        COMMON_HEADER_LEN
    }
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, p: &mut HeaderPacket<T>) {
        p.set_length(self.length);
        p.set_opcode(self.opcode);
        p.set_flags(self.flags);
        p.set_credits(self.credits);
        p.set_marker(self.marker);
        p.set_fid(self.fid);
        p.set_sequence(self.sequence);
        p.set_tid(self.tid);
        p.set_offset(self.offset);
        p.set_data_va(self.data_va);
        p.set_data_mh(self.data_mh);
        p.set_ios_mh(self.ios_mh);
        p.set_ios_va(self.ios_va);
        p.clear_padding();
    }
    pub fn cookie(&self) -> u64 {
        self.ios_va
    }
    pub fn immediate_cookie(&self) -> u32 {
        self.ios_mh
    }
    pub fn num_pages(&self) -> u16 {
        self.data_mh as u16
    }
    pub fn page_size(&self) -> u16 {
        (self.data_mh >> 16) as u16
    }
    pub fn set_vec(&mut self, num_pages: u16, page_size: u16) {
        self.data_mh = u32::from(num_pages) | (u32::from(page_size) << 16);
    }
    /// CREDIT: the upper 32 bits of Offset as i32.
    pub fn credit_value(&self) -> i32 {
        (self.offset >> 32) as u32 as i32
    }
    pub fn set_credit_value(&mut self, v: i32) {
        self.offset = u64::from(v as u32) << 32;
    }
    pub fn status_overlay(&self) -> u32 {
        u32::from_le_bytes([self.opcode, self.flags.0, self.credits, self.marker])
    }
}

/// How the client wants a request completed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CompletionMode {
    /// LWIO_HDR_FLAG_INTERRUPT set: status response (or RDMA write with
    /// immediate) identified by Cookie / ImmediateCookie.
    Interrupt { cookie: u64, immediate_cookie: u32 },
    /// Polling: the status block is RDMA-written to IosVa/IosMh.
    Polled { ios_va: u64, ios_mh: u32 },
}

impl CompletionMode {
    pub(crate) fn from_header(h: &HeaderRepr) -> Self {
        if h.flags.interrupt() {
            CompletionMode::Interrupt {
                cookie: h.ios_va,
                immediate_cookie: h.ios_mh,
            }
        } else {
            CompletionMode::Polled {
                ios_va: h.ios_va,
                ios_mh: h.ios_mh,
            }
        }
    }
    fn apply(&self, h: &mut HeaderRepr) {
        match *self {
            CompletionMode::Interrupt {
                cookie,
                immediate_cookie,
            } => {
                h.flags.0 |= Flags::INTERRUPT;
                h.ios_va = cookie;
                h.ios_mh = immediate_cookie;
            }
            CompletionMode::Polled { ios_va, ios_mh } => {
                h.flags.0 &= !Flags::INTERRUPT;
                h.ios_va = ios_va;
                h.ios_mh = ios_mh;
            }
        }
    }
    pub fn is_interrupt(&self) -> bool {
        matches!(self, CompletionMode::Interrupt { .. })
    }
    /// Cookie in interrupt mode.
    pub fn cookie(&self) -> Option<u64> {
        match *self {
            CompletionMode::Interrupt { cookie, .. } => Some(cookie),
            CompletionMode::Polled { .. } => None,
        }
    }
}

/// The one request a CANCEL names (docs/protocol.md §5.9), as the server
/// knows it: by the completion fields it was sent with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CancelTarget {
    /// An interrupt-mode request: its Cookie (CANCEL: DataVa 1, Offset =
    /// Cookie).
    Cookie(u64),
    /// A polled request: its IosVa and IosMh (CANCEL: DataVa 2, Offset =
    /// IosVa, DataMh = IosMh).
    Polled { ios_va: u64, ios_mh: u32 },
}

impl CancelTarget {
    /// CANCEL's DataVa for a Cookie target.
    pub const BY_COOKIE: u64 = 1;
    /// CANCEL's DataVa for a polled target.
    pub const BY_STATUS_BLOCK: u64 = 2;

    /// The target naming a request sent with `mode`.
    pub fn of(mode: &CompletionMode) -> CancelTarget {
        match *mode {
            CompletionMode::Interrupt { cookie, .. } => CancelTarget::Cookie(cookie),
            CompletionMode::Polled { ios_va, ios_mh } => CancelTarget::Polled { ios_va, ios_mh },
        }
    }

    /// Whether a request sent with `mode` is this target.
    pub fn matches(&self, mode: &CompletionMode) -> bool {
        CancelTarget::of(mode) == *self
    }
}

/// The opcode-specific part of a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RequestOp<'a> {
    Read {
        fid: u16,
        offset: u64,
        length: u32,
        data_va: u64,
        data_mh: u32,
        mode: CompletionMode,
    },
    Write {
        fid: u16,
        offset: u64,
        data: &'a [u8],
        mode: CompletionMode,
    },
    VecRead {
        fid: u16,
        offset: u64,
        length: u32,
        page_size: u16,
        regions: Vec<RdmaRegion>,
        mode: CompletionMode,
    },
    /// With `collapse`, `data` is the single first page and `length` the
    /// total number of bytes to write.
    VecWrite {
        fid: u16,
        offset: u64,
        length: u32,
        num_pages: u16,
        page_size: u16,
        collapse: bool,
        data: &'a [u8],
        mode: CompletionMode,
    },
    Close {
        fid: u16,
        cookie: u64,
    },
    /// CANCEL of every outstanding I/O of the Fid (DataVa 0: the original
    /// form, which older peers send).
    Cancel {
        fid: u16,
        cookie: u64,
    },
    /// CANCEL of one outstanding I/O of the Fid (DataVa 1 or 2, §5.9).
    CancelIo {
        fid: u16,
        cookie: u64,
        target: CancelTarget,
    },
    /// `params` are the raw LWIO_AUTH_PARAMS bytes (parse with
    /// `AuthParamsRepr::parse`; kept raw for signature verification).
    Auth {
        cookie: u64,
        data_va: u64,
        data_mh: u32,
        params: &'a [u8],
    },
    Register {
        cookie: u64,
        params: FidParamsRepr,
    },
    /// `value` = upper 32 bits of Offset as i32.
    Credit {
        cookie: u64,
        value: i32,
    },
    Interrupt {
        cookie: u64,
    },
    /// FLUSH (lwio extension, §5.13): DataVa 0 = fsync, 1 = fdatasync.
    Flush {
        fid: u16,
        cookie: u64,
        data_only: bool,
    },
}

/// A parsed client → server message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestRepr<'a> {
    /// Client's pending-request hint.
    pub credits: u8,
    pub sequence: u16,
    pub tid: u32,
    pub op: RequestOp<'a>,
}

fn exact(buf_len: usize, want: usize) -> Result<()> {
    match buf_len.cmp(&want) {
        core::cmp::Ordering::Less => Err(Error::Truncated),
        core::cmp::Ordering::Equal => Ok(()),
        core::cmp::Ordering::Greater => Err(Error::Malformed),
    }
}

impl<'a> RequestRepr<'a> {
    /// Parse a whole received message (`buf` = exactly the bytes received).
    ///
    /// Structural rules enforced here (violations are connection-fatal):
    /// known opcode, only known flag bits, INTERRUPT flag on non-I/O
    /// opcodes, CONTROL only on INTERRUPT, COLLAPSE_IO only on VEC_WRITE,
    /// and the exact message size per opcode (docs/protocol.md §5).
    pub fn parse(buf: &'a [u8]) -> Result<Self> {
        let hp = HeaderPacket::new_checked(buf)?;
        let h = HeaderRepr::parse(&hp)?;
        let op = Opcode::from_u8(h.opcode).ok_or(Error::Malformed)?;
        let f = h.flags;
        if f.0 & !Flags::ALL != 0 {
            return Err(Error::Malformed);
        }
        if !op.is_io() && !f.interrupt() {
            return Err(Error::Malformed);
        }
        if f.control() && op != Opcode::Interrupt {
            return Err(Error::Malformed);
        }
        if f.collapse() && op != Opcode::VecWrite {
            return Err(Error::Malformed);
        }
        let payload = &buf[COMMON_HEADER_LEN..];
        let mode = CompletionMode::from_header(&h);
        let cookie = h.cookie();
        let op = match op {
            Opcode::Read => {
                exact(buf.len(), COMMON_HEADER_LEN)?;
                RequestOp::Read {
                    fid: h.fid,
                    offset: h.offset,
                    length: h.length,
                    data_va: h.data_va,
                    data_mh: h.data_mh,
                    mode,
                }
            }
            Opcode::Write => {
                let len = usize::try_from(h.length).map_err(|_| Error::Malformed)?;
                exact(payload.len(), len)?;
                RequestOp::Write {
                    fid: h.fid,
                    offset: h.offset,
                    data: payload,
                    mode,
                }
            }
            Opcode::VecRead => {
                let n = usize::from(h.num_pages());
                exact(payload.len(), n * RDMA_REGION_LEN)?;
                let regions = payload
                    .chunks_exact(RDMA_REGION_LEN)
                    .map(|c| RdmaRegion::parse(&RdmaRegionPacket::new_unchecked(c)))
                    .collect::<Result<Vec<_>>>()?;
                RequestOp::VecRead {
                    fid: h.fid,
                    offset: h.offset,
                    length: h.length,
                    page_size: h.page_size(),
                    regions,
                    mode,
                }
            }
            Opcode::VecWrite => {
                let len = usize::try_from(h.length).map_err(|_| Error::Malformed)?;
                let want = if f.collapse() {
                    len.min(usize::from(h.page_size()))
                } else {
                    len
                };
                exact(payload.len(), want)?;
                RequestOp::VecWrite {
                    fid: h.fid,
                    offset: h.offset,
                    length: h.length,
                    num_pages: h.num_pages(),
                    page_size: h.page_size(),
                    collapse: f.collapse(),
                    data: payload,
                    mode,
                }
            }
            Opcode::Close => {
                exact(buf.len(), COMMON_HEADER_LEN)?;
                RequestOp::Close { fid: h.fid, cookie }
            }
            Opcode::Cancel => {
                exact(buf.len(), COMMON_HEADER_LEN)?;
                let (fid, key) = (h.fid, h.offset);
                match h.data_va {
                    // The original form: Offset and DataMh are not looked at.
                    0 => RequestOp::Cancel { fid, cookie },
                    CancelTarget::BY_COOKIE => RequestOp::CancelIo {
                        fid,
                        cookie,
                        target: CancelTarget::Cookie(key),
                    },
                    CancelTarget::BY_STATUS_BLOCK => RequestOp::CancelIo {
                        fid,
                        cookie,
                        target: CancelTarget::Polled {
                            ios_va: key,
                            ios_mh: h.data_mh,
                        },
                    },
                    _ => return Err(Error::Malformed),
                }
            }
            Opcode::Auth => {
                if usize::try_from(h.length).ok() != Some(buf.len()) {
                    return Err(Error::Malformed);
                }
                RequestOp::Auth {
                    cookie,
                    data_va: h.data_va,
                    data_mh: h.data_mh,
                    params: payload,
                }
            }
            Opcode::Register => {
                exact(buf.len(), COMMON_HEADER_LEN + FID_PARAMS_LEN)?;
                if usize::try_from(h.length).ok() != Some(buf.len()) {
                    return Err(Error::Malformed);
                }
                let params = FidParamsRepr::parse(&FidParamsPacket::new_checked(payload)?)?;
                RequestOp::Register { cookie, params }
            }
            Opcode::Credit => {
                exact(buf.len(), COMMON_HEADER_LEN)?;
                RequestOp::Credit {
                    cookie,
                    value: h.credit_value(),
                }
            }
            Opcode::Interrupt => {
                exact(buf.len(), COMMON_HEADER_LEN)?;
                RequestOp::Interrupt { cookie }
            }
            Opcode::Flush => {
                exact(buf.len(), COMMON_HEADER_LEN)?;
                let data_only = match h.data_va {
                    Flush::ALL => false,
                    Flush::DATA_ONLY => true,
                    _ => return Err(Error::Malformed),
                };
                RequestOp::Flush {
                    fid: h.fid,
                    cookie,
                    data_only,
                }
            }
        };
        Ok(RequestRepr {
            credits: h.credits,
            sequence: h.sequence,
            tid: h.tid,
            op,
        })
    }

    /// The opcode of this request.
    pub fn opcode(&self) -> Opcode {
        match self.op {
            RequestOp::Read { .. } => Opcode::Read,
            RequestOp::Write { .. } => Opcode::Write,
            RequestOp::VecRead { .. } => Opcode::VecRead,
            RequestOp::VecWrite { .. } => Opcode::VecWrite,
            RequestOp::Close { .. } => Opcode::Close,
            RequestOp::Cancel { .. } | RequestOp::CancelIo { .. } => Opcode::Cancel,
            RequestOp::Auth { .. } => Opcode::Auth,
            RequestOp::Register { .. } => Opcode::Register,
            RequestOp::Credit { .. } => Opcode::Credit,
            RequestOp::Interrupt { .. } => Opcode::Interrupt,
            RequestOp::Flush { .. } => Opcode::Flush,
        }
    }

    /// Completion mode (non-I/O requests are always interrupt mode).
    pub fn mode(&self) -> CompletionMode {
        match &self.op {
            RequestOp::Read { mode, .. }
            | RequestOp::Write { mode, .. }
            | RequestOp::VecRead { mode, .. }
            | RequestOp::VecWrite { mode, .. } => *mode,
            RequestOp::Close { cookie, .. }
            | RequestOp::Cancel { cookie, .. }
            | RequestOp::CancelIo { cookie, .. }
            | RequestOp::Auth { cookie, .. }
            | RequestOp::Register { cookie, .. }
            | RequestOp::Credit { cookie, .. }
            | RequestOp::Interrupt { cookie }
            | RequestOp::Flush { cookie, .. } => CompletionMode::Interrupt {
                cookie: *cookie,
                immediate_cookie: 0,
            },
        }
    }

    fn payload_len(&self) -> usize {
        match &self.op {
            RequestOp::Write { data, .. } | RequestOp::VecWrite { data, .. } => data.len(),
            RequestOp::VecRead { regions, .. } => regions.len() * RDMA_REGION_LEN,
            RequestOp::Auth { params, .. } => params.len(),
            RequestOp::Register { .. } => FID_PARAMS_LEN,
            _ => 0,
        }
    }

    pub fn buffer_len(&self) -> usize {
        COMMON_HEADER_LEN + self.payload_len()
    }

    /// The header this request is emitted with.
    pub fn header(&self) -> Result<HeaderRepr> {
        let mut h = HeaderRepr {
            opcode: self.opcode() as u8,
            flags: Flags(Flags::INTERRUPT),
            credits: self.credits,
            marker: 0xFF,
            sequence: self.sequence,
            tid: self.tid,
            ..HeaderRepr::default()
        };
        let total = u32::try_from(self.buffer_len()).map_err(|_| Error::Malformed)?;
        match &self.op {
            RequestOp::Read {
                fid,
                offset,
                length,
                data_va,
                data_mh,
                mode,
            } => {
                h.fid = *fid;
                h.offset = *offset;
                h.length = *length;
                h.data_va = *data_va;
                h.data_mh = *data_mh;
                mode.apply(&mut h);
            }
            RequestOp::Write {
                fid,
                offset,
                data,
                mode,
            } => {
                h.fid = *fid;
                h.offset = *offset;
                h.length = u32::try_from(data.len()).map_err(|_| Error::Malformed)?;
                mode.apply(&mut h);
            }
            RequestOp::VecRead {
                fid,
                offset,
                length,
                page_size,
                regions,
                mode,
            } => {
                h.fid = *fid;
                h.offset = *offset;
                h.length = *length;
                let n = u16::try_from(regions.len()).map_err(|_| Error::Malformed)?;
                h.set_vec(n, *page_size);
                mode.apply(&mut h);
            }
            RequestOp::VecWrite {
                fid,
                offset,
                length,
                num_pages,
                page_size,
                collapse,
                mode,
                ..
            } => {
                h.fid = *fid;
                h.offset = *offset;
                h.length = *length;
                h.set_vec(*num_pages, *page_size);
                if *collapse {
                    h.flags.0 |= Flags::COLLAPSE_IO;
                }
                mode.apply(&mut h);
            }
            RequestOp::Close { fid, cookie } | RequestOp::Cancel { fid, cookie } => {
                h.fid = *fid;
                h.length = total;
                h.ios_va = *cookie;
            }
            RequestOp::CancelIo {
                fid,
                cookie,
                target,
            } => {
                h.fid = *fid;
                h.length = total;
                h.ios_va = *cookie;
                match *target {
                    CancelTarget::Cookie(c) => {
                        h.data_va = CancelTarget::BY_COOKIE;
                        h.offset = c;
                    }
                    CancelTarget::Polled { ios_va, ios_mh } => {
                        h.data_va = CancelTarget::BY_STATUS_BLOCK;
                        h.offset = ios_va;
                        h.data_mh = ios_mh;
                    }
                }
            }
            RequestOp::Auth {
                cookie,
                data_va,
                data_mh,
                ..
            } => {
                h.length = total;
                h.ios_va = *cookie;
                h.data_va = *data_va;
                h.data_mh = *data_mh;
            }
            RequestOp::Register { cookie, .. } => {
                h.length = total;
                h.ios_va = *cookie;
            }
            RequestOp::Credit { cookie, value } => {
                h.length = total;
                h.ios_va = *cookie;
                h.set_credit_value(*value);
            }
            RequestOp::Interrupt { cookie } => {
                h.length = total;
                h.ios_va = *cookie;
                h.flags.0 |= Flags::CONTROL;
            }
            RequestOp::Flush {
                fid,
                cookie,
                data_only,
            } => {
                h.fid = *fid;
                h.length = total;
                h.ios_va = *cookie;
                h.data_va = if *data_only {
                    Flush::DATA_ONLY
                } else {
                    Flush::ALL
                };
            }
        }
        Ok(h)
    }

    /// Emit into `buf` (≥ `buffer_len()`); returns bytes written.
    pub fn emit(&self, buf: &mut [u8]) -> Result<usize> {
        let len = self.buffer_len();
        if buf.len() < len {
            return Err(Error::Truncated);
        }
        let h = self.header()?;
        h.emit(&mut HeaderPacket::new_unchecked(
            &mut buf[..COMMON_HEADER_LEN],
        ));
        let pl = &mut buf[COMMON_HEADER_LEN..len];
        match &self.op {
            RequestOp::Write { data, .. } | RequestOp::VecWrite { data, .. } => {
                pl.copy_from_slice(data)
            }
            RequestOp::VecRead { regions, .. } => {
                for (r, c) in regions.iter().zip(pl.chunks_exact_mut(RDMA_REGION_LEN)) {
                    r.emit(&mut RdmaRegionPacket::new_unchecked(c));
                }
            }
            RequestOp::Auth { params, .. } => pl.copy_from_slice(params),
            RequestOp::Register { params, .. } => {
                params.emit(&mut FidParamsPacket::new_unchecked(pl))
            }
            _ => {}
        }
        Ok(len)
    }

    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        let mut v = vec![0u8; self.buffer_len()];
        self.emit(&mut v)?;
        Ok(v)
    }
}

/// Zero-copy view of a whole request message: header plus trailing payload
/// (WRITE / VEC_WRITE data, VEC_READ regions, AUTH params, FID params).
#[derive(Debug, Clone)]
pub struct RequestPacket<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> RequestPacket<T> {
    pub fn new_unchecked(buffer: T) -> Self {
        RequestPacket { buffer }
    }
    /// Only checks that the header is present.
    pub fn new_checked(buffer: T) -> Result<Self> {
        let p = Self::new_unchecked(buffer);
        p.check_len()?;
        Ok(p)
    }
    pub fn check_len(&self) -> Result<()> {
        if self.buffer.as_ref().len() < COMMON_HEADER_LEN {
            Err(Error::Truncated)
        } else {
            Ok(())
        }
    }
    pub fn header(&self) -> HeaderPacket<&[u8]> {
        HeaderPacket::new_unchecked(&self.buffer.as_ref()[..COMMON_HEADER_LEN])
    }
    /// Everything after the common header.
    pub fn payload(&self) -> &[u8] {
        &self.buffer.as_ref()[COMMON_HEADER_LEN..]
    }
    /// WRITE / VEC_WRITE data.
    pub fn write_data(&self) -> &[u8] {
        self.payload()
    }
    /// VEC_READ regions (whole 16-byte chunks of the payload).
    pub fn regions(&self) -> impl Iterator<Item = RdmaRegionPacket<&[u8]>> + '_ {
        self.payload()
            .chunks_exact(RDMA_REGION_LEN)
            .map(RdmaRegionPacket::new_unchecked)
    }
    /// AUTH params view.
    pub fn auth_params(&self) -> Result<super::AuthParamsPacket<&[u8]>> {
        super::AuthParamsPacket::new_checked(self.payload())
    }
    /// REGISTER params view.
    pub fn fid_params(&self) -> Result<FidParamsPacket<&[u8]>> {
        FidParamsPacket::new_checked(self.payload())
    }
}
