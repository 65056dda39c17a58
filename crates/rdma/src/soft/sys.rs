//! Thin wrappers over the few system calls the soft provider uses.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};

use rustix::event::epoll::{self, Event, EventData, EventFlags};
use rustix::event::{EventfdFlags, PollFd, PollFlags, Timespec};

// eventfd, epoll and poll go through rustix, whose wrappers are safe: they
// take borrowed descriptors and Rust buffers. Raw libc calls remain below
// only where a call must read or write registered memory that no Rust slice
// may cover (`read_raw`, `writev_raw`), or has no rustix form here.

pub fn eventfd() -> io::Result<OwnedFd> {
    Ok(rustix::event::eventfd(
        0,
        EventfdFlags::NONBLOCK | EventfdFlags::CLOEXEC,
    )?)
}

pub fn eventfd_write(fd: impl AsFd) {
    // A full counter (EAGAIN) already means "readable", so errors are ignored.
    let _ = rustix::io::write(fd, &1u64.to_ne_bytes());
}

/// Drain an eventfd; true if it was signalled.
pub fn eventfd_read(fd: impl AsFd) -> bool {
    let mut v = [0u8; 8];
    matches!(rustix::io::read(fd, &mut v), Ok(8)) && u64::from_ne_bytes(v) > 0
}

pub fn epoll_create() -> io::Result<OwnedFd> {
    Ok(epoll::create(epoll::CreateFlags::CLOEXEC)?)
}

pub fn epoll_add(ep: impl AsFd, fd: impl AsFd, events: EventFlags, token: u64) -> io::Result<()> {
    Ok(epoll::add(ep, fd, EventData::new_u64(token), events)?)
}

pub fn epoll_del(ep: impl AsFd, fd: impl AsFd) {
    let _ = epoll::delete(ep, fd);
}

/// An empty event slot for `epoll_wait`'s output.
pub const NO_EVENT: Event = Event {
    flags: EventFlags::empty(),
    data: EventData::new_u64(0),
};

/// A poll(2)/epoll_wait(2) timeout in milliseconds (negative: none).
fn timeout(ms: i32) -> Option<Timespec> {
    (ms >= 0).then(|| Timespec {
        tv_sec: (ms / 1000).into(),
        tv_nsec: ((ms % 1000) * 1_000_000).into(),
    })
}

/// Wait for events; returns the tokens (and flags) in `out`.
pub fn epoll_wait(ep: impl AsFd, out: &mut [Event], ms: i32) -> io::Result<usize> {
    match epoll::wait(ep, out, timeout(ms).as_ref()) {
        Ok(n) => Ok(n),
        Err(rustix::io::Errno::INTR) => Ok(0),
        Err(e) => Err(e.into()),
    }
}

/// poll(2) one fd for input; true if readable.
pub fn poll_in(fd: impl AsFd, ms: i32) -> io::Result<bool> {
    let mut p = [PollFd::new(&fd, PollFlags::IN)];
    match rustix::event::poll(&mut p, timeout(ms).as_ref()) {
        Ok(n) => Ok(n > 0),
        Err(rustix::io::Errno::INTR) => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// read(2) into raw memory.
///
/// # Safety
/// `dst..dst+len` must be valid for writes for the duration of the call and
/// no Rust reference may cover it. (`fd` is open for the call: it is
/// borrowed.)
pub unsafe fn read_raw(fd: BorrowedFd<'_>, dst: *mut u8, len: usize) -> io::Result<usize> {
    let r = libc::read(fd.as_raw_fd(), dst.cast(), len);
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r as usize)
    }
}

/// writev(2) (MSG_NOSIGNAL semantics via sendmsg).
///
/// # Safety
/// Every iovec must describe memory valid for reads for the duration of the
/// call. (`fd` is open for the call: it is borrowed.)
pub unsafe fn writev_raw(fd: BorrowedFd<'_>, iov: &[libc::iovec]) -> io::Result<usize> {
    let mut msg: libc::msghdr = std::mem::zeroed();
    msg.msg_iov = iov.as_ptr() as *mut libc::iovec;
    msg.msg_iovlen = iov.len() as _;
    let r = libc::sendmsg(
        fd.as_raw_fd(),
        &msg,
        libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT,
    );
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r as usize)
    }
}

/// shutdown(2) of a socket, best effort (an error means it is already shut
/// or not connected, which the caller handles as a closed peer anyway).
pub fn shutdown(fd: BorrowedFd<'_>, how: rustix::net::Shutdown) {
    let _ = rustix::net::shutdown(fd, how);
}

/// TCP_MAXSEG of a connected socket.
pub fn mss(fd: BorrowedFd<'_>) -> Option<usize> {
    let mut v: libc::c_int = 0;
    let mut l = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: `fd` is a borrowed, open descriptor for the whole call (the
    // `BorrowedFd` lifetime), so the call cannot act on a closed or reused
    // number; the kernel writes at most `l` bytes (one int) into the live
    // local `v` and its length into the live local `l`.
    let r = unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_MAXSEG,
            (&mut v as *mut libc::c_int).cast(),
            &mut l,
        )
    };
    (r == 0 && v > 0).then_some(v as usize)
}
