//! Directory leases, server side (seed 004; docs/leases.md).
//!
//! A session may hold a read+handle lease on a directory: its client then
//! caches the listing and the entries' attributes. A request of another
//! session that changes the directory first *breaks* the lease: the server
//! sends `LeaseBreak` on the holder's watching connection, waits for the
//! `LeaseBreakAck` (or `limits.lease_break_timeout`, after which the lease
//! is revoked), and only then makes the change. While a break of a
//! directory is in progress nobody is granted a lease on it, so no holder
//! can cache the state the change is about to replace.
//!
//! Leases are kept by (export, directory path), per session, bounded per
//! session and server-wide, and vanish with their session or its watching
//! connection.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use tracing::{debug, warn};

use crate::config::Limits;
use crate::fs::split_rel_path;
use crate::fs::table::SessionId;
use lwio_side::codec::{LEASE_HANDLE, LEASE_READ};
use lwio_side::error::{Error, ErrorCode, Result};

/// A directory: (export, canonical path: components joined by '/', "" for
/// the export root).
pub type DirKey = (String, String);

/// The canonical key of directory `path` of `export`.
pub fn dir_key(export: &str, path: &str) -> Result<DirKey> {
    Ok((export.to_string(), split_rel_path(path)?.join("/")))
}

/// The key of the directory holding entry `path` (None for the root itself,
/// which has no parent inside the export).
pub fn parent_key(export: &str, path: &str) -> Result<Option<DirKey>> {
    let c = split_rel_path(path)?;
    Ok(c.split_last()
        .map(|(_, dir)| (export.to_string(), dir.join("/"))))
}

/// Whether directory `key` is `tree` or lies below it.
fn within(key: &DirKey, tree: &DirKey) -> bool {
    key.0 == tree.0
        && (tree.1.is_empty()
            || key.1 == tree.1
            || (key.1.starts_with(&tree.1) && key.1.as_bytes().get(tree.1.len()) == Some(&b'/')))
}

/// What a change touches: directories whose listing or entry attributes
/// change, and trees whose paths change (a renamed directory).
#[derive(Debug, Default, Clone)]
pub struct Change {
    pub dirs: Vec<DirKey>,
    pub trees: Vec<DirKey>,
}

impl Change {
    pub fn is_empty(&self) -> bool {
        self.dirs.is_empty() && self.trees.is_empty()
    }
}

/// One break sent to a watching connection.
#[derive(Debug)]
pub struct BreakMsg {
    pub lease_id: u64,
    pub export: String,
    pub path: String,
    /// Fired when the holder acknowledges.
    pub ack: oneshot::Sender<()>,
}

struct Lease {
    session: SessionId,
    key: DirKey,
}

#[derive(Default)]
struct Inner {
    next_id: u64,
    leases: HashMap<u64, Lease>,
    by_dir: HashMap<DirKey, HashSet<u64>>,
    per_session: HashMap<SessionId, HashSet<u64>>,
    /// session → (generation, sender to its watching connection).
    watchers: HashMap<SessionId, (u64, mpsc::UnboundedSender<BreakMsg>)>,
    next_watch: u64,
    /// Directories with a break in progress, and trees being renamed.
    breaking: HashMap<DirKey, usize>,
    breaking_trees: HashMap<DirKey, usize>,
    /// Leases revoked for want of an acknowledgement (for tests and logs).
    revoked: u64,
    /// Breaks sent.
    breaks: u64,
}

impl Inner {
    fn remove(&mut self, id: u64) -> Option<Lease> {
        let l = self.leases.remove(&id)?;
        if let Some(s) = self.by_dir.get_mut(&l.key) {
            s.remove(&id);
            if s.is_empty() {
                self.by_dir.remove(&l.key);
            }
        }
        if let Some(s) = self.per_session.get_mut(&l.session) {
            s.remove(&id);
            if s.is_empty() {
                self.per_session.remove(&l.session);
            }
        }
        Some(l)
    }

    fn drop_session(&mut self, session: SessionId) -> usize {
        let ids: Vec<u64> = self
            .per_session
            .get(&session)
            .map(|s| s.iter().copied().collect())
            .unwrap_or_default();
        for id in &ids {
            self.remove(*id);
        }
        ids.len()
    }

