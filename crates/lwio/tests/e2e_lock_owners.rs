//! Byte-range lock owners against the real server (issue 31): every new
//! lock owner of a side-channel Lock gets an open file description of its
//! own on the server, so a reader looping Lock with new owner values could
//! exhaust the server's descriptors. They are bounded per open file
//! (`max_lock_owners_per_file`, 64) and per session
//! (`max_lock_owners_per_session`, 1024), counted against the descriptor
//! limit, released by a whole-file unlock; and a file opened read-only
//! takes read locks only, on a description opened read-only.
//!
//! The server is a `lwio serve` child with its default limits, so its
//! descriptors are its own (`/proc/PID/fd`); the clients are the real
//! client library's side-channel sessions.

use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use lwio_client::side_client::SideClient as Side;
use lwio_side::types::OpenOptions;
use lwio_side::{ErrorCode, Login, Token};

const PER_FILE: usize = 64;
const PER_SESSION: usize = 1024;
const FILES: usize = 20;

struct Serve {
    child: Child,
    side: String,
    data: PathBuf,
    token: String,
    _dir: tempfile::TempDir,
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `lwio serve` (plain TCP, soft provider, default limits) exporting
/// `data` with files f0..f19.
fn serve() -> Serve {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    std::fs::create_dir_all(&data).unwrap();
    for i in 0..FILES {
        std::fs::write(data.join(format!("f{i}")), b"lock me").unwrap();
    }
    let ready = dir.path().join("ready");
    let child = Command::new(env!("CARGO_BIN_EXE_lwio"))
        .args(["serve", "--no-tls", "--provider", "soft"])
        .args(["--listen", "127.0.0.1:0", "--rdma-listen", "127.0.0.1:0"])
        .arg("--export")
        .arg(format!("data={}", data.display()))
        .arg("--token-file")
        .arg(dir.path().join("token"))
        .arg("--ready-file")
        .arg(&ready)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    let side = loop {
        if let Ok(s) = std::fs::read_to_string(&ready) {
            if s.ends_with('\n') {
                break s.trim().to_string();
            }
        }
        assert!(t0.elapsed() < Duration::from_secs(30), "server not ready");
        std::thread::sleep(Duration::from_millis(10));
    };
    let token = std::fs::read_to_string(dir.path().join("token"))
        .unwrap()
        .trim()
        .to_string();
    Serve {
        child,
        side,
        data,
        token,
        _dir: dir,
    }
}

impl Serve {
    fn session(&self) -> Side {
        let o = lwio_client::side_client::SideOptions::new(Login::Token(
            Token::new(&self.token).unwrap(),
        ));
        Side::connect(&self.side, &o).unwrap()
    }

    /// The server's open descriptors.
    fn fds(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/fd", self.child.id()))
            .unwrap()
            .count()
    }

