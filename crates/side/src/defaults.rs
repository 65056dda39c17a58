//! What a client and a server on one host agree on without a handshake:
//! where the shared token lives by default and which user names are valid
//! (the server checks its `[users]`, the client its `--user`).

use std::path::PathBuf;

/// The login name of sessions without credentials (also the ACL entry
/// matching them).
pub const ANONYMOUS: &str = "anonymous";
/// The name the shared server token logs in as.
pub const SHARED_TOKEN_NAME: &str = "token";

/// The default token file: `$LWIO_TOKEN_FILE`, else
/// `$XDG_CONFIG_HOME/lwio/token`, else `$HOME/.config/lwio/token`.
pub fn default_token_file() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("LWIO_TOKEN_FILE").filter(|p| !p.is_empty()) {
        return Some(PathBuf::from(p));
    }
    if let Some(x) = std::env::var_os("XDG_CONFIG_HOME").filter(|p| !p.is_empty()) {
        return Some(PathBuf::from(x).join("lwio/token"));
    }
    std::env::var_os("HOME")
        .filter(|p| !p.is_empty())
        .map(|h| PathBuf::from(h).join(".config/lwio/token"))
}

/// User names: 1-64 characters of `[A-Za-z0-9._@-]`, not a reserved name.
pub fn validate_user_name(name: &str) -> Result<(), String> {
    if name.is_empty()
        || name.len() > 64
        || !name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._@-".contains(&b))
    {
        return Err(format!(
            "invalid user name {name:?}: use 1-64 characters of A-Z a-z 0-9 . _ @ -"
        ));
    }
    if name == ANONYMOUS || name == SHARED_TOKEN_NAME {
        return Err(format!("user name {name:?} is reserved"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn user_names() {
        assert!(validate_user_name("alice.b-2@x").is_ok());
        for bad in ["", "anonymous", "token", "a b", "a/b", &"x".repeat(65)] {
            assert!(validate_user_name(bad).is_err(), "{bad:?}");
        }
    }
}
