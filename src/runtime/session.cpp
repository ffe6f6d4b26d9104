#include "runtime/session.h"

#include <algorithm>
#include <cstring>
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
    k.type = p.kv_type;
    return k;
}

constexpr size_t kInputAlign = 64;
size_t align_up(size_t n) { return (n + kInputAlign - 1) / kInputAlign * kInputAlign; }

}  // namespace

Session::Session(const Deepseek2Model& model, mgl::backend& backend, const SessionParams& params)
    : model_(model),
      backend_(backend),
      params_(params),
      own_cache_(std::make_unique<LatentKvCache>(backend, cache_params(model.config(), params))),
      cache_(own_cache_.get()) {
    MGL_CHECK(params_.n_ubatch > 0, "session: n_ubatch must be positive");
    seq_ = cache_->new_sequence();
}

Session::Session(const Deepseek2Model& model, mgl::backend& backend, LatentKvCache& shared_cache,
                 const SessionParams& params)
    : model_(model), backend_(backend), params_(params), cache_(&shared_cache) {
    MGL_CHECK(params_.n_ubatch > 0, "session: n_ubatch must be positive");
    seq_ = cache_->new_sequence();
}

Session::~Session() { cache_->free_sequence(seq_); }

void Session::set_routing_override(RoutingOverride f) {
    if (bool(f) != bool(routing_override_)) decode_.reset();  // the graph's inputs differ
    routing_override_ = std::move(f);
}

void Session::set_expert_fetch(mgl::tensor* state, mgl::tensor* stage,
                               std::function<void(int64_t, bool)> prepare,
                               std::function<const int32_t*(int64_t)> collect, int prefetch,
                               int prefetch_fills) {
    decode_.reset();  // the graph gains or loses its fetch nodes
    expert_fetch_ = state;
    expert_prefetch_ = state ? prefetch : 0;
    expert_prefetch_fills_ = state ? prefetch_fills : 0;
    expert_stage_ = state ? stage : nullptr;
    expert_fetch_prepare_ = std::move(prepare);
    expert_fetch_collect_ = std::move(collect);
}

