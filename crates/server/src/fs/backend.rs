//! File I/O backends: positional reads and writes into caller buffers.
//!
//! [`Backend::submit`] takes a batch of operations, starts them all, and
//! returns when every one has completed. Reads stop short only at end of file;
//! writes either complete fully or fail. Operations on `O_DIRECT` files carry
//! the file's alignment and are checked before anything is submitted.
//!
//! * [`UringBackend`] — io_uring through [`super::ring::Ring`], the driver the
//!   reactors use. A bounded pool of rings (one per concurrent
//!   caller, at most `max_rings`); a caller takes a ring, pushes its whole
//!   batch (one `io_uring_enter` for many operations), reaps completions,
//!   resubmits short transfers, and returns the ring.
//! * [`ThreadPoolBackend`] — a bounded pool of threads doing
//!   `pread`/`pwrite`, used when io_uring is unavailable (old kernels, seccomp,
//!   `io_uring_disabled`). [`open_backend`] detects which one works and logs it.
//! * [`InlineBackend`] — `pread`/`pwrite` on the caller's thread, for threads
//!   whose job is to block on file I/O (the RDMA phase's storage threads).
//!
//! Cancellation ([`Backend::submit_cancellable`]): io_uring cancels requests
//! that are running (`IORING_OP_ASYNC_CANCEL`) once the flag is raised; they
//! fail with `ECANCELED`. What the kernel has already started in a way it
//! cannot interrupt (a buffered read waiting on a page lock, a device
//! transfer in progress) still completes, normally: the cancel is only a
//! request. The thread pool cannot stop a `pread`/`pwrite` that has begun;
//! it only skips operations (and chunks of them) not yet started.

use std::collections::VecDeque;
use std::fmt;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use super::ring::{FdRef, PushError, Ring};

/// The buffer of one operation.
#[derive(Debug)]
pub enum IoBuf<'a> {
    Read(&'a mut [u8]),
    Write(&'a [u8]),
}

impl IoBuf<'_> {
    fn len(&self) -> usize {
        match self {
            IoBuf::Read(b) => b.len(),
            IoBuf::Write(b) => b.len(),
        }
    }
    fn addr(&self) -> usize {
        match self {
            IoBuf::Read(b) => b.as_ptr() as usize,
            IoBuf::Write(b) => b.as_ptr() as usize,
        }
    }
    fn is_write(&self) -> bool {
        matches!(self, IoBuf::Write(_))
    }
}

/// One positional read or write.
#[derive(Debug)]
pub struct IoOp<'a> {
    pub fd: BorrowedFd<'a>,
    pub offset: u64,
    pub buf: IoBuf<'a>,
    /// Required alignment of offset, length and buffer address (1 = none;
    /// the file's alignment for `O_DIRECT` files).
    pub align: u32,
}

impl<'a> IoOp<'a> {
    pub fn read(fd: BorrowedFd<'a>, offset: u64, buf: &'a mut [u8]) -> IoOp<'a> {
        IoOp {
            fd,
            offset,
            buf: IoBuf::Read(buf),
            align: 1,
        }
    }
    pub fn write(fd: BorrowedFd<'a>, offset: u64, buf: &'a [u8]) -> IoOp<'a> {
        IoOp {
            fd,
            offset,
            buf: IoBuf::Write(buf),
            align: 1,
        }
    }
    /// Require `align` (for `O_DIRECT` files).
    pub fn aligned(mut self, align: u32) -> IoOp<'a> {
        self.align = align.max(1);
        self
    }
}

/// Check `O_DIRECT` alignment; the error says what is wrong.
pub fn check_alignment(align: u32, offset: u64, addr: usize, len: usize) -> io::Result<()> {
    let a = u64::from(align.max(1));
    if a == 1 {
        return Ok(());
    }
    let bad = |what: String| {
        Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("unbuffered (O_DIRECT) I/O must be aligned to {a} bytes: {what}"),
        ))
    };
    if !offset.is_multiple_of(a) {
        return bad(format!("offset {offset} is not"));
    }
    if !(len as u64).is_multiple_of(a) {
        return bad(format!("length {len} is not"));
    }
    if !(addr as u64).is_multiple_of(a) {
        return bad(format!("buffer address {addr:#x} is not"));
    }
    Ok(())
}

/// Which backend is in use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendKind {
    IoUring,
    Threads,
}

