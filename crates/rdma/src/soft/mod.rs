//! `soft`: the IETF iWARP stack (MPA/DDP/RDMAP) in user space over TCP.
//!
//! One device, `soft0` (TCP on any interface), transport iWARP. Wire
//! compatible with Linux siw (checked against the siw-modelled `lwio-iwarp`
//! crate in `tests/iwarp_interop.rs`).
//!
//! # Threads and progress
//! Each context owns an epoll fd over its QP sockets (edge-triggered) plus
//! an eventfd. Under [`Progress::Auto`] an engine thread waits on it and
//! does all receive work; under [`Progress::Manual`] whoever polls a CQ,
//! waits on a channel or calls [`Context::progress`] runs the same loop
//! without blocking (no engine thread, no cross-thread wake-up). In both
//! models a posting thread transmits directly (`writev` under the QP lock),
//! so a post never waits for a wake-up; a transmit that hits a full socket
//! is finished by the next `EPOLLOUT` edge. A completion channel's fd is an
//! eventfd (Auto) or an epoll fd over the eventfd and the context's epoll fd
//! (Manual: readable = "call poll").
//!
//! # Data path (`qp.rs`: queues, state, errors; `qp_tx.rs`: transmit; `qp_rx.rs`: receive)
//! MPA enhanced mode (IRD/ORD), markers off, CRC32c negotiated; DDP tagged
//! and untagged (QN 0 Send, 1 Read Request, 2 Terminate) with MSN/MO
//! checks; RDMAP Send, Send with Invalidate (± solicited), RDMA Write, RDMA
//! Read Request/Response, Terminate, and RFC 7306's Immediate Data (an
//! RDMA Write with Immediate is the Write followed by an Immediate Data
//! message on QN 0: 8 bytes, the value big-endian then zeros; it consumes a
//! receive, which completes as `RecvRdmaWithImm` with nothing written into
//! it). Linux siw has no Immediate Data: a consumer sends it only to a
//! peer that said it accepts it (LWIO: FEATURES bit 1, docs/protocol.md
//! §5.2). No Send with Immediate, no RFC 7306 atomics.
//!
//! The receive path runs on lwio-iwarp: its `FpduReceiver` deframes the
//! stream (MPA length, header, pad, CRC) and its `DdpRxState` validates each
//! segment header against the stream (queue numbers, MSNs, message offsets,
//! Read Request and Terminate sizes, opcodes continuing a message); the
//! fuzz targets of both, and `soft_qp_rx` over this engine, exercise the
//! code that runs. `qp_rx.rs` keeps placement (memory keys, receives,
//! anonymous buffering), `qp.rs` the queues.
//!
//! The transmit path runs on lwio-iwarp too: every FPDU's header area
//! (ULPDU_Length, DDP/RDMAP header incl. the Read Request header, a
//! Terminate's body) is a `SegmentHeader` emitted by
//! `lwio_iwarp::tx::emit_fpdu_header` into the frame's own array, pad and
//! CRC are `lwio_iwarp::tx::Trailer`, and the per-queue MSNs come from
//! `TxState::start_message`. The engine keeps its segmentation and frame
//! queue rather than `TxState::segment`'s `Segmenter`, because siw-sized
//! segments are not what the soft provider sends: it cuts every message
//! by one fixed `max_payload` (MSS minus the untagged overhead, not
//! rounded to 4, the same for tagged and untagged segments), builds one
//! segment at a time so Read Responses interleave with the send queue,
//! and sends payload straight from registered memory (`writev`, no copy
//! with CRC off). The Segmenter would change the bytes on the wire (its
//! payload per segment depends on the header length and is a multiple of
//! 4) and moves a header array per segment; the parts it is built from
//! are shared instead. `soft::tests::transmit_bytes_match_golden` pins the
//! streams to the bytes sent before the move.
//!
//! Each tagged segment is validated from its header alone (STag exists and
//! key byte matches, same PD, window bound to this QP, access right, TO and
//! length inside the region/window) *before* any payload byte is read; on a
//! violation the payload is discarded, a Terminate with the exact
//! layer/etype/ecode goes out, and the QP enters the error state. The
//! requester maps the Terminate to `RemAccessErr` (protection) /
//! `RemInvReqErr` / `RemOpErr` on its oldest unfinished WR, with the code in
//! `vendor_err` (`layer << 12 | etype << 8 | ecode`). An RDMA Write
//! completes locally once handed to TCP (like siw), so its rejection lands
//! on the next outstanding WR (e.g. a Read), or only moves the QP to error.
//!
//! Placement: with CRC off, payload ≥ 4 KiB is `read(2)` straight into the
//! registered memory (reported to the deframer with `advance_len`, a
//! length-only advance: the bytes are never read back); headers and small payloads come through a 64 KiB
//! staging buffer (header fills are capped at 1 KiB so a large payload that
//! follows is not swallowed by the stage) and are copied once. After a
//! segment under 16 KiB the receiver switches to small-message mode: a
//! refill reads up to a whole stage (many segments per system call) and only
//! payloads from 32 KiB go direct; the next large segment switches back.
//! (4 KiB reads at queue depth 32: one `read` per batch instead of two or
//! three per message.) With CRC on,
//! every received byte is staged and checksummed from our own buffer, then
//! copied once, and every sent payload is copied once into the frame and
//! checksummed there (otherwise `writev` sends straight from registered
//! memory): the provider never forms a Rust reference to registered memory,
//! which the consumer or another QP may be touching concurrently.
//!
//! Measured (release, loopback, 1 MiB RDMA Writes, 32 in flight, on a
//! shared 2-core VM with load 3.5–11, so only paired runs compare): direct
//! 4.24/4.21 GB/s with 0.149/0.165 s of engine-thread CPU per GB versus
//! staged 3.66/3.76 GB/s with 0.223/0.191 s/GB in the quietest batch; in
//! noisier batches the two were indistinguishable (kernel socket→user copy
//! dominates both, and the extra copy reads a cache-hot 64 KiB stage). CRC
//! on: 1.6–1.9 GB/s. Reproduce with `PERF_DIRECT=0|1 PERF_OP=write
//! PERF_SIZE=1048576 PERF_ITERS=3000 PERF_POLL=0 cargo test --release -p
//! lwio-rdma --lib perf_adhoc -- --ignored --nocapture`.
//!
//! Receive flow control (seed 003): Sends that find no posted receive are
//! buffered per QP up to `Config::indicate_window` bytes (each message
//! counted with 64 bytes of overhead so zero-length sends are bounded too);
//! then the QP stops reading its socket, and TCP pushes back on the sender,
//! until receives are posted, which are filled from the buffers in order.
//!
//! Miri (Stacked Borrows): `MIRIFLAGS=-Zmiri-disable-isolation cargo
//! +nightly miri test -p lwio-rdma --lib soft::tests::NAME -- --exact`
//! passes for `protection_violation_writes_nothing_and_terminates`,
//! `receive_path_byte_at_a_time_and_read_response`,
//! `partial_writes_of_batched_frames_give_the_same_stream`,
//! `receive_posted_mid_anonymous_message_gets_it_whole` (every 61st offset
//! under Miri), `flushed_partial_frame_sends_from_its_own_copy`, and
//! `soft::qp::rx::tests::place_bytes_copies_every_byte`. Its first run found the engine writing the Terminate buffer
//! and anonymous buffers through pointers taken with `as_ptr` (shared, so
//! read-only); they are taken with `as_mut_ptr`. Not run under Miri: the
//! property tests (hundreds of cases, hours at Miri's speed), the golden
//! transmit test (it maps memory at a fixed address), and everything with
//! sockets, epoll and threads (the conformance suite).
//!
//! Every queue is bounded: SQ/RQ by the QP caps, inbound reads by IRD,
//! outbound reads by ORD, CQs by their depth (overrun → `poll` error),
//! staging by 64 KiB, anonymous buffering by the window, Terminate payloads
//! by 64 bytes, MPA private data by 512 bytes.
//!
//! # Limits
//! * `ConnParams::ird/ord` of 0 mean "provider default" (8); max 16.
//! * RDMA Read sinks are a single SGE.
//! * `disconnect` sends what is queued, then closes (FIN) and flushes; there
//!   is no RDMAP-level graceful close (iWARP has none either).
//! * MPA peer-to-peer RTR is answered implicitly (zero-length tagged
//!   segments are accepted without an STag check) but never initiated.

