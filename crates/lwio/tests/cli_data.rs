//! Drive the data-path commands of the `lwio` binary (`cat`, `cp`, `bench`,
//! `serve`'s RDMA phase) as a user would.

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

/// stderr is exactly one line starting with "lwio: error: ".
fn one_line_error() -> impl Predicate<str> {
    predicate::str::starts_with("lwio: error: ")
        .and(predicate::function(|s: &str| {
            s.trim_end().lines().count() == 1
        }))
        .and(predicate::str::contains("panicked").not())
}

struct Served {
    child: Child,
    addr: String,
    /// The server's TLS certificate fingerprint (printed at start).
    fingerprint: String,
    token: PathBuf,
    data: PathBuf,
    /// Where `--metrics` serves.
    metrics: String,
    /// Keeps the temporary directory alive.
    _dir: tempfile::TempDir,
}

impl Served {
    fn url(&self, rest: &str) -> String {
        format!("lwio://{}/{rest}", self.addr)
    }
    /// `lwio ARGS` logged in to this server (token, TLS pinned).
    fn cmd(&self, args: &[&str]) -> assert_cmd::Command {
        let mut c = lwio();
        c.args(args)
            .arg("--token-file")
            .arg(&self.token)
            .env("LWIO_FINGERPRINT", &self.fingerprint);
        c
    }
    /// The same as a spawnable process (stderr piped).
    fn spawn(&self, args: &[&str]) -> Child {
        Command::cargo_bin("lwio")
            .unwrap()
            .args(args)
            .arg("--token-file")
            .arg(&self.token)
            .env("LWIO_FINGERPRINT", &self.fingerprint)
            .env_remove("LWIO_TOKEN")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    }
    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        self.kill();
    }
}

/// `lwio serve` on ephemeral ports (side channel and RDMA), exporting
/// `data` (plus a read-only export `ro`), optionally through a wrapper
/// command (e.g. `unshare`).
fn serve_with(wrap: &[&str], setup: &str) -> Option<Served> {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let ro = dir.path().join("ro");
    std::fs::create_dir_all(&data).unwrap();
    std::fs::create_dir_all(&ro).unwrap();
    std::fs::write(ro.join("r.txt"), b"read only").unwrap();
    std::fs::create_dir_all(dir.path().join("outside")).unwrap();
    std::fs::write(dir.path().join("outside/secret"), b"secret").unwrap();
    std::os::unix::fs::symlink(dir.path().join("outside"), data.join("escape")).unwrap();
    let token = dir.path().join("token");
    let ready = dir.path().join("ready");
    let stdout = dir.path().join("stdout");
    let cfg = dir.path().join("lwio.toml");
    std::fs::write(
        &cfg,
        format!(
            "[exports]\nro = {{ path = \"{}\", read_only = true }}\n",
            ro.display()
        ),
    )
    .unwrap();
    let bin = assert_cmd::cargo::cargo_bin("lwio");
    let mut serve: Vec<String> = vec![
        bin.display().to_string(),
        "serve".into(),
        "--listen".into(),
        "127.0.0.1:0".into(),
        "--rdma-listen".into(),
        "127.0.0.1:0".into(),
        "--provider".into(),
        "soft".into(),
        "--config".into(),
        cfg.display().to_string(),
        "--export".into(),
        format!("data={}", data.display()),
        "--token-file".into(),
        token.display().to_string(),
        "--ready-file".into(),
        ready.display().to_string(),
        "--metrics".into(),
        "127.0.0.1:0".into(),
    ];
    let mut cmd = if wrap.is_empty() {
        let mut c = Command::new(&serve[0]);
        c.args(&serve[1..]);
        c
    } else {
        // wrapper ... sh -c 'SETUP && exec "$@"' sh lwio serve ...
        let mut c = Command::new(wrap[0]);
        c.args(&wrap[1..])
            .args(["sh", "-c"])
            .arg(format!("{setup} && exec \"$@\""))
            .arg("sh")
            .args(serve.drain(..));
        c
    };
    let mut child = cmd
        .env("RUST_LOG", "warn")
        .env("LWIO_DATA", &data)
        .stdout(std::fs::File::create(&stdout).unwrap())
        .stderr(Stdio::null())
        .spawn()
        // Only a wrapper (e.g. `unshare`) can be missing.
        .ok()?;
    let t0 = Instant::now();
    let addr = loop {
        if let Ok(s) = std::fs::read_to_string(&ready) {
            if s.ends_with('\n') {
                break s.trim().to_string();
            }
        }
        if let Ok(Some(_)) = child.try_wait() {
            return None;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "server did not become ready"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    let out = std::fs::read_to_string(&stdout).unwrap();
    assert!(
        out.contains("lwio: RDMA listening on 127.0.0.1:"),
        "RDMA endpoint logged: {out}"
    );
    let fingerprint = out
        .lines()
        .find_map(|l| l.strip_prefix("lwio: TLS fingerprint "))
        .expect("TLS fingerprint printed")
        .to_string();
    let metrics = out
        .lines()
        .find_map(|l| l.strip_prefix("lwio: metrics on http://"))
        .and_then(|l| l.strip_suffix("/metrics"))
        .expect("metrics address printed")
        .to_string();
    Some(Served {
        child,
        addr,
        fingerprint,
        token,
        data,
        metrics,
        _dir: dir,
    })
}

fn serve() -> Served {
    serve_with(&[], "").expect("lwio serve starts")
}

fn write_pattern(path: &Path, len: usize, seed: u8) -> Vec<u8> {
    let v: Vec<u8> = (0..len)
        .map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[3] ^ seed)
        .collect();
    std::fs::write(path, &v).unwrap();
    v
}

/// Files under `root` (relative path → contents), directories as `None`.
fn tree(root: &Path) -> Vec<(String, Option<Vec<u8>>)> {
    fn walk(root: &Path, dir: &Path, out: &mut Vec<(String, Option<Vec<u8>>)>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let e = e.unwrap();
            let p = e.path();
            let rel = p.strip_prefix(root).unwrap().display().to_string();
            let ft = e.file_type().unwrap();
            if ft.is_symlink() {
                continue;
            }
            if ft.is_dir() {
                out.push((rel, None));
                walk(root, &p, out);
            } else {
                out.push((rel, Some(std::fs::read(&p).unwrap())));
            }
        }
    }
    let mut out = Vec::new();
    walk(root, root, &mut out);
    out.sort();
    out
}

