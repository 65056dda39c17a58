//! lwio: RDMA I/O offload. An application server hands its file reads and
//! writes to a storage server over RDMA.
//!
//! This crate holds the storage server, the client library and the `lwio`
//! command-line tool:
//!
//! * [`side`] — the authenticated TCP side channel (discovery phase: login,
//!   file namespace operations, open → server request resume key, negotiate);
//! * [`fs`] — exports, path confinement, the open-file table and the file I/O
//!   backends (io_uring, thread pool);
//! * [`config`] — the TOML configuration;
//! * [`server`] — the server process: side channel plus the hook where the RDMA
//!   phase plugs in;
//! * [`url`], [`units`] — `lwio://` URLs, sizes and durations.

pub mod cli;
pub mod client;
pub mod cmd;
pub mod config;
pub mod data;
pub mod error;
pub mod fs;
pub mod server;
pub mod side;
pub mod units;
pub mod url;

pub use error::{Error, ErrorCode, Result};

/// Fill `buf` from the OS CSPRNG (getrandom(2)).
///
/// Panics only if the kernel refuses randomness, which makes every security
/// property of lwio moot.
pub fn random_bytes(buf: &mut [u8]) {
    getrandom::fill(buf).expect("the OS random number generator failed");
}
