//! Admission on the RDMA listener: a refused client is told why, in one
//! line, and a slot frees when a client leaves (issue 13's limits).

use std::time::{Duration, Instant};

use lwio_client::{Client, ClientOptions, Error, OpenOptions};
use lwio_rdma::conformance::pattern;
use lwio_server::config::Limits;
use lwio_server::io_phase::driver::RdmaServerOptions;
use lwio_server::io_phase::testkit::LocalServer;

const TOKEN: &str = "e2e-admission-token-0123456789";

fn connect(s: &LocalServer) -> Result<Client, Error> {
    let opts = ClientOptions {
        op_timeout: Duration::from_secs(20),
        ..ClientOptions::default()
    };
    Client::connect(
        &format!("lwio://{}/ex", s.side_addr),
        Some(TOKEN),
        opts.no_tls(),
    )
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
    let before = s.rdma.stats().registered_bytes;
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
    // No 1 MiB region of read slots fits this budget: the reads took
    // 4 KiB regions of their own and gave them back (none kept as a spare
    // no later read would take).
    reads_left_nothing(&s, before);
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

/// A budget with no room for a 1 MiB region of read slots: small reads
/// take 4 KiB regions of their own, exact, and give them back; none is
/// kept as a spare (no later read would take a region under 64 KiB).
#[test]
fn small_reads_fit_a_budget_without_room_for_a_slab() {
    let dir = tempfile::tempdir().unwrap();
    let rdma = RdmaServerOptions {
        max_memory: 1 << 20,
        max_connections_per_host: 1000,
        ..RdmaServerOptions::default()
    };
    let s = LocalServer::start(dir.path(), "ex", TOKEN, Limits::default(), rdma).unwrap();
    let clients: Vec<_> = (0..4).map(|_| connect(&s).unwrap()).collect();
    let files: Vec<_> = clients
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let data = pattern(40 + i as u64, 3000);
            std::fs::write(dir.path().join(format!("s{i}")), &data).unwrap();
            (
                c.open(&format!("s{i}"), &OpenOptions::read_only()).unwrap(),
                data,
            )
        })
        .collect();
    let before = s.rdma.stats().registered_bytes;
    for _ in 0..3 {
        for (i, (f, data)) in files.iter().enumerate() {
            let mut back = vec![0u8; data.len()];
            assert_eq!(f.read_at(&mut back, 0).unwrap(), data.len());
            assert!(back == *data, "client {i}");
        }
    }
    reads_left_nothing(&s, before);
}

/// After reads in a budget with no room for a 1 MiB region of read slots:
/// no slab grew, and registered memory is back to `before`.
fn reads_left_nothing(s: &LocalServer, before: usize) {
    // A read's buffer goes back once the server has its RDMA Write's
    // completion, which may follow the client's by a moment; spares would
    // stay until idle reclaim (2 s).
    let t0 = Instant::now();
    let after = loop {
        let after = s.rdma.stats().registered_bytes;
        if after <= before || t0.elapsed() > Duration::from_millis(500) {
            break after;
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let slabs = s.rdma.read_slabs();
    println!("registered before the reads {before} B, after {after} B; slabs {slabs:?}");
    assert_eq!(slabs.registered_bytes, 0, "{slabs:?}");
    assert!(
        after <= before,
        "the reads left {} B registered",
        after - before
    );
}
