//! The `lwio` command line: argument definitions (clap derive) and the
//! commands that work without the RDMA data path.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::{ArgGroup, Args, Parser, Subcommand, ValueEnum};

use lwio_client::side_client::{SideClient, SideOptions};
use lwio_client::url::LwioUrl;
use lwio_client::{ConnectArgs, ProviderChoice};
use lwio_server::config::Config;
use lwio_server::fs::backend::BackendChoice;
use lwio_server::fs::ExportSpec;
use lwio_server::Service;
use lwio_side::error::{Error, ErrorCode};
use lwio_side::units::{parse_duration, parse_size};
use lwio_side::{Attr, FileKind, Token};

const MAIN_EXAMPLES: &str = "\
Examples:
  lwio serve --export data=/srv/data            serve a directory on port 7420
  lwio ls lwio://storage1/data                  list a directory
  lwio stat lwio://storage1/data/db/file.bin    show a file's attributes
  lwio bench                                    benchmark on an embedded default setup
  lwio devices                                  list RDMA providers and devices

URLs are lwio://HOST[:PORT]/EXPORT/PATH (port 7420 by default; IPv6 as [::1];
segments are percent-decoded, e.g. %20 for a space).
Logging: RUST_LOG (default info). Token: --token-file FILE or LWIO_TOKEN.
The side channel uses TLS 1.3: pin the server with --fingerprint sha256:…
(printed by `lwio serve`, or LWIO_FINGERPRINT), or --ca FILE. See docs/security.md.";

/// `--provider auto|soft|verbs` (the values are listed in `--help`).
fn provider_parser() -> impl clap::builder::TypedValueParser<Value = ProviderChoice> {
    use clap::builder::TypedValueParser;
    clap::builder::PossibleValuesParser::new(ProviderChoice::ALL.map(ProviderChoice::as_str)).map(
        |s| {
            s.parse::<ProviderChoice>()
                .expect("a listed provider name parses")
        },
    )
}

/// lwio: RDMA I/O offload. An application server hands its file reads and
/// writes to a storage server over RDMA.
#[derive(Debug, Parser)]
#[command(name = "lwio", version, about, long_about = None, after_help = MAIN_EXAMPLES)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the storage server (side channel; RDMA listener when available).
    #[command(after_help = "\
Examples:
  lwio serve --export data=/srv/data
  lwio serve --export data=/srv/data --export logs=/var/log/app --listen [::]:7420
  lwio serve --config /etc/lwio/lwio.toml --provider soft
  lwio serve --export data=/tmp/d --listen 127.0.0.1:0 --ready-file /tmp/lwio.addr
  lwio serve --check-config /etc/lwio/lwio.toml   check a file, print what would be served

The token file is created with a random token (mode 0600) if it does not exist;
copy it to clients. SIGINT/SIGTERM stop the server gracefully. Under systemd
(NOTIFY_SOCKET) it reports READY=1 once every listener accepts, and STATUS=.
SIGHUP re-reads and checks the config file (docs/operations.md).")]
    Serve(ServeArgs),
    /// List a directory, or the exports when the URL names none.
    #[command(after_help = "\
Examples:
  lwio ls lwio://storage1/                  list the exports
  lwio ls lwio://storage1/data              list the root of export data
  lwio ls -l lwio://[::1]:7000/data/db      long listing over IPv6")]
    Ls(LsArgs),
    /// Show the attributes of a file or directory.
    #[command(after_help = "\
Examples:
  lwio stat lwio://storage1/data/db/file.bin
  LWIO_TOKEN=$(cat token) lwio stat lwio://10.0.0.5/data/")]
    Stat(UrlArgs),
    /// Show a server's metrics: connections, credits, memory, requests by
    /// opcode with latency, error statuses (the series of `serve --metrics`).
    #[command(after_help = "\
Examples:
  lwio stats lwio://storage1/            a table for a person
  lwio stats --raw lwio://storage1/      the OpenMetrics text, as Prometheus scrapes it")]
    Stats(StatsArgs),
    /// Remove a file, a symbolic link or an empty directory.
    #[command(after_help = "\
Examples:
  lwio rm lwio://storage1/data/old.bin
  lwio rm lwio://storage1/data/empty-dir")]
    Rm(UrlArgs),
    /// Create a directory.
    #[command(after_help = "\
Examples:
  lwio mkdir lwio://storage1/data/new
  lwio mkdir -p lwio://storage1/data/a/b/c")]
    Mkdir(MkdirArgs),
    /// Write a remote file to standard output (over the LWIO data path).
    #[command(after_help = "\
Examples:
  lwio cat lwio://storage1/data/config.json
  lwio cat lwio://storage1/data/big.bin | sha256sum")]
    Cat(CatArgs),
    /// Copy files between local paths and lwio URLs (over the LWIO data path).
    #[command(after_help = "\
Examples:
  lwio cp ./local.bin lwio://storage1/data/remote.bin
  lwio cp lwio://storage1/data/remote.bin ./copy.bin
  lwio cp -r ./dir lwio://storage1/data/dir")]
    Cp(CpArgs),
    /// Publish memory as a file other hosts read and write by path, over
    /// RDMA, until Ctrl-C or SIGTERM (docs/memory-objects.md).
    #[command(after_help = "\
