//! The FUSE operations (`fuser::Filesystem`), each a thin call into the
//! mount's state ([`super::files`]) and lease cache ([`super::leased`]).

use super::leased::*;
use super::*;

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
            | InitFlags::FUSE_FLOCK_LOCKS
            // O_DIRECT aio (libaio, io_uring) as asynchronous FUSE
            // requests, several in flight as the caller queued them, not
            // one at a time: the `threads` serve them side by side.
            | InitFlags::FUSE_ASYNC_DIO;
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
        self.settle_all();
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
        self.settle_all();
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
                    self.own_change(&path, OwnChange::Is(&a));
                }
                self.entry(&path, &a, reply)
            }
            Err(e) => {
                if e == libc::ENOENT {
                    self.own_change(&path, OwnChange::Removed);
                }
                reply.error(err(e))
            }
        }
    }

    fn forget(&self, _req: &Request, ino: INodeNo, nlookup: u64) {
        let mut inodes = lock(&self.shared.inodes);
        inodes.forget(ino.0, nlookup);
        if inodes.path(ino.0).is_none() {
            lock(&self.handed_off).remove(&ino.0);
        }
    }

    fn getattr(&self, req: &Request, ino: INodeNo, fh: Option<FileHandle>, reply: ReplyAttr) {
        let _t = self.stats.ops.time(Op::Getattr);
        self.settle(ino.0);
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
        self.settle(ino.0);
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
                self.own_change(&p, OwnChange::Is(&a));
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
            self.own_change(&path, OwnChange::Is(&a));
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
            self.own_change(&path, OwnChange::Is(&a));
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
        self.settle(ino.0);
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
            self.own_change(&to, OwnChange::Is(&a));
            // The source's link count changed too.
            self.own_change(&from, OwnChange::Stale);
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
        self.settle(ino.0);
        let r = self.file(fh).and_then(|f| {
            if mode as u32 & !lwio_side::codec::FALLOC_KNOWN != 0 {
                return Err(libc::EOPNOTSUPP);
            }
            self.on_file(&f, |s, h| s.fallocate(h, mode as u32, offset, length))
        });
        if let Ok(p) = self.path(ino) {
            self.own_change(&p, OwnChange::Stale);
        }
        match r {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(err(e)),
        }
    }

    fn lseek(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: i64,
        whence: i32,
        reply: fuser::ReplyLseek,
    ) {
        let _t = self.stats.ops.time(Op::Lseek);
        self.settle(ino.0);
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
        ino_in: INodeNo,
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
        self.settle(ino_in.0);
        self.settle(ino_out.0);
        // Copied on the server: no byte crosses to this client.
        let r = self.file(fh_in).and_then(|a| {
            let b = self.file(fh_out)?;
            let (h_in, h_out) = (a.handle(), b.handle());
            let len = len.min(lwio_side::codec::COPY_RANGE_MAX);
            self.side(|s| s.copy_range(h_in, offset_in, h_out, offset_out, len))
        });
        if let Ok(p) = self.path(ino_out) {
            self.own_change(&p, OwnChange::Stale);
        }
        match r {
            Ok(n) => reply.written(n as u32),
            Err(e) => reply.error(err(e)),
        }
    }

    fn getlk(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        lock_owner: LockOwner,
        start: u64,
        end: u64,
        typ: i32,
        _pid: u32,
        reply: fuser::ReplyLock,
    ) {
        let _t = self.stats.ops.time(Op::Lock);
        self.settle(ino.0);
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
        ino: INodeNo,
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
        self.settle(ino.0);
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
                self.own_change(&from, OwnChange::Stale);
            } else {
                self.own_change(&from, OwnChange::Removed);
            }
            self.own_change(&to, OwnChange::Stale);
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
        self.settle(ino.0);
        let _as = Acting::of(req);
        let r = self.path(ino).and_then(|p| {
            let f = self.open_path(&p, flags.0, None)?;
            if flags.0 & libc::O_ACCMODE != libc::O_RDONLY {
                self.own_change(&p, OwnChange::Stale);
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
            self.own_change(&path, OwnChange::Stale);
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
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let _t = self.stats.ops.time(Op::Read);
        self.settle(ino.0);
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
        let r = self.write(ino.0, fh, offset, data);
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
                Ok(n) => self.own_change(&p, OwnChange::Wrote(offset + u64::from(*n))),
                Err(_) => self.own_change(&p, OwnChange::Stale),
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
        ino: INodeNo,
        fh: FileHandle,
        lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        let _t = self.stats.ops.time(Op::Flush);
        // The file's unstable writes are answered before the close is: a
        // failure not reported yet is the close's (as NFS reports it).
        // A close drops the closing owner's locks on the file (POSIX).
        let r = self
            .settle_for_close(ino.0)
            .and(self.file(fh))
            .and_then(|f| {
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
        ino: INodeNo,
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
        // The program reads and writes the file itself from now on: this
        // mount's writes of it are on the server first.
        self.settle(ino.0);
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
                lock(&self.handed_off).insert(ino.0);
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
        ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        let _t = self.stats.ops.time(Op::Release);
        self.settle(ino.0);
        let f = lock(&self.files).remove(&fh.0).map(|o| o.current());
        // A write failure nobody was told of (no fsync, no checked close)
        // is not kept past the file's last open: logged.
        if !lock(&self.files).values().any(|o| o.ino == ino.0) {
            if let Some(e) = self.unstable.take_error(ino.0) {
                warn!(
                    node = ino.0,
                    error = %io::Error::from_raw_os_error(e),
                    "a write failed on the server and no fsync or close of the file reported it"
                );
            }
        }
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
        ino: INodeNo,
        fh: FileHandle,
        datasync: bool,
        reply: ReplyEmpty,
    ) {
        let _t = self.stats.ops.time(Op::Fsync);
        let r = self.fsync_file(ino.0, fh, datasync);
        match r {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(err(e)),
        }
    }

    fn opendir(&self, req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        let _t = self.stats.ops.time(Op::Opendir);
        self.settle_all();
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
        self.settle_all();
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
            self.own_change(&path, OwnChange::Is(&a));
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
