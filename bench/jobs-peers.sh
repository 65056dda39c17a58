#!/usr/bin/env bash
# bench/jobs-peers.sh - does 4 KiB random-read IOPS fall as the number of jobs grows, for lwio and
# for the programs people already run, on this machine, in one run? (issue 13: "it must not fall as
# the number of jobs grows ... this 2-vCPU machine cannot show scaling; it must show no collapse").
#
# One file of 64 MiB of random bytes in a tmpfs (page cache), 4 KiB random reads, QD 8 per job,
# jobs 1, 2, 4, 16, 64, 256 (each job its own thread and, for NBD and lwio, its own connection):
#   local  fio ioengine=io_uring on the file itself: no network, no server; what 256 threads
#          submitting and reaping I/O cost on this machine's CPUs
#   NBD    nbdkit's file plugin on loopback (its defaults: 16 threads per connection); fio
#          ioengine=nbd (libnbd), a connection per job
#   lwio   `lwio serve --provider soft` and lwio-scale (the client library, a connection and a
#          thread per job), as bench/scale.sh runs them
# Systems take turns for each number of jobs (so a slow minute of the host hits all of them), over
# ROUNDS rounds; the report gives each one's median IOPS and its IOPS at each number of jobs as a
# ratio of its own best. The ratios, not the IOPS, compare across machines.
#
#   bench/jobs-peers.sh [--bin DIR] [--pin] [--rounds N] [--runtime S] [--jobs 1,2,4,16,64,256]
#
# --bin DIR: the lwio and lwio-scale in DIR (default: cargo build --release).
# --pin: servers on CPU 0, clients (fio, lwio-scale) on the other CPUs; local fio is unpinned.
# Needs fio and nbdkit (apt-get install fio nbdkit). Mounts a tmpfs when run as root, else uses
# /dev/shm.
set -euo pipefail
cd "$(dirname "$0")/.."

BIN= PIN= ROUNDS=3 RUNTIME=4 JOBS=1,2,4,16,64,256
while [ $# -gt 0 ]; do
  case "$1" in
    --bin) BIN=$2; shift 2 ;;
    --pin) PIN=1; shift ;;
    --rounds) ROUNDS=$2; shift 2 ;;
    --runtime) RUNTIME=${2%s}; shift 2 ;;
    --jobs) JOBS=$2; shift 2 ;;
    *) echo "bench/jobs-peers.sh: unknown argument: $1" >&2; exit 2 ;;
  esac
done
for t in fio nbdkit python3 taskset; do
  command -v "$t" >/dev/null || { echo "bench/jobs-peers.sh: $t not found (apt-get install fio nbdkit python3 util-linux)" >&2; exit 2; }
done
if [ -z "$BIN" ]; then
  cargo build --release -q -p lwio --bin lwio --bin lwio-scale
  BIN=${CARGO_TARGET_DIR:-target}/release
fi
NCPU=$(nproc)
SRV=() CLI=()
if [ -n "$PIN" ]; then
  [ "$NCPU" -ge 2 ] || { echo "bench/jobs-peers.sh: --pin needs 2 CPUs or more" >&2; exit 2; }
  SRV=(taskset -c 0) CLI=(taskset -c "1-$((NCPU - 1))")
fi

if [ "$(id -u)" = 0 ]; then WORK=$(mktemp -d /tmp/lwio-jobs.XXXXXX); else WORK=$(mktemp -d /dev/shm/lwio-jobs.XXXXXX); fi
DATA=$WORK/data
mkdir -p "$DATA"
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done
  umount "$DATA" 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT
[ "$(id -u)" = 0 ] && mount -t tmpfs -o size=256m,mode=0755 lwio-jobs "$DATA"
head -c $((64 << 20)) /dev/urandom >"$DATA/file.bin"
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true

# nbdkit on a free port.
NBDPORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
"${SRV[@]}" nbdkit -f -i 127.0.0.1 -p "$NBDPORT" file file="$DATA/file.bin" 2>"$WORK/nbdkit.log" &
PIDS+=($!)

# lwio serve, configured as bench/scale.sh does (one host and one user stand for many clients).
"${SRV[@]}" "$BIN/lwio" serve --config bench/one-host.toml --export "data=$DATA" \
  --listen 127.0.0.1:0 --rdma-listen 127.0.0.1:0 --metrics 127.0.0.1:0 \
  --token-file "$WORK/token" --ready-file "$WORK/ready" --no-tls --provider soft \
  >"$WORK/lwio.out" 2>"$WORK/lwio.log" &
LWIO=$!
PIDS+=($LWIO)
for _ in $(seq 300); do [ -s "$WORK/ready" ] && break; sleep 0.1; done
[ -s "$WORK/ready" ] || { echo "bench/jobs-peers.sh: lwio serve did not start:" >&2; cat "$WORK/lwio.log" >&2; exit 2; }
SIDE=$(head -1 "$WORK/ready")
METRICS=$(sed -n 's|^lwio: metrics on http://\(.*\)/metrics$|\1|p' "$WORK/lwio.out")

