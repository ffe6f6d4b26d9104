// Speed of the expert-cache simulator: expert accesses per second per policy on one core, on
// a V2-Lite-shaped synthetic trace (64 experts, top-6, 26 MoE layers; 1M tokens = 156 M
// accesses by default). Target: >= 20 M accesses/s per policy.
//
//   bench_routing_sim [--tokens N] [--repeats R]
//
// Each configuration runs R times; the median CPU time of the process is reported (on a
// shared machine wall time also counts the time other processes held the core).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <string>
#include <vector>

#include "routing/simulator.h"
#include "routing/synthetic.h"

using namespace minids::routing;

int main(int argc, char** argv) {
    int64_t tokens = 1000000;
    int repeats = 3;
    for (int i = 1; i + 1 < argc; i += 2) {
        const std::string a = argv[i];
        if (a == "--tokens") tokens = std::atoll(argv[i + 1]);
        if (a == "--repeats") repeats = std::atoi(argv[i + 1]);
    }
    SynthParams p;
    p.shape = preset_shape("v2-lite");
    p.n_tokens = tokens;
    p.zipf = {0.8};
    p.stickiness = {0.3};
    p.cross_layer = {0.2};
    auto t0 = std::chrono::steady_clock::now();
    const RoutingTrace tr = generate_trace(p);
    const double gen_s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double accesses = double(tr.n_tokens) * double(tr.row_size());
    std::printf("trace: %lld tokens x 26 layers x top-6 = %.1f M accesses (generated in %.2f s)\n",
                (long long)tokens, accesses / 1e6, gen_s);
    t0 = std::chrono::steady_clock::now();
    const std::vector<int32_t> next = next_uses(tr);
    std::printf("belady next-use pass: %.2f s\n",
                std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());

    std::printf(
        "\n| policy | pools | slots | hit rate | median CPU s | M accesses/s | target 20 |\n");
    std::printf("|---|---|---|---|---|---|---|\n");
    bool all_ok = true;
    for (Policy pol : {Policy::lru, Policy::lfu, Policy::decay, Policy::belady}) {
        for (bool per_layer : {false, true}) {
            for (int64_t slots : {int64_t(982), int64_t(208)}) {  // 59 %, 8 per layer
                CacheConfig c;
                c.policy = pol;
                c.n_slots = slots;
                c.per_layer = per_layer;
                std::vector<double> times;
                SimResult r;
                for (int rep = 0; rep < repeats; ++rep) {
                    const std::clock_t s = std::clock();
                    r = simulate(tr, c, &next);
                    times.push_back(double(std::clock() - s) / CLOCKS_PER_SEC);
                }
                std::sort(times.begin(), times.end());
                const double med = times[times.size() / 2];
                const double rate = accesses / med / 1e6;
                all_ok &= rate >= 20;
                std::printf("| %s | %s | %lld | %.3f | %.3f | %.1f | %s |\n", policy_name(pol),
                            per_layer ? "per-layer" : "global", (long long)slots, r.hit_rate(), med,
                            rate, rate >= 20 ? "ok" : "BELOW");
            }
        }
    }
    std::printf("\n%s\n", all_ok ? "all configurations >= 20 M accesses/s"
                                 : "some configurations below 20 M accesses/s");
    return 0;
}
