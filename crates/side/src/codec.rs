//! Side-channel frames and messages, byte for byte as in
//! `docs/side-channel.md`.
//!
//! A frame is a u32 LE body length followed by the body. A body is
//! `type: u16 | flags: u16 | id: u32 | payload`. All integers are
//! little-endian; strings are u16 length + UTF-8; byte strings and lists are
//! u32 length/count + contents. Decoding is strict (no trailing bytes) and
//! never panics on any input.

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::error::{Error, ErrorCode};
use crate::types::{Attr, AttrX, Creds, FileKind, SetAttr, SetTime, StatFs, MAX_GROUPS};

/// Side-channel protocol version spoken by this build.
pub const PROTOCOL_VERSION: u16 = 2;
/// The first version whose requests may carry the caller's credentials
/// ([`FLAG_CREDS`]), with `Mknod`, `FsyncDir` and the file kinds 5-8
/// (docs/side-channel.md §2). A session of version 1 gets none of them.
pub const CREDS_VERSION: u16 = 2;
/// Body-header flag: the caller's credentials ([`Creds`]) follow the id:
/// `uid: u32 | gid: u32 | ngroups: u16 | groups: u32 × ngroups`.
pub const FLAG_CREDS: u16 = 0x0001;
/// Oldest version this build accepts.
pub const MIN_PROTOCOL_VERSION: u16 = 1;
/// Magic at the start of Hello payloads: ASCII `LWSC`.
pub const MAGIC: [u8; 4] = *b"LWSC";
/// Default and hard maximum body size.
pub const DEFAULT_MAX_FRAME: u32 = 1 << 20;
/// Absolute ceiling on any configured frame size (16 MiB).
pub const HARD_MAX_FRAME: u32 = 16 << 20;
/// Smallest allowed frame limit (a page of listing must fit).
pub const MIN_MAX_FRAME: u32 = 4096;
/// Size of a frame body header (type, flags, id).
pub const BODY_HEADER_LEN: usize = 8;
/// Nonce length for login.
pub const NONCE_LEN: usize = 32;
/// HMAC-SHA256 output length.
pub const MAC_LEN: usize = 32;

/// `auth_methods` bits in [`Response::Hello`].
pub const AUTH_TOKEN: u32 = 1;
pub const AUTH_ANONYMOUS: u32 = 2;
/// User + password (method 2; offered only over TLS unless configured).
pub const AUTH_PASSWORD: u32 = 4;
/// User + per-user token challenge-response (method 3).
pub const AUTH_USER_TOKEN: u32 = 8;

/// Open `access` bits.
pub const ACCESS_READ: u32 = 1;
pub const ACCESS_WRITE: u32 = 2;
/// Open `flags` bits.
pub const OPEN_CREATE: u32 = 0x1;
pub const OPEN_EXCLUSIVE: u32 = 0x2;
pub const OPEN_TRUNCATE: u32 = 0x4;
/// = LWIO FILE_NO_INTERMEDIATE_BUFFERING (0x8) → O_DIRECT.
pub const OPEN_NO_BUFFERING: u32 = 0x8;
/// Write-through → O_DSYNC (data integrity).
pub const OPEN_WRITE_THROUGH: u32 = 0x10;
/// Full sync → O_SYNC (file integrity: data and all metadata).
pub const OPEN_SYNC: u32 = 0x20;
const OPEN_KNOWN: u32 = 0x3f;
/// `SetAttr` mask bits.
pub const SET_MODE: u32 = 0x01;
pub const SET_UID: u32 = 0x02;
pub const SET_GID: u32 = 0x04;
pub const SET_SIZE: u32 = 0x08;
pub const SET_ATIME: u32 = 0x10;
pub const SET_ATIME_NOW: u32 = 0x20;
pub const SET_MTIME: u32 = 0x40;
pub const SET_MTIME_NOW: u32 = 0x80;
const SET_KNOWN: u32 = 0xff;
/// `Fallocate` mode bits (Linux FALLOC_FL_*): KEEP_SIZE, PUNCH_HOLE, ZERO_RANGE.
pub const FALLOC_KNOWN: u32 = 0x01 | 0x02 | 0x10;
/// The most one `CopyRange` copies.
pub const COPY_RANGE_MAX: u64 = 64 << 20;
/// `Seek` whence values.
pub const SEEK_DATA: u8 = 3;
pub const SEEK_HOLE: u8 = 4;

