//! Carrying out `ServerConn`'s actions: sends and RDMA Writes (posted as
//! one list per round), read buffers for FileRead, cancels, closes; the
//! memory-object work queued for this connection.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use lwio_proto::server::{CloseReason, DataSource, ServerAction};
use lwio_proto::status::*;
use lwio_proto::wrid;
use lwio_rdma::{Access, SendOp, SendWr};
use tracing::{debug, info, warn};

use crate::io_phase::readbuf::{ReadBuffer, SLOTS as READ_SLOTS};

use super::conn::{Conn, ReadBuf, MIN_READ_REGION, SEND_CHUNK, SEND_SLOT};
use super::fileio::Need;
use super::shared::lock;
use super::storage::JobKind;

/// How long a READ waits for a read buffer when the registered-memory
/// budget is spent before it is answered STATUS_INSUFFICIENT_RESOURCES.
pub(super) const READ_BUFFER_WAIT: Duration = Duration::from_secs(2);

impl Conn {
    /// Post the memory-object jobs other connections queued for this one
    /// (it carries their publisher's memory); flushed with the actions.
    pub(super) fn pump_mem(&mut self) {
        if self.dead || self.closing.is_some() {
            return;
        }
        if self.mem.overdue(
            Instant::now(),
            crate::io_phase::memobj_io::PUBLISHER_DEADLINE,
        ) {
            self.close_conn(
                "the publisher left an RDMA operation on its memory object unanswered \
                 past the deadline",
            );
            return;
        }
        let room = self.sq_depth.saturating_sub(self.sq_inflight);
        let (shared, pd) = (&self.shared, &self.pd);
        let n = self.mem.pump(room, &mut self.sq_pending, |len| {
            shared.register(pd, len, Access::LOCAL_WRITE)
        });
        self.sq_inflight += n;
        for mr in self.mem.take_freed() {
            self.shared.unregister(mr);
        }
    }

    pub(super) fn read_buf_len(&self) -> usize {
        (self.sconn.config().max_rdma_window_size as usize).next_multiple_of(4096)
    }

    pub(super) fn run_actions(&mut self) {
        loop {
            let a = match self.deferred.pop_front() {
                Some(a) => a,
                None => match self.sconn.poll_action() {
                    Some(a) => a,
                    None => break,
                },
            };
            if let Err(a) = self.action(a) {
                // No send-queue room: wait for completions.
                self.deferred.push_front(a);
                break;
            }
        }
        self.flush_sq();
    }

    pub(super) fn close_conn(&mut self, why: &str) {
        warn!(conn = self.id, "{why}; closing");
        self.dead = true;
    }

