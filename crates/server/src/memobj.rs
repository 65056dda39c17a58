//! Memory objects reachable by path (docs/memory-objects.md, seed 004).
//!
//! A client publishes a range of its own registered memory over the side
//! channel (`Publish`); the server lists it as `EXPORT/.lwio-mem/NAME` while
//! the publisher's RDMA channel lives, and serves other clients' READs and
//! WRITEs of it with RDMA Reads and Writes on the publisher's connection
//! (`io_phase::memobj_io`). This module is the registry both halves share: the
//! objects, and the publishers' RDMA channels by negotiate Key.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};

use lwio_proto::status::*;
use lwio_proto::wire::Guid;
use lwio_proto::NtStatus;
use lwio_side::types::{Attr, AttrX, FileKind};
use lwio_side::{Error, ErrorCode};
use tracing::{debug, info};

use crate::fs::table::SessionId;
use crate::io_phase::Waker;

/// The reserved directory of every export that holds its memory objects.
pub const MEM_DIR: &str = ".lwio-mem";
/// Longest object name, in bytes.
pub const MAX_NAME: usize = 128;
/// Objects one session may publish at once.
pub const MAX_PER_SESSION: usize = 16;
/// Objects the server holds at once.
pub const MAX_PER_SERVER: usize = 1024;
/// Largest object (the protocol's offsets are u64; this bounds nonsense).
pub const MAX_SIZE: u64 = 1 << 40;

/// One server-side I/O against a publisher's memory, done by the thread of
/// the publisher's RDMA connection.
pub enum MemOp {
    /// RDMA Read `len` bytes at the offset into the reader's server buffer
    /// (copied there from a bounce buffer of the publisher's connection).
    Read {
        buf: Arc<crate::io_phase::readbuf::ReadBuffer>,
        len: usize,
    },
    /// RDMA Write these bytes at the offset.
    Write { data: Vec<u8> },
}

/// Where a job's result goes: the requesting connection's storage-reply
/// channel and its waker (the same path storage-pool results take).
pub type Reply = (
    mpsc::Sender<(lwio_proto::server::OpId, Result<u32, NtStatus>)>,
    Arc<Waker>,
);

/// A job for the publisher's connection. Dropped unanswered (the
/// publisher's connection went away with it queued or in flight), it
/// answers [`STATUS_FILE_DELETED`]: a request never hangs on a dead
/// publisher.
pub struct MemJob {
    pub op: lwio_proto::server::OpId,
    pub obj: Arc<MemObj>,
    pub offset: u64,
    pub kind: MemOp,
    reply: Option<Reply>,
}

impl MemJob {
    pub fn new(
        op: lwio_proto::server::OpId,
        obj: Arc<MemObj>,
        offset: u64,
        kind: MemOp,
        reply: Reply,
    ) -> MemJob {
        MemJob {
            op,
            obj,
            offset,
            kind,
            reply: Some(reply),
        }
    }

    /// Answer the job (once).
    pub fn finish(mut self, r: Result<u32, NtStatus>) {
        self.answer(r);
    }

    fn answer(&mut self, r: Result<u32, NtStatus>) {
        // Release the reader's buffer before the reply: the reader takes it
        // back with `Arc::try_unwrap` when the reply arrives.
        self.kind = MemOp::Write { data: Vec::new() };
        if let Some((tx, waker)) = self.reply.take() {
            let _ = tx.send((self.op, r));
            waker.wake();
        }
    }
}

impl Drop for MemJob {
    fn drop(&mut self) {
        if self.reply.is_some() {
            self.answer(Err(STATUS_FILE_DELETED));
        }
    }
}

/// How the server reaches a publisher's RDMA connection.
#[derive(Clone)]
pub struct MemLink {
    pub tx: mpsc::Sender<MemJob>,
    pub waker: Arc<Waker>,
}

