# fio-engine-vm.sh - VM case: fio's external engine (liblwio_fio.so) with the
# verbs provider, as fio runs jobs by default: each job in a process forked
# after fio has sized its files in the parent (busybox sh, in the guest).
# usage: sh ./fio-engine-vm.sh DEV IP
# Writes 8 MiB at random with crc32c verify, then reads them back with
# verify_only, sized by the file itself (no size=: the engine stats the file
# before fio forks), in process mode and with --thread, and checks the
# export's file. Exit 0 only if every fio run verified.
DEV=$1 IP=$2
ulimit -l unlimited 2>/dev/null || ulimit -l 1048576   # siw charges MRs to MEMLOCK
EXP=/tmp/fe-exp; rm -rf $EXP /tmp/fe-ready; mkdir -p $EXP
. ./guest-lib.sh
serve_verbs fe $DEV $IP 7560 $EXP || exit 1
FAILS=0
E="--ioengine=external:/test/liblwio_fio.so --lwio_url=lwio://$IP:7560/data --lwio_token_file=/tmp/fe-token --lwio_no_tls=1 --lwio_provider=verbs"
J="--name=rw4k --filename=rw4k.dat --rw=randwrite --bs=4k --iodepth=16 --verify=crc32c"
fio_case() { # NAME WANT-IO fio-args...
  name=$1 want=$2; shift 2
  if ./fio $E "$@" > /tmp/fe-$name.log 2>&1 && grep -q "io=$want" /tmp/fe-$name.log; then
    echo "PASS $name: $(grep -o '[A-Z]*: bw=[^,]*, [^,]*, io=[^ ,]*' /tmp/fe-$name.log | tr '\n' ' ')"
  else
    echo "FAIL $name:"; tail -n 8 /tmp/fe-$name.log; FAILS=$((FAILS + 1))
  fi
}
fio_case write-verify-process 8192KiB $J --size=8M --do_verify=1
fio_case readback-process-own-size 8192KiB $J --verify_only
fio_case readback-thread-own-size 8192KiB $J --verify_only --thread
fio_case randread-qd32-process 8192KiB --name=rr --filename=rw4k.dat --rw=randread --bs=4k --iodepth=32 --number_ios=2048
s=$(stat -c %s $EXP/rw4k.dat 2>/dev/null)
[ "$s" = 8388608 ] && echo "PASS export file is 8388608 bytes" || { echo "FAIL export file size: $s"; FAILS=$((FAILS + 1)); }
kill $SP; wait $SP
echo "fio-engine $DEV: $FAILS failure(s)"
[ $FAILS = 0 ]
