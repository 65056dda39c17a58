//! Operations of any size (docs/protocol.md §5.12): a WRITE or VEC_WRITE
//! larger than the server's receive buffer is one fragmented message — one
//! request, one write at the server, one status — sent from registered
//! memory without a copy; and every malformed fragment sequence from a
//! hostile client terminates its connection with the exact status, writes
//! nothing, and leaves the good client served.

use std::io::IoSlice;
use std::time::{Duration, Instant};

use lwio_client::{Client, ClientOptions, Completion, File, OpenOptions};
use lwio_proto::status::*;
use lwio_proto::wire::common::{Opcode, RequestOp};
use lwio_proto::wire::fragment::{FragmentRepr, FRAGMENT_HEADER_LEN};
use lwio_proto::wire::{FidParamsRepr, Guid, SrvResumeKey, COMMON_HEADER_LEN};
use lwio_rdma::*;
use lwio_server::config::Limits;
use lwio_server::io_phase::driver::RdmaServerOptions;
use lwio_server::io_phase::testkit::LocalServer;

mod common;
use common::hostile::{connect, intr, req_bytes, Hostile};

const TOKEN: &str = "fragment-test-token-0123456789";
/// 16 MiB + 3: the size, one byte more than a whole number of
/// anything.
const BIG: usize = (16 << 20) + 3;
const ODD: u64 = 4097 * 3 + 1;
/// Fragments of a BIG write: the 56-byte request header and the data, at
/// most the server's receive buffer (1 MiB + 56) less the 16-byte
/// fragment header each.
const BIG_FRAGS: u64 = (56 + BIG as u64).div_ceil((1 << 20) + 56 - 16);

fn pattern(n: usize, seed: u32) -> Vec<u8> {
    (0..n as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8 ^ seed as u8)
        .collect()
}

/// A server whose receive buffers take 1 MiB, so a 16 MiB + 3 write is 16
/// fragments: within the 32 credits the client asks for.
fn server(dir: &std::path::Path) -> LocalServer {
    let mut rdma = RdmaServerOptions {
        auto_credits: false,
        max_memory: 1 << 30,
        ..RdmaServerOptions::default()
    };
    rdma.proto.max_recv_buffer_size = 1 << 20;
    rdma.proto.max_message = 32 << 20;
    rdma.proto.auth_timeout = Duration::from_millis(500);
    LocalServer::start(dir, "ex", TOKEN, Limits::default(), rdma).unwrap()
}

fn client(s: &LocalServer, completion: Completion) -> Client {
    Client::connect(
        &format!("lwio://{}/ex", s.side_addr),
        Some(TOKEN),
        ClientOptions {
            completion,
            // The server's initial grant (32): 16 fragments fit, with room
            // for a polling waiter's INTERRUPT.
            credits: 32,
            ..ClientOptions::default()
        }
        .no_tls(),
    )
    .unwrap()
}

