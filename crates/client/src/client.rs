//! The connected client: the side channel, its RDMA channels (negotiate,
//! connect, multichannel), and the calls made on the client itself.

use super::*;

pub(crate) struct Inner {
    pub(crate) side: Mutex<Option<crate::side_client::SideClient>>,
    /// The RDMA channels, channel 0 first ([`ClientOptions::channels`]);
    /// a reconnect replaces them all.
    pub(crate) engines: RwLock<Vec<Arc<Engine>>>,
    /// Round-robin channel choice for `open`.
    pub(crate) next_channel: std::sync::atomic::AtomicUsize,
    pub(crate) export: Option<String>,
    pub(crate) server_name: String,
    /// Where and how the side channel was reached (for a second connection:
    /// the lease-break watcher).
    pub(crate) authority: String,
    pub(crate) side_opts: crate::side_client::SideOptions,
    /// How the data path was chosen (for a [`handoff::Handoff`]).
    pub(crate) provider_choice: ProviderChoice,
    pub(crate) device: Option<String>,
    /// The negotiate Key of each channel, channel 0 first: the server knows
    /// a channel by it (a publication names the channel that carries it).
    pub(crate) channel_keys: RwLock<Vec<lwio_proto::wire::Guid>>,
    /// The options connected with (a reconnect dials with them again).
    pub(crate) opts: ClientOptions,
    /// Bumped by every reconnect: a file registered at an older epoch
    /// registers again before its next request.
    pub(crate) epoch: AtomicU64,
    /// Bumped when a reconnect found the server's state gone (a restart):
    /// files opened before reopen by path and check their identity.
    pub(crate) reset: AtomicU64,
    pub(crate) reconnects: AtomicU64,
    /// RDMA channels lost and failed over to another channel without a
    /// reconnect (docs/reconnect.md, multichannel failover).
    pub(crate) failovers: AtomicU64,
    /// One reconnect (or failover) at a time.
    pub(crate) recon: Mutex<()>,
}

impl Inner {
    /// Every RDMA channel, channel 0 first (the current connections).
    pub(crate) fn channels(&self) -> Vec<Arc<Engine>> {
        self.engines
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Channel `n` (0 = the first; past the last: channel 0).
    pub(crate) fn channel(&self, n: usize) -> Arc<Engine> {
        let g = self.engines.read().unwrap_or_else(|p| p.into_inner());
        g.get(n).unwrap_or(&g[0]).clone()
    }

    /// The first channel from `from` on (wrapping around) whose
    /// connection is not lost, if any.
    pub(crate) fn live_channel(&self, from: usize) -> Option<usize> {
        let g = self.engines.read().unwrap_or_else(|p| p.into_inner());
        let n = g.len();
        (0..n)
            .map(|i| (from + i) % n)
            .find(|&i| g[i].lost().is_none())
    }

    pub(crate) fn channel_count(&self) -> usize {
        self.engines.read().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Run a side-channel call once (no reconnect).
    pub(crate) fn side_once<T>(
        &self,
        f: impl FnOnce(&mut crate::side_client::SideClient) -> lwio_side::Result<T>,
    ) -> Result<T> {
        let mut g = self.side.lock().unwrap_or_else(|p| p.into_inner());
        match g.as_mut() {
            Some(c) => Ok(f(c)?),
            None => Err(Error::ConnectionLost("side channel closed".into())),
        }
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        for e in self.channels() {
            e.shutdown();
        }
        // The blocking side-channel client owns a tokio runtime, which must
        // not be dropped inside an async context (the async API's last
        // handle may go away there).
        let side = self.side.lock().unwrap_or_else(|p| p.into_inner()).take();
        if tokio::runtime::Handle::try_current().is_ok() {
            let _ = std::thread::Builder::new()
                .name("lwio-side-close".into())
                .spawn(move || drop(side));
        } else {
            drop(side);
        }
    }
}

/// A connected client (blocking API). Cheap to share: `File`s keep it alive.
#[derive(Clone)]
pub struct Client(pub(crate) Arc<Inner>);

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("server", &self.0.server_name)
            .field("provider", &self.0.channel(0).provider())
            .field("completion", &self.0.channel(0).cfg.completion)
            .finish()
    }
}

