//! End-to-end tests: ClientConn and ServerConn wired through a tiny
//! simulated RDMA transport, an in-memory client address space and an
//! in-memory storage backend, with a fake clock and fault injection.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use lwio_proto::client::*;
use lwio_proto::server::*;
use lwio_proto::status::*;
use lwio_proto::wire::common::{CompletionMode, Opcode, RequestOp};
use lwio_proto::wire::{
    AuthParamsRepr, FidParamsRepr, Guid, IoStatusBlock, RdmaRegion, SignatureAlg, SrvResumeKey,
    StatusResponse, FILE_NO_INTERMEDIATE_BUFFERING, LWIO_REV_ID,
};

mod common;
use common::{raw, AUTH_BUF, KEY, RK_PLAIN, SECRET};

const SESSION: u64 = 0x5e55_1011;
const DATA: RemoteBuf = RemoteBuf {
    addr: 0x10000,
    rkey: 2,
};
const IOS_BASE: u64 = 0x9_0000;
const PAGES: u64 = 0xA_0000;
const RK_NOBUF: SrvResumeKey = SrvResumeKey {
    resume_key: 78,
    timestamp: 1,
    pid: 2,
};

struct Region {
    addr: u64,
    rkey: u32,
    bytes: Vec<u8>,
}

#[derive(Default)]
struct Mem {
    regions: Vec<Region>,
}

impl Mem {
    fn find(&self, addr: u64, len: usize) -> Option<(usize, usize)> {
        self.regions.iter().enumerate().find_map(|(i, r)| {
            let off = addr.checked_sub(r.addr)? as usize;
            (off + len <= r.bytes.len()).then_some((i, off))
        })
    }
    fn write(&mut self, addr: u64, rkey: u32, data: &[u8]) -> bool {
        match self.find(addr, data.len()) {
            Some((i, off)) if self.regions[i].rkey == rkey => {
                self.regions[i].bytes[off..off + data.len()].copy_from_slice(data);
                true
            }
            _ => false,
        }
    }
    /// The client writing its own memory (no key involved).
    fn local_write(&mut self, addr: u64, data: &[u8]) -> bool {
        match self.find(addr, data.len()) {
            Some((i, off)) => {
                self.regions[i].bytes[off..off + data.len()].copy_from_slice(data);
                true
            }
            None => false,
        }
    }
    fn read_at(&self, addr: u64, len: usize) -> Vec<u8> {
        let (i, off) = self.find(addr, len).expect("in range");
        self.regions[i].bytes[off..off + len].to_vec()
    }
}

impl LocalMemory for Mem {
    fn read(&self, addr: u64, len: usize) -> Option<Vec<u8>> {
        let (i, off) = self.find(addr, len)?;
        Some(self.regions[i].bytes[off..off + len].to_vec())
    }
}

struct Hooks {
    secrets: HashMap<Guid, Vec<u8>>,
}

impl ServerHooks for Hooks {
    fn session_secret(&mut self, key: &Guid) -> Option<Vec<u8>> {
        self.secrets.get(key).cloned()
    }
    fn open_file(&mut self, rk: &SrvResumeKey, flags: u32) -> Result<u64, NtStatus> {
        match rk.resume_key {
            77 => Ok(1),
            78 if flags & FILE_NO_INTERMEDIATE_BUFFERING != 0 => Ok(1),
            _ => Err(STATUS_ACCESS_DENIED),
        }
    }
}

#[derive(Default)]
struct Storage {
    files: HashMap<u64, Vec<u8>>,
    read_bufs: HashMap<OpId, Vec<u8>>,
    defer: bool,
    held: Vec<ServerAction>,
    closed_files: Vec<(u16, u64)>,
    /// FLUSHes performed: (file, data_only).
    synced: Vec<(u64, bool)>,
    /// What a FLUSH answers (None: success).
    sync_fails: Option<NtStatus>,
}

impl Storage {
    /// Perform a storage action; returns the completion.
    fn perform(&mut self, a: &ServerAction) -> (OpId, Result<u32, NtStatus>) {
        match a {
            ServerAction::FileRead {
                op,
                file,
                offset,
                len,
                ..
            } => {
                let f = self.files.get(file).expect("file");
                let off = *offset as usize;
                if off >= f.len() {
                    return (*op, Err(STATUS_END_OF_FILE));
                }
                let end = (off + *len as usize).min(f.len());
                self.read_bufs.insert(*op, f[off..end].to_vec());
                (*op, Ok((end - off) as u32))
            }
            ServerAction::FileWrite {
                op,
                file,
                offset,
                data,
                ..
            } => {
                let f = self.files.get_mut(file).expect("file");
                let end = *offset as usize + data.len();
                if f.len() < end {
                    f.resize(end, 0);
                }
                f[*offset as usize..end].copy_from_slice(data);
                (*op, Ok(data.len() as u32))
            }
            ServerAction::FileSync {
                op,
                file,
                data_only,
                ..
            } => {
                self.synced.push((*file, *data_only));
                (*op, self.sync_fails.map_or(Ok(0), Err))
            }
            _ => unreachable!(),
        }
    }
}

enum ToClient {
    Msg(Vec<u8>),
    Imm(u32),
}

type MakeMsg = Box<dyn Fn(u16) -> Vec<u8>>;
type Fault = Box<dyn FnMut(Vec<u8>) -> Vec<Vec<u8>>>;

struct Sim {
    now: Instant,
    server: ServerConn,
    /// Per-request data: a number the tests choose (`user_mut`).
    client: ClientConn<u32>,
    mem: Mem,
    hooks: Hooks,
    storage: Storage,
    to_server: VecDeque<Vec<u8>>,
    to_client: VecDeque<ToClient>,
    client_recvs: u32,
    recv_overrun: bool,
    /// RDMA Writes with Immediate the server issued.
    imms: u32,
    server_closed: Option<CloseReason>,
    client_closed: Option<CloseReason>,
    events: Vec<ClientEvent>,
    c2s_fault: Option<Fault>,
    s2c_fault: Option<Fault>,
}

/// The client's queued request messages, each encoded by `poll_transmit`
/// into a send buffer as a driver does.
trait TransmitAll {
    fn transmit_all(&mut self) -> Vec<Vec<u8>>;
}

impl<U: Default> TransmitAll for ClientConn<U> {
    fn transmit_all(&mut self) -> Vec<Vec<u8>> {
        let mut buf = [0u8; 16 * 1024];
        std::iter::from_fn(|| self.poll_transmit(&mut buf).map(|n| buf[..n].to_vec())).collect()
    }
}

fn file_pattern(n: usize) -> Vec<u8> {
    (0..n).map(|i| (i * 7 + i / 251) as u8).collect()
}

impl Sim {
    fn with(scfg: ServerConfig, ccfg: ClientConfig) -> Sim {
        let now = Instant::now();
        let mut mem = Mem::default();
        mem.regions.push(Region {
            addr: AUTH_BUF.addr,
            rkey: AUTH_BUF.rkey,
            bytes: vec![0; 512],
        });
        mem.regions.push(Region {
            addr: DATA.addr,
            rkey: DATA.rkey,
            bytes: vec![0; 65536],
        });
        mem.regions.push(Region {
            addr: IOS_BASE,
            rkey: 3,
            bytes: vec![0; 8 * 16],
        });
        mem.regions.push(Region {
            addr: PAGES,
            rkey: 4,
            bytes: vec![0; 65536],
        });
        let mut storage = Storage::default();
        storage.files.insert(1, file_pattern(10_000));
        Sim {
            now,
            server: ServerConn::new(scfg, now),
            client: ClientConn::new(ccfg),
            mem,
            hooks: Hooks {
                secrets: HashMap::from([(KEY, SECRET.to_vec())]),
            },
            storage,
            to_server: VecDeque::new(),
            to_client: VecDeque::new(),
            client_recvs: 0,
            recv_overrun: false,
            imms: 0,
            server_closed: None,
            client_closed: None,
            events: Vec::new(),
            c2s_fault: None,
            s2c_fault: None,
        }
    }

    fn new() -> Sim {
        Sim::with(server_cfg(), client_cfg())
    }

    /// Run until nothing moves.
    fn pump(&mut self) {
        for _ in 0..10_000 {
            let mut progress = self.client_actions();
            for b in self.client.transmit_all() {
                progress = true;
                match self.c2s_fault.as_mut() {
                    Some(f) => self.to_server.extend(f(b)),
                    None => self.to_server.push_back(b),
                }
            }
            while let Some(e) = self.client.poll_event() {
                self.events.push(e);
            }
            if let Some(m) = self.to_server.pop_front() {
                progress = true;
                if self.client_closed.is_none() {
                    self.server.handle_recv(self.now, &m, &mut self.hooks);
                }
            }
            let acts: Vec<ServerAction> =
                std::iter::from_fn(|| self.server.poll_action()).collect();
            for a in acts {
                progress = true;
                self.server_action(a);
            }
            if let Some(m) = self.to_client.pop_front() {
                progress = true;
                match m {
                    ToClient::Msg(b) => self.client.handle_recv(self.now, &b, &self.mem),
                    ToClient::Imm(i) => self.client.handle_immediate(self.now, i),
                }
            }
            for slot in self.client.polled_slots() {
                let addr = IOS_BASE + 8 * u64::from(slot);
                let ios = IoStatusBlock::from_bytes(&self.mem.read_at(addr, 8)).unwrap();
                if ios != IoStatusBlock::SENTINEL {
                    progress = true;
                    self.client
                        .status_block_updated(self.now, slot, ios.information, ios.status);
                }
            }
            if !progress {
                return;
            }
        }
        panic!("simulation did not settle");
    }

    fn deliver(&mut self, m: ToClient) {
        if self.client_recvs == 0 {
            self.recv_overrun = true;
            return;
        }
        self.client_recvs -= 1;
        self.to_client.push_back(m);
    }

    fn server_action(&mut self, a: ServerAction) {
        match a {
            ServerAction::Send(b) => {
                assert_eq!(b.len(), 16, "server sends only status responses");
                let msgs = match self.s2c_fault.as_mut() {
                    Some(f) => f(b),
                    None => vec![b],
                };
                for m in msgs {
                    self.deliver(ToClient::Msg(m));
                }
            }
            ServerAction::RdmaWrite {
                remote_addr,
                rkey,
                data,
                imm,
            } => {
                let bytes = match data {
                    DataSource::Inline(b) => b,
                    DataSource::ReadBuffer { op, offset, len } => {
                        let b = &self.storage.read_bufs[&op];
                        b[offset as usize..(offset + len) as usize].to_vec()
                    }
                };
                assert!(
                    self.mem.write(remote_addr, rkey, &bytes),
                    "RDMA write out of bounds"
                );
                if let Some(i) = imm {
                    self.imms += 1;
                    self.deliver(ToClient::Imm(i));
                }
            }
            a @ (ServerAction::FileRead { .. }
            | ServerAction::FileWrite { .. }
            | ServerAction::FileSync { .. }) => {
                if self.storage.defer {
                    self.storage.held.push(a);
                } else {
                    let (op, r) = self.storage.perform(&a);
                    self.server.handle_storage_complete(self.now, op, r);
                }
            }
            ServerAction::CancelIo { op } => {
                let pos = self.storage.held.iter().position(|h| match h {
                    ServerAction::FileRead { op: o, .. }
                    | ServerAction::FileWrite { op: o, .. }
                    | ServerAction::FileSync { op: o, .. } => *o == op,
                    _ => false,
                });
                if let Some(p) = pos {
                    self.storage.held.remove(p);
                    self.server
                        .handle_storage_complete(self.now, op, Err(STATUS_CANCELLED));
                }
            }
            // The simulated server announces no MAX_MESSAGE (fragments are
            // tested in lwio's e2e_fragments.rs and fuzzed).
            a @ (ServerAction::FileWriteParts { .. } | ServerAction::RepostRecvs(_)) => {
                panic!("fragment action without fragments: {a:?}")
            }
            ServerAction::ReleaseReadBuffer { op } => {
                self.storage.read_bufs.remove(&op);
            }
            ServerAction::CloseFile { fid, file } => self.storage.closed_files.push((fid, file)),
            ServerAction::CloseConnection(r) => self.server_closed = Some(r),
        }
    }

    fn release_held(&mut self) {
        let held = std::mem::take(&mut self.storage.held);
        for a in held {
            let (op, r) = self.storage.perform(&a);
            self.server.handle_storage_complete(self.now, op, r);
        }
        self.pump();
    }

    fn completion(&self, req: ReqId) -> Option<(u32, NtStatus)> {
        self.events.iter().find_map(|e| match e {
            ClientEvent::Completed {
                req: r,
                information,
                status,
                ..
            } if *r == req => Some((*information, *status)),
            _ => None,
        })
    }

    fn connect(&mut self) {
        self.client.start(self.now).unwrap();
        self.pump();
        assert!(self.client.is_authenticated(), "events: {:?}", self.events);
        assert!(self.server.is_authenticated());
    }

    fn register(&mut self, rk: SrvResumeKey, flags: u32) -> u16 {
        let r = self.client.register(self.now, rk, flags).unwrap();
        self.pump();
        let (fid, st) = self.completion(r).unwrap();
        assert_eq!(st, STATUS_SUCCESS);
        fid as u16
    }

    /// READ into `DATA`, issued now: the request.
    fn read(&mut self, fid: u16, offset: u64, len: u32, mode: Mode) -> ReqId {
        self.client
            .read(self.now, fid, offset, len, DATA, mode)
            .unwrap()
            .req
    }

