//! Exports and confined filesystem access.
//!
//! An export maps a name to a directory (`NAME=PATH`). Every path a client
//! sends is relative to an export root and is resolved so that it can never
//! leave it:
//!
//! * the textual path is checked first: absolute paths and `..` components are
//!   rejected ([`ErrorCode::OutsideExport`]), empty and `.` components dropped;
//! * the path is then opened relative to a directory fd of the export root with
//!   `openat2(RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS)`. Symbolic links inside
//!   the export are followed as long as every step stays beneath the root:
//!   relative links that stay inside are allowed; absolute links and links that
//!   climb out fail with `EXDEV`, reported as "outside the export";
//! * where `openat2` is unavailable (kernels before 5.6, seccomp filters), the
//!   path is walked component by component with `openat(O_NOFOLLOW)`: then **no**
//!   symlink is followed at all (stricter than the openat2 policy);
//! * operations on a name (mkdir, remove, rename, stat of a listing entry) act
//!   on the final component relative to a confined parent directory fd and
//!   never follow a final symlink (removing a link removes the link).
//!
//! Hard links: a hard link inside an export to a file elsewhere on the same
//! filesystem is just another name for that inode. [`Export::open_file`]
//! therefore refuses a regular file whose link count (`st_nlink`, read with
//! `fstat` on the opened fd, so there is no race) is above 1, with
//! [`ErrorCode::PermissionDenied`], unless the export sets
//! `allow_hardlinks`. Truncation is deferred until after that check, so a
//! refused open changes nothing. `stat` and listings still show such files.
//! A directory that a local
//! user renames out of the export *while* a request holds its fd can be reached
//! by that one request (the usual limit of fd-based confinement).

pub mod backend;
pub mod fdcache;
pub mod ids;
pub mod ring;
pub mod table;

mod fdops;
use fdops::timespec;
pub use fdops::{copy_range_fd, fallocate_fd, lock_file, seek_fd, set_attr_fd, statx_fd};

use std::collections::BTreeMap;
use std::ffi::{CStr, CString};
use std::fs::File;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use lwio_side::error::{Error, ErrorCode, Result};

pub use backend::{
    Backend, BackendKind, InlineBackend, IoBuf, IoOp, ThreadPoolBackend, UringBackend,
};
pub use lwio_side::types::{
    Attr, AttrX, DirEntry, FileKind, OpenOptions, RemoveKind, SetAttr, SetTime, StatFs,
};
pub use table::{Denied, OpenFile, OpenFileTable, SessionId, SrvRequestResumeKey, SrvResumeKey};

/// Longest path (bytes) accepted from a client.
pub const MAX_PATH: usize = 4096;
/// Longest file-name component (bytes).
pub const MAX_NAME: usize = 255;

/// Test hook, off unless a test turns it on with [`serve_fifos_for_tests`]
/// (built only with the `testkit` feature).
#[cfg(any(test, feature = "testkit"))]
static SERVE_FIFOS: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Whether FIFOs are served ([`serve_fifos_for_tests`]); never in a server
/// built without the `testkit` feature.
fn serve_fifos() -> bool {
    #[cfg(any(test, feature = "testkit"))]
    return SERVE_FIFOS.load(std::sync::atomic::Ordering::Relaxed);
    #[cfg(not(any(test, feature = "testkit")))]
    false
}

/// **Tests only.** Let [`Export::open_file`] open FIFOs (named pipes), which
/// it otherwise refuses as not regular files. A FIFO is a file whose I/O
/// blocks until the test feeds it: end-to-end tests use it as a storage
/// backend that is slow for as long as they like, to have I/O in flight at
/// the storage (in io_uring, not merely queued) when they CANCEL it. Nothing
/// outside tests calls it; there is no configuration for it.
#[doc(hidden)]
#[cfg(any(test, feature = "testkit"))]
pub fn serve_fifos_for_tests(on: bool) {
    SERVE_FIFOS.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// `NAME=PATH` plus options, as configured.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ExportSpec {
    pub name: String,
    pub path: PathBuf,
    pub read_only: bool,
    /// Open regular files with more than one hard link (default: refused).
    pub allow_hardlinks: bool,
    /// Whose ids the calls run as (docs/mount.md, "Identities").
    pub identity: ids::Identity,
    /// Clients may create device nodes (default: `EPERM`).
    pub allow_devices: bool,
}

impl std::str::FromStr for ExportSpec {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let (name, path) = s
            .split_once('=')
            .ok_or_else(|| format!("invalid export {s:?}: expected NAME=PATH"))?;
        validate_export_name(name)?;
        if path.is_empty() {
            return Err(format!("invalid export {s:?}: empty path"));
        }
        Ok(ExportSpec {
            name: name.to_string(),
            path: PathBuf::from(path),
            ..ExportSpec::default()
        })
    }
}

/// Export names: 1-64 characters of `[A-Za-z0-9._-]`, not `.` or `..`.
pub fn validate_export_name(name: &str) -> std::result::Result<(), String> {
    if name.is_empty()
        || name.len() > 64
        || name == "."
        || name == ".."
        || !name
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || b"._-".contains(&c))
    {
        return Err(format!(
            "invalid export name {name:?}: use 1-64 characters of A-Z a-z 0-9 . _ -"
        ));
    }
    Ok(())
}

/// How paths are resolved beneath an export root.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ResolveMode {
    /// openat2 when the kernel has it, else the fallback.
    #[default]
    Auto,
    /// `openat2(RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS)`.
    Openat2,
    /// Component-by-component `openat(O_NOFOLLOW)`; follows no symlink.
    Fallback,
}

/// Whether this kernel implements `openat2` (probed once).
pub fn openat2_available() -> bool {
    static PROBE: OnceLock<bool> = OnceLock::new();
    *PROBE.get_or_init(|| {
        let root = c"/";
        match sys_openat2(
            rustix::fs::CWD,
            root,
            libc::O_PATH | libc::O_CLOEXEC,
            0,
            libc::RESOLVE_NO_MAGICLINKS,
        ) {
            Ok(_) => true,
            Err(e) => {
                tracing::info!(
                    errno = e,
                    "openat2 unavailable; using openat(O_NOFOLLOW) walk"
                );
                false
            }
        }
    })
}

