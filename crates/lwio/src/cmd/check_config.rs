//! `lwio serve --check-config FILE`: everything `serve` would check at
//! start, without binding anything — the file parses and validates, every
//! export opens as the server would open it (the directory exists; an
//! `identity = "client"` export needs a process that can switch ids), the
//! TLS certificate and key are readable and parse, the users' hashes parse,
//! the addresses resolve. Prints what the server would do and exits 0, or
//! one line per problem on stderr and exits 1.

use std::fmt::Write as _;
use std::net::ToSocketAddrs;
use std::path::Path;

use lwio_server::config::{Config, ExportEntry, IdentityKey};
use lwio_server::fs::{Exports, ResolveMode};
use lwio_server::side_service::tls::ServerIdentity;
use lwio_side::defaults::default_token_file;

use crate::cli::{apply_serve_flags, Reported, ServeArgs, NOTHING_TO_SERVE};

/// The outcome of a check: the report (when valid) or the problems.
#[derive(Debug, Default)]
pub struct Check {
    pub report: Vec<String>,
    pub problems: Vec<String>,
}

/// Check `file` with the other flags of `a`; print the outcome.
pub fn run(a: &ServeArgs, file: &Path) -> anyhow::Result<()> {
    let c = check(a, file);
    if c.problems.is_empty() {
        let mut out = String::new();
        for l in &c.report {
            let _ = writeln!(out, "{l}");
        }
        print!("{out}");
        return Ok(());
    }
    for p in &c.problems {
        eprintln!("lwio: error: {p}");
    }
    Err(Reported(1).into())
}