/// A published memory object.
pub struct MemObj {
    /// What was published: where, how large, the key and the grant.
    pub spec: PublishReq,
    pub session: SessionId,
    /// Nanoseconds since the epoch at publication (its mtime and ctime).
    pub published_ns: i64,
    link: MemLink,
    gone: AtomicBool,
    /// RDMA operations on the publisher's key posted and not completed.
    inflight: AtomicUsize,
    /// Writes into the object completed so far, and their waiters
    /// (`WaitWrites`: the publisher's notification).
    writes: std::sync::atomic::AtomicU64,
    wrote: tokio::sync::Notify,
}

impl std::fmt::Debug for MemObj {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemObj")
            .field("export", &self.spec.export)
            .field("name", &self.spec.name)
            .field("size", &self.spec.size)
            .field("writable", &self.spec.writable)
            .field("session", &self.session)
            .finish()
    }
}

impl MemObj {
    /// Withdrawn (unpublished, or its publisher is gone).
    pub fn is_gone(&self) -> bool {
        self.gone.load(Ordering::SeqCst)
    }

    /// Before posting an RDMA operation on the publisher's key: false (and
    /// nothing counted) if the object is withdrawn. Counted first, checked
    /// second, against `withdraw`'s store-then-read (both SeqCst): either
    /// this sees the withdrawal, or the withdrawal sees this count.
    pub fn begin_io(&self) -> bool {
        self.inflight.fetch_add(1, Ordering::SeqCst);
        if self.gone.load(Ordering::SeqCst) {
            self.end_io();
            return false;
        }
        true
    }

    /// The operation counted by `begin_io` completed (or was never posted).
    pub fn end_io(&self) {
        self.inflight.fetch_sub(1, Ordering::SeqCst);
    }

    /// Operations on the publisher's key still in flight.
    pub fn inflight(&self) -> usize {
        self.inflight.load(Ordering::SeqCst)
    }

    fn withdraw(&self) {
        self.gone.store(true, Ordering::SeqCst);
        self.wrote.notify_waiters();
    }

    /// A write into the object completed.
    pub fn written(&self) {
        self.writes.fetch_add(1, Ordering::SeqCst);
        self.wrote.notify_waiters();
    }

    /// Writes completed so far.
    pub fn writes(&self) -> u64 {
        self.writes.load(Ordering::SeqCst)
    }

    /// Wait until more than `seen` writes completed, the object is
    /// withdrawn, or `timeout` passes; the count then.
    pub async fn wait_writes(&self, seen: u64, timeout: std::time::Duration) -> u64 {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let woken = self.wrote.notified();
            tokio::pin!(woken);
            // Registered before the check: a write between the check and
            // the wait still wakes it.
            woken.as_mut().enable();
            let n = self.writes();
            if n > seen || self.is_gone() {
                return n;
            }
            if tokio::time::timeout_at(deadline, woken).await.is_err() {
                return self.writes();
            }
        }
    }

    /// Hand a job to the publisher's connection; a withdrawn object or a
    /// closed connection answers it with [`STATUS_FILE_DELETED`] (by drop).
    pub fn submit(&self, job: MemJob) {
        if self.is_gone() {
            return; // dropped: answered STATUS_FILE_DELETED
        }
        if let Err(mpsc::SendError(job)) = self.link.tx.send(job) {
            drop(job);
            return;
        }
        self.link.waker.wake();
    }

    /// The object's path in its export.
    pub fn path(&self) -> String {
        format!("{MEM_DIR}/{}", self.spec.name)
    }

    pub fn attr(&self) -> Attr {
        Attr {
            kind: FileKind::File,
            perm: self.perm(),
            size: self.spec.size,
            mtime_ns: self.published_ns,
        }
    }

    pub fn attrx(&self) -> AttrX {
        AttrX {
            kind: FileKind::File,
            perm: self.perm(),
            size: self.spec.size,
            ino: 0,
            nlink: 1,
            uid: 0,
            gid: 0,
            blocks: self.spec.size.div_ceil(512),
            blksize: 4096,
            atime_ns: self.published_ns,
            mtime_ns: self.published_ns,
            ctime_ns: self.published_ns,
        }
    }

    fn perm(&self) -> u32 {
        if self.spec.writable {
            0o666
        } else {
            0o444
        }
    }
}

