#!/bin/sh
# Cross-build shoal.exe (cross-build.sh) and run it under Wine on Linux: `--version`,
# then the test model split in two stages, compared token for token with the Linux
# build's answer. Not part of the test suite (it adds a Windows build of llama.cpp,
# about 5 minutes here); the check a session ran by hand, written down so it can be
# run again. Needs Debian's wine64 (apt install --no-install-recommends wine64).
#
# Debian 12's Wine (8.0) lacks bcryptprimitives.dll, where Rust's standard library
# takes its randomness from (ProcessPrng) on Windows 10 and later: a stand-in built
# here with MinGW, calling the older RtlGenRandom, sits beside shoal.exe for the run.
set -eu
cd "$(dirname "$0")/../.."
packaging/windows/cross-build.sh >/dev/null
model=${SHOAL_MODELS:-$HOME/.cache/shoal/models}/SmolLM2-135M-Instruct.Q4_1.gguf
run=$(mktemp -d)
trap 'rm -rf "$run"' EXIT
cat > "$run/shim.c" <<'C'
#include <windows.h>
BOOLEAN WINAPI SystemFunction036(PVOID buffer, ULONG length);
__declspec(dllexport) BOOL WINAPI ProcessPrng(PBYTE data, SIZE_T len) {
    while (len > 0) {
        ULONG n = len > 0x10000000 ? 0x10000000 : (ULONG)len;
        if (!SystemFunction036(data, n)) return FALSE;
        data += n;
        len -= n;
    }
    return TRUE;
}
C
x86_64-w64-mingw32-gcc-posix -shared -o "$run/bcryptprimitives.dll" "$run/shim.c" -ladvapi32
cp target/x86_64-pc-windows-gnu/debug/shoal.exe "$model" "$run/"
wine=$(command -v wine64 || echo /usr/lib/wine/wine64)
export WINEDEBUG=-all WINEPREFIX="$run/prefix"
cd "$run"
"$wine" ./shoal.exe --version
prompt="What is the capital of France?"
"$wine" ./shoal.exe run -m "$(basename "$model")" -p "$prompt" -n 16 --split 15 --json > windows.json
cd - >/dev/null
cargo build -q -p shoal --bin shoal
target/debug/shoal run -m "$model" -p "$prompt" -n 16 --split 15 --json > "$run/linux.json"
python3 - "$run/windows.json" "$run/linux.json" <<'PY'
import json, sys
w, l = (json.load(open(p)) for p in sys.argv[1:3])
print(f"windows (wine): {w['text']!r}  {w['tok_per_s']:.1f} tok/s")
print(f"linux:          {l['text']!r}  {l['tok_per_s']:.1f} tok/s")
assert w["tokens"] == l["tokens"], "the Windows build answers differently"
print("same tokens")
PY
