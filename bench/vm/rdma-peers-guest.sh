# rdma-peers-guest.sh - the guest half of bench/rdma-peers.sh (busybox sh, in the
# rdma-vm.sh guest with -d rxe,siw: rxe0 = $RXE_IP, siw0 = $SIW_IP).
#
# One data file (on ext4 in memory) is served three ways from this one guest:
#   * NFSv4.2 by the kernel's nfsd, over RDMA (rpcrdma, port 20049) and over TCP;
#   * lwio serve with the verbs provider, one server per device;
# and read and written through the kernel NFS client (proto=rdma / tcp), through
# `lwio mount` (FUSE, data path on the same device) and through liblwio's batch
# interface (fio's external engine liblwio_fio.so), with the same fio jobs.
# For every run it prints `@@RUN row job` and fio's JSON, then `@@CPU` with the
# CPU consumed during the run (jiffies): the whole guest (/proc/stat) and the
# lwio mount daemon (/proc/PID/stat, its utime + stime); the host script parses
# them. Exit status 0 only if every target was set up and every run succeeded.
SECS=${PEERS_SECS:-5}
SIZE=${PEERS_SIZE_MB:-128}
T=/test
FIO=$T/fio
ENG=$T/liblwio_fio.so
L=$T/lwio
DATA=/srv/data
FAILS=0
fail() { echo "FAIL: $*"; FAILS=$((FAILS + 1)); }
# siw charges registrations against RLIMIT_MEMLOCK even for root.
ulimit -l unlimited 2>/dev/null || ulimit -l 1048576

# ---------------------------------------------------------------- the data
mkdir -p $DATA /etc /run/rpcbind /var/lib/nfs/v4recovery /var/lib/nfs/rpc_pipefs
# ext4 on a loop device over a tmpfs file: a file system with O_DIRECT, as a
# real export's (tmpfs has none before Linux 6.6, and lwio passes O_DIRECT to
# the server's file, docs/mount.md), in memory, as the guest has no disk.
mkdir -p /srv/img; mount -t tmpfs -o size=$((SIZE * 2 + 96))m tmpfs /srv/img
dd if=/dev/zero of=/srv/img/ext4 bs=1M count=0 seek=$((SIZE * 2 + 64)) 2>/dev/null
$T/mke2fs -q -F -t ext4 -E lazy_itable_init=0,lazy_journal_init=0 /srv/img/ext4 || fail "mke2fs"
mount -o loop /srv/img/ext4 $DATA || fail "mount ext4 on loop"
head -c $((SIZE * 1048576)) /dev/urandom > $DATA/read.dat
head -c $((SIZE * 1048576)) /dev/urandom > $DATA/write.dat
cp $T/etc-passwd /etc/passwd; cp $T/etc-group /etc/group
cp $T/netconfig /etc/netconfig; cp $T/services /etc/services; cp $T/protocols /etc/protocols
ln -sf /proc/self/mounts /etc/mtab

# ---------------------------------------------------------------- nfsd (v4.2 only)
mount -t nfsd nfsd /proc/fs/nfsd || fail "mount nfsd"
mount -t rpc_pipefs sunrpc /var/lib/nfs/rpc_pipefs
$T/rpcbind -w || fail "rpcbind"
echo "$DATA *(rw,no_root_squash,sync,no_subtree_check,insecure,fsid=1)" > /etc/exports
$T/exportfs -ra || fail "exportfs"
$T/rpc.mountd -N 2 -N 3 || fail "rpc.mountd"
# The shortest grace period the kernel takes: no OPEN is served before it ends.
echo 10 > /proc/fs/nfsd/nfsv4gracetime; echo 10 > /proc/fs/nfsd/nfsv4leasetime
$T/rpc.nfsd -N 3 -V 4.2 --rdma=20049 8 || fail "rpc.nfsd"
echo "nfsd threads $(cat /proc/fs/nfsd/threads), listening: $(cat /proc/fs/nfsd/portlist | sort -u | tr '\n' ' ')"
NFSD_UP=$(cut -d. -f1 /proc/uptime)

# ---------------------------------------------------------------- lwio servers
# One per device, each on the device's own address (side channel and RDMA).
# Token /tmp/rxe-token resp. /tmp/siw-token (guest-lib.sh, serve_verbs).
. $T/guest-lib.sh
serve_verbs rxe $RXE_DEV $RXE_IP 7460 $DATA && grep 'RDMA listening' /tmp/rxe-serve.out || fail "lwio serve on rxe"
serve_verbs siw $SIW_DEV $SIW_IP 7470 $DATA && grep 'RDMA listening' /tmp/siw-serve.out || fail "lwio serve on siw"