/// Login method of [`Request::Login`]. `Debug` hides passwords.
#[derive(Clone, PartialEq, Eq)]
pub enum LoginRequest {
    /// Method 0: only when the server allows anonymous access.
    Anonymous,
    /// Method 1: shared-token challenge-response (see `side::auth`).
    Token {
        client_nonce: [u8; NONCE_LEN],
        proof: [u8; MAC_LEN],
    },
    /// Method 2: user + password (the server refuses it over plain TCP
    /// unless configured otherwise; see docs/security.md).
    Password {
        user: String,
        password: String,
        client_nonce: [u8; NONCE_LEN],
    },
    /// Method 3: user + per-user token, SCRAM-style (see `side::access`).
    UserToken {
        user: String,
        client_nonce: [u8; NONCE_LEN],
        proof: [u8; MAC_LEN],
    },
}

impl std::fmt::Debug for Redacted<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<redacted>")
    }
}

/// Keeps passwords out of `Debug` output.
struct Redacted<'a>(#[allow(dead_code)] &'a str);

impl std::fmt::Debug for LoginRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LoginRequest::Anonymous => f.write_str("Anonymous"),
            LoginRequest::Token { .. } => f.write_str("Token { .. }"),
            LoginRequest::Password { user, password, .. } => f
                .debug_struct("Password")
                .field("user", user)
                .field("password", &Redacted(password))
                .finish_non_exhaustive(),
            LoginRequest::UserToken { user, .. } => f
                .debug_struct("UserToken")
                .field("user", user)
                .finish_non_exhaustive(),
        }
    }
}

mod requests;
pub use requests::Request;

/// Memory-object grants (`Publish::rights`).
pub const MEM_READ: u8 = 1;
pub const MEM_WRITE: u8 = 2;
const MEM_KNOWN: u8 = MEM_READ | MEM_WRITE;

/// Lease kinds (`LeaseDir::want`, `LeaseGranted::granted`).
pub const LEASE_READ: u8 = 1;
pub const LEASE_HANDLE: u8 = 2;
const LEASE_KNOWN: u8 = LEASE_READ | LEASE_HANDLE;

/// One export as listed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportInfo {
    pub name: String,
    pub read_only: bool,
}

/// One listing entry on the wire.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WireDirEntry {
    pub name: String,
    pub attr: Attr,
}

/// Server → client messages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Response {
    Ok,
    Error(Error),
    Hello {
        version: u16,
        server_name: String,
        server_nonce: [u8; NONCE_LEN],
        auth_methods: u32,
        max_frame: u32,
    },
    LoginOk {
        session_id: u64,
        server_proof: [u8; MAC_LEN],
    },
    Exports(Vec<ExportInfo>),
    DirPage {
        entries: Vec<WireDirEntry>,
        next_cookie: u64,
    },
    Attr(Attr),
    Opened {
        handle: u64,
        size: u64,
        align: u32,
        resume_key: Vec<u8>,
        /// Identifies the file itself (device, inode and birth time or
        /// generation, hashed): the same value after a server restart means
        /// the same file. 0 = unknown (an older server omits it).
        file_id: u64,
    },
    /// `Resume` done: the number of open files taken over.
    Resumed {
        files: u64,
    },
    Negotiated {
        response: Vec<u8>,
    },
    AttrX(AttrX),
    /// A symlink's target (`Readlink`).
    Target(String),
    StatFs(StatFs),
    /// The server's metrics in the OpenMetrics text format (`Stats`).
    Metrics(String),
    DirPageX {
        entries: Vec<(String, AttrX)>,
        next_cookie: u64,
    },
    /// A file offset (`Seek`).
    Offset(u64),
    /// Bytes copied (`CopyRange`; 0 at the source's end).
    Copied(u64),
    /// The conflicting lock of a `Lock` test (`kind` 0: none).
    LockInfo {
        kind: u8,
        start: u64,
        len: u64,
    },
    /// The answer to `LeaseDir`: `granted` 0 = refused (lease_id 0).
    LeaseGranted {
        lease_id: u64,
        granted: u8,
    },
    /// Server-initiated, on a watching connection (id 0): drop the cache of
    /// lease `lease_id` on `export`/`path`, then send `LeaseBreakAck`.
    LeaseBreak {
        lease_id: u64,
        export: String,
        path: String,
    },
    /// The answer to `Publish`: the object's path in its export
    /// (`.lwio-mem/NAME`).
    Published {
        path: String,
    },
    /// The answer to `WaitWrites`: writes completed into the object so far.
    Writes(u64),
}

