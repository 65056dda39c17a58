//! The descriptor cache: open files (Fids) without one descriptor each.
//!
//! An open file of the table ([`super::table::OpenFile`]) keeps a [`Fid`]:
//! its identity (device, inode and [`super::table::file_id`]), the flags it
//! was opened with, and a way to open it again: a file handle
//! (`name_to_handle_at`, reopened with `open_by_handle_at` on the export's
//! root) where the server may use handles, else its path beneath the export.
//! The descriptor itself is cached: at most `max` of them are open, and past
//! that the least recently used are closed, in batches, and reopened on their
//! next use (docs/descriptor-cache.md).
//!
//! A reopened descriptor must be the same file: its identity is checked, and
//! a file removed or replaced in between fails with `ESTALE` ("stale"), never
//! with another file's bytes. Never closed early (pinned): descriptors that
//! could not be reopened as they are — files unlinked while open (link count
//! 0), memory objects and anything else without a path in an export (memfds,
//! `O_TMPFILE`), FIFOs — and, for as long as it lasts, a descriptor that an
//! operation holds ([`FdRef`]): eviction never closes a descriptor under an
//! I/O. Byte-range locks live on descriptions of their own
//! (`OpenFile::locks`), never on the cached one, so closing it loses none;
//! those descriptions count against the bound too ([`FdCache::reserve_lock`]).
//! A reopened descriptor has the open's status flags (`O_DIRECT`,
//! `O_DSYNC`, `O_APPEND`, `O_NOATIME`), never `O_CREAT`, `O_EXCL` or
//! `O_TRUNC`.

use std::collections::HashMap;
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use lwio_side::error::{Error, ErrorCode, Result};

use super::{errno, fstat, split_rel_path, Export};

/// `MAX_HANDLE_SZ` of the kernel.
const MAX_HANDLE: usize = 128;

/// `struct file_handle` with room for the largest handle.
#[repr(C)]
#[derive(Clone, Copy)]
struct RawHandle {
    bytes: u32,
    kind: i32,
    data: [u8; MAX_HANDLE],
}

/// A file handle of a file beneath an export (never from a client).
#[derive(Clone)]
pub struct Handle {
    kind: i32,
    data: Box<[u8]>,
}

impl std::fmt::Debug for Handle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Handle(type {}, {} bytes)", self.kind, self.data.len())
    }
}

impl Handle {
    /// The handle of `fd` (its file system's own name for the inode).
    pub(crate) fn of_fd(fd: RawFd) -> std::result::Result<Handle, i32> {
        name_to_handle(fd).map(|(h, _)| h)
    }

    /// Its type and bytes, as fanotify reports a file's handle.
    pub(crate) fn parts(&self) -> (i32, &[u8]) {
        (self.kind, &self.data)
    }
}

/// The handle of `fd` and the id of the mount it is on.
fn name_to_handle(fd: RawFd) -> std::result::Result<(Handle, i32), i32> {
    let mut h = RawHandle {
        bytes: MAX_HANDLE as u32,
        kind: 0,
        data: [0; MAX_HANDLE],
    };
    let mut mount: libc::c_int = 0;
    // SAFETY: `h` is a `struct file_handle` whose `handle_bytes` says how
    // much room follows it (MAX_HANDLE_SZ); the kernel writes at most that,
    // and the mount id into `mount`. The empty path with AT_EMPTY_PATH
    // names `fd` itself.
    let r = unsafe {
        libc::name_to_handle_at(
            fd,
            c"".as_ptr(),
            (&mut h as *mut RawHandle).cast::<libc::file_handle>(),
            &mut mount,
            libc::AT_EMPTY_PATH,
        )
    };
    if r != 0 {
        return Err(errno());
    }
    let n = (h.bytes as usize).min(MAX_HANDLE);
    Ok((
        Handle {
            kind: h.kind,
            data: h.data[..n].into(),
        },
        mount,
    ))
}

