//! `lwio-rping`: rping's ping/pong exchange (rdmacm-utils `rping`) on lwio's
//! verbs API, so that lwio's providers — above all the user-space iWARP
//! provider `soft` on plain TCP sockets — can be checked against the real
//! `rping` on a kernel RDMA device (siw) in both directions.
//!
//! The exchange, per iteration (the client starts):
//! 1. the client fills its *start* buffer with rping's pattern and sends
//!    `struct rping_rdma_info { be64 buf; be32 rkey; be32 size; }` for it;
//! 2. the server RDMA-Reads `size` bytes from it, then sends a go-ahead
//!    (16 bytes, content ignored);
//! 3. the client sends the info of its *sink* buffer;
//! 4. the server RDMA-Writes `strlen(data) + 1` bytes of what it read into the
//!    sink, then sends a go-ahead;
//! 5. with `-V` the client compares sink and start.
//!
//! After `-C` iterations the client disconnects; the server serves until the
//! client disconnects. Like rping, both sides offer IRD = ORD = 1, no private
//! data, and post one 16-byte receive at a time.
//!
//! Beyond rping: the server's `-V` checks the data it RDMA-Read against the
//! pattern rping's client writes, the server's `-C` is the number of
//! iterations it must see before the client disconnects, every wait has a
//! timeout, and the last line says `lwio-rping: N iterations ok` (exit 0) or
//! `lwio-rping: FAILED after N iterations: …` (exit 1; 2 = usage).

use std::collections::VecDeque;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, ToSocketAddrs};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use lwio_rdma::*;

const USAGE: &str = "\
usage: lwio-rping -s [-a ADDR] [options]          server (rping -s)
       lwio-rping -c -a ADDR [options]            client (rping -c)
  -a ADDR          server: address to listen on (default 0.0.0.0); client: server address
  -p PORT          port (default 7174, rping's); server -p 0 picks a free one
  -C COUNT         client: iterations (0 = forever, rping's default);
                   server: iterations the client must complete (default: any)
  -S SIZE          ping data size, 26..=65535 (default 64)
  -V               validate: client compares the echoed data with what it sent;
                   server checks the data it read against rping's pattern
  -v               print the ping data (as rping -v does)
  -d               debug: trace every step on stderr
  --provider P     soft (default; user-space iWARP on TCP) | verbs (libibverbs)
  --device NAME    device of the provider (soft: soft0; verbs: default the one
                   owning -a for a server, else the first usable one)
  --crc on|off     soft: request MPA CRC32c (on = required; off = not asked for,
                   used if the peer asks). Default off. --mpa-crc = --crc on
  --timeout SECS   limit for each wait (server: also for the connection; default
                   30 s per completion, server waits for a connection forever)";

/// rping's `RPING_MIN_BUFSIZE` (`sizeof "0x7fffffff"` + `sizeof "rdma-ping-%d: "`).
const MIN_SIZE: usize = 26;
/// rping's `RPING_BUFSIZE - 1`.
const MAX_SIZE: usize = 64 * 1024 - 1;
/// `sizeof(struct rping_rdma_info)`.
const INFO_LEN: usize = 16;
const DEFAULT_PORT: u16 = 7174;
/// rping's `RPING_SQ_DEPTH`.
const SQ_DEPTH: u32 = 16;

#[derive(Debug, Clone)]
struct Opts {
    server: bool,
    addr: Option<String>,
    port: u16,
    count: u32,
    count_given: bool,
    size: usize,
    validate: bool,
    verbose: bool,
    debug: bool,
    provider: String,
    device: Option<String>,
    crc: bool,
    timeout: Option<Duration>,
}

fn parse_args(args: &[String]) -> Result<Opts, String> {
    let mut o = Opts {
        server: false,
        addr: None,
        port: DEFAULT_PORT,
        count: 0,
        count_given: false,
        size: 64,
        validate: false,
        verbose: false,
        debug: false,
        provider: "soft".into(),
        device: None,
        crc: false,
        timeout: None,
    };
    let mut role = None;
    let mut it = args.iter();
    fn val<'a>(it: &mut std::slice::Iter<'a, String>, opt: &str) -> Result<&'a str, String> {
        it.next()
            .map(|s| s.as_str())
            .ok_or_else(|| format!("{opt} needs a value"))
    }
    fn num<T: std::str::FromStr>(s: &str, opt: &str) -> Result<T, String> {
        s.parse()
            .map_err(|_| format!("{opt}: not a valid number: {s:?}"))
    }
    while let Some(a) = it.next() {
        match a.as_str() {
            "-s" => role = Some(true),
            "-c" => role = Some(false),
            "-a" => o.addr = Some(val(&mut it, a)?.to_string()),
            "-p" => o.port = num(val(&mut it, a)?, a)?,
            "-C" => {
                o.count = num(val(&mut it, a)?, a)?;
                o.count_given = true;
            }
            "-S" => {
                o.size = num(val(&mut it, a)?, a)?;
                if !(MIN_SIZE..=MAX_SIZE).contains(&o.size) {
                    return Err(format!(
                        "invalid size {} (valid range is {MIN_SIZE} to {MAX_SIZE})",
                        o.size
                    ));
                }
            }
            "-V" => o.validate = true,
            "-v" => o.verbose = true,
            "-d" => o.debug = true,
            "-vV" | "-Vv" => {
                o.validate = true;
                o.verbose = true;
            }
            "--provider" => o.provider = val(&mut it, a)?.to_string(),
            "--device" => o.device = Some(val(&mut it, a)?.to_string()),
            "--crc" => {
                o.crc = match val(&mut it, a)? {
                    "on" => true,
                    "off" => false,
                    v => return Err(format!("--crc takes on or off, not {v:?}")),
                }
            }
            "--mpa-crc" => o.crc = true,
            "--timeout" => {
                let secs: f64 = num(val(&mut it, a)?, a)?;
                if !(secs > 0.0 && secs < 1e9) {
                    return Err(format!("--timeout {secs}: want a positive number"));
                }
                o.timeout = Some(Duration::from_secs_f64(secs));
            }
            "-h" | "--help" => return Err(String::new()),
            _ => return Err(format!("unknown argument {a:?}")),
        }
    }
    o.server = role.ok_or("one of -s or -c is required")?;
    if !o.server && o.addr.is_none() {
        return Err("the client needs -a ADDR".into());
    }
    Ok(o)
}

