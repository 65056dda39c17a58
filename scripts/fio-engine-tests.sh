#!/usr/bin/env bash
# fio-engine-tests.sh - fio with liblwio_fio.so, the external ioengine of
# liblwio (crates/capi/fio, docs/capi.md "fio"), as a fio user runs it:
# build the engine against the installed fio's source, start `lwio serve`
# (soft provider, loopback, TLS pinned) on a scratch export, and run fio
# jobs through the engine: random 4 KiB writes with crc32c verify and a
# read-back verify_only pass, sequential 1 MiB writes, a QD32 job file as
# one writes for libaio (batched submit and reap, O_DIRECT) in both
# completion modes, with unregistered buffers, without the engine's
# batching and with fio reaping by zero timeouts, fsync/fdatasync, and
# numjobs=4 (processes and threads). Each run must exit 0 with no error in
# its JSON; the bytes on the export are then checked outside lwio: fio
# --verify_only with ioengine=psync on the export's local files, and cmp
# against the same job run locally. Last, a wrong export name must fail
# with the engine's one-line error.
#
# usage: scripts/fio-engine-tests.sh
# env:   LWIO (lwio binary; default: built), KEEP=1 (keep the scratch dir)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
ROOT=$PWD
for p in fio cc python3; do
  command -v $p >/dev/null || { echo "FAIL: $p is not installed (apt-get install fio gcc python3)"; exit 1; }
done
if [ -z "${LWIO:-}" ]; then
  cargo build -q -p lwio || exit 1
  LWIO=${CARGO_TARGET_DIR:-$ROOT/target}/debug/lwio
fi
W=$(mktemp -d /tmp/lwio-fio-engine-tests.XXXXXX)
SERVER_PID=
cleanup() {
  [ -n "$SERVER_PID" ] && kill "$SERVER_PID" 2>/dev/null && wait "$SERVER_PID" 2>/dev/null
  if [ -n "${KEEP:-}" ]; then echo "kept $W"; else rm -rf "$W"; fi
}
trap cleanup EXIT
PASSES=0 FAILS=0
pass() { echo "PASS $1"; PASSES=$((PASSES + 1)); }
fail() { echo "FAIL $1"; FAILS=$((FAILS + 1)); }

ENG=$(PROFILE=debug crates/capi/fio/build.sh) || { echo "FAIL: the engine does not build"; exit 1; }
echo "engine: $ENG ($(fio --version))"

mkdir -p "$W/export" "$W/home" "$W/local"
export HOME=$W/home
. scripts/lib/serve.sh
serve_data "$W/export" "$W/serve.log" --token-file "$W/token" || { echo "FAIL: server did not start"; exit 1; }
E=(--ioengine="external:$ENG" --lwio_url="$URL" --lwio_token_file="$W/token"
  --lwio_fingerprint="$FP" --lwio_provider=soft)

# check_json FILE JOBS [EXPR]: fio's JSON has JOBS jobs, each with error 0,
# I/O done, no short I/O; EXPR (python, on job `j`) must hold for each.
check_json() {
  python3 - "$@" <<'EOF'
import json, sys
path, want = sys.argv[1], int(sys.argv[2])
expr = sys.argv[3] if len(sys.argv) > 3 else "True"
text = open(path).read()
doc = json.loads(text[text.index("{"):])
jobs = doc["jobs"]
if len(jobs) != want:
    sys.exit(f"{len(jobs)} jobs in the JSON, expected {want}")
for j in jobs:
    if j["error"] != 0:
        sys.exit(f"job {j['jobname']}: error {j['error']}")
    if j["read"]["io_bytes"] + j["write"]["io_bytes"] == 0:
        sys.exit(f"job {j['jobname']}: no I/O")
    # fio 3.33 counts an fdatasync in total_io_u[4], which is
    # short_io_u[0] (read): a write-only job's "short reads" are those.
    dirs = ("write",) if j["read"]["io_bytes"] == 0 else ("read", "write")
    if any(j[d].get("short_ios", 0) for d in dirs):
        sys.exit(f"job {j['jobname']}: short I/Os")
    if not eval(expr):
        sys.exit(f"job {j['jobname']}: not {expr}")
print(" ".join(f"{j['jobname']}: read {j['read']['io_bytes'] >> 10} KiB, "
               f"write {j['write']['io_bytes'] >> 10} KiB, "
               f"{round(j['read']['iops'] + j['write']['iops'])} IOPS" for j in jobs[:2])
      + (f" (+{len(jobs) - 2} jobs)" if len(jobs) > 2 else ""))
EOF
}

# run NAME JOBS EXPR FIO-ARGS...: one fio run that must succeed.
run() {
  local name=$1 jobs=$2 expr=$3 out; shift 3
  if ! timeout 300 fio --output-format=json --output="$W/$name.json" "$@" >"$W/$name.log" 2>&1; then
    fail "$name: fio exited $? ($(tail -3 "$W/$name.log" | tr '\n' ' '))"
    return 1
  fi
  if out=$(check_json "$W/$name.json" "$jobs" "$expr" 2>&1); then
    pass "$name: $out"
  else
    fail "$name: $out"
    return 1
  fi
}

# 1. Random 4 KiB writes at QD32 with crc32c verify in the same job, then a
# read-back pass through the engine (verify_only), then the same pass on
# the export's local file with psync: the bytes are fio's.
RW4K=(--name=rw4k --filename=rw4k.dat --rw=randwrite --bs=4k --size=16M --iodepth=32
  --verify=crc32c)
