//! End to end over loopback on the soft provider: a real server (side
//! channel + RDMA listener, temp export) and a real client, every opcode in
//! both completion modes, byte-exact file contents, credits, the async API.

mod common;

use std::io::{IoSlice, IoSliceMut};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::time::{Duration, Instant};

use lwio_client::{AsyncClient, Client, ClientOptions, Completion, Error, OpenOptions};
use lwio_proto::status::{STATUS_ACCESS_DENIED, STATUS_INVALID_PARAMETER, STATUS_SUCCESS};
use lwio_rdma::conformance::pattern;
use lwio_server::config::Limits;
use lwio_server::io_phase::driver::RdmaServerOptions;
use lwio_server::io_phase::testkit::LocalServer;

const TOKEN: &str = "e2e-test-token-0123456789";

fn server(dir: &Path, rdma: RdmaServerOptions) -> LocalServer {
    common::init_logging();
    LocalServer::start(dir, "ex", TOKEN, Limits::default(), rdma).expect("server starts")
}

fn no_auto() -> RdmaServerOptions {
    RdmaServerOptions {
        auto_credits: false,
        ..RdmaServerOptions::default()
    }
}

fn client(s: &LocalServer, completion: Completion) -> Client {
    let opts = ClientOptions {
        completion,
        credits: 8,
        op_timeout: Duration::from_secs(20),
        // The soft provider stages by default; cover the registered path.
        register_threshold: Some(64 * 1024),
        ..ClientOptions::default()
    };
    connect_with(s, opts)
}

fn connect_with(s: &LocalServer, opts: ClientOptions) -> Client {
    Client::connect(
        &format!("lwio://{}/ex", s.side_addr),
        Some(TOKEN),
        opts.no_tls(),
    )
    .expect("client connects")
}

fn local_read(path: &Path, off: u64, len: usize) -> Vec<u8> {
    let f = std::fs::File::open(path).unwrap();
    let mut v = vec![0u8; len];
    let mut n = 0;
    while n < len {
        match f.read_at(&mut v[n..], off + n as u64).unwrap() {
            0 => break,
            k => n += k,
        }
    }
    v.truncate(n);
    v
}

/// READ and WRITE at odd offsets and lengths, at and beyond EOF, past 4 GiB,
/// VEC_READ / VEC_WRITE, CLOSE — in one completion mode.
fn io_suite(completion: Completion) {
    let dir = tempfile::tempdir().unwrap();
    let s = server(dir.path(), no_auto());
    let c = client(&s, completion);
    assert_eq!(c.completion(), completion);
    let path = dir.path().join("data.bin");
    let f = c
        .open("data.bin", &OpenOptions::read_write().create(true))
        .expect("open");

    // WRITE: odd offsets/lengths, including multi-request (> MaxRecvBufferSize).
    let data = pattern(1, 300_007);
    assert_eq!(f.write_at(&data, 3).unwrap(), data.len());
    assert_eq!(local_read(&path, 3, data.len()), data);
    for (off, len) in [
        (0u64, 1usize),
        (1, 511),
        (4095, 4097),
        (77_777, 12_345),
        (8191, 8193),
    ] {
        let d = pattern(off + 7, len);
        assert_eq!(f.write_at(&d, off).unwrap(), len);
        assert_eq!(local_read(&path, off, len), d, "write at {off}+{len}");
    }
    let size = std::fs::metadata(&path).unwrap().len();
    assert_eq!(f.len().unwrap(), size);

    // READ: byte-exact against the local file, bounce (< 1 KiB) and staged.
    for (off, len) in [
        (0u64, 1usize),
        (5, 1023),
        (1, 1024),
        (4097, 65_537),
        (3, 300_007),
        (123, 200_000),
    ] {
        let mut buf = vec![0xAAu8; len];
        let n = f.read_at(&mut buf, off).unwrap();
        let want = local_read(&path, off, len);
        assert_eq!(n, want.len(), "read at {off}+{len}");
        assert_eq!(&buf[..n], &want[..], "read at {off}+{len}");
    }
    // At end of file: short read, then END_OF_FILE (0 bytes).
    let mut buf = vec![0u8; 1000];
    assert_eq!(f.read_at(&mut buf, size - 10).unwrap(), 10);
    assert_eq!(&buf[..10], &local_read(&path, size - 10, 10)[..]);
    assert_eq!(f.read_at(&mut buf, size).unwrap(), 0);
    assert_eq!(f.read_at(&mut buf, size + 12_345).unwrap(), 0);
    let mut big = vec![0u8; 500_000];
    assert_eq!(f.read_at(&mut big, size - 70_000).unwrap(), 70_000);

    // Past 4 GiB (sparse).
    let far = (5u64 << 30) + 4093;
    let d = pattern(9, 20_011);
    assert_eq!(f.write_at(&d, far).unwrap(), d.len());
    let mut back = vec![0u8; 20_011 + 30];
    assert_eq!(f.read_at(&mut back, far - 30).unwrap(), back.len());
    assert_eq!(&back[..30], &[0u8; 30]);
    assert_eq!(&back[30..], &d[..]);
    assert_eq!(local_read(&path, far, d.len()), d);
    // ... and a read past 4 GiB large enough to land in the caller's buffer
    // (registered) rather than a staging slot.
    let d2 = pattern(10, 300_001);
    assert_eq!(f.write_at(&d2, far + 50_000).unwrap(), d2.len());
    let calls = c.stats().call_registrations;
    let mut back = vec![0u8; 300_001];
    assert_eq!(f.read_at(&mut back, far + 50_000).unwrap(), back.len());
    assert_eq!(back, d2);
    assert_eq!(c.stats().call_registrations, calls + 1);

    // Offsets that overflow are refused locally.
    assert!(matches!(
        f.read_at(&mut buf, u64::MAX - 5),
        Err(Error::InvalidArgument(_))
    ));

    // VEC_WRITE (gathered) and VEC_READ (scattered, one window per page).
    let a = pattern(21, 5000);
    let b = pattern(22, 11_000);
    let n = f
        .write_vectored_at(&[IoSlice::new(&a), IoSlice::new(&b)], 1_000_003)
        .unwrap();
    assert_eq!(n, 16_000);
    let mut want = a.clone();
    want.extend_from_slice(&b);
    assert_eq!(local_read(&path, 1_000_003, 16_000), want);
    let mut x = vec![0u8; 4096 * 3];
    let mut y = vec![0u8; 512 * 3];
    let n = f
        .read_vectored_at(
            &mut [IoSliceMut::new(&mut x), IoSliceMut::new(&mut y)],
            1_000_003,
        )
        .unwrap();
    assert_eq!(n, 4096 * 3 + 512 * 3);
    assert_eq!(&x[..], &want[..4096 * 3]);
    assert_eq!(&y[..], &want[4096 * 3..4096 * 3 + 1536]);
    assert!(
        c.stats().windows_bound >= 4,
        "every page gets its own window"
    );

    // CLOSE: then the Fid is invalid.
    let fid = f.fid();
    f.close().unwrap();
    let e = c.engine();
    let r = e.issue_write(fid, 0, b"x").unwrap();
    let (_, st) = e.wait(r).unwrap();
    assert_eq!(st, lwio_proto::status::STATUS_INVALID_HANDLE);

    // Windows: every one bound was invalidated after its request.
    let stats = c.stats();
    assert_eq!(stats.windows_bound, stats.windows_invalidated, "{stats:?}");
    assert_eq!(
        s.rdma.stats().credit_overruns,
        0,
        "requests beyond the credits granted"
    );
    match completion {
        Completion::Poll => {
            assert!(stats.polled_completions > 0, "{stats:?}");
            assert_eq!(stats.immediate_completions, 0, "{stats:?}");
        }
        Completion::Interrupt => {
            assert_eq!(stats.polled_completions, 0, "{stats:?}");
            // Full reads complete by RDMA Write with Immediate (the soft
            // provider's RFC 7306 Immediate Data), with no status message.
            assert!(stats.immediate_completions > 0, "{stats:?}");
        }
    }
    let ss = s.rdma.stats();
    assert_eq!(
        ss.mrs_remote_access, 0,
        "the server never exposes memory: {ss:?}"
    );
    assert!(ss.mrs_registered > 0);
}

#[test]
fn io_interrupt_mode() {
    io_suite(Completion::Interrupt);
}

/// A server told not to use RDMA Write with Immediate completes every
/// read by its status message: the same bytes, no immediate completion.
#[test]
fn io_interrupt_mode_without_write_with_immediate() {
    let dir = tempfile::tempdir().unwrap();
    let mut opts = no_auto();
    opts.proto.use_write_with_imm = false;
    let s = server(dir.path(), opts);
    let c = client(&s, Completion::Interrupt);
    let f = c
        .open("d.bin", &OpenOptions::read_write().create(true))
        .expect("open");
    let data = pattern(5, 200_003);
    assert_eq!(f.write_at(&data, 0).unwrap(), data.len());
    for (off, len) in [(0u64, 100usize), (7, 65_537), (0, 200_003)] {
        let mut buf = vec![0u8; len];
        assert_eq!(f.read_at(&mut buf, off).unwrap(), len);
        assert_eq!(&buf[..], &data[off as usize..off as usize + len]);
    }
    let st = c.stats();
    assert_eq!(st.immediate_completions, 0, "{st:?}");
}

/// Polling at depth, the pattern of `lwio bench` and of a fio job (reap
/// the oldest request, issue one in its place): the requests leave in
/// batches, not one post (one system call) per request. A guard on the
/// batching and on `send_posts`, not a reproduction of the case fixed with
/// it: in release builds a polled waiter that found its request's status
/// block placed but not yet read posted the requests queued since, one
/// per request at QD 32 (`Engine::done_before_flush` now reads the block
/// first: `lwio bench` 6.8 → 3.2 µs of client CPU per 4 KiB read,
/// bench/RESULTS.md 2026-11-29); this debug-build run batches either way
/// (about 31 requests a post), so that change's evidence is the benchmark.
#[test]
fn polled_reaps_of_placed_completions_leave_new_requests_batched() {
    let dir = tempfile::tempdir().unwrap();
    let s = server(dir.path(), no_auto());
    let c = connect_with(
        &s,
        ClientOptions {
            completion: Completion::Poll,
            credits: 32,
            op_timeout: Duration::from_secs(20),
            ..ClientOptions::default()
        },
    );
    let f = c
        .open("p.bin", &OpenOptions::read_write().create(true))
        .expect("open");
    let data = pattern(8, 64 * 4096);
    assert_eq!(f.write_at(&data, 0).unwrap(), data.len());
    const DEPTH: usize = 32;
    const IOS: usize = 3000;
    let mut inflight = std::collections::VecDeque::new();
    let before = c.stats();
    let mut got = vec![0u8; 4096];
    for i in 0..IOS {
        while inflight.len() < DEPTH {
            let off = ((i * 7 + inflight.len()) % 64) as u64 * 4096;
            let mut b = f.batch(off, lwio_client::Short::Counts);
            b.read(4096, None).expect("issue");
            inflight.push_back((b, off));
        }
        let (mut b, off) = inflight.pop_front().unwrap();
        while let Some(l) = b.reap() {
            l.copy_to(&mut got);
        }
        let (n, end) = b.finish();
        assert!(n == 4096 && end.is_none(), "read at {off}: {n} {end:?}");
        assert_eq!(
            got[..],
            data[off as usize..off as usize + 4096],
            "read at {off}"
        );
    }
    for (b, _) in inflight {
        b.finish();
    }
    let st = c.stats();
    let (reqs, posts) = (
        st.requests - before.requests,
        st.send_posts - before.send_posts,
    );
    eprintln!("{reqs} requests in {posts} posts");
    assert!(reqs >= IOS as u64, "{st:?}");
    assert!(
        posts * 10 <= reqs * 6,
        "{posts} posts for {reqs} requests: polled reaps post the requests one by one"
    );
}

