//! The holder's side of directory leases (docs/leases.md): per leased
//! directory, its listing and its entries' attributes, answered without a
//! round trip until the server breaks the lease.
//!
//! Paths are export-relative and canonical (components joined by '/', ""
//! for the export root), as the server names them in a break.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use lwio_side::types::AttrX;

/// A directory listing: names and full attributes.
pub(crate) type Listing = Vec<(String, AttrX)>;

/// `path` with empty and "." components dropped.
pub(crate) fn canonical(path: &str) -> String {
    path.split('/')
        .filter(|c| !c.is_empty() && *c != ".")
        .collect::<Vec<_>>()
        .join("/")
}

/// (directory, name) of an entry path; None for the export root.
pub(crate) fn split(path: &str) -> Option<(String, String)> {
    let p = canonical(path);
    if p.is_empty() {
        return None;
    }
    Some(match p.rsplit_once('/') {
        Some((d, n)) => (d.to_string(), n.to_string()),
        None => (String::new(), p),
    })
}

fn within(dir: &str, tree: &str) -> bool {
    tree.is_empty()
        || dir == tree
        || (dir.starts_with(tree) && dir.as_bytes().get(tree.len()) == Some(&b'/'))
}

struct Dir {
    lease: u64,
    /// The listing, once taken under the lease.
    entries: Option<BTreeMap<String, AttrX>>,
    /// Names whose attributes changed under this client's own hand (a
    /// write through the data path) and must be asked again.
    stale: HashSet<String>,
    fetched: Instant,
    used: Instant,
}

/// What a lookup in the cache found.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Hit {
    /// The entry, with its attributes.
    Found(AttrX),
    /// No such entry (a negative answer, also from the lease).
    Absent,
}

/// The leased directories of one mount.
pub(crate) struct LeaseCache {
    dirs: HashMap<String, Dir>,
    by_id: HashMap<u64, String>,
    /// Breaks that arrived before their grant was recorded (the break and
    /// the grant travel on two connections).
    early_breaks: HashSet<u64>,
    /// How long a listing is trusted even under a lease (bounds what changes
    /// made on the server by other programs than lwio stay unseen).
    ttl: Duration,
    /// Bumped by every change of the cache but [`LeaseCache::fill`]: an
    /// answer fetched from the server is kept only if nothing changed while
    /// it travelled (a write of ours may have landed after the server
    /// answered).
    gen: u64,
}

