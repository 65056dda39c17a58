//! The lwio client library: file reads and writes offloaded to an lwio
//! server over RDMA.
//!
//! ```no_run
//! use lwio_client::{Client, ClientOptions, Completion, OpenOptions};
//! # fn main() -> Result<(), lwio_client::Error> {
//! let opts = ClientOptions { completion: Completion::Poll, ..ClientOptions::default() };
//! let client = Client::connect("lwio://storage1/data", Some("s3cret-token"), opts)?;
//! let f = client.open("logs/app.log", &OpenOptions::read_write().create(true))?;
//! f.write_at(b"hello", 4096)?;
//! let mut buf = [0u8; 5];
//! assert_eq!(f.read_at(&mut buf, 4096)?, 5);
//! println!("{} bytes", f.len()?);
//! f.close()?;
//! # Ok(()) }
//! ```
//!
//! The side channel is secured and logged into as the `lwio` CLI does it
//! ([`connect`]: TLS trusted on first use in known_hosts; `LWIO_TOKEN` or
//! the default token file when no token is given), so this works against a
//! default `lwio serve`; `opts.no_tls()` for a server with `tls = false`.
//!
//! `connect` logs in over the side channel (token), negotiates a common
//! RDMA provider, connects the RDMA channel and authenticates it (AUTH,
//! signed with a secret bound to this side-channel session and the
//! negotiate Key). `open` opens the file over the side channel, receives a
//! resume key and REGISTERs it on the RDMA channel; reads and writes then go
//! over RDMA only. [`AsyncClient`] / [`AsyncFile`] are the tokio flavour.
//!
//! See [`engine`] for the data path (threads, memory windows, completion
//! modes).

pub mod async_client;
pub mod connect;
pub mod discovery;
pub mod engine;
pub mod errno;
pub mod handoff;
pub mod publish;
pub mod reconnect;
pub mod side;
pub mod url;

use std::io::{IoSlice, IoSliceMut};
use std::net::{IpAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use lwio_proto::status::*;
use lwio_proto::wire::NegotiateRequestRepr;
use lwio_proto::NtStatus;
use tracing::{debug, info};

pub use async_client::{AsyncClient, AsyncFile};
pub use connect::ConnectArgs;
use engine::{status_text, EngineConfig};
pub use engine::{ClientStats, Engine};
/// How the side channel is secured ([`ClientOptions::tls`]).
pub use lwio_side::ClientTls;
pub use publish::{MemRights, PublishError, Published};

use crate::url::{LwioUrl, DEFAULT_PORT};
/// Which RDMA providers a client offers ([`ClientOptions::provider`]).
pub use lwio_rdma::ProviderChoice;
use lwio_side::error::ErrorCode;

/// How completions reach the client.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Completion {
    /// The server sends a status response (or RDMA Write with immediate where
    /// the provider has it); the client sleeps on its completion channel.
    #[default]
    Interrupt,
    /// The server RDMA-writes the IO_STATUS_BLOCK into client memory; the
    /// client watches it (no receive completion involved). After
    /// `poll_spin` without completion the waiter sends INTERRUPT and sleeps.
    Poll,
}

/// Client errors. Messages say what happened and, where it helps, what to do.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    #[error("cannot reach the lwio server: {0}")]
    Unreachable(String),
    #[error("login refused: {0}")]
    WrongToken(String),
    /// Negotiate found no wire transport both hosts speak (the message
    /// names the transports of each side).
    #[error("{0}")]
    NoCommonTransport(String),
    #[error("access denied: {0}")]
    AccessDenied(String),
    /// The export (or the server's file system) is read-only.
    #[error("{0}")]
    ReadOnly(String),
    #[error("not found: {0}")]
    NotFound(String),
    #[error("the server went away: {0}")]
    ConnectionLost(String),
    #[error("{what} failed with {}", status_text(*status))]
    Status { what: String, status: NtStatus },
    #[error("timed out: {0}")]
    TimedOut(String),
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    #[error("busy: {0}")]
    Busy(String),
    #[error("the operation was cancelled")]
    Cancelled,
    #[error("RDMA: {0}")]
    Rdma(String),
    #[error("side channel: {0}")]
    Side(String),
    /// The server's file system refused a call with this code (it maps to
    /// one errno: `EEXIST`, `EPERM`, `ENAMETOOLONG`, …, errno.rs).
    #[error("{0}")]
    Fs(lwio_side::Error),
    #[error("I/O: {0}")]
    Io(String),
    /// The file is no longer the one that was opened: after a server
    /// restart its path names another file, or none (ESTALE).
    #[error("stale file handle: {0}")]
    Stale(String),
}

impl From<lwio_rdma::Error> for Error {
    fn from(e: lwio_rdma::Error) -> Error {
        match e {
            // The server says why in the reject ("server busy: 256
            // connections (limit 256)", "out of receive memory: …"): pass
            // it on, printable characters only.
            lwio_rdma::Error::Rejected { private_data } => {
                let why: String = String::from_utf8_lossy(&private_data)
                    .chars()
                    .filter(|c| !c.is_control())
                    .take(200)
                    .collect();
                if why.is_empty() {
                    Error::Rdma("the server refused the RDMA connection".into())
                } else {
                    Error::Busy(why)
                }
            }
            e => Error::Rdma(e.to_string()),
        }
    }
}

impl From<lwio_side::Error> for Error {
    fn from(e: lwio_side::Error) -> Error {
        let m = e.to_string();
        match e.code {
            ErrorCode::ConnectFailed => Error::Unreachable(m),
            ErrorCode::AuthFailed => Error::WrongToken(m),
            ErrorCode::NotFound | ErrorCode::NoSuchExport => Error::NotFound(m),
            ErrorCode::PermissionDenied | ErrorCode::OutsideExport => Error::AccessDenied(m),
            ErrorCode::ReadOnly => Error::ReadOnly(m),
            ErrorCode::Disconnected => Error::ConnectionLost(m),
            ErrorCode::TimedOut => Error::TimedOut(m),
            ErrorCode::InvalidArgument => Error::InvalidArgument(m),
            ErrorCode::Exists
            | ErrorCode::NotADirectory
            | ErrorCode::IsADirectory
            | ErrorCode::NoSpace
            | ErrorCode::DirectoryNotEmpty
            | ErrorCode::NameTooLong
            | ErrorCode::NotPermitted
            | ErrorCode::CrossDevice
            | ErrorCode::TooManyLinks
            | ErrorCode::Loop
            | ErrorCode::FileTooLarge
            | ErrorCode::TextBusy => Error::Fs(e),
            _ => Error::Side(m),
        }
    }
}

