//! A hostile LWIO client: the public verbs API (soft provider) plus the
//! lwio-proto wire types, with none of the real client's checks, so a test can
//! send the server anything. Used by tests/e2e_hostile.rs and
//! tests/hostile_peers.rs.

use std::time::{Duration, Instant};

use lwio_proto::status::STATUS_SUCCESS;
use lwio_proto::wire::auth::{derive_session_secret, ENDIAN_64};
use lwio_proto::wire::common::{CompletionMode, RequestOp};
use lwio_proto::wire::{
    AddressBlockRepr, AuthParamsRepr, Guid, NegotiateRequestRepr, RequestRepr, SignatureAlg,
    StatusResponse, COMMON_HEADER_LEN, LWIO_REV_ID,
};
use lwio_rdma::*;
use lwio_server::io_phase::testkit::LocalServer;

pub struct Hostile {
    pub side: lwio_client::side_client::SideClient,
    pub key: Guid,
    pub secret: Vec<u8>,
    pub qp: Qp,
    pub cq: Cq,
    pub _pd: Pd,
    pub recv: Mr,
    pub send: Mr,
    pub mem: Mr,
    /// The session id the server returned in its AUTH params (0 before).
    pub session_id: u64,
    /// The server's MaxRecvBufferSize (after AUTH).
    pub server_max_recv: u32,
}