/// No temporary `.NAME.lwio-part-*` file anywhere under `root`.
fn no_part_files(root: &Path) -> bool {
    tree(root).iter().all(|(p, _)| !p.contains(".lwio-part-"))
}

#[test]
fn cp_and_cat_move_data_byte_for_byte() {
    let s = serve();
    let local = tempfile::tempdir().unwrap();
    // local → remote, remote → local, remote → remote.
    let src = local.path().join("big.bin");
    let data = write_pattern(&src, (1 << 20) + 3, 1);
    s.cmd(&["cp", src.to_str().unwrap(), &s.url("data/big.bin")])
        .assert()
        .success();
    assert_eq!(std::fs::read(s.data.join("big.bin")).unwrap(), data);
    let back = local.path().join("back.bin");
    s.cmd(&["cp", &s.url("data/big.bin"), back.to_str().unwrap()])
        .assert()
        .success();
    assert_eq!(std::fs::read(&back).unwrap(), data);
    // Remote → remote on one server: the server copies, no data through us.
    s.cmd(&["cp", &s.url("data/big.bin"), &s.url("data/copy.bin")])
        .env("RUST_LOG", "lwio::cmd::cp=info")
        .assert()
        .success()
        .stderr(predicate::str::contains(format!(
            "copied on the server: no data through this client bytes={}",
            data.len()
        )));
    assert_eq!(std::fs::read(s.data.join("copy.bin")).unwrap(), data);
    // Into an existing directory: keeps the name.
    std::fs::create_dir(s.data.join("into")).unwrap();
    s.cmd(&["cp", src.to_str().unwrap(), &s.url("data/into")])
        .assert()
        .success();
    assert_eq!(std::fs::read(s.data.join("into/big.bin")).unwrap(), data);
    // Overwrites an existing destination.
    write_pattern(&s.data.join("copy.bin"), 10, 9);
    s.cmd(&["cp", src.to_str().unwrap(), &s.url("data/copy.bin")])
        .assert()
        .success();
    assert_eq!(std::fs::read(s.data.join("copy.bin")).unwrap(), data);
    // cat equals the file.
    s.cmd(&["cat", &s.url("data/big.bin")])
        .assert()
        .success()
        .stdout(predicate::function(|out: &[u8]| out == data.as_slice()));
    std::fs::write(s.data.join("empty"), b"").unwrap();
    s.cmd(&["cat", &s.url("data/empty")])
        .assert()
        .success()
        .stdout(predicate::function(|out: &[u8]| out.is_empty()));

    // cp -r a tree with odd sizes, there and back.
    let t = local.path().join("tree");
    std::fs::create_dir_all(t.join("sub/deeper")).unwrap();
    std::fs::create_dir_all(t.join("emptydir")).unwrap();
    write_pattern(&t.join("zero"), 0, 2);
    write_pattern(&t.join("one"), 1, 3);
    write_pattern(&t.join("sub/page-1"), 4095, 4);
    write_pattern(&t.join("sub/deeper/mib+3"), (1 << 20) + 3, 5);
    write_pattern(&t.join("sub/name with space"), 100, 6);
    s.cmd(&["cp", "-r", t.to_str().unwrap(), &s.url("data/t")])
        .assert()
        .success();
    assert_eq!(tree(&s.data.join("t")), tree(&t));
    // Into an existing directory: creates tree/ inside it.
    s.cmd(&["cp", "-r", t.to_str().unwrap(), &s.url("data/t")])
        .assert()
        .success();
    assert_eq!(tree(&s.data.join("t/tree")), tree(&t));
    // remote → local and remote → remote.
    let t2 = local.path().join("t2");
    s.cmd(&["cp", "-r", &s.url("data/t/tree"), t2.to_str().unwrap()])
        .assert()
        .success();
    assert_eq!(tree(&t2), tree(&t));
    s.cmd(&["cp", "-r", &s.url("data/t/tree"), &s.url("data/t3")])
        .assert()
        .success();
    assert_eq!(tree(&s.data.join("t3")), tree(&t));
    // A directory without -r.
    s.cmd(&["cp", t.to_str().unwrap(), &s.url("data/x")])
        .assert()
        .failure()
        .stderr(one_line_error().and(predicate::str::contains("use -r")));
    assert!(no_part_files(&s.data));
    assert!(no_part_files(local.path()));
}

