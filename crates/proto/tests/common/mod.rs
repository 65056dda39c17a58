//! What the protocol's integration tests share: the session a test client
//! logs in with, the resume key of the plain file its server opens, and
//! raw request bytes.

use lwio_proto::client::RemoteBuf;
use lwio_proto::wire::common::RequestOp;
use lwio_proto::wire::{Guid, RequestRepr, SrvResumeKey};

pub const KEY: Guid = Guid::from_u128(0x1111_2222_3333_4444_5555_6666_7777_8888);
pub const SECRET: &[u8] = b"negotiated session secret";
pub const AUTH_BUF: RemoteBuf = RemoteBuf {
    addr: 0x1000,
    rkey: 1,
};
/// The file the tests' hooks open (Fid 1 in sim.rs).
pub const RK_PLAIN: SrvResumeKey = SrvResumeKey {
    resume_key: 77,
    timestamp: 1,
    pid: 2,
};

/// One request, encoded as a client would send it (one credit asked).
pub fn raw(op: RequestOp<'_>) -> Vec<u8> {
    RequestRepr {
        credits: 1,
        sequence: 0,
        tid: 0,
        op,
    }
    .to_bytes()
    .unwrap()
}
