/* What the C test programs of scripts/capi-tests.sh share: CHECK, a byte
 * pattern, the server's own copy of a file, and the options from the
 * command line (URL TOKEN_FILE FINGERPRINT SRVDIR [poll]). */
#ifndef LWIO_TEST_CHECK_H
#define LWIO_TEST_CHECK_H

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <lwio.h>

static int checks;

#define CHECK(cond, ...)                                                     \
    do {                                                                     \
        if (!(cond)) {                                                       \
            fprintf(stderr, "FAIL line %d: ", __LINE__);                     \
            fprintf(stderr, __VA_ARGS__);                                    \
            fprintf(stderr, " (lwio_errmsg: %s)\n", lwio_errmsg());          \
            exit(1);                                                         \
        }                                                                    \
        checks++;                                                            \
    } while (0)

/* `n` bytes of a xorshift pattern of `seed`. */
static inline void fill(unsigned char *b, size_t n, unsigned seed) {
    uint32_t x = seed * 2654435761u + 1;
    for (size_t i = 0; i < n; i++) {
        x ^= x << 13; x ^= x >> 17; x ^= x << 5;
        b[i] = (unsigned char)x;
    }
}

/* The server's copy, read with the kernel's pread. */
static inline void server_read(const char *dir, const char *name, void *buf, size_t n, off_t off) {
    char p[4096];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    int fd = open(p, O_RDONLY);
    CHECK(fd >= 0, "open %s: %s", p, strerror(errno));
    ssize_t got = pread(fd, buf, n, off);
    CHECK(got == (ssize_t)n, "server pread %s: %zd of %zu", p, got, n);
    close(fd);
}

/* Options from the command line: the fingerprint to pin and the completion
 * mode ("poll" or interrupt); exits 2 with the usage line if arguments are
 * missing. */
static inline void test_options(struct lwio_options *o, int argc, char **argv) {
    if (argc < 5) {
        fprintf(stderr, "usage: %s URL TOKEN_FILE FINGERPRINT SRVDIR [poll]\n", argv[0]);
        exit(2);
    }
    lwio_options_init(o);
    o->fingerprint = argv[3];
    o->completion = argc > 5 && !strcmp(argv[5], "poll") ? LWIO_COMPLETION_POLL
                                                          : LWIO_COMPLETION_INTERRUPT;
}

#endif
