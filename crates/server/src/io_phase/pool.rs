//! The shared receive pool (issue 13): the receive buffers of all of one
//! reactor's connections on one device, posted to one shared receive queue
//! (SRQ), sized by the credits actually granted — not by connections ×
//! maximum credits.
//!
//! Every credit a connection holds is a Send its client may make, and every
//! Send takes a receive. So the pool keeps `posted + in_use ≥ promised`,
//! where `promised` is the sum of the credits its connections hold and
//! `in_use` the buffers holding messages not yet handed back: each
//! connection uses at most its credits' worth, so whatever it may still
//! send finds a receive (iWARP has no receiver-not-ready retry: a Send
//! with none is fatal on siw). A connection promises before it grants
//! ([`RecvPool::reserve`], which posts what the promise needs, registering
//! more buffers within the server's registered-memory budget) and stops
//! promising when the client has given credits back
//! ([`RecvPool::release`]). A buffer handed back is posted again only
//! while the promises need it; else it stays free. Where the provider can
//! take untaken receives back (the soft provider's `Srq::withdraw`),
//! `release` does, and a chunk of buffers that is wholly free is
//! unregistered.
//! Devices keep surplus receives posted until traffic consumes them.
//!
//! Where a Send that finds the queue empty waits instead of failing (the
//! soft provider: it buffers the Send under the QP's indicate window and
//! stops reading that socket until a receive is posted, seed 003), the
//! pool does not back every connection's *first* credit with a buffer of
//! its own: those are backed together by a reserve of
//! [`idle_reserve`] buffers (`overcommit`). An idle connection, brought
//! down to one credit, then costs the pool a fraction of a buffer; if more
//! idle connections send at once than the reserve holds, the later ones
//! wait in TCP until a buffer comes back. Credits beyond the first are
//! always backed one for one, so a fragmented message — which needs all
//! its credits at once — never waits on another connection's buffers.

use std::sync::{Arc, Mutex};

use lwio_proto::wrid;
use lwio_rdma::{Access, Mr, Pd, RecvWr, Srq};
use tracing::{debug, warn};

use super::driver::{lock, Shared};

/// Buffers per registered chunk.
const CHUNK: usize = 16;

pub(super) struct RecvPool {
    srq: Srq,
    pd: Pd,
    /// Bytes of one receive buffer.
    slot: usize,
    shared: Arc<Shared>,
    /// A Send finding no receive waits (see the module's doc): first
    /// credits share the [`idle_reserve`].
    overcommit: bool,
    inner: Mutex<Inner>,
}

/// Buffers that back the first credits of `holders` connections together
/// when the pool overcommits: a chunk, plus one per 32 connections.
pub(super) fn idle_reserve(holders: usize) -> usize {
    holders.min(CHUNK + holders / 32)
}

#[derive(Default)]
struct Inner {
    /// Registered chunks by index (None: unregistered); buffer `id` is
    /// slot `id % CHUNK` of chunk `id / CHUNK`.
    chunks: Vec<Option<Arc<Mr>>>,
    /// Free buffers of each chunk (counted to unregister whole chunks).
    chunk_free: Vec<usize>,
    /// Registered buffers neither posted nor in use.
    free: Vec<u64>,
    in_use: usize,
    promised: usize,
    /// Connections promising at least one credit.
    holders: usize,
    /// Receives posted since the pool was made (tests: the cost of
    /// compaction).
    posts: u64,
}

impl Inner {
    /// Chunks registered now.
    fn registered_chunks(&self) -> usize {
        self.chunks.iter().flatten().count()
    }
}

/// What the pool holds (for metrics and tests).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolStats {
    pub registered_bytes: usize,
    pub posted: usize,
    pub in_use: usize,
    pub promised: usize,
    /// Times a Send found the pool's SRQ empty and waited (overcommitted
    /// first credits all used at once).
    pub starved: u64,
}

impl RecvPool {
    pub(super) fn new(
        pd: Pd,
        srq: Srq,
        slot: usize,
        shared: Arc<Shared>,
        overcommit: bool,
    ) -> RecvPool {
        RecvPool {
            srq,
            pd,
            slot,
            shared,
            overcommit,
            inner: Mutex::new(Inner::default()),
        }
    }

