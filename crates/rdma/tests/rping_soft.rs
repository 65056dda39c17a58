//! `lwio-rping` server and client, both on the soft provider over loopback:
//! rping's exchange (Send advertisement, RDMA Read, go-ahead, Send
//! advertisement, RDMA Write, go-ahead) for 100 iterations with the data
//! verified on both sides, MPA CRC on and off. The same binary runs against
//! the kernel's siw in the VM suite (`scripts/vm/interop-rping.sh`).

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::thread::JoinHandle;

const BIN: &str = env!("CARGO_BIN_EXE_lwio-rping");

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// A running server; killed if the test fails before it exits.
struct Server {
    child: Child,
    out: Option<JoinHandle<String>>,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Server {
    /// Start on a free loopback port; returns it and the port.
    fn start(extra: &[&str]) -> (Server, u16) {
        let mut child = Command::new(BIN)
            .args(["-s", "-a", "127.0.0.1", "-p", "0", "--timeout", "60"])
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn lwio-rping -s");
        let mut r = BufReader::new(child.stdout.take().expect("stdout"));
        let (tx, rx) = mpsc::channel();
        let out = std::thread::spawn(move || {
            let mut first = String::new();
            let _ = r.read_line(&mut first);
            let _ = tx.send(first.clone());
            let mut rest = String::new();
            let _ = r.read_to_string(&mut rest);
            first + &rest
        });
        let line = rx.recv().unwrap_or_default();
        // "lwio-rping: listening on 127.0.0.1:PORT (provider soft, device soft0)"
        let port = line
            .split_whitespace()
            .nth(3)
            .and_then(|a| a.rsplit(':').next())
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| panic!("no listening line: {line:?}"));
        (
            Server {
                child,
                out: Some(out),
            },
            port,
        )
    }

    /// Wait for the exit (the server's own --timeout bounds it).
    fn finish(mut self) -> (Option<i32>, String) {
        let code = self.child.wait().ok().and_then(|s| s.code());
        let out = self
            .out
            .take()
            .map(|h| h.join().unwrap_or_default())
            .unwrap_or_default();
        (code, out)
    }
}

/// Run a server and a client with the given extra arguments; returns
/// ((server code, output), (client code, output)).
fn run(
    server_args: &[&str],
    client_args: &[&str],
) -> ((Option<i32>, String), (Option<i32>, String)) {
    let (s, port) = Server::start(server_args);
    let c = Command::new(BIN)
        .args(["-c", "-a", "127.0.0.1", "-p", &port.to_string()])
        .args(["--timeout", "60"])
        .args(client_args)
        .stdin(Stdio::null())
        .output()
        .expect("run lwio-rping -c");
    (s.finish(), (c.status.code(), text(&c)))
}

fn ok(server_args: &[&str], client_args: &[&str]) {
    let ((sc, so), (cc, co)) = run(server_args, client_args);
    let ctx = format!("--- server:\n{so}\n--- client:\n{co}");
    assert_eq!(cc, Some(0), "client failed\n{ctx}");
    assert_eq!(sc, Some(0), "server failed\n{ctx}");
    assert!(co.contains("lwio-rping: 100 iterations ok"), "{ctx}");
    assert!(so.contains("lwio-rping: 100 iterations ok"), "{ctx}");
}

#[test]
fn hundred_iterations_crc_off() {
    ok(
        &["-C", "100", "-V", "--crc", "off"],
        &["-C", "100", "-V", "--crc", "off"],
    );
}

#[test]
fn hundred_iterations_crc_on() {
    ok(
        &["-C", "100", "-V", "--crc", "on"],
        &["-C", "100", "-V", "--crc", "on"],
    );
}

/// CRC requested by one side only is used by both (RFC 5044 §7.1.2).
#[test]
fn crc_requested_by_the_client_only() {
    let ((sc, so), (cc, co)) = run(&["-C", "100", "-V"], &["-C", "100", "-V", "--crc", "on"]);
    assert_eq!((sc, cc), (Some(0), Some(0)), "{so}\n{co}");
    assert!(
        so.contains("MPA CRC on") && co.contains("MPA CRC on"),
        "{so}\n{co}"
    );
}

