//! The async (tokio) client API: [`AsyncClient`] and [`AsyncFile`].
//!
//! **The data path never blocks a thread.** A read or write issues its
//! requests without waiting (`Engine::try_issue_*`: a request goes out only
//! if a credit and a staging buffer or send slot are free now) and then
//! sleeps until a completion. Completions reach the futures through the
//! engine's completion fd: an eventfd that the engine signals at every
//! completion and when the connection is lost ([`Client::set_completion_notify`]),
//! watched by tokio's [`AsyncFd`] in one task per client, which wakes the
//! waiting futures. The engine's progress thread runs the completion
//! channel (the verbs CQ channel, or the soft provider's socket) and the
//! polled status blocks; in polling mode a future that has spun for the
//! engine's `poll_spin` asks the server for an INTERRUPT after its next
//! completion, exactly as a blocking waiter does, so that a status block
//! written by RDMA wakes it too. A future that waits longer re-checks on a
//! timer (1 ms doubling to 64 ms), which needs tokio's time driver
//! (`enable_time` or `enable_all`).
//!
//! Data is read into the engine's registered staging buffers and copied
//! into the caller's buffer by the future itself once its request has
//! completed, so **dropping a future never lets the server write into
//! memory the caller got back**: the dropped future's requests are
//! abandoned (the engine frees their staging buffers when they complete)
//! and a CANCEL names each of them (docs/protocol.md §5.9): those complete
//! with STATUS_CANCELLED if the server can still stop them, and the other
//! I/O of the file — other futures, other threads — is left alone.
//!
//! Connecting, opening, closing, `len`, `set_len` and `interrupt` use the
//! side channel or wait in the blocking client, and run on tokio's blocking
//! pool; they are not on the data path.

use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use lwio_proto::client::ReqId;
use lwio_proto::status::{NtStatus, STATUS_SUCCESS};
use tokio::io::unix::AsyncFd;
use tokio::sync::Notify;

use super::batch::{Batch, Short};
use super::engine::Engine;
use super::{
    status_error, Client, ClientOptions, ClientStats, Completion, Error, File, OpenOptions, Result,
};

fn joined<T>(r: std::result::Result<Result<T>, tokio::task::JoinError>) -> Result<T> {
    r.unwrap_or_else(|e| Err(Error::Io(format!("client task failed: {e}"))))
}

/// What the futures of one client share: the wake-up of "a request
/// completed" (or the connection was lost).
#[derive(Debug)]
struct Wakeup {
    notify: Notify,
}

/// The client, and the task that turns the completion fd into wake-ups
/// (stopped, and the fd detached from the engines, with the last clone).
#[derive(Debug)]
struct Shared {
    client: Client,
    wakeup: Arc<Wakeup>,
    reaper: tokio::task::AbortHandle,
}

impl Drop for Shared {
    fn drop(&mut self) {
        self.reaper.abort();
        self.client.set_completion_notify(None);
    }
}

/// Async client.
#[derive(Clone, Debug)]
pub struct AsyncClient(Arc<Shared>);

/// Read the eventfd whenever it is readable and wake every waiting future.
async fn reap(fd: AsyncFd<Arc<OwnedFd>>, wakeup: Arc<Wakeup>) {
    loop {
        let Ok(mut ready) = fd.readable().await else {
            return;
        };
        let mut count = [0u8; 8];
        // Non-blocking read of the counter; WouldBlock clears the readiness.
        let r = ready.try_io(|inner| {
            rustix::io::read(&**inner.get_ref(), &mut count).map_err(std::io::Error::from)
        });
        if let Ok(Err(e)) = r {
            tracing::warn!(error = %e, "completion fd failed; async waits fall back to timers");
            return;
        }
        wakeup.notify.notify_waiters();
    }
}

impl AsyncClient {
    pub async fn connect(
        target: &str,
        token: Option<&str>,
        opts: ClientOptions,
    ) -> Result<AsyncClient> {
        let (t, k) = (target.to_string(), token.map(str::to_string));
        let c = tokio::task::spawn_blocking(move || Client::connect(&t, k.as_deref(), opts)).await;
        AsyncClient::from_client(joined(c)?)
    }

