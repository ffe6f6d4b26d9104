#include "convert/jobs.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <exception>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

namespace minids::convert {
namespace {

// The one piece of process-wide mutable state: a signal handler can reach nothing else.
volatile std::sig_atomic_t g_interrupt = 0;

extern "C" void on_interrupt_signal(int) { g_interrupt = 1; }

}  // namespace

InterruptScope::InterruptScope() {
    g_interrupt = 0;
    struct sigaction sa {};
    sa.sa_handler = on_interrupt_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, &old_int_);
    sigaction(SIGTERM, &sa, &old_term_);
}

InterruptScope::~InterruptScope() {
    sigaction(SIGINT, &old_int_, nullptr);
    sigaction(SIGTERM, &old_term_, nullptr);
}

bool interrupt_requested() { return g_interrupt != 0; }

void throw_if_interrupted() {
    if (interrupt_requested()) throw Interrupted();
}

int resolve_threads(int requested) {
    if (requested > 0) return requested;
    // Twice the hardware threads: each worker blocks in its O_DIRECT write, so a second one per
    // core keeps the CPU busy meanwhile (synthetic v2-lite: 0.87 -> 1.05-1.12 GB/s, docs/perf.md).
    unsigned hw = std::thread::hardware_concurrency();
    return hw == 0 ? 2 : int(2 * hw);
}

void parallel_for(size_t n, int n_threads, const std::function<void(size_t)>& fn) {
    if (n == 0) return;
    std::atomic<size_t> next{0};
    std::atomic<bool> stop{false};
    std::exception_ptr error;
    std::mutex error_mu;
    auto worker = [&] {
        for (;;) {
            if (stop.load(std::memory_order_relaxed)) return;
            if (interrupt_requested()) {
                stop = true;
                return;
            }
            size_t i = next.fetch_add(1);
            if (i >= n) return;
            try {
                fn(i);
            } catch (...) {
                std::lock_guard<std::mutex> lock(error_mu);
                if (!error) error = std::current_exception();
                stop = true;
                return;
            }
        }
    };
    size_t extra = size_t(std::max(1, n_threads)) - 1;
    if (extra > n - 1) extra = n - 1;
    std::vector<std::thread> threads;
    threads.reserve(extra);
    for (size_t t = 0; t < extra; ++t) {
        try {
            threads.emplace_back(worker);
        } catch (const std::system_error& e) {
            // Out of threads or of memory for their stacks: stop and join the ones started (a
            // joinable std::thread destroyed while unwinding calls std::terminate).
            stop = true;
            for (auto& started : threads) started.join();
            throw std::system_error(e.code(), "cannot start " + std::to_string(n_threads) +
                                                  " threads (only " + std::to_string(t + 1) +
                                                  " could be started; use fewer with --threads)");
        }
    }
    worker();
    for (auto& t : threads) t.join();
    if (error) std::rethrow_exception(error);
    throw_if_interrupted();
}

Progress::Progress(std::string label, uint64_t total_bytes, bool enabled)
    : label_(std::move(label)),
      total_(total_bytes),
      enabled_(enabled),
      tty_(isatty(STDERR_FILENO) == 1),
      start_(std::chrono::steady_clock::now()),
      last_print_(start_) {}

void Progress::add(uint64_t bytes) {
    uint64_t done = done_ += bytes;
    if (!enabled_) return;
    int decile = total_ ? int(done * 10 / total_) : 10;
    auto now = std::chrono::steady_clock::now();
    std::lock_guard<std::mutex> lock(mu_);
    bool due = tty_ ? now - last_print_ > std::chrono::milliseconds(200) : decile > last_decile_;
    if (!due) return;
    last_print_ = now;
    last_decile_ = decile;
    print(false);
}

void Progress::finish() {
    if (!enabled_) return;
    std::lock_guard<std::mutex> lock(mu_);
    if (tty_ || last_decile_ < 10) print(true);
}

void Progress::print(bool final_line) {
    double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    // GB for real models, MB for toy ones.
    const bool gb = total_ >= 1000000000ull;
    const double unit = gb ? 1e9 : 1e6;
    double done = double(done_.load()) / unit;
    double pct = total_ ? 100.0 * double(done_.load()) / double(total_) : 100.0;
    double rate = secs > 0 ? double(done_.load()) / 1e9 / secs : 0.0;
    std::fprintf(stderr, "%s%s: %3.0f%% (%.2f / %.2f %s, %.2f GB/s)%s", tty_ ? "\r" : "",
                 label_.c_str(), pct, done, double(total_) / unit, gb ? "GB" : "MB", rate,
                 (tty_ && !final_line) ? "" : "\n");
    std::fflush(stderr);
}

}  // namespace minids::convert
