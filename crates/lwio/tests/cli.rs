//! Drive the `lwio` binary as a user would.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use assert_cmd::cargo::CommandCargoExt;
use predicates::prelude::*;

fn lwio() -> assert_cmd::Command {
    let mut c = assert_cmd::Command::cargo_bin("lwio").unwrap();
    // Never pick up the developer's own token or config.
    c.env_remove("LWIO_TOKEN")
        .env("LWIO_TOKEN_FILE", "/nonexistent/lwio-test-token")
        .env_remove("LWIO_FINGERPRINT")
        .env_remove("LWIO_PASSWORD")
        .env_remove("LWIO_STRICT_HOST_KEY_CHECKING")
        .env("LWIO_KNOWN_HOSTS", fresh_known_hosts())
        .env_remove("RUST_LOG");
    c
}

/// A known_hosts path of its own for each command (never the developer's
/// ~/.config): every command is a first use unless a test says otherwise.
fn fresh_known_hosts() -> std::path::PathBuf {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static DIR: std::sync::OnceLock<tempfile::TempDir> = std::sync::OnceLock::new();
    static N: AtomicUsize = AtomicUsize::new(0);
    let d = DIR.get_or_init(|| tempfile::tempdir().unwrap());
    d.path()
        .join(format!("known_hosts.{}", N.fetch_add(1, Ordering::Relaxed)))
}

struct Served {
    child: Child,
    addr: String,
    token: PathBuf,
    /// `sha256:…` printed at start (empty with --no-tls).
    fingerprint: String,
    stdout: String,
    dir: tempfile::TempDir,
}

