//! A storage action's file I/O: the open file it names, then the memory
//! object's publisher, the page-cache fast path, the reactor's io_uring or
//! the storage threads ([`Conn::dispatch`]); writes from kept receive
//! buffers ([`Conn::write_parts`]).

use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use lwio_proto::server::{OpId, RecvId};
use lwio_proto::status::*;
use lwio_rdma::Mr;
use tracing::debug;

use crate::fs::table::{OpenFile, Rights};
use crate::io_phase::reactor::RingJob;
use crate::memobj::MemOp;

use super::conn::Conn;
use super::inline::{inline_io, inline_io_vec};
use super::shared::lock;
use super::storage::{reopen_status, ring_job, slow_next_write_ms, sync_file, Job, JobKind};

/// The right an operation needs on its file ([`Conn::file_for`]).
#[derive(Debug, Clone, Copy)]
pub(in crate::io_phase) enum Need {
    Read,
    Write,
    /// Either one (a sync: fsync(2) needs only an open file).
    Either,
}

impl Need {
    fn met_by(self, r: &Rights) -> bool {
        match self {
            Need::Read => r.read,
            Need::Write => r.write,
            Need::Either => r.read || r.write,
        }
    }
}

impl Conn {
    /// A write whose data is `parts` of receive buffers (kept, not posted,
    /// since): a reassembled message's fragments, or a WRITE's one buffer.
    /// Written with one `pwritev` from there on this thread when the
    /// page-cache fast path allows, else on the reactor's io_uring (or a storage thread) from the
    /// same buffers; the buffers are reposted once the write is done
    /// (`storage_done`). The fragment counters count messages of several
    /// fragments only.
    pub(super) fn write_parts(
        &mut self,
        op: OpId,
        file: u64,
        offset: u64,
        parts: Vec<(RecvId, std::ops::Range<usize>)>,
    ) {
        let bufs: Vec<RecvId> = parts.iter().map(|(b, _)| *b).collect();
        let Some(f) = self
            .files
            .get(&file)
            .filter(|f| f.rights.write && !f.is_closed())
            .cloned()
        else {
            // (`file_for` answers the refusal: nothing copied.)
            self.repost_recvs(bufs);
            self.file_for(op, file, Need::Write);
            return;
        };
        // Pieces of the receive buffers: (region, start, len), in message
        // order.
        let mut iov: Vec<(Arc<Mr>, usize, usize)> = Vec::with_capacity(parts.len());
        for (b, r) in &parts {
            let place = self.recv_buf(*b);
            let Some((mr, at)) = place.filter(|(mr, at)| {
                r.end <= self.recv_slot && r.start <= r.end && at + r.end <= mr.len()
            }) else {
                self.repost_recvs(bufs);
                self.close_conn("a fragment range outside its receive buffer");
                return;
            };
            if r.end > r.start {
                iov.push((mr, at + r.start, r.len()));
            }
        }
        let frag = u64::from(parts.len() > 1);
        self.shared
            .fragment_writes
            .fetch_add(frag, Ordering::Relaxed);
        if f.mem.is_some() {
            // A memory object (its publisher's connection does the I/O
            // from a copy): the FileWrite way, from a copy.
            let mut data = Vec::with_capacity(iov.iter().map(|p| p.2).sum());
            for (mr, at, len) in &iov {
                let mut piece = vec![0u8; *len];
                if mr.read_at(*at, &mut piece).is_err() {
                    break;
                }
                data.extend_from_slice(&piece);
            }
            self.repost_recvs(bufs);
            let Some(f) = self.file_for(op, file, Need::Write) else {
                return;
            };
            self.shared
                .fragment_write_calls
                .fetch_add(frag, Ordering::Relaxed);
            self.dispatch(op, f, offset, JobKind::Write { data });
            return;
        }
        self.last_io = Instant::now();
        let fd = match f.fd() {
            Ok(fd) => fd,
            Err(e) => {
                self.repost_recvs(bufs);
                self.storage_done(op, Err(reopen_status(&f, &e)));
                return;
            }
        };
        let total: usize = iov.iter().map(|p| p.2).sum();
        let inline = if !self.shared.opts.inline_io {
            None
        } else {
            let block = self.alone_on_reactor();
            let vecs: Vec<libc::iovec> = iov
                .iter()
                .map(|(mr, at, len)| libc::iovec {
                    iov_base: (mr.addr() as usize + at) as *mut libc::c_void,
                    iov_len: *len,
                })
                .collect();
            // SAFETY: every iovec lies in a receive region (checked
            // above) within a buffer the state machine kept: not posted
            // since its message arrived, so the provider places nothing
            // there, and the region is LOCAL_WRITE only, so no peer key
            // reaches it; the kernel only reads it; `iov` holds an Arc of
            // each region, which keeps it mapped across the call.
            unsafe {
                inline_io_vec(
                    &mut self.inline_mode,
                    &f,
                    fd.as_raw_fd(),
                    offset,
                    &vecs,
                    total,
                    block,
                )
            }
        };
        if let Some(n) = inline {
            self.shared
                .fragment_write_calls
                .fetch_add(frag, Ordering::Relaxed);
            self.shared.inline_ios.fetch_add(1, Ordering::Relaxed);
            self.repost_recvs(bufs);
            self.storage_done(op, Ok(n));
            return;
        }
        self.shared
            .fragment_write_calls
            .fetch_add(frag, Ordering::Relaxed);
        drop(fd);
        let Some(d) = self.sconn.op_data_mut(op) else {
            // (Not in flight: nothing would repost them after the write.)
            self.repost_recvs(bufs);
            return;
        };
        d.recvs = Some(bufs);
        self.dispatch(op, f, offset, JobKind::WriteParts { iov });
    }

