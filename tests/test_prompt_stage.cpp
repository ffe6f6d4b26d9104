// mgl::expert_prompt_stage (the expert cache's prompt stage, docs/expert-cache.md "Prefill"): the
// CPU op against the rule written out by hand, then the CUDA kernel against the same rule over
// random tables, routings, lent buffers (scattered, fewer than the capacity or as many) and blob
// sizes, with the homes in pinned host memory the kernel reads across the link. The whole-model
// check (the resident logits, bit for bit) is in test_expert_offload.cpp and
// test_expert_offload_cuda.cpp.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "test_mgl_util.h"

#ifdef MINIDS_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "expert_fetch.h"
#include "moe_cuda_fixture.h"
#endif

using mgl_test::harness;

namespace {

// The rule: the first `n` distinct experts of ids, in increasing order, whose entry is not inside
// [slot_begin, slot_end) go to buffers 0, 1, ...; returns the buffer of each expert or -1.
std::vector<int64_t> expected_buffers(const std::vector<int64_t>& table,
                                      const std::vector<int32_t>& ids, int64_t slot_begin,
                                      int64_t slot_end, int64_t capacity) {
    std::vector<char> used(table.size(), 0);
    for (int32_t e : ids) used[size_t(e)] = 1;
    std::vector<int64_t> buffer(table.size(), -1);
    int64_t n = 0;
    for (size_t e = 0; e < table.size(); ++e) {
        const bool in_slot = table[e] >= slot_begin && table[e] < slot_end;
        if (used[e] && !in_slot && n < capacity) buffer[e] = n++;
    }
    return buffer;
}

}  // namespace