impl From<Error> for std::io::Error {
    fn from(e: Error) -> std::io::Error {
        use std::io::ErrorKind as K;
        let kind = match &e {
            Error::Unreachable(_) => K::ConnectionRefused,
            Error::WrongToken(_) | Error::AccessDenied(_) => K::PermissionDenied,
            Error::ReadOnly(_) => K::ReadOnlyFilesystem,
            Error::NotFound(_) => K::NotFound,
            Error::ConnectionLost(_) => K::ConnectionAborted,
            Error::TimedOut(_) => K::TimedOut,
            Error::InvalidArgument(_) => K::InvalidInput,
            Error::Cancelled => K::Interrupted,
            Error::Stale(_) => K::StaleNetworkFileHandle,
            _ => K::Other,
        };
        std::io::Error::new(kind, e)
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

fn status_error(what: impl Into<String>, status: NtStatus) -> Error {
    let what = what.into();
    match status {
        STATUS_ACCESS_DENIED => Error::AccessDenied(format!("{what}: {}", status_text(status))),
        STATUS_CANCELLED => Error::Cancelled,
        _ => Error::Status { what, status },
    }
}

/// Threshold of per-call registration on verbs devices when
/// [`ClientOptions::register_threshold`] is `None` (see `bench/RESULTS.md`).
pub const DEFAULT_REGISTER_THRESHOLD: usize = 64 * 1024;

/// The per-call registration threshold for a provider when the options
/// leave it to us: on the soft provider staging measured as fast or faster
/// (`bench/RESULTS.md`: the provider copies every byte from its socket
/// anyway, and a registered read also waits for its invalidations), so it
/// stages; on verbs devices the NIC places data in the caller's buffer with
/// no CPU copy at all, so reads of 64 KiB and more register it.
pub fn default_register_threshold(provider: &str) -> usize {
    if provider == "soft" {
        usize::MAX
    } else {
        DEFAULT_REGISTER_THRESHOLD
    }
}

/// Client settings.
#[derive(Debug, Clone)]
pub struct ClientOptions {
    pub completion: Completion,
    /// Which RDMA providers to offer (in preference order for `auto`).
    pub provider: ProviderChoice,
    /// Device to open (None = the provider's first usable one). With
    /// several devices name the one that routes to the server.
    pub device: Option<String>,
    /// Credits to ask for (the server may grant fewer, and adjusts later).
    pub credits: u16,
    /// The most requests this client ever has in flight on a connection
    /// (its deepest queue; 255 = no limit). Credits a server grants beyond
    /// it are reported unused, and the server takes them back.
    pub max_credits: u16,
    /// Largest read per request (the server's window may be smaller).
    pub read_chunk: usize,
    /// Concurrent large reads (registered staging slots of `read_chunk`).
    pub stage_slots: usize,
    /// Largest write payload per request we send (the server's
    /// MaxRecvBufferSize may be smaller).
    pub write_chunk: usize,
    pub send_slots: usize,
    /// Polling mode: how long a waiter spins on its status block.
    pub poll_spin: Duration,
    /// Interrupt mode: how long a waiting thread polls for its completion
    /// before it sleeps (zero: it sleeps at once). A reply that comes
    /// within this time costs no wake-up of the thread. At most one thread
    /// per CPU of the process polls at a time; the others sleep at once.
    pub busy_poll: Duration,
    /// Blocking reads of at least this many bytes into plain memory land
    /// directly in the caller's buffer, registered for the call, instead of
    /// a staging slot and a copy (`Some(usize::MAX)` = always stage). `None`
    /// = [`default_register_threshold`] of the provider in use. A slice of a
    /// [`Client::register_buffer`] buffer counts as plain memory here;
    /// [`File::read_registered`] into such a buffer always lands directly
    /// (cached registration).
    pub register_threshold: Option<usize>,
    /// Bounds of the registration cache of [`Client::register_buffer`]
    /// buffers: bytes and entries registered at once (least recently used
    /// registrations are dropped past them).
    pub reg_cache_bytes: usize,
    pub reg_cache_entries: usize,
    /// RDMA connections to open over the transports both hosts share
    /// (seed 000 claim 9): each file is registered on one of them, in
    /// turn, so several cores or NICs carry one client's I/O. When one is
    /// lost while another works, its files move to another channel without
    /// a reconnect (a failover, [`Client::failovers`]; docs/reconnect.md).
    /// Default 1.
    pub channels: usize,
    /// Per-request timeout; also the bound on a call's wait for a
    /// reconnect (docs/reconnect.md).
    pub op_timeout: Duration,
    /// Reconnect on its own when the RDMA connection or the side channel
    /// drops, take the open files back (durable handles, or reopen by path
    /// after a server restart) and send unanswered requests again
    /// (docs/reconnect.md). Off: a lost connection fails every call.
    pub reconnect: bool,
    pub connect_timeout: Duration,
    pub client_name: String,
    pub rdma: lwio_rdma::Config,
    /// How [`Client::connect`] secures the side channel. `None` (the
    /// default): as the `lwio` CLI does — TLS, trusted on first use in
    /// known_hosts or verified by the system roots ([`connect`]), which is
    /// what a default `lwio serve` speaks. `Some(ClientTls::Off)` for a
    /// server with `tls = false` (the test kit's `LocalServer`).
    pub tls: Option<lwio_side::ClientTls>,
}

impl ClientOptions {
    /// These options over plain TCP, for a server with `tls = false` (the
    /// test kit's `LocalServer`): [`ClientOptions::tls`] `Some(ClientTls::Off)`.
    pub fn no_tls(self) -> ClientOptions {
        ClientOptions {
            tls: Some(ClientTls::Off),
            ..self
        }
    }
}

impl Default for ClientOptions {
    fn default() -> Self {
        ClientOptions {
            completion: Completion::Interrupt,
            provider: ProviderChoice::Auto,
            device: None,
            credits: 16,
            max_credits: 255,
            read_chunk: 128 * 1024,
            stage_slots: 16,
            write_chunk: 16 * 1024,
            send_slots: 64,
            poll_spin: Duration::from_micros(200),
            busy_poll: Duration::from_micros(50),
            register_threshold: None,
            reg_cache_bytes: 256 << 20,
            reg_cache_entries: 64,
            channels: 1,
            op_timeout: Duration::from_secs(30),
            reconnect: true,
            connect_timeout: Duration::from_secs(10),
            client_name: lwio_side::host_name(),
            // The soft provider's receive work runs in the thread that
            // waits for a completion (or in the progress thread when nobody
            // waits): no engine thread between the socket and the caller.
            rdma: lwio_rdma::Config {
                progress: lwio_rdma::Progress::Manual,
                ..lwio_rdma::Config::default()
            },
            tls: None,
        }
    }
}

/// How to open a file (mirrors `std::fs::OpenOptions`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OpenOptions(pub lwio_side::types::OpenOptions);

impl OpenOptions {
    pub fn read_only() -> OpenOptions {
        OpenOptions(lwio_side::types::OpenOptions::READ)
    }
    pub fn read_write() -> OpenOptions {
        OpenOptions(lwio_side::types::OpenOptions::READ_WRITE)
    }
    pub fn create(mut self, on: bool) -> Self {
        self.0.create = on;
        self
    }
    pub fn truncate(mut self, on: bool) -> Self {
        self.0.truncate = on;
        self
    }
    pub fn exclusive(mut self, on: bool) -> Self {
        self.0.exclusive = on;
        self
    }
    /// FILE_NO_INTERMEDIATE_BUFFERING: `O_DIRECT` at the server; also what
    /// makes VEC_WRITE with COLLAPSE legal.
    pub fn no_buffering(mut self, on: bool) -> Self {
        self.0.no_buffering = on;
        self
    }
    /// `O_DSYNC` at the server: each write's data is on storage when it
    /// completes.
    pub fn write_through(mut self, on: bool) -> Self {
        self.0.write_through = on;
        self
    }
    /// `O_SYNC` at the server: as `write_through`, and the metadata the
    /// write changed (e.g. times) too.
    pub fn sync(mut self, on: bool) -> Self {
        self.0.sync = on;
        self
    }
}

pub(crate) struct Inner {
    pub(crate) side: Mutex<Option<crate::side::Client>>,
    /// The RDMA channels, channel 0 first ([`ClientOptions::channels`]);
    /// a reconnect replaces them all.
    pub(crate) engines: RwLock<Vec<Arc<Engine>>>,
    /// Round-robin channel choice for `open`.
    next_channel: std::sync::atomic::AtomicUsize,
    export: Option<String>,
    pub(crate) server_name: String,
    /// Where and how the side channel was reached (for a second connection:
    /// the lease-break watcher).
    pub(crate) authority: String,
    pub(crate) side_opts: crate::side::ClientOptions,
    /// How the data path was chosen (for a [`handoff::Handoff`]).
    pub(crate) provider_choice: ProviderChoice,
    pub(crate) device: Option<String>,
    /// The negotiate Key of each channel, channel 0 first: the server knows
    /// a channel by it (a publication names the channel that carries it).
    pub(crate) channel_keys: RwLock<Vec<lwio_proto::wire::Guid>>,
    /// The options connected with (a reconnect dials with them again).
    pub(crate) opts: ClientOptions,
    /// Bumped by every reconnect: a file registered at an older epoch
    /// registers again before its next request.
    pub(crate) epoch: AtomicU64,
    /// Bumped when a reconnect found the server's state gone (a restart):
    /// files opened before reopen by path and check their identity.
    pub(crate) reset: AtomicU64,
    pub(crate) reconnects: AtomicU64,
    /// RDMA channels lost and failed over to another channel without a
    /// reconnect (docs/reconnect.md, multichannel failover).
    pub(crate) failovers: AtomicU64,
    /// One reconnect (or failover) at a time.
    pub(crate) recon: Mutex<()>,
}

impl Inner {
    /// Every RDMA channel, channel 0 first (the current connections).
    pub(crate) fn channels(&self) -> Vec<Arc<Engine>> {
        self.engines
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Channel `n` (0 = the first; past the last: channel 0).
    pub(crate) fn channel(&self, n: usize) -> Arc<Engine> {
        let g = self.engines.read().unwrap_or_else(|p| p.into_inner());
        g.get(n).unwrap_or(&g[0]).clone()
    }

    /// The first channel from `from` on (wrapping around) whose
    /// connection is not lost, if any.
    pub(crate) fn live_channel(&self, from: usize) -> Option<usize> {
        let g = self.engines.read().unwrap_or_else(|p| p.into_inner());
        let n = g.len();
        (0..n)
            .map(|i| (from + i) % n)
            .find(|&i| g[i].lost().is_none())
    }

    pub(crate) fn channel_count(&self) -> usize {
        self.engines.read().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Run a side-channel call once (no reconnect).
    pub(crate) fn side_once<T>(
        &self,
        f: impl FnOnce(&mut crate::side::Client) -> lwio_side::Result<T>,
    ) -> Result<T> {
        let mut g = self.side.lock().unwrap_or_else(|p| p.into_inner());
        match g.as_mut() {
            Some(c) => Ok(f(c)?),
            None => Err(Error::ConnectionLost("side channel closed".into())),
        }
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        for e in self.channels() {
            e.shutdown();
        }
        // The blocking side-channel client owns a tokio runtime, which must
        // not be dropped inside an async context (the async API's last
        // handle may go away there).
        let side = self.side.lock().unwrap_or_else(|p| p.into_inner()).take();
        if tokio::runtime::Handle::try_current().is_ok() {
            let _ = std::thread::Builder::new()
                .name("lwio-side-close".into())
                .spawn(move || drop(side));
        } else {
            drop(side);
        }
    }
}

/// A connected client (blocking API). Cheap to share: `File`s keep it alive.
#[derive(Clone)]
pub struct Client(pub(crate) Arc<Inner>);

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("server", &self.0.server_name)
            .field("provider", &self.0.channel(0).provider())
            .field("completion", &self.0.channel(0).cfg.completion)
            .finish()
    }
}

fn parse_target(target: &str) -> Result<(String, String, Option<String>)> {
    if target.starts_with("lwio://") {
        let u = LwioUrl::parse(target).map_err(|e| Error::InvalidArgument(e.to_string()))?;
        return Ok((u.authority(), u.host.clone(), u.export.clone()));
    }
    let (host, authority) = if target.starts_with('[') || target.matches(':').count() == 1 {
        let h = target.rsplit_once(':').map_or(target, |(h, _)| h);
        (h.trim_matches(['[', ']']).to_string(), target.to_string())
    } else if target.contains(':') {
        (target.to_string(), format!("[{target}]:{DEFAULT_PORT}"))
    } else {
        (target.to_string(), format!("{target}:{DEFAULT_PORT}"))
    };
    Ok((authority, host, None))
}

impl Client {
    /// Run a call on this client's side-channel session: the namespace
    /// operations (stat, list, mkdir, rename, remove) that do not move data.
    ///
    /// A call that finds the connection lost reconnects and runs again
    /// ([`ClientOptions::reconnect`]; docs/reconnect.md says which calls
    /// can then fail although their first try took effect).
    pub fn side<T>(
        &self,
        f: impl FnMut(&mut crate::side::Client) -> lwio_side::Result<T>,
    ) -> Result<T> {
        self.0.side(f)
    }

    /// Reconnects so far (each one logged at info: "reconnected").
    pub fn reconnects(&self) -> u64 {
        self.0.reconnects.load(Ordering::Relaxed)
    }

    /// RDMA channels lost and failed over so far: their files moved to
    /// another channel of this client without a reconnect (each one logged
    /// at info: "RDMA channel failed over"; docs/reconnect.md).
    pub fn failovers(&self) -> u64 {
        self.0.failovers.load(Ordering::Relaxed)
    }

    /// Connect to `target` (`lwio://HOST[:PORT][/EXPORT]` or `HOST[:PORT]`)
    /// with a token; `None`: the default login (`LWIO_TOKEN`, else the
    /// default token file if it exists, else anonymous). The side channel
    /// is secured as [`ClientOptions::tls`] says: by default as the `lwio`
    /// CLI does ([`connect`] module), so a default `lwio serve` (TLS with a
    /// self-signed certificate) is trusted on first use.
    pub fn connect(target: &str, token: Option<&str>, opts: ClientOptions) -> Result<Client> {
        let args = connect::ConnectArgs {
            token: token.map(str::to_string),
            connect_timeout: Some(opts.connect_timeout),
            ..connect::ConnectArgs::default()
        };
        let mut so = crate::side::ClientOptions::new(connect::resolve_login(&args)?);
        so.tls = match &opts.tls {
            Some(t) => t.clone(),
            None => connect::resolve_tls(&args)?,
        };
        so.client_name = opts.client_name.clone();
        so.connect_timeout = opts.connect_timeout;
        Client::connect_with(target, &so, opts)
    }

    /// [`Client::connect`] with full side-channel options (any login, TLS):
    /// what the `lwio` CLI uses.
    pub fn connect_with(
        target: &str,
        so: &crate::side::ClientOptions,
        opts: ClientOptions,
    ) -> Result<Client> {
        let (authority, _, export) = parse_target(target)?;
        let mut side = crate::side::Client::connect(&authority, so)?;
        let (engines, server_name, channel_keys) = dial_all(&mut side, &authority, &opts)?;
        Ok(Client(Arc::new(Inner {
            side: Mutex::new(Some(side)),
            engines: RwLock::new(engines),
            next_channel: std::sync::atomic::AtomicUsize::new(0),
            export,
            server_name,
            authority,
            side_opts: so.clone(),
            provider_choice: opts.provider,
            device: opts.device.clone(),
            channel_keys: RwLock::new(channel_keys),
            opts,
            epoch: AtomicU64::new(0),
            reset: AtomicU64::new(0),
            reconnects: AtomicU64::new(0),
            failovers: AtomicU64::new(0),
            recon: Mutex::new(()),
        })))
    }

    /// Open a second side-channel connection, logged in as this client,
    /// that carries this session's directory lease breaks
    /// (docs/leases.md). Read breaks with
    /// [`side::Client::next_break`](crate::side::Client::next_break) and
    /// answer each with `ack_break`; leases are granted only while it is
    /// open.
    pub fn watch_breaks(&self) -> Result<crate::side::Client> {
        let main = self.0.side(|s| Ok(s.session().clone()))?;
        let mut w = crate::side::Client::connect(&self.0.authority, &self.0.side_opts)?;
        w.watch(&main)?;
        Ok(w)
    }

    /// Open a file: `EXPORT/PATH`, or `PATH` when the URL named the export.
    pub fn open(&self, path: &str, o: &OpenOptions) -> Result<File> {
        self.open_mode(path, o, 0o644)
    }

    /// [`Client::open`] with the permission bits a created file gets (before
    /// the server's umask).
    pub fn open_mode(&self, path: &str, o: &OpenOptions, mode: u32) -> Result<File> {
        self.open_as(path, o, mode, None)
    }

    /// [`Client::open_mode`] on behalf of `caller` (the ids an `identity =
    /// "client"` export acts as: docs/mount.md, "Identities"); a reopen
    /// after a server restart carries them too.
    pub fn open_as(
        &self,
        path: &str,
        o: &OpenOptions,
        mode: u32,
        caller: Option<lwio_side::types::Creds>,
    ) -> Result<File> {
        let (export, rel) = self.split(path)?;
        let inner = &self.0;
        let channel = inner
            .next_channel
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        // Opened over the side channel, then registered on an RDMA channel;
        // a connection lost in between reconnects and opens again.
        let (route, file_id) = inner.retry(|| {
            let epoch = inner.epoch.load(Ordering::Acquire);
            let reset = inner.reset.load(Ordering::Acquire);
            let rf = inner.side_once(|s| {
                s.as_caller(caller.as_ref(), |s| s.open(&export, &rel, &o.0, mode))
            })?;
            let r = reconnect::register(inner, channel, &rf, o.0.no_buffering, epoch, reset)
                .inspect_err(|_| {
                    let _ = inner.side_once(|s| s.close(rf.handle));
                })
                .map_err(|e| match e {
                    Error::Status { status, .. } => {
                        status_error(format!("REGISTER of {export}/{rel}"), status)
                    }
                    e => e,
                })?;
            Ok((r, rf.file_id))
        })?;
        Ok(File {
            client: self.clone(),
            route: Mutex::new(route),
            export,
            path: rel,
            open: o.0,
            mode,
            caller,
            file_id,
            no_buffering: o.0.no_buffering,
            closed: false,
        })
    }

    fn split(&self, path: &str) -> Result<(String, String)> {
        let path = path.trim_start_matches('/');
        match &self.0.export {
            Some(e) => Ok((e.clone(), path.to_string())),
            None => match path.split_once('/') {
                Some((e, p)) => Ok((e.to_string(), p.to_string())),
                None => Err(Error::InvalidArgument(format!(
                    "{path:?}: expected EXPORT/PATH"
                ))),
            },
        }
    }

    /// The export named by the URL this client connected to, if any.
    pub fn export(&self) -> Option<&str> {
        self.0.export.as_deref()
    }

    /// Send INTERRUPT and return when the server answers it (after the next
    /// I/O request on this connection completes).
    pub fn interrupt(&self) -> Result<()> {
        self.0.channel(0).interrupt()
    }

    /// Statistics of channel 0 (see [`Client::channel_stats`]).
    pub fn stats(&self) -> ClientStats {
        self.0.channel(0).stats()
    }

    /// How many RDMA channels this client holds ([`ClientOptions::channels`]).
    pub fn channels(&self) -> usize {
        self.0.channel_count()
    }

    /// Every RDMA channel's engine, channel 0 first.
    pub fn engines(&self) -> Vec<Arc<Engine>> {
        self.0.channels()
    }

    /// Statistics of channel `n`, if it exists.
    pub fn channel_stats(&self, n: usize) -> Option<ClientStats> {
        (n < self.channels()).then(|| self.0.channel(n).stats())
    }

    /// Restart the `max_outstanding` high-water mark of [`ClientStats`].
    pub fn reset_peak(&self) {
        self.0.channel(0).reset_peak()
    }

    pub fn credits(&self) -> u16 {
        self.0.channel(0).credits()
    }

    pub fn provider(&self) -> &'static str {
        self.0.channel(0).provider()
    }

    pub fn completion(&self) -> Completion {
        self.0.channel(0).cfg.completion
    }

    /// The RDMA engine of channel 0 (for tools and tests that issue raw
    /// requests): the current connection (a reconnect replaces it).
    pub fn engine(&self) -> Arc<Engine> {
        self.0.channel(0)
    }
}

/// Negotiate and connect every RDMA channel of `opts` over a logged-in side
/// channel: (channels, the server's name, each channel's negotiate Key).
#[allow(clippy::type_complexity)]
pub(crate) fn dial_all(
    side: &mut crate::side::Client,
    authority: &str,
    opts: &ClientOptions,
) -> Result<(Vec<Arc<Engine>>, String, Vec<lwio_proto::wire::Guid>)> {
    let session = side.session().clone();
    let side_ip: Option<IpAddr> = (authority, 0)
        .to_socket_addrs()
        .ok()
        .or_else(|| authority.to_socket_addrs().ok())
        .and_then(|mut a| a.next())
        .map(|a| a.ip());
    // Negotiate over the pipe: offer every local instance the options
    // allow, by wire transport (docs/protocol.md §2.8).
    let cands = discovery::local_candidates(opts.provider, opts.device.as_deref(), side_ip);
    let offered: Vec<_> = cands.iter().map(|c| c.instance).collect();
    let client_key = lwio_side::negotiate::random_guid();
    let req = NegotiateRequestRepr {
        client_name: truncate_name(&opts.client_name),
        key: client_key,
        response_length: 4096,
        providers: lwio_proto::transport::to_blocks(&offered),
    };
    let cfg = EngineConfig {
        completion: opts.completion,
        credits: opts.credits,
        max_credits: opts.max_credits,
        read_chunk: opts.read_chunk.next_multiple_of(4096).max(4096),
        stage_slots: opts.stage_slots.max(1),
        write_chunk: opts.write_chunk.max(512),
        send_slots: opts.send_slots,
        poll_spin: opts.poll_spin,
        busy_poll: opts.busy_poll,
        op_timeout: opts.op_timeout,
        auth_timeout: opts.connect_timeout,
        register_threshold: usize::MAX,
        reg_cache_bytes: opts.reg_cache_bytes,
        reg_cache_entries: opts.reg_cache_entries,
    };
    let mut dial = Dial {
        cands: &cands,
        opened: Vec::new(),
        opts,
        cfg,
        side_ip,
        client_key,
    };
    // Channel 0, then (claim 9) the other channels: each negotiates a
    // Key of its own (the server takes each Key once) and starts at
    // another shared path where there are several.
    let (engine, server_name, key0) = dial.channel(side, &req, &session, 0)?;
    let mut engines = vec![engine];
    let mut channel_keys = vec![key0];
    for n in 1..opts.channels.max(1) {
        let req = NegotiateRequestRepr {
            key: client_key,
            ..req.clone()
        };
        let (e, _, k) = dial.channel(side, &req, &session, n)?;
        engines.push(e);
        channel_keys.push(k);
    }
    Ok((engines, server_name, channel_keys))
}

fn truncate_name(s: &str) -> String {
    let mut out = String::new();
    for c in s.chars() {
        if out.encode_utf16().count() + c.len_utf16() > 63 || c == '\0' {
            break;
        }
        out.push(c);
    }
    if out.is_empty() {
        "lwio-client".into()
    } else {
        out
    }
}

/// Connecting RDMA channels over the paths negotiate found.
struct Dial<'a> {
    cands: &'a [discovery::Candidate],
    /// Devices opened so far (index into `cands`).
    opened: Vec<(usize, lwio_rdma::Context)>,
    opts: &'a ClientOptions,
    cfg: EngineConfig,
    side_ip: Option<IpAddr>,
    client_key: lwio_proto::wire::Guid,
}

