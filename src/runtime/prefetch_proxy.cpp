#include "runtime/prefetch_proxy.h"

#include <atomic>
#include <chrono>
#include <stdexcept>

namespace minids {

PrefetchProxy::PrefetchProxy(mgl::backend& backend, int64_t capacity, size_t bytes,
                             int64_t* done_word, Resolve resolve)
    : ring_buf_(backend.alloc_host_buffer(mgl::expert_prefetch_ring_bytes(capacity))),
      queue_(backend.make_transfer_queue()),
      bytes_(bytes),
      done_word_(done_word),
      resolve_(std::move(resolve)) {
    if (capacity < 1) throw std::invalid_argument("prefetch proxy: an empty ring");
    mgl::expert_prefetch_ring* r = ring();
    r->posted = 0;
    r->capacity = capacity;
    thread_ = std::thread([this] { run(); });
}

PrefetchProxy::~PrefetchProxy() {
    stop_.store(true, std::memory_order_release);
    if (thread_.joinable()) thread_.join();
    try {
        queue_->drain();
    } catch (...) {
    }
}

mgl::expert_prefetch_ring* PrefetchProxy::ring() const {
    return static_cast<mgl::expert_prefetch_ring*>(ring_buf_->base());
}

int64_t PrefetchProxy::ring_address() const { return reinterpret_cast<int64_t>(ring()); }

void PrefetchProxy::check() const {
    std::lock_guard<std::mutex> lock(error_mutex_);
    if (!error_.empty()) throw std::runtime_error("expert cache, prefetch proxy: " + error_);
}

std::string PrefetchProxy::slowest_issue() const {
    return ", slowest issue " +
           std::to_string(slowest_issue_ns_.load(std::memory_order_relaxed) / 1000) + " us";
}

void PrefetchProxy::drain() {
    const int64_t posted = std::atomic_ref<int64_t>(ring()->posted).load(std::memory_order_acquire);
    while (served() < posted) {
        check();
        std::this_thread::yield();
    }
    queue_->drain();
}

// Polls the ring: busy while requests come (a decode step posts one batch per MoE layer, a few
// hundred microseconds apart, and each microsecond of delay is one the next fetch may wait),
// every 200 us after 50 ms without one (between answers).
void PrefetchProxy::run() {
    mgl::expert_prefetch_ring* r = ring();
    const int64_t capacity = r->capacity;
    std::atomic_ref<int64_t> posted_ref(r->posted);
    auto last = std::chrono::steady_clock::now();
    try {
        int64_t served = 0;
        while (!stop_.load(std::memory_order_acquire)) {
            const int64_t posted = posted_ref.load(std::memory_order_acquire);
            if (posted == served) {
                if (std::chrono::steady_clock::now() - last > std::chrono::milliseconds(50))
                    std::this_thread::sleep_for(std::chrono::microseconds(200));
                continue;
            }
            if (posted < served || posted - served > capacity)
                throw std::logic_error("the ring's count went from " + std::to_string(served) +
                                       " to " + std::to_string(posted));
            for (; served < posted; ++served) {
                const mgl::expert_prefetch_request req = r->requests[served % capacity];
                const auto [src, dst] = resolve_(req.key, req.slot);
                const auto t0 = std::chrono::steady_clock::now();
                queue_->copy(dst, src, bytes_);
                queue_->signal(done_word_, served + 1);
                const int64_t ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                                       std::chrono::steady_clock::now() - t0)
                                       .count();
                if (ns > slowest_issue_ns_.load(std::memory_order_relaxed))
                    slowest_issue_ns_.store(ns, std::memory_order_relaxed);
                served_.store(served + 1, std::memory_order_release);
            }
            last = std::chrono::steady_clock::now();
        }
    } catch (const std::exception& e) {
        std::lock_guard<std::mutex> lock(error_mutex_);
        error_ = e.what();
    }
}

}  // namespace minids
