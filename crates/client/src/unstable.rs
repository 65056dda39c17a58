//! Writes sent without waiting for their answers, as NFS's UNSTABLE
//! writes: the caller learns the outcome later ([`PendingWrite::wait`]),
//! and a FLUSH sent behind them on the same connection syncs them
//! (docs/protocol.md §5.13, "Ordering"). The FUSE mount answers a write(2)
//! this way (docs/mount.md, "Unstable writes").

use super::*;
use crate::batch::{Batch, End, Short};

/// One WRITE request on its way (see [`File::start_write`]): a [`Batch`] of
/// one part, reaped later. Dropping it without [`PendingWrite::wait`]
/// abandons the answer (the write still happens, or not, unobserved).
pub struct PendingWrite {
    batch: Batch,
    len: usize,
    /// Its outcome once seen (by `poll`), until `wait` takes it.
    result: Option<Result<usize>>,
}

impl std::fmt::Debug for PendingWrite {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PendingWrite({} bytes)", self.len)
    }
}

impl File {
    /// Send one WRITE of `buf` at `offset` and return without waiting for
    /// its answer. `Ok(None)` when it does not fit one request (larger than
    /// the connection's largest write, or empty): write it with
    /// [`File::write_at`]. Waits only for a credit. `Err(ConnectionLost)`
    /// if the connection is gone (the write was not sent).
    pub fn start_write(&self, buf: &[u8], offset: u64) -> Result<Option<PendingWrite>> {
        offset
            .checked_add(buf.len() as u64)
            .ok_or_else(|| Error::InvalidArgument("offset + length overflows".into()))?;
        let (engine, fid) = self.current()?;
        if buf.is_empty() || buf.len() > engine.max_write() {
            return Ok(None);
        }
        let mut batch = Batch::new(engine, fid, offset, Short::Fails);
        batch.write(buf)?;
        // Issuing only queues the message: nobody waits for this one now.
        batch.flush();
        Ok(Some(PendingWrite {
            batch,
            len: buf.len(),
            result: None,
        }))
    }
}

impl PendingWrite {
    /// The bytes it carries.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it carries no bytes (never: `start_write` sends none such).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether a FLUSH of `f` (its [`File::sync_data`]/[`File::sync_all`])
    /// covers this write without waiting for it: the server orders a FLUSH
    /// after the writes it received before it on the same connection, so
    /// this holds when `f` is on this write's connection and syncs there.
    pub fn covered_by_sync_of(&self, f: &File) -> bool {
        let r = f.now();
        Arc::ptr_eq(&r.engine, self.batch.engine()) && r.engine.server_flushes()
    }

    /// Its answer if it has come, without blocking.
    pub fn poll(&mut self) -> Option<&Result<usize>> {
        if self.result.is_none() && self.batch.try_reap(false).is_some() {
            self.result = Some(self.outcome());
        }
        self.result.as_ref()
    }

    /// Wait for its answer: the bytes written (all of them), the server's
    /// error, or `ConnectionLost` (it may or may not have been written: write
    /// it again on the new connection).
    pub fn wait(mut self) -> Result<usize> {
        if let Some(r) = self.result.take() {
            return r;
        }
        drop(self.batch.reap());
        self.outcome()
    }

    fn outcome(&mut self) -> Result<usize> {
        match self.batch.take_end() {
            (n, None) => Ok(n),
            (_, Some(End::Status(st))) => Err(status_error("WRITE", st)),
            (_, Some(End::Failed(e))) => Err(e),
            (n, Some(End::Short)) => {
                Err(Error::Io(format!("short write: {n} of {} bytes", self.len)))
            }
        }
    }
}