impl Dial<'_> {
    /// Negotiate and connect channel `n`: the best shared path first (for
    /// n > 0 rotated by n, so channels spread over several paths), until one
    /// connects and authenticates.
    fn channel(
        &mut self,
        side: &mut crate::side::Client,
        req: &NegotiateRequestRepr,
        session: &crate::side::Session,
        n: usize,
    ) -> Result<(Arc<Engine>, String, lwio_proto::wire::Guid)> {
        let resp = match side.negotiate(req) {
            Ok(r) => r,
            Err(e)
                if e.message
                    .starts_with(lwio_side::negotiate::NO_COMMON_TRANSPORT) =>
            {
                return Err(Error::NoCommonTransport(e.message));
            }
            Err(e) => return Err(e.into()),
        };
        let server = lwio_proto::transport::from_blocks(&resp.providers);
        let secret =
            lwio_proto::wire::auth::derive_session_secret(&session.secret.0, &resp.key).to_vec();
        let mut paths = discovery::paths(self.cands, &server, self.side_ip);
        if paths.is_empty() {
            return Err(Error::NoCommonTransport(format!(
                "{}: the client offers {}, the server offers {}",
                lwio_side::negotiate::NO_COMMON_TRANSPORT,
                discovery::describe_local(self.cands),
                lwio_proto::transport::describe(&server, true)
            )));
        }
        let k = n % paths.len();
        paths.rotate_left(k);
        let mut last: Option<Error> = None;
        for (ci, addr) in paths {
            let cand = &self.cands[ci];
            let ctx = match self.opened.iter().find(|(i, _)| *i == ci) {
                Some((_, c)) => c.clone(),
                None => match cand.provider.open(Some(&cand.device.name), &self.opts.rdma) {
                    Ok(c) => {
                        self.opened.push((ci, c.clone()));
                        c
                    }
                    Err(e) => {
                        debug!(device = %cand.device.name, error = %e, "device not usable here");
                        last = Some(e.into());
                        continue;
                    }
                },
            };
            let mut cfg = self.cfg.clone();
            cfg.register_threshold = self
                .opts
                .register_threshold
                .unwrap_or_else(|| default_register_threshold(cand.provider.name()))
                .max(engine::BOUNCE_THRESHOLD);
            match Engine::connect(&ctx, addr, resp.key, secret.clone(), cfg) {
                Ok(engine) => {
                    info!(
                        server = %resp.server_name,
                        %addr,
                        channel = n,
                        provider = cand.provider.name(),
                        device = %cand.device.name,
                        transport = %cand.instance.transport,
                        client_uuid = %self.client_key,
                        "connected"
                    );
                    return Ok((engine, resp.server_name.clone(), resp.key));
                }
                Err(e @ Error::AccessDenied(_)) => return Err(e),
                Err(e) => {
                    debug!(%addr, device = %cand.device.name, error = %e, "RDMA connect failed");
                    last = Some(e);
                }
            }
        }
        Err(last.unwrap_or_else(|| Error::NoCommonTransport("no usable RDMA path".into())))
    }
}

