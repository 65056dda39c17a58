//! The side-channel server: one task per connection, generic over the
//! transport (`AsyncRead + AsyncWrite`) so TLS can wrap it later.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tracing::{debug, info, warn};

use super::auth;
use super::codec::*;
use super::negotiate;
use crate::error::{Error, ErrorCode};
use crate::fs::table::Rights;
use crate::fs::OpenOptions;
use crate::server::{NegotiatedClient, ServerState, SessionInfo, SessionSecret, Shutdown};

/// Accept connections until `shutdown` triggers, then wait for sessions to
/// finish their in-flight request (bounded by `limits.shutdown_grace`).
pub async fn accept_loop(listener: TcpListener, state: Arc<ServerState>, shutdown: Shutdown) {
    let slots = Arc::new(Semaphore::new(state.limits.max_sessions));
    let mut tasks = JoinSet::new();
    if let Ok(a) = listener.local_addr() {
        info!(addr = %a, "side channel listening");
    }
    loop {
        tokio::select! {
            _ = shutdown.wait() => break,
            acc = listener.accept() => match acc {
                Ok((stream, peer)) => {
                    let _ = stream.set_nodelay(true);
                    let st = state.clone();
                    let sd = shutdown.clone();
                    match slots.clone().try_acquire_owned() {
                        Ok(permit) => {
                            tasks.spawn(async move {
                                serve_connection(st, stream, peer, sd).await;
                                drop(permit);
                            });
                        }
                        Err(_) => {
                            warn!(%peer, "session limit reached; refusing connection");
                            tasks.spawn(refuse_busy(stream, st.limits.max_sessions));
                        }
                    }
                }
                Err(e) => {
                    // EMFILE and friends: back off instead of spinning.
                    warn!(error = %e, "accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                }
            },
            Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
        }
    }
    drop(listener);
    info!(
        sessions = tasks.len(),
        "shutting down: no longer accepting; finishing in-flight requests"
    );
    let grace = state.limits.shutdown_grace;
    let drained =
        tokio::time::timeout(grace, async { while tasks.join_next().await.is_some() {} }).await;
    if drained.is_err() {
        warn!(
            left = tasks.len(),
            "shutdown grace period over; closing remaining sessions"
        );
        tasks.shutdown().await;
    }
}

async fn refuse_busy(mut stream: tokio::net::TcpStream, max: usize) {
    let e = Error::new(
        ErrorCode::Busy,
        format!("server busy: {max} sessions already open"),
    );
    let _ = tokio::time::timeout(
        std::time::Duration::from_secs(2),
        write_frame(&mut stream, &Response::Error(e).encode(0)),
    )
    .await;
}

enum Phase {
    Hello,
    Login {
        server_nonce: [u8; NONCE_LEN],
        client_name: String,
    },
    Ready {
        session: u64,
    },
}

/// Serve one connection to completion.
pub async fn serve_connection<S>(
    state: Arc<ServerState>,
    mut stream: S,
    peer: SocketAddr,
    shutdown: Shutdown,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send,
{
    let mut phase = Phase::Hello;
    let started = Instant::now();
    let max = state.limits.max_frame;
    debug!(%peer, "connection");
    loop {
        let limit = match phase {
            Phase::Ready { .. } => state.limits.idle_timeout,
            _ => state.limits.login_timeout.saturating_sub(started.elapsed()),
        };
        let frame = tokio::select! {
            biased;
            _ = shutdown.wait() => break,
            r = tokio::time::timeout(limit, read_frame(&mut stream, max)) => r,
        };
        let body = match frame {
            Err(_) => {
                let what = if matches!(phase, Phase::Ready { .. }) {
                    "idle timeout"
                } else {
                    "login timeout"
                };
                info!(%peer, "{what}; closing session");
                let e = Error::new(ErrorCode::TimedOut, format!("{what}: closing session"));
                let _ = write_frame(&mut stream, &Response::Error(e).encode(0)).await;
                break;
            }
            Ok(Ok(Some(b))) => b,
            Ok(Ok(None)) => break,
            Ok(Err(FrameError::TooLarge(n, m))) => {
                warn!(%peer, size = n, limit = m, "frame too large; closing session");
                let e = Error::new(
                    ErrorCode::FrameTooLarge,
                    format!("frame of {n} bytes exceeds the limit of {m}"),
                );
                let _ = write_frame(&mut stream, &Response::Error(e).encode(0)).await;
                break;
            }
            Ok(Err(FrameError::Io(e))) => {
                debug!(%peer, error = %e, "connection error");
                break;
            }
        };
        let (id, req) = match Request::decode(&body) {
            Ok(x) => x,
            Err(e) => {
                warn!(%peer, error = %e, "bad request; closing session");
                let id = split_body(&body).map(|(_, id, _)| id).unwrap_or(0);
                let _ = write_frame(&mut stream, &Response::Error(e.into()).encode(id)).await;
                break;
            }
        };
        let (resp, close) = step(&state, &mut phase, peer, req).await;
        let mut out = resp.encode(id);
        if out.len() > max as usize {
            out = Response::Error(Error::new(ErrorCode::FrameTooLarge, "response too large"))
                .encode(id);
        }
        if write_frame(&mut stream, &out).await.is_err() || close {
            break;
        }
    }
    if let Phase::Ready { session } = phase {
        state.end_session(session);
        info!(%peer, session, "session closed");
    }
}

fn err(code: ErrorCode, msg: impl Into<String>) -> Response {
    Response::Error(Error::new(code, msg))
}

/// Handle one request; returns the response and whether to close afterwards.
async fn step(
    state: &Arc<ServerState>,
    phase: &mut Phase,
    peer: SocketAddr,
    req: Request,
) -> (Response, bool) {
    match (&*phase, req) {
        (_, Request::Bye) => (Response::Ok, true),
        (_, Request::Ping) => (Response::Ok, false),
        (
            Phase::Hello,
            Request::Hello {
                version,
                client_name,
            },
        ) => {
            if version < MIN_PROTOCOL_VERSION {
                return (
                    err(
                        ErrorCode::UnsupportedVersion,
                        format!("client protocol version {version} is too old; server speaks {MIN_PROTOCOL_VERSION}..{PROTOCOL_VERSION}"),
                    ),
                    true,
                );
            }
            let server_nonce = auth::nonce();
            let mut methods = 0;
            if state.auth.token.is_some() {
                methods |= AUTH_TOKEN;
            }
            if state.auth.allow_anonymous {
                methods |= AUTH_ANONYMOUS;
            }
            *phase = Phase::Login {
                server_nonce,
                client_name,
            };
            (
                Response::Hello {
                    version: version.min(PROTOCOL_VERSION),
                    server_name: state.server_name.clone(),
                    server_nonce,
                    auth_methods: methods,
                    max_frame: state.limits.max_frame,
                },
                false,
            )
        }
        (
            Phase::Login {
                server_nonce,
                client_name,
            },
            Request::Login(l),
        ) => {
            let sn = *server_nonce;
            let (secret, proof, anonymous) = match l {
                LoginRequest::Anonymous => {
                    if !state.auth.allow_anonymous {
                        warn!(%peer, "anonymous login refused");
                        return (
                            err(ErrorCode::AuthFailed, "anonymous access is not allowed on this server; a token is required"),
                            true,
                        );
                    }
                    (
                        auth::session_secret(None, &sn, &[0; NONCE_LEN]),
                        [0u8; MAC_LEN],
                        true,
                    )
                }
                LoginRequest::Token {
                    client_nonce,
                    proof,
                } => {
                    let Some(token) = &state.auth.token else {
                        return (
                            err(
                                ErrorCode::AuthFailed,
                                "this server does not accept token logins",
                            ),
                            true,
                        );
                    };
                    if !auth::verify_client_proof(token, &sn, &client_nonce, &proof) {
                        warn!(%peer, "login failed: wrong token");
                        return (
                            err(ErrorCode::AuthFailed, "authentication failed: wrong token"),
                            true,
                        );
                    }
                    (
                        auth::session_secret(Some(token), &sn, &client_nonce),
                        auth::server_proof(token, &sn, &client_nonce),
                        false,
                    )
                }
            };
            let session = state.register_session(SessionInfo {
                id: 0,
                peer,
                client_name: client_name.clone(),
                anonymous,
                secret: SessionSecret(secret),
            });
            info!(%peer, session, client = %client_name, anonymous, "login");
            *phase = Phase::Ready { session };
            (
                Response::LoginOk {
                    session_id: session,
                    server_proof: proof,
                },
                false,
            )
        }
        (Phase::Ready { session }, req) => {
            let session = *session;
            match handle(state, session, req).await {
                Ok(r) => (r, false),
                Err(e) => {
                    debug!(session, code = ?e.code, error = %e, "request failed");
                    (Response::Error(e), false)
                }
            }
        }
        (Phase::Hello, _) => (err(ErrorCode::BadRequest, "expected Hello first"), true),
        (Phase::Login { .. }, _) => (err(ErrorCode::NotLoggedIn, "log in first"), true),
    }
}

/// Run a blocking filesystem call off the async threads.
async fn blocking<T, F>(f: F) -> Result<T, Error>
where
    F: FnOnce() -> Result<T, Error> + Send + 'static,
    T: Send + 'static,
{
    tokio::task::spawn_blocking(f)
        .await
        .unwrap_or_else(|e| Err(Error::new(ErrorCode::Io, format!("internal error: {e}"))))
}

async fn handle(state: &Arc<ServerState>, session: u64, req: Request) -> Result<Response, Error> {
    match req {
        Request::Hello { .. } | Request::Login(_) => {
            Err(Error::new(ErrorCode::BadRequest, "already logged in"))
        }
        Request::Ping | Request::Bye => Ok(Response::Ok),
        Request::ListExports => Ok(Response::Exports(
            state
                .exports
                .iter()
                .map(|e| ExportInfo {
                    name: e.name.clone(),
                    read_only: e.read_only,
                })
                .collect(),
        )),
        Request::ListDir {
            export,
            path,
            cookie,
        } => {
            let ex = state.exports.get(&export)?.clone();
            let budget = (state.limits.max_frame as usize).saturating_sub(64);
            blocking(move || {
                let all = ex.list(&path)?;
                let start = usize::try_from(cookie).unwrap_or(usize::MAX).min(all.len());
                let mut used = 0;
                let mut entries = Vec::new();
                for e in &all[start..] {
                    let we = WireDirEntry {
                        name: e.name.clone(),
                        attr: e.attr,
                    };
                    used += dir_entry_len(&we);
                    if used > budget && !entries.is_empty() {
                        break;
                    }
                    entries.push(we);
                }
                let next = start + entries.len();
                let next_cookie = if next < all.len() { next as u64 } else { 0 };
                Ok(Response::DirPage {
                    entries,
                    next_cookie,
                })
            })
            .await
        }
        Request::Stat { export, path } => {
            let ex = state.exports.get(&export)?.clone();
            blocking(move || Ok(Response::Attr(ex.stat(&path)?))).await
        }
        Request::Open {
            export,
            path,
            access,
            flags,
            mode,
        } => {
            let ex = state.exports.get(&export)?.clone();
            let o = OpenOptions {
                read: access & ACCESS_READ != 0,
                write: access & ACCESS_WRITE != 0,
                create: flags & OPEN_CREATE != 0,
                exclusive: flags & OPEN_EXCLUSIVE != 0,
                truncate: flags & OPEN_TRUNCATE != 0,
                no_buffering: flags & OPEN_NO_BUFFERING != 0,
                write_through: flags & OPEN_WRITE_THROUGH != 0,
            };
            if state.open_files.session_len(session) >= state.limits.max_open_files_per_session {
                return Err(Error::new(
                    ErrorCode::TooManyOpenFiles,
                    format!(
                        "too many open files in this session (limit {})",
                        state.limits.max_open_files_per_session
                    ),
                ));
            }
            let st = state.clone();
            blocking(move || {
                let opened = ex.open_file(&path, &o, mode)?;
                let size = opened.size;
                let rights = Rights {
                    read: o.read,
                    write: o.write,
                };
                let (file, rk) = st
                    .open_files
                    .insert(session, opened, rights, &ex.name, &path)?;
                debug!(session, export = %ex.name, %path, handle = file.handle, "open");
                Ok(Response::Opened {
                    handle: file.handle,
                    size,
                    align: file.align,
                    resume_key: crate::fs::table::encode_request_resume_key(&rk),
                })
            })
            .await
        }
        Request::Close { handle } => {
            state.open_files.close(handle, session)?;
            Ok(Response::Ok)
        }
        Request::Remove { export, path } => {
            let ex = state.exports.get(&export)?.clone();
            blocking(move || ex.remove(&path).map(|_| Response::Ok)).await
        }
        Request::Rename {
            export,
            from,
            to,
            replace,
        } => {
            let ex = state.exports.get(&export)?.clone();
            blocking(move || ex.rename(&from, &to, replace).map(|_| Response::Ok)).await
        }
        Request::Mkdir {
            export,
            path,
            mode,
            parents,
        } => {
            let ex = state.exports.get(&export)?.clone();
            blocking(move || ex.mkdir(&path, mode, parents).map(|_| Response::Ok)).await
        }
        Request::SetSize { handle, size } => {
            let f = state.open_files.get(handle, session)?;
            if !f.rights.write {
                return Err(Error::new(
                    ErrorCode::PermissionDenied,
                    "set-size needs a file opened for writing",
                ));
            }
            blocking(move || {
                f.file
                    .set_len(size)
                    .map_err(|e| Error::from_io(&e, format!("{}/{}", f.export, f.path)))?;
                Ok(Response::Ok)
            })
            .await
        }
        Request::Fsync { handle, data_only } => {
            let f = state.open_files.get(handle, session)?;
            blocking(move || {
                let r = if data_only {
                    f.file.sync_data()
                } else {
                    f.file.sync_all()
                };
                r.map_err(|e| Error::from_io(&e, format!("{}/{}", f.export, f.path)))?;
                Ok(Response::Ok)
            })
            .await
        }
        Request::Negotiate { request } => {
            let req = negotiate::decode_request(&request)?;
            let info = state
                .session(session)
                .ok_or_else(|| Error::new(ErrorCode::NotLoggedIn, "session ended"))?;
            let key = negotiate::random_guid();
            let (resp, bytes) =
                negotiate::build_response(&req, &state.server_name, key, &state.rdma_endpoints())?;
            state.add_negotiation(NegotiatedClient {
                key,
                session,
                session_secret: info.secret,
                client_name: req.client_name.clone(),
                client_key: req.key,
                providers: resp.providers.iter().map(|p| p.name.clone()).collect(),
                expires: Instant::now() + state.limits.resume_key_ttl,
            });
            info!(
                session,
                client = %req.client_name,
                offered = req.providers.len(),
                common = resp.providers.len(),
                "negotiate"
            );
            Ok(Response::Negotiated { response: bytes })
        }
    }
}