pub mod cm;
pub mod cq;
#[cfg(any(test, feature = "fuzzing"))]
pub mod fuzzing;
pub mod mem;
pub mod qp;
pub mod srq;
pub mod sys;
#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use crate::verbs::*;
use cq::{ChanShared, CqShared, SoftChannel, SoftCq};
use lwio_iwarp::wire::mpa::{CRC_LEN, MPA_HDR_LEN};
use lwio_iwarp::wire::{ddp, rdmap};
use mem::{MemTable, SoftMw, SoftPd};
use qp::{QpEngine, QpParams, Shut, SockIo};
use rustix::event::epoll::{Event, EventFlags};

pub use qp::RxStats;

/// Provider name.
pub const NAME: &str = "soft";
/// The one device.
pub const DEVICE: &str = "soft0";
/// Default IRD/ORD when the consumer passes 0, and the maximum.
pub const DEFAULT_IRD_ORD: u8 = 8;
pub const MAX_IRD_ORD: u8 = 16;
const MAX_SGE: u32 = 8;
const WAKE_TOKEN: u64 = 0;

/// The soft provider.
pub fn provider() -> Provider {
    Provider(Arc::new(SoftProvider))
}

pub struct SoftProvider;

pub fn caps() -> DeviceCaps {
    DeviceCaps {
        max_mr_size: 1 << 40,
        max_qp_wr: 16 * 1024,
        max_cqe: 1 << 20,
        max_sge: MAX_SGE,
        max_inline_data: 256,
        max_ird: MAX_IRD_ORD as u32,
        max_ord: MAX_IRD_ORD as u32,
        max_msg_size: u32::MAX as u64,
        mw_kind: MwKind::Native,
        one_shot_mw: true,
        write_with_imm: true,
        send_with_invalidate: true,
        max_srq_wr: 16 * 1024,
        max_srq_sge: MAX_SGE,
    }
}