/// Message type codes.
pub mod ty {
    pub use super::requests::codes::*;

    pub const HELLO: u16 = 0x0001;
    pub const LOGIN: u16 = 0x0002;
    pub const METRICS: u16 = 0x8030;

    pub const OK: u16 = 0x8000;
    pub const HELLO_OK: u16 = 0x8001;
    pub const LOGIN_OK: u16 = 0x8002;
    pub const EXPORTS: u16 = 0x8003;
    pub const DIR_PAGE: u16 = 0x8004;
    pub const ATTR: u16 = 0x8005;
    pub const OPENED: u16 = 0x8006;
    pub const RESUMED: u16 = 0x8026;
    pub const NEGOTIATED: u16 = 0x800d;
    pub const ATTRX: u16 = 0x8010;
    pub const TARGET: u16 = 0x8015;
    pub const STATFS_OK: u16 = 0x8016;
    pub const DIR_PAGE_X: u16 = 0x8019;
    pub const OFFSET: u16 = 0x801c;
    pub const COPIED: u16 = 0x801d;
    pub const LOCK_INFO: u16 = 0x801e;
    pub const LEASE_GRANTED: u16 = 0x801f;
    pub const LEASE_BREAK: u16 = 0x8021;
    pub const PUBLISHED: u16 = 0x8023;
    pub const WRITES: u16 = 0x8025;
    pub const ERROR: u16 = 0x80ff;
}

