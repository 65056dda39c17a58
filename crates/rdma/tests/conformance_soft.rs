//! The conformance suite, soft↔soft, under both progress models and with
//! MPA CRC on and off. Every case is its own test so a failure names it.

use std::net::SocketAddr;
use std::sync::OnceLock;

use lwio_rdma::conformance::{self, Outcome};
use lwio_rdma::*;

fn open(progress: Progress, crc: bool) -> Context {
    let cfg = Config {
        progress,
        mpa_crc: if crc {
            CrcPolicy::Required
        } else {
            CrcPolicy::Off
        },
        indicate_window: 64 * 1024,
        ..Config::default()
    };
    provider("soft").unwrap().open(Some("soft0"), &cfg).unwrap()
}

fn pair(progress: Progress, crc: bool) -> &'static (Context, Context) {
    static P: [OnceLock<(Context, Context)>; 4] = [const { OnceLock::new() }; 4];
    let i = (progress == Progress::Manual) as usize * 2 + crc as usize;
    P[i].get_or_init(|| (open(progress, crc), open(progress, crc)))
}

fn run(progress: Progress, crc: bool, name: &str) {
    let (s, c) = pair(progress, crc);
    let addr: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let r = conformance::run_case(s, c, addr, name).unwrap();
    eprintln!("{r} ({:?}, {progress:?}, crc={crc})", r.elapsed);
    match r.outcome {
        Outcome::Pass | Outcome::Skip(_) => {}
        Outcome::Fail(w) => panic!("{name} ({progress:?}, crc={crc}): {w}"),
    }
}

macro_rules! cases {
    ($($name:ident),* $(,)?) => {
        mod auto_nocrc { $( #[test] fn $name() { super::run(super::Progress::Auto, false, stringify!($name)); } )* }
        mod auto_crc { $( #[test] fn $name() { super::run(super::Progress::Auto, true, stringify!($name)); } )* }
        mod manual_nocrc { $( #[test] fn $name() { super::run(super::Progress::Manual, false, stringify!($name)); } )* }
        mod manual_crc { $( #[test] fn $name() { super::run(super::Progress::Manual, true, stringify!($name)); } )* }
        #[test]
        fn every_case_is_listed() {
            let mut listed = vec![$(stringify!($name)),*];
            let mut all = conformance::case_names();
            listed.sort();
            all.sort();
            assert_eq!(listed, all);
        }
    };
}

cases!(
    send_recv_sizes,
    send_with_invalidate_sizes,
    rdma_write_sizes,
    rdma_read_sizes,
    write_with_imm,
    recv_scatter_multi_sge,
    ordering_many_posts,
    ordering_send_after_writes,
    post_lists,
    unsignaled_writes,
    flush_on_set_error,
    flush_on_peer_disconnect,
    cm_reject_private_data,
    cm_accept_private_data,
    cm_ird_ord_negotiated,
    cq_channel_blocking_wait,
    prot_write_wrong_key,
    prot_read_wrong_key,
    prot_write_other_pd_key,
    prot_write_oob_low,
    prot_write_oob_high,
    prot_read_oob_low,
    prot_read_oob_high,
    prot_write_read_only_region,
    prot_read_write_only_region,
    prot_unbound_window,
    prot_one_shot_window_reused,
    prot_deregistered_region,
    prot_invalidated_window_old_key,
    mw_bind_byte_granularity,
    mw_one_shot,
    mw_send_with_invalidate,
    recv_flow_control_indicate_window,
);