impl Served {
    fn url(&self, rest: &str) -> String {
        format!("lwio://{}/{rest}", self.addr)
    }
    /// `lwio` trusting this server's certificate (LWIO_FINGERPRINT).
    fn cmd(&self) -> assert_cmd::Command {
        let mut c = lwio();
        if !self.fingerprint.is_empty() {
            c.env("LWIO_FINGERPRINT", &self.fingerprint);
        }
        c
    }
    fn client(&self, args: &[&str]) -> assert_cmd::assert::Assert {
        let mut c = self.cmd();
        c.args(args).arg("--token-file").arg(&self.token);
        c.assert()
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn serve() -> Served {
    serve_with(&[], None)
}

/// `lwio serve` with extra arguments and an optional config file text
/// (`@DATA@` in it is replaced by the data directory).
fn serve_with(extra: &[&str], config: Option<&str>) -> Served {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    std::fs::create_dir_all(data.join("sub")).unwrap();
    std::fs::write(data.join("hello.txt"), b"hello").unwrap();
    std::fs::create_dir_all(dir.path().join("outside")).unwrap();
    std::os::unix::fs::symlink(dir.path().join("outside"), data.join("escape")).unwrap();
    let token = dir.path().join("token");
    let ready = dir.path().join("ready");
    let out = dir.path().join("stdout");
    let mut cmd = Command::cargo_bin("lwio").unwrap();
    cmd.args(["serve", "--listen", "127.0.0.1:0"]);
    match config {
        Some(text) => {
            let cfg = dir.path().join("lwio.toml");
            std::fs::write(&cfg, text.replace("@DATA@", &data.display().to_string())).unwrap();
            cmd.arg("--config").arg(cfg);
        }
        None => {
            cmd.arg("--export").arg(format!("data={}", data.display()));
        }
    }
    let child = cmd
        .args(extra)
        .arg("--token-file")
        .arg(&token)
        .arg("--ready-file")
        .arg(&ready)
        .env("RUST_LOG", "warn")
        .stdout(std::fs::File::create(&out).unwrap())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let addr = wait_for(&ready);
    let stdout = std::fs::read_to_string(&out).unwrap();
    let fingerprint = stdout
        .lines()
        .find_map(|l| l.strip_prefix("lwio: TLS fingerprint "))
        .unwrap_or("")
        .to_string();
    Served {
        child,
        addr,
        token,
        fingerprint,
        stdout,
        dir,
    }
}

fn wait_for(ready: &Path) -> String {
    let t0 = Instant::now();
    loop {
        if let Ok(s) = std::fs::read_to_string(ready) {
            if s.ends_with('\n') {
                return s.trim().to_string();
            }
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "server did not become ready"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// stderr is exactly one line starting with "lwio: error: ".
fn one_line_error() -> impl Predicate<str> {
    predicate::str::starts_with("lwio: error: ")
        .and(predicate::function(|s: &str| {
            s.trim_end().lines().count() == 1
        }))
        .and(predicate::str::contains("panicked").not())
}

#[test]
fn help_and_version() {
    lwio()
        .arg("--version")
        .assert()
        .success()
        .stdout(predicate::str::starts_with("lwio "));
    lwio()
        .arg("--help")
        .assert()
        .success()
        .stdout(predicate::str::contains("Examples:"));
    for cmd in [
        "serve",
        "ls",
        "stat",
        "rm",
        "mkdir",
        "cat",
        "cp",
        "bench",
        "devices",
        "rdma-bench",
        "hash-password",
    ] {
        lwio()
            .args([cmd, "--help"])
            .assert()
            .success()
            .stdout(predicate::str::contains("Examples:").and(predicate::str::contains("Usage:")));
    }
    lwio().assert().failure();
    lwio()
        .args(["ls", "not-a-url"])
        .assert()
        .code(2)
        .stderr(one_line_error().and(predicate::str::contains("invalid URL")));
    lwio()
        .args(["bench", "--bs", "4x"])
        .assert()
        .code(2)
        .stderr(one_line_error().and(predicate::str::contains("unknown unit")));
}

#[test]
fn serve_and_manage_files() {
    let s = serve();
    assert!(s.token.exists(), "token file created");
    {
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(
            std::fs::metadata(&s.token).unwrap().permissions().mode() & 0o777,
            0o600
        );
    }
    s.client(&["ls", &s.url("")]).success().stdout("data/\n");
    s.client(&["ls", &s.url("data")])
        .success()
        .stdout(predicate::str::contains("hello.txt\n").and(predicate::str::contains("sub/\n")));
    s.client(&["ls", "-l", &s.url("data/hello.txt")])
        .success()
        .stdout(predicate::str::starts_with("-rw").and(predicate::str::contains(" 5 ")));
    s.client(&["stat", &s.url("data/hello.txt")])
        .success()
        .stdout(predicate::str::contains("Type: file").and(predicate::str::contains("Size: 5")));
    s.client(&["mkdir", &s.url("data/new%20dir")]).success();
    assert!(s.dir.path().join("data/new dir").is_dir());
    s.client(&["mkdir", "-p", &s.url("data/a/b/c")]).success();
    assert!(s.dir.path().join("data/a/b/c").is_dir());
    s.client(&["mkdir", &s.url("data/new%20dir")])
        .failure()
        .stderr(one_line_error().and(predicate::str::contains("File exists")));
    s.client(&["rm", &s.url("data/new%20dir")]).success();
    s.client(&["rm", &s.url("data/hello.txt")]).success();
    assert!(!s.dir.path().join("data/hello.txt").exists());
    s.client(&["rm", &s.url("data/a")])
        .failure()
        .stderr(one_line_error().and(predicate::str::contains("not empty")));
}

#[test]
fn errors_a_person_can_act_on() {
    let s = serve();
    let lwio = || s.cmd();
    // Missing file.
    s.client(&["stat", &s.url("data/nope")])
        .failure()
        .stderr(one_line_error().and(predicate::str::contains(
            "data/nope: No such file or directory",
        )));
    // Missing export.
    s.client(&["ls", &s.url("nope/x")])
        .failure()
        .stderr(one_line_error().and(predicate::str::contains("no export named \"nope\"")));
    // No export in the URL.
    s.client(&["stat", &s.url("")])
        .failure()
        .stderr(one_line_error().and(predicate::str::contains("missing export")));
    // Outside the export: '..' in the URL and a symlink that leaves.
    s.client(&["stat", &s.url("data/../etc")])
        .failure()
        .stderr(one_line_error().and(predicate::str::contains("cannot leave their export")));
    s.client(&["ls", &s.url("data/escape")])
        .failure()
        .stderr(one_line_error().and(predicate::str::contains("outside the export")));
    // Wrong token.
    let bad = s.dir.path().join("bad-token");
    std::fs::write(&bad, "ffffffffffffffffffffffffffffffff\n").unwrap();
    lwio()
        .args(["ls", &s.url("data"), "--token-file"])
        .arg(&bad)
        .assert()
        .failure()
        .stderr(one_line_error().and(predicate::str::contains(
            "authentication failed: wrong token",
        )));
    lwio()
        .args(["ls", &s.url("data")])
        .env("LWIO_TOKEN", "ffffffffffffffffffffffffffffffff")
        .assert()
        .failure()
        .stderr(one_line_error().and(predicate::str::contains("wrong token")));
    // No token at all.
    lwio()
        .args(["ls", &s.url("data")])
        .assert()
        .failure()
        .stderr(one_line_error().and(predicate::str::contains("requires a token")));
    // LWIO_TOKEN with the right token works.
    let token = std::fs::read_to_string(&s.token).unwrap();
    lwio()
        .args(["ls", &s.url("data")])
        .env("LWIO_TOKEN", token.trim())
        .assert()
        .success();
    // The data-path commands (cat, cp, bench) are tested in cli_data.rs.
    lwio()
        .args([
            "rdma-bench",
            "--op",
            "write",
            "--size",
            "4k",
            "--connect",
            "127.0.0.1:1",
        ])
        .assert()
        .failure()
        .stderr(one_line_error().and(predicate::str::contains("unreachable")));
}

#[test]
fn unreachable_host() {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    drop(l);
    lwio()
        .args(["ls", &format!("lwio://{addr}/data")])
        .env("LWIO_TOKEN", "0123456789abcdef0123456789abcdef")
        .assert()
        .failure()
        .stderr(one_line_error().and(predicate::str::contains("cannot connect")));
    // A non-routable address times out.
    lwio()
        .args(["ls", "lwio://192.0.2.1/data", "--connect-timeout", "300ms"])
        .env("LWIO_TOKEN", "0123456789abcdef0123456789abcdef")
        .timeout(Duration::from_secs(20))
        .assert()
        .failure()
        .stderr(one_line_error().and(predicate::str::contains("cannot connect")));
}

#[test]
fn serve_errors() {
    lwio()
        .args(["serve", "--listen", "127.0.0.1:0"])
        .assert()
        .failure()
        .stderr(predicate::str::contains("nothing to serve"));
    let d = tempfile::tempdir().unwrap();
    lwio()
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--export",
            "x=/nonexistent/lwio",
            "--token-file",
        ])
        .arg(d.path().join("t"))
        .env("RUST_LOG", "off")
        .assert()
        .failure()
        .stderr(one_line_error().and(predicate::str::contains("/nonexistent/lwio")));
    let cfg = d.path().join("bad.toml");
    std::fs::write(&cfg, "listn = 1\n").unwrap();
    lwio()
        .args(["serve", "--config"])
        .arg(&cfg)
        .assert()
        .failure()
        .stderr(predicate::str::contains("unknown field"));
    // A misspelt key inside an export's table (readonly for read_only)
    // is refused too: the server does not start, and says which key.
    let data = d.path().join("data");
    std::fs::create_dir(&data).unwrap();
    std::fs::write(
        &cfg,
        format!(
            "listen = \"127.0.0.1:0\"\n[exports]\ndata = {{ path = \"{}\", readonly = true }}\n",
            data.display()
        ),
    )
    .unwrap();
    lwio()
        .args(["serve", "--config"])
        .arg(&cfg)
        .arg("--token-file")
        .arg(d.path().join("t"))
        .timeout(std::time::Duration::from_secs(20))
        .assert()
        .failure()
        .stderr(
            one_line_error()
                .and(predicate::str::contains("unknown field `readonly`"))
                .and(predicate::str::contains("read_only")),
        );
}

#[test]
fn graceful_sigterm() {
    let mut s = serve();
    s.client(&["ls", &s.url("data")]).success();
    // SAFETY: sending a signal to the child we spawned.
    let r = unsafe { libc::kill(s.child.id() as i32, libc::SIGTERM) };
    assert_eq!(r, 0);
    let t0 = Instant::now();
    loop {
        if let Some(st) = s.child.try_wait().unwrap() {
            assert!(st.success(), "clean exit on SIGTERM: {st:?}");
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(15),
            "server did not stop on SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn devices_lists_or_explains() {
    let out = lwio().arg("devices").output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        assert!(
            stderr.starts_with("lwio: error: ") && stderr.contains("RDMA provider"),
            "{stderr}"
        );
        assert_eq!(stderr.trim_end().lines().count(), 1, "{stderr}");
    }
}

/// `sha256:` and 32 colon-separated upper-case hex pairs.
fn is_fingerprint(s: &str) -> bool {
    s.strip_prefix("sha256:").is_some_and(|h| {
        h.split(':').count() == 32
            && h.split(':').all(|p| {
                p.len() == 2
                    && p.chars()
                        .all(|c| c.is_ascii_hexdigit() && !c.is_lowercase())
            })
    })
}

#[test]
fn tls_by_default_with_a_pinned_self_signed_certificate() {
    use std::os::unix::fs::PermissionsExt;
    let s = serve();
    assert!(is_fingerprint(&s.fingerprint), "{:?}", s.stdout);
    assert!(
        s.stdout.starts_with("lwio: TLS fingerprint sha256:"),
        "{:?}",
        s.stdout
    );
    // The self-signed identity lives beside the token file; key mode 0600.
    let key = s.dir.path().join("tls-key.pem");
    assert_eq!(
        std::fs::metadata(&key).unwrap().permissions().mode() & 0o777,
        0o600
    );
    assert!(s.dir.path().join("tls-cert.pem").exists());
    // Pinned by flag (LWIO_FINGERPRINT in s.client) and by --fingerprint.
    s.client(&["ls", &s.url("data")]).success();
    lwio()
        .args(["ls", &s.url("data"), "--fingerprint", &s.fingerprint])
        .arg("--token-file")
        .arg(&s.token)
        .assert()
        .success()
        .stdout(predicate::str::contains("hello.txt"));
    // Lower case without colons is accepted too.
    let compact = s.fingerprint[7..].replace(':', "").to_lowercase();
    lwio()
        .args(["ls", &s.url("data"), "--fingerprint", &compact])
        .arg("--token-file")
        .arg(&s.token)
        .assert()
        .success();
    // A wrong pin: one clear line.
    let wrong = format!("sha256:{}", ["AB"; 32].join(":"));
    lwio()
        .args(["ls", &s.url("data"), "--fingerprint", &wrong])
        .arg("--token-file")
        .arg(&s.token)
        .assert()
        .failure()
        .stderr(one_line_error().and(predicate::str::contains(format!(
            "TLS: the server's certificate fingerprint {} does not match the pinned {wrong}; refusing to connect",
            s.fingerprint
        ))));
    // No pin, no CA, strict host key checking: the system roots do not
    // know a self-signed certificate, and known_hosts does not either.
    let kh_dir = tempfile::tempdir().unwrap();
    let kh = kh_dir.path().join("known_hosts");
    let ls = |extra: &[&str]| {
        let mut c = lwio();
        c.args(["ls", &s.url("data")])
            .args(extra)
            .arg("--known-hosts")
            .arg(&kh)
            .arg("--token-file")
            .arg(&s.token);
        c.assert()
    };
    ls(&["--strict-host-key-checking"])
        .failure()
        .stderr(one_line_error().and(predicate::str::contains(format!(
            "is not in {} and strict host key checking is on; its certificate fingerprint is {}",
            kh.display(),
            s.fingerprint
        ))));
    assert!(!kh.exists(), "strict mode wrote known_hosts");
    // Trust on first use: recorded once, announced once.
    let addr = s
        .url("")
        .trim_start_matches("lwio://")
        .trim_end_matches('/')
        .to_string();
    let first = ls(&[])
        .success()
        .stdout(predicate::str::contains("hello.txt"));
    assert_eq!(
        String::from_utf8_lossy(&first.get_output().stderr).trim_end(),
        format!(
            "lwio: trusting {addr} on first use: {} (recorded in {})",
            s.fingerprint,
            kh.display()
        )
    );
    let recorded = std::fs::read_to_string(&kh).unwrap();
    assert_eq!(recorded, format!("{addr} {}\n", s.fingerprint));
    // Known now: silent, and the file is unchanged.
    ls(&["--strict-host-key-checking"])
        .success()
        .stderr(predicate::str::is_empty());
    assert_eq!(std::fs::read_to_string(&kh).unwrap(), recorded);
    // A changed certificate (the record says otherwise) is refused, naming
    // both fingerprints and the line to delete; nothing is written.
    let other = format!("sha256:{}", ["AB"; 32].join(":"));
    let changed = format!("# servers\n{addr} {other}\n");
    std::fs::write(&kh, &changed).unwrap();
    ls(&[])
        .failure()
        .stderr(one_line_error().and(predicate::str::contains(format!(
        "TLS: the certificate of {addr} HAS CHANGED: it is now {}, but {} line 2 records {other}",
        s.fingerprint,
        kh.display()
    ))));
    assert_eq!(std::fs::read_to_string(&kh).unwrap(), changed);
    // A malformed line is one error naming the file and line.
    std::fs::write(&kh, "garbage\n").unwrap();
    ls(&[])
        .failure()
        .stderr(one_line_error().and(predicate::str::contains(format!(
            "{}:1: malformed known_hosts line",
            kh.display()
        ))));
    // --insecure works, with a warning.
    lwio()
        .args(["ls", &s.url("data"), "--insecure"])
        .arg("--token-file")
        .arg(&s.token)
        .assert()
        .success()
        .stderr(predicate::str::contains("warning: --insecure"));
    // A plain client gets a clear answer, not a hang.
    lwio()
        .args(["ls", &s.url("data"), "--no-tls"])
        .arg("--token-file")
        .arg(&s.token)
        .timeout(Duration::from_secs(10))
        .assert()
        .failure()
        .stderr(one_line_error().and(predicate::str::contains("this server requires TLS")));
    // Malformed pins and contradictory flags are usage errors.
    lwio()
        .args(["ls", &s.url("data"), "--fingerprint", "sha256:12"])
        .assert()
        .failure()
        .stderr(one_line_error().and(predicate::str::contains("invalid fingerprint")));
    lwio()
        .args(["ls", &s.url("data"), "--fingerprint", &wrong, "--insecure"])
        .assert()
        .code(2);
    lwio()
        .args(["ls", &s.url("data"), "--no-tls", "--ca", "x.pem"])
        .assert()
        .code(2);
}

#[test]
fn plain_tcp_only_when_configured_on_both_sides() {
    let s = serve_with(&["--no-tls"], None);
    assert_eq!(s.fingerprint, "", "no fingerprint without TLS");
    let mut c = lwio();
    c.args(["ls", &s.url("data"), "--no-tls", "--token-file"])
        .arg(&s.token)
        .assert()
        .success();
    // A TLS client: a clear error, not a hang.
    lwio()
        .args(["ls", &s.url("data"), "--insecure", "--token-file"])
        .arg(&s.token)
        .timeout(Duration::from_secs(10))
        .assert()
        .failure()
        .stderr(
            predicate::str::contains("did not speak TLS").and(predicate::str::contains(
                "this server does not use TLS (tls = false)",
            )),
        );
    lwio()
        .args(["serve", "--no-tls", "--tls-cert", "a", "--tls-key", "b"])
        .assert()
        .code(2);
    lwio()
        .args(["serve", "--tls-cert", "a", "--export", "d=/tmp"])
        .assert()
        .code(2);
}

#[test]
fn tls_with_given_certificate_and_ca() {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair};
    let ca_key = KeyPair::generate().unwrap();
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(DnType::CommonName, "lwio test CA");
    let ca = ca_params.self_signed(&ca_key).unwrap();
    let leaf_key = KeyPair::generate().unwrap();
    let leaf = CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()])
        .unwrap()
        .signed_by(&leaf_key, &ca, &ca_key)
        .unwrap();
    let d = tempfile::tempdir().unwrap();
    let (cert, key, ca_file) = (
        d.path().join("cert.pem"),
        d.path().join("key.pem"),
        d.path().join("ca.pem"),
    );
    std::fs::write(&cert, leaf.pem()).unwrap();
    std::fs::write(&key, leaf_key.serialize_pem()).unwrap();
    std::fs::write(&ca_file, ca.pem()).unwrap();
    let s = serve_with(
        &[
            "--tls-cert",
            cert.to_str().unwrap(),
            "--tls-key",
            key.to_str().unwrap(),
        ],
        None,
    );
    assert!(is_fingerprint(&s.fingerprint));
    assert!(
        !s.dir.path().join("tls-cert.pem").exists(),
        "no self-signed certificate when one is given"
    );
    lwio()
        .args(["ls", &s.url("data"), "--ca"])
        .arg(&ca_file)
        .arg("--token-file")
        .arg(&s.token)
        .assert()
        .success()
        .stdout(predicate::str::contains("hello.txt"));
    // The wrong CA (its own self-signed certificate as a CA) is refused.
    lwio()
        .args(["ls", &s.url("data"), "--ca"])
        .arg(&cert)
        .arg("--token-file")
        .arg(&s.token)
        .assert()
        .failure()
        .stderr(one_line_error().and(predicate::str::contains("TLS: cannot verify")));
}

#[test]
fn hash_password_users_and_rights() {
    // hash-password from stdin.
    let out = lwio()
        .arg("hash-password")
        .write_stdin("alice-pw\n")
        .assert()
        .success()
        .get_output()
        .stdout
        .clone();
    let alice_hash = String::from_utf8(out).unwrap().trim().to_string();
    assert!(alice_hash.starts_with("$argon2id$v=19$"), "{alice_hash}");
    let out = lwio()
        .arg("hash-password")
        .write_stdin("bob-pw")
        .output()
        .unwrap();
    let bob_hash = String::from_utf8(out.stdout).unwrap().trim().to_string();
    assert_ne!(alice_hash, bob_hash);
    // A fresh per-user token and its verifier.
    let out = lwio()
        .args(["hash-password", "--new-token"])
        .output()
        .unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    let carol_token = text
        .lines()
        .find_map(|l| l.strip_prefix("token: "))
        .unwrap()
        .to_string();
    let carol_verifier = text
        .lines()
        .find_map(|l| l.strip_prefix("verifier: "))
        .unwrap()
        .to_string();
    assert!(carol_verifier.starts_with("lwio-token1$"));
    // --token computes the same verifier.
    lwio()
        .args(["hash-password", "--token"])
        .write_stdin(format!("{carol_token}\n"))
        .assert()
        .success()
        .stdout(format!("{carol_verifier}\n"));
    let config = format!(
        r#"
[exports]
data = {{ path = "@DATA@", readers = ["*"], writers = ["alice"] }}

[users.alice]
password = "{alice_hash}"

[users.bob]
password = "{bob_hash}"

[users.carol]
token = "{carol_verifier}"
"#
    );
    let s = serve_with(&[], Some(&config));
    let user = |name: &str, args: &[String]| {
        let mut c = s.cmd();
        c.args(args).arg("--user").arg(name);
        c
    };
    // Passwords over TLS: right, wrong.
    user("alice", &["mkdir".to_string(), s.url("data/by-alice")])
        .env("LWIO_PASSWORD", "alice-pw")
        .assert()
        .success();
    assert!(s.dir.path().join("data/by-alice").is_dir());
    user("alice", &["ls".to_string(), s.url("data")])
        .env("LWIO_PASSWORD", "bob-pw")
        .assert()
        .failure()
        .stderr(one_line_error().and(predicate::str::contains(
            "authentication failed: wrong user name or password",
        )));
    // bob reads but may not write.
    let pwfile = s.dir.path().join("bob.pw");
    std::fs::write(&pwfile, "bob-pw\n").unwrap();
    user("bob", &["ls".to_string(), s.url("data")])
        .arg("--password-file")
        .arg(&pwfile)
        .assert()
        .success()
        .stdout(predicate::str::contains("by-alice/"));
    for args in [
        vec!["mkdir".to_string(), s.url("data/by-bob")],
        vec!["rm".to_string(), s.url("data/hello.txt")],
    ] {
        user("bob", &args)
            .arg("--password-file")
            .arg(&pwfile)
            .assert()
            .failure()
            .stderr(one_line_error().and(predicate::str::contains(
                "user bob may not write to export data",
            )));
    }
    assert!(s.dir.path().join("data/hello.txt").exists());
    // carol logs in with her token (challenge-response).
    user("carol", &["ls".to_string(), s.url("")])
        .env("LWIO_TOKEN", &carol_token)
        .assert()
        .success()
        .stdout("data/ (read-only)\n");
    user("carol", &["ls".to_string(), s.url("")])
        .env("LWIO_TOKEN", "ffffffffffffffffffffffffffffffff")
        .assert()
        .failure()
        .stderr(one_line_error().and(predicate::str::contains("wrong user name or token")));
    // No password and no terminal: a clear error.
    user("alice", &["ls".to_string(), s.url("data")])
        .assert()
        .failure()
        .stderr(one_line_error().and(predicate::str::contains("no password for alice")));
}

#[test]
fn config_errors_for_users_and_rights() {
    let d = tempfile::tempdir().unwrap();
    for (text, want) in [
        (
            "[exports]\nd = { path = \"/tmp\", writers = [\"zed\"] }\n",
            "unknown user \"zed\"",
        ),
        ("[users.a]\npassword = \"plain\"\n", "users.a.password"),
        ("[users.a]\n", "give `password`"),
        ("[users.anonymous]\ntoken = \"x\"\n", "reserved"),
        ("tls_cert = \"/x\"\n", "tls_cert and tls_key go together"),
        (
            "[limits]\nmax_connections_per_host = 0\n",
            "max_connections_per_host",
        ),
    ] {
        let cfg = d.path().join("c.toml");
        std::fs::write(&cfg, text).unwrap();
        lwio()
            .args(["serve", "--config"])
            .arg(&cfg)
            .assert()
            .failure()
            .stderr(one_line_error().and(predicate::str::contains(want)));
    }
}

/// Issue 31, item 11: with `--anonymous`, anonymous sessions may read the
/// exports without lists but not write them; an export that names
/// "anonymous" in `writers` is writable.
#[test]
fn anonymous_is_read_only_unless_listed() {
    let s = serve_with(
        &[
            "--anonymous",
            "--provider",
            "soft",
            "--rdma-listen",
            "127.0.0.1:0",
        ],
        Some(
            "[exports]\ndata = \"@DATA@\"\nopen = { path = \"@DATA@/sub\", writers = [\"anonymous\"] }\n",
        ),
    );
    let local = s.dir.path().join("local.txt");
    std::fs::write(&local, b"anonymous bytes").unwrap();
    // No token: an anonymous login.
    let anon = |args: &[&str]| s.cmd().args(args).assert();
    anon(&["ls", &s.url("data")])
        .success()
        .stdout(predicate::str::contains("hello.txt"));
    anon(&["cp", local.to_str().unwrap(), &s.url("data/new.txt")])
        .failure()
        .stderr(one_line_error().and(predicate::str::contains(
            "anonymous sessions may not write to export data",
        )));
    anon(&["mkdir", &s.url("data/d")]).failure();
    anon(&["rm", &s.url("data/hello.txt")]).failure();
    assert!(!s.dir.path().join("data/new.txt").exists());
    assert!(!s.dir.path().join("data/d").exists());
    assert!(s.dir.path().join("data/hello.txt").exists());
    // Listed explicitly: writable.
    anon(&["cp", local.to_str().unwrap(), &s.url("open/new.txt")]).success();
    assert_eq!(
        std::fs::read(s.dir.path().join("data/sub/new.txt")).unwrap(),
        b"anonymous bytes"
    );
    // The shared token still writes everywhere.
    s.client(&["cp", local.to_str().unwrap(), &s.url("data/new.txt")])
        .success();
}

/// Issue 31: `--metrics PORT` (no host) listens on localhost only.
#[test]
fn metrics_port_alone_listens_on_localhost() {
    let s = serve_with(&["--metrics", "0"], None);
    assert!(
        s.stdout.contains("lwio: metrics on http://127.0.0.1:"),
        "{}",
        s.stdout
    );
}
