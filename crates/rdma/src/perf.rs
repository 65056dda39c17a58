//! A perftest-like benchmark over the verbs API.
//!
//! Used by `lwio rdma-bench --op write|read|send --size BYTES [--iters N]
//! [--poll]`. Runs both ends in one process (two contexts, a server thread)
//! or one end (`listen` / `connect`). Two phases:
//!
//! * latency: ping-pong, reported as half the round trip like fi_pingpong
//!   (send: message echoed; write: the peer polls the last byte of its
//!   buffer and writes back; read: one read at a time, full time reported);
//! * bandwidth: `depth` operations kept in flight; write ends with a send
//!   that the peer acknowledges (so all data is placed), send with an ack.
//!
//! The client tells the server what to do in the connection's private data.

use std::fmt;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use crate::verbs::*;

/// The operation measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PerfOp {
    Write,
    Read,
    Send,
}

impl std::str::FromStr for PerfOp {
    type Err = Error;
    fn from_str(s: &str) -> Result<PerfOp> {
        match s {
            "write" => Ok(PerfOp::Write),
            "read" => Ok(PerfOp::Read),
            "send" => Ok(PerfOp::Send),
            _ => Err(Error::InvalidArgument(format!(
                "unknown op {s:?} (write|read|send)"
            ))),
        }
    }
}

impl fmt::Display for PerfOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            PerfOp::Write => "write",
            PerfOp::Read => "read",
            PerfOp::Send => "send",
        })
    }
}

/// What to run.
#[derive(Debug, Clone)]
pub struct PerfOpts {
    pub op: PerfOp,
    pub size: usize,
    /// Bandwidth-phase operations.
    pub iters: u64,
    /// Latency-phase round trips (0 = min(iters, 10000)).
    pub lat_iters: u64,
    /// Busy-poll the CQ (otherwise block on a completion channel).
    pub poll: bool,
    /// Operations in flight in the bandwidth phase.
    pub depth: u32,
    pub provider: String,
    pub device: Option<String>,
    pub config: Config,
    /// Run only the server end, listening here.
    pub listen: Option<SocketAddr>,
    /// Run only the client end, connecting here.
    pub connect: Option<SocketAddr>,
}

impl Default for PerfOpts {
    fn default() -> Self {
        PerfOpts {
            op: PerfOp::Write,
            size: 65536,
            iters: 1000,
            lat_iters: 0,
            poll: false,
            depth: 32,
            provider: "soft".into(),
            device: None,
            config: Config::default(),
            listen: None,
            connect: None,
        }
    }
}

/// Results (of the client end; a listen-only run reports what it served).
#[derive(Debug, Clone)]
pub struct PerfReport {
    pub op: PerfOp,
    pub size: usize,
    pub iters: u64,
    pub role: &'static str,
    pub provider: String,
    pub progress: Progress,
    pub mpa_crc: Option<bool>,
    /// Bytes per second in the bandwidth phase.
    pub bandwidth: f64,
    /// Operations per second in the bandwidth phase.
    pub msg_rate: f64,
    pub lat_p50: Option<Duration>,
    pub lat_p99: Option<Duration>,
    /// "half round trip" or "full operation".
    pub lat_kind: &'static str,
    /// Process CPU time (user + system, both ends when run in one process)
    /// per GB moved in the bandwidth phase: robust to a busy machine.
    pub cpu_s_per_gb: Option<f64>,
    /// CPU of the soft provider's engine threads (all receive-side work
    /// under `Progress::Auto`: deframing, validation, placement) per GB.
    pub engine_cpu_s_per_gb: Option<f64>,
}

impl fmt::Display for PerfReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} {} B x {} ({}, {}, {:?}, crc {}): ",
            self.op,
            self.size,
            self.iters,
            self.role,
            self.provider,
            self.progress,
            match self.mpa_crc {
                Some(true) => "on",
                Some(false) => "off",
                None => "n/a",
            }
        )?;
        if self.role == "server" {
            return write!(f, "served");
        }
        let (v, u) = if self.bandwidth >= 1e9 {
            (self.bandwidth / 1e9, "GB/s")
        } else {
            (self.bandwidth / 1e6, "MB/s")
        };
        write!(
            f,
            "{v:.2} {u} ({:.0} msg/s, {:.2} Gbit/s)",
            self.msg_rate,
            self.bandwidth * 8.0 / 1e9
        )?;
        if let Some(c) = self.cpu_s_per_gb {
            write!(f, ", CPU {c:.3} s/GB")?;
        }
        if let Some(c) = self.engine_cpu_s_per_gb {
            write!(f, " (engine threads {c:.3} s/GB)")?;
        }
        if let (Some(a), Some(b)) = (self.lat_p50, self.lat_p99) {
            write!(
                f,
                "; latency p50 {:.2} us, p99 {:.2} us ({})",
                a.as_secs_f64() * 1e6,
                b.as_secs_f64() * 1e6,
                self.lat_kind
            )?;
        }
        Ok(())
    }
}

