//! Reactors (issue 13): a fixed set of server threads drives every RDMA
//! connection; a new connection goes to the least loaded one; a connection
//! that leaves frees its place.

use std::time::{Duration, Instant};

use lwio_client::{Client, ClientOptions, OpenOptions};
use lwio_rdma::conformance::pattern;
use lwio_server::config::Limits;
use lwio_server::io_phase::server::RdmaServerOptions;
use lwio_server::io_phase::testkit::LocalServer;

const TOKEN: &str = "e2e-reactors-token-0123456789";

fn connect(s: &LocalServer) -> Client {
    let opts = ClientOptions {
        op_timeout: Duration::from_secs(20),
        ..ClientOptions::default()
    };
    Client::connect(&format!("lwio://{}/ex", s.side_addr), Some(TOKEN), opts).unwrap()
}

/// Names of this process's threads that start with `prefix`.
fn threads_named(prefix: &str) -> Vec<String> {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .map(|n| n.trim().to_string())
        .filter(|n| n.starts_with(prefix))
        .collect()
}

fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !f() {
        assert!(t0.elapsed() < Duration::from_secs(10), "timed out: {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn two_reactors_drive_24_connections_and_balance_them() {
    let dir = tempfile::tempdir().unwrap();
    let rdma = RdmaServerOptions {
        reactors: 2,
        max_connections_per_host: 64,
        ..RdmaServerOptions::default()
    };
    let s = LocalServer::start(dir.path(), "ex", TOKEN, Limits::default(), rdma).unwrap();
    wait_for("2 reactor threads", || {
        threads_named("lwio-reactor-").len() == 2
    });
    let clients: Vec<Client> = (0..24).map(|_| connect(&s)).collect();
    let files: Vec<_> = clients
        .iter()
        .enumerate()
        .map(|(i, c)| {
            c.open(&format!("f{i}"), &OpenOptions::read_write().create(true))
                .unwrap()
        })
        .collect();
    // Every connection served, byte for byte, on two threads.
    for (i, f) in files.iter().enumerate() {
        let data = pattern(i as u64 + 7, 70_001);
        assert_eq!(f.write_at(&data, 5).unwrap(), data.len());
        let mut back = vec![0u8; data.len()];
        assert_eq!(f.read_at(&mut back, 5).unwrap(), data.len());
        assert_eq!(back, data, "client {i}");
        assert_eq!(
            std::fs::read(dir.path().join(format!("f{i}"))).unwrap()[5..],
            data[..]
        );
    }
    assert_eq!(threads_named("lwio-reactor-").len(), 2);
    assert!(
        threads_named("lwio-rdma-conn").is_empty(),
        "a thread per connection: {:?}",
        threads_named("lwio-rdma-conn")
    );
    let r = s.rdma.reactors();
    assert_eq!(r.len(), 2, "{r:?}");
    assert_eq!(
        r.iter().map(|x| x.0).collect::<Vec<_>>(),
        vec![12, 12],
        "connections per reactor"
    );
    assert!(r.iter().all(|x| x.1 > 0), "both reactors did work: {r:?}");
    assert_eq!(s.rdma.stats().connections, 24);
    // Half leave: their places free, the rest keep working.
    drop(files);
    let mut clients = clients;
    clients.truncate(12);
    wait_for("12 connections closed", || {
        s.rdma.reactors().iter().map(|x| x.0).sum::<usize>() == 12
            && s.rdma.stats().connections == 12
    });
    for (i, c) in clients.iter().enumerate() {
        let f = c.open(&format!("f{i}"), &OpenOptions::read_only()).unwrap();
        let data = pattern(i as u64 + 7, 70_001);
        let mut back = vec![0u8; data.len()];
        assert_eq!(f.read_at(&mut back, 5).unwrap(), data.len());
        assert_eq!(back, data, "client {i} after the others left");
    }
    // A new one goes to the emptier reactor.
    let before = s.rdma.reactors();
    let extra = connect(&s);
    let f = extra
        .open("extra", &OpenOptions::read_write().create(true))
        .unwrap();
    assert_eq!(f.write_at(b"x", 0).unwrap(), 1);
    let after = s.rdma.reactors();
    let min = before.iter().map(|x| x.0).min().unwrap();
    let grew: Vec<usize> = (0..2).filter(|&i| after[i].0 == before[i].0 + 1).collect();
    assert_eq!(grew.len(), 1, "{before:?} -> {after:?}");
    assert_eq!(before[grew[0]].0, min, "{before:?} -> {after:?}");
}
