//! The README's client-library example: write and read back a file over LWIO.
//!
//! `LWIO_TOKEN=… LWIO_FINGERPRINT=sha256:… cargo run --example quickstart -- lwio://storage1/data`
//!
//! The login and TLS are the `lwio` CLI's defaults (`lwio_client::connect`):
//! `LWIO_TOKEN` (else the default token file), `LWIO_FINGERPRINT` (else
//! trust on first use in known_hosts).
use lwio_client::{Client, ClientOptions, Completion, OpenOptions};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "lwio://127.0.0.1/data".into());
    let opts = ClientOptions {
        completion: Completion::Poll,
        ..Default::default()
    };
    let client = Client::connect(&url, None, opts)?;
    let file = client.open("hello.txt", &OpenOptions::read_write().create(true))?;
    file.write_at(b"hello, lwio", 4096)?;
    let mut buf = [0u8; 11];
    file.read_at(&mut buf, 4096)?;
    assert_eq!(&buf, b"hello, lwio");
    file.close()?;
    Ok(())
}
