#!/bin/bash
# busy-poll.sh - the client's busy polling (interrupt mode) off and on, side by side, in one run.
#
# One server (`lwio serve --provider soft`, loopback) exports a tmpfs holding a 256 MiB file of
# random bytes. The same export is mounted twice, `-o direct_io,busy_poll=0s` (a waiting FUSE
# thread sleeps at once) and `-o direct_io,busy_poll=50us` (the default: it polls up to 50 µs
# first); direct_io, so every read is a round trip. Each round runs, on each mount in turn:
#   rr1    fio, 4 KiB random reads, psync, one job (QD 1)
#   rr1x4  fio, the same with 4 jobs (4 FUSE threads waiting at once, on 2 CPUs)
# and `lwio bench` (the client library, no FUSE) at QD 1 with `--busy-poll 0s` and `50us`.
# BP_ON=DURATION compares another window than the default 50us.
# Figures: IOPS, fio's (or lwio bench's) completion latency p50 and p99, and for the mounts the
# mount process's CPU time per I/O (/proc/PID/stat). Medians of the rounds; ratios on / off.
#
# usage:  bench/busy-poll.sh [ROUNDS]      (root for the tmpfs; default 3 rounds)
# env:    BP_ROOT (default /tmp/lwio-busy-poll), BP_DUR seconds per test (5), BP_ON (50us),
#         LWIO_BIN (default target/release/lwio, built if missing)
# Output: a markdown table on stdout, and every exact command.
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
ROUNDS=${1:-3}
ROOT=${BP_ROOT:-/tmp/lwio-busy-poll}
DUR=${BP_DUR:-5}
ON=${BP_ON:-50us}
LWIO=${LWIO_BIN:-$REPO/target/release/lwio}
[ -x "$LWIO" ] || (cd "$REPO" && cargo build --release -q -p lwio) || exit 1
command -v fio >/dev/null || { echo "busy-poll.sh: fio is not installed (apt-get install fio)" >&2; exit 1; }
command -v fusermount3 >/dev/null || { echo "busy-poll.sh: fusermount3 is not installed (apt-get install fuse3)" >&2; exit 1; }

mkdir -p "$ROOT/data" "$ROOT/m-off" "$ROOT/m-on"
export HOME=$ROOT/home LWIO_KNOWN_HOSTS=$ROOT/known_hosts
mkdir -p "$HOME"
mountpoint -q "$ROOT/data" || mount -t tmpfs -o size=512M tmpfs "$ROOT/data"
PIDS=()
cleanup() {
  for m in "$ROOT/m-off" "$ROOT/m-on"; do mountpoint -q "$m" && fusermount3 -u "$m"; done
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null; done
  wait 2>/dev/null
  mountpoint -q "$ROOT/data" && umount "$ROOT/data"
}
trap cleanup EXIT
[ -f "$ROOT/data/file.bin" ] || head -c 256M /dev/urandom >"$ROOT/data/file.bin"

PORT=$(( 10000 + RANDOM % 22000 ))
"$LWIO" serve --export "data=$ROOT/data" --listen "127.0.0.1:$PORT" --provider soft >"$ROOT/serve.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 1 100); do grep -q "RDMA listening" "$ROOT/serve.log" && break; sleep 0.1; done
FP=$(grep -o 'sha256:[0-9A-F:]*' "$ROOT/serve.log" | head -1)
[ -n "$FP" ] || { echo "busy-poll.sh: the server did not start" >&2; cat "$ROOT/serve.log" >&2; exit 1; }
export LWIO_FINGERPRINT=$FP
URL=lwio://127.0.0.1:$PORT/data
: >"$ROOT/commands.txt"
for v in off on; do
  bp=0s; [ $v = on ] && bp=$ON
  cmd=("$LWIO" mount --daemon "$URL" "$ROOT/m-$v" --provider soft -o "direct_io,busy_poll=$bp")
  echo "${cmd[*]}" >>"$ROOT/commands.txt"
  "${cmd[@]}" >&2 || exit 1
done
mount_pid() { pgrep -f -- "lwio mount --daemon $URL $ROOT/m-$1 " | head -1; }
cpu_s() { awk '{print ($14 + $15) / 100}' "/proc/$1/stat"; }

