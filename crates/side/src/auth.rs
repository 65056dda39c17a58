//! Login: shared-token challenge-response and the per-session secret.
//!
//! The token never crosses the wire. With server nonce `Ns` (sent in the
//! Hello reply) and client nonce `Nc` (sent with the login), both 32 bytes
//! from the OS CSPRNG, and `K` = the token's bytes:
//!
//! ```text
//! client proof   = HMAC-SHA256(K, "lwio side-channel v1 client proof"  || 0x00 || Ns || Nc)
//! server proof   = HMAC-SHA256(K, "lwio side-channel v1 server proof"  || 0x00 || Ns || Nc)
//! session secret = HMAC-SHA256(K, "lwio side-channel v1 session secret" || 0x00 || Ns || Nc)
//! ```
//!
//! The server checks the client proof in constant time; the client checks the
//! server proof (mutual authentication). The session secret keys the RDMA
//! phase's AUTH signature. Anonymous sessions use an empty `K`: their secret
//! is derivable by anyone who saw the nonces and authenticates nothing.
//!
//! **Channel binding.** Over TLS, `Ns` above (and in every other proof of
//! the login: per-user tokens, the session secret of a password login) is
//! the *bound* server nonce [`bind_nonce`]:
//!
//! ```text
//! Ns' = SHA-256("lwio side-channel v1 tls-exporter binding" || 0x00 || Ns || E)
//! E   = TLS-Exporter("EXPORTER-Channel-Binding", no context, 32)   (RFC 9266)
//! ```
//!
//! Both ends of one TLS connection derive the same `E`; a man in the middle
//! who terminates TLS toward each side (a client that trusted its
//! certificate on first use, or `--insecure`) holds two connections with two
//! different `E`, so a proof it relays from one to the other is wrong there.
//! Plain TCP has no binding (`Ns' = Ns`). `Resume` and `WatchBreaks` proofs
//! carry the bound nonce of the connection that sends them, so a captured
//! one is good on no other connection.

use std::io::Write;
use std::path::Path;

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::codec::{MAC_LEN, NONCE_LEN};
use crate::error::{Error, ErrorCode, Result};

type HmacSha256 = Hmac<Sha256>;

const CLIENT_LABEL: &[u8] = b"lwio side-channel v1 client proof";
const SERVER_LABEL: &[u8] = b"lwio side-channel v1 server proof";
const SESSION_LABEL: &[u8] = b"lwio side-channel v1 session secret";

/// A shared secret token. `Debug` does not show it.
#[derive(Clone, PartialEq, Eq)]
pub struct Token(Vec<u8>);

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Token(<redacted>)")
    }
}

/// Shortest token accepted (characters).
pub const MIN_TOKEN_LEN: usize = 16;

impl Token {
    /// A token from text: surrounding whitespace is ignored, the rest is used
    /// as bytes (the generated tokens are 64 hex digits).
    pub fn new(text: &str) -> Result<Token> {
        let t = text.trim();
        if t.len() < MIN_TOKEN_LEN {
            return Err(Error::new(
                ErrorCode::InvalidArgument,
                format!(
                    "token too short ({} characters, need at least {MIN_TOKEN_LEN})",
                    t.len()
                ),
            ));
        }
        Ok(Token(t.as_bytes().to_vec()))
    }

    /// A fresh random 256-bit token, as 64 lowercase hex digits.
    pub fn generate() -> Token {
        let mut b = [0u8; 32];
        crate::random_bytes(&mut b);
        Token(hex(&b).into_bytes())
    }

    /// The token text (to write into a token file).
    pub fn expose(&self) -> &[u8] {
        &self.0
    }

    /// Read a token file.
    pub fn load(path: &Path) -> Result<Token> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| Error::from_io(&e, format!("token file {}", path.display())))?;
        Token::new(&text).map_err(|e| {
            Error::new(
                e.code,
                format!("token file {}: {}", path.display(), e.message),
            )
        })
    }

    /// Read a token file, creating it (mode 0600, parent directories 0700)
    /// with a random token if it does not exist. Returns whether it was created.
    pub fn load_or_create(path: &Path) -> Result<(Token, bool)> {
        use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
        let ctx = || format!("token file {}", path.display());
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            if !parent.exists() {
                std::fs::DirBuilder::new()
                    .recursive(true)
                    .mode(0o700)
                    .create(parent)
                    .map_err(|e| Error::from_io(&e, ctx()))?;
            }
        }
        let token = Token::generate();
        match std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path)
        {
            Ok(mut f) => {
                let mut text = token.0.clone();
                text.push(b'\n');
                f.write_all(&text)
                    .and_then(|_| f.sync_all())
                    .map_err(|e| Error::from_io(&e, ctx()))?;
                Ok((token, true))
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                if let Ok(m) = std::fs::metadata(path) {
                    if m.permissions().mode() & 0o077 != 0 {
                        tracing::warn!(
                            path = %path.display(),
                            "token file is readable by group or others; consider chmod 600"
                        );
                    }
                }
                Ok((Token::load(path)?, false))
            }
            Err(e) => Err(Error::from_io(&e, ctx())),
        }
    }
}

