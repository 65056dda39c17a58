//! The server configuration file (TOML). Every key is documented in
//! `docs/config.md`. Command-line flags override the file.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Deserializer};

use crate::fs::backend::BackendChoice;
use crate::fs::{validate_export_name, ExportSpec};
use crate::side_service::access::{
    check_password_hash, validate_user_name, Acl, TokenVerifier, UserCredentials, UserDb,
    ANONYMOUS, ANY_USER,
};
use lwio_side::codec::{DEFAULT_MAX_FRAME, HARD_MAX_FRAME, MIN_MAX_FRAME};
use lwio_side::units::parse_duration;

/// Default side-channel listen address.
pub const DEFAULT_LISTEN: &str = "0.0.0.0:7420";

pub use lwio_rdma::ProviderChoice;

fn de_provider<'de, D: Deserializer<'de>>(d: D) -> Result<ProviderChoice, D::Error> {
    let s = String::deserialize(d)?;
    s.parse().map_err(serde::de::Error::custom)
}

fn de_duration<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    let s = String::deserialize(d)?;
    parse_duration(&s).map_err(serde::de::Error::custom)
}

/// Resource bounds of the side channel and the open-file table.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Limits {
    /// Largest frame body accepted or sent, bytes.
    pub max_frame: u32,
    /// Concurrent side-channel sessions; more are refused with "busy".
    pub max_sessions: usize,
    /// A session with no request for this long is closed.
    #[serde(deserialize_with = "de_duration")]
    pub idle_timeout: Duration,
    /// Time allowed from connect to completed login.
    #[serde(deserialize_with = "de_duration")]
    pub login_timeout: Duration,
    /// Open files per session.
    pub max_open_files_per_session: usize,
    /// Open files server-wide.
    pub max_open_files: usize,
    /// Descriptors the open files are held with (the descriptor cache,
    /// docs/descriptor-cache.md); 0 = half of RLIMIT_NOFILE.
    pub max_open_descriptors: usize,
    /// Byte-range lock owners on one open file (each holds an open file
    /// description of its own on the server).
    pub max_lock_owners_per_file: usize,
    /// Byte-range lock owners on all the open files of one session.
    pub max_lock_owners_per_session: usize,
    /// How long a server request resume key (and a negotiate key) is accepted.
    #[serde(deserialize_with = "de_duration")]
    pub resume_key_ttl: Duration,
    /// On SIGINT/SIGTERM, how long in-flight requests may take before
    /// sessions are cut.
    #[serde(deserialize_with = "de_duration")]
    pub shutdown_grace: Duration,
    /// Concurrent connections from one IP address (logged in or not).
    pub max_connections_per_host: usize,
    /// Concurrent logged-in sessions of one user (the shared token and
    /// anonymous sessions count as one user each).
    pub max_sessions_per_user: usize,
    /// Connections not logged in yet, server-wide.
    pub max_unauthenticated: usize,
    /// Connections not logged in yet from one host (an IPv4 address or an
    /// IPv6 /64); 0 = a sixteenth of `max_unauthenticated`, at least 4
    /// ([`Limits::unauthenticated_per_host`]).
    pub max_unauthenticated_per_host: usize,
    /// New connections per second from one IP address (token bucket rate).
    pub unauth_rate_per_host: u32,
    /// Burst of new connections from one IP address.
    pub unauth_burst_per_host: u32,
    /// New connections per second, server-wide.
    pub unauth_rate: u32,
    /// Burst of new connections, server-wide.
    pub unauth_burst: u32,
    /// Live RDMA connections, server-wide; further connection requests are
    /// refused at MPA time with "server busy: N connections (limit N)".
    pub max_rdma_connections: usize,
    /// Live RDMA connections from one IP address (authenticated or not);
    /// further connection requests are rejected "busy" at MPA time.
    pub max_rdma_connections_per_host: usize,
    /// Directory leases one session may hold (docs/leases.md); past it,
    /// LeaseDir is answered "not granted".
    pub max_leases_per_session: usize,
    /// Directory leases held server-wide.
    pub max_leases: usize,
    /// How long a change waits for the holders of leases it breaks to
    /// acknowledge; an unacknowledged lease is then revoked.
    #[serde(deserialize_with = "de_duration")]
    pub lease_break_timeout: Duration,
    /// How long the open files of a session whose side channel was lost
    /// are kept for the client to take back (durable handles,
    /// docs/reconnect.md). 0 = close them at once.
    #[serde(deserialize_with = "de_duration")]
    pub durable_grace: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_frame: DEFAULT_MAX_FRAME,
            max_sessions: 4096,
            idle_timeout: Duration::from_secs(300),
            login_timeout: Duration::from_secs(10),
            max_open_files_per_session: 16_384,
            max_open_files: 1_000_000,
            max_open_descriptors: 0,
            max_lock_owners_per_file: 64,
            max_lock_owners_per_session: 1024,
            resume_key_ttl: Duration::from_secs(60),
            shutdown_grace: Duration::from_secs(10),
            max_connections_per_host: 64,
            max_sessions_per_user: 64,
            max_unauthenticated: 128,
            max_unauthenticated_per_host: 0,
            unauth_rate_per_host: 20,
            unauth_burst_per_host: 40,
            unauth_rate: 200,
            unauth_burst: 400,
            max_rdma_connections: 4096,
            max_rdma_connections_per_host: 32,
            max_leases_per_session: 1024,
            max_leases: 65_536,
            lease_break_timeout: Duration::from_secs(2),
            durable_grace: Duration::from_secs(60),
        }
    }
}

