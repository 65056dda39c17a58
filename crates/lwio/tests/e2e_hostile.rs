//! A hostile client built from the public verbs API and the proto wire
//! types. Each case asserts the exact NTSTATUS or a terminated connection,
//! and after each case a well-behaved client is still served.

use std::time::{Duration, Instant};

use lwio_client::{Client, ClientOptions, Completion, File, OpenOptions};
use lwio_proto::status::*;
use lwio_proto::wire::common::RequestOp;
use lwio_proto::wire::{
    FidParamsRepr, Guid, RdmaRegion, SignatureAlg, SrvResumeKey, StatusResponse,
};
use lwio_rdma::*;
use lwio_server::config::Limits;
use lwio_server::io_phase::driver::RdmaServerOptions;
use lwio_server::io_phase::testkit::LocalServer;

mod common;
use common::hostile::{connect, intr, Hostile};

const TOKEN: &str = "hostile-test-token-0123456789";

struct Env {
    s: LocalServer,
    _dir: tempfile::TempDir,
    good: File,
    _good_client: Client,
    data: Vec<u8>,
}

fn env() -> Env {
    let proto = lwio_proto::server::ServerConfig {
        auth_timeout: Duration::from_millis(400),
        ..Default::default()
    };
    env_with(RdmaServerOptions {
        auto_credits: false,
        proto,
        ..RdmaServerOptions::default()
    })
}

fn env_with(rdma: RdmaServerOptions) -> Env {
    let dir = tempfile::tempdir().unwrap();
    let data: Vec<u8> = (0..200_000u32).map(|i| (i * 7 + i / 251) as u8).collect();
    std::fs::write(dir.path().join("f.bin"), &data).unwrap();
    let s = LocalServer::start(dir.path(), "ex", TOKEN, Limits::default(), rdma).unwrap();
    let c = Client::connect(
        &format!("lwio://{}/ex", s.side_addr),
        Some(TOKEN),
        ClientOptions {
            completion: Completion::Interrupt,
            ..ClientOptions::default()
        }
        .no_tls(),
    )
    .unwrap();
    let good = c.open("f.bin", &OpenOptions::read_only()).unwrap();
    Env {
        s,
        _dir: dir,
        good,
        _good_client: c,
        data,
    }
}

impl Env {
    /// The well-behaved client is still served, byte for byte.
    fn check_good(&self) {
        let mut b = vec![0u8; 70_001];
        assert_eq!(self.good.read_at(&mut b, 12_345).unwrap(), b.len());
        assert_eq!(&b[..], &self.data[12_345..12_345 + b.len()]);
        assert_eq!(self.s.rdma.stats().mrs_remote_access, 0);
    }
}

/// A raw RDMA connection plus a logged-in side channel.
fn hostile(e: &Env) -> Hostile {
    connect(&e.s, TOKEN, Guid::from_u128(7))
}

impl Hostile {
    fn auth_with(&mut self, key: Guid, credits: u16) -> StatusResponse {
        self.auth_signed(key, credits, SignatureAlg::HmacSha256)
    }

    fn auth(&mut self, credits: u16) {
        let k = self.key;
        assert_eq!(self.auth_with(k, credits).ios.status, STATUS_SUCCESS);
    }

    fn register_key(&self, resume_key: SrvResumeKey, session_id: u64) -> u16 {
        self.send_req(RequestOp::Register {
            cookie: 2,
            params: FidParamsRepr {
                resume_key,
                session_id,
                flags_and_attributes: 0,
            },
        });
        let r = self
            .recv_status(Duration::from_secs(5))
            .expect("REGISTER answered");
        if r.ios.status == STATUS_SUCCESS {
            r.ios.information as u16
        } else {
            panic!("{:#x}", r.ios.status)
        }
    }

    fn register_status(&self, resume_key: SrvResumeKey, session_id: u64) -> NtStatus {
        self.send_req(RequestOp::Register {
            cookie: 3,
            params: FidParamsRepr {
                resume_key,
                session_id,
                flags_and_attributes: 0,
            },
        });
        self.recv_status(Duration::from_secs(5))
            .expect("REGISTER answered")
            .ios
            .status
    }

    fn read_status(&self, fid: u16, offset: u64, length: u32) -> NtStatus {
        self.send_req(RequestOp::Read {
            fid,
            offset,
            length,
            data_va: self.mem.addr(),
            data_mh: self.mem.rkey(),
            mode: intr(9),
        });
        self.recv_status(Duration::from_secs(5))
            .expect("READ answered")
            .ios
            .status
    }
}

