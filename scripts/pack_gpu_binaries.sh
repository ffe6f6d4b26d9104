#!/usr/bin/env bash
# Packs a build's GPU binaries into one small archive for a GPU machine that builds nothing
# (scripts/gpu_check.sh runs them from BIN). The binaries share their CUDA kernels, and xz -9e's
# 64 MiB window stores the shared part once: minids + minids_tests took 10.7 MB at xz's default
# level and 6.5 MB at -9e.
#
#   scripts/pack_gpu_binaries.sh OUT.tar.xz [BUILD_DIR] [EXTRA_BINARY ...]
#   # there: mkdir -p bin && tar xJf OUT.tar.xz -C bin && BIN=bin scripts/gpu_check.sh
set -euo pipefail
out=${1:?usage: pack_gpu_binaries.sh OUT.tar.xz [BUILD_DIR] [EXTRA_BINARY ...]}
build=${2:-build}
shift $(( $# >= 2 ? 2 : 1 ))
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
for b in minids minids_tests "$@"; do
    [[ -x "$build/$b" ]] || { echo "pack_gpu_binaries: $build/$b is missing" >&2; exit 2; }
    cp "$build/$b" "$stage/"
done
strip "$stage"/*
XZ_OPT="-9e -T2" tar cJf "$out" -C "$stage" .
echo "pack_gpu_binaries: $(ls "$stage" | tr '\n' ' ')-> $out ($(du -h "$out" | cut -f1))"