fn resolve(host: Option<&str>, port: u16) -> Result<SocketAddr, String> {
    let Some(h) = host else {
        return Ok(SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), port));
    };
    if let Ok(ip) = h.parse::<IpAddr>() {
        return Ok(SocketAddr::new(ip, port));
    }
    (h, port)
        .to_socket_addrs()
        .map_err(|e| format!("cannot resolve {h:?}: {e}"))?
        .next()
        .ok_or_else(|| format!("{h:?} has no address"))
}

/// rping's ping data for iteration `ping` (`rping_test_client`): the text
/// `rdma-ping-<ping>: `, then ASCII 'A'..='z' rotating from a start character
/// that advances by one per iteration, and a NUL in the last byte.
fn ping_pattern(ping: u32, size: usize) -> Vec<u8> {
    let mut buf = vec![0u8; size];
    let head = format!("rdma-ping-{}: ", ping as i32);
    // snprintf(buf, size, …): at most size - 1 characters.
    let cc = head.len().min(size.saturating_sub(1));
    buf[..cc].copy_from_slice(&head.as_bytes()[..cc]);
    // start = 65 + ping mod 58 ('A'..='z' is 58 characters)
    let mut c = 65 + (ping % 58) as u8;
    for b in buf.iter_mut().skip(cc) {
        *b = c;
        c += 1;
        if c > 122 {
            c = 65;
        }
    }
    if let Some(last) = buf.last_mut() {
        *last = 0;
    }
    buf
}

/// The bytes up to the first NUL (for printing as rping prints `%s`).
fn c_str(b: &[u8]) -> String {
    let end = b.iter().position(|&x| x == 0).unwrap_or(b.len());
    String::from_utf8_lossy(&b[..end]).into_owned()
}

