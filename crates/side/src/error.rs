//! The error type shared by the filesystem layer, the side-channel server and
//! its clients. Its [`ErrorCode`] travels on the wire (see
//! `docs/side-channel.md`), so a client sees the server's exact reason.

use std::fmt;
use std::io;

/// Wire error codes (u16). Values are stable: never renumber.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u16)]
pub enum ErrorCode {
    /// The request was malformed or not allowed in this state.
    BadRequest = 1,
    NotFound = 2,
    PermissionDenied = 3,
    /// The path would leave its export (`..`, absolute, symlink outside).
    OutsideExport = 4,
    Exists = 5,
    NotADirectory = 6,
    IsADirectory = 7,
    NoSpace = 8,
    DirectoryNotEmpty = 9,
    /// Login failed (wrong token, anonymous access not allowed, bad proof).
    AuthFailed = 10,
    /// A request that needs a session came before a successful login.
    NotLoggedIn = 11,
    /// The per-session open-file limit (or the process fd limit) was reached.
    TooManyOpenFiles = 12,
    /// Unknown or foreign file handle.
    BadHandle = 13,
    /// No protocol version in common.
    UnsupportedVersion = 14,
    /// An argument is out of range (e.g. misaligned O_DIRECT I/O).
    InvalidArgument = 15,
    /// The server is at its session limit or shutting down.
    Busy = 16,
    /// Any other I/O error (the message carries the OS text).
    Io = 17,
    /// The export is read-only.
    ReadOnly = 18,
    NameTooLong = 19,
    /// The export named in the request does not exist.
    NoSuchExport = 20,
    /// A frame exceeded the negotiated maximum size.
    FrameTooLarge = 21,
    /// The operation is not supported by this server or filesystem.
    Unsupported = 22,
    /// The peer did not answer in time.
    TimedOut = 23,
    /// The connection failed or was closed (client side only, never sent).
    Disconnected = 24,
    /// The server could not be reached (client side only, never sent).
    ConnectFailed = 25,
    /// No data (or hole) at or after the offset (ENXIO of SEEK_DATA/HOLE).
    NoSuchOffset = 26,
    /// A byte-range lock conflicts with another owner's (EAGAIN).
    Locked = 27,
    /// The caller may not do this (EPERM: not the owner, the sticky bit,
    /// a device node the export does not allow), where `PermissionDenied`
    /// is EACCES (mode bits). Protocol 2; a version-1 peer is sent
    /// `PermissionDenied`.
    NotPermitted = 28,
    /// Across file systems (EXDEV). Protocol 2 (version 1: `Unsupported`).
    CrossDevice = 29,
    /// Too many links (EMLINK). Protocol 2 (version 1: `Io`).
    TooManyLinks = 30,
    /// Too many levels of symbolic links (ELOOP). Protocol 2 (version 1: `Io`).
    Loop = 31,
    /// File too large (EFBIG). Protocol 2 (version 1: `NoSpace`).
    FileTooLarge = 32,
    /// Text file busy (ETXTBSY). Protocol 2 (version 1: `Busy`).
    TextBusy = 33,
}

impl ErrorCode {
    /// All codes, for tests and docs.
    pub const ALL: [ErrorCode; 33] = [
        ErrorCode::BadRequest,
        ErrorCode::NotFound,
        ErrorCode::PermissionDenied,
        ErrorCode::OutsideExport,
        ErrorCode::Exists,
        ErrorCode::NotADirectory,
        ErrorCode::IsADirectory,
        ErrorCode::NoSpace,
        ErrorCode::DirectoryNotEmpty,
        ErrorCode::AuthFailed,
        ErrorCode::NotLoggedIn,
        ErrorCode::TooManyOpenFiles,
        ErrorCode::BadHandle,
        ErrorCode::UnsupportedVersion,
        ErrorCode::InvalidArgument,
        ErrorCode::Busy,
        ErrorCode::Io,
        ErrorCode::ReadOnly,
        ErrorCode::NameTooLong,
        ErrorCode::NoSuchExport,
        ErrorCode::FrameTooLarge,
        ErrorCode::Unsupported,
        ErrorCode::TimedOut,
        ErrorCode::Disconnected,
        ErrorCode::ConnectFailed,
        ErrorCode::NoSuchOffset,
        ErrorCode::Locked,
        ErrorCode::NotPermitted,
        ErrorCode::CrossDevice,
        ErrorCode::TooManyLinks,
        ErrorCode::Loop,
        ErrorCode::FileTooLarge,
        ErrorCode::TextBusy,
    ];

    pub fn from_u16(v: u16) -> Option<ErrorCode> {
        ErrorCode::ALL.iter().copied().find(|c| *c as u16 == v)
    }

