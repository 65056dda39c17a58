//! The real client (`lwio_client::Client` / `File`, both completion modes)
//! against a malicious server (issue 18).
//!
//! Design: the side channel is the real one (`LocalServer`: login, Open,
//! Negotiate, the session secret), so the client's discovery and
//! authentication are exactly what they are in production; only the RDMA
//! address its negotiate answer advertises is replaced by a malicious
//! listener (`common::malicious`). That listener runs proto's `ServerConn`
//! for AUTH, REGISTER and credits (signed with the real session secret, so
//! the client accepts it), and hands every READ / WRITE to the case's
//! script, which serves it honestly or attacks with hand-crafted RDMA
//! Writes and status messages built from the keys in the client's own
//! requests. Nothing on the client side is hand-written: the windows under
//! attack are the ones `client/engine.rs` binds.
//!
//! Reads go into a `RegisteredBuf` of four pages filled with a guard
//! pattern, into the sub-range `PAGE..2*PAGE` (or `PAGE..3*PAGE` for two
//! requests): the read window lies inside the same registered region as the
//! guard bytes around it, so "before" and "past" the window are client
//! memory a missing check would expose. Each case asserts
//!
//! 1. the client's memory outside what the protocol let the server write
//!    is unchanged byte for byte (the whole buffer, compared with a copy);
//! 2. the refusal: the malicious server's QP received exactly one
//!    Terminate from the client's provider with the expected protection
//!    code and ended in the error state (iWARP completes an RDMA Write
//!    locally once sent, so the Terminate is the refusal);
//! 3. the client call's result: the exact error variant and errno (an
//!    attack that breaks the connection fails the call with
//!    `ConnectionLost`, EIO), bounded in time (each call runs on a thread
//!    the test waits for at most `BOUND`), no panic.
//!
//! `cargo test` runs both ends on the soft provider. The RDMA VM suite runs
//! the same binary on kernel rxe and siw (`LWIO_MALICIOUS_PROVIDER=verbs`,
//! `LWIO_MALICIOUS_DEVICE`, `LWIO_MALICIOUS_IP`: `common::malicious::
//! Transport`), where the windows under attack are the verbs provider's
//! (rxe: memory windows; siw: its per-request registrations). A verbs
//! device does not say which Terminate (iWARP) or NAK (RoCE) it sent, so
//! there 2. is "the malicious server's QP ended in the error state" and 3.
//! names no code; 1. is the same byte-for-byte comparison.

use std::ops::Range;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use lwio_client::{
    Client, ClientOptions, Completion, Error, File, OpenOptions, ProviderChoice, RegisteredBuf,
};
use lwio_proto::status::*;
use lwio_rdma::{QpState, WcStatus};
use lwio_server::config::Limits;
use lwio_server::io_phase::driver::RdmaServerOptions;
use lwio_server::io_phase::testkit::LocalServer;

mod common;
use common::malicious::{
    file_byte, status_block, status_msg, Evil, Io, MaliciousServer, Report, Transport,
};

const TOKEN: &str = "malicious-server-token-0123456789";
const PAGE: usize = 4096;
const GUARD: u8 = 0xA5;
const EVIL: u8 = 0xE1;
/// The client's per-request timeout.
const OP_TIMEOUT: Duration = Duration::from_secs(3);
/// No client call may take longer than this.
const BOUND: Duration = Duration::from_secs(20);
/// Terminate codes (`layer << 12 | etype << 8 | ecode`, RFC 5040 §7): DDP
/// tagged buffer, base or bounds violation / invalid STag.
const TERM_BOUNDS: u32 = 0x1101;
const TERM_INVALID_STAG: u32 = 0x1100;

struct Env {
    s: LocalServer,
    _dir: tempfile::TempDir,
}

fn env() -> Env {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("f.bin"), vec![0u8; 64 * 1024]).unwrap();
    let s = LocalServer::start(
        dir.path(),
        "ex",
        TOKEN,
        Limits::default(),
        RdmaServerOptions::default(),
    )
    .unwrap();
    Env { s, _dir: dir }
}

