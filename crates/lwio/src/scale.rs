//! What `lwio-scale` (bench/scale.sh) and the thousand-client test
//! (tests/e2e_thousand.rs) share (issue 13): a process's RSS and threads
//! from `/proc/PID/status`, a scrape of the server's metrics, this
//! process's descriptor limit, and a QD1 4 KiB random-read loop.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use lwio_client::File;

use crate::cmd::bench::Rng;

/// Raise this process's RLIMIT_NOFILE towards `want` (the hard limit too
/// where allowed, else up to the hard limit); returns the soft limit now.
/// A child (`lwio serve`) inherits it.
pub fn raise_nofile(want: u64) -> u64 {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit only read and write the struct we pass.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) != 0 {
            return 0;
        }
        if r.rlim_cur < want {
            let raised = libc::rlimit {
                rlim_cur: want,
                rlim_max: r.rlim_max.max(want),
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) != 0 {
                let to_hard = libc::rlimit {
                    rlim_cur: r.rlim_max.min(want),
                    rlim_max: r.rlim_max,
                };
                libc::setrlimit(libc::RLIMIT_NOFILE, &to_hard);
            }
            libc::getrlimit(libc::RLIMIT_NOFILE, &mut r);
        }
    }
    r.rlim_cur
}

/// A process's resident memory and threads (`/proc/PID/status`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcStatus {
    pub rss_kib: u64,
    pub threads: u64,
}

impl ProcStatus {
    /// Of process `pid`.
    pub fn of(pid: u32) -> anyhow::Result<ProcStatus> {
        Self::read(&format!("/proc/{pid}/status"))
    }

    /// Of this process.
    pub fn own() -> anyhow::Result<ProcStatus> {
        Self::read("/proc/self/status")
    }

    fn read(path: &str) -> anyhow::Result<ProcStatus> {
        let s = std::fs::read_to_string(path).map_err(|e| anyhow::anyhow!("{path}: {e}"))?;
        let field = |name: &str| -> anyhow::Result<u64> {
            s.lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|v| v.split_whitespace().next()?.parse().ok())
                .ok_or_else(|| anyhow::anyhow!("{path}: no {name}"))
        };
        Ok(ProcStatus {
            rss_kib: field("VmRSS:")?,
            threads: field("Threads:")?,
        })
    }
}

/// The unlabelled samples of `http://ADDR/metrics` (`lwio serve
/// --metrics ADDR`, docs/metrics.md): name → value.
pub fn scrape(addr: &str) -> anyhow::Result<BTreeMap<String, f64>> {
    let mut s = std::net::TcpStream::connect(addr)
        .map_err(|e| anyhow::anyhow!("metrics at {addr}: {e}"))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(
        s,
        "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )?;
    let mut body = String::new();
    s.read_to_string(&mut body)
        .map_err(|e| anyhow::anyhow!("metrics at {addr}: {e}"))?;
    let (head, text) = body
        .split_once("\r\n\r\n")
        .ok_or_else(|| anyhow::anyhow!("metrics at {addr}: no HTTP answer"))?;
    anyhow::ensure!(
        head.starts_with("HTTP/1.1 200"),
        "metrics at {addr}: {}",
        head.lines().next().unwrap_or("")
    );
    Ok(text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.contains('{'))
        .filter_map(|l| {
            let (k, v) = l.split_once(' ')?;
            Some((k.to_string(), v.trim().parse().ok()?))
        })
        .collect())
}

/// CPU time (user + system) process `pid` has used (`/proc/PID/stat`).
pub fn cpu_time(pid: u32) -> anyhow::Result<Duration> {
    let path = format!("/proc/{pid}/stat");
    let s = std::fs::read_to_string(&path).map_err(|e| anyhow::anyhow!("{path}: {e}"))?;
    // After the command name in parentheses: state is field 3, utime 14,
    // stime 15.
    let rest = s
        .rsplit_once(')')
        .ok_or_else(|| anyhow::anyhow!("{path}: unexpected format"))?
        .1;
    let f: Vec<u64> = rest
        .split_whitespace()
        .skip(11)
        .take(2)
        .filter_map(|v| v.parse().ok())
        .collect();
    anyhow::ensure!(f.len() == 2, "{path}: unexpected format");
    // SAFETY: sysconf reads a constant.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    Ok(Duration::from_micros((f[0] + f[1]) * 1_000_000 / hz))
}

/// One metric of a scrape (0 when absent).
pub fn metric(m: &BTreeMap<String, f64>, name: &str) -> f64 {
    m.get(name).copied().unwrap_or(0.0)
}

/// 4 KiB reads at QD 1 and random 4 KiB-aligned offsets of the first
/// `size` bytes of `file`, for `runtime` (at least `min_ios` of them);
/// each compared with `expect[off..off + 4096]` when given. Returns the
/// latencies (ns).
pub fn qd1_reads(
    file: &File,
    size: u64,
    expect: Option<&[u8]>,
    runtime: Duration,
    min_ios: u64,
) -> anyhow::Result<Histogram<u64>> {
    const BS: usize = 4096;
    let blocks = (size / BS as u64).max(1);
    let mut rng = Rng::random();
    let mut hist = Histogram::<u64>::new_with_bounds(1, 120_000_000_000, 3)?;
    let mut buf = vec![0u8; BS];
    let t0 = Instant::now();
    while t0.elapsed() < runtime || hist.len() < min_ios {
        let off = (rng.next() % blocks) * BS as u64;
        let t = Instant::now();
        let n = file
            .read_at(&mut buf, off)
            .map_err(|e| anyhow::anyhow!("4 KiB read at {off}: {e}"))?;
        let ns = t.elapsed().as_nanos().min(120_000_000_000) as u64;
        if let Some(want) = expect {
            let want = &want[off as usize..(off as usize + BS).min(want.len())];
            anyhow::ensure!(
                &buf[..n] == want,
                "4 KiB read at {off}: {n} bytes, not the {} written",
                want.len()
            );
        }
        hist.record(ns.max(1))?;
    }
    Ok(hist)
}