fn errno() -> i32 {
    std::io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO)
}

fn sys_openat2(
    dirfd: BorrowedFd<'_>,
    path: &CStr,
    flags: i32,
    mode: u32,
    resolve: u64,
) -> std::result::Result<OwnedFd, i32> {
    use rustix::fs::{Mode, OFlags, ResolveFlags};
    // The kernel refuses a mode without O_CREAT/O_TMPFILE.
    let mode = if flags & (libc::O_CREAT | libc::O_TMPFILE) != 0 {
        Mode::from_raw_mode(mode & 0o7777)
    } else {
        Mode::empty()
    };
    let oflags = OFlags::from_bits_retain(flags as u32);
    let resolve = ResolveFlags::from_bits_retain(resolve);
    for _ in 0..16 {
        match rustix::fs::openat2(dirfd, path, oflags, mode, resolve) {
            Ok(fd) => return Ok(fd),
            // EAGAIN: a concurrent rename/mount raced RESOLVE_BENEATH; retry.
            Err(e) if e == rustix::io::Errno::INTR || e == rustix::io::Errno::AGAIN => continue,
            Err(e) => return Err(e.raw_os_error()),
        }
    }
    Err(libc::EAGAIN)
}

fn sys_openat(
    dirfd: RawFd,
    name: &CStr,
    flags: i32,
    mode: u32,
) -> std::result::Result<OwnedFd, i32> {
    loop {
        // SAFETY: `name` is NUL-terminated; openat does not retain it.
        let r = unsafe { libc::openat(dirfd, name.as_ptr(), flags, mode & 0o7777) };
        if r >= 0 {
            // SAFETY: a fresh fd owned by nobody else.
            return Ok(unsafe { OwnedFd::from_raw_fd(r) });
        }
        let e = errno();
        if e != libc::EINTR {
            return Err(e);
        }
    }
}

fn fstat(fd: RawFd) -> std::result::Result<libc::stat, i32> {
    // SAFETY: stat is plain data; fstat fills it.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `st` is a valid out-pointer for the duration of the call.
    if unsafe { libc::fstat(fd, &mut st) } == 0 {
        Ok(st)
    } else {
        Err(errno())
    }
}

fn fstatat_nofollow(dirfd: RawFd, name: &CStr) -> std::result::Result<libc::stat, i32> {
    // SAFETY: as in `fstat`.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: valid NUL-terminated name and out-pointer.
    let r = unsafe { libc::fstatat(dirfd, name.as_ptr(), &mut st, libc::AT_SYMLINK_NOFOLLOW) };
    if r == 0 {
        Ok(st)
    } else {
        Err(errno())
    }
}

/// `/proc/self/fd/N`: names the inode behind `fd` for the calls that have
/// no fd form for O_PATH descriptors (chmod, reopening for writing).
fn proc_fd(fd: RawFd) -> CString {
    CString::new(format!("/proc/self/fd/{fd}")).expect("no NUL in a formatted number")
}

/// Reopen the inode behind an O_PATH `fd` with `flags`.
fn reopen(fd: RawFd, flags: i32) -> std::result::Result<OwnedFd, i32> {
    let p = proc_fd(fd);
    sys_openat(
        libc::AT_FDCWD,
        &p,
        flags | libc::O_CLOEXEC | libc::O_NOCTTY,
        0,
    )
}

fn cstr(s: &str) -> Result<CString> {
    CString::new(s).map_err(|_| Error::new(ErrorCode::BadRequest, "path contains a NUL byte"))
}

/// Split and check a client path (relative to the export root).
///
/// Rejects absolute paths and `..` ([`ErrorCode::OutsideExport`]), NUL bytes,
/// over-long paths and names; drops empty and `.` components.
pub fn split_rel_path(path: &str) -> Result<Vec<&str>> {
    if path.len() > MAX_PATH {
        return Err(Error::new(ErrorCode::NameTooLong, "path too long"));
    }
    if path.contains('\0') {
        return Err(Error::new(
            ErrorCode::BadRequest,
            "path contains a NUL byte",
        ));
    }
    if path.starts_with('/') {
        return Err(Error::new(
            ErrorCode::OutsideExport,
            format!("{path}: absolute paths are not allowed (paths are relative to the export)"),
        ));
    }
    let mut out = Vec::new();
    for c in path.split('/') {
        match c {
            "" | "." => {}
            ".." => {
                return Err(Error::new(
                    ErrorCode::OutsideExport,
                    format!("{path}: '..' is not allowed (paths cannot leave their export)"),
                ))
            }
            c if c.len() > MAX_NAME => {
                return Err(Error::new(
                    ErrorCode::NameTooLong,
                    format!("{path}: name too long"),
                ))
            }
            c => out.push(c),
        }
    }
    Ok(out)
}

/// A file opened beneath an export.
#[derive(Debug)]
pub struct OpenedFile {
    pub file: File,
    pub size: u64,
    /// Opened with `O_DIRECT`: offsets, lengths and buffer addresses must be
    /// multiples of `align`.
    pub direct: bool,
    pub align: u32,
    /// A memory object, not a file of the export.
    pub mem: Option<std::sync::Arc<crate::memobj::MemObj>>,
}

/// One export: a name and a directory fd everything is resolved beneath.
#[derive(Debug)]
pub struct Export {
    pub name: String,
    pub root: PathBuf,
    pub read_only: bool,
    /// Open regular files with `st_nlink > 1`.
    pub allow_hardlinks: bool,
    /// Whose ids the calls run as.
    pub identity: ids::Identity,
    /// Clients may create device nodes.
    pub allow_devices: bool,
    root_fd: OwnedFd,
    openat2: bool,
    /// Open files can be reopened by file handle (the mount id of the
    /// root), docs/descriptor-cache.md.
    handles: Option<i32>,
    /// The root opened for reading: `open_by_handle_at`'s mount fd (it
    /// refuses the O_PATH `root_fd` with EBADF).
    handle_root: Option<OwnedFd>,
}

