//! Deterministic tests of the soft provider's protocol engine without
//! sockets: two `QpEngine`s joined by in-memory pipes, streams re-fed split at
//! every byte boundary, garbage input, and a bounded property test.

use std::sync::Arc;

use proptest::prelude::*;

use super::cq::SoftChannel;
use super::fuzzing::{ctx, drain, mr_bytes, rx_all, tx_bytes, Pipe, Side};
use super::mem::SoftMw;
use super::{CtxShared, QpState};
use crate::conformance::pattern;
use crate::verbs::*;

fn side(ctx: &Arc<CtxShared>, qpn: u32, crc: bool, max_payload: usize) -> Side {
    super::fuzzing::side(ctx, qpn, crc, max_payload, 64 * 1024)
}

/// Receiver-side fixture: what the sender's stream must produce.
struct Rx {
    side: Side,
    recv_mr: Mr,
    write_mr: Mr,
    read_mr: Mr,
    wmr: Mr,
    mw: Mw,
    mw_key: u32,
}

fn receiver(ctx: &Arc<CtxShared>, crc: bool) -> Rx {
    let mut side = side(ctx, 2, crc, 100);
    let recv_mr = side.pd.alloc_mr(4096, Access::LOCAL_WRITE).expect("mr");
    let write_mr = side
        .pd
        .alloc_mr(4096, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
        .expect("mr");
    let read_mr = side
        .pd
        .alloc_mr(4096, Access::LOCAL_WRITE | Access::REMOTE_READ)
        .expect("mr");
    read_mr.write_at(0, &pattern(3, 4096)).expect("fill");
    let wmr = side
        .pd
        .alloc_mr(
            4096,
            Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::MW_BIND,
        )
        .expect("mr");
    let mw = side.pd.alloc_mw().expect("mw");
    let soft_mw = (*mw.0).as_any().downcast_ref::<SoftMw>().expect("soft mw");
    let mw_key = side
        .core
        .bind(
            soft_mw,
            &MwBind {
                mr: &wmr,
                offset: 10,
                length: 100,
                access: Access::REMOTE_WRITE,
                one_shot: false,
            },
            1,
            false,
        )
        .expect("bind");
    let sges = [
        recv_mr.sge(0, 1000),
        recv_mr.sge(1000, 1),
        recv_mr.sge(2000, 17),
    ];
    side.core
        .post_recv(&[
            RecvWr {
                wr_id: 10,
                sg_list: &sges[..1],
            },
            RecvWr {
                wr_id: 11,
                sg_list: &sges[1..2],
            },
            RecvWr {
                wr_id: 12,
                sg_list: &sges[2..3],
            },
        ])
        .expect("post recv");
    drain(&side.cq);
    Rx {
        side,
        recv_mr,
        write_mr,
        read_mr,
        wmr,
        mw,
        mw_key,
    }
}

/// The sender's stream: a 3-segment send, a write, a zero-length send with
/// invalidate, a small send, a read request (stream fixed by the receiver's
/// keys, which are the same in every fixture built in the same order).
fn sender_stream(ctx: &Arc<CtxShared>, rx: &Rx, crc: bool) -> (Side, Mr, Vec<u8>) {
    sender_stream_with(ctx, rx, crc, 0)
}

/// As `sender_stream`, with writev accepting at most `wchunk` bytes a call.
fn sender_stream_with(
    ctx: &Arc<CtxShared>,
    rx: &Rx,
    crc: bool,
    wchunk: usize,
) -> (Side, Mr, Vec<u8>) {
    let mut s = side(ctx, 1, crc, 100);
    let mr = s.pd.alloc_mr(8192, Access::LOCAL_WRITE).expect("mr");
    mr.write_at(0, &pattern(1, 4096)).expect("fill");
    let a = [mr.sge(0, 250)];
    let b = [mr.sge(300, 222)];
    let c = [mr.sge(600, 1)];
    let d = [mr.sge(4096, 64)];
    s.core
        .post_send(&[
            SendWr::new(1, SendOp::Send, &a),
            SendWr::new(
                2,
                SendOp::Write {
                    remote_addr: rx.write_mr.addr() + 5,
                    rkey: rx.write_mr.rkey(),
                },
                &b,
            ),
            SendWr::new(3, SendOp::SendWithInvalidate { rkey: rx.mw_key }, &[]),
            SendWr::new(4, SendOp::Send, &c),
            SendWr::new(
                5,
                SendOp::Read {
                    remote_addr: rx.read_mr.addr() + 7,
                    rkey: rx.read_mr.rkey(),
                },
                &d,
            ),
        ])
        .expect("post");
    let mut p = Pipe {
        wchunk,
        ..Pipe::default()
    };
    s.core.tx_process(&mut p).expect("tx");
    (s, mr, p.output)
}

fn check_receiver(rx: &mut Rx, what: &str) {
    let w = drain(&rx.side.cq);
    assert_eq!(w.len(), 3, "{what}: {w:?}");
    assert!(w.iter().all(|w| w.is_ok()), "{what}: {w:?}");
    assert_eq!((w[0].wr_id, w[0].byte_len), (10, 250), "{what}");
    assert_eq!((w[1].wr_id, w[1].byte_len), (11, 0), "{what}");
    assert_eq!(w[1].invalidated_rkey, Some(rx.mw_key), "{what}");
    assert_eq!((w[2].wr_id, w[2].byte_len), (12, 1), "{what}");
    let src = pattern(1, 4096);
    let got = mr_bytes(&rx.recv_mr);
    assert_eq!(&got[..250], &src[..250], "{what}: send data");
    assert_eq!(got[2000], src[600], "{what}: third send");
    let wm = mr_bytes(&rx.write_mr);
    assert_eq!(&wm[5..227], &src[300..522], "{what}: write data");
    assert!(
        wm[..5].iter().all(|&b| b == 0) && wm[227..].iter().all(|&b| b == 0),
        "{what}: write bounds"
    );
    assert_eq!(rx.side.core.state, QpState::Rts, "{what}");
    assert!(rx.side.core.rx_idle(), "{what}: receive engine mid-segment");
}

#[test]
fn receive_path_every_split_point() {
    for crc in [false, true] {
        let ctx = ctx();
        let proto = receiver(&ctx, crc);
        let (_s, _mr, stream) = sender_stream(&ctx, &proto, crc);
        drop(proto);
        assert!(stream.len() > 500, "stream of {} bytes", stream.len());
        for k in 0..=stream.len() {
            let mut rx = receiver(&ctx, crc);
            // Rebuild the stream for this fixture's keys.
            let (_s, _mr, stream) = sender_stream(&ctx, &rx, crc);
            let mut p = Pipe {
                input: stream[..k].to_vec(),
                chunk: usize::MAX,
                ..Pipe::default()
            };
            rx_all(&mut rx.side.core, &mut p);
            p.input.extend_from_slice(&stream[k..]);
            rx_all(&mut rx.side.core, &mut p);
            check_receiver(&mut rx, &format!("crc={crc} split at {k}"));
        }
    }
}

#[test]
fn partial_writes_of_batched_frames_give_the_same_stream() {
    for crc in [false, true] {
        let ctx = ctx();
        let mut rx = receiver(&ctx, crc);
        // Written 1..=13 bytes per writev call across the batched frames.
        let (s, _mr, stream) = sender_stream_with(&ctx, &rx, crc, 13);
        let w = drain(&s.cq);
        let ids: Vec<u64> = w.iter().map(|w| w.wr_id).collect();
        assert_eq!(ids, [1, 2, 3, 4], "crc={crc}: {w:?}");
        let mut p = Pipe {
            input: stream,
            chunk: usize::MAX,
            ..Pipe::default()
        };
        rx_all(&mut rx.side.core, &mut p);
        check_receiver(&mut rx, &format!("crc={crc} partial writes"));
    }
}

#[test]
fn receive_path_byte_at_a_time_and_read_response() {
    for crc in [false, true] {
        let ctx = ctx();
        let mut rx = receiver(&ctx, crc);
        let (mut s, smr, stream) = sender_stream(&ctx, &rx, crc);
        let mut p = Pipe {
            input: stream,
            chunk: 1,
            ..Pipe::default()
        };
        rx_all(&mut rx.side.core, &mut p);
        check_receiver(&mut rx, &format!("crc={crc} byte at a time"));
        // The read request is answered: feed the response back byte by byte.
        let resp = tx_bytes(&mut rx.side);
        let mut q = Pipe {
            input: resp,
            chunk: 1,
            ..Pipe::default()
        };
        rx_all(&mut s.core, &mut q);
        let w = drain(&s.cq);
        let ids: Vec<u64> = w.iter().map(|w| w.wr_id).collect();
        assert_eq!(ids, [1, 2, 3, 4, 5], "{w:?}");
        assert!(w.iter().all(|w| w.is_ok()), "{w:?}");
        assert_eq!(mr_bytes(&smr)[4096..4160], pattern(3, 4096)[7..71]);
        // And the window was invalidated by the Send with Invalidate.
        let _ = (&rx.wmr, &rx.mw);
    }
}

/// Post one write of `len` bytes at `to` under `rkey`, feed it to `rx` in
/// 7-byte reads; returns the requester.
fn violate(ctx: &Arc<CtxShared>, rx: &mut Rx, to: u64, rkey: u32, len: u32) -> Side {
    let mut s = side(ctx, 1, true, 100);
    let mr = s.pd.alloc_mr(4096, Access::LOCAL_WRITE).expect("mr");
    mr.write_at(0, &[0xAB; 4096]).expect("fill");
    let sg = [mr.sge(0, len)];
    s.core
        .post_send(&[SendWr::new(
            1,
            SendOp::Write {
                remote_addr: to,
                rkey,
            },
            &sg,
        )])
        .expect("post");
    let bytes = tx_bytes(&mut s);
    let mut p = Pipe {
        input: bytes,
        chunk: 7,
        ..Pipe::default()
    };
    rx_all(&mut rx.side.core, &mut p);
    s
}

#[test]
fn protection_violation_writes_nothing_and_terminates() {
    let ctx = ctx();
    // Entirely outside the window: nothing is written.
    let mut rx = receiver(&ctx, true);
    let before = mr_bytes(&rx.wmr);
    let (to, key) = (rx.wmr.addr() + 9, rx.mw_key);
    let mut s = violate(&ctx, &mut rx, to, key, 50);
    assert_eq!(mr_bytes(&rx.wmr), before, "nothing may be written");
    assert_eq!(rx.side.core.state, QpState::Error);
    assert_eq!(rx.side.core.stats.term_sent, 1);
    assert_eq!(rx.side.core.stats.last_term, 0x1101);
    // The Terminate reaches the requester.
    let term = tx_bytes(&mut rx.side);
    {
        use lwio_iwarp::wire::ddp::Kind;
        use lwio_iwarp::wire::rdmap::{TerminatePacket, TerminateRepr};
        use lwio_iwarp::wire::term::TermKind;
        // MPA length (2) + untagged DDP header (18), then the Terminate.
        let ulpdu = u16::from_be_bytes([term[0], term[1]]) as usize;
        let body = &term[20..2 + ulpdu];
        let t = TerminateRepr::parse(&TerminatePacket::new_checked(body).expect("terminate"))
            .expect("reference parser accepts our Terminate");
        assert_eq!(t.error.kind(), Some(TermKind::DdpTaggedBaseBounds));
        assert!(t.flag_m && t.flag_d && !t.flag_r);
        match t.copied_ddp().expect("copied DDP header").kind {
            Kind::Tagged { stag, to } => assert_eq!((stag, to), (key, rx.wmr.addr() + 9)),
            k => panic!("{k:?}"),
        }
    }
    let mut q = Pipe {
        input: term,
        chunk: 3,
        ..Pipe::default()
    };
    rx_all(&mut s.core, &mut q);
    assert_eq!(s.core.state, QpState::Error);
    assert_eq!(s.core.stats.last_term, 0x1101);

    // A 3-segment write (100-byte FPDUs) starting at the window base: DDP
    // validates each segment, so the first (inside) is placed and the
    // second (crossing the window end) is refused whole — no byte outside
    // the window [10, 110) is ever touched.
    let mut rx = receiver(&ctx, false);
    let mut want = mr_bytes(&rx.wmr);
    let (to, key) = (rx.wmr.addr() + 10, rx.mw_key);
    violate(&ctx, &mut rx, to, key, 300);
    want[10..110].fill(0xAB);
    assert_eq!(mr_bytes(&rx.wmr), want);
    assert_eq!(rx.side.core.state, QpState::Error);
    assert_eq!(rx.side.core.stats.last_term, 0x1101);
}

#[test]
fn garbage_input_never_panics() {
    let ctx = ctx();
    let mut seed = 0x1234_5678_9abc_def0u64;
    for round in 0..300 {
        let mut rx = receiver(&ctx, round % 2 == 0);
        let len = (round * 37) % 3000 + 1;
        let mut input = pattern(seed, len);
        seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
        // Make some rounds look like plausible headers.
        if round % 3 == 0 && input.len() > 4 {
            input[2] = if round % 2 == 0 { 0xC1 } else { 0x41 };
            input[3] = 0x40 | (round as u8 % 9);
        }
        let mut p = Pipe {
            input,
            chunk: 1 + round % 64,
            ..Pipe::default()
        };
        rx_all(&mut rx.side.core, &mut p);
        let _ = tx_bytes(&mut rx.side);
        let _ = drain(&rx.side.cq);
        assert!(mr_bytes(&rx.read_mr) == pattern(3, 4096));
    }
}

#[derive(Debug, Clone)]
enum Op {
    Send(usize),
    Write(usize),
    Read(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0usize..3000).prop_map(Op::Send),
        (0usize..3000).prop_map(Op::Write),
        (0usize..3000).prop_map(Op::Read),
    ]
}

