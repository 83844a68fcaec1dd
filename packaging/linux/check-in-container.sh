#!/bin/bash
# Runs inside a Debian root booted under systemd (systemd-nspawn --boot) with the shoal
# package installed: the package test (daemon/shoal/tests/package.rs) installs it as
# the oneshot unit shoal-check.service, reads what it prints from
# /var/log/shoal-check, and checks it. It waits for shoal.service to be ready, asks
# /health, SIGKILLs the node and waits for systemd to restart it, asks again, stops the
# service (timed), and powers the container off.
set -u
exec > /var/log/shoal-check 2>&1

# The first line of an HTTP answer to GET /health, from bash's /dev/tcp (nothing to
# install in a minimal root); "none" when nothing answers within 30 s.
health() {
    local addr port line
    for _ in $(seq 60); do
        # (The braces keep the 2>/dev/null off the script's own stderr: exec would
        # make it permanent.)
        if addr=$(cat /var/lib/shoal/http 2>/dev/null) && port=${addr##*:} \
            && { exec 3<>"/dev/tcp/127.0.0.1/$port"; } 2>/dev/null; then
            printf 'GET /health HTTP/1.0\r\nHost: localhost\r\n\r\n' >&3
            IFS= read -r -t 10 line <&3 || line="no answer"
            exec 3>&-
            echo "${line%$'\r'}"
            return
        fi
        sleep 0.5
    done
    echo none
}

show() { systemctl show -p "$1" --value shoal.service; }

for _ in $(seq 120); do
    [ "$(systemctl is-active shoal.service)" = active ] && break
    sleep 0.5
done
echo "active=$(systemctl is-active shoal.service)"
echo "status=$(show StatusText)"
echo "user=$(stat -c %U "/proc/$(show MainPID)")"
pid=$(show MainPID)
echo "pid1=$pid"
echo "health1=$(health)"
echo "cluster=$(SHOAL_DATA_DIR=/var/lib/shoal runuser -u shoal -- shoal status --json | tr -d '\n ')"
kill -9 "$pid"
for _ in $(seq 120); do
    now=$(show MainPID)
    if [ "$now" != "$pid" ] && [ "$now" != 0 ] && [ "$(systemctl is-active shoal.service)" = active ]; then
        break
    fi
    sleep 0.5
done
echo "pid2=$(show MainPID)"
echo "restarts=$(show NRestarts)"
echo "health2=$(health)"
echo "watchdog_usec=$(show WatchdogUSec)"
echo "watchdog_ping=$(show WatchdogTimestampMonotonic)"
t0=$(date +%s%N)
systemctl stop shoal.service
t1=$(date +%s%N)
echo "stop_ms=$(((t1 - t0) / 1000000))"
echo "result=$(show Result)"
echo "done"
systemctl poweroff
