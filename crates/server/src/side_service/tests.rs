//! Side channel over a real TCP loopback server in a tempdir.

use std::sync::Arc;
use std::time::Duration;

use super::*;
use crate::config::{IoConfig, Limits, ProviderChoice};
use crate::fs::{ExportSpec, FileKind, OpenOptions, ResolveMode};
use crate::state::{AuthPolicy, Server, ServerOptions, ServerState, Shutdown};
use lwio_client::side_client::{AsyncSideClient, SideClient, SideOptions};
use lwio_side::error::ErrorCode;
use lwio_side::negotiate::NegotiateRequestRepr;
use lwio_side::{codec, Login, Token};

const TOKEN: &str = "0123456789abcdef0123456789abcdef";

struct Running {
    addr: String,
    state: Arc<ServerState>,
    stop: Shutdown,
    task: tokio::task::JoinHandle<()>,
    dir: tempfile::TempDir,
}

async fn start(limits: Limits, anonymous: bool) -> Running {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("data")).unwrap();
    std::fs::write(dir.path().join("data/hello.txt"), b"hello").unwrap();
    let opts = ServerOptions {
        listen: "127.0.0.1:0".into(),
        server_name: "stor1".into(),
        exports: vec![ExportSpec {
            name: "data".into(),
            path: dir.path().join("data"),
            read_only: false,
            allow_hardlinks: false,
            ..Default::default()
        }],
        auth: AuthPolicy {
            token: Some(Token::new(TOKEN).unwrap()),
            allow_anonymous: anonymous,
        },
        limits,
        io: IoConfig::default(),
        provider: ProviderChoice::Auto,
        resolve: ResolveMode::Auto,
    };
    let server = Server::bind(opts).await.unwrap();
    let addr = server.local_addr().unwrap().to_string();
    let state = server.state().clone();
    let stop = server.shutdown_handle();
    let task = tokio::spawn(async move { server.run().await.unwrap() });
    Running {
        addr,
        state,
        stop,
        task,
        dir,
    }
}

fn token_opts() -> SideOptions {
    SideOptions::new(Login::Token(Token::new(TOKEN).unwrap()))
}

const RW: OpenOptions = OpenOptions {
    create: true,
    ..OpenOptions::READ_WRITE
};