const TIMEOUT: Duration = Duration::from_secs(60);

/// Encoded size of a [`Plan`].
const PLAN_LEN: usize = 29;

struct Plan {
    op: PerfOp,
    size: usize,
    iters: u64,
    lat_iters: u64,
    depth: u32,
}

impl Plan {
    fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(32);
        v.push(match self.op {
            PerfOp::Write => 0,
            PerfOp::Read => 1,
            PerfOp::Send => 2,
        });
        v.extend_from_slice(&(self.size as u64).to_be_bytes());
        v.extend_from_slice(&self.iters.to_be_bytes());
        v.extend_from_slice(&self.lat_iters.to_be_bytes());
        v.extend_from_slice(&self.depth.to_be_bytes());
        v
    }
    fn decode(b: &[u8]) -> Result<Plan> {
        if b.len() < PLAN_LEN {
            return Err(Error::InvalidArgument(
                "not a perf client (private data)".into(),
            ));
        }
        let u = |i: usize| u64::from_be_bytes(b[i..i + 8].try_into().expect("8"));
        Ok(Plan {
            op: match b[0] {
                0 => PerfOp::Write,
                1 => PerfOp::Read,
                _ => PerfOp::Send,
            },
            size: u(1).min(1 << 31) as usize,
            iters: u(9),
            lat_iters: u(17),
            depth: u32::from_be_bytes(b[25..29].try_into().expect("4")).clamp(1, 1024),
        })
    }
}

/// One end: context, PD, CQ (+channel), buffer.
struct End {
    ctx: Context,
    pd: Pd,
    cq: Cq,
    ch: CompChannel,
    poll: bool,
}

impl End {
    fn new(opts: &PerfOpts) -> Result<End> {
        let provider = crate::provider(&opts.provider)?;
        // Verbs without --device: the device that owns the listen address,
        // or the one the route to the peer leaves from — not merely the
        // first device on the list.
        let device = opts.device.clone().or_else(|| {
            if provider.name() != "verbs" {
                return None;
            }
            let ip = match (opts.listen, opts.connect) {
                (Some(l), _) if !l.ip().is_unspecified() => Some(l.ip()),
                (_, Some(c)) => crate::source_ip(c.ip()),
                _ => None,
            }?;
            crate::device_owning(&provider, ip)
        });
        let ctx = provider.open(device.as_deref(), &opts.config)?;
        let pd = ctx.alloc_pd()?;
        let ch = ctx.create_comp_channel()?;
        let cq = ctx.create_cq(4 * opts.depth.max(16) + 16, Some(&ch))?;
        Ok(End {
            ctx,
            pd,
            cq,
            ch,
            poll: opts.poll,
        })
    }

    fn init(&self, depth: u32) -> QpInit {
        QpInit {
            pd: self.pd.clone(),
            send_cq: self.cq.clone(),
            recv_cq: self.cq.clone(),
            cap: QpCap {
                max_send_wr: depth + 8,
                max_recv_wr: depth + 8,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: 0,
            },
            sq_sig_all: false,
            recv_window: None,
            srq: None,
        }
    }

    /// Wait for at least one completion; errors unless every one is a success.
    fn wait(&self, out: &mut [Wc]) -> Result<usize> {
        let t = Instant::now();
        loop {
            let n = if self.poll {
                self.cq.poll(out)?
            } else {
                self.cq
                    .wait(&self.ch, out, Some(Duration::from_millis(100)))?
            };
            if n > 0 {
                if let Some(w) = out[..n].iter().find(|w| !w.is_ok()) {
                    return Err(Error::Io(std::io::Error::other(format!(
                        "completion error: {w:?}"
                    ))));
                }
                return Ok(n);
            }
            if t.elapsed() > TIMEOUT {
                return Err(Error::Timeout("benchmark completion".into()));
            }
        }
    }

