//! lwio errors as errno values: what the mount tells the kernel and what
//! the C API returns (negated).

use libc::*;
use lwio_proto::status::*;
use lwio_side::ErrorCode as C;

/// The errno for a side-channel error: the server's own errno when it sent
/// one, else the natural one for its code.
pub fn side(e: &lwio_side::Error) -> i32 {
    match e.code {
        C::NotFound | C::NoSuchExport => ENOENT,
        C::PermissionDenied | C::OutsideExport | C::AuthFailed | C::NotLoggedIn => EACCES,
        C::Exists => EEXIST,
        C::NotADirectory => ENOTDIR,
        C::IsADirectory => EISDIR,
        C::NoSpace => ENOSPC,
        C::DirectoryNotEmpty => ENOTEMPTY,
        C::TooManyOpenFiles => EMFILE,
        C::BadHandle => EBADF,
        C::InvalidArgument | C::BadRequest => EINVAL,
        C::Busy => EBUSY,
        C::ReadOnly => EROFS,
        C::NameTooLong => ENAMETOOLONG,
        C::Unsupported => EOPNOTSUPP,
        C::TimedOut => ETIMEDOUT,
        C::FrameTooLarge => E2BIG,
        C::NoSuchOffset => ENXIO,
        C::Locked => EAGAIN,
        C::NotPermitted => EPERM,
        C::CrossDevice => EXDEV,
        C::TooManyLinks => EMLINK,
        C::Loop => ELOOP,
        C::FileTooLarge => EFBIG,
        C::TextBusy => ETXTBSY,
        C::UnsupportedVersion | C::Io | C::Disconnected | C::ConnectFailed => EIO,
    }
}

/// The errno for a client (data path or connection) error.
pub fn client(e: &crate::Error) -> i32 {
    use crate::Error as E;
    match e {
        E::NotFound(_) => ENOENT,
        E::AccessDenied(_) | E::WrongToken(_) => EACCES,
        E::ReadOnly(_) => EROFS,
        E::InvalidArgument(_) => EINVAL,
        E::Busy(_) => EBUSY,
        E::Cancelled => EINTR,
        E::TimedOut(_) => ETIMEDOUT,
        E::Stale(_) => ESTALE,
        E::Fs(e) => side(e),
        E::Status { status, .. } => match *status {
            STATUS_DISK_FULL => ENOSPC,
            STATUS_INVALID_HANDLE | STATUS_FILE_CLOSED => EBADF,
            STATUS_INVALID_PARAMETER | STATUS_INVALID_BUFFER_SIZE => EINVAL,
            STATUS_ACCESS_DENIED => EACCES,
            STATUS_NOT_SUPPORTED | STATUS_INVALID_DEVICE_REQUEST => EOPNOTSUPP,
            STATUS_IO_TIMEOUT => ETIMEDOUT,
            STATUS_INSUFFICIENT_RESOURCES => ENOMEM,
            STATUS_FILE_DELETED => ESTALE,
            _ => EIO,
        },
        _ => EIO,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_map_to_the_errno_programs_expect() {
        let e = |c| side(&lwio_side::Error::new(c, "x"));
        assert_eq!(e(C::NotFound), ENOENT);
        assert_eq!(e(C::Exists), EEXIST);
        assert_eq!(e(C::DirectoryNotEmpty), ENOTEMPTY);
        assert_eq!(e(C::IsADirectory), EISDIR);
        assert_eq!(e(C::NotADirectory), ENOTDIR);
        assert_eq!(e(C::ReadOnly), EROFS);
        assert_eq!(e(C::NameTooLong), ENAMETOOLONG);
        let s = |status| {
            client(&crate::Error::Status {
                what: "READ".into(),
                status,
            })
        };
        assert_eq!(s(STATUS_DISK_FULL), ENOSPC);
        assert_eq!(s(0xC000_0185), EIO);
        assert_eq!(client(&crate::Error::ConnectionLost("gone".into())), EIO);
        // A refusal of the server's file system keeps its errno through
        // the client's error type (an O_DIRECT open on a file system
        // without it, a held lock), where it used to become EIO.
        let via = |c| client(&crate::Error::from(lwio_side::Error::new(c, "x")));
        assert_eq!(via(C::Unsupported), EOPNOTSUPP);
        assert_eq!(via(C::Locked), EAGAIN);
        assert_eq!(via(C::BadHandle), EBADF);
        assert_eq!(via(C::NoSuchOffset), ENXIO);
        assert_eq!(via(C::NameTooLong), ENAMETOOLONG);
        assert_eq!(client(&crate::Error::Stale("replaced".into())), ESTALE);
    }
}
