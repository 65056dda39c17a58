//! The `verbs` provider: libibverbs + librdmacm, loaded at run time.
//!
//! * The libraries are `dlopen`ed on first use ([`ffi::Lib::get`]); a host
//!   without rdma-core lists one unusable pseudo-device with the reason and
//!   fails `open` with [`Error::ProviderUnavailable`].
//! * Contexts come from `rdma_get_devices()`, so the PDs/CQs allocated here
//!   belong to the very `ibv_context` that rdma_cm ids bound to the device use
//!   (`id->verbs`); connect/accept check that.
//! * Connections always go through rdma_cm (iWARP cannot be connected by hand).
//!   Every listener and every connection has its own `rdma_event_channel`; an
//!   accepted id is migrated from the listener's channel to its own. Once a
//!   connection is established its channel is watched by one process-wide
//!   monitor thread (epoll) that turns `RDMA_CM_EVENT_DISCONNECTED` into a QP
//!   error (so posted work requests flush).
//! * Memory windows are native type-2 windows where the device reports
//!   `IBV_DEVICE_MEM_WINDOW_TYPE_2B`, otherwise per-request registration
//!   (see `docs/verbs-provider.md`).
//!
//! See `docs/verbs-provider.md` for the ABI assumptions and what was verified.

pub mod ffi;

mod async_events;
mod cm;
mod sys;

use std::collections::{HashMap, VecDeque};
use std::ffi::c_void;
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::ptr;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use crate::verbs::*;
use ffi::*;

pub(crate) use cm::CmQp;

/// The `verbs` provider.
pub fn provider() -> Provider {
    Provider(Arc::new(VerbsProvider))
}

/// Whether libibverbs/librdmacm could be loaded on this host (and why not).
pub fn available() -> Result<(), String> {
    Lib::get().map(|_| ())
}

struct VerbsProvider;

impl ProviderOps for VerbsProvider {
    fn name(&self) -> &'static str {
        "verbs"
    }

    fn devices(&self) -> Vec<DeviceInfo> {
        match Lib::get() {
            Err(reason) => vec![DeviceInfo {
                provider: "verbs",
                name: "(none)".into(),
                transport: Transport::Other,
                addresses: Vec::new(),
                usable: Err(reason),
                caps: None,
            }],
            Ok(lib) => sys::list_devices(lib),
        }
    }

    fn open(&self, device: &str, config: &Config) -> Result<Arc<dyn ContextOps>> {
        let lib = Lib::get().map_err(Error::ProviderUnavailable)?;
        Ok(Arc::new(VerbsContext(CtxInner::open(lib, device, config)?)))
    }
}

/// The last OS error as an [`Error`], with context.
/// As [`os_err`] for an errno that rustix returned.
fn rustix_err(what: &str, e: rustix::io::Errno) -> Error {
    let e = std::io::Error::from(e);
    Error::Io(std::io::Error::new(e.kind(), format!("{what}: {e}")))
}

fn os_err(what: &str) -> Error {
    let e = std::io::Error::last_os_error();
    Error::Io(std::io::Error::new(e.kind(), format!("{what}: {e}")))
}

/// Map an errno returned by a verbs call (post/poll functions return it
/// directly, positive) to an [`Error`].
fn errno_err(what: &str, errno: i32) -> Error {
    match errno {
        libc::ENOMEM => Error::QueueFull,
        libc::EINVAL => Error::InvalidArgument(format!("{what}: EINVAL")),
        libc::EPERM | libc::EACCES => Error::Protection(format!("{what}: errno {errno}")),
        _ => {
            let e = std::io::Error::from_raw_os_error(errno);
            Error::Io(std::io::Error::new(e.kind(), format!("{what}: {e}")))
        }
    }
}

/// `LWIO_IBV_DEBUG=1`: trace CM events and raw completions on stderr (for
/// bring-up on a new device; tracing needs a subscriber the smoke binary lacks).
pub(crate) fn debug_on() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("LWIO_IBV_DEBUG").is_some_and(|v| v != "0"))
}

macro_rules! dbg_ibv {
    ($($t:tt)*) => {
        if $crate::ibv::debug_on() {
            eprintln!("[ibv] {}", format!($($t)*));
        }
    };
}
pub(crate) use dbg_ibv;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn access_bits(a: Access) -> i32 {
    let mut v = 0;
    if a.contains(Access::LOCAL_WRITE) {
        v |= IBV_ACCESS_LOCAL_WRITE;
    }
    if a.contains(Access::REMOTE_WRITE) {
        v |= IBV_ACCESS_REMOTE_WRITE;
    }
    if a.contains(Access::REMOTE_READ) {
        v |= IBV_ACCESS_REMOTE_READ;
    }
    if a.contains(Access::MW_BIND) {
        v |= IBV_ACCESS_MW_BIND;
    }
    v
}

// ---------------------------------------------------------------------------
// Context.

/// The function pointers of `ibv_context.ops` that the header's inline
/// wrappers call. Read once at open; providers set them at context creation
/// and never change them.
#[derive(Clone, Copy)]
struct Ops {
    poll_cq: PollCqFn,
    req_notify_cq: ReqNotifyCqFn,
    post_send: PostSendFn,
    post_recv: PostRecvFn,
    post_srq_recv: Option<PostSrqRecvFn>,
    alloc_mw: Option<AllocMwFn>,
    dealloc_mw: Option<DeallocMwFn>,
}

pub(crate) struct CtxInner {
    lib: &'static Lib,
    /// The context rdma_cm uses for this device (owned by librdmacm).
    ctx: *mut ibv_context,
    /// The `rdma_get_devices` list, released at drop.
    list: *mut *mut ibv_context,
    ops: Ops,
    info: DeviceInfo,
    config: Config,
    iwarp: bool,
    /// rxe writes the kernel's `IB_WC_WITH_INVALIDATE` (bit 2) into user
    /// completions instead of `IBV_WC_WITH_INV` (bit 3); bit 2 is
    /// `IBV_WC_IP_CSUM_OK` in libibverbs, meaningless on RC receives.
    rxe_inv_quirk: bool,
    /// siw never raises solicited-only CQ events (Linux 6.1 passes
    /// "signalled" instead of the receive's "solicited" flag when it decides
    /// whether to notify): a solicited-only arm becomes a next-completion arm.
    siw_solicited_quirk: bool,
    native_mw: bool,
    max_ird: u8,
    max_ord: u8,
}

