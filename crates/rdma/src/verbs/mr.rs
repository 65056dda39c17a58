//! Registered memory: page-aligned buffers to register, memory regions,
//! and bounded views of them ([`MrSlice`], [`MrSliceMut`]) that never form a
//! Rust reference over bytes a peer may write.
//!
//! # Why the safe copies are sound
//! Every copy and word access of [`Mr`], [`MrSlice`] and [`MrSliceMut`]
//! runs under the region's CPU lock, shared to read the bytes and exclusive
//! to write them. With the soft provider that lock is the region's fence,
//! which the engine thread takes for every access it makes to the region's
//! bytes (placements exclusive, transmission shared: `soft::mem`), so an
//! application copy and an engine access to the same bytes are never
//! concurrent, whenever the application copies and whatever the peer
//! sends; with a hardware provider it is a lock of the `Mr`'s own, which
//! orders the application's threads among themselves, and the device's
//! DMA is outside the Rust abstract machine. A copy made before the
//! completion that covers the bytes sees them old, new or partly placed
//! (a protocol question), never a data race.

use super::*;

/// A page-aligned, zero-initialised buffer for registration.
///
/// It is its own anonymous mapping (`mmap`), not heap memory: registered
/// buffers are large and long-lived, pinned by RDMA devices page by page, and
/// must go back to the system when dropped. (From the heap, glibc's dynamic
/// mmap threshold would keep freed buffers in the process, which a server that
/// accepts and drops many connections cannot afford.)
pub struct RegBuf {
    pub(super) ptr: *mut u8,
    pub(super) len: usize,
    map_len: usize,
}

// SAFETY: RegBuf exclusively owns its mapping and never reads or writes the
// bytes itself: it only hands out a raw pointer, and whoever dereferences that
// pointer (a provider, `Mr`'s accessors, `RegisteredBuf`) answers for the
// synchronisation of its accesses. Nothing in it is tied to a thread.
unsafe impl Send for RegBuf {}
unsafe impl Sync for RegBuf {}

impl RegBuf {
    pub const ALIGN: usize = 4096;

    pub fn new(len: usize) -> Result<RegBuf> {
        let map_len = len
            .max(1)
            .checked_next_multiple_of(Self::ALIGN)
            .ok_or_else(|| Error::InvalidArgument(format!("buffer of {len} bytes")))?;
        // SAFETY: a fresh private anonymous mapping aliases nothing; the
        // kernel zero-fills it and aligns it to the page size (4096 here).
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(Error::ResourceExhausted(format!(
                "cannot map {len} bytes: {}",
                std::io::Error::last_os_error()
            )));
        }
        Ok(RegBuf {
            ptr: ptr.cast(),
            len,
            map_len,
        })
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }
}

impl Drop for RegBuf {
    fn drop(&mut self) {
        // SAFETY: mapped in `new` with exactly this length; dropped once. The
        // provider holds an `Arc<RegBuf>` for as long as the registration or a
        // work request can touch the memory, so nothing accesses it after this.
        unsafe { libc::munmap(self.ptr.cast(), self.map_len) };
    }
}

/// A memory region. Dropping it deregisters it (keys become invalid at once).
pub struct Mr {
    pub(crate) ops: Arc<dyn MrOps>,
    pub(super) addr: *mut u8,
    pub(super) len: usize,
    pub(super) _owner: Option<Arc<RegBuf>>,
    /// The CPU lock when the provider has none of its own (module docs).
    pub(super) local: RwLock<()>,
}

// SAFETY: the region describes memory valid for its lifetime (owned buffer or
// the `register_raw` contract), so the raw pointer may move between threads.
// Access from any thread goes through raw-pointer copies and word accesses
// under the region's CPU lock (module docs), which orders them against each
// other and against the soft engine's accesses; Rust references over the
// memory come only from the `unsafe` ranged slice methods, whose callers
// prove nothing else touches the range.
unsafe impl Send for Mr {}
unsafe impl Sync for Mr {}

impl fmt::Debug for Mr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Mr(addr={:#x}, len={}, lkey={:#x}, rkey={:#x})",
            self.addr(),
            self.len,
            self.lkey(),
            self.rkey()
        )
    }
}