/// A case: the malicious server with `script`, the real client connected
/// to it in `mode`, the file open, a guarded registered buffer.
struct Case {
    evil: MaliciousServer,
    client: Client,
    file: Option<File>,
    buf: Option<RegisteredBuf>,
    _env: Env,
}

fn case(mode: Completion, script: impl FnMut(&mut Evil, &Io) + Send + 'static) -> Case {
    let env = env();
    let evil = MaliciousServer::start(&env.s.state, Box::new(script));
    let tr = Transport::from_env();
    let client = Client::connect(
        &format!("lwio://{}/ex", env.s.side_addr),
        Some(TOKEN),
        ClientOptions {
            completion: mode,
            credits: 4,
            read_chunk: PAGE,
            op_timeout: OP_TIMEOUT,
            connect_timeout: Duration::from_secs(5),
            provider: if tr.is_soft() {
                ProviderChoice::Soft
            } else {
                ProviderChoice::Verbs
            },
            device: tr.device,
            ..ClientOptions::default()
        }
        .no_tls(),
    )
    .unwrap();
    assert_eq!(client.completion(), mode);
    let file = client.open("f.bin", &OpenOptions::read_write()).unwrap();
    let mut buf = client.register_buffer(4 * PAGE).unwrap();
    buf.fill(GUARD);
    Case {
        evil,
        client,
        file: Some(file),
        buf: Some(buf),
        _env: env,
    }
}

impl Case {
    /// `file.read_registered(&mut buf, r, off)` on a thread (the windows
    /// over the buffer's cached registration), waited for at most `BOUND`:
    /// (result, time taken).
    fn read(&mut self, r: Range<usize>, off: u64) -> (lwio_client::Result<usize>, Duration) {
        let (file, mut buf) = (self.file.take().unwrap(), self.buf.take().unwrap());
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let t = Instant::now();
            let res = file.read_registered(&mut buf, r, off);
            let _ = tx.send((file, buf, res, t.elapsed()));
        });
        let (file, buf, res, took) = rx.recv_timeout(BOUND).expect("the client call hung");
        self.file = Some(file);
        self.buf = Some(buf);
        (res, took)
    }

    /// A read of `len` bytes into plain (unregistered) memory filled with
    /// the guard: staged in the engine's memory and copied out. (result,
    /// time taken, the memory afterwards).
    fn read_staged(
        &mut self,
        len: usize,
        off: u64,
    ) -> (lwio_client::Result<usize>, Duration, Vec<u8>) {
        let file = self.file.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut v = vec![GUARD; len];
            let t = Instant::now();
            let res = file.read_at(&mut v, off);
            let _ = tx.send((file, res, t.elapsed(), v));
        });
        let (file, res, took, v) = rx.recv_timeout(BOUND).expect("the client call hung");
        self.file = Some(file);
        (res, took, v)
    }

    fn write(&mut self, data: Vec<u8>, off: u64) -> (lwio_client::Result<usize>, Duration) {
        let file = self.file.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let t = Instant::now();
            let res = file.write_at(&data, off);
            let _ = tx.send((file, res, t.elapsed()));
        });
        let (file, res, took) = rx.recv_timeout(BOUND).expect("the client call hung");
        self.file = Some(file);
        (res, took)
    }

    fn mem(&self) -> Vec<u8> {
        self.buf.as_ref().unwrap().to_vec()
    }

    /// The attack was refused: the call `r` failed at once (`assert_lost`),
    /// the malicious server got one Terminate with `code`, and the client's
    /// memory is `want` byte for byte. The server's report.
    fn refused(
        self,
        what: &str,
        (r, took): (lwio_client::Result<usize>, Duration),
        code: u32,
        want: &[u8],
    ) -> Report {
        assert_lost(what, &r, took, code);
        let (rep, mem) = self.finish();
        assert_same(what, &mem, want);
        assert_refused(what, &rep, code);
        rep
    }

    /// The malicious server's report once its connection ended.
    fn finish(self) -> (Report, Vec<u8>) {
        let mem = self.mem();
        let Case {
            evil, client, file, ..
        } = self;
        let report = evil.finish(Duration::from_secs(5));
        drop((file, client));
        (report, mem)
    }
}

