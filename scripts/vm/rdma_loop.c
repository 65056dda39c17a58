/* rdma_loop: two RC QPs on one device connected to each other; RDMA WRITE,
 * RDMA READ and SEND/RECV between them, verify data. exit 0 = pass.
 * usage: rdma_loop DEV GID_IDX [imm] [mw2]
 *   imm: also RDMA WRITE WITH IMMEDIATE (recv completion must carry the imm data)
 *   mw2: also bind a type-2 memory window over the target buffer and RDMA WRITE via its rkey
 * (RoCE/rxe only: the QPs are connected by hand with ibv_modify_qp, no rdma_cm.)
 * From /work/shared/tools/rdma-vm-examples/rdma_loop.c, extended for lwio. */
#include <infiniband/verbs.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <arpa/inet.h>

#define SZ (1 << 20)
#define DIE(...) do { fprintf(stderr, "FAIL: " __VA_ARGS__); fprintf(stderr, "\n"); exit(1); } while (0)

static struct ibv_cq *cq;
static struct ibv_wc wait_wc(const char *what) {
  struct ibv_wc wc; int n; time_t t0 = time(NULL);
  while ((n = ibv_poll_cq(cq, 1, &wc)) == 0) if (time(NULL) - t0 > 10) DIE("%s: CQ timeout", what);
  if (n < 0 || wc.status != IBV_WC_SUCCESS) DIE("%s: wc status %s", what, ibv_wc_status_str(wc.status));
  printf("  %s completed (opcode %d, %u bytes)\n", what, wc.opcode, wc.byte_len);
  return wc;
}
static void connect_qp(struct ibv_qp *qp, uint32_t dqpn, union ibv_gid *gid, int gidx) {
  struct ibv_qp_attr a = {0};
  a.qp_state = IBV_QPS_INIT; a.port_num = 1; a.pkey_index = 0;
  a.qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_LOCAL_WRITE;
  if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS)) DIE("INIT");
  memset(&a, 0, sizeof a);
  a.qp_state = IBV_QPS_RTR; a.path_mtu = IBV_MTU_1024; a.dest_qp_num = dqpn; a.rq_psn = 0;
  a.max_dest_rd_atomic = 1; a.min_rnr_timer = 12;
  a.ah_attr.is_global = 1; a.ah_attr.grh.dgid = *gid; a.ah_attr.grh.sgid_index = gidx;
  a.ah_attr.grh.hop_limit = 1; a.ah_attr.port_num = 1;
  if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                    IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER)) DIE("RTR");
  memset(&a, 0, sizeof a);
  a.qp_state = IBV_QPS_RTS; a.timeout = 14; a.retry_cnt = 7; a.rnr_retry = 7; a.sq_psn = 0; a.max_rd_atomic = 1;
  if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                    IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC)) DIE("RTS");
}
int main(int argc, char **argv) {
  const char *name = argc > 1 ? argv[1] : getenv("RXE_DEV");
  int gidx = argc > 2 ? atoi(argv[2]) : (getenv("RXE_GID_IDX") ? atoi(getenv("RXE_GID_IDX")) : 1);
  int num; struct ibv_device **l = ibv_get_device_list(&num);
  if (!l || !num) DIE("no RDMA devices");
  struct ibv_device *dev = NULL;
  for (int i = 0; i < num; i++) if (!name || !strcmp(ibv_get_device_name(l[i]), name)) { dev = l[i]; break; }
  if (!dev) DIE("device %s not found", name);
  struct ibv_context *ctx = ibv_open_device(dev); if (!ctx) DIE("open");
  union ibv_gid gid; if (ibv_query_gid(ctx, 1, gidx, &gid)) DIE("query_gid");
  printf("device %s gid[%d] ok\n", ibv_get_device_name(dev), gidx);
  struct ibv_pd *pd = ibv_alloc_pd(ctx); if (!pd) DIE("pd");
  char *a = malloc(SZ), *b = calloc(1, SZ), *c = calloc(1, SZ);
  for (int i = 0; i < SZ; i++) a[i] = (char)(i * 7 + 3);
  int acc = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
  struct ibv_mr *ma = ibv_reg_mr(pd, a, SZ, acc), *mb = ibv_reg_mr(pd, b, SZ, acc), *mc = ibv_reg_mr(pd, c, SZ, acc);
  if (!ma || !mb || !mc) DIE("reg_mr");
  cq = ibv_create_cq(ctx, 64, NULL, NULL, 0); if (!cq) DIE("cq");
  struct ibv_qp_init_attr qa = { .send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_RC,
    .cap = { .max_send_wr = 16, .max_recv_wr = 16, .max_send_sge = 1, .max_recv_sge = 1 } };
  struct ibv_qp *q1 = ibv_create_qp(pd, &qa), *q2 = ibv_create_qp(pd, &qa);
  if (!q1 || !q2) DIE("create_qp");
  connect_qp(q1, q2->qp_num, &gid, gidx); connect_qp(q2, q1->qp_num, &gid, gidx);
  printf("QPs %u <-> %u connected (RTS)\n", q1->qp_num, q2->qp_num);
  struct ibv_sge s = { .addr = (uintptr_t)a, .length = SZ, .lkey = ma->lkey };
  struct ibv_send_wr wr = { .sg_list = &s, .num_sge = 1, .opcode = IBV_WR_RDMA_WRITE,
    .send_flags = IBV_SEND_SIGNALED, .wr.rdma = { .remote_addr = (uintptr_t)b, .rkey = mb->rkey } }, *bad;
  if (ibv_post_send(q1, &wr, &bad)) DIE("post write");
  wait_wc("RDMA WRITE 1MiB");
  if (memcmp(a, b, SZ)) DIE("WRITE data mismatch");
  s.addr = (uintptr_t)c; s.lkey = mc->lkey; wr.opcode = IBV_WR_RDMA_READ;
  if (ibv_post_send(q2, &wr, &bad)) DIE("post read");
  wait_wc("RDMA READ 1MiB");   /* reads b via q1 */
  if (memcmp(a, c, SZ)) DIE("READ data mismatch");
  memset(c, 0, SZ);
  struct ibv_sge rs = { .addr = (uintptr_t)c, .length = SZ, .lkey = mc->lkey };
  struct ibv_recv_wr rw = { .sg_list = &rs, .num_sge = 1 }, *rbad;
  if (ibv_post_recv(q2, &rw, &rbad)) DIE("post recv");
  s.addr = (uintptr_t)a; s.lkey = ma->lkey; s.length = 4096; wr.opcode = IBV_WR_SEND;
  if (ibv_post_send(q1, &wr, &bad)) DIE("post send");
  wait_wc("SEND/RECV 4KiB (1)"); wait_wc("SEND/RECV 4KiB (2)");
  if (memcmp(a, c, 4096)) DIE("SEND data mismatch");
  for (int i = 3; i < argc; i++) {
    if (!strcmp(argv[i], "imm")) {
      memset(b, 0, SZ);
      if (ibv_post_recv(q2, &rw, &rbad)) DIE("post recv (imm)");
      s.length = 8192; wr.opcode = IBV_WR_RDMA_WRITE_WITH_IMM; wr.imm_data = htonl(0x1234abcd);
      wr.wr.rdma.remote_addr = (uintptr_t)b; wr.wr.rdma.rkey = mb->rkey;
      if (ibv_post_send(q1, &wr, &bad)) DIE("post write_with_imm");
      struct ibv_wc w1 = wait_wc("RDMA WRITE WITH IMM 8KiB (1)"), w2 = wait_wc("RDMA WRITE WITH IMM 8KiB (2)");
      struct ibv_wc *r = w1.opcode == IBV_WC_RECV_RDMA_WITH_IMM ? &w1 : &w2;
      if (r->opcode != IBV_WC_RECV_RDMA_WITH_IMM || !(r->wc_flags & IBV_WC_WITH_IMM) || ntohl(r->imm_data) != 0x1234abcd)
        DIE("write_with_imm: recv opcode %d flags 0x%x imm 0x%x", r->opcode, r->wc_flags, ntohl(r->imm_data));
      if (memcmp(a, b, 8192)) DIE("WRITE_WITH_IMM data mismatch");
      printf("  write_with_imm ok (imm 0x%x)\n", ntohl(r->imm_data));
    } else if (!strcmp(argv[i], "mw2")) {
      /* MW rights need IBV_ACCESS_MW_BIND on the MR */
      struct ibv_mr *mbw = ibv_reg_mr(pd, b, SZ, acc | IBV_ACCESS_MW_BIND); if (!mbw) DIE("reg_mr MW_BIND");
      struct ibv_mw *mw = ibv_alloc_mw(pd, IBV_MW_TYPE_2); if (!mw) DIE("alloc_mw type 2");
      struct ibv_send_wr bw = { .opcode = IBV_WR_BIND_MW, .send_flags = IBV_SEND_SIGNALED,
        .bind_mw = { .mw = mw, .rkey = ibv_inc_rkey(mw->rkey),
          .bind_info = { .mr = mbw, .addr = (uintptr_t)b, .length = 65536,
                         .mw_access_flags = IBV_ACCESS_REMOTE_WRITE } } };
      if (ibv_post_send(q2, &bw, &bad)) DIE("post bind_mw");
  wait_wc("BIND MW type 2");
      memset(b, 0, SZ); s.length = 65536; wr.opcode = IBV_WR_RDMA_WRITE;
      wr.wr.rdma.remote_addr = (uintptr_t)b; wr.wr.rdma.rkey = bw.bind_mw.rkey;
      if (ibv_post_send(q1, &wr, &bad)) DIE("post write via MW");
  wait_wc("RDMA WRITE 64KiB via MW rkey");
      if (memcmp(a, b, 65536)) DIE("MW WRITE data mismatch");
      printf("  mw type 2 ok (rkey 0x%x)\n", bw.bind_mw.rkey);
      ibv_dealloc_mw(mw); ibv_dereg_mr(mbw);
    } else DIE("unknown extra test %s", argv[i]);
  }
  ibv_destroy_qp(q1); ibv_destroy_qp(q2); ibv_destroy_cq(cq);
  ibv_dereg_mr(ma); ibv_dereg_mr(mb); ibv_dereg_mr(mc); ibv_dealloc_pd(pd);
  ibv_close_device(ctx); ibv_free_device_list(l);
  printf("PASS\n");
  return 0;
}
