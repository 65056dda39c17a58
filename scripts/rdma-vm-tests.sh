#!/usr/bin/env bash
# rdma-vm-tests.sh - lwio's RDMA VM test suite: runs the case table below inside qemu
# guests with Soft-RoCE (rxe) and soft-iWARP (siw) via scripts/rdma-vm.sh.
# See docs/vm-tests.md.
#
# usage: scripts/rdma-vm-tests.sh [-l] [-v] [-n] [PATTERN...]
#   PATTERN  shell glob(s) on case names (default: all), e.g. 'rping-*' '*-siw'
#   -l       list the cases (and whether they would run or be skipped), don't run
#   -v       verbose: stream the guests' full output (and console with RDMA_VM_VERBOSE=1)
#   -n       no build: don't run cargo / gcc, use what is already in target/
# env: RDMA_VM_CACHE (see rdma-vm.sh), CARGO (default cargo),
#      RDMA_VM_TESTS_VM_TIMEOUT extra seconds per VM on top of the case timeouts (120)
# Output: one line per case `PASS name (secs)` / `FAIL name (why)` / `SKIP name (reason)`,
# then `N passed, M failed, K skipped`. Exit status 1 if anything failed, 0 otherwise.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
VMRUN=$ROOT/scripts/rdma-vm.sh
CBIN=$ROOT/target/rdma-vm            # C helpers from scripts/vm/*.c land here
CARGO=${CARGO:-cargo}

# ---------------------------------------------------------------- VM flavours
# One VM is booted per flavour that has runnable cases; all its cases run in it, in order.
declare -A VM_ARGS=(
  [main]="-d rxe,siw -M fuse -m 2048"   # 2 GiB: the initramfs holds every case's binaries, the mount cases fio and its engine; rxe0 on veth0 = 10.0.0.1 (RXE_IP), siw0 on veth1 = 10.0.0.2 (SIW_IP); FUSE for the mount cases
  [netns]="-n -d siw"   # siw0 on veth1 = 10.0.0.2 (SIW_IP); veth0 = 10.0.0.1 (PEER_IP) in netns "peer"
)
VM_ORDER="main netns"

