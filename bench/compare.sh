#!/bin/bash
# compare.sh - lwio side by side with NBD, SMB3, NFS, raw TCP and local I/O, in one run, on loopback.
#
#   local    fio ioengine=io_uring on the data file itself
#   raw TCP  iperf3 (one stream) and sockperf 64-byte TCP ping-pong
#   NBD      nbdkit file plugin; client fio ioengine=nbd
#   SMB3     Samba smbd; client libsmbclient (bench/compare/rio.c: QD = processes, one connection each)
#   NFSv3    nfs-ganesha, VFS FSAL; client libnfs (rio: one connection, QD async requests)
#   lwio     `lwio serve --provider soft` (user-space iWARP over TCP); client `lwio bench`,
#            once with --completion poll and once with --completion interrupt
#
# Workloads, the same for every system, on one 1 GiB file of random bytes in a tmpfs (page cache):
#   seqread / seqwrite 1 MiB QD8, seqwrite16 16 MiB QD2, rr1 / rr32 4 KiB random read QD1 / QD32, rw1 4 KiB random write QD1;
#   rr1 (sockperf for raw TCP) again with CPU placements "same" (client and server pinned to vCPU 0)
#   and "split" (client vCPU 0, server vCPU 1).
# Recorded per test: GB/s, IOPS, latency p50/p99, client and server CPU per I/O and per GiB.
#
# usage:  bench/compare.sh [--quick]          install (if missing), build lwio, run, report
#         bench/compare.sh report RUNDIR      print the report of an earlier run again
#   --quick   smoke test: 2 s per test, placement "same" only, quiet-wait 1 s
# env:    COMPARE_ROOT  scratch and results (default /tmp/lwio-compare); results in $COMPARE_ROOT/results/run-*/
#         COMPARE_DUR   seconds per timed test (5)        COMPARE_RUNS  repetitions, medians reported (1)
#         COMPARE_QUIET max seconds to wait for a quiet host before each test (5)
#         COMPARE_ONLY  subset of "local tcp nbd smb nfs lwio"
#         COMPARE_PLACEMENTS  pinned QD1 variants (default "same split"; "" for none)
#         LWIO_BIN      use this lwio binary instead of `cargo build --release -p lwio` (honours CARGO_TARGET_DIR)
#
# Output: the markdown summary on stdout (progress on stderr), saved as RUNDIR/summary.md, with the raw
# output of every test in RUNDIR/r1/SYSTEM.TEST.{out,err,time}, RUNDIR/r1/index.tsv and commands.tsv.
#
# Every server and client runs inside a private network+mount namespace (unshare -n -m) that has
# only the loopback interface, so nothing listens beyond this host; /run and the data directory are
# private tmpfs mounts there. Servers are stopped by PID at the end of their section; on exit
# (normal, error or signal) every process left in that namespace is stopped too. Needs root.
# A full run takes about 7 minutes once the packages are installed (44 tests of 5 s plus waits).
set -u
if [ "${1:-}" = --quick ]; then   # via the environment, so that the namespaced re-invocation sees it too
  export COMPARE_DUR=${COMPARE_DUR:-2} COMPARE_QUIET=${COMPARE_QUIET:-1} COMPARE_PLACEMENTS=${COMPARE_PLACEMENTS-same}
fi
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/.." && pwd)
LIB=$HERE/compare
ROOT=${COMPARE_ROOT:-/tmp/lwio-compare}
DATA=$ROOT/data
TOOLS=$ROOT/tools
RES=$ROOT/results
DUR=${COMPARE_DUR:-5}
RUNS=${COMPARE_RUNS:-1}
QUIET=${COMPARE_QUIET:-5}
ONLY=${COMPARE_ONLY:-"local tcp nbd smb nfs lwio"}
PLACEMENTS=${COMPARE_PLACEMENTS-"same split"}
SMBPASS=peerpass
PY=/usr/bin/python3
PKGS="fio iperf3 sockperf nbdkit samba libsmbclient-dev libnfs-dev nfs-ganesha nfs-ganesha-vfs rpcbind
      iproute2 time gcc pkg-config util-linux procps coreutils python3"
