#!/usr/bin/env bash
#! Shoal's main job on the embedded default, from a fresh Debian machine with Rust:
#! installs what is missing, builds, and runs the demo — a local cluster of three
#! nodes on loopback splits the small test model and answers a question. Extra
#! arguments go to `shoal demo` (e.g. --prompt "…" -n 200, or --in-process).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cargo run --release --locked -p shoal -- demo "$@"
