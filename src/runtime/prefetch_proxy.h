// The host side of prefetch by the copy engines: a thread that serves the copy requests the
// device fetch's prefetches post (mgl::expert_prefetch_ring, in pinned host memory the device
// writes) with copies on a transfer queue of their own, each followed by a signal the device's
// next fetch polls (mgl::expert_fetch_header::proxy_done).
//
// Why a host thread: a copy the device chooses, made by the device itself (a conditional graph
// node, a graph launched from a kernel), stalled the kernels beside it for about the copy's
// whole time on the H200, where the same copy issued by the host did not slow them at all
// (scripts/bench_dma_*_cuda, docs/expert-cache.md "Prefetch by the copy engines").
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

#include "mgl.h"

namespace minids {

class PrefetchProxy {
public:
    // Where a request's bytes come from (host memory) and go (backend memory); throws for a
    // request out of range.
    using Resolve = std::function<std::pair<const void*, void*>(int32_t key, int32_t slot)>;
    // `capacity` requests in the ring; each copy moves `bytes`; `done_word` (backend memory) gets
    // the count of requests served after each copy. Starts the thread.
    PrefetchProxy(mgl::backend& backend, int64_t capacity, size_t bytes, int64_t* done_word,
                  Resolve resolve);
    // Stops the thread and waits for its copies.
    ~PrefetchProxy();
    PrefetchProxy(const PrefetchProxy&) = delete;
    PrefetchProxy& operator=(const PrefetchProxy&) = delete;

    // The ring's address, for the device (pinned memory: the same address there).
    int64_t ring_address() const;
    // Requests served so far (for the header's counters when the state is written again).
    int64_t served() const { return served_.load(std::memory_order_acquire); }
    // Throws what stopped the thread, if something did.
    void check() const;
    // Waits until every request posted so far has been served and its copy has landed.
    void drain();
    // ", slowest issue N us" (the longest a copy and its signal took to queue), for messages.
    std::string slowest_issue() const;

private:
    void run();
    mgl::expert_prefetch_ring* ring() const;

    mgl::buffer_ptr ring_buf_;
    std::unique_ptr<mgl::transfer_queue> queue_;
    size_t bytes_;
    int64_t* done_word_;
    Resolve resolve_;
    std::atomic<int64_t> served_{0};
    std::atomic<int64_t> slowest_issue_ns_{0};
    std::atomic<bool> stop_{false};
    mutable std::mutex error_mutex_;
    std::string error_;
    std::thread thread_;
};

}  // namespace minids