// SAFETY: `ctx` is an ibv_context, which libibverbs documents as usable from
// any thread (all verbs on it are thread-safe); `list` is only touched in
// `drop`. Nothing here is tied to the creating thread.
unsafe impl Send for CtxInner {}
// SAFETY: as above; shared access only calls thread-safe verbs.
unsafe impl Sync for CtxInner {}

impl CtxInner {
    fn open(lib: &'static Lib, name: &str, config: &Config) -> Result<Arc<CtxInner>> {
        let mut n = 0;
        // SAFETY: rdma_get_devices writes the count to `n` and returns a
        // NULL-terminated array of `n` contexts owned by librdmacm (valid
        // until rdma_free_devices) or NULL with errno set.
        let list = unsafe { (lib.rdma_get_devices)(&mut n) };
        if list.is_null() {
            return Err(os_err("rdma_get_devices"));
        }
        let mut found = ptr::null_mut();
        let mut names = Vec::new();
        for i in 0..n.max(0) as usize {
            // SAFETY: i < n entries of the array returned above; each entry is
            // a live ibv_context whose `device` points to its ibv_device.
            let (c, dev_name) = unsafe {
                let c = *list.add(i);
                (c, cstr_array(&(*(*c).device).name))
            };
            if dev_name == name {
                found = c;
            }
            names.push(dev_name);
        }
        if found.is_null() {
            // SAFETY: `list` came from rdma_get_devices and is freed once.
            unsafe { (lib.rdma_free_devices)(list) };
            return Err(Error::NoSuchDevice(format!(
                "verbs has no device {name:?} (devices: {})",
                if names.is_empty() {
                    "none".to_string()
                } else {
                    names.join(", ")
                }
            )));
        }
        // SAFETY: `found` is a live context; `ops` is plain data inside it.
        let raw_ops = unsafe { &(*found).ops };
        let ops = match (
            raw_ops.poll_cq,
            raw_ops.req_notify_cq,
            raw_ops.post_send,
            raw_ops.post_recv,
        ) {
            (Some(poll_cq), Some(req_notify_cq), Some(post_send), Some(post_recv)) => Ops {
                poll_cq,
                req_notify_cq,
                post_send,
                post_recv,
                post_srq_recv: raw_ops.post_srq_recv,
                alloc_mw: raw_ops.alloc_mw,
                dealloc_mw: raw_ops.dealloc_mw,
            },
            _ => {
                // SAFETY: as above.
                unsafe { (lib.rdma_free_devices)(list) };
                return Err(Error::ProviderUnavailable(format!(
                    "{name}: the verbs provider library lacks post/poll operations"
                )));
            }
        };
        // SAFETY: `found` is live; describe() only queries it.
        let (info, dev) = unsafe { sys::describe(lib, found, (*found).device) };
        let iwarp = info.transport == Transport::Iwarp;
        let rxe_inv_quirk = sys::is_rxe(name, info.transport);
        let siw_solicited_quirk = sys::is_siw(name, info.transport);
        let native_mw = info
            .caps
            .as_ref()
            .is_some_and(|c| c.mw_kind == MwKind::Native)
            && ops.alloc_mw.is_some()
            && ops.dealloc_mw.is_some();
        Ok(Arc::new(CtxInner {
            lib,
            ctx: found,
            list,
            ops,
            info,
            config: config.clone(),
            iwarp,
            rxe_inv_quirk,
            siw_solicited_quirk,
            native_mw,
            max_ird: dev.max_ird,
            max_ord: dev.max_ord,
        }))
    }

    /// Effective IRD we offer: 0 = the device maximum.
    fn eff_ird(&self, want: u8) -> u8 {
        if want == 0 {
            self.max_ird
        } else {
            want.min(self.max_ird)
        }
    }
    fn eff_ord(&self, want: u8) -> u8 {
        if want == 0 {
            self.max_ord
        } else {
            want.min(self.max_ord)
        }
    }
}

impl Drop for CtxInner {
    fn drop(&mut self) {
        // SAFETY: every PD/CQ/channel/id made on this context holds an Arc
        // to us, so all are gone; `list` came from rdma_get_devices.
        unsafe { (self.lib.rdma_free_devices)(self.list) };
    }
}

struct VerbsContext(Arc<CtxInner>);

impl ContextOps for VerbsContext {
    fn device(&self) -> &DeviceInfo {
        &self.0.info
    }

    fn alloc_pd(&self) -> Result<Arc<dyn PdOps>> {
        let c = &self.0;
        // SAFETY: c.ctx is live for the life of `c`.
        let pd = unsafe { (c.lib.ibv_alloc_pd)(c.ctx) };
        if pd.is_null() {
            return Err(os_err("ibv_alloc_pd"));
        }
        Ok(Arc::new(VerbsPd(Arc::new(PdInner {
            ctx: c.clone(),
            pd,
            windows: Mutex::new(HashMap::new()),
            mrs: AtomicU64::new(0),
            mrs_remote: AtomicU64::new(0),
            mws: AtomicU64::new(0),
        }))))
    }

    fn create_comp_channel(&self) -> Result<Arc<dyn CompChannelOps>> {
        Ok(Arc::new(VerbsChannel(ChanInner::new(&self.0)?)))
    }

