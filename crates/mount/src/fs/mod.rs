//! The FUSE file system over one lwio client.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo, InitFlags,
    KernelConfig, LockOwner, OpenFlags, RenameFlags, ReplyAttr, ReplyCreate, ReplyData,
    ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyOpen, ReplyStatfs, ReplyWrite, Request, TimeOrNow,
};
use lwio_client::{Client, File, OpenOptions};
use lwio_side::types::{
    AttrX, FileKind, RemoveKind, SetAttr, SetTime, RENAME_EXCHANGE, RENAME_NOREPLACE,
};
use tracing::{debug, warn};

use crate::caller::{self, Acting};
use crate::errno;
use crate::inodes::{join, Inodes};
use crate::leases::{split, Hit, LeaseCache, Listing};
use crate::{MountConfig, Op, Stats};

mod files;
mod leased;
mod ops;
mod unstable;

type Res<T> = Result<T, i32>;

/// Makes a new client after the server went away (the same URL, options
/// and login as the first); the error is one line.
pub type Connect = Box<dyn Fn() -> Result<Client, String> + Send + Sync>;

/// What the file system shares with its lease-break watcher and its
/// keepalive.
pub(crate) struct Shared {
    /// The client; replaced when the server comes back after it went away.
    pub(crate) client: std::sync::RwLock<Client>,
    /// Bumped at each replacement.
    pub(crate) client_gen: AtomicU64,
    pub(crate) connect: Option<Connect>,
    /// The last reconnection attempt (at most one a second).
    pub(crate) last_attempt: Mutex<Option<std::time::Instant>>,
    /// Kernel notifications (set once the FUSE session exists).
    pub(crate) notifier: std::sync::OnceLock<fuser::Notifier>,
    /// The current lease watcher (an older one, ending, leaves things be).
    pub(crate) watch_gen: AtomicU64,
    pub(crate) want_leases: bool,
    pub(crate) inodes: Mutex<Inodes>,
    pub(crate) leases: Mutex<LeaseCache>,
    /// A watching connection is up: leases may be asked for.
    pub(crate) leasing: AtomicBool,
    pub(crate) stats: Arc<Stats>,
    /// `-o hard`: wait for the server instead of failing with EIO.
    pub(crate) hard: bool,
    /// The mount is going away: a hard wait gives up (EIO).
    pub(crate) closing: AtomicBool,
}

/// A side-channel error that means the connection is gone.
fn is_lost(e: &lwio_side::Error) -> bool {
    use lwio_side::error::ErrorCode as C;
    matches!(e.code, C::Disconnected)
}