impl Export {
    /// Open the export root. `mode` picks the resolver.
    pub fn open(spec: &ExportSpec, mode: ResolveMode) -> Result<Export> {
        validate_export_name(&spec.name).map_err(|m| Error::new(ErrorCode::InvalidArgument, m))?;
        let p = CString::new(spec.path.as_os_str().as_encoded_bytes()).map_err(|_| {
            Error::new(
                ErrorCode::InvalidArgument,
                "export path contains a NUL byte",
            )
        })?;
        let fd = sys_openat(
            libc::AT_FDCWD,
            &p,
            libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC,
            0,
        )
        .map_err(|e| {
            Error::from_errno(e, format!("export {}: {}", spec.name, spec.path.display()))
        })?;
        let openat2 = match mode {
            ResolveMode::Auto => openat2_available(),
            ResolveMode::Openat2 => {
                if !openat2_available() {
                    return Err(Error::new(
                        ErrorCode::Unsupported,
                        "openat2 is not available on this kernel",
                    ));
                }
                true
            }
            ResolveMode::Fallback => false,
        };
        let (handles, handle_root) = match fdcache::probe_handles(&spec.name, fd.as_raw_fd()) {
            Some((mount, dir)) => (Some(mount), Some(dir)),
            None => (None, None),
        };
        Ok(Export {
            name: spec.name.clone(),
            root: spec.path.clone(),
            read_only: spec.read_only,
            allow_hardlinks: spec.allow_hardlinks,
            identity: spec.identity.clone(),
            allow_devices: spec.allow_devices,
            root_fd: fd,
            openat2,
            handles,
            handle_root,
        })
    }

    /// The mount fd files of this export are reopened by handle with.
    fn handle_root_fd(&self) -> RawFd {
        self.handle_root
            .as_ref()
            .map_or(self.root_fd.as_raw_fd(), |d| d.as_raw_fd())
    }

    /// Whether open files of this export are reopened by file handle (else
    /// by path), docs/descriptor-cache.md.
    pub fn reopens_by_handle(&self) -> bool {
        self.handles.is_some()
    }

    /// Which resolver this export uses.
    pub fn resolve_mode(&self) -> ResolveMode {
        if self.openat2 {
            ResolveMode::Openat2
        } else {
            ResolveMode::Fallback
        }
    }

    fn describe(&self, comps: &[&str]) -> String {
        format!("{}/{}", self.name, comps.join("/"))
    }

    fn resolve_error(&self, errno: i32, comps: &[&str], dir: Option<RawFd>) -> Error {
        let what = self.describe(comps);
        match errno {
            libc::EXDEV if self.openat2 => Error::new(
                ErrorCode::OutsideExport,
                format!("{what}: resolves outside the export (a symlink leaves it)"),
            ),
            libc::ELOOP | libc::ENOTDIR if !self.openat2 => {
                // Was it a symlink the fallback refused to follow?
                if let (Some(d), Some(last)) = (dir, comps.last()) {
                    if let Ok(c) = CString::new(*last) {
                        if let Ok(st) = fstatat_nofollow(d, &c) {
                            if st.st_mode & libc::S_IFMT == libc::S_IFLNK {
                                return symlink_refused(&what);
                            }
                        }
                    }
                }
                Error::from_errno(errno, what)
            }
            _ => Error::from_errno(errno, what),
        }
    }

    /// Open `comps` (the export root if empty) with `flags`.
    fn resolve(&self, comps: &[&str], flags: i32, mode: u32) -> Result<OwnedFd> {
        let flags = if flags & libc::O_PATH != 0 {
            // openat2 rejects any other flag with O_PATH (EINVAL).
            flags & (libc::O_PATH | libc::O_DIRECTORY | libc::O_NOFOLLOW) | libc::O_CLOEXEC
        } else {
            flags | libc::O_CLOEXEC | libc::O_NOCTTY
        };
        if self.openat2 {
            let path = if comps.is_empty() {
                ".".to_string()
            } else {
                comps.join("/")
            };
            let c = cstr(&path)?;
            return sys_openat2(
                self.root_fd.as_fd(),
                &c,
                flags,
                mode,
                libc::RESOLVE_BENEATH | libc::RESOLVE_NO_MAGICLINKS,
            )
            .map_err(|e| self.resolve_error(e, comps, None));
        }
        let Some((last, dirs)) = comps.split_last() else {
            return sys_openat(self.root_fd.as_raw_fd(), c".", flags, mode)
                .map_err(|e| Error::from_errno(e, self.describe(comps)));
        };
        let mut cur: Option<OwnedFd> = None;
        for (i, d) in dirs.iter().enumerate() {
            let base = cur
                .as_ref()
                .map_or(self.root_fd.as_raw_fd(), |f| f.as_raw_fd());
            let c = cstr(d)?;
            let next = sys_openat(
                base,
                &c,
                libc::O_PATH | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC,
                0,
            )
            .map_err(|e| self.resolve_error(e, &comps[..=i], Some(base)))?;
            cur = Some(next);
        }
        let base = cur
            .as_ref()
            .map_or(self.root_fd.as_raw_fd(), |f| f.as_raw_fd());
        let c = cstr(last)?;
        let fd = sys_openat(base, &c, flags | libc::O_NOFOLLOW, mode)
            .map_err(|e| self.resolve_error(e, comps, Some(base)))?;
        if flags & libc::O_PATH != 0 {
            // O_PATH|O_NOFOLLOW opens a final symlink itself: refuse it.
            let st =
                fstat(fd.as_raw_fd()).map_err(|e| Error::from_errno(e, self.describe(comps)))?;
            if st.st_mode & libc::S_IFMT == libc::S_IFLNK {
                return Err(symlink_refused(&self.describe(comps)));
            }
        }
        Ok(fd)
    }

