// One sequence being run through a model: the token history, its latent KV cache, and the
// eval step that runs one graph per call (a whole prompt chunk, or one decoded token).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "mgl.h"
#include "model/deepseek2.h"
#include "runtime/kv_cache.h"

namespace minids {

struct SessionParams {
    int64_t n_ctx = 4096;    // longest sequence, in tokens
    int64_t page_size = 64;  // KV cache page, in tokens
};

// Sees every named intermediate of an eval (e.g. "q_pe-3", "moe_out-1", "result_output") after
// the graph ran, as contiguous float32 values in the tensor's shape (I32 tensors such as
// expert_ids are converted). Views are not reported: their source is.
using TensorObserver = std::function<void(const mgl::tensor& t, std::span<const float> values)>;

class Session {
public:
    // A session with its own cache for one sequence of up to params.n_ctx tokens.
    Session(const Deepseek2Model& model, mgl::backend& backend, const SessionParams& params);
    // A session that takes a new sequence in a cache shared with other sessions (its pages then
    // interleave with theirs); the cache must outlive the session.
    Session(const Deepseek2Model& model, mgl::backend& backend, LatentKvCache& shared_cache);
    ~Session();
    Session(const Session&) = delete;
    Session& operator=(const Session&) = delete;

    // Appends `tokens` after the cached ones in one graph and returns their logits:
    // [tokens.size(), vocab] row-major with all_logits, else the last position's [vocab].
    // Throws mgl::error when the context would overflow (callers check first).
    // With `observe`, every named intermediate is kept alive (the arena does not reuse it) and
    // handed to the observer: slower, for dumping a run layer by layer.
    std::vector<float> eval(std::span<const int32_t> tokens, bool all_logits = false,
                            const TensorObserver* observe = nullptr);
    // Forgets everything after the first n tokens (the cache keeps the prefix).
    void truncate(int64_t n);
    // Length of the common prefix of `tokens` and the history.
    int64_t common_prefix(std::span<const int32_t> tokens) const;

    const std::vector<int32_t>& tokens() const { return history_; }
    int64_t n_past() const { return int64_t(history_.size()); }
    int64_t n_ctx() const { return cache_->n_ctx(); }
    const LatentKvCache& cache() const { return *cache_; }
    int sequence() const { return seq_; }
    const Deepseek2Model& model() const { return model_; }

private:
    void report_tensors(const std::vector<mgl::tensor*>& nodes, const TensorObserver& observe);

    const Deepseek2Model& model_;
    mgl::backend& backend_;
    std::unique_ptr<LatentKvCache> own_cache_;
    LatentKvCache* cache_ = nullptr;
    int seq_ = 0;
    std::vector<int32_t> history_;
    mgl::buffer_ptr inputs_;  // tokens then positions of the current batch
    size_t inputs_capacity_ = 0;
};

}  // namespace minids
