//! liblwio_preload.so: with `LD_PRELOAD`, an unmodified program's reads and
//! writes of files on an `lwio mount` are served in its own process,
//! straight over RDMA, instead of through the kernel and the mount's FUSE
//! threads. Metadata (open, create, rename, stat of paths, locks) still
//! goes through the mount. See docs/preload.md.
//!
//! How a file becomes ours: at its first data call, a descriptor whose
//! file is a regular file of a `fuse.lwio` mount is asked for the mount's
//! handoff (an ioctl the mount answers for its own user only: where the
//! server is, how to log in, the file's path and server inode). This
//! library connects once per server and export, opens the path, checks that
//! it is the same inode, and from then on carries the descriptor's data.
//! The kernel's descriptor keeps the offset (read/write move it with
//! lseek), so dup, fork and exec share it as they always do.
//!
//! Environment:
//! * `LWIO_PRELOAD=0`: intercept nothing in this process (the variable
//!   passes on to children like LD_PRELOAD itself);
//! * `LWIO_PRELOAD_REPORT=1` (stderr) or `=PATH` (appended): at exit, one
//!   line of what was intercepted and what fell back;
//! * `LWIO_PRELOAD_COMPLETION=interrupt`: sleep until the server's
//!   completion arrives (default `poll`: spin on the status block for up
//!   to 200 µs first, then ask for an interrupt).

// Every exported function here is a C library function of the same name,
// and its safety contract is that function's (its man page): the caller
// passes what the C call requires. Repeating that on ~60 functions says
// nothing more.
#![allow(clippy::missing_safety_doc)]

mod aio;
mod real;
mod state;
mod stdio;

use std::ffi::{c_char, c_int, c_uint, c_void};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use libc::{iovec, off_t, size_t, ssize_t};

use state::{busy, count, set_errno, slot, Open, COUNTERS};

// ------------------------------------------------------------ start and exit

#[used]
#[link_section = ".init_array"]
static INIT: extern "C" fn() = init;

extern "C" fn init() {
    if std::env::var("LWIO_PRELOAD").is_ok_and(|v| matches!(v.as_str(), "0" | "off" | "no")) {
        state::DISABLED.store(true, Ordering::Relaxed);
    }
    // The report's own copy of stderr: programs may close theirs in an
    // exit handler that runs before ours (coreutils' close_stdout does).
    // SAFETY: F_DUPFD_CLOEXEC on descriptor 2; failure leaves -1.
    let fd = unsafe { real::fcntl(2, libc::F_DUPFD_CLOEXEC, 3) };
    REPORT_FD.store(fd, Ordering::Relaxed);
    // SAFETY: registering plain extern "C" functions with no arguments.
    unsafe {
        libc::pthread_atfork(None, None, Some(after_fork_child));
        libc::atexit(report);
    }
}

static REPORT_FD: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(-1);

extern "C" fn after_fork_child() {
    // The child reports what it does itself.
    let c = &*COUNTERS;
    for a in [
        &c.reads,
        &c.read_bytes,
        &c.writes,
        &c.write_bytes,
        &c.other,
        &c.files,
        &c.fallback_files,
        &c.fallback_calls,
    ] {
        a.store(0, Ordering::Relaxed);
    }
    state::lock(&c.reasons).clear();
    state::reset_after_fork();
    aio::reset_after_fork();
}

/// `_exit` skips exit handlers; forked workers (fio's jobs) end with it.
#[no_mangle]
pub unsafe extern "C" fn _exit(status: c_int) -> ! {
    report();
    // SAFETY: the program's call.
    unsafe { libc::syscall(libc::SYS_exit_group, status as libc::c_long) };
    unreachable!("exit_group returned")
}

#[no_mangle]
pub unsafe extern "C" fn _Exit(status: c_int) -> ! {
    // SAFETY: the program's call.
    unsafe { _exit(status) }
}

static REPORTED: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