    /// The confined parent directory of `comps` and the final name.
    fn resolve_parent(&self, comps: &[&str]) -> Result<(OwnedFd, CString)> {
        let (last, dirs) = comps.split_last().ok_or_else(|| {
            Error::new(
                ErrorCode::BadRequest,
                format!("{}: not allowed on the export root", self.name),
            )
        })?;
        let dir = self.resolve(dirs, libc::O_PATH | libc::O_DIRECTORY, 0)?;
        Ok((dir, cstr(last)?))
    }

    fn check_writable(&self) -> Result<()> {
        if self.read_only {
            return Err(Error::new(
                ErrorCode::ReadOnly,
                format!("export {} is read-only", self.name),
            ));
        }
        Ok(())
    }

    /// Attributes of a path (symlinks inside the export are followed under
    /// the openat2 policy; the fallback refuses them).
    pub fn stat(&self, path: &str) -> Result<Attr> {
        let comps = split_rel_path(path)?;
        let fd = self.resolve(&comps, libc::O_PATH, 0)?;
        let st = fstat(fd.as_raw_fd()).map_err(|e| Error::from_errno(e, self.describe(&comps)))?;
        Ok(Attr::from_stat(&st))
    }

    /// List a directory, sorted by name. Entries are not followed: a symlink
    /// is listed as [`FileKind::Symlink`].
    pub fn list(&self, path: &str) -> Result<Vec<DirEntry>> {
        Ok(self
            .list_x(path)?
            .into_iter()
            .map(|(name, a)| DirEntry {
                name,
                attr: Attr {
                    kind: a.kind,
                    perm: a.perm,
                    size: a.size,
                    mtime_ns: a.mtime_ns,
                },
            })
            .collect())
    }

    /// [`Export::list`] with full attributes (lstat of each entry).
    pub fn list_x(&self, path: &str) -> Result<Vec<(String, AttrX)>> {
        let comps = split_rel_path(path)?;
        let fd = self.resolve(&comps, libc::O_RDONLY | libc::O_DIRECTORY, 0)?;
        let what = self.describe(&comps);
        let raw = fd.as_raw_fd();
        // SAFETY: fdopendir takes ownership of `raw` on success; we released
        // it from the OwnedFd only after success (below) so it is closed
        // exactly once (by closedir).
        let dir = unsafe { libc::fdopendir(raw) };
        if dir.is_null() {
            return Err(Error::from_errno(errno(), what));
        }
        let _ = std::os::fd::IntoRawFd::into_raw_fd(fd);
        struct DirGuard(*mut libc::DIR);
        impl Drop for DirGuard {
            fn drop(&mut self) {
                // SAFETY: the DIR came from a successful fdopendir and is
                // closed once, here.
                unsafe { libc::closedir(self.0) };
            }
        }
        let guard = DirGuard(dir);
        let mut out = Vec::new();
        loop {
            // SAFETY: errno is thread-local; resetting it lets us tell the end
            // of the stream from an error, as readdir(3) documents.
            unsafe { *libc::__errno_location() = 0 };
            // SAFETY: `guard.0` is a valid open DIR.
            let ent = unsafe { libc::readdir(guard.0) };
            if ent.is_null() {
                let e = errno();
                if e != 0 {
                    return Err(Error::from_errno(e, what));
                }
                break;
            }
            // SAFETY: readdir returned a valid dirent whose d_name is
            // NUL-terminated; we copy it before the next readdir call.
            let name = unsafe { CStr::from_ptr((*ent).d_name.as_ptr()) };
            let bytes = name.to_bytes();
            if bytes == b"." || bytes == b".." {
                continue;
            }
            let name = name.to_owned();
            // SAFETY: `guard.0` is a valid DIR; dirfd does not transfer ownership.
            let dfd = unsafe { libc::dirfd(guard.0) };
            let attr = match fstatat_nofollow(dfd, &name) {
                Ok(st) => AttrX::from_stat(&st),
                Err(_) => continue, // removed meanwhile
            };
            out.push((String::from_utf8_lossy(name.to_bytes()).into_owned(), attr));
        }
        drop(guard);
        out.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(out)
    }

    /// Create a directory (and its missing parents with `parents`).
    pub fn mkdir(&self, path: &str, mode: u32, parents: bool) -> Result<()> {
        self.check_writable()?;
        let comps = split_rel_path(path)?;
        if comps.is_empty() {
            return if parents {
                Ok(())
            } else {
                Err(Error::new(
                    ErrorCode::Exists,
                    format!("{}: export root exists", self.name),
                ))
            };
        }
        let start = if parents { 1 } else { comps.len() };
        for n in start..=comps.len() {
            let (dir, name) = self.resolve_parent(&comps[..n])?;
            // SAFETY: valid dirfd and NUL-terminated name.
            let r = unsafe {
                libc::mkdirat(
                    dir.as_raw_fd(),
                    name.as_ptr(),
                    (mode & 0o7777) as libc::mode_t,
                )
            };
            if r != 0 {
                let e = errno();
                let exists_as_dir = e == libc::EEXIST
                    && fstatat_nofollow(dir.as_raw_fd(), &name)
                        .map(|st| st.st_mode & libc::S_IFMT == libc::S_IFDIR)
                        .unwrap_or(false);
                if !(parents && exists_as_dir) {
                    return Err(Error::from_errno(e, self.describe(&comps[..n])));
                }
            }
        }
        Ok(())
    }

    /// Remove a file, a symlink or an empty directory.
    pub fn remove(&self, path: &str) -> Result<()> {
        self.check_writable()?;
        let comps = split_rel_path(path)?;
        let (dir, name) = self.resolve_parent(&comps)?;
        let st = fstatat_nofollow(dir.as_raw_fd(), &name)
            .map_err(|e| Error::from_errno(e, self.describe(&comps)))?;
        let flag = if st.st_mode & libc::S_IFMT == libc::S_IFDIR {
            rustix::fs::AtFlags::REMOVEDIR
        } else {
            rustix::fs::AtFlags::empty()
        };
        if let Err(e) = rustix::fs::unlinkat(&dir, name.as_c_str(), flag) {
            return Err(Error::from_errno(e.raw_os_error(), self.describe(&comps)));
        }
        Ok(())
    }

