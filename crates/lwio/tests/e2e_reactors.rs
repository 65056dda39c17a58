//! Reactors (issue 13): a fixed set of server threads drives every RDMA
//! connection; a new connection goes to the least loaded one; a connection
//! that leaves frees its place.

use std::time::{Duration, Instant};

use lwio_client::{Client, ClientOptions, OpenOptions};
use lwio_rdma::conformance::pattern;
use lwio_server::config::Limits;
use lwio_server::io_phase::driver::RdmaServerOptions;
use lwio_server::io_phase::testkit::LocalServer;

const TOKEN: &str = "e2e-reactors-token-0123456789";

/// The tests count this process's reactor threads: one server at a time.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn connect(s: &LocalServer) -> Client {
    let opts = ClientOptions {
        op_timeout: Duration::from_secs(20),
        ..ClientOptions::default()
    };
    Client::connect(
        &format!("lwio://{}/ex", s.side_addr),
        Some(TOKEN),
        opts.no_tls(),
    )
    .unwrap()
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

/// A server on `dir` with two reactors (and room for 64 connections from
/// this host), `rdma`'s other options as given.
fn two_reactors(dir: &std::path::Path, rdma: RdmaServerOptions) -> LocalServer {
    let rdma = RdmaServerOptions {
        reactors: 2,
        max_connections_per_host: 64,
        ..rdma
    };
    LocalServer::start(dir, "ex", TOKEN, Limits::default(), rdma).unwrap()
}

#[test]
fn two_reactors_drive_24_connections_and_balance_them() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let s = two_reactors(dir.path(), RdmaServerOptions::default());
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
    wait_for("24 serving", || s.rdma.connection_states() == (0, 24, 0));
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

/// The shared receive pool (issue 13): receives come from one pool per
/// reactor, sized by the credits granted. Idle connections are brought
/// down to one credit and the pool gives back what they no longer need;
/// a connection that wakes up gets its credits back and moves data
/// exactly; when every client has left the pool holds nothing.
#[test]
fn idle_connections_hold_one_credit_of_the_shared_pool() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let s = two_reactors(
        dir.path(),
        RdmaServerOptions {
            idle_reclaim: Duration::from_millis(300),
            ..RdmaServerOptions::default()
        },
    );
    assert_eq!(
        s.rdma.receive_pool().registered_bytes,
        0,
        "nothing before a client"
    );
    let clients: Vec<Client> = (0..40).map(|_| connect(&s)).collect();
    let files: Vec<_> = clients
        .iter()
        .enumerate()
        .map(|(i, c)| {
            c.open(&format!("p{i}"), &OpenOptions::read_write().create(true))
                .unwrap()
        })
        .collect();
    let round = |salt: u64| {
        for (i, f) in files.iter().enumerate() {
            let data = pattern(salt + i as u64, 300_003);
            assert_eq!(f.write_at(&data, 1).unwrap(), data.len());
            let mut back = vec![0u8; data.len()];
            assert_eq!(f.read_at(&mut back, 1).unwrap(), data.len());
            assert_eq!(back, data, "client {i}");
        }
    };
    round(100);
    let busy = s.rdma.receive_pool();
    assert!(busy.promised >= 40, "{busy:?}");
    // Idle: one credit each, and the pool no bigger than that needs (its
    // buffers come in chunks of 16, one partial chunk per reactor).
    let t0 = Instant::now();
    while s.rdma.receive_pool().promised != 40 {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "idle connections not down to one credit: {:?}, credits {:?}",
            s.rdma.receive_pool(),
            s.rdma.connection_credits()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let idle = s.rdma.receive_pool();
    let slot = (56 + RdmaServerOptions::default().proto.max_recv_buffer_size as usize)
        .next_multiple_of(64);
    assert_eq!(idle.in_use, 0, "{idle:?}");
    // The first credits of the 20 connections of each reactor share a
    // reserve of 16 buffers (one chunk): fewer receives than credits.
    assert_eq!(idle.posted, 2 * 16, "the reserve of each reactor: {idle:?}");
    assert!(
        idle.registered_bytes <= 2 * 16 * slot,
        "pool larger than its reserve: {idle:?} (was {busy:?})"
    );
    println!(
        "receive pool: busy {} KiB, idle {} KiB for 40 connections ({} KiB each)",
        busy.registered_bytes >> 10,
        idle.registered_bytes >> 10,
        (idle.registered_bytes / 40) >> 10
    );
    // All 40 wake at once, each with its one credit: 8 more Sends than
    // receives posted. The late ones wait (in the soft provider, under
    // their QP's indicate window) until a buffer comes back, and nothing
    // is lost or mixed up.
    let gate = std::sync::Barrier::new(files.len());
    std::thread::scope(|sc| {
        for (i, f) in files.iter().enumerate() {
            let gate = &gate;
            sc.spawn(move || {
                let data = pattern(300 + i as u64, 60_000);
                gate.wait();
                assert_eq!(f.write_at(&data, 7).unwrap(), data.len());
                let mut back = vec![0u8; data.len()];
                assert_eq!(f.read_at(&mut back, 7).unwrap(), data.len());
                assert_eq!(back, data, "client {i} after the storm");
            });
        }
    });
    let storm = s.rdma.receive_pool();
    println!("after 40 idle clients woke at once: {storm:?}");
    for i in 0..files.len() {
        let want = pattern(300 + i as u64, 60_000);
        assert_eq!(
            std::fs::read(dir.path().join(format!("p{i}"))).unwrap()[7..7 + want.len()],
            want[..]
        );
    }
    // Waking up: credits come back, data exact.
    round(200);
    for i in 0..files.len() {
        let want = pattern(200 + i as u64, 300_003);
        assert_eq!(
            std::fs::read(dir.path().join(format!("p{i}"))).unwrap()[1..],
            want[..]
        );
    }
    drop(files);
    drop(clients);
    wait_for("connections gone", || s.rdma.stats().connections == 0);
    wait_for("pool empty", || {
        let p = s.rdma.receive_pool();
        p.promised == 0 && p.registered_bytes == 0 && p.posted == 0
    });
}