    /// The closest `std::io::ErrorKind`.
    pub fn io_kind(self) -> io::ErrorKind {
        use io::ErrorKind as K;
        match self {
            ErrorCode::BadRequest | ErrorCode::FrameTooLarge => K::InvalidData,
            ErrorCode::NotFound | ErrorCode::NoSuchExport => K::NotFound,
            ErrorCode::PermissionDenied
            | ErrorCode::OutsideExport
            | ErrorCode::AuthFailed
            | ErrorCode::NotLoggedIn => K::PermissionDenied,
            ErrorCode::Exists => K::AlreadyExists,
            ErrorCode::NotADirectory => K::NotADirectory,
            ErrorCode::IsADirectory => K::IsADirectory,
            ErrorCode::NoSpace => K::StorageFull,
            ErrorCode::DirectoryNotEmpty => K::DirectoryNotEmpty,
            ErrorCode::TooManyOpenFiles | ErrorCode::Busy => K::ResourceBusy,
            ErrorCode::BadHandle | ErrorCode::InvalidArgument => K::InvalidInput,
            ErrorCode::UnsupportedVersion | ErrorCode::Unsupported => K::Unsupported,
            ErrorCode::Io => K::Other,
            ErrorCode::ReadOnly => K::ReadOnlyFilesystem,
            ErrorCode::NameTooLong => K::InvalidFilename,
            ErrorCode::TimedOut => K::TimedOut,
            ErrorCode::Disconnected => K::ConnectionAborted,
            ErrorCode::ConnectFailed => K::ConnectionRefused,
            ErrorCode::NoSuchOffset => K::InvalidInput,
            ErrorCode::Locked => K::WouldBlock,
            ErrorCode::NotPermitted => K::PermissionDenied,
            ErrorCode::CrossDevice => K::CrossesDevices,
            ErrorCode::TooManyLinks => K::TooManyLinks,
            ErrorCode::Loop => K::Other,
            ErrorCode::FileTooLarge => K::FileTooLarge,
            ErrorCode::TextBusy => K::ExecutableFileBusy,
        }
    }

    /// A short human description ("not found", "permission denied", …).
    pub fn describe(self) -> &'static str {
        match self {
            ErrorCode::BadRequest => "bad request",
            ErrorCode::NotFound => "not found",
            ErrorCode::PermissionDenied => "permission denied",
            ErrorCode::OutsideExport => "path is outside the export",
            ErrorCode::Exists => "already exists",
            ErrorCode::NotADirectory => "not a directory",
            ErrorCode::IsADirectory => "is a directory",
            ErrorCode::NoSpace => "no space left on device",
            ErrorCode::DirectoryNotEmpty => "directory not empty",
            ErrorCode::AuthFailed => "authentication failed",
            ErrorCode::NotLoggedIn => "not logged in",
            ErrorCode::TooManyOpenFiles => "too many open files",
            ErrorCode::BadHandle => "bad file handle",
            ErrorCode::UnsupportedVersion => "unsupported protocol version",
            ErrorCode::InvalidArgument => "invalid argument",
            ErrorCode::Busy => "server busy",
            ErrorCode::Io => "I/O error",
            ErrorCode::ReadOnly => "export is read-only",
            ErrorCode::NameTooLong => "name too long",
            ErrorCode::NoSuchExport => "no such export",
            ErrorCode::FrameTooLarge => "message too large",
            ErrorCode::Unsupported => "not supported",
            ErrorCode::TimedOut => "timed out",
            ErrorCode::Disconnected => "connection lost",
            ErrorCode::ConnectFailed => "cannot connect",
            ErrorCode::NoSuchOffset => "no data or hole at or after the offset",
            ErrorCode::Locked => "locked by another owner",
            ErrorCode::NotPermitted => "operation not permitted",
            ErrorCode::CrossDevice => "across file systems",
            ErrorCode::TooManyLinks => "too many links",
            ErrorCode::Loop => "too many levels of symbolic links",
            ErrorCode::FileTooLarge => "file too large",
            ErrorCode::TextBusy => "text file busy",
        }
    }

    /// Map an errno from a filesystem call.
    pub fn from_errno(errno: i32) -> ErrorCode {
        match errno {
            libc::ENOENT => ErrorCode::NotFound,
            libc::EACCES => ErrorCode::PermissionDenied,
            libc::EPERM => ErrorCode::NotPermitted,
            libc::EXDEV => ErrorCode::CrossDevice,
            libc::EMLINK => ErrorCode::TooManyLinks,
            libc::ELOOP => ErrorCode::Loop,
            libc::EFBIG => ErrorCode::FileTooLarge,
            libc::ETXTBSY => ErrorCode::TextBusy,
            libc::EEXIST => ErrorCode::Exists,
            libc::ENOTDIR => ErrorCode::NotADirectory,
            libc::EISDIR => ErrorCode::IsADirectory,
            libc::ENOSPC | libc::EDQUOT => ErrorCode::NoSpace,
            libc::ENOTEMPTY => ErrorCode::DirectoryNotEmpty,
            libc::EMFILE | libc::ENFILE => ErrorCode::TooManyOpenFiles,
            libc::EINVAL => ErrorCode::InvalidArgument,
            libc::EROFS => ErrorCode::ReadOnly,
            libc::ENAMETOOLONG => ErrorCode::NameTooLong,
            libc::EOPNOTSUPP | libc::ENOSYS => ErrorCode::Unsupported,
            libc::EBADF => ErrorCode::BadHandle,
            libc::ETIMEDOUT => ErrorCode::TimedOut,
            libc::ENXIO => ErrorCode::NoSuchOffset,
            _ => ErrorCode::Io,
        }
    }
}

