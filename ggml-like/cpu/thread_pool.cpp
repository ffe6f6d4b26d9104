#include "thread_pool.h"

#include <algorithm>
#include <new>
#include <string>
#include <system_error>

namespace mgl::cpu {

thread_pool::thread_pool(int n_threads) {
    auto refuse = [&](std::error_code code, int started) {
        // Out of threads or memory for their stacks (ulimit -v, -u): the workers already
        // started must be stopped and joined here, since no destructor will run; a joinable
        // std::thread destroyed while unwinding calls std::terminate.
        stop_workers();
        throw std::system_error(code, "cannot start " + std::to_string(n_threads) +
                                          " threads (only " + std::to_string(started) +
                                          " could be started)");
    };
    for (int i = 1; i < std::max(n_threads, 1); ++i) {
        try {
            workers_.emplace_back([this, i] { worker_loop(i); });
        } catch (const std::system_error& e) {
            refuse(e.code(), i);
        } catch (const std::bad_alloc&) {
            // The same limit met one step earlier: the heap could not grow for the thread's
            // state (or the vector), before pthread_create was reached.
            refuse(std::make_error_code(std::errc::not_enough_memory), i);
        }
    }
}

thread_pool::~thread_pool() { stop_workers(); }

void thread_pool::stop_workers() {
    {
        std::lock_guard<std::mutex> lock(mutex_);
        stop_ = true;
    }
    wake_.notify_all();
    for (auto& w : workers_) w.join();
    workers_.clear();
}

void thread_pool::run_chunk(int index) {
    if (index >= job_chunks_) return;
    int64_t begin = job_n_ * index / job_chunks_, end = job_n_ * (index + 1) / job_chunks_;
    try {
        if (begin < end) (*job_)(begin, end);
    } catch (...) {
        std::lock_guard<std::mutex> lock(mutex_);
        if (!error_) error_ = std::current_exception();
    }
}

void thread_pool::worker_loop(int index) {
    uint64_t seen = 0;
    for (;;) {
        {
            std::unique_lock<std::mutex> lock(mutex_);
            wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
            if (stop_) return;
            seen = generation_;
        }
        run_chunk(index);
        std::lock_guard<std::mutex> lock(mutex_);
        if (--pending_ == 0) done_.notify_one();
    }
}

void thread_pool::parallel_for(int64_t n, const std::function<void(int64_t, int64_t)>& fn,
                               int64_t min_chunk) {
    if (n <= 0) return;
    int64_t chunks = std::min<int64_t>(
        size(), (n + std::max<int64_t>(min_chunk, 1) - 1) / std::max<int64_t>(min_chunk, 1));
    if (chunks <= 1 || workers_.empty()) {
        fn(0, n);
        return;
    }
    {
        std::lock_guard<std::mutex> lock(mutex_);
        job_ = &fn;
        job_n_ = n;
        job_chunks_ = int(chunks);
        pending_ = int(workers_.size());
        error_ = nullptr;
        ++generation_;
    }
    wake_.notify_all();
    run_chunk(0);
    std::exception_ptr err;
    {
        std::unique_lock<std::mutex> lock(mutex_);
        done_.wait(lock, [&] { return pending_ == 0; });
        job_ = nullptr;
        err = error_;
        error_ = nullptr;
    }
    if (err) std::rethrow_exception(err);
}

}  // namespace mgl::cpu
