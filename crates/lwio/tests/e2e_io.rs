//! End to end over loopback on the soft provider: a real server (side
//! channel + RDMA listener, temp export) and a real client, every opcode in
//! both completion modes, byte-exact file contents, credits, the async API.

use std::io::{IoSlice, IoSliceMut};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::time::Duration;

use lwio::client::{AsyncClient, Client, ClientOptions, Completion, Error, OpenOptions};
use lwio::config::Limits;
use lwio::data::server::RdmaServerOptions;
use lwio::data::testkit::LocalServer;

const TOKEN: &str = "e2e-test-token-0123456789";

fn server(dir: &Path, rdma: RdmaServerOptions) -> LocalServer {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into()))
        .with_test_writer()
        .try_init();
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
        ..ClientOptions::default()
    };
    Client::connect(&format!("lwio://{}/ex", s.side_addr), Some(TOKEN), opts)
        .expect("client connects")
}

fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
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
    let data = pattern(300_007, 1);
    assert_eq!(f.write_at(&data, 3).unwrap(), data.len());
    assert_eq!(local_read(&path, 3, data.len()), data);
    for (off, len) in [
        (0u64, 1usize),
        (1, 511),
        (4095, 4097),
        (77_777, 12_345),
        (8191, 8193),
    ] {
        let d = pattern(len, off + 7);
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
    let d = pattern(20_011, 9);
    assert_eq!(f.write_at(&d, far).unwrap(), d.len());
    let mut back = vec![0u8; 20_011 + 30];
    assert_eq!(f.read_at(&mut back, far - 30).unwrap(), back.len());
    assert_eq!(&back[..30], &[0u8; 30]);
    assert_eq!(&back[30..], &d[..]);
    assert_eq!(local_read(&path, far, d.len()), d);

    // Offsets that overflow are refused locally.
    assert!(matches!(
        f.read_at(&mut buf, u64::MAX - 5),
        Err(Error::InvalidArgument(_))
    ));

    // VEC_WRITE (gathered) and VEC_READ (scattered, one window per page).
    let a = pattern(5000, 21);
    let b = pattern(11_000, 22);
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
    let slot = if completion == Completion::Poll {
        e.last_slot()
    } else {
        None
    };
    let (_, st) = e.wait(r, slot).unwrap();
    assert_eq!(st, lwio_proto::status::STATUS_INVALID_HANDLE);

    // Windows: every one bound was invalidated after its request.
    let stats = c.stats();
    assert_eq!(stats.windows_bound, stats.windows_invalidated, "{stats:?}");
    assert_eq!(stats.credit_violations, 0);
    match completion {
        Completion::Poll => assert!(stats.polled_completions > 0, "{stats:?}"),
        Completion::Interrupt => assert_eq!(stats.polled_completions, 0, "{stats:?}"),
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

#[test]
fn io_poll_mode() {
    io_suite(Completion::Poll);
}

fn control_suite(completion: Completion) {
    let dir = tempfile::tempdir().unwrap();
    let s = server(dir.path(), no_auto());
    let c = client(&s, completion);
    let path = dir.path().join("ctl.bin");
    let data = pattern(1 << 20, 5);
    std::fs::write(&path, &data).unwrap();
    let f = c.open("ctl.bin", &OpenOptions::read_write()).unwrap();

    // CANCEL: completes at once with SUCCESS; the file stays usable.
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
    assert_eq!(st.credit_violations, 0, "{st:?}");
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
        let c = AsyncClient::connect(&format!("lwio://{}/ex", s.side_addr), Some(TOKEN), opts)
            .await
            .unwrap();
        let f = c
            .open("async.bin", &OpenOptions::read_write().create(true))
            .await
            .unwrap();
        let data = pattern(777_777, 3);
        assert_eq!(f.write_at(&data, 11).await.unwrap(), data.len());
        assert_eq!(f.len().await.unwrap(), 11 + data.len() as u64);
        let mut b = vec![0u8; data.len()];
        assert_eq!(f.read_at(&mut b, 11).await.unwrap(), data.len());
        assert_eq!(b, data);
        // A dropped future: CANCEL is issued, our buffer is never written.
        let mut keep = vec![0xEEu8; 700_000];
        let mut dropped = false;
        for _ in 0..20 {
            let r = tokio::time::timeout(Duration::ZERO, f.read_at(&mut keep, 0)).await;
            if r.is_err() {
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
        assert_eq!(c.stats().credit_violations, 0);
    });
}
