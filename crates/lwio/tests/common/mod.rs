//! Helpers shared by the integration tests (each test file compiles its own
//! copy, so a helper one file does not use is not dead code).
#![allow(dead_code)]

pub mod hostile;
pub mod malicious;
pub mod reconnect;

/// A skip: fails under CI, else prints `SKIPPED: reason` (the caller
/// returns). lwio-server's, shared with its own unit tests.
#[track_caller]
pub fn skip(reason: impl std::fmt::Display) {
    lwio_server::io_phase::testkit::skip(reason)
}

/// Log to the test's output at `RUST_LOG` (default `warn`); once per test
/// binary, later calls do nothing.
pub fn init_logging() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into()))
        .with_test_writer()
        .try_init();
}

/// A loopback server of `dir` as export "ex" whose every file I/O goes to
/// four storage threads (`inline_io = false`): where the slow-write test
/// hook applies and nothing but the server's own ordering keeps a later
/// request from running beside a slow one.
pub fn storage_thread_server(
    dir: &std::path::Path,
    token: &str,
) -> lwio_server::io_phase::testkit::LocalServer {
    lwio_server::io_phase::testkit::LocalServer::start(
        dir,
        "ex",
        token,
        lwio_server::config::Limits::default(),
        lwio_server::io_phase::driver::RdmaServerOptions {
            inline_io: false,
            storage_threads: 4,
            ..lwio_server::io_phase::driver::RdmaServerOptions::default()
        },
    )
    .expect("server starts")
}

/// A soft-provider client of `s`'s export "ex", without TLS, with `opts`.
pub fn soft_client(
    s: &lwio_server::io_phase::testkit::LocalServer,
    token: &str,
    opts: lwio_client::ClientOptions,
) -> lwio_client::Client {
    lwio_client::Client::connect(
        &format!("lwio://{}/ex", s.side_addr),
        Some(token),
        lwio_client::ClientOptions {
            provider: lwio_rdma::ProviderChoice::Soft,
            ..opts
        }
        .no_tls(),
    )
    .expect("client connects")
}
