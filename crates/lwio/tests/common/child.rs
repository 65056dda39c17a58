//! A server in a child process (e2e_thousand, e2e_hundred_thousand), so
//! that its RSS, threads and descriptors are its own, not the clients':
//! the test's own executable started again with an environment variable
//! naming the export directory runs a `LocalServer` there, prints its side
//! channel address, and answers each "?" line on its stdin with a line of
//! figures; it exits when its stdin closes. Included with `#[path]` (each
//! test compiles its own copy, so what one does not use is not dead code).
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

/// The child's side: announce `side_addr`, then answer "?" with
/// `figures()` until stdin closes.
pub fn serve(side_addr: impl std::fmt::Display, figures: impl Fn() -> Vec<u64>) -> ! {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{side_addr}").unwrap();
    out.flush().unwrap();
    for _ in std::io::stdin().lines().map_while(Result::ok) {
        let v: Vec<String> = figures().iter().map(u64::to_string).collect();
        writeln!(out, "{}", v.join(" ")).unwrap();
        out.flush().unwrap();
    }
    std::process::exit(0);
}

/// The server child, from the test's side.
pub struct ChildServer {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    pub side_addr: String,
}

impl ChildServer {
    /// Start this executable again with `env`=`root`.
    pub fn start(env: &str, root: &Path) -> ChildServer {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .env(env, root)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("server child");
        let stdin = child.stdin.take().unwrap();
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let mut side_addr = String::new();
        stdout.read_line(&mut side_addr).unwrap();
        assert!(!side_addr.is_empty(), "the server child did not start");
        ChildServer {
            child,
            stdin,
            stdout,
            side_addr: side_addr.trim().to_string(),
        }
    }

    /// The child's figures now (`n` of them).
    pub fn figures(&mut self, n: usize) -> Vec<u64> {
        writeln!(self.stdin, "?").unwrap();
        let mut l = String::new();
        self.stdout.read_line(&mut l).unwrap();
        let v: Vec<u64> = l
            .split_whitespace()
            .map(|x| x.parse().expect("figure"))
            .collect();
        assert_eq!(v.len(), n, "server child said {l:?}");
        v
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Descriptors the child has open (/proc/PID/fd).
    pub fn fds(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/fd", self.pid()))
            .expect("/proc/PID/fd")
            .count()
    }
}

impl Drop for ChildServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