impl fmt::Display for BackendKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            BackendKind::IoUring => "io_uring",
            BackendKind::Threads => "threads",
        })
    }
}

/// Positional file I/O into caller buffers.
pub trait Backend: Send + Sync + fmt::Debug {
    fn kind(&self) -> BackendKind;

    /// Run a batch; one result per operation, in order: bytes transferred.
    fn submit(&self, ops: &mut [IoOp<'_>]) -> Vec<io::Result<usize>>;

    /// [`Backend::submit`] that gives up when `cancel` becomes true: the
    /// operations not yet started, and those running that the backend can
    /// stop (see the module documentation), fail with `ECANCELED`. Checking
    /// the flag costs nothing while the I/O completes promptly.
    fn submit_cancellable(
        &self,
        ops: &mut [IoOp<'_>],
        cancel: &AtomicBool,
    ) -> Vec<io::Result<usize>> {
        if cancel.load(Ordering::Relaxed) {
            return ops.iter().map(|_| Err(cancelled())).collect();
        }
        self.submit(ops)
    }

    /// Read at `offset`; short only at end of file.
    fn read_at(&self, fd: BorrowedFd<'_>, offset: u64, buf: &mut [u8]) -> io::Result<usize> {
        let mut ops = [IoOp::read(fd, offset, buf)];
        self.submit(&mut ops)
            .pop()
            .unwrap_or_else(|| Err(io::ErrorKind::Other.into()))
    }

    /// Write all of `buf` at `offset`.
    fn write_at(&self, fd: BorrowedFd<'_>, offset: u64, buf: &[u8]) -> io::Result<usize> {
        let mut ops = [IoOp::write(fd, offset, buf)];
        self.submit(&mut ops)
            .pop()
            .unwrap_or_else(|| Err(io::ErrorKind::Other.into()))
    }
}

/// Backend selection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum BackendChoice {
    /// io_uring when it works here, else threads.
    #[default]
    Auto,
    #[serde(alias = "io_uring", alias = "uring")]
    IoUring,
    Threads,
}

impl std::str::FromStr for BackendChoice {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(BackendChoice::Auto),
            "io-uring" | "io_uring" | "uring" => Ok(BackendChoice::IoUring),
            "threads" => Ok(BackendChoice::Threads),
            _ => Err(format!(
                "unknown io backend {s:?} (auto, io-uring, threads)"
            )),
        }
    }
}

/// Open the chosen backend; `Auto` probes io_uring and falls back, logging
/// which one it uses. `workers` bounds rings or threads.
pub fn open_backend(choice: BackendChoice, workers: usize) -> io::Result<Arc<dyn Backend>> {
    let workers = workers.max(1);
    match choice {
        BackendChoice::Threads => {
            tracing::info!(
                threads = workers,
                "file I/O backend: thread pool (configured)"
            );
            Ok(Arc::new(ThreadPoolBackend::new(workers)))
        }
        BackendChoice::IoUring => {
            let b = UringBackend::new(256, workers)?;
            tracing::info!(rings = workers, "file I/O backend: io_uring");
            Ok(Arc::new(b))
        }
        BackendChoice::Auto => match UringBackend::new(256, workers) {
            Ok(b) => {
                tracing::info!(rings = workers, "file I/O backend: io_uring");
                Ok(Arc::new(b))
            }
            Err(e) => {
                tracing::warn!(error = %e, threads = workers, "io_uring unavailable; file I/O backend: thread pool");
                Ok(Arc::new(ThreadPoolBackend::new(workers)))
            }
        },
    }
}

// ---------------------------------------------------------------- io_uring

/// io_uring backend: a bounded pool of [`Ring`]s, the driver the reactors
/// use too. A caller takes a ring, pushes its batch, and blocks in
/// [`Ring::submit_and_wait`] until every operation has completed.
pub struct UringBackend {
    pool: Mutex<Vec<Ring>>,
    freed: Condvar,
    created: AtomicUsize,
    max_rings: usize,
    entries: u32,
}

impl fmt::Debug for UringBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UringBackend")
            .field("entries", &self.entries)
            .field("max_rings", &self.max_rings)
            .finish()
    }
}

/// Largest single read/write submitted (io_uring lengths are u32).
const MAX_CHUNK: usize = 1 << 30;

