//! `lwio-proto`: the LWIO wire format (`wire`), side-channel helpers
//! (`sidechannel`) and sans-IO protocol state machines (`server`, `client`).
//!
//! The normative description is `docs/protocol.md`.
#![forbid(unsafe_code)]

pub mod client;
pub mod server;
pub mod sidechannel;
pub mod status;
pub mod wire;

pub use status::NtStatus;