#[test]
fn io_poll_mode() {
    io_suite(Completion::Poll);
}

fn control_suite(completion: Completion) {
    let dir = tempfile::tempdir().unwrap();
    // The server grants 8 of the 12 credits the client asks for: the +4
    // below is within what it asked for, so it keeps them (an idle client
    // given credits beyond its ask reports them unused:
    // `unused_credits_are_reported_and_taken_back`).
    let mut opts = no_auto();
    opts.proto.max_credits = 8;
    let s = server(dir.path(), opts);
    let c = connect_with(
        &s,
        ClientOptions {
            completion,
            credits: 12,
            op_timeout: Duration::from_secs(20),
            register_threshold: Some(64 * 1024),
            ..ClientOptions::default()
        },
    );
    let path = dir.path().join("ctl.bin");
    let data = pattern(5, 1 << 20);
    std::fs::write(&path, &data).unwrap();
    let f = c.open("ctl.bin", &OpenOptions::read_write()).unwrap();

    // CANCEL with nothing in flight: completes at once with SUCCESS; the
    // file stays usable. (CANCEL of I/O in flight: `cancel_running_*`.)
    f.cancel().unwrap();
    let mut b = vec![0u8; 4096];
    assert_eq!(f.read_at(&mut b, 4096).unwrap(), 4096);
    assert_eq!(&b[..], &data[4096..8192]);

    // INTERRUPT: answered only after the next I/O completes.
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (c2, d2) = (c.clone(), done.clone());
    let t = std::thread::spawn(move || {
        c2.interrupt().unwrap();
        d2.store(true, std::sync::atomic::Ordering::SeqCst);
    });
    std::thread::sleep(Duration::from_millis(100));
    assert!(
        !done.load(std::sync::atomic::Ordering::SeqCst),
        "INTERRUPT answered without I/O"
    );
    assert_eq!(f.read_at(&mut b, 0).unwrap(), 4096);
    t.join().unwrap();
    assert!(done.load(std::sync::atomic::Ordering::SeqCst));

    // CREDIT: a positive delta, then a negative one.
    assert_eq!(c.credits(), 8);
    assert_eq!(s.rdma.credit_delta_all(4), 1);
    wait_for(|| c.credits() == 12, "positive delta reaches the client");
    assert_eq!(f.read_at(&mut b, 0).unwrap(), 4096);
    wait_for(|| s.rdma.connection_credits() == vec![12], "server at 12");
    s.rdma.credit_delta_all(-9);
    // The client retires credits as it sends its CREDIT replies.
    wait_for(
        || {
            let _ = f.read_at(&mut [0u8; 16], 0);
            c.credits() == 3
        },
        "negative delta retires 9 credits",
    );
    wait_for(|| s.rdma.connection_credits() == vec![3], "server at 3");
    assert_eq!(
        c.stats().credit_history,
        vec![8, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3]
    );

    // Outstanding requests never exceed credits: 6 threads hammer 3 credits.
    // (The peak so far includes the phase with 12 credits: measure afresh.)
    c.reset_peak();
    let f = std::sync::Arc::new(f);
    let ts: Vec<_> = (0..6)
        .map(|i| {
            let f = f.clone();
            let want = data.clone();
            std::thread::spawn(move || {
                let mut b = vec![0u8; 70_001];
                for k in 0..8u64 {
                    let off = (i * 131_071 + k * 7) % (1 << 19);
                    assert_eq!(f.read_at(&mut b, off).unwrap(), b.len());
                    assert_eq!(&b[..], &want[off as usize..off as usize + b.len()]);
                }
            })
        })
        .collect();
    for t in ts {
        t.join().unwrap();
    }
    let st = c.stats();
    assert_eq!(
        s.rdma.stats().credit_overruns,
        0,
        "requests beyond the credits granted"
    );
    assert!(st.max_outstanding <= 3 && st.max_outstanding >= 2, "{st:?}");
    assert_eq!(
        s.rdma.stats().closed_by_protocol,
        0,
        "no credit overflow at the server"
    );
}

fn wait_for(mut f: impl FnMut() -> bool, what: &str) {
    let t = std::time::Instant::now();
    while !f() {
        assert!(t.elapsed() < Duration::from_secs(10), "timed out: {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn cancel_interrupt_credit_interrupt_mode() {
    control_suite(Completion::Interrupt);
}

#[test]
fn cancel_interrupt_credit_poll_mode() {
    control_suite(Completion::Poll);
}

/// A FIFO `name` in the export, which the server serves as a file (test
/// hook): its reads wait in the storage backend (io_uring) until the test
/// writes into it. Returns the test's own end, open for reading and writing.
fn slow_fifo(dir: &Path, name: &str) -> std::fs::File {
    use std::os::unix::ffi::OsStrExt;
    lwio_server::fs::serve_fifos_for_tests(true);
    let p = dir.join(name);
    let c = std::ffi::CString::new(p.as_os_str().as_bytes()).unwrap();
    // SAFETY: mkfifo reads the NUL-terminated path we own.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0, "mkfifo");
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&p)
        .unwrap()
}

/// Whether the server's storage runs on io_uring, which can stop a running
/// read of a FIFO; the thread-pool backend cannot (docs/protocol.md §5.9).
/// Only where io_uring does not work at all may a test skip for it.
fn storage_on_io_uring(s: &LocalServer) -> bool {
    use lwio_server::fs::backend::{BackendKind, UringBackend};
    let kind = s.state.backend.kind();
    if kind == BackendKind::IoUring {
        return true;
    }
    assert!(
        UringBackend::new(2, 1).is_err(),
        "io_uring works here, but the server's storage uses {kind}"
    );
    common::skip("io_uring is unavailable here; running I/O cannot be cancelled");
    false
}

/// CANCEL of I/O in flight at the storage: 32 reads wait in the backend (4
/// running on io_uring, 28 queued for the storage threads), and CANCEL
/// completes every one with STATUS_CANCELLED at once (none of them would
/// ever complete by itself); the Fid goes on working afterwards, both ways.
fn cancel_running_suite(completion: Completion) {
    use std::io::{Read, Write};
    use std::time::Instant;
    let dir = tempfile::tempdir().unwrap();
    let mut opts = no_auto();
    opts.proto.max_credits = 64;
    let s = server(dir.path(), opts);
    if !storage_on_io_uring(&s) {
        return;
    }
    let feed = slow_fifo(dir.path(), "slow.fifo");
    let c = Client::connect(
        &format!("lwio://{}/ex", s.side_addr),
        Some(TOKEN),
        ClientOptions {
            completion,
            credits: 40,
            stage_slots: 40,
            op_timeout: Duration::from_secs(30),
            ..ClientOptions::default()
        }
        .no_tls(),
    )
    .expect("client connects");
    assert!(
        c.credits() >= 33,
        "32 reads and the CANCEL: {}",
        c.credits()
    );
    let f = std::sync::Arc::new(c.open("slow.fifo", &OpenOptions::read_write()).unwrap());
    let readers: Vec<_> = (0..32u64)
        .map(|i| {
            let f = f.clone();
            std::thread::spawn(move || {
                let mut b = vec![0u8; 512];
                let r = f.read_at(&mut b, i * 512);
                (r, Instant::now())
            })
        })
        .collect();
    wait_for(|| c.stats().max_outstanding >= 32, "32 reads in flight");
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        readers.iter().all(|t| !t.is_finished()),
        "a read completed without data"
    );
    assert_eq!(s.rdma.stats().ios_cancelled, 0);
    let asked = Instant::now();
    f.cancel().unwrap();
    for t in readers {
        let (r, at) = t.join().unwrap();
        assert!(matches!(r, Err(Error::Cancelled)), "{r:?}");
        let took = at.duration_since(asked);
        assert!(took < Duration::from_secs(5), "cancelled after {took:?}");
    }
    assert_eq!(s.rdma.stats().ios_cancelled, 32);
    // The Fid still works: what the FIFO is fed is read through it, and
    // what is written through it comes out of the FIFO.
    (&feed).write_all(b"still works").unwrap();
    let mut b = [0u8; 11];
    assert_eq!(f.read_at(&mut b, 0).unwrap(), 11);
    assert_eq!(&b, b"still works");
    assert_eq!(f.write_at(b"and writes", 0).unwrap(), 10);
    let mut back = [0u8; 10];
    (&feed).read_exact(&mut back).unwrap();
    assert_eq!(&back, b"and writes");
    assert_eq!(
        s.rdma.stats().credit_overruns,
        0,
        "requests beyond the credits granted"
    );
    assert_eq!(s.rdma.stats().closed_by_protocol, 0);
}

#[test]
fn cancel_running_ios_interrupt_mode() {
    cancel_running_suite(Completion::Interrupt);
}

#[test]
fn cancel_running_ios_poll_mode() {
    cancel_running_suite(Completion::Poll);
}

