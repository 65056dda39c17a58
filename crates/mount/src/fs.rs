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

impl LwioFs {
    /// The file system of `export`/`subdir` (checked to be a directory).
    pub(crate) fn new(
        export: &str,
        subdir: &str,
        cfg: MountConfig,
        shared: Arc<Shared>,
    ) -> io::Result<LwioFs> {
        let stats = shared.stats.clone();
        if let Some(e) = shared.client().export().filter(|e| *e != export) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("the client was connected to export {e}, not {export}"),
            ));
        }
        let fs = LwioFs {
            export: export.to_string(),
            cfg,
            stats,
            shared,
            files: Mutex::new(HashMap::new()),
            dirs: Mutex::new(HashMap::new()),
            next_fh: AtomicU64::new(1),
            lockers: Mutex::new(HashMap::new()),
            cached: Mutex::new(HashMap::new()),
        };
        // The server's own message ("data/x: No such file or directory",
        // "no such export: nosuch") is the one line the user sees.
        let root = match fs.client().side(|s| Ok(s.statx(export, subdir, true))) {
            Ok(Ok(a)) => a,
            Ok(Err(e)) => {
                let kind = io::Error::from_raw_os_error(errno::side(&e)).kind();
                return Err(io::Error::new(kind, e.to_string()));
            }
            Err(e) => return Err(io::Error::other(e.to_string())),
        };
        if root.kind != FileKind::Dir {
            return Err(io::Error::new(
                io::ErrorKind::NotADirectory,
                format!("{export}/{subdir}: not a directory"),
            ));
        }
        Ok(fs)
    }

    fn client(&self) -> Client {
        self.shared.client()
    }

    /// A side-channel call, counted. When the connection to the server is
    /// gone, the mount connects again (at most once a second) and, if that
    /// works, makes the call once more on the new session: after a server
    /// restart, new opens and every namespace call work again (files open
    /// before it are lost: their calls fail with EIO).
    fn side<T>(
        &self,
        f: impl Fn(&mut lwio_client::side::Client) -> lwio_side::Result<T>,
    ) -> Res<T> {
        Stats::add(&self.stats.side_calls, 1);
        // Soft: one more try on a new connection. Hard: as many as it
        // takes (the server may go away again while coming back).
        let mut tries = 0;
        let r = loop {
            let gen = self.shared.client_gen.load(Ordering::Acquire);
            // The ids of the FUSE request this thread serves, if any
            // (caller.rs).
            let who = caller::current();
            let r = self
                .client()
                .side(|s| Ok(s.as_caller(who.as_ref(), |s| f(s))));
            let lost = matches!(&r, Ok(Err(e)) if is_lost(e))
                || matches!(&r, Err(lwio_client::Error::ConnectionLost(_)));
            if !lost || (tries > 0 && !self.shared.hard) || !self.shared.reconnect(gen) {
                break r;
            }
            tries += 1;
            Stats::add(&self.stats.side_calls, 1);
        };
        match r {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => {
                debug!(error = %e, "side channel");
                Err(errno::side(&e))
            }
            Err(e) => {
                warn!(error = %e, "side channel");
                Err(errno::client(&e))
            }
        }
    }

    /// lstat(2) of a path on the server.
    fn stat(&self, path: &str) -> Res<AttrX> {
        let export = &self.export;
        self.side(|s| s.statx(export, path, false))
    }

    fn path(&self, ino: INodeNo) -> Res<String> {
        lock(&self.shared.inodes).path(ino.0).ok_or(libc::ENOENT)
    }

    /// A file open on node `ino`, for a node whose name is gone (unlinked
    /// while open).
    fn open_file_of(&self, ino: INodeNo) -> Option<Arc<File>> {
        lock(&self.files)
            .values()
            .find(|o| o.ino == ino.0)
            .map(|o| o.current())
    }

    /// The open file to act on for `ino`: the given one, else (for a node
    /// with no name left) any file open on it; None: by path.
    fn file_for(&self, ino: INodeNo, fh: Option<FileHandle>) -> Res<Option<Arc<File>>> {
        if let Some(Ok(f)) = fh.map(|fh| self.file(fh)) {
            return Ok(Some(f));
        }
        if lock(&self.shared.inodes).path(ino.0).is_some() {
            return Ok(None);
        }
        self.open_file_of(ino).map(Some).ok_or(libc::ENOENT)
    }

    fn child(&self, parent: INodeNo, name: &OsStr) -> Res<String> {
        Ok(join(&self.path(parent)?, name_str(name)?))
    }

    /// The kernel's attributes: the server's, with our node id. Owners are
    /// the server's uids and gids, as NFS shows them.
    fn attr(&self, ino: u64, a: &AttrX) -> FileAttr {
        let kind = kind_of(a);
        FileAttr {
            ino: INodeNo(ino),
            size: a.size,
            blocks: a.blocks,
            atime: time(a.atime_ns),
            mtime: time(a.mtime_ns),
            ctime: time(a.ctime_ns),
            crtime: time(a.ctime_ns),
            kind,
            perm: (a.perm & 0o7777) as u16,
            nlink: a.nlink,
            uid: a.uid,
            gid: a.gid,
            rdev: 0,
            // Large reads and writes: the data path's unit, not the disk's.
            blksize: self.cfg.max_io,
            flags: 0,
        }
    }

    /// Look `path` up: count a kernel reference and answer with its entry.
    fn entry(&self, path: &str, a: &AttrX, reply: ReplyEntry) {
        // Replied under the cache lock: a break drops the cache (and then
        // tells the kernel) either before this, and the entry gets the
        // short lifetimes, or after the kernel has it.
        let c = lock(&self.shared.leases);
        let leased = self.leasing() && split(path).is_some_and(|(d, _)| c.lease_of(&d).is_some());
        self.reply_entry(path, a, leased, reply);
        drop(c);
    }

    /// Answer a lookup (the caller holds the lease cache's lock when
    /// `leased`).
    fn reply_entry(&self, path: &str, a: &AttrX, leased: bool, reply: ReplyEntry) {
        let ino = {
            let mut t = lock(&self.shared.inodes);
            let ino = t.lookup(path);
            t.set_server_ino(ino, a.ino);
            ino
        };
        let (entry_ttl, attr_ttl) = self.ttls(leased);
        reply.entry_with_ttls(&attr_ttl, &entry_ttl, &self.attr(ino, a), Generation(0));
    }

    fn reply_attr(&self, ino: INodeNo, r: Res<AttrX>, reply: ReplyAttr) {
        match r {
            Ok(a) => reply.attr(&self.cfg.attr_ttl, &self.attr(ino.0, &a)),
            Err(e) => reply.error(err(e)),
        }
    }

    fn entry_of(&self, fh: FileHandle) -> Res<Arc<OpenEntry>> {
        lock(&self.files).get(&fh.0).cloned().ok_or(libc::EBADF)
    }

    /// The open file of `fh`, reopened first if the mount connected again
    /// since it was opened.
    fn file(&self, fh: FileHandle) -> Res<Arc<File>> {
        let o = self.entry_of(fh)?;
        self.fresh(&o)?;
        Ok(o.current())
    }

    /// A side-channel call on open file `f`'s handle, counted: the handle
    /// stays right across a reconnect (the call is made again on the
    /// reopened file, [`File::side`]).
    fn on_file<T>(
        &self,
        f: &File,
        call: impl FnMut(&mut lwio_client::side::Client, u64) -> lwio_side::Result<T>,
    ) -> Res<T> {
        Stats::add(&self.stats.side_calls, 1);
        match f.side(call) {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => {
                debug!(error = %e, "side channel");
                Err(errno::side(&e))
            }
            Err(e) => {
                warn!(error = %e, "side channel");
                Err(errno::client(&e))
            }
        }
    }

    /// Reopen `o` on the current client if it belongs to an older one.
    fn fresh(&self, o: &OpenEntry) -> Res<()> {
        let now = self.shared.client_gen.load(Ordering::Acquire);
        if o.gen.load(Ordering::Acquire) == now {
            return Ok(());
        }
        let _one = lock(&o.reopening);
        if o.gen.load(Ordering::Acquire) == now {
            return Ok(());
        }
        let (path, expect) = {
            let t = lock(&self.shared.inodes);
            (t.path(o.ino), t.server_ino(o.ino))
        };
        // A file whose name is gone cannot be found again.
        let path = path.ok_or(libc::EIO)?;
        let f = self.open_path(&path, o.flags, None).map_err(|e| {
            warn!(path, errno = e, "cannot reopen after reconnecting");
            libc::EIO
        })?;
        if let Some(want) = expect {
            match f.stat() {
                Ok(a) if a.ino == want => {}
                _ => {
                    warn!(path, "not the same file after reconnecting; not reopened");
                    let _ = f.close();
                    return Err(libc::ESTALE);
                }
            }
        }
        let old = std::mem::replace(
            &mut *o.file.write().unwrap_or_else(|p| p.into_inner()),
            Arc::new(f),
        );
        o.gen.store(now, Ordering::Release);
        // The old session is gone, and its handle with it.
        drop(old);
        warn!(path, "reopened after reconnecting");
        Ok(())
    }

    /// Run a data call on `fh`'s file; if the connection was lost under it,
    /// connect again, reopen the file and make the call once more (a READ or
    /// a WRITE at an offset may be repeated: the same bytes land in the same
    /// place).
    fn with_file<T>(
        &self,
        fh: FileHandle,
        op: impl Fn(&File) -> Result<T, lwio_client::Error>,
    ) -> Res<T> {
        let o = self.entry_of(fh)?;
        self.fresh(&o)?;
        let mut tries = 0;
        loop {
            match op(&o.current()) {
                Ok(v) => return Ok(v),
                Err(lwio_client::Error::ConnectionLost(m)) => {
                    let gen = o.gen.load(Ordering::Acquire);
                    if (tries > 0 && !self.shared.hard) || !self.shared.reconnect(gen) {
                        debug!(error = %m, "connection lost");
                        return Err(libc::EIO);
                    }
                    tries += 1;
                    self.fresh(&o)?;
                }
                Err(e) => {
                    debug!(error = %e, "data call");
                    return Err(errno::client(&e));
                }
            }
        }
    }

    fn add_file(&self, ino: u64, flags: i32, f: File) -> u64 {
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        let o = OpenEntry {
            ino,
            flags: flags & !(libc::O_CREAT | libc::O_EXCL | libc::O_TRUNC),
            file: std::sync::RwLock::new(Arc::new(f)),
            gen: AtomicU64::new(self.shared.client_gen.load(Ordering::Acquire)),
            reopening: Mutex::new(()),
        };
        lock(&self.files).insert(fh, Arc::new(o));
        fh
    }

    /// Open `path` over the data path (side-channel open + RDMA register).
    fn open_path(&self, path: &str, flags: i32, create_mode: Option<u32>) -> Res<File> {
        let acc = flags & libc::O_ACCMODE;
        if self.cfg.read_only && (acc != libc::O_RDONLY || flags & libc::O_TRUNC != 0) {
            return Err(libc::EROFS);
        }
        let mut create_mode = create_mode;
        if let (Some(mode), libc::O_RDONLY) = (create_mode, acc) {
            // O_RDONLY|O_CREAT is legal; the server creates only with write
            // access: create (honouring O_EXCL) and close, then open for
            // reading.
            let export = &self.export;
            let c = lwio_side::types::OpenOptions {
                write: true,
                create: true,
                exclusive: flags & libc::O_EXCL != 0,
                ..Default::default()
            };
            self.side(|s| {
                let f = s.open(export, path, &c, mode)?;
                s.close(f.handle)
            })?;
            create_mode = None;
        }
        let mut o = OpenOptions::read_only();
        // Under the write-back cache the kernel reads the rest of a page it
        // writes in part, through any open handle of the file: a write-only
        // open is made read-write where the caller may read (as libfuse's
        // passthrough does), and stays write-only where it may not.
        o.0.read = acc != libc::O_WRONLY || self.cfg.writeback_cache;
        o.0.write = acc != libc::O_RDONLY;
        o.0.truncate = flags & libc::O_TRUNC != 0 && o.0.write;
        o.0.create = create_mode.is_some();
        o.0.exclusive = create_mode.is_some() && flags & libc::O_EXCL != 0;
        o.0.no_buffering = flags & libc::O_DIRECT != 0;
        o.0.set_sync_flags(flags);
        Stats::add(&self.stats.opens, 1);
        Stats::add(&self.stats.side_calls, 1);
        // `Client::open` takes EXPORT/PATH, or PATH when the client's URL
        // named the export (`new` checked that it is this one).
        let client = self.client();
        let full = match client.export() {
            Some(_) => path.to_string(),
            None => format!("{}/{path}", self.export),
        };
        let open = |o: &OpenOptions| {
            client
                .open_as(&full, o, create_mode.unwrap_or(0o644), caller::current())
                .map_err(|e| {
                    debug!(path, error = %e, "open");
                    errno::client(&e)
                })
        };
        match open(&o) {
            Err(libc::EACCES) if acc == libc::O_WRONLY && o.0.read => {
                // Not readable by the caller: write-only, as asked (a write
                // of part of a page the kernel does not hold then fails).
                o.0.read = false;
                open(&o)
            }
            r => r,
        }
    }

    fn fopen_flags(&self, flags: i32, keep: bool) -> FopenFlags {
        if flags & libc::O_DIRECT != 0 || self.cfg.direct_io {
            FopenFlags::FOPEN_DIRECT_IO
        } else if keep {
            FopenFlags::FOPEN_KEEP_CACHE
        } else {
            FopenFlags::empty()
        }
    }

    /// Whether the kernel may keep node `ino`'s page cache at this open of
    /// `path`. Close-to-open asks that an open see what another client
    /// wrote before it: another client's open for writing (or create,
    /// truncate, setattr) in the directory breaks this mount's lease of it
    /// first, and no lease is granted while it holds the file open for
    /// writing. So the cache may stay if the lease under which it was last
    /// dropped is still the directory's lease, and for at most
    /// `lease_timeout` (changes made on the server by other programs than
    /// lwio send no break; a reconnection, whose server may number leases
    /// anew, starts over). Otherwise the cache is dropped, and the current
    /// lease (if any) recorded for the next open.
    fn keep_cache(&self, ino: u64, path: &str) -> bool {
        if !self.cfg.keep_cache || !self.leasing() {
            return false;
        }
        let gen = self.shared.client_gen.load(Ordering::Acquire);
        let lease = split(path).and_then(|(dir, _)| lock(&self.shared.leases).lease_of(&dir));
        let mut k = lock(&self.cached);
        match (lease, k.get(&ino)) {
            (Some(l), Some(&(g, was, at)))
                if g == gen && l == was && at.elapsed() < self.cfg.lease_ttl =>
            {
                true
            }
            (Some(l), _) => {
                k.insert(ino, (gen, l, std::time::Instant::now()));
                false
            }
            (None, _) => {
                k.remove(&ino);
                false
            }
        }
    }

    fn read_into(&self, f: &File, offset: u64, size: u32) -> lwio_client::Result<Vec<u8>> {
        let mut buf = vec![0u8; size as usize];
        let mut done = 0usize;
        while done < buf.len() {
            match f.read_at(&mut buf[done..], offset + done as u64) {
                Ok(0) => break,
                Ok(n) => done += n,
                Err(e) => {
                    if done > 0 {
                        break;
                    }
                    return Err(e);
                }
            }
        }
        buf.truncate(done);
        Stats::add(&self.stats.reads, 1);
        Stats::add(&self.stats.read_bytes, done as u64);
        Ok(buf)
    }

    fn write_all(&self, f: &File, offset: u64, data: &[u8]) -> lwio_client::Result<u32> {
        let mut done = 0usize;
        while done < data.len() {
            match f.write_at(&data[done..], offset + done as u64) {
                Ok(0) => return Err(lwio_client::Error::Io("write made no progress".into())),
                Ok(n) => done += n,
                Err(e) => {
                    if done > 0 {
                        break;
                    }
                    return Err(e);
                }
            }
        }
        Stats::add(&self.stats.writes, 1);
        Stats::add(&self.stats.write_bytes, done as u64);
        Ok(done as u32)
    }

    /// An open directory's listing, and whether it came under a lease.
    fn readdir_entries(&self, fh: FileHandle) -> Res<(Arc<Listing>, bool)> {
        lock(&self.dirs).get(&fh.0).cloned().ok_or(libc::EBADF)
    }

    /// A node id for a listed entry: the looked-up one if the kernel knows
    /// it, else a stable stand-in (readdir's d_ino is informational; the
    /// kernel takes the real id from the lookup that follows).
    fn listed_ino(&self, path: &str) -> u64 {
        if let Some(i) = lock(&self.shared.inodes).peek(path) {
            return i;
        }
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in path.bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
        }
        h | (1 << 63)
    }

    fn remove(&self, parent: INodeNo, name: &OsStr, kind: RemoveKind, reply: ReplyEmpty) {
        let r = (|| -> Res<()> {
            let path = self.child(parent, name)?;
            let export = &self.export;
            self.side(|s| s.remove_kind(export, &path, kind))?;
            lock(&self.shared.inodes).unlinked(&path);
            self.own_change(&path, Own::Removed);
            if kind == RemoveKind::Dir {
                // Our lease on the removed directory: give it back.
                let gone = lock(&self.shared.leases).drop_tree(&path);
                for id in gone {
                    let _ = self.side(|s| s.release_lease(id));
                }
            }
            Ok(())
        })();
        match r {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(err(e)),
        }
    }
}

