/* liblwio from C: memory objects (docs/memory-objects.md). One client
 * publishes a registered buffer; a second reads it by path byte for byte
 * and writes a range, which the publisher sees in its buffer; a read-only
 * object refuses writers; unpublishing removes the path. Run by
 * scripts/capi-tests.sh:
 *
 *   publish URL TOKEN_FILE FINGERPRINT SRVDIR [poll]
 *
 * Prints "ok - ..." per check; exits 1 at the first failure. */
#define _GNU_SOURCE
#include "check.h"

int main(int argc, char **argv) {
    struct lwio_options o;
    test_options(&o, argc, argv);
    o.token_file = argv[2];
    const char *url = argv[1];
    struct lwio_client *a = lwio_connect(url, &o);
    CHECK(a != NULL, "connect publisher");
    struct lwio_client *b = lwio_connect(url, &o);
    CHECK(b != NULL, "connect reader");

    /* A publishes 16 MiB + 5 of registered memory, read-write. */
    size_t n = (16u << 20) + 5;
    unsigned char *mem = lwio_buf_alloc(a, n);
    CHECK(mem != NULL, "buf_alloc");
    fill(mem, n, 3);
    unsigned char *want = malloc(n), *r = malloc(n);
    memcpy(want, mem, n);
    char path[256];
    char name[64];
    snprintf(name, sizeof name, "c-obj-%d", (int)getpid());
    int64_t id = lwio_publish(a, name, mem, 0, path, sizeof path);
    CHECK(id >= 1, "publish: %" PRId64, id);
    char expect[128];
    snprintf(expect, sizeof expect, "data/.lwio-mem/%s", name);
    CHECK(!strcmp(path, expect), "path %s, want %s", path, expect);
    CHECK(lwio_buf_free(mem) == -EBUSY, "a published buffer is not freed");
    printf("ok - published %s\n", path);

    /* B reads it by path, byte for byte, and past the end. */
    char rel[128];
    snprintf(rel, sizeof rel, ".lwio-mem/%s", name);
    int fd = lwio_open(b, rel, O_RDWR, 0);
    CHECK(fd >= 0, "open %s: %d", rel, fd);
    struct lwio_stat st;
    CHECK(lwio_fstat(fd, &st) == 0 && st.size == n, "fstat size");
    memset(r, 0, n);
    CHECK(lwio_pread(fd, r, n, 0) == (int64_t)n, "pread all");
    CHECK(!memcmp(r, want, n), "bytes differ");
    CHECK(lwio_pread(fd, r, 100, n - 3) == 3, "short read at the end");
    CHECK(lwio_pread(fd, r, 100, n) == 0, "EOF at the end");
    printf("ok - read %zu bytes by path\n", n);

    /* B writes a range; A sees it in its own memory as soon as B's write
     * returns: the server answers a write only after an RDMA Read behind
     * its RDMA Write came back from A, and A places a Write before it
     * answers the Read after it (docs/memory-objects.md). No waiting. */
    unsigned char patch[70000];
    fill(patch, sizeof patch, 9);
    CHECK(lwio_pwrite(fd, patch, sizeof patch, 12345) == (int64_t)sizeof patch, "pwrite");
    memcpy(want + 12345, patch, sizeof patch);
    CHECK(!memcmp(mem, want, n), "the publisher's memory lacks the write when pwrite returned");
    CHECK(lwio_pwrite(fd, patch, 10, n - 5) == -ENOSPC, "write past the end: ENOSPC");
    CHECK(!memcmp(mem, want, n), "a refused write changed memory");
    printf("ok - writes land in the publisher's memory\n");

    /* Unpublish: the path is gone, the open file fails with ESTALE, the
     * buffer is the program's again. */
    CHECK(lwio_unpublish(id) == 0, "unpublish");
    CHECK(lwio_unpublish(id) == -EINVAL, "unpublish twice");
    CHECK(lwio_open(b, rel, O_RDONLY, 0) == -ENOENT, "open after unpublish");
    CHECK(lwio_pread(fd, r, 10, 0) == -ESTALE, "read after unpublish");
    CHECK(lwio_close(fd) == 0, "close");

    /* Read-only: writers are refused, memory unchanged. */
    id = lwio_publish(a, name, mem, LWIO_MEM_READ_ONLY, NULL, 0);
    CHECK(id >= 1, "publish read-only");
    CHECK(lwio_open(b, rel, O_RDWR, 0) == -EACCES, "read-write open of a read-only object");
    fd = lwio_open(b, rel, O_RDONLY, 0);
    CHECK(fd >= 0, "read-only open");
    CHECK(lwio_pwrite(fd, patch, 10, 0) < 0, "write through a read-only open");
    CHECK(!memcmp(mem, want, n), "memory changed");
    CHECK(lwio_publish(a, name, mem, 0, NULL, 0) < 0, "a buffer published twice");
    CHECK(lwio_close(fd) == 0, "close");
    /* Disconnecting unpublishes; the buffer stays the program's to free. */
    CHECK(lwio_disconnect(a) == 0, "disconnect publisher");
    CHECK(lwio_open(b, rel, O_RDONLY, 0) == -ENOENT, "open after the publisher left");
    CHECK(lwio_buf_free(mem) == 0, "free after disconnect");
    CHECK(lwio_disconnect(b) == 0, "disconnect reader");
    free(want);
    free(r);
    printf("ok - %d checks (memory objects)\n", checks);
    return 0;
}
