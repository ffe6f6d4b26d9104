// The tensors a DeepSeek-V2 checkpoint holds, derived from its config alone (DESIGN.md "The
// model, exactly"), in the order the converter writes them; and the .mds plan built from them.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "mds/writer.h"
#include "model/config.h"

namespace minids::convert {

enum class TensorRole : uint8_t {
    embedding,  // model.embed_tokens.weight
    norm,       // RMSNorm weights
    linear,     // [out, in] weights (including lm_head and the router gate)
    expert,     // a routed expert's gate/up/down (packed into a blob, not a dense tensor)
};

struct ExpectedTensor {
    std::string name;
    std::vector<int64_t> shape;  // outermost first
    TensorRole role = TensorRole::linear;
    bool optional = false;  // lm_head.weight when embeddings are tied
    // Routed experts only:
    int64_t layer = -1;
    int64_t expert = -1;
    int part = -1;  // 0 gate, 1 up, 2 down (ExpertLayout::parts order)
};

// Dense tensors first (embedding, layers in order, final norm, lm_head), then the routed expert
// parts ordered by (layer, expert, part).
std::vector<ExpectedTensor> expected_tensors(const ModelConfig& c);

// The .mds plan for a model: dense tensors stored as BF16, experts as blobs of `expert_dtype`.
struct ModelPlan {
    std::vector<ExpectedTensor> tensors;  // expected_tensors(c)
    std::vector<size_t> writer_id;        // per tensor: writer tensor id, or blob id for experts
    size_t n_dense = 0;                   // tensors[0, n_dense) are dense
};
ModelPlan plan_model(const ModelConfig& c, mgl::dtype expert_dtype, bool include_lm_head,
                     mds::MdsWriter& w);

std::string shape_str(const std::vector<int64_t>& shape);

}  // namespace minids::convert
