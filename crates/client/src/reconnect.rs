//! Reconnect and durable handles (docs/reconnect.md).
//!
//! A call that finds its connection lost (the RDMA channel or the side
//! channel: [`Error::ConnectionLost`]) waits for a reconnect and runs
//! again, all within [`ClientOptions::op_timeout`](crate::ClientOptions)
//! of its start. One thread reconnects at a time
//! ([`Inner::reconnect`]): it shuts the old RDMA channels down, logs in
//! on a new side channel, takes the lost session's open files back with
//! `Resume` (durable handles; the server keeps them for
//! `limits.durable_grace`), and dials the RDMA channels again, retrying
//! with capped exponential backoff. Files register again lazily, before
//! their next request ([`File::retry`]): `Rekey` (a fresh resume key for
//! the same handle) and REGISTER; after a server restart (the `Resume` is
//! refused: the state is gone) they reopen by path and check the server's
//! file id, and a file that is not the same any more fails with
//! [`Error::Stale`].
//!
//! With several RDMA channels, the loss of one while the side channel and
//! another channel work is a failover, not a reconnect: the files of the
//! lost channel move to a working one (`Rekey` + REGISTER,
//! `File::fail_over`) and their calls run again there.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use lwio_proto::status::STATUS_SUCCESS;
use lwio_proto::wire::FILE_NO_INTERMEDIATE_BUFFERING;
use lwio_side::error::ErrorCode;
use tracing::{debug, info};

use crate::engine::Engine;
use crate::{Error, File, Inner, Result};

/// First pause between reconnect attempts; doubled after each failure.
pub const BACKOFF_MIN: Duration = Duration::from_millis(50);
/// The longest pause between reconnect attempts.
pub const BACKOFF_MAX: Duration = Duration::from_secs(2);

/// Where an open file is registered now.
#[derive(Clone)]
pub(crate) struct Route {
    /// The RDMA channel (index) it is registered on.
    pub(crate) channel: usize,
    pub(crate) engine: Arc<Engine>,
    pub(crate) fid: u16,
    /// Its side-channel handle.
    pub(crate) handle: u64,
    /// The client's [`Inner::epoch`] and [`Inner::reset`] at registration.
    pub(crate) epoch: u64,
    pub(crate) reset: u64,
    /// Set once the file turned out not to be the one opened (after a
    /// server restart): every later call fails with it.
    pub(crate) stale: Option<String>,
}

/// Whether `e` means the connection went away (worth a reconnect). Not
/// when this client terminated it because the server wrote memory it was
/// not given or broke the RDMA protocol: a misbehaving server is not
/// reconnected to, and the call fails at once with that reason.
pub(crate) fn is_lost(e: &Error) -> bool {
    matches!(e, Error::ConnectionLost(m) if !m.contains(crate::engine::REFUSED))
}

/// Whether `e`, from a call on `engine`, means that connection is lost:
/// [`is_lost`], or an RDMA error (posting on a queue pair in the error
/// state) while `engine` is lost, and not refused by this client.
pub(crate) fn lost_on(e: &Error, engine: &Engine) -> bool {
    is_lost(e)
        || matches!(e, Error::Rdma(_))
            && engine
                .check_lost()
                .is_some_and(|why| !why.contains(crate::engine::REFUSED))
}

/// REGISTER an opened file (`rf`) on channel `channel` (modulo the channel
/// count), or on the next one whose connection is not lost; `epoch` and
/// `reset` as read before the open.
pub(crate) fn register(
    inner: &Inner,
    channel: usize,
    rf: &crate::side_client::RemoteFile,
    no_buffering: bool,
    epoch: u64,
    reset: u64,
) -> Result<Route> {
    let channel = inner
        .live_channel(channel % inner.channel_count().max(1))
        .ok_or_else(|| Error::ConnectionLost("every RDMA channel of this client is lost".into()))?;
    let e = inner.channel(channel);
    let flags = if no_buffering {
        FILE_NO_INTERMEDIATE_BUFFERING
    } else {
        0
    };
    match e
        .issue_register(rf.resume_key.key, flags)
        .and_then(|r| e.wait(r))?
    {
        (fid, STATUS_SUCCESS) if fid != 0 && fid <= 0xffff => Ok(Route {
            channel,
            engine: e,
            fid: fid as u16,
            handle: rf.handle,
            epoch,
            reset,
            stale: None,
        }),
        (_, status) => Err(Error::Status {
            what: "REGISTER".into(),
            status,
        }),
    }
}

