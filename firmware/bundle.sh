#!/usr/bin/env bash
# Make a signed RAUC update bundle of the hub's system from a root image.
#
#   firmware/bundle.sh --rootfs rootfs.sqfs --arch amd64|arm64 --version V
#                      --signing-key KEY --signing-cert CERT --out FILE.raucb
#
# The box installs it into the slot it is not running from and boots that slot once on
# trial (firmware/README.md): `firmware/build.sh` makes one beside every image, the
# page's "Install update" takes it, `rauc info --keyring CERT FILE` shows what it holds.
set -euo pipefail
rootfs="" arch="" version="" key="" cert="" out=""
while [ $# -gt 0 ]; do
  case "$1" in
    --rootfs) rootfs=$2; shift 2 ;;
    --arch) arch=$2; shift 2 ;;
    --version) version=$2; shift 2 ;;
    --signing-key) key=$2; shift 2 ;;
    --signing-cert) cert=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    *) echo "bundle.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
for v in rootfs arch version key cert out; do
  [ -n "${!v}" ] || { echo "bundle.sh: --${v/key/signing-key} is missing" >&2; exit 2; }
done
[ "$cert" != "" ] && [ -f "$cert" ] || { echo "bundle.sh: no certificate at $cert" >&2; exit 2; }
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
# The root goes in as it is (no copy: a hard link where the file system allows).
ln "$rootfs" "$dir/rootfs.img" 2>/dev/null || cp "$rootfs" "$dir/rootfs.img"
cat > "$dir/manifest.raucm" <<MANIFEST
[update]
compatible=shoal-hub-$arch
version=$version
description=Shoal hub system $version

[bundle]
format=verity

[image.rootfs]
filename=rootfs.img
MANIFEST
rm -f "$out"
rauc bundle --cert "$cert" --key "$key" "$dir" "$out" >/dev/null
echo "bundle: $out ($(du -h "$out" | cut -f1), version $version)"