pub(crate) fn parse_target(target: &str) -> Result<(String, String, Option<String>)> {
    if target.starts_with("lwio://") {
        let u = LwioUrl::parse(target).map_err(|e| Error::InvalidArgument(e.to_string()))?;
        return Ok((u.authority(), u.host.clone(), u.export.clone()));
    }
    let (host, authority) = if target.starts_with('[') || target.matches(':').count() == 1 {
        let h = target.rsplit_once(':').map_or(target, |(h, _)| h);
        (h.trim_matches(['[', ']']).to_string(), target.to_string())
    } else if target.contains(':') {
        (target.to_string(), format!("[{target}]:{DEFAULT_PORT}"))
    } else {
        (target.to_string(), format!("{target}:{DEFAULT_PORT}"))
    };
    Ok((authority, host, None))
}

impl Client {
    /// Run a call on this client's side-channel session: the namespace
    /// operations (stat, list, mkdir, rename, remove) that do not move data.
    ///
    /// A call that finds the connection lost reconnects and runs again
    /// ([`ClientOptions::reconnect`]; docs/reconnect.md says which calls
    /// can then fail although their first try took effect).
    pub fn side<T>(
        &self,
        f: impl FnMut(&mut crate::side_client::SideClient) -> lwio_side::Result<T>,
    ) -> Result<T> {
        self.0.side(f)
    }

    /// Reconnects so far (each one logged at info: "reconnected").
    pub fn reconnects(&self) -> u64 {
        self.0.reconnects.load(Ordering::Relaxed)
    }

    /// RDMA channels lost and failed over so far: their files moved to
    /// another channel of this client without a reconnect (each one logged
    /// at info: "RDMA channel failed over"; docs/reconnect.md).
    pub fn failovers(&self) -> u64 {
        self.0.failovers.load(Ordering::Relaxed)
    }

    /// Connect to `target` (`lwio://HOST[:PORT][/EXPORT]` or `HOST[:PORT]`)
    /// with a token; `None`: the default login (`LWIO_TOKEN`, else the
    /// default token file if it exists, else anonymous). The side channel
    /// is secured as [`ClientOptions::tls`] says: by default as the `lwio`
    /// CLI does ([`connect`] module), so a default `lwio serve` (TLS with a
    /// self-signed certificate) is trusted on first use.
    pub fn connect(target: &str, token: Option<&str>, opts: ClientOptions) -> Result<Client> {
        let args = connect::ConnectArgs {
            token: token.map(str::to_string),
            connect_timeout: Some(opts.connect_timeout),
            ..connect::ConnectArgs::default()
        };
        let mut so = crate::side_client::SideOptions::new(connect::resolve_login(&args)?);
        so.tls = match &opts.tls {
            Some(t) => t.clone(),
            None => connect::resolve_tls(&args)?,
        };
        so.client_name = opts.client_name.clone();
        so.connect_timeout = opts.connect_timeout;
        Client::connect_with(target, &so, opts)
    }

    /// [`Client::connect`] with full side-channel options (any login, TLS):
    /// what the `lwio` CLI uses.
    pub fn connect_with(
        target: &str,
        so: &crate::side_client::SideOptions,
        opts: ClientOptions,
    ) -> Result<Client> {
        let (authority, _, export) = parse_target(target)?;
        let mut side = crate::side_client::SideClient::connect(&authority, so)?;
        let (engines, server_name, channel_keys) = dial_all(&mut side, &authority, &opts)?;
        Ok(Client(Arc::new(Inner {
            side: Mutex::new(Some(side)),
            engines: RwLock::new(engines),
            next_channel: std::sync::atomic::AtomicUsize::new(0),
            export,
            server_name,
            authority,
            side_opts: so.clone(),
            provider_choice: opts.provider,
            device: opts.device.clone(),
            channel_keys: RwLock::new(channel_keys),
            opts,
            epoch: AtomicU64::new(0),
            reset: AtomicU64::new(0),
            reconnects: AtomicU64::new(0),
            failovers: AtomicU64::new(0),
            recon: Mutex::new(()),
        })))
    }