/// Attributes of the reserved directory itself.
pub fn dir_attrx() -> AttrX {
    AttrX {
        kind: FileKind::Dir,
        perm: 0o555,
        size: 0,
        ino: 0,
        nlink: 2,
        uid: 0,
        gid: 0,
        blocks: 0,
        blksize: 4096,
        atime_ns: 0,
        mtime_ns: 0,
        ctime_ns: 0,
    }
}

/// What a path of an export names in the reserved directory.
#[derive(Debug, PartialEq, Eq)]
pub enum Reserved<'a> {
    /// Not under [`MEM_DIR`]: an ordinary path.
    No,
    /// The directory itself.
    Dir,
    /// An object name (maybe not published).
    Object(&'a str),
    /// Deeper than one level: never exists.
    Deeper,
}

/// Classify `path` (relative to its export, as the side channel carries
/// it; `.` components and repeated slashes are ignored as §6 does).
pub fn classify(path: &str) -> Reserved<'_> {
    let mut comps = path.split('/').filter(|c| !c.is_empty() && *c != ".");
    match comps.next() {
        Some(MEM_DIR) => {}
        _ => return Reserved::No,
    }
    match (comps.next(), comps.next()) {
        (None, _) => Reserved::Dir,
        (Some(n), None) => Reserved::Object(n),
        _ => Reserved::Deeper,
    }
}

fn not_found(export: &str, name: &str) -> Error {
    Error::new(
        ErrorCode::NotFound,
        format!("{export}/{MEM_DIR}/{name}: no such memory object"),
    )
}

#[derive(Default)]
struct Inner {
    objs: HashMap<(String, String), Arc<MemObj>>,
    /// RDMA channels that may carry a publication: negotiate Key →
    /// (session, link).
    channels: HashMap<Guid, (SessionId, MemLink)>,
}

/// The server's memory objects.
#[derive(Default)]
pub struct MemObjects {
    inner: Mutex<Inner>,
}

impl std::fmt::Debug for MemObjects {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "MemObjects({})", self.lock().objs.len())
    }
}

/// What a client asks to publish.
#[derive(Debug, Clone)]
pub struct PublishReq {
    pub export: String,
    pub name: String,
    pub size: u64,
    /// Where the publisher's memory is, in its key's address space.
    pub addr: u64,
    pub rkey: u32,
    /// Granted read-write (else read-only).
    pub writable: bool,
    /// The negotiate Key of the RDMA channel that carries it.
    pub channel: Guid,
}

impl MemObjects {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// An RDMA connection authenticated with negotiate Key `key` for
    /// `session`: it may carry that session's publications.
    pub fn attach(&self, key: Guid, session: SessionId, link: MemLink) {
        self.lock().channels.insert(key, (session, link));
    }

    /// That connection is gone: so is every object published through it.
    pub fn detach(&self, key: &Guid) {
        let mut g = self.lock();
        g.channels.remove(key);
        g.objs.retain(|_, o| {
            let keep = o.spec.channel != *key;
            if !keep {
                o.withdraw();
                info!(export = %o.spec.export, name = %o.spec.name, "memory object withdrawn: its publisher's RDMA channel closed");
            }
            keep
        });
    }

    /// The session ended: its objects go.
    pub fn end_session(&self, session: SessionId) {
        let mut g = self.lock();
        g.channels.retain(|_, (s, _)| *s != session);
        g.objs.retain(|_, o| {
            let keep = o.session != session;
            if !keep {
                o.withdraw();
            }
            keep
        });
    }

