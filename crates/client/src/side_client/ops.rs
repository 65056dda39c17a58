//! The client's request table: one entry per plain operation gives both
//! [`AsyncSideClient`]'s method and [`SideClient`]'s blocking wrapper (see "How to
//! add an operation" in docs/side-channel.md).
//!
//! An entry is `fn name(arg: Type, ...) -> Out = REQUEST => PATTERN => VALUE;`:
//! the method sends `REQUEST`, answers `VALUE` when the response matches
//! `PATTERN`, and any other response is an error. Operations that do more
//! (paging, handles, watch connections, the pipe) are written out in
//! `side.rs`.

use super::{unexpected, AsyncSideClient, SideClient};
use lwio_side::codec::{Request, Response};
use lwio_side::error::Result;
use lwio_side::types::{Attr, AttrX, RemoveKind, SetAttr, StatFs};
use tokio::io::{AsyncRead, AsyncWrite};

macro_rules! client_ops {
    ($(
        $(#[$doc:meta])*
        fn $m:ident($($a:ident : $at:ty),* $(,)?) -> $ret:ty = $req:expr => $pat:pat => $out:expr;
    )*) => {
        impl<S: AsyncRead + AsyncWrite + Unpin + Send> AsyncSideClient<S> {
            $(
                $(#[$doc])*
                pub async fn $m(&mut self, $($a: $at),*) -> Result<$ret> {
                    match self.call($req).await? {
                        $pat => Ok($out),
                        r => Err(unexpected(&r)),
                    }
                }
            )*
        }

        impl SideClient {
            $(
                $(#[$doc])*
                pub fn $m(&mut self, $($a: $at),*) -> Result<$ret> {
                    self.rt.block_on(self.inner.$m($($a),*))
                }
            )*
        }
    };
}

client_ops! {
    fn ping() -> () = Request::Ping => Response::Ok => ();
    fn list_exports() -> Vec<lwio_side::codec::ExportInfo> =
        Request::ListExports => Response::Exports(v) => v;
    fn stat(export: &str, path: &str) -> Attr = Request::Stat {
        export: export.into(),
        path: path.into(),
    } => Response::Attr(a) => a;
    fn close(handle: u64) -> () = Request::Close { handle } => Response::Ok => ();
    /// Remove a file, symlink or empty directory.
    fn remove(export: &str, path: &str) -> () = Request::Remove {
        export: export.into(),
        path: path.into(),
    } => Response::Ok => ();
    fn rename(export: &str, from: &str, to: &str, replace: bool) -> () = Request::Rename {
        export: export.into(),
        from: from.into(),
        to: to.into(),
        replace,
    } => Response::Ok => ();
    fn mkdir(export: &str, path: &str, mode: u32, parents: bool) -> () = Request::Mkdir {
        export: export.into(),
        path: path.into(),
        mode,
        parents,
    } => Response::Ok => ();
    /// Truncate or extend an open file.
    fn set_size(handle: u64, size: u64) -> () =
        Request::SetSize { handle, size } => Response::Ok => ();
    fn fsync(handle: u64, data_only: bool) -> () =
        Request::Fsync { handle, data_only } => Response::Ok => ();
    /// Full attributes of a path (`follow` = false: lstat).
    fn statx(export: &str, path: &str, follow: bool) -> AttrX = Request::StatX {
        export: export.into(),
        path: path.into(),
        follow,
    } => Response::AttrX(a) => a;
    /// Full attributes of an open file (fstat).
    fn stat_handle(handle: u64) -> AttrX =
        Request::StatHandle { handle } => Response::AttrX(a) => a;
    /// chmod, chown, truncate, utimens of a path (never through a final
    /// symlink); the attributes after the change.
    fn set_attr(export: &str, path: &str, set: &SetAttr) -> AttrX = Request::SetAttr {
        export: export.into(),
        path: path.into(),
        set: *set,
    } => Response::AttrX(a) => a;
    /// The same on an open file.
    fn set_attr_handle(handle: u64, set: &SetAttr) -> AttrX =
        Request::SetAttrHandle { handle, set: *set } => Response::AttrX(a) => a;
    /// A hard link `to` of `from` (where the export allows hard links).
    fn link(export: &str, from: &str, to: &str) -> AttrX = Request::Link {
        export: export.into(),
        from: from.into(),
        to: to.into(),
    } => Response::AttrX(a) => a;
    /// fallocate(2) on an open file (`codec::FALLOC_KNOWN` mode bits).
    fn fallocate(handle: u64, mode: u32, offset: u64, len: u64) -> () = Request::Fallocate {
        handle,
        mode,
        offset,
        len,
    } => Response::Ok => ();
    /// lseek(2) SEEK_DATA / SEEK_HOLE (`codec::SEEK_DATA`, `codec::SEEK_HOLE`).
    fn seek(handle: u64, offset: u64, whence: u8) -> u64 = Request::Seek {
        handle,
        offset,
        whence,
    } => Response::Offset(o) => o;
    /// Take or release a POSIX byte-range lock for `owner` (`kind` 0 unlock,
    /// 1 read, 2 write; `len` 0 = to the end); a conflict is `Locked`.
    fn lock(handle: u64, owner: u64, kind: u8, start: u64, len: u64) -> () = Request::Lock {
        handle,
        owner,
        kind,
        start,
        len,
        test: false,
    } => Response::Ok => ();
    /// The lock that would conflict with this one: (kind, start, len), or
    /// None.
    fn test_lock(
        handle: u64,
        owner: u64,
        kind: u8,
        start: u64,
        len: u64,
    ) -> Option<(u8, u64, u64)> = Request::Lock {
        handle,
        owner,
        kind,
        start,
        len,
        test: true,
    } => Response::LockInfo { kind, start, len } => (kind != 0).then_some((kind, start, len));
    /// Ask for a lease on directory `path` (`want`: [`LEASE_READ`] |
    /// [`LEASE_HANDLE`]): (lease id, granted kinds); (0, 0) when refused.
    /// Only a session with a watching connection ([`AsyncSideClient::watch`])
    /// is granted leases (docs/leases.md).
    ///
    /// [`LEASE_READ`]: lwio_side::codec::LEASE_READ
    /// [`LEASE_HANDLE`]: lwio_side::codec::LEASE_HANDLE
    fn lease_dir(export: &str, path: &str, want: u8) -> (u64, u8) = Request::LeaseDir {
        export: export.into(),
        path: path.into(),
        want,
    } => Response::LeaseGranted { lease_id, granted } => (lease_id, granted);
    /// Give a lease back.
    fn release_lease(lease_id: u64) -> () =
        Request::ReleaseLease { lease_id } => Response::Ok => ();
    /// Copy up to 64 MiB between two open files on the server; the bytes
    /// copied (0 at the source's end).
    fn copy_range(src: u64, src_offset: u64, dst: u64, dst_offset: u64, len: u64) -> u64 =
        Request::CopyRange {
            src,
            src_offset,
            dst,
            dst_offset,
            len,
        } => Response::Copied(n) => n;
    /// Create a symbolic link `path` → `target`.
    fn symlink(export: &str, path: &str, target: &str) -> AttrX = Request::Symlink {
        export: export.into(),
        path: path.into(),
        target: target.into(),
    } => Response::AttrX(a) => a;
    /// mknod(2): a FIFO, socket or (where the export allows) device node.
    fn mknod(export: &str, path: &str, mode: u32, rdev: u64) -> AttrX = Request::Mknod {
        export: export.into(),
        path: path.into(),
        mode,
        rdev,
    } => Response::AttrX(a) => a;
    /// fsync(2) of a directory on the server.
    fn fsync_dir(export: &str, path: &str) -> () = Request::FsyncDir {
        export: export.into(),
        path: path.into(),
    } => Response::Ok => ();
    fn readlink(export: &str, path: &str) -> String = Request::Readlink {
        export: export.into(),
        path: path.into(),
    } => Response::Target(t) => t;
    /// The server's metrics, OpenMetrics text (docs/metrics.md).
    fn stats() -> String = Request::Stats => Response::Metrics(t) => t;
    fn statfs(export: &str) -> StatFs = Request::Statfs {
        export: export.into(),
    } => Response::StatFs(f) => f;
    /// unlink(2) or rmdir(2) semantics ([`RemoveKind`]).
    fn remove_kind(export: &str, path: &str, kind: RemoveKind) -> () = Request::Remove2 {
        export: export.into(),
        path: path.into(),
        kind,
    } => Response::Ok => ();
    /// renameat2(2) flags: `types::RENAME_NOREPLACE`, `types::RENAME_EXCHANGE`.
    fn rename_flags(export: &str, from: &str, to: &str, flags: u32) -> () = Request::Rename2 {
        export: export.into(),
        from: from.into(),
        to: to.into(),
        flags,
    } => Response::Ok => ();
}