    fn create_cq(
        &self,
        depth: u32,
        channel: Option<&CompChannel>,
        tag: Option<u64>,
    ) -> Result<Arc<dyn CqOps>> {
        let c = &self.0;
        let chan = match channel {
            None => None,
            Some(ch) => {
                let v = (*ch.0)
                    .as_any()
                    .downcast_ref::<VerbsChannel>()
                    .ok_or_else(|| {
                        Error::InvalidArgument("completion channel of another provider".into())
                    })?;
                if v.0.ctx.ctx != c.ctx {
                    return Err(Error::InvalidArgument(
                        "completion channel of another device context".into(),
                    ));
                }
                Some(v.0.clone())
            }
        };
        let depth = i32::try_from(depth.max(1))
            .map_err(|_| Error::InvalidArgument(format!("CQ depth {depth}")))?;
        let chp = chan.as_ref().map_or(ptr::null_mut(), |c| c.ch);
        // The tag doubles as the CQ's cq_context (what ibv_get_cq_event
        // hands back); the channel's map says which CQs have one.
        let cq_context = tag.map_or(ptr::null_mut(), |t| t as usize as *mut c_void);
        // SAFETY: c.ctx is live; chp is NULL or a live channel of the same
        // context, kept alive by the CqInner that holds `chan`; cq_context
        // is an opaque value libibverbs only stores and returns.
        let cq = unsafe { (c.lib.ibv_create_cq)(c.ctx, depth, cq_context, chp, 0) };
        if cq.is_null() {
            return Err(os_err("ibv_create_cq"));
        }
        if let (Some(ch), Some(t)) = (&chan, tag) {
            lock(&ch.tags).insert(cq as usize, t);
        }
        Ok(Arc::new(VerbsCq(Arc::new(CqInner {
            ctx: c.clone(),
            cq,
            chan,
            tag,
            side: Mutex::new(VecDeque::new()),
            qps: Mutex::new(HashMap::new()),
        }))))
    }

    fn listen(&self, addr: SocketAddr, backlog: u32) -> Result<Arc<dyn ListenerOps>> {
        cm::listen(&self.0, addr, backlog)
    }

    fn connect(
        &self,
        addr: SocketAddr,
        init: &QpInit,
        params: &ConnParams,
    ) -> Result<Arc<dyn QpOps>> {
        cm::connect(&self.0, addr, init, params, &[])
    }

    fn connect_with_recvs(
        &self,
        addr: SocketAddr,
        init: &QpInit,
        params: &ConnParams,
        recvs: &[RecvWr<'_>],
    ) -> Result<Arc<dyn QpOps>> {
        cm::connect(&self.0, addr, init, params, recvs)
    }

    fn progress(&self) -> Result<usize> {
        Ok(0)
    }
}

// ---------------------------------------------------------------------------
// Protection domain, memory regions, windows.

pub(crate) struct PdInner {
    ctx: Arc<CtxInner>,
    pd: *mut ibv_pd,
    /// Per-request-registration windows by their current rkey (fallback mode).
    windows: Mutex<HashMap<u32, Weak<MwInner>>>,
    /// `ibv_reg_mr` calls that succeeded, those with a remote right, and
    /// windows allocated ([`PdCensus`]).
    mrs: AtomicU64,
    mrs_remote: AtomicU64,
    mws: AtomicU64,
}

// SAFETY: an ibv_pd may be used from any thread (verbs are thread-safe); the
// pointer is only freed in drop.
unsafe impl Send for PdInner {}
// SAFETY: as above.
unsafe impl Sync for PdInner {}

impl Drop for PdInner {
    fn drop(&mut self) {
        // SAFETY: all MRs, MWs and QPs of this PD hold an Arc to us and are
        // gone; the PD is deallocated once.
        let r = unsafe { (self.ctx.lib.ibv_dealloc_pd)(self.pd) };
        if r != 0 {
            tracing::warn!("ibv_dealloc_pd failed: {r}");
        }
    }
}

struct VerbsPd(Arc<PdInner>);

impl PdInner {
    /// Register `len` bytes at `addr`.
    fn reg(&self, addr: *mut u8, len: usize, access: Access) -> Result<*mut ibv_mr> {
        // SAFETY: self.pd is live. The caller guarantees addr..addr+len is
        // valid memory that outlives the registration (owned buffer kept by
        // the MrInner, or the register_raw contract). The NIC may write it
        // (DMA) while registered; nothing here holds Rust references to it.
        let mr = unsafe {
            (self.ctx.lib.ibv_reg_mr)(self.pd, addr as *mut c_void, len, access_bits(access))
        };
        if mr.is_null() {
            let e = std::io::Error::last_os_error();
            return Err(match e.raw_os_error() {
                Some(libc::EINVAL) => {
                    Error::InvalidArgument(format!("ibv_reg_mr({len} bytes, {access:?}): {e}"))
                }
                Some(libc::ENOMEM) | Some(libc::EAGAIN) => {
                    Error::ResourceExhausted(format!("ibv_reg_mr({len} bytes): {e}"))
                }
                _ => Error::Io(e),
            });
        }
        self.mrs.fetch_add(1, Ordering::Relaxed);
        if access.intersects(Access::REMOTE_READ | Access::REMOTE_WRITE) {
            self.mrs_remote.fetch_add(1, Ordering::Relaxed);
        }
        Ok(mr)
    }
}

impl PdOps for VerbsPd {
    fn census(&self) -> PdCensus {
        PdCensus {
            mrs: self.0.mrs.load(Ordering::Relaxed),
            mrs_remote: self.0.mrs_remote.load(Ordering::Relaxed),
            mws: self.0.mws.load(Ordering::Relaxed),
        }
    }

    fn reg_mr(&self, mem: MemRegion, access: Access) -> Result<Arc<dyn MrOps>> {
        if mem.len == 0 {
            return Err(Error::InvalidArgument(
                "cannot register an empty region".into(),
            ));
        }
        let mr = self.0.reg(mem.addr, mem.len, access)?;
        // SAFETY: mr is the live ibv_mr just returned; keys are plain fields.
        let (lkey, rkey) = unsafe { ((*mr).lkey, (*mr).rkey) };
        Ok(Arc::new(VerbsMr(Arc::new(MrInner {
            pd: self.0.clone(),
            mr: Mutex::new(mr),
            lkey,
            rkey,
            addr: mem.addr as u64,
            len: mem.len as u64,
            access,
            _owner: mem.owner,
        }))))
    }

