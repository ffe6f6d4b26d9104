#!/usr/bin/env bash
# Fuzzes what minids reads from untrusted files (the .mds preamble/manifest, chat templates,
# tokenizer.json) for a bounded time: builds tests/fuzz/ with clang, libFuzzer, ASan and UBSan in
# build-fuzz/ (only the parsers' own sources), then runs it on the committed seed corpus
# (tests/fuzz/corpus/). Exits non-zero on a crash, leak, sanitizer report, uncaught exception or
# hang; the reproducer is left in build-fuzz/ (crash-*, leak-*, timeout-*). The timeout is
# generous: a template that spends its whole work budget (src/chat/jinja.h, "Limits") takes
# seconds under the sanitizers; a real hang still trips it.
#
#   scripts/fuzz.sh [SECONDS]      (default 60)
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-60}
cc=${FUZZ_CC:-clang-14}
cxx=${FUZZ_CXX:-clang++-14}
command -v "$cxx" >/dev/null || { echo "fuzz: $cxx not found (needs clang with libFuzzer)" >&2; exit 2; }

CC=$cc CXX=$cxx cmake -S . -B build-fuzz -G Ninja -DMINIDS_FUZZ=ON -DMINIDS_TESTS=OFF \
    -DMINIDS_CUDA=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build-fuzz --target fuzz_inputs -j "${JOBS:-2}" >/dev/null

# New inputs the fuzzer finds go to a scratch directory; the committed corpus is only read.
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
echo "fuzz: fuzz_inputs for ${seconds}s on tests/fuzz/corpus" >&2
build-fuzz/fuzz_inputs -max_total_time="$seconds" -timeout=60 -rss_limit_mb=2048 \
    -max_len=262144 -artifact_prefix=build-fuzz/ -print_final_stats=1 \
    "$scratch" tests/fuzz/corpus 2>build-fuzz/fuzz.log || {
    tail -n 40 build-fuzz/fuzz.log >&2
    echo "fuzz: FAILED (log: build-fuzz/fuzz.log; reproducer in build-fuzz/)" >&2
    exit 1
}
grep -E '^stat::number_of_executed_units|^Done' build-fuzz/fuzz.log >&2 || true
echo "fuzz: OK" >&2