std::unique_ptr<Session::StepGraph> Session::record(int64_t T, bool all_logits, bool keep_named) {
    auto s = std::make_unique<StepGraph>();
    const int64_t k = model_.config().num_experts_per_tok;
    const size_t n_moe = model_.moe_layers().size();
    const bool imposed = bool(routing_override_);

    // Inputs, back to back in one backend buffer (one upload per step) with a host staging copy.
    s->tokens = s->ctx.new_tensor(mgl::dtype::i32, {T}, "inp_tokens");
    s->positions = s->ctx.new_tensor(mgl::dtype::i32, {T}, "inp_pos");
    std::vector<mgl::tensor*> inputs{s->tokens, s->positions};
    for (size_t i = 0; imposed && i < n_moe; ++i) {
        const std::string l = std::to_string(model_.moe_layers()[i]);
        s->routing_ids.push_back(s->ctx.new_tensor(mgl::dtype::i32, {T, k}, "imposed_ids-" + l));
        s->routing_weights.push_back(
            s->ctx.new_tensor(mgl::dtype::f32, {T, k}, "imposed_weights-" + l));
        inputs.push_back(s->routing_ids.back());
        inputs.push_back(s->routing_weights.back());
    }
    size_t bytes = 0;
    for (mgl::tensor* t : inputs) bytes += align_up(mgl::nbytes(*t));
    s->inputs = backend_.alloc_buffer(bytes);
    s->host_inputs = backend_.alloc_host_buffer(bytes);
    size_t at = 0;
    for (mgl::tensor* t : inputs) {
        mgl::bind(*t, *s->inputs, at);
        at += align_up(mgl::nbytes(*t));
    }

    ForwardBatch batch;
    batch.tokens = s->tokens;
    batch.positions = s->positions;
    for (int64_t il = 0; il < model_.config().num_hidden_layers; ++il)
        batch.kv_pages.push_back(cache_->layer_pages(s->ctx, il));
    batch.page_table = cache_->page_table(s->ctx, seq_);
    batch.all_logits = all_logits;
    batch.routing_ids = s->routing_ids;
    batch.routing_weights = s->routing_weights;
    batch.expert_fetch = expert_fetch_;
    batch.expert_stage = expert_stage_;
    if (expert_fetch_ && !expert_stage_) batch.expert_prompt_stage = expert_prompt_stage_;
    batch.expert_prefetch = decode_prefetch();
    batch.expert_prefetch_fills = expert_prefetch_fills_;
    s->out = model_.build_forward(s->ctx, batch);

    // The routers' choices are outputs too: kept for the routing observer, and computed even
    // when an imposed routing replaces them (so an eval costs the same either way).
    std::vector<mgl::tensor*> outputs{s->out.logits};
    outputs.insert(outputs.end(), s->out.router_ids.begin(), s->out.router_ids.end());
    outputs.insert(outputs.end(), s->out.router_weights.begin(), s->out.router_weights.end());
    s->graph = mgl::build_graph(s->ctx, outputs, s->out.schedule);
    if (keep_named) {
        // Every named computed node becomes an output, so none is overwritten.
        for (mgl::tensor* n : s->graph.nodes) {
            const bool dumpable = n->type == mgl::dtype::f32 || n->type == mgl::dtype::i32;
            // kv_store's node aliases the whole cache, which is no intermediate.
            const bool computed = n->op_kind != mgl::op::view && n->op_kind != mgl::op::kv_store;
            if (!n->name.empty() && computed && dumpable &&
                std::find(outputs.begin(), outputs.end(), n) == outputs.end())
                outputs.push_back(n);
        }
        s->graph = mgl::build_graph(s->ctx, outputs, s->out.schedule);
    }
    return s;
}

void Session::write_inputs(StepGraph& s, std::span<const int32_t> tokens, int64_t n_past,
                           bool prefill) {
    const int64_t T = int64_t(tokens.size());
    auto* host = static_cast<uint8_t*>(s.host_inputs->base());
    auto host_of = [&](const mgl::tensor* t) {
        return host + (static_cast<const uint8_t*>(t->data) -
                       static_cast<const uint8_t*>(s.inputs->base()));
    };
    std::memcpy(host_of(s.tokens), tokens.data(), size_t(T) * sizeof(int32_t));
    auto* pos = reinterpret_cast<int32_t*>(host_of(s.positions));
    for (int64_t i = 0; i < T; ++i) pos[i] = int32_t(n_past + i);
    if (!s.routing_ids.empty()) {
        RoutingRecord r;
        r.n_tokens = T;
        r.prefill = prefill;
        r.k = s.routing_ids[0]->dim(1);
        const size_t per_layer = size_t(T * r.k);
        r.ids.assign(per_layer * s.routing_ids.size(), 0);
        r.weights.assign(per_layer * s.routing_ids.size(), 0.0f);
        routing_override_(r);
        const int64_t E = model_.config().n_routed_experts;
        for (int32_t id : r.ids) {
            MGL_CHECK(id >= 0 && id < E, "imposed routing: expert id " + std::to_string(id) +
                                             " outside [0, " + std::to_string(E) + ")");
        }
        for (size_t l = 0; l < s.routing_ids.size(); ++l) {
            std::memcpy(host_of(s.routing_ids[l]), r.ids.data() + l * per_layer,
                        per_layer * sizeof(int32_t));
            std::memcpy(host_of(s.routing_weights[l]), r.weights.data() + l * per_layer,
                        per_layer * sizeof(float));
        }
    }
    // One copy for all inputs: they are adjacent in the buffer.
    mgl::context ctx;
    mgl::tensor* all = ctx.new_tensor(mgl::dtype::i32, {int64_t(s.inputs->size() / 4)});
    mgl::bind(*all, *s.inputs, 0);
    backend_.upload_async(*all, host, 0, s.inputs->size() / 4 * 4);
}

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

