//! File types both sides of the side channel share: what a stat or a
//! listing returns and what an open asks for.

/// Kind of a directory entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum FileKind {
    File = 1,
    Dir = 2,
    Symlink = 3,
    Other = 4,
}

impl FileKind {
    pub fn from_u8(v: u8) -> Option<FileKind> {
        match v {
            1 => Some(FileKind::File),
            2 => Some(FileKind::Dir),
            3 => Some(FileKind::Symlink),
            4 => Some(FileKind::Other),
            _ => None,
        }
    }
    pub fn from_mode(mode: u32) -> FileKind {
        match mode & libc::S_IFMT {
            libc::S_IFREG => FileKind::File,
            libc::S_IFDIR => FileKind::Dir,
            libc::S_IFLNK => FileKind::Symlink,
            _ => FileKind::Other,
        }
    }
}

/// File attributes returned by stat and listings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Attr {
    pub kind: FileKind,
    /// Permission bits (`mode & 0o7777`).
    pub perm: u32,
    pub size: u64,
    /// Modification time, nanoseconds since the Unix epoch.
    pub mtime_ns: i64,
}

impl Attr {
    pub fn from_stat(st: &libc::stat) -> Attr {
        Attr {
            kind: FileKind::from_mode(st.st_mode),
            perm: st.st_mode & 0o7777,
            size: st.st_size.max(0) as u64,
            mtime_ns: st
                .st_mtime
                .saturating_mul(1_000_000_000)
                .saturating_add(st.st_mtime_nsec),
        }
    }
}

/// One entry of a directory listing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirEntry {
    /// File name (non-UTF-8 names are converted lossily).
    pub name: String,
    pub attr: Attr,
}

/// What a client asks for when opening a file.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OpenOptions {
    pub read: bool,
    pub write: bool,
    /// Create if missing (needs `write`).
    pub create: bool,
    /// With `create`: fail if it exists.
    pub exclusive: bool,
    /// Truncate to zero (needs `write`).
    pub truncate: bool,
    /// FILE_NO_INTERMEDIATE_BUFFERING → `O_DIRECT`.
    pub no_buffering: bool,
    /// Write-through → `O_DSYNC`.
    pub write_through: bool,
}

impl OpenOptions {
    /// Read only.
    pub const READ: OpenOptions = OpenOptions {
        read: true,
        write: false,
        create: false,
        exclusive: false,
        truncate: false,
        no_buffering: false,
        write_through: false,
    };
    /// Read and write.
    pub const READ_WRITE: OpenOptions = OpenOptions {
        write: true,
        ..OpenOptions::READ
    };
}