/// How long a cancellable wait sleeps before it looks at its flag again:
/// the longest a CANCEL waits for a running io_uring request to be asked to
/// stop. I/O that completes sooner never wakes up for it.
const CANCEL_CHECK: std::time::Duration = std::time::Duration::from_millis(20);

fn cancelled() -> io::Error {
    io::Error::from_raw_os_error(libc::ECANCELED)
}

impl UringBackend {
    /// Create the first ring ([`Ring::new`] checks that io_uring works here
    /// and has what the rings use): fails where io_uring is not usable.
    pub fn new(entries: u32, max_rings: usize) -> io::Result<UringBackend> {
        let ring = Ring::new(entries)?;
        Ok(UringBackend {
            pool: Mutex::new(vec![ring]),
            freed: Condvar::new(),
            created: AtomicUsize::new(1),
            max_rings: max_rings.max(1),
            entries,
        })
    }

    fn take(&self) -> io::Result<Ring> {
        let mut g = self.pool.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(r) = g.pop() {
                return Ok(r);
            }
            if self.created.load(Ordering::Relaxed) < self.max_rings {
                self.created.fetch_add(1, Ordering::Relaxed);
                drop(g);
                return Ring::new(self.entries).inspect_err(|_| {
                    self.created.fetch_sub(1, Ordering::Relaxed);
                });
            }
            g = self.freed.wait(g).unwrap_or_else(|p| p.into_inner());
        }
    }

    fn give(&self, r: Ring) {
        self.pool.lock().unwrap_or_else(|p| p.into_inner()).push(r);
        self.freed.notify_one();
    }

    /// A ring that could not be waited on is dropped (its `Drop` waits for
    /// what the kernel still has, or stops the process) and not reused.
    fn discard(&self, r: Ring) {
        drop(r);
        self.created.fetch_sub(1, Ordering::Relaxed);
        self.freed.notify_one();
    }

    /// Run `ops` on `ring` to completion; short transfers go on from where
    /// they stopped. With `cancel`, the waits wake every [`CANCEL_CHECK`]
    /// to look at the flag: once it is raised, nothing more is pushed and
    /// every operation the ring has gets [`Ring::cancel`]. Returns only when
    /// the ring has nothing of `ops` left; `Err` when the ring failed and
    /// must be discarded (every unfinished result is then that error).
    fn run(
        ring: &mut Ring,
        ops: &mut [IoOp<'_>],
        results: &mut [Option<io::Result<usize>>],
        cancel: Option<&AtomicBool>,
    ) -> io::Result<()> {
        let mut done = vec![0usize; ops.len()];
        let mut queue: VecDeque<usize> = (0..ops.len()).filter(|&i| results[i].is_none()).collect();
        let mut inflight = 0usize;
        let mut cancelling = false;
        let mut reaped = Vec::new();
        loop {
            if !cancelling && cancel.is_some_and(|c| c.load(Ordering::Relaxed)) {
                cancelling = true;
                for i in queue.drain(..) {
                    results[i] = Some(Err(cancelled()));
                }
                // Without a result and no longer queued: with the ring.
                for i in (0..ops.len()).filter(|&i| results[i].is_none()) {
                    ring.cancel(i as u64);
                }
            }
            // Once cancelling, the queue is empty.
            while let Some(&i) = queue.front() {
                let op = &mut ops[i];
                let len = (op.buf.len() - done[i]).min(MAX_CHUNK);
                let off = op.offset + done[i] as u64;
                // SAFETY: the buffer and fd are borrowed by `ops` for the
                // whole call, and this function does not return before every
                // pushed operation has been reaped (`inflight` reaches 0) or
                // the ring is discarded, whose `Drop` waits for the kernel to
                // finish with them: the kernel never touches memory or a
                // descriptor the caller has taken back.
                let pushed = unsafe {
                    match &mut op.buf {
                        IoBuf::Read(b) => ring.read(
                            i as u64,
                            FdRef::Borrowed(op.fd),
                            b[done[i]..].as_mut_ptr(),
                            len,
                            off,
                        ),
                        IoBuf::Write(b) => ring.write(
                            i as u64,
                            FdRef::Borrowed(op.fd),
                            b[done[i]..].as_ptr(),
                            len,
                            off,
                        ),
                    }
                };
                match pushed {
                    Ok(()) => {
                        queue.pop_front();
                        inflight += 1;
                    }
                    // The ring's cap: the rest waits for completions.
                    Err(PushError::Full) => break,
                    Err(e) => {
                        queue.pop_front();
                        results[i] = Some(Err(e.into()));
                    }
                }
            }
            if inflight == 0 {
                return Ok(());
            }
            let tick = (cancel.is_some() && !cancelling).then_some(CANCEL_CHECK);
            if let Err(e) = ring.submit_and_wait(tick) {
                for r in results.iter_mut().filter(|r| r.is_none()) {
                    *r = Some(Err(io::Error::new(e.kind(), e.to_string())));
                }
                return Err(e);
            }
            ring.reap(&mut reaped);
            for (ud, res) in reaped.drain(..) {
                inflight -= 1;
                let i = ud as usize;
                let total = ops[i].buf.len();
                if res < 0 {
                    match -res {
                        libc::EINTR | libc::EAGAIN if cancelling => {
                            results[i] = Some(Err(cancelled()))
                        }
                        libc::EINTR | libc::EAGAIN => queue.push_back(i),
                        e => results[i] = Some(Err(io::Error::from_raw_os_error(e))),
                    }
                } else if res == 0 && total > done[i] {
                    results[i] = Some(if ops[i].buf.is_write() {
                        Err(io::ErrorKind::WriteZero.into())
                    } else {
                        Ok(done[i]) // end of file
                    });
                } else {
                    done[i] += res as usize;
                    if done[i] >= total {
                        results[i] = Some(Ok(done[i]));
                    } else if cancelling {
                        results[i] = Some(Err(cancelled()));
                    } else {
                        queue.push_back(i); // short transfer: continue
                    }
                }
            }
        }
    }
}

