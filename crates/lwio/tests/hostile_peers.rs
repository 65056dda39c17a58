//! Hostile peers beyond `e2e_hostile.rs`: a Fid used from another
//! connection, a server writing outside the one-shot window it was given,
//! 10 000 unauthenticated RDMA-side connections, the per-host cap on the
//! RDMA listener, and truncated / oversized
//! messages at every layer (LWIO, MPA, FPDU, side channel).
//!
//! Each case asserts what must happen, and a well-behaved client keeps being
//! served after it; its acknowledged writes read back byte for byte at the
//! end. Helpers are small copies of those in `e2e_hostile.rs`.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use lwio_client::{Client, ClientOptions, Completion, File, OpenOptions};
use lwio_proto::status::*;
use lwio_proto::wire::common::RequestOp;
use lwio_proto::wire::{Guid, RequestRepr, COMMON_HEADER_LEN};
use lwio_rdma::*;
use lwio_server::config::Limits;
use lwio_server::io_phase::driver::RdmaServerOptions;
use lwio_server::io_phase::testkit::LocalServer;

mod common;
use common::hostile::{connect, intr, req_bytes, Hostile};

const TOKEN: &str = "hostile-peers-token-0123456789";
const T: Duration = Duration::from_secs(5);
const AUTH_TIMEOUT: Duration = Duration::from_millis(400);
const MPA_TIMEOUT: Duration = Duration::from_millis(1000);

/// The tests share one process; the flood measures RSS, so run one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

// ------------------------------------------------------------- environment

struct Env {
    s: LocalServer,
    dir: tempfile::TempDir,
    good: File,
    _good_client: Client,
    /// What the good client has had acknowledged: the file's content.
    model: Vec<u8>,
    round: u32,
}

fn env() -> Env {
    env_with(|_| {})
}

/// [`env`] with the RDMA options adjusted by `adjust`.
fn env_with(adjust: impl FnOnce(&mut RdmaServerOptions)) -> Env {
    common::init_logging();
    let dir = tempfile::tempdir().unwrap();
    let model: Vec<u8> = (0..200_000u32).map(|i| (i * 13 + i / 97) as u8).collect();
    std::fs::write(dir.path().join("good.bin"), &model).unwrap();
    std::fs::write(dir.path().join("other.bin"), vec![0x5a; 4096]).unwrap();
    let proto = lwio_proto::server::ServerConfig {
        auth_timeout: AUTH_TIMEOUT,
        ..Default::default()
    };
    let mut rdma = RdmaServerOptions {
        auto_credits: false,
        proto,
        ..RdmaServerOptions::default()
    };
    rdma.rdma.connect_timeout = MPA_TIMEOUT;
    adjust(&mut rdma);
    let limits = Limits {
        login_timeout: Duration::from_secs(1),
        max_connections_per_host: 1024,
        max_unauthenticated: 1024,
        unauth_rate_per_host: 10_000,
        unauth_burst_per_host: 10_000,
        unauth_rate: 10_000,
        unauth_burst: 10_000,
        ..Limits::default()
    };
    let s = LocalServer::start(dir.path(), "ex", TOKEN, limits, rdma).unwrap();
    let c = Client::connect(
        &format!("lwio://{}/ex", s.side_addr),
        Some(TOKEN),
        ClientOptions {
            completion: Completion::Interrupt,
            ..ClientOptions::default()
        }
        .no_tls(),
    )
    .unwrap();
    let good = c.open("good.bin", &OpenOptions::read_write()).unwrap();
    Env {
        s,
        dir,
        good,
        _good_client: c,
        model,
        round: 0,
    }
}

impl Env {
    /// The well-behaved client writes (acknowledged) and reads back, byte
    /// for byte, within a bound.
    fn check_good(&mut self) {
        let t = Instant::now();
        self.round += 1;
        let off = (self.round as usize * 7_919) % 150_000;
        let chunk: Vec<u8> = (0..3_001u32)
            .map(|i| (i as u8) ^ (self.round as u8).wrapping_mul(31))
            .collect();
        assert_eq!(self.good.write_at(&chunk, off as u64).unwrap(), chunk.len());
        self.model[off..off + chunk.len()].copy_from_slice(&chunk);
        let mut b = vec![0u8; 40_001];
        let roff = off.saturating_sub(10_000);
        assert_eq!(self.good.read_at(&mut b, roff as u64).unwrap(), b.len());
        assert_eq!(&b[..], &self.model[roff..roff + b.len()]);
        assert!(
            t.elapsed() < Duration::from_secs(3),
            "good client served in {:?}",
            t.elapsed()
        );
    }