void Session::queue_routing(StepGraph& s, int64_t T) {
    const auto& ids = s.routing_ids.empty() ? s.out.router_ids : s.routing_ids;
    const auto& wts = s.routing_ids.empty() ? s.out.router_weights : s.routing_weights;
    const size_t per_layer = size_t(T * model_.config().num_experts_per_tok);
    // The expert cache needs only the ids; the weights are fetched for a routing observer. The
    // device fetch logs a decoded token's ids beside its fill log, which comes down in one
    // copy; otherwise every layer's downloads go into one pinned staging buffer, queued while
    // the step still runs (26 small copies cost the host ~2 µs each and the device more, after
    // the step), and cost one wait for the device.
    const bool weights = bool(routing_observer_);
    const size_t n = per_layer * ids.size();
    routing_queued_ = n;
    routing_weights_queued_ = weights;
    const int32_t* fetched = expert_fetch_collect_ ? expert_fetch_collect_(T) : nullptr;
    if (fetched && !weights) {
        routing_ids_at_ = fetched;
        return;
    }
    const size_t bytes = n * sizeof(int32_t) + (weights ? n * sizeof(float) : 0);
    auto* staged_ids =
        static_cast<int32_t*>(backend_.host_staging(routing_host_, std::max<size_t>(bytes, 4096)));
    auto* staged_wts = reinterpret_cast<float*>(staged_ids + n);
    for (size_t l = 0; l < ids.size(); ++l) {
        backend_.download_async(*ids[l], staged_ids + l * per_layer, 0,
                                per_layer * sizeof(int32_t));
        if (weights)
            backend_.download_async(*wts[l], staged_wts + l * per_layer, 0,
                                    per_layer * sizeof(float));
    }
    routing_ids_at_ = staged_ids;
}

void Session::report_routing(int64_t T, bool prefill) {
    RoutingRecord r;
    r.n_tokens = T;
    r.prefill = prefill;
    r.k = model_.config().num_experts_per_tok;
    const size_t n = routing_queued_;
    const int32_t* staged_ids = routing_ids_at_;
    const auto* staged_wts = reinterpret_cast<const float*>(staged_ids + n);
    r.ids.assign(staged_ids, staged_ids + n);
    if (routing_weights_queued_) r.weights.assign(staged_wts, staged_wts + n);
    routing_queued_ = 0;
    if (expert_cache_hook_) expert_cache_hook_(r);
    if (routing_observer_) routing_observer_(r);
}

// Logits up to this size go through a pinned staging buffer kept by the session (one token's
// logits are 0.5 MB or less for every supported vocabulary); larger ones (all positions of a
// prompt) are downloaded directly.
constexpr size_t max_staged_logits_bytes = size_t(4) << 20;