/// Open f.bin over a side channel; its resume key.
fn open_key(side: &mut lwio_client::side_client::SideClient) -> SrvResumeKey {
    let o = lwio_side::types::OpenOptions {
        read: true,
        ..Default::default()
    };
    side.open("ex", "f.bin", &o, 0).unwrap().resume_key.key
}

const T: Duration = Duration::from_secs(5);

#[test]
fn hostile_cases() {
    let e = env();
    e.check_good();

    // 1. RDMA Write and Read aimed at the server: nothing is exposed.
    for (i, read) in [(0u32, false), (1, true)] {
        let mut h = hostile(&e);
        h.auth(4);
        let local = h.send.sge(0, 4096);
        for guess in [0x100u32 | i, 0x200, 0x300, 0x101] {
            let op = if read {
                SendOp::Read {
                    remote_addr: 0x1000,
                    rkey: guess,
                }
            } else {
                SendOp::Write {
                    remote_addr: 0x1000,
                    rkey: guess,
                }
            };
            let _ = h.qp.post_send(&[SendWr::new(7, op, &[local])]);
        }
        assert!(
            h.terminated(T),
            "RDMA {} at the server must be terminated",
            if read { "Read" } else { "Write" }
        );
        e.check_good();
    }

    // 2. REGISTER before AUTH: ACCESS_DENIED, then closed.
    let h = hostile(&e);
    assert_eq!(
        h.register_status(SrvResumeKey::default(), 1),
        STATUS_ACCESS_DENIED
    );
    assert!(h.terminated(T));
    e.check_good();

    // 3. AUTH with a wrong key: ACCESS_DENIED, then closed.
    let mut h = hostile(&e);
    let r = h.auth_with(Guid::from_u128(0xdead_beef), 4);
    assert_eq!(r.ios.status, STATUS_ACCESS_DENIED);
    assert!(h.terminated(T));
    e.check_good();

    // 4. Forged resume key; foreign session id; a key of another session.
    let mut h = hostile(&e);
    h.auth(4);
    let forged = SrvResumeKey {
        resume_key: 0x1234_5678_9abc,
        timestamp: 1,
        pid: 2,
    };
    assert_eq!(
        h.register_status(forged, h.session_id),
        STATUS_INVALID_HANDLE
    );
    let rf = open_key(&mut h.side);
    assert_eq!(
        h.register_status(rf, h.session_id ^ 0x55),
        STATUS_ACCESS_DENIED
    );
    let mut other = hostile(&e);
    let rf2 = open_key(&mut other.side);
    assert_eq!(h.register_status(rf2, h.session_id), STATUS_ACCESS_DENIED);
    // Its own key works.
    let fid = h.register_key(rf, h.session_id);
    assert!(fid != 0);
    // 5. Bogus Fid; offsets and lengths that overflow; too long a read.
    assert_eq!(
        h.read_status(fid.wrapping_add(77), 0, 10),
        STATUS_INVALID_HANDLE
    );
    assert_eq!(
        h.read_status(fid, u64::MAX - 5, 10),
        STATUS_INVALID_PARAMETER
    );
    assert_eq!(h.read_status(fid, 0, u32::MAX), STATUS_INVALID_PARAMETER);
    assert_eq!(h.read_status(fid, 0, 100), STATUS_SUCCESS);
    // 6. VEC_READ whose intermediate region is not one page.
    let regions = [
        RdmaRegion {
            data_va: h.mem.addr(),
            data_mh: h.mem.rkey(),
            length: 4096,
        },
        RdmaRegion {
            data_va: h.mem.addr() + 4096,
            data_mh: h.mem.rkey(),
            length: 2048,
        },
        RdmaRegion {
            data_va: h.mem.addr() + 8192,
            data_mh: h.mem.rkey(),
            length: 2048,
        },
    ];
    h.send_req(RequestOp::VecRead {
        fid,
        offset: 0,
        length: 8192,
        page_size: 4096,
        regions: regions.to_vec(),
        mode: intr(11),
    });
    assert_eq!(
        h.recv_status(T).unwrap().ios.status,
        STATUS_INVALID_PARAMETER
    );
    e.check_good();
    // 7. A write larger than MaxRecvBufferSize: terminated.
    let big = vec![0u8; 64 * 1024];
    h.send_req(RequestOp::Write {
        fid,
        offset: 0,
        data: &big,
        mode: intr(12),
    });
    assert!(h.terminated(T));
    e.check_good();
    drop(other);

    // 8. Credits exceeded: granted 1; an INTERRUPT holds it; one more request.
    // The server counts the request it received beyond the credits.
    let overruns = e.s.rdma.stats().credit_overruns;
    let mut h = hostile(&e);
    h.auth(1);
    h.send_req(RequestOp::Interrupt { cookie: 20 });
    h.send_req(RequestOp::Interrupt { cookie: 21 });
    h.send_req(RequestOp::Interrupt { cookie: 22 });
    assert!(h.terminated(T), "credit overflow terminates");
    assert_eq!(
        e.s.rdma.stats().credit_overruns,
        overruns + 1,
        "the request beyond the credit is counted (once: the connection closed)"
    );
    e.check_good();

    // 9. No AUTH within the (400 ms) timeout.
    let h = hostile(&e);
    let t = Instant::now();
    assert!(h.terminated(T));
    assert!(
        t.elapsed() >= Duration::from_millis(300),
        "closed only after the auth timeout"
    );
    e.check_good();

    // 10. The negotiate Key is one-time: a second AUTH with it is refused.
    let mut h = hostile(&e);
    h.auth(2);
    let key = h.key;
    let mut h2 = hostile(&e);
    h2.secret = h.secret.clone();
    assert_eq!(h2.auth_with(key, 2).ios.status, STATUS_ACCESS_DENIED);
    assert!(h2.terminated(T));
    e.check_good();

    let st = e.s.rdma.stats();
    // The provider's own census of the server's domains (every connection
    // above, closed ones included): it saw the server's registrations, and
    // none with a remote right, and no window.
    assert!(st.provider_mrs >= 20, "{st:?}");
    assert_eq!(st.mrs_remote_access, 0, "{st:?}");
    assert_eq!(st.mws_allocated, 0, "{st:?}");
}

