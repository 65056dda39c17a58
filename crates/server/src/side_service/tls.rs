//! The server's TLS identity: a certificate chain and key from PEM files,
//! or a self-signed certificate created on first start (the client side of
//! the side channel's TLS is in `lwio_side::tls`).

use std::path::Path;
use std::sync::Arc;

use lwio_side::error::{Error, Result};
use lwio_side::tls::{fingerprint, provider, tls_err, SELF_SIGNED_CERT, SELF_SIGNED_KEY};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::ServerConfig;

/// A server's TLS configuration and the fingerprint of its certificate.
#[derive(Clone)]
pub struct ServerIdentity {
    pub config: Arc<ServerConfig>,
    /// `sha256:…` of the end-entity certificate.
    pub fingerprint: String,
}

impl std::fmt::Debug for ServerIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ServerIdentity({})", self.fingerprint)
    }
}

impl ServerIdentity {
    /// From PEM data: a certificate chain (end entity first) and its key.
    pub fn from_pem(cert_pem: &[u8], key_pem: &[u8], what: &str) -> Result<ServerIdentity> {
        let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(cert_pem)
            .collect::<std::result::Result<_, _>>()
            .map_err(|e| tls_err(format!("{what}: certificate: {e}")))?;
        let Some(first) = certs.first() else {
            return Err(tls_err(format!("{what}: no certificate in the PEM data")));
        };
        let fp = fingerprint(first);
        let key = PrivateKeyDer::from_pem_slice(key_pem)
            .map_err(|e| tls_err(format!("{what}: private key: {e}")))?;
        let config = ServerConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| tls_err(format!("{what}: {e}")))?
            .with_no_client_auth()
            .with_single_cert(certs, key)
            .map_err(|e| tls_err(format!("{what}: {e}")))?;
        Ok(ServerIdentity {
            config: Arc::new(config),
            fingerprint: fp,
        })
    }

    /// From PEM files.
    pub fn load(cert: &Path, key: &Path) -> Result<ServerIdentity> {
        let c = std::fs::read(cert)
            .map_err(|e| Error::from_io(&e, format!("TLS certificate {}", cert.display())))?;
        let k = std::fs::read(key)
            .map_err(|e| Error::from_io(&e, format!("TLS key {}", key.display())))?;
        ServerIdentity::from_pem(
            &c,
            &k,
            &format!("TLS certificate {} / key {}", cert.display(), key.display()),
        )
    }

    /// The self-signed identity in `dir` (`tls-cert.pem`, `tls-key.pem`),
    /// created for `names` if missing. Returns whether it was created.
    pub fn self_signed(dir: &Path, names: &[String]) -> Result<(ServerIdentity, bool)> {
        use std::io::Write;
        use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
        let cert = dir.join(SELF_SIGNED_CERT);
        let key = dir.join(SELF_SIGNED_KEY);
        if cert.exists() && key.exists() {
            if let Ok(m) = std::fs::metadata(&key) {
                if m.permissions().mode() & 0o077 != 0 {
                    tracing::warn!(path = %key.display(), "TLS key is readable by group or others; consider chmod 600");
                }
            }
            return Ok((ServerIdentity::load(&cert, &key)?, false));
        }
        if !dir.as_os_str().is_empty() && !dir.exists() {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .map_err(|e| Error::from_io(&e, format!("directory {}", dir.display())))?;
        }
        let ck = rcgen::generate_simple_self_signed(names.to_vec())
            .map_err(|e| tls_err(format!("generating a self-signed certificate: {e}")))?;
        let cert_pem = ck.cert.pem();
        let key_pem = ck.key_pair.serialize_pem();
        let write = |p: &Path, data: &str, mode: u32| -> Result<()> {
            let tmp = p.with_extension("tmp");
            let _ = std::fs::remove_file(&tmp);
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(mode)
                .open(&tmp)
                .map_err(|e| Error::from_io(&e, format!("{}", tmp.display())))?;
            f.write_all(data.as_bytes())
                .and_then(|_| f.sync_all())
                .and_then(|_| std::fs::rename(&tmp, p))
                .map_err(|e| Error::from_io(&e, format!("{}", p.display())))
        };
        write(&key, &key_pem, 0o600)?;
        write(&cert, &cert_pem, 0o644)?;
        Ok((
            ServerIdentity::from_pem(cert_pem.as_bytes(), key_pem.as_bytes(), "self-signed")?,
            true,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn self_signed_created_once_with_private_key() {
        use std::os::unix::fs::PermissionsExt;
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().join("conf");
        let names = vec!["localhost".to_string(), "127.0.0.1".to_string()];
        let (a, created) = ServerIdentity::self_signed(&dir, &names).unwrap();
        assert!(created);
        let mode = std::fs::metadata(dir.join(SELF_SIGNED_KEY))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        let (b, created) = ServerIdentity::self_signed(&dir, &names).unwrap();
        assert!(!created);
        assert_eq!(a.fingerprint, b.fingerprint, "reused, not regenerated");
    }
}
