#!/bin/bash
# pgbench.sh - PostgreSQL 15 (pgbench) on an `lwio mount`, on bindfs and on the local directory,
# side by side, in one run.
#
# Each system gets a fresh data directory; the systems run one after another (never at once):
#   local    a directory on the local disk ($PG_ROOT/local)
#   bindfs   bindfs (a FUSE passthrough) of a local directory
#   lwio     `lwio serve --provider soft` (as root, bench/one-host.toml) exporting $PG_ROOT/export
#            with identity = "client", and `lwio mount -o allow_other,default_permissions` of it,
#            data over soft iWARP
#   NAME     more lwio mounts of the same export with other options (--variant NAME=OPTS)
# The data directory is made by root (through the mount) and given to postgres; then, as the
# `postgres` user: initdb -k (data checksums), postgres on its own port with its
# unix socket in a temp dir, pgbench -i -s SCALE, pgbench -c CLIENTS -T SECS, pg_amcheck
# --heapallindexed (with --install-missing), then after a clean stop pg_checksums -c.
# Prints TPS, latency average, the ratio to local, the checks, and every exact command.
#
# usage:  bench/pgbench.sh [-T SECS] [-s SCALE] [-c CLIENTS] [--systems "local bindfs lwio"]
#                          [--lwio-opts OPTS] [--variant NAME=OPTS]... [--kill-at SECS]
#                          [--server-config "SECTION.KEY = VALUE"]... [--probe N]
#   -T SECS          pgbench run time (default 30)
#   -s SCALE         pgbench -i scale (default 10)
#   -c CLIENTS       pgbench clients (and -j threads: min(CLIENTS, nproc)) (default 4)
#   --systems LIST   which systems, in order (default "local bindfs lwio" plus the variants)
#   --lwio-opts OPTS more -o options for the `lwio` mount (allow_other,default_permissions always given)
#   --variant N=OPTS[@BIN]  one more lwio mount, named N, with -o allow_other,default_permissions,OPTS;
#                    @BIN mounts it with another lwio binary (e.g. an older build, for before/after)
#   --server-config L one more line of `lwio serve`'s configuration (dotted TOML key, e.g.
#                    "rdma.inline_when_alone = false"), after bench/one-host.toml's
#   --probe N        instead of PostgreSQL, what one commit costs: N x (pwrite 8 KiB at the end of a
#                    file, then fdatasync), a WAL commit's shape, run by python3 as postgres in each
#                    system's data directory; prints write and fdatasync µs (mean, p50, p99)
#   --kill-at SECS   on every lwio system, kill -9 `lwio serve` SECS into the pgbench run and
#                    start it again 1 s later (same port, same export): the mount reconnects;
#                    postgres is started again if it stopped, then the checks run as usual
# env:    PG_ROOT (default /tmp/pg-bench; removed and made again), PG_PORT (first of the
#         ports, default 7600), LWIO_BIN (default target/release/lwio, built if missing),
#         RUST_LOG for the mount's log ($PG_ROOT/mount-NAME.log: its unmount line counts what it
#         served)
# Needs root (the server, mounts, runuser). Installs postgresql-15 and bindfs if missing.
set -u
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/.." && pwd)
ROOT=${PG_ROOT:-/tmp/pg-bench}
BASEPORT=${PG_PORT:-7600}
LWIO=${LWIO_BIN:-$REPO/target/release/lwio}
T=30 SCALE=10 CLIENTS=4 SYSTEMS="" LWIO_OPTS="" KILL_AT="" SERVER_EXTRA="" PROBE=""
declare -A VARIANT=()
VNAMES=()
while [ $# -gt 0 ]; do
  case $1 in
    -T) T=$2; shift 2 ;;
    -s) SCALE=$2; shift 2 ;;
    -c) CLIENTS=$2; shift 2 ;;
    --systems) SYSTEMS=$2; shift 2 ;;
    --lwio-opts) LWIO_OPTS=$2; shift 2 ;;
    --variant) VARIANT[${2%%=*}]=${2#*=}; VNAMES+=("${2%%=*}"); shift 2 ;;
    --kill-at) KILL_AT=$2; shift 2 ;;
    --probe) PROBE=$2; shift 2 ;;
    --server-config) SERVER_EXTRA+="$2"$'\n'; shift 2 ;;
    -h|--help) sed -n '2,40p' "$0"; exit 0 ;;
    *) echo "pgbench.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
