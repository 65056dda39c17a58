//! The server's open-file table and server request resume keys.
//!
//! Opening a file over the side channel creates an entry: a handle (for the
//! side channel's close/set-size/fsync) and a **server request resume key**
//! (seed 000 FIG. 3: ResumeKey, Timestamp, Pid, Context). The client later
//! presents the key in an RDMA REGISTER; the RDMA phase calls
//! [`OpenFileTable::lookup_resume_key`] with the side-channel session the
//! RDMA connection authenticated as, and gets the [`OpenFile`] back.
//!
//! A resume key is 64 bits from the OS CSPRNG, unique in the table, bound to
//! the session that opened the file, and accepted only until it expires
//! (`limits.resume_key_ttl`); the file itself stays open until closed or
//! until its session ends.

use std::collections::HashMap;
use std::fs::File;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use super::fdcache::{FdCache, FdRef, Fid};
use super::{Export, OpenedFile};
use lwio_side::error::{Error, ErrorCode, Result};

/// Identifies a side-channel session (assigned at login).
pub type SessionId = u64;

pub use lwio_proto::wire::{RequestResumeKeyRepr as SrvRequestResumeKey, SrvResumeKey};

/// Longest server name usable as a resume key Context and negotiate SrvName
/// (WCHAR[64] with a terminator), in UTF-16 code units.
pub const MAX_SERVER_NAME: usize = lwio_proto::wire::LWIO_MAX_HOST_NAME - 1;

/// Wire form of a request resume key (docs/protocol.md §2.2).
pub fn encode_request_resume_key(k: &SrvRequestResumeKey) -> Vec<u8> {
    // The server name is validated at start-up (MAX_SERVER_NAME), far below
    // the 32767 code units where encoding could fail.
    k.to_bytes().unwrap_or_default()
}

/// Access granted on an open file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Rights {
    pub read: bool,
    pub write: bool,
}

/// An open file as the RDMA phase sees it.
#[derive(Debug, Clone)]
pub struct OpenFile {
    /// Side-channel handle.
    pub handle: u64,
    /// The file's identity and cached descriptor: [`OpenFile::fd`] for I/O
    /// (docs/descriptor-cache.md).
    pub fid: Arc<Fid>,
    pub rights: Rights,
    /// The side-channel session that opened it.
    pub session: SessionId,
    pub export: String,
    pub path: String,
    /// `O_DIRECT`: I/O must be aligned to `align`.
    pub direct: bool,
    pub align: u32,
    pub key: SrvResumeKey,
    /// POSIX byte-range locks taken through this handle: one open file
    /// description per client lock owner, holding that owner's OFD locks
    /// (docs/side-channel.md, Lock), bounded per handle and per session.
    /// They go when the handle closes.
    pub locks: Arc<Mutex<LockOwners>>,
    /// A memory object (docs/memory-objects.md): its I/O goes to the
    /// publisher's memory, and `file` is only a sealed, empty-content
    /// stand-in of the object's size.
    pub mem: Option<Arc<crate::memobj::MemObj>>,
    /// Set when the handle leaves the table (side-channel Close, the end of
    /// its session or of the session's durable grace): every RDMA
    /// connection that registered the file refuses its Fid from then on
    /// (issue 31). Shared by all clones.
    closed: Arc<AtomicBool>,
}

impl OpenFile {
    /// Whether the handle was closed (the file's Fids are dead).
    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// The file's descriptor, held open for as long as the [`FdRef`] lives
    /// (reopened if the cache had closed it; ESTALE if the file was removed
    /// or replaced meanwhile).
    pub fn fd(&self) -> Result<FdRef> {
        self.fid.get()
    }
}

/// The lock descriptions of one open file, by client lock owner: at most
/// `per_file` of them, at most `per_session` across the session's open
/// files, each counted among the descriptor cache's descriptors (issue 31:
/// a reader looping Lock with new owners held one descriptor each, without
/// bound).
pub struct LockOwners {
    fds: HashMap<u64, OwnedFd>,
    /// The session's count of lock descriptions, shared by its open files
    /// (moved to the adopting session by [`OpenFileTable::adopt`]).
    session: Arc<AtomicUsize>,
    cache: Arc<FdCache>,
    per_file: usize,
    per_session: usize,
}