extern "C" fn report() {
    // Once per process (a forked child reports its own).
    // SAFETY: getpid has no preconditions.
    let pid = unsafe { libc::getpid() } as u32;
    if REPORTED.swap(pid, Ordering::Relaxed) == pid {
        return;
    }
    let Ok(to) = std::env::var("LWIO_PRELOAD_REPORT") else {
        return;
    };
    if to.is_empty() || to == "0" {
        return;
    }
    let c = &*COUNTERS;
    let g = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
    let prog = std::env::args().next().unwrap_or_default();
    let reasons = state::lock(&c.reasons).join("; ");
    let line = format!(
        "lwio-preload: pid {} ({prog}): {} files, {} reads ({} bytes), {} writes ({} bytes), {} other calls intercepted; {} files and {} calls fell back to the mount{}{}\n",
        std::process::id(),
        g(&c.files),
        g(&c.reads),
        g(&c.read_bytes),
        g(&c.writes),
        g(&c.write_bytes),
        g(&c.other),
        g(&c.fallback_files),
        g(&c.fallback_calls),
        if reasons.is_empty() { "" } else { ": " },
        reasons,
    );
    let _b = busy();
    if to == "1" || to == "stderr" {
        let fd = REPORT_FD.load(Ordering::Relaxed);
        if fd >= 0 {
            // SAFETY: our own descriptor and a live buffer.
            unsafe { real::write(fd, line.as_ptr().cast(), line.len()) };
        }
    } else {
        use std::io::Write;
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&to)
        {
            let _ = f.write_all(line.as_bytes());
        }
    }
}

// ------------------------------------------------------------ data helpers

/// An error of a call on our file: an errno for the program, or "the
/// server is gone" (the call is made again on the kernel path).
pub(crate) enum Fail {
    Errno(c_int),
    Lost,
}

fn fail_of(e: &lwio_client::Error) -> Fail {
    match e {
        lwio_client::Error::ConnectionLost(_) => Fail::Lost,
        e => Fail::Errno(lwio_client::errno::client(e)),
    }
}

/// Read `n` bytes at `off` (fewer only at the end of the file).
pub(crate) fn pread_full(o: &Open, buf: *mut u8, n: usize, off: u64) -> Result<usize, Fail> {
    if n == 0 {
        return Ok(0);
    }
    if buf.is_null() {
        return Err(Fail::Errno(libc::EFAULT));
    }
    // SAFETY: the program passed `buf` for `n` writable bytes, as read(2)
    // requires, and we rely on it not using them until the call returns (a
    // program that does races with read(2) itself). The peer may write them
    // during `read_at`, through a one-shot window of a per-call
    // registration made from a pointer derived from this slice; `read_at`
    // fences every such window before it returns (see `File::read_impl`).
    let b = unsafe { std::slice::from_raw_parts_mut(buf, n) };
    // All of it, in pipelined requests; short only at the end of the file
    // (so no second call: it would only ask past the end).
    let done = o.file.read_at(b, off).map_err(|e| fail_of(&e))?;
    count(&COUNTERS.reads, 1);
    count(&COUNTERS.read_bytes, done as u64);
    Ok(done)
}

/// Write all `n` bytes at `off`.
pub(crate) fn pwrite_full(o: &Open, buf: *const u8, n: usize, off: u64) -> Result<usize, Fail> {
    if n == 0 {
        return Ok(0);
    }
    if buf.is_null() {
        return Err(Fail::Errno(libc::EFAULT));
    }
    // SAFETY: the program passed `buf` for `n` readable bytes, as write(2)
    // requires, and we rely on it not writing them until the call returns
    // (as for `pread_full`). `write_at` only reads them (copying them into
    // send slots or staging); no peer key ever covers them.
    let b = unsafe { std::slice::from_raw_parts(buf, n) };
    // All of it, in pipelined requests, or an error.
    let done = o.file.write_at(b, off).map_err(|e| fail_of(&e))?;
    o.dirty.store(true, Ordering::Relaxed);
    count(&COUNTERS.writes, 1);
    count(&COUNTERS.write_bytes, done as u64);
    Ok(done)
}

fn iovecs<'a>(iov: *const iovec, n: c_int) -> Result<&'a [iovec], Fail> {
    if !(0..=libc::UIO_MAXIOV).contains(&n) {
        return Err(Fail::Errno(libc::EINVAL));
    }
    if n == 0 {
        return Ok(&[]);
    }
    if iov.is_null() {
        return Err(Fail::Errno(libc::EFAULT));
    }
    // SAFETY: the program passed `n` iovecs, as readv(2) requires.
    Ok(unsafe { std::slice::from_raw_parts(iov, n as usize) })
}

