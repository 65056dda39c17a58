//! `lwio mount` end to end: a real server (side channel + soft RDMA on
//! loopback), a real FUSE mount in a temporary directory, and plain std::fs
//! calls on it, as any program would make them. Contents are compared byte
//! for byte with the server's directory, and failures by their exact errno.
//!
//! These tests need /dev/fuse, and root or fusermount3 (Debian `fuse3`;
//! .ci/run installs it): as root the mount is a plain mount(2). Without
//! them they fail: a skipped mount test is not a pass.

mod common;

use std::fs;
use std::io::{ErrorKind, Seek, SeekFrom, Write};
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;
use std::time::Duration;

use lwio_client::{Client, ClientOptions, Completion};
use lwio_mount::{MountConfig, Mounted};
use lwio_rdma::conformance::pattern;
use lwio_server::config::Limits;
use lwio_server::io_phase::driver::RdmaServerOptions;
use lwio_server::io_phase::testkit::LocalServer;

const TOKEN: &str = "mount-test-token-0123456789";

fn require_fuse() {
    assert!(
        Path::new("/dev/fuse").exists(),
        "/dev/fuse is missing: the mount tests need FUSE (apt-get install fuse3)"
    );
}

struct Fixture {
    server: LocalServer,
    dir: tempfile::TempDir,
    mnt: tempfile::TempDir,
}

impl Fixture {
    fn new() -> Fixture {
        Fixture::with_limits(Limits::default())
    }

    fn with_limits(limits: Limits) -> Fixture {
        require_fuse();
        common::init_logging();
        let dir = tempfile::tempdir().unwrap();
        fs::create_dir(dir.path().join("export")).unwrap();
        let server = LocalServer::start(
            &dir.path().join("export"),
            "ex",
            TOKEN,
            limits,
            RdmaServerOptions::default(),
        )
        .expect("server starts");
        let mnt = tempfile::tempdir().unwrap();
        Fixture { server, dir, mnt }
    }

    fn client(&self) -> Client {
        let opts = ClientOptions {
            completion: Completion::Interrupt,
            op_timeout: Duration::from_secs(20),
            ..ClientOptions::default()
        };
        Client::connect(
            &self.server.side_addr.to_string(),
            Some(TOKEN),
            opts.no_tls(),
        )
        .expect("client connects")
    }

    fn mount(&self, cfg: &MountConfig) -> Mounted {
        self.mount_at(self.mnt.path(), "", cfg)
    }

    /// Two mounts of the export with default options: two clients.
    fn two_mounts(&self) -> (Mounted, Mounted, tempfile::TempDir) {
        let b_dir = tempfile::tempdir().unwrap();
        let a = self.mount(&MountConfig::default());
        let b = self.mount_at(b_dir.path(), "", &MountConfig::default());
        (a, b, b_dir)
    }

    fn mount_at(&self, at: &Path, subdir: &str, cfg: &MountConfig) -> Mounted {
        lwio_mount::mount(self.client(), "ex", subdir, at, cfg).expect("mounts")
    }

    /// The server's copy of `rel`.
    fn srv(&self, rel: &str) -> std::path::PathBuf {
        self.dir.path().join("export").join(rel)
    }

    fn m(&self, rel: &str) -> std::path::PathBuf {
        self.mnt.path().join(rel)
    }
}

/// A file system of type `fstype` mounted on `at` (the mount tests run as
/// root), detached when the guard drops.
struct Umount(std::ffi::CString);

impl Drop for Umount {
    fn drop(&mut self) {
        // SAFETY: a valid NUL-terminated path.
        unsafe { libc::umount2(self.0.as_ptr(), libc::MNT_DETACH) };
    }
}

