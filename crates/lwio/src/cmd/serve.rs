//! `lwio serve`: what the command adds to [`Service::start`] (which binds
//! the side channel, the RDMA phase and metrics): the lines it prints and
//! the service glue (signals, sd_notify, SIGHUP).
//!
//! The RDMA listener binds to `--rdma-listen ADDR` (or the config file's
//! `rdma_listen`) when given, otherwise to
//! the side channel's address with port + 1 (7421 next to the default 7420;
//! port 0 stays 0, i.e. an ephemeral port). Clients learn the address from
//! the negotiate response, so only the side-channel address needs
//! publishing. SIGINT/SIGTERM trigger the shared shutdown: the RDMA phase
//! stops accepting, lets in-flight I/O finish (up to
//! `limits.shutdown_grace`) and closes the connections.

use std::io::Write;

use lwio_server::config::Config;
use lwio_server::Service;

use crate::cli::ServeArgs;
use crate::cmd::notify::Notifier;

/// What `lwio serve` prints on stdout once `service` runs (scripts and
/// tests read these lines): `lwio: TLS fingerprint sha256:…` (with TLS),
/// `lwio: listening on ADDR`, one `lwio: RDMA listening on ADDR (provider
/// P, DEVICE, TRANSPORT)` per RDMA listener, and `lwio: metrics on
/// http://ADDR/metrics` when metrics are served.
pub fn print_listening(service: &Service) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    if let Some(fp) = service.fingerprint() {
        writeln!(out, "lwio: TLS fingerprint {fp}")?;
    }
    writeln!(out, "lwio: listening on {}", service.side_addr())?;
    for (addr, provider, device, inst) in service.rdma_listeners() {
        writeln!(
            out,
            "lwio: RDMA listening on {addr} (provider {provider}, {device}, {})",
            inst.transport
        )?;
    }
    if let Some(m) = service.metrics_addr() {
        writeln!(out, "lwio: metrics on http://{m}/metrics")?;
    }
    out.flush()?;
    Ok(())
}

/// `STATUS=` text: what the server holds now.
pub fn status_line(state: &lwio_server::state::ServerState) -> String {
    let conns = state
        .rdma_snapshot()
        .map(|s| s.states.0 + s.states.1 + s.states.2)
        .unwrap_or(0);
    format!(
        "serving: {} sessions, {} RDMA connections, {} durable sessions",
        state.session_count(),
        conns,
        state.durable_sessions()
    )
}

/// How often `STATUS=` is refreshed under systemd.
pub const STATUS_INTERVAL: std::time::Duration = std::time::Duration::from_secs(5);

