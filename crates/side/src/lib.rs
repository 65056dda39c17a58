//! What both ends of lwio's side channel share: the wire codec of the
//! side channel (`docs/side-channel.md`), login proofs ([`auth`],
//! [`user_token`]), the negotiate pipe ([`negotiate`]), the client's TLS and
//! certificate pinning ([`tls`]), the error codes ([`error`]), the file
//! attribute types ([`types`]), the size/duration units of options
//! ([`units`]), and the defaults both ends share ([`defaults`]: the token
//! file, user names).
//!
//! The side channel is an authenticated TCP session (default port 7420) that
//! carries the discovery phase — hello/version, login, the file namespace
//! (list, stat, open → server request resume key, close, remove, rename,
//! mkdir, set-size, fsync) and the **pipe** carrying negotiate. The client is
//! in `lwio-client`, the server in `lwio-server`. Security model:
//! `docs/security.md`.

pub mod auth;
pub mod codec;
pub mod defaults;
pub mod error;
pub mod known_hosts;
pub mod negotiate;
pub mod tls;
pub mod types;
pub mod units;
pub mod user_token;

pub use auth::{Login, SessionSecret, Token};
pub use codec::{ExportInfo, PROTOCOL_VERSION};
pub use error::{Error, ErrorCode, Result};
pub use negotiate::{
    AddressBlockRepr, Guid, NegotiateRequestRepr, NegotiateResponseRepr, NetAddressRepr,
};
pub use tls::{ClientTls, SideStream};
pub use types::{
    Attr, AttrX, DirEntry, FileKind, OpenOptions, RemoveKind, SetAttr, SetTime, StatFs,
};

/// The side channel's default TCP port.
pub const DEFAULT_PORT: u16 = 7420;

/// Fill `buf` from the OS CSPRNG (getrandom(2)).
///
/// Panics only if the kernel refuses randomness, which makes every security
/// property of lwio moot.
pub fn random_bytes(buf: &mut [u8]) {
    getrandom::fill(buf).expect("the OS random number generator failed");
}

/// This host's name, for the default server name.
pub fn host_name() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most buf.len() bytes into our buffer.
    let r = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if r == 0 {
        let n = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
        let s = String::from_utf8_lossy(&buf[..n]).into_owned();
        if !s.is_empty() {
            return s;
        }
    }
    "lwio-server".to_string()
}
