//! The LWIO RDMA phase: the server's connection driver ([`driver`]) and the
//! pieces the client data path shares with it (provider selection, wake-up
//! plumbing, status mapping).
//!
//! The protocol logic lives in `lwio-proto`'s sans-IO state machines
//! (`ServerConn`, `ClientConn`); this module carries out their actions on the
//! verbs API of `lwio-rdma` and on the file backends of [`crate::fs`].

pub mod driver;
pub mod memobj_io;
pub mod pool;
pub mod reactor;
pub mod readbuf;
/// In-process servers for tests and examples (the `testkit` feature).
#[cfg(any(test, feature = "testkit"))]
pub mod testkit;

use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::time::Duration;

use lwio_proto::status::*;
use lwio_proto::NtStatus;

/// STATUS_UNEXPECTED_IO_ERROR: a backend failure without a closer NTSTATUS.
pub const STATUS_UNEXPECTED_IO_ERROR: NtStatus = 0xC000_00E9;

/// Map a backend I/O error to the NTSTATUS a client sees.
pub fn io_error_status(e: &io::Error) -> NtStatus {
    match e.raw_os_error() {
        Some(libc::ENOSPC) | Some(libc::EDQUOT) => STATUS_DISK_FULL,
        Some(libc::EBADF) | Some(libc::EACCES) | Some(libc::EPERM) | Some(libc::EROFS) => {
            STATUS_ACCESS_DENIED
        }
        Some(libc::EINVAL) | Some(libc::EFBIG) | Some(libc::EOVERFLOW) => STATUS_INVALID_PARAMETER,
        Some(libc::ECANCELED) => STATUS_CANCELLED,
        Some(libc::ENOMEM) => STATUS_INSUFFICIENT_RESOURCES,
        _ => match e.kind() {
            io::ErrorKind::InvalidInput => STATUS_INVALID_PARAMETER,
            io::ErrorKind::PermissionDenied => STATUS_ACCESS_DENIED,
            _ => STATUS_UNEXPECTED_IO_ERROR,
        },
    }
}

/// A non-blocking eventfd used to wake a thread that sleeps in `poll(2)`
/// on a completion channel.
#[derive(Debug)]
pub struct Waker(OwnedFd);

impl Waker {
    pub fn new() -> io::Result<Waker> {
        let fd = rustix::event::eventfd(
            0,
            rustix::event::EventfdFlags::NONBLOCK | rustix::event::EventfdFlags::CLOEXEC,
        )?;
        Ok(Waker(fd))
    }

    /// Make the fd readable.
    pub fn wake(&self) {
        // A full counter (EAGAIN) already means "readable", so the result is
        // moot.
        let _ = rustix::io::write(&self.0, &1u64.to_ne_bytes());
    }

    /// Consume pending wake-ups; true if there were any.
    pub fn drain(&self) -> bool {
        let mut v = [0u8; 8];
        matches!(rustix::io::read(&self.0, &mut v), Ok(8))
    }

    pub fn fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}

/// Wait until one of `fds` is readable or `timeout` passes. Returns the
/// readiness of each fd.
pub fn poll_readable(fds: &[RawFd], timeout: Duration) -> io::Result<Vec<bool>> {
    let mut p: Vec<libc::pollfd> = fds
        .iter()
        .map(|&fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    let ms = timeout.as_millis().min(i32::MAX as u128) as i32;
    // SAFETY: `p` is a live, correctly sized array of pollfd for the call.
    let r = unsafe { libc::poll(p.as_mut_ptr(), p.len() as libc::nfds_t, ms) };
    if r < 0 {
        let e = io::Error::last_os_error();
        if e.kind() == io::ErrorKind::Interrupted {
            return Ok(vec![false; fds.len()]);
        }
        return Err(e);
    }
    Ok(p.iter().map(|x| x.revents != 0).collect())
}
