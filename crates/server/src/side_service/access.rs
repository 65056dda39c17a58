//! Who a session is ([`Principal`]), the configured users and their stored
//! credentials ([`UserDb`]), and per-export access lists ([`Acl`]).
//!
//! Stored credentials never hold a secret in a form that logs a user in:
//!
//! * passwords: an argon2id PHC string (`$argon2id$v=19$m=…,t=…,p=…$salt$hash`),
//!   verified with the `argon2` crate (constant time);
//! * per-user tokens: `lwio-token1$<StoredKey hex>$<ServerKey hex>`, a
//!   SCRAM-style verifier (RFC 5802 construction with HMAC-SHA256): the
//!   client proves knowledge of `ClientKey = HMAC(token, "…client key")`
//!   over both nonces; the server recovers `ClientKey` from the proof and
//!   compares `SHA-256(ClientKey)` with `StoredKey` in constant time. A
//!   stolen config file does not let its reader log in as the user.
//!
//! See docs/security.md.

use std::collections::BTreeMap;

use argon2::password_hash::{PasswordHash, PasswordHasher, PasswordVerifier, SaltString};
use argon2::Argon2;

use crate::fs::table::Rights;

/// ACL entry matching every authenticated principal (users and the shared token).
pub const ANY_USER: &str = "*";
/// ACL entry matching anonymous sessions; the name the shared server token
/// logs in as; the check of user names (shared with clients).
pub use lwio_side::defaults::{validate_user_name, ANONYMOUS, SHARED_TOKEN_NAME};

/// Who a logged-in session is.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Principal {
    /// No credentials (only with `allow_anonymous`).
    Anonymous,
    /// The server-wide shared token (`token_file`).
    SharedToken,
    /// A configured user (password or per-user token).
    User(String),
}

impl Principal {
    /// Name for logs and error messages.
    pub fn name(&self) -> &str {
        match self {
            Principal::Anonymous => ANONYMOUS,
            Principal::SharedToken => SHARED_TOKEN_NAME,
            Principal::User(u) => u,
        }
    }

    /// How error messages call it ("user alice", "anonymous sessions", …).
    pub fn describe(&self) -> String {
        match self {
            Principal::Anonymous => "anonymous sessions".into(),
            Principal::SharedToken => "the shared token".into(),
            Principal::User(u) => format!("user {u}"),
        }
    }
}

impl std::fmt::Display for Principal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Who may read and who may write an export.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Acl {
    pub readers: Vec<String>,
    pub writers: Vec<String>,
}

impl Default for Acl {
    /// No lists configured: everyone who may log in reads (anonymous
    /// sessions only when `allow_anonymous` lets them log in at all), and
    /// every authenticated login writes. Anonymous sessions write only
    /// where an export lists "anonymous" in `writers` (as an NFS export is
    /// read-only and squashes unknown users unless it says otherwise).
    fn default() -> Acl {
        Acl {
            readers: vec![ANY_USER.to_string(), ANONYMOUS.to_string()],
            writers: vec![ANY_USER.to_string()],
        }
    }
}

fn listed(list: &[String], p: &Principal) -> bool {
    list.iter().any(|e| match p {
        Principal::Anonymous => e == ANONYMOUS,
        Principal::SharedToken => e == ANY_USER,
        Principal::User(u) => e == ANY_USER || e == u,
    })
}

impl Acl {
    /// From optional config lists; a missing list means the default.
    pub fn from_lists(readers: Option<&[String]>, writers: Option<&[String]>) -> Acl {
        let d = Acl::default();
        Acl {
            readers: readers.map_or(d.readers, <[String]>::to_vec),
            writers: writers.map_or(d.writers, <[String]>::to_vec),
        }
    }

    /// The rights `p` has on the export (writers may also read).
    pub fn rights(&self, p: &Principal) -> Rights {
        let write = listed(&self.writers, p);
        Rights {
            read: write || listed(&self.readers, p),
            write,
        }
    }
}

// ------------------------------------------------------------ passwords

/// Hash a password as an argon2id PHC string with a fresh random salt
/// (the crate's default parameters: m=19456 KiB, t=2, p=1).
pub fn hash_password(password: &str) -> String {
    let mut salt = [0u8; 16];
    lwio_side::random_bytes(&mut salt);
    // Encoding 16 bytes as a B64 salt cannot fail.
    let salt = SaltString::encode_b64(&salt).expect("16-byte salt encodes");
    Argon2::default()
        .hash_password(password.as_bytes(), &salt)
        .expect("argon2id with default parameters hashes any password")
        .to_string()
}