    /// Publish (the caller checked the export and the session's rights).
    pub fn publish(&self, session: SessionId, r: PublishReq) -> Result<Arc<MemObj>, Error> {
        validate_name(&r.name)?;
        if r.size == 0 || r.size > MAX_SIZE {
            return Err(Error::new(
                ErrorCode::InvalidArgument,
                format!(
                    "memory object size {} out of range (1..={MAX_SIZE})",
                    r.size
                ),
            ));
        }
        if r.addr.checked_add(r.size).is_none() {
            return Err(Error::new(
                ErrorCode::InvalidArgument,
                "memory object range wraps",
            ));
        }
        let mut g = self.lock();
        let link = match g.channels.get(&r.channel) {
            Some((s, l)) if *s == session => l.clone(),
            _ => {
                return Err(Error::new(
                    ErrorCode::PermissionDenied,
                    "the channel key names no RDMA channel of this session",
                ))
            }
        };
        let mine = g.objs.values().filter(|o| o.session == session).count();
        if mine >= MAX_PER_SESSION || g.objs.len() >= MAX_PER_SERVER {
            return Err(Error::new(
                ErrorCode::Busy,
                format!(
                    "too many memory objects (limits: {MAX_PER_SESSION} per session, \
                     {MAX_PER_SERVER} per server)"
                ),
            ));
        }
        let k = (r.export.clone(), r.name.clone());
        if g.objs.contains_key(&k) {
            return Err(Error::new(
                ErrorCode::Exists,
                format!("{}/{MEM_DIR}/{}: already published", r.export, r.name),
            ));
        }
        let published_ns = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as i64)
            .unwrap_or(0);
        let o = Arc::new(MemObj {
            spec: r,
            session,
            published_ns,
            link,
            gone: AtomicBool::new(false),
            inflight: AtomicUsize::new(0),
            writes: std::sync::atomic::AtomicU64::new(0),
            wrote: tokio::sync::Notify::new(),
        });
        debug!(export = %o.spec.export, name = %o.spec.name, size = o.spec.size, writable = o.spec.writable, session, "memory object published");
        g.objs.insert(k, o.clone());
        Ok(o)
    }

    /// Withdraw an object of `session`. The caller waits for
    /// [`MemObj::inflight`] to drain before it answers: the publisher
    /// deregisters its memory at the answer, and an RDMA operation still
    /// arriving with its key would be a protection error on its connection.
    pub fn unpublish(
        &self,
        session: SessionId,
        export: &str,
        name: &str,
    ) -> Result<Arc<MemObj>, Error> {
        let mut g = self.lock();
        let k = (export.to_string(), name.to_string());
        match g.objs.get(&k) {
            Some(o) if o.session == session => {
                o.withdraw();
                let o = o.clone();
                g.objs.remove(&k);
                Ok(o)
            }
            Some(_) => Err(Error::new(
                ErrorCode::PermissionDenied,
                format!("{export}/{MEM_DIR}/{name}: published by another session"),
            )),
            None => Err(not_found(export, name)),
        }
    }

    /// A published object by export and name.
    pub fn get(&self, export: &str, name: &str) -> Result<Arc<MemObj>, Error> {
        self.lock()
            .objs
            .get(&(export.to_string(), name.to_string()))
            .cloned()
            .ok_or_else(|| not_found(export, name))
    }

    /// The objects of an export, by name.
    pub fn list(&self, export: &str) -> Vec<Arc<MemObj>> {
        let mut v: Vec<_> = self
            .lock()
            .objs
            .values()
            .filter(|o| o.spec.export == export)
            .cloned()
            .collect();
        v.sort_by(|a, b| a.spec.name.cmp(&b.spec.name));
        v
    }

    /// Whether `session` has published objects.
    pub fn publishes(&self, session: SessionId) -> bool {
        self.lock().objs.values().any(|o| o.session == session)
    }

    /// Number of published objects.
    pub fn len(&self) -> usize {
        self.lock().objs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A name is one path component: 1..=[`MAX_NAME`] bytes, no `/`, NUL or
/// control characters, not `.` or `..`.
pub fn validate_name(name: &str) -> Result<(), Error> {
    if name.is_empty() || name.len() > MAX_NAME {
        return Err(Error::new(
            ErrorCode::NameTooLong,
            format!("memory object names are 1..={MAX_NAME} bytes"),
        ));
    }
    if name == "." || name == ".." || name.chars().any(|c| c == '/' || c.is_control()) {
        return Err(Error::new(
            ErrorCode::InvalidArgument,
            format!("{name:?} is not a valid memory object name"),
        ));
    }
    Ok(())
}

/// The status of a READ of `len` bytes at `offset`: the length to move
/// (reads past the end are short, at or past it 0 = end of file).
pub fn read_len(obj: &MemObj, offset: u64, len: usize) -> usize {
    let left = obj.spec.size.saturating_sub(offset);
    (len as u64).min(left) as usize
}

/// Whether a WRITE of `len` bytes at `offset` is allowed: the object must
/// be writable and the range inside it (a memory object has a fixed size:
/// STATUS_DISK_FULL, ENOSPC, for any byte past the end; nothing is written).
pub fn write_check(obj: &MemObj, offset: u64, len: usize) -> Result<(), NtStatus> {
    if !obj.spec.writable {
        return Err(STATUS_ACCESS_DENIED);
    }
    match offset.checked_add(len as u64) {
        Some(end) if end <= obj.spec.size => Ok(()),
        _ => Err(STATUS_DISK_FULL),
    }
}

/// The open-file record of a memory object: a stand-in file (an empty
/// memfd of the object's size, sealed against every change) so handle-based
/// calls that reach `OpenFile::file` (fstat, fsync) answer sensibly and
/// none can change anything; the data path uses `mem`.
pub fn opened(obj: &Arc<MemObj>) -> Result<crate::fs::OpenedFile, Error> {
    use rustix::fs::{fcntl_add_seals, ftruncate, memfd_create, MemfdFlags, SealFlags};
    let io = |e: rustix::io::Errno| {
        Error::from_io(
            &std::io::Error::from(e),
            format!("{}/{}", obj.spec.export, obj.path()),
        )
    };
    let fd =
        memfd_create("lwio-mem", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING).map_err(io)?;
    ftruncate(&fd, obj.spec.size).map_err(io)?;
    fcntl_add_seals(
        &fd,
        SealFlags::SHRINK | SealFlags::GROW | SealFlags::WRITE | SealFlags::SEAL,
    )
    .map_err(io)?;
    Ok(crate::fs::OpenedFile {
        file: std::fs::File::from(fd),
        size: obj.spec.size,
        direct: false,
        align: 1,
        mem: Some(obj.clone()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn link() -> (MemLink, mpsc::Receiver<MemJob>) {
        let (tx, rx) = mpsc::channel();
        (
            MemLink {
                tx,
                waker: Arc::new(Waker::new().unwrap()),
            },
            rx,
        )
    }

    fn req(name: &str, key: u8) -> PublishReq {
        PublishReq {
            export: "e".into(),
            name: name.into(),
            size: 100,
            addr: 0x1000,
            rkey: 7,
            writable: false,
            channel: Guid::from_bytes(&[key; 16]).unwrap(),
        }
    }

    #[test]
    fn classify_paths() {
        assert_eq!(classify("a/b"), Reserved::No);
        assert_eq!(classify(""), Reserved::No);
        assert_eq!(classify(".lwio-mem"), Reserved::Dir);
        assert_eq!(classify("./.lwio-mem/"), Reserved::Dir);
        assert_eq!(classify(".lwio-mem//x"), Reserved::Object("x"));
        assert_eq!(classify(".lwio-mem/x/y"), Reserved::Deeper);
        assert_eq!(classify(".lwio-memx"), Reserved::No);
    }

    #[test]
    fn publish_needs_own_channel_and_limits_hold() {
        let m = MemObjects::default();
        let (l, _rx) = link();
        m.attach(Guid::from_bytes(&[1; 16]).unwrap(), 5, l);
        // Another session's channel: refused.
        assert_eq!(
            m.publish(6, req("a", 1)).unwrap_err().code,
            ErrorCode::PermissionDenied
        );
        // Unknown channel.
        assert!(m.publish(5, req("a", 2)).is_err());
        let o = m.publish(5, req("a", 1)).unwrap();
        assert_eq!(
            m.publish(5, req("a", 1)).unwrap_err().code,
            ErrorCode::Exists
        );
        for n in 1..MAX_PER_SESSION {
            m.publish(5, req(&format!("n{n}"), 1)).unwrap();
        }
        assert_eq!(m.publish(5, req("z", 1)).unwrap_err().code, ErrorCode::Busy);
        // Bad names.
        for bad in ["", ".", "..", "a/b", "a\0", &"x".repeat(MAX_NAME + 1)] {
            assert!(validate_name(bad).is_err(), "{bad:?}");
        }
        // Only the publisher withdraws.
        assert!(m.unpublish(6, "e", "a").is_err());
        m.unpublish(5, "e", "a").unwrap();
        assert!(o.is_gone());
        assert_eq!(m.get("e", "a").unwrap_err().code, ErrorCode::NotFound);
        // The channel closing withdraws the rest.
        m.detach(&Guid::from_bytes(&[1; 16]).unwrap());
        assert!(m.is_empty());
    }

    #[test]
    fn dropped_job_answers_file_deleted() {
        let m = MemObjects::default();
        let (l, rx) = link();
        m.attach(Guid::from_bytes(&[1; 16]).unwrap(), 5, l);
        let o = m.publish(5, req("a", 1)).unwrap();
        let (tx, done) = mpsc::channel();
        let w = Arc::new(Waker::new().unwrap());
        o.submit(MemJob::new(
            3,
            o.clone(),
            0,
            MemOp::Write { data: vec![1] },
            (tx, w),
        ));
        // The publisher's connection goes with the job queued.
        drop(rx);
        assert_eq!(done.recv().unwrap(), (3, Err(STATUS_FILE_DELETED)));
    }

    #[test]
    fn sizes_are_fixed() {
        let m = MemObjects::default();
        let (l, _rx) = link();
        m.attach(Guid::from_bytes(&[1; 16]).unwrap(), 5, l);
        let mut r = req("w", 1);
        r.writable = true;
        let o = m.publish(5, r).unwrap();
        assert_eq!(read_len(&o, 90, 20), 10);
        assert_eq!(read_len(&o, 100, 20), 0);
        assert_eq!(read_len(&o, u64::MAX, 20), 0);
        assert_eq!(write_check(&o, 90, 10), Ok(()));
        assert_eq!(write_check(&o, 90, 11), Err(STATUS_DISK_FULL));
        assert_eq!(write_check(&o, u64::MAX, 1), Err(STATUS_DISK_FULL));
        let ro = m.publish(5, req("r", 1)).unwrap();
        assert_eq!(write_check(&ro, 0, 1), Err(STATUS_ACCESS_DENIED));
        // Hostile ranges are refused before anything is registered.
        for (size, addr) in [
            (0, 0x1000),
            (MAX_SIZE + 1, 0x1000),
            (0x2000, u64::MAX - 0x1000),
        ] {
            let mut r = req("bad", 1);
            r.size = size;
            r.addr = addr;
            assert_eq!(
                m.publish(5, r).unwrap_err().code,
                ErrorCode::InvalidArgument,
                "size {size} addr {addr:#x}"
            );
        }
    }
}