/// Where a read's data goes: copied out of staging into the caller's
/// slice, or written directly into registered caller memory.
enum ReadInto<'a> {
    Staged(&'a mut [u8]),
    User(&'a engine::UserDst),
}

/// A buffer whose registration the client caches (see
/// [`Client::register_buffer`]). It dereferences to `[u8]`.
/// [`File::read_registered`] reads into a range of it of at least 1 KiB
/// (`BOUNCE_THRESHOLD`) directly, with no per-call registration and no copy,
/// and without a `&mut [u8]` over the bytes the peer writes. A `read_at`
/// into a slice of it is read as into any slice (staged, or registered for
/// the call from `ClientOptions::register_threshold` up): the cached
/// registration is never used behind a Rust reference. Dropping it releases
/// the registration.
pub struct RegisteredBuf {
    mem: Arc<lwio_rdma::RegBuf>,
    len: usize,
    /// Every channel's registration cache holds it.
    engines: Vec<std::sync::Weak<Engine>>,
}

impl RegisteredBuf {
    /// The buffer's length, without forming a slice over its bytes (which
    /// a read through another handle may be placing).
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether the buffer is empty (never: `register_buffer` refuses 0).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl std::fmt::Debug for RegisteredBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RegisteredBuf({} bytes)", self.len)
    }
}

