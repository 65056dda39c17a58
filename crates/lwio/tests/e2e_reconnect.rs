//! Reconnect and durable handles end to end (docs/reconnect.md): a real
//! `lwio serve` child, killed with SIGKILL and started again on the same
//! addresses under a client with files open and requests in flight; the
//! RDMA connection cut under a live server; durable handles refused to a
//! wrong secret and released when the grace period ends; a file replaced
//! while the server was down reported stale.

mod common;

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::reconnect::{
    block, cut, in_netns, offset, open_all, open_files, rw, survive, wait_until, Srv, Workers,
    BLOCK,
};
use lwio_client::{Client, Error};
use lwio_side::error::ErrorCode;

const THREADS: usize = 32;
const FILES: usize = 4;

/// 32 threads each keep one blocking WRITE in flight (thread t writes its
/// own blocks of file t % 4) until `stop`, then a final round; returns
/// each thread's block count.
fn writers(
    files: &Arc<Vec<lwio_client::File>>,
    stop: &Arc<AtomicBool>,
    done: &Arc<AtomicUsize>,
) -> Workers {
    (0..THREADS)
        .map(|t| {
            let (files, stop, done) = (files.clone(), stop.clone(), done.clone());
            std::thread::spawn(move || {
                let f = &files[t % FILES];
                let mut k = 0;
                while !stop.load(Ordering::Relaxed) || k < 4 {
                    let off = offset(t, k, THREADS, FILES);
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
/// `client` survive `fault` ([`survive`]) with a reconnect. Returns how
/// long after the fault the writes flowed again.
fn writes_survive(client: &Client, dir: &Path, prefix: &str, fault: impl FnOnce()) -> Duration {
    let files = open_all(client, prefix, FILES);
    let resumed = survive(
        client,
        dir,
        prefix,
        &files,
        |stop, done| writers(&files, stop, done),
        fault,
    );
    assert!(client.reconnects() >= 1, "a reconnect was counted");
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
    assert_eq!(e.message, lwio_server::state::RESUME_REFUSED);
    // Its own session id with the victim's id is no better; nothing moved.
    let e = thief
        .resume(&lwio_client::side_client::Session { id: 999, ..forged })
        .unwrap_err();
    assert_eq!(e.message, lwio_server::state::RESUME_REFUSED);
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
    if !in_netns("rdma_connection_cut_in_flight_requests_complete") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let srv = Srv::start(dir.path(), "60s");
    let client = srv.connect(Duration::from_secs(20));
    let port = srv.rdma.rsplit_once(':').unwrap().1.to_string();
    let resumed = writes_survive(&client, dir.path(), "c", || {
        cut(&port, None);
    });
    eprintln!(
        "RDMA socket cut; writes flowing again {resumed:?} later; {} reconnects",
        client.reconnects()
    );
}

/// The async API on a one-thread runtime: `tasks` tasks each write
/// `blocks` 4 KiB blocks of `name` (and read each back, if `read_back`);
/// once a quarter of them are done, `fault` runs on that runtime. Every
/// call must end Ok, the client must have noticed (a reconnect or a
/// failover), and every block must be exact on disk.
fn async_blocks_through(
    dir: &Path,
    client: &Client,
    name: &str,
    (tasks, blocks): (usize, usize),
    read_back: bool,
    fault: impl AsyncFnOnce(),
) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let c = lwio_client::async_client::AsyncClient::from_client(client.clone()).unwrap();
        let f = c.open(name, &rw()).await.unwrap();
        let done = Arc::new(AtomicUsize::new(0));
        let mut set = tokio::task::JoinSet::new();
        for t in 0..tasks {
            let (f, done) = (f.clone(), done.clone());
            set.spawn(async move {
                for b in 0..blocks {
                    let at = ((b * tasks + t) * 4096) as u64;
                    let data = block(t, b)[..4096].to_vec();
                    assert_eq!(
                        f.write_at(&data, at).await.unwrap(),
                        4096,
                        "task {t} block {b}"
                    );
                    if read_back {
                        let mut back = vec![0u8; 4096];
                        assert_eq!(f.read_at(&mut back, at).await.unwrap(), 4096);
                        assert!(back == data, "task {t} block {b} read back");
                    }
                    done.fetch_add(1, Ordering::Relaxed);
                }
            });
        }
        while done.load(Ordering::Relaxed) < tasks * blocks / 4 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        fault().await;
        while let Some(r) = set.join_next().await {
            r.unwrap();
        }
        eprintln!(
            "async calls sent again after the fault: {}",
            f.resent_calls()
        );
    });
    assert!(
        client.reconnects() + client.failovers() >= 1,
        "the cut was noticed"
    );
    let disk = std::fs::read(dir.join("data").join(name)).unwrap();
    for t in 0..tasks {
        for b in 0..blocks {
            let at = (b * tasks + t) * 4096;
            assert!(
                disk[at..at + 4096] == block(t, b)[..4096],
                "task {t} block {b} on disk"
            );
        }
    }
}

/// The async API: 32 tasks write and read back 4 KiB blocks while the RDMA
/// socket is cut: every call succeeds and every block is exact on disk.
/// (Calls the lost connection left unanswered are sent again after the
/// reconnect; in this run the cut lands between calls, so the count of
/// re-sent calls is printed, not asserted.)
#[test]
fn async_io_is_sent_again_after_a_cut() {
    if !in_netns("async_io_is_sent_again_after_a_cut") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let srv = Srv::start(dir.path(), "60s");
    let client = srv.connect(Duration::from_secs(20));
    let port = srv.rdma.rsplit_once(':').unwrap().1.to_string();
    async_blocks_through(
        dir.path(),
        &client,
        "async.bin",
        (32, 64),
        true,
        async || cut(&port, None),
    );
}

/// The async API when the server stops (SIGSTOP) while the RDMA socket is
/// cut under calls in flight, and resumes 1.5 s later: every call ends Ok,
/// every block is exact on disk. The runtime here has one thread, which
/// also sends the SIGCONT. Before the fix, a task's `route` blocked that
/// thread on the file's route lock, held by a blocking-pool thread
/// renewing the route through the stopped server: the SIGCONT never went
/// and every call timed out ("not back after 1 attempts in 30.0s").
#[test]
fn async_io_recovers_when_the_server_stops_through_a_cut() {
    if !in_netns("async_io_recovers_when_the_server_stops_through_a_cut") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let srv = Srv::start(dir.path(), "60s");
    let client = srv.connect(Duration::from_secs(20));
    let port = srv.rdma.rsplit_once(':').unwrap().1.to_string();
    let pid = srv.child.id().to_string();
    let signal = |sig: &str| {
        let st = std::process::Command::new("kill")
            .args([sig, &pid])
            .status()
            .unwrap();
        assert!(st.success(), "kill {sig} {pid}");
    };
    async_blocks_through(
        dir.path(),
        &client,
        "stopped.bin",
        (8, 64),
        false,
        async || {
            signal("-STOP");
            cut(&port, None);
            tokio::time::sleep(Duration::from_millis(1500)).await;
            signal("-CONT");
        },
    );
}
