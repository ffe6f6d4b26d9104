#include "link_trace.h"

#include <cstdio>
#include <sstream>

namespace mgl::cuda {

namespace {
// Enough for a benchmark's decode phases (~40 copies per token); later copies go untimed.
constexpr size_t kMostCopies = 200'000;
}  // namespace

void link_trace::before(cudaStream_t s) {
    if (copies_.size() >= kMostCopies) return;
    copies_.emplace_back();
    copies_.back().start.record(s);
    open_ = true;
}

void link_trace::after(cudaStream_t s, size_t bytes) {
    if (!open_) return;
    copies_.back().end.record(s);
    copies_.back().bytes = bytes;
    open_ = false;
}

std::string link_trace::summarize(const std::vector<double>& copy_ms,
                                  const std::vector<double>& gap_ms, size_t bytes) {
    // Gap sizes in us: up to 2 us is back to back (the next copy was queued behind); 2 ms and
    // more is between answers or benchmark phases, not a step's idle link.
    const double edges[] = {2, 10, 30, 60, 100, 200, 500, 2000};
    constexpr int n_buckets = sizeof(edges) / sizeof(edges[0]) + 1;
    int count[n_buckets] = {};
    double sum[n_buckets] = {};
    double busy = 0, idle = 0;
    for (double c : copy_ms) busy += c;
    for (double g : gap_ms) {
        const double us = g * 1000.0;
        int b = 0;
        while (b < n_buckets - 1 && us >= edges[b]) ++b;
        ++count[b];
        sum[b] += g;
        if (b < n_buckets - 1) idle += g > 0 ? g : 0;
    }
    std::ostringstream o;
    o.setf(std::ios::fixed);
    o.precision(2);
    const double gbps = busy > 0 ? double(bytes) / (busy * 1e6) : 0;
    o << copy_ms.size() << " copies, " << double(bytes) / (1024.0 * 1024.0) << " MiB in " << busy
      << " ms (" << gbps << " GB/s while copying); idle between copies (gaps under 2 ms) " << idle
      << " ms\n";
    for (int b = 0; b < n_buckets; ++b) {
        if (!count[b]) continue;
        o << "  gap ";
        if (b == 0)
            o << "< " << edges[0] << " us";
        else if (b == n_buckets - 1)
            o << ">= " << edges[b - 1] << " us (not counted)";
        else
            o << edges[b - 1] << "-" << edges[b] << " us";
        o << ": " << count[b] << " gaps, " << (b == 0 ? 0.0 : sum[b]) << " ms";
        if (count[b] && b > 0) o << " (mean " << sum[b] * 1000.0 / count[b] << " us)";
        o << "\n";
    }
    return o.str();
}

link_trace::~link_trace() {
    try {
        if (copies_.empty()) return;
        if (open_) copies_.pop_back();
        std::vector<double> copy_ms, gap_ms;
        size_t bytes = 0;
        for (size_t i = 0; i < copies_.size(); ++i) {
            copies_[i].end.synchronize();
            copy_ms.push_back(copies_[i].end.elapsed_since(copies_[i].start));
            bytes += copies_[i].bytes;
            if (i > 0) gap_ms.push_back(copies_[i].start.elapsed_since(copies_[i - 1].end));
        }
        std::fprintf(stderr, "link trace (%s): %s", title_.c_str(),
                     summarize(copy_ms, gap_ms, bytes).c_str());
    } catch (...) {
        // A trace must not turn a clean exit into a crash.
    }
}

}  // namespace mgl::cuda
