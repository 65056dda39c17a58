//! The lwio storage server: exports and their file backends ([`fs`]), the
//! side channel's server ([`side_service`]: login, users and rights, admission, TLS
//! identity), the LWIO I/O phase over RDMA ([`io_phase`]), the
//! configuration ([`config`]), the process that ties them together
//! ([`state`]) and the whole server started with one call ([`service`]).
//! Clients link `lwio-client`, not this crate.

pub mod config;
pub mod fs;
pub mod io_phase;
pub mod memobj;
pub mod metrics;
pub mod service;
pub mod side_service;
pub mod state;

pub use service::{Service, ServiceParts};
pub use state::{Server, ServerOptions, ServerState, Shutdown};
