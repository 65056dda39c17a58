//! Thin wrappers over the few system calls the soft provider uses.

use std::io;
use std::os::fd::{OwnedFd, RawFd};

use super::cq::owned;

fn cvt(r: libc::c_int) -> io::Result<libc::c_int> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

pub fn eventfd() -> io::Result<OwnedFd> {
    // SAFETY: plain system call without pointers.
    let fd = cvt(unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) })?;
    Ok(owned(fd))
}

pub fn eventfd_write(fd: RawFd) {
    let one: u64 = 1;
    // SAFETY: writes 8 bytes from a live local; the fd is an eventfd we own.
    // A full counter (EAGAIN) already means "readable", so errors are ignored.
    unsafe { libc::write(fd, (&one as *const u64).cast(), 8) };
}

/// Drain an eventfd; true if it was signalled.
pub fn eventfd_read(fd: RawFd) -> bool {
    let mut v: u64 = 0;
    // SAFETY: reads 8 bytes into a live local.
    let r = unsafe { libc::read(fd, (&mut v as *mut u64).cast(), 8) };
    r == 8 && v > 0
}

pub fn epoll_create() -> io::Result<OwnedFd> {
    // SAFETY: plain system call.
    let fd = cvt(unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) })?;
    Ok(owned(fd))
}

pub fn epoll_add(ep: RawFd, fd: RawFd, events: u32, token: u64) -> io::Result<()> {
    let mut ev = libc::epoll_event { events, u64: token };
    // SAFETY: `ev` is a live local read by the kernel during the call.
    cvt(unsafe { libc::epoll_ctl(ep, libc::EPOLL_CTL_ADD, fd, &mut ev) })?;
    Ok(())
}

pub fn epoll_del(ep: RawFd, fd: RawFd) {
    let mut ev = libc::epoll_event { events: 0, u64: 0 };
    // SAFETY: as in `epoll_add`.
    unsafe { libc::epoll_ctl(ep, libc::EPOLL_CTL_DEL, fd, &mut ev) };
}

/// Wait for events; returns the tokens (and flags) in `out`.
pub fn epoll_wait(ep: RawFd, out: &mut [libc::epoll_event], ms: i32) -> io::Result<usize> {
    // SAFETY: the kernel writes at most `out.len()` events into `out`.
    let r = unsafe { libc::epoll_wait(ep, out.as_mut_ptr(), out.len() as i32, ms) };
    if r < 0 {
        let e = io::Error::last_os_error();
        if e.kind() == io::ErrorKind::Interrupted {
            return Ok(0);
        }
        return Err(e);
    }
    Ok(r as usize)
}

/// poll(2) one fd for input; true if readable.
pub fn poll_in(fd: RawFd, ms: i32) -> io::Result<bool> {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one live pollfd.
    let r = unsafe { libc::poll(&mut p, 1, ms) };
    if r < 0 {
        let e = io::Error::last_os_error();
        if e.kind() == io::ErrorKind::Interrupted {
            return Ok(false);
        }
        return Err(e);
    }
    Ok(r > 0)
}

/// read(2) into raw memory.
///
/// # Safety
/// `dst..dst+len` must be valid for writes for the duration of the call and
/// no Rust reference may cover it.
pub unsafe fn read_raw(fd: RawFd, dst: *mut u8, len: usize) -> io::Result<usize> {
    let r = libc::read(fd, dst.cast(), len);
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r as usize)
    }
}

/// writev(2) (MSG_NOSIGNAL semantics via sendmsg).
///
/// # Safety
/// Every iovec must describe memory valid for reads for the duration of the call.
pub unsafe fn writev_raw(fd: RawFd, iov: &[libc::iovec]) -> io::Result<usize> {
    let mut msg: libc::msghdr = std::mem::zeroed();
    msg.msg_iov = iov.as_ptr() as *mut libc::iovec;
    msg.msg_iovlen = iov.len() as _;
    let r = libc::sendmsg(fd, &msg, libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT);
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r as usize)
    }
}

pub fn shutdown(fd: RawFd, how: libc::c_int) {
    // SAFETY: plain system call.
    unsafe { libc::shutdown(fd, how) };
}

/// TCP_MAXSEG of a connected socket.
pub fn mss(fd: RawFd) -> Option<usize> {
    let mut v: libc::c_int = 0;
    let mut l = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: the kernel writes an int into the live local `v`.
    let r = unsafe {
        libc::getsockopt(
            fd,
            libc::IPPROTO_TCP,
            libc::TCP_MAXSEG,
            (&mut v as *mut libc::c_int).cast(),
            &mut l,
        )
    };
    (r == 0 && v > 0).then_some(v as usize)
}
