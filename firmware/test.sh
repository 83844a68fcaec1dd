#!/usr/bin/env bash
# The hub image's acceptance test (opt-in: ~20 min, beyond the suite's time): installs
# what it needs from Debian's packages, then builds the image from this checkout's
# Shoal and boots it under qemu (daemon/shoal/tests/hub_image.rs says what it checks).
# As root:   firmware/test.sh
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
need=()
for t in qemu-system-x86_64:qemu-system-x86 mmdebstrap:mmdebstrap rauc:rauc mcopy:mtools \
         mkfs.vfat:dosfstools sfdisk:fdisk mksquashfs:squashfs-tools dnsmasq:dnsmasq-base \
         grub-editenv:grub-common openssl:openssl; do
  command -v "${t%%:*}" >/dev/null 2>&1 || need+=("${t#*:}")
done
[ -e /usr/share/OVMF/OVMF_CODE_4M.fd ] || need+=(ovmf)
if [ ${#need[@]} -gt 0 ]; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${need[@]}"
fi
# The test is #[ignore]d in the suite (it takes ~20 min); --ignored runs it, and a
# missing precondition (not root, a tool) fails it rather than passing silently.
cargo test --locked -p shoal --test hub_image -- --ignored --nocapture
