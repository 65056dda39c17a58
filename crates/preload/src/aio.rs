//! POSIX AIO (aio_read, aio_write, aio_fsync, aio_error, aio_return,
//! aio_suspend, aio_cancel) on files of a mount.
//!
//! A read or write is issued on the RDMA connection by aio_read/aio_write
//! itself, in the caller's thread, and left in flight: one **reaper**
//! thread collects the completions in submission order (the first wait
//! drives the completion queue, which brings in the ones behind it), copies
//! read data out of the staging buffers and marks the control blocks done.
//! So a program keeps as many requests on the wire as it submits, with no
//! thread per request. What cannot be issued that way (a read when no
//! staging buffer is free, a connection lost at issue, aio_fsync) runs on
//! a worker thread of this library instead (up to [`MAX_WORKERS`]), as
//! glibc's own AIO does with its threads. Requests on other files, and
//! ones that ask for a notification thread (SIGEV_THREAD), are the C
//! library's.

use std::collections::{HashMap, VecDeque};
use std::ffi::c_int;
use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use libc::{aiocb, ssize_t};
use lwio_client::{Batch, End, Short};
use lwio_proto::status::STATUS_END_OF_FILE;

use crate::real;
use crate::state::{self, busy, count, lock, set_errno, Open, COUNTERS};

/// Worker threads at most (requests beyond wait in the queue).
pub const MAX_WORKERS: usize = 64;

#[derive(Clone, Copy)]
enum Op {
    Read,
    Write,
    Sync { data_only: bool },
}

struct Job {
    cb: usize,
    fd: c_int,
    op: Op,
    buf: usize,
    len: usize,
    off: i64,
    signal: Option<(c_int, libc::sigval)>,
    o: Arc<Open>,
}

// SAFETY: the raw values in a job (buffer address, sigval) are the
// program's, handed to this library for the request's lifetime, as POSIX
// AIO hands them to the C library's worker threads.
unsafe impl Send for Job {}

#[derive(Clone, Copy)]
enum Req {
    InProgress,
    Done { ret: isize, err: c_int },
}

struct Aio {
    reqs: Mutex<HashMap<usize, Req>>,
    done: Condvar,
    queue: Mutex<(VecDeque<Job>, usize, usize)>, // (jobs, workers, idle)
    work: Condvar,
    /// Requests in flight on a connection, oldest first, and whether the
    /// reaper thread runs.
    flights: Mutex<(VecDeque<Flight>, bool)>,
    landed: Condvar,
}

/// A job issued on a connection, waiting for its completions.
struct Flight {
    job: Job,
    /// Its requests (the parts of its buffer), on its file's connection.
    batch: Batch,
    /// The errno of a part that could not be issued (none after it were).
    issue_error: Option<c_int>,
}

static AIO: AtomicPtr<Aio> = AtomicPtr::new(std::ptr::null_mut());

fn aio() -> &'static Aio {
    state::leaked(&AIO, || Aio {
        reqs: Mutex::new(HashMap::new()),
        done: Condvar::new(),
        queue: Mutex::new((VecDeque::new(), 0, 0)),
        work: Condvar::new(),
        flights: Mutex::new((VecDeque::new(), false)),
        landed: Condvar::new(),
    })
}

/// In a forked child: no worker threads, no requests (POSIX: a child has
/// no outstanding AIO of its parent's).
pub fn reset_after_fork() {
    AIO.store(std::ptr::null_mut(), Ordering::Release);
}

fn run(j: &Job) -> (isize, c_int) {
    let r = match j.op {
        Op::Read => transfer(j, false),
        Op::Write => transfer(j, true),
        Op::Sync { data_only } => {
            count(&COUNTERS.other, 1);
            let r = if data_only {
                j.o.file.sync_data()
            } else {
                j.o.file.sync_all()
            };
            r.map(|_| 0).map_err(|e| lwio_client::errno::client(&e))
        }
    };
    match r {
        Ok(n) => (n, 0),
        Err(e) => (-1, e),
    }
}

