#!/usr/bin/env bash
# package-tests.sh - build the lwio Debian package, install it on this host
# with apt, and run it as a service: the files, `lwio --version`, the man
# pages, pkg-config and liblwio, `serve --check-config`, the server started
# as lwio.service starts it (sd_notify READY=1 only once both listeners
# accept), an fstab line mounted with `mount -t fuse.lwio`, a file written
# through the mount, SIGHUP, a stop within shutdown_grace, removal, and no
# process left. Root only (apt, mount, the lwio user); a Debian host.
#
# usage: scripts/package-tests.sh        (CI: wired in by .ci/run)
# env:   LWIO_DEB=path.deb  test this package instead of building one
#
# Without systemd as PID 1 (CI, containers) the script starts
# `/usr/bin/lwio serve --config FILE` as the unit's ExecStart does: as the
# lwio user, with the unit's limits, and NOTIFY_SOCKET on a socket it
# listens on. With systemd it uses the unit itself.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
T0=$(date +%s)
PASS=0
FAIL=0
pass() { PASS=$((PASS + 1)); echo "ok: $*"; }
fail() { FAIL=$((FAIL + 1)); echo "FAIL: $*" >&2; }
die() { echo "package-tests: $*" >&2; summary; exit 1; }
summary() { echo "package-tests: $(( $(date +%s) - T0 )) s"; echo "$PASS passed, $FAIL failed"; }

[ "$(id -u)" = 0 ] || { echo "package-tests: needs root (apt, mount, useradd)" >&2; exit 1; }
command -v apt-get >/dev/null || { echo "package-tests: needs apt (Debian)" >&2; exit 1; }

W=$(mktemp -d /tmp/lwio-pkgtest.XXXXXX)
chmod 755 "$W"
EXPORT=/srv/lwio-pkgtest/data
MNT=$W/mnt
SERVER_PID=
NOTIFY_PID=
WAS_INSTALLED=$(dpkg-query -W -f='${Status}' lwio 2>/dev/null | grep -c 'install ok installed' || true)

cleanup() {
    set +e
    for m in "$MNT" "$W/mnt2"; do
        mountpoint -q "$m" 2>/dev/null && { fusermount3 -u "$m" 2>/dev/null || umount -l "$m"; }
    done
    [ -n "$SERVER_PID" ] && kill "$SERVER_PID" 2>/dev/null && wait "$SERVER_PID" 2>/dev/null
    [ -n "$NOTIFY_PID" ] && kill "$NOTIFY_PID" 2>/dev/null
    if [ "$WAS_INSTALLED" = 0 ] && dpkg-query -W lwio >/dev/null 2>&1; then
        DEBIAN_FRONTEND=noninteractive apt-get purge -y -q lwio >/dev/null 2>&1
    fi
    rm -rf "$W" /srv/lwio-pkgtest /etc/lwio/pkgtest.toml
}
trap cleanup EXIT

# 1. Build.
if [ -n "${LWIO_DEB:-}" ]; then
    DEB=$LWIO_DEB
else
    if ! command -v cargo-deb >/dev/null; then
        echo "package-tests: installing cargo-deb"
        cargo install -q --locked cargo-deb
    fi
    packaging/build-deb.sh >"$W/build.log" 2>&1 || { tail -20 "$W/build.log"; die "build-deb.sh failed"; }
    DEB=$(ls -t target/debian/lwio_*.deb | head -1)