Examples:
  lwio publish lwio://storage1/data weights --file ./weights.bin --read-only
  lwio publish lwio://storage1/data scratch --size 1GiB --out ./scratch.bin

Prints the object's URL (lwio://HOST:PORT/EXPORT/.lwio-mem/NAME) on the first
line of standard output, then serves: others `lwio cat`, `lwio cp` or mount it.
On Ctrl-C or SIGTERM it unpublishes, and with --out writes the final contents.")]
    Publish(PublishArgs),
    /// Mount an export (or a directory in it) as a file system (FUSE): any
    /// program reads and writes it, file data over RDMA.
    #[command(after_help = "\
Examples:
  lwio mount lwio://localhost/data /mnt/data          foreground; Ctrl-C unmounts
  lwio mount --daemon lwio://srv/data/db /mnt/db -o ro,provider=soft
  fusermount3 -u /mnt/data                            unmount (or umount as root)

Options (-o, comma-separated, as mount(8) passes them):
  ro, rw, allow_other, allow_root, default_permissions,
  attr_timeout=SECS, entry_timeout=SECS (default 1), threads=N (default 4),
  max_io=BYTES (largest read/write, default 1 MiB), fsname=NAME, direct_io,
  completion=interrupt|poll, provider=auto|soft|verbs, device=NAME,
  token_file=FILE, user=NAME, password_file=FILE, fingerprint=sha256:HEX,
  ca=FILE, insecure, no_tls, connect_timeout=DURATION.
/etc/fstab:
  lwio://srv/data  /mnt/data  fuse.lwio  defaults,_netdev,token_file=/etc/lwio/token  0 0
See docs/mount.md.")]
    Mount(MountArgs),
    /// Benchmark file I/O through lwio (fio-like). Without a URL: an embedded
    /// server on loopback with the soft provider and a temporary file.
    #[command(after_help = "\
Examples:
  lwio bench
  lwio bench lwio://storage1/data/bench.dat --rw randread --bs 4k --qd 32 --jobs 4 --runtime 30s
  lwio bench --rw write --bs 1M --qd 4 --size 1GiB --completion interrupt --json")]
    Bench(BenchArgs),
    /// List RDMA providers and their devices (like ibv_devices).
    #[command(after_help = "\
Examples:
  lwio devices")]
    Devices,
    /// Raw RDMA verbs benchmark, over loopback or between two hosts (like ib_write_bw).
    #[command(after_help = "\
Examples:
  lwio rdma-bench --op write --size 1M --iters 2000          # both ends here, loopback
  lwio rdma-bench --op send --size 64 --iters 20000 --poll   # latency, busy-polling
  lwio rdma-bench --op write --size 64k --listen 0.0.0.0:7471
  lwio rdma-bench --op write --size 64k --iters 10000 --connect 10.0.0.5:7471 --poll")]
    RdmaBench(RdmaBenchArgs),
    /// Hash a password (argon2id) or a user token for `[users.NAME]` in the
    /// server config. Reads from standard input, or asks on the terminal.
    #[command(after_help = "\
Examples:
  lwio hash-password                          asks twice, prints $argon2id$…
  echo -n 's3cret' | lwio hash-password       from standard input (first line)
  lwio hash-password --token < alice.token    prints lwio-token1$… for a token
  lwio hash-password --new-token              a fresh token and its verifier

Put the output in the server config:
  [users.alice]
  password = \"$argon2id$v=19$…\"")]
    HashPassword(HashPasswordArgs),
    /// Write the man pages or shell completions (for packaging).
    #[command(hide = true)]
    Generate(GenerateArgs),
}

#[derive(Debug, Args)]
pub struct GenerateArgs {
    #[command(subcommand)]
    pub what: GenerateWhat,
}

#[derive(Debug, Subcommand)]
pub enum GenerateWhat {
    /// lwio.1, lwio-SUBCOMMAND.1, lwio.toml.5 and liblwio.3 into DIR.
    Man { dir: PathBuf },
    /// Completions for bash (lwio), zsh (_lwio) and fish (lwio.fish) into DIR.
    Completions { dir: PathBuf },
}

/// `--log-format`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Default)]
pub enum LogFormat {
    /// One line per event.
    #[default]
    Text,
    /// One JSON object per line (for log shippers).
    Json,
}

#[derive(Debug, Args)]
pub struct HashPasswordArgs {
    /// Read a user token (not a password) and print its verifier.
    #[arg(long, conflicts_with = "new_token")]
    pub token: bool,
    /// Generate a random token; print it and its verifier.
    #[arg(long)]
    pub new_token: bool,
}

