//! The server configuration file (TOML). Every key is documented in
//! `docs/config.md`. Command-line flags override the file.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Deserializer};

use crate::fs::backend::BackendChoice;
use crate::fs::{validate_export_name, ExportSpec};
use crate::side::codec::{DEFAULT_MAX_FRAME, HARD_MAX_FRAME, MIN_MAX_FRAME};
use crate::units::parse_duration;

/// Default side-channel listen address.
pub const DEFAULT_LISTEN: &str = "0.0.0.0:7420";

/// Which RDMA provider the server (and `lwio` clients) use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum ProviderChoice {
    /// The first usable provider, in `lwio_rdma::providers()` order.
    #[default]
    Auto,
    /// The user-space iWARP provider over TCP (runs anywhere).
    Soft,
    /// libibverbs: RDMA NICs, rxe, siw.
    Verbs,
}

impl ProviderChoice {
    pub fn as_str(self) -> &'static str {
        match self {
            ProviderChoice::Auto => "auto",
            ProviderChoice::Soft => "soft",
            ProviderChoice::Verbs => "verbs",
        }
    }
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
    /// How long a server request resume key (and a negotiate key) is accepted.
    #[serde(deserialize_with = "de_duration")]
    pub resume_key_ttl: Duration,
    /// On SIGINT/SIGTERM, how long in-flight requests may take before
    /// sessions are cut.
    #[serde(deserialize_with = "de_duration")]
    pub shutdown_grace: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_frame: DEFAULT_MAX_FRAME,
            max_sessions: 256,
            idle_timeout: Duration::from_secs(300),
            login_timeout: Duration::from_secs(10),
            max_open_files_per_session: 1024,
            resume_key_ttl: Duration::from_secs(60),
            shutdown_grace: Duration::from_secs(10),
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

/// One `[exports]` entry: a path, or a table with options.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(untagged)]
pub enum ExportEntry {
    Path(PathBuf),
    Table {
        path: PathBuf,
        #[serde(default)]
        read_only: bool,
    },
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
    /// RDMA provider for the data path.
    pub provider: ProviderChoice,
    /// Export name → directory.
    pub exports: BTreeMap<String, ExportEntry>,
    pub limits: Limits,
    pub io: IoConfig,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            listen: DEFAULT_LISTEN.to_string(),
            server_name: None,
            token_file: None,
            allow_anonymous: false,
            provider: ProviderChoice::Auto,
            exports: BTreeMap::new(),
            limits: Limits::default(),
            io: IoConfig::default(),
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
        let l = &self.limits;
        if !(MIN_MAX_FRAME..=HARD_MAX_FRAME).contains(&l.max_frame) {
            return Err(ConfigError(format!(
                "limits.max_frame must be between {MIN_MAX_FRAME} and {HARD_MAX_FRAME}"
            )));
        }
        if l.max_sessions == 0 || l.max_open_files_per_session == 0 || self.io.workers == 0 {
            return Err(ConfigError(
                "limits.max_sessions, limits.max_open_files_per_session and io.workers must be at least 1".into(),
            ));
        }
        for (k, d) in [
            ("idle_timeout", l.idle_timeout),
            ("login_timeout", l.login_timeout),
            ("resume_key_ttl", l.resume_key_ttl),
        ] {
            if d.is_zero() {
                return Err(ConfigError(format!("limits.{k} must be greater than zero")));
            }
        }
        Ok(())
    }

    /// Add or replace an export (command-line `--export` overrides the file).
    pub fn set_export(&mut self, spec: &ExportSpec) {
        self.exports.insert(
            spec.name.clone(),
            ExportEntry::Table {
                path: spec.path.clone(),
                read_only: spec.read_only,
            },
        );
    }

    /// Exports as specs, sorted by name.
    pub fn export_specs(&self) -> Vec<ExportSpec> {
        self.exports
            .iter()
            .map(|(name, e)| match e {
                ExportEntry::Path(p) => ExportSpec {
                    name: name.clone(),
                    path: p.clone(),
                    read_only: false,
                },
                ExportEntry::Table { path, read_only } => ExportSpec {
                    name: name.clone(),
                    path: path.clone(),
                    read_only: *read_only,
                },
            })
            .collect()
    }
}

/// The default token file: `$LWIO_TOKEN_FILE`, else
/// `$XDG_CONFIG_HOME/lwio/token`, else `$HOME/.config/lwio/token`.
pub fn default_token_file() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("LWIO_TOKEN_FILE").filter(|p| !p.is_empty()) {
        return Some(PathBuf::from(p));
    }
    if let Some(x) = std::env::var_os("XDG_CONFIG_HOME").filter(|p| !p.is_empty()) {
        return Some(PathBuf::from(x).join("lwio/token"));
    }
    std::env::var_os("HOME")
        .filter(|p| !p.is_empty())
        .map(|h| PathBuf::from(h).join(".config/lwio/token"))
}

/// The example from docs/config.md (kept in sync by a test).
pub const EXAMPLE: &str = r#"# /etc/lwio/lwio.toml
listen = "0.0.0.0:7420"
server_name = "storage1"
token_file = "/etc/lwio/token"
allow_anonymous = false
provider = "auto"

[exports]
data = "/srv/data"
logs = { path = "/var/log/app", read_only = true }

[limits]
max_frame = 1048576
max_sessions = 256
idle_timeout = "5m"
login_timeout = "10s"
max_open_files_per_session = 1024
resume_key_ttl = "60s"
shutdown_grace = "10s"

[io]
backend = "auto"
workers = 4
"#;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn example_parses() {
        let c = Config::from_toml(EXAMPLE).unwrap();
        assert_eq!(c.listen, "0.0.0.0:7420");
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
    fn flags_override() {
        let mut c = Config::from_toml(EXAMPLE).unwrap();
        c.set_export(&"data=/elsewhere".parse().unwrap());
        c.set_export(&"new=/new".parse().unwrap());
        let specs = c.export_specs();
        assert_eq!(specs.len(), 3);
        assert_eq!(specs[0].path, PathBuf::from("/elsewhere"));
    }
}
