//! Run the verbs conformance suite between two contexts chosen on the
//! command line, e.g. soft↔soft on loopback, or soft↔siw / rxe↔rxe in a VM:
//!
//! ```text
//! lwio-conformance --server-provider soft --client-provider verbs \
//!     --server-device soft0 --client-device siw0 --addr 10.0.2.15:7471 [--crc on|off]
//!     [--progress auto|manual] [--only CASE[,CASE…]] [--list]
//! ```
//! Prints `PASS name`, `FAIL name: why` or `SKIP name: why` per case; a case
//! that fails with a known driver deviation (`conformance::DEVIATIONS`) is
//! `XFAIL name: reason (docs/interop.md#…) [failure]` and does not fail the
//! run, a listed case that passes is `XPASS name`. Then `K expected
//! deviations` and a final `N passed, M failed, K skipped` (XFAILs counted
//! as skipped); exits 1 if any case failed.

use std::net::SocketAddr;
use std::process::ExitCode;

use lwio_rdma::conformance::{self, Outcome};
use lwio_rdma::*;

struct Args {
    server_provider: String,
    client_provider: String,
    server_device: Option<String>,
    client_device: Option<String>,
    addr: SocketAddr,
    crc: CrcPolicy,
    progress: Progress,
    only: Option<Vec<String>>,
    list: bool,
}

const USAGE: &str =
    "usage: lwio-conformance [--server-provider soft|verbs] [--client-provider soft|verbs] \
[--server-device NAME] [--client-device NAME] [--addr IP:PORT] [--crc on|off] \
[--progress auto|manual] [--only CASE[,CASE...]] [--list]";

fn parse() -> Result<Args, String> {
    let mut a = Args {
        server_provider: "soft".into(),
        client_provider: "soft".into(),
        server_device: None,
        client_device: None,
        addr: "127.0.0.1:0".parse().expect("literal"),
        crc: CrcPolicy::Off,
        progress: Progress::Auto,
        only: None,
        list: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let mut val = || {
            it.next()
                .ok_or_else(|| format!("{k} needs a value\n{USAGE}"))
        };
        match k.as_str() {
            "--server-provider" => a.server_provider = val()?,
            "--client-provider" => a.client_provider = val()?,
            "--server-device" => a.server_device = Some(val()?),
            "--client-device" => a.client_device = Some(val()?),
            "--addr" => {
                let v = val()?;
                a.addr = v.parse().map_err(|e| format!("--addr {v}: {e}"))?
            }
            "--crc" => {
                a.crc = match val()?.as_str() {
                    "on" => CrcPolicy::Required,
                    "off" => CrcPolicy::Off,
                    "preferred" => CrcPolicy::Preferred,
                    v => return Err(format!("--crc {v}: want on|off")),
                }
            }
            "--progress" => {
                a.progress = match val()?.as_str() {
                    "auto" => Progress::Auto,
                    "manual" => Progress::Manual,
                    v => return Err(format!("--progress {v}: want auto|manual")),
                }
            }
            "--only" => a.only = Some(val()?.split(',').map(str::to_string).collect()),
            "--list" => a.list = true,
            "-h" | "--help" => return Err(USAGE.into()),
            _ => return Err(format!("unknown argument {k:?}\n{USAGE}")),
        }
    }
    Ok(a)
}

fn open(provider_name: &str, device: Option<&str>, cfg: &Config) -> Result<Context, String> {
    let p = provider(provider_name).map_err(|e| e.to_string())?;
    p.open(device, cfg).map_err(|e| {
        format!(
            "{provider_name} device {}: {e}",
            device.unwrap_or("(first usable)")
        )
    })
}

fn main() -> ExitCode {
    let a = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    if a.list {
        for n in conformance::case_names() {
            println!("{n}");
        }
        return ExitCode::SUCCESS;
    }
    let cfg = Config {
        progress: a.progress,
        mpa_crc: a.crc,
        ..Config::default()
    };
    let ctxs = open(&a.server_provider, a.server_device.as_deref(), &cfg).and_then(|s| {
        Ok((
            s,
            open(&a.client_provider, a.client_device.as_deref(), &cfg)?,
        ))
    });
    let (server, client) = match ctxs {
        Ok(c) => c,
        Err(e) => {
            println!("FAIL setup: {e}");
            println!("0 passed, 1 failed");
            return ExitCode::FAILURE;
        }
    };
    let only = a.only.clone();
    let results = conformance::run_filtered(&server, &client, a.addr, |n| {
        only.as_ref().is_none_or(|o| o.iter().any(|x| x == n))
    });
    let results = match results {
        Ok(r) => r,
        Err(e) => {
            println!("FAIL setup: listen on {}: {e}", a.addr);
            println!("0 passed, 1 failed");
            return ExitCode::FAILURE;
        }
    };
    let (mut p, mut f, mut s, mut x) = (0, 0, 0, 0);
    for r in &results {
        let dev = conformance::deviation(&server, &client, r.name);
        match (&r.outcome, dev) {
            (Outcome::Fail(w), Some(d)) => {
                // Known deviation: reported, counted among the skipped.
                println!("XFAIL {}: {} ({}) [{w}]", r.name, d.reason, d.reference);
                x += 1;
                s += 1;
            }
            (Outcome::Pass, Some(d)) => {
                println!("XPASS {} (listed deviation: {})", r.name, d.reference);
                p += 1;
            }
            (Outcome::Pass, None) => {
                println!("{r}");
                p += 1;
            }
            (Outcome::Fail(_), None) => {
                println!("{r}");
                f += 1;
            }
            (Outcome::Skip(_), _) => {
                println!("{r}");
                s += 1;
            }
        }
    }
    println!(
        "{x} expected deviations (server {}, client {})",
        conformance::driver_of(&server),
        conformance::driver_of(&client)
    );
    println!("{p} passed, {f} failed, {s} skipped");
    if f > 0 {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