fn preadv_full(o: &Open, iov: &[iovec], off: u64) -> Result<usize, Fail> {
    let mut done = 0usize;
    for v in iov {
        let k = match pread_full(o, v.iov_base.cast(), v.iov_len, off + done as u64) {
            Ok(k) => k,
            Err(e) if done == 0 => return Err(e),
            Err(_) => break,
        };
        done += k;
        if k < v.iov_len {
            break;
        }
    }
    Ok(done)
}

fn pwritev_full(o: &Open, iov: &[iovec], off: u64) -> Result<usize, Fail> {
    let mut done = 0usize;
    for v in iov {
        match pwrite_full(
            o,
            v.iov_base.cast_const().cast(),
            v.iov_len,
            off + done as u64,
        ) {
            Ok(k) => done += k,
            Err(e) if done == 0 => return Err(e),
            Err(_) => break,
        }
    }
    Ok(done)
}

/// lseek(2) on the program's descriptor, through the C library.
fn kernel_seek(fd: c_int, off: off_t, whence: c_int) -> Result<u64, Fail> {
    // SAFETY: lseek on the program's descriptor.
    let p = unsafe { real::lseek(fd, off, whence) };
    if p < 0 {
        return Err(Fail::Errno(state::errno()));
    }
    Ok(p as u64)
}

/// A transfer at `off`; without one, at the descriptor's offset (the
/// kernel's: shared by dup, fork and exec), which it then advances past
/// what moved, as read(2) and write(2) do.
fn at(
    fd: c_int,
    off: Option<u64>,
    f: impl FnOnce(u64) -> Result<usize, Fail>,
) -> Result<isize, Fail> {
    let Some(off) = off else {
        let pos = kernel_seek(fd, 0, libc::SEEK_CUR)?;
        let k = f(pos)?;
        // SAFETY: lseek on the program's descriptor.
        unsafe { real::lseek(fd, (pos + k as u64) as off_t, libc::SEEK_SET) };
        return Ok(k as isize);
    };
    Ok(f(off)? as isize)
}

/// Run `f` on our file of `fd`, if it is one: Some(result) when served
/// here; None when the kernel path must serve the call (not our file, or
/// the server went away: then the file falls back for good).
fn serve(fd: c_int, f: impl FnOnce(&Arc<Open>) -> Result<isize, Fail>) -> Option<isize> {
    let _b = busy()?;
    let o = slot(fd)?;
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(&o)));
    match r {
        Ok(Ok(v)) => Some(v),
        Ok(Err(Fail::Errno(e))) => {
            set_errno(e);
            Some(-1)
        }
        Ok(Err(Fail::Lost)) => {
            state::warn_once("the server went away: files go through the mount".into());
            state::fall_back(fd, &o, "the server went away");
            None
        }
        Err(_) => {
            set_errno(libc::EIO);
            Some(-1)
        }
    }
}

// ------------------------------------------------------------ read and write

#[no_mangle]
pub unsafe extern "C" fn read(fd: c_int, buf: *mut c_void, n: size_t) -> ssize_t {
    if let Some(r) = serve(fd, |o| at(fd, None, |p| pread_full(o, buf.cast(), n, p))) {
        return r;
    }
    // SAFETY: the program's call, passed on.
    unsafe { real::read(fd, buf, n) }
}

#[no_mangle]
pub unsafe extern "C" fn write(fd: c_int, buf: *const c_void, n: size_t) -> ssize_t {
    if let Some(r) = serve(fd, |o| at(fd, None, |p| pwrite_full(o, buf.cast(), n, p))) {
        return r;
    }
    // SAFETY: the program's call, passed on.
    unsafe { real::write(fd, buf, n) }
}

fn offset(off: off_t) -> Result<u64, Fail> {
    u64::try_from(off).map_err(|_| Fail::Errno(libc::EINVAL))
}

macro_rules! positional {
    ($name:ident, $buf:ty, $f:ident) => {
        #[no_mangle]
        pub unsafe extern "C" fn $name(fd: c_int, buf: $buf, n: size_t, off: off_t) -> ssize_t {
            if let Some(r) = serve(fd, |o| Ok($f(o, buf.cast(), n, offset(off)?)? as isize)) {
                return r;
            }
            // SAFETY: the program's call, passed on.
            unsafe { real::$name(fd, buf, n, off) }
        }
    };
}
positional!(pread, *mut c_void, pread_full);
positional!(pread64, *mut c_void, pread_full);
positional!(pwrite, *const c_void, pwrite_full);
positional!(pwrite64, *const c_void, pwrite_full);

