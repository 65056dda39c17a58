//! Storage jobs: file I/O that would block the reactor, carried out on
//! a small pool of storage threads over a [`Backend`] or (as ring pieces,
//! [`ring_job`]) on the reactor's io_uring; their cancel flags; the test
//! hook that slows a write.

use std::os::fd::AsFd;
#[cfg(any(test, feature = "testkit"))]
use std::sync::atomic::AtomicU64;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use lwio_proto::server::OpId;
use lwio_proto::status::*;
use lwio_proto::NtStatus;
use lwio_rdma::Mr;
use tracing::{debug, warn};

use crate::fs::backend::Backend;
use crate::fs::table::OpenFile;
use crate::io_phase::reactor::KeptAlive;
use crate::io_phase::readbuf::ReadBuffer;
use crate::io_phase::{io_error_status, Waker};

use super::shared::lock;

pub(super) enum JobKind {
    Read {
        buf: Arc<ReadBuffer>,
        len: usize,
    },
    Write {
        data: Vec<u8>,
    },
    /// A reassembled message's data: (offset, length) pieces of the
    /// receive region `mr`, in order (buffers kept for the message, not
    /// posted until the job's reply).
    WriteParts {
        iov: Vec<(Arc<Mr>, usize, usize)>,
    },
    /// A FLUSH: fsync, or fdatasync with `data_only`, of the file.
    Sync {
        data_only: bool,
    },
}

pub(super) struct Job {
    pub(super) op: OpId,
    /// Also what keeps the file "in use" (`OpenFileTable::in_use`) until
    /// this job has ended: a `Rekey` for another connection waits for it,
    /// so a write of a lost connection is applied or cancelled before any
    /// later write to the file can arrive (docs/reconnect.md, the ordering
    /// rule). Dropped only after the I/O returned, never before.
    pub(super) file: crate::fs::fdcache::FdRef,
    pub(super) offset: u64,
    pub(super) align: u32,
    pub(super) kind: JobKind,
    pub(super) cancel: Arc<AtomicBool>,
    pub(super) reply: mpsc::Sender<(OpId, Result<u32, NtStatus>)>,
    pub(super) waker: Arc<Waker>,
}

#[derive(Clone)]
pub(super) struct StoragePool {
    pub(super) tx: mpsc::SyncSender<Job>,
    /// Jobs sent and not yet taken by a storage thread.
    pub(super) queued: Arc<AtomicUsize>,
}

impl StoragePool {
    pub(super) fn new(
        threads: usize,
        backend: Arc<dyn Backend>,
        queued: Arc<AtomicUsize>,
    ) -> StoragePool {
        let threads = threads.max(1);
        let (tx, rx) = mpsc::sync_channel::<Job>(threads * 256);
        let rx = Arc::new(Mutex::new(rx));
        for n in 0..threads {
            let rx = rx.clone();
            let backend = backend.clone();
            let taken = queued.clone();
            let r = std::thread::Builder::new()
                .name(format!("lwio-rdma-io-{n}"))
                .spawn(move || loop {
                    let job = match lock(&rx).recv() {
                        Ok(j) => j,
                        Err(_) => return,
                    };
                    taken.fetch_sub(1, Ordering::Relaxed);
                    let res = run_job(&*backend, &job);
                    // Drop the job (its Arc of the read buffer) before the
                    // reply: the reactor takes the buffer back
                    // with Arc::try_unwrap, and a clone still alive here
                    // made that fail and leak the registered-memory budget.
                    let (op, reply, waker) = (job.op, job.reply.clone(), job.waker.clone());
                    drop(job);
                    let _ = reply.send((op, res));
                    waker.wake();
                });
            if let Err(e) = r {
                warn!(error = %e, "cannot start a storage thread");
            }
        }
        StoragePool { tx, queued }
    }
}

/// Test hook, 0 unless a test sets it with [`slow_next_storage_write_for_tests`]
/// (built only with the `testkit` feature).
#[cfg(any(test, feature = "testkit"))]
pub(super) static SLOW_NEXT_WRITE_MS: AtomicU64 = AtomicU64::new(0);

