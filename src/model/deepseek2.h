// DeepSeek-V2 family model: weights bound from a mapped .mds file and the forward graph.
//
// Where the weights live depends on the backend (model/weight_store.h): for the CPU every weight
// is a leaf mgl::tensor whose data points into the file mapping (nothing is copied); for CUDA
// they are copied once into device memory. The routed experts of a MoE layer are reached through
// an expert table, an i64 tensor [n_routed_experts] of blob addresses that moe_experts reads, so
// an expert cache can move experts by rewriting table entries. Shapes below are outermost first,
// as in the checkpoint (a linear weight is [out, in]); D = hidden_size, H = heads,
// r = kv_lora_rank.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "mds/reader.h"
#include "mgl.h"
#include "model/config.h"
#include "model/weight_store.h"

namespace minids {

struct Deepseek2Layer {
    mgl::tensor* attn_norm = nullptr;  // input_layernorm [D]
    mgl::tensor* wq = nullptr;         // q_proj [H·(nope+rope), D]   (q_lora_rank null)
    mgl::tensor* wq_a = nullptr;       // q_a_proj [q_lora_rank, D]   (q_lora_rank set)
    mgl::tensor* q_a_norm = nullptr;   // q_a_layernorm [q_lora_rank]
    mgl::tensor* wq_b = nullptr;       // q_b_proj [H·(nope+rope), q_lora_rank]
    mgl::tensor* wkv_a_mqa = nullptr;  // kv_a_proj_with_mqa [r + rope, D]
    // [wq or wq_a ; wkv_a_mqa] stacked by rows, when the weights were copied (device backends):
    // the query and latent projections read the same input, so one matmul serves both.
    mgl::tensor* wq_kv_a = nullptr;
    mgl::tensor* kv_a_norm = nullptr;  // kv_a_layernorm [r]
    mgl::tensor* wk_b = nullptr;       // view of kv_b_proj: W_uk as [H, r, nope] (transposed)
    mgl::tensor* wv_b = nullptr;       // view of kv_b_proj: W_uv as [H, v, r]
    mgl::tensor* wo = nullptr;         // o_proj [D, H·v]
    mgl::tensor* ffn_norm = nullptr;   // post_attention_layernorm [D]
    // Dense SwiGLU MLP, or the shared experts of a MoE layer (null when absent).
    mgl::tensor* ffn_gate = nullptr;  // [n_ff, D]
    mgl::tensor* ffn_up = nullptr;    // [n_ff, D]
    mgl::tensor* ffn_down = nullptr;  // [D, n_ff]
    // MoE only.
    mgl::tensor* router = nullptr;        // mlp.gate [n_routed_experts, D]
    mgl::tensor* expert_table = nullptr;  // [n_routed_experts] i64 blob addresses
    bool is_moe = false;
};

// What one forward call needs besides the weights. Every value that changes from call to call is
// a tensor, so a graph recorded for one decode step serves the next ones.
struct ForwardBatch {
    mgl::tensor* tokens = nullptr;     // [T] i32
    mgl::tensor* positions = nullptr;  // [T] i32: where each token goes in the cache
    // The latent cache: one page pool per layer [n_pages, page_size, r + rope] and the sequence's
    // page table [max_pages] i32 (see runtime/kv_cache.h).
    std::vector<mgl::tensor*> kv_pages;
    mgl::tensor* page_table = nullptr;
    bool all_logits = false;  // logits for every position, else only the last
    // Routing imposed instead of the routers' choice (the routers still run): per MoE layer, in
    // layer order, ids [T, k] i32 and weights [T, k] f32. Empty: the routers decide.
    std::vector<mgl::tensor*> routing_ids;
    std::vector<mgl::tensor*> routing_weights;
    // The expert cache's device fetch: before each MoE layer's experts run, mgl::expert_fetch
    // with this state copies the layer's missing experts into slots (runtime/expert_offload.h).
    // Null: the expert tables are read as they are.
    mgl::tensor* expert_fetch = nullptr;
    // With expert_fetch, the staging store's stage (mgl::expert_fetch's `stage`): the experts'
    // homes are host memory the device cannot read, so every fill goes through it. Null: the
    // homes are readable in place.
    mgl::tensor* expert_stage = nullptr;
    // With expert_fetch (not the staging store): the count and addresses of the slots the cache
    // lends a prompt chunk ([1 + capacity] i64, mgl::expert_prompt_stage's `buffers`), into
    // which each MoE layer of the chunk copies the experts it uses that are not in slots,
    // instead of the grouped kernels reading them in place. Null: they are read in place.
    mgl::tensor* expert_prompt_stage = nullptr;
    // With expert_fetch and one decoded token whose routing is not imposed: each MoE layer but
    // the last prefetches this many of the next MoE layer's experts, predicted by that layer's
    // router applied to this layer's FFN input (mgl::expert_prefetch; docs/expert-cache.md,
    // "Prefetch"). 0: no prefetch.
    int expert_prefetch = 0;
    // With expert_prefetch: at most this many of those experts are filled per layer, the best
    // ranked that are not in slots (mgl::expert_prefetch's max_fills). 0: every one.
    int expert_prefetch_fills = 0;
};

struct ForwardResult {
    mgl::tensor* logits = nullptr;  // [T, vocab] with all_logits, else [1, vocab]
    // What each MoE layer's router chose (layer order): ids [T, k] i32, weights [T, k] f32.
    std::vector<mgl::tensor*> router_ids;
    std::vector<mgl::tensor*> router_weights;
    // Nodes the graph must place in this order before the rest (mgl::build_graph's `first`):
    // each prefetch right after its previous layer's fetch, so on the CUDA backend it runs
    // beside that layer's experts instead of just before its own layer's fetch.
    std::vector<mgl::tensor*> schedule;
};

class Deepseek2Model {
public:
    // Binds every weight by name and shape (throws mds::FileError naming what is missing or
    // mis-shaped) and places them where `backend` computes (copying them to the device for CUDA).
    // The backend must outlive the model.
    Deepseek2Model(const mds::MdsFile& file, mgl::backend& backend,
                   const WeightOptions& options = {});
    Deepseek2Model(const Deepseek2Model&) = delete;
    Deepseek2Model& operator=(const Deepseek2Model&) = delete;

