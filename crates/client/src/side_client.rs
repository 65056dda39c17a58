//! Side-channel clients: [`AsyncSideClient`] (tokio, generic over the transport)
//! and [`SideClient`] (blocking, owns a small runtime).

use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;

use lwio_proto::sidechannel::parse_request_resume_key;
use lwio_proto::wire::RequestResumeKeyRepr as SrvRequestResumeKey;
use lwio_side::auth;
use lwio_side::codec::*;
use lwio_side::error::{Error, ErrorCode, Result};
use lwio_side::negotiate::{self, NegotiateRequestRepr, NegotiateResponseRepr};
use lwio_side::tls::SideStream;
use lwio_side::types::{AttrX, Creds, DirEntry, OpenOptions};
use lwio_side::SessionSecret;

mod ops;
/// What an application needs to log in and secure the side channel.
pub use lwio_side::{tls, ClientTls, Login, Token};

/// How to connect and log in.
#[derive(Debug, Clone)]
pub struct SideOptions {
    pub login: Login,
    /// Name the server logs for this client.
    pub client_name: String,
    pub connect_timeout: Duration,
    /// Per-request timeout.
    pub request_timeout: Duration,
    /// Largest response accepted.
    pub max_frame: u32,
    /// Transport security. [`SideOptions::new`] leaves it
    /// [`ClientTls::Off`] (plain TCP, for embedded and test servers);
    /// [`SideOptions::resolve`] gives the one default of the CLI, the C
    /// API and `SideClient::connect`: TLS (crate::connect).
    pub tls: ClientTls,
    /// Send a password even over plain TCP (the server must allow it too).
    pub allow_plain_password: bool,
    /// The ids the requests carry (what an `identity = "client"` export
    /// acts as, for a login it trusts): by default this process's real
    /// uid, gid and groups, as an NFS client sends its caller's.
    pub caller: Option<Creds>,
}

/// This process's real uid and gid and its supplementary groups.
pub fn process_ids() -> Creds {
    // SAFETY: getuid/getgid cannot fail; getgroups with size 0 only counts.
    let (uid, gid, n) = unsafe {
        (
            libc::getuid(),
            libc::getgid(),
            libc::getgroups(0, std::ptr::null_mut()),
        )
    };
    let mut groups = vec![0; n.max(0) as usize];
    // SAFETY: the kernel writes at most `groups.len()` gids into it.
    let m = unsafe { libc::getgroups(groups.len() as libc::c_int, groups.as_mut_ptr()) };
    groups.truncate(m.max(0) as usize);
    groups.truncate(lwio_side::types::MAX_GROUPS);
    Creds { uid, gid, groups }
}

impl SideOptions {
    pub fn new(login: Login) -> SideOptions {
        SideOptions {
            login,
            client_name: lwio_side::host_name(),
            connect_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(30),
            max_frame: HARD_MAX_FRAME,
            tls: ClientTls::Off,
            allow_plain_password: false,
            caller: Some(process_ids()),
        }
    }
}

/// The logged-in session, client side.
#[derive(Debug, Clone)]
pub struct Session {
    pub id: u64,
    /// The per-session secret; keys the RDMA-phase AUTH signature.
    pub secret: SessionSecret,
    pub anonymous: bool,
    /// The user logged in as (password or per-user token logins).
    pub user: Option<String>,
    /// Whether the side channel runs over TLS.
    pub tls: bool,
    pub server_name: String,
    pub version: u16,
    /// The server nonce of this connection's login, bound to its TLS
    /// connection (`auth::bind_nonce`): `Resume` and `WatchBreaks` proofs
    /// sent on this connection carry it.
    pub nonce: [u8; NONCE_LEN],
}

/// A file opened over the side channel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteFile {
    pub handle: u64,
    pub size: u64,
    /// Required alignment for unbuffered I/O (1 when buffered).
    pub align: u32,
    /// To present in the RDMA REGISTER.
    pub resume_key: SrvRequestResumeKey,
    /// What identifies the file itself across server restarts (0 =
    /// unknown: a memory object, or an older server).
    pub file_id: u64,
}