    /// Every acknowledged write reads back, over RDMA and on disk.
    fn final_check(mut self) {
        self.check_good();
        let mut b = vec![0u8; self.model.len()];
        assert_eq!(self.good.read_at(&mut b, 0).unwrap(), b.len());
        assert!(b == self.model, "acknowledged writes lost (RDMA read)");
        let disk = std::fs::read(self.dir.path().join("good.bin")).unwrap();
        assert!(disk == self.model, "acknowledged writes lost (disk)");
    }
}

// ---------------------------------------------------------- hostile client

/// A raw RDMA connection plus a logged-in side channel.
fn hostile(s: &LocalServer) -> Hostile {
    connect(s, TOKEN, Guid::from_u128(9))
}

impl Hostile {
    fn auth(&mut self) {
        self.auth_ok(4);
    }

    fn status_of(&self, op: RequestOp<'_>) -> NtStatus {
        self.send_req(op);
        self.recv_status(T).expect("answered").ios.status
    }
}

// ------------------------------------------------------------------ case 1

/// A Fid of another connection means nothing here: READ, WRITE and CLOSE
/// on it get INVALID_HANDLE (docs/protocol.md 5.x: an unknown Fid), and the
/// owner's file and Fid are untouched.
#[test]
fn fid_from_another_connection() {
    let _g = serial();
    let mut e = env();
    e.check_good();
    let f = e.good.fid();
    let mut h = hostile(&e.s);
    h.auth();
    // B also has a file of its own open on the side channel (not registered
    // over RDMA), so its session is a real one with rights.
    let o = lwio_side::types::OpenOptions {
        read: true,
        write: true,
        ..Default::default()
    };
    let _rk = h.side.open("ex", "other.bin", &o, 0).unwrap();
    assert_eq!(
        h.status_of(RequestOp::Read {
            fid: f,
            offset: 0,
            length: 100,
            data_va: h.mem.addr(),
            data_mh: h.mem.rkey(),
            mode: intr(5),
        }),
        STATUS_INVALID_HANDLE,
        "READ on a foreign Fid"
    );
    let junk = [0xEEu8; 100];
    assert_eq!(
        h.status_of(RequestOp::Write {
            fid: f,
            offset: 0,
            data: &junk,
            mode: intr(6),
        }),
        STATUS_INVALID_HANDLE,
        "WRITE on a foreign Fid"
    );
    assert_eq!(
        h.status_of(RequestOp::Close { fid: f, cookie: 7 }),
        STATUS_INVALID_HANDLE,
        "CLOSE on a foreign Fid"
    );
    // The hostile connection itself is still usable (a status, not a
    // protocol violation), and nothing reached A's file.
    assert_eq!(
        h.status_of(RequestOp::Read {
            fid: f,
            offset: 0,
            length: 1,
            data_va: h.mem.addr(),
            data_mh: h.mem.rkey(),
            mode: intr(8),
        }),
        STATUS_INVALID_HANDLE
    );
    assert_eq!(e.good.fid(), f);
    e.check_good();
    e.final_check();
}

// ------------------------------------------------------------------ case 2

/// What the malicious server does with the window it was given.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Attack {
    BeforeWindow,
    PastWindow,
    SecondWrite,
    AfterInvalidate,
}

const PAGE: usize = 4096;
const FILL: u8 = 0xA5;
const LEGIT: u8 = 0x3C;
const EVIL: u8 = 0xE1;