[ -n "$SYSTEMS" ] || SYSTEMS="local bindfs lwio ${VNAMES[*]:-}"
[ "$(id -u)" = 0 ] || { echo "pgbench.sh: run as root" >&2; exit 2; }

# ---- what it needs
PGBIN=/usr/lib/postgresql/15/bin
if [ ! -x "$PGBIN/pgbench" ]; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q postgresql-15 >&2 ||
    { apt-get update -q >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q postgresql-15 >&2; } || exit 1
fi
command -v bindfs >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -q bindfs >&2 || exit 1
id postgres >/dev/null 2>&1 || { echo "pgbench.sh: no postgres user" >&2; exit 1; }
[ -x "$LWIO" ] || (cd "$REPO" && cargo build --release -q -p lwio) || exit 1
JOBS=$(( CLIENTS < $(nproc) ? CLIENTS : $(nproc) ))

SERVER=""
cleanup() {
  for s in $SYSTEMS; do
    [ -f "$ROOT/$s/pgdata/postmaster.pid" ] && runuser -u postgres -- "$PGBIN/pg_ctl" -D "$ROOT/$s/pgdata" -m immediate stop >/dev/null 2>&1
  done
  for m in "$ROOT"/m-*; do mountpoint -q "$m" && { fusermount3 -u "$m" 2>/dev/null || umount -l "$m"; }; done
  [ -n "$SERVER" ] && kill "$SERVER" 2>/dev/null
  wait 2>/dev/null
}
trap cleanup EXIT
for m in "$ROOT"/m-*; do mountpoint -q "$m" && { echo "pgbench.sh: $m is still mounted" >&2; exit 1; }; done
rm -rf "$ROOT"
mkdir -p "$ROOT"/{export,local,bsrc,home,sock,log}
chmod 755 "$ROOT"
chown postgres: "$ROOT/sock" "$ROOT/local" "$ROOT/bsrc" "$ROOT/log"
export HOME=$ROOT/home LWIO_KNOWN_HOSTS=$ROOT/home/known_hosts
: >"$ROOT/commands.txt"
cmd() { echo "$*" >>"$ROOT/commands.txt"; }

SPORT=$((BASEPORT + 90))
# The export as a database's is set up (docs/config.md, "Identities"): files
# belong to whoever made them through the mount, and root stays root so that
# the script can make the data directory and give it to postgres.
write_config() {
  cat "$HERE/one-host.toml" >"$ROOT/lwio.toml"
  printf '%s' "$SERVER_EXTRA" >>"$ROOT/lwio.toml"
  cat >>"$ROOT/lwio.toml" <<EOF

[exports]
data = { path = "$ROOT/export", identity = "client", trust_client_ids = ["*"], root_squash = false }
EOF
}
# serve: `lwio serve` of the export, in the background (also the restart of --kill-at).
serve() {
  "$LWIO" serve --config "$ROOT/lwio.toml" \
    --listen "127.0.0.1:$SPORT" --provider soft >>"$ROOT/serve.log" 2>&1 &
}
start_server() {
  write_config
  serve
  SERVER=$!
  for _ in $(seq 100); do grep -q "RDMA listening" "$ROOT/serve.log" && break; sleep 0.1; done
  FP=$(grep -o 'sha256:[0-9A-F:]*' "$ROOT/serve.log" | head -1)
  [ -n "$FP" ] || { echo "pgbench.sh: lwio serve did not start" >&2; cat "$ROOT/serve.log" >&2; exit 1; }
  export LWIO_FINGERPRINT=$FP
}
cmd "$LWIO serve --config $ROOT/lwio.toml --listen 127.0.0.1:$SPORT --provider soft   # bench/one-host.toml + ${SERVER_EXTRA//$'\n'/ + }[exports] data = { path = \"$ROOT/export\", identity = \"client\", trust_client_ids = [\"*\"], root_squash = false }"

