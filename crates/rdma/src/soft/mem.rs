//! Protection domains, memory regions, memory windows and the STag table.
//!
//! One table per context maps the 24-bit STag index to a region or window;
//! the low 8 bits (the key byte) must match the entry's current key. Every
//! time an index is reused, or a window is re-bound, the key byte advances,
//! so a stale key never matches again (until 256 reuses wrap it).
//!
//! # Revocation and placement in progress
//! A segment's payload may arrive over many reads (a slow or stalling peer),
//! so checking a key once at the segment's header is not enough: the
//! receive path writes registered memory only inside [`PlaceKeep::enter`],
//! which holds the region's fence for writing (and the window's placement
//! fence for reading) and checks the key is still live. Deregistration,
//! window invalidation, deallocation and re-binding first make the key dead,
//! then take the fence for writing: they return only once no write into the
//! memory is running, and no later write starts (the rest of such a segment
//! is refused with a Terminate, as an RNIC refuses the later packets of a
//! write whose key was invalidated). They wait for one `read(2)` or copy at
//! most, never for the peer, so a stalling peer cannot hold them up (issue
//! 31).
//!
//! # The region fence is the region's reader-writer lock
//! Every access this process makes to a soft region's bytes, by the engine
//! or by the application, runs under [`MrState::fence`]: the receive path's
//! placements (tagged and untagged: copies from the stage, `read(2)` into
//! the region, a held word) take it for writing; the transmit path holds it
//! for reading while `writev` or a copy reads payload from the region; the
//! application's copies through `Mr`/`MrSlice` (`read_at`, `load_u64`, ...)
//! take it for reading, its writes (`write_at`, `fill`, `store_*`) for
//! writing ([`SoftMr`]'s `MrOps::cpu_lock`). So two accesses to the same
//! byte from two threads, one of them a write, are never concurrent: each
//! pair is ordered by the lock (a happens-before edge), whatever the peer
//! sends and whenever the application copies. This is what makes the safe
//! copies of `Mr` sound with `Progress::Auto`, where the engine is a thread
//! of this process (a hardware provider's DMA is outside the Rust abstract
//! machine). A thread takes several fences in address order
//! ([`read_fences`], and the placements' write fences), and never a fence
//! it already holds, so the lock cannot deadlock; every holder runs one
//! copy or one non-blocking system call under it.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};

use crate::verbs::*;
use lwio_iwarp::wire::term::TermKind;

static NEXT_PD: AtomicU32 = AtomicU32::new(1);

/// The state of a registered region, shared by the table and in-flight work.
pub struct MrState {
    pub stag: u32,
    pub addr: u64,
    pub len: u64,
    pub access: Access,
    pub pd: u32,
    pub valid: AtomicBool,
    /// The region's reader-writer lock (module docs): held for writing by
    /// every write of the receive path into this region and by the
    /// application's writes; for reading by every read of the transmit path
    /// and the application's copies; taken (write) by deregistration after
    /// `valid` is cleared.
    pub fence: RwLock<()>,
    /// Keeps library-owned memory alive while any reference to this state lives.
    _owner: Option<Arc<dyn std::any::Any + Send + Sync>>,
}

impl MrState {
    /// Whether this state keeps the region's memory alive (a `RegBuf`
    /// registered with `Pd::register`); caller-owned memory
    /// (`Pd::register_raw`) may be freed as soon as the `Mr` is dropped.
    pub fn owns_memory(&self) -> bool {
        self._owner.is_some()
    }
}

/// A window's current binding.
#[derive(Clone)]
pub struct Binding {
    pub mr: Arc<MrState>,
    pub addr: u64,
    pub len: u64,
    pub access: Access,
    pub one_shot: bool,
    pub qpn: u32,
}

pub struct MwState {
    pub pd: u32,
    /// The STag most recently issued (index + key byte).
    pub stag: AtomicU32,
    pub binding: Mutex<Option<Binding>>,
    /// Advanced (under `binding`) whenever the window's access is revoked:
    /// invalidation, deallocation, re-binding. A placement through the
    /// window is live while the epoch it resolved under is current.
    pub epoch: AtomicU64,
    /// As [`MrState::fence`], for placements through this window.
    pub fence: RwLock<()>,
}