fn device_info() -> DeviceInfo {
    DeviceInfo {
        provider: NAME,
        name: DEVICE.into(),
        transport: Transport::Iwarp,
        addresses: vec![std::net::IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED)],
        usable: Ok(()),
        caps: Some(caps()),
    }
}

impl ProviderOps for SoftProvider {
    fn name(&self) -> &'static str {
        NAME
    }
    fn devices(&self) -> Vec<DeviceInfo> {
        vec![device_info()]
    }
    fn open(&self, device: &str, config: &Config) -> Result<Arc<dyn ContextOps>> {
        if device != DEVICE {
            return Err(Error::NoSuchDevice(format!(
                "soft provider has only {DEVICE}, not {device:?}"
            )));
        }
        Ok(Arc::new(SoftContext {
            sh: CtxShared::new(config.clone())?,
        }))
    }
}

/// Shared state of a context (held by every object made from it).
pub struct CtxShared {
    pub manual: bool,
    pub config: Config,
    ep: Arc<OwnedFd>,
    wake: Arc<OwnedFd>,
    qps: Mutex<HashMap<u64, Arc<QpShared>>>,
    /// QPs whose receive drive stopped on its budget (edge-triggered epoll
    /// will not report their pending input again).
    ready: Mutex<Vec<Arc<QpShared>>>,
    next_token: AtomicU64,
    next_qpn: AtomicU32,
    pub table: Arc<MemTable>,
    device: DeviceInfo,
}

impl CtxShared {
    fn new(config: Config) -> Result<Arc<CtxShared>> {
        let ep = Arc::new(sys::epoll_create()?);
        let wake = Arc::new(sys::eventfd()?);
        sys::epoll_add(&*ep, &*wake, EventFlags::IN | EventFlags::ET, WAKE_TOKEN)?;
        let manual = config.progress == Progress::Manual;
        let sh = Arc::new(CtxShared {
            manual,
            config,
            ep: ep.clone(),
            wake: wake.clone(),
            qps: Mutex::new(HashMap::new()),
            ready: Mutex::new(Vec::new()),
            next_token: AtomicU64::new(1),
            next_qpn: AtomicU32::new(1),
            table: Arc::new(MemTable::default()),
            device: device_info(),
        });
        if !manual {
            let weak = Arc::downgrade(&sh);
            std::thread::Builder::new()
                .name("lwio-soft-engine".into())
                .spawn(move || engine(weak, ep, wake))?;
        }
        Ok(sh)
    }

