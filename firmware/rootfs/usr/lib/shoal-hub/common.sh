# Shared by the hub's root scripts (apply, health): paths and the status file the page
# shows. Sourced, not run.
# (The suite's test of these scripts points them at folders of its own, and replaces
# systemctl, with SHOAL_HUB_*; systemd starts them with none of these set.)
# Bytes, not characters: lengths, ranges and classes below count and match bytes
# whatever locale systemd or a shell gave.
export LC_ALL=C
# The appliance folder is root's (the node may read it: status.json); the node writes
# only in its inbox. Root never writes in the inbox, and reads its files only as
# copies it made there without following links (`take`).
APPLIANCE=${SHOAL_HUB_APPLIANCE:-/var/lib/shoal/appliance}
INBOX=$APPLIANCE/inbox
# Root's copies of the inbox's files, checked where the node cannot swap them.
TAKEN=$APPLIANCE/.taken
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
# A regular file (not a link, not a device), or nothing.
regular() { [ -f "$1" ] && [ ! -L "$1" ]; }
# Whether the appliance folder is root's and no one else may write in it (else the
# node could make root write through a link: nothing is done then).
appliance_is_roots() {
  [ -d "$APPLIANCE" ] && [ ! -L "$APPLIANCE" ] \
    && [ "$(stat -c %u "$APPLIANCE")" = 0 ] && [ $(( 0$(stat -c %a "$APPLIANCE") & 022 )) = 0 ]
}
# Copy the inbox's file $1 into $TAKEN and print the copy's path; nothing (and no
# copy) unless it is a regular file. cp -P opens it with O_NOFOLLOW: a link the node
# plants meanwhile is copied as a link, which `regular` then refuses.
take() {
  local copy=$TAKEN/$1
  install -d -m 0700 "$TAKEN" || return 1
  rm -f -- "$copy"
  cp -P --preserve=mode -- "$INBOX/$1" "$copy" 2>/dev/null || return 1
  if regular "$copy"; then echo "$copy"; else rm -f -- "$copy"; return 1; fi
}
# Change status.json with a jq program (and its --arg/--argjson), in root's folder.
status_update() {
  local f=$APPLIANCE/status.json tmp old='{}'
  # Never a temporary file in a folder someone else may write in.
  appliance_is_roots || { log "$APPLIANCE is not root's alone: status not written"; return 1; }
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