impl MwState {
    /// Revoke the current binding's access (the caller holds `binding` and
    /// changes it), then wait for placements through the window already
    /// writing.
    fn revoke(&self) {
        self.epoch.fetch_add(1, Ordering::AcqRel);
    }

    fn wait_placements(&self) {
        drop(self.fence.write().unwrap_or_else(|e| e.into_inner()));
    }
}

/// The registrations a payload lies in, kept alive with it and fenced
/// while it is read or written: a frame's to send, a placement's to write
/// (a receive's scatter list may span several). Almost always one, held
/// without an allocation.
#[derive(Clone, Default)]
pub struct Regions {
    first: Option<Arc<MrState>>,
    rest: Vec<Arc<MrState>>,
}

impl Regions {
    pub fn of(mrs: &[Arc<MrState>]) -> Regions {
        match mrs.split_first() {
            None => Regions::default(),
            Some((first, rest)) => Regions {
                first: Some(first.clone()),
                rest: rest.to_vec(),
            },
        }
    }
    pub fn one(mr: Option<Arc<MrState>>) -> Regions {
        Regions {
            first: mr,
            rest: Vec::new(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.first.is_none()
    }
    pub fn iter(&self) -> impl Iterator<Item = &Arc<MrState>> {
        self.first.iter().chain(self.rest.iter())
    }
}

/// What a placement writes through: its regions, and the window (with the
/// epoch it resolved under) when the key was a window's.
#[derive(Clone)]
pub struct PlaceKeep {
    regions: Regions,
    mw: Option<(Arc<MwState>, u64)>,
}

/// Fences held while one write of a placement runs.
pub struct PlaceGuard<'a> {
    _mw: Option<RwLockReadGuard<'a, ()>>,
    _mr: Fences<RwLockWriteGuard<'a, ()>>,
}

/// Guards on several region fences ([`read_fences`], [`write_fences`]); up
/// to four without an allocation (a transmit batch's frames or a
/// placement's destination name one or two regions).
pub struct Fences<G> {
    _few: [Option<G>; 4],
    _more: Vec<G>,
}

/// `take` on each distinct region of `mrs`, in the one order in which a
/// thread takes several region fences (by address), so that two threads
/// each taking a set of them cannot deadlock, and a thread never takes one
/// twice.
fn fences<'a, G>(
    mrs: impl Iterator<Item = &'a Arc<MrState>>,
    take: impl Fn(&'a MrState) -> G,
) -> Fences<G> {
    let mut few: [Option<&'a Arc<MrState>>; 4] = [None; 4];
    let mut n = 0;
    let mut spill: Vec<&'a Arc<MrState>> = Vec::new();
    for m in mrs {
        if !spill.is_empty() {
            spill.push(m);
        } else if few[..n].iter().flatten().any(|f| Arc::ptr_eq(f, m)) {
            continue;
        } else if n < few.len() {
            few[n] = Some(m);
            n += 1;
        } else {
            spill.extend(few.iter().flatten());
            spill.push(m);
        }
    }
    let mut g = Fences {
        _few: [None, None, None, None],
        _more: Vec::new(),
    };
    if spill.is_empty() {
        let few = &mut few[..n];
        few.sort_by_key(|m| m.map_or(0, |m| Arc::as_ptr(m) as usize));
        for (slot, m) in g._few.iter_mut().zip(few.iter().flatten()) {
            *slot = Some(take(m));
        }
    } else {
        spill.sort_by_key(|m| Arc::as_ptr(m) as usize);
        spill.dedup_by_key(|m| Arc::as_ptr(m) as usize);
        g._more = spill.into_iter().map(|m| take(m)).collect();
    }
    g
}

/// Read guards on the fences of `mrs`: held while the transmit path reads
/// payload out of those regions.
pub fn read_fences<'a>(
    mrs: impl Iterator<Item = &'a Arc<MrState>>,
) -> Fences<RwLockReadGuard<'a, ()>> {
    fences(mrs, |m| m.fence.read().unwrap_or_else(|e| e.into_inner()))
}

/// Write guards on the fences of `mrs`: held while the receive path places
/// into those regions.
fn write_fences<'a>(
    mrs: impl Iterator<Item = &'a Arc<MrState>>,
) -> Fences<RwLockWriteGuard<'a, ()>> {
    fences(mrs, |m| m.fence.write().unwrap_or_else(|e| e.into_inner()))
}

