#!/usr/bin/env bash
# bench/scale.sh - one server, many clients (issue 13; crates/lwio/src/bin/lwio-scale.rs).
#
# Starts `lwio serve` (soft provider, loopback) on a tmpfs export and runs
# lwio-scale against it:
#   - QD1 4 KiB random-read p50/p99 of one client alone;
#   - aggregate 4 KiB random-read IOPS with jobs 1, 2, 4, 16, 64, 256 at QD 8;
#   - idle connections 1, 10, 100, 250, 500, 1000: connect time, and per idle
#     connection the server's RSS, registered bytes and threads;
#   - the QD1 client again beside 999 idle ones, and the ratios.
#
# The server keeps its defaults except what one host standing for many
# clients needs: every client here comes from 127.0.0.1 and logs in with the
# one token (one user), so the per-host and per-user limits and the
# unauthenticated-connection rate limits are raised (printed below). Where a
# default stops the run (before issue 13's reactors and shared receive pool:
# the 512 MiB registered-memory budget at about 60 connections of ~8.5 MiB,
# then the cap of 256), lwio-scale prints the connection it stopped at and
# the client's error line.
#
#   bench/scale.sh                        # the defaults
#   bench/scale.sh --config-extra 'rdma.max_write_size = 1024' \
#                  --config-extra 'limits.max_rdma_connections = 1100' \
#                  --config-extra 'limits.max_sessions = 1100'
#   bench/scale.sh --connections 1,10 --jobs 1,2 --runtime 2s --latency-runtime 2s
#
# --config-extra 'SECTION.KEY = VALUE' (docs/config.md; dotted TOML keys)
# adds a setting or replaces one of the script's; --bin DIR runs the lwio
# and lwio-scale found in DIR instead of building them (an A/B of two
# builds); other arguments go to lwio-scale. Mounts a tmpfs for the export when run as root, else uses
# /dev/shm.
#
# --pin puts the server on CPU 0 and lwio-scale on the others (taskset):
# the clients of a real deployment run on other machines, and unpinned, on
# two CPUs, 256 client threads take turns with the server's reactors on
# both (bench/RESULTS.md, "2026-11-26 (12:20–13:10): a standby clock ...").
set -euo pipefail
cd "$(dirname "$0")/.."

EXTRA=()
PASS=()
BIN=
PIN=
while [ $# -gt 0 ]; do
  case "$1" in
    --pin) PIN=1; shift ;;
    --bin) BIN=$2; shift 2 ;;
    --bin=*) BIN=${1#*=}; shift ;;
    --config-extra) EXTRA+=("$2"); shift 2 ;;
    --config-extra=*) EXTRA+=("${1#*=}"); shift ;;
    *) PASS+=("$1"); shift ;;
  esac
done

if [ -z "$BIN" ]; then
  cargo build --release -q -p lwio --bin lwio --bin lwio-scale
  BIN=${CARGO_TARGET_DIR:-target}/release
fi

if [ "$(id -u)" = 0 ]; then
  WORK=$(mktemp -d /tmp/lwio-scale.XXXXXX)
else
  WORK=$(mktemp -d /dev/shm/lwio-scale.XXXXXX)
fi
EXPORT=$WORK/export
mkdir -p "$EXPORT"
SERVER=
cleanup() {
  if [ -n "$SERVER" ]; then kill "$SERVER" 2>/dev/null || true; wait "$SERVER" 2>/dev/null || true; fi
  umount "$EXPORT" 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT
if [ "$(id -u)" = 0 ]; then
  mount -t tmpfs -o size=256m,mode=0755 lwio-scale "$EXPORT"
fi

# The configuration (bench/one-host.toml, and --config-extra).
CONF=$WORK/lwio.toml
cp bench/one-host.toml "$CONF"
for e in "${EXTRA[@]}"; do
  key=$(printf '%s' "${e%%=*}" | tr -d '[:space:]')
  [ -n "$key" ] && [ "$key" != "$e" ] || { echo "bench/scale.sh: --config-extra wants 'SECTION.KEY = VALUE', got: $e" >&2; exit 2; }
  grep -v "^${key//./\\.} *=" "$CONF" >"$CONF.new" || true
  printf '%s\n' "$e" >>"$CONF.new"
  mv "$CONF.new" "$CONF"
done

# Descriptors: about 6 per connection in the server, 8 per client here.
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true

echo "bench/scale.sh: $(date -u '+%Y-%m-%d %H:%M UTC'); $(nproc) CPUs, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //'), kernel $(uname -r); RLIMIT_NOFILE $(ulimit -n)"
echo "bench/scale.sh: all clients come from 127.0.0.1 and log in with one token (one user): the per-host"
echo "  and per-user limits and the unauthenticated-connection rate limits are raised; the rest is lwio serve's"
echo "  defaults (docs/config.md) plus any --config-extra. The server's configuration:"
grep -v '^#' "$CONF" | sed 's/^/    /'

SERVER_CPUS=()
CLIENT_CPUS=()
if [ -n "$PIN" ]; then
  NCPU=$(nproc)
  if [ "$NCPU" -lt 2 ]; then
    echo "bench/scale.sh: --pin needs 2 CPUs or more (this machine has $NCPU)" >&2
    exit 2
  fi
  SERVER_CPUS=(taskset -c 0)
  CLIENT_CPUS=(taskset -c "1-$((NCPU - 1))")
  echo "bench/scale.sh: --pin: the server on CPU 0, lwio-scale on CPUs 1-$((NCPU - 1))"
fi

"${SERVER_CPUS[@]}" "$BIN/lwio" serve --config "$CONF" --export "scale=$EXPORT" \
  --listen 127.0.0.1:0 --rdma-listen 127.0.0.1:0 --metrics 127.0.0.1:0 \
  --token-file "$WORK/token" --ready-file "$WORK/ready" --no-tls --provider soft \
  >"$WORK/server.out" 2>"$WORK/server.log" &
SERVER=$!
for _ in $(seq 300); do
  [ -s "$WORK/ready" ] && break
  kill -0 "$SERVER" 2>/dev/null || { echo "bench/scale.sh: lwio serve exited:" >&2; cat "$WORK/server.log" >&2; exit 2; }
  sleep 0.1
done
SIDE=$(head -1 "$WORK/ready")
METRICS=$(sed -n 's|^lwio: metrics on http://\(.*\)/metrics$|\1|p' "$WORK/server.out")
[ -n "$SIDE" ] && [ -n "$METRICS" ] || { echo "bench/scale.sh: lwio serve did not start" >&2; cat "$WORK/server.log" >&2; exit 2; }

"${CLIENT_CPUS[@]}" "$BIN/lwio-scale" --url "lwio://$SIDE/scale" --token-file "$WORK/token" \
  --server-pid "$SERVER" --metrics "$METRICS" "${PASS[@]}"

# What the server said about the connections it refused.
if grep -qiE 'busy|out of receive memory|refus|reject' "$WORK/server.log"; then
  echo "bench/scale.sh: the server's log on refusals (count, message):"
  grep -iE 'busy|out of receive memory|refus|reject' "$WORK/server.log" \
    | sed -E 's/^[^ ]+ +//; s/[0-9]+\.[0-9]+\.[0-9]+\.[0-9]+:[0-9]+/ADDR/g' | sort | uniq -c | sort -rn | head -5
fi