    /// Receive bytes an idle connection (one credit) costs the pool: a
    /// buffer, or its share of the reserve when the pool overcommits.
    pub(super) fn idle_bytes(&self) -> usize {
        if self.overcommit {
            self.slot.div_ceil(32)
        } else {
            self.slot
        }
    }

    pub(super) fn srq(&self) -> &Srq {
        &self.srq
    }

    /// The region and offset of buffer `id`.
    pub(super) fn buf(&self, id: u64) -> Option<(Arc<Mr>, usize)> {
        let i = lock(&self.inner);
        let c = i.chunks.get(id as usize / CHUNK)?.as_ref()?;
        Some((c.clone(), (id as usize % CHUNK) * self.slot))
    }

    pub(super) fn stats(&self) -> PoolStats {
        let i = lock(&self.inner);
        PoolStats {
            registered_bytes: i.registered_chunks() * CHUNK * self.slot,
            posted: self.srq.posted(),
            in_use: i.in_use,
            promised: i.promised,
            starved: self.srq.starved(),
        }
    }

    /// Receives that `promised` credits of `holders` connections need
    /// posted or in use.
    fn need(&self, promised: usize, holders: usize) -> usize {
        if self.overcommit {
            promised.saturating_sub(holders) + idle_reserve(holders)
        } else {
            promised
        }
    }

    /// Promise up to `want` more credits, at least `min` or none, for a
    /// connection that promised none so far if `first`: posts the receives
    /// the promises need. Returns how many were promised.
    pub(super) fn reserve(&self, want: usize, min: usize, first: bool) -> usize {
        let mut i = lock(&self.inner);
        let mut have = self.srq.posted() + i.in_use;
        let holders = i.holders + usize::from(first);
        let mut got = 0;
        while got < want {
            if self.need(i.promised + got + 1, holders) > have {
                if !self.post_one(&mut i) {
                    break;
                }
                have += 1;
            }
            got += 1;
        }
        if got < min {
            // Undo: the surplus stays posted (used by the next promise).
            return 0;
        }
        i.promised += got;
        i.holders = holders;
        got
    }

    /// Post one buffer (free, or from a new chunk); false if the budget is
    /// spent.
    fn post_one(&self, i: &mut Inner) -> bool {
        if i.free.is_empty() && !self.grow(i) {
            return false;
        }
        let Some(id) = i.free.pop() else {
            return false;
        };
        self.post(i, id)
    }

    fn post(&self, i: &mut Inner, id: u64) -> bool {
        let c = id as usize / CHUNK;
        let Some(mr) = i.chunks.get(c).and_then(|m| m.clone()) else {
            return false;
        };
        let sge = [mr.sge((id as usize % CHUNK) * self.slot, self.slot as u32)];
        let wr = RecvWr {
            wr_id: wrid::RECV | id,
            sg_list: &sge,
        };
        match self.srq.post_recv(&[wr]) {
            Ok(()) => {
                i.chunk_free[c] -= 1;
                i.posts += 1;
                true
            }
            Err(e) => {
                warn!(error = %e.error, "cannot post to the shared receive queue");
                i.free.push(id);
                false
            }
        }
    }

    /// Register one more chunk within the budget.
    fn grow(&self, i: &mut Inner) -> bool {
        let Ok(mr) = self
            .shared
            .register(&self.pd, CHUNK * self.slot, Access::LOCAL_WRITE)
        else {
            debug!("receive pool: registered-memory budget spent");
            return false;
        };
        let c = super::readbuf::place_chunk(&mut i.chunks, &mut i.chunk_free, mr, CHUNK);
        i.free
            .extend((0..CHUNK).rev().map(|k| (c * CHUNK + k) as u64));
        true
    }

