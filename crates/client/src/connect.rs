//! How a client logs in and secures its side channel — one default for the
//! `lwio` CLI, the C API and [`Client::connect`](crate::Client::connect):
//! [`SideOptions::resolve`] turns what the caller said ([`ConnectArgs`])
//! into side-channel options, filling in what it did not say from the
//! environment and the default files.
//!
//! Login, first match wins: with a user, that user's token (given, from a
//! file, or `LWIO_TOKEN`) or password (given, from a file, `LWIO_PASSWORD`,
//! or asked for); without one, the token given or its file, else
//! `LWIO_TOKEN`, else the default token file
//! ([`default_token_file`]) if it exists, else anonymous.
//!
//! TLS, first match wins: plain TCP when asked; unverified when asked; a
//! pinned fingerprint (given, or `LWIO_FINGERPRINT` unless a CA file is
//! given); a CA file; else trust on first use as ssh does, in the
//! known_hosts file given, or `LWIO_KNOWN_HOSTS`, or the default one
//! ([`lwio_side::known_hosts::default_path`]; strict with
//! `LWIO_STRICT_HOST_KEY_CHECKING=yes`); without a home directory the
//! system roots. A default `lwio serve` speaks TLS with a self-signed
//! certificate, which the default accepts on first use and pins from then
//! on (docs/security.md).

use std::path::PathBuf;
use std::time::Duration;

use lwio_side::defaults::{default_token_file, validate_user_name};
use lwio_side::error::{Error, ErrorCode, Result};
use lwio_side::tls::parse_fingerprint;
use lwio_side::{ClientTls, Login, Token};

use crate::side_client::SideOptions;

/// What a caller says about login and TLS (the CLI's flags, the C API's
/// options); what it leaves out is resolved by [`SideOptions::resolve`].
#[derive(Debug, Clone, Default)]
pub struct ConnectArgs {
    /// Log in as this user (token or password).
    pub user: Option<String>,
    /// A token in memory.
    pub token: Option<String>,
    /// A file holding the token (when `token` is not given).
    pub token_file: Option<PathBuf>,
    /// The user's password in memory.
    pub password: Option<String>,
    /// A file whose first line is the user's password.
    pub password_file: Option<PathBuf>,
    /// Ask for a user's password (on a terminal) when none is given:
    /// called with the prompt.
    pub ask_password: Option<fn(&str) -> std::io::Result<String>>,
    /// Plain TCP (a server with `tls = false`).
    pub no_tls: bool,
    /// TLS without verifying the server.
    pub insecure: bool,
    /// Pin the server's certificate: `sha256:…`.
    pub fingerprint: Option<String>,
    /// Verify the server against the CA certificates in this PEM file.
    pub ca: Option<PathBuf>,
    /// Trust on first use in this file.
    pub known_hosts: Option<PathBuf>,
    /// Refuse a server not yet in known_hosts.
    pub strict_host_key_checking: bool,
    /// How long to try to connect and log in (`None`: the default).
    pub connect_timeout: Option<Duration>,
}

impl SideOptions {
    /// Side-channel options for `args` with everything it leaves out
    /// resolved (module docs): [`resolve_login`] and [`resolve_tls`].
    pub fn resolve(args: &ConnectArgs) -> Result<SideOptions> {
        let mut o = SideOptions::new(resolve_login(args)?);
        o.tls = resolve_tls(args)?;
        if let Some(t) = args.connect_timeout {
            o.connect_timeout = t;
        }
        Ok(o)
    }
}

fn invalid(m: impl Into<String>) -> Error {
    Error::new(ErrorCode::InvalidArgument, m)
}

/// A non-empty environment variable.
fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

/// `LWIO_TOKEN`, if set.
fn env_token() -> Result<Option<Token>> {
    env("LWIO_TOKEN")
        .map(|t| Token::new(&t).map_err(|e| invalid(format!("LWIO_TOKEN: {}", e.message))))
        .transpose()
}

/// The first line of a secret read from a file.
fn first_line(text: &str) -> &str {
    text.lines().next().unwrap_or("").trim_end_matches('\r')
}

