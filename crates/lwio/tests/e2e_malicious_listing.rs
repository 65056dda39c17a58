//! A malicious server's directory listings (issue 31): entry names that
//! are not one path component (`../x`, an absolute path, `..`, `.`, the
//! empty name, `a/b`, a NUL) must never reach a local path.
//!
//! The server is the real one (`LocalServer`: login, Stat, Open, the RDMA
//! data path), seen through a side-channel proxy that plays the malicious
//! part: it renames one entry of every listing (ListDir and ListDirX
//! pages) to the case's name, and maps the requests for that name back to
//! the real file, so that a client which trusted the name would get its
//! bytes and write them wherever the name points. The real `lwio cp -r`
//! copies the listed directory into a fresh destination beside a sentinel
//! file; the real client library lists it directly.
//!
//! Each case asserts the listing is refused with an error that names the
//! entry (the library: `BadRequest`, EPROTO-style "server listed an invalid
//! entry name"; `lwio cp`: exit 1 with that message), that the sentinel is
//! byte for byte what it was, and that nothing at all changed beside it (no
//! new file, not even the destination directory).

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};

use lwio_server::config::Limits;
use lwio_server::io_phase::driver::RdmaServerOptions;
use lwio_server::io_phase::testkit::LocalServer;
use lwio_side::codec::{Request, Response};
use lwio_side::{ErrorCode, Login, Token};

const TOKEN: &str = "malicious-listing-token-0123456789";
/// The real file the listing renames, and its bytes.
const REAL: &str = "payload.txt";
const PAYLOAD: &[u8] = b"#!/bin/sh\necho owned\n";
const SENTINEL: &[u8] = b"the sentinel's own bytes\n";

// ------------------------------------------------------------------ proxy

fn read_frame(s: &mut TcpStream) -> Option<Vec<u8>> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len).ok()?;
    let mut body = vec![0u8; u32::from_le_bytes(len) as usize];
    s.read_exact(&mut body).ok()?;
    Some(body)
}

fn write_frame(s: &mut TcpStream, body: &[u8]) -> bool {
    let mut b = (body.len() as u32).to_le_bytes().to_vec();
    b.extend_from_slice(body);
    s.write_all(&b).is_ok()
}

/// The malicious side: renames `REAL` in every listing of `dir` to
/// `evil`, and sends requests for `dir/evil` to `dir/REAL`.
#[derive(Clone)]
struct Evil {
    dir: String,
    evil: String,
}

impl Evil {
    fn request(&self, body: Vec<u8>) -> Vec<u8> {
        let Ok((id, mut req)) = Request::decode(&body) else {
            return body;
        };
        let asked = format!("{}/{}", self.dir, self.evil);
        let path = match &mut req {
            Request::Stat { path, .. }
            | Request::StatX { path, .. }
            | Request::Open { path, .. }
            | Request::Readlink { path, .. } => path,
            _ => return body,
        };
        if *path != asked {
            return body;
        }
        *path = format!("{}/{REAL}", self.dir);
        req.encode(id)
    }

    fn response(&self, body: Vec<u8>) -> Vec<u8> {
        let Ok((id, mut resp)) = Response::decode(&body) else {
            return body;
        };
        match &mut resp {
            Response::DirPage { entries, .. } => {
                for e in entries.iter_mut().filter(|e| e.name == REAL) {
                    e.name = self.evil.clone();
                }
            }
            Response::DirPageX { entries, .. } => {
                for (name, _) in entries.iter_mut().filter(|(n, _)| n == REAL) {
                    *name = self.evil.clone();
                }
            }
            _ => return body,
        }
        resp.encode(id)
    }
}

/// A side-channel proxy in front of `upstream` that plays `evil`.
fn proxy(upstream: SocketAddr, evil: Evil) -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    std::thread::spawn(move || {
        for c in l.incoming() {
            let Ok(mut c) = c else { return };
            let Ok(mut s) = TcpStream::connect(upstream) else {
                return;
            };
            let (mut c2, mut s2) = (c.try_clone().unwrap(), s.try_clone().unwrap());
            let ev = evil.clone();
            std::thread::spawn(move || {
                while let Some(b) = read_frame(&mut c) {
                    if !write_frame(&mut s, &ev.request(b)) {
                        break;
                    }
                }
                let _ = s.shutdown(Shutdown::Write);
            });
            let ev = evil.clone();
            std::thread::spawn(move || {
                while let Some(b) = read_frame(&mut s2) {
                    if !write_frame(&mut c2, &ev.response(b)) {
                        break;
                    }
                }
                let _ = c2.shutdown(Shutdown::Both);
            });
        }
    });
    addr
}

// ------------------------------------------------------------ environment

struct Env {
    s: LocalServer,
    _dir: tempfile::TempDir,
    /// The client's side: `sentinel`, `token`; the copy goes to `out`.
    local: PathBuf,
}

fn env() -> Env {
    let dir = tempfile::tempdir().unwrap();
    let export = dir.path().join("export");
    std::fs::create_dir_all(export.join("d")).unwrap();
    std::fs::write(export.join("d").join(REAL), PAYLOAD).unwrap();
    std::fs::write(export.join("d/plain.txt"), b"plain\n").unwrap();
    let local = dir.path().join("local");
    std::fs::create_dir_all(&local).unwrap();
    std::fs::write(local.join("sentinel"), SENTINEL).unwrap();
    std::fs::write(local.join("token"), TOKEN).unwrap();
    let s = LocalServer::start(
        &export,
        "ex",
        TOKEN,
        Limits::default(),
        RdmaServerOptions::default(),
    )
    .unwrap();
    Env {
        s,
        _dir: dir,
        local,
    }
}

