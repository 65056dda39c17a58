//! A whole server from one call: [`Service::start`] takes a (flag-merged,
//! validated) [`Config`] and does what `lwio serve` does before it serves —
//! load or create the token file, load or create the TLS identity, build
//! the runtime, bind the side channel, bind the RDMA listener (on the side
//! channel's port + 1 unless `rdma_listen` says otherwise), serve metrics
//! when asked — and then serves on a thread of its own until
//! [`Service::stop`] (or a trigger of [`Service::shutdown_handle`]).
//!
//! [`Service::start_with`] is the lower half for embedders and test kits
//! that assemble [`ServerOptions`] and [`Security`] themselves (plain TCP,
//! a token in memory, an RDMA listener of their choosing).
//!
//! Both build their own tokio runtime: call them from plain threads, not
//! from inside a runtime.
//!
//! Nothing is printed: the caller reads the bound addresses
//! ([`Service::side_addr`], [`Service::rdma_listeners`],
//! [`Service::metrics_addr`]) and the TLS fingerprint and says what it
//! wants. What it decides is logged (tracing), as `lwio serve` always did.

use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use lwio_proto::transport::Instance;
use lwio_side::error::{Error, ErrorCode, Result};
use lwio_side::Token;

use crate::config::{default_token_file, Config, ProviderChoice};
use crate::io_phase::driver::{RdmaServer, RdmaServerOptions, ServerHandle};
use crate::side_service::tls::ServerIdentity;
use crate::state::{Security, Server, ServerOptions, ServerState, Shutdown};

/// The pieces [`Service::start_with`] serves.
#[derive(Debug, Clone)]
pub struct ServiceParts {
    pub options: ServerOptions,
    pub security: Security,
    /// The RDMA listener; `None`: none (negotiate offers no providers).
    pub rdma: Option<RdmaServerOptions>,
    /// Serve Prometheus metrics here ([`metrics_addr`]: a port alone means
    /// localhost).
    pub metrics_listen: Option<String>,
    /// Runtime worker threads; `None`: one per CPU.
    pub worker_threads: Option<usize>,
}