    fn is_breaking(&self, key: &DirKey) -> bool {
        self.breaking.contains_key(key) || self.breaking_trees.keys().any(|t| within(key, t))
    }
}

/// The server's lease table.
pub struct Leases {
    inner: Mutex<Inner>,
    max_per_session: usize,
    max_total: usize,
    timeout: Duration,
}

impl std::fmt::Debug for Leases {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Leases")
            .field("held", &self.lock().leases.len())
            .finish()
    }
}

/// Counters of the lease table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LeaseCounts {
    pub held: usize,
    pub breaks: u64,
    pub revoked: u64,
}

impl Leases {
    pub fn new(limits: &Limits) -> Leases {
        Leases {
            inner: Mutex::new(Inner {
                next_id: 1,
                next_watch: 1,
                ..Inner::default()
            }),
            max_per_session: limits.max_leases_per_session,
            max_total: limits.max_leases,
            timeout: limits.lease_break_timeout,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn counts(&self) -> LeaseCounts {
        let g = self.lock();
        LeaseCounts {
            held: g.leases.len(),
            breaks: g.breaks,
            revoked: g.revoked,
        }
    }

    /// Grant `session` a read+handle lease on `key`, or refuse (lease id 0,
    /// granted 0): no watching connection, a limit reached, a break of the
    /// directory in progress, or `writers_elsewhere()` (another session has
    /// an entry of it open for writing, whose attributes change under the
    /// data path where the server does not look).
    pub fn grant(
        &self,
        session: SessionId,
        key: DirKey,
        want: u8,
        writers_elsewhere: impl FnOnce() -> bool,
    ) -> (u64, u8) {
        let mut g = self.lock();
        let why = if !g.watchers.contains_key(&session) {
            Some("no watching connection")
        } else if let Some(id) = g.by_dir.get(&key).and_then(|s| {
            s.iter()
                .copied()
                .find(|id| g.leases.get(id).is_some_and(|l| l.session == session))
        }) {
            // Asked again: the lease it already holds.
            return (id, want & (LEASE_READ | LEASE_HANDLE));
        } else if g.per_session.get(&session).map_or(0, |s| s.len()) >= self.max_per_session {
            Some("per-session lease limit")
        } else if g.leases.len() >= self.max_total {
            Some("server lease limit")
        } else if g.is_breaking(&key) {
            Some("a break of this directory is in progress")
        } else if writers_elsewhere() {
            Some("another session has an entry open for writing")
        } else {
            None
        };
        if let Some(why) = why {
            debug!(session, export = %key.0, dir = %key.1, why, "lease not granted");
            return (0, 0);
        }
        let id = g.next_id;
        g.next_id += 1;
        g.by_dir.entry(key.clone()).or_default().insert(id);
        g.per_session.entry(session).or_default().insert(id);
        g.leases.insert(id, Lease { session, key });
        (id, want & (LEASE_READ | LEASE_HANDLE))
    }

    /// Give a lease back (only its holder may).
    pub fn release(&self, session: SessionId, id: u64) -> Result<()> {
        let mut g = self.lock();
        match g.leases.get(&id) {
            Some(l) if l.session == session => {
                g.remove(id);
                Ok(())
            }
            _ => Err(Error::new(
                ErrorCode::BadHandle,
                format!("no lease {id} in this session"),
            )),
        }
    }

    /// Make a connection the break carrier of `session`; a previous one is
    /// replaced (its leases go: their holder's cache went with it).
    pub fn watch(&self, session: SessionId) -> (u64, mpsc::UnboundedReceiver<BreakMsg>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let mut g = self.lock();
        let gen = g.next_watch;
        g.next_watch += 1;
        if g.watchers.insert(session, (gen, tx)).is_some() {
            g.drop_session(session);
        }
        (gen, rx)
    }

    /// The watching connection `gen` of `session` ended: its leases go.
    pub fn unwatch(&self, session: SessionId, gen: u64) {
        let mut g = self.lock();
        if g.watchers.get(&session).is_some_and(|(w, _)| *w == gen) {
            g.watchers.remove(&session);
            let n = g.drop_session(session);
            debug!(
                session,
                leases = n,
                "watching connection closed; its leases dropped"
            );
        }
    }

    /// The session ended: its leases and its watcher go (which ends the
    /// watching connection).
    pub fn end_session(&self, session: SessionId) {
        let mut g = self.lock();
        g.watchers.remove(&session);
        g.drop_session(session);
    }

    /// A change made on the server's own file system (side/dirwatch.rs):
    /// break every lease on `key`, whoever holds it, without waiting (the
    /// change is made already). The number of leases broken.
    pub fn break_external(&self, key: &DirKey) -> usize {
        let mut g = self.lock();
        let ids: Vec<u64> = g
            .by_dir
            .get(key)
            .map(|s| s.iter().copied().collect())
            .unwrap_or_default();
        Self::send_breaks(&mut g, ids)
    }

    /// Every lease, broken without waiting (the watch lost events).
    pub fn break_all_external(&self) -> usize {
        let mut g = self.lock();
        let ids: Vec<u64> = g.leases.keys().copied().collect();
        Self::send_breaks(&mut g, ids)
    }

    fn send_breaks(g: &mut Inner, ids: Vec<u64>) -> usize {
        // Nobody waits for the acknowledgements: the receivers go.
        ids.into_iter()
            .filter(|id| Self::send_break(g, *id).is_some())
            .count()
    }

    /// Remove lease `id` and send its holder the break: the lease, and
    /// the receiver its acknowledgement fires (None: no such lease, or
    /// its holder's watching connection is gone, which took its cache).
    fn send_break(g: &mut Inner, id: u64) -> Option<(Lease, oneshot::Receiver<()>)> {
        let l = g.remove(id)?;
        let (_, tx) = g.watchers.get(&l.session)?;
        let (ack, rx) = oneshot::channel();
        let m = BreakMsg {
            lease_id: id,
            export: l.key.0.clone(),
            path: l.key.1.clone(),
            ack,
        };
        tx.send(m).ok()?;
        g.breaks += 1;
        Some((l, rx))
    }

    /// Break what `change` by `session` touches, and wait for the holders.
    /// The returned guard keeps the directories "breaking" (no grants) until
    /// it is dropped, after the change was made.
    pub async fn break_for(self: &Arc<Self>, session: SessionId, change: Change) -> BreakGuard {
        if change.is_empty() {
            return BreakGuard {
                leases: None,
                change,
            };
        }
        let mut waits = Vec::new();
        {
            let mut g = self.lock();
            for d in &change.dirs {
                *g.breaking.entry(d.clone()).or_default() += 1;
            }
            for t in &change.trees {
                *g.breaking_trees.entry(t.clone()).or_default() += 1;
            }
            let mut victims: Vec<u64> = Vec::new();
            for d in &change.dirs {
                if let Some(s) = g.by_dir.get(d) {
                    victims.extend(
                        s.iter()
                            .filter(|id| g.leases.get(id).is_some_and(|l| l.session != session)),
                    );
                }
            }
            let mut own = Vec::new();
            if !change.trees.is_empty() {
                for (id, l) in &g.leases {
                    if change.trees.iter().any(|t| within(&l.key, t)) {
                        if l.session == session {
                            // The holder made this change itself and drops
                            // its own cache below the moved tree (no
                            // message: a break would wait on its own
                            // kernel, which holds the rename's locks).
                            own.push(*id);
                        } else {
                            victims.push(*id);
                        }
                    }
                }
            }
            victims.sort_unstable();
            victims.dedup();
            for id in own {
                g.remove(id);
            }
            for id in victims {
                if let Some((l, rx)) = Self::send_break(&mut g, id) {
                    waits.push((id, l.session, l.key, rx));
                }
            }
        }
        let deadline = tokio::time::Instant::now() + self.timeout;
        for (id, holder, key, rx) in waits {
            match tokio::time::timeout_at(deadline, rx).await {
                Ok(Ok(())) => debug!(lease = id, holder, "lease break acknowledged"),
                // The watching connection went away: the lease went with it.
                Ok(Err(_)) => {}
                Err(_) => {
                    self.lock().revoked += 1;
                    warn!(
                        lease = id,
                        holder,
                        export = %key.0,
                        dir = %key.1,
                        timeout = ?self.timeout,
                        "lease break not acknowledged in time; lease revoked"
                    );
                }
            }
        }
        BreakGuard {
            leases: Some(self.clone()),
            change,
        }
    }
}

/// Keeps a change's directories "breaking" until the change is made.
pub struct BreakGuard {
    leases: Option<Arc<Leases>>,
    change: Change,
}

impl Drop for BreakGuard {
    fn drop(&mut self) {
        let Some(l) = self.leases.take() else { return };
        let mut g = l.lock();
        for d in &self.change.dirs {
            if let Some(n) = g.breaking.get_mut(d) {
                *n -= 1;
                if *n == 0 {
                    g.breaking.remove(d);
                }
            }
        }
        for t in &self.change.trees {
            if let Some(n) = g.breaking_trees.get_mut(t) {
                *n -= 1;
                if *n == 0 {
                    g.breaking_trees.remove(t);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(p: &str) -> DirKey {
        dir_key("e", p).unwrap()
    }

    /// A change of directories `ds` only.
    fn dirs(ds: &[&str]) -> Change {
        Change {
            dirs: ds.iter().map(|d| key(d)).collect(),
            trees: vec![],
        }
    }

    fn table(timeout_ms: u64, per_session: usize, total: usize) -> Arc<Leases> {
        Arc::new(Leases::new(&Limits {
            lease_break_timeout: Duration::from_millis(timeout_ms),
            max_leases_per_session: per_session,
            max_leases: total,
            ..Limits::default()
        }))
    }

    #[test]
    fn keys_are_canonical() {
        assert_eq!(key("a//b/./c/"), ("e".into(), "a/b/c".into()));
        assert_eq!(key(""), ("e".into(), "".into()));
        assert_eq!(
            parent_key("e", "a/b").unwrap(),
            Some(("e".into(), "a".into()))
        );
        assert_eq!(parent_key("e", "a").unwrap(), Some(("e".into(), "".into())));
        assert_eq!(parent_key("e", ".").unwrap(), None);
        assert!(dir_key("e", "../x").is_err());
        assert!(within(&key("a/b"), &key("a")));
        assert!(within(&key("a"), &key("a")));
        assert!(!within(&key("ab"), &key("a")));
        assert!(within(&key("ab"), &key("")));
    }

    #[test]
    fn grants_need_a_watcher_and_respect_limits() {
        let t = table(100, 2, 3);
        assert_eq!(t.grant(1, key("a"), 3, || false), (0, 0), "no watcher");
        let (_g1, _rx1) = t.watch(1);
        let (id, granted) = t.grant(1, key("a"), 3, || false);
        assert!(id != 0 && granted == 3);
        assert_eq!(
            t.grant(1, key("a/"), 3, || false),
            (id, 3),
            "same lease again"
        );
        assert_ne!(t.grant(1, key("b"), 1, || false).0, 0);
        assert_eq!(
            t.grant(1, key("c"), 3, || false),
            (0, 0),
            "per-session limit"
        );
        let (_g2, _rx2) = t.watch(2);
        assert_ne!(t.grant(2, key("a"), 3, || false).0, 0);
        assert_eq!(t.grant(2, key("d"), 3, || false), (0, 0), "server limit");
        assert_eq!(t.grant(2, key("x"), 3, || true), (0, 0), "writer elsewhere");
        t.release(1, id).unwrap();
        assert_eq!(
            t.release(2, id).unwrap_err().code,
            ErrorCode::BadHandle,
            "only the holder releases"
        );
        assert_ne!(t.grant(2, key("d"), 3, || false).0, 0);
        t.end_session(2);
        assert_eq!(t.counts().held, 1);
    }

    #[tokio::test]
    async fn a_change_waits_for_the_ack_and_others_keep_their_leases() {
        let t = table(5_000, 10, 10);
        let (_, mut rx1) = t.watch(1);
        let (_, _rx2) = t.watch(2);
        let (a, _) = t.grant(1, key("d"), 3, || false);
        let (b, _) = t.grant(2, key("d"), 3, || false);
        let (other, _) = t.grant(1, key("elsewhere"), 3, || false);
        // Session 2 changes d: session 1's lease breaks, 2's own does not.
        let holder = tokio::spawn(async move {
            let m = rx1.recv().await.unwrap();
            assert_eq!(
                (m.lease_id, m.export.as_str(), m.path.as_str()),
                (a, "e", "d")
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
            m.ack.send(()).unwrap();
            rx1
        });
        let started = tokio::time::Instant::now();
        let guard = t.break_for(2, dirs(&["d"])).await;
        assert!(
            started.elapsed() >= Duration::from_millis(50),
            "waited for the ack"
        );
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "not for the timeout"
        );
        // While the change is in progress, d is not leased again.
        assert_eq!(t.grant(1, key("d"), 3, || false), (0, 0));
        drop(guard);
        assert_ne!(t.grant(1, key("d"), 3, || false).0, 0);
        let c = t.counts();
        assert_eq!((c.breaks, c.revoked), (1, 0));
        // b and the lease elsewhere survive.
        t.release(2, b).unwrap();
        t.release(1, other).unwrap();
        drop(holder.await.unwrap());
    }

    #[tokio::test]
    async fn a_silent_holder_delays_the_change_by_the_timeout_and_loses_its_lease() {
        let t = table(300, 10, 10);
        let (_, mut rx1) = t.watch(1);
        let (id, _) = t.grant(1, key("d"), 3, || false);
        let started = tokio::time::Instant::now();
        drop(t.break_for(2, dirs(&["d"])).await);
        let waited = started.elapsed();
        assert!(waited >= Duration::from_millis(300), "{waited:?}");
        assert!(waited < Duration::from_secs(3), "{waited:?}");
        let m = rx1.try_recv().expect("a break was sent");
        assert_eq!(m.lease_id, id);
        assert_eq!(
            t.counts(),
            LeaseCounts {
                held: 0,
                breaks: 1,
                revoked: 1
            }
        );
        assert_eq!(t.release(1, id).unwrap_err().code, ErrorCode::BadHandle);
    }

    #[tokio::test]
    async fn a_rename_breaks_the_trees_below_and_drops_own_leases_silently() {
        let t = table(2_000, 10, 10);
        let (_, mut rx1) = t.watch(1);
        let (_, mut rx2) = t.watch(2);
        let (below, _) = t.grant(1, key("a/b/c"), 3, || false);
        let (beside, _) = t.grant(1, key("ab"), 3, || false);
        let (own, _) = t.grant(2, key("a/b"), 3, || false);
        let acker = tokio::spawn(async move {
            let m = rx1.recv().await.unwrap();
            let id = m.lease_id;
            m.ack.send(()).unwrap();
            id
        });
        drop(
            t.break_for(
                2,
                Change {
                    dirs: vec![key(""), key("z")],
                    trees: vec![key("a")],
                },
            )
            .await,
        );
        assert_eq!(acker.await.unwrap(), below);
        assert!(rx2.try_recv().is_err(), "no message to the renamer itself");
        assert_eq!(t.release(2, own).unwrap_err().code, ErrorCode::BadHandle);
        t.release(1, beside).unwrap();
        assert_eq!(t.counts().held, 0);
    }

    #[tokio::test]
    async fn a_closed_watcher_drops_the_sessions_leases() {
        let t = table(2_000, 10, 10);
        let (gen, rx) = t.watch(1);
        t.grant(1, key("d"), 3, || false);
        drop(rx);
        // A break to a vanished watcher does not wait.
        let started = tokio::time::Instant::now();
        drop(t.break_for(2, dirs(&["d"])).await);
        assert!(started.elapsed() < Duration::from_secs(1));
        t.grant(1, key("e"), 3, || false);
        t.unwatch(1, gen + 100);
        assert_eq!(
            t.counts().held,
            1,
            "another generation's unwatch is ignored"
        );
        t.unwatch(1, gen);
        assert_eq!(t.counts().held, 0);
    }
}