/// Options shared by client commands.
#[derive(Debug, Clone, Args)]
pub struct ClientArgs {
    /// Token file for login (default: $LWIO_TOKEN, then $LWIO_TOKEN_FILE or
    /// ~/.config/lwio/token if it exists, else anonymous).
    #[arg(long, value_name = "FILE")]
    pub token_file: Option<PathBuf>,
    /// Give up connecting after this long.
    #[arg(long, value_name = "DURATION", default_value = "5s", value_parser = parse_duration)]
    pub connect_timeout: Duration,
    /// Log in as this user: with --token-file/LWIO_TOKEN its per-user token,
    /// else a password (--password-file, LWIO_PASSWORD, or asked).
    #[arg(long, value_name = "NAME")]
    pub user: Option<String>,
    /// File holding the password of --user (first line).
    #[arg(long, value_name = "FILE", requires = "user")]
    pub password_file: Option<PathBuf>,
    /// Trust the server only if its TLS certificate has this SHA-256
    /// fingerprint (as printed by `lwio serve`; default $LWIO_FINGERPRINT).
    #[arg(long, value_name = "sha256:HEX", conflicts_with_all = ["ca", "insecure", "no_tls"])]
    pub fingerprint: Option<String>,
    /// Verify the server's TLS certificate against the CA certificates in
    /// this PEM file (default: the system's root certificates).
    #[arg(long, value_name = "FILE", conflicts_with_all = ["insecure", "no_tls"])]
    pub ca: Option<PathBuf>,
    /// Use TLS without verifying the server (anyone on the path can
    /// impersonate it). Prints a warning.
    #[arg(long, conflicts_with = "no_tls")]
    pub insecure: bool,
    /// Plain TCP, for servers configured with `tls = false`.
    #[arg(long)]
    pub no_tls: bool,
    /// Servers trusted on first use, as ssh's known_hosts (default
    /// $LWIO_KNOWN_HOSTS, else ~/.config/lwio/known_hosts): without
    /// --fingerprint/--ca, a server not yet there is recorded with its
    /// certificate's fingerprint, and a changed certificate is refused.
    #[arg(long, value_name = "FILE")]
    pub known_hosts: Option<PathBuf>,
    /// Refuse servers that are not in known_hosts instead of trusting them
    /// on first use (ssh's StrictHostKeyChecking=yes; also
    /// LWIO_STRICT_HOST_KEY_CHECKING=yes).
    #[arg(long)]
    pub strict_host_key_checking: bool,
    /// RDMA provider of the data path: `auto` tries the verbs devices that
    /// route to the server first, then the soft provider; `soft`; `verbs`.
    #[arg(long, value_parser = provider_parser(), default_value = "auto")]
    pub provider: ProviderChoice,
    /// Verbs device to use (default: the ones that route to the server).
    #[arg(long, value_name = "NAME")]
    pub device: Option<String>,
    /// Interrupt completions: how long a waiting thread polls for its
    /// completion before it sleeps ("0s": it sleeps at once; at most one
    /// thread per CPU polls at a time). Default: the client library's, 50us.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub busy_poll: Option<Duration>,
}

#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// Export a directory as NAME (repeatable; overrides the config file's NAME).
    #[arg(long = "export", value_name = "NAME=PATH")]
    pub exports: Vec<ExportSpec>,
    /// Side-channel address (default 0.0.0.0:7420; port 0 picks a free port).
    #[arg(long, value_name = "ADDR")]
    pub listen: Option<String>,
    /// Token file; created with a random token if missing.
    #[arg(long, value_name = "FILE")]
    pub token_file: Option<PathBuf>,
    /// TOML configuration file (see docs/config.md).
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// RDMA provider for the data path.
    #[arg(long, value_parser = provider_parser())]
    pub provider: Option<ProviderChoice>,
    /// Only this verbs device listens (default: every usable one).
    #[arg(long, value_name = "NAME")]
    pub device: Option<String>,
    /// File I/O backend: auto, io-uring, threads.
    #[arg(long, value_name = "BACKEND")]
    pub io_backend: Option<BackendChoice>,
    /// Also accept logins without a token (read-only, except on exports
    /// whose `writers` list "anonymous").
    #[arg(long)]
    pub anonymous: bool,
    /// TLS certificate chain (PEM). Without --tls-cert/--tls-key, a
    /// self-signed certificate is created beside the token file.
    #[arg(
        long,
        value_name = "FILE",
        requires = "tls_key",
        conflicts_with = "no_tls"
    )]
    pub tls_cert: Option<PathBuf>,
    /// Private key of --tls-cert (PEM).
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// Serve the side channel over plain TCP (clients need --no-tls).
    #[arg(long)]
    pub no_tls: bool,
    /// Write the bound address to FILE once listening.
    #[arg(long, value_name = "FILE")]
    pub ready_file: Option<PathBuf>,
    /// RDMA listen address (default: the side channel's host, port + 1;
    /// port 0 picks a free port).
    #[arg(long, value_name = "ADDR")]
    pub rdma_listen: Option<String>,
    /// Serve Prometheus metrics at http://ADDR/metrics (plain HTTP: bind it
    /// to a management address; a port alone means 127.0.0.1). Same as
    /// `metrics_listen = "ADDR"`.
    #[arg(long, value_name = "ADDR")]
    pub metrics: Option<String>,
    /// Also accept the seed's unkeyed MD5 RDMA AUTH signature (insecure:
    /// anyone who knows a negotiate Key can then authenticate; see
    /// docs/security.md). Same as `compat_md5_auth = true`.
    #[arg(long)]
    pub compat_md5_auth: bool,
    /// Check FILE (a --config file, with the other flags given) instead of
    /// serving: print what the server would do and exit 0, or one line per
    /// problem and exit 1.
    #[arg(long, value_name = "FILE", conflicts_with = "config")]
    pub check_config: Option<PathBuf>,
    /// Log format on stderr: text (one line per event) or json (one JSON
    /// object per line, for log shippers).
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
}