    fn create_srq(&self, max_wr: u32, max_sge: u32) -> Result<Arc<dyn SrqOps>> {
        let pd = &self.0;
        let Some(post) = pd.ctx.ops.post_srq_recv else {
            return Err(Error::NotSupported(format!(
                "{}: the verbs provider library has no post_srq_recv",
                pd.ctx.info.name
            )));
        };
        let mut attr = ibv_srq_init_attr {
            srq_context: ptr::null_mut(),
            attr: ibv_srq_attr {
                max_wr: max_wr.max(1),
                max_sge: max_sge.max(1),
                srq_limit: 0,
            },
        };
        // SAFETY: pd.pd is live (kept alive by the SrqInner's Arc); attr
        // lives on the stack for the call (the library copies it).
        let srq = unsafe { (pd.ctx.lib.ibv_create_srq)(pd.pd, &mut attr) };
        if srq.is_null() {
            return Err(os_err("ibv_create_srq"));
        }
        Ok(Arc::new(VerbsSrq(Arc::new(SrqInner {
            pd: pd.clone(),
            srq,
            post,
            track: Mutex::new(SrqTrack::default()),
        }))))
    }

    fn alloc_mw(&self) -> Result<Arc<dyn MwOps>> {
        let pd = &self.0;
        let ctx = &pd.ctx;
        let (mw, rkey, kind) = if ctx.native_mw {
            let alloc = ctx.ops.alloc_mw.expect("native_mw implies alloc_mw");
            // SAFETY: the inline ibv_alloc_mw(pd, IBV_MW_TYPE_2): calls the
            // provider's alloc_mw through the context ops with our live PD.
            let mw = unsafe { alloc(pd.pd, IBV_MW_TYPE_2) };
            if mw.is_null() {
                return Err(os_err("ibv_alloc_mw(type 2)"));
            }
            // SAFETY: mw is live; rkey is a plain field.
            (mw, unsafe { (*mw).rkey }, MwKind::Native)
        } else {
            (ptr::null_mut(), 0, MwKind::PerRequestRegistration)
        };
        pd.mws.fetch_add(1, Ordering::Relaxed);
        Ok(Arc::new(VerbsMw(Arc::new(MwInner {
            pd: pd.clone(),
            kind,
            mw: Mutex::new(mw),
            rkey: AtomicU32::new(rkey),
            reg: Mutex::new(None),
        }))))
    }
}

pub(crate) struct MrInner {
    pd: Arc<PdInner>,
    /// NULL once deregistered.
    mr: Mutex<*mut ibv_mr>,
    lkey: u32,
    rkey: u32,
    addr: u64,
    len: u64,
    access: Access,
    /// Keeps a library-owned buffer alive until this registration (and any
    /// fallback window over it, which holds an Arc to us) is gone.
    _owner: Option<Arc<dyn std::any::Any + Send + Sync>>,
}

// SAFETY: the ibv_mr pointer is guarded by the mutex and only passed to
// thread-safe verbs (ibv_dereg_mr, key reads). MrInner never touches the
// described memory: the NIC does (DMA), and the application does through
// `verbs::Mr`'s raw-pointer accessors, whose own SAFETY covers that.
unsafe impl Send for MrInner {}
// SAFETY: as above.
unsafe impl Sync for MrInner {}

impl MrInner {
    fn dereg(&self) {
        let mut g = lock(&self.mr);
        if g.is_null() {
            return;
        }
        // SAFETY: *g is the live ibv_mr; after success it is never used again
        // (set to NULL under the lock).
        let r = unsafe { (self.pd.ctx.lib.ibv_dereg_mr)(*g) };
        if r == 0 {
            *g = ptr::null_mut();
        } else {
            tracing::warn!(
                "ibv_dereg_mr failed ({r}); windows still bound? retried when the region is dropped"
            );
        }
    }
    fn raw(&self) -> *mut ibv_mr {
        *lock(&self.mr)
    }
}

impl Drop for MrInner {
    fn drop(&mut self) {
        self.dereg();
    }
}

struct VerbsMr(Arc<MrInner>);

impl MrOps for VerbsMr {
    fn lkey(&self) -> u32 {
        self.0.lkey
    }
    fn rkey(&self) -> u32 {
        self.0.rkey
    }
    fn deregister(&self) {
        self.0.dereg();
    }
}

/// A per-request registration standing in for a window binding.
struct FallbackReg {
    mr: *mut ibv_mr,
    /// The region the window is bound into (keeps its memory alive).
    _region: Arc<MrInner>,
}

pub(crate) struct MwInner {
    pd: Arc<PdInner>,
    kind: MwKind,
    /// Native: the ibv_mw (NULL once deallocated). Fallback: always NULL.
    mw: Mutex<*mut ibv_mw>,
    rkey: AtomicU32,
    /// Fallback: the current registration.
    reg: Mutex<Option<FallbackReg>>,
}

// SAFETY: the raw pointers are guarded by mutexes and only passed to
// thread-safe verbs.
unsafe impl Send for MwInner {}
// SAFETY: as above.
unsafe impl Sync for MwInner {}

impl MwInner {
    /// Fallback: drop the current registration (if its key is `rkey`, or any
    /// when `rkey` is None). Returns whether one was dropped.
    fn unregister(&self, rkey: Option<u32>) -> bool {
        let mut g = lock(&self.reg);
        let Some(reg) = g.as_ref() else { return false };
        // SAFETY: reg.mr is live until deregistered below.
        let key = unsafe { (*reg.mr).rkey };
        if rkey.is_some_and(|k| k != key) {
            return false;
        }
        // SAFETY: reg.mr is a live registration owned by this window; it is
        // removed from `reg` so never used again.
        let r = unsafe { (self.pd.ctx.lib.ibv_dereg_mr)(reg.mr) };
        if r != 0 {
            tracing::warn!("ibv_dereg_mr of a window registration failed: {r}");
        }
        *g = None;
        lock(&self.pd.windows).remove(&key);
        true
    }

