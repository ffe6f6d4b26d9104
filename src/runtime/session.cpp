#include "runtime/session.h"

#include <algorithm>
#include <string>

namespace minids {

namespace {

KvCacheParams cache_params(const ModelConfig& c, const SessionParams& p) {
    KvCacheParams k;
    k.n_layer = c.num_hidden_layers;
    k.kv_lora_rank = c.kv_lora_rank;
    k.rope_dim = c.qk_rope_head_dim;
    k.n_ctx = p.n_ctx;
    k.page_size = p.page_size;
    k.max_sequences = 1;
    return k;
}

}  // namespace

void Session::report_tensors(const std::vector<mgl::tensor*>& nodes,
                             const TensorObserver& observe) {
    std::vector<float> values;
    std::vector<int32_t> ints;
    for (mgl::tensor* n : nodes) {
        MGL_CHECK(n->is_contiguous(), "session: named node " + n->name + " is not contiguous");
        const size_t count = size_t(n->nelements());
        values.resize(count);
        if (n->type == mgl::dtype::i32) {
            ints.resize(count);
            backend_.download(*n, ints.data(), 0, count * sizeof(int32_t));
            for (size_t i = 0; i < count; ++i) values[i] = float(ints[i]);
        } else {
            backend_.download(*n, values.data(), 0, count * sizeof(float));
        }
        observe(*n, values);
    }
}

Session::Session(const Deepseek2Model& model, mgl::backend& backend, const SessionParams& params)
    : model_(model),
      backend_(backend),
      own_cache_(std::make_unique<LatentKvCache>(backend, cache_params(model.config(), params))),
      cache_(own_cache_.get()) {
    seq_ = cache_->new_sequence();
}

Session::Session(const Deepseek2Model& model, mgl::backend& backend, LatentKvCache& shared_cache)
    : model_(model), backend_(backend), cache_(&shared_cache) {
    seq_ = cache_->new_sequence();
}

Session::~Session() { cache_->free_sequence(seq_); }

std::vector<float> Session::eval(std::span<const int32_t> tokens, bool all_logits,
                                 const TensorObserver* observe) {
    const int64_t T = int64_t(tokens.size());
    MGL_CHECK(T > 0, "session: eval of an empty batch");
    const int64_t n_past = this->n_past();
    MGL_CHECK(n_past + T <= n_ctx(), "session: " + std::to_string(n_past + T) +
                                         " tokens exceed the context of " +
                                         std::to_string(n_ctx()));
    const int64_t vocab = model_.config().vocab_size;
    for (int32_t id : tokens) {
        MGL_CHECK(id >= 0 && id < vocab,
                  "session: token id " + std::to_string(id) + " outside the vocabulary");
    }
    cache_->reserve(seq_, T);

    const size_t in_bytes = 2 * size_t(T) * sizeof(int32_t);
    if (in_bytes > inputs_capacity_) {
        inputs_ = backend_.alloc_buffer(in_bytes);
        inputs_capacity_ = in_bytes;
    }
    mgl::context ctx;
    ForwardBatch batch;
    batch.tokens = ctx.new_tensor(mgl::dtype::i32, {T}, "inp_tokens");
    batch.positions = ctx.new_tensor(mgl::dtype::i32, {T}, "inp_pos");
    batch.n_past = n_past;
    batch.seq = seq_;
    batch.all_logits = all_logits;
    mgl::bind(*batch.tokens, *inputs_, 0);
    mgl::bind(*batch.positions, *inputs_, size_t(T) * sizeof(int32_t));
    std::vector<int32_t> positions(static_cast<size_t>(T));
    for (int64_t i = 0; i < T; ++i) positions[size_t(i)] = int32_t(n_past + i);
    backend_.upload(*batch.tokens, tokens.data(), 0, size_t(T) * sizeof(int32_t));
    backend_.upload(*batch.positions, positions.data(), 0, size_t(T) * sizeof(int32_t));

    mgl::tensor* logits = model_.build_forward(ctx, batch, *cache_);
    mgl::graph g = mgl::build_graph(ctx, {logits});
    std::vector<mgl::tensor*> observed;
    if (observe) {
        // Rebuild with every named computed node as an output, so none is overwritten.
        std::vector<mgl::tensor*> outputs{logits};
        for (mgl::tensor* n : g.nodes) {
            const bool dumpable = n->type == mgl::dtype::f32 || n->type == mgl::dtype::i32;
            // kv_store's node aliases the whole cache, which is no intermediate.
            const bool computed = n->op_kind != mgl::op::view && n->op_kind != mgl::op::kv_store;
            if (n != logits && !n->name.empty() && computed && dumpable) {
                observed.push_back(n);
                outputs.push_back(n);
            }
        }
        observed.push_back(logits);
        g = mgl::build_graph(ctx, outputs);
    }
    backend_.allocate(g);
    backend_.compute(g);
    backend_.synchronize();
    if (observe) report_tensors(observed, *observe);
    std::vector<float> out(size_t(logits->nelements()));
    backend_.download(*logits, out.data(), 0, out.size() * sizeof(float));

    cache_->advance(seq_, T);
    history_.insert(history_.end(), tokens.begin(), tokens.end());
    return out;
}

void Session::truncate(int64_t n) {
    n = std::clamp<int64_t>(n, 0, n_past());
    cache_->truncate(seq_, n);
    history_.resize(size_t(n));
}

int64_t Session::common_prefix(std::span<const int32_t> tokens) const {
    const size_t n = std::min(tokens.size(), history_.size());
    size_t i = 0;
    while (i < n && tokens[i] == history_[i]) ++i;
    return int64_t(i);
}

}  // namespace minids
