#!/usr/bin/env bash
# Everything minids checks on a GPU machine, in one call, ending with one summary line per check:
# the GPU test cases, the whole suite, GPU vs CPU on the demo model, the synthetic V2-Lite
# benchmarks (FP8 and BF16 experts, pp512 / tg128 / tg128 at depth 32768, time to first token;
# FP8 also with the expert cache at a 12 GiB budget and at 208 slots, with the staging store, and
# traced to show where the host link idles: MINIDS_LINK_TRACE),
# and optionally the kernel benchmarks and the full-size check against transformers.
#
#   scripts/gpu_check.sh [--all-tests] [--kernels] [--full-size] [--fixtures] [--profile] [--quick]
#                        [--fetch-compare] [--ncu] [--norm-out] [--ab VAR=VALUE ...] [--ab-hits]
#                        [--ab-offload] [--hugepages-ab] [--kernel-trace]
#
# --ab VAR=VALUE (repeatable) runs the demo model (GPU vs CPU) and the FP8 tg128 and pp512 once
# more with that environment variable set: one binary A/Bs a switch on the whole model.
# --ab-hits adds to each --ab the expert cache's every-expert-a-hit pair (the resident tg128 and
# the 12 GiB cache's tg128 on the replayed sticky trace) with that variable set, next to the
# default row; e.g. --ab MINIDS_CUDA_FUSE=norm,residual,route,mla_prep,route_fetch --ab-hits.
# --ab-offload adds to each --ab the 12 GiB plan's four phases (-r 1), alternated twice with the
# default's (processes differ by a few %: each setting runs in two of them).
# --fetch-compare adds the expert cache's host fetch (and its copy-stream variant) next to the
# default device fetch.
# --profile adds a profiled FP8 bench (MINIDS_CUDA_PROFILE=1: time per launch of the decode graph
# and of the prompt pass) whose tables go to $OUT/profile_f8.log.
# --norm-out also runs the demo model (GPU vs CPU) and the FP8 tg128 with the norm_out fusion on,
# and with norm_out and router_route on (MINIDS_CUDA_FUSE; both off by default until measured).
# --hugepages-ab converts the FP8 model once more and measures the 12 GiB plan's first load after
# that conversion (and a second) with MINIDS_EXPERT_COPY_HUGEPAGES=0, beside the default's pair.
# --kernel-trace traces the every-expert-a-hit pair with CUPTI (scripts/kernel_trace/: needs
# $BIN/libminids_kernel_trace.so, which pack_gpu_binaries.sh packs when named) and writes where
# the replayed decode step's time goes, resident against the 12 GiB cache, kernel by kernel, to
# $OUT/kernel_trace_hits.md (tracing slows each kernel: compare the two, not against bench).
# --ncu adds scripts/ncu_decode.sh: Nsight Compute's time of every kernel of one decode step
# (table in $OUT/ncu_summary.txt, its top lines in the summary).
#
# Builds nothing: it runs the binaries in $BIN (default build/; a build made on another machine
# with -arch=sm_90 and static cudart runs as is). Logs and results go to $OUT (default
# gpu_check_out/); the summary is also written to $OUT/summary.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
BIN="${BIN:-build}"
OUT="${OUT:-gpu_check_out}"
WORK="${WORK:-/tmp/minids_gpu_check}"
mkdir -p "$OUT" "$WORK"
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export MINIDS_TEST_DATA="$PWD/tests/data" MINIDS_BINARY="$PWD/$BIN/minids"
KERNELS=0 FULL=0 FIXTURES=0 QUICK=0 ALL_TESTS=0 PROFILE=0 FETCH_COMPARE=0 NCU=0 NORM_OUT=0
AB_HITS=0 AB_OFFLOAD=0 HUGEPAGES_AB=0 KERNEL_TRACE=0
AB=()
while [[ $# -gt 0 ]]; do
    a=$1
    shift
    case "$a" in
        --ab) AB+=("$1"); shift ;;
        --ab-hits) AB_HITS=1 ;;
        --ab-offload) AB_OFFLOAD=1 ;;
        --kernels) KERNELS=1 ;;
        --full-size) FULL=1 ;;
        --fixtures) FIXTURES=1 ;;
        --quick) QUICK=1 ;;
        --profile) PROFILE=1 ;;
        --all-tests) ALL_TESTS=1 ;;
        --fetch-compare) FETCH_COMPARE=1 ;;
        --ncu) NCU=1 ;;
        --norm-out) NORM_OUT=1 ;;
        --hugepages-ab) HUGEPAGES_AB=1 ;;
        --kernel-trace) KERNEL_TRACE=1 ;;
        *) echo "gpu_check: unknown option $a" >&2; exit 2 ;;
    esac