/// The server's request counters once they include `want` WRITE-type
/// requests of `op` (live connections flush theirs every 50 ms).
fn wait_requests(s: &LocalServer, op: Opcode, want: u64) -> lwio_proto::stats::RequestStats {
    let t = Instant::now();
    loop {
        let st = s.rdma.request_stats();
        if st.op(op).completed >= want || t.elapsed() > Duration::from_secs(10) {
            return st;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn write_and_vec_write_of_16_mib_plus_3_are_one_request_each() {
    let dir = tempfile::tempdir().unwrap();
    let s = server(dir.path());
    for (round, completion) in [Completion::Interrupt, Completion::Poll]
        .into_iter()
        .enumerate()
    {
        let c = client(&s, completion);
        let name = format!("big{round}.bin");
        let f = c
            .open(&name, &OpenOptions::read_write().create(true))
            .unwrap();
        for (k, vectored) in [false, true].into_iter().enumerate() {
            let data = pattern(BIG, (round * 2 + k) as u32);
            let op = if vectored {
                Opcode::VecWrite
            } else {
                Opcode::Write
            };
            let before = wait_requests(&s, op, 0);
            let srv0 = s.rdma.stats();
            let cl0 = c.stats();
            let n = if vectored {
                // Two slices: VEC_WRITE gathers them into one message.
                let (a, b) = data.split_at(5_000_001);
                f.write_vectored_at(&[IoSlice::new(a), IoSlice::new(b)], ODD)
                    .unwrap()
            } else {
                f.write_at(&data, ODD).unwrap()
            };
            assert_eq!(n, BIG);
            let after = wait_requests(&s, op, before.op(op).completed + 1);
            let srv = s.rdma.stats();
            let cl = c.stats();
            // One request, one write call at the server, one status.
            assert_eq!(after.op(op).requests - before.op(op).requests, 1, "{op:?}");
            assert_eq!(
                after.op(op).completed - before.op(op).completed,
                1,
                "{op:?}"
            );
            assert_eq!(after.op(op).bytes - before.op(op).bytes, BIG as u64);
            assert_eq!(after.messages_reassembled - before.messages_reassembled, 1);
            assert_eq!(after.fragments - before.fragments, BIG_FRAGS);
            assert_eq!(srv.fragment_writes - srv0.fragment_writes, 1);
            assert_eq!(srv.fragment_write_calls - srv0.fragment_write_calls, 1);
            assert_eq!(cl.requests - cl0.requests, 1);
            assert_eq!(cl.fragmented_writes - cl0.fragmented_writes, 1);
            // Plain caller memory: registered for the call and sent from
            // where it is; nothing copied into send slots.
            assert_eq!(cl.send_copy_bytes - cl0.send_copy_bytes, 0);
            assert_eq!(cl.call_registrations - cl0.call_registrations, 1);
            assert_eq!(cl.fragments_sent - cl0.fragments_sent, BIG_FRAGS);
            // Byte for byte, through lwio and on the server's disk.
            let mut back = vec![0u8; BIG];
            assert_eq!(f.read_at(&mut back, ODD).unwrap(), BIG);
            assert!(back == data, "read back differs ({op:?}, {completion:?})");
            let disk = std::fs::read(dir.path().join(&name)).unwrap();
            assert_eq!(disk.len(), ODD as usize + BIG);
            assert!(disk[ODD as usize..] == data[..], "disk differs ({op:?})");
            assert!(disk[..ODD as usize].iter().all(|&b| b == 0));
        }
        f.close().unwrap();
    }
    assert_eq!(s.rdma.stats().mrs_remote_access, 0);
}

#[test]
fn a_write_from_a_registered_buffer_copies_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let s = server(dir.path());
    for completion in [Completion::Interrupt, Completion::Poll] {
        let c = client(&s, completion);
        let f = c
            .open("reg.bin", &OpenOptions::read_write().create(true))
            .unwrap();
        let mut rb = c.register_buffer(BIG).unwrap();
        let data = pattern(BIG, 9);
        rb.copy_from_slice(&data);
        let cl0 = c.stats();
        assert_eq!(f.write_at(&rb, ODD).unwrap(), BIG);
        let cl = c.stats();
        assert_eq!(cl.send_copy_bytes, cl0.send_copy_bytes, "bytes copied");
        // The buffer's cached registration: none made for the call.
        assert_eq!(cl.call_registrations, cl0.call_registrations);
        assert_eq!(cl.fragmented_writes - cl0.fragmented_writes, 1);
        assert_eq!(cl.fragments_sent - cl0.fragments_sent, BIG_FRAGS);
        let disk = std::fs::read(dir.path().join("reg.bin")).unwrap();
        assert!(disk[ODD as usize..] == data[..], "disk differs");
        f.close().unwrap();
    }
}

/// A READ of 16 MiB + 3 into registered memory is one request with one
/// status: the server reads and RDMA-writes it in pieces of its window.
/// At the end of the file it is one request too, answered with the bytes
/// there are.
#[test]
fn a_read_of_16_mib_plus_3_is_one_request() {
    let dir = tempfile::tempdir().unwrap();
    let data = pattern(BIG + 5_000_000, 11);
    std::fs::write(dir.path().join("r.bin"), &data).unwrap();
    let s = server(dir.path());
    for completion in [Completion::Interrupt, Completion::Poll] {
        let c = client(&s, completion);
        let f = c.open("r.bin", &OpenOptions::read_only()).unwrap();
        let mut rb = c.register_buffer(BIG).unwrap();
        for (off, want) in [(ODD, BIG), (data.len() as u64 - 1_000_001, 1_000_001)] {
            rb.fill(0);
            let before = wait_requests(&s, Opcode::Read, 0);
            let n = f.read_registered(&mut rb, 0..BIG, off).unwrap();
            assert_eq!(n, want, "{completion:?} at {off}");
            assert!(
                rb[..n] == data[off as usize..off as usize + n],
                "bytes differ ({completion:?} at {off})"
            );
            assert!(rb[n..].iter().all(|&b| b == 0), "bytes past the end");
            let after = wait_requests(&s, Opcode::Read, before.op(Opcode::Read).completed + 1);
            let d = |f: fn(&lwio_proto::stats::OpStats) -> u64| {
                f(after.op(Opcode::Read)) - f(before.op(Opcode::Read))
            };
            assert_eq!(d(|o| o.requests), 1, "one READ ({completion:?} at {off})");
            assert_eq!(d(|o| o.completed), 1, "one status");
            assert_eq!(d(|o| o.bytes), want as u64);
        }
        // Every window bound for those reads was invalidated.
        let st = c.stats();
        assert_eq!(st.windows_bound, st.windows_invalidated, "{st:?}");
        f.close().unwrap();
    }
    assert_eq!(s.rdma.stats().mrs_remote_access, 0);
}

/// A COLLAPSE write of 4,096 pages (16 MiB, one page on the wire) is one
/// VEC_WRITE request: the server takes it up to its MAX_MESSAGE.
#[test]
fn a_collapse_write_of_many_pages_is_one_request() {
    let dir = tempfile::tempdir().unwrap();
    let s = server(dir.path());
    let c = client(&s, Completion::Interrupt);
    let f = c
        .open(
            "c.bin",
            &OpenOptions::read_write().create(true).no_buffering(true),
        )
        .unwrap();
    let page = pattern(4096, 5);
    let total = 16u64 << 20;
    let before = wait_requests(&s, Opcode::VecWrite, 0);
    let cl0 = c.stats();
    assert_eq!(f.write_repeated_at(&page, total, 1 << 20).unwrap(), total);
    assert_eq!(c.stats().requests - cl0.requests, 1, "one request");
    let after = wait_requests(
        &s,
        Opcode::VecWrite,
        before.op(Opcode::VecWrite).completed + 1,
    );
    let op = |r: &lwio_proto::stats::RequestStats| r.op(Opcode::VecWrite).clone();
    assert_eq!(op(&after).requests - op(&before).requests, 1);
    assert_eq!(op(&after).bytes - op(&before).bytes, total);
    let disk = std::fs::read(dir.path().join("c.bin")).unwrap();
    assert_eq!(disk.len() as u64, (1 << 20) + total);
    for (i, p) in disk[1 << 20..].chunks(4096).enumerate() {
        assert_eq!(p, &page[..], "page {i}");
    }
    f.close().unwrap();
}

// ------------------------------------------------------------- hostile

struct Env {
    s: LocalServer,
    dir: tempfile::TempDir,
    good: File,
    _good_client: Client,
    data: Vec<u8>,
}

fn env() -> Env {
    let dir = tempfile::tempdir().unwrap();
    let data = pattern(300_000, 3);
    std::fs::write(dir.path().join("f.bin"), &data).unwrap();
    std::fs::write(dir.path().join("victim.bin"), vec![0xEEu8; 1 << 20]).unwrap();
    let mut rdma = RdmaServerOptions {
        auto_credits: false,
        ..RdmaServerOptions::default()
    };
    rdma.proto.max_message = 1 << 20;
    rdma.proto.auth_timeout = Duration::from_millis(500);
    let s = LocalServer::start(dir.path(), "ex", TOKEN, Limits::default(), rdma).unwrap();
    let c = client(&s, Completion::Interrupt);
    let good = c.open("f.bin", &OpenOptions::read_write()).unwrap();
    Env {
        s,
        dir,
        good,
        _good_client: c,
        data,
    }
}

impl Env {
    /// The well-behaved client is still served (a fragmented write and a
    /// read, byte for byte), and the victim file holds nothing new.
    fn check_good(&self) {
        let w = pattern(200_000, 77);
        assert_eq!(self.good.write_at(&w, 50_000).unwrap(), w.len());
        let mut b = vec![0u8; 250_000];
        assert_eq!(self.good.read_at(&mut b, 0).unwrap(), b.len());
        assert_eq!(&b[..50_000], &self.data[..50_000]);
        assert!(b[50_000..] == w[..]);
        let v = std::fs::read(self.dir.path().join("victim.bin")).unwrap();
        assert!(v.iter().all(|&x| x == 0xEE), "the victim file was written");
        assert_eq!(self.s.rdma.stats().mrs_remote_access, 0);
    }

    fn closed_with(&self, st: NtStatus) -> u64 {
        self.s
            .rdma
            .stats()
            .closed_by_status
            .get(&st)
            .copied()
            .unwrap_or(0)
    }
}

/// A hostile client, authenticated, with victim.bin registered.
fn hostile(e: &Env) -> (Hostile, u16) {
    let mut h = connect(&e.s, TOKEN, Guid::from_u128(0xF7A6));
    let sp = h.auth_ok(32);
    assert_eq!(sp.max_message, 1 << 20, "the server announces MAX_MESSAGE");
    // It reads publishers' memory by RDMA Read (memory objects), so it says
    // it supports RDMA Read (seed 000); this client, as a seed-only one,
    // says 0 and is served all the same.
    assert_eq!(sp.rdma_read_supported, 1, "RdmaReadSupported");
    let rk = open_victim(&mut h);
    h.send_req(RequestOp::Register {
        cookie: 2,
        params: FidParamsRepr {
            resume_key: rk,
            session_id: h.session_id,
            flags_and_attributes: 0,
        },
    });
    let r = h
        .recv_status(Duration::from_secs(5))
        .expect("REGISTER answered");
    assert_eq!(r.ios.status, STATUS_SUCCESS);
    (h, r.ios.information as u16)
}

fn open_victim(h: &mut Hostile) -> SrvResumeKey {
    let o = lwio_side::types::OpenOptions {
        read: true,
        write: true,
        ..Default::default()
    };
    h.side
        .open("ex", "victim.bin", &o, 0)
        .expect("open victim.bin on the side channel")
        .resume_key
        .key
}

/// A fragment: header for (`offset`, data length, `remaining`), then
/// `data`. `first`/`last` follow the rules unless told otherwise.
fn frag(offset: u32, data: &[u8], remaining: u32) -> Vec<u8> {
    let f = FragmentRepr {
        data_length: data.len() as u32,
        first: offset == 0,
        last: remaining == 0,
        message_offset: offset,
        remaining,
    };
    let mut b = vec![0u8; FRAGMENT_HEADER_LEN];
    f.emit(&mut b);
    b.extend_from_slice(data);
    b
}

/// The FIRST fragment of a WRITE message of `total` bytes: the request
/// header, then data, `chunk` bytes in all.
fn first_frag(fid: u16, total: u32, chunk: usize) -> Vec<u8> {
    let mut first = write_head(fid, total as usize - COMMON_HEADER_LEN);
    first.extend_from_slice(&vec![0x5A; chunk - COMMON_HEADER_LEN]);
    frag(0, &first, total - chunk as u32)
}

/// The first bytes of a WRITE message of `len` data bytes at 0 of `fid`.
fn write_head(fid: u16, len: usize) -> Vec<u8> {
    let data = vec![0xABu8; len];
    let mut m = req_bytes(RequestOp::Write {
        fid,
        offset: 0,
        data: &data,
        mode: intr(77),
    });
    m.truncate(COMMON_HEADER_LEN);
    m
}

/// Send each message as its own Send, back to back, from distinct places
/// of the send region.
fn send_all(h: &Hostile, msgs: &[Vec<u8>]) {
    let mut off = 0usize;
    let mut wrs = Vec::new();
    for m in msgs {
        h.send.write_at(off, m).unwrap();
        wrs.push((off, m.len()));
        off += m.len().next_multiple_of(64);
    }
    for (i, (off, len)) in wrs.into_iter().enumerate() {
        let _ = h.qp.post_send(&[SendWr::new(
            2000 + i as u64,
            SendOp::Send,
            &[h.send.sge(off, len as u32)],
        )]);
    }
}

/// The messages a hostile case sends, given the Fid of victim.bin.
type Sequence = Box<dyn Fn(u16) -> Vec<Vec<u8>>>;

#[test]
fn malformed_fragment_sequences_terminate_with_the_exact_status() {
    let e = env();
    e.check_good();
    let chunk = 4096usize;
    let body = vec![0x5Au8; chunk];
    // A 3-fragment message of 56 + 3 * 4096 - 56 data bytes, each case
    // breaking it in one way.
    let total = 3 * chunk as u32;
    let cases: Vec<(&str, NtStatus, Sequence)> = vec![
        (
            "missing fragment",
            STATUS_INVALID_PARAMETER,
            Box::new(move |fid| {
                vec![
                    first_frag(fid, total, chunk),
                    // The middle one never comes: the last starts at 2 chunks.
                    frag(2 * chunk as u32, &vec![0x5A; chunk], 0),
                ]
            }),
        ),
        (
            "truncated fragment (DataLength past the bytes sent)",
            STATUS_INVALID_PARAMETER,
            Box::new(move |fid| {
                let mut f = first_frag(fid, total, chunk);
                f.truncate(f.len() - 100);
                vec![f]
            }),
        ),
        (
            "beyond the negotiated size",
            STATUS_INVALID_BUFFER_SIZE,
            Box::new(move |fid| vec![first_frag(fid, (1 << 20) + 1, chunk)]),
        ),
        (
            "RemainingDataLength that does not add up",
            STATUS_INVALID_PARAMETER,
            Box::new(move |fid| {
                vec![
                    first_frag(fid, total, chunk),
                    // Says the message is one chunk longer.
                    frag(chunk as u32, &vec![0x5A; chunk], 2 * chunk as u32),
                ]
            }),
        ),
        (
            "a flood of first fragments",
            STATUS_INVALID_PARAMETER,
            Box::new(move |fid| (0..8).map(|_| first_frag(fid, total, chunk)).collect()),
        ),
        (
            "another request before the last fragment",
            STATUS_INVALID_PARAMETER,
            Box::new(move |fid| {
                vec![
                    first_frag(fid, total, chunk),
                    req_bytes(RequestOp::Write {
                        fid,
                        offset: 0,
                        data: &body,
                        mode: intr(78),
                    }),
                ]
            }),
        ),
        (
            "a first fragment without a whole request header",
            STATUS_INVALID_PARAMETER,
            Box::new(move |fid| {
                let head = write_head(fid, total as usize - COMMON_HEADER_LEN);
                vec![frag(0, &head[..40], total - 40)]
            }),
        ),
    ];
    for (what, status, make) in cases {
        let base = e.closed_with(status);
        let conns = e.s.rdma.stats().connections;
        let (h, fid) = hostile(&e);
        send_all(&h, &make(fid));
        assert!(
            h.terminated(Duration::from_secs(10)),
            "{what}: connection not terminated"
        );
        let t = Instant::now();
        while e.closed_with(status) == base && t.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(e.closed_with(status), base + 1, "{what}: status");
        drop(h);
        // The connection's resources go (nothing leaks).
        let t = Instant::now();
        while e.s.rdma.stats().connections > conns && t.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(
            e.s.rdma.stats().connections,
            conns,
            "{what}: connection left"
        );
        e.check_good();
    }
    // The server goes first: dropping a File and its Client whose server
    // is gone is prompt (no reconnect attempts for op_timeout).
    let Env {
        s,
        dir,
        good,
        _good_client,
        ..
    } = e;
    drop(s);
    let t = Instant::now();
    drop(good);
    drop(_good_client);
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "drop took {:?}",
        t.elapsed()
    );
    drop(dir);
}

/// The credit balancer counts a fragmented message's credits: a client
/// writing 1 MiB messages (16 fragments of 64 KiB) eight at a time is short
/// of credits whenever its spare ones cannot hold one more such message,
/// however few requests it has outstanding, and is granted more — up to
/// the eight messages it has queued, not stuck at two in flight.
#[test]
fn a_busy_fragmented_writer_is_granted_credits_for_its_messages() {
    let dir = tempfile::tempdir().unwrap();
    let mut rdma = RdmaServerOptions {
        max_memory: 1 << 30,
        ..RdmaServerOptions::default()
    };
    rdma.proto.max_recv_buffer_size = 64 << 10;
    let s = LocalServer::start(dir.path(), "ex", TOKEN, Limits::default(), rdma).unwrap();
    let c = Client::connect(
        &format!("lwio://{}/ex", s.side_addr),
        Some(TOKEN),
        ClientOptions {
            completion: Completion::Interrupt,
            credits: 128,
            ..ClientOptions::default()
        }
        .no_tls(),
    )
    .unwrap();
    let f = c
        .open("busy", &OpenOptions::read_write().create(true))
        .unwrap();
    let start = c.credits();
    let t0 = Instant::now();
    let mut most = start;
    std::thread::scope(|sc| {
        for k in 0..8u64 {
            let f = &f;
            sc.spawn(move || {
                let data = pattern(1 << 20, k as u32);
                let mut i = 0u64;
                while t0.elapsed() < Duration::from_secs(3) {
                    let at = ((i * 8 + k) % 32) << 20;
                    assert_eq!(f.write_at(&data, at).unwrap(), data.len());
                    i += 1;
                }
            });
        }
        while t0.elapsed() < Duration::from_secs(3) {
            most = most.max(c.credits());
            std::thread::sleep(Duration::from_millis(10));
        }
    });
    println!("credits: {start} at the start, {most} at most while writing");
    assert!(
        most >= 96,
        "a writer of 16-fragment messages, 8 at a time, got at most {most} credits (from {start})"
    );
    // What the writers left on disk: each 1 MiB slot holds its writer's
    // pattern.
    let disk = std::fs::read(dir.path().join("busy")).unwrap();
    for slot in 0..disk.len() >> 20 {
        let want = pattern(1 << 20, (slot % 8) as u32);
        assert!(
            disk[slot << 20..(slot + 1) << 20] == want[..],
            "slot {slot}"
        );
    }
}