    /// Busy-wait until the byte at `off` of `mr` equals `v` (driving progress).
    fn spin_byte(&self, mr: &Mr, off: usize, v: u8) -> Result<()> {
        let t = Instant::now();
        let mut b = [0u8; 1];
        let mut k = 0u32;
        loop {
            mr.read_at(off, &mut b)?;
            if b[0] == v {
                std::sync::atomic::fence(std::sync::atomic::Ordering::Acquire);
                return Ok(());
            }
            self.ctx.progress()?;
            k += 1;
            if k.is_multiple_of(1 << 16) && t.elapsed() > TIMEOUT {
                return Err(Error::Timeout("waiting for a written byte".into()));
            }
        }
    }
}

fn recv(qp: &Qp, mr: &Mr, off: usize, size: usize, wr_id: u64) -> Result<()> {
    qp.post_recv(&[RecvWr {
        wr_id,
        sg_list: &[mr.sge(off, size as u32)],
    }])
    .map_err(|e| e.error)
}

fn post(qp: &Qp, op: SendOp, sge: Sge, wr_id: u64, signaled: bool) -> Result<()> {
    let sg = [sge];
    let mut w = SendWr::new(wr_id, op, if sge.length == 0 { &[] } else { &sg });
    w.signaled = signaled;
    qp.post_send(&[w]).map_err(|e| e.error)
}

fn remote_info(addr: u64, rkey: u32) -> Vec<u8> {
    let mut v = addr.to_be_bytes().to_vec();
    v.extend_from_slice(&rkey.to_be_bytes());
    v
}

fn parse_remote(b: &[u8]) -> Result<(u64, u32)> {
    if b.len() < 12 {
        return Err(Error::Handshake("peer sent no buffer description".into()));
    }
    Ok((
        u64::from_be_bytes(b[..8].try_into().expect("8")),
        u32::from_be_bytes(b[8..12].try_into().expect("4")),
    ))
}

const ACCESS: Access = Access::LOCAL_WRITE
    .union(Access::REMOTE_WRITE)
    .union(Access::REMOTE_READ);

/// wr_id of the server's credit messages.
const CREDIT_WR: u64 = u64::MAX - 1;

/// Send bandwidth flow control: the receives the server posts first, and
/// how many more each 1-byte credit message grants.
fn send_credits(iters: u64, depth: u32) -> (u64, u64) {
    let window = iters.min(u64::from(depth) + 4);
    (window, (u64::from(depth) / 2).max(1))
}