/// What this client itself did to an entry (its own changes keep its own
/// lease cache right; they break only other clients' leases).
enum Own<'a> {
    /// Created or changed, with the attributes the server answered.
    Is(&'a AttrX),
    Removed,
    /// Changed in a way only the server knows (a rename target, a write
    /// past the kernel's cache).
    Stale,
    /// Written by this mount up to this byte.
    Wrote(u64),
}

/// `t` in nanoseconds since the Unix epoch.
fn epoch_ns(t: SystemTime) -> i64 {
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => i64::try_from(d.as_nanos()).unwrap_or(i64::MAX),
        Err(e) => -i64::try_from(e.duration().as_nanos()).unwrap_or(i64::MAX),
    }
}

impl LwioFs {
    /// Node `ino`'s directory and name, where leases are on (its
    /// attributes may then be in the lease cache).
    fn leased_name(&self, ino: INodeNo) -> Option<(String, String)> {
        if !self.leasing() {
            return None;
        }
        split(&self.path(ino).ok()?)
    }

    /// Whether attributes `a` are of node `ino`'s file on the server (a
    /// name's entry in the lease cache, or an answer by handle).
    fn is_node(&self, ino: INodeNo, a: &AttrX) -> bool {
        lock(&self.shared.inodes).server_ino(ino.0) == Some(a.ino)
    }

