//! Metrics: `lwio serve --metrics ADDR` serves them in the Prometheus /
//! OpenMetrics text format (`GET /metrics`), and the side channel's STATS
//! request returns the same text to `lwio stats` (docs/metrics.md lists
//! every series). Encoded by the prometheus-client crate from the server's
//! own counters at each scrape (a [`Collector`]): the data path keeps plain
//! per-connection counters (`lwio_proto::stats`) and adds them into the
//! server's every 50 ms, so a scrape costs the data path nothing.

use std::sync::Arc;
use std::time::Duration;

use lwio_proto::stats::{opcode_name, RequestStats, LATENCY_BOUNDS_US, OPCODES};
use lwio_proto::status;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric, NoLabelSet};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use crate::io_phase::driver::ServerStats;
use crate::state::{ServerState, Shutdown};

/// What the RDMA phase reports at a scrape.
#[derive(Debug, Clone, Default)]
pub struct RdmaSnapshot {
    pub stats: ServerStats,
    pub requests: RequestStats,
    /// Credits granted to each live connection.
    pub credits: Vec<usize>,
    /// The credit budget shared by all connections.
    pub credit_budget: u32,
    /// The connection limit.
    pub max_connections: usize,
    /// Each reactor's connections and busy time (nanoseconds).
    pub reactors: Vec<(usize, u64)>,
    /// The shared receive pools, summed.
    pub pool: crate::io_phase::pool::PoolStats,
    /// The reactors' read-buffer slabs, summed.
    pub read_slabs: crate::io_phase::readbuf::ReadSlabStats,
    /// Live connections: (authenticating, serving, closing).
    pub states: (usize, usize, usize),
}

/// The content type of [`render`]'s text.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

#[derive(Debug)]
struct Figures {
    sessions: usize,
    open_files: usize,
    durable_sessions: usize,
    /// `Rekey`s that waited for an earlier RDMA connection, and gave up.
    rekey_waits: (u64, u64),
    /// The descriptor cache behind the open files, and its bound.
    descriptors: (crate::fs::fdcache::FdCacheStats, usize),
    rdma: Option<RdmaSnapshot>,
}

fn gauge(e: &mut DescriptorEncoder<'_>, name: &str, help: &str, v: i64) -> std::fmt::Result {
    let g = ConstGauge::new(v);
    g.encode(e.encode_descriptor(name, help, None, g.metric_type())?)
}

fn counter(e: &mut DescriptorEncoder<'_>, name: &str, help: &str, v: u64) -> std::fmt::Result {
    let c = ConstCounter::new(v);
    c.encode(e.encode_descriptor(name, help, None, c.metric_type())?)
}

/// One counter family with an `op` label, over every opcode.
fn by_op(
    e: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    r: &RequestStats,
    f: impl Fn(&lwio_proto::stats::OpStats) -> u64,
) -> std::fmt::Result {
    let mut m = e.encode_descriptor(name, help, None, MetricType::Counter)?;
    for op in OPCODES {
        let labels = [("op", opcode_name(op))];
        ConstCounter::new(f(r.op(op))).encode(m.encode_family(&labels)?)?;
    }
    Ok(())
}

/// An NTSTATUS as a label: its name, or its hex value.
fn status_label(st: lwio_proto::NtStatus) -> String {
    match status::name(st) {
        Some(n) => n.to_string(),
        None => format!("{st:#010x}"),
    }
}

fn i64_of(v: impl TryInto<i64>) -> i64 {
    v.try_into().unwrap_or(i64::MAX)
}