impl PlaceKeep {
    /// A placement into one region, through a window when `mw` is set.
    pub fn new(mr: Arc<MrState>, mw: Option<(Arc<MwState>, u64)>) -> PlaceKeep {
        PlaceKeep {
            regions: Regions::one(Some(mr)),
            mw,
        }
    }

    /// The regions of a receive's scatter list (`None` for an empty one).
    pub fn regions(mrs: &[Arc<MrState>]) -> Option<PlaceKeep> {
        let regions = Regions::of(mrs);
        (!regions.is_empty()).then_some(PlaceKeep { regions, mw: None })
    }

    /// Whether the key the placement resolved is still live.
    pub fn live(&self) -> bool {
        self.regions.iter().all(|m| m.valid.load(Ordering::Acquire))
            && self
                .mw
                .as_ref()
                .is_none_or(|(w, e)| w.epoch.load(Ordering::Acquire) == *e)
    }

    /// Enter one write: `None` when the key was revoked (write nothing);
    /// otherwise revocation, and every other access to the regions, waits
    /// for the guard to drop.
    pub fn enter(&self) -> Option<PlaceGuard<'_>> {
        let mw = self
            .mw
            .as_ref()
            .map(|(w, _)| w.fence.read().unwrap_or_else(|e| e.into_inner()));
        let g = PlaceGuard {
            _mw: mw,
            _mr: write_fences(self.regions.iter()),
        };
        self.live().then_some(g)
    }
}

enum Entry {
    Mr(Arc<MrState>),
    Mw(Arc<MwState>),
}

struct Slot {
    key: u8,
    entry: Option<Entry>,
}

#[derive(Default)]
struct Inner {
    slots: Vec<Slot>,
    free: Vec<u32>,
}

/// Maximum number of keys (regions + windows) per context.
pub const MAX_KEYS: usize = 1 << 20;

/// The per-context STag table.
#[derive(Default)]
pub struct MemTable {
    inner: RwLock<Inner>,
}

/// A resolved remote access: where to place or read, and what keeps it alive.
pub struct Resolved {
    pub ptr: u64,
    /// End (exclusive) of the validated range: the window's or region's end.
    pub end: u64,
    pub mr: Arc<MrState>,
    /// The window resolved through and its epoch (window keys only).
    pub mw: Option<(Arc<MwState>, u64)>,
}

impl MemTable {
    fn insert(&self, mk: impl FnOnce(u32) -> Entry) -> Result<u32> {
        let mut t = self.inner.write().unwrap_or_else(|e| e.into_inner());
        let idx = match t.free.pop() {
            Some(i) => i,
            None => {
                if t.slots.len() >= MAX_KEYS {
                    return Err(Error::ResourceExhausted("STag table full".into()));
                }
                if t.slots.is_empty() {
                    // Index 0 is never handed out (STag 0 is "no key").
                    t.slots.push(Slot {
                        key: 0,
                        entry: None,
                    });
                }
                t.slots.push(Slot {
                    key: 0,
                    entry: None,
                });
                (t.slots.len() - 1) as u32
            }
        };
        let slot = &mut t.slots[idx as usize];
        slot.key = slot.key.wrapping_add(1);
        let stag = stag::make(idx, slot.key);
        slot.entry = Some(mk(stag));
        Ok(stag)
    }

    fn remove(&self, stag_v: u32) {
        let mut t = self.inner.write().unwrap_or_else(|e| e.into_inner());
        let idx = stag::index(stag_v) as usize;
        if let Some(s) = t.slots.get_mut(idx) {
            if s.entry.is_some() && s.key == stag::key(stag_v) {
                s.entry = None;
                t.free.push(idx as u32);
            }
        }
    }

    fn lookup(&self, stag_v: u32) -> Option<Lookup> {
        let t = self.inner.read().unwrap_or_else(|e| e.into_inner());
        let s = t.slots.get(stag::index(stag_v) as usize)?;
        if stag::index(stag_v) == 0 {
            return None;
        }
        match s.entry.as_ref()? {
            Entry::Mr(m) if s.key == stag::key(stag_v) => Some(Lookup::Mr(m.clone())),
            Entry::Mw(w) => Some(Lookup::Mw(w.clone())),
            _ => None,
        }
    }

