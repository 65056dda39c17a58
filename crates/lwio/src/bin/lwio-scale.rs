//! `lwio-scale`: one server, many clients (issue 13; run by
//! `bench/scale.sh`, which starts the server).
//!
//! Against a running `lwio serve` (`--url`, token from `--token-file` or
//! `$LWIO_TOKEN`), in this order:
//!
//! 1. **QD1 alone**: one client (default options) reads 4 KiB at random
//!    offsets of `--file`, one at a time, for `--latency-runtime`: p50/p99.
//! 2. **IOPS**: for each `--jobs` J, J clients (each its own connection and
//!    thread, `lwio bench`'s job loop) keep `--qd` 4 KiB random reads in
//!    flight for `--runtime`: aggregate IOPS, and the CPU time this process
//!    (the clients) and the server used per I/O meanwhile (what decides the
//!    IOPS once the CPUs are all busy, and less noisy than IOPS on a shared
//!    machine).
//! 3. **Idle connections**: clients (default options, each with the file
//!    open) are connected one at a time up to each of `--connections`,
//!    timing every connect + open; at each step the server's RSS and threads
//!    (`/proc/PID/status` of `--server-pid`), its registered bytes and
//!    connections (`--metrics`), and this process's RSS and threads, per
//!    idle connection. A refused connection ends the steps with the
//!    client's error line.
//! 4. **QD1 with the others idle**: one idle client leaves, the QD1 client
//!    of 1 connects and measures again beside the rest (999 with 1,000).
//!
//! Prints plain lines: the command, then each phase's figures and the
//! ratios. Exit 0 even when the server refused some connections (that is a
//! figure); 2 if the run itself failed.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use clap::Parser;
use hdrhistogram::Histogram;
use lwio::cli::{Completion as CliCompletion, RwPattern};
use lwio::cmd::bench::{job, job_options, JobResult, Plan, Rng};
use lwio::scale::{cpu_time, metric, qd1_reads, raise_nofile, scrape, ProcStatus};
use lwio_client::{Client, ClientOptions, ClientTls, Completion, File, OpenOptions};

#[derive(Parser, Debug)]
#[command(about = "lwio: one server, many clients (issue 13); see bench/scale.sh")]
struct Args {
    /// `lwio://HOST:PORT/EXPORT` of the running server.
    #[arg(long)]
    url: String,
    /// File holding the token (default: $LWIO_TOKEN).
    #[arg(long)]
    token_file: Option<PathBuf>,
    /// The server's process id: its RSS and threads are read from /proc.
    #[arg(long)]
    server_pid: Option<u32>,
    /// The server's `--metrics` address: registered bytes, connections.
    #[arg(long)]
    metrics: Option<String>,
    /// Idle connections to reach, in steps.
    #[arg(long, value_delimiter = ',', default_value = "1,10,100,250,500,1000")]
    connections: Vec<usize>,
    /// Jobs of the IOPS runs (each one client and one thread).
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,16,64,256")]
    jobs: Vec<usize>,
    #[arg(long, default_value_t = 8)]
    qd: usize,
    /// Length of each IOPS run.
    #[arg(long, default_value = "5s", value_parser = duration)]
    runtime: Duration,
    /// Length of each QD1 latency run.
    #[arg(long, default_value = "5s", value_parser = duration)]
    latency_runtime: Duration,
    /// How the IOPS jobs reap completions (interrupt: 256 polling jobs on
    /// two cores would measure their own spinning).
    #[arg(long, value_enum, default_value = "interrupt")]
    completion: CliCompletion,
    /// The file read (created in the export and filled if shorter).
    #[arg(long, default_value = "scale.dat")]
    file: String,
    #[arg(long, default_value = "64MiB", value_parser = size)]
    size: u64,
    /// Every client's `ClientOptions::busy_poll` (interrupt mode: how long
    /// a waiter polls before it sleeps; "0s" = sleep at once). Default:
    /// the library's.
    #[arg(long, value_parser = duration)]
    busy_poll: Option<Duration>,
}