/// Lowercase hex.
pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn mac(key: &[u8], label: &[u8], sn: &[u8; NONCE_LEN], cn: &[u8; NONCE_LEN]) -> HmacSha256 {
    // HMAC accepts keys of any length, so this cannot fail.
    let mut m = <HmacSha256 as Mac>::new_from_slice(key).expect("HMAC takes any key length");
    m.update(label);
    m.update(&[0]);
    m.update(sn);
    m.update(cn);
    m
}

/// Client proof for a token login.
pub fn client_proof(token: &Token, sn: &[u8; NONCE_LEN], cn: &[u8; NONCE_LEN]) -> [u8; MAC_LEN] {
    mac(&token.0, CLIENT_LABEL, sn, cn)
        .finalize()
        .into_bytes()
        .into()
}

/// Constant-time check of a client proof.
pub fn verify_client_proof(
    token: &Token,
    sn: &[u8; NONCE_LEN],
    cn: &[u8; NONCE_LEN],
    proof: &[u8],
) -> bool {
    mac(&token.0, CLIENT_LABEL, sn, cn)
        .verify_slice(proof)
        .is_ok()
}

/// Server proof (the client checks it).
pub fn server_proof(token: &Token, sn: &[u8; NONCE_LEN], cn: &[u8; NONCE_LEN]) -> [u8; MAC_LEN] {
    mac(&token.0, SERVER_LABEL, sn, cn)
        .finalize()
        .into_bytes()
        .into()
}

/// Constant-time check of a server proof.
pub fn verify_server_proof(
    token: &Token,
    sn: &[u8; NONCE_LEN],
    cn: &[u8; NONCE_LEN],
    proof: &[u8],
) -> bool {
    mac(&token.0, SERVER_LABEL, sn, cn)
        .verify_slice(proof)
        .is_ok()
}

/// The per-session secret (empty key for anonymous sessions).
pub fn session_secret(
    token: Option<&Token>,
    sn: &[u8; NONCE_LEN],
    cn: &[u8; NONCE_LEN],
) -> [u8; MAC_LEN] {
    let key = token.map_or(&[][..], |t| &t.0[..]);
    mac(key, SESSION_LABEL, sn, cn)
        .finalize()
        .into_bytes()
        .into()
}

/// The TLS exporter label of RFC 9266 (`tls-exporter` channel binding).
pub const EXPORTER_LABEL: &[u8] = b"EXPORTER-Channel-Binding";
/// Length of the exporter value mixed into the login.
pub const BINDING_LEN: usize = 32;
const BINDING_LABEL: &[u8] = b"lwio side-channel v1 tls-exporter binding";

/// The server nonce the login's proofs use: `sn` itself over plain TCP,
/// bound to the TLS connection's exporter value `binding` over TLS (module
/// docs).
pub fn bind_nonce(sn: &[u8; NONCE_LEN], binding: Option<&[u8; BINDING_LEN]>) -> [u8; NONCE_LEN] {
    use sha2::Digest;
    let Some(b) = binding else {
        return *sn;
    };
    let mut h = Sha256::new();
    h.update(BINDING_LABEL);
    h.update([0]);
    h.update(sn);
    h.update(b);
    h.finalize().into()
}

const BREAKS_LABEL: &[u8] = b"lwio-breaks";

/// The proof that binds a lease-break watching connection to session
/// `session_id`: HMAC-SHA256(that session's secret, "lwio-breaks" ||
/// session_id LE || N), where N is the bound server nonce of the login of
/// the connection that asks (docs/leases.md): fresh for each connection, so
/// a captured proof is good on no other. The secret itself never travels.
pub fn breaks_mac(
    secret: &SessionSecret,
    session_id: u64,
    nonce: &[u8; NONCE_LEN],
) -> [u8; MAC_LEN] {
    labelled_mac(BREAKS_LABEL, secret, session_id, nonce)
        .finalize()
        .into_bytes()
        .into()
}

/// HMAC-SHA256(secret, label || session_id LE || nonce), not finalized yet.
fn labelled_mac(
    label: &[u8],
    secret: &SessionSecret,
    session_id: u64,
    nonce: &[u8; NONCE_LEN],
) -> HmacSha256 {
    let mut m = <HmacSha256 as Mac>::new_from_slice(&secret.0).expect("HMAC takes any key");
    m.update(label);
    m.update(&session_id.to_le_bytes());
    m.update(nonce);
    m
}

/// Constant-time check of [`breaks_mac`].
pub fn verify_breaks_mac(
    secret: &SessionSecret,
    session_id: u64,
    nonce: &[u8; NONCE_LEN],
    mac: &[u8],
) -> bool {
    labelled_mac(BREAKS_LABEL, secret, session_id, nonce)
        .verify_slice(mac)
        .is_ok()
}

