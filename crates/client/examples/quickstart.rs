//! The README's client-library example: write and read back a file over LWIO.
//!
//! `LWIO_TOKEN=… LWIO_FINGERPRINT=sha256:… cargo run --example quickstart -- lwio://storage1/data`
use lwio_client::side::{
    tls::parse_fingerprint, ClientOptions as SideOptions, ClientTls, Login, Token,
};
use lwio_client::{Client, ClientOptions, Completion, OpenOptions};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "lwio://127.0.0.1/data".into());
    let mut side = SideOptions::new(Login::Token(Token::new(&std::env::var("LWIO_TOKEN")?)?));
    side.tls = ClientTls::Fingerprint(parse_fingerprint(&std::env::var("LWIO_FINGERPRINT")?)?);
    let opts = ClientOptions {
        completion: Completion::Poll,
        ..Default::default()
    };
    let client = Client::connect_with(&url, &side, opts)?;
    let file = client.open("hello.txt", &OpenOptions::read_write().create(true))?;
    file.write_at(b"hello, lwio", 4096)?;
    let mut buf = [0u8; 11];
    file.read_at(&mut buf, 4096)?;
    assert_eq!(&buf, b"hello, lwio");
    file.close()?;
    Ok(())
}