#[test]
fn async_api_and_dropped_future() {
    let dir = tempfile::tempdir().unwrap();
    let s = server(dir.path(), no_auto());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let opts = ClientOptions {
            completion: Completion::Poll,
            ..ClientOptions::default()
        };
        let c = AsyncClient::connect(
            &format!("lwio://{}/ex", s.side_addr),
            Some(TOKEN),
            opts.no_tls(),
        )
        .await
        .unwrap();
        let f = c
            .open("async.bin", &OpenOptions::read_write().create(true))
            .await
            .unwrap();
        let data = pattern(3, 777_777);
        assert_eq!(f.write_at(&data, 11).await.unwrap(), data.len());
        assert_eq!(f.len().await.unwrap(), 11 + data.len() as u64);
        let mut b = vec![0u8; data.len()];
        assert_eq!(f.read_at(&mut b, 11).await.unwrap(), data.len());
        assert_eq!(b, data);
        // A dropped future: CANCEL is issued, our buffer is never written.
        let mut keep = vec![0xEEu8; 700_000];
        let mut dropped = false;
        for _ in 0..200 {
            // Poll the read exactly once, then drop it if it is not done
            // (on a fast machine it sometimes is: then try again).
            let r = {
                let mut fut = std::pin::pin!(f.read_at(&mut keep, 0));
                std::future::poll_fn(|cx| {
                    std::task::Poll::Ready(std::future::Future::poll(fut.as_mut(), cx))
                })
                .await
            };
            if r.is_pending() {
                dropped = true;
                assert!(
                    keep.iter().all(|&x| x == 0xEE),
                    "a dropped read wrote the buffer"
                );
                break;
            }
            keep.fill(0xEE);
        }
        assert!(dropped, "no future was dropped before completing");
        assert!(f.dropped_futures() >= 1);
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(keep.iter().all(|&x| x == 0xEE), "written after the drop");
        // The connection goes on working.
        for _ in 0..3 {
            let mut b = vec![0u8; 4096];
            match f.read_at(&mut b, 11).await {
                Ok(n) => {
                    assert_eq!(n, 4096);
                    assert_eq!(&b[..], &data[..4096]);
                }
                Err(Error::Cancelled) => continue, // raced with the CANCEL
                Err(e) => panic!("{e}"),
            }
        }
        f.set_len(100).await.unwrap();
        assert_eq!(f.len().await.unwrap(), 100);
        f.close().await.unwrap();
        if !storage_on_io_uring(&s) {
            return;
        }

        // A dropped future cancels its own request, and no other. Two reads
        // wait at the storage (a FIFO with no data yet); the second future
        // is dropped once its request is out: the server cancels that one
        // request, the other still waits and gets the data fed afterwards.
        use std::io::Write;
        let feed = slow_fifo(dir.path(), "slow.fifo");
        let g = c
            .open("slow.fifo", &OpenOptions::read_write())
            .await
            .unwrap();
        let cancelled = s.rdma.stats().ios_cancelled;
        // Raced: an INTERRUPT a polled read above left out counted in max_outstanding; count requests.
        let issued = c.stats().requests;
        let other = {
            let g = g.clone();
            tokio::spawn(async move {
                let mut b = vec![0u8; 5];
                let r = g.read_at(&mut b, 0).await;
                (r, b)
            })
        };
        wait_for(|| c.stats().requests > issued, "the other read is out");
        let mut keep = vec![0xEEu8; 4096];
        {
            let mut fut = std::pin::pin!(g.read_at(&mut keep, 0));
            let t = std::time::Instant::now();
            while c.stats().requests < issued + 2 {
                assert!(
                    t.elapsed() < Duration::from_secs(10),
                    "second read not issued"
                );
                let r = std::future::poll_fn(|cx| {
                    std::task::Poll::Ready(std::future::Future::poll(fut.as_mut(), cx))
                })
                .await;
                assert!(r.is_pending(), "a read of an empty FIFO completed");
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
        let t = std::time::Instant::now();
        while s.rdma.stats().ios_cancelled == cancelled {
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "the dropped read was not cancelled"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(
            s.rdma.stats().ios_cancelled,
            cancelled + 1,
            "only the dropped read"
        );
        assert!(!other.is_finished(), "the other read was cancelled too");
        (&feed).write_all(b"hello").unwrap();
        let (r, b) = other.await.unwrap();
        assert_eq!(r.unwrap(), 5);
        assert_eq!(&b, b"hello");
        assert!(
            keep.iter().all(|&x| x == 0xEE),
            "the dropped read wrote the buffer"
        );
        assert_eq!(g.dropped_futures(), 1);
        assert_eq!(
            s.rdma.stats().credit_overruns,
            0,
            "requests beyond the credits granted"
        );
    });
}

/// The async data path blocks no thread: 32 tasks on a current-thread
/// runtime (one thread for all of them) each write and read back their own
/// 4 KiB blocks. Each read or write is one request; had any of them blocked
/// the thread while it waited, no two requests would ever have been out at
/// once (2 with the INTERRUPT of a polling waiter). With 8 credits, tasks also wait for credits without blocking.
/// Data byte for byte, in both completion modes.
fn async_concurrency_suite(completion: Completion) {
    let dir = tempfile::tempdir().unwrap();
    let s = server(dir.path(), no_auto());
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    // The blocking client connects outside the runtime (its side channel
    // has a runtime of its own).
    let blocking = client(&s, completion);
    rt.block_on(async {
        let c = AsyncClient::from_client(blocking).unwrap();
        let f = c
            .open("conc.bin", &OpenOptions::read_write().create(true))
            .await
            .unwrap();
        let (tasks, blocks) = (32usize, 8usize);
        let mut set = tokio::task::JoinSet::new();
        for t in 0..tasks {
            let f = f.clone();
            set.spawn(async move {
                for b in 0..blocks {
                    let at = ((b * tasks + t) * 4096) as u64;
                    let data = pattern((t * blocks + b) as u64, 4096);
                    assert_eq!(f.write_at(&data, at).await.unwrap(), 4096);
                    let mut back = vec![0u8; 4096];
                    assert_eq!(f.read_at(&mut back, at).await.unwrap(), 4096);
                    assert_eq!(back, data, "task {t} block {b}");
                }
            });
        }
        while let Some(r) = set.join_next().await {
            r.unwrap();
        }
        let st = c.stats();
        // Blocking waits would allow one request, plus in polling mode the
        // INTERRUPT that wakes the waiter: at most 2.
        assert!(
            st.max_outstanding > 2,
            "one thread never had more than two requests out: the futures block ({st:?})"
        );
        assert_eq!(
            s.rdma.stats().credit_overruns,
            0,
            "requests beyond the credits granted"
        );
        let whole = local_read(&dir.path().join("conc.bin"), 0, tasks * blocks * 4096);
        for t in 0..tasks {
            for b in 0..blocks {
                let at = (b * tasks + t) * 4096;
                assert_eq!(
                    &whole[at..at + 4096],
                    &pattern((t * blocks + b) as u64, 4096)[..],
                    "file at {at}"
                );
            }
        }
        f.close().await.unwrap();
    });
}

#[test]
fn async_concurrency_interrupt_mode() {
    async_concurrency_suite(Completion::Interrupt);
}

#[test]
fn async_concurrency_poll_mode() {
    async_concurrency_suite(Completion::Poll);
}

/// Large reads land in the caller's memory: a plain buffer is registered
/// for the call; a `register_buffer` buffer comes from the registration
/// cache (LRU-bounded, released on drop). Data is byte-exact either way and
/// every window is invalidated.
fn registered_suite(completion: Completion) {
    let dir = tempfile::tempdir().unwrap();
    let s = server(dir.path(), no_auto());
    let opts = ClientOptions {
        completion,
        credits: 8,
        reg_cache_entries: 2,
        register_threshold: Some(64 * 1024),
        op_timeout: Duration::from_secs(20),
        ..ClientOptions::default()
    };
    let c = Client::connect(
        &format!("lwio://{}/ex", s.side_addr),
        Some(TOKEN),
        opts.no_tls(),
    )
    .unwrap();
    let data = pattern(77, 3 << 20);
    std::fs::write(dir.path().join("r.bin"), &data).unwrap();
    let f = c.open("r.bin", &OpenOptions::read_only()).unwrap();

    // Below the threshold: staged, no registration.
    let mut small = vec![0u8; 60_000];
    assert_eq!(f.read_at(&mut small, 5).unwrap(), small.len());
    assert_eq!(&small[..], &data[5..60_005]);
    assert_eq!(c.stats().call_registrations, 0);

    // A plain 1 MiB buffer at an odd offset: registered for the call.
    let mut plain = vec![0u8; 1 << 20];
    assert_eq!(f.read_at(&mut plain, 4097).unwrap(), plain.len());
    assert_eq!(&plain[..], &data[4097..4097 + (1 << 20)]);
    assert_eq!(c.stats().call_registrations, 1);

    // Cached buffers: registered once, reads (also into ranges) hit.
    let mut a = c.register_buffer(1 << 20).unwrap();
    let mut b = c.register_buffer(300_000).unwrap();
    let st0 = c.stats();
    assert_eq!(st0.reg_cache_misses, 2, "{st0:?}");
    for k in 0..3u64 {
        let off = k * 777_777;
        assert_eq!(f.read_registered(&mut a, 0..1 << 20, off).unwrap(), 1 << 20);
        assert_eq!(&a[..], &data[off as usize..off as usize + (1 << 20)]);
        assert_eq!(
            f.read_registered(&mut b, 1000..201_000, off + 3).unwrap(),
            200_000
        );
        assert_eq!(
            &b[1000..201_000],
            &data[off as usize + 3..off as usize + 200_003]
        );
    }
    let st1 = c.stats();
    assert_eq!(st1.reg_cache_hits, st0.reg_cache_hits + 6, "{st1:?}");
    assert_eq!(st1.call_registrations, 1, "{st1:?}");
    assert_eq!(st1.reg_cache_misses, 2, "{st1:?}");
    // The same without a `&mut [u8]` over the bytes: a cache hit, byte-exact,
    // nothing outside the range touched; bad ranges are errors.
    b[999] = 0x5A;
    b[201_000] = 0x5A;
    assert_eq!(
        f.read_registered(&mut b, 1000..201_000, 17).unwrap(),
        200_000
    );
    assert_eq!(&b[1000..201_000], &data[17..200_017]);
    assert_eq!((b[999], b[201_000]), (0x5A, 0x5A));
    assert_eq!(c.stats().reg_cache_hits, st1.reg_cache_hits + 1);
    // A `&mut` slice of a registered buffer never goes through the cached
    // registration (the peer would write behind the reference): below the
    // threshold it is staged, above it registered for the call.
    let st1 = c.stats();
    assert_eq!(f.read_at(&mut b[1000..51_000], 5).unwrap(), 50_000);
    assert_eq!(&b[1000..51_000], &data[5..50_005]);
    assert_eq!(f.read_at(&mut b[..], 6).unwrap(), 300_000);
    assert_eq!(&b[..], &data[6..300_006]);
    let st = c.stats();
    assert_eq!(st.reg_cache_hits, st1.reg_cache_hits, "{st:?}");
    assert_eq!(st.call_registrations, st1.call_registrations + 1, "{st:?}");
    assert!(f.read_registered(&mut b, 0..300_001, 0).is_err());
    #[allow(clippy::reversed_empty_ranges)]
    let backwards = 10..5;
    assert!(f.read_registered(&mut b, backwards, 0).is_err());
    assert_eq!(f.read_registered(&mut b, 7..7, 0).unwrap(), 0);
    // Small: staged into the range.
    assert_eq!(f.read_registered(&mut b, 5..105, 9).unwrap(), 100);
    assert_eq!(&b[5..105], &data[9..109]);

    // A third buffer with a 2-entry bound evicts the least recently used
    // registration (a); a's next read registers it again.
    let mut x = c.register_buffer(70_000).unwrap();
    assert_eq!(c.stats().reg_cache_evictions, 1);
    assert_eq!(f.read_registered(&mut x, 0..70_000, 9).unwrap(), 70_000);
    assert_eq!(&x[..], &data[9..70_009]);
    assert_eq!(f.read_registered(&mut a, 0..1 << 20, 11).unwrap(), 1 << 20);
    assert_eq!(&a[..], &data[11..11 + (1 << 20)]);
    let st2 = c.stats();
    assert_eq!(st2.reg_cache_misses, 4, "{st2:?}");
    assert_eq!(st2.reg_cache_evictions, 2, "{st2:?}");

    // Explicit release, then reads into plain memory again.
    drop(a);
    drop(b);
    drop(x);
    let mut plain = vec![0u8; 200_000];
    assert_eq!(f.read_at(&mut plain, 1).unwrap(), 200_000);
    assert_eq!(&plain[..], &data[1..200_001]);
    // Short read at end of file into caller memory.
    let mut tail = vec![0xA5u8; 100_000];
    let n = f.read_at(&mut tail, data.len() as u64 - 30_000).unwrap();
    assert_eq!(n, 30_000);
    assert_eq!(&tail[..n], &data[data.len() - 30_000..]);

    let st = c.stats();
    assert_eq!(st.windows_bound, st.windows_invalidated, "{st:?}");
    assert_eq!(
        s.rdma.stats().credit_overruns,
        0,
        "requests beyond the credits granted"
    );
    // Least privilege (seed 002): the provider registered caller and engine
    // memory with no remote right of its own (reached only through the
    // windows bound per request), counted by the provider itself.
    let census = c.engine().census();
    assert!(census.mrs >= 5 && census.mws > 0, "{census:?}");
    assert_eq!(census.mrs_remote, 0, "{census:?}");
}

/// Defaults on the soft provider: plain memory is staged (measured as fast
/// or faster there), a registered buffer still lands directly.
#[test]
fn soft_default_stages_plain_reads() {
    let dir = tempfile::tempdir().unwrap();
    let s = server(dir.path(), no_auto());
    let c = Client::connect(
        &format!("lwio://{}/ex", s.side_addr),
        Some(TOKEN),
        ClientOptions::default().no_tls(),
    )
    .unwrap();
    assert_eq!(c.provider(), "soft");
    let data = pattern(8, 1 << 20);
    std::fs::write(dir.path().join("d.bin"), &data).unwrap();
    let f = c.open("d.bin", &OpenOptions::read_only()).unwrap();
    let mut plain = vec![0u8; 1 << 20];
    assert_eq!(f.read_at(&mut plain, 0).unwrap(), 1 << 20);
    assert_eq!(plain, data);
    let mut rb = c.register_buffer(1 << 20).unwrap();
    assert_eq!(f.read_registered(&mut rb, 0..4096, 4096).unwrap(), 4096);
    assert_eq!(&rb[..4096], &data[4096..8192]);
    let st = c.stats();
    assert_eq!(st.call_registrations, 0, "{st:?}");
    assert_eq!(st.reg_cache_hits, 1, "{st:?}");
}

#[test]
fn registered_reads_interrupt_mode() {
    registered_suite(Completion::Interrupt);
}

#[test]
fn registered_reads_poll_mode() {
    registered_suite(Completion::Poll);
}

/// Open flags of the fds this process holds on `path` (the in-process
/// server's), from /proc/self/fdinfo.
fn fd_flags(path: &Path) -> Vec<i32> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc/self/fd").unwrap().flatten() {
        if std::fs::read_link(e.path()).ok().as_deref() != Some(path) {
            continue;
        }
        let info = std::fs::read_to_string(format!(
            "/proc/self/fdinfo/{}",
            e.file_name().to_string_lossy()
        ))
        .unwrap_or_default();
        if let Some(l) = info.lines().find(|l| l.starts_with("flags:")) {
            out.push(i32::from_str_radix(l[6..].trim(), 8).unwrap());
        }
    }
    out
}

