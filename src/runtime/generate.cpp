#include "runtime/generate.h"

#include <chrono>
#include <limits>

#include "runtime/interrupt.h"

namespace minids {

namespace {
double seconds_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
}  // namespace

GenerationStats generate(Session& session, Sampler& sampler, std::span<const int32_t> new_tokens,
                         const GenerateParams& params, const std::function<bool(int32_t)>& on_token,
                         std::vector<float>* prefill_logits) {
    GenerationStats st;
    const int64_t vocab = session.model().config().vocab_size;
    for (int32_t id : new_tokens) sampler.accept(id);
    auto interrupted = [&] { return params.interrupt && params.interrupt->requested(); };

    // The logits to sample from: a view of the session's buffer (no 400 KB copy per token), or
    // of `owned` when the prompt's logits are kept or observed.
    std::span<float> logits;
    std::vector<float> owned;
    auto t0 = std::chrono::steady_clock::now();
    if (!new_tokens.empty()) {
        if (prefill_logits || params.observe_prefill) {
            const bool all = prefill_logits != nullptr;
            owned = session.eval(new_tokens, all, params.observe_prefill);
            if (all) {
                *prefill_logits = owned;
                owned.erase(owned.begin(), owned.end() - vocab);
            }
            logits = owned;
        } else {
            logits = session.eval_last(new_tokens);
        }
        st.n_prompt = int64_t(new_tokens.size());
    }
    st.prompt_s = seconds_since(t0);
    if (logits.empty() || params.n_predict == 0) {
        st.stop = StopReason::n_predict;
        return st;
    }

    t0 = std::chrono::steady_clock::now();
    for (;;) {
        if (interrupted()) {
            st.stop = StopReason::interrupted;
            break;
        }
        if (params.ignore_eos && params.eos_id && *params.eos_id >= 0 &&
            *params.eos_id < int64_t(logits.size()))
            logits[size_t(*params.eos_id)] = -std::numeric_limits<float>::infinity();
        const int32_t id = sampler.sample(logits);
        sampler.accept(id);
        if (params.eos_id && id == *params.eos_id && !params.ignore_eos) {
            st.stop = StopReason::eos;
            break;
        }
        ++st.n_gen;
        if (!on_token(id)) {
            st.stop = StopReason::callback;
            break;
        }
        if (params.n_predict > 0 && st.n_gen >= params.n_predict) {
            st.stop = StopReason::n_predict;
            break;
        }
        if (session.n_past() + 1 > session.n_ctx()) {
            st.stop = StopReason::context_full;
            break;
        }
        const int32_t one[1] = {id};
        logits = session.eval_last(one);
    }
    st.gen_s = seconds_since(t0);
    return st;
}

}  // namespace minids