/// `-V`: `got` must equal `want`; else say where they differ.
fn check_data(what: &str, ping: u32, got: &[u8], want: &[u8]) -> Result<(), Fail> {
    if got == want {
        return Ok(());
    }
    let i = got
        .iter()
        .zip(want)
        .position(|(a, b)| a != b)
        .unwrap_or(got.len().min(want.len()));
    let show =
        |b: &[u8]| String::from_utf8_lossy(&b[i.min(b.len())..(i + 16).min(b.len())]).into_owned();
    Err(Fail(format!(
        "{what} mismatch in iteration {ping} at byte {i} of {}: got {:?}, want {:?}",
        want.len(),
        show(got),
        show(want)
    )))
}

fn encode_info(addr: u64, rkey: u32, size: u32) -> [u8; INFO_LEN] {
    let mut b = [0u8; INFO_LEN];
    b[..8].copy_from_slice(&addr.to_be_bytes());
    b[8..12].copy_from_slice(&rkey.to_be_bytes());
    b[12..].copy_from_slice(&size.to_be_bytes());
    b
}

fn decode_info(b: &[u8; INFO_LEN]) -> (u64, u32, u32) {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    let mut k = [0u8; 4];
    k.copy_from_slice(&b[8..12]);
    let mut s = [0u8; 4];
    s.copy_from_slice(&b[12..]);
    (
        u64::from_be_bytes(a),
        u32::from_be_bytes(k),
        u32::from_be_bytes(s),
    )
}

/// A failure with its message (the final line prints it).
struct Fail(String);

impl<E: std::fmt::Display> From<E> for Fail {
    fn from(e: E) -> Self {
        Fail(e.to_string())
    }
}

fn ctx_err<E: std::fmt::Display>(what: &'static str) -> impl Fn(E) -> Fail {
    move |e| Fail(format!("{what}: {e}"))
}

const WR_RECV: u64 = 1;
const WR_SEND: u64 = 2;
const WR_READ: u64 = 3;
const WR_WRITE: u64 = 4;

/// What a wait for a completion ended with.
enum Got {
    Wc(Wc),
    /// The expected work request was flushed: the QP left RTS (peer gone).
    Flushed(Wc),
}

/// One connection's verbs objects and the rping buffers.
struct Session {
    qp: Qp,
    cq: Cq,
    chan: CompChannel,
    /// Completions polled but not consumed yet.
    pending: VecDeque<Wc>,
    recv_mr: Mr,
    /// Two 16-byte send slots used alternately, so a slot is never rewritten
    /// while the previous send from it may still be in flight.
    send_mr: Mr,
    send_slot: usize,
    /// rping's `rdma_buf`: the server's Read sink / Write source, the client's sink.
    rdma_mr: Mr,
    /// The client's Read source (`start_buf`).
    start_mr: Option<Mr>,
    timeout: Duration,
    debug: bool,
}

impl Session {
    fn dbg(&self, msg: impl FnOnce() -> String) {
        if self.debug {
            eprintln!("[lwio-rping] {}", msg());
        }
    }

    fn post_recv(&self) -> Result<(), Fail> {
        let sge = [self.recv_mr.sge(0, INFO_LEN as u32)];
        self.qp
            .post_recv(&[RecvWr {
                wr_id: WR_RECV,
                sg_list: &sge,
            }])
            .map_err(ctx_err("post receive"))
    }

    fn send_info(&mut self, addr: u64, rkey: u32, size: u32) -> Result<(), Fail> {
        let off = self.send_slot * INFO_LEN;
        self.send_slot ^= 1;
        self.send_mr
            .write_at(off, &encode_info(addr, rkey, size))
            .map_err(ctx_err("send buffer"))?;
        let sge = [self.send_mr.sge(off, INFO_LEN as u32)];
        self.dbg(|| format!("send info addr {addr:#x} rkey {rkey:#x} len {size}"));
        self.qp
            .post_send(&[SendWr::new(WR_SEND, SendOp::Send, &sge)])
            .map_err(ctx_err("post send"))
    }

    fn rdma(&self, wr_id: u64, op: SendOp, len: u32) -> Result<(), Fail> {
        let sge = [self.rdma_mr.sge(0, len)];
        self.dbg(|| format!("post {op:?} len {len}"));
        self.qp
            .post_send(&[SendWr::new(wr_id, op, &sge)])
            .map_err(ctx_err("post RDMA"))
    }

