// Host -> backend bulk copies through pinned staging buffers, for the one-time weight load.
//
// A copy from pageable memory (the file mapping) runs at 6-10 GB/s on the H200 machine: the
// driver stages it through its own pinned buffers with one thread. Registering the whole mapping
// instead did not return in 45 s on a 17 GB file (docs/perf.md). Here several threads copy the
// mapping into one of two pinned buffers while the backend's DMA empties the other, so the load
// runs at the speed of a parallel memcpy out of the page cache, not of the driver's staging.
// Small pieces (norm weights, scales) are packed into the current buffer and sent together.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "mgl.h"

namespace minids {

// dst[0, n) <- src[0, n) split over up to `threads` threads (the caller's among them); below a
// few MiB, or when no thread can be started, the caller copies alone.
void parallel_memcpy(uint8_t* dst, const uint8_t* src, size_t n, unsigned threads);

// Threads for the weight load's copies out of the file mapping: MINIDS_LOAD_THREADS (1-64) when
// set, else the hardware's up to 8. More did not pay on the H200 machine's 16 cores: the BF16
// V2-Lite experts' staged copy took 1.90 / 2.08 s with 8 threads, 2.48 / 2.66 s with 12 and
// 2.83 / 3.61 s with 16 (~11 GB/s at best, docs/perf.md).
unsigned load_copy_threads();

class StagedCopier {
public:
    // `chunk_bytes` per staging buffer (two are allocated), `threads` memcpy workers.
    StagedCopier(mgl::backend& backend, size_t chunk_bytes, unsigned threads);
    ~StagedCopier();
    StagedCopier(const StagedCopier&) = delete;
    StagedCopier& operator=(const StagedCopier&) = delete;

    // Queues dst[0, n) <- src[0, n); may wait for an earlier chunk's transfer. `src` may be
    // released when this returns; `dst` is written by the time finish() returns.
    void copy(void* dst, const void* src, uint64_t n);
    // Sends what is packed and waits for every transfer.
    void finish();

private:
    struct Segment {
        uint8_t* dst;
        size_t offset, size;
    };
    void flush();

    mgl::backend& backend_;
    size_t chunk_;
    unsigned threads_;
    mgl::buffer_ptr buffers_[2];
    int current_ = 0;
    size_t filled_ = 0;
    bool in_flight_ = false;  // the other buffer's transfers may still run
    std::vector<Segment> segments_;
};

}  // namespace minids
