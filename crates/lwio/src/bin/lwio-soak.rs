//! `lwio-soak`: the fault-injection soak of issue 14 (run by
//! `bench/soak.sh`, which mounts a small tmpfs for the export).
//!
//! Starts `lwio serve` (soft provider, plain TCP side channel) on the
//! export, runs `--clients` client threads with a mixed workload (random
//! 1 B–1 MiB writes and reads on files of their own), and meanwhile, every
//! 2–4 s and in shuffled rounds, injects a fault: SIGKILL + restart of the
//! server, `ss -K` of its connections, SIGSTOP for 2 s, the export's file
//! system filled for 1.5 s.
//!
//! Each client keeps the expected bytes of every **acknowledged** range
//! (docs/durability.md §1: the write returned success; none of these
//! faults crashes the host, so acknowledged = in the page cache = kept). A
//! failed write makes its range unknown and is retried (same bytes, same
//! offset) after a delay; a failed connection makes the soak re-create the
//! client. Reads compare every acknowledged byte they cover; at the end
//! every file is read back through lwio and from the export directly.
//!
//! Prints one line — operations, faults, reconnects, bytes acknowledged,
//! bytes lost — and exits 1 if any acknowledged byte was lost (2 if the
//! harness itself failed).

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Parser;
use lwio::cmd::bench::Rng;
use lwio_client::{Client, ClientOptions, ClientTls, Completion, Error, File, OpenOptions};
use lwio_proto::status::STATUS_DISK_FULL;

#[derive(Parser, Debug)]
#[command(about = "lwio fault-injection soak (issue 14); see bench/soak.sh")]
struct Args {
    /// How long the workload runs under faults, then the read-back
    /// (default: $LWIO_SOAK_DURATION, else 150s).
    #[arg(long, value_parser = duration)]
    duration: Option<Duration>,
    /// The export's directory (a small file system of its own: it is
    /// filled up as a fault).
    #[arg(long)]
    export_dir: PathBuf,
    /// The `lwio` binary to serve with (default: next to this one).
    #[arg(long)]
    lwio: Option<PathBuf>,
    #[arg(long, default_value_t = 4)]
    clients: usize,
    /// Files per client, and the size each may grow to.
    #[arg(long, default_value_t = 2)]
    files: usize,
    #[arg(long, default_value = "8MiB", value_parser = size)]
    file_size: u64,
    /// Mean time between faults (each is 0.66–1.33 × this apart).
    #[arg(long, default_value = "3s", value_parser = duration)]
    fault_every: Duration,
    /// Seed of the workload and of the fault order (default: random,
    /// printed).
    #[arg(long)]
    seed: Option<u64>,
    /// Where the server's token and log go (default: a temp directory).
    #[arg(long)]
    work_dir: Option<PathBuf>,
}

fn duration(s: &str) -> Result<Duration, String> {
    lwio_side::units::parse_duration(s).map_err(|e| e.to_string())
}

fn size(s: &str) -> Result<u64, String> {
    lwio_side::units::parse_size(s).map_err(|e| e.to_string())
}

/// The workload's draws, reproducible from `--seed`.
trait Draw {
    fn below(&mut self, n: u64) -> u64;
    /// 1..=max, log-uniform (small and large transfers alike).
    fn len(&mut self, max: u64) -> u64;
    fn fill(&mut self, buf: &mut [u8]);
}

impl Draw for Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    fn len(&mut self, max: u64) -> u64 {
        let bits = 64 - max.leading_zeros() as u64;
        let b = self.below(bits) + 1;
        (self.below(1 << b) + 1).min(max)
    }
    fn fill(&mut self, buf: &mut [u8]) {
        for c in buf.chunks_mut(8) {
            let v = self.next().to_le_bytes();
            c.copy_from_slice(&v[..c.len()]);
        }
    }
}

#[derive(Default)]
struct Counters {
    ops: AtomicU64,
    reconnects: AtomicU64,
    acked: AtomicU64,
    write_errors: AtomicU64,
    read_errors: AtomicU64,
    syncs: AtomicU64,
}

// ------------------------------------------------------------------ server

struct Server {
    lwio: PathBuf,
    export: PathBuf,
    token_file: PathBuf,
    log: PathBuf,
    side_port: u16,
    rdma_port: u16,
    child: Option<Child>,
}

fn free_port() -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

impl Server {
    fn url(&self) -> String {
        format!("lwio://127.0.0.1:{}/soak", self.side_port)
    }

    fn pid(&self) -> Option<libc::pid_t> {
        self.child.as_ref().map(|c| c.id() as libc::pid_t)
    }