done
for ab in ${AB[@]+"${AB[@]}"}; do
    [[ $ab == *=* ]] || { echo "gpu_check: --ab wants VAR=VALUE, got $ab" >&2; exit 2; }
done
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
say() { echo "$*" | tee -a "$SUMMARY"; }
t0=$(date +%s)
elapsed() { echo "$(( $(date +%s) - t0 ))s"; }
# The tok/s of bench's markdown row for test $1 (pp512, tg128, ...), read from stdin.
tok_s() { grep -E "\| $1 " | awk -F'|' '{print $9}' | awk '{print $1}'; }

nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader \
    > "$OUT/gpu.txt" 2>&1
# The binaries say which commit they were built from (they may come from another machine; the
# tree's own git state, when it has one, is printed beside it).
say "gpu: $(head -1 "$OUT/gpu.txt")  binaries: $("$BIN/minids" --version 2>/dev/null || echo ?)  tree: $(git describe --always --dirty 2>/dev/null || echo ?)"

# 1. GPU test cases (and with --all-tests the whole suite, CPU tests included).
timeout 600 "$BIN/minids_tests" -tc='cuda*,mgl cuda*' -tce='cuda expert offload*' > "$OUT/tests_cuda.log" 2>&1
say "tests (cuda*): $(grep -E '^\[doctest\] test cases' "$OUT/tests_cuda.log" | tail -1) [$(elapsed)]"
# The expert cache's GPU test in a process of its own (new code: a device fault there must not
# take the other GPU tests' context with it).
# Three times: with the experts' host store as a registered copy (the default), as the
# registered file mapping (MINIDS_EXPERT_STORE=mapped, the fallback), and unregistered, fetched
# through pinned staging buffers (MINIDS_EXPERT_STORE=staging, the fallback's fallback).
for store in copy mapped staging; do
    MINIDS_EXPERT_STORE=$store timeout 300 "$BIN/minids_tests" -tc='cuda expert offload*' > "$OUT/tests_offload_$store.log" 2>&1
    say "tests (cuda expert offload, host store $store): $(grep -E '^\[doctest\] test cases' "$OUT/tests_offload_$store.log" | tail -1)"
    grep 'MESSAGE: CUDA expert offload' "$OUT/tests_offload_$store.log" | sed 's/.*MESSAGE: //' | cut -c1-170 | while read -r l; do say "  $l"; done
done
if [[ $ALL_TESTS == 1 ]]; then
    timeout 900 "$BIN/minids_tests" > "$OUT/tests_all.log" 2>&1
    say "tests (all):   $(grep -E '^\[doctest\] test cases' "$OUT/tests_all.log" | tail -1) [$(elapsed)]"
fi