    /// Carry out one action; `Err(action)` = retry later (send queue full).
    pub(super) fn action(&mut self, a: ServerAction) -> Result<(), ServerAction> {
        if self.dead {
            return Ok(());
        }
        match a {
            ServerAction::Send(bytes) => self.post_inline(bytes, None),
            ServerAction::RdmaWrite {
                remote_addr,
                rkey,
                data: DataSource::Inline(bytes),
                imm,
            } => self.post_inline(bytes, Some((remote_addr, rkey, imm))),
            ServerAction::RdmaWrite {
                remote_addr,
                rkey,
                data: DataSource::ReadBuffer { op, offset, len },
                imm,
            } => {
                if self.sq_inflight >= self.sq_depth {
                    return Err(ServerAction::RdmaWrite {
                        remote_addr,
                        rkey,
                        data: DataSource::ReadBuffer { op, offset, len },
                        imm,
                    });
                }
                // (Its op has completed: the state machine writes from a
                // read buffer only then, and keeps its data until
                // `maybe_free_buf` takes it.)
                let Some(b) = self.sconn.done_data_mut(op).and_then(|d| d.read.as_mut()) else {
                    self.close_conn("RDMA write from an unknown read buffer");
                    return Ok(());
                };
                if (offset as usize).saturating_add(len as usize) > b.buf.len() {
                    self.close_conn("RDMA write outside its read buffer");
                    return Ok(());
                }
                let sge = [b.buf.sge(offset as usize, len)];
                let opk = match imm {
                    Some(imm) => SendOp::WriteWithImm {
                        remote_addr,
                        rkey,
                        imm,
                    },
                    None => SendOp::Write { remote_addr, rkey },
                };
                b.writes_inflight += 1;
                self.sq_inflight += 1;
                self.sq_pending
                    .push((wrid::READBUF | op, opk, (len > 0).then_some(sge[0])));
                Ok(())
            }
            ServerAction::FileRead {
                op,
                fid,
                file,
                offset,
                len,
            } => {
                let Some(f) = self.file_for(op, file, Need::Read) else {
                    return Ok(());
                };
                // Sized by the read (a power of two from 64 KiB up to the
                // window), so small reads of many connections do not each
                // pin a whole window.
                let want = (len as usize)
                    .max(1)
                    .next_power_of_two()
                    .clamp(MIN_READ_REGION, self.read_buf_len().max(MIN_READ_REGION));
                let spare = self.spare_bufs.iter().position(|m| m.len() >= want);
                let got = match spare.map(|i| self.spare_bufs.swap_remove(i)) {
                    Some(m) => Ok(ReadBuffer::own(m)),
                    None => {
                        // Up to 64 KiB: a slot of the reactor's slab of
                        // the smallest size that holds it (readbuf.rs);
                        // larger, or without slabs: a region of its own.
                        // Tight: a smaller buffer (a read larger than it is
                        // short, and the client reads on).
                        let slabs = self.reads.as_ref();
                        let slab = |k: usize| slabs.ok_or(STATUS_INSUFFICIENT_RESOURCES)?[k].take();
                        let own = |len| {
                            self.shared
                                .register(&self.pd, len, Access::LOCAL_WRITE)
                                .map(ReadBuffer::own)
                        };
                        let size = (len as usize).max(1);
                        if slabs.is_some() && size <= READ_SLOTS[0] {
                            slab(0).or_else(|_| own(READ_SLOTS[0]))
                        } else if slabs.is_some() && size <= READ_SLOTS[1] {
                            slab(1).or_else(|_| own(want)).or_else(|_| slab(0))
                        } else {
                            own(want)
                                .or_else(|_| slab(1))
                                .or_else(|_| own(MIN_READ_REGION))
                                .or_else(|_| slab(0))
                        }
                    }
                };
                let buf = match got {
                    Ok(b) => b,
                    Err(st) => {
                        // The budget is spent: wait for buffers to come
                        // back (this connection's or others'), up to
                        // READ_BUFFER_WAIT, then answer the status.
                        let Some(d) = self.sconn.op_data_mut(op) else {
                            // (Not in flight: nothing to answer.)
                            return Ok(());
                        };
                        let since = *d.read_wait.get_or_insert_with(Instant::now);
                        if since.elapsed() < READ_BUFFER_WAIT {
                            return Err(ServerAction::FileRead {
                                op,
                                fid,
                                file,
                                offset,
                                len,
                            });
                        }
                        // (Its data, the wait with it, goes with the op.)
                        self.sconn
                            .handle_storage_complete(Instant::now(), op, Err(st));
                        return Ok(());
                    }
                };
                let buf = Arc::new(buf);
                let Some(d) = self.sconn.op_data_mut(op) else {
                    // (Not in flight: nothing would take the buffer back.)
                    self.recycle_read_buf(buf);
                    return Ok(());
                };
                d.read_wait = None;
                d.read = Some(ReadBuf {
                    buf: buf.clone(),
                    writes_inflight: 0,
                    released: false,
                    at_storage: true,
                });
                let len = (len as usize).min(buf.len());
                self.dispatch(op, f, offset, JobKind::Read { buf, len });
                Ok(())
            }
            ServerAction::FileWrite {
                op,
                fid: _,
                file,
                offset,
                data,
            } => {
                let Some(f) = self.file_for(op, file, Need::Write) else {
                    return Ok(());
                };
                self.dispatch(op, f, offset, JobKind::Write { data });
                Ok(())
            }
            ServerAction::FileSync {
                op,
                fid: _,
                file,
                data_only,
            } => {
                // fsync(2) needs an open file, of either direction.
                let Some(f) = self.file_for(op, file, Need::Either) else {
                    return Ok(());
                };
                self.dispatch(op, f, 0, JobKind::Sync { data_only });
                Ok(())
            }
            ServerAction::FileWriteParts {
                op,
                fid: _,
                file,
                offset,
                parts,
            } => {
                self.write_parts(op, file, offset, parts);
                Ok(())
            }
            ServerAction::RepostRecvs(bufs) => {
                self.repost_recvs(bufs);
                Ok(())
            }
            ServerAction::CancelIo { op } => {
                if let Some(d) = self.sconn.op_data_mut(op) {
                    if let Some(c) = &d.cancel {
                        c.store(true, Ordering::Release);
                    }
                    if let (Some(id), Some(rio)) = (d.ring, &self.rio) {
                        lock(rio).cancel(id);
                    }
                }
                Ok(())
            }
            ServerAction::ReleaseReadBuffer { op } => {
                if let Some(b) = self.sconn.done_data_mut(op).and_then(|d| d.read.as_mut()) {
                    b.released = true;
                }
                self.maybe_free_buf(op);
                Ok(())
            }
            ServerAction::CloseFile { fid, file } => {
                if let Some(f) = self.files.remove(&file) {
                    debug!(conn = self.id, fid, path = %f.path, "CLOSE");
                }
                Ok(())
            }
            ServerAction::CloseConnection(reason) => {
                match &reason {
                    CloseReason::AuthFailed => {
                        self.shared.auth_failed.fetch_add(1, Ordering::Relaxed);
                    }
                    CloseReason::CreditOverflow => {
                        self.shared.credit_overruns.fetch_add(1, Ordering::Relaxed);
                        self.shared
                            .closed_by_protocol
                            .fetch_add(1, Ordering::Relaxed);
                    }
                    _ => {
                        self.shared
                            .closed_by_protocol
                            .fetch_add(1, Ordering::Relaxed);
                    }
                }
                *lock(&self.shared.closed_by_status)
                    .entry(reason.status())
                    .or_default() += 1;
                info!(conn = self.id, peer = %self.peer, ?reason, status = format_args!("{:#010x}", reason.status()), "terminating connection");
                self.begin_close(Instant::now());
                Ok(())
            }
        }
    }