LWIO_URL=lwio://127.0.0.1:7420/data/file.bin

log() { echo "[compare $(date +%H:%M:%S)] $*" >&2; }
want() { case " $ONLY " in *" $1 "*) return 0;; esac; return 1; }

# ------------------------------------------------------------------------------------------ setup
POLICY=/usr/sbin/policy-rc.d POLICY_TAG="temporary, from lwio bench/compare.sh: no service starts during its apt-get" POLICY_MINE=""
drop_policy() {
  [ -n "$POLICY_MINE" ] && grep -qF "$POLICY_TAG" "$POLICY" 2>/dev/null && rm -f "$POLICY"
  POLICY_MINE=""
}
do_install() {
  mkdir -p "$ROOT" "$DATA" "$TOOLS" "$RES" "$ROOT/lwio"
  local missing="" p
  for p in $PKGS; do dpkg-query -W -f='${Status}\n' "$p" 2>/dev/null | grep -q 'install ok installed' || missing="$missing $p"; done
  if [ -n "$missing" ]; then
    log "apt-get install:$missing"
    while fuser /var/lib/dpkg/lock-frontend >/dev/null 2>&1; do sleep 3; done   # another apt may run
    # Debian would start smbd, nmbd, nfs-ganesha and rpcbind on all interfaces right away: a temporary
    # policy-rc.d (only if the host has none) keeps every service from starting during the install.
    if [ ! -e "$POLICY" ]; then
      printf '#!/bin/sh\n# %s\nexit 101\n' "$POLICY_TAG" > "$POLICY" && chmod 755 "$POLICY" && POLICY_MINE=1
    fi
    # shellcheck disable=SC2086
    if ! DEBIAN_FRONTEND=noninteractive apt-get install -y $missing >> "$ROOT/install.log" 2>&1; then
      apt-get update >> "$ROOT/install.log" 2>&1
      # shellcheck disable=SC2086
      DEBIAN_FRONTEND=noninteractive apt-get install -y $missing >> "$ROOT/install.log" 2>&1 ||
        { log "apt-get failed, see $ROOT/install.log"; exit 1; }
    fi
    [ -n "$POLICY_MINE" ] && log "note: Debian enabled the new packages' services for the next boot;" \
      "'systemctl disable smbd nmbd nfs-ganesha rpcbind rpcbind.socket' keeps them off"
    drop_policy
  fi
  if [ ! -x "$TOOLS/rio" ] || [ "$LIB/rio.c" -nt "$TOOLS/rio" ]; then
    # shellcheck disable=SC2046
    gcc -O2 -Wall -o "$TOOLS/rio" "$LIB/rio.c" $(pkg-config --cflags --libs smbclient libnfs) || exit 1
  fi
  fio --enghelp 2>&1 | grep -qw nbd || log "WARNING: this fio has no nbd engine"
}

# lwio: build once, here, outside the namespace. LWIO = the binary, LWIO_ERR = why there is none.
build_lwio() {
  LWIO=${LWIO_BIN:-} LWIO_ERR=""
  if [ -z "$LWIO" ]; then
    local tdir
    tdir=$(cd "$REPO" && cargo metadata --format-version 1 --no-deps 2>/dev/null |
           $PY -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])') || tdir=${CARGO_TARGET_DIR:-$REPO/target}
    LWIO=$tdir/release/lwio
    log "cargo build --release -p lwio (target dir $tdir)"
    # in its own process group, so that a signal to this script stops cargo and its rustc children too
    (cd "$REPO" && exec setsid -w cargo build --release -p lwio) > "$ROOT/build.log" 2>&1 &
    BUILD_PID=$!
    if ! wait "$BUILD_PID"; then
      LWIO_ERR="cargo build --release -p lwio failed: $(grep -m3 -E '^error' "$ROOT/build.log" | tr '\n' ' ')"
      LWIO=""
      log "$LWIO_ERR (lwio rows will say FAILED; log: $ROOT/build.log)"
    fi
    BUILD_PID=""
  fi
  [ -z "$LWIO" ] || [ -x "$LWIO" ] || { LWIO_ERR="no lwio binary at $LWIO"; LWIO=""; }
  export LWIO LWIO_ERR
}

