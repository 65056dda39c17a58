//! A malicious LWIO server for the real client (`lwio_client`): the real
//! side channel (login, Open, Negotiate — a `LocalServer`) advertises, in
//! its negotiate answer, an RDMA listener of this module instead of the real
//! one. That listener speaks the I/O phase with proto's `ServerConn` (so the
//! client's AUTH, REGISTER and credit handling are the real thing, signed
//! with the real session secret) and hands every READ / WRITE to a test
//! script, which may serve it honestly or attack with hand-crafted RDMA
//! Writes and status messages using the keys from the client's requests.
//! Used by tests/e2e_malicious_server.rs.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use lwio_proto::server::{DataSource, ServerAction, ServerConfig, ServerConn, ServerHooks};
use lwio_proto::status::*;
use lwio_proto::wire::auth::derive_session_secret;
use lwio_proto::wire::common::{CompletionMode, RequestOp};
use lwio_proto::wire::{Guid, IoStatusBlock, RequestRepr, SrvResumeKey, StatusResponse};
use lwio_proto::NtStatus;
use lwio_rdma::*;
use lwio_server::state::ServerState;

/// Where the malicious server and the client meet: the soft provider on
/// loopback (`cargo test`), or a verbs device, chosen by the environment
/// as the RDMA VM suite does (`LWIO_MALICIOUS_PROVIDER=verbs`,
/// `LWIO_MALICIOUS_DEVICE=rxe0`, `LWIO_MALICIOUS_IP=10.0.0.1`).
#[derive(Debug, Clone)]
pub struct Transport {
    /// "soft" or "verbs".
    pub provider: String,
    pub device: Option<String>,
    pub ip: std::net::IpAddr,
}

impl Transport {
    pub fn from_env() -> Transport {
        let provider = std::env::var("LWIO_MALICIOUS_PROVIDER").unwrap_or_else(|_| "soft".into());
        let device = std::env::var("LWIO_MALICIOUS_DEVICE").ok();
        let ip = std::env::var("LWIO_MALICIOUS_IP")
            .ok()
            .map(|s| s.parse().expect("LWIO_MALICIOUS_IP: an IP address"))
            .unwrap_or(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST));
        assert!(
            provider == "soft" || device.is_some(),
            "LWIO_MALICIOUS_PROVIDER={provider} needs LWIO_MALICIOUS_DEVICE"
        );
        Transport {
            provider,
            device,
            ip,
        }
    }

    /// The soft provider, whose Terminates the tests can read.
    pub fn is_soft(&self) -> bool {
        self.provider == "soft"
    }
}

/// The content of the file the malicious server claims to serve.
pub fn file_byte(off: u64) -> u8 {
    (off.wrapping_mul(7) ^ (off >> 9)) as u8 ^ 0x5a
}

const RECV_SLOT: usize = 16 * 1024;
const RECVS: usize = 64;
const SEND_AREA: usize = 4 << 20;
/// wr_id of the writes and sends a script posts itself.
pub const EVIL_WR: u64 = 0xE000_0000;

/// One READ or WRITE as the malicious server received it.
#[derive(Debug, Clone)]
pub struct Io {
    /// 0 for the first I/O request of the connection, then 1, 2, …
    pub n: usize,
    pub write: bool,
    pub offset: u64,
    pub length: u32,
    /// The read's target (0 for a write).
    pub data_va: u64,
    pub data_mh: u32,
    pub mode: CompletionMode,
    raw: Vec<u8>,
}

impl Io {
    /// Polled: the status block address and the key the client sent for it.
    pub fn ios(&self) -> (u64, u32) {
        match self.mode {
            CompletionMode::Polled { ios_va, ios_mh } => (ios_va, ios_mh),
            CompletionMode::Interrupt { .. } => panic!("request {} is not polled", self.n),
        }
    }
    /// Interrupt mode: the request's cookie.
    pub fn cookie(&self) -> u64 {
        self.mode.cookie().expect("interrupt-mode request")
    }
}

/// The 8 bytes of an IO_STATUS_BLOCK.
pub fn status_block(information: u32, status: NtStatus) -> Vec<u8> {
    IoStatusBlock {
        information,
        status,
    }
    .to_bytes()
    .to_vec()
}

/// A 16-byte status response message.
pub fn status_msg(cookie: u64, information: u32, status: NtStatus) -> Vec<u8> {
    StatusResponse {
        cookie,
        ios: IoStatusBlock {
            information,
            status,
        },
    }
    .to_bytes()
    .to_vec()
}

