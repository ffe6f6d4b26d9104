// A fixed set of worker threads owned by the CPU backend. parallel_for splits a range into one
// contiguous chunk per thread (static partition: the ops are regular, and equal chunks keep each
// thread streaming its own rows of a weight matrix).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace mgl::cpu {

class thread_pool {
public:
    // Throws std::system_error (nothing left running) when the threads cannot all be started.
    explicit thread_pool(int n_threads);
    ~thread_pool();
    thread_pool(const thread_pool&) = delete;
    thread_pool& operator=(const thread_pool&) = delete;

    int size() const { return int(workers_.size()) + 1; }

    // Calls fn(begin, end) on disjoint chunks covering [0, n), at most one chunk per thread and
    // none smaller than min_chunk (small ranges run on the calling thread alone). The calling
    // thread works too. The first exception thrown by any chunk is rethrown here.
    void parallel_for(int64_t n, const std::function<void(int64_t, int64_t)>& fn,
                      int64_t min_chunk = 1);

private:
    void stop_workers();
    void worker_loop(int index);
    void run_chunk(int index);

    std::vector<std::thread> workers_;
    std::mutex mutex_;
    std::condition_variable wake_;
    std::condition_variable done_;
    uint64_t generation_ = 0;
    bool stop_ = false;
    int pending_ = 0;
    // The job being run (valid while pending_ > 0).
    const std::function<void(int64_t, int64_t)>* job_ = nullptr;
    int64_t job_n_ = 0;
    int job_chunks_ = 0;
    std::exception_ptr error_;
};

}  // namespace mgl::cpu
