//! The listeners: [`RdmaServer`] opens the provider instances the options
//! select, listens on each and, as [`RdmaPhase::serve`], starts the
//! reactors and storage threads, admits connection requests (connection
//! limits) and drains the connections at shutdown.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use lwio_proto::server::ServerConfig;
use lwio_proto::transport::{CrcPolicy, Instance, WireTransport};
use lwio_proto::wire::COMMON_HEADER_LEN;
use lwio_rdma::Context;
use tracing::{debug, info, warn};

use crate::io_phase::reactor::{DomainSpec, Reactors};
use crate::state::{RdmaPhase, ServerState, Shutdown};

use super::conn::Conn;
use super::options::RdmaServerOptions;
use super::shared::{lock, Control, ServerHandle, Shared};
use super::storage::StoragePool;

/// One listening provider instance: a soft listener or a verbs device.
pub(super) struct Listening {
    pub(super) ctx: Context,
    pub(super) listener: lwio_rdma::Listener,
    /// What negotiate advertises for it.
    pub(super) instance: Instance,
    /// Connection protocol settings for this device (Write with immediate
    /// where the device has it).
    pub(super) proto: ServerConfig,
}

/// The RDMA listeners: implements [`RdmaPhase`]. One per provider instance
/// the options select (`auto`: every usable verbs device and the soft
/// provider), all serving the same exports and sharing one budget.
pub struct RdmaServer {
    pub(super) listeners: Vec<Listening>,
    pub(super) shared: Arc<Shared>,
}

impl std::fmt::Debug for RdmaServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaServer")
            .field(
                "listeners",
                &self
                    .listeners
                    .iter()
                    .map(|l| l.describe())
                    .collect::<Vec<_>>(),
            )
            .finish()
    }
}

impl Listening {
    pub(super) fn describe(&self) -> String {
        format!(
            "{} on {} ({} {})",
            self.instance.transport,
            self.listener.local_addr(),
            self.ctx.device().provider,
            self.ctx.device().name
        )
    }
}

/// The wire transport of a local device, as negotiate names it.
pub fn wire_transport(t: lwio_rdma::Transport) -> Option<WireTransport> {
    WireTransport::from_wire_name(t.wire_name()?)
}