/// Async side-channel client over any byte stream.
#[derive(Debug)]
pub struct AsyncSideClient<S = SideStream> {
    stream: S,
    next_id: u32,
    session: Session,
    max_frame: u32,
    timeout: Duration,
    /// Whose ids the requests carry ([`AsyncSideClient::set_caller`]).
    caller: Option<Creds>,
}

fn lost(e: impl std::fmt::Display) -> Error {
    Error::new(
        ErrorCode::Disconnected,
        format!("connection to the server lost: {e}"),
    )
}

impl AsyncSideClient<SideStream> {
    /// Connect to `addr` (`host:port`), run TLS as `opts.tls` says, log in.
    /// A refusal the server marks as passing ("… retry later": its
    /// admission control, while too many connections from this host are
    /// logging in at once) is tried again, backing off from 10 to 200 ms,
    /// within `connect_timeout`.
    pub async fn connect(addr: &str, opts: &SideOptions) -> Result<AsyncSideClient<SideStream>> {
        let deadline = tokio::time::Instant::now() + opts.connect_timeout;
        let mut backoff = Duration::from_millis(10);
        loop {
            match Self::connect_once(addr, opts).await {
                Err(e)
                    if e.code == ErrorCode::Busy
                        && e.message.ends_with("retry later")
                        && tokio::time::Instant::now() + backoff < deadline =>
                {
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_millis(200));
                }
                r => return r,
            }
        }
    }

    async fn connect_once(addr: &str, opts: &SideOptions) -> Result<AsyncSideClient<SideStream>> {
        let stream =
            match tokio::time::timeout(opts.connect_timeout, TcpStream::connect(addr)).await {
                Err(_) => {
                    return Err(Error::new(
                        ErrorCode::ConnectFailed,
                        format!(
                            "cannot connect to {addr}: timed out after {:?}",
                            opts.connect_timeout
                        ),
                    ))
                }
                Ok(Err(e)) => {
                    let hint = if e.kind() == std::io::ErrorKind::ConnectionRefused {
                        " (is `lwio serve` running there?)"
                    } else {
                        ""
                    };
                    return Err(Error::new(
                        ErrorCode::ConnectFailed,
                        format!("cannot connect to {addr}: {e}{hint}"),
                    ));
                }
                Ok(Ok(s)) => s,
            };
        let _ = stream.set_nodelay(true);
        let stream = tls::connect(stream, addr, &opts.tls, opts.connect_timeout).await?;
        let secure = stream.is_tls();
        let binding = stream.channel_binding();
        if secure && binding.is_none() {
            return Err(Error::new(
                ErrorCode::ConnectFailed,
                format!("{addr}: the TLS connection exports no channel binding"),
            ));
        }
        AsyncSideClient::handshake_bound(stream, opts, secure, binding).await
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin + Send> AsyncSideClient<S> {
    /// Hello + login over an established stream, taken to be plain (no
    /// password over it unless `opts.allow_plain_password`).
    pub async fn handshake(stream: S, opts: &SideOptions) -> Result<AsyncSideClient<S>> {
        AsyncSideClient::handshake_over(stream, opts, false).await
    }

    /// Hello + login; `secure`: the stream is TLS (or otherwise protected).
    pub async fn handshake_over(
        stream: S,
        opts: &SideOptions,
        secure: bool,
    ) -> Result<AsyncSideClient<S>> {
        AsyncSideClient::handshake_bound(stream, opts, secure, None).await
    }

    /// Hello + login, the login bound to the transport by `binding` (a TLS
    /// connection's exporter value, `SideStream::channel_binding`).
    pub async fn handshake_bound(
        stream: S,
        opts: &SideOptions,
        secure: bool,
        binding: Option<[u8; lwio_side::auth::BINDING_LEN]>,
    ) -> Result<AsyncSideClient<S>> {
        let mut c = AsyncSideClient {
            stream,
            caller: opts.caller.clone(),
            next_id: 1,
            session: Session {
                id: 0,
                secret: SessionSecret([0; 32]),
                anonymous: true,
                user: None,
                tls: secure,
                server_name: String::new(),
                version: 0,
                nonce: [0; NONCE_LEN],
            },
            max_frame: opts.max_frame,
            timeout: opts.request_timeout,
        };
        let hello = c
            .call(Request::Hello {
                version: PROTOCOL_VERSION,
                client_name: opts.client_name.clone(),
            })
            .await?;
        let Response::Hello {
            version,
            server_name,
            server_nonce,
            auth_methods,
            max_frame,
        } = hello
        else {
            return Err(unexpected(&hello));
        };
        if !(MIN_PROTOCOL_VERSION..=PROTOCOL_VERSION).contains(&version) {
            return Err(Error::new(
                ErrorCode::UnsupportedVersion,
                format!("server chose unsupported version {version}"),
            ));
        }
        c.max_frame = c.max_frame.min(max_frame.max(MIN_MAX_FRAME));
        let cn = auth::nonce();
        let sn = auth::bind_nonce(&server_nonce, binding.as_ref());
        let no = |m: &str| Error::new(ErrorCode::AuthFailed, m);
        // (request, session secret, expected server proof check, user)
        let (req, secret, user): (LoginRequest, [u8; MAC_LEN], Option<String>) = match &opts.login {
            Login::Anonymous => {
                if auth_methods & AUTH_ANONYMOUS == 0 {
                    return Err(no(
                        "the server requires a token (use --token-file FILE or set LWIO_TOKEN)",
                    ));
                }
                (
                    LoginRequest::Anonymous,
                    auth::session_secret(None, &sn, &[0u8; NONCE_LEN]),
                    None,
                )
            }
            Login::Token(t) => (
                LoginRequest::Token {
                    client_nonce: cn,
                    proof: auth::client_proof(t, &sn, &cn),
                },
                auth::session_secret(Some(t), &sn, &cn),
                None,
            ),
            Login::Password { user, password } => {
                if !secure && !opts.allow_plain_password {
                    return Err(no(
                        "refusing to send a password over plain TCP: use TLS (or a token)",
                    ));
                }
                if auth_methods & AUTH_PASSWORD == 0 {
                    return Err(no(if secure {
                        "the server does not accept password logins"
                    } else {
                        "the server does not accept password logins over plain TCP"
                    }));
                }
                (
                    LoginRequest::Password {
                        user: user.clone(),
                        password: password.clone(),
                        client_nonce: cn,
                    },
                    lwio_side::user_token::user_session_secret(password.as_bytes(), &sn, &cn),
                    Some(user.clone()),
                )
            }
            Login::UserToken { user, token } => (
                LoginRequest::UserToken {
                    user: user.clone(),
                    client_nonce: cn,
                    proof: lwio_side::user_token::user_token_proof(token.expose(), user, &sn, &cn),
                },
                lwio_side::user_token::user_session_secret(
                    &lwio_side::user_token::user_token_client_key(token.expose()),
                    &sn,
                    &cn,
                ),
                Some(user.clone()),
            ),
        };
        let r = c.call(Request::Login(req)).await?;
        let Response::LoginOk {
            session_id,
            server_proof,
        } = r
        else {
            return Err(unexpected(&r));
        };
        let server_ok = match &opts.login {
            Login::Token(t) => auth::verify_server_proof(t, &sn, &cn, &server_proof),
            Login::UserToken { user, token } => {
                lwio_side::user_token::verify_user_token_server_proof(
                    token.expose(),
                    user,
                    &sn,
                    &cn,
                    &server_proof,
                )
            }
            // Nothing to prove with a password (TLS authenticates the
            // server) or anonymously.
            Login::Anonymous | Login::Password { .. } => true,
        };
        if !server_ok {
            return Err(no(
                "the server could not prove it knows the token (wrong server?)",
            ));
        }
        c.session = Session {
            id: session_id,
            secret: SessionSecret(secret),
            anonymous: matches!(opts.login, Login::Anonymous),
            user,
            tls: secure,
            server_name,
            version,
            nonce: sn,
        };
        Ok(c)
    }

    /// The logged-in session (id, secret for the RDMA AUTH).
    pub fn session(&self) -> &Session {
        &self.session
    }

    /// The requests from now on carry these ids (the calling process's:
    /// what an `identity = "client"` export acts as, docs/mount.md,
    /// "Identities"); `None` = none. Sent only to a server of protocol
    /// [`CREDS_VERSION`] or later.
    pub fn set_caller(&mut self, c: Option<Creds>) {
        self.caller = c;
    }

    /// Send one request and wait for its response; server errors become `Err`.
    pub async fn call(&mut self, req: Request) -> Result<Response> {
        let id = self.next_id;
        self.next_id = self.next_id.wrapping_add(1).max(1);
        let caller = self
            .caller
            .as_ref()
            .filter(|_| self.session.version >= CREDS_VERSION);
        let body = req.encode_as(id, caller);
        if body.len() > self.max_frame as usize {
            return Err(Error::new(ErrorCode::FrameTooLarge, "request too large"));
        }
        let max = self.max_frame;
        let io = async {
            write_frame(&mut self.stream, &body).await.map_err(lost)?;
            match read_frame(&mut self.stream, max).await {
                Ok(Some(b)) => Ok(b),
                Ok(None) => Err(lost("closed by the server")),
                Err(FrameError::TooLarge(n, m)) => Err(Error::new(
                    ErrorCode::FrameTooLarge,
                    format!("response of {n} bytes exceeds the limit of {m}"),
                )),
                Err(FrameError::Io(e)) => Err(lost(e)),
            }
        };
        let b = tokio::time::timeout(self.timeout, io).await.map_err(|_| {
            Error::new(
                ErrorCode::TimedOut,
                format!("no answer from the server within {:?}", self.timeout),
            )
        })??;
        let (rid, resp) = Response::decode(&b)
            .map_err(|e| Error::new(ErrorCode::BadRequest, format!("server sent {e}")))?;
        if let Response::Error(e) = resp {
            return Err(e);
        }
        if rid != id {
            return Err(Error::new(
                ErrorCode::BadRequest,
                format!("response id {rid} does not match request {id}"),
            ));
        }
        Ok(resp)
    }

    async fn ok(&mut self, req: Request) -> Result<()> {
        match self.call(req).await? {
            Response::Ok => Ok(()),
            r => Err(unexpected(&r)),
        }
    }

    /// Say goodbye and drop the connection.
    pub async fn bye(mut self) -> Result<()> {
        self.ok(Request::Bye).await
    }

    /// All entries of a directory (follows pages).
    pub async fn list_dir(&mut self, export: &str, path: &str) -> Result<Vec<DirEntry>> {
        let mut out = Vec::new();
        let mut cookie = 0;
        loop {
            let r = self
                .call(Request::ListDir {
                    export: export.into(),
                    path: path.into(),
                    cookie,
                })
                .await?;
            let Response::DirPage {
                entries,
                next_cookie,
            } = r
            else {
                return Err(unexpected(&r));
            };
            for e in entries {
                check_entry_name(&e.name)?;
                out.push(DirEntry {
                    name: e.name,
                    attr: e.attr,
                });
            }
            if next_cookie == 0 || next_cookie <= cookie {
                return Ok(out);
            }
            cookie = next_cookie;
        }
    }

    /// All entries of a directory with full attributes (follows pages).
    pub async fn list_dir_x(&mut self, export: &str, path: &str) -> Result<Vec<(String, AttrX)>> {
        let mut out = Vec::new();
        let mut cookie = 0;
        loop {
            let r = self
                .call(Request::ListDirX {
                    export: export.into(),
                    path: path.into(),
                    cookie,
                })
                .await?;
            let Response::DirPageX {
                entries,
                next_cookie,
            } = r
            else {
                return Err(unexpected(&r));
            };
            for (name, _) in &entries {
                check_entry_name(name)?;
            }
            out.extend(entries);
            if next_cookie == 0 || next_cookie <= cookie {
                return Ok(out);
            }
            cookie = next_cookie;
        }
    }

    /// Open (or create) a file; returns its handle, size and resume key.
    pub async fn open(
        &mut self,
        export: &str,
        path: &str,
        o: &OpenOptions,
        mode: u32,
    ) -> Result<RemoteFile> {
        let mut access = 0;
        if o.read {
            access |= ACCESS_READ;
        }
        if o.write {
            access |= ACCESS_WRITE;
        }
        let mut flags = 0;
        for (on, bit) in [
            (o.create, OPEN_CREATE),
            (o.exclusive, OPEN_EXCLUSIVE),
            (o.truncate, OPEN_TRUNCATE),
            (o.no_buffering, OPEN_NO_BUFFERING),
            (o.write_through, OPEN_WRITE_THROUGH),
            (o.sync, OPEN_SYNC),
        ] {
            if on {
                flags |= bit;
            }
        }
        let r = self
            .call(Request::Open {
                export: export.into(),
                path: path.into(),
                access,
                flags,
                mode,
            })
            .await?;
        opened(r)
    }

    /// Take over the open files of lost session `old` of the same login
    /// (durable handles, docs/reconnect.md); returns how many.
    pub async fn resume(&mut self, old: &Session) -> Result<u64> {
        let mac = auth::resume_mac(&old.secret, old.id, &self.session.nonce);
        let r = self
            .call(Request::Resume {
                session_id: old.id,
                mac,
            })
            .await?;
        match r {
            Response::Resumed { files } => Ok(files),
            r => Err(unexpected(&r)),
        }
    }

    /// A fresh resume key for open file `handle` (to REGISTER it on a new
    /// RDMA connection).
    pub async fn rekey(&mut self, handle: u64) -> Result<RemoteFile> {
        let r = self.call(Request::Rekey { handle }).await?;
        opened(r)
    }

    /// Turn this connection into the carrier of the lease breaks of session
    /// `main` (another logged-in session of the same user, whose secret
    /// proves the binding). From then on, read breaks with
    /// [`AsyncSideClient::next_break`] and answer each with
    /// [`AsyncSideClient::ack_break`].
    pub async fn watch(&mut self, main: &Session) -> Result<()> {
        let mac = auth::breaks_mac(&main.secret, main.id, &self.session.nonce);
        self.ok(Request::WatchBreaks {
            session_id: main.id,
            mac,
        })
        .await
    }

    /// The next lease break on a watching connection: (lease id, export,
    /// directory). Waits as long as it takes; an error means the watch (and
    /// with it every lease of the session) is over.
    pub async fn next_break(&mut self) -> Result<(u64, String, String)> {
        let b = match read_frame(&mut self.stream, self.max_frame).await {
            Ok(Some(b)) => b,
            Ok(None) => return Err(lost("closed by the server")),
            Err(FrameError::TooLarge(n, m)) => {
                return Err(Error::new(
                    ErrorCode::FrameTooLarge,
                    format!("message of {n} bytes exceeds the limit of {m}"),
                ))
            }
            Err(FrameError::Io(e)) => return Err(lost(e)),
        };
        match Response::decode(&b) {
            Ok((
                _,
                Response::LeaseBreak {
                    lease_id,
                    export,
                    path,
                },
            )) => Ok((lease_id, export, path)),
            Ok((_, Response::Error(e))) => Err(e),
            Ok((_, r)) => Err(unexpected(&r)),
            Err(e) => Err(Error::new(
                ErrorCode::BadRequest,
                format!("server sent {e}"),
            )),
        }
    }

    /// Acknowledge a break: the cache of that lease is gone.
    pub async fn ack_break(&mut self, lease_id: u64) -> Result<()> {
        let body = Request::LeaseBreakAck { lease_id }.encode(0);
        tokio::time::timeout(self.timeout, write_frame(&mut self.stream, &body))
            .await
            .map_err(|_| Error::new(ErrorCode::TimedOut, "acknowledging a lease break"))?
            .map_err(lost)
    }

    /// The pipe: send our providers, get the common ones, a server Key and
    /// the addresses to connect to.
    pub async fn negotiate(&mut self, req: &NegotiateRequestRepr) -> Result<NegotiateResponseRepr> {
        let r = self
            .call(Request::Negotiate {
                request: negotiate::encode_request(req)?,
            })
            .await?;
        let Response::Negotiated { response } = r else {
            return Err(unexpected(&r));
        };
        negotiate::decode_response(&response)
    }
}

/// A listed entry's name must be one path component: not empty, `.` or
/// `..`, without `/` or NUL. A malicious server could otherwise make a
/// consumer that joins names to a local path (`lwio cp -r`, the mount)
/// climb out of its destination (`../x`) or replace it (an absolute name).
pub fn check_entry_name(name: &str) -> Result<()> {
    if name.is_empty() || name == "." || name == ".." || name.contains(['/', '\0']) {
        return Err(Error::new(
            ErrorCode::BadRequest,
            format!("server listed an invalid entry name {name:?}"),
        ));
    }
    Ok(())
}

fn unexpected(r: &Response) -> Error {
    Error::new(
        ErrorCode::BadRequest,
        format!("unexpected response from server: {r:?}"),
    )
}

/// Blocking side-channel client (owns a single-threaded tokio runtime).
#[derive(Debug)]
pub struct SideClient {
    rt: tokio::runtime::Runtime,
    inner: AsyncSideClient<SideStream>,
}

impl SideClient {
    /// Connect to `addr` (`host:port`) and log in.
    pub fn connect(addr: &str, opts: &SideOptions) -> Result<SideClient> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| Error::from_io(&e, "tokio runtime"))?;
        let inner = rt.block_on(AsyncSideClient::connect(addr, opts))?;
        Ok(SideClient { rt, inner })
    }

    pub fn session(&self) -> &Session {
        self.inner.session()
    }
    /// See [`AsyncSideClient::set_caller`].
    pub fn set_caller(&mut self, c: Option<Creds>) {
        self.inner.set_caller(c)
    }
    /// `f` with the requests carrying `c` (`None`: the connection's own,
    /// [`SideOptions::caller`]), then the connection's own again.
    pub fn as_caller<T>(&mut self, c: Option<&Creds>, f: impl FnOnce(&mut SideClient) -> T) -> T {
        let Some(c) = c else { return f(self) };
        let own = self.inner.caller.replace(c.clone());
        let r = f(self);
        self.inner.caller = own;
        r
    }
    pub fn bye(self) -> Result<()> {
        self.rt.block_on(self.inner.bye())
    }
    pub fn list_dir(&mut self, export: &str, path: &str) -> Result<Vec<DirEntry>> {
        self.rt.block_on(self.inner.list_dir(export, path))
    }
    pub fn open(
        &mut self,
        export: &str,
        path: &str,
        o: &OpenOptions,
        mode: u32,
    ) -> Result<RemoteFile> {
        self.rt.block_on(self.inner.open(export, path, o, mode))
    }
    /// See [`AsyncSideClient::resume`].
    pub fn resume(&mut self, old: &Session) -> Result<u64> {
        self.rt.block_on(self.inner.resume(old))
    }
    /// See [`AsyncSideClient::rekey`].
    pub fn rekey(&mut self, handle: u64) -> Result<RemoteFile> {
        self.rt.block_on(self.inner.rekey(handle))
    }
    pub fn negotiate(&mut self, req: &NegotiateRequestRepr) -> Result<NegotiateResponseRepr> {
        self.rt.block_on(self.inner.negotiate(req))
    }
    pub fn list_dir_x(&mut self, export: &str, path: &str) -> Result<Vec<(String, AttrX)>> {
        self.rt.block_on(self.inner.list_dir_x(export, path))
    }
    /// See [`AsyncSideClient::watch`].
    pub fn watch(&mut self, main: &Session) -> Result<()> {
        self.rt.block_on(self.inner.watch(main))
    }
    /// See [`AsyncSideClient::next_break`].
    pub fn next_break(&mut self) -> Result<(u64, String, String)> {
        self.rt.block_on(self.inner.next_break())
    }
    /// See [`AsyncSideClient::ack_break`].
    pub fn ack_break(&mut self, lease_id: u64) -> Result<()> {
        self.rt.block_on(self.inner.ack_break(lease_id))
    }
}

