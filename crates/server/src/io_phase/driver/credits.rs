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
        // Active: requests in flight or arriving since the last round (a
        // connection with no I/O since then is not short of credits,
        // whatever its last request's hint said: else an idle one at one
        // credit looks busy).
        let fresh = self.sconn.data_requests() != self.requests_balanced;
        self.requests_balanced = self.sconn.data_requests();
        let hint = self.sconn.take_peak_hint();
        let active = self.sconn.outstanding() > 0 || fresh;
        let round = Round {
            credits,
            base: self.base_credits,
            outstanding: self.sconn.outstanding(),
            active,
            message: self.sconn.take_largest_message(),
            hint,
            cap: self.client_cap,
            max_per_conn: self.shared.opts.max_credits_per_conn,
            // The fair share of the budget bounds what a hint alone can
            // get (counted only when a hint asks for more than the
            // connection holds: otherwise it bounds nothing).
            share: if active && u16::from(hint) >= credits {
                self.shared.fair_share()
            } else {
                0
            },
        };
        let busy = round.target().map(|(target, cap)| {
            self.client_cap = cap;
            target
        });
        if let Some(target) = busy {
            self.last_io = now;
            let granted = self.shared.credits_granted.load(Ordering::Acquire);
            let room = i64::from(self.shared.opts.credit_budget) - granted;
            let want = i64::from(target.saturating_sub(credits)).min(room);
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
                        hint,
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

/// What the balancer knows of a connection in one round.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Round {
    /// Its credits now.
    pub credits: u16,
    /// Its initial grant: the most the server grants at AUTH (`max_credits`,
    /// within the receive budget), what it returns to after idle.
    pub base: u16,
    /// Requests (fragments) in flight at the server.
    pub outstanding: u32,
    /// Requests in flight, or some arrived since the last round.
    pub active: bool,
    /// Credits of the largest fragmented message since the last round (0:
    /// none).
    pub message: u32,
    /// The highest Credits hint since the last round: the requests pending
    /// on the client (seed 000), those waiting for a credit included.
    pub hint: u8,
    /// The most the client said it can use (a CREDIT reply that reported
    /// some unused).
    pub cap: Option<u16>,
    /// `max_credits_per_conn`.
    pub max_per_conn: u16,
    /// Its fair share of the credit budget (budget / live connections).
    pub share: u16,
}

impl Round {
    /// The credits a busy connection should reach (None: not busy), and
    /// its cap from now on.
    ///
    /// Toward demand: a client that reports more pending requests than
    /// it has credits gets one per request and one more (for an INTERRUPT,
    /// a CANCEL or a CREDIT reply) in one grant, and at least the step
    /// below (a hint counts requests, not the fragments of the message one
    /// of them waits to send), above an earlier cap too (its backlog is
    /// news since it reported credits unused). A hint is
    /// only a hint, so what it gets is bounded: at most
    /// `max_credits_per_conn`, at most its fair share of the budget (or
    /// its initial grant, if larger), and only while it is active.
    ///
    /// Saturated: a connection whose spare credits cannot hold one more
    /// request (or one more of its largest fragmented messages) while its
    /// hint shows no more than it holds — a peer that does not count its
    /// backlog, or an lwio client at its reserved credit — gets 8 more
    /// (or one more such message), up to its cap; a client given more than
    /// it needs reports them unused and they are taken back. A saturated
    /// connection below its initial grant (woken from idle) gets that back
    /// at once, up to its cap.
    pub fn target(&self) -> Option<(u16, Option<u16>)> {
        if !self.active {
            return None;
        }
        let max = self.max_per_conn.min(255);
        let message = self.message.max(1);
        let saturated = self.outstanding + message >= u32::from(self.credits);
        let demand = (u16::from(self.hint) + 1)
            .min(max)
            .min(self.share.max(self.base));
        let capped = max.min(self.cap.unwrap_or(255));
        // Woken from idle (one credit, with the shared receive pool): back
        // to the initial grant at once, whatever the first requests could
        // tell of the backlog, but not past a cap (only a backlog lifts it).
        let floor = if saturated && self.credits < self.base {
            self.base.min(capped)
        } else {
            0
        };
        let step = self
            .base
            .saturating_sub(self.credits)
            .max(8)
            .max(u16::try_from(message).unwrap_or(u16::MAX));
        // A connection the floor lifts (woken from idle) gets the floor,
        // not a step past it.
        let stepped =
            (floor <= self.credits).then(|| self.credits.saturating_add(step).min(capped));
        if demand > self.credits {
            // A backlog: toward it, and at least a step. A hint counts
            // requests, not the credits of the fragmented message one of
            // them waits to send, and the reserved credit keeps an lwio
            // client's hint near its credits: by its demand alone a
            // connection of 1 MiB writes grew one credit a round (found by
            // bench/lwio-ab.sh: 1 MiB QD 8 writes at 0.72x).
            let cap = self.cap.map(|c| c.max(demand));
            let target = demand.max(floor).max(stepped.unwrap_or(0));
            return Some((target, cap));
        }
        if floor > self.credits {
            return Some((floor, self.cap));
        }
        if !saturated {
            return None;
        }
        stepped.map(|t| (t, self.cap))
    }
}