/// A read or write of the job's buffer, on the kernel path if the server
/// went away.
fn transfer(j: &Job, write: bool) -> Result<isize, c_int> {
    let off = u64::try_from(j.off).map_err(|_| libc::EINVAL)?;
    let r = if write {
        crate::pwrite_full(&j.o, j.buf as *const u8, j.len, off)
    } else {
        crate::pread_full(&j.o, j.buf as *mut u8, j.len, off)
    };
    match r {
        Ok(n) => Ok(n as isize),
        Err(crate::Fail::Errno(e)) => Err(e),
        Err(crate::Fail::Lost) => {
            state::fall_back(j.fd, &j.o, "the server went away");
            // SAFETY: the program's buffer of `len` bytes, as it submitted.
            let r = unsafe {
                if write {
                    real::pwrite(j.fd, j.buf as *const _, j.len, j.off)
                } else {
                    real::pread(j.fd, j.buf as *mut _, j.len, j.off)
                }
            };
            if r < 0 {
                Err(state::errno())
            } else {
                Ok(r)
            }
        }
    }
}

fn worker(a: &'static Aio) {
    state::busy_forever();
    loop {
        let job = {
            let mut q = lock(&a.queue);
            loop {
                if let Some(j) = q.0.pop_front() {
                    break j;
                }
                q.2 += 1;
                q = a.work.wait(q).unwrap_or_else(|p| p.into_inner());
                q.2 -= 1;
            }
        };
        let (ret, err) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run(&job)))
            .unwrap_or((-1, libc::EIO));
        complete(a, &job, ret, err);
    }
}

/// Mark a job done, wake aio_suspend, send the program's signal.
fn complete(a: &Aio, job: &Job, ret: isize, err: c_int) {
    lock(&a.reqs).insert(job.cb, Req::Done { ret, err });
    a.done.notify_all();
    if let Some((sig, val)) = job.signal {
        // SAFETY: queueing the program's chosen signal to itself.
        unsafe { libc::sigqueue(libc::getpid(), sig, val) };
    }
}

/// Issue a read or write on the connection, left in flight for the reaper;
/// the job back when it must run on a worker thread instead.
fn issue(a: &'static Aio, j: Job) -> Result<(), Job> {
    let write = match j.op {
        Op::Read => false,
        Op::Write => true,
        Op::Sync { .. } => return Err(j),
    };
    let Ok(off) = u64::try_from(j.off) else {
        return Err(j);
    };
    if j.len == 0 || j.buf == 0 || off.checked_add(j.len as u64).is_none() {
        return Err(j); // the worker path gives the exact result or error
    }
    // A short part ends the job (the end of the file, for a read).
    let mut batch = j.o.file.batch(off, Short::Ends);
    let chunk = if write {
        batch.max_write()
    } else {
        batch.max_read()
    };
    let n_parts = j.len.div_ceil(chunk);
    // A read needs a staging buffer per part now; staging buffers come
    // back only as the reaper finishes reads, so never wait for them here.
    if !write && batch.free_stages(chunk.min(j.len)) < n_parts {
        return Err(j);
    }
    let mut issue_error = None;
    while batch.issued() < j.len {
        let at = batch.issued();
        let n = chunk.min(j.len - at);
        let r = if write {
            // SAFETY: the program lent `aio_nbytes` readable bytes at
            // `aio_buf` until aio_return; `Batch::write` only reads them,
            // copying them into a free send slot or, with none free, into
            // its queue of outgoing messages, before it returns.
            let data = unsafe { std::slice::from_raw_parts((j.buf as *const u8).add(at), n) };
            batch.write(data)
        } else {
            batch.read(n, None)
        };
        match r {
            Ok(()) => {}
            // Nothing on the wire yet: the worker path runs it (and goes
            // to the kernel if the connection is lost).
            Err(_) if batch.outstanding() == 0 => return Err(j),
            Err(err) => {
                issue_error = Some(lwio_client::errno::client(&err));
                break;
            }
        }
        if write {
            j.o.dirty.store(true, Ordering::Relaxed);
        }
    }
    // On the wire now: the reaper may be asleep waiting for an earlier one.
    batch.flush();
    let mut f = lock(&a.flights);
    f.0.push_back(Flight {
        job: j,
        batch,
        issue_error,
    });
    if !f.1 {
        let spawned = std::thread::Builder::new()
            .name("lwio-aio-reap".into())
            .spawn(move || reaper(a));
        match spawned {
            Ok(_) => f.1 = true,
            Err(_) => {
                // No reaper: finish this one here (the program's thread
                // waits for it, as a synchronous call would).
                let fl = f.0.pop_back();
                drop(f);
                if let Some(fl) = fl {
                    land(a, fl);
                }
                return Ok(());
            }
        }
    }
    drop(f);
    a.landed.notify_one();
    Ok(())
}

