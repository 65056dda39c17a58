//! A connection recipe handed from `lwio mount` to the interception
//! library (liblwio_preload.so) of a program of the same user, so that the
//! program can reach a file of the mount directly over RDMA
//! (docs/preload.md).
//!
//! The mount answers an ioctl on one of its open files with this text: the
//! server (authority), the export, the file's path in it and its server
//! inode number, and how the mount logged in and checked the server (its
//! login, TLS mode, provider). The login is a secret: the mount hands it
//! only to callers of its own user (or root), who could read it from the
//! mount's memory anyway.
//!
//! The format is text, one `key=value` per line after the first line
//! `lwio-handoff 1`; strings are hex so that no byte of a path or password
//! can break a line.

use std::fmt::Write as _;
use std::path::PathBuf;

use lwio_rdma::ProviderChoice;
use lwio_side::auth::{Login, Token};
use lwio_side::tls::ClientTls;

/// The ioctl that asks a file of `lwio mount` for its [`Handoff`]:
/// `_IOR('l', 0x10, char[4096])`. The reply is NUL-terminated text.
pub const IOC_HANDOFF: u32 = (2 << 30) | ((HANDOFF_MAX as u32) << 16) | ((b'l' as u32) << 8) | 0x10;

/// The size of the ioctl's reply buffer.
pub const HANDOFF_MAX: usize = 4096;

const MAGIC: &str = "lwio-handoff 1";

/// How to reach one file of a mount from another process.
#[derive(Clone)]
pub struct Handoff {
    /// `HOST:PORT` of the side channel.
    pub authority: String,
    pub export: String,
    /// The file's path in the export.
    pub path: String,
    /// The file's inode number on the server (the reopen must find it).
    pub ino: u64,
    pub login: Login,
    pub tls: ClientTls,
    pub allow_plain_password: bool,
    pub provider: ProviderChoice,
    pub device: Option<String>,
}

impl std::fmt::Debug for Handoff {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Handoff")
            .field("authority", &self.authority)
            .field("export", &self.export)
            .field("path", &self.path)
            .field("ino", &self.ino)
            .field("login", &self.login)
            .field("tls", &self.tls)
            .field("provider", &self.provider)
            .finish_non_exhaustive()
    }
}

fn hex(b: &[u8]) -> String {
    let mut s = String::with_capacity(b.len() * 2);
    for x in b {
        let _ = write!(s, "{x:02x}");
    }
    s
}

fn unhex(s: &str) -> Result<Vec<u8>, String> {
    if !s.len().is_multiple_of(2) {
        return Err(format!("odd-length hex {s:?}"));
    }
    (0..s.len())
        .step_by(2)
        .map(|i| {
            s.get(i..i + 2)
                .and_then(|d| u8::from_str_radix(d, 16).ok())
                .ok_or_else(|| format!("bad hex {s:?}"))
        })
        .collect()
}

fn unhex_str(s: &str) -> Result<String, String> {
    String::from_utf8(unhex(s)?).map_err(|_| "not UTF-8".to_string())
}

fn token(s: &str) -> Result<Token, String> {
    Token::new(&unhex_str(s)?).map_err(|e| e.to_string())
}

impl Handoff {
    /// The text form.
    pub fn encode(&self) -> String {
        let mut s = format!("{MAGIC}\n");
        let _ = writeln!(s, "authority={}", hex(self.authority.as_bytes()));
        let _ = writeln!(s, "export={}", hex(self.export.as_bytes()));
        let _ = writeln!(s, "path={}", hex(self.path.as_bytes()));
        let _ = writeln!(s, "ino={}", self.ino);
        let login = match &self.login {
            Login::Anonymous => "anonymous".to_string(),
            Login::Token(t) => format!("token:{}", hex(t.expose())),
            Login::Password { user, password } => {
                format!(
                    "password:{}:{}",
                    hex(user.as_bytes()),
                    hex(password.as_bytes())
                )
            }
            Login::UserToken { user, token } => {
                format!("usertoken:{}:{}", hex(user.as_bytes()), hex(token.expose()))
            }
        };
        let _ = writeln!(s, "login={login}");
        let tls = match &self.tls {
            ClientTls::Off => "off".to_string(),
            ClientTls::SystemRoots => "system".to_string(),
            ClientTls::CaFile(p) => format!("ca:{}", hex(p.to_string_lossy().as_bytes())),
            ClientTls::Fingerprint(fp) => format!("pin:{}", hex(fp)),
            ClientTls::Insecure => "insecure".to_string(),
            ClientTls::KnownHosts { file, strict } => format!(
                "known_hosts:{}:{}",
                u8::from(*strict),
                hex(file.to_string_lossy().as_bytes())
            ),
        };
        let _ = writeln!(s, "tls={tls}");
        let _ = writeln!(s, "plain_password={}", u8::from(self.allow_plain_password));
        let _ = writeln!(s, "provider={}", self.provider);
        if let Some(d) = &self.device {
            let _ = writeln!(s, "device={}", hex(d.as_bytes()));
        }
        s
    }

