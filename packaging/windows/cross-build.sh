#!/bin/sh
# Cross-build shoal.exe for Windows (x86_64-pc-windows-gnu) on Debian 12, with
# Debian's MinGW-w64: what this repository's CI machine can do to show the product
# builds for Windows (a release for users is better built on Windows, or with a newer
# MinGW, see README.md).
#
#   packaging/windows/cross-build.sh [--release]
#
# Needs: rustup target add x86_64-pc-windows-gnu; apt install gcc-mingw-w64-x86-64
# g++-mingw-w64-x86-64 (its *-posix compilers: llama.cpp needs std::thread and
# std::mutex, which the default win32 thread model lacks).
set -eu
cd "$(dirname "$0")/../.."
profile=""
[ "${1:-}" = "--release" ] && profile="--release"

export CC_x86_64_pc_windows_gnu=x86_64-w64-mingw32-gcc-posix
export CXX_x86_64_pc_windows_gnu=x86_64-w64-mingw32-g++-posix
export CARGO_TARGET_X86_64_PC_WINDOWS_GNU_LINKER=x86_64-w64-mingw32-gcc-posix
# Debian 12's MinGW-w64 headers (v10) lack the thread power-throttling declarations
# llama.cpp's CPU backend uses (v11 has them): declared by this header instead.
CFLAGS_x86_64_pc_windows_gnu="-include $(pwd)/packaging/windows/mingw-compat.h"
export CFLAGS_x86_64_pc_windows_gnu
# shellcheck disable=SC2086
cargo build --locked --target x86_64-pc-windows-gnu -p shoal --bin shoal $profile
if [ -n "$profile" ]; then dir=target/x86_64-pc-windows-gnu/release; else dir=target/x86_64-pc-windows-gnu/debug; fi
ls -l "$dir/shoal.exe"
