//! Hand-written FFI for the parts of libibverbs and librdmacm the verbs
//! provider uses, matching the x86_64 ABI of rdma-core ≥ 44 (Debian 12's
//! `libibverbs1`/`librdmacm1` 44.0). No headers or bindgen at build time; the
//! libraries are opened with `dlopen` at run time ([`Lib::get`]).
//!
//! Every struct the provider reads or writes field by field is declared in
//! full and pinned by compile-time size/offset assertions taken from
//! `<infiniband/verbs.h>` and `<rdma/rdma_cma.h>` (rdma-core 44). Structs that
//! are only ever passed by pointer are opaque.
//!
//! `ibv_post_send`, `ibv_post_recv`, `ibv_poll_cq`, `ibv_req_notify_cq`,
//! `ibv_alloc_mw` and `ibv_dealloc_mw` are `static inline` in the header: they
//! call through `context->ops` ([`ibv_context_ops`]), whose layout is part of
//! the stable ABI (the `_compat_*` slots are kept for exactly that reason).

#![allow(non_camel_case_types, dead_code)]

use std::ffi::{c_char, c_int, c_uint, c_void};
use std::mem::{offset_of, size_of};
use std::sync::OnceLock;

// ---------------------------------------------------------------------------
// Constants (enum values from verbs.h / rdma_cma.h).

pub const IBV_WC_SUCCESS: u32 = 0;
pub const IBV_WC_LOC_LEN_ERR: u32 = 1;
pub const IBV_WC_LOC_QP_OP_ERR: u32 = 2;
pub const IBV_WC_LOC_EEC_OP_ERR: u32 = 3;
pub const IBV_WC_LOC_PROT_ERR: u32 = 4;
pub const IBV_WC_WR_FLUSH_ERR: u32 = 5;
pub const IBV_WC_MW_BIND_ERR: u32 = 6;
pub const IBV_WC_BAD_RESP_ERR: u32 = 7;
pub const IBV_WC_LOC_ACCESS_ERR: u32 = 8;
pub const IBV_WC_REM_INV_REQ_ERR: u32 = 9;
pub const IBV_WC_REM_ACCESS_ERR: u32 = 10;
pub const IBV_WC_REM_OP_ERR: u32 = 11;
pub const IBV_WC_RETRY_EXC_ERR: u32 = 12;
pub const IBV_WC_RNR_RETRY_EXC_ERR: u32 = 13;
pub const IBV_WC_LOC_RDD_VIOL_ERR: u32 = 14;
pub const IBV_WC_REM_INV_RD_REQ_ERR: u32 = 15;
pub const IBV_WC_REM_ABORT_ERR: u32 = 16;
pub const IBV_WC_INV_EECN_ERR: u32 = 17;
pub const IBV_WC_INV_EEC_STATE_ERR: u32 = 18;
pub const IBV_WC_FATAL_ERR: u32 = 19;
pub const IBV_WC_RESP_TIMEOUT_ERR: u32 = 20;
pub const IBV_WC_GENERAL_ERR: u32 = 21;

pub const IBV_WC_SEND: u32 = 0;
pub const IBV_WC_RDMA_WRITE: u32 = 1;
pub const IBV_WC_RDMA_READ: u32 = 2;
pub const IBV_WC_BIND_MW: u32 = 5;
pub const IBV_WC_LOCAL_INV: u32 = 6;
pub const IBV_WC_RECV: u32 = 1 << 7;
pub const IBV_WC_RECV_RDMA_WITH_IMM: u32 = (1 << 7) + 1;

pub const IBV_WC_WITH_IMM: u32 = 1 << 1;
pub const IBV_WC_WITH_INV: u32 = 1 << 3;

pub const IBV_WR_RDMA_WRITE: u32 = 0;
pub const IBV_WR_RDMA_WRITE_WITH_IMM: u32 = 1;
pub const IBV_WR_SEND: u32 = 2;
pub const IBV_WR_SEND_WITH_IMM: u32 = 3;
pub const IBV_WR_RDMA_READ: u32 = 4;
pub const IBV_WR_LOCAL_INV: u32 = 7;
pub const IBV_WR_BIND_MW: u32 = 8;
pub const IBV_WR_SEND_WITH_INV: u32 = 9;

pub const IBV_SEND_FENCE: u32 = 1 << 0;
pub const IBV_SEND_SIGNALED: u32 = 1 << 1;
pub const IBV_SEND_SOLICITED: u32 = 1 << 2;
pub const IBV_SEND_INLINE: u32 = 1 << 3;

pub const IBV_ACCESS_LOCAL_WRITE: c_int = 1;
pub const IBV_ACCESS_REMOTE_WRITE: c_int = 1 << 1;
pub const IBV_ACCESS_REMOTE_READ: c_int = 1 << 2;
pub const IBV_ACCESS_MW_BIND: c_int = 1 << 4;

pub const IBV_DEVICE_MEM_WINDOW: u32 = 1 << 17;
pub const IBV_DEVICE_MEM_MGT_EXTENSIONS: u32 = 1 << 21;
pub const IBV_DEVICE_MEM_WINDOW_TYPE_2A: u32 = 1 << 23;
pub const IBV_DEVICE_MEM_WINDOW_TYPE_2B: u32 = 1 << 24;

