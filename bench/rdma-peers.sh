#!/usr/bin/env bash
# rdma-peers.sh - lwio beside the kernel's own RDMA file service, in one RDMA VM
# (issue 34, "the RDMA anchors"): the same fio jobs on
#   * an NFSv4.2 mount with proto=rdma, served by the guest's nfsd (rpcrdma),
#   * `lwio mount` with the verbs provider,
#   * liblwio's batch interface (fio's external engine liblwio_fio.so),
# on rxe0 (Soft-RoCE) and on siw0 (soft-iWARP), plus NFSv4.2 over TCP on the
# same veth as a reference. Jobs: 4 KiB random read QD1 (psync) and QD32
# (libaio), 1 MiB sequential read and write QD8 (libaio); O_DIRECT on the
# mounts. Client CPU per I/O: fio's own usr + sys, plus the lwio mount
# daemon's for the mount rows; "guest CPU" is every CPU of the guest (both
# ends, kernel threads, softirq) per I/O.
#
# SMB Direct cannot run: Debian's kernel is built without
# CONFIG_SMB_SERVER_SMBDIRECT (ksmbd) and CONFIG_CIFS_SMB_DIRECT (the cifs
# client's `rdma` option); the script checks the config and says so.
#
# The guest runs under qemu's TCG emulation here: every figure is indicative
# only, a ratio between rows of one run, never a target (docs/vm-tests.md).
#
# usage: bench/rdma-peers.sh            (env: PEERS_SECS=5 per run, PEERS_SIZE_MB=128,
#        PEERS_JOBS="randread-qd1 randread-qd32 read-1m write-1m" to run some of them)
# needs: the RDMA VM's host packages (scripts/rdma-vm.sh installs them) and
#        nfs-kernel-server nfs-common fio fuse3 on the host: their programs are
#        copied into the guest (on a systemd host, installing nfs-kernel-server
#        starts an NFS server: `systemctl disable --now nfs-server` if unwanted).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
SECS=${PEERS_SECS:-5}
SIZE=${PEERS_SIZE_MB:-128}
missing=()
for p in rpc.nfsd rpc.mountd exportfs rpcbind mount.nfs fio fusermount3; do
  command -v $p >/dev/null || PATH=$PATH:/usr/sbin:/sbin command -v $p >/dev/null || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "rdma-peers.sh: missing ${missing[*]}: apt-get install --no-install-recommends nfs-kernel-server nfs-common fio fuse3" >&2
  exit 2
fi
W=$(mktemp -d /tmp/lwio-rdma-peers.XXXXXX)
trap 'rm -rf "$W"' EXIT
cargo build -q --release -p lwio
ENG=$(PROFILE=release crates/capi/fio/build.sh)
LWIO=${CARGO_TARGET_DIR:-$REPO/target}/release/lwio
# The guest's users (rpcbind runs as _rpc) and the files libtirpc and rpc.nfsd read.
cat >"$W/etc-passwd" <<'EOF'
root:x:0:0:root:/root:/bin/sh
_rpc:x:100:65534::/run/rpcbind:/usr/sbin/nologin
statd:x:101:65534::/var/lib/nfs:/usr/sbin/nologin
nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin
EOF
printf 'root:x:0:\nnogroup:x:65534:\n' >"$W/etc-group"
s() { PATH=$PATH:/usr/sbin:/sbin command -v "$1"; }
VMCMD=(scripts/rdma-vm.sh -d rxe,siw -m 3072 -t $((SECS * 7 * 4 * 2 + 600))
  -M nfsd -M rpcrdma -M nfsv4 -M fuse -M loop -M ext4
  -f "$W/etc-passwd" -f "$W/etc-group" -f /etc/netconfig -f /etc/services -f /etc/protocols
  -f "$(s rpcbind)" -f "$(s exportfs)" -f "$(s rpc.mountd)" -f "$(s rpc.nfsd)" -f "$(s mount.nfs)"
  -f "$(s fio)" -f "$(s mke2fs)" -f "$(s fusermount3):/usr/bin/fusermount3" -f "$LWIO" -f "$ENG" -f scripts/vm/guest-lib.sh
  -e PEERS_SECS="$SECS" -e PEERS_SIZE_MB="$SIZE" bench/vm/rdma-peers-guest.sh)