    pub fn epfd(&self) -> BorrowedFd<'_> {
        self.ep.as_fd()
    }

    /// Drive one QP; a panic is contained to it (the QP moves to error).
    fn drive_qp(&self, qp: &Arc<QpShared>) -> usize {
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| qp.drive()));
        match r {
            Ok((n, more)) => {
                if more && self.manual {
                    // The socket has no new edge to report the work left:
                    // `schedule` also makes the context (and so every
                    // manual channel's fd) readable, or a waiter would
                    // sleep with bytes already in the socket.
                    self.schedule(qp.clone());
                } else if more {
                    // The engine thread looks at the ready list next round.
                    self.ready
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .push(qp.clone());
                }
                n
            }
            Err(_) => {
                tracing::error!(
                    token = qp.token,
                    "soft: QP engine panicked; QP moved to error"
                );
                let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    let mut c = qp.lock();
                    c.set_error();
                    qp.drive_locked(&mut c, false);
                }));
                0
            }
        }
    }

    /// Drive the QPs that stopped on their budget; true if some still have
    /// more to do.
    fn run_ready(&self) -> (usize, bool) {
        let ready = std::mem::take(&mut *self.ready.lock().unwrap_or_else(|e| e.into_inner()));
        let mut n = 0;
        for qp in &ready {
            n += self.drive_qp(qp);
        }
        let more = !self
            .ready
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_empty();
        (n, more)
    }

    fn handle(&self, evs: &[Event]) -> usize {
        let mut n = 0;
        for ev in evs {
            let token = ev.data.u64();
            if token == WAKE_TOKEN {
                sys::eventfd_read(&*self.wake);
                continue;
            }
            if let Some(qp) = self.qp(token) {
                n += self.drive_qp(&qp);
            }
        }
        n
    }

    /// One round of the event loop (`ms` = epoll timeout, 0 while QPs have
    /// work left over from their budget).
    ///
    /// Work left over (a QP stopped on its budget again) keeps the wake-up
    /// eventfd signalled, so that the context's fd, and every manual
    /// channel's, stays readable until a later round does it: `handle` may
    /// just have consumed the signal that `schedule` gave for it, and the
    /// socket, read only in part, has no new edge to report.
    pub fn progress_once(&self, ms: i32) -> Result<usize> {
        let (mut n, more) = self.run_ready();
        let mut evs = [sys::NO_EVENT; 64];
        let k = sys::epoll_wait(&*self.ep, &mut evs, if more { 0 } else { ms })?;
        n += self.handle(&evs[..k]);
        if self.manual
            && !self
                .ready
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .is_empty()
        {
            sys::eventfd_write(&*self.wake);
        }
        Ok(n)
    }

    fn register(&self, qp: Arc<QpShared>) -> Result<()> {
        // Into the map first: the socket may already be readable (the peer's
        // first message right after the MPA exchange), and epoll reports that
        // edge at once to the engine thread, which drops events of tokens it
        // cannot find — with EPOLLET nothing would ever report the data again.
        let (token, keep) = (qp.token, qp.clone());
        self.qps
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(token, qp);
        let r = sys::epoll_add(
            &*self.ep,
            &keep.fd,
            EventFlags::IN | EventFlags::OUT | EventFlags::RDHUP | EventFlags::ET,
            token,
        );
        if let Err(e) = r {
            self.qps
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&token);
            return Err(e.into());
        }
        Ok(())
    }

    /// The QP registered under `token`, if it still is.
    fn qp(&self, token: u64) -> Option<Arc<QpShared>> {
        self.qps
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&token)
            .cloned()
    }

    /// Queue a QP that has receive work left and no edge to report it.
    fn schedule(&self, qp: Arc<QpShared>) {
        self.ready
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(qp);
        sys::eventfd_write(&*self.wake);
    }

    fn unregister(&self, qp: &QpShared) {
        sys::epoll_del(&*self.ep, &qp.fd);
        self.qps
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&qp.token);
    }
}

