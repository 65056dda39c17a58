//! The lease-break watcher: a thread reading this mount's watching
//! connection (docs/leases.md). On a break it drops the directory's cache,
//! tells the kernel to forget the names and attributes it took from it, and
//! acknowledges, so that the other client's change completes.
//!
//! Kernel notifications run on a thread of their own, and a break waits for
//! them at most [`NOTIFY_WAIT`]: a notification about a directory needs the
//! kernel's lock on it, which one of this mount's own requests may hold
//! while it waits on the server for the very change being broken (two
//! mounts creating in one directory at once). The acknowledgement then goes
//! first and the invalidation lands right after.

use std::ffi::OsStr;
use std::io;
use std::sync::atomic::Ordering;
use std::sync::{mpsc, Arc};
use std::time::Duration;

use fuser::{INodeNo, Notifier};
use tracing::{debug, info, warn};

use crate::fs::{lock, Shared};
use crate::inodes::join;
use crate::Stats;

/// The longest a break waits for the kernel's invalidations.
const NOTIFY_WAIT: Duration = Duration::from_millis(200);

/// What the kernel must forget: a directory node and its children's names
/// and nodes.
struct Forget {
    dir: Option<u64>,
    names: Vec<(String, Option<u64>)>,
    done: Option<mpsc::Sender<()>>,
}

/// After a reconnection: forget what the old session's leases covered and
/// watch for the new session's breaks.
pub(crate) fn restart(shared: &Arc<Shared>, client: &lwio_client::Client) {
    shared.watch_gen.fetch_add(1, Ordering::AcqRel);
    shared.leasing.store(false, Ordering::Relaxed);
    let all = lock(&shared.leases).clear();
    if let Some(n) = shared.notifier.get() {
        for (dir, names) in all {
            forget(n, &nodes(shared, &dir, names, None));
        }
    }
    if !shared.want_leases {
        return;
    }
    match client.watch_breaks() {
        Ok(w) => {
            if let Err(e) = start(w, shared.clone()) {
                warn!(error = %e, "no lease watcher thread");
            }
        }
        Err(e) => info!(error = %e, "no directory leases (the server does not grant them)"),
    }
}

/// Start watching on `w` (already turned into a watching connection).
pub(crate) fn start(
    mut w: lwio_client::side_client::SideClient,
    shared: Arc<Shared>,
) -> io::Result<()> {
    let Some(notifier) = shared.notifier.get().cloned() else {
        return Err(io::Error::other("no FUSE session to notify"));
    };
    let gen = shared.watch_gen.load(Ordering::Acquire);
    let (tx, rx) = mpsc::channel::<Forget>();
    std::thread::Builder::new()
        .name("lwio-notify".into())
        .spawn(move || {
            for f in rx {
                forget(&notifier, &f);
                if let Some(d) = f.done {
                    let _ = d.send(());
                }
            }
        })?;
    shared.leasing.store(true, Ordering::Relaxed);
    std::thread::Builder::new()
        .name("lwio-leases".into())
        .spawn(move || {
            let why = loop {
                let (id, export, dir) = match w.next_break() {
                    Ok(b) => b,
                    Err(e) => break e,
                };
                Stats::add(&shared.stats.lease_breaks, 1);
                let dropped = lock(&shared.leases).broken(id);
                debug!(lease = id, %export, %dir, cached = dropped.is_some(), "lease break");
                if let Some((dir, names)) = dropped {
                    let (done, wait) = mpsc::channel();
                    let f = nodes(&shared, &dir, names, Some(done));
                    if tx.send(f).is_ok() && wait.recv_timeout(NOTIFY_WAIT).is_err() {
                        debug!(
                            lease = id,
                            "kernel invalidation still running; acknowledging"
                        );
                    }
                }
                if let Err(e) = w.ack_break(id) {
                    break e;
                }
            };
            // The watch is over (unmount, or the connection is gone): no
            // lease holds any more, so nothing may stay cached long. (A
            // newer watcher, after a reconnection, has taken over already.)
            if shared.watch_gen.load(Ordering::Acquire) != gen {
                return;
            }
            shared.leasing.store(false, Ordering::Relaxed);
            let all = lock(&shared.leases).clear();
            for (dir, names) in all {
                let _ = tx.send(nodes(&shared, &dir, names, None));
            }
            if shared.stats.lease_breaks.load(Ordering::Relaxed) > 0 || !is_closed(&why) {
                info!(error = %why, "lease watch ended; caching by timeouts only");
            } else {
                debug!(error = %why, "lease watch ended");
            }
        })?;
    Ok(())
}

fn is_closed(e: &lwio_side::Error) -> bool {
    e.code == lwio_side::error::ErrorCode::Disconnected
}

/// The nodes of `dir` and its cached names that the kernel may know.
fn nodes(shared: &Shared, dir: &str, names: Vec<String>, done: Option<mpsc::Sender<()>>) -> Forget {
    let t = lock(&shared.inodes);
    Forget {
        dir: t.peek(dir),
        names: names
            .into_iter()
            .map(|n| {
                let ino = t.peek(&join(dir, &n));
                (n, ino)
            })
            .collect(),
        done,
    }
}

fn forget(n: &Notifier, f: &Forget) {
    let Some(dir) = f.dir else {
        // The kernel holds no node of the directory: nothing of it cached.
        return;
    };
    for (name, ino) in &f.names {
        // ENOENT: the kernel had no such entry cached; fine.
        if let Err(e) = n.inval_entry(INodeNo(dir), OsStr::new(name)) {
            if e.raw_os_error() != Some(libc::ENOENT) {
                warn!(error = %e, name, "kernel entry invalidation");
            }
        }
        if let Some(i) = ino {
            let _ = n.inval_inode(INodeNo(*i), 0, 0);
        }
    }
    // The directory's own attributes and its cached listing pages.
    let _ = n.inval_inode(INodeNo(dir), 0, 0);
}
