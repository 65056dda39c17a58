//! Read buffers: where the server puts a file's bytes before it
//! RDMA-Writes them to the client.
//!
//! A read of up to [`SLOTS`]`[1]` bytes gets a slot of one of its
//! reactor's two [`ReadSlab`]s: slots of 4 KiB (a 4 KiB random read, the
//! common case) or 64 KiB, carved from regions of [`CHUNK_BYTES`]
//! registered together. Larger reads, and connections without a reactor
//! domain (their own protection domain), get a region of their own, kept
//! for the connection's next reads.
//!
//! Why (issue 13, bench/RESULTS.md "read buffers carved from shared
//! regions"): with a region per read, 256 connections at queue depth 8
//! kept 2,048 regions in flight, and every I/O touched the cold state of
//! its own one (the provider's key lookup, the region's reference count)
//! — the largest part of the server's CPU per I/O growing with the number
//! of connections. Slots of a few shared regions keep that state hot, and
//! a slot given back is the next one taken (last in, first out), its bytes
//! still in cache. And a 4 KiB read holds 4 KiB of the registered-memory
//! budget, not 64 KiB: 1,000 clients with 8 such reads in flight each take
//! 31 MiB of the 512 MiB default, not all of it; nor does a connection that
//! read once keep spare regions of its own while it idles.
//!
//! Memory: a chunk is registered against the server's budget
//! ([`Shared::register`]) when no slot is free, and unregistered when all
//! its slots are free and the slab holds at least another chunk's worth of
//! free slots, or when the slab has no connection left. So an idle server
//! holds no read memory, and a busy one at most one spare chunk per
//! reactor beyond what its reads use.

use std::sync::{Arc, Mutex};

use lwio_proto::NtStatus;
use lwio_rdma::{Access, Mr, MrSliceMut, Pd, Sge};

use super::driver::{lock, Shared};

/// Bytes of a slot of each of a reactor's slabs.
pub(super) const SLOTS: [usize; 2] = [4 << 10, 64 << 10];
/// Bytes of one registered chunk.
pub(super) const CHUNK_BYTES: usize = 1 << 20;

/// A read's buffer: `len` bytes at `base` of `mr`, either a slot of a
/// [`ReadSlab`] (given back when the last holder drops it) or a region of
/// its own.
pub struct ReadBuffer {
    // Declared before `lease`, so dropped first: when the slab gets the slot
    // back, this reference to its chunk is already gone.
    mr: Arc<Mr>,
    base: usize,
    len: usize,
    lease: Option<Lease>,
}

/// A slot of a slab, given back on drop.
struct Lease {
    slab: Arc<ReadSlab>,
    slot: usize,
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.slab.put(self.slot);
    }
}

impl ReadBuffer {
    /// A buffer that is a whole region of its own.
    pub(super) fn own(mr: Mr) -> ReadBuffer {
        ReadBuffer {
            len: mr.len(),
            mr: Arc::new(mr),
            base: 0,
            lease: None,
        }
    }

    /// The region back, if this buffer is one of its own and nobody else
    /// holds it (to keep for the next read, or to unregister).
    pub(super) fn into_own(self) -> Option<Mr> {
        if self.lease.is_some() {
            return None;
        }
        Arc::try_unwrap(self.mr).ok()
    }

    /// A slab's slot (not a region of its own).
    pub(super) fn is_slot(&self) -> bool {
        self.lease.is_some()
    }

    pub(crate) fn addr(&self) -> u64 {
        self.mr.addr() + self.base as u64
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// An SGE for `len` bytes at `off` of this buffer (`off + len` must be
    /// within it: the caller checks, as for [`Mr::sge`]).
    pub(super) fn sge(&self, off: usize, len: u32) -> Sge {
        self.mr.sge(self.base + off, len)
    }

    fn check(&self, off: usize, len: usize) -> lwio_rdma::Result<()> {
        match off.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(lwio_rdma::Error::InvalidArgument(format!(
                "range {off}+{len} outside a read buffer of {} bytes",
                self.len
            ))),
        }
    }

    /// A bounds-checked view of `len` bytes at `off` that can also write.
    pub(crate) fn slice_mut(&self, off: usize, len: usize) -> lwio_rdma::Result<MrSliceMut<'_>> {
        self.check(off, len)?;
        self.mr.slice_mut(self.base + off, len)
    }

    /// Copy bytes into the buffer.
    pub(crate) fn write_at(&self, off: usize, src: &[u8]) -> lwio_rdma::Result<()> {
        self.slice_mut(off, src.len())?.write_at(0, src)
    }
}

/// Put a newly registered chunk of `n` slots, all free, in the first
/// empty place of `chunks` (growing it); its index. (The receive pool's
/// chunks too.)
pub(super) fn place_chunk(
    chunks: &mut Vec<Option<Arc<Mr>>>,
    chunk_free: &mut Vec<usize>,
    mr: Mr,
    n: usize,
) -> usize {
    let c = match chunks.iter().position(Option::is_none) {
        Some(c) => c,
        None => {
            chunks.push(None);
            chunk_free.push(0);
            chunks.len() - 1
        }
    };
    chunks[c] = Some(Arc::new(mr));
    chunk_free[c] = n;
    c
}

