//! `-o` mount options, parsed as mount(8) and mount.fuse(8) pass them.

use std::time::Duration;

/// How the mount behaves (docs/mount.md).
#[derive(Debug, Clone, PartialEq)]
pub struct MountConfig {
    /// `ro`: mounted read-only (the kernel refuses writes with EROFS).
    pub read_only: bool,
    /// `allow_other`: other users may use the mount (needs
    /// `user_allow_other` in /etc/fuse.conf unless root).
    pub allow_other: bool,
    /// `allow_root`: root may use the mount too.
    pub allow_root: bool,
    /// `default_permissions`: the kernel checks mode bits itself.
    pub default_permissions: bool,
    /// `attr_timeout=SECS`: how long the kernel caches attributes.
    pub attr_ttl: Duration,
    /// `entry_timeout=SECS`: how long the kernel caches names.
    pub entry_ttl: Duration,
    /// `threads=N`: FUSE request threads (requests served at once).
    pub threads: usize,
    /// `max_io=BYTES`: the largest read and write the kernel sends.
    pub max_io: u32,
    /// `fsname=NAME`: the source shown in /proc/mounts.
    pub fsname: Option<String>,
    /// `direct_io`: no client page cache (every read and write goes to the
    /// server, as sshfs's option of that name); the server's file is still
    /// opened normally.
    pub direct_io: bool,
    /// `leases` (default) / `noleases`: hold directory leases, and answer
    /// lookups, attributes and listings of leased directories from them
    /// (docs/leases.md).
    pub leases: bool,
    /// `lease_timeout=SECS`: how long the kernel keeps names and attributes
    /// of a leased directory, and how long a leased listing is trusted at
    /// most (it bounds how long a change made on the server by a program
    /// other than lwio stays unseen).
    pub lease_ttl: Duration,
    /// Directories leased at once; the least recently used is given back.
    pub max_leases: usize,
    /// `keepalive=SECS`: how often an idle mount pings the server, so that
    /// the server's `idle_timeout` (5 minutes by default) never ends a
    /// mounted session. 0 turns it off.
    pub keepalive: Duration,
    /// `preload` (default) / `nopreload`: answer the handoff ioctl of
    /// liblwio_preload.so for programs of the mount's own user (or root),
    /// so that their reads and writes of the mount's files go straight to
    /// the server over RDMA (docs/preload.md). `nopreload` refuses it
    /// (EPERM): such programs then use the mount as any other.
    pub preload: bool,
    /// `hard`: while the server is away, calls wait for it to come back
    /// (trying again every second) instead of failing with EIO (`soft`, the
    /// default), as NFS's `hard` does; an unmount ends the wait (EIO).
    pub hard: bool,
    /// `keep_cache` (default) / `nokeep_cache`: at an open, let the kernel
    /// keep the file's page cache when this mount has held the lease of its
    /// directory, unbroken, since the cache was last dropped (for at most
    /// `lease_timeout`); else the cache is dropped (close-to-open).
    pub keep_cache: bool,
    /// `writeback_cache` / `nowriteback_cache` (default): let the kernel
    /// keep written pages and send them in batches (at the latest at
    /// fsync, close or memory pressure), and own the file's size and mtime
    /// while it caches them, as libfuse's option of that name. For a mount
    /// that is the only writer of its files (a database's data directory):
    /// another client's change to a file this mount caches may not be seen
    /// until the file's cache is dropped (docs/mount.md, "Write-back").
    pub writeback_cache: bool,
    /// `unstable_writes` (default) / `nounstable_writes`: answer a write
    /// once it is sent to the server, as an NFS client does, and report
    /// its failure at the file's next fsync or close (docs/mount.md,
    /// "Unstable writes"); else each write waits for the server's answer.
    pub unstable_writes: bool,
}

