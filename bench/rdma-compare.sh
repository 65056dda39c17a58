#!/usr/bin/env bash
# rdma-compare.sh - lwio's RDMA layer (soft provider, loopback) side by side
# with iperf3 (single TCP stream) and libfabric's tcp provider (fi_pingpong),
# measured in the same run, reported as ratios.
#
# usage: bench/rdma-compare.sh [--record] [--reps N]
#   --record   append the table to bench/RESULTS.md (with date, machine, commands)
#   --reps N   rounds; each round runs every measurement once, in turn, so
#              that lwio and its peer are measured side by side in the same
#              minute; the medians and the range of the per-round ratios are
#              reported (default 3)
# env: LWIO_BIN (default target/release/lwio, built if missing)
#
# Everything runs on 127.0.0.1 and stops by itself. Installs iperf3 and
# libfabric-bin from Debian when missing. Absolute numbers on a shared 2-vCPU
# machine are noisy: read the ratios.
set -euo pipefail
cd "$(dirname "$0")/.."
RECORD=0 REPS=3
while [ $# -gt 0 ]; do
  case $1 in
    --record) RECORD=1 ;;
    --reps) REPS=$2; shift ;;
    -h|--help) sed -n '2,/^set -e/p' "$0" | sed '$d'; exit 0 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done