    /// Send raw bytes to the server as if from the client.
    fn inject(&mut self, b: Vec<u8>) {
        self.to_server.push_back(b);
        self.pump();
    }
}

fn server_cfg() -> ServerConfig {
    ServerConfig {
        session_id: SESSION,
        max_credits: 8,
        ..ServerConfig::default()
    }
}

fn client_cfg() -> ClientConfig {
    let mut c = ClientConfig::new(KEY, SECRET.to_vec(), AUTH_BUF);
    c.status_blocks = Some(StatusBlockArea {
        base: IOS_BASE,
        rkey: 3,
        slots: 16,
    });
    c.credits_wanted = 4;
    // An lwio client on a device that receives RDMA Writes with Immediate
    // (FEATURES bit 1); `use_write_with_imm` decides per server.
    c.accepts_immediate = true;
    c
}

fn intr(cookie: u64) -> CompletionMode {
    CompletionMode::Interrupt {
        cookie,
        immediate_cookie: cookie as u32,
    }
}

// ------------------------------------------------------------------ scenarios

fn run_all_opcodes(mode: Mode, imm: bool) {
    let mut scfg = server_cfg();
    scfg.use_write_with_imm = imm;
    let mut s = Sim::with(scfg, client_cfg());
    s.connect();
    assert_eq!(s.client.credits(), 4);
    assert_eq!(s.client.session_id(), SESSION);
    assert_eq!(s.client.posted_recvs(), 5);
    let fid = s.register(RK_NOBUF, FILE_NO_INTERMEDIATE_BUFFERING);
    assert_eq!(fid, 1);
    let file = file_pattern(10_000);

    // READ
    let r = s.read(fid, 100, 3000, mode);
    s.pump();
    assert_eq!(s.completion(r), Some((3000, STATUS_SUCCESS)));
    assert_eq!(s.mem.read_at(DATA.addr, 3000), file[100..3100]);

    // The server counts status-block completions (it busy-polls after
    // them): one for the polled READ, none in interrupt mode.
    assert_eq!(
        s.server.polled_completions(),
        u64::from(matches!(mode, Mode::Polled))
    );

    // Short read at the end of the file, then END_OF_FILE.
    let r = s.read(fid, 9_000, 4096, mode);
    s.pump();
    assert_eq!(s.completion(r), Some((1000, STATUS_SUCCESS)));
    let r = s.read(fid, 20_000, 10, mode);
    s.pump();
    assert_eq!(s.completion(r), Some((0, STATUS_END_OF_FILE)));

    // WRITE
    let r = s
        .client
        .write(s.now, fid, 50, b"hello lwio", mode)
        .unwrap()
        .req;
    s.pump();
    assert_eq!(s.completion(r), Some((10, STATUS_SUCCESS)));
    assert_eq!(&s.storage.files[&1][50..60], b"hello lwio");

    // VEC_READ: 2 full pages + 1024-byte tail into scattered pages.
    let regions = [
        RdmaRegion {
            data_va: PAGES + 8192,
            data_mh: 4,
            length: 4096,
        },
        RdmaRegion {
            data_va: PAGES,
            data_mh: 4,
            length: 4096,
        },
        RdmaRegion {
            data_va: PAGES + 3 * 4096,
            data_mh: 4,
            length: 1024,
        },
    ];
    let r = s
        .client
        .vec_read(s.now, fid, 0, 9216, 4096, &regions, mode)
        .unwrap()
        .req;
    s.pump();
    assert_eq!(s.completion(r), Some((9216, STATUS_SUCCESS)));
    let f = s.storage.files[&1].clone();
    assert_eq!(s.mem.read_at(PAGES + 8192, 4096), f[..4096]);
    assert_eq!(s.mem.read_at(PAGES, 4096), f[4096..8192]);
    assert_eq!(s.mem.read_at(PAGES + 3 * 4096, 1024), f[8192..9216]);

    // VEC_WRITE without collapse.
    let data: Vec<u8> = (0..5000u32).map(|i| (i % 13) as u8).collect();
    let r = s
        .client
        .vec_write(s.now, fid, 1000, 4096, 5000, &data, false, mode)
        .unwrap()
        .req;
    s.pump();
    assert_eq!(s.completion(r), Some((5000, STATUS_SUCCESS)));
    assert_eq!(s.storage.files[&1][1000..6000], data[..]);

    // VEC_WRITE collapsed: one page repeated, last page partial.
    let page = vec![0xabu8; 4096];
    let r = s
        .client
        .vec_write(s.now, fid, 4096, 4096, 4096 * 2 + 512, &page, true, mode)
        .unwrap()
        .req;
    s.pump();
    assert_eq!(s.completion(r), Some((8704, STATUS_SUCCESS)));
    assert!(s.storage.files[&1][4096..4096 + 8704]
        .iter()
        .all(|&b| b == 0xab));
    assert_eq!(s.storage.files[&1].len(), 12_800);

    // INTERRUPT, answered after the next I/O completes.
    let irq = s.client.interrupt(s.now).unwrap();
    s.pump();
    assert_eq!(s.completion(irq), None);
    let r = s.read(fid, 0, 16, mode);
    s.pump();
    assert_eq!(s.completion(r), Some((16, STATUS_SUCCESS)));
    assert_eq!(s.completion(irq), Some((0, STATUS_SUCCESS)));

    // CANCEL with a deferred read: it completes with STATUS_CANCELLED.
    s.storage.defer = true;
    let r = s.read(fid, 0, 512, mode);
    s.pump();
    assert_eq!(s.completion(r), None);
    let c = s.client.cancel(s.now, fid).unwrap();
    s.pump();
    assert_eq!(s.completion(c), Some((0, STATUS_SUCCESS)));
    assert_eq!(s.completion(r), Some((0, STATUS_CANCELLED)));
    s.storage.defer = false;

    // Credits: +2 then -3, the full three-way handshake.
    s.server.start_credit_delta(s.now, 2).unwrap();
    s.pump();
    assert_eq!(s.client.credits(), 6);
    assert_eq!(s.server.credits(), 6);
    assert!(!s.server.credit_transaction_active());
    assert_eq!(s.client.posted_recvs(), 7);
    s.server.start_credit_delta(s.now, -3).unwrap();
    s.pump();
    assert_eq!(s.client.credits(), 3);
    assert_eq!(s.server.credits(), 3);
    assert!(!s.server.credit_transaction_active());

    // CLOSE: Fid invalid afterwards.
    let c = s.client.close_file(s.now, fid).unwrap();
    s.pump();
    assert_eq!(s.completion(c), Some((0, STATUS_SUCCESS)));
    assert_eq!(s.storage.closed_files, vec![(fid, 1)]);
    let r = s.read(fid, 0, 16, mode);
    s.pump();
    assert_eq!(s.completion(r), Some((0, STATUS_INVALID_HANDLE)));

    assert_eq!(s.client.outstanding(), 0);
    assert_eq!(s.server.outstanding(), 0);
    assert!(!s.recv_overrun);
    assert!(s.server_closed.is_none() && s.client_closed.is_none());
    assert!(s.storage.read_bufs.is_empty(), "read buffers released");
}

#[test]
fn all_opcodes_interrupt_mode() {
    run_all_opcodes(Mode::Interrupt, false);
}

#[test]
fn all_opcodes_interrupt_mode_with_immediate() {
    run_all_opcodes(Mode::Interrupt, true);
}

#[test]
fn all_opcodes_polling_mode() {
    run_all_opcodes(Mode::Polled, false);
}

#[test]
fn write_into_encodes_the_same_message_in_place() {
    for mode in [Mode::Interrupt, Mode::Polled] {
        let mut s = Sim::with(server_cfg(), client_cfg());
        s.connect();
        let fid = s.register(RK_NOBUF, FILE_NO_INTERMEDIATE_BUFFERING);
        // Too small a buffer: refused, nothing recorded or queued.
        let before = s.client.outstanding();
        let mut small = [0u8; 60];
        assert_eq!(
            s.client
                .write_into(s.now, fid, 0, b"0123456789", mode, &mut small),
            Err(ClientError::InvalidArgument)
        );
        assert_eq!(s.client.outstanding(), before);
        // In place: the caller sends it; the server completes it as a WRITE.
        let mut buf = [0xAAu8; 200];
        let (issued, n) = s
            .client
            .write_into(s.now, fid, 33, b"0123456789", mode, &mut buf)
            .unwrap();
        let r = issued.req;
        assert_eq!(n, 56 + 10);
        assert!(
            buf[n..].iter().all(|&b| b == 0xAA),
            "wrote past the message"
        );
        assert_eq!(s.client.transmit_pending(), 0, "queued a message too");
        while let Some(a) = s.client.poll_action() {
            if let ClientAction::ResetStatusBlock { addr, .. } = a {
                assert!(s.mem.write(addr, 3, &IoStatusBlock::SENTINEL.to_bytes()));
            }
        }
        s.to_server.push_back(buf[..n].to_vec());
        s.pump();
        assert_eq!(s.completion(r), Some((10, STATUS_SUCCESS)));
        assert_eq!(&s.storage.files[&1][33..43], b"0123456789");
        // The same request through `write` is the same bytes but for the
        // cookie and sequence number: the next one's encoding matches.
        let r2 = s
            .client
            .write(s.now, fid, 33, b"0123456789", mode)
            .unwrap()
            .req;
        while let Some(a) = s.client.poll_action() {
            if let ClientAction::ResetStatusBlock { addr, .. } = a {
                assert!(s.mem.write(addr, 3, &IoStatusBlock::SENTINEL.to_bytes()))
            }
        }
        let mut sent = s.client.transmit_all();
        assert_eq!(sent.len(), 1, "one message for write()");
        let b = sent.remove(0);
        assert_eq!(b.len(), n);
        // Past the common header (cookie, sequence): the same payload.
        assert_eq!(&b[56..], &buf[56..n]);
        s.to_server.push_back(b);
        s.pump();
        assert_eq!(s.completion(r2), Some((10, STATUS_SUCCESS)));
    }
}

/// Hand `msg` to the server as received in buffer `buf` (`None`: through
/// `handle_recv`, no buffer); what it answered and every action.
fn recv_in(s: &mut Sim, buf: Option<RecvId>, msg: &[u8]) -> (RecvBuffer, Vec<ServerAction>) {
    let r = match buf {
        Some(b) => s.server.handle_recv_in(s.now, b, msg, &mut s.hooks),
        None => {
            s.server.handle_recv(s.now, msg, &mut s.hooks);
            RecvBuffer::Repost
        }
    };
    (r, std::iter::from_fn(|| s.server.poll_action()).collect())
}

/// How many times `acts` hand receive buffer `buf` back.
fn handbacks(acts: &[ServerAction], buf: RecvId) -> usize {
    acts.iter()
        .map(|a| match a {
            ServerAction::FileWriteParts { parts, .. } => {
                parts.iter().filter(|(b, _)| *b == buf).count()
            }
            ServerAction::RepostRecvs(bufs) => bufs.iter().filter(|b| **b == buf).count(),
            _ => 0,
        })
        .sum()
}

/// The (cookie, information, status) of the status responses in `acts`.
fn statuses(acts: &[ServerAction]) -> Vec<(u64, u32, NtStatus)> {
    acts.iter()
        .filter_map(|a| match a {
            ServerAction::Send(b) => {
                let r = StatusResponse::from_bytes(b).unwrap();
                Some((r.cookie, r.ios.information, r.ios.status))
            }
            _ => None,
        })
        .collect()
}

