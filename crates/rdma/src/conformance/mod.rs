//! A provider-neutral conformance suite for the verbs API.
//!
//! It uses only the public API of [`crate::verbs`] (plus, when a QP belongs
//! to the soft provider, its debug counters), and takes the two contexts to
//! use, so the same cases run soft↔soft, verbs↔verbs (rxe/siw) or soft↔siw.
//!
//! Each case connects a fresh QP pair through the server context's listener,
//! runs, and reports [`Outcome::Pass`], [`Outcome::Fail`] or
//! [`Outcome::Skip`]. Under manual progress the suite drives both contexts
//! itself (`Context::progress`, a no-op for hardware) while it waits.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use crate::verbs::*;

/// The result of one case.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Pass,
    Fail(String),
    Skip(String),
}

/// A named case result.
#[derive(Debug, Clone)]
pub struct CaseResult {
    pub name: &'static str,
    pub outcome: Outcome,
    pub elapsed: Duration,
}

impl std::fmt::Display for CaseResult {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.outcome {
            Outcome::Pass => write!(f, "PASS {}", self.name),
            Outcome::Fail(w) => write!(f, "FAIL {}: {w}", self.name),
            Outcome::Skip(w) => write!(f, "SKIP {}: {w}", self.name),
        }
    }
}

enum CaseErr {
    Fail(String),
    Skip(String),
}

impl From<String> for CaseErr {
    fn from(s: String) -> CaseErr {
        CaseErr::Fail(s)
    }
}
impl From<Error> for CaseErr {
    fn from(e: Error) -> CaseErr {
        CaseErr::Fail(e.to_string())
    }
}
impl From<PostError> for CaseErr {
    fn from(e: PostError) -> CaseErr {
        CaseErr::Fail(e.to_string())
    }
}

type R = std::result::Result<(), CaseErr>;
type CaseFn = fn(&Env<'_>) -> R;

macro_rules! fail {
    ($($t:tt)*) => { return Err(CaseErr::Fail(format!($($t)*))) };
}
macro_rules! ensure {
    ($c:expr, $($t:tt)*) => { if !$c { fail!($($t)*) } };
}

/// The message sizes every data operation is checked at.
pub const SIZES: [usize; 6] = [0, 1, 4095, 4096, 65537, (1 << 20) + 3];
const MAXSZ: usize = (1 << 20) + 3;
const GUARD: usize = 16;
const TIMEOUT: Duration = Duration::from_secs(20);

/// Every case, in run order.
pub fn case_names() -> Vec<&'static str> {
    CASES.iter().map(|c| c.0).collect()
}

const CASES: &[(&str, CaseFn)] = &[
    ("send_recv_sizes", case_send_sizes),
    ("send_with_invalidate_sizes", case_send_inv_sizes),
    ("rdma_write_sizes", case_write_sizes),
    ("rdma_read_sizes", case_read_sizes),
    ("write_with_imm", case_write_imm),
    ("recv_scatter_multi_sge", case_multi_sge),
    ("ordering_many_posts", case_ordering),
    ("ordering_send_after_writes", case_send_after_writes),
    ("post_lists", case_post_lists),
    ("unsignaled_writes", case_unsignaled),
    ("flush_on_set_error", case_flush_set_error),
    ("flush_on_peer_disconnect", case_flush_disconnect),
    ("cm_reject_private_data", case_reject),
    ("cm_accept_private_data", case_accept_pd),
    ("cm_ird_ord_negotiated", case_ird_ord),
    ("cq_channel_blocking_wait", case_channel_wait),
    ("cq_arm_solicited_only", case_solicited),
    ("srq_two_qps_share_receives", case_srq),
    ("cq_tagged_channel_reports_fired", case_tagged_cqs),
    ("prot_write_wrong_key", prot_write_wrong_key),
    ("prot_read_wrong_key", prot_read_wrong_key),
    ("prot_write_other_pd_key", prot_other_pd),
    ("prot_write_oob_low", prot_write_oob_low),
    ("prot_write_oob_high", prot_write_oob_high),
    ("prot_read_oob_low", prot_read_oob_low),
    ("prot_read_oob_high", prot_read_oob_high),
    ("prot_write_read_only_region", prot_write_ro),
    ("prot_read_write_only_region", prot_read_wo),
    ("prot_unbound_window", prot_unbound_window),
    ("prot_one_shot_window_reused", prot_one_shot_reuse),
    ("prot_deregistered_region", prot_dereg),
    ("prot_invalidated_window_old_key", prot_stale_key),
    ("mw_bind_byte_granularity", case_mw_granularity),
    ("mw_one_shot", case_mw_one_shot),
    ("mw_send_with_invalidate", case_mw_send_inv),
    ("recv_flow_control_indicate_window", case_flow_control),
    ("pd_census_counts", case_pd_census),
    ("mw_on_region_without_remote_rights", case_mw_local_region),
];

