//! The side channel: an authenticated TCP session (default port 7420) that
//! carries the discovery phase — hello/version, login, the file namespace
//! (list, stat, open → server request resume key, close, remove, rename,
//! mkdir, set-size, fsync) and the **pipe** carrying negotiate.
//!
//! Wire format: `docs/side-channel.md` ([`codec`]). Login: [`auth`];
//! users, rights: [`access`]; TLS: [`tls`]; connection limits:
//! [`admission`]. Server: [`server`]; clients: [`client`]. Security model:
//! `docs/security.md`.

pub mod access;
pub mod admission;
pub mod auth;
pub mod client;
pub mod codec;
pub mod negotiate;
pub mod server;
pub mod tls;

pub use crate::url::DEFAULT_PORT;
pub use access::Principal;
pub use auth::{Login, Token};
pub use client::{AsyncClient, Client, ClientOptions, RemoteFile, Session};
pub use codec::{ExportInfo, PROTOCOL_VERSION};
pub use negotiate::{
    AddressBlockRepr, Guid, NegotiateRequestRepr, NegotiateResponseRepr, NetAddressRepr,
};
pub use tls::{ClientTls, SideStream};

#[cfg(test)]
mod security_tests;
#[cfg(test)]
mod tests;
