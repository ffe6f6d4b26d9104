#include "runtime/sampler.h"

#include <algorithm>
#include <cmath>
#include <unordered_set>

namespace minids {

namespace {

// Softmax of the candidates' logits divided by `temp`, in place (max-subtracted, in double so
// that the sums do not depend on the order of large and small terms).
void softmax_in_place(std::vector<std::pair<int32_t, float>>& cands, std::vector<double>& probs,
                      double temp) {
    probs.resize(cands.size());
    double max_logit = cands.front().second;
    for (const auto& c : cands) max_logit = std::max(max_logit, double(c.second));
    double sum = 0.0;
    for (size_t i = 0; i < cands.size(); ++i) {
        probs[i] = std::exp((double(cands[i].second) - max_logit) / temp);
        sum += probs[i];
    }
    for (double& p : probs) p /= sum;
}

// Index of the first maximum, as std::max_element (NaNs are never a maximum unless first). Eight
// independent running maxima so the scan vectorizes: half the time of max_element over a
// 102,400-entry vocabulary.
size_t first_argmax(std::span<const float> v) {
    const size_t n = v.size();
    float m[8];
    for (float& x : m) x = v[0];
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (size_t j = 0; j < 8; ++j) m[j] = v[i + j] > m[j] ? v[i + j] : m[j];
    float best = m[0];
    for (size_t j = 1; j < 8; ++j) best = m[j] > best ? m[j] : best;
    for (; i < n; ++i) best = v[i] > best ? v[i] : best;
    for (size_t k = 0; k < n; ++k)
        if (v[k] == best) return k;
    return 0;  // v[0] is NaN
}

}  // namespace

Sampler::Sampler(const SamplerParams& params, int64_t n_ctx) : params_(params) {
    if (params_.repeat_last_n < 0) {
        window_ = size_t(std::max<int64_t>(n_ctx, 0));
    } else {
        window_ = size_t(params_.repeat_last_n);
    }
    seed_ = params_.seed;
    if (seed_ == SamplerParams::default_seed) seed_ = std::random_device{}();
    rng_.seed(seed_);
}

void Sampler::accept(int32_t id) {
    if (window_ == 0) return;
    history_.push_back(id);
    while (history_.size() > window_) history_.pop_front();
}

// llama.cpp's repeat penalty: every distinct token of the window once; a positive logit is
// divided by the penalty, a negative one multiplied, so both move towards "less likely".
std::vector<float> Sampler::penalized(std::span<const float> logits) const {
    std::vector<float> out(logits.begin(), logits.end());
    if (params_.repeat_penalty == 1.0f || history_.empty()) return out;
    std::unordered_set<int32_t> seen;
    for (int32_t id : history_) {
        if (id < 0 || size_t(id) >= out.size() || !seen.insert(id).second) continue;
        float& l = out[size_t(id)];
        l = l > 0.0f ? l / params_.repeat_penalty : l * params_.repeat_penalty;
    }
    return out;
}

std::vector<TokenProb> Sampler::candidates(std::span<const float> logits) const {
    if (logits.empty()) return {};
    // Copy the vocabulary only when a penalty changes it (this runs once per generated token:
    // a 102,400-entry vocabulary is 400 KB).
    std::vector<float> pen_copy;
    if (params_.repeat_penalty != 1.0f && !history_.empty()) pen_copy = penalized(logits);
    const std::span<const float> pen = pen_copy.empty() ? logits : std::span<const float>(pen_copy);
    if (params_.temp <= 0.0f) {
        // First maximum wins, so ties go to the lower id.
        return {TokenProb{int32_t(first_argmax(pen)), 1.0f}};
    }

    auto by_logit = [](const auto& a, const auto& b) {
        return a.second > b.second || (a.second == b.second && a.first < b.first);
    };
    std::vector<std::pair<int32_t, float>> cands;
    const size_t keep =
        params_.top_k > 0 ? std::min(pen.size(), size_t(params_.top_k)) : pen.size();
    if (keep < pen.size()) {
        // Top-k in one pass: a heap of the best k so far, its worst on top; a later token ties
        // with it only at a higher id, so anything not above its logit is out at one compare.
        // Then the k sorted. Same set and order as sorting everything.
        cands.reserve(keep);
        size_t i = 0;
        for (; i < keep; ++i) {
            cands.emplace_back(int32_t(i), pen[i]);
            std::push_heap(cands.begin(), cands.end(), by_logit);
        }
        float worst = cands.front().second;
        for (; i < pen.size(); ++i) {
            if (!(pen[i] > worst)) continue;
            std::pop_heap(cands.begin(), cands.end(), by_logit);
            cands.back() = {int32_t(i), pen[i]};
            std::push_heap(cands.begin(), cands.end(), by_logit);
            worst = cands.front().second;
        }
        std::sort(cands.begin(), cands.end(), by_logit);
    } else {
        cands.resize(pen.size());
        for (size_t i = 0; i < pen.size(); ++i) cands[i] = {int32_t(i), pen[i]};
        std::sort(cands.begin(), cands.end(), by_logit);
    }

    std::vector<double> probs;
    if (params_.top_p < 1.0f) {
        // Smallest prefix whose mass reaches top_p (at least one token).
        softmax_in_place(cands, probs, 1.0);
        double cum = 0.0;
        size_t n = 0;
        while (n < cands.size()) {
            cum += probs[n++];
            if (cum >= double(params_.top_p)) break;
        }
        cands.resize(n);
    }
    if (params_.min_p > 0.0f) {
        // Keep tokens whose probability is at least min_p times the best one's; in logits that
        // is logit >= max_logit + ln(min_p). The best token always stays.
        const double cut = double(cands.front().second) + std::log(double(params_.min_p));
        size_t n = 1;
        while (n < cands.size() && double(cands[n].second) >= cut) ++n;
        cands.resize(n);
    }
    softmax_in_place(cands, probs, double(params_.temp));
    std::vector<TokenProb> out(cands.size());
    for (size_t i = 0; i < cands.size(); ++i) out[i] = {cands[i].first, float(probs[i])};
    return out;
}

int32_t Sampler::sample(std::span<const float> logits) {
    std::vector<TokenProb> cands = candidates(logits);
    if (cands.empty()) return 0;
    if (cands.size() == 1) return cands.front().id;
    // A uniform draw from the raw 32-bit output (not std::uniform_real_distribution, whose
    // algorithm differs between standard libraries), so a seed means the same tokens everywhere.
    const double u = double(rng_()) / 4294967296.0;
    double cum = 0.0;
    for (const TokenProb& c : cands) {
        cum += double(c.p);
        if (u < cum) return c.id;
    }
    return cands.back().id;
}

}  // namespace minids
