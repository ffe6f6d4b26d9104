// Host time of the expert cache's own work (OffloadStats::host_ns, host_beside_ns).
#pragma once

#include <chrono>
#include <cstdint>

namespace minids {

// Adds the scope's duration to `ns`.
class HostTime {
public:
    explicit HostTime(uint64_t& ns) : ns_(ns) {}
    ~HostTime() {
        ns_ += uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(
                            std::chrono::steady_clock::now() - t0_)
                            .count());
    }
    HostTime(const HostTime&) = delete;
    HostTime& operator=(const HostTime&) = delete;

private:
    uint64_t& ns_;
    std::chrono::steady_clock::time_point t0_ = std::chrono::steady_clock::now();
};

}  // namespace minids