# fio: "iops p50_us p99_us cpu_us_per_io"
fio_run() { # variant jobs
  local v=$1 jobs=$2 pid t0 t1
  local cmd=(fio --name=t --directory="$ROOT/m-$v" --filename=file.bin --rw=randread --bs=4k
    --ioengine=psync --iodepth=1 --numjobs="$jobs" --group_reporting --time_based
    --runtime="$DUR" --output-format=json)
  echo "${cmd[*]}" >>"$ROOT/commands.txt"
  pid=$(mount_pid "$v"); t0=$(cpu_s "$pid")
  "${cmd[@]}" 2>/dev/null >"$ROOT/fio.json"
  t1=$(cpu_s "$pid")
  python3 -c '
import json,sys
d=json.load(open(sys.argv[1]))["jobs"][0]["read"]
p=d["clat_ns"]["percentile"]
ios=d["total_ios"] or 1
print("%.0f %.1f %.1f %.1f" % (d["iops"], p["50.000000"]/1e3, p["99.000000"]/1e3, (float(sys.argv[3])-float(sys.argv[2]))*1e6/ios))' \
    "$ROOT/fio.json" "$t0" "$t1"
}
# lwio bench: "iops p50_us p99_us -"
bench_run() { # busy_poll
  local cmd=("$LWIO" bench "$URL/file.bin" --provider soft --rw randread --bs 4k --qd 1
    --size 256MiB --runtime "${DUR}s" --completion interrupt --busy-poll "$1" --json)
  echo "${cmd[*]}" >>"$ROOT/commands.txt"
  "${cmd[@]}" 2>/dev/null | python3 -c '
import json,sys
j=json.loads(sys.stdin.read().strip().splitlines()[-1])
l=j["lat_us"]
print("%.0f %.1f %.1f -" % (j["iops"], l["p50"], l["p99"]))' 2>/dev/null || echo "- - - -"
}

declare -A R
for r in $(seq 1 "$ROUNDS"); do
  for v in off on; do
    R[rr1.$v]+="$(fio_run $v 1);"
    R[rr1x4.$v]+="$(fio_run $v 4);"
  done
  R[bench.off]+="$(bench_run 0s);"
  R[bench.on]+="$(bench_run "$ON");"
  echo "round $r of $ROUNDS done" >&2
done

# Median of column $2 over the rounds of key $1.
med() {
  python3 -c '
import sys,statistics
v=[r.split()[int(sys.argv[2])-1] for r in sys.argv[1].split(";") if r.strip()]
v=[float(x) for x in v if x != "-"]
print(("%.1f" % statistics.median(v)) if v else "-")' "${R[$1]}" "$2"
}
ratio() { python3 -c "a,b='$1','$2'
print('%.2f' % (float(a)/float(b)) if '-' not in (a,b) and float(b) else '-')"; }
echo "## client busy polling off and on — $(date -u +%Y-%m-%d)"
echo
echo "Machine: $(nproc) vCPU, $(free -g | awk '/Mem:/{print $2}') GiB, $(uname -r); load before: $(cut -d' ' -f1-3 /proc/loadavg)."
echo "Produced by \`BP_ON=$ON bench/busy-poll.sh $ROUNDS\` (lwio $(cd "$REPO" && git rev-parse --short HEAD)), ${DUR} s per test, medians of $ROUNDS rounds, loopback, soft provider."
echo
echo "| test | busy_poll | IOPS | p50 µs | p99 µs | client CPU µs/I/O |"
echo "| --- | --- | ---: | ---: | ---: | ---: |"
for t in rr1 rr1x4 bench; do
  for v in off on; do
    bp=0s; [ $v = on ] && bp=$ON
    echo "| $t | $bp | $(med $t.$v 1) | $(med $t.$v 2) | $(med $t.$v 3) | $(med $t.$v 4) |"
  done
done
echo
echo "| test | IOPS on/off | p50 on/off | p99 on/off |"
echo "| --- | ---: | ---: | ---: |"
for t in rr1 rr1x4 bench; do
  echo "| $t | $(ratio "$(med $t.on 1)" "$(med $t.off 1)") | $(ratio "$(med $t.on 2)" "$(med $t.off 2)") | $(ratio "$(med $t.on 3)" "$(med $t.off 3)") |"
done
echo
echo "rr1: 4 KiB random reads, fio psync, 1 job, on \`lwio mount -o direct_io\`; rr1x4: 4 jobs; bench: \`lwio bench --qd 1 --completion interrupt\` (no FUSE)."
echo "Client CPU: the mount process's user + system time during the fio run, per I/O."
echo
echo "Commands:"
echo '```'
sort -u "$ROOT/commands.txt"
echo '```'