const RESUME_LABEL: &[u8] = b"lwio-resume";

/// Proof of a session's secret for `Resume` (docs/reconnect.md), bound to
/// the asking connection's login nonce as [`breaks_mac`] is.
pub fn resume_mac(
    secret: &SessionSecret,
    session_id: u64,
    nonce: &[u8; NONCE_LEN],
) -> [u8; MAC_LEN] {
    labelled_mac(RESUME_LABEL, secret, session_id, nonce)
        .finalize()
        .into_bytes()
        .into()
}

/// Constant-time check of [`resume_mac`].
pub fn verify_resume_mac(
    secret: &SessionSecret,
    session_id: u64,
    nonce: &[u8; NONCE_LEN],
    mac: &[u8],
) -> bool {
    labelled_mac(RESUME_LABEL, secret, session_id, nonce)
        .verify_slice(mac)
        .is_ok()
}

/// A fresh nonce.
pub fn nonce() -> [u8; NONCE_LEN] {
    let mut n = [0u8; NONCE_LEN];
    crate::random_bytes(&mut n);
    n
}

/// How a client logs in. `Debug` does not show secrets.
#[derive(Clone, PartialEq, Eq)]
pub enum Login {
    /// No credentials; the server must allow anonymous access.
    Anonymous,
    /// Shared-token challenge-response.
    Token(Token),
    /// User + password. Sent to the server (which stores only a salted
    /// argon2id hash), so only over TLS unless
    /// `ClientOptions::allow_plain_password`.
    Password { user: String, password: String },
    /// User + per-user token, challenge-response (the token is never sent).
    UserToken { user: String, token: Token },
}

impl std::fmt::Debug for Login {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Login::Anonymous => f.write_str("Anonymous"),
            Login::Token(t) => write!(f, "Token({t:?})"),
            Login::Password { user, .. } => write!(f, "Password({user}, <redacted>)"),
            Login::UserToken { user, .. } => write!(f, "UserToken({user}, <redacted>)"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn proofs_and_secret() {
        let t = Token::new("0123456789abcdef0123456789abcdef").unwrap();
        let (sn, cn) = ([1u8; 32], [2u8; 32]);
        let p = client_proof(&t, &sn, &cn);
        assert!(verify_client_proof(&t, &sn, &cn, &p));
        assert!(!verify_client_proof(&t, &cn, &sn, &p), "nonces are ordered");
        let other = Token::new("ffffffffffffffffffffffffffffffff").unwrap();
        assert!(!verify_client_proof(&other, &sn, &cn, &p));
        let s = server_proof(&t, &sn, &cn);
        assert_ne!(s, p, "client and server proofs differ");
        assert!(verify_server_proof(&t, &sn, &cn, &s));
        assert!(
            !verify_server_proof(&t, &sn, &cn, &p),
            "a client proof is not a server proof"
        );
        let k = session_secret(Some(&t), &sn, &cn);
        assert_ne!(k, s);
        assert_ne!(k, session_secret(Some(&t), &sn, &[3; 32]));
        assert_ne!(k, session_secret(None, &sn, &cn));
        // Known-answer: pins the construction documented in docs/side-channel.md.
        let mut m =
            <HmacSha256 as Mac>::new_from_slice(b"0123456789abcdef0123456789abcdef").unwrap();
        m.update(b"lwio side-channel v1 client proof\0");
        m.update(&sn);
        m.update(&cn);
        assert_eq!(p, <[u8; 32]>::from(m.finalize().into_bytes()));
    }

    #[test]
    fn tokens() {
        assert!(Token::new("short").is_err());
        assert_eq!(
            Token::new("  0123456789abcdef\n").unwrap().expose(),
            b"0123456789abcdef"
        );
        let g = Token::generate();
        assert_eq!(g.expose().len(), 64);
        assert!(g.expose().iter().all(|c| c.is_ascii_hexdigit()));
        assert_ne!(g, Token::generate());
        assert_eq!(format!("{g:?}"), "Token(<redacted>)");
    }

    #[test]
    fn token_file_created_0600() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("sub/dir/token");
        let (t, created) = Token::load_or_create(&p).unwrap();
        assert!(created);
        let m = std::fs::metadata(&p).unwrap();
        assert_eq!(m.permissions().mode() & 0o777, 0o600);
        let (t2, created) = Token::load_or_create(&p).unwrap();
        assert!(!created);
        assert_eq!(t, t2);
        assert_eq!(Token::load(&p).unwrap(), t);
        let e = Token::load(&d.path().join("missing")).unwrap_err();
        assert_eq!(e.code, ErrorCode::NotFound);
        assert!(e.message.contains("token file"), "{e}");
    }
}

/// A 32-byte per-session secret; `Debug` does not show it.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct SessionSecret(pub [u8; 32]);

impl std::fmt::Debug for SessionSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SessionSecret(<redacted>)")
    }
}