/// Why a body did not decode.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("malformed side-channel message: {0}")]
pub struct DecodeError(pub &'static str);

impl From<DecodeError> for Error {
    fn from(e: DecodeError) -> Error {
        Error::new(ErrorCode::BadRequest, e.to_string())
    }
}

// ---------------------------------------------------------------- writer

#[derive(Default)]
pub(crate) struct Writer(pub(crate) Vec<u8>);

impl Writer {
    fn head(t: u16, id: u32) -> Writer {
        let mut w = Writer(Vec::with_capacity(64));
        w.u16(t);
        w.u16(0);
        w.u32(id);
        w
    }
    pub(crate) fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    pub(crate) fn u16(&mut self, v: u16) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    pub(crate) fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    pub(crate) fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    pub(crate) fn i64(&mut self, v: i64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    pub(crate) fn bool(&mut self, v: bool) {
        self.u8(v as u8);
    }
    pub(crate) fn raw(&mut self, v: &[u8]) {
        self.0.extend_from_slice(v);
    }
    /// u16 length + UTF-8; longer strings are cut at a char boundary.
    pub(crate) fn str(&mut self, s: &str) {
        let mut n = s.len().min(u16::MAX as usize);
        while !s.is_char_boundary(n) {
            n -= 1;
        }
        self.u16(n as u16);
        self.raw(&s.as_bytes()[..n]);
    }
    pub(crate) fn bytes(&mut self, b: &[u8]) {
        self.u32(b.len() as u32);
        self.raw(b);
    }
    fn attrx(&mut self, a: &AttrX) {
        self.u8(a.kind as u8);
        self.u32(a.perm);
        self.u64(a.size);
        self.u64(a.ino);
        self.u32(a.nlink);
        self.u32(a.uid);
        self.u32(a.gid);
        self.u64(a.blocks);
        self.u32(a.blksize);
        self.i64(a.atime_ns);
        self.i64(a.mtime_ns);
        self.i64(a.ctime_ns);
    }
    fn set_attr(&mut self, s: &SetAttr) {
        let mut mask = 0;
        let time = |t: Option<SetTime>, set: u32, now: u32| match t {
            Some(SetTime::Now) => (now, 0),
            Some(SetTime::At(ns)) => (set, ns),
            None => (0, 0),
        };
        let (am, at) = time(s.atime, SET_ATIME, SET_ATIME_NOW);
        let (mm, mt) = time(s.mtime, SET_MTIME, SET_MTIME_NOW);
        for (on, bit) in [
            (s.mode.is_some(), SET_MODE),
            (s.uid.is_some(), SET_UID),
            (s.gid.is_some(), SET_GID),
            (s.size.is_some(), SET_SIZE),
        ] {
            if on {
                mask |= bit;
            }
        }
        self.u32(mask | am | mm);
        self.u32(s.mode.unwrap_or(0));
        self.u32(s.uid.unwrap_or(0));
        self.u32(s.gid.unwrap_or(0));
        self.u64(s.size.unwrap_or(0));
        self.i64(at);
        self.i64(mt);
    }
    fn attr(&mut self, a: &Attr) {
        self.u8(a.kind as u8);
        self.u32(a.perm);
        self.u64(a.size);
        self.i64(a.mtime_ns);
    }
}

// ---------------------------------------------------------------- reader

pub(crate) struct Reader<'a> {
    pub(crate) b: &'a [u8],
}

impl<'a> Reader<'a> {
    pub(crate) fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        if self.b.len() < n {
            return Err(DecodeError("truncated"));
        }
        let (h, t) = self.b.split_at(n);
        self.b = t;
        Ok(h)
    }
    pub(crate) fn arr<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }
    pub(crate) fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.take(1)?[0])
    }
    pub(crate) fn u16(&mut self) -> Result<u16, DecodeError> {
        Ok(u16::from_le_bytes(self.arr()?))
    }
    pub(crate) fn u32(&mut self) -> Result<u32, DecodeError> {
        Ok(u32::from_le_bytes(self.arr()?))
    }
    pub(crate) fn u64(&mut self) -> Result<u64, DecodeError> {
        Ok(u64::from_le_bytes(self.arr()?))
    }
    pub(crate) fn i64(&mut self) -> Result<i64, DecodeError> {
        Ok(i64::from_le_bytes(self.arr()?))
    }
    pub(crate) fn bool(&mut self) -> Result<bool, DecodeError> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            _ => Err(DecodeError("boolean not 0 or 1")),
        }
    }
    pub(crate) fn str(&mut self) -> Result<String, DecodeError> {
        let n = self.u16()? as usize;
        let b = self.take(n)?;
        String::from_utf8(b.to_vec()).map_err(|_| DecodeError("string is not UTF-8"))
    }
    pub(crate) fn bytes(&mut self) -> Result<Vec<u8>, DecodeError> {
        let n = self.u32()? as usize;
        Ok(self.take(n)?.to_vec())
    }
    /// A u32 count, checked against the bytes left (each item ≥ `min` bytes).
    pub(crate) fn count(&mut self, min: usize) -> Result<usize, DecodeError> {
        let n = self.u32()? as usize;
        if n.saturating_mul(min) > self.b.len() {
            return Err(DecodeError("count exceeds message"));
        }
        Ok(n)
    }
    fn attrx(&mut self) -> Result<AttrX, DecodeError> {
        let kind = FileKind::from_u8(self.u8()?).ok_or(DecodeError("unknown file kind"))?;
        Ok(AttrX {
            kind,
            perm: self.u32()?,
            size: self.u64()?,
            ino: self.u64()?,
            nlink: self.u32()?,
            uid: self.u32()?,
            gid: self.u32()?,
            blocks: self.u64()?,
            blksize: self.u32()?,
            atime_ns: self.i64()?,
            mtime_ns: self.i64()?,
            ctime_ns: self.i64()?,
        })
    }
    fn set_attr(&mut self) -> Result<SetAttr, DecodeError> {
        let mask = self.u32()?;
        if mask & !SET_KNOWN != 0 {
            return Err(DecodeError("unknown set-attribute bits"));
        }
        if mask & SET_ATIME != 0 && mask & SET_ATIME_NOW != 0
            || mask & SET_MTIME != 0 && mask & SET_MTIME_NOW != 0
        {
            return Err(DecodeError("a time both given and now"));
        }
        let (mode, uid, gid, size, at, mt) = (
            self.u32()?,
            self.u32()?,
            self.u32()?,
            self.u64()?,
            self.i64()?,
            self.i64()?,
        );
        let time = |set: u32, now: u32, ns: i64| {
            if mask & now != 0 {
                Some(SetTime::Now)
            } else if mask & set != 0 {
                Some(SetTime::At(ns))
            } else {
                None
            }
        };
        Ok(SetAttr {
            mode: (mask & SET_MODE != 0).then_some(mode),
            uid: (mask & SET_UID != 0).then_some(uid),
            gid: (mask & SET_GID != 0).then_some(gid),
            size: (mask & SET_SIZE != 0).then_some(size),
            atime: time(SET_ATIME, SET_ATIME_NOW, at),
            mtime: time(SET_MTIME, SET_MTIME_NOW, mt),
        })
    }
    fn attr(&mut self) -> Result<Attr, DecodeError> {
        let kind = FileKind::from_u8(self.u8()?).ok_or(DecodeError("unknown file kind"))?;
        Ok(Attr {
            kind,
            perm: self.u32()?,
            size: self.u64()?,
            mtime_ns: self.i64()?,
        })
    }
    pub(crate) fn end(&self) -> Result<(), DecodeError> {
        if self.b.is_empty() {
            Ok(())
        } else {
            Err(DecodeError("trailing bytes"))
        }
    }
}