fn mount_fs(fstype: &std::ffi::CStr, at: &Path) -> Umount {
    let c = std::ffi::CString::new(at.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: valid NUL-terminated strings; no data argument.
    let r = unsafe {
        libc::mount(
            fstype.as_ptr(),
            c.as_ptr(),
            fstype.as_ptr(),
            0,
            std::ptr::null(),
        )
    };
    assert_eq!(
        r,
        0,
        "mounting a {fstype:?} on {}: {}",
        at.display(),
        std::io::Error::last_os_error()
    );
    Umount(c)
}

fn errno(e: std::io::Error) -> i32 {
    e.raw_os_error()
        .unwrap_or_else(|| panic!("not an OS error: {e}"))
}

fn is_mountpoint(p: &Path) -> bool {
    let parent = p.parent().unwrap();
    fs::metadata(p).map(|m| m.dev()).ok() != fs::metadata(parent).map(|m| m.dev()).ok()
}

#[test]
fn files_written_and_read_through_the_mount_are_byte_exact() {
    let f = Fixture::new();
    let m = f.mount(&MountConfig::default());
    assert!(is_mountpoint(f.mnt.path()));

    // Written through the mount: the server's file has the same bytes.
    let big = pattern(7, 5 * 1024 * 1024 + 12_345);
    fs::write(f.m("big.bin"), &big).unwrap();
    assert_eq!(fs::read(f.srv("big.bin")).unwrap(), big);
    // Written on the server: the mount reads the same bytes.
    let other = pattern(9, 3 * 1024 * 1024 + 1);
    fs::write(f.srv("server.bin"), &other).unwrap();
    assert_eq!(fs::read(f.m("server.bin")).unwrap(), other);

    // pwrite/pread at odd offsets, past the end (a hole reads as zeros).
    let h = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(f.m("big.bin"))
        .unwrap();
    h.write_all_at(b"middle", 1_000_003).unwrap();
    h.write_all_at(b"tail", big.len() as u64 + 4096).unwrap();
    h.sync_all().unwrap();
    let mut want = big.clone();
    want[1_000_003..1_000_009].copy_from_slice(b"middle");
    want.resize(big.len() + 4096, 0);
    want.extend_from_slice(b"tail");
    assert_eq!(fs::read(f.srv("big.bin")).unwrap(), want);
    let mut got = vec![0u8; 10];
    h.read_exact_at(&mut got, 1_000_000).unwrap();
    assert_eq!(&got, &want[1_000_000..1_000_010]);
    // Truncate through an open handle and by path.
    h.set_len(100).unwrap();
    drop(h);
    assert_eq!(fs::read(f.srv("big.bin")).unwrap(), &want[..100]);
    fs::OpenOptions::new()
        .write(true)
        .truncate(true)
        .open(f.m("big.bin"))
        .unwrap();
    assert_eq!(fs::metadata(f.srv("big.bin")).unwrap().len(), 0);

    // Append mode.
    let mut a = fs::OpenOptions::new()
        .append(true)
        .create(true)
        .open(f.m("log.txt"))
        .unwrap();
    a.write_all(b"one\n").unwrap();
    a.write_all(b"two\n").unwrap();
    drop(a);
    assert_eq!(fs::read(f.srv("log.txt")).unwrap(), b"one\ntwo\n");

    // O_DIRECT opens and moves the same bytes with aligned offsets and
    // lengths, as on a local disk (tmpfs may refuse O_DIRECT: then the
    // exact errno is EINVAL, as on a local tmpfs).
    match fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(f.m("server.bin"))
    {
        Ok(d) => {
            // A page-aligned buffer, as O_DIRECT wants of any file system.
            let mut raw = vec![0u8; (1 << 20) + 4096];
            let at = raw.as_ptr().align_offset(4096);
            let v = &mut raw[at..at + (1 << 20)];
            let mut got = Vec::new();
            loop {
                let n = d.read_at(v, got.len() as u64).unwrap();
                got.extend_from_slice(&v[..n]);
                if n < v.len() {
                    break;
                }
            }
            assert_eq!(got, other);
        }
        Err(e) => assert_eq!(errno(e), libc::EINVAL),
    }

    // Sizes and kinds as the server sees them.
    let md = fs::metadata(f.m("server.bin")).unwrap();
    assert_eq!(md.len(), other.len() as u64);
    assert!(md.is_file());
    assert!(fs::metadata(f.mnt.path()).unwrap().is_dir());

    m.unmount().unwrap();
    assert!(!is_mountpoint(f.mnt.path()));
    // Nothing written was lost by the unmount.
    assert_eq!(fs::read(f.srv("log.txt")).unwrap(), b"one\ntwo\n");
}

/// An export's file system without O_DIRECT (ramfs; tmpfs before Linux
/// 6.6): an O_DIRECT open through the mount fails as the local open does,
/// EINVAL, not EIO, and a buffered open of the same file still reads it.
#[test]
fn o_direct_on_a_file_system_without_it_is_einval_as_locally() {
    let f = Fixture::new();
    let ram = f.srv("ram");
    fs::create_dir(&ram).unwrap();
    let _u = mount_fs(c"ramfs", &ram);
    fs::write(ram.join("f"), b"ramfs bytes").unwrap();
    let direct = |p: &Path| {
        fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECT)
            .open(p)
            .map(|_| ())
            .map_err(errno)
    };
    // The referee: the local open.
    assert_eq!(direct(&ram.join("f")), Err(libc::EINVAL));
    let m = f.mount(&MountConfig::default());
    assert_eq!(direct(&f.m("ram/f")), Err(libc::EINVAL));
    assert_eq!(fs::read(f.m("ram/f")).unwrap(), b"ramfs bytes");
    drop(m);
}

