//! LWIO end to end over real verbs, for the RDMA VM tests
//! (`scripts/vm/lwio-e2e.sh`, cases `lwio-e2e-rxe` / `lwio-e2e-siw`).
//!
//! `lwio-e2e-vm DEVICE IP` starts a server (side channel on loopback, RDMA
//! listener on the verbs provider's DEVICE at IP) and, in one process, a
//! client on the same device for each completion mode. Reads and writes of
//! every shape (bounce, staged, registered caller memory, a cached
//! registered buffer, vectored, past 4 GiB, many requests in flight) are
//! checked byte for byte against the exported file. On a device with RDMA
//! Write with Immediate (rxe) interrupt-mode reads must complete through it;
//! on one without memory windows (siw) the provider's per-request
//! registration stands in for them. The server's receives must come from
//! its shared receive pool (an SRQ) where the device has SRQs.
//! `LWIO_E2E_IDLE_RECLAIM_MS` sets the server's `idle_reclaim` (e.g. 20:
//! idle credits are taken back between every step). Prints `PASS name` / `FAIL name: why`
//! lines; exits 1 if anything failed. Not part of the `lwio` CLI.

use std::io::{IoSlice, IoSliceMut};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::time::Duration;

use lwio_client::{Client, ClientOptions, Completion, OpenOptions};
use lwio_rdma::conformance::pattern;
use lwio_server::config::{Limits, ProviderChoice};
use lwio_server::io_phase::driver::RdmaServerOptions;
use lwio_server::io_phase::testkit::LocalServer;

const TOKEN: &str = "lwio-e2e-vm-token-0123456789";

fn local_read(path: &Path, off: u64, len: usize) -> Vec<u8> {
    let Ok(f) = std::fs::File::open(path) else {
        return Vec::new();
    };
    let mut v = vec![0u8; len];
    let mut n = 0;
    while n < len {
        match f.read_at(&mut v[n..], off + n as u64) {
            Ok(0) | Err(_) => break,
            Ok(k) => n += k,
        }
    }
    v.truncate(n);
    v
}

type R = Result<(), String>;

fn check(cond: bool, what: impl FnOnce() -> String) -> R {
    if cond {
        Ok(())
    } else {
        Err(what())
    }
}

fn e2s(e: impl std::fmt::Display) -> String {
    e.to_string()
}

/// Writes, then reads of every shape, byte for byte.
/// Windows bound and invalidated so far (printed; shown when a case fails).
fn trace_windows(c: &Client, step: &str) {
    let st = c.stats();
    println!(
        "    after {step}: windows bound {}, invalidated {}",
        st.windows_bound, st.windows_invalidated
    );
}

fn io_case(c: &Client, root: &Path, name: &str) -> R {
    let path = root.join(name);
    let f = c
        .open(name, &OpenOptions::read_write().create(true))
        .map_err(e2s)?;
    let data = pattern(1, 700_001);
    check(f.write_at(&data, 3).map_err(e2s)? == data.len(), || {
        "short write".into()
    })?;
    check(local_read(&path, 3, data.len()) == data, || {
        "written data differs on disk".into()
    })?;
    for (off, len) in [
        (3u64, 1usize),
        (5, 1023),
        (1000, 60_000),
        (4097, 65_537),
        (3, 700_001),
    ] {
        let mut buf = vec![0xAAu8; len];
        let n = f.read_at(&mut buf, off).map_err(e2s)?;
        trace_windows(c, &format!("read {off}+{len}"));
        let want = local_read(&path, off, len);
        check(n == want.len() && buf[..n] == want[..], || {
            format!("read at {off}+{len}: {n} bytes, data differs")
        })?;
    }
    // A cached registered buffer.
    let mut rb = c.register_buffer(1 << 20).map_err(e2s)?;
    let n = f.read_registered(&mut rb, 0..500_000, 77).map_err(e2s)?;
    check(n == 500_000 && rb[..n] == data[74..74 + n], || {
        "read into a registered buffer differs".into()
    })?;
    drop(rb);
    trace_windows(c, "read into a registered buffer");
    // Vectored.
    let a = pattern(21, 5000);
    let b = pattern(22, 11_000);
    f.write_vectored_at(&[IoSlice::new(&a), IoSlice::new(&b)], 1_000_003)
        .map_err(e2s)?;
    let mut want = a.clone();
    want.extend_from_slice(&b);
    let (mut x, mut y) = (vec![0u8; 4096 * 3], vec![0u8; 512 * 3]);
    f.read_vectored_at(
        &mut [IoSliceMut::new(&mut x), IoSliceMut::new(&mut y)],
        1_000_003,
    )
    .map_err(e2s)?;
    trace_windows(c, "vectored read");
    check(
        x[..] == want[..4096 * 3] && y[..] == want[4096 * 3..4096 * 3 + 1536],
        || "vectored read differs".into(),
    )?;
    // Past 4 GiB.
    let far = (5u64 << 30) + 4093;
    let d = pattern(9, 300_007);
    f.write_at(&d, far).map_err(e2s)?;
    let mut back = vec![0u8; d.len()];
    f.read_at(&mut back, far).map_err(e2s)?;
    check(back == d && local_read(&path, far, d.len()) == d, || {
        "I/O past 4 GiB differs".into()
    })?;
    // Many requests in flight from several threads.
    let f = std::sync::Arc::new(f);
    let ts: Vec<_> = (0..4u64)
        .map(|i| {
            let f = f.clone();
            let data = data.clone();
            std::thread::spawn(move || -> R {
                let mut buf = vec![0u8; 150_001];
                for k in 0..6u64 {
                    let off = 3 + (i * 97_003 + k * 31) % 500_000;
                    let n = f.read_at(&mut buf, off).map_err(e2s)?;
                    let o = (off - 3) as usize;
                    check(n == buf.len() && buf[..] == data[o..o + n], || {
                        format!("concurrent read at {off} differs")
                    })?;
                }
                Ok(())
            })
        })
        .collect();
    for t in ts {
        t.join()
            .map_err(|_| "reader thread panicked".to_string())??;
    }
    Ok(())
}