env_txt() {
  local commit dirty
  commit=$(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo unknown)
  dirty=$(git -C "$REPO" status --porcelain --untracked-files=no -- crates Cargo.toml Cargo.lock 2>/dev/null | wc -l)
  echo "date:     $(date -Is)"
  echo "machine:  $(hostname) | $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //') | $(nproc) vCPU | $(free -g | awk '/^Mem:/{print $2}') GiB RAM | $(systemd-detect-virt 2>/dev/null || echo virt-unknown)"
  echo "kernel:   $(uname -r) | load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
  echo "lwio:     commit $commit$([ "$dirty" -gt 0 ] && echo " + $dirty uncommitted change(s) in crates/") | ${LWIO:-none: $LWIO_ERR}"
  echo "settings: ${DUR}s per test, $RUNS repetition(s), quiet-wait <= ${QUIET}s, systems: $ONLY, placements: unpinned ${PLACEMENTS:-}"
  echo "data:     one 1 GiB file of /dev/urandom bytes on a private tmpfs ($DATA/file.bin), written before the run"
  echo "packages: $(dpkg-query -W -f='${Package} ${Version}, ' fio iperf3 sockperf nbdkit samba libsmbclient 'libnfs1*' nfs-ganesha 2>/dev/null | sed 's/, $//')"
}

# ------------------------------------------------------------------------------------------ namespace cleanup
# Every process in network namespace $1 (e.g. "net:[4026532…]") except this shell; never the host's namespace.
ns_pids() {
  find /proc/[0-9]*/ns/net -maxdepth 0 -printf '%h %l\n' 2>/dev/null |
    awk -v ns="$1" -v me="$BASHPID" '$2 == ns { split($1, p, "/"); if (p[3] != me) print p[3] }'
}
sweep_ns() {
  local ns=$1 p i left
  [ -n "$ns" ] && [ "$ns" != "$HOST_NS" ] || return 0
  for p in $(ns_pids "$ns"); do [ "$p" != "$$" ] && kill -TERM "$p" 2>/dev/null; done
  for i in $(seq 30); do
    left=$(ns_pids "$ns" | grep -vx "$$")
    [ -z "$left" ] && return 0
    sleep 0.1
  done
  for p in $left; do kill -KILL "$p" 2>/dev/null; done
}