fn prevalidate(ops: &[IoOp<'_>]) -> Vec<Option<io::Result<usize>>> {
    ops.iter()
        .map(|op| {
            if let Err(e) = check_alignment(op.align, op.offset, op.buf.addr(), op.buf.len()) {
                Some(Err(e))
            } else if op
                .offset
                .checked_add(op.buf.len() as u64)
                .is_none_or(|end| end > i64::MAX as u64)
            {
                Some(Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "offset + length overflows",
                )))
            } else if op.buf.len() == 0 {
                Some(Ok(0))
            } else {
                None
            }
        })
        .collect()
}

impl Backend for UringBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::IoUring
    }

    fn submit(&self, ops: &mut [IoOp<'_>]) -> Vec<io::Result<usize>> {
        self.submit_with(ops, None)
    }

    fn submit_cancellable(
        &self,
        ops: &mut [IoOp<'_>],
        cancel: &AtomicBool,
    ) -> Vec<io::Result<usize>> {
        self.submit_with(ops, Some(cancel))
    }
}

impl UringBackend {
    fn submit_with(
        &self,
        ops: &mut [IoOp<'_>],
        cancel: Option<&AtomicBool>,
    ) -> Vec<io::Result<usize>> {
        let mut results = prevalidate(ops);
        if results.iter().any(|r| r.is_none()) {
            match self.take() {
                Ok(mut ring) => match UringBackend::run(&mut ring, ops, &mut results, cancel) {
                    Ok(()) => self.give(ring),
                    Err(e) => {
                        tracing::error!(error = %e, "io_uring wait failed; the ring is discarded");
                        self.discard(ring);
                    }
                },
                Err(e) => {
                    for r in results.iter_mut().filter(|r| r.is_none()) {
                        *r = Some(Err(io::Error::new(e.kind(), e.to_string())));
                    }
                }
            }
        }
        results
            .into_iter()
            .map(|r| r.unwrap_or_else(|| Err(io::Error::other("operation not completed"))))
            .collect()
    }
}

// ---------------------------------------------------------------- threads

struct Job {
    fd: RawFd,
    addr: usize,
    len: usize,
    offset: u64,
    write: bool,
    index: usize,
    done: mpsc::Sender<(usize, io::Result<usize>)>,
}

/// `pread`/`pwrite` on the calling thread: for threads that exist to
/// block on file I/O (the RDMA phase's storage threads when io_uring is
/// unavailable), so that they are the one pool, not a pool in front of
/// [`ThreadPoolBackend`]'s. Cancellation skips the operations, and chunks,
/// not yet started.
#[derive(Debug, Default, Clone, Copy)]
pub struct InlineBackend;

impl Backend for InlineBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Threads
    }

    fn submit(&self, ops: &mut [IoOp<'_>]) -> Vec<io::Result<usize>> {
        self.submit_cancellable(ops, &AtomicBool::new(false))
    }

    fn submit_cancellable(
        &self,
        ops: &mut [IoOp<'_>],
        cancel: &AtomicBool,
    ) -> Vec<io::Result<usize>> {
        let pre = prevalidate(ops);
        ops.iter_mut()
            .zip(pre)
            .map(|(op, pre)| {
                if let Some(r) = pre {
                    return r;
                }
                if cancel.load(Ordering::Relaxed) {
                    return Err(cancelled());
                }
                let (addr, len, write) = (op.buf.addr(), op.buf.len(), op.buf.is_write());
                // SAFETY: `op.buf` is a live borrow (exclusive for a read)
                // of [addr, addr+len) and `op.fd` a borrowed open fd, both
                // held by `ops` for the whole call.
                unsafe { rw_all(op.fd.as_raw_fd(), addr, len, op.offset, write, Some(cancel)) }
            })
            .collect()
    }
}

/// `pread`/`pwrite` on a bounded pool of threads.
pub struct ThreadPoolBackend {
    tx: Option<mpsc::SyncSender<Job>>,
    workers: Vec<JoinHandle<()>>,
}

impl fmt::Debug for ThreadPoolBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ThreadPoolBackend")
            .field("threads", &self.workers.len())
            .finish()
    }
}