fn readv_at(
    fd: c_int,
    o: &Open,
    iov: *const iovec,
    n: c_int,
    off: Option<u64>,
) -> Result<isize, Fail> {
    let iov = iovecs(iov, n)?;
    at(fd, off, |p| preadv_full(o, iov, p))
}

fn writev_at(
    fd: c_int,
    o: &Open,
    iov: *const iovec,
    n: c_int,
    off: Option<u64>,
) -> Result<isize, Fail> {
    let iov = iovecs(iov, n)?;
    at(fd, off, |p| pwritev_full(o, iov, p))
}

#[no_mangle]
pub unsafe extern "C" fn readv(fd: c_int, iov: *const iovec, n: c_int) -> ssize_t {
    if let Some(r) = serve(fd, |o| readv_at(fd, o, iov, n, None)) {
        return r;
    }
    // SAFETY: the program's call, passed on.
    unsafe { real::readv(fd, iov, n) }
}

#[no_mangle]
pub unsafe extern "C" fn writev(fd: c_int, iov: *const iovec, n: c_int) -> ssize_t {
    if let Some(r) = serve(fd, |o| writev_at(fd, o, iov, n, None)) {
        return r;
    }
    // SAFETY: the program's call, passed on.
    unsafe { real::writev(fd, iov, n) }
}

macro_rules! positional_v {
    ($name:ident, $real:ident, $f:ident) => {
        #[no_mangle]
        pub unsafe extern "C" fn $name(
            fd: c_int,
            iov: *const iovec,
            n: c_int,
            off: off_t,
        ) -> ssize_t {
            if let Some(r) = serve(fd, |o| $f(fd, o, iov, n, Some(offset(off)?))) {
                return r;
            }
            // SAFETY: the program's call, passed on.
            unsafe { real::$real(fd, iov, n, off) }
        }
    };
}
positional_v!(preadv, preadv, readv_at);
positional_v!(preadv64, preadv64, readv_at);
positional_v!(pwritev, pwritev, writev_at);
positional_v!(pwritev64, pwritev64, writev_at);

/// preadv2/pwritev2 flags this library honours (RWF_HIPRI and RWF_NOWAIT
/// are hints it may ignore: the call is served, blocking).
fn v2_read(
    fd: c_int,
    o: &Open,
    iov: *const iovec,
    n: c_int,
    off: off_t,
    _flags: c_int,
) -> Result<isize, Fail> {
    readv_at(
        fd,
        o,
        iov,
        n,
        if off == -1 { None } else { Some(offset(off)?) },
    )
}

fn v2_write(
    fd: c_int,
    o: &Open,
    iov: *const iovec,
    n: c_int,
    off: off_t,
    flags: c_int,
) -> Result<isize, Fail> {
    let at = if flags & libc::RWF_APPEND != 0 {
        Some(o.file.len().map_err(|e| fail_of(&e))?)
    } else if off == -1 {
        None
    } else {
        Some(offset(off)?)
    };
    let k = writev_at(fd, o, iov, n, at)?;
    if flags & libc::RWF_SYNC != 0 {
        o.file.sync_all().map_err(|e| fail_of(&e))?;
    } else if flags & libc::RWF_DSYNC != 0 {
        o.file.sync_data().map_err(|e| fail_of(&e))?;
    }
    Ok(k)
}

macro_rules! v2 {
    ($name:ident, $real:ident, $f:ident) => {
        #[no_mangle]
        pub unsafe extern "C" fn $name(
            fd: c_int,
            iov: *const iovec,
            n: c_int,
            off: off_t,
            flags: c_int,
        ) -> ssize_t {
            if let Some(r) = serve(fd, |o| $f(fd, o, iov, n, off, flags)) {
                return r;
            }
            // SAFETY: the program's call, passed on.
            unsafe { real::$real(fd, iov, n, off, flags) }
        }
    };
}
v2!(preadv2, preadv2, v2_read);
v2!(preadv64v2, preadv64v2, v2_read);
v2!(pwritev2, pwritev2, v2_write);
v2!(pwritev64v2, pwritev64v2, v2_write);

