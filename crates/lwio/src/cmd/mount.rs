//! `lwio mount URL MOUNTPOINT`: an export as a FUSE file system
//! (crates/mount), file data over the LWIO data path.
//!
//! Foreground by default: Ctrl-C or SIGTERM unmounts, and so does
//! `fusermount3 -u` from outside. `--daemon` (and the /etc/fstab form, run
//! by mount(8) as `lwio URL MOUNTPOINT -o OPTIONS`) detaches once the mount
//! is up: the parent waits for the child's word and reports its error, so
//! a bad URL, token or export still fails in one line before anything is
//! mounted.

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{anyhow, bail, Context};
use lwio_client::ClientOptions;
use lwio_mount::MountConfig;
use lwio_side::units::parse_duration;

use super::connect_data;
use crate::cli::{ClientArgs, Completion, MountArgs};

/// Set in the detached child of `--daemon`; its stdout is the pipe on which
/// it tells the parent that the mount is up.
const CHILD_ENV: &str = "LWIO_MOUNT_DAEMON_CHILD";
const READY: &str = "lwio-mount-ready";

/// Apply the client's own `-o` options (the ones the file system leaves).
fn client_option(
    a: &mut ClientArgs,
    completion: &mut Completion,
    k: &str,
    v: Option<String>,
) -> anyhow::Result<()> {
    let need = |v: Option<String>| v.ok_or_else(|| anyhow!("mount option {k:?}: needs a value"));
    let duration = |v: Option<String>| {
        let v = need(v)?;
        parse_duration(&v).map_err(|e| anyhow!("mount option \"{k}={v}\": {e}"))
    };
    match k {
        "provider" => {
            let v = need(v)?;
            a.provider = v
                .parse()
                .map_err(|e| anyhow!("mount option \"provider={v}\": {e}"))?
        }
        "device" => a.device = Some(need(v)?),
        "completion" => {
            *completion = match need(v)?.as_str() {
                "poll" => Completion::Poll,
                "interrupt" => Completion::Interrupt,
                o => bail!("mount option \"completion={o}\": expected poll or interrupt"),
            }
        }
        "token_file" => a.token_file = Some(need(v)?.into()),
        "user" => a.user = Some(need(v)?),
        "password_file" => a.password_file = Some(need(v)?.into()),
        "fingerprint" => a.fingerprint = Some(need(v)?),
        "ca" => a.ca = Some(need(v)?.into()),
        "insecure" if v.is_none() => a.insecure = true,
        "no_tls" if v.is_none() => a.no_tls = true,
        "known_hosts" => a.known_hosts = Some(need(v)?.into()),
        "strict_host_key_checking" if v.is_none() => a.strict_host_key_checking = true,
        "busy_poll" => a.busy_poll = Some(duration(v)?),
        "connect_timeout" => a.connect_timeout = duration(v)?,
        _ => bail!(
            "mount option {:?}: unknown (see `lwio mount --help`)",
            match v {
                Some(v) => format!("{k}={v}"),
                None => k.to_string(),
            }
        ),
    }
    Ok(())
}