    const ModelConfig& config() const { return cfg_; }
    const mds::MdsFile& file() const { return file_; }
    // Bytes of the weights the forward reads (dense tensors + expert blobs).
    uint64_t weight_bytes() const { return weight_bytes_; }
    const WeightStore& weights() const { return *store_; }
    // Layers with routed experts, in order, and the experts' layout.
    const std::vector<int64_t>& moe_layers() const { return moe_layers_; }
    const mgl::expert_layout* expert_layout() const { return expert_layout_.get(); }

    // Records the forward for `batch` into `ctx`: writes the batch's c and k_pe into the cache
    // at its positions and returns the logits and the routers' choices.
    ForwardResult build_forward(mgl::context& ctx, const ForwardBatch& batch) const;
    // The experts MoE layer `il`'s router chooses for the residual stream `h` [T, D] (what enters
    // a layer's FFN block, before the norm): layer il's post_attention_layernorm, router, softmax
    // and top-k, the ops the forward routes with. Applied to an earlier layer's state it predicts
    // layer il's experts before that layer runs (the prefetch of issue 10;
    // scripts/record_routing_text.cpp --predict measures how well). Returns ids [T, k] i32.
    // `k` > 0 keeps only the router's k best experts instead of the model's top-k.
    mgl::tensor* build_routing_prediction(mgl::context& ctx, int64_t il, mgl::tensor* h,
                                          int k = 0) const;

private:
    mgl::tensor* weight(const std::string& name, std::vector<int64_t> shape);
    void bind_layer(int64_t il);
    void bind_expert_layout();
    void merge_projections();
    void transpose_wk_b();

    mgl::tensor* build_attention(mgl::context& ctx, const Deepseek2Layer& L, int64_t il,
                                 mgl::tensor* x, const ForwardBatch& batch) const;
    // Router of layer L for the normed FFN input x: ids [T, k] i32, and probs [T, E].
    mgl::tensor* build_router(mgl::context& ctx, const Deepseek2Layer& L, int64_t il,
                              mgl::tensor* x, mgl::tensor*& probs,
                              const mgl::moe_route_params& route) const;
    // A MoE layer's FFN; `fetch` carries the expert fetch from one MoE layer to the next: the
    // table the layer's fetch takes (a prefetch's alias, or null: the layer's own), and what
    // the layer leaves for the next one's prefetch (its fetch and the ids it reads).
    struct FetchChain {
        mgl::tensor* table = nullptr;
        mgl::tensor* last_fetch = nullptr;
        mgl::tensor* last_ids = nullptr;
        mgl::tensor* last_weights = nullptr;
    };
    mgl::tensor* build_ffn(mgl::context& ctx, const Deepseek2Layer& L, int64_t il, mgl::tensor* x,
                           const ForwardBatch& batch, size_t moe_index, ForwardResult& result,
                           FetchChain& fetch) const;

    const mds::MdsFile& file_;
    ModelConfig cfg_;
    mgl::context weights_;  // leaf tensors over the weights (mapping or device copies)
    std::unique_ptr<WeightStore> store_;
    mgl::tensor* tok_embd_ = nullptr;     // embed_tokens [vocab, D]
    mgl::tensor* output_norm_ = nullptr;  // norm [D]
    mgl::tensor* output_ = nullptr;       // lm_head [vocab, D] (embed_tokens when tied)
    std::vector<Deepseek2Layer> layers_;
    std::vector<int64_t> moe_layers_;
    std::shared_ptr<const mgl::expert_layout> expert_layout_;
    std::shared_ptr<const mgl::rope_params> rope_;
    mgl::moe_route_params route_;
    float kq_scale_ = 1.0f;
    uint64_t weight_bytes_ = 0;
};

}  // namespace minids
