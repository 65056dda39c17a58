//! TLS 1.3 for the side channel (rustls with the `ring` provider; TLS 1.2 and
//! older are not compiled in).
//!
//! * Server: a certificate chain + key from PEM files, or a self-signed
//!   certificate created on first start and kept beside the token file
//!   (`tls-cert.pem`, `tls-key.pem` mode 0600). Its SHA-256 fingerprint is
//!   printed at start (`sha256:AB:CD:…`).
//! * Client ([`ClientTls`]): the system roots, a CA file, a pinned
//!   fingerprint, or (explicitly) no verification at all.
//! * Mismatched ends fail fast with one clear line: the server looks at the
//!   first two bytes (`16 03` = a TLS record) and answers a plain client
//!   with a plain error frame; a TLS client that receives a plain lwio frame
//!   reports that the server does not use TLS.

use std::io;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{ClientConfig, DigitallySignedStruct, SignatureScheme};
use sha2::{Digest, Sha256};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

use crate::codec::{Response, BODY_HEADER_LEN};
use crate::error::{Error, ErrorCode, Result};

/// File names of the self-signed identity, beside the token file.
pub const SELF_SIGNED_CERT: &str = "tls-cert.pem";
pub const SELF_SIGNED_KEY: &str = "tls-key.pem";

/// The crypto provider (ring).
pub fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

pub fn tls_err(what: impl std::fmt::Display) -> Error {
    Error::new(ErrorCode::InvalidArgument, what.to_string())
}

/// `sha256:AB:CD:…` of a DER certificate.
pub fn fingerprint(der: &[u8]) -> String {
    let d = Sha256::digest(der);
    let hex: Vec<String> = d.iter().map(|b| format!("{b:02X}")).collect();
    format!("sha256:{}", hex.join(":"))
}

/// `sha256:AB:CD:…` of a SHA-256 digest.
pub fn fingerprint_of_digest(d: &[u8; 32]) -> String {
    fingerprint_hex(d)
}

/// Parse a fingerprint: optional `sha256:` prefix, 64 hex digits, colons
/// optional, any case.
pub fn parse_fingerprint(s: &str) -> Result<[u8; 32]> {
    let t = s.trim();
    let t = if t.len() >= 7 && t[..7].eq_ignore_ascii_case("sha256:") {
        &t[7..]
    } else {
        t
    };
    let hex: String = t.chars().filter(|c| *c != ':').collect();
    let bad = || {
        tls_err(format!(
            "invalid fingerprint {s:?}: expected sha256: and 64 hex digits (as printed by `lwio serve`)"
        ))
    };
    if hex.len() != 64 || !hex.is_ascii() {
        return Err(bad());
    }
    let mut out = [0u8; 32];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).map_err(|_| bad())?;
    }
    Ok(out)
}

/// How a client secures the side channel.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum ClientTls {
    /// Plain TCP (the server must be configured with `tls = false`).
    #[default]
    Off,
    /// TLS, certificate verified against the system's root certificates.
    SystemRoots,
    /// TLS, certificate verified against the CA certificates in this PEM file.
    CaFile(PathBuf),
    /// TLS, the server's certificate must have this SHA-256 fingerprint
    /// (names and dates are not checked: the pin is the identity).
    Fingerprint([u8; 32]),
    /// TLS without verifying the server (encrypts, but does not stop an
    /// active attacker). Logs a warning.
    Insecure,
    /// TLS, trust on first use as ssh does (crate::known_hosts): a server
    /// recorded in `file` must show the recorded fingerprint; an unknown one
    /// is accepted if the system roots verify it, else recorded (and
    /// announced on stderr) unless `strict`, which refuses it.
    KnownHosts { file: PathBuf, strict: bool },
}

impl ClientTls {
    pub fn is_tls(&self) -> bool {
        !matches!(self, ClientTls::Off)
    }
}

/// Shared slot where our verifiers leave a human explanation of a refusal.
type Why = Arc<Mutex<Option<String>>>;

#[derive(Debug)]
struct PinVerifier {
    pin: Option<[u8; 32]>,
    provider: Arc<CryptoProvider>,
    why: Why,
    tofu: Option<Tofu>,
}

/// Trust-on-first-use state of one connection.
#[derive(Debug)]
struct Tofu {
    file: PathBuf,
    host: String,
    strict: bool,
    /// The known_hosts line of the pin, when there is one.
    line: Option<usize>,
    /// The system roots, to accept a certificate a real CA signed.
    webpki: Option<Arc<rustls::client::WebPkiServerVerifier>>,
    /// A fingerprint to record once the handshake has succeeded.
    seen: Arc<Mutex<Option<[u8; 32]>>>,
}