# ------------------------------------------------------------------------------------------ bench helpers
cpu_jiffies() { local _c u n s i w q sq st _r; read -r _c u n s i w q sq st _r < /proc/stat; echo "$((u+n+s+q+sq+st)) $((u+n+s+i+w+q+sq+st))"; }
busy_frac() {
  local j0 j1
  read -r -a j0 <<< "$(cpu_jiffies)"; sleep "$1"; read -r -a j1 <<< "$(cpu_jiffies)"
  awk -v d1=$((j1[0]-j0[0])) -v d2=$((j1[1]-j0[1])) 'BEGIN{printf "%.3f", d2 ? d1/d2 : 0}'
}
# wait (at most $QUIET s) until the host is <10% busy while nothing of ours runs but idle servers
quiet_gate() {
  local t0; t0=$(date +%s)
  while :; do
    BG=$(busy_frac 1)
    awk -v b="$BG" 'BEGIN{exit !(b < 0.10)}' && return 0
    [ $(( $(date +%s) - t0 )) -ge "$QUIET" ] && { log "host still busy ($BG), measuring anyway"; return 0; }
    sleep 1
  done
}
KILL_PIDS=()
# the started servers and all their descendants (smbd forks a process per client)
server_tree() {
  [ ${#KILL_PIDS[@]} -gt 0 ] || return 0
  ps -e -o pid=,ppid= | awk -v roots="${KILL_PIDS[*]}" '
    BEGIN { n = split(roots, r, " "); for (i = 1; i <= n; i++) s[r[i]] = 1 }
    { par[$1] = $2 }
    END { do { ch = 0; for (p in par) if (!(p in s) && (par[p] in s)) { s[p] = 1; ch = 1 } } while (ch); for (p in s) print p }'
}
# CPU placement of one test (PIN=none|same|split): none = scheduler decides; same = client and all server
# processes/threads on vCPU 0; split = client on vCPU 0, servers on vCPU 1.
PIN=none
pin_servers() { local p; for p in $(server_tree); do taskset -a -p -c "$1" "$p" > /dev/null 2>&1; done; }
# meas SYSTEM TEST TOOL cmd... : one timed client run; raw output kept in $REP/SYSTEM.TEST.{out,err,time}
meas() {
  local peer=$1 test=$2 tool=$3; shift 3
  local b="$REP/$peer.$test" s0 s1 t0 t1 rc srv
  case $PIN in
    same)  pin_servers 0; set -- taskset -c 0 "$@" ;;
    split) pin_servers 1; set -- taskset -c 0 "$@" ;;
    *)     pin_servers "0-$(( $(nproc) - 1 ))" ;;
  esac
  printf '%s\t%s\t%s\n' "$peer" "$test" "$(printf '%q ' "$@")" >> "$REP/commands.tsv"
  srv=$(IFS=,; echo "${KILL_PIDS[*]}")
  quiet_gate
  s0=$($PY -S "$LIB/snap.py" "$srv")
  t0=$(date +%s.%N)
  /usr/bin/time -f '%U %S %e' -o "$b.time" timeout -k 5 $((DUR + 60)) "$@" > "$b.out" 2> "$b.err"; rc=$?
  t1=$(date +%s.%N)
  s1=$($PY -S "$LIB/snap.py" "$srv")
  printf '%s\t%s\t%s\t%s\t%s\t%s %s\t%s\t%s\t%s\n' "$peer" "$test" "$tool" "$rc" "$BG" "$t0" "$t1" "$s0" "$s1" \
    "$(tail -1 "$b.time")" >> "$REP/index.tsv"
  if [ $rc -ne 0 ]; then log "FAILED rc=$rc $peer $test: $(tail -3 "$b.err" | tr '\n' ' ')"; else log "done $peer $test"; fi
}
# fail_test SYSTEM TEST WHY : a test that could not run (its server did not start, no binary): FAILED in the report
fail_test() {
  echo "$3" > "$REP/$1.$2.err"
  printf '%s\t%s\t-\tnot-run\t0\t0 0\t0 0\t0 0\t0 0 0\n' "$1" "$2" >> "$REP/index.tsv"
  log "FAILED $1 $2: $3"
}
# placements FUNC SYSTEM TEST args... : FUNC again for each pinned placement, as tests TEST.same / TEST.split
placements() { local f=$1 peer=$2 test=$3 p; shift 3; for p in $PLACEMENTS; do PIN=$p "$f" "$peer" "$test.$p" "$@"; done; }
server_cmd() { printf '%s\t%s\t%s\n' "$1" "(server)" "$2" >> "$REP/commands.tsv"; }
fio_t() { local peer=$1 test=$2 rw=$3 bs=$4 qd=$5; shift 5
  meas "$peer" "$test" fio fio --name="$test" --rw="$rw" --bs="$bs" --iodepth="$qd" --time_based --runtime="$DUR" \
       --lat_percentiles=1 --output-format=json "$@"; }