    /// Wait for the completion of the work request `wr_id`; send completions
    /// in between are checked and dropped.
    fn wait(&mut self, wr_id: u64, what: &str) -> Result<Got, Fail> {
        let deadline = Instant::now() + self.timeout;
        loop {
            while let Some(wc) = self.pending.pop_front() {
                self.dbg(|| format!("completion {wc:?}"));
                if wc.status == WcStatus::WrFlushErr {
                    if wc.wr_id == wr_id {
                        return Ok(Got::Flushed(wc));
                    }
                    continue;
                }
                if !wc.is_ok() {
                    return Err(Fail(format!(
                        "{} completion failed while waiting for {what}: {:?} (vendor_err {:#x})",
                        wr_name(wc.wr_id),
                        wc.status,
                        wc.vendor_err
                    )));
                }
                if wc.wr_id == wr_id {
                    return Ok(Got::Wc(wc));
                }
                if wc.wr_id != WR_SEND {
                    return Err(Fail(format!(
                        "unexpected {} completion ({:?}) while waiting for {what}",
                        wr_name(wc.wr_id),
                        wc.opcode
                    )));
                }
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Fail(format!(
                    "timed out after {:?} waiting for {what} (QP state {:?})",
                    self.timeout,
                    self.qp.state()
                )));
            }
            let mut wcs = [Wc::BLANK; 16];
            let n = self
                .cq
                .wait(
                    &self.chan,
                    &mut wcs,
                    Some(left.min(Duration::from_millis(500))),
                )
                .map_err(ctx_err("poll CQ"))?;
            self.pending.extend(wcs[..n].iter().copied());
        }
    }

    /// Wait for the next receive; `None` = flushed (the peer disconnected).
    fn wait_recv(&mut self, what: &str) -> Result<Option<[u8; INFO_LEN]>, Fail> {
        match self.wait(WR_RECV, what)? {
            Got::Flushed(_) => Ok(None),
            Got::Wc(wc) => {
                if wc.opcode != WcOpcode::Recv {
                    return Err(Fail(format!(
                        "receive completed as {:?} while waiting for {what}",
                        wc.opcode
                    )));
                }
                if wc.byte_len as usize != INFO_LEN {
                    // rping: "Received bogus data, size %d"
                    return Err(Fail(format!(
                        "received bogus data, size {} (want {INFO_LEN}) while waiting for {what}",
                        wc.byte_len
                    )));
                }
                let mut b = [0u8; INFO_LEN];
                self.recv_mr
                    .read_at(0, &mut b)
                    .map_err(ctx_err("receive buffer"))?;
                // Re-post before anything else can make the peer send again.
                self.post_recv()?;
                Ok(Some(b))
            }
        }
    }

    fn wait_ok(&mut self, wr_id: u64, what: &str) -> Result<Wc, Fail> {
        match self.wait(wr_id, what)? {
            Got::Wc(wc) => Ok(wc),
            Got::Flushed(wc) => Err(Fail(format!(
                "{what}: flushed (QP state {:?}, vendor_err {:#x}): the peer disconnected or the connection failed",
                self.qp.state(),
                wc.vendor_err
            ))),
        }
    }
}

fn wr_name(id: u64) -> &'static str {
    match id {
        WR_RECV => "receive",
        WR_SEND => "send",
        WR_READ => "RDMA Read",
        WR_WRITE => "RDMA Write",
        _ => "unknown",
    }
}

struct Setup {
    ctx: Context,
    pd: Pd,
    cq: Cq,
    chan: CompChannel,
}

