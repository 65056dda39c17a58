#!/bin/bash
# commit-latency.sh - what one database commit costs: N x (pwrite 8 KiB at the end of a file, then
# fdatasync), the shape of a WAL commit, on the local directory, on bindfs (a FUSE passthrough) and
# on `lwio mount`s with various options, side by side in one run.
#
# usage:  bench/commit-latency.sh [-n N] [--systems "local bindfs lwio"] [--variant NAME=OPTS[@BIN]]...
#                                [--server-config "SECTION.KEY = VALUE"]...
#   -n N             commits per system (default 3000)
#   --variant N=OPTS one more lwio mount, named N, with -o OPTS (after allow_other); @BIN mounts
#                    it with another lwio binary
#   --server-config L one more line of `lwio serve`'s configuration (dotted TOML key, e.g.
#                    "rdma.inline_when_alone = false"), after bench/one-host.toml's
# Prints per system: write µs and fdatasync µs (mean, p50, p99) and the ratio of a commit to the
# local one, and the exact commands. env: CL_ROOT (default /tmp/commit-lat; removed and made again),
# LWIO_BIN (default target/release/lwio). Needs root (the server runs as root, as in pgbench.sh).
set -u
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/.." && pwd)
ROOT=${CL_ROOT:-/tmp/commit-lat}
LWIO=${LWIO_BIN:-$REPO/target/release/lwio}
N=3000 SYSTEMS="" SERVER_EXTRA=""
declare -A VARIANT=()
VNAMES=()
while [ $# -gt 0 ]; do
  case $1 in
    -n) N=$2; shift 2 ;;
    --systems) SYSTEMS=$2; shift 2 ;;
    --variant) VARIANT[${2%%=*}]=${2#*=}; VNAMES+=("${2%%=*}"); shift 2 ;;
    --server-config) SERVER_EXTRA+="$2"$'\n'; shift 2 ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) echo "commit-latency.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
[ -n "$SYSTEMS" ] || SYSTEMS="local bindfs lwio ${VNAMES[*]:-}"
[ "$(id -u)" = 0 ] || { echo "commit-latency.sh: run as root" >&2; exit 2; }
[ -x "$LWIO" ] || { echo "commit-latency.sh: no $LWIO (cargo build --release)" >&2; exit 2; }
command -v bindfs >/dev/null || { echo "commit-latency.sh: bindfs is not installed (apt-get install bindfs)" >&2; exit 2; }

SERVER=""
cleanup() {
  for m in "$ROOT"/m-*; do mountpoint -q "$m" && { fusermount3 -u "$m" 2>/dev/null || umount -l "$m"; }; done
  [ -n "$SERVER" ] && kill "$SERVER" 2>/dev/null && wait "$SERVER" 2>/dev/null
}
trap cleanup EXIT
rm -rf "$ROOT"
mkdir -p "$ROOT/local" "$ROOT/bsrc" "$ROOT/export" "$ROOT/home"
export HOME=$ROOT/home LWIO_KNOWN_HOSTS=$ROOT/home/known_hosts
SPORT=${CL_PORT:-7790}
cat "$HERE/one-host.toml" >"$ROOT/lwio.toml"
printf '%s' "$SERVER_EXTRA" >>"$ROOT/lwio.toml"
printf '\n[exports]\ndata = { path = "%s", identity = "client", trust_client_ids = ["*"], root_squash = false }\n' \
  "$ROOT/export" >>"$ROOT/lwio.toml"

echo "# commands"
echo "$LWIO serve --config $ROOT/lwio.toml --listen 127.0.0.1:$SPORT --provider soft   # bench/one-host.toml + ${SERVER_EXTRA//$'\n'/ + }[exports] data (identity = client)"
"$LWIO" serve --config "$ROOT/lwio.toml" --listen "127.0.0.1:$SPORT" --provider soft >"$ROOT/serve.log" 2>&1 &
SERVER=$!
for _ in $(seq 100); do grep -q "RDMA listening" "$ROOT/serve.log" && break; sleep 0.1; done
FP=$(grep -o 'sha256:[0-9A-F:]*' "$ROOT/serve.log" | head -1)
[ -n "$FP" ] || { echo "commit-latency.sh: lwio serve did not start" >&2; cat "$ROOT/serve.log" >&2; exit 1; }
export LWIO_FINGERPRINT=$FP

probe() { # DIR -> "write_mean write_p50 write_p99 sync_mean sync_p50 sync_p99"
  python3 - "$1/wal" "$N" <<'PY'
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

declare -A RES=()
for s in $SYSTEMS; do
  case $s in
    local) d=$ROOT/local ;;
    bindfs) d=$ROOT/m-bindfs; mkdir -p "$d"; echo "bindfs $ROOT/bsrc $d"; bindfs "$ROOT/bsrc" "$d" || exit 1 ;;
    *)
      opts=allow_other bin=$LWIO
      if [ "$s" != lwio ]; then
        v=${VARIANT[$s]}
        [[ $v == *@* ]] && { bin=${v#*@}; v=${v%@*}; }
        [ -n "$v" ] && opts+=",$v"
      fi
      d=$ROOT/m-$s; mkdir -p "$d"
      echo "$bin mount --daemon --log $ROOT/mount-$s.log lwio://127.0.0.1:$SPORT/data $d --provider soft -o $opts"
      "$bin" mount --daemon --log "$ROOT/mount-$s.log" "lwio://127.0.0.1:$SPORT/data" "$d" --provider soft -o "$opts" || exit 1
      mkdir -p "$d/$s"; d=$d/$s ;;
  esac
  RES[$s]=$(probe "$d") || exit 1
  case $s in local) ;; *) m=${d%/"$s"}; [ "$s" = bindfs ] && m=$d; fusermount3 -u "$m" ;; esac
done
echo
echo "# $N x (pwrite 8 KiB, fdatasync), python3 os.pwrite/os.fdatasync; µs"
printf '%-10s %8s %8s %8s %10s %8s %8s %10s\n' system w_mean w_p50 w_p99 sync_mean s_p50 s_p99 "÷ local"
read -r _ _ _ _ _ _ <<<"${RES[local]:-0 0 0 0 0 0}"
lw=$(awk '{print $1 + $4}' <<<"${RES[local]:-0 0 0 0 0 0}")
for s in $SYSTEMS; do
  read -r a b c d e f <<<"${RES[$s]}"
  r=$(awk -v x="$a" -v y="$d" -v l="$lw" 'BEGIN { if (l > 0) printf "%.2f", (x + y) / l; else print "-" }')
  printf '%-10s %8s %8s %8s %10s %8s %8s %10s\n' "$s" "$a" "$b" "$c" "$d" "$e" "$f" "$r"
done
