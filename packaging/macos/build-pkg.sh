#!/bin/sh
# Build Shoal's macOS installer (on a Mac with Xcode's command line tools) into
# target/dist: shoal-VERSION-macos-ARCH.pkg and its .sha256. It installs
# /usr/local/bin/shoal and the launchd daemon dev.shoal.node (RunAtLoad, restarted on
# failure, a background process; data in /Library/Application Support/Shoal), and
# loads it. `sudo shoal service uninstall [--purge]` removes it.
#
#   packaging/macos/build-pkg.sh [aarch64-apple-darwin|x86_64-apple-darwin]
#
# Apple silicon builds use Metal (the `metal` feature); Intel builds the CPU.
set -eu
cd "$(dirname "$0")/../.."

target=${1:-aarch64-apple-darwin}
case "$target" in
    aarch64-apple-darwin) arch=arm64; features="--features metal" ;;
    x86_64-apple-darwin) arch=x86_64; features="" ;;
    *) echo "build-pkg.sh: unknown target $target" >&2; exit 2 ;;
esac
version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -n1)
SHOAL_GIT_COMMIT=$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)
export SHOAL_GIT_COMMIT
# shellcheck disable=SC2086
cargo build --release --locked -p shoal --bin shoal --target "$target" $features

payload=$(mktemp -d)
scripts=$(mktemp -d)
trap 'rm -rf "$payload" "$scripts"' EXIT
install -d "$payload/usr/local/bin" "$payload/Library/LaunchDaemons"
install -m 755 "target/$target/release/shoal" "$payload/usr/local/bin/shoal"
install -m 644 packaging/macos/dev.shoal.node.plist "$payload/Library/LaunchDaemons/dev.shoal.node.plist"
install -m 755 packaging/macos/postinstall "$scripts/postinstall"

mkdir -p target/dist
pkg="target/dist/shoal-$version-macos-$arch.pkg"
pkgbuild --root "$payload" --scripts "$scripts" --identifier dev.shoal.node --version "$version" \
    --install-location / "$pkg"
(cd target/dist && shasum -a 256 "$(basename "$pkg")" > "$(basename "$pkg").sha256")
ls -l target/dist