fn open(o: &Opts, local_hint: Option<IpAddr>) -> Result<Setup, Fail> {
    let prov = provider(&o.provider).map_err(ctx_err("provider"))?;
    let device = match (&o.device, o.provider.as_str()) {
        (Some(d), _) => Some(d.clone()),
        (None, "verbs") => local_hint.and_then(|ip| {
            prov.devices()
                .into_iter()
                .find(|d| d.usable.is_ok() && d.addresses.contains(&ip))
                .map(|d| d.name)
        }),
        _ => None,
    };
    let cfg = Config {
        mpa_crc: if o.crc {
            CrcPolicy::Required
        } else {
            CrcPolicy::Off
        },
        connect_timeout: o.timeout.unwrap_or(Duration::from_secs(10)),
        ..Config::default()
    };
    let ctx = prov
        .open(device.as_deref(), &cfg)
        .map_err(ctx_err("open device"))?;
    let pd = ctx.alloc_pd().map_err(ctx_err("alloc PD"))?;
    let chan = ctx
        .create_comp_channel()
        .map_err(ctx_err("completion channel"))?;
    let cq = ctx
        .create_cq(SQ_DEPTH * 2, Some(&chan))
        .map_err(ctx_err("create CQ"))?;
    Ok(Setup { ctx, pd, cq, chan })
}

fn qp_init(s: &Setup) -> QpInit {
    QpInit {
        pd: s.pd.clone(),
        send_cq: s.cq.clone(),
        recv_cq: s.cq.clone(),
        cap: QpCap {
            max_send_wr: SQ_DEPTH,
            max_recv_wr: 2,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
        },
        sq_sig_all: false,
        recv_window: None,
        srq: None,
    }
}

/// rping's `rping_init_conn_param`: responder_resources = initiator_depth = 1.
fn conn_params() -> ConnParams {
    ConnParams {
        private_data: Vec::new(),
        ird: 1,
        ord: 1,
    }
}

fn session(o: &Opts, s: &Setup, qp: Qp) -> Result<Session, Fail> {
    let rw = Access::LOCAL_WRITE | Access::REMOTE_READ | Access::REMOTE_WRITE;
    let sess = Session {
        recv_mr: s
            .pd
            .alloc_mr(INFO_LEN, Access::LOCAL_WRITE)
            .map_err(ctx_err("register receive buffer"))?,
        send_mr: s
            .pd
            .alloc_mr(2 * INFO_LEN, Access::empty())
            .map_err(ctx_err("register send buffer"))?,
        send_slot: 0,
        rdma_mr: s
            .pd
            .alloc_mr(o.size, rw)
            .map_err(ctx_err("register rdma buffer"))?,
        start_mr: if o.server {
            None
        } else {
            Some(
                s.pd.alloc_mr(o.size, rw)
                    .map_err(ctx_err("register start buffer"))?,
            )
        },
        qp,
        cq: s.cq.clone(),
        chan: s.chan.clone(),
        pending: VecDeque::new(),
        timeout: o.timeout.unwrap_or(Duration::from_secs(30)),
        debug: o.debug,
    };
    sess.post_recv()?;
    Ok(sess)
}

fn describe(qp: &Qp) -> String {
    let n = qp.negotiated();
    let crc = match n.mpa_crc {
        Some(true) => ", MPA CRC on",
        Some(false) => ", MPA CRC off",
        None => "",
    };
    format!(
        "{} (local {}{crc}, IRD {} ORD {})",
        qp.peer_addr(),
        qp.local_addr(),
        n.ird,
        n.ord
    )
}

