// Token sampler with llama.cpp's knobs, names and defaults.
//
// The chain, in llama.cpp's order: repeat penalty over the last `repeat_last_n` accepted tokens,
// then top-k, top-p, min-p on the (penalized) distribution, then temperature, then a draw from
// the remaining candidates. `temp <= 0` is greedy: the arg-max after the penalty (ties: lower id).
// The generator is seeded once: the same seed and the same logits give the same tokens.
#pragma once

#include <cstdint>
#include <deque>
#include <random>
#include <span>
#include <vector>

namespace minids {

struct SamplerParams {
    float temp = 0.8f;             // --temp; <= 0: greedy
    int32_t top_k = 40;            // --top-k; <= 0: off
    float top_p = 0.95f;           // --top-p; >= 1: off
    float min_p = 0.05f;           // --min-p; <= 0: off
    float repeat_penalty = 1.0f;   // --repeat-penalty; 1: off
    int32_t repeat_last_n = 64;    // --repeat-last-n; 0: off, -1: the whole context
    uint32_t seed = default_seed;  // -s/--seed; default_seed: a random seed
    static constexpr uint32_t default_seed = 0xFFFFFFFFu;  // llama.cpp's LLAMA_DEFAULT_SEED
};

// A candidate that survived the filters, with its probability after temperature.
struct TokenProb {
    int32_t id = 0;
    float p = 0.0f;
};

class Sampler {
public:
    // n_ctx bounds the penalty window when repeat_last_n == -1.
    Sampler(const SamplerParams& params, int64_t n_ctx);

    // Picks the next token from `logits` (one row of the vocabulary) and does not accept it.
    int32_t sample(std::span<const float> logits);
    // The candidates the draw would choose from, sorted by probability (descending, ties: lower
    // id first), probabilities summing to 1. Greedy gives one candidate with p = 1.
    std::vector<TokenProb> candidates(std::span<const float> logits) const;
    // Records a token (prompt or generated) for the repeat penalty.
    void accept(int32_t id);
    // Forgets the accepted tokens (the generator keeps its state, as llama.cpp's reset does).
    void reset_history() { history_.clear(); }
    uint32_t seed() const { return seed_; }
    const SamplerParams& params() const { return params_; }

private:
    std::vector<float> penalized(std::span<const float> logits) const;

    SamplerParams params_;
    size_t window_ = 0;  // tokens remembered for the penalty
    uint32_t seed_ = 0;
    std::mt19937 rng_;
    std::deque<int32_t> history_;
};

}  // namespace minids