fi
[ -f "$DEB" ] || die "no package: $DEB"
dpkg-deb -c "$DEB" >"$W/contents"
for f in ./usr/bin/lwio ./usr/lib/liblwio.so ./usr/lib/liblwio_preload.so ./usr/include/lwio.h \
    ./usr/lib/pkgconfig/lwio.pc ./usr/sbin/mount.fuse.lwio ./usr/sbin/mount.lwio \
    ./usr/share/man/man1/lwio.1.gz ./usr/share/man/man1/lwio-serve.1.gz ./usr/share/man/man5/lwio.toml.5.gz \
    ./usr/share/man/man3/liblwio.3.gz ./usr/share/bash-completion/completions/lwio \
    ./etc/lwio/lwio.toml ./usr/lib/systemd/system/lwio.service ./usr/lib/systemd/system/lwio-root.service \
    ./usr/share/lwio/grafana/lwio.json ./usr/share/lwio/prometheus/lwio-alerts.yml \
    ./usr/lib/lwio/liblwio_fio.so; do
    grep -q " $f\$" "$W/contents" && pass "package has $f" || fail "package lacks $f"
done
dpkg-deb -f "$DEB" Depends | grep -q fuse3 && pass "depends on fuse3" || fail "no fuse3 dependency"

# 2. Install with apt (pulls fuse3 and adduser).
DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$(realpath "$DEB")" >"$W/apt-install.log" 2>&1 ||
    { tail -20 "$W/apt-install.log"; die "apt install failed"; }
pass "apt install $(basename "$DEB")"
grep -q 'no usable export yet' "$W/apt-install.log" || [ ! -d /run/systemd/system ] ||
    fail "postinst did not say the default config has no export"

V=$(/usr/bin/lwio --version)
[ "$V" = "lwio $(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)" ] && pass "lwio --version: $V" || fail "lwio --version: $V"
[ "$(command -v lwio)" = /usr/bin/lwio ] || [ "$(command -v lwio)" = /bin/lwio ] || fail "lwio on PATH is $(command -v lwio)"
for page in "1 lwio" "1 lwio-serve" "1 lwio-mount" "5 lwio.toml" "3 liblwio"; do
    set -- $page
    p=$(man -w "$1" "$2" 2>/dev/null || true)
    [ "$p" = "/usr/share/man/man$1/$2.$1.gz" ] && pass "man -w $1 $2: $p" || fail "man -w $1 $2: '$p'"
done
MANPAGER=cat MANWIDTH=80 man 1 lwio 2>/dev/null | grep 'lwio-serve(1)' >/dev/null && pass "man lwio names lwio-serve(1)" || fail "man lwio"
getent passwd lwio >/dev/null && pass "system user lwio" || fail "no lwio user"
[ "$(stat -c '%U %a' /var/lib/lwio 2>/dev/null)" = "lwio 700" ] && pass "/var/lib/lwio lwio 700" || fail "/var/lib/lwio: $(stat -c '%U %a' /var/lib/lwio 2>&1)"
grep -qx /etc/lwio/lwio.toml /var/lib/dpkg/info/lwio.conffiles && pass "conffile /etc/lwio/lwio.toml" || fail "not a conffile"
if command -v pkg-config >/dev/null && command -v cc >/dev/null; then
    printf '#include <lwio.h>\n#include <stdio.h>\nint main(void){ return lwio_connect(NULL, NULL) == NULL ? 0 : 1; }\n' >"$W/t.c"
    # shellcheck disable=SC2046
    if cc -o "$W/t" "$W/t.c" $(pkg-config --cflags --libs lwio) 2>"$W/cc.log" && "$W/t"; then
        pass "cc with pkg-config lwio; liblwio.so loads"
    else
        fail "cc against liblwio: $(head -3 "$W/cc.log")"
    fi
fi
if command -v systemd-analyze >/dev/null; then
    for u in lwio.service lwio-root.service; do
        if systemd-analyze verify "/usr/lib/systemd/system/$u" >"$W/verify.log" 2>&1; then
            pass "systemd-analyze verify $u"
        elif grep -qiE 'failed to (connect|initialize)|not booted|Failed to setup' "$W/verify.log"; then
            echo "skip: systemd-analyze verify $u ($(head -1 "$W/verify.log"))"
        else
            fail "systemd-analyze verify $u: $(cat "$W/verify.log")"
        fi
    done
fi

# 3. --check-config: the shipped file (no export) is refused, one line.
if out=$(runuser -u lwio -- lwio serve --check-config /etc/lwio/lwio.toml 2>&1); then
    fail "the shipped config passed --check-config"