    /// Post a Send (remote = None) or an RDMA Write of owned bytes.
    pub(super) fn post_inline(
        &mut self,
        bytes: Vec<u8>,
        remote: Option<(u64, u32, Option<u32>)>,
    ) -> Result<(), ServerAction> {
        let back = |bytes: Vec<u8>| match remote {
            None => ServerAction::Send(bytes),
            Some((remote_addr, rkey, imm)) => ServerAction::RdmaWrite {
                remote_addr,
                rkey,
                data: DataSource::Inline(bytes),
                imm,
            },
        };
        if bytes.len() > SEND_SLOT {
            self.close_conn("outgoing message larger than a send slot");
            return Ok(());
        }
        if self.sq_inflight >= self.sq_depth {
            return Err(back(bytes));
        }
        if self.send_free.is_empty() && self.send_mrs.len() * SEND_CHUNK < self.sq_depth {
            // More sends in flight than slots: one more chunk (within the
            // budget; else the action waits for a slot to come back).
            if let Ok(m) = self
                .shared
                .register(&self.pd, SEND_SLOT * SEND_CHUNK, Access::empty())
            {
                let base = (self.send_mrs.len() * SEND_CHUNK) as u32;
                self.send_mrs.push(m);
                self.send_free
                    .extend((base..base + SEND_CHUNK as u32).rev());
            }
        }
        let Some(slot) = self.send_free.pop() else {
            return Err(back(bytes));
        };
        let Some(mr) = self.send_mrs.get(slot as usize / SEND_CHUNK) else {
            return Ok(());
        };
        let off = (slot as usize % SEND_CHUNK) * SEND_SLOT;
        if mr.write_at(off, &bytes).is_err() {
            self.send_free.push(slot);
            self.close_conn("send slot out of range");
            return Ok(());
        }
        let sge = [mr.sge(off, bytes.len() as u32)];
        let op = match remote {
            None => SendOp::Send,
            Some((remote_addr, rkey, None)) => SendOp::Write { remote_addr, rkey },
            Some((remote_addr, rkey, Some(imm))) => SendOp::WriteWithImm {
                remote_addr,
                rkey,
                imm,
            },
        };
        self.sq_inflight += 1;
        self.sq_pending.push((
            wrid::SEND | u64::from(slot),
            op,
            (!bytes.is_empty()).then_some(sge[0]),
        ));
        Ok(())
    }

    /// Post the work requests queued by this round of actions as one list:
    /// the soft provider sends a whole list (RDMA Writes and statuses of a
    /// batch of requests) with one `writev`.
    pub(super) fn flush_sq(&mut self) {
        if self.sq_pending.is_empty() {
            return;
        }
        let pending = std::mem::take(&mut self.sq_pending);
        let wrs: Vec<SendWr<'_>> = pending
            .iter()
            .map(|(id, op, sge)| SendWr::new(*id, *op, sge.as_slice()))
            .collect();
        if let Err(e) = self.qp.post_send(&wrs) {
            // Those from the failed one on were not posted: no completion
            // will return their resources.
            for p in &pending[e.index.min(pending.len())..] {
                self.sq_inflight = self.sq_inflight.saturating_sub(1);
                let v = wrid::value(p.0);
                match wrid::kind(p.0) {
                    wrid::SEND => self.send_free.push(v as u32),
                    wrid::READBUF => {
                        if let Some(b) = self.sconn.op_data_mut(v).and_then(|d| d.read.as_mut()) {
                            b.writes_inflight = b.writes_inflight.saturating_sub(1);
                        }
                    }
                    _ => {}
                }
            }
            if self.closing.is_none() {
                debug!(conn = self.id, error = %e.error, "posting a send failed (connection gone)");
            }
            self.begin_close(Instant::now());
        }
    }
}
