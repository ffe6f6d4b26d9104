// The staging store's stage (mgl.h, expert_stage_header): its layout, and the host's copies of a
// layer's posted fills into it, which both backends run (the CPU's expert_fetch inline, the CUDA
// backend in a host node of the step between the plan and the copy kernels).
#include <algorithm>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <system_error>

#include "cpu/thread_pool.h"
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

// The serve's threads: started by the first serve (only the staging store serves), kept for the
// process, shared by every stage, one serve at a time. Threads started and joined for each layer
// cost more than a layer's copies can spare: seven took 2.1-4.3 ms on the 2-core development
// machine, and a decoded token serves up to 26 layers.
std::mutex serve_mutex;
cpu::thread_pool* serve_pool() {  // under serve_mutex
    static std::unique_ptr<cpu::thread_pool> pool;
    static bool tried = false;
    if (!tried) {
        tried = true;
        try {
            pool = std::make_unique<cpu::thread_pool>(int(serve_threads));
        } catch (const std::system_error&) {  // no threads to be had: the caller copies alone
        }
    }
    return pool.get();
}

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
    const std::function<void(int64_t, int64_t)> copy_range = [&](int64_t begin, int64_t end) {
        while (begin < end) {
            const int64_t i = begin / h.blob_bytes, at = begin % h.blob_bytes;
            const int64_t n = std::min(end - begin, h.blob_bytes - at);
            std::memcpy(expert_stage_buffer(&h, i) + at,
                        reinterpret_cast<const uint8_t*>(src[i]) + at, size_t(n));
            begin += n;
        }
    };
    std::lock_guard<std::mutex> lock(serve_mutex);
    if (cpu::thread_pool* pool = serve_pool()) {
        pool->parallel_for(total, copy_range, min_piece);
    } else {
        copy_range(0, total);
    }
}

}  // namespace mgl
