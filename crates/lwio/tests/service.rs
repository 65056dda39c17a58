//! Running lwio as a service: `serve --check-config`, the man pages and
//! completions of `generate`, sd_notify (READY=1, STATUS=, STOPPING=1),
//! SIGHUP and `--log-format json`.

use std::io::{BufRead, BufReader, Read};
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use assert_cmd::cargo::CommandCargoExt;

fn lwio() -> assert_cmd::Command {
    let mut c = assert_cmd::Command::cargo_bin("lwio").unwrap();
    c.env("LWIO_TOKEN_FILE", "/nonexistent/lwio-test-token")
        .env_remove("NOTIFY_SOCKET")
        .env_remove("RUST_LOG");
    c
}

const HASH: &str =
    "$argon2id$v=19$m=19456,t=2,p=1$c2FsdHNhbHRzYWx0$8Jz3Y0Jq4V3m4yQv2Yl1bX0cVb0W8Kq9yQd3W2xJmWQ";

/// A directory with `data/`, a TLS certificate and key, and `good.toml`
/// that uses them all.
struct Setup {
    dir: tempfile::TempDir,
}

impl Setup {
    fn new() -> Setup {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("data")).unwrap();
        let ck = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).unwrap();
        std::fs::write(dir.path().join("cert.pem"), ck.cert.pem()).unwrap();
        std::fs::write(dir.path().join("key.pem"), ck.key_pair.serialize_pem()).unwrap();
        let s = Setup { dir };
        s.write("good.toml", &s.good());
        s
    }
    fn p(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }
    fn d(&self) -> String {
        self.dir.path().display().to_string()
    }
    fn good(&self) -> String {
        let d = self.d();
        format!(
            r#"listen = "127.0.0.1:7500"
token_file = "{d}/token"
tls_cert = "{d}/cert.pem"
tls_key = "{d}/key.pem"
metrics_listen = "127.0.0.1:9400"

[exports]
data = {{ path = "{d}/data", writers = ["alice"] }}
ro = {{ path = "{d}/data", read_only = true }}

[users.alice]
password = "{HASH}"
"#
        )
    }
    fn write(&self, name: &str, text: &str) -> PathBuf {
        let p = self.p(name);
        std::fs::write(&p, text).unwrap();
        p
    }
    fn check(&self, name: &str) -> assert_cmd::assert::Assert {
        lwio()
            .args(["serve", "--check-config"])
            .arg(self.p(name))
            .assert()
    }
}

fn stdout(a: &assert_cmd::assert::Assert) -> String {
    String::from_utf8_lossy(&a.get_output().stdout).into_owned()
}
fn stderr(a: &assert_cmd::assert::Assert) -> String {
    String::from_utf8_lossy(&a.get_output().stderr).into_owned()
}

#[test]
fn check_config_good_file_prints_what_would_be_served() {
    let s = Setup::new();
    let a = s.check("good.toml").success();
    let d = s.d();
    let out = stdout(&a);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(
        lines[0],
        format!("lwio: {d}/good.toml is valid; lwio serve would:")
    );
    assert!(
        lines[1].starts_with(&format!(
            "listen 127.0.0.1:7500 (side channel), TLS certificate {d}/cert.pem (key {d}/key.pem), fingerprint sha256:"
        )),
        "{out}"
    );
    assert_eq!(lines[2], "RDMA listen 127.0.0.1:7501 (provider auto)");
    assert_eq!(lines[3], "metrics on http://127.0.0.1:9400/metrics");
    assert_eq!(
        lines[4],
        format!("token file {d}/token (created on first start)")
    );
    assert_eq!(lines[5], "user alice (password)");
    assert_eq!(
        lines[6],
        format!("export data {d}/data: read-write, identity server, readers [*, anonymous], writers [alice]")
    );
    assert_eq!(
        lines[7],
        format!("export ro {d}/data: read-only, identity server, readers [*, anonymous], writers [*, anonymous]")
    );
    assert_eq!(lines.len(), 8, "{out}");
    assert_eq!(stderr(&a), "");
    // Checking binds and creates nothing.
    assert!(!s.p("token").exists());
}

