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
pub fn status_line(state: &lwio_server::server::ServerState) -> String {
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
/// (`STOPPING=1`), SIGHUP re-reads the configuration ([`reload`]); with
/// `$NOTIFY_SOCKET`, `READY=1` and then `STATUS=` every
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
    tokio::spawn(async move {
        loop {
            tokio::select! {
                _ = int.recv() => { tracing::info!("SIGINT: shutting down"); break }
                _ = term.recv() => { tracing::info!("SIGTERM: shutting down"); break }
                _ = hup.recv() => reload(&args, &running),
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

/// SIGHUP: re-read and check the configuration, and say what a restart
/// would change. Exports and users are not swapped in a running server
/// (docs/operations.md, "Reload"): they are plain fields of the shared
/// `ServerState`, read without a lock on every request.
pub fn reload(args: &ServeArgs, running: &Config) {
    let Some(path) = &args.config else {
        tracing::info!("SIGHUP: no --config file; nothing to re-read");
        return;
    };
    let check = crate::cmd::check_config::check(args, path);
    if !check.problems.is_empty() {
        for p in &check.problems {
            tracing::warn!(problem = %p, "SIGHUP: configuration has a problem; still serving the configuration read at start");
        }
        return;
    }
    let new = match crate::cli::serve_config(args) {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!(problem = %e, "SIGHUP: configuration has a problem; still serving the configuration read at start");
            return;
        }
    };
    let changes = config_changes(running, &new);
    if changes.is_empty() {
        tracing::info!(config = %path.display(), "SIGHUP: configuration re-read and checked: unchanged");
    } else {
        tracing::warn!(
            config = %path.display(),
            changes = %changes.join("; "),
            "SIGHUP: configuration changed; a running lwio serve cannot take new exports, users or settings: restart it to apply (systemctl restart lwio; durable sessions reconnect, docs/operations.md)"
        );
    }
}

/// What differs between two configurations, one phrase per kind.
pub fn config_changes(old: &Config, new: &Config) -> Vec<String> {
    fn diff<V: PartialEq>(
        what: &str,
        a: &std::collections::BTreeMap<String, V>,
        b: &std::collections::BTreeMap<String, V>,
    ) -> Option<String> {
        let added: Vec<&str> = b
            .keys()
            .filter(|k| !a.contains_key(*k))
            .map(String::as_str)
            .collect();
        let removed: Vec<&str> = a
            .keys()
            .filter(|k| !b.contains_key(*k))
            .map(String::as_str)
            .collect();
        let changed: Vec<&str> = a
            .iter()
            .filter(|(k, v)| b.get(*k).is_some_and(|w| w != *v))
            .map(|(k, _)| k.as_str())
            .collect();
        let mut parts = Vec::new();
        for (verb, v) in [("added", added), ("removed", removed), ("changed", changed)] {
            if !v.is_empty() {
                parts.push(format!("{verb} {}", v.join(" ")));
            }
        }
        (!parts.is_empty()).then(|| format!("{what} {}", parts.join(", ")))
    }
    let mut out = Vec::new();
    out.extend(diff("exports", &old.exports, &new.exports));
    out.extend(diff("users", &old.users, &new.users));
    let strip = |c: &Config| {
        let mut c = c.clone();
        c.exports.clear();
        c.users.clear();
        c
    };
    if strip(old) != strip(new) {
        out.push("other settings".into());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_changes_name_what_a_restart_would_change() {
        let a = Config::from_toml("[exports]\nd = \"/d\"\ne = \"/e\"\n").unwrap();
        assert!(config_changes(&a, &a).is_empty());
        let b = Config::from_toml("listen = \"127.0.0.1:1\"\n[exports]\nd = \"/d2\"\nf = \"/f\"\n")
            .unwrap();
        assert_eq!(
            config_changes(&a, &b),
            ["exports added f, removed e, changed d", "other settings"]
        );
    }
}