# ---------------------------------------------------------------- case table
# name | vm | timeout(s) | needs | guard | guest command
#   needs: host files (relative to the repo root) copied to /test/<basename>; a missing
#          one makes the case SKIP. target/release/* come from `cargo build --release --bins`
#          (looked up in $CARGO_TARGET_DIR/release when CARGO_TARGET_DIR is set),
#          target/release/examples/NAME from `cargo build --release --example NAME`,
#          target/release/tests/NAME: the integration test binary tests/NAME.rs of
#          the workspace (`cargo test --release --no-run --test NAME`), copied there,
#          target/release/liblwio_fio.so from crates/capi/fio/build.sh (against the
#          host's fio), target/rdma-vm/* from scripts/vm/*.c; an absolute path is a
#          host program taken as it is (with its shared libraries).
#   guard: host shell command (run in the repo root); non-zero -> SKIP. `-` for none.
#   guest command: busybox sh in /test with scripts/vm/guest-lib.sh sourced (pair,
#          wait_tcp, siw_param, mpa_flags, inpeer); may contain '|'. Exit 0 = PASS.
CASES=$(cat <<'EOF'
verbs-dlopen        | main  | 60  | target/rdma-vm/verbs_probe | - | ./verbs_probe $RXE_IP $RXE_DEV $SIW_IP $SIW_DEV
rdma-loop-rxe       | main  | 60  | target/rdma-vm/rdma_loop   | - | ./rdma_loop $RXE_DEV $RXE_GID_IDX imm mw2
rping-rxe           | main  | 120 | - | - | pair "rping -s -a $RXE_IP -C 100 -V" "rping -c -a $RXE_IP -C 100 -V"
rping-siw           | main  | 120 | - | - | pair "rping -s -a $SIW_IP -C 100 -V" "rping -c -a $SIW_IP -C 100 -V"
rping-siw-crc       | main  | 120 | - | - | siw_param mpa_crc_required Y && pair "rping -s -a $SIW_IP -C 100 -V" "rping -c -a $SIW_IP -C 100 -V"; r=$?; siw_param mpa_crc_required N; exit $r
ucmatose-rxe        | main  | 60  | - | - | pair "ucmatose -b $RXE_IP" "ucmatose -s $RXE_IP"
ucmatose-siw        | main  | 60  | - | - | pair "ucmatose -b $SIW_IP" "ucmatose -s $SIW_IP"
ib_write_bw-rxe     | main  | 90  | - | - | pair "ib_write_bw -d $RXE_DEV -R -s 65536 -n 300 -F" "ib_write_bw -d $RXE_DEV -R -s 65536 -n 300 -F $RXE_IP"
ib_write_bw-siw     | main  | 90  | - | - | pair "ib_write_bw -d $SIW_DEV -R -s 65536 -n 300 -F" "ib_write_bw -d $SIW_DEV -R -s 65536 -n 300 -F $SIW_IP"
ib_read_bw-rxe      | main  | 90  | - | - | pair "ib_read_bw -d $RXE_DEV -R -s 65536 -n 300 -F" "ib_read_bw -d $RXE_DEV -R -s 65536 -n 300 -F $RXE_IP"
ib_read_bw-siw      | main  | 90  | - | - | pair "ib_read_bw -d $SIW_DEV -R -s 65536 -n 300 -F" "ib_read_bw -d $SIW_DEV -R -s 65536 -n 300 -F $SIW_IP"
conformance-rxe     | main  | 600 | target/release/lwio-conformance | - | ./lwio-conformance --server-provider verbs --client-provider verbs --server-device $RXE_DEV --client-device $RXE_DEV --addr $RXE_IP:7471
conformance-siw     | main  | 600 | target/release/lwio-conformance | - | ./lwio-conformance --server-provider verbs --client-provider verbs --server-device $SIW_DEV --client-device $SIW_DEV --addr $SIW_IP:7471
conformance-soft-to-siw     | main | 600 | target/release/lwio-conformance | - | ./lwio-conformance --client-provider soft --server-provider verbs --server-device $SIW_DEV --addr $SIW_IP:7472 --crc off
conformance-siw-to-soft     | main | 600 | target/release/lwio-conformance | - | ./lwio-conformance --client-provider verbs --client-device $SIW_DEV --server-provider soft --addr $SIW_IP:7473 --crc off
conformance-soft-to-siw-crc | main | 600 | target/release/lwio-conformance | - | ./lwio-conformance --client-provider soft --server-provider verbs --server-device $SIW_DEV --addr $SIW_IP:7474 --crc on
conformance-siw-to-soft-crc | main | 600 | target/release/lwio-conformance | - | siw_param mpa_crc_required Y; ./lwio-conformance --client-provider verbs --client-device $SIW_DEV --server-provider soft --addr $SIW_IP:7475 --crc on; r=$?; siw_param mpa_crc_required N; exit $r
lwio-e2e-rxe        | main  | 180 | target/release/examples/lwio-e2e-vm scripts/vm/lwio-e2e.sh | - | sh ./lwio-e2e.sh $RXE_DEV $RXE_IP
lwio-e2e-siw        | main  | 180 | target/release/examples/lwio-e2e-vm scripts/vm/lwio-e2e.sh | - | sh ./lwio-e2e.sh $SIW_DEV $SIW_IP
mount-readers-rxe   | main  | 240 | target/release/lwio /usr/bin/fio /usr/bin/fusermount3 scripts/vm/mount-readers.sh | - | sh ./mount-readers.sh $RXE_DEV $RXE_IP
mount-readers-siw   | main  | 240 | target/release/lwio /usr/bin/fio /usr/bin/fusermount3 scripts/vm/mount-readers.sh | - | sh ./mount-readers.sh $SIW_DEV $SIW_IP
fio-engine-rxe      | main  | 240 | target/release/lwio target/release/liblwio_fio.so /usr/bin/fio scripts/vm/fio-engine-vm.sh | - | sh ./fio-engine-vm.sh $RXE_DEV $RXE_IP
fio-engine-siw      | main  | 240 | target/release/lwio target/release/liblwio_fio.so /usr/bin/fio scripts/vm/fio-engine-vm.sh | - | sh ./fio-engine-vm.sh $SIW_DEV $SIW_IP
lwio-xprov-siw-server-soft-client | main | 240 | target/release/lwio scripts/vm/lwio-xprov.sh | - | sh ./lwio-xprov.sh siw-server-soft-client
lwio-xprov-soft-server-siw-client | main | 240 | target/release/lwio scripts/vm/lwio-xprov.sh | - | sh ./lwio-xprov.sh soft-server-siw-client
lwio-xprov-both                   | main | 300 | target/release/lwio scripts/vm/lwio-xprov.sh | - | sh ./lwio-xprov.sh both
lwio-xprov-rxe-server-soft-client | main | 120 | target/release/lwio scripts/vm/lwio-xprov.sh | - | sh ./lwio-xprov.sh rxe-server-soft-client
malicious-server-rxe | main | 400 | target/release/tests/e2e_malicious_server | - | ulimit -l unlimited; LWIO_MALICIOUS_PROVIDER=verbs LWIO_MALICIOUS_DEVICE=$RXE_DEV LWIO_MALICIOUS_IP=$RXE_IP ./e2e_malicious_server --test-threads=1
malicious-server-siw | main | 400 | target/release/tests/e2e_malicious_server | - | ulimit -l unlimited; LWIO_MALICIOUS_PROVIDER=verbs LWIO_MALICIOUS_DEVICE=$SIW_DEV LWIO_MALICIOUS_IP=$SIW_IP ./e2e_malicious_server --test-threads=1
rdma-bench-send-siw | main | 120 | target/release/lwio | - | ulimit -l unlimited; pair "./lwio rdma-bench --provider verbs --op send --size 65536 --iters 3000 --listen $SIW_IP:7177" "./lwio rdma-bench --provider verbs --op send --size 65536 --iters 3000 --connect $SIW_IP:7177"
rdma-bench-send-rxe | main | 120 | target/release/lwio | - | ulimit -l unlimited; pair "./lwio rdma-bench --provider verbs --op send --size 65536 --iters 3000 --listen $RXE_IP:7178" "./lwio rdma-bench --provider verbs --op send --size 65536 --iters 3000 --connect $RXE_IP:7178"
mpa-tcp-to-siw      | netns | 30  | - | - | rping -s -a $SIW_IP -C 1 & wait_tcp $SIW_IP 7174 && { (printf 'MPA ID Req Frame\000\001\000\000'; sleep 2) | timeout 5 inpeer nc $SIW_IP 7174 > /tmp/rep; }; head -c 16 /tmp/rep | grep -x 'MPA ID Rep Frame'
mpa-tcp-to-siw-crc  | netns | 30  | - | - | rping -s -a $SIW_IP -C 1 & wait_tcp $SIW_IP 7174 && { (printf 'MPA ID Req Frame\100\001\000\000'; sleep 2) | timeout 5 inpeer nc $SIW_IP 7174 > /tmp/rep; }; head -c 16 /tmp/rep | grep -x 'MPA ID Rep Frame' && [ "$(mpa_flags /tmp/rep)" = 40 ]
mpa-siw-to-tcp      | netns | 30  | - | - | inpeer nc -l -p 7174 > /tmp/req & sleep 1; timeout -s KILL 4 rping -c -a $PEER_IP -C 1; head -c 16 /tmp/req | grep -x 'MPA ID Req Frame' && [ "$(mpa_flags /tmp/req)" = 10 ]
mpa-siw-to-tcp-crc  | netns | 30  | - | - | siw_param mpa_crc_required Y; inpeer nc -l -p 7174 > /tmp/req & sleep 1; timeout -s KILL 4 rping -c -a $PEER_IP -C 1; siw_param mpa_crc_required N; head -c 16 /tmp/req | grep -x 'MPA ID Req Frame' && [ "$(mpa_flags /tmp/req)" = 50 ]
rping-siw-netns     | netns | 120 | - | - | pair "rping -s -a $SIW_IP -C 100 -V" "rping -c -a $SIW_IP -C 100 -V"
interop-soft-to-siw        | netns | 150 | target/release/lwio-rping | - | pair "rping -s -a $SIW_IP -C 100 -V" "inpeer ./lwio-rping -c -a $SIW_IP -C 100 -V"
interop-siw-to-soft        | netns | 150 | target/release/lwio-rping | - | pair "inpeer ./lwio-rping -s -a $PEER_IP -C 100 -V" "rping -c -a $PEER_IP -C 100 -V"
interop-soft-to-siw-crc    | netns | 150 | target/release/lwio-rping | - | pair "rping -s -a $SIW_IP -C 100 -V" "inpeer ./lwio-rping -c -a $SIW_IP -C 100 -V --mpa-crc"
interop-siw-to-soft-crc    | netns | 150 | target/release/lwio-rping | - | siw_param mpa_crc_required Y; pair "inpeer ./lwio-rping -s -a $PEER_IP -C 100 -V" "rping -c -a $PEER_IP -C 100 -V"; r=$?; siw_param mpa_crc_required N; exit $r
interop-siw-to-soft-crc-ours | netns | 90 | target/release/lwio-rping scripts/vm/interop-rping.sh | - | sh ./interop-rping.sh siw-to-soft-crc-ours
interop-soft-to-siw-strict | netns | 60  | target/release/lwio-rping scripts/vm/interop-rping.sh | - | sh ./interop-rping.sh soft-to-siw-strict
interop-64k                | netns | 150 | target/release/lwio-rping scripts/vm/interop-rping.sh | - | sh ./interop-rping.sh soft-to-siw-64k siw-to-soft-64k
interop-p2p-gap            | netns | 60  | target/release/lwio-rping scripts/vm/interop-rping.sh | - | sh ./interop-rping.sh siw-p2p-to-soft
interop-verbs-to-soft      | netns | 90  | target/release/lwio-rping scripts/vm/interop-rping.sh | - | sh ./interop-rping.sh verbs-to-soft
EOF
)
# conformance-*: lwio-conformance (crates/rdma/src/bin) holds both contexts in one process;
# the soft end of the soft<->siw rows uses siw0's own address (siw as initiator must resolve
# to siw0, so not 10.0.0.1 = rxe0); known siw deviations are XFAIL (docs/interop.md).
# NB for the colleagues: the interop-* command lines above are the
# planned interfaces (lwio-rping: an
# rping-compatible client/server on lwio's soft iWARP provider over plain TCP, --mpa-crc =
# request MPA CRC). Adjust them when the binaries land; a case whose binary is absent SKIPs.
# MPA CRC semantics of this siw (see docs/vm-tests.md): siw as responder uses CRC iff the
# initiator asks for it (mpa_crc_required does not make a passive siw demand it); siw as
# initiator asks for CRC iff mpa_crc_required=Y, and accepts a responder that turns CRC on.