struct Hooks {
    state: Arc<ServerState>,
}

impl ServerHooks for Hooks {
    fn session_secret(&mut self, key: &Guid) -> Option<Vec<u8>> {
        let n = self.state.lookup_negotiate_key(key)?;
        Some(derive_session_secret(&n.session_secret.0, key).to_vec())
    }
    fn open_file(&mut self, _rk: &SrvResumeKey, _flags: u32) -> Result<u64, NtStatus> {
        Ok(1)
    }
}

/// The server side of one connection, as a script sees it.
pub struct Evil {
    qp: Qp,
    cq: Cq,
    rmr: Mr,
    smr: Mr,
    send_at: usize,
    conn: ServerConn,
    hooks: Hooks,
    read_bufs: HashMap<u64, Vec<u8>>,
    /// Every I/O request received so far, in order.
    pub seen: Vec<Io>,
    go: Receiver<()>,
    /// Completions of the writes and sends the script posted itself.
    pub evil_wcs: Vec<Wc>,
}

/// What the server thread reports once its connection ended.
#[derive(Debug)]
pub struct Report {
    /// The malicious server's QP at the end (Error after a Terminate).
    pub qp_state: QpState,
    /// Terminates the malicious server's QP received, and the last code
    /// (`layer << 12 | etype << 8 | ecode`, as `Wc::vendor_err`); `None`
    /// on a verbs device, which does not tell.
    pub term_recv: Option<u64>,
    pub last_term: u32,
    /// I/O requests received.
    pub ios: usize,
    pub evil_wcs: Vec<Wc>,
}

impl Evil {
    fn put(&mut self, data: &[u8]) -> Sge {
        if self.send_at + data.len() > SEND_AREA {
            self.send_at = 0;
        }
        let off = self.send_at;
        self.smr.write_at(off, data).unwrap();
        self.send_at = (off + data.len()).next_multiple_of(64);
        self.smr.sge(off, data.len() as u32)
    }

    /// RDMA Write `data` to `remote` with `rkey` (anything the script likes).
    pub fn write(&mut self, remote: u64, rkey: u32, data: &[u8]) {
        let sge = self.put(data);
        let _ = self.qp.post_send(&[SendWr::new(
            EVIL_WR,
            SendOp::Write {
                remote_addr: remote,
                rkey,
            },
            &[sge],
        )]);
    }

    /// Send a message (e.g. a forged status response).
    pub fn send(&mut self, bytes: &[u8]) {
        let sge = self.put(bytes);
        let _ = self
            .qp
            .post_send(&[SendWr::new(EVIL_WR, SendOp::Send, &[sge])]);
    }

    /// Complete `io` as its mode says, through its own key or cookie: an
    /// IO_STATUS_BLOCK written to IosVa with IosMh (polled), or a status
    /// response with its Cookie (interrupt).
    pub fn complete(&mut self, io: &Io, information: u32, status: NtStatus) {
        match io.mode {
            CompletionMode::Polled { ios_va, ios_mh } => {
                self.write(ios_va, ios_mh, &status_block(information, status))
            }
            CompletionMode::Interrupt { cookie, .. } => {
                self.send(&status_msg(cookie, information, status))
            }
        }
    }

    /// Serve `io` as the real server would (data, then its completion).
    pub fn honest(&mut self, io: &Io) {
        let raw = io.raw.clone();
        self.conn.handle_recv(Instant::now(), &raw, &mut self.hooks);
        self.run_actions();
    }

    /// The data an honest server would place for `io` (a READ).
    pub fn data_of(io: &Io) -> Vec<u8> {
        (0..u64::from(io.length))
            .map(|i| file_byte(io.offset + i))
            .collect()
    }

    /// Block until the test says go (bounded).
    pub fn wait_go(&self) {
        self.go
            .recv_timeout(Duration::from_secs(20))
            .expect("the test's go");
    }