# setup NAME -> the data directory's parent, made ready for postgres
setup() {
  local s=$1 d
  case $s in
    local) mkdir "$ROOT/local/pgdata" && chown postgres: "$ROOT/local/pgdata" && echo "$ROOT/local" ;;
    bindfs)
      mkdir -p "$ROOT/m-bindfs"
      cmd "bindfs $ROOT/bsrc $ROOT/m-bindfs"
      bindfs "$ROOT/bsrc" "$ROOT/m-bindfs" >&2 || return 1
      mkdir "$ROOT/m-bindfs/pgdata" && chown postgres: "$ROOT/m-bindfs/pgdata" || return 1
      echo "$ROOT/m-bindfs" ;;
    *)
      local opts=allow_other,default_permissions bin=$LWIO v
      if [ "$s" = lwio ]; then [ -n "$LWIO_OPTS" ] && opts+=",$LWIO_OPTS"
      else
        v=${VARIANT[$s]}
        [[ $v == *@* ]] && { bin=${v#*@}; v=${v%@*}; }
        opts+=",$v"
      fi
      opts=${opts%,}
      d=$ROOT/m-$s
      mkdir -p "$d"
      cmd "$bin mount --daemon --log $ROOT/mount-$s.log lwio://127.0.0.1:$SPORT/data $d --provider soft -o $opts"
      "$bin" mount --daemon --log "$ROOT/mount-$s.log" "lwio://127.0.0.1:$SPORT/data" "$d" --provider soft -o "$opts" >&2 || return 1
      # Made through the mount by root, then given to postgres, as on a local disk; what
      # postgres creates in it is postgres's own (identity = "client").
      mkdir -p "$d/$s/pgdata" && chown postgres: "$d/$s/pgdata" || return 1
      echo "$d/$s" ;;
  esac
}

pg() { runuser -u postgres -- "$@"; }
for s in $SYSTEMS; do
  case $s in local|bindfs) ;; *) [ -n "$SERVER" ] || start_server ;; esac
