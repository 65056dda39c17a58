//! Staged-copy vs registered reads on loopback (soft provider): the
//! measurement behind `ClientOptions::register_threshold`.
//!
//! `cargo run --release -p lwio --example read-bench [SECONDS_PER_CASE [FILTER [ROUNDS]]]`
//! (FILTER: only cases whose `MODE/KIND SIZE` contains it, e.g. `Interrupt`;
//! ROUNDS: repeat the three kinds interleaved)
//!
//! For 64 KiB and 1 MiB reads of a file in the server's page cache, in
//! both completion modes: `staged` (server writes into staging slots, the
//! client copies out), `per-call` (the caller's buffer is registered for
//! each call), `cached` (a `Client::register_buffer` buffer, registration
//! from the cache). Prints one line per case: MiB/s and µs per read.

use std::time::{Duration, Instant};

use lwio_client::{Client, ClientOptions, Completion, OpenOptions};
use lwio_server::config::Limits;
use lwio_server::io_phase::driver::RdmaServerOptions;
use lwio_server::io_phase::testkit::LocalServer;

const TOKEN: &str = "read-bench-token-0123456789";
const FILE: usize = 64 << 20;

fn main() {
    let secs: f64 = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(2.0);
    // Optional: only cases whose name contains this (e.g. "Interrupt").
    let only = std::env::args().nth(2).unwrap_or_default();
    let rounds: usize = std::env::args()
        .nth(3)
        .and_then(|s| s.parse().ok())
        .unwrap_or(1);
    let dir = tempfile::tempdir().expect("temp dir");
    let data: Vec<u8> = (0..FILE).map(|i| (i * 7 + i / 4096) as u8).collect();
    std::fs::write(dir.path().join("bench.bin"), &data).expect("write file");
    let server = LocalServer::start(
        dir.path(),
        "ex",
        TOKEN,
        Limits::default(),
        RdmaServerOptions::default(),
    )
    .expect("server");
    println!("case                         size   MiB/s    us/read");
    for completion in [Completion::Interrupt, Completion::Poll] {
        for size in [64 << 10, 1 << 20] {
            for mode in std::iter::repeat_n(["staged", "per-call", "cached"], rounds).flatten() {
                if !format!("{completion:?}/{mode} {}K", size >> 10).contains(&only) {
                    continue;
                }
                let opts = ClientOptions {
                    completion,
                    register_threshold: Some(if mode == "staged" { usize::MAX } else { 1024 }),
                    ..ClientOptions::default()
                };
                let c = Client::connect(
                    &format!("lwio://{}/ex", server.side_addr),
                    Some(TOKEN),
                    opts.no_tls(),
                )
                .expect("connect");
                let f = c
                    .open("bench.bin", &OpenOptions::read_only())
                    .expect("open");
                let mut plain = vec![0u8; size];
                let mut reg = c.register_buffer(size).expect("register_buffer");
                let cached = mode == "cached";
                let mut run = |d: Duration| -> (u64, Duration) {
                    let t = Instant::now();
                    let mut n = 0u64;
                    let mut off = 0usize;
                    while t.elapsed() < d {
                        // The cached registration is used through
                        // `read_registered` (a slice of the buffer is read as
                        // plain memory).
                        let k = if cached {
                            f.read_registered(&mut reg, 0..size, off as u64)
                        } else {
                            f.read_at(&mut plain, off as u64)
                        }
                        .expect("read");
                        assert_eq!(k, size);
                        n += 1;
                        off = (off + size) % FILE;
                    }
                    (n, t.elapsed())
                };
                run(Duration::from_millis(200)); // warm-up
                let (n, el) = run(Duration::from_secs_f64(secs));
                let buf: &[u8] = if cached { &reg } else { &plain };
                // Spot check the last read.
                let off = ((n as usize - 1) * size) % FILE;
                assert_eq!(&buf[..size], &data[off..off + size], "data mismatch");
                let mib = (n as f64 * size as f64) / (1 << 20) as f64 / el.as_secs_f64();
                let us = el.as_secs_f64() * 1e6 / n as f64;
                println!(
                    "{:<28} {:>5}K {:>7.0} {:>10.1}",
                    format!("{completion:?}/{mode}"),
                    size >> 10,
                    mib,
                    us
                );
                let st = c.stats();
                assert_eq!(st.windows_bound, st.windows_invalidated, "{st:?}");
            }
        }
    }
}
