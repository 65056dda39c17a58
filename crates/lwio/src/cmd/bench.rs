//! `lwio bench`: fio-like benchmark of file I/O through lwio.
//!
//! **Target.** With a URL: that file (created and laid out to `--size` if
//! missing or shorter). Without: an *embedded server* — a child process
//! `lwio serve` on 127.0.0.1 (ephemeral ports) exporting a temporary
//! directory with a `--size` file of pseudo-random bytes, logged in with a
//! token generated for this run. The server runs in a child so the client
//! CPU time below (getrusage RUSAGE_SELF) is the client's alone.
//!
//! **Queue depth.** Each job has its own client (its own RDMA connection)
//! and one thread that keeps `--qd` I/Os in flight on it with the client
//! engine's issue/wait API (an I/O larger than the negotiated request size
//! is several pipelined requests). The server grants credits (at most 32
//! per connection by default); when `--qd` exceeds them, requests queue in
//! the client until a credit frees, as the report's `credits` shows.
//!
//! **Reported.** IOPS, bandwidth, latency percentiles (HDR histogram, from
//! issue to observed completion), client CPU time per I/O, and the exact
//! equivalent command line. `--json` prints the same as one JSON object.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;

use super::{connect_data, ctx, describe};
use crate::cli::{BenchArgs, Completion as CliCompletion, RwPattern};
use lwio_client::url::LwioUrl;
use lwio_client::{
    status_text, Batch, Client, ClientOptions, Completion, End, File, OpenOptions, Short,
};
use lwio_side::units::{format_duration, format_size};

/// Largest block size accepted.
const MAX_BS: u64 = 64 << 20;
/// Largest WRITE payload per request the benchmark offers (the server's
/// default `[rdma] max_write_size`).
const WRITE_CHUNK: usize = 64 * 1024;
/// Registered staging memory per job, at most.
const MAX_STAGE_BYTES: usize = 64 << 20;

fn rw_name(rw: RwPattern) -> &'static str {
    match rw {
        RwPattern::Read => "read",
        RwPattern::Write => "write",
        RwPattern::Randread => "randread",
        RwPattern::Randwrite => "randwrite",
        RwPattern::Randrw => "randrw",
    }
}

fn completion_name(c: CliCompletion) -> &'static str {
    match c {
        CliCompletion::Poll => "poll",
        CliCompletion::Interrupt => "interrupt",
    }
}

/// The command line that reproduces this run.
pub fn equivalent_command(a: &BenchArgs) -> String {
    let mut s = String::from("lwio bench");
    if let Some(u) = &a.url {
        s.push(' ');
        s.push_str(&u.to_string());
    }
    s.push_str(&format!(
        " --rw {} --bs {} --qd {} --jobs {} --size {} --runtime {} --completion {} --provider {}",
        rw_name(a.rw),
        format_size(a.bs),
        a.qd,
        a.jobs,
        format_size(a.size),
        format_duration(a.runtime),
        completion_name(a.completion),
        a.client.provider.as_str()
    ));
    let c = &a.client;
    if let Some(d) = &c.device {
        s.push_str(&format!(" --device {d}"));
    }
    if let Some(u) = &c.user {
        s.push_str(&format!(" --user {u}"));
    }
    if let Some(t) = &c.token_file {
        s.push_str(&format!(" --token-file {}", t.display()));
    }
    if let Some(f) = &c.fingerprint {
        s.push_str(&format!(" --fingerprint {f}"));
    }
    if let Some(p) = &c.ca {
        s.push_str(&format!(" --ca {}", p.display()));
    }
    if c.insecure {
        s.push_str(" --insecure");
    }
    if c.no_tls {
        s.push_str(" --no-tls");
    }
    if a.json {
        s.push_str(" --json");
    }
    s
}

// --------------------------------------------------------- embedded server

/// A temporary directory, removed on drop.
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A child `lwio serve` over a temporary directory.
struct Embedded {
    child: Child,
    addr: String,
    /// Dropped after the child is stopped (fields drop after `Drop::drop`).
    dir: TempDir,
}

