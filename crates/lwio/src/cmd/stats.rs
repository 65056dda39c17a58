//! `lwio stats lwio://HOST`: the server's metrics (the same series as
//! `lwio serve --metrics`, fetched over the side channel) as a table for a
//! person.

use std::collections::BTreeMap;
use std::fmt::Write as _;

/// One sample of the OpenMetrics text: name, labels, value.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub value: f64,
}

/// The samples of an OpenMetrics/Prometheus text exposition (comments and
/// malformed lines are skipped).
pub fn parse(text: &str) -> Vec<Sample> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let value = match value {
                "+Inf" => f64::INFINITY,
                v => v.parse().ok()?,
            };
            let (name, labels) = match series.split_once('{') {
                Some((n, rest)) => (n, parse_labels(rest.strip_suffix('}')?)?),
                None => (series, BTreeMap::new()),
            };
            Some(Sample {
                name: name.to_string(),
                labels,
                value,
            })
        })
        .collect()
}

fn parse_labels(s: &str) -> Option<BTreeMap<String, String>> {
    let mut out = BTreeMap::new();
    let mut rest = s;
    while !rest.is_empty() {
        let (k, r) = rest.split_once("=\"")?;
        let end = r.find('"')?;
        out.insert(k.trim_start_matches(',').to_string(), r[..end].to_string());
        rest = r[end + 1..].trim_start_matches(',');
    }
    Some(out)
}

fn one(s: &[Sample], name: &str) -> Option<f64> {
    s.iter().find(|x| x.name == name).map(|x| x.value)
}

fn by_label<'a>(s: &'a [Sample], name: &str, label: &str) -> BTreeMap<&'a str, f64> {
    s.iter()
        .filter(|x| x.name == name)
        .filter_map(|x| Some((x.labels.get(label)?.as_str(), x.value)))
        .collect()
}

/// Bytes for a person: 1.5 MiB.
fn bytes(v: f64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = v;
    let mut i = 0;
    while v >= 1024.0 && i + 1 < units.len() {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{v:.0} B")
    } else {
        format!("{v:.1} {}", units[i])
    }
}

fn latency(secs: f64) -> String {
    if secs.is_infinite() {
        ">1 s".into()
    } else if secs < 1e-3 {
        format!("≤{:.0} µs", secs * 1e6)
    } else if secs < 1.0 {
        format!("≤{:.1} ms", secs * 1e3)
    } else {
        format!("≤{secs:.1} s")
    }
}

/// The bucket bound below which `q` of `op`'s latencies fall.
fn quantile(s: &[Sample], op: &str, q: f64) -> Option<f64> {
    let mut buckets: Vec<(f64, f64)> = s
        .iter()
        .filter(|x| {
            x.name == "lwio_request_latency_seconds_bucket"
                && x.labels.get("op").map(String::as_str) == Some(op)
        })
        .filter_map(|x| {
            let le = x.labels.get("le")?;
            let le = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().ok()?
            };
            Some((le, x.value))
        })
        .collect();
    buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    let total = buckets.last()?.1;
    if total <= 0.0 {
        return None;
    }
    let want = (total * q).ceil().max(1.0);
    buckets.iter().find(|b| b.1 >= want).map(|b| b.0)
}

