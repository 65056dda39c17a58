#!/usr/bin/env bash
# preload-tests.sh - unmodified programs under LD_PRELOAD=liblwio_preload.so
# on an `lwio mount`: dd, cat, cp, cmp, sha256sum, sqlite3 and fio
# (--verify=crc32c with psync, pvsync2 and posixaio), plus a C program that
# shares descriptors by dup, dup2, fork and exec and mixes O_APPEND and mmap
# with read and write (crates/preload/tests/c/mix.c). Each program's own
# check is the referee; its results must equal what the same program gives
# without the preload, and its exit report (LWIO_PRELOAD_REPORT) must show
# that the data calls were intercepted, not passed to the mount.
#
# usage: scripts/preload-tests.sh          env: LWIO (lwio binary), PRELOAD (.so)
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
if [ -z "${LWIO:-}" ] || [ -z "${PRELOAD:-}" ]; then
  cargo build -q -p lwio -p lwio-preload || exit 1
  LWIO=${LWIO:-${CARGO_TARGET_DIR:-$ROOT/target}/debug/lwio}
  PRELOAD=${PRELOAD:-${CARGO_TARGET_DIR:-$ROOT/target}/debug/liblwio_preload.so}
fi
for p in fusermount3 sqlite3 fio cc sha256sum cmp dd; do
  command -v "$p" >/dev/null || { echo "FAIL: $p is not installed (apt-get install fuse3 sqlite3 fio gcc)"; exit 1; }
done
[ -e /dev/fuse ] || { echo "FAIL: /dev/fuse is missing"; exit 1; }

W=$(mktemp -d /tmp/lwio-preload-tests.XXXXXX)
export HOME=$W/home LWIO_KNOWN_HOSTS=$W/known_hosts
mkdir -p "$HOME" "$W/export" "$W/mnt" "$W/mnt2" "$W/local"
SERVER_PID=
FAILS=0
cleanup() {
  for m in "$W/mnt" "$W/mnt2"; do
    mountpoint -q "$m" && { fusermount3 -u "$m" 2>/dev/null || fusermount3 -uz "$m"; }
  done
  [ -n "$SERVER_PID" ] && kill "$SERVER_PID" 2>/dev/null && wait "$SERVER_PID" 2>/dev/null
  if [ "${KEEP:-0}" = 1 ]; then echo "kept $W"; else rm -rf "$W"; fi
}
trap cleanup EXIT
pass() { echo "PASS $1"; }
fail() { echo "FAIL $1: $2"; FAILS=$((FAILS + 1)); }

. scripts/lib/serve.sh
serve_data "$W/export" "$W/serve.log" 3>&- || { echo "FAIL: server did not start"; exit 1; }
export LWIO_FINGERPRINT=$FP
"$LWIO" mount --daemon --log "$W/mount.log" "$URL" "$W/mnt" --provider soft ||
  { echo "FAIL: mount"; exit 1; }
"$LWIO" mount --daemon --log "$W/mount2.log" "$URL" "$W/mnt2" --provider soft -o nopreload ||
  { echo "FAIL: mount -o nopreload"; exit 1; }
M=$W/mnt

# Run a program under the preload; its report lines go to $W/report.
pre() {
  : >"$W/report"
  LD_PRELOAD=$PRELOAD LWIO_PRELOAD_REPORT=$W/report "$@"
}
# The sums of the report's fields over every process: "files reads rbytes writes wbytes fallback_files".
totals() {
  awk '{
    for (i = 1; i <= NF; i++) {
      if ($(i+1) == "files," && $(i+2) != "and") f += $i
      if ($(i+1) == "reads") { r += $i; rb += substr($(i+2), 2) }
      if ($(i+1) == "writes") { w += $i; wb += substr($(i+2), 2) }
      if ($(i+1) == "files" && $(i+2) == "and") ff += $i
    }
  } END { printf "%d %d %d %d %d %d\n", f, r, rb, w, wb, ff }' "$W/report"
}
# expect_io NAME MIN_READ_BYTES MIN_WRITE_BYTES: the report shows them intercepted.
expect_io() {
  local t; t=$(totals)
  read -r f r rb w wb ff <<<"$t"
  if [ "$f" -lt 1 ] || [ "$rb" -lt "$2" ] || [ "$wb" -lt "$3" ]; then
    fail "$1" "not intercepted: files=$f reads=$r ($rb bytes) writes=$w ($wb bytes) fallback=$ff; want >= $2 read and $3 written bytes: $(cat "$W/report")"
    return 1
  fi
  echo "    intercepted: $f files, $r reads ($rb bytes), $w writes ($wb bytes), $ff files fell back"
}