/// The reaper: wait for each flight's completions in turn.
fn reaper(a: &'static Aio) {
    state::busy_forever();
    loop {
        let fl = {
            let mut f = lock(&a.flights);
            loop {
                if let Some(fl) = f.0.pop_front() {
                    break fl;
                }
                f = a.landed.wait(f).unwrap_or_else(|p| p.into_inner());
            }
        };
        land(a, fl);
    }
}

/// Wait for a flight's parts, copy read data to the program, complete it.
fn land(a: &Aio, fl: Flight) {
    let Flight {
        job: j,
        mut batch,
        issue_error,
    } = fl;
    let write = matches!(j.op, Op::Write);
    while let Some(l) = batch.reap() {
        // SAFETY: the program lent `aio_nbytes` writable bytes at
        // `aio_buf` until aio_return; this copy out of the staging buffer
        // is the only write to them.
        unsafe { l.copy_into_raw(j.buf as *mut u8) };
    }
    let (total, end) = batch.finish();
    let err = match end {
        None | Some(End::Short) | Some(End::Status(STATUS_END_OF_FILE)) => None,
        Some(End::Status(st)) => Some(lwio_client::errno::client(&lwio_client::Error::Status {
            what: if write { "WRITE" } else { "READ" }.into(),
            status: st,
        })),
        // A part's completion never came (the connection is gone, or it
        // timed out).
        Some(End::Failed(_)) => {
            // The server went away mid-request: the whole request again on
            // the kernel path (a write of the same bytes to the same place
            // is idempotent), as the synchronous calls do.
            let (ret, e) = match transfer(&j, write) {
                Ok(n) => (n, 0),
                Err(e) => (-1, e),
            };
            complete(a, &j, ret, e);
            return;
        }
    };
    if write {
        count(&COUNTERS.writes, 1);
        count(&COUNTERS.write_bytes, total as u64);
    } else {
        count(&COUNTERS.reads, 1);
        count(&COUNTERS.read_bytes, total as u64);
    }
    let (ret, e) = match (err.or(issue_error), total) {
        (Some(e), 0) => (-1, e),
        _ => (total as isize, 0),
    };
    complete(a, &j, ret, e);
}

/// Queue a request on our file; Err = not ours (the C library's).
fn submit(cb: *mut aiocb, op: Option<Op>) -> Result<c_int, ()> {
    if cb.is_null() {
        return Err(());
    }
    let _b = busy().ok_or(())?;
    // SAFETY: the program's control block, valid until aio_return.
    let c = unsafe { &*cb };
    let o = state::slot(c.aio_fildes).ok_or(())?;
    let signal = match c.aio_sigevent.sigev_notify {
        libc::SIGEV_NONE => None,
        libc::SIGEV_SIGNAL => Some((c.aio_sigevent.sigev_signo, c.aio_sigevent.sigev_value)),
        _ => {
            // A notification thread: the C library's AIO, on a coherent
            // kernel view.
            state::kernel_coherent(c.aio_fildes, &o);
            return Err(());
        }
    };
    let op = match op {
        Some(op) => op,
        None => match c.aio_lio_opcode {
            libc::LIO_READ => Op::Read,
            libc::LIO_WRITE => Op::Write,
            _ => return Err(()),
        },
    };
    let a = aio();
    lock(&a.reqs).insert(cb as usize, Req::InProgress);
    let job = Job {
        cb: cb as usize,
        fd: c.aio_fildes,
        op,
        buf: c.aio_buf as usize,
        len: c.aio_nbytes,
        off: c.aio_offset,
        signal,
        o,
    };
    let Err(job) = issue(a, job) else {
        return Ok(0);
    };
    let mut q = lock(&a.queue);
    q.0.push_back(job);
    if q.2 == 0 && q.1 < MAX_WORKERS {
        let spawned = std::thread::Builder::new()
            .name("lwio-aio".into())
            .spawn(move || worker(a));
        if spawned.is_ok() {
            q.1 += 1;
        }
    }
    drop(q);
    a.work.notify_one();
    Ok(0)
}

