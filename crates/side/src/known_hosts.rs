//! `known_hosts`: trust on first use of a server's TLS certificate, as ssh
//! does with host keys (docs/security.md, "Trusting a server").
//!
//! One line per server: `HOST:PORT sha256:HEX` (IPv6 as `[::1]:7420`), `#`
//! comments and blank lines ignored. The key is the side-channel address as
//! the user wrote it.

use std::io::Write;
use std::path::{Path, PathBuf};

use crate::error::{Error, ErrorCode, Result};
use crate::tls::parse_fingerprint;

/// A known server: its fingerprint and the line that records it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Known {
    pub fingerprint: [u8; 32],
    pub line: usize,
}

/// The default file: `$XDG_CONFIG_HOME/lwio/known_hosts`, else
/// `~/.config/lwio/known_hosts`.
pub fn default_path() -> Option<PathBuf> {
    if let Some(x) = std::env::var_os("XDG_CONFIG_HOME").filter(|x| !x.is_empty()) {
        return Some(PathBuf::from(x).join("lwio/known_hosts"));
    }
    std::env::var_os("HOME")
        .filter(|h| !h.is_empty())
        .map(|h| PathBuf::from(h).join(".config/lwio/known_hosts"))
}

fn malformed(file: &Path, line: usize, why: &str) -> Error {
    Error::new(
        ErrorCode::InvalidArgument,
        format!(
            "{}:{line}: malformed known_hosts line ({why}; expected HOST:PORT sha256:HEX)",
            file.display()
        ),
    )
}

/// Parse the file's text: every (host, fingerprint, line).
pub fn parse(file: &Path, text: &str) -> Result<Vec<(String, [u8; 32], usize)>> {
    let mut out = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let line = raw.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let mut it = line.split_whitespace();
        let (Some(host), Some(fp), None) = (it.next(), it.next(), it.next()) else {
            return Err(malformed(file, i + 1, "two fields"));
        };
        if !host.contains(':') {
            return Err(malformed(file, i + 1, "the address has no port"));
        }
        let fp = parse_fingerprint(fp).map_err(|_| malformed(file, i + 1, "bad fingerprint"))?;
        out.push((host.to_string(), fp, i + 1));
    }
    Ok(out)
}

/// The recorded fingerprint of `host` (`HOST:PORT`), if any.
pub fn lookup(file: &Path, host: &str) -> Result<Option<Known>> {
    let text = match std::fs::read_to_string(file) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => {
            return Err(Error::from_io(
                &e,
                format!("known_hosts {}", file.display()),
            ))
        }
    };
    Ok(parse(file, &text)?
        .into_iter()
        .find(|(h, _, _)| h == host)
        .map(|(_, fingerprint, line)| Known { fingerprint, line }))
}

/// Record `host` with `fp` (unless a line for it appeared meanwhile: then
/// that line stands). Creates the file (0600) and its directory (0700).
/// Concurrent writers are serialised with flock(2), and the line is one
/// O_APPEND write.
pub fn record(file: &Path, host: &str, fp: &[u8; 32]) -> Result<()> {
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
    let ctx = |e: std::io::Error| Error::from_io(&e, format!("known_hosts {}", file.display()));
    if let Some(dir) = file.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(ctx)?;
    }
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .mode(0o600)
        .open(file)
        .map_err(ctx)?;
    use std::os::fd::AsRawFd;
    // SAFETY: flock on an fd we own; the lock ends when `f` is closed.
    if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) } != 0 {
        return Err(ctx(std::io::Error::last_os_error()));
    }
    if lookup(file, host)?.is_some() {
        return Ok(());
    }
    let line = format!("{host} {}\n", crate::tls::fingerprint_of_digest(fp));
    f.write_all(line.as_bytes()).map_err(ctx)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_lookup_record() {
        let d = tempfile::tempdir().unwrap();
        let f = d.path().join("sub/known_hosts");
        assert_eq!(lookup(&f, "a:1").unwrap(), None);
        let fp = [0xab; 32];
        record(&f, "a:1", &fp).unwrap();
        record(&f, "[::1]:7420", &[1; 32]).unwrap();
        // Recording a known host again changes nothing.
        record(&f, "a:1", &[2; 32]).unwrap();
        let text = std::fs::read_to_string(&f).unwrap();
        assert_eq!(text.lines().count(), 2);
        assert!(text.starts_with("a:1 sha256:AB:AB:"));
        assert_eq!(
            lookup(&f, "a:1").unwrap(),
            Some(Known {
                fingerprint: fp,
                line: 1
            })
        );
        assert_eq!(lookup(&f, "[::1]:7420").unwrap().unwrap().line, 2);
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(
            std::fs::metadata(&f).unwrap().permissions().mode() & 0o777,
            0o600
        );
        assert_eq!(
            std::fs::metadata(f.parent().unwrap())
                .unwrap()
                .permissions()
                .mode()
                & 0o777,
            0o700
        );
        // Comments and blank lines are fine; a malformed line is one error
        // naming the file and line.
        std::fs::write(&f, "# c\n\na:1 sha256:zz\n").unwrap();
        let e = lookup(&f, "a:1").unwrap_err();
        assert_eq!(
            e.message,
            format!(
                "{}:3: malformed known_hosts line (bad fingerprint; expected HOST:PORT sha256:HEX)",
                f.display()
            )
        );
    }

    #[test]
    fn concurrent_first_use_leaves_one_line() {
        let d = tempfile::tempdir().unwrap();
        let f = d.path().join("known_hosts");
        std::thread::scope(|s| {
            for i in 0..8 {
                let f = &f;
                s.spawn(move || record(f, "srv:7420", &[i; 32]).unwrap());
            }
        });
        let text = std::fs::read_to_string(&f).unwrap();
        assert_eq!(text.lines().count(), 1, "{text}");
    }
}
