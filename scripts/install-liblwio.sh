#!/usr/bin/env bash
# install-liblwio.sh - build liblwio and install it for C programs:
#   PREFIX/lib/liblwio.so, PREFIX/lib/liblwio.a, PREFIX/include/lwio.h,
#   PREFIX/lib/pkgconfig/lwio.pc   (then: cc prog.c $(pkg-config --cflags --libs lwio)),
#   PREFIX/lib/liblwio_preload.so  (LD_PRELOAD for programs on an `lwio mount`),
#   PREFIX/lib/lwio/liblwio_fio.so (fio --ioengine=external:...; built against
#                                   the installed fio: only where fio is installed)
#
# usage: scripts/install-liblwio.sh [PREFIX]    (default /usr/local)
# env:   PROFILE=debug|release (default release), CARGO_TARGET_DIR
set -euo pipefail
cd "$(dirname "$0")/.."
PREFIX=${1:-/usr/local}
PROFILE=${PROFILE:-release}
flag=(); [ "$PROFILE" = release ] && flag=(--release)
cargo build -q "${flag[@]}" -p lwio-capi -p lwio-preload
T=${CARGO_TARGET_DIR:-target}/$PROFILE
VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
install -d "$PREFIX/lib/pkgconfig" "$PREFIX/include"
install -m 0755 "$T/liblwio.so" "$PREFIX/lib/liblwio.so"
install -m 0644 "$T/liblwio.a" "$PREFIX/lib/liblwio.a"
install -m 0755 "$T/liblwio_preload.so" "$PREFIX/lib/liblwio_preload.so"
install -m 0644 crates/capi/include/lwio.h "$PREFIX/include/lwio.h"
sed -e "s|@PREFIX@|$PREFIX|" -e "s|@VERSION@|$VERSION|" crates/capi/lwio.pc.in >"$PREFIX/lib/pkgconfig/lwio.pc"
if command -v fio >/dev/null; then
  # Built against this machine's fio (crates/capi/fio/build.sh).
  PROFILE=$PROFILE crates/capi/fio/build.sh >/dev/null
  install -d "$PREFIX/lib/lwio"
  install -m 0755 "$T/liblwio_fio.so" "$PREFIX/lib/lwio/liblwio_fio.so"
  echo "installed the fio engine: fio --ioengine=external:$PREFIX/lib/lwio/liblwio_fio.so"
else
  echo "fio is not installed: the fio engine (liblwio_fio.so) was not built"
fi
echo "installed liblwio $VERSION in $PREFIX"