else
    [ "$out" = "lwio: error: config file /etc/lwio/lwio.toml: nothing to serve: give at least one --export NAME=PATH (or [exports] in --config)" ] &&
        pass "--check-config on the shipped file: exit 1, one line" || fail "--check-config on the shipped file: $out"
fi

# A configuration with an export the lwio user owns, on free ports.
read -r SIDE RDMA METRICS < <(python3 -c '
import socket
ss = [socket.socket() for _ in range(3)]
for s in ss: s.bind(("127.0.0.1", 0))
print(*[s.getsockname()[1] for s in ss])')
install -d -o lwio -g lwio "$EXPORT"
# In /etc/lwio, where a unit's sandbox sees it (PrivateTmp= hides /tmp).
CONF=/etc/lwio/pkgtest.toml
cat >"$CONF" <<EOF
listen = "127.0.0.1:$SIDE"
rdma_listen = "127.0.0.1:$RDMA"
metrics_listen = "127.0.0.1:$METRICS"
provider = "soft"
token_file = "/var/lib/lwio/token"

[exports]
data = "$EXPORT"

[limits]
shutdown_grace = "5s"
EOF
chmod 644 "$CONF"
runuser -u lwio -- lwio serve --check-config "$CONF" >"$W/check.out" 2>&1 &&
    grep -qx "export data $EXPORT: read-write, identity server, readers \[\*, anonymous\], writers \[\*, anonymous\]" "$W/check.out" &&
    pass "--check-config on a good file" || fail "--check-config on a good file: $(cat "$W/check.out")"
sed 's/^provider = "soft"/provider = "soft"\ncolour = 1/' "$CONF" >"$W/bad.toml"
if out=$(lwio serve --check-config "$W/bad.toml" 2>&1); then fail "unknown key passed"; else
    case $out in "lwio: error: config file $W/bad.toml: line 5 (colour = 1): unknown field \`colour\`"*) pass "--check-config: unknown key";; *) fail "unknown key: $out";; esac
fi

# 4. The server, as the unit runs it.
if [ -d /run/systemd/system ] && [ "$(cat /proc/1/comm)" = systemd ]; then
    MODE=systemd
    install -d /etc/systemd/system/lwio.service.d
    cat >/etc/systemd/system/lwio.service.d/pkgtest.conf <<EOF
[Service]
ExecStartPre=
ExecStartPre=/usr/bin/lwio serve --check-config $CONF
ExecStart=
ExecStart=/usr/bin/lwio serve --config $CONF
EOF
    systemctl daemon-reload
    systemctl start lwio.service && pass "systemctl start lwio (Type=notify: READY=1 arrived)" || fail "systemctl start lwio: $(journalctl -u lwio -n 20 --no-pager)"
    SERVER_PID=$(systemctl show -p MainPID --value lwio.service)
    for p in "$SIDE" "$RDMA"; do
        python3 -c "import socket; socket.create_connection(('127.0.0.1', $p), 2).close()" && pass "port $p accepts after start" || fail "port $p"
    done
    systemctl show -p StatusText --value lwio.service | grep -q '^serving: ' && pass "STATUS= in systemctl status" || fail "no STATUS="
    # Under the unit's SystemCallFilter= the server still has io_uring.
    journalctl -u lwio --no-pager | grep 'file I/O backend: io_uring' >/dev/null && pass "io_uring backend under the unit's system-call filter" ||
        fail "file I/O backend under the unit: $(journalctl -u lwio --no-pager | grep -o 'file I/O backend.*' | tail -1)"
else
    MODE=direct
    # NOTIFY_SOCKET on a socket we listen on; at READY=1 the listener
    # connects to both ports at once and records whether they accept.
    cat >"$W/notify.py" <<'EOF'