impl ServerCertVerifier for PinVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> std::result::Result<ServerCertVerified, rustls::Error> {
        let got: [u8; 32] = Sha256::digest(end_entity.as_ref()).into();
        let Some(pin) = self.pin else {
            let Some(t) = &self.tofu else {
                return Ok(ServerCertVerified::assertion()); // --insecure
            };
            // Unknown host: a certificate the system roots verify needs no
            // record; otherwise trust it on first use (not in strict mode).
            if let Some(w) = &t.webpki {
                if w.verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)
                    .is_ok()
                {
                    return Ok(ServerCertVerified::assertion());
                }
            }
            if t.strict {
                let msg = format!(
                    "TLS: {} is not in {} and strict host key checking is on; its certificate fingerprint is {} (check it with the server's `lwio serve` output, then connect once with --fingerprint {} or add the line \"{} {}\")",
                    t.host,
                    t.file.display(),
                    fingerprint_hex(&got),
                    fingerprint_hex(&got),
                    t.host,
                    fingerprint_hex(&got)
                );
                *self.why.lock().unwrap_or_else(|p| p.into_inner()) = Some(msg.clone());
                return Err(rustls::Error::General(msg));
            }
            *t.seen.lock().unwrap_or_else(|p| p.into_inner()) = Some(got);
            return Ok(ServerCertVerified::assertion());
        };
        if got == pin {
            return Ok(ServerCertVerified::assertion());
        }
        let msg = match &self.tofu {
            Some(t) => format!(
                "TLS: the certificate of {} HAS CHANGED: it is now {}, but {} line {} records {}; someone may be impersonating the server, or its certificate was replaced: if you trust the new one, delete that line and connect again",
                t.host,
                fingerprint_hex(&got),
                t.file.display(),
                t.line.unwrap_or(0),
                fingerprint_hex(&pin)
            ),
            None => format!(
                "TLS: the server's certificate fingerprint {} does not match the pinned {}; refusing to connect",
                fingerprint(end_entity.as_ref()),
                fingerprint_hex(&pin)
            ),
        };
        *self.why.lock().unwrap_or_else(|p| p.into_inner()) = Some(msg.clone());
        Err(rustls::Error::General(msg))
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

fn fingerprint_hex(d: &[u8; 32]) -> String {
    let hex: Vec<String> = d.iter().map(|b| format!("{b:02X}")).collect();
    format!("sha256:{}", hex.join(":"))
}

fn client_config(tls: &ClientTls, why: &Why, tofu: Option<Tofu>) -> Result<Arc<ClientConfig>> {
    let p = provider();
    let b = ClientConfig::builder_with_provider(p.clone())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(tls_err)?;
    let cfg = match tls {
        ClientTls::Off => return Err(tls_err("TLS is off")),
        ClientTls::SystemRoots | ClientTls::CaFile(_) => {
            let mut roots = rustls::RootCertStore::empty();
            if let ClientTls::CaFile(path) = tls {
                let pem = std::fs::read(path)
                    .map_err(|e| Error::from_io(&e, format!("CA file {}", path.display())))?;
                let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&pem)
                    .collect::<std::result::Result<_, _>>()
                    .map_err(|e| tls_err(format!("CA file {}: {e}", path.display())))?;
                let (added, _) = roots.add_parsable_certificates(certs);
                if added == 0 {
                    return Err(tls_err(format!(
                        "CA file {}: no usable certificate",
                        path.display()
                    )));
                }
            } else {
                let found = rustls_native_certs::load_native_certs();
                roots.add_parsable_certificates(found.certs);
                if roots.is_empty() {
                    return Err(tls_err(
                        "no system root certificates found: use --ca FILE or --fingerprint sha256:… (printed by `lwio serve`)",
                    ));
                }
            }
            b.with_root_certificates(roots).with_no_client_auth()
        }
        ClientTls::Fingerprint(pin) => b
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(PinVerifier {
                pin: Some(*pin),
                provider: p,
                why: why.clone(),
                tofu: None,
            }))
            .with_no_client_auth(),
        ClientTls::Insecure => b
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(PinVerifier {
                pin: None,
                provider: p,
                why: why.clone(),
                tofu: None,
            }))
            .with_no_client_auth(),
        ClientTls::KnownHosts { .. } => {
            let mut t = tofu.ok_or_else(|| tls_err("known_hosts state missing"))?;
            let pin = match t.line {
                Some(_) => *t.seen.lock().unwrap_or_else(|e| e.into_inner()),
                None => None,
            };
            *t.seen.lock().unwrap_or_else(|e| e.into_inner()) = None;
            if pin.is_none() {
                let mut roots = rustls::RootCertStore::empty();
                roots.add_parsable_certificates(rustls_native_certs::load_native_certs().certs);
                if !roots.is_empty() {
                    t.webpki = rustls::client::WebPkiServerVerifier::builder_with_provider(
                        Arc::new(roots),
                        p.clone(),
                    )
                    .build()
                    .ok();
                }
            }
            b.dangerous()
                .with_custom_certificate_verifier(Arc::new(PinVerifier {
                    pin,
                    provider: p,
                    why: why.clone(),
                    tofu: Some(t),
                }))
                .with_no_client_auth()
        }
    };
    Ok(Arc::new(cfg))
}