/// One RDMA listener: bound address, provider, device and what negotiate
/// advertises for it.
pub type RdmaListener = (SocketAddr, &'static str, String, Instance);

/// A running server (side channel, RDMA listener, metrics) on a runtime of
/// its own. Dropping it stops it ([`Service::stop`]).
pub struct Service {
    side_addr: SocketAddr,
    rdma: Option<(ServerHandle, Vec<RdmaListener>)>,
    metrics_addr: Option<SocketAddr>,
    fingerprint: Option<String>,
    state: Arc<ServerState>,
    shutdown: Shutdown,
    runtime: tokio::runtime::Handle,
    thread: Option<JoinHandle<Result<()>>>,
}

impl std::fmt::Debug for Service {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Service(side {}", self.side_addr)?;
        if let Some(a) = self.rdma_addr() {
            write!(f, ", rdma {a}")?;
        }
        write!(f, ")")
    }
}

impl Service {
    /// Start serving `config` as `lwio serve` does (module docs). Logs
    /// where the token and TLS identity come from; returns once every
    /// listener is bound and the server runs.
    pub fn start(config: Config) -> Result<Service> {
        let c = config;
        let token_path = c.token_file.clone().or_else(default_token_file);
        let token = match &token_path {
            Some(p) => {
                let (t, created) = Token::load_or_create(p)?;
                if created {
                    tracing::info!(path = %p.display(), "created a new token file (mode 0600); copy it to clients");
                } else {
                    tracing::info!(path = %p.display(), "using token file");
                }
                Some(t)
            }
            None if c.allow_anonymous => None,
            None => {
                return Err(invalid(
                    "no token file: give --token-file FILE (HOME is not set)",
                ))
            }
        };
        if c.allow_anonymous {
            tracing::warn!("anonymous access enabled: anyone who can connect has the rights the exports grant to \"anonymous\"");
        }
        let tls = if !c.tls {
            tracing::warn!(
                "TLS disabled (tls = false): the side channel is plain TCP; clients need --no-tls"
            );
            None
        } else if let (Some(cert), Some(key)) = (&c.tls_cert, &c.tls_key) {
            Some(ServerIdentity::load(cert, key)?)
        } else {
            let Some(dir) = token_path.as_ref().and_then(|p| p.parent()) else {
                return Err(invalid("no place for a self-signed TLS certificate: give --tls-cert FILE --tls-key FILE (or --token-file FILE)"));
            };
            let name = c.server_name.clone().unwrap_or_else(lwio_side::host_name);
            let mut names = vec![
                name,
                "localhost".to_string(),
                "127.0.0.1".into(),
                "::1".into(),
            ];
            names.dedup();
            let (id, created) = ServerIdentity::self_signed(dir, &names)?;
            let cert = dir.join(lwio_side::tls::SELF_SIGNED_CERT);
            if created {
                tracing::info!(path = %cert.display(), "created a self-signed TLS certificate (key mode 0600)");
            } else {
                tracing::info!(path = %cert.display(), "using the self-signed TLS certificate");
            }
            Some(id)
        };
        let parts = ServiceParts {
            options: ServerOptions::from_config(&c, token),
            security: Security::from_config(&c, tls)?,
            rdma: None,
            metrics_listen: c.metrics_listen.clone(),
            worker_threads: None,
        };
        launch(parts, |side| {
            let listen = rdma_listen_addr(c.rdma_listen.as_deref(), &c.listen, side)?;
            Ok(Some(RdmaServerOptions::from_config(&c, listen)))
        })
    }

    /// Serve `parts` (module docs): bind, then run on a thread of its own.
    pub fn start_with(mut parts: ServiceParts) -> Result<Service> {
        let rdma = parts.rdma.take();
        launch(parts, move |_| Ok(rdma))
    }

    /// The bound side-channel address (the port when 0 was asked for).
    pub fn side_addr(&self) -> SocketAddr {
        self.side_addr
    }

    /// The first RDMA listener's address, if there is one.
    pub fn rdma_addr(&self) -> Option<SocketAddr> {
        self.rdma.as_ref().and_then(|(_, l)| l.first()).map(|l| l.0)
    }

    /// Every RDMA listener (none without an RDMA phase).
    pub fn rdma_listeners(&self) -> &[RdmaListener] {
        self.rdma.as_ref().map(|(_, l)| l.as_slice()).unwrap_or(&[])
    }

    /// The RDMA listener's figures and controls.
    pub fn rdma_handle(&self) -> Option<&ServerHandle> {
        self.rdma.as_ref().map(|(h, _)| h)
    }

    /// Where metrics are served, if they are.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics_addr
    }

    /// The TLS certificate's `sha256:…` fingerprint (`None`: plain TCP).
    pub fn fingerprint(&self) -> Option<&str> {
        self.fingerprint.as_deref()
    }

    pub fn state(&self) -> &Arc<ServerState> {
        &self.state
    }

    /// A handle whose `trigger()` stops the service gracefully (what
    /// [`Service::stop`] does, usable from a signal handler's task).
    pub fn shutdown_handle(&self) -> Shutdown {
        self.shutdown.clone()
    }

    /// The service's runtime, to run more tasks beside it (signal handlers,
    /// status updates); they end with it.
    pub fn runtime(&self) -> &tokio::runtime::Handle {
        &self.runtime
    }

    /// Block until the service stops (after a trigger of its shutdown
    /// handle): what its server returned.
    pub fn wait(mut self) -> Result<()> {
        match self.thread.take() {
            Some(t) => t
                .join()
                .unwrap_or_else(|_| Err(Error::new(ErrorCode::Io, "the server thread panicked"))),
            None => Ok(()),
        }
    }

    /// Stop gracefully: stop accepting, let in-flight I/O finish (up to
    /// `limits.shutdown_grace`), close the connections; waits up to 20 s.
    pub fn stop(&mut self) {
        self.shutdown.trigger();
        if let Some(t) = self.thread.take() {
            let deadline = std::time::Instant::now() + Duration::from_secs(20);
            while !t.is_finished() && std::time::Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(10));
            }
            if t.is_finished() {
                if let Ok(Err(e)) = t.join() {
                    tracing::warn!(error = %e, "server stopped with an error");
                }
            }
        }
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        self.stop();
    }
}

