//! The C library's own functions, found past this library with
//! `dlsym(RTLD_NEXT, …)` and cached.

use std::ffi::{c_char, c_int, c_uint, c_void};
use std::sync::atomic::{AtomicPtr, Ordering};

use libc::{aiocb, iovec, off_t, size_t, ssize_t, FILE};

/// The next definition of `name` (NUL-terminated) after this library.
fn next(name: &'static [u8], slot: &AtomicPtr<c_void>) -> *mut c_void {
    let p = slot.load(Ordering::Relaxed);
    if !p.is_null() {
        return p;
    }
    // SAFETY: `name` is a NUL-terminated literal; RTLD_NEXT is valid from
    // a shared object; dlsym has no other preconditions.
    let p = unsafe { libc::dlsym(libc::RTLD_NEXT, name.as_ptr().cast()) };
    slot.store(p, Ordering::Relaxed);
    p
}

macro_rules! real {
    ($( $name:ident ( $($a:ident : $t:ty),* ) -> $r:ty = $fail:expr; )*) => {
        $(
            /// The C library's function of this name.
            ///
            /// # Safety
            /// As the C function's own contract.
            pub unsafe fn $name($($a: $t),*) -> $r {
                static P: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());
                let p = next(concat!(stringify!($name), "\0").as_bytes(), &P);
                if p.is_null() {
                    // SAFETY: errno is this thread's.
                    unsafe { *libc::__errno_location() = libc::ENOSYS };
                    return $fail;
                }
                // SAFETY: dlsym found the C library's definition of this
                // very name, whose C signature this declaration repeats.
                let f: unsafe extern "C" fn($($t),*) -> $r = unsafe { std::mem::transmute(p) };
                // SAFETY: the caller keeps the function's contract.
                unsafe { f($($a),*) }
            }
        )*
    };
}