    /// The async flavour of a connected client. It takes over the engines'
    /// completion fd ([`Client::set_completion_notify`]): do not also use
    /// `lwio_completion_fd`-style notification on the same client.
    /// Must be called within a tokio runtime.
    pub fn from_client(client: Client) -> Result<AsyncClient> {
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(Error::InvalidArgument(
                "AsyncClient needs a tokio runtime (with its I/O and time drivers)".into(),
            ));
        }
        let fd = rustix::event::eventfd(
            0,
            rustix::event::EventfdFlags::NONBLOCK | rustix::event::EventfdFlags::CLOEXEC,
        )
        .map_err(|e| Error::Io(format!("eventfd: {e}")))?;
        let fd = Arc::new(fd);
        // SAFETY: the descriptor is the eventfd just created, owned by the
        // `Arc<OwnedFd>` that the `AsyncFd` holds a clone of: it stays open,
        // and `as_raw_fd` returns that same descriptor, for the `AsyncFd`'s
        // whole life (the engines hold other clones; nothing closes it
        // before the last one drops).
        let afd =
            unsafe { AsyncFd::register_with_interest(fd.clone(), tokio::io::Interest::READABLE) }
                .map_err(|e| Error::Io(format!("completion fd in the tokio reactor: {e}")))?;
        let wakeup = Arc::new(Wakeup {
            notify: Notify::new(),
        });
        client.set_completion_notify(Some(fd.clone()));
        let reaper = tokio::spawn(reap(afd, wakeup.clone())).abort_handle();
        Ok(AsyncClient(Arc::new(Shared {
            client,
            wakeup,
            reaper,
        })))
    }

    pub async fn open(&self, path: &str, o: &OpenOptions) -> Result<AsyncFile> {
        let (c, p, o) = (self.0.client.clone(), path.to_string(), *o);
        let f = joined(tokio::task::spawn_blocking(move || c.open(&p, &o)).await)?;
        Ok(AsyncFile {
            file: Arc::new(f),
            shared: self.0.clone(),
            cancels: Arc::new(AtomicU64::new(0)),
            resends: Arc::new(AtomicU64::new(0)),
        })
    }

    pub async fn interrupt(&self) -> Result<()> {
        let c = self.0.client.clone();
        joined(tokio::task::spawn_blocking(move || c.interrupt()).await)
    }

    pub fn stats(&self) -> ClientStats {
        self.0.client.stats()
    }

    /// The blocking client underneath.
    pub fn blocking(&self) -> &Client {
        &self.0.client
    }
}

/// Async file handle (cheap to clone).
#[derive(Clone, Debug)]
pub struct AsyncFile {
    file: Arc<File>,
    shared: Arc<Shared>,
    cancels: Arc<AtomicU64>,
    /// Calls run again after a lost connection.
    resends: Arc<AtomicU64>,
}

/// The requests one future has outstanding, in the batch of its call.
/// Dropped before they are all reaped (the future was dropped, or gave up
/// on an error), it abandons them — the engine frees their staging buffers
/// when they complete — and CANCELs them.
struct Inflight<'a> {
    file: &'a AsyncFile,
    /// The Fid the requests went out on (on the batch's connection).
    fid: u16,
    batch: Batch,
}

impl Drop for Inflight<'_> {
    fn drop(&mut self) {
        let left = self.batch.abandon_all();
        if left.is_empty() {
            return;
        }
        self.file.cancels.fetch_add(1, Ordering::Relaxed);
        let e = self.batch.engine().clone();
        let fid = self.fid;
        tracing::debug!(
            fid,
            n = left.len(),
            "future dropped: cancelling its requests"
        );
        let mut rest = Vec::new();
        for req in left {
            match e.try_issue_cancel_request(fid, req) {
                // Sent (its answer is not awaited), or already complete.
                Ok(Some(Some(c))) => e.abandon_req(c),
                Ok(Some(None)) | Err(_) => {}
                Ok(None) => rest.push(req),
            }
        }
        if rest.is_empty() {
            return;
        }
        // No credit now: send the rest when completions return credits.
        let wakeup = self.file.shared.wakeup.clone();
        let cancel = async move {
            for req in rest {
                loop {
                    let notified = wakeup.notify.notified();
                    tokio::pin!(notified);
                    notified.as_mut().enable();
                    match e.try_issue_cancel_request(fid, req) {
                        Ok(Some(Some(c))) => {
                            e.abandon_req(c);
                            break;
                        }
                        Ok(Some(None)) | Err(_) => break,
                        Ok(None) => {
                            let _ = tokio::time::timeout(Duration::from_millis(50), notified).await;
                        }
                    }
                }
            }
        };
        if let Ok(h) = tokio::runtime::Handle::try_current() {
            h.spawn(cancel);
        }
    }
}