#[test]
fn directories_listing_rename_and_exact_errnos() {
    let f = Fixture::new();
    // Files are added below straight into the server's directory, past
    // lwio: only a mount without leases sees such changes at once (with
    // leases, after lease_timeout; see the test after the lease test).
    let _m = f.mount(&MountConfig {
        leases: false,
        ..MountConfig::default()
    });
    let _m = &_m;

    fs::create_dir(f.m("d")).unwrap();
    fs::create_dir(f.m("d/e")).unwrap();
    fs::write(f.m("d/e/x"), b"x").unwrap();
    assert!(f.srv("d/e/x").is_file());
    let mut names: Vec<_> = fs::read_dir(f.m("d"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(names, ["e"]);
    // A listing of many entries (several readdir calls) is complete.
    for i in 0..300 {
        fs::write(f.srv(&format!("d/f{i:03}")), i.to_string()).unwrap();
    }
    // `ls -l` of 301 entries: the listing carries their attributes
    // (readdirplus), so the sizes come with no round trip per entry.
    let st = _m.stats().clone();
    let calls = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
    let (side0, lookups0) = (calls(&st.side_calls), calls(&st.lookups));
    let mut n = 0;
    for e in fs::read_dir(f.m("d")).unwrap() {
        let e = e.unwrap();
        let md = e.metadata().unwrap();
        let name = e.file_name().into_string().unwrap();
        if let Some(i) = name.strip_prefix('f') {
            assert_eq!(md.len(), i.parse::<u64>().unwrap().to_string().len() as u64);
        }
        n += 1;
    }
    assert_eq!(n, 301);
    let (side, lookups) = (calls(&st.side_calls) - side0, calls(&st.lookups) - lookups0);
    assert!(
        side < 10 && lookups < 5,
        "ls -l of 301 entries took {side} side-channel calls and {lookups} lookups"
    );
    assert_eq!(fs::read_to_string(f.m("d/f123")).unwrap(), "123");

    // Rename a directory: what was beneath it follows.
    fs::rename(f.m("d/e"), f.m("d/g")).unwrap();
    assert_eq!(fs::read(f.m("d/g/x")).unwrap(), b"x");
    assert!(f.srv("d/g/x").is_file() && !f.srv("d/e").exists());
    // Rename a file over another: replaced.
    fs::write(f.m("a"), b"A").unwrap();
    fs::write(f.m("b"), b"B").unwrap();
    fs::rename(f.m("a"), f.m("b")).unwrap();
    assert_eq!(fs::read(f.srv("b")).unwrap(), b"A");
    assert!(!f.srv("a").exists());

    // The exact errno of each failure.
    let e = |r: std::io::Result<()>| errno(r.unwrap_err());
    assert_eq!(e(fs::read(f.m("nope")).map(drop)), libc::ENOENT);
    assert_eq!(e(fs::create_dir(f.m("d"))), libc::EEXIST);
    assert_eq!(
        e(fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(f.m("b"))
            .map(drop)),
        libc::EEXIST
    );
    assert_eq!(e(fs::remove_dir(f.m("d"))), libc::ENOTEMPTY);
    assert_eq!(e(fs::write(f.m("d"), b"x")), libc::EISDIR);
    assert_eq!(e(fs::write(f.m("b/x"), b"x")), libc::ENOTDIR);
    assert_eq!(e(fs::write(f.m("nodir/x"), b"x")), libc::ENOENT);
    let long = "n".repeat(256);
    assert_eq!(e(fs::write(f.m(&long), b"x")), libc::ENAMETOOLONG);
    assert_eq!(e(fs::rename(f.m("nope"), f.m("z"))), libc::ENOENT);

    // Remove files and directories.
    fs::remove_file(f.m("b")).unwrap();
    assert!(!f.srv("b").exists());
    assert_eq!(e(fs::remove_file(f.m("b"))), libc::ENOENT);
    fs::remove_dir_all(f.m("d")).unwrap();
    assert!(!f.srv("d").exists());
}

#[test]
fn read_only_mount_refuses_writes_and_writes_nothing() {
    let f = Fixture::new();
    fs::write(f.srv("keep"), b"original").unwrap();
    let cfg = MountConfig {
        read_only: true,
        ..MountConfig::default()
    };
    let _m = f.mount(&cfg);
    assert_eq!(fs::read(f.m("keep")).unwrap(), b"original");
    let e = |r: std::io::Result<()>| errno(r.unwrap_err());
    assert_eq!(e(fs::write(f.m("keep"), b"changed")), libc::EROFS);
    assert_eq!(e(fs::write(f.m("new"), b"x")), libc::EROFS);
    assert_eq!(e(fs::create_dir(f.m("dir"))), libc::EROFS);
    assert_eq!(e(fs::remove_file(f.m("keep"))), libc::EROFS);
    assert_eq!(fs::read(f.srv("keep")).unwrap(), b"original");
    assert!(!f.srv("new").exists() && !f.srv("dir").exists());
}

#[test]
fn a_subdirectory_mount_sees_only_its_tree() {
    let f = Fixture::new();
    fs::create_dir_all(f.srv("db/inner")).unwrap();
    fs::write(f.srv("db/inner/f"), b"inside").unwrap();
    fs::write(f.srv("outside"), b"no").unwrap();
    let _m = f.mount_at(f.mnt.path(), "db", &MountConfig::default());
    assert_eq!(fs::read(f.m("inner/f")).unwrap(), b"inside");
    assert_eq!(
        fs::read(f.m("outside")).unwrap_err().kind(),
        ErrorKind::NotFound
    );
    let mut w = fs::File::create(f.m("inner/new")).unwrap();
    w.write_all(b"made in db").unwrap();
    w.seek(SeekFrom::Start(0)).unwrap();
    drop(w);
    assert_eq!(fs::read(f.srv("db/inner/new")).unwrap(), b"made in db");
}

#[test]
fn a_mount_of_a_missing_directory_fails_before_mounting() {
    let f = Fixture::new();
    let e = lwio_mount::mount(
        f.client(),
        "ex",
        "no/such/dir",
        f.mnt.path(),
        &MountConfig::default(),
    )
    .err()
    .expect("refused");
    assert_eq!(e.kind(), ErrorKind::NotFound, "{e}");
    assert_eq!(e.to_string(), "ex/no/such/dir: No such file or directory");
    assert!(!is_mountpoint(f.mnt.path()));
}

#[test]
fn posix_attributes_links_and_rename_flags() {
    use std::os::unix::fs::PermissionsExt;
    let f = Fixture::new();
    let _m = f.mount(&MountConfig::default());
    let e = |r: std::io::Result<()>| errno(r.unwrap_err());

    // chmod and utimens reach the server's file.
    fs::write(f.m("a"), b"data").unwrap();
    fs::set_permissions(f.m("a"), fs::Permissions::from_mode(0o640)).unwrap();
    assert_eq!(fs::metadata(f.srv("a")).unwrap().mode() & 0o7777, 0o640);
    assert_eq!(fs::metadata(f.m("a")).unwrap().mode() & 0o7777, 0o640);
    let t = std::time::UNIX_EPOCH + Duration::new(1_600_000_000, 123_456_789);
    fs::File::options()
        .write(true)
        .open(f.m("a"))
        .unwrap()
        .set_modified(t)
        .unwrap();
    assert_eq!(fs::metadata(f.srv("a")).unwrap().modified().unwrap(), t);
    assert_eq!(fs::metadata(f.m("a")).unwrap().modified().unwrap(), t);
    // Owners are the server's (root runs these tests: chown works).
    let srv = fs::metadata(f.srv("a")).unwrap();
    let m = fs::metadata(f.m("a")).unwrap();
    assert_eq!(
        (m.uid(), m.gid(), m.ino() != 0),
        (srv.uid(), srv.gid(), true)
    );
    // identity = "server" (the default): the files are the server's
    // user's, and stay so: a chown to anyone else is EPERM and changes
    // nothing; chown to the server's own ids is allowed (tar as root).
    let refused = std::os::unix::fs::chown(f.m("a"), Some(1234), Some(4321)).unwrap_err();
    assert_eq!(refused.raw_os_error(), Some(libc::EPERM), "{refused}");
    let after = fs::metadata(f.srv("a")).unwrap();
    assert_eq!((after.uid(), after.gid()), (srv.uid(), srv.gid()));
    std::os::unix::fs::chown(f.m("a"), Some(srv.uid()), Some(srv.gid())).unwrap();
    // No set-id bits from a client (issue 31: a writer's chmod 4755 left a
    // setuid-root file on a root server); the rest of the mode is kept.
    fs::set_permissions(f.m("a"), fs::Permissions::from_mode(0o6755)).unwrap();
    assert_eq!(
        fs::metadata(f.srv("a")).unwrap().permissions().mode() & 0o7777,
        0o755
    );
    fs::set_permissions(f.m("a"), fs::Permissions::from_mode(0o644)).unwrap();

    // Symlinks: created verbatim, read back, listed and lstat'ed as links,
    // followed inside the export.
    std::os::unix::fs::symlink("a", f.m("link")).unwrap();
    assert_eq!(fs::read_link(f.srv("link")).unwrap(), Path::new("a"));
    assert_eq!(fs::read_link(f.m("link")).unwrap(), Path::new("a"));
    assert!(fs::symlink_metadata(f.m("link"))
        .unwrap()
        .file_type()
        .is_symlink());
    assert_eq!(fs::read(f.m("link")).unwrap(), b"data");
    assert_eq!(
        e(std::os::unix::fs::symlink("a", f.m("link"))),
        libc::EEXIST
    );
    // A link out of the export is stored verbatim. The client's kernel
    // resolves it on the client, as with NFS (so it reads the client's own
    // /etc/hostname); the server never follows it: opening it or changing
    // its attributes through the side channel is refused.
    std::os::unix::fs::symlink("/etc/hostname", f.m("out")).unwrap();
    assert_eq!(
        fs::read_link(f.m("out")).unwrap(),
        Path::new("/etc/hostname")
    );
    let c = f.client();
    let refused = c.open("ex/out", &lwio_client::OpenOptions::read_only());
    assert!(
        matches!(refused, Err(lwio_client::Error::AccessDenied(_))),
        "{refused:?}"
    );
    let chmod = c.side(|s| {
        Ok(s.set_attr(
            "ex",
            "out",
            &lwio_side::SetAttr {
                mode: Some(0o777),
                ..Default::default()
            },
        ))
    });
    assert_eq!(
        chmod.unwrap().unwrap_err().code,
        lwio_side::ErrorCode::Unsupported,
        "chmod of a symlink changes nothing, as on Linux"
    );

    // unlink of a directory and rmdir of a file fail as the OS says.
    fs::create_dir(f.m("dir")).unwrap();
    assert_eq!(e(fs::remove_file(f.m("dir"))), libc::EISDIR);
    assert_eq!(e(fs::remove_dir(f.m("a"))), libc::ENOTDIR);

    // renameat2: NOREPLACE refuses an existing target, EXCHANGE swaps.
    fs::write(f.m("b"), b"bee").unwrap();
    let rn = |a: &str, b: &str, flags: libc::c_uint| -> std::io::Result<()> {
        let a = std::ffi::CString::new(f.m(a).into_os_string().into_encoded_bytes()).unwrap();
        let b = std::ffi::CString::new(f.m(b).into_os_string().into_encoded_bytes()).unwrap();
        // SAFETY: valid NUL-terminated paths.
        let r = unsafe {
            libc::renameat2(
                libc::AT_FDCWD,
                a.as_ptr(),
                libc::AT_FDCWD,
                b.as_ptr(),
                flags,
            )
        };
        if r == 0 {
            Ok(())
        } else {
            Err(std::io::Error::last_os_error())
        }
    };
    assert_eq!(e(rn("a", "b", libc::RENAME_NOREPLACE)), libc::EEXIST);
    rn("a", "b", libc::RENAME_EXCHANGE).unwrap();
    assert_eq!(fs::read(f.srv("a")).unwrap(), b"bee");
    assert_eq!(fs::read(f.srv("b")).unwrap(), b"data");
    assert_eq!(fs::read(f.m("a")).unwrap(), b"bee");
    assert_eq!(fs::read(f.m("b")).unwrap(), b"data");

    // An open file keeps working, and fstat answers, after its name goes.
    let mut h = fs::File::options()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(f.m("tmp"))
        .unwrap();
    fs::remove_file(f.m("tmp")).unwrap();
    assert!(!f.srv("tmp").exists());
    h.write_all(b"still here").unwrap();
    assert_eq!(h.metadata().unwrap().len(), 10);
    h.set_len(4).unwrap();
    assert_eq!(h.metadata().unwrap().len(), 4);

    // statfs reports the server's file system.
    // SAFETY: statvfs is plain data; valid path and out-pointer.
    let (mut sm, mut ss): (libc::statvfs, libc::statvfs) = unsafe { std::mem::zeroed() };
    let cm = std::ffi::CString::new(f.mnt.path().as_os_str().as_encoded_bytes()).unwrap();
    let cs = std::ffi::CString::new(f.srv("").as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: as above.
    assert_eq!(unsafe { libc::statvfs(cm.as_ptr(), &mut sm) }, 0);
    // SAFETY: as above.
    assert_eq!(unsafe { libc::statvfs(cs.as_ptr(), &mut ss) }, 0);
    assert_eq!(sm.f_blocks * sm.f_frsize, ss.f_blocks * ss.f_frsize);
    assert!(sm.f_bavail > 0 && sm.f_namemax == ss.f_namemax);
}

#[test]
fn two_mounts_of_one_export_see_each_other() {
    // Two mounts on one host are two clients (two sessions, two RDMA
    // connections). Without directory leases, B asks the server every time
    // with zero timeouts, and contents follow close-to-open.
    let f = Fixture::new();
    let a = f.mount(&MountConfig::default());
    let mnt_b = tempfile::tempdir().unwrap();
    let b_cfg = MountConfig {
        attr_ttl: Duration::ZERO,
        entry_ttl: Duration::ZERO,
        ..MountConfig::default()
    };
    let b = f.mount_at(mnt_b.path(), "", &b_cfg);
    let pa = |r: &str| a.mountpoint().join(r);
    let pb = |r: &str| b.mountpoint().join(r);
    fs::write(pa("shared"), b"version 1").unwrap();
    assert_eq!(fs::read(pb("shared")).unwrap(), b"version 1");
    fs::write(pa("shared"), b"version 2, longer").unwrap();
    assert_eq!(fs::read(pb("shared")).unwrap(), b"version 2, longer");
    assert_eq!(fs::metadata(pb("shared")).unwrap().len(), 17);
    fs::create_dir(pa("dir")).unwrap();
    fs::rename(pa("shared"), pa("dir/moved")).unwrap();
    assert_eq!(errno(fs::metadata(pb("shared")).unwrap_err()), libc::ENOENT);
    assert_eq!(fs::read(pb("dir/moved")).unwrap(), b"version 2, longer");
    let names: Vec<_> = fs::read_dir(pb("dir"))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, ["moved"]);
    fs::remove_file(pb("dir/moved")).unwrap();
    assert!(!f.srv("dir/moved").exists());
}

#[test]
fn kept_page_cache_still_follows_close_to_open() {
    // B keeps a file's page cache across its opens under the lease of the
    // file's directory; A's open for writing breaks that lease first, so
    // B's next open after A's close reads A's bytes (same length: only the
    // contents differ, not the size).
    let f = Fixture::new();
    fs::create_dir(f.srv("d")).unwrap();
    fs::write(f.srv("d/file"), b"version 1").unwrap();
    let a = f.mount(&MountConfig::default());
    let mnt_b = tempfile::tempdir().unwrap();
    let b = f.mount_at(mnt_b.path(), "", &MountConfig::default());
    let pa = |r: &str| a.mountpoint().join(r);
    let pb = |r: &str| b.mountpoint().join(r);
    assert_eq!(names(&pb("d")), ["file"]);
    for _ in 0..3 {
        assert_eq!(fs::read(pb("d/file")).unwrap(), b"version 1");
    }
    let reads = b.stats().reads.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(fs::read(pb("d/file")).unwrap(), b"version 1");
    assert_eq!(
        b.stats().reads.load(std::sync::atomic::Ordering::Relaxed),
        reads,
        "a reopen under the lease reads from the kept page cache"
    );
    fs::write(pa("d/file"), b"version 2").unwrap();
    assert_eq!(fs::read(pb("d/file")).unwrap(), b"version 2");
    // Without a lease (noleases), every open drops the cache.
    let mnt_c = tempfile::tempdir().unwrap();
    let c_cfg = MountConfig {
        leases: false,
        ..MountConfig::default()
    };
    let c = f.mount_at(mnt_c.path(), "", &c_cfg);
    assert_eq!(
        fs::read(c.mountpoint().join("d/file")).unwrap(),
        b"version 2"
    );
    fs::write(pa("d/file"), b"version 3").unwrap();
    assert_eq!(
        fs::read(c.mountpoint().join("d/file")).unwrap(),
        b"version 3"
    );
    assert_eq!(fs::read(pb("d/file")).unwrap(), b"version 3");
}

/// Make the kernel forget cached dentries and inodes (root only), so that
/// the next lookups reach the mount.
fn drop_kernel_caches() {
    fs::write("/proc/sys/vm/drop_caches", "2")
        .expect("writing /proc/sys/vm/drop_caches (the lease test runs as root, as CI does)");
}

fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    v.sort();
    v
}

#[test]
fn directory_leases_answer_without_round_trips_and_break_on_changes() {
    // Both mounts hold leases (the default) and keep what a lease covers in
    // the kernel for a minute (lease_timeout=60): only the breaks make the
    // other mount's changes visible, and they must, at once.
    let f = Fixture::new();
    fs::create_dir(f.srv("d")).unwrap();
    for i in 0..20 {
        fs::write(f.srv(&format!("d/f{i}")), vec![b'x'; i]).unwrap();
    }
    let a = f.mount(&MountConfig::default());
    let mnt_b = tempfile::tempdir().unwrap();
    let b = f.mount_at(mnt_b.path(), "", &MountConfig::default());
    let pa = |r: &str| a.mountpoint().join(r);
    let pb = |r: &str| b.mountpoint().join(r);
    let sa = a.stats().clone();
    let g = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);

    // A lists the root and d: it takes leases and keeps the listings.
    assert_eq!(names(a.mountpoint()), ["d"]);
    let want: Vec<String> = {
        let mut v: Vec<String> = (0..20).map(|i| format!("f{i}")).collect();
        v.sort();
        v
    };
    assert_eq!(names(&pa("d")), want);
    assert!(g(&sa.leases_granted) >= 1, "{}", sa.summary());

    // The kernel forgets; A answers the lookups, attributes, a negative
    // lookup and a second listing from the lease: no side-channel call.
    drop_kernel_caches();
    let calls = g(&sa.side_calls);
    let hits = g(&sa.lease_hits);
    for i in 0..20 {
        assert_eq!(
            fs::metadata(pa(&format!("d/f{i}"))).unwrap().len(),
            i as u64
        );
    }
    assert_eq!(errno(fs::metadata(pa("d/nope")).unwrap_err()), libc::ENOENT);
    assert_eq!(names(&pa("d")), want);
    assert_eq!(
        g(&sa.side_calls),
        calls,
        "answered without a round trip: {}",
        sa.summary()
    );
    let answered = g(&sa.lease_hits) - hits;
    assert!(
        answered >= 21,
        "{answered} answers from the lease: {}",
        sa.summary()
    );

    // B's changes break A's lease: A sees each at once.
    fs::write(pb("d/new"), b"from b").unwrap();
    assert_eq!(fs::read(pa("d/new")).unwrap(), b"from b");
    assert!(names(&pa("d")).contains(&"new".to_string()));
    fs::set_permissions(pb("d/f3"), fs::Permissions::from_mode(0o600)).unwrap();
    assert_eq!(fs::metadata(pa("d/f3")).unwrap().mode() & 0o777, 0o600);
    fs::rename(pb("d/f1"), pb("d/g1")).unwrap();
    assert_eq!(errno(fs::metadata(pa("d/f1")).unwrap_err()), libc::ENOENT);
    assert_eq!(fs::metadata(pa("d/g1")).unwrap().len(), 1);
    fs::remove_file(pb("d/f2")).unwrap();
    assert_eq!(errno(fs::metadata(pa("d/f2")).unwrap_err()), libc::ENOENT);
    let mut h = fs::OpenOptions::new()
        .append(true)
        .open(pb("d/f5"))
        .unwrap();
    h.write_all(b"0123456789").unwrap();
    drop(h);
    assert_eq!(fs::metadata(pa("d/f5")).unwrap().len(), 15);
    assert_eq!(fs::read(pa("d/f5")).unwrap(), b"xxxxx0123456789");
    fs::create_dir(pb("d/sub")).unwrap();
    assert!(fs::metadata(pa("d/sub")).unwrap().is_dir());
    let mut now: Vec<String> = want
        .iter()
        .filter(|n| *n != "f1" && *n != "f2")
        .cloned()
        .chain(["g1", "new", "sub"].map(String::from))
        .collect();
    now.sort();
    assert_eq!(names(&pa("d")), now);
    assert!(g(&sa.lease_breaks) >= 1, "{}", sa.summary());

    // A's own changes keep its own lease (no break) and its cache right.
    let breaks = g(&sa.lease_breaks);
    fs::write(pa("d/mine"), b"12345").unwrap();
    fs::remove_file(pa("d/f4")).unwrap();
    fs::rename(pa("d/f6"), pa("d/h6")).unwrap();
    assert_eq!(fs::metadata(pa("d/mine")).unwrap().len(), 5);
    assert_eq!(errno(fs::metadata(pa("d/f4")).unwrap_err()), libc::ENOENT);
    drop_kernel_caches();
    assert_eq!(fs::metadata(pa("d/mine")).unwrap().len(), 5);
    assert_eq!(errno(fs::metadata(pa("d/f6")).unwrap_err()), libc::ENOENT);
    assert_eq!(fs::metadata(pa("d/h6")).unwrap().len(), 6);
    assert_eq!(
        g(&sa.lease_breaks),
        breaks,
        "own changes break nothing of ours"
    );
    // And B, whose lease on d those changes broke, sees them.
    assert_eq!(fs::read(pb("d/mine")).unwrap(), b"12345");
    assert_eq!(errno(fs::metadata(pb("d/f4")).unwrap_err()), libc::ENOENT);
    assert!(names(&pb("d")).contains(&"h6".to_string()));
}

