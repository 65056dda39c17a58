#!/bin/sh
# interop-rping.sh - lwio's soft iWARP provider (user space, plain TCP) against the
# kernel's soft-iWARP (siw) with rping's exchange, both directions. Runs inside the
# guest of `scripts/rdma-vm.sh -n -d siw` (busybox sh): our side lives in netns
# "peer" (PEER_IP=10.0.0.1, veth0), siw0 is on veth1 (SIW_IP=10.0.0.2) in the root
# netns, so every byte crosses the veth pair between a TCP socket and kernel siw.
#
# usage (guest): interop-rping.sh [CASE...]      default: all cases below
#   soft-to-siw          rping -s on siw0        <- lwio-rping -c (soft)
#   siw-to-soft          lwio-rping -s (soft)    <- rping -c on siw0
#   soft-to-siw-crc      as soft-to-siw, our client requests MPA CRC (--crc on)
#   siw-to-soft-crc      as siw-to-soft, siw requests CRC (mpa_crc_required=Y)
#   siw-to-soft-crc-ours as siw-to-soft, siw does not ask, our server turns CRC on
#   soft-to-siw-strict   siw mpa_crc_strict=Y, our client insists on CRC:
#                        must be refused cleanly (both sides fail, no hang)
#   siw-p2p-to-soft      siw peer_to_peer=Y initiator (RFC 6581 P2P + RTR). PASS if the
#                        100 iterations work, or if it ends in the known gap (soft responder
#                        without P2P: siw fails to connect, our server sees it go, nothing
#                        hangs); which one is printed. See docs/interop.md.
#   verbs-to-soft        lwio-rping --provider verbs on siw0 (root netns) <- -> soft
#   soft-to-verbs        lwio-rping -s --provider verbs on siw0 <- soft client. Not in the
#                        default list: RACY on iWARP, the verbs API cannot post a receive
#                        before accept, and siw terminates a Send that finds no receive
#   *-64k                any of the above with -S 65535 (rping's largest size)
# env: COUNT (100), LWIO_RPING (./lwio-rping), RPING_PORT (7174)
# host: scripts/rdma-vm.sh -n -d siw -f target/release/lwio-rping \
#         -f scripts/vm/guest-lib.sh scripts/vm/interop-rping.sh [CASE...]
# Prints `PASS case` / `FAIL case (why)` per case with both sides' last lines;
# exit status = number of failed cases (0 = all passed).
cd /test || exit 125
. /test/guest-lib.sh || { echo "interop-rping.sh needs /test/guest-lib.sh (-f scripts/vm/guest-lib.sh)"; exit 125; }
R=${LWIO_RPING:-./lwio-rping}
COUNT=${COUNT:-100}
P=${RPING_PORT:-7174}
[ -x "$R" ] || { echo "no $R (-f target/release/lwio-rping)"; exit 125; }
[ "${RDMA_VM_NETNS:-0}" = 1 ] || { echo "run with rdma-vm.sh -n (netns mode)"; exit 125; }
: "${SIW_IP:?}" "${PEER_IP:?}"
PAIR_WAIT=${PAIR_WAIT:-20}

echo "kernel $(uname -r); siw params: $(cd /sys/module/siw/parameters 2>/dev/null && for f in *; do printf '%s=%s ' "$f" "$(cat "$f")"; done)"
echo "lwio (soft, netns $PEER_NS) $PEER_IP  <->  $SIW_DEV $SIW_IP (root netns); $COUNT iterations, -V"

reset_params() { for p in mpa_crc_required mpa_crc_strict peer_to_peer; do siw_param $p N >/dev/null; done; }

# show_logs: the last line of each side's output that says how it ended
show_logs() {
  echo "  client: $(grep -v '^$' /tmp/pair-client.log | tail -n 1)"
  echo "  server: $(grep -v '^$' /tmp/pair-server.log | tail -n 1)"
  grep -h 'connected to\|accepted' /tmp/pair-client.log /tmp/pair-server.log | sed 's/^/  /'
}