impl Mr {
    pub fn addr(&self) -> u64 {
        self.addr as u64
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn lkey(&self) -> u32 {
        self.ops.lkey()
    }
    pub fn rkey(&self) -> u32 {
        self.ops.rkey()
    }
    /// An SGE covering `len` bytes at `offset` of this region.
    pub fn sge(&self, offset: usize, len: u32) -> Sge {
        Sge {
            addr: self.addr() + offset as u64,
            length: len,
            lkey: self.lkey(),
        }
    }

    /// The lock that orders CPU accesses to the bytes (module docs).
    fn cpu_lock(&self) -> &RwLock<()> {
        self.ops.cpu_lock().unwrap_or(&self.local)
    }

    fn check(&self, off: usize, len: usize) -> Result<()> {
        match off.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(Error::InvalidArgument(format!(
                "range {off}+{len} outside region of {} bytes",
                self.len
            ))),
        }
    }

    /// Copy bytes out of the region (see [`MrSlice::read_at`]).
    pub fn read_at(&self, off: usize, dst: &mut [u8]) -> Result<()> {
        self.slice(off, dst.len())?.read_at(0, dst)
    }

    /// Copy bytes into the region (see [`MrSliceMut::write_at`]).
    pub fn write_at(&self, off: usize, src: &[u8]) -> Result<()> {
        self.slice_mut(off, src.len())?.write_at(0, src)
    }

    /// Fill a range with a byte.
    pub fn fill(&self, off: usize, len: usize, byte: u8) -> Result<()> {
        self.slice_mut(off, len)?.fill(0, len, byte)
    }

    /// A bounds-checked read-only view of `len` bytes at `off`.
    ///
    /// Fails (never panics) when `off + len` overflows or passes the end.
    pub fn slice(&self, off: usize, len: usize) -> Result<MrSlice<'_>> {
        self.check(off, len)?;
        Ok(MrSlice {
            // In bounds (checked), so the offset pointer stays inside the
            // mapping: `wrapping_add` never actually wraps here.
            ptr: self.addr.wrapping_add(off),
            len,
            lock: self.cpu_lock(),
        })
    }

    /// A bounds-checked view of `len` bytes at `off` that can also write.
    ///
    /// Fails (never panics) when `off + len` overflows or passes the end.
    pub fn slice_mut(&self, off: usize, len: usize) -> Result<MrSliceMut<'_>> {
        let v = self.slice(off, len)?;
        Ok(MrSliceMut {
            ptr: v.ptr,
            len: v.len,
            lock: v.lock,
        })
    }

    /// Load a little-endian u32 (see [`MrSlice::load_u32`]).
    pub fn load_u32(&self, off: usize) -> Result<u32> {
        self.slice(off, 4)?.load_u32(0)
    }
    /// Store a little-endian u32 (see [`MrSliceMut::store_u32`]).
    pub fn store_u32(&self, off: usize, v: u32) -> Result<()> {
        self.slice_mut(off, 4)?.store_u32(0, v)
    }
    /// Load a little-endian u64 for a polled status block (see
    /// [`MrSlice::load_u64`]).
    pub fn load_u64(&self, off: usize) -> Result<u64> {
        self.slice(off, 8)?.load_u64(0)
    }
    /// Store a little-endian u64 (see [`MrSliceMut::store_u32`]).
    pub fn store_u64(&self, off: usize, v: u64) -> Result<()> {
        self.slice_mut(off, 8)?.store_u64(0, v)
    }
}

/// A bounds-checked range of a [`Mr`] ([`Mr::slice`]): a pointer and a length
/// that borrow the region, so the memory stays registered and mapped while
/// the view lives. Its accessors copy bytes in and out through raw pointers
/// and never form a Rust reference over registered memory, which a peer
/// (RDMA Write, a receive) or the provider's engine thread may be writing.
/// Only [`MrSlice::as_slice`] does, and it is `unsafe`.
#[derive(Clone, Copy)]
pub struct MrSlice<'a> {
    ptr: *mut u8,
    len: usize,
    /// The region's CPU lock (module docs); borrowing it borrows the `Mr`.
    lock: &'a RwLock<()>,
}