/// The memory a read into `r` must leave: guard everywhere, `data` in
/// `r` if given.
fn guarded(r: Range<usize>, data: Option<&[u8]>) -> Vec<u8> {
    let mut v = vec![GUARD; 4 * PAGE];
    if let Some(d) = data {
        v[r].copy_from_slice(d);
    }
    v
}

fn file_data(off: u64, len: usize) -> Vec<u8> {
    (0..len as u64).map(|i| file_byte(off + i)).collect()
}

fn assert_same(what: &str, got: &[u8], want: &[u8]) {
    if let Some(i) = (0..want.len()).find(|&i| got[i] != want[i]) {
        panic!(
            "{what}: client memory changed at byte {i} (page {}, offset {}): {:#04x}, want {:#04x}",
            i / PAGE,
            i % PAGE,
            got[i],
            want[i]
        );
    }
}

/// The call failed because the client refused the server's access and
/// closed the connection: the exact variant, a message that says so (with
/// the Terminate `code` the client sent), its errno, in time.
fn assert_lost(what: &str, r: &lwio_client::Result<usize>, took: Duration, code: u32) {
    if !device_reports(code) {
        // The device refused the access (the memory checks and the
        // malicious QP's state say so) but did not tell the client, which
        // took the failed connection for a lost server and tried to
        // reconnect (new windows; the malicious listener takes no second
        // connection): the call fails, in bounded time.
        eprintln!("{what}: the call failed in {took:?}: {r:?}");
        match r {
            Err(e @ (Error::ConnectionLost(_) | Error::TimedOut(_))) => {
                let errno = lwio_client::errno::client(e);
                assert!(
                    errno == libc::EIO || errno == libc::ETIMEDOUT,
                    "{what}: errno {errno}"
                );
            }
            other => panic!("{what}: expected the connection lost, got {other:?}"),
        }
        assert!(took < BOUND, "{what}: took {took:?}");
        return;
    }
    match r {
        Err(e @ Error::ConnectionLost(m)) => {
            eprintln!("{what}: the call failed in {took:?}: {e}");
            // The soft provider tells the client which Terminate it sent
            // (`Qp::terminate_sent`); a verbs device only that it refused
            // an access (`Qp::device_refusal`, its async event).
            let how = if Transport::from_env().is_soft() {
                format!("(iWARP Terminate {code:#06x})")
            } else {
                "(the RDMA device reported a local access violation)".to_string()
            };
            assert!(
                m.starts_with("the server tried to write client memory it was not given")
                    && m.ends_with(&format!(
                        "the client refused it and closed the connection {how}"
                    )),
                "{what}: message {m:?}"
            );
            assert_eq!(lwio_client::errno::client(e), libc::EIO, "{what}: errno");
            assert_eq!(
                std::io::Error::from(e.clone()).kind(),
                std::io::ErrorKind::ConnectionAborted
            );
        }
        other => panic!("{what}: expected ConnectionLost, got {other:?}"),
    }
    assert!(
        took < OP_TIMEOUT,
        "{what}: the refusal took {took:?} (it must not wait for the timeout)"
    );
}

/// Whether the client learns that its provider refused the access with
/// Terminate `code`: always on the soft provider; on a verbs device only
/// where the kernel raises `IBV_EVENT_QP_ACCESS_ERR` for it — siw, for an
/// access outside a key's range (measured on Debian's 6.1 kernel: siw
/// raises nothing for an invalid key, rxe nothing at all).
fn device_reports(code: u32) -> bool {
    let tr = Transport::from_env();
    tr.is_soft()
        || (code == TERM_BOUNDS && tr.device.as_deref().is_some_and(|d| d.starts_with("siw")))
}