import os, socket, sys, time
path, log, side, rdma = sys.argv[1:5]
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
s.bind(path)
os.chmod(path, 0o777)
with open(log, "a", buffering=1) as f:
    while True:
        data = s.recv(4096).decode()
        extra = ""
        if "READY=1" in data.split("\n"):
            res = []
            for port in (side, rdma):
                try:
                    socket.create_connection(("127.0.0.1", int(port)), 2).close()
                    res.append("ok")
                except OSError as e:
                    res.append("refused(%s)" % e)
            extra = " connect=" + ",".join(res)
        f.write("%.3f %s%s\n" % (time.time(), data.replace("\n", "|"), extra))
        if "STOPPING=1" in data.split("\n"):
            break
EOF
    python3 "$W/notify.py" "$W/notify.sock" "$W/notify.log" "$SIDE" "$RDMA" &
    NOTIFY_PID=$!
    for _ in $(seq 50); do [ -S "$W/notify.sock" ] && break; sleep 0.1; done
    # ExecStartPre, then ExecStart with the unit's User= and Limit*=.
    runuser -u lwio -- /usr/bin/lwio serve --check-config "$CONF" >/dev/null || fail "ExecStartPre"
    (
        ulimit -n 1048576 2>/dev/null || ulimit -n "$(ulimit -Hn)"
        ulimit -l unlimited 2>/dev/null || true
        cd /
        # As systemd starts a service: no PAM session, the unit's user and
        # groups, the limits above; setpriv and env exec, so $! is lwio.
        exec setpriv --reuid=lwio --regid=lwio --init-groups \
            env NOTIFY_SOCKET="$W/notify.sock" /usr/bin/lwio serve --config "$CONF"
    ) >"$W/server.out" 2>"$W/server.err" &
    SERVER_PID=$!
    for _ in $(seq 300); do grep -q 'READY=1' "$W/notify.log" 2>/dev/null && break; sleep 0.1; done
    if grep -q 'READY=1.* connect=ok,ok$' "$W/notify.log"; then
        pass "READY=1 after both listeners accept ($(grep -o 'STATUS=[^|]*' "$W/notify.log" | head -1))"
    else
        fail "READY=1: $(cat "$W/notify.log" 2>&1); $(tail -5 "$W/server.err")"
    fi
    grep -q "lwio: RDMA listening on 127.0.0.1:$RDMA" "$W/server.out" && pass "RDMA listener on $RDMA" || fail "server stdout: $(cat "$W/server.out")"
    [ "$(readlink "/proc/$SERVER_PID/exe")" = /usr/bin/lwio ] && [ "$(stat -c %U "/proc/$SERVER_PID")" = lwio ] &&
        pass "server pid $SERVER_PID is /usr/bin/lwio as lwio" || fail "server process: $(ps -o user,args -p "$SERVER_PID")"
    nofile=$(awk '/Max open files/ {print $4}' "/proc/$SERVER_PID/limits")
    if (ulimit -n 1048576) 2>/dev/null; then
        [ "$nofile" = 1048576 ] && pass "LimitNOFILE 1048576" || fail "open-file limit $nofile"
    else
        echo "note: this host cannot raise the open-file limit to 1048576 (hard limit $(ulimit -Hn)); the server has $nofile"
    fi
fi
[ "$(stat -c %U /var/lib/lwio/token)" = lwio ] && pass "token created by the lwio user" || fail "token owner"
if [ "$MODE" = systemd ]; then
    FP=$(journalctl -u lwio --no-pager | sed -n 's/.*lwio: TLS fingerprint \(sha256:[0-9A-F:]*\).*/\1/p' | tail -1)
else
    FP=$(sed -n 's/^lwio: TLS fingerprint \(sha256:[0-9A-F:]*\)$/\1/p' "$W/server.out")
fi
[ -n "$FP" ] && pass "server fingerprint $FP" || fail "no fingerprint"
curl -sf "http://127.0.0.1:$METRICS/metrics" | grep '^lwio_sessions ' >/dev/null && pass "metrics on $METRICS" || fail "no metrics"

