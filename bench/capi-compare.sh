#!/usr/bin/env bash
# capi-compare.sh - liblwio's C batch interface beside `lwio bench`, in one
# run, on the same 1 GiB tmpfs file of one `lwio serve` (soft provider,
# loopback): 4 KiB random reads at QD1 and QD32, both completion modes.
# Prints a markdown table (IOPS, p50, client CPU per I/O, C : lwio bench)
# and the exact commands.
#
# usage: bench/capi-compare.sh     env: CC_SECS (default 10)
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
SECS=${CC_SECS:-10}
W=$(mktemp -d /tmp/lwio-capi-compare.XXXXXX)
SERVER_PID=
cleanup() {
  [ -n "$SERVER_PID" ] && kill "$SERVER_PID" 2>/dev/null && wait "$SERVER_PID" 2>/dev/null
  mountpoint -q "$W/data" && umount "$W/data"
  rm -rf "$W"
}
trap cleanup EXIT
cargo build -q --release -p lwio
PROFILE=release scripts/install-liblwio.sh "$W/prefix" >/dev/null
LWIO=${CARGO_TARGET_DIR:-$REPO/target}/release/lwio
cc -O2 -Wall -Werror -o "$W/capi-bench" bench/capi/capi-bench.c \
  $(PKG_CONFIG_PATH=$W/prefix/lib/pkgconfig pkg-config --cflags --libs lwio) -Wl,-rpath,"$W/prefix/lib"
mkdir -p "$W/data" "$W/home"
mount -t tmpfs -o size=1200M tmpfs "$W/data" 2>/dev/null || true
head -c 1G /dev/urandom >"$W/data/file.bin"
export HOME=$W/home
. scripts/lib/serve.sh
serve_data "$W/data" "$W/serve.log" --token-file "$W/token" || { echo "the server did not start" >&2; exit 1; }
export LWIO_FINGERPRINT=$FP
CMDS=()
row() { # qd mode
  local qd=$1 mode=$2 c b
  local ccmd=("$W/capi-bench" "$URL" file.bin "$W/token" "$FP" "$qd" 4096 "$SECS" $((1 << 30)) "$mode")
  local bcmd=("$LWIO" bench "$URL/file.bin" --token-file "$W/token" --provider soft --rw randread --bs 4k
    --qd "$qd" --size 1GiB --runtime "${SECS}s" --completion "$mode" --json)
  CMDS+=("${ccmd[*]}" "${bcmd[*]}")
  c=$("${ccmd[@]}")
  b=$("${bcmd[@]}" 2>/dev/null | tail -1)
  python3 - "$qd" "$mode" "$c" "$b" <<'PY'
import json, sys
qd, mode, c, b = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
bi, bp = b["iops"], b["lat_us"]["p50"]
bc = b.get("client_cpu_us_per_io")
print(f"| 4 KiB randread QD{qd}, {mode} | {c['iops']:.0f} | {bi:.0f} | {c['iops']/bi:.2f} | "
      f"{c['p50_us']:.1f} / {bp:.1f} | {c['cpu_us_per_io']:.2f} / {'-' if bc is None else f'{bc:.2f}'} |")
PY
}
echo "## liblwio batch interface beside lwio bench — $(date -u +%Y-%m-%d)"
echo
echo "Machine: $(nproc) vCPU, $(free -g | awk '/Mem:/{print $2}') GiB, $(uname -r); lwio $(git rev-parse --short HEAD); ${SECS} s per test; 1 GiB file on tmpfs; soft provider on loopback."
echo
echo "| test | C batch IOPS | lwio bench IOPS | C : bench | p50 µs C / bench | client CPU µs per I/O C / bench |"
echo "| --- | --- | --- | --- | --- | --- |"
for mode in interrupt poll; do for qd in 1 32; do row $qd $mode; done; done
echo
echo "Commands:"
echo
for c in "${CMDS[@]}"; do echo "    $c"; done