pub const IBV_QPS_RESET: u32 = 0;
pub const IBV_QPS_INIT: u32 = 1;
pub const IBV_QPS_RTR: u32 = 2;
pub const IBV_QPS_RTS: u32 = 3;
pub const IBV_QPS_SQD: u32 = 4;
pub const IBV_QPS_SQE: u32 = 5;
pub const IBV_QPS_ERR: u32 = 6;
pub const IBV_QP_STATE: c_int = 1;

pub const IBV_QPT_RC: u32 = 2;

pub const IBV_NODE_CA: c_int = 1;
pub const IBV_NODE_RNIC: c_int = 4;
pub const IBV_TRANSPORT_IB: c_int = 0;
pub const IBV_TRANSPORT_IWARP: c_int = 1;

pub const IBV_LINK_LAYER_UNSPECIFIED: u8 = 0;
pub const IBV_LINK_LAYER_INFINIBAND: u8 = 1;
pub const IBV_LINK_LAYER_ETHERNET: u8 = 2;

pub const IBV_PORT_ACTIVE: u32 = 4;

pub const IBV_MW_TYPE_2: u32 = 2;

pub const RDMA_PS_TCP: u32 = 0x0106;
pub const RDMA_MAX_RESP_RES: u8 = 0xff;
pub const RDMA_MAX_INIT_DEPTH: u8 = 0xff;

pub const RDMA_CM_EVENT_ADDR_RESOLVED: u32 = 0;
pub const RDMA_CM_EVENT_ADDR_ERROR: u32 = 1;
pub const RDMA_CM_EVENT_ROUTE_RESOLVED: u32 = 2;
pub const RDMA_CM_EVENT_ROUTE_ERROR: u32 = 3;
pub const RDMA_CM_EVENT_CONNECT_REQUEST: u32 = 4;
pub const RDMA_CM_EVENT_CONNECT_RESPONSE: u32 = 5;
pub const RDMA_CM_EVENT_CONNECT_ERROR: u32 = 6;
pub const RDMA_CM_EVENT_UNREACHABLE: u32 = 7;
pub const RDMA_CM_EVENT_REJECTED: u32 = 8;
pub const RDMA_CM_EVENT_ESTABLISHED: u32 = 9;
pub const RDMA_CM_EVENT_DISCONNECTED: u32 = 10;
pub const RDMA_CM_EVENT_DEVICE_REMOVAL: u32 = 11;
pub const RDMA_CM_EVENT_TIMEWAIT_EXIT: u32 = 15;

/// IB CM reject reason "consumer defined" (the peer called `rdma_reject`).
pub const IB_CM_REJ_CONSUMER_DEFINED: c_int = 28;

// ---------------------------------------------------------------------------
// libibverbs structs.

/// `pthread_mutex_t` on x86_64 glibc: 40 bytes, 8-aligned.
#[repr(C)]
pub struct PthreadMutex(pub [u64; 5]);
/// `pthread_cond_t` on x86_64 glibc: 48 bytes, 8-aligned.
#[repr(C)]
pub struct PthreadCond(pub [u64; 6]);

#[repr(C)]
pub struct ibv_device {
    /// `struct _ibv_device_ops` (two obsolete function pointers).
    pub _ops: [*mut c_void; 2],
    pub node_type: c_int,
    pub transport_type: c_int,
    pub name: [c_char; 64],
    pub dev_name: [c_char; 64],
    pub dev_path: [c_char; 256],
    pub ibdev_path: [c_char; 256],
}

pub type PollCqFn = unsafe extern "C" fn(*mut ibv_cq, c_int, *mut ibv_wc) -> c_int;
pub type ReqNotifyCqFn = unsafe extern "C" fn(*mut ibv_cq, c_int) -> c_int;
pub type PostSendFn =
    unsafe extern "C" fn(*mut ibv_qp, *mut ibv_send_wr, *mut *mut ibv_send_wr) -> c_int;
pub type PostRecvFn =
    unsafe extern "C" fn(*mut ibv_qp, *mut ibv_recv_wr, *mut *mut ibv_recv_wr) -> c_int;
pub type PostSrqRecvFn =
    unsafe extern "C" fn(*mut ibv_srq, *mut ibv_recv_wr, *mut *mut ibv_recv_wr) -> c_int;
pub type AllocMwFn = unsafe extern "C" fn(*mut ibv_pd, u32) -> *mut ibv_mw;
pub type DeallocMwFn = unsafe extern "C" fn(*mut ibv_mw) -> c_int;