impl Drop for CtxShared {
    fn drop(&mut self) {
        // Tell the engine thread (if any) to look again: its upgrade fails.
        sys::eventfd_write(&*self.wake);
    }
}

fn engine(weak: Weak<CtxShared>, ep: Arc<OwnedFd>, _wake: Arc<OwnedFd>) {
    let mut evs = [sys::NO_EVENT; 64];
    loop {
        let more = match weak.upgrade() {
            Some(ctx) => ctx.run_ready().1,
            None => return,
        };
        let k = match sys::epoll_wait(&*ep, &mut evs, if more { 0 } else { 1000 }) {
            Ok(k) => k,
            Err(e) => {
                tracing::error!(error = %e, "soft engine: epoll_wait failed");
                return;
            }
        };
        let Some(ctx) = weak.upgrade() else {
            return;
        };
        ctx.handle(&evs[..k]);
    }
}

/// A QP as seen by the engine.
pub struct QpShared {
    core: Mutex<QpEngine>,
    fd: OwnedFd,
    token: u64,
    local: SocketAddr,
    peer: SocketAddr,
    negotiated: Negotiated,
}

impl QpShared {
    fn lock(&self) -> MutexGuard<'_, QpEngine> {
        self.core.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Do all pending protocol work. Returns segments + frames processed.
    fn drive(&self) -> (usize, bool) {
        let mut c = self.lock();
        let n = self.drive_locked(&mut c, true);
        (n, c.rx_more)
    }

    fn drive_locked(&self, c: &mut QpEngine, rx: bool) -> usize {
        let mut io = SockIo(self.fd.as_fd());
        let mut n = 0;
        if rx {
            n += c.rx_process(&mut io).unwrap_or(0);
        }
        match c.tx_process(&mut io) {
            Ok(k) => n += k,
            Err(e) => {
                tracing::debug!(error = %e, "soft: send failed");
                c.peer_closed = true;
                c.set_error();
            }
        }
        if c.shut == Shut::Now {
            sys::shutdown(self.fd.as_fd(), rustix::net::Shutdown::Write);
            c.shut = Shut::Done;
        }
        n
    }
}

pub struct SoftContext {
    sh: Arc<CtxShared>,
}

impl ContextOps for SoftContext {
    fn device(&self) -> &DeviceInfo {
        &self.sh.device
    }
    fn open_manual_sibling(&self) -> Result<Option<Arc<dyn ContextOps>>> {
        let config = Config {
            progress: Progress::Manual,
            ..self.sh.config.clone()
        };
        Ok(Some(Arc::new(SoftContext {
            sh: CtxShared::new(config)?,
        })))
    }
    fn alloc_pd(&self) -> Result<Arc<dyn PdOps>> {
        Ok(Arc::new(SoftPd::new(self.sh.table.clone())))
    }
    fn create_comp_channel(&self) -> Result<Arc<dyn CompChannelOps>> {
        Ok(Arc::new(SoftChannel(Arc::new(ChanShared::new(
            self.sh.clone(),
        )?))))
    }
    fn create_cq(
        &self,
        depth: u32,
        channel: Option<&CompChannel>,
        tag: Option<u64>,
    ) -> Result<Arc<dyn CqOps>> {
        let chan = match channel {
            None => None,
            Some(c) => Some(
                (*c.0)
                    .as_any()
                    .downcast_ref::<SoftChannel>()
                    .ok_or_else(|| Error::InvalidArgument("channel of another provider".into()))?
                    .0
                    .clone(),
            ),
        };
        if chan
            .as_ref()
            .is_some_and(|c| !Arc::ptr_eq(c.ctx(), &self.sh))
        {
            return Err(Error::InvalidArgument(
                "completion channel of another context".into(),
            ));
        }
        if depth == 0 || depth > caps().max_cqe {
            return Err(Error::InvalidArgument(format!("CQ depth {depth}")));
        }
        Ok(Arc::new(SoftCq(Arc::new(CqShared::with_tag(
            self.sh.clone(),
            depth,
            chan,
            tag,
        )))))
    }
    fn listen(&self, addr: SocketAddr, backlog: u32) -> Result<Arc<dyn ListenerOps>> {
        cm::listen(self.sh.clone(), addr, backlog)
    }
    fn connect(
        &self,
        addr: SocketAddr,
        init: &QpInit,
        params: &ConnParams,
    ) -> Result<Arc<dyn QpOps>> {
        cm::connect(self.sh.clone(), addr, init, params)
    }
    fn progress(&self) -> Result<usize> {
        if !self.sh.manual {
            return Ok(0);
        }
        self.sh.progress_once(0)
    }
}