FAILED=0
run_case() {
  c=$1 size=64 S=
  case $c in *-64k) size=65535; c=${c%-64k} ;; esac
  [ $size = 64 ] || S="-S $size"
  srv_rping="rping -s -a $SIW_IP -p $P -C $COUNT -V $S"
  cli_rping="rping -c -a $PEER_IP -p $P -C $COUNT -V $S"
  srv_soft="inpeer $R -s -a $PEER_IP -p $P -C $COUNT -V $S --provider soft --timeout 60"
  cli_soft="inpeer $R -c -a $SIW_IP -p $P -C $COUNT -V $S --provider soft --timeout 60"
  srv_verbs="$R -s -a $SIW_IP -p $P -C $COUNT -V $S --provider verbs --timeout 60"
  cli_verbs="$R -c -a $PEER_IP -p $P -C $COUNT -V $S --provider verbs --timeout 60"
  expect=pass
  reset_params
  case $c in
    soft-to-siw)          srv=$srv_rping cli=$cli_soft ;;
    soft-to-siw-crc)      srv=$srv_rping cli="$cli_soft --crc on" ;;
    soft-to-siw-strict)   siw_param mpa_crc_strict Y; srv=$srv_rping cli="$cli_soft --crc on"; expect=refused ;;
    siw-to-soft)          srv=$srv_soft cli=$cli_rping ;;
    siw-to-soft-crc)      siw_param mpa_crc_required Y; srv=$srv_soft cli=$cli_rping ;;
    siw-to-soft-crc-ours) srv="$srv_soft --crc on" cli=$cli_rping ;;
    siw-p2p-to-soft)      siw_param peer_to_peer Y; srv=$srv_soft cli="timeout 60 $cli_rping"; expect=p2p ;;
    verbs-to-soft)        srv=$srv_soft cli=$cli_verbs ;;
    soft-to-verbs)        srv=$srv_verbs cli=$cli_soft ;;
    *) echo "FAIL $1 (unknown case)"; FAILED=$((FAILED + 1)); return ;;
  esac
  echo "=== $1: server: $srv"
  echo "=== $1: client: $cli"
  t0=$(cut -d' ' -f1 /proc/uptime)
  w=$PAIR_WAIT; [ $expect = refused ] && w=3
  PAIR_DELAY=1 PAIR_WAIT=$w pair "$srv" "$cli" > /tmp/interop-pair.log 2>&1; rc=$?
  t1=$(cut -d' ' -f1 /proc/uptime); d=$(awk -v a="$t0" -v b="$t1" 'BEGIN{printf "%.1f", b-a}')
  reset_params
  # rping has no final line: the pair's exit codes say it; ours says N iterations ok
  if [ $expect = pass ]; then
    if [ $rc = 0 ] && grep -q "lwio-rping: $COUNT iterations ok" /tmp/pair-client.log /tmp/pair-server.log; then
      echo "PASS $1 (${d}s)"; show_logs
    else
      echo "FAIL $1 (${d}s)"; sed 's/^/  | /' /tmp/interop-pair.log; FAILED=$((FAILED + 1))
    fi
  elif [ $expect = refused ]; then
    # our client must fail at connection time with a reject, quickly
    if [ $rc != 0 ] && grep -q "lwio-rping: FAILED after 0 iterations: connect to .*rejected" /tmp/pair-client.log; then
      echo "PASS $1 (refused as expected, ${d}s)"; show_logs
    else
      echo "FAIL $1 (expected a clean MPA reject, ${d}s)"; sed 's/^/  | /' /tmp/interop-pair.log; FAILED=$((FAILED + 1))
    fi
  else
    # p2p: full interop, or the known gap: siw's initiator gives up (no matching RTR)
    # and our server sees the connection go
    if [ $rc = 0 ] && grep -q "lwio-rping: $COUNT iterations ok" /tmp/pair-server.log; then
      echo "PASS $1 (P2P interoperates, ${d}s)"; show_logs
    elif [ $rc != 0 ] && grep -q "CONNECT_ERROR" /tmp/pair-client.log &&
       grep -q "FAILED after 0 iterations: the client disconnected before the first iteration" /tmp/pair-server.log; then
      echo "PASS $1 (known gap: soft responder without RFC 6581 P2P, siw refused, ${d}s)"; show_logs
    else
      echo "FAIL $1 (neither P2P interop nor the clean known-gap failure, ${d}s)"; sed 's/^/  | /' /tmp/interop-pair.log; FAILED=$((FAILED + 1))
    fi
  fi
  # nothing of this case may linger into the next (same port)
  for p in $(pidof rping lwio-rping 2>/dev/null); do kill -9 "$p" 2>/dev/null; done
  sleep 1
}

[ $# -gt 0 ] || set -- soft-to-siw siw-to-soft soft-to-siw-crc siw-to-soft-crc siw-to-soft-crc-ours \
  soft-to-siw-strict soft-to-siw-64k siw-to-soft-64k siw-p2p-to-soft verbs-to-soft
for c in "$@"; do run_case "$c"; done
echo "interop-rping: $(($# - FAILED)) of $# cases passed"
exit $FAILED
