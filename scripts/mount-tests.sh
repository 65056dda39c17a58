#!/usr/bin/env bash
# mount-tests.sh - real programs that nobody here wrote, run on `lwio mount`
# as their users run them; their own integrity checks are the referee.
#
# usage: scripts/mount-tests.sh [CASE ...]     (default: every case)
# env:   LWIO      the lwio binary (default: target/release/lwio, built if missing)
#        KEEP=1    keep the scratch directory
#
# A server (`lwio serve`, soft provider, loopback) exports a scratch directory;
# `lwio mount --daemon` mounts it; each case runs a program on the mount and
# prints PASS or FAIL with the program's own verdict. Any FAIL fails the run.
# Needs root-less FUSE (/dev/fuse, fusermount3) and the Debian packages
# fuse3 sqlite3 fio stress-ng sysbench git tar (.ci/run installs them).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

if [ -z "${LWIO:-}" ]; then
  cargo build --release -q -p lwio || exit 1
  LWIO=$ROOT/target/release/lwio
fi
for p in fusermount3 sqlite3 fio stress-ng sysbench git tar; do
  command -v "$p" >/dev/null || { echo "FAIL: $p is not installed (apt-get install fuse3 sqlite3 fio stress-ng sysbench git tar)"; exit 1; }
done
[ -e /dev/fuse ] || { echo "FAIL: /dev/fuse is missing"; exit 1; }

W=$(mktemp -d /tmp/lwio-mount-tests.XXXXXX)
export HOME=$W/home LWIO_KNOWN_HOSTS=$W/known_hosts
mkdir -p "$HOME" "$W/export" "$W/mnt" "$W/mnt2" "$W/scratch"
SERVER_PID=
FAILS=0
RUN=0

cleanup() {
  for m in "$W/mnt" "$W/mnt2" "$W/mnt-hard" "$W/mnt-wb" "$W/mnt-ac" "$W/mnt-wf" "$W/mnt-us"; do
    mountpoint -q "$m" && { fusermount3 -u "$m" 2>/dev/null || fusermount3 -uz "$m"; }
  done
  [ -n "$SERVER_PID" ] && kill "$SERVER_PID" 2>/dev/null && wait "$SERVER_PID" 2>/dev/null
  if [ "${KEEP:-0}" = 1 ]; then echo "kept $W"; else rm -rf "$W"; fi
}
trap cleanup EXIT

pass() { echo "PASS $1 ($(( $(date +%s) - T0 ))s)"; }
fail() { echo "FAIL $1: $2"; FAILS=$((FAILS + 1)); }

. scripts/lib/serve.sh
start_server() { # [port: the same one again]
  SERVE_PORT=${1:-} serve_data "$W/export" "$W/serve.log" 3>&- ||
    { echo "FAIL: server did not start"; exit 1; }
  export LWIO_FINGERPRINT=$FP
}

# unmount_side_calls MOUNTPOINT: unmount it, and print how many side-channel
# calls the mount made in its life (from the line its log ends with).
unmount_side_calls() {
  fusermount3 -u "$1"
  sleep 0.2
  grep -o '[0-9]* side-channel calls' "$W/mount-$(basename "$1").log" | awk '{print $1}'
}

do_mount() { # mountpoint [extra args]
  local m=$1; shift
  "$LWIO" mount --daemon --log "$W/mount-$(basename "$m").log" "$URL" "$m" --provider soft "$@"
}

start_server
do_mount "$W/mnt" || { echo "FAIL: mount"; exit 1; }
M=$W/mnt

# ---------------------------------------------------------------- cases

