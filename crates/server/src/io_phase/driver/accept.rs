//! Admission of one connection request: the registered-memory budget,
//! the receives (the reactor's shared pool, or a region of its own), the
//! send slots and the queue pair ([`Conn::accept`]).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Instant;

use lwio_proto::server::ServerConn;
use lwio_proto::wire::COMMON_HEADER_LEN;
use lwio_proto::wrid;
use lwio_rdma::{Access, ConnParams, QpCap, QpInit, RecvWr};
use tracing::info;

use crate::io_phase::reactor::Domain;
use crate::io_phase::Waker;
use crate::state::ServerState;

use super::conn::{Conn, RecvSrc, MIN_READ_REGION, SEND_CHUNK, SEND_SLOT};
use super::listener::Listening;
use super::shared::{ConnEntry, ConnState, Shared};
use super::storage::StoragePool;

impl Conn {
    pub(super) fn accept(
        id: u64,
        listening: &Listening,
        req: lwio_rdma::ConnRequest,
        shared: Arc<Shared>,
        state: Arc<ServerState>,
        pool: StoragePool,
        domain: Option<&Domain>,
    ) -> Result<(Conn, ConnEntry), lwio_rdma::Error> {
        let peer = req.peer_addr();
        let mut cfg = listening.proto.clone();
        cfg.session_id = crate::fs::table::random_u64() | 1;
        let nrecv = usize::from(shared.opts.max_credits_per_conn.max(cfg.max_credits)) + 2;
        let sq_depth = 1024usize;
        let recv_slot =
            (COMMON_HEADER_LEN + cfg.max_recv_buffer_size as usize).next_multiple_of(64);
        let nomem = |what: &str| {
            lwio_rdma::Error::ResourceExhausted(format!("{what}: registered-memory budget"))
        };
        let out_of_memory = |req: lwio_rdma::ConnRequest| {
            let why = format!(
                "out of receive memory: {} MiB registered (limit {} MiB)",
                shared.mem_used.load(Ordering::Relaxed).div_ceil(1 << 20),
                shared.opts.max_memory >> 20
            );
            let _ = req.reject(why.as_bytes());
        };
        // Pool mode (the reactor's domain on this device): the receives
        // come from the reactor's shared receive queue; this connection
        // promises the pool the credits it grants, from one (AUTH) up to
        // the initial grant, as far as the budget allows.
        // Admitted only with room for its buffers and one read buffer (a
        // connection that could never read is refused at the door).
        let idle = domain.map_or(recv_slot, |d| d.pool.idle_bytes());
        let need = idle + SEND_SLOT * SEND_CHUNK + MIN_READ_REGION;
        if domain.is_some()
            && shared.mem_used.load(Ordering::Relaxed) + need > shared.opts.max_memory
        {
            out_of_memory(req);
            return Err(nomem("receive buffers"));
        }
        let backed = match domain {
            Some(d) => {
                // The initial grant shrinks as the budget fills (one,
                // plus a sixteenth of the receive buffers the budget has
                // beyond every possible connection's one): a storm of new
                // connections is admitted with fewer credits each rather
                // than refused, and the balancer grants more to the ones
                // that turn busy.
                let extra = shared.extra_buffers(recv_slot) / 16;
                let want = usize::from(cfg.max_credits).min(1 + extra);
                let got = d.pool.reserve(want, 1, true);
                if got == 0 {
                    out_of_memory(req);
                    return Err(nomem("receive buffers"));
                }
                cfg.max_credits = u16::try_from(got).unwrap_or(u16::MAX);
                got
            }
            None => 0,
        };
        // Without a domain, with a provider that has a progress thread
        // (soft): this connection's own context, driven by its reactor
        // alone (the QP joins it at accept).
        let own_ctx = if domain.is_none() && shared.opts.conn_contexts {
            listening.ctx.open_manual_sibling()?
        } else {
            None
        };
        let (ctx, pd, chan) = match domain {
            Some(d) => (&d.ctx, d.pd.clone(), d.chan.clone()),
            None => {
                let ctx = own_ctx.as_ref().unwrap_or(&listening.ctx);
                (ctx, ctx.alloc_pd()?, ctx.create_comp_channel()?)
            }
        };
        let depth = (nrecv + sq_depth + 16) as u32;
        let cq = match domain {
            Some(_) => ctx.create_cq_tagged(depth, &chan, id),
            None => ctx.create_cq(depth, Some(&chan)),
        };
        let release = |backed: usize| {
            if let Some(d) = domain {
                d.pool.release(backed, true);
            }
        };
        let cq = match cq {
            Ok(c) => c,
            Err(e) => {
                release(backed);
                return Err(e);
            }
        };
        let recv = match domain {
            Some(d) => RecvSrc::Pool(d.pool.clone()),
            None => match shared.register(&pd, recv_slot * nrecv, Access::LOCAL_WRITE) {
                Ok(m) => RecvSrc::Own(Arc::new(m)),
                Err(_) => {
                    out_of_memory(req);
                    return Err(nomem("receive buffers"));
                }
            },
        };
        let send_mr = match shared.register(&pd, SEND_SLOT * SEND_CHUNK, Access::empty()) {
            Ok(m) => m,
            Err(_) => {
                recv.free(&shared);
                release(backed);
                out_of_memory(req);
                return Err(nomem("send buffers"));
            }
        };
        let init = QpInit {
            pd: pd.clone(),
            send_cq: cq.clone(),
            recv_cq: cq.clone(),
            cap: QpCap {
                max_send_wr: sq_depth as u32,
                max_recv_wr: if domain.is_some() { 0 } else { nrecv as u32 },
                max_send_sge: 2,
                max_recv_sge: 1,
                max_inline_data: 0,
            },
            sq_sig_all: true,
            recv_window: shared.opts.recv_window,
            srq: domain.map(|d| d.pool.srq().clone()),
        };
        // The receives are posted before the acceptance reaches the
        // client (on its QP, or in the pool by `reserve`): its AUTH may
        // follow the handshake at once, and on iWARP devices (siw, iWARP
        // NICs) a Send that finds no posted receive is fatal (no RNR
        // retry).
        let sges: Vec<[lwio_rdma::Sge; 1]> = match &recv {
            RecvSrc::Own(mr) => (0..nrecv)
                .map(|i| [mr.sge(i * recv_slot, recv_slot as u32)])
                .collect(),
            _ => Vec::new(),
        };
        let recvs: Vec<RecvWr<'_>> = sges
            .iter()
            .enumerate()
            .map(|(i, sge)| RecvWr {
                wr_id: wrid::RECV | i as u64,
                sg_list: sge,
            })
            .collect();
        let qp = match req.accept_with_recvs(&init, &ConnParams::default(), &recvs) {
            Ok(q) => q,
            Err(e) => {
                recv.free(&shared);
                release(backed);
                shared.unregister(send_mr);
                return Err(e);
            }
        };
        let (done_tx, done_rx) = mpsc::channel();
        let (ctl_tx, ctl_rx) = mpsc::channel();
        let waker = Arc::new(Waker::new()?);
        let credits_pub = Arc::new(AtomicUsize::new(1));
        let state_pub = Arc::new(std::sync::atomic::AtomicU8::new(
            ConnState::Authenticating as u8,
        ));
        let now = Instant::now();
        let base_credits = cfg.max_credits;
        info!(conn = id, %peer, qpn = qp.qp_num(), listener = %listening.describe(), "RDMA connection accepted");
        let entry = ConnEntry {
            ctl: ctl_tx,
            waker: waker.clone(),
            credits: credits_pub.clone(),
            state: state_pub.clone(),
            pd: domain.is_none().then(|| pd.clone()),
        };
        let sconn = ServerConn::with_op_data(cfg, now);
        let reads = domain.map(|d| {
            for r in &d.reads {
                r.attach();
            }
            d.reads.clone()
        });
        Ok((
            Conn {
                id,
                peer,
                qp,
                cq,
                chan,
                pd,
                recv,
                backed,
                held: Default::default(),
                recv_slot,
                send_mrs: vec![send_mr],
                send_free: (0..SEND_CHUNK as u32).rev().collect(),
                sq_depth,
                sq_inflight: 0,
                deferred: VecDeque::new(),
                spare_bufs: Vec::new(),
                reads,
                mem: Default::default(),
                files: HashMap::new(),
                next_file: 1,
                session: None,
                sconn,
                shared,
                state,
                pool,
                done_tx,
                done_rx,
                ctl_rx,
                waker,
                credits_pub,
                state_pub,
                credits_reported: 0,
                base_credits,
                client_cap: None,
                last_io: now,
                closing: None,
                draining: None,
                dead: false,
                inline_mode: HashMap::new(),
                slot: 0,
                rio: None,
                reactor_conns: None,
                last_tick: now,
                last_busy: now,
                last_polled: now,
                last_polled_count: 0,
                requests_balanced: 0,
                sq_pending: Vec::new(),
                _ctx: own_ctx,
            },
            entry,
        ))
    }
}