/// Open the file of `h` on the file system of `mount_fd`.
fn open_by_handle(mount_fd: RawFd, h: &Handle, flags: i32) -> std::result::Result<OwnedFd, i32> {
    let mut raw = RawHandle {
        bytes: h.data.len() as u32,
        kind: h.kind,
        data: [0; MAX_HANDLE],
    };
    raw.data[..h.data.len()].copy_from_slice(&h.data);
    loop {
        // SAFETY: `raw` is a valid `struct file_handle` of `bytes` bytes
        // (at most MAX_HANDLE_SZ, as name_to_handle_at gave it); the kernel
        // only reads it.
        let r = unsafe {
            libc::open_by_handle_at(
                mount_fd,
                (&mut raw as *mut RawHandle).cast::<libc::file_handle>(),
                flags | libc::O_CLOEXEC | libc::O_NOCTTY,
            )
        };
        if r >= 0 {
            // SAFETY: a fresh descriptor that nothing else owns.
            return Ok(unsafe { OwnedFd::from_raw_fd(r) });
        }
        let e = errno();
        if e != libc::EINTR {
            return Err(e);
        }
    }
}

/// Whether open files of the export rooted at `root` can be reopened by
/// handle: the file system gives handles and this process may use them
/// (`CAP_DAC_READ_SEARCH`). If so, the mount id and the root opened for
/// reading (the mount fd `open_by_handle_at` takes: an O_PATH one fails
/// with EBADF).
pub(super) fn probe_handles(name: &str, root: RawFd) -> Option<(i32, OwnedFd)> {
    // Why not, logged once per export: its open files are reopened by path.
    let by_path = |errno: i32, why: &str| {
        tracing::info!(
            export = name,
            errno,
            "{why}; open files are reopened by path"
        );
    };
    let flags = libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC;
    let dir = super::sys_openat(root, c".", flags, 0)
        .map_err(|e| by_path(e, "cannot open the export's root for reading"))
        .ok()?;
    let (h, mount) = name_to_handle(root)
        .map_err(|e| by_path(e, "no file handles on this file system"))
        .ok()?;
    open_by_handle(dir.as_raw_fd(), &h, libc::O_PATH)
        .map_err(|e| {
            by_path(
                e,
                "open_by_handle_at failed (EPERM: it needs CAP_DAC_READ_SEARCH)",
            )
        })
        .ok()?;
    Some((mount, dir))
}

/// The flags an open file is reopened with: its access mode and status
/// flags as the kernel reports them (`F_GETFL`), less `O_NONBLOCK`.
fn reopen_flags(fd: RawFd) -> i32 {
    // SAFETY: F_GETFL on a descriptor the caller holds; no pointer.
    let fl = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    let keep = libc::O_ACCMODE
        | libc::O_APPEND
        | libc::O_DIRECT
        | libc::O_DSYNC
        | libc::O_SYNC
        | libc::O_NOATIME
        | libc::O_LARGEFILE;
    fl.max(0) & keep
}

/// The stale-handle error (ESTALE's code, `Io`): the open file is gone
/// from where it was. The RDMA phase answers STATUS_FILE_DELETED.
pub fn stale(what: &str, why: &str) -> Error {
    Error::new(
        ErrorCode::from_errno(libc::ESTALE),
        format!(
            "{what}: stale file handle: the file {why} while the server had closed its descriptor"
        ),
    )
}

/// How a Fid is opened again.
#[derive(Debug)]
enum Reopen {
    /// It cannot be: its descriptor stays open (pinned).
    Never,
    /// Beneath `export`, by handle where there is one, else by `path`.
    In {
        export: Arc<Export>,
        path: String,
        handle: Option<Handle>,
    },
}

/// Counters of a [`FdCache`], for metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FdCacheStats {
    /// Fids alive.
    pub fids: usize,
    /// Descriptors the Fids hold open now (pinned ones included).
    pub open: usize,
    /// Of them, pinned (never closed early).
    pub pinned: usize,
    /// Of them, byte-range lock descriptions (`OpenFile::locks`: one per
    /// client lock owner, never closed early).
    pub locks: usize,
    /// The most descriptors held at once.
    pub peak: usize,
    /// Descriptors closed to make room, and reopened on use.
    pub evictions: u64,
    pub reopens: u64,
    /// Reopens that found the file removed or replaced.
    pub stale: u64,
}

