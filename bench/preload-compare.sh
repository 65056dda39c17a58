#!/usr/bin/env bash
# preload-compare.sh - fio on `lwio mount` with and without
# liblwio_preload.so, beside liblwio's C batch interface, `lwio bench` and
# NBD (nbdkit + fio's nbd engine), in one run on the same 1 GiB tmpfs file
# (soft provider, loopback; interrupt completions, and the 4 KiB rows again
# polled):
#   4 KiB random read at QD1 (psync) and QD32 (posixaio),
#   1 MiB sequential read and write (psync, QD1).
# Prints a markdown table (IOPS or MB/s, p50, client CPU per I/O), the
# ratios the issue names as targets, and every command.
# Client CPU: the fio process (all its threads: the preload's too) plus the
# mount daemon's CPU over the run (/proc/PID/stat), per I/O.
#
# usage: bench/preload-compare.sh     env: PC_SECS (default 10); root (tmpfs);
#   PC_ONLY=REGEX runs only the rows whose key matches (e.g. '^preload.*rr32')
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
SECS=${PC_SECS:-10}
for p in fio nbdkit cc pkg-config fusermount3; do
  command -v $p >/dev/null || { echo "needs $p (apt-get install fio nbdkit gcc pkg-config fuse3)"; exit 1; }
done
W=$(mktemp -d /tmp/lwio-preload-compare.XXXXXX)
SERVER_PID= NBD_PID=
cleanup() {
  mountpoint -q "$W/mnt" && fusermount3 -u "$W/mnt"
  [ -n "$SERVER_PID" ] && kill "$SERVER_PID" 2>/dev/null && wait "$SERVER_PID" 2>/dev/null
  [ -n "$NBD_PID" ] && kill "$NBD_PID" 2>/dev/null
  mountpoint -q "$W/data" && umount "$W/data"
  rm -rf "$W"
}
trap cleanup EXIT
cargo build -q --release -p lwio -p lwio-preload
PROFILE=release scripts/install-liblwio.sh "$W/prefix" >/dev/null
T=${CARGO_TARGET_DIR:-$REPO/target}/release
LWIO=$T/lwio
PRELOAD=$W/prefix/lib/liblwio_preload.so
cc -O2 -Wall -Werror -o "$W/capi-bench" bench/capi/capi-bench.c \
  $(PKG_CONFIG_PATH=$W/prefix/lib/pkgconfig pkg-config --cflags --libs lwio) -Wl,-rpath,"$W/prefix/lib"
mkdir -p "$W/data" "$W/home" "$W/mnt"
mount -t tmpfs -o size=1200M tmpfs "$W/data" 2>/dev/null || true
head -c 1G /dev/urandom >"$W/data/file.bin"
export HOME=$W/home
. scripts/lib/serve.sh
serve_data "$W/data" "$W/serve.log" --token-file "$W/token" || { echo "the server did not start" >&2; exit 1; }
export LWIO_FINGERPRINT=$FP
"$LWIO" mount --daemon --log "$W/mount.log" "$URL" "$W/mnt" --provider soft --token-file "$W/token" >/dev/null
MPID=$(pgrep -f "lwio mount --daemon --log $W/mount.log" | head -1)
NPORT=$(( PORT + 7000 ))
nbdkit -i 127.0.0.1 -p "$NPORT" -P "$W/nbd.pid" file file="$W/data/file.bin"
for _ in $(seq 1 50); do [ -s "$W/nbd.pid" ] && break; sleep 0.1; done
NBD_PID=$(cat "$W/nbd.pid")

