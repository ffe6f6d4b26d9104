// DeepSeek-V2 family model: weights bound from a mapped .mds file and the forward graph.
//
// Binding copies nothing: every weight is a leaf mgl::tensor whose data points into the file
// mapping, and the routed experts of a MoE layer are one mgl::expert_set whose per-expert
// pointers point at the expert blobs. Shapes below are outermost first, as in the checkpoint
// (a linear weight is [out, in]); D = hidden_size, H = heads, r = kv_lora_rank.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "mds/reader.h"
#include "mgl.h"
#include "model/config.h"

namespace minids {

class LatentKvCache;

struct Deepseek2Layer {
    mgl::tensor* attn_norm = nullptr;  // input_layernorm [D]
    mgl::tensor* wq = nullptr;         // q_proj [H·(nope+rope), D]   (q_lora_rank null)
    mgl::tensor* wq_a = nullptr;       // q_a_proj [q_lora_rank, D]   (q_lora_rank set)
    mgl::tensor* q_a_norm = nullptr;   // q_a_layernorm [q_lora_rank]
    mgl::tensor* wq_b = nullptr;       // q_b_proj [H·(nope+rope), q_lora_rank]
    mgl::tensor* wkv_a_mqa = nullptr;  // kv_a_proj_with_mqa [r + rope, D]
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
    mgl::tensor* router = nullptr;  // mlp.gate [n_routed_experts, D]
    std::shared_ptr<const mgl::expert_set> experts;
    bool is_moe = false;
};

// What one forward call needs besides the weights.
struct ForwardBatch {
    mgl::tensor* tokens = nullptr;     // [T] i32
    mgl::tensor* positions = nullptr;  // [T] i32, n_past .. n_past+T-1
    int64_t n_past = 0;                // tokens already in the cache for this sequence
    int seq = 0;                       // cache sequence
    bool all_logits = false;           // logits for every position, else only the last
};

class Deepseek2Model {
public:
    // Binds every weight by name and shape; throws mds::FileError naming what is missing or
    // mis-shaped.
    explicit Deepseek2Model(const mds::MdsFile& file);
    Deepseek2Model(const Deepseek2Model&) = delete;
    Deepseek2Model& operator=(const Deepseek2Model&) = delete;

    const ModelConfig& config() const { return cfg_; }
    const mds::MdsFile& file() const { return file_; }
    // Bytes of the weights the forward reads (dense tensors + expert blobs).
    uint64_t weight_bytes() const { return weight_bytes_; }

    // Records the forward for `batch` into `ctx`: writes the batch's c and k_pe into the cache
    // and returns the logits, [T, vocab] with all_logits, else [1, vocab].
    mgl::tensor* build_forward(mgl::context& ctx, const ForwardBatch& batch,
                               LatentKvCache& cache) const;

private:
    mgl::tensor* weight(const std::string& name, std::vector<int64_t> shape);
    mgl::tensor* optional_norm(const std::string& name, int64_t n);
    void bind_layer(int64_t il);
    std::shared_ptr<const mgl::expert_set> bind_experts(int64_t il);

    mgl::tensor* build_attention(mgl::context& ctx, const Deepseek2Layer& L, int64_t il,
                                 mgl::tensor* x, const ForwardBatch& batch, mgl::tensor* pages,
                                 mgl::tensor* page_table) const;
    mgl::tensor* build_ffn(mgl::context& ctx, const Deepseek2Layer& L, int64_t il,
                           mgl::tensor* x) const;

    const mds::MdsFile& file_;
    ModelConfig cfg_;
    mgl::context weights_;                // leaf tensors over the mapping
    mgl::tensor* tok_embd_ = nullptr;     // embed_tokens [vocab, D]
    mgl::tensor* output_norm_ = nullptr;  // norm [D]
    mgl::tensor* output_ = nullptr;       // lm_head [vocab, D] (embed_tokens when tied)
    std::vector<Deepseek2Layer> layers_;
    std::shared_ptr<const mgl::rope_params> rope_;
    mgl::moe_route_params route_;
    float kq_scale_ = 1.0f;
    uint64_t weight_bytes_ = 0;
};

}  // namespace minids