impl Collector for Figures {
    fn encode(&self, mut e: DescriptorEncoder<'_>) -> std::fmt::Result {
        gauge(
            &mut e,
            "lwio_sessions",
            "Side-channel sessions logged in",
            i64_of(self.sessions),
        )?;
        gauge(
            &mut e,
            "lwio_open_files",
            "Files open over the side channel, durable ones of lost sessions included",
            i64_of(self.open_files),
        )?;
        gauge(
            &mut e,
            "lwio_durable_sessions",
            "Lost sessions whose open files are kept for limits.durable_grace",
            i64_of(self.durable_sessions),
        )?;
        counter(
            &mut e,
            "lwio_rekey_drain_waits",
            "Rekeys that waited for an earlier RDMA connection's requests on the file to end",
            self.rekey_waits.0,
        )?;
        counter(
            &mut e,
            "lwio_rekey_drain_busy",
            "Rekeys answered Busy: the earlier connection still held the file after 10 s",
            self.rekey_waits.1,
        )?;
        let (d, max) = &self.descriptors;
        gauge(
            &mut e,
            "lwio_open_descriptors",
            "Descriptors held open for the open files (the descriptor cache)",
            i64_of(d.open),
        )?;
        gauge(
            &mut e,
            "lwio_lock_descriptors",
            "Of them, byte-range lock descriptions (one per client lock owner)",
            i64_of(d.locks),
        )?;
        gauge(
            &mut e,
            "lwio_open_descriptors_limit",
            "The descriptor cache's bound (limits.max_open_descriptors)",
            i64_of(*max),
        )?;
        counter(
            &mut e,
            "lwio_descriptor_evictions",
            "Descriptors of open files closed to stay within the bound",
            d.evictions,
        )?;
        counter(
            &mut e,
            "lwio_descriptor_reopens",
            "Descriptors of open files opened again on use",
            d.reopens,
        )?;
        counter(
            &mut e,
            "lwio_descriptor_reopens_stale",
            "Reopens that found the file removed or replaced (stale file handle)",
            d.stale,
        )?;
        let Some(r) = &self.rdma else {
            return Ok(());
        };
        let s = &r.stats;
        gauge(
            &mut e,
            "lwio_rdma_connections",
            "RDMA connections open",
            i64_of(s.connections),
        )?;
        gauge(
            &mut e,
            "lwio_rdma_connections_limit",
            "RDMA connections the server accepts at most",
            i64_of(r.max_connections),
        )?;
        counter(
            &mut e,
            "lwio_rdma_connections_accepted",
            "RDMA connections accepted",
            s.accepted,
        )?;
        counter(
            &mut e,
            "lwio_rdma_connections_rejected",
            "RDMA connection requests refused (limits, bad or reused keys, out of memory)",
            s.rejected,
        )?;
        counter(
            &mut e,
            "lwio_rdma_auth_ok",
            "RDMA connections that authenticated",
            s.auth_ok,
        )?;
        counter(
            &mut e,
            "lwio_rdma_auth_failed",
            "RDMA connections that failed AUTH",
            s.auth_failed,
        )?;
        counter(
            &mut e,
            "lwio_rdma_closed_by_protocol",
            "RDMA connections the server closed for a protocol violation",
            s.closed_by_protocol,
        )?;
        counter(
            &mut e,
            "lwio_rdma_credit_overruns",
            "Requests received beyond the credits granted (each closes its connection)",
            s.credit_overruns,
        )?;
        gauge(
            &mut e,
            "lwio_rdma_credits_granted",
            "Credits granted to all connections",
            s.credits_granted,
        )?;
        gauge(
            &mut e,
            "lwio_rdma_credit_budget",
            "The credit budget the connections share",
            i64::from(r.credit_budget),
        )?;
        gauge(
            &mut e,
            "lwio_rdma_registered_bytes",
            "Server memory registered for RDMA (receive, send and read buffers)",
            i64_of(s.registered_bytes),
        )?;
        gauge(
            &mut e,
            "lwio_rdma_remote_access_regions",
            "Server memory regions with a remote right (the server exposes no memory: always 0)",
            i64_of(s.mrs_remote_access),
        )?;
        gauge(
            &mut e,
            "lwio_rdma_memory_windows",
            "Memory windows allocated on the server (always 0)",
            i64_of(s.mws_allocated),
        )?;
        gauge(
            &mut e,
            "lwio_storage_queue_depth",
            "File I/Os waiting for a storage thread",
            i64_of(s.storage_queue),
        )?;
        let mut m = e.encode_descriptor(
            "lwio_rdma_connections_by_state",
            "RDMA connections by state (within 50 ms)",
            None,
            MetricType::Gauge,
        )?;
        for (st, n) in [
            ("authenticating", r.states.0),
            ("serving", r.states.1),
            ("closing", r.states.2),
        ] {
            ConstGauge::new(i64_of(n)).encode(m.encode_family(&[("state", st)])?)?;
        }
        gauge(
            &mut e,
            "lwio_rdma_receive_pool_bytes",
            "Memory registered for the reactors' shared receive pools",
            i64_of(r.pool.registered_bytes),
        )?;
        gauge(
            &mut e,
            "lwio_rdma_receive_pool_posted",
            "Receives posted to the shared receive queues",
            i64_of(r.pool.posted),
        )?;
        gauge(
            &mut e,
            "lwio_rdma_receive_pool_in_use",
            "Receive buffers holding a message being served",
            i64_of(r.pool.in_use),
        )?;
        gauge(
            &mut e,
            "lwio_rdma_receive_pool_promised",
            "Credits the pools back: what connections hold",
            i64_of(r.pool.promised),
        )?;
        counter(
            &mut e,
            "lwio_rdma_receive_pool_starved",
            "Sends that found a shared receive queue empty and waited for a receive",
            r.pool.starved,
        )?;
        gauge(
            &mut e,
            "lwio_rdma_read_slab_bytes",
            "Memory registered for the reactors' read-buffer slabs",
            i64_of(r.read_slabs.registered_bytes),
        )?;
        gauge(
            &mut e,
            "lwio_rdma_read_slab_in_use_bytes",
            "Read-buffer slab slots holding a read's data",
            i64_of(r.read_slabs.in_use_bytes),
        )?;
        let mut m = e.encode_descriptor(
            "lwio_reactor_connections",
            "RDMA connections each reactor thread drives",
            None,
            MetricType::Gauge,
        )?;
        for (i, (n, _)) in r.reactors.iter().enumerate() {
            let i = i.to_string();
            ConstGauge::new(i64_of(*n)).encode(m.encode_family(&[("reactor", i.as_str())])?)?;
        }
        let mut m = e.encode_descriptor(
            "lwio_reactor_busy_seconds",
            "Time each reactor thread spent serving its connections (not sleeping or idle polling)",
            None,
            MetricType::Counter,
        )?;
        for (i, (_, ns)) in r.reactors.iter().enumerate() {
            let i = i.to_string();
            ConstCounter::new(*ns as f64 / 1e9)
                .encode(m.encode_family(&[("reactor", i.as_str())])?)?;
        }
        counter(
            &mut e,
            "lwio_inline_ios",
            "File I/Os done by the reactor itself (page-cache fast path)",
            s.inline_ios,
        )?;
        counter(
            &mut e,
            "lwio_inline_syncs",
            "FLUSHes run by the reactor itself (inline_when_alone)",
            s.inline_syncs,
        )?;
        counter(
            &mut e,
            "lwio_ios_cancelled",
            "File I/Os that ended cancelled",
            s.ios_cancelled,
        )?;
        let q = &r.requests;
        counter(
            &mut e,
            "lwio_fragments_received",
            "LWIO_FRAGMENT messages received (operations of any size)",
            q.fragments,
        )?;
        counter(
            &mut e,
            "lwio_fragmented_messages",
            "Fragmented messages reassembled, each one request",
            q.messages_reassembled,
        )?;
        counter(
            &mut e,
            "lwio_fragment_writes",
            "Reassembled messages written to their files",
            s.fragment_writes,
        )?;
        counter(
            &mut e,
            "lwio_fragment_write_calls",
            "Write calls those took (one pwritev, or one storage batch, each)",
            s.fragment_write_calls,
        )?;
        let mut m = e.encode_descriptor(
            "lwio_connections_terminated",
            "RDMA connections the server terminated, by the NTSTATUS of the reason",
            None,
            MetricType::Counter,
        )?;
        for (st, n) in &s.closed_by_status {
            let name = status_label(*st);
            ConstCounter::new(*n).encode(m.encode_family(&[("status", name.as_str())])?)?;
        }
        by_op(
            &mut e,
            "lwio_requests",
            "LWIO requests received, by opcode",
            q,
            |o| o.requests,
        )?;
        by_op(
            &mut e,
            "lwio_requests_completed",
            "LWIO requests answered, by opcode",
            q,
            |o| o.completed,
        )?;
        by_op(
            &mut e,
            "lwio_request_bytes",
            "Data bytes moved by answered requests, by opcode",
            q,
            |o| o.bytes,
        )?;
        let mut m = e.encode_descriptor(
            "lwio_request_latency_seconds",
            "Time from a request's arrival to its answer, by opcode",
            None,
            MetricType::Histogram,
        )?;
        for op in OPCODES {
            let o = q.op(op);
            let mut buckets: Vec<(f64, u64)> = LATENCY_BOUNDS_US
                .iter()
                .map(|&us| (us as f64 / 1e6, 0))
                .chain(std::iter::once((f64::MAX, 0)))
                .collect();
            for (b, n) in buckets.iter_mut().zip(o.latency_buckets) {
                b.1 = n;
            }
            let count = o.latency_buckets.iter().sum();
            let sum = o.latency_sum_ns as f64 / 1e9;
            m.encode_family(&[("op", opcode_name(op))])?
                .encode_histogram::<NoLabelSet>(sum, count, &buckets, None)?;
        }
        let mut m = e.encode_descriptor(
            "lwio_request_errors",
            "Requests answered with an error status, by NTSTATUS",
            None,
            MetricType::Counter,
        )?;
        for (st, n) in &q.errors {
            let name = status_label(*st);
            ConstCounter::new(*n).encode(m.encode_family(&[("status", name.as_str())])?)?;
        }
        Ok(())
    }
}

