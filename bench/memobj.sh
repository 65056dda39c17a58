#!/bin/bash
# memobj.sh - reading a memory object (docs/memory-objects.md) against reading a file, in one run:
# `lwio serve` (soft provider, loopback, no TLS) exports a tmpfs directory holding a SIZE file;
# `lwio publish` publishes SIZE bytes of its own memory there; then, interleaved, ROUNDS times:
# `lwio cat` of the object and `lwio cat` of the file, to /dev/null. Prints GB/s of each, the
# ratio object/file, and the CPU the publisher process spent while the object was read
# (utime+stime from /proc/PID/stat), in ms and ms per GiB.
#
# usage:  bench/memobj.sh
# env:    LWIO binary (target/release/lwio)   ROUNDS (3)   SIZE bytes (1073741824)
set -u
LWIO=${LWIO:-target/release/lwio}
ROUNDS=${ROUNDS:-3}
SIZE=${SIZE:-1073741824}
[ -x "$LWIO" ] || { echo "no $LWIO (cargo build --release -p lwio)" >&2; exit 1; }
DIR=$(mktemp -d /dev/shm/lwio-memobj.XXXXXX)
mkdir -p "$DIR/data"
SRV="" PUB=""
cleanup() {
  [ -n "$PUB" ] && kill "$PUB" 2>/dev/null
  [ -n "$SRV" ] && kill "$SRV" 2>/dev/null
  wait 2>/dev/null
  rm -rf "$DIR"
}
trap cleanup EXIT INT TERM
head -c "$SIZE" /dev/urandom > "$DIR/data/file.bin"
SERVE=("$LWIO" serve --export "data=$DIR/data" --listen 127.0.0.1:0 --token-file "$DIR/token"
  --provider soft --no-tls --ready-file "$DIR/ready")
"${SERVE[@]}" > "$DIR/serve.out" 2> "$DIR/serve.log" &
SRV=$!
for _ in $(seq 100); do [ -s "$DIR/ready" ] && break; sleep 0.1; done
[ -s "$DIR/ready" ] || { echo "serve did not start: $(tail -3 "$DIR/serve.log")" >&2; exit 1; }
ADDR=$(head -1 "$DIR/ready")
URL=lwio://$ADDR/data
CLI=(--provider soft --no-tls --token-file "$DIR/token")
PUBLISH=("$LWIO" publish "$URL" obj --size "$SIZE" "${CLI[@]}")
"${PUBLISH[@]}" > "$DIR/publish.out" 2> "$DIR/publish.log" &
PUB=$!
for _ in $(seq 300); do [ -s "$DIR/publish.out" ] && break; sleep 0.1; done
OBJ=$(head -1 "$DIR/publish.out")
[ "$OBJ" = "$URL/.lwio-mem/obj" ] || { echo "publish failed: $OBJ $(tail -3 "$DIR/publish.log")" >&2; exit 1; }
CAT_OBJ=("$LWIO" cat "$OBJ" "${CLI[@]}")
CAT_FILE=("$LWIO" cat "$URL/file.bin" "${CLI[@]}")
echo "serve:     ${SERVE[*]}"
echo "publish:   ${PUBLISH[*]}"
echo "object:    ${CAT_OBJ[*]} > /dev/null"
echo "file:      ${CAT_FILE[*]} > /dev/null"
HZ=$(getconf CLK_TCK)
# utime+stime of a process, in clock ticks (fields 14 and 15; after the ")" of comm).
cpu() { sed 's/.*) //' "/proc/$1/stat" | awk '{print $12 + $13}'; }
now() { date +%s.%N; }
# Time one command to /dev/null; prints seconds, fails loudly on error.
timed() {
  local t0 t1
  t0=$(now)
  "$@" > /dev/null 2> "$DIR/cat.err" || { echo "FAILED: $* : $(tail -1 "$DIR/cat.err")" >&2; exit 1; }
  t1=$(now)
  echo "$t1 - $t0" | bc -l
}
GIB=$(echo "$SIZE / 1073741824" | bc -l)
printf '\n| round | object GB/s | file GB/s | object/file | publisher CPU ms | publisher CPU ms/GiB |\n'
printf '|---:|---:|---:|---:|---:|---:|\n'
for r in $(seq "$ROUNDS"); do
  c0=$(cpu "$PUB")
  to=$(timed "${CAT_OBJ[@]}")
  c1=$(cpu "$PUB")
  tf=$(timed "${CAT_FILE[@]}")
  ms=$(echo "($c1 - $c0) * 1000 / $HZ" | bc -l)
  go=$(echo "$SIZE / $to / 1000000000" | bc -l)
  gf=$(echo "$SIZE / $tf / 1000000000" | bc -l)
  printf '| %d | %.2f | %.2f | %.2f | %.0f | %.0f |\n' "$r" "$go" "$gf" \
    "$(echo "$go / $gf" | bc -l)" "$ms" "$(echo "$ms / $GIB" | bc -l)"
done
kill -INT "$PUB"; wait "$PUB" 2>/dev/null; PUB=""
