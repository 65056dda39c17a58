//! Completion queues and completion channels.
//!
//! A CQ is a bounded queue under a mutex: the provider pushes (Release, via
//! the mutex), the consumer pops (Acquire, via the mutex), so data placed
//! before a completion was pushed is visible to whoever pops it.
//!
//! A channel owns an eventfd. Under `Progress::Auto` its fd *is* the eventfd:
//! readable means "an armed CQ got a completion". Under `Progress::Manual`
//! its fd is an epoll fd over the eventfd and the context's epoll fd, so
//! readable means "call poll": either a CQ event is pending or a socket has
//! protocol work that polling will do.
//!
//! Under `Progress::Manual`, a thread blocked in [`CompChannelOps::wait`]
//! runs the context's progress itself; an event its own progress raises on
//! that channel is handed to it directly (`ChanShared::local`), not through
//! the eventfd: no `write` and `read` of the eventfd per completion for the
//! caller that drives its own I/O (the mount's FUSE threads, a blocking
//! `lwio_client::File`). Other channels, and events raised by other
//! threads, go through the eventfd as before.

use std::cell::Cell;
use std::collections::{HashSet, VecDeque};
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::sys;
use super::CtxShared;
use crate::verbs::*;
use rustix::event::epoll::EventFlags;

const ARM_NONE: u8 = 0;
const ARM_ALL: u8 = 1;
const ARM_SOLICITED: u8 = 2;

pub struct CqShared {
    q: Mutex<VecDeque<Wc>>,
    depth: usize,
    overflow: AtomicBool,
    armed: AtomicU8,
    chan: Option<Arc<ChanShared>>,
    /// Reported by the channel's `take_fired` when this CQ fires.
    tag: Option<u64>,
    ctx: Arc<CtxShared>,
}

impl CqShared {
    pub fn new(ctx: Arc<CtxShared>, depth: u32, chan: Option<Arc<ChanShared>>) -> CqShared {
        Self::with_tag(ctx, depth, chan, None)
    }

    /// A CQ whose events its channel reports as `tag`.
    pub fn with_tag(
        ctx: Arc<CtxShared>,
        depth: u32,
        chan: Option<Arc<ChanShared>>,
        tag: Option<u64>,
    ) -> CqShared {
        CqShared {
            tag,
            q: Mutex::new(VecDeque::with_capacity((depth as usize).min(64))),
            depth: depth.max(1) as usize,
            overflow: AtomicBool::new(false),
            armed: AtomicU8::new(ARM_NONE),
            chan,
            ctx,
        }
    }

    /// The context this CQ belongs to.
    pub fn ctx(&self) -> &Arc<CtxShared> {
        &self.ctx
    }

    /// Push a completion; `solicited` marks receives of solicited messages
    /// (errors always count as solicited).
    pub fn push(&self, wc: Wc, solicited: bool) {
        {
            let mut q = self.q.lock().unwrap_or_else(|e| e.into_inner());
            if q.len() >= self.depth {
                self.overflow.store(true, Ordering::Release);
                tracing::warn!(wr_id = wc.wr_id, "CQ overrun: completion dropped");
                return;
            }
            q.push_back(wc);
        }
        let a = self.armed.load(Ordering::Acquire);
        if a == ARM_NONE {
            return;
        }
        let fire = a == ARM_ALL || solicited || !wc.is_ok();
        if fire
            && self
                .armed
                .compare_exchange(a, ARM_NONE, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
        {
            if let Some(c) = &self.chan {
                if let Some(t) = self.tag {
                    c.fired(t);
                }
                c.notify();
            }
        }
    }

    fn pop(&self, out: &mut [Wc]) -> usize {
        let mut q = self.q.lock().unwrap_or_else(|e| e.into_inner());
        let n = out.len().min(q.len());
        for (o, w) in out.iter_mut().zip(q.drain(..n)) {
            *o = w;
        }
        n
    }
}

pub struct SoftCq(pub Arc<CqShared>);

impl CqOps for SoftCq {
    fn poll(&self, out: &mut [Wc]) -> Result<usize> {
        if self.0.overflow.load(Ordering::Acquire) {
            return Err(Error::ResourceExhausted("completion queue overrun".into()));
        }
        if out.is_empty() {
            return Ok(0);
        }
        let n = self.0.pop(out);
        if n > 0 || !self.0.ctx.manual {
            return Ok(n);
        }
        self.0.ctx.progress_once(0)?;
        Ok(self.0.pop(out))
    }