impl RdmaServer {
    /// Open the providers the options select and start listening on each.
    ///
    /// * `soft`: the soft provider on `listen`;
    /// * `verbs`: the named `device`, or every usable verbs device;
    /// * `auto`: every usable verbs device, then the soft provider.
    ///
    /// The first listener takes `listen`'s port, the next ones the ports
    /// after it (port 0: each its own ephemeral port). A verbs device
    /// listens on `listen`'s address if it owns it (a specific address
    /// that it does not own skips it), else on its own first address.
    pub fn bind(mut opts: RdmaServerOptions) -> Result<RdmaServer, lwio_rdma::Error> {
        if opts.conn_contexts {
            // Connections get their own contexts (soft provider): the
            // listener's needs no engine thread either.
            opts.rdma.progress = lwio_rdma::Progress::Manual;
        }
        let mut listeners: Vec<Listening> = Vec::new();
        let mut last_err = None;
        let fragment_budget = lwio_proto::fragment::Budget::new(opts.max_memory / 2);
        for (provider, dev) in lwio_rdma::devices_for(opts.provider, opts.device.as_deref()) {
            if let Err(why) = &dev.usable {
                debug!(provider = provider.name(), device = %dev.name, %why, "device not usable; not listening");
                last_err = Some(lwio_rdma::Error::ProviderUnavailable(format!(
                    "{} {}: {why}",
                    provider.name(),
                    dev.name
                )));
                continue;
            }
            let Some(transport) = wire_transport(dev.transport) else {
                debug!(device = %dev.name, transport = %dev.transport, "unknown wire transport; not listening");
                continue;
            };
            let soft = provider.name() == "soft";
            let ip = if soft || !opts.listen.ip().is_unspecified() {
                if !soft && !dev.addresses.contains(&opts.listen.ip()) {
                    debug!(device = %dev.name, listen = %opts.listen, "device does not own the listen address; not listening");
                    continue;
                }
                opts.listen.ip()
            } else {
                match dev.addresses.first() {
                    Some(ip) => *ip,
                    None => {
                        debug!(device = %dev.name, "device has no IP address; not listening");
                        continue;
                    }
                }
            };
            let port = match opts.listen.port() {
                0 => 0,
                p => p.saturating_add(listeners.len() as u16),
            };
            let addr = SocketAddr::new(ip, port);
            let ctx = match provider.open(Some(&dev.name), &opts.rdma) {
                Ok(c) => c,
                Err(e) => {
                    warn!(provider = provider.name(), device = %dev.name, error = %e, "cannot open RDMA device");
                    last_err = Some(e);
                    continue;
                }
            };
            let listener = match ctx.listen(addr, 128) {
                Ok(l) => l,
                Err(e) => {
                    warn!(provider = provider.name(), device = %dev.name, %addr, error = %e, "cannot listen");
                    last_err = Some(e);
                    continue;
                }
            };
            let local = listener.local_addr();
            let mut adv = local;
            if local.ip().is_unspecified() {
                if let Some(ip) = opts.advertise {
                    adv.set_ip(ip);
                }
            }
            let mut instance = Instance::new(transport, adv);
            if transport == WireTransport::Iwarp && soft {
                instance.crc = match opts.rdma.mpa_crc {
                    lwio_rdma::CrcPolicy::Required => CrcPolicy::Required,
                    _ => CrcPolicy::Optional,
                };
            }
            let caps = ctx.device().caps.clone();
            let mut proto = opts.proto.clone();
            // Partial fragmented messages hold receive buffers that are
            // already registered; the budget bounds how much of the
            // server's registered memory they may pin at once.
            proto.fragment_budget = Some(fragment_budget.clone());
            // Write with immediate completes full reads without a status
            // message; only where this device has it.
            proto.use_write_with_imm =
                proto.use_write_with_imm && caps.as_ref().is_some_and(|c| c.write_with_imm);
            let l = Listening {
                ctx,
                listener,
                instance,
                proto,
            };
            info!(listener = %l.describe(), "RDMA listener");
            listeners.push(l);
        }
        if listeners.is_empty() {
            return Err(last_err.unwrap_or_else(|| {
                lwio_rdma::Error::ProviderUnavailable(format!(
                    "no usable RDMA device for provider {}",
                    opts.provider
                ))
            }));
        }
        let shared = Arc::new(Shared::new(opts));
        Ok(RdmaServer { listeners, shared })
    }

    /// The first listener's address.
    pub fn local_addr(&self) -> SocketAddr {
        self.listeners[0].listener.local_addr()
    }

    /// Every listener: its bound address, provider and device name, and
    /// what negotiate advertises for it.
    pub fn listeners(&self) -> Vec<(SocketAddr, &'static str, String, Instance)> {
        self.listeners
            .iter()
            .map(|l| {
                (
                    l.listener.local_addr(),
                    l.ctx.device().provider,
                    l.ctx.device().name.clone(),
                    l.instance,
                )
            })
            .collect()
    }

    pub fn handle(&self) -> ServerHandle {
        ServerHandle(self.shared.clone())
    }
}

impl RdmaPhase for RdmaServer {
    fn endpoints(&self) -> Vec<Instance> {
        self.listeners.iter().map(|l| l.instance).collect()
    }

    fn snapshot(&self) -> Option<crate::metrics::RdmaSnapshot> {
        let h = self.handle();
        Some(crate::metrics::RdmaSnapshot {
            stats: h.stats(),
            requests: h.request_stats(),
            credits: h.connection_credits(),
            credit_budget: self.shared.opts.credit_budget,
            max_connections: self.shared.opts.max_connections,
            reactors: h.reactors(),
            pool: h.receive_pool(),
            read_slabs: h.read_slabs(),
            states: h.connection_states(),
        })
    }