#[test]
fn a_write_lends_its_receive_buffer_to_file_write_parts() {
    let mut s = Sim::new();
    s.connect();
    let fid = s.register(RK_PLAIN, 0);
    let data: &[u8] = b"lent, not copied";
    let n = data.len() as u32;
    let write = |cookie: u64, fid: u16, data: &[u8]| {
        raw(RequestOp::Write {
            fid,
            offset: 70,
            data,
            mode: intr(cookie),
        })
    };
    let vec_write = raw(RequestOp::VecWrite {
        fid,
        offset: 70,
        length: n,
        num_pages: 1,
        page_size: 4096,
        collapse: false,
        data,
        mode: intr(42),
    });
    for (cookie, msg) in [(41, write(41, fid, data)), (42, vec_write)] {
        let (kept, acts) = recv_in(&mut s, Some(7), &msg);
        assert_eq!(kept, RecvBuffer::Kept);
        // Exactly one action: the write, from the data's exact place in
        // the message (after the 56-byte header) in buffer 7.
        let [ServerAction::FileWriteParts {
            op,
            fid: f,
            file: 1,
            offset: 70,
            parts,
        }] = &acts[..]
        else {
            panic!("not one FileWriteParts: {acts:?}");
        };
        assert_eq!(*f, fid);
        assert_eq!(parts, &vec![(7, 56..56 + data.len())]);
        assert_eq!(&msg[parts[0].1.clone()], data);
        // Done: one status; the buffer was handed back once, by the
        // FileWriteParts (the embedder reposts it with the write done).
        s.server.handle_storage_complete(s.now, *op, Ok(n));
        let done: Vec<_> = std::iter::from_fn(|| s.server.poll_action()).collect();
        assert_eq!(statuses(&done), vec![(cookie, n, STATUS_SUCCESS)]);
        assert_eq!(handbacks(&acts, 7) + handbacks(&done, 7), 1);
        assert_eq!(done.len(), 1, "{done:?}");
    }
    // Without a buffer (`handle_recv`): a FileWrite of a copy.
    let msg = write(43, fid, data);
    let (_, acts) = recv_in(&mut s, None, &msg);
    let [ServerAction::FileWrite { op, data: copy, .. }] = &acts[..] else {
        panic!("not one FileWrite: {acts:?}");
    };
    assert_eq!(copy, data);
    s.server.handle_storage_complete(s.now, *op, Ok(n));
    let done: Vec<_> = std::iter::from_fn(|| s.server.poll_action()).collect();
    assert_eq!(statuses(&done), vec![(43, n, STATUS_SUCCESS)]);
    // Answered at once, the buffer posted again at once: a refusal (no
    // such Fid) and an empty write.
    for (msg, want) in [
        (write(44, fid + 9, data), (44, 0, STATUS_INVALID_HANDLE)),
        (write(45, fid, b""), (45, 0, STATUS_SUCCESS)),
    ] {
        let (kept, acts) = recv_in(&mut s, Some(7), &msg);
        assert_eq!(kept, RecvBuffer::Repost);
        assert_eq!(statuses(&acts), vec![want]);
        assert_eq!(acts.len(), 1, "{acts:?}");
    }
    // Cancelled before the embedder took its write: the buffer comes back
    // once, in a RepostRecvs, and the write is never issued.
    let msg = write(46, fid, data);
    let kept = s.server.handle_recv_in(s.now, 7, &msg, &mut s.hooks);
    assert_eq!(kept, RecvBuffer::Kept);
    let (kept, acts) = recv_in(&mut s, Some(8), &raw(RequestOp::Cancel { fid, cookie: 47 }));
    assert_eq!(kept, RecvBuffer::Repost);
    assert!(
        acts.contains(&ServerAction::RepostRecvs(vec![7])),
        "{acts:?}"
    );
    assert!(!acts
        .iter()
        .any(|a| matches!(a, ServerAction::FileWriteParts { .. })));
    assert_eq!(handbacks(&acts, 7), 1);
    assert_eq!(handbacks(&acts, 8), 0);
    assert_eq!(
        statuses(&acts),
        vec![(46, 0, STATUS_CANCELLED), (47, 0, STATUS_SUCCESS)]
    );
    assert_eq!(s.server.outstanding(), 0);
    assert_eq!(s.server.pending_ops(), 0);
}

#[test]
fn md5_compat_mode() {
    let mut sc = server_cfg();
    sc.allow_md5 = true;
    let mut cc = client_cfg();
    cc.signature = SignatureAlg::Md5;
    let mut s = Sim::with(sc, cc);
    s.connect();
    // Refused when not allowed.
    let mut cc = client_cfg();
    cc.signature = SignatureAlg::Md5;
    let mut s = Sim::with(server_cfg(), cc);
    s.client.start(s.now).unwrap();
    s.pump();
    assert_eq!(s.server_closed, Some(CloseReason::AuthFailed));
    assert!(s.events.contains(&ClientEvent::AuthFailed {
        status: STATUS_ACCESS_DENIED
    }));
}

#[test]
fn auth_wrong_key_and_wrong_secret() {
    let mut cc = client_cfg();
    cc.key = Guid::from_u128(99);
    let mut s = Sim::with(server_cfg(), cc);
    s.client.start(s.now).unwrap();
    s.pump();
    assert_eq!(s.server_closed, Some(CloseReason::AuthFailed));
    assert!(s.events.contains(&ClientEvent::AuthFailed {
        status: STATUS_ACCESS_DENIED
    }));
    assert!(s.client.is_closed());

    let mut cc = client_cfg();
    cc.secret = b"wrong".to_vec();
    let mut s = Sim::with(server_cfg(), cc);
    s.client.start(s.now).unwrap();
    s.pump();
    assert_eq!(s.server_closed, Some(CloseReason::AuthFailed));
}

#[test]
fn client_rejects_forged_server_params() {
    // Params signed with another secret (a spoofing server).
    let mut s = Sim::new();
    let cookie = s.client.start(s.now).unwrap();
    let forged = AuthParamsRepr {
        rev_id: LWIO_REV_ID,
        endian: 8,
        page_size: 4096,
        header_size: 56,
        credits: 4,
        max_recv_buffer_size: 8192,
        key: Some(KEY),
        session_id: Some(SESSION),
        ..AuthParamsRepr::default()
    }
    .to_signed_bytes(SignatureAlg::HmacSha256, b"attacker")
    .unwrap();
    assert!(s.mem.write(AUTH_BUF.addr, AUTH_BUF.rkey, &forged));
    let st = StatusResponse {
        cookie,
        ios: IoStatusBlock {
            information: forged.len() as u32 + 8,
            status: STATUS_SUCCESS,
        },
    };
    s.client.handle_recv(s.now, &st.to_bytes(), &s.mem);
    assert!(s.client.is_closed());
    assert!(!s.client.is_authenticated());

    // A truncated params length (Information tampered) is rejected too.
    let mut s = Sim::new();
    s.s2c_fault = Some(Box::new(|mut b: Vec<u8>| {
        b[8] = b[8].wrapping_sub(1);
        vec![b]
    }));
    s.client.start(s.now).unwrap();
    s.pump();
    assert!(s.client.is_closed());
    assert!(matches!(
        s.client_closed,
        Some(CloseReason::ServerMisbehaved(_))
    ));
}

#[test]
fn auth_timeout_with_fake_clock() {
    let mut s = Sim::new();
    assert_eq!(
        s.server.poll_timeout(),
        Some(s.now + Duration::from_secs(10))
    );
    s.server.handle_timeout(s.now + Duration::from_secs(9));
    assert!(!s.server.is_closed());
    s.server.handle_timeout(s.now + Duration::from_secs(10));
    s.pump();
    assert_eq!(s.server_closed, Some(CloseReason::AuthTimeout));
    assert_eq!(s.server.poll_timeout(), None);
}

#[test]
fn register_before_auth_is_denied_and_terminates() {
    let mut s = Sim::new();
    let mut seen = Vec::new();
    let b = raw(RequestOp::Register {
        cookie: 5,
        params: FidParamsRepr::default(),
    });
    s.server.handle_recv(s.now, &b, &mut s.hooks);
    while let Some(a) = s.server.poll_action() {
        seen.push(a);
    }
    let st = StatusResponse {
        cookie: 5,
        ios: IoStatusBlock {
            information: 0,
            status: STATUS_ACCESS_DENIED,
        },
    };
    assert_eq!(seen[0], ServerAction::Send(st.to_bytes().to_vec()));
    assert_eq!(
        seen[1],
        ServerAction::CloseConnection(CloseReason::ProtocolViolation("request before AUTH"))
    );
}

#[test]
fn foreign_session_and_bad_resume_key() {
    let mut s = Sim::new();
    s.connect();
    // Bypass the client to use a foreign session id.
    let mut statuses = Vec::new();
    let b = raw(RequestOp::Register {
        cookie: 900,
        params: FidParamsRepr {
            resume_key: RK_PLAIN,
            session_id: SESSION + 1,
            flags_and_attributes: 0,
        },
    });
    s.server.handle_recv(s.now, &b, &mut s.hooks);
    while let Some(a) = s.server.poll_action() {
        if let ServerAction::Send(b) = a {
            statuses.push(StatusResponse::from_bytes(&b).unwrap());
        }
    }
    assert_eq!(statuses[0].cookie, 900);
    assert_eq!(statuses[0].ios.status, STATUS_ACCESS_DENIED);

    let r = s
        .client
        .register(
            s.now,
            SrvResumeKey {
                resume_key: 1,
                timestamp: 0,
                pid: 0,
            },
            0,
        )
        .unwrap();
    s.pump();
    assert_eq!(s.completion(r), Some((0, STATUS_ACCESS_DENIED)));
}

/// Drive the server directly and collect its status responses.
fn direct(s: &mut Sim, b: &[u8]) -> (Vec<StatusResponse>, Vec<ServerAction>) {
    s.server.handle_recv(s.now, b, &mut s.hooks);
    let mut st = Vec::new();
    let mut other = Vec::new();
    while let Some(a) = s.server.poll_action() {
        match a {
            ServerAction::Send(b) => st.push(StatusResponse::from_bytes(&b).unwrap()),
            a @ (ServerAction::FileRead { .. } | ServerAction::FileWrite { .. }) => {
                let (op, r) = s.storage.perform(&a);
                s.server.handle_storage_complete(s.now, op, r);
                let more: Vec<_> = std::iter::from_fn(|| s.server.poll_action()).collect();
                for m in more {
                    match m {
                        ServerAction::Send(b) => st.push(StatusResponse::from_bytes(&b).unwrap()),
                        m => other.push(m),
                    }
                }
            }
            a => other.push(a),
        }
    }
    (st, other)
}

#[test]
fn validation_statuses() {
    let mut s = Sim::new();
    s.connect();
    let fid = s.register(RK_PLAIN, 0);
    let read = |fid, offset, length, cookie| {
        raw(RequestOp::Read {
            fid,
            offset,
            length,
            data_va: DATA.addr,
            data_mh: 2,
            mode: intr(cookie),
        })
    };
    // Bogus Fid.
    let (st, _) = direct(&mut s, &read(fid + 10, 0, 16, 11));
    assert_eq!(
        (st[0].cookie, st[0].ios.status),
        (11, STATUS_INVALID_HANDLE)
    );
    // Offset + length overflow.
    let (st, _) = direct(&mut s, &read(fid, u64::MAX - 3, 16, 12));
    assert_eq!(st[0].ios.status, STATUS_INVALID_PARAMETER);
    // Above MaxRdmaWindowSize.
    let (st, _) = direct(&mut s, &read(fid, 0, 512 * 1024 + 1, 13));
    assert_eq!(st[0].ios.status, STATUS_INVALID_PARAMETER);
    // Zero-length read succeeds with 0 bytes.
    let (st, _) = direct(&mut s, &read(fid, 0, 0, 14));
    assert_eq!(
        (st[0].ios.information, st[0].ios.status),
        (0, STATUS_SUCCESS)
    );
    // VEC_READ: middle region not a full page, last region not a sector multiple,
    // count mismatch.
    let vr = |regions: Vec<RdmaRegion>, length, cookie| {
        raw(RequestOp::VecRead {
            fid,
            offset: 0,
            length,
            page_size: 4096,
            regions,
            mode: intr(cookie),
        })
    };
    let p = |len| RdmaRegion {
        data_va: PAGES,
        data_mh: 4,
        length: len,
    };
    let (st, _) = direct(&mut s, &vr(vec![p(2048), p(1024)], 3072, 15));
    assert_eq!(st[0].ios.status, STATUS_INVALID_PARAMETER);
    let (st, _) = direct(&mut s, &vr(vec![p(4096), p(100)], 4196, 16));
    assert_eq!(st[0].ios.status, STATUS_INVALID_PARAMETER);
    let (st, _) = direct(&mut s, &vr(vec![p(4096)], 8192, 17));
    assert_eq!(st[0].ios.status, STATUS_INVALID_PARAMETER);
    let (st, _) = direct(&mut s, &vr(vec![p(4096), p(512)], 4608, 18));
    assert_eq!(st[0].ios.status, STATUS_SUCCESS);
    // COLLAPSE on a file registered without FILE_NO_INTERMEDIATE_BUFFERING.
    let page = vec![1u8; 4096];
    let b = raw(RequestOp::VecWrite {
        fid,
        offset: 0,
        length: 8192,
        num_pages: 2,
        page_size: 4096,
        collapse: true,
        data: &page,
        mode: intr(19),
    });
    let (st, _) = direct(&mut s, &b);
    assert_eq!(st[0].ios.status, STATUS_INVALID_PARAMETER);
    // CLOSE / CANCEL of an unknown Fid.
    let (st, _) = direct(
        &mut s,
        &raw(RequestOp::Close {
            fid: 999,
            cookie: 20,
        }),
    );
    assert_eq!(st[0].ios.status, STATUS_INVALID_HANDLE);
    let (st, _) = direct(
        &mut s,
        &raw(RequestOp::Cancel {
            fid: 999,
            cookie: 21,
        }),
    );
    assert_eq!(st[0].ios.status, STATUS_INVALID_HANDLE);
    // Second INTERRUPT while one is pending.
    let (st, _) = direct(&mut s, &raw(RequestOp::Interrupt { cookie: 22 }));
    assert!(st.is_empty());
    let (st, _) = direct(&mut s, &raw(RequestOp::Interrupt { cookie: 23 }));
    assert_eq!(
        (st[0].cookie, st[0].ios.status),
        (23, STATUS_INVALID_DEVICE_REQUEST)
    );
    // The pending one is answered after the next I/O completion.
    let (st, _) = direct(&mut s, &read(fid, 0, 8, 24));
    assert_eq!(
        st.iter().map(|s| s.cookie).collect::<Vec<_>>(),
        vec![24, 22]
    );
    assert!(!s.server.is_closed());
    assert_eq!(s.server.outstanding(), 0);
}