    /// The kernel wrote node `ino`'s times back (write-back cache): kept in
    /// the lease cache when the directory is leased and the name is still
    /// this file; the attributes to answer with, or `None` to ask the
    /// server as usual.
    fn times_written_back(
        &self,
        ino: INodeNo,
        mtime: SystemTime,
        ctime: Option<SystemTime>,
    ) -> Option<AttrX> {
        let (dir, leaf) = self.leased_name(ino)?;
        let mut c = lock(&self.shared.leases);
        match c.lookup(&dir, &leaf) {
            Some(Hit::Found(mut a)) if self.is_node(ino, &a) => {
                a.mtime_ns = epoch_ns(mtime);
                a.ctime_ns = ctime.map_or(a.ctime_ns, epoch_ns);
                c.put(&dir, &leaf, &a);
                Some(a)
            }
            _ => None,
        }
    }

    /// The kernel's entry and attribute lifetimes for an entry of `dir`:
    /// long under a lease (a break invalidates them), else the options'.
    fn ttls(&self, leased: bool) -> (Duration, Duration) {
        if leased {
            (self.cfg.lease_ttl, self.cfg.lease_ttl)
        } else {
            (self.cfg.entry_ttl, self.cfg.attr_ttl)
        }
    }

    fn leasing(&self) -> bool {
        self.shared.leasing.load(Ordering::Relaxed)
    }

