//! Operations on an open descriptor, for the side channel's calls by
//! handle: attributes, copy, locks, fallocate, seek, stat.

use super::*;

/// utimensat(2) argument for one time.
pub(super) fn timespec(t: Option<SetTime>) -> libc::timespec {
    match t {
        None => libc::timespec {
            tv_sec: 0,
            tv_nsec: libc::UTIME_OMIT,
        },
        Some(SetTime::Now) => libc::timespec {
            tv_sec: 0,
            tv_nsec: libc::UTIME_NOW,
        },
        Some(SetTime::At(ns)) => libc::timespec {
            tv_sec: ns.div_euclid(1_000_000_000),
            tv_nsec: ns.rem_euclid(1_000_000_000),
        },
    }
}

/// Apply attribute changes to an open file's descriptor.
pub fn set_attr_fd(fd: RawFd, set: &SetAttr, what: &str) -> Result<AttrX> {
    if let Some(size) = set.size {
        // SAFETY: plain syscall on a caller-owned fd.
        if unsafe { libc::ftruncate(fd, size.min(i64::MAX as u64) as i64) } != 0 {
            return Err(Error::from_errno(errno(), what));
        }
    }
    if let Some(mode) = set.mode {
        // SAFETY: plain syscall.
        if unsafe { libc::fchmod(fd, (mode & 0o7777) as libc::mode_t) } != 0 {
            return Err(Error::from_errno(errno(), what));
        }
    }
    if set.uid.is_some() || set.gid.is_some() {
        let (u, g) = (set.uid.unwrap_or(u32::MAX), set.gid.unwrap_or(u32::MAX));
        // SAFETY: plain syscall.
        if unsafe { libc::fchown(fd, u, g) } != 0 {
            return Err(Error::from_errno(errno(), what));
        }
    }
    if set.atime.is_some() || set.mtime.is_some() {
        let ts = [timespec(set.atime), timespec(set.mtime)];
        // SAFETY: a two-element timespec array.
        if unsafe { libc::futimens(fd, ts.as_ptr()) } != 0 {
            return Err(Error::from_errno(errno(), what));
        }
    }
    let st = fstat(fd).map_err(|e| Error::from_errno(e, what))?;
    Ok(AttrX::from_stat(&st))
}

/// Copy `len` bytes (at most [`COPY_RANGE_MAX`]) from `src` at `src_off` to
/// `dst` at `dst_off` on the server: copy_file_range(2), or reads and writes
/// where the kernel cannot (EXDEV, EOPNOTSUPP, EINVAL). Returns the bytes
/// copied (short at the source's end).
pub fn copy_range_fd(
    src: RawFd,
    src_off: u64,
    dst: RawFd,
    dst_off: u64,
    len: u64,
    what: &str,
) -> Result<u64> {
    let len = len.min(lwio_side::codec::COPY_RANGE_MAX);
    let (Ok(mut i), Ok(mut o)) = (i64::try_from(src_off), i64::try_from(dst_off)) else {
        return Err(Error::from_errno(libc::EFBIG, what));
    };
    let mut done = 0u64;
    let mut fallback = false;
    while done < len {
        let want = (len - done) as usize;
        let n = if !fallback {
            // SAFETY: valid fds and offset out-pointers; flags 0.
            let n = unsafe { libc::copy_file_range(src, &mut i, dst, &mut o, want, 0) };
            if n < 0 {
                let e = errno();
                if matches!(
                    e,
                    libc::EXDEV | libc::EOPNOTSUPP | libc::EINVAL | libc::ENOSYS
                ) && done == 0
                {
                    fallback = true;
                    continue;
                }
                return Err(Error::from_errno(e, what));
            }
            n as u64
        } else {
            let mut buf = vec![0u8; want.min(1 << 20)];
            // SAFETY: the buffer has buf.len() bytes.
            let r = unsafe { libc::pread(src, buf.as_mut_ptr().cast(), buf.len(), i) };
            if r < 0 {
                return Err(Error::from_errno(errno(), what));
            }
            let r = r as usize;
            let mut w = 0;
            while w < r {
                // SAFETY: buf[w..r] is initialised and in bounds.
                let k = unsafe { libc::pwrite(dst, buf[w..].as_ptr().cast(), r - w, o + w as i64) };
                if k < 0 {
                    return Err(Error::from_errno(errno(), what));
                }
                w += k as usize;
            }
            i += r as i64;
            o += r as i64;
            r as u64
        };
        if n == 0 {
            break;
        }
        done += n;
    }
    Ok(done)
}