/// One reactor's read slots on one device (its protection domain).
pub(crate) struct ReadSlab {
    pd: Pd,
    /// Bytes of a slot.
    slot: usize,
    /// Slots of a chunk.
    per_chunk: usize,
    shared: Arc<Shared>,
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    /// Registered chunks by index (None: unregistered); slot `s` is slot
    /// `s % per_chunk` of chunk `s / per_chunk`.
    chunks: Vec<Option<Arc<Mr>>>,
    /// Free slots of each chunk.
    chunk_free: Vec<usize>,
    /// Free slots, the last given back on top.
    free: Vec<usize>,
    /// Connections that may take slots.
    users: usize,
}

/// What the read slabs hold (for metrics and tests).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReadSlabStats {
    /// Registered for slabs.
    pub registered_bytes: usize,
    /// In slots holding a read's data.
    pub in_use_bytes: usize,
}

impl ReadSlab {
    /// A slab of `slot`-byte slots (a divisor of [`CHUNK_BYTES`]).
    pub(super) fn new(pd: Pd, shared: Arc<Shared>, slot: usize) -> ReadSlab {
        let slot = slot.clamp(1, CHUNK_BYTES);
        ReadSlab {
            pd,
            slot,
            per_chunk: CHUNK_BYTES / slot,
            shared,
            inner: Mutex::new(Inner::default()),
        }
    }

    /// A connection starts taking slots.
    pub(super) fn attach(&self) {
        lock(&self.inner).users += 1;
    }

    /// A connection stops; with the last one gone, wholly free chunks are
    /// unregistered (the rest as their slots come back).
    pub(super) fn detach(&self) {
        let mut i = lock(&self.inner);
        i.users = i.users.saturating_sub(1);
        if i.users == 0 {
            for c in 0..i.chunks.len() {
                if i.chunks[c].is_some() && i.chunk_free[c] == self.per_chunk {
                    self.drop_chunk(&mut i, c);
                }
            }
        }
    }

    /// A free slot, registering a chunk if none is free (`Err`: the budget
    /// or the provider refused).
    pub(super) fn take(self: &Arc<Self>) -> Result<ReadBuffer, NtStatus> {
        let n = self.per_chunk;
        let mut i = lock(&self.inner);
        let slot = match i.free.pop() {
            Some(s) => s,
            None => {
                let mr = self
                    .shared
                    .register(&self.pd, self.slot * n, Access::LOCAL_WRITE)?;
                let inner = &mut *i;
                let c = place_chunk(&mut inner.chunks, &mut inner.chunk_free, mr, n);
                // Slot 0 on top.
                i.free.extend((c * n..(c + 1) * n).rev());
                i.free.pop().unwrap_or(c * n)
            }
        };
        let c = slot / n;
        i.chunk_free[c] -= 1;
        let Some(mr) = i.chunks[c].clone() else {
            // Unreachable: a free slot's chunk is registered.
            return Err(lwio_proto::status::STATUS_INSUFFICIENT_RESOURCES);
        };
        drop(i);
        Ok(ReadBuffer {
            mr,
            base: (slot % n) * self.slot,
            len: self.slot,
            lease: Some(Lease {
                slab: self.clone(),
                slot,
            }),
        })
    }

    fn put(&self, slot: usize) {
        let mut i = lock(&self.inner);
        let n = self.per_chunk;
        let c = slot / n;
        i.free.push(slot);
        i.chunk_free[c] += 1;
        if i.chunk_free[c] == n && (i.users == 0 || i.free.len() >= 2 * n) {
            self.drop_chunk(&mut i, c);
        }
    }

    /// Unregister wholly free chunk `c`.
    fn drop_chunk(&self, i: &mut Inner, c: usize) {
        let n = self.per_chunk;
        i.free.retain(|s| s / n != c);
        i.chunk_free[c] = 0;
        if let Some(mr) = i.chunks[c].take() {
            let len = mr.len();
            match Arc::try_unwrap(mr) {
                Ok(mr) => self.shared.unregister(mr),
                // Not expected (every slot is back, and a buffer drops its
                // reference before its lease); freed when the last goes.
                Err(_) => self.shared.forget(len),
            }
        }
    }

