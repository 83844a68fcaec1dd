#!/usr/bin/env bash
#! Shoal's main job on the embedded default, from a fresh Debian machine with Rust:
#! installs what the demo needs (build tools, the small test model), builds, and runs
#! the demo — a local cluster of three nodes on loopback splits the small test model
#! and answers a question — then prints what each phase took. Extra arguments go to
#! `shoal demo` (e.g. --once to stop after the answer, --prompt "…" -n 200).
#!
#! It builds the binary the test suite tests (Cargo's dev profile, with llama.cpp and the
#! hashing optimised: see Cargo.toml), so the README's two commands share one build; a
#! release build (`cargo build --release`, ~10 min more here) decodes ~15% faster.
set -euo pipefail
cd "$(dirname "$0")/.."

now() { date +%s.%N; }
secs() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f", b - a }'; }

t0=$(now)
scripts/setup.sh --demo
t1=$(now)
cargo build --locked -p shoal --bin shoal
t2=$(now)
# The build's own phases are timed here; the demo times the rest and prints them all.
exec cargo run --quiet --locked -p shoal --bin shoal -- demo \
  --phase "set-up=$(secs "$t0" "$t1")" --phase "build=$(secs "$t1" "$t2")" "$@"