    fn run_actions(&mut self) {
        while let Some(a) = self.conn.poll_action() {
            match a {
                ServerAction::Send(b) => {
                    let sge = self.put(&b);
                    let _ = self.qp.post_send(&[SendWr::new(1, SendOp::Send, &[sge])]);
                }
                ServerAction::RdmaWrite {
                    remote_addr,
                    rkey,
                    data,
                    imm: _,
                } => {
                    let bytes = match data {
                        DataSource::Inline(b) => b,
                        DataSource::ReadBuffer { op, offset, len } => {
                            let b = &self.read_bufs[&op];
                            b[offset as usize..(offset + len) as usize].to_vec()
                        }
                    };
                    let sge = self.put(&bytes);
                    let _ = self.qp.post_send(&[SendWr::new(
                        2,
                        SendOp::Write { remote_addr, rkey },
                        &[sge],
                    )]);
                }
                ServerAction::FileRead {
                    op, offset, len, ..
                } => {
                    let b: Vec<u8> = (0..u64::from(len)).map(|i| file_byte(offset + i)).collect();
                    self.read_bufs.insert(op, b);
                    self.conn
                        .handle_storage_complete(Instant::now(), op, Ok(len));
                }
                ServerAction::FileWrite { op, data, .. } => {
                    self.conn
                        .handle_storage_complete(Instant::now(), op, Ok(data.len() as u32));
                }
                // This server announces no MAX_MESSAGE: no fragments come.
                ServerAction::FileWriteParts { op, parts, .. } => {
                    let n: usize = parts.iter().map(|(_, r)| r.len()).sum();
                    self.conn
                        .handle_storage_complete(Instant::now(), op, Ok(n as u32));
                }
                ServerAction::FileSync { op, .. } => {
                    self.conn.handle_storage_complete(Instant::now(), op, Ok(0));
                }
                ServerAction::RepostRecvs(_) => {}
                ServerAction::CancelIo { op } => {
                    self.conn
                        .handle_storage_complete(Instant::now(), op, Err(STATUS_CANCELLED));
                }
                ServerAction::ReleaseReadBuffer { op } => {
                    self.read_bufs.remove(&op);
                }
                ServerAction::CloseFile { .. } => {}
                ServerAction::CloseConnection(_) => {
                    let _ = self.qp.disconnect();
                }
            }
        }
    }
}

/// A script: called for every READ / WRITE the client sends.
pub type Script = Box<dyn FnMut(&mut Evil, &Io) + Send>;

/// A malicious RDMA listener (the provider of [`Transport::from_env`])
/// serving one connection.
pub struct MaliciousServer {
    pub addr: SocketAddr,
    go: Sender<()>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<Report>>,
}

impl MaliciousServer {
    /// Listen on loopback and make the side channel of `state` advertise
    /// this listener (instead of the real RDMA server) in its negotiate
    /// answers; serve one connection with `script`.
    pub fn start(state: &Arc<ServerState>, script: Script) -> MaliciousServer {
        let tr = Transport::from_env();
        let ctx = provider(&tr.provider)
            .unwrap()
            .open(tr.device.as_deref(), &Config::default())
            .unwrap();
        let listener = ctx.listen(SocketAddr::new(tr.ip, 0), 4).unwrap();
        let addr = listener.local_addr();
        // The real RDMA phase sets its endpoints when the server thread
        // starts; replace them once it has.
        let t = Instant::now();
        while state.rdma_endpoints().is_empty() {
            assert!(t.elapsed() < Duration::from_secs(10), "no RDMA endpoints");
            std::thread::sleep(Duration::from_millis(5));
        }
        let mut eps = state.rdma_endpoints();
        for e in &mut eps {
            e.addr = addr;
        }
        if !tr.is_soft() {
            // The device's transport (RoCE for rxe), one endpoint.
            let transport = lwio_server::io_phase::driver::wire_transport(ctx.device().transport)
                .expect("an RDMA transport");
            eps = vec![lwio_proto::transport::Instance::new(transport, addr)];
        }
        state.set_rdma_endpoints(eps);
        let (go, go_rx) = std::sync::mpsc::channel();
        let stop = Arc::new(AtomicBool::new(false));
        let (st, stop2) = (state.clone(), stop.clone());
        let thread = std::thread::Builder::new()
            .name("malicious-server".into())
            .spawn(move || serve(ctx, listener, st, script, go_rx, stop2))
            .unwrap();
        MaliciousServer {
            addr,
            go,
            stop,
            thread: Some(thread),
        }
    }

    /// Let a script blocked in [`Evil::wait_go`] continue.
    pub fn go(&self) {
        let _ = self.go.send(());
    }

    /// Wait (bounded) until the connection ended (its QP in error), or stop
    /// it after `bound`; the report.
    pub fn finish(mut self, bound: Duration) -> Report {
        let t = self.thread.take().unwrap();
        let start = Instant::now();
        while !t.is_finished() && start.elapsed() < bound {
            std::thread::sleep(Duration::from_millis(5));
        }
        self.stop.store(true, Ordering::SeqCst);
        t.join().expect("malicious server thread")
    }
}

