// Where the time of a replayed graph goes, launch by launch (MINIDS_CUDA_PROFILE=1).
//
// There is no Nsight Systems on the GPU machine and ncu serializes kernels, so the backend
// measures itself: the profiled recording has a timing event between consecutive launches
// (captured as event-record nodes, so they replay with the graph), and after each replay the
// elapsed time of every launch is added up. The extra nodes cost about a graph node each
// (~0.7 us); the table says so. Eager runs (prompt chunks) are timed launch by launch with the
// queue drained before each, so each row also holds one launch latency (~4 us). It is printed to
// stderr when the backend is destroyed, grouped by launch kind and node name with layer numbers
// folded ("blk.#.attn_q").
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace mgl::cuda {

// Milliseconds per folded label summed over runs, and how many runs were summed.
struct profile_table {
    std::map<std::string, std::pair<double, int>> rows;  // label -> (ms, launches per run)
    uint64_t runs = 0;
    // Largest first, with the share of the measured step time.
    std::string format(const std::string& title) const;
};

class step_profile {
public:
    step_profile() = default;
    step_profile(const step_profile&) = delete;
    step_profile& operator=(const step_profile&) = delete;
    ~step_profile();

    // Before launch `i` (of `labels.size()`), and once after the last; `capturing` while the
    // stream is being captured into a graph.
    void set_labels(std::vector<std::string> labels);
    bool has_labels() const { return !events_.empty(); }
    void mark(size_t i, cudaStream_t s, bool capturing);
    // After a replay has been enqueued: waits for it and adds each launch's time.
    void collect(cudaStream_t s);
    bool empty() const { return replays_ == 0; }
    // Adds this recording's totals to `into` (graphs of one shape, e.g. every prompt chunk of
    // 512 tokens, are summed into one table).
    void merge_into(struct profile_table& into) const;

private:
    std::vector<std::string> labels_;
    std::vector<cudaEvent_t> events_;  // labels_.size() + 1
    std::vector<double> ms_;           // per launch, summed over replays
    uint64_t replays_ = 0;
};

// MINIDS_CUDA_REPLAY_TIMER=1: the GPU time of every graph replay, from an event recorded just
// before the launch to one just after it (two events per replay, no per-launch ones), so a
// benchmark can tell the replayed step itself from the host's gap between steps (wall time per
// token minus this). Printed to stderr per graph shape when the backend is destroyed.
class replay_timer {
public:
    replay_timer() = default;
    replay_timer(const replay_timer&) = delete;
    replay_timer& operator=(const replay_timer&) = delete;
    ~replay_timer();

    // Around one replay's launch on `s`. before() first collects the previous replay's time
    // (waiting for it if it has not finished, which a decode loop has already done).
    void before(cudaStream_t s, const std::string& title);
    void after(cudaStream_t s);
    // "cuda replay timer: TITLE: N replays, GPU time per replay median X us, mean Y us" lines.
    std::string format();

private:
    void collect();
    cudaEvent_t start_ = nullptr, end_ = nullptr;
    std::string pending_;  // title of the replay whose events are recorded but not collected
    std::map<std::string, std::vector<float>> us_;
};

}  // namespace mgl::cuda
