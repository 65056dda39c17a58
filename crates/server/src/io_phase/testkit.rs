//! A complete server (side channel + RDMA listener) on loopback ephemeral
//! ports, for end-to-end tests, examples and `lwio bench --local`.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;

use super::driver::{RdmaServerOptions, ServerHandle};
use crate::config::{IoConfig, Limits, ProviderChoice};
use crate::fs::{ExportSpec, ResolveMode};
use crate::service::{Service, ServiceParts};
use crate::state::{AuthPolicy, Security, ServerOptions, ServerState};
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
    service: Service,
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

    /// Plain TCP, the shared token only, one runtime worker, on loopback:
    /// [`Service::start_with`].
    fn start_exports(
        exports: Vec<ExportSpec>,
        token: &str,
        limits: Limits,
        rdma: RdmaServerOptions,
        io: IoConfig,
    ) -> lwio_side::Result<LocalServer> {
        let provider = rdma.provider;
        let options = ServerOptions {
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
        let service = Service::start_with(ServiceParts {
            options,
            security: Security::default(),
            rdma: Some(rdma),
            metrics_listen: None,
            worker_threads: Some(1),
        })?;
        let (Some(rdma_addr), Some(handle)) = (service.rdma_addr(), service.rdma_handle()) else {
            unreachable!("an RDMA listener was asked for");
        };
        Ok(LocalServer {
            side_addr: service.side_addr(),
            rdma_addr,
            rdma: handle.clone(),
            state: service.state().clone(),
            token: token.into(),
            service,
        })
    }

    /// Stop gracefully and wait (bounded).
    pub fn stop(&mut self) {
        self.service.stop();
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