/// One connection between a hand-rolled LWIO client (one-shot window
/// bound for one READ, as `client/engine.rs` does) and a malicious server.
/// Returns (client memory, client QP state, server's completions of the bad
/// write, server QP state).
fn window_attack(attack: Attack) -> (Vec<u8>, QpState, Vec<WcStatus>, QpState) {
    let sctx = provider("soft")
        .unwrap()
        .open(None, &Config::default())
        .unwrap();
    let listener = sctx.listen("127.0.0.1:0".parse().unwrap(), 4).unwrap();
    let addr = listener.local_addr();
    let server = std::thread::spawn(move || {
        let pd = sctx.alloc_pd().unwrap();
        let cq = sctx.create_cq(64, None).unwrap();
        let init = QpInit {
            pd: pd.clone(),
            send_cq: cq.clone(),
            recv_cq: cq.clone(),
            cap: QpCap::default(),
            sq_sig_all: true,
            recv_window: None,
            srq: None,
        };
        let req = listener.get_request(Some(T)).unwrap().expect("a client");
        let rmr = pd.alloc_mr(4096, Access::LOCAL_WRITE).unwrap();
        let smr = pd.alloc_mr(2 * PAGE + 64, Access::LOCAL_WRITE).unwrap();
        let qp = req
            .accept_with_recvs(
                &init,
                &ConnParams::default(),
                &[
                    RecvWr {
                        wr_id: 76,
                        sg_list: &[rmr.sge(0, 2048)],
                    },
                    RecvWr {
                        wr_id: 77,
                        sg_list: &[rmr.sge(2048, 2048)],
                    },
                ],
            )
            .unwrap();
        let mut wc = [Wc::BLANK; 8];
        let t = Instant::now();
        // Wait for the READ request and parse it as a server would. The
        // client's "go" (AfterInvalidate) can arrive in the same poll batch
        // as the request: remember it, or it is lost with the batch.
        let (va, mh, len, go_seen) = loop {
            assert!(t.elapsed() < T, "no request from the client");
            let n = cq.poll(&mut wc).unwrap();
            let recvs = wc[..n]
                .iter()
                .filter(|w| w.opcode == WcOpcode::Recv)
                .count();
            if let Some(w) = wc[..n].iter().find(|w| w.opcode == WcOpcode::Recv) {
                assert!(w.is_ok());
                let mut b = vec![0u8; w.byte_len as usize];
                rmr.read_at(0, &mut b).unwrap();
                let r = RequestRepr::parse(&b).unwrap();
                match r.op {
                    RequestOp::Read {
                        data_va,
                        data_mh,
                        length,
                        ..
                    } => break (data_va, data_mh, length as u64, recvs > 1),
                    other => panic!("unexpected {other:?}"),
                }
            }
            std::thread::sleep(Duration::from_millis(1));
        };
        smr.fill(0, PAGE, LEGIT).unwrap();
        smr.fill(PAGE, PAGE + 64, EVIL).unwrap();
        let write = |wr_id: u64, off: usize, n: u32, remote: u64| {
            let _ = qp.post_send(&[SendWr::new(
                wr_id,
                SendOp::Write {
                    remote_addr: remote,
                    rkey: mh,
                },
                &[smr.sge(off, n)],
            )]);
        };
        match attack {
            Attack::BeforeWindow => write(1, PAGE, 16, va - 1),
            Attack::PastWindow => write(1, PAGE, 1, va + len),
            Attack::SecondWrite => {
                write(1, 0, len as u32, va);
                // Let the first one complete before the second.
                let mut done = Vec::new();
                let t = Instant::now();
                while done.is_empty() && t.elapsed() < T {
                    let n = cq.poll(&mut wc).unwrap();
                    done.extend(wc[..n].iter().filter(|w| w.wr_id == 1).map(|w| w.status));
                    std::thread::sleep(Duration::from_millis(1));
                }
                assert_eq!(done, vec![WcStatus::Success], "the legitimate write");
                std::thread::sleep(Duration::from_millis(50));
                write(2, PAGE, len as u32, va);
            }
            Attack::AfterInvalidate => {
                // The client invalidates, then tells us (a second send).
                let t = Instant::now();
                let mut go = go_seen;
                while !go {
                    assert!(t.elapsed() < T, "no go from the client");
                    let n = cq.poll(&mut wc).unwrap();
                    go = wc[..n].iter().any(|w| w.opcode == WcOpcode::Recv);
                    if !go {
                        std::thread::sleep(Duration::from_millis(1));
                    }
                }
                write(2, PAGE, len as u32, va);
            }
        }
        // Collect the write completions until the QP dies or they all came.
        let want = match attack {
            Attack::SecondWrite | Attack::AfterInvalidate => 2,
            _ => 1,
        };
        let mut st = Vec::new();
        let t = Instant::now();
        while t.elapsed() < T {
            let n = cq.poll(&mut wc).unwrap_or(0);
            st.extend(wc[..n].iter().filter(|w| w.wr_id == want).map(|w| w.status));
            if !st.is_empty() && qp.state() == QpState::Error {
                break;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        (st, qp.state())
    });

    // The hand-rolled client.
    let ctx = provider("soft")
        .unwrap()
        .open(None, &Config::default())
        .unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(64, None).unwrap();
    let init = QpInit {
        pd: pd.clone(),
        send_cq: cq.clone(),
        recv_cq: cq.clone(),
        cap: QpCap::default(),
        sq_sig_all: true,
        recv_window: None,
        srq: None,
    };
    let qp = ctx.connect(addr, &init, &ConnParams::default()).unwrap();
    let rmr = pd.alloc_mr(256, Access::LOCAL_WRITE).unwrap();
    qp.post_recv(&[RecvWr {
        wr_id: 500,
        sg_list: &[rmr.sge(0, 256)],
    }])
    .unwrap();
    let buf = pd
        .alloc_mr(
            3 * PAGE,
            Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::MW_BIND,
        )
        .unwrap();
    buf.fill(0, 3 * PAGE, FILL).unwrap();
    let mw = pd.alloc_mw().unwrap();
    let rkey = qp
        .bind_mw(
            &mw,
            &MwBind {
                mr: &buf,
                offset: PAGE as u64,
                length: PAGE as u64,
                access: Access::REMOTE_WRITE,
                one_shot: true,
            },
            300,
            true,
        )
        .unwrap();
    let smr = pd.alloc_mr(256, Access::LOCAL_WRITE).unwrap();
    let req = req_bytes(RequestOp::Read {
        fid: 1,
        offset: 0,
        length: PAGE as u32,
        data_va: buf.addr() + PAGE as u64,
        data_mh: rkey,
        mode: intr(1),
    });
    smr.write_at(0, &req).unwrap();
    qp.post_send(&[SendWr::new(
        301,
        SendOp::Send,
        &[smr.sge(0, req.len() as u32)],
    )])
    .unwrap();
    if attack == Attack::AfterInvalidate {
        qp.invalidate(rkey, 302, true).unwrap();
        // Wait for the invalidation to complete, then say "go".
        let mut wc = [Wc::BLANK; 8];
        let t = Instant::now();
        let mut ok = false;
        while !ok && t.elapsed() < T {
            let n = cq.poll(&mut wc).unwrap();
            ok = wc[..n].iter().any(|w| w.wr_id == 302 && w.is_ok());
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(ok, "local invalidate completed");
        qp.post_send(&[SendWr::new(303, SendOp::Send, &[smr.sge(0, 8)])])
            .unwrap();
    }
    let (st, server_state) = server.join().expect("malicious server thread");
    // The client sees the Terminate: its QP is in error (a clean error the
    // engine maps to a failed request), not a crash.
    let t = Instant::now();
    let mut wc = [Wc::BLANK; 8];
    while qp.state() != QpState::Error && t.elapsed() < T {
        let _ = cq.poll(&mut wc);
        std::thread::sleep(Duration::from_millis(2));
    }
    let mut mem = vec![0u8; 3 * PAGE];
    buf.read_at(0, &mut mem).unwrap();
    (mem, qp.state(), st, server_state)
}

/// A malicious server: writes outside the one-shot window, a second time
/// through it, and after the client invalidated it — all refused by the
/// provider (Terminate), the client's memory unchanged byte for byte.
#[test]
fn server_writes_outside_its_window() {
    let _g = serial();
    for attack in [
        Attack::BeforeWindow,
        Attack::PastWindow,
        Attack::SecondWrite,
        Attack::AfterInvalidate,
    ] {
        let (mem, state, st, server_state) = window_attack(attack);
        eprintln!("{attack:?}: server write completions {st:?}, server QP {server_state:?}");
        // iWARP completes an RDMA Write locally once sent; the refusal is
        // the Terminate from the client's provider: both QPs in error.
        assert_eq!(
            server_state,
            QpState::Error,
            "{attack:?}: the malicious server got a Terminate"
        );
        assert_eq!(state, QpState::Error, "{attack:?}: client QP in error");
        let inside = if attack == Attack::SecondWrite {
            LEGIT
        } else {
            FILL
        };
        assert!(
            mem[..PAGE].iter().all(|&b| b == FILL),
            "{attack:?}: memory before the window changed"
        );
        assert!(
            mem[PAGE..2 * PAGE].iter().all(|&b| b == inside),
            "{attack:?}: window content"
        );
        assert!(
            mem[2 * PAGE..].iter().all(|&b| b == FILL),
            "{attack:?}: memory after the window changed"
        );
    }
}

// ------------------------------------------------------------------ case 3

fn vm_rss_kib() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    s.lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap()
}

fn raise_nofile(want: u64) -> u64 {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    unsafe {
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut r);
        if r.rlim_cur < want {
            let n = libc::rlimit {
                rlim_cur: want,
                rlim_max: want.max(r.rlim_max),
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &n) == 0 {
                r = n;
            }
        }
    }
    r.rlim_cur
}

/// Closed by the peer: EOF or reset (never "would block").
fn peer_closed(s: &mut TcpStream) -> bool {
    let mut b = [0u8; 512];
    loop {
        match s.read(&mut b) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return false,
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => return false,
            Err(_) => return true,
        }
    }
}