    /// The open file behind a storage action, if the connection may do
    /// that kind of I/O on it; otherwise the op is completed with the error.
    pub(super) fn file_for(&mut self, op: OpId, file: u64, need: Need) -> Option<OpenFile> {
        self.last_io = Instant::now();
        let st = match self.files.get(&file) {
            None => STATUS_INVALID_HANDLE,
            // Its handle was closed on the side channel, or its session
            // ended: the Fid is dead on every connection (issue 31).
            Some(f) if f.is_closed() => {
                if let Some(f) = self.files.remove(&file) {
                    debug!(conn = self.id, path = %f.path, file, "Fid of a closed handle");
                }
                STATUS_FILE_CLOSED
            }
            Some(f) if need.met_by(&f.rights) => return Some(f.clone()),
            Some(_) => STATUS_ACCESS_DENIED,
        };
        self.sconn
            .handle_storage_complete(Instant::now(), op, Err(st));
        None
    }

    pub(super) fn dispatch(&mut self, op: OpId, f: OpenFile, offset: u64, kind: JobKind) {
        if let Some(obj) = &f.mem {
            // A memory object: the publisher's connection does the I/O.
            let kind = match kind {
                JobKind::Read { buf, len } => MemOp::Read { buf, len },
                JobKind::Write { data } => MemOp::Write { data },
                // A memory object is the publisher's memory: no storage
                // to sync.
                JobKind::Sync { .. } => {
                    self.storage_done(op, Ok(0));
                    return;
                }
                // `write_parts` sends memory objects the FileWrite way.
                JobKind::WriteParts { .. } => {
                    self.storage_done(op, Err(STATUS_INVALID_DEVICE_REQUEST));
                    return;
                }
            };
            let reply = (self.done_tx.clone(), self.waker.clone());
            if let Some(r) = crate::io_phase::memobj_io::submit(obj, op, offset, kind, reply) {
                self.storage_done(op, r);
            }
            return;
        }
        // The descriptor, held (never closed by the cache) until the I/O
        // has returned.
        let fd = match f.fd() {
            Ok(fd) => fd,
            Err(e) => {
                self.storage_done(op, Err(reopen_status(&f, &e)));
                return;
            }
        };
        if let JobKind::Sync { data_only } = kind {
            if self.alone_on_reactor() {
                let r = sync_file(&*fd, data_only)
                    .map(|()| 0)
                    .map_err(|e| crate::io_phase::io_error_status(&e));
                self.shared.inline_syncs.fetch_add(1, Ordering::Relaxed);
                self.storage_done(op, r);
                return;
            }
        }
        if let Some(r) = self.try_inline(&f, fd.as_raw_fd(), offset, &kind) {
            self.shared.inline_ios.fetch_add(1, Ordering::Relaxed);
            // Release the read buffer's Arc before `storage_done`, which
            // takes the buffer back with `Arc::try_unwrap`.
            drop(kind);
            self.storage_done(op, Ok(r));
            return;
        }
        let slow_hook = matches!(kind, JobKind::Write { .. } | JobKind::WriteParts { .. })
            && slow_next_write_ms(false) > 0;
        // A sync on the ring too: the kernel's worker runs the fsync and
        // the reactor reaps it with its other I/O, one thread hand-off
        // less than the pool's (a database syncs at every commit).
        if let (Some(rio), false) = (self.rio.clone(), slow_hook) {
            let align = if f.direct { f.align } else { 1 };
            let sync = match kind {
                JobKind::Sync { data_only } => Some(data_only),
                _ => None,
            };
            let r = ring_job(offset, align, kind).and_then(|(iov, write, keep)| {
                let job = RingJob {
                    conn: self.id,
                    slot: self.slot,
                    op,
                    file: fd,
                    offset,
                    iov,
                    write,
                    sync,
                    keep,
                };
                // SAFETY: `ring_job` built every iovec inside `keep`, which
                // the ring op owns until its completion is reaped. A read
                // buffer is this op's alone while it is at storage (see
                // `run_job`); a write's bytes are a copy or receive buffers
                // kept for the message (reposted only in `storage_done`),
                // registered LOCAL_WRITE only: nothing writes them while
                // the kernel reads them.
                unsafe { lock(&rio).push(job) }
            });
            match r {
                Ok(id) => {
                    if let Some(d) = self.sconn.op_data_mut(op) {
                        d.ring = Some(id);
                    }
                }
                Err(st) => self.storage_done(op, Err(st)),
            }
            return;
        }
        let cancel = Arc::new(AtomicBool::new(false));
        let job = Job {
            op,
            file: fd,
            offset,
            align: if f.direct { f.align } else { 1 },
            kind,
            cancel: cancel.clone(),
            reply: self.done_tx.clone(),
            waker: self.waker.clone(),
        };
        // Counted before it can be taken (and uncounted), never after.
        self.pool.queued.fetch_add(1, Ordering::Relaxed);
        match self.pool.tx.try_send(job) {
            Ok(()) => {
                if let Some(d) = self.sconn.op_data_mut(op) {
                    d.cancel = Some(cancel);
                }
            }
            Err(_) => {
                self.pool.queued.fetch_sub(1, Ordering::Relaxed);
                debug!(conn = self.id, op, "storage queue full");
                if let Some(b) = self.sconn.op_data_mut(op).and_then(|d| d.read.as_mut()) {
                    b.at_storage = false;
                }
                self.sconn.handle_storage_complete(
                    Instant::now(),
                    op,
                    Err(STATUS_INSUFFICIENT_RESOURCES),
                );
            }
        }
    }

