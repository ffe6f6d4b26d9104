// StagedCopier (the weight load's copies through two pinned staging buffers): pieces smaller
// than a buffer are packed together, larger ones span several buffers, big ones take the
// parallel memcpy; every destination byte must equal its source. Run on the CPU backend (whose
// async copy is a memcpy); the CUDA backend's ordering is exercised by every GPU model load.
#include <doctest/doctest.h>

#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "mgl.h"
#include "model/staged_copy.h"
#include "model/weight_store.h"

TEST_CASE("staged copier: packed, spanning and parallel pieces arrive intact") {
    auto be = mgl::make_cpu_backend(1);
    std::mt19937 rng(7);
    // Sizes around the 1 MiB buffer: tiny (packed), odd, exactly one buffer, several buffers,
    // and above the 4 MiB parallel-copy threshold.
    const std::vector<size_t> sizes = {
        1, 17, 4096, (1 << 20) - 3, 1 << 20, 5 << 20, 1234567, (9 << 20) + 5, 3, 65536};
    for (unsigned threads : {1u, 3u}) {
        CAPTURE(threads);
        std::vector<std::vector<uint8_t>> src, dst;
        for (size_t n : sizes) {
            std::vector<uint8_t> s(n);
            for (auto& b : s) b = uint8_t(rng());
            src.push_back(std::move(s));
            dst.emplace_back(n, uint8_t(0xAA));
        }
        {
            minids::StagedCopier copier(*be, size_t(1) << 20, threads);
            for (size_t i = 0; i < sizes.size(); ++i) {
                copier.copy(dst[i].data(), src[i].data(), src[i].size());
            }
            copier.finish();
        }
        for (size_t i = 0; i < sizes.size(); ++i) {
            CAPTURE(sizes[i]);
            CHECK(dst[i] == src[i]);
        }
    }
}

TEST_CASE("staged copier: the source may change once copy() returns") {
    auto be = mgl::make_cpu_backend(1);
    std::vector<uint8_t> src(3000), dst(3000, 0);
    std::iota(src.begin(), src.end(), uint8_t(0));
    const std::vector<uint8_t> expected = src;
    minids::StagedCopier copier(*be, size_t(1) << 20, 2);
    copier.copy(dst.data(), src.data(), src.size());
    std::fill(src.begin(), src.end(), uint8_t(0));  // staged already: must not reach dst
    copier.finish();
    CHECK(dst == expected);
}

TEST_CASE("host memory helpers: parallel_memcpy, anonymous memory, available memory") {
    // parallel_memcpy: below and above its threshold, with more threads than pieces.
    for (size_t n : {size_t(1000), size_t(9) << 20}) {
        std::vector<uint8_t> src(n), dst(n, 0);
        std::iota(src.begin(), src.end(), uint8_t(3));
        minids::parallel_memcpy(dst.data(), src.data(), n, 5);
        CHECK(dst == src);
    }
    minids::AnonymousMemory m(size_t(3) << 20);
    REQUIRE(m.data() != nullptr);
    m.data()[(size_t(3) << 20) - 1] = 42;  // writable to its last byte
    CHECK(m.data()[(size_t(3) << 20) - 1] == 42);
    // Linux reports MemAvailable; it is below the machine's memory and above nothing.
    const uint64_t avail = minids::available_host_memory();
    CHECK(avail > 0);
    CHECK(avail < (uint64_t(1) << 50));
}
