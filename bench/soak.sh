#!/usr/bin/env bash
# bench/soak.sh - the fault-injection soak of issue 14 (crates/lwio/src/bin/lwio-soak.rs).
#
# 4 clients with a mixed workload (random 1 B-1 MiB writes and reads) while
# the server is SIGKILLed and restarted, its connections cut (ss -K), paused
# (SIGSTOP 2 s) and its export's file system filled, in shuffled rounds every
# 2-4 s; then every acknowledged byte is read back. Prints one line and exits
# non-zero if any acknowledged byte was lost.
#
# Needs root: the export is a small tmpfs mounted here (and unmounted on exit)
# so that filling it is harmless, and ss -K needs CAP_NET_ADMIN.
#
#   bench/soak.sh                       # 150 s of faults (CI), ~3 min in all
#   bench/soak.sh --duration 30m        # by hand
#   LWIO_SOAK_DURATION=10m bench/soak.sh
# Extra arguments go to lwio-soak (--seed N repeats a run's workload and fault order).
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "bench/soak.sh: needs root (mounts a tmpfs for the export, ss -K)" >&2; exit 2; }
command -v ss >/dev/null || { echo "bench/soak.sh: needs ss (iproute2)" >&2; exit 2; }

cargo build --release -q -p lwio --bin lwio --bin lwio-soak
BIN=${CARGO_TARGET_DIR:-target}/release

WORK=$(mktemp -d /tmp/lwio-soak.XXXXXX)
EXPORT=$WORK/export
mkdir -p "$EXPORT"
cleanup() {
  umount "$EXPORT" 2>/dev/null || umount -l "$EXPORT" 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT
# 4 clients x 2 files x 8 MiB = 64 MiB of data; the rest is what "full" takes.
mount -t tmpfs -o size=96m,mode=0755 lwio-soak "$EXPORT"

"$BIN/lwio-soak" --export-dir "$EXPORT" --lwio "$BIN/lwio" --work-dir "$WORK/run" "$@"
