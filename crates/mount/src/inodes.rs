//! The inode table: FUSE node ids for the paths the kernel has looked up.
//!
//! The side channel names files by path, FUSE by node id. A node lives from
//! its first lookup until the kernel forgets it (its lookup count drops to
//! zero). Renames move a node and everything beneath it; an unlinked node
//! keeps its last path until it is forgotten, but no longer answers to it.

use std::collections::HashMap;

pub(crate) const ROOT: u64 = 1;

struct Node {
    path: String,
    lookups: u64,
    /// Its name was removed (unlink, rmdir, replaced by a rename): it is
    /// reachable only through files still open on it.
    unlinked: bool,
    /// The server's inode number, as last seen (0: not seen): a file
    /// reopened after a reconnection must have the same.
    server_ino: u64,
}

pub(crate) struct Inodes {
    by_ino: HashMap<u64, Node>,
    by_path: HashMap<String, u64>,
    next: u64,
}

/// `parent/name` (the export root is the empty path).
pub(crate) fn join(parent: &str, name: &str) -> String {
    if parent.is_empty() {
        name.to_string()
    } else {
        format!("{parent}/{name}")
    }
}

impl Inodes {
    pub(crate) fn new(root: &str) -> Inodes {
        let mut t = Inodes {
            by_ino: HashMap::new(),
            by_path: HashMap::new(),
            next: ROOT + 1,
        };
        t.by_ino.insert(
            ROOT,
            Node {
                path: root.to_string(),
                lookups: 1,
                unlinked: false,
                server_ino: 0,
            },
        );
        t.by_path.insert(root.to_string(), ROOT);
        t
    }

    /// The path of a node that still has a name.
    pub(crate) fn path(&self, ino: u64) -> Option<String> {
        self.by_ino
            .get(&ino)
            .filter(|n| !n.unlinked)
            .map(|n| n.path.clone())
    }

    /// Record the server's inode number of node `ino`.
    pub(crate) fn set_server_ino(&mut self, ino: u64, server_ino: u64) {
        if let Some(n) = self.by_ino.get_mut(&ino) {
            n.server_ino = server_ino;
        }
    }

    /// The server's inode number of node `ino`, if seen.
    pub(crate) fn server_ino(&self, ino: u64) -> Option<u64> {
        self.by_ino
            .get(&ino)
            .map(|n| n.server_ino)
            .filter(|&i| i != 0)
    }

    /// The node of `path`, without counting a lookup.
    pub(crate) fn peek(&self, path: &str) -> Option<u64> {
        self.by_path.get(path).copied()
    }

    /// Count one kernel lookup of `path`: its node id (a new one the first
    /// time).
    pub(crate) fn lookup(&mut self, path: &str) -> u64 {
        if let Some(&ino) = self.by_path.get(path) {
            if let Some(n) = self.by_ino.get_mut(&ino) {
                n.lookups += 1;
            }
            return ino;
        }
        let ino = self.next;
        self.next += 1;
        self.by_ino.insert(
            ino,
            Node {
                path: path.to_string(),
                lookups: 1,
                unlinked: false,
                server_ino: 0,
            },
        );
        self.by_path.insert(path.to_string(), ino);
        ino
    }

    /// The kernel dropped `n` lookups of `ino`.
    pub(crate) fn forget(&mut self, ino: u64, n: u64) {
        if ino == ROOT {
            return;
        }
        let Some(node) = self.by_ino.get_mut(&ino) else {
            return;
        };
        node.lookups = node.lookups.saturating_sub(n);
        if node.lookups == 0 {
            let path = self.by_ino.remove(&ino).map(|n| n.path).unwrap_or_default();
            if self.by_path.get(&path) == Some(&ino) {
                self.by_path.remove(&path);
            }
        }
    }

    /// `path` no longer names its node (unlink, rmdir, or replaced by a
    /// rename).
    pub(crate) fn unlinked(&mut self, path: &str) {
        if let Some(ino) = self.by_path.remove(path) {
            if let Some(n) = self.by_ino.get_mut(&ino) {
                n.unlinked = true;
            }
        }
    }

    /// `from` was renamed to `to`: the node of `to` (if any) is replaced,
    /// and `from` and every node beneath it move.
    pub(crate) fn renamed(&mut self, from: &str, to: &str) {
        self.unlinked(to);
        self.move_tree(from, to);
    }

    /// `a` and `b` were exchanged (RENAME_EXCHANGE).
    pub(crate) fn exchanged(&mut self, a: &str, b: &str) {
        let tmp = format!("\0exchange\0{a}");
        self.move_tree(a, &tmp);
        self.move_tree(b, a);
        self.move_tree(&tmp, b);
    }

    fn move_tree(&mut self, from: &str, to: &str) {
        let prefix = format!("{from}/");
        let moved: Vec<(String, u64)> = self
            .by_path
            .iter()
            .filter(|(p, _)| p.as_str() == from || p.starts_with(&prefix))
            .map(|(p, &i)| (p.clone(), i))
            .collect();
        for (p, _) in &moved {
            self.by_path.remove(p);
        }
        for (p, ino) in moved {
            let new = format!("{to}{}", &p[from.len()..]);
            if let Some(n) = self.by_ino.get_mut(&ino) {
                n.path = new.clone();
            }
            self.by_path.insert(new, ino);
        }
    }

    /// Nodes in the table (for tests and bounds).
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.by_ino.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lookups_forgets_and_renames() {
        let mut t = Inodes::new("");
        let a = t.lookup("a");
        let ab = t.lookup("a/b");
        let abc = t.lookup("a/b/c");
        let ax = t.lookup("ax");
        assert_eq!(t.lookup("a"), a);
        t.renamed("a", "z");
        assert_eq!(t.path(a).unwrap(), "z");
        assert_eq!(t.path(ab).unwrap(), "z/b");
        assert_eq!(t.path(abc).unwrap(), "z/b/c");
        // "ax" shares a prefix with "a" but is not beneath it.
        assert_eq!(t.path(ax).unwrap(), "ax");
        assert_eq!(t.peek("a"), None);
        t.exchanged("z", "ax");
        assert_eq!(t.path(a).unwrap(), "ax");
        assert_eq!(t.path(ab).unwrap(), "ax/b");
        assert_eq!(t.path(ax).unwrap(), "z");
        // Two lookups of "a" (now "ax"): two forgets drop it.
        t.forget(a, 1);
        assert_eq!(t.peek("ax"), Some(a));
        t.forget(a, 1);
        assert_eq!(t.peek("ax"), None);
        assert_eq!(t.path(a), None);
        // Replaced by a rename: the old node no longer answers to the name.
        let y = t.lookup("y");
        t.renamed("z", "y");
        assert_eq!(t.peek("y"), Some(ax));
        // The replaced node no longer has a name (only its open files).
        assert_eq!(t.path(y), None);
        t.forget(y, 1);
        assert_eq!(t.peek("y"), Some(ax));
        t.forget(ROOT, 10);
        assert_eq!(t.path(ROOT).unwrap(), "");
        assert_eq!(t.len(), 4);
    }
}
