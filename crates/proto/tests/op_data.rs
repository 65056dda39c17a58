//! `ServerConn<U>`: the embedder's data per storage operation, kept with
//! the op while it is in flight and, when it outlives it
//! (`OpData::outlives_op`), until the embedder takes it back.

use std::time::Instant;

use lwio_proto::client::{ClientConfig, ClientConn};
use lwio_proto::server::*;
use lwio_proto::status::*;
use lwio_proto::wire::common::{CompletionMode, RequestOp};
use lwio_proto::wire::{FidParamsRepr, Guid, SrvResumeKey};
use lwio_proto::NtStatus;

mod common;
use common::{raw, AUTH_BUF, KEY, RK_PLAIN, SECRET};

/// A stand-in for a driver's read buffer.
#[derive(Debug, Default, PartialEq)]
struct Data {
    buf: Option<u32>,
    touched: u32,
}

impl OpData for Data {
    fn outlives_op(&self) -> bool {
        self.buf.is_some()
    }
}

struct Hooks;

impl ServerHooks for Hooks {
    fn session_secret(&mut self, key: &Guid) -> Option<Vec<u8>> {
        (*key == KEY).then(|| SECRET.to_vec())
    }
    fn open_file(&mut self, _rk: &SrvResumeKey, _flags: u32) -> Result<u64, NtStatus> {
        Ok(7)
    }
}

fn drain<U: OpData>(s: &mut ServerConn<U>) -> Vec<ServerAction> {
    std::iter::from_fn(|| s.poll_action()).collect()
}

/// An authenticated connection with Fid 1 registered.
fn ready(now: Instant) -> ServerConn<Data> {
    let mut s = ServerConn::<Data>::with_op_data(ServerConfig::default(), now);
    let mut c: ClientConn = ClientConn::new(ClientConfig::new(KEY, SECRET.to_vec(), AUTH_BUF));
    c.start(now).unwrap();
    let mut buf = [0u8; 4096];
    let n = c.poll_transmit(&mut buf).unwrap();
    s.handle_recv(now, &buf[..n], &mut Hooks);
    assert!(s.is_authenticated());
    drain(&mut s);
    let session_id = s.config().session_id;
    s.handle_recv(
        now,
        &raw(RequestOp::Register {
            cookie: 1,
            params: FidParamsRepr {
                resume_key: RK_PLAIN,
                session_id,
                flags_and_attributes: 0,
            },
        }),
        &mut Hooks,
    );
    assert_eq!(s.open_fids(), 1, "{:?}", drain(&mut s));
    drain(&mut s);
    s
}

/// A READ of `len` bytes of Fid 1: its op.
fn read(s: &mut ServerConn<Data>, now: Instant, len: u32) -> OpId {
    s.handle_recv(
        now,
        &raw(RequestOp::Read {
            fid: 1,
            offset: 0,
            length: len,
            data_va: 0x10000,
            data_mh: 2,
            mode: CompletionMode::Interrupt {
                cookie: 9,
                immediate_cookie: 9,
            },
        }),
        &mut Hooks,
    );
    match drain(s).as_slice() {
        [ServerAction::FileRead { op, .. }] => *op,
        a => panic!("{a:?}"),
    }
}

#[test]
fn data_that_outlives_its_op_is_kept_until_taken() {
    let now = Instant::now();
    let mut s = ready(now);
    let op = read(&mut s, now, 100);
    assert_eq!(s.op_data_mut(op), Some(&mut Data::default()));
    s.op_data_mut(op).unwrap().buf = Some(5);
    assert!(s.done_data_mut(op).is_none(), "in flight");
    assert!(s.take_done_data(op).is_none(), "in flight");
    assert_eq!(s.op_data_iter_mut().count(), 1);

    s.handle_storage_complete(now, op, Ok(100));
    let acts = drain(&mut s);
    assert!(acts.iter().any(|a| matches!(
        a,
        ServerAction::RdmaWrite {
            data: DataSource::ReadBuffer { op: o, .. },
            ..
        } if *o == op
    )));
    assert_eq!(acts.last(), Some(&ServerAction::ReleaseReadBuffer { op }));
    assert_eq!(s.pending_ops(), 0);
    // Kept for the RDMA Writes from its buffer.
    s.done_data_mut(op).unwrap().touched += 1;
    s.op_data_mut(op).unwrap().touched += 1;
    assert_eq!(
        s.op_data_iter_mut().map(|(o, _)| o).collect::<Vec<_>>(),
        [op]
    );
    assert_eq!(
        s.take_done_data(op),
        Some(Data {
            buf: Some(5),
            touched: 2
        })
    );
    assert!(s.take_done_data(op).is_none(), "taken once");
    assert!(s.op_data_mut(op).is_none());
}

#[test]
fn other_data_goes_with_its_op() {
    let now = Instant::now();
    let mut s = ready(now);
    let op = read(&mut s, now, 100);
    s.op_data_mut(op).unwrap().touched = 3;
    s.handle_storage_complete(now, op, Err(STATUS_INSUFFICIENT_RESOURCES));
    drain(&mut s);
    assert!(s.op_data_mut(op).is_none());
    assert!(s.take_done_data(op).is_none());
    assert_eq!(s.op_data_iter_mut().count(), 0);
}