    /// The server's open descriptors once `ok` holds of their count, or
    /// after 5 s (then the count as it is).
    fn fds_until(&self, ok: impl Fn(usize) -> bool) -> usize {
        let t0 = Instant::now();
        loop {
            let n = self.fds();
            if ok(n) || t0.elapsed() > Duration::from_secs(5) {
                return n;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// The access modes (`O_ACCMODE` of fdinfo's flags) of the server's
    /// descriptors of `path`.
    fn modes_of(&self, path: &Path) -> Vec<i32> {
        let pid = self.child.id();
        let mut out = Vec::new();
        for e in std::fs::read_dir(format!("/proc/{pid}/fd")).unwrap() {
            let e = e.unwrap();
            if std::fs::read_link(e.path()).ok().as_deref() != Some(path) {
                continue;
            }
            let n = e.file_name();
            let Ok(info) =
                std::fs::read_to_string(format!("/proc/{pid}/fdinfo/{}", n.to_string_lossy()))
            else {
                continue;
            };
            let flags = info
                .lines()
                .find_map(|l| l.strip_prefix("flags:"))
                .map(|f| i32::from_str_radix(f.trim(), 8).unwrap())
                .unwrap();
            out.push(flags & libc::O_ACCMODE);
        }
        out
    }
}

fn ro() -> OpenOptions {
    OpenOptions {
        read: true,
        ..Default::default()
    }
}

fn rw() -> OpenOptions {
    OpenOptions {
        read: true,
        write: true,
        ..Default::default()
    }
}

const READ: u8 = 1;
const WRITE: u8 = 2;

/// A read-only session takes read locks with ever new owners on 20 files,
/// 100 owners each: each file grants 64 and refuses the rest, the session
/// stops at 1024 in all; the server's descriptors grow by at most those
/// 1024; unlocking releases descriptors (and makes room); another session
/// keeps opening and locking files throughout.
#[test]
fn lock_owner_flood_from_a_reader_is_bounded() {
    let s = serve();
    let mut evil = s.session();
    let handles: Vec<u64> = (0..FILES)
        .map(|i| {
            evil.open("data", &format!("f{i}"), &ro(), 0)
                .unwrap()
                .handle
        })
        .collect();
    let base = s.fds();
    let mut owner = 0u64;
    let mut granted = Vec::new();
    let mut refusals = Vec::new();
    for &h in &handles {
        let mut n = 0;
        for _ in 0..100 {
            owner += 1;
            match evil.lock(h, owner, READ, 0, 0) {
                Ok(()) => n += 1,
                Err(e) => refusals.push((h, e)),
            }
        }
        granted.push(n);
    }
    // Raced: the whole server's descriptor count, which its other threads change too, was read once.
    let grown = s
        .fds_until(|n| n.saturating_sub(base) <= PER_SESSION + 8)
        .saturating_sub(base);
    eprintln!("granted per file {granted:?}; server descriptors +{grown}");
    assert!(
        grown <= PER_SESSION + 8,
        "the server's descriptors grew by {grown} for one reader's lock owners (bound {PER_SESSION})"
    );
    let mut want = vec![PER_FILE; PER_SESSION / PER_FILE];
    want.resize(FILES, 0);
    assert_eq!(granted, want, "lock owners granted per file");
    assert_eq!(refusals.len(), FILES * 100 - PER_SESSION);
    for (i, (h, e)) in refusals.iter().enumerate() {
        assert_eq!(e.code, ErrorCode::TooManyOpenFiles, "{e}");
        assert_eq!(lwio_client::errno::side(e), libc::EMFILE);
        let per_file = handles[..PER_SESSION / PER_FILE].contains(h);
        let want = if per_file {
            format!("{PER_FILE} lock owners (limit max_lock_owners_per_file = {PER_FILE})")
        } else {
            format!("{PER_SESSION} lock owners (limit max_lock_owners_per_session = {PER_SESSION})")
        };
        assert!(
            e.message.contains(&want),
            "refusal {i}: {e} (want {want:?})"
        );
    }

    // Another session is served all along: it opens every file (and new
    // ones), locks them with owners of its own, reads and writes.
    let mut good = s.session();
    for i in 0..FILES {
        let f = good.open("data", &format!("f{i}"), &rw(), 0).unwrap();
        // The reader holds whole-file read locks on f0..f15: a shared
        // lock is granted, an exclusive one conflicts (as locally).
        good.lock(f.handle, 7, READ, 0, 0).unwrap();
        good.close(f.handle).unwrap();
    }
    for i in 0..50 {
        let o = OpenOptions {
            create: true,
            ..rw()
        };
        let f = good.open("data", &format!("new{i}"), &o, 0o644).unwrap();
        good.lock(f.handle, 1, WRITE, 0, 0).unwrap();
        good.close(f.handle).unwrap();
    }

    // A whole-file unlock releases the owner's description: 10 fewer
    // descriptors, room for exactly 10 more owners on that file.
    let before = s.fds();
    for o in 1..=10 {
        evil.lock(handles[0], o, 0, 0, 0).unwrap();
    }
    // Raced: as above (exactly 10 fewer, with no margin for another thread's descriptor).
    let freed = before.saturating_sub(s.fds_until(|n| before.saturating_sub(n) >= 10));
    assert!(freed >= 10, "unlocking 10 owners freed {freed} descriptors");
    for _ in 0..10 {
        owner += 1;
        evil.lock(handles[0], owner, READ, 0, 0).unwrap();
    }
    owner += 1;
    let e = evil.lock(handles[0], owner, READ, 0, 0).unwrap_err();
    assert!(e.message.contains("max_lock_owners_per_file"), "{e}");
    // Closing a handle releases all its descriptions.
    let before = s.fds();
    evil.close(handles[1]).unwrap();
    // Raced: as above.
    let freed = before.saturating_sub(s.fds_until(|n| before.saturating_sub(n) >= PER_FILE));
    assert!(
        freed >= PER_FILE,
        "closing a handle of 64 owners freed {freed}"
    );
    drop(evil);
    drop(good);
}

/// A file opened read-only takes read locks only: a write lock is refused
/// with EBADF, as a local `fcntl(F_OFD_SETLK, F_WRLCK)` on an O_RDONLY
/// descriptor is; testing for one (F_OFD_GETLK) works; the description
/// behind its read locks is opened read-only. A file opened read-write
/// takes write locks, on a read-write description.
#[test]
fn a_read_only_handle_takes_read_locks_only() {
    let s = serve();
    let path = s.data.join("f1");
    // What the kernel says locally.
    let local = std::fs::File::open(&path).unwrap();
    // SAFETY: flock is plain data; a valid descriptor and flock pointer.
    let local_errno = unsafe {
        let mut fl: libc::flock = std::mem::zeroed();
        fl.l_type = libc::F_WRLCK as i16;
        fl.l_whence = libc::SEEK_SET as i16;
        assert_eq!(
            libc::fcntl(local.as_raw_fd(), libc::F_OFD_SETLK, &mut fl),
            -1
        );
        std::io::Error::last_os_error().raw_os_error().unwrap()
    };
    assert_eq!(local_errno, libc::EBADF);
    drop(local);

    let mut c = s.session();
    let h = c.open("data", "f1", &ro(), 0).unwrap().handle;
    let fds = s.fds();
    for (start, len) in [(0, 0), (10, 5)] {
        let e = c.lock(h, 1, WRITE, start, len).unwrap_err();
        eprintln!("write lock on a read-only handle: {e}");
        assert_eq!(e.code, ErrorCode::BadHandle, "{e}");
        assert_eq!(lwio_client::errno::side(&e), local_errno, "{e}");
        assert!(e.message.contains("data/f1"), "{e}");
    }
    // Read again for a while: a descriptor the server has open for a
    // moment for something else must not fail the test.
    let after = s.fds_until(|n| n <= fds);
    assert!(
        after <= fds,
        "a refused write lock left a description: {fds} descriptors before, {after} after"
    );
    // Testing for a write lock is a query, as F_OFD_GETLK is locally.
    assert_eq!(c.test_lock(h, 1, WRITE, 0, 0).unwrap(), None);
    for o in 1..=3 {
        c.lock(h, o, READ, 0, 0).unwrap();
    }
    let modes = s.modes_of(&path);
    assert!(modes.len() >= 3, "descriptions of f1: {modes:?}");
    assert!(
        modes.iter().all(|&m| m == libc::O_RDONLY),
        "a read-only handle's lock descriptions must be O_RDONLY: access modes {modes:?}"
    );
    // Its read locks hold against writers of other sessions.
    let mut w = s.session();
    let wh = w.open("data", "f1", &rw(), 0).unwrap().handle;
    let e = w.lock(wh, 9, WRITE, 0, 0).unwrap_err();
    assert_eq!(e.code, ErrorCode::Locked, "{e}");
    c.close(h).unwrap();
    w.lock(wh, 9, WRITE, 0, 0).unwrap();
    let modes = s.modes_of(&path);
    assert!(
        modes.contains(&libc::O_RDWR),
        "the read-write handle's description: {modes:?}"
    );
}
