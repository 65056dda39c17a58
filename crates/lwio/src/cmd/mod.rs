//! The `lwio` commands that use the LWIO data path: `serve`'s RDMA phase
//! ([`serve`]), [`cat`], [`cp`], [`bench`] and the raw verbs benchmark
//! [`rdma_bench`].
//!
//! Data always moves with LWIO I/O operations (READ/WRITE over the RDMA
//! channel); the side channel only logs in, lists, opens, creates, sizes,
//! renames and removes.

pub mod bench;
pub mod cat;
pub mod check_config;
pub mod cp;
pub mod generate;
pub mod mount;
pub mod notify;
pub mod publish;
pub mod rdma_bench;
pub mod serve;
pub mod stats;

use std::io::IsTerminal;
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::time::Duration;

use lwio_proto::status::{STATUS_CANCELLED, STATUS_DISK_FULL, STATUS_END_OF_FILE};

use crate::cli::ClientArgs;
use lwio_client::url::LwioUrl;
use lwio_client::{ClientOptions, Completion, ProviderChoice};

/// Bytes per I/O call of `cat` and `cp` (the client splits each into
/// pipelined requests of the negotiated size).
pub const COPY_CHUNK: usize = 4 << 20;

/// Connect the data-path client to the server of `url` (any export).
pub fn connect_data(
    url: &LwioUrl,
    args: &ClientArgs,
    mut opts: ClientOptions,
) -> anyhow::Result<lwio_client::Client> {
    let mut side = crate::cli::client_options(args)?;
    side.client_name = opts.client_name.clone();
    opts.connect_timeout = args.connect_timeout;
    opts.provider = args.provider;
    opts.device = args.device.clone();
    if let Some(d) = args.busy_poll {
        opts.busy_poll = d;
    }
    lwio_client::Client::connect_with(&url.authority(), &side, opts)
        .map_err(|e| anyhow::anyhow!(describe(&e)))
}

/// Client options for bulk transfers (`cat`, `cp`): big reads, many in
/// flight. One-shot commands do not reconnect: a lost server fails the
/// copy at once, with one line (docs/reconnect.md).
pub fn bulk_options() -> ClientOptions {
    ClientOptions {
        reconnect: false,
        completion: Completion::Interrupt,
        provider: ProviderChoice::Auto,
        credits: 32,
        read_chunk: 512 * 1024,
        stage_slots: 16,
        write_chunk: 16 * 1024,
        send_slots: 64,
        ..ClientOptions::default()
    }
}

/// One line a person can act on, for a client error.
pub fn describe(e: &lwio_client::Error) -> String {
    use lwio_client::Error as E;
    match e {
        E::Unreachable(m) => m.clone(),
        // The side channel's own messages name the path and the reason.
        E::WrongToken(m) | E::NotFound(m) | E::AccessDenied(m) | E::ReadOnly(m) | E::Side(m) => {
            m.clone()
        }
        E::ConnectionLost(m) => format!("the server went away: {m}"),
        // The server's own reason for refusing ("server busy: …").
        E::Busy(m) => m.clone(),
        E::Status { what, status }
            if *status == STATUS_DISK_FULL && what.contains(".lwio-mem/") =>
        {
            format!("{what}: past the end of the memory object (its size is fixed)")
        }
        E::Status { what, status } if *status == lwio_proto::status::STATUS_FILE_DELETED => {
            format!("{what}: the memory object was withdrawn by its publisher")
        }
        E::Status { what, status } if *status == STATUS_DISK_FULL => {
            format!("{what}: no space left on the server's disk (STATUS_DISK_FULL)")
        }
        E::Status { what, status } if *status == STATUS_END_OF_FILE => {
            format!("{what}: unexpected end of file")
        }
        E::Status { what, status } if *status == STATUS_CANCELLED => {
            format!("{what}: cancelled")
        }
        E::Rdma(m) if m.contains("unavailable") || m.contains("no RDMA") => {
            format!("no usable RDMA provider: {m}")
        }
        other => other.to_string(),
    }
    .replace('\n', " ")
}

/// A client error with what was being done.
pub fn ctx(what: impl std::fmt::Display, e: lwio_client::Error) -> anyhow::Error {
    let what = what.to_string();
    let d = describe(&e);
    if d.contains(&what) {
        return anyhow::anyhow!(d);
    }
    // "EXPORT/PATH: reason" from the server: the URL already names it.
    if let Some((head, rest)) = d.split_once(": ") {
        if !head.is_empty() && what.ends_with(head) {
            return anyhow::anyhow!("{what}: {rest}");
        }
    }
    anyhow::anyhow!("{what}: {d}")
}

// ------------------------------------------------------------ interruption

static INTERRUPTED: AtomicBool = AtomicBool::new(false);
static SIGNAL: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_signal(sig: libc::c_int) {
    // Only async-signal-safe work: two atomic stores.
    SIGNAL.store(sig, Ordering::SeqCst);
    INTERRUPTED.store(true, Ordering::SeqCst);
}