# ------------------------------------------------------------ coreutils
head -c $((20 << 20)) /dev/urandom >"$W/local/src"
head -c 1234567 /dev/urandom >>"$W/local/src"   # an odd tail
SUM=$(sha256sum <"$W/local/src" | cut -d' ' -f1)
SIZE=$(stat -c %s "$W/local/src")

pre cp "$W/local/src" "$M/cp.bin" && cmp "$W/local/src" "$M/cp.bin" && expect_io cp 0 "$SIZE" && pass "cp (write $SIZE bytes)"
pre dd if="$W/local/src" of="$M/dd.bin" bs=1M conv=fsync status=none && cmp "$W/local/src" "$M/dd.bin" &&
  expect_io "dd of=" 0 "$SIZE" && pass "dd of= bs=1M conv=fsync"
pre dd if="$M/dd.bin" of="$W/local/dd.out" bs=64k status=none && cmp "$W/local/src" "$W/local/dd.out" &&
  expect_io "dd if=" "$SIZE" 0 && pass "dd if= bs=64k"
pre cat "$M/cp.bin" >"$W/local/cat.out" && cmp "$W/local/src" "$W/local/cat.out" &&
  expect_io cat "$SIZE" 0 && pass cat
if pre cmp "$M/cp.bin" "$W/local/src"; then
  expect_io cmp "$SIZE" 0 && pass "cmp (equal files)"
else fail cmp "cmp found a difference"; fi
# cmp must also see a difference that is there.
printf 'X' | dd of="$M/dd.bin" bs=1 seek=$((SIZE - 3)) conv=notrunc status=none
out=$(pre cmp "$M/cp.bin" "$M/dd.bin" 2>&1)
case "$out" in
  *"differ: byte $((SIZE - 2)),"*) pass "cmp (a changed byte near the end: $out)" ;;
  *) fail cmp "wanted a difference at byte $((SIZE - 2)), got: $out" ;;
esac
got=$(pre sha256sum "$M/cp.bin" | cut -d' ' -f1)
if [ "$got" = "$SUM" ]; then expect_io sha256sum "$SIZE" 0 && pass "sha256sum (a stdio stream)"; else fail sha256sum "$got != $SUM"; fi

# ------------------------------------------------------------ sqlite3
{
  echo "CREATE TABLE t(id INTEGER PRIMARY KEY, v TEXT, n INTEGER);"
  for b in $(seq 0 4); do
    echo "BEGIN;"
    for i in $(seq 1 2000); do echo "INSERT INTO t(v, n) VALUES (printf('%0200d', $((b * 2000 + i))), $((b * 2000 + i)));"; done
    echo "COMMIT;"
  done
  echo "CREATE INDEX tn ON t(n);"
  echo "DELETE FROM t WHERE n % 3 = 0;"
  echo "VACUUM;"
  echo "PRAGMA integrity_check;"
  echo "SELECT count(*), sum(n), sum(length(v)) FROM t;"
} >"$W/sql"
want=$(sqlite3 "$W/local/t.db" <"$W/sql" 2>&1)
got=$(pre sqlite3 "$M/t.db" <"$W/sql" 2>&1)
if [ "$got" = "$want" ] && [ "$(echo "$got" | head -1)" = ok ]; then
  expect_io sqlite3 0 100000 && pass "sqlite3 (integrity_check ok; $(echo "$got" | tail -1))"
else
  fail sqlite3 "under the preload: $got; without: $want"