#[test]
fn check_config_missing_export_path() {
    let s = Setup::new();
    s.write(
        "bad.toml",
        &s.good().replace("/data\", writers", "/nope\", writers"),
    );
    let a = s.check("bad.toml").code(1);
    assert_eq!(
        stderr(&a),
        format!(
            "lwio: error: config file {d}/bad.toml: export data: {d}/nope: No such file or directory\n",
            d = s.d()
        )
    );
    assert_eq!(stdout(&a), "");
}

#[test]
fn check_config_export_that_is_a_file() {
    let s = Setup::new();
    s.write(
        "bad.toml",
        &s.good()
            .replace("/data\", read_only", "/cert.pem\", read_only"),
    );
    let a = s.check("bad.toml").code(1);
    assert_eq!(
        stderr(&a),
        format!(
            "lwio: error: config file {d}/bad.toml: export ro: {d}/cert.pem: Not a directory\n",
            d = s.d()
        )
    );
}

#[test]
fn check_config_unreadable_and_unparsable_key() {
    let s = Setup::new();
    s.write(
        "bad.toml",
        &s.good().replace("/key.pem", "/missing-key.pem"),
    );
    let a = s.check("bad.toml").code(1);
    assert_eq!(
        stderr(&a),
        format!(
            "lwio: error: config file {d}/bad.toml: TLS key {d}/missing-key.pem: No such file or directory\n",
            d = s.d()
        )
    );
    std::fs::write(s.p("key.pem"), "not a key\n").unwrap();
    let a = s.check("good.toml").code(1);
    let err = stderr(&a);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.starts_with(&format!(
            "lwio: error: config file {d}/good.toml: TLS certificate {d}/cert.pem / key {d}/key.pem: ",
            d = s.d()
        )),
        "{err}"
    );
}

#[test]
fn check_config_unknown_key() {
    let s = Setup::new();
    s.write("bad.toml", &format!("colour = \"blue\"\n{}", s.good()));
    let a = s.check("bad.toml").code(1);
    let err = stderr(&a);
    assert!(
        err.starts_with(&format!(
            "lwio: error: config file {}/bad.toml: line 1 (colour = \"blue\"): unknown field `colour`, expected one of `listen`,",
            s.d()
        )),
        "{err}"
    );
    assert_eq!(err.lines().count(), 1, "{err}");
    assert_eq!(stdout(&a), "");
}

#[test]
fn check_config_bad_user_hash() {
    let s = Setup::new();
    s.write("bad.toml", &s.good().replace("$v=19$", "$v=x$"));
    let a = s.check("bad.toml").code(1);
    assert_eq!(
        stderr(&a),
        format!(
            "lwio: error: config file {}/bad.toml: users.alice.password: not a PHC password hash: invalid parameter value: contains invalid character: 'x'\n",
            s.d()
        )
    );
}

#[test]
fn check_config_reports_every_problem_one_line_each() {
    let s = Setup::new();
    let text = s
        .good()
        .replace("/data\", writers", "/nope\", writers")
        .replace("/key.pem", "/missing-key.pem")
        .replace("$v=19$", "$v=x$");
    s.write("bad.toml", &text);
    let a = s.check("bad.toml").code(1);
    let err = stderr(&a);
    let lines: Vec<&str> = err.lines().collect();
    assert_eq!(lines.len(), 3, "{err}");
    assert!(lines[0].ends_with("users.alice.password: not a PHC password hash: invalid parameter value: contains invalid character: 'x'"), "{err}");
    assert!(
        lines[1].ends_with("/nope: No such file or directory"),
        "{err}"
    );
    assert!(
        lines[2].ends_with("/missing-key.pem: No such file or directory"),
        "{err}"
    );
}