    fn serve(&self, state: Arc<ServerState>, shutdown: Shutdown) {
        let sh = &self.shared;
        // The storage threads do their file I/O themselves (they exist to
        // block on it): one pool, not one in front of the backend's.
        let pool = StoragePool::new(
            sh.opts.storage_threads,
            Arc::new(crate::fs::InlineBackend),
            sh.storage_queued.clone(),
        );
        let n = match sh.opts.reactors {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
            n => n,
        };
        let use_ring = state.backend.kind() == crate::fs::backend::BackendKind::IoUring;
        // Each listener's receives: a shared receive pool per reactor where
        // the device has SRQs (the soft provider always does).
        let specs: Vec<DomainSpec> = self
            .listeners
            .iter()
            .map(|l| {
                let soft = l.ctx.device().provider == "soft";
                let slot = (COMMON_HEADER_LEN + l.proto.max_recv_buffer_size as usize)
                    .next_multiple_of(64);
                let most = (sh.opts.max_memory / slot.max(1)).clamp(64, 1 << 20) as u32;
                let caps = l.ctx.device().caps.as_ref().map_or(0, |c| c.max_srq_wr);
                DomainSpec {
                    ctx: l.ctx.clone(),
                    sibling: soft && sh.opts.conn_contexts,
                    // `caps` is 0 on a verbs device without SRQs
                    // (max_srq 0): a receive region per connection.
                    srq_wr: if sh.opts.shared_receives {
                        most.min(caps)
                    } else {
                        0
                    },
                    slot,
                    overcommit: soft,
                }
            })
            .collect();
        let reactors = match Reactors::start(n, sh, use_ring, &specs) {
            Ok(r) => r,
            Err(e) => {
                warn!(error = %e, "cannot start the RDMA reactors; RDMA phase not serving");
                return;
            }
        };
        while !shutdown.is_triggered() {
            // One listener waits 100 ms; with several, each is polled in
            // turn with a short wait.
            let wait = Duration::from_millis(if self.listeners.len() == 1 { 100 } else { 20 });
            let mut got = None;
            for (li, l) in self.listeners.iter().enumerate() {
                match l.listener.get_request(Some(wait)) {
                    Ok(Some(r)) => {
                        got = Some((li, l, r));
                        break;
                    }
                    Ok(None) => {}
                    Err(e) => {
                        warn!(listener = %l.describe(), error = %e, "RDMA listener failed");
                        std::thread::sleep(Duration::from_millis(50));
                    }
                }
            }
            let Some((li, listening, req)) = got else {
                continue;
            };
            let peer = req.peer_addr();
            // The refusal's reason travels in the MPA reject's private data:
            // the client prints it (not "peer closed").
            let live = lock(&sh.conns).len();
            if live >= sh.opts.max_connections {
                warn!(%peer, limit = sh.opts.max_connections, "RDMA connection limit reached; rejecting");
                sh.rejected.fetch_add(1, Ordering::Relaxed);
                let why = format!(
                    "server busy: {live} connections (limit {})",
                    sh.opts.max_connections
                );
                let _ = req.reject(why.as_bytes());
                continue;
            }
            let ip = peer.ip();
            if !sh.host_acquire(ip) {
                warn!(%peer, limit = sh.opts.max_connections_per_host, "RDMA connection limit per host reached; rejecting");
                sh.rejected.fetch_add(1, Ordering::Relaxed);
                let why = format!(
                    "server busy: {} connections from {ip} (limit {} per host)",
                    sh.opts.max_connections_per_host, sh.opts.max_connections_per_host
                );
                let _ = req.reject(why.as_bytes());
                continue;
            }
            let id = sh.next_conn.fetch_add(1, Ordering::Relaxed);
            let (r, domain) = reactors.pick(li);
            let accepted = Conn::accept(
                id,
                listening,
                req,
                sh.clone(),
                state.clone(),
                pool.clone(),
                domain.as_deref(),
            );
            match accepted {
                Ok((conn, entry)) => {
                    sh.accepted.fetch_add(1, Ordering::Relaxed);
                    lock(&sh.conns).insert(id, entry);
                    reactors.assign(r, conn);
                }
                Err(e) => {
                    reactors.unpick(r);
                    warn!(%peer, error = %e, "cannot accept RDMA connection");
                    sh.rejected.fetch_add(1, Ordering::Relaxed);
                    sh.host_release(ip);
                }
            }
        }
        info!(
            connections = lock(&sh.conns).len(),
            "RDMA phase shutting down: draining connections"
        );
        for c in lock(&sh.conns).values() {
            let _ = c.ctl.send(Control::Shutdown);
            c.waker.wake();
        }
        let deadline = Instant::now() + sh.opts.shutdown_grace + Duration::from_secs(2);
        reactors.finish(deadline);
        info!("RDMA phase stopped");
    }
}
