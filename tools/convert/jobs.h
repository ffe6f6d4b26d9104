// Running the converter's work: a parallel loop that stops on the first error or on Ctrl-C, the
// Ctrl-C/SIGTERM handling itself, and the progress line on stderr.
#pragma once

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <string>

namespace minids::convert {

// Thrown when SIGINT/SIGTERM arrived during a conversion; the CLI exits 130. Unwinding runs the
// writer's destructor, which removes OUT.tmp.
struct Interrupted : std::runtime_error {
    Interrupted() : std::runtime_error("interrupted") {}
};

// While alive, SIGINT and SIGTERM set a flag instead of killing the process (the previous
// handlers come back on destruction). Work checks the flag through throw_if_interrupted().
class InterruptScope {
public:
    InterruptScope();
    ~InterruptScope();
    InterruptScope(const InterruptScope&) = delete;
    InterruptScope& operator=(const InterruptScope&) = delete;

private:
    struct sigaction old_int_ {};
    struct sigaction old_term_ {};
};
bool interrupt_requested();
void throw_if_interrupted();

// 0 -> twice the machine's hardware threads (workers block in direct writes).
int resolve_threads(int requested);

// Calls fn(i) for i in [0, n) on n_threads threads (the caller's included). Indices are handed
// out in increasing order. After the first exception (or an interrupt) no new index starts; the
// exception is rethrown once all threads have stopped.
void parallel_for(size_t n, int n_threads, const std::function<void(size_t)>& fn);

// "converting: 42% (6.7 / 16.0 GB, 1.3 GB/s)" on stderr: redrawn in place on a terminal, one line
// per 10% otherwise. Thread-safe.
class Progress {
public:
    Progress(std::string label, uint64_t total_bytes, bool enabled);
    void add(uint64_t bytes);
    void finish();

private:
    void print(bool final_line);
    std::string label_;
    uint64_t total_ = 0;
    std::atomic<uint64_t> done_{0};
    bool enabled_ = false;
    bool tty_ = false;
    std::mutex mu_;
    std::chrono::steady_clock::time_point start_, last_print_;
    int last_decile_ = -1;
};

}  // namespace minids::convert
