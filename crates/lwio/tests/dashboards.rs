//! The Grafana dashboard (packaging/grafana/lwio.json) and the Prometheus
//! alert rules (packaging/prometheus/lwio-alerts.yml) query only series
//! that a running `lwio serve --metrics` exposes.

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use assert_cmd::cargo::CommandCargoExt;

fn repo_file(rel: &str) -> String {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(rel);
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// The series names a scrape of `text` offers to PromQL: gauges as named,
/// counters with `_total`, histograms as `_bucket`, `_sum` and `_count`.
fn exposed(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for l in text.lines() {
        if let Some(rest) = l.strip_prefix("# TYPE ") {
            let mut it = rest.split_whitespace();
            let (name, kind) = (it.next().unwrap(), it.next().unwrap());
            match kind {
                "counter" => {
                    names.insert(format!("{name}_total"));
                }
                "histogram" => {
                    for s in ["_bucket", "_sum", "_count"] {
                        names.insert(format!("{name}{s}"));
                    }
                }
                _ => {
                    names.insert(name.to_string());
                }
            }
        } else if !l.starts_with('#') && !l.is_empty() {
            let end = l.find(['{', ' ']).unwrap_or(l.len());
            names.insert(l[..end].to_string());
        }
    }
    names
}

/// The `lwio_…` metric names in a PromQL expression.
fn queried(expr: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut word = String::new();
    let mut in_string = false;
    for c in expr.chars().chain([' ']) {
        if c == '"' {
            in_string = !in_string;
        }
        if !in_string && (c.is_ascii_alphanumeric() || c == '_' || c == ':') {
            word.push(c);
        } else {
            if word.starts_with("lwio_") {
                out.insert(std::mem::take(&mut word));
            }
            word.clear();
        }
    }
    out
}

/// Every `expr` (and templating `query`) string in the dashboard.
fn dashboard_exprs(v: &serde_json::Value, out: &mut Vec<String>) {
    match v {
        serde_json::Value::Object(m) => {
            for (k, x) in m {
                match (k.as_str(), x) {
                    ("expr" | "query" | "definition", serde_json::Value::String(s)) => {
                        out.push(s.clone())
                    }
                    _ => dashboard_exprs(x, out),
                }
            }
        }
        serde_json::Value::Array(a) => a.iter().for_each(|x| dashboard_exprs(x, out)),
        _ => {}
    }
}

fn scrape() -> String {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("data")).unwrap();
    let mut child = Command::cargo_bin("lwio")
        .unwrap()
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--provider",
            "soft",
            "--metrics",
            "127.0.0.1:0",
        ])
        .arg("--export")
        .arg(format!("data={}", dir.path().join("data").display()))
        .arg("--token-file")
        .arg(dir.path().join("token"))
        .env("RUST_LOG", "warn")
        .env_remove("NOTIFY_SOCKET")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let addr = loop {
        let l = lines
            .next()
            .expect("the server printed its metrics address")
            .unwrap();
        if let Some(a) = l
            .strip_prefix("lwio: metrics on http://")
            .and_then(|a| a.strip_suffix("/metrics"))
        {
            break a.to_string();
        }
    };
    let mut s = std::net::TcpStream::connect(&addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).unwrap();
    let _ = child.kill();
    let _ = child.wait();
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
    resp.split_once("\r\n\r\n").unwrap().1.to_string()
}

#[test]
fn dashboard_and_alerts_query_only_exposed_series() {
    let metrics = scrape();
    let have = exposed(&metrics);
    assert!(have.contains("lwio_sessions"), "{metrics}");
    assert!(
        have.contains("lwio_request_latency_seconds_bucket"),
        "{metrics}"
    );

    let dash: serde_json::Value =
        serde_json::from_str(&repo_file("packaging/grafana/lwio.json")).expect("lwio.json is JSON");
    let mut exprs = Vec::new();
    dashboard_exprs(&dash, &mut exprs);
    let in_dashboard: BTreeSet<String> = exprs.iter().flat_map(|e| queried(e)).collect();

    let rules: serde_yaml::Value =
        serde_yaml::from_str(&repo_file("packaging/prometheus/lwio-alerts.yml"))
            .expect("lwio-alerts.yml is YAML");
    let mut alerts = Vec::new();
    for g in rules["groups"].as_sequence().expect("groups") {
        for r in g["rules"].as_sequence().expect("rules") {
            let name = r["alert"].as_str().expect("every rule is an alert");
            let expr = r["expr"].as_str().unwrap_or_else(|| panic!("{name}: expr"));
            assert!(
                r["annotations"]["summary"].as_str().is_some(),
                "{name}: summary"
            );
            alerts.push((name.to_string(), expr.to_string()));
        }
    }
    let in_alerts: BTreeSet<String> = alerts.iter().flat_map(|(_, e)| queried(e)).collect();

    let missing: Vec<&String> = in_dashboard
        .iter()
        .chain(&in_alerts)
        .filter(|n| !have.contains(*n))
        .collect();
    assert!(
        missing.is_empty(),
        "queried but not exposed: {missing:?}\nexposed: {have:?}"
    );

    // What the issue asks the dashboard to show, and the alerts to watch.
    for n in [
        "lwio_sessions",
        "lwio_rdma_connections",
        "lwio_rdma_connections_limit",
        "lwio_rdma_credits_granted",
        "lwio_rdma_credit_budget",
        "lwio_requests_completed_total",
        "lwio_request_bytes_total",
        "lwio_request_latency_seconds_bucket",
        "lwio_request_errors_total",
        "lwio_rdma_registered_bytes",
    ] {
        assert!(in_dashboard.contains(n), "the dashboard does not show {n}");
    }
    for n in [
        "lwio_rdma_connections_rejected_total",
        "lwio_rdma_auth_failed_total",
        "lwio_rdma_remote_access_regions",
        "lwio_durable_sessions",
    ] {
        assert!(in_alerts.contains(n), "no alert on {n}");
    }
    assert!(in_dashboard.len() >= 30, "{in_dashboard:?}");
}

#[test]
fn name_extraction() {
    assert_eq!(
        queried(
            r#"histogram_quantile(0.99, sum by (le, op) (rate(lwio_request_latency_seconds_bucket{instance=~"lwio_x"}[5m])))"#
        ),
        BTreeSet::from(["lwio_request_latency_seconds_bucket".to_string()])
    );
    let e = exposed("# TYPE lwio_a counter\n# TYPE lwio_h histogram\n# TYPE lwio_g gauge\nlwio_g{x=\"1\"} 2\n# EOF\n");
    assert_eq!(
        e.into_iter().collect::<Vec<_>>(),
        [
            "lwio_a_total",
            "lwio_g",
            "lwio_h_bucket",
            "lwio_h_count",
            "lwio_h_sum"
        ]
    );
}