/// Serve one client on `l` (the server end).
fn serve(end: &End, l: &Listener) -> Result<()> {
    let req = l
        .get_request(Some(TIMEOUT))?
        .ok_or_else(|| Error::Timeout("no benchmark client".into()))?;
    let plan = Plan::decode(req.private_data())?;
    let half = plan.size.max(64);
    // Source half [0, half), sink half [half, 2*half).
    let mr = end.pd.alloc_mr(2 * half, ACCESS)?;
    let params = ConnParams {
        private_data: remote_info(mr.addr() + half as u64, mr.rkey()),
        ird: 16,
        ord: 16,
    };
    // iWARP has no RNR retry: a Send that finds no receive posted breaks
    // the connection. So every receive is posted before the client can
    // send what lands in it: the first one before the acceptance reaches
    // the client, the next one before each echo, the bandwidth window
    // before the last echo.
    let (window, step) = send_credits(plan.iters, plan.depth);
    let first: Vec<Sge> = match plan.op {
        PerfOp::Send if plan.lat_iters > 0 => vec![mr.sge(half, plan.size as u32)],
        PerfOp::Send => (0..window)
            .map(|_| mr.sge(half, plan.size as u32))
            .collect(),
        _ => Vec::new(),
    };
    let sgl: Vec<[Sge; 1]> = first.iter().map(|s| [*s]).collect();
    let pre: Vec<RecvWr<'_>> = sgl
        .iter()
        .enumerate()
        .map(|(i, s)| RecvWr {
            wr_id: i as u64,
            sg_list: s,
        })
        .collect();
    let qp = req.accept_with_recvs(&end.init(plan.depth), &params, &pre)?;
    let (raddr, rkey) = parse_remote(
        qp.negotiated()
            .peer_private_data
            .get(PLAN_LEN..)
            .unwrap_or(&[]),
    )?;
    let size = plan.size;
    let mut wcs = [crate::verbs::Wc::BLANK; 64];
    match plan.op {
        PerfOp::Send => {
            // Latency: echo each message back (the receive for the next
            // one, or the bandwidth window, posted before the echo).
            for i in 0..plan.lat_iters {
                end.wait(&mut wcs[..1])?;
                if i + 1 < plan.lat_iters {
                    recv(&qp, &mr, half, size, i + 1)?;
                } else {
                    for w in 0..window {
                        recv(&qp, &mr, half, size, w)?;
                    }
                }
                post(&qp, SendOp::Send, mr.sge(0, size as u32), i, true)?;
                end.wait(&mut wcs[..1])?;
            }
            // Bandwidth: receive `iters` messages, then acknowledge. A
            // sender's completions say only that its data left, so the
            // client sends within credits: the window of receives posted
            // first, plus `step` for every 1-byte credit message we send
            // after reposting that many (and after the last repost).
            let mut posted = window;
            let mut got = 0u64;
            let mut since_credit = 0u64;
            while got < plan.iters {
                let n = end.wait(&mut wcs)?;
                for w in &wcs[..n] {
                    if w.opcode != WcOpcode::Recv {
                        continue; // a credit message's send completion
                    }
                    got += 1;
                    if posted < plan.iters {
                        recv(&qp, &mr, half, size, posted)?;
                        posted += 1;
                        since_credit += 1;
                        if since_credit == step || posted == plan.iters {
                            since_credit = 0;
                            post(&qp, SendOp::Send, mr.sge(0, 1), CREDIT_WR, true)?;
                        }
                    }
                }
            }
            post(&qp, SendOp::Send, mr.sge(0, 0), 0, true)?;
            // Our final send's completion (credit sends may still complete).
            loop {
                let n = end.wait(&mut wcs[..1])?;
                if n == 1 && wcs[0].wr_id != CREDIT_WR {
                    break;
                }
            }
        }
        PerfOp::Write => {
            if size > 0 {
                for i in 0..plan.lat_iters {
                    let tag = (i % 255) as u8 + 1;
                    end.spin_byte(&mr, half + size - 1, tag)?;
                    mr.write_at(size - 1, &[tag])?;
                    post(
                        &qp,
                        SendOp::Write {
                            remote_addr: raddr,
                            rkey,
                        },
                        mr.sge(0, size as u32),
                        i,
                        true,
                    )?;
                    end.wait(&mut wcs[..1])?;
                }
            }
            // Bandwidth: the client's closing send, then our ack.
            recv(&qp, &mr, 0, 0, 0)?;
            end.wait(&mut wcs[..1])?;
            post(&qp, SendOp::Send, mr.sge(0, 0), 0, true)?;
            end.wait(&mut wcs[..1])?;
        }
        PerfOp::Read => {
            recv(&qp, &mr, 0, 0, 0)?;
            end.wait(&mut wcs[..1])?;
        }
    }
    // Wait for the client to finish with us.
    let t = Instant::now();
    while qp.state() == QpState::Rts && t.elapsed() < Duration::from_secs(5) {
        end.ctx.progress()?;
        std::thread::sleep(Duration::from_micros(100));
    }
    Ok(())
}

fn percentile(v: &mut [Duration], p: f64) -> Option<Duration> {
    if v.is_empty() {
        return None;
    }
    v.sort_unstable();
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    Some(v[i.min(v.len() - 1)])
}