// ------------------------------------------------------------ seek, sync, stat

fn seek(fd: c_int, o: &Open, off: off_t, whence: c_int) -> Result<isize, Fail> {
    // Only the end is the server's to say; the rest is the kernel's
    // offset arithmetic (SEEK_DATA and SEEK_HOLE ask the mount).
    if whence != libc::SEEK_END {
        return Ok(kernel_seek(fd, off, whence)? as isize);
    }
    count(&COUNTERS.other, 1);
    let end = o.file.len().map_err(|e| fail_of(&e))? as i64;
    let to = end
        .checked_add(off)
        .filter(|t| *t >= 0)
        .ok_or(Fail::Errno(libc::EINVAL))?;
    Ok(kernel_seek(fd, to, libc::SEEK_SET)? as isize)
}

#[no_mangle]
pub unsafe extern "C" fn lseek(fd: c_int, off: off_t, whence: c_int) -> off_t {
    if let Some(r) = serve(fd, |o| seek(fd, o, off, whence)) {
        return r as off_t;
    }
    // SAFETY: the program's call, passed on.
    unsafe { real::lseek(fd, off, whence) }
}

#[no_mangle]
pub unsafe extern "C" fn lseek64(fd: c_int, off: off_t, whence: c_int) -> off_t {
    if let Some(r) = serve(fd, |o| seek(fd, o, off, whence)) {
        return r as off_t;
    }
    // SAFETY: the program's call, passed on.
    unsafe { real::lseek64(fd, off, whence) }
}

#[no_mangle]
pub unsafe extern "C" fn fsync(fd: c_int) -> c_int {
    if let Some(r) = serve(fd, |o| {
        count(&COUNTERS.other, 1);
        o.file.sync_all().map_err(|e| fail_of(&e))?;
        Ok(0)
    }) {
        return r as c_int;
    }
    // SAFETY: the program's call, passed on.
    unsafe { real::fsync(fd) }
}

#[no_mangle]
pub unsafe extern "C" fn fdatasync(fd: c_int) -> c_int {
    if let Some(r) = serve(fd, |o| {
        count(&COUNTERS.other, 1);
        o.file.sync_data().map_err(|e| fail_of(&e))?;
        Ok(0)
    }) {
        return r as c_int;
    }
    // SAFETY: the program's call, passed on.
    unsafe { real::fdatasync(fd) }
}

/// Our file's attributes as the server has them now: the kernel asks the
/// mount afresh (our writes changed the size behind its back), then the
/// kernel's stat answers.
fn fresh_attrs(fd: c_int) -> Result<isize, Fail> {
    count(&COUNTERS.other, 1);
    state::refresh_attrs(fd);
    Ok(0)
}

#[no_mangle]
pub unsafe extern "C" fn fstat(fd: c_int, st: *mut libc::stat) -> c_int {
    let _ = serve(fd, |_| fresh_attrs(fd));
    // SAFETY: the program's call, passed on.
    unsafe { real::fstat(fd, st) }
}

#[no_mangle]
pub unsafe extern "C" fn fstat64(fd: c_int, st: *mut libc::stat64) -> c_int {
    let _ = serve(fd, |_| fresh_attrs(fd));
    // SAFETY: the program's call, passed on.
    unsafe { real::fstat64(fd, st) }
}

/// fstatat(fd, "", …, AT_EMPTY_PATH) is fstat(fd).
unsafe fn empty_path(path: *const c_char, flags: c_int) -> bool {
    // SAFETY: a non-null path is the program's C string.
    flags & libc::AT_EMPTY_PATH != 0 && (path.is_null() || unsafe { *path } == 0)
}

#[no_mangle]
pub unsafe extern "C" fn fstatat(
    dir: c_int,
    path: *const c_char,
    st: *mut libc::stat,
    flags: c_int,
) -> c_int {
    // SAFETY: the program's arguments.
    if unsafe { empty_path(path, flags) } {
        let _ = serve(dir, |_| fresh_attrs(dir));
    }
    // SAFETY: the program's call, passed on.
    unsafe { real::fstatat(dir, path, st, flags) }
}

