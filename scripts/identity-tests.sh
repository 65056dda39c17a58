#!/usr/bin/env bash
# identity-tests.sh - `lwio mount` used by several users, as a storage
# server is (docs/mount.md, "Identities"): `lwio serve` as root with
# `identity = "client"` exports, the mount made with
# `-o allow_other,default_permissions`, and programs run as their own
# users, never as the server's.
#
# usage: scripts/identity-tests.sh [CASE ...]   (default: every case)
# env:   LWIO    the lwio binary (default: target/release/lwio, built if missing)
#        KEEP=1  keep the scratch directory
#        PG_SECONDS  pgbench duration per run (default 20)
#
# Cases:
#   posix     scripts/posix-checks.py by users 2001-2003 on the mount and on
#             the export's own directory (the referee): they must agree.
#   squash    root_squash: root's files on the mount belong to 65534;
#             an untrusted login cannot assert ids: it is refused, or acts
#             as its configured uid whatever it asserts.
#   fsyncdir  fsync(2) of a directory on the mount fsyncs it on the server.
#   cli       lwio cp sends its process's ids: a file it writes is its user's.
#   postgres  PostgreSQL from Debian as its own user: initdb -k, pgbench,
#             pg_amcheck --heapallindexed, pg_checksums -c; then again with
#             the server SIGKILLed and restarted during pgbench.
# Needs root, FUSE, python3, strace and PostgreSQL (.ci/run installs them).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

if [ -z "${LWIO:-}" ]; then
  cargo build --release -q -p lwio || exit 1
  LWIO=$ROOT/target/release/lwio
fi
[ "$(id -u)" = 0 ] || { echo "FAIL: identity-tests.sh runs as root (it acts as several users)"; exit 1; }
for p in fusermount3 python3 strace setpriv; do
  command -v "$p" >/dev/null || { echo "FAIL: $p is not installed"; exit 1; }
done
PGBIN=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1)

W=$(mktemp -d /tmp/lwio-identity-tests.XXXXXX)
chmod 755 "$W"
export HOME=$W/home LWIO_KNOWN_HOSTS=$W/known_hosts
mkdir -p "$HOME" "$W/data" "$W/squash" "$W/mnt" "$W/mnt-squash" "$W/mnt-bob" "$W/mnt-carol"
chmod 777 "$W/data" "$W/squash"
SERVER_PID=
FAILS=0
RUN=0
PORT=$(( 10000 + RANDOM % 22000 ))
URL=lwio://127.0.0.1:$PORT

cleanup() {
  for m in "$W"/mnt*; do
    mountpoint -q "$m" && { fusermount3 -u "$m" 2>/dev/null || umount -l "$m"; }
  done
  [ -n "$SERVER_PID" ] && kill "$SERVER_PID" 2>/dev/null && wait "$SERVER_PID" 2>/dev/null
  if [ "${KEEP:-0}" = 1 ]; then echo "kept $W"; else rm -rf "$W"; fi
}
trap cleanup EXIT

pass() { echo "PASS $1 ($(( $(date +%s) - T0 ))s)"; }
fail() { echo "FAIL $1: $2"; FAILS=$((FAILS + 1)); }