fn duration(s: &str) -> Result<Duration, String> {
    lwio_side::units::parse_duration(s).map_err(|e| e.to_string())
}

fn size(s: &str) -> Result<u64, String> {
    lwio_side::units::parse_size(s).map_err(|e| e.to_string())
}

fn main() {
    let a = Args::parse();
    if let Err(e) = run(&a) {
        eprintln!("lwio-scale: error: {e:#}");
        std::process::exit(2);
    }
}

/// The command line, quoted where needed.
fn command_line() -> String {
    std::env::args()
        .map(|s| {
            if !s.is_empty()
                && s.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_./=:,@+".contains(c))
            {
                s
            } else {
                format!("'{}'", s.replace('\'', r"'\''"))
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

struct Ctx<'a> {
    a: &'a Args,
    token: String,
}

impl Ctx<'_> {
    fn connect(&self, opts: ClientOptions) -> Result<Client, lwio_client::Error> {
        let opts = ClientOptions {
            busy_poll: self.a.busy_poll.unwrap_or(opts.busy_poll),
            // bench/scale.sh serves with --no-tls.
            tls: Some(ClientTls::Off),
            ..opts
        };
        Client::connect(&self.a.url, Some(&self.token), opts)
    }

    /// A client with the file open read-only.
    fn client_with_file(&self, opts: ClientOptions) -> Result<(Client, File), String> {
        let c = self.connect(opts).map_err(|e| format!("connect: {e}"))?;
        let f = c
            .open(&self.a.file, &OpenOptions::read_only())
            .map_err(|e| format!("open {}: {e}", self.a.file))?;
        Ok((c, f))
    }

    /// The server's figures now (what can be read of them).
    fn server(&self) -> Server {
        let p = self.a.server_pid.and_then(|p| ProcStatus::of(p).ok());
        let m = self.a.metrics.as_deref().and_then(|m| scrape(m).ok());
        Server {
            rss_kib: p.map(|p| p.rss_kib),
            threads: p.map(|p| p.threads),
            registered: m
                .as_ref()
                .map(|m| metric(m, "lwio_rdma_registered_bytes") as u64),
            connections: m
                .as_ref()
                .map(|m| metric(m, "lwio_rdma_connections") as u64),
        }
    }

    /// Wait (up to 30 s) until the server has at most `n` RDMA connections.
    fn settle(&self, n: u64) {
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs(30) {
            match self.server().connections {
                Some(c) if c > n => std::thread::sleep(Duration::from_millis(50)),
                Some(_) => return,
                None => {
                    std::thread::sleep(Duration::from_secs(1));
                    return;
                }
            }
        }
        eprintln!("lwio-scale: the server still had more than {n} connections after 30 s");
    }
}

#[derive(Debug, Clone, Copy)]
struct Server {
    rss_kib: Option<u64>,
    threads: Option<u64>,
    registered: Option<u64>,
    connections: Option<u64>,
}

fn us(h: &Histogram<u64>, q: f64) -> f64 {
    h.value_at_quantile(q) as f64 / 1000.0
}

/// "(n/a)" for figures the run could not read.
fn opt<T: std::fmt::Display>(v: Option<T>) -> String {
    v.map_or("n/a".into(), |v| v.to_string())
}

/// `(now - base) / n`, one decimal.
fn per(now: Option<u64>, base: Option<u64>, n: usize) -> String {
    match (now, base) {
        (Some(a), Some(b)) if n > 0 => format!("{:.1}", (a as f64 - b as f64) / n as f64),
        _ => "n/a".into(),
    }
}

fn run(a: &Args) -> anyhow::Result<()> {
    println!("lwio-scale: {}", command_line());
    let token = match &a.token_file {
        Some(p) => std::fs::read_to_string(p)
            .map_err(|e| anyhow::anyhow!("{}: {e}", p.display()))?
            .trim()
            .to_string(),
        None => std::env::var("LWIO_TOKEN")
            .map_err(|_| anyhow::anyhow!("give --token-file or set LWIO_TOKEN"))?,
    };
    let most = a.connections.iter().copied().max().unwrap_or(0);
    let most_jobs = a.jobs.iter().copied().max().unwrap_or(0);
    // Per client about 8 descriptors here (side and RDMA sockets, the
    // runtime's and the provider's epoll and eventfds).
    let want = (most.max(most_jobs) as u64 + 2) * 12 + 256;
    let nofile = raise_nofile(want);
    if nofile < want {
        println!(
            "lwio-scale: RLIMIT_NOFILE {nofile} (wanted {want}): clients may run out of descriptors"
        );
    }
    let cx = Ctx {
        a,
        token: token.clone(),
    };
    let opts = || ClientOptions {
        op_timeout: Duration::from_secs(60),
        ..ClientOptions::default()
    };

    // The file, laid out once.
    {
        let c = cx.connect(opts()).map_err(|e| anyhow::anyhow!("{e}"))?;
        let f = c
            .open(&a.file, &OpenOptions::read_write().create(true))
            .map_err(|e| anyhow::anyhow!("{}: {e}", a.file))?;
        let have = f.len().map_err(|e| anyhow::anyhow!("{e}"))?;
        if have < a.size {
            let mut rng = Rng::random();
            let mut block = vec![0u8; 1 << 20];
            let mut off = have;
            while off < a.size {
                for w in block.chunks_exact_mut(8) {
                    w.copy_from_slice(&rng.next().to_le_bytes());
                }
                let n = (a.size - off).min(block.len() as u64) as usize;
                off += f
                    .write_at(&block[..n], off)
                    .map_err(|e| anyhow::anyhow!("{}: {e}", a.file))? as u64;
            }
        }
        f.close().map_err(|e| anyhow::anyhow!("{e}"))?;
    }
    cx.settle(0);
    println!(
        "setup: file {} of {} MiB; idle and QD1 clients: default ClientOptions (completion interrupt, 16 credits asked); busy_poll {:?} on every client",
        a.file,
        a.size >> 20,
        a.busy_poll.unwrap_or(ClientOptions::default().busy_poll)
    );

    // 1. QD1 alone.
    let qd1 = |label: &str| -> anyhow::Result<Histogram<u64>> {
        let (_c, f) = cx.client_with_file(opts()).map_err(anyhow::Error::msg)?;
        let h = qd1_reads(&f, a.size, None, a.latency_runtime, 100)?;
        println!(
            "qd1 {label}: p50 {:.1} us, p99 {:.1} us, p99.9 {:.1} us ({} reads of 4 KiB in {:?})",
            us(&h, 0.5),
            us(&h, 0.99),
            us(&h, 0.999),
            h.len(),
            a.latency_runtime
        );
        Ok(h)
    };
    let alone = qd1("alone")?;
    cx.settle(0);

    // 2. IOPS.
    println!(
        "iops: 4 KiB random reads, QD {} per job, {:?} each, completion {:?}",
        a.qd, a.runtime, a.completion
    );
    println!("  jobs       IOPS   p50_us   p99_us  client_cpu_us/io  server_cpu_us/io");
    let mut iops_by_jobs = Vec::new();
    for &j in &a.jobs {
        match iops(&cx, j) {
            Ok((iops, h, cpu)) => {
                println!(
                    "  {j:>4} {iops:>10.0} {:>8.1} {:>8.1}  {:>16}  {:>16}",
                    us(&h, 0.5),
                    us(&h, 0.99),
                    cpu.0,
                    cpu.1
                );
                iops_by_jobs.push((j, iops));
            }
            Err(e) => println!("  {j:>4} not run: {e}"),
        }
        cx.settle(0);
    }
    if let (Some(first), Some(last)) = (iops_by_jobs.first(), iops_by_jobs.last()) {
        let best = iops_by_jobs.iter().map(|x| x.1).fold(0.0, f64::max);
        println!(
            "iops ratio: jobs {} / jobs {} = {:.2}; jobs {} / best = {:.2}",
            last.0,
            first.0,
            last.1 / first.1,
            last.0,
            last.1 / best
        );
    }

    // 3. Idle connections.
    let base = cx.server();
    let own0 = ProcStatus::own()?;
    println!(
        "idle: server before: RSS {} KiB, threads {}, registered {} B, RDMA connections {}; this process: RSS {} KiB, threads {}",
        opt(base.rss_kib),
        opt(base.threads),
        opt(base.registered),
        opt(base.connections),
        own0.rss_kib,
        own0.threads
    );
    println!(
        "  conns  connect_ms(mean   p99    max)  server_RSS_MiB  RSS_KiB/conn  registered_KiB/conn  threads  threads/conn  idle_CPU%  client_RSS_KiB/conn  client_threads/conn  client_idle_CPU%"
    );
    let mut idle: Vec<(Client, File)> = Vec::with_capacity(most);
    let mut stopped = None;
    for &n in &a.connections {
        let mut times = Vec::new();
        while idle.len() < n {
            let t = Instant::now();
            match cx.client_with_file(opts()) {
                Ok(cf) => {
                    times.push(t.elapsed());
                    idle.push(cf);
                }
                Err(e) => {
                    stopped = Some((idle.len() + 1, n, e));
                    break;
                }
            }
        }
        let k = idle.len();
        // The credit balancer reclaims an idle connection's extra credits
        // after 2 s: measure what idle connections hold.
        std::thread::sleep(Duration::from_millis(2500));
        let s = cx.server();
        let own = ProcStatus::own()?;
        // CPU the server and this process use while every connection is
        // idle (over 1 s).
        let me = std::process::id();
        let c0 = (a.server_pid.map(cpu_time), cpu_time(me));
        std::thread::sleep(Duration::from_secs(1));
        let c1 = (a.server_pid.map(cpu_time), cpu_time(me));
        let busy =
            |x: Option<anyhow::Result<Duration>>, y: Option<anyhow::Result<Duration>>| match (x, y)
            {
                (Some(Ok(x)), Some(Ok(y))) => {
                    format!("{:.1}", y.saturating_sub(x).as_secs_f64() * 100.0)
                }
                _ => "n/a".into(),
            };
        let (server_cpu, client_cpu) = (busy(c0.0, c1.0), busy(Some(c0.1), Some(c1.1)));
        times.sort();
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let (mean, p99, max) = if times.is_empty() {
            (0.0, 0.0, 0.0)
        } else {
            (
                ms(times.iter().sum::<Duration>()) / times.len() as f64,
                ms(times[(times.len() * 99).div_ceil(100) - 1]),
                ms(*times.last().expect("not empty")),
            )
        };
        println!(
            "  {k:>5}  {mean:>14.2} {p99:>6.2} {max:>6.2}  {:>14}  {:>12}  {:>19}  {:>7}  {:>12}  {server_cpu:>9}  {:>19}  {:>19}  {client_cpu:>16}",
            opt(s.rss_kib.map(|r| format!("{:.1}", r as f64 / 1024.0))),
            per(s.rss_kib, base.rss_kib, k),
            match s.registered {
                Some(r) if k > 0 => format!("{:.1}", r as f64 / 1024.0 / k as f64),
                _ => "n/a".into(),
            },
            opt(s.threads),
            per(s.threads, base.threads, k),
            per(Some(own.rss_kib), Some(own0.rss_kib), k),
            per(Some(own.threads), Some(own0.threads), k),
        );
        if let Some((at, want, e)) = &stopped {
            println!(
                "  STOPPED at connection {at} (of {want} wanted): {e} (server: {} RDMA connections, {} registered bytes)",
                opt(s.connections),
                opt(s.registered)
            );
            break;
        }
    }

    // 4. QD1 beside the others, idle.
    if !idle.is_empty() {
        idle.pop();
        cx.settle(idle.len() as u64);
        let with = qd1(&format!("with {} idle", idle.len()))?;
        println!(
            "qd1 ratio (with {} idle / alone): p50 {:.2}x, p99 {:.2}x (target <= 1.2x)",
            idle.len(),
            us(&with, 0.5) / us(&alone, 0.5),
            us(&with, 0.99) / us(&alone, 0.99)
        );
    }
    let t = Instant::now();
    drop(idle);
    cx.settle(0);
    let s = cx.server();
    println!(
        "idle clients closed in {:.1} s; server after: RSS {} KiB, threads {}, registered {} B, RDMA connections {}",
        t.elapsed().as_secs_f64(),
        opt(s.rss_kib),
        opt(s.threads),
        opt(s.registered),
        opt(s.connections)
    );
    Ok(())
}

/// The CPU time per I/O of this process and of the server during an IOPS
/// run (µs, one decimal; "n/a" when it cannot be read).
type CpuPerIo = (String, String);

/// Aggregate IOPS (and latencies) of `j` jobs at QD `--qd`, and the CPU
/// time per I/O.
fn iops(cx: &Ctx, j: usize) -> Result<(f64, Histogram<u64>, CpuPerIo), String> {
    let a = cx.a;
    let completion = match a.completion {
        CliCompletion::Poll => Completion::Poll,
        CliCompletion::Interrupt => Completion::Interrupt,
    };
    let mut conns = Vec::with_capacity(j);
    for i in 0..j {
        let o = ClientOptions {
            op_timeout: Duration::from_secs(60),
            ..job_options(4096, a.qd, completion)
        };
        conns.push(
            cx.client_with_file(o)
                .map_err(|e| format!("connection {} of {j}: {e}", i + 1))?,
        );
    }
    let plan = Plan {
        rw: RwPattern::Randread,
        bs: 4096,
        qd: a.qd,
        size: a.size,
    };
    let me = std::process::id();
    let cpu = || {
        (
            cpu_time(me).ok(),
            a.server_pid.and_then(|p| cpu_time(p).ok()),
        )
    };
    let mut cpu0 = (None, None);
    let live = AtomicU64::new(0);
    let stop = AtomicBool::new(false);
    let barrier = Arc::new(Barrier::new(j + 1));
    let results: Vec<anyhow::Result<JobResult>> = std::thread::scope(|s| {
        let hs: Vec<_> = conns
            .iter()
            .map(|(c, f)| {
                let (live, stop, barrier) = (&live, &stop, barrier.clone());
                s.spawn(move || job(c, f, plan, a.runtime, &barrier, live, stop))
            })
            .collect();
        barrier.wait();
        cpu0 = cpu();
        hs.into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("a job panicked")))
            })
            .collect()
    });
    let cpu1 = cpu();
    let mut hist =
        Histogram::<u64>::new_with_bounds(1, 120_000_000_000, 3).map_err(|e| e.to_string())?;
    let (mut ios, mut elapsed) = (0u64, Duration::ZERO);
    for r in results {
        let r = r.map_err(|e| format!("{e:#}"))?;
        let _ = hist.add(&r.hist);
        ios += r.reads + r.writes;
        elapsed = elapsed.max(r.elapsed);
    }
    let per_io = |x: Option<Duration>, y: Option<Duration>| match (x, y) {
        (Some(x), Some(y)) if ios > 0 => {
            format!(
                "{:.1}",
                y.saturating_sub(x).as_secs_f64() * 1e6 / ios as f64
            )
        }
        _ => "n/a".into(),
    };
    let cpu = (per_io(cpu0.0, cpu1.0), per_io(cpu0.1, cpu1.1));
    Ok((ios as f64 / elapsed.as_secs_f64().max(1e-9), hist, cpu))
}