/// The largest size rping allows: every message spans many FPDUs.
#[test]
fn hundred_iterations_max_size_crc_on() {
    ok(
        &["-C", "100", "-V", "-S", "65535", "--crc", "on"],
        &["-C", "100", "-V", "-S", "65535", "--crc", "on"],
    );
}

/// A client buffer larger than the server's fails on both sides with the
/// reason, as rping does (it would fail its RDMA Read).
#[test]
fn size_mismatch_fails_cleanly() {
    let ((sc, so), (cc, co)) = run(&["-S", "64"], &["-C", "5", "-S", "1000"]);
    assert_eq!(sc, Some(1), "{so}");
    assert_eq!(cc, Some(1), "{co}");
    assert!(
        so.contains("FAILED after 0 iterations: iteration 0: the client's buffer is 1000 bytes"),
        "{so}"
    );
    assert!(co.contains("FAILED after 0 iterations"), "{co}");
}

/// The server's -C is the number of iterations it must see.
#[test]
fn server_count_is_checked() {
    let ((sc, so), (cc, co)) = run(&["-C", "7"], &["-C", "5", "-V"]);
    assert_eq!(cc, Some(0), "{co}");
    assert_eq!(sc, Some(1), "{so}");
    assert!(
        so.contains("the client disconnected after 5 iterations, -C says 7"),
        "{so}"
    );
}

/// RFC 6581 peer-to-peer request (what siw's initiator sends with
/// `peer_to_peer=Y`: P in the IRD word, Write and Read RTR offered in the ORD
/// word). The soft responder at 9165c78 ignores P2P (reply P = 0, no RTR:
/// siw then terminates, docs/interop.md "peer-to-peer mode"); a responder
/// that supports it echoes P and picks exactly one offered RTR type. Either
/// answer is accepted here, anything else (P without RTR, RTR without P, two
/// RTR types, a reject) fails. The reply's form is printed.
#[test]
fn p2p_request_gets_a_consistent_reply() {
    use std::io::Write;
    use std::net::TcpStream;
    let (s, port) = Server::start(&["--timeout", "10"]);
    let mut t = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    t.set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .unwrap();
    let mut req = b"MPA ID Req Frame".to_vec();
    // flags: enhanced (0x10), rev 2, PD_Length 4: IRD 1 | P, ORD 1 | W | R
    req.extend_from_slice(&[0x10, 2, 0, 4, 0x80, 0x01, 0xc0, 0x01]);
    t.write_all(&req).unwrap();
    let mut rep = [0u8; 24];
    t.read_exact(&mut rep).expect("MPA reply");
    assert_eq!(&rep[..16], b"MPA ID Rep Frame");
    assert_eq!(rep[16] & 0x30, 0x10, "enhanced, not rejected: {rep:?}");
    assert_eq!(u16::from_be_bytes([rep[18], rep[19]]), 4);
    let ird = u16::from_be_bytes([rep[20], rep[21]]);
    let ord = u16::from_be_bytes([rep[22], rep[23]]);
    let (p, rtr) = (ird & 0x8000 != 0, ord & 0xc000);
    if p {
        assert!(
            rtr == 0x8000 || rtr == 0x4000,
            "P2P echoed: exactly one offered RTR type must be chosen (ORD word {ord:#06x})"
        );
        eprintln!("soft responder: P2P echoed, RTR {rtr:#06x}");
    } else {
        assert_eq!(rtr, 0, "RTR chosen without P (ORD word {ord:#06x})");
        eprintln!("soft responder: P2P not supported (known gap vs siw peer_to_peer=Y)");
    }
    drop(t);
    // No RTR follows: our server must see the connection go, not hang.
    let (code, out) = s.finish();
    assert_eq!(code, Some(1), "{out}");
    assert!(out.contains("FAILED after 0 iterations"), "{out}");
}