impl Shared {
    pub(crate) fn client(&self) -> Client {
        self.client
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Replace client generation `gen`, which lost its server, with a new
    /// one. True when a client newer than `gen` is in place (made here or by
    /// another thread meanwhile).
    pub(crate) fn reconnect(self: &Arc<Self>, gen: u64) -> bool {
        if !self.hard {
            return self.try_reconnect(gen);
        }
        // -o hard: wait until the server is back (or the mount goes away).
        let mut told = false;
        loop {
            if self.try_reconnect(gen) {
                return true;
            }
            if self.closing.load(Ordering::Acquire) || self.connect.is_none() {
                return false;
            }
            if !told {
                warn!("server away; -o hard: calls wait for it to come back");
                told = true;
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// One attempt (at most one a second across threads).
    fn try_reconnect(self: &Arc<Self>, gen: u64) -> bool {
        let Some(connect) = &self.connect else {
            return false;
        };
        let mut last = lock(&self.last_attempt);
        if self.client_gen.load(Ordering::Acquire) != gen {
            return true;
        }
        if last.is_some_and(|t| t.elapsed() < Duration::from_secs(1)) {
            return false;
        }
        *last = Some(std::time::Instant::now());
        let c = match connect() {
            Ok(c) => c,
            Err(e) => {
                warn!(error = %e, "server still away; calls fail with EIO until it is back");
                return false;
            }
        };
        *self.client.write().unwrap_or_else(|p| p.into_inner()) = c.clone();
        self.client_gen.fetch_add(1, Ordering::AcqRel);
        tracing::warn!(
            "connected to the server again: new calls and opens work; files open before are lost"
        );
        // The old session's leases went with it.
        crate::watcher::restart(self, &c);
        true
    }
}

fn err(e: i32) -> Errno {
    Errno::from_i32(e)
}

/// A file open through the mount. After the mount connected again (the
/// server restarted, a connection reset), the file is reopened by path on
/// the new session at its next use, checked to be the same file (the
/// server's inode number), and the call goes on.
struct OpenEntry {
    /// The node it was opened on.
    ino: u64,
    /// open(2) flags (without O_CREAT, O_EXCL and O_TRUNC: a reopen must
    /// neither create nor truncate).
    flags: i32,
    file: std::sync::RwLock<Arc<File>>,
    /// The client generation the file belongs to.
    gen: AtomicU64,
    reopening: Mutex<()>,
}

impl OpenEntry {
    fn current(&self) -> Arc<File> {
        self.file.read().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

/// An lwio export (or a directory in it) as a FUSE file system.
pub struct LwioFs {
    export: String,
    cfg: MountConfig,
    stats: Arc<Stats>,
    shared: Arc<Shared>,
    /// Open files by FUSE handle.
    files: Mutex<HashMap<u64, Arc<OpenEntry>>>,
    /// Open directories: the listing taken at opendir.
    dirs: Mutex<HashMap<u64, (Arc<Listing>, bool)>>,
    next_fh: AtomicU64,
    /// Lock owners that took a lock through each open file (their locks go
    /// when one of their descriptors of it closes, as POSIX says).
    lockers: Mutex<HashMap<u64, std::collections::HashSet<u64>>>,
    /// Files whose kernel page cache was last dropped under a lease of
    /// their directory: node -> (client generation, that lease, when).
    /// See `keep_cache`.
    cached: Mutex<HashMap<u64, (u64, u64, std::time::Instant)>>,
    /// Writes answered before the server's answer (`unstable_writes`).
    unstable: unstable::Unstable,
    /// Nodes handed to liblwio_preload.so (its handoff ioctl): a program
    /// reads and writes them over its own connection, which cannot wait
    /// for this mount's unstable writes, so the mount's writes of them are
    /// waited for. Dropped when the kernel forgets the node.
    handed_off: Mutex<std::collections::HashSet<u64>>,
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn name_str(name: &OsStr) -> Res<&str> {
    // The side channel names files in UTF-8 (docs/side-channel.md §6).
    name.to_str().ok_or(libc::EILSEQ)
}

/// A FUSE lock range (inclusive end, OFFSET_MAX = to the end) and type as
/// the side channel's (kind, len).
fn lock_args(typ: i32, start: u64, end: u64) -> Res<(u8, u64)> {
    let kind = match typ {
        libc::F_UNLCK => 0,
        libc::F_RDLCK => 1,
        libc::F_WRLCK => 2,
        _ => return Err(libc::EINVAL),
    };
    let len = if end >= i64::MAX as u64 {
        0
    } else {
        end.checked_sub(start).ok_or(libc::EINVAL)? + 1
    };
    Ok((kind, len))
}

fn kind_of(a: &AttrX) -> FileType {
    match a.kind {
        FileKind::Dir => FileType::Directory,
        FileKind::Symlink => FileType::Symlink,
        FileKind::Fifo => FileType::NamedPipe,
        FileKind::Socket => FileType::Socket,
        FileKind::CharDev => FileType::CharDevice,
        FileKind::BlockDev => FileType::BlockDevice,
        FileKind::File | FileKind::Other => FileType::RegularFile,
    }
}

/// Attributes for "." and ".." of an empty directory's readdirplus.
const DIR_ATTR: AttrX = AttrX {
    kind: FileKind::Dir,
    perm: 0o755,
    size: 0,
    ino: 0,
    nlink: 2,
    uid: 0,
    gid: 0,
    blocks: 0,
    blksize: 0,
    atime_ns: 0,
    mtime_ns: 0,
    ctime_ns: 0,
};

fn time(ns: i64) -> SystemTime {
    if ns >= 0 {
        UNIX_EPOCH + Duration::from_nanos(ns as u64)
    } else {
        UNIX_EPOCH - Duration::from_nanos(ns.unsigned_abs())
    }
}