# 5. An fstab line through mount -t fuse.lwio (mount.fuse.lwio → mount.fuse3 → lwio).
mkdir -p "$MNT"
echo "lwio://127.0.0.1:$SIDE/data  $MNT  fuse.lwio  defaults,_netdev,token_file=/var/lib/lwio/token,fingerprint=$FP  0 0" >"$W/fstab"
if env PATH=/usr/sbin:/usr/bin:/sbin:/bin mount -T "$W/fstab" "$MNT" 2>"$W/mount.err"; then
    pass "mount -T fstab ($MNT, fuse.lwio)"
else
    fail "mount: $(cat "$W/mount.err")"
fi
[ "$(awk -v m="$MNT" '$2 == m {print $1, $3}' /proc/mounts)" = "lwio:data fuse" ] && pass "/proc/mounts: lwio:data on $MNT" || fail "/proc/mounts: $(grep "$MNT" /proc/mounts)"
echo "written through lwio $$" >"$MNT/pkgtest.txt" && sync -f "$MNT/pkgtest.txt" || fail "write through the mount"
[ "$(cat "$EXPORT/pkgtest.txt" 2>&1)" = "written through lwio $$" ] && pass "file written through the mount is in the export" || fail "export has: $(cat "$EXPORT/pkgtest.txt" 2>&1)"
[ "$(stat -c %U "$EXPORT/pkgtest.txt" 2>&1)" = lwio ] && pass "owned by lwio (identity = server)" || fail "owner $(stat -c %U "$EXPORT/pkgtest.txt" 2>&1)"
[ "$(cat "$MNT/pkgtest.txt")" = "written through lwio $$" ] && pass "read back through the mount" || fail "read back"
# The packaged fio engine against the packaged server: a verified job.
# (Direct mode: the host has fio; the systemd container has no fio.)
if [ "$MODE" = direct ]; then
    if fio --name=pkgfio --ioengine=external:/usr/lib/lwio/liblwio_fio.so \
        --lwio_url="lwio://127.0.0.1:$SIDE/data" --lwio_token_file=/var/lib/lwio/token \
        --lwio_fingerprint="$FP" --filename=pkgfio.dat --rw=randwrite --bs=4k --size=4M \
        --iodepth=16 --verify=crc32c --do_verify=1 --verify_fatal=1 >"$W/fio.log" 2>&1 &&
        grep -q "err= 0" "$W/fio.log" && [ "$(stat -c %s "$EXPORT/pkgfio.dat")" = 4194304 ]; then
        pass "fio --ioengine=external:/usr/lib/lwio/liblwio_fio.so: 4 MiB randwrite, crc32c verified"
    else
        fail "fio through the packaged engine: $(grep -iE "error|err=|verify" "$W/fio.log" | head -3)"
    fi
    rm -f "$EXPORT/pkgfio.dat"
fi

# 6. Reload: SIGHUP re-checks, the server keeps serving (and the mount works).
if [ "$MODE" = systemd ]; then systemctl reload lwio.service; else kill -HUP "$SERVER_PID"; fi
sleep 1
kill -0 "$SERVER_PID" 2>/dev/null && pass "alive after SIGHUP" || fail "SIGHUP stopped the server"
if [ "$MODE" = direct ]; then
    grep -q 'SIGHUP: configuration re-read and checked: unchanged' "$W/server.err" && pass "SIGHUP logged the re-check" || fail "SIGHUP log: $(tail -3 "$W/server.err")"