impl std::fmt::Debug for LockOwners {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LockOwners")
            .field("owners", &self.fds.len())
            .finish()
    }
}

impl LockOwners {
    /// The description of `owner`, if it has one.
    pub fn get(&self, owner: u64) -> Option<RawFd> {
        self.fds.get(&owner).map(|f| f.as_raw_fd())
    }

    /// Owners holding a description.
    pub fn len(&self) -> usize {
        self.fds.len()
    }

    pub fn is_empty(&self) -> bool {
        self.fds.is_empty()
    }

    /// Give `owner` the description `open` makes, within the bounds: per
    /// file, per session, and the server's descriptors. `what` names the
    /// file in the refusal.
    pub fn add(
        &mut self,
        owner: u64,
        what: &str,
        open: impl FnOnce() -> Result<OwnedFd>,
    ) -> Result<RawFd> {
        let n = self.fds.len();
        if n >= self.per_file {
            return Err(Error::new(
                ErrorCode::TooManyOpenFiles,
                format!(
                    "{what}: this open file already has {n} lock owners (limit max_lock_owners_per_file = {})",
                    self.per_file
                ),
            ));
        }
        let max = self.per_session;
        if let Err(n) = self
            .session
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                (n < max).then_some(n + 1)
            })
        {
            return Err(Error::new(
                ErrorCode::TooManyOpenFiles,
                format!(
                    "{what}: this session already has {n} lock owners (limit max_lock_owners_per_session = {max})"
                ),
            ));
        }
        if !self.cache.reserve_lock() {
            self.session.fetch_sub(1, Ordering::Relaxed);
            return Err(Error::new(
                ErrorCode::TooManyOpenFiles,
                format!(
                    "{what}: the server holds {} descriptors (limit max_open_descriptors = {})",
                    self.cache.stats().open,
                    self.cache.max()
                ),
            ));
        }
        match open() {
            Ok(fd) => {
                let raw = fd.as_raw_fd();
                if let Some(old) = self.fds.insert(owner, fd) {
                    // Not reached (`add` is for owners without one), but
                    // never count a description twice.
                    drop(old);
                    self.release(1);
                }
                Ok(raw)
            }
            Err(e) => {
                self.release(1);
                Err(e)
            }
        }
    }

    /// Close `owner`'s description (and with it all its locks).
    pub fn remove(&mut self, owner: u64) {
        if self.fds.remove(&owner).is_some() {
            self.release(1);
        }
    }

    fn release(&self, n: usize) {
        self.session.fetch_sub(n, Ordering::Relaxed);
        for _ in 0..n {
            self.cache.release_lock();
        }
    }
}

impl Drop for LockOwners {
    fn drop(&mut self) {
        let n = self.fds.len();
        self.fds.clear();
        self.release(n);
    }
}

/// Why a resume key lookup was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Denied {
    #[error("unknown resume key (never issued, or the file was closed)")]
    Unknown,
    #[error("resume key expired")]
    Expired,
    #[error("resume key belongs to another session")]
    WrongSession,
}

struct Entry {
    file: OpenFile,
    key_expires: Instant,
}

#[derive(Default)]
struct Inner {
    by_handle: HashMap<u64, Entry>,
    by_key: HashMap<u64, u64>,
    per_session: HashMap<SessionId, usize>,
    /// Lock descriptions per session ([`LockOwners`]).
    lock_owners: HashMap<SessionId, Arc<AtomicUsize>>,
    next_handle: u64,
}

/// resume key → (file, rights, owning session, expiry).
pub struct OpenFileTable {
    inner: Mutex<Inner>,
    ttl: Duration,
    max_per_session: usize,
    /// Open files server-wide.
    max_total: usize,
    /// The descriptors behind them.
    cache: Arc<FdCache>,
    /// Lock owners (descriptions) per open file and per session.
    max_lock_owners_per_file: usize,
    max_lock_owners_per_session: usize,
    server_name: String,
    pid: u64,
    /// `Rekey`s that found the file still held by an earlier RDMA
    /// connection and waited for it to let go, and those that gave up
    /// (`Busy`) after `REKEY_DRAIN`.
    rekey_waits: AtomicU64,
    rekey_busy: AtomicU64,
}