    fn dealloc(&self) {
        match self.kind {
            MwKind::PerRequestRegistration => {
                self.unregister(None);
            }
            MwKind::Native => {
                let mut g = lock(&self.mw);
                if !g.is_null() {
                    let dealloc = self.pd.ctx.ops.dealloc_mw.expect("native");
                    // SAFETY: the inline ibv_dealloc_mw: the provider's
                    // dealloc_mw on our live window, which is never used again.
                    let r = unsafe { dealloc(*g) };
                    if r != 0 {
                        tracing::warn!("ibv_dealloc_mw failed: {r}");
                    }
                    *g = ptr::null_mut();
                }
            }
        }
    }
}

impl Drop for MwInner {
    fn drop(&mut self) {
        self.dealloc();
    }
}

struct VerbsMw(Arc<MwInner>);

impl MwOps for VerbsMw {
    fn rkey(&self) -> u32 {
        self.0.rkey.load(Ordering::Acquire)
    }
    fn kind(&self) -> MwKind {
        self.0.kind
    }
    fn deallocate(&self) {
        self.0.dealloc();
    }
}

// ---------------------------------------------------------------------------
// Shared receive queue.

pub(crate) struct SrqInner {
    pd: Arc<PdInner>,
    srq: *mut ibv_srq,
    /// The context's `ops.post_srq_recv` (what the inline
    /// `ibv_post_srq_recv` calls).
    post: PostSrqRecvFn,
    track: Mutex<SrqTrack>,
}

/// Receives posted and not completed yet: the device sees sequence numbers
/// (with `RECV_BIT`) as wr_ids; a completion on any QP of the SRQ takes its
/// record back (`CmQp::translate`).
#[derive(Default)]
struct SrqTrack {
    next: u64,
    pending: HashMap<u64, u64>,
}

// SAFETY: an ibv_srq may be used from any thread (ibv_post_srq_recv is
// thread-safe); the pointer is only freed in drop; the records are behind
// a mutex.
unsafe impl Send for SrqInner {}
// SAFETY: as above.
unsafe impl Sync for SrqInner {}

impl SrqInner {
    /// The consumer's wr_id of the receive the device completed as `seq`.
    fn take(&self, seq: u64) -> Option<u64> {
        lock(&self.track).pending.remove(&seq)
    }
}

impl Drop for SrqInner {
    fn drop(&mut self) {
        // SAFETY: every QP bound to this SRQ holds an Arc to us and has been
        // destroyed; the SRQ is destroyed once. Receives still posted are
        // discarded with it (verbs semantics).
        let r = unsafe { (self.pd.ctx.lib.ibv_destroy_srq)(self.srq) };
        if r != 0 {
            tracing::warn!("ibv_destroy_srq failed: {r}");
        }
    }
}

pub(crate) struct VerbsSrq(Arc<SrqInner>);

impl SrqOps for VerbsSrq {
    fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<(), PostError> {
        let s = &self.0;
        if wrs.is_empty() {
            return Ok(());
        }
        // Held across the post: a completion of one of these receives
        // (translated on a polling thread) finds its record.
        let mut t = lock(&s.track);
        let base = t.next;
        let (r, posted) = cm::post_recv_list(s.pd.ctx.iwarp, wrs, base, |list, bad| {
            // SAFETY: the inline ibv_post_srq_recv: the provider's
            // post_srq_recv on our live SRQ with the NULL-terminated list
            // `post_recv_list` built (valid for the call); `bad` is its out
            // pointer.
            unsafe { (s.post)(s.srq, list, bad) }
        });
        for (i, w) in wrs.iter().enumerate().take(posted) {
            t.pending.insert(base + i as u64, w.wr_id);
        }
        t.next = base + posted as u64;
        if r == 0 {
            return Ok(());
        }
        Err(PostError {
            index: posted,
            error: errno_err("ibv_post_srq_recv", r.abs()),
        })
    }

    fn posted(&self) -> usize {
        lock(&self.0.track).pending.len()
    }
}

// ---------------------------------------------------------------------------
// Completion channel.

pub(crate) struct ChanInner {
    ctx: Arc<CtxInner>,
    ch: *mut ibv_comp_channel,
    /// epoll set of {channel fd, wake eventfd}: what `fd()` returns.
    epfd: OwnedFd,
    /// Signalled when a synthetic completion is queued on a CQ of this channel.
    evfd: OwnedFd,
    /// Tagged CQs of this channel: `ibv_cq` address → tag.
    tags: Mutex<HashMap<usize, u64>>,
    /// Tags of CQs that got a synthetic completion (`take_fired`).
    synth_fired: Mutex<Vec<u64>>,
}

// SAFETY: an ibv_comp_channel may be used from any thread; reads of its fd
// are serialised by the kernel; the fds are plain kernel objects.
unsafe impl Send for ChanInner {}
// SAFETY: as above.
unsafe impl Sync for ChanInner {}

fn set_nonblocking(fd: RawFd) -> Result<()> {
    // SAFETY: fcntl on an fd we own; no memory is passed.
    unsafe {
        let fl = libc::fcntl(fd, libc::F_GETFL);
        if fl < 0 || libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK) < 0 {
            return Err(os_err("fcntl(O_NONBLOCK)"));
        }
    }
    Ok(())
}