impl Inner {
    /// Run `f`; while it fails because the connection is lost (and
    /// reconnecting is on), reconnect and run it again, until
    /// `op_timeout` after the start.
    ///
    /// While one RDMA channel is lost and another still works, `f` first
    /// runs again without a reconnect, at most once per channel (an `open`
    /// then registers on a working channel; a call that failed on the side
    /// channel fails again and reconnects after those tries).
    pub(crate) fn retry<T>(&self, mut f: impl FnMut() -> Result<T>) -> Result<T> {
        let deadline = Instant::now() + self.opts.op_timeout;
        let mut reruns = 0;
        loop {
            let seen = self.epoch.load(Ordering::Acquire);
            match f() {
                Err(e)
                    if self.opts.reconnect
                        && (is_lost(&e) || self.channels().iter().any(|c| lost_on(&e, c))) =>
                {
                    if reruns < self.channel_count()
                        && self.channels().iter().any(|c| c.check_lost().is_some())
                        && self.live_channel(0).is_some()
                        && Instant::now() < deadline
                    {
                        reruns += 1;
                        debug!(error = %e, "an RDMA channel is lost; again on another");
                        continue;
                    }
                    self.reconnect(seen, deadline, &e)?
                }
                r => return r,
            }
        }
    }

    /// A side-channel call, again after a reconnect if the connection was
    /// lost ([`Inner::retry`]).
    pub(crate) fn side<T>(
        &self,
        mut f: impl FnMut(&mut crate::side_client::SideClient) -> lwio_side::Result<T>,
    ) -> Result<T> {
        self.retry(|| self.side_once(&mut f))
    }

    /// Reconnect, unless another thread did since epoch `seen`: new side
    /// channel, `Resume` of the lost session, new RDMA channels. Retries
    /// with backoff from [`BACKOFF_MIN`] to [`BACKOFF_MAX`] until
    /// `deadline`; then [`Error::TimedOut`] naming `why` and the last error.
    pub(crate) fn reconnect(&self, seen: u64, deadline: Instant, why: &Error) -> Result<()> {
        let _one = self.recon.lock().unwrap_or_else(|p| p.into_inner());
        if self.epoch.load(Ordering::Acquire) != seen {
            return Ok(());
        }
        let t0 = Instant::now();
        let mut backoff = BACKOFF_MIN;
        let mut attempts = 0u32;
        loop {
            attempts += 1;
            match self.reconnect_once() {
                Ok(files) => {
                    let n = self.reconnects.fetch_add(1, Ordering::Relaxed) + 1;
                    self.epoch.fetch_add(1, Ordering::AcqRel);
                    info!(
                        server = %self.authority,
                        attempts,
                        ms = t0.elapsed().as_millis() as u64,
                        durable_files = ?files,
                        reconnects = n,
                        cause = %why,
                        "reconnected"
                    );
                    return Ok(());
                }
                Err(
                    e @ (Error::WrongToken(_)
                    | Error::AccessDenied(_)
                    | Error::NoCommonTransport(_)
                    | Error::InvalidArgument(_)),
                ) => return Err(e),
                Err(e) => {
                    let now = Instant::now();
                    if now + backoff >= deadline {
                        return Err(Error::TimedOut(format!(
                            "connection to {} lost ({why}) and not back after {attempts} attempts in {:.1?}: {e}",
                            self.authority,
                            t0.elapsed()
                        )));
                    }
                    debug!(attempts, error = %e, ?backoff, "reconnect failed; retrying");
                    std::thread::sleep(backoff);
                    backoff = (backoff * 2).min(BACKOFF_MAX);
                }
            }
        }
    }