fn run_client(o: &Opts, done: &mut u32) -> Result<(), Fail> {
    let addr = resolve(o.addr.as_deref(), o.port).map_err(Fail)?;
    let s = open(o, None)?;
    let qp = s
        .ctx
        .connect(addr, &qp_init(&s), &conn_params())
        .map_err(|e| Fail(format!("connect to {addr}: {e}")))?;
    println!("lwio-rping: connected to {}", describe(&qp));
    let mut sess = session(o, &s, qp)?;
    let size = o.size;
    let mut sink = vec![0u8; size];
    let mut ping: u32 = 0;
    while o.count == 0 || ping < o.count {
        let data = ping_pattern(ping, size);
        let (start_addr, start_rkey) = {
            let start = sess
                .start_mr
                .as_ref()
                .ok_or(Fail("no start buffer".into()))?;
            start.write_at(0, &data).map_err(ctx_err("start buffer"))?;
            (start.addr(), start.rkey())
        };
        // A stale echo must not pass validation.
        sess.rdma_mr
            .fill(0, size, 0)
            .map_err(ctx_err("rdma buffer"))?;
        sess.send_info(start_addr, start_rkey, size as u32)?;
        if sess
            .wait_recv("the go-ahead after the server's RDMA Read")?
            .is_none()
        {
            return Err(Fail(
                "the server disconnected before the RDMA Read go-ahead".into(),
            ));
        }
        let (sink_addr, sink_rkey) = (sess.rdma_mr.addr(), sess.rdma_mr.rkey());
        sess.send_info(sink_addr, sink_rkey, size as u32)?;
        if sess
            .wait_recv("the go-ahead after the server's RDMA Write")?
            .is_none()
        {
            return Err(Fail(
                "the server disconnected before the RDMA Write go-ahead".into(),
            ));
        }
        sess.rdma_mr
            .read_at(0, &mut sink)
            .map_err(ctx_err("rdma buffer"))?;
        if o.validate {
            check_data("data", ping, &sink, &data)?;
        }
        if o.verbose {
            println!("ping data: {}", c_str(&sink));
        }
        ping += 1;
        *done = ping;
    }
    sess.dbg(|| "disconnecting".into());
    sess.qp.disconnect().map_err(ctx_err("disconnect"))?;
    // Let the provider report the flush of the posted receive (and any
    // late send completion) before the objects go away.
    sess.timeout = sess.timeout.min(Duration::from_secs(2));
    let _ = sess.wait(WR_RECV, "the flush of the last receive");
    Ok(())
}