/// The slowing the test hook asks of the next write, in ms (taken, when
/// `take`); always 0 in a server built without the `testkit` feature.
pub(super) fn slow_next_write_ms(take: bool) -> u64 {
    #[cfg(any(test, feature = "testkit"))]
    return if take {
        SLOW_NEXT_WRITE_MS.swap(0, Ordering::Relaxed)
    } else {
        SLOW_NEXT_WRITE_MS.load(Ordering::Relaxed)
    };
    #[cfg(not(any(test, feature = "testkit")))]
    {
        let _ = take;
        0
    }
}

/// **Tests only.** Make the next write a storage thread of this process
/// starts take `d` longer and ignore a cancel raised meanwhile: a device
/// whose write, once started, cannot be stopped (the thread-pool backend;
/// an io_uring write already running in the kernel). End-to-end tests use
/// it to have a lost connection's write still running when the client
/// comes back. Nothing outside tests calls it; there is no configuration
/// for it.
#[doc(hidden)]
#[cfg(any(test, feature = "testkit"))]
pub fn slow_next_storage_write_for_tests(d: Duration) {
    SLOW_NEXT_WRITE_MS.store(
        u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1),
        Ordering::Relaxed,
    );
}

/// **Tests only.** Whether the write [`slow_next_storage_write_for_tests`]
/// slows has started.
#[doc(hidden)]
#[cfg(any(test, feature = "testkit"))]
pub fn slow_storage_write_started_for_tests() -> bool {
    SLOW_NEXT_WRITE_MS.load(Ordering::Relaxed) == 0
}

/// A FLUSH's system call: `fdatasync(2)` with `data_only`, else `fsync(2)`
/// (on a storage thread, or on the reactor: `Conn::dispatch`).
pub(super) fn sync_file(fd: impl std::os::fd::AsFd, data_only: bool) -> std::io::Result<()> {
    let r = if data_only {
        rustix::fs::fdatasync(fd)
    } else {
        rustix::fs::fsync(fd)
    };
    r.map_err(std::io::Error::from)
}

/// A storage job as ring pieces: (iovecs, write, what keeps them alive).
/// `O_DIRECT` (`align` > 1): a write whose bytes are not aligned in memory
/// goes from an aligned copy; offsets and lengths must be aligned already.
pub(super) fn ring_job(
    offset: u64,
    align: u32,
    kind: JobKind,
) -> Result<(Vec<libc::iovec>, bool, KeptAlive), NtStatus> {
    let bad = |_| STATUS_INVALID_PARAMETER;
    let iov = |addr: usize, len: usize| libc::iovec {
        iov_base: addr as *mut libc::c_void,
        iov_len: len,
    };
    let a = align.max(1) as usize;
    // An aligned copy of `len` bytes, filled by `fill`.
    let bounce = |len: usize, fill: &mut dyn FnMut(&mut [u8])| {
        let mut b = vec![0u8; len + a];
        let pad = b.as_ptr().align_offset(a).min(a);
        fill(&mut b[pad..pad + len]);
        let at = b.as_ptr() as usize + pad;
        (at, b)
    };
    match kind {
        // An fsync: no memory, the ring op says which (`RingJob::sync`).
        JobKind::Sync { .. } => Ok((Vec::new(), false, KeptAlive::Nothing)),
        JobKind::Read { buf, len } => {
            let len = len.min(buf.len());
            crate::fs::backend::check_alignment(align, offset, buf.addr() as usize, len)
                .map_err(bad)?;
            Ok((
                vec![iov(buf.addr() as usize, len)],
                false,
                KeptAlive::Mr(buf),
            ))
        }
        JobKind::Write { data } => {
            let len = data.len();
            if a > 1 && !(data.as_ptr() as usize).is_multiple_of(a) {
                let (at, b) = bounce(len, &mut |d| d.copy_from_slice(&data));
                crate::fs::backend::check_alignment(align, offset, at, len).map_err(bad)?;
                return Ok((vec![iov(at, len)], true, KeptAlive::Bytes(b)));
            }
            let at = data.as_ptr() as usize;
            crate::fs::backend::check_alignment(align, offset, at, len).map_err(bad)?;
            Ok((vec![iov(at, len)], true, KeptAlive::Bytes(data)))
        }
        JobKind::WriteParts { iov: parts } => {
            for (mr, at, len) in &parts {
                if at.checked_add(*len).is_none_or(|e| e > mr.len()) {
                    return Err(STATUS_INVALID_PARAMETER);
                }
            }
            if a > 1 {
                let total: usize = parts.iter().map(|p| p.2).sum();
                let (at, b) = bounce(total, &mut |d| {
                    let mut o = 0;
                    for (mr, at, len) in &parts {
                        // Pieces checked inside their regions above.
                        let _ = mr.read_at(*at, &mut d[o..o + len]);
                        o += len;
                    }
                });
                crate::fs::backend::check_alignment(align, offset, at, total).map_err(bad)?;
                return Ok((vec![iov(at, total)], true, KeptAlive::Bytes(b)));
            }
            let v = parts
                .iter()
                .map(|(mr, at, len)| iov(mr.addr() as usize + at, *len))
                .collect();
            let mut regions: Vec<Arc<Mr>> = Vec::new();
            for (mr, _, _) in parts {
                if !regions.iter().any(|r| Arc::ptr_eq(r, &mr)) {
                    regions.push(mr);
                }
            }
            Ok((v, true, KeptAlive::Mrs(regions)))
        }
    }
}

