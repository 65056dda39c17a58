/* aio.c - POSIX AIO on a file of an lwio mount under liblwio_preload.so,
 * with the C library's semantics as the referee: 96 writes in flight at
 * once (more than the connection's credits), reads of every size class (a
 * page, 1 MiB in several requests, one across the end of the file, one
 * past it), aio_suspend with and without a timeout, SIGEV_SIGNAL
 * notification, aio_fsync, aio_cancel of finished requests, aio_return's
 * one-shot result, and the errors of bad requests (a negative offset).
 * Every byte is checked against what was written.
 *
 * usage: aio FILE                                                    */
#define _GNU_SOURCE
#include <aio.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define FAIL(...) do { fprintf(stderr, "aio: FAIL line %d: ", __LINE__); fprintf(stderr, __VA_ARGS__); fprintf(stderr, "\n"); exit(1); } while (0)

#define NW 96
#define PAGE 4096
#define SIZE ((size_t)NW * PAGE + 1000) /* the last write is short */

static unsigned char want[SIZE];
static volatile sig_atomic_t signals;

static void on_usr1(int sig, siginfo_t *si, void *uc) {
  (void)sig; (void)uc;
  if (si->si_value.sival_int == 4242) signals++;
}

/* Wait for one request: aio_suspend until aio_error leaves EINPROGRESS. */
static ssize_t finish(struct aiocb *cb, const char *what) {
  const struct aiocb *l[1] = {cb};
  int e;
  while ((e = aio_error(cb)) == EINPROGRESS) {
    struct timespec t = {10, 0};
    if (aio_suspend(l, 1, &t) && errno != EINTR) FAIL("%s: aio_suspend: %s", what, strerror(errno));
  }
  ssize_t r = aio_return(cb);
  if (e && r != -1) FAIL("%s: aio_error %d but aio_return %zd", what, e, r);
  if (!e && r < 0) FAIL("%s: aio_return %zd with aio_error 0", what, r);
  errno = e;
  return r;
}

static void read_check(int fd, off_t off, size_t len, size_t expect, const char *what) {
  unsigned char *b = malloc(len + 1);
  if (!b) FAIL("malloc");
  memset(b, 0xEE, len + 1);
  struct aiocb cb = {.aio_fildes = fd, .aio_buf = b, .aio_nbytes = len, .aio_offset = off};
  if (aio_read(&cb)) FAIL("%s: aio_read: %s", what, strerror(errno));
  ssize_t r = finish(&cb, what);
  if (r != (ssize_t)expect) FAIL("%s: read %zd bytes, want %zu (%s)", what, r, expect, strerror(errno));
  if (expect && memcmp(b, want + off, expect)) FAIL("%s: bytes differ", what);
  if (b[len] != 0xEE) FAIL("%s: wrote past the buffer", what);
  for (size_t i = expect; i < len; i++)
    if (b[i] != 0xEE) FAIL("%s: wrote past the bytes read, at %zu", what, i);
  free(b);
}

