#!/usr/bin/env bash
# build-deb.sh - build the lwio Debian package: target/debian/lwio_VERSION-1_ARCH.deb
#
# Release builds of lwio, liblwio.so, liblwio_preload.so and the fio engine
# liblwio_fio.so (crates/capi/fio/build.sh: needs fio, gcc, dpkg-dev); the man pages,
# completions and lwio.pc into target/release/pkg/; then cargo-deb with the
# metadata of crates/lwio/Cargo.toml. Extra arguments go to `cargo deb`.
# Needs cargo-deb (`cargo install cargo-deb`).
set -euo pipefail
cd "$(dirname "$0")/.."
command -v cargo-deb >/dev/null || { echo "build-deb.sh: cargo-deb is missing: cargo install cargo-deb" >&2; exit 1; }
cargo build --release -p lwio --bin lwio
cargo build --release -p lwio-capi -p lwio-preload --lib
# The fio engine, built against this machine's fio (Debian's: the package
# is for the same release); needs fio, gcc and dpkg-dev.
PROFILE=release crates/capi/fio/build.sh >/dev/null
T=${CARGO_TARGET_DIR:-target}/release
rm -rf "$T/pkg"
"$T/lwio" generate man "$T/pkg/man" >/dev/null
gzip -9n "$T"/pkg/man/*
"$T/lwio" generate completions "$T/pkg/completions" >/dev/null
VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
sed -e "s|@PREFIX@|/usr|" -e "s|@VERSION@|$VERSION|" crates/capi/lwio.pc.in >"$T/pkg/lwio.pc"
# Stripped: the release profile keeps line tables (debug = 1).
cargo deb -p lwio --no-build --strip "$@"