/// The service side of `lwio serve`, called once [`Service::start`]
/// returned (every listener bound, the server running): SIGINT/SIGTERM
/// stop the server
/// (`STOPPING=1`), SIGHUP re-reads the configuration and applies its
/// exports and users ([`reload`]; `RELOADING=1` … `READY=1` around it);
/// with `$NOTIFY_SOCKET`, `READY=1` and then `STATUS=` every
/// [`STATUS_INTERVAL`]. The signal handlers are installed before this
/// returns, so a SIGHUP right after `READY=1` cannot kill the process.
pub fn start_service(server: &Service, args: ServeArgs, running: Config) -> anyhow::Result<()> {
    use tokio::signal::unix::{signal, SignalKind};
    // Signal streams and tasks belong to the service's runtime.
    let _rt = server.runtime().enter();
    let notifier = Notifier::from_env();
    let stop = server.shutdown_handle();
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let mut hup = signal(SignalKind::hangup())?;
    let n = notifier.clone();
    let state = server.state().clone();
    tokio::spawn(async move {
        let mut running = running;
        loop {
            tokio::select! {
                _ = int.recv() => { tracing::info!("SIGINT: shutting down"); break }
                _ = term.recv() => { tracing::info!("SIGTERM: shutting down"); break }
                _ = hup.recv() => {
                    // systemd's reload protocol (sd_notify(3)): RELOADING=1
                    // with the monotonic clock, READY=1 once done.
                    n.send(&format!("RELOADING=1\nMONOTONIC_USEC={}\nSTATUS=reloading the configuration", monotonic_usec()));
                    let st = state.clone();
                    let (a, r) = (args.clone(), running.clone());
                    // Reading the file and opening export roots block.
                    let next = tokio::task::spawn_blocking(move || reload(&a, &r, &st)).await;
                    if let Ok(Some(c)) = next {
                        running = c;
                    }
                    n.send(&format!("READY=1\nSTATUS={}", status_line(&state)));
                }
            }
        }
        n.send("STOPPING=1\nSTATUS=shutting down");
        stop.trigger();
    });
    if notifier.enabled() {
        let state = server.state().clone();
        let stop = server.shutdown_handle();
        tokio::spawn(async move {
            // The listening sockets accept (the kernel completes handshakes
            // into their backlogs) since they were bound, and
            // `Service::start` returned once `run()` was being polled.
            tokio::task::yield_now().await;
            notifier.send(&format!("READY=1\nSTATUS={}", status_line(&state)));
            tracing::info!("told systemd READY=1");
            let mut tick = tokio::time::interval(STATUS_INTERVAL);
            tick.tick().await;
            loop {
                tick.tick().await;
                if stop.is_triggered() {
                    break;
                }
                notifier.send(&format!("STATUS={}", status_line(&state)));
            }
        });
    }
    Ok(())
}

/// CLOCK_MONOTONIC in microseconds (`MONOTONIC_USEC=` of `RELOADING=1`).
fn monotonic_usec() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec into `ts`.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000 + ts.tv_nsec as u64 / 1_000
}

/// Why a reload changed nothing (one warning per problem).
const RELOAD_REFUSED: &str =
    "SIGHUP: configuration has a problem; still serving the configuration in force";

/// SIGHUP: re-read and check the configuration file (and the flags of the
/// command line, which still override it); if it is sound, serve its
/// exports, access lists and users from now on
/// ([`lwio_server::state::ServerState::reload`]: one info line per change
/// applied, one warning per setting that needs a restart) and return it as
/// the configuration in force. With a problem, nothing changes: one
/// warning per problem, `None`.
pub fn reload(
    args: &ServeArgs,
    running: &Config,
    state: &lwio_server::state::ServerState,
) -> Option<Config> {
    let Some(path) = &args.config else {
        tracing::info!("SIGHUP: no --config file; nothing to re-read");
        return None;
    };
    let check = crate::cmd::check_config::check(args, path);
    if !check.problems.is_empty() {
        for p in &check.problems {
            tracing::warn!(problem = %p, "{RELOAD_REFUSED}");
        }
        return None;
    }
    let new = match crate::cli::serve_config(args) {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!(problem = %e, "{RELOAD_REFUSED}");
            return None;
        }
    };
    if &new == running {
        tracing::info!(config = %path.display(), "SIGHUP: configuration re-read and checked: unchanged");
        return None;
    }
    let done = match state.reload(running, &new) {
        Ok(d) => d,
        Err(e) => {
            tracing::warn!(problem = %e, "{RELOAD_REFUSED}");
            return None;
        }
    };
    for line in &done.applied {
        tracing::info!("SIGHUP: {line}");
    }
    for line in &done.needs_restart {
        tracing::warn!("SIGHUP: {line} (the running server keeps the value it started with; systemctl restart lwio applies it, durable sessions reconnect: docs/operations.md)");
    }
    tracing::info!(
        config = %path.display(),
        changes = done.applied.len(),
        needs_restart = done.needs_restart.len(),
        sessions_ended = done.sessions_ended,
        "SIGHUP: configuration reloaded"
    );
    // What runs now: the new exports and users, the old everything else
    // (so a setting that needs a restart is reported at every reload
    // until then).
    let mut now = running.clone();
    now.exports = new.exports;
    now.users = new.users;
    Some(now)
}
