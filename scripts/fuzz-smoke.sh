#!/usr/bin/env bash
# fuzz-smoke.sh - run every cargo-fuzz target of fuzz/ for a bounded time.
#
# usage: scripts/fuzz-smoke.sh [TARGET ...]        (default: every target in fuzz/Cargo.toml)
# env:   FUZZ_SECONDS  seconds per target (default 20)
#        FUZZ_JOBS     libFuzzer workers per target (default 1)
#
# For each target it first replays, once, every input kept in the repository
# (fuzz/corpus/<target>/ and fuzz/regressions/<target>/: a crash that was found
# and fixed is kept in regressions/ and so becomes a failing regression test if
# it ever comes back), then fuzzes for FUZZ_SECONDS on a scratch copy of the
# corpus so the repository is never modified. A crash fails the run and leaves
# the reproducer in fuzz/artifacts/<target>/.
#
# Needs the nightly toolchain (present on the project's machines) and
# cargo-fuzz (installed from crates.io when missing).
set -euo pipefail
cd "$(dirname "$0")/.."
SECS=${FUZZ_SECONDS:-20}
JOBS=${FUZZ_JOBS:-1}

if ! rustup run nightly rustc --version >/dev/null 2>&1; then
  echo "fuzz-smoke: the nightly toolchain is required (rustup toolchain list shows none)" >&2
  exit 1
fi
if ! command -v cargo-fuzz >/dev/null 2>&1; then
  echo "fuzz-smoke: installing cargo-fuzz from crates.io" >&2
  cargo install --locked cargo-fuzz >&2
fi

if [ $# -gt 0 ]; then
  targets=("$@")
else
  mapfile -t targets < <(cd fuzz && cargo +nightly fuzz list)
fi
[ ${#targets[@]} -gt 0 ] || { echo "fuzz-smoke: no targets" >&2; exit 1; }

echo "fuzz-smoke: building ${#targets[@]} targets"
(cd fuzz && cargo +nightly fuzz build -O >/dev/null)

scratch=$(mktemp -d "${TMPDIR:-/tmp}/lwio-fuzz.XXXXXX")
trap 'rm -rf "$scratch"' EXIT
pass=0 fail=0
for t in "${targets[@]}"; do
  kept=()
  for d in "fuzz/corpus/$t" "fuzz/regressions/$t"; do
    [ -d "$d" ] && [ -n "$(ls -A "$d")" ] && kept+=("$PWD/$d")
  done
  mkdir -p "$scratch/$t"
  log=$scratch/$t.log
  ok=1
  if [ ${#kept[@]} -gt 0 ]; then
    # Replay what the repository keeps, once each.
    (cd fuzz && cargo +nightly fuzz run -O "$t" "${kept[@]}" -- -runs=0) >"$log" 2>&1 || ok=0
  fi
  if [ $ok = 1 ]; then
    for d in ${kept[@]+"${kept[@]}"}; do cp -r "$d"/. "$scratch/$t"/; done
    (cd fuzz && cargo +nightly fuzz run -O "$t" "$scratch/$t" -- \
        -max_total_time="$SECS" -jobs="$JOBS" -workers="$JOBS" -print_final_stats=1) >>"$log" 2>&1 || ok=0
  fi
  runs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | awk '{s+=$2} END {print s+0}')
  if [ $ok = 1 ]; then
    pass=$((pass + 1)); echo "PASS fuzz $t (${SECS}s, $runs runs)"
  else
    fail=$((fail + 1)); echo "FAIL fuzz $t — reproducer under fuzz/artifacts/$t/; log tail:"
    tail -25 "$log" | sed 's/^/    /'
  fi
done
echo "fuzz: $pass passed, $fail failed"
[ $fail = 0 ]