fn invalid(m: impl Into<String>) -> Error {
    Error::new(ErrorCode::InvalidArgument, m)
}

/// Bind everything of `parts` (the RDMA options from the bound side-channel
/// address), then run the server on its own thread, which owns the runtime.
fn launch(
    parts: ServiceParts,
    rdma: impl FnOnce(SocketAddr) -> Result<Option<RdmaServerOptions>>,
) -> Result<Service> {
    let mut b = tokio::runtime::Builder::new_multi_thread();
    if let Some(n) = parts.worker_threads {
        b.worker_threads(n);
    }
    let rt = b
        .enable_all()
        .build()
        .map_err(|e| Error::from_io(&e, "tokio runtime"))?;
    let fingerprint = parts.security.tls.as_ref().map(|t| t.fingerprint.clone());
    let mut server = rt.block_on(Server::bind_secure(parts.options, parts.security))?;
    let side_addr = server
        .local_addr()
        .map_err(|e| Error::from_io(&e, "side channel address"))?;
    let rdma = match rdma(side_addr)? {
        Some(opts) => {
            let (choice, listen) = (opts.provider, opts.listen);
            if opts.proto.allow_md5 {
                tracing::warn!(
                    "compat_md5_auth is on: the RDMA listener also accepts the seed's unkeyed MD5 AUTH signature, which authenticates nothing (anyone who learns a negotiate Key can connect); use only on a trusted fabric for interoperability tests"
                );
            }
            let phase = RdmaServer::bind(opts).map_err(|e| bind_error(choice, listen, e))?;
            tracing::info!(addr = %phase.local_addr(), "RDMA phase ready");
            let info = (phase.handle(), phase.listeners());
            server.set_rdma_phase(Arc::new(phase));
            Some(info)
        }
        None => None,
    };
    let metrics_addr = match &parts.metrics_listen {
        Some(m) => {
            let addr = metrics_addr(m);
            let l = rt
                .block_on(tokio::net::TcpListener::bind(&addr))
                .map_err(|e| {
                    Error::new(
                        ErrorCode::Io,
                        format!("cannot listen for metrics on {addr}: {e}"),
                    )
                })?;
            let bound = l
                .local_addr()
                .map_err(|e| Error::from_io(&e, "metrics address"))?;
            rt.spawn(crate::metrics::serve(
                l,
                server.state().clone(),
                server.shutdown_handle(),
            ));
            Some(bound)
        }
        None => None,
    };
    let state = server.state().clone();
    let shutdown = server.shutdown_handle();
    let runtime = rt.handle().clone();
    // Returns once `run` is being polled (it accepts from then on).
    let (started_tx, started_rx) = std::sync::mpsc::channel();
    let thread = std::thread::Builder::new()
        .name("lwio-server".into())
        .spawn(move || {
            let r = rt.block_on(async move {
                let _ = started_tx.send(());
                server.run().await
            });
            // Tasks spawned beside the server (metrics, signals) end here.
            drop(rt);
            r
        })
        .map_err(|e| Error::from_io(&e, "server thread"))?;
    let _ = started_rx.recv();
    Ok(Service {
        side_addr,
        rdma,
        metrics_addr,
        fingerprint,
        state,
        shutdown,
        runtime,
        thread: Some(thread),
    })
}