case_sqlite() {
  local db=$M/sqlite/t.db
  mkdir -p "$M/sqlite"
  {
    echo "PRAGMA journal_mode=WAL; CREATE TABLE t(id INTEGER PRIMARY KEY, v TEXT, n INTEGER);"
    for t in $(seq 0 9); do
      echo "BEGIN;"
      for i in $(seq 1 1000); do echo "INSERT INTO t(v, n) VALUES (hex(randomblob(32)), $((t * 1000 + i)));"; done
      echo "COMMIT;"
    done
    echo "CREATE INDEX tv ON t(v); DELETE FROM t WHERE n % 7 = 0; VACUUM;"
  } | sqlite3 "$db" >/dev/null || { fail sqlite "sqlite3 failed"; return; }
  local ic cnt
  ic=$(sqlite3 "$db" "PRAGMA integrity_check;")
  cnt=$(sqlite3 "$db" "SELECT count(*) FROM t;")
  # The server's own copy, read with no FUSE in the way.
  local ic2
  ic2=$(sqlite3 "file:$W/export/sqlite/t.db?mode=ro" "PRAGMA integrity_check;" 2>&1)
  if [ "$ic" = ok ] && [ "$cnt" = 8572 ] && [ "$ic2" = ok ]; then pass "sqlite (10000 rows in 10 transactions, integrity_check ok on the mount and on the server, $cnt rows left)"
  else fail sqlite "integrity_check=$ic server=$ic2 rows=$cnt (want ok ok 8572)"; fi
}

case_fio() {
  local eng out
  # libaio with O_DIRECT: FUSE's async direct I/O, 32 requests in flight
  # (random, then sequential into a new file: writes that extend it).
  for eng in psync io_uring libaio-direct libaio-direct-seq; do
    local args=(--ioengine=$eng --iodepth=8 --rw=randwrite --bs=64k)
    case $eng in
      libaio-direct) args=(--ioengine=libaio --direct=1 --iodepth=32 --rw=randwrite --bs=4k) ;;
      libaio-direct-seq) args=(--ioengine=libaio --direct=1 --iodepth=32 --rw=write --bs=16k) ;;
    esac
    out=$(fio --name="verify-$eng" --directory="$M" --filename="fio-$eng.dat" --size=64M "${args[@]}" \
      --verify=crc32c --do_verify=1 --verify_fatal=1 \
      --verify_backlog=64 --verify_state_save=0 2>&1)
    if [ $? -eq 0 ] && grep -q "err= 0" <<<"$out" && ! grep -qi "verify.*bad\|crc32c.*fail" <<<"$out"; then
      pass "fio $eng 64M ${args[*]} --verify=crc32c"
    else
      fail "fio $eng" "$(grep -i "err=\|verify\|error" <<<"$out" | head -3)"
    fi
  done
}

case_stress_ng() {
  local out
  out=$(cd "$M" && mkdir -p stress && stress-ng --temp-path "$M/stress" --hdd 2 --hdd-bytes 16M \
    --dir 2 --rename 2 --verify --timeout 15s --metrics-brief 2>&1)
  if [ $? -eq 0 ] && ! grep -qi "fail\|error" <<<"$(grep -v "metrc\|skipped" <<<"$out")"; then
    pass "stress-ng --hdd 2 --dir 2 --rename 2 --verify (15 s)"
  else
    fail stress-ng "$(grep -i "fail\|error" <<<"$out" | head -3)"
  fi
}

case_sysbench() {
  local out
  # prepare writes blocks without checksums: a validated seqwr writes them
  # all first, then rndrw and seqrd check every block they read.
  local sb="sysbench fileio --file-total-size=64M --file-num=8 --validate=on"
  out=$(cd "$M" && mkdir -p sysbench && cd sysbench &&
    $sb prepare >/dev/null &&
    $sb --file-test-mode=seqwr run 2>&1 &&
    $sb --file-test-mode=rndrw --time=10 run 2>&1 &&
    $sb --file-test-mode=seqrd run 2>&1 &&
    $sb cleanup >/dev/null)
  local rc=$?
  if [ $rc -eq 0 ] && grep -q "reads/s" <<<"$out" && ! grep -qi "validation failed\|FATAL" <<<"$out"; then
    pass "sysbench fileio --validate=on: seqwr, rndrw (10 s), seqrd"
  else
    fail sysbench "rc=$rc: $(grep -i "fatal\|failed\|error" <<<"$out" | head -3) | last lines: $(tail -4 <<<"$out" | tr '\n' ' ')"
  fi
}

