//! `lwio://HOST[:PORT]/EXPORT/PATH` URLs.
//!
//! * `HOST` is a DNS name, an IPv4 address or an IPv6 address in brackets
//!   (`[::1]`, `[fe80::1%eth0]`). `PORT` defaults to [`DEFAULT_PORT`] (7420).
//! * `EXPORT` is the first path segment; it may be absent (`lwio://host` or
//!   `lwio://host/`), which only `lwio ls` accepts (it lists the exports).
//! * `PATH` is the rest, relative to the export root. Empty segments and `.`
//!   are dropped; `..` is rejected (paths never leave their export).
//! * Segments are **percent-decoded** (`%20` is a space, `%25` a percent sign).
//!   A decoded `/` (`%2F`) or NUL (`%00`) is rejected, as is invalid UTF-8.
//!   `?` and `#` have no special meaning: they are ordinary file-name
//!   characters. User information (`user@host`) is not supported yet.

use std::fmt;

/// The side channel's default TCP port.
pub use lwio_side::DEFAULT_PORT;

/// A parsed `lwio://` URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LwioUrl {
    /// Host name or address, without IPv6 brackets.
    pub host: String,
    pub port: u16,
    /// The export name, if the URL has one.
    pub export: Option<String>,
    /// Path inside the export: decoded segments joined by `/`, no leading
    /// slash; empty for the export root.
    pub path: String,
}

/// Why a URL did not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid URL {url:?}: {reason}")]
pub struct UrlError {
    pub url: String,
    pub reason: String,
}

impl LwioUrl {
    /// Parse `lwio://HOST[:PORT]/EXPORT/PATH`.
    pub fn parse(input: &str) -> Result<LwioUrl, UrlError> {
        let err = |reason: &str| UrlError {
            url: input.to_string(),
            reason: reason.to_string(),
        };
        let rest = input
            .strip_prefix("lwio://")
            .ok_or_else(|| err("expected lwio://HOST[:PORT]/EXPORT/PATH"))?;
        let (authority, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i + 1..]),
            None => (rest, ""),
        };
        if authority.contains('@') {
            return Err(err("user information (user@host) is not supported"));
        }
        let (host, port) = if let Some(after) = authority.strip_prefix('[') {
            let close = after
                .find(']')
                .ok_or_else(|| err("missing ']' after IPv6 address"))?;
            let host = &after[..close];
            let (addr, _zone) = host.split_once('%').unwrap_or((host, ""));
            if addr.parse::<std::net::Ipv6Addr>().is_err() {
                return Err(err("invalid IPv6 address in brackets"));
            }
            let tail = &after[close + 1..];
            let port = match tail {
                "" => None,
                t => Some(
                    t.strip_prefix(':')
                        .ok_or_else(|| err("unexpected characters after ']'"))?,
                ),
            };
            (host.to_string(), port)
        } else {
            match authority.rsplit_once(':') {
                Some((h, _)) if h.contains(':') => {
                    return Err(err(
                        "IPv6 addresses must be written in brackets, e.g. [::1]",
                    ))
                }
                Some((h, p)) => (h.to_string(), Some(p)),
                None => (authority.to_string(), None),
            }
        };
        if host.is_empty() {
            return Err(err("missing host"));
        }
        if !authority.starts_with('[')
            && host.contains(|c: char| !(c.is_ascii_alphanumeric() || c == '-' || c == '.'))
        {
            return Err(err("invalid host name"));
        }
        let port = match port {
            None => DEFAULT_PORT,
            Some(p) => match p.parse::<u16>() {
                Ok(0) | Err(_) => return Err(err("invalid port (expected 1-65535)")),
                Ok(p) => p,
            },
        };
        let mut segments = Vec::new();
        for raw in path.split('/') {
            let seg = percent_decode(raw).map_err(|r| err(&r))?;
            match seg.as_str() {
                "" | "." => continue,
                ".." => return Err(err("'..' is not allowed: paths cannot leave their export")),
                _ => segments.push(seg),
            }
        }
        let export = if segments.is_empty() {
            None
        } else {
            Some(segments.remove(0))
        };
        Ok(LwioUrl {
            host,
            port,
            export,
            path: segments.join("/"),
        })
    }

    /// The export, or an error naming the URL when it has none.
    pub fn require_export(&self) -> Result<&str, UrlError> {
        self.export.as_deref().ok_or_else(|| UrlError {
            url: self.to_string(),
            reason: "missing export name (lwio://HOST[:PORT]/EXPORT/PATH)".into(),
        })
    }

    /// `host:port` suitable for `TcpStream::connect` (IPv6 in brackets).
    pub fn authority(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }
}

impl fmt::Display for LwioUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "lwio://{}", self.authority())?;
        if let Some(e) = &self.export {
            write!(f, "/{}", percent_encode(e))?;
            for seg in self.path.split('/').filter(|s| !s.is_empty()) {
                write!(f, "/{}", percent_encode(seg))?;
            }
        }
        Ok(())
    }
}

impl std::str::FromStr for LwioUrl {
    type Err = UrlError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        LwioUrl::parse(s)
    }
}