# ---------------------------------------------------------------- options
LIST=0 VERBOSE=0 NOBUILD=0
while getopts "lvnh" o; do
  case $o in l) LIST=1 ;; v) VERBOSE=1 ;; n) NOBUILD=1 ;; h) sed -n '2,/^set -e/p' "$0" | sed '$d'; exit 0 ;; *) exit 2 ;; esac
done
shift $((OPTIND - 1))
PATTERNS=("$@"); [ ${#PATTERNS[@]} -gt 0 ] || PATTERNS=('*')
cd "$ROOT"
log() { echo "[vm-tests] $*" >&2; }
trim() { local s=$1; s=${s#"${s%%[![:space:]]*}"}; s=${s%"${s##*[![:space:]]}"}; printf '%s' "$s"; }

NAMES=()
declare -A C_VM C_TO C_NEEDS C_GUARD C_CMD
while IFS= read -r line; do
  [[ $line =~ ^[[:space:]]*(#|$) ]] && continue
  IFS='|' read -r n vm to needs guard cmd <<< "$line"
  n=$(trim "$n"); sel=0
  for p in "${PATTERNS[@]}"; do [[ $n == $p ]] && sel=1; done
  [ $sel = 1 ] || continue
  # the command is everything after the 5th '|'
  cmd=${line#*|}; cmd=${cmd#*|}; cmd=${cmd#*|}; cmd=${cmd#*|}; cmd=${cmd#*|}
  NAMES+=("$n"); C_VM[$n]=$(trim "$vm"); C_TO[$n]=$(trim "$to"); C_NEEDS[$n]=$(trim "$needs")
  C_GUARD[$n]=$(trim "$guard"); C_CMD[$n]=$(trim "$cmd")
  [ -n "${VM_ARGS[${C_VM[$n]}]:-}" ] || { echo "case $n: unknown vm '${C_VM[$n]}'" >&2; exit 2; }
done <<< "$CASES"
[ ${#NAMES[@]} -gt 0 ] || { echo "no case matches ${PATTERNS[*]}" >&2; exit 2; }

needs_of() { local x; for x in ${C_NEEDS[$1]}; do [ "$x" = - ] || echo "$x"; done; }
# host path of a need: target/release/* live in $CARGO_TARGET_DIR/release when that is set
# (where `cargo build` puts them), else in target/release relative to the repo root
host_path() {
  case $1 in
    /*) echo "$1"; return ;;   # a host program (e.g. /usr/bin/fio), with its libraries
    target/release/*) [ -n "${CARGO_TARGET_DIR:-}" ] && { case $CARGO_TARGET_DIR in /*) echo "$CARGO_TARGET_DIR/release/${1#target/release/}" ;; *) echo "$ROOT/$CARGO_TARGET_DIR/release/${1#target/release/}" ;; esac; return; } ;;
  esac
  echo "$ROOT/$1"
}

# ---------------------------------------------------------------- build
T0=$(date +%s)
BUILD_FAIL=()   # needs prefixes whose build failed -> FAIL, not SKIP
if [ $NOBUILD = 0 ] && [ $LIST = 0 ]; then
  want_cargo=0 want_c=0 want_fio=0 EXAMPLES=() TESTS=()
  for n in "${NAMES[@]}"; do for x in $(needs_of "$n"); do
    case $x in
      target/release/examples/*) [[ " ${EXAMPLES[*]-} " == *" ${x##*/} "* ]] || EXAMPLES+=(--example "${x##*/}") ;;
      target/release/tests/*) [[ " ${TESTS[*]-} " == *" ${x##*/} "* ]] || TESTS+=("${x##*/}") ;;
      target/release/liblwio_fio.so) want_cargo=1 want_fio=1 ;;
      target/release/*) want_cargo=1 ;; target/rdma-vm/*) want_c=1 ;;
    esac; done; done
  if [ ${#EXAMPLES[@]} -gt 0 ]; then
    log "cargo build --release ${EXAMPLES[*]}"
    if ! "$CARGO" build --release --workspace "${EXAMPLES[@]}" >&2; then
      log "cargo build failed: cases that need target/release/examples/* will FAIL"; BUILD_FAIL+=(target/release/examples/)
    fi
  fi
  for t in ${TESTS[@]+"${TESTS[@]}"}; do
    # The test harness binary has a hash in its name: take its path from
    # cargo's JSON messages and copy it where the case table names it.
    log "cargo test --release --no-run --test $t"
    exe=$("$CARGO" test --release --workspace --no-run --test "$t" --message-format=json 2>/dev/null |
      grep "\"name\":\"$t\"" | grep -o '"executable":"[^"]*"' | tail -n 1 | cut -d'"' -f4) || true
    dest=$(host_path "target/release/tests/$t")
    if [ -n "$exe" ] && [ -x "$exe" ] && mkdir -p "$(dirname "$dest")" && cp "$exe" "$dest"; then :; else
      log "building test $t failed: cases that need it will FAIL"; BUILD_FAIL+=("target/release/tests/$t")
    fi
  done
  if [ $want_cargo = 1 ]; then
    log "cargo build --release --bins (workspace)"
    if ! "$CARGO" build --release --workspace --bins >&2; then
      log "cargo build failed: cases that need target/release/* will FAIL"; BUILD_FAIL+=(target/release/)
    fi
  fi
  if [ $want_fio = 1 ]; then
    # fio's external engine, against the headers of the host's fio (the one
    # the cases copy into the guest).
    log "crates/capi/fio/build.sh (release)"
    if ! PROFILE=release crates/capi/fio/build.sh >&2; then
      log "building liblwio_fio.so failed: cases that need it will FAIL"; BUILD_FAIL+=(target/release/liblwio_fio.so)
    fi
  fi
  if [ $want_c = 1 ]; then
    if [ ! -f /usr/include/infiniband/verbs.h ] || [ ! -f /usr/include/rdma/rdma_cma.h ] || ! command -v gcc >/dev/null; then
      log "installing libibverbs-dev librdmacm-dev gcc (headers for scripts/vm/*.c)"
      SUDO=; [ "$(id -u)" = 0 ] || SUDO="sudo -n"
      { $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends --no-remove \
          -o DPkg::Lock::Timeout=600 libibverbs-dev librdmacm-dev gcc >&2 ||
        { $SUDO apt-get update -qq >&2 && $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
          --no-install-recommends --no-remove -o DPkg::Lock::Timeout=600 libibverbs-dev librdmacm-dev gcc >&2; }; } || true
    fi
    mkdir -p "$CBIN"
    # verbs_probe must NOT link libibverbs/librdmacm (it dlopen()s them, like lwio's provider)
    gcc -O2 -Wall -o "$CBIN/verbs_probe" scripts/vm/verbs_probe.c -ldl >&2 &&
    gcc -O2 -Wall -o "$CBIN/rdma_loop" scripts/vm/rdma_loop.c -libverbs >&2 ||
      { log "building scripts/vm/*.c failed"; BUILD_FAIL+=(target/rdma-vm/); }
  fi
fi
T_BUILD=$(( $(date +%s) - T0 ))

# ---------------------------------------------------------------- classify
declare -A RESULT WHY
for n in "${NAMES[@]}"; do
  for x in $(needs_of "$n"); do
    for b in ${BUILD_FAIL[@]+"${BUILD_FAIL[@]}"}; do
      [[ $x == "$b"* ]] && { RESULT[$n]=FAIL; WHY[$n]="build of $x failed"; }
    done
    [ -n "${RESULT[$n]:-}" ] && break
    # Every binary a case needs is built above: one that is still missing
    # after a build means a broken build or a wrong path, and must fail the
    # run rather than let the case pass unnoticed as a skip. With -n (no
    # build) it is only skipped.
    if [ ! -e "$(host_path "$x")" ]; then
      if [ $NOBUILD = 1 ] || [ $LIST = 1 ]; then RESULT[$n]=SKIP; WHY[$n]="$(host_path "$x") not built (-n)"
      else RESULT[$n]=FAIL; WHY[$n]="$(host_path "$x") missing after the build"; fi
      break
    fi
  done
  g=${C_GUARD[$n]}
  if [ -z "${RESULT[$n]:-}" ] && [ "$g" != - ] && ! bash -c "$g" >/dev/null 2>&1; then
    RESULT[$n]=SKIP; WHY[$n]="guard failed: $g"
  fi
done

if [ $LIST = 1 ]; then
  for n in "${NAMES[@]}"; do
    printf '%-26s %-6s %4ss  %s\n' "$n" "${C_VM[$n]}" "${C_TO[$n]}" "${RESULT[$n]:+${RESULT[$n]} (${WHY[$n]})}"
    printf '    %s\n' "${C_CMD[$n]}"
  done
  exit 0
fi
for n in "${NAMES[@]}"; do
  case ${RESULT[$n]:-} in SKIP) echo "SKIP $n (${WHY[$n]})" ;; FAIL) echo "FAIL $n (${WHY[$n]})" ;; esac
done

# ---------------------------------------------------------------- run, one VM per flavour
q() { printf "'%s'" "$(printf '%s' "$1" | sed "s/'/'\\\\''/g")"; }
WORK=$(mktemp -d "${TMPDIR:-/tmp}/rdma-vm-tests.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
declare -A VM_SECS
for vm in $VM_ORDER; do
  run=() files=() tsum=0
  for n in "${NAMES[@]}"; do
    [ "${C_VM[$n]}" = "$vm" ] && [ -z "${RESULT[$n]:-}" ] || continue
    run+=("$n"); tsum=$((tsum + C_TO[$n]))
    for x in $(needs_of "$n"); do [[ " ${files[*]-} " == *" $x "* ]] || files+=("$x"); done
  done
  [ ${#run[@]} -gt 0 ] || continue
  S=$WORK/suite-$vm.sh
  {
    echo '#!/bin/sh'
    echo 'cd /test; export CASE_VERBOSE='"$([ $VERBOSE = 1 ] && echo 1)"
    echo 'run_case() { # name timeout cmd'
    echo '  t0=$(cut -d" " -f1 /proc/uptime)'
    echo '  timeout "$2" sh -c ". /test/guest-lib.sh; $3" > /tmp/case.log 2>&1 < /dev/null; rc=$?'
    echo '  t1=$(cut -d" " -f1 /proc/uptime); d=$(awk -v a=$t0 -v b=$t1 "BEGIN{printf \"%.1f\", b-a}")'
    echo '  [ $rc = 143 ] || [ $rc = 137 ] && rc="$rc (timeout $2s)"'
    echo '  if [ "$rc" = 0 ]; then [ -n "$CASE_VERBOSE" ] && sed "s/^/    | /" /tmp/case.log; echo "@@CASE PASS $1 ${d}s"'
    echo '  else sed "s/^/    | /" /tmp/case.log | tail -n 60; echo "@@CASE FAIL $1 rc=$rc, ${d}s"; fi'
    echo '  . /test/guest-lib.sh; kill_leftovers'
    echo '}'
    for n in "${run[@]}"; do printf 'run_case %s %s %s\n' "$(q "$n")" "${C_TO[$n]}" "$(q "${C_CMD[$n]}")"; done
    echo 'exit 0'
  } > "$S"
  args=(${VM_ARGS[$vm]} -t $((tsum + ${RDMA_VM_TESTS_VM_TIMEOUT:-120})) -f "$ROOT/scripts/vm/guest-lib.sh" -e RUST_BACKTRACE=1)
  [ "${RDMA_VM_VERBOSE:-0}" = 1 ] && args+=(-v)
  for x in ${files[@]+"${files[@]}"}; do args+=(-f "$(host_path "$x")"); done
  log "VM '$vm' (${VM_ARGS[$vm]}): ${#run[@]} cases: ${run[*]}"
  v0=$(date +%s)
  set +e
  "$VMRUN" "${args[@]}" "$S" < /dev/null 2> >(sed -u 's/^/  /' >&2) | while IFS= read -r l; do
    l=${l%$'\r'}
    case $l in
      "@@CASE "*) set -- $l; echo "$2 $3 (${*:4})"; echo "$2 $3" >> "$WORK/results" ;;
      *) [ $VERBOSE = 1 ] || [[ $l == "    | "* ]] && echo "$l" ;;
    esac
  done
  vrc=${PIPESTATUS[0]}
  set -e
  VM_SECS[$vm]=$(( $(date +%s) - v0 ))
  for n in "${run[@]}"; do
    r=$(awk -v n="$n" '$2 == n {print $1}' "$WORK/results" 2>/dev/null | tail -1)
    if [ -n "$r" ]; then RESULT[$n]=$r
    else RESULT[$n]=FAIL; echo "FAIL $n (no result: VM exited with $vrc$([ "$vrc" = 124 ] && echo ', timeout'))"; fi
  done
done

# ---------------------------------------------------------------- summary
np=0 nf=0 ns=0
for n in "${NAMES[@]}"; do case ${RESULT[$n]} in PASS) np=$((np+1)) ;; FAIL) nf=$((nf+1)) ;; SKIP) ns=$((ns+1)) ;; esac; done
tv=""; for vm in "${!VM_SECS[@]}"; do tv+=" vm:$vm ${VM_SECS[$vm]}s"; done
log "timing: build ${T_BUILD}s${tv}, total $(( $(date +%s) - T0 ))s"
echo "$np passed, $nf failed, $ns skipped"
[ $nf = 0 ]
