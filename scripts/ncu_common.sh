# Sourced by scripts/ncu_*.sh: BIN, OUT, WORK (defaults build, ncu_out, /tmp/minids_gpu_check),
# the CUDA libraries on the path, NCU (Nsight Compute's binary) and model (the synthetic
# V2-Lite with FP8 experts, converted once into WORK). $1: the calling script's name, for errors.
BIN="${BIN:-build}"
OUT="${OUT:-ncu_out}"
WORK="${WORK:-/tmp/minids_gpu_check}"
mkdir -p "$OUT" "$WORK"
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
NCU="$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)"
[[ -x "$NCU" ]] || { echo "$1: no ncu found" >&2; exit 1; }
model="$WORK/v2-lite-f8_e4m3.mds"
[[ -f "$model" ]] || timeout 300 "$BIN/minids" convert -q --synthetic v2-lite --expert-dtype f8_e4m3 \
    -o "$model" > "$OUT/ncu_convert.log" 2>&1 || { echo "$1: convert failed" >&2; exit 1; }
