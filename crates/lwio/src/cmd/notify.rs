//! sd_notify(3) without libsystemd: one datagram to the unix socket named
//! by `$NOTIFY_SOCKET` (a path, or `@name` for the abstract namespace).
//! Outside systemd (no `NOTIFY_SOCKET`) every call does nothing.

use std::io;
use std::os::unix::net::{SocketAddr, UnixDatagram};

/// Where the notifications go, read once from the environment.
#[derive(Debug, Clone)]
pub struct Notifier {
    target: Option<String>,
}

impl Notifier {
    /// From `$NOTIFY_SOCKET`. The variable is left in place: the children
    /// lwio starts are not services.
    pub fn from_env() -> Notifier {
        Notifier {
            target: std::env::var("NOTIFY_SOCKET")
                .ok()
                .filter(|s| !s.is_empty()),
        }
    }

    /// Whether a service manager listens.
    pub fn enabled(&self) -> bool {
        self.target.is_some()
    }

    /// Send `state` (newline-separated `KEY=VALUE` assignments, e.g.
    /// `READY=1`). `Ok` without a socket.
    pub fn notify(&self, state: &str) -> io::Result<()> {
        let Some(t) = &self.target else {
            return Ok(());
        };
        let addr = socket_addr(t)?;
        let sock = UnixDatagram::unbound()?;
        let n = sock.send_to_addr(state.as_bytes(), &addr)?;
        if n != state.len() {
            return Err(io::Error::other("short write to NOTIFY_SOCKET"));
        }
        Ok(())
    }

    /// [`Notifier::notify`], logging a failure instead of returning it (a
    /// lost status line must not stop the server).
    pub fn send(&self, state: &str) {
        if let Err(e) = self.notify(state) {
            tracing::warn!(state, error = %e, "sd_notify failed");
        }
    }
}

fn socket_addr(t: &str) -> io::Result<SocketAddr> {
    if let Some(name) = t.strip_prefix('@') {
        use std::os::linux::net::SocketAddrExt;
        SocketAddr::from_abstract_name(name.as_bytes())
    } else if t.starts_with('/') {
        SocketAddr::from_pathname(t)
    } else {
        Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("NOTIFY_SOCKET {t:?} is neither a path nor @abstract"),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sends_one_datagram_to_a_path_and_an_abstract_socket() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("notify");
        let rx = UnixDatagram::bind(&p).unwrap();
        let n = Notifier {
            target: Some(p.to_str().unwrap().into()),
        };
        n.notify("READY=1\nSTATUS=up").unwrap();
        let mut buf = [0u8; 64];
        let len = rx.recv(&mut buf).unwrap();
        assert_eq!(&buf[..len], b"READY=1\nSTATUS=up");

        use std::os::linux::net::SocketAddrExt;
        let name = format!("lwio-notify-test-{}", std::process::id());
        let rx = UnixDatagram::bind_addr(&SocketAddr::from_abstract_name(&name).unwrap()).unwrap();
        let n = Notifier {
            target: Some(format!("@{name}")),
        };
        n.notify("STOPPING=1").unwrap();
        let len = rx.recv(&mut buf).unwrap();
        assert_eq!(&buf[..len], b"STOPPING=1");
    }

    #[test]
    fn no_socket_is_a_no_op_and_a_bad_one_an_error() {
        let n = Notifier { target: None };
        assert!(!n.enabled());
        n.notify("READY=1").unwrap();
        let n = Notifier {
            target: Some("relative".into()),
        };
        assert!(n.notify("READY=1").is_err());
        let n = Notifier {
            target: Some("/nonexistent/dir/socket".into()),
        };
        assert!(n.notify("READY=1").is_err());
    }
}