#[tokio::test]
async fn login_and_round_trips() {
    let s = start(Limits::default(), false).await;
    let mut c = AsyncSideClient::connect(&s.addr, &token_opts())
        .await
        .unwrap();
    assert_eq!(c.session().server_name, "stor1");
    assert!(!c.session().anonymous);
    let server_side = s.state.session(c.session().id).unwrap();
    assert_eq!(
        server_side.secret,
        c.session().secret,
        "both ends derive the same session secret"
    );

    let ex = c.list_exports().await.unwrap();
    assert_eq!(
        ex,
        vec![ExportInfo {
            name: "data".into(),
            read_only: false
        }]
    );
    let a = c.stat("data", "hello.txt").await.unwrap();
    assert_eq!((a.kind, a.size), (FileKind::File, 5));
    c.mkdir("data", "d1/d2", 0o755, true).await.unwrap();
    let l = c.list_dir("data", "").await.unwrap();
    let names: Vec<_> = l.iter().map(|e| e.name.as_str()).collect();
    assert_eq!(names, ["d1", "hello.txt"]);

    let f = c.open("data", "d1/new.bin", &RW, 0o600).await.unwrap();
    assert_eq!(f.size, 0);
    assert_eq!(f.resume_key.server_name, "stor1");
    c.set_size(f.handle, 1 << 20).await.unwrap();
    c.fsync(f.handle, false).await.unwrap();
    assert_eq!(c.stat("data", "d1/new.bin").await.unwrap().size, 1 << 20);
    // The RDMA phase finds the file by resume key, for this session only.
    let of = s
        .state
        .lookup_resume_key(&f.resume_key.key, c.session().id)
        .unwrap();
    assert_eq!(of.path, "d1/new.bin");
    assert!(s
        .state
        .lookup_resume_key(&f.resume_key.key, c.session().id + 1)
        .is_err());
    c.close(f.handle).await.unwrap();
    assert_eq!(
        c.close(f.handle).await.unwrap_err().code,
        ErrorCode::BadHandle
    );

    c.rename("data", "d1/new.bin", "moved.bin", false)
        .await
        .unwrap();
    assert_eq!(
        c.rename("data", "moved.bin", "hello.txt", false)
            .await
            .unwrap_err()
            .code,
        ErrorCode::Exists
    );
    c.remove("data", "moved.bin").await.unwrap();
    c.remove("data", "d1/d2").await.unwrap();
    c.remove("data", "d1").await.unwrap();

    // Errors come back with their codes and readable messages.
    let e = c.stat("data", "nope").await.unwrap_err();
    assert_eq!(e.code, ErrorCode::NotFound);
    assert_eq!(e.to_string(), "data/nope: No such file or directory");
    assert_eq!(std::io::Error::from(e).kind(), std::io::ErrorKind::NotFound);
    assert_eq!(
        c.stat("nope", "x").await.unwrap_err().code,
        ErrorCode::NoSuchExport
    );
    assert_eq!(
        c.stat("data", "../x").await.unwrap_err().code,
        ErrorCode::OutsideExport
    );
    assert_eq!(
        c.stat("data", "/etc").await.unwrap_err().code,
        ErrorCode::OutsideExport
    );
    assert_eq!(
        c.remove("data", "nope").await.unwrap_err().code,
        ErrorCode::NotFound
    );
    assert_eq!(
        c.mkdir("data", "hello.txt", 0o755, false)
            .await
            .unwrap_err()
            .code,
        ErrorCode::Exists
    );
    std::os::unix::fs::symlink("/etc", s.dir.path().join("data/etc")).unwrap();
    assert_eq!(
        c.list_dir("data", "etc").await.unwrap_err().code,
        ErrorCode::OutsideExport
    );
    // Still usable after errors.
    c.ping().await.unwrap();
    let id = c.session().id;
    c.bye().await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(s.state.session(id).is_none());
    s.stop.trigger();
    s.task.await.unwrap();
}

#[tokio::test]
async fn wrong_token_and_anonymous() {
    let s = start(Limits::default(), false).await;
    let bad = SideOptions::new(Login::Token(
        Token::new("ffffffffffffffffffffffffffffffff").unwrap(),
    ));
    let e = AsyncSideClient::connect(&s.addr, &bad).await.unwrap_err();
    assert_eq!(e.code, ErrorCode::AuthFailed);
    assert_eq!(e.to_string(), "authentication failed: wrong token");
    let e = AsyncSideClient::connect(&s.addr, &SideOptions::new(Login::Anonymous))
        .await
        .unwrap_err();
    assert_eq!(e.code, ErrorCode::AuthFailed);
    assert!(e.to_string().contains("requires a token"), "{e}");
    assert_eq!(s.state.session_count(), 0);
    s.stop.trigger();
    s.task.await.unwrap();

    let s = start(Limits::default(), true).await;
    let c = AsyncSideClient::connect(&s.addr, &SideOptions::new(Login::Anonymous))
        .await
        .unwrap();
    assert!(c.session().anonymous);
    s.stop.trigger();
    s.task.await.unwrap();
}

#[tokio::test]
async fn unreachable() {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    drop(l);
    let e = AsyncSideClient::connect(&addr, &token_opts())
        .await
        .unwrap_err();
    assert_eq!(e.code, ErrorCode::ConnectFailed);
    assert!(e.to_string().contains("cannot connect"), "{e}");
}