    /// Whether this thread may block for this connection's sync or small
    /// write (`inline_when_alone`): the connection is the only one its
    /// reactor drives, so no other client waits behind the device (its own
    /// requests wait, as behind a busy worker).
    fn alone_on_reactor(&self) -> bool {
        self.shared.opts.inline_io
            && self.shared.opts.inline_when_alone
            && self
                .reactor_conns
                .as_ref()
                .is_some_and(|n| n.load(Ordering::Relaxed) == 1)
    }

    /// The page-cache fast path: do the I/O on this thread when it cannot
    /// block on a device. On tmpfs/ramfs a file's data is memory, so plain
    /// `pread`/`pwrite` are memory copies; elsewhere the call carries
    /// `RWF_NOWAIT` and fails with `EAGAIN` instead of blocking (data not
    /// cached, writeback or locks needed). `Some(n)` = done, all of it;
    /// `None` = hand it to the storage pool (which redoes a partial transfer
    /// whole: reads and writes of the same bytes are idempotent). Skipped
    /// for `O_DIRECT` files and when `inline_io` is off; a file system that
    /// refuses `RWF_NOWAIT` is remembered per file and direction. A
    /// connection alone on its reactor (`alone_on_reactor`) has its
    /// small writes made with a plain call even there.
    pub(super) fn try_inline(
        &mut self,
        f: &OpenFile,
        fd: RawFd,
        offset: u64,
        kind: &JobKind,
    ) -> Option<u32> {
        if !self.shared.opts.inline_io {
            return None;
        }
        let block = self.alone_on_reactor();
        let (ptr, len, write) = match kind {
            JobKind::Read { buf, len } => (buf.addr() as *mut u8, (*len).min(buf.len()), false),
            JobKind::Write { data } => (data.as_ptr() as *mut u8, data.len(), true),
            // Tried inline before it became a job (`write_parts`); a sync
            // blocks on the device.
            JobKind::WriteParts { .. } | JobKind::Sync { .. } => return None,
        };
        // SAFETY: a read lands in a server read buffer registered with
        // LOCAL_WRITE only (no remote key reaches it) from which no RDMA
        // Write is posted until this op completes, so the kernel's write
        // races with nothing; its length is clamped to the buffer (a slab
        // slot's own bytes: other slots are disjoint, and this one is not
        // given to another read while the Arc in `kind` lives) and that Arc
        // keeps the mapping alive. A write's source is a live
        // Vec in `kind`, only read.
        unsafe { inline_io(&mut self.inline_mode, f, fd, offset, ptr, len, write, block) }
    }
}
