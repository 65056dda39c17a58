#!/usr/bin/env bash
# rdma-vm.sh - run a host-built program inside a throw-away qemu guest that boots a
# stock Debian kernel with a soft RDMA device (Soft-RoCE rxe / soft-iWARP siw).
# Adopted from /work/shared/tools/rdma-vm.sh for lwio; see docs/vm-tests.md.
#
# usage: rdma-vm.sh [options] [--] PROGRAM [ARGS...]
#   -d DRV    rxe | siw | rxe,siw   (default rxe). Debian kernels don't ship siw.ko;
#             it is built out-of-tree from linux-source + linux-headers on first use,
#             patched so that its tunables are module parameters (see -k).
#   -n        netns mode (interop): veth0 (10.0.0.1) lives in guest netns "peer", the
#             driver(s) sit on veth1 (10.0.0.2) in the root netns, so TCP between a
#             plain-socket program in "peer" and kernel siw0 really crosses the veth pair.
#             Run a command there with `inpeer CMD...` (= ip netns exec peer CMD).
#   -k MOD.PARAM=VAL   module parameter at insmod time, e.g. -k siw.mpa_crc_required=1.
#             siw's (also writable at run time in /sys/module/siw/parameters/):
#             mpa_crc_required mpa_crc_strict peer_to_peer try_gso siw_tcp_nagle (bool),
#             mpa_version (1|2). Repeatable.
#   -t SECS   wall-clock limit for the whole VM run (default 300; exit 124 on expiry)
#   -m MB     guest memory (default 1024)      -c N  guest vCPUs (default nproc, max 4)
#   -a ACCEL  kvm | tcg | auto (default auto: kvm only if /dev/kvm is real VMX/SVM KVM)
#   -f SRC[:DST]  extra host file or directory for the guest (default DST=/test/<basename>);
#             ELF files get their shared libraries (ldd closure) too. Repeatable.
#   -e K=V    environment variable for PROGRAM. Repeatable.
#   -M MOD    extra kernel module of the guest kernel (with its dependencies), loaded
#             after the base ones (e.g. -M nfsd -M rpcrdma -M fuse). Repeatable.
#   -v        stream the guest kernel console (ttyS0) to stderr
#   -P        only prepare (host packages, kernel, siw.ko, base initramfs); don't boot
# PROGRAM may be an ELF binary (its ldd closure is copied) or a busybox-sh script.
# Guest: cwd=/test, root, busybox userland, no /etc/ld.so.cache.
#   default:   veth0=10.0.0.1/24 + veth1 (peer ends, root netns).
#              rxe0 on veth0 (GID idx 1 = ::ffff:10.0.0.1, RoCEv2); siw0 on veth0 when
#              alone, on veth1=10.0.0.2/24 when rxe is there too.
#   netns (-n): veth0=10.0.0.1 in netns "peer"; rxe0/siw0 on veth1=10.0.0.2 (root netns).
#   Exported: RDMA_DEV RDMA_IP RDMA_GID_IDX (first driver of -d), RXE_DEV/RXE_IP,
#   RXE_GID_IDX, SIW_DEV/SIW_IP, RDMA_VM_NETNS (0|1), PEER_NS/PEER_IP (netns mode).
#   Always present (dlopen()ed at run time, not visible to ldd): libibverbs.so.1,
#   librdmacm.so.1 (+ unversioned .so symlinks), libibverbs/lib{rxe,siw}-rdmav*.so with
#   /etc/libibverbs.d/{rxe,siw}.driver, libgcc_s.so.1.
#   PATH tools: ibv_devices ibv_devinfo ibv_{rc,ud,srq}_pingpong ib_{write,read,send}_{bw,lat}
#   rping ucmatose udaddy rdma_server rdma_client /usr/bin/rdma /usr/bin/ip inpeer + busybox.
#   NB: busybox sh prefers its own applets: call iproute2 as /usr/bin/ip.
# PROGRAM's stdout+stderr come back on stdout; the exit status is PROGRAM's
# (124 = timeout, 125 = setup failed / VM died without reporting a status).
# Env: RDMA_VM_CACHE  cache dir (kernel, siw.ko, base initramfs; flock'ed while building),
#                     default $HOME/.cache/lwio-rdma-vm
#      RDMA_VM_KPKG   kernel package (default: what linux-image-amd64 depends on)
#      CI=true        nothing interactive is ever asked; apt runs non-interactively anyway.
set -euo pipefail