impl std::fmt::Debug for OpenFileTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpenFileTable")
            .field("open", &self.len())
            .field("ttl", &self.ttl)
            .finish()
    }
}

/// 8 bytes from the OS CSPRNG.
pub fn random_u64() -> u64 {
    let mut b = [0u8; 8];
    lwio_side::random_bytes(&mut b);
    u64::from_le_bytes(b)
}

impl OpenFileTable {
    /// `ttl`: how long a resume key is accepted; `server_name`: the Context.
    pub fn new(
        ttl: Duration,
        max_per_session: usize,
        server_name: impl Into<String>,
    ) -> OpenFileTable {
        OpenFileTable {
            inner: Mutex::new(Inner {
                next_handle: 1,
                ..Inner::default()
            }),
            ttl,
            max_per_session,
            max_total: usize::MAX,
            cache: FdCache::new(super::fdcache::default_max_descriptors()),
            max_lock_owners_per_file: 64,
            max_lock_owners_per_session: 1024,
            server_name: server_name.into(),
            pid: u64::from(std::process::id()),
            rekey_waits: AtomicU64::new(0),
            rekey_busy: AtomicU64::new(0),
        }
    }

    /// At most `max_open_files` open files server-wide, held with at most
    /// `max_descriptors` open descriptors (0: half of RLIMIT_NOFILE).
    pub fn with_caps(mut self, max_open_files: usize, max_descriptors: usize) -> OpenFileTable {
        self.max_total = max_open_files;
        self.cache = FdCache::new(if max_descriptors == 0 {
            super::fdcache::default_max_descriptors()
        } else {
            max_descriptors
        });
        self
    }

    /// At most `per_file` lock owners (each an open file description) on
    /// one open file, and `per_session` on all of a session's.
    pub fn with_lock_caps(mut self, per_file: usize, per_session: usize) -> OpenFileTable {
        self.max_lock_owners_per_file = per_file;
        self.max_lock_owners_per_session = per_session;
        self
    }

