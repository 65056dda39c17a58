/* verbs_probe: load libibverbs.so.1 and librdmacm.so.1 with dlopen() (NOT linked, the
 * way lwio's verbs provider loads them), open every device, print its capabilities,
 * probe memory windows and max inline data, and check that rdma_cm maps IP -> device.
 * Build: gcc -O2 -o verbs_probe verbs_probe.c -ldl   (headers: libibverbs-dev, librdmacm-dev)
 * usage: verbs_probe [IP DEV]...   (each pair: rdma_bind_addr(IP) must land on DEV)
 * exit 0 = libraries, provider plugins and devices all usable. */
#include <arpa/inet.h>
#include <dlfcn.h>
#include <errno.h>
#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define DIE(...) do { fprintf(stderr, "FAIL: " __VA_ARGS__); fprintf(stderr, "\n"); exit(1); } while (0)
#define SYM(lib, name) typeof(&name) p_##name = (typeof(&name))dlsym(lib, #name); \
  if (!p_##name) DIE("dlsym %s: %s", #name, dlerror())

int main(int argc, char **argv) {
  void *v = dlopen("libibverbs.so.1", RTLD_NOW | RTLD_GLOBAL);
  if (!v) DIE("dlopen libibverbs.so.1: %s", dlerror());
  void *cm = dlopen("librdmacm.so.1", RTLD_NOW | RTLD_GLOBAL);
  if (!cm) DIE("dlopen librdmacm.so.1: %s", dlerror());
  SYM(v, ibv_get_device_list); SYM(v, ibv_free_device_list); SYM(v, ibv_get_device_name);
  SYM(v, ibv_open_device); SYM(v, ibv_close_device); SYM(v, ibv_query_device);
  SYM(v, ibv_alloc_pd); SYM(v, ibv_dealloc_pd); SYM(v, ibv_reg_mr); SYM(v, ibv_dereg_mr);
  SYM(v, ibv_create_cq); SYM(v, ibv_destroy_cq); SYM(v, ibv_create_qp); SYM(v, ibv_destroy_qp);
  SYM(cm, rdma_create_event_channel); SYM(cm, rdma_destroy_event_channel);
  SYM(cm, rdma_create_id); SYM(cm, rdma_destroy_id); SYM(cm, rdma_bind_addr);

  int num = 0;
  struct ibv_device **l = p_ibv_get_device_list(&num);
  if (!l || !num) DIE("no RDMA devices (provider plugins /usr/lib/x86_64-linux-gnu/libibverbs/ missing?)");
  for (int i = 0; i < num; i++) {
    const char *name = p_ibv_get_device_name(l[i]);
    struct ibv_context *ctx = p_ibv_open_device(l[i]);
    if (!ctx) DIE("open %s: %s", name, strerror(errno));
    struct ibv_device_attr a;
    if (p_ibv_query_device(ctx, &a)) DIE("query_device %s", name);
    printf("device %s: max_mr_size=0x%llx max_qp=%d max_qp_wr=%d max_sge=%d max_sge_rd=%d max_cq=%d "
           "max_cqe=%d max_mr=%d max_pd=%d max_qp_rd_atom(IRD)=%d max_qp_init_rd_atom(ORD)=%d "
           "max_srq=%d max_srq_wr=%d max_mw=%d atomic_cap=%d "
           "device_cap_flags=0x%x MW_TYPE_2A=%d MW_TYPE_2B=%d MEM_MGT_EXTENSIONS=%d\n",
           name, (unsigned long long)a.max_mr_size, a.max_qp, a.max_qp_wr, a.max_sge, a.max_sge_rd,
           a.max_cq, a.max_cqe, a.max_mr, a.max_pd, a.max_qp_rd_atom, a.max_qp_init_rd_atom,
           a.max_srq, a.max_srq_wr, a.max_mw, a.atomic_cap, a.device_cap_flags,
           !!(a.device_cap_flags & IBV_DEVICE_MEM_WINDOW_TYPE_2A),
           !!(a.device_cap_flags & IBV_DEVICE_MEM_WINDOW_TYPE_2B),
           !!(a.device_cap_flags & IBV_DEVICE_MEM_MGT_EXTENSIONS));
    struct ibv_pd *pd = p_ibv_alloc_pd(ctx);
    if (!pd) DIE("alloc_pd %s", name);
    static char buf[1 << 16];
    struct ibv_mr *mr = p_ibv_reg_mr(pd, buf, sizeof buf, IBV_ACCESS_LOCAL_WRITE |
                                     IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ);
    if (!mr) DIE("reg_mr %s: %s", name, strerror(errno));
    for (int t = 1; t <= 2; t++) {   /* ibv_alloc_mw is an inline over ctx->ops */
      struct ibv_mw *mw = ibv_alloc_mw(pd, t == 1 ? IBV_MW_TYPE_1 : IBV_MW_TYPE_2);
      printf("  %s alloc_mw type %d: %s\n", name, t, mw ? "ok" : strerror(errno));
      if (mw) ibv_dealloc_mw(mw);
    }
    struct ibv_cq *cq = p_ibv_create_cq(ctx, 16, NULL, NULL, 0);
    if (!cq) DIE("create_cq %s", name);
    int best = -1, got = -1;
    for (int inl = 4096; inl >= 0; inl = inl > 64 ? inl / 2 : inl - 8) {
      struct ibv_qp_init_attr qa = { .send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_RC,
        .cap = { .max_send_wr = 4, .max_recv_wr = 4, .max_send_sge = 1, .max_recv_sge = 1,
                 .max_inline_data = inl } };
      struct ibv_qp *qp = p_ibv_create_qp(pd, &qa);
      if (qp) { best = inl; got = qa.cap.max_inline_data; p_ibv_destroy_qp(qp); break; }
    }
    printf("  %s max_inline_data: largest accepted request %d (cap returned %d)\n", name, best, got);
    p_ibv_destroy_cq(cq); p_ibv_dereg_mr(mr); p_ibv_dealloc_pd(pd); p_ibv_close_device(ctx);
  }
  p_ibv_free_device_list(l);

  for (int i = 1; i + 1 < argc; i += 2) {   /* rdma_cm: IP -> device */
    struct rdma_event_channel *ch = p_rdma_create_event_channel();
    struct rdma_cm_id *id;
    if (!ch || p_rdma_create_id(ch, &id, NULL, RDMA_PS_TCP)) DIE("rdma_create_id");
    struct sockaddr_in sa = { .sin_family = AF_INET };
    if (inet_pton(AF_INET, argv[i], &sa.sin_addr) != 1) DIE("bad IP %s", argv[i]);
    if (p_rdma_bind_addr(id, (struct sockaddr *)&sa)) DIE("rdma_bind_addr %s: %s", argv[i], strerror(errno));
    const char *dn = id->verbs ? p_ibv_get_device_name(id->verbs->device) : "(none)";
    printf("rdma_cm: %s -> %s\n", argv[i], dn);
    if (strcmp(dn, argv[i + 1])) DIE("rdma_cm bound %s to %s, expected %s", argv[i], dn, argv[i + 1]);
    p_rdma_destroy_id(id); p_rdma_destroy_event_channel(ch);
  }
  printf("PASS\n");
  return 0;
}