/// Run `lwio bench … --json`; its stdout as JSON.
fn bench_json(c: &mut assert_cmd::Command) -> serde_json::Value {
    let out = c
        .arg("--json")
        .timeout(Duration::from_secs(60))
        .assert()
        .success()
        .get_output()
        .stdout
        .clone();
    serde_json::from_slice(&out).unwrap()
}

#[test]
fn bench_embedded_both_completion_modes() {
    for mode in ["poll", "interrupt"] {
        let out = lwio()
            .args([
                "bench",
                "--runtime",
                "1s",
                "--size",
                "8M",
                "--completion",
                mode,
            ])
            .timeout(Duration::from_secs(60))
            .assert()
            .success()
            .get_output()
            .stdout
            .clone();
        let text = String::from_utf8(out).unwrap();
        assert!(
            text.starts_with(&format!(
                "lwio bench --rw randread --bs 4k --qd 16 --jobs 1 --size 8M --runtime 1s --completion {mode}"
            )),
            "{text}"
        );
        for k in ["IOPS", "p50", "p99.9", "client CPU", "per I/O"] {
            assert!(text.contains(k), "{k} missing: {text}");
        }
    }
    for mode in ["poll", "interrupt"] {
        let v = bench_json(lwio().args([
            "bench",
            "--runtime",
            "1s",
            "--size",
            "8M",
            "--rw",
            "randrw",
            "--qd",
            "4",
            "--completion",
            mode,
        ]));
        for k in [
            "command",
            "rw",
            "bs",
            "qd",
            "jobs",
            "completion",
            "provider",
            "ios",
            "iops",
            "bandwidth_bytes_per_s",
            "lat_us",
            "client_cpu_us_per_io",
        ] {
            assert!(v.get(k).is_some(), "{k} missing: {v}");
        }
        for k in ["p50", "p99", "p99_9"] {
            assert!(v["lat_us"][k].as_f64().unwrap() > 0.0, "{v}");
        }
        assert!(v["iops"].as_f64().unwrap() > 0.0, "{v}");
        assert_eq!(v["completion"], mode);
        assert_eq!(v["rw"], "randrw");
        assert!(v["read_ios"].as_u64().unwrap() > 0 && v["write_ios"].as_u64().unwrap() > 0);
    }
}

