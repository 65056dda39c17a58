//! Provider traits. Consumers do not need these; providers implement them.

use super::*;

/// Gives providers a way to downcast handles of their own kind.
pub trait AsAny: Any + Send + Sync {
    fn as_any(&self) -> &dyn Any;
}
impl<T: Any + Send + Sync> AsAny for T {
    fn as_any(&self) -> &dyn Any {
        self
    }
}

pub trait ProviderOps: AsAny {
    fn name(&self) -> &'static str;
    /// Every device, usable or not (with the reason).
    fn devices(&self) -> Vec<DeviceInfo>;
    fn open(&self, device: &str, config: &Config) -> Result<Arc<dyn ContextOps>>;
}

pub trait ContextOps: AsAny {
    fn device(&self) -> &DeviceInfo;
    fn alloc_pd(&self) -> Result<Arc<dyn PdOps>>;
    fn create_comp_channel(&self) -> Result<Arc<dyn CompChannelOps>>;
    /// A CQ, on `channel` if given; with a `tag` (only given with a
    /// channel) [`CompChannelOps::take_fired`] reports its events as it.
    fn create_cq(
        &self,
        depth: u32,
        channel: Option<&CompChannel>,
        tag: Option<u64>,
    ) -> Result<Arc<dyn CqOps>>;
    fn listen(&self, addr: SocketAddr, backlog: u32) -> Result<Arc<dyn ListenerOps>>;
    fn connect(
        &self,
        addr: SocketAddr,
        init: &QpInit,
        params: &ConnParams,
    ) -> Result<Arc<dyn QpOps>>;
    /// Manual progress: do whatever work is pending without blocking; returns
    /// the number of events processed. A no-op for hardware providers.
    fn progress(&self) -> Result<usize>;
    /// A new context of the same device and configuration whose work
    /// is driven by its caller alone (`Progress::Manual`), for one
    /// connection served by one thread; `None` if the provider gains
    /// nothing from it (the default: hardware has no per-context
    /// progress thread to avoid).
    fn open_manual_sibling(&self) -> Result<Option<Arc<dyn ContextOps>>> {
        Ok(None)
    }
    /// Connect with `recvs` posted on the new QP before the connection
    /// request is sent. The default connects, then posts.
    fn connect_with_recvs(
        &self,
        addr: SocketAddr,
        init: &QpInit,
        params: &ConnParams,
        recvs: &[RecvWr<'_>],
    ) -> Result<Arc<dyn QpOps>> {
        let qp = self.connect(addr, init, params)?;
        qp.post_recv(recvs).map_err(|e| e.error)?;
        Ok(qp)
    }
}

/// Registered memory as handed to a provider. The provider must keep
/// `owner` alive for as long as any key of the registration (or a window
/// bound to it) can be used or a work request referencing it is in flight.
pub struct MemRegion {
    pub addr: *mut u8,
    pub len: usize,
    pub owner: Option<Arc<dyn Any + Send + Sync>>,
}
// SAFETY: MemRegion is a description of memory that the registrant
// guarantees stays valid (owned buffer kept alive by `owner`, or the caller's
// contract of `Pd::register_raw`). Accesses through it are raw-pointer copies
// performed by the provider, never Rust references. The consumer learns
// that bytes are placed from a completion (the soft CQ's mutex, or the
// verbs library's barriers in poll_cq, order the placement before it)
// or, for a polled status block, from an atomic load that pairs with the
// soft provider's atomic store of the block's word (see
// `MrSlice::load_u64` for the case it leaves to the hardware).
unsafe impl Send for MemRegion {}
unsafe impl Sync for MemRegion {}

pub trait PdOps: AsAny {
    fn reg_mr(&self, mem: MemRegion, access: Access) -> Result<Arc<dyn MrOps>>;
    fn alloc_mw(&self) -> Result<Arc<dyn MwOps>>;
    /// What the provider has made on this domain since it was created.
    fn census(&self) -> super::PdCensus;
    /// A shared receive queue whose receives' keys belong to this domain.
    fn create_srq(&self, _max_wr: u32, _max_sge: u32) -> Result<Arc<dyn SrqOps>> {
        Err(Error::NotSupported("shared receive queues".into()))
    }
}

pub trait SrqOps: AsAny {
    /// As [`QpOps::post_recv`]; the receives are taken by whichever QP
    /// bound to the SRQ needs one next.
    fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<(), PostError>;
    /// Receives posted and not yet taken by a QP.
    fn posted(&self) -> usize;
    /// Take back up to `max` receives no QP has taken (the last posted
    /// first); their wr_ids. Devices cannot: none.
    fn withdraw(&self, _max: usize) -> Vec<u64> {
        Vec::new()
    }
    /// Take back every untaken receive whose wr_id `pick` selects;
    /// their wr_ids. Devices cannot: none.
    fn withdraw_if(&self, _pick: &mut dyn FnMut(u64) -> bool) -> Vec<u64> {
        Vec::new()
    }
    /// Times a Send found the SRQ empty and waited for a receive (the
    /// soft provider; devices: 0).
    fn starved(&self) -> u64 {
        0
    }
}

pub trait MrOps: AsAny {
    fn lkey(&self) -> u32;
    fn rkey(&self) -> u32;
    /// Invalidate both keys now; later accesses fail. Idempotent. Returns
    /// once no write into the region by the provider is running (a
    /// placement half done is not finished later).
    fn deregister(&self);
    /// The lock that orders the application's CPU accesses to the region's
    /// bytes (`Mr`'s copies and word accesses) against the provider's own
    /// accesses from threads of this process: `None` when the provider has
    /// none (a device or the kernel places and reads the bytes, outside the
    /// Rust abstract machine). Readers of the bytes take it shared, writers
    /// exclusive.
    fn cpu_lock(&self) -> Option<&std::sync::RwLock<()>> {
        None
    }
}

pub trait MwOps: AsAny {
    /// The key most recently issued for this window (valid only while bound).
    fn rkey(&self) -> u32;
    fn kind(&self) -> MwKind;
    fn deallocate(&self);
}

pub trait CqOps: AsAny {
    fn poll(&self, out: &mut [Wc]) -> Result<usize>;
    /// Request an event on the CQ's channel for the next (solicited) completion.
    fn arm(&self, solicited_only: bool) -> Result<()>;
}

pub trait CompChannelOps: AsAny {
    /// Readable (POLLIN) when an event is pending, or — for a manual-progress
    /// software provider — when there may be protocol work to do.
    fn fd(&self) -> RawFd;
    /// Block until an event arrives or `timeout` passes (None = forever),
    /// consuming and acknowledging it. Returns whether an event arrived.
    /// A manual-progress provider makes progress while it waits.
    fn wait(&self, timeout: Option<Duration>) -> Result<bool>;
    /// Without blocking: append the tags of the tagged CQs that fired
    /// since the last call, each once; consume the fd's readiness.
    /// Returns how many were appended.
    fn take_fired(&self, _out: &mut Vec<u64>) -> Result<usize> {
        Err(Error::NotSupported("tagged CQ events".into()))
    }
}

pub trait ListenerOps: AsAny {
    fn local_addr(&self) -> SocketAddr;
    /// Next connection request, or `None` after `timeout` (None = block).
    fn get_request(&self, timeout: Option<Duration>) -> Result<Option<Box<dyn ConnRequestOps>>>;
    /// Readable when a request is (probably) pending.
    fn fd(&self) -> RawFd;
}

pub trait ConnRequestOps: Send {
    fn peer_addr(&self) -> SocketAddr;
    fn private_data(&self) -> &[u8];
    /// The peer's offered IRD/ORD.
    fn peer_ird_ord(&self) -> (u8, u8);
    fn accept(self: Box<Self>, init: &QpInit, params: &ConnParams) -> Result<Arc<dyn QpOps>>;
    fn reject(self: Box<Self>, private_data: &[u8]) -> Result<()>;
    /// Accept with `recvs` posted on the new QP before the acceptance is
    /// sent. The default accepts, then posts (right for providers that
    /// buffer early Sends).
    fn accept_with_recvs(
        self: Box<Self>,
        init: &QpInit,
        params: &ConnParams,
        recvs: &[RecvWr<'_>],
    ) -> Result<Arc<dyn QpOps>> {
        let qp = self.accept(init, params)?;
        qp.post_recv(recvs).map_err(|e| e.error)?;
        Ok(qp)
    }
}

pub trait QpOps: AsAny {
    fn qp_num(&self) -> u32;
    fn state(&self) -> QpState;
    fn negotiated(&self) -> Negotiated;
    fn local_addr(&self) -> SocketAddr;
    fn peer_addr(&self) -> SocketAddr;
    fn post_send(&self, wrs: &[SendWr<'_>]) -> Result<(), PostError>;
    fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<(), PostError>;
    /// Post a bind of `mw`; returns the new remote key (new key byte).
    fn bind_mw(&self, mw: &Mw, bind: &MwBind<'_>, wr_id: u64, signaled: bool) -> Result<u32>;
    /// Post a local invalidate of a window key.
    fn invalidate(&self, rkey: u32, wr_id: u64, signaled: bool) -> Result<()>;
    /// Orderly disconnect; outstanding work is flushed.
    fn disconnect(&self) -> Result<()>;
    /// Move to the error state at once (flushes everything).
    fn set_error(&self);
    /// The iWARP Terminate this provider sent on the connection, as
    /// `layer << 12 | etype << 8 | ecode` (the `vendor_err` packing),
    /// if it refused the peer's traffic. `None` if it sent none or the
    /// provider does not tell (the default).
    fn terminate_sent(&self) -> Option<u16> {
        None
    }
    /// What the device reported when it refused the peer's traffic, where
    /// it reports it but not the Terminate (the verbs provider: the QP's
    /// affiliated asynchronous error). `None` if it did not (the default).
    fn device_refusal(&self) -> Option<DeviceRefusal> {
        None
    }
}