#[test]
fn check_config_no_export_and_unreadable_file() {
    let s = Setup::new();
    s.write("empty.toml", "# nothing\n");
    let a = s.check("empty.toml").code(1);
    assert_eq!(
        stderr(&a),
        format!(
            "lwio: error: config file {}/empty.toml: nothing to serve: give at least one --export NAME=PATH (or [exports] in --config)\n",
            s.d()
        )
    );
    // --export on the command line counts, as for serve.
    lwio()
        .args(["serve", "--export"])
        .arg(format!("x={}", s.p("data").display()))
        .arg("--check-config")
        .arg(s.p("empty.toml"))
        .assert()
        .success();
    let a = s.check("missing.toml").code(1);
    assert_eq!(
        stderr(&a),
        format!(
            "lwio: error: cannot read config file {}/missing.toml: No such file or directory (os error 2)\n",
            s.d()
        )
    );
}

/// identity = "client" needs CAP_SETUID/CAP_SETGID: root without them (its
/// bounding set cut by setpriv) is told so.
#[test]
fn check_config_client_identity_needs_setuid() {
    let s = Setup::new();
    s.write(
        "client.toml",
        &s.good()
            .replace("writers = [\"alice\"] }", "identity = \"client\" }"),
    );
    let setpriv = Path::new("/usr/bin/setpriv");
    if unsafe { libc::geteuid() } != 0 || !setpriv.exists() {
        eprintln!("skipped: needs root and setpriv");
        return;
    }
    let a = s.check("client.toml").success();
    assert!(
        stdout(&a).contains(&format!("export data {}/data: read-write, identity client (root_squash true, all_squash false, anon 65534:65534, trust_client_ids []), readers [*, anonymous], writers [*, anonymous]\n", s.d())),
        "{}",
        stdout(&a)
    );
    let a = assert_cmd::Command::new(setpriv)
        .args(["--bounding-set", "-setuid,-setgid", "--"])
        .arg(assert_cmd::cargo::cargo_bin("lwio"))
        .args(["serve", "--check-config"])
        .arg(s.p("client.toml"))
        .assert()
        .code(1);
    assert_eq!(
        stderr(&a),
        format!("lwio: error: config file {}/client.toml: export data: identity = \"client\" needs a server that may act as other users (root, or CAP_SETUID and CAP_SETGID); use identity = \"server\" otherwise\n", s.d())
    );
}

/// The subcommands `lwio --help` lists.
fn help_subcommands() -> Vec<String> {
    let a = lwio().arg("--help").assert().success();
    let out = stdout(&a);
    let mut names = Vec::new();
    let mut inside = false;
    for l in out.lines() {
        if l.starts_with("Commands:") {
            inside = true;
            continue;
        }
        if inside {
            if !l.starts_with("  ") {
                break;
            }
            let name = l.split_whitespace().next().unwrap().to_string();
            if name != "help" {
                names.push(name);
            }
        }
    }
    names
}