    fn arm(&self, solicited_only: bool) -> Result<()> {
        if self.0.chan.is_none() {
            return Err(Error::InvalidArgument(
                "CQ has no completion channel".into(),
            ));
        }
        self.0.armed.store(
            if solicited_only {
                ARM_SOLICITED
            } else {
                ARM_ALL
            },
            Ordering::Release,
        );
        Ok(())
    }
}

thread_local! {
    /// The channel (its address) whose `wait` this thread is running the
    /// context's progress for; 0 when none.
    static DRIVING: Cell<usize> = const { Cell::new(0) };
}

pub struct ChanShared {
    efd: OwnedFd,
    /// An event raised by the progress of the thread blocked in this
    /// channel's `wait`, for that thread to take without the eventfd.
    local: AtomicBool,
    /// Eventfd writes made (tests count them).
    fd_writes: AtomicU64,
    /// Tags of tagged CQs that fired and were not yet taken (each once).
    fired: Mutex<(Vec<u64>, HashSet<u64>)>,
    /// Manual progress: epoll over `efd` and the context's epoll fd.
    epfd: Option<OwnedFd>,
    ctx: Arc<CtxShared>,
}

impl ChanShared {
    pub fn new(ctx: Arc<CtxShared>) -> Result<ChanShared> {
        let efd = sys::eventfd()?;
        let epfd = if ctx.manual {
            let ep = sys::epoll_create()?;
            sys::epoll_add(&ep, &efd, EventFlags::IN, 0)?;
            sys::epoll_add(&ep, ctx.epfd(), EventFlags::IN, 1)?;
            Some(ep)
        } else {
            None
        };
        Ok(ChanShared {
            efd,
            local: AtomicBool::new(false),
            fd_writes: AtomicU64::new(0),
            fired: Mutex::new((Vec::new(), HashSet::new())),
            epfd,
            ctx,
        })
    }

    /// The context this channel belongs to.
    pub fn ctx(&self) -> &Arc<CtxShared> {
        &self.ctx
    }

    /// Signal an event: to the thread that raised it if that thread is
    /// blocked in this channel's `wait` (it takes the event when its
    /// progress returns), else through the eventfd.
    pub fn notify(&self) {
        if DRIVING.with(Cell::get) == self as *const ChanShared as usize {
            self.local.store(true, Ordering::Release);
            return;
        }
        self.fd_writes.fetch_add(1, Ordering::Relaxed);
        sys::eventfd_write(&self.efd);
    }

    /// Eventfd writes made since creation.
    pub fn fd_writes(&self) -> u64 {
        self.fd_writes.load(Ordering::Relaxed)
    }

    /// Run the context's progress once as this channel's waiter: events it
    /// raises on this channel are kept for this thread ([`Self::notify`]).
    fn progress_as_waiter(&self) -> Result<usize> {
        /// Puts back the thread's previous channel, also on unwinding.
        struct Restore(usize);
        impl Drop for Restore {
            fn drop(&mut self) {
                DRIVING.with(|d| d.set(self.0));
            }
        }
        let me = self as *const ChanShared as usize;
        let _restore = Restore(DRIVING.with(|d| d.replace(me)));
        self.ctx.progress_once(0)
    }

    /// Record that the CQ tagged `tag` fired (before `notify`).
    fn fired(&self, tag: u64) {
        let mut f = self.fired.lock().unwrap_or_else(|e| e.into_inner());
        if f.1.insert(tag) {
            f.0.push(tag);
        }
    }

    /// Consume a pending event; true if there was one. A local event is
    /// taken without reading the eventfd (an eventfd event left with it is
    /// taken next time: one spurious wake-up at most).
    fn consume(&self) -> bool {
        self.local.swap(false, Ordering::Acquire) || sys::eventfd_read(&self.efd)
    }
}

pub struct SoftChannel(pub Arc<ChanShared>);

impl CompChannelOps for SoftChannel {
    fn fd(&self) -> RawFd {
        match &self.0.epfd {
            Some(e) => e.as_raw_fd(),
            None => self.0.efd.as_raw_fd(),
        }
    }

    fn wait(&self, timeout: Option<Duration>) -> Result<bool> {
        let deadline = timeout.map(|t| Instant::now() + t);
        loop {
            if self.0.ctx.manual {
                self.0.progress_as_waiter()?;
            }
            if self.0.consume() {
                return Ok(true);
            }
            let ms = match deadline {
                None => -1,
                Some(d) => {
                    let left = d.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Ok(false);
                    }
                    left.as_millis().clamp(1, i32::MAX as u128) as i32
                }
            };
            let fd = match &self.0.epfd {
                Some(e) => e.as_fd(),
                None => self.0.efd.as_fd(),
            };
            sys::poll_in(fd, ms)?;
        }
    }

    fn take_fired(&self, out: &mut Vec<u64>) -> Result<usize> {
        // Readiness first: a CQ firing after this leaves the fd readable
        // and its tag queued for the next call (a tag queued before it is
        // taken now, with at worst one spurious readiness left).
        self.0.consume();
        let mut f = self.0.fired.lock().unwrap_or_else(|e| e.into_inner());
        let n = f.0.len();
        out.append(&mut f.0);
        f.1.clear();
        Ok(n)
    }
}