run randwrite-verify 1 "j['read']['io_bytes'] == 16 << 20" "${E[@]}" "${RW4K[@]}" --do_verify=1
run readback-verify 1 "j['read']['io_bytes'] == 16 << 20" "${E[@]}" "${RW4K[@]}" --verify_only
run local-verify-rw4k 1 "j['read']['io_bytes'] == 16 << 20" --ioengine=psync \
  "${RW4K[@]/--filename=rw4k.dat/--filename=$W/export/rw4k.dat}" --iodepth=1 --verify_only
# The same read-back with no size=: the engine stats the file (in a child
# of fio's parent process, or in-process with thread) and fio covers it.
OWN=(); for a in "${RW4K[@]}"; do [ "$a" = --size=16M ] || OWN+=("$a"); done
run readback-own-size 1 "j['read']['io_bytes'] == 16 << 20" "${E[@]}" "${OWN[@]}" --verify_only
run readback-own-size-thread 1 "j['read']['io_bytes'] == 16 << 20" "${E[@]}" "${OWN[@]}" --verify_only --thread

# 2. Sequential 1 MiB writes with verify (several requests per I/O), and
# the same job with a pattern of offsets run locally: byte for byte equal.
SEQ=(--name=seq1m --rw=write --bs=1M --size=32M --iodepth=8 --verify=pattern
  --verify_pattern=%o --do_verify=1)
run seq1m-verify 1 "j['write']['io_bytes'] == 32 << 20" "${E[@]}" "${SEQ[@]}" --filename=seq1m.dat
run seq1m-local 1 True --ioengine=psync "${SEQ[@]}" --filename="$W/local/seq1m.dat"
if cmp -s "$W/export/seq1m.dat" "$W/local/seq1m.dat"; then
  pass "seq1m-cmp: the export's file equals the local run's ($(stat -c %s "$W/export/seq1m.dat") bytes)"
else
  fail "seq1m-cmp: $(cmp "$W/export/seq1m.dat" "$W/local/seq1m.dat" 2>&1 | head -1)"
fi

# 3. A QD32 job file as written for libaio (engine options in the file,
# O_DIRECT, batched submit and reap), random reads of the file of 1 then
# a mixed random read/write with verify; in both completion modes, with
# fio's own (unregistered) buffers, without the engine's batching, and
# with fio reaping by zero timeouts.
# "unbatched": the engine submits at each commit; "reap0": fio reaps with
# a zero timeout (iodepth_batch_complete_min=0, its polling loop).
for variant in interrupt poll unregistered unbatched reap0; do
  mode=interrupt reg=1 batch=1 cmin=1
  case $variant in
    poll) mode=poll ;;
    unregistered) reg=0 ;;
    unbatched) batch=0 ;;
    reap0) cmin=0 ;;
  esac
  cat >"$W/qd32-$variant.fio" <<EOF
[global]
ioengine=external:$ENG
lwio_url=$URL
lwio_token_file=$W/token
lwio_fingerprint=$FP
lwio_provider=soft
lwio_completion=$mode
lwio_registered=$reg
lwio_batch=$batch
direct=1
bs=4k
iodepth=32
iodepth_batch_submit=8
iodepth_batch_complete_min=$cmin
iodepth_batch_complete_max=32

[randread]
filename=rw4k.dat
rw=randread
runtime=2
time_based

[randrw]
stonewall
filename=qd32-$variant.dat
rw=randrw
size=8M
verify=crc32c
do_verify=1
EOF
  run "qd32-$variant" 2 True "$W/qd32-$variant.fio"
done

# 4. fsync every 8 writes and fdatasync every 16, and at the end.
run fsync 2 "j['sync']['lat_ns']['N'] >= 32 and j['sync']['lat_ns']['max'] < 10**10" "${E[@]}" --name=fsync --filename=fsync.dat --rw=randwrite \
  --bs=4k --size=4M --iodepth=16 --fsync=8 --end_fsync=1 \
  --name=fdatasync --filename=fdatasync.dat --rw=randwrite --bs=4k --size=4M --iodepth=16 --fdatasync=16

# 5. numjobs=4: four processes, each with its own connection and file,
# then the same as threads of one process; each file checked locally.
MJ=(--rw=randwrite --bs=4k --size=4M --iodepth=32 --verify=crc32c --numjobs=4)
run numjobs4 4 True "${E[@]}" --name=mj "${MJ[@]}" --do_verify=1
run numjobs4-threads 4 True "${E[@]}" --name=mjt "${MJ[@]}" --do_verify=1 --thread
for n in mj mjt; do
  run "local-verify-$n" 4 "j['read']['io_bytes'] == 4 << 20" --ioengine=psync --name=$n \
    "${MJ[@]}" --iodepth=1 --directory="$W/export" --verify_only
done

# 6. A wrong export name: fio fails, with the engine's one line.
if timeout 60 fio --name=bad "${E[@]/--lwio_url=$URL/--lwio_url=lwio://127.0.0.1:$PORT/nosuch}" \
    --filename=x.dat --rw=randread --bs=4k --size=1M >"$W/bad.log" 2>&1; then
  fail "wrong-export: fio exited 0"
elif [ "$(grep -c "^liblwio: lwio://127.0.0.1:$PORT/nosuch: .*no export named \"nosuch\"" "$W/bad.log")" = 1 ]; then
  pass "wrong-export: $(grep '^liblwio:' "$W/bad.log")"
else
  fail "wrong-export: no one-line error from the engine: $(tr '\n' ' ' <"$W/bad.log")"
fi

kill "$SERVER_PID" 2>/dev/null && wait "$SERVER_PID" 2>/dev/null
SERVER_PID=
echo "fio-engine-tests: $PASSES passed, $FAILS failed"
[ "$FAILS" = 0 ] && [ "$PASSES" -gt 0 ]
