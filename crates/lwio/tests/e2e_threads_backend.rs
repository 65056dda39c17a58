//! A host without io_uring (issue 13: "one fallback pool for backends
//! without io_uring, not a pool on top of a pool"): with `[io] backend =
//! "threads"`, the RDMA phase's storage threads (`lwio-rdma-io-*`) do the
//! file I/O themselves; the backend's own thread pool (`lwio-io-*`) moves
//! none of its bytes. Its own process: it counts this process's threads'
//! I/O (`/proc/self/task/*/io`).

use std::time::Duration;

use lwio_client::{Client, ClientOptions, Completion, OpenOptions};
use lwio_rdma::conformance::pattern;
use lwio_server::config::{IoConfig, Limits};
use lwio_server::fs::backend::BackendChoice;
use lwio_server::io_phase::driver::RdmaServerOptions;
use lwio_server::io_phase::testkit::LocalServer;

const TOKEN: &str = "e2e-threads-backend-token-0123";

/// Bytes read and written through syscalls by this process's threads whose
/// name starts with `prefix` (`rchar`, `wchar`).
fn io_of(prefix: &str) -> (u64, u64, usize) {
    let mut t = (0, 0, 0);
    for task in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
        let Ok(name) = std::fs::read_to_string(task.path().join("comm")) else {
            continue;
        };
        if !name.trim().starts_with(prefix) {
            continue;
        }
        let Ok(io) = std::fs::read_to_string(task.path().join("io")) else {
            continue;
        };
        let field = |k: &str| -> u64 {
            io.lines()
                .find_map(|l| l.strip_prefix(k))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0)
        };
        t.0 += field("rchar:");
        t.1 += field("wchar:");
        t.2 += 1;
    }
    t
}

#[test]
fn without_io_uring_the_storage_threads_do_the_file_io() {
    let dir = tempfile::tempdir().unwrap();
    let rdma = RdmaServerOptions {
        // Every I/O to the storage threads (no page-cache fast path).
        inline_io: false,
        storage_threads: 2,
        ..RdmaServerOptions::default()
    };
    let io = IoConfig {
        backend: BackendChoice::Threads,
        workers: 2,
    };
    let s = LocalServer::start_with_io(dir.path(), "ex", TOKEN, Limits::default(), rdma, io)
        .expect("server starts");
    let opts = ClientOptions {
        completion: Completion::Interrupt,
        op_timeout: Duration::from_secs(20),
        ..ClientOptions::default()
    };
    let c = Client::connect(
        &format!("lwio://{}/ex", s.side_addr),
        Some(TOKEN),
        opts.no_tls(),
    )
    .unwrap();
    let f = c
        .open("t", &OpenOptions::read_write().create(true))
        .unwrap();
    let (_, _, pool_threads) = io_of("lwio-io-");
    assert_eq!(pool_threads, 2, "the backend's thread pool is there");
    let (r0, w0, storage) = io_of("lwio-rdma-io");
    assert_eq!(storage, 2, "two storage threads");
    let (pr0, pw0, _) = io_of("lwio-io-");
    let data = pattern(13, (3 << 20) + 5);
    assert_eq!(f.write_at(&data, 4099).unwrap(), data.len());
    let mut back = vec![0u8; data.len()];
    assert_eq!(f.read_at(&mut back, 4099).unwrap(), data.len());
    assert!(back == data, "read back differs");
    let disk = std::fs::read(dir.path().join("t")).unwrap();
    assert_eq!(disk.len(), 4099 + data.len());
    assert!(disk[..4099].iter().all(|&b| b == 0));
    assert!(disk[4099..] == data[..], "the file differs");
    let (r1, w1, _) = io_of("lwio-rdma-io");
    let (pr1, pw1, _) = io_of("lwio-io-");
    println!(
        "storage threads: read {} B, wrote {} B; backend pool: read {} B, wrote {} B",
        r1 - r0,
        w1 - w0,
        pr1 - pr0,
        pw1 - pw0
    );
    assert!(
        w1 - w0 >= data.len() as u64,
        "storage threads wrote {}",
        w1 - w0
    );
    assert!(
        r1 - r0 >= data.len() as u64,
        "storage threads read {}",
        r1 - r0
    );
    assert_eq!(
        (pr1 - pr0, pw1 - pw0),
        (0, 0),
        "the backend pool moved bytes"
    );
}
