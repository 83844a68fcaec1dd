#!/usr/bin/env bash
#! Shoal's main job on the embedded default, from a fresh Debian machine with Rust:
#! installs what is missing, builds, and runs the demo — the small test model split
#! into three stages, answering a question. Extra arguments go to `shoal demo`
#! (e.g. --prompt "…" -n 200).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cargo run --release --locked -p shoal -- demo "$@"
