// Host sampling cost per generated token: microseconds per Sampler::sample on a vocabulary of
// V2's size (102,400 random logits, one of them changed before each draw), with llama.cpp's
// defaults (temperature 0.8, top-k 40, top-p 0.95, min-p 0.05) and greedy; median of repeats
// after a warm-up. This runs on the host between two decode steps of `run` and `chat`, so it adds
// to every token's time (a V2-Lite decode step on the H200 is ~2.4 ms).
//
//   build/bench_sampler [--vocab N] [--repeats R]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <vector>

#include <CLI/CLI.hpp>

#include "runtime/sampler.h"

namespace {

double median_us_per_draw(minids::Sampler& s, std::vector<float>& logits, int repeats) {
    constexpr int draws = 100;
    std::vector<double> t;
    for (int r = 0; r < repeats + 1; ++r) {
        const auto t0 = std::chrono::steady_clock::now();
        for (int i = 0; i < draws; ++i) {
            logits[size_t(i * 7919) % logits.size()] += 1e-3f;
            s.accept(s.sample(logits));
        }
        const double us =
            std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0)
                .count();
        if (r > 0) t.push_back(us / draws);  // the first round warms up
    }
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
    CLI::App app{"host sampling cost per token"};
    int64_t vocab = 102400;
    int repeats = 9;
    app.add_option("--vocab", vocab, "vocabulary size")
        ->check(CLI::Range(int64_t(1), int64_t(1) << 24));
    app.add_option("--repeats", repeats, "timed rounds of 100 draws")->check(CLI::Range(1, 1000));
    CLI11_PARSE(app, argc, argv);

    std::vector<float> logits(static_cast<size_t>(vocab));
    std::mt19937 rng(1);
    std::normal_distribution<float> normal(0.0f, 3.0f);
    for (float& x : logits) x = normal(rng);

    minids::SamplerParams defaults;
    defaults.seed = 1;
    minids::Sampler sampled(defaults, 4096);
    minids::SamplerParams greedy_params;
    greedy_params.temp = 0.0f;
    minids::Sampler greedy(greedy_params, 4096);
    minids::SamplerParams penalty_params = defaults;
    penalty_params.repeat_penalty = 1.1f;
    minids::Sampler penalized(penalty_params, 4096);
    std::printf("vocabulary %lld, median of %d rounds of 100 draws\n", (long long)vocab, repeats);
    std::printf("defaults (temp 0.8, top-k 40, top-p 0.95, min-p 0.05): %.1f us per token\n",
                median_us_per_draw(sampled, logits, repeats));
    std::printf("greedy (--temp 0):                                     %.1f us per token\n",
                median_us_per_draw(greedy, logits, repeats));
    std::printf("defaults + --repeat-penalty 1.1:                       %.1f us per token\n",
                median_us_per_draw(penalized, logits, repeats));
    return 0;
}