mount_ticks() { awk '{print $14 + $15}' "/proc/$MPID/stat"; }
# fio_row LABEL rw bs qd engine [fio args…] -> "iops mb_s p50_us cpu_us_per_io"
fio_json() {
  local rw=$2 bs=$3 qd=$4 eng=$5; shift 5
  local cmd=(fio --name=t --rw="$rw" --bs="$bs" --iodepth="$qd" --ioengine="$eng" --runtime="$SECS" --time_based
    --group_reporting --output-format=json "$@")
  echo "${PRE_ENV:-}${cmd[*]}" >>"$W/cmds"
  local t0 t1
  t0=$(mount_ticks)
  if [ -n "${PRE_ENV:-}" ]; then
    LD_PRELOAD=$PRELOAD LWIO_PRELOAD_COMPLETION=${PRE_MODE:-interrupt} "${cmd[@]}" >"$W/fio.json"
  else "${cmd[@]}" >"$W/fio.json"; fi
  t1=$(mount_ticks)
  python3 - "$W/fio.json" "$rw" "$SECS" $(( t1 - t0 )) "$(getconf CLK_TCK)" <<'PY'
import json, sys
txt = open(sys.argv[1]).read()  # the nbd engine prints a line before the JSON
j = json.loads(txt[txt.index("{"):])["jobs"][0]
rw, secs, ticks, hz = sys.argv[2], float(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
d = j["write"] if "write" in rw else j["read"]
ios = max(d["total_ios"], 1)
cpu_s = (j["usr_cpu"] + j["sys_cpu"]) / 100.0 * secs + ticks / hz
p50 = d["clat_ns"]["percentile"]["50.000000"] / 1000.0
print(f'{d["iops"]:.0f} {d["bw_bytes"] / 1e6:.1f} {p50:.1f} {cpu_s * 1e6 / ios:.2f}')
PY
}
bench_json() { # rw bs qd [completion]
  local cmd=("$LWIO" bench "$URL/file.bin" --token-file "$W/token" --provider soft --rw "$1" --bs "$2"
    --qd "$3" --size 1GiB --runtime "${SECS}s" --completion "${4:-interrupt}" --json)
  echo "${cmd[*]}" >>"$W/cmds"
  "${cmd[@]}" 2>/dev/null | tail -1 | python3 -c '
import json, sys
b, bs = json.load(sys.stdin), int(sys.argv[1])
c = b.get("client_cpu_us_per_io")
print("%.0f %.1f %.1f %.2f" % (b["iops"], b["iops"] * bs / 1e6, b["lat_us"]["p50"], -1 if c is None else c))' \
    "$(numfmt --from=iec "${2^^}")"
}
capi_json() { # qd [completion]
  local cmd=("$W/capi-bench" "$URL" file.bin "$W/token" "$FP" "$1" 4096 "$SECS" $((1 << 30)) "${2:-interrupt}")
  echo "${cmd[*]}" >>"$W/cmds"
  "${cmd[@]}" | python3 -c '
import json, sys
c = json.load(sys.stdin)
print("%.0f %.1f %.1f %.2f" % (c["iops"], c["mb_s"], c["p50_us"], c["cpu_us_per_io"]))'
}
F=(--filename="$W/mnt/file.bin" --size=1g)
NBD=(--uri="nbd://127.0.0.1:$NPORT" --size=1g)
declare -A R
run() { # key cmd...
  local k=$1; shift
  [[ -z ${PC_ONLY:-} || $k =~ $PC_ONLY ]] || return 0
  R[$k]=$("$@")
  echo "  $k: ${R[$k]}" >&2
}
for wl in "rr1 randread 4k 1 psync" "rr32 randread 4k 32 posixaio" "sr read 1M 1 psync" "sw write 1M 1 psync"; do
  read -r k rw bs qd eng <<<"$wl"
  run "mount.$k" fio_json x "$rw" "$bs" "$qd" "$eng" "${F[@]}"
  PRE_ENV="LWIO_PRELOAD_COMPLETION=interrupt LD_PRELOAD=$PRELOAD " run "preload.$k" fio_json x "$rw" "$bs" "$qd" "$eng" "${F[@]}"
  run "bench.$k" bench_json "$rw" "$bs" "$qd"
  run "nbd.$k" fio_json x "$rw" "$bs" "$qd" nbd "${NBD[@]}"
done
run capi.rr1 capi_json 1
run capi.rr32 capi_json 32
# Polled completions (the spin budget, then INTERRUPT and sleep): the
# preload's LWIO_PRELOAD_COMPLETION=poll beside the same mode elsewhere.
for wl in "rr1 4k 1 psync" "rr32 4k 32 posixaio"; do
  read -r k bs qd eng <<<"$wl"
  PRE_ENV="LWIO_PRELOAD_COMPLETION=poll LD_PRELOAD=$PRELOAD " PRE_MODE=poll \
    run "preloadp.$k" fio_json x randread "$bs" "$qd" "$eng" "${F[@]}"
  run "benchp.$k" bench_json randread "$bs" "$qd" poll
  run "capip.$k" capi_json "$qd" poll
done

f() { echo "${R[$1]}" | cut -d' ' -f"$2"; }
cell() { # key: "IOPS (MB/s) | p50 | cpu"
  [ -n "${R[$1]:-}" ] || { echo "- | - | -"; return; }
  echo "$(f "$1" 1) ($(f "$1" 2) MB/s) | $(f "$1" 3) | $(f "$1" 4)"
}
ratio() { # a b -> a / b, or "-" when either is missing (a row not run)
  [ -n "$1" ] && [ -n "$2" ] || { echo -; return; }
  python3 -c "a, b = float('$1'), float('$2'); print(f'{a / b:.2f}' if b > 0 and a >= 0 else '-')"
}
echo "## liblwio_preload.so beside the plain mount, the C batch interface, lwio bench and NBD — $(date -u +%Y-%m-%d)"
echo
echo "Machine: $(nproc) vCPU, $(free -g | awk '/Mem:/{print $2}') GiB, $(uname -r); lwio $(git rev-parse --short HEAD); ${SECS} s per test; 1 GiB file on tmpfs; soft provider on loopback; interrupt completions where a row does not say polled; $(fio --version), $(nbdkit --version | head -1)."
echo
echo "| test | client | IOPS (MB/s) | p50 µs | client CPU µs per I/O |"
echo "| --- | --- | --- | --- | --- |"
for k in rr1 rr32 sr sw; do
  case $k in rr1) t="4 KiB randread QD1";; rr32) t="4 KiB randread QD32";; sr) t="1 MiB seq read QD1";; sw) t="1 MiB seq write QD1";; esac
  for c in mount preload preloadp capi capip bench benchp nbd; do
    [ -n "${R[$c.$k]:-}" ] || continue
    case $c in mount) n="fio on the mount";; preload) n="fio on the mount + preload";; capi) n="C batch (liblwio)";; bench) n="lwio bench";;
      preloadp) n="fio on the mount + preload, polled";; capip) n="C batch (liblwio), polled";; benchp) n="lwio bench, polled";; nbd) n="fio nbd engine";; esac
    echo "| $t | $n | $(cell "$c.$k") |"
  done
done
echo
echo "Targets (issue 15):"
echo
for m in "interrupts: " "polled: p"; do
  n=${m%%:*} s=${m##*: }
  echo "* $n: preload : mount, QD1 IOPS = $(ratio "$(f preload$s.rr1 1)" "$(f mount.rr1 1)") (target >= 3)"
  echo "* $n: preload : lwio bench, QD1 p50 latency = $(ratio "$(f preload$s.rr1 3)" "$(f bench$s.rr1 3)") (target <= 1.3)"
  echo "* $n: C batch : lwio bench, QD32 IOPS = $(ratio "$(f capi$s.rr32 1)" "$(f bench$s.rr32 1)") (target >= 0.91, i.e. within 1.1x)"
  echo "* $n: C batch : NBD, QD32 IOPS = $(ratio "$(f capi$s.rr32 1)" "$(f nbd.rr32 1)") (target >= 2)"
  echo "* $n: C batch : NBD, client CPU per 4 KiB read at QD32 = $(ratio "$(f capi$s.rr32 4)" "$(f nbd.rr32 4)") (target <= 0.5)"
done
echo
echo "Commands:"
echo
sed "s/^/    /" "$W/cmds"