    /// Rename within the export. Without `replace`, an existing target fails
    /// with [`ErrorCode::Exists`].
    pub fn rename(&self, from: &str, to: &str, replace: bool) -> Result<()> {
        self.check_writable()?;
        let fc = split_rel_path(from)?;
        let tc = split_rel_path(to)?;
        let (fd, fname) = self.resolve_parent(&fc)?;
        let (td, tname) = self.resolve_parent(&tc)?;
        let flags = if replace { 0 } else { libc::RENAME_NOREPLACE };
        // SAFETY: valid dirfds and NUL-terminated names.
        let mut r = unsafe {
            libc::renameat2(
                fd.as_raw_fd(),
                fname.as_ptr(),
                td.as_raw_fd(),
                tname.as_ptr(),
                flags,
            )
        };
        if r != 0 && !replace && matches!(errno(), libc::EINVAL | libc::ENOSYS) {
            // Filesystem without RENAME_NOREPLACE: check, then rename (racy).
            if fstatat_nofollow(td.as_raw_fd(), &tname).is_ok() {
                return Err(Error::from_errno(libc::EEXIST, self.describe(&tc)));
            }
            // SAFETY: as above.
            r = unsafe {
                libc::renameat(
                    fd.as_raw_fd(),
                    fname.as_ptr(),
                    td.as_raw_fd(),
                    tname.as_ptr(),
                )
            };
        }
        if r != 0 {
            let e = errno();
            if e == libc::EXDEV {
                return Err(Error::new(
                    ErrorCode::Unsupported,
                    format!(
                        "{} -> {}: cannot rename across filesystems",
                        self.describe(&fc),
                        self.describe(&tc)
                    ),
                ));
            }
            return Err(Error::from_errno(
                e,
                format!("{} -> {}", self.describe(&fc), self.describe(&tc)),
            ));
        }
        Ok(())
    }

    /// Full attributes of a path; without `follow`, of a final symlink
    /// itself (lstat).
    pub fn statx(&self, path: &str, follow: bool) -> Result<AttrX> {
        let comps = split_rel_path(path)?;
        let st = if follow || comps.is_empty() {
            let fd = self.resolve(&comps, libc::O_PATH, 0)?;
            fstat(fd.as_raw_fd())
        } else {
            let (dir, name) = self.resolve_parent(&comps)?;
            fstatat_nofollow(dir.as_raw_fd(), &name)
        }
        .map_err(|e| Error::from_errno(e, self.describe(&comps)))?;
        Ok(AttrX::from_stat(&st))
    }

    /// Change attributes of a path, never through a final symbolic link
    /// (its own owner and times change; its mode cannot, as on Linux).
    pub fn set_attr(&self, path: &str, set: &SetAttr) -> Result<AttrX> {
        self.check_writable()?;
        let comps = split_rel_path(path)?;
        let what = self.describe(&comps);
        // The object itself, opened without following it: an O_PATH fd
        // pins the inode, so a concurrent rename or a symlink swapped in at
        // the name cannot redirect the changes below.
        let fd = if comps.is_empty() {
            self.resolve(&comps, libc::O_PATH, 0)?
        } else {
            let (dir, name) = self.resolve_parent(&comps)?;
            sys_openat(
                dir.as_raw_fd(),
                &name,
                libc::O_PATH | libc::O_NOFOLLOW | libc::O_CLOEXEC,
                0,
            )
            .map_err(|e| Error::from_errno(e, &what))?
        };
        let st = fstat(fd.as_raw_fd()).map_err(|e| Error::from_errno(e, &what))?;
        let is_link = st.st_mode & libc::S_IFMT == libc::S_IFLNK;
        if let Some(size) = set.size {
            // truncate(2) of the pinned inode: reopen it for writing
            // through /proc/self/fd (never a symlink: refused first).
            if st.st_mode & libc::S_IFMT != libc::S_IFREG {
                let e = if st.st_mode & libc::S_IFMT == libc::S_IFDIR {
                    libc::EISDIR
                } else {
                    libc::EINVAL
                };
                return Err(Error::from_errno(e, &what));
            }
            let w =
                reopen(fd.as_raw_fd(), libc::O_WRONLY).map_err(|e| Error::from_errno(e, &what))?;
            // SAFETY: plain syscall on an fd we own.
            if unsafe { libc::ftruncate(w.as_raw_fd(), size.min(i64::MAX as u64) as i64) } != 0 {
                return Err(Error::from_errno(errno(), &what));
            }
        }
        if let Some(mode) = set.mode {
            if is_link {
                return Err(Error::from_errno(libc::EOPNOTSUPP, &what));
            }
            // chmod(2) of the pinned inode: /proc/self/fd/N names it (the
            // magic link is followed to that inode, never by name).
            let p = proc_fd(fd.as_raw_fd());
            // SAFETY: valid NUL-terminated path.
            if unsafe { libc::chmod(p.as_ptr(), (mode & 0o7777) as libc::mode_t) } != 0 {
                return Err(Error::from_errno(errno(), &what));
            }
        }
        if set.uid.is_some() || set.gid.is_some() {
            let (u, g) = (set.uid.unwrap_or(u32::MAX), set.gid.unwrap_or(u32::MAX));
            // SAFETY: empty NUL-terminated path with AT_EMPTY_PATH acts on
            // the fd itself (the link itself for a symlink's O_PATH fd).
            let r = unsafe {
                libc::fchownat(
                    fd.as_raw_fd(),
                    c"".as_ptr(),
                    u,
                    g,
                    libc::AT_EMPTY_PATH | libc::AT_SYMLINK_NOFOLLOW,
                )
            };
            if r != 0 {
                return Err(Error::from_errno(errno(), &what));
            }
        }
        if set.atime.is_some() || set.mtime.is_some() {
            let ts = [timespec(set.atime), timespec(set.mtime)];
            let r = if comps.is_empty() {
                let p = proc_fd(fd.as_raw_fd());
                // SAFETY: valid path and a two-element timespec array.
                unsafe { libc::utimensat(libc::AT_FDCWD, p.as_ptr(), ts.as_ptr(), 0) }
            } else {
                // By name in the confined parent, never following it: the
                // name is the same object or a new one in that directory.
                let (dir, name) = self.resolve_parent(&comps)?;
                // SAFETY: valid dirfd, name and timespec array.
                unsafe {
                    libc::utimensat(
                        dir.as_raw_fd(),
                        name.as_ptr(),
                        ts.as_ptr(),
                        libc::AT_SYMLINK_NOFOLLOW,
                    )
                }
            };
            if r != 0 {
                return Err(Error::from_errno(errno(), &what));
            }
        }
        let st = fstat(fd.as_raw_fd()).map_err(|e| Error::from_errno(e, &what))?;
        Ok(AttrX::from_stat(&st))
    }

