#!/usr/bin/env bash
#! The whole test suite, from a fresh Debian machine with Rust: installs what is
#! missing (scripts/setup.sh), then runs every test of the workspace.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# llama.cpp is compiled optimised even in this dev-profile build (see Cargo.toml).
cargo test --workspace --locked "$@"
