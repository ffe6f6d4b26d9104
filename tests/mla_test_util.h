// Helpers of the CUDA MLA kernel tests: device buffers, a host copy of a paged latent cache with
// a scrambled page table and poisoned unwritten rows, and a parallel loop for the double
// references (they dominate the test time).
#pragma once
#ifdef MINIDS_HAVE_CUDA
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <thread>
#include <vector>

#include "cuda_check.h"
#include "mgl.h"

namespace minids::test {

// A device copy of a host vector, freed at scope exit.
template <typename T>
struct DevBuf {
    T* ptr = nullptr;
    size_t n = 0;
    DevBuf() = default;
    explicit DevBuf(const std::vector<T>& host) { upload(host); }
    DevBuf(const DevBuf&) = delete;
    DevBuf& operator=(const DevBuf&) = delete;
    ~DevBuf() { cudaFree(ptr); }
    void upload(const std::vector<T>& host) {
        if (host.size() != n) {
            cudaFree(ptr);
            ptr = nullptr;
            n = host.size();
            CUDA_CHECK(
                cudaMalloc(reinterpret_cast<void**>(&ptr), std::max<size_t>(n, 1) * sizeof(T)));
        }
        CUDA_CHECK(cudaMemcpy(ptr, host.data(), n * sizeof(T), cudaMemcpyHostToDevice));
    }
    std::vector<T> download() const {
        std::vector<T> host(n);
        CUDA_CHECK(cudaMemcpy(host.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost));
        return host;
    }
};

// fn(i) for i in [0, n) on all hardware threads.
inline void parallel_for(int64_t n, const std::function<void(int64_t)>& fn) {
    const int64_t workers =
        std::min<int64_t>(n, std::max<int64_t>(1, std::thread::hardware_concurrency()));
    std::atomic<int64_t> next{0};
    std::vector<std::thread> pool;
    for (int64_t w = 0; w < workers; ++w)
        pool.emplace_back([&] {
            for (int64_t i = next++; i < n; i = next++) fn(i);
        });
    for (auto& t : pool) t.join();
}

// A paged latent cache on the host, laid out exactly as on the device: `bytes` is the page pool
// (unwritten rows hold NaN), `rows` the stored values in logical order as doubles (after bf16 /
// f16 rounding when the pages are bf16 / f16), which is what references read.
struct HostCache {
    mgl::dtype type = mgl::dtype::f32;
    int64_t r = 0, rope = 0, width = 0, page_size = 0, n_pages = 0, max_pages = 0, n_ctx = 0;
    std::vector<int32_t> table;
    std::vector<uint8_t> bytes;
    std::vector<double> rows;  // [max_pages · page_size][width], NaN where not written

    size_t elem() const { return type == mgl::dtype::f32 ? 4 : 2; }
    size_t offset(int64_t pos) const {
        const int64_t phys = table[size_t(pos / page_size)];
        return size_t((phys * page_size + pos % page_size) * width) * elem();
    }
    // Stores one row as the device would (bf16, f16: round to nearest even) and records it.
    void set(int64_t pos, const float* v) {
        uint8_t* dst = bytes.data() + offset(pos);
        for (int64_t i = 0; i < width; ++i) {
            if (type == mgl::dtype::f32) {
                std::memcpy(dst + 4 * i, &v[i], 4);
                rows[size_t(pos * width + i)] = v[i];
            } else {
                const bool f16 = type == mgl::dtype::f16;
                const uint16_t h = f16 ? mgl::f32_to_f16(v[i]) : mgl::f32_to_bf16(v[i]);
                std::memcpy(dst + 2 * i, &h, 2);
                rows[size_t(pos * width + i)] = f16 ? mgl::f16_to_f32(h) : mgl::bf16_to_f32(h);
            }
        }
    }
};

// Positions [0, n_ctx) hold random rows; the page table addresses `capacity` positions (at least
// n_ctx) plus two spare logical pages, mapped by a random permutation of the physical pages, of
// which three more are never mapped. Everything not written is NaN.
inline HostCache make_cache(mgl::dtype type, int64_t r, int64_t rope, int64_t page_size,
                            int64_t n_ctx, uint64_t seed, int64_t capacity = 0) {
    HostCache c;
    c.type = type;
    c.r = r;
    c.rope = rope;
    c.width = r + rope;
    c.page_size = page_size;
    c.n_ctx = n_ctx;
    capacity = std::max(capacity, n_ctx);
    c.max_pages = (capacity + page_size - 1) / page_size + 2;
    c.n_pages = c.max_pages + 3;
    std::vector<int32_t> perm(size_t(c.n_pages));
    std::iota(perm.begin(), perm.end(), 0);
    std::mt19937_64 rng(seed);
    std::shuffle(perm.begin(), perm.end(), rng);
    c.table.assign(perm.begin(), perm.begin() + c.max_pages);
    c.bytes.resize(size_t(c.n_pages * page_size * c.width) * c.elem());
    if (type == mgl::dtype::f32) {
        const uint32_t nan = 0x7fc00000u;
        for (size_t i = 0; i < c.bytes.size(); i += 4) std::memcpy(&c.bytes[i], &nan, 4);
    } else {
        const uint16_t nan = type == mgl::dtype::f16 ? 0x7e00u : 0x7fc0u;
        for (size_t i = 0; i < c.bytes.size(); i += 2) std::memcpy(&c.bytes[i], &nan, 2);
    }
    c.rows.assign(size_t(c.max_pages * page_size * c.width), NAN);
    std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
    std::vector<float> row(size_t(c.width));
    for (int64_t pos = 0; pos < n_ctx; ++pos) {
        for (auto& x : row) x = dist(rng);
        c.set(pos, row.data());
    }
    return c;
}

inline const char* type_name(mgl::dtype t) { return mgl::dtype_name(t); }

}  // namespace minids::test
#endif  // MINIDS_HAVE_CUDA