    fn own_change(&self, path: &str, what: Own) {
        if !self.leasing() {
            return;
        }
        let Some((dir, name)) = split(path) else {
            return;
        };
        let mut c = lock(&self.shared.leases);
        match what {
            Own::Is(a) => c.put(&dir, &name, a),
            Own::Removed => c.del(&dir, &name),
            Own::Stale => c.stale(&dir, &name),
            Own::Wrote(end) => c.wrote(&dir, &name, end, epoch_ns(SystemTime::now())),
        }
    }

    /// The listing of directory `path`: from its lease when it has one,
    /// else from the server (taking a lease first where leases are on, so
    /// that the listing can be kept). (listing, from a lease).
    fn dir_listing(&self, path: &str) -> Res<(Arc<Listing>, bool)> {
        let export = &self.export;
        if !self.leasing() {
            return Ok((Arc::new(self.side(|s| s.list_dir_x(export, path))?), false));
        }
        if let Some(l) = lock(&self.shared.leases).listing(path) {
            Stats::add(&self.stats.lease_hits, 1);
            return Ok((l, true));
        }
        let held = lock(&self.shared.leases).lease_of(path);
        let lease = match held {
            Some(id) => Some(id),
            None => self.take_lease(path),
        };
        let list = self.side(|s| s.list_dir_x(export, path))?;
        match lease {
            Some(id) => {
                lock(&self.shared.leases).install(path, id, &list);
                Ok((Arc::new(list), true))
            }
            None => Ok((Arc::new(list), false)),
        }
    }

    /// Ask for a read+handle lease on `path` (giving the coldest one back at
    /// the cap); the lease id if granted.
    fn take_lease(&self, path: &str) -> Option<u64> {
        let coldest = {
            let c = lock(&self.shared.leases);
            (c.len() >= self.cfg.max_leases)
                .then(|| c.coldest())
                .flatten()
        };
        if let Some((dir, id)) = coldest {
            lock(&self.shared.leases).forget(&dir);
            let _ = self.side(|s| s.release_lease(id));
        }
        let export = &self.export;
        let want = lwio_side::codec::LEASE_READ | lwio_side::codec::LEASE_HANDLE;
        match self.side(|s| s.lease_dir(export, path, want)) {
            Ok((id, g)) if id != 0 && g != 0 => {
                if lock(&self.shared.leases).granted(path, id) {
                    Stats::add(&self.stats.leases_granted, 1);
                    Some(id)
                } else {
                    None
                }
            }
            Ok(_) => None,
            Err(e) => {
                debug!(path, errno = e, "lease");
                None
            }
        }
    }
}

