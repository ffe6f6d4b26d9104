// The staging store's stage (mgl.h, expert_stage_header): its layout, and the host's copies of a
// layer's posted fills into it, which both backends run (the CPU's expert_fetch inline, the CUDA
// backend in a host node of the step between the plan and the copy kernels).
#include <algorithm>
#include <cstring>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "mgl.h"

namespace mgl {

namespace {

constexpr int64_t stage_align = 256;
int64_t align_up(int64_t n) { return (n + stage_align - 1) / stage_align * stage_align; }

// Threads for one layer's copies out of pageable memory: one memcpy reads a few GB/s, so a
// decoded token's six 8.6 MB experts (V2-Lite FP8) take several threads to approach the link;
// the weight load's copies found 8 the best on the H200 machine (src/model/staged_copy.h).
constexpr int64_t serve_threads = 8;
// Below this, one piece per thread is not worth a thread.
constexpr int64_t min_piece = int64_t(1) << 20;

}  // namespace

expert_stage_header expert_stage_layout(int64_t capacity, int64_t blob_bytes) {
    MGL_CHECK(capacity > 0 && blob_bytes > 0, "expert stage: " + std::to_string(capacity) +
                                                  " buffers of " + std::to_string(blob_bytes) +
                                                  " bytes");
    expert_stage_header h;
    h.capacity = capacity;
    h.blob_bytes = blob_bytes;
    h.stride = align_up(blob_bytes);
    h.buffer_offset = align_up(int64_t(sizeof(expert_stage_header)) + capacity * 8);
    return h;
}

size_t expert_stage_bytes(const expert_stage_header& h) {
    return size_t(h.buffer_offset + h.capacity * h.stride);
}

void expert_stage_serve(expert_stage_header& h) {
    MGL_CHECK(h.n >= 0 && h.n <= h.capacity, "expert stage: " + std::to_string(h.n) +
                                                 " fills posted for " + std::to_string(h.capacity) +
                                                 " buffers");
    const int64_t* src = expert_stage_sources(&h);
    // The posted bytes as one range split into equal pieces (a fill may span pieces).
    const int64_t total = h.n * h.blob_bytes;
    const int64_t n_threads = std::clamp<int64_t>(total / min_piece, 1, serve_threads);
    const int64_t piece = (total + n_threads - 1) / n_threads;
    auto copy_range = [&](int64_t begin, int64_t end) {
        while (begin < end) {
            const int64_t i = begin / h.blob_bytes, at = begin % h.blob_bytes;
            const int64_t n = std::min(end - begin, h.blob_bytes - at);
            std::memcpy(expert_stage_buffer(&h, i) + at,
                        reinterpret_cast<const uint8_t*>(src[i]) + at, size_t(n));
            begin += n;
        }
    };
    std::vector<std::thread> helpers;
    for (int64_t t = 1; t < n_threads; ++t) {
        const int64_t begin = std::min(total, t * piece), end = std::min(total, (t + 1) * piece);
        try {
            helpers.emplace_back(copy_range, begin, end);
        } catch (const std::system_error&) {  // no thread to be had: the caller copies it
            copy_range(begin, end);
        }
    }
    copy_range(0, std::min(total, piece));
    for (std::thread& t : helpers) t.join();
}

}  // namespace mgl
