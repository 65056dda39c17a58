//! The side-channel server: admission control at accept, then one task per
//! connection: TLS detection and handshake, hello, login, requests. The
//! session code is generic over the transport (`AsyncRead + AsyncWrite`).

use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;
use tracing::{debug, info, warn};

pub mod access;
pub mod admission;
pub mod dirwatch;
pub mod leases;
mod mem;
pub mod tls;

mod conn;
mod handle;
mod session;

#[cfg(test)]
mod security_tests;
#[cfg(test)]
mod tests;

use crate::fs::ids::{as_caller, Caller, Creds};
use crate::fs::table::Rights;
use crate::fs::{Export, OpenOptions};
use crate::state::{NegotiatedClient, ServerState, SessionInfo, Shutdown};
use access::Principal;
use admission::ConnGuard;
use leases::Change;
use lwio_side::auth;
use lwio_side::codec::*;
use lwio_side::error::{Error, ErrorCode};
use lwio_side::negotiate;
use lwio_side::SessionSecret;

pub use conn::accept_loop;
pub use session::serve_connection;
use {conn::*, handle::*, session::*};

/// The largest frame read before login: Hello and Login are small, so a
/// peer that has not logged in cannot make the server allocate `max_frame`
/// (up to 16 MiB) for a body it never sends.
pub const PRE_LOGIN_MAX_FRAME: u32 = 4096;