done
declare -A TPS LAT AMC CSUM NOTE PROBED
# probe DIR: --probe's commits in DIR, as postgres -> "w_mean w_p50 w_p99 s_mean s_p50 s_p99" (µs)
probe() {
  cmd "[$2] python3: $PROBE x (os.pwrite 8 KiB at the end of $1/wal, os.fdatasync)"
  pg python3 - "$1/wal" "$PROBE" <<'PY'
import os, sys, time
path, n = sys.argv[1], int(sys.argv[2])
fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
buf = os.urandom(8192)
w, s = [], []
for i in range(n):
    t0 = time.perf_counter_ns()
    os.pwrite(fd, buf, i * 8192)
    t1 = time.perf_counter_ns()
    os.fdatasync(fd)
    t2 = time.perf_counter_ns()
    w.append((t1 - t0) / 1000)
    s.append((t2 - t1) / 1000)
os.close(fd)
def st(v):
    v2 = sorted(v)
    return "%.0f %.0f %.0f" % (sum(v) / len(v), v2[len(v2) // 2], v2[int(len(v2) * 0.99)])
print(st(w), st(s))
PY
}
unmount_system() { # $1 system, $2 its base directory
  if [[ $2 == "$ROOT"/m-* ]]; then
    local m=${2%/"$1"}
    [ "$1" = bindfs ] && m=$2
    fusermount3 -u "$m" || umount "$m"
    sleep 0.5
  fi
}
i=0
for s in $SYSTEMS; do
  i=$((i + 1))
  port=$((BASEPORT + i))
  base=$(setup "$s") || { echo "pgbench.sh: $s: setup failed" >&2; NOTE[$s]="setup failed"; continue; }
  D=$base/pgdata
  if [ -n "$PROBE" ]; then
    PROBED[$s]=$(probe "$D" "$s") || NOTE[$s]="probe failed"
    unmount_system "$s" "$base"
    echo "   $s: ${PROBED[$s]:-?}" >&2
    continue
  fi
  sock=$ROOT/sock/$s
  mkdir -p "$sock" && chown postgres: "$sock"
  echo "== $s: $D (port $port)" >&2
  cmd "[$s] initdb -k -D $D"
  pg "$PGBIN/initdb" -k -D "$D" -A trust >"$ROOT/initdb-$s.log" 2>&1 ||
    { NOTE[$s]="initdb failed (initdb-$s.log)"; continue; }
  pgopts="-p $port -k $sock -c listen_addresses=''"
  cmd "[$s] pg_ctl -D $D -o \"$pgopts\" -l $ROOT/log/pg-$s.log -w start"
  pg "$PGBIN/pg_ctl" -D "$D" -o "$pgopts" -l "$ROOT/log/pg-$s.log" -w start >/dev/null ||
    { NOTE[$s]="postgres did not start (log/pg-$s.log)"; continue; }
  cmd "[$s] pgbench -h $sock -p $port -i -s $SCALE postgres"
  pg "$PGBIN/pgbench" -h "$sock" -p "$port" -i -s "$SCALE" postgres >"$ROOT/init-$s.log" 2>&1 ||
    NOTE[$s]="pgbench -i failed"
  cmd "[$s] pgbench -h $sock -p $port -c $CLIENTS -j $JOBS -T $T postgres"
  killer=""
  if [ -n "$KILL_AT" ] && [ -n "$SERVER" ] && [[ $base == "$ROOT"/m-* ]] && [ "$s" != bindfs ]; then
    ( sleep "$KILL_AT"; kill -9 "$SERVER"; echo "killed lwio serve at ${KILL_AT}s" >&2; sleep 1
      serve
      echo $! >"$ROOT/server.pid"; wait ) &
    killer=$!
  fi
  pg "$PGBIN/pgbench" -h "$sock" -p "$port" -c "$CLIENTS" -j "$JOBS" -T "$T" postgres >"$ROOT/run-$s.log" 2>&1
  rc=$?
  if [ -n "$killer" ]; then
    for _ in $(seq 50); do [ -s "$ROOT/server.pid" ] && break; sleep 0.1; done
    SERVER=$(cat "$ROOT/server.pid")
    NOTE[$s]="server killed at ${KILL_AT}s and restarted; pgbench rc=$rc"
    # postgres may have stopped (a PANIC on EIO): start it again (crash recovery).
    if ! pg "$PGBIN/pg_ctl" -D "$D" status >/dev/null 2>&1; then
      sleep 2
      pg "$PGBIN/pg_ctl" -D "$D" -o "$pgopts" -l "$ROOT/log/pg-$s.log" -w -t 120 start >/dev/null ||
        NOTE[$s]+="; postgres did not start again"
      NOTE[$s]+="; postgres restarted"
    fi
  elif [ $rc != 0 ]; then
    NOTE[$s]="pgbench rc=$rc"
  fi
  TPS[$s]=$(sed -n 's/^tps = \([0-9.]*\) (without initial connection time)/\1/p' "$ROOT/run-$s.log")
  LAT[$s]=$(sed -n 's/^latency average = \([0-9.]*\) ms/\1/p' "$ROOT/run-$s.log")
  cmd "[$s] pg_amcheck -h $sock -p $port --install-missing --heapallindexed -d postgres"
  if pg "$PGBIN/pg_amcheck" -h "$sock" -p "$port" --install-missing --heapallindexed -d postgres >"$ROOT/amcheck-$s.log" 2>&1; then
    AMC[$s]=clean
  else AMC[$s]="FAILED (amcheck-$s.log)"; fi
  cmd "[$s] pg_ctl -D $D -m fast -w stop"
  pg "$PGBIN/pg_ctl" -D "$D" -m fast -w stop >/dev/null || NOTE[$s]+="; stop failed"
  cmd "[$s] pg_checksums -c -D $D"
  if pg "$PGBIN/pg_checksums" -c -D "$D" >"$ROOT/checksums-$s.log" 2>&1; then
    CSUM[$s]="clean ($(sed -n 's/^Blocks scanned: *//p' "$ROOT/checksums-$s.log") blocks)"
  else CSUM[$s]="FAILED (checksums-$s.log)"; fi
  unmount_system "$s" "$base"
  echo "   $s: ${TPS[$s]:-?} TPS, ${LAT[$s]:-?} ms; amcheck ${AMC[$s]}; checksums ${CSUM[$s]} ${NOTE[$s]:-}" >&2
done

# ---- report
ratio() { python3 -c "a,b='$1','$2'
print('%.2f' % (float(a)/float(b)) if a and b and float(b) else '-')" 2>/dev/null || echo -; }
if [ -n "$PROBE" ]; then
  echo "## One commit (8 KiB pwrite + fdatasync, as postgres): lwio mount vs bindfs vs local — $(date -u +%Y-%m-%d)"
  echo
  echo "Machine: $(nproc) vCPU, $(free -g | awk '/Mem:/{print $2}') GiB, $(uname -r); load before: $(cut -d' ' -f1-3 /proc/loadavg)."
  echo "Produced by \`bench/pgbench.sh --probe $PROBE\` (lwio $(cd "$REPO" && git rev-parse --short HEAD)); $ROOT on $(df --output=fstype "$ROOT" | tail -1)."
  echo
  echo "| system | write µs mean / p50 / p99 | fdatasync µs mean / p50 / p99 | commit : local | note |"
  echo "| --- | --- | --- | --- | --- |"
  read -r lw _ _ ls _ _ <<<"${PROBED[local]:-0 0 0 0 0 0}"
  for s in $SYSTEMS; do
    read -r a b c d e f <<<"${PROBED[$s]:-- - - - - -}"
    r=$(python3 -c "a,d,lw,ls='$a','$d','$lw','$ls'
print('%.2f' % ((float(a)+float(d))/(float(lw)+float(ls))))" 2>/dev/null || echo -)
    echo "| $s | $a / $b / $c | $d / $e / $f | $r | ${NOTE[$s]:-} |"
  done
  echo
  echo "Commands:"
  echo
  sed 's/^/    /' "$ROOT/commands.txt"
  exit 0
fi
echo "## PostgreSQL 15 pgbench: lwio mount vs bindfs vs local — $(date -u +%Y-%m-%d)"
echo
echo "Machine: $(nproc) vCPU, $(free -g | awk '/Mem:/{print $2}') GiB, $(uname -r); load before: $(cut -d' ' -f1-3 /proc/loadavg)."
echo "Produced by \`bench/pgbench.sh -T $T -s $SCALE -c $CLIENTS${KILL_AT:+ --kill-at $KILL_AT}\` (lwio $(cd "$REPO" && git rev-parse --short HEAD)); $ROOT on $(df --output=fstype "$ROOT" | tail -1)."
echo
echo "| system | TPS | latency avg, ms | TPS : local | pg_amcheck | pg_checksums | note |"
echo "| --- | --- | --- | --- | --- | --- | --- |"
for s in $SYSTEMS; do
  echo "| $s | ${TPS[$s]:--} | ${LAT[$s]:--} | $(ratio "${TPS[$s]:-}" "${TPS[local]:-}") | ${AMC[$s]:--} | ${CSUM[$s]:--} | ${NOTE[$s]:-} |"
done
echo
echo "Commands (as postgres: runuser -u postgres -- $PGBIN/…):"
echo
sed 's/^/    /' "$ROOT/commands.txt"
for s in $SYSTEMS; do
  [ -f "$ROOT/mount-$s.log" ] && grep -ho "was unmounted.*" "$ROOT/mount-$s.log" | tail -1 | sed "s/^/    mount $s: /"
done
exit 0