/// Wait until every stream is closed by the peer; how many still open.
fn wait_all_closed(v: &mut [TcpStream], bound: Duration) -> usize {
    for s in v.iter() {
        s.set_nonblocking(true).unwrap();
    }
    let t = Instant::now();
    let mut open: Vec<usize> = (0..v.len()).collect();
    while !open.is_empty() && t.elapsed() < bound {
        open.retain(|&i| !peer_closed(&mut v[i]));
        if !open.is_empty() {
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    open.len()
}

/// An MPA rev 1 request without CRC, markers or private data.
fn mpa_request() -> Vec<u8> {
    let mut f = b"MPA ID Req Frame".to_vec();
    f.extend_from_slice(&[0, 1, 0, 0]);
    f
}

/// Complete the MPA handshake over plain TCP: the stream is then in FPDU
/// mode with an LWIO connection waiting for its AUTH on the server.
fn mpa_connect(addr: SocketAddr) -> std::io::Result<TcpStream> {
    match mpa_try(addr)? {
        (s, false) => Ok(s),
        (_, true) => Err(std::io::Error::other("MPA reject")),
    }
}

/// (stream, rejected): the server rejects with "busy" at its connection
/// limits (`RdmaServerOptions::max_connections`, `max_connections_per_host`).
fn mpa_try(addr: SocketAddr) -> std::io::Result<(TcpStream, bool)> {
    mpa_try_stream(TcpStream::connect_timeout(&addr, T)?)
}

/// A TCP connection to `dst` (IPv4) from source address `src`.
fn connect_from(src: std::net::Ipv4Addr, dst: SocketAddr) -> std::io::Result<TcpStream> {
    use std::os::fd::FromRawFd;
    let SocketAddr::V4(dst) = dst else {
        return Err(std::io::Error::other("IPv4 only"));
    };
    let sin = |ip: std::net::Ipv4Addr, port: u16| libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: port.to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from(ip).to_be(),
        },
        sin_zero: [0; 8],
    };
    // SAFETY: plain socket calls on a fresh fd, with valid sockaddr_in
    // pointers and lengths; the fd is owned by the TcpStream (or closed).
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let s = TcpStream::from_raw_fd(fd);
        let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
        let a = sin(src, 0);
        if libc::bind(fd, &a as *const _ as *const libc::sockaddr, len) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let b = sin(*dst.ip(), dst.port());
        if libc::connect(fd, &b as *const _ as *const libc::sockaddr, len) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(s)
    }
}