#[no_mangle]
pub unsafe extern "C" fn fstatat64(
    dir: c_int,
    path: *const c_char,
    st: *mut libc::stat64,
    flags: c_int,
) -> c_int {
    // SAFETY: the program's arguments.
    if unsafe { empty_path(path, flags) } {
        let _ = serve(dir, |_| fresh_attrs(dir));
    }
    // SAFETY: the program's call, passed on.
    unsafe { real::fstatat64(dir, path, st, flags) }
}

// ------------------------------------------------------------ descriptors

/// A descriptor number the C library just handed out: whatever this
/// library knew about an earlier descriptor of that number is stale.
fn fresh_fd(fd: c_int) -> c_int {
    if fd >= 0 {
        state::forget(fd);
    }
    fd
}

#[no_mangle]
pub unsafe extern "C" fn open(path: *const c_char, flags: c_int, mode: c_uint) -> c_int {
    // The mode argument is variadic in C; on the System V ABIs it arrives
    // in the register of a third argument, read only with O_CREAT or
    // O_TMPFILE, as the C library does.
    // SAFETY: the program's call, passed on.
    fresh_fd(unsafe { real::open(path, flags, mode) })
}

#[no_mangle]
pub unsafe extern "C" fn open64(path: *const c_char, flags: c_int, mode: c_uint) -> c_int {
    // SAFETY: the program's call, passed on (mode: see `open`).
    fresh_fd(unsafe { real::open64(path, flags, mode) })
}

#[no_mangle]
pub unsafe extern "C" fn openat(
    dir: c_int,
    path: *const c_char,
    flags: c_int,
    mode: c_uint,
) -> c_int {
    // SAFETY: the program's call, passed on (mode: see `open`).
    fresh_fd(unsafe { real::openat(dir, path, flags, mode) })
}

#[no_mangle]
pub unsafe extern "C" fn openat64(
    dir: c_int,
    path: *const c_char,
    flags: c_int,
    mode: c_uint,
) -> c_int {
    // SAFETY: the program's call, passed on (mode: see `open`).
    fresh_fd(unsafe { real::openat64(dir, path, flags, mode) })
}

#[no_mangle]
pub unsafe extern "C" fn creat(path: *const c_char, mode: c_uint) -> c_int {
    // SAFETY: the program's call, passed on.
    fresh_fd(unsafe { real::creat(path, mode) })
}

#[no_mangle]
pub unsafe extern "C" fn creat64(path: *const c_char, mode: c_uint) -> c_int {
    // SAFETY: the program's call, passed on.
    fresh_fd(unsafe { real::creat64(path, mode) })
}

/// Let go of our side of `fd` before the kernel closes it: our file's
/// handle on the server (its last descriptor), then the kernel's
/// attributes made fresh for whoever looks next.
pub(crate) fn release(fd: c_int) {
    let Some(state::Slot::Lwio(o)) = state::forget(fd) else {
        return;
    };
    let dirty = o.dirty.load(Ordering::Relaxed);
    let _b = busy();
    drop(o);
    if dirty {
        state::refresh_attrs(fd);
    }
}

#[no_mangle]
pub unsafe extern "C" fn close(fd: c_int) -> c_int {
    release(fd);
    // SAFETY: the program's call, passed on.
    unsafe { real::close(fd) }
}

#[no_mangle]
pub unsafe extern "C" fn close_range(first: c_uint, last: c_uint, flags: c_int) -> c_int {
    if flags & libc::CLOSE_RANGE_CLOEXEC as c_int == 0 {
        let ours: Vec<c_int> = state::state()
            .fds
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .keys()
            .copied()
            .filter(|&fd| fd as c_uint >= first && fd as c_uint <= last)
            .collect();
        for fd in ours {
            release(fd);
        }
    }
    // SAFETY: the program's call, passed on.
    unsafe { real::close_range(first, last, flags) }
}

#[no_mangle]
pub unsafe extern "C" fn dup(fd: c_int) -> c_int {
    // SAFETY: the program's call, passed on.
    let to = unsafe { real::dup(fd) };
    if to >= 0 {
        state::duplicate(fd, to);
    }
    to
}

#[no_mangle]
pub unsafe extern "C" fn dup2(fd: c_int, to: c_int) -> c_int {
    if fd != to {
        release(to);
    }
    // SAFETY: the program's call, passed on.
    let r = unsafe { real::dup2(fd, to) };
    if r >= 0 && fd != to {
        state::duplicate(fd, r);
    }
    r
}

