# guest-lib.sh - helpers for VM test cases (busybox sh, sourced inside the guest).
# Every case command of scripts/rdma-vm-tests.sh runs as `sh -c ". guest-lib.sh; CMD"`
# in /test, with a per-case timeout; exit status 0 = PASS.
# Env from rdma-vm.sh: RDMA_DEV RDMA_IP RDMA_GID_IDX RXE_DEV RXE_IP RXE_GID_IDX SIW_DEV SIW_IP
#   RDMA_VM_NETNS, and in netns mode PEER_NS=peer PEER_IP=10.0.0.1 (`inpeer CMD` runs there).

# pair SERVER_CMD CLIENT_CMD: start the server in the background, give it PAIR_DELAY
# seconds (default 1) to listen, run the client; both must exit 0. The server gets
# PAIR_WAIT seconds (default 30) to finish after the client did.
pair() {
  sh -c "$1" > /tmp/pair-server.log 2>&1 & _sp=$!
  sleep "${PAIR_DELAY:-1}"
  sh -c "$2" > /tmp/pair-client.log 2>&1; _c=$?
  _i=0; while kill -0 $_sp 2>/dev/null && [ $_i -lt $((${PAIR_WAIT:-30} * 10)) ]; do usleep 100000; _i=$((_i + 1)); done
  kill -0 $_sp 2>/dev/null && { echo "server still running ${PAIR_WAIT:-30}s after the client: killing it"; kill -9 $_sp; }
  wait $_sp; _s=$?
  echo "client=$_c server=$_s ($2 | $1)"
  if [ $_c != 0 ] || [ $_s != 0 ] || [ -n "${CASE_VERBOSE:-}" ]; then
    echo "--- client log:"; tail -n 25 /tmp/pair-client.log
    echo "--- server log:"; tail -n 25 /tmp/pair-server.log
  fi
  [ $_c = 0 ] && [ $_s = 0 ]
}

# wait_tcp IP PORT [SECS]: wait until something listens on IP:PORT (root netns)
wait_tcp() {
  _i=0; _hex=$(printf '%02X%02X%02X%02X:%04X' $(echo "$1" | awk -F. '{print $4, $3, $2, $1}') "$2")
  until grep -q " $_hex 00000000:0000 0A" /proc/net/tcp; do
    _i=$((_i + 1)); [ $_i -gt $((${3:-10} * 10)) ] && { echo "nothing listens on $1:$2"; return 1; }; usleep 100000
  done
}

# siw_param NAME VALUE: set a siw tunable at run time (module built with them as params)
siw_param() { echo "$2" > /sys/module/siw/parameters/$1 && echo "siw $1=$(cat /sys/module/siw/parameters/$1)"; }

# mpa_flags FILE: MPA request/reply header flags byte (offset 16) as two hex digits
# (0x80 markers, 0x40 CRC, 0x20 reject, 0x10 enhanced/MPAv2), from a raw TCP capture.
mpa_flags() { od -An -tx1 -j16 -N1 "$1" | tr -d ' \n'; }

# kill_leftovers: kill -9 test programs still running after a case (busybox has no pgrep);
# also stale busybox `timeout` watchers (they outlive the command they guard)
kill_leftovers() {
  for _d in /proc/[0-9]*; do
    read -r _comm < $_d/comm 2>/dev/null || continue
    case $_comm in timeout|rping|ucmatose|udaddy|ib_*|ibv_*|nc|rdma_server|rdma_client|lwio*|verbs_probe|rdma_loop) kill -9 ${_d#/proc/} 2>/dev/null ;; esac
  done
  return 0
}

# serve_verbs TAG DEV IP PORT EXPORT-DIR: `./lwio serve` (plain TCP side channel
# on IP:PORT, RDMA on IP:PORT+1, the verbs provider on DEV) exporting `data`,
# token /tmp/TAG-token; waits until it is ready (SP = its pid). Output in
# /tmp/TAG-serve.{out,err}. Non-zero, with a FAIL line, if it did not start.
serve_verbs() {
  ./lwio serve --no-tls --listen $3:$4 --rdma-listen $3:$(($4 + 1)) --token-file /tmp/$1-token \
    --export data=$5 --provider verbs --device $2 --ready-file /tmp/$1-ready \
    > /tmp/$1-serve.out 2> /tmp/$1-serve.err &
  SP=$!
  _i=0; until [ -s /tmp/$1-ready ]; do
    _i=$((_i + 1)); [ $_i -gt 300 ] && { echo "FAIL: server: $(tail -n 5 /tmp/$1-serve.err)"; return 1; }; usleep 100000
  done
}