#[derive(Debug, Args)]
pub struct UrlArgs {
    /// lwio://HOST[:PORT]/EXPORT/PATH
    #[arg(value_parser = LwioUrl::parse)]
    pub url: LwioUrl,
    #[command(flatten)]
    pub client: ClientArgs,
}

#[derive(Debug, Args)]
pub struct StatsArgs {
    /// lwio://HOST[:PORT]/
    #[arg(value_parser = LwioUrl::parse)]
    pub url: LwioUrl,
    /// Print the OpenMetrics text instead of the table.
    #[arg(long)]
    pub raw: bool,
    #[command(flatten)]
    pub client: ClientArgs,
}

#[derive(Debug, Args)]
pub struct LsArgs {
    /// lwio://HOST[:PORT]/EXPORT/PATH (or lwio://HOST/ for the exports)
    #[arg(value_parser = LwioUrl::parse)]
    pub url: LwioUrl,
    /// Long format: type, permissions, size, modification time, name.
    #[arg(short, long)]
    pub long: bool,
    #[command(flatten)]
    pub client: ClientArgs,
}

#[derive(Debug, Args)]
pub struct MkdirArgs {
    /// lwio://HOST[:PORT]/EXPORT/PATH
    #[arg(value_parser = LwioUrl::parse)]
    pub url: LwioUrl,
    /// Create missing parents; no error if it exists.
    #[arg(short, long)]
    pub parents: bool,
    #[command(flatten)]
    pub client: ClientArgs,
}

#[derive(Debug, Args)]
pub struct CatArgs {
    /// lwio://HOST[:PORT]/EXPORT/PATH
    #[arg(value_parser = LwioUrl::parse)]
    pub url: LwioUrl,
    #[command(flatten)]
    pub client: ClientArgs,
}

#[derive(Debug, Args)]
pub struct PublishArgs {
    /// lwio://HOST[:PORT]/EXPORT
    #[arg(value_parser = LwioUrl::parse)]
    pub url: LwioUrl,
    /// The object's name: it appears as EXPORT/.lwio-mem/NAME.
    pub name: String,
    /// Load the object's bytes from this file (its size is the object's).
    #[arg(
        long,
        value_name = "PATH",
        required_unless_present = "size",
        conflicts_with = "size"
    )]
    pub file: Option<PathBuf>,
    /// An object of this many zero bytes.
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    pub size: Option<u64>,
    /// Others may only read it (default: read and write, within their
    /// rights on the export).
    #[arg(long)]
    pub read_only: bool,
    /// After unpublishing, write the final contents here.
    #[arg(long, value_name = "PATH")]
    pub out: Option<PathBuf>,
    #[command(flatten)]
    pub client: ClientArgs,
}

#[derive(Debug, Args)]
pub struct MountArgs {
    /// lwio://HOST[:PORT]/EXPORT[/SUBDIR]
    #[arg(value_parser = LwioUrl::parse)]
    pub url: LwioUrl,
    /// An existing empty directory.
    pub mountpoint: PathBuf,
    /// Mount options, comma-separated (repeatable): see below.
    #[arg(short = 'o', value_name = "OPTIONS")]
    pub options: Vec<String>,
    /// Detach once mounted (the default when run by mount(8) from /etc/fstab).
    #[arg(long)]
    pub daemon: bool,
    /// With --daemon: append the mount's log here (default: discarded).
    #[arg(long, value_name = "FILE")]
    pub log: Option<PathBuf>,
    /// How the data path reaps completions (`-o completion=`).
    #[arg(long, value_enum, default_value = "interrupt")]
    pub completion: Completion,
    #[command(flatten)]
    pub client: ClientArgs,
}

#[derive(Debug, Args)]
pub struct CpArgs {
    /// Source: a local path or an lwio:// URL.
    pub src: String,
    /// Destination: a local path or an lwio:// URL.
    pub dst: String,
    /// Copy directories recursively.
    #[arg(short, long)]
    pub recursive: bool,
    #[command(flatten)]
    pub client: ClientArgs,
}

/// I/O pattern of `lwio bench`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum RwPattern {
    Read,
    Write,
    Randread,
    Randwrite,
    Randrw,
}

/// How completions are reaped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Completion {
    /// Busy-poll the completion queue (lowest latency, burns a core).
    Poll,
    /// Sleep on completion events.
    Interrupt,
}

#[derive(Debug, Args)]
pub struct BenchArgs {
    /// File to benchmark (lwio://HOST[:PORT]/EXPORT/PATH). Default: an
    /// embedded server on loopback with a temporary file.
    #[arg(value_parser = LwioUrl::parse)]
    pub url: Option<LwioUrl>,
    /// I/O pattern.
    #[arg(long, value_enum, default_value = "randread")]
    pub rw: RwPattern,
    /// Block size (e.g. 4k, 1M).
    #[arg(long, value_name = "SIZE", default_value = "4k", value_parser = parse_size)]
    pub bs: u64,
    /// Queue depth: I/Os in flight per job.
    #[arg(long, value_name = "N", default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=65536))]
    pub qd: u32,
    /// Parallel jobs (each with its own RDMA connection).
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub jobs: u32,
    /// File size to use (created if needed).
    #[arg(long, value_name = "SIZE", default_value = "64M", value_parser = parse_size)]
    pub size: u64,
    /// How long to run.
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = parse_duration)]
    pub runtime: Duration,
    /// Completion mode.
    #[arg(long, value_enum, default_value = "poll")]
    pub completion: Completion,
    /// Print results as JSON.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub client: ClientArgs,
}