#[tokio::test]
async fn negotiate_over_the_pipe() {
    let s = start(Limits::default(), false).await;
    use lwio_proto::transport::{self, Instance, WireTransport::*};
    let i = |t, a: &str| Instance::new(t, a.parse().unwrap());
    let server = vec![i(RoceV2, "127.0.0.1:7472"), i(Iwarp, "127.0.0.1:7471")];
    s.state.set_rdma_endpoints(server.clone());
    let mut c = AsyncSideClient::connect(&s.addr, &token_opts())
        .await
        .unwrap();
    let req = NegotiateRequestRepr {
        client_name: "app".into(),
        key: negotiate::random_guid(),
        response_length: 4096,
        providers: transport::to_blocks(&[i(Iwarp, "127.0.0.1:0"), i(Infiniband, "127.0.0.1:0")]),
    };
    let r1 = c.negotiate(&req).await.unwrap();
    assert_eq!(r1.server_name, "stor1");
    assert_eq!(transport::from_blocks(&r1.providers), vec![server[1]]);
    let r2 = c.negotiate(&req).await.unwrap();
    assert_ne!(r1.key, r2.key, "a fresh Key per negotiate");
    let n = s.state.lookup_negotiate_key(&r1.key).unwrap();
    assert_eq!(n.session, c.session().id);
    assert_eq!(n.session_secret, c.session().secret);
    assert_eq!(n.client_key, req.key);
    assert_eq!(n.offered, vec![server[1]]);
    // An InfiniBand-only client: refused in one line naming both sides.
    let ib_only = NegotiateRequestRepr {
        providers: transport::to_blocks(&[i(Infiniband, "127.0.0.1:0")]),
        ..req.clone()
    };
    let e = c.negotiate(&ib_only).await.unwrap_err();
    assert_eq!(e.code, ErrorCode::Unsupported);
    assert_eq!(
        e.message,
        "no RDMA transport in common: the client offers InfiniBand, the server offers RoCEv2 at 127.0.0.1:7472, iWARP at 127.0.0.1:7471"
    );
    // Garbage on the pipe is a clean error.
    let e = c
        .call(codec::Request::Negotiate {
            request: vec![1, 2, 3],
        })
        .await
        .unwrap_err();
    assert_eq!(e.code, ErrorCode::BadRequest);
    c.bye().await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        s.state.lookup_negotiate_key(&r1.key).is_none(),
        "gone with its session"
    );
    s.stop.trigger();
    s.task.await.unwrap();
}

#[tokio::test]
async fn limits_enforced() {
    let limits = Limits {
        max_sessions: 1,
        max_open_files_per_session: 2,
        idle_timeout: Duration::from_millis(300),
        // No durable handles: the idle session's files close with it.
        durable_grace: Duration::ZERO,
        max_frame: 4096,
        ..Limits::default()
    };
    let s = start(limits, false).await;
    let mut c = AsyncSideClient::connect(&s.addr, &token_opts())
        .await
        .unwrap();
    // Second session refused while the first is open.
    let e = AsyncSideClient::connect(&s.addr, &token_opts())
        .await
        .unwrap_err();
    assert_eq!(e.code, ErrorCode::Busy, "{e}");
    c.open("data", "a", &RW, 0o600).await.unwrap();
    c.open("data", "b", &RW, 0o600).await.unwrap();
    assert_eq!(
        c.open("data", "c", &RW, 0o600).await.unwrap_err().code,
        ErrorCode::TooManyOpenFiles
    );
    // Listings page under a small frame limit.
    for i in 0..300 {
        std::fs::write(
            s.dir
                .path()
                .join(format!("data/file-with-a-longish-name-{i:04}")),
            b"",
        )
        .unwrap();
    }
    let l = c.list_dir("data", "").await.unwrap();
    assert_eq!(l.len(), 303);
    // A frame over the limit is refused (by the client, which learnt the
    // server's limit in Hello).
    let big = "x".repeat(5000);
    let e = c.stat("data", &big).await.unwrap_err();
    assert_eq!(e.code, ErrorCode::FrameTooLarge, "{e}");
    // Idle timeout closes sessions and their files.
    drop(c);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut c = AsyncSideClient::connect(&s.addr, &token_opts())
        .await
        .unwrap();
    c.open("data", "a", &RW, 0o600).await.unwrap();
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert!(c.ping().await.is_err());
    assert_eq!(s.state.open_files.len(), 0);
    s.stop.trigger();
    s.task.await.unwrap();
}