impl Limits {
    /// Connections not logged in yet one host may hold: the configured
    /// `max_unauthenticated_per_host`, or by default
    /// max(4, `max_unauthenticated` / 16).
    pub fn unauthenticated_per_host(&self) -> usize {
        match self.max_unauthenticated_per_host {
            0 => (self.max_unauthenticated / 16).max(4),
            n => n,
        }
    }
}

/// `[io]`: the file I/O backend.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct IoConfig {
    /// `auto` (io_uring if usable, else threads), `io-uring`, `threads`.
    pub backend: BackendChoice,
    /// Rings (io_uring) or threads (thread pool).
    pub workers: usize,
}

impl Default for IoConfig {
    fn default() -> Self {
        IoConfig {
            backend: BackendChoice::Auto,
            workers: 4,
        }
    }
}

/// `[rdma]`: how the RDMA data path runs.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RdmaConfig {
    /// Reactor threads that drive the RDMA connections, each many
    /// (0 = one per core).
    pub reactors: usize,
    /// Try file I/O on the reactor thread with `RWF_NOWAIT` before a
    /// storage thread (page-cache hits then cost no hand-off).
    pub inline_io: bool,
    /// A connection alone on its reactor has its FLUSHes (fsync) and its
    /// small writes that would block run on the reactor thread, as an NFS
    /// server thread runs a COMMIT (two thread hand-offs less per database
    /// commit); with other connections on the reactor they go to a worker.
    pub inline_when_alone: bool,
    /// After a connection's last activity its reactor keeps polling this long
    /// before it sleeps (lower latency, burns a core; 0 = off).
    #[serde(deserialize_with = "de_duration")]
    pub busy_poll: Duration,
    /// After completing a request whose client polls (completion by status
    /// block), keep polling this long: a polling client gets a polling
    /// server, an interrupt-mode client costs no server spinning.
    #[serde(deserialize_with = "de_duration")]
    pub busy_poll_polled: Duration,
    /// Soft provider: `connection` = each connection has its own context
    /// whose socket its thread reads (no engine thread); `engine` = one
    /// shared context with an engine thread.
    pub progress: ProgressChoice,
    /// Payload bytes of one WRITE request (each receive buffer is this plus
    /// the 56-byte header). Larger = fewer messages per big write, more
    /// registered memory per credit.
    pub max_write_size: u32,
    /// Receive flow control (seed 003's indicate window), per connection:
    /// bytes of Sends that arrive before a receive is posted for them that
    /// the server holds before it stops reading that connection until its
    /// receives catch up. A client within its credits never needs it; it
    /// bounds what one that is not can make the server buffer (soft
    /// provider; verbs devices have no such buffering).
    pub indicate_window: u32,
    /// The largest write one request may carry as a fragmented message
    /// (docs/protocol.md §5.12), announced to clients as MAX_MESSAGE;
    /// 0 = no fragments (every write is cut into `max_write_size` requests).
    pub max_message: u32,
    /// AUTH must arrive this long after an RDMA connection is accepted.
    #[serde(deserialize_with = "de_duration")]
    pub auth_timeout: Duration,
    /// A credit transaction unanswered this long marks its client slow
    /// (logged, counted); the connection stays (docs/durability.md §2).
    #[serde(deserialize_with = "de_duration")]
    pub credit_timeout: Duration,
    /// Soft provider: a peer whose host answers nothing this long (TCP
    /// keepalive and `TCP_USER_TIMEOUT` on the connection's socket) is
    /// dead and its connection is dropped.
    #[serde(deserialize_with = "de_duration")]
    pub dead_peer_timeout: Duration,
}

