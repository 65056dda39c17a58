//! `lwio-proto`: the LWIO wire format (`wire`), side-channel helpers
//! (`sidechannel`) and sans-IO protocol state machines (`server`, `client`).
//!
//! The normative description is `docs/protocol.md`.
//!
//! ```
//! use lwio_proto::wire::common::{CompletionMode, RequestOp};
//! use lwio_proto::wire::{RequestRepr, StatusResponse};
//!
//! // A READ request in interrupt mode, as the client sends it.
//! let req = RequestRepr {
//!     credits: 1,
//!     sequence: 0,
//!     tid: 0,
//!     op: RequestOp::Read {
//!         fid: 1,
//!         offset: 0,
//!         length: 4096,
//!         data_va: 0x1000,
//!         data_mh: 7,
//!         mode: CompletionMode::Interrupt { cookie: 42, immediate_cookie: 42 },
//!     },
//! };
//! let bytes = req.to_bytes().unwrap();
//! assert_eq!(bytes.len(), 56);
//! assert_eq!(RequestRepr::parse(&bytes).unwrap(), req);
//!
//! // The server's 16-byte answer.
//! let resp = StatusResponse::from_bytes(&[42, 0, 0, 0, 0, 0, 0, 0, 0, 16, 0, 0, 0, 0, 0, 0]).unwrap();
//! assert_eq!((resp.cookie, resp.ios.information, resp.ios.status), (42, 4096, 0));
//! ```
#![forbid(unsafe_code)]

pub mod client;
pub mod fragment;
pub mod server;
pub mod sidechannel;
pub mod stats;
pub mod status;
pub mod transport;
pub mod wire;

pub use status::NtStatus;

/// Work-request id tags: the top byte says what a completion belongs to.
pub mod wrid {
    pub const RECV: u64 = 1 << 56;
    pub const SEND: u64 = 2 << 56;
    pub const READBUF: u64 = 3 << 56;
    pub const BIND: u64 = 4 << 56;
    pub const INVAL: u64 = 5 << 56;
    /// The invalidation of a polled request's status-block window; the
    /// value is the status slot ([`crate::client::ClientConn::release_slot`]
    /// at its completion).
    pub const INVAL_SLOT: u64 = 6 << 56;
    pub const MASK: u64 = 0xff << 56;

    pub fn kind(w: u64) -> u64 {
        w & MASK
    }
    pub fn value(w: u64) -> u64 {
        w & !MASK
    }
}