# 2. The demo model, greedy, on the GPU and on the CPU: the same text is expected (both compute
# in FP32; the GPU's BF16 KV cache is forced to F32 here so the comparison is like for like).
# The model is named (-m): a binary built elsewhere looks for the demo model beside its own
# source tree, which is not here.
prompt="Return the number of"
# demo_run NAME [run arguments...]: text to $OUT/NAME.txt, exit status to $OUT/NAME.rc.
demo_run() {
    local name=$1
    shift
    timeout 120 "$BIN/minids" run -m models/demo.mds -p "$prompt" -n 48 --temp 0 "$@" \
        > "$OUT/$name.txt" 2> "$OUT/$name.log"
    echo $? > "$OUT/$name.rc"
}
# "identical" only when both runs succeeded and wrote text: two failed runs print nothing, and
# nothing equals nothing.
demo_compare() {
    local a=$1 b=$2
    if [[ $(cat "$OUT/$a.rc") != 0 || $(cat "$OUT/$b.rc") != 0 || ! -s "$OUT/$a.txt" ]]; then
        echo "FAILED (exit status $(cat "$OUT/$a.rc") / $(cat "$OUT/$b.rc"), see $a.log, $b.log)"
    elif cmp -s "$OUT/$a.txt" "$OUT/$b.txt"; then
        echo identical
    else
        echo DIFFERENT
    fi
}
demo_run demo_gpu --cache-type-k f32
demo_run demo_cpu --cpu
say "demo model greedy 48 tokens, GPU vs CPU: $(demo_compare demo_gpu demo_cpu); GPU: $(grep -o '[0-9.]* tok/s' "$OUT/demo_gpu.log" | tail -1)"
# The defaults (ggml-like/include/mgl-cuda.h) plus norm_out, so the A/B differs in that alone.
FUSE_NORM_OUT="norm,residual,route,mla_prep,prefetch_behind_misses,shared_beside,norm_out"
FUSE_ROUTER="$FUSE_NORM_OUT,router_route"
if [[ $NORM_OUT == 1 ]]; then
    for pair in "norm_out:$FUSE_NORM_OUT" "norm_out+router_route:$FUSE_ROUTER"; do
        name=${pair%%:*} fuse=${pair#*:}
        MINIDS_CUDA_FUSE=$fuse demo_run "demo_gpu_$name" --cache-type-k f32
        say "demo model greedy 48 tokens, GPU with $name vs CPU: $(demo_compare "demo_gpu_$name" demo_cpu)"
    done
fi

for ab in ${AB[@]+"${AB[@]}"}; do
    (export "${ab?}"; demo_run demo_gpu_ab --cache-type-k f32)
    say "demo model greedy 48 tokens, GPU with $ab vs CPU: $(demo_compare demo_gpu_ab demo_cpu)"
done

# The every-expert-a-hit pair on model $1 (a replayed sticky trace, $WORK/sticky.npz): tg128 fully
# resident and with the 12 GiB cache, with environment setting $2 (VAR=VALUE, or empty for none);
# $3 tells the logs apart.
every_hit() {
    local f=$1 ab=$2 tag=${3:-} envs=()
    [[ -n $ab ]] && envs=("$ab")
    env ${envs[@]+"${envs[@]}"} timeout 200 "$BIN/minids" bench -m "$f" -p 16 -n 128 -r 2 -o md \
        --replay-routing "$WORK/sticky.npz" > "$OUT/bench_hits_resident$tag.md" 2> "$OUT/bench_hits_resident$tag.log"
    env ${envs[@]+"${envs[@]}"} timeout 200 "$BIN/minids" bench -m "$f" -p 16 -n 128 -r 2 -o md \
        --vram-budget 12GiB --replay-routing "$WORK/sticky.npz" > "$OUT/bench_hits_12g$tag.md" 2> "$OUT/bench_hits_12g$tag.log"
    local res=$(tok_s tg128 < "$OUT/bench_hits_resident$tag.md")
    local off=$(tok_s tg128 < "$OUT/bench_hits_12g$tag.md")
    say "every expert a hit (replayed sticky trace${ab:+, $ab}): resident tg128 ${res:-?}, 12 GiB cache tg128 ${off:-?} tok/s ($(awk "BEGIN { if (\"$res\" > 0) printf \"%.1f%% of resident\", 100 * \"$off\" / \"$res\" }"))"
}

# The every-expert-a-hit pair on model $1 traced by CUPTI (--kernel-trace): per kernel, the time
# each adds to the replayed decode step, resident against the 12 GiB cache.
kernel_trace_hits() {
    local f=$1 lib="$PWD/$BIN/libminids_kernel_trace.so"
    [[ -f $lib ]] || { say "kernel trace: $BIN/libminids_kernel_trace.so missing (pack it)"; return; }
    local args=(bench -m "$f" -p 16 -n 64 -r 1 -o md --replay-routing "$WORK/sticky.npz")
    MINIDS_KERNEL_TRACE="$WORK/trace_resident.txt" CUDA_INJECTION64_PATH="$lib" timeout 200 \
        "$BIN/minids" "${args[@]}" > /dev/null 2> "$OUT/kernel_trace_resident.log"
    MINIDS_KERNEL_TRACE="$WORK/trace_12g.txt" CUDA_INJECTION64_PATH="$lib" timeout 200 \
        "$BIN/minids" "${args[@]}" --vram-budget 12GiB > /dev/null 2> "$OUT/kernel_trace_12g.log"
    python3 scripts/kernel_trace/report.py "$WORK/trace_resident.txt" "$WORK/trace_12g.txt" \
        > "$OUT/kernel_trace_hits.md" 2>&1
    say "kernel trace, every expert a hit (traced, slower than bench): $(grep -E '^\| step ' "$OUT/kernel_trace_hits.md" | awk -F'|' '{print "replayed step resident / 12 GiB us " $5 "(" $6 ")"}')"
}

# "LABEL: process start to first token X s (first byte of the answer), to exit Y s"; $2 names the
# log, the rest are minids run arguments.
ttft_line() {
    local label=$1 log=$2
    shift 2
    local s=$(date +%s.%N)
    local first=$(timeout 120 "$BIN/minids" run "$@" -p hello -n 8 --temp 0 2> "$OUT/$log.log" |
        python3 -c 'import sys, time
b = sys.stdin.buffer.read(1)
print("%.6f" % time.time() if b else "-", flush=True)
sys.stdin.buffer.read()')
    local e=$(date +%s.%N)
    say "$label: process start to first token $(awk "BEGIN { if (\"$first\" == \"-\") print \"?\"; else printf \"%.2f\", $first - $s }") s (first byte of the answer), to exit $(awk "BEGIN { printf \"%.2f\", $e - $s }") s"
}

# 3. Synthetic V2-Lite: FP8 experts, then BF16 experts (each converted, benchmarked, deleted).
bench_model() {  # $1 = expert dtype
    local f="$WORK/v2-lite-$1.mds"
    rm -f "$f"
    timeout 300 "$BIN/minids" convert -q --synthetic v2-lite --expert-dtype "$1" -o "$f" > "$OUT/convert_$1.log" 2>&1 ||
        { say "convert v2-lite $1: FAILED (see convert_$1.log)"; return; }
    # Time to first token with the file in the page cache (read once before): from process start
    # to the first byte of the streamed answer on stdout, and to the process's exit (which adds
    # the teardown: unregistering and freeing host memory, destroying the CUDA context). -n 8 so
    # that some byte comes (one token of a random-weight model may print nothing): the first
    # figure can hold up to 7 decode steps (~15 ms resident).
    cat "$f" > /dev/null
    ttft_line "v2-lite $1" "ttft_$1" -m "$f"
    if [[ $1 == f8_e4m3 ]]; then  # the same with the expert cache's 12 GiB plan (issue 10: 3 s)
        # Twice: the first load after a conversion filled the experts' anonymous copy 2-10x
        # slower (3.9-13.9 s against 1.9-2.1 s to load on the H200, sixth session; huge pages
        # were obtained both times, docs/perf.md), so both are reported.
        ttft_line "v2-lite $1, 12 GiB plan (first load after the conversion)" "ttft_$1_12g" -m "$f" --vram-budget 12GiB
        ttft_line "v2-lite $1, 12 GiB plan (loaded again)" "ttft_$1_12g_again" -m "$f" --vram-budget 12GiB
        if [[ $HUGEPAGES_AB == 1 ]]; then  # the same first load without the huge-page advice
            rm -f "$f"
            timeout 300 "$BIN/minids" convert -q --synthetic v2-lite --expert-dtype "$1" -o "$f" \
                >> "$OUT/convert_$1.log" 2>&1
            cat "$f" > /dev/null
            MINIDS_EXPERT_COPY_HUGEPAGES=0 ttft_line \
                "v2-lite $1, 12 GiB plan, MINIDS_EXPERT_COPY_HUGEPAGES=0 (first load after the conversion)" \
                "ttft_$1_12g_nohuge" -m "$f" --vram-budget 12GiB
            MINIDS_EXPERT_COPY_HUGEPAGES=0 ttft_line \
                "v2-lite $1, 12 GiB plan, MINIDS_EXPERT_COPY_HUGEPAGES=0 (loaded again)" \
                "ttft_$1_12g_nohuge_again" -m "$f" --vram-budget 12GiB
        fi
    fi
    local reps=5; [[ $QUICK == 1 ]] && reps=2
    timeout 300 "$BIN/minids" bench -m "$f" -p 512 -n 128 -r $reps -o md > "$OUT/bench_$1.md" 2> "$OUT/bench_$1.log"
    if [[ $QUICK == 0 && $1 == f8_e4m3 ]]; then
        timeout 400 "$BIN/minids" bench -m "$f" -p 0 -n 128 -d 32768 -r 3 -o md > "$OUT/bench_$1_d32k.md" 2>> "$OUT/bench_$1.log"
    fi
    if [[ $NORM_OUT == 1 ]]; then  # the same tg128 with norm_out (+ router_route), then without
        for fuse in "$FUSE_NORM_OUT" "$FUSE_ROUTER" all; do
            MINIDS_CUDA_FUSE=$fuse timeout 200 "$BIN/minids" bench -m "$f" -p 0 -n 128 -r $reps -o md \
                2>/dev/null | grep -E '\| tg' | while read -r line; do say "bench $1 (MINIDS_CUDA_FUSE=$fuse): $line"; done
        done
    fi
    if [[ $1 == f8_e4m3 ]]; then
        for ab in ${AB[@]+"${AB[@]}"}; do
            env "$ab" timeout 200 "$BIN/minids" bench -m "$f" -p 512 -n 128 -r $reps -o md \
                2>/dev/null | grep -E '\| (pp|tg)' | while read -r line; do say "bench $1 ($ab): $line"; done
        done
    fi
    # The host's gap between decode steps: tg128 again with each graph replay timed by two CUDA
    # events (MINIDS_CUDA_REPLAY_TIMER); wall time per token minus the replay's GPU time is what
    # the step waits on the host (logits download, sync, input upload, graph launch).
    if [[ $1 == f8_e4m3 ]]; then
        MINIDS_CUDA_REPLAY_TIMER=1 timeout 200 "$BIN/minids" bench -m "$f" -p 0 -n 128 -r $reps -o md \
            > "$OUT/bench_replay_timer.md" 2> "$OUT/bench_replay_timer.log"
        local tg=$(tok_s tg128 < "$OUT/bench_replay_timer.md")
        local gpu_us=$(grep -m1 'cuda replay timer' "$OUT/bench_replay_timer.log" | sed -E 's/.*median ([0-9.]+) us.*/\1/')
        say "decode host gap: tg128 ${tg:-?} tok/s with the replay timer; GPU time per decode replay ${gpu_us:-?} us (median); $(awk "BEGIN { if (\"$tg\" > 0 && \"$gpu_us\" > 0) printf \"wall %.1f us per token, host gap %.1f us\", 1e6 / \"$tg\", 1e6 / \"$tg\" - \"$gpu_us\" }")"
    fi
    # The expert cache (issue 10, new): the 12 GiB plan, and 8 slots per MoE layer (208).
    if [[ $1 == f8_e4m3 ]]; then
        # The driver's view of the process's GPU memory, sampled every 200 ms during the run.
        nvidia-smi --query-compute-apps=used_memory --format=csv,noheader,nounits -lms 200 \
            > "$OUT/offload_12g_mem.txt" 2>/dev/null &
        local smi=$!
        # The default fetch (device, --expert-prefetch auto: the top 4, one fill); with --fetch-compare also
        # the host fetch, and its best setting (copy stream, frequency admission) below.
        local fetch=(); [[ $FETCH_COMPARE == 1 ]] && fetch=(--sweep-fetch host,device)
        MINIDS_LOAD_TRACE=1 timeout 300 "$BIN/minids" bench -m "$f" -p 512 -n 128 -r 2 -o md --vram-budget 12GiB \
            ${fetch[@]+"${fetch[@]}"} > "$OUT/bench_offload_12g.md" 2> "$OUT/bench_offload_12g.log"
        local rc=$?
        kill $smi 2>/dev/null
        local peak=$(sort -n "$OUT/offload_12g_mem.txt" | tail -1)
        local verdict="within the budget"; [[ -n $peak && $peak -gt 12288 ]] && verdict="OVER THE BUDGET"
        [[ -z $peak ]] && verdict="not sampled"
        say "offload 12GiB: rc=$rc, peak GPU memory of the process ${peak:-?} MiB (nvidia-smi; budget 12288 MiB): $verdict; load: $(grep -E "weight store: (experts|dense)" "$OUT/bench_offload_12g.log" | sed 's/weight store: //' | tr '\n' ';')"
        timeout 300 "$BIN/minids" bench -m "$f" -p 512 -n 64 -r 2 -o md --vram-budget 12GiB \
            --sweep-slots 208 ${fetch[@]+"${fetch[@]}"} > "$OUT/bench_offload_208.md" 2> "$OUT/bench_offload_208.log"
        say "offload 208 slots: rc=$?"
        # Prefetch (--expert-prefetch N: each MoE layer fills the next layer's experts among its
        # top N predicted, at most --expert-prefetch-fills of them, 1 by default; on one stream,
        # its copies queued for the copy engines right behind the layer's misses): off, 3 and 4
        # in one process; the top 3 uncapped (the twelfth session's default) and on a side stream
        # (the ninth session's schedule) to compare.
        timeout 300 "$BIN/minids" bench -m "$f" -p 512 -n 128 -r 1 -o md --vram-budget 12GiB \
            --sweep-prefetch 0,3,4 > "$OUT/bench_offload_12g_prefetch.md" 2> "$OUT/bench_offload_12g_prefetch.log"
        say "offload 12GiB, prefetch 0/3/4, one fill: rc=$?"
        timeout 300 "$BIN/minids" bench -m "$f" -p 512 -n 128 -r 1 -o md --vram-budget 12GiB \
            --sweep-prefetch 3 --expert-prefetch-fills 0 > "$OUT/bench_offload_12g_prefetch_uncapped.md" \
            2> "$OUT/bench_offload_12g_prefetch_uncapped.log"
        say "offload 12GiB, prefetch 3 uncapped: rc=$?"
        MINIDS_CUDA_FUSE=norm,residual,route,mla_prep,side_stream timeout 300 "$BIN/minids" bench \
            -m "$f" -p 512 -n 128 -r 1 -o md --vram-budget 12GiB --sweep-prefetch 3 \
            --expert-prefetch-fills 0 > "$OUT/bench_offload_12g_prefetch_side.md" 2> "$OUT/bench_offload_12g_prefetch_side.log"
        say "offload 12GiB, prefetch 3 uncapped on a side stream: rc=$?"
        # Where the link idles (MINIDS_LINK_TRACE=1: each copy of the copy engines timed by an
        # event pair; the traced run is a few % slower): the idle time between copies before a
        # step's first copy and within steps, by gap size (the log has the table).
        MINIDS_LINK_TRACE=1 timeout 300 "$BIN/minids" bench -m "$f" -p 512 -n 128 -r 1 -o md \
            --vram-budget 12GiB > "$OUT/bench_offload_12g_link_trace.md" 2> "$OUT/bench_offload_12g_link_trace.log"
        say "offload 12GiB, link trace: rc=$?; $(grep -h -m1 '^link trace' "$OUT/bench_offload_12g_link_trace.log" | sed 's/^link trace ([^)]*): //')"
        # Every fill is copied by the copy engines by default (MINIDS_FETCH_COPY=engines, issued
        # by the host's proxy thread); the same phases with the fetch's copy kernel, to compare
        # (both without prefetch).
        MINIDS_FETCH_COPY=kernel timeout 300 "$BIN/minids" bench -m "$f" -p 512 -n 128 -r 1 -o md \
            --vram-budget 12GiB --expert-prefetch 0 > "$OUT/bench_offload_12g_kernel.md" \
            2> "$OUT/bench_offload_12g_kernel.log"
        say "offload 12GiB, fills by the copy kernel (MINIDS_FETCH_COPY=kernel): rc=$?"
        # The staging store (the fallback when nothing can be registered): every miss copied by
        # the host into pinned buffers, then by the device into its slot.
        MINIDS_EXPERT_STORE=staging timeout 300 "$BIN/minids" bench -m "$f" -p 512 -n 64 -r 1 -o md \
            --vram-budget 12GiB > "$OUT/bench_offload_12g_staging.md" 2> "$OUT/bench_offload_12g_staging.log"
        say "offload 12GiB, staging store: rc=$?"
        # The prompt stage (--expert-prompt-stage, default a layer's experts) against none, pp512
        # at 12 GiB, alternated processes.
        local stage_pp=""
        for stage in 0 auto 0 auto; do
            stage_pp+=" $stage $(timeout 120 "$BIN/minids" bench -m "$f" -p 512 -n 0 -r 3 -o md \
                --vram-budget 12GiB --expert-prompt-stage $stage 2>/dev/null | tok_s pp512);"
        done
        say "offload 12GiB, prompt stage: pp512 tok/s by --expert-prompt-stage:$stage_pp"
        if [[ $FETCH_COMPARE == 1 ]]; then
            timeout 300 "$BIN/minids" bench -m "$f" -p 512 -n 128 -r 2 -o md --vram-budget 12GiB \
                --expert-cache-copy-stream --expert-cache-admit frequency \
                > "$OUT/bench_offload_12g_cs.md" 2> "$OUT/bench_offload_12g_cs.log"
            say "offload 12GiB, copy stream + frequency admission: rc=$?"
        fi
        if [[ $AB_OFFLOAD == 1 ]]; then
            local i=0
            for ab in ${AB[@]+"${AB[@]}"}; do
                i=$((i + 1))
                for round in 1 2; do
                    for setting in "$ab" default; do
                        local t="$OUT/bench_offload_12g_ab${i}_${round}_${setting%%=*}.md"
                        env $([[ $setting != default ]] && echo "$setting") timeout 300 "$BIN/minids" bench \
                            -m "$f" -p 512 -n 128 -r 1 -o md --vram-budget 12GiB > "$t" 2>/dev/null
                        grep -E '\| (cold|warm), ' "$t" | while read -r line; do
                            say "bench offload 12GiB ($setting, round $round) phase: $line"
                        done
                    done
                done
            done
        fi
        # Every expert a hit (issue 10: within 5 % of the resident speed): a replayed trace whose
        # experts never change (stickiness 1: each token reuses the previous token's six), so
        # 156 experts, all in slots after the first token; the same replay fully resident. With
        # --ab-hits the pair again under each --ab setting.
        "$BIN/minids" routing gen --preset v2-lite --stickiness 1 -n 4096 "$WORK/sticky.npz" > /dev/null 2>&1
        every_hit "$f" ""
        [[ $KERNEL_TRACE == 1 ]] && kernel_trace_hits "$f"
        if [[ $AB_HITS == 1 ]]; then
            local i=0
            for ab in ${AB[@]+"${AB[@]}"}; do
                i=$((i + 1))
                every_hit "$f" "$ab" "_ab$i"
            done
        fi
        for t in "$OUT/bench_offload_12g.md" "$OUT/bench_offload_208.md" "$OUT/bench_offload_12g_cs.md" \
            "$OUT/bench_offload_12g_staging.md"; do
            grep -E '\| (pp|tg)[0-9]' "$t" 2>/dev/null | while read -r line; do say "bench offload $(basename "$t" .md): $line"; done
        done
        for t in "$OUT/bench_offload_12g.md" "$OUT/bench_offload_208.md" "$OUT/bench_offload_12g_cs.md" \
            "$OUT/bench_offload_12g_staging.md" "$OUT/bench_offload_12g_prefetch.md" \
            "$OUT/bench_offload_12g_prefetch_uncapped.md" "$OUT/bench_offload_12g_prefetch_side.md" \
            "$OUT/bench_offload_12g_kernel.md"; do
            grep -E '\| (cold|warm), ' "$t" 2>/dev/null | while read -r line; do say "bench offload $(basename "$t" .md) phase: $line"; done
        done
    fi
    if [[ $PROFILE == 1 && $1 == f8_e4m3 ]]; then
        MINIDS_CUDA_PROFILE=1 timeout 200 "$BIN/minids" bench -m "$f" -p 512 -n 64 -r 1 -o md \
            > /dev/null 2> "$OUT/profile_f8.log"
        MINIDS_CUDA_PROFILE=1 timeout 200 "$BIN/minids" bench -m "$f" -p 0 -n 32 -d 32768 -r 1 \
            -o md > /dev/null 2> "$OUT/profile_f8_d32k.log"
        say "profile f8_e4m3: $(grep -c 'cuda profile' "$OUT/profile_f8.log") tables in profile_f8.log"
        # The expert cache's decode step per launch: the expert_fetch rows are the time the
        # step spends fetching misses (its stall on the host link).
        MINIDS_CUDA_PROFILE=1 timeout 200 "$BIN/minids" bench -m "$f" -p 512 -n 64 -r 1 -o md \
            --vram-budget 12GiB > /dev/null 2> "$OUT/profile_f8_offload.log"
        say "profile f8_e4m3 offload 12GiB, decode graph: $(grep -m1 -E '^ +[0-9.]+ +[0-9.]+% +[0-9]+ +[0-9.]+ +expert_fetch' "$OUT/profile_f8_offload.log" | awk '{print $2 " of the step in expert_fetch (" $1 " us per token)"}')"
    fi
    for t in "$OUT/bench_$1.md" "$OUT/bench_$1_d32k.md"; do
        [[ -f $t ]] && grep -E '\| (pp|tg)[0-9]' "$t" | while read -r line; do say "bench $1: $line"; done
    done
    rm -f "$f"
}
bench_model f8_e4m3
[[ $QUICK == 0 ]] && bench_model bf16
say "benchmarks done [$(elapsed)]"

# 3b. Optional: every kernel of one decode step under Nsight Compute.
if [[ $NCU == 1 ]]; then
    BIN="$BIN" OUT="$OUT" WORK="$WORK" timeout 300 scripts/ncu_decode.sh > "$OUT/ncu_summary.txt" 2>&1
    say "ncu decode step: rc=$? $(sed -n 2p "$OUT/ncu_summary.txt")"
    sed -n 4,9p "$OUT/ncu_summary.txt" | cut -c1-140 | while read -r l; do say "  $l"; done
fi

# 4. Optional: kernel benchmarks (tables in $OUT/bench_*_cuda.log, summaries below).
if [[ $KERNELS == 1 ]]; then
    # The stream GEMV's shapes on the decode products first (about a minute).
    timeout 200 "$BIN/bench_matvec_cuda" --stream-sweep > "$OUT/bench_stream_sweep.log" 2>&1
    say "kernel bench stream sweep: rc=$? (table in bench_stream_sweep.log)"
    for b in matvec mla moe; do
        timeout 200 "$BIN/bench_${b}_cuda" > "$OUT/bench_${b}_cuda.log" 2>&1
        say "kernel bench $b: rc=$? ($(wc -l < "$OUT/bench_${b}_cuda.log") lines)"
    done
fi

# 5. Optional: the variant fixtures from transformers (issue 13) and the full-size check.
if [[ $FIXTURES == 1 ]]; then
    timeout 400 python3 scripts/make_variant_fixtures.py "$WORK/fx" > "$OUT/fixtures.log" 2>&1
    say "variant fixtures: rc=$? $(tail -1 "$WORK/fx/summary.txt" 2>/dev/null)"
    cp "$WORK/fx/variants.tar.gz" "$OUT/" 2>/dev/null
    cp "$WORK/fx/summary.txt" "$OUT/fixtures_summary.txt" 2>/dev/null
fi
if [[ $FULL == 1 ]]; then
    OUT="$OUT/full_size" MINIDS="$BIN/minids" scripts/full_size_check.sh > "$OUT/full_size.log" 2>&1
    say "full-size check: rc=$?"
    grep -E "rel|greedy|PASS|FAIL|SKIP" "$OUT/full_size/summary.txt" 2>/dev/null | head -20 | while read -r l; do say "  $l"; done
fi
say "gpu_check done in $(elapsed)"