    /// Resolve a local key for an SGE.
    pub fn local(&self, sge: &Sge, pd: u32, need: Access) -> Result<Arc<MrState>, WcStatus> {
        let mr = match self.lookup(sge.lkey) {
            Some(Lookup::Mr(m)) => m,
            _ => return Err(WcStatus::LocProtErr),
        };
        if !mr.valid.load(Ordering::Acquire) || mr.pd != pd || !mr.access.contains(need) {
            return Err(WcStatus::LocProtErr);
        }
        let end = sge.addr.checked_add(sge.length as u64);
        match end {
            Some(end) if sge.addr >= mr.addr && end <= mr.addr + mr.len => Ok(mr),
            _ => Err(WcStatus::LocProtErr),
        }
    }

    /// Validate a remote access (a tagged segment, or the source of an RDMA
    /// Read Request). `read_req` selects RDMAP-layer codes (Read Request) over
    /// DDP-layer codes (tagged placement). One-shot windows are consumed.
    #[allow(clippy::too_many_arguments)]
    pub fn remote(
        &self,
        stag_v: u32,
        to: u64,
        len: u64,
        need: Access,
        pd: u32,
        qpn: u32,
        read_req: bool,
    ) -> Result<Resolved, TermKind> {
        let (inv, bounds, assoc) = if read_req {
            (
                TermKind::RdmapProtInvalidStag,
                TermKind::RdmapProtBaseBounds,
                TermKind::RdmapProtStagNotAssociated,
            )
        } else {
            (
                TermKind::DdpTaggedInvalidStag,
                TermKind::DdpTaggedBaseBounds,
                TermKind::DdpTaggedStagNotAssociated,
            )
        };
        let in_range = |base: u64, blen: u64| -> bool {
            match to.checked_add(len) {
                Some(end) => to >= base && end <= base.saturating_add(blen),
                None => false,
            }
        };
        match self.lookup(stag_v) {
            None => Err(inv),
            Some(Lookup::Mr(mr)) => {
                if !mr.valid.load(Ordering::Acquire) {
                    return Err(inv);
                }
                if mr.pd != pd {
                    return Err(assoc);
                }
                if !mr.access.contains(need) {
                    return Err(TermKind::RdmapProtAccessRights);
                }
                if !in_range(mr.addr, mr.len) {
                    return Err(bounds);
                }
                Ok(Resolved {
                    ptr: to,
                    end: mr.addr + mr.len,
                    mr,
                    mw: None,
                })
            }
            Some(Lookup::Mw(mw)) => {
                if mw.stag.load(Ordering::Acquire) != stag_v {
                    return Err(inv);
                }
                let mut b = mw.binding.lock().unwrap_or_else(|e| e.into_inner());
                let Some(bind) = b.as_ref() else {
                    return Err(inv);
                };
                if !bind.mr.valid.load(Ordering::Acquire) {
                    return Err(inv);
                }
                if mw.pd != pd {
                    return Err(assoc);
                }
                if bind.qpn != qpn {
                    return Err(assoc);
                }
                if !bind.access.contains(need) {
                    return Err(TermKind::RdmapProtAccessRights);
                }
                if !in_range(bind.addr, bind.len) {
                    return Err(bounds);
                }
                let mr = bind.mr.clone();
                let end = bind.addr + bind.len;
                if bind.one_shot {
                    *b = None;
                }
                let epoch = mw.epoch.load(Ordering::Acquire);
                drop(b);
                Ok(Resolved {
                    ptr: to,
                    end,
                    mr,
                    mw: Some((mw, epoch)),
                })
            }
        }
    }

    /// Invalidate a window key (local invalidate or a peer's Send with
    /// Invalidate). Regions registered with `reg_mr` cannot be invalidated.
    /// `qpn`: for a peer's Send with Invalidate, the window must be bound to
    /// this QP (its RDMAP stream). Returns once no placement through the
    /// window is writing.
    pub fn invalidate(&self, stag_v: u32, pd: u32, qpn: Option<u32>) -> Result<(), TermKind> {
        match self.lookup(stag_v) {
            Some(Lookup::Mw(mw)) if mw.stag.load(Ordering::Acquire) == stag_v && mw.pd == pd => {
                let mut b = mw.binding.lock().unwrap_or_else(|e| e.into_inner());
                match (b.as_ref(), qpn) {
                    (Some(bind), Some(q)) if bind.qpn != q => {
                        Err(TermKind::RdmapOpCannotInvalidate)
                    }
                    _ => {
                        *b = None;
                        mw.revoke();
                        drop(b);
                        mw.wait_placements();
                        Ok(())
                    }
                }
            }
            _ => Err(TermKind::RdmapOpCannotInvalidate),
        }
    }
}