    /// Create a symbolic link at `path` holding `target` verbatim (the
    /// server never follows a link out of the export, §6).
    pub fn symlink(&self, path: &str, target: &str) -> Result<AttrX> {
        self.check_writable()?;
        let comps = split_rel_path(path)?;
        if target.is_empty() || target.len() > 4095 {
            return Err(Error::from_errno(
                if target.is_empty() {
                    libc::ENOENT
                } else {
                    libc::ENAMETOOLONG
                },
                self.describe(&comps),
            ));
        }
        let t = cstr(target)?;
        let (dir, name) = self.resolve_parent(&comps)?;
        // SAFETY: valid NUL-terminated strings and dirfd.
        if unsafe { libc::symlinkat(t.as_ptr(), dir.as_raw_fd(), name.as_ptr()) } != 0 {
            return Err(Error::from_errno(errno(), self.describe(&comps)));
        }
        let st = fstatat_nofollow(dir.as_raw_fd(), &name)
            .map_err(|e| Error::from_errno(e, self.describe(&comps)))?;
        Ok(AttrX::from_stat(&st))
    }

    /// Whether `set` only clears S_ISUID and S_ISGID of the file at
    /// `path` and the caller (the thread's ids) may write the file: what a
    /// client's kernel asks, with the writer's ids, before a write by
    /// someone other than the owner (file_remove_privs), and what the
    /// local kernel does for any writer (docs/mount.md, "Identities").
    pub fn only_kills_privileges(&self, path: &str, set: &SetAttr) -> Result<bool> {
        let Some(new) = set.mode else {
            return Ok(false);
        };
        if set.uid.is_some()
            || set.gid.is_some()
            || set.size.is_some()
            || set.atime.is_some()
            || set.mtime.is_some()
        {
            return Ok(false);
        }
        let cur = self.statx(path, false)?;
        let bits = libc::S_ISUID | libc::S_ISGID;
        if cur.kind != FileKind::File
            || new & !bits != cur.perm & !bits
            || new & bits & !(cur.perm & bits) != 0
            || new == cur.perm
        {
            return Ok(false);
        }
        let comps = split_rel_path(path)?;
        let (dir, name) = self.resolve_parent(&comps)?;
        Ok(rustix::fs::accessat(
            &dir,
            name.as_c_str(),
            rustix::fs::Access::WRITE_OK,
            rustix::fs::AtFlags::EACCESS | rustix::fs::AtFlags::SYMLINK_NOFOLLOW,
        )
        .is_ok())
    }

    /// mknod(2) at `path`: a FIFO or socket (or an empty regular file);
    /// a character or block device only where the export sets
    /// `allow_devices` (else `NotPermitted`, EPERM).
    pub fn mknod(&self, path: &str, mode: u32, rdev: u64) -> Result<AttrX> {
        self.check_writable()?;
        let comps = split_rel_path(path)?;
        match mode & libc::S_IFMT {
            libc::S_IFIFO | libc::S_IFSOCK | libc::S_IFREG => {}
            libc::S_IFCHR | libc::S_IFBLK if self.allow_devices => {}
            libc::S_IFCHR | libc::S_IFBLK => {
                return Err(Error::new(
                    ErrorCode::NotPermitted,
                    format!(
                        "{}: export {} does not allow device nodes (allow_devices)",
                        self.describe(&comps),
                        self.name
                    ),
                ))
            }
            _ => {
                return Err(Error::new(
                    ErrorCode::InvalidArgument,
                    format!("{}: mknod of mode {mode:#o}", self.describe(&comps)),
                ))
            }
        }
        let (dir, name) = self.resolve_parent(&comps)?;
        let mode = mode & (libc::S_IFMT | 0o7777);
        // SAFETY: a valid dirfd and NUL-terminated name; integers otherwise.
        if unsafe { libc::mknodat(dir.as_raw_fd(), name.as_ptr(), mode, rdev as libc::dev_t) } != 0
        {
            return Err(Error::from_errno(errno(), self.describe(&comps)));
        }
        let st = fstatat_nofollow(dir.as_raw_fd(), &name)
            .map_err(|e| Error::from_errno(e, self.describe(&comps)))?;
        Ok(AttrX::from_stat(&st))
    }

    /// The directory at `path`, opened for reading (what fanotify marks).
    pub fn open_dir(&self, path: &str) -> Result<OwnedFd> {
        let comps = split_rel_path(path)?;
        self.resolve(&comps, libc::O_RDONLY | libc::O_DIRECTORY, 0)
    }