/// The malicious server got exactly one Terminate, with `code` (soft
/// provider; a verbs device does not say), and its QP is in error.
fn assert_refused(what: &str, rep: &Report, code: u32) {
    eprintln!("{what}: malicious server {rep:?}");
    if let Some(n) = rep.term_recv {
        assert_eq!(n, 1, "{what}: one Terminate from the client");
        assert_eq!(
            rep.last_term, code,
            "{what}: Terminate code {:#06x}, want {code:#06x}",
            rep.last_term
        );
    }
    assert_eq!(
        rep.qp_state,
        QpState::Error,
        "{what}: malicious QP in error"
    );
}

/// Nothing the malicious server did was refused: no Terminate (soft), and
/// none of its own writes and sends completed with a remote error (RoCE
/// reports a refusal there; its QP may still end in error when the client
/// hangs up).
fn assert_nothing_refused(what: &str, rep: &Report) {
    eprintln!("{what}: malicious server {rep:?}");
    assert_eq!(rep.term_recv.unwrap_or(0), 0, "{what}: a Terminate");
    assert!(
        rep.evil_wcs.iter().all(|w| !matches!(
            w.status,
            WcStatus::RemAccessErr | WcStatus::RemInvReqErr | WcStatus::RemOpErr
        )),
        "{what}: refused by the client"
    );
}

const MODES: [Completion; 2] = [Completion::Interrupt, Completion::Poll];

// ----------------------------------------------------------------- cases

/// An RDMA Write that starts one byte before the read's window (16 bytes:
/// the byte before and 15 inside), with the read's own key; into a
/// registered buffer (the window is a sub-range of it) and into plain
/// memory (the window is the engine's staging slot; the caller's buffer
/// must come back untouched).
#[test]
fn write_before_the_read_window() {
    for mode in MODES {
        for staged in [false, true] {
            let what = format!("{mode:?}, staged {staged}: write at DataVa - 1");
            let mut c = case(mode, |ev, io| {
                assert!(!io.write);
                ev.write(io.data_va - 1, io.data_mh, &[EVIL; 16]);
            });
            let call = if staged {
                let (r, took, v) = c.read_staged(PAGE, 0);
                assert_same(&what, &v, &[GUARD; PAGE]);
                (r, took)
            } else {
                c.read(PAGE..2 * PAGE, 0)
            };
            c.refused(&what, call, TERM_BOUNDS, &guarded(PAGE..2 * PAGE, None));
        }
    }
}

/// One byte just past the window (DataVa + Length), and Length + 1 bytes
/// from DataVa. For the second the bytes inside the window are the
/// server's to write (they may or may not have landed before the refusal
/// of the segment that crosses the end); the byte past it never changes.
#[test]
fn write_past_the_read_window() {
    for mode in MODES {
        for overrun in [false, true] {
            let what = format!(
                "{mode:?}: {}",
                if overrun {
                    "Length + 1 bytes at DataVa"
                } else {
                    "one byte at DataVa + Length"
                }
            );
            let mut c = case(mode, move |ev, io| {
                if overrun {
                    ev.write(io.data_va, io.data_mh, &vec![EVIL; io.length as usize + 1]);
                } else {
                    ev.write(io.data_va + u64::from(io.length), io.data_mh, &[EVIL]);
                }
            });
            let (r, took) = c.read(PAGE..2 * PAGE, 0);
            assert_lost(&what, &r, took, TERM_BOUNDS);
            let (rep, mem) = c.finish();
            let mut want = guarded(PAGE..2 * PAGE, None);
            if overrun && mem[PAGE..2 * PAGE] != want[PAGE..2 * PAGE] {
                // Placed inside the window before the crossing segment.
                eprintln!("{what}: part of the window was written before the refusal");
                want[PAGE..2 * PAGE].copy_from_slice(&mem[PAGE..2 * PAGE]);
                assert!(mem[PAGE..2 * PAGE].iter().all(|&b| b == EVIL || b == GUARD));
            }
            assert_same(&what, &mem, &want);
            assert_refused(&what, &rep, TERM_BOUNDS);
        }
    }
}

