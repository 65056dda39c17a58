//! Reconnect and durable handles end to end (docs/reconnect.md): a real
//! `lwio serve` child, killed with SIGKILL and started again on the same
//! addresses under a client with files open and requests in flight; the
//! RDMA connection cut under a live server; durable handles refused to a
//! wrong secret and released when the grace period ends; a file replaced
//! while the server was down reported stale.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use lwio_client::{Client, ClientOptions, Error, OpenOptions};
use lwio_side::error::ErrorCode;
use lwio_side::{Login, Token};

mod netns;

/// A `lwio serve` child on fixed (after the first start) addresses.
struct Srv {
    child: Child,
    dir: PathBuf,
    /// Side channel and RDMA listen addresses.
    side: String,
    rdma: String,
    grace: &'static str,
}

impl Srv {
    /// Start on ephemeral ports with `limits.durable_grace = grace`.
    fn start(dir: &Path, grace: &'static str) -> Srv {
        Srv::start_on(dir, "127.0.0.1:0", "127.0.0.1:0", grace)
    }

    fn start_on(dir: &Path, side: &str, rdma: &str, grace: &'static str) -> Srv {
        std::fs::create_dir_all(dir.join("data")).unwrap();
        let cfg = dir.join("lwio.toml");
        std::fs::write(&cfg, format!("[limits]\ndurable_grace = \"{grace}\"\n")).unwrap();
        let (ready, stdout) = (dir.join("ready"), dir.join("stdout"));
        let _ = std::fs::remove_file(&ready);
        let child = Command::new(assert_cmd::cargo::cargo_bin("lwio"))
            .args(["serve", "--no-tls", "--provider", "soft", "--listen", side])
            .args(["--rdma-listen", rdma, "--config"])
            .arg(&cfg)
            .arg("--export")
            .arg(format!("data={}", dir.join("data").display()))
            .arg("--token-file")
            .arg(dir.join("token"))
            .arg("--ready-file")
            .arg(&ready)
            .env("RUST_LOG", "warn")
            .stdout(std::fs::File::create(&stdout).unwrap())
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
        let out = std::fs::read_to_string(&stdout).unwrap();
        let rdma = out
            .lines()
            .find_map(|l| l.strip_prefix("lwio: RDMA listening on "))
            .and_then(|l| l.split_whitespace().next())
            .expect("RDMA address printed")
            .to_string();
        Srv {
            child,
            dir: dir.to_path_buf(),
            side,
            rdma,
            grace,
        }
    }

    fn kill(&mut self) {
        let _ = self.child.kill(); // SIGKILL
        let _ = self.child.wait();
    }

    /// SIGKILL, then start again on the same addresses, the same export.
    fn restart(&mut self, between: impl FnOnce()) -> Duration {
        self.kill();
        between();
        let t0 = Instant::now();
        let mut n = Srv::start_on(&self.dir, &self.side, &self.rdma, self.grace);
        std::mem::swap(self, &mut n);
        std::mem::forget(n); // its child is reaped above
        t0.elapsed()
    }

    fn token(&self) -> String {
        std::fs::read_to_string(self.dir.join("token"))
            .unwrap()
            .trim()
            .to_string()
    }

    fn side_opts(&self) -> lwio_client::side::ClientOptions {
        lwio_client::side::ClientOptions::new(Login::Token(Token::new(&self.token()).unwrap()))
    }

    fn connect(&self, op_timeout: Duration) -> Client {
        let opts = ClientOptions {
            provider: lwio_rdma::ProviderChoice::Soft,
            op_timeout,
            connect_timeout: Duration::from_secs(5),
            credits: 32,
            ..ClientOptions::default()
        };
        Client::connect_with(
            &format!("lwio://{}/data", self.side),
            &self.side_opts(),
            opts,
        )
        .unwrap()
    }

    /// A separate side-channel session (same token).
    fn side_client(&self) -> lwio_client::side::Client {
        lwio_client::side::Client::connect(&self.side, &self.side_opts()).unwrap()
    }
}