impl Default for MountConfig {
    fn default() -> Self {
        MountConfig {
            read_only: false,
            allow_other: false,
            allow_root: false,
            default_permissions: false,
            attr_ttl: Duration::from_secs(1),
            entry_ttl: Duration::from_secs(1),
            threads: 4,
            max_io: 1 << 20,
            fsname: None,
            direct_io: false,
            leases: true,
            lease_ttl: Duration::from_secs(60),
            max_leases: 512,
            keepalive: Duration::from_secs(60),
            preload: true,
            hard: false,
            keep_cache: true,
            writeback_cache: false,
            unstable_writes: true,
        }
    }
}

/// A bad `-o` option, as one line.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("mount option {option:?}: {reason}")]
pub struct OptionError {
    pub option: String,
    pub reason: String,
}

/// Options that mount(8) and fstab pass for every file system and that mean
/// nothing to a FUSE file system of its own (the kernel applies `nodev`,
/// `nosuid`, `noexec` and the atime options from the mount call itself).
const IGNORED: &[&str] = &[
    "defaults",
    "rw",
    "auto",
    "noauto",
    "user",
    "nouser",
    "users",
    "nofail",
    "_netdev",
    "dev",
    "nodev",
    "suid",
    "nosuid",
    "exec",
    "noexec",
    "atime",
    "noatime",
    "relatime",
    "strictatime",
    "nodiratime",
    "async",
    "sync",
    "dirsync",
    "soft",
];

