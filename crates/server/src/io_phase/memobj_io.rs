//! The RDMA side of memory objects (docs/memory-objects.md).
//!
//! Two connections take part in every I/O on a memory object:
//!
//! * the **reader's** (or writer's) connection receives the READ or WRITE of
//!   the open object ([`submit`]): it clamps the range to the object's fixed
//!   size and hands a [`MemJob`] to the publisher's connection, exactly as it
//!   hands a file job to the storage pool; the answer comes back on the same
//!   reply channel and completes the request the usual way (a READ's data
//!   then goes to the reader's window with the usual RDMA Write);
//! * the **publisher's** connection ([`PubSide`]) carries the job out on its
//!   own queue pair: an RDMA Read from the publisher's key into a bounce
//!   buffer of its own domain, copied into the reader's server buffer; or
//!   the written bytes copied into a bounce buffer and RDMA-Written to the
//!   publisher's key. Bounce buffers are local-access server memory: the
//!   server exposes none of its memory.

use std::collections::HashMap;
use std::sync::{mpsc, Arc};

use lwio_proto::server::OpId;
use lwio_proto::status::*;
use lwio_proto::wire::Guid;
use lwio_proto::NtStatus;
use lwio_rdma::{Mr, SendOp, Sge};
use tracing::{debug, warn};

use super::Waker;
use crate::fs::table::SessionId;
use crate::memobj::{read_len, write_check, MemJob, MemLink, MemObj, MemOp, Reply};
use crate::state::ServerState;

/// Work-request id kind of a memory-object RDMA Read or Write.
pub const WRID_MEMOBJ: u64 = 6 << 56;

/// At most this many jobs of one publisher in flight at once (each holds a
/// bounce buffer); the rest wait in the channel.
pub const MAX_INFLIGHT: usize = 8;

/// Start an I/O on memory object `obj` for the requesting connection.
/// Returns the status when it is known at once (nothing to move, or
/// refused); otherwise the answer comes through `reply`.
pub fn submit(
    obj: &Arc<MemObj>,
    op: OpId,
    offset: u64,
    kind: MemOp,
    reply: Reply,
) -> Option<Result<u32, NtStatus>> {
    if obj.is_gone() {
        return Some(Err(STATUS_FILE_DELETED));
    }
    let kind = match kind {
        MemOp::Read { buf, len } => {
            let n = read_len(obj, offset, len.min(buf.len()));
            if n == 0 {
                return Some(Ok(0));
            }
            MemOp::Read { buf, len: n }
        }
        MemOp::Write { data } => {
            if let Err(st) = write_check(obj, offset, data.len()) {
                return Some(Err(st));
            }
            if data.is_empty() {
                return Some(Ok(0));
            }
            MemOp::Write { data }
        }
    };
    obj.submit(MemJob::new(op, obj.clone(), offset, kind, reply));
    None
}

/// How long an RDMA operation on a publisher's memory may stay
/// unanswered before the server gives up on the publisher and closes its
/// connection (answering every job STATUS_FILE_DELETED): a publisher that
/// never answers an RDMA Read must not hold its readers' requests forever.
pub const PUBLISHER_DEADLINE: std::time::Duration = std::time::Duration::from_secs(30);

/// A job the publisher's connection has posted.
struct Posted {
    job: MemJob,
    bounce: Mr,
    len: usize,
    at: std::time::Instant,
    /// A write whose RDMA Write failed (its flushing Read, which this
    /// entry is keyed by, completes it).
    write_failed: bool,
}

/// The publisher's half, kept by every connection (any authenticated
/// connection may carry publications of its session).
pub struct PubSide {
    tx: mpsc::Sender<MemJob>,
    rx: mpsc::Receiver<MemJob>,
    /// The negotiate Key and session AUTH presented, until AUTH succeeds.
    pending: Option<(Guid, SessionId)>,
    key: Option<Guid>,
    posted: HashMap<u64, Posted>,
    /// A write's RDMA Write → the one-byte RDMA Read posted after it, whose
    /// completion answers the job (see [`PubSide::pump`]).
    writes: HashMap<u64, u64>,
    next: u64,
    /// Bounce buffers of jobs that failed before posting.
    freed: Vec<Mr>,
}

impl Default for PubSide {
    fn default() -> Self {
        let (tx, rx) = mpsc::channel();
        PubSide {
            tx,
            rx,
            pending: None,
            key: None,
            posted: HashMap::new(),
            writes: HashMap::new(),
            next: 0,
            freed: Vec::new(),
        }
    }
}

impl PubSide {
    /// AUTH presented negotiate Key `key` of `session` (not verified yet).
    pub fn presented(&mut self, key: Guid, session: SessionId) {
        self.pending = Some((key, session));
    }

    /// AUTH succeeded: the session may publish memory reachable through
    /// this connection, which it names by the Key.
    pub fn attach(&mut self, state: &ServerState, waker: Arc<Waker>) {
        let Some((key, session)) = self.pending.take() else {
            return;
        };
        state.mem_objects.attach(
            key,
            session,
            MemLink {
                tx: self.tx.clone(),
                waker,
            },
        );
        self.key = Some(key);
    }

