//! The reactor's page-cache fast path (`inline_io`): file I/O done on
//! the reactor thread itself when it cannot block (tmpfs/ramfs plain calls,
//! else `RWF_NOWAIT`).

use std::collections::HashMap;
use std::os::fd::RawFd;

use crate::fs::table::OpenFile;

/// The reactor's fast path for one file and direction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum InlineMode {
    /// tmpfs/ramfs: plain calls (memory copies, never a device wait).
    Memory,
    /// `RWF_NOWAIT`, falling back to the pool on `EAGAIN`.
    NoWait,
    /// Always the pool (`RWF_NOWAIT` refused).
    Off,
}

pub(super) fn inline_mode_of(fd: std::os::fd::RawFd) -> InlineMode {
    const TMPFS_MAGIC: i64 = 0x0102_1994;
    const RAMFS_MAGIC: i64 = 0x8584_58f6;
    // SAFETY: statfs is plain old data; all-zero bytes are a valid value.
    let mut sfs: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: fstatfs writes into the struct we own; `fd` is an open file.
    if unsafe { libc::fstatfs(fd, &mut sfs) } == 0 {
        #[allow(clippy::unnecessary_cast)]
        let t = sfs.f_type as i64;
        if t == TMPFS_MAGIC || t == RAMFS_MAGIC {
            return InlineMode::Memory;
        }
    }
    InlineMode::NoWait
}

/// The fast path's system call (see `Conn::try_inline`): `Some(n)` when
/// all `len` bytes moved without blocking (with `block`, a small write
/// also where it may block: [`inline_io_iov`]); `None` = use the storage
/// pool.
///
/// # Safety
/// For a read, `ptr..ptr+len` must be valid for writes and not accessed by
/// anything else during the call; for a write, valid for reads.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn inline_io(
    cache: &mut HashMap<(u64, bool), InlineMode>,
    f: &OpenFile,
    fd: RawFd,
    offset: u64,
    ptr: *mut u8,
    len: usize,
    write: bool,
    block: bool,
) -> Option<u32> {
    let iov = [libc::iovec {
        iov_base: ptr.cast(),
        iov_len: len,
    }];
    // SAFETY: the caller's contract, for the one piece.
    unsafe { inline_io_iov(cache, f, fd, offset, &iov, len, write, block) }
}

/// [`inline_io`] of a write gathered from several pieces: one `pwritev2`.
///
/// # Safety
/// Every `iov` piece must be valid for reads during the call; `total` is
/// their summed length.
pub(super) unsafe fn inline_io_vec(
    cache: &mut HashMap<(u64, bool), InlineMode>,
    f: &OpenFile,
    fd: RawFd,
    offset: u64,
    iov: &[libc::iovec],
    total: usize,
    block: bool,
) -> Option<u32> {
    // SAFETY: the caller's contract.
    unsafe { inline_io_iov(cache, f, fd, offset, iov, total, true, block) }
}

/// The largest write made with a plain (blocking) call on the reactor of a
/// connection alone there (`block`): a page-cache copy of this size takes
/// microseconds; larger ones keep the workers' parallelism.
pub(super) const BLOCKING_WRITE_MAX: usize = 64 << 10;

/// With `block` (the connection is alone on its reactor: nothing else
/// waits for this thread), a buffered write of up to
/// [`BLOCKING_WRITE_MAX`] is a plain call even where `RWF_NOWAIT` is
/// refused (ext4): it may wait for the page cache, never for another
/// client.
///
/// # Safety
/// As [`inline_io`], for every piece of `iov` (`total` bytes in all);
/// `fd` is `f`'s descriptor, held open across the call.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn inline_io_iov(
    cache: &mut HashMap<(u64, bool), InlineMode>,
    f: &OpenFile,
    fd: RawFd,
    offset: u64,
    iov: &[libc::iovec],
    len: usize,
    write: bool,
    block: bool,
) -> Option<u32> {
    if f.direct || len == 0 || iov.len() > 1024 {
        return None;
    }
    let n = u32::try_from(len).ok()?;
    let mode = *cache
        .entry((f.handle, write))
        .or_insert_with(|| inline_mode_of(fd));
    let plain = block && write && len <= BLOCKING_WRITE_MAX;
    let flags = match mode {
        InlineMode::Memory => 0,
        _ if plain => 0,
        InlineMode::Off => return None,
        InlineMode::NoWait => libc::RWF_NOWAIT,
    };
    let off = libc::off_t::try_from(offset).ok()?;
    let cnt = iov.len() as libc::c_int;
    // SAFETY: the caller vouches for every piece of `iov`, which lives
    // across the call; `fd` is an open file.
    let r = unsafe {
        if write {
            libc::pwritev2(fd, iov.as_ptr(), cnt, off, flags)
        } else {
            libc::preadv2(fd, iov.as_ptr(), cnt, off, flags)
        }
    };
    if r < 0 {
        if std::io::Error::last_os_error().raw_os_error() == Some(libc::EOPNOTSUPP) {
            // No RWF_NOWAIT here: always the pool for this file.
            cache.insert((f.handle, write), InlineMode::Off);
        }
        // Real errors (and EAGAIN) are left to the pool's attempt, which
        // reports them.
        return None;
    }
    (r as usize == len).then_some(n)
}