/// Memory objects (docs/memory-objects.md): the side-channel calls behind
/// [`crate::Client::publish`].
impl<S: AsyncRead + AsyncWrite + Unpin + Send> AsyncSideClient<S> {
    /// Publish `size` bytes at `addr` behind `rkey` on the RDMA channel
    /// negotiated with `channel_key`, as `export`/.lwio-mem/`name`
    /// (`rights`: `MEM_READ`, or `MEM_READ | MEM_WRITE`). Returns the
    /// object's path in the export.
    #[allow(clippy::too_many_arguments)]
    pub async fn publish(
        &mut self,
        export: &str,
        name: &str,
        size: u64,
        addr: u64,
        rkey: u32,
        rights: u8,
        channel_key: [u8; 16],
    ) -> Result<String> {
        match self
            .call(Request::Publish {
                export: export.into(),
                name: name.into(),
                size,
                addr,
                rkey,
                rights,
                channel_key,
            })
            .await?
        {
            Response::Published { path } => Ok(path),
            r => Err(unexpected(&r)),
        }
    }

    /// Withdraw an object this session published.
    pub async fn unpublish(&mut self, export: &str, name: &str) -> Result<()> {
        self.ok(Request::Unpublish {
            export: export.into(),
            name: name.into(),
        })
        .await
    }

