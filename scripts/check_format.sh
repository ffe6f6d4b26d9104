#!/usr/bin/env bash
# Fails (exit 1) listing every tracked C++/CUDA source that .clang-format would change.
set -uo pipefail
cd "$(dirname "$0")/.."
command -v clang-format >/dev/null || { echo "format: clang-format not installed, not checked" >&2; exit 0; }
bad=()
while IFS= read -r -d '' f; do
    clang-format --dry-run -Werror "$f" >/dev/null 2>&1 || bad+=("$f")
done < <(git ls-files -z '*.cpp' '*.h' '*.cu' '*.cuh')
if ((${#bad[@]})); then
    echo "format: not clang-formatted (run clang-format -i on them): ${bad[*]}" >&2
    exit 1
fi
echo "format: OK"