/// Everything needed to turn an established, MPA-negotiated socket into a QP.
pub(crate) struct Established {
    pub stream: std::net::TcpStream,
    pub negotiated: Negotiated,
    pub crc: bool,
    pub ird: u8,
    pub ord: u8,
}

fn soft_cq(cq: &Cq) -> Result<Arc<CqShared>> {
    Ok((*cq.0)
        .as_any()
        .downcast_ref::<SoftCq>()
        .ok_or_else(|| Error::InvalidArgument("CQ of another provider".into()))?
        .0
        .clone())
}

pub(crate) fn check_init(ctx: &Arc<CtxShared>, init: &QpInit) -> Result<()> {
    let c = caps();
    let cap = &init.cap;
    if cap.max_send_wr == 0
        || cap.max_send_wr > c.max_qp_wr
        || cap.max_recv_wr > c.max_qp_wr
        || cap.max_send_sge > c.max_sge
        || cap.max_recv_sge > c.max_sge
        || cap.max_inline_data > c.max_inline_data
    {
        return Err(Error::InvalidArgument(format!(
            "QP capabilities {cap:?} exceed {c:?}"
        )));
    }
    (*init.pd.0)
        .as_any()
        .downcast_ref::<SoftPd>()
        .ok_or_else(|| Error::InvalidArgument("PD of another provider".into()))?;
    for cq in [&init.send_cq, &init.recv_cq] {
        if !Arc::ptr_eq(soft_cq(cq)?.ctx(), ctx) {
            return Err(Error::InvalidArgument("CQ of another context".into()));
        }
    }
    let pd = (*init.pd.0)
        .as_any()
        .downcast_ref::<SoftPd>()
        .ok_or_else(|| Error::InvalidArgument("PD of another provider".into()))?;
    if !Arc::ptr_eq(&pd.table, &ctx.table) {
        return Err(Error::InvalidArgument("PD of another context".into()));
    }
    soft_srq(ctx, init)?;
    Ok(())
}

/// The QP's shared receive queue, if it has one (of this context).
fn soft_srq(ctx: &Arc<CtxShared>, init: &QpInit) -> Result<Option<Arc<srq::SrqShared>>> {
    let Some(s) = &init.srq else {
        return Ok(None);
    };
    let s = (*s.0)
        .as_any()
        .downcast_ref::<srq::SoftSrq>()
        .ok_or_else(|| Error::InvalidArgument("SRQ of another provider".into()))?
        .0
        .clone();
    if !Arc::ptr_eq(&s.table, &ctx.table) {
        return Err(Error::InvalidArgument("SRQ of another context".into()));
    }
    Ok(Some(s))
}

/// TCP keepalive and `TCP_USER_TIMEOUT` so that a peer whose host is gone
/// is detected within about `t` (`Config::dead_peer_timeout`).
pub(crate) fn set_dead_peer_timeout(
    s: &std::net::TcpStream,
    t: std::time::Duration,
) -> std::io::Result<()> {
    use rustix::net::sockopt;
    use std::time::Duration;
    let secs = t.as_secs().max(3);
    sockopt::set_socket_keepalive(s, true)?;
    sockopt::set_tcp_keepidle(s, Duration::from_secs(secs / 3))?;
    sockopt::set_tcp_keepintvl(s, Duration::from_secs((secs / 6).max(1)))?;
    sockopt::set_tcp_keepcnt(s, 4)?;
    let ms = u32::try_from(t.as_millis()).unwrap_or(u32::MAX).max(1);
    sockopt::set_tcp_user_timeout(s, ms)?;
    Ok(())
}