/// Body header: (type, id, payload); the credentials of a request that
/// carries them are skipped (see [`Request::decode_as`]).
pub fn split_body(body: &[u8]) -> Result<(u16, u32, &[u8]), DecodeError> {
    split_head(body).map(|(t, id, _, payload)| (t, id, payload))
}

/// A body split: (type, id, credentials, payload).
type Head<'a> = (u16, u32, Option<Creds>, &'a [u8]);

/// Body header with its optional credentials.
fn split_head(body: &[u8]) -> Result<Head<'_>, DecodeError> {
    let mut r = Reader { b: body };
    let t = r.u16()?;
    let flags = r.u16()?;
    if flags & !FLAG_CREDS != 0 {
        return Err(DecodeError("unknown flags"));
    }
    let id = r.u32()?;
    let creds = if flags & FLAG_CREDS != 0 {
        let (uid, gid, n) = (r.u32()?, r.u32()?, r.u16()? as usize);
        if n > MAX_GROUPS {
            return Err(DecodeError("too many groups in credentials"));
        }
        let groups = (0..n).map(|_| r.u32()).collect::<Result<Vec<_>, _>>()?;
        Some(Creds { uid, gid, groups })
    } else {
        None
    };
    Ok((t, id, creds, r.b))
}

/// Serialised size of one full-attribute listing entry (for paging).
pub fn dir_entry_x_len(name: &str) -> usize {
    2 + name.len().min(u16::MAX as usize) + crate::types::ATTRX_LEN
}

/// Serialised size of one listing entry (for paging).
pub fn dir_entry_len(e: &WireDirEntry) -> usize {
    2 + e.name.len().min(u16::MAX as usize) + 21
}

impl Request {
    /// Encode as a frame body with request id `id`.
    pub fn encode(&self, id: u32) -> Vec<u8> {
        if let Some(w) = self.encode_table(id) {
            return w.0;
        }
        let mut w;
        match self {
            Request::Hello {
                version,
                client_name,
            } => {
                w = Writer::head(ty::HELLO, id);
                w.raw(&MAGIC);
                w.u16(*version);
                w.str(client_name);
            }
            Request::Login(l) => {
                w = Writer::head(ty::LOGIN, id);
                match l {
                    LoginRequest::Anonymous => w.u8(0),
                    LoginRequest::Token {
                        client_nonce,
                        proof,
                    } => {
                        w.u8(1);
                        w.raw(client_nonce);
                        w.raw(proof);
                    }
                    LoginRequest::Password {
                        user,
                        password,
                        client_nonce,
                    } => {
                        w.u8(2);
                        w.str(user);
                        w.str(password);
                        w.raw(client_nonce);
                    }
                    LoginRequest::UserToken {
                        user,
                        client_nonce,
                        proof,
                    } => {
                        w.u8(3);
                        w.str(user);
                        w.raw(client_nonce);
                        w.raw(proof);
                    }
                }
            }
            _ => unreachable!("a table request"),
        }
        w.0
    }

    /// Encode with the caller's credentials in the body header
    /// ([`FLAG_CREDS`]; only to a peer of [`CREDS_VERSION`] or later).
    /// Groups past [`MAX_GROUPS`] are left out.
    pub fn encode_as(&self, id: u32, creds: Option<&Creds>) -> Vec<u8> {
        let body = self.encode(id);
        let Some(c) = creds else { return body };
        let groups = &c.groups[..c.groups.len().min(MAX_GROUPS)];
        let mut w = Writer(Vec::with_capacity(body.len() + 10 + 4 * groups.len()));
        w.raw(&body[..2]);
        w.u16(FLAG_CREDS);
        w.raw(&body[4..BODY_HEADER_LEN]);
        w.u32(c.uid);
        w.u32(c.gid);
        w.u16(groups.len() as u16);
        for g in groups {
            w.u32(*g);
        }
        w.raw(&body[BODY_HEADER_LEN..]);
        w.0
    }

