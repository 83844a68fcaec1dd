#!/usr/bin/env bash
#! The whole test suite, from a fresh Debian machine with Rust: installs what is
#! missing (scripts/setup.sh), then runs every test of the workspace and ends with
#! one summary line over all test binaries.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
log=$(mktemp)
trap 'rm -f "$log"' EXIT
# llama.cpp is compiled optimised even in this dev-profile build (see Cargo.toml).
status=0
cargo test --workspace --locked "$@" 2>&1 | tee "$log" || status=$?
awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($(i+1) ~ /^passed/) p += $i; if ($(i+1) ~ /^failed/) f += $i } }
     END { printf "all tests: %d passed, %d failed\n", p, f }' "$log"
exit "$status"