# dave (the mounts' login) is trusted with ids; bob is not and has no uid
# configured; carol is not trusted either, and acts as uid 2500.
for u in dave bob carol; do printf '%s-secret\n' "$u" >"$W/$u.pw"; done
chmod 600 "$W"/*.pw
hash() { "$LWIO" hash-password <"$W/$1.pw" || { echo "FAIL: hash-password" >&2; exit 1; }; }
cat >"$W/lwio.toml" <<EOF
listen = "127.0.0.1:$PORT"
token_file = "$W/token"

[users.dave]
password = "$(hash dave)"

[users.bob]
password = "$(hash bob)"

[users.carol]
password = "$(hash carol)"
uid = 2500
gid = 2500

[exports]
# The databases' export: no_root_squash, so that root is root here too.
data = { path = "$W/data", identity = "client", trust_client_ids = ["dave"], root_squash = false }
# The exports(5) defaults: root squashed to 65534.
squash = { path = "$W/squash", identity = "client", trust_client_ids = ["dave"] }
EOF

start_server() {
  "$LWIO" serve --config "$W/lwio.toml" --provider soft >>"$W/serve.log" 2>&1 3>&- &
  SERVER_PID=$!
  for _ in $(seq 1 100); do
    [ "$(grep -c "RDMA listening" "$W/serve.log")" -ge "${1:-1}" ] && break
    sleep 0.1
  done
  FP=$(grep -o 'sha256:[0-9A-F:]*' "$W/serve.log" | head -1)
  [ -n "$FP" ] || { echo "FAIL: server did not start"; cat "$W/serve.log"; exit 1; }
  export LWIO_FINGERPRINT=$FP
}

mount_as() { # url mountpoint user password-file [extra -o]
  local url=$1 m=$2 user=$3 pw=$4; shift 4
  "$LWIO" mount --daemon --log "$W/mount-$(basename "$m").log" "$url" "$m" --provider soft \
    --user "$user" --password-file "$pw" -o allow_other,default_permissions "$@"
}

start_server
mount_as "$URL/data" "$W/mnt" dave "$W/dave.pw" || { echo "FAIL: mount"; cat "$W"/mount-mnt.log; exit 1; }

# ---------------------------------------------------------------- cases

case_posix() {
  local out=$W/posix.out
  if timeout 600 /usr/bin/python3 scripts/posix-checks.py "$W/data" "$W/mnt" >"$out" 2>&1; then
    pass "posix: $(tail -1 "$out") (mount and export agree, users 2001-2003)"
  else
    grep -v '^PASS' "$out" | head -40
    fail posix "$(tail -1 "$out")"
  fi
}

case_squash() {
  local ok=1
  mount_as "$URL/squash" "$W/mnt-squash" dave "$W/dave.pw" || { fail squash "mount"; return; }
  touch "$W/mnt-squash/by-root" && mkdir "$W/mnt-squash/dir-by-root"
  local o; o=$(stat -c %u:%g "$W/squash/by-root" "$W/squash/dir-by-root" | sort -u)
  [ "$o" = "65534:65534" ] || { ok=0; fail squash "root's file on the server: $o, want 65534:65534"; }
  # root, squashed, may not chown (it is nobody there).
  if chown 2001 "$W/mnt-squash/by-root" 2>/dev/null; then ok=0; fail squash "squashed root could chown"; fi
  # bob: not trusted, no uid configured: refused, and nothing created.
  if mount_as "$URL/squash" "$W/mnt-bob" bob "$W/bob.pw" 2>"$W/bob.err"; then
    if setpriv --reuid=2001 --regid=2001 --clear-groups touch "$W/mnt-bob/bob-as-2001" 2>/dev/null \
      || touch "$W/mnt-bob/bob-as-root" 2>/dev/null; then
      ok=0; fail squash "an untrusted login created a file: $(ls -ln "$W/squash")"
    fi
    fusermount3 -u "$W/mnt-bob"
  fi
  grep -q "trust_client_ids" "$W/serve.log" "$W/bob.err" "$W/mount-mnt-bob.log" 2>/dev/null ||
    { ok=0; fail squash "the refusal does not name trust_client_ids"; }
  ls "$W/squash" | grep -q bob- && { ok=0; fail squash "bob's file exists: $(ls -ln "$W/squash")"; }
  # carol: not trusted, uid 2500 configured: her files are 2500's, whoever
  # she claims to be (root, or 2001), and she cannot chown them to root.
  mount_as "$URL/squash" "$W/mnt-carol" carol "$W/carol.pw" || { fail squash "carol's mount"; return; }
  chmod 777 "$W/squash"
  touch "$W/mnt-carol/carol-as-root"
  # (touch then fails to set the times: the new file is 2500's, not 2001's.)
  setpriv --reuid=2001 --regid=2001 --clear-groups touch "$W/mnt-carol/carol-as-2001" 2>/dev/null
  o=$(stat -c %u:%g "$W/squash/carol-as-root" "$W/squash/carol-as-2001" 2>&1 | sort -u)
  [ "$o" = "2500:2500" ] || { ok=0; fail squash "carol's files: $o, want 2500:2500"; }
  if chown 0:0 "$W/mnt-carol/carol-as-root" 2>/dev/null; then ok=0; fail squash "carol gave a file to root"; fi
  [ "$(stat -c %u "$W/squash/carol-as-root")" = 2500 ] || { ok=0; fail squash "owner changed"; }
  fusermount3 -u "$W/mnt-carol"; fusermount3 -u "$W/mnt-squash"
  [ $ok = 1 ] && pass "squash: root -> 65534, an untrusted login refused (no uid) or pinned to its configured uid 2500"
}

case_fsyncdir() {
  mkdir -p "$W/mnt/syncdir"
  strace -f -qq -e trace=fsync -p "$SERVER_PID" -o "$W/strace.out" &
  local st=$!
  sleep 1
  python3 - "$W/mnt/syncdir" <<'EOF'
import os, sys
d = sys.argv[1]
open(os.path.join(d, "new"), "w").close()
fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
os.fsync(fd)
os.close(fd)
EOF
  local rc=$?
  sleep 0.5
  kill "$st"; wait "$st" 2>/dev/null
  if [ $rc = 0 ] && grep -q 'fsync(' "$W/strace.out"; then
    pass "fsyncdir: fsync of a directory on the mount fsyncs it on the server ($(grep -c 'fsync(' "$W/strace.out") fsync calls seen)"
  else
    fail fsyncdir "rc=$rc, server fsync calls: $(cat "$W/strace.out")"
  fi
}

case_cli() {
  # lwio cp sends its process's ids, as an NFS client does: run by uid
  # 2001 with the trusted login, the file it writes is 2001's.
  install -o 2001 -g 2001 -m 600 "$W/dave.pw" "$W/dave-2001.pw"
  install -o 2001 -g 2001 -m 644 /etc/hostname "$W/src-2001"
  local kh=$W/kh-2001; cp "$LWIO_KNOWN_HOSTS" "$kh" 2>/dev/null; touch "$kh"; chown 2001 "$kh"
  if setpriv --reuid=2001 --regid=2001 --clear-groups env HOME="$W" LWIO_KNOWN_HOSTS="$kh" LWIO_FINGERPRINT="$FP" \
    "$LWIO" cp --provider soft --user dave --password-file "$W/dave-2001.pw" "$W/src-2001" "$URL/data/by-cli" 2>"$W/cli.err" &&
    [ "$(stat -c %u:%g "$W/data/by-cli")" = 2001:2001 ] && cmp -s "$W/src-2001" "$W/data/by-cli"; then
    pass "cli: lwio cp run by uid 2001 writes a file of 2001:2001, byte for byte"
  else
    fail cli "$(cat "$W/cli.err"); $(stat -c %u:%g "$W/data/by-cli" 2>&1)"
  fi
}

pg() { # as the postgres user
  setpriv --reuid=postgres --regid=postgres --init-groups env -i PATH="$PGBIN:/usr/bin:/bin" HOME=/tmp "$@"
}

pg_run_bench() { # pgdata socket-dir port seconds log
  pg "$PGBIN/pgbench" -h "$2" -p "$3" -c 4 -T "$4" -n postgres >>"$5" 2>&1
}

case_postgres() {
  [ -n "$PGBIN" ] || { fail postgres "PostgreSQL is not installed (apt-get install postgresql)"; return; }
  local D=$W/mnt/pg S=$W/pgsock P=$(( PORT + 7 )) L=$W/pg.log secs=${PG_SECONDS:-20}
  mkdir -p "$S"; chown postgres:postgres "$S"
  # The database's directory, made by root on the mount and given to postgres.
  mkdir "$D" && chown postgres:postgres "$D" && chmod 700 "$D" || { fail postgres "mkdir/chown on the mount"; return; }
  if ! pg "$PGBIN/initdb" -k -D "$D/data" >"$L" 2>&1; then
    tail -5 "$L"; fail postgres "initdb -k as postgres failed"; return
  fi
  [ "$(stat -c %U "$W/data/pg/data/PG_VERSION")" = postgres ] || { fail postgres "files are not postgres's on the server"; return; }
  local opts="-c unix_socket_directories=$S -c listen_addresses= -p $P"
  pg "$PGBIN/pg_ctl" -D "$D/data" -l "$S/server.log" -o "$opts" -w start >>"$L" 2>&1 || { tail -20 "$S/server.log"; fail postgres "pg_ctl start"; return; }
  pg "$PGBIN/pgbench" -h "$S" -p $P -i -s 10 postgres >>"$L" 2>&1 || { tail -5 "$L"; fail postgres "pgbench -i"; return; }
  pg_run_bench "$D" "$S" $P "$secs" "$L" || { tail -5 "$L"; fail postgres "pgbench"; return; }
  local tps; tps=$(grep -o 'tps = [0-9.]*' "$L" | tail -1)
  pg "$PGBIN/psql" -h "$S" -p $P -qc 'CREATE EXTENSION IF NOT EXISTS amcheck' postgres >>"$L" 2>&1
  pg "$PGBIN/pg_amcheck" -h "$S" -p $P --heapallindexed postgres >>"$L" 2>&1 || { tail -5 "$L"; fail postgres "pg_amcheck"; return; }
  # Kill the server during a run; restart it; the mount reconnects.
  pg_run_bench "$D" "$S" $P "$secs" "$W/pg-kill.log" &
  local bench=$!
  sleep $(( secs / 3 + 1 ))
  kill -9 "$SERVER_PID"; wait "$SERVER_PID" 2>/dev/null
  sleep 2
  start_server 2
  wait "$bench"
  echo "pgbench across the kill: rc=$? $(grep -o 'tps = [0-9.]*' "$W/pg-kill.log" | tail -1)" >>"$L"
  # Calls made while the server is away fail (EIO, a soft mount); once it
  # is back, open files work again: never EBADF from a handle of the lost
  # session (lseek(SEEK_END) asks the attributes by handle).
  if grep -q "Bad file descriptor" "$W/pg-kill.log" "$S/server.log"; then
    grep -m3 "Bad file descriptor" "$W/pg-kill.log" "$S/server.log"
    fail postgres "EBADF after the server came back"; return
  fi
  # PostgreSQL may have stopped on an I/O error (a PANIC is its answer to
  # a failed fsync): restart it; crash recovery replays the WAL.
  pg "$PGBIN/pg_ctl" -D "$D/data" -m immediate stop >>"$L" 2>&1
  pg "$PGBIN/pg_ctl" -D "$D/data" -l "$S/server.log" -o "$opts" -w start >>"$L" 2>&1 || { tail -20 "$S/server.log"; fail postgres "restart after the server kill"; return; }
  pg_run_bench "$D" "$S" $P 5 "$L" || { tail -5 "$L"; fail postgres "pgbench after recovery"; return; }
  pg "$PGBIN/pg_amcheck" -h "$S" -p $P --heapallindexed postgres >>"$L" 2>&1 || { tail -5 "$L"; fail postgres "pg_amcheck after the kill"; return; }
  pg "$PGBIN/pg_ctl" -D "$D/data" -w stop >>"$L" 2>&1 || { fail postgres "pg_ctl stop"; return; }
  if pg "$PGBIN/pg_checksums" -c -D "$D/data" >>"$L" 2>&1 && grep -q "Bad checksums:  *0" "$L"; then
    pass "postgres: initdb -k, pgbench -s 10 ($tps), pg_amcheck, a server SIGKILL and restart mid-run, pg_amcheck again, pg_checksums: 0 bad"
  else
    tail -8 "$L"; fail postgres "pg_checksums"
  fi
}

CASES=(${@:-posix squash fsyncdir cli postgres})
for c in "${CASES[@]}"; do
  T0=$(date +%s); RUN=$((RUN + 1))
  "case_$c"
done
echo "identity-tests: $RUN case groups, $FAILS failure(s)"
[ "$FAILS" = 0 ]
