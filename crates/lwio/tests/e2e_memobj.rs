//! Memory objects reachable by path (docs/memory-objects.md, seed 004), end
//! to end over loopback on the soft provider: a publisher's registered
//! buffer read and written by other clients as `ex/.lwio-mem/NAME`, served
//! by the server with RDMA Reads and Writes on the publisher's connection.

mod common;

use std::path::Path;
use std::time::Duration;

use lwio_client::{Client, ClientOptions, Completion, Error, MemRights, OpenOptions};
use lwio_proto::status::{STATUS_DISK_FULL, STATUS_FILE_DELETED};
use lwio_rdma::conformance::pattern;
use lwio_server::config::Limits;
use lwio_server::io_phase::driver::RdmaServerOptions;
use lwio_server::io_phase::testkit::LocalServer;

const TOKEN: &str = "e2e-memobj-token-0123456789";

fn server(dir: &Path) -> LocalServer {
    common::init_logging();
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
    Client::connect(
        &format!("lwio://{}/ex", s.side_addr),
        Some(TOKEN),
        opts.no_tls(),
    )
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
    let n = f.read_registered(&mut rb, 0..1 << 20, 5 << 20).unwrap();
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
    // Placed when A's library next reads its connection (at once when A
    // is idle; docs/memory-objects.md).
    wait_for(5, "the write in the publisher's memory", || {
        p.to_vec().unwrap() == expect
    });
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

/// Poll `cond` until it holds or `secs` pass (then fail with `what`).
fn wait_for(secs: u64, what: &str, mut cond: impl FnMut() -> bool) {
    let t0 = std::time::Instant::now();
    while !cond() {
        assert!(
            t0.elapsed() < Duration::from_secs(secs),
            "timed out waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The server never exposes its own memory, whatever the publishers do.
fn assert_server_unexposed(s: &LocalServer) {
    let st = s.rdma.stats();
    assert_eq!(st.mrs_remote_access, 0, "server MR with a remote right");
    assert_eq!(st.mws_allocated, 0, "server memory window");
}

#[test]
fn publisher_gone_mid_read_frees_everything_on_the_server() {
    let dir = tempfile::tempdir().unwrap();
    let s = server(dir.path());
    // Nothing registered before any client connects.
    assert_eq!(s.rdma.stats().registered_bytes, 0);
    let b = client(&s, Completion::Interrupt);
    const LEN: usize = 64 << 20;
    assert_eq!(s.state.mem_objects.len(), 0);
    assert_server_unexposed(&s);

    let a = client(&s, Completion::Interrupt);
    let want = pattern(19, LEN);
    let mut buf = a.register_buffer(LEN).unwrap();
    buf.copy_from_slice(&want);
    let p = a.publish("big", buf, MemRights::ReadOnly).unwrap();
    assert_eq!(s.state.mem_objects.len(), 1);
    assert!(s.rdma.stats().registered_bytes > 0);
    let f = b.open(".lwio-mem/big", &OpenOptions::read_only()).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let reader = std::thread::spawn(move || {
        let mut v = vec![0u8; LEN];
        let mut whole = 0usize;
        loop {
            // One 64 MiB read (split by the library into pieces).
            match f.read_at(&mut v, 0) {
                Ok(n) => {
                    assert_eq!(n, LEN);
                    assert!(v == want, "wrong bytes in a whole read");
                    whole += 1;
                    let _ = tx.send(whole);
                }
                Err(e) => return (whole, e, f),
            }
        }
    });
    // Disconnect the publisher while a large read is in flight: after one
    // whole read, the next one is under way.
    rx.recv_timeout(Duration::from_secs(60))
        .expect("a first 64 MiB read completes");
    assert_server_unexposed(&s);
    a.engine().shutdown();
    let t0 = std::time::Instant::now();
    let (whole, e, f) = reader.join().unwrap();
    assert!(t0.elapsed() < Duration::from_secs(30), "reader hung");
    assert!(whole >= 1);
    // The documented outcome for I/O on a withdrawn object.
    match &e {
        Error::Status { status, .. } => assert_eq!(*status, STATUS_FILE_DELETED, "{e}"),
        other => panic!("read after the publisher left: {other:?}"),
    }
    // Every later read says the same, never data.
    let mut v = [0u8; 4096];
    match f.read_at(&mut v, 0) {
        Err(Error::Status { status, .. }) => assert_eq!(status, STATUS_FILE_DELETED),
        other => panic!("read on the dead handle: {other:?}"),
    }
    // The withdrawal (on the publisher's connection thread) removes the
    // object from the server's registry: then the path is gone.
    wait_for(10, "the object withdrawn", || {
        s.state.mem_objects.is_empty()
    });
    assert!(matches!(
        b.side(|c| c.stat("ex", ".lwio-mem/big")),
        Err(Error::NotFound(_))
    ));
    assert!(matches!(
        b.open(".lwio-mem/big", &OpenOptions::read_only()),
        Err(Error::NotFound(_))
    ));
    assert_eq!(s.state.mem_objects.len(), 0);
    drop(f);
    drop(p);
    drop(a);
    // The publisher's connection closes on its thread.
    wait_for(20, "the publisher's RDMA connection closed", || {
        s.rdma.stats().connections == 1
    });
    assert_eq!(s.state.mem_objects.len(), 0);
    assert_server_unexposed(&s);
    // The reader's connection still works.
    std::fs::write(dir.path().join("after"), b"still here").unwrap();
    let g = b.open("after", &OpenOptions::read_only()).unwrap();
    assert_eq!(read_all(&g, 64), b"still here");
    drop(g);
    // When the reader leaves too, the server holds no registered memory at
    // all: nothing of the publisher's connection (bounce buffers, jobs) was
    // left behind. (While the reader is connected its own read buffers,
    // grown by the large reads, stay with its connection.)
    drop(b);
    wait_for(20, "registered bytes back to 0", || {
        let st = s.rdma.stats();
        st.connections == 0 && st.registered_bytes == 0
    });
    assert_eq!(s.state.mem_objects.len(), 0);
    assert_server_unexposed(&s);
}

/// Publish through the raw side channel, keeping the server's error code.
fn raw_publish(c: &Client, name: &str) -> Result<String, lwio_side::ErrorCode> {
    c.side(|s| Ok(s.publish("ex", name, 4096, 0x10000, 1, 1, [7; 16])))
        .expect("side channel")
        .map_err(|e| e.code)
}

#[test]
fn forged_paths_and_bad_names_are_refused() {
    use lwio_side::ErrorCode as C;
    let dir = tempfile::tempdir().unwrap();
    let s = server(dir.path());
    let a = client(&s, Completion::Interrupt);
    // Nothing published: a guessed path does not exist.
    assert!(matches!(
        a.open(".lwio-mem/NOPE", &OpenOptions::read_only()),
        Err(Error::NotFound(_))
    ));
    assert!(matches!(
        a.side(|c| c.stat("ex", ".lwio-mem/NOPE")),
        Err(Error::NotFound(_))
    ));
    // Out of the reserved directory by `..`: an ordinary (missing) file.
    assert!(matches!(
        a.open(".lwio-mem/../x", &OpenOptions::read_only()),
        Err(Error::NotFound(_))
    ));
    // Names the server refuses at Publish, before anything else.
    let long = "n".repeat(129);
    for (name, code) in [
        ("", C::NameTooLong),
        (long.as_str(), C::NameTooLong),
        (".", C::InvalidArgument),
        ("..", C::InvalidArgument),
        ("a/b", C::InvalidArgument),
        ("../x", C::InvalidArgument),
        ("a\0b", C::InvalidArgument),
        ("a\nb", C::InvalidArgument),
    ] {
        assert_eq!(raw_publish(&a, name), Err(code), "{name:?}");
    }
    // A good name with a channel key of no channel of this session.
    assert_eq!(raw_publish(&a, "ok"), Err(C::PermissionDenied));
    // The same through the library (which refuses "" and "/" itself).
    for name in ["", "a/b"] {
        let r = a
            .publish(name, a.register_buffer(4096).unwrap(), MemRights::ReadOnly)
            .map_err(Error::from);
        assert!(matches!(r, Err(Error::InvalidArgument(_))), "{name:?}");
    }
    for name in ["..", "a\0b"] {
        let r = a
            .publish(name, a.register_buffer(4096).unwrap(), MemRights::ReadOnly)
            .map_err(Error::from);
        assert!(matches!(r, Err(Error::InvalidArgument(_))), "{name:?}");
    }
    let r = a
        .publish(&long, a.register_buffer(4096).unwrap(), MemRights::ReadOnly)
        .map_err(Error::from);
    match r {
        Err(Error::Fs(e)) => assert!(e.message.contains("1..=128"), "{e}"),
        other => panic!("129-byte name: {:?}", other.map(|p| p.path().to_string())),
    }
    // 128 bytes is fine.
    let p = a
        .publish(
            &"n".repeat(128),
            a.register_buffer(4096).unwrap(),
            MemRights::ReadOnly,
        )
        .unwrap();
    assert_eq!(s.state.mem_objects.len(), 1);
    drop(p);
    assert_eq!(s.state.mem_objects.len(), 0);
    assert!(a
        .side(|c| c.list_dir("ex", ".lwio-mem"))
        .unwrap()
        .is_empty());
    assert_server_unexposed(&s);
}

#[test]
fn a_publisher_gets_16_objects_and_no_more() {
    let dir = tempfile::tempdir().unwrap();
    let s = server(dir.path());
    let a = client(&s, Completion::Interrupt);
    let mut held = Vec::new();
    let mut refused = 0;
    let t0 = std::time::Instant::now();
    for i in 0..10_000 {
        let r = a.publish(
            &format!("o{i}"),
            a.register_buffer(4096).unwrap(),
            MemRights::ReadOnly,
        );
        match r {
            Ok(p) => {
                assert!(i < 16, "object {i} published");
                held.push(p);
            }
            Err(lwio_client::PublishError {
                error: Error::Side(m),
                buf,
            }) => {
                assert!(i >= 16, "object {i} refused: {m}");
                assert!(m.contains("too many memory objects"), "{m}");
                // The refused buffer comes back, the caller's to use.
                assert_eq!(buf.len(), 4096);
                refused += 1;
            }
            Err(e) => panic!("object {i}: {e:?}"),
        }
    }
    assert_eq!((held.len(), refused), (16, 10_000 - 16));
    assert!(t0.elapsed() < Duration::from_secs(120));
    assert_eq!(s.state.mem_objects.len(), 16);
    assert_eq!(a.side(|c| c.list_dir("ex", ".lwio-mem")).unwrap().len(), 16);
    // The refused names do not exist.
    assert!(matches!(
        a.side(|c| c.stat("ex", ".lwio-mem/o16")),
        Err(Error::NotFound(_))
    ));
    // One withdrawn: exactly one more fits.
    held.remove(3).unpublish().unwrap();
    assert_eq!(s.state.mem_objects.len(), 15);
    held.push(
        a.publish(
            "again",
            a.register_buffer(4096).unwrap(),
            MemRights::ReadOnly,
        )
        .unwrap(),
    );
    assert!(matches!(
        a.publish(
            "more",
            a.register_buffer(4096).unwrap(),
            MemRights::ReadOnly
        )
        .map_err(Error::from),
        Err(Error::Side(_))
    ));
    assert_eq!(s.state.mem_objects.len(), 16);
    // The limit is per session: another publisher still can.
    let b = client(&s, Completion::Interrupt);
    let q = b
        .publish("b0", b.register_buffer(4096).unwrap(), MemRights::ReadOnly)
        .unwrap();
    assert_eq!(s.state.mem_objects.len(), 17);
    drop(q);
    drop(held);
    assert_eq!(s.state.mem_objects.len(), 0);
    assert_server_unexposed(&s);
}

#[test]
fn reads_after_unpublish_are_refused_not_served() {
    let dir = tempfile::tempdir().unwrap();
    let s = server(dir.path());
    let a = client(&s, Completion::Interrupt);
    let want = pattern(23, 1 << 20);
    let mut buf = a.register_buffer(want.len()).unwrap();
    buf.copy_from_slice(&want);
    let p = a.publish("w", buf, MemRights::ReadWrite).unwrap();
    let b = client(&s, Completion::Poll);
    let f = b.open(".lwio-mem/w", &OpenOptions::read_write()).unwrap();
    assert!(read_all(&f, want.len()) == want);
    let back = p.unpublish().unwrap();
    assert!(back[..] == want[..], "memory changed");
    let t0 = std::time::Instant::now();
    let mut v = vec![0u8; 256 << 10];
    for i in 0..200u64 {
        v.fill(0);
        match f.read_at(&mut v, (i * 4096) % (1 << 20)) {
            Err(Error::Status { status, .. }) => assert_eq!(status, STATUS_FILE_DELETED),
            other => panic!("read {i} after unpublish: {other:?}"),
        }
        assert!(v.iter().all(|&x| x == 0), "read {i} delivered data");
    }
    match f.write_at(&[1; 512], 0) {
        Err(Error::Status { status, .. }) => assert_eq!(status, STATUS_FILE_DELETED),
        other => panic!("write after unpublish: {other:?}"),
    }
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
    assert!(back[..] == want[..], "a late write reached the memory");
    assert!(matches!(
        b.open(".lwio-mem/w", &OpenOptions::read_only()),
        Err(Error::NotFound(_))
    ));
    assert_server_unexposed(&s);
}

/// What the publisher is told is in its memory: the writes that
/// [`Published::wait_writes`] counts, and every write finished before
/// [`Published::unpublish`], are in the memory it reads at once, even when
/// its own threads were not reading its connection (the server answers a
/// write once its RDMA Write is sent, and on iWARP the publisher places it
/// when it next reads its connection). Before each write the publisher does
/// I/O of its own, so that its progress thread naps rather than waiting on
/// the socket. Without the ordering barrier after the count and before the
/// deregistration, the memory lacked the write: the CI failure of
/// `cli_data::publish_serves_memory_to_cat_and_cp`, whose `--out` file
/// missed the last writes.
#[test]
fn what_the_publisher_is_told_is_in_its_memory() {
    let dir = tempfile::tempdir().unwrap();
    let s = server(dir.path());
    std::fs::write(dir.path().join("own.bin"), vec![7u8; 4096]).unwrap();
    for completion in [Completion::Poll, Completion::Interrupt] {
        let a = client(&s, completion);
        const LEN: usize = 1 << 20;
        let mut want = pattern(23, LEN);
        let own = a.open("own.bin", &OpenOptions::read_only()).unwrap();
        let b = client(&s, Completion::Interrupt);
        let own_io = || {
            let mut x = [0u8; 4096];
            for _ in 0..20 {
                assert_eq!(own.read_at(&mut x, 0).unwrap(), 4096);
            }
        };
        for round in 0..10u32 {
            let mut buf = a.register_buffer(LEN).unwrap();
            buf.copy_from_slice(&want);
            let p = a.publish("told", buf, MemRights::ReadWrite).unwrap();
            let w = b
                .open(".lwio-mem/told", &OpenOptions::read_write())
                .unwrap();
            let mut seen = 0;
            for k in 0..5u32 {
                own_io();
                let at = ((round * 5 + k) as usize * 40_961) % (LEN - 8192);
                let patch = pattern(100 + u64::from(round * 5 + k), 8192);
                assert_eq!(w.write_at(&patch, at as u64).unwrap(), 8192);
                want[at..at + 8192].copy_from_slice(&patch);
                seen = p.wait_writes(seen, Duration::from_secs(10)).unwrap();
                let mut got = vec![0u8; 8192];
                p.read_at(at, &mut got).unwrap();
                assert!(
                    got == patch,
                    "{completion:?} round {round}.{k}: wait_writes said {seen} writes, \
                     but the memory at {at} lacks the last"
                );
            }
            // A last write, then unpublish at once: the buffer given back
            // holds it.
            own_io();
            let at = (round as usize * 77_777) % (LEN - 65536);
            let patch = pattern(900 + u64::from(round), 65536);
            assert_eq!(w.write_at(&patch, at as u64).unwrap(), 65536);
            want[at..at + 65536].copy_from_slice(&patch);
            drop(w);
            let back = p.unpublish().unwrap();
            assert!(
                back[..] == want[..],
                "{completion:?} round {round}: the buffer given back lacks a write finished \
                 before unpublish"
            );
        }
    }
}

/// A write through the server is in the publisher's memory when the
/// writer's call returns, even while the publisher's own threads are not
/// reading its socket: the server follows its RDMA Write with a one-byte
/// RDMA Read of the same key and answers the writer on the Read's
/// completion (on iWARP a Write's completion means only that it was sent;
/// the publisher's soft provider places it when one of its threads next
/// reads the socket). Before each write the publisher does I/O of its own,
/// so that its progress thread naps (callers drive) rather than waiting
/// on the socket; without the Read the publisher's memory lacked the write
/// (capi-tests' `publish (poll)` failed so in CI once).
#[test]
fn a_write_is_in_the_publishers_memory_when_the_writer_returns() {
    let dir = tempfile::tempdir().unwrap();
    let s = server(dir.path());
    for completion in [Completion::Poll, Completion::Interrupt] {
        let a = client(&s, completion);
        const LEN: usize = 1 << 20;
        let mut want = pattern(23, LEN);
        let mut buf = a.register_buffer(LEN).unwrap();
        buf.copy_from_slice(&want);
        let p = a.publish("visible", buf, MemRights::ReadWrite).unwrap();
        std::fs::write(dir.path().join("own.bin"), vec![7u8; 4096]).unwrap();
        let own = a.open("own.bin", &OpenOptions::read_only()).unwrap();
        let b = client(&s, Completion::Interrupt);
        let w = b
            .open(".lwio-mem/visible", &OpenOptions::read_write())
            .unwrap();
        for round in 0..20u32 {
            let mut x = [0u8; 4096];
            for _ in 0..20 {
                assert_eq!(own.read_at(&mut x, 0).unwrap(), 4096);
            }
            let at = (round as usize * 40_961) % (LEN - 8192);
            let patch = pattern(100 + u64::from(round), 8192);
            assert_eq!(w.write_at(&patch, at as u64).unwrap(), 8192);
            want[at..at + 8192].copy_from_slice(&patch);
            let mut got = vec![0u8; 8192];
            p.read_at(at, &mut got).unwrap();
            assert!(
                got == patch,
                "{completion:?} round {round}: the publisher's memory at {at} lacks the write \
                 that returned"
            );
        }
        assert!(
            p.to_vec().unwrap() == want,
            "{completion:?}: the whole object"
        );
        drop(w);
        p.unpublish().unwrap();
    }
}