impl Filesystem for LwioFs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> io::Result<()> {
        let _ = config.set_max_write(self.cfg.max_io);
        let _ = config.set_max_readahead(self.cfg.max_io);
        // readdirplus: a listing carries every entry's attributes, so `ls -l`
        // and `find -ls` need no lookup round trip per entry (the kernel
        // picks plain readdir or readdirplus itself: READDIRPLUS_AUTO).
        let want = InitFlags::FUSE_ATOMIC_O_TRUNC
            | InitFlags::FUSE_PARALLEL_DIROPS
            | InitFlags::FUSE_DO_READDIRPLUS
            | InitFlags::FUSE_READDIRPLUS_AUTO
            // fcntl locks are the server's, so they hold across mounts;
            // flock(2) locks too, as whole-file locks of their open file
            // (as NFS does: they conflict with fcntl locks of others).
            | InitFlags::FUSE_POSIX_LOCKS
            | InitFlags::FUSE_FLOCK_LOCKS;
        if let Err(missing) = config.add_capabilities(want) {
            debug!(?missing, "kernel lacks FUSE capabilities");
        }
        if self.cfg.writeback_cache
            && config
                .add_capabilities(InitFlags::FUSE_WRITEBACK_CACHE)
                .is_err()
        {
            warn!("writeback_cache: the kernel does not offer FUSE's write-back cache; writes stay synchronous");
        }
        Ok(())
    }

    fn destroy(&mut self) {
        self.shared.closing.store(true, Ordering::Release);
        let files: Vec<_> = lock(&self.files)
            .drain()
            .map(|(_, o)| o.current())
            .collect();
        for f in files {
            if let Ok(f) = Arc::try_unwrap(f) {
                let _ = f.close();
            }
        }
        tracing::info!(stats = %self.stats.summary(), "unmounted");
    }

    fn lookup(&self, req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let _t = self.stats.ops.time(Op::Lookup);
        let _as = Acting::of(req);
        Stats::add(&self.stats.lookups, 1);
        let path = match self.child(parent, name) {
            Ok(p) => p,
            Err(e) => return reply.error(err(e)),
        };
        if let (true, Some((dir, leaf))) = (self.leasing(), split(&path)) {
            // Answered under the cache lock (see `entry`).
            let mut c = lock(&self.shared.leases);
            match c.lookup(&dir, &leaf) {
                Some(Hit::Found(a)) => {
                    Stats::add(&self.stats.lease_hits, 1);
                    return self.reply_entry(&path, &a, true, reply);
                }
                Some(Hit::Absent) => {
                    Stats::add(&self.stats.lease_hits, 1);
                    return reply.error(err(libc::ENOENT));
                }
                None => {}
            }
        }
        match self.stat(&path) {
            Ok(a) => {
                if self.leasing() {
                    self.own_change(&path, Own::Is(&a));
                }
                self.entry(&path, &a, reply)
            }
            Err(e) => {
                if e == libc::ENOENT {
                    self.own_change(&path, Own::Removed);
                }
                reply.error(err(e))
            }
        }
    }

    fn forget(&self, _req: &Request, ino: INodeNo, nlookup: u64) {
        lock(&self.shared.inodes).forget(ino.0, nlookup);
    }

    fn getattr(&self, req: &Request, ino: INodeNo, fh: Option<FileHandle>, reply: ReplyAttr) {
        let _t = self.stats.ops.time(Op::Getattr);
        let _as = Acting::of(req);
        // Under the directory's lease the name still means this node (any
        // other client's rename or unlink breaks the lease first, and ours
        // update the cache), so the cache answers, also for an fstat or an
        // lseek to the end (asked by handle) while the server's inode is
        // the node's. Else an fstat asks by handle: right even after the
        // name was unlinked or renamed by someone else.
        let leased = self.leased_name(ino);
        let mut gen = None;
        if let Some((dir, leaf)) = &leased {
            let mut c = lock(&self.shared.leases);
            match c.lookup(dir, leaf) {
                Some(Hit::Found(a)) if fh.is_none() || self.is_node(ino, &a) => {
                    Stats::add(&self.stats.lease_hits, 1);
                    let (_, ttl) = self.ttls(true);
                    return reply.attr(&ttl, &self.attr(ino.0, &a));
                }
                _ => gen = Some(c.gen()),
            }
        }
        let r = match self.file_for(ino, fh) {
            Ok(Some(f)) => self.on_file(&f, |s, h| s.stat_handle(h)),
            Ok(None) => self.path(ino).and_then(|p| self.stat(&p)),
            Err(e) => Err(e),
        };
        // Kept for the next question if nothing changed meanwhile (and,
        // asked by handle, if the name is still this file).
        if let (Ok(a), Some((dir, leaf)), Some(gen)) = (&r, &leased, gen) {
            if fh.is_none() || self.is_node(ino, a) {
                lock(&self.shared.leases).fill(dir, leaf, a, gen);
            }
        }
        self.reply_attr(ino, r, reply)
    }

    fn setattr(
        &self,
        req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        ctime: Option<SystemTime>,
        fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let _t = self.stats.ops.time(Op::Setattr);
        let _as = Acting::of(req);
        // Under the write-back cache the kernel writes a file's times back
        // (mtime and ctime, by handle, nothing else) whenever it writes its
        // pages back: at every fsync. The server's own writes of those pages
        // set its mtime already, so under the directory's lease the mount
        // keeps the kernel's times in its cache and answers without a round
        // trip (docs/mount.md, "Write-back").
        if let (true, Some(_), Some(TimeOrNow::SpecificTime(m)), None, None, None, None, None) = (
            self.cfg.writeback_cache,
            fh,
            mtime,
            mode,
            uid,
            gid,
            size,
            atime,
        ) {
            if let Some(a) = self.times_written_back(ino, m, ctime) {
                Stats::add(&self.stats.lease_hits, 1);
                let (_, ttl) = self.ttls(true);
                return reply.attr(&ttl, &self.attr(ino.0, &a));
            }
        }
        let r = (|| -> Res<AttrX> {
            if self.cfg.read_only {
                return Err(libc::EROFS);
            }
            let t = |t: Option<TimeOrNow>| {
                t.map(|t| match t {
                    TimeOrNow::Now => SetTime::Now,
                    TimeOrNow::SpecificTime(st) => SetTime::At(epoch_ns(st)),
                })
            };
            let set = SetAttr {
                mode: mode.map(|m| m & 0o7777),
                uid,
                gid,
                size,
                atime: t(atime),
                mtime: t(mtime),
            };
            let a = match self.file_for(ino, fh)? {
                Some(f) => self.on_file(&f, |s, h| s.set_attr_handle(h, &set))?,
                None => {
                    let path = self.path(ino)?;
                    let export = &self.export;
                    self.side(|s| s.set_attr(export, &path, &set))?
                }
            };
            if let Ok(p) = self.path(ino) {
                self.own_change(&p, Own::Is(&a));
            }
            Ok(a)
        })();
        self.reply_attr(ino, r, reply)
    }

    fn mkdir(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        reply: ReplyEntry,
    ) {
        let _t = self.stats.ops.time(Op::Mkdir);
        let _as = Acting::of(req);
        let r = (|| -> Res<(String, AttrX)> {
            let path = self.child(parent, name)?;
            let export = &self.export;
            self.side(|s| s.mkdir(export, &path, mode & !umask & 0o7777, false))?;
            let a = self.stat(&path)?;
            self.own_change(&path, Own::Is(&a));
            Ok((path, a))
        })();
        match r {
            Ok((p, a)) => self.entry(&p, &a, reply),
            Err(e) => reply.error(err(e)),
        }
    }

    fn unlink(&self, req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let _t = self.stats.ops.time(Op::Remove);
        let _as = Acting::of(req);
        self.remove(parent, name, RemoveKind::NotDir, reply)
    }

    fn rmdir(&self, req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let _t = self.stats.ops.time(Op::Remove);
        let _as = Acting::of(req);
        self.remove(parent, name, RemoveKind::Dir, reply)
    }

    fn symlink(
        &self,
        req: &Request,
        parent: INodeNo,
        link_name: &OsStr,
        target: &std::path::Path,
        reply: ReplyEntry,
    ) {
        let _t = self.stats.ops.time(Op::Mkdir);
        let _as = Acting::of(req);
        let r = (|| -> Res<(String, AttrX)> {
            let path = self.child(parent, link_name)?;
            let target = target.to_str().ok_or(libc::EILSEQ)?;
            let export = &self.export;
            let a = self.side(|s| s.symlink(export, &path, target))?;
            self.own_change(&path, Own::Is(&a));
            Ok((path, a))
        })();
        match r {
            Ok((p, a)) => self.entry(&p, &a, reply),
            Err(e) => reply.error(err(e)),
        }
    }

    fn link(
        &self,
        req: &Request,
        ino: INodeNo,
        newparent: INodeNo,
        newname: &OsStr,
        reply: ReplyEntry,
    ) {
        let _t = self.stats.ops.time(Op::Other);
        let _as = Acting::of(req);
        let r = (|| -> Res<(String, AttrX)> {
            let from = self.path(ino)?;
            let to = self.child(newparent, newname)?;
            let export = &self.export;
            // An export without allow_hardlinks refuses as a file system
            // without hard links does: link(2)'s EPERM.
            let a = self.side(|s| s.link(export, &from, &to)).map_err(|e| {
                if e == libc::EACCES {
                    libc::EPERM
                } else {
                    e
                }
            })?;
            self.own_change(&to, Own::Is(&a));
            // The source's link count changed too.
            self.own_change(&from, Own::Stale);
            Ok((to, a))
        })();
        match r {
            Ok((p, a)) => self.entry(&p, &a, reply),
            Err(e) => reply.error(err(e)),
        }
    }

    fn fallocate(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        let _t = self.stats.ops.time(Op::Fallocate);
        let r = self.file(fh).and_then(|f| {
            if mode as u32 & !lwio_side::codec::FALLOC_KNOWN != 0 {
                return Err(libc::EOPNOTSUPP);
            }
            self.on_file(&f, |s, h| s.fallocate(h, mode as u32, offset, length))
        });
        if let Ok(p) = self.path(ino) {
            self.own_change(&p, Own::Stale);
        }
        match r {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(err(e)),
        }
    }

    fn lseek(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: i64,
        whence: i32,
        reply: fuser::ReplyLseek,
    ) {
        let _t = self.stats.ops.time(Op::Lseek);
        // The kernel handles SEEK_SET/CUR/END itself; DATA and HOLE ask the
        // server's file system.
        let r = self.file(fh).and_then(|f| {
            let w = match whence {
                libc::SEEK_DATA => lwio_side::codec::SEEK_DATA,
                libc::SEEK_HOLE => lwio_side::codec::SEEK_HOLE,
                _ => return Err(libc::EINVAL),
            };
            let off = u64::try_from(offset).map_err(|_| libc::ENXIO)?;
            self.on_file(&f, |s, h| s.seek(h, off, w))
        });
        match r {
            Ok(o) => reply.offset(o as i64),
            Err(e) => reply.error(err(e)),
        }
    }

    fn copy_file_range(
        &self,
        _req: &Request,
        _ino_in: INodeNo,
        fh_in: FileHandle,
        offset_in: u64,
        ino_out: INodeNo,
        fh_out: FileHandle,
        offset_out: u64,
        len: u64,
        _flags: fuser::CopyFileRangeFlags,
        reply: ReplyWrite,
    ) {
        let _t = self.stats.ops.time(Op::Other);
        // Copied on the server: no byte crosses to this client.
        let r = self.file(fh_in).and_then(|a| {
            let b = self.file(fh_out)?;
            let (h_in, h_out) = (a.handle(), b.handle());
            let len = len.min(lwio_side::codec::COPY_RANGE_MAX);
            self.side(|s| s.copy_range(h_in, offset_in, h_out, offset_out, len))
        });
        if let Ok(p) = self.path(ino_out) {
            self.own_change(&p, Own::Stale);
        }
        match r {
            Ok(n) => reply.written(n as u32),
            Err(e) => reply.error(err(e)),
        }
    }

    fn getlk(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        lock_owner: LockOwner,
        start: u64,
        end: u64,
        typ: i32,
        _pid: u32,
        reply: fuser::ReplyLock,
    ) {
        let _t = self.stats.ops.time(Op::Lock);
        let r = self.file(fh).and_then(|f| {
            let (kind, len) = lock_args(typ, start, end)?;
            self.on_file(&f, |s, h| s.test_lock(h, lock_owner.0, kind, start, len))
        });
        match r {
            Ok(None) => reply.locked(start, end, libc::F_UNLCK, 0),
            Ok(Some((kind, s, len))) => {
                let end = if len == 0 {
                    i64::MAX as u64
                } else {
                    s + len - 1
                };
                let typ = if kind == 2 {
                    libc::F_WRLCK
                } else {
                    libc::F_RDLCK
                };
                // The holder is another client: no local pid to name.
                reply.locked(s, end, typ, 0)
            }
            Err(e) => reply.error(err(e)),
        }
    }

    fn setlk(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        lock_owner: LockOwner,
        start: u64,
        end: u64,
        typ: i32,
        _pid: u32,
        sleep: bool,
        reply: ReplyEmpty,
    ) {
        let _t = self.stats.ops.time(Op::Lock);
        let r = self.file(fh).and_then(|f| {
            let (kind, len) = lock_args(typ, start, end)?;
            if kind != 0 {
                lock(&self.lockers)
                    .entry(fh.0)
                    .or_default()
                    .insert(lock_owner.0);
            }
            // F_SETLKW: the server never waits (a waiting lock would hold
            // this mount's side channel); we retry, backing off to 50 ms.
            let mut nap = Duration::from_millis(1);
            loop {
                match self.on_file(&f, |s, h| s.lock(h, lock_owner.0, kind, start, len)) {
                    Err(libc::EAGAIN) if sleep => {
                        std::thread::sleep(nap);
                        nap = (nap * 2).min(Duration::from_millis(50));
                    }
                    r => return r,
                }
            }
        });
        match r {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(err(e)),
        }
    }

    fn readlink(&self, req: &Request, ino: INodeNo, reply: ReplyData) {
        let _t = self.stats.ops.time(Op::Other);
        let _as = Acting::of(req);
        let r = self.path(ino).and_then(|p| {
            let export = &self.export;
            self.side(|s| s.readlink(export, &p))
        });
        match r {
            Ok(t) => reply.data(t.as_bytes()),
            Err(e) => reply.error(err(e)),
        }
    }

    fn rename(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        let _t = self.stats.ops.time(Op::Rename);
        let _as = Acting::of(req);
        let r = (|| -> Res<()> {
            let from = self.child(parent, name)?;
            let to = self.child(newparent, newname)?;
            let mut f = 0;
            if flags.contains(RenameFlags::RENAME_NOREPLACE) {
                f |= RENAME_NOREPLACE;
            }
            let exchange = flags.contains(RenameFlags::RENAME_EXCHANGE);
            if exchange {
                f |= RENAME_EXCHANGE;
            }
            let export = &self.export;
            // The server refuses a rename across its file systems as
            // Unsupported: that is EXDEV, which mv(1) handles by copying.
            self.side(|s| s.rename_flags(export, &from, &to, f))
                .map_err(|e| {
                    if e == libc::EOPNOTSUPP {
                        libc::EXDEV
                    } else {
                        e
                    }
                })?;
            {
                let mut t = lock(&self.shared.inodes);
                if exchange {
                    t.exchanged(&from, &to);
                } else {
                    t.renamed(&from, &to);
                }
            }
            if exchange {
                self.own_change(&from, Own::Stale);
            } else {
                self.own_change(&from, Own::Removed);
            }
            self.own_change(&to, Own::Stale);
            // Our leases at and below both paths named the old tree; the
            // server dropped them with the rename.
            let mut c = lock(&self.shared.leases);
            c.drop_tree(&from);
            c.drop_tree(&to);
            Ok(())
        })();
        match r {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(err(e)),
        }
    }

    fn open(&self, req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        let _t = self.stats.ops.time(Op::Open);
        let _as = Acting::of(req);
        let r = self.path(ino).and_then(|p| {
            let f = self.open_path(&p, flags.0, None)?;
            if flags.0 & libc::O_ACCMODE != libc::O_RDONLY {
                self.own_change(&p, Own::Stale);
            }
            Ok((f, self.keep_cache(ino.0, &p)))
        });
        match r {
            Ok((f, keep)) => reply.opened(
                FileHandle(self.add_file(ino.0, flags.0, f)),
                self.fopen_flags(flags.0, keep),
            ),
            Err(e) => reply.error(err(e)),
        }
    }

    fn create(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        let _t = self.stats.ops.time(Op::Create);
        let _as = Acting::of(req);
        let r = (|| -> Res<(String, File, AttrX)> {
            let path = self.child(parent, name)?;
            let f = self.open_path(&path, flags, Some(mode & !umask & 0o7777))?;
            let a = self.stat(&path)?;
            // Written next, through the data path.
            self.own_change(&path, Own::Stale);
            Ok((path, f, a))
        })();
        match r {
            Ok((path, f, a)) => {
                let ino = lock(&self.shared.inodes).lookup(&path);
                lock(&self.shared.inodes).set_server_ino(ino, a.ino);
                let fh = self.add_file(ino, flags, f);
                // A new (or truncated) file: nothing of it to keep, but the
                // lease is recorded for its next open.
                let keep = self.keep_cache(ino, &path);
                reply.created(
                    &self.cfg.attr_ttl,
                    &self.attr(ino, &a),
                    Generation(0),
                    FileHandle(fh),
                    self.fopen_flags(flags, keep),
                );
            }
            Err(e) => reply.error(err(e)),
        }
    }

    fn read(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let _t = self.stats.ops.time(Op::Read);
        match self.with_file(fh, |f| self.read_into(f, offset, size)) {
            Ok(buf) => reply.data(&buf),
            Err(e) => reply.error(err(e)),
        }
    }

    fn write(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: fuser::WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        let _t = self.stats.ops.time(Op::Write);
        let r = self.with_file(fh, |f| self.write_all(f, offset, data));
        if self.cfg.direct_io
            || self
                .entry_of(fh)
                .is_ok_and(|o| o.flags & libc::O_DIRECT != 0)
        {
            // Written past the kernel's page cache: the next open drops it.
            lock(&self.cached).remove(&ino.0);
        }
        if let (true, Ok(p)) = (self.leasing(), self.path(ino)) {
            match &r {
                Ok(n) => self.own_change(&p, Own::Wrote(offset + u64::from(*n))),
                Err(_) => self.own_change(&p, Own::Stale),
            }
        }
        match r {
            Ok(n) => reply.written(n),
            Err(e) => reply.error(err(e)),
        }
    }

    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        let _t = self.stats.ops.time(Op::Flush);
        // Writes are synchronous (no write-back cache): nothing to push.
        // A close drops the closing owner's locks on the file (POSIX).
        let r = self.file(fh).and_then(|f| {
            let had = lock(&self.lockers)
                .get_mut(&fh.0)
                .is_some_and(|o| o.remove(&lock_owner.0));
            if had {
                self.on_file(&f, |s, h| s.lock(h, lock_owner.0, 0, 0, 0))?;
            }
            Ok(())
        });
        match r {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(err(e)),
        }
    }

    /// The handoff of liblwio_preload.so (docs/preload.md): how a program
    /// of the mount's own user reaches this open file over RDMA itself.
    fn ioctl(
        &self,
        req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: fuser::IoctlFlags,
        cmd: u32,
        _in_data: &[u8],
        out_size: u32,
        reply: fuser::ReplyIoctl,
    ) {
        use lwio_client::handoff::{HANDOFF_MAX, IOC_HANDOFF};
        if cmd != IOC_HANDOFF {
            return reply.error(Errno::ENOTTY);
        }
        // SAFETY: getuid has no preconditions and cannot fail.
        let owner = unsafe { libc::getuid() };
        if !self.cfg.preload || (req.uid() != owner && req.uid() != 0) {
            debug!(uid = req.uid(), "handoff refused");
            return reply.error(Errno::EPERM);
        }
        let r = (|| -> Res<String> {
            let o = self.entry_of(fh)?;
            self.fresh(&o)?;
            let f = o.current();
            let ino = self.with_file(fh, |f| f.stat())?.ino;
            let (_, path) = f.export_path();
            Ok(self.client().handoff(&self.export, path, ino).encode())
        })();
        match r {
            Ok(text) if text.len() < HANDOFF_MAX.min(out_size as usize) => {
                let mut out = text.into_bytes();
                out.push(0);
                reply.ioctl(0, &out);
            }
            Ok(_) => reply.error(Errno::ERANGE),
            Err(e) => reply.error(err(e)),
        }
    }

    fn release(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        let _t = self.stats.ops.time(Op::Release);
        let f = lock(&self.files).remove(&fh.0).map(|o| o.current());
        // The server drops the handle's locks with it.
        lock(&self.lockers).remove(&fh.0);
        // A read or write still running on another thread holds the other
        // reference; the file then closes when that one drops it.
        if let Some(Ok(f)) = f.map(Arc::try_unwrap) {
            if let Err(e) = f.close() {
                warn!(error = %e, "close");
            }
        }
        reply.ok();
    }

    fn fsync(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        datasync: bool,
        reply: ReplyEmpty,
    ) {
        let _t = self.stats.ops.time(Op::Fsync);
        let r = self.with_file(fh, |f| {
            if !f.syncs_on_rdma() {
                Stats::add(&self.stats.side_calls, 1);
            }
            if datasync {
                f.sync_data()
            } else {
                f.sync_all()
            }
        });
        match r {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(err(e)),
        }
    }

    fn opendir(&self, req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        let _t = self.stats.ops.time(Op::Opendir);
        let _as = Acting::of(req);
        let r = self.path(ino).and_then(|p| self.dir_listing(&p));
        match r {
            Ok((list, leased)) => {
                let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
                lock(&self.dirs).insert(fh, (list, leased));
                // Under a lease the kernel may keep the listing too: a break
                // invalidates it (and our own changes do, in the kernel).
                let flags = if leased {
                    FopenFlags::FOPEN_CACHE_DIR | FopenFlags::FOPEN_KEEP_CACHE
                } else {
                    FopenFlags::empty()
                };
                reply.opened(FileHandle(fh), flags);
            }
            Err(e) => reply.error(err(e)),
        }
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        let _t = self.stats.ops.time(Op::Readdir);
        let r = self
            .readdir_entries(fh)
            .and_then(|l| Ok((l.0, self.path(ino)?)));
        let (list, dir) = match r {
            Ok(v) => v,
            Err(e) => return reply.error(err(e)),
        };
        // Offsets: 1 after ".", 2 after "..", 3 + i after entry i.
        let mut i = offset;
        while i < 2 + list.len() as u64 {
            let full = match i {
                0 => reply.add(ino, 1, FileType::Directory, "."),
                1 => reply.add(INodeNo(1), 2, FileType::Directory, ".."),
                _ => {
                    let (name, a) = &list[(i - 2) as usize];
                    let ino = self.listed_ino(&join(&dir, name));
                    reply.add(INodeNo(ino), i + 1, kind_of(a), name)
                }
            };
            if full {
                break;
            }
            i += 1;
        }
        reply.ok();
    }

    fn readdirplus(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        mut reply: fuser::ReplyDirectoryPlus,
    ) {
        let _t = self.stats.ops.time(Op::Readdir);
        let r = self
            .readdir_entries(fh)
            .and_then(|l| Ok((l, self.path(ino)?)));
        let ((list, leased), dir) = match r {
            Ok(v) => v,
            Err(e) => return reply.error(err(e)),
        };
        // Entries from a listing taken under a lease live long in the
        // kernel, if the lease still holds now (checked, and replied, under
        // the cache lock: see `entry`).
        let c = lock(&self.shared.leases);
        let leased = leased && self.leasing() && c.lease_of(&dir).is_some();
        let (_, ttl) = self.ttls(leased);
        // "." and "..": the kernel makes no entries (nor lookup counts) of
        // them, so any directory attributes do.
        let dot = FileAttr {
            ino,
            kind: FileType::Directory,
            ..self.attr(ino.0, &list.first().map(|e| e.1).unwrap_or(DIR_ATTR))
        };
        let mut i = offset;
        while i < 2 + list.len() as u64 {
            let full = match i {
                0 => reply.add(ino, 1, ".", &ttl, &dot, Generation(0)),
                1 => reply.add(INodeNo(1), 2, "..", &ttl, &dot, Generation(0)),
                _ => {
                    // Each entry handed over is a lookup the kernel will
                    // forget; one that did not fit is not.
                    let (name, a) = &list[(i - 2) as usize];
                    let path = join(&dir, name);
                    let child = {
                        let mut t = lock(&self.shared.inodes);
                        let child = t.lookup(&path);
                        t.set_server_ino(child, a.ino);
                        child
                    };
                    let full = reply.add(
                        INodeNo(child),
                        i + 1,
                        name,
                        &ttl,
                        &self.attr(child, a),
                        Generation(0),
                    );
                    if full {
                        lock(&self.shared.inodes).forget(child, 1);
                    }
                    full
                }
            };
            if full {
                break;
            }
            i += 1;
        }
        reply.ok();
        drop(c);
    }

    fn releasedir(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        reply: ReplyEmpty,
    ) {
        lock(&self.dirs).remove(&fh.0);
        reply.ok();
    }

    fn fsyncdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        // The server fsyncs the directory: the names created, removed and
        // renamed in it are on its disk (docs/durability.md).
        let export = &self.export;
        match self
            .path(ino)
            .and_then(|p| self.side(|s| s.fsync_dir(export, &p)))
        {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(err(e)),
        }
    }

    fn mknod(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        rdev: u32,
        reply: ReplyEntry,
    ) {
        let _as = Acting::of(req);
        let r = (|| -> Res<(String, AttrX)> {
            if self.cfg.read_only {
                return Err(libc::EROFS);
            }
            let path = self.child(parent, name)?;
            let export = &self.export;
            let mode = mode & libc::S_IFMT | mode & !umask & 0o7777;
            let a = self.side(|s| s.mknod(export, &path, mode, u64::from(rdev)))?;
            self.own_change(&path, Own::Is(&a));
            Ok((path, a))
        })();
        match r {
            Ok((p, a)) => self.entry(&p, &a, reply),
            Err(e) => reply.error(err(e)),
        }
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        let _t = self.stats.ops.time(Op::Statfs);
        let export = &self.export;
        match self.side(|s| s.statfs(export)) {
            Ok(f) => reply.statfs(
                f.blocks, f.bfree, f.bavail, f.files, f.ffree, f.bsize, f.namelen, f.frsize,
            ),
            Err(e) => reply.error(err(e)),
        }
    }
}