impl Default for RdmaConfig {
    fn default() -> Self {
        RdmaConfig {
            reactors: 0,
            inline_io: true,
            inline_when_alone: true,
            busy_poll: Duration::from_micros(20),
            busy_poll_polled: Duration::from_micros(100),
            progress: ProgressChoice::Connection,
            max_write_size: 64 * 1024,
            indicate_window: 128 * 1024,
            max_message: crate::io_phase::driver::DEFAULT_MAX_MESSAGE,
            auth_timeout: Duration::from_secs(10),
            credit_timeout: Duration::from_secs(10),
            dead_peer_timeout: Duration::from_secs(30),
        }
    }
}

/// `[rdma] progress`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ProgressChoice {
    Connection,
    Engine,
}

/// One `[exports]` entry: a path, or a table with options.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExportEntry {
    Path(PathBuf),
    Table(ExportTable),
}

/// `identity` of an export entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum IdentityKey {
    /// Every call as the server's own uid and gid.
    #[default]
    Server,
    /// Every call as the caller (docs/mount.md, "Identities").
    Client,
}

fn yes() -> bool {
    true
}
fn nobody() -> u32 {
    crate::fs::ids::NOBODY
}

/// The table form of an export entry. An unknown key is an error, as
/// everywhere in the file: a misspelt `readonly` must not leave an export
/// writable.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExportTable {
    pub path: PathBuf,
    #[serde(default)]
    pub read_only: bool,
    /// Who may read: user names, `"*"` (any authenticated user),
    /// `"anonymous"`. Default: everyone who can log in.
    #[serde(default)]
    pub readers: Option<Vec<String>>,
    /// Who may write (and read). Default: everyone who can log in.
    #[serde(default)]
    pub writers: Option<Vec<String>>,
    /// Open regular files that have more than one hard link (a hard
    /// link may name a file outside the export). Default: refused.
    #[serde(default)]
    pub allow_hardlinks: bool,
    /// `"server"` (default) or `"client"`.
    #[serde(default)]
    pub identity: IdentityKey,
    /// exports(5): uid 0 acts as `anon_uid`. Default true.
    #[serde(default = "yes")]
    pub root_squash: bool,
    /// exports(5): every caller acts as `anon_uid`. Default false.
    #[serde(default)]
    pub all_squash: bool,
    #[serde(default = "nobody")]
    pub anon_uid: u32,
    #[serde(default = "nobody")]
    pub anon_gid: u32,
    /// Logins whose asserted uid and gid are believed (user names, `"*"`).
    #[serde(default)]
    pub trust_client_ids: Vec<String>,
    /// Clients may create device nodes (default: EPERM).
    #[serde(default)]
    pub allow_devices: bool,
}

impl ExportTable {
    fn new(path: PathBuf) -> ExportTable {
        ExportTable {
            path,
            read_only: false,
            readers: None,
            writers: None,
            allow_hardlinks: false,
            identity: IdentityKey::Server,
            root_squash: true,
            all_squash: false,
            anon_uid: nobody(),
            anon_gid: nobody(),
            trust_client_ids: Vec::new(),
            allow_devices: false,
        }
    }

    fn identity(&self) -> crate::fs::ids::Identity {
        use crate::fs::ids::{Identity, IdentityMode};
        Identity {
            mode: match self.identity {
                IdentityKey::Server => IdentityMode::Server,
                IdentityKey::Client => IdentityMode::Client,
            },
            root_squash: self.root_squash,
            all_squash: self.all_squash,
            anon_uid: self.anon_uid,
            anon_gid: self.anon_gid,
            trust_client_ids: self.trust_client_ids.clone(),
        }
    }
}

impl<'de> Deserialize<'de> for ExportEntry {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        // Not `#[serde(untagged)]`: its one error ("did not match any
        // variant") would hide which key of the table is wrong.
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Path(PathBuf),
            Table(toml::Table),
        }
        match Raw::deserialize(d)? {
            Raw::Path(p) => Ok(ExportEntry::Path(p)),
            Raw::Table(t) => ExportTable::deserialize(t)
                .map(ExportEntry::Table)
                .map_err(serde::de::Error::custom),
        }
    }
}

/// One `[users.NAME]` entry: an argon2id password hash and/or a per-user
/// token verifier (both from `lwio hash-password`).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct UserEntry {
    /// argon2id PHC string.
    pub password: Option<String>,
    /// `lwio-token1$…` verifier of the user's token.
    pub token: Option<String>,
    /// The uid this user's calls run as on `identity = "client"` exports
    /// that do not trust its asserted ids (`trust_client_ids`).
    pub uid: Option<u32>,
    /// Its gid there (default: `uid`).
    pub gid: Option<u32>,
}