impl std::ops::Deref for RegisteredBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: the allocation (page-aligned, zero-initialised, at least
        // `len` bytes) is owned by `mem` and alive while `self` is. Nothing
        // writes it while this shared view lives: the region's own key is
        // never sent, and the peer can write it only through a window bound
        // for a read into it, which needs a `&mut [u8]` of it (so this
        // shared borrow has ended) and returns only after every such window
        // is invalidated. (During such a read the caller's `&mut` is live
        // while the peer writes; see the SAFETY note in `File::read_impl`.)
        unsafe { std::slice::from_raw_parts(self.mem.as_ptr(), self.len) }
    }
}

impl std::ops::DerefMut for RegisteredBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`; `&mut self` makes this view exclusive among
        // Rust references, and no remote write is possible while it lives
        // unless it is handed to a read (see `File::read_impl`).
        unsafe { std::slice::from_raw_parts_mut(self.mem.as_ptr(), self.len) }
    }
}

impl Drop for RegisteredBuf {
    fn drop(&mut self) {
        // Explicit release: the cache entry (and its registration) goes.
        // Even without it the entry would keep the memory alive.
        for e in self.engines.iter().filter_map(|e| e.upgrade()) {
            e.cache_release(self.mem.as_ptr() as usize);
        }
    }
}

impl Client {
    /// Allocate a zeroed buffer of `len` bytes and register it in the
    /// client's registration cache: large reads into it with
    /// [`File::read_registered`] skip both the per-call registration and the
    /// staging copy, and large writes from it skip the copy into send
    /// slots. The registration lives
    /// until the buffer is dropped (or, past the cache bounds, is evicted
    /// and redone on the next use).
    pub fn register_buffer(&self, len: usize) -> Result<RegisteredBuf> {
        let mem = lwio_rdma::RegBuf::new(len.max(1).next_multiple_of(4096))?;
        let mem = Arc::new(mem);
        for e in self.0.channels() {
            e.cache_insert(mem.clone())?;
        }
        Ok(RegisteredBuf {
            mem,
            len,
            engines: self.0.channels().iter().map(Arc::downgrade).collect(),
        })
    }
}

/// An open, registered file. After a reconnect it registers again before
/// its next request (docs/reconnect.md).
pub struct File {
    client: Client,
    /// Where the file is registered now (channel, Fid, handle).
    route: Mutex<reconnect::Route>,
    export: String,
    path: String,
    /// How it was opened (a reopen by path after a server restart uses the
    /// same access, never create, truncate or exclusive).
    open: lwio_side::types::OpenOptions,
    mode: u32,
    /// Whose ids it was opened with (a reopen uses them again).
    caller: Option<lwio_side::types::Creds>,
    /// The server's identity of the file (0 = unknown).
    file_id: u64,
    no_buffering: bool,
    closed: bool,
}

impl std::fmt::Debug for File {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "File({}/{}, fid {})", self.export, self.path, self.fid())
    }
}

impl File {
    /// The Fid the file has on its RDMA connection (a reconnect changes it).
    pub fn fid(&self) -> u16 {
        self.now().fid
    }

    /// The engine of the channel this file is registered on (for callers
    /// that issue and reap requests themselves, as the C batch API does),
    /// with its Fid there. After a lost connection this registers the file
    /// on the new one first (waiting for the reconnect, up to `op_timeout`).
    pub fn channel_engine(&self) -> Arc<Engine> {
        self.now().engine
    }

    /// The engine and Fid to issue requests on, registered on the current
    /// connection (after a reconnect, waiting for it up to `op_timeout`).
    pub fn current(&self) -> Result<(Arc<Engine>, u16)> {
        self.retry(|r| Ok((r.engine.clone(), r.fid)))
    }

    /// The route as it stands (no re-registration).
    fn now(&self) -> reconnect::Route {
        self.route.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The route as it stands, or `None` while another thread holds it to
    /// renew it (a re-registration, a failover: side-channel calls that
    /// can take as long as the server does). Async callers use this: a
    /// runtime thread must not block on that lock.
    fn try_now(&self) -> Option<reconnect::Route> {
        match self.route.try_lock() {
            Ok(g) => Some(g.clone()),
            Err(std::sync::TryLockError::Poisoned(p)) => Some(p.into_inner().clone()),
            Err(std::sync::TryLockError::WouldBlock) => None,
        }
    }

    /// fstat(2) of the open file, from the server (by its handle).
    pub fn stat(&self) -> Result<lwio_side::types::AttrX> {
        self.retry(|r| self.client.0.side_once(|s| s.stat_handle(r.handle)))
    }

    /// The RDMA channel this file's requests use (0 = the first).
    pub fn channel(&self) -> usize {
        self.now().channel
    }

    /// Read into `buf` at `offset`; returns the bytes read (short only at end
    /// of file; 0 at or past it).
    pub fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<usize> {
        self.retry(|r| self.read_impl(r, buf, offset, false))
    }

    /// Read `range` of a registered buffer at `offset`, directly into the
    /// buffer from 1 KiB up through its cached registration (no copy, no
    /// per-call registration), without a `&mut [u8]` over the bytes while
    /// the peer writes them: the pointer comes from the buffer's own
    /// memory, as its registration's does. (`read_at(&mut buf[range], ..)`
    /// reads the same bytes but never through the cached registration.)
    /// Returns the bytes read (short only at end of file; 0 at or past it).
    pub fn read_registered(
        &self,
        buf: &mut RegisteredBuf,
        range: std::ops::Range<usize>,
        offset: u64,
    ) -> Result<usize> {
        let len = range.end.checked_sub(range.start).ok_or_else(|| {
            Error::InvalidArgument(format!("range {range:?} ends before it starts"))
        })?;
        if range.end > buf.len {
            return Err(Error::InvalidArgument(format!(
                "range {range:?} outside a buffer of {} bytes",
                buf.len
            )));
        }
        if len == 0 {
            return Ok(0);
        }
        offset
            .checked_add(len as u64)
            .ok_or_else(|| Error::InvalidArgument("offset + length overflows".into()))?;
        self.retry(|r| self.read_registered_once(r, buf, range.clone(), offset))
    }

    fn read_registered_once(
        &self,
        r: &reconnect::Route,
        buf: &mut RegisteredBuf,
        range: std::ops::Range<usize>,
        offset: u64,
    ) -> Result<usize> {
        let len = range.len();
        let e = &*r.engine;
        if len >= engine::BOUNCE_THRESHOLD {
            // In bounds (checked above), so no wrap.
            let ptr = buf.mem.as_ptr().wrapping_add(range.start);
            // SAFETY: `buf` is exclusively borrowed for the whole call, so no
            // Rust reference to its memory exists meanwhile (the buffer hands
            // them out only through `&self`/`&mut self`), and none is formed
            // here: `ptr` comes from the `RegBuf`'s own pointer, like the
            // cached registration the peer writes through, so the peer's
            // writes alias no live reference. Every window over the range is
            // one-shot and `fence_group` returns only once all are
            // invalidated and completed (or the QP is in error); the cache
            // entry keeps the memory alive.
            let dst = unsafe { e.user_dst(ptr, len, false) };
            if let Some(x) = self.read_direct(r, dst, len, offset, false) {
                return x;
            }
        }
        // Staged: no window covers the buffer, so a slice of it is fine.
        let slice = &mut buf[range];
        self.read_chunks(r, len, offset, false, ReadInto::Staged(slice))
    }

    fn read_impl(
        &self,
        r: &reconnect::Route,
        buf: &mut [u8],
        offset: u64,
        vectored: bool,
    ) -> Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        offset
            .checked_add(buf.len() as u64)
            .ok_or_else(|| Error::InvalidArgument("offset + length overflows".into()))?;
        let e = &*r.engine;
        if buf.len() >= engine::BOUNCE_THRESHOLD {
            let (ptr, len) = (buf.as_mut_ptr(), buf.len());
            let per_call = len >= e.cfg.register_threshold;
            // SAFETY: `ptr` is derived from `buf`, exclusively borrowed for
            // this whole call and not used until we return. `slice_dst`
            // registers it for this call (or gives `None`, and we stage),
            // never through the registration cache, so every write the peer
            // makes goes through a pointer derived from `buf`, as Stacked and
            // Tree Borrows allow while `buf` itself is not used. Every window
            // over it is bound one-shot for exactly one request's range
            // inside it, and `read_direct` fences the group before it
            // returns (or the queue pair is in the error state, where no
            // remote access is executed); the per-call registration is
            // dropped there too, so no remote write reaches the buffer after
            // the borrow ends. A slice of a `RegisteredBuf` is read the same
            // way; `File::read_registered` is its zero-copy path through the
            // cached registration.
            let dst = unsafe { e.slice_dst(ptr, len, per_call) };
            if let Some(x) = self.read_direct(r, dst, len, offset, vectored) {
                return x;
            }
        }
        let len = buf.len();
        self.read_chunks(r, len, offset, vectored, ReadInto::Staged(buf))
    }

    /// Read `len` bytes at `offset` straight into the caller memory that
    /// `Engine::user_dst` returned, fenced before this returns; `None` when
    /// it returned none (or failed): the caller stages instead.
    fn read_direct(
        &self,
        r: &reconnect::Route,
        dst: Result<Option<engine::UserDst>>,
        len: usize,
        offset: u64,
        vectored: bool,
    ) -> Option<Result<usize>> {
        match dst {
            Ok(None) => None,
            Ok(Some(dst)) => {
                let x = self.read_chunks(r, len, offset, vectored, ReadInto::User(&dst));
                r.engine.fence_group(dst.group());
                drop(dst);
                Some(x)
            }
            Err(err) => {
                debug!(error = %err, len, "cannot register the caller's buffer; staging");
                None
            }
        }
    }

    fn read_chunks(
        &self,
        r: &reconnect::Route,
        blen: usize,
        offset: u64,
        vectored: bool,
        mut into: ReadInto,
    ) -> Result<usize> {
        let (e, fid) = (&*r.engine, r.fid);
        let page = e.client_page_size();
        // Into registered caller memory a READ is one request up to the
        // server's MAX_MESSAGE (VEC_READ stays within the window).
        let chunk = match into {
            ReadInto::User(_) if !vectored => e.max_read_direct(),
            _ => e.max_read(),
        };
        let depth = match into {
            ReadInto::User(_) => usize::from(e.credits()).max(1),
            ReadInto::Staged(_) => usize::from(e.credits()).clamp(1, e.cfg.stage_slots),
        };
        let mut pending = std::collections::VecDeque::new();
        let mut issued = 0usize;
        let mut total = 0usize;
        let mut stop: Option<Result<usize>> = None;
        loop {
            while stop.is_none() && issued < blen && pending.len() < depth {
                let len = chunk.min(blen - issued);
                // VEC_READ needs a last region that is a multiple of 512.
                let vec = (vectored && len.is_multiple_of(512)).then_some(page);
                let dst = match &into {
                    ReadInto::User(d) => Some((*d, issued)),
                    ReadInto::Staged(_) => None,
                };
                match e.issue_read_to(fid, offset + issued as u64, len, vec, dst) {
                    Ok((req, stage)) => {
                        let slot = if e.cfg.completion == Completion::Poll {
                            e.slot_of(req)
                        } else {
                            None
                        };
                        pending.push_back((req, slot, stage, issued, len));
                        issued += len;
                    }
                    Err(err) => stop = Some(Err(err)),
                }
            }
            let Some((req, slot, stage, at, len)) = pending.pop_front() else {
                break;
            };
            let w = e.wait(req, slot);
            self.read_outcome(e, w, stage, at, len, &mut total, &mut stop, |stage, n| {
                if let ReadInto::Staged(buf) = &mut into {
                    e.finish_stage(stage, &mut buf[at..at + n]);
                }
            });
        }
        stop.unwrap_or(Ok(total))
    }

    /// Account one READ request's completion, for bytes `at..at + len` of
    /// the call: data that continues the call's `total` goes to `land`
    /// (with the request's stage, which it takes); otherwise the stage is
    /// given back, and the end of the call (EOF, a short read, the first
    /// error) goes to `stop`. The engine keeps (and frees) the stage of an
    /// abandoned request (`Err`).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn read_outcome(
        &self,
        e: &Engine,
        r: Result<(u32, NtStatus)>,
        stage: engine::Stage,
        at: usize,
        len: usize,
        total: &mut usize,
        stop: &mut Option<Result<usize>>,
        land: impl FnOnce(engine::Stage, usize),
    ) {
        match r {
            Ok((n, STATUS_SUCCESS)) => {
                let n = (n as usize).min(len);
                if stop.is_none() && at == *total {
                    land(stage, n);
                    *total += n;
                    if n < len {
                        *stop = Some(Ok(*total));
                    }
                } else {
                    e.release_stage(stage);
                }
            }
            Ok((_, STATUS_END_OF_FILE)) => {
                e.release_stage(stage);
                stop.get_or_insert(Ok(*total));
            }
            Ok((_, st)) => {
                e.release_stage(stage);
                stop.get_or_insert_with(|| {
                    Err(status_error(
                        format!("READ of {}/{}", self.export, self.path),
                        st,
                    ))
                });
            }
            Err(err) => {
                stop.get_or_insert(Err(err));
            }
        }
    }

    /// Vectored read (VEC_READ, each page exposed through its own one-shot
    /// window) into several buffers.
    pub fn read_vectored_at(&self, bufs: &mut [IoSliceMut<'_>], offset: u64) -> Result<usize> {
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        let mut tmp = vec![0u8; total];
        let n = self.retry(|r| self.read_impl(r, &mut tmp, offset, true))?;
        let mut o = 0;
        for b in bufs.iter_mut() {
            if o >= n {
                break;
            }
            let k = b.len().min(n - o);
            b[..k].copy_from_slice(&tmp[o..o + k]);
            o += k;
        }
        Ok(n)
    }

    /// Write all of `buf` at `offset` (split into WRITE requests of the
    /// server's MaxRecvBufferSize, pipelined up to the credits).
    ///
    /// A request the lost connection left unanswered is sent again after
    /// the reconnect, before this returns (docs/reconnect.md, ordering).
    pub fn write_at(&self, buf: &[u8], offset: u64) -> Result<usize> {
        self.retry(|r| self.write_impl(r, buf, offset, false))
    }

    /// Vectored write: VEC_WRITE (without COLLAPSE).
    pub fn write_vectored_at(&self, bufs: &[IoSlice<'_>], offset: u64) -> Result<usize> {
        let data: Vec<u8> = bufs.iter().flat_map(|b| b.iter().copied()).collect();
        self.retry(|r| self.write_impl(r, &data, offset, true))
    }

    fn write_impl(
        &self,
        r: &reconnect::Route,
        buf: &[u8],
        offset: u64,
        vectored: bool,
    ) -> Result<usize> {
        offset
            .checked_add(buf.len() as u64)
            .ok_or_else(|| Error::InvalidArgument("offset + length overflows".into()))?;
        let (e, fid) = (&*r.engine, r.fid);
        let page = e.client_page_size();
        let mut chunk = e.max_write();
        if self.no_buffering && chunk >= usize::from(page) {
            // Unbuffered files need aligned pieces: whole pages per request.
            chunk -= chunk % usize::from(page);
        }
        // Larger than one request: fragmented messages (docs/protocol.md
        // §5.12), one request each — the whole write when it fits in one,
        // else messages of half the largest, so two are in flight.
        // Large writes go out from the caller's memory, registered (a
        // `RegisteredBuf`'s cached registration, or one for this call):
        // nothing is copied into send slots.
        let zero_copy = buf.len() > chunk && e.max_write_message(true) > chunk;
        // SAFETY: `buf` is borrowed for this whole call, and every send
        // from it is fenced (`fence_sends`) before the call returns.
        let src = if zero_copy {
            unsafe { e.write_source(buf, true) }.unwrap_or(None)
        } else {
            None
        };
        let msg_max = e.max_write_message(src.is_some());
        let plain = chunk;
        let mut message = false;
        if buf.len() > chunk && msg_max > chunk {
            message = true;
            chunk = if buf.len() <= msg_max {
                buf.len()
            } else {
                msg_max / 2
            };
            if self.no_buffering && chunk >= usize::from(page) && chunk < buf.len() {
                chunk -= chunk % usize::from(page);
            }
        }
        // Fewer credits than when the write was planned (the server took
        // back an idle connection's, before a message or while it waited to
        // go): smaller messages, or plain requests.
        let shrink = |chunk: &mut usize, message: &mut bool| {
            let fits = e.max_write_message(src.is_some());
            if fits > plain {
                *chunk = fits;
                if self.no_buffering && *chunk >= usize::from(page) {
                    *chunk -= *chunk % usize::from(page);
                }
            } else {
                *message = false;
                *chunk = plain;
            }
        };
        let depth = usize::from(e.credits()).max(1);
        let mut pending = std::collections::VecDeque::new();
        let mut issued = 0usize;
        let mut done = 0usize;
        let mut err: Option<Error> = None;
        loop {
            while err.is_none() && issued < buf.len() && pending.len() < depth {
                let len = chunk.min(buf.len() - issued);
                let data = &buf[issued..issued + len];
                let r = if message {
                    let sub = src.as_ref().map(|u| u.at(issued));
                    e.issue_write_message(
                        fid,
                        offset + issued as u64,
                        data,
                        vectored.then_some(page),
                        sub.as_ref(),
                    )
                } else if vectored {
                    e.issue_vec_write(fid, offset + issued as u64, page, len as u32, data, false)
                } else {
                    e.issue_write(fid, offset + issued as u64, data)
                };
                match r {
                    Ok(req) => {
                        let slot = if e.cfg.completion == Completion::Poll {
                            e.slot_of(req)
                        } else {
                            None
                        };
                        pending.push_back((req, slot, len));
                        issued += len;
                    }
                    Err(_) if message && e.max_write_message(src.is_some()) < len => {
                        shrink(&mut chunk, &mut message);
                    }
                    Err(x) => err = Some(x),
                }
            }
            let Some((req, slot, len)) = pending.pop_front() else {
                break;
            };
            self.write_outcome(e.wait(req, slot), len, &mut done, &mut err);
        }
        if let Some(u) = &src {
            e.fence_sends(u);
        }
        match err {
            Some(e) => Err(e),
            None => Ok(done),
        }
    }

    /// Account one WRITE request's completion: `len` bytes more `done`, or
    /// the first error.
    pub(crate) fn write_outcome(
        &self,
        r: Result<(u32, NtStatus)>,
        len: usize,
        done: &mut usize,
        err: &mut Option<Error>,
    ) {
        match r {
            Ok((n, STATUS_SUCCESS)) if n as usize == len => *done += len,
            Ok((n, STATUS_SUCCESS)) => {
                err.get_or_insert(Error::Io(format!("short write: {n} of {len} bytes")));
            }
            Ok((_, st)) => {
                err.get_or_insert(status_error(
                    format!("WRITE to {}/{}", self.export, self.path),
                    st,
                ));
            }
            Err(x) => {
                err.get_or_insert(x);
            }
        }
    }

    /// Write `page` repeated to fill `total` bytes at `offset` using
    /// VEC_WRITE with COLLAPSE (only the first page crosses the wire) when
    /// legal — file opened with `no_buffering`, `page` one client page —
    /// otherwise plain writes. Returns the bytes written.
    pub fn write_repeated_at(&self, page: &[u8], total: u64, offset: u64) -> Result<u64> {
        let e = self.channel_engine();
        let ps = usize::from(e.client_page_size());
        let sps = usize::from(e.server_page_size());
        let legal =
            self.no_buffering && page.len() == ps && (ps.max(sps) % ps.min(sps).max(1) == 0);
        let mut done = 0u64;
        if legal {
            // The server's window, or up to its MAX_MESSAGE when it takes
            // longer COLLAPSE writes (docs/protocol.md §5.12); at most the
            // 65,535 pages NumPages counts.
            let max_req = (e.max_read_direct() as u64)
                .min(u64::from(u16::MAX) * ps as u64)
                .max(ps as u64);
            while done < total {
                let len = (total - done).min(max_req) as u32;
                let data = &page[..(len as usize).min(ps)];
                let at = offset + done;
                let w = self.retry(|r| {
                    let e = &r.engine;
                    let req = e.issue_vec_write(r.fid, at, ps as u16, len, data, true)?;
                    let slot = if e.cfg.completion == Completion::Poll {
                        e.slot_of(req)
                    } else {
                        None
                    };
                    e.wait(req, slot)
                })?;
                match w {
                    (n, STATUS_SUCCESS) if n == len => done += u64::from(len),
                    (_, st) => return Err(status_error("VEC_WRITE (COLLAPSE)", st)),
                }
            }
            return Ok(done);
        }
        let mut block = Vec::new();
        while block.len() < 64 * 1024 && !page.is_empty() {
            block.extend_from_slice(page);
        }
        while done < total && !block.is_empty() {
            let len = (total - done).min(block.len() as u64) as usize;
            self.write_at(&block[..len], offset + done)?;
            done += len as u64;
        }
        Ok(done)
    }

    /// CANCEL: every outstanding I/O of this file is asked to cancel; those
    /// the server still can stop complete with STATUS_CANCELLED
    /// (docs/protocol.md §5.9 says which cannot).
    pub fn cancel(&self) -> Result<()> {
        let (e, fid) = self.current()?;
        let r = e.issue_cancel(fid)?;
        match e.wait(r, None)? {
            (_, STATUS_SUCCESS) => Ok(()),
            (_, st) => Err(status_error("CANCEL", st)),
        }
    }

    /// CANCEL the one outstanding request `req` of this file (nothing if it
    /// has completed): only it completes with STATUS_CANCELLED.
    pub fn cancel_request(&self, req: lwio_proto::client::ReqId) -> Result<()> {
        let r = self.now();
        let (e, fid) = (r.engine, r.fid);
        let Some(r) = e.issue_cancel_request(fid, req)? else {
            return Ok(());
        };
        match e.wait(r, None)? {
            (_, STATUS_SUCCESS) => Ok(()),
            (_, st) => Err(status_error("CANCEL", st)),
        }
    }

    /// The file size (side channel).
    pub fn len(&self) -> Result<u64> {
        Ok(self.stat()?.size)
    }

    pub fn is_empty(&self) -> Result<bool> {
        Ok(self.len()? == 0)
    }

    /// Truncate or extend (side channel).
    pub fn set_len(&self, size: u64) -> Result<()> {
        self.retry(|r| self.client.0.side_once(|s| s.set_size(r.handle, size)))
    }

    /// fsync(2) on the server: data and metadata reach stable storage.
    pub fn sync_all(&self) -> Result<()> {
        self.sync(false)
    }

    /// fdatasync(2) on the server.
    pub fn sync_data(&self) -> Result<()> {
        self.sync(true)
    }

    /// Whether [`File::sync_data`] and [`File::sync_all`] go over the RDMA
    /// connection (a FLUSH) rather than the side channel.
    pub fn syncs_on_rdma(&self) -> bool {
        self.route().is_ok_and(|r| r.engine.server_flushes())
    }

    /// A FLUSH on the file's RDMA connection where the server serves it
    /// (docs/protocol.md §5.13): one request beside the file's I/O, no
    /// side-channel round trip; else the side channel's `Fsync`.
    fn sync(&self, data_only: bool) -> Result<()> {
        self.retry(|r| {
            if !r.engine.server_flushes() {
                return self.client.0.side_once(|s| s.fsync(r.handle, data_only));
            }
            let req = r.engine.issue_flush(r.fid, data_only)?;
            match r.engine.wait(req, None)? {
                (_, STATUS_SUCCESS) => Ok(()),
                (_, st) => Err(status_error(
                    if data_only {
                        "FLUSH (fdatasync)"
                    } else {
                        "FLUSH (fsync)"
                    },
                    st,
                )),
            }
        })
    }

    /// A side-channel call on this open file's handle (fstat, fchmod,
    /// fallocate, a lock, …). When the connection is lost under it, the
    /// client connects again, the file is registered (or reopened) on the
    /// new session, and the call is made again with the file's new
    /// handle. The outer error is the connection's; the inner one is the
    /// server's answer, with its code.
    pub fn side<T>(
        &self,
        mut f: impl FnMut(&mut crate::side::Client, u64) -> lwio_side::Result<T>,
    ) -> Result<lwio_side::Result<T>> {
        self.retry(|r| {
            self.client.0.side_once(|s| match f(s, r.handle) {
                // Lost: through `retry`, which reconnects and reopens.
                Err(e) if e.code == ErrorCode::Disconnected => Err(e),
                answer => Ok(answer),
            })
        })
    }

    /// The side-channel handle of this open file (for side-channel calls
    /// that act on an open file, through [`Client::side`]; [`File::side`]
    /// keeps it current across a reconnect).
    pub fn handle(&self) -> u64 {
        self.now().handle
    }

    /// The export and the path within it that this file was opened as.
    pub fn export_path(&self) -> (&str, &str) {
        (&self.export, &self.path)
    }

    /// CLOSE on the RDMA channel, then close the side-channel handle.
    pub fn close(mut self) -> Result<()> {
        self.close_inner()
    }

    fn close_inner(&mut self) -> Result<()> {
        if self.closed {
            return Ok(());
        }
        self.closed = true;
        let r = self.retry(|r| {
            let e = &r.engine;
            let rdma = e.issue_close(r.fid).and_then(|x| e.wait(x, None));
            let side = self.client.0.side_once(|s| s.close(r.handle));
            Ok((rdma?, side))
        });
        let (rdma, side) = match r {
            // Nothing of it is open any more.
            Err(Error::Stale(_)) => return Ok(()),
            r => r?,
        };
        match rdma {
            (_, STATUS_SUCCESS) => {}
            (_, st) => return Err(status_error("CLOSE", st)),
        }
        side?;
        Ok(())
    }
}

impl Drop for File {
    fn drop(&mut self) {
        if self.closed {
            return;
        }
        if tokio::runtime::Handle::try_current().is_ok() {
            // Dropped in async code: the blocking side-channel client must
            // not run here. Close on a helper thread.
            self.closed = true;
            let (client, r) = (self.client.clone(), self.now());
            let _ = std::thread::Builder::new()
                .name("lwio-file-close".into())
                .spawn(move || close_once(&client, &r));
            return;
        }
        // Best effort, without a reconnect: a drop must not wait out
        // `op_timeout` for a server that is gone (its durable grace closes
        // the file there). `File::close` reconnects and reports.
        self.closed = true;
        close_once(&self.client, &self.now());
    }
}

/// Close a dropped file once, best effort: CLOSE on its RDMA channel and on
/// the side channel, no reconnect.
fn close_once(client: &Client, r: &reconnect::Route) {
    let e = &r.engine;
    if let Err(e) = e.issue_close(r.fid).and_then(|x| e.wait(x, None)) {
        debug!(error = %e, "closing a dropped file (RDMA)");
    }
    if let Err(e) = client.0.side_once(|s| s.close(r.handle)) {
        debug!(error = %e, "closing a dropped file (side channel)");
    }
}