/// Operation of `lwio rdma-bench`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum RdmaOp {
    Write,
    Read,
    Send,
}

/// Provider of `lwio rdma-bench` (auto is not allowed: both ends must agree).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum RdmaProvider {
    Soft,
    Verbs,
}

#[derive(Debug, Args)]
/// With neither `--listen` nor `--connect`, both ends run in this process over
/// loopback (two contexts, two threads).
#[command(group(ArgGroup::new("role").required(false).args(["listen", "connect"])))]
pub struct RdmaBenchArgs {
    /// RDMA operation to measure.
    #[arg(long, value_enum)]
    pub op: RdmaOp,
    /// Message size (e.g. 4k, 1M).
    #[arg(long, value_name = "BYTES", value_parser = parse_size)]
    pub size: u64,
    /// Number of operations.
    #[arg(long, value_name = "N", default_value_t = 1000)]
    pub iters: u64,
    /// Busy-poll completions instead of waiting for events (the soft
    /// provider then runs its protocol engine in the polling thread).
    #[arg(long)]
    pub poll: bool,
    /// Wait for the peer on this address (server side). Without --listen or
    /// --connect both ends run here, over loopback.
    #[arg(long, value_name = "ADDR")]
    pub listen: Option<String>,
    /// Connect to a listening peer (client side).
    #[arg(long, value_name = "ADDR")]
    pub connect: Option<String>,
    /// RDMA provider.
    #[arg(long, value_enum, default_value = "soft")]
    pub provider: RdmaProvider,
}

/// A failure to report as one line.
pub type CliResult = anyhow::Result<()>;

/// A failure already reported on stderr (several lines): the binary exits
/// with this status and prints nothing more.
#[derive(Debug)]
pub struct Reported(pub u8);

impl std::fmt::Display for Reported {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "failed (reported above)")
    }
}

impl std::error::Error for Reported {}

/// Run a parsed command.
pub fn run(cli: Cli) -> CliResult {
    // SideClient commands log only when asked (RUST_LOG): their output is
    // their result and one-line errors. `serve` and `mount` set up their own.
    if std::env::var_os("RUST_LOG").is_some()
        && !matches!(cli.command, Command::Serve(_) | Command::Mount(_))
    {
        init_tracing_default("warn");
    }
    match cli.command {
        Command::Serve(a) => serve(a),
        Command::Ls(a) => ls(a),
        Command::Stat(a) => stat(a),
        Command::Stats(a) => stats(a),
        Command::Rm(a) => {
            let export = a.url.require_export()?.to_string();
            if a.url.path.is_empty() {
                anyhow::bail!("{}: refusing to remove the root of export {export}", a.url);
            }
            connect(&a.url, &a.client)?.remove(&export, &a.url.path)?;
            Ok(())
        }
        Command::Mkdir(a) => {
            let export = a.url.require_export()?.to_string();
            connect(&a.url, &a.client)?.mkdir(&export, &a.url.path, 0o755, a.parents)?;
            Ok(())
        }
        Command::Cat(a) => crate::cmd::cat::run(a),
        Command::Mount(a) => crate::cmd::mount::run(a),
        Command::Cp(a) => crate::cmd::cp::run(a),
        Command::Publish(a) => crate::cmd::publish::run(a),
        Command::Bench(a) => crate::cmd::bench::run(a),
        Command::Devices => devices(),
        Command::RdmaBench(a) => crate::cmd::rdma_bench::run(a),
        Command::HashPassword(a) => hash_password(a),
        Command::Generate(a) => crate::cmd::generate::run(a),
    }
}

/// The first line of a secret read from a file or stdin.
fn first_line(text: &str) -> &str {
    text.lines().next().unwrap_or("").trim_end_matches('\r')
}

/// What the shared client flags say about login and TLS; the rest is
/// the one client default ([`SideOptions::resolve`], `lwio_client::connect`:
/// `LWIO_TOKEN`, the default token file, known_hosts, …).
pub fn connect_args(args: &ClientArgs) -> ConnectArgs {
    ConnectArgs {
        user: args.user.clone(),
        token_file: args.token_file.clone(),
        password_file: args.password_file.clone(),
        ask_password: Some(|prompt| rpassword::prompt_password(prompt)),
        no_tls: args.no_tls,
        insecure: args.insecure,
        fingerprint: args.fingerprint.clone(),
        ca: args.ca.clone(),
        known_hosts: args.known_hosts.clone(),
        strict_host_key_checking: args.strict_host_key_checking,
        connect_timeout: Some(args.connect_timeout),
        ..ConnectArgs::default()
    }
}

/// SideClient options from the shared client flags.
pub fn client_options(args: &ClientArgs) -> anyhow::Result<SideOptions> {
    if args.insecure && !args.no_tls {
        eprintln!("lwio: warning: --insecure: the server's TLS certificate is not verified");
    }
    Ok(SideOptions::resolve(&connect_args(args))?)
}

