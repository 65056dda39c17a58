#!/usr/bin/env bash
# systemd-tests.sh - the Debian package on a fresh Debian system under a real
# systemd: a bookworm tree made with debootstrap (cached), booted as a
# container with systemd-nspawn (systemd is its PID 1), and
# scripts/package-tests.sh run inside it against the package, so that its
# systemd mode runs: `apt install ./lwio_*.deb`, `systemctl start lwio`
# (Type=notify: it returns only after READY=1, and both ports then accept),
# STATUS=, an fstab line mounted with `mount -T`, a file written through the
# mount, `systemctl reload lwio`, `systemctl stop lwio` within
# shutdown_grace, `apt purge`, and no process left.
#
# The RDMA VM guest (scripts/rdma-vm.sh) is an initramfs without systemd;
# a container is the fresh Debian system with systemd here (issue 35).
#
# usage: scripts/systemd-tests.sh          (CI: wired in by .ci/run, after `package`)
# env:   LWIO_DEB=path.deb   the package (default: the newest target/debian/lwio_*.deb,
#                            built with packaging/build-deb.sh when there is none)
#        SYSTEMD_ROOT=DIR    where the cached Debian tree is kept
#                            (default: ${CARGO_TARGET_DIR:-target}/systemd-root)
# Root only; needs the network to deb.debian.org the first time (debootstrap)
# and for apt inside the container (the package's dependencies).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
T0=$(date +%s)
say() { echo "systemd-tests: $*"; }
die() { echo "systemd-tests: $*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "needs root (debootstrap, systemd-nspawn)"
need=()
command -v debootstrap >/dev/null || need+=(debootstrap)
command -v systemd-nspawn >/dev/null || need+=(systemd-container)
command -v nsenter >/dev/null || need+=(util-linux)
if [ ${#need[@]} -gt 0 ]; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${need[@]}" >/dev/null 2>&1 ||
        { apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${need[@]}" >/dev/null; } ||
        die "cannot install ${need[*]}"
fi

# 1. The package.
DEB=${LWIO_DEB:-}
if [ -z "$DEB" ]; then
    DEB=$(ls -t "${CARGO_TARGET_DIR:-target}"/debian/lwio_*.deb 2>/dev/null | head -1 || true)
    if [ -z "$DEB" ]; then
        command -v cargo-deb >/dev/null || cargo install -q --locked cargo-deb
        packaging/build-deb.sh >/dev/null 2>&1 || die "packaging/build-deb.sh failed"
        DEB=$(ls -t "${CARGO_TARGET_DIR:-target}"/debian/lwio_*.deb | head -1)
    fi
fi
[ -f "$DEB" ] || die "no package: $DEB"
say "package $DEB"

# 2. A fresh Debian tree: made once with debootstrap, copied for each run.
BASE=${SYSTEMD_ROOT:-${CARGO_TARGET_DIR:-$ROOT/target}/systemd-root}
PKGS=systemd,systemd-sysv,dbus,fuse3,ca-certificates,python3,curl,man-db,procps,adduser
if [ ! -f "$BASE/.complete" ] || [ "$(cat "$BASE/.complete")" != "$PKGS" ]; then
    say "debootstrap bookworm into $BASE (once)"
    rm -rf "$BASE"
    mkdir -p "$BASE"
    debootstrap --variant=minbase --include="$PKGS" bookworm "$BASE" http://deb.debian.org/debian \
        >"$BASE.log" 2>&1 || { tail -20 "$BASE.log"; die "debootstrap failed"; }
    echo lwio-systemd-test >"$BASE/etc/hostname"
    # The container's console is a pipe: no getty on it.
    ln -sf /dev/null "$BASE/etc/systemd/system/console-getty.service"
    echo "$PKGS" >"$BASE/.complete"
fi
W=$(mktemp -d /var/tmp/lwio-systemd.XXXXXX)
NSPID=
cleanup() {
    set +e
    if [ -n "$NSPID" ] && kill -0 "$NSPID" 2>/dev/null; then
        kill -TERM "$NSPID"   # systemd-nspawn halts the container
        for _ in $(seq 100); do kill -0 "$NSPID" 2>/dev/null || break; sleep 0.2; done
        kill -KILL "$NSPID" 2>/dev/null
    fi
    # Mounts left in the tree by a failed run.
    grep -o " $W/[^ ]*" /proc/mounts | sort -r | while read -r m; do umount -l "$m"; done
    rm -rf "$W"
}
trap cleanup EXIT
cp -a "$BASE" "$W/root"
cp "$DEB" "$W/root/root/lwio.deb"

# 3. Boot it, systemd as PID 1; /dev/fuse for the mount; the repository
#    read-only at /src (package-tests.sh and Cargo.toml's version).
MACHINE=lwio-test-$$
systemd-nspawn -q -D "$W/root" -M "$MACHINE" --register=no --keep-unit --boot \
    --console=pipe --bind=/dev/fuse --bind-ro="$ROOT:/src" </dev/null >"$W/console.log" 2>&1 &
NSPID=$!
CPID=
for _ in $(seq 100); do
    CPID=$(pgrep -P "$NSPID" -x systemd || true)
    [ -n "$CPID" ] && break
    kill -0 "$NSPID" 2>/dev/null || { cat "$W/console.log" >&2; die "systemd-nspawn exited"; }
    sleep 0.2
done
[ -n "$CPID" ] || { cat "$W/console.log" >&2; die "no systemd in the container"; }
inside() { nsenter -t "$CPID" -a -- env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 "$@"; }
# systemd is found as a process before it listens on its bus: until then
# systemctl says "Failed to connect to bus" (seen on a loaded CI machine);
# ask again until it answers, within the same two minutes.
deadline=$((SECONDS + 120))
while :; do
    state=$(timeout 120 nsenter -t "$CPID" -a -- systemctl is-system-running --wait 2>&1 || true)
    case $state in
        *"Failed to connect to bus"*) [ "$SECONDS" -lt "$deadline" ] && { sleep 0.5; continue; } ;;
    esac
    break
done
case $state in
    running | degraded) say "container booted, systemd $(inside systemctl --version | head -1 | cut -d' ' -f2) is PID 1 ($state)" ;;
    *) inside systemctl --failed --no-pager || true; die "container did not come up: $state" ;;
esac
[ "$(inside cat /proc/1/comm)" = systemd ] || die "PID 1 in the container is not systemd"

# 4. The package tests, in systemd mode.
inside apt-get update -q >"$W/apt-update.log" 2>&1 || { tail -5 "$W/apt-update.log"; die "apt-get update in the container"; }
set +e
inside bash -c 'cd /src && LWIO_DEB=/root/lwio.deb bash scripts/package-tests.sh' 2>&1 | tee "$W/package-tests.log"
rc=${PIPESTATUS[0]}
set -e
grep -q '^ok: systemctl start lwio (Type=notify: READY=1 arrived)$' "$W/package-tests.log" ||
    { rc=1; echo "systemd-tests: package-tests did not run in systemd mode" >&2; }

# 5. A database's set-up: lwio-root.service with an identity = "client"
#    export, mounted from fstab with allow_other,default_permissions; a user
#    who is not root creates a 0700 directory tree through the mount, enters
#    it and owns it on the server, is refused root's 0700 directory, and
#    root is squashed.
cat >"$W/root/root/root-unit.sh" <<'INNER'
set -u
fails=0
ok() { echo "ok: $*"; }
bad() { echo "FAIL: $*" >&2; fails=$((fails + 1)); }
DEBIAN_FRONTEND=noninteractive apt-get install -y -q /root/lwio.deb >/root/apt.log 2>&1 || { tail -5 /root/apt.log; exit 1; }
useradd -m -u 2001 dbuser
install -d -m 755 /srv/db
printf '%s\n' 'listen = "127.0.0.1:7420"' 'provider = "soft"' 'token_file = "/var/lib/lwio/token"' \
    '[exports]' 'db = { path = "/srv/db", identity = "client", trust_client_ids = ["*"] }' \
    '[limits]' 'shutdown_grace = "5s"' >/etc/lwio/lwio.toml
if systemctl start lwio-root.service; then ok "systemctl start lwio-root (READY=1)"; else
    bad "start: $(journalctl -u lwio-root -n 20 --no-pager)"; exit 1
fi
journalctl -u lwio-root --no-pager | grep 'file I/O backend: io_uring' >/dev/null && ok "io_uring backend under lwio-root's filter" ||
    bad "backend: $(journalctl -u lwio-root --no-pager | grep -o 'file I/O backend.*')"
FP=$(journalctl -u lwio-root --no-pager | sed -n 's/.*lwio: TLS fingerprint \(sha256:[0-9A-F:]*\).*/\1/p' | tail -1)
mkdir -p /mnt/db
echo "lwio://127.0.0.1/db /mnt/db fuse.lwio _netdev,allow_other,default_permissions,token_file=/var/lib/lwio/token,fingerprint=$FP 0 0" >>/etc/fstab
if mount -a -t fuse.lwio && mountpoint -q /mnt/db; then ok "mount -a: /mnt/db from its fstab line"; else bad "mount -a"; exit 1; fi
# As on NFS: the administrator makes the database's directory on the
# server and gives it to the database's user (client root is squashed).
install -d -o dbuser -g dbuser -m 700 /srv/db/pg
install -d -m 1777 /srv/db/shared
install -d -m 700 /srv/db/rootonly
runuser -u dbuser -- sh -c 'umask 077; mkdir /mnt/db/pg/pg_wal && mkdir /mnt/db/pg/pg_wal/archive_status && echo wal >/mnt/db/pg/pg_wal/000001' &&
    ok "dbuser made a 0700 directory tree through the mount and entered it" || bad "dbuser could not create and enter its own directories"
got=$(stat -c '%u %a' /srv/db/pg/pg_wal /srv/db/pg/pg_wal/archive_status /srv/db/pg/pg_wal/000001 | tr '\n' ' ')
[ "$got" = "2001 700 2001 700 2001 600 " ] && ok "owned by dbuser (uid 2001) on the server" || bad "on the server: $got"
if runuser -u dbuser -- ls /mnt/db/rootonly >/dev/null 2>&1; then bad "dbuser listed root's 0700 directory"; else ok "dbuser refused root's 0700 directory"; fi
if touch /mnt/db/byroot 2>/dev/null; then bad "squashed root created a file in root's 0755 directory"; else ok "squashed root refused in root's 0755 directory"; fi
touch /mnt/db/shared/byroot
[ "$(stat -c %u /srv/db/shared/byroot 2>&1)" = 65534 ] && ok "root's file in a 1777 directory is 65534's (root_squash)" ||
    bad "root's file: $(stat -c %u /srv/db/shared/byroot 2>&1)"
umount /mnt/db && ok "unmounted" || bad "umount"
t=$(date +%s%N)
systemctl stop lwio-root.service
ms=$(( ($(date +%s%N) - t) / 1000000 ))
[ "$ms" -lt 7000 ] && ok "lwio-root stopped in ${ms} ms" || bad "stop took ${ms} ms"
echo "root-unit: $fails failure(s)"
exit "$fails"
INNER
if inside bash /root/root-unit.sh 2>&1 | tee "$W/root-unit.log"; [ "${PIPESTATUS[0]}" != 0 ]; then
    rc=1
fi
say "$(( $(date +%s) - T0 )) s"
exit "$rc"