/// Blocks larger than one request (1 MiB: a read of several parts, a
/// write sent as one fragmented message from a registered buffer) in both
/// completion modes: every I/O completes. A 1 MiB write with interrupts
/// panicked in the job's reaping once (its part is longer than the
/// scratch buffer sized for one read request).
#[test]
fn bench_large_blocks_in_both_completion_modes() {
    let s = serve();
    let url = s.url("data/large.dat");
    for mode in ["poll", "interrupt"] {
        for rw in ["write", "read"] {
            let v = bench_json(&mut s.cmd(&[
                "bench",
                &url,
                "--rw",
                rw,
                "--bs",
                "1M",
                "--qd",
                "4",
                "--size",
                "16M",
                "--runtime",
                "500ms",
                "--completion",
                mode,
            ]));
            let ios = v[format!("{rw}_ios")].as_u64().unwrap();
            assert!(ios > 0, "{mode} {rw}: {v}");
            assert_eq!(v["bs"], 1 << 20, "{v}");
        }
    }
}

#[test]
fn bench_against_a_server_and_its_errors() {
    let s = serve();
    let v = bench_json(&mut s.cmd(&[
        "bench",
        &s.url("data/bench.dat"),
        "--rw",
        "write",
        "--bs",
        "64k",
        "--qd",
        "4",
        "--jobs",
        "2",
        "--size",
        "1M",
        "--runtime",
        "500ms",
    ]));
    assert!(v["write_ios"].as_u64().unwrap() > 0, "{v}");
    assert_eq!(v["jobs"], 2);
    assert_eq!(
        std::fs::metadata(s.data.join("bench.dat")).unwrap().len(),
        1 << 20
    );
    lwio()
        .args(["bench", "--bs", "8k", "--size", "4k"])
        .assert()
        .failure()
        .stderr(one_line_error().and(predicate::str::contains("smaller than --bs")));
    // No usable RDMA provider: the embedded server says why.
    lwio()
        .args(["bench", "--provider", "verbs", "--runtime", "1s"])
        .timeout(Duration::from_secs(60))
        .assert()
        .failure()
        .stderr(one_line_error().and(predicate::str::contains("no usable RDMA provider")));
}

#[test]
fn errors_a_person_can_act_on() {
    let s = serve();
    let local = tempfile::tempdir().unwrap();
    let f = local.path().join("f.bin");
    write_pattern(&f, 10_000, 7);
    let fs = f.to_str().unwrap();
    let err = |args: &[&str], needle: &str| {
        s.cmd(args)
            .timeout(Duration::from_secs(30))
            .assert()
            .failure()
            .stderr(one_line_error().and(predicate::str::contains(needle)));
    };
    // Unreachable host.
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let closed = l.local_addr().unwrap();
    drop(l);
    err(
        &["cat", &format!("lwio://{closed}/data/x")],
        "cannot connect",
    );
    err(
        &["cp", fs, &format!("lwio://{closed}/data/x")],
        "cannot connect",
    );
    // Wrong token.
    lwio()
        .args(["cat", &s.url("data/big.bin")])
        .env("LWIO_TOKEN", "ffffffffffffffffffffffffffffffff")
        .env("LWIO_FINGERPRINT", &s.fingerprint)
        .assert()
        .failure()
        .stderr(one_line_error().and(predicate::str::contains("wrong token")));
    // Missing export, missing file (both directions).
    err(&["cat", &s.url("nosuch/x")], "no export named");
    err(&["cp", fs, &s.url("nosuch/x")], "no export named");
    std::fs::create_dir(s.data.join("adir")).unwrap();
    err(&["cat", &s.url("data/adir")], "data/adir: Is a directory");
    // A missing file whose name says "export" is still just missing.
    s.cmd(&["cp", fs, &s.url("data/export.csv")])
        .assert()
        .success();
    err(
        &["cat", &s.url("data/missing.bin")],
        "data/missing.bin: No such file or directory",
    );
    err(
        &[
            "cp",
            &s.url("data/missing.bin"),
            local.path().join("m").to_str().unwrap(),
        ],
        "No such file or directory",
    );
    err(
        &[
            "cp",
            local.path().join("nope").to_str().unwrap(),
            &s.url("data/m"),
        ],
        "No such file or directory",
    );
    err(
        &["cp", fs, &s.url("data/no/such/dir/f")],
        "the destination directory does not exist",
    );
    // Permission denied (a read-only export).
    err(&["cp", fs, &s.url("ro/f.bin")], "read-only");
    // Permission denied locally (unless we are root, who may write anywhere).
    let locked = local.path().join("locked");
    std::fs::create_dir(&locked).unwrap();
    std::fs::write(s.data.join("small"), b"abc").unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&locked, std::fs::Permissions::from_mode(0o500)).unwrap();
    if unsafe { libc::geteuid() } != 0 {
        err(
            &[
                "cp",
                &s.url("data/small"),
                locked.join("x").to_str().unwrap(),
            ],
            "permission denied",
        );
    }
    // A path outside the export (symlink leaving it).
    err(&["cat", &s.url("data/escape/secret")], "outside the export");
    err(
        &[
            "cp",
            &s.url("data/escape/secret"),
            local.path().join("s").to_str().unwrap(),
        ],
        "outside the export",
    );
    // Both local.
    err(&["cp", fs, "/tmp/x"], "must be an lwio:// URL");
    // No usable RDMA provider for the server.
    lwio()
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--provider",
            "verbs",
            "--export",
        ])
        .arg(format!("d={}", s.data.display()))
        .arg("--token-file")
        .arg(&s.token)
        .env("RUST_LOG", "off")
        .assert()
        .failure()
        .stderr(one_line_error().and(predicate::str::contains(
            "no usable RDMA provider for --provider verbs",
        )));
    // … nor for rdma-bench (this host has no RDMA device; on one that has,
    // the peer at port 1 refuses).
    lwio()
        .args([
            "rdma-bench",
            "--op",
            "write",
            "--size",
            "4k",
            "--connect",
            "127.0.0.1:1",
            "--provider",
            "verbs",
        ])
        .timeout(Duration::from_secs(30))
        .assert()
        .failure()
        .stderr(one_line_error());
    assert!(!local.path().join("m").exists() && !local.path().join("s").exists());
    assert!(no_part_files(&s.data) && no_part_files(local.path()));
}