/// The client end.
fn client(end: &End, opts: &PerfOpts, addr: SocketAddr) -> Result<PerfReport> {
    let size = opts.size;
    let plan = Plan {
        op: opts.op,
        size,
        iters: opts.iters,
        lat_iters: if opts.lat_iters == 0 {
            opts.iters.min(10_000)
        } else {
            opts.lat_iters
        },
        depth: opts.depth.clamp(1, 1024),
    };
    let half = size.max(64);
    let mr = end.pd.alloc_mr(2 * half, ACCESS)?;
    let mut pd = plan.encode();
    pd.extend_from_slice(&remote_info(mr.addr() + half as u64, mr.rkey()));
    let params = ConnParams {
        private_data: pd,
        ird: 16,
        ord: 16,
    };
    let qp = end.ctx.connect(addr, &end.init(plan.depth), &params)?;
    let (raddr, rkey) = parse_remote(&qp.negotiated().peer_private_data)?;
    let depth = match opts.op {
        PerfOp::Read => plan.depth.min(qp.negotiated().ord.max(1) as u32),
        _ => plan.depth,
    } as u64;
    let mut wcs = [crate::verbs::Wc::BLANK; 64];
    let mut lat = Vec::with_capacity(plan.lat_iters as usize);
    let write = SendOp::Write {
        remote_addr: raddr,
        rkey,
    };
    let read = SendOp::Read {
        remote_addr: raddr,
        rkey,
    };
    // Latency phase.
    let mut lat_kind = "half round trip";
    match opts.op {
        PerfOp::Send => {
            for i in 0..plan.lat_iters {
                recv(&qp, &mr, half, size, i)?;
                let t = Instant::now();
                post(&qp, SendOp::Send, mr.sge(0, size as u32), i, true)?;
                let mut seen = 0;
                while seen < 2 {
                    seen += end.wait(&mut wcs[..2])?;
                }
                lat.push(t.elapsed() / 2);
            }
        }
        PerfOp::Write if size > 0 => {
            for i in 0..plan.lat_iters {
                let tag = (i % 255) as u8 + 1;
                mr.write_at(size - 1, &[tag])?;
                let t = Instant::now();
                post(&qp, write, mr.sge(0, size as u32), i, true)?;
                end.spin_byte(&mr, half + size - 1, tag)?;
                lat.push(t.elapsed() / 2);
                end.wait(&mut wcs[..1])?;
            }
        }
        PerfOp::Write => {}
        PerfOp::Read => {
            lat_kind = "full operation";
            for i in 0..plan.lat_iters {
                let t = Instant::now();
                post(&qp, read, mr.sge(0, size as u32), i, true)?;
                end.wait(&mut wcs[..1])?;
                lat.push(t.elapsed());
            }
        }
    }
    // Bandwidth phase.
    let op = match opts.op {
        PerfOp::Write => write,
        PerfOp::Read => read,
        PerfOp::Send => SendOp::Send,
    };
    // Sends go within the server's credits (see `serve`); the final ack
    // and the 1-byte credit messages land in receives posted here.
    let (window, step) = send_credits(plan.iters, plan.depth);
    let mut granted = if opts.op == PerfOp::Send {
        window
    } else {
        u64::MAX
    };
    // Credit messages unread at once: at most one per `step` of the window,
    // plus the last one; and the final ack.
    let credit_recvs = if opts.op == PerfOp::Send {
        window / step + 2
    } else {
        0
    };
    if opts.op != PerfOp::Read {
        for _ in 0..=credit_recvs {
            recv(&qp, &mr, half, 1, u64::MAX)?;
        }
    }
    let t = Instant::now();
    let cpu0 = cpu_now();
    let eng0 = engine_cpu();
    let (mut posted, mut done, mut acked) = (0u64, 0u64, false);
    while done < plan.iters {
        while posted < plan.iters && posted - done < depth && posted < granted {
            post(&qp, op, mr.sge(0, size as u32), posted, true)?;
            posted += 1;
        }
        let n = end.wait(&mut wcs)?;
        for w in &wcs[..n] {
            if w.opcode == WcOpcode::Recv {
                if w.byte_len == 1 {
                    granted = granted.saturating_add(step);
                    recv(&qp, &mr, half, 1, u64::MAX)?;
                } else {
                    acked = true;
                }
            } else {
                done += 1;
            }
        }
    }
    match opts.op {
        PerfOp::Write => {
            // All writes are placed once our send arrives; wait for the ack.
            post(&qp, SendOp::Send, mr.sge(0, 0), 0, true)?;
            let mut seen = 0;
            while seen < 2 {
                seen += end.wait(&mut wcs[..2])?;
            }
        }
        PerfOp::Send => {
            // The ack is the 0-byte message; late credit messages may come first.
            while !acked {
                let n = end.wait(&mut wcs[..1])?;
                if n == 1 && wcs[0].opcode == WcOpcode::Recv && wcs[0].byte_len == 0 {
                    acked = true;
                }
            }
        }
        PerfOp::Read => {
            post(&qp, SendOp::Send, mr.sge(0, 0), 0, true)?;
            end.wait(&mut wcs[..1])?;
        }
    }
    let el = t.elapsed().as_secs_f64().max(1e-9);
    let cpu = cpu_now() - cpu0;
    let eng = engine_cpu().zip(eng0).map(|(a, b)| a - b);
    let gb = plan.iters as f64 * size as f64 / 1e9;
    let _ = qp.disconnect();
    let p50 = percentile(&mut lat, 0.5);
    let p99 = percentile(&mut lat, 0.99);
    Ok(PerfReport {
        op: opts.op,
        size,
        iters: plan.iters,
        role: "client",
        provider: opts.provider.clone(),
        progress: opts.config.progress,
        mpa_crc: qp.negotiated().mpa_crc,
        bandwidth: (plan.iters as f64 * size as f64) / el,
        msg_rate: plan.iters as f64 / el,
        lat_p50: p50,
        lat_p99: p99,
        lat_kind,
        cpu_s_per_gb: (gb > 0.0).then_some(cpu / gb.max(1e-12)),
        engine_cpu_s_per_gb: eng.filter(|_| gb > 0.0).map(|e| e / gb.max(1e-12)),
    })
}

