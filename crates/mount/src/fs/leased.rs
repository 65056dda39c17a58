//! The directory leases (docs/leases.md) as the mount uses them: what it
//! may answer from its cache, and its own changes kept there.

use super::*;

/// What this client itself did to an entry (its own changes keep its own
/// lease cache right; they break only other clients' leases).
pub(super) enum OwnChange<'a> {
    /// Created or changed, with the attributes the server answered.
    Is(&'a AttrX),
    Removed,
    /// Changed in a way only the server knows (a rename target, a write
    /// past the kernel's cache).
    Stale,
    /// Written by this mount up to this byte.
    Wrote(u64),
}

/// `t` in nanoseconds since the Unix epoch.
pub(super) fn epoch_ns(t: SystemTime) -> i64 {
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => i64::try_from(d.as_nanos()).unwrap_or(i64::MAX),
        Err(e) => -i64::try_from(e.duration().as_nanos()).unwrap_or(i64::MAX),
    }
}

impl LwioFs {
    /// Node `ino`'s directory and name, where leases are on (its
    /// attributes may then be in the lease cache).
    pub(super) fn leased_name(&self, ino: INodeNo) -> Option<(String, String)> {
        if !self.leasing() {
            return None;
        }
        split(&self.path(ino).ok()?)
    }

    /// Whether attributes `a` are of node `ino`'s file on the server (a
    /// name's entry in the lease cache, or an answer by handle).
    pub(super) fn is_node(&self, ino: INodeNo, a: &AttrX) -> bool {
        lock(&self.shared.inodes).server_ino(ino.0) == Some(a.ino)
    }

    /// The kernel wrote node `ino`'s times back (write-back cache): kept in
    /// the lease cache when the directory is leased and the name is still
    /// this file; the attributes to answer with, or `None` to ask the
    /// server as usual.
    pub(super) fn times_written_back(
        &self,
        ino: INodeNo,
        mtime: SystemTime,
        ctime: Option<SystemTime>,
    ) -> Option<AttrX> {
        let (dir, leaf) = self.leased_name(ino)?;
        let mut c = lock(&self.shared.leases);
        match c.lookup(&dir, &leaf) {
            Some(Hit::Found(mut a)) if self.is_node(ino, &a) => {
                a.mtime_ns = epoch_ns(mtime);
                a.ctime_ns = ctime.map_or(a.ctime_ns, epoch_ns);
                c.put(&dir, &leaf, &a);
                Some(a)
            }
            _ => None,
        }
    }

    /// The kernel's entry and attribute lifetimes for an entry of `dir`:
    /// long under a lease (a break invalidates them), else the options'.
    pub(super) fn ttls(&self, leased: bool) -> (Duration, Duration) {
        if leased {
            (self.cfg.lease_ttl, self.cfg.lease_ttl)
        } else {
            (self.cfg.entry_ttl, self.cfg.attr_ttl)
        }
    }

    pub(super) fn leasing(&self) -> bool {
        self.shared.leasing.load(Ordering::Relaxed)
    }

    pub(super) fn own_change(&self, path: &str, what: OwnChange) {
        if !self.leasing() {
            return;
        }
        let Some((dir, name)) = split(path) else {
            return;
        };
        let mut c = lock(&self.shared.leases);
        match what {
            OwnChange::Is(a) => c.put(&dir, &name, a),
            OwnChange::Removed => c.del(&dir, &name),
            OwnChange::Stale => c.stale(&dir, &name),
            OwnChange::Wrote(end) => c.wrote(&dir, &name, end, epoch_ns(SystemTime::now())),
        }
    }

    /// The listing of directory `path`: from its lease when it has one,
    /// else from the server (taking a lease first where leases are on, so
    /// that the listing can be kept). (listing, from a lease).
    pub(super) fn dir_listing(&self, path: &str) -> Res<(Arc<Listing>, bool)> {
        let export = &self.export;
        if !self.leasing() {
            return Ok((Arc::new(self.side(|s| s.list_dir_x(export, path))?), false));
        }
        if let Some(l) = lock(&self.shared.leases).listing(path) {
            Stats::add(&self.stats.lease_hits, 1);
            return Ok((l, true));
        }
        let held = lock(&self.shared.leases).lease_of(path);
        let lease = match held {
            Some(id) => Some(id),
            None => self.take_lease(path),
        };
        let list = self.side(|s| s.list_dir_x(export, path))?;
        match lease {
            Some(id) => {
                lock(&self.shared.leases).install(path, id, &list);
                Ok((Arc::new(list), true))
            }
            None => Ok((Arc::new(list), false)),
        }
    }

    /// Ask for a read+handle lease on `path` (giving the coldest one back at
    /// the cap); the lease id if granted.
    pub(super) fn take_lease(&self, path: &str) -> Option<u64> {
        let coldest = {
            let c = lock(&self.shared.leases);
            (c.len() >= self.cfg.max_leases)
                .then(|| c.coldest())
                .flatten()
        };
        if let Some((dir, id)) = coldest {
            lock(&self.shared.leases).forget(&dir);
            let _ = self.side(|s| s.release_lease(id));
        }
        let export = &self.export;
        let want = lwio_side::codec::LEASE_READ | lwio_side::codec::LEASE_HANDLE;
        match self.side(|s| s.lease_dir(export, path, want)) {
            Ok((id, g)) if id != 0 && g != 0 => {
                if lock(&self.shared.leases).granted(path, id) {
                    Stats::add(&self.stats.leases_granted, 1);
                    Some(id)
                } else {
                    None
                }
            }
            Ok(_) => None,
            Err(e) => {
                debug!(path, errno = e, "lease");
                None
            }
        }
    }
}