#[cfg(test)]
mod tests {
    use super::Round;

    /// A connection at its initial 8 credits, saturated (7 in flight and
    /// the reserved credit), with few connections sharing the budget.
    fn round(hint: u8) -> Round {
        Round {
            credits: 8,
            base: 8,
            outstanding: 7,
            active: true,
            message: 0,
            hint,
            cap: None,
            max_per_conn: 128,
            share: 4096,
        }
    }

    /// A backlog is granted toward its demand in one grant: 32 pending
    /// requests get 33 credits (one per request and one for INTERRUPT,
    /// CANCEL or a CREDIT reply). Before, the hint only made a connection
    /// "busy", and it grew 8 at a time.
    #[test]
    fn a_backlog_is_granted_toward_its_demand() {
        assert_eq!(round(32).target(), Some((33, None)));
        // A demand below the saturated step gets the step (below).
        assert_eq!(round(8).target(), Some((16, None)));
        // Not saturated but reporting a backlog (its requests wait for
        // something else as well): still toward it.
        let r = Round {
            outstanding: 2,
            ..round(20)
        };
        assert_eq!(r.target(), Some((21, None)));
        // A backlog beyond an earlier cap (credits it reported unused)
        // lifts the cap: the backlog is news.
        let r = Round {
            cap: Some(8),
            ..round(20)
        };
        assert_eq!(r.target(), Some((21, Some(21))));
    }

    /// A saturated connection whose backlog is a fragmented message (1 MiB
    /// writes of 17 credits each) reports a hint of about its credits (its
    /// requests, not the message's fragments): it grows by a message a
    /// round, not by the one credit its hint asks for (before: 33 here, and
    /// 1 MiB writes at QD 8 ran at 0.72x).
    #[test]
    fn a_saturated_backlog_of_messages_grows_by_a_message() {
        let r = Round {
            credits: 32,
            outstanding: 31,
            message: 17,
            ..round(32)
        };
        assert_eq!(r.target(), Some((49, None)));
        // Bounded as ever.
        let r = Round {
            credits: 120,
            outstanding: 119,
            message: 17,
            ..round(120)
        };
        assert_eq!(r.target(), Some((128, None)));
    }

    /// A hint is the client's word: what it gets is bounded by
    /// `max_credits_per_conn`, by its fair share of the budget (or its
    /// initial grant, if larger), and only an active connection gets
    /// anything.
    #[test]
    fn a_hostile_hint_is_bounded() {
        assert_eq!(round(255).target(), Some((128, None)));
        let r = Round {
            share: 40,
            ..round(255)
        };
        assert_eq!(r.target(), Some((40, None)));
        // Many connections: a share below the initial grant leaves a
        // saturated connection the old step, up to what the hint cannot
        // raise (its cap).
        let r = Round {
            share: 4,
            credits: 8,
            cap: Some(8),
            ..round(255)
        };
        assert_eq!(r.target(), Some((8, Some(8))));
        let r = Round {
            active: false,
            outstanding: 0,
            ..round(255)
        };
        assert_eq!(r.target(), None);
    }

    /// A connection saturated with a hint that shows no more than it holds
    /// (a peer that does not count its backlog, or an lwio client at its
    /// reserved credit) grows 8 at a time, as before, up to its cap; one
    /// with room to spare is not busy.
    #[test]
    fn saturation_without_a_backlog_grows_by_the_step() {
        assert_eq!(round(7).target(), Some((16, None)));
        assert_eq!(round(0).target(), Some((16, None)));
        let r = Round {
            credits: 9,
            outstanding: 8,
            cap: Some(9),
            ..round(8)
        };
        assert_eq!(r.target(), Some((9, Some(9))));
        let r = Round {
            credits: 16,
            outstanding: 8,
            ..round(8)
        };
        assert_eq!(r.target(), None);
        // Woken from idle at one credit: back to the initial grant at once
        // (before, one step past it: 9), then toward its backlog.
        let r = Round {
            credits: 1,
            outstanding: 1,
            ..round(1)
        };
        assert_eq!(r.target(), Some((8, None)));
        let r = Round {
            credits: 1,
            outstanding: 1,
            ..round(12)
        };
        assert_eq!(r.target(), Some((13, None)));
        // Below the initial grant (32 here) because it reported the rest
        // unused: its cap holds, and only a backlog lifts it. (Found by
        // bench/scale.sh: a QD 8 job was granted 23 and gave them back
        // every round.)
        let r = Round {
            credits: 9,
            base: 32,
            outstanding: 8,
            cap: Some(9),
            ..round(8)
        };
        assert_eq!(r.target(), Some((9, Some(9))));
        let r = Round {
            credits: 9,
            base: 32,
            outstanding: 8,
            cap: Some(9),
            ..round(12)
        };
        assert_eq!(r.target(), Some((13, Some(13))));
    }
}