fn connect(url: &LwioUrl, args: &ClientArgs) -> anyhow::Result<SideClient> {
    Ok(SideClient::connect(
        &url.authority(),
        &client_options(args)?,
    )?)
}

/// Read a secret from stdin (first line) or, on a terminal, ask for it
/// (twice when `confirm`).
fn read_secret(what: &str, confirm: bool) -> anyhow::Result<String> {
    use std::io::{IsTerminal, Read};
    if !std::io::stdin().is_terminal() {
        let mut t = String::new();
        std::io::stdin()
            .read_to_string(&mut t)
            .map_err(|e| anyhow::anyhow!("reading the {what} from standard input: {e}"))?;
        return Ok(first_line(&t).to_string());
    }
    let a = rpassword::prompt_password(format!("{what}: "))?;
    if confirm && rpassword::prompt_password(format!("{what} again: "))? != a {
        anyhow::bail!("the two {what}s differ");
    }
    Ok(a)
}

fn hash_password(a: HashPasswordArgs) -> CliResult {
    use lwio_server::side_service::access::{self, TokenVerifier};
    let mut out = std::io::stdout().lock();
    if a.new_token {
        let t = Token::generate();
        writeln!(out, "token: {}", String::from_utf8_lossy(t.expose()))?;
        writeln!(out, "verifier: {}", TokenVerifier::from_token(t.expose()))?;
        return Ok(());
    }
    if a.token {
        let t = Token::new(&read_secret("Token", false)?)?;
        writeln!(out, "{}", TokenVerifier::from_token(t.expose()))?;
        return Ok(());
    }
    let p = read_secret("Password", true)?;
    if p.is_empty() {
        anyhow::bail!("empty password");
    }
    writeln!(out, "{}", access::hash_password(&p))?;
    Ok(())
}

fn kind_name(k: FileKind) -> &'static str {
    match k {
        FileKind::File => "file",
        FileKind::Dir => "directory",
        FileKind::Symlink => "symlink",
        FileKind::Fifo => "fifo",
        FileKind::Socket => "socket",
        FileKind::CharDev => "character device",
        FileKind::BlockDev => "block device",
        FileKind::Other => "other",
    }
}

fn kind_char(k: FileKind) -> char {
    match k {
        FileKind::File => '-',
        FileKind::Dir => 'd',
        FileKind::Symlink => 'l',
        FileKind::Fifo => 'p',
        FileKind::Socket => 's',
        FileKind::CharDev => 'c',
        FileKind::BlockDev => 'b',
        FileKind::Other => '?',
    }
}

fn perm_string(p: u32) -> String {
    let mut s = String::with_capacity(9);
    for shift in [6, 3, 0] {
        let b = (p >> shift) & 7;
        s.push(if b & 4 != 0 { 'r' } else { '-' });
        s.push(if b & 2 != 0 { 'w' } else { '-' });
        s.push(if b & 1 != 0 { 'x' } else { '-' });
    }
    s
}

/// `YYYY-MM-DD HH:MM:SS` UTC from nanoseconds since the epoch.
pub fn format_utc(ns: i64) -> String {
    let secs = ns.div_euclid(1_000_000_000);
    let days = secs.div_euclid(86_400);
    let tod = secs.rem_euclid(86_400);
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02}",
        tod / 3600,
        tod / 60 % 60,
        tod % 60
    )
}

fn long_line(name: &str, a: &Attr) -> String {
    format!(
        "{}{} {:>14} {} {}{}",
        kind_char(a.kind),
        perm_string(a.perm),
        a.size,
        format_utc(a.mtime_ns),
        name,
        if a.kind == FileKind::Dir { "/" } else { "" }
    )
}

fn ls(a: LsArgs) -> CliResult {
    let mut c = connect(&a.url, &a.client)?;
    let mut out = std::io::stdout().lock();
    let Some(export) = a.url.export.clone() else {
        for e in c.list_exports()? {
            writeln!(
                out,
                "{}/{}",
                e.name,
                if e.read_only { " (read-only)" } else { "" }
            )?;
        }
        return Ok(());
    };
    let entries = match c.list_dir(&export, &a.url.path) {
        Ok(v) => v,
        Err(e) if e.code == ErrorCode::NotADirectory => {
            let attr = c.stat(&export, &a.url.path)?;
            let name = a.url.path.rsplit('/').next().unwrap_or_default();
            if a.long {
                writeln!(out, "{}", long_line(name, &attr))?;
            } else {
                writeln!(out, "{name}")?;
            }
            return Ok(());
        }
        Err(e) => return Err(e.into()),
    };
    for e in entries {
        if a.long {
            writeln!(out, "{}", long_line(&e.name, &e.attr))?;
        } else {
            writeln!(
                out,
                "{}{}",
                e.name,
                if e.attr.kind == FileKind::Dir {
                    "/"
                } else {
                    ""
                }
            )?;
        }
    }
    Ok(())
}

fn stats(a: StatsArgs) -> CliResult {
    let text = connect(&a.url, &a.client)?.stats()?;
    let mut out = std::io::stdout().lock();
    if a.raw {
        out.write_all(text.as_bytes())?;
    } else {
        let server = format!("lwio://{}/", a.url.authority());
        out.write_all(crate::cmd::stats::table(&server, &text).as_bytes())?;
    }
    Ok(())
}

