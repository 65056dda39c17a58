//! `lwio rdma-bench`: raw verbs benchmark between two hosts, over
//! [`lwio_rdma::perf`] (like perftest's ib_write_bw / ib_read_lat).

use std::io::Write;
use std::net::{SocketAddr, ToSocketAddrs};

use lwio_rdma::perf::{PerfOp, PerfOpts};

use crate::cli::{RdmaBenchArgs, RdmaOp, RdmaProvider};

fn addr(flag: &str, s: &str) -> anyhow::Result<SocketAddr> {
    s.to_socket_addrs()
        .ok()
        .and_then(|mut a| a.next())
        .ok_or_else(|| anyhow::anyhow!("--{flag} {s:?}: expected HOST:PORT"))
}

/// The perf options for the arguments.
pub fn perf_opts(a: &RdmaBenchArgs) -> anyhow::Result<PerfOpts> {
    if a.size == 0 || a.size > u64::from(u32::MAX) {
        anyhow::bail!("--size must be between 1 byte and 4 GiB");
    }
    if a.iters == 0 {
        anyhow::bail!("--iters must be at least 1");
    }
    Ok(PerfOpts {
        op: match a.op {
            RdmaOp::Write => PerfOp::Write,
            RdmaOp::Read => PerfOp::Read,
            RdmaOp::Send => PerfOp::Send,
        },
        size: a.size as usize,
        iters: a.iters,
        poll: a.poll,
        provider: match a.provider {
            RdmaProvider::Soft => "soft",
            RdmaProvider::Verbs => "verbs",
        }
        .into(),
        listen: a.listen.as_deref().map(|s| addr("listen", s)).transpose()?,
        connect: a
            .connect
            .as_deref()
            .map(|s| addr("connect", s))
            .transpose()?,
        // Busy-polling means the polling thread also drives the soft
        // provider's protocol engine (Progress::Manual): no engine thread and
        // no cross-thread wake-up per message, as fi_pingpong polls its own
        // endpoint. Hardware providers ignore the setting.
        config: lwio_rdma::Config {
            progress: if a.poll {
                lwio_rdma::Progress::Manual
            } else {
                lwio_rdma::Progress::Auto
            },
            ..lwio_rdma::Config::default()
        },
        ..PerfOpts::default()
    })
}

pub fn run(a: RdmaBenchArgs) -> anyhow::Result<()> {
    let opts = perf_opts(&a)?;
    if let Some(l) = opts.listen {
        eprintln!(
            "lwio: rdma-bench waiting for a peer on {l} ({}, {} B)",
            opts.provider, opts.size
        );
    }
    let report = lwio_rdma::perf::run(&opts).map_err(|e| match e {
        lwio_rdma::Error::ProviderUnavailable(m) | lwio_rdma::Error::NoSuchDevice(m) => {
            anyhow::anyhow!(
                "no usable RDMA provider for --provider {}: {m} (`lwio devices` lists what this host has)",
                opts.provider
            )
        }
        other => anyhow::anyhow!("rdma-bench: {other}"),
    })?;
    let mut out = std::io::stdout().lock();
    writeln!(out, "{report}")?;
    Ok(())
}