impl Drop for MaliciousServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn serve(
    ctx: Context,
    listener: Listener,
    state: Arc<ServerState>,
    mut script: Script,
    go: Receiver<()>,
    stop: Arc<AtomicBool>,
) -> Report {
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(1024, None).unwrap();
    let init = QpInit {
        pd: pd.clone(),
        send_cq: cq.clone(),
        recv_cq: cq.clone(),
        cap: QpCap::default(),
        sq_sig_all: true,
        recv_window: None,
        srq: None,
    };
    let t = Instant::now();
    let req = loop {
        assert!(t.elapsed() < Duration::from_secs(20), "no client came");
        if let Some(r) = listener
            .get_request(Some(Duration::from_millis(50)))
            .unwrap()
        {
            break r;
        }
        if stop.load(Ordering::SeqCst) {
            panic!("stopped before a client came");
        }
    };
    // Server memory: local access only (the server never exposes memory).
    let rmr = pd.alloc_mr(RECV_SLOT * RECVS, Access::LOCAL_WRITE).unwrap();
    let smr = pd.alloc_mr(SEND_AREA, Access::LOCAL_WRITE).unwrap();
    let sges: Vec<[Sge; 1]> = (0..RECVS)
        .map(|i| [rmr.sge(i * RECV_SLOT, RECV_SLOT as u32)])
        .collect();
    let recvs: Vec<RecvWr<'_>> = sges
        .iter()
        .enumerate()
        .map(|(i, s)| RecvWr {
            wr_id: i as u64,
            sg_list: s,
        })
        .collect();
    let qp = req
        .accept_with_recvs(&init, &ConnParams::default(), &recvs)
        .unwrap();
    let mut ev = Evil {
        qp,
        cq,
        rmr,
        smr,
        send_at: 0,
        conn: ServerConn::new(ServerConfig::default(), Instant::now()),
        hooks: Hooks { state },
        read_bufs: HashMap::new(),
        seen: Vec::new(),
        go,
        evil_wcs: Vec::new(),
    };
    let mut wc = [Wc::BLANK; 32];
    let deadline = Instant::now() + Duration::from_secs(60);
    while !stop.load(Ordering::SeqCst) && Instant::now() < deadline {
        let n = ev.cq.poll(&mut wc).unwrap_or(0);
        for w in wc[..n].iter().copied() {
            if w.wr_id == EVIL_WR {
                ev.evil_wcs.push(w);
                continue;
            }
            if w.opcode != WcOpcode::Recv || !w.is_ok() {
                continue;
            }
            let slot = w.wr_id as usize;
            let mut b = vec![0u8; w.byte_len as usize];
            ev.rmr.read_at(slot * RECV_SLOT, &mut b).unwrap();
            let _ = ev.qp.post_recv(&[RecvWr {
                wr_id: w.wr_id,
                sg_list: &[ev.rmr.sge(slot * RECV_SLOT, RECV_SLOT as u32)],
            }]);
            let io = match RequestRepr::parse(&b).map(|r| r.op) {
                Ok(RequestOp::Read {
                    offset,
                    length,
                    data_va,
                    data_mh,
                    mode,
                    ..
                }) => Some((false, offset, length, data_va, data_mh, mode)),
                Ok(RequestOp::Write {
                    offset, data, mode, ..
                }) => Some((true, offset, data.len() as u32, 0, 0, mode)),
                _ => None,
            };
            match io {
                Some((write, offset, length, data_va, data_mh, mode)) => {
                    let io = Io {
                        n: ev.seen.len(),
                        write,
                        offset,
                        length,
                        data_va,
                        data_mh,
                        mode,
                        raw: b,
                    };
                    ev.seen.push(io.clone());
                    script(&mut ev, &io);
                }
                None => {
                    ev.conn.handle_recv(Instant::now(), &b, &mut ev.hooks);
                    ev.run_actions();
                }
            }
        }
        if ev.qp.state() == QpState::Error {
            // Collect what is left (flushes, the completions of the
            // script's own writes) and stop.
            std::thread::sleep(Duration::from_millis(20));
            let n = ev.cq.poll(&mut wc).unwrap_or(0);
            ev.evil_wcs
                .extend(wc[..n].iter().filter(|w| w.wr_id == EVIL_WR).copied());
            break;
        }
        if n == 0 {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    let st = lwio_rdma::soft::qp_stats(&ev.qp);
    Report {
        qp_state: ev.qp.state(),
        term_recv: st.as_ref().map(|s| s.term_recv),
        last_term: st.map_or(0, |s| s.last_term),
        ios: ev.seen.len(),
        evil_wcs: ev.evil_wcs,
    }
}