    /// One reconnect attempt; `Some(n)`: `n` durable files taken back,
    /// `None`: the server's state was gone (files reopen by path).
    fn reconnect_once(&self) -> Result<Option<u64>> {
        for e in self.channels() {
            e.shutdown();
        }
        let old = {
            let g = self.side.lock().unwrap_or_else(|p| p.into_inner());
            match g.as_ref() {
                Some(s) => s.session().clone(),
                None => return Err(Error::ConnectionLost("the client is closing".into())),
            }
        };
        let mut side = crate::side_client::SideClient::connect(&self.authority, &self.side_opts)?;
        let files = match side.resume(&old) {
            Ok(n) => Some(n),
            // Refused, whatever the reason (lost past its grace, a server
            // restart): the files must be opened again.
            Err(e) if e.code == ErrorCode::PermissionDenied => {
                info!(server = %self.authority, session = old.id, error = %e, "durable handles gone; files reopen by path");
                self.reset.fetch_add(1, Ordering::AcqRel);
                None
            }
            Err(e) => return Err(e.into()),
        };
        // From here the new session is the one to resume if the RDMA dial
        // fails (it holds the files now).
        let mut g = self.side.lock().unwrap_or_else(|p| p.into_inner());
        let s = g.insert(side);
        let (engines, _, keys) = crate::dial_all(s, &self.authority, &self.opts)?;
        drop(g);
        *self.engines.write().unwrap_or_else(|p| p.into_inner()) = engines;
        *self.channel_keys.write().unwrap_or_else(|p| p.into_inner()) = keys;
        Ok(files)
    }
}

impl File {
    /// Run `f` on the file's current registration; a lost connection is
    /// waited out and `f` runs again on the new one (the caller's buffers
    /// are still borrowed, so a re-sent WRITE carries the same bytes).
    ///
    /// When only the file's RDMA channel was lost and another channel still
    /// works, `f` runs again on that one after the file moved there (a
    /// failover, [`File::route`]), without a reconnect.
    pub(crate) fn retry<T>(&self, mut f: impl FnMut(&Route) -> Result<T>) -> Result<T> {
        let inner = &self.client.0;
        let deadline = Instant::now() + inner.opts.op_timeout;
        loop {
            let seen = inner.epoch.load(Ordering::Acquire);
            let r = match self.route() {
                Ok(r) => r,
                Err(e) if inner.opts.reconnect && is_lost(&e) => {
                    inner.reconnect(seen, deadline, &e)?;
                    continue;
                }
                Err(e) => return Err(e),
            };
            match f(&r) {
                Err(e) if inner.opts.reconnect && lost_on(&e, &r.engine) => {
                    // Each pass through here moves the file off a channel
                    // that is lost for good, so it ends.
                    if r.engine.check_lost().is_some()
                        && inner.live_channel(0).is_some()
                        && Instant::now() < deadline
                    {
                        debug!(file = %self.path, channel = r.channel, "re-issuing on another channel");
                        continue;
                    }
                    inner.reconnect(r.epoch, deadline, &e)?;
                    debug!(file = %self.path, "re-issuing after a reconnect");
                }
                r => return r,
            }
        }
    }