pub fn run(mut a: MountArgs) -> anyhow::Result<()> {
    // A mount is a service: its warnings (a lost server, a failed close)
    // go to stderr, or to --log once detached.
    crate::cli::init_tracing_default("warn");
    let export = a.url.require_export()?.to_string();
    let subdir = a.url.path.clone();
    let mut cfg = MountConfig::default();
    for list in &a.options {
        for (k, v) in cfg.apply(list)? {
            client_option(&mut a.client, &mut a.completion, &k, v)?;
        }
    }
    match std::fs::metadata(&a.mountpoint) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => bail!("{}: not a directory", a.mountpoint.display()),
        Err(e) => bail!("{}: {e}", a.mountpoint.display()),
    }
    if a.daemon && std::env::var_os(CHILD_ENV).is_none() {
        return spawn_daemon(&a.mountpoint);
    }
    let child = std::env::var_os(CHILD_ENV).is_some();
    if child {
        // SAFETY: setsid has no memory effects; failing (already a group
        // leader) is harmless.
        unsafe { libc::setsid() };
    }
    let opts = ClientOptions {
        completion: match a.completion {
            Completion::Poll => lwio_client::Completion::Poll,
            Completion::Interrupt => lwio_client::Completion::Interrupt,
        },
        client_name: "lwio-mount".into(),
        // A blip keeps the open files (docs/reconnect.md); the mount's own
        // reconnect (a new client) covers what the library cannot.
        reconnect: true,
        ..super::bulk_options()
    };
    let client = connect_data(&a.url, &a.client, opts.clone())?;
    let (provider, completion) = (client.provider(), client.completion());
    // After the server went away, the mount connects again the same way.
    let first = std::sync::Mutex::new(Some(client));
    let (url, args) = (a.url.clone(), a.client.clone());
    let connect: lwio_mount::fs::Connect = Box::new(move || {
        if let Some(c) = first.lock().unwrap_or_else(|p| p.into_inner()).take() {
            return Ok(c);
        }
        connect_data(&url, &args, opts.clone()).map_err(|e| e.to_string())
    });
    let mounted = lwio_mount::mount_reconnecting(connect, &export, &subdir, &a.mountpoint, &cfg)
        .map_err(|e| anyhow!("mounting {} on {}: {e}", a.url, a.mountpoint.display()))?;
    eprintln!(
        "lwio: mounted {} on {} (provider {provider}, completion {completion:?}{})",
        a.url,
        a.mountpoint.display(),
        if cfg.read_only { ", read-only" } else { "" }
    );
    if child {
        detach_stdio(a.log.as_deref())?;
    }
    super::catch_interrupts();
    while !super::interrupted() && !mounted.is_finished() {
        std::thread::sleep(Duration::from_millis(100));
    }
    let stats = mounted.stats().summary();
    if mounted.is_finished() {
        mounted.join()?;
        eprintln!("lwio: {} was unmounted ({stats})", a.mountpoint.display());
        return Ok(());
    }
    mounted
        .unmount()
        .with_context(|| format!("unmounting {}", a.mountpoint.display()))?;
    eprintln!("lwio: unmounted {} ({stats})", a.mountpoint.display());
    Ok(())
}

/// Tell the parent we are up, then let go of its pipes: stdout and stderr
/// go to `log` (appended) or /dev/null.
fn detach_stdio(log: Option<&Path>) -> anyhow::Result<()> {
    let mut out = std::io::stdout();
    writeln!(out, "{READY}")?;
    out.flush()?;
    let target = match log {
        Some(p) => std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(p)
            .with_context(|| format!("--log {}", p.display()))?,
        None => std::fs::OpenOptions::new().write(true).open("/dev/null")?,
    };
    use std::os::fd::AsRawFd;
    for fd in [1, 2] {
        // SAFETY: dup2 onto the standard descriptors; `target` is a valid
        // open file for the duration of the call.
        if unsafe { libc::dup2(target.as_raw_fd(), fd) } < 0 {
            return Err(std::io::Error::last_os_error().into());
        }
    }
    Ok(())
}

/// Run this command again as a detached child, wait for it to mount (or
/// fail), and return.
fn spawn_daemon(mountpoint: &Path) -> anyhow::Result<()> {
    let exe = std::env::current_exe().context("finding the lwio executable")?;
    let args: Vec<_> = std::env::args_os().skip(1).collect();
    let mut child = Command::new(exe)
        .args(args)
        .env(CHILD_ENV, "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("starting the mount daemon")?;
    let stdout = child.stdout.take().expect("piped stdout");
    let stderr = child.stderr.take().expect("piped stderr");
    // Relay what the child says on stderr until it is up.
    let relay = std::thread::spawn(move || {
        let mut lines = Vec::new();
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            lines.push(line);
        }
        lines
    });
    let mut first = String::new();
    let _ = BufReader::new(stdout).read_line(&mut first);
    if first.trim() == READY {
        // The child keeps running; its stderr now goes to its log.
        let lines = relay.join().unwrap_or_default();
        for l in lines {
            eprintln!("{l}");
        }
        return Ok(());
    }
    let status = child.wait()?;
    let lines = relay.join().unwrap_or_default();
    // The child's own "lwio: error: …" line is the message.
    let msg = lines
        .iter()
        .rev()
        .find_map(|l| l.strip_prefix("lwio: error: "))
        .map(str::to_string)
        .unwrap_or_else(|| format!("the mount daemon exited with {status}"));
    if msg.contains(&*mountpoint.to_string_lossy()) {
        bail!("{msg}")
    }
    bail!("{msg} (mounting on {})", mountpoint.display())
}