/// A lock request on an open file for one client lock owner: `kind` 0
/// unlock, 1 read, 2 write; `len` 0 = to the end of the file. With `test`,
/// the conflicting lock (kind, start, len), if any (F_OFD_GETLK); else the
/// lock is taken or released (F_OFD_SETLK, never waiting: a conflict is
/// `Locked`). Unlocking the whole file drops the owner's description, and
/// with it all its locks.
///
/// Each owner's description is opened with the handle's own access (a
/// file opened read-only takes read locks only: a write lock is refused
/// with EBADF, as `fcntl(F_SETLK, F_WRLCK)` on an O_RDONLY descriptor is),
/// and the descriptions are bounded ([`table::LockOwners`]).
pub fn lock_file(
    f: &OpenFile,
    owner: u64,
    kind: u8,
    start: u64,
    len: u64,
    test: bool,
) -> Result<Option<(u8, u64, u64)>> {
    let what = format!("{}/{}", f.export, f.path);
    let mut locks = f.locks.lock().unwrap_or_else(|p| p.into_inner());
    if kind == 0 && !test && start == 0 && len == 0 {
        locks.remove(owner);
        return Ok(None);
    }
    if kind == 2 && !test && !f.rights.write {
        return Err(Error::new(
            ErrorCode::BadHandle,
            format!("{what}: a write lock needs the file opened for writing (Bad file descriptor)"),
        ));
    }
    let fd = match locks.get(owner) {
        Some(fd) => fd,
        None if kind == 0 && !test => return Ok(None),
        None => {
            // A description of its own per owner, so that owners conflict
            // with each other as processes do, here and across sessions;
            // with the handle's access, never more (it is used for locking
            // only, never for I/O).
            let acc = match (f.rights.read, f.rights.write) {
                (true, true) => libc::O_RDWR,
                (false, true) => libc::O_WRONLY,
                _ => libc::O_RDONLY,
            };
            locks.add(owner, &what, || {
                let file = f.fd()?;
                reopen(file.as_raw_fd(), acc).map_err(|e| Error::from_errno(e, &what))
            })?
        }
    };
    let (Ok(s), Ok(l)) = (i64::try_from(start), i64::try_from(len)) else {
        return Err(Error::from_errno(libc::EINVAL, &what));
    };
    // SAFETY: flock is plain data.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = match kind {
        1 => libc::F_RDLCK,
        2 => libc::F_WRLCK,
        _ => libc::F_UNLCK,
    } as i16;
    fl.l_whence = libc::SEEK_SET as i16;
    fl.l_start = s;
    fl.l_len = l;
    let cmd = if test {
        libc::F_OFD_GETLK
    } else {
        libc::F_OFD_SETLK
    };
    // SAFETY: valid fd and flock out-pointer.
    if unsafe { libc::fcntl(fd, cmd, &mut fl) } != 0 {
        let e = errno();
        if matches!(e, libc::EAGAIN | libc::EACCES) {
            return Err(Error::new(
                ErrorCode::Locked,
                format!("{what}: locked by another owner"),
            ));
        }
        return Err(Error::from_errno(e, &what));
    }
    if !test || fl.l_type == libc::F_UNLCK as i16 {
        return Ok(None);
    }
    let k = if fl.l_type == libc::F_WRLCK as i16 {
        2
    } else {
        1
    };
    Ok(Some((k, fl.l_start.max(0) as u64, fl.l_len.max(0) as u64)))
}

/// fallocate(2) on an open file.
pub fn fallocate_fd(fd: RawFd, mode: u32, offset: u64, len: u64, what: &str) -> Result<()> {
    let (Ok(off), Ok(len)) = (i64::try_from(offset), i64::try_from(len)) else {
        return Err(Error::from_errno(libc::EFBIG, what));
    };
    // SAFETY: plain syscall on a caller-owned fd.
    if unsafe { libc::fallocate(fd, mode as i32, off, len) } != 0 {
        return Err(Error::from_errno(errno(), what));
    }
    Ok(())
}

/// lseek(2) with SEEK_DATA or SEEK_HOLE on an open file (ENXIO, no data
/// at or after the offset, is `NoSuchOffset`).
pub fn seek_fd(fd: RawFd, offset: u64, whence: i32, what: &str) -> Result<u64> {
    let off = i64::try_from(offset).map_err(|_| Error::from_errno(libc::ENXIO, what))?;
    // SAFETY: plain syscall on a caller-owned fd. lseek on a shared fd moves
    // its offset, which LWIO never uses (every I/O is positional).
    let r = unsafe { libc::lseek(fd, off, whence) };
    if r < 0 {
        return Err(Error::from_errno(errno(), what));
    }
    Ok(r as u64)
}

/// fstat(2) of an open file.
pub fn statx_fd(fd: RawFd, what: &str) -> Result<AttrX> {
    let st = fstat(fd).map_err(|e| Error::from_errno(e, what))?;
    Ok(AttrX::from_stat(&st))
}
