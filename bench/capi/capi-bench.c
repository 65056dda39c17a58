/* capi-bench: random 4 KiB (or --bs) reads through liblwio's batch
 * interface at a queue depth, into registered memory, for a time; prints
 * IOPS, MB/s, p50/p99 latency and the process's CPU per I/O as one JSON
 * line. Used by bench/capi-compare.sh beside `lwio bench`.
 *
 *   capi-bench URL/PATH TOKEN_FILE FINGERPRINT QD BS SECONDS SIZE [poll] */
#define _GNU_SOURCE
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>

#include <lwio.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv) {
    if (argc < 8) {
        fprintf(stderr, "usage: %s URL PATH TOKEN_FILE FINGERPRINT QD BS SECONDS SIZE [poll]\n", argv[0]);
        return 2;
    }
    const char *url = argv[1], *path = argv[2];
    int qd = atoi(argv[5]);
    size_t bs = strtoull(argv[6], NULL, 0);
    double secs = atof(argv[7]);
    uint64_t size = strtoull(argv[8], NULL, 0);
    struct lwio_options o;
    lwio_options_init(&o);
    o.token_file = argv[3];
    o.fingerprint = argv[4];
    o.completion = argc > 9 && !strcmp(argv[9], "poll") ? LWIO_COMPLETION_POLL
                                                         : LWIO_COMPLETION_INTERRUPT;
    struct lwio_client *c = lwio_connect(url, &o);
    if (!c) { fprintf(stderr, "connect: %s\n", lwio_errmsg()); return 1; }
    int fd = lwio_open(c, path, O_RDONLY, 0);
    if (fd < 0) { fprintf(stderr, "open: %s\n", lwio_errmsg()); return 1; }
    unsigned char *mem = lwio_buf_alloc(c, (size_t)qd * bs);
    if (!mem) { fprintf(stderr, "buf_alloc: %s\n", lwio_errmsg()); return 1; }
    uint64_t blocks = size / bs, x = 88172645463325252ull;
    struct lwio_op *ops = calloc(qd, sizeof *ops);
    struct lwio_cqe *cq = calloc(qd, sizeof *cq);
    double *start = calloc(qd, sizeof *start);
    size_t cap = 1 << 22, nlat = 0;
    double *lat = malloc(cap * sizeof *lat);
    for (int i = 0; i < qd; i++) {
        x ^= x << 13; x ^= x >> 7; x ^= x << 17;
        ops[i] = (struct lwio_op){.user_data = i, .fd = fd, .opcode = LWIO_OP_READ,
                                  .buf = mem + i * bs, .len = bs, .offset = (x % blocks) * bs};
        start[i] = now();
    }
    struct rusage r0, r1;
    getrusage(RUSAGE_SELF, &r0);
    double t0 = now(), end = t0 + secs;
    if (lwio_submit(c, ops, qd) != qd) { fprintf(stderr, "submit: %s\n", lwio_errmsg()); return 1; }
    uint64_t done = 0;
    int inflight = qd;
    while (inflight > 0) {
        int k = lwio_reap(c, cq, 1, inflight);
        if (k < 1) { fprintf(stderr, "reap: %d %s\n", k, lwio_errmsg()); return 1; }
        double t = now();
        int again = 0;
        inflight -= k;
        for (int j = 0; j < k; j++) {
            int i = (int)cq[j].user_data;
            if (cq[j].res != (int64_t)bs) { fprintf(stderr, "read: %" PRId64 "\n", cq[j].res); return 1; }
            if (nlat < cap) lat[nlat++] = t - start[i];
            done++;
            if (t < end) {
                x ^= x << 13; x ^= x >> 7; x ^= x << 17;
                ops[again] = (struct lwio_op){.user_data = i, .fd = fd, .opcode = LWIO_OP_READ,
                                              .buf = mem + i * bs, .len = bs,
                                              .offset = (x % blocks) * bs};
                start[i] = t;
                again++;
            }
        }
        if (again && lwio_submit(c, ops, again) != again) {
            fprintf(stderr, "submit: %s\n", lwio_errmsg());
            return 1;
        }
        inflight += again;
    }
    double el = now() - t0;
    getrusage(RUSAGE_SELF, &r1);
    double cpu = (r1.ru_utime.tv_sec - r0.ru_utime.tv_sec) + (r1.ru_utime.tv_usec - r0.ru_utime.tv_usec) / 1e6 +
                 (r1.ru_stime.tv_sec - r0.ru_stime.tv_sec) + (r1.ru_stime.tv_usec - r0.ru_stime.tv_usec) / 1e6;
    qsort(lat, nlat, sizeof *lat, cmp);
    printf("{\"iops\": %.0f, \"mb_s\": %.1f, \"p50_us\": %.1f, \"p99_us\": %.1f, \"cpu_us_per_io\": %.2f}\n",
           done / el, done * bs / el / 1e6, lat[nlat / 2] * 1e6, lat[nlat * 99 / 100] * 1e6, cpu / done * 1e6);
    lwio_close(fd);
    lwio_disconnect(c);
    return 0;
}