    /// Open a second side-channel connection, logged in as this client,
    /// that carries this session's directory lease breaks
    /// (docs/leases.md). Read breaks with
    /// [`side::SideClient::next_break`](crate::side_client::SideClient::next_break) and
    /// answer each with `ack_break`; leases are granted only while it is
    /// open.
    pub fn watch_breaks(&self) -> Result<crate::side_client::SideClient> {
        let main = self.0.side(|s| Ok(s.session().clone()))?;
        let mut w = crate::side_client::SideClient::connect(&self.0.authority, &self.0.side_opts)?;
        w.watch(&main)?;
        Ok(w)
    }

    /// Open a file: `EXPORT/PATH`, or `PATH` when the URL named the export.
    pub fn open(&self, path: &str, o: &OpenOptions) -> Result<File> {
        self.open_mode(path, o, 0o644)
    }

    /// [`Client::open`] with the permission bits a created file gets (before
    /// the server's umask).
    pub fn open_mode(&self, path: &str, o: &OpenOptions, mode: u32) -> Result<File> {
        self.open_as(path, o, mode, None)
    }

    /// [`Client::open_mode`] on behalf of `caller` (the ids an `identity =
    /// "client"` export acts as: docs/mount.md, "Identities"); a reopen
    /// after a server restart carries them too.
    pub fn open_as(
        &self,
        path: &str,
        o: &OpenOptions,
        mode: u32,
        caller: Option<lwio_side::types::Creds>,
    ) -> Result<File> {
        let (export, rel) = self.split(path)?;
        let inner = &self.0;
        let channel = inner
            .next_channel
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        // Opened over the side channel, then registered on an RDMA channel;
        // a connection lost in between reconnects and opens again.
        let (route, file_id) = inner.retry(|| {
            let epoch = inner.epoch.load(Ordering::Acquire);
            let reset = inner.reset.load(Ordering::Acquire);
            let rf = inner.side_once(|s| {
                s.as_caller(caller.as_ref(), |s| s.open(&export, &rel, &o.0, mode))
            })?;
            let r = reconnect::register(inner, channel, &rf, o.0.no_buffering, epoch, reset)
                .inspect_err(|_| {
                    let _ = inner.side_once(|s| s.close(rf.handle));
                })
                .map_err(|e| match e {
                    Error::Status { status, .. } => {
                        status_error(format!("REGISTER of {export}/{rel}"), status)
                    }
                    e => e,
                })?;
            Ok((r, rf.file_id))
        })?;
        Ok(File {
            client: self.clone(),
            route: Mutex::new(route),
            export,
            path: rel,
            open: o.0,
            mode,
            caller,
            file_id,
            no_buffering: o.0.no_buffering,
            closed: false,
        })
    }

    pub(crate) fn split(&self, path: &str) -> Result<(String, String)> {
        let path = path.trim_start_matches('/');
        match &self.0.export {
            Some(e) => Ok((e.clone(), path.to_string())),
            None => match path.split_once('/') {
                Some((e, p)) => Ok((e.to_string(), p.to_string())),
                None => Err(Error::InvalidArgument(format!(
                    "{path:?}: expected EXPORT/PATH"
                ))),
            },
        }
    }

    /// The export named by the URL this client connected to, if any.
    pub fn export(&self) -> Option<&str> {
        self.0.export.as_deref()
    }

    /// Send INTERRUPT and return when the server answers it (after the next
    /// I/O request on this connection completes).
    pub fn interrupt(&self) -> Result<()> {
        self.0.channel(0).interrupt()
    }

    /// Statistics of channel 0 (see [`Client::channel_stats`]).
    pub fn stats(&self) -> ClientStats {
        self.0.channel(0).stats()
    }

    /// How many RDMA channels this client holds ([`ClientOptions::channels`]).
    pub fn channels(&self) -> usize {
        self.0.channel_count()
    }

    /// Every RDMA channel's engine, channel 0 first (tests only: the
    /// `test-support` feature).
    #[cfg(feature = "test-support")]
    #[doc(hidden)]
    pub fn engines(&self) -> Vec<Arc<Engine>> {
        self.0.channels()
    }

