# scripts/lib/serve.sh - sourced by the test and benchmark scripts that need
# one `lwio serve` of a directory on loopback (run from the repository root).
#
# serve_data DIR LOG [ARGS...]: start "$LWIO" serving DIR as export "data" on
# a random port of 127.0.0.1 (another if it is taken) with the soft provider
# (ARGS go to `lwio serve`; redirections on the call reach the server too),
# wait up to 10 s for its RDMA listener, and set SERVER_PID, PORT, FP (its
# TLS fingerprint) and URL.
# SERVE_PORT=N: that port (a server started again where it was), never another.
# Returns 1, with the server's log on stderr, if it did not start.
serve_data() {
  local dir=$1 log=$2 try
  shift 2
  # Ports below the kernel's ephemeral range (32768-60999), so that no
  # client socket of another test holds one; another listener still may:
  # then a new pair of ports (the RDMA listener takes PORT + 1).
  for try in 1 2 3 4 5; do
    PORT=${SERVE_PORT:-$(( 10000 + RANDOM % 22000 ))}
    "$LWIO" serve --export "data=$dir" --listen "127.0.0.1:$PORT" --provider soft "$@" >"$log" 2>&1 &
    SERVER_PID=$!
    for _ in $(seq 1 100); do
      grep -q "RDMA listening" "$log" && break
      grep -q "Address already in use" "$log" && break
      sleep 0.1
    done
    [ -z "${SERVE_PORT:-}" ] && grep -q "Address already in use" "$log" || break
    kill "$SERVER_PID" 2>/dev/null; wait "$SERVER_PID" 2>/dev/null
  done
  FP=$(grep -o 'sha256:[0-9A-F:]*' "$log" | head -1)
  URL=lwio://127.0.0.1:$PORT/data
  [ -n "$FP" ] || { cat "$log" >&2; return 1; }
}
