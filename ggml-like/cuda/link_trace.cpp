#include "link_trace.h"

#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <sstream>

namespace mgl::cuda {

namespace {
// Enough for a benchmark's decode phases (~40 copies per token); later copies go untimed.
constexpr size_t kMostCopies = 200'000;
}  // namespace

void link_trace::before(cudaStream_t s, const void* src) {
    if (copies_.size() >= kMostCopies) return;
    copies_.emplace_back();
    copies_.back().src = static_cast<const char*>(src);
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
                                  const std::vector<double>& gap_ms,
                                  const std::vector<bool>& new_step, size_t bytes) {
    // Gap sizes in us: up to 2 us is back to back (the next copy was queued behind); 2 ms and
    // more is between answers or benchmark phases, not a step's idle link.
    const double edges[] = {2, 10, 30, 60, 100, 200, 500, 2000};
    constexpr int n_buckets = sizeof(edges) / sizeof(edges[0]) + 1;
    struct histogram {
        int count[n_buckets] = {};
        double sum[n_buckets] = {};
        int idle_count = 0;
        double idle = 0;
    } within, steps;
    double busy = 0;
    for (double c : copy_ms) busy += c;
    for (size_t i = 0; i < gap_ms.size(); ++i) {
        const double g = gap_ms[i], us = g * 1000.0;
        histogram& h = i < new_step.size() && new_step[i] ? steps : within;
        int b = 0;
        while (b < n_buckets - 1 && us >= edges[b]) ++b;
        ++h.count[b];
        h.sum[b] += g;
        if (b > 0 && b < n_buckets - 1) {
            h.idle += g;
            ++h.idle_count;
        }
    }
    std::ostringstream o;
    o.setf(std::ios::fixed);
    o.precision(2);
    const double gbps = busy > 0 ? double(bytes) / (busy * 1e6) : 0;
    o << copy_ms.size() << " copies, " << double(bytes) / (1024.0 * 1024.0) << " MiB in " << busy
      << " ms (" << gbps << " GB/s while copying); idle between copies (gaps of 2 us to 2 ms) "
      << within.idle + steps.idle << " ms: " << steps.idle << " ms in " << steps.idle_count
      << " gaps before a step's first copy, " << within.idle << " ms in " << within.idle_count
      << " within steps\n";
    for (const auto& [name, h] : {std::pair<const char*, const histogram&>{"within steps", within},
                                  {"before a step's first copy", steps}}) {
        for (int b = 0; b < n_buckets; ++b) {
            if (!h.count[b]) continue;
            o << "  " << name << ", gap ";
            if (b == 0)
                o << "< " << edges[0] << " us";
            else if (b == n_buckets - 1)
                o << ">= " << edges[b - 1] << " us (not counted)";
            else
                o << edges[b - 1] << "-" << edges[b] << " us";
            o << ": " << h.count[b] << " gaps";
            if (b > 0)
                o << ", " << h.sum[b] << " ms (mean " << h.sum[b] * 1000.0 / h.count[b] << " us)";
            o << "\n";
        }
    }
    return o.str();
}

link_trace::~link_trace() {
    try {
        if (copies_.empty()) return;
        if (open_) copies_.pop_back();
        const char *lowest = copies_[0].src, *highest = copies_[0].src;
        for (const timed_copy& c : copies_) {
            lowest = std::min(lowest, c.src);
            highest = std::max(highest, c.src);
        }
        const ptrdiff_t far = (highest - lowest) / 4;
        std::vector<double> copy_ms, gap_ms;
        std::vector<bool> new_step;
        size_t bytes = 0;
        for (size_t i = 0; i < copies_.size(); ++i) {
            copies_[i].end.synchronize();
            copy_ms.push_back(copies_[i].end.elapsed_since(copies_[i].start));
            bytes += copies_[i].bytes;
            if (i == 0) continue;
            gap_ms.push_back(copies_[i].start.elapsed_since(copies_[i - 1].end));
            new_step.push_back(far > 0 && copies_[i - 1].src - copies_[i].src > far);
        }
        std::fprintf(stderr, "link trace (%s): %s", title_.c_str(),
                     summarize(copy_ms, gap_ms, new_step, bytes).c_str());
    } catch (...) {
        // A trace must not turn a clean exit into a crash.
    }
}

}  // namespace mgl::cuda