impl Embedded {
    fn start(a: &BenchArgs) -> anyhow::Result<Embedded> {
        let dir = TempDir(std::env::temp_dir().join(format!(
            "lwio-bench-{}-{}",
            std::process::id(),
            super::random_suffix()
        )));
        {
            use std::os::unix::fs::DirBuilderExt;
            std::fs::DirBuilder::new()
                .mode(0o700)
                .recursive(true)
                .create(dir.0.join("data"))
                .map_err(|e| anyhow::anyhow!("creating {}: {e}", dir.0.display()))?;
        }
        // A token for this run only.
        let token = lwio_side::Token::generate();
        let token_path = dir.0.join("token");
        {
            use std::os::unix::fs::OpenOptionsExt;
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&token_path)
                .map_err(|e| anyhow::anyhow!("{}: {e}", token_path.display()))?;
            f.write_all(token.expose())?;
            f.write_all(b"\n")?;
        }
        fill_file(&dir.0.join("data").join("bench.dat"), a.size)?;
        let exe = std::env::current_exe()
            .map_err(|e| anyhow::anyhow!("cannot find the lwio executable: {e}"))?;
        let ready = dir.0.join("ready");
        let log_path = dir.0.join("server.log");
        let log = std::fs::File::create(&log_path)
            .map_err(|e| anyhow::anyhow!("{}: {e}", log_path.display()))?;
        let mut cmd = Command::new(exe);
        cmd.arg("serve")
            .args(["--listen", "127.0.0.1:0", "--rdma-listen", "127.0.0.1:0"])
            .arg("--export")
            .arg(format!("bench={}", dir.0.join("data").display()))
            .arg("--token-file")
            .arg(&token_path)
            .arg("--ready-file")
            .arg(&ready)
            .args(["--provider", a.client.provider.as_str()])
            // Loopback only, with a token made for this run: the side
            // channel needs no TLS (the data path is RDMA either way).
            .arg("--no-tls")
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log);
        {
            use std::os::unix::process::CommandExt;
            // SAFETY: prctl is async-signal-safe and the closure touches no
            // memory of the parent: the server dies with us.
            unsafe {
                cmd.pre_exec(|| {
                    libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
                    Ok(())
                });
            }
        }
        let child = cmd
            .spawn()
            .map_err(|e| anyhow::anyhow!("cannot start the embedded server: {e}"))?;
        let mut e = Embedded {
            child,
            addr: String::new(),
            dir,
        };
        let t0 = Instant::now();
        loop {
            if let Ok(s) = std::fs::read_to_string(&ready) {
                if s.ends_with('\n') {
                    e.addr = s.lines().next().unwrap_or("").trim().to_string();
                    return Ok(e);
                }
            }
            if let Ok(Some(st)) = e.child.try_wait() {
                let log = std::fs::read_to_string(&log_path).unwrap_or_default();
                let last = log
                    .lines()
                    .rev()
                    .find(|l| !l.trim().is_empty())
                    .unwrap_or("no message");
                anyhow::bail!("the embedded server exited ({st}): {}", last.trim());
            }
            if t0.elapsed() > Duration::from_secs(30) {
                anyhow::bail!("the embedded server did not start within 30 s");
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn url(&self) -> anyhow::Result<LwioUrl> {
        Ok(LwioUrl::parse(&format!(
            "lwio://{}/bench/bench.dat",
            self.addr
        ))?)
    }
}

impl Drop for Embedded {
    fn drop(&mut self) {
        let pid = self.child.id() as libc::pid_t;
        if let Ok(None) = self.child.try_wait() {
            // SAFETY: signalling our own child process.
            unsafe { libc::kill(pid, libc::SIGTERM) };
            let t0 = Instant::now();
            while t0.elapsed() < Duration::from_secs(5) {
                if let Ok(Some(_)) = self.child.try_wait() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Write `size` pseudo-random bytes to a new local file.
fn fill_file(path: &Path, size: u64) -> anyhow::Result<()> {
    let mut f = std::io::BufWriter::with_capacity(
        1 << 20,
        std::fs::File::create(path).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?,
    );
    let mut rng = Rng::random();
    let mut block = vec![0u8; 1 << 20];
    let mut left = size;
    while left > 0 {
        for w in block.chunks_exact_mut(8) {
            w.copy_from_slice(&rng.next().to_le_bytes());
        }
        let n = left.min(block.len() as u64) as usize;
        f.write_all(&block[..n])
            .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        left -= n as u64;
    }
    f.flush()
        .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    Ok(())
}

/// xorshift64*: offsets and payload, not security (also the soak's,
/// `lwio-soak`, seeded to repeat a run).
pub struct Rng(u64);

impl Rng {
    pub fn random() -> Rng {
        let mut b = [0u8; 8];
        lwio_side::random_bytes(&mut b);
        Rng::seeded(u64::from_le_bytes(b))
    }
    pub fn seeded(seed: u64) -> Rng {
        Rng(seed | 1)
    }
    #[allow(clippy::should_implement_trait)]
    pub fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
}

// -------------------------------------------------------------- the runs

/// What one job does (also `lwio-scale`'s IOPS runs).
#[derive(Debug, Clone, Copy)]
pub struct Plan {
    pub rw: RwPattern,
    pub bs: usize,
    pub qd: usize,
    /// Bytes of the file the offsets fall in.
    pub size: u64,
}

/// One job's figures: latencies (ns) of its completed I/Os.
pub struct JobResult {
    pub hist: Histogram<u64>,
    pub reads: u64,
    pub writes: u64,
    pub elapsed: Duration,
}

/// One I/O in flight: its requests, and how many there are.
struct InFlight {
    batch: Batch,
    parts: usize,
    start: Instant,
    read: bool,
}

/// Keep `plan.qd` I/Os in flight on `file` for `runtime` (or until
/// `stop`), after `start`; counts each completed I/O in `live`.
pub fn job(
    client: &Client,
    file: &File,
    plan: Plan,
    runtime: Duration,
    start: &std::sync::Barrier,
    live: &AtomicU64,
    stop: &AtomicBool,
) -> anyhow::Result<JobResult> {
    start.wait();
    let limits = file.request_limits();
    let (max_r, max_w) = (limits.max_read, limits.max_write);
    let blocks = (plan.size / plan.bs as u64).max(1);
    let mut rng = Rng::random();
    let mut wbuf = vec![0u8; plan.bs];
    for w in wbuf.chunks_mut(8) {
        let v = rng.next().to_le_bytes();
        w.copy_from_slice(&v[..w.len()]);
    }
    // A write larger than one request goes as one fragmented message
    // (docs/protocol.md §5.12), sent from a registered buffer: no copy.
    let wreg = if plan.bs > max_w && limits.max_write_message >= plan.bs {
        let mut r = client
            .register_buffer(plan.bs)
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        r.copy_from_slice(&wbuf);
        Some(r)
    } else {
        None
    };
    // Writes go as one fragmented message from the registered buffer when
    // its cached registration is on the file's connection.
    let wsrc = match &wreg {
        Some(r) => file
            .batch(0, Short::Counts)
            .send_from_buffer(r)
            .map_err(|e| anyhow::anyhow!("{e}"))?
            .then_some(r),
        None => None,
    };
    let mut scratch = vec![0u8; max_r];
    let mut hist = Histogram::<u64>::new_with_bounds(1, 120_000_000_000, 3)
        .map_err(|e| anyhow::anyhow!("histogram: {e}"))?;
    // Requests outstanding at most: what the staging slots hold.
    let budget = limits.stage_slots.max(1);
    let mut inflight: std::collections::VecDeque<InFlight> = Default::default();
    // Read requests outstanding (each holds a staging slot).
    let mut staged = 0usize;
    let mut pending_read = false;
    let (mut reads, mut writes) = (0u64, 0u64);
    let mut seq = 0u64;
    let t0 = Instant::now();
    let deadline = t0 + runtime;
    let mut failure: Option<anyhow::Error> = None;
    loop {
        let issuing = failure.is_none() && !stop.load(Ordering::Relaxed) && {
            // Check the clock once per I/O.
            Instant::now() < deadline
        };
        // Issue while there is room.
        while issuing && inflight.len() < plan.qd {
            let read = match plan.rw {
                RwPattern::Read | RwPattern::Randread => true,
                RwPattern::Write | RwPattern::Randwrite => false,
                RwPattern::Randrw => std::mem::take(&mut pending_read) || rng.next() & 1 == 0,
            };
            let chunk = match (read, &wsrc) {
                (true, _) => max_r,
                (false, Some(_)) => plan.bs,
                (false, None) => max_w,
            };
            let nreq = plan.bs.div_ceil(chunk);
            if read && staged + nreq > budget && !inflight.is_empty() {
                // Every staging slot is taken: reap first (the pattern
                // choice stays, so randrw keeps its mix).
                pending_read = true;
                break;
            }
            let block = match plan.rw {
                RwPattern::Read | RwPattern::Write => {
                    let b = seq % blocks;
                    seq += 1;
                    b
                }
                _ => rng.next() % blocks,
            };
            let off = block * plan.bs as u64;
            // Every part's bytes count (a short read is not this
            // benchmark's to judge); a status other than success fails it.
            let start = Instant::now();
            let mut batch = file.batch(off, Short::Counts);
            if !read {
                if let Some(r) = wsrc {
                    // The cached registration keeps the buffer's memory
                    // alive: no fence per I/O.
                    if let Err(err) = batch.send_from_buffer(r) {
                        failure = Some(anyhow::anyhow!(describe(&err)));
                        break;
                    }
                }
            }
            while batch.issued() < plan.bs {
                let len = (plan.bs - batch.issued()).min(chunk);
                let o = batch.issued();
                let r = match (read, &wreg, &wsrc) {
                    (true, ..) => batch.read(len, None),
                    (false, Some(r), Some(_)) => batch.write_message(&r[..], None),
                    _ => batch.write(&wbuf[o..o + len]),
                };
                if let Err(err) = r {
                    failure = Some(anyhow::anyhow!(describe(&err)));
                    break;
                }
            }
            let parts = batch.outstanding();
            if read {
                staged += parts;
            }
            inflight.push_back(InFlight {
                batch,
                parts,
                start,
                read,
            });
            if failure.is_some() {
                break;
            }
        }
        // Reap the oldest.
        let Some(mut io) = inflight.pop_front() else {
            break;
        };
        if io.read {
            staged -= io.parts;
        }
        // A read's staged part is copied out (a part is at most one read
        // request: `scratch`); a write's has nothing to copy, and may be a
        // whole fragmented message, longer than `scratch`.
        while let Some(l) = io.batch.reap() {
            l.copy_to(&mut scratch);
        }
        let ok = match io.batch.finish().1 {
            None | Some(End::Short) => true,
            Some(End::Status(st)) => {
                failure.get_or_insert_with(|| {
                    anyhow::anyhow!(
                        "{} failed with {}",
                        if io.read { "READ" } else { "WRITE" },
                        status_text(st)
                    )
                });
                false
            }
            Some(End::Failed(err)) => {
                failure.get_or_insert_with(|| anyhow::anyhow!(describe(&err)));
                false
            }
        };
        if ok {
            let ns = io.start.elapsed().as_nanos().min(u128::from(u64::MAX)) as u64;
            let _ = hist.record(ns.clamp(1, 120_000_000_000));
            if io.read {
                reads += 1;
            } else {
                writes += 1;
            }
            live.fetch_add(1, Ordering::Relaxed);
        }
    }
    if let Some(f) = failure {
        return Err(f);
    }
    Ok(JobResult {
        hist,
        reads,
        writes,
        elapsed: t0.elapsed(),
    })
}

fn cpu_time() -> Duration {
    // SAFETY: getrusage fills the zeroed struct we own.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let tv = |t: libc::timeval| {
        Duration::from_secs(t.tv_sec.max(0) as u64) + Duration::from_micros(t.tv_usec.max(0) as u64)
    };
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// Make sure the target file holds `size` bytes (lay it out if shorter).
fn layout(client: &Client, url: &LwioUrl, size: u64) -> anyhow::Result<()> {
    let export = url.require_export()?;
    let path = format!("{export}/{}", url.path);
    let f = client
        .open(&path, &OpenOptions::read_write().create(true))
        .map_err(|e| ctx(url, e))?;
    let have = f.len().map_err(|e| ctx(url, e))?;
    if have >= size {
        return f.close().map_err(|e| ctx(url, e));
    }
    let pb = super::byte_bar(size - have, "laying out the file");
    let mut rng = Rng::random();
    let mut block = vec![0u8; super::COPY_CHUNK];
    for w in block.chunks_exact_mut(8) {
        w.copy_from_slice(&rng.next().to_le_bytes());
    }
    let mut off = have;
    while off < size {
        if super::interrupted() {
            return Err(super::interrupted_error());
        }
        let n = (size - off).min(block.len() as u64) as usize;
        f.write_at(&block[..n], off).map_err(|e| ctx(url, e))?;
        off += n as u64;
        pb.inc(n as u64);
    }
    pb.finish_and_clear();
    f.close().map_err(|e| ctx(url, e))
}

/// The client options of one job of `bs`-byte I/Os at depth `qd`.
pub fn job_options(bs: usize, qd: usize, completion: Completion) -> ClientOptions {
    let read_chunk = bs.next_multiple_of(4096).clamp(4096, 512 * 1024);
    let chunks = bs.div_ceil(read_chunk);
    let stage_slots = (qd * chunks).clamp(1, (MAX_STAGE_BYTES / read_chunk).max(1));
    ClientOptions {
        completion,
        credits: (qd * chunks).clamp(1, 1024) as u16,
        read_chunk,
        stage_slots,
        write_chunk: bs.clamp(512, WRITE_CHUNK),
        // Every write request in flight is encoded in its own send slot.
        send_slots: (qd * bs.div_ceil(WRITE_CHUNK)).clamp(16, 1024),
        // Polling means polling: a waiter spins up to 10 ms (a 1 MiB read
        // at QD 8 takes milliseconds) before it falls back to INTERRUPT.
        poll_spin: Duration::from_millis(10),
        ..ClientOptions::default()
    }
}

pub fn run(a: BenchArgs) -> anyhow::Result<()> {
    if a.bs == 0 || a.bs > MAX_BS {
        anyhow::bail!("--bs must be between 1 byte and {}", format_size(MAX_BS));
    }
    if a.size < a.bs {
        anyhow::bail!(
            "--size {} is smaller than --bs {}",
            format_size(a.size),
            format_size(a.bs)
        );
    }
    if a.runtime.is_zero() {
        anyhow::bail!("--runtime must be more than 0");
    }
    super::catch_interrupts();
    let embedded = match &a.url {
        Some(_) => None,
        None => Some(Embedded::start(&a)?),
    };
    let url = match (&a.url, &embedded) {
        (Some(u), _) => u.clone(),
        (None, Some(e)) => e.url()?,
        (None, None) => unreachable!("embedded server started above"),
    };
    url.require_export()?;
    let bs = a.bs as usize;
    let qd = a.qd as usize;
    let mut opts = job_options(
        bs,
        qd,
        match a.completion {
            CliCompletion::Poll => Completion::Poll,
            CliCompletion::Interrupt => Completion::Interrupt,
        },
    );
    opts.provider = a.client.provider;
    opts.device = a.client.device.clone();
    let mut client_args = a.client.clone();
    if let Some(e) = &embedded {
        // Log in with the token generated for this run.
        client_args.token_file = Some(e.dir.0.join("token"));
        client_args.no_tls = true;
        client_args.user = None;
    }
    let jobs = a.jobs as usize;
    let mut clients = Vec::with_capacity(jobs);
    for _ in 0..jobs {
        clients.push(connect_data(&url, &client_args, opts.clone())?);
    }
    layout(&clients[0], &url, a.size)?;
    let open = match a.rw {
        RwPattern::Read | RwPattern::Randread => OpenOptions::read_only(),
        _ => OpenOptions::read_write(),
    };
    let export = url.require_export()?.to_string();
    let mut files = Vec::with_capacity(jobs);
    for c in &clients {
        files.push(
            c.open(&format!("{export}/{}", url.path), &open)
                .map_err(|e| ctx(&url, e))?,
        );
    }
    let plan = Plan {
        rw: a.rw,
        bs,
        qd,
        size: a.size,
    };
    let provider = clients[0].provider();
    let credits = clients[0].credits();
    let live = AtomicU64::new(0);
    let stop = AtomicBool::new(false);
    let barrier = Arc::new(std::sync::Barrier::new(jobs + 1));
    let show = super::show_progress() && !a.json;
    let label = format!(
        "{} {} qd{} x{}",
        rw_name(a.rw),
        format_size(a.bs),
        a.qd,
        a.jobs
    );
    let (results, cpu) = std::thread::scope(|s| {
        let handles: Vec<_> = clients
            .iter()
            .zip(&files)
            .map(|(c, f)| {
                let (live, stop, barrier) = (&live, &stop, barrier.clone());
                s.spawn(move || job(c, f, plan, a.runtime, &barrier, live, stop))
            })
            .collect();
        barrier.wait();
        let cpu0 = cpu_time();
        let t0 = Instant::now();
        let pb = if show {
            let pb = indicatif::ProgressBar::new(a.runtime.as_millis() as u64);
            pb.set_style(
                indicatif::ProgressStyle::with_template("{prefix} {bar:30} {msg}")
                    .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
            );
            pb.set_prefix(label.clone());
            pb
        } else {
            indicatif::ProgressBar::hidden()
        };
        let mut last = (Instant::now(), 0u64);
        while !handles.iter().all(|h| h.is_finished()) {
            std::thread::sleep(Duration::from_millis(100));
            if super::interrupted() {
                stop.store(true, Ordering::Relaxed);
            }
            let now = Instant::now();
            if now.duration_since(last.0) >= Duration::from_millis(500) {
                let n = live.load(Ordering::Relaxed);
                let rate = (n - last.1) as f64 / now.duration_since(last.0).as_secs_f64();
                pb.set_message(format!(
                    "{:.0} IOPS, {:.1} MiB/s",
                    rate,
                    rate * a.bs as f64 / 1048576.0
                ));
                last = (now, n);
            }
            pb.set_position(t0.elapsed().as_millis().min(a.runtime.as_millis()) as u64);
        }
        pb.finish_and_clear();
        let results: Vec<anyhow::Result<JobResult>> = handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("a benchmark job failed")))
            })
            .collect();
        (results, cpu_time().saturating_sub(cpu0))
    });
    for f in files {
        let _ = f.close();
    }
    drop(clients);
    if super::interrupted() {
        return Err(super::interrupted_error());
    }
    let mut hist = Histogram::<u64>::new_with_bounds(1, 120_000_000_000, 3)
        .map_err(|e| anyhow::anyhow!("histogram: {e}"))?;
    let (mut reads, mut writes, mut elapsed) = (0u64, 0u64, Duration::ZERO);
    for r in results {
        let r = r?;
        let _ = hist.add(&r.hist);
        reads += r.reads;
        writes += r.writes;
        elapsed = elapsed.max(r.elapsed);
    }
    drop(embedded);
    let ios = reads + writes;
    if ios == 0 {
        anyhow::bail!("no I/O completed in {}", format_duration(a.runtime));
    }
    let secs = elapsed.as_secs_f64().max(1e-9);
    let iops = ios as f64 / secs;
    let bw = iops * a.bs as f64;
    let us = |v: u64| v as f64 / 1000.0;
    let cpu_per_io_us = cpu.as_secs_f64() * 1e6 / ios as f64;
    let target = match &a.url {
        Some(u) => u.to_string(),
        None => "embedded".to_string(),
    };
    let command = equivalent_command(&a);
    let mut out = std::io::stdout().lock();
    if a.json {
        let v = serde_json::json!({
            "command": command,
            "target": target,
            "rw": rw_name(a.rw),
            "bs": a.bs,
            "qd": a.qd,
            "jobs": a.jobs,
            "size": a.size,
            "runtime_s": a.runtime.as_secs_f64(),
            "elapsed_s": secs,
            "completion": completion_name(a.completion),
            "provider": provider,
            "credits": credits,
            "ios": ios,
            "read_ios": reads,
            "write_ios": writes,
            "iops": iops,
            "bandwidth_bytes_per_s": bw,
            "bandwidth_mib_per_s": bw / 1048576.0,
            "lat_us": {
                "min": us(hist.min()),
                "mean": hist.mean() / 1000.0,
                "p50": us(hist.value_at_quantile(0.5)),
                "p99": us(hist.value_at_quantile(0.99)),
                "p99_9": us(hist.value_at_quantile(0.999)),
                "max": us(hist.max()),
            },
            "client_cpu_s": cpu.as_secs_f64(),
            "client_cpu_us_per_io": cpu_per_io_us,
        });
        writeln!(out, "{v}")?;
        return Ok(());
    }
    writeln!(out, "{command}")?;
    writeln!(
        out,
        "  target: {}, provider {provider}, completion {}, credits {credits} per connection",
        if a.url.is_some() {
            target.clone()
        } else {
            "embedded server (child `lwio serve` on 127.0.0.1, temporary file)".into()
        },
        completion_name(a.completion)
    )?;
    writeln!(
        out,
        "  {ios} I/Os in {secs:.2} s (reads {reads}, writes {writes})"
    )?;
    writeln!(
        out,
        "  IOPS {iops:.0}   bandwidth {:.1} MiB/s ({:.1} MB/s)",
        bw / 1048576.0,
        bw / 1e6
    )?;
    writeln!(
        out,
        "  latency us: p50 {:.1}  p99 {:.1}  p99.9 {:.1}  (min {:.1}, mean {:.1}, max {:.1})",
        us(hist.value_at_quantile(0.5)),
        us(hist.value_at_quantile(0.99)),
        us(hist.value_at_quantile(0.999)),
        us(hist.min()),
        hist.mean() / 1000.0,
        us(hist.max())
    )?;
    writeln!(
        out,
        "  client CPU: {cpu_per_io_us:.2} us per I/O ({:.2} s in {secs:.2} s = {:.0}% of one core)",
        cpu.as_secs_f64(),
        cpu.as_secs_f64() / secs * 100.0
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[test]
    fn equivalent_command_round_trips() {
        let cli = crate::cli::Cli::try_parse_from([
            "lwio",
            "bench",
            "--rw",
            "randrw",
            "--bs",
            "8k",
            "--qd",
            "4",
            "--runtime",
            "1500ms",
        ])
        .unwrap();
        let crate::cli::Command::Bench(a) = cli.command else {
            panic!()
        };
        let line = equivalent_command(&a);
        assert_eq!(
            line,
            "lwio bench --rw randrw --bs 8k --qd 4 --jobs 1 --size 64M --runtime 1500ms --completion poll --provider auto"
        );
        let again = crate::cli::Cli::try_parse_from(line.split(' ')).unwrap();
        let crate::cli::Command::Bench(b) = again.command else {
            panic!()
        };
        assert_eq!((b.rw, b.bs, b.qd, b.runtime), (a.rw, a.bs, a.qd, a.runtime));
    }
}
