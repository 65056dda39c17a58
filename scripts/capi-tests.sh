#!/usr/bin/env bash
# capi-tests.sh - liblwio from C, as a C programmer uses it: install the
# library (scripts/install-liblwio.sh) into a scratch prefix, compile the
# programs of crates/capi/tests/c with cc and pkg-config against the
# installed header, shared and static library, and run them against a real
# `lwio serve` (soft provider, loopback, TLS pinned), in both completion
# modes. Each program checks its own results byte for byte; those of
# ASAN_PROGRAMS also run built with -fsanitize=address (when cc has it).
#
# usage: scripts/capi-tests.sh      env: LWIO (lwio binary; default: built)
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
for p in cc pkg-config; do
  command -v $p >/dev/null || { echo "FAIL: $p is not installed (apt-get install gcc pkg-config)"; exit 1; }
done
if [ -z "${LWIO:-}" ]; then
  cargo build -q -p lwio || exit 1
  LWIO=${CARGO_TARGET_DIR:-$ROOT/target}/debug/lwio
fi
W=$(mktemp -d /tmp/lwio-capi-tests.XXXXXX)
SERVER_PID=
cleanup() {
  [ -n "$SERVER_PID" ] && kill "$SERVER_PID" 2>/dev/null && wait "$SERVER_PID" 2>/dev/null
  rm -rf "$W"
}
trap cleanup EXIT
FAILS=0
fail() { echo "FAIL $1"; FAILS=$((FAILS + 1)); }

PROFILE=debug scripts/install-liblwio.sh "$W/prefix" || exit 1
export PKG_CONFIG_PATH=$W/prefix/lib/pkgconfig
mkdir -p "$W/export" "$W/home"
export HOME=$W/home
. scripts/lib/serve.sh
serve_data "$W/export" "$W/serve.log" --token-file "$W/token" || { echo "FAIL: server did not start"; exit 1; }
ASAN_PROGRAMS="publish_fail"

for src in crates/capi/tests/c/*.c; do
  name=$(basename "$src" .c)
  # Shared, through pkg-config; and static.
  cc -Wall -Wextra -Werror -O1 -o "$W/$name" "$src" $(pkg-config --cflags --libs lwio) \
    -Wl,-rpath,"$W/prefix/lib" || { fail "$name: does not compile against the installed header"; continue; }
  cc -Wall -Wextra -Werror -O1 -o "$W/$name-static" "$src" $(pkg-config --cflags lwio) \
    "$W/prefix/lib/liblwio.a" $(pkg-config --libs-only-other --static lwio) -lpthread -ldl -lm ||
    { fail "$name: does not link statically"; continue; }
  bins="$name $name-static"
  # Programs that check memory the library hands back also run under
  # AddressSanitizer (shared library), where the compiler has it.
  case " $ASAN_PROGRAMS " in *" $name "*)
    if cc -fsanitize=address -g -Wall -Wextra -Werror -O1 -o "$W/$name-asan" "$src" \
        $(pkg-config --cflags --libs lwio) -Wl,-rpath,"$W/prefix/lib" 2>"$W/asan.log"; then
      bins="$bins $name-asan"
    else
      echo "SKIP $name-asan: cc has no AddressSanitizer ($(head -1 "$W/asan.log"))"
    fi ;;
  esac
  for mode in interrupt poll; do
    for bin in $bins; do
      if out=$(ASAN_OPTIONS=detect_leaks=0 "$W/$bin" "$URL" "$W/token" "$FP" "$W/export" "$mode" 2>&1); then
        echo "PASS $bin ($mode): $(echo "$out" | tail -1)"
      else
        fail "$bin ($mode): $(echo "$out" | tail -3 | tr '\n' ' ')"
      fi
    done
  done
done
echo "capi-tests: $FAILS failure(s)"
[ "$FAILS" = 0 ]