#[test]
fn fatal_violations_terminate() {
    let cases: Vec<(&str, MakeMsg, CloseReason)> = vec![
        (
            "unknown opcode",
            Box::new(|_| {
                let mut b = raw(RequestOp::Close { fid: 1, cookie: 1 });
                b[4] = 0x0a;
                b
            }),
            CloseReason::ProtocolViolation("malformed message"),
        ),
        (
            "truncated",
            Box::new(|fid| raw(RequestOp::Close { fid, cookie: 1 })[..40].to_vec()),
            CloseReason::ProtocolViolation("malformed message"),
        ),
        (
            "write too large",
            Box::new(|fid| {
                raw(RequestOp::Write {
                    fid,
                    offset: 0,
                    data: &[0u8; 8193],
                    mode: intr(1),
                })
            }),
            CloseReason::PayloadTooLarge,
        ),
        (
            "too many regions",
            Box::new(|fid| {
                let regions = vec![
                    RdmaRegion {
                        data_va: 0,
                        data_mh: 0,
                        length: 4096
                    };
                    513
                ];
                raw(RequestOp::VecRead {
                    fid,
                    offset: 0,
                    length: 513 * 4096,
                    page_size: 4096,
                    regions,
                    mode: intr(1),
                })
            }),
            CloseReason::PayloadTooLarge,
        ),
        (
            "cookie 0",
            Box::new(|fid| raw(RequestOp::Close { fid, cookie: 0 })),
            CloseReason::ProtocolViolation("cookie 0"),
        ),
        (
            "credit without transaction",
            Box::new(|_| {
                raw(RequestOp::Credit {
                    cookie: 3,
                    value: 0,
                })
            }),
            CloseReason::ProtocolViolation("CREDIT without transaction"),
        ),
        (
            "second auth",
            Box::new(|_| {
                raw(RequestOp::Auth {
                    cookie: 3,
                    data_va: 0,
                    data_mh: 0,
                    params: &[0u8; 31],
                })
            }),
            CloseReason::ProtocolViolation("second AUTH"),
        ),
    ];
    for (name, make, reason) in cases {
        let mut s = Sim::new();
        s.connect();
        let fid = s.register(RK_PLAIN, 0);
        s.inject(make(fid));
        assert_eq!(s.server_closed, Some(reason), "{name}");
        // Nothing is processed afterwards.
        let (st, other) = direct(&mut s, &raw(RequestOp::Close { fid, cookie: 9 }));
        assert!(st.is_empty() && other.is_empty(), "{name}");
    }
}

#[test]
fn credit_overflow_terminates() {
    let mut s = Sim::new();
    s.connect();
    let fid = s.register(RK_PLAIN, 0);
    s.storage.defer = true;
    // 4 credits: four reads in flight are fine...
    for c in 1..=4u64 {
        s.inject(raw(RequestOp::Read {
            fid,
            offset: 0,
            length: 8,
            data_va: DATA.addr,
            data_mh: 2,
            mode: intr(100 + c),
        }));
    }
    assert!(s.server_closed.is_none());
    assert_eq!(s.server.outstanding(), 4);
    // ...the fifth is a credit overflow.
    s.inject(raw(RequestOp::Close { fid, cookie: 200 }));
    assert_eq!(s.server_closed, Some(CloseReason::CreditOverflow));
}

#[test]
fn client_respects_credits() {
    let mut s = Sim::new();
    s.connect();
    let fid = s.register(RK_PLAIN, 0);
    s.storage.defer = true;
    // Four credits: three for I/O, the last kept for INTERRUPT and CANCEL.
    for _ in 0..3 {
        s.client
            .read(s.now, fid, 0, 8, DATA, Mode::Interrupt)
            .unwrap();
    }
    assert_eq!(
        s.client.read(s.now, fid, 0, 8, DATA, Mode::Interrupt),
        Err(ClientError::NoCredits)
    );
    assert!(!s.client.can_issue() && s.client.can_interrupt());
    s.client.interrupt(s.now).unwrap();
    assert!(!s.client.can_interrupt());
    assert_eq!(s.client.outstanding(), 4);
    s.pump();
    s.release_held();
    assert_eq!(s.client.outstanding(), 0);
    assert!(s.client.can_issue());
}

#[test]
fn negative_credit_waits_for_free_slots() {
    let mut s = Sim::new();
    s.connect();
    let fid = s.register(RK_PLAIN, 0);
    s.storage.defer = true;
    let reqs: Vec<_> = (0..3).map(|_| s.read(fid, 0, 8, Mode::Interrupt)).collect();
    // The fourth credit, kept back from I/O, goes to an INTERRUPT.
    s.client.interrupt(s.now).unwrap();
    s.pump();
    s.server.start_credit_delta(s.now, -2).unwrap();
    s.pump();
    // All credits are busy: no CREDIT message could be sent yet.
    assert!(s.server.credit_transaction_active());
    assert_eq!(s.client.credits(), 4);
    assert_eq!(
        s.client.read(s.now, fid, 0, 8, DATA, Mode::Interrupt),
        Err(ClientError::NoCredits)
    );
    s.release_held();
    for r in reqs {
        assert_eq!(s.completion(r), Some((8, STATUS_SUCCESS)));
    }
    assert!(!s.server.credit_transaction_active());
    assert_eq!((s.client.credits(), s.server.credits()), (2, 2));
    assert!(s.server_closed.is_none());
    // Only one transaction at a time, and bounds.
    s.server.start_credit_delta(s.now, 1).unwrap();
    assert_eq!(
        s.server.start_credit_delta(s.now, 1),
        Err(CreditError::TransactionInProgress)
    );
    s.pump();
    assert_eq!(
        s.server.start_credit_delta(s.now, -3),
        Err(CreditError::OutOfRange)
    );
}

#[test]
fn credit_handshake_violations_and_timeout() {
    // Out-of-order negative credit values.
    let mut s = Sim::new();
    s.connect();
    s.server.start_credit_delta(s.now, -2).unwrap();
    s.c2s_fault = Some(Box::new(|b: Vec<u8>| {
        let mut b = b;
        if b[4] == Opcode::Credit as u8 {
            b[20..24].copy_from_slice(&(-1i32).to_le_bytes());
        }
        vec![b]
    }));
    s.pump();
    assert_eq!(
        s.server_closed,
        Some(CloseReason::ProtocolViolation("CREDIT out of order"))
    );

    // Dropped CREDIT replies: past the credit timeout the client counts as
    // slow, once; the connection and the transaction stay.
    let mut s = Sim::new();
    s.connect();
    s.c2s_fault = Some(Box::new(|b: Vec<u8>| {
        if b[4] == Opcode::Credit as u8 {
            vec![]
        } else {
            vec![b]
        }
    }));
    s.server.start_credit_delta(s.now, 1).unwrap();
    s.pump();
    let t = s.server.poll_timeout().unwrap();
    assert_eq!(t, s.now + Duration::from_secs(10));
    s.server.handle_timeout(t - Duration::from_nanos(1));
    assert_eq!(s.server.slow_credit_replies(), 0);
    s.server.handle_timeout(t);
    s.server.handle_timeout(t + Duration::from_secs(100));
    s.pump();
    assert_eq!(s.server_closed, None);
    assert_eq!(s.server.slow_credit_replies(), 1, "counted once");
    assert_eq!(s.server.poll_timeout(), None, "no timer left");
    assert!(s.server.credit_transaction_active());
}

/// A client that answers a credit transaction long after the credit
/// timeout (stopped, descheduled) keeps its connection: the late replies
/// complete the transaction and I/O goes on.
#[test]
fn slow_credit_replies_keep_the_connection() {
    for delta in [3, -2] {
        let mut s = Sim::new();
        s.connect();
        let fid = s.register(RK_PLAIN, 0);
        let before = s.server.credits();
        // The client is stopped: what the server sends waits for it.
        let held: std::rc::Rc<std::cell::RefCell<Vec<Vec<u8>>>> = Default::default();
        let h = held.clone();
        s.s2c_fault = Some(Box::new(move |b: Vec<u8>| {
            h.borrow_mut().push(b);
            vec![]
        }));
        s.server.start_credit_delta(s.now, delta).unwrap();
        s.pump();
        s.now += Duration::from_secs(30);
        s.server.handle_timeout(s.now);
        s.pump();
        assert_eq!(s.server_closed, None, "delta {delta}");
        assert_eq!(s.server.slow_credit_replies(), 1);
        // It runs again and finds the notification.
        s.s2c_fault = None;
        for m in held.borrow_mut().drain(..) {
            s.deliver(ToClient::Msg(m));
        }
        s.pump();
        assert!(!s.server.credit_transaction_active(), "delta {delta}");
        let want = (i32::from(before) + delta) as u16;
        assert_eq!(s.server.credits(), want);
        assert_eq!(s.client.credits(), want);
        assert_eq!(s.server_closed, None);
        assert_eq!(s.client_closed, None);
        let r = s.read(fid, 0, 32, Mode::Interrupt);
        s.pump();
        assert_eq!(s.completion(r), Some((32, STATUS_SUCCESS)));
        assert_eq!(s.mem.read_at(DATA.addr, 32), file_pattern(32));
    }
}

#[test]
fn dropped_and_duplicated_messages() {
    // Duplicated server status responses are ignored by the client.
    let mut s = Sim::new();
    s.connect();
    let fid = s.register(RK_PLAIN, 0);
    s.s2c_fault = Some(Box::new(|b: Vec<u8>| vec![b.clone(), b]));
    let r = s.read(fid, 0, 32, Mode::Interrupt);
    s.pump();
    assert_eq!(s.completion(r), Some((32, STATUS_SUCCESS)));
    assert_eq!(
        s.events
            .iter()
            .filter(|e| matches!(e, ClientEvent::Completed { req, .. } if *req == r))
            .count(),
        1
    );
    assert!(!s.client.is_closed());

    // A dropped request leaves it outstanding on the client (no completion).
    let mut s = Sim::new();
    s.connect();
    let fid = s.register(RK_PLAIN, 0);
    s.c2s_fault = Some(Box::new(|_b: Vec<u8>| vec![]));
    let r = s.read(fid, 0, 32, Mode::Interrupt);
    s.pump();
    assert_eq!(s.completion(r), None);
    assert_eq!(s.client.outstanding(), 1);

    // A duplicated request is executed twice by the server (no dedup), the
    // client reports one completion.
    let mut s = Sim::new();
    s.connect();
    let fid = s.register(RK_PLAIN, 0);
    s.c2s_fault = Some(Box::new(|b: Vec<u8>| vec![b.clone(), b]));
    let r = s
        .client
        .write(s.now, fid, 0, b"dup", Mode::Interrupt)
        .unwrap()
        .req;
    s.pump();
    assert_eq!(s.completion(r), Some((3, STATUS_SUCCESS)));
    assert!(!s.client.is_closed() && s.server_closed.is_none());

    // A truncated status response makes the client terminate.
    let mut s = Sim::new();
    s.connect();
    let fid = s.register(RK_PLAIN, 0);
    s.s2c_fault = Some(Box::new(|b: Vec<u8>| vec![b[..12].to_vec()]));
    s.client
        .read(s.now, fid, 0, 32, DATA, Mode::Interrupt)
        .unwrap();
    s.pump();
    assert_eq!(
        s.client_closed,
        Some(CloseReason::ServerMisbehaved("malformed status response"))
    );
}

#[test]
fn client_rejects_bad_credit_delta() {
    let mut s = Sim::new();
    s.connect();
    let d = StatusResponse {
        cookie: 0,
        ios: IoStatusBlock {
            information: (-10i32) as u32,
            status: LWIO_NOTIFY_CREDIT,
        },
    };
    s.client.handle_recv(s.now, &d.to_bytes(), &s.mem);
    assert!(s.client.is_closed());
}

#[test]
fn server_auth_params_are_what_the_doc_says() {
    let mut s = Sim::new();
    s.connect();
    let ev = s.events.iter().find_map(|e| match e {
        ClientEvent::Authenticated { server, .. } => Some(server.clone()),
        _ => None,
    });
    let p: AuthParamsRepr = ev.unwrap();
    assert_eq!(p.rev_id, LWIO_REV_ID);
    assert_eq!(p.header_size, 56);
    assert_eq!(p.base_sequence, 1);
    assert_eq!(p.max_recv_buffer_size, 8192);
    assert_eq!(p.credits, 4);
    assert_eq!(p.key, Some(KEY));
    assert_eq!(p.session_id, Some(SESSION));
    assert_eq!(p.signature.as_ref().map(|s| s.len()), Some(32));
}

#[test]
fn close_with_io_in_flight_defers_close_file() {
    let mut s = Sim::new();
    s.connect();
    let fid = s.register(RK_PLAIN, 0);
    s.storage.defer = true;
    let r = s.read(fid, 0, 64, Mode::Polled);
    s.pump();
    let c = s.client.close_file(s.now, fid).unwrap();
    s.pump();
    assert_eq!(s.completion(c), Some((0, STATUS_SUCCESS)));
    assert!(
        s.storage.closed_files.is_empty(),
        "file still has I/O in flight"
    );
    assert_eq!(s.server.open_fids(), 0);
    assert_eq!(s.server.registered_files(), vec![(fid, 1)]);
    s.release_held();
    assert_eq!(s.completion(r), Some((64, STATUS_SUCCESS)));
    assert_eq!(s.storage.closed_files, vec![(fid, 1)]);
    // Fids are not reused right away.
    assert_eq!(s.register(RK_PLAIN, 0), fid + 1);
}