/// The login of `args` (module docs).
pub fn resolve_login(args: &ConnectArgs) -> Result<Login> {
    let given = match (&args.token, &args.token_file) {
        (Some(t), _) => Some(Token::new(t).map_err(|e| invalid(format!("token: {}", e.message)))?),
        (None, Some(p)) => Some(Token::load(p)?),
        (None, None) => None,
    };
    if let Some(user) = &args.user {
        validate_user_name(user).map_err(|e| invalid(format!("--user: {e}")))?;
        let token = match given {
            Some(t) => Some(t),
            None => env_token()?,
        };
        if let Some(token) = token {
            return Ok(Login::UserToken {
                user: user.clone(),
                token,
            });
        }
        let no_password = |why: String| {
            invalid(format!(
                "no password for {user}: give --password-file FILE or set LWIO_PASSWORD{why}"
            ))
        };
        let password = if let Some(p) = &args.password {
            p.clone()
        } else if let Some(p) = &args.password_file {
            let t = std::fs::read_to_string(p)
                .map_err(|e| Error::from_io(&e, format!("password file {}", p.display())))?;
            first_line(&t).to_string()
        } else if let Ok(p) = std::env::var("LWIO_PASSWORD") {
            p
        } else if let Some(ask) = args.ask_password {
            ask(&format!("Password for {user}: ")).map_err(|e| no_password(format!(" ({e})")))?
        } else {
            return Err(no_password(String::new()));
        };
        return Ok(Login::Password {
            user: user.clone(),
            password,
        });
    }
    if let Some(t) = given {
        return Ok(Login::Token(t));
    }
    if let Some(t) = env_token()? {
        return Ok(Login::Token(t));
    }
    if let Some(p) = default_token_file().filter(|p| p.exists()) {
        return Ok(Login::Token(Token::load(&p)?));
    }
    Ok(Login::Anonymous)
}

/// The transport security of `args` (module docs).
pub fn resolve_tls(args: &ConnectArgs) -> Result<ClientTls> {
    if args.no_tls {
        return Ok(ClientTls::Off);
    }
    if args.insecure {
        return Ok(ClientTls::Insecure);
    }
    let fp = match &args.fingerprint {
        Some(f) => Some(f.clone()),
        None if args.ca.is_none() => env("LWIO_FINGERPRINT"),
        None => None,
    };
    if let Some(f) = fp {
        return Ok(ClientTls::Fingerprint(parse_fingerprint(&f)?));
    }
    if let Some(p) = &args.ca {
        return Ok(ClientTls::CaFile(p.clone()));
    }
    let file = args
        .known_hosts
        .clone()
        .or_else(|| {
            std::env::var_os("LWIO_KNOWN_HOSTS")
                .filter(|v| !v.is_empty())
                .map(PathBuf::from)
        })
        .or_else(lwio_side::known_hosts::default_path);
    let strict = args.strict_host_key_checking
        || std::env::var("LWIO_STRICT_HOST_KEY_CHECKING")
            .is_ok_and(|v| matches!(v.as_str(), "yes" | "1" | "true"));
    Ok(match file {
        Some(file) => ClientTls::KnownHosts { file, strict },
        // No HOME and no file given: only a CA-signed certificate will do.
        None => ClientTls::SystemRoots,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const TOKEN: &str = "0123456789abcdef0123456789abcdef";

    #[test]
    fn what_is_given_wins() {
        let a = ConnectArgs {
            token: Some(TOKEN.into()),
            no_tls: true,
            ..Default::default()
        };
        let o = SideOptions::resolve(&a).unwrap();
        assert!(matches!(o.login, Login::Token(_)));
        assert_eq!(o.tls, ClientTls::Off);
        let a = ConnectArgs {
            user: Some("alice".into()),
            password: Some("pw".into()),
            known_hosts: Some("/k".into()),
            strict_host_key_checking: true,
            ..Default::default()
        };
        let o = SideOptions::resolve(&a).unwrap();
        assert!(
            matches!(o.login, Login::Password { ref user, ref password } if user == "alice" && password == "pw")
        );
        assert_eq!(
            o.tls,
            ClientTls::KnownHosts {
                file: "/k".into(),
                strict: true
            }
        );
        let a = ConnectArgs {
            ca: Some("/ca.pem".into()),
            insecure: false,
            ..Default::default()
        };
        assert_eq!(
            resolve_tls(&a).unwrap(),
            ClientTls::CaFile("/ca.pem".into())
        );
        let a = ConnectArgs {
            fingerprint: Some("sha256:nonsense".into()),
            ..Default::default()
        };
        assert!(resolve_tls(&a)
            .unwrap_err()
            .message
            .contains("invalid fingerprint"));
        let a = ConnectArgs {
            user: Some("anonymous".into()),
            ..Default::default()
        };
        assert!(resolve_login(&a)
            .unwrap_err()
            .message
            .starts_with("--user: "));
    }

    /// The default is TLS: trust on first use, or the system roots.
    #[test]
    fn the_default_is_tls() {
        let t = resolve_tls(&ConnectArgs::default()).unwrap();
        assert!(t.is_tls(), "{t:?}");
        assert_ne!(t, ClientTls::Insecure);
    }
}
