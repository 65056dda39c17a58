# lwio-xprov.sh - VM case: LWIO end to end across providers that share a wire
# transport (busybox sh, in the guest; main VM: rxe0 = $RXE_IP, siw0 = $SIW_IP).
# usage: sh ./lwio-xprov.sh CASE
#   siw-server-soft-client   `lwio serve --provider verbs` on siw0, clients on soft (TCP)
#   soft-server-siw-client   `lwio serve --provider soft`, clients on siw0 (verbs)
#   both                     `lwio serve --provider auto` (rxe0, siw0 and soft), a soft
#                            client, a siw client and an auto client
#   rxe-server-soft-client   server on rxe0 (RoCEv2), soft client: refused in one line
# Each client runs `lwio cat`, `lwio cp` both ways (cmp byte for byte) and `lwio bench`
# in both completion modes. /test/lwio is the host-built release binary.
# Prints PASS/FAIL lines; exit 0 only if everything passed.
case_=$1
L=./lwio
[ -x $L ] || { echo "FAIL: /test/lwio missing"; exit 1; }
# siw charges registrations against RLIMIT_MEMLOCK even for root.
ulimit -l unlimited 2>/dev/null || ulimit -l 1048576 2>/dev/null
EXP=/tmp/xprov-exp; TOK=/tmp/xprov-token; OUT=/tmp/xprov-serve.out; ERR=/tmp/xprov-serve.err
rm -rf $EXP /tmp/xprov-ready; mkdir -p $EXP
head -c 3000001 /dev/urandom > $EXP/src.bin
FAILS=0
fail() { echo "FAIL: $*"; FAILS=$((FAILS + 1)); }
# A client failure also shows what the server logged last (why it closed).
# The client's own log (RUST_LOG=info for the bench) and the kernel's (siw and rxe
# report transmit and protocol errors there) too.
fail_c() {
  fail "$*"; echo "--- serve stderr (last 12 lines):"; tail -n 12 $ERR
  echo "--- client stderr (last 20 lines):"; tail -n 20 /tmp/xprov-c.err
  echo "--- dmesg (last 15 lines):"; dmesg 2>/dev/null | tail -n 15
}

start_server() { # SIDE_ADDR serve-args...
  side=$1; shift
  RUST_LOG=info $L serve --no-tls --listen "$side" --token-file $TOK --export data=$EXP \
    --ready-file /tmp/xprov-ready "$@" > $OUT 2> $ERR &
  SP=$!
  _i=0
  until [ -s /tmp/xprov-ready ]; do
    _i=$((_i + 1))
    if [ $_i -gt 200 ] || ! kill -0 $SP 2>/dev/null; then
      echo "--- serve stdout:"; cat $OUT; echo "--- serve stderr:"; tail -n 20 $ERR
      fail "server did not start ($*)"; return 1
    fi
    usleep 100000
  done
  cat $OUT
}

stop_server() { kill $SP 2>/dev/null; wait $SP 2>/dev/null; }

# check_client NAME CLIENT-ARGS...: cat, cp up, cp down, bench poll + interrupt
check_client() {
  name=$1; shift
  C="--no-tls --token-file $TOK $*"
  url=lwio://$SIDE/data
  if $L cat $C $url/src.bin > /tmp/xprov-cat.bin 2> /tmp/xprov-c.err && cmp /tmp/xprov-cat.bin $EXP/src.bin; then
    echo "PASS $name cat 3000001 bytes"
  else
    fail_c "$name cat: $(tail -n 3 /tmp/xprov-c.err)"
  fi
  head -c 1000003 /dev/urandom > /tmp/xprov-up.bin
  if $L cp $C /tmp/xprov-up.bin $url/up-$name.bin 2> /tmp/xprov-c.err && cmp /tmp/xprov-up.bin $EXP/up-$name.bin; then
    echo "PASS $name cp upload 1000003 bytes"
  else
    fail_c "$name cp upload: $(tail -n 3 /tmp/xprov-c.err)"
  fi
  rm -f /tmp/xprov-down.bin
  if $L cp $C $url/src.bin /tmp/xprov-down.bin 2> /tmp/xprov-c.err && cmp /tmp/xprov-down.bin $EXP/src.bin; then
    echo "PASS $name cp download 3000001 bytes"
  else
    fail_c "$name cp download: $(tail -n 3 /tmp/xprov-c.err)"
  fi
  for m in poll interrupt; do
    if RUST_LOG=info $L bench $C $url/bench.dat --rw randrw --bs 16k --qd 4 --size 4M --runtime 1s \
        --completion $m --json > /tmp/xprov-bench.json 2> /tmp/xprov-c.err \
        && grep -q '"iops"' /tmp/xprov-bench.json; then
      echo "PASS $name bench $m: $(tr ',' '\n' < /tmp/xprov-bench.json | grep -m1 '"iops"')"
    else
      fail_c "$name bench $m: $(grep -v ' INFO ' /tmp/xprov-c.err | tail -n 3)"
    fi
  done
}