enum Lookup {
    Mr(Arc<MrState>),
    Mw(Arc<MwState>),
}

// ---------------------------------------------------------------------------

pub struct SoftPd {
    pub id: u32,
    pub table: Arc<MemTable>,
    mrs: AtomicU64,
    mrs_remote: AtomicU64,
    mws: AtomicU64,
}

impl SoftPd {
    pub fn new(table: Arc<MemTable>) -> SoftPd {
        SoftPd {
            id: NEXT_PD.fetch_add(1, Ordering::Relaxed),
            table,
            mrs: AtomicU64::new(0),
            mrs_remote: AtomicU64::new(0),
            mws: AtomicU64::new(0),
        }
    }
}

pub struct SoftMr {
    pub state: Arc<MrState>,
    table: Arc<MemTable>,
}

pub struct SoftMw {
    pub state: Arc<MwState>,
    pub index: u32,
    table: Arc<MemTable>,
    deallocated: AtomicBool,
}

impl PdOps for SoftPd {
    fn reg_mr(&self, mem: MemRegion, access: Access) -> Result<Arc<dyn MrOps>> {
        if mem.addr.is_null() && mem.len > 0 {
            return Err(Error::InvalidArgument("null region".into()));
        }
        if access.contains(Access::REMOTE_WRITE) && !access.contains(Access::LOCAL_WRITE) {
            return Err(Error::InvalidArgument(
                "REMOTE_WRITE requires LOCAL_WRITE".into(),
            ));
        }
        let mut state = None;
        self.table.insert(|stag| {
            let s = Arc::new(MrState {
                stag,
                addr: mem.addr as u64,
                len: mem.len as u64,
                access,
                pd: self.id,
                valid: AtomicBool::new(true),
                fence: RwLock::new(()),
                _owner: mem.owner.clone(),
            });
            state = Some(s.clone());
            Entry::Mr(s)
        })?;
        let state = state.ok_or_else(|| Error::ResourceExhausted("registration".into()))?;
        self.mrs.fetch_add(1, Ordering::Relaxed);
        if access.intersects(Access::REMOTE_READ | Access::REMOTE_WRITE) {
            self.mrs_remote.fetch_add(1, Ordering::Relaxed);
        }
        Ok(Arc::new(SoftMr {
            state,
            table: self.table.clone(),
        }))
    }

    fn alloc_mw(&self) -> Result<Arc<dyn MwOps>> {
        let mut state = None;
        let stag = self.table.insert(|stag| {
            let s = Arc::new(MwState {
                pd: self.id,
                stag: AtomicU32::new(stag),
                binding: Mutex::new(None),
                epoch: AtomicU64::new(0),
                fence: RwLock::new(()),
            });
            state = Some(s.clone());
            Entry::Mw(s)
        })?;
        let state = state.ok_or_else(|| Error::ResourceExhausted("window".into()))?;
        self.mws.fetch_add(1, Ordering::Relaxed);
        Ok(Arc::new(SoftMw {
            state,
            index: stag::index(stag),
            table: self.table.clone(),
            deallocated: AtomicBool::new(false),
        }))
    }

    fn census(&self) -> PdCensus {
        PdCensus {
            mrs: self.mrs.load(Ordering::Relaxed),
            mrs_remote: self.mrs_remote.load(Ordering::Relaxed),
            mws: self.mws.load(Ordering::Relaxed),
        }
    }

    fn create_srq(&self, max_wr: u32, max_sge: u32) -> Result<Arc<dyn SrqOps>> {
        Ok(Arc::new(super::srq::SoftSrq(Arc::new(
            super::srq::SrqShared::new(self.table.clone(), self.id, max_wr, max_sge)?,
        ))))
    }
}

