// The GPU memory plan (runtime/memory_plan.h) on V2-Lite's sizes, and --vram-budget's sizes.
#include <doctest/doctest.h>

#include <stdexcept>
#include <string>

#include "runtime/memory_plan.h"

using namespace minids;

namespace {

constexpr uint64_t MiB = 1ull << 20, GiB = 1ull << 30;

// V2-Lite with FP8 experts: 26 MoE layers x 64 experts of 8.65 MB, top-6, 2.87 GiB dense,
// 27 layers x 576 BF16 values of KV cache per token.
MemoryPlanInput v2_lite(uint64_t budget, int64_t ctx = 4096) {
    MemoryPlanInput in;
    in.budget = budget;
    in.dense_bytes = 2940 * MiB;
    in.slot_bytes = 8650752;
    in.n_experts = 26 * 64;
    in.min_slots = 6;
    in.kv_bytes_per_token = 27 * 576 * 2;
    in.n_ctx = ctx;
    in.work_bytes = 1 * GiB;
    return in;
}

}  // namespace

TEST_CASE("memory plan: resident when everything fits, slots for what is left otherwise") {
    const MemoryPlan big = plan_memory(v2_lite(80 * GiB));
    CHECK(big.fits);
    CHECK(big.resident);
    CHECK(big.slots == 26 * 64);

    const MemoryPlan p = plan_memory(v2_lite(12 * GiB));
    REQUIRE(p.fits);
    CHECK_FALSE(p.resident);
    // 12 GiB - 2940 MiB - 121.5 MiB KV - 1 GiB = 8226.5 MiB -> 997 slots of 8.25 MiB
    CHECK(p.slots == (12 * GiB - 2940 * MiB - 27 * 576 * 2 * 4096ull - GiB) / 8650752);
    CHECK(p.total() <= 12 * GiB);
    CHECK(p.table(12 * GiB).find("an expert cache") != std::string::npos);

    MemoryPlanInput forced = v2_lite(12 * GiB);
    forced.forced_slots = 208;
    const MemoryPlan f = plan_memory(forced);
    CHECK(f.fits);
    CHECK(f.slots == 208);
}

TEST_CASE("memory plan: a budget too small is refused with what would fit") {
    const MemoryPlan p = plan_memory(v2_lite(4 * GiB));
    CHECK_FALSE(p.fits);
    CHECK(p.refusal.find("needs at least") != std::string::npos);
    CHECK(p.refusal.find("budget is 4.00 GiB") != std::string::npos);
    // A context that cannot fit: the largest that does is named.
    const MemoryPlan ctx = plan_memory(v2_lite(5 * GiB, 1 << 20));
    CHECK_FALSE(ctx.fits);
    CHECK(ctx.refusal.find("at most -c ") != std::string::npos);

    MemoryPlanInput few = v2_lite(12 * GiB);
    few.forced_slots = 5;  // top-6
    CHECK(plan_memory(few).refusal.find("fewer than the 6 experts") != std::string::npos);
    MemoryPlanInput staging = v2_lite(12 * GiB);  // the staging store: a slot per expert of a layer
    staging.min_slots = 64;
    staging.min_slots_are = "slots the staging store needs (one per expert of a layer)";
    staging.forced_slots = 63;
    CHECK(plan_memory(staging).refusal ==
          "--expert-cache-slots 63 is fewer than the 64 slots the staging store needs (one per "
          "expert of a layer)");
    staging.forced_slots = 64;
    CHECK(plan_memory(staging).fits);
    MemoryPlanInput many = v2_lite(12 * GiB);
    many.forced_slots = 1500;  // more than fit
    CHECK_FALSE(plan_memory(many).fits);
}

TEST_CASE("memory plan: --vram-budget sizes") {
    CHECK(parse_byte_size("12GiB") == 12 * GiB);
    CHECK(parse_byte_size("12G") == 12 * GiB);
    CHECK(parse_byte_size("11000MiB") == 11000 * MiB);
    CHECK(parse_byte_size("512m") == 512 * MiB);
    CHECK(parse_byte_size("1.5GiB") == 3 * GiB / 2);
    CHECK(parse_byte_size("12GB") == 12000000000ull);
    CHECK(parse_byte_size("4096") == 4096);
    for (const char* bad : {"", "GiB", "-1G", "12XB", "1.2.3G", "nanG", "inf", "1e30", "12 GiBs"})
        CHECK_THROWS_AS(parse_byte_size(bad), std::invalid_argument);
}