/// The environment of a run.
pub struct Env<'a> {
    server: &'a Context,
    client: &'a Context,
    listener: Listener,
    connect_to: SocketAddr,
}

/// Run every case. `server_addr` is where the server context listens (port
/// 0 = any; an unspecified IP is reached through 127.0.0.1).
pub fn run(server: &Context, client: &Context, server_addr: SocketAddr) -> Result<Vec<CaseResult>> {
    run_filtered(server, client, server_addr, |_| true)
}

/// Run the cases whose name `filter` accepts.
pub fn run_filtered(
    server: &Context,
    client: &Context,
    server_addr: SocketAddr,
    filter: impl Fn(&str) -> bool,
) -> Result<Vec<CaseResult>> {
    let env = Env::new(server, client, server_addr)?;
    Ok(CASES
        .iter()
        .filter(|c| filter(c.0))
        .map(|&(name, f)| env.run_one(name, f))
        .collect())
}

/// Run one case by name.
pub fn run_case(
    server: &Context,
    client: &Context,
    server_addr: SocketAddr,
    name: &str,
) -> Result<CaseResult> {
    let (n, f) = CASES
        .iter()
        .find(|c| c.0 == name)
        .ok_or_else(|| Error::InvalidArgument(format!("no conformance case {name:?}")))?;
    let env = Env::new(server, client, server_addr)?;
    Ok(env.run_one(n, *f))
}