/// A first read is served honestly; while the second (same range) is
/// outstanding the server writes through the *first* read's key, which
/// the client invalidated when that read completed.
#[test]
fn replayed_key_of_a_completed_read() {
    for mode in MODES {
        let what = format!("{mode:?}: first read's key replayed");
        let mut c = case(mode, |ev, io| {
            if io.n == 0 {
                ev.honest(io);
            } else {
                let first = ev.seen[0].clone();
                ev.write(first.data_va, first.data_mh, &vec![EVIL; PAGE]);
            }
        });
        let (r, _) = c.read(PAGE..2 * PAGE, 0);
        assert_eq!(r, Ok(PAGE), "{what}: the honest first read");
        let first = guarded(PAGE..2 * PAGE, Some(&file_data(0, PAGE)));
        assert_same(&what, &c.mem(), &first);
        let call = c.read(PAGE..2 * PAGE, 8 * PAGE as u64);
        c.refused(&what, call, TERM_INVALID_STAG, &first);
    }
}

/// Polling: a first read (and, separately, a first write) is served
/// honestly; while the second is outstanding the server writes a
/// successful status block through the first request's status-block key
/// (whose slot the client uses again only after that key's invalidation
/// completed, under a new key).
#[test]
fn replayed_status_block_key_of_a_completed_request() {
    for write in [false, true] {
        let what = format!(
            "Poll: status key of a completed {} replayed",
            if write { "write" } else { "read" }
        );
        let mut c = case(Completion::Poll, |ev, io| {
            if io.n == 0 {
                ev.honest(io);
            } else {
                let (va, key) = ev.seen[0].ios();
                // The slot serves again only once its old window's
                // invalidation completed, and then under a new key; the
                // old key reaches nothing either way.
                if io.ios().0 == va {
                    assert_ne!(io.ios().1, key, "reused under the old key");
                }
                ev.write(va, key, &status_block(io.length, STATUS_SUCCESS));
            }
        });
        let (call, want) = if write {
            assert_eq!(c.write(vec![1; 100], 0).0, Ok(100), "{what}: first write");
            (c.write(vec![2; 100], 0), guarded(PAGE..2 * PAGE, None))
        } else {
            assert_eq!(c.read(PAGE..2 * PAGE, 0).0, Ok(PAGE), "{what}: first read");
            let want = guarded(PAGE..2 * PAGE, Some(&file_data(0, PAGE)));
            (c.read(PAGE..2 * PAGE, PAGE as u64), want)
        };
        c.refused(&what, call, TERM_INVALID_STAG, &want);
    }
}

/// Polling, two reads outstanding: the server completes the second one by
/// writing its status block through the *first* one's status-block key
/// (the address is the second's own IosVa, one slot away).
#[test]
fn forged_status_block_of_another_outstanding_request() {
    let what = "Poll: second request's status block through the first's key";
    let mut c = case(Completion::Poll, |ev, io| {
        if io.n == 1 {
            let (_, first_key) = ev.seen[0].ios();
            let (second_va, _) = io.ios();
            ev.write(
                second_va,
                first_key,
                &status_block(io.length, STATUS_SUCCESS),
            );
        }
    });
    let call = c.read(PAGE..3 * PAGE, 0);
    let rep = c.refused(what, call, TERM_BOUNDS, &guarded(PAGE..3 * PAGE, None));
    assert_eq!(rep.ios, 2, "both reads were outstanding");
}

