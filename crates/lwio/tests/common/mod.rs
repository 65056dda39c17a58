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