fn do_job(j: &Job) -> io::Result<usize> {
    // SAFETY: the submitting thread keeps the buffer [addr, addr+len) and
    // the fd alive until it has received this job's result (or the job is
    // dropped), see `ThreadPoolBackend::submit`.
    unsafe { rw_all(j.fd, j.addr, j.len, j.offset, j.write, None) }
}

/// `pread`/`pwrite` until all of [addr, addr+len) is done (a read: or end
/// of file), retrying EINTR; between chunks, stops if `cancel` is raised.
///
/// # Safety
/// `fd` is open and [addr, addr+len) is memory the caller lets this call
/// write (a read) or read (a write) until it returns.
unsafe fn rw_all(
    fd: RawFd,
    addr: usize,
    len: usize,
    offset: u64,
    write: bool,
    cancel: Option<&AtomicBool>,
) -> io::Result<usize> {
    let mut done = 0usize;
    while done < len {
        if done > 0 && cancel.is_some_and(|c| c.load(Ordering::Relaxed)) {
            return Err(cancelled());
        }
        let n = (len - done).min(MAX_CHUNK);
        let off = (offset + done as u64) as libc::off_t;
        // SAFETY: the caller's contract: the range and the fd stay valid
        // for this call.
        let r = unsafe {
            if write {
                libc::pwrite(fd, (addr + done) as *const libc::c_void, n, off)
            } else {
                libc::pread(fd, (addr + done) as *mut libc::c_void, n, off)
            }
        };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if r == 0 {
            if write {
                return Err(io::ErrorKind::WriteZero.into());
            }
            break;
        }
        done += r as usize;
    }
    Ok(done)
}

impl ThreadPoolBackend {
    pub fn new(threads: usize) -> ThreadPoolBackend {
        let threads = threads.max(1);
        let (tx, rx) = mpsc::sync_channel::<Job>(threads * 4);
        let rx = Arc::new(Mutex::new(rx));
        let workers = (0..threads)
            .map(|n| {
                let rx = rx.clone();
                std::thread::Builder::new()
                    .name(format!("lwio-io-{n}"))
                    .spawn(move || loop {
                        let job = match rx.lock().unwrap_or_else(|p| p.into_inner()).recv() {
                            Ok(j) => j,
                            Err(_) => return,
                        };
                        let r = do_job(&job);
                        let _ = job.done.send((job.index, r));
                    })
                    .expect("spawning an I/O thread")
            })
            .collect();
        ThreadPoolBackend {
            tx: Some(tx),
            workers,
        }
    }
}

impl Drop for ThreadPoolBackend {
    fn drop(&mut self) {
        self.tx.take();
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

impl Backend for ThreadPoolBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Threads
    }