/// FLUSH (§5.13): offered in the server's AUTH answer; storage syncs the
/// Fid's file, and the status comes back when it is done; a CLOSE waits
/// for it like for an I/O; a storage failure is the answer; an unknown
/// Fid is INVALID_HANDLE without touching storage.
#[test]
fn flush_syncs_the_file_and_a_close_waits_for_it() {
    let mut s = Sim::new();
    assert!(!s.client.server_flushes(), "nothing known before AUTH");
    s.connect();
    assert!(s.client.server_flushes());
    let fid = s.register(RK_PLAIN, 0);
    let f = s.client.flush(s.now, fid, true).unwrap();
    s.pump();
    assert_eq!(s.completion(f), Some((0, STATUS_SUCCESS)));
    assert_eq!(s.storage.synced, vec![(1, true)]);
    // Held at storage: not answered, and the CLOSE does not close the file.
    s.storage.defer = true;
    let f = s.client.flush(s.now, fid, false).unwrap();
    s.pump();
    assert_eq!(s.completion(f), None);
    let c = s.client.close_file(s.now, fid).unwrap();
    s.pump();
    assert_eq!(s.completion(c), Some((0, STATUS_SUCCESS)));
    assert!(s.storage.closed_files.is_empty(), "closed under a FLUSH");
    s.storage.sync_fails = Some(STATUS_DISK_FULL);
    s.release_held();
    assert_eq!(s.completion(f), Some((0, STATUS_DISK_FULL)));
    assert_eq!(s.storage.synced, vec![(1, true), (1, false)]);
    assert_eq!(s.storage.closed_files, vec![(fid, 1)]);
    // The Fid is gone: refused at once, storage untouched.
    let f = s.client.flush(s.now, fid, true).unwrap();
    s.pump();
    assert_eq!(s.completion(f), Some((0, STATUS_INVALID_HANDLE)));
    assert_eq!(s.storage.synced.len(), 2);
    let st = s.server.request_stats();
    assert_eq!(st.op(Opcode::Flush).requests, 3);
}

/// A FLUSH sent behind writes that are still at storage (a client that did
/// not wait for their answers: the mount's unstable writes) syncs only
/// after every one of them, of any Fid, has reached storage; a CANCEL
/// withdraws a FLUSH still waiting.
#[test]
fn flush_waits_for_the_writes_received_before_it() {
    let mut s = Sim::new();
    s.connect();
    let a = s.register(RK_PLAIN, 0);
    let b = s.register(RK_PLAIN, 0);
    s.storage.defer = true;
    let w1 = s
        .client
        .write(s.now, a, 0, b"first", Mode::Interrupt)
        .unwrap()
        .req;
    let w2 = s
        .client
        .write(s.now, b, 8, b"second", Mode::Interrupt)
        .unwrap()
        .req;
    let f = s.client.flush(s.now, a, true).unwrap();
    s.pump();
    // Both writes are at storage; the sync has not been asked for.
    assert_eq!(s.storage.held.len(), 2, "{:?}", s.storage.held);
    assert!(s
        .storage
        .held
        .iter()
        .all(|x| matches!(x, ServerAction::FileWrite { .. })));
    // The first write lands: the sync still waits for the second.
    let first = s.storage.held.remove(0);
    let (op, r) = s.storage.perform(&first);
    s.server.handle_storage_complete(s.now, op, r);
    s.pump();
    assert_eq!(s.completion(w1), Some((5, STATUS_SUCCESS)));
    assert!(s
        .storage
        .held
        .iter()
        .all(|x| !matches!(x, ServerAction::FileSync { .. })));
    assert_eq!(s.completion(f), None);
    // The second lands: now the sync goes to storage, and is answered.
    s.release_held();
    assert_eq!(s.completion(w2), Some((6, STATUS_SUCCESS)));
    assert!(s.storage.synced.is_empty(), "synced with the writes");
    s.release_held();
    assert_eq!(s.completion(f), Some((0, STATUS_SUCCESS)));
    assert_eq!(s.storage.synced, vec![(1, true)]);
    assert_eq!(&s.storage.files[&1][..5], b"first");

    // A FLUSH held behind a write is withdrawn by a CANCEL of its Fid: it
    // never syncs, and the write is unaffected.
    let w = s
        .client
        .write(s.now, b, 0, b"third", Mode::Interrupt)
        .unwrap()
        .req;
    let f = s.client.flush(s.now, a, false).unwrap();
    s.pump();
    s.client.cancel(s.now, a).unwrap();
    s.pump();
    assert_eq!(s.completion(f), Some((0, STATUS_CANCELLED)));
    s.release_held();
    assert_eq!(s.completion(w), Some((5, STATUS_SUCCESS)));
    s.release_held();
    assert_eq!(
        s.storage.synced,
        vec![(1, true)],
        "a withdrawn FLUSH synced"
    );
}

/// A server that does not offer FLUSH (a seed-only or older peer) is
/// never sent one.
#[test]
fn flush_is_not_sent_to_a_server_that_did_not_offer_it() {
    let cfg = ServerConfig {
        flush: false,
        ..server_cfg()
    };
    let mut s = Sim::with(cfg, client_cfg());
    s.connect();
    assert!(!s.client.server_flushes());
    let fid = s.register(RK_PLAIN, 0);
    assert_eq!(
        s.client.flush(s.now, fid, true),
        Err(ClientError::InvalidArgument)
    );
    // One sent anyway (a broken client) is refused, storage untouched.
    s.inject(raw(RequestOp::Flush {
        fid,
        cookie: 9,
        data_only: true,
    }));
    assert!(s.storage.synced.is_empty());
    assert!(s.server_closed.is_none());
}

#[test]
fn nothing_after_close_connection() {
    let mut s = Sim::new();
    s.connect();
    let fid = s.register(RK_PLAIN, 0);
    s.storage.defer = true;
    s.client
        .read(s.now, fid, 0, 64, DATA, Mode::Interrupt)
        .unwrap();
    s.pump();
    s.inject(raw(RequestOp::Close { fid, cookie: 0 }));
    assert_eq!(
        s.server_closed,
        Some(CloseReason::ProtocolViolation("cookie 0"))
    );
    let held = std::mem::take(&mut s.storage.held);
    for a in held {
        let (op, r) = s.storage.perform(&a);
        s.server.handle_storage_complete(s.now, op, r);
    }
    assert_eq!(s.server.poll_action(), None);
    assert_eq!(
        s.server.start_credit_delta(s.now, 1),
        Err(CreditError::Closed)
    );
    assert_eq!(s.server.poll_timeout(), None);
}

#[test]
fn polled_sentinel_is_ignored_and_immediate_only_on_last_region() {
    let mut scfg = server_cfg();
    scfg.use_write_with_imm = true;
    let mut s = Sim::with(scfg, client_cfg());
    s.connect();
    let fid = s.register(RK_PLAIN, 0);
    // Sentinel reads as "not yet written".
    s.storage.defer = true;
    let r = s.read(fid, 0, 8, Mode::Polled);
    s.pump();
    let slot = s.client.polled_slots()[0];
    assert_eq!(
        s.mem.read_at(IOS_BASE + 8 * u64::from(slot), 8),
        IoStatusBlock::SENTINEL.to_bytes().to_vec()
    );
    s.client
        .status_block_updated(s.now, slot, u32::MAX, u32::MAX);
    assert_eq!(s.client.outstanding(), 1);
    // A block caught half placed (the Information and the low bytes of
    // Status new, the top byte still the sentinel's) is not a completion.
    s.client.status_block_updated(s.now, slot, 8, 0xFFFF_FF00);
    s.client.status_block_updated(s.now, slot, 8, 0xFF00_0000);
    assert_eq!(s.client.outstanding(), 1);
    s.release_held();
    assert_eq!(s.completion(r), Some((8, STATUS_SUCCESS)));

    // VEC_READ with immediate: one RDMA write per region, imm on the last.
    s.storage.defer = false;
    let regions = [
        RdmaRegion {
            data_va: PAGES,
            data_mh: 4,
            length: 4096,
        },
        RdmaRegion {
            data_va: PAGES + 4096,
            data_mh: 4,
            length: 512,
        },
    ];
    s.client
        .vec_read(s.now, fid, 0, 4608, 4096, &regions, Mode::Interrupt)
        .unwrap();
    let send = match &s.client.transmit_all()[..] {
        [b] => b.clone(),
        m => panic!("{m:?}"),
    };
    s.server.handle_recv(s.now, &send, &mut s.hooks);
    let read = match s.server.poll_action() {
        Some(a @ ServerAction::FileRead { .. }) => a,
        a => panic!("{a:?}"),
    };
    let (op, res) = s.storage.perform(&read);
    s.server.handle_storage_complete(s.now, op, res);
    let acts: Vec<_> = std::iter::from_fn(|| s.server.poll_action()).collect();
    let imms: Vec<_> = acts
        .iter()
        .filter_map(|a| match a {
            ServerAction::RdmaWrite {
                imm,
                data: DataSource::ReadBuffer { .. },
                ..
            } => Some(*imm),
            _ => None,
        })
        .collect();
    assert_eq!(imms.len(), 2);
    assert_eq!(imms[0], None);
    assert!(imms[1].is_some());
    assert!(
        !acts.iter().any(|a| matches!(a, ServerAction::Send(_))),
        "no status response"
    );
    assert_eq!(acts.last(), Some(&ServerAction::ReleaseReadBuffer { op }));
}

/// A server whose device sends RDMA Writes with Immediate completes a full
/// interrupt-mode read with one only for a client that said in AUTH
/// (FEATURES bit 1) that its device receives them; any other client (a
/// seed-only one, or lwio on Linux siw, which would answer the RFC 7306
/// Immediate Data with a Terminate) gets its status message.
#[test]
fn immediate_completion_only_for_a_client_that_accepts_it() {
    for accepts in [false, true] {
        let mut scfg = server_cfg();
        scfg.use_write_with_imm = true;
        let mut ccfg = client_cfg();
        ccfg.accepts_immediate = accepts;
        let mut s = Sim::with(scfg, ccfg);
        s.connect();
        let fid = s.register(RK_PLAIN, 0);
        let file = file_pattern(10_000);
        for i in 0..3u64 {
            let r = s.read(fid, 1000 * i, 500, Mode::Interrupt);
            s.pump();
            assert_eq!(
                s.completion(r),
                Some((500, STATUS_SUCCESS)),
                "accepts {accepts}"
            );
            assert_eq!(
                s.mem.read_at(DATA.addr, 500),
                file[1000 * i as usize..1000 * i as usize + 500]
            );
        }
        assert_eq!(s.imms, if accepts { 3 } else { 0 }, "accepts {accepts}");
        assert!(!s.recv_overrun && s.server_closed.is_none());
    }
}

#[test]
fn positive_credit_reply_rules() {
    // The unused-credit value is recorded; a value above N terminates.
    let mut s = Sim::new();
    s.connect();
    s.server.start_credit_delta(s.now, 3).unwrap();
    assert_eq!(
        s.server.credits(),
        7,
        "positive delta takes effect when sent"
    );
    let delta = s.server.poll_action().unwrap();
    let want = StatusResponse {
        cookie: 0,
        ios: IoStatusBlock {
            information: 3,
            status: LWIO_NOTIFY_CREDIT,
        },
    };
    assert_eq!(delta, ServerAction::Send(want.to_bytes().to_vec()));
    let (st, _) = direct(
        &mut s,
        &raw(RequestOp::Credit {
            cookie: 31,
            value: 2,
        }),
    );
    assert_eq!((st[0].cookie, st[0].ios.status), (31, STATUS_SUCCESS));
    assert_eq!(s.server.unused_credits_reported(), 2);
    assert!(!s.server.credit_transaction_active());
    // A second CREDIT for the finished transaction is a violation.
    let (st, other) = direct(
        &mut s,
        &raw(RequestOp::Credit {
            cookie: 32,
            value: 0,
        }),
    );
    assert!(st.is_empty());
    assert_eq!(
        other,
        vec![ServerAction::CloseConnection(
            CloseReason::ProtocolViolation("CREDIT without transaction")
        )]
    );

    let mut s = Sim::new();
    s.connect();
    s.server.start_credit_delta(s.now, 1).unwrap();
    while s.server.poll_action().is_some() {}
    let (_, other) = direct(
        &mut s,
        &raw(RequestOp::Credit {
            cookie: 33,
            value: 2,
        }),
    );
    assert_eq!(
        other,
        vec![ServerAction::CloseConnection(
            CloseReason::ProtocolViolation("bad CREDIT value")
        )]
    );
}

/// A polled request whose status block is reachable only through its own
/// key (`Mode::PolledWindow`): the request names the slot that
/// `next_status_slot` announced and that key, so the server's status write
/// lands through a window over those 8 bytes alone; the area's key is not
/// sent (a write with it would miss the window and fail the sim).
#[test]
fn polled_window_names_its_own_status_block_key() {
    let mut s = Sim::new();
    s.connect();
    let fid = s.register(RK_PLAIN, 0);
    for round in 0..3u32 {
        let (slot, addr) = s.client.next_status_slot().unwrap();
        assert_eq!(addr, IOS_BASE + 8 * u64::from(slot));
        let key = 0x7700 + round;
        // The window: exactly this slot, under its own key, found before
        // the status area (whose key is 3).
        s.mem.regions.insert(
            0,
            Region {
                addr,
                rkey: key,
                bytes: IoStatusBlock::SENTINEL.to_bytes().to_vec(),
            },
        );
        let r = s
            .client
            .read(
                s.now,
                fid,
                64 * u64::from(round),
                64,
                DATA,
                Mode::PolledWindow(key),
            )
            .unwrap();
        assert_eq!(r.slot, Some(slot), "issued with the slot named before");
        let r = r.req;
        assert_eq!(s.client.slot_of(r), Some(slot));
        s.pump();
        assert_eq!(s.completion(r), Some((64, STATUS_SUCCESS)));
        assert_eq!(s.client.slot_of(r), None, "completed: no slot");
        // The window goes with the request.
        s.mem.regions.remove(0);
    }
}