/// poll(2) one fd for POLLIN until `deadline`; returns whether it is readable.
fn poll_in(fd: RawFd, deadline: Option<Instant>) -> Result<bool> {
    loop {
        let ms = match deadline {
            None => -1,
            Some(d) => {
                let left = d.saturating_duration_since(Instant::now());
                // round up so that a short timeout does not become a busy 0
                left.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32
            }
        };
        let mut p = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd on the stack for the duration of the call.
        let r = unsafe { libc::poll(&mut p, 1, ms) };
        if r < 0 {
            if std::io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            return Err(os_err("poll"));
        }
        return Ok(r > 0);
    }
}

impl ChanInner {
    fn new(ctx: &Arc<CtxInner>) -> Result<Arc<ChanInner>> {
        // SAFETY: ctx.ctx is live.
        let ch = unsafe { (ctx.lib.ibv_create_comp_channel)(ctx.ctx) };
        if ch.is_null() {
            return Err(os_err("ibv_create_comp_channel"));
        }
        let guard = ChanGuard(ctx.lib, ch);
        // SAFETY: ch is live; fd is a plain field owned by the channel.
        let chfd = unsafe { (*ch).fd };
        set_nonblocking(chfd)?;
        let epfd = rustix::event::epoll::create(rustix::event::epoll::CreateFlags::CLOEXEC)
            .map_err(|e| rustix_err("epoll_create1", e))?;
        let evfd = rustix::event::eventfd(
            0,
            rustix::event::EventfdFlags::NONBLOCK | rustix::event::EventfdFlags::CLOEXEC,
        )
        .map_err(|e| rustix_err("eventfd", e))?;
        // The channel's fd belongs to libibverbs (closed by
        // ibv_destroy_comp_channel), so it is added with a raw epoll_ctl
        // rather than borrowed as a `BorrowedFd`; the eventfd goes the same way.
        for fd in [chfd, evfd.as_raw_fd()] {
            let mut ev = libc::epoll_event {
                events: libc::EPOLLIN as u32,
                u64: fd as u64,
            };
            // SAFETY: valid epoll fd, valid fds, event struct on the stack.
            if unsafe { libc::epoll_ctl(epfd.as_raw_fd(), libc::EPOLL_CTL_ADD, fd, &mut ev) } < 0 {
                return Err(os_err("epoll_ctl"));
            }
        }
        std::mem::forget(guard);
        Ok(Arc::new(ChanInner {
            ctx: ctx.clone(),
            ch,
            epfd,
            evfd,
            tags: Mutex::new(HashMap::new()),
            synth_fired: Mutex::new(Vec::new()),
        }))
    }

    /// Wake waiters (a synthetic completion was queued on the CQ tagged `tag`).
    fn wake(&self, tag: Option<u64>) {
        if let Some(t) = tag {
            let mut f = lock(&self.synth_fired);
            if !f.contains(&t) {
                f.push(t);
            }
        }
        // A full counter (EAGAIN) already means "readable".
        let _ = rustix::io::write(&self.evfd, &1u64.to_ne_bytes());
    }

    /// Consume the synthetic-completion wake-up; returns whether there was one.
    fn consume_wake(&self) -> bool {
        let mut v = [0u8; 8];
        matches!(rustix::io::read(&self.evfd, &mut v), Ok(8))
    }

    /// The next CQ event, acknowledged, without blocking: `Some(tag)` (the
    /// CQ's tag, if it has one), or `None` when no event is queued.
    fn next_event(&self) -> Option<Option<u64>> {
        let mut cq: *mut ibv_cq = ptr::null_mut();
        let mut cq_ctx: *mut c_void = ptr::null_mut();
        // SAFETY: self.ch is live; its fd is nonblocking, so this returns
        // -1 (EAGAIN) instead of blocking when no event is queued. On
        // success `cq` is a live CQ of this channel (ibv_destroy_cq waits
        // until its events are acknowledged).
        let r = unsafe { (self.ctx.lib.ibv_get_cq_event)(self.ch, &mut cq, &mut cq_ctx) };
        if r != 0 {
            return None;
        }
        // Looked up before the acknowledgement, while the CQ (and so its
        // entry) cannot be gone.
        let tag = lock(&self.tags).get(&(cq as usize)).copied();
        // SAFETY: acknowledges the one event just received on `cq`, so
        // acknowledgements always balance the events got (ibv_destroy_cq
        // of a CQ that fired does not wait forever).
        unsafe { (self.ctx.lib.ibv_ack_cq_events)(cq, 1) };
        Some(tag)
    }

    /// Consume pending events without blocking; returns whether any.
    fn drain(&self) -> bool {
        let mut got = self.consume_wake();
        while self.next_event().is_some() {
            got = true;
        }
        got
    }

    /// Consume pending events; append the tags of the CQs that fired (once each).
    fn take_fired(&self, out: &mut Vec<u64>) -> usize {
        let before = out.len();
        let add = |out: &mut Vec<u64>, t: u64| {
            if !out[before..].contains(&t) {
                out.push(t);
            }
        };
        self.consume_wake();
        for t in std::mem::take(&mut *lock(&self.synth_fired)) {
            add(out, t);
        }
        while let Some(tag) = self.next_event() {
            if let Some(t) = tag {
                add(out, t);
            }
        }
        out.len() - before
    }
}

