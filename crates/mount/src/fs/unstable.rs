//! Unstable writes (docs/mount.md): a write(2) is answered once its WRITE
//! is sent, as an NFS client answers before the server's reply; fsync(2)
//! sends its FLUSH behind the writes (the server orders it after them) and
//! then collects their answers; close(2) collects them too. An error is
//! reported by the next fsync or close of the file, as NFS does.
//!
//! Every other call that reads the file's data or attributes (read, getattr,
//! setattr, open, locks, lseek, …) first waits for the file's writes, so
//! nothing but the moment an error is reported changes: no call sees the
//! file without its written bytes, on this mount or, after a close or an
//! fsync, on any other.

use std::collections::HashMap;
use std::sync::{Condvar, Mutex};

use lwio_client::{File, PendingWrite};

use super::lock;
use crate::errno;

/// Writes a write again, waited for, through its open file (FUSE handle,
/// offset, bytes): the bytes written or the errno.
pub(crate) type Resend<'a> = &'a dyn Fn(u64, u64, &[u8]) -> Result<u32, i32>;

/// At most this many bytes are written and not yet answered, per mount
/// (a write beyond waits for the oldest): the copies kept to send them again
/// after a reconnect are bounded.
const MAX_BYTES: usize = 16 << 20;
/// At most this many writes unanswered, per mount.
const MAX_WRITES: usize = 1024;

/// One write sent and not answered yet, with what it needs to be sent again
/// (after a lost connection).
struct Entry {
    id: u64,
    fh: u64,
    offset: u64,
    data: Vec<u8>,
    pw: PendingWrite,
}

impl Entry {
    fn overlaps(&self, offset: u64, len: u64) -> bool {
        self.offset < offset.saturating_add(len) && offset < self.offset + self.data.len() as u64
    }
}

#[derive(Default)]
struct Node {
    pending: Vec<Entry>,
    /// Entries a waiter took out and is finishing.
    busy: usize,
    /// The first error of a write not yet reported (errno).
    error: Option<i32>,
}

#[derive(Default)]
struct State {
    nodes: HashMap<u64, Node>,
    bytes: usize,
    writes: usize,
    next: u64,
}

impl State {
    /// Writes of node `ino` that left the table (their bytes, and the errno
    /// of a failed one); a node with nothing left is forgotten.
    fn account(&mut self, ino: u64, done: impl IntoIterator<Item = (usize, Option<i32>)>) {
        let n = self.nodes.entry(ino).or_default();
        for (len, err) in done {
            self.bytes -= len;
            self.writes -= 1;
            if let Some(x) = err {
                n.error.get_or_insert(x);
            }
        }
        self.forget_if_empty(ino);
    }

    /// Forget node `ino` when nothing of it is left: no write pending or
    /// being finished, no error to report.
    fn forget_if_empty(&mut self, ino: u64) {
        if self
            .nodes
            .get(&ino)
            .is_some_and(|n| n.pending.is_empty() && n.busy == 0 && n.error.is_none())
        {
            self.nodes.remove(&ino);
        }
    }
}

/// The mount's unstable writes, by node.
#[derive(Default)]
pub(crate) struct Unstable {
    st: Mutex<State>,
    cv: Condvar,
}

/// How a write taken out of the table ended.
enum Outcome {
    Ok,
    Failed(i32),
    /// Its connection was lost: written again on the file's new one.
    Resent(Result<(), i32>),
}

impl Unstable {
    /// Whether any write is unanswered (cheap: for calls on directories,
    /// whose answers carry their entries' attributes).
    pub(crate) fn any(&self) -> bool {
        lock(&self.st).writes > 0
    }

    /// Whether node `ino` has unanswered writes.
    pub(crate) fn has(&self, ino: u64) -> bool {
        lock(&self.st)
            .nodes
            .get(&ino)
            .is_some_and(|n| !n.pending.is_empty() || n.busy > 0)
    }

    /// Record a write sent for node `ino` through open file `fh`.
    pub(crate) fn add(&self, ino: u64, fh: u64, offset: u64, data: Vec<u8>, pw: PendingWrite) {
        let mut st = lock(&self.st);
        st.next += 1;
        let id = st.next;
        st.bytes += data.len();
        st.writes += 1;
        st.nodes.entry(ino).or_default().pending.push(Entry {
            id,
            fh,
            offset,
            data,
            pw,
        });
    }

    /// Before a write of `len` bytes at `offset` to `ino`: wait for the
    /// node's writes it overlaps (two writes of the same bytes in flight at
    /// once could land in either order), take in the answers that came, and
    /// keep the table within its bounds.
    pub(crate) fn before_write(&self, ino: u64, offset: u64, len: usize, resend: Resend<'_>) {
        self.reap(ino);
        self.settle(ino, |e| e.overlaps(offset, len as u64), resend);
        loop {
            let oldest = {
                let st = lock(&self.st);
                if st.bytes + len <= MAX_BYTES && st.writes < MAX_WRITES {
                    return;
                }
                st.nodes
                    .iter()
                    .filter_map(|(i, n)| n.pending.first().map(|e| (e.id, *i)))
                    .min()
            };
            match oldest {
                Some((id, node)) => {
                    self.settle(node, |e| e.id == id, resend);
                }
                // All taken by other waiters: wait for one of them.
                None => {
                    let st = lock(&self.st);
                    if st.bytes + len <= MAX_BYTES && st.writes < MAX_WRITES {
                        return;
                    }
                    drop(self.cv.wait(st));
                }
            }
        }
    }