/// The slot of a completed `Mode::PolledWindow` request is not used again
/// until the caller releases it (its window's invalidation completed): an
/// old key that still reached it could otherwise write the next request's
/// status. A slot of the area's own key (`Mode::Polled`) serves again at
/// once.
#[test]
fn a_windowed_status_slot_waits_for_its_release() {
    let mut s = Sim::new();
    s.connect();
    let fid = s.register(RK_PLAIN, 0);
    let (slot, addr) = s.client.next_status_slot().unwrap();
    s.mem.regions.insert(
        0,
        Region {
            addr,
            rkey: 0x7700,
            bytes: IoStatusBlock::SENTINEL.to_bytes().to_vec(),
        },
    );
    let r = s
        .client
        .read(s.now, fid, 0, 64, DATA, Mode::PolledWindow(0x7700))
        .unwrap()
        .req;
    s.pump();
    assert_eq!(s.completion(r), Some((64, STATUS_SUCCESS)));
    s.mem.regions.remove(0);
    assert_eq!(s.client.fenced_slots(), 1);
    let (next, _) = s.client.next_status_slot().unwrap();
    assert_ne!(next, slot, "reused before its window was released");
    // Another request meanwhile takes another slot.
    let r2 = s.read(fid, 64, 64, Mode::Polled);
    assert_eq!(s.client.slot_of(r2), Some(next));
    s.pump();
    assert_eq!(s.completion(r2), Some((64, STATUS_SUCCESS)));
    // The area's key: back at once.
    assert_eq!(s.client.next_status_slot().unwrap().0, next);
    s.client.release_slot(slot);
    assert_eq!(s.client.fenced_slots(), 0);
    assert!(
        (0..16).any(|_| {
            let (n, _) = s.client.next_status_slot().unwrap();
            let r = s.read(fid, 0, 8, Mode::Polled);
            s.pump();
            assert_eq!(s.completion(r), Some((8, STATUS_SUCCESS)));
            n == slot
        }),
        "a released slot never served again"
    );
}

/// CANCEL naming one request (§5.9) cancels that request only, whatever
/// its completion mode; the others of the Fid go on and complete normally.
/// A request that already completed can no longer be named.
#[test]
fn cancel_request_cancels_only_that_request() {
    for target_mode in [Mode::Interrupt, Mode::Polled] {
        let mut s = Sim::new();
        s.connect();
        let fid = s.register(RK_PLAIN, 0);
        s.storage.defer = true;
        let a = s.read(fid, 0, 64, Mode::Polled);
        let b = s.read(fid, 64, 64, target_mode);
        let c = s.read(fid, 128, 64, Mode::Interrupt);
        s.pump();
        assert_eq!(s.storage.held.len(), 3);
        let k = s.client.cancel_request(s.now, fid, b).unwrap();
        s.pump();
        assert_eq!(s.completion(k), Some((0, STATUS_SUCCESS)));
        assert_eq!(
            s.completion(b),
            Some((0, STATUS_CANCELLED)),
            "{target_mode:?}"
        );
        assert_eq!(s.completion(a), None, "{target_mode:?}: not named");
        assert_eq!(s.completion(c), None, "{target_mode:?}: not named");
        assert_eq!(s.storage.held.len(), 2);
        s.release_held();
        assert_eq!(s.completion(a), Some((64, STATUS_SUCCESS)));
        assert_eq!(s.completion(c), Some((64, STATUS_SUCCESS)));
        assert_eq!(
            s.client.cancel_request(s.now, fid, a),
            Err(ClientError::InvalidArgument)
        );
        assert_eq!(s.client.outstanding(), 0);
        assert_eq!(s.server.outstanding(), 0);
    }
}

/// A READ and the CANCEL naming it that arrive in one batch (the server
/// handles both before its embedder takes any action): the read is
/// withdrawn before any storage or inline I/O starts it, and completes with
/// STATUS_CANCELLED; a read of another request in the same batch is not.
#[test]
fn cancel_in_the_same_batch_withdraws_the_unstarted_io() {
    for whole_fid in [false, true] {
        let mut s = Sim::new();
        s.connect();
        let fid = s.register(RK_PLAIN, 0);
        let keep = s.read(fid, 0, 64, Mode::Interrupt);
        let r = s.read(fid, 64, 64, Mode::Polled);
        let k = if whole_fid {
            s.client.cancel(s.now, fid).unwrap()
        } else {
            s.client.cancel_request(s.now, fid, r).unwrap()
        };
        let msgs = s.client.transmit_all();
        while let Some(a) = s.client.poll_action() {
            match a {
                ClientAction::ResetStatusBlock { addr, .. } => {
                    assert!(s.mem.local_write(addr, &IoStatusBlock::SENTINEL.to_bytes()))
                }
                a => panic!("{a:?}"),
            }
        }
        assert_eq!(msgs.len(), 3);
        for m in &msgs {
            s.server.handle_recv(s.now, m, &mut s.hooks);
        }
        let acts: Vec<ServerAction> = std::iter::from_fn(|| s.server.poll_action()).collect();
        let reads: Vec<u64> = acts
            .iter()
            .filter_map(|a| match a {
                ServerAction::FileRead { offset, .. } => Some(*offset),
                _ => None,
            })
            .collect();
        assert_eq!(reads, if whole_fid { vec![] } else { vec![0] });
        for a in acts {
            s.server_action(a);
        }
        s.pump();
        assert_eq!(s.completion(k), Some((0, STATUS_SUCCESS)));
        assert_eq!(s.completion(r), Some((0, STATUS_CANCELLED)));
        let want = if whole_fid {
            (0, STATUS_CANCELLED)
        } else {
            (64, STATUS_SUCCESS)
        };
        assert_eq!(s.completion(keep), Some(want));
        assert_eq!(s.client.outstanding(), 0);
        assert_eq!(s.server.outstanding(), 0);
        assert!(s.server_closed.is_none() && s.client_closed.is_none());
    }
}

/// The server counts what it serves (the metrics of `lwio serve --metrics`
/// and `lwio stats`): requests, answers and bytes by opcode, latency from
/// arrival to answer on the fake clock, and error statuses.
#[test]
fn server_request_stats_follow_the_fake_clock() {
    let mut s = Sim::new();
    s.connect();
    let fid = s.register(RK_PLAIN, 0);
    // A READ held at the storage for 300 µs.
    s.storage.defer = true;
    let r = s
        .client
        .read(s.now, fid, 0, 4000, DATA, Mode::Polled)
        .unwrap()
        .req;
    s.pump();
    s.now += Duration::from_micros(300);
    s.release_held();
    s.pump();
    assert_eq!(s.completion(r), Some((4000, STATUS_SUCCESS)));
    s.storage.defer = false;
    let w = s
        .client
        .write(s.now, fid, 100, b"hello", Mode::Interrupt)
        .unwrap()
        .req;
    s.pump();
    assert_eq!(s.completion(w), Some((5, STATUS_SUCCESS)));
    // A READ of a Fid never registered: refused at once.
    let bad = s
        .client
        .read(s.now, fid + 7, 0, 10, DATA, Mode::Interrupt)
        .unwrap()
        .req;
    s.pump();
    assert_eq!(s.completion(bad), Some((0, STATUS_INVALID_HANDLE)));

    let st = s.server.request_stats().clone();
    for op in [Opcode::Auth, Opcode::Register, Opcode::Write] {
        let o = st.op(op);
        assert_eq!((o.requests, o.completed), (1, 1), "{op:?}");
    }
    assert_eq!(st.op(Opcode::Write).bytes, 5);
    let rd = st.op(Opcode::Read);
    assert_eq!((rd.requests, rd.completed, rd.bytes), (2, 2, 4000));
    // 300 µs lands in the ≤ 500 µs bucket, the refusal (no time passed) in
    // the first; nothing else.
    let i500 = lwio_proto::stats::LATENCY_BOUNDS_US
        .iter()
        .position(|&b| b == 500)
        .unwrap();
    assert_eq!(rd.latency_buckets[i500], 1);
    assert_eq!(rd.latency_buckets[0], 1);
    assert_eq!(rd.latency_buckets.iter().sum::<u64>(), 2);
    assert_eq!(rd.latency_sum_ns, 300_000);
    assert_eq!(st.op(Opcode::Close).requests, 0);
    assert_eq!(
        st.errors.iter().map(|(k, v)| (*k, *v)).collect::<Vec<_>>(),
        vec![(STATUS_INVALID_HANDLE, 1)]
    );
    // Handed over once.
    assert_eq!(s.server.take_request_stats(), st);
    assert!(s.server.request_stats().is_empty());
}

// ------------------------------------------------ the client owns requests

fn timed_cfg(op: Duration) -> ClientConfig {
    let mut c = client_cfg();
    c.op_timeout = Some(op);
    c
}

fn timed_out_events(s: &Sim) -> Vec<(ReqId, Opcode)> {
    s.events
        .iter()
        .filter_map(|e| match e {
            ClientEvent::TimedOut { req, opcode } => Some((*req, *opcode)),
            _ => None,
        })
        .collect()
}

#[test]
fn unanswered_request_times_out_at_its_deadline_and_stays_outstanding() {
    let op = Duration::from_secs(5);
    for mode in [Mode::Interrupt, Mode::Polled] {
        let mut s = Sim::with(server_cfg(), timed_cfg(op));
        s.connect();
        let fid = s.register(RK_PLAIN, 0);
        assert_eq!(s.client.poll_timeout(), None, "nothing outstanding");
        s.storage.defer = true;
        let issued = s.client.read(s.now, fid, 0, 64, DATA, mode).unwrap();
        let r = issued.req;
        s.pump();
        let deadline = s.now + op;
        assert_eq!(s.client.poll_timeout(), Some(deadline));
        // One nanosecond early: nothing.
        s.client.handle_timeout(deadline - Duration::from_nanos(1));
        s.pump();
        assert!(timed_out_events(&s).is_empty());
        assert!(!s.client.is_timed_out(r));
        // At the deadline: exactly one TimedOut, naming the request.
        s.client.handle_timeout(deadline);
        s.client.handle_timeout(deadline + op);
        s.pump();
        assert_eq!(timed_out_events(&s), vec![(r, Opcode::Read)]);
        assert!(s.client.is_timed_out(r));
        assert_eq!(s.client.poll_timeout(), None, "no deadline left");
        // Still outstanding: its credit and status block stay taken, and
        // the connection stays up.
        assert!(s.client.is_outstanding(r));
        assert_eq!(s.client.outstanding(), 1);
        assert_eq!(s.client.slot_of(r), issued.slot);
        assert!(s.client_closed.is_none());
        assert_eq!(s.client.take_done(r), None);
        // The late answer completes it as usual.
        s.release_held();
        assert_eq!(s.completion(r), Some((64, STATUS_SUCCESS)));
        assert!(!s.client.is_timed_out(r));
        let d = s.client.take_done(r).expect("kept until taken");
        assert_eq!((d.information, d.status), (64, STATUS_SUCCESS));
        assert_eq!(s.client.outstanding(), 0);
    }
}

#[test]
fn request_answered_just_before_its_deadline_does_not_time_out() {
    let op = Duration::from_secs(5);
    let mut s = Sim::with(server_cfg(), timed_cfg(op));
    s.connect();
    let fid = s.register(RK_PLAIN, 0);
    let start = s.now;
    s.storage.defer = true;
    let r = s.read(fid, 0, 32, Mode::Interrupt);
    s.pump();
    // Time passes; the answer comes 1 ms before the deadline.
    s.now = start + op - Duration::from_millis(1);
    s.client.handle_timeout(s.now);
    s.release_held();
    assert_eq!(s.completion(r), Some((32, STATUS_SUCCESS)));
    s.client.handle_timeout(start + op * 10);
    s.pump();
    assert!(timed_out_events(&s).is_empty());
    assert_eq!(s.client.poll_timeout(), None);
    assert!(s.client_closed.is_none());
}

#[test]
fn deadlines_run_from_each_request_issue() {
    let op = Duration::from_secs(5);
    let mut s = Sim::with(server_cfg(), timed_cfg(op));
    s.connect();
    let fid = s.register(RK_PLAIN, 0);
    s.storage.defer = true;
    let t0 = s.now;
    let a = s
        .client
        .read(t0, fid, 0, 8, DATA, Mode::Interrupt)
        .unwrap()
        .req;
    let t1 = t0 + Duration::from_secs(2);
    s.now = t1;
    let b = s
        .client
        .read(t1, fid, 8, 8, DATA, Mode::Interrupt)
        .unwrap()
        .req;
    s.pump();
    assert_eq!(s.client.poll_timeout(), Some(t0 + op));
    s.client.handle_timeout(t0 + op);
    s.pump();
    assert_eq!(timed_out_events(&s), vec![(a, Opcode::Read)]);
    assert_eq!(s.client.poll_timeout(), Some(t1 + op));
    s.client.handle_timeout(t1 + op);
    s.pump();
    assert_eq!(
        timed_out_events(&s),
        vec![(a, Opcode::Read), (b, Opcode::Read)]
    );
}

