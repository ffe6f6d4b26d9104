// The host side of prefetch by the copy engines (runtime/prefetch_proxy.h) on the CPU backend,
// whose transfer queue copies at once: requests posted into the ring as the device posts them
// are copied in order, each followed by the served count in the done word; a bad request stops
// the thread with a message instead of copying.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "mgl.h"
#include "runtime/prefetch_proxy.h"

using namespace minids;

namespace {

constexpr size_t kBytes = 4096;

// Posts `req` as the device does: the request first, then the count (release).
void post(mgl::expert_prefetch_ring& ring, const mgl::expert_prefetch_request& req) {
    ring.requests[ring.posted % ring.capacity] = req;
    std::atomic_ref<int64_t>(ring.posted).fetch_add(1, std::memory_order_release);
}

// Waits (at most 5 s) until the done word reaches `n`.
bool wait_done(const int64_t& done, int64_t n) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (std::atomic_ref<const int64_t>(done).load(std::memory_order_acquire) < n) {
        if (std::chrono::steady_clock::now() > until) return false;
        std::this_thread::yield();
    }
    return true;
}

}  // namespace

TEST_CASE("prefetch proxy: posted requests are copied in order and counted in the done word") {
    auto be = mgl::make_cpu_backend(1);
    const int n_keys = 6, n_slots = 3;
    std::vector<std::vector<uint8_t>> homes(n_keys, std::vector<uint8_t>(kBytes));
    for (int k = 0; k < n_keys; ++k)
        for (size_t i = 0; i < kBytes; ++i) homes[size_t(k)][i] = uint8_t(k * 31 + i);
    std::vector<std::vector<uint8_t>> slots(n_slots, std::vector<uint8_t>(kBytes, 0));
    int64_t done = 0;
    PrefetchProxy proxy(*be, 4, kBytes, &done, [&](int32_t key, int32_t slot) {
        if (key < 0 || key >= n_keys || slot < 0 || slot >= n_slots)
            throw std::logic_error("request out of range");
        return std::pair<const void*, void*>(homes[size_t(key)].data(), slots[size_t(slot)].data());
    });
    auto& ring = *reinterpret_cast<mgl::expert_prefetch_ring*>(proxy.ring_address());
    REQUIRE(ring.capacity == 4);
    // More requests than the ring holds, in batches that fit it (as the device's layers post).
    const std::vector<std::vector<mgl::expert_prefetch_request>> batches = {
        {{0, 0}, {1, 1}}, {{2, 2}, {3, 0}, {4, 1}}, {{5, 2}}};
    int64_t posted = 0;
    for (const auto& batch : batches) {
        for (const auto& r : batch) post(ring, r);
        posted += int64_t(batch.size());
        REQUIRE(wait_done(done, posted));
        for (const auto& r : batch) CHECK(slots[size_t(r.slot)] == homes[size_t(r.key)]);
    }
    CHECK(proxy.served() == posted);
    proxy.drain();
    CHECK_NOTHROW(proxy.check());
}

TEST_CASE("prefetch proxy: a request out of range stops the thread with a message") {
    auto be = mgl::make_cpu_backend(1);
    std::vector<uint8_t> home(kBytes, 7), slot(kBytes, 0);
    int64_t done = 0;
    PrefetchProxy proxy(*be, 4, kBytes, &done, [&](int32_t key, int32_t s) {
        if (key != 0 || s != 0) throw std::logic_error("a request for expert 9 is out of range");
        return std::pair<const void*, void*>(home.data(), slot.data());
    });
    auto& ring = *reinterpret_cast<mgl::expert_prefetch_ring*>(proxy.ring_address());
    post(ring, {9, 0});
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    bool stopped = false;
    while (!stopped && std::chrono::steady_clock::now() < until) {
        try {
            proxy.check();
            std::this_thread::yield();
        } catch (const std::runtime_error& e) {
            stopped = true;
            CHECK(std::string(e.what()).find("out of range") != std::string::npos);
        }
    }
    CHECK(stopped);
    CHECK(done == 0);  // nothing was copied or counted
    CHECK(slot == std::vector<uint8_t>(kBytes, 0));
}
