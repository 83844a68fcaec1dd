#!/usr/bin/env bash
# Build the hub box's disk image (and its first update bundle) from Debian's packages.
#
#   firmware/build.sh [--arch amd64|arm64] [--deb FILE] [--out DIR] [--version V]
#                     [--signing-key KEY --signing-cert CERT]
#
# Output in DIR (default target/firmware/ARCH): shoal-hub-ARCH.img (a raw GPT disk
# image: write it to the box's disk with dd or a flasher), rootfs.sqfs (the system, the
# same bytes slot A holds), shoal-hub-ARCH-V.raucb (the same system as a signed update
# bundle) and build.log. Runs as root (the root file system's owners), ~3-5 min.
#
# How (see firmware/README.md): mmdebstrap makes the root as a directory, with the
# .deb of Shoal and this folder's rootfs/ overlay; the disk is then assembled offline,
# without mounting anything (this machine kind's kernel has no vfat): mksquashfs for
# the read-only root, mke2fs -d for the data partition, mkfs.vfat + mtools for the
# EFI system partition (GRUB, its A/B script and environment), sfdisk + dd for the
# partition table. The result boots on UEFI machines and under qemu with OVMF.
#
# Update bundles are signed: without --signing-key/--signing-cert, a development key
# pair is made once in ~/.cache/shoal/firmware-keys (kept outside the repository); the
# image trusts the certificate it was built with.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/.." && pwd)

arch=$(dpkg --print-architecture)
deb=""
out=""
version=""
key=""
cert=""
suite=bookworm
mirror=${SHOAL_DEBIAN_MIRROR:-http://deb.debian.org/debian}
while [ $# -gt 0 ]; do
  case "$1" in
    --arch) arch=$2; shift 2 ;;
    --deb) deb=$(realpath "$2"); shift 2 ;;
    --out) out=$2; shift 2 ;;
    --version) version=$2; shift 2 ;;
    --signing-key) key=$(realpath "$2"); shift 2 ;;
    --signing-cert) cert=$(realpath "$2"); shift 2 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "build.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
say() { printf 'firmware: %s\n' "$*" >&2; }
die() { say "$*"; exit 1; }

case "$arch" in
  amd64) efi_target=x86_64-efi; efi_name=BOOTX64.EFI; console=ttyS0 ;;
  arm64) efi_target=arm64-efi; efi_name=BOOTAA64.EFI; console=ttyAMA0 ;;
  *) die "--arch $arch: amd64 or arm64" ;;
esac
[ "$(id -u)" = 0 ] || die "needs root (the root file system's owners and modes)"
out=${out:-$repo/target/firmware/$arch}
mkdir -p "$out"
out=$(realpath "$out")
started=$(date +%s)

# Host tools, from Debian's packages.
need=()
for t in mmdebstrap:mmdebstrap mksquashfs:squashfs-tools mke2fs:e2fsprogs mkfs.vfat:dosfstools \
         mcopy:mtools sfdisk:fdisk rauc:rauc openssl:openssl grub-editenv:grub-common; do
  command -v "${t%%:*}" >/dev/null 2>&1 || need+=("${t#*:}")
done
if [ "$arch" != "$(dpkg --print-architecture)" ]; then
  # Maintainer scripts of a foreign root run under qemu's user-mode emulation.
  [ -e /usr/bin/qemu-aarch64-static ] || need+=(qemu-user-static binfmt-support)
