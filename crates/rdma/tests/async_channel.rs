//! The completion channel's fd drives async code: a tokio task waits on it
//! with `AsyncFd` (no thread blocked in the provider), under both progress
//! models. Under `Progress::Manual` the fd is an epoll fd whose readiness
//! means "call poll", and polling does the protocol work.

use std::os::fd::{AsRawFd, RawFd};
use std::time::Duration;

use lwio_rdma::*;
use tokio::io::unix::AsyncFd;

#[derive(Debug)]
struct Fd(RawFd);
impl AsRawFd for Fd {
    fn as_raw_fd(&self) -> RawFd {
        self.0
    }
}

fn open(progress: Progress) -> Context {
    let cfg = Config {
        progress,
        ..Config::default()
    };
    provider("soft").unwrap().open(None, &cfg).unwrap()
}

async fn next_completion(cq: &Cq, ch: &CompChannel, afd: &AsyncFd<Fd>) -> Wc {
    let mut out = [lwio_rdma::Wc::BLANK; 1];
    loop {
        if cq.poll(&mut out).unwrap() == 1 {
            return out[0];
        }
        cq.arm(false).unwrap();
        if cq.poll(&mut out).unwrap() == 1 {
            return out[0];
        }
        let mut guard = afd.readable().await.unwrap();
        guard.clear_ready();
        // Consume the event (and, under manual progress, do the work).
        ch.wait(Some(Duration::ZERO)).unwrap();
    }
}

fn run(progress: Progress) {
    let (s, c) = (open(progress), open(progress));
    let l = s.listen("127.0.0.1:0".parse().unwrap(), 4).unwrap();
    let addr = l.local_addr();
    let ch = s.create_comp_channel().unwrap();
    let scq = s.create_cq(16, Some(&ch)).unwrap();
    let spd = s.alloc_pd().unwrap();
    let cpd = c.alloc_pd().unwrap();
    let ccq = c.create_cq(16, None).unwrap();
    let (si, ci) = (QpInit::new(&spd, &scq), QpInit::new(&cpd, &ccq));
    let (sqp, cqp) = std::thread::scope(|sc| {
        let h = sc.spawn(|| {
            l.get_request(Some(Duration::from_secs(10)))
                .unwrap()
                .unwrap()
                .accept(&si, &ConnParams::default())
                .unwrap()
        });
        let q = c.connect(addr, &ci, &ConnParams::default()).unwrap();
        (h.join().unwrap(), q)
    });
    let smr = spd.alloc_mr(4096, Access::LOCAL_WRITE).unwrap();
    let cmr = cpd.alloc_mr(4096, Access::LOCAL_WRITE).unwrap();
    cmr.write_at(0, b"async hello").unwrap();
    for i in 0..3 {
        sqp.post_recv(&[RecvWr {
            wr_id: i,
            sg_list: &[smr.sge(0, 4096)],
        }])
        .unwrap();
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        // SAFETY: the fd belongs to `ch`, which outlives `afd` (dropped at
        // the end of this block) and never changes or closes its fd.
        let afd = unsafe { AsyncFd::register(Fd(ch.fd())) }.unwrap();
        for i in 0..3u64 {
            // The peer sends from another thread a little later, while this
            // task is parked on the fd.
            let (cqp, sge) = (cqp.clone(), cmr.sge(0, 11));
            let sender = std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(20));
                cqp.post_send(&[SendWr::new(i, SendOp::Send, &[sge])])
                    .unwrap();
            });
            let w = tokio::time::timeout(Duration::from_secs(10), next_completion(&scq, &ch, &afd))
                .await
                .expect("no completion through the channel fd");
            sender.join().unwrap();
            assert!(w.is_ok() && w.wr_id == i && w.byte_len == 11, "{w:?}");
            let mut b = [0u8; 11];
            smr.read_at(0, &mut b).unwrap();
            assert_eq!(&b, b"async hello");
        }
    });
}

#[test]
fn channel_fd_drives_async_code_auto() {
    run(Progress::Auto);
}

#[test]
fn channel_fd_drives_async_code_manual() {
    run(Progress::Manual);
}
