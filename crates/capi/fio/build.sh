#!/usr/bin/env bash
# build.sh - build liblwio_fio.so, the fio ioengine for lwio
# (fio --ioengine=external:/path/liblwio_fio.so; docs/capi.md, "fio").
#
# fio loads an external engine with dlopen and checks FIO_IOOPS_VERSION, so
# the engine is compiled against the headers of the very fio that runs it.
# Debian ships no fio headers: this fetches the source package of the
# installed fio (same version, Debian's patches applied) with apt-get
# source through the machine's own apt sources (a private apt state under
# the target dir: the system's sources and lists are not touched), runs its
# ./configure for config-host.h, and caches the tree in
# TARGET/fio-src/VERSION, so a rebuild downloads nothing. liblwio is linked
# in statically: the .so needs nothing else at run time.
#
# usage: crates/capi/fio/build.sh
# env:   PROFILE=debug|release (default release)   CARGO_TARGET_DIR
#        FIO_SRC=DIR  a configured fio source tree of the installed fio's
#                     version (instead of fetching; for a fio not from Debian)
# prints the path of the engine (TARGET/PROFILE/liblwio_fio.so).
set -euo pipefail
cd "$(dirname "$0")/../../.."
ROOT=$PWD
PROFILE=${PROFILE:-release}
TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
case "$TARGET" in /*) ;; *) TARGET=$ROOT/$TARGET ;; esac
OUT=$TARGET/$PROFILE/liblwio_fio.so

die() { echo "build.sh: $*" >&2; exit 1; }
for p in fio cc; do
  command -v $p >/dev/null || die "$p is not installed (apt-get install fio gcc)"
done
FIO_VERSION=$(fio --version) # "fio-3.33"

fetch_fio_source() { # DEBVER DIR: the configured source tree in DIR/fio
  local debver=$1 dir=$2 apt tmp f
  command -v dpkg-source >/dev/null || die "dpkg-source is not installed (apt-get install dpkg-dev)"
  echo "build.sh: fetching the source of fio $debver (once; cached in $dir)" >&2
  apt=$TARGET/fio-src/apt
  rm -rf "$apt" && mkdir -p "$apt/sources.list.d" "$apt/lists/partial" "$apt/cache/archives/partial"
  # The machine's apt sources of its own release (suites CODENAME*), as
  # deb-src entries.
  local codename; codename=$(. /etc/os-release && echo "${VERSION_CODENAME:-}")
  [ -n "$codename" ] || die "no VERSION_CODENAME in /etc/os-release"
  for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
    [ -f "$f" ] || continue
    sed -n "s/^[[:space:]]*deb[[:space:]]\(.*[[:space:]]${codename}[-[:space:]]\)/deb-src \1/p" "$f" >>"$apt/sources.list.d/src.list"
  done
  for f in /etc/apt/sources.list.d/*.sources; do
    [ -f "$f" ] && grep -Eq "^Suites:[[:space:]]*$codename([-[:space:]]|\$)" "$f" || continue
    sed 's/^Types:[[:space:]]*deb[[:space:]]*$/Types: deb-src/' "$f" >"$apt/sources.list.d/$(basename "$f")"
  done
  touch "$apt/sources.list"
  local opts=(-q -o "Dir::Etc::SourceList=$apt/sources.list" -o "Dir::Etc::SourceParts=$apt/sources.list.d"
    -o "Dir::State::Lists=$apt/lists" -o "Dir::Cache=$apt/cache" -o "APT::Sandbox::User=root")
  # A source that fails (a mirror without deb-src) is not fatal while
  # another has fio: apt-get source says.
  apt-get "${opts[@]}" update >"$apt/update.log" 2>&1 || { cat "$apt/update.log" >&2; echo "build.sh: apt-get update (deb-src) had errors" >&2; }
  tmp=$(mktemp -d "$TARGET/fio-src/tmp.XXXXXX")
  # apt checks the files against the signed Sources index; dpkg-source
  # against the .dsc.
  (cd "$tmp" && apt-get "${opts[@]}" source --download-only "fio=$debver" >download.log 2>&1 &&
    dpkg-source -x fio_*.dsc fio >extract.log 2>&1) ||
    { cat "$tmp"/*.log >&2; rm -rf "$tmp"; die "apt-get source fio=$debver failed"; }
  # Configured as Debian builds it (debian/rules), less the GUI and the
  # libraries not installed: none of that changes the structures an
  # engine sees.
  (cd "$tmp/fio" && ./configure --disable-native --prefix=/usr >../configure.log 2>&1) ||
    { cat "$tmp/configure.log" >&2; rm -rf "$tmp"; die "fio ./configure failed"; }
  rm -rf "$dir" && mv "$tmp" "$dir"
}

if [ -z "${FIO_SRC:-}" ]; then
  DEBVER=$(dpkg-query -W -f '${Version}' fio 2>/dev/null) ||
    die "fio is not a Debian package here: set FIO_SRC to a configured source tree of $FIO_VERSION"
  mkdir -p "$TARGET/fio-src"
  [ -f "$TARGET/fio-src/$DEBVER/fio/config-host.h" ] || fetch_fio_source "$DEBVER" "$TARGET/fio-src/$DEBVER"
  FIO_SRC=$TARGET/fio-src/$DEBVER/fio
fi
[ -f "$FIO_SRC/config-host.h" ] || die "$FIO_SRC/config-host.h is missing: run ./configure there"
SRC_VERSION=$(sed -n 's/^DEF_VER=//p' "$FIO_SRC/FIO-VERSION-GEN" 2>/dev/null | head -1)
case "$FIO_VERSION" in
  "${SRC_VERSION:-none}"*) ;;
  *) die "the fio source in $FIO_SRC is ${SRC_VERSION:-of no known version}, the installed fio is $FIO_VERSION" ;;
esac

flag=(); [ "$PROFILE" = release ] && flag=(--release)
cargo build -q "${flag[@]}" -p lwio-capi
LIB=$TARGET/$PROFILE/liblwio.a
[ -f "$LIB" ] || die "$LIB was not built"

# fio's own flags for its engines (Makefile), its config, and lwio.h; the
# Rust library's symbols stay inside the engine (--exclude-libs).
cc -std=gnu99 -O2 -g -fPIC -shared -Wall -Werror -Wdeclaration-after-statement \
  -D_GNU_SOURCE -D_LARGEFILE_SOURCE -D_FILE_OFFSET_BITS=64 -DBITS_PER_LONG="$(getconf LONG_BIT)" \
  -include "$FIO_SRC/config-host.h" -I"$FIO_SRC" -I"$ROOT/crates/capi/include" \
  -o "$OUT.tmp" "$ROOT/crates/capi/fio/liblwio_fio.c" "$LIB" -lpthread -ldl -lm -Wl,--exclude-libs,ALL
mv "$OUT.tmp" "$OUT"
echo "$OUT"
