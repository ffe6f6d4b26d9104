// One sequence being run through a model: the token history, its latent KV cache, and eval().
//
// eval() runs a prompt chunk as a graph recorded for that call (chunks of at most n_ubatch
// tokens), and a single decoded token through the decode graph, recorded once per session and
// computed again for every token: before each step only the contents of its inputs change (token,
// position, the page table when a page was added), so a backend may replay it (CUDA graphs).
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
    int64_t n_ubatch = 512;  // most tokens in one prompt graph (longer prompts are chunked)
    mgl::dtype kv_type = mgl::dtype::f32;  // KV cache rows: f32, bf16 or f16
};

// Sees every named intermediate of an eval (e.g. "q_pe-3", "ffn_out-1", "result_output") after
// the graph ran, as contiguous float32 values in the tensor's shape (I32 tensors such as
// expert_ids are converted). Views are not reported: their source is.
using TensorObserver = std::function<void(const mgl::tensor& t, std::span<const float> values)>;

// The experts of one eval's tokens for every MoE layer (Deepseek2Model::moe_layers() order):
// ids and weights are [n_moe_layers][n_tokens][k], row-major.
struct RoutingRecord {
    int64_t n_tokens = 0;
    bool prefill = false;  // a prompt chunk (n_tokens >= 1) rather than one decoded token
    int64_t k = 0;
    std::vector<int32_t> ids;
    std::vector<float> weights;
};
// Sees what the routers chose (or what an override imposed) after each eval.
using RoutingObserver = std::function<void(const RoutingRecord&)>;
// Fills ids and weights (n_tokens, prefill and k are set, the vectors sized) to impose a
// routing on the next eval instead of the routers' choice; the routers still run, so an eval
// costs the same.
using RoutingOverride = std::function<void(RoutingRecord&)>;

class Session {
public:
    // A session with its own cache for one sequence of up to params.n_ctx tokens.
    Session(const Deepseek2Model& model, mgl::backend& backend, const SessionParams& params);
    // A session that takes a new sequence in a cache shared with other sessions (its pages then
    // interleave with theirs); the cache must outlive the session.
    Session(const Deepseek2Model& model, mgl::backend& backend, LatentKvCache& shared_cache,
            const SessionParams& params = {});
    ~Session();
    Session(const Session&) = delete;
    Session& operator=(const Session&) = delete;

    // Appends `tokens` after the cached ones and returns their logits: [tokens.size(), vocab]
    // row-major with all_logits, else the last position's [vocab]. Throws mgl::error when the
    // context would overflow (callers check first).
    // With `observe`, every named intermediate is kept alive (the arena does not reuse it) and
    // handed to the observer: slower (one graph for all tokens, never the decode graph), for
    // dumping a run layer by layer.
    std::vector<float> eval(std::span<const int32_t> tokens, bool all_logits = false,
                            const TensorObserver* observe = nullptr);
    // The same as eval(tokens) (the last position's [vocab] logits) without a copy: a view of the
    // session's own buffer (on a device backend the pinned buffer the logits are downloaded to),
    // valid until the next eval. For decode loops: a 102,400 vocabulary is 400 KB per token.
    std::span<float> eval_last(std::span<const int32_t> tokens);
    // Forgets everything after the first n tokens (the cache keeps the prefix).
    void truncate(int64_t n);
    // Length of the common prefix of `tokens` and the history.
    int64_t common_prefix(std::span<const int32_t> tokens) const;

    void set_routing_observer(RoutingObserver f) { routing_observer_ = std::move(f); }
    // The expert cache's bookkeeping (runtime/expert_offload.h): sees the routing of every eval,
    // before the routing observer, once the eval's logits are back. Its record has the ids; the
    // weights only when a routing observer is set too.
    void set_expert_cache_hook(RoutingObserver f) { expert_cache_hook_ = std::move(f); }
    // The expert cache's device fetch (runtime/expert_offload.h): each MoE layer's missing
    // experts are copied into slots by the graph itself (mgl::expert_fetch with `state`), and
    // `prepare` runs before every eval's graph with its token count (it offers the step's
    // victim slots) and whether the backend will queue the graph whole before any of it runs
    // (mgl::backend::launches_whole: then the victims may follow the launch, written from
    // `collect`). `collect` runs right after the graph is queued, with its token count, so
    // what it queues (the fetch's counters, id log and fill log) comes back in the eval's one
    // wait with the logits; it returns where the step's routing ids will then be (every MoE
    // layer's T · k, back to back), which spares the session one download per layer, or null
    // when it does not log them. A null state turns it off. `stage`: the staging store's
    // (mgl::expert_fetch), or null. Re-records the decode graph.
    // `prefetch`, `prefetch_fills`: ForwardBatch::expert_prefetch and expert_prefetch_fills of the
    // decode graph (0: none; 0: no cap).
    void set_expert_fetch(mgl::tensor* state, mgl::tensor* stage,
                          std::function<void(int64_t n_tokens, bool launched_whole)> prepare,
                          std::function<const int32_t*(int64_t n_tokens)> collect = nullptr,
                          int prefetch = 0, int prefetch_fills = 0);
    // With the device fetch: the count and addresses of the slots lent to a prompt chunk, into
    // which each MoE layer copies its experts not in slots (ForwardBatch::expert_prompt_stage).
    // Null: off. Decode steps never stage, so the decode graph stays as recorded.
    void set_expert_prompt_stage(mgl::tensor* buffers) { expert_prompt_stage_ = buffers; }
    // Changing whether an override is set re-records the decode graph.
    void set_routing_override(RoutingOverride f);
    // The prefetch the decode graph is built with: set_expert_fetch's, but none while an override
    // imposes the routing (the routers cannot predict it).
    int decode_prefetch() const { return routing_override_ ? 0 : expert_prefetch_; }
    // Decode steps go through the recorded graph (default). false records a fresh graph for
    // every token: the independent path tests compare the replayed one against.
    void set_decode_graph(bool on) { use_decode_graph_ = on; }

