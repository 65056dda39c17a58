/* liblwio from C across a network blip: batch operations (lwio_submit /
 * lwio_reap) whose connection is cut complete anyway, byte for byte, after
 * the library reconnects (docs/reconnect.md). The blip is this process's
 * own TCP sockets shut down under the library (side channel and RDMA), as
 * a reset on the path would leave them. Run by scripts/capi-tests.sh:
 *
 *   reconnect URL TOKEN_FILE FINGERPRINT SRVDIR [poll]
 *
 * 1. Cut, then submit 8 writes and 8 reads: every request is lost, so each
 *    operation completes only by running again on the new connection.
 * 2. Submit 8 writes and 8 reads, then cut at once: those in flight are
 *    lost, the others done.
 * Each time every CQE is the full length, the reads equal the file and
 * the writes are on the server's disk. Prints "ok - ..." per check. */
#define _GNU_SOURCE
#include <dirent.h>
#include <sys/socket.h>

#include "check.h"

/* Shut down every connected TCP socket of this process (the library's):
 * how many. */
static int cut_all(void) {
    DIR *d = opendir("/proc/self/fd");
    CHECK(d != NULL, "opendir /proc/self/fd");
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        int fd = atoi(e->d_name);
        if (fd <= 2 || fd == dirfd(d)) continue;
        int type = 0;
        socklen_t tl = sizeof type;
        struct sockaddr_storage peer;
        socklen_t pl = sizeof peer;
        if (getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &tl) != 0 || type != SOCK_STREAM) continue;
        if (getpeername(fd, (struct sockaddr *)&peer, &pl) != 0) continue;
        if (peer.ss_family != AF_INET && peer.ss_family != AF_INET6) continue;
        if (shutdown(fd, SHUT_RDWR) == 0) n++;
    }
    closedir(d);
    return n;
}

enum { OPS = 8, BS = 64 * 1024, HALF = OPS * BS };

/* OPS writes of pattern `seed` to [0, HALF) and OPS reads of [HALF,
 * 2*HALF), submitted together; `cut_after` cuts right after submitting.
 * Checks every CQE, the reads against `file`, and the writes on the
 * server. */
static void round_trip(struct lwio_client *c, int fd, const char *srv, unsigned char *file,
                       unsigned char *buf, unsigned seed, int cut_after) {
    struct lwio_op ops[2 * OPS];
    struct lwio_cqe cq[2 * OPS];
    fill(buf, HALF, seed);
    memset(buf + HALF, 0, HALF);
    for (int i = 0; i < 2 * OPS; i++) {
        int rd = i >= OPS;
        ops[i] = (struct lwio_op){.user_data = 100u * seed + i,
                                  .fd = fd,
                                  .opcode = rd ? LWIO_OP_READ : LWIO_OP_WRITE,
                                  .buf = buf + (size_t)i * BS,
                                  .len = BS,
                                  .offset = (uint64_t)i * BS};
    }
    int k = lwio_submit(c, ops, 2 * OPS);
    CHECK(k == 2 * OPS, "submit %d operations: %d", 2 * OPS, k);
    if (cut_after) CHECK(cut_all() >= 1, "cut: no TCP socket to shut down");
    int got = 0;
    while (got < 2 * OPS) {
        int r = lwio_reap(c, cq + got, 1, 2 * OPS - got);
        CHECK(r >= 1, "reap: %d", r);
        got += r;
    }
    for (int i = 0; i < 2 * OPS; i++)
        CHECK(cq[i].user_data == 100u * seed + i && cq[i].res == BS,
              "cqe %d: user_data %" PRIu64 " res %" PRId64 " (%s)", i, cq[i].user_data, cq[i].res,
              cq[i].res < 0 ? strerror((int)-cq[i].res) : "short");
    CHECK(!memcmp(buf + HALF, file + HALF, HALF), "reads differ from the file");
    unsigned char *s = malloc(HALF);
    server_read(srv, "c-reconnect.bin", s, HALF, 0);
    CHECK(!memcmp(s, buf, HALF), "the server's copy of the writes differs");
    memcpy(file, buf, HALF);
    free(s);
}

int main(int argc, char **argv) {
    struct lwio_options o;
    test_options(&o, argc, argv);
    o.token_file = argv[2];
    const char *url = argv[1], *srv = argv[4];
    struct lwio_client *c = lwio_connect(url, &o);
    CHECK(c != NULL, "connect %s", url);
    int fd = lwio_open(c, "c-reconnect.bin", O_RDWR | O_CREAT | O_TRUNC, 0644);
    CHECK(fd >= 0, "open c-reconnect.bin: %d", fd);
    unsigned char *file = malloc(2 * HALF), *buf = malloc(2 * HALF);
    fill(file, 2 * HALF, 7);
    CHECK(lwio_pwrite(fd, file, 2 * HALF, 0) == 2 * HALF, "pwrite 1 MiB");

    int cut = cut_all();
    CHECK(cut >= 2, "cut %d TCP sockets (the side channel and the RDMA connection)", cut);
    round_trip(c, fd, srv, file, buf, 1, 0);
    printf("ok - %d operations submitted after a cut of %d sockets, all run again, byte-exact\n",
           2 * OPS, cut);

    round_trip(c, fd, srv, file, buf, 2, 1);
    printf("ok - %d operations cut in flight, all complete, byte-exact\n", 2 * OPS);

    /* And the plain calls go on on the new connection. */
    fill(buf, 4096, 3);
    CHECK(lwio_pwrite(fd, buf, 4096, 12345) == 4096, "pwrite after the blips");
    memcpy(file + 12345, buf, 4096);
    CHECK(lwio_pread(fd, buf, 2 * HALF, 0) == 2 * HALF, "pread after the blips");
    CHECK(!memcmp(buf, file, 2 * HALF), "the file after the blips differs");
    CHECK(lwio_close(fd) == 0, "close");
    CHECK(lwio_disconnect(c) == 0, "disconnect");
    free(file);
    free(buf);
    printf("ok - %d checks\n", checks);
    return 0;
}
