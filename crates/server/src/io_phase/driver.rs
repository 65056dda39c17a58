//! The server side of the RDMA phase.
//!
//! [`RdmaServer`] listens on each provider instance the options select and
//! implements [`crate::state::RdmaPhase`]: `lwio serve` builds it, attaches
//! it with `Server::set_rdma_phase`, and `Server::run` calls
//! [`RdmaPhase::serve`](crate::state::RdmaPhase::serve) on a dedicated
//! thread.
//!
//! Each accepted connection has its own QP and CQ and runs one
//! `lwio_proto::server::ServerConn<OpState>`, which keeps the connection's
//! data per storage operation (`conn::OpState`) with the operation. Where the device has shared receive
//! queues (the soft provider always does), its protection domain,
//! completion channel and receive pool are its reactor's on that device
//! (`reactor::Domain`, the CQ tagged with the connection's id); elsewhere
//! it gets its own protection domain, completion channel and receive
//! region (with the soft provider also its own context under manual
//! progress, so its reactor reads its socket). A fixed set of **reactor**
//! threads ([`super::reactor`], one per core by default) drives the
//! connections: each polls its connections for `busy_poll` after activity
//! (`busy_poll_polled` after a polled completion), then sleeps in
//! `epoll_wait` on their completion channels and on the eventfds that
//! storage workers and the control plane (credit balancing, shutdown) use
//! to wake them. Page-cache I/O runs on the reactor itself (`inline_io`: tmpfs plain
//! calls, else `RWF_NOWAIT`; writes straight from the receive buffer that
//! `ServerAction::FileWriteParts` lends); what would block runs on a small pool of
//! storage threads over the [`crate::fs::backend::Backend`] (io_uring where
//! available). Each round's RDMA Writes and sends are posted as one list.
//!
//! CANCEL (docs/protocol.md §5.9): a storage job carries a cancel flag that
//! `ServerAction::CancelIo` (and the connection closing) raises. A job still
//! queued is not started; one running on io_uring is stopped with
//! `IORING_OP_ASYNC_CANCEL` where the kernel can (`Backend::
//! submit_cancellable`). Inline page-cache I/O cannot be cancelled: it is
//! one non-blocking call, done before the next message is read; a request
//! whose CANCEL came in the same batch is withdrawn by `ServerConn` before
//! its FileRead/FileWrite reaches `dispatch`, so the inline path never
//! starts it.
//!
//! Memory: **the server never exposes memory**. Every region it registers
//! (receive buffers, send/inline buffers, read buffers) has `LOCAL_WRITE` at
//! most — no `REMOTE_*`, no `MW_BIND` — and the server allocates no windows.
//! [`ServerHandle::stats`] counts registrations by access so tests can assert
//! it; a peer's RDMA Write or Read aimed at the server finds no valid key and
//! the provider terminates the connection.
//!
//! Auth: the AUTH Key is resolved through the side channel's negotiate table
//! ([`ServerState::lookup_negotiate_key`](crate::state::ServerState::lookup_negotiate_key));
//! each Key is accepted **once** (consumed on first use) and only while
//! fresh. The secret is
//! `derive_session_secret(session secret, Key)`. The side-channel session
//! found this way is the only session whose resume keys REGISTER accepts.
//!
//! The layers, one file each under `server/`:
//!
//! * `options.rs`: [`RdmaServerOptions`] and its defaults;
//! * `shared.rs`: what every connection shares (budget, connection table,
//!   counters) and [`ServerHandle`] / [`ServerStats`];
//! * `listener.rs`: [`RdmaServer`], its listeners and the accept loop;
//! * `storage.rs`: storage jobs, the storage threads and the ring pieces of
//!   a job; `inline.rs`: the page-cache fast path;
//! * `hooks.rs`: the `ServerHooks` of AUTH and REGISTER;
//! * `conn.rs`: the connection and what its reactor calls, with its other
//!   layers in `impl Conn` blocks of their own: `accept.rs` (admission),
//!   `credits.rs` (control and credit balancing), `completions.rs` (work
//!   and storage completions), `actions.rs` (the state machine's actions)
//!   and `fileio.rs` (their file I/O).

mod accept;
mod actions;
mod completions;
mod conn;
mod credits;
mod fileio;
mod hooks;
mod inline;
mod listener;
mod options;
mod shared;
mod storage;

pub use listener::{wire_transport, RdmaServer};
pub use options::{RdmaServerOptions, DEFAULT_MAX_MESSAGE};
pub use shared::{ServerHandle, ServerStats};
#[doc(hidden)]
#[cfg(any(test, feature = "testkit"))]
pub use storage::{slow_next_storage_write_for_tests, slow_storage_write_started_for_tests};

pub(super) use conn::Conn;
pub(super) use shared::{lock, Shared, STATS_FLUSH};