/// What a request's wait says when `op_timeout` passes.
const WAITED: &str = "request";

/// The error of a request whose answer did not come within `op_timeout`.
fn timed_out(req: ReqId) -> Error {
    Error::TimedOut(format!("{}: request {req}", Error::TimedOut(WAITED.into())))
}

impl AsyncFile {
    /// CANCELs issued because futures were dropped.
    pub fn dropped_futures(&self) -> u64 {
        self.cancels.load(Ordering::Relaxed)
    }

    pub fn fid(&self) -> u16 {
        self.file.fid()
    }

    /// Reads and writes of this file (and its clones) run again after
    /// their connection was lost.
    pub fn resent_calls(&self) -> u64 {
        self.resends.load(Ordering::Relaxed)
    }

    /// The engine and Fid to issue on: the file's registration, renewed
    /// first (on the blocking pool) if a reconnect happened since or its
    /// channel is lost (a failover to another channel).
    async fn route(&self) -> Result<(Arc<Engine>, u16)> {
        // Never wait for the route's lock on this thread: whoever holds it
        // is renewing the route through side-channel calls (as long as the
        // server takes: a stopped server stalled every task of the runtime
        // here). Busy: wait on the blocking pool instead.
        if let Some(r) = self.file.try_now() {
            let epoch = self.file.client.0.epoch.load(Ordering::Acquire);
            if r.stale.is_none() && r.epoch == epoch && r.engine.lost().is_none() {
                return Ok((r.engine, r.fid));
            }
        }
        let f = self.file.clone();
        tokio::task::spawn_blocking(move || f.current())
            .await
            .unwrap_or_else(|e| Err(Error::Io(format!("internal error: {e}"))))
    }

    /// Sleep until the next completion (or `step`, whichever is first);
    /// `Err` once `deadline` has passed. `notified` was enabled before the
    /// caller last looked, so a completion in between is not missed.
    async fn sleep(
        &self,
        notified: std::pin::Pin<&mut tokio::sync::futures::Notified<'_>>,
        step: Duration,
        deadline: Instant,
        what: &str,
    ) -> Result<()> {
        let now = Instant::now();
        if now >= deadline {
            return Err(Error::TimedOut(what.to_string()));
        }
        let _ = tokio::time::timeout(step.min(deadline - now), notified).await;
        Ok(())
    }

    /// Nothing of ours is out and no credit (or staging buffer, send slot)
    /// is free: other requests hold them, and their completions give them
    /// back.
    async fn credit_wait(
        &self,
        notified: std::pin::Pin<&mut tokio::sync::futures::Notified<'_>>,
        deadline: Instant,
    ) -> Result<()> {
        let step = Duration::from_millis(50);
        self.sleep(notified, step, deadline, "waiting for a credit")
            .await
    }

    /// Wait until `done` says the awaited completion has come, as the
    /// engine's completion mode wants: polled (`polled` and the engine
    /// polls), spin on the status block for `poll_spin`, then arm the
    /// interrupt and sleep with a backoff of 1 to 64 ms; else sleep until
    /// the next completion, looking again every 50 ms. `Ok(false)` once
    /// `op_timeout` has passed without it; `done`'s error at once.
    async fn wait_until(
        &self,
        e: &Engine,
        polled: bool,
        mut done: impl FnMut() -> Result<bool>,
    ) -> Result<bool> {
        let deadline = Instant::now() + e.config().op_timeout;
        let poll = e.completion_mode() == Completion::Poll && polled;
        let spin_until = Instant::now() + e.config().poll_spin;
        let mut sleeps = 0u32;
        loop {
            let notified = self.shared.wakeup.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if done()? {
                return Ok(true);
            }
            if poll && Instant::now() < spin_until {
                // Polling: the status block lands with no event; look again
                // after the other tasks of this thread had their turn.
                tokio::task::yield_now().await;
                continue;
            }
            let step = if poll {
                e.arm_interrupt();
                sleeps += 1;
                Duration::from_millis(1 << (sleeps - 1).min(6))
            } else {
                Duration::from_millis(50)
            };
            if self.sleep(notified, step, deadline, WAITED).await.is_err() {
                return Ok(false);
            }
        }
    }