fn mpa_try_stream(mut s: TcpStream) -> std::io::Result<(TcpStream, bool)> {
    s.set_read_timeout(Some(T))?;
    s.write_all(&mpa_request())?;
    let mut h = [0u8; 20];
    s.read_exact(&mut h)?;
    if &h[..16] != b"MPA ID Rep Frame" {
        return Err(std::io::Error::other(format!("MPA reply {h:?}")));
    }
    let pd = u16::from_be_bytes([h[18], h[19]]) as usize;
    let mut p = vec![0u8; pd];
    s.read_exact(&mut p)?;
    Ok((s, h[16] & 0x20 != 0))
}

const FLOOD: usize = 10_000;
/// Documented bound on the server process's RSS growth under the flood.
const RSS_BOUND_KIB: u64 = 64 * 1024;

/// 10 000 TCP connections to the RDMA listener that never finish MPA: the
/// good client keeps being served within 3 s, RSS grows less than 64 MiB,
/// and every half-open connection is closed by the server after the MPA
/// timeout (1 s here).
#[test]
fn ten_thousand_half_open_rdma_connections() {
    let _g = serial();
    let lim = raise_nofile(3 * FLOOD as u64 + 4096);
    assert!(
        lim >= FLOOD as u64 + 2048,
        "RLIMIT_NOFILE {lim}: cannot hold the flood"
    );
    let mut e = env();
    e.check_good();
    let rss0 = vm_rss_kib();
    let addr = e.s.rdma_addr;
    let t = Instant::now();
    let mut flood = Vec::with_capacity(FLOOD);
    let mut refused = 0usize;
    let mut peak = rss0;
    for i in 0..FLOOD {
        match TcpStream::connect_timeout(&addr, T) {
            Ok(s) => flood.push(s),
            Err(_) => refused += 1,
        }
        if i % 2_000 == 1_999 {
            e.check_good();
            peak = peak.max(vm_rss_kib());
        }
    }
    let opened = flood.len();
    e.check_good();
    peak = peak.max(vm_rss_kib());
    let connect_time = t.elapsed();
    // Half-open (no MPA request): closed after the MPA timeout at the latest.
    let t = Instant::now();
    let still = wait_all_closed(&mut flood, MPA_TIMEOUT * 4 + Duration::from_secs(2));
    let closed_in = t.elapsed();
    drop(flood);
    e.check_good();
    eprintln!(
        "flood: {opened} opened, {refused} refused in {connect_time:?}; all but {still} \
         closed by the server {closed_in:?} later; RSS {rss0} -> peak {peak} KiB"
    );
    assert_eq!(refused, 0, "connections refused by the kernel/listener");
    assert_eq!(still, 0, "half-open MPA connections left open");

    assert!(
        peak - rss0 < RSS_BOUND_KIB,
        "RSS grew {} KiB (bound {RSS_BOUND_KIB})",
        peak - rss0
    );
    e.final_check();
}

