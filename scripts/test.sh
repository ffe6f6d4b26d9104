#!/usr/bin/env bash
# Runs the whole test suite (doctest) against the build in build/ and ends with its summary.
# GPU tests run where a CUDA device is present and are skipped, visibly, where none is.
set -uo pipefail
cd "$(dirname "$0")/.."
[ -x build/minids_tests ] || { echo "test: build/minids_tests missing; run ./scripts/setup.sh first" >&2; exit 2; }
cmake --build build -j "${JOBS:-$(nproc)}" >/dev/null || { echo "test: build failed" >&2; exit 2; }

if build/minids_tests -tc="cuda matvec bf16*" 2>&1 | grep -q "test cases: *0 |"; then
    echo "test: no CUDA device here: the GPU test cases (cuda*) are reported as skipped" >&2
fi

# Formatting and fuzzing first, so the output ends with the test runner's summary.
checks_rc=0
# Formatting is part of the suite: every tracked source is clang-formatted.
if [ $# -eq 0 ]; then scripts/check_format.sh || checks_rc=1; fi

# Fuzz the manifest parser for a bounded time when the fuzz build exists (see scripts/fuzz.sh).
if [ -z "${MINIDS_NO_FUZZ:-}" ] && [ -x scripts/fuzz.sh ] && [ $# -eq 0 ]; then
    scripts/fuzz.sh 60 || checks_rc=1
fi

log=$(mktemp)
build/minids_tests "$@" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
[ "$checks_rc" -eq 0 ] || rc=1

summary=$(grep -E '^\[doctest\] test cases:' "$log" | tail -1)
passed=$(echo "$summary" | sed -E 's/.*\| *([0-9]+) passed.*/\1/')
failed=$(echo "$summary" | sed -E 's/.*\| *([0-9]+) failed.*/\1/')
skipped=$(echo "$summary" | sed -E 's/.*\| *([0-9]+) skipped.*/\1/')
rm -f "$log"
echo "tests: ${passed:-0} passed, ${failed:-?} failed, ${skipped:-0} skipped"
exit $rc
