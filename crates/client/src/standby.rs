//! The standby clock: one thread per process that looks after every client
//! progress thread standing by while its callers drive.
//!
//! A client's progress thread drives its connection only while no caller
//! waits (`engine::progress_loop`). While callers keep waiting it stands
//! by, and it must notice when they stop: it takes the role back after a
//! whole stretch of time in which none waited. Each progress thread used
//! to time that stretch itself, napping up to 50 ms: with 256 busy clients
//! in one process that was 5,000 wake-ups a second and 9 % of the client's
//! CPU (issue 13). Now, after its first short naps, a progress thread
//! joins this clock and sleeps until it is woken: the clock looks at every
//! member each [`TICK`] and wakes the ones whose callers did not wait for
//! a whole tick. The clock's thread runs only while some progress thread
//! stands by on it, and ends when none does.

use std::sync::{Mutex, Weak};
use std::time::Duration;

/// How often the clock looks. A progress thread is woken between one and
/// two ticks after its callers' last wait.
pub(crate) const TICK: Duration = Duration::from_millis(50);

/// A member of the clock (a client's engine).
pub(crate) trait OnClock: Send + Sync {
    /// One look, every [`TICK`]; false once the member leaves the clock
    /// (it was woken, or stopped standing by).
    fn tick(&self) -> bool;
}

struct Clock {
    members: Vec<Weak<dyn OnClock>>,
    running: bool,
}

static CLOCK: Mutex<Clock> = Mutex::new(Clock {
    members: Vec::new(),
    running: false,
});

fn lock() -> std::sync::MutexGuard<'static, Clock> {
    CLOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// Add a member (the caller makes sure it is not listed already); starts
/// the clock's thread if it is not running. An error: the thread could not
/// be started, and the member is not listed.
pub(crate) fn join(member: Weak<dyn OnClock>) -> std::io::Result<()> {
    let mut c = lock();
    if !c.running {
        std::thread::Builder::new()
            .name("lwio-client-standby".into())
            .spawn(run)?;
        c.running = true;
    }
    c.members.push(member);
    Ok(())
}

fn run() {
    loop {
        std::thread::sleep(TICK);
        let mut c = lock();
        // A member is looked at under the lock: `tick` only reads counters
        // and may write an eventfd, and `join` is rare (once per stretch
        // of standing by).
        c.members.retain(|m| m.upgrade().is_some_and(|m| m.tick()));
        if c.members.is_empty() {
            c.running = false;
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::time::Instant;

    struct Member {
        ticks: AtomicUsize,
        leave_after: usize,
    }

    impl OnClock for Member {
        fn tick(&self) -> bool {
            self.ticks.fetch_add(1, Ordering::SeqCst) + 1 < self.leave_after
        }
    }

    fn member(leave_after: usize) -> Arc<Member> {
        Arc::new(Member {
            ticks: AtomicUsize::new(0),
            leave_after,
        })
    }

    #[test]
    fn members_are_ticked_until_they_leave_and_the_thread_ends_with_the_last() {
        let (a, b) = (member(2), member(4));
        let (wa, wb): (Weak<dyn OnClock>, Weak<dyn OnClock>) =
            (Arc::downgrade(&a) as _, Arc::downgrade(&b) as _);
        join(wa).unwrap();
        join(wb).unwrap();
        let t = Instant::now();
        while b.ticks.load(Ordering::SeqCst) < 4 {
            assert!(t.elapsed() < Duration::from_secs(10), "the clock stopped");
            std::thread::sleep(Duration::from_millis(10));
        }
        // Two more periods: neither is looked at again.
        std::thread::sleep(TICK * 2);
        // Other tests of this process may keep the clock running with
        // members of their own; these two have left it in any case.
        assert!(
            lock()
                .members
                .iter()
                .all(|m| !std::ptr::addr_eq(m.as_ptr(), Arc::as_ptr(&a))
                    && !std::ptr::addr_eq(m.as_ptr(), Arc::as_ptr(&b))),
            "a member that left is still listed"
        );
        assert_eq!(a.ticks.load(Ordering::SeqCst), 2);
        assert_eq!(b.ticks.load(Ordering::SeqCst), 4);
        // b's four ticks took at least three periods.
        assert!(t.elapsed() >= TICK * 3, "{:?}", t.elapsed());
    }

    #[test]
    fn a_dropped_member_leaves_the_clock() {
        let m = member(usize::MAX);
        let w: Weak<dyn OnClock> = Arc::downgrade(&m) as _;
        join(w).unwrap();
        std::thread::sleep(TICK * 2);
        assert!(m.ticks.load(Ordering::SeqCst) >= 1);
        let p = Arc::as_ptr(&m);
        drop(m);
        let t = Instant::now();
        while lock()
            .members
            .iter()
            .any(|x| std::ptr::addr_eq(x.as_ptr(), p))
        {
            assert!(t.elapsed() < Duration::from_secs(10), "still listed");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}