/// Check that a string is an argon2id PHC hash.
pub fn check_password_hash(phc: &str) -> Result<(), String> {
    let h = PasswordHash::new(phc).map_err(|e| format!("not a PHC password hash: {e}"))?;
    if h.algorithm.as_str() != "argon2id" {
        return Err(format!(
            "password hash uses {}, expected argon2id (make one with `lwio hash-password`)",
            h.algorithm
        ));
    }
    Ok(())
}

/// Verify a password against a PHC string (constant time in the hash).
pub fn verify_password(phc: &str, password: &str) -> bool {
    match PasswordHash::new(phc) {
        Ok(h) => Argon2::default()
            .verify_password(password.as_bytes(), &h)
            .is_ok(),
        Err(_) => false,
    }
}

/// A fixed hash to verify against for unknown users, so that the time to
/// fail does not tell whether a user exists.
pub fn dummy_password_hash() -> &'static str {
    static H: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    H.get_or_init(|| hash_password("lwio: no such user"))
}

// ------------------------------------------------------------ user tokens

pub use lwio_side::user_token::*;

// ------------------------------------------------------------ user db

/// Stored credentials of one user (at least one of the two).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UserCredentials {
    /// argon2id PHC string.
    pub password: Option<String>,
    pub token: Option<TokenVerifier>,
    /// `uid`/`gid` from the config: what the user's calls run as on
    /// `identity = "client"` exports that do not trust its ids.
    pub ids: Option<(u32, u32)>,
}

/// Configured users by name.
pub type UserDb = BTreeMap<String, UserCredentials>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn acl_matching() {
        let alice = Principal::User("alice".into());
        let bob = Principal::User("bob".into());
        let d = Acl::default();
        for p in [&alice, &Principal::SharedToken] {
            assert_eq!(
                d.rights(p),
                Rights {
                    read: true,
                    write: true
                }
            );
        }
        // Anonymous sessions read by default, and write only where listed.
        assert_eq!(
            d.rights(&Principal::Anonymous),
            Rights {
                read: true,
                write: false
            }
        );
        let open = Acl::from_lists(None, Some(&["anonymous".into()]));
        assert!(open.rights(&Principal::Anonymous).write);
        let ro = Acl::from_lists(Some(&["*".into()]), Some(&["alice".into()]));
        assert!(ro.rights(&alice).write);
        assert_eq!(
            ro.rights(&bob),
            Rights {
                read: true,
                write: false
            }
        );
        assert!(ro.rights(&Principal::SharedToken).read);
        assert_eq!(ro.rights(&Principal::Anonymous), Rights::default());
        let only = Acl::from_lists(Some(&[]), Some(&["bob".into()]));
        assert!(only.rights(&bob).read, "writers may read");
        assert_eq!(only.rights(&alice), Rights::default());
    }

    #[test]
    fn passwords() {
        let h = hash_password("correct horse");
        assert!(h.starts_with("$argon2id$v=19$"), "{h}");
        check_password_hash(&h).unwrap();
        assert!(verify_password(&h, "correct horse"));
        assert!(!verify_password(&h, "correct horsf"));
        assert!(!verify_password("garbage", "x"));
        assert_ne!(h, hash_password("correct horse"), "salted");
        assert!(check_password_hash("$argon2i$v=19$m=16,t=2,p=1$c2FsdHNhbHQ$aGFzaA").is_err());
        assert!(check_password_hash("plain").is_err());
    }

    #[test]
    fn user_tokens() {
        let tok = b"0123456789abcdef0123456789abcdef";
        let v = TokenVerifier::from_token(tok);
        let s = v.to_string();
        assert!(s.starts_with(TOKEN_VERIFIER_PREFIX));
        assert_eq!(TokenVerifier::parse(&s).unwrap(), v);
        assert!(TokenVerifier::parse("lwio-token1$00$11").is_err());
        assert!(!s.contains("0123456789abcdef0123"), "token not in clear");
        let (sn, cn) = ([1u8; 32], [2u8; 32]);
        let p = user_token_proof(tok, "alice", &sn, &cn);
        let ck = v.verify("alice", &sn, &cn, &p).unwrap();
        assert_eq!(ck, user_token_client_key(tok));
        assert!(v.verify("bob", &sn, &cn, &p).is_none(), "bound to the user");
        assert!(v.verify("alice", &cn, &sn, &p).is_none(), "bound to nonces");
        let other = user_token_proof(b"ffffffffffffffffffffffffffffffff", "alice", &sn, &cn);
        assert!(v.verify("alice", &sn, &cn, &other).is_none());
        let sp = v.server_proof("alice", &sn, &cn);
        assert!(verify_user_token_server_proof(tok, "alice", &sn, &cn, &sp));
        assert!(!verify_user_token_server_proof(tok, "alice", &sn, &cn, &p));
    }
}