std::vector<float> Session::run_chunk(std::span<const int32_t> tokens, bool all_logits,
                                      const TensorObserver* observe, std::span<float>* view) {
    const int64_t T = int64_t(tokens.size());
    const int64_t n_past = this->n_past();
    const bool decode = T == 1 && !observe && use_decode_graph_;
    cache_->reserve(seq_, T);

    std::unique_ptr<StepGraph> one_off;
    StepGraph* s;
    if (decode) {
        if (!decode_) {
            decode_ = record(1, false, false);
            decode_->graph.reusable = true;
            backend_.allocate(decode_->graph, decode_arena_);
        }
        s = decode_.get();
    } else {
        one_off = record(T, all_logits, observe != nullptr);
        backend_.allocate(one_off->graph, prompt_arena_);
        s = one_off.get();
    }
    write_inputs(*s, tokens, n_past, !decode);
    cache_->sync(seq_);
    if (expert_fetch_prepare_) expert_fetch_prepare_(T, backend_.launches_whole(s->graph));
    backend_.compute(s->graph);

    if (observe) {
        std::vector<mgl::tensor*> observed;
        for (mgl::tensor* n : s->graph.outputs) {
            if (n != s->out.logits && !n->name.empty()) observed.push_back(n);
        }
        observed.push_back(s->out.logits);
        report_tensors(observed, *observe);
    }
    const size_t n_logits = size_t(s->out.logits->nelements());
    std::vector<float> out;
    const bool device = backend_.compute_memory() != mgl::memory_kind::host;
    // (The device fetch's collect always runs: it may owe the step its victims.)
    const bool routing = routing_observer_ || expert_cache_hook_ || expert_fetch_collect_;
    bool routing_queued = false;
    if (device && n_logits * sizeof(float) <= max_staged_logits_bytes) {
        // Every decoded token downloads its logits (400 KB for a 102,400 vocabulary): through
        // pinned staging, as the driver stages a copy to pageable memory itself, more slowly.
        // (A backend computing in host memory copies straight into the result.) The routing's
        // downloads join the same wait.
        const size_t bytes = n_logits * sizeof(float);
        auto* staged = static_cast<float*>(backend_.host_staging(logits_host_, bytes));
        backend_.download_async(*s->out.logits, staged, 0, bytes);
        if (routing) queue_routing(*s, T);
        routing_queued = routing;
        backend_.synchronize();
        if (view) {
            *view = std::span<float>(staged, n_logits);
        } else {
            out.assign(staged, staged + n_logits);
        }
    } else if (view) {  // a host backend: into the session's buffer, allocated once
        last_logits_.resize(n_logits);
        backend_.download(*s->out.logits, last_logits_.data(), 0, n_logits * sizeof(float));
        *view = last_logits_;
    } else {  // a prompt's logits for every position, or a host backend: straight into the result
        out.resize(n_logits);
        backend_.download(*s->out.logits, out.data(), 0, n_logits * sizeof(float));
    }
    if (routing) {
        if (!routing_queued) {
            queue_routing(*s, T);
            backend_.synchronize();
        }
        report_routing(T, !decode);
    }

    cache_->advance(seq_, T);
    history_.insert(history_.end(), tokens.begin(), tokens.end());
    return out;
}

void Session::check_eval(std::span<const int32_t> tokens) const {
    const int64_t T = int64_t(tokens.size());
    MGL_CHECK(T > 0, "session: eval of an empty batch");
    MGL_CHECK(n_past() + T <= n_ctx(), "session: " + std::to_string(n_past() + T) +
                                           " tokens exceed the context of " +
                                           std::to_string(n_ctx()));
    const int64_t vocab = model_.config().vocab_size;
    for (int32_t id : tokens) {
        MGL_CHECK(id >= 0 && id < vocab,
                  "session: token id " + std::to_string(id) + " outside the vocabulary");
    }
}

std::span<float> Session::eval_last(std::span<const int32_t> tokens) {
    check_eval(tokens);
    const int64_t T = int64_t(tokens.size()), chunk = params_.n_ubatch;
    std::span<float> view;
    for (int64_t i = 0; i < T; i += chunk)
        run_chunk(tokens.subspan(size_t(i), size_t(std::min(chunk, T - i))), false, nullptr, &view);
    return view;
}

std::vector<float> Session::eval(std::span<const int32_t> tokens, bool all_logits,
                                 const TensorObserver* observe) {
    check_eval(tokens);
    const int64_t T = int64_t(tokens.size());
    // A dump sees the whole prompt as one graph; otherwise prompts run in chunks of n_ubatch.
    const int64_t chunk = observe ? T : params_.n_ubatch;
    std::vector<float> logits;
    for (int64_t i = 0; i < T; i += chunk) {
        const auto part = tokens.subspan(size_t(i), size_t(std::min(chunk, T - i)));
        std::vector<float> l = run_chunk(part, all_logits, observe);
        if (all_logits) {
            logits.insert(logits.end(), l.begin(), l.end());
        } else {
            logits = std::move(l);
        }
    }
    return logits;
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
