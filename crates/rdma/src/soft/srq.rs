//! Shared receive queues.
//!
//! An SRQ is a queue of receives under a mutex that the QPs bound to it
//! (all of one context) take from, in posting order, when a Send starts to
//! arrive. A QP that finds it empty buffers the Send anonymously under its
//! indicate window exactly as a QP with an empty receive queue does (and
//! stops reading its socket when the window is full), and leaves its token
//! with the SRQ: the next post schedules every such QP on its context, whose
//! next drive (`QpEngine::rx_process`) hands the buffered Sends to the new
//! receives in arrival order and resumes reading.
//!
//! Lock order: a QP's mutex, then the SRQ's (a QP takes a receive while it
//! is driven); posting takes the SRQ's alone and schedules the waiting QPs
//! after releasing it.

use std::collections::{HashSet, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use super::mem::MemTable;
use super::qp::{resolve_sges, RecvWqe};
use super::CtxShared;
use crate::verbs::*;

pub struct SrqShared {
    pub table: Arc<MemTable>,
    pub pd: u32,
    max_wr: usize,
    max_sge: usize,
    q: Mutex<SrqQueue>,
    /// QPs that found the queue empty (counted once per wait).
    starved: std::sync::atomic::AtomicU64,
}

#[derive(Default)]
struct SrqQueue {
    rq: VecDeque<RecvWqe>,
    /// QPs (token, context) that found the queue empty since the last post.
    waiters: Vec<(u64, Weak<CtxShared>)>,
    waiting: HashSet<u64>,
}

/// A QP's link to its SRQ (in its `QpParams`).
#[derive(Clone)]
pub struct SrqBinding {
    pub srq: Arc<SrqShared>,
    /// The QP's token in its context (`CtxShared::qps`).
    pub token: u64,
    pub ctx: Weak<CtxShared>,
}

impl SrqBinding {
    /// The next receive; if there is none, the QP is scheduled again when
    /// receives are posted.
    pub(crate) fn take(&self) -> Option<RecvWqe> {
        let mut q = self.srq.lock();
        let r = q.rq.pop_front();
        if r.is_none() && q.waiting.insert(self.token) {
            q.waiters.push((self.token, self.ctx.clone()));
            self.srq
                .starved
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        r
    }
}

impl SrqShared {
    pub fn new(table: Arc<MemTable>, pd: u32, max_wr: u32, max_sge: u32) -> Result<SrqShared> {
        let c = super::caps();
        if max_wr == 0 || max_wr > c.max_srq_wr || max_sge > c.max_srq_sge {
            return Err(Error::InvalidArgument(format!(
                "SRQ of {max_wr} receives of {max_sge} SGEs (at most {} of {})",
                c.max_srq_wr, c.max_srq_sge
            )));
        }
        Ok(SrqShared {
            table,
            pd,
            max_wr: max_wr as usize,
            max_sge: max_sge as usize,
            q: Mutex::new(SrqQueue::default()),
            starved: Default::default(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, SrqQueue> {
        self.q.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn post(&self, wrs: &[RecvWr<'_>]) -> Result<(), PostError> {
        let (r, waiters) = {
            let mut q = self.lock();
            let r = self.push_all(&mut q, wrs);
            let waiters = if q.rq.is_empty() {
                Vec::new()
            } else {
                q.waiting.clear();
                std::mem::take(&mut q.waiters)
            };
            (r, waiters)
        };
        for (token, ctx) in waiters {
            if let Some(ctx) = ctx.upgrade() {
                if let Some(qp) = ctx.qp(token) {
                    ctx.schedule(qp);
                }
            }
        }
        r
    }

    fn push_all(&self, q: &mut SrqQueue, wrs: &[RecvWr<'_>]) -> Result<(), PostError> {
        for (index, w) in wrs.iter().enumerate() {
            let err = |error| PostError { index, error };
            if w.sg_list.len() > self.max_sge {
                return Err(err(Error::InvalidArgument(format!(
                    "{} SGEs > the SRQ's {}",
                    w.sg_list.len(),
                    self.max_sge
                ))));
            }
            if q.rq.len() >= self.max_wr {
                return Err(err(Error::QueueFull));
            }
            // No CQ to report a bad key on (the QP that would take the
            // receive is not known yet): refuse it here.
            let (pieces, keep, len) =
                resolve_sges(&self.table, self.pd, w.sg_list, Access::LOCAL_WRITE).map_err(
                    |st| {
                        err(Error::Protection(format!(
                            "receive {} of the SRQ: {st:?}",
                            w.wr_id
                        )))
                    },
                )?;
            q.rq.push_back(RecvWqe {
                wr_id: w.wr_id,
                pieces,
                _keep: keep,
                len,
            });
        }
        Ok(())
    }
}

pub struct SoftSrq(pub Arc<SrqShared>);

impl SrqOps for SoftSrq {
    fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<(), PostError> {
        self.0.post(wrs)
    }
    fn posted(&self) -> usize {
        self.0.lock().rq.len()
    }
    fn withdraw(&self, max: usize) -> Vec<u64> {
        let mut q = self.0.lock();
        let n = max.min(q.rq.len());
        let at = q.rq.len() - n;
        // A receive a QP has taken is off the queue already: only untaken
        // ones come back, and their buffers are no longer referenced.
        q.rq.drain(at..).rev().map(|w| w.wr_id).collect()
    }
    fn withdraw_if(&self, pick: &mut dyn FnMut(u64) -> bool) -> Vec<u64> {
        let mut q = self.0.lock();
        let mut out = Vec::new();
        // As `withdraw`: only untaken receives are on the queue.
        q.rq.retain(|w| {
            if pick(w.wr_id) {
                out.push(w.wr_id);
                false
            } else {
                true
            }
        });
        out
    }
    fn starved(&self) -> u64 {
        self.0.starved.load(std::sync::atomic::Ordering::Relaxed)
    }
}