fn status_of(r: Result<usize, Error>) -> u32 {
    match r {
        Err(Error::Status { status, .. }) => status,
        Err(Error::AccessDenied(_)) => STATUS_ACCESS_DENIED,
        Ok(_) => STATUS_SUCCESS,
        Err(e) => panic!("unexpected error {e}"),
    }
}

/// FILE_NO_INTERMEDIATE_BUFFERING (O_DIRECT): aligned reads and writes work
/// (byte-exact), unaligned ones fail with INVALID_PARAMETER; VEC_WRITE with
/// COLLAPSE writes its page repeated, and is refused without the flag.
fn direct_suite(completion: Completion) {
    let dir = tempfile::tempdir().unwrap();
    let s = server(dir.path(), no_auto());
    let c = client(&s, completion);
    let path = dir.path().join("direct.bin");
    let f = c
        .open(
            "direct.bin",
            &OpenOptions::read_write().create(true).no_buffering(true),
        )
        .unwrap();
    assert!(
        fd_flags(&path).iter().any(|fl| fl & libc::O_DIRECT != 0),
        "server opened with O_DIRECT: {:?}",
        fd_flags(&path)
    );
    // Aligned writes (several requests) and reads (staged and registered).
    let d = pattern(31, 512 * 1024);
    assert_eq!(f.write_at(&d, 8192).unwrap(), d.len());
    assert_eq!(local_read(&path, 8192, d.len()), d);
    let mut b = vec![0u8; 3 * 4096];
    assert_eq!(f.read_at(&mut b, 8192 + 4096).unwrap(), b.len());
    assert_eq!(&b[..], &d[4096..4096 * 4]);
    let mut big = vec![0u8; 256 * 1024];
    assert_eq!(f.read_at(&mut big, 8192 + 65_536).unwrap(), big.len());
    assert_eq!(&big[..], &d[65_536..65_536 + 256 * 1024]);
    // Unaligned offset or length: INVALID_PARAMETER, nothing written.
    assert_eq!(
        status_of(f.write_at(&pattern(1, 4096), 8193)),
        STATUS_INVALID_PARAMETER
    );
    assert_eq!(
        status_of(f.write_at(&pattern(1, 1000), 8192)),
        STATUS_INVALID_PARAMETER
    );
    assert_eq!(local_read(&path, 8192, d.len()), d);
    assert_eq!(status_of(f.read_at(&mut b, 100)), STATUS_INVALID_PARAMETER);
    assert_eq!(
        status_of(f.read_at(&mut b[..1000], 4096)),
        STATUS_INVALID_PARAMETER
    );
    let mut big_odd = vec![0u8; 200_000];
    assert_eq!(
        status_of(f.read_at(&mut big_odd, 8192)),
        STATUS_INVALID_PARAMETER
    );

    // COLLAPSE: one page on the wire per request, 40 pages on disk.
    let page = pattern(41, 4096);
    let reqs = c.stats().requests;
    let total = 40 * 4096u64;
    assert_eq!(f.write_repeated_at(&page, total, 1 << 20).unwrap(), total);
    let sent = c.stats().requests - reqs;
    assert!(sent <= 2, "COLLAPSE used ({sent} requests for 160 KiB)");
    let back = local_read(&path, 1 << 20, total as usize);
    assert_eq!(back.len(), total as usize);
    for (i, chunk) in back.chunks(4096).enumerate() {
        assert_eq!(chunk, &page[..], "page {i}");
    }

    // Without FILE_NO_INTERMEDIATE_BUFFERING, COLLAPSE is INVALID_PARAMETER.
    let plain_path = dir.path().join("plain.bin");
    let g = c
        .open("plain.bin", &OpenOptions::read_write().create(true))
        .unwrap();
    let e = c.engine();
    let r = e
        .issue_vec_write(g.fid(), 0, 4096, 8192, &page, true)
        .unwrap();
    assert_eq!(e.wait(r).unwrap().1, STATUS_INVALID_PARAMETER);
    assert_eq!(
        std::fs::metadata(&plain_path).unwrap().len(),
        0,
        "nothing written"
    );
    // write_repeated_at on such a file falls back to plain writes.
    assert_eq!(g.write_repeated_at(&page, 3 * 4096, 0).unwrap(), 3 * 4096);
    assert_eq!(local_read(&plain_path, 4096, 4096), page);
    assert_eq!(
        s.rdma.stats().credit_overruns,
        0,
        "requests beyond the credits granted"
    );
}

#[test]
fn direct_io_and_collapse_interrupt_mode() {
    direct_suite(Completion::Interrupt);
}

#[test]
fn direct_io_and_collapse_poll_mode() {
    direct_suite(Completion::Poll);
}

/// Write-through opens are O_DSYNC at the server; data is byte-exact.
#[test]
fn write_through_open() {
    let dir = tempfile::tempdir().unwrap();
    let s = server(dir.path(), no_auto());
    let c = client(&s, Completion::Interrupt);
    let path = dir.path().join("wt.bin");
    let f = c
        .open(
            "wt.bin",
            &OpenOptions::read_write().create(true).write_through(true),
        )
        .unwrap();
    let flags = fd_flags(&path);
    assert!(
        !flags.is_empty() && flags.iter().all(|fl| fl & libc::O_DSYNC == libc::O_DSYNC),
        "server fds are O_DSYNC: {flags:?}"
    );
    let d = pattern(12, 100_003);
    assert_eq!(f.write_at(&d, 17).unwrap(), d.len());
    assert_eq!(local_read(&path, 17, d.len()), d);
    let mut b = vec![0u8; d.len()];
    assert_eq!(f.read_at(&mut b, 17).unwrap(), d.len());
    assert_eq!(b, d);
}

/// `O_SYNC` is `O_SYNC` at the server, not `O_DSYNC` (issue 31): a `sync`
/// open's descriptors carry `__O_SYNC | O_DSYNC`, a `write_through` one's
/// `O_DSYNC` only.
#[test]
fn sync_open_is_o_sync_at_the_server() {
    let dir = tempfile::tempdir().unwrap();
    let s = server(dir.path(), no_auto());
    let c = client(&s, Completion::Interrupt);
    let path = dir.path().join("sync.bin");
    let f = c
        .open(
            "sync.bin",
            &OpenOptions::read_write().create(true).sync(true),
        )
        .unwrap();
    let flags = fd_flags(&path);
    assert!(
        !flags.is_empty() && flags.iter().all(|fl| fl & libc::O_SYNC == libc::O_SYNC),
        "server fds are O_SYNC (0o4010000): {:?}",
        flags.iter().map(|f| format!("{f:o}")).collect::<Vec<_>>()
    );
    let d = pattern(13, 10_007);
    assert_eq!(f.write_at(&d, 3).unwrap(), d.len());
    assert_eq!(local_read(&path, 3, d.len()), d);
    drop(f);
    let dpath = dir.path().join("dsync.bin");
    let _g = c
        .open(
            "dsync.bin",
            &OpenOptions::read_write().create(true).write_through(true),
        )
        .unwrap();
    let flags = fd_flags(&dpath);
    assert!(
        !flags.is_empty() && flags.iter().all(|fl| fl & libc::O_SYNC == libc::O_DSYNC),
        "write-through stays O_DSYNC: {:?}",
        flags.iter().map(|f| format!("{f:o}")).collect::<Vec<_>>()
    );
}

/// A resume key from a read-only open registers (REGISTER carries no access
/// of its own) but cannot write: WRITE, VEC_WRITE and VEC_WRITE with
/// COLLAPSE on its Fid fail with ACCESS_DENIED and the file is unchanged.
/// Symmetrically a write-only open cannot READ.
#[test]
fn read_only_key_cannot_write() {
    let dir = tempfile::tempdir().unwrap();
    let s = server(dir.path(), no_auto());
    let c = client(&s, Completion::Interrupt);
    let path = dir.path().join("ro.bin");
    let data = pattern(3, 64 * 1024);
    std::fs::write(&path, &data).unwrap();
    let f = c.open("ro.bin", &OpenOptions::read_only()).unwrap();
    assert!(matches!(
        f.write_at(b"evil", 0),
        Err(Error::AccessDenied(_))
    ));
    assert!(matches!(
        f.write_at(&pattern(4, 100_000), 0),
        Err(Error::AccessDenied(_))
    ));
    assert!(matches!(
        f.write_vectored_at(&[IoSlice::new(b"a"), IoSlice::new(b"b")], 10),
        Err(Error::AccessDenied(_))
    ));
    let e = c.engine();
    let r = e.issue_write(f.fid(), 0, b"raw").unwrap();
    assert_eq!(e.wait(r).unwrap().1, STATUS_ACCESS_DENIED);
    let g = c
        .open("ro.bin", &OpenOptions::read_only().no_buffering(true))
        .unwrap();
    let page = pattern(5, 4096);
    assert!(matches!(
        g.write_repeated_at(&page, 8192, 0),
        Err(Error::AccessDenied(_))
    ));
    assert_eq!(std::fs::read(&path).unwrap(), data, "file unchanged");
    // Reading is allowed.
    let mut b = vec![0u8; 4096];
    assert_eq!(f.read_at(&mut b, 4096).unwrap(), 4096);
    assert_eq!(&b[..], &data[4096..8192]);
    // A write-only open cannot read.
    let w = c
        .open(
            "ro.bin",
            &OpenOptions(lwio_side::types::OpenOptions {
                write: true,
                ..Default::default()
            }),
        )
        .unwrap();
    assert!(matches!(w.read_at(&mut b, 0), Err(Error::AccessDenied(_))));
    assert_eq!(w.write_at(b"ok", 0).unwrap(), 2);
    assert_eq!(&std::fs::read(&path).unwrap()[..2], b"ok");
}