    fn submit(&self, ops: &mut [IoOp<'_>]) -> Vec<io::Result<usize>> {
        let mut results = prevalidate(ops);
        let (done_tx, done_rx) = mpsc::channel();
        let mut sent = 0usize;
        if let Some(tx) = &self.tx {
            for (i, op) in ops.iter().enumerate() {
                if results[i].is_some() {
                    continue;
                }
                let job = Job {
                    fd: op.fd.as_raw_fd(),
                    addr: op.buf.addr(),
                    len: op.buf.len(),
                    offset: op.offset,
                    write: op.buf.is_write(),
                    index: i,
                    done: done_tx.clone(),
                };
                if tx.send(job).is_ok() {
                    sent += 1;
                }
            }
        }
        drop(done_tx);
        // Every job holds a clone of `done_tx`: the channel only disconnects
        // once each job has finished or been dropped, so no worker can touch
        // the buffers after this loop.
        let mut got = 0;
        while got < sent {
            match done_rx.recv() {
                Ok((i, r)) => {
                    results[i] = Some(r);
                    got += 1;
                }
                Err(_) => break,
            }
        }
        results
            .into_iter()
            .map(|r| r.unwrap_or_else(|| Err(io::Error::other("I/O thread pool is shut down"))))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    fn backends() -> Vec<Arc<dyn Backend>> {
        let mut v: Vec<Arc<dyn Backend>> =
            vec![Arc::new(ThreadPoolBackend::new(3)), Arc::new(InlineBackend)];
        match UringBackend::new(8, 2) {
            Ok(b) => v.push(Arc::new(b)),
            Err(e) => eprintln!("io_uring unavailable here, testing threads only: {e}"),
        }
        v
    }

    fn pattern(len: usize, seed: u8) -> Vec<u8> {
        (0..len)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect()
    }

    #[test]
    fn byte_exact_odd_offsets() {
        for b in backends() {
            let f = tempfile::tempfile().unwrap();
            let fd = f.as_fd();
            let data = pattern(100_003, 7);
            assert_eq!(
                b.write_at(fd, 13, &data).unwrap(),
                data.len(),
                "{:?}",
                b.kind()
            );
            let mut back = vec![0u8; data.len()];
            assert_eq!(b.read_at(fd, 13, &mut back).unwrap(), data.len());
            assert_eq!(back, data, "{:?}", b.kind());
            // Odd sub-range.
            let mut part = vec![0u8; 777];
            assert_eq!(b.read_at(fd, 13 + 4097, &mut part).unwrap(), 777);
            assert_eq!(&part[..], &data[4097..4097 + 777]);
            // Short at EOF.
            let mut tail = vec![0u8; 50];
            assert_eq!(b.read_at(fd, 13 + 100_003 - 20, &mut tail).unwrap(), 20);
            assert_eq!(&tail[..20], &data[100_003 - 20..]);
            assert_eq!(b.read_at(fd, 1 << 20, &mut tail).unwrap(), 0);
        }
    }

    #[test]
    fn past_4gib_sparse() {
        for b in backends() {
            let f = tempfile::tempfile().unwrap();
            let fd = f.as_fd();
            let off = (5u64 << 30) + 3;
            let data = pattern(65_537, 3);
            assert_eq!(b.write_at(fd, off, &data).unwrap(), data.len());
            assert_eq!(f.metadata().unwrap().len(), off + data.len() as u64);
            let mut back = vec![0u8; data.len() + 10];
            assert_eq!(b.read_at(fd, off - 10, &mut back).unwrap(), data.len() + 10);
            assert_eq!(&back[..10], &[0u8; 10], "hole reads as zeros");
            assert_eq!(&back[10..], &data[..]);
        }
    }

    #[test]
    fn batches() {
        for b in backends() {
            let f = tempfile::tempfile().unwrap();
            let fd = f.as_fd();
            // More operations than ring entries (8) to exercise requeueing.
            let chunks: Vec<Vec<u8>> = (0..40).map(|i| pattern(1000 + i, i as u8)).collect();
            let mut ops: Vec<IoOp<'_>> = chunks
                .iter()
                .enumerate()
                .map(|(i, c)| IoOp::write(fd, (i as u64) * 5003, c))
                .collect();
            for r in b.submit(&mut ops) {
                assert!(r.is_ok());
            }
            let mut outs: Vec<Vec<u8>> = chunks.iter().map(|c| vec![0u8; c.len()]).collect();
            let mut ops: Vec<IoOp<'_>> = outs
                .iter_mut()
                .enumerate()
                .map(|(i, o)| IoOp::read(fd, (i as u64) * 5003, o))
                .collect();
            let rs = b.submit(&mut ops);
            drop(ops);
            for (i, r) in rs.into_iter().enumerate() {
                assert_eq!(r.unwrap(), chunks[i].len());
                assert_eq!(outs[i], chunks[i]);
            }
        }
    }

    #[test]
    fn errors_per_operation() {
        for b in backends() {
            let f = tempfile::tempfile().unwrap();
            let ro = std::fs::File::open("/dev/null").unwrap();
            let buf = [1u8; 10];
            let mut ops = [
                IoOp::write(f.as_fd(), 0, &buf),
                IoOp::write(ro.as_fd(), 0, &buf),
            ];
            let rs = b.submit(&mut ops);
            assert_eq!(rs[0].as_ref().unwrap(), &10);
            assert_eq!(
                rs[1].as_ref().unwrap_err().raw_os_error(),
                Some(libc::EBADF)
            );
        }
    }

    #[test]
    fn alignment_checked() {
        assert!(check_alignment(1, 3, 5, 7).is_ok());
        assert!(check_alignment(4096, 8192, 4096, 4096).is_ok());
        let e = check_alignment(4096, 5, 4096, 4096).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
        assert_eq!(
            e.to_string(),
            "unbuffered (O_DIRECT) I/O must be aligned to 4096 bytes: offset 5 is not"
        );
        assert!(check_alignment(512, 0, 512, 100)
            .unwrap_err()
            .to_string()
            .contains("length 100"));
        assert!(check_alignment(512, 0, 3, 512)
            .unwrap_err()
            .to_string()
            .contains("buffer address"));
        for b in backends() {
            let f = tempfile::tempfile().unwrap();
            let buf = [0u8; 100];
            let mut ops = [IoOp::write(f.as_fd(), 1, &buf).aligned(512)];
            let r = b.submit(&mut ops).pop().unwrap();
            assert_eq!(r.unwrap_err().kind(), io::ErrorKind::InvalidInput);
        }
    }

    /// A read that never completes by itself (an empty pipe) is cancelled
    /// while running on io_uring: `ECANCELED` soon after the flag is raised,
    /// and the ring goes back to the pool fit for use.
    #[test]
    fn running_uring_read_is_cancelled() {
        let b = match UringBackend::new(8, 1) {
            Ok(b) => b,
            Err(e) => return eprintln!("io_uring unavailable here: {e}"),
        };
        let mut fds = [0i32; 2];
        // SAFETY: pipe2 writes two descriptors into the array we own.
        assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
        // SAFETY: both descriptors were just created and are owned here.
        let (rx, tx) = unsafe {
            use std::os::fd::FromRawFd;
            (
                std::fs::File::from_raw_fd(fds[0]),
                std::fs::File::from_raw_fd(fds[1]),
            )
        };
        let cancel = Arc::new(AtomicBool::new(false));
        let c2 = cancel.clone();
        let raiser = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(200));
            c2.store(true, Ordering::Release);
        });
        let t = std::time::Instant::now();
        let mut buf = vec![0u8; 64];
        let mut ops = [IoOp::read(rx.as_fd(), 0, &mut buf)];
        let r = b.submit_cancellable(&mut ops, &cancel).pop().unwrap();
        raiser.join().unwrap();
        assert_eq!(r.unwrap_err().raw_os_error(), Some(libc::ECANCELED));
        assert!(
            t.elapsed() < std::time::Duration::from_secs(5),
            "{:?}",
            t.elapsed()
        );
        // The same ring serves the next read.
        use std::io::Write;
        (&tx).write_all(b"after").unwrap();
        let cancel = AtomicBool::new(false);
        let mut ops = [IoOp::read(rx.as_fd(), 0, &mut buf[..5])];
        let r = b.submit_cancellable(&mut ops, &cancel).pop().unwrap();
        assert_eq!(r.unwrap(), 5);
        assert_eq!(&buf[..5], b"after");
    }

    #[test]
    fn auto_detect() {
        let b = open_backend(BackendChoice::Auto, 2).unwrap();
        let forced = open_backend(BackendChoice::Threads, 2).unwrap();
        assert_eq!(forced.kind(), BackendKind::Threads);
        let f = tempfile::tempfile().unwrap();
        assert_eq!(b.write_at(f.as_fd(), 0, b"abc").unwrap(), 3);
    }
}