need=()
command -v iperf3 >/dev/null || need+=(iperf3)
command -v fi_pingpong >/dev/null || need+=(libfabric-bin)
if [ ${#need[@]} -gt 0 ]; then
  apt-get update -qq >/dev/null 2>&1 || true
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi
LWIO=${LWIO_BIN:-target/release/lwio}
if [ ! -x "$LWIO" ] || [ -z "${LWIO_BIN:-}" ]; then cargo build --release -q --bin lwio; fi

median() { sort -g | awk '{a[NR]=$1} END {print (NR % 2) ? a[(NR+1)/2] : (a[NR/2] + a[NR/2+1]) / 2}'; }
PIDS=()
cleanup() { for p in ${PIDS[@]+"${PIDS[@]}"}; do kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT

# --- iperf3, one stream, 5 s: bytes/s
iperf_bw() {
  iperf3 -s -1 -B 127.0.0.1 -p 5299 >/dev/null 2>&1 & PIDS+=($!)
  sleep 0.5
  iperf3 -c 127.0.0.1 -p 5299 -t 5 -J | python3 -c 'import json,sys; print(json.load(sys.stdin)["end"]["sum_received"]["bits_per_second"]/8)'
  wait "${PIDS[-1]}" 2>/dev/null || true
}
# --- fi_pingpong (busy-polls): prints "bytes/s usec_per_xfer"
fi_pp() { # size iters
  local port=$((47000 + RANDOM % 1000))
  fi_pingpong -p tcp -e msg -B "$port" -I "$2" -S "$1" >/dev/null 2>&1 & PIDS+=($!)
  sleep 0.5
  fi_pingpong -p tcp -e msg -P "$port" -I "$2" -S "$1" 127.0.0.1 2>/dev/null \
    | awk 'NF>=8 && $1 !~ /bytes/ {printf "%.0f %.2f\n", $6*1e6, $7}' | tail -1
  wait "${PIDS[-1]}" 2>/dev/null || true
}
# --- lwio rdma-bench: prints "bytes/s p50_us"
lwio_rb() { # op size iters [--poll]
  local out
  out=$("$LWIO" rdma-bench --op "$1" --size "$2" --iters "$3" ${4:-} 2>&1) || { echo "lwio rdma-bench failed: $out" >&2; return 1; }
  python3 - "$out" <<'PY'
import re, sys
s = sys.argv[1]
m = re.search(r'([0-9.]+) (GB|MB)/s', s)
bw = float(m.group(1)) * (1e9 if m.group(2) == 'GB' else 1e6) if m else 0.0
l = re.search(r'p50 ([0-9.]+) us', s)
print(bw, l.group(1) if l else 'nan')
PY
}

declare -A S   # key -> samples of field 1, one per round; key_2 -> field 2
sample() { # key cmd...
  local key=$1 out; shift
  out=$("$@")
  S[$key]+="$(echo "$out" | awk '{print $1}') "
  S[${key}_2]+="$(echo "$out" | awk '{print $2}') "
}

# Rounds, not blocks: the host's vCPU placement changes from minute to
# minute (the 64 B half round trip of either program swings between ~4 and
# ~6.3 µs), so a block of lwio runs and a block of fi_pingpong runs compare
# two placements. Each round measures everything once, back to back.
echo "measuring ($REPS rounds, medians) ..." >&2
for round in $(seq "$REPS"); do
  sample iperf     iperf_bw
  sample fi_64     fi_pp 64 20000
  sample lw_send64 lwio_rb send 64 20000 --poll
  sample fi_1m     fi_pp 1048576 2000
  sample lw_write  lwio_rb write 1048576 2000
  echo "  round $round: 64 B lwio $(echo ${S[lw_send64_2]} | awk '{print $NF}') µs, fi_pingpong $(echo ${S[fi_64_2]} | awk '{print $NF}') µs" >&2
done
declare -A R
for k in "${!S[@]}"; do R[$k]=$(printf '%s\n' ${S[$k]} | median); done
# per-round ratios a/b of two sample lists: "median (min–max)"
round_ratios() {
  paste <(printf '%s\n' $1) <(printf '%s\n' $2) |
    awk '$2 > 0 {print $1 / $2}' | sort -g |
    awk '{a[NR]=$1} END {if (!NR) {print "n/a"; exit}
         m = (NR % 2) ? a[(NR+1)/2] : (a[NR/2] + a[NR/2+1]) / 2
         printf "%.2f (%.2f–%.2f)", m, a[1], a[NR]}'
}

gbs() { awk -v a="$1" 'BEGIN { printf "%.2f GB/s", a / 1e9 }'; }
table=$(cat <<EOF
| measurement | lwio (soft, loopback) | fi_pingpong (tcp) | iperf3 (1 stream) | ratio lwio : fi_pingpong | ratio lwio : iperf3 | target |
| --- | --- | --- | --- | --- | --- | --- |
| 1 MiB RDMA write, bandwidth | $(gbs "${R[lw_write]}") | $(gbs "${R[fi_1m]}") | $(gbs "${R[iperf]}") | $(round_ratios "${S[lw_write]}" "${S[fi_1m]}") | $(round_ratios "${S[lw_write]}" "${S[iperf]}") | ≥ 1.0 and ≥ 0.9 |
| 64 B send, polling, latency per transfer (half RTT, p50) | ${R[lw_send64_2]} µs | ${R[fi_64_2]} µs | — | $(round_ratios "${S[lw_send64_2]}" "${S[fi_64_2]}") | — | ≤ 1.0 |
EOF
)
cmds=$(cat <<EOF
    iperf3 -s -1 -B 127.0.0.1 -p 5299 & iperf3 -c 127.0.0.1 -p 5299 -t 5 -J
    fi_pingpong -p tcp -e msg -B PORT -I 20000 -S 64 & fi_pingpong -p tcp -e msg -P PORT -I 20000 -S 64 127.0.0.1
    fi_pingpong -p tcp -e msg -B PORT -I 2000 -S 1048576 & fi_pingpong -p tcp -e msg -P PORT -I 2000 -S 1048576 127.0.0.1
    $LWIO rdma-bench --op send --size 64 --iters 20000 --poll
    $LWIO rdma-bench --op write --size 1048576 --iters 2000
EOF
)
echo "$table"
echo
echo "commands (medians of $REPS rounds; ratios: median of the per-round ratios, and their range):"
echo "$cmds"
if [ $RECORD = 1 ]; then
  load=$(cut -d' ' -f1-3 /proc/loadavg)
  {
    echo
    echo "## RDMA layer vs iperf3 and fi_pingpong — $(date -u +%Y-%m-%d)"
    echo
    echo "Machine: $(nproc) vCPU, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo), $(uname -r); load average before the run: $load."
    echo "Produced by \`bench/rdma-compare.sh --record --reps $REPS\` (lwio $(git rev-parse --short HEAD)); absolute figures are medians of the $REPS rounds, ratios the median (and range) of the per-round ratios."
    echo
    echo "$table"
    echo
    echo "Commands:"
    echo
    echo "$cmds"
  } >> bench/RESULTS.md
  echo "recorded in bench/RESULTS.md" >&2
fi