/// CPU seconds used so far by this process's soft engine threads
/// (`/proc/self/task/*/stat`), if there are any.
fn engine_cpu() -> Option<f64> {
    let tick = {
        // SAFETY: sysconf has no memory effects.
        let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
        if t <= 0 {
            100.0
        } else {
            t as f64
        }
    };
    let mut total = 0u64;
    let mut found = false;
    for e in std::fs::read_dir("/proc/self/task").ok()?.flatten() {
        let stat = std::fs::read_to_string(e.path().join("stat")).unwrap_or_default();
        // "tid (comm) state ... utime(14) stime(15)"
        let (Some(a), Some(b)) = (stat.find('('), stat.rfind(')')) else {
            continue;
        };
        if !stat[a + 1..b].starts_with("lwio-soft-engin") {
            continue;
        }
        let f: Vec<&str> = stat[b + 1..].split_whitespace().collect();
        if let (Some(u), Some(s)) = (f.get(11), f.get(12)) {
            total += u.parse::<u64>().unwrap_or(0) + s.parse::<u64>().unwrap_or(0);
            found = true;
        }
    }
    found.then_some(total as f64 / tick)
}

/// User + system CPU seconds of this process so far.
fn cpu_now() -> f64 {
    // SAFETY: getrusage writes one `rusage` into the zeroed local.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: as above; RUSAGE_SELF is always valid.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) } != 0 {
        return 0.0;
    }
    let t = |v: libc::timeval| v.tv_sec as f64 + v.tv_usec as f64 / 1e6;
    t(u.ru_utime) + t(u.ru_stime)
}