#[test]
fn full_disk_is_a_clear_error() {
    // The export on a 1 MiB tmpfs, in a private mount namespace.
    let Some(s) = serve_with(
        &["unshare", "-Urm"],
        "mount -t tmpfs -o size=1m lwio-test \"$LWIO_DATA\"",
    ) else {
        lwio_server::io_phase::testkit::skip(
            "cannot mount a tmpfs in a user namespace here (unshare -Urm)",
        );
        return;
    };
    let local = tempfile::tempdir().unwrap();
    let f = local.path().join("big.bin");
    write_pattern(&f, 4 << 20, 8);
    s.cmd(&["cp", f.to_str().unwrap(), &s.url("data/big.bin")])
        .timeout(Duration::from_secs(60))
        .assert()
        .failure()
        .stderr(one_line_error().and(predicate::str::contains("no space left")));
    // Nothing with the final name, no partial file either.
    s.cmd(&["ls", &s.url("data")])
        .assert()
        .success()
        .stdout(predicate::str::contains("big.bin").not());
}

/// Wait until a `.NAME.lwio-part-*` file shows up in `dir`.
fn wait_for_part(dir: &Path, limit: Duration) -> bool {
    let t0 = Instant::now();
    while t0.elapsed() < limit {
        if let Ok(rd) = std::fs::read_dir(dir) {
            if rd
                .flatten()
                .any(|e| e.file_name().to_string_lossy().contains(".lwio-part-"))
            {
                return true;
            }
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    false
}

/// Wait for a spawned command: it must fail with one error line (returned).
fn fails_with_one_line(c: Child) -> String {
    let out = c.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "{stderr}");
    assert!(one_line_error().eval(&stderr), "{stderr}");
    stderr
}

#[test]
fn server_killed_mid_copy_leaves_no_final_file() {
    let local = tempfile::tempdir().unwrap();
    let big = local.path().join("big.bin");
    // Sparse: cheap to make, still 256 MiB to send.
    std::fs::File::create(&big)
        .unwrap()
        .set_len(256 << 20)
        .unwrap();
    // local → remote.
    let mut s = serve();
    let cp = s.spawn(&["cp", big.to_str().unwrap(), &s.url("data/big.bin")]);
    assert!(wait_for_part(&s.data, Duration::from_secs(20)));
    std::thread::sleep(Duration::from_millis(100));
    s.kill();
    let stderr = fails_with_one_line(cp);
    assert!(stderr.contains("server went away"), "{stderr}");
    assert!(!s.data.join("big.bin").exists());

    // remote → local: the local partial file is removed too.
    let mut s = serve();
    std::fs::File::create(s.data.join("big.bin"))
        .unwrap()
        .set_len(256 << 20)
        .unwrap();
    let dst = local.path().join("dst");
    std::fs::create_dir(&dst).unwrap();
    let cp = s.spawn(&["cp", &s.url("data/big.bin"), dst.to_str().unwrap()]);
    assert!(wait_for_part(&dst, Duration::from_secs(20)));
    std::thread::sleep(Duration::from_millis(100));
    s.kill();
    fails_with_one_line(cp);
    assert!(!dst.join("big.bin").exists());
    assert!(no_part_files(&dst), "partial file left");
}

#[test]
fn interrupted_cp_removes_its_partial_file() {
    let s = serve();
    let local = tempfile::tempdir().unwrap();
    let big = local.path().join("big.bin");
    std::fs::File::create(&big)
        .unwrap()
        .set_len(256 << 20)
        .unwrap();
    let cp = s.spawn(&["cp", big.to_str().unwrap(), &s.url("data/big.bin")]);
    assert!(wait_for_part(&s.data, Duration::from_secs(20)));
    // SAFETY: signalling our own child.
    unsafe { libc::kill(cp.id() as i32, libc::SIGINT) };
    let stderr = fails_with_one_line(cp);
    assert!(stderr.contains("interrupted by SIGINT"), "{stderr}");
    assert!(!s.data.join("big.bin").exists());
    assert!(no_part_files(&s.data), "partial file left");
}

/// `GET path` on the metrics listener: (status line, body).
fn http_get(addr: &str, path: &str) -> (String, String) {
    use std::io::{Read, Write};
    let mut c = std::net::TcpStream::connect(addr).unwrap();
    write!(c, "GET {path} HTTP/1.1\r\nHost: {addr}\r\n\r\n").unwrap();
    let mut r = String::new();
    c.read_to_string(&mut r).unwrap();
    let (head, body) = r.split_once("\r\n\r\n").expect("an HTTP response");
    (
        head.lines().next().unwrap_or("").to_string(),
        body.to_string(),
    )
}

/// The value of one series (`name{labels}` exactly as exposed).
fn series(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
}

/// `lwio serve --metrics`: Prometheus text that counts what clients did,
/// exactly: a copy in is WRITE bytes, a cat is READ bytes, each request is
/// in the latency histogram; the server exposes no memory.
#[test]
fn metrics_count_what_clients_did() {
    let s = serve();
    let (status, body) = http_get(&s.metrics, "/metrics");
    assert_eq!(status, "HTTP/1.1 200 OK");
    assert_eq!(
        series(&body, "lwio_request_bytes_total{op=\"write\"}"),
        Some(0.0)
    );
    assert_eq!(http_get(&s.metrics, "/").0, "HTTP/1.1 404 Not Found");

    let local = tempfile::tempdir().unwrap();
    let src = local.path().join("m.bin");
    let data = write_pattern(&src, (1 << 20) + 3, 9);
    s.cmd(&["cp", src.to_str().unwrap(), &s.url("data/m.bin")])
        .assert()
        .success();
    let out = s.cmd(&["cat", &s.url("data/m.bin")]).output().unwrap();
    assert!(out.status.success());
    assert_eq!(out.stdout, data);

    // Connections add their counts in every 50 ms and when they close.
    let t0 = Instant::now();
    let text = loop {
        let (_, text) = http_get(&s.metrics, "/metrics");
        let w = series(&text, "lwio_request_bytes_total{op=\"write\"}");
        let r = series(&text, "lwio_request_bytes_total{op=\"read\"}");
        // And the read's slab slots back (after the server's RDMA Write
        // completions, which may follow the client's by a moment).
        let slots = series(&text, "lwio_rdma_read_slab_in_use_bytes");
        if w == Some(data.len() as f64) && r == Some(data.len() as f64) && slots == Some(0.0) {
            break text;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "write/read bytes {w:?}/{r:?}, want {}:\n{text}",
            data.len()
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    for op in ["write", "read", "auth", "register", "close"] {
        let n = series(&text, &format!("lwio_requests_total{{op=\"{op}\"}}")).unwrap();
        let done = series(
            &text,
            &format!("lwio_requests_completed_total{{op=\"{op}\"}}"),
        );
        let hist = series(
            &text,
            &format!("lwio_request_latency_seconds_count{{op=\"{op}\"}}"),
        );
        assert!(n >= 1.0, "{op}: {n}");
        assert_eq!(done, Some(n), "{op} answered");
        assert_eq!(hist, Some(n), "{op} in the histogram");
    }
    assert_eq!(series(&text, "lwio_rdma_remote_access_regions"), Some(0.0));
    assert_eq!(series(&text, "lwio_rdma_memory_windows"), Some(0.0));
    assert!(series(&text, "lwio_rdma_read_slab_bytes").is_some());
    assert!(series(&text, "lwio_rdma_connections_accepted_total").unwrap() >= 2.0);
    // The same figures over the side channel, for a person.
    let out = s.cmd(&["stats", &s.url("")]).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let table = String::from_utf8(out.stdout).unwrap();
    let write = table
        .lines()
        .find(|l| l.starts_with("write "))
        .unwrap_or_else(|| panic!("no write row:\n{table}"));
    assert!(write.contains(" 1.0 MiB "), "{write}");
    assert!(
        table.contains("Exposed memory       0 regions, 0 windows"),
        "{table}"
    );
    assert!(table.contains("Read-buffer slabs    "), "{table}");
    let raw = s.cmd(&["stats", "--raw", &s.url("")]).output().unwrap();
    assert!(String::from_utf8(raw.stdout)
        .unwrap()
        .contains("# TYPE lwio_requests counter"));
    assert!(
        text.contains("lwio_request_latency_seconds_bucket{le=\"+Inf\",op=\"read\"}")
            || text.contains("lwio_request_latency_seconds_bucket{op=\"read\",le=\"+Inf\"}")
    );
}

/// A `lwio publish` process: killed if the test ends without stopping it
/// (a failed assertion), and its stderr printed when the test fails.
struct Publisher {
    child: Child,
    log: tempfile::NamedTempFile,
}

impl Drop for Publisher {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        if std::thread::panicking() {
            let log = std::fs::read_to_string(self.log.path()).unwrap_or_default();
            eprintln!("--- lwio publish stderr ---\n{log}--- end ---");
        }
    }
}

/// `lwio publish` as a process: its first stdout line is the object's URL.
fn publish(s: &Served, args: &[&str]) -> (Publisher, String) {
    use std::io::BufRead;
    let log = tempfile::NamedTempFile::new().unwrap();
    let mut child = Command::cargo_bin("lwio")
        .unwrap()
        .arg("publish")
        .args(args)
        .arg("--token-file")
        .arg(&s.token)
        .env("LWIO_FINGERPRINT", &s.fingerprint)
        .env("LWIO_KNOWN_HOSTS", fresh_known_hosts())
        .env_remove("LWIO_TOKEN")
        .env_remove("RUST_LOG")
        .stdout(Stdio::piped())
        .stderr(log.reopen().unwrap())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    (Publisher { child, log }, line.trim().to_string())
}

/// SIGTERM, then the exit status (within 30 s).
fn stop(mut p: Publisher) -> std::process::ExitStatus {
    // SAFETY: signalling our own child process.
    unsafe { libc::kill(p.child.id() as i32, libc::SIGTERM) };
    let t0 = Instant::now();
    loop {
        if let Some(st) = p.child.try_wait().unwrap() {
            return st;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "publish did not stop"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn publish_serves_memory_to_cat_and_cp() {
    let s = serve();
    let local = tempfile::tempdir().unwrap();
    let src = local.path().join("weights.bin");
    let mut want = write_pattern(&src, 64 << 20, 7);
    let out = local.path().join("final.bin");
    let (p, url) = publish(
        &s,
        &[
            &s.url("data"),
            "weights",
            "--file",
            src.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ],
    );
    assert_eq!(url, s.url("data/.lwio-mem/weights"));
    // stat and ls see it at its size.
    s.cmd(&["stat", &url])
        .assert()
        .success()
        .stdout(predicate::str::contains(format!("Size: {}", 64 << 20)));
    s.cmd(&["ls", "-l", &s.url("data/.lwio-mem")])
        .assert()
        .success()
        .stdout(predicate::str::contains("weights"));
    // cat reads it byte for byte.
    s.cmd(&["cat", &url])
        .assert()
        .success()
        .stdout(predicate::function(|o: &[u8]| o == want.as_slice()));
    // cp writes into it in place (from offset 0), and reads it out.
    let patch = local.path().join("patch.bin");
    let pv = write_pattern(&patch, (3 << 20) + 5, 9);
    s.cmd(&["cp", patch.to_str().unwrap(), &url])
        .assert()
        .success();
    want[..pv.len()].copy_from_slice(&pv);
    let back = local.path().join("back.bin");
    s.cmd(&["cp", &url, back.to_str().unwrap()])
        .assert()
        .success();
    assert!(std::fs::read(&back).unwrap() == want);
    // Remote → memory object on the same server goes through the client
    // (the server copies files only).
    std::fs::write(s.data.join("small"), b"0123456789").unwrap();
    s.cmd(&["cp", &s.url("data/small"), &url])
        .assert()
        .success();
    want[..10].copy_from_slice(b"0123456789");
    let back2 = local.path().join("back2.bin");
    s.cmd(&["cp", &url, back2.to_str().unwrap()])
        .assert()
        .success();
    assert!(std::fs::read(&back2).unwrap() == want);
    // A file larger than the object: a clear error at the first byte past
    // the end (cp writes in order: everything before it is in).
    let big = local.path().join("big.bin");
    let bv = write_pattern(&big, (64 << 20) + 1, 1);
    s.cmd(&["cp", big.to_str().unwrap(), &url])
        .assert()
        .failure()
        .stderr(one_line_error().and(predicate::str::contains(
            "past the end of the memory object (its size is fixed)",
        )));
    want.copy_from_slice(&bv[..64 << 20]);
    // Ctrl-C/SIGTERM: unpublished, the final contents written out.
    assert!(stop(p).success());
    assert!(std::fs::read(&out).unwrap() == want);
    s.cmd(&["stat", &url])
        .assert()
        .failure()
        .stderr(one_line_error().and(predicate::str::contains("no such memory object")));
    assert!(no_part_files(&s.data));
}

#[test]
fn publish_read_only_refuses_cp_and_keeps_memory() {
    let s = serve();
    let local = tempfile::tempdir().unwrap();
    let out = local.path().join("final.bin");
    let (p, url) = publish(
        &s,
        &[
            &s.url("data"),
            "zeros",
            "--size",
            "1MiB",
            "--read-only",
            "--out",
            out.to_str().unwrap(),
        ],
    );
    s.cmd(&["cat", &url])
        .assert()
        .success()
        .stdout(predicate::function(|o: &[u8]| {
            o == vec![0u8; 1 << 20].as_slice()
        }));
    let patch = local.path().join("patch.bin");
    write_pattern(&patch, 4096, 9);
    s.cmd(&["cp", patch.to_str().unwrap(), &url])
        .assert()
        .failure()
        .stderr(one_line_error().and(predicate::str::contains("read-only")));
    assert!(stop(p).success());
    assert!(std::fs::read(&out).unwrap() == vec![0u8; 1 << 20]);
    // Publishing needs an export name and a size or a file.
    s.cmd(&["publish", &s.url(""), "x", "--size", "1"])
        .assert()
        .failure()
        .stderr(one_line_error());
}

#[test]
fn publish_serves_more_than_the_default_registration_cache() {
    // 300 MiB: more than the client's default registration cache (256 MiB),
    // which refused the buffer before `lwio publish` sized it to fit.
    let s = serve();
    let (p, url) = publish(&s, &[&s.url("data"), "big", "--size", "300MiB"]);
    assert_eq!(url, s.url("data/.lwio-mem/big"));
    s.cmd(&["stat", &url])
        .assert()
        .success()
        .stdout(predicate::str::contains(format!("Size: {}", 300 << 20)));
    assert!(stop(p).success());
}

/// A publisher that has been idle long enough for the server to reclaim
/// its credits (down to one) still serves its object: the server's RDMA
/// Reads of its memory are answered.
#[test]
fn publish_serves_reads_after_the_publisher_idles() {
    let s = serve();
    let local = tempfile::tempdir().unwrap();
    let src = local.path().join("idle.bin");
    let want = write_pattern(&src, 8 << 20, 3);
    let (p, url) = publish(
        &s,
        &[&s.url("data"), "idle", "--file", src.to_str().unwrap()],
    );
    std::thread::sleep(Duration::from_secs(3));
    s.cmd(&["cat", &url])
        .timeout(Duration::from_secs(20))
        .assert()
        .success()
        .stdout(predicate::function(|o: &[u8]| o == want.as_slice()));
    assert!(stop(p).success());
}