impl<'a> Env<'a> {
    fn new(server: &'a Context, client: &'a Context, server_addr: SocketAddr) -> Result<Env<'a>> {
        let listener = server.listen(server_addr, 64)?;
        let mut connect_to = listener.local_addr();
        if connect_to.ip().is_unspecified() {
            connect_to.set_ip(IpAddr::V4(Ipv4Addr::LOCALHOST));
        }
        Ok(Env {
            server,
            client,
            listener,
            connect_to,
        })
    }

    fn run_one(&self, name: &'static str, f: CaseFn) -> CaseResult {
        let t = Instant::now();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(self)));
        let outcome = match r {
            Ok(Ok(())) => Outcome::Pass,
            Ok(Err(CaseErr::Fail(w))) => Outcome::Fail(w),
            Ok(Err(CaseErr::Skip(w))) => Outcome::Skip(w),
            Err(p) => Outcome::Fail(format!(
                "panicked: {}",
                p.downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default()
            )),
        };
        CaseResult {
            name,
            outcome,
            elapsed: t.elapsed(),
        }
    }

    fn progress(&self) {
        let _ = self.server.progress();
        let _ = self.client.progress();
    }

    fn both_soft(&self) -> bool {
        self.server.device().provider == "soft" && self.client.device().provider == "soft"
    }

    /// Wait for exactly `n` completions on `cq`.
    fn wait(&self, cq: &Cq, n: usize) -> std::result::Result<Vec<Wc>, String> {
        let mut out = Vec::with_capacity(n);
        let mut buf = [Wc::BLANK; 32];
        let t = Instant::now();
        let mut idle = 0u32;
        while out.len() < n {
            let want = (n - out.len()).min(buf.len());
            let k = cq
                .poll(&mut buf[..want])
                .map_err(|e| format!("poll: {e}"))?;
            out.extend_from_slice(&buf[..k]);
            if k == 0 {
                self.progress();
                idle += 1;
                if idle > 64 {
                    std::thread::sleep(Duration::from_micros(50));
                }
                if t.elapsed() > TIMEOUT {
                    return Err(format!(
                        "timed out waiting for {n} completions, got {}: {:?}",
                        out.len(),
                        out
                    ));
                }
            } else {
                idle = 0;
            }
        }
        Ok(out)
    }

    /// Poll for `d`, expecting no completion.
    fn quiet(&self, cq: &Cq, d: Duration) -> std::result::Result<(), String> {
        let t = Instant::now();
        let mut buf = [Wc::BLANK; 4];
        while t.elapsed() < d {
            let k = cq.poll(&mut buf).map_err(|e| format!("poll: {e}"))?;
            if k > 0 {
                return Err(format!("unexpected completion(s): {:?}", &buf[..k]));
            }
            self.progress();
            std::thread::sleep(Duration::from_micros(200));
        }
        Ok(())
    }

    /// Wait until `qp` is in the error state.
    fn wait_error(&self, qp: &Qp) -> std::result::Result<(), String> {
        let t = Instant::now();
        while qp.state() != QpState::Error {
            self.progress();
            if t.elapsed() > TIMEOUT {
                return Err(format!("QP still in {:?}", qp.state()));
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        Ok(())
    }

    /// The next connection request, polling so a failed client can abort.
    fn request(&self, abort: &std::sync::atomic::AtomicBool) -> Result<ConnRequest> {
        let t = Instant::now();
        loop {
            if let Some(r) = self.listener.get_request(Some(Duration::from_millis(20)))? {
                return Ok(r);
            }
            if abort.load(std::sync::atomic::Ordering::Acquire) {
                return Err(Error::Timeout("client gave up".into()));
            }
            if t.elapsed() > TIMEOUT {
                return Err(Error::Timeout("no connection request".into()));
            }
        }
    }

    fn connect(&self, sp: &ConnParams, cp: &ConnParams) -> std::result::Result<Conn, CaseErr> {
        self.connect_with(sp, cp, None)
    }

    fn connect_with(
        &self,
        sp: &ConnParams,
        cp: &ConnParams,
        server_pd: Option<Pd>,
    ) -> std::result::Result<Conn, CaseErr> {
        let spd = match server_pd {
            Some(p) => p,
            None => self.server.alloc_pd()?,
        };
        let scq = self.server.create_cq(4096, None)?;
        let cpd = self.client.alloc_pd()?;
        let ccq = self.client.create_cq(4096, None)?;
        let cap = QpCap {
            max_send_wr: 256,
            max_recv_wr: 256,
            max_send_sge: 4,
            max_recv_sge: 4,
            max_inline_data: 64,
        };
        let sinit = QpInit {
            pd: spd.clone(),
            send_cq: scq.clone(),
            recv_cq: scq.clone(),
            cap,
            sq_sig_all: false,
            recv_window: None,
            srq: None,
        };
        let cinit = QpInit {
            pd: cpd.clone(),
            send_cq: ccq.clone(),
            recv_cq: ccq.clone(),
            cap,
            sq_sig_all: false,
            recv_window: None,
            srq: None,
        };
        let (sqp, cqp) = self.connect_qps(&sinit, &cinit, sp, cp)?;
        Ok(Conn {
            s: End {
                pd: spd,
                cq: scq,
                qp: sqp,
            },
            c: End {
                pd: cpd,
                cq: ccq,
                qp: cqp,
            },
        })
    }
}

impl Env<'_> {
    /// Connect a client QP made of `cinit` to a server QP made of `sinit`;
    /// returns (server QP, client QP).
    fn connect_qps(
        &self,
        sinit: &QpInit,
        cinit: &QpInit,
        sp: &ConnParams,
        cp: &ConnParams,
    ) -> std::result::Result<(Qp, Qp), CaseErr> {
        let abort = std::sync::atomic::AtomicBool::new(false);
        let (sres, cres) = std::thread::scope(|sc| {
            let h = sc.spawn(|| -> Result<Qp> { self.request(&abort)?.accept(sinit, sp) });
            let c = self.client.connect(self.connect_to, cinit, cp);
            if c.is_err() {
                abort.store(true, std::sync::atomic::Ordering::Release);
            }
            (h.join(), c)
        });
        let cqp = cres.map_err(|e| format!("client connect: {e}"))?;
        let sqp = match sres {
            Ok(r) => r.map_err(|e| format!("server accept: {e}"))?,
            Err(_) => fail!("server accept thread panicked"),
        };
        Ok((sqp, cqp))
    }

    /// A client end (own PD and CQ) connected to a server QP made of `sinit`.
    fn client_to(&self, sinit: &QpInit) -> std::result::Result<(Qp, End), CaseErr> {
        let pd = self.client.alloc_pd()?;
        let cq = self.client.create_cq(256, None)?;
        let cinit = QpInit::new(&pd, &cq);
        let (sqp, qp) = self.connect_qps(sinit, &cinit, &params(b""), &params(b""))?;
        Ok((sqp, End { pd, cq, qp }))
    }
}

