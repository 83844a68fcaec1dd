#!/usr/bin/env bash
#! The whole test suite, from a fresh Debian machine with Rust: installs what is
#! missing (scripts/setup.sh), then runs every test of the workspace and ends with
#! one summary line over all test binaries; then every fuzz target runs for a short time
#! (SHOAL_FUZZ_SECS, default 20; 0 skips).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# The suite needs ~8 GB under target/ (and /tmp for shards); on a shared disk, say up
# front how much there is, so that "No space left on device" has its cause beside it.
df -h . /tmp 2>/dev/null | awk 'NR == 1 || !seen[$0]++' | sed 's/^/disk: /' || true
log=$(mktemp)
trap 'rm -f "$log"' EXIT
# llama.cpp is compiled optimised even in this dev-profile build (see Cargo.toml).
status=0
cargo test --workspace --locked "$@" 2>&1 | tee "$log" || status=$?
# Every fuzz target for a short time (issue 15): parsers of network input and of files.
# Where no nightly toolchain can be had, it says so and the suite goes on.
fuzz_secs=${SHOAL_FUZZ_SECS:-20}
if [ "$fuzz_secs" -gt 0 ]; then
  SHOAL_FUZZ_OPTIONAL=1 SHOAL_FUZZ_TARGET="${SHOAL_FUZZ_TARGET:-$HOME/.cache/shoal/fuzz-target}" \
    scripts/fuzz.sh "$fuzz_secs" 2>&1 | tee -a "$log" || status=$?
fi
awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($(i+1) ~ /^passed/) p += $i; if ($(i+1) ~ /^failed/) f += $i } }
     END { printf "all tests: %d passed, %d failed\n", p, f }' "$log"
exit "$status"