/// The server's metrics now, in the OpenMetrics text format.
pub fn render(state: &ServerState) -> String {
    let mut reg = Registry::default();
    reg.register_collector(Box::new(Figures {
        sessions: state.session_count(),
        open_files: state.open_files.len(),
        durable_sessions: state.durable_sessions(),
        rekey_waits: state.open_files.rekey_waits(),
        descriptors: (
            state.open_files.descriptors().stats(),
            state.open_files.descriptors().max(),
        ),
        rdma: state.rdma_snapshot(),
    }));
    let mut out = String::new();
    if prometheus_client::encoding::text::encode(&mut out, &reg).is_err() {
        out.clear();
    }
    out
}

/// Most metrics connections served at once; further ones are closed at
/// once (a scraper retries at its next interval).
const MAX_SCRAPES: usize = 64;
/// A connection has this long to send its request and take the answer.
pub const SCRAPE_TIMEOUT: Duration = Duration::from_secs(5);
/// The longest request head read.
const MAX_HEAD: usize = 8192;

/// Serve `GET /metrics` on `listener` until `shutdown` (plain HTTP/1.1,
/// one request per connection; anything else gets 404 or 405). Each
/// connection is served on its own task within [`SCRAPE_TIMEOUT`], so slow
/// or idle sockets never hold up another scrape; past [`MAX_SCRAPES`] at
/// once, new connections are closed unanswered.
pub async fn serve(listener: TcpListener, state: Arc<ServerState>, shutdown: Shutdown) {
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_SCRAPES));
    loop {
        let (sock, peer) = tokio::select! {
            r = listener.accept() => match r {
                Ok(a) => a,
                Err(e) => {
                    tracing::warn!(error = %e, "metrics listener: accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            _ = shutdown.wait() => return,
        };
        let Ok(permit) = slots.clone().try_acquire_owned() else {
            tracing::debug!(%peer, "metrics: too many connections; closing");
            continue;
        };
        let state = state.clone();
        tokio::spawn(async move {
            let _permit = permit;
            let r = tokio::time::timeout(SCRAPE_TIMEOUT, scrape(sock, &state)).await;
            if !matches!(r, Ok(Ok(()))) {
                tracing::debug!(%peer, "metrics request failed or timed out");
            }
        });
    }
}

async fn scrape(mut sock: tokio::net::TcpStream, state: &ServerState) -> std::io::Result<()> {
    let mut head = Vec::with_capacity(1024);
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && !head.windows(2).any(|w| w == b"\n\n") {
        let n = sock.read(&mut buf).await?;
        if n == 0 {
            break;
        }
        head.extend_from_slice(&buf[..n]);
        if head.len() > MAX_HEAD {
            return respond(
                &mut sock,
                "431 Request Header Fields Too Large",
                "text/plain",
                "",
            )
            .await;
        }
    }
    let line = head.split(|&b| b == b'\n').next().unwrap_or_default();
    let line = String::from_utf8_lossy(line);
    let mut parts = line.split_whitespace();
    let (method, target) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let path = target.split('?').next().unwrap_or("");
    match (method, path) {
        ("GET", "/metrics") => respond(&mut sock, "200 OK", CONTENT_TYPE, &render(state)).await,
        ("GET", _) => respond(&mut sock, "404 Not Found", "text/plain", "try /metrics\n").await,
        _ => respond(&mut sock, "405 Method Not Allowed", "text/plain", "").await,
    }
}

async fn respond(
    sock: &mut tokio::net::TcpStream,
    status: &str,
    ctype: &str,
    body: &str,
) -> std::io::Result<()> {
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    sock.write_all(head.as_bytes()).await?;
    sock.write_all(body.as_bytes()).await?;
    sock.shutdown().await
}
