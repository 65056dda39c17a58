//! What comes back to a connection: work completions (receives handed to
//! `ServerConn`, sends, RDMA Writes from read buffers, memory-object
//! operations), receive buffers reposted, storage completions and the read
//! buffers they free.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use lwio_proto::server::{OpId, RecvBuffer, RecvId};
use lwio_proto::status::*;
use lwio_proto::wrid;
use lwio_proto::NtStatus;
use lwio_rdma::{Mr, RecvWr, Wc, WcStatus};
use tracing::{info, warn};

use crate::io_phase::readbuf::ReadBuffer;

use super::conn::{Conn, RecvSrc, MIN_READ_REGION};
use super::hooks::Hooks;

impl Conn {
    pub(super) fn completion(&mut self, w: Wc) {
        let v = wrid::value(w.wr_id);
        match wrid::kind(w.wr_id) {
            wrid::RECV => {
                if let RecvSrc::Pool(p) = &self.recv {
                    p.taken();
                    self.held.insert(v);
                }
                if !w.is_ok() {
                    if w.status != WcStatus::WrFlushErr {
                        warn!(conn = self.id, status = ?w.status, "receive failed");
                    }
                    if matches!(self.recv, RecvSrc::Pool(_)) {
                        self.repost_recv(v);
                    }
                    return;
                }
                let slot = v as usize;
                let len = (w.byte_len as usize).min(self.recv_slot);
                let Some((mr, at)) = self.recv_buf(v) else {
                    return;
                };
                let Ok(view) = mr.slice(at, len) else {
                    self.repost_recv(v);
                    return;
                };
                if self.closing.is_none() {
                    // SAFETY: the slice covers this slot's received bytes
                    // only, not the receive region (its own or a pool
                    // chunk): the other slots stay posted and the provider
                    // may be placing into them right now. This slot's receive has just completed (polled
                    // here) and is re-posted only below, after the slice is
                    // gone (`handle_recv` keeps nothing that borrows it); the
                    // region is registered LOCAL_WRITE only, so no peer key
                    // reaches it; so nothing writes [at, at+len) while the
                    // slice lives, and the borrowed Mr keeps it mapped.
                    let msg = unsafe { view.as_slice() };
                    let was_auth = self.sconn.is_authenticated();
                    let mut hooks = Hooks {
                        state: &self.state,
                        shared: &self.shared,
                        session: &mut self.session,
                        files: &mut self.files,
                        next_file: &mut self.next_file,
                        peer: self.peer,
                        mem: &mut self.mem,
                    };
                    let kept =
                        self.sconn
                            .handle_recv_in(Instant::now(), slot as RecvId, msg, &mut hooks);
                    if !was_auth && self.sconn.is_authenticated() {
                        self.shared.auth_ok.fetch_add(1, Ordering::Relaxed);
                        self.mem.attach(&self.state, self.waker.clone());
                        info!(conn = self.id, peer = %self.peer, session = ?self.session, credits = self.sconn.credits(), "AUTH ok");
                    }
                    if kept == RecvBuffer::Kept {
                        // A fragment, or a WRITE's data lent to its file
                        // write: the buffer comes back with the write
                        // (FileWriteParts) or a refusal (RepostRecvs), and
                        // is reposted then.
                        return;
                    }
                }
                // Repost: the state machine kept nothing that points into it.
                self.repost_recv(slot as RecvId);
            }
            wrid::SEND => {
                self.sq_inflight = self.sq_inflight.saturating_sub(1);
                self.send_free.push(v as u32);
                if !w.is_ok() && w.status != WcStatus::WrFlushErr {
                    warn!(conn = self.id, status = ?w.status, vendor = w.vendor_err, "send failed");
                }
            }
            wrid::READBUF => {
                self.sq_inflight = self.sq_inflight.saturating_sub(1);
                if !w.is_ok() && w.status != WcStatus::WrFlushErr {
                    warn!(conn = self.id, status = ?w.status, vendor = w.vendor_err, "RDMA write to the client failed");
                }
                if let Some(b) = self.sconn.done_data_mut(v).and_then(|d| d.read.as_mut()) {
                    b.writes_inflight = b.writes_inflight.saturating_sub(1);
                }
                self.maybe_free_buf(v);
            }
            crate::io_phase::memobj_io::WRID_MEMOBJ => {
                self.sq_inflight = self.sq_inflight.saturating_sub(1);
                if let Some(mr) = self.mem.complete(v, w.is_ok()) {
                    self.shared.unregister(mr);
                }
            }
            _ => {}
        }
    }