/// The bounded set of open descriptors behind the open files.
pub struct FdCache {
    max: usize,
    /// Evictable Fids whose descriptor is open, by id. Lock order: this,
    /// then a Fid's `fd`; an `Arc<Fid>` is never dropped while it is held
    /// (a Fid's drop takes it).
    resident: Mutex<HashMap<u64, Weak<Fid>>>,
    tick: AtomicU64,
    next_id: AtomicU64,
    fids: AtomicUsize,
    open: AtomicUsize,
    pinned: AtomicUsize,
    /// Lock descriptions counted in `open` ([`FdCache::reserve_lock`]).
    locks: AtomicUsize,
    peak: AtomicUsize,
    evictions: AtomicU64,
    reopens: AtomicU64,
    stale: AtomicU64,
}

impl std::fmt::Debug for FdCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FdCache")
            .field("max", &self.max)
            .field("stats", &self.stats())
            .finish()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Descriptors left to everything else when the cache is sized from
/// RLIMIT_NOFILE: half of it (sockets, epoll and event descriptors of the
/// connections, lock descriptions, the side channel's runtime).
pub fn default_max_descriptors() -> usize {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes only into `r`, a live local.
    let cur = if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) } == 0 {
        r.rlim_cur
    } else {
        1024
    };
    usize::try_from(cur / 2).unwrap_or(usize::MAX).max(16)
}

impl FdCache {
    /// A cache of at most `max` (at least 1) open descriptors.
    pub fn new(max: usize) -> Arc<FdCache> {
        Arc::new(FdCache {
            max: max.max(1),
            resident: Mutex::new(HashMap::new()),
            tick: AtomicU64::new(0),
            next_id: AtomicU64::new(1),
            fids: AtomicUsize::new(0),
            open: AtomicUsize::new(0),
            pinned: AtomicUsize::new(0),
            locks: AtomicUsize::new(0),
            peak: AtomicUsize::new(0),
            evictions: AtomicU64::new(0),
            reopens: AtomicU64::new(0),
            stale: AtomicU64::new(0),
        })
    }

    /// The bound on open descriptors.
    pub fn max(&self) -> usize {
        self.max
    }

    pub fn stats(&self) -> FdCacheStats {
        FdCacheStats {
            fids: self.fids.load(Ordering::Relaxed),
            open: self.open.load(Ordering::Relaxed),
            pinned: self.pinned.load(Ordering::Relaxed),
            locks: self.locks.load(Ordering::Relaxed),
            peak: self.peak.load(Ordering::Relaxed),
            evictions: self.evictions.load(Ordering::Relaxed),
            reopens: self.reopens.load(Ordering::Relaxed),
            stale: self.stale.load(Ordering::Relaxed),
        }
    }

    /// A Fid for a freshly opened `file`. `origin`: the export and path it
    /// was opened at (`None`: it cannot be reopened, and stays open).
    pub fn insert(self: &Arc<Self>, file: File, origin: Option<(Arc<Export>, &str)>) -> Arc<Fid> {
        let fd = file.as_raw_fd();
        let st = fstat(fd).ok();
        let regular = st.is_some_and(|s| s.st_mode & libc::S_IFMT == libc::S_IFREG);
        let how = match origin {
            Some((export, path)) if regular => {
                let handle = export.handles.and_then(|mount| match name_to_handle(fd) {
                    Ok((h, m)) if m == mount => Some(h),
                    _ => None,
                });
                Reopen::In {
                    export,
                    path: path.to_string(),
                    handle,
                }
            }
            _ => Reopen::Never,
        };
        let pinned = matches!(how, Reopen::Never);
        let fid = Arc::new(Fid {
            id: self.next_id.fetch_add(1, Ordering::Relaxed),
            cache: self.clone(),
            ident: super::table::file_id(&file),
            flags: reopen_flags(fd),
            how,
            fd: Mutex::new(Some(Arc::new(file))),
            pinned: AtomicBool::new(pinned),
            last: AtomicU64::new(self.tick.fetch_add(1, Ordering::Relaxed) + 1),
        });
        self.fids.fetch_add(1, Ordering::Relaxed);
        if pinned {
            self.pinned.fetch_add(1, Ordering::Relaxed);
        }
        self.opened(&fid, pinned);
        fid
    }