/// `struct ibv_context_ops`: 32 function-pointer slots; the ones lwio calls
/// are typed, the rest are placeholders that only keep the layout.
#[repr(C)]
pub struct ibv_context_ops {
    pub _compat_query_device: *mut c_void,
    pub _compat_query_port: *mut c_void,
    pub _compat_alloc_pd: *mut c_void,
    pub _compat_dealloc_pd: *mut c_void,
    pub _compat_reg_mr: *mut c_void,
    pub _compat_rereg_mr: *mut c_void,
    pub _compat_dereg_mr: *mut c_void,
    pub alloc_mw: Option<AllocMwFn>,
    pub bind_mw: *mut c_void,
    pub dealloc_mw: Option<DeallocMwFn>,
    pub _compat_create_cq: *mut c_void,
    pub poll_cq: Option<PollCqFn>,
    pub req_notify_cq: Option<ReqNotifyCqFn>,
    pub _compat_cq_event: *mut c_void,
    pub _compat_resize_cq: *mut c_void,
    pub _compat_destroy_cq: *mut c_void,
    pub _compat_create_srq: *mut c_void,
    pub _compat_modify_srq: *mut c_void,
    pub _compat_query_srq: *mut c_void,
    pub _compat_destroy_srq: *mut c_void,
    pub post_srq_recv: Option<PostSrqRecvFn>,
    pub _compat_create_qp: *mut c_void,
    pub _compat_query_qp: *mut c_void,
    pub _compat_modify_qp: *mut c_void,
    pub _compat_destroy_qp: *mut c_void,
    pub post_send: Option<PostSendFn>,
    pub post_recv: Option<PostRecvFn>,
    pub _compat_create_ah: *mut c_void,
    pub _compat_destroy_ah: *mut c_void,
    pub _compat_attach_mcast: *mut c_void,
    pub _compat_detach_mcast: *mut c_void,
    pub _compat_async_event: *mut c_void,
}

#[repr(C)]
pub struct ibv_context {
    pub device: *mut ibv_device,
    pub ops: ibv_context_ops,
    pub cmd_fd: c_int,
    pub async_fd: c_int,
    pub num_comp_vectors: c_int,
    pub mutex: PthreadMutex,
    pub abi_compat: *mut c_void,
}

/// `struct ibv_async_event`: the element (a union of the CQ, QP, SRQ or WQ
/// pointer and the port number, pointer-sized) and `enum ibv_event_type`.
#[repr(C)]
pub struct ibv_async_event {
    pub element: *mut c_void,
    pub event_type: c_int,
}

/// `IBV_EVENT_QP_FATAL`: an error that put the QP in the error state.
pub const IBV_EVENT_QP_FATAL: c_int = 1;
/// `IBV_EVENT_QP_REQ_ERR`: the responder found an invalid request (a
/// protocol error of the peer).
pub const IBV_EVENT_QP_REQ_ERR: c_int = 2;
/// `IBV_EVENT_QP_ACCESS_ERR`: the responder found a local access violation
/// (the peer used a key, range or right this side did not grant).
pub const IBV_EVENT_QP_ACCESS_ERR: c_int = 3;

#[repr(C)]
pub struct ibv_device_attr {
    pub fw_ver: [c_char; 64],
    pub node_guid: u64,
    pub sys_image_guid: u64,
    pub max_mr_size: u64,
    pub page_size_cap: u64,
    pub vendor_id: u32,
    pub vendor_part_id: u32,
    pub hw_ver: u32,
    pub max_qp: c_int,
    pub max_qp_wr: c_int,
    pub device_cap_flags: c_uint,
    pub max_sge: c_int,
    pub max_sge_rd: c_int,
    pub max_cq: c_int,
    pub max_cqe: c_int,
    pub max_mr: c_int,
    pub max_pd: c_int,
    pub max_qp_rd_atom: c_int,
    pub max_ee_rd_atom: c_int,
    pub max_res_rd_atom: c_int,
    pub max_qp_init_rd_atom: c_int,
    pub max_ee_init_rd_atom: c_int,
    pub atomic_cap: c_int,
    pub max_ee: c_int,
    pub max_rdd: c_int,
    pub max_mw: c_int,
    pub max_raw_ipv6_qp: c_int,
    pub max_raw_ethy_qp: c_int,
    pub max_mcast_grp: c_int,
    pub max_mcast_qp_attach: c_int,
    pub max_total_mcast_qp_attach: c_int,
    pub max_ah: c_int,
    pub max_fmr: c_int,
    pub max_map_per_fmr: c_int,
    pub max_srq: c_int,
    pub max_srq_wr: c_int,
    pub max_srq_sge: c_int,
    pub max_pkeys: u16,
    pub local_ca_ack_delay: u8,
    pub phys_port_cnt: u8,
}

/// `struct ibv_port_attr`. The exported `ibv_query_port` symbol fills the
/// `_compat_ibv_port_attr` prefix (everything up to `flags`); the caller zeroes
/// the whole struct first, as the header's inline wrapper does.
#[repr(C)]
pub struct ibv_port_attr {
    pub state: u32,
    pub max_mtu: u32,
    pub active_mtu: u32,
    pub gid_tbl_len: c_int,
    pub port_cap_flags: u32,
    pub max_msg_sz: u32,
    pub bad_pkey_cntr: u32,
    pub qkey_viol_cntr: u32,
    pub pkey_tbl_len: u16,
    pub lid: u16,
    pub sm_lid: u16,
    pub lmc: u8,
    pub max_vl_num: u8,
    pub sm_sl: u8,
    pub subnet_timeout: u8,
    pub init_type_reply: u8,
    pub active_width: u8,
    pub active_speed: u8,
    pub phys_state: u8,
    pub link_layer: u8,
    pub flags: u8,
    pub port_cap_flags2: u16,
}