impl MrOps for SoftMr {
    fn lkey(&self) -> u32 {
        self.state.stag
    }
    fn rkey(&self) -> u32 {
        self.state.stag
    }
    /// The region's fence (module docs).
    fn cpu_lock(&self) -> Option<&RwLock<()>> {
        Some(&self.state.fence)
    }
    /// Returns once no placement into the region is writing (module docs).
    fn deregister(&self) {
        if self.state.valid.swap(false, Ordering::AcqRel) {
            self.table.remove(self.state.stag);
            drop(self.state.fence.write().unwrap_or_else(|e| e.into_inner()));
        }
    }
}

impl Drop for SoftMr {
    fn drop(&mut self) {
        self.deregister();
    }
}

impl MwOps for SoftMw {
    fn rkey(&self) -> u32 {
        self.state.stag.load(Ordering::Acquire)
    }
    fn kind(&self) -> MwKind {
        MwKind::Native
    }
    fn deallocate(&self) {
        if !self.deallocated.swap(true, Ordering::AcqRel) {
            {
                let mut b = self.state.binding.lock().unwrap_or_else(|e| e.into_inner());
                *b = None;
                self.state.revoke();
            }
            self.state.wait_placements();
            // Remove by the index's slot key (the table key byte of the slot is
            // the allocation key, the window's current key may differ).
            let mut t = self.table.inner.write().unwrap_or_else(|e| e.into_inner());
            let idx = self.index as usize;
            if let Some(s) = t.slots.get_mut(idx) {
                if matches!(&s.entry, Some(Entry::Mw(w)) if Arc::ptr_eq(w, &self.state)) {
                    // Advance the slot key past the window's last key so a
                    // reuse of the index never revives an old window key.
                    s.key = stag::key(self.state.stag.load(Ordering::Acquire));
                    s.entry = None;
                    t.free.push(idx as u32);
                }
            }
        }
    }
}

impl Drop for SoftMw {
    fn drop(&mut self) {
        self.deallocate();
    }
}

impl SoftMw {
    /// Bind (called from the QP's post path: no system call).
    pub fn bind(&self, b: &MwBind<'_>, pd: u32, qpn: u32) -> Result<u32> {
        if self.deallocated.load(Ordering::Acquire) {
            return Err(Error::InvalidArgument("window deallocated".into()));
        }
        let mr = (*b.mr.ops)
            .as_any()
            .downcast_ref::<SoftMr>()
            .ok_or_else(|| Error::InvalidArgument("region of another provider".into()))?;
        let mrs = &mr.state;
        if !mrs.valid.load(Ordering::Acquire) {
            return Err(Error::Protection("region deregistered".into()));
        }
        if mrs.pd != pd || self.state.pd != pd {
            return Err(Error::Protection("window, region and QP PDs differ".into()));
        }
        if !mrs.access.contains(Access::MW_BIND) {
            return Err(Error::Protection("region lacks MW_BIND".into()));
        }
        // Verbs semantics (IBA C10-75/C10-78): the window's rights need not
        // be the region's own. The region needs MW_BIND, and LOCAL_WRITE
        // for a window that grants REMOTE_WRITE; a region registered with no
        // remote right carries windows that grant one, while its own key
        // grants nothing remote.
        let rights = Access::REMOTE_READ | Access::REMOTE_WRITE;
        if !rights.contains(b.access)
            || (b.access.contains(Access::REMOTE_WRITE)
                && !mrs.access.contains(Access::LOCAL_WRITE))
        {
            return Err(Error::Protection(format!(
                "window rights {:?} not allowed by region {:?}",
                b.access, mrs.access
            )));
        }
        match b.offset.checked_add(b.length) {
            Some(end) if end <= mrs.len => {}
            _ => {
                return Err(Error::Protection(format!(
                    "window {}+{} outside region of {}",
                    b.offset, b.length, mrs.len
                )))
            }
        }
        let mut g = self.state.binding.lock().unwrap_or_else(|e| e.into_inner());
        let new = stag::next_key(self.state.stag.load(Ordering::Acquire));
        self.state.stag.store(new, Ordering::Release);
        // The old key's access ends here, a placement still running through
        // it included.
        self.state.revoke();
        *g = Some(Binding {
            mr: mrs.clone(),
            addr: mrs.addr + b.offset,
            len: b.length,
            access: b.access,
            one_shot: b.one_shot,
            qpn,
        });
        drop(g);
        self.state.wait_placements();
        Ok(new)
    }
}