/// Read buffers (readbuf.rs): a 4 KiB read holds a 4 KiB slot of its
/// reactor's slab, not a 64 KiB region of its own kept for the
/// connection's next reads. 32 clients, 8 threads each reading 4 KiB, every
/// byte checked: the server's read buffers (registered bytes beyond its
/// receive pool, sampled throughout) stay within a few slab chunks (regions
/// of their own took 32 connections × 8 × 64 KiB = 16 MiB here), and
/// nothing is registered once the clients have gone.
#[test]
fn small_reads_hold_small_slots() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let dir = tempfile::tempdir().unwrap();
    const CLIENTS: usize = 32;
    const LEN: usize = 256 << 10;
    for i in 0..CLIENTS {
        std::fs::write(
            dir.path().join(format!("r{i}")),
            pattern(900 + i as u64, LEN),
        )
        .unwrap();
    }
    let s = two_reactors(dir.path(), RdmaServerOptions::default());
    let clients: Vec<Client> = (0..CLIENTS).map(|_| connect(&s)).collect();
    let files: Vec<_> = clients
        .iter()
        .enumerate()
        .map(|(i, c)| c.open(&format!("r{i}"), &OpenOptions::read_only()).unwrap())
        .collect();
    // Registered bytes beyond the receive pool and each connection's first
    // chunk of send slots (4 KiB; a connection whose sends outrun it
    // registers another, within the bound below).
    let reads = || {
        let st = s.rdma.stats().registered_bytes;
        st.saturating_sub(s.rdma.receive_pool().registered_bytes + CLIENTS * 4096)
    };
    let done = std::sync::atomic::AtomicBool::new(false);
    let peak = std::thread::scope(|sc| {
        let sampler = sc.spawn(|| {
            let mut peak = 0;
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                peak = peak.max(reads());
                std::thread::sleep(Duration::from_micros(200));
            }
            peak
        });
        let readers: Vec<_> = files
            .iter()
            .enumerate()
            .flat_map(|(i, f)| (0..8).map(move |t| (i, f, t)))
            .map(|(i, f, t)| {
                sc.spawn(move || {
                    let want = pattern(900 + i as u64, LEN);
                    let mut b = vec![0u8; 4096];
                    for k in 0..32 {
                        let at = ((t * 32 + k) * 4096 + 512 * t) % (LEN - 4096);
                        assert_eq!(f.read_at(&mut b, at as u64).unwrap(), 4096);
                        assert!(
                            b == want[at..at + 4096],
                            "client {i} thread {t} read at {at}"
                        );
                    }
                })
            })
            .collect();
        for r in readers {
            r.join().unwrap();
        }
        done.store(true, std::sync::atomic::Ordering::Relaxed);
        sampler.join().unwrap()
    });
    // Every slot comes back (once the server has its RDMA Write's
    // completion, which may follow the client's by a moment).
    wait_for("slots back", || s.rdma.read_slabs().in_use_bytes == 0);
    let slabs = s.rdma.read_slabs();
    println!(
        "read buffers of {CLIENTS} connections, 8 reads of 4 KiB each at a time: peak {} KiB; \
         slabs after: {slabs:?}",
        peak >> 10
    );
    // The reads came from the slabs, and every slot is back.
    assert!(slabs.registered_bytes >= 1 << 20, "{slabs:?}");
    assert_eq!(slabs.in_use_bytes, 0, "{slabs:?}");
    // Two reactors, each at most one chunk of 4 KiB slots for its 128
    // reads and one spare.
    assert!(peak <= 4 << 20, "read buffers reached {} KiB", peak >> 10);
    drop(files);
    drop(clients);
    wait_for("connections gone", || s.rdma.stats().connections == 0);
    wait_for("nothing registered", || {
        s.rdma.stats().registered_bytes == 0
    });
    assert_eq!(s.rdma.read_slabs(), Default::default());
}
