//! End to end over loopback on the soft provider: a real server (side
//! channel + RDMA listener, temp export) and a real client, every opcode in
//! both completion modes, byte-exact file contents, credits, the async API.

use std::io::{IoSlice, IoSliceMut};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::time::Duration;

use lwio::client::{Client, ClientOptions, Completion, Error, OpenOptions};
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