#[test]
fn generate_man_pages_and_completions() {
    let subs = help_subcommands();
    assert!(subs.len() >= 10, "{subs:?}");
    assert!(subs.iter().any(|s| s == "serve"));
    assert!(!subs.iter().any(|s| s == "generate"), "generate is hidden");
    let dir = tempfile::tempdir().unwrap();
    let man = dir.path().join("man");
    lwio()
        .args(["generate", "man"])
        .arg(&man)
        .assert()
        .success()
        .stdout(format!(
            "lwio: wrote {} man pages in {}\n",
            subs.len() + 3,
            man.display()
        ));
    let top = std::fs::read_to_string(man.join("lwio.1")).unwrap();
    assert!(top.contains("\n.TH lwio 1 "), "{top}");
    assert!(top.contains("\n.SH \"SEE ALSO\"\n"), "{top}");
    for s in &subs {
        let page = man.join(format!("lwio-{s}.1"));
        let text =
            std::fs::read_to_string(&page).unwrap_or_else(|e| panic!("{}: {e}", page.display()));
        assert!(text.contains(&format!("\n.TH lwio-{s} 1 ")), "{s}: {text}");
        assert!(
            top.contains(&format!("lwio\\-{}(1)", s.replace('-', "\\-"))),
            "lwio.1 does not name {s}"
        );
    }
    let toml5 = std::fs::read_to_string(man.join("lwio.toml.5")).unwrap();
    assert!(toml5.starts_with(".TH LWIO.TOML 5 "), "{toml5}");
    for key in ["listen", "max_sessions", "shutdown_grace", "identity"] {
        assert!(
            toml5.contains(&format!(".TP\n\\fB{key}\\fR")),
            "lwio.toml.5 lacks {key}"
        );
    }
    let lib3 = std::fs::read_to_string(man.join("liblwio.3")).unwrap();
    assert!(lib3.starts_with(".TH LIBLWIO 3 "));
    assert!(lib3.contains("lwio_connect"));
    // man(1) can format every page without a warning.
    if Path::new("/usr/bin/man").exists() {
        for entry in std::fs::read_dir(&man).unwrap() {
            let p = entry.unwrap().path();
            let out = Command::new("man")
                .args(["--warnings=w", "-l"])
                .arg(&p)
                .env("MANPAGER", "cat")
                .env("MANWIDTH", "80")
                .output()
                .unwrap();
            assert!(out.status.success(), "{}", p.display());
            assert!(!out.stdout.is_empty(), "{}", p.display());
        }
    }

    let comp = dir.path().join("comp");
    lwio()
        .args(["generate", "completions"])
        .arg(&comp)
        .assert()
        .success()
        .stdout(format!("lwio: wrote 3 completions in {}\n", comp.display()));
    let bash = std::fs::read_to_string(comp.join("lwio")).unwrap();
    let zsh = std::fs::read_to_string(comp.join("_lwio")).unwrap();
    let fish = std::fs::read_to_string(comp.join("lwio.fish")).unwrap();
    assert!(zsh.starts_with("#compdef lwio"));
    for s in &subs {
        assert!(bash.contains(&format!("lwio,{s})")), "bash lacks {s}");
        assert!(fish.contains(&format!("-a \"{s}\"")), "fish lacks {s}");
    }
    assert!(bash.contains("--check-config"));
}

/// A server with `$NOTIFY_SOCKET` set to a socket of the test.
struct Notified {
    child: std::process::Child,
    sock: UnixDatagram,
    stdout: BufReader<std::process::ChildStdout>,
    dir: tempfile::TempDir,
}