#[repr(C)]
pub struct ibv_pd {
    pub context: *mut ibv_context,
    pub handle: u32,
}

#[repr(C)]
pub struct ibv_mr {
    pub context: *mut ibv_context,
    pub pd: *mut ibv_pd,
    pub addr: *mut c_void,
    pub length: usize,
    pub handle: u32,
    pub lkey: u32,
    pub rkey: u32,
}

#[repr(C)]
pub struct ibv_mw {
    pub context: *mut ibv_context,
    pub pd: *mut ibv_pd,
    pub rkey: u32,
    pub handle: u32,
    pub type_: u32,
}

#[repr(C)]
pub struct ibv_comp_channel {
    pub context: *mut ibv_context,
    pub fd: c_int,
    pub refcnt: c_int,
}

#[repr(C)]
pub struct ibv_cq {
    pub context: *mut ibv_context,
    pub channel: *mut ibv_comp_channel,
    pub cq_context: *mut c_void,
    pub handle: u32,
    pub cqe: c_int,
    pub mutex: PthreadMutex,
    pub cond: PthreadCond,
    pub comp_events_completed: u32,
    pub async_events_completed: u32,
}

#[repr(C)]
pub struct ibv_qp {
    pub context: *mut ibv_context,
    pub qp_context: *mut c_void,
    pub pd: *mut ibv_pd,
    pub send_cq: *mut ibv_cq,
    pub recv_cq: *mut ibv_cq,
    pub srq: *mut c_void,
    pub handle: u32,
    pub qp_num: u32,
    pub state: u32,
    pub qp_type: u32,
    pub mutex: PthreadMutex,
    pub cond: PthreadCond,
    pub events_completed: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_qp_cap {
    pub max_send_wr: u32,
    pub max_recv_wr: u32,
    pub max_send_sge: u32,
    pub max_recv_sge: u32,
    pub max_inline_data: u32,
}

/// `struct ibv_srq`: only ever handled by pointer.
#[repr(C)]
pub struct ibv_srq {
    _opaque: [u8; 0],
}

#[repr(C)]
pub struct ibv_srq_attr {
    pub max_wr: u32,
    pub max_sge: u32,
    pub srq_limit: u32,
}

#[repr(C)]
pub struct ibv_srq_init_attr {
    pub srq_context: *mut c_void,
    pub attr: ibv_srq_attr,
}

#[repr(C)]
pub struct ibv_qp_init_attr {
    pub qp_context: *mut c_void,
    pub send_cq: *mut ibv_cq,
    pub recv_cq: *mut ibv_cq,
    pub srq: *mut c_void,
    pub cap: ibv_qp_cap,
    pub qp_type: u32,
    pub sq_sig_all: c_int,
}

/// `struct ibv_qp_attr`: lwio only sets/reads `qp_state` (with
/// `IBV_QP_STATE`); the rest is kept zeroed at its exact size.
#[repr(C)]
pub struct ibv_qp_attr {
    pub qp_state: u32,
    pub cur_qp_state: u32,
    pub _rest: [u64; 17],
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_wc {
    pub wr_id: u64,
    pub status: u32,
    pub opcode: u32,
    pub vendor_err: u32,
    pub byte_len: u32,
    /// `imm_data` (network byte order) with `IBV_WC_WITH_IMM`, or
    /// `invalidated_rkey` with `IBV_WC_WITH_INV`.
    pub imm_data: u32,
    pub qp_num: u32,
    pub src_qp: u32,
    pub wc_flags: c_uint,
    pub pkey_index: u16,
    pub slid: u16,
    pub sl: u8,
    pub dlid_path_bits: u8,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_sge {
    pub addr: u64,
    pub length: u32,
    pub lkey: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_mw_bind_info {
    pub mr: *mut ibv_mr,
    pub addr: u64,
    pub length: u64,
    pub mw_access_flags: c_uint,
}

/// The `bind_mw` member of the last union of `struct ibv_send_wr`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_send_wr_bind_mw {
    pub mw: *mut ibv_mw,
    pub rkey: u32,
    pub bind_info: ibv_mw_bind_info,
}

/// `struct ibv_send_wr`. The `wr` union is declared as its `rdma` member
/// (`remote_addr`, `rkey`) padded to the union's 32 bytes; the `qp_type`
/// union as `xrc.remote_srqn`; the last union as `bind_mw` (its largest
/// member, 48 bytes).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_send_wr {
    pub wr_id: u64,
    pub next: *mut ibv_send_wr,
    pub sg_list: *mut ibv_sge,
    pub num_sge: c_int,
    pub opcode: u32,
    pub send_flags: c_uint,
    /// `imm_data` (network byte order) or `invalidate_rkey`.
    pub imm_data: u32,
    pub remote_addr: u64,
    pub rkey: u32,
    pub _wr_pad: [u32; 5],
    pub remote_srqn: u32,
    pub _qp_type_pad: u32,
    pub bind_mw: ibv_send_wr_bind_mw,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_recv_wr {
    pub wr_id: u64,
    pub next: *mut ibv_recv_wr,
    pub sg_list: *mut ibv_sge,
    pub num_sge: c_int,
}

// ---------------------------------------------------------------------------
// librdmacm structs.

#[repr(C)]
pub struct rdma_event_channel {
    pub fd: c_int,
}

/// `struct rdma_cm_id`. `route` (struct rdma_route: rdma_addr + path record
/// pointer + count) begins with `struct rdma_addr`, whose first two members are
/// the source and destination `sockaddr_storage` (128 bytes each) — what the
/// header's inline `rdma_get_local_addr`/`rdma_get_peer_addr` return.
#[repr(C)]
pub struct rdma_cm_id {
    pub verbs: *mut ibv_context,
    pub channel: *mut rdma_event_channel,
    pub context: *mut c_void,
    pub qp: *mut ibv_qp,
    pub src_addr: libc::sockaddr_storage,
    pub dst_addr: libc::sockaddr_storage,
    /// `struct rdma_ib_addr` (sgid, dgid, pkey) padded, path_rec, num_paths.
    pub _route_rest: [u64; 7],
    pub ps: u32,
    pub port_num: u8,
    pub event: *mut rdma_cm_event,
    pub send_cq_channel: *mut ibv_comp_channel,
    pub send_cq: *mut ibv_cq,
    pub recv_cq_channel: *mut ibv_comp_channel,
    pub recv_cq: *mut ibv_cq,
    pub srq: *mut c_void,
    pub pd: *mut ibv_pd,
    pub qp_type: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct rdma_conn_param {
    pub private_data: *const c_void,
    pub private_data_len: u8,
    pub responder_resources: u8,
    pub initiator_depth: u8,
    pub flow_control: u8,
    pub retry_count: u8,
    pub rnr_retry_count: u8,
    pub srq: u8,
    pub qp_num: u32,
}

#[repr(C)]
pub struct rdma_cm_event {
    pub id: *mut rdma_cm_id,
    pub listen_id: *mut rdma_cm_id,
    pub event: u32,
    pub status: c_int,
    /// `param.conn`; the union's other member (`ud`, 56 bytes) is only padding here.
    pub conn: rdma_conn_param,
    pub _ud_pad: [u64; 4],
}

// ---------------------------------------------------------------------------
// Layout assertions (values from rdma-core 44 headers on x86_64, gcc).

const _: () = {
    assert!(size_of::<ibv_device>() == 664);
    assert!(offset_of!(ibv_device, node_type) == 16);
    assert!(offset_of!(ibv_device, transport_type) == 20);
    assert!(offset_of!(ibv_device, name) == 24);
    assert!(size_of::<ibv_context_ops>() == 256);
    assert!(offset_of!(ibv_context_ops, alloc_mw) == 56);
    assert!(offset_of!(ibv_context_ops, dealloc_mw) == 72);
    assert!(offset_of!(ibv_context_ops, poll_cq) == 88);
    assert!(offset_of!(ibv_context_ops, req_notify_cq) == 96);
    assert!(offset_of!(ibv_context_ops, post_srq_recv) == 160);
    assert!(offset_of!(ibv_context_ops, post_send) == 200);
    assert!(offset_of!(ibv_context_ops, post_recv) == 208);
    assert!(size_of::<ibv_context>() == 328);
    assert!(offset_of!(ibv_context, ops) == 8);
    assert!(offset_of!(ibv_context, cmd_fd) == 264);
    assert!(offset_of!(ibv_context, mutex) == 280);
    assert!(offset_of!(ibv_context, abi_compat) == 320);
    assert!(size_of::<ibv_device_attr>() == 232);
    assert!(offset_of!(ibv_device_attr, max_mr_size) == 80);
    assert!(offset_of!(ibv_device_attr, max_qp_wr) == 112);
    assert!(offset_of!(ibv_device_attr, device_cap_flags) == 116);
    assert!(offset_of!(ibv_device_attr, max_sge) == 120);
    assert!(offset_of!(ibv_device_attr, max_cqe) == 132);
    assert!(offset_of!(ibv_device_attr, max_qp_rd_atom) == 144);
    assert!(offset_of!(ibv_device_attr, max_qp_init_rd_atom) == 156);
    assert!(offset_of!(ibv_device_attr, max_mw) == 176);
    assert!(offset_of!(ibv_device_attr, phys_port_cnt) == 227);
    assert!(size_of::<ibv_port_attr>() == 52);
    assert!(offset_of!(ibv_port_attr, max_msg_sz) == 20);
    assert!(offset_of!(ibv_port_attr, link_layer) == 46);
    assert!(size_of::<ibv_pd>() == 16);
    assert!(size_of::<ibv_mr>() == 48);
    assert!(offset_of!(ibv_mr, lkey) == 36);
    assert!(offset_of!(ibv_mr, rkey) == 40);
    assert!(size_of::<ibv_mw>() == 32);
    assert!(offset_of!(ibv_mw, rkey) == 16);
    assert!(offset_of!(ibv_mw, type_) == 24);
    assert!(size_of::<ibv_comp_channel>() == 16);
    assert!(offset_of!(ibv_comp_channel, fd) == 8);
    assert!(size_of::<ibv_cq>() == 128);
    assert!(size_of::<ibv_qp>() == 160);
    assert!(offset_of!(ibv_qp, qp_num) == 52);
    assert!(offset_of!(ibv_qp, state) == 56);
    assert!(size_of::<ibv_qp_init_attr>() == 64);
    assert!(offset_of!(ibv_qp_init_attr, cap) == 32);
    assert!(offset_of!(ibv_qp_init_attr, qp_type) == 52);
    assert!(offset_of!(ibv_qp_init_attr, sq_sig_all) == 56);
    assert!(size_of::<ibv_qp_attr>() == 144);
    assert!(size_of::<ibv_wc>() == 48);
    assert!(offset_of!(ibv_wc, status) == 8);
    assert!(offset_of!(ibv_wc, vendor_err) == 16);
    assert!(offset_of!(ibv_wc, byte_len) == 20);
    assert!(offset_of!(ibv_wc, imm_data) == 24);
    assert!(offset_of!(ibv_wc, qp_num) == 28);
    assert!(offset_of!(ibv_wc, wc_flags) == 36);
    assert!(size_of::<ibv_sge>() == 16);
    assert!(size_of::<ibv_mw_bind_info>() == 32);
    assert!(size_of::<ibv_send_wr>() == 128);
    assert!(offset_of!(ibv_send_wr, next) == 8);
    assert!(offset_of!(ibv_send_wr, sg_list) == 16);
    assert!(offset_of!(ibv_send_wr, num_sge) == 24);
    assert!(offset_of!(ibv_send_wr, opcode) == 28);
    assert!(offset_of!(ibv_send_wr, send_flags) == 32);
    assert!(offset_of!(ibv_send_wr, imm_data) == 36);
    assert!(offset_of!(ibv_send_wr, remote_addr) == 40);
    assert!(offset_of!(ibv_send_wr, rkey) == 48);
    assert!(offset_of!(ibv_send_wr, remote_srqn) == 72);
    assert!(offset_of!(ibv_send_wr, bind_mw) == 80);
    assert!(size_of::<ibv_recv_wr>() == 32);
    assert!(size_of::<ibv_srq_init_attr>() == 24);
    assert!(offset_of!(ibv_srq_init_attr, attr) == 8);
    assert!(size_of::<rdma_event_channel>() == 4);
    assert!(size_of::<rdma_cm_id>() == 416);
    assert!(offset_of!(rdma_cm_id, qp) == 24);
    assert!(offset_of!(rdma_cm_id, src_addr) == 32);
    assert!(offset_of!(rdma_cm_id, dst_addr) == 160);
    assert!(offset_of!(rdma_cm_id, ps) == 344);
    assert!(offset_of!(rdma_cm_id, port_num) == 348);
    assert!(offset_of!(rdma_cm_id, event) == 352);
    assert!(offset_of!(rdma_cm_id, pd) == 400);
    assert!(offset_of!(rdma_cm_id, qp_type) == 408);
    assert!(size_of::<rdma_conn_param>() == 24);
    assert!(offset_of!(rdma_conn_param, private_data_len) == 8);
    assert!(offset_of!(rdma_conn_param, responder_resources) == 9);
    assert!(offset_of!(rdma_conn_param, initiator_depth) == 10);
    assert!(offset_of!(rdma_conn_param, rnr_retry_count) == 13);
    assert!(offset_of!(rdma_conn_param, qp_num) == 16);
    assert!(size_of::<rdma_cm_event>() == 80);
    assert!(offset_of!(rdma_cm_event, event) == 16);
    assert!(offset_of!(rdma_cm_event, status) == 20);
    assert!(offset_of!(rdma_cm_event, conn) == 24);
};

// ---------------------------------------------------------------------------
// The libraries, opened at run time.

/// Function pointers resolved from `libibverbs.so.1` and `librdmacm.so.1`.
/// Versioned symbols resolve to their default version (`@@IBVERBS_1.1`), the
/// one a program linked against rdma-core ≥ 1.1 headers would use.
pub struct Lib {
    _ibverbs: libloading::Library,
    _rdmacm: libloading::Library,
    pub ibv_get_device_list: unsafe extern "C" fn(*mut c_int) -> *mut *mut ibv_device,
    pub ibv_free_device_list: unsafe extern "C" fn(*mut *mut ibv_device),
    pub ibv_open_device: unsafe extern "C" fn(*mut ibv_device) -> *mut ibv_context,
    pub ibv_close_device: unsafe extern "C" fn(*mut ibv_context) -> c_int,
    pub ibv_query_device: unsafe extern "C" fn(*mut ibv_context, *mut ibv_device_attr) -> c_int,
    pub ibv_query_port: unsafe extern "C" fn(*mut ibv_context, u8, *mut ibv_port_attr) -> c_int,
    pub ibv_alloc_pd: unsafe extern "C" fn(*mut ibv_context) -> *mut ibv_pd,
    pub ibv_dealloc_pd: unsafe extern "C" fn(*mut ibv_pd) -> c_int,
    pub ibv_reg_mr: unsafe extern "C" fn(*mut ibv_pd, *mut c_void, usize, c_int) -> *mut ibv_mr,
    pub ibv_dereg_mr: unsafe extern "C" fn(*mut ibv_mr) -> c_int,
    pub ibv_create_comp_channel: unsafe extern "C" fn(*mut ibv_context) -> *mut ibv_comp_channel,
    pub ibv_destroy_comp_channel: unsafe extern "C" fn(*mut ibv_comp_channel) -> c_int,
    pub ibv_create_cq: unsafe extern "C" fn(
        *mut ibv_context,
        c_int,
        *mut c_void,
        *mut ibv_comp_channel,
        c_int,
    ) -> *mut ibv_cq,
    pub ibv_destroy_cq: unsafe extern "C" fn(*mut ibv_cq) -> c_int,
    pub ibv_create_srq: unsafe extern "C" fn(*mut ibv_pd, *mut ibv_srq_init_attr) -> *mut ibv_srq,
    pub ibv_destroy_srq: unsafe extern "C" fn(*mut ibv_srq) -> c_int,
    pub ibv_get_cq_event:
        unsafe extern "C" fn(*mut ibv_comp_channel, *mut *mut ibv_cq, *mut *mut c_void) -> c_int,
    pub ibv_ack_cq_events: unsafe extern "C" fn(*mut ibv_cq, c_uint),
    pub ibv_modify_qp: unsafe extern "C" fn(*mut ibv_qp, *mut ibv_qp_attr, c_int) -> c_int,
    pub ibv_query_qp:
        unsafe extern "C" fn(*mut ibv_qp, *mut ibv_qp_attr, c_int, *mut ibv_qp_init_attr) -> c_int,
    pub ibv_get_async_event: unsafe extern "C" fn(*mut ibv_context, *mut ibv_async_event) -> c_int,
    pub ibv_ack_async_event: unsafe extern "C" fn(*mut ibv_async_event),

    pub rdma_create_event_channel: unsafe extern "C" fn() -> *mut rdma_event_channel,
    pub rdma_destroy_event_channel: unsafe extern "C" fn(*mut rdma_event_channel),
    pub rdma_create_id: unsafe extern "C" fn(
        *mut rdma_event_channel,
        *mut *mut rdma_cm_id,
        *mut c_void,
        u32,
    ) -> c_int,
    pub rdma_destroy_id: unsafe extern "C" fn(*mut rdma_cm_id) -> c_int,
    pub rdma_bind_addr: unsafe extern "C" fn(*mut rdma_cm_id, *mut libc::sockaddr) -> c_int,
    pub rdma_listen: unsafe extern "C" fn(*mut rdma_cm_id, c_int) -> c_int,
    pub rdma_resolve_addr: unsafe extern "C" fn(
        *mut rdma_cm_id,
        *mut libc::sockaddr,
        *mut libc::sockaddr,
        c_int,
    ) -> c_int,
    pub rdma_resolve_route: unsafe extern "C" fn(*mut rdma_cm_id, c_int) -> c_int,
    pub rdma_create_qp:
        unsafe extern "C" fn(*mut rdma_cm_id, *mut ibv_pd, *mut ibv_qp_init_attr) -> c_int,
    pub rdma_destroy_qp: unsafe extern "C" fn(*mut rdma_cm_id),
    pub rdma_connect: unsafe extern "C" fn(*mut rdma_cm_id, *mut rdma_conn_param) -> c_int,
    pub rdma_accept: unsafe extern "C" fn(*mut rdma_cm_id, *mut rdma_conn_param) -> c_int,
    pub rdma_reject: unsafe extern "C" fn(*mut rdma_cm_id, *const c_void, u8) -> c_int,
    pub rdma_disconnect: unsafe extern "C" fn(*mut rdma_cm_id) -> c_int,
    pub rdma_get_cm_event:
        unsafe extern "C" fn(*mut rdma_event_channel, *mut *mut rdma_cm_event) -> c_int,
    pub rdma_ack_cm_event: unsafe extern "C" fn(*mut rdma_cm_event) -> c_int,
    pub rdma_migrate_id: unsafe extern "C" fn(*mut rdma_cm_id, *mut rdma_event_channel) -> c_int,
    pub rdma_get_devices: unsafe extern "C" fn(*mut c_int) -> *mut *mut ibv_context,
    pub rdma_free_devices: unsafe extern "C" fn(*mut *mut ibv_context),
    pub rdma_event_str: unsafe extern "C" fn(u32) -> *const c_char,
}

static LIB: OnceLock<Result<Lib, String>> = OnceLock::new();

macro_rules! sym {
    ($lib:expr, $libname:expr, $name:ident) => {{
        // SAFETY: the symbol is looked up by its C name; the Rust type it is
        // read as is the declaration of that function in rdma-core ≥ 44's
        // headers (verbs.h / rdma_cma.h), transcribed by hand above. The
        // pointer stays valid because the `Library` is stored in the same
        // `Lib`, which lives in a static and is never dropped.
        let s = unsafe { $lib.get(concat!(stringify!($name), "\0").as_bytes()) }
            .map_err(|e| format!("{}: symbol {}: {e}", $libname, stringify!($name)))?;
        *s
    }};
}

impl Lib {
    /// The loaded libraries, or why they could not be loaded.
    pub fn get() -> Result<&'static Lib, String> {
        LIB.get_or_init(Lib::load).as_ref().map_err(|e| e.clone())
    }

    fn load() -> Result<Lib, String> {
        Lib::load_from("libibverbs.so.1", "librdmacm.so.1")
    }

    /// Load the two libraries by file name (tests use missing names).
    pub(crate) fn load_from(ibv: &str, cm: &str) -> Result<Lib, String> {
        // SAFETY: loading runs the libraries' ELF constructors. libibverbs'
        // and librdmacm's only set up internal state (no fork handlers
        // or signal handlers are installed until a device is opened).
        let ibverbs = unsafe { libloading::Library::new(ibv) }
            .map_err(|e| format!("{ibv} not loadable (rdma-core not installed?): {e}"))?;
        // SAFETY: as above.
        let rdmacm = unsafe { libloading::Library::new(cm) }
            .map_err(|e| format!("{cm} not loadable (rdma-core not installed?): {e}"))?;
        let (i, c) = (&ibverbs, &rdmacm);
        Ok(Lib {
            ibv_get_device_list: sym!(i, ibv, ibv_get_device_list),
            ibv_free_device_list: sym!(i, ibv, ibv_free_device_list),
            ibv_open_device: sym!(i, ibv, ibv_open_device),
            ibv_close_device: sym!(i, ibv, ibv_close_device),
            ibv_query_device: sym!(i, ibv, ibv_query_device),
            ibv_query_port: sym!(i, ibv, ibv_query_port),
            ibv_alloc_pd: sym!(i, ibv, ibv_alloc_pd),
            ibv_dealloc_pd: sym!(i, ibv, ibv_dealloc_pd),
            ibv_reg_mr: sym!(i, ibv, ibv_reg_mr),
            ibv_dereg_mr: sym!(i, ibv, ibv_dereg_mr),
            ibv_create_comp_channel: sym!(i, ibv, ibv_create_comp_channel),
            ibv_destroy_comp_channel: sym!(i, ibv, ibv_destroy_comp_channel),
            ibv_create_cq: sym!(i, ibv, ibv_create_cq),
            ibv_destroy_cq: sym!(i, ibv, ibv_destroy_cq),
            ibv_create_srq: sym!(i, ibv, ibv_create_srq),
            ibv_destroy_srq: sym!(i, ibv, ibv_destroy_srq),
            ibv_get_cq_event: sym!(i, ibv, ibv_get_cq_event),
            ibv_ack_cq_events: sym!(i, ibv, ibv_ack_cq_events),
            ibv_modify_qp: sym!(i, ibv, ibv_modify_qp),
            ibv_query_qp: sym!(i, ibv, ibv_query_qp),
            ibv_get_async_event: sym!(i, ibv, ibv_get_async_event),
            ibv_ack_async_event: sym!(i, ibv, ibv_ack_async_event),
            rdma_create_event_channel: sym!(c, cm, rdma_create_event_channel),
            rdma_destroy_event_channel: sym!(c, cm, rdma_destroy_event_channel),
            rdma_create_id: sym!(c, cm, rdma_create_id),
            rdma_destroy_id: sym!(c, cm, rdma_destroy_id),
            rdma_bind_addr: sym!(c, cm, rdma_bind_addr),
            rdma_listen: sym!(c, cm, rdma_listen),
            rdma_resolve_addr: sym!(c, cm, rdma_resolve_addr),
            rdma_resolve_route: sym!(c, cm, rdma_resolve_route),
            rdma_create_qp: sym!(c, cm, rdma_create_qp),
            rdma_destroy_qp: sym!(c, cm, rdma_destroy_qp),
            rdma_connect: sym!(c, cm, rdma_connect),
            rdma_accept: sym!(c, cm, rdma_accept),
            rdma_reject: sym!(c, cm, rdma_reject),
            rdma_disconnect: sym!(c, cm, rdma_disconnect),
            rdma_get_cm_event: sym!(c, cm, rdma_get_cm_event),
            rdma_ack_cm_event: sym!(c, cm, rdma_ack_cm_event),
            rdma_migrate_id: sym!(c, cm, rdma_migrate_id),
            rdma_get_devices: sym!(c, cm, rdma_get_devices),
            rdma_free_devices: sym!(c, cm, rdma_free_devices),
            rdma_event_str: sym!(c, cm, rdma_event_str),
            _ibverbs: ibverbs,
            _rdmacm: rdmacm,
        })
    }

    /// `rdma_event_str` as a Rust string.
    pub fn event_str(&self, ev: u32) -> String {
        // SAFETY: rdma_event_str returns a pointer to a static NUL-terminated
        // string for any value (an "UNKNOWN EVENT" string for unknown ones).
        unsafe {
            let p = (self.rdma_event_str)(ev);
            if p.is_null() {
                format!("event {ev}")
            } else {
                std::ffi::CStr::from_ptr(p).to_string_lossy().into_owned()
            }
        }
    }
}

/// A C `char` array as a Rust string (up to the first NUL).
pub fn cstr_array(a: &[c_char]) -> String {
    let bytes: Vec<u8> = a
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}
