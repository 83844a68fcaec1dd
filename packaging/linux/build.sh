#!/bin/sh
# Build Shoal's release artifacts for Linux into target/dist: the binary
# (shoal-VERSION-linux-ARCH) and the .deb, each with a .sha256 beside it.
#
#   packaging/linux/build.sh [--features vulkan|cuda]
#
# The release profile (Cargo.toml): LTO, one codegen unit, stripped. GPU builds need
# their toolkit where this runs (see packaging/linux/README.md); `shoal --version`
# lists the backends a binary has.
set -eu
cd "$(dirname "$0")/../.."

features=""
suffix=""
if [ "${1:-}" = "--features" ]; then
    [ $# -ge 2 ] || { echo "build.sh: --features needs a list" >&2; exit 2; }
    features=$2
    suffix="-$(echo "$2" | tr ',' '-')"
fi

version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -n1)
arch=$(uname -m)
SHOAL_GIT_COMMIT=$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)
export SHOAL_GIT_COMMIT
if [ -n "$features" ]; then
    cargo build --release --locked -p shoal --bin shoal --features "$features"
else
    cargo build --release --locked -p shoal --bin shoal
fi
mkdir -p target/dist
bin="target/dist/shoal-$version-linux-$arch$suffix"
cp target/release/shoal "$bin"
if [ -n "$features" ]; then
    cargo deb -p shoal --no-build --features "$features" -o "target/dist/shoal${suffix}_${version}-1_$(dpkg --print-architecture).deb"
else
    cargo deb -p shoal --no-build -o "target/dist/shoal_${version}-1_$(dpkg --print-architecture).deb"
fi
cd target/dist
for f in *; do
    case "$f" in *.sha256) continue ;; esac
    sha256sum "$f" > "$f.sha256"
done
ls -l