real! {
    open(path: *const c_char, flags: c_int, mode: c_uint) -> c_int = -1;
    open64(path: *const c_char, flags: c_int, mode: c_uint) -> c_int = -1;
    openat(dir: c_int, path: *const c_char, flags: c_int, mode: c_uint) -> c_int = -1;
    openat64(dir: c_int, path: *const c_char, flags: c_int, mode: c_uint) -> c_int = -1;
    creat(path: *const c_char, mode: c_uint) -> c_int = -1;
    creat64(path: *const c_char, mode: c_uint) -> c_int = -1;
    close(fd: c_int) -> c_int = -1;
    close_range(first: c_uint, last: c_uint, flags: c_int) -> c_int = -1;
    dup(fd: c_int) -> c_int = -1;
    dup2(fd: c_int, to: c_int) -> c_int = -1;
    dup3(fd: c_int, to: c_int, flags: c_int) -> c_int = -1;
    fcntl(fd: c_int, cmd: c_int, arg: usize) -> c_int = -1;
    fcntl64(fd: c_int, cmd: c_int, arg: usize) -> c_int = -1;
    read(fd: c_int, buf: *mut c_void, n: size_t) -> ssize_t = -1;
    write(fd: c_int, buf: *const c_void, n: size_t) -> ssize_t = -1;
    pread(fd: c_int, buf: *mut c_void, n: size_t, off: off_t) -> ssize_t = -1;
    pread64(fd: c_int, buf: *mut c_void, n: size_t, off: off_t) -> ssize_t = -1;
    pwrite(fd: c_int, buf: *const c_void, n: size_t, off: off_t) -> ssize_t = -1;
    pwrite64(fd: c_int, buf: *const c_void, n: size_t, off: off_t) -> ssize_t = -1;
    readv(fd: c_int, iov: *const iovec, n: c_int) -> ssize_t = -1;
    writev(fd: c_int, iov: *const iovec, n: c_int) -> ssize_t = -1;
    preadv(fd: c_int, iov: *const iovec, n: c_int, off: off_t) -> ssize_t = -1;
    preadv64(fd: c_int, iov: *const iovec, n: c_int, off: off_t) -> ssize_t = -1;
    pwritev(fd: c_int, iov: *const iovec, n: c_int, off: off_t) -> ssize_t = -1;
    pwritev64(fd: c_int, iov: *const iovec, n: c_int, off: off_t) -> ssize_t = -1;
    preadv2(fd: c_int, iov: *const iovec, n: c_int, off: off_t, flags: c_int) -> ssize_t = -1;
    preadv64v2(fd: c_int, iov: *const iovec, n: c_int, off: off_t, flags: c_int) -> ssize_t = -1;
    pwritev2(fd: c_int, iov: *const iovec, n: c_int, off: off_t, flags: c_int) -> ssize_t = -1;
    pwritev64v2(fd: c_int, iov: *const iovec, n: c_int, off: off_t, flags: c_int) -> ssize_t = -1;
    lseek(fd: c_int, off: off_t, whence: c_int) -> off_t = -1;
    lseek64(fd: c_int, off: off_t, whence: c_int) -> off_t = -1;
    fsync(fd: c_int) -> c_int = -1;
    fdatasync(fd: c_int) -> c_int = -1;
    fstat(fd: c_int, st: *mut libc::stat) -> c_int = -1;
    fstat64(fd: c_int, st: *mut libc::stat64) -> c_int = -1;
    fstatat(dir: c_int, path: *const c_char, st: *mut libc::stat, flags: c_int) -> c_int = -1;
    fstatat64(dir: c_int, path: *const c_char, st: *mut libc::stat64, flags: c_int) -> c_int = -1;
    mmap(addr: *mut c_void, len: size_t, prot: c_int, flags: c_int, fd: c_int, off: off_t) -> *mut c_void = libc::MAP_FAILED;
    mmap64(addr: *mut c_void, len: size_t, prot: c_int, flags: c_int, fd: c_int, off: off_t) -> *mut c_void = libc::MAP_FAILED;
    sendfile(out: c_int, inp: c_int, off: *mut off_t, n: size_t) -> ssize_t = -1;
    sendfile64(out: c_int, inp: c_int, off: *mut off_t, n: size_t) -> ssize_t = -1;
    copy_file_range(a: c_int, ao: *mut off_t, b: c_int, bo: *mut off_t, n: size_t, flags: c_uint) -> ssize_t = -1;
    fopen(path: *const c_char, mode: *const c_char) -> *mut FILE = std::ptr::null_mut();
    fopen64(path: *const c_char, mode: *const c_char) -> *mut FILE = std::ptr::null_mut();
    fdopen(fd: c_int, mode: *const c_char) -> *mut FILE = std::ptr::null_mut();
    fclose(f: *mut FILE) -> c_int = -1;
    fileno(f: *mut FILE) -> c_int = -1;
    fileno_unlocked(f: *mut FILE) -> c_int = -1;
    aio_read(cb: *mut aiocb) -> c_int = -1;
    aio_read64(cb: *mut aiocb) -> c_int = -1;
    aio_write(cb: *mut aiocb) -> c_int = -1;
    aio_write64(cb: *mut aiocb) -> c_int = -1;
    aio_fsync(op: c_int, cb: *mut aiocb) -> c_int = -1;
    aio_fsync64(op: c_int, cb: *mut aiocb) -> c_int = -1;
    aio_error(cb: *const aiocb) -> c_int = -1;
    aio_error64(cb: *const aiocb) -> c_int = -1;
    aio_return(cb: *mut aiocb) -> ssize_t = -1;
    aio_return64(cb: *mut aiocb) -> ssize_t = -1;
    aio_suspend(list: *const *const aiocb, n: c_int, timeout: *const libc::timespec) -> c_int = -1;
    aio_suspend64(list: *const *const aiocb, n: c_int, timeout: *const libc::timespec) -> c_int = -1;
    aio_cancel(fd: c_int, cb: *mut aiocb) -> c_int = -1;
    aio_cancel64(fd: c_int, cb: *mut aiocb) -> c_int = -1;
}
