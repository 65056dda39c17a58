/* liblwio from C: byte-exact reads and writes against the server's own
 * file (pread on SRVDIR), odd offsets, past 4 GiB, vectored calls, 64
 * batch operations in flight, registered buffers, and the exact error of
 * each bad call. Run by scripts/capi-tests.sh:
 *
 *   basic URL TOKEN_FILE FINGERPRINT SRVDIR [poll]
 *
 * Prints "ok - ..." per check; exits 1 at the first failure. */
#define _GNU_SOURCE
#include <sys/epoll.h>

#include "check.h"

int main(int argc, char **argv) {
    struct lwio_options o;
    test_options(&o, argc, argv);
    const char *url = argv[1], *srv = argv[4];

    /* A wrong token: NULL and a message, nothing connected. */
    o.token = "wrong-token-0123456789abcdef0123";
    CHECK(lwio_connect(url, &o) == NULL, "connected with a wrong token");
    CHECK(strstr(lwio_errmsg(), "token") || strstr(lwio_errmsg(), "authentication"),
          "wrong-token message: %s", lwio_errmsg());
    printf("ok - wrong token refused: %s\n", lwio_errmsg());
    o.token = NULL;
    o.token_file = argv[2];
    struct lwio_client *c = lwio_connect(url, &o);
    CHECK(c != NULL, "connect %s", url);

    /* Missing file without O_CREAT. */
    CHECK(lwio_open(c, "nope.bin", O_RDONLY, 0) == -ENOENT, "open of a missing file");

    int fd = lwio_open(c, "c-test.bin", O_RDWR | O_CREAT | O_TRUNC, 0644);
    CHECK(fd >= 0, "open c-test.bin: %d", fd);

    /* 5 MiB + 123 written, then read back by lwio and by the server. */
    size_t n = (5u << 20) + 123;
    unsigned char *w = malloc(n), *r = malloc(n), *s = malloc(n);
    fill(w, n, 1);
    CHECK(lwio_pwrite(fd, w, n, 0) == (int64_t)n, "pwrite 5 MiB");
    memset(r, 0, n);
    CHECK(lwio_pread(fd, r, n, 0) == (int64_t)n, "pread 5 MiB");
    CHECK(!memcmp(r, w, n), "5 MiB read back differs");
    server_read(srv, "c-test.bin", s, n, 0);
    CHECK(!memcmp(s, w, n), "the server's copy differs");
    printf("ok - 5 MiB + 123 byte-exact through lwio and on the server\n");

    /* Odd offsets, and past 4 GiB (a sparse file). */
    CHECK(lwio_pwrite(fd, "middle", 6, 1000003) == 6, "pwrite at an odd offset");
    uint64_t far = (4ull << 30) + 17;
    fill(w, 4096, 2);
    CHECK(lwio_pwrite(fd, w, 4096, far) == 4096, "pwrite past 4 GiB");
    CHECK(lwio_pread(fd, r, 4096, far) == 4096 && !memcmp(r, w, 4096), "pread past 4 GiB");
    server_read(srv, "c-test.bin", s, 4096, (off_t)far);
    CHECK(!memcmp(s, w, 4096), "the server's copy past 4 GiB differs");
    CHECK(lwio_pread(fd, r, 100, far + 4090) == 6, "a read across the end is short");
    CHECK(lwio_pread(fd, r, 100, far + 5000) == 0, "a read past the end is 0");
    server_read(srv, "c-test.bin", s, 6, 1000003);
    CHECK(!memcmp(s, "middle", 6), "odd-offset write on the server");
    struct lwio_stat st;
    CHECK(lwio_fstat(fd, &st) == 0 && st.size == far + 4096, "fstat size %" PRIu64, st.size);
    printf("ok - odd offsets, past 4 GiB, short reads at the end, fstat\n");

    /* Vectored. */
    char a[3] = "abc", b[5] = "12345", ra[3], rb[5];
    struct lwio_iovec wv[2] = {{a, 3}, {b, 5}}, rv[2] = {{ra, 3}, {rb, 5}};
    CHECK(lwio_pwritev(fd, wv, 2, 77) == 8, "pwritev");
    CHECK(lwio_preadv(fd, rv, 2, 77) == 8 && !memcmp(ra, a, 3) && !memcmp(rb, b, 5), "preadv");
    printf("ok - preadv/pwritev\n");

    /* 64 batch reads in flight, then 64 batch writes, each byte-exact. */
    fill(w, n, 1);
    memcpy(w + 77, "abc12345", 8);
    memcpy(w + 1000003, "middle", 6);
    enum { Q = 64, BS = 4096 };
    struct lwio_op ops[Q];
    struct lwio_cqe cq[Q];
    /* Registered memory: reads land in it directly, so all 64 fit in
     * flight (staged reads into plain memory are bounded by the staging
     * buffers: see the loop after). */
    unsigned char *bufs = lwio_buf_alloc(c, Q * BS);
    CHECK(bufs != NULL, "buf_alloc for the batch");
    for (int i = 0; i < Q; i++) {
        ops[i] = (struct lwio_op){.user_data = 1000 + i, .fd = fd, .opcode = LWIO_OP_READ,
                                  .buf = bufs + i * BS, .len = BS, .offset = (uint64_t)i * 65537};
    }
    CHECK(lwio_submit(c, ops, Q) == Q, "submit 64 reads");
    int got = 0;
    while (got < Q) {
        int k = lwio_reap(c, cq + got, 1, Q - got);
        CHECK(k >= 1, "reap: %d", k);
        got += k;
    }
    for (int i = 0; i < Q; i++) {
        CHECK(cq[i].user_data == 1000u + i && cq[i].res == BS, "cqe %d: %" PRIu64 " %" PRId64, i,
              cq[i].user_data, cq[i].res);
        CHECK(!memcmp(bufs + i * BS, w + i * 65537, BS), "batch read %d differs", i);
    }
    /* Into plain memory (staged): submit what fits, reap, go on. */
    unsigned char *plain = calloc(Q, 512);
    int sub = 0, rep = 0, peak = 0;
    for (int i = 0; i < Q; i++) {
        ops[i] = (struct lwio_op){.user_data = i, .fd = fd, .opcode = LWIO_OP_READ,
                                  .buf = plain + i * 512, .len = 512, .offset = (uint64_t)i * 7919};
    }
    while (rep < Q) {
        if (sub < Q) {
            int k = lwio_submit(c, ops + sub, Q - sub);
            CHECK(k > 0 || (k == -EAGAIN && sub > rep), "submit: %d", k);
            if (k > 0) sub += k;
        }
        if (sub - rep > peak) peak = sub - rep;
        int k = lwio_reap(c, cq + rep, 1, sub - rep);
        CHECK(k >= 1, "reap: %d", k);
        rep += k;
    }
    for (int i = 0; i < Q; i++) {
        CHECK(cq[i].user_data == (uint64_t)i && cq[i].res == 512, "staged cqe %d", i);
        CHECK(!memcmp(plain + i * 512, w + i * 7919, 512), "staged read %d differs", i);
    }
    printf("ok - 64 staged reads into plain memory, up to %d in flight\n", peak);
    free(plain);
    for (int i = 0; i < Q; i++) {
        ops[i] = (struct lwio_op){.user_data = 1000 + i, .fd = fd, .opcode = LWIO_OP_READ,
                                  .buf = bufs + i * BS, .len = BS, .offset = (uint64_t)i * 65537};
    }
    for (int i = 0; i < Q; i++) {
        fill(bufs + i * BS, BS, 100 + i);
        ops[i].opcode = LWIO_OP_WRITE;
        ops[i].offset = (6u << 20) + (uint64_t)i * BS;
    }
    CHECK(lwio_submit(c, ops, Q) == Q, "submit 64 writes");
    CHECK(lwio_reap(c, cq, Q, Q) == Q, "reap 64 writes");
    for (int i = 0; i < Q; i++) {
        CHECK(cq[i].res == BS, "write cqe %d: %" PRId64, i, cq[i].res);
        server_read(srv, "c-test.bin", s, BS, (6 << 20) + i * BS);
        CHECK(!memcmp(s, bufs + i * BS, BS), "batch write %d differs on the server", i);
    }
    CHECK(lwio_reap(c, cq, 0, Q) == 0, "nothing left to reap");
    printf("ok - 64 reads and 64 writes in flight, byte-exact\n");

    /* Sleep in epoll until completions come (interrupt mode), reap them
     * without blocking. */
    int cfd = lwio_completion_fd(c);
    if (o.completion == LWIO_COMPLETION_POLL) {
        CHECK(cfd == -EINVAL, "completion fd in poll mode: %d", cfd);
    } else {
        CHECK(cfd >= 0, "completion fd: %d", cfd);
        CHECK(lwio_completion_fd(c) == cfd, "the same fd again");
        int ep = epoll_create1(EPOLL_CLOEXEC);
        struct epoll_event ev = {.events = EPOLLIN, .data.fd = cfd};
        CHECK(ep >= 0 && epoll_ctl(ep, EPOLL_CTL_ADD, cfd, &ev) == 0, "epoll on the fd");
        for (int i = 0; i < 16; i++) {
            ops[i] = (struct lwio_op){.user_data = 500 + i, .fd = fd, .opcode = LWIO_OP_READ,
                                      .buf = bufs + i * BS, .len = BS, .offset = (uint64_t)i * 4099};
        }
        CHECK(lwio_submit(c, ops, 16) == 16, "submit 16 reads");
        int have = 0, sleeps = 0;
        while (have < 16) {
            struct epoll_event out;
            int k = epoll_wait(ep, &out, 1, 10000);
            CHECK(k == 1, "epoll_wait: %d (completions never signalled)", k);
            uint64_t cnt;
            CHECK(read(cfd, &cnt, 8) == 8 && cnt >= 1, "eventfd read");
            sleeps++;
            int r = lwio_reap(c, cq + have, 0, 16 - have);
            CHECK(r >= 0, "reap after epoll: %d", r);
            have += r;
        }
        for (int i = 0; i < 16; i++) {
            CHECK(cq[i].user_data == 500u + i && cq[i].res == BS &&
                      !memcmp(bufs + i * BS, w + i * 4099, BS),
                  "epoll-reaped read %d", i);
        }
        close(ep);
        printf("ok - completion fd: 16 reads reaped after %d epoll wake-ups\n", sleeps);
    }
    CHECK(lwio_buf_free(bufs) == 0, "free the batch buffer");

    /* Registered buffer: a 1 MiB read lands in it. */
    unsigned char *rb1 = lwio_buf_alloc(c, 1 << 20);
    CHECK(rb1 != NULL, "buf_alloc");
    CHECK(lwio_pread(fd, rb1, 1 << 20, 4096) == (1 << 20) && !memcmp(rb1, w + 4096, 1 << 20),
          "pread into a registered buffer");
    CHECK(lwio_pread(fd, rb1 + 100, 5000, 8192) == 5000 && !memcmp(rb1 + 100, w + 8192, 5000),
          "pread into the middle of a registered buffer");
    CHECK(lwio_buf_free(rb1) == 0, "buf_free");
    CHECK(lwio_buf_free(rb1) == -EINVAL, "double buf_free");
    printf("ok - registered buffer\n");

    /* ftruncate, fsync. */
    CHECK(lwio_ftruncate(fd, 1 << 20) == 0, "ftruncate");
    CHECK(lwio_fstat(fd, &st) == 0 && st.size == 1 << 20, "size after ftruncate");
    CHECK(lwio_fsync(fd, 0) == 0 && lwio_fsync(fd, 1) == 0, "fsync, fdatasync");

    /* Bad calls: the exact errno, nothing written. */
    CHECK(lwio_pread(fd, NULL, 10, 0) == -EFAULT, "NULL buffer");
    CHECK(lwio_pwrite(fd, NULL, 10, 0) == -EFAULT, "NULL buffer (write)");
    CHECK(lwio_pwrite(fd, w, 10, UINT64_MAX - 5) == -EINVAL, "offset overflow");
    CHECK(lwio_fstat(fd, NULL) == -EFAULT, "NULL stat");
    CHECK(lwio_open(c, NULL, O_RDONLY, 0) == -EFAULT, "NULL path");
    struct lwio_op bad = {.fd = 999, .opcode = LWIO_OP_READ, .buf = r, .len = 1};
    CHECK(lwio_submit(c, &bad, 1) == -EBADF, "submit on a bad fd");
    CHECK(lwio_close(fd) == 0, "close");
    CHECK(lwio_close(fd) == -EBADF, "double close");
    CHECK(lwio_pread(fd, r, 10, 0) == -EBADF, "read after close");
    server_read(srv, "c-test.bin", s, 10, 0);
    CHECK(!memcmp(s, w, 10), "nothing written by the refused calls");
    printf("ok - bad calls: EFAULT, EINVAL, EBADF, nothing written\n");

    /* Read-only opens refuse writes. */
    fd = lwio_open(c, "c-test.bin", O_RDONLY, 0);
    CHECK(fd >= 0, "reopen read-only");
    int64_t e = lwio_pwrite(fd, "x", 1, 0);
    CHECK(e < 0, "write to a read-only open: %" PRId64, e);
    server_read(srv, "c-test.bin", s, 1, 0);
    CHECK(s[0] == w[0], "the refused write changed nothing");
    printf("ok - read-only open refuses writes (%" PRId64 ")\n", e);

    /* Disconnect closes the client's files; the client is then gone. */
    CHECK(lwio_disconnect(c) == 0, "disconnect");
    CHECK(lwio_pread(fd, r, 1, 0) == -EBADF, "file of a disconnected client");
    CHECK(lwio_open(c, "c-test.bin", O_RDONLY, 0) == -EBADF, "a disconnected client");
    CHECK(lwio_disconnect(c) == -EBADF, "double disconnect");
    printf("ok - disconnect\n");
    printf("basic: %d checks passed\n", checks);
    free(w); free(r); free(s);
    return 0;
}