fi
# Read back under the preload, and through the mount alone.
got=$(pre sqlite3 "$M/t.db" "PRAGMA integrity_check; SELECT count(*), sum(n), sum(length(v)) FROM t;")
plain=$(sqlite3 "$M/t.db" "PRAGMA integrity_check; SELECT count(*), sum(n), sum(length(v)) FROM t;")
if [ "$got" = "$want" ] && [ "$plain" = "$want" ]; then
  expect_io "sqlite3 (read)" 4096 0 && pass "sqlite3 reopened with and without the preload"
else fail "sqlite3 reopen" "preload: $got; mount: $plain; want $want"; fi

# ------------------------------------------------------------ fio
for eng in psync pvsync2 posixaio; do
  qd=1; [ $eng = posixaio ] && qd=32
  if pre fio --name="verify-$eng" --filename="$M/fio-$eng" --size=16m --bs=4k --rw=randwrite \
      --ioengine=$eng --iodepth=$qd --verify=crc32c --do_verify=1 --verify_fatal=1 --verify_state_save=0 \
      --output-format=terse --terse-version=3 >"$W/fio.out" 2>"$W/fio.err"; then
    # terse v3: field 5 = errors
    err=$(cut -d';' -f5 "$W/fio.out")
    [ "$err" = 0 ] && expect_io "fio $eng" $((16 << 20)) $((16 << 20)) &&
      pass "fio --ioengine=$eng --iodepth=$qd --verify=crc32c (16 MiB written and verified)"
  else
    fail "fio $eng" "$(tail -3 "$W/fio.err" | tr '\n' ' ')"
  fi
done

# ------------------------------------------------------------ sharing
cc -Wall -Wextra -Werror -O1 -o "$W/mix" crates/preload/tests/c/mix.c || fail mix "does not compile"
if out=$(pre "$W/mix" "$M/mix.bin" "$W/local/mix.expect" 2>&1); then
  if cmp "$M/mix.bin" "$W/local/mix.expect"; then
    if grep -q "mmap (a mapped file goes through the mount)" "$W/report" &&
       grep -q "O_APPEND" "$W/report" && expect_io mix 1 1; then
      pass "$out"
    else fail mix "report: $(cat "$W/report")"; fi
  else fail mix "the file read through the mount differs from what the program wrote"; fi
else fail mix "$out"; fi

# ------------------------------------------------------------ POSIX AIO
cc -Wall -Wextra -Werror -O1 -o "$W/aio" crates/preload/tests/c/aio.c -lrt || fail aio "does not compile"
if out=$(pre "$W/aio" "$M/aio.bin" 2>&1); then
  # The same program on a local file gives the same bytes.
  if "$W/aio" "$W/local/aio.bin" >/dev/null && cmp "$M/aio.bin" "$W/local/aio.bin" &&
     read -r f r rb w wb ff <<<"$(totals)" && [ "$w" -ge 96 ] && [ "$r" -ge 52 ] && [ "$ff" = 0 ]; then
    pass "POSIX AIO: $out"
    sed 's/^/    /' "$W/report"
  else fail aio "report: $(cat "$W/report")"; fi
else fail aio "$out"; fi

# ------------------------------------------------------------ off switches
out=$(LWIO_PRELOAD=0 pre cat "$M/cp.bin" | sha256sum | cut -d' ' -f1)
read -r f r rb w wb ff <<<"$(totals)"
if [ "$out" = "$SUM" ] && [ "$f" = 0 ] && [ "$rb" = 0 ]; then pass "LWIO_PRELOAD=0: nothing intercepted, same bytes"
else fail "LWIO_PRELOAD=0" "sum $out, report: $(cat "$W/report")"; fi
out=$(pre cat "$W/mnt2/cp.bin" 2>"$W/stderr" | sha256sum | cut -d' ' -f1)
read -r f r rb w wb ff <<<"$(totals)"
if [ "$out" = "$SUM" ] && [ "$f" = 0 ] && [ "$ff" = 1 ] && grep -q "refused the handoff" "$W/stderr"; then
  pass "-o nopreload: the mount refuses the handoff, the program reads through it ($(head -1 "$W/stderr"))"
