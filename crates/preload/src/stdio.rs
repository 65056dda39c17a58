//! Streams (`fopen`, `fread`, `fwrite`): the C library's stdio reads and
//! writes through internal calls no preload can see, so a file of a mount
//! opened with `fopen` becomes a cookie stream (fopencookie(3)) whose
//! reads, writes and seeks are this library's calls on the stream's real
//! descriptor. `fileno` answers that descriptor, so programs that mix the
//! stream with its descriptor (fstat, posix_fadvise) keep working.

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::Mutex;

use libc::{off_t, size_t, ssize_t, FILE};

use crate::real;
use crate::state::{self, busy, lock};

#[repr(C)]
struct CookieIo {
    read: Option<unsafe extern "C" fn(*mut c_void, *mut c_char, size_t) -> ssize_t>,
    write: Option<unsafe extern "C" fn(*mut c_void, *const c_char, size_t) -> ssize_t>,
    seek: Option<unsafe extern "C" fn(*mut c_void, *mut i64, c_int) -> c_int>,
    close: Option<unsafe extern "C" fn(*mut c_void) -> c_int>,
}

extern "C" {
    fn fopencookie(cookie: *mut c_void, mode: *const c_char, io: CookieIo) -> *mut FILE;
}

/// Cookie streams and their descriptors.
static STREAMS: Mutex<Option<HashMap<usize, c_int>>> = Mutex::new(None);

// The cookie is the descriptor itself (as a pointer-sized integer).
fn fd_of(cookie: *mut c_void) -> c_int {
    cookie as usize as c_int
}

unsafe extern "C" fn c_read(cookie: *mut c_void, buf: *mut c_char, n: size_t) -> ssize_t {
    // SAFETY: stdio's buffer of `n` bytes.
    unsafe { crate::read(fd_of(cookie), buf.cast(), n) }
}

unsafe extern "C" fn c_write(cookie: *mut c_void, buf: *const c_char, n: size_t) -> ssize_t {
    // SAFETY: stdio's buffer of `n` bytes.
    let r = unsafe { crate::write(fd_of(cookie), buf.cast(), n) };
    // A cookie write returns 0 on error (fopencookie(3)).
    r.max(0)
}

unsafe extern "C" fn c_seek(cookie: *mut c_void, off: *mut i64, whence: c_int) -> c_int {
    // SAFETY: stdio passes a valid offset to read and update.
    unsafe {
        let r = crate::lseek(fd_of(cookie), *off as off_t, whence);
        if r < 0 {
            return -1;
        }
        *off = r as i64;
    }
    0
}

unsafe extern "C" fn c_close(cookie: *mut c_void) -> c_int {
    // SAFETY: the stream's own descriptor, closed once (by fclose).
    unsafe { crate::close(fd_of(cookie)) }
}

/// open(2) flags of an fopen mode, or None for a mode this library leaves
/// to the C library.
fn flags_of(mode: &[u8]) -> Option<c_int> {
    let (first, rest) = mode.split_first()?;
    let plus = rest.contains(&b'+');
    let mut f = match (first, plus) {
        (b'r', false) => libc::O_RDONLY,
        (b'r', true) => libc::O_RDWR,
        (b'w', false) => libc::O_WRONLY | libc::O_CREAT | libc::O_TRUNC,
        (b'w', true) => libc::O_RDWR | libc::O_CREAT | libc::O_TRUNC,
        // Appending streams stay the C library's (appends go through the
        // mount).
        _ => return None,
    };
    for c in rest {
        match c {
            b'x' => f |= libc::O_EXCL,
            b'e' => f |= libc::O_CLOEXEC,
            b'+' | b'b' | b'm' | b't' => {}
            // ",ccs=" and anything else: the C library's.
            _ => return None,
        }
    }
    Some(f)
}

unsafe fn open_stream(path: *const c_char, mode: *const c_char, large: bool) -> Option<*mut FILE> {
    if path.is_null() || mode.is_null() {
        return None;
    }
    let _b = busy()?;
    // SAFETY: the program's C string.
    let flags = flags_of(unsafe { CStr::from_ptr(mode) }.to_bytes())?;
    // SAFETY: the program's path; 0666 as fopen(3) creates.
    let fd = unsafe {
        if large {
            real::open64(path, flags, 0o666)
        } else {
            real::open(path, flags, 0o666)
        }
    };
    if fd < 0 {
        // The C library's fopen will fail the same way and set errno.
        return None;
    }
    state::forget(fd);
    if state::slot(fd).is_none() {
        // Not ours: an ordinary stream on the descriptor.
        // SAFETY: our fresh descriptor and the program's mode.
        let f = unsafe { real::fdopen(fd, mode) };
        if f.is_null() {
            // SAFETY: our descriptor, closed once.
            unsafe { real::close(fd) };
            return None;
        }
        return Some(f);
    }
    let io = CookieIo {
        read: Some(c_read),
        write: Some(c_write),
        seek: Some(c_seek),
        close: Some(c_close),
    };
    // SAFETY: the cookie is a descriptor number, never dereferenced.
    let f = unsafe { fopencookie(fd as usize as *mut c_void, mode, io) };
    if f.is_null() {
        crate::release(fd);
        // SAFETY: our descriptor, closed once.
        unsafe { real::close(fd) };
        return None;
    }
    lock(&STREAMS)
        .get_or_insert_with(HashMap::new)
        .insert(f as usize, fd);
    Some(f)
}

#[no_mangle]
pub unsafe extern "C" fn fopen(path: *const c_char, mode: *const c_char) -> *mut FILE {
    // SAFETY: the program's arguments.
    if let Some(f) = unsafe { open_stream(path, mode, false) } {
        return f;
    }
    // SAFETY: the program's call, passed on.
    unsafe { real::fopen(path, mode) }
}

#[no_mangle]
pub unsafe extern "C" fn fopen64(path: *const c_char, mode: *const c_char) -> *mut FILE {
    // SAFETY: the program's arguments.
    if let Some(f) = unsafe { open_stream(path, mode, true) } {
        return f;
    }
    // SAFETY: the program's call, passed on.
    unsafe { real::fopen64(path, mode) }
}

fn stream_fd(f: *mut FILE) -> Option<c_int> {
    lock(&STREAMS).as_ref()?.get(&(f as usize)).copied()
}

#[no_mangle]
pub unsafe extern "C" fn fileno(f: *mut FILE) -> c_int {
    if let Some(fd) = stream_fd(f) {
        return fd;
    }
    // SAFETY: the program's call, passed on.
    unsafe { real::fileno(f) }
}

#[no_mangle]
pub unsafe extern "C" fn fileno_unlocked(f: *mut FILE) -> c_int {
    if let Some(fd) = stream_fd(f) {
        return fd;
    }
    // SAFETY: the program's call, passed on.
    unsafe { real::fileno_unlocked(f) }
}

#[no_mangle]
pub unsafe extern "C" fn fclose(f: *mut FILE) -> c_int {
    let ours = lock(&STREAMS)
        .as_mut()
        .and_then(|m| m.remove(&(f as usize)));
    if ours.is_none() && !f.is_null() {
        // The C library closes the descriptor inside, where this library
        // cannot see it: forget it first.
        // SAFETY: the program's stream.
        let fd = unsafe { real::fileno(f) };
        if fd >= 0 {
            crate::release(fd);
        }
    }
    // SAFETY: the program's call, passed on (a cookie stream's close
    // callback closes its descriptor through this library).
    unsafe { real::fclose(f) }
}