fi
if [ ${#need[@]} -gt 0 ]; then
  say "installing ${need[*]} (Debian's packages)"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${need[@]}" >&2
fi

# Shoal's package: given, or built from this checkout (release profile).
if [ -z "$deb" ]; then
  [ "$arch" = "$(dpkg --print-architecture)" ] || die "--arch $arch needs --deb FILE (a Shoal .deb built for $arch)"
  say "building Shoal's .deb (release profile)"
  (cd "$repo" && cargo build --release --locked -p shoal --bin shoal >&2 && \
     cargo deb -p shoal --no-build --quiet -o "$out/shoal.deb" >&2)
  deb=$out/shoal.deb
fi
[ -f "$deb" ] || die "no .deb at $deb"
deb_arch=$(dpkg-deb -f "$deb" Architecture)
[ "$deb_arch" = "$arch" ] || die "$deb is for $deb_arch, not $arch"
shoal_version=$(dpkg-deb -f "$deb" Version)
version=${version:-$shoal_version}

# Signing key pair of update bundles.
if [ -z "$key$cert" ]; then
  keys=${SHOAL_FIRMWARE_KEYS:-$HOME/.cache/shoal/firmware-keys}
  key=$keys/dev.key.pem
  cert=$keys/dev.cert.pem
  if [ ! -f "$key" ] || [ ! -f "$cert" ]; then
    say "making a development signing key in $keys (use --signing-key/--signing-cert for releases)"
    mkdir -p "$keys" && chmod 700 "$keys"
    openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 36500 \
      -subj "/O=Shoal development/CN=Shoal hub update signing (development)" \
      -keyout "$key" -out "$cert" 2>/dev/null
  fi
fi
[ -f "$key" ] && [ -f "$cert" ] || die "--signing-key and --signing-cert go together"

# Reproducible where the tools allow: fixed times, UUIDs and hash seeds.
export SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-$(cd "$repo" && git log -1 --format=%ct 2>/dev/null || date +%s)}
export E2FSPROGS_FAKE_TIME=$SOURCE_DATE_EPOCH

work=$(mktemp -d "$out/.work.XXXXXX")
trap 'rm -rf "$work"' EXIT
root=$work/root
cp "$deb" "$work/shoal.deb"
cp "$cert" "$work/keyring.pem"

packages=(
  systemd systemd-sysv udev dbus systemd-resolved systemd-timesyncd
  "linux-image-$arch" initramfs-tools kmod
  rauc rauc-service "grub-efi-$arch-bin" grub-common e2fsprogs
  iwd wireless-regdb tzdata ca-certificates curl jq iproute2 nftables
)
# Shoal's own dependencies (its Depends, alternatives and versions aside) come in with
# the rest; the .deb itself is installed by dpkg in the root.
IFS=, read -r -a shoal_deps <<< "$(dpkg-deb -f "$deb" Depends | sed 's/([^)]*)//g; s/|[^,]*//g; s/ //g')"
packages+=("${shoal_deps[@]}")
say "making the root (mmdebstrap, $suite, $arch)"
mmdebstrap --variant=minbase --architectures="$arch" --include="$(IFS=,; echo "${packages[*]}")" \
  --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
  --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/locale/*' \
  --dpkgopt='path-exclude=/usr/share/info/*' \
  --customize-hook="copy-in '$work/shoal.deb' /tmp" \
  --customize-hook='chroot "$1" env DEBIAN_FRONTEND=noninteractive dpkg -i /tmp/shoal.deb' \
  --customize-hook='rm -f "$1/tmp/shoal.deb"' \
  --customize-hook="sync-in '$here/rootfs' /" \
  --customize-hook="copy-in '$work/keyring.pem' /etc/rauc" \
  --customize-hook="chroot \"\$1\" /usr/lib/shoal-hub/image-setup '$version' '$arch'" \
  "$suite" "$root" "$mirror" >"$out/build.log" 2>&1 \
  || { tail -n 40 "$out/build.log" >&2; die "mmdebstrap failed (whole log: $out/build.log)"; }

# The ESP: GRUB (one EFI file with its modules inside), the A/B script, the environment.
say "assembling the disk offline"
cat > "$work/stub.cfg" <<'CFG'
# Embedded in GRUB's EFI file: go on with the A/B script on the partition it came from.
regexp --set 1:esp '^[(]([^)]*)[)]' "$cmdpath"
set root=$esp
configfile /EFI/shoal/grub.cfg
CFG
cp "$work/stub.cfg" "$root/tmp/stub.cfg"
chroot "$root" grub-mkstandalone -O "$efi_target" -o "/tmp/$efi_name" \
  --modules="part_gpt fat squash4 ext2 regexp loadenv test echo linux normal configfile search" \
  --locales= --themes= --fonts= "boot/grub/grub.cfg=/tmp/stub.cfg"
mv "$root/tmp/$efi_name" "$work/$efi_name"
rm -f "$root/tmp/stub.cfg"
grub-editenv "$work/grubenv" create
grub-editenv "$work/grubenv" set ORDER="A B" A_OK=1 A_TRY=0 B_OK=0 B_TRY=0
sed "s/@CONSOLE@/$console/" "$here/grub.cfg" > "$work/grub.cfg"
esp=$work/esp.img
mkfs.vfat -C -n SHOAL-BOOT -i 5348414c "$esp" $((64 * 1024)) >/dev/null
mmd -i "$esp" ::/EFI ::/EFI/BOOT ::/EFI/shoal
mcopy -i "$esp" "$work/$efi_name" "::/EFI/BOOT/$efi_name"
mcopy -i "$esp" "$work/grub.cfg" "$work/grubenv" ::/EFI/shoal/
printf 'Shoal hub boot partition. Put an empty file named shoal-factory-reset here to\r\nerase all settings and data at the next boot (back to first setup).\r\n' > "$work/README.TXT"
mcopy -i "$esp" "$work/README.TXT" ::/README.TXT

# The read-only root (squashfs: GRUB reads the kernel from it) and the data partition
# (ext4 from the skeleton the factory reset also uses).
rm -rf "$root/tmp/"* "$root/var/tmp/"* "$root/var/cache/apt/"*.bin "$root/var/lib/apt/lists/"*
mksquashfs "$root" "$out/rootfs.sqfs" -noappend -comp xz -no-progress -quiet -reproducible >/dev/null
data=$work/data.img
mke2fs -q -t ext4 -L shoal-data -U 5348414c-0000-4000-8000-000000000004 -E hash_seed=5348414c-0000-4000-8000-0000000000aa \
  -d "$root/usr/lib/shoal-hub/data-skeleton" "$data" 256M

# GPT: ESP, root A, root B, data (fixed ids: the same inputs give the same table).
mib=$((1024 * 1024))
slot_mib=1024
root_mib=$(( ($(stat -c %s "$out/rootfs.sqfs") + mib - 1) / mib ))
[ "$root_mib" -lt "$slot_mib" ] || die "the root ($root_mib MiB) does not fit a ${slot_mib} MiB slot"
img=$out/shoal-hub-$arch.img
rm -f "$img"
total_mib=$((1 + 64 + 2 * slot_mib + 256 + 1))
truncate -s "${total_mib}M" "$img"
sfdisk --quiet "$img" <<TABLE
label: gpt
label-id: 5348414C-0000-4000-8000-000000000000
start=1MiB, size=64MiB, type=C12A7328-F81F-11D2-BA4B-00A0C93EC93B, name="esp", uuid=5348414C-0000-4000-8000-000000000001
size=${slot_mib}MiB, type=0FC63DAF-8483-4772-8E79-3D69D8477DE4, name="root-a", uuid=5348414C-0000-4000-8000-000000000002
size=${slot_mib}MiB, type=0FC63DAF-8483-4772-8E79-3D69D8477DE4, name="root-b", uuid=5348414C-0000-4000-8000-000000000003
size=256MiB, type=0FC63DAF-8483-4772-8E79-3D69D8477DE4, name="data", uuid=5348414C-0000-4000-8000-000000000004
TABLE
dd if="$esp" of="$img" bs=1M seek=1 conv=notrunc,sparse status=none
dd if="$out/rootfs.sqfs" of="$img" bs=1M seek=65 conv=notrunc,sparse status=none
dd if="$data" of="$img" bs=1M seek=$((65 + 2 * slot_mib)) conv=notrunc,sparse status=none

# The same system as a signed update bundle.
"$here/bundle.sh" --rootfs "$out/rootfs.sqfs" --arch "$arch" --version "$version" \
  --signing-key "$key" --signing-cert "$cert" --out "$out/shoal-hub-$arch-$version.raucb" >&2

say "done in $(( $(date +%s) - started )) s: $img ($(du -h --apparent-size "$img" | cut -f1), $(du -h "$img" | cut -f1) used), root $root_mib MiB, Shoal $shoal_version"
echo "$img"