/// 1 000 connections that finish MPA and never AUTH: the server rejects
/// above `max_connections` (256 live at once; the per-host cap is lifted
/// here so that the global one is what is reached) with an MPA reject "busy",
/// closes each accepted one after the auth timeout and keeps serving the good
/// client, and its RSS stays bounded. (Before registered buffers became their
/// own mappings it grew +375..490 MiB and kept it: glibc's dynamic mmap
/// threshold retained the freed per-connection buffers. Measured since: about
/// +17 MiB peak for 255 live unauthenticated connections, ~67 KiB each.)
#[test]
fn unauthenticated_rdma_connections_memory() {
    let _g = serial();
    raise_nofile(3 * FLOOD as u64 + 4096);
    let mut e = env_with(|r| r.max_connections_per_host = 1024);
    e.check_good();
    let rss0 = vm_rss_kib();
    let mut peak = rss0;
    let addr = e.s.rdma_addr;
    // MPA done, no AUTH.
    const NO_AUTH: usize = 1_000;
    let t = Instant::now();
    let mut silent = Vec::with_capacity(NO_AUTH);
    let mut busy = 0usize;
    for i in 0..NO_AUTH {
        let (st, rejected) = mpa_try(addr).unwrap();
        busy += rejected as usize;
        silent.push(st);
        if i % 250 == 249 {
            e.check_good();
            peak = peak.max(vm_rss_kib());
        }
    }
    let mpa_time = t.elapsed();
    peak = peak.max(vm_rss_kib());
    let t = Instant::now();
    let still = wait_all_closed(&mut silent, AUTH_TIMEOUT * 4 + Duration::from_secs(2));
    let closed_in = t.elapsed();
    drop(silent);
    e.check_good();
    let rss1 = vm_rss_kib();
    eprintln!(
        "no-AUTH: {NO_AUTH} MPA connections in {mpa_time:?} ({busy} rejected busy); all but \
         {still} closed {closed_in:?} later; RSS {rss0} -> peak {peak} -> end {rss1} KiB"
    );
    assert_eq!(still, 0, "connections without AUTH left open");
    assert!(
        peak - rss0 < RSS_BOUND_KIB,
        "RSS grew {} KiB (bound {RSS_BOUND_KIB})",
        peak - rss0
    );
    e.final_check();
}