pub(super) fn run_job(backend: &dyn Backend, job: &Job) -> Result<u32, NtStatus> {
    if job.cancel.load(Ordering::Acquire) {
        return Err(STATUS_CANCELLED);
    }
    let never = AtomicBool::new(false);
    let slow = if matches!(job.kind, JobKind::Read { .. } | JobKind::Sync { .. }) {
        0
    } else {
        slow_next_write_ms(true)
    };
    let cancel = if slow > 0 {
        // Started: from here on the write runs to its end (test hook).
        std::thread::sleep(Duration::from_millis(slow));
        &never
    } else {
        &*job.cancel
    };
    let fd = job.file.as_fd();
    let r = match &job.kind {
        JobKind::Sync { data_only } => Some(sync_file(fd, *data_only).map(|()| 0)),
        JobKind::Read { buf, len } => {
            let len = (*len).min(buf.len());
            let Ok(mut view) = buf.slice_mut(0, len) else {
                return Err(STATUS_INVALID_PARAMETER);
            };
            // SAFETY: `buf` belongs to this op alone. A region of its own
            // goes back to the spare pool only once its op is released, its
            // RDMA Writes have completed and it is no longer at storage
            // (`maybe_free_buf`), and `Arc::try_unwrap` proves this job's
            // reference is gone by then; a slab's slot goes back to its slab
            // only when the last `Arc<ReadBuffer>` (this job holds one) is
            // dropped, and other slots of its chunk are disjoint byte ranges
            // (`ReadBuffer::slice_mut` is bounded to this slot's). It is
            // registered LOCAL_WRITE only, so no remote key reaches it and no
            // receive is posted into it; the reactor posts an RDMA Write from
            // it only after this job's reply arrives (and did not do the I/O
            // inline: an op goes either inline or to the pool). So this slice
            // over [0, len) of the buffer is the only access to those bytes
            // while it lives; the Arc keeps the chunk's Mr, and its mapping,
            // alive.
            let slice = unsafe { view.as_mut_slice() };
            let mut ops =
                [crate::fs::backend::IoOp::read(fd, job.offset, slice).aligned(job.align)];
            backend.submit_cancellable(&mut ops, cancel).pop()
        }
        JobKind::Write { data } => {
            // O_DIRECT needs an aligned memory address too. The request's
            // payload is wherever the receive put it, so copy it into an
            // aligned buffer (offset and length alignment are the client's
            // business: unaligned ones fail with INVALID_PARAMETER).
            let a = job.align.max(1) as usize;
            let mut bounce = Vec::new();
            let data: &[u8] = if a > 1 && !(data.as_ptr() as usize).is_multiple_of(a) {
                bounce.resize(data.len() + a, 0u8);
                let pad = bounce.as_ptr().align_offset(a).min(a);
                bounce[pad..pad + data.len()].copy_from_slice(data);
                &bounce[pad..pad + data.len()]
            } else {
                data
            };
            let mut ops =
                [crate::fs::backend::IoOp::write(fd, job.offset, data).aligned(job.align)];
            backend.submit_cancellable(&mut ops, cancel).pop()
        }
        JobKind::WriteParts { iov } => {
            let mut slices: Vec<&[u8]> = Vec::with_capacity(iov.len());
            for (mr, at, len) in iov {
                let (at, len, base) = (*at, *len, mr.addr() as usize);
                if at.checked_add(len).is_none_or(|e| e > mr.len()) {
                    return Err(STATUS_INVALID_PARAMETER);
                }
                // SAFETY: the piece lies in the receive region (checked),
                // in a buffer kept for this message: the reactor
                // reposts it only after this job's reply (`storage_done`),
                // and the region is LOCAL_WRITE only, so neither the
                // provider nor a peer writes it while this shared slice
                // lives; the job's Arc keeps the region mapped even if the
                // connection is torn down meanwhile.
                slices.push(unsafe { std::slice::from_raw_parts((base + at) as *const u8, len) });
            }
            let a = job.align.max(1) as usize;
            if a > 1 {
                // O_DIRECT: one aligned copy, then one write.
                let total: usize = slices.iter().map(|s| s.len()).sum();
                let mut bounce = vec![0u8; total + a];
                let pad = bounce.as_ptr().align_offset(a).min(a);
                let mut o = pad;
                for sl in &slices {
                    bounce[o..o + sl.len()].copy_from_slice(sl);
                    o += sl.len();
                }
                let mut ops =
                    [
                        crate::fs::backend::IoOp::write(fd, job.offset, &bounce[pad..pad + total])
                            .aligned(job.align),
                    ];
                backend.submit_cancellable(&mut ops, cancel).pop()
            } else {
                // One batch: the pieces at consecutive offsets.
                let mut off = job.offset;
                let mut ops: Vec<_> = slices
                    .iter()
                    .map(|sl| {
                        let op = crate::fs::backend::IoOp::write(fd, off, sl);
                        off += sl.len() as u64;
                        op
                    })
                    .collect();
                let want: Vec<usize> = slices.iter().map(|s| s.len()).collect();
                let rs = backend.submit_cancellable(&mut ops, cancel);
                let mut done = 0usize;
                let mut err = None;
                for (r, w) in rs.into_iter().zip(want) {
                    match r {
                        Ok(n) => {
                            done += n;
                            if n < w {
                                break;
                            }
                        }
                        Err(e) => {
                            err = Some(e);
                            break;
                        }
                    }
                }
                // As one write: a failure (ENOSPC after some pieces went
                // in) is the answer, not the bytes before it.
                match err {
                    Some(e) => Some(Err(e)),
                    None => Some(Ok(done)),
                }
            }
        }
    };
    match r {
        Some(Ok(n)) => Ok(u32::try_from(n).unwrap_or(u32::MAX)),
        Some(Err(e)) => {
            debug!(op = job.op, error = %e, "storage operation failed");
            Err(io_error_status(&e))
        }
        None => Err(crate::io_phase::STATUS_UNEXPECTED_IO_ERROR),
    }
}

/// The status of an I/O whose file's descriptor could not be opened again
/// (docs/descriptor-cache.md): out of descriptors is a resource shortage;
/// anything else (removed, replaced, no longer permitted) means the open
/// file is gone: STATUS_FILE_DELETED, which clients map to ESTALE.
pub(super) fn reopen_status(f: &OpenFile, e: &lwio_side::error::Error) -> NtStatus {
    debug!(export = %f.export, path = %f.path, "cannot reopen an open file: {}", e.message);
    if e.code == lwio_side::error::ErrorCode::TooManyOpenFiles {
        STATUS_INSUFFICIENT_RESOURCES
    } else {
        STATUS_FILE_DELETED
    }
}