struct End {
    pd: Pd,
    cq: Cq,
    qp: Qp,
}

struct Conn {
    s: End,
    c: End,
}

/// A deterministic byte pattern.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

fn read_mr(mr: &Mr, off: usize, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    mr.read_at(off, &mut v).expect("in range");
    v
}

fn cmp(what: &str, got: &[u8], want: &[u8]) -> std::result::Result<(), String> {
    if got.len() != want.len() {
        return Err(format!("{what}: length {} != {}", got.len(), want.len()));
    }
    match got.iter().zip(want).position(|(a, b)| a != b) {
        None => Ok(()),
        Some(i) => Err(format!(
            "{what}: first difference at byte {i} of {}: got {:#04x}, want {:#04x}",
            want.len(),
            got[i],
            want[i]
        )),
    }
}

/// `data` at `off` of `mr`, with `GUARD` bytes of 0xEE before (if `off`
/// leaves room) and after it.
fn guarded(mr: &Mr, off: usize, data: &[u8]) -> std::result::Result<(), String> {
    let size = data.len();
    cmp(&format!("size {size} data"), &read_mr(mr, off, size), data)?;
    if off >= GUARD {
        cmp(
            &format!("size {size} low guard"),
            &read_mr(mr, off - GUARD, GUARD),
            &[0xEE; GUARD],
        )?;
    }
    cmp(
        &format!("size {size} high guard"),
        &read_mr(mr, off + size, GUARD),
        &[0xEE; GUARD],
    )
}

fn check_ok(w: &Wc, wr_id: u64, op: WcOpcode) -> std::result::Result<(), String> {
    if w.status != WcStatus::Success || w.wr_id != wr_id || w.opcode != op {
        return Err(format!("expected {op:?} wr_id {wr_id} Success, got {w:?}"));
    }
    Ok(())
}

const RW: Access = Access::LOCAL_WRITE
    .union(Access::REMOTE_WRITE)
    .union(Access::REMOTE_READ);

fn send_wr<'a>(wr_id: u64, op: SendOp, sg: &'a [Sge]) -> SendWr<'a> {
    SendWr::new(wr_id, op, sg)
}

fn params(pd: &[u8]) -> ConnParams {
    ConnParams {
        private_data: pd.to_vec(),
        ird: 8,
        ord: 8,
    }
}

// ---------------------------------------------------------------------------
// The cases, by kind (after the macros they use).

mod connection;
mod data;
mod flow;
mod protection;
mod windows;

use connection::*;
use data::*;
use flow::*;
use protection::*;
use windows::*;

// ---------------------------------------------------------------------------
// Known deviations of kernel drivers.

/// Which end of a run must be on the deviating driver.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    Server,
    Client,
}

/// A verified deviation of a device driver from what a case checks (and,
/// where a protection property is concerned, from the RFCs). A case listed
/// here that fails is reported `XFAIL` and does not fail the run.
#[derive(Debug, Clone, Copy)]
pub struct Deviation {
    /// Driver of the deviating end (see [`driver_of`]).
    pub driver: &'static str,
    /// The end that must be on `driver`.
    pub side: Side,
    /// If set, the other end's driver must be this (the deviation only shows
    /// with that peer).
    pub peer: Option<&'static str>,
    pub case: &'static str,
    pub reason: &'static str,
    /// Where it is explained (`docs/interop.md#…`).
    pub reference: &'static str,
}