fn stat(a: UrlArgs) -> CliResult {
    let export = a.url.require_export()?.to_string();
    let attr = connect(&a.url, &a.client)?.stat(&export, &a.url.path)?;
    let mut out = std::io::stdout().lock();
    writeln!(out, "     URL: {}", a.url)?;
    writeln!(out, "    Type: {}", kind_name(attr.kind))?;
    writeln!(out, "    Size: {}", attr.size)?;
    writeln!(
        out,
        "    Mode: {:04o} ({}{})",
        attr.perm,
        kind_char(attr.kind),
        perm_string(attr.perm)
    )?;
    writeln!(out, "Modified: {} UTC", format_utc(attr.mtime_ns))?;
    Ok(())
}

fn devices() -> CliResult {
    let providers = lwio_rdma::providers();
    if providers.is_empty() {
        anyhow::bail!("no usable RDMA provider: none is compiled into this build");
    }
    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "{:<8} {:<12} {:<10} {:<32} status",
        "provider", "device", "transport", "addresses"
    )?;
    let mut usable = 0;
    for p in providers {
        let devs = p.devices();
        if devs.is_empty() {
            writeln!(
                out,
                "{:<8} {:<12} {:<10} {:<32} no devices",
                p.name(),
                "-",
                "-",
                "-"
            )?;
        }
        for d in devs {
            let addrs = if d.addresses.is_empty() {
                "-".to_string()
            } else {
                d.addresses
                    .iter()
                    .map(|a| a.to_string())
                    .collect::<Vec<_>>()
                    .join(",")
            };
            let status = match &d.usable {
                Ok(()) => {
                    usable += 1;
                    "usable".to_string()
                }
                Err(why) => format!("unusable: {why}"),
            };
            writeln!(
                out,
                "{:<8} {:<12} {:<10} {:<32} {status}",
                d.provider,
                d.name,
                d.transport.to_string(),
                addrs
            )?;
        }
    }
    if usable == 0 {
        anyhow::bail!("no usable RDMA provider on this host (see the reasons above)");
    }
    Ok(())
}

/// Logs on stderr: RUST_LOG, else `default`.
pub fn init_tracing_default(default: &str) {
    init_tracing_format(default, LogFormat::Text);
}

/// Logs on stderr in `format`: RUST_LOG, else `default`.
pub fn init_tracing_format(default: &str, format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    if format == LogFormat::Json {
        let _ = tracing_subscriber::fmt()
            .json()
            .with_current_span(false)
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .try_init();
        return;
    }
    // Colours only on a terminal: a log file or journal gets plain text.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
}

/// Merge the config file and the flags.
pub fn serve_config(a: &ServeArgs) -> anyhow::Result<Config> {
    let mut c = match &a.config {
        Some(p) => Config::load(p)?,
        None => Config::default(),
    };
    apply_serve_flags(&mut c, a);
    c.validate()?;
    if c.exports.is_empty() {
        anyhow::bail!("{NOTHING_TO_SERVE}");
    }
    Ok(c)
}

/// Why a server with no export does not start.
pub const NOTHING_TO_SERVE: &str =
    "nothing to serve: give at least one --export NAME=PATH (or [exports] in --config)";

/// The flags of `serve` over the config file's values.
pub fn apply_serve_flags(c: &mut Config, a: &ServeArgs) {
    if let Some(l) = &a.listen {
        c.listen = l.clone();
    }
    if let Some(t) = &a.token_file {
        c.token_file = Some(t.clone());
    }
    if let Some(p) = a.provider {
        c.provider = p;
    }
    if let Some(d) = &a.device {
        c.device = Some(d.clone());
    }
    if let Some(b) = a.io_backend {
        c.io.backend = b;
    }
    if a.anonymous {
        c.allow_anonymous = true;
    }
    if a.no_tls {
        c.tls = false;
    }
    if a.compat_md5_auth {
        c.compat_md5_auth = true;
    }
    if a.tls_cert.is_some() {
        c.tls_cert = a.tls_cert.clone();
        c.tls_key = a.tls_key.clone();
    }
    for e in &a.exports {
        c.set_export(e);
    }
}

fn write_ready_file(path: &Path, addr: &str) -> anyhow::Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, format!("{addr}\n"))
        .and_then(|_| std::fs::rename(&tmp, path))
        .map_err(|e| anyhow::anyhow!("ready file {}: {e}", path.display()))
}

fn serve(a: ServeArgs) -> CliResult {
    if let Some(file) = &a.check_config {
        return crate::cmd::check_config::run(&a, file);
    }
    init_tracing_format("info", a.log_format);
    let c = serve_config(&a)?;
    // `--rdma-listen` and `--metrics` over the file's values; `c` stays
    // what SIGHUP compares a re-read file with.
    let mut start = c.clone();
    if let Some(r) = &a.rdma_listen {
        start.rdma_listen = Some(r.clone());
    }
    if let Some(m) = &a.metrics {
        start.metrics_listen = Some(m.clone());
    }
    let service = Service::start(start)?;
    crate::cmd::serve::print_listening(&service)?;
    // Raced: the ready file was written before the signal handlers (and their descriptors) existed.
    crate::cmd::serve::start_service(&service, a.clone(), c)?;
    if let Some(p) = &a.ready_file {
        write_ready_file(p, &service.side_addr().to_string())?;
    }
    service.wait()?;
    Ok(())
}