/// 4 clients (both completion modes) × 3 files each, all concurrent:
/// writes and reads (staged and registered) byte-exact, no credit
/// violations, no protocol closes.
#[test]
fn many_clients_many_files() {
    let dir = tempfile::tempdir().unwrap();
    let s = server(dir.path(), RdmaServerOptions::default());
    let clients: Vec<Client> = (0..4)
        .map(|i| {
            client(
                &s,
                if i % 2 == 0 {
                    Completion::Poll
                } else {
                    Completion::Interrupt
                },
            )
        })
        .collect();
    let mut ts = Vec::new();
    for (ci, c) in clients.iter().enumerate() {
        for fi in 0..3usize {
            let c = c.clone();
            let root = dir.path().to_path_buf();
            ts.push(std::thread::spawn(move || {
                let name = format!("c{ci}f{fi}.bin");
                let f = c
                    .open(&name, &OpenOptions::read_write().create(true))
                    .unwrap();
                let seed = (ci * 10 + fi) as u64;
                let d = pattern(seed, 200_000 + fi * 50_001);
                for round in 0..3u64 {
                    let off = round * 1_000_003 + fi as u64;
                    assert_eq!(f.write_at(&d, off).unwrap(), d.len());
                    let mut b = vec![0u8; d.len()];
                    assert_eq!(f.read_at(&mut b, off).unwrap(), d.len());
                    assert_eq!(b, d, "{name} round {round}");
                    let mut small = vec![0u8; 999];
                    assert_eq!(f.read_at(&mut small, off + 12_345).unwrap(), 999);
                    assert_eq!(&small[..], &d[12_345..12_345 + 999]);
                }
                for round in 0..3u64 {
                    let off = round * 1_000_003 + fi as u64;
                    assert_eq!(local_read(&root.join(&name), off, d.len()), d);
                }
                f.close().unwrap();
            }));
        }
    }
    for t in ts {
        t.join().unwrap();
    }
    for c in &clients {
        let st = c.stats();
        assert_eq!(
            s.rdma.stats().credit_overruns,
            0,
            "requests beyond the credits granted"
        );
        assert_eq!(st.windows_bound, st.windows_invalidated, "{st:?}");
    }
    let ss = s.rdma.stats();
    assert_eq!(ss.closed_by_protocol, 0, "{ss:?}");
    assert_eq!(ss.connections, 4, "{ss:?}");
}

/// Graceful shutdown with I/O in flight: every write the server
/// acknowledged is on disk afterwards, and clients see an error (not a
/// hang) for what was cut off.
#[test]
fn graceful_shutdown_keeps_acknowledged_writes() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = server(dir.path(), RdmaServerOptions::default());
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut ts = Vec::new();
    for ci in 0..2usize {
        let c = client(
            &s,
            if ci == 0 {
                Completion::Poll
            } else {
                Completion::Interrupt
            },
        );
        let stop = stop.clone();
        ts.push(std::thread::spawn(move || {
            let f = c
                .open(
                    &format!("sd{ci}.bin"),
                    &OpenOptions::read_write().create(true),
                )
                .unwrap();
            let mut acked = Vec::new();
            for k in 0..100_000u64 {
                let d = pattern(k + 1000 * ci as u64, 64 * 1024);
                match f.write_at(&d, k * 65_536) {
                    Ok(n) => {
                        assert_eq!(n, d.len());
                        acked.push(k);
                    }
                    Err(_) => break,
                }
                if stop.load(std::sync::atomic::Ordering::Relaxed) {
                    break;
                }
            }
            drop(f);
            acked
        }));
    }
    std::thread::sleep(Duration::from_millis(400));
    let t = std::time::Instant::now();
    s.stop();
    assert!(
        t.elapsed() < Duration::from_secs(15),
        "shutdown took {:?}",
        t.elapsed()
    );
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for (ci, t) in ts.into_iter().enumerate() {
        let acked = t.join().unwrap();
        assert!(!acked.is_empty(), "client {ci} wrote before the shutdown");
        let path = dir.path().join(format!("sd{ci}.bin"));
        for k in acked {
            let d = pattern(k + 1000 * ci as u64, 64 * 1024);
            assert_eq!(
                local_read(&path, k * 65_536, d.len()),
                d,
                "acknowledged write {k} of client {ci} is on disk"
            );
        }
    }
}

/// The server's fast path: on tmpfs the connection thread reads into its
/// read buffer and writes straight from the request's receive buffer (no
/// storage thread, no copy of the data). Same bytes either way; with
/// `inline_io` off, every I/O goes to the storage threads.
fn tmpfs_suite(inline_io: bool) {
    let shm = Path::new("/dev/shm");
    assert!(shm.is_dir(), "/dev/shm (tmpfs) is needed for this test");
    let dir = tempfile::tempdir_in(shm).unwrap();
    let s = server(
        dir.path(),
        RdmaServerOptions {
            inline_io,
            ..no_auto()
        },
    );
    for completion in [Completion::Interrupt, Completion::Poll] {
        let c = client(&s, completion);
        let name = format!("t-{completion:?}.bin");
        let f = c
            .open(&name, &OpenOptions::read_write().create(true))
            .unwrap();
        let data = pattern(11, 300_000);
        assert_eq!(f.write_at(&data, 5).unwrap(), data.len());
        assert_eq!(f.write_at(b"tail", 300_005).unwrap(), 4);
        let mut want = vec![0u8; 5];
        want.extend_from_slice(&data);
        want.extend_from_slice(b"tail");
        assert_eq!(std::fs::read(dir.path().join(&name)).unwrap(), want);
        for (off, len) in [
            (0usize, 4096usize),
            (4093, 1),
            (1000, 200_000),
            (299_000, 1_009),
        ] {
            let mut b = vec![0xAAu8; len];
            assert_eq!(f.read_at(&mut b, off as u64).unwrap(), len);
            assert_eq!(b, want[off..off + len], "read {off}+{len}");
        }
        // Reads past the end: short, then end of file.
        let mut b = vec![0u8; 100];
        assert_eq!(f.read_at(&mut b, 300_000).unwrap(), 9);
        assert_eq!(&b[..9], &want[300_000..]);
        f.close().unwrap();
    }
    let inline = s.rdma.stats().inline_ios;
    if inline_io {
        assert!(inline >= 10, "fast path not taken: {inline}");
    } else {
        assert_eq!(inline, 0);
    }
}

#[test]
fn tmpfs_fast_path() {
    tmpfs_suite(true);
}

#[test]
fn tmpfs_storage_threads() {
    tmpfs_suite(false);
}

