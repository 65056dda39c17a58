/* mix.c - descriptors shared the ways programs share them, on a file of an
 * lwio mount under liblwio_preload.so: dup, dup2, fork, exec, O_APPEND and
 * mmap mixed with read and write. Every step checks the bytes and the
 * offset the kernel would give; the final content is written to EXPECT so
 * that the script can compare the file read without the preload.
 *
 * usage: mix FILE EXPECT          (exec'd as: mix --exec-child FD)      */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#define FAIL(...) do { fprintf(stderr, "mix: FAIL line %d: ", __LINE__); fprintf(stderr, __VA_ARGS__); fprintf(stderr, "\n"); exit(1); } while (0)

static char want[1 << 16];
static size_t want_len;

static void fill(char *p, size_t n, char c) {
  for (size_t i = 0; i < n; i++) p[i] = (char)(c + (i % 7));
}

static void put(int fd, char c, size_t n, const char *how) {
  char buf[8192];
  fill(buf, n, c);
  off_t at = lseek(fd, 0, SEEK_CUR);
  ssize_t r = write(fd, buf, n);
  if (r != (ssize_t)n) FAIL("%s: write %zd: %s", how, r, strerror(errno));
  memcpy(want + at, buf, n);
  if ((size_t)at + n > want_len) want_len = at + n;
}

static void check_all(int fd, const char *when) {
  static char got[1 << 16];
  ssize_t r = pread(fd, got, sizeof got, 0);
  if (r != (ssize_t)want_len) FAIL("%s: pread %zd bytes, want %zu", when, r, want_len);
  if (memcmp(got, want, want_len)) FAIL("%s: content differs", when);
  struct stat st;
  if (fstat(fd, &st) || st.st_size != (off_t)want_len)
    FAIL("%s: fstat size %lld, want %zu", when, (long long)st.st_size, want_len);
}

static off_t pos(int fd) { return lseek(fd, 0, SEEK_CUR); }

int main(int argc, char **argv) {
  if (argc == 3 && !strcmp(argv[1], "--exec-child")) {
    /* A new program image with an inherited descriptor. */
    int fd = atoi(argv[2]);
    char b[2000], e[2000];
    fill(e, sizeof e, 'D');
    if (pread(fd, b, sizeof b, 16000) != (ssize_t)sizeof b || memcmp(b, e, sizeof b))
      FAIL("exec child: D not seen at 16000");
    if (pos(fd) != 18000) FAIL("exec child: offset %lld, want 18000", (long long)pos(fd));
    fill(e, 1000, 'E');
    if (write(fd, e, 1000) != 1000) FAIL("exec child: write");
    return 0;
  }
  if (argc != 3) { fprintf(stderr, "usage: mix FILE EXPECT\n"); return 2; }
  const char *path = argv[1];
  int fd = open(path, O_RDWR | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) FAIL("open: %s", strerror(errno));
  put(fd, 'A', 8192, "first");
  put(fd, 'a', 1808, "second");
  if (pos(fd) != 10000) FAIL("offset %lld after 10000 bytes", (long long)pos(fd));

  int fd2 = dup(fd);
  put(fd2, 'B', 5000, "dup");
  if (pos(fd) != 15000) FAIL("dup: offsets not shared (%lld)", (long long)pos(fd));
  if (dup2(fd, 10) != 10) FAIL("dup2");
  put(10, 'C', 1000, "dup2");
  int fd3 = fcntl(fd, F_DUPFD_CLOEXEC, 20);
  if (fd3 < 20 || pos(fd3) != 16000) FAIL("F_DUPFD_CLOEXEC");
  check_all(fd3, "after dups");

  pid_t pid = fork();
  if (pid == 0) {
    char b[2000];
    fill(b, sizeof b, 'D');
    if (write(fd, b, sizeof b) != (ssize_t)sizeof b) _exit(3);
    _exit(0);
  }
  int st;
  if (waitpid(pid, &st, 0) != pid || !WIFEXITED(st) || WEXITSTATUS(st)) FAIL("fork child");
  fill(want + 16000, 2000, 'D');
  want_len = 18000;
  if (pos(fd) != 18000) FAIL("fork: offset %lld, want 18000", (long long)pos(fd));
  check_all(fd, "after fork");

  pid = fork();
  if (pid == 0) {
    char n[16];
    snprintf(n, sizeof n, "%d", fd);
    execl("/proc/self/exe", argv[0], "--exec-child", n, (char *)NULL);
    _exit(4);
  }
  if (waitpid(pid, &st, 0) != pid || !WIFEXITED(st) || WEXITSTATUS(st)) FAIL("exec child");
  fill(want + 18000, 1000, 'E');
  want_len = 19000;
  check_all(fd, "after exec");

  int fa = open(path, O_WRONLY | O_APPEND);
  if (fa < 0) FAIL("open O_APPEND");
  lseek(fa, 0, SEEK_SET); /* appends go to the end all the same */
  char f[500];
  fill(f, sizeof f, 'F');
  if (write(fa, f, sizeof f) != (ssize_t)sizeof f) FAIL("append");
  memcpy(want + 19000, f, sizeof f);
  want_len = 19500;
  check_all(fd, "after O_APPEND");
  /* Appends through the mount (the preload leaves O_APPEND descriptors to
   * it), each read back at once through the preload's descriptor, which
   * reads from the server over its own connection: the mount must have the
   * write on the server before the write returns (it once answered first,
   * and a read here missed the append about one time in twenty). */
  for (int i = 0; i < 200; i++) {
    char g[100];
    fill(g, sizeof g, (char)('a' + i % 20));
    if (write(fa, g, sizeof g) != (ssize_t)sizeof g) FAIL("append %d", i);
    memcpy(want + want_len, g, sizeof g);
    want_len += sizeof g;
    char back[100];
    if (pread(fd, back, sizeof back, (off_t)(want_len - sizeof g)) != (ssize_t)sizeof back ||
        memcmp(back, g, sizeof g))
      FAIL("append %d: not read back at once through the other descriptor", i);
  }
  check_all(fd, "after the appends");

  /* A mapping sees what was written, and read/write see the mapping. */
  char *m = mmap(NULL, want_len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (m == MAP_FAILED) FAIL("mmap: %s", strerror(errno));
  if (memcmp(m, want, want_len)) FAIL("mapping differs from what was written");
  memset(m, 'G', 100);
  memset(want, 'G', 100);
  if (msync(m, want_len, MS_SYNC)) FAIL("msync");
  check_all(fd, "after writing the mapping");
  char h[100];
  memset(h, 'H', sizeof h);
  if (pwrite(fd, h, sizeof h, 200) != (ssize_t)sizeof h) FAIL("pwrite after mmap");
  memcpy(want + 200, h, sizeof h);
  if (memcmp(m + 200, h, sizeof h)) FAIL("the mapping does not see a later pwrite");
  munmap(m, want_len);
  check_all(fd, "after munmap");

  close(fa); close(fd3); close(10); close(fd2);
  if (fsync(fd)) FAIL("fsync");
  close(fd);
  FILE *out = fopen(argv[2], "w");
  if (!out || fwrite(want, 1, want_len, out) != want_len || fclose(out)) FAIL("writing %s", argv[2]);
  printf("mix: ok (%zu bytes: dup, dup2, F_DUPFD, fork, exec, O_APPEND, mmap)\n", want_len);
  return 0;
}