/// Catch SIGINT and SIGTERM (once: a second one kills the process as usual)
/// so a command can clean up; see [`interrupted`].
pub fn catch_interrupts() {
    for sig in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: installs a handler that only stores to atomics; the
        // sigaction struct is fully initialised (zeroed, then set).
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
            sa.sa_flags = libc::SA_RESETHAND;
            libc::sigemptyset(&mut sa.sa_mask);
            libc::sigaction(sig, &sa, std::ptr::null_mut());
        }
    }
}

/// Whether SIGINT/SIGTERM arrived since [`catch_interrupts`].
pub fn interrupted() -> bool {
    INTERRUPTED.load(Ordering::SeqCst)
}

/// The error for an interrupted command.
pub fn interrupted_error() -> anyhow::Error {
    let name = match SIGNAL.load(Ordering::SeqCst) {
        libc::SIGTERM => "SIGTERM",
        _ => "SIGINT",
    };
    anyhow::anyhow!("interrupted by {name}")
}

// ---------------------------------------------------------------- progress

/// Whether to draw progress (stderr is a terminal).
pub fn show_progress() -> bool {
    std::io::stderr().is_terminal()
}

/// A byte-count progress bar on stderr, hidden when stderr is not a terminal.
pub fn byte_bar(total: u64, label: &str) -> indicatif::ProgressBar {
    if !show_progress() {
        return indicatif::ProgressBar::hidden();
    }
    let pb = indicatif::ProgressBar::new(total);
    let style = indicatif::ProgressStyle::with_template(
        "{msg:30!} {bar:30} {bytes:>10}/{total_bytes:<10} {binary_bytes_per_sec:>12} {eta:>4}",
    )
    .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar());
    pb.set_style(style);
    pb.set_message(label.to_string());
    pb.enable_steady_tick(Duration::from_millis(200));
    pb
}

/// A short random hex string (temporary names).
pub fn random_suffix() -> String {
    let mut b = [0u8; 4];
    lwio_side::random_bytes(&mut b);
    b.iter().map(|x| format!("{x:02x}")).collect()
}

// ----------------------------------------------------------------- copying

/// A file read at offsets (remote or local).
pub trait ReadAt: Sync {
    /// Read into `buf` at `off`; 0 at end of file.
    fn read_at(&self, buf: &mut [u8], off: u64) -> anyhow::Result<usize>;
}

/// A remote file opened over the data path.
pub struct RemoteReader<'a> {
    pub file: &'a lwio_client::File,
    /// For messages (the URL).
    pub name: String,
}

impl ReadAt for RemoteReader<'_> {
    fn read_at(&self, buf: &mut [u8], off: u64) -> anyhow::Result<usize> {
        self.file.read_at(buf, off).map_err(|e| ctx(&self.name, e))
    }
}

/// A local file.
pub struct LocalReader<'a> {
    pub file: &'a std::fs::File,
    pub name: String,
}

impl ReadAt for LocalReader<'_> {
    fn read_at(&self, buf: &mut [u8], off: u64) -> anyhow::Result<usize> {
        use std::os::unix::fs::FileExt;
        loop {
            match self.file.read_at(buf, off) {
                Ok(n) => return Ok(n),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => anyhow::bail!("{}: {}", self.name, lwio_side::Error::from_io(&e, "read")),
            }
        }
    }
}

/// Copy `src` from offset 0 to its end into `sink(data, offset)` (which
/// returns whether to go on). A reader thread keeps up to two chunks of
/// [`COPY_CHUNK`] ahead of the sink. Stops with an error on SIGINT/SIGTERM
/// (after [`catch_interrupts`]). Returns the bytes passed to the sink.
pub fn pump(
    src: &dyn ReadAt,
    pb: &indicatif::ProgressBar,
    mut sink: impl FnMut(&[u8], u64) -> anyhow::Result<bool>,
) -> anyhow::Result<u64> {
    type Chunk = anyhow::Result<(Vec<u8>, usize, u64)>;
    let (tx, rx) = std::sync::mpsc::sync_channel::<Chunk>(2);
    let (back_tx, back_rx) = std::sync::mpsc::channel::<Vec<u8>>();
    std::thread::scope(|s| {
        s.spawn(move || {
            let mut off = 0u64;
            loop {
                if interrupted() {
                    let _ = tx.send(Err(interrupted_error()));
                    return;
                }
                let mut buf = back_rx.try_recv().unwrap_or_else(|_| vec![0u8; COPY_CHUNK]);
                match src.read_at(&mut buf, off) {
                    Ok(0) => return,
                    Ok(n) => {
                        if tx.send(Ok((buf, n, off))).is_err() {
                            return;
                        }
                        off += n as u64;
                    }
                    Err(e) => {
                        let _ = tx.send(Err(e));
                        return;
                    }
                }
            }
        });
        let res = (|| {
            let mut total = 0u64;
            for item in rx.iter() {
                let (buf, n, off) = item?;
                if interrupted() {
                    return Err(interrupted_error());
                }
                if !sink(&buf[..n], off)? {
                    break;
                }
                total += n as u64;
                pb.inc(n as u64);
                let _ = back_tx.send(buf);
            }
            if interrupted() {
                return Err(interrupted_error());
            }
            Ok(total)
        })();
        // Unblock the reader if the sink stopped early.
        drop(rx);
        res
    })
}