/// The seed's MD5 AUTH form (an unkeyed digest) is refused unless the
/// server configuration sets `compat_md5_auth = true`.
#[test]
fn md5_auth_only_with_compat_md5_auth() {
    for (toml, accepted) in [("", false), ("compat_md5_auth = true\n", true)] {
        let cfg = lwio_server::config::Config::from_toml(toml).unwrap();
        let mut rdma = lwio_server::io_phase::driver::RdmaServerOptions::from_config(
            &cfg,
            "127.0.0.1:0".parse().unwrap(),
        );
        rdma.auto_credits = false;
        rdma.proto.auth_timeout = Duration::from_millis(400);
        assert_eq!(rdma.proto.allow_md5, accepted);
        let e = env_with(rdma);
        e.check_good();
        let mut h = hostile(&e);
        let k = h.key;
        let r = h.auth_signed(k, 4, SignatureAlg::Md5);
        if accepted {
            assert_eq!(r.ios.status, STATUS_SUCCESS, "{toml:?}");
            // A working connection: REGISTER and READ succeed.
            let rf = open_key(&mut h.side);
            let fid = h.register_key(rf, h.session_id);
            assert!(fid != 0);
            assert_eq!(h.read_status(fid, 0, 100), STATUS_SUCCESS);
        } else {
            assert_eq!(r.ios.status, STATUS_ACCESS_DENIED, "{toml:?}");
            assert!(h.terminated(T), "closed after a refused MD5 AUTH");
        }
        // HMAC-SHA256 AUTH works either way.
        let mut good = hostile(&e);
        good.auth(4);
        e.check_good();
    }
}

