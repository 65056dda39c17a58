#!/bin/bash
# mount-compare.sh - `lwio mount` side by side with sshfs, `lwio bench` and the local file, in one run.
#
# One 1 GiB file of random bytes in a tmpfs. Each system serves it on loopback:
#   local   fio on the file itself
#   lwio    `lwio serve --provider soft` + `lwio mount -o direct_io` (FUSE, data over soft iWARP)
#   sshfs   Debian sshfs (FUSE over ssh/sftp) to a private sshd, `-o direct_io`
#   bench   `lwio bench` (the client library, no FUSE) on the same file
# direct_io on both FUSE mounts: no client page cache, so every read is a round trip.
# Workloads (fio, psync, one job): rr1 4 KiB random read QD1; seqread and seqwrite 1 MiB.
# Metadata: `tar x` of a tree of 5000 small files into each mount, then `find -ls` of it
# (warm: run twice, the second is reported).
#
# usage:  bench/mount-compare.sh            (root; installs fio, sshfs, openssh-server if missing)
# env:    MC_ROOT (default /tmp/lwio-mount-compare), MC_DUR seconds per fio test (10),
#         LWIO_BIN (default target/release/lwio, built if missing)
# Output: a markdown table of figures and ratios on stdout, and every exact command.
set -u
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/.." && pwd)
ROOT=${MC_ROOT:-/tmp/lwio-mount-compare}
DUR=${MC_DUR:-10}
LWIO=${LWIO_BIN:-$REPO/target/release/lwio}
[ -x "$LWIO" ] || (cd "$REPO" && cargo build --release -q -p lwio) || exit 1
for p in fio sshfs sshd; do
  command -v $p >/dev/null || [ -x /usr/sbin/$p ] ||
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q fio sshfs openssh-server >&2 || exit 1
done

PIDS=()
cleanup() {
  for m in "$ROOT/m-lwio" "$ROOT/m-lwio-nl" "$ROOT/m-sshfs"; do mountpoint -q "$m" && fusermount3 -u "$m"; done
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null; done
  wait 2>/dev/null
  mountpoint -q "$ROOT/data" && umount "$ROOT/data"
}
trap cleanup EXIT
mkdir -p "$ROOT"/{data,m-lwio,m-lwio-nl,m-sshfs,home,ssh,tree}
mountpoint -q "$ROOT/data" || mount -t tmpfs -o size=3G tmpfs "$ROOT/data"
F=$ROOT/data/file.bin
[ -f "$F" ] || head -c 1G /dev/urandom >"$F"

# ---- servers and mounts
export HOME=$ROOT/home LWIO_KNOWN_HOSTS=$ROOT/home/known_hosts
PORT=7640
"$LWIO" serve --export "data=$ROOT/data" --listen 127.0.0.1:$PORT --provider soft >"$ROOT/serve.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 50); do grep -q "RDMA listening" "$ROOT/serve.log" && break; sleep 0.1; done
"$LWIO" mount --daemon lwio://127.0.0.1:$PORT/data "$ROOT/m-lwio" --provider soft -o direct_io >&2 || exit 1
# The same without directory leases (1 s kernel timeouts only), for the
# metadata comparison.
"$LWIO" mount --daemon lwio://127.0.0.1:$PORT/data "$ROOT/m-lwio-nl" --provider soft -o direct_io,noleases >&2 || exit 1

[ -f "$ROOT/ssh/id" ] || ssh-keygen -q -t ed25519 -N '' -f "$ROOT/ssh/id"
[ -f "$ROOT/ssh/host" ] || ssh-keygen -q -t ed25519 -N '' -f "$ROOT/ssh/host"
cp "$ROOT/ssh/id.pub" "$ROOT/ssh/authorized_keys"
mkdir -p /run/sshd
/usr/sbin/sshd -D -p 2299 -o ListenAddress=127.0.0.1 -h "$ROOT/ssh/host" \
  -o AuthorizedKeysFile="$ROOT/ssh/authorized_keys" -o PermitRootLogin=prohibit-password \
  -o StrictModes=no -o PidFile=none &
PIDS+=($!)
sleep 1
sshfs -p 2299 -o IdentityFile="$ROOT/ssh/id",StrictHostKeyChecking=no,UserKnownHostsFile=/dev/null,direct_io \
  root@127.0.0.1:"$ROOT/data" "$ROOT/m-sshfs" || exit 1