/// The table `lwio stats` prints.
pub fn table(server: &str, text: &str) -> String {
    let s = parse(text);
    let g = |n: &str| one(&s, n).unwrap_or(0.0);
    let mut o = String::new();
    let _ = writeln!(o, "Server               {server}");
    let _ = writeln!(o, "Sessions             {}", g("lwio_sessions"));
    if one(&s, "lwio_rdma_connections").is_none() {
        let _ = writeln!(o, "RDMA                 not served");
        return o;
    }
    let _ = writeln!(
        o,
        "RDMA connections     {} (limit {}; accepted {}, refused {})",
        g("lwio_rdma_connections"),
        g("lwio_rdma_connections_limit"),
        g("lwio_rdma_connections_accepted_total"),
        g("lwio_rdma_connections_rejected_total"),
    );
    let _ = writeln!(
        o,
        "Credits granted      {} of {}",
        g("lwio_rdma_credits_granted"),
        g("lwio_rdma_credit_budget")
    );
    let _ = writeln!(
        o,
        "Registered memory    {}",
        bytes(g("lwio_rdma_registered_bytes"))
    );
    let _ = writeln!(
        o,
        "Receive pool         {} ({} posted, {} in use, {} credits held, {} waits for a receive)",
        bytes(g("lwio_rdma_receive_pool_bytes")),
        g("lwio_rdma_receive_pool_posted"),
        g("lwio_rdma_receive_pool_in_use"),
        g("lwio_rdma_receive_pool_promised"),
        g("lwio_rdma_receive_pool_starved_total")
    );
    let _ = writeln!(
        o,
        "Read-buffer slabs    {} ({} in use)",
        bytes(g("lwio_rdma_read_slab_bytes")),
        bytes(g("lwio_rdma_read_slab_in_use_bytes"))
    );
    let conns = by_label(&s, "lwio_reactor_connections", "reactor");
    let busy = by_label(&s, "lwio_reactor_busy_seconds_total", "reactor");
    if !conns.is_empty() {
        let each: Vec<String> = conns
            .iter()
            .map(|(r, n)| {
                format!(
                    "#{r}: {n} conns, busy {:.1} s",
                    busy.get(r).copied().unwrap_or(0.0)
                )
            })
            .collect();
        let _ = writeln!(o, "Reactors             {}", each.join("; "));
    }
    let _ = writeln!(
        o,
        "Storage queue        {} (inline I/Os {}, inline syncs {}, cancelled {})",
        g("lwio_storage_queue_depth"),
        g("lwio_inline_ios_total"),
        g("lwio_inline_syncs_total"),
        g("lwio_ios_cancelled_total")
    );
    let _ = writeln!(
        o,
        "Exposed memory       {} regions, {} windows (the server exposes none)",
        g("lwio_rdma_remote_access_regions"),
        g("lwio_rdma_memory_windows")
    );
    let reqs = by_label(&s, "lwio_requests_total", "op");
    let done = by_label(&s, "lwio_requests_completed_total", "op");
    let moved = by_label(&s, "lwio_request_bytes_total", "op");
    let _ = writeln!(o);
    let _ = writeln!(
        o,
        "{:<10} {:>10} {:>10} {:>12} {:>10} {:>10}",
        "request", "received", "answered", "data", "p50", "p99"
    );
    for (op, n) in &reqs {
        if *n == 0.0 {
            continue;
        }
        let show = |q| quantile(&s, op, q).map_or("-".into(), latency);
        let _ = writeln!(
            o,
            "{:<10} {:>10} {:>10} {:>12} {:>10} {:>10}",
            op,
            n,
            done.get(op).copied().unwrap_or(0.0),
            bytes(moved.get(op).copied().unwrap_or(0.0)),
            show(0.5),
            show(0.99)
        );
    }
    let errors = by_label(&s, "lwio_request_errors_total", "status");
    if !errors.is_empty() {
        let _ = writeln!(o);
        let _ = writeln!(o, "{:<32} {:>10}", "error status", "answers");
        for (st, n) in errors {
            let _ = writeln!(o, "{st:<32} {n:>10}");
        }
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = "\
# TYPE lwio_sessions gauge
lwio_sessions 2
lwio_rdma_connections 1
lwio_rdma_connections_limit 256
lwio_rdma_connections_accepted_total 3
lwio_rdma_connections_rejected_total 1
lwio_rdma_registered_bytes 1572864
lwio_rdma_receive_pool_bytes 1049600
lwio_rdma_receive_pool_posted 16
lwio_rdma_receive_pool_in_use 0
lwio_rdma_receive_pool_promised 2
lwio_rdma_receive_pool_starved_total 3
lwio_rdma_read_slab_bytes 2097152
lwio_rdma_read_slab_in_use_bytes 65536
lwio_reactor_connections{reactor=\"0\"} 1
lwio_reactor_connections{reactor=\"1\"} 0
lwio_reactor_busy_seconds_total{reactor=\"0\"} 0.25
lwio_reactor_busy_seconds_total{reactor=\"1\"} 0
lwio_requests_total{op=\"read\"} 4
lwio_requests_total{op=\"close\"} 0
lwio_requests_completed_total{op=\"read\"} 4
lwio_request_bytes_total{op=\"read\"} 2048
lwio_request_latency_seconds_bucket{le=\"0.000005\",op=\"read\"} 1
lwio_request_latency_seconds_bucket{le=\"0.00001\",op=\"read\"} 3
lwio_request_latency_seconds_bucket{le=\"+Inf\",op=\"read\"} 4
lwio_request_errors_total{status=\"STATUS_END_OF_FILE\"} 1
# EOF
";

    #[test]
    fn parses_and_tabulates() {
        let s = parse(TEXT);
        assert_eq!(s[0].name, "lwio_sessions");
        assert_eq!(s[0].value, 2.0);
        let b = s
            .iter()
            .find(|x| x.labels.get("le").map(String::as_str) == Some("+Inf"))
            .unwrap();
        assert_eq!(b.labels.get("op").map(String::as_str), Some("read"));
        assert_eq!(quantile(&s, "read", 0.5), Some(0.00001));
        assert_eq!(quantile(&s, "read", 0.99), Some(f64::INFINITY));
        assert_eq!(quantile(&s, "close", 0.5), None);
        let t = table("lwio://h", TEXT);
        assert!(
            t.contains("RDMA connections     1 (limit 256; accepted 3, refused 1)"),
            "{t}"
        );
        assert!(t.contains("Registered memory    1.5 MiB"), "{t}");
        assert!(
            t.contains("Receive pool         1.0 MiB (16 posted, 0 in use, 2 credits held, 3 waits for a receive)"),
            "{t}"
        );
        assert!(
            t.contains("Read-buffer slabs    2.0 MiB (64.0 KiB in use)"),
            "{t}"
        );
        assert!(
            t.contains("Reactors             #0: 1 conns, busy 0.2 s; #1: 0 conns, busy 0.0 s"),
            "{t}"
        );
        assert!(
            t.lines().any(|l| l.split_whitespace().collect::<Vec<_>>()
                == ["read", "4", "4", "2.0", "KiB", "≤10", "µs", ">1", "s"]),
            "{t}"
        );
        assert!(!t.contains("close"), "unused opcodes are left out: {t}");
        assert!(t.contains("STATUS_END_OF_FILE"), "{t}");
    }
}
