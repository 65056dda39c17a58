/* liblwio from C: a failed lwio_publish leaves the buffer the caller's
 * (issue 31). Before the fix the library had moved the buffer into the
 * publish call, and every error after that (the name taken, an invalid
 * name, the per-session limit) unmapped it while the program still held
 * the pointer: the writes below crashed (SIGSEGV) and lwio_buf_free said
 * -EINVAL. Now every byte of it stays writable and readable after each
 * failure, it can still be published, and it is freed normally. scripts/
 * capi-tests.sh also runs this program built with -fsanitize=address.
 *
 *   publish_fail URL TOKEN_FILE FINGERPRINT SRVDIR [poll]
 *
 * Prints "ok - ..." per check; exits 1 at the first failure. */
#define _GNU_SOURCE
#include "check.h"

/* Write a fresh pattern of `seed` into every byte of `mem` and read each
 * one back. */
static void use_every_byte(unsigned char *mem, size_t n, unsigned seed, const char *after) {
    unsigned char *want = malloc(n);
    CHECK(want != NULL, "malloc");
    fill(want, n, seed);
    for (size_t i = 0; i < n; i++) mem[i] = want[i];
    size_t i = 0;
    while (i < n && mem[i] == want[i]) i++;
    CHECK(i == n, "after %s: byte %zu reads %#x, wrote %#x", after, i, mem[i], want[i]);
    free(want);
    printf("ok - after %s all %zu bytes of the buffer are the program's\n", after, n);
}

int main(int argc, char **argv) {
    struct lwio_options o;
    test_options(&o, argc, argv);
    o.token_file = argv[2];
    struct lwio_client *a = lwio_connect(argv[1], &o);
    CHECK(a != NULL, "connect");

    char name[64];
    snprintf(name, sizeof name, "c-taken-%d", (int)getpid());
    size_t n1 = 64 << 10;
    unsigned char *first = lwio_buf_alloc(a, n1);
    CHECK(first != NULL, "buf_alloc first");
    int64_t id = lwio_publish(a, name, first, 0, NULL, 0);
    CHECK(id >= 1, "publish %s: %" PRId64, name, id);

    /* A second buffer under the same name: refused, the name is taken. */
    size_t n = (1u << 20) + 3;
    unsigned char *mem = lwio_buf_alloc(a, n);
    CHECK(mem != NULL, "buf_alloc");
    fill(mem, n, 5);
    char path[256] = "untouched";
    int64_t r = lwio_publish(a, name, mem, 0, path, sizeof path);
    CHECK(r < 0, "publishing a taken name succeeded: %" PRId64, r);
    CHECK(strstr(lwio_errmsg(), "already published") != NULL, "message: %s", lwio_errmsg());
    CHECK(!strcmp(path, "untouched"), "a failed publish wrote the path: %s", path);
    printf("ok - a taken name is refused: %" PRId64 " (%s)\n", r, lwio_errmsg());
    use_every_byte(mem, n, 7, "a refused publish (name taken)");

    /* An invalid name, refused by the library itself. */
    CHECK(lwio_publish(a, "a/b", mem, 0, NULL, 0) == -EINVAL, "an invalid name");
    use_every_byte(mem, n, 8, "a refused publish (invalid name)");

    /* Still a buffer of the client: it publishes under a free name, comes
     * back on unpublish, with the bytes the program wrote. */
    unsigned char *copy = malloc(n);
    CHECK(copy != NULL, "malloc");
    memcpy(copy, mem, n);
    char other[80];
    snprintf(other, sizeof other, "%s-2", name);
    int64_t id2 = lwio_publish(a, other, mem, LWIO_MEM_READ_ONLY, path, sizeof path);
    CHECK(id2 >= 1, "publish under a free name: %" PRId64, id2);
    CHECK(lwio_buf_free(mem) == -EBUSY, "a published buffer is not freed");
    CHECK(lwio_unpublish(id2) == 0, "unpublish");
    CHECK(!memcmp(mem, copy, n), "the buffer changed while published read-only");
    free(copy);
    printf("ok - the buffer publishes after the failures (%s)\n", path);

    CHECK(lwio_buf_free(mem) == 0, "free the buffer of the refused publishes");
    CHECK(lwio_unpublish(id) == 0, "unpublish the first");
    CHECK(lwio_buf_free(first) == 0, "free the first");
    CHECK(lwio_disconnect(a) == 0, "disconnect");
    printf("ok - %d checks (a failed publish keeps the buffer)\n", checks);
    return 0;
}