/// Move bytes both ways until nothing moves.
fn pump(a: &mut Side, b: &mut Side, chunk: usize) {
    for _ in 0..10_000 {
        let ab = tx_bytes(a);
        let ba = tx_bytes(b);
        if ab.is_empty() && ba.is_empty() {
            return;
        }
        let mut p = Pipe {
            input: ab,
            chunk,
            ..Pipe::default()
        };
        rx_all(&mut b.core, &mut p);
        assert_eq!(p.pos, p.input.len(), "receiver left bytes unread");
        let mut q = Pipe {
            input: ba,
            chunk,
            ..Pipe::default()
        };
        rx_all(&mut a.core, &mut q);
        assert_eq!(q.pos, q.input.len(), "requester left bytes unread");
    }
    panic!("pump did not settle");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn random_posts_round_trip(ops in proptest::collection::vec(op(), 1..24),
                               crc in any::<bool>(),
                               mp in 16usize..2000,
                               chunk in 1usize..5000) {
        let ctx = ctx();
        let mut a = side(&ctx, 1, crc, mp);
        let mut b = side(&ctx, 2, crc, mp);
        const SLOT: usize = 3000;
        let n = ops.len();
        let amr = a.pd.alloc_mr(n * SLOT, Access::LOCAL_WRITE).expect("mr");
        let bmr = b.pd.alloc_mr(n * SLOT, Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ).expect("mr");
        let bsrc = pattern(99, n * SLOT);
        bmr.write_at(0, &bsrc).expect("fill");
        let asrc = pattern(7, n * SLOT);
        amr.write_at(0, &asrc).expect("fill");
        // Receives for every send, in order, into per-op slots.
        let mut want_b = bsrc.clone();
        let mut want_a = asrc.clone();
        let mut recv_sizes = Vec::new();
        for (i, o) in ops.iter().enumerate() {
            let off = i * SLOT;
            match *o {
                Op::Send(sz) => {
                    let sg = [bmr.sge(off, SLOT as u32)];
                    b.core.post_recv(&[RecvWr { wr_id: i as u64, sg_list: &sg }]).expect("recv");
                    want_b[off..off + sz].copy_from_slice(&asrc[off..off + sz]);
                    recv_sizes.push((i as u64, sz));
                }
                Op::Write(sz) => want_b[off..off + sz].copy_from_slice(&asrc[off..off + sz]),
                Op::Read(sz) => want_a[off..off + sz].copy_from_slice(&bsrc[off..off + sz]),
            }
        }
        for (i, o) in ops.iter().enumerate() {
            let off = i * SLOT;
            let (op, sz) = match *o {
                Op::Send(sz) => (SendOp::Send, sz),
                Op::Write(sz) => (SendOp::Write { remote_addr: bmr.addr() + off as u64, rkey: bmr.rkey() }, sz),
                Op::Read(sz) => (SendOp::Read { remote_addr: bmr.addr() + off as u64, rkey: bmr.rkey() }, sz),
            };
            let sg = [amr.sge(off, sz as u32)];
            a.core.post_send(&[SendWr::new(i as u64, op, &sg)]).expect("send");
            if i % 5 == 4 {
                pump(&mut a, &mut b, chunk);
            }
        }
        pump(&mut a, &mut b, chunk);
        let wa = drain(&a.cq);
        let ids: Vec<u64> = wa.iter().map(|w| w.wr_id).collect();
        prop_assert_eq!(ids, (0..n as u64).collect::<Vec<_>>());
        prop_assert!(wa.iter().all(|w| w.is_ok()), "{:?}", wa);
        let wb = drain(&b.cq);
        let got: Vec<(u64, usize)> = wb.iter().map(|w| (w.wr_id, w.byte_len as usize)).collect();
        prop_assert_eq!(got, recv_sizes);
        prop_assert!(mr_bytes(&bmr) == want_b, "target memory differs");
        prop_assert!(mr_bytes(&amr) == want_a, "read sinks differ");
    }
}

