#!/usr/bin/env bash
# identity-cost.sh - what acting as the caller costs (docs/mount.md,
# "Identities"): the same namespace workload, run by uid 2001, on two
# mounts of one server: an export with identity = "server" and one with
# identity = "client" (per-thread setfsuid/setfsgid/setgroups around each
# call). No caches (attr_timeout=0, entry_timeout=0, noleases): every
# call reaches the server. Rounds interleaved; prints ops/s and the ratio.
#
# usage: bench/identity-cost.sh [ROUNDS (3)] [FILES (2000)]
# Root, FUSE (fuse3), python3. LWIO=path/to/lwio (default target/release/lwio).
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-3}
N=${2:-2000}
LWIO=${LWIO:-$PWD/target/release/lwio}
[ -x "$LWIO" ] || cargo build --release -q -p lwio
W=$(mktemp -d /tmp/lwio-identity-cost.XXXXXX)
chmod 755 "$W"
export HOME=$W/home LWIO_KNOWN_HOSTS=$W/kh
mkdir -p "$HOME" "$W/srv" "$W/cli" "$W/m-srv" "$W/m-cli"
chmod 777 "$W/srv" "$W/cli"
PORT=$(( 10000 + RANDOM % 22000 ))
cat >"$W/lwio.toml" <<EOF
listen = "127.0.0.1:$PORT"
token_file = "$W/token"
[exports]
srv = { path = "$W/srv" }
cli = { path = "$W/cli", identity = "client", trust_client_ids = ["*"] }
EOF
"$LWIO" serve --config "$W/lwio.toml" --provider soft >"$W/serve.log" 2>&1 &
SP=$!
trap 'fusermount3 -u "$W/m-srv" 2>/dev/null; fusermount3 -u "$W/m-cli" 2>/dev/null; kill $SP; wait $SP 2>/dev/null; rm -rf "$W"' EXIT
for _ in $(seq 1 100); do grep -q "RDMA listening" "$W/serve.log" && break; sleep 0.1; done
export LWIO_FINGERPRINT=$(grep -o 'sha256:[0-9A-F:]*' "$W/serve.log" | head -1)
O=allow_other,attr_timeout=0,entry_timeout=0,noleases
for e in srv cli; do
  "$LWIO" mount --daemon --provider soft --token-file "$W/token" "lwio://127.0.0.1:$PORT/$e" "$W/m-$e" -o "$O"
done
run() { # dir -> ops/s of create + stat + unlink, as uid 2001
  setpriv --reuid=2001 --regid=2001 --clear-groups /usr/bin/python3 - "$1" "$N" <<'EOF'
import os, sys, time
d, n = sys.argv[1], int(sys.argv[2])
t = time.perf_counter()
for i in range(n):
    p = f"{d}/f{i}"
    os.close(os.open(p, os.O_CREAT | os.O_WRONLY, 0o644))
    os.stat(p)
    os.unlink(p)
print(f"{3 * n / (time.perf_counter() - t):.0f}")
EOF
}
echo "command: bench/identity-cost.sh $ROUNDS $N   (create+stat+unlink by uid 2001, no caches)"
printf '%-6s %14s %14s %7s\n' round server-ids client-ids ratio
for r in $(seq 1 "$ROUNDS"); do
  a=$(run "$W/m-srv"); b=$(run "$W/m-cli")
  printf '%-6s %14s %14s %7s\n' "$r" "$a" "$b" "$(python3 -c "print(f'{$b/$a:.3f}')")"
done