/// The Fid of a file whose handle is gone answers an error, not data, on
/// the RDMA connection that registered it (issue 31): after a side-channel
/// Close of the handle, and after the session ended and its durable grace
/// ran out. Before the fix the connection kept the file and served it.
#[test]
fn closed_handle_and_ended_session_revoke_the_fid() {
    let limits = Limits {
        durable_grace: Duration::from_millis(300),
        ..Limits::default()
    };
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("f.bin"), vec![0x77u8; 8192]).unwrap();
    let s = LocalServer::start(
        dir.path(),
        "ex",
        TOKEN,
        limits,
        RdmaServerOptions {
            auto_credits: false,
            ..RdmaServerOptions::default()
        },
    )
    .unwrap();
    let dead = |st: NtStatus| st == STATUS_FILE_CLOSED || st == STATUS_INVALID_HANDLE;

    // 1. Close over the side channel.
    let mut h = connect(&s, TOKEN, Guid::from_u128(21));
    h.auth(4);
    let o = lwio_side::types::OpenOptions {
        read: true,
        ..Default::default()
    };
    let rf = h.side.open("ex", "f.bin", &o, 0).unwrap();
    let fid = h.register_key(rf.resume_key.key, h.session_id);
    assert_eq!(h.read_status(fid, 0, 100), STATUS_SUCCESS);
    h.side.close(rf.handle).unwrap();
    let st = h.read_status(fid, 0, 100);
    assert!(
        dead(st),
        "READ of the Fid of a closed handle: {st:#x} ({})",
        lwio_proto::status::name(st).unwrap_or("?")
    );

    // 2. The session ends (its side channel goes), the grace runs out.
    let mut h = connect(&s, TOKEN, Guid::from_u128(22));
    h.auth(4);
    let rf = h.side.open("ex", "f.bin", &o, 0).unwrap();
    let fid = h.register_key(rf.resume_key.key, h.session_id);
    assert_eq!(h.read_status(fid, 0, 100), STATUS_SUCCESS);
    // Replace the side channel by another session's: the first one ends.
    let other = connect(&s, TOKEN, Guid::from_u128(23));
    drop(std::mem::replace(&mut h.side, other.side));
    let t = Instant::now();
    let st = loop {
        let st = h.read_status(fid, 0, 100);
        if st != STATUS_SUCCESS || t.elapsed() > Duration::from_secs(5) {
            break st;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(
        dead(st),
        "READ of the Fid of an ended session's file, past its grace: {st:#x} ({})",
        lwio_proto::status::name(st).unwrap_or("?")
    );
    assert_eq!(s.state.open_files.len(), 0);
}

/// Issue 31: a flood of Negotiates from one session leaves a bounded
/// negotiate table, and the latest Key still authenticates.
#[test]
fn negotiate_flood_is_bounded_and_the_latest_key_authenticates() {
    use lwio_proto::wire::auth::derive_session_secret;
    use lwio_proto::wire::{AddressBlockRepr, NegotiateRequestRepr};
    let e = env();
    let mut h = hostile(&e);
    let req = NegotiateRequestRepr {
        client_name: "flood".into(),
        key: Guid::from_u128(8),
        response_length: 4096,
        providers: vec![AddressBlockRepr {
            name: "soft".into(),
            instances: vec![],
        }],
    };
    let t0 = Instant::now();
    let mut last = h.key;
    for i in 0..100_000 {
        last = h.side.negotiate(&req).unwrap().key;
        if i % 1000 == 999 {
            let n = e.s.state.negotiation_count();
            assert!(
                n <= 64,
                "{n} negotiate Keys outstanding after {} Negotiates",
                i + 1
            );
        }
    }
    eprintln!("100 000 negotiates in {:?}", t0.elapsed());
    // This session's newest 16, and the good client's.
    let bound = lwio_server::state::MAX_NEGOTIATIONS_PER_SESSION;
    assert!(
        e.s.state.negotiation_count() <= bound + 1,
        "{}",
        e.s.state.negotiation_count()
    );
    // A new RDMA connection (the first one's AUTH timeout is long past)
    // authenticates with the flooding session's latest Key.
    let mut h2 = hostile(&e);
    h2.secret = derive_session_secret(&h.side.session().secret.0, &last).to_vec();
    assert_eq!(h2.auth_with(last, 2).ios.status, STATUS_SUCCESS);
    drop(h);
    e.check_good();
}

/// Issue 31: a forged AUTH naming a valid negotiate Key (a wrong signature)
/// is refused without using the Key up: the real AUTH with it still works.
#[test]
fn forged_auth_does_not_burn_the_negotiate_key() {
    let e = env();
    let mut h = hostile(&e);
    let key = h.key;
    let real = std::mem::replace(&mut h.secret, vec![0x5a; 32]);
    assert_eq!(h.auth_with(key, 2).ios.status, STATUS_ACCESS_DENIED);
    assert!(h.terminated(T));
    // The same side-channel session (h.side, still logged in) on a new
    // RDMA connection, with the real signature.
    let mut h2 = hostile(&e);
    h2.secret = real;
    assert_eq!(h2.auth_with(key, 2).ios.status, STATUS_SUCCESS);
    // Used now: once only.
    let mut h3 = hostile(&e);
    h3.secret = h2.secret.clone();
    assert_eq!(h3.auth_with(key, 2).ios.status, STATUS_ACCESS_DENIED);
    drop(h);
    e.check_good();
}
