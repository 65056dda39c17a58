//! 100,000 open files on one server (issue 13): 10 clients open 10,000
//! distinct files each through lwio, all of them open at once, read every
//! one once (checked byte for byte), then close them all. The server holds
//! them with a bounded number of descriptors (the descriptor cache,
//! docs/descriptor-cache.md) under a process limit (RLIMIT_NOFILE 20,000
//! here, and on CI) far below 100,000; its descriptors stay under that
//! limit throughout, and afterwards its open files, cached descriptors,
//! registered bytes and descriptor count are back to the baseline.
//!
//! The server runs in a child process (common/child.rs), so that the
//! descriptors counted are its own; hence `harness = false`.

use std::path::Path;
use std::time::{Duration, Instant};

use lwio::scale::raise_nofile;
use lwio_client::{Client, ClientOptions, File, OpenOptions};
use lwio_server::config::Config;
use lwio_server::io_phase::driver::RdmaServerOptions;
use lwio_server::io_phase::testkit::LocalServer;

#[path = "common/child.rs"]
mod child;
#[path = "common/harness.rs"]
mod harness;

use child::ChildServer;

const TOKEN: &str = "e2e-hundred-thousand-token-0123";
const SERVE_ENV: &str = "LWIO_HUNDRED_THOUSAND_SERVE";
const CLIENTS: usize = 10;
const PER_CLIENT: usize = 10_000;
const FILES: usize = CLIENTS * PER_CLIENT;

/// The defaults (16,384 open files per session, descriptors: half of
/// RLIMIT_NOFILE) with a cache bound well below the files, so that most
/// of them are reopened on their read.
const CONFIG: &str = r#"
[limits]
max_open_descriptors = 4096
"#;

/// Figures the child reports, in order.
const FIGURES: usize = 8;

fn serve_child(root: &str) {
    let cfg = Config::from_toml(CONFIG).expect("CONFIG parses");
    let rdma = RdmaServerOptions::from_config(&cfg, "127.0.0.1:0".parse().unwrap());
    let s = LocalServer::start(Path::new(root), "ex", TOKEN, cfg.limits.clone(), rdma)
        .expect("server starts");
    child::serve(s.side_addr, || {
        let st = s.rdma.stats();
        let c = s.state.open_files.descriptors().stats();
        vec![
            st.connections as u64,
            st.registered_bytes as u64,
            s.state.open_files.len() as u64,
            c.open as u64,
            c.peak as u64,
            c.evictions,
            c.reopens,
            c.stale,
        ]
    })
}

#[derive(Debug, Clone, Copy)]
struct Figures {
    connections: u64,
    registered: u64,
    open_files: u64,
    descriptors: u64,
    peak: u64,
    evictions: u64,
    reopens: u64,
    stale: u64,
}

fn figures(s: &mut ChildServer) -> Figures {
    let v = s.figures(FIGURES);
    Figures {
        connections: v[0],
        registered: v[1],
        open_files: v[2],
        descriptors: v[3],
        peak: v[4],
        evictions: v[5],
        reopens: v[6],
        stale: v[7],
    }
}

