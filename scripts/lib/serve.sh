# scripts/lib/serve.sh - sourced by the test and benchmark scripts that need
# one `lwio serve` of a directory on loopback (run from the repository root).
#
# serve_data DIR LOG [ARGS...]: start "$LWIO" serving DIR as export "data" on
# a random port of 127.0.0.1 with the soft provider (ARGS go to `lwio serve`;
# redirections on the call reach the server too), wait up to 10 s for its
# RDMA listener, and set SERVER_PID, PORT, FP (its TLS fingerprint) and URL.
# Returns 1, with the server's log on stderr, if it did not start.
serve_data() {
  local dir=$1 log=$2
  shift 2
  PORT=$(( 20000 + RANDOM % 20000 ))
  "$LWIO" serve --export "data=$dir" --listen "127.0.0.1:$PORT" --provider soft "$@" >"$log" 2>&1 &
  SERVER_PID=$!
  for _ in $(seq 1 100); do grep -q "RDMA listening" "$log" && break; sleep 0.1; done
  FP=$(grep -o 'sha256:[0-9A-F:]*' "$log" | head -1)
  URL=lwio://127.0.0.1:$PORT/data
  [ -n "$FP" ] || { cat "$log" >&2; return 1; }
}