TIMEOUT=300 MEM=1024 ACCEL=auto VERBOSE=0 DRIVERS=rxe NETNS=0 PREPARE_ONLY=0
CPUS=$(nproc); [ "$CPUS" -gt 4 ] && CPUS=4
EXTRA=() ENVS=() KPARAMS=() XMODS=()
while getopts "d:t:m:c:a:f:e:k:M:nvPh" o; do
  case $o in
    d) DRIVERS=$OPTARG ;; t) TIMEOUT=$OPTARG ;; m) MEM=$OPTARG ;; c) CPUS=$OPTARG ;;
    a) ACCEL=$OPTARG ;; f) EXTRA+=("$OPTARG") ;; e) ENVS+=("$OPTARG") ;; v) VERBOSE=1 ;;
    k) KPARAMS+=("$OPTARG") ;; M) XMODS+=("$OPTARG") ;; n) NETNS=1 ;; P) PREPARE_ONLY=1 ;;
    h) sed -n '2,/^set -e/p' "$0" | sed '$d'; exit 0 ;;
    *) exit 2 ;;
  esac
done
shift $((OPTIND - 1))
[ $# -ge 1 ] || [ $PREPARE_ONLY = 1 ] || { echo "usage: $0 [options] PROGRAM [ARGS...]  (-h for help)" >&2; exit 2; }
case $DRIVERS in rxe|siw|rxe,siw|siw,rxe) ;; *) echo "bad -d $DRIVERS" >&2; exit 2 ;; esac
[ $NETNS = 1 ] && [[ $DRIVERS == *,* ]] && { echo "-n takes a single driver (-d rxe or -d siw)" >&2; exit 2; }
for p in ${KPARAMS[@]+"${KPARAMS[@]}"}; do
  [[ $p =~ ^[a-z0-9_]+\.[a-z0-9_]+=[^[:space:]\']*$ ]] || { echo "bad -k $p (want MOD.PARAM=VAL)" >&2; exit 2; }
done
BIN=
if [ $# -ge 1 ]; then
  BIN=$1; shift
  if [ ! -e "$BIN" ]; then BIN=$(command -v "$BIN") || { echo "no such program: $BIN" >&2; exit 2; }; fi
  BIN=$(readlink -f "$BIN")
fi

CACHE=${RDMA_VM_CACHE:-$HOME/.cache/lwio-rdma-vm}
KPKG_WANT=${RDMA_VM_KPKG:-${RXE_KPKG:-}}
ML=/usr/lib/x86_64-linux-gnu
export DEBIAN_FRONTEND=noninteractive
log() { echo "[rdma-vm] $*" >&2; }
die() { log "$*"; exit 125; }
SUDO=; [ "$(id -u)" = 0 ] || { command -v sudo >/dev/null && SUDO="sudo -n"; }
APT_UPDATED=0
apt_update() { [ $APT_UPDATED = 1 ] && return 0; log "apt-get update"; $SUDO apt-get update -qq >&2 || die "apt-get update failed"; APT_UPDATED=1; }
have_candidate() { apt-cache policy "$1" 2>/dev/null | grep "Candidate: [0-9]" >/dev/null; }   # no grep -q: SIGPIPE+pipefail
apt_install() { # pkgs... ; never removes host packages (a shared dev box may hold conflicting ones)
  # unless RDMA_VM_APT_ALLOW_REMOVE=1 (set by .ci/run): the machine image ships a
  # backported qemu-utils that conflicts with Debian's qemu-system-x86, and the
  # VM tests need the latter (nothing in lwio uses qemu-img/qemu-nbd).
  local p; for p in "$@"; do have_candidate "$p" || apt_update; done
  log "installing host packages: $*"
  local rm=--no-remove; [ "${RDMA_VM_APT_ALLOW_REMOVE:-0}" = 1 ] && rm=
  local cmd=($SUDO apt-get install -y -q --no-install-recommends $rm -o DPkg::Lock::Timeout=600 "$@")
  "${cmd[@]}" >&2 || { apt_update; "${cmd[@]}" >&2; } \
    || die "apt-get install $* failed (if apt wanted to remove a conflicting package, install it by hand)"
}
dl() { # pkg[=ver] destdir : apt-get download + unpack (no installation on the host)
  local t; t=$(mktemp -d "$CACHE/dl.XXXXXX")
  if ! (cd "$t" && apt-get download "$1" >"$t.log" 2>&1); then
    log "apt-get download $1 failed ($(tail -1 "$t.log")); retrying after apt-get update"; apt_update
    (cd "$t" && apt-get download "$1" >/dev/null 2>&1) || { rm -rf "$t"; die "download of $1 failed"; }
  fi
  (cd "$t" && dpkg -x ./*.deb "$2" && dpkg-deb -f ./*.deb Version > "$2/.version") || { rm -rf "$t"; die "unpacking $1 failed"; }
  rm -rf "$t" "$t.log"
}

dl_kv() { # pkg version destdir: that version, or -- when the archive no longer has it
  # (a Debian upload can supersede a kernel's linux-kbuild before the image it belongs to:
  # linux-kbuild-6.1 6.1.192-3 beside linux-image-6.1.0-56-amd64 6.1.192-2, 2026-11-29) --
  # the candidate of the same upstream version, as apt itself would install beside it
  local cand
  if apt-cache madison "$1" 2>/dev/null | awk -v v="$2" '$3 == v {f = 1} END {exit !f}'; then
    dl "$1=$2" "$3"; return
  fi
  cand=$(apt-cache policy "$1" 2>/dev/null | awk '/Candidate:/{print $2}')
  if [ -z "$cand" ] || [ "$cand" = "(none)" ] || [ "${cand%-*}" != "${2%-*}" ]; then
    apt_update
    cand=$(apt-cache policy "$1" 2>/dev/null | awk '/Candidate:/{print $2}')
  fi
  [ -n "$cand" ] && [ "$cand" != "(none)" ] && [ "${cand%-*}" = "${2%-*}" ] \
    || die "$1: neither $2 nor another upload of ${2%-*} is in the archive (candidate: ${cand:-none})"
  log "$1=$2 is no longer in the archive: using $cand (same upstream ${2%-*})"
  dl "$1=$cand" "$3"
}

# Everything up to the assembled per-run initrd happens under an exclusive lock on the
# cache, so a concurrent second invocation waits instead of racing on apt / the builds.
mkdir -p "$CACHE"
exec 9>"$CACHE/.lock"
if ! flock -n 9; then log "waiting for the cache lock $CACHE/.lock (another rdma-vm.sh is preparing)"; flock 9; fi

# ---------------------------------------------------------------- host deps
need=()
chk() { command -v "$1" >/dev/null 2>&1 || need+=("$2"); }
chk qemu-system-x86_64 qemu-system-x86; chk cpio cpio; chk ibv_rc_pingpong ibverbs-utils
chk rdma iproute2; chk ib_write_bw perftest; chk rping rdmacm-utils; chk xz xz-utils; chk depmod kmod
chk modinfo kmod; chk apt-get apt; chk dpkg-deb dpkg; chk gzip gzip; chk md5sum coreutils
{ [ -x /bin/busybox ] && ! ldd /bin/busybox >/dev/null 2>&1; } || need+=(busybox-static)   # must be static
ls $ML/libibverbs/librxe-rdmav*.so $ML/libibverbs/libsiw-rdmav*.so >/dev/null 2>&1 || need+=(ibverbs-providers)
case $DRIVERS in *siw*) chk make make; chk bc bc; chk gcc gcc ;; esac
[ ${#need[@]} -eq 0 ] || apt_install $(printf '%s\n' "${need[@]}" | sort -u)

# ---------------------------------------------------------------- kernel
if [ -n "$KPKG_WANT" ]; then KPKG=$KPKG_WANT
else
  have_candidate linux-image-amd64 || apt_update
  KPKG=$(apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-[0-9]/{print $2; exit}')
  [ -n "$KPKG" ] || die "cannot determine the kernel package behind linux-image-amd64"
fi
KDIR=$CACHE/$KPKG
if [ ! -d "$KDIR/boot" ]; then log "fetching $KPKG"; rm -rf "$KDIR"; dl "$KPKG" "$KDIR"; fi
KVER=$(ls "$KDIR/lib/modules" | head -1)
VMLINUZ=$KDIR/boot/vmlinuz-$KVER
[ -f "$KDIR/lib/modules/$KVER/modules.dep" ] || depmod -b "$KDIR" "$KVER"

# ---------------------------------------------------------------- siw.ko (out of tree)
# Upstream siw (6.1) hard-codes its MPA tunables as `const bool`; we turn them into
# module parameters (defaults unchanged) so interop tests can switch CRC etc.
SIW_TUNABLES="try_gso mpa_crc_required mpa_crc_strict siw_tcp_nagle peer_to_peer"
siw_patch() { # srcdir
  local s=$1 v
  for v in $SIW_TUNABLES; do
    grep -q "^const bool $v;$" "$s/siw_main.c" || { log "warning: siw source differs, not patching $v"; return 1; }
    sed -i "s/^const bool $v;\$/bool $v;\nmodule_param($v, bool, 0644);\nMODULE_PARM_DESC($v, \"lwio rdma-vm: was a const\");/" "$s/siw_main.c"
    sed -i "s/^extern const bool $v;\$/extern bool $v;/" "$s/siw.h"
  done
  grep -q '^u_char mpa_version = MPA_REVISION_2;$' "$s/siw_main.c" &&
    sed -i 's/^u_char mpa_version = MPA_REVISION_2;$/&\nmodule_param(mpa_version, byte, 0644);\nMODULE_PARM_DESC(mpa_version, "MPA revision 1 or 2");/' "$s/siw_main.c"
}
SIWKO=
if [[ $DRIVERS == *siw* ]]; then
  SIWKO=$(find "$KDIR/lib/modules/$KVER" -name 'siw.ko*' | head -1)
  if [ -z "$SIWKO" ]; then
    SIWKO=$CACHE/siw-$KVER-params/siw.ko
    if [ ! -f "$SIWKO" ]; then
      KV=$(cat "$KDIR/.version"); MM=$(echo "$KV" | cut -d. -f1,2)
      log "kernel has no siw.ko (CONFIG_RDMA_SIW unset): building it from linux-source-$MM=$KV (~1 min)"
      B=$CACHE/siw-build-$KVER; rm -rf "$B"; mkdir -p "$B/root" "$B/src"
      for p in $(apt-cache depends "linux-headers-$KVER" | awk '/Depends: linux-(headers|kbuild)/{print $2}') "linux-headers-$KVER"; do
        dl_kv "$p" "$KV" "$B/root"; done
      H=$B/root/usr/src/linux-headers-$KVER
      # the compiler the kernel was built with (gcc-12 on bookworm), installed if missing
      CC=$(sed -n 's/^CONFIG_CC_VERSION_TEXT="\(gcc-[0-9]*\) .*/\1/p' "$H/.config" 2>/dev/null || true)
      [ -z "$CC" ] || command -v "$CC" >/dev/null || apt_install "$CC"
      dl_kv "linux-source-$MM" "$KV" "$B/srcdeb"
      tar -xJf "$B"/srcdeb/usr/src/linux-source-*.tar.xz -C "$B/src" --wildcards '*/drivers/infiniband/sw/siw'
      rm -rf "$B/srcdeb"
      sed -i "s|include /usr/src/|include $B/root/usr/src/|" "$H/Makefile"   # absolute path in Debian's stub
      S=$(echo "$B"/src/*/drivers/infiniband/sw/siw)
      siw_patch "$S" || true
      make -C "$H" M="$S" CONFIG_RDMA_SIW=m CONFIG_DEBUG_INFO_BTF_MODULES= ${CC:+CC=$CC} modules >"$B/build.log" 2>&1 \
        || { tail -30 "$B/build.log" >&2; die "siw.ko build failed"; }
      mkdir -p "$(dirname "$SIWKO")"; cp "$S/siw.ko" "$SIWKO.tmp"; mv "$SIWKO.tmp" "$SIWKO"
      cp -r "$S" "$(dirname "$SIWKO")/src"   # patched source kept for reference (small)
      rm -rf "$B"
    fi
  fi
fi

# ---------------------------------------------------------------- helpers
put() { # root file [dest]: copy (dereferenced) to canonical dir, keeping the referenced name
  local root=$1 f=$2 d=${3:-}
  [ -n "$d" ] || d="$(readlink -f "$(dirname "$f")")/$(basename "$f")"
  [ -e "$root$d" ] && return 0
  mkdir -p "$root$(dirname "$d")"; cp -L "$f" "$root$d"
}
is_elf() { [ "$(head -c4 "$1" 2>/dev/null | tail -c3)" = ELF ]; }
libs_of() { ldd "$1" 2>/dev/null | awk '$2 == "=>" && $3 ~ /^\//{print $3} $1 ~ /^\//{print $1}'; }
put_with_libs() { put "$@"; if is_elf "$2"; then local l; for l in $(libs_of "$2"); do put "$1" "$l"; done; fi; }
unz() { case $1 in *.xz) xz -dc "$1" ;; *.zst) zstd -dc "$1" ;; *.gz) gzip -dc "$1" ;; *) cat "$1" ;; esac; }

# ---------------------------------------------------------------- base initramfs (cached)
MODS="crc32_generic crc32c_generic rdma_rxe ib_uverbs rdma_ucm ib_umad veth"
[ -n "$SIWKO" ] && MODS="$MODS $(modinfo -F depends "$SIWKO" | tr , ' ')"
TOOLS="ibv_devices ibv_devinfo ibv_rc_pingpong ibv_ud_pingpong ibv_srq_pingpong ib_write_bw ib_read_bw
 ib_send_bw ib_write_lat ib_read_lat ib_send_lat rping ucmatose udaddy rdma_server rdma_client rdma ip"
# dlopen()ed at run time, invisible to ldd of the tools that don't link them; the lwio
# verbs provider dlopen()s libibverbs.so.1 / librdmacm.so.1 itself.
DLOPEN_LIBS="$ML/libgcc_s.so.1 $ML/libibverbs.so.1 $ML/librdmacm.so.1"
for l in $DLOPEN_LIBS; do [ -e "$l" ] || die "host lacks $l"; done
# the base image depends on this script's guest part, busybox, siw.ko and the tools
SUM=$( { echo "$MODS|$TOOLS|$DLOPEN_LIBS"; sed -n '/^# >>> base-image-start/,/^# <<< base-image-end/p' "$0"; cat /bin/busybox ${SIWKO:+"$SIWKO"} $DLOPEN_LIBS \
         $(for t in $TOOLS; do command -v $t; done) $ML/libibverbs/lib{rxe,siw}-rdmav*.so; } | md5sum | cut -c1-8)
VARIANT=$([ -n "$SIWKO" ] && echo siw || echo nosiw)   # -d rxe runs do not need (nor build) siw.ko
BASE=$CACHE/base-$KVER-$VARIANT-$SUM.cpio.gz
# >>> base-image-start
# add_modules ROOT MOD...: the modules and their dependencies, decompressed
# (busybox insmod: plain .ko), into ROOT/modules, appended to
# ROOT/modules/order in load order (those listed there already are kept).
add_modules() {
  local root=$1 m deps kw path n; shift
  for m in "$@"; do
    deps=$(modprobe -d "$KDIR" -S "$KVER" --show-depends "$m" 2>&1) || die "module $m: $deps"
    while read -r kw path _; do
      [ "$kw" = insmod ] || continue
      n=$(basename "$path"); n=${n%.xz}; n=${n%.zst}; n=${n%.gz}
      grep -qx "$n" "$root/modules/order" || { unz "$path" > "$root/modules/$n"; echo "$n" >> "$root/modules/order"; }
    done <<<"$deps"
  done
}
build_base() {
  log "building base initramfs $BASE"
  local R; R=$(mktemp -d "$CACHE/root.XXXXXX")
  mkdir -p "$R"/{usr/bin,usr/sbin,usr/lib/x86_64-linux-gnu,usr/lib64,proc,sys,dev,tmp,run/netns,root,etc/libibverbs.d,modules,test,var}
  for l in bin sbin lib lib64; do ln -s usr/$l "$R/$l"; done
  ln -s ../run "$R/var/run"
  cp /bin/busybox "$R/usr/bin/busybox"
  for a in $(/bin/busybox --list); do [ -e "$R/usr/bin/$a" ] || ln -s busybox "$R/usr/bin/$a"; done
  for t in $TOOLS; do p=$(command -v "$t") || { log "warning: $t not found"; continue; }
    rm -f "$R/usr/bin/$t"; put_with_libs "$R" "$p" "/usr/bin/$t"; done
  for l in $DLOPEN_LIBS; do put_with_libs "$R" "$l"; done
  ln -sf libibverbs.so.1 "$R$ML/libibverbs.so"; ln -sf librdmacm.so.1 "$R$ML/librdmacm.so"
  # libibverbs provider plugins + .driver files (soft ones only; others just spam warnings)
  for p in rxe siw; do
    for so in $ML/libibverbs/lib$p-rdmav*.so; do put_with_libs "$R" "$so"; done
    cp /etc/libibverbs.d/$p.driver "$R/etc/libibverbs.d/"
  done
  for f in $ML/libibverbs.so.1 $ML/librdmacm.so.1 $ML/libgcc_s.so.1 /etc/libibverbs.d/rxe.driver /etc/libibverbs.d/siw.driver; do
    [ -e "$R$f" ] || die "base image lacks $f"; done
  ls "$R$ML"/libibverbs/librxe-rdmav*.so "$R$ML"/libibverbs/libsiw-rdmav*.so >/dev/null || die "base image lacks provider plugins"
  # kernel modules, dependency-closed, in load order, decompressed (busybox insmod: plain .ko)
  : > "$R/modules/order"
  add_modules "$R" $MODS
  [ -n "$SIWKO" ] && { unz "$SIWKO" > "$R/modules/siw.ko"; echo siw.ko >> "$R/modules/order"; }
  echo "root:x:0:0:root:/root:/bin/sh" > "$R/etc/passwd"; echo "root:x:0:" > "$R/etc/group"
  printf '127.0.0.1 localhost\n10.0.0.1 rdma-guest\n' > "$R/etc/hosts"
  printf '#!/bin/sh\nexec /usr/bin/ip netns exec "${PEER_NS:-peer}" "$@"\n' > "$R/usr/bin/inpeer"; chmod +x "$R/usr/bin/inpeer"
  cat > "$R/init" <<'EOF'
#!/bin/sh
export PATH=/usr/bin:/usr/sbin:/bin:/sbin HOME=/root
mount -t proc proc /proc; mount -t sysfs sysfs /sys; mount -t devtmpfs devtmpfs /dev
exec </dev/console >/dev/console 2>&1   # initramfs has no /dev/console node at exec time
mkdir -p /dev/pts /dev/shm; mount -t devpts devpts /dev/pts; mount -t tmpfs tmpfs /dev/shm
mount -t tmpfs tmpfs /run; mkdir -p /run/netns
O=/dev/ttyS1; stty -F $O raw -echo
fail() { { echo "[guest] setup failed: $*"; dmesg | tail -15; echo "@@RXE-EXIT-STATUS=125@@"; } > $O; poweroff -f; }
run() { out=$("$@" 2>&1) || fail "$* -> $out"; }
. /test/drivers
for m in $(cat /modules/order); do
  n=${m%.ko}; args=$(sed -n "s/^${n}\.//p" /test/kparams 2>/dev/null | tr '\n' ' ')
  insmod /modules/$m $args || { [ -n "$args" ] && fail "insmod $m $args"; echo "[guest] warning: insmod $m failed"; }
done
run /usr/bin/ip link set lo up
run /usr/bin/ip link add veth0 type veth peer name veth1
if [ "$NETNS" = 1 ]; then
  run /usr/bin/ip netns add peer
  run /usr/bin/ip link set veth0 netns peer
  run /usr/bin/ip -n peer addr add 10.0.0.1/24 dev veth0
  run /usr/bin/ip -n peer link set lo up; run /usr/bin/ip -n peer link set veth0 up
  run /usr/bin/ip addr add 10.0.0.2/24 dev veth1; run /usr/bin/ip link set veth1 up
  export PEER_NS=peer PEER_IP=10.0.0.1
else
  run /usr/bin/ip addr add 10.0.0.1/24 dev veth0
  run /usr/bin/ip link set veth0 up; run /usr/bin/ip link set veth1 up
fi
export RDMA_VM_NETNS=$NETNS
waitfor() { i=0; until eval "$1"; do i=$((i+1)); [ $i -gt 200 ] && fail "$2"; usleep 50000; done; }
RDMA_DEV=
for d in $(echo $DRIVERS | tr , ' '); do
  case $d in
  rxe) nd=veth0 ip=10.0.0.1; [ "$NETNS" = 1 ] && nd=veth1 ip=10.0.0.2
       hx=$(printf '%02x%02x:%02x%02x' $(echo $ip | tr . ' '))
       run /usr/bin/rdma link add rxe0 type rxe netdev $nd
       waitfor "grep -q ffff:$hx /sys/class/infiniband/rxe0/ports/1/gids/* 2>/dev/null" "rxe0 has no IPv4 GID"
       gi=$(grep -l ffff:$hx /sys/class/infiniband/rxe0/ports/1/gids/* | head -1); gi=${gi##*/}
       export RXE_DEV=rxe0 RXE_IP=$ip RXE_GID_IDX=$gi ;;
  siw) nd=veth0 ip=10.0.0.1
       if [ "$NETNS" = 1 ]; then nd=veth1 ip=10.0.0.2
       elif [ -n "${RXE_DEV:-}" ] || [ "$DRIVERS" = siw,rxe ]; then nd=veth1 ip=10.0.0.2; run /usr/bin/ip addr add $ip/24 dev veth1; fi
       run /usr/bin/rdma link add siw0 type siw netdev $nd
       export SIW_DEV=siw0 SIW_IP=$ip; gi=0 ;;
  esac
  waitfor "grep -q ACTIVE /sys/class/infiniband/${d}0/ports/1/state 2>/dev/null" "${d}0 not ACTIVE"
  [ -n "$RDMA_DEV" ] || { RDMA_DEV=${d}0; RDMA_GID_IDX=$gi; [ $d = rxe ] && RDMA_IP=$RXE_IP || RDMA_IP=$SIW_IP; }
done
export RDMA_DEV RDMA_IP RDMA_GID_IDX
. /test/env
cd /test
echo "@@RXE-READY@@ $(cut -d' ' -f1 /proc/uptime)"
sh /test/cmd < /dev/null > $O 2>&1
echo "@@RXE-EXIT-STATUS=$?@@" > $O
sync; poweroff -f
EOF
  chmod +x "$R/init"
  (cd "$R" && find . | cpio -o -H newc --quiet | gzip -1) > "$BASE.tmp" && mv "$BASE.tmp" "$BASE"
  rm -rf "$R"
  # drop stale base images of this kernel+variant (we hold the exclusive lock: nobody reads them)
  find "$CACHE" -maxdepth 1 -name "base-$KVER-$VARIANT-*.cpio.gz" ! -name "$(basename "$BASE")" -delete
  find "$CACHE" -maxdepth 1 -regex ".*/base-$KVER-[0-9a-f]*\.cpio\.gz" -delete   # pre-variant names
}
# <<< base-image-end
[ -f "$BASE" ] || build_base
for p in ${KPARAMS[@]+"${KPARAMS[@]}"}; do   # busybox insmod silently ignores unknown parameters
  m=${p%%.*} n=${p#*.}; n=${n%%=*}
  if [ "$m" = siw ] && [ -n "$SIWKO" ]; then parms=$(modinfo -F parm "$SIWKO")
  else parms=$(modinfo -b "$KDIR" -k "$KVER" -F parm "$m" 2>/dev/null) || { log "-k $p: no module $m"; exit 2; }; fi
  printf '%s\n' "$parms" | cut -d: -f1 | grep -x "$n" >/dev/null || { log "-k $p: module $m has no parameter $n (has: $(printf '%s\n' "$parms" | cut -d: -f1 | tr '\n' ' '))"; exit 2; }
done
if [ $PREPARE_ONLY = 1 ]; then log "prepared: kernel $KVER, ${SIWKO:+siw.ko $SIWKO, }base $BASE"; exit 0; fi

# ---------------------------------------------------------------- per-run overlay
W=$(mktemp -d "${TMPDIR:-/tmp}/rdma-vm-run.XXXXXX")
trap 'rm -rf "$W"' EXIT
T=$W/root; mkdir -p "$T/test"
gzip -dc "$BASE" | cpio -t --quiet | sed 's#^\.##; s#^#/#; s#^//#/#' > "$W/base.list"
add_file() { # src dest ; shared libs not already in the base image go along
  put "$T" "$1" "$2"; chmod u+x "$T$2" 2>/dev/null || true
  if is_elf "$1"; then local l d; for l in $(libs_of "$1"); do
    d="$(readlink -f "$(dirname "$l")")/$(basename "$l")"; grep -qxF "$d" "$W/base.list" || put "$T" "$l"; done; fi
}
add_any() { # src dest ; directories recursively
  if [ -d "$1" ]; then local f; while IFS= read -r -d '' f; do add_file "$f" "$2/${f#"$1"/}"; done < <(find "$1" -type f -print0)
  else [ -e "$1" ] || die "no such file: $1"; add_file "$1" "$2"; fi
}
add_file "$BIN" "/test/$(basename "$BIN")"
if [ ${#XMODS[@]} -gt 0 ]; then   # -M: the base order plus the new modules, in load order
  mkdir -p "$T/modules"; gzip -dc "$BASE" | cpio -i --quiet --to-stdout modules/order > "$T/modules/order"
  [ -s "$T/modules/order" ] || die "base image $BASE has no modules/order"
  add_modules "$T" "${XMODS[@]}"
fi
for x in ${EXTRA[@]+"${EXTRA[@]}"}; do
  src=${x%%:*} dst=${x#*:}; [ "$dst" = "$x" ] && dst=/test/$(basename "$src"); add_any "$(readlink -f "$src")" "$dst"; done
q() { printf "'%s'" "$(printf '%s' "$1" | sed "s/'/'\\\\''/g")"; }
{ printf 'exec /test/%s' "$(q "$(basename "$BIN")")"; for a in "$@"; do printf ' %s' "$(q "$a")"; done; echo; } > "$T/test/cmd"
printf 'DRIVERS=%s\nNETNS=%s\n' "$DRIVERS" "$NETNS" > "$T/test/drivers"
printf '%s\n' ${KPARAMS[@]+"${KPARAMS[@]}"} > "$T/test/kparams"
: > "$T/test/env"; for e in ${ENVS[@]+"${ENVS[@]}"}; do printf 'export %s=%s\n' "${e%%=*}" "$(q "${e#*=}")" >> "$T/test/env"; done
(cd "$T" && find . -mindepth 1 | cpio -o -H newc --quiet) > "$W/overlay.cpio"
# concatenated initramfs: an uncompressed cpio after a gzip'd one must start 4-byte aligned
pad=$(( (4 - $(stat -c %s "$BASE") % 4) % 4 ))
{ cat "$BASE"; head -c "$pad" /dev/zero; cat "$W/overlay.cpio"; } > "$W/initrd"
exec 9>&-   # cache lock released: the VM runs on private copies

# ---------------------------------------------------------------- accel
kvm_ok() { # PVM-style /dev/kvm (kvm_pvm, no vmx/svm) accepts the VM but hangs a stock kernel
  [ -r /dev/kvm ] && [ -w /dev/kvm ] && grep -qwE 'vmx|svm' /proc/cpuinfo && [ ! -d /sys/module/kvm_pvm ]
}
[ "$ACCEL" = auto ] && { if kvm_ok; then ACCEL=kvm; else ACCEL=tcg; fi; }
if [ "$ACCEL" = kvm ]; then ACC=(-accel kvm -cpu host); else ACC=(-accel tcg,thread=multi -cpu max); fi

# ---------------------------------------------------------------- boot
log "kernel $KVER, $DRIVERS$([ $NETNS = 1 ] && echo ' (netns)'), accel $ACCEL, ${CPUS} vCPU, ${MEM}M: $(basename "$BIN") $*"
CONF=$W/console.log; : > "$CONF"; [ $VERBOSE = 1 ] && { tail -f "$CONF" >&2 & TPID=$!; }
t0=$(date +%s.%N)
set +e
timeout -k 5 "$TIMEOUT" qemu-system-x86_64 "${ACC[@]}" -smp "$CPUS" -m "$MEM" -machine q35 \
  -display none -monitor none -no-reboot -nodefaults -nic none \
  -chardev "file,id=con,path=$CONF" -serial chardev:con -chardev stdio,id=out,signal=off -serial chardev:out \
  -kernel "$VMLINUZ" -initrd "$W/initrd" -append "console=ttyS0 panic=-1 rdinit=/init $([ $VERBOSE = 1 ] || echo quiet loglevel=4)" \
  < /dev/null 2>"$W/qemu.err" | tee "$W/out.log" | sed -u '/^@@RXE-EXIT-STATUS=[0-9]*@@$/d; s/@@RXE-EXIT-STATUS=[0-9]*@@$//'
qrc=${PIPESTATUS[0]}
set -e
t1=$(date +%s.%N)
[ -n "${TPID:-}" ] && { sleep 0.2; kill "$TPID" 2>/dev/null || true; }
rc=$(sed -n 's/.*@@RXE-EXIT-STATUS=\([0-9]*\)@@$/\1/p' "$W/out.log" | tail -1)
ready=$(awk '/^@@RXE-READY@@/{print $2}' "$CONF" | tr -d '\r')
log "VM wall time $(awk -v a="$t0" -v b="$t1" 'BEGIN{printf "%.1f", b-a}')s (RDMA ready at ${ready:-?}s guest uptime), exit status ${rc:-none}"
if [ -z "$rc" ]; then
  if [ "$qrc" = 124 ] || [ "$qrc" = 137 ]; then log "TIMEOUT after ${TIMEOUT}s"; rc=124; else rc=125; fi
  log "no exit status from guest (qemu rc=$qrc); qemu stderr + console tail:"
  cat "$W/qemu.err" >&2; tail -30 "$CONF" >&2 || true
fi
exit "$rc"
