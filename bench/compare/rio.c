// rio: tiny block-I/O load generator for remote-file peers (libnfs, libsmbclient) and local files.
// Built by bench/compare.sh (from the peers.sh anchors in ../shared/tools/peers).
// usage: rio BACKEND TARGET MODE BS QD SECONDS
//   BACKEND file : TARGET=/path           QD = worker processes, each pread/pwrite (sync)
//   BACKEND nfs  : TARGET=nfs://host/exp/file?version=4  one libnfs context, QD async requests in flight
//   BACKEND smb  : TARGET=smb://host/share/file          QD = worker processes, one libsmbclient context (TCP conn) each
//   MODE: randread | randwrite | read | write   (read/write = one sequential stream, wrapping, shared by the QD
//         workers/requests: each takes the next block)
// env SMBUSER / SMBPASS. Prints one JSON line. CPU = getrusage over the timed loop only (parent + workers).
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <nfsc/libnfs.h>
#include <libsmbclient.h>

static const char *backend, *target, *mode;
static uint64_t bs, fsize, nblk;
static int qd, is_write, is_rand;
static double secs;
static atomic_uint_fast64_t seq_next, *seq_ptr = &seq_next;  // sequential cursor (shared memory for workers)
static volatile int stop_flag;

static inline uint64_t now_ns(void) {
    struct timespec ts; clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + ts.tv_nsec;
}
static inline uint64_t xs(uint64_t *s) { uint64_t x = *s; x ^= x << 13; x ^= x >> 7; x ^= x << 17; return *s = x; }
static inline uint64_t next_off(uint64_t *rng) {
    if (is_rand) return (xs(rng) % nblk) * bs;
    return (atomic_fetch_add(seq_ptr, 1) % nblk) * bs;
}

typedef struct { uint64_t *lat; size_t n, cap; uint64_t bytes; } stats_t;
static void rec(stats_t *s, uint64_t ns, uint64_t b) {
    if (s->n == s->cap) { s->cap = s->cap ? s->cap * 2 : 1 << 16; s->lat = realloc(s->lat, s->cap * sizeof(uint64_t)); }
    s->lat[s->n++] = ns; s->bytes += b;
}
static int cmpu(const void *a, const void *b) { uint64_t x = *(uint64_t *)a, y = *(uint64_t *)b; return x < y ? -1 : x > y; }
static void die(const char *m) { fprintf(stderr, "rio: %s (errno %d %s)\n", m, errno, strerror(errno)); exit(2); }

/* ---------------- file / smb : QD worker processes ---------------- */
// libsmbclient is not thread-safe here (Debian's build lacks smbc_thread_posix), so QD>1 uses QD forked
// processes, each with its own context/TCP connection (or fd). Results go through a MAP_SHARED region.
static const char *smb_user, *smb_pass;
static void smb_auth(const char *srv, const char *shr, char *wg, int wglen, char *un, int unlen, char *pw, int pwlen) {
    (void)srv; (void)shr;
    snprintf(wg, wglen, "WORKGROUP"); snprintf(un, unlen, "%s", smb_user); snprintf(pw, pwlen, "%s", smb_pass);
}
typedef struct { volatile int ready, done; double cpu; size_t n; uint64_t bytes; } wsh_t;
typedef struct { volatile int go, stop; atomic_uint_fast64_t seq; wsh_t w[]; } shm_t;
static shm_t *shm; static uint64_t *shlat; static size_t shcap;
static double ru_cpu(void) { struct rusage r; getrusage(RUSAGE_SELF, &r);
    return r.ru_utime.tv_sec + r.ru_utime.tv_usec / 1e6 + r.ru_stime.tv_sec + r.ru_stime.tv_usec / 1e6; }
