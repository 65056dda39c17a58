//! `lwio mount`: an lwio export as a POSIX file system, on FUSE.
//!
//! Namespace operations (lookup, getattr, mkdir, rename, …) go over the
//! client's side-channel session; file data moves over the LWIO data path
//! (READ and WRITE on RDMA), never over the side channel. See
//! docs/mount.md for the semantics, the options and what a second client
//! sees.
//!
//! The file system itself is [`fs::LwioFs`]; [`mount`] starts a FUSE
//! session for it on a mount point and returns a [`Mounted`] handle that
//! unmounts it.

/// Errors as errno values (the client library's mapping).
pub use lwio_client::errno;
mod caller;
pub mod fs;
mod inodes;
mod leases;
pub mod options;
mod watcher;

use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

pub use options::{MountConfig, OptionError};

/// Counters of a mount (what it served and how).
#[derive(Debug, Default)]
pub struct Stats {
    /// FUSE lookups served.
    pub lookups: AtomicU64,
    /// Side-channel calls made (each is one round trip to the server).
    pub side_calls: AtomicU64,
    /// READ calls over the data path, and their bytes.
    pub reads: AtomicU64,
    pub read_bytes: AtomicU64,
    /// WRITE calls over the data path, and their bytes.
    pub writes: AtomicU64,
    pub write_bytes: AtomicU64,
    /// Files opened (side-channel open + RDMA register).
    pub opens: AtomicU64,
    /// Lookups, attributes and listings answered from a directory lease,
    /// with no round trip.
    pub lease_hits: AtomicU64,
    /// Directory leases granted to this mount.
    pub leases_granted: AtomicU64,
    /// Lease breaks received (another client changed a leased directory).
    pub lease_breaks: AtomicU64,
    /// FUSE requests by kind: how many, and the time spent serving them.
    pub ops: OpStats,
}

/// Kinds of FUSE request counted in [`OpStats`].
#[derive(Debug, Clone, Copy)]
pub enum Op {
    Lookup,
    Getattr,
    Setattr,
    Open,
    Create,
    Read,
    Write,
    Flush,
    Release,
    Fsync,
    Opendir,
    Readdir,
    Remove,
    Rename,
    Mkdir,
    Lock,
    Lseek,
    Fallocate,
    Statfs,
    Other,
}

const OP_NAMES: [&str; 20] = [
    "lookup",
    "getattr",
    "setattr",
    "open",
    "create",
    "read",
    "write",
    "flush",
    "release",
    "fsync",
    "opendir",
    "readdir",
    "remove",
    "rename",
    "mkdir",
    "lock",
    "lseek",
    "fallocate",
    "statfs",
    "other",
];

/// Counts and total service time of FUSE requests, by [`Op`].
#[derive(Debug, Default)]
pub struct OpStats {
    count: [AtomicU64; 20],
    nanos: [AtomicU64; 20],
}

/// Times one request; counted when dropped.
pub(crate) struct OpTimer<'a>(&'a OpStats, Op, std::time::Instant);

impl Drop for OpTimer<'_> {
    fn drop(&mut self) {
        let i = self.1 as usize;
        Stats::add(&self.0.count[i], 1);
        Stats::add(&self.0.nanos[i], self.2.elapsed().as_nanos() as u64);
    }
}

impl OpStats {
    pub(crate) fn time(&self, op: Op) -> OpTimer<'_> {
        OpTimer(self, op, std::time::Instant::now())
    }

    /// (requests, total time) of one kind.
    pub fn get(&self, op: Op) -> (u64, std::time::Duration) {
        let i = op as usize;
        (
            self.count[i].load(Ordering::Relaxed),
            std::time::Duration::from_nanos(self.nanos[i].load(Ordering::Relaxed)),
        )
    }

    /// "getattr 120 (35 µs avg), …" for the kinds served at least once.
    pub fn summary(&self) -> String {
        let mut v = Vec::new();
        for (i, name) in OP_NAMES.iter().enumerate() {
            let n = self.count[i].load(Ordering::Relaxed);
            if let Some(us) = (self.nanos[i].load(Ordering::Relaxed) / 1000).checked_div(n) {
                v.push(format!("{name} {n} ({us} µs avg)"));
            }
        }
        v.join(", ")
    }
}

