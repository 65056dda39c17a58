//! The process-wide monitor thread: disconnects and device removal on
//! established connections.

use super::*;

pub(in crate::ibv) struct Monitor {
    pub(in crate::ibv) epfd: RawFd,
    /// Wakes the monitor when a sweep is scheduled.
    pub(in crate::ibv) evfd: RawFd,
    pub(in crate::ibv) conns: Mutex<HashMap<u64, Weak<CmQp>>>,
    pub(in crate::ibv) sweeps: Mutex<Vec<(Instant, Weak<CmQp>)>>,
}

pub(in crate::ibv) const WAKE_TOKEN: u64 = u64::MAX;

pub(in crate::ibv) static MONITOR: OnceLock<Result<Monitor, String>> = OnceLock::new();

pub(in crate::ibv) fn monitor() -> Result<&'static Monitor> {
    MONITOR
        .get_or_init(|| {
            // SAFETY: creates a new epoll fd that lives for the process.
            let epfd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
            if epfd < 0 {
                return Err(format!(
                    "epoll_create1: {}",
                    std::io::Error::last_os_error()
                ));
            }
            // SAFETY: creates a new eventfd that lives for the process.
            let evfd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
            if evfd < 0 {
                return Err(format!("eventfd: {}", std::io::Error::last_os_error()));
            }
            let mut ev = libc::epoll_event {
                events: libc::EPOLLIN as u32,
                u64: WAKE_TOKEN,
            };
            // SAFETY: live epoll fd and eventfd; ev on the stack.
            if unsafe { libc::epoll_ctl(epfd, libc::EPOLL_CTL_ADD, evfd, &mut ev) } < 0 {
                return Err(format!("epoll_ctl: {}", std::io::Error::last_os_error()));
            }
            std::thread::Builder::new()
                .name("lwio-rdmacm".into())
                .spawn(move || monitor_loop(epfd))
                .map_err(|e| format!("spawning the rdma_cm monitor: {e}"))?;
            Ok(Monitor {
                epfd,
                evfd,
                conns: Mutex::new(HashMap::new()),
                sweeps: Mutex::new(Vec::new()),
            })
        })
        .as_ref()
        .map_err(|e| Error::ResourceExhausted(e.clone()))
}

pub(in crate::ibv) fn monitor_loop(epfd: RawFd) {
    // SAFETY: epoll_event is plain data.
    let mut evs: [libc::epoll_event; 16] = unsafe { std::mem::zeroed() };
    loop {
        let timeout = match MONITOR.get() {
            Some(Ok(m)) => m.run_due_sweeps(),
            _ => 10,
        };
        // SAFETY: epfd is a live epoll fd (never closed); evs is a local buffer.
        let n = unsafe { libc::epoll_wait(epfd, evs.as_mut_ptr(), evs.len() as i32, timeout) };
        if n < 0 {
            if std::io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            tracing::error!("rdma_cm monitor: epoll_wait failed; monitor stops");
            return;
        }
        let Some(Ok(m)) = MONITOR.get() else {
            continue;
        };
        for ev in &evs[..n as usize] {
            let token = ev.u64;
            if token == WAKE_TOKEN {
                let mut v = 0u64;
                // SAFETY: reads 8 bytes into a local from our nonblocking eventfd.
                unsafe { libc::read(m.evfd, &mut v as *mut u64 as *mut c_void, 8) };
                continue;
            }
            dbg_ibv!("monitor: wake-up for connection {token}");
            let core = lock(&m.conns).get(&token).and_then(Weak::upgrade);
            if let Some(core) = core {
                core.process_cm_events();
            }
        }
    }
}

impl Monitor {
    pub(in crate::ibv) fn schedule_sweep(&self, at: Instant, qp: Weak<CmQp>) {
        lock(&self.sweeps).push((at, qp));
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a local to our eventfd.
        unsafe { libc::write(self.evfd, &one as *const u64 as *const c_void, 8) };
    }

    /// Run the sweeps that are due; returns the epoll timeout (ms) until the
    /// next one, or -1.
    pub(in crate::ibv) fn run_due_sweeps(&self) -> i32 {
        let now = Instant::now();
        let due: Vec<Weak<CmQp>> = {
            let mut g = lock(&self.sweeps);
            let (due, later): (Vec<_>, Vec<_>) = g.drain(..).partition(|(t, _)| *t <= now);
            *g = later;
            due.into_iter().map(|(_, w)| w).collect()
        };
        for w in due {
            if let Some(q) = w.upgrade() {
                q.sweep();
            }
        }
        let g = lock(&self.sweeps);
        match g.iter().map(|(t, _)| *t).min() {
            None => -1,
            Some(t) => t
                .saturating_duration_since(Instant::now())
                .as_millis()
                .clamp(1, i32::MAX as u128) as i32,
        }
    }

    pub(in crate::ibv) fn add(&self, core: &Arc<CmQp>) -> Result<()> {
        lock(&self.conns).insert(core.token, Arc::downgrade(core));
        let mut ev = libc::epoll_event {
            events: libc::EPOLLIN as u32,
            u64: core.token,
        };
        // SAFETY: live epoll fd and channel fd; ev on the stack.
        if unsafe { libc::epoll_ctl(self.epfd, libc::EPOLL_CTL_ADD, core.ch.fd(), &mut ev) } < 0 {
            lock(&self.conns).remove(&core.token);
            return Err(os_err("epoll_ctl(rdma_cm channel)"));
        }
        // Events that arrived before registration (a fast peer disconnect).
        core.process_cm_events();
        Ok(())
    }

    pub(in crate::ibv) fn remove(&self, token: u64, fd: RawFd) {
        // Under the lock, so a concurrent wake-up either already holds a
        // strong reference (and we are not dropping) or finds nothing.
        let mut g = lock(&self.conns);
        if g.remove(&token).is_some() {
            // SAFETY: live epoll fd; fd is the channel's, still open.
            unsafe { libc::epoll_ctl(self.epfd, libc::EPOLL_CTL_DEL, fd, ptr::null_mut()) };
        }
    }
}
