#!/usr/bin/env bash
# The GPU time of every kernel of minids' decode step, read by Nsight Compute (hardware timer,
# one kernel at a time: no launch gaps, no overlap), on the synthetic V2-Lite with FP8 experts.
# Complements the event profile of gpu_check.sh --profile, whose per-launch figures include the
# gaps between kernels and an event pair each.
#
#   BIN=build OUT=ncu_out scripts/ncu_decode.sh [--prompt N] [extra minids bench flags, e.g. -d 32768]
#
# --prompt N profiles one N-token prompt pass instead (the last of a `bench -p N -n 0` run).
# Builds nothing. Writes $OUT/ncu_decode.csv (or ncu_prompt.csv, raw) and prints one line per
# kernel name: launches in one decode step (prompt pass), median µs per launch, DRAM bytes read
# per launch, GB/s.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/ncu_common.sh ncu_decode
what=decode run=(-p 0 -n 3)
if [[ "${1:-}" == --prompt ]]; then
    what=prompt run=(-p "$2" -n 0)
    shift 2
fi
# The summary keeps the kernels from the last launch of the embedding gather on: the final graph
# replay of a decode step (every name once per layer there), or the last prompt pass.
"$NCU" --clock-control none --csv --page raw --print-units base \
    --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,launch__grid_size,launch__block_size,launch__registers_per_thread \
    "$BIN/minids" bench -m "$model" "${run[@]}" -r 1 "$@" > "$OUT/ncu_$what.csv" 2> "$OUT/ncu_$what.log"
echo "ncu rc=$? ($(wc -l < "$OUT/ncu_$what.csv") lines)"
python3 - "$OUT/ncu_$what.csv" "$what" <<'EOF'
import csv, io, sys, statistics, collections
# the program's own output shares stdout with ncu's csv: keep the quoted csv lines
lines = [l for l in open(sys.argv[1]).read().splitlines() if l.startswith('"')]
rows = list(csv.DictReader(io.StringIO("\n".join(lines))))
num = lambda v: float(v.replace(",", ""))
rows = [r for r in rows if r.get("gpu__time_duration.sum", "").replace(",", "").replace(".", "").isdigit()]
if not rows: sys.exit("no kernel rows")
# the last decode step: from the last launch of the embedding gather to the end
last = max(i for i, r in enumerate(rows) if "get_rows" in r["Kernel Name"])
step = rows[last:]
by = collections.OrderedDict()
for r in step:
    by.setdefault((r["Kernel Name"][:60], r["launch__grid_size"]), []).append(r)
tot = sum(num(r["gpu__time_duration.sum"]) for r in step) / 1e3
print(f"{sys.argv[2]} {'step' if sys.argv[2] == 'decode' else 'pass'}: {len(step)} kernels, {tot:.1f} us of kernel time (ns timer, serialized)")
print(f"{'us total':>9} {'n':>4} {'med us':>8} {'MB read':>8} {'GB/s':>6} grid/block/regs  kernel")
for name, rs in sorted(by.items(), key=lambda kv: -sum(num(r['gpu__time_duration.sum']) for r in kv[1])):
    t = [num(r["gpu__time_duration.sum"]) / 1e3 for r in rs]
    b = [num(r["dram__bytes_read.sum"]) for r in rs]
    med = statistics.median(t)
    mb = statistics.median(b) / 1e6
    r0 = rs[0]
    print(f"{sum(t):9.1f} {len(t):4d} {med:8.2f} {mb:8.2f} {mb / med * 1e3:6.0f} "
          f"{r0['launch__grid_size']}/{r0['launch__block_size']}/{r0['launch__registers_per_thread']}  {name[0]}")
EOF