/// `lwio_open_files` from the server's metrics, asked on `c`.
fn open_files(c: &mut lwio_client::side::Client) -> u64 {
    let t = c.stats().unwrap();
    t.lines()
        .find_map(|l| l.strip_prefix("lwio_open_files "))
        .and_then(|v| v.trim().parse().ok())
        .expect("lwio_open_files in the metrics")
}

impl Drop for Srv {
    fn drop(&mut self) {
        self.kill();
    }
}

fn rw() -> OpenOptions {
    OpenOptions::read_write().create(true)
}

const BLOCK: usize = 16 * 1024;
const THREADS: usize = 32;
const FILES: usize = 4;

/// The bytes of block `k` of thread `t` (distinct for every block).
fn block(t: usize, k: usize) -> Vec<u8> {
    let seed = (t * 7919 + k * 104_729) as u32;
    (0..BLOCK as u32)
        .map(|i| (i.wrapping_add(seed).wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect()
}

/// 32 threads each keep one blocking WRITE in flight (thread t writes its
/// own blocks of file t % 4) until `stop`, then a final round; returns
/// each thread's block count.
fn writers(
    files: &Arc<Vec<lwio_client::File>>,
    stop: &Arc<AtomicBool>,
    done: &Arc<AtomicUsize>,
) -> Vec<std::thread::JoinHandle<usize>> {
    (0..THREADS)
        .map(|t| {
            let (files, stop, done) = (files.clone(), stop.clone(), done.clone());
            std::thread::spawn(move || {
                let f = &files[t % FILES];
                let slot = t / FILES; // 8 threads share a file, interleaved
                let mut k = 0;
                while !stop.load(Ordering::Relaxed) || k < 4 {
                    let off = ((k * (THREADS / FILES) + slot) * BLOCK) as u64;
                    let n = f
                        .write_at(&block(t, k), off)
                        .unwrap_or_else(|e| panic!("thread {t} block {k}: {e}"));
                    assert_eq!(n, BLOCK);
                    k += 1;
                    done.fetch_add(1, Ordering::Relaxed);
                }
                k
            })
        })
        .collect()
}

/// The ordering rule (docs/reconnect.md): one thread rewrites the same 4
/// KiB at offset 0 of `f` with version 0, 1, 2, … until `stop`; a write
/// that returned is never overtaken by an earlier one re-sent or applied
/// late, so the file ends with the last version. Returns it.
fn orderer(
    f: lwio_client::File,
    stop: &Arc<AtomicBool>,
) -> std::thread::JoinHandle<(lwio_client::File, u64)> {
    let stop = stop.clone();
    std::thread::spawn(move || {
        let mut v = 0u64;
        loop {
            f.write_at(&version(v), 0)
                .unwrap_or_else(|e| panic!("version {v}: {e}"));
            if stop.load(Ordering::Relaxed) {
                return (f, v);
            }
            v += 1;
        }
    })
}

fn version(v: u64) -> Vec<u8> {
    v.to_le_bytes().repeat(512)
}

/// What file `i` must hold after the writers wrote `counts` blocks.
fn expected(i: usize, counts: &[usize]) -> Vec<u8> {
    let per = THREADS / FILES;
    let max = (0..THREADS)
        .filter(|t| t % FILES == i)
        .map(|t| counts[t])
        .max()
        .unwrap();
    let mut v = vec![0u8; 0];
    for k in 0..max {
        for slot in 0..per {
            let t = slot * FILES + i;
            let off = (k * per + slot) * BLOCK;
            if k < counts[t] {
                if v.len() < off + BLOCK {
                    v.resize(off + BLOCK, 0);
                }
                v[off..off + BLOCK].copy_from_slice(&block(t, k));
            }
        }
    }
    v
}

/// Poll `what` every 10 ms until it holds, at most `bound`.
fn wait_until(bound: Duration, mut what: impl FnMut() -> bool) -> bool {
    let t0 = Instant::now();
    while t0.elapsed() < bound {
        if what() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    what()
}

#[test]
fn server_killed_and_restarted_under_32_writes_in_flight() {
    let dir = tempfile::tempdir().unwrap();
    let mut srv = Srv::start(dir.path(), "60s");
    let client = srv.connect(Duration::from_secs(20));
    let mut restart = Duration::ZERO;
    let resumed = writes_survive(&client, dir.path(), "f", || restart = srv.restart(|| {}));
    eprintln!(
        "restart took {restart:?}; writes flowing again {resumed:?} later; {} reconnects",
        client.reconnects()
    );
}

/// 32 writers (and the ordering thread) on 4 files named PREFIX0..3 of
/// `client`; `fault` happens once 200 blocks are written; then 200 more
/// must complete, every call returns `Ok`, and the files are exact byte
/// for byte on the server's disk (`dir`/data) and read back over RDMA.
/// Returns how long after the fault the writes flowed again.
fn writes_survive(client: &Client, dir: &Path, prefix: &str, fault: impl FnOnce()) -> Duration {
    let files: Arc<Vec<_>> = Arc::new(
        (0..FILES)
            .map(|i| client.open(&format!("{prefix}{i}"), &rw()).unwrap())
            .collect(),
    );
    let (stop, done) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicUsize::new(0)),
    );
    let threads = writers(&files, &stop, &done);
    let order = orderer(
        client.open(&format!("{prefix}-order"), &rw()).unwrap(),
        &stop,
    );
    assert!(wait_until(Duration::from_secs(20), || done
        .load(Ordering::Relaxed)
        >= 200));
    let before = done.load(Ordering::Relaxed);
    fault();
    let t0 = Instant::now();
    assert!(
        wait_until(Duration::from_secs(20), || done.load(Ordering::Relaxed)
            >= before + 200),
        "no progress after the fault"
    );
    let resumed = t0.elapsed();
    stop.store(true, Ordering::Relaxed);
    let counts: Vec<usize> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    let (order, last) = order.join().unwrap();
    let disk = std::fs::read(dir.join(format!("data/{prefix}-order"))).unwrap();
    assert!(
        disk == version(last),
        "offset 0 holds an older version than {last}"
    );
    order.close().unwrap();
    assert!(client.reconnects() >= 1, "a reconnect was counted");
    for (i, f) in files.iter().enumerate() {
        let want = expected(i, &counts);
        let disk = std::fs::read(dir.join(format!("data/{prefix}{i}"))).unwrap();
        assert!(
            disk == want,
            "file {prefix}{i}: {} bytes on disk, {} expected",
            disk.len(),
            want.len()
        );
        let mut back = vec![0u8; want.len()];
        assert_eq!(f.read_at(&mut back, 0).unwrap(), want.len());
        assert!(back == want, "file {prefix}{i} read back differs");
    }
    resumed
}

#[test]
fn replaced_file_is_stale_after_restart_others_continue() {
    let dir = tempfile::tempdir().unwrap();
    let mut srv = Srv::start(dir.path(), "60s");
    let client = srv.connect(Duration::from_secs(20));
    let keep = client.open("keep", &rw()).unwrap();
    let gone = client.open("replaced", &rw()).unwrap();
    keep.write_at(b"kept", 0).unwrap();
    gone.write_at(b"old file", 0).unwrap();
    let data = dir.path().join("data");
    srv.restart(|| {
        // Another file takes the path while the server is down.
        std::fs::write(data.join("replaced.new"), b"new file").unwrap();
        std::fs::rename(data.join("replaced.new"), data.join("replaced")).unwrap();
    });
    let e = gone.write_at(b"lost?", 0).unwrap_err();
    assert!(matches!(e, Error::Stale(_)), "{e}");
    assert!(
        e.to_string().starts_with(
            "stale file handle: data/replaced: another file after the server restarted"
        ),
        "{e}"
    );
    assert_eq!(lwio_client::errno::client(&e), libc::ESTALE);
    // It stays stale, and the new file is untouched.
    assert!(matches!(
        gone.read_at(&mut [0u8; 4], 0),
        Err(Error::Stale(_))
    ));
    assert_eq!(std::fs::read(data.join("replaced")).unwrap(), b"new file");
    // The other file goes on.
    keep.write_at(b"KEPT", 4).unwrap();
    let mut b = [0u8; 8];
    assert_eq!(keep.read_at(&mut b, 0).unwrap(), 8);
    assert_eq!(&b, b"keptKEPT");
    gone.close().unwrap();
    keep.close().unwrap();
}

#[test]
fn wrong_secret_cannot_claim_durable_handles() {
    let dir = tempfile::tempdir().unwrap();
    let srv = Srv::start(dir.path(), "60s");
    let client = srv.connect(Duration::from_secs(10));
    let f = client.open("mine", &rw()).unwrap();
    f.write_at(b"mine", 0).unwrap();
    let victim = client.side(|s| Ok(s.session().clone())).unwrap();
    // Another session of the same token, guessing the secret.
    let mut thief = srv.side_client();
    let mut forged = victim.clone();
    forged.secret = lwio_side::SessionSecret([0x55; 32]);
    let e = thief.resume(&forged).unwrap_err();
    assert_eq!(e.code, ErrorCode::PermissionDenied);
    assert_eq!(e.message, lwio_server::server::RESUME_REFUSED);
    // Its own session id with the victim's id is no better; nothing moved.
    let e = thief
        .resume(&lwio_client::side::Session { id: 999, ..forged })
        .unwrap_err();
    assert_eq!(e.message, lwio_server::server::RESUME_REFUSED);
    let e = thief.rekey(f.handle()).unwrap_err();
    assert_eq!(e.code, ErrorCode::BadHandle, "{e}");
    f.write_at(b"MINE", 0).unwrap();
    let mut b = [0u8; 4];
    f.read_at(&mut b, 0).unwrap();
    assert_eq!(&b, b"MINE");
}

#[test]
fn durable_handles_released_when_grace_ends() {
    let dir = tempfile::tempdir().unwrap();
    let srv = Srv::start(dir.path(), "1s");
    let mut obs = srv.side_client();
    let baseline = open_files(&mut obs);
    let mut lost = srv.side_client();
    let o = lwio_side::types::OpenOptions {
        create: true,
        ..lwio_side::types::OpenOptions::READ_WRITE
    };
    for i in 0..3 {
        lost.open("data", &format!("g{i}"), &o, 0o644).unwrap();
    }
    assert_eq!(open_files(&mut obs), baseline + 3);
    let t0 = Instant::now();
    drop(lost); // the connection goes; the files are kept for the grace
    assert!(wait_until(Duration::from_secs(2), || open_files(&mut obs)
        == baseline + 3));
    assert!(
        wait_until(Duration::from_secs(5), || open_files(&mut obs) == baseline),
        "durable handles not released after the grace period"
    );
    let took = t0.elapsed();
    assert!(
        took >= Duration::from_millis(900),
        "released after {took:?}, before the 1 s grace"
    );
    eprintln!("durable handles released {took:?} after the session was lost (grace 1 s)");
}

/// The RDMA connection cut under a live server (`ss -K` on the client's
/// socket of the soft provider, in a private network namespace): the 32
/// writes in flight complete after the reconnect, byte for byte.
#[test]
fn rdma_connection_cut_in_flight_requests_complete() {
    if !netns::inside("rdma_connection_cut_in_flight_requests_complete") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let srv = Srv::start(dir.path(), "60s");
    let client = srv.connect(Duration::from_secs(20));
    let port = srv.rdma.rsplit_once(':').unwrap().1.to_string();
    let resumed = writes_survive(&client, dir.path(), "c", || {
        netns::cut(&port);
    });
    eprintln!(
        "RDMA socket cut; writes flowing again {resumed:?} later; {} reconnects",
        client.reconnects()
    );
}