[ -n "${PEERS_JOBS:-}" ] && VMCMD=("${VMCMD[@]:0:${#VMCMD[@]}-1}" -e PEERS_JOBS="$PEERS_JOBS" "${VMCMD[@]: -1}")
echo "command: ${VMCMD[*]}" >&2
set +e
"${VMCMD[@]}" >"$W/guest.log" 2>"$W/vm.err"
rc=$?
set -e
grep -v '^@@\|^[{}\[ ]\|^\]' "$W/guest.log" | grep -v '^"' >&2 || true
KCONF=$(ls "${RDMA_VM_CACHE:-$HOME/.cache/lwio-rdma-vm}"/linux-image-*/boot/config-* 2>/dev/null | head -1)
smbd="SMB Direct: not run: the guest kernel ($(basename "${KCONF:-unknown}" | sed 's/^config-//')) has $(grep -hE '^(# )?CONFIG_(SMB_SERVER_SMBDIRECT|CIFS_SMB_DIRECT)[ =]' "${KCONF:-/dev/null}" | tr '\n' ';' | sed 's/;$//')"
if ! grep -q '^@@RUN ' "$W/guest.log"; then
  tail -20 "$W/vm.err" >&2
  echo "rdma-peers.sh: the guest failed (exit $rc) before any run" >&2
  exit 1
fi
# The table has every run; a failed one says how it failed (and the exit
# status is 1).
python3 - "$W/guest.log" "$SECS" "$SIZE" "$(git rev-parse --short HEAD)" "$(fio --version)" "$smbd" "${VMCMD[*]}" "${PEERS_JOBS:-}" <<'PY'
import json, sys, re, datetime
log, secs, size, rev, fiov, smbd, cmd, only = sys.argv[1:9]
runs, cpu, cur, buf, failed = {}, {}, None, [], {}
for line in open(log, errors="replace"):
    line = line.rstrip("\r\n")
    if line.startswith("@@RUN "):
        cur, buf = tuple(line.split()[1:3]), []
    elif line == "@@END" and cur:
        text = "\n".join(buf)
        runs[cur] = json.loads(text[text.index("{"):])
        cur = None
    elif line.startswith("@@FAIL "):
        f = line.split(None, 3)
        failed[(f[1], f[2])] = f[3] if len(f) > 3 else "failed"
    elif line.startswith("@@CPU "):
        f = line.split()
        kv = dict(x.split("=") for x in f[3:])
        cpu[(f[1], f[2])] = kv
    elif cur:
        buf.append(line)
rows = ["nfs-rdma-rxe", "lwio-mount-rxe", "liblwio-rxe", "nfs-rdma-siw", "lwio-mount-siw", "liblwio-siw", "nfs-tcp"]
jobs = [("randread-qd1", "4 KiB random read, QD1 (psync)", "read"),
        ("randread-qd32", "4 KiB random read, QD32 (libaio)", "read"),
        ("read-1m", "1 MiB sequential read, QD8", "read"),
        ("write-1m", "1 MiB sequential write, QD8", "write")]
if only.split():
    jobs = [j for j in jobs if j[0] in only.split()]
print(f"## RDMA peers in the VM (bench/rdma-peers.sh) — {datetime.date.today()}")
print()
print(f"Guest: Debian 6.1 kernel under qemu TCG (emulated; indicative only, ratios within this run), "
      f"2 vCPU, 3 GiB; lwio {rev}; {fiov}; {secs} s per run; {size} MiB files on ext4 on a loop device in the guest's memory, "
      f"one server and one client in the guest. NFSv4.2 by the guest's nfsd, default rsize/wsize; lwio with the verbs provider on the same device. {smbd}.")
print()
print("| job | row | IOPS | MB/s | p50 µs | client CPU µs/I/O | guest CPU µs/I/O | IOPS : NFS/RDMA same device |")
print("|---|---|---:|---:|---:|---:|---:|---:|")
for job, title, d in jobs:
    base = {}
    for row in rows:
        r = runs.get((row, job))
        if not r:
            if (row, job) in failed:
                print(f"| {title} | {row} | failed: {failed[(row, job)]} | | | | | |")
            continue
        j = r["jobs"][0]
        x = j[d]
        ios = max(x["total_ios"], 1)
        rt = j["job_runtime"] / 1000
        fio_cpu = (j["usr_cpu"] + j["sys_cpu"]) / 100 * rt
        c = cpu.get((row, job), {})
        hz = float(c.get("hz", 100))
        mountd = float(c.get("mountd", 0)) / hz
        allc = float(c.get("all", 0)) / hz
        p50 = x["clat_ns"]["percentile"]["50.000000"] / 1000
        dev = row.rsplit("-", 1)[1]
        if row.startswith("nfs-rdma"):
            base[dev] = x["iops"]
        ratio = f"{x['iops'] / base[dev]:.2f}" if dev in base and not row.startswith("nfs") else "-"
        print(f"| {title} | {row} | {x['iops']:.0f} | {x['bw_bytes'] / 1e6:.1f} | {p50:.0f} | "
              f"{(fio_cpu + mountd) * 1e6 / ios:.1f} | {allc * 1e6 / ios:.1f} | {ratio} |")
missing = [f"{r} {j}" for j, _, _ in jobs for r in rows if (r, j) not in runs]
print()
print(f"Command: `bench/rdma-peers.sh` (PEERS_SECS={secs}); the VM: `{cmd}`")
if missing:
    sys.exit("rdma-peers.sh: runs that failed or did not run: " + ", ".join(missing))
PY
