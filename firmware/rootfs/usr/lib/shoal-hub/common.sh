# Shared by the hub's root scripts (apply, health): paths and the status file the page
# shows. Sourced, not run.
# (The suite's test of these scripts points them at folders of its own, and replaces
# systemctl, with SHOAL_HUB_*; systemd starts them with none of these set.)
# Bytes, not characters: lengths, ranges and classes below count and match bytes
# whatever locale systemd or a shell gave.
export LC_ALL=C
APPLIANCE=${SHOAL_HUB_APPLIANCE:-/var/lib/shoal/appliance}
HUB=${SHOAL_HUB_DATA:-/data/hub}
ZONEINFO=${SHOAL_HUB_ZONEINFO:-/usr/share/zoneinfo}
SYSTEMCTL=${SHOAL_HUB_SYSTEMCTL:-systemctl}
# Which system slot runs: A or B (GRUB puts rauc.slot= on the kernel's command line).
booted_slot() { sed -n 's/.*rauc\.slot=\([AB]\).*/\1/p' /proc/cmdline; }
other_slot() { if [ "$(booted_slot)" = A ]; then echo B; else echo A; fi; }
log() { echo "shoal-hub: $*" >&2; }
# Whether every byte of $1 is printable ASCII (0x20-0x7e: no newline, tab or other
# control, nothing past 0x7e; LC_ALL=C above makes the range one of bytes).
printable() { case $1 in *[!\ -~]*) return 1 ;; esac; }
# A regular file (not a link, not a device) the node wrote, or nothing.
regular() { [ -f "$1" ] && [ ! -L "$1" ]; }
# Change status.json with a jq program (and its --arg/--argjson): read whatever is
# there (the node cannot make us follow a link: the new file is renamed over it).
status_update() {
  local f=$APPLIANCE/status.json tmp old='{}'
  if regular "$f" && jq -e 'type == "object"' "$f" >/dev/null 2>&1; then old=$(cat "$f"); fi
  tmp=$(mktemp "$APPLIANCE/.status.XXXXXX") || return 1
  if printf '%s' "$old" | jq "$@" > "$tmp"; then
    chmod 0644 "$tmp" && mv -f "$tmp" "$f"
  else
    rm -f "$tmp"; return 1
  fi
}
# The update's state: none|installing|installed|good|failed|rolled-back, and why.
update_state() {
  status_update --arg s "$1" --arg m "$2" '.update = {state: $s, message: $m, at: (now | floor)}'
}