echo "bench/jobs-peers.sh: $(date -u '+%Y-%m-%d %H:%M UTC'); $NCPU CPUs, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //'), kernel $(uname -r)"
echo "  $(fio --version), nbdkit $(nbdkit --version | awk '{print $2}'), lwio $("$BIN/lwio" --version 2>/dev/null | awk '{print $2}')${PIN:+; --pin: servers on CPU 0, clients on CPUs 1-$((NCPU - 1))}"
FIO=(--name=rr --rw=randread --bs=4k --iodepth=8 --thread --group_reporting --time_based
     --runtime="$RUNTIME" --ramp_time=1 --norandommap --randrepeat=0 --output-format=json)
echo "  local: fio ${FIO[*]} --ioengine=io_uring --filename=$DATA/file.bin --numjobs=N"
echo "  NBD:   nbdkit -f -i 127.0.0.1 -p $NBDPORT file file=$DATA/file.bin;"
echo "         fio ${FIO[*]} --ioengine=nbd --uri=nbd://127.0.0.1:$NBDPORT --size=64M --numjobs=N"
echo "  lwio:  lwio serve --config bench/one-host.toml --export data=$DATA --listen 127.0.0.1:0 --rdma-listen 127.0.0.1:0 --metrics 127.0.0.1:0 --no-tls --provider soft"
echo "         (bench/one-host.toml: the per-host, per-user and rate limits raised);"
echo "         lwio-scale --url lwio://$SIDE/data --file file.bin --connections 1 --latency-runtime 1s --jobs N --runtime ${RUNTIME}s"

fio_iops() {  # fio JSON on stdin -> read IOPS (its nbd engine prints a line per connection first)
  python3 -c 'import json,sys; t=sys.stdin.read(); d=json.loads(t[t.index("{"):]); print(int(sum(j["read"]["iops"] for j in d["jobs"])))'
}
RES=$WORK/results.tsv
: >"$RES"
IFS=, read -r -a JL <<<"$JOBS"
for r in $(seq 1 "$ROUNDS"); do
  for j in "${JL[@]}"; do
    v=$(fio "${FIO[@]}" --ioengine=io_uring --filename="$DATA/file.bin" --numjobs="$j" 2>>"$WORK/fio.err" | fio_iops) || v=0
    printf 'local\t%s\t%s\t%s\n' "$j" "$r" "$v" >>"$RES"
    v=$("${CLI[@]}" fio "${FIO[@]}" --ioengine=nbd --uri="nbd://127.0.0.1:$NBDPORT" --size=64M --numjobs="$j" 2>>"$WORK/fio.err" | fio_iops) || v=0
    printf 'NBD\t%s\t%s\t%s\n' "$j" "$r" "$v" >>"$RES"
    v=$("${CLI[@]}" "$BIN/lwio-scale" --url "lwio://$SIDE/data" --token-file "$WORK/token" \
          --server-pid "$LWIO" --metrics "$METRICS" --file file.bin --connections 1 --latency-runtime 1s --jobs "$j" \
          --runtime "${RUNTIME}s" 2>>"$WORK/scale.err" \
        | awk '/^ +[0-9]+ +[0-9]+ /{print $2; exit}') || v=0
    printf 'lwio\t%s\t%s\t%s\n' "$j" "$r" "${v:-0}" >>"$RES"
    echo "  round $r, jobs $j: $(grep -P "\t$j\t$r\t" "$RES" | awk '{printf "%s %s  ", $1, $4}')" >&2
  done
done

python3 - "$RES" <<'EOF'
import sys, statistics
rows = [l.split('\t') for l in open(sys.argv[1]).read().split('\n') if l]
systems = ['local', 'NBD', 'lwio']
jobs = sorted({int(r[1]) for r in rows})
med = {}
for s in systems:
    for j in jobs:
        v = [int(r[3]) for r in rows if r[0] == s and int(r[1]) == j]
        med[s, j] = int(statistics.median(v)) if v else 0
print("\n4 KiB random read, QD 8 per job: median IOPS of the rounds (ratio to the system's best)")
print("  jobs " + "".join(f"{s:>22}" for s in systems))
for j in jobs:
    cells = ""
    for s in systems:
        best = max(med[s, k] for k in jobs) or 1
        cells += f"{med[s, j]:>14,} ({med[s, j] / best:4.2f})"
    print(f"  {j:>4} " + cells)
print("  the largest number of jobs against the best, per round:")
for s in systems:
    per = []
    for r in sorted({r[2] for r in rows}, key=int):
        v = {int(x[1]): int(x[3]) for x in rows if x[0] == s and x[2] == r}
        if v and max(v.values()):
            per.append(f"{v[max(jobs)] / max(v.values()):.2f}")
    print(f"    {s:>5}: " + " ".join(per))
if any(int(r[3]) == 0 for r in rows):
    print("  (a 0 is a run that failed: see the script's stderr)")
EOF