#[tokio::test]
async fn garbage_and_graceful_shutdown() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let s = start(Limits::default(), false).await;
    // Not an lwio client: the server answers with an error and closes.
    let mut raw = tokio::net::TcpStream::connect(&s.addr).await.unwrap();
    raw.write_all(b"\x05\x00\x00\x00hello").await.unwrap();
    let mut buf = Vec::new();
    raw.read_to_end(&mut buf).await.unwrap();
    assert!(buf.len() > 4);
    // A request before Hello.
    let mut raw = tokio::net::TcpStream::connect(&s.addr).await.unwrap();
    codec::write_frame(&mut raw, &codec::Request::ListExports.encode(1))
        .await
        .unwrap();
    let b = codec::read_frame(&mut raw, 1 << 20).await.unwrap().unwrap();
    match codec::Response::decode(&b).unwrap().1 {
        codec::Response::Error(e) => assert_eq!(e.code, ErrorCode::BadRequest),
        r => panic!("{r:?}"),
    }
    // A frame over the server's limit: refused before its body is read.
    let mut raw = tokio::net::TcpStream::connect(&s.addr).await.unwrap();
    raw.write_all(&(64u32 << 20).to_le_bytes()).await.unwrap();
    let b = codec::read_frame(&mut raw, 1 << 20).await.unwrap().unwrap();
    match codec::Response::decode(&b).unwrap().1 {
        codec::Response::Error(e) => assert_eq!(e.code, ErrorCode::FrameTooLarge),
        r => panic!("{r:?}"),
    }
    // Shutdown closes idle sessions promptly.
    let mut c = AsyncSideClient::connect(&s.addr, &token_opts())
        .await
        .unwrap();
    s.stop.trigger();
    tokio::time::timeout(Duration::from_secs(5), s.task)
        .await
        .unwrap()
        .unwrap();
    assert!(c.ping().await.is_err());
    assert!(
        tokio::net::TcpStream::connect(&s.addr).await.is_err(),
        "no longer accepting"
    );
}

#[test]
fn blocking_client() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let s = rt.block_on(start(Limits::default(), false));
    let addr = s.addr.clone();
    let j = std::thread::spawn(move || {
        let mut c = SideClient::connect(&addr, &token_opts()).unwrap();
        assert_eq!(c.stat("data", "hello.txt").unwrap().size, 5);
        let f = c
            .open(
                "data",
                "hello.txt",
                &OpenOptions {
                    read: true,
                    ..OpenOptions::default()
                },
                0,
            )
            .unwrap();
        assert_eq!(f.size, 5);
        c.close(f.handle).unwrap();
        c.bye().unwrap();
    });
    j.join().unwrap();
    s.stop.trigger();
    rt.block_on(s.task).unwrap();
}

#[tokio::test]
async fn hard_linked_file_is_refused_over_the_side_channel() {
    let s = start(Limits::default(), false).await;
    let outside = s.dir.path().join("outside-secret");
    std::fs::write(&outside, b"secret").unwrap();
    if std::fs::hard_link(&outside, s.dir.path().join("data/hl")).is_err() {
        crate::io_phase::testkit::skip("cannot create hard links here");
        return;
    }
    let mut c = AsyncSideClient::connect(&s.addr, &token_opts())
        .await
        .unwrap();
    // Stat, then open: the open is refused with permission denied.
    assert_eq!(c.stat("data", "hl").await.unwrap().size, 6);
    let ro = OpenOptions {
        write: false,
        create: false,
        ..RW
    };
    let e = c.open("data", "hl", &ro, 0).await.unwrap_err();
    assert_eq!(e.code, ErrorCode::PermissionDenied, "{e}");
    assert_eq!(
        std::io::Error::from(e.clone()).kind(),
        std::io::ErrorKind::PermissionDenied
    );
    assert!(
        e.to_string()
            .contains("data/hl is hard-linked (2 links); refused: set allow_hardlinks"),
        "{e}"
    );
    // The session goes on; single-link files still open.
    c.open("data", "hello.txt", &ro, 0).await.unwrap();
    s.stop.trigger();
    let _ = s.task.await;
}

