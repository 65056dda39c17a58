//! Control messages (credit deltas, shutdown) and credit balancing: how
//! many credits a connection holds, backed by its receive pool.

use std::sync::atomic::Ordering;
use std::time::Instant;

use tracing::debug;

use super::conn::{Conn, RecvSrc};
use super::shared::Control;

impl Conn {
    pub(super) fn control(&mut self, c: Control) {
        match c {
            Control::CreditDelta(d) => {
                let d = if d > 0 {
                    self.promise(d as usize) as i32
                } else {
                    d
                };
                if d == 0 {
                    return;
                }
                let r = self.sconn.start_credit_delta(Instant::now(), d);
                if r.is_err() && d > 0 {
                    self.unpromise(d as usize);
                }
                debug!(conn = self.id, delta = d, result = ?r, "credit delta requested");
            }
            Control::Shutdown => {
                if self.draining.is_none() {
                    self.draining = Some(Instant::now() + self.shared.opts.shutdown_grace);
                }
            }
        }
    }

    /// Pool mode: promise the pool up to `n` more credits before granting
    /// them (its receives are posted first); how many it took. Own
    /// receive buffers: all of them (they are posted already).
    pub(super) fn promise(&mut self, n: usize) -> usize {
        match &self.recv {
            RecvSrc::Pool(p) => {
                let n = n.min(self.shared.extra_buffers(self.recv_slot));
                let got = p.reserve(n, 1, self.backed == 0);
                self.backed += got;
                got
            }
            _ => n,
        }
    }

    /// What an idle connection keeps: one credit when its receives come
    /// from the pool (issue 13), else its initial grant (its own buffers
    /// stay registered anyway).
    pub(super) fn idle_credits(&self) -> u16 {
        match self.recv {
            RecvSrc::Pool(_) => 1,
            _ => self.base_credits,
        }
    }

    /// Undo a [`Conn::promise`] whose grant did not start.
    pub(super) fn unpromise(&mut self, n: usize) {
        if let RecvSrc::Pool(p) = &self.recv {
            let n = n.min(self.backed);
            self.backed -= n;
            p.release(n, n > 0 && self.backed == 0);
        }
    }

    /// Credit balancing: grant to busy connections from the global budget,
    /// reclaim from idle ones.
    pub(super) fn balance(&mut self, now: Instant) {
        let credits = self.sconn.credits();
        if usize::from(credits) < self.backed {
            // The client gave credits back: the pool need not back them.
            let n = self.backed - usize::from(credits);
            self.unpromise(n);
        }
        self.credits_pub
            .store(usize::from(credits), Ordering::Relaxed);
        let d = i64::from(credits) - self.credits_reported;
        if d != 0 {
            self.shared.credits_granted.fetch_add(d, Ordering::AcqRel);
            self.credits_reported += d;
        }
        if !self.sconn.is_authenticated()
            || self.sconn.credit_transaction_active()
            || self.draining.is_some()
        {
            return;
        }
        // Credits the client reported it cannot use (its reply to a
        // positive delta): take them back at once and grant no more than it
        // can use from now on, automatic balancing or not (seed 000: no new
        // positive update before a negative one).
        let unused = self.sconn.take_unused_credits();
        if unused > 0 {
            let cap = credits.saturating_sub(unused.min(255) as u16).max(1);
            self.client_cap = Some(cap);
            let delta = -i32::from(credits - cap);
            if delta < 0 && self.sconn.start_credit_delta(now, delta).is_ok() {
                debug!(
                    conn = self.id,
                    delta, cap, "taking back credits the client reported unused"
                );
            }
            return;
        }
        if !self.shared.opts.auto_credits {
            return;
        }
        // Busy: short of credits with requests coming (a connection with
        // no I/O since the last round is not, whatever its last request's
        // hint said: else an idle one at one credit looks busy). Short:
        // its spare credits cannot hold one more request, or one more of
        // the largest fragmented message it sent this round (a client
        // writing 16-fragment messages with 40 credits has two in flight
        // and 8 credits it cannot use).
        let fresh = self.sconn.data_requests() != self.requests_balanced;
        self.requests_balanced = self.sconn.data_requests();
        let active = self.sconn.outstanding() > 0 || fresh;
        let message = self.sconn.take_largest_message().max(1);
        let busy = active
            && (self.sconn.outstanding() + message >= u32::from(credits)
                || u16::from(self.sconn.credit_hint()) >= credits);
        if busy {
            self.last_io = now;
            let max = self
                .shared
                .opts
                .max_credits_per_conn
                .min(255)
                .min(self.client_cap.unwrap_or(255));
            let granted = self.shared.credits_granted.load(Ordering::Acquire);
            let room = i64::from(self.shared.opts.credit_budget) - granted;
            // Back to the initial grant at once (a connection waking from
            // idle holds one credit in pool mode), then 8 at a time, or one
            // more of its largest messages.
            let step = i64::from(self.base_credits.saturating_sub(credits))
                .max(8)
                .max(i64::from(message));
            let want = i64::from(max.saturating_sub(credits)).min(step).min(room);
            let want = if want > 0 {
                self.promise(want as usize) as i64
            } else {
                0
            };
            if want > 0 {
                if self.sconn.start_credit_delta(now, want as i32).is_ok() {
                    debug!(
                        conn = self.id,
                        delta = want,
                        "granting credits to a busy connection"
                    );
                } else {
                    self.unpromise(want as usize);
                }
            }
        } else if self.sconn.outstanding() > 0 {
            self.last_io = now;
        } else if credits > self.idle_credits()
            && now.duration_since(self.last_io) >= self.shared.opts.idle_reclaim
        {
            let delta = -i32::from(credits - self.idle_credits());
            // Idle: its spare read buffers go back too.
            for mr in self.spare_bufs.drain(..) {
                self.shared.unregister(mr);
            }
            if self.sconn.start_credit_delta(now, delta).is_ok() {
                debug!(
                    conn = self.id,
                    delta, "reclaiming credits from an idle connection"
                );
                self.last_io = now;
            }
        }
    }
}
