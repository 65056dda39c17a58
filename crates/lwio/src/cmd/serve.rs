//! `lwio serve`: the RDMA phase next to the side channel.
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
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::Arc;

use lwio_server::config::{Config, ProviderChoice};
use lwio_server::io_phase::server::{RdmaServer, RdmaServerOptions};
use lwio_server::server::Server;

use crate::cli::ServeArgs;
use crate::cmd::notify::Notifier;

/// The RDMA listen address: `explicit` if given, else the side channel's
/// bound IP with the configured side-channel port + 1 (0 stays 0).
pub fn rdma_listen_addr(
    explicit: Option<&str>,
    side_config: &str,
    side_bound: SocketAddr,
) -> anyhow::Result<SocketAddr> {
    if let Some(s) = explicit {
        return s
            .to_socket_addrs()
            .ok()
            .and_then(|mut a| a.next())
            .ok_or_else(|| {
                anyhow::anyhow!("invalid RDMA listen address {s:?} (expected HOST:PORT)")
            });
    }
    let port: u16 = side_config
        .rsplit_once(':')
        .and_then(|(_, p)| p.parse().ok())
        .unwrap_or(side_bound.port());
    let port = match port {
        0 => 0,
        65535 => anyhow::bail!(
            "side-channel port 65535 leaves no port for RDMA: give --rdma-listen HOST:PORT"
        ),
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

/// Serve Prometheus metrics on `addr` beside `server` (until its shutdown);
/// prints `lwio: metrics on http://ADDR/metrics`. A port alone listens on
/// localhost ([`metrics_addr`]).
pub async fn start_metrics(server: &Server, addr: &str) -> anyhow::Result<()> {
    let addr = &metrics_addr(addr);
    let l = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| anyhow::anyhow!("cannot listen for metrics on {addr}: {e}"))?;
    let bound = l.local_addr()?;
    tokio::spawn(lwio_server::metrics::serve(
        l,
        server.state().clone(),
        server.shutdown_handle(),
    ));
    let mut out = std::io::stdout().lock();
    writeln!(out, "lwio: metrics on http://{bound}/metrics")?;
    out.flush()?;
    Ok(())
}

/// Bind the RDMA listener for `c` and attach it to `server`; prints
/// `lwio: RDMA listening on ADDR (provider P, DEVICE, TRANSPORT)` on stdout,
/// one line per listener.
pub fn attach_rdma(
    server: &mut Server,
    c: &Config,
    rdma_listen: Option<&str>,
) -> anyhow::Result<()> {
    let side = server.local_addr()?;
    let explicit = rdma_listen.or(c.rdma_listen.as_deref());
    let listen = rdma_listen_addr(explicit, &c.listen, side)?;
    let opts = RdmaServerOptions::from_config(c, listen);
    if opts.proto.allow_md5 {
        tracing::warn!(
            "compat_md5_auth is on: the RDMA listener also accepts the seed's unkeyed MD5 AUTH signature, which authenticates nothing (anyone who learns a negotiate Key can connect); use only on a trusted fabric for interoperability tests"
        );
    }
    let phase = RdmaServer::bind(opts).map_err(|e| bind_error(c.provider, listen, e))?;
    tracing::info!(addr = %phase.local_addr(), "RDMA phase ready");
    {
        let mut out = std::io::stdout().lock();
        for (addr, provider, device, inst) in phase.listeners() {
            writeln!(
                out,
                "lwio: RDMA listening on {addr} (provider {provider}, {device}, {})",
                inst.transport
            )?;
        }
        out.flush()?;
    }
    server.set_rdma_phase(Arc::new(phase));
    Ok(())
}

fn bind_error(choice: ProviderChoice, listen: SocketAddr, e: lwio_rdma::Error) -> anyhow::Error {
    use lwio_rdma::Error as E;
    match e {
        E::ProviderUnavailable(m) | E::NoSuchDevice(m) => anyhow::anyhow!(
            "no usable RDMA provider for --provider {}: {m} (try --provider soft; `lwio devices` lists what this host has)",
            choice.as_str()
        ),
        E::Io(io) => anyhow::anyhow!("cannot listen for RDMA on {listen}: {io}"),
        other => anyhow::anyhow!(
            "RDMA listener ({}, {listen}): {other}",
            choice.as_str()
        ),
    }
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

/// The service side of `lwio serve`, called once every listener is bound
/// and just before `server.run()`: SIGINT/SIGTERM stop the server
/// (`STOPPING=1`), SIGHUP re-reads the configuration ([`reload`]); with
/// `$NOTIFY_SOCKET`, `READY=1` and then `STATUS=` every
/// [`STATUS_INTERVAL`]. The signal handlers are installed before this
/// returns, so a SIGHUP right after `READY=1` cannot kill the process.
pub fn start_service(server: &Server, args: ServeArgs, running: Config) -> anyhow::Result<()> {
    use tokio::signal::unix::{signal, SignalKind};
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
            // into their backlogs) since they were bound; this task runs
            // once `run()` is being polled, which accepts them.
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
