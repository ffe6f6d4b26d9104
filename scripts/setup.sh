#!/usr/bin/env bash
# Installs the build dependencies (Debian packages, idempotent), then configures and builds minids
# into build/ (binary: build/minids). CUDA code is compiled when nvcc is found.
set -euo pipefail
cd "$(dirname "$0")/.."

PACKAGES=(build-essential cmake ninja-build pkg-config git
          libcli11-dev libxxhash-dev doctest-dev nlohmann-json3-dev libpcre2-dev libedit-dev
          clang-14 libclang-rt-14-dev clang-format ccache)
missing=()
for p in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
    echo "setup: installing ${missing[*]}" >&2
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get update -q
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

JOBS="${JOBS:-$(nproc)}"
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release ${MINIDS_CMAKE_ARGS:-}
cmake --build build -j "$JOBS"
echo "setup: built build/minids" >&2
