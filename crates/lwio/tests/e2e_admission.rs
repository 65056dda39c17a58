//! Admission on the RDMA listener: a refused client is told why, in one
//! line, and a slot frees when a client leaves (issue 13's limits).

use std::time::{Duration, Instant};

use lwio_client::{Client, ClientOptions, Error, OpenOptions};
use lwio_rdma::conformance::pattern;
use lwio_server::config::Limits;
use lwio_server::io_phase::server::RdmaServerOptions;
use lwio_server::io_phase::testkit::LocalServer;

const TOKEN: &str = "e2e-admission-token-0123456789";

fn connect(s: &LocalServer) -> Result<Client, Error> {
    let opts = ClientOptions {
        op_timeout: Duration::from_secs(20),
        ..ClientOptions::default()
    };
    Client::connect(&format!("lwio://{}/ex", s.side_addr), Some(TOKEN), opts)
}

/// With a cap of 50 (issue 13), the 51st client gets "server busy: 50
/// connections (limit 50)"; when one leaves, the next one gets in, and
/// every admitted client moves data byte for byte.
#[test]
fn connection_cap_refuses_with_the_reason_and_frees_slots() {
    const CAP: usize = 50;
    let dir = tempfile::tempdir().unwrap();
    let rdma = RdmaServerOptions {
        max_connections: CAP,
        max_connections_per_host: 64,
        ..RdmaServerOptions::default()
    };
    // All the clients come from 127.0.0.1 at once: past the default burst
    // of 40 new side-channel connections per address (it is the RDMA cap
    // under test, not the side channel's rate limit).
    let limits = Limits {
        unauth_rate_per_host: 1000,
        unauth_burst_per_host: 1000,
        ..Limits::default()
    };
    let s = LocalServer::start(dir.path(), "ex", TOKEN, limits, rdma).unwrap();
    let mut clients: Vec<Client> = (0..CAP)
        .map(|i| connect(&s).unwrap_or_else(|e| panic!("client {i} under the cap: {e}")))
        .collect();
    match connect(&s) {
        Err(Error::Busy(m)) => {
            assert_eq!(m, format!("server busy: {CAP} connections (limit {CAP})"))
        }
        Err(e) => panic!("want the server's reason, got: {e}"),
        Ok(_) => panic!("connection {} got past a cap of {CAP}", CAP + 1),
    }
    assert!(s.rdma.stats().rejected >= 1);
    // One leaves: its slot frees (when its connection thread has closed).
    drop(clients.pop());
    let t0 = Instant::now();
    let late = loop {
        match connect(&s) {
            Ok(c) => break c,
            Err(Error::Busy(_)) if t0.elapsed() < Duration::from_secs(10) => {
                std::thread::sleep(Duration::from_millis(20))
            }
            Err(e) => panic!("no slot freed: {e}"),
        }
    };
    clients.push(late);
    for (i, c) in clients.iter().enumerate() {
        let name = format!("f{i}");
        let f = c
            .open(&name, &OpenOptions::read_write().create(true))
            .unwrap();
        let data = pattern(i as u64, 10_000);
        assert_eq!(f.write_at(&data, 3).unwrap(), data.len());
        let mut back = vec![0u8; data.len()];
        assert_eq!(f.read_at(&mut back, 3).unwrap(), data.len());
        assert_eq!(back, data);
        assert_eq!(
            std::fs::read(dir.path().join(&name)).unwrap()[3..],
            data[..]
        );
    }
}

/// A connection that cannot get its buffers within the registered-memory
/// budget is refused with that reason, not "peer closed".
#[test]
fn out_of_registered_memory_is_the_reason_given() {
    let dir = tempfile::tempdir().unwrap();
    // A budget of 1 MiB: each connection admitted holds at least its
    // share of the pool's receive reserve and one chunk of send slots
    // (4 KiB), and admission wants room for one read buffer; clients are
    // admitted (with fewer credits as it fills) until one no longer fits.
    let budget = 1 << 20;
    let rdma = RdmaServerOptions {
        max_memory: budget,
        max_connections_per_host: 1000,
        ..RdmaServerOptions::default()
    };
    // Many clients from one address, quickly: the side channel's per-host
    // limits are not what this test is about.
    let limits = Limits {
        max_connections_per_host: 2000,
        max_sessions_per_user: 2000,
        unauth_rate_per_host: 10_000,
        unauth_burst_per_host: 10_000,
        unauth_rate: 10_000,
        unauth_burst: 10_000,
        ..Limits::default()
    };
    let s = LocalServer::start(dir.path(), "ex", TOKEN, limits, rdma).unwrap();
    let mut clients = Vec::new();
    let refusal = loop {
        match connect(&s) {
            Ok(c) => {
                assert!(s.rdma.stats().registered_bytes <= budget);
                clients.push(c);
                assert!(clients.len() < 1000, "1 MiB held 1000 connections");
            }
            Err(Error::Busy(m)) => break m,
            Err(e) => panic!("want the server's reason, got: {e}"),
        }
    };
    assert!(
        refusal.starts_with("out of receive memory: ") && refusal.ends_with(" MiB)"),
        "{refusal}"
    );
    assert!(clients.len() >= 2, "only {} admitted", clients.len());
    println!("{} connections in 1 MiB, then: {refusal}", clients.len());
    // Every admitted one works, and a slot frees when one leaves.
    for (i, c) in clients.iter().enumerate() {
        let f = c
            .open(&format!("m{i}"), &OpenOptions::read_write().create(true))
            .unwrap();
        let data = pattern(i as u64, 3000);
        assert_eq!(f.write_at(&data, 0).unwrap(), data.len());
        let mut back = vec![0u8; data.len()];
        assert_eq!(f.read_at(&mut back, 0).unwrap(), data.len());
        assert_eq!(back, data);
    }
    drop(clients.pop());
    let t0 = Instant::now();
    loop {
        match connect(&s) {
            Ok(_) => break,
            Err(Error::Busy(_)) if t0.elapsed() < Duration::from_secs(10) => {
                std::thread::sleep(Duration::from_millis(20))
            }
            Err(e) => panic!("no room freed: {e}"),
        }
    }
}