// ------------------------------------------------------------------ case 4

/// Truncated and oversized messages at every layer.
#[test]
fn truncated_and_oversized_messages() {
    let _g = serial();
    let mut e = env();
    e.check_good();

    // LWIO: a READ request truncated at every length below its full size
    // (0 .. header, and into the body): the connection is terminated.
    let full = req_bytes(RequestOp::Read {
        fid: 1,
        offset: 0,
        length: 10,
        data_va: 0x1000,
        data_mh: 0x100,
        mode: intr(3),
    });
    assert!(full.len() >= COMMON_HEADER_LEN);
    for len in 0..full.len() {
        let mut h = hostile(&e.s);
        h.auth();
        h.send_bytes(&full[..len]);
        assert!(
            h.terminated(T),
            "LWIO request truncated to {len} of {} bytes must terminate",
            full.len()
        );
        if len % 8 == 0 || len == COMMON_HEADER_LEN {
            e.check_good();
        }
    }
    e.check_good();

    // LWIO: a WRITE one byte above the server's MaxRecvBufferSize.
    let mut h = hostile(&e.s);
    h.auth();
    let big = vec![0x11u8; h.server_max_recv as usize + 1];
    h.send_req(RequestOp::Write {
        fid: 1,
        offset: 0,
        data: &big,
        mode: intr(4),
    });
    assert!(h.terminated(T), "oversized send must terminate");
    e.check_good();

    // MPA: malformed request frames straight over TCP.
    let bad_frames: Vec<Vec<u8>> = vec![
        b"MPA ID Rep Frame\x00\x01\x00\x00".to_vec(), // a reply as a request
        b"XXXXXXXXXXXXXXXX\x00\x01\x00\x00".to_vec(), // wrong key
        b"MPA ID Req Frame\x00\x09\x00\x00".to_vec(), // revision 9
        b"MPA ID Req Frame\x80\x01\x00\x00".to_vec(), // markers
        b"MPA ID Req Frame\x00\x01\xff\xff".to_vec(), // PD_Length 65535, no PD
        b"MPA ID Req".to_vec(),                       // truncated, then EOF
    ];
    for (i, f) in bad_frames.iter().enumerate() {
        let mut s = TcpStream::connect_timeout(&e.s.rdma_addr, T).unwrap();
        s.write_all(f).unwrap();
        if i == bad_frames.len() - 1 {
            s.shutdown(Shutdown::Write).unwrap();
        }
        let t = Instant::now();
        let left = wait_all_closed(std::slice::from_mut(&mut s), MPA_TIMEOUT * 3);
        assert_eq!(left, 0, "malformed MPA frame {i} left the connection open");
        eprintln!("MPA frame {i}: closed after {:?}", t.elapsed());
    }
    e.check_good();

    // FPDU: MPA done, then an FPDU whose length is 65535 (above any MULPDU)
    // followed by garbage; and one of length 1 (below the DDP header).
    for ulpdu in [0xffffu16, 1] {
        let mut s = mpa_connect(e.s.rdma_addr).unwrap();
        let mut fp = ulpdu.to_be_bytes().to_vec();
        fp.extend(std::iter::repeat_n(0xffu8, 2048));
        let _ = s.write_all(&fp);
        let t = Instant::now();
        let left = wait_all_closed(std::slice::from_mut(&mut s), Duration::from_secs(3));
        assert_eq!(left, 0, "FPDU of length {ulpdu} left the connection open");
        assert!(
            t.elapsed() < AUTH_TIMEOUT,
            "FPDU of length {ulpdu}: closed for the violation, not the auth timeout ({:?})",
            t.elapsed()
        );
    }
    e.check_good();

    // Side channel: a truncated frame (length 100, 10 bytes, EOF), a
    // truncated frame left hanging (closed by the login timeout), and one
    // above max_frame.
    let max_frame = Limits::default().max_frame;
    let cases: Vec<(Vec<u8>, bool, Duration)> = vec![
        (
            [&100u32.to_le_bytes()[..], &[1u8; 10][..]].concat(),
            true,
            Duration::from_secs(1),
        ),
        (vec![7, 0], true, Duration::from_secs(1)),
        (
            [&100u32.to_le_bytes()[..], &[1u8; 10][..]].concat(),
            false,
            Duration::from_secs(4),
        ),
        (
            (max_frame + 1).to_le_bytes().to_vec(),
            false,
            Duration::from_millis(900),
        ),
        (
            u32::MAX.to_le_bytes().to_vec(),
            false,
            Duration::from_millis(900),
        ),
    ];
    for (i, (bytes, eof, bound)) in cases.iter().enumerate() {
        let mut s = TcpStream::connect_timeout(&e.s.side_addr, T).unwrap();
        s.write_all(bytes).unwrap();
        if *eof {
            s.shutdown(Shutdown::Write).unwrap();
        }
        let t = Instant::now();
        let left = wait_all_closed(std::slice::from_mut(&mut s), *bound);
        assert_eq!(left, 0, "side-channel frame case {i} left open");
        eprintln!("side frame {i}: closed after {:?}", t.elapsed());
    }
    e.check_good();
    e.final_check();
}