/// The whole file.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Side-channel listen address (`HOST:PORT`; port 0 = any free port).
    pub listen: String,
    /// Server name sent to clients (Context of the resume key); default: host name.
    pub server_name: Option<String>,
    /// Token file; created with a random token if missing.
    pub token_file: Option<PathBuf>,
    /// Accept logins without a token.
    pub allow_anonymous: bool,
    /// TLS 1.3 on the side channel (default true).
    pub tls: bool,
    /// PEM certificate chain; with neither this nor `tls_key`, a self-signed
    /// certificate is created beside the token file.
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of `tls_cert`.
    pub tls_key: Option<PathBuf>,
    /// Accept password logins over plain TCP (`tls = false`). Off by default:
    /// the password would cross the network in clear.
    pub allow_password_without_tls: bool,
    /// Users by name.
    pub users: BTreeMap<String, UserEntry>,
    /// RDMA provider for the data path.
    #[serde(deserialize_with = "de_provider")]
    pub provider: ProviderChoice,
    /// Only this verbs device listens (with `provider` `verbs` or `auto`);
    /// default: every usable one.
    pub device: Option<String>,
    /// RDMA listen address (`HOST:PORT`); default: the side channel's host
    /// with its port + 1 (port 0 stays 0). `--rdma-listen` overrides it.
    pub rdma_listen: Option<String>,
    /// Serve Prometheus metrics on `HOST:PORT` (`GET /metrics`);
    /// `--metrics` overrides it. Off by default.
    pub metrics_listen: Option<String>,
    /// Also accept the seed's unkeyed MD5 signature on RDMA AUTH
    /// (`lwio_proto::server::ServerConfig::allow_md5`). Insecure; off by
    /// default.
    pub compat_md5_auth: bool,
    /// Export name → directory.
    pub exports: BTreeMap<String, ExportEntry>,
    pub limits: Limits,
    pub io: IoConfig,
    pub rdma: RdmaConfig,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            listen: DEFAULT_LISTEN.to_string(),
            server_name: None,
            token_file: None,
            allow_anonymous: false,
            tls: true,
            tls_cert: None,
            tls_key: None,
            allow_password_without_tls: false,
            users: BTreeMap::new(),
            provider: ProviderChoice::Auto,
            device: None,
            rdma_listen: None,
            metrics_listen: None,
            compat_md5_auth: false,
            exports: BTreeMap::new(),
            limits: Limits::default(),
            io: IoConfig::default(),
            rdma: RdmaConfig::default(),
        }
    }
}

/// A configuration problem, with the file name when there is one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ConfigError(pub String);

impl Config {
    /// Parse TOML text and validate it.
    pub fn from_toml(text: &str) -> Result<Config, ConfigError> {
        let c: Config = toml::from_str(text).map_err(|e| {
            // One line: the message and where, not toml's multi-line excerpt.
            let msg = e.message().trim_end().replace('\n', " ");
            match e.span() {
                Some(sp) => {
                    let start = sp.start.min(text.len());
                    let line = text[..start].matches('\n').count() + 1;
                    let src = text.lines().nth(line - 1).unwrap_or("").trim();
                    ConfigError(format!("line {line} ({src}): {msg}"))
                }
                None => ConfigError(msg),
            }
        })?;
        c.validate()?;
        Ok(c)
    }

