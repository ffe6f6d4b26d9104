#include "model/staged_copy.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <thread>

namespace minids {

namespace {
// Below this a memcpy is not worth waking threads for.
constexpr size_t kParallelMin = size_t(4) << 20;
}  // namespace

StagedCopier::StagedCopier(mgl::backend& backend, size_t chunk_bytes, unsigned threads)
    : backend_(backend),
      chunk_(std::max<size_t>(chunk_bytes, 1 << 20)),
      threads_(std::max(1u, threads)) {
    for (auto& b : buffers_) b = backend_.alloc_host_buffer(chunk_);
}

StagedCopier::~StagedCopier() {
    // Transfers may still read the staging buffers: wait before they are freed (no throw here).
    try {
        if (in_flight_ || !segments_.empty()) backend_.synchronize();
    } catch (...) {
    }
}

unsigned load_copy_threads() {
    if (const char* env = std::getenv("MINIDS_LOAD_THREADS")) {
        const long n = std::strtol(env, nullptr, 10);
        if (n >= 1 && n <= 64) return unsigned(n);
    }
    return std::min(8u, std::max(1u, std::thread::hardware_concurrency()));
}

void parallel_memcpy(uint8_t* dst, const uint8_t* src, size_t n, unsigned threads) {
    if (n < kParallelMin || threads <= 1) {
        std::memcpy(dst, src, n);
        return;
    }
    const size_t part = (n / threads + 4095) / 4096 * 4096;
    std::vector<std::thread> workers;
    size_t o = part;
    try {
        workers.reserve(threads);
        for (; o < n; o += part)
            workers.emplace_back([=] { std::memcpy(dst + o, src + o, std::min(part, n - o)); });
    } catch (const std::exception&) {
        // No more threads (ulimit): the parts not handed out are copied by this thread below.
    }
    std::memcpy(dst, src, std::min(part, n));
    for (; o < n; o += part) std::memcpy(dst + o, src + o, std::min(part, n - o));
    for (auto& w : workers) w.join();
}

void StagedCopier::copy(void* dst, const void* src, uint64_t n) {
    auto* d = static_cast<uint8_t*>(dst);
    const auto* s = static_cast<const uint8_t*>(src);
    while (n > 0) {
        if (filled_ == chunk_) flush();
        const size_t m = size_t(std::min<uint64_t>(n, chunk_ - filled_));
        auto* staging = static_cast<uint8_t*>(buffers_[current_]->base());
        parallel_memcpy(staging + filled_, s, m, threads_);
        segments_.push_back({d, filled_, m});
        filled_ += m;
        d += m;
        s += m;
        n -= m;
    }
}

void StagedCopier::flush() {
    if (segments_.empty()) return;
    // The other buffer's transfers must be done before this buffer's are queued: the next fill
    // goes into that other buffer.
    if (in_flight_) backend_.synchronize();
    const auto* staging = static_cast<const uint8_t*>(buffers_[current_]->base());
    for (const Segment& sg : segments_) {
        backend_.copy_to_backend_async(sg.dst, staging + sg.offset, sg.size);
    }
    segments_.clear();
    in_flight_ = true;
    current_ ^= 1;
    filled_ = 0;
}

void StagedCopier::finish() {
    flush();
    if (in_flight_) backend_.synchronize();
    in_flight_ = false;
}

}  // namespace minids