#[test]
fn changes_made_past_lwio_show_after_the_lease_timeout() {
    let f = Fixture::new();
    fs::create_dir(f.srv("d")).unwrap();
    let a = f.mount(&MountConfig {
        lease_ttl: Duration::from_millis(500),
        ..MountConfig::default()
    });
    assert!(names(&a.mountpoint().join("d")).is_empty());
    // Written on the server's disk by another program: no break comes.
    fs::write(f.srv("d/local"), b"x").unwrap();
    std::thread::sleep(Duration::from_millis(700));
    assert_eq!(names(&a.mountpoint().join("d")), ["local"]);
    assert_eq!(fs::read(a.mountpoint().join("d/local")).unwrap(), b"x");
}

#[test]
fn noleases_mounts_take_no_leases() {
    let f = Fixture::new();
    fs::create_dir(f.srv("d")).unwrap();
    let cfg = MountConfig {
        leases: false,
        ..MountConfig::default()
    };
    let a = f.mount(&cfg);
    fs::read_dir(a.mountpoint().join("d"))
        .unwrap()
        .for_each(drop);
    let st = a.stats();
    assert_eq!(
        st.leases_granted.load(std::sync::atomic::Ordering::Relaxed),
        0
    );
    assert_eq!(f.server.state.leases.counts().held, 0);
}