/// Check `file` with the other flags of `a`.
pub fn check(a: &ServeArgs, file: &Path) -> Check {
    let mut out = Check::default();
    let text = match std::fs::read_to_string(file) {
        Ok(t) => t,
        Err(e) => {
            out.problems
                .push(format!("cannot read config file {}: {e}", file.display()));
            return out;
        }
    };
    // Config::load parses and validates, stopping at the first problem. A
    // file that parses but does not validate is still checked further, so
    // that every problem gets its line.
    let mut c = match Config::load(file) {
        Ok(c) => c,
        Err(e) => {
            out.problems.push(e.0);
            match toml::from_str::<Config>(&text) {
                Ok(c) => c,
                Err(_) => return out,
            }
        }
    };
    let prefix = format!("config file {}", file.display());
    apply_serve_flags(&mut c, a);
    let mut problem = |p: String| {
        if !out.problems.iter().any(|q| q.ends_with(&p)) {
            out.problems.push(format!("{prefix}: {p}"));
        }
    };
    if let Err(e) = c.validate() {
        problem(e.0);
    }
    if let Err(e) = c.user_db() {
        problem(e.0);
    }
    if c.exports.is_empty() {
        problem(NOTHING_TO_SERVE.into());
    }
    for (what, addr) in [
        ("listen", Some(&c.listen)),
        ("rdma_listen", c.rdma_listen.as_ref()),
        ("metrics_listen", c.metrics_listen.as_ref()),
    ] {
        if let Some(addr) = addr {
            if addr
                .to_socket_addrs()
                .map_or(true, |mut i| i.next().is_none())
            {
                problem(format!(
                    "{what}: {addr:?} is not an address (expected HOST:PORT)"
                ));
            }
        }
    }
    // Exports: opened one by one as the server opens them (the directory
    // exists and is one; identity = "client" needs CAP_SETUID/CAP_SETGID).
    for spec in c.export_specs() {
        if let Err(e) = Exports::open(std::slice::from_ref(&spec), ResolveMode::Auto) {
            let msg = e.to_string();
            // The server's message names the export already when the
            // directory fails; say which export otherwise.
            if msg.starts_with("export ") {
                problem(msg);
            } else {
                problem(format!("export {}: {msg}", spec.name));
            }
        }
    }
    let token_path = c.token_file.clone().or_else(default_token_file);
    let mut tls_line = String::from("TLS off (plain TCP; clients need --no-tls)");
    if c.tls {
        match (&c.tls_cert, &c.tls_key) {
            (Some(cert), Some(key)) => match ServerIdentity::load(cert, key) {
                Ok(id) => {
                    tls_line = format!(
                        "TLS certificate {} (key {}), fingerprint {}",
                        cert.display(),
                        key.display(),
                        id.fingerprint
                    )
                }
                Err(e) => problem(e.to_string()),
            },
            _ => match token_path.as_ref().and_then(|p| p.parent()) {
                Some(dir) => {
                    tls_line = format!(
                        "TLS with the self-signed certificate in {} ({})",
                        dir.display(),
                        if dir.join(lwio_side::tls::SELF_SIGNED_CERT).exists() {
                            "exists"
                        } else {
                            "created on first start"
                        }
                    )
                }
                None => problem("no place for a self-signed TLS certificate: give tls_cert and tls_key (or token_file)".into()),
            },
        }
    }
    let token_line = match &token_path {
        Some(p) if p.exists() => match lwio_side::Token::load(p) {
            Ok(_) => format!("token file {}", p.display()),
            Err(e) => {
                problem(e.to_string());
                String::new()
            }
        },
        Some(p) => format!("token file {} (created on first start)", p.display()),
        None if c.allow_anonymous => "no token file (anonymous logins only)".into(),
        None => {
            problem("no token file: set token_file (HOME is not set)".into());
            String::new()
        }
    };
    if !out.problems.is_empty() {
        return out;
    }

    let r = &mut out.report;
    r.push(format!(
        "lwio: {} is valid; lwio serve would:",
        file.display()
    ));
    r.push(format!("listen {} (side channel), {tls_line}", c.listen));
    r.push(format!(
        "RDMA listen {} (provider {}{})",
        c.listen
            .to_socket_addrs()
            .ok()
            .and_then(|mut a| a.next())
            .and_then(|side| {
                lwio_server::service::rdma_listen_addr(c.rdma_listen.as_deref(), &c.listen, side)
                    .ok()
            })
            .map_or_else(
                || c.rdma_listen.clone().unwrap_or_default(),
                |a| a.to_string()
            ),
        c.provider.as_str(),
        c.device
            .as_deref()
            .map(|d| format!(", device {d}"))
            .unwrap_or_default()
    ));
    r.push(match &c.metrics_listen {
        Some(m) => format!("metrics on http://{m}/metrics"),
        None => "metrics off".into(),
    });
    r.push(token_line);
    if c.allow_anonymous {
        r.push("anonymous logins accepted".into());
    }
    for (name, u) in &c.users {
        let mut how = Vec::new();
        if u.password.is_some() {
            how.push("password".to_string());
        }
        if u.token.is_some() {
            how.push("token".into());
        }
        if let Some(uid) = u.uid {
            how.push(format!("uid {uid} gid {}", u.gid.unwrap_or(uid)));
        }
        r.push(format!("user {name} ({})", how.join(", ")));
    }
    for (name, e) in &c.exports {
        r.push(export_line(name, e));
    }
    out
}

/// `export NAME PATH (options)` as the server would serve it.
fn export_line(name: &str, e: &ExportEntry) -> String {
    let list = |l: &Option<Vec<String>>| match l {
        Some(v) => format!("[{}]", v.join(", ")),
        None => "[*, anonymous]".into(),
    };
    match e {
        ExportEntry::Path(p) => format!(
            "export {name} {}: read-write, identity server, readers [*, anonymous], writers [*, anonymous]",
            p.display()
        ),
        ExportEntry::Table(t) => {
            let mut s = format!(
                "export {name} {}: {}, identity {}",
                t.path.display(),
                if t.read_only {
                    "read-only"
                } else {
                    "read-write"
                },
                match t.identity {
                    IdentityKey::Server => "server",
                    IdentityKey::Client => "client",
                }
            );
            if t.identity == IdentityKey::Client {
                let _ = write!(
                    s,
                    " (root_squash {}, all_squash {}, anon {}:{}, trust_client_ids [{}])",
                    t.root_squash,
                    t.all_squash,
                    t.anon_uid,
                    t.anon_gid,
                    t.trust_client_ids.join(", ")
                );
            }
            let _ = write!(
                s,
                ", readers {}, writers {}",
                list(&t.readers),
                list(&t.writers)
            );
            if t.allow_hardlinks {
                s.push_str(", allow_hardlinks");
            }
            if t.allow_devices {
                s.push_str(", allow_devices");
            }
            s
        }
    }
}