/// Wait (bounded) until the server has `n` RDMA connections.
fn wait_connections(s: &mut ChildServer, n: u64) -> Figures {
    let t0 = Instant::now();
    loop {
        let f = figures(s);
        if f.connections == n {
            return f;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "server: {} RDMA connections after 30 s, want {n}",
            f.connections
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn name(i: usize) -> String {
    format!("c{}/f{i:06}", i / PER_CLIENT)
}

/// File `i`'s bytes: its index, distinct from every other file's.
fn content(i: usize) -> Vec<u8> {
    format!("file {i:06} of {FILES}\n").into_bytes()
}

fn write_files(dir: &Path) {
    for c in 0..CLIENTS {
        std::fs::create_dir(dir.join(format!("c{c}"))).unwrap();
    }
    for i in 0..FILES {
        std::fs::write(dir.join(name(i)), content(i)).unwrap();
    }
}

fn opts() -> ClientOptions {
    ClientOptions {
        op_timeout: Duration::from_secs(60),
        connect_timeout: Duration::from_secs(30),
        ..ClientOptions::default()
    }
}

fn main() {
    if let Ok(root) = std::env::var(SERVE_ENV) {
        return serve_child(&root);
    }
    harness::run(
        "a_hundred_thousand_open_files_on_one_server",
        a_hundred_thousand_open_files_on_one_server,
    );
}

fn a_hundred_thousand_open_files_on_one_server() {
    let nofile = raise_nofile(20_000);
    assert!(
        nofile < FILES as u64 || nofile >= 20_000,
        "RLIMIT_NOFILE {nofile}"
    );
    let t_all = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    write_files(dir.path());
    let create_time = t_all.elapsed();
    let mut s = ChildServer::start(SERVE_ENV, dir.path());
    let url = format!("lwio://{}/ex", s.side_addr);

    // One client first, for what the server sets up once.
    {
        let c = Client::connect(&url, Some(TOKEN), opts().no_tls()).expect("connect");
        let f = c.open(&name(0), &OpenOptions::read_only()).expect("open");
        f.close().unwrap();
    }
    let base = wait_connections(&mut s, 0);
    let base_fds = s.fds();
    assert_eq!((base.open_files, base.descriptors), (0, 0));

    // Each client opens its 10,000 files; all are open at once.
    let t = Instant::now();
    let clients: Vec<(Client, Vec<File>)> = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..CLIENTS)
            .map(|k| {
                let url = &url;
                sc.spawn(move || {
                    let c = Client::connect(url, Some(TOKEN), opts().no_tls())
                        .unwrap_or_else(|e| panic!("client {k}: connect: {e}"));
                    let files: Vec<File> = (k * PER_CLIENT..(k + 1) * PER_CLIENT)
                        .map(|i| {
                            c.open(&name(i), &OpenOptions::read_only())
                                .unwrap_or_else(|e| panic!("client {k}: open {}: {e}", name(i)))
                        })
                        .collect();
                    (c, files)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let open_time = t.elapsed();
    let open = figures(&mut s);
    let open_fds = s.fds();
    assert_eq!(open.open_files, FILES as u64, "open files on the server");
    assert!(open.descriptors <= 4096 + 64, "{open:?}");

    // Every file read once, checked.
    let t = Instant::now();
    std::thread::scope(|sc| {
        for (k, (_, files)) in clients.iter().enumerate() {
            sc.spawn(move || {
                let mut buf = [0u8; 64];
                for (j, f) in files.iter().enumerate() {
                    let i = k * PER_CLIENT + j;
                    let want = content(i);
                    let n = f
                        .read_at(&mut buf, 0)
                        .unwrap_or_else(|e| panic!("read {}: {e}", name(i)));
                    assert_eq!(&buf[..n], &want[..], "{} read other bytes", name(i));
                }
            });
        }
    });
    let read_time = t.elapsed();
    let read = figures(&mut s);
    let read_fds = s.fds();

    // All closed.
    let t = Instant::now();
    std::thread::scope(|sc| {
        for (c, files) in clients {
            sc.spawn(move || {
                for f in files {
                    f.close().unwrap();
                }
                drop(c);
            });
        }
    });
    let close_time = t.elapsed();
    let after = wait_connections(&mut s, 0);
    let after_fds = s.fds();
    eprintln!(
        "{FILES} files, {CLIENTS} clients: created in {create_time:?}, opened in {open_time:?}, \
         read in {read_time:?}, closed in {close_time:?}, in all {:?}; server descriptors: \
         baseline {base_fds}, all open {open_fds}, after the reads {read_fds}, after {after_fds} \
         (RLIMIT_NOFILE {nofile}); cache: peak {}, evictions {}, reopens {}, stale {}",
        t_all.elapsed(),
        read.peak,
        read.evictions,
        read.reopens,
        read.stale,
    );
    // The bound holds but for descriptors opened at the same instant by
    // concurrent requests, each before it makes room.
    assert!(
        read.peak <= 4096 + 64,
        "the cache held {} descriptors (bound 4096)",
        read.peak
    );
    assert!(read.reopens > 0 && read.stale == 0, "{read:?}");
    for fds in [open_fds, read_fds] {
        assert!(
            (fds as u64) < nofile,
            "server descriptors {fds} (limit {nofile})"
        );
    }
    assert_eq!(after.open_files, 0, "open files left");
    assert_eq!(after.descriptors, 0, "cached descriptors left");
    assert_eq!(after.registered, 0, "registered bytes left");
    assert_eq!(
        after_fds, base_fds,
        "server descriptors back to the baseline"
    );
}