/// Destroys a half-built completion channel on early return.
struct ChanGuard(&'static Lib, *mut ibv_comp_channel);
impl Drop for ChanGuard {
    fn drop(&mut self) {
        // SAFETY: the channel has no CQs yet and is destroyed once.
        unsafe { (self.0.ibv_destroy_comp_channel)(self.1) };
    }
}

impl Drop for ChanInner {
    fn drop(&mut self) {
        // SAFETY: every CQ using this channel holds an Arc to us and is gone.
        let r = unsafe { (self.ctx.lib.ibv_destroy_comp_channel)(self.ch) };
        if r != 0 {
            tracing::warn!("ibv_destroy_comp_channel failed: {r}");
        }
    }
}

struct VerbsChannel(Arc<ChanInner>);

impl CompChannelOps for VerbsChannel {
    fn fd(&self) -> RawFd {
        self.0.epfd.as_raw_fd()
    }

    fn wait(&self, timeout: Option<Duration>) -> Result<bool> {
        let deadline = timeout.map(|t| Instant::now() + t);
        loop {
            if self.0.drain() {
                return Ok(true);
            }
            if !poll_in(self.0.epfd.as_raw_fd(), deadline)? {
                return Ok(self.0.drain());
            }
        }
    }

    fn take_fired(&self, out: &mut Vec<u64>) -> Result<usize> {
        Ok(self.0.take_fired(out))
    }
}

// ---------------------------------------------------------------------------
// Completion queue.

pub(crate) struct CqInner {
    ctx: Arc<CtxInner>,
    cq: *mut ibv_cq,
    chan: Option<Arc<ChanInner>>,
    /// Reported by the channel's `take_fired` when this CQ fires.
    tag: Option<u64>,
    /// Synthetic completions (fallback window binds/invalidations, flushes of
    /// requests posted after the QP failed); drained before the hardware CQ.
    /// Its lock is also the CQ's poll lock: whoever takes completions from
    /// the device (`poll`, `drain_into`) holds it from `ibv_poll_cq` to the
    /// end of translating them. A completion is matched to its work request
    /// by its place in the QP's queue of posted requests, in order
    /// (`CmQp::translate`), so the completions must be translated in the
    /// order the device gave them. Two threads polling at once (a caller
    /// busy-polling beside the thread that drives the queue) could
    /// otherwise translate a later batch first: its match dropped the
    /// earlier requests' records as completed unsignaled, and their
    /// completions, translated next, found no record and were lost (reads
    /// that never completed, send slots never freed: `lwio mount` with four
    /// readers on rxe and siw, scripts/vm/mount-readers.sh).
    side: Mutex<VecDeque<Wc>>,
    /// QPs whose completions land here, by QP number (to translate wr_ids).
    qps: Mutex<HashMap<u32, Weak<CmQp>>>,
}

// SAFETY: ibv_cq polling/arming is thread-safe in libibverbs providers; the
// Rust-side state is behind mutexes.
unsafe impl Send for CqInner {}
// SAFETY: as above.
unsafe impl Sync for CqInner {}

impl CqInner {
    /// Queue a synthetic completion behind everything the device has already
    /// completed on this CQ (those are moved to the side queue first, so
    /// completion order is kept).
    fn push_synthetic(&self, wc: Wc) {
        let mut side = lock(&self.side);
        self.drain_into(&mut side);
        side.push_back(wc);
        drop(side);
        if let Some(ch) = &self.chan {
            ch.wake(self.tag);
        }
    }

    /// Several synthetic completions, queued the same way.
    fn push_synthetic_all(&self, wcs: impl IntoIterator<Item = Wc>) {
        let mut side = lock(&self.side);
        self.drain_into(&mut side);
        let before = side.len();
        side.extend(wcs);
        let added = side.len() > before;
        drop(side);
        if added {
            if let Some(ch) = &self.chan {
                ch.wake(self.tag);
            }
        }
    }

    /// Move everything the device has completed so far to the side queue
    /// (whose lock the caller holds: `side`).
    fn drain_into(&self, side: &mut VecDeque<Wc>) {
        loop {
            // SAFETY: ibv_wc is plain old data; all-zero is a valid value.
            let mut buf: [ibv_wc; POLL_BATCH] = unsafe { std::mem::zeroed() };
            // SAFETY: the inline ibv_poll_cq on our live CQ, at most
            // POLL_BATCH entries into `buf`.
            let r = unsafe { (self.ctx.ops.poll_cq)(self.cq, POLL_BATCH as i32, buf.as_mut_ptr()) };
            if r <= 0 {
                break;
            }
            let qps = lock(&self.qps);
            for raw in &buf[..r as usize] {
                if let Some(w) = qps
                    .get(&raw.qp_num)
                    .and_then(Weak::upgrade)
                    .and_then(|q| q.translate(raw))
                {
                    side.push_back(w);
                }
            }
            if (r as usize) < POLL_BATCH {
                break;
            }
        }
    }
}

impl Drop for CqInner {
    fn drop(&mut self) {
        if let Some(ch) = &self.chan {
            lock(&ch.tags).remove(&(self.cq as usize));
        }
        // SAFETY: QPs using this CQ hold an Arc to us and are destroyed; the
        // CQ is destroyed once. Events on it were acknowledged in drain().
        let r = unsafe { (self.ctx.lib.ibv_destroy_cq)(self.cq) };
        if r != 0 {
            tracing::warn!("ibv_destroy_cq failed: {r}");
        }
    }
}

struct VerbsCq(Arc<CqInner>);

const POLL_BATCH: usize = 32;

impl CqOps for VerbsCq {
    fn poll(&self, out: &mut [Wc]) -> Result<usize> {
        let c = &self.0;
        // Held to the end: the poll lock (see `side`).
        let mut side = lock(&c.side);
        let mut n = 0;
        while n < out.len() {
            match side.pop_front() {
                Some(wc) => {
                    out[n] = wc;
                    n += 1;
                }
                None => break,
            }
        }
        while n < out.len() {
            let want = (out.len() - n).min(POLL_BATCH);
            // SAFETY: ibv_wc is plain old data; all-zero is a valid value.
            let mut buf: [ibv_wc; POLL_BATCH] = unsafe { std::mem::zeroed() };
            // SAFETY: the inline ibv_poll_cq: the provider's poll_cq on our
            // live CQ, writing at most `want` ≤ POLL_BATCH entries into `buf`.
            let r = unsafe { (c.ctx.ops.poll_cq)(c.cq, want as i32, buf.as_mut_ptr()) };
            if r < 0 {
                return Err(Error::Io(std::io::Error::other(format!(
                    "ibv_poll_cq failed ({r})"
                ))));
            }
            let got = r as usize;
            if got == 0 {
                break;
            }
            let qps = lock(&c.qps);
            for raw in &buf[..got] {
                dbg_ibv!(
                    "wc qp={} wr_id={:#x} status={} opcode={} flags={:#x} len={} imm/inv={:#x} vendor={:#x}",
                    raw.qp_num,
                    raw.wr_id,
                    raw.status,
                    raw.opcode,
                    raw.wc_flags,
                    raw.byte_len,
                    raw.imm_data,
                    raw.vendor_err
                );
                let core = qps.get(&raw.qp_num).and_then(Weak::upgrade);
                match core.and_then(|q| q.translate(raw)) {
                    Some(wc) => {
                        out[n] = wc;
                        n += 1;
                    }
                    None => tracing::debug!(
                        "dropping a completion of QP {} (destroyed or unknown)",
                        raw.qp_num
                    ),
                }
            }
            if got < want {
                break;
            }
        }
        Ok(n)
    }

    fn arm(&self, solicited_only: bool) -> Result<()> {
        let c = &self.0;
        if c.chan.is_none() {
            return Err(Error::InvalidArgument(
                "arming a CQ that has no completion channel".into(),
            ));
        }
        // siw: a spurious wake-up rather than a missed one (see the field).
        let solicited = solicited_only && !c.ctx.siw_solicited_quirk;
        // SAFETY: the inline ibv_req_notify_cq on our live CQ.
        let r = unsafe { (c.ctx.ops.req_notify_cq)(c.cq, solicited as i32) };
        if r != 0 {
            return Err(errno_err("ibv_req_notify_cq", r));
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------
// Status/opcode mapping.

pub(crate) fn map_status(s: u32) -> WcStatus {
    match s {
        IBV_WC_SUCCESS => WcStatus::Success,
        IBV_WC_LOC_LEN_ERR => WcStatus::LocLenErr,
        IBV_WC_LOC_QP_OP_ERR | IBV_WC_LOC_EEC_OP_ERR => WcStatus::LocQpOpErr,
        IBV_WC_LOC_PROT_ERR | IBV_WC_LOC_ACCESS_ERR => WcStatus::LocProtErr,
        IBV_WC_WR_FLUSH_ERR => WcStatus::WrFlushErr,
        IBV_WC_MW_BIND_ERR => WcStatus::MwBindErr,
        IBV_WC_REM_INV_REQ_ERR | IBV_WC_REM_INV_RD_REQ_ERR => WcStatus::RemInvReqErr,
        IBV_WC_REM_ACCESS_ERR => WcStatus::RemAccessErr,
        IBV_WC_REM_OP_ERR | IBV_WC_REM_ABORT_ERR => WcStatus::RemOpErr,
        IBV_WC_RETRY_EXC_ERR | IBV_WC_RESP_TIMEOUT_ERR => WcStatus::RetryExcErr,
        IBV_WC_RNR_RETRY_EXC_ERR => WcStatus::RnrRetryExcErr,
        IBV_WC_FATAL_ERR => WcStatus::FatalErr,
        _ => WcStatus::GeneralErr,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn load_fails_cleanly_or_lists_devices() {
        let p = provider();
        assert_eq!(p.name(), "verbs");
        let devs = p.devices();
        match available() {
            Err(reason) => {
                assert_eq!(devs.len(), 1);
                assert_eq!(devs[0].usable.as_ref().unwrap_err(), &reason);
                match p.open(Some("rxe0"), &Config::default()) {
                    Err(Error::ProviderUnavailable(r)) => assert_eq!(r, reason),
                    Err(e) => panic!("unexpected error {e}"),
                    Ok(_) => panic!("open succeeded without libraries"),
                }
            }
            Ok(()) => {
                for d in &devs {
                    assert_eq!(d.provider, "verbs");
                }
                match p.open(Some("no-such-device-lwio"), &Config::default()) {
                    Err(Error::NoSuchDevice(_)) | Err(Error::Io(_)) => {}
                    Err(e) => panic!("unexpected error {e}"),
                    Ok(_) => panic!("opened a device that does not exist"),
                }
            }
        }
        // never panics when no device is usable
        let _ = p.open(None, &Config::default());
    }

    #[test]
    fn missing_library_is_an_error_not_a_crash() {
        let e = Lib::load_from("libibverbs-lwio-missing.so.1", "librdmacm.so.1")
            .err()
            .expect("a missing library must not load");
        assert!(e.contains("libibverbs-lwio-missing.so.1"), "{e}");
        let e = Lib::load_from("libc.so.6", "librdmacm-lwio-missing.so.1")
            .err()
            .expect("a missing library must not load");
        // libc loads but has no verbs symbols, or the second library is missing
        assert!(e.contains("lwio-missing") || e.contains("symbol"), "{e}");
    }

    #[test]
    fn status_mapping() {
        assert_eq!(map_status(IBV_WC_SUCCESS), WcStatus::Success);
        assert_eq!(map_status(IBV_WC_WR_FLUSH_ERR), WcStatus::WrFlushErr);
        assert_eq!(map_status(IBV_WC_REM_ACCESS_ERR), WcStatus::RemAccessErr);
        assert_eq!(
            map_status(IBV_WC_RNR_RETRY_EXC_ERR),
            WcStatus::RnrRetryExcErr
        );
        assert_eq!(map_status(999), WcStatus::GeneralErr);
    }

    #[test]
    fn private_data_framing() {
        let f = cm::frame_private(false, cm::PdMsg::Request, b"hello").unwrap();
        let mut padded = f.clone();
        padded.resize(56, 0);
        assert_eq!(cm::unframe_private(false, &padded), b"hello");
        assert_eq!(cm::unframe_private(true, b"hello"), b"hello");
        assert!(cm::frame_private(false, cm::PdMsg::Request, &[0; 55]).is_err());
        assert!(cm::frame_private(false, cm::PdMsg::Accept, &[0; 194]).is_ok());
        assert_eq!(
            cm::frame_private(true, cm::PdMsg::Accept, b"x").unwrap(),
            b"x"
        );
    }
}
