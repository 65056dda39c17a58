#![no_main]
//! The side channel's server after login: a hostile logged-in user, not only
//! the codec. One in-process server (the real `ServerState`, one read-write
//! export in a temporary directory, token login) serves each input on a
//! fresh connection (`serve_connection` over an in-memory stream): Hello,
//! Login with the token, then the input as a sequence of requests, each
//! `[u16 LE length][request body]` (a body that does not decode is skipped,
//! so the session goes on; WatchBreaks, which keeps the stream, is skipped
//! too). The server must never panic (a panic in its task is re-raised
//! here) and must answer each request it is sent within a bound.
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use lwio_server::config::{IoConfig, Limits, ProviderChoice};
use lwio_server::fs::{ExportSpec, ResolveMode};
use lwio_server::state::AuthPolicy;
use lwio_server::{Server, ServerOptions, ServerState, Shutdown};
use lwio_side::auth;
use lwio_side::codec::{
    read_frame, write_frame, LoginRequest, Request, Response, PROTOCOL_VERSION,
};
use lwio_side::Token;

const TOKEN: &str = "side-dispatch-fuzz-token-0123456789";

struct Env {
    rt: tokio::runtime::Runtime,
    state: Arc<ServerState>,
    /// Kept (never run: connections come in memory), not leaked.
    _server: std::sync::Mutex<Server>,
    _dir: tempfile::TempDir,
}

fn env() -> &'static Env {
    static ENV: OnceLock<Env> = OnceLock::new();
    ENV.get_or_init(|| {
        let dir = tempfile::tempdir().expect("temporary directory");
        std::fs::write(dir.path().join("f"), b"0123456789").expect("seed file");
        std::fs::create_dir(dir.path().join("d")).expect("seed directory");
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime");
        let opts = ServerOptions {
            listen: "127.0.0.1:0".into(),
            server_name: "fuzz".into(),
            exports: vec![ExportSpec {
                name: "ex".into(),
                path: dir.path().to_path_buf(),
                read_only: false,
                allow_hardlinks: false,
                ..Default::default()
            }],
            auth: AuthPolicy {
                token: Some(Token::new(TOKEN).expect("token")),
                allow_anonymous: false,
            },
            limits: Limits::default(),
            io: IoConfig::default(),
            provider: ProviderChoice::Soft,
            resolve: ResolveMode::Auto,
        };
        let server = rt.block_on(Server::bind(opts)).expect("server");
        let state = server.state().clone();
        Env {
            rt,
            state,
            _server: std::sync::Mutex::new(server),
            _dir: dir,
        }
    })
}

/// Send one request and wait for its answer; false when the session ended.
async fn call<S>(s: &mut S, id: u32, req: &Request) -> bool
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    if write_frame(s, &req.encode(id)).await.is_err() {
        return false;
    }
    match tokio::time::timeout(Duration::from_secs(5), read_frame(s, 1 << 24)).await {
        Ok(Ok(Some(b))) => Response::decode(&b).is_ok(),
        Ok(_) => false,
        Err(_) => panic!("request {req:?} not answered in 5 s"),
    }
}

fuzz_target!(|data: &[u8]| {
    let e = env();
    let state = e.state.clone();
    let data = data.to_vec();
    e.rt.block_on(async move {
        let (mut c, s) = tokio::io::duplex(1 << 20);
        let peer = "127.0.0.1:9".parse().expect("address");
        let server = tokio::spawn(lwio_server::side_service::serve_connection(
            state,
            s,
            peer,
            Shutdown::new(),
        ));
        let hello = Request::Hello {
            version: PROTOCOL_VERSION,
            client_name: "fuzz".into(),
        };
        write_frame(&mut c, &hello.encode(1)).await.expect("hello");
        let b = read_frame(&mut c, 1 << 24).await.expect("hello answer").expect("answer");
        let Ok((_, Response::Hello { server_nonce, .. })) = Response::decode(&b) else {
            panic!("no Hello answer");
        };
        let cn = auth::nonce();
        let t = Token::new(TOKEN).expect("token");
        let login = Request::Login(LoginRequest::Token {
            client_nonce: cn,
            proof: auth::client_proof(&t, &server_nonce, &cn),
        });
        write_frame(&mut c, &login.encode(2)).await.expect("login");
        let b = read_frame(&mut c, 1 << 24).await.expect("login answer").expect("answer");
        assert!(
            matches!(Response::decode(&b), Ok((_, Response::LoginOk { .. }))),
            "token login refused"
        );
        let mut rest = &data[..];
        let mut id = 3u32;
        while rest.len() >= 2 {
            let n = usize::from(u16::from_le_bytes([rest[0], rest[1]])).min(rest.len() - 2);
            let body = &rest[2..2 + n];
            rest = &rest[2 + n..];
            let Ok((_, _creds, req)) = Request::decode_as(body) else {
                continue;
            };
            if matches!(req, Request::WatchBreaks { .. } | Request::Bye) {
                continue;
            }
            if !call(&mut c, id, &req).await {
                break;
            }
            id = id.wrapping_add(1);
        }
        drop(c);
        if let Err(e) = server.await {
            if e.is_panic() {
                std::panic::resume_unwind(e.into_panic());
            }
        }
    });
});
