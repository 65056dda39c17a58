//! Memory objects reachable by path (docs/memory-objects.md, seed 004), end
//! to end over loopback on the soft provider: a publisher's registered
//! buffer read and written by other clients as `ex/.lwio-mem/NAME`, served
//! by the server with RDMA Reads and Writes on the publisher's connection.

use std::path::Path;
use std::time::Duration;

use lwio_client::{Client, ClientOptions, Completion, Error, MemRights, OpenOptions};
use lwio_proto::status::{STATUS_DISK_FULL, STATUS_FILE_DELETED};
use lwio_rdma::conformance::pattern;
use lwio_server::config::Limits;
use lwio_server::io_phase::server::RdmaServerOptions;
use lwio_server::io_phase::testkit::LocalServer;

const TOKEN: &str = "e2e-memobj-token-0123456789";

fn server(dir: &Path) -> LocalServer {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into()))
        .with_test_writer()
        .try_init();
    LocalServer::start(
        dir,
        "ex",
        TOKEN,
        Limits::default(),
        RdmaServerOptions::default(),
    )
    .expect("server starts")
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

/// Read all of `f` from 0 (chunked as the library splits it).
fn read_all(f: &lwio_client::File, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    let mut n = 0;
    while n < len {
        match f.read_at(&mut v[n..], n as u64).expect("read") {
            0 => break,
            k => n += k,
        }
    }
    v.truncate(n);
    v
}

fn publish_read_write(completion: Completion) {
    let dir = tempfile::tempdir().unwrap();
    let s = server(dir.path());
    let a = client(&s, completion);
    const LEN: usize = 64 << 20;
    let want = pattern(19, LEN);
    let mut buf = a.register_buffer(LEN).unwrap();
    buf.copy_from_slice(&want);
    let p = a.publish("weights", buf, MemRights::ReadWrite).unwrap();
    assert_eq!(p.path(), "ex/.lwio-mem/weights");
    assert_eq!(p.len(), LEN);

    // B sees it with stat and ls, at its size.
    let b = client(&s, completion);
    let st = b.side(|c| c.stat("ex", ".lwio-mem/weights")).unwrap();
    assert_eq!(st.size, LEN as u64);
    let ls = b.side(|c| c.list_dir("ex", ".lwio-mem")).unwrap();
    assert_eq!(ls.len(), 1);
    assert_eq!(ls[0].name, "weights");
    assert_eq!(ls[0].attr.size, LEN as u64);

    // B reads it byte for byte.
    let f = b
        .open(".lwio-mem/weights", &OpenOptions::read_only())
        .unwrap();
    assert_eq!(f.len().unwrap(), LEN as u64);
    let got = read_all(&f, LEN + 4096);
    assert_eq!(got.len(), LEN, "a read past the end is short");
    assert!(got == want, "bytes differ");
    // Into registered memory too (the reader's direct path).
    let mut rb = b.register_buffer(1 << 20).unwrap();
    let n = f.read_at(&mut rb[..], 5 << 20).unwrap();
    assert_eq!(n, 1 << 20);
    assert!(rb[..] == want[5 << 20..6 << 20]);
    // At and past the end: end of file.
    let mut small = [0u8; 100];
    assert_eq!(f.read_at(&mut small, LEN as u64 - 10).unwrap(), 10);
    assert_eq!(&small[..10], &want[LEN - 10..]);
    assert_eq!(f.read_at(&mut small, LEN as u64).unwrap(), 0);

    // C writes a range; A sees it in its buffer.
    let c = client(&s, completion);
    let w = c
        .open(".lwio-mem/weights", &OpenOptions::read_write())
        .unwrap();
    let patch = pattern(7, 3 << 20);
    w.write_at(&patch, 1_000_001).unwrap();
    let mut expect = want.clone();
    expect[1_000_001..1_000_001 + patch.len()].copy_from_slice(&patch);
    assert!(
        p.to_vec().unwrap() == expect,
        "publisher's memory after the write"
    );
    // The publisher is told: one write (of 3 MiB: one or more requests).
    let n = p.wait_writes(0, Duration::from_secs(10)).unwrap();
    assert!(n >= 1, "writes seen: {n}");
    // Nothing new: the wait ends by its timeout with the same count.
    let t0 = std::time::Instant::now();
    assert_eq!(p.wait_writes(n, Duration::from_millis(300)).unwrap(), n);
    assert!(t0.elapsed() >= Duration::from_millis(250));
    // A waiter is woken by the next write.
    let waiter = std::thread::scope(|sc| {
        let h = sc.spawn(|| p.wait_writes(n, Duration::from_secs(10)).unwrap());
        std::thread::sleep(Duration::from_millis(100));
        w.write_at(&patch[..100], 1_000_001).unwrap();
        h.join().unwrap()
    });
    assert!(waiter > n);
    // B reads the new bytes through the server.
    assert!(read_all(&f, LEN) == expect);
    // A write that would pass the end: DISK_FULL, and nothing written.
    match w.write_at(&[0xee; 100], LEN as u64 - 50) {
        Err(Error::Status { status, .. }) => assert_eq!(status, STATUS_DISK_FULL),
        other => panic!("write past the end: {other:?}"),
    }
    assert!(
        p.to_vec().unwrap() == expect,
        "a refused write changed memory"
    );

    // A changes its buffer locally; readers see it.
    p.write_at(0, b"hello").unwrap();
    let mut h = [0u8; 5];
    assert_eq!(f.read_at(&mut h, 0).unwrap(), 5);
    assert_eq!(&h, b"hello");

    // Unpublish: the path is gone, open handles fail clearly.
    let back = p.unpublish().unwrap();
    assert_eq!(&back[..5], b"hello");
    assert!(matches!(
        b.side(|c| c.stat("ex", ".lwio-mem/weights")),
        Err(Error::NotFound(_))
    ));
    assert!(matches!(
        b.open(".lwio-mem/weights", &OpenOptions::read_only()),
        Err(Error::NotFound(_))
    ));
    match f.read_at(&mut small, 0) {
        Err(Error::Status { status, .. }) => assert_eq!(status, STATUS_FILE_DELETED),
        other => panic!("read of a withdrawn object: {other:?}"),
    }
    match w.write_at(&[1], 0) {
        Err(Error::Status { status, .. }) => assert_eq!(status, STATUS_FILE_DELETED),
        other => panic!("write to a withdrawn object: {other:?}"),
    }
    assert!(b
        .side(|c| c.list_dir("ex", ".lwio-mem"))
        .unwrap()
        .is_empty());
    // The publisher's channel is intact: it publishes again and serves.
    let p2 = a.publish("again", back, MemRights::ReadOnly).unwrap();
    let f2 = b
        .open(".lwio-mem/again", &OpenOptions::read_only())
        .unwrap();
    assert_eq!(f2.read_at(&mut h, 0).unwrap(), 5);
    assert_eq!(&h, b"hello");
    drop(p2);
}

