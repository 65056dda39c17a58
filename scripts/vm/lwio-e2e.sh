# lwio-e2e.sh - VM case: LWIO end to end over real verbs (busybox sh, in the guest).
# usage: sh ./lwio-e2e.sh DEVICE IP      e.g. sh ./lwio-e2e.sh $RXE_DEV $RXE_IP
# Runs /test/lwio-e2e-vm (crates/lwio/examples/lwio-e2e-vm.rs, host-built with
# `cargo build --release --example lwio-e2e-vm`): server and client in one process on
# the verbs provider's DEVICE, both completion modes, data checked byte for byte;
# over rxe interrupt-mode reads must complete by RDMA Write with Immediate, over siw
# (no memory windows) the provider's per-request registration stands in for windows.
# Prints the program's PASS/FAIL lines; exit 0 only if it passed.
dev=$1 ip=$2
[ -n "$dev" ] && [ -n "$ip" ] || { echo "usage: lwio-e2e.sh DEVICE IP"; exit 2; }
[ -x ./lwio-e2e-vm ] || { echo "FAIL: /test/lwio-e2e-vm missing"; exit 1; }
# siw charges every registration against RLIMIT_MEMLOCK even for root (rxe does not);
# server + client in one process register several MiB.
ulimit -l unlimited 2>/dev/null || ulimit -l 1048576 2>/dev/null || echo "note: cannot raise ulimit -l ($(ulimit -l))"
./lwio-e2e-vm "$dev" "$ip" > /tmp/lwio-e2e.log 2>&1; r=$?
cat /tmp/lwio-e2e.log
grep -q '^PASS ' /tmp/lwio-e2e.log || { echo "FAIL: no PASS line"; r=1; }
grep -q '^FAIL ' /tmp/lwio-e2e.log && r=1
echo "lwio-e2e $dev $ip: exit $r"
exit $r