expect_listener() { # pattern: the server printed this listener
  grep -q "$1" $OUT || fail "server did not list a listener matching '$1'"
}

case $case_ in
siw-server-soft-client)
  SIDE=$SIW_IP:7460
  start_server $SIDE --provider verbs --device $SIW_DEV --rdma-listen $SIW_IP:7461 || exit 1
  expect_listener "RDMA listening on $SIW_IP:7461 (provider verbs, $SIW_DEV, iWARP)"
  check_client soft --provider soft
  stop_server ;;
soft-server-siw-client)
  SIDE=$SIW_IP:7470
  start_server $SIDE --provider soft --rdma-listen $SIW_IP:7471 || exit 1
  expect_listener "RDMA listening on $SIW_IP:7471 (provider soft, soft0, iWARP)"
  check_client siw --provider verbs --device $SIW_DEV
  stop_server ;;
both)
  SIDE=$SIW_IP:7480
  start_server $SIDE --provider auto --rdma-listen 0.0.0.0:7481 || exit 1
  expect_listener "(provider verbs, $SIW_DEV, iWARP)"
  expect_listener "(provider verbs, $RXE_DEV, RoCEv2)"
  expect_listener "(provider soft, soft0, iWARP)"
  check_client soft --provider soft
  check_client siw --provider verbs --device $SIW_DEV
  # auto: hardware devices that route to the server's address come first,
  # so every connection of the auto client lands on a verbs listener
  # (rxe0's or siw0's, both local addresses), none on the soft one.
  n0=$(grep -c 'RDMA connection accepted' $ERR)
  check_client auto
  accepted=$(grep 'RDMA connection accepted' $ERR | tail -n +$((n0 + 1)))
  if [ -n "$accepted" ] && ! echo "$accepted" | grep -qv "(verbs "; then
    echo "PASS auto client: $(echo "$accepted" | wc -l) connection(s), all on verbs listeners: $(echo "$accepted" | grep -o '(verbs [a-z0-9]*)' | sort -u | tr '\n' ' ')"
  else
    fail "auto client connections not all on verbs listeners: $accepted"
  fi
  stop_server ;;
rxe-server-soft-client)
  SIDE=$RXE_IP:7490
  start_server $SIDE --provider verbs --device $RXE_DEV --rdma-listen $RXE_IP:7491 || exit 1
  want="lwio: error: no RDMA transport in common: the client offers iWARP, the server offers RoCEv2 at $RXE_IP:7491"
  RUST_LOG=warn $L cat --no-tls --token-file $TOK --provider soft lwio://$SIDE/data/src.bin > /tmp/xprov-cat.bin 2> /tmp/xprov-c.err; r=$?
  if [ $r != 0 ] && [ "$(cat /tmp/xprov-c.err)" = "$want" ] && [ ! -s /tmp/xprov-cat.bin ]; then
    echo "PASS refused in one line: $want"
  else
    fail "expected exit != 0 and exactly '$want'; got exit $r and '$(cat /tmp/xprov-c.err)'"
  fi
  stop_server ;;
*) echo "usage: lwio-xprov.sh siw-server-soft-client|soft-server-siw-client|both|rxe-server-soft-client"; exit 2 ;;
esac
echo "lwio-xprov $case_: $FAILS failure(s)"
[ $FAILS = 0 ]