/// Records the first bytes read from the server, to explain a failed
/// handshake (e.g. the server answered in plain lwio framing).
#[derive(Debug)]
pub struct Sniff<S> {
    inner: S,
    seen: Arc<Mutex<Vec<u8>>>,
}

const SNIFF_CAP: usize = 512;

impl<S: AsyncRead + Unpin> AsyncRead for Sniff<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let me = self.get_mut();
        let before = buf.filled().len();
        let r = Pin::new(&mut me.inner).poll_read(cx, buf);
        if let Poll::Ready(Ok(())) = &r {
            let mut seen = me.seen.lock().unwrap_or_else(|p| p.into_inner());
            if seen.len() < SNIFF_CAP {
                let new = &buf.filled()[before..];
                let n = new.len().min(SNIFF_CAP - seen.len());
                seen.extend_from_slice(&new[..n]);
            }
        }
        r
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Sniff<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

/// A side-channel connection: plain TCP or TLS over TCP.
#[derive(Debug)]
pub enum SideStream {
    Plain(TcpStream),
    Tls(Box<tokio_rustls::client::TlsStream<Sniff<TcpStream>>>),
}

impl SideStream {
    pub fn is_tls(&self) -> bool {
        matches!(self, SideStream::Tls(_))
    }

    /// The connection's `tls-exporter` value (RFC 9266) that binds the
    /// login to it (`crate::auth::bind_nonce`); `None` over plain TCP.
    pub fn channel_binding(&self) -> Option<[u8; crate::auth::BINDING_LEN]> {
        match self {
            SideStream::Plain(_) => None,
            SideStream::Tls(s) => exporter(s.get_ref().1),
        }
    }
}

/// The RFC 9266 exporter value of a TLS connection whose handshake is done
/// (`None` only if rustls refuses to export, which it does before the
/// handshake completes).
pub fn exporter<D>(conn: &rustls::ConnectionCommon<D>) -> Option<[u8; crate::auth::BINDING_LEN]> {
    conn.export_keying_material(
        [0u8; crate::auth::BINDING_LEN],
        crate::auth::EXPORTER_LABEL,
        None,
    )
    .ok()
}

impl AsyncRead for SideStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            SideStream::Plain(s) => Pin::new(s).poll_read(cx, buf),
            SideStream::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for SideStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            SideStream::Plain(s) => Pin::new(s).poll_write(cx, buf),
            SideStream::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            SideStream::Plain(s) => Pin::new(s).poll_flush(cx),
            SideStream::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            SideStream::Plain(s) => Pin::new(s).poll_shutdown(cx),
            SideStream::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}

/// If `b` starts with an lwio Error frame, the error.
pub fn plain_error_in(b: &[u8]) -> Option<Error> {
    let len = u32::from_le_bytes(b.get(..4)?.try_into().ok()?) as usize;
    if len < BODY_HEADER_LEN || b.len() < 4 + len {
        return None;
    }
    match Response::decode(&b[4..4 + len]).ok()?.1 {
        Response::Error(e) => Some(e),
        _ => None,
    }
}

/// The host part of `host:port` / `[v6]:port`, for SNI and name checks.
pub fn host_of(addr: &str) -> &str {
    let h = match addr.rsplit_once(':') {
        Some((h, p)) if p.chars().all(|c| c.is_ascii_digit()) => h,
        _ => addr,
    };
    h.trim_start_matches('[').trim_end_matches(']')
}