fn ours(cb: *const aiocb) -> Option<Req> {
    let p = AIO.load(Ordering::Acquire);
    if p.is_null() || cb.is_null() {
        return None;
    }
    // SAFETY: leaked, never freed.
    let a = unsafe { &*p };
    lock(&a.reqs).get(&(cb as usize)).copied()
}

macro_rules! submit_fn {
    ($name:ident, $real:ident, $op:expr) => {
        #[no_mangle]
        pub unsafe extern "C" fn $name(cb: *mut aiocb) -> c_int {
            if let Ok(r) = submit(cb, Some($op)) {
                return r;
            }
            // SAFETY: the program's call, passed on.
            unsafe { real::$real(cb) }
        }
    };
}
submit_fn!(aio_read, aio_read, Op::Read);
submit_fn!(aio_read64, aio_read64, Op::Read);
submit_fn!(aio_write, aio_write, Op::Write);
submit_fn!(aio_write64, aio_write64, Op::Write);

fn fsync_op(op: c_int) -> Op {
    Op::Sync {
        data_only: op == libc::O_DSYNC,
    }
}

#[no_mangle]
pub unsafe extern "C" fn aio_fsync(op: c_int, cb: *mut aiocb) -> c_int {
    if let Ok(r) = submit(cb, Some(fsync_op(op))) {
        return r;
    }
    // SAFETY: the program's call, passed on.
    unsafe { real::aio_fsync(op, cb) }
}

#[no_mangle]
pub unsafe extern "C" fn aio_fsync64(op: c_int, cb: *mut aiocb) -> c_int {
    if let Ok(r) = submit(cb, Some(fsync_op(op))) {
        return r;
    }
    // SAFETY: the program's call, passed on.
    unsafe { real::aio_fsync64(op, cb) }
}

fn error_of(r: Req) -> c_int {
    match r {
        Req::InProgress => libc::EINPROGRESS,
        Req::Done { err, .. } => err,
    }
}

#[no_mangle]
pub unsafe extern "C" fn aio_error(cb: *const aiocb) -> c_int {
    if let Some(r) = ours(cb) {
        return error_of(r);
    }
    // SAFETY: the program's call, passed on.
    unsafe { real::aio_error(cb) }
}

#[no_mangle]
pub unsafe extern "C" fn aio_error64(cb: *const aiocb) -> c_int {
    if let Some(r) = ours(cb) {
        return error_of(r);
    }
    // SAFETY: the program's call, passed on.
    unsafe { real::aio_error64(cb) }
}