/// A bounds-checked range of a [`Mr`] that can also be written
/// ([`Mr::slice_mut`]). Writing through it needs no `&mut`: registered memory
/// is shared with the provider and the peer anyway, so exclusivity is a
/// protocol property (the range is not posted, bound or in flight), which
/// only [`MrSliceMut::as_mut_slice`] asks the caller to prove.
pub struct MrSliceMut<'a> {
    ptr: *mut u8,
    len: usize,
    lock: &'a RwLock<()>,
}

// SAFETY: a view is a pointer into a registered region plus a length and the
// region's CPU lock; it only reaches the memory through raw-pointer copies and
// word accesses under that lock (or the `unsafe` slice methods, whose
// contracts exclude concurrent writers), as `Mr` itself does, and `Mr` is
// Send + Sync for the same reason.
unsafe impl Send for MrSlice<'_> {}
unsafe impl Sync for MrSlice<'_> {}
// SAFETY: as for `MrSlice`.
unsafe impl Send for MrSliceMut<'_> {}
unsafe impl Sync for MrSliceMut<'_> {}

impl fmt::Debug for MrSlice<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "MrSlice(addr={:p}, len={})", self.ptr, self.len)
    }
}

impl fmt::Debug for MrSliceMut<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "MrSliceMut(addr={:p}, len={})", self.ptr, self.len)
    }
}

fn range_err(off: usize, len: usize, of: usize) -> Error {
    Error::InvalidArgument(format!("range {off}+{len} outside a view of {of} bytes"))
}