    /// Take in the node's answers that have come (never blocks).
    fn reap(&self, ino: u64) {
        let mut st = lock(&self.st);
        let Some(n) = st.nodes.get_mut(&ino) else {
            return;
        };
        let mut done = Vec::new();
        let mut i = 0;
        while i < n.pending.len() {
            let err = match n.pending[i].pw.poll() {
                None => None,
                Some(Ok(_)) => Some(None),
                // A lost connection needs the write sent again: left to a
                // waiter (not under this lock).
                Some(Err(lwio_client::Error::ConnectionLost(_))) => None,
                Some(Err(x)) => Some(Some(errno::client(x))),
            };
            match err {
                None => i += 1,
                Some(err) => done.push((n.pending.swap_remove(i).data.len(), err)),
            }
        }
        st.account(ino, done);
    }

    /// Wait for the node's writes that `pick` chooses (and for any other
    /// waiter's still finishing), sending again those whose connection was
    /// lost. Returns whether any was sent again.
    fn settle(&self, ino: u64, pick: impl Fn(&Entry) -> bool, resend: Resend<'_>) -> bool {
        let mut taken: Vec<Entry> = {
            let mut st = lock(&self.st);
            let Some(n) = st.nodes.get_mut(&ino) else {
                return false;
            };
            let (mine, rest): (Vec<Entry>, Vec<Entry>) =
                std::mem::take(&mut n.pending).into_iter().partition(&pick);
            n.pending = rest;
            n.busy += mine.len();
            mine
        };
        let mut resent = false;
        let mut results = Vec::with_capacity(taken.len());
        // In the order they were sent: a write sent again lands after the
        // ones before it.
        taken.sort_by_key(|e| e.id);
        for e in taken {
            let len = e.data.len();
            let out = match e.pw.wait() {
                Ok(_) => Outcome::Ok,
                Err(lwio_client::Error::ConnectionLost(_)) => {
                    Outcome::Resent(resend(e.fh, e.offset, &e.data).and_then(|n| {
                        if n as usize == len {
                            Ok(())
                        } else {
                            Err(libc::EIO)
                        }
                    }))
                }
                Err(x) => Outcome::Failed(errno::client(&x)),
            };
            results.push((len, out));
        }
        let mut st = lock(&self.st);
        st.nodes.entry(ino).or_default().busy -= results.len();
        let done = results.into_iter().map(|(len, out)| match out {
            Outcome::Ok => (len, None),
            Outcome::Failed(x) => (len, Some(x)),
            Outcome::Resent(r) => {
                resent = true;
                (len, r.err())
            }
        });
        st.account(ino, done);
        self.cv.notify_all();
        // Writes another waiter took out count too: wait for them.
        loop {
            let n = st.nodes.get(&ino);
            if n.is_none_or(|n| n.busy == 0) {
                break;
            }
            st = self.cv.wait(st).unwrap_or_else(|p| p.into_inner());
        }
        st.forget_if_empty(ino);
        resent
    }

    /// Wait for every write of `ino` (a read, getattr, setattr, lock, … of
    /// it). Errors stay for the next fsync or close.
    pub(crate) fn drain(&self, ino: u64, resend: Resend<'_>) {
        if self.has(ino) {
            self.settle(ino, |_| true, resend);
        }
    }

    /// Wait for every write of every node (a listing, whose entries carry
    /// their attributes).
    pub(crate) fn drain_all(&self, resend: Resend<'_>) {
        if !self.any() {
            return;
        }
        let inos: Vec<u64> = lock(&self.st).nodes.keys().copied().collect();
        for ino in inos {
            self.settle(ino, |_| true, resend);
        }
    }

    /// The node's first unreported write error, reported now (fsync, close).
    pub(crate) fn take_error(&self, ino: u64) -> Option<i32> {
        let mut st = lock(&self.st);
        let n = st.nodes.get_mut(&ino)?;
        let e = n.error.take();
        st.forget_if_empty(ino);
        e
    }

    /// fsync(2) of `ino` through `f`: the writes a FLUSH of `f` does not
    /// cover (another connection's) are waited for first, then `sync` runs
    /// (the server orders it after the others), then their answers are
    /// collected; if any had to be sent again, `sync` runs once more.
    pub(crate) fn fsync(
        &self,
        ino: u64,
        f: &File,
        sync: &dyn Fn() -> Result<(), i32>,
        resend: Resend<'_>,
    ) -> Result<(), i32> {
        let mut again = self.settle(ino, |e| !e.pw.covered_by_sync_of(f), resend);
        let r = sync();
        again |= self.settle(ino, |_| true, resend);
        let r = if again && r.is_ok() { sync() } else { r };
        match self.take_error(ino) {
            Some(e) => Err(e),
            None => r,
        }
    }
}