/// Run the TLS handshake as a client over `tcp`.
pub async fn connect(
    tcp: TcpStream,
    addr: &str,
    tls: &ClientTls,
    timeout: Duration,
) -> Result<SideStream> {
    if !tls.is_tls() {
        return Ok(SideStream::Plain(tcp));
    }
    if *tls == ClientTls::Insecure {
        tracing::warn!(
            server = addr,
            "--insecure: the server's TLS certificate is NOT verified; an active attacker can impersonate it"
        );
    }
    let why: Why = Arc::default();
    // Trust on first use: the recorded fingerprint, if any, is the pin
    // (handed to client_config through `seen`).
    let seen: Arc<Mutex<Option<[u8; 32]>>> = Arc::default();
    let tofu = match tls {
        ClientTls::KnownHosts { file, strict } => {
            let known = crate::known_hosts::lookup(file, addr)?;
            *seen.lock().unwrap_or_else(|p| p.into_inner()) = known.as_ref().map(|k| k.fingerprint);
            Some(Tofu {
                file: file.clone(),
                host: addr.to_string(),
                strict: *strict,
                line: known.map(|k| k.line),
                webpki: None,
                seen: seen.clone(),
            })
        }
        _ => None,
    };
    let cfg = client_config(tls, &why, tofu)?;
    let host = host_of(addr).to_string();
    let name = ServerName::try_from(host.clone()).map_err(|_| {
        tls_err(format!(
            "{host:?} is not a valid TLS server name (DNS name or IP address)"
        ))
    })?;
    let sniffed = Arc::new(Mutex::new(Vec::new()));
    let sniff = Sniff {
        inner: tcp,
        seen: sniffed.clone(),
    };
    let connector = tokio_rustls::TlsConnector::from(cfg);
    let r = tokio::time::timeout(timeout, connector.connect(name, sniff)).await;
    let e = match r {
        Ok(Ok(s)) => {
            // The handshake proved the key: now record a first-use host.
            let first = seen.lock().unwrap_or_else(|p| p.into_inner()).take();
            if let (ClientTls::KnownHosts { file, .. }, Some(fp)) = (tls, first) {
                crate::known_hosts::record(file, addr, &fp)?;
                eprintln!(
                    "lwio: trusting {addr} on first use: {} (recorded in {})",
                    fingerprint_hex(&fp),
                    file.display()
                );
            }
            return Ok(SideStream::Tls(Box::new(s)));
        }
        Ok(Err(e)) => e,
        Err(_) => {
            return Err(Error::new(
                ErrorCode::TimedOut,
                format!("TLS handshake with {addr} timed out after {timeout:?}"),
            ))
        }
    };
    if let Some(m) = why.lock().unwrap_or_else(|p| p.into_inner()).take() {
        return Err(Error::new(ErrorCode::AuthFailed, m));
    }
    let sniffed = sniffed.lock().unwrap_or_else(|p| p.into_inner()).clone();
    if let Some(pe) = plain_error_in(&sniffed) {
        if pe.code == ErrorCode::Busy {
            return Err(pe);
        }
        return Err(Error::new(
            ErrorCode::ConnectFailed,
            format!(
                "{addr} did not speak TLS; it answered in plain TCP: {}",
                pe.message
            ),
        ));
    }
    let rustls_err = e
        .get_ref()
        .and_then(|i| i.downcast_ref::<rustls::Error>())
        .cloned();
    Err(match rustls_err {
        Some(rustls::Error::InvalidCertificate(c)) => Error::new(
            ErrorCode::AuthFailed,
            format!(
                "TLS: cannot verify the certificate of {addr}: {c:?} (use --ca FILE, or pin it with --fingerprint sha256:… as printed by `lwio serve`)"
            ),
        ),
        _ => Error::new(
            ErrorCode::ConnectFailed,
            format!("TLS handshake with {addr} failed: {e}"),
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fingerprints() {
        let fp = fingerprint(b"abc");
        assert!(fp.starts_with("sha256:BA:78:16:BF"), "{fp}");
        assert_eq!(fp.len(), 7 + 32 * 3 - 1);
        let d = parse_fingerprint(&fp).unwrap();
        assert_eq!(fingerprint_hex(&d), fp);
        let lower = fp[7..].replace(':', "").to_lowercase();
        assert_eq!(parse_fingerprint(&lower).unwrap(), d);
        assert_eq!(parse_fingerprint(&format!("SHA256:{lower}")).unwrap(), d);
        for bad in ["", "sha256:", "sha256:zz", &fp[..fp.len() - 1]] {
            assert!(parse_fingerprint(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn hosts() {
        assert_eq!(host_of("a.b:7420"), "a.b");
        assert_eq!(host_of("[::1]:7420"), "::1");
        assert_eq!(host_of("127.0.0.1:1"), "127.0.0.1");
        assert_eq!(host_of("name"), "name");
    }
}