fn main() {
    let mut args = std::env::args().skip(1);
    let (Some(dev), Some(ip)) = (args.next(), args.next()) else {
        eprintln!("usage: lwio-e2e-vm DEVICE IP");
        std::process::exit(2);
    };
    if std::env::var_os("RUST_LOG").is_some() {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .try_init();
    }
    let caps = lwio_rdma::providers()
        .into_iter()
        .find(|p| p.name() == "verbs")
        .and_then(|p| p.devices().into_iter().find(|d| d.name == dev))
        .and_then(|d| d.caps);
    let Some(caps) = caps else {
        println!("FAIL setup: no verbs device {dev}");
        std::process::exit(1);
    };
    println!(
        "device {dev}: write_with_imm={} mw={:?} one_shot_mw={}",
        caps.write_with_imm, caps.mw_kind, caps.one_shot_mw
    );
    let root = std::env::temp_dir().join(format!("lwio-e2e-vm-{}", std::process::id()));
    let _ = std::fs::create_dir_all(&root);
    let rdma = RdmaServerOptions {
        provider: ProviderChoice::Verbs,
        device: Some(dev.clone()),
        listen: format!("{ip}:0").parse().expect("IP address"),
        ..RdmaServerOptions::default()
    };
    let mut rdma = rdma;
    if let Some(ms) = std::env::var("LWIO_E2E_IDLE_RECLAIM_MS")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        rdma.idle_reclaim = Duration::from_millis(ms);
    }
    let server = match LocalServer::start_on(&root, "ex", TOKEN, Limits::default(), rdma) {
        Ok(s) => s,
        Err(e) => {
            println!("FAIL setup: server on {dev} {ip}: {e}");
            std::process::exit(1);
        }
    };
    let mut failed = 0;
    for completion in [Completion::Interrupt, Completion::Poll] {
        let name = format!("{dev}-{completion:?}").to_lowercase();
        let opts = ClientOptions {
            completion,
            provider: ProviderChoice::Verbs,
            device: Some(dev.clone()),
            credits: 8,
            op_timeout: Duration::from_secs(30),
            ..ClientOptions::default()
        };
        let r = Client::connect(
            &format!("lwio://{}/ex", server.side_addr),
            Some(TOKEN),
            opts.no_tls(),
        )
        .map_err(e2s)
        .and_then(|c| {
            io_case(&c, &root, &format!("{name}.bin"))?;
            let st = c.stats();
            println!("  {name}: {st:?}");
            // While the client is connected: the server's receives came
            // from the shared receive pool (an SRQ) where the device has
            // SRQs, else from the connection's own region.
            let pool = server.rdma.receive_pool();
            println!("  {name}: server receive pool {pool:?}");
            if caps.max_srq_wr > 0 {
                check(pool.promised > 0 && pool.registered_bytes > 0, || {
                    format!("the device has SRQs but the server's receive pool is unused: {pool:?}")
                })?;
            } else {
                check(pool.registered_bytes == 0, || {
                    format!("the device has no SRQ but the server's receive pool holds memory: {pool:?}")
                })?;
            }
            check(st.windows_bound == st.windows_invalidated, || {
                "a window was left bound".into()
            })?;
            check(st.credit_violations == 0, || "credit violation".into())?;
            check(st.call_registrations > 0, || {
                "no read landed in caller memory".into()
            })?;
            match completion {
                Completion::Interrupt if caps.write_with_imm => {
                    check(st.immediate_completions > 0, || {
                        "the device has write with immediate but no read completed through it"
                            .into()
                    })
                }
                Completion::Interrupt => check(st.immediate_completions == 0, || {
                    "immediate completions without device support".into()
                }),
                Completion::Poll => {
                    check(st.polled_completions > 0, || "no polled completion".into())
                }
            }
        });
        match r {
            Ok(()) => println!("PASS {name}"),
            Err(e) => {
                failed += 1;
                println!("FAIL {name}: {e}");
            }
        }
    }
    let ss = server.rdma.stats();
    println!("  server: {ss:?}");
    if ss.mrs_remote_access != 0 || ss.closed_by_protocol != 0 {
        failed += 1;
        println!("FAIL {dev}-server: exposed memory or protocol closes: {ss:?}");
    }
    drop(server);
    let _ = std::fs::remove_dir_all(&root);
    std::process::exit(if failed == 0 { 0 } else { 1 });
}