/// Discovery: a server that advertises only RoCE (here: the soft server's
/// state told so) and a soft client (iWARP only) share no transport; the
/// client's error names both sides in one line, and no RDMA connection is
/// made.
#[test]
fn transport_mismatch_is_one_line_naming_both_sides() {
    use lwio_proto::transport::{Instance, WireTransport};
    let dir = tempfile::tempdir().unwrap();
    let s = server(dir.path(), no_auto());
    let roce: std::net::SocketAddr = "127.0.0.1:7999".parse().unwrap();
    // The server advertises its real listener once it runs; replace that.
    let t0 = std::time::Instant::now();
    while s.state.rdma_endpoints().is_empty() {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "server never listened"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(s.state.rdma_endpoints()[0].transport, WireTransport::Iwarp);
    s.state
        .set_rdma_endpoints(vec![Instance::new(WireTransport::RoceV2, roce)]);
    let opts = ClientOptions {
        provider: lwio_rdma::ProviderChoice::Soft,
        ..ClientOptions::default()
    };
    let Err(e) = Client::connect(
        &format!("lwio://{}/ex", s.side_addr),
        Some(TOKEN),
        opts.no_tls(),
    ) else {
        panic!("connected without a common transport");
    };
    assert_eq!(
        e,
        Error::NoCommonTransport(
            "no RDMA transport in common: the client offers iWARP, the server offers RoCEv2 at 127.0.0.1:7999"
                .into()
        )
    );
    assert_eq!(
        e.to_string(),
        "no RDMA transport in common: the client offers iWARP, the server offers RoCEv2 at 127.0.0.1:7999"
    );
    assert_eq!(s.rdma.stats().accepted, 0, "no RDMA connection was made");
}

/// Seed 000 claim 9: a client opens several RDMA connections over the
/// shared transport; files are registered on them in turn, and each one
/// moves its file's bytes exactly.
#[test]
fn several_channels_spread_files_byte_for_byte() {
    let dir = tempfile::tempdir().unwrap();
    let s = server(dir.path(), no_auto());
    let opts = ClientOptions {
        completion: Completion::Interrupt,
        channels: 3,
        ..ClientOptions::default()
    };
    let c = Client::connect(
        &format!("lwio://{}/ex", s.side_addr),
        Some(TOKEN),
        opts.no_tls(),
    )
    .expect("client connects");
    assert_eq!(c.channels(), 3);
    assert_eq!(s.rdma.stats().accepted, 3, "three RDMA connections");
    let mut files = Vec::new();
    for i in 0..6u64 {
        let f = c
            .open(
                &format!("ch{i}.bin"),
                &OpenOptions::read_write().create(true),
            )
            .unwrap();
        assert_eq!(f.channel(), (i % 3) as usize, "round robin");
        let data = pattern(i + 40, 200_003 + i as usize);
        assert_eq!(f.write_at(&data, 7).unwrap(), data.len());
        files.push((f, data));
    }
    for (i, (f, data)) in files.iter().enumerate() {
        assert_eq!(
            local_read(&dir.path().join(format!("ch{i}.bin")), 7, data.len()),
            *data
        );
        let mut back = vec![0u8; data.len()];
        assert_eq!(f.read_at(&mut back, 7).unwrap(), data.len());
        assert_eq!(&back, data);
    }
    for n in 0..3 {
        assert!(
            c.channel_stats(n).unwrap().requests >= 4,
            "channel {n} carried I/O"
        );
    }
    assert!(c.channel_stats(3).is_none());
    // A registered buffer is in every channel's cache: a read into it on
    // channel 2 lands without a per-call registration.
    let mut rb = c.register_buffer(200_005).unwrap();
    let before = c.channel_stats(2).unwrap().reg_cache_hits;
    assert_eq!(
        files[2].0.read_registered(&mut rb, 0..200_005, 7).unwrap(),
        200_005
    );
    assert_eq!(&rb[..], &files[2].1[..]);
    assert!(c.channel_stats(2).unwrap().reg_cache_hits > before);
}

/// More threads reading at once than the engine has staging buffers, with
/// polled completions: a thread that has a credit but no buffer must let go
/// of the engine lock while it waits, because buffers come back only when
/// the other threads finish their reads under that lock. (It once spun
/// holding it: `fio --ioengine=posixaio --iodepth=32` under the preload
/// hung.) Every read returns the file's bytes exactly.
#[test]
fn more_readers_than_staging_buffers_poll_mode() {
    let dir = tempfile::tempdir().unwrap();
    let data = pattern(77, 1 << 20);
    std::fs::write(dir.path().join("r.bin"), &data).unwrap();
    let s = server(dir.path(), no_auto());
    let opts = ClientOptions {
        completion: Completion::Poll,
        credits: 32,
        stage_slots: 2,
        op_timeout: Duration::from_secs(20),
        ..ClientOptions::default()
    };
    let c = Client::connect(
        &format!("lwio://{}/ex", s.side_addr),
        Some(TOKEN),
        opts.no_tls(),
    )
    .expect("client connects");
    let f = std::sync::Arc::new(c.open("r.bin", &OpenOptions::read_only()).unwrap());
    let (tx, rx) = std::sync::mpsc::channel();
    for t in 0..12u64 {
        let (f, tx, data) = (f.clone(), tx.clone(), data.clone());
        std::thread::spawn(move || {
            let mut buf = vec![0u8; 16 * 1024];
            for i in 0..40u64 {
                let off = ((t * 40 + i) * 12_289) % (data.len() as u64 - buf.len() as u64);
                let r = f.read_at(&mut buf, off).map(|n| {
                    n == buf.len() && buf[..] == data[off as usize..off as usize + buf.len()]
                });
                if !matches!(r, Ok(true)) {
                    let _ = tx.send(Err(format!("thread {t} read {i} at {off}: {r:?}")));
                    return;
                }
            }
            let _ = tx.send(Ok(()));
        });
    }
    drop(tx);
    for _ in 0..12 {
        match rx.recv_timeout(Duration::from_secs(120)) {
            Ok(r) => r.unwrap(),
            Err(e) => panic!("a reader never finished ({e}): the engine is stuck"),
        }
    }
}

/// Polling: every request's status block gets a one-shot window of its own,
/// bound when it is issued and invalidated when it completes (no window
/// over the whole status area, which a server could write at any time). A
/// write binds exactly one window; a read two (its data and its status);
/// with interrupts a write binds none. All are gone afterwards.
#[test]
fn polled_status_block_window_per_request() {
    let dir = tempfile::tempdir().unwrap();
    let s = server(dir.path(), no_auto());
    for completion in [Completion::Poll, Completion::Interrupt] {
        let c = client(&s, completion);
        let f = c
            .open("sw.bin", &OpenOptions::read_write().create(true))
            .unwrap();
        let s0 = c.stats();
        for i in 0..10u64 {
            assert_eq!(f.write_at(&[i as u8; 100], i * 100).unwrap(), 100);
        }
        let s1 = c.stats();
        let per_write = u64::from(completion == Completion::Poll);
        assert_eq!(
            s1.windows_bound - s0.windows_bound,
            10 * per_write,
            "{s1:?}"
        );
        let mut b = [0u8; 100];
        for i in 0..10u64 {
            assert_eq!(f.read_at(&mut b, i * 100).unwrap(), 100);
            assert_eq!(b, [i as u8; 100]);
        }
        let s2 = c.stats();
        assert_eq!(
            s2.windows_bound - s1.windows_bound,
            10 * (1 + per_write),
            "{s2:?}"
        );
        assert_eq!(s2.windows_bound, s2.windows_invalidated, "{s2:?}");
        if completion == Completion::Poll {
            assert!(s2.polled_completions >= 20, "{s2:?}");
        }
    }
}

/// The CREDIT reply to a positive delta reports the new credits the client
/// does not need (seed 000), and the server takes exactly those back. What
/// an idle client needs is what it asked for at AUTH, at most its
/// `max_credits`: asked 8 and holding 8, all of a +4 are unused (both
/// sides back at 8; before, the report counted only credits above
/// `max_credits`, 255 by default, and it kept 12); asked 12 and granted
/// 8, the +4 are its own; asked 12 but able to use at most 10, the 2
/// above 10 are unused.
#[test]
fn unused_credits_are_reported_and_taken_back() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("u.bin"), pattern(3, 8192)).unwrap();
    let mut opts = no_auto();
    opts.proto.max_credits = 8;
    let s = server(dir.path(), opts);
    for (asked, max, want, hist) in [
        (8u16, 255u16, 8u16, &[8u16, 12, 11, 10, 9, 8][..]),
        (12, 255, 12, &[8, 12][..]),
        (12, 10, 10, &[8, 12, 11, 10][..]),
    ] {
        let opts = ClientOptions {
            completion: Completion::Interrupt,
            credits: asked,
            max_credits: max,
            ..ClientOptions::default()
        };
        let c = Client::connect(
            &format!("lwio://{}/ex", s.side_addr),
            Some(TOKEN),
            opts.no_tls(),
        )
        .expect("client connects");
        let f = c.open("u.bin", &OpenOptions::read_only()).unwrap();
        assert_eq!(c.credits(), 8);
        assert_eq!(s.rdma.credit_delta_all(4), 1);
        wait_for(
            || {
                let _ = f.read_at(&mut [0u8; 16], 0);
                c.stats().credit_history.len() >= hist.len()
                    && c.credits() == want
                    && s.rdma.connection_credits() == vec![usize::from(want)]
            },
            "both sides settle",
        );
        // Settled, not passing through: still there a moment later.
        std::thread::sleep(Duration::from_millis(100));
        let _ = f.read_at(&mut [0u8; 16], 0);
        assert_eq!(c.credits(), want, "asked {asked}, max {max}");
        assert_eq!(s.rdma.connection_credits(), vec![usize::from(want)]);
        assert_eq!(c.stats().credit_history, hist, "asked {asked}, max {max}");
        drop(f);
        drop(c);
        wait_for(|| s.rdma.connection_credits().is_empty(), "client gone");
    }
}

/// A client with a backlog says so in its Credits hint (seed 000: the
/// number of pending requests, those waiting for a credit included) and
/// the balancer grants toward it: 32 threads reading through a connection
/// that starts at 8 credits are granted what their backlog asks (the first
/// grant goes past the balancer's step of 8, to 16), and settle, the same on
/// both sides, between 33 (one per pending request and the one kept back
/// for INTERRUPT and CANCEL) and the client's need, 2 × 32 + 1 = 65 (a
/// connection saturated at 33 may still be given a step of 8, which the
/// client keeps: it is within its need). Before, the hint was at most the
/// credits held + 1, and the balancer only added 8 at a time while the
/// connection was saturated (8, 16, 24, 32, 40). Once the threads stop, the
/// idle connection gives its credits back.
#[test]
fn a_backlog_is_granted_toward_its_demand_and_given_back_when_idle() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let dir = tempfile::tempdir().unwrap();
    let data = pattern(9, 1 << 20);
    std::fs::write(dir.path().join("b.bin"), &data).unwrap();
    let s = server(
        dir.path(),
        RdmaServerOptions {
            idle_reclaim: Duration::from_millis(300),
            ..RdmaServerOptions::default()
        },
    );
    let c = backlog_client(&s);
    let f = Arc::new(c.open("b.bin", &OpenOptions::read_only()).unwrap());
    assert_eq!(c.credits(), 8);
    let stop = Arc::new(AtomicBool::new(false));
    let threads: Vec<_> = (0..32u64)
        .map(|i| {
            let (f, stop, want) = (f.clone(), stop.clone(), data.clone());
            std::thread::spawn(move || {
                let mut b = vec![0u8; 4096];
                let mut k = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let off = ((i * 37 + k * 11) % 256) * 4096;
                    assert_eq!(f.read_at(&mut b, off).unwrap(), 4096);
                    assert_eq!(&b[..], &want[off as usize..off as usize + 4096]);
                    k += 1;
                }
            })
        })
        .collect();
    settles_toward_demand(&c, &s);
    // Settled above 32: all 32 reads in flight at once, given the time for
    // every thread to have one out at the same instant (on a loaded host,
    // 300 ms of settling is not always enough for that).
    wait_for(
        || c.stats().max_outstanding >= 32,
        "32 reads in flight at once",
    );
    stop.store(true, Ordering::Relaxed);
    for t in threads {
        t.join().unwrap();
    }
    // Idle: back to what an idle connection keeps (one credit with the
    // shared receive pool, else its initial 8).
    wait_for(
        || {
            let n = s.rdma.connection_credits();
            n.len() == 1 && n[0] <= 8 && usize::from(c.credits()) == n[0]
        },
        "the idle connection gives its credits back",
    );
    assert_eq!(s.rdma.stats().credit_overruns, 0);
    assert_eq!(s.rdma.stats().closed_by_protocol, 0);
}

/// The client of the backlog tests: interrupts, 8 credits to start, room
/// for 64 staged reads, time enough under load.
fn backlog_client(s: &LocalServer) -> Client {
    connect_with(
        s,
        ClientOptions {
            completion: Completion::Interrupt,
            credits: 8,
            stage_slots: 64,
            op_timeout: Duration::from_secs(20),
            ..ClientOptions::default()
        },
    )
}

/// Wait until the connection's credits settle, the same on both sides,
/// within [33, 65] for 300 ms (one credit per request, and more, but not
/// twice as many), and check that the first grant went past the balancer's
/// step of 8 for a saturated connection (8 -> 16): it granted toward the
/// backlog the Credits hint reported.
fn settles_toward_demand(c: &Client, s: &LocalServer) {
    let at = |n: u16| c.credits() == n && s.rdma.connection_credits() == vec![usize::from(n)];
    let t = Instant::now();
    let settled = loop {
        let n = c.credits();
        let since = Instant::now();
        while (33..=65).contains(&n) && at(n) && since.elapsed() < Duration::from_millis(300) {
            std::thread::sleep(Duration::from_millis(5));
        }
        if since.elapsed() >= Duration::from_millis(300) {
            break n;
        }
        assert!(
            t.elapsed() < Duration::from_secs(15),
            "no settling within [33, 65]: client {}, server {:?}, history {:?}",
            c.credits(),
            s.rdma.connection_credits(),
            c.stats().credit_history
        );
        std::thread::sleep(Duration::from_millis(5));
    };
    let history = c.stats().credit_history;
    assert!(
        history.get(1).is_some_and(|&h| h > 16),
        "the first grant was a step of 8 (settled at {settled}): {history:?}"
    );
}

