//! The side channel: an authenticated TCP session (default port 7420) that
//! carries the discovery phase — hello/version, login, the file namespace
//! (list, stat, open → server request resume key, close, remove, rename,
//! mkdir, set-size, fsync) and the **pipe** carrying negotiate.
//!
//! Wire format: `docs/side-channel.md` ([`codec`]). Login: [`auth`].
//! Server: [`server`]; clients: [`client`].

pub mod auth;
pub mod client;
pub mod codec;
pub mod negotiate;
pub mod server;

pub use crate::url::DEFAULT_PORT;
pub use auth::{Login, Token};
pub use client::{AsyncClient, Client, ClientOptions, RemoteFile, Session};
pub use codec::{ExportInfo, PROTOCOL_VERSION};
pub use negotiate::{
    AddressBlockRepr, Guid, NegotiateRequestRepr, NegotiateResponseRepr, NetAddressRepr,
};

#[cfg(test)]
mod tests;
