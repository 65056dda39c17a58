//! One server, a thousand clients (issue 13): 1,000 clients of one server
//! (soft provider, loopback), each with a file of its own open. With 999 of
//! them idle the first runs QD1 reads that must all complete and be right;
//! then every client does one READ and one WRITE, checked byte for byte
//! (through lwio and on the export's disk). The server's RSS growth and
//! registered memory per idle connection are measured and held under
//! bounds, and its threads do not grow with connections (reactors and the
//! shared receive pool, issue 13).
//!
//! The server runs in a child process, so that its RSS and threads are its
//! own, not the clients': this test's own executable started again with
//! `LWIO_THOUSAND_SERVE=DIR` runs a `LocalServer` on DIR (the configuration
//! below, parsed as `lwio serve` parses its file) and answers "?" lines on
//! its stdin with its figures; it exits when its stdin closes. Hence
//! `harness = false` (crates/lwio/Cargo.toml): `main` is the test.

use std::path::Path;
use std::time::{Duration, Instant};

use lwio::scale::{qd1_reads, raise_nofile, ProcStatus};
use lwio_client::{Client, ClientOptions, File, OpenOptions};
use lwio_rdma::conformance::pattern;
use lwio_server::config::Config;
use lwio_server::io_phase::driver::RdmaServerOptions;
use lwio_server::io_phase::testkit::LocalServer;

#[path = "common/child.rs"]
mod child;
#[path = "common/harness.rs"]
mod harness;

use child::ChildServer;

const TOKEN: &str = "e2e-thousand-token-0123456789";
const SERVE_ENV: &str = "LWIO_THOUSAND_SERVE";
const CLIENTS: usize = 1000;
/// Threads that connect the clients (and later drive their I/O).
const THREADS: usize = 4;
/// Bytes of each client's file.
const FILE: usize = 8192;
/// The hot client's own file (QD1 reads at random offsets of it).
const HOT: usize = 1 << 20;
/// Server RSS growth per idle connection allowed (generous: issue 13's
/// target is 64 KiB; the figure is printed).
const RSS_PER_CONN_KIB: f64 = 96.0;
/// Registered memory per idle connection allowed: one chunk of send slots
/// (4 KiB) and a share of the pool's reserve of receive buffers (one per
/// 32 connections, 64 KiB + header each, plus a chunk of 16 per reactor).
const REGISTERED_PER_CONN_KIB: f64 = 16.0;

/// `lwio serve`'s defaults (the registered-memory budget, the receive
/// buffer size, the server-wide caps of 4,096 sessions and connections)
/// except what 1,000 clients of one host, all logged in with the one token,
/// need.
const CONFIG: &str = r#"
[limits]
# All the clients come from 127.0.0.1 (64 side-channel connections per
# address by default).
max_connections_per_host = 1100
# The shared token is one user (64 sessions per user).
max_sessions_per_user = 1100
# Connecting 1,000 clients in seconds, not at 20 new connections per
# second from one address (200 server-wide).
unauth_rate_per_host = 5000
unauth_burst_per_host = 5000
unauth_rate = 5000
unauth_burst = 5000
# RDMA connections from one address (32).
max_rdma_connections_per_host = 1100
"#;

/// The server child's side: serve `root` until stdin closes.
fn serve_child(root: &str) {
    let cfg = Config::from_toml(CONFIG).expect("CONFIG parses");
    let rdma = RdmaServerOptions::from_config(&cfg, "127.0.0.1:0".parse().unwrap());
    let s = LocalServer::start(Path::new(root), "ex", TOKEN, cfg.limits.clone(), rdma)
        .expect("server starts");
    child::serve(s.side_addr, || {
        let st = s.rdma.stats();
        vec![
            st.connections as u64,
            st.registered_bytes as u64,
            s.state.open_files.len() as u64,
            s.rdma.receive_pool().promised as u64,
        ]
    })
}

/// The server child, from the test's side.
struct Server {
    c: ChildServer,
    side_addr: String,
}

/// The server's RDMA connections, registered bytes and open files.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Figures {
    connections: u64,
    registered: u64,
    open_files: u64,
    /// Credits the connections hold (the receive pools' promises).
    credits: u64,
}

impl Server {
    fn start(root: &Path) -> Server {
        let c = ChildServer::start(SERVE_ENV, root);
        let side_addr = c.side_addr.clone();
        Server { c, side_addr }
    }

