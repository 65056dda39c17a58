#!/usr/bin/env bash
# fio-engine.sh - fio through liblwio_fio.so (the external ioengine,
# crates/capi/fio) beside `lwio bench`, in one run, on the same 1 GiB tmpfs
# file of one `lwio serve` (soft provider, loopback): 4 KiB random reads at
# QD32, one job, in each completion mode, alternating ROUNDS times; fio
# with the engine's default registered buffers and with lwio_registered=0.
# fio's job is the one `lwio bench` runs (same file, size, block size,
# depth, provider, completion mode; norandommap, as lwio bench draws each
# offset at random), written as a fio user would. Prints a markdown table
# (IOPS of each, fio : bench, p50 latency, client CPU per I/O) and the exact
# commands. Target (issue 34, item 5): fio : bench >= 1/1.1 (0.91).
#
# usage: bench/fio-engine.sh     env: FE_SECS (default 10), FE_ROUNDS (default 2),
#                                     FE_MODES (default "interrupt poll")
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
SECS=${FE_SECS:-10}
ROUNDS=${FE_ROUNDS:-2}
MODES=${FE_MODES:-interrupt poll}
W=$(mktemp -d /tmp/lwio-fio-engine.XXXXXX)
SERVER_PID=
cleanup() {
  [ -n "$SERVER_PID" ] && kill "$SERVER_PID" 2>/dev/null && wait "$SERVER_PID" 2>/dev/null
  mountpoint -q "$W/data" && umount "$W/data"
  rm -rf "$W"
}
trap cleanup EXIT
cargo build -q --release -p lwio
ENG=$(PROFILE=release crates/capi/fio/build.sh)
LWIO=${CARGO_TARGET_DIR:-$REPO/target}/release/lwio
mkdir -p "$W/data" "$W/home"
mount -t tmpfs -o size=1200M tmpfs "$W/data" 2>/dev/null || true
head -c 1G /dev/urandom >"$W/data/file.bin"
export HOME=$W/home
. scripts/lib/serve.sh
serve_data "$W/data" "$W/serve.log" --token-file "$W/token" || { echo "the server did not start" >&2; exit 1; }
export LWIO_FINGERPRINT=$FP
CMDS=()
run_fio() { # var cmd...: fio's JSON into var
  local var=$1 json; shift
  json=$("$@" 2>"$W/fio.err") || { cat "$W/fio.err" >&2; exit 1; }
  printf -v "$var" '%s' "$json"
}
row() { # mode round
  local mode=$1 round=$2 f u b
  local bcmd=("$LWIO" bench "$URL/file.bin" --token-file "$W/token" --provider soft --rw randread --bs 4k
    --qd 32 --jobs 1 --size 1GiB --runtime "${SECS}s" --completion "$mode" --json)
  local fcmd=(fio --name=randread --ioengine="external:$ENG" --lwio_url="$URL" --lwio_token_file="$W/token"
    --lwio_fingerprint="$FP" --lwio_provider=soft --lwio_completion="$mode" --filename=file.bin
    --rw=randread --bs=4k --iodepth=32 --numjobs=1 --size=1G --runtime="$SECS" --time_based
    --norandommap --randrepeat=0 --output-format=json)
  [ "$round" = 1 ] && CMDS+=("${bcmd[*]}" "${fcmd[*]}" "${fcmd[*]} --lwio_registered=0")
  # Alternate the order, so a drift of the machine hits all three.
  if [ $((round % 2)) = 1 ]; then
    b=$("${bcmd[@]}" 2>/dev/null | tail -1)
    run_fio f "${fcmd[@]}"
    run_fio u "${fcmd[@]}" --lwio_registered=0
  else
    run_fio u "${fcmd[@]}" --lwio_registered=0
    run_fio f "${fcmd[@]}"
    b=$("${bcmd[@]}" 2>/dev/null | tail -1)
  fi
  python3 - "$mode" "$round" "$f" "$u" "$b" <<'PY'
import json, sys
mode, rnd, b = sys.argv[1], sys.argv[2], json.loads(sys.argv[5])
bi = b["iops"]
bc = b.get("client_cpu_us_per_io")
for name, f in (("registered", sys.argv[3]), ("lwio_registered=0", sys.argv[4])):
    j = json.loads(f[f.index("{"):])["jobs"][0]
    if j["error"]:
        sys.exit(f"fio: error {j['error']}")
    fi = j["read"]["iops"]
    fp = j["read"]["clat_ns"]["percentile"]["50.000000"] / 1000
    cpu_s = (j["usr_cpu"] + j["sys_cpu"]) / 100 * j["job_runtime"] / 1000
    fc = cpu_s * 1e6 / max(j["read"]["total_ios"], 1)
    print(f"| 4 KiB randread QD32, {mode}, {name}, round {rnd} | {fi:.0f} | {bi:.0f} | {fi / bi:.2f} | "
          f"{fp:.1f} / {b['lat_us']['p50']:.1f} | {fc:.2f} / {'-' if bc is None else f'{bc:.2f}'} |")
PY
}
echo "## fio with liblwio_fio.so beside lwio bench — $(date -u +%Y-%m-%d)"
echo
echo "Machine: $(nproc) vCPU ($(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -1)), $(free -g | awk '/Mem:/{print $2}') GiB, $(uname -r); load average at start $(cut -d' ' -f1-3 /proc/loadavg); lwio $(git rev-parse --short HEAD); $(fio --version); ${SECS} s per test; 1 GiB file on tmpfs; soft provider on loopback."
echo
echo "| test | fio IOPS | lwio bench IOPS | fio : bench | p50 µs fio / bench | client CPU µs per I/O fio / bench |"
echo "| --- | --- | --- | --- | --- | --- |"
for mode in $MODES; do for r in $(seq 1 "$ROUNDS"); do row "$mode" "$r"; done; done
echo
echo "Commands:"
echo
for c in "${CMDS[@]}"; do echo "    $c"; done