#[test]
fn holes_fallocate_and_hard_links() {
    let f = Fixture::new();
    let _m = f.mount(&MountConfig::default());
    let file = fs::File::options()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(f.m("sparse"))
        .unwrap();
    let fd = std::os::fd::AsRawFd::as_raw_fd(&file);
    // 1 MiB of data, then a hole punched in its middle.
    file.write_all_at(&vec![7u8; 1 << 20], 0).unwrap();
    file.sync_all().unwrap();
    // SAFETY: plain syscalls on an fd we own.
    let r = unsafe {
        libc::fallocate(
            fd,
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            256 << 10,
            256 << 10,
        )
    };
    assert_eq!(r, 0, "{}", std::io::Error::last_os_error());
    let mut back = vec![0u8; 1 << 20];
    file.read_exact_at(&mut back, 0).unwrap();
    let mut want = vec![7u8; 1 << 20];
    want[256 << 10..512 << 10].fill(0);
    assert!(
        back == want,
        "punched range reads as zeros, the rest as data"
    );
    assert_eq!(fs::read(f.srv("sparse")).unwrap(), want);
    // SEEK_HOLE / SEEK_DATA are the server file system's answers.
    // SAFETY: as above.
    let hole = unsafe { libc::lseek(fd, 0, libc::SEEK_HOLE) };
    // SAFETY: as above.
    let data = unsafe { libc::lseek(fd, 256 << 10, libc::SEEK_DATA) };
    let local = fs::File::open(f.srv("sparse")).unwrap();
    let lfd = std::os::fd::AsRawFd::as_raw_fd(&local);
    // SAFETY: as above.
    let (lhole, ldata) = unsafe {
        (
            libc::lseek(lfd, 0, libc::SEEK_HOLE),
            libc::lseek(lfd, 256 << 10, libc::SEEK_DATA),
        )
    };
    assert_eq!((hole, data), (lhole, ldata));
    // Past the end: ENXIO, as locally.
    // SAFETY: as above.
    let past = unsafe { libc::lseek(fd, 4 << 20, libc::SEEK_DATA) };
    assert_eq!(past, -1);
    assert_eq!(
        std::io::Error::last_os_error().raw_os_error(),
        Some(libc::ENXIO)
    );
    // Preallocation grows the file (mode 0) as posix_fallocate does.
    // SAFETY: as above.
    assert_eq!(unsafe { libc::fallocate(fd, 0, 0, 2 << 20) }, 0);
    assert_eq!(fs::metadata(f.srv("sparse")).unwrap().len(), 2 << 20);

    // Hard links: this export does not allow them (a second name would
    // make the file unopenable, docs/side-channel.md §6): EPERM, nothing made.
    assert_eq!(
        errno(fs::hard_link(f.m("sparse"), f.m("second")).unwrap_err()),
        libc::EPERM
    );
    assert!(!f.srv("second").exists());
}

