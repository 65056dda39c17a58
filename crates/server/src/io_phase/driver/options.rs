//! The RDMA listener's configuration: [`RdmaServerOptions`], its defaults
//! and how `lwio serve`'s configuration fills it.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

use lwio_proto::server::ServerConfig;
use lwio_rdma::ProviderChoice;

/// Configuration of the RDMA listener.
#[derive(Debug, Clone)]
pub struct RdmaServerOptions {
    pub provider: ProviderChoice,
    /// Device to open (None = the provider's first usable device). With
    /// several devices (e.g. rxe0 and siw0) name the one that owns `listen`.
    pub device: Option<String>,
    /// Where the RDMA listener binds (port 0 = ephemeral).
    pub listen: SocketAddr,
    /// Address advertised in negotiate responses when `listen` is a wildcard
    /// (the client falls back to the side channel's host when this is None).
    pub advertise: Option<IpAddr>,
    /// Protocol limits of each connection (`session_id` is replaced per
    /// connection by a random value).
    pub proto: ServerConfig,
    pub max_connections: usize,
    /// Live connections from one peer IP address (authenticated or not);
    /// further connection requests from it are rejected "busy".
    pub max_connections_per_host: usize,
    /// Registered memory (bytes) across all connections.
    pub max_memory: usize,
    /// Credits across all connections: the pool the balancer grants from.
    pub credit_budget: u32,
    /// Most credits one connection may reach through balancing.
    pub max_credits_per_conn: u16,
    /// Grant more credits to busy connections / reclaim from idle ones.
    pub auto_credits: bool,
    /// A connection idle this long gives its extra credits back.
    pub idle_reclaim: Duration,
    pub storage_threads: usize,
    /// Reactor threads driving the connections (0 = one per core).
    pub reactors: usize,
    /// Do page-cache file I/O on the reactor thread (tmpfs/ramfs: plain
    /// calls; elsewhere `RWF_NOWAIT`, falling back to a storage thread).
    pub inline_io: bool,
    /// A connection that is the only one its reactor drives has its FLUSHes,
    /// and its writes of up to 64 KiB that `RWF_NOWAIT` cannot make (ext4
    /// buffered writes), done on the reactor thread itself (no hand-off to
    /// a worker and back); with more connections there they go to a
    /// worker, so that none waits behind another's I/O.
    pub inline_when_alone: bool,
    /// A reactor polls a connection this long after its last activity before
    /// it sleeps.
    pub busy_poll: Duration,
    /// After completing a request its client polls for (status block), the
    /// reactor polls that connection this long before it sleeps.
    pub busy_poll_polled: Duration,
    /// Receive buffers from a shared receive pool per reactor and device
    /// (an SRQ) where the device has SRQs, sized by the credits granted;
    /// false: each connection registers its own.
    pub shared_receives: bool,
    /// Soft provider: give each connection its own context with manual
    /// progress (its thread reads its own socket; no engine thread).
    pub conn_contexts: bool,
    /// On shutdown, how long in-flight I/O may take before connections are cut.
    pub shutdown_grace: Duration,
    /// Seed 003's indicate window of each connection: bytes of Sends that
    /// arrive with no receive posted that the provider may hold before it
    /// stops reading that connection (`None`: the provider context's
    /// default). Providers without such buffering ignore it.
    pub recv_window: Option<usize>,
    pub rdma: lwio_rdma::Config,
}

impl Default for RdmaServerOptions {
    fn default() -> Self {
        RdmaServerOptions {
            provider: ProviderChoice::Soft,
            device: None,
            listen: SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 7421),
            advertise: None,
            // Write with immediate completes full reads without a status
            // message; `bind` keeps it only where the device has it.
            proto: ServerConfig {
                use_write_with_imm: true,
                max_message: DEFAULT_MAX_MESSAGE,
                ..ServerConfig::default()
            },
            max_connections: 4096,
            max_connections_per_host: 32,
            max_memory: 512 << 20,
            credit_budget: 4096,
            max_credits_per_conn: 128,
            auto_credits: true,
            idle_reclaim: Duration::from_secs(2),
            storage_threads: 4,
            reactors: 0,
            inline_io: true,
            inline_when_alone: true,
            busy_poll: Duration::from_micros(20),
            busy_poll_polled: Duration::from_micros(100),
            conn_contexts: true,
            shared_receives: true,
            shutdown_grace: Duration::from_secs(10),
            recv_window: Some(128 * 1024),
            rdma: lwio_rdma::Config::default(),
        }
    }
}

/// The largest fragmented message (docs/protocol.md §5.12) a server
/// reassembles by default.
pub const DEFAULT_MAX_MESSAGE: u32 = 16 << 20;

impl RdmaServerOptions {
    /// The RDMA listener options the configuration asks for, listening on
    /// `listen` (`compat_md5_auth` → `proto.allow_md5`, limits, grace).
    pub fn from_config(c: &crate::config::Config, listen: SocketAddr) -> RdmaServerOptions {
        let d = RdmaServerOptions::default();
        RdmaServerOptions {
            provider: c.provider,
            device: c.device.clone(),
            listen,
            shutdown_grace: c.limits.shutdown_grace,
            max_connections: c.limits.max_rdma_connections,
            max_connections_per_host: c.limits.max_rdma_connections_per_host,
            proto: lwio_proto::server::ServerConfig {
                allow_md5: c.compat_md5_auth,
                // A Fid needs a file opened on the session's side channel
                // first: the same bound (at most 65,535, the Fid space).
                max_fids: c
                    .limits
                    .max_open_files_per_session
                    .min(usize::from(u16::MAX)),
                max_recv_buffer_size: c.rdma.max_write_size,
                max_message: c.rdma.max_message,
                auth_timeout: c.rdma.auth_timeout,
                credit_timeout: c.rdma.credit_timeout,
                ..d.proto
            },
            reactors: c.rdma.reactors,
            inline_io: c.rdma.inline_io,
            inline_when_alone: c.rdma.inline_when_alone,
            busy_poll: c.rdma.busy_poll,
            busy_poll_polled: c.rdma.busy_poll_polled,
            conn_contexts: c.rdma.progress == crate::config::ProgressChoice::Connection,
            recv_window: Some(c.rdma.indicate_window as usize),
            rdma: lwio_rdma::Config {
                dead_peer_timeout: Some(c.rdma.dead_peer_timeout),
                ..d.rdma
            },
            ..d
        }
    }
}