/// The RDMA listen address: `explicit` if given, else the side channel's
/// bound IP with the configured side-channel port + 1 (0 stays 0).
pub fn rdma_listen_addr(
    explicit: Option<&str>,
    side_config: &str,
    side_bound: SocketAddr,
) -> Result<SocketAddr> {
    if let Some(s) = explicit {
        return s
            .to_socket_addrs()
            .ok()
            .and_then(|mut a| a.next())
            .ok_or_else(|| {
                invalid(format!(
                    "invalid RDMA listen address {s:?} (expected HOST:PORT)"
                ))
            });
    }
    let port: u16 = side_config
        .rsplit_once(':')
        .and_then(|(_, p)| p.parse().ok())
        .unwrap_or(side_bound.port());
    let port = match port {
        0 => 0,
        65535 => {
            return Err(invalid(
                "side-channel port 65535 leaves no port for RDMA: give --rdma-listen HOST:PORT",
            ))
        }
        p => p + 1,
    };
    Ok(SocketAddr::new(side_bound.ip(), port))
}

/// The metrics listen address: a port alone (`9100` or `:9100`) means
/// localhost (the endpoint is plain HTTP without a login); anything else as
/// given.
pub fn metrics_addr(addr: &str) -> String {
    let port = addr.strip_prefix(':').unwrap_or(addr);
    if port.parse::<u16>().is_ok() {
        format!("127.0.0.1:{port}")
    } else {
        addr.to_string()
    }
}