impl MountConfig {
    /// Apply one `-o` list (`a,b=c,…`). Options this crate does not know
    /// are returned for the caller (the client's own options: provider,
    /// completion, token_file, …); it reports the ones it cannot use.
    pub fn apply(&mut self, list: &str) -> Result<Vec<(String, Option<String>)>, OptionError> {
        let mut rest = Vec::new();
        for item in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (k, v) = match item.split_once('=') {
                Some((k, v)) => (k, Some(v)),
                None => (item, None),
            };
            let bad = |reason: &str| OptionError {
                option: item.to_string(),
                reason: reason.to_string(),
            };
            let secs = |v: Option<&str>| -> Result<Duration, OptionError> {
                let v = v.ok_or_else(|| bad("needs a value in seconds"))?;
                let f: f64 = v
                    .parse()
                    .map_err(|_| bad("expected seconds, e.g. 1 or 0.5"))?;
                if !(0.0..=86_400.0).contains(&f) {
                    return Err(bad("expected 0 to 86400 seconds"));
                }
                Ok(Duration::from_secs_f64(f))
            };
            match (k, v) {
                ("ro", None) => self.read_only = true,
                ("rw", None) => self.read_only = false,
                ("allow_other", None) => self.allow_other = true,
                ("allow_root", None) => self.allow_root = true,
                ("default_permissions", None) => self.default_permissions = true,
                ("attr_timeout", v) => self.attr_ttl = secs(v)?,
                ("entry_timeout", v) => self.entry_ttl = secs(v)?,
                ("threads", v) => {
                    self.threads = v
                        .and_then(|v| v.parse().ok())
                        .filter(|n| (1..=64).contains(n))
                        .ok_or_else(|| bad("expected a number of threads from 1 to 64"))?
                }
                ("max_io", v) => {
                    self.max_io = v
                        .and_then(|v| v.parse().ok())
                        .filter(|n: &u32| (4096..=16 << 20).contains(n) && n.is_multiple_of(4096))
                        .ok_or_else(|| bad("expected bytes: a multiple of 4096 up to 16777216"))?
                }
                ("fsname", Some(v)) => self.fsname = Some(v.to_string()),
                ("direct_io", None) => self.direct_io = true,
                ("leases", None) => self.leases = true,
                ("noleases", None) => self.leases = false,
                ("lease_timeout", v) => self.lease_ttl = secs(v)?,
                ("keepalive", v) => self.keepalive = secs(v)?,
                ("preload", None) => self.preload = true,
                ("nopreload", None) => self.preload = false,
                ("hard", None) => self.hard = true,
                ("soft", None) => self.hard = false,
                ("keep_cache", None) => self.keep_cache = true,
                ("nokeep_cache", None) => self.keep_cache = false,
                ("writeback_cache", None) => self.writeback_cache = true,
                ("nowriteback_cache", None) => self.writeback_cache = false,
                ("unstable_writes", None) => self.unstable_writes = true,
                ("nounstable_writes", None) => self.unstable_writes = false,
                (k, None) if IGNORED.contains(&k) || k.starts_with("x-") => {}
                (k, v) if k.starts_with("x-") => {
                    let _ = v;
                }
                (k, v) => rest.push((k.to_string(), v.map(str::to_string))),
            }
        }
        Ok(rest)
    }

    /// The FUSE mount options for the kernel.
    pub(crate) fn fuse_options(&self, export: &str, subdir: &str) -> Vec<fuser::MountOption> {
        use fuser::MountOption as M;
        let name = self.fsname.clone().unwrap_or_else(|| {
            if subdir.is_empty() {
                format!("lwio:{export}")
            } else {
                format!("lwio:{export}/{subdir}")
            }
        });
        let mut v = vec![
            M::FSName(name),
            M::Subtype("lwio".into()),
            if self.read_only { M::RO } else { M::RW },
            M::NoDev,
            M::NoSuid,
        ];
        if self.default_permissions {
            v.push(M::DefaultPermissions);
        }
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_mount_conventions() {
        let mut c = MountConfig::default();
        let rest = c
            .apply("ro,allow_other,attr_timeout=2.5,entry_timeout=0,threads=8,noatime,x-systemd.automount,_netdev,provider=soft,completion=poll")
            .unwrap();
        assert!(c.read_only && c.allow_other);
        assert_eq!(c.attr_ttl, Duration::from_millis(2500));
        assert_eq!(c.entry_ttl, Duration::ZERO);
        assert_eq!(c.threads, 8);
        assert_eq!(
            rest,
            vec![
                ("provider".to_string(), Some("soft".to_string())),
                ("completion".to_string(), Some("poll".to_string()))
            ]
        );
    }

    #[test]
    fn lease_and_keepalive_options() {
        let mut c = MountConfig::default();
        assert!(c.leases && c.lease_ttl == Duration::from_secs(60));
        assert!(c
            .apply("noleases,lease_timeout=5,keepalive=0")
            .unwrap()
            .is_empty());
        assert!(!c.leases);
        assert_eq!(c.lease_ttl, Duration::from_secs(5));
        assert!(c.keepalive.is_zero());
        c.apply("leases").unwrap();
        assert!(c.leases);
        assert!(c.apply("lease_timeout=-1").is_err());
        assert!(c.keep_cache);
        c.apply("nokeep_cache").unwrap();
        assert!(!c.keep_cache);
        assert!(!c.writeback_cache);
        c.apply("writeback_cache").unwrap();
        assert!(c.writeback_cache);
        c.apply("nowriteback_cache").unwrap();
        assert!(!c.writeback_cache);
        assert!(c.unstable_writes);
        c.apply("nounstable_writes").unwrap();
        assert!(!c.unstable_writes);
        c.apply("unstable_writes").unwrap();
        assert!(c.unstable_writes);
        // soft (default) and hard, as NFS spells them; the last one wins.
        assert!(!c.hard);
        assert!(c.apply("hard").unwrap().is_empty());
        assert!(c.hard);
        c.apply("hard,soft").unwrap();
        assert!(!c.hard);
    }

    #[test]
    fn bad_values_are_one_line_naming_the_option() {
        let mut c = MountConfig::default();
        let e = c.apply("threads=0").unwrap_err();
        assert_eq!(
            e.to_string(),
            "mount option \"threads=0\": expected a number of threads from 1 to 64"
        );
        assert!(c.apply("attr_timeout=abc").is_err());
        assert!(c.apply("max_io=1000").is_err());
        // Nothing was applied from the bad options.
        assert_eq!(c, MountConfig::default());
    }
}
