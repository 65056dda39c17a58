//! The request table: every side-channel request is declared once here,
//! and its `Request` variant, encoder and decoder come from that entry
//! (see "How to add an operation" in docs/side-channel.md, §9).
//!
//! An entry is `Name = TYPE_CODE 0xNNNN { field: Type, ... };` (no braces for a
//! request without payload). Fields go on the wire in the order given,
//! each as its [`Wire`] impl says. A field may carry a check,
//! `field: Type => reject COND, "message"`, tested right after it is read
//! (with the fields before it in scope); a message that fails it does not
//! decode. `Hello` and `Login` are the two requests written by hand (the
//! magic prefix and the login method switch), in `codec.rs`.

use super::{
    ty, DecodeError, LoginRequest, Reader, Writer, ACCESS_READ, ACCESS_WRITE, FALLOC_KNOWN,
    LEASE_KNOWN, MAC_LEN, MEM_KNOWN, MEM_READ, OPEN_KNOWN, SEEK_DATA, SEEK_HOLE,
};
use crate::types::{RemoveKind, SetAttr, RENAME_EXCHANGE, RENAME_NOREPLACE};

/// A value as a request carries it on the wire.
pub(crate) trait Wire: Sized {
    fn put(&self, w: &mut Writer);
    fn get(r: &mut Reader<'_>) -> Result<Self, DecodeError>;
}

/// Integers little-endian, booleans as one byte 0 or 1.
macro_rules! wire_by_method {
    ($($t:ident),*) => {$(
        impl Wire for $t {
            fn put(&self, w: &mut Writer) {
                w.$t(*self)
            }
            fn get(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
                r.$t()
            }
        }
    )*};
}

wire_by_method!(u8, u32, u64, bool);

/// u16 length + UTF-8.
impl Wire for String {
    fn put(&self, w: &mut Writer) {
        w.str(self)
    }
    fn get(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        r.str()
    }
}

/// u32 length + bytes.
impl Wire for Vec<u8> {
    fn put(&self, w: &mut Writer) {
        w.bytes(self)
    }
    fn get(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        r.bytes()
    }
}

/// Fixed size, no length (MACs, keys).
impl<const N: usize> Wire for [u8; N] {
    fn put(&self, w: &mut Writer) {
        w.raw(self)
    }
    fn get(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        r.arr()
    }
}

impl Wire for SetAttr {
    fn put(&self, w: &mut Writer) {
        w.set_attr(self)
    }
    fn get(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        r.set_attr()
    }
}

impl Wire for RemoveKind {
    fn put(&self, w: &mut Writer) {
        w.u8(*self as u8)
    }
    fn get(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        match r.u8()? {
            0 => Ok(RemoveKind::Any),
            1 => Ok(RemoveKind::NotDir),
            2 => Ok(RemoveKind::Dir),
            _ => Err(DecodeError("unknown remove kind")),
        }
    }
}

macro_rules! requests {
    ($(
        $(#[$doc:meta])*
        $name:ident = $code:ident $num:literal $({
            $($f:ident : $t:ty $(=> reject $bad:expr, $msg:literal)?),* $(,)?
        })?;
    )*) => {
        /// Type codes of the table's requests (re-exported by `codec::ty`).
        pub mod codes {
            $(pub const $code: u16 = $num;)*
        }

        /// Client → server messages.
        #[derive(Debug, Clone, PartialEq, Eq)]
        pub enum Request {
            Hello {
                version: u16,
                client_name: String,
            },
            Login(LoginRequest),
            $(
                $(#[$doc])*
                $name $({ $($f: $t),* })?,
            )*
        }

        impl Request {
            /// The body of a table request (None: `Hello`, `Login`).
            pub(super) fn encode_table(&self, id: u32) -> Option<Writer> {
                match self {
                    $(
                        Request::$name $({ $($f),* })? => {
                            #[allow(unused_mut)] // a request without payload
                            let mut w = Writer::head(ty::$code, id);
                            $($( $f.put(&mut w); )*)?
                            Some(w)
                        }
                    )*
                    Request::Hello { .. } | Request::Login(_) => None,
                }
            }

            /// The payload of a table request of type `t` (None: not one).
            pub(super) fn decode_table(
                t: u16,
                r: &mut Reader<'_>,
            ) -> Result<Option<Request>, DecodeError> {
                Ok(Some(match t {
                    $(
                        ty::$code => {
                            $($(
                                let $f = <$t as Wire>::get(r)?;
                                $(if $bad {
                                    return Err(DecodeError($msg));
                                })?
                            )*)?
                            Request::$name $({ $($f),* })?
                        }
                    )*
                    _ => return Ok(None),
                }))
            }
        }
    };
}

requests! {
    ListExports = LIST_EXPORTS 0x0003;
    ListDir = LIST_DIR 0x0004 { export: String, path: String, cookie: u64 };
    Stat = STAT 0x0005 { export: String, path: String };
    Open = OPEN 0x0006 {
        export: String,
        path: String,
        access: u32,
        flags: u32,
        mode: u32 => reject access & !(ACCESS_READ | ACCESS_WRITE) != 0
            || flags & !OPEN_KNOWN != 0, "unknown open access or flag bits",
    };
    Close = CLOSE 0x0007 { handle: u64 };
    Remove = REMOVE 0x0008 { export: String, path: String };
    Rename = RENAME 0x0009 { export: String, from: String, to: String, replace: bool };
    Mkdir = MKDIR 0x000a { export: String, path: String, mode: u32, parents: bool };
    SetSize = SET_SIZE 0x000b { handle: u64, size: u64 };
    Fsync = FSYNC 0x000c { handle: u64, data_only: bool };
    /// The pipe: an LWIO negotiate request, opaque here.
    Negotiate = NEGOTIATE 0x000d { request: Vec<u8> };
    Ping = PING 0x000e;
    Bye = BYE 0x000f;
    /// Full attributes of a path; `follow` = false is lstat (docs §4.1).
    StatX = STATX 0x0010 { export: String, path: String, follow: bool };
    /// Full attributes of an open file (fstat).
    StatHandle = STAT_HANDLE 0x0011 { handle: u64 };
    /// chmod/chown/truncate/utimens of a path, never through a final symlink.
    SetAttr = SET_ATTR 0x0012 { export: String, path: String, set: SetAttr };
    /// The same on an open file.
    SetAttrHandle = SET_ATTR_HANDLE 0x0013 { handle: u64, set: SetAttr };
    Symlink = SYMLINK 0x0014 { export: String, path: String, target: String };
    Readlink = READLINK 0x0015 { export: String, path: String };
    Statfs = STATFS 0x0016 { export: String };
    /// The server's metrics (docs/metrics.md), for `lwio stats`.
    Stats = STATS 0x0030;
    /// Remove with unlink(2) or rmdir(2) semantics.
    Remove2 = REMOVE2 0x0017 { export: String, path: String, kind: RemoveKind };
    /// renameat2(2) with `RENAME_NOREPLACE`/`RENAME_EXCHANGE`.
    Rename2 = RENAME2 0x0018 {
        export: String,
        from: String,
        to: String,
        flags: u32 => reject flags & !(RENAME_NOREPLACE | RENAME_EXCHANGE) != 0
            || flags == RENAME_NOREPLACE | RENAME_EXCHANGE,
            "unknown or conflicting rename flags",
    };
    /// ListDir with full attributes (readdirplus).
    ListDirX = LIST_DIR_X 0x0019 { export: String, path: String, cookie: u64 };
    /// A hard link `to` of `from` (only where the export allows hard links).
    Link = LINK 0x001a { export: String, from: String, to: String };
    /// fallocate(2) on an open file (mode: FALLOC_FL_KEEP_SIZE 1,
    /// PUNCH_HOLE 2, ZERO_RANGE 0x10).
    Fallocate = FALLOCATE 0x001b {
        handle: u64,
        mode: u32,
        offset: u64,
        len: u64 => reject mode & !FALLOC_KNOWN != 0, "unknown fallocate mode bits",
    };
    /// lseek(2) SEEK_DATA (3) or SEEK_HOLE (4) on an open file.
    Seek = SEEK 0x001c {
        handle: u64,
        offset: u64,
        whence: u8 => reject whence != SEEK_DATA && whence != SEEK_HOLE,
            "seek whence is not SEEK_DATA or SEEK_HOLE",
    };
    /// copy_file_range(2) between two files this session has open, on the
    /// server (no data through the client); at most 64 MiB per call.
    CopyRange = COPY_RANGE 0x001d {
        src: u64,
        src_offset: u64,
        dst: u64,
        dst_offset: u64,
        len: u64,
    };
    /// A POSIX byte-range lock on an open file for one client lock owner
    /// (`kind` 0 unlock, 1 read, 2 write; `len` 0 = to the end), or with
    /// `test` the lock that would conflict (F_GETLK).
    Lock = LOCK 0x001e {
        handle: u64,
        owner: u64,
        kind: u8 => reject kind > 2, "unknown lock kind",
        start: u64,
        len: u64,
        test: bool,
    };
    /// Ask for a lease on a directory (`want`: [`LEASE_READ`] |
    /// [`LEASE_HANDLE`]); answered by `LeaseGranted` (docs/leases.md).
    ///
    /// [`LEASE_READ`]: super::LEASE_READ
    /// [`LEASE_HANDLE`]: super::LEASE_HANDLE
    LeaseDir = LEASE_DIR 0x001f {
        export: String,
        path: String,
        want: u8 => reject want == 0 || want & !LEASE_KNOWN != 0, "unknown lease kind",
    };
    /// Give a lease back.
    ReleaseLease = RELEASE_LEASE 0x0020 { lease_id: u64 };
    /// Make this connection the carrier of lease breaks for session
    /// `session_id`, proved by `mac` = HMAC-SHA256(that session's secret,
    /// "lwio-breaks" || session_id LE). Answered by Ok; from then on the
    /// server sends `LeaseBreak` frames on it unprompted.
    WatchBreaks = WATCH_BREAKS 0x0021 { session_id: u64, mac: [u8; MAC_LEN] };
    /// Take over the open files of an earlier session of the same
    /// principal whose connection was lost (docs/reconnect.md): durable
    /// handles. `mac` = HMAC-SHA256(that session's secret, "lwio-resume" ||
    /// session_id LE). Answered by `Resumed`; the files keep their handles
    /// and need a `Rekey` before REGISTER on a new RDMA connection.
    Resume = RESUME 0x0026 { session_id: u64, mac: [u8; MAC_LEN] };
    /// A fresh resume key for an open file of this session (to REGISTER it
    /// on a new RDMA connection). Answered by `Opened` (same handle).
    Rekey = REKEY 0x0027 { handle: u64 };
    /// The holder dropped its cache of a broken lease (no answer).
    LeaseBreakAck = LEASE_BREAK_ACK 0x0022 { lease_id: u64 };
    /// Publish a memory object (docs/memory-objects.md): `size` bytes of
    /// the sender's memory at `addr`, reachable by the server only, through
    /// `rkey` on the RDMA channel whose negotiate Key is `channel_key`;
    /// `rights` [`MEM_READ`] | [`MEM_WRITE`] (read is required). Answered by
    /// `Published`.
    ///
    /// [`MEM_READ`]: super::MEM_READ
    /// [`MEM_WRITE`]: super::MEM_WRITE
    Publish = PUBLISH 0x0023 {
        export: String,
        name: String,
        size: u64,
        addr: u64,
        rkey: u32,
        rights: u8 => reject rights & MEM_READ == 0 || rights & !MEM_KNOWN != 0,
            "memory-object rights must be read or read-write",
        channel_key: [u8; 16],
    };
    /// Withdraw a memory object this session published. Answered by Ok.
    Unpublish = UNPUBLISH 0x0024 { export: String, name: String };
    /// The publisher waits (at most `timeout_ms`, capped at 60 s) until
    /// more than `seen` writes into its object have completed. Answered by
    /// `Writes`.
    WaitWrites = WAIT_WRITES 0x0025 { export: String, name: String, seen: u64, timeout_ms: u32 };
    /// mknod(2) of a FIFO, socket or device node (`mode` carries the
    /// `S_IFMT` type and the permission bits; `rdev` the device number).
    /// Devices only where the export allows them. Answered by `AttrX`.
    /// Protocol 2.
    Mknod = MKNOD 0x0028 { export: String, path: String, mode: u32, rdev: u64 };
    /// fsync(2) of a directory: its entries (creates, removes, renames in
    /// it) are on the server's disk when this is answered Ok. Protocol 2.
    FsyncDir = FSYNC_DIR 0x0029 { export: String, path: String };
}