pub(crate) fn create_qp(
    ctx: Arc<CtxShared>,
    init: &QpInit,
    est: Established,
) -> Result<Arc<dyn QpOps>> {
    let pd = (*init.pd.0)
        .as_any()
        .downcast_ref::<SoftPd>()
        .ok_or_else(|| Error::InvalidArgument("PD of another provider".into()))?;
    if !Arc::ptr_eq(&pd.table, &ctx.table) {
        return Err(Error::InvalidArgument("PD of another context".into()));
    }
    let stream = est.stream;
    stream.set_nodelay(true)?;
    if let Some(t) = ctx.config.dead_peer_timeout {
        set_dead_peer_timeout(&stream, t)?;
    }
    stream.set_nonblocking(true)?;
    let local = stream.local_addr()?;
    let peer = stream.peer_addr()?;
    let fd: OwnedFd = stream.into();
    let max_payload = if ctx.config.mulpdu > 0 {
        ctx.config.mulpdu.saturating_sub(ddp::UNTAGGED_HDR_LEN)
    } else {
        sys::mss(fd.as_fd())
            .unwrap_or(1460)
            .saturating_sub(MPA_HDR_LEN + CRC_LEN + ddp::UNTAGGED_HDR_LEN)
    }
    .clamp(64, 0xffff - ddp::UNTAGGED_HDR_LEN - rdmap::READ_REQUEST_LEN);
    let (scq, rcq) = (soft_cq(&init.send_cq)?, soft_cq(&init.recv_cq)?);
    if !Arc::ptr_eq(scq.ctx(), &ctx) || !Arc::ptr_eq(rcq.ctx(), &ctx) {
        return Err(Error::InvalidArgument("CQ of another context".into()));
    }
    let qpn = ctx.next_qpn.fetch_add(1, Ordering::Relaxed);
    let token = ctx.next_token.fetch_add(1, Ordering::Relaxed);
    let srq = soft_srq(&ctx, init)?.map(|srq| srq::SrqBinding {
        srq,
        token,
        ctx: Arc::downgrade(&ctx),
    });
    let params = QpParams {
        qpn,
        pd: pd.id,
        table: ctx.table.clone(),
        scq,
        rcq,
        cap: init.cap,
        sq_sig_all: init.sq_sig_all,
        crc: est.crc,
        max_payload,
        ird: est.ird as u32,
        ord: est.ord as u32,
        indicate_window: init.recv_window.unwrap_or(ctx.config.indicate_window),
        rx_budget: if ctx.manual {
            qp::RX_BUDGET_MANUAL
        } else {
            qp::RX_BUDGET
        },
        srq,
    };
    let sh = Arc::new(QpShared {
        core: Mutex::new(QpEngine::new(params)),
        fd,
        token,
        local,
        peer,
        negotiated: est.negotiated,
    });
    ctx.register(sh.clone())?;
    tracing::debug!(qpn, %local, %peer, crc = est.crc, "soft QP established");
    Ok(Arc::new(SoftQp { sh, ctx }))
}

/// The consumer's handle of a soft QP.
pub struct SoftQp {
    sh: Arc<QpShared>,
    ctx: Arc<CtxShared>,
}

impl SoftQp {
    /// Receive-path counters (anonymous buffering, direct vs copied bytes).
    pub fn stats(&self) -> RxStats {
        let core = self.sh.lock();
        RxStats {
            indicate_window: core.p.indicate_window,
            ..core.stats
        }
    }
}

/// Debug counters of a QP if it belongs to the soft provider: for tests and
/// benchmarks of the provider (applications ask [`Qp::terminate_sent`]).
#[doc(hidden)]
pub fn qp_stats(qp: &Qp) -> Option<RxStats> {
    (*qp.0).as_any().downcast_ref::<SoftQp>().map(|q| q.stats())
}