    /// Decode a frame body: (id, request); credentials, if any, are
    /// dropped (see [`Request::decode_as`]).
    pub fn decode(body: &[u8]) -> Result<(u32, Request), DecodeError> {
        Request::decode_as(body).map(|(id, _, req)| (id, req))
    }

    /// Decode a frame body: (id, the caller's credentials if the header
    /// carries them, request). What the server runs.
    pub fn decode_as(body: &[u8]) -> Result<(u32, Option<Creds>, Request), DecodeError> {
        let (t, id, creds, payload) = split_head(body)?;
        let mut r = Reader { b: payload };
        let req = match t {
            ty::HELLO => {
                if r.arr::<4>()? != MAGIC {
                    return Err(DecodeError("bad magic (not an lwio client?)"));
                }
                Request::Hello {
                    version: r.u16()?,
                    client_name: r.str()?,
                }
            }
            ty::LOGIN => match r.u8()? {
                0 => Request::Login(LoginRequest::Anonymous),
                1 => Request::Login(LoginRequest::Token {
                    client_nonce: r.arr()?,
                    proof: r.arr()?,
                }),
                2 => Request::Login(LoginRequest::Password {
                    user: r.str()?,
                    password: r.str()?,
                    client_nonce: r.arr()?,
                }),
                3 => Request::Login(LoginRequest::UserToken {
                    user: r.str()?,
                    client_nonce: r.arr()?,
                    proof: r.arr()?,
                }),
                _ => return Err(DecodeError("unknown login method")),
            },
            _ => match Request::decode_table(t, &mut r)? {
                Some(req) => req,
                None => return Err(DecodeError("unknown request type")),
            },
        };
        r.end()?;
        Ok((id, creds, req))
    }
}

impl Response {
    /// The response as a peer of protocol `version` can decode it: file
    /// kinds past 4 (FIFOs, sockets, devices: [`CREDS_VERSION`]) become
    /// `Other` for a version-1 peer.
    pub fn for_version(mut self, version: u16) -> Response {
        if version >= CREDS_VERSION {
            return self;
        }
        match &mut self {
            Response::Error(e) => e.code = e.code.for_v1(),
            Response::Attr(a) => a.kind = a.kind.for_v1(),
            Response::AttrX(a) => a.kind = a.kind.for_v1(),
            Response::DirPage { entries, .. } => {
                for e in entries {
                    e.attr.kind = e.attr.kind.for_v1();
                }
            }
            Response::DirPageX { entries, .. } => {
                for (_, a) in entries {
                    a.kind = a.kind.for_v1();
                }
            }
            _ => {}
        }
        self
    }