    /// Count a byte-range lock description about to be opened (it lives
    /// outside the cache and is never closed early) against the bound,
    /// closing cached descriptors to make room. `false`, counting nothing,
    /// when even then it would pass the bound: the caller refuses the lock.
    /// [`FdCache::release_lock`] when the description is closed.
    pub fn reserve_lock(&self) -> bool {
        let n = self.open.fetch_add(1, Ordering::Relaxed) + 1;
        self.locks.fetch_add(1, Ordering::Relaxed);
        if n > self.max {
            let (mut held, mut closed) = (Vec::new(), Vec::new());
            {
                let mut res = lock(&self.resident);
                if self.open.load(Ordering::Relaxed) > self.max {
                    self.evict(&mut res, &mut held, &mut closed);
                }
            }
            drop(closed);
            drop(held);
            if self.open.load(Ordering::Relaxed) > self.max {
                self.release_lock();
                return false;
            }
        }
        self.peak
            .fetch_max(self.open.load(Ordering::Relaxed), Ordering::Relaxed);
        true
    }

    /// A lock description of [`FdCache::reserve_lock`] was closed.
    pub fn release_lock(&self) {
        self.open.fetch_sub(1, Ordering::Relaxed);
        self.locks.fetch_sub(1, Ordering::Relaxed);
    }

    /// `fid` has a descriptor open again: count it, make it evictable
    /// (unless pinned) and close the least recently used past the bound.
    fn opened(&self, fid: &Arc<Fid>, pinned: bool) {
        let n = self.open.fetch_add(1, Ordering::Relaxed) + 1;
        self.peak.fetch_max(n, Ordering::Relaxed);
        let (mut held, mut closed) = (Vec::new(), Vec::new());
        {
            let mut res = lock(&self.resident);
            if !pinned {
                res.insert(fid.id, Arc::downgrade(fid));
            }
            if self.open.load(Ordering::Relaxed) > self.max {
                self.evict(&mut res, &mut held, &mut closed);
            }
        }
        // Descriptors closed and Fids let go outside the lock: a Fid's
        // drop takes it.
        drop(closed);
        drop(held);
    }

