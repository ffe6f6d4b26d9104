// Where the host link idles (MINIDS_LINK_TRACE=1): a transfer queue's copies timed on the device
// by an event before and after each one, and at the end the copies' time and the gaps between
// them, by size, printed to stderr. A gap is the link waiting for the next copy to be issued: for
// the expert cache's copy engines (the prefetch proxy), between a decode step's last copy and the
// next step's first, or after a MoE layer's copies while nothing else was posted. The gaps are
// also split in two by where the next copy reads: a step's copies go up the layers, and the
// expert store holds the layers in order, so a next source far below the last one (more than a
// quarter of the sources' range) starts a new step. Each copy costs two event records on the
// issuing host thread (~1-2 us), which the trip to the next copy pays: the traced run is slower.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <string>
#include <vector>

#include "cuda_resources.h"

namespace mgl::cuda {

class link_trace {
public:
    explicit link_trace(std::string title) : title_(std::move(title)) {}
    link_trace(const link_trace&) = delete;
    link_trace& operator=(const link_trace&) = delete;
    // Prints the summary (the stream must be drained first).
    ~link_trace();
    // Around one copy of `bytes` from `src` queued on `s`.
    void before(cudaStream_t s, const void* src);
    void after(cudaStream_t s, size_t bytes);

    // The summary of copies that took `copy_ms` each and started `gap_ms` after the one before
    // (negative: queued behind it, no gap); `new_step[i]` when gap i starts a new step.
    static std::string summarize(const std::vector<double>& copy_ms,
                                 const std::vector<double>& gap_ms,
                                 const std::vector<bool>& new_step, size_t bytes);

private:
    std::string title_;
    struct timed_copy {
        event start{true}, end{true};
        size_t bytes = 0;
        const char* src = nullptr;
    };
    std::vector<timed_copy> copies_;
    bool open_ = false;
};

}  // namespace mgl::cuda
