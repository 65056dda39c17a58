//! Unstable writes (docs/protocol.md §5.13, "Ordering"): a WRITE sent with
//! `File::start_write` and not waited for, then a FLUSH on the same
//! connection. The server's write is slow (a test hook, at a storage
//! thread: `inline_io = false`); the FLUSH must not sync before the write
//! has reached storage, so `sync_data` returns only after the write, whose
//! answer has then come, and the bytes are in the file. (Its own binary:
//! the hook is global to the process.)

use std::time::{Duration, Instant};

use lwio_client::{ClientOptions, OpenOptions};
use lwio_server::io_phase::driver::{
    slow_next_storage_write_for_tests, slow_storage_write_started_for_tests,
};

mod common;

const TOKEN: &str = "e2e-unstable-token-0123456789";
const SLOW: Duration = Duration::from_millis(600);

#[test]
fn a_flush_sent_behind_an_unanswered_write_syncs_after_it() {
    common::init_logging();
    let dir = tempfile::tempdir().unwrap();
    let s = common::storage_thread_server(dir.path(), TOKEN);
    // (The FLUSH could run beside the slow write at another storage
    // thread: only the ordering may hold it.)
    let c = common::soft_client(&s, TOKEN, ClientOptions::default());
    let f = c
        .open("wal", &OpenOptions::read_write().create(true))
        .unwrap();
    let g = c.open("wal", &OpenOptions::read_write()).unwrap();
    let data: Vec<u8> = (0..8192u32).map(|i| (i * 7 + 3) as u8).collect();

    slow_next_storage_write_for_tests(SLOW);
    let t0 = Instant::now();
    let mut pw = f
        .start_write(&data, 4096)
        .expect("sent")
        .expect("fits one request");
    assert!(
        t0.elapsed() < SLOW / 2,
        "start_write waited for the write: {:?}",
        t0.elapsed()
    );
    while !slow_storage_write_started_for_tests() {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "write never started"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    assert!(pw.poll().is_none(), "answered while at storage");
    // The other open of the file, on the same connection, syncs: its
    // FLUSH covers the write (another Fid of one file).
    assert!(pw.covered_by_sync_of(&g));
    g.sync_data().expect("fdatasync");
    let synced = t0.elapsed();
    assert!(
        synced >= SLOW - Duration::from_millis(50),
        "the FLUSH was answered at {synced:?}, before the write it follows ended ({SLOW:?})"
    );
    assert!(
        matches!(pw.poll(), Some(Ok(8192))),
        "the write's answer had not come when its FLUSH's did"
    );
    assert_eq!(pw.wait().unwrap(), 8192);
    let disk = std::fs::read(dir.path().join("wal")).unwrap();
    assert_eq!(disk.len(), 4096 + 8192);
    assert!(disk[4096..] == data[..], "the bytes differ on disk");

    // Too large for one request: the caller writes it the usual way.
    let big = vec![1u8; 64 << 20];
    assert!(f.start_write(&big, 0).unwrap().is_none());
    // An error comes with the answer: a write past the largest file
    // (EFBIG on the server) is sent, and fails when waited for.
    let pw = f.start_write(&data, 1 << 60).unwrap().unwrap();
    assert!(
        pw.wait().is_err(),
        "a write past the largest file succeeded"
    );
    f.close().unwrap();
    g.close().unwrap();
}
