// The generation loop: prefill the new tokens as one batch, then sample and decode one token at
// a time until EOS, the token budget, the context end, a stop request from the caller, or Ctrl-C.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <span>

#include "runtime/sampler.h"
#include "runtime/session.h"

namespace minids {

class InterruptHandler;

enum class StopReason { eos, n_predict, context_full, callback, interrupted };

struct GenerationStats {
    int64_t n_prompt = 0;   // tokens prefilled
    double prompt_s = 0.0;  // wall time of the prefill
    int64_t n_gen = 0;      // tokens sampled (EOS not counted)
    double gen_s = 0.0;     // wall time from the first sample to the end
    StopReason stop = StopReason::n_predict;
};

struct GenerateParams {
    int64_t n_predict = -1;         // < 0: until EOS or the context is full
    std::optional<int32_t> eos_id;  // stop at this token (not emitted)
    bool ignore_eos = false;        // never sample eos_id (its logit is -inf) and never stop on it
    const InterruptHandler* interrupt = nullptr;
    const TensorObserver* observe_prefill = nullptr;  // sees the prefill's named intermediates
};

// Prefills `new_tokens` after the session's history (all of them must be new; callers truncate
// the session to the shared prefix first), then generates. `on_token(id)` gets each sampled token
// before it is decoded; returning false stops (a stop string was seen). The prompt tokens are
// accepted into the sampler's penalty window. `prefill_logits`, when given, receives the logits of
// every new position ([n, vocab] row-major).
GenerationStats generate(Session& session, Sampler& sampler, std::span<const int32_t> new_tokens,
                         const GenerateParams& params, const std::function<bool(int32_t)>& on_token,
                         std::vector<float>* prefill_logits = nullptr);

}  // namespace minids