/// Why siw fails the Send-with-Invalidate cases (shared by two entries).
const SIW_INVALIDATED_RKEY: &str =
    "siw invalidates the STag but reports the invalidated key only to kernel CQs \
     (siw_rqe_complete), so a user-space receive has no invalidated_rkey";
/// Why a refused Read's error class differs with siw (shared by three entries).
const SIW_TERMINATE_NIBBLES: &str =
    "siw's Terminate for a refused Read has layer and etype nibbles swapped \
     (little-endian bitfields): RDMAP/remote-protection arrives as DDP/0, \
     which RFC 5040 maps to a remote operation error, not an access error";

/// Every known deviation. Only list what was reproduced in the VM and is
/// explained by the driver's source (docs/interop.md, "Known deviations").
pub const DEVIATIONS: &[Deviation] = &[
    Deviation {
        driver: "siw",
        side: Side::Server,
        peer: None,
        case: "send_with_invalidate_sizes",
        reason: SIW_INVALIDATED_RKEY,
        reference: "docs/interop.md#siw-invalidated-rkey",
    },
    Deviation {
        driver: "siw",
        side: Side::Server,
        peer: None,
        case: "mw_send_with_invalidate",
        reason: SIW_INVALIDATED_RKEY,
        reference: "docs/interop.md#siw-invalidated-rkey",
    },
    Deviation {
        driver: "siw",
        side: Side::Server,
        peer: None,
        case: "cq_arm_solicited_only",
        reason: "siw never raises a solicited-only CQ event for a receive \
                 (siw_rqe_complete notifies with SIW_WQE_SIGNALLED, not SOLICITED)",
        reference: "docs/interop.md#siw-solicited-events",
    },
    Deviation {
        driver: "siw",
        side: Side::Server,
        peer: None,
        case: "prot_read_write_only_region",
        reason: "PROTECTION NOT ENFORCED: siw serves an RDMA Read from a region registered \
                 without REMOTE_READ (siw_check_sgl_tx(pd, wqe, 0) checks no permission)",
        reference: "docs/interop.md#siw-remote-read-not-enforced",
    },
    Deviation {
        driver: "siw",
        side: Side::Server,
        peer: Some("soft"),
        case: "prot_read_wrong_key",
        reason: SIW_TERMINATE_NIBBLES,
        reference: "docs/interop.md#siw-terminate-nibbles",
    },
    Deviation {
        driver: "siw",
        side: Side::Server,
        peer: Some("soft"),
        case: "prot_read_oob_low",
        reason: SIW_TERMINATE_NIBBLES,
        reference: "docs/interop.md#siw-terminate-nibbles",
    },
    Deviation {
        driver: "siw",
        side: Side::Server,
        peer: Some("soft"),
        case: "prot_read_oob_high",
        reason: SIW_TERMINATE_NIBBLES,
        reference: "docs/interop.md#siw-terminate-nibbles",
    },
];

/// The driver of a context: `"soft"` for the soft provider, else the device
/// name without its trailing unit number (`rxe0` → `rxe`, `siw0` → `siw`,
/// `mlx5_0` → `mlx5`), or the transport if the name has no letters.
pub fn driver_of(ctx: &Context) -> String {
    let d = ctx.device();
    if d.provider == "soft" {
        return "soft".into();
    }
    let n = d
        .name
        .trim_end_matches(|c: char| c.is_ascii_digit())
        .trim_end_matches('_');
    if n.is_empty() {
        d.transport.to_string()
    } else {
        n.to_string()
    }
}

/// The known deviation for `case` between these contexts, if any.
pub fn deviation(server: &Context, client: &Context, case: &str) -> Option<&'static Deviation> {
    let (sd, cd) = (driver_of(server), driver_of(client));
    DEVIATIONS.iter().find(|d| {
        let (me, other) = match d.side {
            Side::Server => (&sd, &cd),
            Side::Client => (&cd, &sd),
        };
        d.case == case && d.driver == me && d.peer.is_none_or(|p| p == other)
    })
}