    /// Read and parse a file.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| ConfigError(format!("cannot read config file {}: {e}", path.display())))?;
        Config::from_toml(&text)
            .map_err(|e| ConfigError(format!("config file {}: {}", path.display(), e.0)))
    }

    /// Check values that TOML types alone do not.
    pub fn validate(&self) -> Result<(), ConfigError> {
        for name in self.exports.keys() {
            validate_export_name(name).map_err(ConfigError)?;
        }
        self.user_db()?;
        for (name, e) in &self.exports {
            if let ExportEntry::Table(t) = e {
                let trust = Some(t.trust_client_ids.clone());
                for (what, list) in [
                    ("readers", &t.readers),
                    ("writers", &t.writers),
                    ("trust_client_ids", &trust),
                ] {
                    for who in list.iter().flatten() {
                        if what == "trust_client_ids" && who == ANONYMOUS {
                            return Err(ConfigError(format!(
                                "exports.{name}.trust_client_ids: anonymous sessions cannot be trusted with ids (they act as anon_uid)"
                            )));
                        }
                        if who != ANY_USER && who != ANONYMOUS && !self.users.contains_key(who) {
                            return Err(ConfigError(format!(
                                "exports.{name}.{what}: unknown user {who:?} (define [users.{who}], or use \"*\" or \"anonymous\")"
                            )));
                        }
                    }
                }
            }
        }
        if self.tls_cert.is_some() != self.tls_key.is_some() {
            return Err(ConfigError(
                "tls_cert and tls_key go together: give both, or neither for a self-signed certificate".into(),
            ));
        }
        let l = &self.limits;
        if !(MIN_MAX_FRAME..=HARD_MAX_FRAME).contains(&l.max_frame) {
            return Err(ConfigError(format!(
                "limits.max_frame must be between {MIN_MAX_FRAME} and {HARD_MAX_FRAME}"
            )));
        }
        for (k, v) in [
            ("max_sessions", l.max_sessions),
            ("max_open_files_per_session", l.max_open_files_per_session),
            ("max_open_files", l.max_open_files),
            ("max_lock_owners_per_file", l.max_lock_owners_per_file),
            ("max_lock_owners_per_session", l.max_lock_owners_per_session),
            ("max_connections_per_host", l.max_connections_per_host),
            ("max_sessions_per_user", l.max_sessions_per_user),
            ("max_unauthenticated", l.max_unauthenticated),
            ("unauth_rate_per_host", l.unauth_rate_per_host as usize),
            ("unauth_burst_per_host", l.unauth_burst_per_host as usize),
            ("unauth_rate", l.unauth_rate as usize),
            ("unauth_burst", l.unauth_burst as usize),
            ("max_rdma_connections", l.max_rdma_connections),
            (
                "max_rdma_connections_per_host",
                l.max_rdma_connections_per_host,
            ),
        ] {
            if v == 0 {
                return Err(ConfigError(format!("limits.{k} must be at least 1")));
            }
        }
        if self.io.workers == 0 {
            return Err(ConfigError("io.workers must be at least 1".into()));
        }
        for (k, d) in [
            ("idle_timeout", l.idle_timeout),
            ("login_timeout", l.login_timeout),
            ("resume_key_ttl", l.resume_key_ttl),
            ("lease_break_timeout", l.lease_break_timeout),
        ] {
            if d.is_zero() {
                return Err(ConfigError(format!("limits.{k} must be greater than zero")));
            }
        }
        Ok(())
    }

    /// The settings of `new` that differ from `self` and that a running
    /// server cannot take (everything but `exports` and `users`): what a
    /// reload reports as "needs a restart", one key (or table) each.
    pub fn restart_changes(&self, new: &Config) -> Vec<&'static str> {
        let (a, b) = (self, new);
        // Every field is named here or below: a new setting must be sorted
        // into live or restart-only before this compiles.
        let Config {
            listen: _,
            server_name: _,
            token_file: _,
            allow_anonymous: _,
            tls: _,
            tls_cert: _,
            tls_key: _,
            allow_password_without_tls: _,
            users: _,
            provider: _,
            device: _,
            rdma_listen: _,
            metrics_listen: _,
            compat_md5_auth: _,
            exports: _,
            limits: _,
            io: _,
            rdma: _,
        } = a;
        let mut out = Vec::new();
        macro_rules! keys {
            ($($k:ident),*) => {$(
                if a.$k != b.$k {
                    out.push(stringify!($k));
                }
            )*};
        }
        keys!(
            listen,
            server_name,
            token_file,
            allow_anonymous,
            tls,
            tls_cert,
            tls_key,
            allow_password_without_tls,
            provider,
            device,
            rdma_listen,
            metrics_listen,
            compat_md5_auth,
            limits,
            io,
            rdma
        );
        out
    }

    /// Add or replace an export (command-line `--export` overrides the file;
    /// an export replaced this way keeps the file's access lists).
    pub fn set_export(&mut self, spec: &ExportSpec) {
        let mut t = match self.exports.get(&spec.name) {
            Some(ExportEntry::Table(t)) => t.clone(),
            _ => {
                let mut t = ExportTable::new(spec.path.clone());
                t.allow_hardlinks = spec.allow_hardlinks;
                t
            }
        };
        t.path = spec.path.clone();
        t.read_only = spec.read_only;
        self.exports
            .insert(spec.name.clone(), ExportEntry::Table(t));
    }

    /// The configured users with parsed credentials.
    pub fn user_db(&self) -> Result<UserDb, ConfigError> {
        let mut db = UserDb::new();
        for (name, u) in &self.users {
            validate_user_name(name).map_err(|e| ConfigError(format!("users.{name}: {e}")))?;
            if u.gid.is_some() && u.uid.is_none() {
                return Err(ConfigError(format!(
                    "users.{name}: gid without uid: give uid too"
                )));
            }
            if u.password.is_none() && u.token.is_none() {
                return Err(ConfigError(format!(
                    "users.{name}: give `password` (an argon2id hash) and/or `token` (a token verifier), both from `lwio hash-password`"
                )));
            }
            if let Some(p) = &u.password {
                check_password_hash(p)
                    .map_err(|e| ConfigError(format!("users.{name}.password: {e}")))?;
            }
            let token = match &u.token {
                Some(t) => Some(
                    TokenVerifier::parse(t)
                        .map_err(|e| ConfigError(format!("users.{name}.token: {e}")))?,
                ),
                None => None,
            };
            db.insert(
                name.clone(),
                UserCredentials {
                    password: u.password.clone(),
                    token,
                    ids: u.uid.map(|uid| (uid, u.gid.unwrap_or(uid))),
                },
            );
        }
        Ok(db)
    }

    /// Access list of every export.
    pub fn acls(&self) -> HashMap<String, Acl> {
        self.exports
            .iter()
            .map(|(name, e)| {
                let acl = match e {
                    ExportEntry::Path(_) => Acl::default(),
                    ExportEntry::Table(t) => {
                        Acl::from_lists(t.readers.as_deref(), t.writers.as_deref())
                    }
                };
                (name.clone(), acl)
            })
            .collect()
    }

    /// Exports as specs, sorted by name.
    pub fn export_specs(&self) -> Vec<ExportSpec> {
        self.exports
            .iter()
            .map(|(name, e)| match e {
                ExportEntry::Path(p) => ExportSpec {
                    name: name.clone(),
                    path: p.clone(),
                    ..ExportSpec::default()
                },
                ExportEntry::Table(t) => ExportSpec {
                    name: name.clone(),
                    path: t.path.clone(),
                    read_only: t.read_only,
                    allow_hardlinks: t.allow_hardlinks,
                    identity: t.identity(),
                    allow_devices: t.allow_devices,
                },
            })
            .collect()
    }
}