fn hex(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

/// Decode `%XX` escapes in one path segment.
pub fn percent_decode(seg: &str) -> Result<String, String> {
    let b = seg.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let (h, l) = match (
                b.get(i + 1).and_then(|&c| hex(c)),
                b.get(i + 2).and_then(|&c| hex(c)),
            ) {
                (Some(h), Some(l)) => (h, l),
                _ => return Err(format!("bad percent escape in {seg:?} (use %25 for '%')")),
            };
            let v = h << 4 | l;
            if v == b'/' || v == 0 {
                return Err("'%2F' and '%00' are not allowed in a path segment".into());
            }
            out.push(v);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| format!("segment {seg:?} is not valid UTF-8 once decoded"))
}

/// Encode a segment so that [`percent_decode`] gives it back: everything but
/// unreserved characters and a few harmless ones is escaped.
pub fn percent_encode(seg: &str) -> String {
    let mut out = String::with_capacity(seg.len());
    for &c in seg.as_bytes() {
        if c.is_ascii_alphanumeric() || b"-._~+,=@:".contains(&c) {
            out.push(c as char);
        } else {
            out.push_str(&format!("%{c:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(s: &str) -> LwioUrl {
        LwioUrl::parse(s).unwrap_or_else(|e| panic!("{s}: {e}"))
    }

    #[test]
    fn basic() {
        let u = p("lwio://storage1:7000/data/dir/file.bin");
        assert_eq!(u.host, "storage1");
        assert_eq!(u.port, 7000);
        assert_eq!(u.export.as_deref(), Some("data"));
        assert_eq!(u.path, "dir/file.bin");
        assert_eq!(u.authority(), "storage1:7000");
    }

    #[test]
    fn default_port_and_ipv4() {
        let u = p("lwio://10.0.0.1/data");
        assert_eq!(u.port, DEFAULT_PORT);
        assert_eq!(u.host, "10.0.0.1");
        assert_eq!(u.export.as_deref(), Some("data"));
        assert_eq!(u.path, "");
    }

    #[test]
    fn ipv6() {
        let u = p("lwio://[::1]:9000/e/f");
        assert_eq!(u.host, "::1");
        assert_eq!(u.port, 9000);
        assert_eq!(u.authority(), "[::1]:9000");
        let u = p("lwio://[fe80::1%eth0]/e");
        assert_eq!(u.host, "fe80::1%eth0");
        assert_eq!(u.port, DEFAULT_PORT);
        assert!(LwioUrl::parse("lwio://::1/e").is_err());
        assert!(LwioUrl::parse("lwio://[::1/e").is_err());
        assert!(LwioUrl::parse("lwio://[nothex]/e").is_err());
        assert!(LwioUrl::parse("lwio://[::1]x/e").is_err());
    }

    #[test]
    fn missing_export() {
        for s in ["lwio://host", "lwio://host/", "lwio://host:1//"] {
            let u = p(s);
            assert_eq!(u.export, None, "{s}");
            let e = u.require_export().unwrap_err();
            assert!(e.reason.contains("missing export"), "{e}");
        }
    }

    #[test]
    fn normalisation() {
        let u = p("lwio://h/e//a/./b/");
        assert_eq!(u.path, "a/b");
    }

    #[test]
    fn dotdot_rejected() {
        let e = LwioUrl::parse("lwio://h/e/a/../../etc").unwrap_err();
        assert!(e.reason.contains("cannot leave"), "{e}");
        assert!(LwioUrl::parse("lwio://h/../x").is_err());
        assert!(LwioUrl::parse("lwio://h/e/%2e%2e").is_err());
    }

    #[test]
    fn percent_encoding() {
        let u = p("lwio://h/my%20export/a%25b/%C3%A9t%C3%A9?#");
        assert_eq!(u.export.as_deref(), Some("my export"));
        assert_eq!(u.path, "a%b/été?#");
        assert!(LwioUrl::parse("lwio://h/e/a%2Fb").is_err());
        assert!(LwioUrl::parse("lwio://h/e/a%00").is_err());
        assert!(LwioUrl::parse("lwio://h/e/a%zz").is_err());
        assert!(LwioUrl::parse("lwio://h/e/a%4").is_err());
        assert!(LwioUrl::parse("lwio://h/e/%ff").is_err());
    }

    #[test]
    fn display_round_trip() {
        for s in [
            "lwio://h:7420/e/a/b",
            "lwio://[::1]:9/my%20export/x%25y/%23",
            "lwio://host:1",
        ] {
            let u = p(s);
            assert_eq!(u.to_string(), s);
            assert_eq!(p(&u.to_string()), u);
        }
    }

    #[test]
    fn bad_urls() {
        for s in [
            "",
            "http://h/e",
            "lwio://",
            "lwio://:80/e",
            "lwio://h:0/e",
            "lwio://h:70000/e",
            "lwio://h:x/e",
            "lwio://user@h/e",
            "lwio://h h/e",
        ] {
            assert!(LwioUrl::parse(s).is_err(), "{s:?} should not parse");
        }
    }
}