/// The Credits hint counts async futures waiting for a credit as it counts
/// threads blocked in an issue: 32 tasks on one thread, each keeping a
/// 4 KiB read going, on a connection that starts with 8 credits, are
/// granted toward their backlog as the 32 threads above are (without the
/// futures in the hint, the balancer only sees a saturated connection and
/// steps by 8).
#[test]
fn async_futures_waiting_for_a_credit_count_in_the_hint() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let dir = tempfile::tempdir().unwrap();
    let data = pattern(10, 1 << 20);
    std::fs::write(dir.path().join("b.bin"), &data).unwrap();
    let s = server(dir.path(), RdmaServerOptions::default());
    let blocking = backlog_client(&s);
    let stop = Arc::new(AtomicBool::new(false));
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let c = rt.block_on(async { AsyncClient::from_client(blocking).unwrap() });
    let watcher = {
        let (bc, flag) = (c.blocking().clone(), stop.clone());
        let s = &s;
        std::thread::scope(|sc| {
            let w = sc.spawn(move || {
                assert_eq!(bc.credits(), 8);
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    settles_toward_demand(&bc, s)
                }));
                flag.store(true, Ordering::Relaxed);
                r
            });
            rt.block_on(async {
                let f = c.open("b.bin", &OpenOptions::read_only()).await.unwrap();
                let mut set = tokio::task::JoinSet::new();
                for i in 0..32u64 {
                    let (f, stop, want) = (f.clone(), stop.clone(), data.clone());
                    set.spawn(async move {
                        let mut b = vec![0u8; 4096];
                        let mut k = 0u64;
                        while !stop.load(Ordering::Relaxed) {
                            let off = ((i * 37 + k * 11) % 256) * 4096;
                            assert_eq!(f.read_at(&mut b, off).await.unwrap(), 4096);
                            assert_eq!(&b[..], &want[off as usize..off as usize + 4096]);
                            k += 1;
                        }
                    });
                }
                while let Some(r) = set.join_next().await {
                    r.unwrap();
                }
            });
            w.join().unwrap()
        })
    };
    if let Err(p) = watcher {
        std::panic::resume_unwind(p);
    }
    // Settled above 32: all 32 reads in flight at once, given the time for
    // every thread to have one out at the same instant (on a loaded host,
    // 300 ms of settling is not always enough for that).
    wait_for(
        || c.stats().max_outstanding >= 32,
        "32 reads in flight at once",
    );
    assert_eq!(s.rdma.stats().credit_overruns, 0);
}

/// Polling with no spin budget: every wait goes straight to the automatic
/// path (send INTERRUPT, sleep until its answer, which follows the server's
/// next completion, with a bounded backoff). Every read returns its bytes,
/// INTERRUPTs were sent, and no credit was overdrawn by them.
#[test]
fn polled_waits_sleep_on_interrupt() {
    let dir = tempfile::tempdir().unwrap();
    let data = pattern(21, 4 << 20);
    std::fs::write(dir.path().join("i.bin"), &data).unwrap();
    let s = server(dir.path(), no_auto());
    let opts = ClientOptions {
        completion: Completion::Poll,
        credits: 8,
        poll_spin: Duration::ZERO,
        op_timeout: Duration::from_secs(20),
        ..ClientOptions::default()
    };
    let c = Client::connect(
        &format!("lwio://{}/ex", s.side_addr),
        Some(TOKEN),
        opts.no_tls(),
    )
    .expect("client connects");
    let f = c.open("i.bin", &OpenOptions::read_only()).unwrap();
    let mut b = vec![0u8; 1 << 20];
    for i in 0..24u64 {
        let off = (i * 333_331) % (3 << 20);
        assert_eq!(f.read_at(&mut b, off).unwrap(), b.len());
        assert!(
            b[..] == data[off as usize..off as usize + b.len()],
            "read {i}"
        );
    }
    // A read that certainly waits: its data comes 200 ms later. With no
    // spin budget the waiter finds its block unwritten and sleeps on an
    // INTERRUPT (the reads above may all have found theirs written already
    // on a loaded machine, so they prove nothing about it).
    use std::io::Write;
    let mut feed = slow_fifo(dir.path(), "later.fifo");
    let g = c.open("later.fifo", &OpenOptions::read_write()).unwrap();
    // The last read's own INTERRUPT is answered right after its completion;
    // until the client has taken that answer it counts as outstanding, and a
    // new wait sleeps on it instead of sending one (the assertion below then
    // failed now and then under load). The progress thread takes it within
    // this pause.
    // An INTERRUPT that reached the server after the last read had
    // completed is answered only at the next completion (the FIFO read's):
    // the new wait then sleeps on that one rather than sending another.
    // Either way the slow read ends by an INTERRUPT's answer, which the
    // status-message count shows.
    std::thread::sleep(Duration::from_millis(100));
    let before = c.stats();
    let t = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(200));
        feed.write_all(b"later").unwrap();
        feed
    });
    let mut small = [0u8; 5];
    assert_eq!(g.read_at(&mut small, 0).unwrap(), 5);
    assert_eq!(&small, b"later");
    let _feed = t.join().unwrap();
    let st = c.stats();
    assert!(st.interrupts_sent > 0, "{st:?}");
    assert!(
        st.interrupt_completions > before.interrupt_completions,
        "the slow read did not sleep on an INTERRUPT: {before:?} -> {st:?}"
    );
    assert_eq!(
        s.rdma.stats().credit_overruns,
        0,
        "requests beyond the credits granted"
    );
}

/// Issue 33, item 1: at full queue depth a polled waiter can still send
/// its INTERRUPT (one credit is kept back for INTERRUPT and CANCEL), so a
/// read whose data comes late is woken by the INTERRUPT's answer within a
/// few ms of the data, not by the re-poll timer (1 -> 64 ms) or the 20 ms
/// scan. Before, with every credit in use, no INTERRUPT went out.
#[test]
fn a_polled_read_at_full_queue_depth_is_woken_by_its_interrupt() {
    use std::io::Write;
    let dir = tempfile::tempdir().unwrap();
    let s = server(dir.path(), no_auto());
    // Two credits, and a read of two chunks: the read's requests take every
    // credit requests may take.
    let opts = ClientOptions {
        completion: Completion::Poll,
        credits: 2,
        max_credits: 2,
        read_chunk: 4096,
        poll_spin: Duration::ZERO,
        op_timeout: Duration::from_secs(20),
        ..ClientOptions::default()
    }
    .no_tls();
    let c = Client::connect(&format!("lwio://{}/ex", s.side_addr), Some(TOKEN), opts)
        .expect("client connects");
    assert_eq!(c.credits(), 2);
    let mut feed = slow_fifo(dir.path(), "late.fifo");
    let f = c.open("late.fifo", &OpenOptions::read_write()).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    let before = c.stats();
    // The data comes 300 ms after the read is issued.
    let t = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        let fed = Instant::now();
        feed.write_all(&[b'x'; 8192]).unwrap();
        (feed, fed)
    });
    let mut b = vec![0u8; 8192];
    let mut got = 0;
    while got < b.len() {
        let n = f.read_at(&mut b[got..], 0).unwrap();
        assert!(n > 0, "end of data after {got} bytes");
        got += n;
    }
    let back = Instant::now();
    let (_feed, fed) = t.join().unwrap();
    assert!(b.iter().all(|&x| x == b'x'));
    let st = c.stats();
    assert!(
        st.interrupts_sent > before.interrupts_sent,
        "no INTERRUPT went out at full queue depth: {before:?} -> {st:?}"
    );
    // The INTERRUPT's answer and the read's status race: the read's waiter
    // may see its status (it polls) a moment before the engine has taken
    // the INTERRUPT's answer off the queue, so the answer is waited for.
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut st = st;
    while st.interrupts_answered == before.interrupts_answered && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
        st = c.stats();
    }
    assert!(
        st.interrupts_answered > before.interrupts_answered,
        "no INTERRUPT was answered: {before:?} -> {st:?}"
    );
    // The time only catches a wait gone wrong (with the re-poll timer
    // alone it is up to 64 ms more, which a loaded CI machine can also
    // take, so the bound is loose).
    let late = back.saturating_duration_since(fed);
    assert!(
        late < Duration::from_millis(500),
        "the read came back {late:?} after the data"
    );
    assert_eq!(
        s.rdma.stats().credit_overruns,
        0,
        "requests beyond the credits granted"
    );
}

/// Issue 13: an idle client costs (almost) no wake-ups. Connected, a file
/// open and nothing in flight, its progress thread sleeps until an event or
/// a deadline, not on a 20 ms tick (which was 50 wake-ups a second per
/// client); a read right after is served byte for byte.
fn idle_suite(completion: Completion) {
    let dir = tempfile::tempdir().unwrap();
    let s = server(dir.path(), RdmaServerOptions::default());
    let c = client(&s, completion);
    let f = c
        .open("idle.bin", &OpenOptions::read_write().create(true))
        .unwrap();
    let data = pattern(13, 100_003);
    assert_eq!(f.write_at(&data, 0).unwrap(), data.len());
    let mut back = vec![0u8; data.len()];
    assert_eq!(f.read_at(&mut back, 0).unwrap(), data.len());
    assert_eq!(back, data);
    // What a polling waiter whose spin ran out leaves behind: an INTERRUPT
    // outstanding until the next completion. It has no deadline, and no
    // status block to scan.
    // (The reads above may have sent one already: then this one joins it.)
    c.engine().arm_interrupt();
    assert!(c.stats().interrupts_sent >= 1);
    // The server's credit balancing may still take back what the traffic
    // earned (a credit transaction: a few wake-ups); then nothing happens.
    std::thread::sleep(Duration::from_millis(500));
    let window = Duration::from_secs(2);
    let before = c.stats().progress_wakeups;
    std::thread::sleep(window);
    let woke = c.stats().progress_wakeups - before;
    eprintln!("{completion:?}: {woke} progress wake-ups in {window:?} idle");
    assert!(
        woke <= 5 * window.as_secs(),
        "{completion:?}: an idle client's progress thread woke {woke} times in {window:?}"
    );
    let mut again = vec![0u8; data.len()];
    assert_eq!(f.read_at(&mut again, 0).unwrap(), data.len());
    assert_eq!(again, data);
    let st = c.stats();
    assert_eq!(
        s.rdma.stats().credit_overruns,
        0,
        "requests beyond the credits granted"
    );
    assert_eq!(st.timed_out, 0);
}

#[test]
fn idle_client_sleeps() {
    for completion in [Completion::Interrupt, Completion::Poll] {
        idle_suite(completion);
    }
}

/// The deadlines the progress thread sleeps to still fire: a read that
/// nobody waits for (its request at the server, waiting on an empty FIFO)
/// times out in the state machine at the op timeout, found by the progress
/// thread alone; fed, the FIFO completes it (the engine frees its staging
/// buffer) and the file works on.
fn unwaited_deadline_suite(completion: Completion) {
    use std::io::Write;
    let dir = tempfile::tempdir().unwrap();
    let s = server(dir.path(), no_auto());
    let feed = slow_fifo(dir.path(), &format!("deadline-{completion:?}.fifo"));
    let op_timeout = Duration::from_millis(700);
    let c = connect_with(
        &s,
        ClientOptions {
            completion,
            credits: 8,
            op_timeout,
            ..ClientOptions::default()
        },
    );
    let f = c
        .open(
            &format!("deadline-{completion:?}.fifo"),
            &OpenOptions::read_write(),
        )
        .unwrap();
    let e = c.engine();
    let (req, _stage) = e.issue_read(f.fid(), 0, 16, None).unwrap();
    e.flush();
    let issued = std::time::Instant::now();
    std::thread::sleep(op_timeout / 2);
    assert_eq!(c.stats().timed_out, 0, "timed out early");
    wait_for(
        || c.stats().timed_out == 1,
        "the unwaited request times out",
    );
    let late = issued.elapsed();
    assert!(
        late < op_timeout + Duration::from_millis(500),
        "{completion:?}: timed out {late:?} after issue (op timeout {op_timeout:?})"
    );
    // Its waiter comes late: the request timed out (and is abandoned).
    assert!(matches!(e.wait(req), Err(Error::TimedOut(_))));
    // The server answers it once the FIFO has data; the file works on.
    (&feed).write_all(&[1u8; 16]).unwrap();
    (&feed).write_all(b"fifo works").unwrap();
    let mut b = [0u8; 10];
    assert_eq!(f.read_at(&mut b, 0).unwrap(), 10, "read after the timeout");
    assert_eq!(&b, b"fifo works");
    assert_eq!(
        s.rdma.stats().credit_overruns,
        0,
        "requests beyond the credits granted"
    );
}