    /// Post the queued jobs, as far as `room` send-queue entries and
    /// [`MAX_INFLIGHT`] allow: work requests are appended to `wrs`, and
    /// their number returned. `register` allocates a local-access bounce
    /// buffer.
    ///
    /// A write is an RDMA Write followed by a one-byte RDMA Read of the
    /// same key, and the job is answered on the Read's completion. A Read
    /// is answered only after the responder has placed the Writes before
    /// it on the connection (RFC 5040 §5.5 ordering; the same on
    /// InfiniBand), whereas on iWARP a Write's own completion means only
    /// that it was sent: the publisher's soft provider places it when one
    /// of its threads next reads the socket. So the writer's call returns
    /// once the bytes are in the publisher's memory.
    pub fn pump(
        &mut self,
        mut room: usize,
        wrs: &mut Vec<(u64, SendOp, Option<Sge>)>,
        mut register: impl FnMut(usize) -> Result<Mr, NtStatus>,
    ) -> usize {
        let mut n = 0;
        while room >= 2 && self.posted.len() < MAX_INFLIGHT {
            let Ok(job) = self.rx.try_recv() else {
                break;
            };
            let len = match &job.kind {
                MemOp::Read { len, .. } => *len,
                MemOp::Write { data } => data.len(),
            };
            // The range was clamped by `submit`; check again before any
            // key is used (the job came from another connection's thread).
            let end = job.offset.checked_add(len as u64);
            let remote_addr = job.obj.spec.addr.checked_add(job.offset);
            let (Some(end), Some(remote_addr)) = (end, remote_addr) else {
                job.finish(Err(STATUS_INVALID_PARAMETER));
                continue;
            };
            if end > job.obj.spec.size || len == 0 || u32::try_from(len).is_err() {
                job.finish(Err(STATUS_INVALID_PARAMETER));
                continue;
            }
            // Counted before it is posted, so an unpublish waits for it.
            if !job.obj.begin_io() {
                job.finish(Err(STATUS_FILE_DELETED));
                continue;
            }
            // A write's bounce has one byte more, for its flushing Read.
            let extra = usize::from(matches!(job.kind, MemOp::Write { .. }));
            let bounce = match register(len + extra) {
                Ok(m) => m,
                Err(st) => {
                    job.obj.end_io();
                    job.finish(Err(st));
                    continue;
                }
            };
            let rkey = job.obj.spec.rkey;
            let op = match &job.kind {
                MemOp::Read { .. } => SendOp::Read { remote_addr, rkey },
                MemOp::Write { data } => {
                    if bounce.write_at(0, data).is_err() {
                        job.obj.end_io();
                        job.finish(Err(STATUS_INVALID_PARAMETER));
                        self.freed.push(bounce);
                        continue;
                    }
                    SendOp::Write { remote_addr, rkey }
                }
            };
            let mut id = self.take_id();
            wrs.push((WRID_MEMOBJ | id, op, Some(bounce.sge(0, len as u32))));
            room -= 1;
            n += 1;
            if extra == 1 {
                let flush = self.take_id();
                self.writes.insert(id, flush);
                let read = SendOp::Read { remote_addr, rkey };
                wrs.push((WRID_MEMOBJ | flush, read, Some(bounce.sge(len, 1))));
                room -= 1;
                n += 1;
                id = flush;
            }
            self.posted.insert(
                id,
                Posted {
                    job,
                    bounce,
                    len,
                    at: std::time::Instant::now(),
                    write_failed: false,
                },
            );
        }
        n
    }

    fn take_id(&mut self) -> u64 {
        let id = self.next;
        self.next = (self.next + 1) & !lwio_proto::wrid::MASK;
        id
    }

    /// The work request `id` completed (`ok` = successfully). Returns its
    /// bounce buffer for deregistration.
    pub fn complete(&mut self, id: u64, ok: bool) -> Option<Mr> {
        if let Some(flush) = self.writes.remove(&id) {
            // A write's RDMA Write: its Read answers the job.
            if !ok {
                if let Some(p) = self.posted.get_mut(&flush) {
                    p.write_failed = true;
                }
            }
            return None;
        }
        let Posted {
            job,
            bounce,
            len,
            write_failed,
            ..
        } = self.posted.remove(&id)?;
        let ok = ok && !write_failed;
        job.obj.end_io();
        if !ok {
            debug!(object = %job.obj.spec.name, "RDMA access to the publisher's memory failed");
            // The publisher's key refused it (unpublished and deregistered,
            // or the connection is going): the object is gone for readers.
            job.finish(Err(STATUS_FILE_DELETED));
            return Some(bounce);
        }
        let r = match &job.kind {
            MemOp::Read { buf, .. } => {
                let mut tmp = vec![0u8; len];
                match bounce
                    .read_at(0, &mut tmp)
                    .and_then(|_| buf.write_at(0, &tmp))
                {
                    Ok(()) => Ok(len as u32),
                    Err(e) => {
                        warn!(error = %e, "memory-object copy failed");
                        Err(STATUS_INVALID_PARAMETER)
                    }
                }
            }
            MemOp::Write { .. } => {
                job.obj.written();
                Ok(len as u32)
            }
        };
        job.finish(r);
        Some(bounce)
    }

    /// Bounce buffers to deregister (jobs that failed before posting).
    pub fn take_freed(&mut self) -> Vec<Mr> {
        std::mem::take(&mut self.freed)
    }

    /// Whether an operation has waited for the publisher past `limit`.
    pub fn overdue(&self, now: std::time::Instant, limit: std::time::Duration) -> bool {
        self.posted
            .values()
            .any(|p| now.saturating_duration_since(p.at) > limit)
    }

    /// Posted work requests (their completions are still due).
    pub fn posted(&self) -> usize {
        self.posted.len() + self.writes.len()
    }

    /// The connection is going: its publications go, and every job still
    /// here is answered STATUS_FILE_DELETED (by drop). Returns the bounce
    /// buffers for deregistration.
    pub fn teardown(&mut self, state: &ServerState) -> Vec<Mr> {
        if let Some(k) = self.key.take() {
            state.mem_objects.detach(&k);
        }
        while let Ok(j) = self.rx.try_recv() {
            drop(j);
        }
        self.writes.clear();
        self.posted
            .drain()
            .map(|(_, p)| {
                p.job.obj.end_io();
                p.bounce
            })
            .collect()
    }
}