    /// fsync(2) of the directory at `path`: the names created, removed
    /// and renamed in it are on disk when this returns.
    pub fn fsync_dir(&self, path: &str) -> Result<()> {
        let comps = split_rel_path(path)?;
        let fd = self.resolve(&comps, libc::O_RDONLY | libc::O_DIRECTORY, 0)?;
        // SAFETY: a valid descriptor we own.
        if unsafe { libc::fsync(fd.as_raw_fd()) } != 0 {
            return Err(Error::from_errno(errno(), self.describe(&comps)));
        }
        Ok(())
    }

    /// The target of the symbolic link at `path`.
    pub fn readlink(&self, path: &str) -> Result<String> {
        let comps = split_rel_path(path)?;
        let (dir, name) = self.resolve_parent(&comps)?;
        let mut buf = vec![0u8; 4096];
        // SAFETY: valid dirfd and name; the buffer has buf.len() bytes.
        let n = unsafe {
            libc::readlinkat(
                dir.as_raw_fd(),
                name.as_ptr(),
                buf.as_mut_ptr().cast(),
                buf.len(),
            )
        };
        if n < 0 {
            return Err(Error::from_errno(errno(), self.describe(&comps)));
        }
        buf.truncate(n as usize);
        Ok(String::from_utf8_lossy(&buf).into_owned())
    }

    /// A hard link `to` of the file `from`. Only where the export allows
    /// hard links: elsewhere a second name makes the file unopenable (§6).
    pub fn link(&self, from: &str, to: &str) -> Result<AttrX> {
        self.check_writable()?;
        let fc = split_rel_path(from)?;
        let tc = split_rel_path(to)?;
        if !self.allow_hardlinks {
            return Err(Error::from_errno(
                libc::EPERM,
                format!(
                    "{}: hard links are refused on export {} (set allow_hardlinks on the export to permit)",
                    self.describe(&tc),
                    self.name
                ),
            ));
        }
        let (fd, fname) = self.resolve_parent(&fc)?;
        let (td, tname) = self.resolve_parent(&tc)?;
        // SAFETY: valid dirfds and NUL-terminated names; flags 0: a final
        // symlink is linked itself, never followed.
        let r = unsafe {
            libc::linkat(
                fd.as_raw_fd(),
                fname.as_ptr(),
                td.as_raw_fd(),
                tname.as_ptr(),
                0,
            )
        };
        let what = format!("{} -> {}", self.describe(&fc), self.describe(&tc));
        if r != 0 {
            return Err(Error::from_errno(errno(), what));
        }
        let st =
            fstatat_nofollow(td.as_raw_fd(), &tname).map_err(|e| Error::from_errno(e, &what))?;
        Ok(AttrX::from_stat(&st))
    }

    /// statvfs(3) of the export's file system.
    pub fn statfs(&self) -> Result<StatFs> {
        // SAFETY: statvfs is plain data that fstatvfs fills.
        let mut v: libc::statvfs = unsafe { std::mem::zeroed() };
        // SAFETY: valid fd and out-pointer.
        if unsafe { libc::fstatvfs(self.root_fd.as_raw_fd(), &mut v) } != 0 {
            return Err(Error::from_errno(errno(), &self.name));
        }
        Ok(StatFs {
            bsize: v.f_bsize as u32,
            frsize: v.f_frsize as u32,
            blocks: v.f_blocks,
            bfree: v.f_bfree,
            bavail: v.f_bavail,
            files: v.f_files,
            ffree: v.f_ffree,
            namelen: v.f_namemax as u32,
        })
    }

    /// unlink(2) ([`RemoveKind::NotDir`]) or rmdir(2) ([`RemoveKind::Dir`])
    /// with the OS's own errors; [`RemoveKind::Any`] is [`Export::remove`].
    pub fn remove_kind(&self, path: &str, kind: RemoveKind) -> Result<()> {
        let flag = match kind {
            RemoveKind::Any => return self.remove(path),
            RemoveKind::NotDir => rustix::fs::AtFlags::empty(),
            RemoveKind::Dir => rustix::fs::AtFlags::REMOVEDIR,
        };
        self.check_writable()?;
        let comps = split_rel_path(path)?;
        let (dir, name) = self.resolve_parent(&comps)?;
        if let Err(e) = rustix::fs::unlinkat(&dir, name.as_c_str(), flag) {
            return Err(Error::from_errno(e.raw_os_error(), self.describe(&comps)));
        }
        Ok(())
    }

    /// renameat2(2) with `flags` (RENAME_NOREPLACE, RENAME_EXCHANGE).
    pub fn rename_flags(&self, from: &str, to: &str, flags: u32) -> Result<()> {
        self.check_writable()?;
        let fc = split_rel_path(from)?;
        let tc = split_rel_path(to)?;
        let (fd, fname) = self.resolve_parent(&fc)?;
        let (td, tname) = self.resolve_parent(&tc)?;
        let mut f = 0;
        if flags & lwio_side::types::RENAME_NOREPLACE != 0 {
            f |= libc::RENAME_NOREPLACE;
        }
        if flags & lwio_side::types::RENAME_EXCHANGE != 0 {
            f |= libc::RENAME_EXCHANGE;
        }
        // SAFETY: valid dirfds and NUL-terminated names.
        let r = unsafe {
            libc::renameat2(
                fd.as_raw_fd(),
                fname.as_ptr(),
                td.as_raw_fd(),
                tname.as_ptr(),
                f,
            )
        };
        if r != 0 {
            let e = errno();
            let what = format!("{} -> {}", self.describe(&fc), self.describe(&tc));
            if e == libc::EXDEV {
                return Err(Error::new(
                    ErrorCode::Unsupported,
                    format!("{what}: cannot rename across filesystems"),
                ));
            }
            return Err(Error::from_errno(e, what));
        }
        Ok(())
    }