/// Verbs semantics of windows (IBA C10-75/C10-78): a region registered with
/// no remote right of its own (LOCAL_WRITE | MW_BIND) carries a window that
/// grants REMOTE_WRITE. Writes through the window land, byte for byte; a
/// write with the region's own key is refused and writes nothing. (So a
/// client registers its memory with no remote right at all.)
fn case_mw_local_region(env: &Env<'_>) -> R {
    let c = env.connect(&params(b""), &params(b""))?;
    let t = filled(&c.s.pd, 8192, Access::LOCAL_WRITE | Access::MW_BIND, 16)?;
    let mw = c.s.pd.alloc_mw()?;
    let key = bind(&c, &mw, &t, 100, 4000, Access::REMOTE_WRITE, false)?;
    let data = pattern(17, 4000);
    let mut want = read_mr(&t, 0, 8192);
    write_ok(env, &c, t.addr() + 100, key, &data, 50)?;
    want[100..4100].copy_from_slice(&data);
    cmp("through the window", &read_mr(&t, 0, 8192), &want)?;
    expect_violation(
        env,
        &c,
        Attempt::Write {
            addr: t.addr() + 5000,
            rkey: t.rkey(),
            len: 512,
        },
        &t,
        0,
        8192,
        V_RDMAP_ACCESS,
    )
}

/// The provider's own count of what a domain holds (`Pd::census`), which a
/// server reports to prove it never registered memory with a remote right:
/// every region, those with a remote right, and windows, on this domain
/// only, and cumulative (dropping does not make a registration unhappen).
fn case_pd_census(env: &Env<'_>) -> R {
    let pd = env.client.alloc_pd()?;
    let other = env.client.alloc_pd()?;
    ensure!(
        pd.census() == PdCensus::default(),
        "a new domain counts {:?}",
        pd.census()
    );
    let a = pd.alloc_mr(4096, Access::LOCAL_WRITE)?;
    let b = pd.alloc_mr(4096, Access::LOCAL_WRITE | Access::REMOTE_WRITE)?;
    let c = pd.alloc_mr(4096, Access::LOCAL_WRITE | Access::REMOTE_READ)?;
    let mw = pd.alloc_mw()?;
    let want = PdCensus {
        mrs: 3,
        mrs_remote: 2,
        mws: 1,
    };
    let got = pd.census();
    ensure!(
        got == want,
        "counted {got:?} for 3 regions (2 with a remote right) and 1 window"
    );
    ensure!(
        other.census() == PdCensus::default(),
        "another domain counts {:?}",
        other.census()
    );
    drop((a, b, c, mw));
    ensure!(
        pd.census() == want,
        "dropping changed the count: {:?}",
        pd.census()
    );
    Ok(())
}

#[cfg(test)]
mod deviation_tests {
    use super::*;

    #[test]
    fn deviations_name_real_cases_and_docs() {
        let names = case_names();
        for d in DEVIATIONS {
            assert!(names.contains(&d.case), "unknown case {}", d.case);
            assert!(d.reference.starts_with("docs/interop.md#"), "{d:?}");
            let anchor = d.reference.trim_start_matches("docs/interop.md#");
            let doc = include_str!("../../../../docs/interop.md");
            assert!(
                doc.contains(&format!("<a id=\"{anchor}\"></a>")),
                "docs/interop.md has no anchor {anchor}"
            );
        }
    }

    #[test]
    fn case_result_lines() {
        let r = |outcome| CaseResult {
            name: "write_with_imm",
            outcome,
            elapsed: Duration::ZERO,
        };
        assert_eq!(r(Outcome::Pass).to_string(), "PASS write_with_imm");
        assert_eq!(
            r(Outcome::Fail("x".into())).to_string(),
            "FAIL write_with_imm: x"
        );
        assert_eq!(
            r(Outcome::Skip("no caps".into())).to_string(),
            "SKIP write_with_imm: no caps"
        );
    }

    #[test]
    fn soft_pair_has_no_deviations() {
        let p = crate::provider("soft").unwrap();
        let a = p.open(None, &Config::default()).unwrap();
        let b = p.open(None, &Config::default()).unwrap();
        assert_eq!(driver_of(&a), "soft");
        for n in case_names() {
            assert!(deviation(&a, &b, n).is_none(), "{n}");
        }
    }
}