# ---- fio
CMDS=()
fio_run() { # name dir rw bs -> "bw_MBps iops p50_us"
  local dir=$1 rw=$2 bs=$3 extra=()
  [ "$rw" = write ] && extra=(--filename=write.bin --size=1G) || extra=(--filename=file.bin)
  local cmd=(fio --name=t --directory="$dir" "${extra[@]}" --rw="$rw" --bs="$bs" --ioengine=psync
    --iodepth=1 --time_based --runtime="$DUR" --output-format=json)
  echo "${cmd[*]}" >>"$ROOT/commands.txt"
  "${cmd[@]}" 2>/dev/null | python3 -c '
import json,sys
j=json.load(sys.stdin)["jobs"][0]
k="write" if j["write"]["io_bytes"] else "read"
d=j[k]
print("%.1f %.0f %.1f" % (d["bw_bytes"]/1e6, d["iops"], d["clat_ns"]["percentile"]["50.000000"]/1e3))'
  rm -f "$dir/write.bin"
}
declare -A R
: >"$ROOT/commands.txt"
for sys in local lwio sshfs; do
  case $sys in local) d=$ROOT/data ;; lwio) d=$ROOT/m-lwio ;; sshfs) d=$ROOT/m-sshfs ;; esac
  R[$sys.rr1]=$(fio_run "$d" randread 4k)
  R[$sys.seqread]=$(fio_run "$d" read 1M)
  R[$sys.seqwrite]=$(fio_run "$d" write 1M)
  echo "$sys done" >&2
done
bench() { # rw bs qd
  local cmd=("$LWIO" bench lwio://127.0.0.1:$PORT/data/file.bin --provider soft --rw "$1" --bs "$2"
    --qd 1 --size 1GiB --runtime "${DUR}s" --completion interrupt --json)
  echo "${cmd[*]}" >>"$ROOT/commands.txt"
  "${cmd[@]}" 2>/dev/null | python3 -c '
import json,sys
j=json.loads(sys.stdin.read().strip().splitlines()[-1])
print("%.1f %.0f %.1f" % (j["bandwidth_bytes_per_s"]/1e6, j["iops"], j["lat_us"]["p50"]))' 2>/dev/null || echo "- - -"
}
R[bench.rr1]=$(bench randread 4k)
R[bench.seqread]=$(bench read 1M)

# ---- metadata: tar x of 5000 small files, then find -ls (second run reported)
if [ ! -f "$ROOT/tree.tar" ]; then
  for i in $(seq 0 49); do mkdir -p "$ROOT/tree/t/d$i"; for j in $(seq 0 99); do echo "$i $j" >"$ROOT/tree/t/d$i/f$j"; done; done
  tar -C "$ROOT/tree" -cf "$ROOT/tree.tar" t
fi
meta() { # dir -> "tar_s find_cold_s find_again_s find_later_s"
  local d=$1 t0 t1 t1b t2 t3 t4
  rm -rf "$d/t"
  t0=$(date +%s.%N); tar -C "$d" -xf "$ROOT/tree.tar"; t1=$(date +%s.%N)
  find "$d/t" -ls >/dev/null; t1b=$(date +%s.%N)
  find "$d/t" -ls >/dev/null; t2=$(date +%s.%N)
  # Warm, later: past the kernel's 1 s attribute and entry timeouts.
  sleep 2
  t3=$(date +%s.%N); find "$d/t" -ls >/dev/null; t4=$(date +%s.%N)
  rm -rf "$d/t"
  python3 -c "print('%.3f %.3f %.3f %.3f' % ($t1-$t0, $t1b-$t1, $t2-$t1b, $t4-$t3))"
}
CMDS+=("tar -C MOUNT -xf tree.tar (50 dirs x 100 files); find MOUNT/t -ls; again at once; again after 2 s")
for sys in local lwio lwionl sshfs; do
  case $sys in local) d=$ROOT/data ;; lwio) d=$ROOT/m-lwio ;; lwionl) d=$ROOT/m-lwio-nl ;; sshfs) d=$ROOT/m-sshfs ;; esac
  R[$sys.meta]=$(meta "$d")
done