/// Per-host cap on the RDMA listener: one host (127.0.0.2 when it can be
/// bound, else 127.0.0.1) opens cap + 5 connections that finish MPA and
/// never AUTH. Exactly the cap is accepted, the rest get an MPA reject
/// ("busy"); another address is still accepted and the good client served;
/// once the host's connections close, it is accepted again.
#[test]
fn rdma_per_host_cap() {
    let _g = serial();
    const CAP: usize = 8;
    let mut e = env_with(|r| {
        r.max_connections_per_host = CAP;
        // Keep the silent connections alive for the whole test.
        r.proto.auth_timeout = Duration::from_secs(30);
    });
    e.check_good();
    let addr = e.s.rdma_addr;
    let other_ip: std::net::Ipv4Addr = "127.0.0.2".parse().unwrap();
    let (src, other_host) = match connect_from(other_ip, addr) {
        Ok(s) => {
            drop(s);
            (other_ip, true)
        }
        Err(err) => {
            // The fallback checks less (no second host): a skip of that part.
            common::skip(format!(
                "cannot bind 127.0.0.2 ({err}): flooding from 127.0.0.1 only"
            ));
            ("127.0.0.1".parse().unwrap(), false)
        }
    };
    // Let the probe connection (no MPA request) go away before counting.
    std::thread::sleep(MPA_TIMEOUT + Duration::from_millis(500));
    // From 127.0.0.1 the good client already holds one slot.
    let room = if other_host { CAP } else { CAP - 1 };
    let mut held = Vec::new();
    let mut busy = 0;
    for _ in 0..CAP + 5 {
        let (st, rejected) = mpa_try_stream(connect_from(src, addr).unwrap()).unwrap();
        if rejected {
            busy += 1;
        } else {
            held.push(st);
        }
    }
    eprintln!(
        "per-host cap {CAP}: {} accepted, {busy} rejected busy from {src}",
        held.len()
    );
    assert_eq!(held.len(), room, "accepted up to the per-host cap");
    assert_eq!(busy, CAP + 5 - room, "the rest rejected busy");
    e.check_good();
    if other_host {
        // Another address is not affected by 127.0.0.2's cap.
        let (st, rejected) = mpa_try(addr).unwrap();
        assert!(!rejected, "a connection from 127.0.0.1 is accepted");
        drop(st);
    }
    // Closing the host's connections frees its slots.
    for s in &held {
        let _ = s.shutdown(Shutdown::Both);
    }
    drop(held);
    let t = Instant::now();
    loop {
        let (st, rejected) = mpa_try_stream(connect_from(src, addr).unwrap()).unwrap();
        drop(st);
        if !rejected {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "slots not freed after the connections closed"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    e.final_check();
}
