#!/bin/sh
# Install Shoal as a systemd service on any systemd Linux (Debian and Ubuntu users can
# take the .deb instead): the binary into /usr/local/bin, the unit the .deb ships, a
# `shoal` system user, data in /var/lib/shoal; the service is enabled and started.
#
#   sudo ./install.sh [--join TOKEN] [--root DIR] [PATH/TO/shoal]
#
# --join TOKEN  a join token from a member of your cluster (`shoal nodes token` there):
#               this PC joins it as soon as the service starts.
# --root DIR    write the files under DIR and start nothing (staging an image).
# The binary: the one given, else ./shoal beside this script, else `shoal` on PATH.
# It runs `shoal service install`, which `shoal service uninstall [--purge]` undoes.
set -eu

args="$*"
join=""
root=""
bin=""
while [ $# -gt 0 ]; do
    case "$1" in
        --join) [ $# -ge 2 ] || { echo "install.sh: --join needs a token" >&2; exit 2; }; join=$2; shift 2 ;;
        --root) [ $# -ge 2 ] || { echo "install.sh: --root needs a directory" >&2; exit 2; }; root=$2; shift 2 ;;
        -h|--help) sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        -*) echo "install.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
        *) bin=$1; shift ;;
    esac
done

if [ -z "$bin" ]; then
    here=$(dirname "$0")
    if [ -x "$here/shoal" ]; then
        bin="$here/shoal"
    elif command -v shoal >/dev/null 2>&1; then
        bin=$(command -v shoal)
    else
        echo "install.sh: no shoal binary: give its path, or put it beside this script" >&2
        exit 1
    fi
fi
if [ -z "$root" ]; then
    if [ "$(id -u)" -ne 0 ]; then
        echo "install.sh: installing a service needs root: sudo $0 $args" >&2
        exit 1
    fi
    if [ ! -d /run/systemd/system ]; then
        echo "install.sh: this system does not run systemd; start \`shoal serve\` from your init system instead" >&2
        exit 1
    fi
fi

set -- service install
[ -n "$join" ] && set -- "$@" --join "$join"
[ -n "$root" ] && set -- "$@" --root "$root"
exec "$bin" "$@"