# ---- report
f() { echo "${R[$1]:-- - -}" | cut -d' ' -f"$2"; }
ratio() { python3 -c "a,b='$1','$2'
print('%.2f' % (float(a)/float(b)) if a not in ('-','') and b not in ('-','','0','0.0') else '-')"; }
echo "## lwio mount vs sshfs vs lwio bench vs local — $(date -u +%Y-%m-%d)"
echo
echo "Machine: $(nproc) vCPU, $(free -g | awk '/Mem:/{print $2}') GiB, $(uname -r); load before: $(cut -d' ' -f1-3 /proc/loadavg)."
echo "Produced by \`bench/mount-compare.sh\` (lwio $(cd "$REPO" && git rev-parse --short HEAD)), ${DUR} s per fio test, 1 GiB file in tmpfs, loopback."
echo
echo "| test | local | lwio mount | sshfs | lwio bench | lwio : sshfs |"
echo "| --- | --- | --- | --- | --- | --- |"
echo "| 4 KiB random read QD1, IOPS (p50 µs) | $(f local.rr1 2) ($(f local.rr1 3)) | $(f lwio.rr1 2) ($(f lwio.rr1 3)) | $(f sshfs.rr1 2) ($(f sshfs.rr1 3)) | $(f bench.rr1 2) ($(f bench.rr1 3)) | $(ratio "$(f lwio.rr1 2)" "$(f sshfs.rr1 2)") |"
echo "| 1 MiB sequential read, MB/s | $(f local.seqread 1) | $(f lwio.seqread 1) | $(f sshfs.seqread 1) | $(f bench.seqread 1) | $(ratio "$(f lwio.seqread 1)" "$(f sshfs.seqread 1)") |"
echo "| 1 MiB sequential write, MB/s | $(f local.seqwrite 1) | $(f lwio.seqwrite 1) | $(f sshfs.seqwrite 1) | - | $(ratio "$(f lwio.seqwrite 1)" "$(f sshfs.seqwrite 1)") |"
echo "| tar x of 5000 files, s | $(f local.meta 1) | $(f lwio.meta 1) | $(f sshfs.meta 1) | - | $(ratio "$(f sshfs.meta 1)" "$(f lwio.meta 1)") (speed-up) |"
echo "| find -ls, cold / again at once / again after 2 s, s | $(f local.meta 2) / $(f local.meta 3) / $(f local.meta 4) | $(f lwio.meta 2) / $(f lwio.meta 3) / $(f lwio.meta 4) | $(f sshfs.meta 2) / $(f sshfs.meta 3) / $(f sshfs.meta 4) | - | $(ratio "$(f sshfs.meta 4)" "$(f lwio.meta 4)") (later speed-up) |"
echo
echo "Directory leases (the same export mounted twice, with leases and with -o noleases):"
echo
echo "| find -ls of 5000 files, s | with leases | -o noleases | noleases : leases |"
echo "| --- | --- | --- | --- |"
echo "| tar x (5000 creates) | $(f lwio.meta 1) | $(f lwionl.meta 1) | $(ratio "$(f lwionl.meta 1)" "$(f lwio.meta 1)") |"
echo "| cold (first after tar) | $(f lwio.meta 2) | $(f lwionl.meta 2) | $(ratio "$(f lwionl.meta 2)" "$(f lwio.meta 2)") |"
echo "| warm, at once | $(f lwio.meta 3) | $(f lwionl.meta 3) | $(ratio "$(f lwionl.meta 3)" "$(f lwio.meta 3)") |"
echo "| warm, 2 s later (past the 1 s timeouts) | $(f lwio.meta 4) | $(f lwionl.meta 4) | $(ratio "$(f lwionl.meta 4)" "$(f lwio.meta 4)") |"
echo
echo "Commands:"
echo
sed 's/^/    /' "$ROOT/commands.txt"
for c in "${CMDS[@]}"; do echo "    $c"; done
echo "    lwio mount --daemon lwio://127.0.0.1:$PORT/data MOUNT --provider soft -o direct_io"
echo "    lwio mount --daemon lwio://127.0.0.1:$PORT/data MOUNT --provider soft -o direct_io,noleases"
echo "    sshfs -p 2299 -o IdentityFile=…,direct_io root@127.0.0.1:DATA MOUNT"