TEST_CASE("mgl expert_prompt_stage on the CPU: the first misses in expert order, copied") {
    const int64_t E = 12, blob = 1000, stride = 1024;
    std::mt19937 rng(7);
    std::vector<uint8_t> homes(size_t(E * blob));
    for (auto& b : homes) b = uint8_t(rng());
    // Slots 0-2 hold experts 2, 5 and 9; slots 3-7 are lent (in reverse order).
    const int64_t S = 8;
    std::vector<uint8_t> slots(size_t(S * stride), 0);
    std::vector<int64_t> table(static_cast<size_t>(E));
    for (int64_t e = 0; e < E; ++e)
        table[size_t(e)] = reinterpret_cast<int64_t>(&homes[size_t(e * blob)]);
    const int32_t in_slots[3] = {2, 5, 9};
    for (int64_t s = 0; s < 3; ++s) {
        std::memcpy(&slots[size_t(s * stride)], &homes[size_t(in_slots[s] * blob)], size_t(blob));
        table[size_t(in_slots[s])] = reinterpret_cast<int64_t>(&slots[size_t(s * stride)]);
    }
    mgl::expert_fetch_header header;
    header.n_experts = E;
    header.n_slots = S;
    header.blob_bytes = blob;
    header.slot_base = reinterpret_cast<int64_t>(slots.data());
    header.slot_stride = stride;
    // Experts used: 0, 1, 2, 4, 5, 7, 9, 11 (three tokens of four, repeats included).
    const std::vector<int32_t> ids = {4, 0, 2, 11, 7, 1, 0, 9, 5, 4, 2, 1};
    auto layout = std::make_shared<mgl::expert_layout>();
    layout->blob_bytes = blob;
    const int64_t capacity = 5;
    // Lent: 3 of the 5 the graph was built for, then all 5, then more than 5 (read as 5).
    for (const int64_t lent : {int64_t(3), capacity, int64_t(9)}) {
        CAPTURE(lent);
        harness h;
        mgl::tensor* t = h.leaf(mgl::dtype::i64, {E}, table.data(), size_t(E) * 8, "table");
        mgl::tensor* state =
            h.leaf(mgl::dtype::i64, {int64_t(sizeof header / 8)}, &header, sizeof header, "state");
        std::vector<int64_t> words = {lent};
        for (int64_t i = 0; i < capacity; ++i)
            words.push_back(reinterpret_cast<int64_t>(&slots[size_t((S - 1 - i) * stride)]));
        mgl::tensor* buffers =
            h.leaf(mgl::dtype::i64, {1 + capacity}, words.data(), words.size() * 8, "buffers");
        mgl::tensor* out =
            mgl::expert_prompt_stage(h.ctx, t, h.i32({3, 4}, ids), state, layout, buffers);
        CHECK(out->iparams[0] == capacity);  // the capacity is the buffers' size less the count
        h.run(out);
        const auto* got = static_cast<const int64_t*>(out->data);
        const int64_t n = std::min(lent, capacity);
        const std::vector<int64_t> want =
            expected_buffers(table, ids, header.slot_base, header.slot_base + 3 * stride, n);
        // By hand: 0, 1, 4 staged with three buffers; 7 and 11 too with five.
        CHECK(want[0] == 0);
        CHECK(want[1] == 1);
        CHECK(want[4] == 2);
        CHECK(want[7] == (n == 3 ? -1 : 3));
        CHECK(want[11] == (n == 3 ? -1 : 4));
        for (int64_t e = 0; e < E; ++e) {
            CAPTURE(e);
            if (want[size_t(e)] < 0) {
                CHECK(got[e] == table[size_t(e)]);  // in a slot, unused, or past the lent ones
            } else {
                const int64_t b = words[size_t(1 + want[size_t(e)])];
                CHECK(got[e] == b);
                CHECK(std::memcmp(reinterpret_cast<const void*>(b), &homes[size_t(e * blob)],
                                  size_t(blob)) == 0);
            }
        }
    }
    SUBCASE("refusals") {
        harness h;
        mgl::tensor* t = h.leaf(mgl::dtype::i64, {E}, table.data(), size_t(E) * 8, "table");
        mgl::tensor* state =
            h.leaf(mgl::dtype::i64, {int64_t(sizeof header / 8)}, &header, sizeof header, "state");
        const std::vector<int64_t> words = {2, header.slot_base + 6 * stride,
                                            header.slot_base + 7 * stride};
        mgl::tensor* buffers =
            h.leaf(mgl::dtype::i64, {3}, words.data(), words.size() * 8, "buffers");
        // A count with no address serves nothing; addresses must be i64.
        mgl::tensor* count_only = h.leaf(mgl::dtype::i64, {1}, words.data(), 8, "count");
        CHECK_THROWS_AS(
            mgl::expert_prompt_stage(h.ctx, t, h.i32({3, 4}, ids), state, layout, count_only),
            mgl::error);
        mgl::tensor* as_i32 = h.i32({6}, {2, 0, 0, 0, 0, 0});
        CHECK_THROWS_AS(
            mgl::expert_prompt_stage(h.ctx, t, h.i32({3, 4}, ids), state, layout, as_i32),
            mgl::error);
        // An id outside [0, E) is an error when the op runs.
        std::vector<int32_t> bad = ids;
        bad[5] = int32_t(E);
        mgl::tensor* out =
            mgl::expert_prompt_stage(h.ctx, t, h.i32({3, 4}, bad), state, layout, buffers);
        CHECK_THROWS_AS(h.run(out), mgl::error);
    }
}

