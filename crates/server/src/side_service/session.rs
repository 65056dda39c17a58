//! A session: the frame loop of one connection, hello, negotiate and
//! login (passwords checked off the runtime), and its end.

use super::*;

pub(super) enum Phase {
    Hello,
    Login {
        server_nonce: [u8; NONCE_LEN],
        client_name: String,
    },
    Ready {
        session: u64,
        principal: Principal,
    },
}

/// Serve one connection to completion over an already established transport
/// (`tls`: whether it is TLS), without admission accounting.
pub async fn serve_connection<S>(
    state: Arc<ServerState>,
    stream: S,
    peer: SocketAddr,
    shutdown: Shutdown,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send,
{
    serve_session(state, stream, peer, None, None, Instant::now(), shutdown).await
}

pub(super) async fn serve_session<S>(
    state: Arc<ServerState>,
    mut stream: S,
    peer: SocketAddr,
    binding: Option<[u8; auth::BINDING_LEN]>,
    mut guard: Option<ConnGuard>,
    started: Instant,
    shutdown: Shutdown,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send,
{
    // TLS (with the connection's exporter value), or plain TCP.
    let tls = binding.is_some();
    let mut phase = Phase::Hello;
    // The protocol version the Hello settled (1 until then): what the
    // responses may carry (`Response::for_version`).
    let mut version = 1;
    let max = state.limits.max_frame;
    debug!(%peer, tls, "connection");
    loop {
        let ready = matches!(phase, Phase::Ready { .. });
        let limit = match phase {
            Phase::Ready { .. } => state.limits.idle_timeout,
            _ => state.limits.login_timeout.saturating_sub(started.elapsed()),
        };
        // Writes get as long as reads: the idle timeout once logged in,
        // what is left of the login timeout before (at least a second to
        // say why the session ends).
        let wlimit = limit.max(Duration::from_secs(1));
        let read_max = if ready {
            max
        } else {
            max.min(PRE_LOGIN_MAX_FRAME)
        };
        // A reload may end the session (its user removed, or another
        // password or token): say why and close. (Completes only then: a
        // frame half read is never dropped for a session that goes on.)
        let current = match &phase {
            Phase::Ready { session, .. } => Some(*session),
            _ => None,
        };
        let frame = tokio::select! {
            biased;
            _ = shutdown.wait() => break,
            why = revoked_wait(&state, current.unwrap_or(0)), if current.is_some() => {
                info!(%peer, "{why}; closing session");
                let e = Error::new(ErrorCode::AuthFailed, why);
                let _ = write_within(&mut stream, &Response::Error(e).encode(0), wlimit).await;
                break;
            }
            r = tokio::time::timeout(limit, read_frame(&mut stream, read_max)) => r,
        };
        let body = match frame {
            Err(_) => {
                // A publisher may be quiet for as long as it publishes
                // (docs/memory-objects.md): its session has no idle timeout.
                if let Phase::Ready { session, .. } = &phase {
                    if state.mem_objects.publishes(*session) {
                        continue;
                    }
                }
                let what = if matches!(phase, Phase::Ready { .. }) {
                    "idle timeout"
                } else {
                    "login timeout"
                };
                info!(%peer, "{what}; closing session");
                let e = Error::new(ErrorCode::TimedOut, format!("{what}: closing session"));
                let _ = write_within(&mut stream, &Response::Error(e).encode(0), wlimit).await;
                break;
            }
            Ok(Ok(Some(b))) => b,
            Ok(Ok(None)) => break,
            Ok(Err(FrameError::TooLarge(n, m))) => {
                warn!(%peer, size = n, limit = m, "frame too large; closing session");
                let when = if ready { "" } else { " before login" };
                let e = Error::new(
                    ErrorCode::FrameTooLarge,
                    format!("frame of {n} bytes exceeds the limit of {m}{when}"),
                );
                let _ = write_within(&mut stream, &Response::Error(e).encode(0), wlimit).await;
                break;
            }
            Ok(Err(FrameError::Io(e))) => {
                debug!(%peer, error = %e, "connection error");
                break;
            }
        };
        let (id, creds, req) = match Request::decode_as(&body) {
            Ok(x) => x,
            Err(e) => {
                warn!(%peer, error = %e, "bad request; closing session");
                let id = split_body(&body).map(|(_, id, _)| id).unwrap_or(0);
                let _ =
                    write_within(&mut stream, &Response::Error(e.into()).encode(id), wlimit).await;
                break;
            }
        };
        if let (Phase::Ready { principal, .. }, Request::WatchBreaks { session_id, mac }) =
            (&phase, &req)
        {
            let target = *session_id;
            let current = match &phase {
                Phase::Ready { session, .. } => *session,
                _ => 0,
            };
            match watch_check(&state, principal, current, target, mac) {
                Ok(()) => {
                    if write_within(&mut stream, &Response::Ok.encode(id), wlimit)
                        .await
                        .is_ok()
                    {
                        watch(state.clone(), stream, target, peer, shutdown.clone()).await;
                    }
                    break;
                }
                Err(e) => {
                    warn!(%peer, session = target, "watch refused");
                    if write_within(&mut stream, &Response::Error(e).encode(id), wlimit)
                        .await
                        .is_err()
                    {
                        break;
                    }
                    continue;
                }
            }
        }
        // Hello and Login (the password check included) run inside the
        // login deadline.
        let (resp, close) = if ready {
            step(&state, &mut phase, peer, binding, creds, req).await
        } else {
            let left = state.limits.login_timeout.saturating_sub(started.elapsed());
            match tokio::time::timeout(left, step(&state, &mut phase, peer, binding, creds, req))
                .await
            {
                Ok(r) => r,
                Err(_) => {
                    info!(%peer, "login timeout during the login; closing session");
                    (
                        err(ErrorCode::TimedOut, "login timeout: closing session"),
                        true,
                    )
                }
            }
        };
        if let Response::Hello { version: v, .. } = &resp {
            version = *v;
        }
        let resp = resp.for_version(version);
        if matches!(phase, Phase::Ready { .. }) {
            if let Some(g) = guard.as_mut() {
                g.authenticated();
            }
        }
        let mut out = resp.encode(id);
        if out.len() > max as usize {
            out = Response::Error(Error::new(ErrorCode::FrameTooLarge, "response too large"))
                .encode(id);
        }
        if let Err(e) = write_within(&mut stream, &out, wlimit).await {
            if e.kind() == std::io::ErrorKind::TimedOut {
                info!(%peer, "peer does not read its answers (write timeout); closing session");
            }
            break;
        }
        if close {
            break;
        }
    }
    if let Phase::Ready { session, .. } = phase {
        state.end_session(session);
        state.forget_revoked(session);
        info!(%peer, session, "session closed");
    }
    drop(guard);
}

/// Wait until a reload ends `session`; why.
pub(super) async fn revoked_wait(state: &ServerState, session: u64) -> String {
    loop {
        let n = state.revocations.notified();
        tokio::pin!(n);
        n.as_mut().enable();
        if let Some(why) = state.revoked(session) {
            return why;
        }
        n.await;
    }
}

pub(super) fn err(code: ErrorCode, msg: impl Into<String>) -> Response {
    Response::Error(Error::new(code, msg))
}

/// Verify a password off the async threads, at most two at a time.
pub(super) async fn check_password(state: &Arc<ServerState>, user: &str, password: String) -> bool {
    let phc = state
        .security()
        .users
        .get(user)
        .and_then(|u| u.password.clone());
    let Ok(permit) = state.password_checks.clone().acquire_owned().await else {
        return false;
    };
    // The permit goes with the check: a login that times out meanwhile
    // does not free its slot before the argon2 work is done.
    tokio::task::spawn_blocking(move || {
        let _permit = permit;
        match phc {
            Some(h) => access::verify_password(&h, &password),
            None => {
                // Same work for unknown users: no user enumeration by timing.
                let _ = access::verify_password(access::dummy_password_hash(), &password);
                false
            }
        }
    })
    .await
    .unwrap_or(false)
}

/// Handle one request; returns the response and whether to close afterwards.
pub(super) async fn step(
    state: &Arc<ServerState>,
    phase: &mut Phase,
    peer: SocketAddr,
    binding: Option<[u8; auth::BINDING_LEN]>,
    creds: Option<Creds>,
    req: Request,
) -> (Response, bool) {
    let tls = binding.is_some();
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
            let sec = state.security();
            let mut methods = 0;
            if state.auth.token.is_some() {
                methods |= AUTH_TOKEN;
            }
            if state.auth.allow_anonymous {
                methods |= AUTH_ANONYMOUS;
            }
            if sec.users.values().any(|u| u.password.is_some())
                && (tls || sec.allow_password_without_tls)
            {
                methods |= AUTH_PASSWORD;
            }
            if sec.users.values().any(|u| u.token.is_some()) {
                methods |= AUTH_USER_TOKEN;
            }
            // The login's proofs use the nonce bound to this connection.
            *phase = Phase::Login {
                server_nonce: auth::bind_nonce(&server_nonce, binding.as_ref()),
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
            let client_name = client_name.clone();
            // The users a login is checked against (a reload may swap them
            // while it runs: see below).
            let users_before = state.security();
            let (secret, proof, principal) = match login(state, peer, tls, &sn, l).await {
                Ok(x) => x,
                Err(e) => return (Response::Error(e), true),
            };
            // Lost sessions kept for Resume count too (the oldest give way).
            if let Err(e) = state.make_room_for(&principal) {
                warn!(%peer, who = %principal, "per-user session limit reached");
                return (Response::Error(e), true);
            }
            let anonymous = principal == Principal::Anonymous;
            let session = state.register_session(SessionInfo {
                id: 0,
                peer,
                client_name: client_name.clone(),
                anonymous,
                principal: principal.clone(),
                tls,
                secret: SessionSecret(secret),
                nonce: sn,
            });
            // A reload that removed this user, or changed its password or
            // token, while the login was checked ended the user's sessions
            // before this one was registered: refuse it too.
            if let Principal::User(u) = &principal {
                let now = state.security();
                if !Arc::ptr_eq(&users_before, &now)
                    && users_before.users.get(u) != now.users.get(u)
                {
                    state.end_session(session);
                    warn!(%peer, user = %u, "login refused: the user's credentials changed during the login (server reload)");
                    return (
                        err(
                            ErrorCode::AuthFailed,
                            "authentication failed: the server's users changed during the login; log in again",
                        ),
                        true,
                    );
                }
            }
            info!(%peer, session, client = %client_name, who = %principal, tls, "login");
            *phase = Phase::Ready { session, principal };
            (
                Response::LoginOk {
                    session_id: session,
                    server_proof: proof,
                },
                false,
            )
        }
        (Phase::Ready { session, principal }, req) => {
            let session = *session;
            let principal = principal.clone();
            if let Some(why) = state.revoked(session) {
                info!(%peer, session, "{why}; closing session");
                return (err(ErrorCode::AuthFailed, why), true);
            }
            // A change first breaks the other sessions' leases on what it
            // touches, and makes no grants there until it is done.
            let change = touches(state, session, &principal, &req);
            let _breaking = state.leases.break_for(session, change).await;
            match handle(state, session, &principal, creds.as_ref(), req).await {
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

pub(super) type LoginOk = ([u8; MAC_LEN], [u8; MAC_LEN], Principal);

/// Check a login; (session secret, server proof, principal).
pub(super) async fn login(
    state: &Arc<ServerState>,
    peer: SocketAddr,
    tls: bool,
    sn: &[u8; NONCE_LEN],
    l: LoginRequest,
) -> Result<LoginOk, Error> {
    let fail = |m: &str| Error::new(ErrorCode::AuthFailed, m);
    match l {
        LoginRequest::Anonymous => {
            if !state.auth.allow_anonymous {
                warn!(%peer, "anonymous login refused");
                return Err(fail(
                    "anonymous access is not allowed on this server; a token is required",
                ));
            }
            Ok((
                auth::session_secret(None, sn, &[0; NONCE_LEN]),
                [0u8; MAC_LEN],
                Principal::Anonymous,
            ))
        }
        LoginRequest::Token {
            client_nonce,
            proof,
        } => {
            let Some(token) = &state.auth.token else {
                return Err(fail("this server does not accept token logins"));
            };
            if !auth::verify_client_proof(token, sn, &client_nonce, &proof) {
                warn!(%peer, "login failed: wrong token");
                return Err(fail("authentication failed: wrong token"));
            }
            Ok((
                auth::session_secret(Some(token), sn, &client_nonce),
                auth::server_proof(token, sn, &client_nonce),
                Principal::SharedToken,
            ))
        }
        LoginRequest::Password {
            user,
            password,
            client_nonce,
        } => {
            if !tls && !state.security().allow_password_without_tls {
                warn!(%peer, %user, "password login over plain TCP refused");
                return Err(fail(
                    "password login over plain TCP is refused: use TLS (or set allow_password_without_tls = true on the server)",
                ));
            }
            let secret = access::user_session_secret(password.as_bytes(), sn, &client_nonce);
            if !check_password(state, &user, password).await {
                warn!(%peer, %user, "login failed: wrong user name or password");
                return Err(fail("authentication failed: wrong user name or password"));
            }
            Ok((secret, [0u8; MAC_LEN], Principal::User(user)))
        }
        LoginRequest::UserToken {
            user,
            client_nonce,
            proof,
        } => {
            let v = state
                .security()
                .users
                .get(&user)
                .and_then(|u| u.token.clone());
            // Unknown users cost the same as wrong tokens.
            let v = v.unwrap_or_else(|| access::TokenVerifier::from_token(&auth::nonce()));
            let Some(ck) = v.verify(&user, sn, &client_nonce, &proof) else {
                warn!(%peer, %user, "login failed: wrong user name or token");
                return Err(fail("authentication failed: wrong user name or token"));
            };
            Ok((
                access::user_session_secret(&ck, sn, &client_nonce),
                v.server_proof(&user, sn, &client_nonce),
                Principal::User(user),
            ))
        }
    }
}
