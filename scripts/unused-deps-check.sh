#!/usr/bin/env bash
# scripts/unused-deps-check.sh - no crate of the workspace (nor the fuzz
# crate) declares a dependency it does not use (issue 32): runs cargo-machete
# over the tree. --with-metadata asks cargo for each dependency's library
# name (md-5 is `md5`), so renamed crates are matched correctly; it may
# refresh a Cargo.lock that is out of date, never one that is current.
# A real false positive (a crate used only through a macro's expansion, say)
# goes in that crate's `[package.metadata.cargo-machete] ignored` list with a
# comment saying why. Exit 1 and name the crate and dependency otherwise.
# Needs cargo-machete: `cargo install cargo-machete --locked`.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! cargo machete --version >/dev/null 2>&1; then
  echo "cargo-machete is not installed: cargo install cargo-machete --locked" >&2
  exit 2
fi
cargo machete --with-metadata "$@"