    /// Wait for `req`'s completion: (information, status). `polled`: the
    /// request completes through its status block in polling mode (an
    /// I/O; not a CANCEL).
    async fn complete(&self, e: &Arc<Engine>, req: ReqId, polled: bool) -> Result<(u32, NtStatus)> {
        let mut answer = None;
        // `answer` is set exactly when the wait ended with it.
        self.wait_until(e, polled, || {
            answer = e.try_wait(req, true)?;
            Ok(answer.is_some())
        })
        .await?;
        match answer {
            Some(a) => Ok(a),
            None => {
                e.abandon_req(req);
                Err(timed_out(req))
            }
        }
    }

    /// Wait for the completion of the oldest part of `b` (an I/O), as
    /// [`AsyncFile::complete`] waits for one request, and leave it for
    /// [`Batch::try_reap`]; a timeout is the part's outcome.
    async fn complete_front(&self, b: &mut Batch) {
        let e = b.engine().clone();
        // `poll_front` cannot fail: its failures are the part's outcome.
        if let Ok(false) = self.wait_until(&e, true, || Ok(b.poll_front(true))).await {
            let req = b.front_req().unwrap_or_default();
            b.give_up_front(timed_out(req));
        }
    }

    /// Whether a call that failed with `e` is run again (a lost
    /// connection; the next attempt's `route` waits for the reconnect or
    /// the failover), before `deadline`, as the blocking `File` calls do
    /// (docs/reconnect.md): a request the lost connection left unanswered
    /// is sent again.
    async fn again(&self, e: &Error, deadline: Instant) -> bool {
        let inner = &self.file.client.0;
        if inner.opts.reconnect && crate::reconnect::is_lost(e) && Instant::now() < deadline {
            tracing::debug!(error = %e, "async I/O lost its connection; sending it again");
            self.resends.fetch_add(1, Ordering::Relaxed);
            tokio::time::sleep(Duration::from_millis(5)).await;
            return true;
        }
        false
    }

    /// Read into `buf` at `offset`. A read the lost connection left
    /// unanswered is sent again after the reconnect (within `op_timeout`).
    pub async fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<usize> {
        let deadline = Instant::now() + self.file.client.0.opts.op_timeout;
        loop {
            match self.read_once(buf, offset).await {
                Err(e) if self.again(&e, deadline).await => {}
                r => return r,
            }
        }
    }

