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
//! A call's requests are issued and reaped through a [`Batch`] (the
//! blocking and async files, the C API's batch calls and the preload's AIO
//! share it). The data path under it (threads, memory windows, completion
//! modes) is the crate's private `engine` module; docs/architecture.md
//! describes it.

pub mod async_client;
pub mod batch;
pub mod connect;
pub mod discovery;
pub(crate) mod engine;
pub mod errno;
pub mod handoff;
pub mod publish;
pub mod reconnect;
pub mod side_client;
pub mod url;

mod client;
mod file;
mod unstable;
pub use client::Client;
pub(crate) use client::{dial_all, Inner};
pub use file::{File, RegisteredBuf, RequestLimits};
pub use unstable::PendingWrite;

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
pub use batch::{Batch, Connection, End, Landing, Short};
pub use connect::ConnectArgs;
pub use engine::{status_text, ClientStats, BOUNCE_THRESHOLD};
use engine::{Engine, EngineConfig};
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
            | ErrorCode::TextBusy
            // The file system's own refusals that an errno names:
            // EOPNOTSUPP, EAGAIN (a lock held), EBADF, ENXIO (SEEK_DATA
            // past the end), not a generic EIO.
            | ErrorCode::Unsupported
            | ErrorCode::Locked
            | ErrorCode::BadHandle
            | ErrorCode::NoSuchOffset => Error::Fs(e),
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
    /// (its deepest queue; 255 = no limit). Of a server's grant, the
    /// credits beyond what the client needs (its pending requests and one
    /// for INTERRUPT and CANCEL, at least `credits`, at most this) are
    /// reported unused, and the server takes them back.
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
