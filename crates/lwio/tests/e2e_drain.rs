//! The server's half of the ordering rule (docs/reconnect.md): a WRITE of
//! a lost RDMA connection that is still running at a storage thread is
//! applied before the file can be registered on the client's next
//! connection, so it cannot land over a newer write. The server runs with
//! `inline_io = false` (every write goes to the storage threads) and its
//! first write is slow (3 s, not stoppable once started: a test hook); the
//! RDMA socket is cut (`ss -K`, in a private network namespace) while that
//! write runs; the client reconnects, re-sends it and then writes newer
//! bytes to the same range: the file must end with the newer bytes, and the
//! `Rekey` must have waited for the lost connection's write.

use std::time::{Duration, Instant};

use lwio_client::{ClientOptions, OpenOptions};
use lwio_server::io_phase::driver::{
    slow_next_storage_write_for_tests, slow_storage_write_started_for_tests,
};

mod common;
use common::reconnect::{cut, in_netns};

const TOKEN: &str = "e2e-drain-token-0123456789";
const LEN: usize = 64 * 1024;
const SLOW: Duration = Duration::from_secs(3);

#[test]
fn stale_write_of_a_lost_connection_never_lands_after_a_newer_one() {
    const NAME: &str = "stale_write_of_a_lost_connection_never_lands_after_a_newer_one";
    if !in_netns(NAME) {
        return;
    }
    common::init_logging();
    let dir = tempfile::tempdir().unwrap();
    // The re-sent and the newer write must not queue behind the slow one
    // at the storage: only the hold may order them.
    let s = common::storage_thread_server(dir.path(), TOKEN);
    let c = common::soft_client(
        &s,
        TOKEN,
        ClientOptions {
            op_timeout: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(5),
            ..ClientOptions::default()
        },
    );
    let f = c
        .open("f", &OpenOptions::read_write().create(true))
        .unwrap();
    let (old, new) = (vec![0xAAu8; LEN], vec![0x55u8; LEN]);

    slow_next_storage_write_for_tests(SLOW);
    let t0 = Instant::now();
    let writer = std::thread::spawn(move || {
        let r = f.write_at(&old, 0);
        (f, r, t0.elapsed())
    });
    // The old write runs at a storage thread (it sleeps there for SLOW).
    let running = Instant::now();
    while !slow_storage_write_started_for_tests() {
        assert!(
            running.elapsed() < Duration::from_secs(10),
            "the write never reached the storage threads"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::sleep(Duration::from_millis(200));
    let port = s.rdma_addr.port();
    cut(&port.to_string(), None);
    let cut = t0.elapsed();
    // The call re-sends the old bytes after the reconnect and returns.
    let (f, r, returned) = writer.join().unwrap();
    assert_eq!(r.unwrap(), LEN);
    assert!(c.reconnects() >= 1, "a reconnect was counted");
    // A newer write to the same range, issued after the old call returned.
    assert_eq!(f.write_at(&new, 0).unwrap(), LEN);
    // Give a stale write every chance to land late.
    let settle = SLOW.saturating_sub(t0.elapsed()) + Duration::from_millis(500);
    std::thread::sleep(settle);
    let disk = std::fs::read(dir.path().join("f")).unwrap();
    assert_eq!(disk.len(), LEN);
    let stale = disk.iter().filter(|&&b| b == 0xAA).count();
    assert!(
        disk == new,
        "{stale} bytes of the lost connection's write landed over the newer one"
    );
    let mut back = vec![0u8; LEN];
    assert_eq!(f.read_at(&mut back, 0).unwrap(), LEN);
    assert!(back == new, "read back differs");
    let (waits, busy) = s.state.open_files.rekey_waits();
    eprintln!(
        "cut at {cut:?}; old write call returned at {returned:?} (slow write {SLOW:?}); \
         {} reconnects; rekey waits {waits}, busy {busy}",
        c.reconnects()
    );
    assert!(waits >= 1, "the Rekey did not wait for the running write");
    assert_eq!(busy, 0);
    assert!(
        returned >= SLOW,
        "the old call returned at {returned:?}, before the lost write ended ({SLOW:?})"
    );
    f.close().unwrap();
}