    async fn read_once(&self, buf: &mut [u8], offset: u64) -> Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        offset
            .checked_add(buf.len() as u64)
            .ok_or_else(|| Error::InvalidArgument("offset + length overflows".into()))?;
        let (e, fid) = self.route().await?;
        let f = &self.file;
        let chunk = e.max_read();
        let depth = usize::from(e.credits()).clamp(1, e.config().stage_slots);
        let mut inflight = Inflight {
            file: self,
            fid,
            batch: Batch::new(e.clone(), fid, offset, Short::Ends),
        };
        let b = &mut inflight.batch;
        let deadline = Instant::now() + e.config().op_timeout;
        // The caller's buffer is written only once the read is complete (a
        // future dropped before that leaves it untouched): a read that fits
        // in the staging buffers it may hold keeps them until then, a
        // longer one collects its data here first.
        let mut collect = (buf.len() > depth * chunk).then(|| vec![0u8; buf.len()]);
        loop {
            let notified = self.shared.wakeup.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            while !b.ended() && b.issued() < buf.len() && b.outstanding() < depth {
                let len = chunk.min(buf.len() - b.issued());
                match b.try_read(len) {
                    Ok(true) => {}
                    Ok(false) => break,
                    Err(err) => b.fail(err),
                }
            }
            if b.outstanding() == 0 {
                if b.ended() || b.issued() >= buf.len() {
                    break;
                }
                // Nothing of ours out and no credit or staging buffer free:
                // other requests hold them; their completions give them back.
                // Staging buffers kept by this read are given back first (their
                // data moved aside), or reads that each hold some and wait for
                // more would wait for one another.
                if b.has_kept() {
                    b.copy_kept(collect.get_or_insert_with(|| vec![0u8; buf.len()]));
                    continue;
                }
                let _counted = e.credit_waiter();
                self.credit_wait(notified, deadline).await?;
                continue;
            }
            self.complete_front(b).await;
            if let Some(l) = b.try_reap(false) {
                match &mut collect {
                    Some(v) => l.copy_into(v),
                    None => l.keep(),
                }
            }
        }
        let r = f.read_result(b.take_end());
        if let Ok(total) = r {
            if let Some(v) = &collect {
                buf[..total].copy_from_slice(&v[..total]);
            }
            b.copy_kept(buf);
        }
        r
    }

    /// Write `data` at `offset`. A write the lost connection left
    /// unanswered is sent again after the reconnect (within `op_timeout`),
    /// before this returns (the ordering rule of docs/reconnect.md).
    pub async fn write_at(&self, data: &[u8], offset: u64) -> Result<usize> {
        let deadline = Instant::now() + self.file.client.0.opts.op_timeout;
        loop {
            match self.write_once(data, offset).await {
                Err(e) if self.again(&e, deadline).await => {}
                r => return r,
            }
        }
    }

    async fn write_once(&self, data: &[u8], offset: u64) -> Result<usize> {
        offset
            .checked_add(data.len() as u64)
            .ok_or_else(|| Error::InvalidArgument("offset + length overflows".into()))?;
        let (e, fid) = self.route().await?;
        let f = &self.file;
        let page = usize::from(e.client_page_size());
        let mut chunk = e.max_write();
        if f.no_buffering && chunk >= page {
            // Unbuffered files need aligned pieces: whole pages per request.
            chunk -= chunk % page;
        }
        let depth = usize::from(e.credits()).max(1);
        let mut inflight = Inflight {
            file: self,
            fid,
            batch: Batch::new(e.clone(), fid, offset, Short::Fails),
        };
        let b = &mut inflight.batch;
        let deadline = Instant::now() + e.config().op_timeout;
        loop {
            let notified = self.shared.wakeup.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            while !b.ended() && b.issued() < data.len() && b.outstanding() < depth {
                let issued = b.issued();
                let len = chunk.min(data.len() - issued);
                match b.try_write(&data[issued..issued + len]) {
                    Ok(true) => {}
                    Ok(false) => break,
                    Err(x) => b.fail(x),
                }
            }
            if b.outstanding() == 0 {
                if b.ended() || b.issued() >= data.len() {
                    break;
                }
                let _counted = e.credit_waiter();
                self.credit_wait(notified, deadline).await?;
                continue;
            }
            self.complete_front(b).await;
            drop(b.try_reap(false));
        }
        f.write_result(b.take_end())
    }

    /// CANCEL this file's outstanding I/O (docs/protocol.md §5.9).
    pub async fn cancel(&self) -> Result<()> {
        let (e, fid) = self.route().await?;
        let deadline = Instant::now() + e.config().op_timeout;
        let req = loop {
            let notified = self.shared.wakeup.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(r) = e.try_issue_cancel(fid)? {
                break r;
            }
            self.credit_wait(notified, deadline).await?;
        };
        match self.complete(&e, req, false).await? {
            (_, STATUS_SUCCESS) => Ok(()),
            (_, st) => Err(status_error("CANCEL", st)),
        }
    }

    pub async fn len(&self) -> Result<u64> {
        let f = self.file.clone();
        joined(tokio::task::spawn_blocking(move || f.len()).await)
    }

    pub async fn set_len(&self, size: u64) -> Result<()> {
        let f = self.file.clone();
        joined(tokio::task::spawn_blocking(move || f.set_len(size)).await)
    }

    /// Close (when this is the last handle; otherwise the last drop closes).
    pub async fn close(self) -> Result<()> {
        match Arc::try_unwrap(self.file) {
            Ok(f) => joined(tokio::task::spawn_blocking(move || f.close()).await),
            Err(_) => Ok(()),
        }
    }
}