impl<'a> MrSlice<'a> {
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The first byte's address (what an [`Sge`] or a window bind names).
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr
    }

    /// `len` bytes at `off` must be inside the view, and the address
    /// `align`-aligned; returns the address.
    fn at(&self, off: usize, len: usize, align: usize) -> Result<*mut u8> {
        match off.checked_add(len) {
            Some(end) if end <= self.len => {}
            _ => return Err(range_err(off, len, self.len)),
        }
        let p = self.ptr.wrapping_add(off);
        if !(p as usize).is_multiple_of(align) {
            return Err(Error::InvalidArgument(format!(
                "offset {off} is not {align}-byte aligned"
            )));
        }
        Ok(p)
    }

    /// A sub-view: `len` bytes at `off` of this view.
    pub fn slice(&self, off: usize, len: usize) -> Result<MrSlice<'a>> {
        Ok(MrSlice {
            ptr: self.at(off, len, 1)?,
            len,
            lock: self.lock,
        })
    }

    /// Shared hold of the CPU lock: no writer of these bytes in this
    /// process runs while it lives.
    fn shared(&self) -> RwLockReadGuard<'a, ()> {
        self.lock.read().unwrap_or_else(|e| e.into_inner())
    }

    /// Copy `dst.len()` bytes at `off` of the view into `dst`.
    pub fn read_at(&self, off: usize, dst: &mut [u8]) -> Result<()> {
        let p = self.at(off, dst.len(), 1)?;
        let _g = self.shared();
        // SAFETY: the range is inside the registered region, which the
        // borrowed `Mr` keeps mapped. `dst` is a Rust allocation that cannot
        // overlap it: the only references ever formed over registered memory
        // come from the `unsafe` slice methods, whose contracts forbid any
        // other access to that range while they live. No reference is formed
        // over the source, and no thread of this process writes it during
        // the copy: every such writer (the soft engine's placements, the
        // application's `write_at`) holds the region's CPU lock exclusively,
        // and we hold it shared (module docs). A device's DMA is outside the
        // abstract machine; bytes have no invalid values.
        unsafe { std::ptr::copy_nonoverlapping(p, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    /// Copy the whole view into `dst`, which must be exactly as long.
    pub fn copy_to_slice(&self, dst: &mut [u8]) -> Result<()> {
        if dst.len() != self.len {
            return Err(Error::InvalidArgument(format!(
                "destination of {} bytes for a view of {}",
                dst.len(),
                self.len
            )));
        }
        self.read_at(0, dst)
    }

    /// Load a little-endian u32 at `off` (4-byte aligned), then an
    /// `Acquire` fence: one aligned volatile access, which the compiler may
    /// not elide, merge or hoist out of a polling loop, made under the
    /// region's CPU lock (so no writer in this process runs meanwhile). The
    /// fence keeps later reads of the data the word vouches for after this
    /// load; that a device made the data visible before the word is the
    /// transport's ordering (one connection places in order). Poll status
    /// blocks with [`MrSlice::load_u64`], which the soft provider stores
    /// whole.
    pub fn load_u32(&self, off: usize) -> Result<u32> {
        let p = self.at(off, 4, 4)?;
        let g = self.shared();
        // SAFETY: in bounds of the mapped region (which the borrowed `Mr`
        // keeps mapped) and 4-byte aligned (checked by `at`); any bit
        // pattern is a valid u32; no writer in this process runs
        // concurrently (the lock is held shared, writers hold it
        // exclusively), and a device's DMA is outside the abstract machine.
        let v = unsafe { std::ptr::read_volatile(p as *const u32) };
        drop(g);
        fence(Ordering::Acquire);
        Ok(u32::from_le(v))
    }

    /// Load a little-endian u64 at `off` (8-byte aligned) of a polled
    /// status block: one `AtomicU64` load with `Acquire` ordering, under
    /// the region's CPU lock held shared.
    ///
    /// The lock makes it sound: no writer of the word in this process (the
    /// soft provider's engine placing a peer's Write, the application's
    /// `store_u64`) runs meanwhile, and releasing the lock after a
    /// placement orders everything the engine placed before (earlier
    /// segments of the connection, placed in order: the data the block
    /// vouches for) before this load. The soft provider stores a status
    /// block written by an 8-byte RDMA Write whole, also when TCP delivers
    /// its bytes in two reads (`soft::qp_rx::place_bytes`), so the load
    /// never sees it half new. The protocol still tolerates a torn block,
    /// for peers whose placement of 8 bytes is not atomic
    /// (`lwio_proto::wire::small::poll_block_written`). With a hardware
    /// provider the writer is the device's DMA, outside the abstract
    /// machine: the atomic load is one aligned access that is not elided
    /// or hoisted out of a polling loop, and the data's visibility before
    /// the block is the transport's ordering.
    pub fn load_u64(&self, off: usize) -> Result<u64> {
        let p = self.at(off, 8, 8)?;
        let _g = self.shared();
        // SAFETY: in bounds of the mapped region, which stays mapped while
        // the view borrows its `Mr`, and 8-byte aligned (checked by `at`),
        // as `AtomicU64::from_ptr` requires; no thread of this process
        // writes the word while the lock is held shared.
        let v = unsafe { std::sync::atomic::AtomicU64::from_ptr(p.cast()) }.load(Ordering::Acquire);
        Ok(u64::from_le(v))
    }

    /// A shared Rust slice over the view.
    ///
    /// # Safety
    /// For as long as the slice lives nothing may write any byte of this
    /// range: no receive or RDMA Read into it posted, no key or window that
    /// the peer holds covering it with remote write access, no other thread
    /// or view writing it, and the provider not placing into it (e.g. a
    /// receive slot whose completion was polled and that is not re-posted
    /// before the slice is gone). Other parts of the region may be in any
    /// state: the slice covers this range only.
    pub unsafe fn as_slice(&self) -> &'a [u8] {
        std::slice::from_raw_parts(self.ptr, self.len)
    }
}

impl<'a> MrSliceMut<'a> {
    /// The same range, read-only.
    pub fn as_view(&self) -> MrSlice<'a> {
        MrSlice {
            ptr: self.ptr,
            len: self.len,
            lock: self.lock,
        }
    }

    /// Exclusive hold of the CPU lock: no other access to the region's
    /// bytes from this process runs while it lives.
    fn exclusive(&self) -> RwLockWriteGuard<'a, ()> {
        self.lock.write().unwrap_or_else(|e| e.into_inner())
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn as_mut_ptr(&self) -> *mut u8 {
        self.ptr
    }
    /// See [`MrSlice::read_at`].
    pub fn read_at(&self, off: usize, dst: &mut [u8]) -> Result<()> {
        self.as_view().read_at(off, dst)
    }
    /// See [`MrSlice::copy_to_slice`].
    pub fn copy_to_slice(&self, dst: &mut [u8]) -> Result<()> {
        self.as_view().copy_to_slice(dst)
    }
    /// See [`MrSlice::load_u32`].
    pub fn load_u32(&self, off: usize) -> Result<u32> {
        self.as_view().load_u32(off)
    }
    /// See [`MrSlice::load_u64`].
    pub fn load_u64(&self, off: usize) -> Result<u64> {
        self.as_view().load_u64(off)
    }

    /// Copy `src` into the view at `off`.
    pub fn write_at(&self, off: usize, src: &[u8]) -> Result<()> {
        let p = self.as_view().at(off, src.len(), 1)?;
        let _g = self.exclusive();
        // SAFETY: in bounds of the mapped region; `src` cannot overlap it (as
        // in `MrSlice::read_at`). No reference is formed over the
        // destination, and no other thread of this process reads or writes
        // it during the copy: the region's CPU lock is held exclusively
        // (module docs). A range that a posted send or the peer's RDMA Read
        // is reading is then sent old or new (a protocol question), never
        // raced.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), p, src.len()) };
        Ok(())
    }

    /// Copy `src`, exactly as long as the view, into it.
    pub fn copy_from_slice(&self, src: &[u8]) -> Result<()> {
        if src.len() != self.len {
            return Err(Error::InvalidArgument(format!(
                "source of {} bytes for a view of {}",
                src.len(),
                self.len
            )));
        }
        self.write_at(0, src)
    }

    /// Fill `len` bytes at `off` with `byte`.
    pub fn fill(&self, off: usize, len: usize, byte: u8) -> Result<()> {
        let p = self.as_view().at(off, len, 1)?;
        let _g = self.exclusive();
        // SAFETY: as in `write_at` (in bounds, the CPU lock held
        // exclusively).
        unsafe { std::ptr::write_bytes(p, byte, len) };
        Ok(())
    }

    /// A `Release` fence, then a volatile little-endian u32 store at `off`
    /// (4-byte aligned): for words that are polled, e.g. resetting a status
    /// block to its sentinel before the request that completes there is
    /// sent. The fence keeps earlier writes before it; the peer cannot write
    /// the word before it has seen the request, which is posted after this.
    pub fn store_u32(&self, off: usize, v: u32) -> Result<()> {
        let p = self.as_view().at(off, 4, 4)?;
        fence(Ordering::Release);
        let _g = self.exclusive();
        // SAFETY: in bounds and aligned; any u32 is valid; the CPU lock is
        // held exclusively (no other access from this process meanwhile).
        unsafe { std::ptr::write_volatile(p as *mut u32, v.to_le()) };
        Ok(())
    }

    /// As [`MrSliceMut::store_u32`] for an 8-byte aligned u64.
    pub fn store_u64(&self, off: usize, v: u64) -> Result<()> {
        let p = self.as_view().at(off, 8, 8)?;
        fence(Ordering::Release);
        let _g = self.exclusive();
        // SAFETY: as in `store_u32`.
        unsafe { std::ptr::write_volatile(p as *mut u64, v.to_le()) };
        Ok(())
    }

    /// A shared slice over the view; see [`MrSlice::as_slice`].
    ///
    /// # Safety
    /// As for [`MrSlice::as_slice`].
    pub unsafe fn as_slice(&self) -> &[u8] {
        std::slice::from_raw_parts(self.ptr, self.len)
    }

    /// An exclusive Rust slice over the view.
    ///
    /// # Safety
    /// As for [`MrSlice::as_slice`], and in addition nothing may *read* the
    /// range while the slice lives: no posted send or RDMA Write from it, no
    /// key or window the peer holds covering it (RDMA Read), no other view
    /// or thread using it (e.g. a send slot just taken from the free list
    /// and not yet posted, or a buffer registered with local access only
    /// that no posted work request names).
    pub unsafe fn as_mut_slice(&mut self) -> &mut [u8] {
        std::slice::from_raw_parts_mut(self.ptr, self.len)
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        self.ops.deregister();
    }
}