    /// Open (or create) a regular file (or a FIFO, under
    /// [`serve_fifos_for_tests`]).
    pub fn open_file(&self, path: &str, o: &OpenOptions, mode: u32) -> Result<OpenedFile> {
        let comps = split_rel_path(path)?;
        if o.write || o.create || o.truncate {
            self.check_writable()?;
        }
        if (o.create || o.truncate) && !o.write {
            return Err(Error::new(
                ErrorCode::InvalidArgument,
                "create and truncate need write access",
            ));
        }
        if !o.read && !o.write {
            return Err(Error::new(
                ErrorCode::InvalidArgument,
                "open needs read and/or write access",
            ));
        }
        if comps.is_empty() {
            return Err(Error::new(
                ErrorCode::IsADirectory,
                format!("{}: is the export root", self.name),
            ));
        }
        let mut flags = match (o.read, o.write) {
            (true, true) => libc::O_RDWR,
            (false, true) => libc::O_WRONLY,
            _ => libc::O_RDONLY,
        };
        if o.create {
            flags |= libc::O_CREAT;
            if o.exclusive {
                flags |= libc::O_EXCL;
            }
        }
        // O_TRUNC is not passed: truncation happens below, once the file is
        // known to be acceptable (a refused hard link must stay untouched).
        if o.no_buffering {
            flags |= libc::O_DIRECT;
        }
        if o.write_through {
            flags |= libc::O_DSYNC;
        }
        if o.sync {
            flags |= libc::O_SYNC;
        }
        // O_NONBLOCK: never hang on a FIFO planted in the export.
        let fd = match self.resolve(&comps, flags | libc::O_NONBLOCK, mode) {
            Err(e) if o.no_buffering && e.code == ErrorCode::InvalidArgument => {
                return Err(Error::new(
                    ErrorCode::Unsupported,
                    format!(
                        "{}: the filesystem does not support unbuffered (O_DIRECT) I/O",
                        self.describe(&comps)
                    ),
                ))
            }
            r => r?,
        };
        let st = fstat(fd.as_raw_fd()).map_err(|e| Error::from_errno(e, self.describe(&comps)))?;
        match st.st_mode & libc::S_IFMT {
            libc::S_IFREG => {}
            libc::S_IFIFO if serve_fifos() => {}
            libc::S_IFDIR => return Err(Error::from_errno(libc::EISDIR, self.describe(&comps))),
            _ => {
                return Err(Error::new(
                    ErrorCode::InvalidArgument,
                    format!("{}: not a regular file", self.describe(&comps)),
                ))
            }
        }
        if st.st_nlink > 1 && !self.allow_hardlinks {
            return Err(Error::new(
                ErrorCode::PermissionDenied,
                format!(
                    "{} is hard-linked ({} links); refused: set allow_hardlinks on the export to permit",
                    self.describe(&comps),
                    st.st_nlink
                ),
            ));
        }
        let mut size = st.st_size.max(0) as u64;
        if o.truncate && size != 0 {
            // SAFETY: ftruncate on an fd we own.
            if unsafe { libc::ftruncate(fd.as_raw_fd(), 0) } != 0 {
                return Err(Error::from_errno(errno(), self.describe(&comps)));
            }
            size = 0;
        }
        // SAFETY: fcntl on an fd we own, with integer arguments.
        unsafe {
            let fl = libc::fcntl(fd.as_raw_fd(), libc::F_GETFL);
            if fl >= 0 {
                libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, fl & !libc::O_NONBLOCK);
            }
        }
        let align = if o.no_buffering {
            dio_align(fd.as_raw_fd())
        } else {
            1
        };
        Ok(OpenedFile {
            file: File::from(fd),
            size,
            direct: o.no_buffering,
            align,
            mem: None,
        })
    }
}

fn symlink_refused(what: &str) -> Error {
    Error::new(
        ErrorCode::OutsideExport,
        format!(
            "{what}: is a symbolic link, which this server does not follow (openat2 unavailable)"
        ),
    )
}

/// O_DIRECT alignment for an open file: statx(STATX_DIOALIGN), else 4096.
fn dio_align(fd: RawFd) -> u32 {
    // SAFETY: statx is plain data; all-zero is valid.
    let mut stx: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: empty path with AT_EMPTY_PATH stats `fd`; `stx` is a valid out-pointer.
    let r = unsafe {
        libc::statx(
            fd,
            c"".as_ptr(),
            libc::AT_EMPTY_PATH,
            libc::STATX_DIOALIGN,
            &mut stx,
        )
    };
    if r == 0 && stx.stx_mask & libc::STATX_DIOALIGN != 0 {
        let a = stx.stx_dio_offset_align.max(stx.stx_dio_mem_align);
        if a.is_power_of_two() {
            return a;
        }
    }
    4096
}

/// The set of exports, by name.
#[derive(Debug, Default)]
pub struct Exports {
    map: BTreeMap<String, Arc<Export>>,
}

impl Exports {
    /// Open every export root; fails on duplicates or unusable roots.
    pub fn open(specs: &[ExportSpec], mode: ResolveMode) -> Result<Exports> {
        let mut map = BTreeMap::new();
        for s in specs {
            if map.contains_key(&s.name) {
                return Err(Error::new(
                    ErrorCode::InvalidArgument,
                    format!("export {} is defined twice", s.name),
                ));
            }
            if s.identity.mode == ids::IdentityMode::Client && !ids::can_switch() {
                return Err(Error::new(
                    ErrorCode::PermissionDenied,
                    format!(
                        "export {}: identity = \"client\" needs a server that may act as other users (root, or CAP_SETUID and CAP_SETGID); use identity = \"server\" otherwise",
                        s.name
                    ),
                ));
            }
            map.insert(s.name.clone(), Arc::new(Export::open(s, mode)?));
        }
        Ok(Exports { map })
    }

    /// An export by name, or [`ErrorCode::NoSuchExport`].
    pub fn get(&self, name: &str) -> Result<&Arc<Export>> {
        self.map.get(name).ok_or_else(|| {
            Error::new(
                ErrorCode::NoSuchExport,
                format!("no export named {name:?} on this server"),
            )
        })
    }

    pub fn iter(&self) -> impl Iterator<Item = &Arc<Export>> {
        self.map.values()
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}

#[cfg(test)]
mod tests;