impl Notified {
    fn start(extra: &[&str], config: Option<&str>) -> Notified {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("data")).unwrap();
        let sock_path = dir.path().join("notify");
        let sock = UnixDatagram::bind(&sock_path).unwrap();
        sock.set_read_timeout(Some(Duration::from_secs(30)))
            .unwrap();
        let mut cmd = Command::cargo_bin("lwio").unwrap();
        cmd.args(["serve", "--listen", "127.0.0.1:0", "--provider", "soft"])
            .arg("--token-file")
            .arg(dir.path().join("token"));
        match config {
            Some(text) => {
                let p = dir.path().join("lwio.toml");
                std::fs::write(
                    &p,
                    text.replace("@DATA@", &dir.path().join("data").display().to_string()),
                )
                .unwrap();
                cmd.arg("--config").arg(p);
            }
            None => {
                cmd.arg("--export")
                    .arg(format!("data={}", dir.path().join("data").display()));
            }
        }
        let mut child = cmd
            .args(extra)
            .env("NOTIFY_SOCKET", &sock_path)
            .env_remove("RUST_LOG")
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(dir.path().join("stderr")).unwrap())
            .spawn()
            .unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        Notified {
            child,
            sock,
            stdout,
            dir,
        }
    }
    fn recv(&self) -> String {
        let mut buf = [0u8; 4096];
        let n = self.sock.recv(&mut buf).expect("a notification in 30 s");
        String::from_utf8_lossy(&buf[..n]).into_owned()
    }
    fn stderr(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("stderr")).unwrap()
    }
    /// The next notification that is not a periodic `STATUS=serving…`,
    /// within 30 s.
    fn recv_skipping_status(&self) -> String {
        let t0 = Instant::now();
        loop {
            let got = self.recv();
            if !got.starts_with("STATUS=serving") {
                return got;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "only STATUS= for 30 s"
            );
        }
    }
    /// After a SIGHUP: `RELOADING=1` with `MONOTONIC_USEC=`, then
    /// `READY=1` (sd_notify(3), the reload protocol of `Type=notify`).
    fn reloaded(&self) {
        let r = self.recv_skipping_status();
        let mut lines = r.lines();
        assert_eq!(lines.next(), Some("RELOADING=1"), "{r:?}");
        let usec = lines.next().and_then(|l| l.strip_prefix("MONOTONIC_USEC="));
        assert!(
            usec.is_some_and(|u| u.parse::<u64>().is_ok_and(|u| u > 0)),
            "{r:?}"
        );
        let ready = self.recv_skipping_status();
        assert!(ready.starts_with("READY=1\nSTATUS=serving: "), "{ready:?}");
    }
    /// The side-channel address from stdout (after `READY=1`).
    fn side_addr(&mut self) -> String {
        let mut line = String::new();
        loop {
            line.clear();
            assert!(self.stdout.read_line(&mut line).unwrap() > 0, "no address");
            if let Some(a) = line.trim_end().strip_prefix("lwio: listening on ") {
                return a.to_string();
            }
        }
    }
    fn signal(&self, sig: i32) {
        assert_eq!(unsafe { libc::kill(self.child.id() as i32, sig) }, 0);
    }
    fn wait_stderr(&self, what: &str) -> String {
        let t0 = Instant::now();
        loop {
            let e = self.stderr();
            if e.contains(what) {
                return e;
            }
            assert!(t0.elapsed() < Duration::from_secs(30), "no {what:?} in {e}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Notified {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn sd_notify_ready_status_reload_and_stopping() {
    let mut s = Notified::start(&[], Some("[exports]\ndata = \"@DATA@\"\n"));
    let ready = s.recv();
    // READY=1 comes once the side channel and the RDMA listener are up:
    // their addresses are on stdout already, and both accept.
    let mut lines = Vec::new();
    let mut line = String::new();
    while lines.len() < 3 {
        line.clear();
        assert!(s.stdout.read_line(&mut line).unwrap() > 0);
        lines.push(line.trim_end().to_string());
    }
    assert!(
        ready.starts_with(
            "READY=1\nSTATUS=serving: 0 sessions, 0 RDMA connections, 0 durable sessions"
        ),
        "{ready:?}"
    );
    let side = lines
        .iter()
        .find_map(|l| l.strip_prefix("lwio: listening on "))
        .unwrap_or_else(|| panic!("{lines:?}"));
    let rdma = lines
        .iter()
        .find_map(|l| l.strip_prefix("lwio: RDMA listening on "))
        .and_then(|l| l.split(' ').next())
        .unwrap_or_else(|| panic!("{lines:?}"));
    for addr in [side, rdma] {
        std::net::TcpStream::connect_timeout(&addr.parse().unwrap(), Duration::from_secs(5))
            .unwrap_or_else(|e| panic!("{addr}: {e}"));
    }
    // STATUS= refreshes.
    let status = s.recv();
    assert!(status.starts_with("STATUS=serving: "), "{status:?}");

    // SIGHUP with the file unchanged: re-read, still serving; the reload
    // protocol of sd_notify(3) around it.
    s.signal(libc::SIGHUP);
    s.reloaded();
    s.wait_stderr("SIGHUP: configuration re-read and checked: unchanged");
    assert!(
        s.child.try_wait().unwrap().is_none(),
        "SIGHUP must not stop the server"
    );
    // Changed: the new export is applied; a setting that cannot change
    // live is named, one line.
    let cfg = s.dir.path().join("lwio.toml");
    let d = s.dir.path().join("data").display().to_string();
    std::fs::write(
        &cfg,
        format!("[limits]\nmax_sessions = 7\n[exports]\ndata = \"{d}\"\nmore = \"{d}\"\n"),
    )
    .unwrap();
    s.signal(libc::SIGHUP);
    s.reloaded();
    let e = s.wait_stderr(&format!("SIGHUP: export added: more path={d}"));
    assert_eq!(
        e.matches("SIGHUP: needs a restart: limits").count(),
        1,
        "{e}"
    );
    assert!(!e.contains("needs a restart: exports"), "{e}");
    // Broken: one line per problem, still serving.
    std::fs::write(&cfg, "[exports]\ndata = \"/nonexistent\"\n").unwrap();
    s.signal(libc::SIGHUP);
    s.reloaded();
    s.wait_stderr("export data: /nonexistent: No such file or directory");
    assert!(s.child.try_wait().unwrap().is_none());

    s.signal(libc::SIGTERM);
    assert_eq!(s.recv_skipping_status(), "STOPPING=1\nSTATUS=shutting down");
    let t0 = Instant::now();
    let status = loop {
        if let Some(st) = s.child.try_wait().unwrap() {
            break st;
        }
        assert!(t0.elapsed() < Duration::from_secs(15), "did not stop");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "{status}");
}

#[test]
fn log_format_json_is_one_object_per_line() {
    let mut s = Notified::start(&["--log-format", "json"], None);
    assert!(s.recv().starts_with("READY=1\n"));
    s.signal(libc::SIGTERM);
    let _ = s.child.wait();
    let mut rest = String::new();
    s.stdout.read_to_string(&mut rest).unwrap();
    let err = s.stderr();
    assert!(err.lines().count() >= 3, "{err}");
    let mut messages = Vec::new();
    for l in err.lines() {
        let v: serde_json::Value = serde_json::from_str(l).unwrap_or_else(|e| panic!("{l:?}: {e}"));
        assert!(v["timestamp"].is_string(), "{l}");
        assert!(v["level"].is_string(), "{l}");
        messages.push(v["fields"]["message"].as_str().unwrap_or("").to_string());
    }
    assert!(messages.iter().any(|m| m == "export"), "{messages:?}");
    assert!(
        messages.iter().any(|m| m == "SIGTERM: shutting down"),
        "{messages:?}"
    );
}

/// SIGHUP applies the exports and users of the file to a running server
/// (docs/operations.md, "Reload"): sessions stay, a new export is reached
/// by new sessions, a new user logs in; a removed user's session ends and
/// its login is refused, a removed export refuses new requests as an
/// unknown one; a broken file changes nothing.
#[test]
fn sighup_applies_exports_and_users_without_dropping_sessions() {
    use lwio_client::side_client::{Login, SideClient as Side, SideOptions, Token};
    use lwio_client::{Client, ClientOptions, ClientTls, OpenOptions, ProviderChoice};
    use lwio_side::user_token::TokenVerifier;

    const ALICE: &str = "alice-token-0123456789abcdef";
    const BOB: &str = "bob-token-0123456789abcdef01";
    let verifier = |t: &str| TokenVerifier::from_token(t.as_bytes()).to_string();
    let users = |names: &[(&str, &str)]| -> String {
        names
            .iter()
            .map(|(u, t)| format!("[users.{u}]\ntoken = \"{}\"\n", verifier(t)))
            .collect()
    };
    let mut s = Notified::start(
        &[],
        Some(&format!(
            "tls = false\n[exports]\na = \"@DATA@\"\n{}",
            users(&[("alice", ALICE)])
        )),
    );
    assert!(s.recv().starts_with("READY=1"));
    let side = s.side_addr();
    let d = s.dir.path().to_path_buf();
    let cfg = d.join("lwio.toml");
    let login = |user: &str, token: &str| {
        SideOptions::new(Login::UserToken {
            user: user.into(),
            token: Token::new(token).unwrap(),
        })
    };
    let client = |export: &str, user: &str, token: &str| {
        let opts = ClientOptions {
            provider: ProviderChoice::Soft,
            tls: Some(ClientTls::Off),
            ..ClientOptions::default()
        };
        Client::connect_with(
            &format!("lwio://{side}/{export}"),
            &login(user, token),
            opts,
        )
    };
    let pattern = |n: usize, seed: u8| -> Vec<u8> {
        (0..n)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect()
    };
    // A session of alice on export a writes and reads a file.
    let a1 = client("a", "alice", ALICE).unwrap();
    let f = a1
        .open("one.bin", &OpenOptions::read_write().create(true))
        .unwrap();
    let one = pattern(300_000, 1);
    f.write_at(&one, 0).unwrap();
    let mut back = vec![0u8; one.len()];
    assert_eq!(f.read_at(&mut back, 0).unwrap(), one.len());
    assert!(back == one);
    assert_eq!(std::fs::read(d.join("data/one.bin")).unwrap(), one);
    // Her side channel, to check the namespace as her later on.
    let mut alice_side = Side::connect(&side, &login("alice", ALICE)).unwrap();
    // Bob is not a user yet; export b is not served.
    let e = Side::connect(&side, &login("bob", BOB)).unwrap_err();
    assert_eq!(
        e.to_string(),
        "authentication failed: wrong user name or token"
    );
    let e = alice_side.list_dir("b", "").unwrap_err();
    assert_eq!(e.to_string(), "no export named \"b\" on this server");

    // Add export b (with a file in it) and user bob; remove nothing.
    std::fs::create_dir(d.join("b")).unwrap();
    let two = pattern(200_000, 7);
    std::fs::write(d.join("b/two.bin"), &two).unwrap();
    let data = d.join("data").display().to_string();
    let b = d.join("b").display().to_string();
    std::fs::write(
        &cfg,
        format!(
            "tls = false\n[exports]\na = \"{data}\"\nb = \"{b}\"\n{}",
            users(&[("alice", ALICE), ("bob", BOB)])
        ),
    )
    .unwrap();
    s.signal(libc::SIGHUP);
    s.reloaded();
    let log = s.wait_stderr("SIGHUP: configuration reloaded");
    assert!(
        log.contains(&format!("SIGHUP: export added: b path={b}")),
        "{log}"
    );
    assert!(log.contains("SIGHUP: user added: bob"), "{log}");
    assert!(!log.contains("needs a restart"), "{log}");
    // A new session reaches b: the data byte for byte.
    let b1 = client("b", "alice", ALICE).unwrap();
    let g = b1.open("two.bin", &OpenOptions::read_only()).unwrap();
    let mut got = vec![0u8; two.len()];
    assert_eq!(g.read_at(&mut got, 0).unwrap(), two.len());
    assert!(got == two, "export b's file, byte for byte");
    // The first session on a still works, on the file it had open.
    let more = pattern(65_536, 3);
    f.write_at(&more, one.len() as u64).unwrap();
    let mut back = vec![0u8; more.len()];
    assert_eq!(f.read_at(&mut back, one.len() as u64).unwrap(), more.len());
    assert!(back == more);
    assert_eq!(alice_side.list_dir("b", "").unwrap().len(), 1);
    // Bob logs in, and reaches a.
    let bob = client("a", "bob", BOB).unwrap();
    let h = bob.open("one.bin", &OpenOptions::read_only()).unwrap();
    let mut got = vec![0u8; one.len()];
    assert_eq!(h.read_at(&mut got, 0).unwrap(), one.len());
    assert!(got == one);

    // Remove alice and export b.
    std::fs::write(
        &cfg,
        format!(
            "tls = false\n[exports]\na = \"{data}\"\n{}",
            users(&[("bob", BOB)])
        ),
    )
    .unwrap();
    s.signal(libc::SIGHUP);
    s.reloaded();
    let log = s.wait_stderr("SIGHUP: export removed: b");
    // Her three sessions (two clients, one side channel) and the two files
    // they had open.
    assert!(
        log.contains("SIGHUP: user removed: alice (3 sessions ended, 2 open files closed)"),
        "{log}"
    );
    // Alice's login is refused; her sessions were ended, with the reason.
    let e = Side::connect(&side, &login("alice", ALICE)).unwrap_err();
    assert_eq!(
        e.to_string(),
        "authentication failed: wrong user name or token"
    );
    let e = alice_side.list_dir("a", "").unwrap_err();
    assert_eq!(
        e.to_string(),
        "session ended: user alice was removed from the configuration (server reload)"
    );
    // Her open file is closed: the data path refuses it.
    // The server answers STATUS_FILE_CLOSED (the registered file was
    // closed under the connection) or STATUS_INVALID_HANDLE (its handle is
    // gone already), depending on which the data path looks at first.
    // Either way no data moves.
    let e = f.read_at(&mut back, 0).unwrap_err();
    assert!(
        matches!(&e, lwio_client::Error::Status { what, status }
            if what == "READ of a/one.bin" && [0xC000_0128, 0xC000_0008].contains(status)),
        "STATUS_FILE_CLOSED or STATUS_INVALID_HANDLE: {e:?}"
    );
    // Export b refuses a new open, as an unknown export.
    let mut bob_side = Side::connect(&side, &login("bob", BOB)).unwrap();
    let e = bob_side
        .open("b", "two.bin", &OpenOptions::read_only().0, 0)
        .unwrap_err();
    assert_eq!(e.to_string(), "no export named \"b\" on this server");
    // Bob's session on a goes on.
    assert!(bob_side.list_dir("a", "").unwrap().len() == 1);
    let mut got = vec![0u8; 4096];
    assert_eq!(h.read_at(&mut got, 0).unwrap(), 4096);
    assert!(got[..] == one[..4096]);

    // A broken file changes nothing: a still works, the log says why.
    std::fs::write(
        &cfg,
        format!(
            "tls = false\n[exports]\na = \"{data}\"\nc = \"{}/missing\"\n",
            d.display()
        ),
    )
    .unwrap();
    s.signal(libc::SIGHUP);
    s.reloaded();
    let log = s.wait_stderr("missing: No such file or directory");
    assert!(
        log.contains(
            "SIGHUP: configuration has a problem; still serving the configuration in force"
        ),
        "{log}"
    );
    assert_eq!(bob_side.list_dir("a", "").unwrap().len(), 1);
    let e = bob_side.list_dir("c", "").unwrap_err();
    assert_eq!(e.to_string(), "no export named \"c\" on this server");
    assert!(Side::connect(&side, &login("bob", BOB)).is_ok());

    // A changed export option applies to new requests; a file open on it
    // goes on.
    std::fs::write(
        &cfg,
        format!(
            "tls = false\n[exports]\na = {{ path = \"{data}\", read_only = true }}\n{}",
            users(&[("bob", BOB)])
        ),
    )
    .unwrap();
    s.signal(libc::SIGHUP);
    s.reloaded();
    s.wait_stderr(&format!("SIGHUP: export changed: a path={data}"));
    let e = bob_side
        .open(
            "a",
            "new.txt",
            &OpenOptions::read_write().create(true).0,
            0o644,
        )
        .unwrap_err();
    assert_eq!(e.to_string(), "export a is read-only");
    let mut got = vec![0u8; 4096];
    assert_eq!(h.read_at(&mut got, 4096).unwrap(), 4096);
    assert!(got[..] == one[4096..8192]);

    // Bob's token changes: his sessions end, the old token is refused,
    // the new one logs in.
    const BOB2: &str = "bob-token-two-0123456789abcdef";
    std::fs::write(
        &cfg,
        format!(
            "tls = false\n[exports]\na = {{ path = \"{data}\", read_only = true }}\n{}",
            users(&[("bob", BOB2)])
        ),
    )
    .unwrap();
    s.signal(libc::SIGHUP);
    s.reloaded();
    s.wait_stderr("SIGHUP: user changed: bob (");
    let e = bob_side.list_dir("a", "").unwrap_err();
    assert_eq!(
        e.to_string(),
        "session ended: user bob has a new password or token (server reload)"
    );
    let e = Side::connect(&side, &login("bob", BOB)).unwrap_err();
    assert_eq!(
        e.to_string(),
        "authentication failed: wrong user name or token"
    );
    let mut bob2 = Side::connect(&side, &login("bob", BOB2)).unwrap();
    assert_eq!(bob2.list_dir("a", "").unwrap().len(), 1);
    assert!(s.child.try_wait().unwrap().is_none());
}