#[no_mangle]
pub unsafe extern "C" fn dup3(fd: c_int, to: c_int, flags: c_int) -> c_int {
    if fd != to {
        release(to);
    }
    // SAFETY: the program's call, passed on.
    let r = unsafe { real::dup3(fd, to, flags) };
    if r >= 0 {
        state::duplicate(fd, r);
    }
    r
}

fn fcntl_common(fd: c_int, cmd: c_int, arg: usize, r: c_int) {
    match cmd {
        libc::F_DUPFD | libc::F_DUPFD_CLOEXEC if r >= 0 => state::duplicate(fd, r),
        libc::F_SETFL if r >= 0 && arg as c_int & libc::O_APPEND != 0 => {
            if let Some(_b) = busy() {
                if let Some(o) = slot(fd) {
                    state::fall_back(fd, &o, "O_APPEND (appends go through the mount)");
                }
            }
        }
        _ => {}
    }
}

#[no_mangle]
pub unsafe extern "C" fn fcntl(fd: c_int, cmd: c_int, arg: usize) -> c_int {
    // The third argument is variadic in C (an int or a pointer); on the
    // System V ABIs it arrives in the register of a third argument and is
    // passed on as it came.
    // SAFETY: the program's call, passed on.
    let r = unsafe { real::fcntl(fd, cmd, arg) };
    fcntl_common(fd, cmd, arg, r);
    r
}

#[no_mangle]
pub unsafe extern "C" fn fcntl64(fd: c_int, cmd: c_int, arg: usize) -> c_int {
    // SAFETY: the program's call, passed on (see `fcntl`).
    let r = unsafe { real::fcntl64(fd, cmd, arg) };
    fcntl_common(fd, cmd, arg, r);
    r
}

// ------------------------------------------------------------ the kernel path

/// A mapping sees the kernel's pages: the file goes to the kernel path.
fn before_map(fd: c_int, flags: c_int) {
    if fd >= 0 && flags & libc::MAP_ANONYMOUS == 0 {
        if let Some(_b) = busy() {
            state::mapping(fd);
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn mmap(
    addr: *mut c_void,
    len: size_t,
    prot: c_int,
    flags: c_int,
    fd: c_int,
    off: off_t,
) -> *mut c_void {
    before_map(fd, flags);
    // SAFETY: the program's call, passed on.
    unsafe { real::mmap(addr, len, prot, flags, fd, off) }
}

#[no_mangle]
pub unsafe extern "C" fn mmap64(
    addr: *mut c_void,
    len: size_t,
    prot: c_int,
    flags: c_int,
    fd: c_int,
    off: off_t,
) -> *mut c_void {
    before_map(fd, flags);
    // SAFETY: the program's call, passed on.
    unsafe { real::mmap64(addr, len, prot, flags, fd, off) }
}

/// The kernel is about to move data of `fd` itself (sendfile,
/// copy_file_range): make its view right first.
fn kernel_moves(fd: c_int) {
    if let Some(_b) = busy() {
        if let Some(o) = slot(fd) {
            state::kernel_coherent(fd, &o);
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn sendfile(out: c_int, inp: c_int, off: *mut off_t, n: size_t) -> ssize_t {
    kernel_moves(inp);
    kernel_moves(out);
    // SAFETY: the program's call, passed on.
    unsafe { real::sendfile(out, inp, off, n) }
}

#[no_mangle]
pub unsafe extern "C" fn sendfile64(out: c_int, inp: c_int, off: *mut off_t, n: size_t) -> ssize_t {
    kernel_moves(inp);
    kernel_moves(out);
    // SAFETY: the program's call, passed on.
    unsafe { real::sendfile64(out, inp, off, n) }
}

#[no_mangle]
pub unsafe extern "C" fn copy_file_range(
    a: c_int,
    ao: *mut off_t,
    b: c_int,
    bo: *mut off_t,
    n: size_t,
    flags: c_uint,
) -> ssize_t {
    kernel_moves(a);
    kernel_moves(b);
    // SAFETY: the program's call, passed on.
    let r = unsafe { real::copy_file_range(a, ao, b, bo, n, flags) };
    if r > 0 {
        // The kernel (through the mount) changed `b` on the server.
        if let Some(_g) = busy() {
            if let Some(o) = slot(b) {
                o.dirty.store(true, Ordering::Relaxed);
            }
        }
    }
    r
}