#[test]
fn interrupt_has_no_deadline() {
    let op = Duration::from_secs(5);
    let mut s = Sim::with(server_cfg(), timed_cfg(op));
    s.connect();
    let fid = s.register(RK_PLAIN, 0);
    let irq = s.client.interrupt(s.now).unwrap();
    s.pump();
    assert_eq!(s.client.interrupt_outstanding(), Some(irq));
    assert_eq!(s.client.poll_timeout(), None);
    s.client.handle_timeout(s.now + op * 100);
    s.pump();
    assert!(timed_out_events(&s).is_empty());
    // Answered after the next I/O completion, then gone.
    let r = s.read(fid, 0, 8, Mode::Interrupt);
    s.pump();
    assert_eq!(s.completion(r), Some((8, STATUS_SUCCESS)));
    assert_eq!(s.completion(irq), Some((0, STATUS_SUCCESS)));
    assert_eq!(s.client.interrupt_outstanding(), None);
    let d = s.client.take_done(irq).expect("kept until taken");
    assert_eq!(d.opcode, Opcode::Interrupt);
}

#[test]
fn unanswered_credit_reply_closes_the_connection() {
    let op = Duration::from_secs(5);
    let mut s = Sim::with(server_cfg(), timed_cfg(op));
    s.connect();
    // The server's delta reaches the client; its answer to the client's
    // CREDIT reply is lost.
    let mut n = 0;
    s.s2c_fault = Some(Box::new(move |b: Vec<u8>| {
        n += 1;
        if n == 1 {
            vec![b]
        } else {
            vec![]
        }
    }));
    s.server.start_credit_delta(s.now, 1).unwrap();
    s.pump();
    assert_eq!(s.client.credits(), 5, "the delta was applied");
    assert_eq!(s.client.outstanding(), 1, "the CREDIT reply waits");
    assert_eq!(s.client.poll_timeout(), Some(s.now + op));
    s.client
        .handle_timeout(s.now + op - Duration::from_nanos(1));
    s.pump();
    assert!(s.client_closed.is_none());
    s.client.handle_timeout(s.now + op);
    s.pump();
    assert_eq!(s.client_closed, Some(CloseReason::CreditTimeout));
    assert!(s.client.is_closed());
    assert!(timed_out_events(&s).is_empty(), "no request event for it");
    assert_eq!(s.client.poll_timeout(), None);
}

#[test]
fn answered_credit_reply_does_not_time_out() {
    let op = Duration::from_secs(5);
    let mut s = Sim::with(server_cfg(), timed_cfg(op));
    s.connect();
    s.server.start_credit_delta(s.now, 1).unwrap();
    s.pump();
    assert_eq!(s.client.outstanding(), 0);
    s.client.handle_timeout(s.now + op * 2);
    s.pump();
    assert!(s.client_closed.is_none());
    assert_eq!(s.client.credits(), 5);
}

#[test]
fn completed_requests_keep_their_data_until_taken_once() {
    for mode in [Mode::Interrupt, Mode::Polled] {
        let mut s = Sim::new();
        s.connect();
        let fid = s.register(RK_PLAIN, 0);
        let a = s.read(fid, 0, 16, mode);
        let b = s.client.write(s.now, fid, 0, b"xy", mode).unwrap().req;
        *s.client.user_mut(a).unwrap() = 11;
        *s.client.user_mut(b).unwrap() = 22;
        let mut users: Vec<u32> = s.client.outstanding_users().copied().collect();
        users.sort_unstable();
        assert_eq!(users, vec![11, 22]);
        s.pump();
        assert_eq!(s.client.outstanding(), 0);
        assert_eq!(s.client.outstanding_users().count(), 0);
        assert!(s.client.is_done(a) && s.client.is_done(b));
        // Reachable after completion, for the driver's clean-up.
        assert_eq!(s.client.user_mut(a).copied(), Some(11));
        let d = s.client.take_done(b).unwrap();
        assert_eq!(d.user, 22);
        assert_eq!(
            (d.opcode, d.information, d.status),
            (Opcode::Write, 2, STATUS_SUCCESS)
        );
        assert_eq!(s.client.take_done(b), None, "taken once");
        assert_eq!(s.client.user_mut(b), None);
        let d = s.client.take_done(a).unwrap();
        assert_eq!((d.user, d.information), (11, 16));
        // Unknown requests have no data.
        assert_eq!(s.client.user_mut(12345), None);
    }
}

#[test]
fn issue_returns_the_status_block_it_completes_through() {
    let mut s = Sim::new();
    s.connect();
    let fid = s.register(RK_PLAIN, 0);
    let i = s
        .client
        .read(s.now, fid, 0, 8, DATA, Mode::Interrupt)
        .unwrap();
    assert_eq!(i.slot, None);
    let mut seen = Vec::new();
    // (Three of the four credits are for I/O.)
    for k in 0..2u64 {
        let next = s.client.next_status_slot().map(|(slot, _)| slot);
        let p = s
            .client
            .read(s.now, fid, 8 * k, 8, DATA, Mode::Polled)
            .unwrap();
        assert_eq!(p.slot, next);
        assert_eq!(s.client.slot_of(p.req), p.slot);
        seen.push(p.slot.unwrap());
    }
    // Different blocks, each reset before its request leaves.
    let resets: Vec<u32> = std::iter::from_fn(|| s.client.poll_action())
        .filter_map(|a| match a {
            ClientAction::ResetStatusBlock { slot, .. } => Some(slot),
            _ => None,
        })
        .collect();
    assert_eq!(resets, seen);
    let mut d = seen.clone();
    d.dedup();
    assert_eq!(d.len(), 2);
}

#[test]
fn preposted_receives_are_not_asked_for_again() {
    for pre in [0u32, 5, 9] {
        let mut cc = client_cfg();
        cc.recvs_preposted = pre;
        let mut s = Sim::with(server_cfg(), cc);
        s.client_recvs = pre;
        s.client.start(s.now).unwrap();
        let asked: u32 = std::iter::from_fn(|| s.client.poll_action())
            .filter_map(|a| match a {
                ClientAction::PostRecv(n) => Some(n),
                _ => None,
            })
            .sum();
        // Before AUTH: one credit, so two receives (credits + 1).
        assert_eq!(asked, 2u32.saturating_sub(pre), "preposted {pre}");
        s.client_recvs += asked;
        s.pump();
        assert!(s.client.is_authenticated());
        // Granted 4: credits + 1 = 5 posted, or what is left of more
        // posted before connect (the AUTH answer took one).
        assert_eq!(s.client.posted_recvs(), pre.saturating_sub(1).max(5));
        // What the transport holds is what the connection counts.
        assert_eq!(s.client_recvs, s.client.posted_recvs());
        assert!(!s.recv_overrun);
    }
}

#[test]
fn encoding_into_a_buffer_waits_for_queued_messages() {
    let mut s = Sim::new();
    s.connect();
    let fid = s.register(RK_NOBUF, FILE_NO_INTERMEDIATE_BUFFERING);
    // A READ waits to be transmitted: a WRITE cannot jump ahead of it.
    let r = s.read(fid, 0, 8, Mode::Interrupt);
    assert_eq!(s.client.transmit_pending(), 1);
    let mut buf = [0u8; 256];
    let before = s.client.outstanding();
    assert_eq!(
        s.client
            .write_into(s.now, fid, 0, b"abc", Mode::Interrupt, &mut buf),
        Err(ClientError::TransmitPending)
    );
    assert_eq!(s.client.outstanding(), before, "nothing recorded");
    // A buffer too small for the queued message closes the connection.
    let mut tiny = [0u8; 8];
    let mut t = Sim::new();
    t.connect();
    t.client
        .read(t.now, 1, 0, 8, DATA, Mode::Interrupt)
        .unwrap();
    assert_eq!(t.client.poll_transmit(&mut tiny), None);
    assert_eq!(
        t.client.poll_action(),
        Some(ClientAction::CloseConnection(CloseReason::PayloadTooLarge))
    );
    assert_eq!(t.client.transmit_pending(), 0);
    // Once transmitted, the WRITE goes straight into the buffer, and both
    // leave in issue order (sequence numbers ascending).
    let first = s.client.transmit_all();
    assert_eq!(first.len(), 1);
    let (w, n) = s
        .client
        .write_into(s.now, fid, 0, b"abc", Mode::Interrupt, &mut buf)
        .unwrap();
    let seq = |b: &[u8]| u16::from_le_bytes([b[6], b[7]]);
    assert_eq!(seq(&buf[..n]), seq(&first[0]).wrapping_add(1));
    s.to_server.push_back(first[0].clone());
    s.to_server.push_back(buf[..n].to_vec());
    s.pump();
    assert_eq!(s.completion(r), Some((8, STATUS_SUCCESS)));
    assert_eq!(s.completion(w.req), Some((3, STATUS_SUCCESS)));
}

// ------------------------------------------- connection lost at every point

/// One unit of progress of a simulated connection ([`Sim::step`]): the
/// points at which a connection can be cut.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    /// A request message left the client (it is on the wire).
    ClientSent,
    /// The server received a message (a FileRead/FileWrite is queued).
    ServerReceived,
    /// The server handed a FileRead/FileWrite to the backend.
    StorageTaken,
    /// The server RDMA-wrote read data into the client's buffer (with an
    /// immediate: also the completion, on its way to the client).
    DataWritten,
    /// The server RDMA-wrote the status block (polling): the completion is
    /// in the client's memory.
    StatusWritten,
    /// The server sent the status response: on its way to the client.
    StatusSent,
    /// Any other action of the server (releasing a read buffer).
    ServerOther,
    /// The backend finished one storage operation.
    StorageDone,
    /// The client received a status response or an immediate.
    ClientReceived,
    /// The client saw a status block change (polling).
    ClientPolled,
}

impl Sim {
    /// Move the simulation by one unit; `None` when nothing is left to do.
    /// The client's own bookkeeping (posting receives, resetting status
    /// blocks, events) involves no peer and is done on the way.
    fn step(&mut self) -> Option<Step> {
        self.client_local();
        let mut buf = [0u8; 16 * 1024];
        let step = if let Some(n) = self.client.poll_transmit(&mut buf) {
            self.to_server.push_back(buf[..n].to_vec());
            Step::ClientSent
        } else if let Some(m) = self.to_server.pop_front() {
            self.server.handle_recv(self.now, &m, &mut self.hooks);
            Step::ServerReceived
        } else if let Some(a) = self.server.poll_action() {
            let step = match &a {
                ServerAction::FileRead { .. } | ServerAction::FileWrite { .. } => {
                    Step::StorageTaken
                }
                ServerAction::RdmaWrite { remote_addr, .. }
                    if *remote_addr >= IOS_BASE && *remote_addr < IOS_BASE + 8 * 16 =>
                {
                    Step::StatusWritten
                }
                ServerAction::RdmaWrite { .. } => Step::DataWritten,
                ServerAction::Send(_) => Step::StatusSent,
                _ => Step::ServerOther,
            };
            self.server_action(a);
            step
        } else if !self.storage.held.is_empty() {
            let a = self.storage.held.remove(0);
            let (op, r) = self.storage.perform(&a);
            self.server.handle_storage_complete(self.now, op, r);
            Step::StorageDone
        } else if let Some(m) = self.to_client.pop_front() {
            match m {
                ToClient::Msg(b) => self.client.handle_recv(self.now, &b, &self.mem),
                ToClient::Imm(i) => self.client.handle_immediate(self.now, i),
            }
            Step::ClientReceived
        } else {
            let changed = self.client.polled_slots().into_iter().find_map(|slot| {
                let addr = IOS_BASE + 8 * u64::from(slot);
                let ios = IoStatusBlock::from_bytes(&self.mem.read_at(addr, 8)).unwrap();
                (ios != IoStatusBlock::SENTINEL).then_some((slot, ios))
            });
            let (slot, ios) = changed?;
            self.client
                .status_block_updated(self.now, slot, ios.information, ios.status);
            Step::ClientPolled
        };
        self.client_local();
        Some(step)
    }

    /// Carry out the client's actions (receives posted, status blocks reset
    /// to the sentinel, its close); whether there were any.
    fn client_actions(&mut self) -> bool {
        let mut any = false;
        while let Some(a) = self.client.poll_action() {
            any = true;
            match a {
                ClientAction::PostRecv(n) => self.client_recvs += n,
                ClientAction::ResetStatusBlock { addr, .. } => {
                    assert!(self
                        .mem
                        .local_write(addr, &IoStatusBlock::SENTINEL.to_bytes()))
                }
                ClientAction::CloseConnection(r) => self.client_closed = Some(r),
            }
        }
        any
    }

    fn client_local(&mut self) {
        self.client_actions();
        while let Some(e) = self.client.poll_event() {
            self.events.push(e);
        }
    }

    /// What the application gets for `req` once the connection is lost, by
    /// the client driver's rule (`Engine::wait`): a status block already in
    /// its memory is looked at first, then a completion it has seen is
    /// returned; anything else fails with "connection lost".
    fn outcome_after_loss(&mut self, req: ReqId) -> Result<(u32, NtStatus), &'static str> {
        if let Some(slot) = self.client.slot_of(req) {
            let ios =
                IoStatusBlock::from_bytes(&self.mem.read_at(IOS_BASE + 8 * u64::from(slot), 8))
                    .unwrap();
            if ios != IoStatusBlock::SENTINEL {
                self.client
                    .status_block_updated(self.now, slot, ios.information, ios.status);
            }
        }
        match self.client.take_done(req) {
            Some(d) => Ok((d.information, d.status)),
            None => {
                assert!(
                    self.client.is_outstanding(req),
                    "a request without completion is still outstanding"
                );
                Err("connection lost")
            }
        }
    }
}

/// What the storage of a dead connection does with the operations it had
/// taken but not finished: the embedder either cancels them or lets them
/// run to the end; both before the client's next connection writes (the
/// rule of docs/durability.md, "Replay and ordering").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Orphans {
    Cancelled,
    Completed,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LifeOp {
    Read,
    Write,
}