# rio_t SYSTEM TEST BACKEND TARGET MODE BS QD   (rio prints one JSON line; see bench/compare/rio.c)
rio_t() { meas "$1" "$2" rio env SMBPASS="$SMBPASS" "$TOOLS/rio" "$3" "$4" "$5" "$6" "$7" "$DUR"; }
# lwio_t SYSTEM TEST RW BS QD  (SYSTEM lwio-poll / lwio-interrupt names the completion mode)
lwio_t() {
  meas "$1" "$2" lwio "$LWIO" bench "$LWIO_URL" --rw "$3" --bs "$4" --qd "$5" --size 1G --runtime "${DUR}s" \
       --completion "${1#lwio-}" --provider soft --no-tls --token-file "$ROOT/lwio/token" --json
}
stop_pid() {
  local p=$1 c i
  [ -d "/proc/$p" ] || return 0
  for c in $(ps -o pid= --ppid "$p"); do kill "$c" 2>/dev/null; done
  kill "$p" 2>/dev/null
  for i in $(seq 50); do [ -d "/proc/$p" ] || return 0; sleep 0.1; done
  kill -9 "$p" 2>/dev/null
}
stop_servers() { local p; for p in ${KILL_PIDS[@]+"${KILL_PIDS[@]}"}; do stop_pid "$p"; done; KILL_PIDS=(); }
wait_file() { local i; for i in $(seq 100); do [ -s "$1" ] && return 0; sleep 0.1; done; log "timeout waiting for $1"; return 1; }
wait_port() { local i; for i in $(seq 100); do ss -ltn "sport = :$1" | grep -q LISTEN && return 0; sleep 0.1; done; log "port $1 not listening"; return 1; }
WORKLOADS="seqread seqwrite seqwrite16 rr1 rr32 rw1"
fail_all() { local peer=$1 why=$2 t p; for t in $WORKLOADS; do fail_test "$peer" "$t" "$why"; done
  for p in $PLACEMENTS; do fail_test "$peer" "rr1.$p" "$why"; done; }