int main(int argc, char **argv) {
  if (argc != 2) FAIL("usage: aio FILE");
  int fd = open(argv[1], O_RDWR | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) FAIL("open %s: %s", argv[1], strerror(errno));
  for (size_t i = 0; i < SIZE; i++) want[i] = (unsigned char)(i * 2654435761u >> 13);

  /* 96 writes in flight at once, in reverse order. */
  static struct aiocb w[NW];
  for (int i = NW - 1; i >= 0; i--) {
    size_t len = i == NW - 1 ? SIZE - (size_t)i * PAGE : PAGE;
    w[i] = (struct aiocb){.aio_fildes = fd, .aio_buf = want + (size_t)i * PAGE, .aio_nbytes = len,
                          .aio_offset = (off_t)i * PAGE};
    if (aio_write(&w[i])) FAIL("aio_write %d: %s", i, strerror(errno));
  }
  for (int i = 0; i < NW; i++) {
    ssize_t r = finish(&w[i], "write");
    if (r != (ssize_t)w[i].aio_nbytes) FAIL("write %d: %zd bytes (%s)", i, r, strerror(errno));
  }
  /* aio_return is one-shot: the request is no longer known afterwards
   * (the C library's answer for an unknown control block, not ours). */
  int c = aio_cancel(fd, &w[0]);
  if (c != AIO_ALLDONE && !(c == -1 && errno == EINVAL))
    FAIL("aio_cancel of a finished request: %d (%s)", c, strerror(errno));

  struct aiocb s = {.aio_fildes = fd};
  if (aio_fsync(O_SYNC, &s)) FAIL("aio_fsync: %s", strerror(errno));
  if (finish(&s, "fsync") != 0) FAIL("aio_fsync: %s", strerror(errno));

  /* Reads of every size class, 48 in flight at once for the pages. */
  static struct aiocb r[48];
  static unsigned char rb[48][PAGE];
  for (int i = 0; i < 48; i++) {
    r[i] = (struct aiocb){.aio_fildes = fd, .aio_buf = rb[i], .aio_nbytes = PAGE,
                          .aio_offset = (off_t)((i * 37) % (NW - 1)) * PAGE + 123};
    if (aio_read(&r[i])) FAIL("aio_read %d: %s", i, strerror(errno));
  }
  const struct aiocb *all[48];
  for (int i = 0; i < 48; i++) all[i] = &r[i];
  int left = 48;
  while (left) {
    struct timespec t = {10, 0};
    if (aio_suspend(all, 48, &t) && errno != EINTR) FAIL("aio_suspend(48): %s", strerror(errno));
    for (int i = 0; i < 48; i++) {
      if (!all[i] || aio_error(&r[i]) == EINPROGRESS) continue;
      if (aio_return(&r[i]) != PAGE) FAIL("read %d short", i);
      if (memcmp(rb[i], want + r[i].aio_offset, PAGE)) FAIL("read %d: bytes differ", i);
      all[i] = NULL;
      left--;
    }
  }
  read_check(fd, 0, (size_t)1 << 20, (size_t)1 << 20 < SIZE ? (size_t)1 << 20 : SIZE, "1 MiB");
  read_check(fd, 7, SIZE - 7, SIZE - 7, "all but 7 bytes, odd offset");
  read_check(fd, SIZE - 100, 5000, 100, "across the end");
  read_check(fd, SIZE + 10, 4096, 0, "past the end");

  /* A zero timeout on a request in flight or done: 0, or EAGAIN. */
  struct aiocb z = {.aio_fildes = fd, .aio_buf = rb[0], .aio_nbytes = PAGE, .aio_offset = 0};
  if (aio_read(&z)) FAIL("aio_read z: %s", strerror(errno));
  const struct aiocb *zl[1] = {&z};
  struct timespec zero = {0, 0};
  if (aio_suspend(zl, 1, &zero) && errno != EAGAIN) FAIL("aio_suspend(0): %s", strerror(errno));
  if (finish(&z, "z") != PAGE || memcmp(rb[0], want, PAGE)) FAIL("z: bytes differ");

  /* SIGEV_SIGNAL: the program's signal, with its value. */
  struct sigaction sa = {.sa_sigaction = on_usr1, .sa_flags = SA_SIGINFO};
  sigemptyset(&sa.sa_mask);
  if (sigaction(SIGUSR1, &sa, NULL)) FAIL("sigaction");
  struct aiocb g = {.aio_fildes = fd, .aio_buf = rb[1], .aio_nbytes = PAGE, .aio_offset = PAGE};
  g.aio_sigevent.sigev_notify = SIGEV_SIGNAL;
  g.aio_sigevent.sigev_signo = SIGUSR1;
  g.aio_sigevent.sigev_value.sival_int = 4242;
  if (aio_read(&g)) FAIL("aio_read with a signal: %s", strerror(errno));
  if (finish(&g, "signal") != PAGE || memcmp(rb[1], want + PAGE, PAGE)) FAIL("signal read: bytes differ");
  for (int i = 0; i < 1000 && !signals; i++) usleep(10000);
  if (signals != 1) FAIL("SIGEV_SIGNAL: %d signals, want 1", (int)signals);

  /* Bad requests: the errors the C library gives. */
  struct aiocb bad = {.aio_fildes = fd, .aio_buf = rb[2], .aio_nbytes = PAGE, .aio_offset = -4096};
  if (aio_read(&bad) == 0) {
    if (finish(&bad, "negative offset") != -1 || errno != EINVAL)
      FAIL("negative offset: not EINVAL (%s)", strerror(errno));
  } else if (errno != EINVAL) FAIL("negative offset: aio_read %s", strerror(errno));

  if (close(fd)) FAIL("close");
  printf("ok (%zu bytes; %d writes and %d reads in flight at once)\n", SIZE, NW, 48);
  return 0;
}