    /// Parse the text form (every required key, nothing malformed).
    pub fn decode(text: &str) -> Result<Handoff, String> {
        let mut lines = text.lines();
        if lines.next() != Some(MAGIC) {
            return Err("not an lwio handoff (or another version)".into());
        }
        let (mut authority, mut export, mut path, mut ino) = (None, None, None, None);
        let (mut login, mut tls, mut plain, mut provider, mut device) =
            (None, None, false, None, None);
        for l in lines.filter(|l| !l.is_empty()) {
            let (k, v) = l.split_once('=').ok_or_else(|| format!("bad line {l:?}"))?;
            match k {
                "authority" => authority = Some(unhex_str(v)?),
                "export" => export = Some(unhex_str(v)?),
                "path" => path = Some(unhex_str(v)?),
                "ino" => ino = Some(v.parse::<u64>().map_err(|_| format!("bad ino {v:?}"))?),
                "login" => {
                    let mut p = v.split(':');
                    login = Some(match (p.next(), p.next(), p.next(), p.next()) {
                        (Some("anonymous"), None, None, None) => Login::Anonymous,
                        (Some("token"), Some(t), None, None) => Login::Token(token(t)?),
                        (Some("password"), Some(u), Some(pw), None) => Login::Password {
                            user: unhex_str(u)?,
                            password: unhex_str(pw)?,
                        },
                        (Some("usertoken"), Some(u), Some(t), None) => Login::UserToken {
                            user: unhex_str(u)?,
                            token: token(t)?,
                        },
                        _ => return Err(format!("bad login {:?}", v.split(':').next())),
                    })
                }
                "tls" => {
                    let (kind, rest) = v.split_once(':').unwrap_or((v, ""));
                    tls = Some(match kind {
                        "off" => ClientTls::Off,
                        "system" => ClientTls::SystemRoots,
                        "insecure" => ClientTls::Insecure,
                        "ca" => ClientTls::CaFile(PathBuf::from(unhex_str(rest)?)),
                        "pin" => ClientTls::Fingerprint(
                            unhex(rest)?
                                .try_into()
                                .map_err(|_| "bad pin length".to_string())?,
                        ),
                        "known_hosts" => {
                            let (strict, file) =
                                rest.split_once(':').ok_or("bad known_hosts".to_string())?;
                            ClientTls::KnownHosts {
                                file: PathBuf::from(unhex_str(file)?),
                                strict: strict == "1",
                            }
                        }
                        o => return Err(format!("bad tls {o:?}")),
                    })
                }
                "plain_password" => plain = v == "1",
                "provider" => provider = Some(v.parse::<ProviderChoice>()?),
                "device" => device = Some(unhex_str(v)?),
                // Later versions may add keys.
                _ => {}
            }
        }
        let need = |what: &str| format!("handoff without {what}");
        Ok(Handoff {
            authority: authority.ok_or_else(|| need("authority"))?,
            export: export.ok_or_else(|| need("export"))?,
            path: path.ok_or_else(|| need("path"))?,
            ino: ino.ok_or_else(|| need("ino"))?,
            login: login.ok_or_else(|| need("login"))?,
            tls: tls.ok_or_else(|| need("tls"))?,
            allow_plain_password: plain,
            provider: provider.ok_or_else(|| need("provider"))?,
            device,
        })
    }

    /// What makes two handoffs reach the server the same way (one client
    /// serves every file with the same key).
    pub fn connection_key(&self) -> String {
        let mut h = self.clone();
        h.path.clear();
        h.ino = 0;
        h.encode()
    }