case_tar_git() {
  local src=$W/scratch/src
  rm -rf "$src"; mkdir -p "$src"
  cp -r "$ROOT/crates/proto" "$ROOT/crates/side" "$ROOT/docs" "$src/"
  ln -s docs "$src/docs-link"
  chmod 0750 "$src/docs"
  tar -C "$W/scratch" -cf "$W/scratch/src.tar" src
  mkdir -p "$M/tar" && tar -C "$M/tar" -xf "$W/scratch/src.tar" || { fail tar "tar x on the mount failed"; return; }
  if ! diff -r --no-dereference "$src" "$M/tar/src" >"$W/diff.out" 2>&1; then
    fail tar "diff -r: $(head -3 "$W/diff.out")"; return
  fi
  tar -C "$M/tar" -cf "$W/scratch/back.tar" src && mkdir -p "$W/scratch/back" &&
    tar -C "$W/scratch/back" -xf "$W/scratch/back.tar" &&
    diff -r --no-dereference "$src" "$W/scratch/back/src" >"$W/diff2.out" 2>&1 ||
    { fail tar "tar out of the mount: $(head -3 "$W/diff2.out")"; return; }
  pass "tar x into the mount and c out of it, diff -r equal ($(find "$src" | wc -l) entries)"
  T0=$(date +%s)
  local g=$M/git
  git init -q "$g" && cp -r "$src/." "$g/" && (cd "$g" &&
    git add -A && git -c user.email=ci@lwio -c user.name=ci commit -qm "tree" &&
    echo change >>proto/Cargo.toml && git -c user.email=ci@lwio -c user.name=ci commit -qam "change" &&
    git fsck --full --strict 2>&1 && git gc -q && git fsck --full --strict 2>&1) >"$W/git.out" 2>&1
  if [ $? -eq 0 ] && [ "$(cd "$g" && git rev-list --count HEAD)" = 2 ]; then
    pass "git init, add, commit twice, fsck --full --strict, gc, fsck"
  else
    fail git "$(tail -3 "$W/git.out")"
  fi
}

case_fstab() {
  # mount(8)'s helper runs `lwio URL MOUNTPOINT -o OPTIONS` for a fuse.lwio line.
  local bin=$W/bin
  mkdir -p "$bin" && ln -sf "$LWIO" "$bin/lwio"
  if PATH=$bin:$PATH mount.fuse3 "$URL" "$W/mnt2" -t lwio -o "ro,provider=soft,busy_poll=50us,_netdev" >"$W/fstab.out" 2>&1 &&
    mountpoint -q "$W/mnt2" && cmp -s "$W/mnt2/sqlite/t.db" "$W/export/sqlite/t.db" &&
    ! touch "$W/mnt2/ro-test" 2>/dev/null; then
    fusermount3 -u "$W/mnt2" && pass "fstab form (mount.fuse3 -t lwio, -o ro,busy_poll=50us): mounted, read equal, write refused, unmounted"
  else
    fail fstab "$(cat "$W/fstab.out" | head -3)"
  fi
}