#[test]
fn copy_file_range_copies_on_the_server() {
    let f = Fixture::new();
    let m = f.mount(&MountConfig::default());
    let data = pattern(3, (9 << 20) + 77);
    fs::write(f.srv("src"), &data).unwrap();
    let src = fs::File::open(f.m("src")).unwrap();
    let dst = fs::File::create(f.m("dst")).unwrap();
    let st = m.stats().clone();
    let moved = |s: &lwio_mount::Stats| {
        s.read_bytes.load(std::sync::atomic::Ordering::Relaxed)
            + s.write_bytes.load(std::sync::atomic::Ordering::Relaxed)
    };
    let before = moved(&st);
    let (sfd, dfd) = (
        std::os::fd::AsRawFd::as_raw_fd(&src),
        std::os::fd::AsRawFd::as_raw_fd(&dst),
    );
    let mut total = 0usize;
    loop {
        // SAFETY: valid fds; null offsets use and advance the file offsets.
        let n = unsafe {
            libc::copy_file_range(
                sfd,
                std::ptr::null_mut(),
                dfd,
                std::ptr::null_mut(),
                1 << 30,
                0,
            )
        };
        assert!(n >= 0, "{}", std::io::Error::last_os_error());
        if n == 0 {
            break;
        }
        total += n as usize;
    }
    assert_eq!(total, data.len());
    drop((src, dst));
    assert_eq!(fs::read(f.srv("dst")).unwrap(), data);
    // No byte of it crossed the data path to this client.
    assert_eq!(moved(&st) - before, 0);
}