static void worker(int id) {
    uint64_t rng = 0x9e3779b97f4a7c15ull * (id + 1);
    char *buf = aligned_alloc(4096, bs); memset(buf, 0xa5 + id, bs);
    int fd = -1; SMBCCTX *ctx = NULL; SMBCFILE *sf = NULL;
    smbc_read_fn rd = NULL; smbc_write_fn wr = NULL; smbc_lseek_fn sk = NULL;
    if (!strcmp(backend, "file")) {
        fd = open(target, is_write ? O_RDWR : O_RDONLY); if (fd < 0) die("open");
    } else {
        ctx = smbc_new_context(); if (!ctx) die("smbc_new_context");
        smbc_setFunctionAuthData(ctx, smb_auth);
        smbc_setOptionNoAutoAnonymousLogin(ctx, 1);
        smbc_setOptionUseKerberos(ctx, 0);
        smbc_setOptionProtocols(ctx, "SMB3", "SMB3");
        if (!smbc_init_context(ctx)) die("smbc_init_context");
        sf = smbc_getFunctionOpen(ctx)(ctx, target, is_write ? O_RDWR : O_RDONLY, 0);
        if (!sf) die("smbc open");
        rd = smbc_getFunctionRead(ctx); wr = smbc_getFunctionWrite(ctx); sk = smbc_getFunctionLseek(ctx);
    }
    for (int i = 0; i < 200; i++) {   // warm-up, not recorded
        uint64_t off = (xs(&rng) % nblk) * bs; ssize_t r;
        if (fd >= 0) r = is_write ? pwrite(fd, buf, bs, off) : pread(fd, buf, bs, off);
        else { sk(ctx, sf, off, SEEK_SET); r = is_write ? wr(ctx, sf, buf, bs) : rd(ctx, sf, buf, bs); }
        if (r != (ssize_t)bs) die("warm-up io");
    }
    wsh_t *w = &shm->w[id]; uint64_t *lat = shlat + (size_t)id * shcap;
    w->ready = 1;
    while (!shm->go) usleep(200);
    double c0 = ru_cpu();
    while (!shm->stop) {
        uint64_t off = next_off(&rng), t0 = now_ns(); ssize_t r;
        if (fd >= 0) r = is_write ? pwrite(fd, buf, bs, off) : pread(fd, buf, bs, off);
        else { sk(ctx, sf, off, SEEK_SET); r = is_write ? wr(ctx, sf, buf, bs) : rd(ctx, sf, buf, bs); }
        if (r != (ssize_t)bs) die("io");
        uint64_t d = now_ns() - t0;
        if (w->n < shcap) lat[w->n] = d;
        w->n++; w->bytes += bs;
    }
    w->cpu = ru_cpu() - c0;
    w->done = 1;
    if (fd >= 0) close(fd); else { smbc_getFunctionClose(ctx)(ctx, sf); smbc_free_context(ctx, 1); }
    _exit(0);
}

/* ---------------- nfs : one context, async ---------------- */
struct nfs_context *nfs; struct nfsfh *nfh; char *nbuf;
typedef struct { uint64_t t0; int slot; } req_t;
static stats_t nst; static int inflight, nfs_err; static uint64_t nrng = 88172645463325252ull;
static void nfs_issue(req_t *r);
static void nfs_cb_fn(int err, struct nfs_context *n, void *data, void *priv) {
    (void)n; (void)data; req_t *r = priv; inflight--;
    if (err < 0 || (uint64_t)err != bs) { fprintf(stderr, "nfs io err %d %s\n", err, err < 0 ? (char *)data : ""); nfs_err = 1; return; }
    if (r->t0) rec(&nst, now_ns() - r->t0, bs);
    if (!stop_flag) nfs_issue(r);
}
static int recording;
static void nfs_issue(req_t *r) {
    uint64_t off = next_off(&nrng); r->t0 = recording ? now_ns() : 0; int rc;
    if (is_write) rc = nfs_pwrite_async(nfs, nfh, off, bs, nbuf, nfs_cb_fn, r);
    else rc = nfs_pread_async(nfs, nfh, off, bs, nfs_cb_fn, r);
    if (rc) { fprintf(stderr, "nfs queue failed: %s\n", nfs_get_error(nfs)); exit(2); }
    inflight++;
}
static void nfs_poll_until(uint64_t deadline) {
    while (!nfs_err && (deadline ? now_ns() < deadline : inflight > 0)) {
        struct pollfd p = { .fd = nfs_get_fd(nfs), .events = nfs_which_events(nfs) };
        if (poll(&p, 1, 100) < 0) die("poll");
        if (nfs_service(nfs, p.revents) < 0) { fprintf(stderr, "nfs_service: %s\n", nfs_get_error(nfs)); exit(2); }
    }
    if (nfs_err) exit(2);
}

