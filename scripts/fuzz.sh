#!/usr/bin/env bash
#! Builds every cargo-fuzz target of daemon/fuzz (nightly, address sanitizer, debug
#! assertions) and runs each for SECONDS (default 30) under the same libFuzzer flags,
#! starting from the kept seeds and regression inputs plus the working corpus of earlier
#! runs. Prints per target: executions, exec/s, coverage (cov/ft from libFuzzer's last
#! status line), corpus size and the crashes found (their inputs land in
#! daemon/fuzz/artifacts/<target>/). Exits non-zero if any target crashed.
#!
#! Usage: scripts/fuzz.sh [SECONDS] [TARGET...]
#! Needs a nightly toolchain; installs cargo-fuzz (pinned) into ~/.cargo/bin when
#! missing. Where either cannot be had it says so and fails, or exits 0 when
#! SHOAL_FUZZ_OPTIONAL=1. Builds go to SHOAL_FUZZ_TARGET (default daemon/fuzz/target);
#! the test suite points it outside the repository so that later runs reuse the build.
set -uo pipefail
cd "$(dirname "$0")/.."
secs=${1:-30}
shift || true
[[ $secs =~ ^[0-9]+$ ]] || { echo "usage: scripts/fuzz.sh [SECONDS] [TARGET...]" >&2; exit 2; }
CARGO_FUZZ_VERSION=0.13.2
FUZZ=daemon/fuzz
TARGET_DIR=${SHOAL_FUZZ_TARGET:-$FUZZ/target}
export PATH="$HOME/.cargo/bin:$PATH"

unavailable() {
    echo "fuzz: cannot fuzz: $1" >&2
    if [[ ${SHOAL_FUZZ_OPTIONAL:-0} == 1 ]]; then
        echo "fuzz: skipped (SHOAL_FUZZ_OPTIONAL=1)"
        exit 0
    fi
    exit 1
}

command -v cargo >/dev/null || unavailable "cargo is not installed"
cargo +nightly --version >/dev/null 2>&1 ||
    unavailable "no nightly toolchain (cargo-fuzz needs one: rustup toolchain install nightly)"
if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "fuzz: installing cargo-fuzz $CARGO_FUZZ_VERSION into ~/.cargo/bin"
    cargo install cargo-fuzz --version "$CARGO_FUZZ_VERSION" --locked ||
        unavailable "cargo install cargo-fuzz failed (no registry access?)"
fi

start=$(date +%s)
cargo +nightly fuzz build --fuzz-dir "$FUZZ" --target-dir "$TARGET_DIR" || { echo "fuzz: the targets do not build" >&2; exit 1; }
built=$(date +%s)
bin_dir=$TARGET_DIR/$(rustc +nightly -vV | sed -n 's/^host: //p')/release
if (($# > 0)); then
    targets=("$@")
else
    mapfile -t targets < <(cargo +nightly fuzz list --fuzz-dir "$FUZZ")
fi
# One log folder per run: two runs at once (say, CI and a long run) must not share logs.
logs=$TARGET_DIR/logs/$(date +%Y%m%d-%H%M%S)-$$
mkdir -p "$logs"

# The same flags for every target and every run length: 10 s is a timeout, a single
# allocation or a resident size over 2 GiB is an out-of-memory finding.
flags=(-max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -malloc_limit_mb=2048 -print_final_stats=1)
failed=()
printf '%-15s %12s %8s %7s %7s %8s %8s\n' target executions exec/s cov ft corpus crashes
for t in "${targets[@]}"; do
    corpus=$FUZZ/corpus/$t
    artifacts=$FUZZ/artifacts/$t
    log=$logs/$t.log
    mkdir -p "$corpus" "$artifacts"
    inputs=("$corpus" "$FUZZ/seeds/$t")
    [[ -d $FUZZ/regressions/$t ]] && inputs+=("$FUZZ/regressions/$t")
    before=$(find "$artifacts" -type f | wc -l)
    "$bin_dir/$t" "${flags[@]}" -artifact_prefix="$artifacts/" "${inputs[@]}" >"$log" 2>&1
    rc=$?
    crashes=$(($(find "$artifacts" -type f | wc -l) - before))
    # The last status line ("#N  DONE  cov: C ft: F corp: U/S ... exec/s: E").
    status=$(grep -aE '^#[0-9]+' "$log" | tail -n 1)
    field() { sed -nE "s/.*[[:space:]]$1:? ([^[:space:]]+).*/\\1/p" <<<"$status"; }
    execs=$(grep -a '^stat::number_of_executed_units:' "$log" | sed 's/.*: *//')
    rate=$(grep -a '^stat::average_exec_per_sec:' "$log" | sed 's/.*: *//')
    printf '%-15s %12s %8s %7s %7s %8s %8s\n' "$t" "${execs:-${status%% *}}" "${rate:-$(field exec/s)}" \
        "$(field cov)" "$(field ft)" "$(field corp | cut -d/ -f1)" "$crashes"
    if ((rc != 0 || crashes > 0)); then
        failed+=("$t")
        echo "fuzz: $t failed (exit $rc); its log: $log; inputs: $artifacts/" >&2
        grep -aE '^(==[0-9]+==( ERROR|ERROR)|thread .* panicked|SUMMARY)' "$log" | head -n 5 >&2
    fi
done
end=$(date +%s)
echo "fuzz: ${#targets[@]} targets, ${secs} s each; build $((built - start)) s, total $((end - start)) s"
if ((${#failed[@]} > 0)); then
    echo "fuzz: FAILED: ${failed[*]}" >&2
    exit 1
fi
echo "fuzz: no crashes"