    /// Stop promising `n` credits (all of one connection's if `last`): take
    /// back the receives no promise needs where the provider can, and
    /// unregister wholly free chunks.
    ///
    /// Compaction: when the chunks registered beyond what the promises
    /// need are a whole chunk and an eighth of all registered (hysteresis),
    /// the untaken receives of the chunks above the lowest ones that hold
    /// the need are taken back (`Srq::withdraw_if`), and as many posted
    /// again from those lowest chunks, so the others empty and go. A Send
    /// arriving meanwhile waits in the provider's indicate window (seed
    /// 003). The work is a scan of the queue, done after at least an
    /// eighth of the pool has become surplus: amortized, a few steps per
    /// buffer freed. (Taking every receive back and posting the needed
    /// ones again on each release, as this first did, stalled a reactor
    /// for seconds when a thousand new connections were brought down to
    /// one credit at once.)
    pub(super) fn release(&self, n: usize, last: bool) {
        let mut i = lock(&self.inner);
        i.promised = i.promised.saturating_sub(n);
        if last {
            i.holders = i.holders.saturating_sub(1);
        }
        let need = self.need(i.promised, i.holders);
        let chunks = i.registered_chunks();
        let surplus = chunks.saturating_sub(need.div_ceil(CHUNK));
        let posted = self.srq.posted();
        if surplus > chunks / 8 {
            // The lowest registered chunks that hold `need` are kept.
            let mut room = 0;
            let mut cut = i.chunks.len();
            for (c, m) in i.chunks.iter().enumerate() {
                if room >= need {
                    cut = c;
                    break;
                }
                if m.is_some() {
                    room += CHUNK;
                }
            }
            let back = self
                .srq
                .withdraw_if(|w| wrid::value(w) as usize / CHUNK >= cut);
            self.freed(&mut i, &back);
            // Post again from the kept chunks' free buffers (lowest first).
            let mut kept: Vec<u64> = Vec::new();
            i.free.retain(|&id| {
                let low = (id as usize / CHUNK) < cut;
                if low {
                    kept.push(id);
                }
                !low
            });
            kept.sort_unstable_by(|a, b| b.cmp(a));
            while self.srq.posted() + i.in_use < need {
                let Some(id) = kept.pop() else { break };
                if !self.post(&mut i, id) {
                    break;
                }
            }
            i.free.extend(kept);
            // Still short (buffers of the high chunks in use): as reserve.
            while self.srq.posted() + i.in_use < need {
                if !self.post_one(&mut i) {
                    break;
                }
            }
        } else {
            let take = (posted + i.in_use).saturating_sub(need).min(posted);
            if take > 0 {
                let back = self.srq.withdraw(take);
                self.freed(&mut i, &back);
            }
        }
        self.shrink(&mut i);
    }

    /// Receives taken back from the SRQ: their buffers are free.
    fn freed(&self, i: &mut Inner, ids: &[u64]) {
        for &w in ids {
            let id = wrid::value(w);
            if let Some(f) = i.chunk_free.get_mut(id as usize / CHUNK) {
                *f += 1;
            }
            i.free.push(id);
        }
    }

    /// Unregister chunks none of whose buffers is posted or in use.
    fn shrink(&self, i: &mut Inner) {
        let whole: Vec<usize> = (0..i.chunks.len())
            .filter(|&c| i.chunks[c].is_some() && i.chunk_free[c] == CHUNK)
            .collect();
        if whole.is_empty() {
            return;
        }
        let mut gone = vec![false; i.chunks.len()];
        for &c in &whole {
            gone[c] = true;
        }
        i.free.retain(|&id| !gone[id as usize / CHUNK]);
        for c in whole {
            if let Some(mr) = i.chunks[c].take() {
                match Arc::try_unwrap(mr) {
                    Ok(mr) => self.shared.unregister(mr),
                    Err(mr) => {
                        // A storage job still writes from it (a
                        // reassembled message of a closed connection):
                        // freed when that job ends.
                        self.shared.forget(mr.len());
                    }
                }
            }
            i.chunk_free[c] = 0;
        }
    }

    /// A receive completed (with a message, or flushed): its buffer is in
    /// use until handed back. (What is posted is the SRQ's own count: a
    /// receive a QP took whose completion is never polled — its
    /// connection gone — then errs towards posting one more, never one
    /// fewer.)
    pub(super) fn taken(&self) {
        lock(&self.inner).in_use += 1;
    }