int main(int argc, char **argv) {
    if (argc < 7) { fprintf(stderr, "usage: rio file|nfs|smb TARGET randread|randwrite|read|write BS QD SECONDS\n"); return 1; }
    backend = argv[1]; target = argv[2]; mode = argv[3]; bs = strtoull(argv[4], 0, 0); qd = atoi(argv[5]); secs = atof(argv[6]);
    is_write = strstr(mode, "write") != NULL; is_rand = !strncmp(mode, "rand", 4);
    smb_user = getenv("SMBUSER") ? getenv("SMBUSER") : "root"; smb_pass = getenv("SMBPASS") ? getenv("SMBPASS") : "peerpass";
    struct rusage ru0, ru1; uint64_t t0, t1; stats_t all = {0};
    if (!strcmp(backend, "nfs")) {
        nfs = nfs_init_context(); if (!nfs) die("nfs_init_context");
        struct nfs_url *u = nfs_parse_url_full(nfs, target); if (!u) { fprintf(stderr, "url: %s\n", nfs_get_error(nfs)); return 2; }
        if (nfs_mount(nfs, u->server, u->path)) { fprintf(stderr, "mount: %s\n", nfs_get_error(nfs)); return 2; }
        if (nfs_open(nfs, u->file, is_write ? O_RDWR : O_RDONLY, &nfh)) { fprintf(stderr, "open: %s\n", nfs_get_error(nfs)); return 2; }
        struct nfs_stat_64 st; if (nfs_fstat64(nfs, nfh, &st)) { fprintf(stderr, "fstat: %s\n", nfs_get_error(nfs)); return 2; }
        fsize = st.nfs_size; nblk = fsize / bs;
        fprintf(stderr, "rio nfs: size %llu readmax %llu writemax %llu\n", (unsigned long long)fsize,
                (unsigned long long)nfs_get_readmax(nfs), (unsigned long long)nfs_get_writemax(nfs));
        nbuf = aligned_alloc(4096, bs); memset(nbuf, 0x5a, bs);
        req_t *reqs = calloc(qd, sizeof(req_t));
        for (int i = 0; i < 200; i++) { nfs_issue(&reqs[0]); stop_flag = 1; nfs_poll_until(0); stop_flag = 0; } // warm-up
        atomic_store(&seq_next, 0); nst.n = 0; nst.bytes = 0; recording = 1;
        getrusage(RUSAGE_SELF, &ru0); t0 = now_ns();
        for (int i = 0; i < qd; i++) { reqs[i].slot = i; nfs_issue(&reqs[i]); }
        nfs_poll_until(t0 + (uint64_t)(secs * 1e9));
        stop_flag = 1; t1 = now_ns(); getrusage(RUSAGE_SELF, &ru1);
        nfs_poll_until(0);   // drain (not timed)
        all = nst;
        nfs_close(nfs, nfh); nfs_destroy_context(nfs);
    } else {
        if (!strcmp(backend, "file")) {
            struct stat st; if (stat(target, &st)) die("stat"); fsize = st.st_size;
        } else {
            SMBCCTX *c = smbc_new_context(); smbc_setFunctionAuthData(c, smb_auth); smbc_setOptionNoAutoAnonymousLogin(c, 1);
            smbc_setOptionUseKerberos(c, 0);
            if (!smbc_init_context(c)) die("smbc_init_context");
            struct stat st; if (smbc_getFunctionStat(c)(c, target, &st)) die("smbc stat"); fsize = st.st_size;
            smbc_free_context(c, 1);
        }
        nblk = fsize / bs;
        shcap = 4u << 20;   // latency samples per worker (lazily touched)
        size_t hdr = (sizeof(shm_t) + qd * sizeof(wsh_t) + 4095) & ~(size_t)4095;
        char *m = mmap(NULL, hdr + (size_t)qd * shcap * 8, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (m == MAP_FAILED) die("mmap");
        shm = (shm_t *)m; shlat = (uint64_t *)(m + hdr); seq_ptr = &shm->seq;  // one sequential stream over all workers
        pid_t *pids = calloc(qd, sizeof(pid_t));
        for (int i = 0; i < qd; i++) { pids[i] = fork(); if (pids[i] < 0) die("fork"); if (pids[i] == 0) worker(i); }
        for (int i = 0; i < qd; i++) while (!shm->w[i].ready) { int st; if (waitpid(pids[i], &st, WNOHANG) == pids[i]) { fprintf(stderr, "rio: worker %d died in setup\n", i); return 2; } usleep(1000); }
        getrusage(RUSAGE_SELF, &ru0); t0 = now_ns();
        shm->go = 1;
        struct timespec ts = { (time_t)secs, (long)((secs - (time_t)secs) * 1e9) }; nanosleep(&ts, NULL);
        shm->stop = 1; t1 = now_ns();
        for (int i = 0; i < qd; i++) while (!shm->w[i].done) usleep(200);
        getrusage(RUSAGE_SELF, &ru1);
        for (int i = 0; i < qd; i++) { int st; waitpid(pids[i], &st, 0); }
        double wcpu = 0;
        for (int i = 0; i < qd; i++) {
            wcpu += shm->w[i].cpu;
            size_t n = shm->w[i].n < shcap ? shm->w[i].n : shcap;
            for (size_t j = 0; j < n; j++) rec(&all, shlat[(size_t)i * shcap + j], bs);
        }
        ru1.ru_utime.tv_sec += (time_t)wcpu; ru1.ru_utime.tv_usec += (long)((wcpu - (time_t)wcpu) * 1e6);  // parent + workers
        if (ru1.ru_utime.tv_usec >= 1000000) { ru1.ru_utime.tv_sec++; ru1.ru_utime.tv_usec -= 1000000; }
    }
    double el = (t1 - t0) / 1e9;
    double cpu = (ru1.ru_utime.tv_sec - ru0.ru_utime.tv_sec) + (ru1.ru_utime.tv_usec - ru0.ru_utime.tv_usec) / 1e6 +
                 (ru1.ru_stime.tv_sec - ru0.ru_stime.tv_sec) + (ru1.ru_stime.tv_usec - ru0.ru_stime.tv_usec) / 1e6;
    qsort(all.lat, all.n, sizeof(uint64_t), cmpu);
    double gib = all.bytes / 1073741824.0;
    printf("{\"backend\":\"%s\",\"mode\":\"%s\",\"bs\":%llu,\"qd\":%d,\"ios\":%zu,\"secs\":%.3f,\"iops\":%.1f,\"GBps\":%.4f,"
           "\"p50_us\":%.2f,\"p99_us\":%.2f,\"cpu_s\":%.4f,\"cpu_us_per_io\":%.3f,\"cpu_s_per_GiB\":%.4f}\n",
           backend, mode, (unsigned long long)bs, qd, all.n, el, all.n / el, all.bytes / el / 1e9,
           all.n ? all.lat[all.n / 2] / 1e3 : 0, all.n ? all.lat[(size_t)(all.n * 0.99)] / 1e3 : 0,
           cpu, all.n ? cpu / all.n * 1e6 : 0, gib > 0 ? cpu / gib : 0);
    return 0;
}