#[tokio::test]
async fn leases_over_the_wire_watch_grant_break_and_ack() {
    let s = start(Limits::default(), true).await;
    let mut a = AsyncSideClient::connect(&s.addr, &token_opts())
        .await
        .unwrap();
    let mut b = AsyncSideClient::connect(&s.addr, &token_opts())
        .await
        .unwrap();
    std::fs::create_dir(s.dir.path().join("data/d")).unwrap();
    // No watching connection: no lease.
    assert_eq!(a.lease_dir("data", "d", 3).await.unwrap(), (0, 0));

    // A watch needs the proof of the session's secret, and the same user.
    let mut w = AsyncSideClient::connect(&s.addr, &token_opts())
        .await
        .unwrap();
    let mut forged = a.session().clone();
    forged.secret = lwio_side::SessionSecret([9; 32]);
    let e = w.watch(&forged).await.unwrap_err();
    assert_eq!(e.code, ErrorCode::PermissionDenied);
    let mut anon = AsyncSideClient::connect(&s.addr, &SideOptions::new(Login::Anonymous))
        .await
        .unwrap();
    let e = anon.watch(a.session()).await.unwrap_err();
    assert_eq!(e.code, ErrorCode::PermissionDenied, "another user");
    // Refused watches leave the connection usable; a right one turns it.
    w.watch(a.session()).await.unwrap();

    let (id, granted) = a.lease_dir("data", "d/", 3).await.unwrap();
    assert!(id != 0 && granted == 3);
    // A's own change does not break A's lease.
    a.mkdir("data", "d/mine", 0o755, false).await.unwrap();
    // B's change does: B's mkdir completes only after A's watcher acked.
    let acker = tokio::spawn(async move {
        let got = w.next_break().await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        w.ack_break(got.0).await.unwrap();
        (got, w)
    });
    let t = std::time::Instant::now();
    b.mkdir("data", "d/theirs", 0o755, false).await.unwrap();
    assert!(
        t.elapsed() >= Duration::from_millis(100),
        "{:?}",
        t.elapsed()
    );
    let ((lease, export, dir), _w) = acker.await.unwrap();
    assert_eq!((lease, export.as_str(), dir.as_str()), (id, "data", "d"));
    assert!(s.dir.path().join("data/d/theirs").is_dir());
    let c = s.state.leases.counts();
    assert_eq!((c.held, c.breaks, c.revoked), (0, 1, 0));
    // A break's lease is gone: releasing it is an error.
    assert_eq!(
        a.release_lease(id).await.unwrap_err().code,
        ErrorCode::BadHandle
    );
    // An ack on a normal connection is a protocol error, not a crash.
    let e = b
        .call(Request::LeaseBreakAck { lease_id: 1 })
        .await
        .unwrap_err();
    assert_eq!(e.code, ErrorCode::BadRequest);
    s.stop.trigger();
    let _ = s.task.await;
}

#[tokio::test]
async fn a_session_end_drops_its_leases_and_closes_its_watch() {
    let s = start(Limits::default(), false).await;
    let mut a = AsyncSideClient::connect(&s.addr, &token_opts())
        .await
        .unwrap();
    let mut w = AsyncSideClient::connect(&s.addr, &token_opts())
        .await
        .unwrap();
    w.watch(a.session()).await.unwrap();
    let (id, _) = a.lease_dir("data", "", 1).await.unwrap();
    assert_ne!(id, 0);
    assert_eq!(s.state.leases.counts().held, 1);
    a.bye().await.unwrap();
    // The watch ends with the session.
    let e = tokio::time::timeout(Duration::from_secs(5), w.next_break())
        .await
        .expect("the watch closes")
        .unwrap_err();
    assert_eq!(e.code, ErrorCode::Disconnected);
    for _ in 0..100 {
        if s.state.leases.counts().held == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(s.state.leases.counts().held, 0);
    s.stop.trigger();
    let _ = s.task.await;
}
