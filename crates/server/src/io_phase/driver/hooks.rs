//! The [`ServerHooks`] a connection gives its `ServerConn`: AUTH's
//! negotiate Key (looked up, then used up once) and REGISTER's files.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use lwio_proto::server::ServerHooks;
use lwio_proto::status::*;
use lwio_proto::wire::auth::derive_session_secret;
use lwio_proto::wire::{Guid, SrvResumeKey};
use lwio_proto::NtStatus;
use tracing::{debug, info, warn};

use crate::fs::table::{Denied, OpenFile, SessionId};
use crate::state::ServerState;

use super::shared::Shared;

/// Per-connection hook state: the side-channel session found at AUTH and
/// the files REGISTER opened.
pub(super) struct Hooks<'a> {
    pub(super) state: &'a ServerState,
    pub(super) shared: &'a Shared,
    pub(super) session: &'a mut Option<SessionId>,
    pub(super) files: &'a mut HashMap<u64, OpenFile>,
    pub(super) next_file: &'a mut u64,
    pub(super) peer: SocketAddr,
    /// Memory objects this connection may carry (docs/memory-objects.md).
    pub(super) mem: &'a mut crate::io_phase::memobj_io::PubSide,
}

impl ServerHooks for Hooks<'_> {
    // The Key is looked up here and used up only once the AUTH's signature
    // verified (`auth_verified`): a forged AUTH naming a Key it saw (or
    // guessed) must not burn it for the client that negotiated it.
    fn session_secret(&mut self, key: &Guid) -> Option<Vec<u8>> {
        let Some(n) = self.state.lookup_negotiate_key(key) else {
            info!(peer = %self.peer, %key, "AUTH with an unknown or expired negotiate key");
            return None;
        };
        if self.shared.key_used(key) {
            warn!(peer = %self.peer, %key, "AUTH with an already used negotiate key");
            return None;
        }
        Some(derive_session_secret(&n.session_secret.0, key).to_vec())
    }

    fn auth_verified(&mut self, key: &Guid) -> bool {
        let Some(n) = self.state.lookup_negotiate_key(key) else {
            info!(peer = %self.peer, %key, "negotiate key gone during its AUTH");
            return false;
        };
        let ttl = n.expires.saturating_duration_since(Instant::now()) + Duration::from_secs(1);
        if !self.shared.consume_key(key, ttl) {
            warn!(peer = %self.peer, %key, "AUTH with an already used negotiate key");
            return false;
        }
        *self.session = Some(n.session);
        self.mem.presented(*key, n.session);
        true
    }

    fn open_file(&mut self, rk: &SrvResumeKey, _flags: u32) -> Result<u64, NtStatus> {
        let Some(session) = *self.session else {
            return Err(STATUS_ACCESS_DENIED);
        };
        match self.state.lookup_resume_key(rk, session) {
            Ok(f) => {
                let h = *self.next_file;
                *self.next_file += 1;
                debug!(peer = %self.peer, session, path = %f.path, file = h, "REGISTER");
                self.files.insert(h, f);
                Ok(h)
            }
            Err(d) => {
                info!(peer = %self.peer, session, reason = %d, "REGISTER refused");
                Err(match d {
                    Denied::Unknown => STATUS_INVALID_HANDLE,
                    Denied::Expired | Denied::WrongSession => STATUS_ACCESS_DENIED,
                })
            }
        }
    }
}
