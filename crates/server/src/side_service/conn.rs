//! Connections: accepting within the admission limits, telling TLS from
//! plain TCP and from other protocols, and bounded writes.

use super::*;

/// Write one frame within `limit`: a peer that stops reading cannot hold
/// its session (and its admission slot) forever. Err on timeout.
pub(super) async fn write_within<S: AsyncWrite + Unpin>(
    stream: &mut S,
    body: &[u8],
    limit: Duration,
) -> std::io::Result<()> {
    match tokio::time::timeout(limit, write_frame(stream, body)).await {
        Ok(r) => r,
        Err(_) => Err(std::io::ErrorKind::TimedOut.into()),
    }
}

/// Message a TLS client gets from a plain server.
pub const NOT_TLS_MSG: &str =
    "this server does not use TLS (tls = false): connect with --no-tls, or enable TLS on the server";
/// Message a plain client gets from a TLS server.
pub const TLS_REQUIRED_MSG: &str =
    "this server requires TLS: connect without --no-tls (pin its certificate with --fingerprint, or use --ca)";

/// Best effort, never blocks: one error frame into the socket buffer.
pub(super) fn refuse_now(stream: &TcpStream, code: ErrorCode, msg: &str) {
    let body = Response::Error(Error::new(code, msg)).encode(0);
    let mut buf = Vec::with_capacity(4 + body.len());
    buf.extend_from_slice(&(body.len() as u32).to_le_bytes());
    buf.extend_from_slice(&body);
    let _ = stream.try_write(&buf);
}

/// Accept connections until `shutdown` triggers, then wait for sessions to
/// finish their in-flight request (bounded by `limits.shutdown_grace`).
pub async fn accept_loop(listener: TcpListener, state: Arc<ServerState>, shutdown: Shutdown) {
    let slots = Arc::new(Semaphore::new(state.limits.max_sessions));
    let mut tasks = JoinSet::new();
    if let Ok(a) = listener.local_addr() {
        info!(addr = %a, tls = state.security().tls.is_some(), "side channel listening");
    }
    // Refusals are logged at most once a second, with a count.
    let mut refused_since_log = 0u64;
    let mut last_log = Instant::now() - Duration::from_secs(2);
    loop {
        tokio::select! {
            _ = shutdown.wait() => break,
            acc = listener.accept() => match acc {
                Ok((stream, peer)) => {
                    let guard = match state.admission.admit(peer.ip()) {
                        Ok(g) => g,
                        Err(why) => {
                            refuse_now(&stream, ErrorCode::Busy, why.message());
                            drop(stream);
                            refused_since_log += 1;
                            if last_log.elapsed() >= Duration::from_secs(1) {
                                warn!(%peer, reason = ?why, refused = refused_since_log, "refusing connections");
                                refused_since_log = 0;
                                last_log = Instant::now();
                            }
                            continue;
                        }
                    };
                    let _ = stream.set_nodelay(true);
                    match slots.clone().try_acquire_owned() {
                        Ok(permit) => {
                            let st = state.clone();
                            let sd = shutdown.clone();
                            tasks.spawn(connection(st, stream, peer, sd, guard, permit));
                        }
                        Err(_) => {
                            warn!(%peer, "session limit reached; refusing connection");
                            refuse_now(
                                &stream,
                                ErrorCode::Busy,
                                &format!("server busy: {} sessions already open", state.limits.max_sessions),
                            );
                        }
                    }
                }
                Err(e) => {
                    // EMFILE and friends: back off instead of spinning.
                    warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
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

/// Does the client open with a TLS record (`16 03`)? Waits for two bytes.
pub(super) async fn starts_with_tls(stream: &TcpStream) -> std::io::Result<bool> {
    let mut b = [0u8; 2];
    loop {
        let n = stream.peek(&mut b).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        if b[0] != 0x16 {
            return Ok(false);
        }
        if n >= 2 {
            return Ok(b[1] == 0x03);
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Answer a client that speaks the wrong transport with one plain error
/// frame, then close cleanly (drain what it sent so the close is a FIN, not
/// a reset that could destroy our answer).
pub(super) async fn wrong_transport(mut stream: TcpStream, msg: &str) {
    let e = Error::new(ErrorCode::Unsupported, msg);
    let _ = tokio::time::timeout(Duration::from_secs(2), async {
        let _ = write_frame(&mut stream, &Response::Error(e).encode(0)).await;
        let _ = stream.shutdown().await;
        let mut sink = [0u8; 4096];
        let mut total = 0;
        while total < 1 << 16 {
            match stream.read(&mut sink).await {
                Ok(0) | Err(_) => break,
                Ok(n) => total += n,
            }
        }
    })
    .await;
}

pub(super) async fn connection(
    state: Arc<ServerState>,
    stream: TcpStream,
    peer: SocketAddr,
    shutdown: Shutdown,
    guard: ConnGuard,
    permit: OwnedSemaphorePermit,
) {
    let started = Instant::now();
    let login_timeout = state.limits.login_timeout;
    let tls = tokio::select! {
        biased;
        _ = shutdown.wait() => return,
        r = tokio::time::timeout(login_timeout, starts_with_tls(&stream)) => match r {
            Ok(Ok(t)) => t,
            Ok(Err(e)) => {
                debug!(%peer, error = %e, "closed before saying anything");
                return;
            }
            Err(_) => {
                info!(%peer, "login timeout (no data); closing");
                return;
            }
        },
    };
    match (&state.security().tls, tls) {
        (Some(id), true) => {
            let acceptor = tokio_rustls::TlsAcceptor::from(id.config.clone());
            let left = login_timeout.saturating_sub(started.elapsed());
            match tokio::time::timeout(left, acceptor.accept(stream)).await {
                Ok(Ok(s)) => {
                    // The login is bound to this TLS connection (RFC 9266
                    // tls-exporter; docs/security.md, "Channel binding").
                    let Some(binding) = lwio_side::tls::exporter(s.get_ref().1) else {
                        info!(%peer, "TLS connection exports no channel binding; closing");
                        return;
                    };
                    serve_session(
                        state,
                        s,
                        peer,
                        Some(binding),
                        Some(guard),
                        started,
                        shutdown,
                    )
                    .await
                }
                Ok(Err(e)) => info!(%peer, error = %e, "TLS handshake failed"),
                Err(_) => info!(%peer, "login timeout during the TLS handshake"),
            }
        }
        (Some(_), false) => {
            info!(%peer, "plain-TCP client on a TLS side channel; refused");
            wrong_transport(stream, TLS_REQUIRED_MSG).await;
        }
        (None, true) => {
            info!(%peer, "TLS client on a plain-TCP side channel; refused");
            wrong_transport(stream, NOT_TLS_MSG).await;
        }
        (None, false) => {
            serve_session(state, stream, peer, None, Some(guard), started, shutdown).await
        }
    }
    drop(permit);
}