    /// Signal `fd` (an eventfd) at every request completion on every
    /// channel from now on (`None`: stop), so that a caller can sleep in
    /// epoll until there is something to reap (the C API's
    /// `lwio_completion_fd`).
    pub fn set_completion_notify(&self, fd: Option<Arc<std::os::fd::OwnedFd>>) {
        for e in self.0.channels() {
            e.set_notify(fd.clone());
        }
    }

    /// Statistics of channel `n`, if it exists.
    pub fn channel_stats(&self, n: usize) -> Option<ClientStats> {
        (n < self.channels()).then(|| self.0.channel(n).stats())
    }

    /// Restart the `max_outstanding` high-water mark of [`ClientStats`].
    pub fn reset_peak(&self) {
        self.0.channel(0).reset_peak()
    }

    pub fn credits(&self) -> u16 {
        self.0.channel(0).credits()
    }

    pub fn provider(&self) -> &'static str {
        self.0.channel(0).provider()
    }

    pub fn completion(&self) -> Completion {
        self.0.channel(0).cfg.completion
    }

    /// The RDMA engine of channel 0, for tests that issue raw requests
    /// (the `test-support` feature): the current connection (a reconnect
    /// replaces it).
    #[cfg(feature = "test-support")]
    #[doc(hidden)]
    pub fn engine(&self) -> Arc<Engine> {
        self.0.channel(0)
    }
}

/// Negotiate and connect every RDMA channel of `opts` over a logged-in side
/// channel: (channels, the server's name, each channel's negotiate Key).
#[allow(clippy::type_complexity)]
pub(crate) fn dial_all(
    side: &mut crate::side_client::SideClient,
    authority: &str,
    opts: &ClientOptions,
) -> Result<(Vec<Arc<Engine>>, String, Vec<lwio_proto::wire::Guid>)> {
    let session = side.session().clone();
    let side_ip: Option<IpAddr> = (authority, 0)
        .to_socket_addrs()
        .ok()
        .or_else(|| authority.to_socket_addrs().ok())
        .and_then(|mut a| a.next())
        .map(|a| a.ip());
    // Negotiate over the pipe: offer every local instance the options
    // allow, by wire transport (docs/protocol.md §2.8).
    let cands = discovery::local_candidates(opts.provider, opts.device.as_deref(), side_ip);
    let offered: Vec<_> = cands.iter().map(|c| c.instance).collect();
    let client_key = lwio_side::negotiate::random_guid();
    let req = NegotiateRequestRepr {
        client_name: truncate_name(&opts.client_name),
        key: client_key,
        response_length: 4096,
        providers: lwio_proto::transport::to_blocks(&offered),
    };
    let cfg = EngineConfig {
        completion: opts.completion,
        credits: opts.credits,
        max_credits: opts.max_credits,
        read_chunk: opts.read_chunk.next_multiple_of(4096).max(4096),
        stage_slots: opts.stage_slots.max(1),
        write_chunk: opts.write_chunk.max(512),
        send_slots: opts.send_slots,
        poll_spin: opts.poll_spin,
        busy_poll: opts.busy_poll,
        op_timeout: opts.op_timeout,
        auth_timeout: opts.connect_timeout,
        register_threshold: usize::MAX,
        reg_cache_bytes: opts.reg_cache_bytes,
        reg_cache_entries: opts.reg_cache_entries,
    };
    let mut dial = Dial {
        cands: &cands,
        opened: Vec::new(),
        opts,
        cfg,
        side_ip,
        client_key,
    };
    // Channel 0, then (claim 9) the other channels: each negotiates a
    // Key of its own (the server takes each Key once) and starts at
    // another shared path where there are several.
    let (engine, server_name, key0) = dial.channel(side, &req, &session, 0)?;
    let mut engines = vec![engine];
    let mut channel_keys = vec![key0];
    for n in 1..opts.channels.max(1) {
        let req = NegotiateRequestRepr {
            key: client_key,
            ..req.clone()
        };
        let (e, _, k) = dial.channel(side, &req, &session, n)?;
        engines.push(e);
        channel_keys.push(k);
    }
    Ok((engines, server_name, channel_keys))
}

