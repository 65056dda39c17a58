//! A `lwio serve` child for the reconnect and failover tests
//! (e2e_reconnect.rs, e2e_multichannel.rs), and running a test again in a
//! private network namespace where `ss -K` may cut its connections.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use lwio_client::{Client, ClientOptions, File, OpenOptions};
use lwio_side::{Login, Token};

/// A `lwio serve` child on fixed (after the first start) addresses.
pub struct Srv {
    pub child: Child,
    pub dir: PathBuf,
    /// Side channel and RDMA listen addresses.
    pub side: String,
    pub rdma: String,
    pub grace: &'static str,
}

impl Srv {
    /// Start on ephemeral ports with `limits.durable_grace = grace`.
    pub fn start(dir: &Path, grace: &'static str) -> Srv {
        Srv::start_on(dir, "127.0.0.1:0", "127.0.0.1:0", grace)
    }

    pub fn start_on(dir: &Path, side: &str, rdma: &str, grace: &'static str) -> Srv {
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

    pub fn kill(&mut self) {
        let _ = self.child.kill(); // SIGKILL
        let _ = self.child.wait();
    }

    /// SIGKILL, then start again on the same addresses, the same export.
    pub fn restart(&mut self, between: impl FnOnce()) -> Duration {
        self.kill();
        between();
        let t0 = Instant::now();
        let mut n = Srv::start_on(&self.dir, &self.side, &self.rdma, self.grace);
        std::mem::swap(self, &mut n);
        std::mem::forget(n); // its child is reaped above
        t0.elapsed()
    }

    pub fn token(&self) -> String {
        std::fs::read_to_string(self.dir.join("token"))
            .unwrap()
            .trim()
            .to_string()
    }

    pub fn side_opts(&self) -> lwio_client::side_client::SideOptions {
        lwio_client::side_client::SideOptions::new(Login::Token(Token::new(&self.token()).unwrap()))
    }

    pub fn connect(&self, op_timeout: Duration) -> Client {
        self.connect_opts(ClientOptions {
            op_timeout,
            ..Srv::opts()
        })
    }

    /// The options of [`Srv::connect`]: soft provider, 32 credits.
    pub fn opts() -> ClientOptions {
        ClientOptions {
            provider: lwio_rdma::ProviderChoice::Soft,
            op_timeout: Duration::from_secs(20),
            connect_timeout: Duration::from_secs(5),
            credits: 32,
            ..ClientOptions::default()
        }
    }

    pub fn connect_opts(&self, opts: ClientOptions) -> Client {
        Client::connect_with(
            &format!("lwio://{}/data", self.side),
            &self.side_opts(),
            opts,
        )
        .unwrap()
    }

    /// A separate side-channel session (same token).
    pub fn side_client(&self) -> lwio_client::side_client::SideClient {
        lwio_client::side_client::SideClient::connect(&self.side, &self.side_opts()).unwrap()
    }
}

/// `lwio_open_files` from the server's metrics, asked on `c`.
pub fn open_files(c: &mut lwio_client::side_client::SideClient) -> u64 {
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

/// Poll `what` every 10 ms until it holds, at most `bound`.
pub fn wait_until(bound: Duration, mut what: impl FnMut() -> bool) -> bool {
    let t0 = Instant::now();
    while t0.elapsed() < bound {
        if what() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    what()
}

/// Whether this is the copy of test `name` that runs inside `unshare -rn`
/// (its own loopback, where `ss -K` may destroy sockets). If not, run the
/// test binary again there for just that test, assert that it passed, and
/// return false: the caller returns.
pub fn in_netns(name: &str) -> bool {
    if std::env::var_os("LWIO_TEST_IN_NETNS").is_some() {
        return true;
    }
    let me = std::env::current_exe().unwrap();
    let out = Command::new("unshare")
        .args(["-rn", "sh", "-c", "ip link set lo up && exec \"$0\" \"$@\""])
        .arg(&me)
        .args(["--exact", name, "--nocapture"])
        .env("LWIO_TEST_IN_NETNS", "1")
        .output()
        .expect("unshare runs (util-linux)");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "in the namespace: {text}");
    assert!(
        text.contains("1 passed"),
        "the test ran in the namespace: {text}"
    );
    false
}

pub fn rw() -> OpenOptions {
    OpenOptions::read_write().create(true)
}

/// The size of a test block.
pub const BLOCK: usize = 16 * 1024;
/// The bytes of block `k` of thread `t` (distinct for every block).
pub fn block(t: usize, k: usize) -> Vec<u8> {
    let seed = (t * 7919 + k * 104_729) as u32;
    (0..BLOCK as u32)
        .map(|i| (i.wrapping_add(seed).wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect()
}

/// The ordering rule (docs/reconnect.md): one thread rewrites the same 4
/// KiB at offset 0 of `f` with version 0, 1, 2, … until `stop`; a write
/// that returned is never overtaken by an earlier one re-sent or applied
/// late, so the file ends with the last version. Returns it.
pub fn orderer(f: File, stop: &Arc<AtomicBool>) -> std::thread::JoinHandle<(File, u64)> {
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

pub fn version(v: u64) -> Vec<u8> {
    v.to_le_bytes().repeat(512)
}

/// Destroy the client's sockets of the RDMA connections to `port` (all of
/// them, or the one from local port `sport`) with `ss -K`.
pub fn cut(port: &str, sport: Option<&str>) {
    let mut ss = Command::new("ss");
    ss.args(["-K", "dst", "127.0.0.1", "dport", "=", &format!(":{port}")]);
    if let Some(p) = sport {
        ss.args(["sport", "=", &format!(":{p}")]);
    }
    let out = ss.output().expect("ss runs");
    let killed = String::from_utf8_lossy(&out.stdout).into_owned();
    let want = format!("127.0.0.1:{}", sport.unwrap_or(port));
    assert!(killed.contains(&want), "ss -K killed {want}: {killed}");
}

/// Where thread `t` of `threads` writes its block `k`: in file `t % files`,
/// the threads of a file interleaved block by block.
pub fn offset(t: usize, k: usize, threads: usize, files: usize) -> u64 {
    ((k * (threads / files) + t / files) * BLOCK) as u64
}

/// What file `i` of `files` must hold after thread `t` wrote `counts[t]`
/// blocks at [`offset`].
pub fn expected(i: usize, counts: &[usize], files: usize) -> Vec<u8> {
    let mut v = Vec::new();
    for t in (0..counts.len()).filter(|t| t % files == i) {
        for k in 0..counts[t] {
            let off = offset(t, k, counts.len(), files) as usize;
            if v.len() < off + BLOCK {
                v.resize(off + BLOCK, 0);
            }
            v[off..off + BLOCK].copy_from_slice(&block(t, k));
        }
    }
    v
}

/// Worker threads, each returning how many blocks it wrote.
pub type Workers = Vec<std::thread::JoinHandle<usize>>;

/// `workers(stop, done)` (each call counted in `done`, until `stop`) and
/// the ordering thread (on file PREFIX-order) run on `client`; `fault`
/// happens once 200 are done; then 200 more must be done after it. Every
/// call returns `Ok` (the workers panic otherwise), and file `files[i]`,
/// named PREFIXi, is exact byte for byte ([`expected`]) on the server's
/// disk (`dir`/data) and read back over RDMA. Returns how long the 200
/// after the fault took.
pub fn survive(
    client: &Client,
    dir: &Path,
    prefix: &str,
    files: &[File],
    workers: impl FnOnce(&Arc<AtomicBool>, &Arc<AtomicUsize>) -> Workers,
    fault: impl FnOnce(),
) -> Duration {
    let (stop, done) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicUsize::new(0)),
    );
    let threads = workers(&stop, &done);
    let order = orderer(
        client.open(&format!("{prefix}-order"), &rw()).unwrap(),
        &stop,
    );
    let done_now = || done.load(Ordering::Relaxed);
    assert!(wait_until(Duration::from_secs(30), || done_now() >= 200));
    fault();
    let (before, t0) = (done_now(), Instant::now());
    assert!(
        wait_until(Duration::from_secs(30), || done_now() >= before + 200),
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
    for (i, f) in files.iter().enumerate() {
        let want = expected(i, &counts, files.len());
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
    eprintln!(
        "{prefix}: {} blocks of {} threads, exact on disk and read back",
        counts.iter().sum::<usize>(),
        counts.len()
    );
    resumed
}

/// Open (create) files PREFIX0..PREFIX(n-1) on `client`.
pub fn open_all(client: &Client, prefix: &str, n: usize) -> Arc<Vec<File>> {
    Arc::new(
        (0..n)
            .map(|i| client.open(&format!("{prefix}{i}"), &rw()).unwrap())
            .collect(),
    )
}