/// fcntl(F_SETLK / F_SETLKW / F_GETLK) of a byte range; Err(errno).
fn fcntl_lock(f: &fs::File, cmd: i32, typ: i32, start: i64, len: i64) -> Result<libc::flock, i32> {
    // SAFETY: flock is plain data.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = typ as i16;
    fl.l_whence = libc::SEEK_SET as i16;
    fl.l_start = start;
    fl.l_len = len;
    // SAFETY: a valid fd and flock pointer.
    let r = unsafe { libc::fcntl(std::os::fd::AsRawFd::as_raw_fd(f), cmd, &mut fl) };
    os_result(r).map(|()| fl)
}

#[test]
fn posix_locks_hold_across_two_mounts() {
    let f = Fixture::new();
    let (a, b, _mnt_b) = f.two_mounts();
    fs::write(f.srv("db"), vec![0u8; 4096]).unwrap();
    let open = |m: &Mounted| {
        fs::File::options()
            .read(true)
            .write(true)
            .open(m.mountpoint().join("db"))
            .unwrap()
    };
    let (fa, fb) = (open(&a), open(&b));
    // A write-locks bytes 0..100: B can neither write- nor read-lock them,
    // and F_GETLK names A's lock; B may lock other bytes.
    fcntl_lock(&fa, libc::F_SETLK, libc::F_WRLCK, 0, 100).unwrap();
    assert_eq!(
        fcntl_lock(&fb, libc::F_SETLK, libc::F_WRLCK, 50, 10).unwrap_err(),
        libc::EAGAIN
    );
    assert_eq!(
        fcntl_lock(&fb, libc::F_SETLK, libc::F_RDLCK, 0, 1).unwrap_err(),
        libc::EAGAIN
    );
    let held = fcntl_lock(&fb, libc::F_GETLK, libc::F_WRLCK, 10, 1).unwrap();
    assert_eq!(
        (i32::from(held.l_type), held.l_start, held.l_len),
        (libc::F_WRLCK, 0, 100)
    );
    fcntl_lock(&fb, libc::F_SETLK, libc::F_WRLCK, 100, 10).unwrap();
    assert_eq!(
        i32::from(
            fcntl_lock(&fa, libc::F_GETLK, libc::F_WRLCK, 200, 0)
                .unwrap()
                .l_type
        ),
        libc::F_UNLCK
    );
    // Unlock: B gets it.
    fcntl_lock(&fa, libc::F_SETLK, libc::F_UNLCK, 0, 100).unwrap();
    fcntl_lock(&fb, libc::F_SETLK, libc::F_WRLCK, 0, 50).unwrap();
    // A waits (F_SETLKW) until B's descriptor closes, which drops B's locks.
    let waiter = std::thread::spawn(move || {
        let t = std::time::Instant::now();
        fcntl_lock(&fa, libc::F_SETLKW, libc::F_WRLCK, 0, 200).map(|_| t.elapsed())
    });
    std::thread::sleep(Duration::from_millis(300));
    assert!(!waiter.is_finished(), "F_SETLKW did not wait for B's lock");
    drop(fb);
    let waited = waiter.join().unwrap().unwrap();
    assert!(waited >= Duration::from_millis(250), "{waited:?}");
}

/// 0 → Ok, else the errno of the call just made.
fn os_result(r: i32) -> Result<(), i32> {
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error().raw_os_error().unwrap())
    }
}

fn flock(f: &fs::File, op: i32) -> Result<(), i32> {
    use std::os::fd::AsRawFd;
    // SAFETY: flock(2) on a descriptor we own; no memory is passed.
    os_result(unsafe { libc::flock(f.as_raw_fd(), op) })
}