#ifdef MINIDS_HAVE_CUDA
TEST_CASE("cuda expert_prompt_stage: the CPU's rule, homes read across the link" *
          doctest::skip(!minids::test::cuda_device_available())) {
    using moe_test::DeviceBuffer;
    std::mt19937 rng(11);
    struct Shape {
        int64_t E, blob, S, n_ids;
    };
    // Blob sizes: below one copy chunk, several chunks with a tail, not a multiple of 16.
    for (const Shape sh :
         {Shape{12, 1003, 4, 12}, Shape{64, 300000, 40, 3072}, Shape{160, 70001, 100, 48}}) {
        const int64_t stride = (sh.blob + 255) / 256 * 256;
        uint8_t* homes = nullptr;
        REQUIRE(cudaHostAlloc(reinterpret_cast<void**>(&homes), size_t(sh.E * stride),
                              cudaHostAllocMapped) == cudaSuccess);
        for (int64_t i = 0; i < sh.E * stride; ++i) homes[i] = uint8_t(rng());
        DeviceBuffer slots(size_t(sh.S * stride));
        DeviceBuffer header(sizeof(mgl::expert_fetch_header), 0);
        mgl::expert_fetch_header h;
        h.n_experts = sh.E;
        h.n_slots = sh.S;
        h.blob_bytes = sh.blob;
        h.slot_base = reinterpret_cast<int64_t>(slots.ptr);
        h.slot_stride = stride;
        REQUIRE(cudaMemcpy(header.ptr, &h, sizeof h, cudaMemcpyHostToDevice) == cudaSuccess);
        for (int round = 0; round < 4; ++round) {
            // A random third of the experts in slots (their bytes do not matter here), random ids.
            std::vector<int64_t> table(size_t(sh.E));
            std::vector<int64_t> free_slots;
            for (int64_t s = 0; s < sh.S; ++s) free_slots.push_back(s);
            std::shuffle(free_slots.begin(), free_slots.end(), rng);
            for (int64_t e = 0; e < sh.E; ++e) {
                table[size_t(e)] = reinterpret_cast<int64_t>(homes + e * stride);
                if (rng() % 3 == 0 && !free_slots.empty()) {
                    table[size_t(e)] = h.slot_base + free_slots.back() * stride;
                    free_slots.pop_back();
                }
            }
            std::vector<int32_t> ids(size_t(sh.n_ids));
            for (auto& id : ids) id = int32_t(rng() % uint32_t(sh.E));
            for (const int64_t capacity : {int64_t(1), int64_t(7), sh.E}) {
                // Lent: the capacity, or (from 7) fewer; scattered over a pool, last first.
                const int64_t lent = capacity == 7 && round % 2 ? 4 : capacity;
                CAPTURE(sh.E);
                CAPTURE(sh.blob);
                CAPTURE(round);
                CAPTURE(capacity);
                CAPTURE(lent);
                DeviceBuffer pool(size_t(2 * capacity * stride));
                std::vector<int64_t> words = {lent};
                for (int64_t i = 0; i < capacity; ++i)
                    words.push_back(reinterpret_cast<int64_t>(pool.as<uint8_t>() +
                                                              (2 * capacity - 1 - 2 * i) * stride));
                DeviceBuffer d_table(table), d_ids(ids), out(size_t(sh.E) * 8), d_words(words);
                minids::kernels::ExpertPromptStageParams p;
                p.state = header.as<mgl::expert_fetch_header>();
                p.table = d_table.as<int64_t>();
                p.out = out.as<int64_t>();
                p.ids = d_ids.as<int32_t>();
                p.n_ids = sh.n_ids;
                p.n_experts = int32_t(sh.E);
                p.buffers = d_words.as<int64_t>();
                p.capacity = capacity;
                p.blob_bytes = sh.blob;
                minids::kernels::expert_prompt_stage(p, nullptr);
                REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
                std::vector<int64_t> got(size_t(sh.E));
                REQUIRE(cudaMemcpy(got.data(), out.ptr, got.size() * 8, cudaMemcpyDeviceToHost) ==
                        cudaSuccess);
                std::vector<uint8_t> buf(pool.bytes);
                REQUIRE(cudaMemcpy(buf.data(), pool.ptr, buf.size(), cudaMemcpyDeviceToHost) ==
                        cudaSuccess);
                const std::vector<int64_t> want =
                    expected_buffers(table, ids, h.slot_base, h.slot_base + sh.S * stride, lent);
                int64_t mismatched_entries = 0, mismatched_blobs = 0, staged = 0;
                for (int64_t e = 0; e < sh.E; ++e) {
                    const int64_t b = want[size_t(e)];
                    if (b < 0) {
                        mismatched_entries += got[size_t(e)] != table[size_t(e)];
                        continue;
                    }
                    ++staged;
                    const int64_t addr = words[size_t(1 + b)];
                    mismatched_entries += got[size_t(e)] != addr;
                    const size_t at = size_t(addr - reinterpret_cast<int64_t>(pool.ptr));
                    mismatched_blobs +=
                        std::memcmp(&buf[at], homes + e * stride, size_t(sh.blob)) != 0;
                }
                CHECK(staged > 0);
                CHECK(mismatched_entries == 0);
                CHECK(mismatched_blobs == 0);
            }
        }
        cudaFreeHost(homes);
    }
}
#endif
