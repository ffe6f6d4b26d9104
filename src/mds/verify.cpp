// MdsFile::verify: every byte of the file is covered either by a checksum (preamble, manifest,
// each tensor, each expert blob) or by the rule that padding is zero, so any changed byte shows.
// Work is split into ranges handed to threads through one atomic cursor, largest first.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <new>
#include <system_error>
#include <thread>
#include <vector>

#include <xxhash.h>

#include "mds/manifest.h"
#include "mds/reader.h"

namespace minids::mds {

namespace {

// The least work worth a thread of its own.
constexpr uint64_t kBytesPerThread = 64ull << 20;
// Padding is checked in chunks of this size so one long gap still spreads across threads.
constexpr uint64_t padding_chunk = 64ull << 20;

struct Range {
    uint64_t begin = 0, end = 0;
    bool zero_padding = false;  // else: XXH3 over [begin, end) must equal `expected`
    uint64_t expected = 0;
    std::string what;
};

bool all_zero(const uint8_t* p, uint64_t n, uint64_t& first_nonzero) {
    uint64_t i = 0;
    // Word-at-a-time scan; memcpy keeps it free of alignment assumptions.
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        std::memcpy(&w, p + i, 8);
        if (w) break;
    }
    for (; i < n; ++i) {
        if (p[i]) {
            first_nonzero = i;
            return false;
        }
    }
    return true;
}

}  // namespace

MdsFile::VerifyResult MdsFile::verify(
    int n_threads, const std::function<void(uint64_t, uint64_t)>& progress) const {
    const uint8_t* base = base_;
    mds_preamble pre;
    std::memcpy(&pre, base, sizeof pre);

    std::vector<Range> ranges;
    ranges.push_back(
        {0, offsetof(mds_preamble, preamble_xxh3), false, pre.preamble_xxh3, "preamble"});
    const uint64_t manifest_end = sizeof(mds_preamble) + pre.manifest_len;
    ranges.push_back({sizeof(mds_preamble), manifest_end, false, pre.manifest_xxh3, "manifest"});
    // Covered spans, for working out the padding between them.
    std::vector<std::pair<uint64_t, uint64_t>> covered = {{0, manifest_end}};
    for (const auto& t : tensors_) {
        ranges.push_back({t.offset, t.offset + t.nbytes, false, t.xxh3, "tensor " + t.name});
        covered.emplace_back(t.offset, t.offset + t.nbytes);
    }
    for (const auto& b : experts_.blobs) {
        uint64_t end = b.offset + experts_.blob_nbytes;
        ranges.push_back({b.offset, end, false, b.xxh3,
                          "expert blob layer " + std::to_string(b.layer) + " expert " +
                              std::to_string(b.expert)});
        covered.emplace_back(b.offset, end);
    }
    std::sort(covered.begin(), covered.end());
    uint64_t cursor = 0;
    auto add_padding = [&](uint64_t begin, uint64_t end) {
        for (uint64_t b = begin; b < end; b += padding_chunk)
            ranges.push_back({b, std::min(end, b + padding_chunk), true, 0, "padding"});
    };
    for (const auto& [b, e] : covered) {
        if (b > cursor) add_padding(cursor, b);
        cursor = std::max(cursor, e);
    }
    add_padding(cursor, size_);
    std::sort(ranges.begin(), ranges.end(),
              [](const Range& a, const Range& b) { return a.end - a.begin > b.end - b.begin; });

    // The 8 bytes of preamble_xxh3 are checked by comparing the preamble's hash against them.
    const uint64_t checksum_field = sizeof(mds_preamble) - offsetof(mds_preamble, preamble_xxh3);
    uint64_t total = checksum_field;
    for (const auto& r : ranges) total += r.end - r.begin;
    if (n_threads <= 0)
        n_threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    n_threads = static_cast<int>(std::min<size_t>(static_cast<size_t>(n_threads), ranges.size()));
    // A thread costs more than hashing a few MiB (its stack, and the 64 MiB malloc arena glibc
    // reserves for it, which under ulimit -v is what runs out first), so small files get fewer.
    n_threads = static_cast<int>(std::min<uint64_t>(
        static_cast<uint64_t>(n_threads), (total + kBytesPerThread - 1) / kBytesPerThread));
    n_threads = std::max(n_threads, 1);

    std::atomic<size_t> next{0};
    std::atomic<uint64_t> done_bytes{checksum_field};
    std::atomic<int> running{n_threads};
    std::mutex mu;
    std::condition_variable all_done;
    std::vector<std::string> problems;
    auto worker = [&] {
        for (size_t i; (i = next.fetch_add(1)) < ranges.size();) {
            const Range& r = ranges[i];
            const uint8_t* p = base + r.begin;
            const uint64_t n = r.end - r.begin;
            std::string problem;
            if (r.zero_padding) {
                uint64_t at = 0;
                if (!all_zero(p, n, at))
                    problem = path_ + ": padding at offset " + std::to_string(r.begin + at) +
                              ": expected zero bytes, found a non-zero byte";
            } else {
                uint64_t h = XXH3_64bits(p, n);
                if (h != r.expected)
                    problem = path_ + ": " + r.what + ": expected checksum " + hex_u64(r.expected) +
                              ", found " + hex_u64(h) + " (the data is corrupt)";
            }
            if (!problem.empty()) {
                std::lock_guard lock(mu);
                problems.push_back(std::move(problem));
            }
            done_bytes.fetch_add(n, std::memory_order_relaxed);
        }
        std::lock_guard lock(mu);
        if (--running == 0) all_done.notify_all();
    };
    if (n_threads == 1 && !progress) {
        worker();  // no thread to start for small files and tight test loops
    } else {
        std::vector<std::jthread> threads;
        threads.reserve(static_cast<size_t>(n_threads));
        int started = 0;
        for (; started < n_threads; ++started) {
            // Under ulimit -v the stacks fill the address space: the next start fails either in
            // pthread_create (system_error) or, when the heap cannot grow either, in allocating
            // the thread's state (bad_alloc; seen in CI). Both mean the same: no more threads.
            try {
                threads.emplace_back(worker);
            } catch (const std::system_error&) {
                break;  // fewer threads than asked: the ones running share the work
            } catch (const std::bad_alloc&) {
                break;
            }
        }
        if (started < n_threads) {
            std::lock_guard lock(mu);
            running -= n_threads - std::max(started, 1);
        }
        if (started == 0) worker();  // not even one: this thread does it all
        // Progress is reported from this thread only, so callers need no locking.
        std::unique_lock lock(mu);
        while (running > 0) {
            all_done.wait_for(lock, std::chrono::milliseconds(100));
            if (progress) {
                lock.unlock();
                progress(done_bytes.load(), total);
                lock.lock();
            }
        }
    }
    if (progress) progress(total, total);

    VerifyResult result;
    std::sort(problems.begin(), problems.end());
    result.problems = std::move(problems);
    result.ok = result.problems.empty();
    return result;
}

}  // namespace minids::mds
