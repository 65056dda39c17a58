#!/usr/bin/env bash
# scripts/client-deps-check.sh - an application that depends on the client
# crate alone must build without io_uring, argon2 or rcgen in its tree (issue
# 11): those belong to the server (io_uring storage backend, password
# hashing, certificate generation). Checks lwio-client's tree as such an
# application gets it: normal and build dependencies, default features, every
# target platform. Exit 1 and print the paths that pull one in.
set -euo pipefail
cd "$(dirname "$0")/.."
FORBIDDEN='io-uring|argon2|rcgen'
tree=$(cargo tree -p lwio-client -e normal,build --target all --prefix none --format '{p}')
if bad=$(grep -E "^($FORBIDDEN) " <<<"$tree" | sort -u) && [ -n "$bad" ]; then
  echo "lwio-client's dependency tree contains:" >&2
  echo "$bad" >&2
  for c in $(awk '{print $1}' <<<"$bad" | sort -u); do
    cargo tree -p lwio-client -e normal,build --target all -i "$c" >&2 || true
  done
  exit 1
fi
# Nor the RDMA crate's tool parts (the conformance suite, the benchmarks).
feats=$(cargo tree -p lwio-client -e normal,build,features --target all --prefix none --format '{p} {f}' |
  grep -E '^lwio-rdma ' | sort -u)
if grep -qE 'conformance|perf' <<<"$feats"; then
  echo "lwio-client's lwio-rdma has its tool features on: $feats" >&2
  exit 1
fi
echo "lwio-client: $(sort -u <<<"$tree" | wc -l) crates, none of io-uring, argon2, rcgen; lwio-rdma without conformance or perf"
