//! The mount's state behind the FUSE calls: inodes and paths, open files
//! (reopened after a reconnect), side-channel calls as the caller, and the
//! attributes and entries the kernel is answered with.

use super::leased::OwnChange;
use super::*;

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
            unstable: Default::default(),
            handed_off: Mutex::new(Default::default()),
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

    pub(super) fn client(&self) -> Client {
        self.shared.client()
    }

    /// A side-channel call, counted. When the connection to the server is
    /// gone, the mount connects again (at most once a second) and, if that
    /// works, makes the call once more on the new session: after a server
    /// restart, new opens and every namespace call work again (files open
    /// before it are lost: their calls fail with EIO).
    pub(super) fn side<T>(
        &self,
        f: impl Fn(&mut lwio_client::side_client::SideClient) -> lwio_side::Result<T>,
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
    pub(super) fn stat(&self, path: &str) -> Res<AttrX> {
        let export = &self.export;
        self.side(|s| s.statx(export, path, false))
    }

    pub(super) fn path(&self, ino: INodeNo) -> Res<String> {
        lock(&self.shared.inodes).path(ino.0).ok_or(libc::ENOENT)
    }

    /// A file open on node `ino`, for a node whose name is gone (unlinked
    /// while open).
    pub(super) fn open_file_of(&self, ino: INodeNo) -> Option<Arc<File>> {
        lock(&self.files)
            .values()
            .find(|o| o.ino == ino.0)
            .map(|o| o.current())
    }

    /// The open file to act on for `ino`: the given one, else (for a node
    /// with no name left) any file open on it; None: by path.
    pub(super) fn file_for(&self, ino: INodeNo, fh: Option<FileHandle>) -> Res<Option<Arc<File>>> {
        if let Some(Ok(f)) = fh.map(|fh| self.file(fh)) {
            return Ok(Some(f));
        }
        if lock(&self.shared.inodes).path(ino.0).is_some() {
            return Ok(None);
        }
        self.open_file_of(ino).map(Some).ok_or(libc::ENOENT)
    }

    pub(super) fn child(&self, parent: INodeNo, name: &OsStr) -> Res<String> {
        Ok(join(&self.path(parent)?, name_str(name)?))
    }

    /// The kernel's attributes: the server's, with our node id. Owners are
    /// the server's uids and gids, as NFS shows them.
    pub(super) fn attr(&self, ino: u64, a: &AttrX) -> FileAttr {
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
    pub(super) fn entry(&self, path: &str, a: &AttrX, reply: ReplyEntry) {
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
    pub(super) fn reply_entry(&self, path: &str, a: &AttrX, leased: bool, reply: ReplyEntry) {
        let ino = {
            let mut t = lock(&self.shared.inodes);
            let ino = t.lookup(path);
            t.set_server_ino(ino, a.ino);
            ino
        };
        let (entry_ttl, attr_ttl) = self.ttls(leased);
        reply.entry_with_ttls(&attr_ttl, &entry_ttl, &self.attr(ino, a), Generation(0));
    }

    pub(super) fn reply_attr(&self, ino: INodeNo, r: Res<AttrX>, reply: ReplyAttr) {
        match r {
            Ok(a) => reply.attr(&self.cfg.attr_ttl, &self.attr(ino.0, &a)),
            Err(e) => reply.error(err(e)),
        }
    }

    pub(super) fn entry_of(&self, fh: FileHandle) -> Res<Arc<OpenEntry>> {
        lock(&self.files).get(&fh.0).cloned().ok_or(libc::EBADF)
    }

    /// The open file of `fh`, reopened first if the mount connected again
    /// since it was opened.
    pub(super) fn file(&self, fh: FileHandle) -> Res<Arc<File>> {
        let o = self.entry_of(fh)?;
        self.fresh(&o)?;
        Ok(o.current())
    }

    /// A side-channel call on open file `f`'s handle, counted: the handle
    /// stays right across a reconnect (the call is made again on the
    /// reopened file, [`File::side`]).
    pub(super) fn on_file<T>(
        &self,
        f: &File,
        call: impl FnMut(&mut lwio_client::side_client::SideClient, u64) -> lwio_side::Result<T>,
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
    pub(super) fn fresh(&self, o: &OpenEntry) -> Res<()> {
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
    pub(super) fn with_file<T>(
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

    pub(super) fn add_file(&self, ino: u64, flags: i32, f: File) -> u64 {
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
    pub(super) fn open_path(&self, path: &str, flags: i32, create_mode: Option<u32>) -> Res<File> {
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
            // open(2): "EINVAL: the file system does not support the
            // O_DIRECT flag" (the server says which file system refused).
            Err(libc::EOPNOTSUPP) if o.0.no_buffering => Err(libc::EINVAL),
            r => r,
        }
    }

    pub(super) fn fopen_flags(&self, flags: i32, keep: bool) -> FopenFlags {
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
    pub(super) fn keep_cache(&self, ino: u64, path: &str) -> bool {
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

    pub(super) fn read_into(
        &self,
        f: &File,
        offset: u64,
        size: u32,
    ) -> lwio_client::Result<Vec<u8>> {
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

    /// A write(2) of node `ino` through `fh`: sent and answered at once when
    /// the mount's writes are unstable, the file is not O_SYNC/O_DSYNC and
    /// the node was not handed to the preload (its answer is collected
    /// later: `unstable`), else written and waited for.
    pub(super) fn write(&self, ino: u64, fh: FileHandle, offset: u64, data: &[u8]) -> Res<u32> {
        let o = self.entry_of(fh)?;
        // Every write: the per-mount bounds hold across files too (a node
        // with nothing pending costs two lookups here).
        self.unstable
            .before_write(ino, offset, data.len(), &|fh, off, d| {
                self.resend(fh, off, d)
            });
        let sync = o.flags & (libc::O_SYNC | libc::O_DSYNC) != 0;
        // A node a program also reaches through the preload: its reads
        // there go to the server at once, so this write must be there first.
        let shared = lock(&self.handed_off).contains(&ino);
        if self.cfg.unstable_writes && !sync && !shared {
            self.fresh(&o)?;
            match o.current().start_write(data, offset) {
                Ok(Some(pw)) => {
                    self.unstable.add(ino, fh.0, offset, data.to_vec(), pw);
                    Stats::add(&self.stats.writes, 1);
                    Stats::add(&self.stats.write_bytes, data.len() as u64);
                    return Ok(data.len() as u32);
                }
                // Larger than one request, or the connection is going:
                // the waited-for way (which reconnects).
                Ok(None) | Err(lwio_client::Error::ConnectionLost(_)) => {}
                Err(e) => return Err(errno::client(&e)),
            }
        }
        self.with_file(fh, |f| self.write_all(f, offset, data))
    }

    /// An unstable write whose connection was lost, written again (and
    /// waited for) through its open file, reopened on the new connection.
    fn resend(&self, fh: u64, offset: u64, data: &[u8]) -> Res<u32> {
        self.with_file(FileHandle(fh), |f| self.write_all(f, offset, data))
    }

    /// Wait for node `ino`'s unstable writes (before a call that reads its
    /// data or attributes). Their errors stay for the next fsync or close.
    pub(super) fn settle(&self, ino: u64) {
        self.unstable
            .drain(ino, &|fh, off, d| self.resend(fh, off, d));
    }

    /// Wait for every unstable write of the mount (before a listing or a
    /// lookup, whose answers carry attributes).
    pub(super) fn settle_all(&self) {
        self.unstable
            .drain_all(&|fh, off, d| self.resend(fh, off, d));
    }

    /// close(2) of `ino` (FUSE's flush): its writes waited for; the first
    /// failure of one not reported yet is the close's.
    pub(super) fn settle_for_close(&self, ino: u64) -> Res<()> {
        self.settle(ino);
        match self.unstable.take_error(ino) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// fsync(2)/fdatasync(2) of `ino` through `fh` (see `Unstable::fsync`).
    pub(super) fn fsync_file(&self, ino: u64, fh: FileHandle, datasync: bool) -> Res<()> {
        let f = self.file(fh)?;
        let sync = || {
            self.with_file(fh, |f| {
                if !f.syncs_on_rdma() {
                    Stats::add(&self.stats.side_calls, 1);
                }
                if datasync {
                    f.sync_data()
                } else {
                    f.sync_all()
                }
            })
        };
        self.unstable
            .fsync(ino, &f, &sync, &|fh, off, d| self.resend(fh, off, d))
    }

    pub(super) fn write_all(&self, f: &File, offset: u64, data: &[u8]) -> lwio_client::Result<u32> {
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
    pub(super) fn readdir_entries(&self, fh: FileHandle) -> Res<(Arc<Listing>, bool)> {
        lock(&self.dirs).get(&fh.0).cloned().ok_or(libc::EBADF)
    }

    /// A node id for a listed entry: the looked-up one if the kernel knows
    /// it, else a stable stand-in (readdir's d_ino is informational; the
    /// kernel takes the real id from the lookup that follows).
    pub(super) fn listed_ino(&self, path: &str) -> u64 {
        if let Some(i) = lock(&self.shared.inodes).peek(path) {
            return i;
        }
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in path.bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
        }
        h | (1 << 63)
    }

    pub(super) fn remove(
        &self,
        parent: INodeNo,
        name: &OsStr,
        kind: RemoveKind,
        reply: ReplyEmpty,
    ) {
        let r = (|| -> Res<()> {
            let path = self.child(parent, name)?;
            let export = &self.export;
            self.side(|s| s.remove_kind(export, &path, kind))?;
            lock(&self.shared.inodes).unlinked(&path);
            self.own_change(&path, OwnChange::Removed);
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