fn bind_error(choice: ProviderChoice, listen: SocketAddr, e: lwio_rdma::Error) -> Error {
    use lwio_rdma::Error as E;
    match e {
        E::ProviderUnavailable(m) | E::NoSuchDevice(m) => Error::new(
            ErrorCode::Io,
            format!(
                "no usable RDMA provider for --provider {}: {m} (try --provider soft; `lwio devices` lists what this host has)",
                choice.as_str()
            ),
        ),
        E::Io(io) => Error::new(
            ErrorCode::Io,
            format!("cannot listen for RDMA on {listen}: {io}"),
        ),
        other => Error::new(
            ErrorCode::Io,
            format!("RDMA listener ({}, {listen}): {other}", choice.as_str()),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fs::table::Rights;

    #[test]
    fn metrics_port_alone_is_localhost() {
        assert_eq!(metrics_addr("9100"), "127.0.0.1:9100");
        assert_eq!(metrics_addr(":9100"), "127.0.0.1:9100");
        assert_eq!(metrics_addr("0.0.0.0:9100"), "0.0.0.0:9100");
        assert_eq!(metrics_addr("[::1]:9100"), "[::1]:9100");
    }

    #[test]
    fn default_rdma_port() {
        let bound: SocketAddr = "0.0.0.0:7420".parse().unwrap();
        assert_eq!(
            rdma_listen_addr(None, "0.0.0.0:7420", bound).unwrap(),
            "0.0.0.0:7421".parse().unwrap()
        );
        let bound: SocketAddr = "127.0.0.1:40000".parse().unwrap();
        assert_eq!(
            rdma_listen_addr(None, "127.0.0.1:0", bound).unwrap(),
            "127.0.0.1:0".parse().unwrap()
        );
        assert_eq!(
            rdma_listen_addr(Some("127.0.0.1:9000"), "127.0.0.1:0", bound).unwrap(),
            "127.0.0.1:9000".parse().unwrap()
        );
        assert!(rdma_listen_addr(Some("nonsense"), "x", bound).is_err());
        assert!(rdma_listen_addr(None, "[::]:65535", bound).is_err());
        let c = Config::from_toml("rdma_listen = \"127.0.0.1:9000\"\n").unwrap();
        assert_eq!(c.rdma_listen.as_deref(), Some("127.0.0.1:9000"));
        assert!(
            !RdmaServerOptions::from_config(&c, bound).proto.allow_md5,
            "MD5 off by default"
        );
        assert_eq!(
            RdmaServerOptions::from_config(&c, bound).max_connections_per_host,
            32
        );
        let c = Config::from_toml("compat_md5_auth = true\n").unwrap();
        assert!(RdmaServerOptions::from_config(&c, bound).proto.allow_md5);
        let c = Config::from_toml("[limits]\nmax_rdma_connections_per_host = 3\n").unwrap();
        assert_eq!(
            RdmaServerOptions::from_config(&c, bound).max_connections_per_host,
            3
        );
        assert!(Config::from_toml("[limits]\nmax_rdma_connections_per_host = 0\n").is_err());
    }

    /// A default configuration (an export, loopback, the token file in a
    /// temporary directory) serves TLS with a self-signed certificate beside
    /// the token, RDMA on an ephemeral port, and stops when asked.
    #[test]
    fn start_a_default_config_and_stop() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = Config {
            listen: "127.0.0.1:0".into(),
            token_file: Some(dir.path().join("token")),
            provider: ProviderChoice::Soft,
            metrics_listen: Some("127.0.0.1:0".into()),
            ..Config::default()
        };
        c.set_export(&crate::fs::ExportSpec {
            name: "data".into(),
            path: dir.path().to_path_buf(),
            ..Default::default()
        });
        let mut s = Service::start(c).unwrap();
        assert!(s.fingerprint().unwrap().starts_with("sha256:"));
        assert!(dir.path().join("token").exists());
        assert!(dir.path().join(lwio_side::tls::SELF_SIGNED_CERT).exists());
        assert_ne!(s.side_addr().port(), 0);
        assert_ne!(s.rdma_addr().unwrap().port(), 0);
        assert_eq!(s.rdma_listeners().len(), 1);
        assert!(s.metrics_addr().is_some());
        std::net::TcpStream::connect(s.side_addr()).unwrap();
        s.stop();
        assert!(std::net::TcpStream::connect(s.side_addr()).is_err());
    }

    /// `ServerState::reload`: exports added and removed as one snapshot
    /// with their access lists, a root that cannot be opened changes
    /// nothing, other settings are only named.
    #[test]
    fn reload_swaps_exports_and_names_what_needs_a_restart() {
        use crate::side_service::access::Principal;
        let dir = tempfile::tempdir().unwrap();
        let (d, e) = (dir.path().join("d"), dir.path().join("e"));
        std::fs::create_dir(&d).unwrap();
        std::fs::create_dir(&e).unwrap();
        let conf = |extra: &str| {
            let mut c = Config::from_toml(&format!(
                "listen = \"127.0.0.1:0\"\ntls = false\nprovider = \"soft\"\n[exports]\nd = \"{}\"\n{extra}",
                d.display()
            ))
            .unwrap();
            c.token_file = Some(dir.path().join("token"));
            c
        };
        let c0 = conf("");
        let s = Service::start(c0.clone()).unwrap();
        let st = s.state();
        let anon = Principal::Anonymous;
        assert!(st.exports().get("e").is_err());
        let c1 = conf(&format!(
            "e = {{ path = \"{}\", readers = [\"anonymous\"], writers = [] }}",
            e.display()
        ));
        let r = st.reload(&c0, &c1).unwrap();
        assert_eq!(r.applied, [format!("export added: e path={}", e.display())]);
        assert!(r.needs_restart.is_empty() && r.sessions_ended == 0);
        assert!(st.exports().get("e").is_ok());
        let rights = st.rights("e", &anon);
        assert!(rights.read && !rights.write, "its access list came with it");
        // A root that is gone: refused, nothing changes.
        let mut bad = c1.clone();
        bad.set_export(&crate::fs::ExportSpec {
            name: "f".into(),
            path: dir.path().join("gone"),
            ..Default::default()
        });
        bad.listen = "127.0.0.1:1".into();
        assert!(st.reload(&c1, &bad).is_err());
        assert!(st.exports().get("f").is_err() && st.exports().get("e").is_ok());
        // Removed: unknown to new requests, no rights; a changed listen
        // address is only named.
        let mut c2 = c0.clone();
        c2.listen = "127.0.0.1:1".into();
        let r = st.reload(&c1, &c2).unwrap();
        assert_eq!(r.applied, ["export removed: e"]);
        assert_eq!(r.needs_restart, ["needs a restart: listen"]);
        assert_eq!(
            st.exports().get("e").unwrap_err().message,
            "no export named \"e\" on this server"
        );
        assert_eq!(st.rights("e", &anon), Rights::default());
        assert!(st.rights("d", &Principal::SharedToken).write);
    }

    /// The library's default client (`Client::connect` with
    /// `ClientOptions::default()`, the example at the top of lwio-client's
    /// docs) connects to a default server: TLS with a self-signed
    /// certificate, trusted on first use and recorded in known_hosts; the
    /// login from the default token file when no token is given. Runs in a
    /// child with its own HOME (the defaults live there).
    #[test]
    fn a_default_client_connects_to_a_default_server() {
        let home = tempfile::tempdir().unwrap();
        let mut c = std::process::Command::new(std::env::current_exe().unwrap());
        c.args([
            "--exact",
            "service::tests::default_client_child",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("LWIO_DEFAULT_CHILD", "1")
        .env("HOME", home.path());
        for v in [
            "XDG_CONFIG_HOME",
            "LWIO_TOKEN",
            "LWIO_TOKEN_FILE",
            "LWIO_FINGERPRINT",
            "LWIO_KNOWN_HOSTS",
            "LWIO_STRICT_HOST_KEY_CHECKING",
        ] {
            c.env_remove(v);
        }
        let out = c.output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{stdout}\n{err}");
        assert!(stdout.contains("1 passed"), "the child ran: {stdout}");
        let known = std::fs::read_to_string(home.path().join(".config/lwio/known_hosts")).unwrap();
        assert!(known.contains(" sha256:"), "recorded on first use: {known}");
    }

    #[test]
    fn default_client_child() {
        use lwio_client::{Client, ClientOptions, Completion, OpenOptions};
        if std::env::var_os("LWIO_DEFAULT_CHILD").is_none() {
            return; // Only as the child of the test above.
        }
        let home = std::path::PathBuf::from(std::env::var_os("HOME").unwrap());
        let data = home.join("data");
        std::fs::create_dir(&data).unwrap();
        let mut c = Config {
            listen: "127.0.0.1:0".into(),
            provider: ProviderChoice::Soft,
            ..Config::default()
        };
        c.set_export(&crate::fs::ExportSpec {
            name: "data".into(),
            path: data.clone(),
            ..Default::default()
        });
        let s = Service::start(c).unwrap();
        let fp = s.fingerprint().expect("TLS by default").to_string();
        let token = std::fs::read_to_string(home.join(".config/lwio/token")).unwrap();
        let url = format!("lwio://{}/data", s.side_addr());
        // The documented example, against the default server.
        let opts = ClientOptions {
            completion: Completion::Poll,
            ..ClientOptions::default()
        };
        let client = Client::connect(&url, Some(token.trim()), opts).unwrap();
        let f = client
            .open("app.log", &OpenOptions::read_write().create(true))
            .unwrap();
        f.write_at(b"hello", 4096).unwrap();
        let mut buf = [0u8; 5];
        assert_eq!(f.read_at(&mut buf, 4096).unwrap(), 5);
        assert_eq!(&buf, b"hello");
        f.close().unwrap();
        drop(client);
        let known = std::fs::read_to_string(home.join(".config/lwio/known_hosts")).unwrap();
        let hex = fp
            .trim_start_matches("sha256:")
            .replace(':', "")
            .to_ascii_lowercase();
        assert!(
            known.to_ascii_lowercase().replace(':', "").contains(&hex),
            "{known} records {fp}"
        );
        // No token: the default token file; the pinned certificate again.
        let client = Client::connect(&url, None, ClientOptions::default()).unwrap();
        assert_eq!(
            client
                .open("app.log", &OpenOptions::read_only())
                .unwrap()
                .len()
                .unwrap(),
            4101
        );
    }
}