#[test]
fn publish_read_write_interrupt_mode() {
    publish_read_write(Completion::Interrupt);
}

#[test]
fn publish_read_write_poll_mode() {
    publish_read_write(Completion::Poll);
}

#[test]
fn read_only_grant_refuses_writers_and_keeps_memory() {
    let dir = tempfile::tempdir().unwrap();
    let s = server(dir.path());
    let a = client(&s, Completion::Interrupt);
    let want = pattern(3, 1 << 20);
    let mut buf = a.register_buffer(want.len()).unwrap();
    buf.copy_from_slice(&want);
    let p = a.publish("ro", buf, MemRights::ReadOnly).unwrap();
    let b = client(&s, Completion::Interrupt);
    // Opening for writing is refused (EACCES), reading is not.
    assert!(matches!(
        b.open(".lwio-mem/ro", &OpenOptions::read_write()),
        Err(Error::AccessDenied(_))
    ));
    let f = b.open(".lwio-mem/ro", &OpenOptions::read_only()).unwrap();
    assert!(read_all(&f, want.len()) == want);
    // A file opened read-only cannot write either (ACCESS_DENIED on the
    // data path).
    assert!(matches!(
        f.write_at(&[0; 16], 0),
        Err(Error::AccessDenied(_))
    ));
    // Nothing in the reserved directory changes but by publishing.
    for r in [
        b.side(|c| c.remove("ex", ".lwio-mem/ro")),
        b.side(|c| c.mkdir("ex", ".lwio-mem/d", 0o755, false)),
        b.side(|c| c.rename("ex", ".lwio-mem/ro", "x", false)),
    ] {
        assert!(matches!(r, Err(Error::AccessDenied(_))), "{r:?}");
    }
    assert!(matches!(
        b.open(".lwio-mem/new", &OpenOptions::read_write().create(true)),
        Err(Error::NotFound(_))
    ));
    assert!(p.to_vec().unwrap() == want, "memory changed");
    // Another session cannot unpublish it.
    assert!(b.side(|c| c.unpublish("ex", "ro")).is_err());
    assert!(b.side(|c| c.stat("ex", ".lwio-mem/ro")).is_ok());
}