# ------------------------------------------------------------------------------------------ sections
sec_local() {
  # fio's default invalidate=1 would drop the file's page cache before each job: keep it.
  local T=("--filename=$DATA/file.bin" --invalidate=0 --size=1G --ioengine=io_uring)
  if ! fio --name=probe "${T[@]}" --rw=randread --bs=4k --runtime=1 --time_based >/dev/null 2>&1; then
    T=("${T[@]:0:3}" --ioengine=psync)
    echo "note:     $REP: io_uring unusable here, the local rows use psync" >> "$REP/../env.txt"
  fi
  fio_t local seqread  read      1M 8  "${T[@]}"
  fio_t local seqwrite write     1M 8  "${T[@]}"
  fio_t local seqwrite16 write   16M 2  "${T[@]}"
  fio_t local rr1      randread  4k 1  "${T[@]}"
  fio_t local rr32     randread  4k 32 "${T[@]}"
  fio_t local rw1      randwrite 4k 1  "${T[@]}"
}
sec_tcp() {
  server_cmd tcp "iperf3 -s -B 127.0.0.1 -p 5201 -D -I $RUN/iperf3.pid; sockperf server --tcp -i 127.0.0.1 -p 11111"
  iperf3 -s -B 127.0.0.1 -p 5201 -D -I "$RUN/iperf3.pid" && wait_file "$RUN/iperf3.pid" && KILL_PIDS+=("$(cat "$RUN/iperf3.pid")")
  sockperf server --tcp -i 127.0.0.1 -p 11111 > "$REP/sockperf-server.log" 2>&1 &
  KILL_PIDS+=($!)
  wait_port 5201; wait_port 11111
  meas tcp iperf3 iperf3 iperf3 -c 127.0.0.1 -p 5201 -t "$DUR" -J
  pingpong() { meas "$1" "$2" sockperf sockperf ping-pong --tcp -i 127.0.0.1 -p 11111 -m 64 -t "$DUR" --full-rtt; }
  pingpong tcp pingpong
  placements pingpong tcp pingpong
  stop_servers
}
sec_nbd() {
  rm -f "$RUN/nbdkit.pid"
  server_cmd nbd "nbdkit -i 127.0.0.1 -p 10809 -P $RUN/nbdkit.pid file file=$DATA/file.bin"
  if ! { nbdkit -i 127.0.0.1 -p 10809 -P "$RUN/nbdkit.pid" file file="$DATA/file.bin" && wait_file "$RUN/nbdkit.pid"; }; then
    fail_all nbd "nbdkit did not start"; return
  fi
  KILL_PIDS+=("$(cat "$RUN/nbdkit.pid")")
  local NBD=(--ioengine=nbd --uri=nbd://127.0.0.1:10809 --size=1G)
  fio_t nbd seqread  read      1M 8  "${NBD[@]}"
  fio_t nbd seqwrite write     1M 8  "${NBD[@]}"
  fio_t nbd seqwrite16 write   16M 2  "${NBD[@]}"
  fio_t nbd rr1      randread  4k 1  "${NBD[@]}"
  fio_t nbd rr32     randread  4k 32 "${NBD[@]}"
  fio_t nbd rw1      randwrite 4k 1  "${NBD[@]}"
  placements fio_t nbd rr1 randread 4k 1 "${NBD[@]}"
  stop_servers
}
sec_smb() {
  local S=$ROOT/smb
  rm -rf "$S"; mkdir -p "$S"/{private,lock,state,cache,pid,log,ncalrpc}
  cat > "$S/smb.conf" <<SMB_EOF
[global]
  server role = standalone server
  interfaces = 127.0.0.1
  bind interfaces only = yes
  smb ports = 445
  disable netbios = yes
  server min protocol = SMB3
  client min protocol = SMB3
  passdb backend = tdbsam:$S/private/passdb.tdb
  private dir = $S/private
  lock directory = $S/lock
  state directory = $S/state
  cache directory = $S/cache
  pid directory = $S/pid
  ncalrpc dir = $S/ncalrpc
  log file = $S/log/log.%m
  log level = 0
  load printers = no
  printing = bsd
  printcap name = /dev/null
  disable spoolss = yes
  server signing = disabled
  smb encrypt = off
[data]
  path = $DATA
  read only = no
  valid users = root
SMB_EOF
  cp "$S/smb.conf" "$REP/smb.conf"
  printf '%s\n%s\n' "$SMBPASS" "$SMBPASS" | smbpasswd -c "$S/smb.conf" -a -s root > /dev/null 2>&1
  server_cmd smb "smbd -D -s $S/smb.conf   (smb.conf: $REP/smb.conf; Samba defaults otherwise, signing and encryption off)"
  if ! { smbd -D -s "$S/smb.conf" && wait_file "$S/pid/smbd.pid" && wait_port 445; }; then
    fail_all smb "smbd did not start: $(tail -2 "$S"/log/log.* 2>/dev/null | tr '\n' ' ')"; return
  fi
  KILL_PIDS+=("$(cat "$S/pid/smbd.pid")")
  local U=smb://127.0.0.1/data/file.bin
  rio_t smb seqread  smb $U read      1048576 8    # 8 client processes x 1 connection each
  rio_t smb seqwrite smb $U write     1048576 8
  rio_t smb seqwrite16 smb $U write   16777216 2
  rio_t smb rr1      smb $U randread  4096    1
  rio_t smb rr32     smb $U randread  4096    32
  rio_t smb rw1      smb $U randwrite 4096    1
  placements rio_t smb rr1 smb $U randread 4096 1
  stop_servers
}
sec_nfs() {
  local N=$ROOT/nfs
  rm -rf "$N"; mkdir -p "$N/recov" "$N/log"
  # No Bind_addr: getaddrinfo(AI_ADDRCONFIG) in ganesha rejects "127.0.0.1" in a namespace with only lo;
  # the namespace has no other interface, so the wildcard listener is loopback-only.
  cat > "$N/ganesha.conf" <<NFS_EOF
NFS_CORE_PARAM {
    NFS_Port = 2049;
    MNT_Port = 20048;
    Protocols = 3;
    Enable_NLM = false;
    Enable_RQUOTA = false;
    Enable_UDP = false;
}
NFSV4 { Graceless = true; RecoveryRoot = $N/recov; }
EXPORT {
    Export_Id = 1;
    Path = $DATA;
    Pseudo = /data;
    Access_Type = RW;
    Squash = No_Root_Squash;
    SecType = sys;
    Protocols = 3;
    Transports = TCP;
    FSAL { Name = VFS; }
}
LOG { Default_Log_Level = EVENT; }
NFS_EOF
  cp "$N/ganesha.conf" "$REP/ganesha.conf"
  # NFSv3 needs rpcbind (ganesha exits if it cannot register v3); it runs in this private netns+/run only
  server_cmd nfs3 "rpcbind -f; ganesha.nfsd -f $N/ganesha.conf -L $N/log/ganesha.log -p $RUN/ganesha.pid -N NIV_EVENT   (config: $REP/ganesha.conf)"
  rpcbind -f > "$N/log/rpcbind.log" 2>&1 &
  KILL_PIDS+=($!); wait_port 111
  rm -f "$RUN/ganesha.pid"
  if ! { ganesha.nfsd -f "$N/ganesha.conf" -L "$N/log/ganesha.log" -p "$RUN/ganesha.pid" -N NIV_EVENT &&
         wait_file "$RUN/ganesha.pid" && wait_port 2049; }; then
    fail_all nfs3 "ganesha did not start: $(grep -E 'FATAL|MAJ' "$N/log/ganesha.log" | tail -2 | tr '\n' ' ')"
    stop_servers; return
  fi
  KILL_PIDS+=("$(cat "$RUN/ganesha.pid")")
  sleep 1
  local U="nfs://127.0.0.1$DATA/file.bin?version=3"
  rio_t nfs3 seqread  nfs "$U" read      1048576 8
  rio_t nfs3 seqwrite nfs "$U" write     1048576 8
  rio_t nfs3 seqwrite16 nfs "$U" write   16777216 2
  rio_t nfs3 rr1      nfs "$U" randread  4096    1
  rio_t nfs3 rr32     nfs "$U" randread  4096    32
  rio_t nfs3 rw1      nfs "$U" randwrite 4096    1
  placements rio_t nfs3 rr1 nfs "$U" randread 4096 1
  stop_servers
}
sec_lwio() {
  local m
  if [ -z "$LWIO" ]; then
    for m in poll interrupt; do fail_all "lwio-$m" "$LWIO_ERR"; done; return
  fi
  # the default limits suffice: one connection per run, credits = QD (server grants up to 128)
  local cmd=("$LWIO" serve --export "data=$DATA" --listen 127.0.0.1:7420 --token-file "$ROOT/lwio/token"
             --provider soft --no-tls --ready-file "$RUN/lwio.ready")
  server_cmd lwio "RUST_LOG=warn $(printf '%q ' "${cmd[@]}")"
  rm -f "$RUN/lwio.ready"
  RUST_LOG=warn "${cmd[@]}" > "$REP/lwio-server.out" 2> "$REP/lwio-server.log" &
  local pid=$! i
  KILL_PIDS+=("$pid")
  for i in $(seq 300); do   # up to 30 s, while it lives
    [ -s "$RUN/lwio.ready" ] || ! kill -0 "$pid" 2>/dev/null && break
    sleep 0.1
  done
  if ! { [ -s "$RUN/lwio.ready" ] && grep -q 'RDMA listening' "$REP/lwio-server.out"; }; then
    local why
    why="lwio serve did not start ($(kill -0 "$pid" 2>/dev/null && echo "no ready file after 30 s" || echo "it exited")): $(cat "$REP/lwio-server.log" "$REP/lwio-server.out" 2>/dev/null | tail -2 | tr '\n' ' ')"
    for m in poll interrupt; do fail_all "lwio-$m" "$why"; done
    stop_servers; return
  fi
  for m in poll interrupt; do
    lwio_t "lwio-$m" seqread  read      1M 8
    lwio_t "lwio-$m" seqwrite write     1M 8
    lwio_t "lwio-$m" seqwrite16 write   16M 2
    lwio_t "lwio-$m" rr1      randread  4k 1
    lwio_t "lwio-$m" rr32     randread  4k 32
    lwio_t "lwio-$m" rw1      randwrite 4k 1
    placements lwio_t "lwio-$m" rr1 randread 4k 1
  done
  stop_servers
}

# runs inside: unshare -m -n --propagation private; $1 = this repetition's output directory
bench_inner() {
  REP=$1; RUN=$REP/run; mkdir -p "$RUN"
  HOST_NS=none
  readlink /proc/self/ns/net > "$REP/netns"
  trap 'stop_servers; sweep_ns "$(readlink /proc/$$/ns/net)"' EXIT
  trap 'exit 130' INT TERM HUP
  ip link set lo up || exit 1
  mount -t tmpfs -o size=64M compare-run /run || exit 1
  mount -t tmpfs -o size=4G,mode=0755 compare-data "$DATA" || exit 1
  head -c 1G /dev/urandom > "$DATA/file.bin"
  want local && sec_local
  want tcp   && sec_tcp
  want nbd   && sec_nbd
  want smb   && sec_smb
  want nfs   && sec_nfs
  want lwio  && sec_lwio
  log "repetition finished: $REP"
}

# ------------------------------------------------------------------------------------------ main
# on exit, also after a signal: stop a running cargo build, then everything left in the namespaces
outer_cleanup() {
  local f
  drop_policy
  [ -n "$BUILD_PID" ] && kill -TERM -- "-$BUILD_PID" 2>/dev/null
  [ -n "$INNER_PID" ] && kill -TERM "$INNER_PID" 2>/dev/null
  if [ -n "$OUT_DIR" ]; then
    for f in "$OUT_DIR"/r*/netns; do [ -f "$f" ] && sweep_ns "$(cat "$f")"; done
  fi
}
main() {
  local t0 r
  t0=$(date +%s)
  [ "$(id -u)" = 0 ] || { echo "compare.sh needs root (namespaces, tmpfs mounts, packages)" >&2; exit 1; }
  HOST_NS=$(readlink /proc/self/ns/net) OUT_DIR="" BUILD_PID="" INNER_PID=""
  trap outer_cleanup EXIT
  trap 'exit 130' INT TERM HUP
  do_install
  if want lwio; then build_lwio; else LWIO="" LWIO_ERR="not selected"; export LWIO LWIO_ERR; fi
  OUT_DIR=$RES/run-$(date +%Y%m%d-%H%M%S); mkdir -p "$OUT_DIR"
  env_txt > "$OUT_DIR/env.txt"
  for r in $(seq "$RUNS"); do
    log "repetition $r/$RUNS -> $OUT_DIR/r$r"
    unshare -m -n --propagation private bash "$0" _inner "$OUT_DIR/r$r" &
    INNER_PID=$!
    wait "$INNER_PID"
    INNER_PID=""
  done
  echo "$(( $(date +%s) - t0 ))" > "$OUT_DIR/elapsed_s"
  $PY "$LIB/report.py" "$OUT_DIR"
  log "summary: $OUT_DIR/summary.md; total elapsed $(( $(date +%s) - t0 )) s"
}

case "${1:-}" in
  _inner) bench_inner "$2" ;;
  report) $PY "$LIB/report.py" "${2:?usage: compare.sh report RUNDIR}" ;;
  ""|--quick) main ;;
  -h|--help) sed -n '2,/^set -u/p' "$0" | sed '$d'; exit 0 ;;
  *) echo "unknown argument $1 (see --help)" >&2; exit 2 ;;
esac
