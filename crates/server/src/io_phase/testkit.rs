//! A complete server (side channel + RDMA listener) on loopback ephemeral
//! ports, for end-to-end tests, examples and `lwio bench --local`.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use super::server::{RdmaServer, RdmaServerOptions, ServerHandle};
use crate::config::{IoConfig, Limits, ProviderChoice};
use crate::fs::{ExportSpec, ResolveMode};
use crate::server::{AuthPolicy, Server, ServerOptions, ServerState, Shutdown};
use lwio_side::Token;

/// The one read-write export `export` of `root`.
fn one(root: &Path, export: &str) -> ExportSpec {
    ExportSpec {
        name: export.into(),
        path: root.to_path_buf(),
        read_only: false,
        allow_hardlinks: false,
        ..Default::default()
    }
}

/// A running server.
pub struct LocalServer {
    /// Side-channel address (`host:port` for `Client::connect`).
    pub side_addr: SocketAddr,
    pub rdma_addr: SocketAddr,
    pub rdma: ServerHandle,
    pub state: Arc<ServerState>,
    pub token: String,
    shutdown: Shutdown,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for LocalServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "LocalServer(side {}, rdma {})",
            self.side_addr, self.rdma_addr
        )
    }
}

impl LocalServer {
    /// Export `root` as `export` and serve it with `token`.
    pub fn start(
        root: &Path,
        export: &str,
        token: &str,
        limits: Limits,
        mut rdma: RdmaServerOptions,
    ) -> lwio_side::Result<LocalServer> {
        rdma.listen = "127.0.0.1:0".parse().expect("literal address");
        rdma.provider = ProviderChoice::Soft;
        rdma.device = None;
        LocalServer::start_on(root, export, token, limits, rdma)
    }

    /// [`LocalServer::start`] on the provider, device and RDMA listen
    /// address of `rdma` as given (e.g. verbs on rxe0 at 10.0.0.1:0); the
    /// side channel stays on loopback.
    pub fn start_on(
        root: &Path,
        export: &str,
        token: &str,
        limits: Limits,
        rdma: RdmaServerOptions,
    ) -> lwio_side::Result<LocalServer> {
        LocalServer::start_exports(
            vec![one(root, export)],
            token,
            limits,
            rdma,
            IoConfig::default(),
        )
    }

    /// [`LocalServer::start`] with this file I/O backend (`[io]`), e.g.
    /// the thread pool of a host without io_uring.
    pub fn start_with_io(
        root: &Path,
        export: &str,
        token: &str,
        limits: Limits,
        mut rdma: RdmaServerOptions,
        io: IoConfig,
    ) -> lwio_side::Result<LocalServer> {
        rdma.listen = "127.0.0.1:0".parse().expect("literal address");
        rdma.provider = ProviderChoice::Soft;
        rdma.device = None;
        LocalServer::start_exports(vec![one(root, export)], token, limits, rdma, io)
    }

    /// [`LocalServer::start`] with these exports (read-only ones, several).
    pub fn start_specs(
        exports: Vec<ExportSpec>,
        token: &str,
        limits: Limits,
        mut rdma: RdmaServerOptions,
    ) -> lwio_side::Result<LocalServer> {
        rdma.listen = "127.0.0.1:0".parse().expect("literal address");
        rdma.provider = ProviderChoice::Soft;
        rdma.device = None;
        LocalServer::start_exports(exports, token, limits, rdma, IoConfig::default())
    }

    fn start_exports(
        exports: Vec<ExportSpec>,
        token: &str,
        limits: Limits,
        rdma: RdmaServerOptions,
        io: IoConfig,
    ) -> lwio_side::Result<LocalServer> {
        let provider = rdma.provider;
        let opts = ServerOptions {
            listen: "127.0.0.1:0".into(),
            server_name: "lwio-test".into(),
            exports,
            auth: AuthPolicy {
                token: Some(Token::new(token)?),
                allow_anonymous: false,
            },
            limits,
            io,
            provider,
            resolve: ResolveMode::Auto,
        };
        let phase = RdmaServer::bind(rdma).map_err(|e| {
            lwio_side::Error::new(lwio_side::ErrorCode::Io, format!("RDMA listener: {e}"))
        })?;
        let rdma_addr = phase.local_addr();
        let handle = phase.handle();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .map_err(|e| lwio_side::Error::from_io(&e, "tokio runtime"))?;
        let mut server = rt.block_on(Server::bind(opts))?;
        server.set_rdma_phase(Arc::new(phase));
        let side_addr = server
            .local_addr()
            .map_err(|e| lwio_side::Error::from_io(&e, "side channel address"))?;
        let state = server.state().clone();
        let shutdown = server.shutdown_handle();
        let thread = std::thread::Builder::new()
            .name("lwio-local-server".into())
            .spawn(move || {
                if let Err(e) = rt.block_on(server.run()) {
                    tracing::warn!(error = %e, "local server stopped with an error");
                }
            })
            .map_err(|e| lwio_side::Error::from_io(&e, "server thread"))?;
        Ok(LocalServer {
            side_addr,
            rdma_addr,
            rdma: handle,
            state,
            token: token.into(),
            shutdown,
            thread: Some(thread),
        })
    }

    /// Stop gracefully and wait (bounded).
    pub fn stop(&mut self) {
        self.shutdown.trigger();
        if let Some(t) = self.thread.take() {
            let deadline = std::time::Instant::now() + Duration::from_secs(20);
            while !t.is_finished() && std::time::Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(10));
            }
            if t.is_finished() {
                let _ = t.join();
            }
        }
    }
}

impl Drop for LocalServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A test that cannot run here for want of `reason` (a capability, a
/// kernel feature, an address): under CI (the `CI` environment variable
/// set) the test fails with the reason, so a skip is never counted as a
/// pass there; elsewhere it prints `SKIPPED: reason` and the caller returns.
#[track_caller]
pub fn skip(reason: impl std::fmt::Display) {
    if std::env::var_os("CI").is_some() {
        panic!("skipped under CI (CI is set): {reason}");
    }
    eprintln!("SKIPPED: {reason}");
}

#[cfg(test)]
mod tests {
    /// Run this test binary again for `skip_child` with `CI` set or not;
    /// (exit success, stderr).
    fn child(ci: bool) -> (bool, String) {
        let mut c = std::process::Command::new(std::env::current_exe().expect("test binary"));
        c.args([
            "--exact",
            "io_phase::testkit::tests::skip_child",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("LWIO_SKIP_CHILD", "1")
        .env_remove("CI");
        if ci {
            c.env("CI", "true");
        }
        let out = c.output().expect("run the test binary");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    #[test]
    fn skip_child() {
        if std::env::var_os("LWIO_SKIP_CHILD").is_none() {
            return; // Only as the child of `a_skip_fails_under_ci_only`.
        }
        super::skip("the reason");
    }

    /// A skip is a failure under CI and a printed SKIPPED elsewhere.
    #[test]
    fn a_skip_fails_under_ci_only() {
        let (ok, err) = child(true);
        assert!(
            !ok && err.contains("skipped under CI (CI is set): the reason"),
            "{err}"
        );
        let (ok, err) = child(false);
        assert!(ok && err.contains("SKIPPED: the reason"), "{err}");
    }
}