fi
ls "$MNT" | grep -qx pkgtest.txt && pass "mount still served after SIGHUP" || fail "listing after SIGHUP"
# An export added to the file is applied by the reload; the mount stays.
install -d -o lwio -g lwio /srv/lwio-pkgtest/more
sed -i "s|^data = \"$EXPORT\"\$|&\nmore = \"/srv/lwio-pkgtest/more\"|" "$CONF"
grep -q '^more = ' "$CONF" || fail "could not add an export to $CONF"
if [ "$MODE" = systemd ]; then systemctl reload lwio.service; else kill -HUP "$SERVER_PID"; fi
sleep 1
if [ "$MODE" = systemd ]; then RLOG=$(journalctl -u lwio --no-pager); else RLOG=$(cat "$W/server.err"); fi
echo "$RLOG" | grep -q 'SIGHUP: export added: more path=/srv/lwio-pkgtest/more' && pass "SIGHUP applied the added export" || fail "reload log: $(echo "$RLOG" | tail -3)"
ls "$MNT" | grep -qx pkgtest.txt && pass "mount still served after the reload" || fail "listing after the reload"
# A new mount of the added export, from its own fstab line, while the first stays mounted.
MNT2=$W/mnt2
mkdir -p "$MNT2"
echo "lwio://127.0.0.1:$SIDE/more  $MNT2  fuse.lwio  defaults,_netdev,token_file=/var/lib/lwio/token,fingerprint=$FP  0 0" >"$W/fstab2"
if env PATH=/usr/sbin:/usr/bin:/sbin:/bin mount -T "$W/fstab2" "$MNT2" 2>"$W/mount2.err"; then
    echo "in the added export $$" >"$MNT2/more.txt" && sync -f "$MNT2/more.txt"
    [ "$(cat /srv/lwio-pkgtest/more/more.txt 2>&1)" = "in the added export $$" ] && pass "a new mount of the reloaded export writes into it" || fail "added export has: $(cat /srv/lwio-pkgtest/more/more.txt 2>&1)"
    fusermount3 -u "$MNT2" || fail "unmount $MNT2"
else
    fail "mount of the added export: $(cat "$W/mount2.err")"
fi
mountpoint -q "$MNT" && ls "$MNT" | grep -qx pkgtest.txt && pass "the first mount stayed mounted" || fail "the first mount is gone"

fusermount3 -u "$MNT" && pass "unmounted" || fail "unmount"

# 7. Stop within shutdown_grace (5 s) plus a margin.
t=$(date +%s%N)
if [ "$MODE" = systemd ]; then systemctl stop lwio.service; else kill -TERM "$SERVER_PID"; fi
for _ in $(seq 100); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.1; done
ms=$(( ($(date +%s%N) - t) / 1000000 ))
if kill -0 "$SERVER_PID" 2>/dev/null; then fail "still running ${ms} ms after SIGTERM"; else
    [ "$ms" -lt 7000 ] && pass "stopped in ${ms} ms (shutdown_grace 5 s)" || fail "stop took ${ms} ms"
fi
if [ "$MODE" = direct ]; then
    wait "$NOTIFY_PID" 2>/dev/null || true
    NOTIFY_PID=
    grep -q 'STOPPING=1' "$W/notify.log" && pass "STOPPING=1 sent" || fail "no STOPPING=1: $(cat "$W/notify.log")"
fi
SERVER_PID=
[ "$MODE" = systemd ] && rm -rf /etc/systemd/system/lwio.service.d/pkgtest.conf && systemctl daemon-reload

# 8. Remove: nothing of lwio left running.
rm -f "$CONF"
DEBIAN_FRONTEND=noninteractive apt-get purge -y -q lwio >"$W/apt-remove.log" 2>&1 && pass "apt purge lwio" || fail "apt purge: $(tail -5 "$W/apt-remove.log")"
[ ! -e /usr/bin/lwio ] && [ ! -e /etc/lwio/lwio.toml ] && [ ! -e /var/lib/lwio ] && pass "files removed" || fail "files left: $(ls -d /usr/bin/lwio /etc/lwio /var/lib/lwio 2>/dev/null)"
left=$(pgrep -f '^/usr/bin/lwio ' || true)
[ -z "$left" ] && pass "no lwio process left" || fail "processes left: $left"
if [ "$WAS_INSTALLED" != 0 ]; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$(realpath "$DEB")" >/dev/null 2>&1 || true
fi

summary
[ "$FAIL" = 0 ]
