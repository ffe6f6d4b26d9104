// MoE routing and experts: moe_topk (greedy / group-limited greedy), moe_weights, moe_experts.
#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <vector>

#include "cpu_ops.h"

namespace mgl::cpu {

namespace {

// Ascending by "better": higher probability first, then the lower id.
bool ranks_before(const std::vector<float>& p, int32_t a, int32_t b) {
    return p[size_t(a)] > p[size_t(b)] || (p[size_t(a)] == p[size_t(b)] && a < b);
}

}  // namespace

void run_moe_topk(exec_context& ex, tensor& node) {
    const tensor& probs = *node.src[0];
    const int k = node.iparams[0];
    const auto method = topk_method(node.iparams[1]);
    const int n_group = node.iparams[2], topk_group = node.iparams[3];
    const int64_t E = probs.shape[1];
    ex.pool.parallel_for(probs.shape[0], [&](int64_t t0, int64_t t1) {
        std::vector<float> p(static_cast<size_t>(E));
        std::vector<int32_t> order(static_cast<size_t>(E));
        for (int64_t t = t0; t < t1; ++t) {
            read_row(probs, t, p.data());
            std::iota(order.begin(), order.end(), 0);
            auto end = order.end();
            if (method == topk_method::group_limited_greedy) {
                // Score each group by its best expert, keep the best topk_group groups (ties: lower
                // group id), and rank only the experts of those groups.
                const int64_t group_size = E / n_group;
                std::vector<int32_t> groups(static_cast<size_t>(n_group));
                std::vector<float> group_score(static_cast<size_t>(n_group), -INFINITY);
                for (int64_t e = 0; e < E; ++e)
                    group_score[size_t(e / group_size)] =
                        std::max(group_score[size_t(e / group_size)], p[size_t(e)]);
                std::iota(groups.begin(), groups.end(), 0);
                std::partial_sort(
                    groups.begin(), groups.begin() + topk_group, groups.end(),
                    [&](int32_t a, int32_t b) { return ranks_before(group_score, a, b); });
                std::vector<bool> kept(static_cast<size_t>(n_group), false);
                for (int g = 0; g < topk_group; ++g) kept[size_t(groups[size_t(g)])] = true;
                end = std::stable_partition(order.begin(), order.end(), [&](int32_t e) {
                    return kept[size_t(e / group_size)];
                });
            }
            std::partial_sort(order.begin(), order.begin() + k, end,
                              [&](int32_t a, int32_t b) { return ranks_before(p, a, b); });
            auto* dst = static_cast<int32_t*>(node.data) + t * k;
            std::copy(order.begin(), order.begin() + k, dst);
        }
    });
}

void run_moe_weights(exec_context&, tensor& node) {
    const tensor& probs = *node.src[0];
    const tensor& ids = *node.src[1];
    const int64_t k = node.iparams[0], E = probs.shape[1];
    const bool normalize = node.iparams[1] != 0 && k > 1;
    const float routed_scaling_factor = node.fparams[0];
    for (int64_t t = 0; t < probs.shape[0]; ++t) {
        float* w = static_cast<float*>(node.data) + t * k;
        double sum = 0.0;
        for (int64_t i = 0; i < k; ++i) {
            int32_t id;
            std::memcpy(&id,
                        static_cast<const char*>(ids.data) + t * ids.stride[0] + i * ids.stride[1],
                        sizeof id);
            MGL_CHECK(id >= 0 && id < E, "moe_weights: expert id " + std::to_string(id) +
                                             " outside [0, " + std::to_string(E) + ")");
            w[i] = load_f32(dtype::f32, static_cast<const char*>(probs.data) + t * probs.stride[0] +
                                            id * probs.stride[1]);
            sum += w[i];
        }
        for (int64_t i = 0; i < k; ++i)
            w[i] = normalize ? float(w[i] / sum) : w[i] * routed_scaling_factor;
    }
}

namespace {

// y [M, N] = xs [M, K] · W [N, K]ᵀ (W row-major, `type`, optional f8 row scales) on the pool.
void expert_matmul(exec_context& ex, dtype type, const void* w, const float* scale, const float* xs,
                   int64_t M, int64_t K, float* y, int64_t N) {
    matmul_job job;
    job.x = xs;
    job.x_stride = K;
    job.M = M;
    job.K = K;
    job.type = type;
    job.w = static_cast<const uint8_t*>(w);
    job.w_row_stride = K * int64_t(dtype_size(type));
    job.scale = scale;
    job.y = y;
    job.y_stride = N;
    matmul_parallel(ex, job, N);
}

// SwiGLU MLP on M rows: y [M, D] = down(silu(gate·x) * (up·x)).
void swiglu_mlp(exec_context& ex, dtype type, const void* gate, const float* gate_scale,
                const void* up, const float* up_scale, const void* down, const float* down_scale,
                const float* xs, int64_t M, int64_t D, int64_t F, float* y) {
    std::vector<float> g(static_cast<size_t>(M * F)), u(static_cast<size_t>(M * F));
    expert_matmul(ex, type, gate, gate_scale, xs, M, D, g.data(), F);
    expert_matmul(ex, type, up, up_scale, xs, M, D, u.data(), F);
    for (size_t i = 0; i < g.size(); ++i) g[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
    expert_matmul(ex, type, down, down_scale, g.data(), M, F, y, D);
}

}  // namespace

void run_moe_experts(exec_context& ex, tensor& node) {
    const tensor& x = *node.src[0];
    const tensor& ids = *node.src[1];
    const tensor& wts = *node.src[2];
    const tensor& table = *node.src[3];
    const expert_layout& L = *node.experts;
    const int64_t T = x.shape[0], D = L.n_embd, F = L.n_ff, k = ids.shape[1];
    const int64_t E = table.shape[0];
    const bool fp8 = L.type == dtype::f8_e4m3;
    auto* out = static_cast<float*>(node.data);
    std::fill(out, out + T * D, 0.0f);

    // Tokens routed to each expert, in ascending expert order so results are reproducible.
    std::map<int32_t, std::vector<std::pair<int64_t, float>>> routed;
    for (int64_t t = 0; t < T; ++t) {
        for (int64_t i = 0; i < k; ++i) {
            int32_t id;
            std::memcpy(&id,
                        static_cast<const char*>(ids.data) + t * ids.stride[0] + i * ids.stride[1],
                        sizeof id);
            MGL_CHECK(id >= 0 && id < E, "moe_experts: expert id " + std::to_string(id) +
                                             " outside the table of " + std::to_string(E));
            float w = load_f32(dtype::f32, static_cast<const char*>(wts.data) + t * wts.stride[0] +
                                               i * wts.stride[1]);
            routed[id].emplace_back(t, w);
        }
    }

    std::vector<float> xs, y;
    for (const auto& [id, tokens] : routed) {
        int64_t address;
        std::memcpy(&address, static_cast<const char*>(table.data) + id * sizeof address,
                    sizeof address);
        MGL_CHECK(address != 0, "moe_experts: expert " + std::to_string(id) + " has no blob");
        const auto* blob = reinterpret_cast<const uint8_t*>(address);
        auto scale = [&](uint64_t off) {
            return fp8 ? reinterpret_cast<const float*>(blob + off) : nullptr;
        };
        const auto M = int64_t(tokens.size());
        xs.resize(static_cast<size_t>(M * D));
        y.resize(static_cast<size_t>(M * D));
        for (int64_t m = 0; m < M; ++m) read_row(x, tokens[size_t(m)].first, xs.data() + m * D);
        swiglu_mlp(ex, L.type, blob + L.gate, scale(L.gate_scale), blob + L.up, scale(L.up_scale),
                   blob + L.down, scale(L.down_scale), xs.data(), M, D, F, y.data());
        for (int64_t m = 0; m < M; ++m) {
            auto [t, w] = tokens[size_t(m)];
            for (int64_t d = 0; d < D; ++d) out[t * D + d] += w * y[size_t(m * D + d)];
        }
    }

    if (const tensor* sg = node.src[4]) {  // shared expert: every token, weight 1
        const tensor& su = *node.src[5];
        const tensor& sd = *node.src[6];
        MGL_CHECK(sg->is_contiguous() && su.is_contiguous() && sd.is_contiguous() &&
                      sg->type == su.type && sg->type == sd.type,
                  "moe_experts: shared expert weights must be contiguous and of one dtype");
        const int64_t SF = sg->shape[0];
        xs.resize(static_cast<size_t>(T * D));
        y.resize(static_cast<size_t>(T * D));
        for (int64_t t = 0; t < T; ++t) read_row(x, t, xs.data() + t * D);
        swiglu_mlp(ex, sg->type, sg->data, nullptr, su.data, nullptr, sd.data, nullptr, xs.data(),
                   T, D, SF, y.data());
        for (int64_t i = 0; i < T * D; ++i) out[i] += y[size_t(i)];
    }
}

}  // namespace mgl::cpu