/// "Too early": the server completes a read (status block through its own
/// key, or status message) before writing any data, then — after the call
/// returned — writes the data through the read's key. The call returns the
/// count the server claimed (it cannot tell), with its buffer exactly as it
/// was; the late write is refused and changes nothing; the next call fails.
#[test]
fn completion_before_the_data() {
    for mode in MODES {
        let what = format!("{mode:?}: completion before the data");
        let mut c = case(mode, |ev, io| {
            if io.n > 0 {
                return;
            }
            ev.complete(io, io.length, STATUS_SUCCESS);
            ev.wait_go();
            ev.write(io.data_va, io.data_mh, &Evil::data_of(io));
        });
        let (r, _) = c.read(PAGE..2 * PAGE, 0);
        assert_eq!(r, Ok(PAGE), "{what}: the server's word");
        let before = guarded(PAGE..2 * PAGE, None);
        assert_same(&what, &c.mem(), &before);
        c.evil.go();
        // Let the late write arrive (it is refused at once).
        std::thread::sleep(Duration::from_millis(200));
        let call = c.read(2 * PAGE..3 * PAGE, 0);
        c.refused(&what, call, TERM_INVALID_STAG, &before);
    }
}

/// A status that claims more than was asked (Information = u32::MAX) after
/// honest data: the call reports the requested length, nothing outside the
/// window changes, and no write was refused (none was out of bounds).
#[test]
fn completion_claiming_more_than_requested() {
    for mode in MODES {
        let what = format!("{mode:?}: Information = u32::MAX");
        let mut c = case(mode, |ev, io| {
            ev.write(io.data_va, io.data_mh, &Evil::data_of(io));
            ev.complete(io, u32::MAX, STATUS_SUCCESS);
        });
        let (r, _) = c.read(PAGE..2 * PAGE, 0);
        assert_eq!(r, Ok(PAGE), "{what}: clamped to the request");
        let want = guarded(PAGE..2 * PAGE, Some(&file_data(0, PAGE)));
        let (rep, mem) = c.finish();
        assert_same(&what, &mem, &want);
        assert_nothing_refused(&what, &rep);
    }
}

/// Interrupt mode: while a read is outstanding the server sends status
/// responses for requests that are not outstanding — the completed first
/// read's cookie (a replay) and a cookie never issued — and never completes
/// the read. Neither completes it (the protocol ignores unknown cookies,
/// docs/protocol.md §9); the call fails with `TimedOut` (ETIMEDOUT) at the
/// client's request timeout, and the buffer is unchanged.
#[test]
fn completion_for_a_request_not_outstanding() {
    let what = "Interrupt: completions for requests not outstanding";
    let mut c = case(Completion::Interrupt, |ev, io| {
        if io.n == 0 {
            return ev.honest(io);
        }
        let old = ev.seen[0].cookie();
        ev.send(&status_msg(old, io.length, STATUS_SUCCESS));
        ev.send(&status_msg(
            io.cookie().wrapping_add(1000),
            io.length,
            STATUS_SUCCESS,
        ));
    });
    assert_eq!(c.read(PAGE..2 * PAGE, 0).0, Ok(PAGE), "{what}: first read");
    let first = guarded(PAGE..2 * PAGE, Some(&file_data(0, PAGE)));
    let received = c.client.stats().interrupt_completions;
    let (r, took) = c.read(PAGE..2 * PAGE, 4 * PAGE as u64);
    assert!(
        c.client.stats().interrupt_completions >= received + 2,
        "{what}: both forged completions reached the client"
    );
    match &r {
        Err(e @ Error::TimedOut(_)) => {
            eprintln!("{what}: the call failed in {took:?}: {e}");
            assert_eq!(lwio_client::errno::client(e), libc::ETIMEDOUT);
        }
        other => panic!("{what}: expected TimedOut, got {other:?}"),
    }
    assert!(took >= OP_TIMEOUT && took < OP_TIMEOUT + Duration::from_secs(3));
    let (rep, mem) = c.finish();
    assert_same(what, &mem, &first);
    assert_nothing_refused(what, &rep);
}