#[test]
fn publisher_disconnect_removes_the_path_and_fails_readers() {
    let dir = tempfile::tempdir().unwrap();
    let s = server(dir.path());
    let a = client(&s, Completion::Interrupt);
    let mut buf = a.register_buffer(1 << 20).unwrap();
    buf.fill(0x5a);
    let p = a.publish("gone", buf, MemRights::ReadOnly).unwrap();
    let b = client(&s, Completion::Interrupt);
    let f = b.open(".lwio-mem/gone", &OpenOptions::read_only()).unwrap();
    let mut v = [0u8; 64];
    assert_eq!(f.read_at(&mut v, 0).unwrap(), 64);
    assert_eq!(v, [0x5a; 64]);
    // The publisher's RDMA channel goes away without unpublishing (as when
    // its process dies): the server withdraws the object by itself.
    a.engine().shutdown();
    let t0 = std::time::Instant::now();
    loop {
        match b.side(|c| c.stat("ex", ".lwio-mem/gone")) {
            Err(Error::NotFound(_)) => break,
            Ok(_) if t0.elapsed() < Duration::from_secs(10) => {
                std::thread::sleep(Duration::from_millis(20))
            }
            other => panic!("stat after the publisher left: {other:?}"),
        }
    }
    assert!(matches!(
        b.open(".lwio-mem/gone", &OpenOptions::read_only()),
        Err(Error::NotFound(_))
    ));
    match f.read_at(&mut v, 0) {
        Err(Error::Status { status, .. }) => assert_eq!(status, STATUS_FILE_DELETED),
        other => panic!("read after the publisher left: {other:?}"),
    }
    // Dropping the publication now is harmless (the object is gone).
    drop(p);
    // Ending the side session withdraws too: a second publisher's session
    // ends with its client.
    let a2 = client(&s, Completion::Interrupt);
    let p2 = a2
        .publish("s", a2.register_buffer(4096).unwrap(), MemRights::ReadOnly)
        .unwrap();
    assert!(b.side(|c| c.stat("ex", ".lwio-mem/s")).is_ok());
    drop(p2); // unpublishes
    assert!(matches!(
        b.side(|c| c.stat("ex", ".lwio-mem/s")),
        Err(Error::NotFound(_))
    ));
}

#[test]
fn reads_racing_unpublish_end_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let s = server(dir.path());
    let a = client(&s, Completion::Interrupt);
    const LEN: usize = 8 << 20;
    let want = pattern(11, LEN);
    let mut buf = a.register_buffer(LEN).unwrap();
    buf.copy_from_slice(&want);
    let p = a.publish("race", buf, MemRights::ReadOnly).unwrap();
    let b = client(&s, Completion::Interrupt);
    let f = b.open(".lwio-mem/race", &OpenOptions::read_only()).unwrap();
    let reader = std::thread::spawn(move || {
        let mut v = vec![0u8; 1 << 20];
        let mut ok = 0;
        loop {
            let off = (ok % 8) << 20;
            match f.read_at(&mut v, off as u64) {
                Ok(n) => {
                    assert_eq!(n, 1 << 20);
                    assert!(v == want[off..off + (1 << 20)]);
                    ok += 1;
                }
                Err(Error::Status { status, .. }) if status == STATUS_FILE_DELETED => return ok,
                Err(e) => panic!("read: {e}"),
            }
        }
    });
    std::thread::sleep(Duration::from_millis(300));
    let back = p.unpublish().unwrap();
    let ok = reader.join().unwrap();
    assert!(ok > 0);
    // The publisher's channel survived the race: publish and read again.
    let p = a.publish("race2", back, MemRights::ReadOnly).unwrap();
    let f = b
        .open(".lwio-mem/race2", &OpenOptions::read_only())
        .unwrap();
    let mut v = [0u8; 16];
    assert_eq!(f.read_at(&mut v, 0).unwrap(), 16);
    drop(p);
}
