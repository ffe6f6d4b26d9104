#!/usr/bin/env bash
# Full-size check (issue 8 item 6): minids against transformers on the exact DeepSeek-V2-Lite
# shapes with random weights, FP8 and BF16 experts. Run from the repository root on the GPU
# machine with build/ carried; one call, about 5-9 minutes, up to ~63 GB of disk (or 31 GB of disk
# and 31 GB of /dev/shm). Everything after the options goes to scripts/full_size_check.py:
#   scripts/full_size_check.sh                      # 27 layers, minids on the GPU (when it has one)
#   scripts/full_size_check.sh --layers 4 --cpu     # quick: 4 layers, minids on the CPU
# Results: $OUT (default full_size_out/): summary.txt, results.json, logs.tar.gz.
set -euo pipefail
cd "$(dirname "$0")/.."
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
OUT="${OUT:-full_size_out}"
MINIDS="${MINIDS:-build/minids}"  # a carried build may live elsewhere (scripts/gpu_check.sh)
if [[ ! -x "$MINIDS" ]]; then
    echo "full_size_check: $MINIDS is missing (cmake --build build --target minids)" >&2
    exit 2
fi
python3 -c 'import torch, transformers, numpy' || {
    echo "full_size_check: needs python3 with torch, transformers and numpy" >&2
    exit 2
}
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader || true
df -h . /dev/shm 2>/dev/null || true
exec python3 scripts/full_size_check.py --out "$OUT" --minids "$MINIDS" "$@"