    /// Encode as a frame body answering request `id`.
    pub fn encode(&self, id: u32) -> Vec<u8> {
        let mut w;
        match self {
            Response::Ok => w = Writer::head(ty::OK, id),
            Response::Error(e) => {
                w = Writer::head(ty::ERROR, id);
                w.u16(e.code as u16);
                w.str(&e.message);
            }
            Response::Hello {
                version,
                server_name,
                server_nonce,
                auth_methods,
                max_frame,
            } => {
                w = Writer::head(ty::HELLO_OK, id);
                w.raw(&MAGIC);
                w.u16(*version);
                w.str(server_name);
                w.raw(server_nonce);
                w.u32(*auth_methods);
                w.u32(*max_frame);
            }
            Response::LoginOk {
                session_id,
                server_proof,
            } => {
                w = Writer::head(ty::LOGIN_OK, id);
                w.u64(*session_id);
                w.raw(server_proof);
            }
            Response::Exports(list) => {
                w = Writer::head(ty::EXPORTS, id);
                w.u32(list.len() as u32);
                for e in list {
                    w.str(&e.name);
                    w.bool(e.read_only);
                }
            }
            Response::DirPage {
                entries,
                next_cookie,
            } => {
                w = Writer::head(ty::DIR_PAGE, id);
                w.u64(*next_cookie);
                w.u32(entries.len() as u32);
                for e in entries {
                    w.str(&e.name);
                    w.attr(&e.attr);
                }
            }
            Response::Attr(a) => {
                w = Writer::head(ty::ATTR, id);
                w.attr(a);
            }
            Response::Opened {
                handle,
                size,
                align,
                resume_key,
                file_id,
            } => {
                w = Writer::head(ty::OPENED, id);
                w.u64(*handle);
                w.u64(*size);
                w.u32(*align);
                w.bytes(resume_key);
                w.u64(*file_id);
            }
            Response::Resumed { files } => {
                w = Writer::head(ty::RESUMED, id);
                w.u64(*files);
            }
            Response::Negotiated { response } => {
                w = Writer::head(ty::NEGOTIATED, id);
                w.bytes(response);
            }
            Response::AttrX(a) => {
                w = Writer::head(ty::ATTRX, id);
                w.attrx(a);
            }
            Response::Target(t) => {
                w = Writer::head(ty::TARGET, id);
                w.str(t);
            }
            Response::Metrics(t) => {
                w = Writer::head(ty::METRICS, id);
                w.bytes(t.as_bytes());
            }
            Response::Offset(o) => {
                w = Writer::head(ty::OFFSET, id);
                w.u64(*o);
            }
            Response::Copied(n) => {
                w = Writer::head(ty::COPIED, id);
                w.u64(*n);
            }
            Response::LeaseGranted { lease_id, granted } => {
                w = Writer::head(ty::LEASE_GRANTED, id);
                w.u64(*lease_id);
                w.u8(*granted);
            }
            Response::Published { path } => {
                w = Writer::head(ty::PUBLISHED, id);
                w.str(path);
            }
            Response::Writes(n) => {
                w = Writer::head(ty::WRITES, id);
                w.u64(*n);
            }
            Response::LeaseBreak {
                lease_id,
                export,
                path,
            } => {
                w = Writer::head(ty::LEASE_BREAK, id);
                w.u64(*lease_id);
                w.str(export);
                w.str(path);
            }
            Response::LockInfo { kind, start, len } => {
                w = Writer::head(ty::LOCK_INFO, id);
                w.u8(*kind);
                w.u64(*start);
                w.u64(*len);
            }
            Response::DirPageX {
                entries,
                next_cookie,
            } => {
                w = Writer::head(ty::DIR_PAGE_X, id);
                w.u64(*next_cookie);
                w.u32(entries.len() as u32);
                for (name, a) in entries {
                    w.str(name);
                    w.attrx(a);
                }
            }
            Response::StatFs(f) => {
                w = Writer::head(ty::STATFS_OK, id);
                w.u32(f.bsize);
                w.u32(f.frsize);
                w.u64(f.blocks);
                w.u64(f.bfree);
                w.u64(f.bavail);
                w.u64(f.files);
                w.u64(f.ffree);
                w.u32(f.namelen);
            }
        }
        w.0
    }