    fn figures(&mut self) -> Figures {
        let v = self.c.figures(4);
        Figures {
            connections: v[0],
            registered: v[1],
            open_files: v[2],
            credits: v[3],
        }
    }

    fn status(&self) -> ProcStatus {
        ProcStatus::of(self.c.pid()).expect("server status")
    }

    /// Wait until the server has `n` RDMA connections (bounded).
    fn wait_connections(&mut self, n: u64) -> Figures {
        let t0 = Instant::now();
        loop {
            let f = self.figures();
            if f.connections == n {
                return f;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "server: {} RDMA connections after 30 s, want {n}",
                f.connections
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

fn content(i: usize) -> Vec<u8> {
    pattern(i as u64, FILE)
}

/// What client `i` writes over the second half of its file.
fn written(i: usize) -> Vec<u8> {
    pattern(1_000_000 + i as u64, FILE / 2)
}

fn opts() -> ClientOptions {
    ClientOptions {
        op_timeout: Duration::from_secs(60),
        connect_timeout: Duration::from_secs(30),
        ..ClientOptions::default()
    }
}

fn connect(url: &str, i: usize) -> (Client, File) {
    let c = Client::connect(url, Some(TOKEN), opts().no_tls())
        .unwrap_or_else(|e| panic!("client {i} of {CLIENTS}: connect: {e}"));
    let f = c
        .open(&format!("c{i:04}"), &OpenOptions::read_write())
        .unwrap_or_else(|e| panic!("client {i}: open: {e}"));
    (c, f)
}

fn write_files(dir: &Path) {
    for i in 0..CLIENTS {
        std::fs::write(dir.join(format!("c{i:04}")), content(i)).unwrap();
    }
    std::fs::write(dir.join("hot"), pattern(u64::MAX, HOT)).unwrap();
}

fn main() {
    if let Ok(root) = std::env::var(SERVE_ENV) {
        return serve_child(&root);
    }
    harness::run(
        "a_thousand_clients_on_one_server",
        a_thousand_clients_on_one_server,
    );
}

fn a_thousand_clients_on_one_server() {
    // Per client here about 8 descriptors (side and RDMA sockets, the
    // side runtime's and the provider's epoll and eventfds), about 6 in the
    // server (which inherits this limit); the hard limit here is 20,000.
    let nofile = raise_nofile(20_000);
    assert!(
        nofile >= 12_000,
        "RLIMIT_NOFILE {nofile}: 1,000 clients need about 12,000 descriptors"
    );
    let t_all = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    write_files(dir.path());
    let mut s = Server::start(dir.path());
    let url = format!("lwio://{}/ex", s.side_addr);

    // One client first, for what the server sets up once: the baseline is
    // taken after it left.
    drop(connect(&url, 0));
    s.wait_connections(0);
    let base = s.status();
    let own0 = ProcStatus::own().unwrap();

    // Connect the thousand, THREADS at a time.
    let t = Instant::now();
    let mut clients: Vec<(Client, File)> = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..THREADS)
            .map(|k| {
                let url = &url;
                sc.spawn(move || {
                    (k..CLIENTS)
                        .step_by(THREADS)
                        .map(|i| (i, connect(url, i)))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        let mut all: Vec<_> = hs.into_iter().flat_map(|h| h.join().unwrap()).collect();
        all.sort_by_key(|(i, _)| *i);
        all.into_iter().map(|(_, c)| c).collect()
    });
    let connect_time = t.elapsed();
    // Idle connections give their extra credits back after 2 s (down to
    // one each) and the pool what they no longer need: wait for that
    // (bounded), then a little for the pool's compaction.
    let t0 = Instant::now();
    loop {
        let f = s.figures();
        if f.credits == CLIENTS as u64 {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "idle connections still hold {} credits after 60 s (want {CLIENTS})",
            f.credits
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    std::thread::sleep(Duration::from_millis(500));
    let (idle, m) = (s.status(), s.figures());
    let own = ProcStatus::own().unwrap();
    assert_eq!(m.connections, CLIENTS as u64);
    assert_eq!(m.open_files, CLIENTS as u64);
    let per_kib = (idle.rss_kib as f64 - base.rss_kib as f64) / CLIENTS as f64;
    let registered = m.registered as f64;
    eprintln!(
        "{CLIENTS} clients connected in {connect_time:?} ({THREADS} threads); server per idle connection: \
         RSS +{per_kib:.1} KiB ({} -> {} KiB), registered {:.1} KiB, threads +{:.2} ({} -> {}); \
         this process per client: RSS +{:.1} KiB, threads +{:.2}",
        base.rss_kib,
        idle.rss_kib,
        registered / 1024.0 / CLIENTS as f64,
        (idle.threads as f64 - base.threads as f64) / CLIENTS as f64,
        base.threads,
        idle.threads,
        (own.rss_kib as f64 - own0.rss_kib as f64) / CLIENTS as f64,
        (own.threads as f64 - own0.threads as f64) / CLIENTS as f64,
    );
    assert!(
        per_kib <= RSS_PER_CONN_KIB,
        "server RSS grew {per_kib:.1} KiB per idle connection (bound {RSS_PER_CONN_KIB} KiB)"
    );
    let reg_kib = registered / 1024.0 / CLIENTS as f64;
    assert!(
        reg_kib <= REGISTERED_PER_CONN_KIB,
        "{reg_kib:.1} KiB registered per idle connection (bound {REGISTERED_PER_CONN_KIB} KiB)"
    );
    // A fixed set of threads (reactors, storage, the side channel's
    // runtime, which may start a few more on demand), not one per
    // connection.
    assert!(
        idle.threads <= base.threads + 10,
        "server threads grew with connections: {} -> {}",
        base.threads,
        idle.threads
    );

    // A hot client, the others idle: QD1 reads, each checked.
    let t = Instant::now();
    let hot = clients[0]
        .0
        .open("hot", &OpenOptions::read_only())
        .expect("hot file");
    let want = pattern(u64::MAX, HOT);
    let h = qd1_reads(&hot, HOT as u64, Some(&want), Duration::from_secs(2), 1000)
        .expect("hot client's reads");
    let hot_time = t.elapsed();
    eprintln!(
        "hot client, {} idle: {} QD1 4 KiB reads in {hot_time:?}, p50 {:.1} us, p99 {:.1} us",
        CLIENTS - 1,
        h.len(),
        h.value_at_quantile(0.5) as f64 / 1e3,
        h.value_at_quantile(0.99) as f64 / 1e3
    );
    hot.close().unwrap();

    // Every client: one READ and one WRITE (the slowest of each printed).
    let t = Instant::now();
    let slowest = std::thread::scope(|sc| {
        let per = CLIENTS.div_ceil(THREADS);
        let hs: Vec<_> = clients
            .chunks(per)
            .enumerate()
            .map(|(k, chunk)| {
                sc.spawn(move || {
                    let mut slowest = (Duration::ZERO, Duration::ZERO);
                    for (j, (_, f)) in chunk.iter().enumerate() {
                        let i = k * per + j;
                        let mut back = vec![0u8; FILE];
                        let t = Instant::now();
                        assert_eq!(f.read_at(&mut back, 0).unwrap(), FILE, "client {i}");
                        slowest.0 = slowest.0.max(t.elapsed());
                        assert!(back == content(i), "client {i} read other bytes");
                        let w = written(i);
                        let t = Instant::now();
                        assert_eq!(f.write_at(&w, (FILE / 2) as u64).unwrap(), w.len());
                        slowest.1 = slowest.1.max(t.elapsed());
                    }
                    slowest
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap())
            .fold((Duration::ZERO, Duration::ZERO), |a, b| {
                (a.0.max(b.0), a.1.max(b.1))
            })
    });
    let io_time = t.elapsed();
    for i in 0..CLIENTS {
        let mut want = content(i);
        want[FILE / 2..].copy_from_slice(&written(i));
        let disk = std::fs::read(dir.path().join(format!("c{i:04}"))).unwrap();
        assert!(disk == want, "client {i}: the export's file differs");
    }

    let t = Instant::now();
    for (c, f) in clients.drain(..) {
        f.close().unwrap();
        drop(c);
    }
    let m = s.wait_connections(0);
    let after = s.status();
    assert_eq!(m.registered, 0, "registered bytes left");
    assert_eq!(m.open_files, 0, "open files left");
    eprintln!(
        "phases: connect {connect_time:?}, hot client {hot_time:?}, read+write {io_time:?} \
         (slowest READ {:?}, WRITE {:?}), close {:?}; \
         in all {:?}; server after: RSS {} KiB, threads {}",
        slowest.0,
        slowest.1,
        t.elapsed(),
        t_all.elapsed(),
        after.rss_kib,
        after.threads
    );
}