    /// Connect as the handoff says, with `opts` for the data path.
    pub fn connect(&self, mut opts: crate::ClientOptions) -> crate::Result<crate::Client> {
        let mut so = crate::side_client::SideOptions::new(self.login.clone());
        so.tls = self.tls.clone();
        so.allow_plain_password = self.allow_plain_password;
        so.client_name = opts.client_name.clone();
        so.connect_timeout = opts.connect_timeout;
        opts.provider = self.provider;
        opts.device = self.device.clone();
        crate::Client::connect_with(
            &format!("lwio://{}/{}", self.authority, self.export),
            &so,
            opts,
        )
    }
}

impl crate::Client {
    /// The handoff of file `path` (server inode `ino`) of `export`, reached
    /// the way this client was.
    pub fn handoff(&self, export: &str, path: &str, ino: u64) -> Handoff {
        let so = &self.0.side_opts;
        Handoff {
            authority: self.0.authority.clone(),
            export: export.to_string(),
            path: path.to_string(),
            ino,
            login: so.login.clone(),
            tls: so.tls.clone(),
            allow_plain_password: so.allow_plain_password,
            provider: self.0.provider_choice,
            device: self.0.device.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(login: Login, tls: ClientTls) -> Handoff {
        Handoff {
            authority: "10.0.0.1:7007".into(),
            export: "data".into(),
            path: "dir/a file\nwith=odd:bytes".into(),
            ino: 123456789,
            login,
            tls,
            allow_plain_password: true,
            provider: ProviderChoice::Soft,
            device: Some("siw0".into()),
        }
    }

    #[test]
    fn every_login_and_tls_mode_survives_the_text_form() {
        let tok = || Token::new("0123456789abcdef0123").unwrap();
        let cases = [
            (Login::Anonymous, ClientTls::Off),
            (Login::Token(tok()), ClientTls::Fingerprint([7; 32])),
            (
                Login::Password {
                    user: "ann".into(),
                    password: "p:w=\n d".into(),
                },
                ClientTls::CaFile("/etc/ca.pem".into()),
            ),
            (
                Login::UserToken {
                    user: "bob".into(),
                    token: tok(),
                },
                ClientTls::KnownHosts {
                    file: "/h/.lwio/known_hosts".into(),
                    strict: true,
                },
            ),
            (Login::Anonymous, ClientTls::Insecure),
            (Login::Anonymous, ClientTls::SystemRoots),
        ];
        for (login, tls) in cases {
            let h = sample(login, tls);
            let text = h.encode();
            assert!(
                text.lines().all(|l| !l.contains(' ') || l == MAGIC),
                "{text}"
            );
            let d = Handoff::decode(&text).unwrap();
            assert_eq!(d.encode(), text);
            assert_eq!(d.path, h.path);
            assert_eq!(d.ino, h.ino);
            assert_eq!(d.tls, h.tls);
            assert_eq!(d.device.as_deref(), Some("siw0"));
        }
    }

    #[test]
    fn malformed_handoffs_are_refused_with_the_reason() {
        let good = sample(Login::Anonymous, ClientTls::Off).encode();
        assert!(Handoff::decode("lwio-handoff 2\n")
            .unwrap_err()
            .contains("another version"));
        let no_login: String = good
            .lines()
            .filter(|l| !l.starts_with("login="))
            .map(|l| format!("{l}\n"))
            .collect();
        assert_eq!(
            Handoff::decode(&no_login).unwrap_err(),
            "handoff without login"
        );
        let bad = good.replace("ino=123456789", "ino=x");
        assert!(Handoff::decode(&bad).unwrap_err().contains("bad ino"));
        let bad = good.replace("tls=off", "tls=pin:00");
        assert_eq!(Handoff::decode(&bad).unwrap_err(), "bad pin length");
    }

    #[test]
    fn the_connection_key_ignores_the_file() {
        let a = sample(Login::Anonymous, ClientTls::Off);
        let mut b = a.clone();
        b.path = "other".into();
        b.ino = 1;
        assert_eq!(a.connection_key(), b.connection_key());
        b.export = "other".into();
        assert_ne!(a.connection_key(), b.connection_key());
    }

    #[test]
    fn the_ioctl_number_is_ior_l_0x10_of_4096_bytes() {
        // _IOR('l', 0x10, char[4096]) as <linux/ioctl.h> computes it.
        assert_eq!(IOC_HANDOFF, 0x9000_6c10);
    }
}