    /// The descriptor cache behind the open files.
    pub fn descriptors(&self) -> &Arc<FdCache> {
        &self.cache
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A panic while holding the lock cannot leave the maps inconsistent
        // in a way that matters more than refusing service; keep going.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Enter a freshly opened file; returns it and its request resume key.
    /// `origin`: the export it was opened in, by `path` (`None`: its
    /// descriptor cannot be reopened and stays open).
    pub fn insert(
        &self,
        session: SessionId,
        opened: OpenedFile,
        rights: Rights,
        export: &str,
        path: &str,
        origin: Option<&Arc<Export>>,
    ) -> Result<(OpenFile, SrvRequestResumeKey)> {
        let mut g = self.lock();
        let total = g.by_handle.len();
        if total >= self.max_total {
            return Err(Error::new(
                ErrorCode::TooManyOpenFiles,
                format!(
                    "this server already has {total} open files (limit {})",
                    self.max_total
                ),
            ));
        }
        let n = g.per_session.get(&session).copied().unwrap_or(0);
        if n >= self.max_per_session {
            return Err(Error::new(
                ErrorCode::TooManyOpenFiles,
                format!(
                    "this session already has {n} open files (limit {})",
                    self.max_per_session
                ),
            ));
        }
        let mut rk = random_u64();
        while rk == 0 || g.by_key.contains_key(&rk) {
            rk = random_u64();
        }
        let timestamp = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        let key = SrvResumeKey {
            resume_key: rk,
            timestamp,
            pid: self.pid,
        };
        let handle = g.next_handle;
        g.next_handle += 1;
        let fid = self
            .cache
            .insert(opened.file, origin.map(|e| (e.clone(), path)));
        let file = OpenFile {
            handle,
            fid,
            rights,
            session,
            export: export.to_string(),
            path: path.to_string(),
            direct: opened.direct,
            align: opened.align,
            key,
            locks: Arc::new(Mutex::new(LockOwners {
                fds: HashMap::new(),
                session: g.lock_owners.entry(session).or_default().clone(),
                cache: self.cache.clone(),
                per_file: self.max_lock_owners_per_file,
                per_session: self.max_lock_owners_per_session,
            })),
            mem: opened.mem,
            closed: Arc::new(AtomicBool::new(false)),
        };
        g.by_key.insert(rk, handle);
        g.by_handle.insert(
            handle,
            Entry {
                file: file.clone(),
                key_expires: Instant::now() + self.ttl,
            },
        );
        *g.per_session.entry(session).or_insert(0) += 1;
        let req = SrvRequestResumeKey {
            key,
            server_name: self.server_name.clone(),
        };
        Ok((file, req))
    }

    /// An open file by side-channel handle, for its own session only.
    pub fn get(&self, handle: u64, session: SessionId) -> Result<OpenFile> {
        let g = self.lock();
        match g.by_handle.get(&handle) {
            Some(e) if e.file.session == session => Ok(e.file.clone()),
            _ => Err(Error::new(
                ErrorCode::BadHandle,
                format!("no open file with handle {handle}"),
            )),
        }
    }

    /// Whether a session other than `except` has a file open for writing
    /// directly in directory `dir` (a canonical lease key) of `export`.
    pub fn writers_in(&self, export: &str, dir: &str, except: SessionId) -> bool {
        let g = self.lock();
        g.by_handle.values().any(|e| {
            let f = &e.file;
            f.rights.write
                && f.session != except
                && f.export == export
                && crate::side_service::leases::parent_key(export, &f.path)
                    .ok()
                    .flatten()
                    .is_some_and(|(_, d)| d == dir)
        })
    }

    /// Close a handle of `session`.
    pub fn close(&self, handle: u64, session: SessionId) -> Result<()> {
        let mut g = self.lock();
        match g.by_handle.get(&handle) {
            Some(e) if e.file.session == session => {}
            _ => {
                return Err(Error::new(
                    ErrorCode::BadHandle,
                    format!("no open file with handle {handle}"),
                ))
            }
        }
        if let Some(e) = g.by_handle.remove(&handle) {
            e.file.closed.store(true, Ordering::Release);
            g.by_key.remove(&e.file.key.resume_key);
            if let Some(n) = g.per_session.get_mut(&session) {
                *n = n.saturating_sub(1);
            }
        }
        Ok(())
    }

    /// Close everything a session opened (its side channel ended).
    pub fn close_session(&self, session: SessionId) -> usize {
        let mut g = self.lock();
        let handles: Vec<u64> = g
            .by_handle
            .iter()
            .filter(|(_, e)| e.file.session == session)
            .map(|(h, _)| *h)
            .collect();
        for h in &handles {
            if let Some(e) = g.by_handle.remove(h) {
                e.file.closed.store(true, Ordering::Release);
                g.by_key.remove(&e.file.key.resume_key);
            }
        }
        g.per_session.remove(&session);
        g.lock_owners.remove(&session);
        handles.len()
    }

    /// Move every open file of session `old` to session `new` (a durable
    /// resume, docs/reconnect.md); returns how many moved. Handles stay.
    /// Refused (`TooManyOpenFiles`, nothing moved) if `new` would then hold
    /// more than `max_open_files_per_session`.
    pub fn adopt(&self, old: SessionId, new: SessionId) -> Result<usize> {
        let mut g = self.lock();
        let moving = g.per_session.get(&old).copied().unwrap_or(0);
        let have = g.per_session.get(&new).copied().unwrap_or(0);
        if moving > 0 && have + moving > self.max_per_session {
            return Err(Error::new(
                ErrorCode::TooManyOpenFiles,
                format!(
                    "this session has {have} open files and the one resumed {moving}: more than the limit of {} (close some first)",
                    self.max_per_session
                ),
            ));
        }
        let mut n = 0;
        let counter = g.lock_owners.entry(new).or_default().clone();
        for e in g.by_handle.values_mut() {
            if e.file.session == old {
                e.file.session = new;
                n += 1;
                // Its lock descriptions count for the new session now.
                let mut l = e.file.locks.lock().unwrap_or_else(|p| p.into_inner());
                let k = l.fds.len();
                l.session.fetch_sub(k, Ordering::Relaxed);
                counter.fetch_add(k, Ordering::Relaxed);
                l.session = counter.clone();
            }
        }
        g.per_session.remove(&old);
        g.lock_owners.remove(&old);
        if n > 0 {
            *g.per_session.entry(new).or_insert(0) += n;
        }
        Ok(n)
    }

    /// Whether anything besides the table still holds handle `handle`'s
    /// file: an RDMA connection that registered it, or a request of one in
    /// flight — a storage job holds the file until its I/O has returned
    /// (completed, failed or cancelled), also after its connection is gone.
    /// `None` if `session` has no such handle.
    pub fn in_use(&self, handle: u64, session: SessionId) -> Option<bool> {
        let g = self.lock();
        let e = g.by_handle.get(&handle)?;
        (e.file.session == session).then(|| Arc::strong_count(&e.file.fid) > 1)
    }

    /// Count a `Rekey` that had to wait for an earlier connection's hold
    /// (`busy`: and gave up).
    pub fn note_rekey_wait(&self, busy: bool) {
        let c = if busy {
            &self.rekey_busy
        } else {
            &self.rekey_waits
        };
        c.fetch_add(1, Ordering::Relaxed);
    }

    /// `Rekey`s that waited for an earlier connection to let go of the
    /// file, and those of them that ended `Busy`.
    pub fn rekey_waits(&self) -> (u64, u64) {
        (
            self.rekey_waits.load(Ordering::Relaxed),
            self.rekey_busy.load(Ordering::Relaxed),
        )
    }

    /// A fresh resume key for handle `handle` of `session` (to REGISTER the
    /// file on another RDMA connection); the old key stops working.
    pub fn rekey(
        &self,
        handle: u64,
        session: SessionId,
    ) -> Result<(OpenFile, SrvRequestResumeKey)> {
        let mut g = self.lock();
        let bad = || {
            Error::new(
                ErrorCode::BadHandle,
                format!("no open file with handle {handle}"),
            )
        };
        match g.by_handle.get(&handle) {
            Some(e) if e.file.session == session => {}
            _ => return Err(bad()),
        }
        let mut rk = random_u64();
        while rk == 0 || g.by_key.contains_key(&rk) {
            rk = random_u64();
        }
        let expires = Instant::now() + self.ttl;
        let Some(e) = g.by_handle.get_mut(&handle) else {
            return Err(bad());
        };
        let old = e.file.key.resume_key;
        e.file.key.resume_key = rk;
        e.key_expires = expires;
        let file = e.file.clone();
        g.by_key.remove(&old);
        g.by_key.insert(rk, handle);
        let req = SrvRequestResumeKey {
            key: file.key,
            server_name: self.server_name.clone(),
        };
        Ok((file, req))
    }

    /// For the RDMA phase's REGISTER: the file behind a resume key, if the key
    /// is known, unexpired, and was issued to `session`. All three fields of
    /// the key must match.
    pub fn lookup_resume_key(
        &self,
        key: &SrvResumeKey,
        session: SessionId,
    ) -> Result<OpenFile, Denied> {
        let g = self.lock();
        let h = g.by_key.get(&key.resume_key).ok_or(Denied::Unknown)?;
        let e = g.by_handle.get(h).ok_or(Denied::Unknown)?;
        if e.file.key != *key {
            return Err(Denied::Unknown);
        }
        if e.file.session != session {
            return Err(Denied::WrongSession);
        }
        if Instant::now() >= e.key_expires {
            return Err(Denied::Expired);
        }
        Ok(e.file.clone())
    }

    /// Number of open files.
    pub fn len(&self) -> usize {
        self.lock().by_handle.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Open files of one session.
    pub fn session_len(&self, session: SessionId) -> usize {
        self.lock().per_session.get(&session).copied().unwrap_or(0)
    }
}

/// What identifies a file across server restarts: device, inode and birth
/// time (statx) or, where the file system keeps none, its inode generation
/// (FS_IOC_GETVERSION), hashed (FNV-1a) into 64 bits. A file replaced by
/// another under the same path (a new inode, or a reused inode number with
/// a new birth time or generation) gets another id. 0 if fstat fails.
pub fn file_id(f: &File) -> u64 {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::MetadataExt;
    let Ok(m) = f.metadata() else {
        return 0;
    };
    let fd = f.as_raw_fd();
    // SAFETY: statx on our own open descriptor with an empty path and
    // AT_EMPTY_PATH writes only into `stx`, a properly sized, zeroed local.
    let birth = unsafe {
        let mut stx: libc::statx = std::mem::zeroed();
        let empty = c"";
        let r = libc::statx(
            fd,
            empty.as_ptr(),
            libc::AT_EMPTY_PATH,
            libc::STATX_BTIME,
            &mut stx,
        );
        if r == 0 && stx.stx_mask & libc::STATX_BTIME != 0 {
            (stx.stx_btime.tv_sec as u64) << 32 ^ u64::from(stx.stx_btime.tv_nsec)
        } else {
            0
        }
    };
    let generation = if birth == 0 {
        let mut v: libc::c_long = 0;
        // SAFETY: FS_IOC_GETVERSION writes one long into `v`, a live local.
        let r = unsafe { libc::ioctl(fd, FS_IOC_GETVERSION, &mut v as *mut libc::c_long) };
        if r == 0 {
            v as u64
        } else {
            0
        }
    } else {
        0
    };
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for w in [m.dev(), m.ino(), birth, generation] {
        for b in w.to_le_bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    }
    h.max(1)
}

/// `_IOR('v', 1, long)`.
const FS_IOC_GETVERSION: libc::c_ulong = 0x8008_7601;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fs::OpenedFile;

    fn opened() -> OpenedFile {
        OpenedFile {
            file: tempfile::tempfile().unwrap(),
            size: 0,
            direct: false,
            align: 1,
            mem: None,
        }
    }

    const RW: Rights = Rights {
        read: true,
        write: true,
    };

    #[test]
    fn resume_key_wire_round_trip() {
        let k = SrvRequestResumeKey {
            key: SrvResumeKey {
                resume_key: 0x0102030405060708,
                timestamp: 9,
                pid: 10,
            },
            server_name: "\\\\stor1".into(),
        };
        let b = encode_request_resume_key(&k);
        assert_eq!(b.len(), 26 + 14);
        assert_eq!(&b[..8], &[8, 7, 6, 5, 4, 3, 2, 1]);
        assert_eq!(&b[24..26], &[14, 0]);
        assert_eq!(&b[26..30], &[b'\\', 0, b'\\', 0]);
        // Parsed back by the proto crate; `None` if truncated, odd-length or
        // not UTF-16.
        let decode = |b: &[u8]| lwio_proto::sidechannel::parse_request_resume_key(b).ok();
        assert_eq!(decode(&b), Some(k));
        assert_eq!(decode(&b[..30]), None);
        let mut odd = b.clone();
        odd[24] = 13;
        assert_eq!(decode(&odd), None);
    }

    /// Lock owners: per file, per session (following `adopt`), within the
    /// descriptor bound, released by a whole-file unlock and by the close;
    /// a read-only file takes read locks only.
    #[test]
    fn lock_owners_are_bounded_and_counted() {
        use crate::fs::lock_file;
        let t = OpenFileTable::new(Duration::from_secs(60), 100, "srv")
            .with_caps(1000, 1000)
            .with_lock_caps(4, 6);
        let stats = || t.descriptors().stats();
        let (a, _) = t.insert(1, opened(), RW, "e", "a", None).unwrap();
        for o in 1..=4 {
            lock_file(&a, o, 1, 0, 0, false).unwrap();
        }
        let e = lock_file(&a, 5, 1, 0, 0, false).unwrap_err();
        assert_eq!(e.code, ErrorCode::TooManyOpenFiles);
        assert_eq!(
            e.message,
            "e/a: this open file already has 4 lock owners (limit max_lock_owners_per_file = 4)"
        );
        // An owner that has its description takes more locks on it.
        lock_file(&a, 4, 1, 100, 10, false).unwrap();
        let (b, _) = t.insert(1, opened(), RW, "e", "b", None).unwrap();
        lock_file(&b, 1, 1, 0, 0, false).unwrap();
        lock_file(&b, 2, 1, 0, 0, false).unwrap();
        let e = lock_file(&b, 3, 1, 0, 0, false).unwrap_err();
        assert_eq!(e.code, ErrorCode::TooManyOpenFiles);
        assert_eq!(
            e.message,
            "e/b: this session already has 6 lock owners (limit max_lock_owners_per_session = 6)"
        );
        assert_eq!(stats().locks, 6);
        assert_eq!(stats().open, 2 + 6, "two files, six lock descriptions");
        // Another session has its own count.
        let (c, _) = t.insert(2, opened(), RW, "e", "c", None).unwrap();
        lock_file(&c, 1, 1, 0, 0, false).unwrap();
        // A whole-file unlock closes the owner's description.
        lock_file(&a, 1, 0, 0, 0, false).unwrap();
        assert_eq!(stats().locks, 6);
        lock_file(&b, 3, 1, 0, 0, false).unwrap();
        // Adopted files bring their count: session 2 has 7 now.
        assert_eq!(t.adopt(1, 2).unwrap(), 2);
        let e = lock_file(&c, 2, 1, 0, 0, false).unwrap_err();
        assert!(e.message.contains("already has 7 lock owners"), "{e}");
        // Closing (and the last clone going) releases them all.
        for f in [a, b, c] {
            t.close(f.handle, 2).unwrap();
        }
        assert_eq!(stats().locks, 0);
        assert_eq!(stats().open, 0);
        let (d, _) = t.insert(2, opened(), RW, "e", "d", None).unwrap();
        lock_file(&d, 1, 1, 0, 0, false).unwrap();

        // A read-only file: read locks, on a read-only description; no
        // write lock (EBADF), though a test for one is a query.
        let ro = Rights {
            read: true,
            write: false,
        };
        let (r, _) = t.insert(3, opened(), ro, "e", "r", None).unwrap();
        let e = lock_file(&r, 1, 2, 0, 0, false).unwrap_err();
        assert_eq!(e.code, ErrorCode::BadHandle);
        assert_eq!(lock_file(&r, 1, 2, 0, 0, true).unwrap(), None);
        lock_file(&r, 1, 1, 0, 0, false).unwrap();
        let fd = r.locks.lock().unwrap().get(1).unwrap();
        // SAFETY: F_GETFL on a descriptor `r` holds open.
        let fl = unsafe { libc::fcntl(fd, libc::F_GETFL) };
        assert_eq!(fl & libc::O_ACCMODE, libc::O_RDONLY);
    }

    /// Lock descriptions count against the descriptor bound: past it the
    /// cached descriptors are closed to make room, and when none can be,
    /// a new owner is refused.
    #[test]
    fn lock_owners_count_against_the_descriptor_bound() {
        use crate::fs::lock_file;
        let t = OpenFileTable::new(Duration::from_secs(60), 100, "srv").with_caps(1000, 4);
        // Pinned (unlinked) files: their descriptors cannot be closed.
        let (a, _) = t.insert(1, opened(), RW, "e", "a", None).unwrap();
        for o in 1..=3 {
            lock_file(&a, o, 1, 0, 0, false).unwrap();
        }
        let e = lock_file(&a, 4, 1, 0, 0, false).unwrap_err();
        assert_eq!(e.code, ErrorCode::TooManyOpenFiles);
        assert_eq!(
            e.message,
            "e/a: the server holds 4 descriptors (limit max_open_descriptors = 4)"
        );
        assert_eq!(t.descriptors().stats().locks, 3);
        assert_eq!(t.descriptors().stats().open, 4);
        // The refusal counted nothing toward the session either.
        lock_file(&a, 1, 0, 0, 0, false).unwrap();
        lock_file(&a, 4, 1, 0, 0, false).unwrap();
    }

    #[test]
    fn resume_keys_unique() {
        let t = OpenFileTable::new(Duration::from_secs(60), 10_000, "srv");
        let mut seen = std::collections::HashSet::new();
        for _ in 0..2000 {
            let (f, rk) = t.insert(1, opened(), RW, "e", "p", None).unwrap();
            assert_eq!(rk.server_name, "srv");
            assert_eq!(rk.key.pid, u64::from(std::process::id()));
            assert!(seen.insert(rk.key.resume_key));
            assert_eq!(f.key, rk.key);
        }
        assert_eq!(t.len(), 2000);
    }

    #[test]
    fn resume_key_session_binding() {
        let t = OpenFileTable::new(Duration::from_secs(60), 8, "srv");
        let (f, rk) = t.insert(7, opened(), RW, "e", "a/b", None).unwrap();
        let got = t.lookup_resume_key(&rk.key, 7).unwrap();
        assert_eq!(got.handle, f.handle);
        assert_eq!(got.path, "a/b");
        assert_eq!(
            t.lookup_resume_key(&rk.key, 8).unwrap_err(),
            Denied::WrongSession
        );
        let mut forged = rk.key;
        forged.timestamp ^= 1;
        assert_eq!(
            t.lookup_resume_key(&forged, 7).unwrap_err(),
            Denied::Unknown
        );
        let mut other = rk.key;
        other.resume_key ^= 1;
        assert_eq!(t.lookup_resume_key(&other, 7).unwrap_err(), Denied::Unknown);
        // Handles are per session too.
        assert_eq!(t.get(f.handle, 8).unwrap_err().code, ErrorCode::BadHandle);
        assert_eq!(t.close(f.handle, 8).unwrap_err().code, ErrorCode::BadHandle);
        t.close(f.handle, 7).unwrap();
        assert_eq!(
            t.lookup_resume_key(&rk.key, 7).unwrap_err(),
            Denied::Unknown
        );
        assert!(t.is_empty());
    }

    #[test]
    fn resume_key_expiry() {
        let t = OpenFileTable::new(Duration::from_millis(30), 8, "srv");
        let (f, rk) = t.insert(1, opened(), RW, "e", "p", None).unwrap();
        assert!(t.lookup_resume_key(&rk.key, 1).is_ok());
        std::thread::sleep(Duration::from_millis(60));
        assert_eq!(
            t.lookup_resume_key(&rk.key, 1).unwrap_err(),
            Denied::Expired
        );
        // The handle itself stays usable until closed.
        assert!(t.get(f.handle, 1).is_ok());
    }

    #[test]
    fn adopt_rekey_and_file_id() {
        let t = OpenFileTable::new(Duration::from_secs(60), 8, "srv");
        let (f, rk) = t.insert(1, opened(), RW, "e", "p", None).unwrap();
        assert_eq!(t.in_use(f.handle, 1), Some(true), "`f` holds a clone");
        let (id, h) = (f.fid.ident(), f.handle);
        drop(f);
        assert_eq!(t.in_use(h, 1), Some(false));
        assert_eq!(t.adopt(1, 2).unwrap(), 1);
        assert_eq!(t.session_len(1), 0);
        assert_eq!(t.session_len(2), 1);
        assert_eq!(
            t.lookup_resume_key(&rk.key, 1).unwrap_err(),
            Denied::WrongSession
        );
        assert!(t.rekey(h, 1).is_err(), "the old session has no handle now");
        let (g, rk2) = t.rekey(h, 2).unwrap();
        assert_ne!(rk2.key.resume_key, rk.key.resume_key);
        assert_eq!(g.fid.ident(), id);
        assert_ne!(id, 0);
        assert_eq!(
            t.lookup_resume_key(&rk.key, 2).unwrap_err(),
            Denied::Unknown,
            "the old key is gone"
        );
        assert_eq!(t.lookup_resume_key(&rk2.key, 2).unwrap().handle, h);
        // Another file has another id.
        let (o, _) = t.insert(2, opened(), RW, "e", "q", None).unwrap();
        assert_ne!(o.fid.ident(), id);
    }

    #[test]
    fn per_session_limit_and_session_close() {
        let t = OpenFileTable::new(Duration::from_secs(60), 2, "srv");
        t.insert(1, opened(), RW, "e", "p", None).unwrap();
        t.insert(1, opened(), RW, "e", "p", None).unwrap();
        let e = t.insert(1, opened(), RW, "e", "p", None).unwrap_err();
        assert_eq!(e.code, ErrorCode::TooManyOpenFiles);
        t.insert(2, opened(), RW, "e", "p", None).unwrap();
        assert_eq!(t.close_session(1), 2);
        assert_eq!(t.session_len(1), 0);
        assert_eq!(t.len(), 1);
        t.insert(1, opened(), RW, "e", "p", None).unwrap();
    }
}