/// Map an error to the one line printed by the binary.
pub fn error_line(e: &anyhow::Error) -> String {
    if let Some(le) = e.downcast_ref::<Error>() {
        return le.to_string();
    }
    let mut s = e.to_string();
    // One line, whatever the cause chain.
    if let Some(i) = s.find('\n') {
        s.truncate(i);
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("lwio").chain(args.iter().copied()))
    }

    #[test]
    fn cli_is_consistent() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }

    #[test]
    fn bench_arguments() {
        let c = parse(&[
            "bench",
            "lwio://h/e/f",
            "--rw",
            "randrw",
            "--bs",
            "1M",
            "--qd",
            "32",
            "--jobs",
            "4",
            "--size",
            "1GiB",
            "--runtime",
            "30s",
            "--completion",
            "interrupt",
            "--json",
        ])
        .unwrap();
        let Command::Bench(b) = c.command else {
            panic!()
        };
        assert_eq!(b.url.unwrap().path, "f");
        assert_eq!(b.rw, RwPattern::Randrw);
        assert_eq!(b.bs, 1 << 20);
        assert_eq!((b.qd, b.jobs), (32, 4));
        assert_eq!(b.size, 1 << 30);
        assert_eq!(b.runtime, Duration::from_secs(30));
        assert_eq!(b.completion, Completion::Interrupt);
        assert!(b.json);
        let Command::Bench(b) = parse(&["bench"]).unwrap().command else {
            panic!()
        };
        assert!(b.url.is_none());
        assert_eq!(
            (b.rw, b.bs, b.qd, b.jobs),
            (RwPattern::Randread, 4096, 16, 1)
        );
        assert_eq!(b.runtime, Duration::from_secs(10));
        assert!(parse(&["bench", "--bs", "4x"]).is_err());
        assert!(parse(&["bench", "--runtime", "soon"]).is_err());
        assert!(parse(&["bench", "--qd", "0"]).is_err());
        assert!(parse(&["bench", "--rw", "sideways"]).is_err());
        assert!(parse(&["bench", "http://x"]).is_err());
    }

    #[test]
    fn rdma_bench_arguments() {
        let Command::RdmaBench(r) = parse(&[
            "rdma-bench",
            "--op",
            "write",
            "--size",
            "64k",
            "--connect",
            "10.0.0.1:7471",
            "--poll",
        ])
        .unwrap()
        .command
        else {
            panic!()
        };
        assert_eq!(
            (r.op, r.size, r.iters, r.poll),
            (RdmaOp::Write, 65536, 1000, true)
        );
        assert_eq!(r.provider, RdmaProvider::Soft);
        // No role: both ends here, over loopback.
        let Command::RdmaBench(l) = parse(&["rdma-bench", "--op", "write", "--size", "1k"])
            .unwrap()
            .command
        else {
            panic!()
        };
        assert_eq!((l.listen, l.connect), (None, None));
        assert!(
            parse(&[
                "rdma-bench",
                "--op",
                "send",
                "--size",
                "1k",
                "--listen",
                "a",
                "--connect",
                "b"
            ])
            .is_err(),
            "one role only"
        );
        assert!(parse(&[
            "rdma-bench",
            "--op",
            "read",
            "--size",
            "1k",
            "--listen",
            "x",
            "--provider",
            "auto"
        ])
        .is_err());
    }

    #[test]
    fn other_arguments() {
        let Command::Cp(c) = parse(&["cp", "-r", "a", "lwio://h/e/b"]).unwrap().command else {
            panic!()
        };
        assert!(c.recursive);
        let Command::Serve(s) = parse(&[
            "serve",
            "--export",
            "a=/x",
            "--export",
            "b=/y",
            "--listen",
            "127.0.0.1:0",
            "--provider",
            "verbs",
            "--io-backend",
            "threads",
        ])
        .unwrap()
        .command
        else {
            panic!()
        };
        assert_eq!(s.exports.len(), 2);
        assert_eq!(s.provider, Some(ProviderChoice::Verbs));
        assert_eq!(s.io_backend, Some(BackendChoice::Threads));
        let cfg = serve_config(&s).unwrap();
        assert_eq!(cfg.listen, "127.0.0.1:0");
        assert!(parse(&["serve", "--export", "noequals"]).is_err());
        assert!(parse(&["ls", "lwio://h:99999/e"]).is_err());
        let Command::Mkdir(m) = parse(&["mkdir", "-p", "lwio://[::1]/e/a/b"])
            .unwrap()
            .command
        else {
            panic!()
        };
        assert!(m.parents);
        assert_eq!(m.url.host, "::1");
    }

    #[test]
    fn formatting() {
        assert_eq!(format_utc(0), "1970-01-01 00:00:00");
        assert_eq!(format_utc(1_700_000_000_000_000_000), "2023-11-14 22:13:20");
        assert_eq!(format_utc(951_782_400_000_000_000), "2000-02-29 00:00:00");
        assert_eq!(format_utc(-1_000_000_000), "1969-12-31 23:59:59");
        assert_eq!(perm_string(0o754), "rwxr-xr--");
    }
}