/// A receive posted while a multi-segment Send is being buffered
/// anonymously (no receive was posted when it began) takes the message
/// whole, wherever the stream stood when it was posted: between segments,
/// inside a header, inside a payload or inside a trailer. (A receive posted
/// mid-payload once took the half-read segment with zeros for its unread
/// part, and the rest of that segment went to the freed buffer.)
#[test]
fn receive_posted_mid_anonymous_message_gets_it_whole() {
    const LEN: usize = 1000;
    for crc in [false, true] {
        let ctx = ctx();
        let stream = {
            let mut s = side(&ctx, 1, crc, 100);
            let mr = s.pd.alloc_mr(LEN, Access::LOCAL_WRITE).expect("mr");
            mr.write_at(0, &pattern(42, LEN)).expect("fill");
            s.core
                .post_send(&[SendWr::new(1, SendOp::Send, &[mr.sge(0, LEN as u32)])])
                .expect("send");
            tx_bytes(&mut s)
        };
        assert!(stream.len() > LEN, "{} bytes", stream.len());
        let want = pattern(42, LEN);
        // Under Miri every 61st offset (each run is ~10^5 times slower).
        for k in (0..=stream.len()).step_by(if cfg!(miri) { 61 } else { 1 }) {
            let mut rx = side(&ctx, 2, crc, 100);
            let mr = rx.pd.alloc_mr(LEN, Access::LOCAL_WRITE).expect("mr");
            let mut p = Pipe {
                input: stream[..k].to_vec(),
                chunk: usize::MAX,
                ..Pipe::default()
            };
            rx_all(&mut rx.core, &mut p);
            rx.core
                .post_recv(&[RecvWr {
                    wr_id: 9,
                    sg_list: &[mr.sge(0, LEN as u32)],
                }])
                .expect("recv");
            p.input.extend_from_slice(&stream[k..]);
            rx_all(&mut rx.core, &mut p);
            let w = drain(&rx.cq);
            assert_eq!(w.len(), 1, "crc={crc} posted at {k}: {w:?}");
            assert!(w[0].is_ok(), "crc={crc} posted at {k}: {w:?}");
            assert_eq!(w[0].byte_len as usize, LEN, "crc={crc} posted at {k}");
            let got = mr_bytes(&mr);
            if let Some(i) = (0..LEN).find(|&i| got[i] != want[i]) {
                panic!("crc={crc} posted at {k}: first difference at byte {i}");
            }
            assert_eq!(rx.core.state, QpState::Rts, "crc={crc} posted at {k}");
            assert!(rx.core.rx_idle(), "crc={crc} posted at {k}");
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// The fuzz target's body (fuzz/fuzz_targets/soft_qp_rx.rs) on random
    /// inputs: arbitrary traffic, framing, windows and schedules of
    /// delivery and receive posting; exact data where nothing was corrupted.
    #[test]
    fn receive_engine_under_random_schedules(data in proptest::collection::vec(any::<u8>(), 0..400)) {
        super::fuzzing::soft_qp_rx(&data);
    }
}

// ---------------------------------------------------------------------
// Golden transmit bytes.

/// Where the golden test maps its registered memory: a fixed address, so
/// that the addresses a Read Request carries (its sink TO is the local
/// SGE's address) are the same in every run.
const GOLDEN_BASE: usize = 0x5a5a_0000_0000;
const GOLDEN_LEN: usize = 64 * 1024;

/// An anonymous mapping at `GOLDEN_BASE`, unmapped on drop.
struct FixedMap(*mut u8);

impl FixedMap {
    fn new() -> FixedMap {
        // SAFETY: a fresh anonymous private mapping at an address nobody
        // else uses (MAP_FIXED_NOREPLACE fails instead of replacing an
        // existing mapping); the result is checked below.
        let p = unsafe {
            libc::mmap(
                GOLDEN_BASE as *mut libc::c_void,
                GOLDEN_LEN,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED_NOREPLACE,
                -1,
                0,
            )
        };
        assert_eq!(p as usize, GOLDEN_BASE, "mmap at the golden address");
        FixedMap(p as *mut u8)
    }
}

impl Drop for FixedMap {
    fn drop(&mut self) {
        // SAFETY: our own mapping; every registration over it is dropped
        // before the map (declared first, dropped last).
        unsafe { libc::munmap(self.0 as *mut libc::c_void, GOLDEN_LEN) };
    }
}

/// FNV-1a, 64 bit.
fn fnv64(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf2_9ce4_8422_2325, |h, &x| {
        (h ^ x as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

/// The transmit streams of a representative set of posts, per framing
/// (CRC off/on, several payload sizes, including ones that are not a
/// multiple of 4): every opcode, multi-segment Sends and Writes over
/// several SGEs, zero-length Send with Invalidate and zero-length Write,
/// inline Send, Read Requests, Read Responses (to a peer's reads), a
/// Terminate (the answer to a Write through an invalid STag).
fn golden_streams() -> Vec<(String, Vec<u8>)> {
    let map = FixedMap::new();
    let half = GOLDEN_LEN / 2;
    let mut out = Vec::new();
    for (crc, maxp) in [
        (false, 100),
        (true, 100),
        (false, 1434),
        (true, 1434),
        (false, 17),
        (true, 4000),
        (false, 65_000),
    ] {
        let ctx = ctx();
        let mut a = side(&ctx, 1, crc, maxp);
        let mut b = side(&ctx, 2, crc, maxp);
        let acc = Access::LOCAL_WRITE | Access::REMOTE_READ | Access::REMOTE_WRITE;
        // SAFETY: the mapping outlives both registrations (dropped at the
        // end of this iteration); only the engines and `write_at` touch it.
        let (amr, bmr) = unsafe {
            (
                a.pd.register_raw(map.0, half, acc).expect("reg a"),
                b.pd.register_raw(map.0.add(half), half, acc)
                    .expect("reg b"),
            )
        };
        amr.write_at(0, &pattern(7, half)).expect("fill a");
        bmr.write_at(0, &pattern(8, half)).expect("fill b");
        let name = |what: &str| format!("crc={} max_payload={maxp} {what}", crc as u8);

        let s1 = [amr.sge(0, 1000), amr.sge(2000, 2000)];
        let s2 = [amr.sge(5000, 5)];
        let s4 = [amr.sge(6001, 33)];
        let s5 = [amr.sge(7000, 700), amr.sge(8003, 1000), amr.sge(9000, 800)];
        let s7 = [amr.sge(12_000, 4096)];
        let s8 = [amr.sge(17_000, 40)];
        let s9 = [amr.sge(18_000, 2)];
        let mut se = SendWr::new(2, SendOp::Send, &s2);
        se.solicited = true;
        let mut inv_se = SendWr::new(4, SendOp::SendWithInvalidate { rkey: 0x0bad_cafe }, &s4);
        inv_se.solicited = true;
        let mut inline = SendWr::new(8, SendOp::Send, &s8);
        inline.inline = true;
        a.core
            .post_send(&[
                SendWr::new(1, SendOp::Send, &s1),
                se,
                SendWr::new(3, SendOp::SendWithInvalidate { rkey: 0x1234_5678 }, &[]),
                inv_se,
                SendWr::new(
                    5,
                    SendOp::Write {
                        remote_addr: 0x1000_0000_0007,
                        rkey: 0xabcd,
                    },
                    &s5,
                ),
                SendWr::new(
                    6,
                    SendOp::Write {
                        remote_addr: 0x1000_0000_0008,
                        rkey: 0xabce,
                    },
                    &[],
                ),
                SendWr::new(
                    7,
                    SendOp::Read {
                        remote_addr: 0x2000_0000_0003,
                        rkey: 0x77,
                    },
                    &s7,
                ),
                inline,
                SendWr::new(9, SendOp::Send, &s9),
            ])
            .expect("post a");
        out.push((name("sq"), tx_bytes(&mut a)));

        // The peer's reads of A's memory, answered by A.
        let r1 = [bmr.sge(5, 3001)];
        b.core
            .post_send(&[
                SendWr::new(
                    21,
                    SendOp::Read {
                        remote_addr: amr.addr() + 11,
                        rkey: amr.rkey(),
                    },
                    &r1,
                ),
                SendWr::new(
                    22,
                    SendOp::Read {
                        remote_addr: amr.addr() + 20_000,
                        rkey: amr.rkey(),
                    },
                    &[],
                ),
            ])
            .expect("post b reads");
        let reqs = tx_bytes(&mut b);
        out.push((name("peer read requests"), reqs.clone()));
        let mut p = Pipe {
            input: reqs,
            chunk: usize::MAX,
            ..Pipe::default()
        };
        rx_all(&mut a.core, &mut p);
        out.push((name("read responses"), tx_bytes(&mut a)));

        // A Write through a key A does not have: A terminates.
        let w = [bmr.sge(100, 10)];
        b.core
            .post_send(&[SendWr::new(
                23,
                SendOp::Write {
                    remote_addr: amr.addr(),
                    rkey: 0x00de_ad00,
                },
                &w,
            )])
            .expect("post b write");
        p.input.extend_from_slice(&tx_bytes(&mut b));
        rx_all(&mut a.core, &mut p);
        out.push((name("terminate"), tx_bytes(&mut a)));
        drop((amr, bmr, a, b));
    }
    out
}

/// The golden file: one line per stream, `name|length|fnv64`. Generated by
/// the transmit path before it moved onto lwio-iwarp; regenerate (only
/// when the wire format is meant to change) with `LWIO_TX_GOLDEN=write`.
const GOLDEN_FILE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/src/soft/tx_golden.txt");

#[test]
fn transmit_bytes_match_golden() {
    let got: String = golden_streams()
        .iter()
        .map(|(n, b)| format!("{n}|{}|{:016x}\n", b.len(), fnv64(b)))
        .collect();
    if std::env::var("LWIO_TX_GOLDEN").as_deref() == Ok("write") {
        std::fs::write(GOLDEN_FILE, &got).expect("write golden");
        return;
    }
    let want = std::fs::read_to_string(GOLDEN_FILE).expect("golden file");
    for (g, w) in got.lines().zip(want.lines()) {
        assert_eq!(g, w, "transmit bytes differ from the golden stream");
    }
    assert_eq!(got.lines().count(), want.lines().count(), "stream count");
}

/// Transmit-engine microbenchmark (`cargo test --release -p lwio-rdma --lib
/// tx_segment_cost -- --ignored --nocapture`): ns per segment to frame
/// RDMA Writes and Sends and hand them to an `Io` that takes every iovec
/// without reading it (so the socket's copy is not measured). Best of 7.
#[test]
#[ignore]
fn tx_segment_cost() {
    use super::qp::Io;
    struct Sink;
    // SAFETY: neither method touches memory: `read` returns nothing and
    // `writev` only adds up the lengths.
    impl Io for Sink {
        unsafe fn read(&mut self, _dst: *mut u8, _len: usize) -> std::io::Result<usize> {
            Err(std::io::ErrorKind::WouldBlock.into())
        }
        unsafe fn writev(&mut self, iov: &[libc::iovec]) -> std::io::Result<usize> {
            Ok(iov.iter().map(|v| v.iov_len).sum())
        }
    }
    for (crc, maxp, size, send) in [
        (false, 256, 16 * 1024, false),
        (false, 1434, 64 * 1024, false),
        (false, 4096, 64 * 1024, false),
        (false, 1434, 4096, true),
        (true, 1434, 4096, false),
    ] {
        let ctx = ctx();
        let mut s = side(&ctx, 1, crc, maxp);
        let mr = s.pd.alloc_mr(size, Access::LOCAL_WRITE).expect("mr");
        let sg = [mr.sge(0, size as u32)];
        let op = if send {
            SendOp::Send
        } else {
            SendOp::Write {
                remote_addr: 0x1000,
                rkey: 0x100,
            }
        };
        let mut wr = SendWr::new(0, op, &sg);
        wr.signaled = false;
        let wrs = vec![wr; 128];
        let segs = 128 * size.div_ceil(maxp);
        let mut best = f64::MAX;
        for _ in 0..7 {
            let rounds = 20;
            let t = std::time::Instant::now();
            for _ in 0..rounds {
                s.core.post_send(&wrs).expect("post");
                s.core.tx_process(&mut Sink).expect("tx");
            }
            let ns = t.elapsed().as_nanos() as f64 / (rounds * segs) as f64;
            best = best.min(ns);
        }
        println!(
            "{} {size} B, max_payload {maxp}, crc {crc}: {best:.1} ns/segment",
            if send { "send" } else { "write" }
        );
    }
}

/// A frame partly written when the QP is flushed is finished from the
/// frame's own copy of its payload: the WR completes (flushed) at once, and
/// its `register_raw` memory may then be freed or reused by its owner
/// before the rest of the frame goes out.
#[test]
fn flushed_partial_frame_sends_from_its_own_copy() {
    use super::qp::Io;
    use std::io;
    /// Takes `left` bytes, then would block.
    struct Partial {
        left: usize,
        out: Vec<u8>,
    }
    // SAFETY: `read` writes nothing; `writev` reads at most the bytes of
    // the iovecs, which the caller guarantees readable.
    impl Io for Partial {
        unsafe fn read(&mut self, _dst: *mut u8, _len: usize) -> io::Result<usize> {
            Err(io::ErrorKind::WouldBlock.into())
        }
        unsafe fn writev(&mut self, iov: &[libc::iovec]) -> io::Result<usize> {
            let mut t = 0;
            for v in iov {
                let n = v.iov_len.min(self.left - t);
                self.out
                    .extend_from_slice(std::slice::from_raw_parts(v.iov_base as *const u8, n));
                t += n;
            }
            self.left -= t;
            if t == 0 {
                return Err(io::ErrorKind::WouldBlock.into());
            }
            Ok(t)
        }
    }
    let ctx = ctx();
    let mut s = side(&ctx, 1, false, 100);
    let mut mem = pattern(3, 200);
    // SAFETY: `mem` outlives the registration and the WR, and is written
    // below only after the WR completed (as its owner may then).
    let mr = unsafe {
        s.pd.register_raw(mem.as_mut_ptr(), mem.len(), Access::LOCAL_WRITE)
    }
    .expect("mr");
    let sge = [mr.sge(0, 100)];
    let write = SendOp::Write {
        remote_addr: 0x1000,
        rkey: 0x4200,
    };
    s.core
        .post_send(&[SendWr::new(7, write, &sge)])
        .expect("post");
    let mut io = Partial {
        left: 30,
        out: Vec::new(),
    };
    s.core.tx_process(&mut io).expect("tx");
    assert_eq!(io.out.len(), 30, "the frame is partly written");
    s.core.enter_error(None);
    let w = drain(&s.cq);
    assert_eq!(w.len(), 1, "{w:?}");
    assert_eq!((w[0].wr_id, w[0].status), (7, WcStatus::WrFlushErr));
    // The owner takes its memory back and reuses it.
    drop(mr);
    mem.fill(0xee);
    let mut out = io.out;
    out.extend(tx_bytes(&mut s));
    // MPA header (2) + tagged DDP/RDMAP header (14), then the payload as it
    // was when the WR was posted.
    let expect = pattern(3, 100);
    assert_eq!(out.get(16..116), Some(&expect[..]), "{out:?}");
}

// ---------------------------------------------------------------------------
// Shared receive queues, over loopback sockets (the wake-up of a QP holding
// Sends goes through its context).

/// A soft context with progress model `progress`.
fn open_soft(progress: Progress) -> Context {
    super::provider()
        .open(
            Some(super::DEVICE),
            &Config {
                progress,
                ..Config::default()
            },
        )
        .expect("open")
}

/// Connect `c` (QP `cinit`) to listener `l`, accepted with `sinit`:
/// (server QP, client QP).
fn accept_and_connect(l: &Listener, sinit: &QpInit, c: &Context, cinit: &QpInit) -> (Qp, Qp) {
    let addr = l.local_addr();
    std::thread::scope(|sc| {
        let h = sc.spawn(|| {
            let r = l
                .get_request(Some(std::time::Duration::from_secs(10)))
                .expect("request")
                .expect("a request");
            r.accept(sinit, &ConnParams::default()).expect("accept")
        });
        let q = c
            .connect(addr, cinit, &ConnParams::default())
            .expect("connect");
        (h.join().expect("accept thread"), q)
    })
}

/// A server context (`Progress::Manual`, one SRQ) and a client context.
struct SrqRig {
    s: Context,
    c: Context,
    l: Listener,
    spd: Pd,
    scq: Cq,
    srq: Srq,
}

impl SrqRig {
    /// `n` receives of 64 bytes each, wr_ids 10, 11, …, posted to the SRQ
    /// in that order; their region, filled with 0xEE.
    fn post_numbered(&self, n: usize) -> Mr {
        let smr = self.spd.alloc_mr(n * 64, Access::LOCAL_WRITE).expect("mr");
        smr.fill(0, n * 64, 0xEE).expect("fill");
        let sg: Vec<[Sge; 1]> = (0..n).map(|i| [smr.sge(i * 64, 64)]).collect();
        let wrs: Vec<RecvWr<'_>> = sg
            .iter()
            .enumerate()
            .map(|(i, s)| RecvWr {
                wr_id: 10 + i as u64,
                sg_list: s,
            })
            .collect();
        self.srq.post_recv(&wrs).expect("post");
        smr
    }

    fn new() -> SrqRig {
        let (s, c) = (open_soft(Progress::Manual), open_soft(Progress::Auto));
        let l = s
            .listen("127.0.0.1:0".parse().expect("addr"), 16)
            .expect("listen");
        let spd = s.alloc_pd().expect("pd");
        let scq = s.create_cq(256, None).expect("cq");
        let srq = spd.create_srq(64, 2).expect("srq");
        SrqRig {
            s,
            c,
            l,
            spd,
            scq,
            srq,
        }
    }

    /// A server QP on the SRQ (receive window `window`) and its client
    /// peer (QP, PD, CQ).
    fn connect(&self, window: Option<usize>) -> (Qp, Qp, Pd, Cq) {
        let sinit = QpInit {
            recv_window: window,
            srq: Some(self.srq.clone()),
            ..QpInit::new(&self.spd, &self.scq)
        };
        let cpd = self.c.alloc_pd().expect("pd");
        let ccq = self.c.create_cq(256, None).expect("cq");
        let cinit = QpInit::new(&cpd, &ccq);
        let (sqp, cqp) = accept_and_connect(&self.l, &sinit, &self.c, &cinit);
        (sqp, cqp, cpd, ccq)
    }

    /// Drive the server for `ms` milliseconds, collecting its completions.
    fn run(&self, ms: u64) -> Vec<Wc> {
        let t = std::time::Instant::now();
        let mut v = Vec::new();
        let mut b = [Wc::BLANK; 16];
        while t.elapsed() < std::time::Duration::from_millis(ms) {
            self.s.progress().expect("progress");
            let k = self.scq.poll(&mut b).expect("poll");
            v.extend_from_slice(&b[..k]);
            std::thread::sleep(std::time::Duration::from_micros(200));
        }
        v
    }

    /// Drive the server until `n` completions (30 s at most).
    fn wait(&self, n: usize) -> Vec<Wc> {
        let t = std::time::Instant::now();
        let mut v = Vec::new();
        let mut b = [Wc::BLANK; 16];
        while v.len() < n {
            assert!(t.elapsed().as_secs() < 30, "timeout after {v:?}");
            let k = self
                .scq
                .poll(&mut b[..(n - v.len()).min(16)])
                .expect("poll");
            v.extend_from_slice(&b[..k]);
            if k == 0 {
                self.s.progress().expect("progress");
                std::thread::yield_now();
            }
        }
        v
    }
}

/// Sends to a QP whose SRQ is empty are held (anonymously, then with the
/// socket left unread once the QP's window is full: 3 × 3000 bytes against
/// 4 KiB) and placed byte for byte, in arrival order, once receives are
/// posted to the SRQ.
#[test]
fn srq_empty_holds_sends_until_receives_are_posted() {
    let rig = SrqRig::new();
    let (sqp, cqp, cpd, ccq) = rig.connect(Some(4096));
    let cmr = cpd.alloc_mr(3 * 3000, Access::LOCAL_WRITE).expect("mr");
    let data: Vec<Vec<u8>> = (0..3).map(|i| pattern(70 + i, 3000)).collect();
    for (i, d) in data.iter().enumerate() {
        cmr.write_at(i * 3000, d).expect("fill");
    }
    let sges: Vec<[Sge; 1]> = (0..3).map(|i| [cmr.sge(i * 3000, 3000)]).collect();
    let sends: Vec<SendWr<'_>> = sges
        .iter()
        .enumerate()
        .map(|(i, sg)| SendWr::new(i as u64, SendOp::Send, sg))
        .collect();
    cqp.post_send(&sends).expect("send");
    let early = rig.run(150);
    assert!(early.is_empty(), "completions with an empty SRQ: {early:?}");
    assert_eq!(rig.srq.posted(), 0);
    assert_eq!(rig.srq.starved(), 1, "one QP waits for a receive");
    let st = super::qp_stats(&sqp).expect("soft QP");
    assert!(st.anon_bytes > 0, "the first Send is buffered: {st:?}");
    assert!(
        st.paused > 0,
        "the window filled and reading stopped: {st:?}"
    );
    let smr = rig.spd.alloc_mr(4 * 4096, Access::LOCAL_WRITE).expect("mr");
    smr.fill(0, 4 * 4096, 0xEE).expect("fill");
    for i in 0..4 {
        rig.srq
            .post_recv(&[RecvWr {
                wr_id: 500 + i as u64,
                sg_list: &[smr.sge(i * 4096, 4000)],
            }])
            .expect("post to the SRQ");
    }
    let w = rig.wait(3);
    for (i, wc) in w.iter().enumerate() {
        assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
        assert_eq!(wc.opcode, WcOpcode::Recv, "{wc:?}");
        assert_eq!(wc.wr_id, 500 + i as u64, "arrival order: {w:?}");
        assert_eq!(wc.qp_num, sqp.qp_num(), "{wc:?}");
        assert_eq!(wc.byte_len, 3000, "{wc:?}");
        let mut got = vec![0u8; 4096];
        smr.read_at(i * 4096, &mut got).expect("read");
        assert!(got[..3000] == data[i][..], "message {i} differs");
        assert!(got[3000..].iter().all(|&b| b == 0xEE), "past message {i}");
    }
    assert_eq!(rig.srq.posted(), 1);
    let mut b = [Wc::BLANK; 4];
    let t = std::time::Instant::now();
    let mut sent = 0;
    while sent < 3 && t.elapsed().as_secs() < 30 {
        sent += ccq.poll(&mut b).expect("poll");
    }
    assert_eq!(sent, 3);
    assert!(rig.run(20).is_empty());
    assert_eq!(super::qp_stats(&sqp).expect("soft").anon_bytes, 0);
    assert_eq!(rig.srq.starved(), 1, "no wait since the post");
}

/// A QP in error flushes none of its SRQ's receives: they stay posted and
/// another QP of the SRQ consumes them, first posted first.
#[test]
fn srq_qp_error_leaves_srq_receives() {
    let rig = SrqRig::new();
    let (qa, _ca, _pa, _cqa) = rig.connect(None);
    let (qb, cb, pb, cqb) = rig.connect(None);
    let smr = rig.spd.alloc_mr(2 * 64, Access::LOCAL_WRITE).expect("mr");
    let (s0, s1) = ([smr.sge(0, 64)], [smr.sge(64, 64)]);
    rig.srq
        .post_recv(&[
            RecvWr {
                wr_id: 1,
                sg_list: &s0,
            },
            RecvWr {
                wr_id: 2,
                sg_list: &s1,
            },
        ])
        .expect("post");
    qa.set_error();
    assert_eq!(qa.state(), QpState::Error);
    let flushed = rig.run(100);
    assert!(
        flushed.iter().all(|w| w.qp_num == qa.qp_num()) && flushed.iter().all(|w| w.wr_id > 2),
        "SRQ receives flushed by QP A's error: {flushed:?}"
    );
    assert_eq!(rig.srq.posted(), 2, "{flushed:?}");
    let cmr = pb.alloc_mr(64, Access::LOCAL_WRITE).expect("mr");
    let data = pattern(99, 40);
    cmr.write_at(0, &data).expect("fill");
    cb.post_send(&[SendWr::new(7, SendOp::Send, &[cmr.sge(0, 40)])])
        .expect("send");
    let w = rig.wait(1);
    assert_eq!(w[0].status, WcStatus::Success, "{w:?}");
    assert_eq!(w[0].wr_id, 1, "first posted first: {w:?}");
    assert_eq!(w[0].qp_num, qb.qp_num());
    assert_eq!(w[0].byte_len, 40);
    let mut got = vec![0u8; 40];
    smr.read_at(0, &mut got).expect("read");
    assert_eq!(got, data);
    assert_eq!(rig.srq.posted(), 1);
    let mut b = [Wc::BLANK; 2];
    let t = std::time::Instant::now();
    while cqb.poll(&mut b).expect("poll") == 0 {
        assert!(t.elapsed().as_secs() < 30);
    }
    assert_eq!(b[0].wr_id, 7);
    // A QP of an SRQ takes no receives of its own.
    assert!(matches!(
        qb.post_recv(&[RecvWr {
            wr_id: 3,
            sg_list: &s0,
        }]),
        Err(PostError {
            error: Error::InvalidArgument(_),
            ..
        })
    ));
}

/// `Srq::withdraw` takes back untaken receives, last posted first, and
/// never one a QP has taken: a Send then lands in the receive left posted.
#[test]
fn srq_withdraw_takes_back_untaken_receives() {
    let rig = SrqRig::new();
    let (qb, cb, pb, _cqb) = rig.connect(None);
    let smr = rig.post_numbered(3);
    assert_eq!(rig.srq.withdraw(2), vec![12, 11]);
    assert_eq!(rig.srq.posted(), 1);
    assert_eq!(rig.srq.withdraw(0), Vec::<u64>::new());
    let cmr = pb.alloc_mr(64, Access::LOCAL_WRITE).expect("mr");
    let data = pattern(5, 50);
    cmr.write_at(0, &data).expect("fill");
    cb.post_send(&[SendWr::new(1, SendOp::Send, &[cmr.sge(0, 50)])])
        .expect("send");
    let w = rig.wait(1);
    assert_eq!(
        (w[0].wr_id, w[0].qp_num, w[0].byte_len),
        (10, qb.qp_num(), 50)
    );
    let mut got = vec![0u8; 3 * 64];
    smr.read_at(0, &mut got).expect("read");
    assert_eq!(&got[..50], &data[..]);
    assert!(
        got[64..].iter().all(|&b| b == 0xEE),
        "withdrawn buffers untouched"
    );
    assert_eq!(
        rig.srq.withdraw(5),
        Vec::<u64>::new(),
        "the taken one is gone"
    );
}

#[test]
fn srq_withdraw_if_takes_back_the_picked_receives_and_keeps_the_order() {
    let rig = SrqRig::new();
    let (qb, cb, pb, _cqb) = rig.connect(None);
    let smr = rig.post_numbered(5);
    assert_eq!(rig.srq.withdraw_if(|id| id % 2 == 0), vec![10, 12, 14]);
    assert_eq!(rig.srq.posted(), 2);
    let cmr = pb.alloc_mr(64, Access::LOCAL_WRITE).expect("mr");
    let data = pattern(9, 40);
    cmr.write_at(0, &data).expect("fill");
    cb.post_send(&[SendWr::new(1, SendOp::Send, &[cmr.sge(0, 40)])])
        .expect("send");
    let w = rig.wait(1);
    assert_eq!(
        (w[0].wr_id, w[0].qp_num, w[0].byte_len),
        (11, qb.qp_num(), 40),
        "the first kept receive takes the Send"
    );
    let mut got = vec![0u8; 5 * 64];
    smr.read_at(0, &mut got).expect("read");
    assert_eq!(&got[64..104], &data[..]);
    assert!(
        got[..64].iter().chain(&got[128..]).all(|&b| b == 0xEE),
        "withdrawn and untaken buffers untouched"
    );
    assert_eq!(rig.srq.withdraw_if(|_| true), vec![13]);
    assert_eq!(rig.srq.posted(), 0);
}

/// Under `Progress::Manual` a QP reads at most `RX_BUDGET_MANUAL` segments
/// per round, and the context's fd (so a manual channel's fd) must stay
/// readable for as long as such leftover work waits: the socket, read only
/// in part, reports no new edge. 200 small RDMA Writes and a Send are in
/// the server's socket before it reads any; a consumer that sleeps in
/// `poll(2)` on its channel between rounds gets them all, byte for byte.
/// Before the fix, the second round consumed the wake-up that the first
/// had left for the leftover and the consumer slept with 3,000 bytes
/// unread (a `lwio publish` process left the server's RDMA Read of its
/// memory unanswered so, and a publisher's memory lacked writes the
/// server had reported done).
#[test]
fn manual_progress_keeps_the_channel_readable_while_budgeted_work_is_left() {
    use std::os::fd::BorrowedFd;
    const N: usize = 200;
    const LEN: usize = 64;
    let (s, c) = (open_soft(Progress::Manual), open_soft(Progress::Auto));
    let l = s
        .listen("127.0.0.1:0".parse().expect("addr"), 4)
        .expect("listen");
    let chan = s.create_comp_channel().expect("channel");
    let spd = s.alloc_pd().expect("pd");
    let scq = s.create_cq(64, Some(&chan)).expect("cq");
    let smr = spd
        .alloc_mr(N * LEN + 64, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
        .expect("mr");
    smr.fill(0, N * LEN + 64, 0xEE).expect("fill");
    let cpd = c.alloc_pd().expect("pd");
    let ccq = c.create_cq(512, None).expect("cq");
    let data = pattern(91, N * LEN + 64);
    let cmr = cpd.alloc_mr(N * LEN + 64, Access::LOCAL_WRITE).expect("mr");
    cmr.write_at(0, &data).expect("fill");
    let sinit = QpInit::new(&spd, &scq);
    let cinit = QpInit {
        cap: QpCap {
            max_send_wr: (N + 8) as u32,
            ..QpCap::default()
        },
        ..QpInit::new(&cpd, &ccq)
    };
    let (sqp, cqp) = accept_and_connect(&l, &sinit, &c, &cinit);
    sqp.post_recv(&[RecvWr {
        wr_id: 7,
        sg_list: &[smr.sge(N * LEN, 64)],
    }])
    .expect("post recv");
    // The server's socket holds every segment before it reads one.
    let sges: Vec<[Sge; 1]> = (0..=N).map(|i| [cmr.sge(i * LEN, LEN as u32)]).collect();
    let wrs: Vec<SendWr<'_>> = sges
        .iter()
        .enumerate()
        .map(|(i, sg)| {
            let op = if i < N {
                SendOp::Write {
                    remote_addr: smr.addr() + (i * LEN) as u64,
                    rkey: smr.rkey(),
                }
            } else {
                SendOp::Send
            };
            SendWr::new(i as u64, op, sg)
        })
        .collect();
    cqp.post_send(&wrs).expect("post");
    let t = std::time::Instant::now();
    let mut done = 0;
    let mut b = [Wc::BLANK; 64];
    while done <= N {
        assert!(t.elapsed().as_secs() < 30, "the client's sends: {done}");
        done += ccq.poll(&mut b).expect("poll");
    }
    std::thread::sleep(std::time::Duration::from_millis(50));
    // The consumer: a round, then sleep on the channel until it is readable.
    let mut got = Vec::new();
    let mut rounds = 0;
    while got.is_empty() {
        rounds += 1;
        s.progress().expect("progress");
        scq.arm(false).expect("arm");
        let k = scq.poll(&mut b).expect("poll");
        got.extend_from_slice(&b[..k]);
        if !got.is_empty() {
            break;
        }
        // SAFETY: the channel outlives this borrow.
        let fd = unsafe { BorrowedFd::borrow_raw(chan.fd()) };
        let mut fds = [rustix::event::PollFd::new(
            &fd,
            rustix::event::PollFlags::IN,
        )];
        let ts = rustix::event::Timespec {
            tv_sec: 5,
            tv_nsec: 0,
        };
        let n = rustix::event::poll(&mut fds, Some(&ts)).expect("poll(2)");
        let st = super::qp_stats(&sqp).expect("soft QP");
        assert!(
            n == 1,
            "round {rounds}: the channel's fd is not readable, with the Send not yet \
             delivered and budgeted work left ({st:?})"
        );
        let _ = chan.take_fired(&mut Vec::new());
    }
    assert!(
        rounds > 2,
        "{rounds} rounds: the budget did not stop a round"
    );
    assert_eq!(got.len(), 1, "{got:?}");
    assert_eq!(got[0].status, WcStatus::Success, "{got:?}");
    assert_eq!(got[0].wr_id, 7);
    assert_eq!(got[0].byte_len, LEN as u32);
    let mut placed = vec![0u8; N * LEN + 64];
    smr.read_at(0, &mut placed).expect("read");
    assert!(placed == data, "the Writes and the Send, byte for byte");
}

// ---------------------------------------------------------------------------
// Revocation while a segment's payload is arriving (issue 31).

/// What revoking a key does to a placement half done.
#[derive(Clone, Copy, Debug)]
enum Revoke {
    /// `Mr::drop` (deregistration) of the region written directly.
    Dereg,
    /// Local invalidation of the window the Write goes through.
    Invalidate,
    /// Deregistration of the region under the window.
    DeregUnderWindow,
}

/// A single-segment RDMA Write of `len` bytes arrives in two halves; between
/// them the program revokes the key and takes its memory back. No byte of the
/// memory changes after the revocation returned, and the stream ends with a
/// Terminate (invalid STag). Before the fix the second half was placed into
/// the deregistered memory (direct `read(2)` with CRC off, a staged copy with
/// CRC on).
fn revoke_mid_segment(crc: bool, how: Revoke) {
    let what = format!("crc={crc} {how:?}");
    let ctx = ctx();
    let len = 16 * 1024usize;
    let mut rx = side(&ctx, 2, crc, 32 * 1024);
    // Memory the test owns: after the revocation it is the program's again.
    let mut mem = vec![0u8; len + 64];
    let base = mem.as_mut_ptr();
    // SAFETY: `mem` outlives the region (dropped at the revocation or at the
    // end of this function); it is read below only through the raw pointer
    // while the engine is not running (single-threaded test).
    let mr = unsafe {
        rx.pd.register_raw(
            base,
            mem.len(),
            Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::MW_BIND,
        )
    }
    .expect("register");
    let mw = rx.pd.alloc_mw().expect("mw");
    let (to, key) = match how {
        Revoke::Dereg => (mr.addr() + 32, mr.rkey()),
        Revoke::Invalidate | Revoke::DeregUnderWindow => {
            let soft_mw = (*mw.0).as_any().downcast_ref::<SoftMw>().expect("soft mw");
            let k = rx
                .core
                .bind(
                    soft_mw,
                    &MwBind {
                        mr: &mr,
                        offset: 0,
                        length: mem.len() as u64,
                        access: Access::REMOTE_WRITE,
                        one_shot: true,
                    },
                    1,
                    false,
                )
                .expect("bind");
            (mr.addr() + 32, k)
        }
    };
    let mut s = side(&ctx, 1, crc, 32 * 1024);
    let smr = s.pd.alloc_mr(len, Access::LOCAL_WRITE).expect("mr");
    smr.write_at(0, &vec![0xAB; len]).expect("fill");
    let sg = [smr.sge(0, len as u32)];
    s.core
        .post_send(&[SendWr::new(
            1,
            SendOp::Write {
                remote_addr: to,
                rkey: key,
            },
            &sg,
        )])
        .expect("post");
    let stream = tx_bytes(&mut s);
    assert!(
        stream.len() > len,
        "{what}: one segment of {}",
        stream.len()
    );
    // Header and the first half of the payload.
    let half = 2 + 18 + len / 2;
    let mut p = Pipe {
        input: stream[..half].to_vec(),
        chunk: usize::MAX,
        ..Pipe::default()
    };
    rx_all(&mut rx.core, &mut p);
    let snap = |b: *const u8| -> Vec<u8> {
        // SAFETY: `mem` is live; nothing writes it during the copy.
        unsafe { std::slice::from_raw_parts(b, len + 64) }.to_vec()
    };
    let before = snap(base);
    assert!(
        before[32..32 + len / 2 - 64].iter().all(|&b| b == 0xAB),
        "{what}: the first half was placed"
    );
    assert!(!rx.core.rx_idle(), "{what}: mid-segment");
    match how {
        Revoke::Dereg | Revoke::DeregUnderWindow => drop(mr),
        Revoke::Invalidate => {
            rx.core.invalidate(key, 2, false).expect("invalidate");
        }
    }
    // The peer goes on: the rest of the segment.
    p.input.extend_from_slice(&stream[half..]);
    rx_all(&mut rx.core, &mut p);
    assert!(
        snap(base) == before,
        "{what}: bytes of the revoked memory changed after the revocation returned"
    );
    assert_eq!(rx.core.state, QpState::Error, "{what}");
    assert_eq!(rx.core.stats.term_sent, 1, "{what}");
    assert_eq!(
        rx.core.stats.last_term,
        lwio_iwarp::wire::term::TermError::from(
            lwio_iwarp::wire::term::TermKind::DdpTaggedInvalidStag
        )
        .vendor_err(),
        "{what}"
    );
    drop(mw);
    drop(mem);
}

#[test]
fn deregistration_mid_segment_places_nothing_more() {
    for crc in [false, true] {
        revoke_mid_segment(crc, Revoke::Dereg);
    }
}

#[test]
fn window_invalidation_mid_segment_places_nothing_more() {
    for crc in [false, true] {
        revoke_mid_segment(crc, Revoke::Invalidate);
        revoke_mid_segment(crc, Revoke::DeregUnderWindow);
    }
}

/// A Read Response from caller-owned memory (`register_raw`) does not
/// depend on the memory outliving the `Mr`: a Read answered while the
/// region is registered carries the bytes; a Read still queued when the
/// `Mr` is dropped is refused with a Terminate and never sends what the
/// memory holds afterwards.
#[test]
fn read_of_raw_memory_deregistered_while_queued_sends_nothing_of_it() {
    for crc in [false, true] {
        for dereg in [false, true] {
            let what = format!("crc={crc} dereg={dereg}");
            let ctx = ctx();
            let mut rx = side(&ctx, 2, crc, 32 * 1024);
            let len = 4096usize;
            let mut mem = vec![0x5Au8; len];
            let base = mem.as_mut_ptr();
            // SAFETY: `mem` outlives the region (dropped below, or at the
            // end of this iteration, before `mem`); nothing reads or writes
            // it through a reference while the region exists (manual
            // progress, single thread).
            let mr = unsafe {
                rx.pd
                    .register_raw(base, len, Access::LOCAL_WRITE | Access::REMOTE_READ)
            }
            .expect("register");
            let mut s = side(&ctx, 1, crc, 32 * 1024);
            let smr = s.pd.alloc_mr(len, Access::LOCAL_WRITE).expect("mr");
            let sg = [smr.sge(0, len as u32)];
            s.core
                .post_send(&[SendWr::new(
                    1,
                    SendOp::Read {
                        remote_addr: mr.addr(),
                        rkey: mr.rkey(),
                    },
                    &sg,
                )])
                .expect("post");
            let mut p = Pipe {
                input: tx_bytes(&mut s),
                chunk: usize::MAX,
                ..Pipe::default()
            };
            rx_all(&mut rx.core, &mut p);
            if dereg {
                drop(mr);
                // The memory is the program's again.
                mem.fill(0xEE);
            }
            let resp = tx_bytes(&mut rx);
            let mut q = Pipe {
                input: resp,
                chunk: usize::MAX,
                ..Pipe::default()
            };
            rx_all(&mut s.core, &mut q);
            let w = drain(&s.cq);
            let got = mr_bytes(&smr);
            if dereg {
                assert_eq!(rx.core.stats.term_sent, 1, "{what}");
                assert!(
                    !w.is_empty() && w.iter().all(|w| !w.is_ok()),
                    "{what}: {w:?}"
                );
                assert!(!got.contains(&0xEE), "{what}: freed memory sent");
            } else {
                assert_eq!(rx.core.stats.term_sent, 0, "{what}");
                assert!(w.len() == 1 && w[0].is_ok(), "{what}: {w:?}");
                assert!(got.iter().all(|&b| b == 0x5A), "{what}");
            }
        }
    }
}

/// A polled word is never seen half-placed: an RDMA Write whose payload
/// TCP delivers in two reads, split at every byte, at every alignment. After
/// the first part, each aligned word the write covers whole holds either
/// all its old bytes or all its new ones (the word being completed is held
/// back and placed by one store); after the second, the region holds
/// exactly the written bytes. The old code placed the first part's bytes at
/// once: a status block split after 3 bytes showed 3 new bytes and 5 old.
#[test]
fn a_word_split_across_reads_is_placed_whole() {
    const LEN: usize = 24;
    let ctx = ctx();
    for at in 64..72u64 {
        for split in 0..=LEN {
            let rx = receiver(&ctx, false);
            let base = rx.write_mr.addr();
            assert_eq!(base % 8, 0, "a region's memory is 8-aligned");
            let old = vec![0xEEu8; 4096];
            rx.write_mr.write_at(0, &old).expect("fill");
            let mut s = side(&ctx, 1, false, 100);
            let src = s.pd.alloc_mr(4096, Access::LOCAL_WRITE).expect("mr");
            let new: Vec<u8> = (1..=LEN as u8).collect();
            src.write_at(0, &new).expect("fill");
            let sg = [src.sge(0, LEN as u32)];
            s.core
                .post_send(&[SendWr::new(
                    1,
                    SendOp::Write {
                        remote_addr: base + at,
                        rkey: rx.write_mr.rkey(),
                    },
                    &sg,
                )])
                .expect("post");
            let bytes = tx_bytes(&mut s);
            // MPA header (2) + tagged DDP/RDMAP header (14), then the
            // payload in one segment.
            let hdr = 16;
            assert_eq!(bytes.len(), hdr + LEN + 4, "one segment, CRC field");
            let mut rx = rx;
            let mut first = Pipe {
                input: bytes[..hdr + split].to_vec(),
                chunk: 1 << 20,
                ..Pipe::default()
            };
            rx_all(&mut rx.side.core, &mut first);
            let mid = mr_bytes(&rx.write_mr);
            let (lo, hi) = (at as usize, at as usize + LEN);
            for w in (lo.next_multiple_of(8)..hi)
                .step_by(8)
                .filter(|w| w + 8 <= hi)
            {
                let word = &mid[w..w + 8];
                assert!(
                    word == &old[w..w + 8] || word == &new[w - lo..w - lo + 8],
                    "at {at}, split {split}: word at {w} half-placed: {word:?}"
                );
            }
            let mut rest = Pipe {
                input: bytes[hdr + split..].to_vec(),
                chunk: 1 << 20,
                ..Pipe::default()
            };
            rx_all(&mut rx.side.core, &mut rest);
            let end = mr_bytes(&rx.write_mr);
            assert_eq!(&end[lo..hi], &new[..], "at {at}, split {split}");
            assert!(end[..lo].iter().chain(&end[hi..]).all(|&b| b == 0xEE));
            assert_eq!(rx.side.core.state, QpState::Rts, "at {at}, split {split}");
        }
    }
}

/// Under manual progress, a thread blocked in `Cq::wait` runs the
/// context's progress itself, and the completions that progress produces
/// for it are handed to it without the eventfd: ten Sends, each sent while
/// the receiver is blocked in its wait, arrive byte for byte with no
/// eventfd write (the old code wrote it, and read it back, for each:
/// ten writes). A completion raised by another thread still goes through
/// the eventfd (the channel tests of `tests/async_channel.rs`).
#[test]
fn a_waiter_running_its_own_progress_takes_its_events_without_the_eventfd() {
    const LEN: usize = 100;
    let (s, c) = (open_soft(Progress::Manual), open_soft(Progress::Auto));
    let l = s
        .listen("127.0.0.1:0".parse().expect("addr"), 4)
        .expect("listen");
    let chan = s.create_comp_channel().expect("channel");
    let spd = s.alloc_pd().expect("pd");
    let scq = s.create_cq(64, Some(&chan)).expect("cq");
    let smr = spd.alloc_mr(10 * LEN, Access::LOCAL_WRITE).expect("mr");
    let cpd = c.alloc_pd().expect("pd");
    let ccq = c.create_cq(64, None).expect("cq");
    let data = pattern(17, 10 * LEN);
    let cmr = cpd.alloc_mr(10 * LEN, Access::LOCAL_WRITE).expect("mr");
    cmr.write_at(0, &data).expect("fill");
    let (sqp, cqp) = accept_and_connect(&l, &QpInit::new(&spd, &scq), &c, &QpInit::new(&cpd, &ccq));
    let soft_chan = (*chan.0)
        .as_any()
        .downcast_ref::<SoftChannel>()
        .expect("soft channel");
    let mut b = [Wc::BLANK; 4];
    for i in 0..10usize {
        sqp.post_recv(&[RecvWr {
            wr_id: i as u64,
            sg_list: &[smr.sge(i * LEN, LEN as u32)],
        }])
        .expect("post recv");
        std::thread::scope(|sc| {
            sc.spawn(|| {
                // Sent once the receiver is asleep in its wait.
                std::thread::sleep(std::time::Duration::from_millis(30));
                let sg = [cmr.sge(i * LEN, LEN as u32)];
                cqp.post_send(&[SendWr::new(i as u64, SendOp::Send, &sg)])
                    .expect("post send");
            });
            let n = scq
                .wait(&chan, &mut b, Some(std::time::Duration::from_secs(10)))
                .expect("wait");
            assert_eq!(n, 1, "send {i}: {:?}", &b[..n]);
            assert_eq!(b[0].status, WcStatus::Success, "{:?}", b[0]);
            assert_eq!((b[0].wr_id, b[0].byte_len), (i as u64, LEN as u32));
        });
        let mut sent = [Wc::BLANK; 4];
        let t = std::time::Instant::now();
        while ccq.poll(&mut sent).expect("poll") == 0 {
            assert!(t.elapsed().as_secs() < 10, "the client's send {i}");
        }
    }
    let mut got = vec![0u8; 10 * LEN];
    smr.read_at(0, &mut got).expect("read");
    assert!(got == data, "the ten Sends, byte for byte");
    assert_eq!(
        soft_chan.0.fd_writes(),
        0,
        "the waiter's own completions went through the eventfd"
    );
}

/// The region fence is the region's reader-writer lock for every access
/// this process makes to its bytes: an application copy out of a region
/// (`read_at`, `load_u64`) waits for a placement into it that is writing,
/// and an application write (`write_at`) waits for a transmission reading
/// from it, while a copy goes on beside a transmission. Before the lock,
/// the copies ran at once, concurrently with the engine's writes (a data
/// race under `Progress::Auto`).
#[test]
fn application_copies_and_engine_accesses_to_a_region_exclude_each_other() {
    use super::mem::{read_fences, PlaceKeep, SoftMr};
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;
    let ctx = ctx();
    let s = side(&ctx, 1, false, 100);
    let mr = s.pd.alloc_mr(4096, Access::LOCAL_WRITE).expect("mr");
    let state = (*mr.ops)
        .as_any()
        .downcast_ref::<SoftMr>()
        .expect("soft mr")
        .state
        .clone();
    fn waits<G>(held: G, act: impl Fn() + Sync, what: &str) {
        let done = AtomicBool::new(false);
        std::thread::scope(|sc| {
            let h = sc.spawn(|| {
                act();
                done.store(true, Ordering::SeqCst);
            });
            std::thread::sleep(Duration::from_millis(150));
            let early = done.load(Ordering::SeqCst);
            drop(held);
            h.join().expect("join");
            assert!(!early, "{what} ran while the engine held the region");
        });
        assert!(done.load(Ordering::SeqCst), "{what}");
    }
    let keep = PlaceKeep::new(state.clone(), None);
    waits(
        keep.enter().expect("live"),
        || {
            let mut b = [0u8; 16];
            mr.read_at(0, &mut b).expect("read");
        },
        "read_at during a placement",
    );
    waits(
        keep.enter().expect("live"),
        || {
            mr.load_u64(8).expect("load");
        },
        "load_u64 during a placement",
    );
    waits(
        read_fences(std::iter::once(&state)),
        || mr.write_at(0, &[7; 16]).expect("write"),
        "write_at during a transmission",
    );
    // A copy beside a transmission: both only read.
    let fences = read_fences(std::iter::once(&state));
    std::thread::scope(|sc| {
        sc.spawn(|| {
            let mut b = [0u8; 16];
            mr.read_at(0, &mut b).expect("read");
            assert_eq!(b, [7; 16]);
        })
        .join()
        .expect("a copy beside a transmission");
    });
    drop(fences);
}

/// A receive whose region was deregistered while it was posted gets
/// nothing written (with `register_raw` memory, the memory may be the
/// program's again): the receive fails, and the stream ends; placed from
/// the socket (no CRC) and from the stage (CRC). Before, the bytes were
/// written into the deregistered memory.
#[test]
fn a_receive_whose_region_was_deregistered_gets_nothing_written() {
    for crc in [false, true] {
        let what = format!("crc={crc}");
        let ctx = ctx();
        let mut rx = side(&ctx, 2, crc, 32 * 1024);
        let len = 4096usize;
        let mut mem = vec![0x5Au8; len];
        let mut s = side(&ctx, 1, crc, 32 * 1024);
        let smr = s.pd.alloc_mr(len, Access::LOCAL_WRITE).expect("mr");
        smr.write_at(0, &[0x11; 4096]).expect("fill");
        let sg = [smr.sge(0, len as u32)];
        s.core
            .post_send(&[SendWr::new(1, SendOp::Send, &sg)])
            .expect("post send");
        let mut p = Pipe {
            input: tx_bytes(&mut s),
            chunk: usize::MAX,
            ..Pipe::default()
        };
        // SAFETY: `mem` outlives the region, which is dropped below before
        // `mem` is touched through a reference; manual progress on this
        // thread only.
        let mr = unsafe {
            rx.pd
                .register_raw(mem.as_mut_ptr(), len, Access::LOCAL_WRITE)
        }
        .expect("register");
        let rsg = [mr.sge(0, len as u32)];
        rx.core
            .post_recv(&[RecvWr {
                wr_id: 7,
                sg_list: &rsg,
            }])
            .expect("post recv");
        drop(mr);
        // The memory is the program's again.
        mem.fill(0xEE);
        rx_all(&mut rx.core, &mut p);
        assert!(
            mem.iter().all(|&b| b == 0xEE),
            "{what}: written after deregistration"
        );
        let w = drain(&rx.cq);
        assert!(
            w.iter().any(|w| w.wr_id == 7 && !w.is_ok()),
            "{what}: {w:?}"
        );
        assert_eq!(rx.core.stats.term_sent, 1, "{what}");
    }
}

/// A transmit batch's read fences: each distinct region once (a region
/// named twice is not locked twice, which could deadlock behind a waiting
/// writer), with and without spilling past the four held inline; all
/// released with the guard.
#[test]
fn read_fences_hold_each_region_once_and_release_it() {
    use super::mem::{read_fences, SoftMr};
    let ctx = ctx();
    let s = side(&ctx, 1, false, 100);
    let mrs: Vec<Mr> = (0..6)
        .map(|_| s.pd.alloc_mr(4096, Access::LOCAL_WRITE).expect("mr"))
        .collect();
    let states: Vec<_> = mrs
        .iter()
        .map(|m| {
            (*m.ops)
                .as_any()
                .downcast_ref::<SoftMr>()
                .expect("soft mr")
                .state
                .clone()
        })
        .collect();
    for n in [1, 3, 4, 5, 6] {
        let named = states[..n].iter().chain(states[..n].iter().rev());
        let g = read_fences(named);
        for (i, st) in states.iter().enumerate() {
            assert_eq!(st.fence.try_write().is_err(), i < n, "n={n} region {i}");
        }
        drop(g);
        assert!(
            states.iter().all(|st| st.fence.try_write().is_ok()),
            "n={n}"
        );
    }
}

/// RDMA Write with Immediate (RFC 7306 Immediate Data after the Write):
/// the data lands byte for byte, each Immediate Data message consumes the
/// next receive in order with the Sends around it and completes it as
/// `RecvRdmaWithImm` with the value and nothing written into the receive's
/// memory; with no receive posted it waits (anonymously) like a Send and
/// goes to the receive posted later. An empty Write with Immediate sends
/// the Immediate Data alone; a solicited one keeps its flag. A Send with
/// Immediate stays refused.
#[test]
fn write_with_immediate_consumes_receives_in_order_and_writes_nothing_into_them() {
    let rig = SrqRig::new();
    let (sqp, cqp, cpd, ccq) = rig.connect(Some(64 * 1024));
    let target = rig
        .spd
        .alloc_mr(256 * 1024, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
        .expect("mr");
    let big = pattern(91, 200 * 1024);
    let cmr = cpd.alloc_mr(256 * 1024, Access::LOCAL_WRITE).expect("mr");
    cmr.write_at(0, &big).expect("fill");
    cmr.write_at(210 * 1024, b"first send").expect("fill");
    cmr.write_at(220 * 1024, b"second send").expect("fill");
    fn wi<'a>(target: &Mr, wr_id: u64, imm: u32, sg: &'a [Sge], solicited: bool) -> SendWr<'a> {
        let mut w = SendWr::new(
            wr_id,
            SendOp::WriteWithImm {
                remote_addr: target.addr(),
                rkey: target.rkey(),
                imm,
            },
            sg,
        );
        w.solicited = solicited;
        w
    }
    let sg_big = [cmr.sge(0, big.len() as u32)];
    let sg_a = [cmr.sge(210 * 1024, 10)];
    let sg_b = [cmr.sge(220 * 1024, 11)];

    // Receives posted first: each message takes the next one.
    let recvs = rig.post_numbered(3);
    cqp.post_send(&[
        SendWr::new(1, SendOp::Send, &sg_a),
        wi(&target, 2, 0xDEAD_BEEF, &sg_big, false),
        SendWr::new(3, SendOp::Send, &sg_b),
    ])
    .expect("post");
    let w = rig.wait(3);
    assert_eq!(
        w.iter().map(|c| c.wr_id).collect::<Vec<_>>(),
        [10, 11, 12],
        "{w:?}"
    );
    assert!(w
        .iter()
        .all(|c| c.status == WcStatus::Success && c.qp_num == sqp.qp_num()));
    assert_eq!(
        (w[0].opcode, w[0].byte_len, w[0].imm),
        (WcOpcode::Recv, 10, None)
    );
    assert_eq!(
        (w[1].opcode, w[1].byte_len, w[1].imm),
        (WcOpcode::RecvRdmaWithImm, 0, Some(0xDEAD_BEEF))
    );
    assert_eq!(
        (w[2].opcode, w[2].byte_len, w[2].imm),
        (WcOpcode::Recv, 11, None)
    );
    let mut got = vec![0u8; 3 * 64];
    recvs.read_at(0, &mut got).expect("read");
    assert_eq!(&got[..10], b"first send");
    assert!(
        got[64..128].iter().all(|&b| b == 0xEE),
        "the immediate's receive was written"
    );
    assert_eq!(&got[128..139], b"second send");
    let mut placed = vec![0u8; big.len()];
    target.read_at(0, &mut placed).expect("read");
    assert!(placed == big, "the Write's data differs");

    // No receive posted: the messages wait, then go to the receives in
    // order. An empty, solicited Write with Immediate.
    target.fill(0, 256 * 1024, 0).expect("fill");
    cqp.post_send(&[
        SendWr::new(4, SendOp::Send, &sg_a),
        wi(&target, 5, 7, &[], true),
        wi(&target, 6, 0x0102_0304, &sg_big[..], false),
    ])
    .expect("post");
    assert!(rig.run(100).is_empty(), "completed with no receive posted");
    let st = super::qp_stats(&sqp).expect("soft QP");
    assert!(st.anon_bytes > 0, "held anonymously: {st:?}");
    let recvs2 = rig.post_numbered(3);
    let w = rig.wait(3);
    assert_eq!(
        w.iter().map(|c| c.wr_id).collect::<Vec<_>>(),
        [10, 11, 12],
        "{w:?}"
    );
    assert_eq!((w[0].opcode, w[0].byte_len), (WcOpcode::Recv, 10));
    assert_eq!(
        (w[1].opcode, w[1].imm),
        (WcOpcode::RecvRdmaWithImm, Some(7))
    );
    assert_eq!(
        (w[2].opcode, w[2].imm),
        (WcOpcode::RecvRdmaWithImm, Some(0x0102_0304))
    );
    recvs2.read_at(0, &mut got).expect("read");
    assert!(
        got[64..].iter().all(|&b| b == 0xEE),
        "an immediate's receive was written"
    );
    target.read_at(0, &mut placed).expect("read");
    assert!(placed == big, "the Write's data differs");
    assert_eq!(super::qp_stats(&sqp).expect("soft").anon_bytes, 0);

    // The sender: six completions, the writes as RdmaWrite.
    let mut b = [Wc::BLANK; 8];
    let mut sent = Vec::new();
    let t = std::time::Instant::now();
    while sent.len() < 6 && t.elapsed().as_secs() < 30 {
        let k = ccq.poll(&mut b).expect("poll");
        sent.extend_from_slice(&b[..k]);
    }
    let ops: Vec<_> = sent.iter().map(|c| (c.wr_id, c.opcode, c.status)).collect();
    assert_eq!(
        ops,
        [
            (1, WcOpcode::Send, WcStatus::Success),
            (2, WcOpcode::RdmaWrite, WcStatus::Success),
            (3, WcOpcode::Send, WcStatus::Success),
            (4, WcOpcode::Send, WcStatus::Success),
            (5, WcOpcode::RdmaWrite, WcStatus::Success),
            (6, WcOpcode::RdmaWrite, WcStatus::Success),
        ]
    );
    let e = cqp
        .post_send(&[SendWr::new(9, SendOp::SendWithImm { imm: 1 }, &sg_a)])
        .expect_err("Send with Immediate");
    assert!(matches!(e.error, Error::NotSupported(_)), "{e:?}");
}