    /// Post receive buffers `bufs` again.
    pub(super) fn repost_recvs(&mut self, bufs: impl IntoIterator<Item = RecvId>) {
        for b in bufs {
            self.repost_recv(b);
        }
    }

    /// Post receive buffer `slot` again.
    pub(super) fn repost_recv(&mut self, slot: RecvId) {
        let mr = match &self.recv {
            RecvSrc::Own(mr) => mr,
            RecvSrc::Pool(p) => {
                if self.held.remove(&slot) {
                    p.give_back(&[slot]);
                }
                return;
            }
            RecvSrc::Gone => return,
        };
        let at = slot as usize * self.recv_slot;
        if at >= mr.len() {
            return;
        }
        let sge = [mr.sge(at, self.recv_slot as u32)];
        let _ = self.qp.post_recv(&[RecvWr {
            wr_id: wrid::RECV | slot,
            sg_list: &sge,
        }]);
    }

    /// The region and offset of receive buffer `id`.
    pub(super) fn recv_buf(&self, id: RecvId) -> Option<(Arc<Mr>, usize)> {
        match &self.recv {
            RecvSrc::Own(mr) => Some((mr.clone(), id as usize * self.recv_slot)),
            RecvSrc::Pool(p) => p.buf(id),
            RecvSrc::Gone => None,
        }
    }

    pub(super) fn storage_done(&mut self, op: OpId, r: Result<u32, NtStatus>) {
        let mut recvs = None;
        if let Some(d) = self.sconn.op_data_mut(op) {
            // Back from storage (a storage thread, the ring, inline).
            d.cancel = None;
            d.ring = None;
            recvs = d.recvs.take();
            if let Some(b) = d.read.as_mut() {
                b.at_storage = false;
            }
        }
        if let Some(bufs) = recvs {
            self.repost_recvs(bufs);
        }
        if r == Err(STATUS_CANCELLED) {
            self.shared.ios_cancelled.fetch_add(1, Ordering::Relaxed);
        }
        self.sconn.handle_storage_complete(Instant::now(), op, r);
        self.maybe_free_buf(op);
    }

    /// Take back the read buffer of completed op `op` once it is released
    /// and no RDMA Write from it or storage job into it is left.
    pub(super) fn maybe_free_buf(&mut self, op: OpId) {
        let free = self
            .sconn
            .done_data_mut(op)
            .and_then(|d| d.read.as_ref())
            .is_some_and(|b| b.released && b.writes_inflight == 0 && !b.at_storage);
        if free {
            if let Some(b) = self.sconn.take_done_data(op).and_then(|d| d.read) {
                self.recycle_read_buf(b.buf);
            }
        }
    }

    /// A read buffer nothing refers to any more: a slab's slot goes back
    /// to it as the last holder drops it; a region of its own is kept for
    /// the next read, or unregistered.
    pub(super) fn recycle_read_buf(&mut self, buf: Arc<ReadBuffer>) {
        if let Some(mr) = Arc::try_unwrap(buf).ok().and_then(ReadBuffer::into_own) {
            // Kept for the next read while the budget has room;
            // given back when it is three quarters spent. (Not a
            // region smaller than 64 KiB, taken when a slab could
            // not grow: no read would take it again.)
            let used = self.shared.mem_used.load(Ordering::Relaxed);
            if mr.len() >= MIN_READ_REGION
                && self.spare_bufs.len() < usize::from(self.sconn.credits()).max(4)
                && used <= self.shared.opts.max_memory / 4 * 3
            {
                self.spare_bufs.push(mr);
            } else {
                self.shared.unregister(mr);
            }
        }
    }
}