impl Stats {
    pub(crate) fn add(c: &AtomicU64, n: u64) {
        c.fetch_add(n, Ordering::Relaxed);
    }

    /// One line for logs.
    pub fn summary(&self) -> String {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        format!(
            "{} lookups, {} side-channel calls, {} opens, {} reads ({} bytes), {} writes ({} bytes), {} answers from leases, {} leases, {} breaks; requests: {}",
            g(&self.lookups),
            g(&self.side_calls),
            g(&self.opens),
            g(&self.reads),
            g(&self.read_bytes),
            g(&self.writes),
            g(&self.write_bytes),
            g(&self.lease_hits),
            g(&self.leases_granted),
            g(&self.lease_breaks),
            self.ops.summary()
        )
    }
}

/// A mounted file system. Dropping it unmounts.
pub struct Mounted {
    mountpoint: PathBuf,
    unmounter: Option<fuser::SessionUnmounter>,
    thread: Option<JoinHandle<io::Result<()>>>,
    stats: Arc<Stats>,
    /// Dropped with the mount: stops the keepalive thread.
    _keepalive: Option<std::sync::mpsc::Sender<()>>,
    /// To end `-o hard` waits when unmounting.
    closing: Arc<fs::Shared>,
}

impl Mounted {
    /// Where it is mounted.
    pub fn mountpoint(&self) -> &Path {
        &self.mountpoint
    }

    /// The mount's counters.
    pub fn stats(&self) -> &Arc<Stats> {
        &self.stats
    }

    /// Whether the FUSE session ended (unmounted from outside with
    /// `fusermount3 -u` or `umount`, or the kernel connection aborted).
    pub fn is_finished(&self) -> bool {
        self.thread.as_ref().is_none_or(|t| t.is_finished())
    }

    /// Unmount (the kernel flushes and releases every open file first: our
    /// writes are synchronous, so nothing dirty stays behind) and wait for
    /// the session to end.
    pub fn unmount(mut self) -> io::Result<()> {
        self.unmount_inner()
    }

    /// Wait until the session ends (an unmount from outside).
    pub fn join(mut self) -> io::Result<()> {
        let r = match self.thread.take() {
            Some(t) => t
                .join()
                .unwrap_or_else(|_| Err(io::Error::other("the FUSE session thread panicked"))),
            None => Ok(()),
        };
        self.unmounter = None;
        r
    }

    fn unmount_inner(&mut self) -> io::Result<()> {
        // Calls waiting for an absent server (-o hard) give up with EIO, so
        // that their FUSE threads come back and the session can end.
        self.closing
            .closing
            .store(true, std::sync::atomic::Ordering::Release);
        let mut first = Ok(());
        if !self.is_finished() {
            if let Some(u) = self.unmounter.as_mut() {
                first = u.unmount();
            }
        }
        self.unmounter = None;
        let r = match self.thread.take() {
            Some(t) => t
                .join()
                .unwrap_or_else(|_| Err(io::Error::other("the FUSE session thread panicked"))),
            None => Ok(()),
        };
        first.and(r)
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        if self.thread.is_some() {
            if let Err(e) = self.unmount_inner() {
                tracing::warn!(mountpoint = %self.mountpoint.display(), error = %e, "unmount");
            }
        }
    }
}

/// Mount `export`/`subdir` of a connected client on `mountpoint`. Returns
/// once the kernel has accepted the mount (the FUSE INIT exchange is done),
/// so a failure (no /dev/fuse, no fusermount3, a busy mount point) is
/// reported here, before anything is mounted.
pub fn mount(
    client: lwio_client::Client,
    export: &str,
    subdir: &str,
    mountpoint: &Path,
    cfg: &MountConfig,
) -> io::Result<Mounted> {
    mount_inner(client, None, export, subdir, mountpoint, cfg)
}