/// Log in over the side channel with `token`, negotiate with `client_key`,
/// and connect an RDMA QP (soft provider) to the server: a client that speaks
/// LWIO only through the wire types, so it can say anything.
pub fn connect(s: &LocalServer, token: &str, client_key: Guid) -> Hostile {
    let login = lwio_client::side_client::Login::Token(
        lwio_client::side_client::Token::new(token).unwrap(),
    );
    let mut side = lwio_client::side_client::SideClient::connect(
        &s.side_addr.to_string(),
        &lwio_client::side_client::SideOptions::new(login),
    )
    .unwrap();
    let resp = side
        .negotiate(&NegotiateRequestRepr {
            client_name: "hostile".into(),
            key: client_key,
            response_length: 4096,
            providers: vec![AddressBlockRepr {
                name: "soft".into(),
                instances: vec![],
            }],
        })
        .unwrap();
    let secret = derive_session_secret(&side.session().secret.0, &resp.key).to_vec();
    let ctx = provider("soft")
        .unwrap()
        .open(None, &Config::default())
        .unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(1024, None).unwrap();
    let init = QpInit {
        pd: pd.clone(),
        send_cq: cq.clone(),
        recv_cq: cq.clone(),
        cap: QpCap::default(),
        sq_sig_all: true,
        recv_window: None,
        srq: None,
    };
    let qp = ctx
        .connect(s.rdma_addr, &init, &ConnParams::default())
        .unwrap();
    let recv = pd.alloc_mr(64 * 64, Access::LOCAL_WRITE).unwrap();
    for i in 0..32 {
        qp.post_recv(&[RecvWr {
            wr_id: i,
            sg_list: &[recv.sge(i as usize * 64, 64)],
        }])
        .unwrap();
    }
    let send = pd.alloc_mr(1 << 20, Access::LOCAL_WRITE).unwrap();
    let mem = pd
        .alloc_mr(1 << 20, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
        .unwrap();
    Hostile {
        side,
        key: resp.key,
        secret,
        qp,
        cq,
        _pd: pd,
        recv,
        send,
        mem,
        session_id: 0,
        server_max_recv: 0,
    }
}

/// A client's AUTH params (unsigned) with `key` and `credits`.
pub fn client_params(key: Guid, credits: u16) -> AuthParamsRepr {
    AuthParamsRepr {
        rev_id: LWIO_REV_ID,
        endian: ENDIAN_64,
        page_size: 4096,
        base_sequence: 0,
        max_rdma_window_size: 65536,
        max_send_buffer_size: 8192,
        max_recv_buffer_size: 64,
        header_size: COMMON_HEADER_LEN as u16,
        credits,
        rdma_read_supported: 0,
        key: Some(key),
        session_id: None,
        signature: None,
        max_message: 0,
        features: 0,
    }
}

pub fn intr(cookie: u64) -> CompletionMode {
    CompletionMode::Interrupt {
        cookie,
        immediate_cookie: cookie as u32,
    }
}

pub fn req_bytes(op: RequestOp<'_>) -> Vec<u8> {
    RequestRepr {
        credits: 1,
        sequence: 0,
        tid: 0,
        op,
    }
    .to_bytes()
    .unwrap()
}

impl Hostile {
    pub fn send_bytes(&self, b: &[u8]) {
        self.send.write_at(0, b).unwrap();
        let _ = self.qp.post_send(&[SendWr::new(
            1000,
            SendOp::Send,
            &[self.send.sge(0, b.len() as u32)],
        )]);
    }

    pub fn send_req(&self, op: RequestOp<'_>) {
        self.send_bytes(&req_bytes(op));
    }

    /// Next status response, or None if the connection died / timeout.
    pub fn recv_status(&self, timeout: Duration) -> Option<StatusResponse> {
        let t = Instant::now();
        let mut wc = [Wc::BLANK; 8];
        while t.elapsed() < timeout {
            let n = self.cq.poll(&mut wc).unwrap_or(0);
            for w in &wc[..n] {
                if w.opcode == WcOpcode::Recv {
                    if !w.is_ok() {
                        return None;
                    }
                    let mut b = vec![0u8; w.byte_len as usize];
                    self.recv.read_at(w.wr_id as usize * 64, &mut b).unwrap();
                    let _ = self.qp.post_recv(&[RecvWr {
                        wr_id: w.wr_id,
                        sg_list: &[self.recv.sge(w.wr_id as usize * 64, 64)],
                    }]);
                    return StatusResponse::from_bytes(&b).ok();
                }
            }
            if n == 0 {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        None
    }

    /// AUTH with `key`, asking for `credits`, its params signed by `alg`
    /// (MD5: the seed's unkeyed digest). On success the session id is kept.
    pub fn auth_signed(&mut self, key: Guid, credits: u16, alg: SignatureAlg) -> StatusResponse {
        let bytes = client_params(key, credits)
            .to_signed_bytes(alg, &self.secret)
            .unwrap();
        self.send_req(RequestOp::Auth {
            cookie: 1,
            data_va: self.mem.addr(),
            data_mh: self.mem.rkey(),
            params: &bytes,
        });
        let r = self
            .recv_status(Duration::from_secs(5))
            .expect("AUTH answered");
        if r.ios.status == STATUS_SUCCESS {
            let sp = self.server_params(&r);
            self.session_id = sp.session_id.unwrap_or(0);
            self.server_max_recv = sp.max_recv_buffer_size;
        }
        r
    }

    /// The server's verified AUTH params, after a successful AUTH answered
    /// with `r`.
    pub fn server_params(&self, r: &StatusResponse) -> AuthParamsRepr {
        let mut raw = vec![0u8; r.ios.information as usize - 8];
        self.mem.read_at(0, &mut raw).unwrap();
        AuthParamsRepr::verify(&raw, &self.secret).unwrap().0
    }

    /// AUTH (HMAC-SHA256, this connection's Key) asking for `credits`; it
    /// must succeed. Returns the server's verified params.
    pub fn auth_ok(&mut self, credits: u16) -> AuthParamsRepr {
        let k = self.key;
        let r = self.auth_signed(k, credits, SignatureAlg::HmacSha256);
        assert_eq!(r.ios.status, STATUS_SUCCESS);
        self.server_params(&r)
    }

    pub fn terminated(&self, timeout: Duration) -> bool {
        let t = Instant::now();
        while t.elapsed() < timeout {
            if self.qp.state() == QpState::Error {
                return true;
            }
            let mut wc = [Wc::BLANK; 8];
            let _ = self.cq.poll(&mut wc);
            std::thread::sleep(Duration::from_millis(2));
        }
        false
    }
}