    /// The file's registration on the current connection: registered again
    /// (Rekey, or reopen by path after a server restart) if a reconnect
    /// happened since, or moved to another channel if its own was lost
    /// ([`File::fail_over`]). Holding the route lock meanwhile, other calls
    /// on this file wait: they re-issue in the order they reach it.
    pub(crate) fn route(&self) -> Result<Route> {
        let inner = &self.client.0;
        let mut g = self.route.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(s) = &g.stale {
            return Err(Error::Stale(s.clone()));
        }
        let epoch = inner.epoch.load(Ordering::Acquire);
        if g.epoch == epoch {
            return match g.engine.lost() {
                Some(why) if inner.opts.reconnect && !why.contains(crate::engine::REFUSED) => {
                    self.fail_over(&mut g, why)
                }
                _ => Ok(g.clone()),
            };
        }
        let reset = inner.reset.load(Ordering::Acquire);
        let rf = if g.reset != reset {
            match self.reopen() {
                Ok(rf) => rf,
                Err(Error::Stale(m)) => {
                    g.stale = Some(m.clone());
                    return Err(Error::Stale(m));
                }
                Err(e) => return Err(e),
            }
        } else {
            let h = g.handle;
            inner.side_once(|s| s.rekey(h))?
        };
        let r = register(inner, g.channel, &rf, self.no_buffering, epoch, reset)?;
        *g = r.clone();
        Ok(r)
    }

    /// The file's channel is lost: move the file to another channel that
    /// works, on the same side-channel session (`Rekey`, which waits until
    /// the lost connection let go of the file, then REGISTER), without a
    /// reconnect. The first file to move off a channel counts the failover
    /// ([`Inner::failovers`]), logs it and shuts the lost channel down; it
    /// comes back with the next reconnect. `ConnectionLost` when no channel
    /// works (or a reconnect came first): the caller reconnects.
    fn fail_over(&self, g: &mut Route, why: String) -> Result<Route> {
        let inner = &self.client.0;
        // Not while a reconnect replaces the channels: the file would be
        // registered on a new connection under the old epoch, and its
        // `Rekey` after the reconnect would wait for that connection.
        let _one = inner.recon.lock().unwrap_or_else(|p| p.into_inner());
        let lost = || Error::ConnectionLost(why.clone());
        if inner.epoch.load(Ordering::Acquire) != g.epoch {
            return Err(lost());
        }
        let to = inner.live_channel(g.channel + 1).ok_or_else(lost)?;
        let h = g.handle;
        let rf = inner.side_once(|s| s.rekey(h))?;
        let r = register(inner, to, &rf, self.no_buffering, g.epoch, g.reset)?;
        if g.engine.claim_failover() {
            let n = inner.failovers.fetch_add(1, Ordering::Relaxed) + 1;
            info!(
                server = %inner.authority,
                channel = g.channel,
                to = r.channel,
                failovers = n,
                cause = %why,
                "RDMA channel failed over"
            );
            g.engine.shutdown();
        }
        debug!(file = %self.path, from = g.channel, to = r.channel, "file moved to another channel");
        *g = r.clone();
        Ok(r)
    }

    /// After a server restart: open the path again (same access; never
    /// create, truncate or exclusive) and check that it is the same file.
    fn reopen(&self) -> Result<crate::side_client::RemoteFile> {
        let inner = &self.client.0;
        let what = format!("{}/{}", self.export, self.path);
        let mut o = self.open;
        o.create = false;
        o.truncate = false;
        o.exclusive = false;
        let rf = match inner.side_once(|s| {
            s.as_caller(self.caller.as_ref(), |s| {
                s.open(&self.export, &self.path, &o, self.mode)
            })
        }) {
            Ok(rf) => rf,
            Err(Error::NotFound(_)) => {
                return Err(Error::Stale(format!(
                    "{what}: gone after the server restarted"
                )))
            }
            Err(e) => return Err(e),
        };
        if self.file_id == 0 || rf.file_id != self.file_id {
            let _ = inner.side_once(|s| s.close(rf.handle));
            return Err(Error::Stale(if self.file_id == 0 || rf.file_id == 0 {
                format!("{what}: cannot tell whether it is still the same file after the server restarted (no file id)")
            } else {
                format!(
                    "{what}: another file after the server restarted (file id {:#x}, was {:#x})",
                    rf.file_id, self.file_id
                )
            }));
        }
        info!(file = %what, "reopened by path after a server restart");
        Ok(rf)
    }
}
