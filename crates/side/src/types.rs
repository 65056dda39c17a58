//! File types both sides of the side channel share: what a stat or a
//! listing returns and what an open asks for.

/// Kind of a directory entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum FileKind {
    File = 1,
    Dir = 2,
    Symlink = 3,
    /// Anything a protocol-1 peer cannot name (and devices' kinds below
    /// are sent as this to it).
    Other = 4,
    /// A FIFO (named pipe). Protocol 2.
    Fifo = 5,
    /// A Unix-domain socket. Protocol 2.
    Socket = 6,
    /// A character device. Protocol 2.
    CharDev = 7,
    /// A block device. Protocol 2.
    BlockDev = 8,
}

impl FileKind {
    pub fn from_u8(v: u8) -> Option<FileKind> {
        match v {
            1 => Some(FileKind::File),
            2 => Some(FileKind::Dir),
            3 => Some(FileKind::Symlink),
            4 => Some(FileKind::Other),
            5 => Some(FileKind::Fifo),
            6 => Some(FileKind::Socket),
            7 => Some(FileKind::CharDev),
            8 => Some(FileKind::BlockDev),
            _ => None,
        }
    }
    pub fn from_mode(mode: u32) -> FileKind {
        match mode & libc::S_IFMT {
            libc::S_IFREG => FileKind::File,
            libc::S_IFDIR => FileKind::Dir,
            libc::S_IFLNK => FileKind::Symlink,
            libc::S_IFIFO => FileKind::Fifo,
            libc::S_IFSOCK => FileKind::Socket,
            libc::S_IFCHR => FileKind::CharDev,
            libc::S_IFBLK => FileKind::BlockDev,
            _ => FileKind::Other,
        }
    }

    /// The `S_IFMT` bits of this kind (0 for `Other`).
    pub fn mode_bits(self) -> u32 {
        match self {
            FileKind::File => libc::S_IFREG,
            FileKind::Dir => libc::S_IFDIR,
            FileKind::Symlink => libc::S_IFLNK,
            FileKind::Fifo => libc::S_IFIFO,
            FileKind::Socket => libc::S_IFSOCK,
            FileKind::CharDev => libc::S_IFCHR,
            FileKind::BlockDev => libc::S_IFBLK,
            FileKind::Other => 0,
        }
    }

    /// The kind as a protocol-1 peer knows it (kinds 1-4).
    pub fn for_v1(self) -> FileKind {
        match self {
            FileKind::File | FileKind::Dir | FileKind::Symlink | FileKind::Other => self,
            _ => FileKind::Other,
        }
    }
}

/// The most supplementary groups a request's credentials carry (NFS's
/// AUTH_SYS carries 16; Linux allows 65,536: a caller in more is sent with
/// its first 64, docs/mount.md "Identities").
pub const MAX_GROUPS: usize = 64;

/// Who a request acts for: the calling process's uid, gid and
/// supplementary groups, as the client's kernel gave them (FUSE) or as
/// the client process has them. What the server does with them is the
/// export's `identity` policy (docs/mount.md, "Identities").
#[derive(Debug, Clone, PartialEq, Eq, Default, Hash)]
pub struct Creds {
    pub uid: u32,
    pub gid: u32,
    /// At most [`MAX_GROUPS`].
    pub groups: Vec<u32>,
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

fn ns(sec: i64, nsec: i64) -> i64 {
    sec.saturating_mul(1_000_000_000).saturating_add(nsec)
}

/// Full attributes (`StatX`, `StatHandle`, `SetAttr`: docs/side-channel.md
/// §4.1), what a POSIX file system reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttrX {
    pub kind: FileKind,
    /// Permission bits (`mode & 0o7777`).
    pub perm: u32,
    pub size: u64,
    /// Inode number on the server.
    pub ino: u64,
    pub nlink: u32,
    pub uid: u32,
    pub gid: u32,
    /// Allocated 512-byte blocks.
    pub blocks: u64,
    pub blksize: u32,
    /// Times, nanoseconds since the Unix epoch.
    pub atime_ns: i64,
    pub mtime_ns: i64,
    pub ctime_ns: i64,
}

/// Encoded size of [`AttrX`].
pub const ATTRX_LEN: usize = 69;

impl AttrX {
    pub fn from_stat(st: &libc::stat) -> AttrX {
        AttrX {
            kind: FileKind::from_mode(st.st_mode),
            perm: st.st_mode & 0o7777,
            size: st.st_size.max(0) as u64,
            ino: st.st_ino,
            nlink: st.st_nlink.min(u64::from(u32::MAX)) as u32,
            uid: st.st_uid,
            gid: st.st_gid,
            blocks: st.st_blocks.max(0) as u64,
            blksize: st.st_blksize.clamp(0, i64::from(u32::MAX)) as u32,
            atime_ns: ns(st.st_atime, st.st_atime_nsec),
            mtime_ns: ns(st.st_mtime, st.st_mtime_nsec),
            ctime_ns: ns(st.st_ctime, st.st_ctime_nsec),
        }
    }
}

/// A time to set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SetTime {
    /// The server's clock.
    Now,
    /// Nanoseconds since the Unix epoch.
    At(i64),
}

/// Attribute changes (`SetAttr`, `SetAttrHandle`); `None` leaves one alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SetAttr {
    /// Permission bits (& 0o7777).
    pub mode: Option<u32>,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    /// Truncate or extend (regular files).
    pub size: Option<u64>,
    pub atime: Option<SetTime>,
    pub mtime: Option<SetTime>,
}

impl SetAttr {
    /// Whether it changes nothing.
    pub fn is_empty(&self) -> bool {
        *self == SetAttr::default()
    }
}

/// File system figures of an export (`Statfs`), as statvfs(3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StatFs {
    pub bsize: u32,
    pub frsize: u32,
    pub blocks: u64,
    pub bfree: u64,
    pub bavail: u64,
    pub files: u64,
    pub ffree: u64,
    pub namelen: u32,
}

/// What `Remove2` may remove.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum RemoveKind {
    /// A file, a symlink or an empty directory (as `Remove`).
    Any = 0,
    /// unlink(2): a directory fails with `IsADirectory` (EISDIR).
    NotDir = 1,
    /// rmdir(2): anything else fails with `NotADirectory` (ENOTDIR).
    Dir = 2,
}

/// `Rename2` flags (renameat2(2)).
pub const RENAME_NOREPLACE: u32 = 1;
pub const RENAME_EXCHANGE: u32 = 2;

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
    /// Full sync → `O_SYNC` (what `O_DSYNC` gives, and every metadata
    /// change of a write reaches storage too).
    pub sync: bool,
}

impl OpenOptions {
    /// The synchronisation an open(2) `flags` asks for: `O_SYNC` as
    /// [`OpenOptions::sync`], `O_DSYNC` as [`OpenOptions::write_through`].
    /// (On Linux `O_SYNC` is `__O_SYNC | O_DSYNC`: both bits must be set
    /// for `O_SYNC`, and its `O_DSYNC` bit alone is `O_DSYNC`.)
    pub fn set_sync_flags(&mut self, open_flags: i32) {
        self.sync = open_flags & libc::O_SYNC == libc::O_SYNC;
        self.write_through = open_flags & libc::O_DSYNC != 0;
    }

    /// Read only.
    pub const READ: OpenOptions = OpenOptions {
        read: true,
        write: false,
        create: false,
        exclusive: false,
        truncate: false,
        no_buffering: false,
        write_through: false,
        sync: false,
    };
    /// Read and write.
    pub const READ_WRITE: OpenOptions = OpenOptions {
        write: true,
        ..OpenOptions::READ
    };
}