fn run_server(o: &Opts, done: &mut u32) -> Result<(), Fail> {
    let addr = resolve(o.addr.as_deref(), o.port).map_err(Fail)?;
    let s = open(o, Some(addr.ip()))?;
    let l = s
        .ctx
        .listen(addr, 3)
        .map_err(|e| Fail(format!("listen on {addr}: {e}")))?;
    println!(
        "lwio-rping: listening on {} (provider {}, device {})",
        l.local_addr(),
        o.provider,
        s.ctx.device().name
    );
    let req = l
        .get_request(o.timeout)
        .map_err(ctx_err("waiting for a connection"))?
        .ok_or_else(|| Fail("no connection request within the timeout".into()))?;
    let peer = req.peer_addr();
    let qp = req
        .accept(&qp_init(&s), &conn_params())
        .map_err(|e| Fail(format!("accept {peer}: {e}")))?;
    println!("lwio-rping: accepted {}", describe(&qp));
    let mut sess = session(o, &s, qp)?;
    let size = o.size;
    let mut buf = vec![0u8; size];
    let mut ping: u32 = 0;
    // The client's start buffer, or its disconnect.
    while let Some(info) = sess.wait_recv("the client's start buffer")? {
        let (raddr, rkey, rlen) = decode_info(&info);
        sess.dbg(|| format!("start info addr {raddr:#x} rkey {rkey:#x} len {rlen}"));
        let rlen = rlen as usize;
        if rlen == 0 || rlen > size {
            return Err(Fail(format!(
                "iteration {ping}: the client's buffer is {rlen} bytes; ours (-S) is {size}"
            )));
        }
        sess.rdma_mr
            .fill(0, size, 0)
            .map_err(ctx_err("rdma buffer"))?;
        sess.rdma(
            WR_READ,
            SendOp::Read {
                remote_addr: raddr,
                rkey,
            },
            rlen as u32,
        )?;
        let wc = sess.wait_ok(WR_READ, "the RDMA Read")?;
        if wc.opcode != WcOpcode::RdmaRead {
            return Err(Fail(format!("RDMA Read completed as {:?}", wc.opcode)));
        }
        sess.rdma_mr
            .read_at(0, &mut buf)
            .map_err(ctx_err("rdma buffer"))?;
        if o.validate {
            check_data("read data", ping, &buf[..rlen], &ping_pattern(ping, rlen))?;
        }
        if o.verbose {
            println!("server ping data: {}", c_str(&buf));
        }
        // Go-ahead (rping's server sends its never-filled send buffer: zeros).
        sess.send_info(0, 0, 0)?;
        let Some(info) = sess.wait_recv("the client's sink buffer")? else {
            return Err(Fail(format!(
                "iteration {ping}: the client disconnected before advertising its sink"
            )));
        };
        let (waddr, wkey, wlen) = decode_info(&info);
        sess.dbg(|| format!("sink info addr {waddr:#x} rkey {wkey:#x} len {wlen}"));
        // rping writes strlen(rdma_buf) + 1 bytes.
        let n = buf
            .iter()
            .position(|&b| b == 0)
            .map(|p| p + 1)
            .unwrap_or(size);
        if n > wlen as usize {
            return Err(Fail(format!(
                "iteration {ping}: the client's sink is {wlen} bytes, the echo {n}"
            )));
        }
        sess.rdma(
            WR_WRITE,
            SendOp::Write {
                remote_addr: waddr,
                rkey: wkey,
            },
            n as u32,
        )?;
        let wc = sess.wait_ok(WR_WRITE, "the RDMA Write")?;
        if wc.opcode != WcOpcode::RdmaWrite {
            return Err(Fail(format!("RDMA Write completed as {:?}", wc.opcode)));
        }
        sess.send_info(0, 0, 0)?;
        ping += 1;
        *done = ping;
    }
    sess.dbg(|| "client disconnected".into());
    let _ = sess.qp.disconnect();
    if ping == 0 {
        return Err(Fail(
            "the client disconnected before the first iteration".into(),
        ));
    }
    if o.count_given && o.count != 0 && ping != o.count {
        return Err(Fail(format!(
            "the client disconnected after {ping} iterations, -C says {}",
            o.count
        )));
    }
    Ok(())
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let o = match parse_args(&args) {
        Ok(o) => o,
        Err(e) => {
            if e.is_empty() {
                println!("{USAGE}");
                return ExitCode::SUCCESS;
            }
            eprintln!("lwio-rping: {e}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let mut done = 0u32;
    let r = if o.server {
        run_server(&o, &mut done)
    } else {
        run_client(&o, &mut done)
    };
    match r {
        Ok(()) => {
            println!("lwio-rping: {done} iterations ok");
            ExitCode::SUCCESS
        }
        Err(Fail(why)) => {
            println!("lwio-rping: FAILED after {done} iterations: {why}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pattern_matches_rping() {
        // rping -S 64, ping 0: "rdma-ping-0: " then 'A'.. rotating, NUL last.
        let p = ping_pattern(0, 64);
        assert_eq!(&p[..13], b"rdma-ping-0: ");
        assert_eq!(p[13], b'A');
        assert_eq!(p[14], b'B');
        assert_eq!(p[63], 0);
        assert_eq!(p.iter().position(|&b| b == 0), Some(63));
        // ping 1 starts at 'B'; after 'z' comes 'A'.
        let p = ping_pattern(1, 80);
        assert_eq!(&p[..13], b"rdma-ping-1: ");
        assert_eq!(p[13], b'B');
        let z = p.iter().position(|&b| b == b'z').unwrap();
        assert_eq!(p[z + 1], b'A');
        // the start character wraps after 58 iterations
        assert_eq!(ping_pattern(58, 64)[14], b'A');
        assert_eq!(ping_pattern(57, 64)[14], b'z');
    }

    #[test]
    fn info_is_big_endian() {
        let b = encode_info(0x0102030405060708, 0x0a0b0c0d, 64);
        assert_eq!(b, [1, 2, 3, 4, 5, 6, 7, 8, 0xa, 0xb, 0xc, 0xd, 0, 0, 0, 64]);
        assert_eq!(decode_info(&b), (0x0102030405060708, 0x0a0b0c0d, 64));
    }

    #[test]
    fn args() {
        let a = |s: &str| parse_args(&s.split_whitespace().map(String::from).collect::<Vec<_>>());
        let o = a("-c -a 10.0.0.2 -C 100 -V --crc on").unwrap();
        assert!(!o.server && o.validate && o.crc && o.count == 100);
        assert!(a("-c").is_err());
        assert!(a("-s -S 25").is_err());
        assert!(a("-s -S 65536").is_err());
        assert!(a("-s --crc maybe").is_err());
        assert!(a("-s --mpa-crc").unwrap().crc);
    }
}