case_bad_input() {
  local out n
  # One line each, before anything is mounted.
  for what in "unreachable:lwio://127.0.0.1:1/data" "no-export:$URL/../nosuch" "wrong-token:$URL" "bad-option:$URL"; do
    local name=${what%%:*} url=${what#*:} extra=()
    [ "$name" = no-export ] && url=lwio://127.0.0.1:$PORT/nosuch
    [ "$name" = bad-option ] && extra=(-o busy_poll=fast)
    [ "$name" = wrong-token ] && { echo "wrong-token-0123456789abcdef0123" >"$W/bad.token"; extra=(--token-file "$W/bad.token"); }
    out=$("$LWIO" mount --daemon "$url" "$W/mnt2" --provider soft --connect-timeout 2s "${extra[@]}" 2>&1)
    local rc=$?
    n=$(printf '%s\n' "$out" | grep -c .)
    if [ $rc -eq 0 ] || mountpoint -q "$W/mnt2" || [ "$n" != 1 ] || ! grep -q "^lwio: error: " <<<"$out"; then
      fail "bad-input $name" "got: $out"
    else
      pass "bad input ($name): one line, nothing mounted: $out"
    fi
    T0=$(date +%s)
  done
}

case_server_death() {
  # Kill the server under a mount: calls fail with EIO in bounded time; the
  # mount can be unmounted; after a restart a new mount works.
  echo data >"$W/export/alive"
  # A file held open across the restart: reopened by path on the new
  # session at its next use.
  echo "before restart" >"$M/held"
  exec 3<>"$M/held"
  kill -9 "$SERVER_PID"; wait "$SERVER_PID" 2>/dev/null; SERVER_PID=
  local rc
  timeout 60 cat "$M/alive" >/dev/null 2>"$W/dead.err"; rc=$?
  if [ $rc -eq 124 ]; then fail server-death "cat hung for 60 s"; return; fi
  if [ $rc -eq 0 ]; then
    # The attribute cache may still answer; a new file's data cannot.
    timeout 60 sh -c "echo x >'$M/new-after-death'" 2>"$W/dead.err"; rc=$?
  fi
  grep -q "Input/output error\|Transport endpoint\|No such" "$W/dead.err" && [ $rc -ne 0 ] && [ $rc -ne 124 ] ||
    { fail server-death "rc=$rc: $(cat "$W/dead.err")"; return; }
  # Restarted on the same address: the same mount connects again, and new
  # opens and namespace calls work (within its one-a-second retry).
  start_server "$PORT"
  local ok=
  for _ in $(seq 1 20); do
    if [ "$(cat "$M/alive" 2>/dev/null)" = data ] && echo back >"$M/after-restart" 2>/dev/null; then
      ok=1; break
    fi
    sleep 0.5
  done
  [ -n "$ok" ] && [ "$(cat "$W/export/after-restart")" = back ] ||
    { exec 3>&-; fail server-death "the mount did not work again after the restart"; return; }
  printf 'AFTER!' >&3; local wrc=$?
  exec 3>&-
  [ $wrc = 0 ] && [ "$(cat "$W/export/held")" = "AFTER! restart" ] ||
    { fail server-death "a file open across the restart: rc=$wrc, server has '$(cat "$W/export/held")'"; return; }
  fusermount3 -u "$M" 2>"$W/umount.err" || { sleep 1; fusermount3 -u "$M" 2>>"$W/umount.err"; } ||
    { fail server-death "unmount after the restart: $(cat "$W/umount.err"; fuser -vm "$M" 2>&1 | tail -3)"; return; }
  do_mount "$M" && [ "$(cat "$M/alive")" = data ] ||
    { fail server-death "a new mount after the restart"; return; }
  pass "server killed: $(head -1 "$W/dead.err"); restarted: the same mount works again, a file held open across it was reopened and written; remounted"
}

case_hard() {
  # -o hard: while the server is away a call waits for it instead of
  # failing; once it is back the call completes with the right bytes.
  local H=$W/mnt-hard
  mkdir -p "$H"
  head -c 300000 /dev/urandom >"$W/export/hard.bin"
  do_mount "$H" -o hard || { fail hard "mount -o hard"; return; }
  cmp -s "$H/hard.bin" "$W/export/hard.bin" || { fail hard "read before the kill"; return; }
  kill -9 "$SERVER_PID"; wait "$SERVER_PID" 2>/dev/null; SERVER_PID=
  # A new name: no cache can answer it.
  cp "$W/export/hard.bin" "$W/export/hard2.bin"
  timeout 120 cat "$H/hard2.bin" >"$W/hard.out" 2>"$W/hard.err" &
  local reader=$!
  sleep 3
  if ! kill -0 "$reader" 2>/dev/null; then
    wait "$reader"; fail hard "the call did not wait for the server: rc=$? $(cat "$W/hard.err")"
    start_server "$PORT"; return
  fi
  start_server "$PORT"
  wait "$reader"; local rc=$?
  if [ $rc = 0 ] && cmp -s "$W/hard.out" "$W/export/hard2.bin"; then
    pass "-o hard: a read made while the server was away waited 3+ s and completed byte for byte once it was back"
  else
    fail hard "rc=$rc: $(cat "$W/hard.err"); $(cmp "$W/hard.out" "$W/export/hard2.bin" 2>&1)"
  fi
  fusermount3 -u "$H" 2>/dev/null || fusermount3 -uz "$H"
}

case_local_change() {
  # A leased directory changed on the server's own file system (not
  # through lwio): the server's fanotify watch breaks the lease, and the
  # mount shows the new name within a second (before: lease_timeout, 60 s).
  mkdir -p "$W/export/lc"
  ls "$M/lc" >/dev/null; ls "$M/lc" >/dev/null   # listed: leased
  touch "$W/export/lc/made-on-the-server"
  local t0=$(date +%s%N) seen=0
  for _ in $(seq 1 20); do
    if ls "$M/lc" | grep -q made-on-the-server; then seen=1; break; fi
    sleep 0.05
  done
  local ms=$(( ($(date +%s%N) - t0) / 1000000 ))
  if [ $seen = 1 ]; then
    pass "local change: a name made on the server's disk shows on the mount after $ms ms"
  else
    fail local_change "not seen within 1 s: $(ls "$M/lc")"
  fi
}

case_attr_cache() {
  # A file appended to with an fstat and an lseek to its end between the
  # writes (as PostgreSQL sizes its relations): under the directory's lease
  # the mount answers from its own writes, right every time, instead of
  # asking the server after each write (before: one getattr per write).
  local m=$W/mnt-ac out n
  mkdir -p "$m" "$W/export/ac"
  do_mount "$m" || { fail attr_cache "mount"; return; }
  ls "$m/ac" >/dev/null; ls "$m/ac" >/dev/null   # listed: leased
  out=$(/usr/bin/python3 - "$m/ac/appended" <<'EOF' 2>&1
import os, sys
fd = os.open(sys.argv[1], os.O_CREAT | os.O_WRONLY, 0o644)
block = bytes(range(256)) * 32
for i in range(200):
    end = os.lseek(fd, 0, os.SEEK_END)
    assert end == i * 8192, f"lseek(SEEK_END) {end} after {i} writes"
    assert os.fstat(fd).st_size == end, f"fstat {os.fstat(fd).st_size}"
    os.pwrite(fd, block, end)
os.close(fd)
assert os.stat(sys.argv[1]).st_size == 200 * 8192
EOF
  )
  n=$(unmount_side_calls "$m")
  if [ -n "$out" ]; then
    fail attr_cache "$out"
  elif ! cmp -s "$W/export/ac/appended" <(/usr/bin/python3 -c 'import sys; sys.stdout.buffer.write(bytes(range(256)) * 32 * 200)'); then
    fail attr_cache "the file on the server differs from what was written"
  elif [ -z "$n" ] || [ "$n" -gt 20 ]; then
    fail attr_cache "${n:-?} side-channel calls for 200 appends (want <= 20; one per write means the cache did not answer)"
  else
    pass "attr cache: 200 appends with fstat and lseek(SEEK_END), sizes right, $n side-channel calls in all"
  fi
}

case_writeback() {
  # -o writeback_cache: the kernel keeps written pages and sends them in
  # batches. Its referees: fio --verify and sqlite's integrity check on
  # it, writes of odd sizes at odd offsets (the kernel reads the rest of
  # each page) equal byte for byte on the server after fsync and before
  # close, and another mount seeing them after close (close-to-open).
  local m=$W/mnt-wb out
  mkdir -p "$m" "$W/export/wb"
  do_mount "$m" -o writeback_cache || { fail writeback "mount"; return; }
  out=$(fio --name=wb --directory="$m/wb" --filename=fio.dat --size=16M --bs=4k --rw=randwrite \
    --ioengine=psync --verify=crc32c --do_verify=1 --verify_fatal=1 --verify_state_save=0 2>&1)
  if [ $? -ne 0 ] || ! grep -q "err= 0" <<<"$out"; then
    fail writeback "fio: $(grep -i "err=\|verify\|error" <<<"$out" | head -3)"; fusermount3 -u "$m"; return
  fi
  out=$(sqlite3 "$m/wb/t.db" "PRAGMA journal_mode=WAL; CREATE TABLE t(a, b); WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x+1 FROM c WHERE x < 20000) INSERT INTO t SELECT x, randomblob(100) FROM c; PRAGMA integrity_check;" 2>&1 | tail -1)
  [ "$out" = ok ] || { fail writeback "sqlite integrity_check: $out"; fusermount3 -u "$m"; return; }
  out=$(/usr/bin/python3 - "$m/wb/odd" "$W/export/wb/odd" "$M/wb/odd" <<'EOF' 2>&1
import os, random, sys
mnt, server, other = sys.argv[1:]
rnd = random.Random(7)
ref = bytearray()
fd = os.open(mnt, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
for _ in range(300):
    off = rnd.randrange(0, 600_000)
    data = rnd.randbytes(rnd.randrange(1, 9000))
    os.pwrite(fd, data, off)
    if len(ref) < off + len(data):
        ref.extend(bytes(off + len(data) - len(ref)))
    ref[off:off + len(data)] = data
os.fsync(fd)
with open(server, "rb") as f:
    assert f.read() == ref, "after fsync, the server's file differs"
os.close(fd)
with open(other, "rb") as f:
    assert f.read() == ref, "after close, another mount reads something else"
EOF
  )
  fusermount3 -u "$m"
  if [ -n "$out" ]; then
    fail writeback "$out"
  else
    pass "writeback_cache: fio --verify, sqlite integrity_check, 300 odd writes equal on the server after fsync and on another mount after close"
  fi
}

case_writeback_fsync() {
  # -o writeback_cache, a database's commit loop: write, fdatasync, 50
  # times, in a leased directory. Each fdatasync costs the server one call
  # (the sync; the pages go over RDMA), not two: the times the kernel
  # writes back before it are kept by the mount (the server's writes set
  # its mtime). The data is the server's byte for byte after each sync.
  local m=$W/mnt-wf out n
  mkdir -p "$m" "$W/export/wf"
  do_mount "$m" -o writeback_cache || { fail writeback_fsync "mount"; return; }
  ls "$m/wf" >/dev/null; ls "$m/wf" >/dev/null   # listed: leased
  out=$(/usr/bin/python3 - "$m/wf/wal" "$W/export/wf/wal" <<'EOF' 2>&1
import os, sys
mnt, server = sys.argv[1:]
fd = os.open(mnt, os.O_CREAT | os.O_WRONLY, 0o600)
for i in range(50):
    block = bytes([i]) * 8192
    os.pwrite(fd, block, i * 8192)
    os.fdatasync(fd)
    with open(server, "rb") as f:
        f.seek(i * 8192)
        assert f.read(8192) == block, f"write {i} not on the server after fdatasync"
os.close(fd)
EOF
  )
  n=$(unmount_side_calls "$m")
  if [ -n "$out" ]; then
    fail writeback_fsync "$out"
  elif [ -z "$n" ] || [ "$n" -gt 20 ]; then
    fail writeback_fsync "${n:-?} side-channel calls for 50 write+fdatasync (want <= 20: a sync is a FLUSH on the RDMA connection, not a side-channel call)"
  else
    pass "writeback_cache: 50 write+fdatasync, each on the server after its sync, $n side-channel calls in all"
  fi
}

case_unstable() {
  # Unstable writes (the default; docs/mount.md): write(2) is answered once
  # the WRITE is sent, as an NFS client answers. A failure on the server
  # (here EFBIG: a write past the largest file of the export's file system)
  # is then reported by the file's next fsync, once, and by close, with the
  # errno that a waited-for write (-o nounstable_writes) returns at once.
  # Overlapping writes land in the order they were made, another open of
  # the file reads them at once, and the server has them after fsync.
  local m=$W/mnt-us want got
  mkdir -p "$m" "$W/export/us"
  do_mount "$m" -o nounstable_writes || { fail unstable "mount"; return; }
  want=$(/usr/bin/python3 - "$m/us/far" <<'EOF' 2>&1
import errno, os, sys
fd = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR, 0o644)
try:
    os.pwrite(fd, b"x" * 8192, 1 << 50)
    print("a waited-for write past the largest file succeeded")
except OSError as e:
    print(errno.errorcode[e.errno])
os.close(fd)
EOF
  )
  fusermount3 -u "$m"
  case "$want" in E*) ;; *) fail unstable "-o nounstable_writes: $want"; return ;; esac
  got=$(/usr/bin/python3 - "$M/us/far2" "$W/export/us/order" "$M/us/order" "$want" <<'EOF' 2>&1
import errno, os, random, sys
far, server, mnt, want = sys.argv[1:]
fd = os.open(far, os.O_CREAT | os.O_RDWR, 0o644)
assert os.pwrite(fd, b"x" * 8192, 1 << 50) == 8192, "short"
try:
    os.fsync(fd)
    sys.exit("fsync after the failed write succeeded")
except OSError as e:
    assert errno.errorcode[e.errno] == want, f"fsync: {errno.errorcode[e.errno]}, want {want}"
os.fsync(fd)  # reported once
assert os.pwrite(fd, b"y" * 8192, 1 << 50) == 8192, "short"
try:
    os.close(fd)
    sys.exit("close after the failed write succeeded")
except OSError as e:
    assert errno.errorcode[e.errno] == want, f"close: {errno.errorcode[e.errno]}, want {want}"
rnd = random.Random(11)
ref = bytearray(64 << 10)
fd = os.open(mnt, os.O_CREAT | os.O_RDWR | os.O_TRUNC, 0o644)
rd = os.open(mnt, os.O_RDONLY)
for i in range(2000):
    off = rnd.randrange(0, len(ref) - 8192)
    data = rnd.randbytes(rnd.randrange(1, 8192))
    assert os.pwrite(fd, data, off) == len(data)
    ref[off:off + len(data)] = data
    if i % 100 == 0:
        assert os.pread(rd, len(ref), 0) == ref[:os.fstat(fd).st_size], f"another open read other bytes after write {i}"
os.fsync(fd)
with open(server, "rb") as f:
    got = f.read()
assert got == ref[:len(got)] and len(got) >= len(ref) - 8192, "the server's file differs after fsync"
os.close(rd)
os.close(fd)
EOF
  )
  if [ -n "$got" ]; then
    fail unstable "$got"
  else
    pass "unstable writes: a server's $want reported by fsync (once) and by close, as a waited-for write returns it; 2000 overlapping writes in order, read at once by another open, on the server after fsync"
  fi
}

CASES=(${@:-sqlite fio stress_ng sysbench tar_git fstab bad_input server_death hard local_change attr_cache writeback writeback_fsync unstable})
for c in "${CASES[@]}"; do
  T0=$(date +%s); RUN=$((RUN + 1))
  "case_$c"
done
echo "mount-tests: $RUN case groups, $FAILS failure(s)"
[ "$FAILS" = 0 ]