    pub(super) fn usage(&self) -> ReadSlabStats {
        let i = lock(&self.inner);
        let slots = i.chunks.iter().flatten().count() * self.per_chunk;
        ReadSlabStats {
            registered_bytes: slots * self.slot,
            in_use_bytes: (slots - i.free.len()) * self.slot,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::io_phase::driver::RdmaServerOptions;
    use std::sync::atomic::Ordering;

    fn slab(max_memory: usize, slot: usize) -> (Arc<ReadSlab>, Arc<Shared>) {
        let ctx = lwio_rdma::soft::provider()
            .open(None, &lwio_rdma::Config::default())
            .expect("soft device");
        let pd = ctx.alloc_pd().expect("pd");
        let shared = Arc::new(Shared::new(RdmaServerOptions {
            max_memory,
            ..RdmaServerOptions::default()
        }));
        (Arc::new(ReadSlab::new(pd, shared.clone(), slot)), shared)
    }

    fn used(shared: &Shared) -> usize {
        shared.mem_used.load(Ordering::Relaxed)
    }

    /// Slots are disjoint, bounded, reused last in first out; chunks come
    /// and go with the load, and the budget counts exactly what is
    /// registered.
    #[test]
    fn slots_are_disjoint_reused_and_chunks_follow_the_load() {
        for slot in SLOTS {
            slots_of(slot);
        }
    }

    fn slots_of(slot: usize) {
        #[allow(non_snake_case)]
        let (SLOT, CHUNK) = (slot, CHUNK_BYTES / slot);
        let (s, shared) = slab(64 << 20, SLOT);
        s.attach();
        let bufs: Vec<ReadBuffer> = (0..3 * CHUNK).map(|_| s.take().unwrap()).collect();
        let all = 3 * CHUNK_BYTES;
        assert_eq!(
            s.usage(),
            ReadSlabStats {
                registered_bytes: all,
                in_use_bytes: all
            }
        );
        assert_eq!(used(&shared), 3 * CHUNK * SLOT);
        // Each slot its own SLOT bytes: write a tag into every one, read
        // them all back.
        for (n, b) in bufs.iter().enumerate() {
            assert_eq!(b.len(), SLOT);
            b.write_at(0, &vec![n as u8; SLOT]).unwrap();
        }
        let mut ranges: Vec<(u64, u64)> = bufs
            .iter()
            .map(|b| (b.addr(), b.addr() + SLOT as u64))
            .collect();
        ranges.sort();
        assert!(ranges.windows(2).all(|w| w[0].1 <= w[1].0), "slots overlap");
        for (n, b) in bufs.iter().enumerate() {
            let v = b.slice_mut(0, SLOT).unwrap();
            let mut got = vec![0u8; SLOT];
            v.read_at(0, &mut got).unwrap();
            assert!(
                got.iter().all(|&x| x == n as u8),
                "slot {n} was overwritten"
            );
        }
        // Out of bounds is an error, not a write into the neighbour.
        assert!(bufs[0].write_at(SLOT - 1, &[1, 2]).is_err());
        assert!(bufs[0].slice_mut(1, SLOT).is_err());
        assert!(bufs[0].slice_mut(usize::MAX, 2).is_err());

        // Last in, first out.
        let mut bufs = bufs;
        let last = bufs.pop().unwrap();
        let at = last.addr();
        drop(last);
        let again = s.take().unwrap();
        assert_eq!(again.addr(), at);
        bufs.push(again);

        // All back, none in use: a chunk is kept while another chunk's
        // worth of slots is free elsewhere, so at most two stay.
        drop(bufs);
        let st = s.usage();
        assert!(st.registered_bytes <= 2 * CHUNK_BYTES, "{st:?}");
        assert_eq!(used(&shared), st.registered_bytes);
        // The last connection gone: nothing stays registered.
        s.detach();
        assert_eq!(s.usage(), ReadSlabStats::default());
        assert_eq!(used(&shared), 0);
    }

    /// A slot held past its connection's end (a storage job still reading
    /// into it) is freed when it comes back.
    #[test]
    fn a_slot_held_past_the_last_connection_is_freed_when_it_returns() {
        let (s, shared) = slab(64 << 20, SLOTS[0]);
        s.attach();
        let held = Arc::new(s.take().unwrap());
        let job = held.clone();
        drop(held);
        s.detach();
        assert_eq!(used(&shared), CHUNK_BYTES, "still in use");
        drop(job);
        assert_eq!(s.usage(), ReadSlabStats::default());
        assert_eq!(used(&shared), 0);
    }

    /// The budget bounds the slab: a chunk that does not fit is refused
    /// with the status, and nothing is counted for it.
    #[test]
    #[allow(non_snake_case)]
    fn the_budget_refuses_a_chunk_it_cannot_hold() {
        let (SLOT, CHUNK) = (SLOTS[1], CHUNK_BYTES / SLOTS[1]);
        let (s, shared) = slab(CHUNK * SLOT + SLOT, SLOT);
        s.attach();
        let a: Vec<ReadBuffer> = (0..CHUNK).map(|_| s.take().unwrap()).collect();
        assert_eq!(
            s.take().err(),
            Some(lwio_proto::status::STATUS_INSUFFICIENT_RESOURCES)
        );
        assert_eq!(used(&shared), CHUNK * SLOT);
        drop(a);
        s.detach();
        assert_eq!(used(&shared), 0);
    }
}