    fn start(&mut self) -> anyhow::Result<()> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)?;
        let child = Command::new(&self.lwio)
            .arg("serve")
            .arg("--export")
            .arg(format!("soak={}", self.export.display()))
            .arg("--listen")
            .arg(format!("127.0.0.1:{}", self.side_port))
            .arg("--rdma-listen")
            .arg(format!("127.0.0.1:{}", self.rdma_port))
            .arg("--token-file")
            .arg(&self.token_file)
            .args(["--no-tls", "--provider", "soft"])
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()?;
        self.child = Some(child);
        // Ready when the side channel accepts (bounded).
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(15) {
            if std::net::TcpStream::connect(("127.0.0.1", self.side_port)).is_ok() {
                return Ok(());
            }
            if let Some(st) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                anyhow::bail!(
                    "lwio serve exited at start: {st} (log {})",
                    self.log.display()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        anyhow::bail!(
            "lwio serve not listening after 15 s (log {})",
            self.log.display()
        )
    }

    fn signal(&self, sig: libc::c_int) {
        if let Some(pid) = self.pid() {
            // SAFETY: kill(2) on the pid of our own child process (not yet
            // reaped: `child` is still held); no memory is involved.
            unsafe { libc::kill(pid, sig) };
        }
    }

    fn kill(&mut self) {
        self.signal(libc::SIGCONT);
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

// ------------------------------------------------------------------ faults

#[derive(Debug, Clone, Copy)]
enum Fault {
    Kill,
    Cut,
    Pause,
    Fill,
}

const FAULTS: [Fault; 4] = [Fault::Kill, Fault::Cut, Fault::Pause, Fault::Fill];

/// Fill the export's file system until ENOSPC, hold it full, free it.
fn fill_disk(dir: &Path, hold: Duration) -> anyhow::Result<u64> {
    let path = dir.join(".soak-filler");
    let mut f = std::fs::File::create(&path)?;
    let chunk = vec![0x5Au8; 1 << 20];
    let mut n = 0u64;
    loop {
        match f.write(&chunk) {
            Ok(0) => break,
            Ok(k) => n += k as u64,
            Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => break,
            Err(e) => {
                let _ = std::fs::remove_file(&path);
                return Err(e.into());
            }
        }
        if n > (64 << 30) {
            let _ = std::fs::remove_file(&path);
            anyhow::bail!(
                "{} is not a small file system: stopped filling at 64 GiB",
                dir.display()
            );
        }
    }
    std::thread::sleep(hold);
    drop(f);
    std::fs::remove_file(&path)?;
    Ok(n)
}

/// `ss -K` every TCP connection of the server's two ports.
fn cut(s: &Server) -> anyhow::Result<()> {
    let filter = format!("( sport = :{} or sport = :{} )", s.side_port, s.rdma_port);
    let out = Command::new("ss")
        .args(["-K", "-t", "-n", "state", "established"])
        .arg(&filter)
        .output()?;
    if !out.status.success() {
        anyhow::bail!(
            "ss -K failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

// ----------------------------------------------------------------- clients

/// Expected contents of one file: the bytes of every acknowledged range.
struct Model {
    name: String,
    data: Vec<u8>,
    known: Vec<bool>,
    /// Acknowledged bytes some read found wrong (each counted once).
    bad: Vec<bool>,
}

impl Model {
    fn forget(&mut self, off: usize, len: usize) {
        self.known[off..off + len].fill(false);
    }
    fn learn(&mut self, off: usize, bytes: &[u8]) {
        self.data[off..off + bytes.len()].copy_from_slice(bytes);
        self.known[off..off + bytes.len()].fill(true);
    }
    /// Mark the acknowledged bytes of `[off, off+want)` that `got` (what
    /// was read, maybe short) does not match; returns how many.
    fn mismatches(&mut self, off: usize, want: usize, got: &[u8]) -> u64 {
        let mut n = 0;
        for i in 0..want {
            if self.known[off + i] && got.get(i) != Some(&self.data[off + i]) {
                self.bad[off + i] = true;
                n += 1;
            }
        }
        n
    }
    fn lost(&self) -> u64 {
        self.bad.iter().filter(|b| **b).count() as u64
    }
}

struct Conn {
    /// Held for its connection (the files use it too).
    client: Client,
    files: Vec<File>,
}

struct Worker {
    id: usize,
    url: String,
    token: String,
    models: Vec<Model>,
    conn: Option<Conn>,
    connected_once: bool,
    rng: Rng,
    c: Arc<Counters>,
    /// Failed writes to send again: (file, offset, bytes).
    retry: Vec<(usize, usize, Vec<u8>)>,
    log: Arc<Mutex<Vec<String>>>,
}

/// Whether an error means the client's connection is gone (re-create it).
fn connection_gone(e: &Error) -> bool {
    !matches!(e, Error::Status { .. } | Error::InvalidArgument(_))
}

impl Worker {
    fn note(&self, m: String) {
        let mut l = self.log.lock().unwrap_or_else(|e| e.into_inner());
        if l.len() < 20 {
            l.push(m);
        }
    }

    fn connect(&mut self) -> Result<(), Error> {
        if self.conn.is_some() {
            return Ok(());
        }
        let opts = ClientOptions {
            completion: if self.id.is_multiple_of(2) {
                Completion::Interrupt
            } else {
                Completion::Poll
            },
            credits: 16,
            op_timeout: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(5),
            // Its server runs with --no-tls.
            tls: Some(ClientTls::Off),
            ..ClientOptions::default()
        };
        let client = Client::connect(&self.url, Some(&self.token), opts)?;
        let mut files = Vec::new();
        for m in &self.models {
            files.push(client.open(&m.name, &OpenOptions::read_write().create(true))?);
        }
        if self.connected_once {
            // A client the soak had to make again (the library's own
            // reconnect gave up within op_timeout).
            self.c.reconnects.fetch_add(1, Ordering::Relaxed);
        }
        self.connected_once = true;
        self.conn = Some(Conn { client, files });
        Ok(())
    }

    /// Count the library's reconnects of the client about to be dropped.
    fn drop_conn(&mut self) {
        if let Some(c) = self.conn.take() {
            self.c
                .reconnects
                .fetch_add(c.client.reconnects(), Ordering::Relaxed);
        }
    }

    fn failed(&mut self, e: &Error) {
        if connection_gone(e) {
            self.drop_conn();
        }
        std::thread::sleep(Duration::from_millis(100 + self.rng.below(200)));
    }

    fn write(&mut self, fi: usize, off: usize, data: Vec<u8>) {
        self.c.ops.fetch_add(1, Ordering::Relaxed);
        // Unknown from the moment it is sent until it is acknowledged.
        self.models[fi].forget(off, data.len());
        let r = match self.connect() {
            Ok(()) => {
                let f = &self.conn.as_ref().expect("connected").files[fi];
                f.write_at(&data, off as u64)
            }
            Err(e) => Err(e),
        };
        match r {
            Ok(n) if n == data.len() => {
                self.models[fi].learn(off, &data);
                self.c.acked.fetch_add(n as u64, Ordering::Relaxed);
            }
            Ok(n) => {
                self.note(format!(
                    "client {}: short write {n} of {}",
                    self.id,
                    data.len()
                ));
                self.c.write_errors.fetch_add(1, Ordering::Relaxed);
                self.retry.push((fi, off, data));
            }
            Err(e) => {
                self.c.write_errors.fetch_add(1, Ordering::Relaxed);
                if !matches!(&e, Error::Status { status, .. } if *status == STATUS_DISK_FULL)
                    && !connection_gone(&e)
                {
                    self.note(format!("client {}: write: {e}", self.id));
                }
                self.failed(&e);
                self.retry.push((fi, off, data));
            }
        }
    }

    /// Read `[off, off+len)` and compare the acknowledged bytes; false if
    /// the read itself failed.
    fn read_check(&mut self, fi: usize, off: usize, len: usize) -> bool {
        self.c.ops.fetch_add(1, Ordering::Relaxed);
        let r = self.connect().and_then(|()| {
            let f = &self.conn.as_ref().expect("connected").files[fi];
            let mut buf = vec![0u8; len];
            let mut n = 0;
            while n < len {
                match f.read_at(&mut buf[n..], (off + n) as u64)? {
                    0 => break,
                    k => n += k,
                }
            }
            buf.truncate(n);
            Ok(buf)
        });
        match r {
            Ok(got) => {
                let bad = self.models[fi].mismatches(off, len, &got);
                if bad > 0 {
                    self.note(format!(
                        "client {}: {} [{off}, +{len}): {bad} acknowledged bytes differ (read {} bytes)",
                        self.id,
                        self.models[fi].name,
                        got.len()
                    ));
                }
                true
            }
            Err(e) => {
                self.c.read_errors.fetch_add(1, Ordering::Relaxed);
                self.failed(&e);
                false
            }
        }
    }

    fn run(&mut self, stop: &AtomicBool) {
        self.run_until(stop);
        self.drop_conn();
    }

    fn run_until(&mut self, stop: &AtomicBool) {
        let size = self.models[0].data.len();
        while !stop.load(Ordering::Relaxed) {
            if let Some((fi, off, data)) = self.retry.pop() {
                self.write(fi, off, data);
                continue;
            }
            let fi = self.rng.below(self.models.len() as u64) as usize;
            let len = self.rng.len(1 << 20) as usize;
            let off = self.rng.below((size - len) as u64 + 1) as usize;
            match self.rng.below(20) {
                0 => {
                    self.c.ops.fetch_add(1, Ordering::Relaxed);
                    let r = self.connect().and_then(|()| {
                        self.conn.as_ref().expect("connected").files[fi].sync_data()
                    });
                    match r {
                        Ok(()) => {
                            self.c.syncs.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(e) => self.failed(&e),
                    }
                }
                1..=10 => {
                    let mut data = vec![0u8; len];
                    self.rng.fill(&mut data);
                    self.write(fi, off, data);
                }
                _ => {
                    self.read_check(fi, off, len);
                }
            }
        }
    }

    /// After the faults: finish the retries, then read every file back.
    fn finish(&mut self, deadline: Instant) -> bool {
        while let Some((fi, off, data)) = self.retry.pop() {
            if Instant::now() > deadline {
                return false;
            }
            self.write(fi, off, data);
        }
        let size = self.models[0].data.len();
        for fi in 0..self.models.len() {
            let mut off = 0;
            while off < size {
                let len = (1 << 20).min(size - off);
                if !self.read_check(fi, off, len) {
                    if Instant::now() > deadline {
                        return false;
                    }
                    continue;
                }
                off += len;
            }
        }
        true
    }
}

// -------------------------------------------------------------------- main

fn main() {
    let args = Args::parse();
    match soak(&args) {
        Ok(lost) => std::process::exit(if lost > 0 { 1 } else { 0 }),
        Err(e) => {
            eprintln!("lwio-soak: error: {e:#}");
            std::process::exit(2);
        }
    }
}

fn soak(a: &Args) -> anyhow::Result<u64> {
    let run_for = match a.duration {
        Some(d) => d,
        None => match std::env::var("LWIO_SOAK_DURATION") {
            Ok(v) => duration(&v).map_err(|e| anyhow::anyhow!("LWIO_SOAK_DURATION: {e}"))?,
            Err(_) => Duration::from_secs(150),
        },
    };
    let seed = a.seed.unwrap_or_else(|| {
        let mut b = [0u8; 8];
        let _ = getrandom::fill(&mut b);
        u64::from_le_bytes(b) | 1
    });
    let lwio = match &a.lwio {
        Some(p) => p.clone(),
        None => std::env::current_exe()?.with_file_name("lwio"),
    };
    let tmp = tempfile_dir(a.work_dir.as_deref())?;
    let token = format!(
        "soak-{seed:016x}-{:016x}",
        Rng::seeded(seed ^ 0xdead_beef).next()
    );
    let token_file = tmp.join("token");
    std::fs::write(&token_file, format!("{token}\n"))?;
    let file_size = usize::try_from(a.file_size)?;
    anyhow::ensure!(file_size >= 1 << 20, "--file-size must be at least 1 MiB");
    let mut server = Server {
        lwio,
        export: a.export_dir.clone(),
        token_file,
        log: tmp.join("server.log"),
        side_port: free_port()?,
        rdma_port: free_port()?,
        child: None,
    };
    eprintln!(
        "lwio-soak: seed {seed}, {} clients × {} files of {} B, {:?} under faults (kill, cut, pause, fill) every ~{:?}; \
         reconnects = the clients' own (Client::reconnects) + clients re-created by the soak; server log {}",
        a.clients,
        a.files,
        file_size,
        run_for,
        a.fault_every,
        server.log.display()
    );
    server.start()?;
    let c = Arc::new(Counters::default());
    let stop = Arc::new(AtomicBool::new(false));
    let log = Arc::new(Mutex::new(Vec::new()));
    let mut workers = Vec::new();
    for id in 0..a.clients {
        let mut w = Worker {
            id,
            url: server.url(),
            token: token.clone(),
            models: (0..a.files)
                .map(|j| Model {
                    name: format!("c{id}-f{j}.dat"),
                    data: vec![0; file_size],
                    known: vec![false; file_size],
                    bad: vec![false; file_size],
                })
                .collect(),
            conn: None,
            connected_once: false,
            rng: Rng::seeded(
                seed.wrapping_add(0x9E37_79B9_7F4A_7C15u64.wrapping_mul(id as u64 + 1)),
            ),
            c: c.clone(),
            retry: Vec::new(),
            log: log.clone(),
        };
        let stop = stop.clone();
        workers.push(std::thread::spawn(move || {
            w.run(&stop);
            w
        }));
    }

    // The harness: shuffled rounds of the four faults.
    let mut rng = Rng::seeded(seed ^ 0x5eed);
    let mut counts = [0u64; 4];
    let mut cut_unsupported = None;
    let end = Instant::now() + run_for;
    let mut round: Vec<usize> = Vec::new();
    let result = (|| -> anyhow::Result<()> {
        loop {
            let gap = a
                .fault_every
                .mul_f64(0.66 + 0.67 * (rng.below(1000) as f64 / 1000.0));
            if Instant::now() + gap >= end {
                std::thread::sleep(end.saturating_duration_since(Instant::now()));
                return Ok(());
            }
            std::thread::sleep(gap);
            if round.is_empty() {
                round = (0..FAULTS.len()).collect();
                for i in (1..round.len()).rev() {
                    round.swap(i, rng.below(i as u64 + 1) as usize);
                }
            }
            let k = round.pop().expect("refilled");
            match FAULTS[k] {
                Fault::Kill => {
                    server.kill();
                    std::thread::sleep(Duration::from_millis(300));
                    server.start()?;
                }
                Fault::Cut => {
                    if let Err(e) = cut(&server) {
                        cut_unsupported.get_or_insert(e.to_string());
                        continue;
                    }
                }
                Fault::Pause => {
                    server.signal(libc::SIGSTOP);
                    std::thread::sleep(Duration::from_secs(2));
                    server.signal(libc::SIGCONT);
                }
                Fault::Fill => {
                    fill_disk(&a.export_dir, Duration::from_millis(1500))?;
                }
            }
            counts[k] += 1;
        }
    })();
    stop.store(true, Ordering::Relaxed);
    server.signal(libc::SIGCONT);
    let _ = std::fs::remove_file(a.export_dir.join(".soak-filler"));
    let mut done = Vec::new();
    for w in workers {
        done.push(
            w.join()
                .map_err(|_| anyhow::anyhow!("a client thread panicked"))?,
        );
    }
    if let Err(e) = result {
        server.kill();
        return Err(e);
    }
    // Read-back: through lwio (bounded), then straight from the export.
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut complete = true;
    for w in &mut done {
        complete &= w.finish(deadline);
    }
    let lwio_lost: u64 = done.iter().flat_map(|w| &w.models).map(Model::lost).sum();
    let mut fs_lost = 0;
    for w in &mut done {
        for m in &mut w.models {
            let mut got = Vec::new();
            if let Ok(mut f) = std::fs::File::open(a.export_dir.join(&m.name)) {
                f.read_to_end(&mut got)?;
            }
            let len = m.data.len();
            fs_lost += m.mismatches(0, len, &got);
        }
    }
    // Distinct acknowledged bytes found wrong anywhere.
    let lost: u64 = done.iter().flat_map(|w| &w.models).map(Model::lost).sum();
    for w in &mut done {
        w.conn = None;
    }
    server.kill();
    for m in log.lock().unwrap_or_else(|e| e.into_inner()).iter() {
        eprintln!("lwio-soak: {m}");
    }
    if let Some(e) = &cut_unsupported {
        eprintln!("lwio-soak: connection cuts not injected: {e}");
    }
    anyhow::ensure!(complete, "the final read-back did not finish within 120 s");
    let faults: u64 = counts.iter().sum();
    println!(
        "lwio-soak: operations {}, faults injected {faults} (kill {}, cut {}, pause {}, fill {}), reconnects {}, bytes acknowledged {}, bytes lost {lost}",
        c.ops.load(Ordering::Relaxed),
        counts[0],
        counts[1],
        counts[2],
        counts[3],
        c.reconnects.load(Ordering::Relaxed),
        c.acked.load(Ordering::Relaxed),
    );
    eprintln!(
        "lwio-soak: write errors {}, read errors {}, syncs {}, wrong through lwio {lwio_lost}, on the export {fs_lost}",
        c.write_errors.load(Ordering::Relaxed),
        c.read_errors.load(Ordering::Relaxed),
        c.syncs.load(Ordering::Relaxed),
    );
    Ok(lost)
}

/// `dir` or a fresh directory under the system's temp directory.
fn tempfile_dir(dir: Option<&Path>) -> anyhow::Result<PathBuf> {
    let p = match dir {
        Some(d) => d.to_path_buf(),
        None => std::env::temp_dir().join(format!("lwio-soak-{}", std::process::id())),
    };
    std::fs::create_dir_all(&p)?;
    Ok(p)
}