    /// Close the least recently used evictable descriptors until a
    /// sixteenth of the bound is free (or nothing more can go). The Fids
    /// looked at go to `held`, the descriptors closed to `closed`, both to
    /// be dropped once `res` is unlocked.
    fn evict(
        &self,
        res: &mut HashMap<u64, Weak<Fid>>,
        held: &mut Vec<Arc<Fid>>,
        closed: &mut Vec<Arc<File>>,
    ) {
        let target = self.max - self.max / 16;
        let mut order: Vec<(u64, usize)> = Vec::with_capacity(res.len());
        res.retain(|_, w| match w.upgrade() {
            Some(f) => {
                order.push((f.last.load(Ordering::Relaxed), held.len()));
                held.push(f);
                true
            }
            None => false,
        });
        order.sort_unstable();
        for (_, i) in order {
            if self.open.load(Ordering::Relaxed) <= target {
                break;
            }
            let fid = &held[i];
            let Ok(mut g) = fid.fd.try_lock() else {
                continue; // being reopened by another thread
            };
            let Some(file) = g.as_ref() else {
                res.remove(&fid.id);
                continue;
            };
            if Arc::strong_count(file) > 1 {
                continue; // an operation holds it
            }
            // A file unlinked while open cannot be reopened: keep it.
            if fstat(file.as_raw_fd()).is_ok_and(|s| s.st_nlink == 0) {
                fid.pinned.store(true, Ordering::Relaxed);
                self.pinned.fetch_add(1, Ordering::Relaxed);
                res.remove(&fid.id);
                continue;
            }
            if let Some(file) = g.take() {
                closed.push(file);
                res.remove(&fid.id);
                self.open.fetch_sub(1, Ordering::Relaxed);
                self.evictions.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

/// An open file's identity and cached descriptor.
pub struct Fid {
    id: u64,
    cache: Arc<FdCache>,
    /// [`super::table::file_id`] at open: what a reopen must find.
    ident: u64,
    flags: i32,
    how: Reopen,
    fd: Mutex<Option<Arc<File>>>,
    /// Never closed before the Fid ends.
    pinned: AtomicBool,
    /// The cache's clock at the last use.
    last: AtomicU64,
}

impl std::fmt::Debug for Fid {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fid")
            .field("id", &self.id)
            .field("ident", &self.ident)
            .field("how", &self.how)
            .finish()
    }
}

/// A descriptor held for an operation: the Fid's cached descriptor, which
/// is not closed while this lives. It also holds the Fid (what
/// `OpenFileTable::in_use` counts).
#[derive(Debug, Clone)]
pub struct FdRef {
    file: Arc<File>,
    fid: Arc<Fid>,
}

impl FdRef {
    /// The descriptor, for an io_uring op that keeps it to its completion.
    pub fn arc(&self) -> Arc<File> {
        self.file.clone()
    }

    pub fn fid(&self) -> &Arc<Fid> {
        &self.fid
    }
}

impl std::ops::Deref for FdRef {
    type Target = File;
    fn deref(&self) -> &File {
        &self.file
    }
}

impl AsRawFd for FdRef {
    fn as_raw_fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }
}

impl Fid {
    /// The open descriptor, reopened if it was closed to make room.
    /// `Err` (ESTALE) if the file was removed or replaced meanwhile.
    pub fn get(self: &Arc<Self>) -> Result<FdRef> {
        let c = &self.cache;
        self.last.store(
            c.tick.fetch_add(1, Ordering::Relaxed) + 1,
            Ordering::Relaxed,
        );
        let mut g = lock(&self.fd);
        if let Some(f) = &*g {
            return Ok(FdRef {
                file: f.clone(),
                fid: self.clone(),
            });
        }
        let file = Arc::new(self.reopen()?);
        *g = Some(file.clone());
        drop(g);
        c.reopens.fetch_add(1, Ordering::Relaxed);
        c.opened(self, false);
        Ok(FdRef {
            file,
            fid: self.clone(),
        })
    }

    /// The identity checked on reopen ([`super::table::file_id`]).
    pub fn ident(&self) -> u64 {
        self.ident
    }

    /// Whether its descriptor is open now.
    pub fn is_open(&self) -> bool {
        lock(&self.fd).is_some()
    }

    /// Whether its descriptor is never closed before it ends.
    pub fn is_pinned(&self) -> bool {
        self.pinned.load(Ordering::Relaxed)
    }

    fn reopen(&self) -> Result<File> {
        let Reopen::In {
            export,
            path,
            handle,
        } = &self.how
        else {
            return Err(stale("an open file", "lost its descriptor"));
        };
        let what = format!("{}/{}", export.name, path);
        let gone = |c: &FdCache, why| {
            c.stale.fetch_add(1, Ordering::Relaxed);
            stale(&what, why)
        };
        // O_NONBLOCK: a FIFO planted at the path must not hang the open
        // (it is then refused as another file).
        let flags = self.flags | libc::O_NONBLOCK;
        let by_handle = handle
            .as_ref()
            .map(|h| open_by_handle(export.handle_root_fd(), h, flags));
        let fd = match by_handle {
            Some(Ok(fd)) => fd,
            Some(Err(libc::ESTALE | libc::ENOENT)) => return Err(gone(&self.cache, "was removed")),
            Some(Err(e)) if !matches!(e, libc::EPERM | libc::EOPNOTSUPP | libc::ENOSYS) => {
                return Err(Error::from_errno(e, &what))
            }
            // No handle, or handles refused now: by path.
            _ => {
                let comps = split_rel_path(path)?;
                match export.resolve(&comps, flags, 0) {
                    Ok(fd) => fd,
                    Err(e) if e.code == ErrorCode::NotFound => {
                        return Err(gone(&self.cache, "was removed or renamed"))
                    }
                    Err(e) => return Err(e),
                }
            }
        };
        let file = File::from(fd);
        if super::table::file_id(&file) != self.ident {
            return Err(gone(&self.cache, "was replaced by another file"));
        }
        if self.flags & libc::O_NONBLOCK == 0 {
            // SAFETY: fcntl on the descriptor just opened; integer arguments.
            unsafe { libc::fcntl(file.as_raw_fd(), libc::F_SETFL, self.flags) };
        }
        Ok(file)
    }
}

impl Drop for Fid {
    fn drop(&mut self) {
        let c = &self.cache;
        c.fids.fetch_sub(1, Ordering::Relaxed);
        let pinned = *self.pinned.get_mut();
        if pinned {
            c.pinned.fetch_sub(1, Ordering::Relaxed);
        }
        let open = self
            .fd
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .take()
            .is_some();
        if open {
            c.open.fetch_sub(1, Ordering::Relaxed);
            if !pinned {
                lock(&c.resident).remove(&self.id);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fs::{ExportSpec, OpenOptions, ResolveMode};
    use std::os::unix::fs::FileExt;

    struct Fx {
        dir: tempfile::TempDir,
        ex: Arc<Export>,
    }

    /// An export of a fresh directory; `handles`: whether reopens may use
    /// file handles (where this process can at all).
    fn export(handles: bool) -> Fx {
        let dir = tempfile::tempdir().unwrap();
        let spec = ExportSpec {
            name: "ex".into(),
            path: dir.path().to_path_buf(),
            read_only: false,
            allow_hardlinks: false,
            ..Default::default()
        };
        let mut ex = Export::open(&spec, ResolveMode::Auto).unwrap();
        if !handles {
            ex.handles = None;
        }
        Fx {
            dir,
            ex: Arc::new(ex),
        }
    }

    impl Fx {
        fn write(&self, name: &str, data: &[u8]) {
            std::fs::write(self.dir.path().join(name), data).unwrap();
        }
        fn open(&self, c: &Arc<FdCache>, name: &str) -> Arc<Fid> {
            let o = self.ex.open_file(name, &OpenOptions::READ, 0).unwrap();
            c.insert(o.file, Some((self.ex.clone(), name)))
        }
    }

    fn content(r: &FdRef) -> Vec<u8> {
        let mut b = vec![0u8; 64];
        let n = r.read_at(&mut b, 0).unwrap();
        b.truncate(n);
        b
    }

    #[test]
    fn least_recently_used_go_first_and_come_back() {
        let fx = export(true);
        let c = FdCache::new(8);
        for i in 0..10 {
            fx.write(&format!("f{i}"), format!("file {i}").as_bytes());
        }
        let fids: Vec<Arc<Fid>> = (0..8).map(|i| fx.open(&c, &format!("f{i}"))).collect();
        assert_eq!(c.stats().open, 8);
        assert!(fids.iter().all(|f| f.is_open()));
        // f0 used again: f1 is now the least recently used.
        drop(fids[0].get().unwrap());
        let f8 = fx.open(&c, "f8");
        assert_eq!(c.stats().open, 8, "one closed to make room");
        assert!(fids[0].is_open() && !fids[1].is_open() && fids[2].is_open());
        assert!(f8.is_open());
        // f1 comes back with its own bytes; f2 makes room.
        assert_eq!(content(&fids[1].get().unwrap()), b"file 1");
        assert!(fids[1].is_open() && !fids[2].is_open());
        let s = c.stats();
        assert_eq!((s.open, s.evictions, s.reopens, s.stale), (8, 2, 1, 0));
        assert!(s.peak <= 9);
        // Every one reads its own file, whichever were closed meanwhile.
        for (i, f) in fids.iter().enumerate() {
            assert_eq!(content(&f.get().unwrap()), format!("file {i}").as_bytes());
        }
        assert!(c.stats().open <= 8);
        drop(fids);
        drop(f8);
        let s = c.stats();
        assert_eq!((s.fids, s.open, s.pinned), (0, 0, 0));
        assert!(lock(&c.resident).is_empty());
    }

    #[test]
    fn pinned_descriptors_are_never_closed() {
        let fx = export(true);
        let c = FdCache::new(4);
        // Held by an operation.
        fx.write("held", b"held");
        let held = fx.open(&c, "held");
        let op = held.get().unwrap();
        // Unlinked while open.
        fx.write("gone", b"gone");
        let gone = fx.open(&c, "gone");
        std::fs::remove_file(fx.dir.path().join("gone")).unwrap();
        // Not reopenable at all (no export path: a memfd, O_TMPFILE).
        let anon = c.insert(tempfile::tempfile().unwrap(), None);
        assert!(anon.is_pinned());
        let mut others = Vec::new();
        for i in 0..20 {
            fx.write(&format!("o{i}"), b"other");
            let f = fx.open(&c, &format!("o{i}"));
            drop(f.get().unwrap());
            others.push(f);
        }
        assert!(held.is_open(), "an operation's descriptor stays open");
        assert!(
            gone.is_open() && gone.is_pinned(),
            "unlinked: kept ({} {} {:?})",
            gone.is_open(),
            gone.is_pinned(),
            c.stats()
        );
        assert!(anon.is_open());
        assert_eq!(content(&op), b"held");
        assert_eq!(content(&gone.get().unwrap()), b"gone");
        // Once the operation let go, it may be closed like the others.
        drop(op);
        for i in 20..30 {
            fx.write(&format!("o{i}"), b"other");
            others.push(fx.open(&c, &format!("o{i}")));
        }
        assert!(c.stats().open <= 4);
        assert!(!held.is_open());
        assert_eq!(content(&held.get().unwrap()), b"held");
        assert_eq!(c.stats().pinned, 2);
        drop((gone, anon));
        assert_eq!(c.stats().pinned, 0);
    }

    /// Open `name`, let the cache close it (a second file over a bound of 1).
    fn evicted(fx: &Fx, c: &Arc<FdCache>, name: &str) -> Arc<Fid> {
        let f = fx.open(c, name);
        fx.write("other", b"other");
        let _o = fx.open(c, "other");
        assert!(!f.is_open());
        f
    }

    #[test]
    fn reopen_by_handle_follows_a_rename() {
        let fx = export(true);
        if !fx.ex.reopens_by_handle() {
            crate::io_phase::testkit::skip("no file handles here (CAP_DAC_READ_SEARCH?)");
            return;
        }
        let c = FdCache::new(1);
        fx.write("a", b"bytes of a");
        let f = evicted(&fx, &c, "a");
        std::fs::rename(fx.dir.path().join("a"), fx.dir.path().join("b")).unwrap();
        assert_eq!(content(&f.get().unwrap()), b"bytes of a");
    }

    #[test]
    fn reopen_by_path_checks_identity() {
        let fx = export(false);
        assert!(!fx.ex.reopens_by_handle());
        let c = FdCache::new(1);
        fx.write("a", b"bytes of a");
        let f = evicted(&fx, &c, "a");
        assert_eq!(content(&f.get().unwrap()), b"bytes of a");
        // Renamed away: by path it is gone.
        let f = evicted(&fx, &c, "a");
        std::fs::rename(fx.dir.path().join("a"), fx.dir.path().join("b")).unwrap();
        let e = f.get().unwrap_err();
        assert!(e.message.contains("stale file handle"), "{}", e.message);
        assert_eq!(c.stats().stale, 1);
    }

    #[test]
    fn a_replaced_file_is_stale_not_another_files_bytes() {
        for handles in [true, false] {
            let fx = export(handles);
            let c = FdCache::new(1);
            fx.write("a", b"the original");
            let f = evicted(&fx, &c, "a");
            // Replaced behind the server's back: a new file renamed over
            // the name (the old inode is freed).
            fx.write("new", b"an impostor!");
            std::fs::rename(fx.dir.path().join("new"), fx.dir.path().join("a")).unwrap();
            let e = f.get().unwrap_err();
            assert!(
                e.message.contains("ex/a: stale file handle"),
                "handles {handles}: {}",
                e.message
            );
            // Removed: stale too.
            fx.write("b", b"bbb");
            let g = evicted(&fx, &c, "b");
            std::fs::remove_file(fx.dir.path().join("b")).unwrap();
            assert!(g.get().is_err());
            assert_eq!(c.stats().stale, 2);
        }
    }

    #[test]
    fn reopened_with_the_same_flags() {
        let fx = export(true);
        let c = FdCache::new(1);
        fx.write("a", b"");
        let o = OpenOptions {
            write: true,
            write_through: true,
            ..OpenOptions::default()
        };
        let opened = fx.ex.open_file("a", &o, 0).unwrap();
        let f = c.insert(opened.file, Some((fx.ex.clone(), "a")));
        let before = reopen_flags(f.get().unwrap().as_raw_fd());
        assert_eq!(before & libc::O_ACCMODE, libc::O_WRONLY);
        assert_ne!(before & libc::O_DSYNC, 0);
        fx.write("other", b"");
        let _o = fx.open(&c, "other");
        assert!(!f.is_open());
        let r = f.get().unwrap();
        let fl = unsafe_getfl(r.as_raw_fd());
        assert_eq!(reopen_flags(r.as_raw_fd()), before);
        assert_eq!(fl & libc::O_NONBLOCK, 0);
        r.write_at(b"x", 0).unwrap();
    }

    fn unsafe_getfl(fd: RawFd) -> i32 {
        // SAFETY: F_GETFL on a live descriptor; no pointer.
        unsafe { libc::fcntl(fd, libc::F_GETFL) }
    }
}