impl ErrorCode {
    /// The code as a protocol-1 peer knows it (codes 1-27).
    pub fn for_v1(self) -> ErrorCode {
        match self {
            ErrorCode::NotPermitted => ErrorCode::PermissionDenied,
            ErrorCode::CrossDevice => ErrorCode::Unsupported,
            ErrorCode::TooManyLinks | ErrorCode::Loop => ErrorCode::Io,
            ErrorCode::FileTooLarge => ErrorCode::NoSpace,
            ErrorCode::TextBusy => ErrorCode::Busy,
            c => c,
        }
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.describe())
    }
}

/// An lwio error: a wire code and a message a person can act on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error {
    pub code: ErrorCode,
    pub message: String,
}

impl Error {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Error {
        Error {
            code,
            message: message.into(),
        }
    }

    /// From an OS error number with context (`"open a/b"`).
    pub fn from_errno(errno: i32, context: impl fmt::Display) -> Error {
        let os = io::Error::from_raw_os_error(errno);
        let code = ErrorCode::from_errno(errno);
        Error::new(code, format!("{context}: {}", strip_os_suffix(&os)))
    }

    /// From a `std::io::Error` with context.
    pub fn from_io(e: &io::Error, context: impl fmt::Display) -> Error {
        match e.raw_os_error() {
            Some(n) => Error::from_errno(n, context),
            None => Error::new(io_kind_code(e.kind()), format!("{context}: {e}")),
        }
    }

    pub fn kind(&self) -> io::ErrorKind {
        self.code.io_kind()
    }
}

fn io_kind_code(k: io::ErrorKind) -> ErrorCode {
    use io::ErrorKind as K;
    match k {
        K::NotFound => ErrorCode::NotFound,
        K::PermissionDenied => ErrorCode::PermissionDenied,
        K::AlreadyExists => ErrorCode::Exists,
        K::InvalidInput => ErrorCode::InvalidArgument,
        K::InvalidData => ErrorCode::BadRequest,
        K::TimedOut => ErrorCode::TimedOut,
        K::UnexpectedEof
        | K::ConnectionReset
        | K::ConnectionAborted
        | K::BrokenPipe
        | K::NotConnected => ErrorCode::Disconnected,
        K::Unsupported => ErrorCode::Unsupported,
        _ => ErrorCode::Io,
    }
}

/// "No such file or directory (os error 2)" → "No such file or directory".
fn strip_os_suffix(e: &io::Error) -> String {
    let s = e.to_string();
    match s.rfind(" (os error") {
        Some(i) => s[..i].to_string(),
        None => s,
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.message.is_empty() {
            f.write_str(self.code.describe())
        } else {
            f.write_str(&self.message)
        }
    }
}

impl std::error::Error for Error {}

impl From<Error> for io::Error {
    fn from(e: Error) -> io::Error {
        io::Error::new(e.kind(), e.to_string())
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip() {
        for c in ErrorCode::ALL {
            assert_eq!(ErrorCode::from_u16(c as u16), Some(c));
        }
        assert_eq!(ErrorCode::from_u16(0), None);
        assert_eq!(ErrorCode::from_u16(999), None);
    }

    #[test]
    fn errno_mapping() {
        let e = Error::from_errno(libc::ENOENT, "open a/b");
        assert_eq!(e.code, ErrorCode::NotFound);
        assert_eq!(e.to_string(), "open a/b: No such file or directory");
        assert_eq!(io::Error::from(e).kind(), io::ErrorKind::NotFound);
        assert_eq!(
            ErrorCode::from_errno(libc::EACCES),
            ErrorCode::PermissionDenied
        );
        assert_eq!(ErrorCode::from_errno(libc::ENOSPC), ErrorCode::NoSpace);
    }
}