impl LeaseCache {
    pub(crate) fn new(ttl: Duration) -> LeaseCache {
        LeaseCache {
            dirs: HashMap::new(),
            by_id: HashMap::new(),
            early_breaks: HashSet::new(),
            ttl,
            gen: 0,
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.dirs.len()
    }

    /// The lease held on `dir`, if any.
    pub(crate) fn lease_of(&self, dir: &str) -> Option<u64> {
        self.dirs.get(&canonical(dir)).map(|d| d.lease)
    }

    /// Record a granted lease; false if it was broken already.
    pub(crate) fn granted(&mut self, dir: &str, lease: u64) -> bool {
        self.gen += 1;
        if self.early_breaks.remove(&lease) {
            return false;
        }
        let dir = canonical(dir);
        let now = Instant::now();
        if let Some(old) = self.dirs.insert(
            dir.clone(),
            Dir {
                lease,
                entries: None,
                stale: HashSet::new(),
                fetched: now,
                used: now,
            },
        ) {
            self.by_id.remove(&old.lease);
        }
        self.by_id.insert(lease, dir);
        true
    }

    /// Install the listing taken after lease `lease` was granted on `dir`
    /// (ignored if that lease was broken meanwhile).
    pub(crate) fn install(&mut self, dir: &str, lease: u64, listing: &Listing) {
        self.gen += 1;
        if let Some(d) = self.dirs.get_mut(&canonical(dir)) {
            if d.lease == lease {
                d.entries = Some(listing.iter().cloned().collect());
                d.stale.clear();
                d.fetched = Instant::now();
            }
        }
    }

    /// The listing of `dir`, if leased, listed and fresh.
    pub(crate) fn listing(&mut self, dir: &str) -> Option<Arc<Listing>> {
        let ttl = self.ttl;
        let d = self.dirs.get_mut(&canonical(dir))?;
        if d.fetched.elapsed() > ttl || !d.stale.is_empty() {
            return None;
        }
        d.used = Instant::now();
        let e = d.entries.as_ref()?;
        Some(Arc::new(e.iter().map(|(n, a)| (n.clone(), *a)).collect()))
    }

    /// Look `name` up in leased directory `dir`.
    pub(crate) fn lookup(&mut self, dir: &str, name: &str) -> Option<Hit> {
        let ttl = self.ttl;
        let d = self.dirs.get_mut(&canonical(dir))?;
        if d.fetched.elapsed() > ttl || d.stale.contains(name) {
            return None;
        }
        let e = d.entries.as_ref()?;
        d.used = Instant::now();
        Some(match e.get(name) {
            Some(a) => Hit::Found(*a),
            None => Hit::Absent,
        })
    }

    /// This client created or changed `dir`/`name` and knows its attributes.
    pub(crate) fn put(&mut self, dir: &str, name: &str, a: &AttrX) {
        self.gen += 1;
        self.insert(dir, name, a);
    }

    /// `dir`/`name` has attributes `a` (and is no longer stale), in a
    /// leased directory whose listing is here.
    fn insert(&mut self, dir: &str, name: &str, a: &AttrX) {
        if let Some(d) = self.dirs.get_mut(&canonical(dir)) {
            if let Some(e) = d.entries.as_mut() {
                e.insert(name.to_string(), *a);
                d.stale.remove(name);
            }
        }
    }

    /// This client removed `dir`/`name`.
    pub(crate) fn del(&mut self, dir: &str, name: &str) {
        self.gen += 1;
        if let Some(d) = self.dirs.get_mut(&canonical(dir)) {
            if let Some(e) = d.entries.as_mut() {
                e.remove(name);
                d.stale.remove(name);
            }
        }
    }

    /// The cache's generation, read before asking the server for what
    /// [`LeaseCache::fill`] then keeps.
    pub(crate) fn gen(&self) -> u64 {
        self.gen
    }

    /// The server's attributes of `dir`/`name`, asked at generation `gen`:
    /// kept (and the name no longer stale) if the cache did not change
    /// since, so that the next question is answered here.
    pub(crate) fn fill(&mut self, dir: &str, name: &str, a: &AttrX, gen: u64) {
        if gen == self.gen {
            self.insert(dir, name, a);
        }
    }

    /// This client wrote `dir`/`name` up to byte `end` at `now_ns`: under
    /// the lease no other client has it open for writing, so its size is
    /// the larger of the two and its times are the write's (as the
    /// kernel's write-back cache keeps them). A name not known fresh here
    /// becomes stale instead.
    pub(crate) fn wrote(&mut self, dir: &str, name: &str, end: u64, now_ns: i64) {
        self.gen += 1;
        let Some(d) = self.dirs.get_mut(&canonical(dir)) else {
            return;
        };
        let fresh = !d.stale.contains(name);
        match d.entries.as_mut().and_then(|e| e.get_mut(name)) {
            Some(a) if fresh => {
                a.size = a.size.max(end);
                a.blocks = a.blocks.max(end.div_ceil(512));
                a.mtime_ns = now_ns;
                a.ctime_ns = now_ns;
            }
            Some(_) => {}
            None => {
                if d.entries.is_some() {
                    d.stale.insert(name.to_string());
                }
            }
        }
    }

    /// `dir`/`name` changed in a way this client cannot see (written through
    /// the data path): ask the server next time.
    pub(crate) fn stale(&mut self, dir: &str, name: &str) {
        self.gen += 1;
        if let Some(d) = self.dirs.get_mut(&canonical(dir)) {
            if d.entries.is_some() && !d.stale.contains(name) {
                d.stale.insert(name.to_string());
            }
        }
    }

    /// Forget the caches of `tree` and everything below it (this client
    /// renamed or removed it; the server dropped those leases of ours with
    /// the change, or will on release). Returns the leases forgotten.
    pub(crate) fn drop_tree(&mut self, tree: &str) -> Vec<u64> {
        self.gen += 1;
        let tree = canonical(tree);
        let gone: Vec<String> = self
            .dirs
            .keys()
            .filter(|d| within(d, &tree))
            .cloned()
            .collect();
        gone.into_iter()
            .filter_map(|d| self.dirs.remove(&d))
            .map(|d| {
                self.by_id.remove(&d.lease);
                d.lease
            })
            .collect()
    }

    /// The server broke lease `id`: drop its cache. Returns the directory and
    /// the names the kernel may hold from it.
    pub(crate) fn broken(&mut self, id: u64) -> Option<(String, Vec<String>)> {
        self.gen += 1;
        let Some(dir) = self.by_id.remove(&id) else {
            // Not recorded yet: refuse it when its grant arrives.
            if self.early_breaks.len() >= 4096 {
                self.early_breaks.clear();
            }
            self.early_breaks.insert(id);
            return None;
        };
        let d = self.dirs.remove(&dir)?;
        let names = d
            .entries
            .map(|e| e.into_keys().collect())
            .unwrap_or_default();
        Some((dir, names))
    }

    /// Drop everything (the watching connection is gone): every directory
    /// and the names the kernel may hold from it.
    pub(crate) fn clear(&mut self) -> Vec<(String, Vec<String>)> {
        self.gen += 1;
        self.by_id.clear();
        self.dirs
            .drain()
            .map(|(dir, d)| {
                let names = d
                    .entries
                    .map(|e| e.into_keys().collect())
                    .unwrap_or_default();
                (dir, names)
            })
            .collect()
    }

    /// The least recently used leased directory (to give back at the cap).
    pub(crate) fn coldest(&self) -> Option<(String, u64)> {
        self.dirs
            .iter()
            .min_by_key(|(_, d)| d.used)
            .map(|(p, d)| (p.clone(), d.lease))
    }

    /// Forget `dir` (its lease was given back).
    pub(crate) fn forget(&mut self, dir: &str) {
        self.gen += 1;
        if let Some(d) = self.dirs.remove(&canonical(dir)) {
            self.by_id.remove(&d.lease);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lwio_side::types::FileKind;

    fn attr(size: u64) -> AttrX {
        AttrX {
            kind: FileKind::File,
            perm: 0o644,
            size,
            ino: size,
            nlink: 1,
            uid: 0,
            gid: 0,
            blocks: 0,
            blksize: 4096,
            atime_ns: 0,
            mtime_ns: 0,
            ctime_ns: 0,
        }
    }

    #[test]
    fn paths() {
        assert_eq!(canonical("/a//b/./"), "a/b");
        assert_eq!(split("a/b/c"), Some(("a/b".into(), "c".into())));
        assert_eq!(split("c"), Some(("".into(), "c".into())));
        assert_eq!(split(""), None);
        assert!(within("a/b", "a") && within("a", "a") && !within("ab", "a"));
        assert!(within("x", ""));
    }

    #[test]
    fn own_writes_grow_the_cached_size_and_a_fetched_answer_is_kept_only_if_nothing_changed() {
        let mut c = LeaseCache::new(Duration::from_secs(60));
        assert!(c.granted("d", 7));
        c.install("d", 7, &vec![("f".into(), attr(100))]);
        // A write past the end grows the size and sets the times; one
        // inside it keeps the size.
        c.wrote("d", "f", 8192, 5);
        let Some(Hit::Found(a)) = c.lookup("d", "f") else {
            panic!("entry lost")
        };
        assert_eq!((a.size, a.blocks, a.mtime_ns, a.ctime_ns), (8192, 16, 5, 5));
        c.wrote("d", "f", 10, 6);
        assert!(
            matches!(c.lookup("d", "f"), Some(Hit::Found(a)) if a.size == 8192 && a.mtime_ns == 6)
        );
        // Stale (a rename onto it): a write leaves it stale, and an answer
        // fetched before a later change is not kept.
        c.stale("d", "f");
        c.wrote("d", "f", 9000, 7);
        assert_eq!(c.lookup("d", "f"), None);
        let g = c.gen();
        c.wrote("d", "f", 9500, 8);
        c.fill("d", "f", &attr(9000), g);
        assert_eq!(
            c.lookup("d", "f"),
            None,
            "a write landed while the answer travelled"
        );
        let g = c.gen();
        c.fill("d", "f", &attr(9500), g);
        assert_eq!(c.lookup("d", "f"), Some(Hit::Found(attr(9500))));
        // A name the listing lacks is not answered as absent after a write.
        c.wrote("d", "new", 1, 9);
        assert_eq!(c.lookup("d", "new"), None);
        // Broken: nothing is kept.
        let g = c.gen();
        c.broken(7);
        c.fill("d", "f", &attr(1), g);
        assert_eq!(c.lookup("d", "f"), None);
    }

    #[test]
    fn answers_from_the_listing_until_broken() {
        let mut c = LeaseCache::new(Duration::from_secs(60));
        assert_eq!(c.lookup("d", "f"), None, "no lease");
        assert!(c.granted("d", 7));
        assert_eq!(c.lookup("d", "f"), None, "leased but not listed");
        c.install("d", 7, &vec![("f".into(), attr(1))]);
        assert_eq!(c.lookup("d", "f"), Some(Hit::Found(attr(1))));
        assert_eq!(c.lookup("d", "g"), Some(Hit::Absent));
        assert_eq!(c.listing("/d/").unwrap().len(), 1);
        // Own changes keep the cache right.
        c.put("d", "g", &attr(2));
        c.del("d", "f");
        assert_eq!(c.lookup("d", "f"), Some(Hit::Absent));
        c.stale("d", "g");
        assert_eq!(c.lookup("d", "g"), None, "stale: ask the server");
        assert!(c.listing("d").is_none(), "a listing with a stale entry");
        c.put("d", "g", &attr(3));
        assert_eq!(c.lookup("d", "g"), Some(Hit::Found(attr(3))));
        // A break drops it all and names what the kernel may hold.
        assert_eq!(c.broken(7), Some(("d".into(), vec!["g".into()])));
        assert_eq!(c.lookup("d", "g"), None);
        assert_eq!(c.len(), 0);
    }

    #[test]
    fn a_break_before_its_grant_wins() {
        let mut c = LeaseCache::new(Duration::from_secs(60));
        assert_eq!(c.broken(9), None);
        assert!(!c.granted("d", 9));
        assert_eq!(c.lease_of("d"), None);
        // A listing for a lease broken in flight is not installed.
        assert!(c.granted("d", 10));
        c.broken(10);
        c.install("d", 10, &vec![]);
        assert_eq!(c.lookup("d", "x"), None);
    }

    #[test]
    fn listings_expire_and_trees_drop() {
        let mut c = LeaseCache::new(Duration::ZERO);
        c.granted("a", 1);
        c.install("a", 1, &vec![]);
        std::thread::sleep(Duration::from_millis(2));
        assert_eq!(c.lookup("a", "x"), None, "expired");
        let mut c = LeaseCache::new(Duration::from_secs(60));
        for (i, d) in ["a", "a/b", "ab", ""].iter().enumerate() {
            c.granted(d, i as u64 + 1);
        }
        let mut gone = c.drop_tree("a");
        gone.sort();
        assert_eq!(gone, vec![1, 2]);
        assert_eq!(c.len(), 2);
        assert_eq!(c.clear().len(), 2);
    }
}