/// Every path under `root` (relative) with its content (`None`: a
/// directory).
fn tree(root: &Path) -> BTreeMap<PathBuf, Option<Vec<u8>>> {
    fn walk(root: &Path, d: &Path, out: &mut BTreeMap<PathBuf, Option<Vec<u8>>>) {
        for e in std::fs::read_dir(d).unwrap() {
            let p = e.unwrap().path();
            let rel = p.strip_prefix(root).unwrap().to_path_buf();
            if p.is_dir() {
                out.insert(rel, None);
                walk(root, &p, out);
            } else {
                out.insert(rel, Some(std::fs::read(&p).unwrap()));
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(root, root, &mut out);
    out
}

/// The names a server must not list, with the local path each would
/// reach if joined to the destination `out` (the absolute one: the
/// sentinel itself).
fn bad_names(local: &Path) -> Vec<String> {
    vec![
        "../sentinel".into(),
        local.join("sentinel").to_str().unwrap().into(),
        "../../local/sentinel".into(),
        "..".into(),
        ".".into(),
        String::new(),
        "x/y".into(),
        "a\0b".into(),
    ]
}

fn lwio() -> std::process::Command {
    let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_lwio"));
    c.env_remove("LWIO_TOKEN")
        .env_remove("LWIO_FINGERPRINT")
        .env_remove("LWIO_PASSWORD")
        .env_remove("RUST_LOG")
        .env("LWIO_TOKEN_FILE", "/nonexistent/lwio-test-token");
    c
}

// ------------------------------------------------------------------ cases

/// `lwio cp -r lwio://EVIL/ex/d LOCAL/out`: refused at the listing, the
/// entry named, nothing beside the destination (nor the destination
/// itself) created or changed.
#[test]
fn cp_r_refuses_entry_names_that_leave_the_destination() {
    let e = env();
    for name in bad_names(&e.local) {
        let addr = proxy(
            e.s.side_addr,
            Evil {
                dir: "d".into(),
                evil: name.clone(),
            },
        );
        let before = tree(&e.local);
        let out = lwio()
            .args(["cp", "-r", "--no-tls", "--token-file"])
            .arg(e.local.join("token"))
            .arg(format!("lwio://{addr}/ex/d"))
            .arg(e.local.join("out"))
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        eprintln!("{name:?}: exit {:?}, stderr {stderr:?}", out.status.code());
        assert_eq!(
            std::fs::read(e.local.join("sentinel")).unwrap(),
            SENTINEL,
            "{name:?}: the sentinel beside the destination was overwritten"
        );
        assert_eq!(
            tree(&e.local),
            before,
            "{name:?}: files beside the destination changed"
        );
        assert_eq!(out.status.code(), Some(1), "{name:?}: cp must fail");
        let want = format!("server listed an invalid entry name {name:?}");
        assert!(
            stderr.starts_with("lwio: error: ")
                && stderr.contains(&want)
                && stderr.trim_end().lines().count() == 1,
            "{name:?}: stderr {stderr:?}, want one error line with {want:?}"
        );
    }
}

/// The client library's listing calls refuse such a name themselves, for
/// every consumer (the mount lists with `list_dir_x`), with `BadRequest`
/// naming the entry; an honest listing through the same proxy passes.
#[test]
fn library_listings_refuse_invalid_entry_names() {
    let e = env();
    let opts = lwio_client::side_client::SideOptions::new(Login::Token(Token::new(TOKEN).unwrap()));
    for name in bad_names(&e.local) {
        let addr = proxy(
            e.s.side_addr,
            Evil {
                dir: "d".into(),
                evil: name.clone(),
            },
        );
        let mut c =
            lwio_client::side_client::SideClient::connect(&addr.to_string(), &opts).unwrap();
        let want = format!("server listed an invalid entry name {name:?}");
        for x in [false, true] {
            let r = if x {
                c.list_dir_x("ex", "d").map(|v| v.len())
            } else {
                c.list_dir("ex", "d").map(|v| v.len())
            };
            match r {
                Err(err) => {
                    assert_eq!(err.code, ErrorCode::BadRequest, "{name:?} (x {x}): {err}");
                    assert_eq!(err.message, want, "{name:?} (x {x})");
                }
                Ok(n) => panic!("{name:?} (x {x}): listing of {n} entries accepted"),
            }
        }
    }
    // The proxy itself is honest about other names.
    let addr = proxy(
        e.s.side_addr,
        Evil {
            dir: "d".into(),
            evil: "renamed.txt".into(),
        },
    );
    let mut c = lwio_client::side_client::SideClient::connect(&addr.to_string(), &opts).unwrap();
    let mut names: Vec<String> = c
        .list_dir("ex", "d")
        .unwrap()
        .into_iter()
        .map(|e| e.name)
        .collect();
    names.sort();
    assert_eq!(names, ["plain.txt", "renamed.txt"]);
    let mut names: Vec<String> = c
        .list_dir_x("ex", "d")
        .unwrap()
        .into_iter()
        .map(|e| e.0)
        .collect();
    names.sort();
    assert_eq!(names, ["plain.txt", "renamed.txt"]);
}