# ---------------------------------------------------------------- mounts
# The NFS client sees one server behind 10.0.0.1 and 10.0.0.2 (NFSv4.1+
# trunking detection: the same server owner) and would carry a second mount
# over the first one's transport, so each NFS mount is made alone, for its
# phase, and checked to be on its own address.
mkdir -p /mnt/nfs-rdma-rxe /mnt/nfs-rdma-siw /mnt/nfs-tcp /mnt/lwio-rxe /mnt/lwio-siw
while [ $(($(cut -d. -f1 /proc/uptime) - NFSD_UP)) -lt 11 ]; do sleep 1; done # grace
want=$(md5sum < $DATA/read.dat)
same_bytes() { # DIR
  got=$(md5sum < $1/read.dat)
  [ "$got" = "$want" ] && echo "ok: $1/read.dat reads back the server's bytes" || fail "$1/read.dat differs"
}
nfs_mount() { # DIR SERVER-IP OPTS
  $T/mount.nfs $2:$DATA $1 -o vers=4.2,$3 || { fail "mount.nfs $2 $3"; return 1; }
  m=$(grep " $1 " /proc/mounts); echo "$m"
  case "$m" in *",addr=$2 "*|*",addr=$2,"*) ;; *) fail "$1 is not on $2: $m" ;; esac
  same_bytes $1
}
lwio_mount() { # DIR DEV URL
  $L mount --daemon --log /tmp/$(basename $1).log --token-file /tmp/${1##*-}-token --no-tls \
    --provider verbs --device $2 $3 $1 || { fail "lwio mount $3 on $2: $(tail -n 3 /tmp/$(basename $1).log)"; return 1; }
  grep " $1 " /proc/mounts
  [ -e /tmp/checked-${1##*/} ] || { same_bytes $1; touch /tmp/checked-${1##*/}; }
}

# ---------------------------------------------------------------- runs
# PID of the lwio mount daemon of a mount point (busybox has no pgrep).
mount_pid() {
  for d in /proc/[0-9]*; do
    case "$(tr '\0' ' ' < $d/cmdline 2>/dev/null)" in *" mount "*" $1"*) echo ${d#/proc/}; return ;; esac
  done
}
cpu_all() { awk '/^cpu /{print $2 + $3 + $4 + $7 + $8}' /proc/stat; }
cpu_pid() { [ -n "$1" ] && awk '{print $14 + $15}' /proc/$1/stat 2>/dev/null || echo 0; }
JOBS=${PEERS_JOBS:-randread-qd1 randread-qd32 read-1m write-1m}
job_args() { # JOB ENGINE: fio arguments
  case $1 in
  randread-qd1) echo "--rw=randread --bs=4k --iodepth=1 --filename=read.dat" ;;
  randread-qd32) echo "--rw=randread --bs=4k --iodepth=32 --filename=read.dat" ;;
  read-1m) echo "--rw=read --bs=1m --iodepth=8 --filename=read.dat" ;;
  write-1m) echo "--rw=write --bs=1m --iodepth=8 --filename=write.dat" ;;
  esac
}
run() { # ROW JOB PID DIR-OR-URL fio-engine-args...
  row=$1 job=$2 pid=$3 where=$4; shift 4
  a0=$(cpu_all); p0=$(cpu_pid $pid)
  # --directory before --filename: fio joins them at --filename.
  $FIO --name=$job "$@" $where $(job_args $job) --size=${SIZE}M --runtime=$SECS --time_based \
    --norandommap --randrepeat=0 --output-format=json --output=/tmp/fio.json > /tmp/fio.err 2>&1 ||
    { fail "$row $job: $(tail -n 6 /tmp/fio.err) $(grep -v "^ \|^{\|^}" /tmp/fio.json | head -n 6)"
      why=$(sed -n 's/.*io_u error on file [^:]*: \([^:]*\):.*/\1/p' /tmp/fio.err | head -n 1)
      echo "@@FAIL $row $job ${why:-fio failed}"; return 1; }
  a1=$(cpu_all); p1=$(cpu_pid $pid)
  echo "@@RUN $row $job"; cat /tmp/fio.json; echo "@@END"
  echo "@@CPU $row $job all=$((a1 - a0)) mountd=$((p1 - p0)) hz=100"
}
phase() { # DEV-SUFFIX NFS-IP NFS-OPTS ROWS...
  dev=$1 ip=$2 opts=$3; shift 3
  nfs_mount /mnt/nfs-$dev $ip $opts || return
  for job in $JOBS; do
    case $job in randread-qd1) eng="--ioengine=psync --direct=1" ;; *) eng="--ioengine=libaio --direct=1" ;; esac
    for row in "$@"; do
      case $row in
      nfs-*) run $row $job "" --directory=/mnt/$row $eng ;;
      lwio-mount-*)
        # A mount of its own for each job: a failure stays in its row.
        d=/mnt/lwio-${row##*-}
        if [ $row = lwio-mount-rxe ]; then lwio_mount $d $RXE_DEV lwio://$RXE_IP:7460/data
        else lwio_mount $d $SIW_DEV lwio://$SIW_IP:7470/data; fi &&
          run $row $job "$(mount_pid $d)" --directory=$d $eng
        umount $d 2>/dev/null || umount -l $d ;;
      liblwio-rxe) run $row $job "" --lwio_url=lwio://$RXE_IP:7460/data --ioengine=external:$ENG \
        --lwio_token_file=/tmp/rxe-token --lwio_no_tls=1 --lwio_provider=verbs ;;
      liblwio-siw) run $row $job "" --lwio_url=lwio://$SIW_IP:7470/data --ioengine=external:$ENG \
        --lwio_token_file=/tmp/siw-token --lwio_no_tls=1 --lwio_provider=verbs ;;
      esac
    done
  done
  umount /mnt/nfs-$dev || fail "umount /mnt/nfs-$dev"
}
phase rdma-rxe $RXE_IP proto=rdma,port=20049 nfs-rdma-rxe lwio-mount-rxe liblwio-rxe
phase rdma-siw $SIW_IP proto=rdma,port=20049 nfs-rdma-siw lwio-mount-siw liblwio-siw
phase tcp $RXE_IP proto=tcp nfs-tcp
echo "peers: $FAILS failure(s)"
[ $FAILS = 0 ]