/// Run the benchmark.
pub fn run(opts: &PerfOpts) -> Result<PerfReport> {
    if opts.size > u32::MAX as usize {
        return Err(Error::InvalidArgument("size above 4 GiB".into()));
    }
    match (opts.listen, opts.connect) {
        (Some(_), Some(_)) => Err(Error::InvalidArgument(
            "give --listen or --connect, not both".into(),
        )),
        (Some(addr), None) => {
            let end = End::new(opts)?;
            let l = end.ctx.listen(addr, 4)?;
            serve(&end, &l)?;
            Ok(PerfReport {
                op: opts.op,
                size: opts.size,
                iters: opts.iters,
                role: "server",
                provider: opts.provider.clone(),
                progress: opts.config.progress,
                mpa_crc: None,
                bandwidth: 0.0,
                msg_rate: 0.0,
                lat_p50: None,
                lat_p99: None,
                lat_kind: "",
                cpu_s_per_gb: None,
                engine_cpu_s_per_gb: None,
            })
        }
        (None, Some(addr)) => client(&End::new(opts)?, opts, addr),
        (None, None) => {
            let server = End::new(opts)?;
            let l = server.ctx.listen("127.0.0.1:0".parse().expect("addr"), 4)?;
            let addr = l.local_addr();
            std::thread::scope(|sc| {
                let h = sc.spawn(|| serve(&server, &l));
                let c = End::new(opts).and_then(|e| client(&e, opts, addr));
                let s = h.join().unwrap_or_else(|_| {
                    Err(Error::Io(std::io::Error::other("server thread panicked")))
                });
                let r = c?;
                s?;
                Ok(r)
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn quick(op: PerfOp, size: usize, progress: Progress, poll: bool) {
        let opts = PerfOpts {
            op,
            size,
            iters: 200,
            lat_iters: 50,
            poll,
            depth: 8,
            config: Config {
                progress,
                ..Config::default()
            },
            ..PerfOpts::default()
        };
        let r = run(&opts).unwrap_or_else(|e| panic!("{op} {size} {progress:?}: {e}"));
        assert!(r.bandwidth > 0.0 || size == 0, "{r}");
        assert!(r.msg_rate > 0.0, "{r}");
        if op != PerfOp::Write || size > 0 {
            assert!(r.lat_p50.is_some() && r.lat_p99 >= r.lat_p50, "{r}");
        }
        eprintln!("{r}");
    }

    #[test]
    fn perf_loopback_all_ops() {
        for op in [PerfOp::Write, PerfOp::Read, PerfOp::Send] {
            quick(op, 4096, Progress::Auto, false);
            quick(op, 65537, Progress::Manual, true);
        }
        quick(PerfOp::Send, 0, Progress::Auto, true);
        quick(PerfOp::Write, 0, Progress::Manual, true);
    }

    /// Send bandwidth runs within the server's credits, including a last
    /// partial step (203 messages: a window of 12, then steps of 4).
    #[test]
    fn send_credits_cover_every_message() {
        assert_eq!(send_credits(203, 8), (12, 4));
        assert_eq!(send_credits(3, 8), (3, 4));
        assert_eq!(send_credits(1000, 1), (5, 1));
        for iters in [1, 3, 12, 13, 203] {
            let opts = PerfOpts {
                op: PerfOp::Send,
                size: 512,
                iters,
                lat_iters: 3,
                depth: 8,
                ..PerfOpts::default()
            };
            let r = run(&opts).unwrap_or_else(|e| panic!("{iters} sends: {e}"));
            assert_eq!(r.iters, iters);
        }
    }

    #[test]
    fn perf_listen_and_connect_ends() {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        let base = PerfOpts {
            op: PerfOp::Send,
            size: 1000,
            iters: 100,
            lat_iters: 20,
            depth: 4,
            ..PerfOpts::default()
        };
        let server = PerfOpts {
            listen: Some(addr),
            ..base.clone()
        };
        let h = std::thread::spawn(move || run(&server));
        let client = PerfOpts {
            connect: Some(addr),
            ..base
        };
        let t = std::time::Instant::now();
        let r = loop {
            match run(&client) {
                Err(Error::Unreachable(_)) if t.elapsed() < Duration::from_secs(10) => {
                    std::thread::sleep(Duration::from_millis(20))
                }
                r => break r.unwrap(),
            }
        };
        assert_eq!(r.role, "client");
        assert!(r.lat_p50.is_some() && r.msg_rate > 0.0, "{r}");
        let s = h.join().unwrap().unwrap();
        assert_eq!(s.role, "server");
        assert!(format!("{s}").ends_with("served"));
    }

    /// Ad-hoc measurement: `PERF_OP=write PERF_SIZE=1048576 PERF_ITERS=2000
    /// PERF_PROGRESS=manual PERF_POLL=1 PERF_CRC=1 cargo test --release -p
    /// lwio-rdma --lib perf_adhoc -- --ignored --nocapture`.
    #[test]
    #[ignore]
    fn perf_adhoc() {
        let env = |k: &str, d: &str| std::env::var(k).unwrap_or_else(|_| d.to_string());
        let opts = PerfOpts {
            op: env("PERF_OP", "write").parse().unwrap(),
            size: env("PERF_SIZE", "65536").parse().unwrap(),
            iters: env("PERF_ITERS", "1000").parse().unwrap(),
            lat_iters: env("PERF_LAT_ITERS", "0").parse().unwrap(),
            poll: env("PERF_POLL", "1") == "1",
            depth: env("PERF_DEPTH", "32").parse().unwrap(),
            config: Config {
                progress: if env("PERF_PROGRESS", "auto") == "manual" {
                    Progress::Manual
                } else {
                    Progress::Auto
                },
                mpa_crc: if env("PERF_CRC", "0") == "1" {
                    CrcPolicy::Required
                } else {
                    CrcPolicy::Off
                },
                ..Config::default()
            },
            ..PerfOpts::default()
        };
        crate::soft::qp::DIRECT_PLACEMENT.store(
            env("PERF_DIRECT", "1") == "1",
            std::sync::atomic::Ordering::Relaxed,
        );
        println!("{}", run(&opts).unwrap());
    }
}
