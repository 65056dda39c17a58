# mount-readers.sh - VM case: `lwio mount` over a verbs device, read and
# written by several processes at once, in interrupt mode (busybox sh, in
# the guest). usage: sh ./mount-readers.sh DEV IP
# Four fio jobs write their own files with crc32c verify, then read one file
# at random by four jobs at once with psync and by one libaio job at QD 32,
# all through a mount with direct_io (every read goes to the server). Each
# run must end with err=0 and the export's files hold what was verified.
# Before the verbs provider translated completions under one lock, two
# threads polling the client's completion queue at once (a busy-polling
# caller beside the driving thread) lost completions: reads that never
# completed (ETIMEDOUT), and a mount that then waited for credits forever.
DEV=$1 IP=$2
export PATH=/test:$PATH   # fusermount3, as the suite copies it
ulimit -l unlimited 2>/dev/null || ulimit -l 1048576   # siw charges MRs to MEMLOCK
EXP=/tmp/mr-exp M=/tmp/mr-mnt
rm -rf $EXP /tmp/mr-ready; mkdir -p $EXP $M
ln -sf /proc/self/mounts /etc/mtab
. ./guest-lib.sh
serve_verbs mr $DEV $IP 7580 $EXP || exit 1
./lwio mount --daemon --log /tmp/mr-mount.log --token-file /tmp/mr-token --no-tls --provider verbs \
  --device $DEV -o direct_io,completion=interrupt lwio://$IP:7580/data $M || { echo "FAIL: mount: $(tail -n 3 /tmp/mr-mount.log)"; exit 1; }
FAILS=0
fio_case() { # NAME fio-args...
  name=$1; shift
  if ./fio --directory=$M "$@" > /tmp/mr-$name.log 2>&1 && grep -q "err= 0" /tmp/mr-$name.log && ! grep -q "err=[1-9]" /tmp/mr-$name.log; then
    echo "PASS $name: $(grep -o '[A-Z]*: bw=[^,]*, [^,]*, io=[^ ,]*' /tmp/mr-$name.log | tr '\n' ' ')"
  else
    echo "FAIL $name:"; grep -i "error\|err=" /tmp/mr-$name.log | head -n 6; FAILS=$((FAILS + 1))
  fi
}
fio_case write-verify-4jobs --name=w --rw=randwrite --bs=4k --size=4M --numjobs=4 --ioengine=psync \
  --verify=crc32c --do_verify=1 --verify_fatal=1 --group_reporting
head -c 16777216 /dev/urandom > $EXP/read.dat
fio_case randread-4jobs --name=r --filename=read.dat --rw=randread --bs=4k --size=16M --numjobs=4 \
  --ioengine=psync --runtime=10 --time_based --group_reporting
fio_case randread-libaio-qd32 --name=q --filename=read.dat --rw=randread --bs=4k --size=16M --iodepth=32 \
  --ioengine=libaio --runtime=5 --time_based
# The mount still serves after the runs (no request left holding a credit).
if cmp $M/read.dat $EXP/read.dat; then echo "PASS read.dat reads back byte for byte"; else echo "FAIL read.dat differs"; FAILS=$((FAILS + 1)); fi
grep -i "timed out" /tmp/mr-mount.log | head -n 3
umount $M; kill $SP; wait $SP
echo "mount-readers $DEV: $FAILS failure(s)"
[ $FAILS = 0 ]