    const std::vector<int32_t>& tokens() const { return history_; }
    int64_t n_past() const { return int64_t(history_.size()); }
    int64_t n_ctx() const { return cache_->n_ctx(); }
    const LatentKvCache& cache() const { return *cache_; }
    int sequence() const { return seq_; }
    const Deepseek2Model& model() const { return model_; }

private:
    // The graph of one eval and the leaves it reads inputs from.
    struct StepGraph {
        mgl::context ctx;
        mgl::graph graph;
        ForwardResult out;
        mgl::tensor* tokens = nullptr;     // [T] i32
        mgl::tensor* positions = nullptr;  // [T] i32
        std::vector<mgl::tensor*> routing_ids, routing_weights;
        mgl::buffer_ptr inputs;       // backend memory: tokens, positions, imposed routing
        mgl::buffer_ptr host_inputs;  // their staging copy in host memory
    };
    std::unique_ptr<StepGraph> record(int64_t T, bool all_logits, bool keep_named);
    void write_inputs(StepGraph& s, std::span<const int32_t> tokens, int64_t n_past, bool prefill);
    // Throws mgl::error for an empty batch, a context overflow or a token outside the vocabulary.
    void check_eval(std::span<const int32_t> tokens) const;
    // Runs one chunk; its logits come back in the result or, with `view`, as a view of the
    // session's buffer (the last position only).
    std::vector<float> run_chunk(std::span<const int32_t> tokens, bool all_logits,
                                 const TensorObserver* observe, std::span<float>* view = nullptr);
    void report_tensors(const std::vector<mgl::tensor*>& nodes, const TensorObserver& observe);
    // The routing's downloads (and the expert fetch's collect), queued into pinned staging for
    // the eval's one wait; then, after that wait, the record for the hook and the observer.
    void queue_routing(StepGraph& s, int64_t T);
    void report_routing(int64_t T, bool prefill);

    const Deepseek2Model& model_;
    mgl::backend& backend_;
    SessionParams params_;
    std::unique_ptr<LatentKvCache> own_cache_;
    LatentKvCache* cache_ = nullptr;
    int seq_ = 0;
    std::vector<int32_t> history_;
    mgl::arena prompt_arena_, decode_arena_;  // separate, so a prompt never invalidates decode
    std::unique_ptr<StepGraph> decode_;       // recorded on the first decoded token
    mgl::buffer_ptr routing_host_;            // pinned staging for the routing downloads
    mgl::buffer_ptr logits_host_;             // pinned staging for one token's logits
    std::vector<float> last_logits_;          // eval_last's logits on a host backend
    bool use_decode_graph_ = true;
    RoutingObserver routing_observer_;
    RoutingObserver expert_cache_hook_;
    RoutingOverride routing_override_;
    mgl::tensor* expert_fetch_ = nullptr;
    int expert_prefetch_ = 0;
    int expert_prefetch_fills_ = 0;
    mgl::tensor* expert_stage_ = nullptr;
    mgl::tensor* expert_prompt_stage_ = nullptr;
    std::function<void(int64_t, bool)> expert_fetch_prepare_;
    std::function<const int32_t*(int64_t)> expert_fetch_collect_;
    size_t routing_queued_ = 0;  // ids queue_routing queued (weights after them in routing_host_)
    const int32_t* routing_ids_at_ = nullptr;  // where they land: routing_host_ or the fetch's log
    bool routing_weights_queued_ = false;
};

}  // namespace minids