#[test]
fn unwaited_deadline_fires() {
    for completion in [Completion::Interrupt, Completion::Poll] {
        unwaited_deadline_suite(completion);
    }
}

/// An idle client, asleep without a deadline, still sees its connection
/// go: the server stops and the channel reports it lost at once (a flushed
/// receive is an event), not on a tick.
#[test]
fn idle_client_sees_the_server_go() {
    for completion in [Completion::Interrupt, Completion::Poll] {
        let dir = tempfile::tempdir().unwrap();
        let mut s = server(dir.path(), no_auto());
        let c = client(&s, completion);
        let f = c
            .open("gone.bin", &OpenOptions::read_write().create(true))
            .unwrap();
        assert_eq!(f.write_at(b"before", 0).unwrap(), 6);
        std::thread::sleep(Duration::from_millis(300));
        let e = c.engine();
        assert!(e.lost().is_none());
        let woke = c.stats().progress_wakeups;
        s.stop();
        wait_for(|| e.lost().is_some(), "the idle client sees the loss");
        eprintln!(
            "{completion:?}: lost ({:?}) after {} wake-ups",
            e.lost(),
            c.stats().progress_wakeups - woke
        );
    }
}

/// Interrupt mode: a waiter polls the completion queue for up to
/// `busy_poll` before it sleeps, and a reply inside that window ends the
/// wait without a sleep. `busy_poll` zero: every wait that finds its reply
/// missing sleeps at once. The bytes are exact either way.
#[test]
fn interrupt_waiters_busy_poll_before_they_sleep() {
    let dir = tempfile::tempdir().unwrap();
    let s = server(dir.path(), RdmaServerOptions::default());
    let data = pattern(29, 64 * 4096);
    for (busy_poll, polls) in [(Duration::from_secs(1), true), (Duration::ZERO, false)] {
        let c = connect_with(
            &s,
            ClientOptions {
                completion: Completion::Interrupt,
                busy_poll,
                op_timeout: Duration::from_secs(20),
                ..ClientOptions::default()
            },
        );
        let f = c
            .open("busy.bin", &OpenOptions::read_write().create(true))
            .unwrap();
        assert_eq!(f.write_at(&data, 0).unwrap(), data.len());
        let before = c.stats().busy_poll_hits;
        let mut buf = vec![0u8; 4096];
        for i in 0..200usize {
            let off = (i * 37 % 63) * 4096 + i % 17;
            assert_eq!(f.read_at(&mut buf, off as u64).unwrap(), 4096);
            assert_eq!(buf[..], data[off..off + 4096], "read {i} at {off}");
        }
        let hits = c.stats().busy_poll_hits - before;
        eprintln!("busy_poll {busy_poll:?}: {hits} of 200 reads ended by busy polling");
        if polls {
            // Other tests of this binary may hold the process's polling
            // places (one per CPU) for a moment: not every read, but some.
            assert!(hits > 0, "no wait ended by busy polling in 200 reads");
        } else {
            assert_eq!(hits, 0);
        }
        let st = c.stats();
        assert_eq!(
            s.rdma.stats().credit_overruns,
            0,
            "requests beyond the credits granted"
        );
        assert_eq!(st.timed_out, 0, "{st:?}");
    }
}

/// A client's progress thread lives as long as its engine does (issue 33:
/// one once ended with nothing logged while its client went on): through
/// I/O, idle stretches longer than its longest standby nap, and a large
/// write, in both completion modes; and it ends, with the connection
/// reported lost, when the server goes.
#[test]
fn progress_threads_live_as_long_as_their_engines() {
    for completion in [Completion::Interrupt, Completion::Poll] {
        let dir = tempfile::tempdir().unwrap();
        let s = server(dir.path(), RdmaServerOptions::default());
        let c = client(&s, completion);
        let alive = |what: &str| {
            for (i, e) in c.engines().iter().enumerate() {
                assert!(
                    e.progress_running(),
                    "{completion:?}: channel {i}'s progress thread ended {what}"
                );
            }
        };
        alive("at connect");
        let data = pattern(31, (8 << 20) + 1);
        let f = c
            .open("p.bin", &OpenOptions::read_write().create(true))
            .unwrap();
        assert_eq!(f.write_at(&data, 0).unwrap(), data.len());
        alive("after an 8 MiB + 1 write");
        for round in 0..3 {
            // Longer than the standby naps (up to 50 ms) and the re-poll
            // backoff: the thread sleeps, and must come back.
            std::thread::sleep(Duration::from_millis(300));
            let mut buf = vec![0u8; 4096];
            assert_eq!(f.read_at(&mut buf, 4096 * round).unwrap(), 4096);
            assert_eq!(buf[..], data[4096 * round as usize..][..4096]);
            alive("after an idle stretch");
        }
        drop(f);
        // The server goes: the thread ends, and says why (the engine is
        // marked lost, so no waiter waits on it).
        drop(s);
        wait_for(
            || c.engines().iter().all(|e| !e.progress_running()),
            "progress threads to end after the server went",
        );
    }
}

/// fsync and fdatasync of an open file are a FLUSH on its RDMA connection
/// (docs/protocol.md §5.13), counted by the server as such, on files open
/// for writing and for reading alike; the data written before is in the
/// file. Against a server that does not offer FLUSH, the same calls go
/// over the side channel.
#[test]
fn sync_is_a_flush_on_the_rdma_connection() {
    use lwio_proto::wire::common::Opcode;
    for offered in [true, false] {
        let dir = tempfile::tempdir().unwrap();
        let mut rdma = no_auto();
        rdma.proto.flush = offered;
        let s = server(dir.path(), rdma);
        let c = client(&s, Completion::Interrupt);
        let f = c
            .open("wal", &OpenOptions::read_write().create(true))
            .expect("open");
        let data = pattern(5, 8192);
        assert_eq!(f.write_at(&data, 8192).unwrap(), data.len());
        assert_eq!(f.syncs_on_rdma(), offered);
        f.sync_data().expect("fdatasync");
        f.sync_all().expect("fsync");
        assert_eq!(local_read(&dir.path().join("wal"), 8192, 8192), data);
        let r = c.open("wal", &OpenOptions::read_only()).expect("open ro");
        r.sync_all().expect("fsync of a read-only open");
        let want = if offered { 3 } else { 0 };
        wait_for(
            || s.rdma.request_stats().op(Opcode::Flush).requests >= want,
            "the server's FLUSH count",
        );
        let st = s.rdma.request_stats();
        assert_eq!(st.op(Opcode::Flush).requests, want, "offered: {offered}");
        assert_eq!(st.op(Opcode::Flush).completed, want);
        assert!(st.errors.is_empty() || !offered, "{:?}", st.errors);
        f.close().unwrap();
        r.close().unwrap();
    }
}

/// `inline_when_alone`: a FLUSH, and a small write the file system cannot
/// make with `RWF_NOWAIT` (ext4's buffered writes), on a connection that is
/// alone on its reactor run on the reactor thread (no hand-off to a worker
/// and back: a database commit's latency); with a second connection on the
/// reactor they go to a worker, so that no client waits behind another's
/// I/O; once the second leaves, inline again. Each sync is answered and the
/// bytes are in the file. `inline_when_alone = false`: never inline.
#[test]
fn a_sync_runs_on_the_reactor_only_while_its_connection_is_alone_there() {
    let dir = tempfile::tempdir().unwrap();
    let s = server(
        dir.path(),
        RdmaServerOptions {
            reactors: 1,
            ..no_auto()
        },
    );
    let c1 = client(&s, Completion::Interrupt);
    let f = c1
        .open("wal", &OpenOptions::read_write().create(true))
        .unwrap();
    // Whether this file system makes buffered writes with RWF_NOWAIT (then
    // they are inline whoever else is on the reactor).
    let nowait_writes = {
        use std::os::fd::AsRawFd;
        let p = std::fs::File::create(dir.path().join("probe")).unwrap();
        let b = [0u8; 4096];
        let iov = libc::iovec {
            iov_base: b.as_ptr() as *mut libc::c_void,
            iov_len: b.len(),
        };
        // SAFETY: one iovec over `b`, alive across the call; `p` is open.
        unsafe { libc::pwritev2(p.as_raw_fd(), &iov, 1, 0, libc::RWF_NOWAIT) == 4096 }
    };
    let mut want = Vec::new();
    // -> (inline syncs, inline I/Os) after a write and an fdatasync
    let commit = |round: u8, want: &mut Vec<u8>| {
        let page = vec![round; 8192];
        assert_eq!(f.write_at(&page, want.len() as u64).unwrap(), page.len());
        want.extend_from_slice(&page);
        f.sync_data().expect("fdatasync");
        assert_eq!(&std::fs::read(dir.path().join("wal")).unwrap(), want);
        let st = s.rdma.stats();
        (st.inline_syncs, st.inline_ios)
    };
    let (syncs, ios) = commit(1, &mut want);
    assert_eq!((syncs, ios), (1, 1), "alone on the reactor: inline");
    let c2 = client(&s, Completion::Interrupt);
    assert_eq!(s.rdma.stats().connections, 2);
    let (syncs, ios) = commit(2, &mut want);
    assert_eq!(syncs, 1, "two on the reactor: a worker's sync");
    assert_eq!(
        ios,
        if nowait_writes { 2 } else { 1 },
        "two on the reactor: a blocking write at a worker"
    );
    drop(c2);
    let t0 = Instant::now();
    while s.rdma.stats().connections != 1 {
        assert!(t0.elapsed() < Duration::from_secs(10), "c2 never left");
        std::thread::sleep(Duration::from_millis(5));
    }
    // (The reactor's count drops right after the table's, on its thread.)
    std::thread::sleep(Duration::from_millis(100));
    let (syncs, ios) = commit(3, &mut want);
    assert_eq!(syncs, 2, "alone again: inline");
    assert_eq!(ios, if nowait_writes { 3 } else { 2 });

    let dir2 = tempfile::tempdir().unwrap();
    let s2 = server(
        dir2.path(),
        RdmaServerOptions {
            reactors: 1,
            inline_when_alone: false,
            ..no_auto()
        },
    );
    let c = client(&s2, Completion::Interrupt);
    let g = c
        .open("wal", &OpenOptions::read_write().create(true))
        .unwrap();
    assert_eq!(g.write_at(b"page", 0).unwrap(), 4);
    g.sync_data().expect("fdatasync");
    assert_eq!(std::fs::read(dir2.path().join("wal")).unwrap(), b"page");
    assert_eq!(s2.rdma.stats().inline_syncs, 0, "inline_when_alone = false");
}
