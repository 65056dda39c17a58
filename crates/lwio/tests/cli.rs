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
        .env_remove("RUST_LOG");
    c
}

struct Served {
    child: Child,
    addr: String,
    token: PathBuf,
    dir: tempfile::TempDir,
}

impl Served {
    fn url(&self, rest: &str) -> String {
        format!("lwio://{}/{rest}", self.addr)
    }
    fn client(&self, args: &[&str]) -> assert_cmd::assert::Assert {
        let mut c = lwio();
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
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    std::fs::create_dir_all(data.join("sub")).unwrap();
    std::fs::write(data.join("hello.txt"), b"hello").unwrap();
    std::fs::create_dir_all(dir.path().join("outside")).unwrap();
    std::os::unix::fs::symlink(dir.path().join("outside"), data.join("escape")).unwrap();
    let token = dir.path().join("token");
    let ready = dir.path().join("ready");
    let child = Command::cargo_bin("lwio")
        .unwrap()
        .args(["serve", "--listen", "127.0.0.1:0", "--export"])
        .arg(format!("data={}", data.display()))
        .arg("--token-file")
        .arg(&token)
        .arg("--ready-file")
        .arg(&ready)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let addr = wait_for(&ready);
    Served {
        child,
        addr,
        token,
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
    // Data path commands say so.
    for args in [
        vec!["cat".to_string(), s.url("data/hello.txt")],
        vec!["cp".to_string(), "a".to_string(), s.url("data/b")],
        vec!["bench".to_string()],
    ] {
        lwio()
            .args(&args)
            .assert()
            .failure()
            .stderr(one_line_error().and(predicate::str::contains("requires the LWIO data path")));
    }
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
        .stderr(one_line_error().and(predicate::str::contains("not available in this build")));
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
