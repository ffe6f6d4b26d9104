#!/usr/bin/env bash
# Why one kernel of minids' decode step runs as fast as it does: Nsight Compute's speed-of-light,
# occupancy, launch, scheduler and warp-stall sections for the kernels whose names match REGEX,
# on the synthetic V2-Lite with FP8 experts (the last COUNT launches of a short decode run).
#
#   BIN=build OUT=ncu_out scripts/ncu_kernel.sh REGEX [COUNT] [extra minids bench flags]
#   e.g. scripts/ncu_kernel.sh 'decode_gate_up|decode_down' 4
#
# Builds nothing. Writes $OUT/ncu_kernel.txt (ncu's details page) and prints its main lines.
set -uo pipefail
cd "$(dirname "$0")/.."
regex=${1:?usage: ncu_kernel.sh REGEX [COUNT] [bench flags]}
count=${2:-4}
shift $(( $# >= 2 ? 2 : 1 ))
source scripts/ncu_common.sh ncu_kernel
# Skip the warm-up's launches: profile the last `count` matches of a 3-token decode run (26 MoE
# layers per token, so a count up to 26 stays inside the final token's graph replay).
total=$("$NCU" --clock-control none --csv --page raw --metrics gpu__time_duration.sum \
    -k "regex:$regex" "$BIN/minids" bench -m "$model" -p 0 -n 3 -r 1 "$@" 2>/dev/null |
    grep -c '^"[0-9]')
skip=$(( total > count ? total - count : 0 ))
"$NCU" --clock-control none --import-source no -k "regex:$regex" -s "$skip" -c "$count" \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats \
    --section WarpStateStats --section MemoryWorkloadAnalysis \
    "$BIN/minids" bench -m "$model" -p 0 -n 3 -r 1 "$@" > "$OUT/ncu_kernel.txt" 2>&1
echo "ncu rc=$? ($total matching launches, the last $count profiled; details in $OUT/ncu_kernel.txt)"
grep -E '^  [a-z_:<>, ()0-9A-Z]+\(|Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Block Limit|Issued Warp|No Eligible|Active Warps Per|Eligible Warps|Warp Cycles Per Issued|Stall|^    [A-Z]+ +[A-Za-z]' \
    "$OUT/ncu_kernel.txt" | cut -c1-150 | head -80
