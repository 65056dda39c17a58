//! Per-user token logins: a SCRAM-style verifier (RFC 5802 construction
//! with HMAC-SHA256). The client computes its proof and checks the server's;
//! the server stores only the verifier ([`TokenVerifier`]) and recovers
//! `ClientKey` from the proof. See docs/security.md.

use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::codec::{MAC_LEN, NONCE_LEN};

type HmacSha256 = Hmac<Sha256>;

const UT_CLIENT_KEY: &[u8] = b"lwio user-token v1 client key";
const UT_SERVER_KEY: &[u8] = b"lwio user-token v1 server key";
const UT_CLIENT_PROOF: &[u8] = b"lwio side-channel v1 user-token client proof";
const UT_SERVER_PROOF: &[u8] = b"lwio side-channel v1 user-token server proof";
const UT_SESSION: &[u8] = b"lwio side-channel v1 session secret";
/// Prefix of a stored user-token verifier.
pub const TOKEN_VERIFIER_PREFIX: &str = "lwio-token1$";

fn hmac(key: &[u8], parts: &[&[u8]]) -> [u8; MAC_LEN] {
    let mut m = <HmacSha256 as Mac>::new_from_slice(key).expect("HMAC takes any key length");
    for p in parts {
        m.update(p);
    }
    m.finalize().into_bytes().into()
}

/// `ClientKey` of a per-user token (client side, and to build verifiers).
pub fn user_token_client_key(token: &[u8]) -> [u8; MAC_LEN] {
    hmac(token, &[UT_CLIENT_KEY])
}

/// What the server stores for a per-user token.
#[derive(Clone, PartialEq, Eq)]
pub struct TokenVerifier {
    pub stored_key: [u8; MAC_LEN],
    pub server_key: [u8; MAC_LEN],
}

impl std::fmt::Debug for TokenVerifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TokenVerifier(<redacted>)")
    }
}

fn unhex32(s: &str) -> Option<[u8; 32]> {
    if s.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

impl TokenVerifier {
    /// The verifier of a token (its text, surrounding whitespace removed).
    pub fn from_token(token: &[u8]) -> TokenVerifier {
        let ck = user_token_client_key(token);
        TokenVerifier {
            stored_key: Sha256::digest(ck).into(),
            server_key: hmac(token, &[UT_SERVER_KEY]),
        }
    }

    /// Parse `lwio-token1$<64 hex>$<64 hex>`.
    pub fn parse(s: &str) -> Result<TokenVerifier, String> {
        let bad = || {
            "not a token verifier: expected lwio-token1$<64 hex digits>$<64 hex digits> (make one with `lwio hash-password --token`)".to_string()
        };
        let rest = s.strip_prefix(TOKEN_VERIFIER_PREFIX).ok_or_else(bad)?;
        let (a, b) = rest.split_once('$').ok_or_else(bad)?;
        Ok(TokenVerifier {
            stored_key: unhex32(a).ok_or_else(bad)?,
            server_key: unhex32(b).ok_or_else(bad)?,
        })
    }

    /// Verify a client proof; on success returns `ClientKey` (keys the
    /// session secret).
    pub fn verify(
        &self,
        user: &str,
        sn: &[u8; NONCE_LEN],
        cn: &[u8; NONCE_LEN],
        proof: &[u8; MAC_LEN],
    ) -> Option<[u8; MAC_LEN]> {
        let ck = xor_client_signature(&self.stored_key, user, sn, cn, proof);
        let h: [u8; 32] = Sha256::digest(ck).into();
        if bool::from(h.ct_eq(&self.stored_key)) {
            Some(ck)
        } else {
            None
        }
    }

    /// The server's proof (the client checks it).
    pub fn server_proof(
        &self,
        user: &str,
        sn: &[u8; NONCE_LEN],
        cn: &[u8; NONCE_LEN],
    ) -> [u8; MAC_LEN] {
        user_token_server_proof(&self.server_key, user, sn, cn)
    }
}

impl std::fmt::Display for TokenVerifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{TOKEN_VERIFIER_PREFIX}{}${}",
            crate::auth::hex(&self.stored_key),
            crate::auth::hex(&self.server_key)
        )
    }
}

fn user_token_server_proof(
    server_key: &[u8; MAC_LEN],
    user: &str,
    sn: &[u8; NONCE_LEN],
    cn: &[u8; NONCE_LEN],
) -> [u8; MAC_LEN] {
    hmac(
        server_key,
        &[UT_SERVER_PROOF, &[0], user.as_bytes(), &[0], sn, cn],
    )
}

/// Client side: the proof for a per-user token login.
pub fn user_token_proof(
    token: &[u8],
    user: &str,
    sn: &[u8; NONCE_LEN],
    cn: &[u8; NONCE_LEN],
) -> [u8; MAC_LEN] {
    let v = TokenVerifier::from_token(token);
    let ck = user_token_client_key(token);
    xor_client_signature(&v.stored_key, user, sn, cn, &ck)
}

/// `x XOR HMAC(StoredKey, label || 0 || user || 0 || Ns || Nc)`: turns
/// `ClientKey` into the proof and back.
fn xor_client_signature(
    stored_key: &[u8; MAC_LEN],
    user: &str,
    sn: &[u8; NONCE_LEN],
    cn: &[u8; NONCE_LEN],
    x: &[u8; MAC_LEN],
) -> [u8; MAC_LEN] {
    let sig = hmac(
        stored_key,
        &[UT_CLIENT_PROOF, &[0], user.as_bytes(), &[0], sn, cn],
    );
    std::array::from_fn(|i| x[i] ^ sig[i])
}

/// Client side: check the server's proof for a per-user token login.
pub fn verify_user_token_server_proof(
    token: &[u8],
    user: &str,
    sn: &[u8; NONCE_LEN],
    cn: &[u8; NONCE_LEN],
    proof: &[u8; MAC_LEN],
) -> bool {
    let v = TokenVerifier::from_token(token);
    bool::from(user_token_server_proof(&v.server_key, user, sn, cn).ct_eq(proof))
}

/// Session secret of a per-user token or password login, keyed with
/// `ClientKey` (token) or the password.
pub fn user_session_secret(
    key: &[u8],
    sn: &[u8; NONCE_LEN],
    cn: &[u8; NONCE_LEN],
) -> [u8; MAC_LEN] {
    hmac(key, &[UT_SESSION, &[0], sn, cn])
}