fn take_return(cb: *mut aiocb) -> Option<ssize_t> {
    match ours(cb)? {
        Req::InProgress => {
            set_errno(libc::EINPROGRESS);
            Some(-1)
        }
        Req::Done { ret, err } => {
            lock(&aio().reqs).remove(&(cb as usize));
            if ret < 0 {
                set_errno(err);
            }
            Some(ret)
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn aio_return(cb: *mut aiocb) -> ssize_t {
    if let Some(r) = take_return(cb) {
        return r;
    }
    // SAFETY: the program's call, passed on.
    unsafe { real::aio_return(cb) }
}

#[no_mangle]
pub unsafe extern "C" fn aio_return64(cb: *mut aiocb) -> ssize_t {
    if let Some(r) = take_return(cb) {
        return r;
    }
    // SAFETY: the program's call, passed on.
    unsafe { real::aio_return64(cb) }
}

/// aio_suspend over a list holding some of our requests: Some(result), or
/// None when none is ours (the C library's call).
unsafe fn suspend(
    list: *const *const aiocb,
    n: c_int,
    timeout: *const libc::timespec,
) -> Option<c_int> {
    if list.is_null() || n <= 0 || AIO.load(Ordering::Acquire).is_null() {
        return None;
    }
    // SAFETY: the program's list of `n` entries (null ones are skipped).
    let cbs = unsafe { std::slice::from_raw_parts(list, n as usize) };
    let a = aio();
    let (mine, foreign): (Vec<*const aiocb>, Vec<*const aiocb>) = {
        let reqs = lock(&a.reqs);
        cbs.iter()
            .filter(|c| !c.is_null())
            .partition(|c| reqs.contains_key(&(**c as usize)))
    };
    if mine.is_empty() {
        return None;
    }
    let deadline = if timeout.is_null() {
        None
    } else {
        // SAFETY: the program's timespec.
        let t = unsafe { &*timeout };
        Some(
            Instant::now()
                + Duration::new(
                    t.tv_sec.max(0) as u64,
                    t.tv_nsec.clamp(0, 999_999_999) as u32,
                ),
        )
    };
    let mut reqs = lock(&a.reqs);
    loop {
        if mine
            .iter()
            .any(|c| matches!(reqs.get(&(*c as usize)), Some(Req::Done { .. }) | None))
        {
            return Some(0);
        }
        // SAFETY: the program's control blocks, for the C library.
        if foreign
            .iter()
            .any(|c| unsafe { real::aio_error(*c) } != libc::EINPROGRESS)
        {
            return Some(0);
        }
        let mut wait = Duration::from_secs(3600);
        if let Some(d) = deadline {
            let now = Instant::now();
            if now >= d {
                set_errno(libc::EAGAIN);
                return Some(-1);
            }
            wait = d - now;
        }
        if !foreign.is_empty() {
            // Theirs do not wake us: look again soon.
            wait = wait.min(Duration::from_millis(1));
        }
        reqs = a
            .done
            .wait_timeout(reqs, wait)
            .unwrap_or_else(|p| p.into_inner())
            .0;
    }
}

#[no_mangle]
pub unsafe extern "C" fn aio_suspend(
    list: *const *const aiocb,
    n: c_int,
    timeout: *const libc::timespec,
) -> c_int {
    // SAFETY: the program's arguments.
    if let Some(r) = unsafe { suspend(list, n, timeout) } {
        return r;
    }
    // SAFETY: the program's call, passed on.
    unsafe { real::aio_suspend(list, n, timeout) }
}

#[no_mangle]
pub unsafe extern "C" fn aio_suspend64(
    list: *const *const aiocb,
    n: c_int,
    timeout: *const libc::timespec,
) -> c_int {
    // SAFETY: the program's arguments.
    if let Some(r) = unsafe { suspend(list, n, timeout) } {
        return r;
    }
    // SAFETY: the program's call, passed on.
    unsafe { real::aio_suspend64(list, n, timeout) }
}

/// Our requests cannot be taken back once queued (the RDMA request may be
/// on the wire): AIO_NOTCANCELED while any runs, else AIO_ALLDONE.
fn cancel(fd: c_int, cb: *mut aiocb) -> Option<c_int> {
    if !cb.is_null() {
        return Some(match ours(cb)? {
            Req::InProgress => libc::AIO_NOTCANCELED,
            Req::Done { .. } => libc::AIO_ALLDONE,
        });
    }
    let p = AIO.load(Ordering::Acquire);
    if p.is_null() {
        return None;
    }
    let _b = busy()?;
    state::slot(fd)?;
    // SAFETY: leaked, never freed.
    let a = unsafe { &*p };
    let running = lock(&a.queue).0.iter().any(|j| j.fd == fd)
        || lock(&a.reqs).values().any(|r| matches!(r, Req::InProgress));
    Some(if running {
        libc::AIO_NOTCANCELED
    } else {
        libc::AIO_ALLDONE
    })
}

#[no_mangle]
pub unsafe extern "C" fn aio_cancel(fd: c_int, cb: *mut aiocb) -> c_int {
    if let Some(r) = cancel(fd, cb) {
        return r;
    }
    // SAFETY: the program's call, passed on.
    unsafe { real::aio_cancel(fd, cb) }
}

#[no_mangle]
pub unsafe extern "C" fn aio_cancel64(fd: c_int, cb: *mut aiocb) -> c_int {
    if let Some(r) = cancel(fd, cb) {
        return r;
    }
    // SAFETY: the program's call, passed on.
    unsafe { real::aio_cancel64(fd, cb) }
}