/// [`mount`] with a client made by `connect`, which the mount calls again
/// when the server went away (a restart, a reset connection): then new
/// calls and opens work again once the server is back.
pub fn mount_reconnecting(
    connect: fs::Connect,
    export: &str,
    subdir: &str,
    mountpoint: &Path,
    cfg: &MountConfig,
) -> io::Result<Mounted> {
    let client = connect().map_err(io::Error::other)?;
    mount_inner(client, Some(connect), export, subdir, mountpoint, cfg)
}

fn mount_inner(
    client: lwio_client::Client,
    connect: Option<fs::Connect>,
    export: &str,
    subdir: &str,
    mountpoint: &Path,
    cfg: &MountConfig,
) -> io::Result<Mounted> {
    let stats = Arc::new(Stats::default());
    let root = leases::canonical(subdir);
    let shared = Arc::new(fs::Shared {
        client: std::sync::RwLock::new(client.clone()),
        client_gen: AtomicU64::new(0),
        connect,
        last_attempt: std::sync::Mutex::new(None),
        notifier: std::sync::OnceLock::new(),
        watch_gen: AtomicU64::new(0),
        want_leases: cfg.leases,
        inodes: std::sync::Mutex::new(inodes::Inodes::new(&root)),
        leases: std::sync::Mutex::new(leases::LeaseCache::new(cfg.lease_ttl)),
        leasing: std::sync::atomic::AtomicBool::new(false),
        stats: stats.clone(),
        hard: cfg.hard,
        closing: std::sync::atomic::AtomicBool::new(false),
    });
    // Lease breaks arrive on a second connection of this client's session.
    let watch = if cfg.leases {
        match client.watch_breaks() {
            Ok(w) => Some(w),
            Err(e) => {
                tracing::info!(error = %e, "no directory leases (the server does not grant them)");
                None
            }
        }
    } else {
        None
    };
    drop(client);
    let fs = fs::LwioFs::new(export, &root, cfg.clone(), shared.clone())?;
    let keepalive = (!cfg.keepalive.is_zero()).then(|| keepalive(shared.clone(), cfg.keepalive));
    let mut config = fuser::Config::default();
    config.mount_options = cfg.fuse_options(export, subdir);
    config.acl = if cfg.allow_other {
        fuser::SessionACL::All
    } else if cfg.allow_root {
        fuser::SessionACL::RootAndOwner
    } else {
        fuser::SessionACL::Owner
    };
    config.n_threads = Some(cfg.threads.max(1));
    config.clone_fd = cfg.threads > 1;
    let mut session = fuser::Session::new(fs, mountpoint, &config)?;
    let unmounter = session.unmount_callable();
    let _ = shared.notifier.set(session.notifier());
    let closing_of = shared.clone();
    if let Some(w) = watch {
        watcher::start(w, shared)?;
    }
    let thread = std::thread::Builder::new()
        .name("lwio-fuse".into())
        .spawn(move || session.run())?;
    Ok(Mounted {
        mountpoint: mountpoint.to_path_buf(),
        unmounter: Some(unmounter),
        thread: Some(thread),
        stats,
        _keepalive: keepalive,
        closing: closing_of,
    })
}

/// Ping the server every `every` so that an idle mount keeps its session
/// (the server closes sessions idle for `idle_timeout`). Stops when the
/// returned sender is dropped.
fn keepalive(shared: Arc<fs::Shared>, every: std::time::Duration) -> std::sync::mpsc::Sender<()> {
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let spawned = std::thread::Builder::new()
        .name("lwio-keepalive".into())
        .spawn(move || {
            while let Err(std::sync::mpsc::RecvTimeoutError::Timeout) = rx.recv_timeout(every) {
                let gen = shared.client_gen.load(Ordering::Acquire);
                let r = shared.client().side(|s| s.ping());
                if let Err(e) = r {
                    tracing::warn!(error = %e, "keepalive ping");
                    // Reconnect now rather than at the next program's call.
                    shared.reconnect(gen);
                }
            }
        });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "no keepalive thread");
    }
    tx
}