    /// Decode a frame body: (id, response). Unknown error codes decode as
    /// [`ErrorCode::Io`] with the number in the message.
    pub fn decode(body: &[u8]) -> Result<(u32, Response), DecodeError> {
        let (t, id, creds, payload) = split_head(body)?;
        if creds.is_some() {
            return Err(DecodeError("credentials in a response"));
        }
        let mut r = Reader { b: payload };
        let resp = match t {
            ty::OK => Response::Ok,
            ty::ERROR => {
                let raw = r.u16()?;
                let message = r.str()?;
                Response::Error(match ErrorCode::from_u16(raw) {
                    Some(code) => Error::new(code, message),
                    None => Error::new(
                        ErrorCode::Io,
                        format!("{message} (server error code {raw})"),
                    ),
                })
            }
            ty::HELLO_OK => {
                if r.arr::<4>()? != MAGIC {
                    return Err(DecodeError("bad magic (not an lwio server?)"));
                }
                Response::Hello {
                    version: r.u16()?,
                    server_name: r.str()?,
                    server_nonce: r.arr()?,
                    auth_methods: r.u32()?,
                    max_frame: r.u32()?,
                }
            }
            ty::LOGIN_OK => Response::LoginOk {
                session_id: r.u64()?,
                server_proof: r.arr()?,
            },
            ty::EXPORTS => {
                let n = r.count(3)?;
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push(ExportInfo {
                        name: r.str()?,
                        read_only: r.bool()?,
                    });
                }
                Response::Exports(v)
            }
            ty::DIR_PAGE => {
                let next_cookie = r.u64()?;
                let n = r.count(23)?;
                let mut entries = Vec::with_capacity(n);
                for _ in 0..n {
                    entries.push(WireDirEntry {
                        name: r.str()?,
                        attr: r.attr()?,
                    });
                }
                Response::DirPage {
                    entries,
                    next_cookie,
                }
            }
            ty::ATTR => Response::Attr(r.attr()?),
            ty::OPENED => Response::Opened {
                handle: r.u64()?,
                size: r.u64()?,
                align: r.u32()?,
                resume_key: r.bytes()?,
                // Optional trailing field (absent from older servers).
                file_id: if r.b.is_empty() { 0 } else { r.u64()? },
            },
            ty::RESUMED => Response::Resumed { files: r.u64()? },
            ty::NEGOTIATED => Response::Negotiated {
                response: r.bytes()?,
            },
            ty::ATTRX => Response::AttrX(r.attrx()?),
            ty::TARGET => Response::Target(r.str()?),
            ty::METRICS => Response::Metrics(
                String::from_utf8(r.bytes()?).map_err(|_| DecodeError("metrics are not UTF-8"))?,
            ),
            ty::OFFSET => Response::Offset(r.u64()?),
            ty::COPIED => Response::Copied(r.u64()?),
            ty::LOCK_INFO => {
                let kind = r.u8()?;
                if kind > 2 {
                    return Err(DecodeError("unknown lock kind"));
                }
                Response::LockInfo {
                    kind,
                    start: r.u64()?,
                    len: r.u64()?,
                }
            }
            ty::DIR_PAGE_X => {
                let next_cookie = r.u64()?;
                let n = r.count(2 + crate::types::ATTRX_LEN)?;
                let mut entries = Vec::with_capacity(n);
                for _ in 0..n {
                    entries.push((r.str()?, r.attrx()?));
                }
                Response::DirPageX {
                    entries,
                    next_cookie,
                }
            }
            ty::STATFS_OK => Response::StatFs(StatFs {
                bsize: r.u32()?,
                frsize: r.u32()?,
                blocks: r.u64()?,
                bfree: r.u64()?,
                bavail: r.u64()?,
                files: r.u64()?,
                ffree: r.u64()?,
                namelen: r.u32()?,
            }),
            ty::LEASE_GRANTED => {
                let (lease_id, granted) = (r.u64()?, r.u8()?);
                if granted & !LEASE_KNOWN != 0 {
                    return Err(DecodeError("unknown lease kind"));
                }
                Response::LeaseGranted { lease_id, granted }
            }
            ty::LEASE_BREAK => Response::LeaseBreak {
                lease_id: r.u64()?,
                export: r.str()?,
                path: r.str()?,
            },
            ty::PUBLISHED => Response::Published { path: r.str()? },
            ty::WRITES => Response::Writes(r.u64()?),
            _ => return Err(DecodeError("unknown response type")),
        };
        r.end()?;
        Ok((id, resp))
    }
}

// ---------------------------------------------------------------- frames

/// Frame-level failure.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("frame of {0} bytes exceeds the limit of {1}")]
    TooLarge(u32, u32),
}

/// Read one frame body. `Ok(None)` on a clean end of stream before a frame.
pub async fn read_frame<Rd: AsyncRead + Unpin>(
    r: &mut Rd,
    max: u32,
) -> Result<Option<Vec<u8>>, FrameError> {
    let mut len = [0u8; 4];
    let mut got = 0;
    while got < 4 {
        let n = r.read(&mut len[got..]).await?;
        if n == 0 {
            if got == 0 {
                return Ok(None);
            }
            return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof).into());
        }
        got += n;
    }
    let n = u32::from_le_bytes(len);
    if n > max {
        return Err(FrameError::TooLarge(n, max));
    }
    let mut body = vec![0u8; n as usize];
    r.read_exact(&mut body).await?;
    Ok(Some(body))
}

/// Write one frame (length prefix + body) and flush.
pub async fn write_frame<Wr: AsyncWrite + Unpin>(w: &mut Wr, body: &[u8]) -> std::io::Result<()> {
    let len = u32::try_from(body.len())
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidInput, "frame too large"))?;
    let mut buf = Vec::with_capacity(4 + body.len());
    buf.extend_from_slice(&len.to_le_bytes());
    buf.extend_from_slice(body);
    w.write_all(&buf).await?;
    w.flush().await
}

#[cfg(test)]
mod tests;