const W_OFF: u64 = 1000;
const W_LEN: usize = 100;
const R_OFF: u64 = 2000;
const R_LEN: u32 = 64;

fn new_bytes() -> Vec<u8> {
    (0..W_LEN).map(|i| 0xA0 ^ (i as u8)).collect()
}

/// A connected, registered simulation with deferred storage, `op` issued.
fn life_start(op: LifeOp, mode: Mode, imm: bool) -> (Sim, ReqId) {
    let mut scfg = server_cfg();
    scfg.use_write_with_imm = imm;
    let mut s = Sim::with(scfg, client_cfg());
    s.connect();
    let fid = s.register(RK_PLAIN, 0);
    s.storage.defer = true;
    s.mem.local_write(DATA.addr, &[0xEE; R_LEN as usize]);
    s.events.clear();
    let req = match op {
        LifeOp::Write => s.client.write(s.now, fid, W_OFF, &new_bytes(), mode),
        LifeOp::Read => s.client.read(s.now, fid, R_OFF, R_LEN, DATA, mode),
    }
    .unwrap()
    .req;
    // The driver resets the status block as it issues (before anything
    // can be sent).
    s.client_local();
    (s, req)
}

/// Cut the connection of `s` after `cut` steps (None: never); returns the
/// steps taken and the application's outcome of `req`.
fn life_run(
    s: &mut Sim,
    req: ReqId,
    cut: Option<usize>,
    orphans: Orphans,
) -> (Vec<Step>, Result<(u32, NtStatus), &'static str>) {
    let mut steps = Vec::new();
    while cut.is_none_or(|c| steps.len() < c) {
        match s.step() {
            Some(st) => steps.push(st),
            None => break,
        }
    }
    // The connection is gone: nothing more crosses it. The server's queued
    // actions and the backend's taken operations are what a dead
    // connection's embedder still has.
    if orphans == Orphans::Completed {
        while let Some(a) = s.server.poll_action() {
            if matches!(
                a,
                ServerAction::FileWrite { .. } | ServerAction::FileRead { .. }
            ) {
                let _completion_nobody_reads = s.storage.perform(&a);
            }
        }
        for a in std::mem::take(&mut s.storage.held) {
            let _completion_nobody_reads = s.storage.perform(&a);
        }
    }
    s.storage.held.clear();
    (steps, s.outcome_after_loss(req))
}

/// Reconnect on the same storage (a new ServerConn and ClientConn), and
/// check the file as the application can: the lost request is sent again
/// (same bytes, same offset), then a later overlapping write, then a read
/// back must show exactly the later state.
fn life_recover(old: Sim, op: LifeOp, mode: Mode, lost: bool, ctx: &str) {
    let mut t = Sim::new();
    t.storage.files = old.storage.files;
    t.connect();
    let fid = t.register(RK_PLAIN, 0);
    let mut expect = file_pattern(10_000);
    expect[W_OFF as usize..W_OFF as usize + W_LEN].copy_from_slice(&new_bytes());
    if op == LifeOp::Write && lost {
        let r = t
            .client
            .write(t.now, fid, W_OFF, &new_bytes(), mode)
            .unwrap()
            .req;
        t.pump();
        assert_eq!(
            t.completion(r),
            Some((W_LEN as u32, STATUS_SUCCESS)),
            "{ctx}"
        );
    }
    if op == LifeOp::Read {
        // No write was issued: the file is as it was.
        expect = file_pattern(10_000);
    }
    // A later write overlapping the first one's second half.
    let later: Vec<u8> = (0..W_LEN).map(|i| 0x5C ^ (i as u8)).collect();
    let off2 = W_OFF + W_LEN as u64 / 2;
    let r = t.client.write(t.now, fid, off2, &later, mode).unwrap().req;
    t.pump();
    assert_eq!(
        t.completion(r),
        Some((W_LEN as u32, STATUS_SUCCESS)),
        "{ctx}"
    );
    expect[off2 as usize..off2 as usize + W_LEN].copy_from_slice(&later);
    assert_eq!(t.storage.files[&1], expect, "{ctx}: file after recovery");
    let r = t.read(fid, W_OFF, 2 * W_LEN as u32, mode);
    t.pump();
    assert_eq!(
        t.completion(r),
        Some((2 * W_LEN as u32, STATUS_SUCCESS)),
        "{ctx}"
    );
    assert_eq!(
        t.mem.read_at(DATA.addr, 2 * W_LEN),
        expect[W_OFF as usize..W_OFF as usize + 2 * W_LEN],
        "{ctx}: read back"
    );
}

#[test]
fn connection_lost_at_every_point_of_a_request() {
    let variants = [
        (Mode::Interrupt, false),
        (Mode::Interrupt, true),
        (Mode::Polled, false),
    ];
    let mut cuts = 0;
    for op in [LifeOp::Write, LifeOp::Read] {
        for (mode, imm) in variants {
            // The whole life, uncut: the step at which the application can
            // see the completion, and the number of points.
            let (mut s, req) = life_start(op, mode, imm);
            let (full, res) = life_run(&mut s, req, None, Orphans::Cancelled);
            let expect_ok = match op {
                LifeOp::Write => (W_LEN as u32, STATUS_SUCCESS),
                LifeOp::Read => (R_LEN, STATUS_SUCCESS),
            };
            assert_eq!(res, Ok(expect_ok), "{op:?} {mode:?} imm={imm} uncut");
            // Where the completion reaches the application: the status
            // block landing in its memory, or the status response or
            // immediate received.
            let seen = match mode {
                Mode::Polled => full.iter().position(|s| *s == Step::StatusWritten),
                _ => full.iter().rposition(|s| *s == Step::ClientReceived),
            }
            .expect("the completion reaches the client");
            assert!(full.contains(&Step::StorageDone), "storage was deferred");
            if imm && op == LifeOp::Read {
                assert!(!full.contains(&Step::StatusSent), "{full:?}");
            }
            for cut in 0..=full.len() {
                for orphans in [Orphans::Cancelled, Orphans::Completed] {
                    let ctx = format!(
                        "{op:?} {mode:?} imm={imm} cut after {cut} steps {:?} ({orphans:?})",
                        &full[..cut]
                    );
                    let (mut s, req) = life_start(op, mode, imm);
                    let (steps, res) = life_run(&mut s, req, Some(cut), orphans);
                    assert_eq!(steps, full[..cut], "{ctx}: deterministic");
                    // Success exactly when the client saw the completion;
                    // before that, connection lost — never a success the
                    // server did not send.
                    if cut > seen {
                        assert_eq!(res, Ok(expect_ok), "{ctx}");
                    } else {
                        assert_eq!(res, Err("connection lost"), "{ctx}");
                    }
                    assert!(s.client_closed.is_none() && s.server_closed.is_none());
                    let file = &s.storage.files[&1];
                    let old = file_pattern(10_000);
                    match op {
                        LifeOp::Write => {
                            let got = &file[W_OFF as usize..W_OFF as usize + W_LEN];
                            // All or nothing; acknowledged means applied.
                            if res.is_ok() {
                                assert_eq!(got, new_bytes(), "{ctx}");
                            } else {
                                assert!(
                                    got == new_bytes()
                                        || got == &old[W_OFF as usize..W_OFF as usize + W_LEN],
                                    "{ctx}: torn write"
                                );
                            }
                            // Nothing else of the file changed.
                            assert_eq!(file[..W_OFF as usize], old[..W_OFF as usize], "{ctx}");
                            assert_eq!(
                                file[W_OFF as usize + W_LEN..],
                                old[W_OFF as usize + W_LEN..],
                                "{ctx}"
                            );
                        }
                        LifeOp::Read => {
                            assert_eq!(*file, old, "{ctx}: a read changed the file");
                            if res.is_ok() {
                                assert_eq!(
                                    s.mem.read_at(DATA.addr, R_LEN as usize),
                                    old[R_OFF as usize..(R_OFF + u64::from(R_LEN)) as usize],
                                    "{ctx}: acknowledged read data"
                                );
                            }
                        }
                    }
                    life_recover(s, op, mode, res.is_err(), &ctx);
                    cuts += 1;
                }
            }
        }
    }
    // Every variant has at least: sent, received, storage taken, storage
    // done, status sent, status seen (+ the uncut end).
    assert!(cuts >= 2 * 3 * 2 * 7, "{cuts} cut points");
}

/// The Credits hint is the number of I/O requests pending on the client
/// (seed 000): those holding credits, this one included, and those the
/// caller has waiting for a credit (`set_waiting`); INTERRUPT, CANCEL and
/// CREDIT are not I/O and count neither themselves nor each other. A
/// backlog that cleared only because a credit came back still shows in the
/// next request's hint. The old hint (credits held + 1) could not exceed
/// the credits granted.
#[test]
fn credits_hint_counts_requests_waiting_for_a_credit() {
    let mut s = Sim::new();
    s.connect();
    let fid = s.register(RK_PLAIN, 0);
    s.storage.defer = true;
    // Four credits: three reads, hints 1, 2, 3.
    for want in 1..=3u8 {
        s.read(fid, 0, 8, Mode::Interrupt);
        s.pump();
        assert_eq!(s.server.credit_hint(), want);
        assert_eq!(s.client.last_hint(), want);
    }
    assert_eq!(s.server.take_peak_hint(), 3);
    // Five more wait for a credit: the INTERRUPT (the reserved credit)
    // carries the 3 reads + 5 waiting.
    s.client.set_waiting(5);
    assert_eq!(s.client.pending(), 8);
    s.client.interrupt(s.now).unwrap();
    assert_eq!(s.client.pending(), 8, "an INTERRUPT is not I/O");
    s.pump();
    assert_eq!(s.server.credit_hint(), 8);
    assert_eq!(s.server.take_peak_hint(), 8);
    // The reads complete (and the INTERRUPT after them); one waiter took
    // its credit: 4 still wait and one read is issued.
    s.release_held();
    assert_eq!(s.client.outstanding(), 0);
    s.client.set_waiting(4);
    s.read(fid, 0, 8, Mode::Interrupt);
    s.pump();
    assert_eq!(s.server.credit_hint(), 5);
    // A backlog that cleared before the next request went out: 1 held and
    // 2 waiting (3 pending), then the read completes and both waiters are
    // served; the first of them reports the 3.
    s.client.set_waiting(2);
    s.release_held();
    s.client.set_waiting(0);
    s.read(fid, 0, 8, Mode::Interrupt);
    s.pump();
    assert_eq!(s.server.credit_hint(), 3);
    // ...and the one after it only what is pending then.
    s.read(fid, 0, 8, Mode::Interrupt);
    s.pump();
    assert_eq!(s.server.credit_hint(), 2);
    // At most 255 (a u8).
    s.client.set_waiting(1000);
    s.read(fid, 0, 8, Mode::Interrupt);
    s.pump();
    assert_eq!(s.server.credit_hint(), 255);
    s.client.set_waiting(0);
    s.release_held();
}

/// The reply to a positive delta reports the new credits the client does
/// not need (seed 000: "the number of credits allocated by the server that
/// the client did not use"): what it needs is one credit per pending
/// request and the one kept back for INTERRUPT and CANCEL, at least what
/// it asked for at AUTH (4 here), at most `max_credits`. Before, the
/// report was the new credits above `max_credits` (255 by default): 0.
#[test]
fn unused_part_of_a_positive_grant_is_reported() {
    let cases: [(u16, usize, i32, u32); 5] = [
        // (max_credits, requests waiting, delta, unused reported)
        // 3 reads + 4 waiting = 7 pending: 15 needed (twice, + the
        // reserved one) of 24.
        (255, 4, 20, 9),
        // Granted short of the headroom (7 pending, 8 credits): none.
        (255, 4, 4, 0),
        // No backlog: 3 reads need 7; 1 above unused.
        (255, 0, 4, 1),
        // More pending than the client can ever use: capped at 6.
        (6, 4, 10, 8),
        // A delta that leaves it short: everything is used.
        (255, 20, 10, 0),
    ];
    for (max, waiting, delta, unused) in cases {
        let mut cfg = client_cfg();
        cfg.max_credits = max;
        let mut s = Sim::with(server_cfg(), cfg);
        s.connect();
        let fid = s.register(RK_PLAIN, 0);
        s.storage.defer = true;
        for _ in 0..3 {
            s.read(fid, 0, 8, Mode::Interrupt);
        }
        s.client.set_waiting(waiting);
        s.client.interrupt(s.now).unwrap();
        s.pump();
        s.server.start_credit_delta(s.now, delta).unwrap();
        s.pump();
        let ctx = format!("max {max}, waiting {waiting}, delta {delta}");
        assert!(!s.server.credit_transaction_active(), "{ctx}");
        assert_eq!(s.server.take_unused_credits(), unused, "{ctx}");
        assert_eq!(s.client.credits(), 4 + delta as u16, "{ctx}");
        s.client.set_waiting(0);
        s.release_held();
    }
    // An idle client granted more than it asked for at AUTH reports all
    // of them; within what it asked for, none.
    let mut s = Sim::new();
    s.connect();
    s.server.start_credit_delta(s.now, -2).unwrap();
    s.pump();
    assert_eq!(s.client.credits(), 2);
    s.server.start_credit_delta(s.now, 2).unwrap();
    s.pump();
    assert_eq!(s.server.take_unused_credits(), 0, "back to its 4");
    s.server.start_credit_delta(s.now, 3).unwrap();
    s.pump();
    assert_eq!(s.server.take_unused_credits(), 3, "beyond its 4");
}