impl QpOps for SoftQp {
    fn qp_num(&self) -> u32 {
        self.sh.lock().p.qpn
    }
    fn state(&self) -> QpState {
        self.sh.lock().state
    }
    fn negotiated(&self) -> Negotiated {
        self.sh.negotiated.clone()
    }
    fn local_addr(&self) -> SocketAddr {
        self.sh.local
    }
    fn peer_addr(&self) -> SocketAddr {
        self.sh.peer
    }
    fn post_send(&self, wrs: &[SendWr<'_>]) -> Result<(), PostError> {
        let mut c = self.sh.lock();
        let r = c.post_send(wrs);
        self.sh.drive_locked(&mut c, false);
        r
    }
    fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<(), PostError> {
        let mut c = self.sh.lock();
        let r = c.post_recv(wrs);
        let paused = c.rx_paused();
        if paused || c.tx_pending() {
            // Resume a receive side stopped by the indicate window, and send
            // a Terminate / close that posting may have caused.
            self.sh.drive_locked(&mut c, paused);
            if c.rx_more {
                drop(c);
                self.ctx.schedule(self.sh.clone());
            }
        }
        r
    }
    fn bind_mw(&self, mw: &Mw, bind: &MwBind<'_>, wr_id: u64, signaled: bool) -> Result<u32> {
        let w = (*mw.0)
            .as_any()
            .downcast_ref::<SoftMw>()
            .ok_or_else(|| Error::InvalidArgument("window of another provider".into()))?;
        let mut c = self.sh.lock();
        c.bind(w, bind, wr_id, signaled)
    }
    fn invalidate(&self, rkey: u32, wr_id: u64, signaled: bool) -> Result<()> {
        self.sh.lock().invalidate(rkey, wr_id, signaled)
    }
    fn disconnect(&self) -> Result<()> {
        let mut c = self.sh.lock();
        // Closing: queued sends drain (here or on later EPOLLOUT edges),
        // then FIN; the peer sees end of stream and flushes its receives.
        c.disconnect();
        self.sh.drive_locked(&mut c, false);
        Ok(())
    }
    fn set_error(&self) {
        let mut c = self.sh.lock();
        c.set_error();
        self.sh.drive_locked(&mut c, false);
    }
    fn terminate_sent(&self) -> Option<u16> {
        let st = self.sh.lock().stats;
        // `last_term` is the vendor_err packing (16 bits) of the last
        // Terminate sent or received. Once one is sent the QP is in error
        // and discards its input, and once one is received it sends none:
        // with `term_sent > 0` it is the one sent.
        (st.term_sent > 0).then_some(st.last_term as u16)
    }
}

impl Drop for SoftQp {
    fn drop(&mut self) {
        {
            let mut c = self.sh.lock();
            c.set_error();
            self.sh.drive_locked(&mut c, false);
        }
        self.ctx.unregister(&self.sh);
    }
}

#[cfg(test)]
mod dead_peer_tests {
    use rustix::net::sockopt;
    use std::time::Duration;

    #[test]
    fn dead_peer_timeout_sets_keepalive_and_user_timeout() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let s = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        super::set_dead_peer_timeout(&s, Duration::from_secs(30)).unwrap();
        assert!(sockopt::socket_keepalive(&s).unwrap());
        assert_eq!(sockopt::tcp_keepidle(&s).unwrap(), Duration::from_secs(10));
        assert_eq!(sockopt::tcp_keepintvl(&s).unwrap(), Duration::from_secs(5));
        assert_eq!(sockopt::tcp_keepcnt(&s).unwrap(), 4);
        assert_eq!(sockopt::tcp_user_timeout(&s).unwrap(), 30_000);
        // Short timeouts (tests) keep probes at least a second apart.
        super::set_dead_peer_timeout(&s, Duration::from_millis(1500)).unwrap();
        assert_eq!(sockopt::tcp_keepidle(&s).unwrap(), Duration::from_secs(1));
        assert_eq!(sockopt::tcp_keepintvl(&s).unwrap(), Duration::from_secs(1));
        assert_eq!(sockopt::tcp_user_timeout(&s).unwrap(), 1500);
    }
}