    /// Buffers handed back: posted again while the promises need them,
    /// else kept free.
    pub(super) fn give_back(&self, ids: &[u64]) {
        let mut i = lock(&self.inner);
        let need = self.need(i.promised, i.holders);
        for &id in ids {
            i.in_use = i.in_use.saturating_sub(1);
            let c = id as usize / CHUNK;
            if i.chunks.get(c).is_none_or(|m| m.is_none()) {
                continue;
            }
            i.chunk_free[c] += 1;
            if self.srq.posted() + i.in_use < need {
                // (A failed post keeps it free.)
                self.post(&mut i, id);
            } else {
                i.free.push(id);
            }
        }
    }

    /// Buffers that will never come back (a closed connection's storage
    /// job that outlived it): no longer counted in use.
    pub(super) fn lose(&self, n: usize) {
        let mut i = lock(&self.inner);
        i.in_use = i.in_use.saturating_sub(n);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::io_phase::driver::RdmaServerOptions;
    use std::sync::atomic::Ordering;

    const SLOT: usize = 256;

    fn pool(max_memory: usize) -> (RecvPool, Arc<Shared>) {
        let ctx = lwio_rdma::soft::provider()
            .open(None, &lwio_rdma::Config::default())
            .expect("soft device");
        let pd = ctx.alloc_pd().expect("pd");
        let srq = pd.create_srq(16_384, 1).expect("srq");
        let shared = Arc::new(Shared::new(RdmaServerOptions {
            max_memory,
            ..RdmaServerOptions::default()
        }));
        (RecvPool::new(pd, srq, SLOT, shared.clone(), true), shared)
    }

    fn check(p: &RecvPool) -> (usize, usize) {
        let i = lock(&p.inner);
        let need = p.need(i.promised, i.holders);
        assert!(
            p.srq.posted() + i.in_use >= need,
            "posted {} + in use {} < need {need}",
            p.srq.posted(),
            i.in_use
        );
        (need, i.registered_chunks())
    }

    /// A thousand connections granted 16 credits each, then brought down
    /// to one, then gone: every promise stays backed, the pool shrinks to
    /// what the promises need, and it posts a bounded number of receives
    /// on the way (taking every receive back and posting the needed ones
    /// again on each release posted about seven million here, and
    /// stalled a reactor for seconds in `hostile_peers`).
    #[test]
    fn a_thousand_connections_come_and_go_with_bounded_work() {
        let (p, shared) = pool(1 << 30);
        for _ in 0..1000 {
            assert_eq!(p.reserve(16, 1, true), 16);
        }
        let (need, _) = check(&p);
        assert_eq!(need, 15 * 1000 + idle_reserve(1000));
        let posts = lock(&p.inner).posts;
        assert_eq!(posts as usize, need, "one post per needed receive");
        for _ in 0..1000 {
            p.release(15, false);
            check(&p);
        }
        let (need, chunks) = check(&p);
        assert_eq!(need, idle_reserve(1000));
        let kept = need.div_ceil(CHUNK);
        assert!(
            chunks < kept + 1 + chunks / 8 + 1,
            "{chunks} chunks registered for {need} receives"
        );
        assert_eq!(
            shared.mem_used.load(Ordering::Relaxed),
            chunks * CHUNK * SLOT,
            "the budget counts what is registered"
        );
        let reposted = lock(&p.inner).posts - posts;
        assert!(
            reposted <= (kept * CHUNK) as u64,
            "{reposted} receives posted again while shrinking"
        );
        for _ in 0..1000 {
            p.release(1, true);
            check(&p);
        }
        let st = p.stats();
        assert_eq!((st.promised, st.posted, st.registered_bytes), (0, 0, 0));
        assert_eq!(shared.mem_used.load(Ordering::Relaxed), 0);
    }

    /// Growing again after a compaction reuses the kept chunks' buffers
    /// first and backs every promise.
    #[test]
    fn promises_after_a_compaction_are_backed() {
        let (p, _shared) = pool(1 << 30);
        for _ in 0..100 {
            p.reserve(16, 1, true);
        }
        for _ in 0..90 {
            p.release(15, false);
            check(&p);
        }
        for _ in 0..90 {
            assert_eq!(p.reserve(15, 1, false), 15);
            check(&p);
        }
        let (need, chunks) = check(&p);
        assert_eq!(need, 1500 + idle_reserve(100));
        assert_eq!(chunks, need.div_ceil(CHUNK), "no chunk beyond the need");
    }
}
