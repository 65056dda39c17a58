//! The soft provider's receive engine alone: a stream of RDMA Write
//! segments, built once by a sender engine, fed to a receiver engine from
//! memory (no sockets, no threads), best of 7 passes. Prints ns per segment
//! for a few payload sizes: the cost of deframing, validating and placing.
//!
//!     cargo run --release -p lwio-rdma --features fuzzing --example soft_rx_bench
//!
//! Compare two commits by running it in each (a worktree per commit).
use lwio_rdma::soft::fuzzing::{ctx, drain, rx_all, side, tx_bytes, Pipe};
use lwio_rdma::{Access, SendOp, SendWr};

fn main() {
    println!(
        "command: cargo run --release -p lwio-rdma --features fuzzing --example soft_rx_bench"
    );
    for size in [256usize, 4096, 65000] {
        let ctx = ctx();
        let mut tx = side(&ctx, 1, false, 65000, 64 * 1024);
        let mut rx = side(&ctx, 2, false, 65000, 64 * 1024);
        let n = 4000;
        let smr = tx.pd.alloc_mr(size * 64, Access::LOCAL_WRITE).expect("mr");
        let dmr = rx
            .pd
            .alloc_mr(size * 64, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
            .expect("mr");
        let mut stream = Vec::new();
        for i in 0..n {
            let off = (i % 64) * size;
            let op = SendOp::Write {
                remote_addr: dmr.addr() + off as u64,
                rkey: dmr.rkey(),
            };
            tx.core
                .post_send(&[SendWr::new(i as u64, op, &[smr.sge(off, size as u32)])])
                .expect("post");
            if i % 256 == 255 {
                stream.extend(tx_bytes(&mut tx));
                drain(&tx.cq);
            }
        }
        stream.extend(tx_bytes(&mut tx));
        // Tagged writes carry no sequence numbers: the same stream can be
        // fed to the same receiver again.
        let mut best = f64::MAX;
        for _ in 0..7 {
            let mut p = Pipe {
                input: stream.clone(),
                chunk: 65536,
                ..Pipe::default()
            };
            let t = std::time::Instant::now();
            rx_all(&mut rx.core, &mut p);
            best = best.min(t.elapsed().as_secs_f64());
            assert_eq!(p.pos, p.input.len(), "receiver left bytes unread");
        }
        println!(
            "write {size:>6} B: {:>6.0} ns/segment, {:.2} GB/s (best of 7, {n} segments, 64 KiB reads)",
            best * 1e9 / n as f64,
            (n * size) as f64 / best / 1e9
        );
    }
}