    /// Wait (at most `timeout_ms`, the server caps it at 60 s) until more
    /// than `seen` writes into an object this session published have
    /// completed; the count.
    pub async fn wait_writes(
        &mut self,
        export: &str,
        name: &str,
        seen: u64,
        timeout_ms: u32,
    ) -> Result<u64> {
        match self
            .call(Request::WaitWrites {
                export: export.into(),
                name: name.into(),
                seen,
                timeout_ms,
            })
            .await?
        {
            Response::Writes(n) => Ok(n),
            r => Err(unexpected(&r)),
        }
    }
}

impl SideClient {
    /// See [`AsyncSideClient::publish`].
    #[allow(clippy::too_many_arguments)]
    pub fn publish(
        &mut self,
        export: &str,
        name: &str,
        size: u64,
        addr: u64,
        rkey: u32,
        rights: u8,
        channel_key: [u8; 16],
    ) -> Result<String> {
        self.rt.block_on(
            self.inner
                .publish(export, name, size, addr, rkey, rights, channel_key),
        )
    }

    /// See [`AsyncSideClient::unpublish`].
    pub fn unpublish(&mut self, export: &str, name: &str) -> Result<()> {
        self.rt.block_on(self.inner.unpublish(export, name))
    }

    /// See [`AsyncSideClient::wait_writes`].
    pub fn wait_writes(
        &mut self,
        export: &str,
        name: &str,
        seen: u64,
        timeout_ms: u32,
    ) -> Result<u64> {
        self.rt
            .block_on(self.inner.wait_writes(export, name, seen, timeout_ms))
    }
}

/// An `Opened` response as a [`RemoteFile`].
fn opened(r: Response) -> Result<RemoteFile> {
    let Response::Opened {
        handle,
        size,
        align,
        resume_key,
        file_id,
    } = r
    else {
        return Err(unexpected(&r));
    };
    let resume_key = parse_request_resume_key(&resume_key)
        .map_err(|_| Error::new(ErrorCode::BadRequest, "server sent a malformed resume key"))?;
    Ok(RemoteFile {
        handle,
        size,
        align,
        resume_key,
        file_id,
    })
}