#[test]
fn flock_holds_across_two_mounts() {
    let f = Fixture::new();
    let (a, b, _mnt_b) = f.two_mounts();
    fs::write(f.srv("lockfile"), b"").unwrap();
    // Opened read-write: the server refuses write (exclusive) locks on a
    // file opened read-only (issue 31), and flock arrives as a whole-file
    // lock of the open file that the side channel cannot tell from fcntl's.
    let open = |m: &Mounted| {
        fs::File::options()
            .read(true)
            .write(true)
            .open(m.mountpoint().join("lockfile"))
            .unwrap()
    };
    let fa = open(&a);
    let fb = open(&b);
    let fb2 = open(&b);
    // Unlike a local flock(2): LOCK_EX on a read-only open is EBADF (as a
    // local fcntl write lock on one is); LOCK_SH works.
    let ro = fs::File::open(b.mountpoint().join("lockfile")).unwrap();
    assert_eq!(flock(&ro, libc::LOCK_EX | libc::LOCK_NB), Err(libc::EBADF));
    flock(&ro, libc::LOCK_SH | libc::LOCK_NB).unwrap();
    flock(&ro, libc::LOCK_UN).unwrap();
    drop(ro);
    flock(&fa, libc::LOCK_EX | libc::LOCK_NB).unwrap();
    assert_eq!(
        flock(&fb, libc::LOCK_EX | libc::LOCK_NB),
        Err(libc::EWOULDBLOCK)
    );
    assert_eq!(
        flock(&fb, libc::LOCK_SH | libc::LOCK_NB),
        Err(libc::EWOULDBLOCK)
    );
    // Downgraded to shared: B may share it, not take it exclusively.
    flock(&fa, libc::LOCK_SH | libc::LOCK_NB).unwrap();
    flock(&fb, libc::LOCK_SH | libc::LOCK_NB).unwrap();
    assert_eq!(
        flock(&fb2, libc::LOCK_EX | libc::LOCK_NB),
        Err(libc::EWOULDBLOCK)
    );
    flock(&fb, libc::LOCK_UN).unwrap();
    // A blocking LOCK_EX in B waits for A's close, then gets it.
    let t = std::thread::spawn(move || {
        let started = std::time::Instant::now();
        flock(&fb2, libc::LOCK_EX).unwrap();
        (started.elapsed(), fb2)
    });
    std::thread::sleep(Duration::from_millis(300));
    drop(fa);
    let (waited, fb2) = t.join().unwrap();
    assert!(waited >= Duration::from_millis(250), "{waited:?}");
    // Held by B now: A's new descriptor is refused.
    let fa = open(&a);
    assert_eq!(
        flock(&fa, libc::LOCK_EX | libc::LOCK_NB),
        Err(libc::EWOULDBLOCK)
    );
    drop(fb2);
    // FUSE sends the release that drops a flock lock after close(2)
    // returns: it arrives within moments.
    let mut got = flock(&fa, libc::LOCK_EX | libc::LOCK_NB);
    for _ in 0..100 {
        if got.is_ok() {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
        got = flock(&fa, libc::LOCK_EX | libc::LOCK_NB);
    }
    assert_eq!(got, Ok(()));
}

#[test]
fn an_idle_mount_keeps_its_session() {
    // A server that closes sessions idle for one second; the mount pings
    // every 300 ms and stays usable, open file included.
    let f = Fixture::with_limits(Limits {
        idle_timeout: Duration::from_secs(1),
        ..Limits::default()
    });
    let cfg = MountConfig {
        keepalive: Duration::from_millis(300),
        ..MountConfig::default()
    };
    let m = f.mount(&cfg);
    let mut h = fs::File::create(m.mountpoint().join("f")).unwrap();
    h.write_all(b"before").unwrap();
    std::thread::sleep(Duration::from_millis(2500));
    h.write_all(b" after").unwrap();
    drop(h);
    fs::write(m.mountpoint().join("g"), b"new").unwrap();
    assert_eq!(fs::read(f.srv("f")).unwrap(), b"before after");
    assert_eq!(fs::read(f.srv("g")).unwrap(), b"new");
}

#[test]
fn read_only_export_and_rename_across_file_systems() {
    // The server's own refusals, not the mount's: a read-only export gives
    // EROFS for every change, and a rename between two file
    // systems inside one export gives EXDEV (mv then copies).
    require_fuse();
    let dir = tempfile::tempdir().unwrap();
    let (rw, ro) = (dir.path().join("rw"), dir.path().join("ro"));
    fs::create_dir_all(rw.join("other")).unwrap();
    fs::create_dir_all(&ro).unwrap();
    fs::write(ro.join("keep"), b"kept").unwrap();
    let spec = |name: &str, path: &Path, read_only| lwio_server::fs::ExportSpec {
        name: name.into(),
        path: path.to_path_buf(),
        read_only,
        allow_hardlinks: false,
        ..Default::default()
    };
    let server = LocalServer::start_specs(
        vec![spec("rw", &rw, false), spec("ro", &ro, true)],
        TOKEN,
        Limits::default(),
        RdmaServerOptions::default(),
    )
    .expect("server starts");
    let client = || {
        Client::connect(
            &server.side_addr.to_string(),
            Some(TOKEN),
            ClientOptions::default().no_tls(),
        )
        .expect("client connects")
    };
    let (m_ro, m_rw) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let ro_mount =
        lwio_mount::mount(client(), "ro", "", m_ro.path(), &MountConfig::default()).unwrap();
    let p = |r: &str| ro_mount.mountpoint().join(r);
    assert_eq!(fs::read(p("keep")).unwrap(), b"kept");
    let e = |r: std::io::Result<()>| errno(r.unwrap_err());
    assert_eq!(e(fs::write(p("keep"), b"x")), libc::EROFS);
    assert_eq!(e(fs::write(p("new"), b"x")), libc::EROFS);
    assert_eq!(e(fs::create_dir(p("d"))), libc::EROFS);
    assert_eq!(e(fs::remove_file(p("keep"))), libc::EROFS);
    assert_eq!(e(fs::rename(p("keep"), p("k2"))), libc::EROFS);
    assert_eq!(e(std::os::unix::fs::symlink("keep", p("l"))), libc::EROFS);
    {
        use std::os::unix::fs::PermissionsExt;
        let chmod = fs::set_permissions(p("keep"), fs::Permissions::from_mode(0o600));
        assert_eq!(e(chmod), libc::EROFS);
    }
    assert_eq!(fs::read(ro.join("keep")).unwrap(), b"kept");
    assert_eq!(fs::read_dir(&ro).unwrap().count(), 1);

    // A tmpfs mounted inside the rw export: a second file system.
    let other = rw.join("other");
    let _u = mount_fs(c"tmpfs", &other);
    let rw_mount =
        lwio_mount::mount(client(), "rw", "", m_rw.path(), &MountConfig::default()).unwrap();
    let q = |r: &str| rw_mount.mountpoint().join(r);
    fs::write(q("f"), b"moving").unwrap();
    assert_eq!(e(fs::rename(q("f"), q("other/f"))), libc::EXDEV);
    assert!(rw.join("f").exists() && !other.join("f").exists());
    drop(rw_mount);
    drop(ro_mount);
}