else fail "-o nopreload" "sum $out, report: $(cat "$W/report"), stderr: $(cat "$W/stderr")"; fi

# ------------------------------------------------------------ server restart
# Last: it kills the server. A program under the preload reads a file in
# 64 KiB steps and writes each step to a copy; halfway it pauses while the
# server is killed and restarted on the same address. Then it goes on: the
# preload's client reconnects by itself (docs/reconnect.md: the files are
# reopened by path and checked to be the same), every later call is still
# served by the preload (none falls back to the mount), and not a byte is
# lost. (Before the client reconnected, the files went back to the mount.)
head -c $((8 << 20)) /dev/urandom >"$W/export/restart.bin"
cat >"$W/steps.py" <<'PY'
import hashlib, os, sys, time
src = os.open(sys.argv[1], os.O_RDONLY)
dst = os.open(sys.argv[2], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
h, off = hashlib.sha256(), 0
while True:
    if off == 4 << 20:
        open(sys.argv[3] + "/paused", "w").close()
        t0 = time.time()
        while not os.path.exists(sys.argv[3] + "/go"):
            if time.time() - t0 > 60:
                sys.exit("never told to go on")
            time.sleep(0.05)
    b = os.pread(src, 65536, off)
    if not b:
        break
    os.pwrite(dst, b, off)
    h.update(b)
    off += len(b)
os.fsync(dst)
print(h.hexdigest(), off)
PY
(
  for _ in $(seq 1 600); do [ -e "$W/paused" ] && break; sleep 0.1; done
  kill -9 "$SERVER_PID"
  # It is not this subshell's child, so wait(1) cannot wait for it: wait
  # until it has exited (gone, or a zombie: its sockets are closed), or the
  # new server may find its ports still held and exit.
  for _ in $(seq 1 200); do
    st=$(awk '/^State:/ {print $2}' "/proc/$SERVER_PID/status" 2>/dev/null)
    [ -z "$st" ] || [ "$st" = Z ] && break
    sleep 0.05
  done
  # A zombie leader's listening sockets can outlive it for a moment while
  # the rest of the process is torn down (seen: a LISTEN socket of no
  # process on the port): wait until nothing listens there any more.
  for _ in $(seq 1 200); do
    ss -Hltn "( sport = :$PORT or sport = :$((PORT + 1)) )" 2>/dev/null | grep -q . || break
    sleep 0.05
  done
  "$LWIO" serve --export "data=$W/export" --listen "127.0.0.1:$PORT" --provider soft \
    >"$W/serve2.log" 2>&1 3>&- &
  for _ in $(seq 1 100); do grep -q "RDMA listening" "$W/serve2.log" && break; sleep 0.1; done
  touch "$W/go"
) &
KILLER=$!
out=$(timeout 120 env LD_PRELOAD="$PRELOAD" LWIO_PRELOAD_REPORT="$W/report.restart" \
  python3 "$W/steps.py" "$M/restart.bin" "$M/restart.copy" "$W" 2>&1); rc=$?
wait "$KILLER"
SERVER_PID=$(pgrep -f "serve --export data=$W/export" | head -1)
want="$(sha256sum <"$W/export/restart.bin" | cut -d' ' -f1) $((8 << 20))"
if [ $rc = 0 ] && [ "$(tail -1 <<<"$out")" = "$want" ] &&
   cmp -s "$W/export/restart.bin" "$W/export/restart.copy" &&
   grep "python" "$W/report.restart" | grep -q "2 files, 129 reads (8388608 bytes), 128 writes (8388608 bytes), .* 0 files and 0 calls fell back to the mount"; then
  pass "server killed and restarted under a program reading and writing: every byte read and copied"
  grep python "$W/report.restart" | sed 's/^/    /'
else
  fail "server restart" "rc=$rc out='$out' want='$want' copy: $(cmp "$W/export/restart.bin" "$W/export/restart.copy" 2>&1); report: $(grep python "$W/report.restart" 2>/dev/null); restarted server's log: $(tail -5 "$W/serve2.log" 2>/dev/null)"
fi

echo "preload-tests: $FAILS failure(s)"
[ "$FAILS" = 0 ]