/// The default token file (shared with clients).
pub use lwio_side::defaults::default_token_file;

/// The example from docs/config.md (kept in sync by a test).
pub const EXAMPLE: &str = r#"# /etc/lwio/lwio.toml
listen = "0.0.0.0:7420"
server_name = "storage1"
token_file = "/etc/lwio/token"
allow_anonymous = false
provider = "auto"
tls = true
tls_cert = "/etc/lwio/cert.pem"
tls_key = "/etc/lwio/key.pem"
allow_password_without_tls = false

[exports]
data = { path = "/srv/data", readers = ["*"], writers = ["alice"] }
logs = { path = "/var/log/app", read_only = true }

[users.alice]
password = "$argon2id$v=19$m=19456,t=2,p=1$c2FsdHNhbHRzYWx0$8Jz3Y0Jq4V3m4yQv2Yl1bX0cVb0W8Kq9yQd3W2xJmWQ"

[users.backup]
token = "lwio-token1$9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08$60303ae22b998861bce3b28f33eec1be758a213c86c93c076dbe9f558c11c752"

[limits]
max_frame = 1048576
max_sessions = 4096
idle_timeout = "5m"
login_timeout = "10s"
max_open_files_per_session = 16384
max_open_files = 1000000
max_open_descriptors = 0
max_lock_owners_per_file = 64
max_lock_owners_per_session = 1024
resume_key_ttl = "60s"
shutdown_grace = "10s"
max_connections_per_host = 64
max_sessions_per_user = 64
max_unauthenticated = 128
max_unauthenticated_per_host = 0
unauth_rate_per_host = 20
unauth_burst_per_host = 40
unauth_rate = 200
unauth_burst = 400
max_leases_per_session = 1024
max_leases = 65536
lease_break_timeout = "2s"
durable_grace = "60s"
max_rdma_connections = 4096
max_rdma_connections_per_host = 32

[io]
backend = "auto"
workers = 4