pub(crate) fn truncate_name(s: &str) -> String {
    let mut out = String::new();
    for c in s.chars() {
        if out.encode_utf16().count() + c.len_utf16() > 63 || c == '\0' {
            break;
        }
        out.push(c);
    }
    if out.is_empty() {
        "lwio-client".into()
    } else {
        out
    }
}

/// Connecting RDMA channels over the paths negotiate found.
pub(crate) struct Dial<'a> {
    pub(crate) cands: &'a [discovery::Candidate],
    /// Devices opened so far (index into `cands`).
    pub(crate) opened: Vec<(usize, lwio_rdma::Context)>,
    pub(crate) opts: &'a ClientOptions,
    pub(crate) cfg: EngineConfig,
    pub(crate) side_ip: Option<IpAddr>,
    pub(crate) client_key: lwio_proto::wire::Guid,
}

impl Dial<'_> {
    /// Negotiate and connect channel `n`: the best shared path first (for
    /// n > 0 rotated by n, so channels spread over several paths), until one
    /// connects and authenticates.
    pub(crate) fn channel(
        &mut self,
        side: &mut crate::side_client::SideClient,
        req: &NegotiateRequestRepr,
        session: &crate::side_client::Session,
        n: usize,
    ) -> Result<(Arc<Engine>, String, lwio_proto::wire::Guid)> {
        let resp = match side.negotiate(req) {
            Ok(r) => r,
            Err(e)
                if e.message
                    .starts_with(lwio_side::negotiate::NO_COMMON_TRANSPORT) =>
            {
                return Err(Error::NoCommonTransport(e.message));
            }
            Err(e) => return Err(e.into()),
        };
        let server = lwio_proto::transport::from_blocks(&resp.providers);
        let secret =
            lwio_proto::wire::auth::derive_session_secret(&session.secret.0, &resp.key).to_vec();
        let mut paths = discovery::paths(self.cands, &server, self.side_ip);
        if paths.is_empty() {
            return Err(Error::NoCommonTransport(format!(
                "{}: the client offers {}, the server offers {}",
                lwio_side::negotiate::NO_COMMON_TRANSPORT,
                discovery::describe_local(self.cands),
                lwio_proto::transport::describe(&server, true)
            )));
        }
        let k = n % paths.len();
        paths.rotate_left(k);
        let mut last: Option<Error> = None;
        for (ci, addr) in paths {
            let cand = &self.cands[ci];
            let ctx = match self.opened.iter().find(|(i, _)| *i == ci) {
                Some((_, c)) => c.clone(),
                None => match cand.provider.open(Some(&cand.device.name), &self.opts.rdma) {
                    Ok(c) => {
                        self.opened.push((ci, c.clone()));
                        c
                    }
                    Err(e) => {
                        debug!(device = %cand.device.name, error = %e, "device not usable here");
                        last = Some(e.into());
                        continue;
                    }
                },
            };
            let mut cfg = self.cfg.clone();
            cfg.register_threshold = self
                .opts
                .register_threshold
                .unwrap_or_else(|| default_register_threshold(cand.provider.name()))
                .max(engine::BOUNCE_THRESHOLD);
            match Engine::connect(&ctx, addr, resp.key, secret.clone(), cfg) {
                Ok(engine) => {
                    info!(
                        server = %resp.server_name,
                        %addr,
                        channel = n,
                        provider = cand.provider.name(),
                        device = %cand.device.name,
                        transport = %cand.instance.transport,
                        client_uuid = %self.client_key,
                        "connected"
                    );
                    return Ok((engine, resp.server_name.clone(), resp.key));
                }
                Err(e @ Error::AccessDenied(_)) => return Err(e),
                Err(e) => {
                    debug!(%addr, device = %cand.device.name, error = %e, "RDMA connect failed");
                    last = Some(e);
                }
            }
        }
        Err(last.unwrap_or_else(|| Error::NoCommonTransport("no usable RDMA path".into())))
    }
}
