#!/bin/bash
# lwio-ab.sh - the compare.sh workloads against several lwio builds, interleaved, in one run:
# what each change bought. Each build serves a 1 GiB tmpfs file of random bytes with its own
# `lwio serve` (defaults, soft provider, loopback) and is measured by its own `lwio bench`.
#
# usage:  bench/lwio-ab.sh LABEL=BINARY [LABEL=BINARY ...]
# env:    AB_DUR seconds per test (3)   AB_ROUNDS rounds over all builds, medians printed (1)
#         AB_TESTS subset of "seqread seqwrite rr1 rr32 rw1" (all)   AB_MODES "poll interrupt"
# Prints one markdown table: per build and mode, seq read/write GB/s, QD1 p50 us, QD32 IOPS,
# randwrite QD1 p50 us, client CPU us per 4k read at QD32.
set -u
[ $# -ge 1 ] || { sed -n '2,11p' "$0"; exit 1; }
DUR=${AB_DUR:-3}
ROUNDS=${AB_ROUNDS:-1}
TESTS=${AB_TESTS:-"seqread seqwrite rr1 rr32 rw1"}
MODES=${AB_MODES:-"poll interrupt"}
DIR=$(mktemp -d /dev/shm/lwio-ab.XXXXXX)
OUT=$DIR/out
mkdir -p "$DIR/data" "$OUT"
SRV=""
cleanup() { [ -n "$SRV" ] && kill "$SRV" 2>/dev/null; wait 2>/dev/null; rm -rf "$DIR"; }
trap cleanup EXIT INT TERM
head -c 1G /dev/urandom > "$DIR/data/file.bin"
args() {
  case $1 in
    seqread) echo "--rw read --bs 1M --qd 8" ;;
    seqwrite) echo "--rw write --bs 1M --qd 8" ;;
    rr1) echo "--rw randread --bs 4k --qd 1" ;;
    rr32) echo "--rw randread --bs 4k --qd 32" ;;
    rw1) echo "--rw randwrite --bs 4k --qd 1" ;;
  esac
}
for r in $(seq "$ROUNDS"); do
  for spec in "$@"; do
    label=${spec%%=*} bin=${spec#*=}
    rm -f "$DIR/ready"
    "$bin" serve --export "data=$DIR/data" --listen 127.0.0.1:0 --token-file "$DIR/token" \
      --provider soft --no-tls --ready-file "$DIR/ready" > "$DIR/serve.out" 2> "$DIR/serve.log" &
    SRV=$!
    for _ in $(seq 100); do [ -s "$DIR/ready" ] && break; sleep 0.1; done
    addr=$(head -1 "$DIR/ready")
    for m in $MODES; do
      for t in $TESTS; do
        # shellcheck disable=SC2046
        "$bin" bench "lwio://$addr/data/file.bin" $(args "$t") --size 1G --runtime "${DUR}s" \
          --completion "$m" --provider soft --no-tls --token-file "$DIR/token" --json \
          > "$OUT/$label.$m.$t.$r.json" 2> "$OUT/$label.$m.$t.$r.err" ||
          echo "FAILED $label $m $t: $(tail -1 "$OUT/$label.$m.$t.$r.err")" >&2
      done
    done
    kill "$SRV"; wait "$SRV" 2>/dev/null; SRV=""
    echo "[ab] round $r: $label done" >&2
  done
done
python3 - "$OUT" "$@" <<'PY'
import glob, json, os, statistics, sys
out, specs = sys.argv[1], [s.split('=', 1)[0] for s in sys.argv[2:]]
def get(label, m, t, f):
    files = glob.glob(os.path.join(out, '%s.%s.%s.*.json' % (label, m, t)))
    if not files:
        return '-'
    v = []
    for p in files:
        try:
            v.append(f(json.load(open(p))))
        except Exception:
            pass
    return statistics.median(v) if v else None
def fmt(x, s):
    return 'FAILED' if x is None else x if x == '-' else s.format(x)
print('| build | mode | seq read GB/s | seq write GB/s | rr QD1 p50 us | rr QD32 IOPS | rw QD1 p50 us | client us/4k QD32 |')
print('|---|---|---:|---:|---:|---:|---:|---:|')
for l in specs:
    for m in os.environ.get('AB_MODES', 'poll interrupt').split():
        gb = lambda d: d['bandwidth_bytes_per_s'] / 1e9
        p50 = lambda d: d['lat_us']['p50']
        print('| %s | %s | %s | %s | %s | %s | %s | %s |' % (l, m,
            fmt(get(l, m, 'seqread', gb), '{:.2f}'), fmt(get(l, m, 'seqwrite', gb), '{:.2f}'),
            fmt(get(l, m, 'rr1', p50), '{:.1f}'), fmt(get(l, m, 'rr32', lambda d: d['iops']), '{:,.0f}'),
            fmt(get(l, m, 'rw1', p50), '{:.1f}'), fmt(get(l, m, 'rr32', lambda d: d['client_cpu_us_per_io']), '{:.1f}')))
PY