[rdma]
reactors = 0
inline_io = true
inline_when_alone = true
busy_poll = "20us"
busy_poll_polled = "100us"
progress = "connection"
max_write_size = 65536
indicate_window = 131072
max_message = 16777216
auth_timeout = "10s"
credit_timeout = "10s"
dead_peer_timeout = "30s"
"#;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn example_parses() {
        let c = Config::from_toml(EXAMPLE).unwrap();
        assert_eq!(c.listen, "0.0.0.0:7420");
        assert!(!c.compat_md5_auth);
        assert_eq!(c.server_name.as_deref(), Some("storage1"));
        assert_eq!(c.provider, ProviderChoice::Auto);
        assert_eq!(c.limits.idle_timeout, Duration::from_secs(300));
        let specs = c.export_specs();
        assert_eq!(specs.len(), 2);
        assert_eq!(specs[0].name, "data");
        assert!(!specs[0].read_only);
        assert_eq!(specs[1].path, PathBuf::from("/var/log/app"));
        assert!(specs[1].read_only);
        assert_eq!(c.io.backend, BackendChoice::Auto);
        assert!(c.tls);
        let users = c.user_db().unwrap();
        assert!(users["alice"].password.is_some());
        assert!(users["backup"].token.is_some());
        let acls = c.acls();
        let alice = crate::side_service::access::Principal::User("alice".into());
        let backup = crate::side_service::access::Principal::User("backup".into());
        assert!(acls["data"].rights(&alice).write);
        assert!(!acls["data"].rights(&backup).write);
        assert!(acls["data"].rights(&backup).read);
        assert!(acls["logs"].rights(&backup).write, "default list");
        assert_eq!(
            c.limits,
            Limits::default(),
            "the example shows the defaults"
        );
    }

    #[test]
    fn rdma_table() {
        let c = Config::from_toml(EXAMPLE).unwrap();
        assert_eq!(
            c.rdma,
            RdmaConfig::default(),
            "the example shows the defaults"
        );
        let c = Config::from_toml(
            "[rdma]\ninline_io = false\ninline_when_alone = false\nbusy_poll = \"250us\"\nprogress = \"engine\"\nmax_write_size = 262144\nindicate_window = 32768",
        )
        .unwrap();
        assert_eq!(
            c.rdma,
            RdmaConfig {
                inline_io: false,
                inline_when_alone: false,
                busy_poll: Duration::from_micros(250),
                busy_poll_polled: Duration::from_micros(100),
                progress: ProgressChoice::Engine,
                max_write_size: 262144,
                indicate_window: 32768,
                max_message: crate::io_phase::driver::DEFAULT_MAX_MESSAGE,
                ..RdmaConfig::default()
            }
        );
        let t = Config::from_toml(
            "[rdma]\nauth_timeout = \"3s\"\ncredit_timeout = \"1s\"\ndead_peer_timeout = \"5s\"",
        )
        .unwrap();
        let o = crate::io_phase::driver::RdmaServerOptions::from_config(
            &t,
            "127.0.0.1:0".parse().unwrap(),
        );
        assert_eq!(o.proto.auth_timeout, Duration::from_secs(3));
        assert_eq!(o.proto.credit_timeout, Duration::from_secs(1));
        assert_eq!(o.rdma.dead_peer_timeout, Some(Duration::from_secs(5)));
        let e = Config::from_toml("[rdma]\nprogress = \"threads\"").unwrap_err();
        assert!(e.0.contains("unknown variant"), "{e}");
        let o = crate::io_phase::driver::RdmaServerOptions::from_config(
            &c,
            "127.0.0.1:0".parse().unwrap(),
        );
        assert!(!o.inline_io && !o.inline_when_alone && !o.conn_contexts);
        assert_eq!(o.busy_poll, Duration::from_micros(250));
        assert_eq!(o.proto.max_recv_buffer_size, 262144);
        assert_eq!(o.recv_window, Some(32768));
    }

    #[test]
    fn example_is_documented() {
        let doc = include_str!("../../../docs/config.md");
        assert!(
            doc.contains(EXAMPLE),
            "docs/config.md must contain config::EXAMPLE verbatim"
        );
    }

    #[test]
    fn defaults() {
        let c = Config::from_toml("").unwrap();
        assert_eq!(c, Config::default());
        assert_eq!(c.limits.max_frame, DEFAULT_MAX_FRAME);
    }

    #[test]
    fn unknown_keys_are_refused_in_every_table() {
        for (text, key) in [
            (
                "[exports]\ndata = { path = \"/d\", readonly = true }",
                "readonly",
            ),
            ("[exports.data]\npath = \"/d\"\nwriter = [\"*\"]", "writer"),
            (
                "[exports]\ndata = { path = \"/d\", identity = \"client\", rootsquash = false }",
                "rootsquash",
            ),
            ("[users.alice]\npasswd = \"x\"", "passwd"),
            ("[limits]\nmax_sesions = 1", "max_sesions"),
            ("[io]\nworker = 1", "worker"),
            ("[rdma]\nprogres = \"engine\"", "progres"),
        ] {
            let e = Config::from_toml(text).unwrap_err();
            assert!(
                e.0.contains(&format!("unknown field `{key}`")),
                "{text}: {e}"
            );
            assert!(!e.0.contains('\n'), "one line: {e}");
        }
        // The keys that exist are taken.
        let c = Config::from_toml(
            "[users.alice]\ntoken = \"lwio-token1$00$00\"\nuid = 1000\n[exports]\ndata = { path = \"/d\", identity = \"client\", trust_client_ids = [\"alice\"], all_squash = true, anon_uid = 7, anon_gid = 8, allow_devices = true }",
        );
        // (The token verifier above is malformed on purpose: the error
        // names it, not an unknown key.)
        assert!(c.unwrap_err().0.contains("users.alice.token"));
        let c = Config::from_toml(
            "[exports]\ndata = { path = \"/d\", identity = \"client\", trust_client_ids = [\"*\"], root_squash = false, anon_uid = 7, allow_devices = true }",
        )
        .unwrap();
        let spec = &c.export_specs()[0];
        assert_eq!(spec.identity.mode, crate::fs::ids::IdentityMode::Client);
        assert!(!spec.identity.root_squash && spec.allow_devices);
        assert_eq!((spec.identity.anon_uid, spec.identity.anon_gid), (7, 65534));
        let e = Config::from_toml("[exports]\ndata = { path = \"/d\", identity = \"root\" }")
            .unwrap_err();
        assert!(e.0.contains("unknown variant `root`"), "{e}");
        let e = Config::from_toml(
            "[exports]\ndata = { path = \"/d\", identity = \"client\", trust_client_ids = [\"mallory\"] }",
        )
        .unwrap_err();
        assert!(e.0.contains("unknown user \"mallory\""), "{e}");
    }

    #[test]
    fn errors_are_readable() {
        let e = Config::from_toml("listn = \"x\"").unwrap_err();
        assert!(e.0.contains("unknown field"), "{e}");
        let e = Config::from_toml("[limits]\nidle_timeout = \"soon\"").unwrap_err();
        assert!(e.0.contains("invalid duration"), "{e}");
        let e = Config::from_toml("[limits]\nmax_frame = 10").unwrap_err();
        assert!(e.0.contains("max_frame"), "{e}");
        let e = Config::from_toml("[exports]\n\"a/b\" = \"/x\"").unwrap_err();
        assert!(e.0.contains("invalid export name"), "{e}");
        let e = Config::from_toml("provider = \"magic\"").unwrap_err();
        assert!(e.0.contains("provider"), "{e}");
        let e = Config::from_toml("[io]\nbackend = \"io_uring\"").unwrap();
        assert_eq!(e.io.backend, BackendChoice::IoUring);
    }

    #[test]
    fn restart_changes_name_every_setting_but_exports_and_users() {
        let a = Config::from_toml("[exports]\nd = \"/d\"\n").unwrap();
        assert!(a.restart_changes(&a).is_empty());
        let b = Config::from_toml(
            "listen = \"127.0.0.1:1\"\ntls = false\n[limits]\nmax_sessions = 2\n[exports]\ne = \"/e\"\n[users.u]\ntoken = \"lwio-token1$0000000000000000000000000000000000000000000000000000000000000000$0000000000000000000000000000000000000000000000000000000000000000\"\n",
        )
        .unwrap();
        assert_eq!(a.restart_changes(&b), ["listen", "tls", "limits"]);
    }

    #[test]
    fn flags_override() {
        let mut c = Config::from_toml(EXAMPLE).unwrap();
        c.set_export(&"data=/elsewhere".parse().unwrap());
        c.set_export(&"new=/new".parse().unwrap());
        let specs = c.export_specs();
        assert_eq!(specs.len(), 3);
        assert_eq!(specs[0].path, PathBuf::from("/elsewhere"));
    }

    #[test]
    fn allow_hardlinks_per_export() {
        let c = Config::from_toml(
            "[exports]\na = \"/a\"\nb = { path = \"/b\", allow_hardlinks = true }\nc = { path = \"/c\" }",
        )
        .unwrap();
        let specs = c.export_specs();
        assert!(!specs[0].allow_hardlinks);
        assert!(specs[1].allow_hardlinks);
        assert!(!specs[2].allow_hardlinks);
        let mut c = c;
        c.set_export(&"b=/elsewhere".parse().unwrap());
        assert!(c.export_specs()[1].allow_hardlinks, "kept from the file");
    }
}
