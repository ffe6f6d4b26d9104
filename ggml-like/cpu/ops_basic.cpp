// Row-wise and elementwise ops: get_rows, add, mul, scale, rms_norm, rope, softmax, swiglu, cpy,
// contiguous, concat. Each is a plain loop over rows, rows split across the thread pool.
#include <cmath>
#include <vector>

#include "cpu_ops.h"

namespace mgl::cpu {

namespace {

float* out_row(tensor& node, int64_t row) {
    return static_cast<float*>(node.data) + row * inner_dim(node);
}

// Index of every dim but the innermost for row `row` of a tensor with t's shape.
std::array<int64_t, max_dims> row_index(const tensor& t, int64_t row) {
    std::array<int64_t, max_dims> idx{};
    for (int i = t.n_dims - 2; i >= 0; --i) {
        idx[size_t(i)] = row % t.shape[size_t(i)];
        row /= t.shape[size_t(i)];
    }
    return idx;
}

void for_rows(exec_context& ex, const tensor& node, const std::function<void(int64_t)>& fn) {
    ex.pool.parallel_for(
        n_rows(node),
        [&](int64_t r0, int64_t r1) {
            for (int64_t r = r0; r < r1; ++r) fn(r);
        },
        rows_per_chunk(inner_dim(node)));
}

}  // namespace

void run_get_rows(exec_context& ex, tensor& node) {
    const tensor& table = *node.src[0];
    const tensor& ids = *node.src[1];
    const tensor* scale = node.src[2];
    int64_t V = table.shape[0], D = table.shape[1];
    for_rows(ex, node, [&](int64_t t) {
        int32_t id = load_i32(ids, t);
        MGL_CHECK(id >= 0 && id < V, "get_rows: id " + std::to_string(id) + " at position " +
                                         std::to_string(t) + " is outside the table's " +
                                         std::to_string(V) + " rows");
        const char* src = static_cast<const char*>(table.data) + id * table.stride[0];
        float s = scale ? static_cast<const float*>(scale->data)[id] : 1.0f;
        float* dst = out_row(node, t);
        for (int64_t i = 0; i < D; ++i)
            dst[i] = load_f32(table.type, src + i * table.stride[1]) * s;
    });
}

void run_add_mul(exec_context& ex, tensor& node) {
    const tensor& a = *node.src[0];
    const tensor& b = *node.src[1];
    const bool is_add = node.op_kind == op::add;
    const int offset = a.n_dims - b.n_dims;  // b's dims align with a's innermost ones
    const int64_t D = inner_dim(node);
    const int64_t b_inner_stride = (b.n_dims == 0 || inner_dim(b) == 1) ? 0 : inner_stride(b);
    for_rows(ex, node, [&](int64_t r) {
        auto idx = row_index(a, r);
        const char* bp = static_cast<const char*>(b.data);
        for (int j = 0; j + 1 < b.n_dims; ++j) {
            if (b.shape[size_t(j)] != 1) bp += idx[size_t(j + offset)] * b.stride[size_t(j)];
        }
        const char* ap = row_ptr(a, r);
        float* dst = out_row(node, r);
        for (int64_t i = 0; i < D; ++i) {
            float x = load_f32(dtype::f32, ap + i * inner_stride(a));
            float y = load_f32(dtype::f32, bp + i * b_inner_stride);
            dst[i] = is_add ? x + y : x * y;
        }
    });
}

void run_scale(exec_context& ex, tensor& node) {
    const tensor& a = *node.src[0];
    const float s = node.fparams[0];
    for_rows(ex, node, [&](int64_t r) {
        float* dst = out_row(node, r);
        read_row(a, r, dst);
        for (int64_t i = 0; i < inner_dim(node); ++i) dst[i] *= s;
    });
}

void run_rms_norm(exec_context& ex, tensor& node) {
    const tensor& x = *node.src[0];
    const tensor* w = node.src[1];
    const float eps = node.fparams[0];
    const int64_t D = inner_dim(node);
    for_rows(ex, node, [&](int64_t r) {
        float* dst = out_row(node, r);
        read_row(x, r, dst);
        double sum_sq = 0.0;
        for (int64_t i = 0; i < D; ++i) sum_sq += double(dst[i]) * dst[i];
        float inv = 1.0f / std::sqrt(float(sum_sq / double(D)) + eps);
        for (int64_t i = 0; i < D; ++i) {
            float g =
                w ? load_f32(w->type, static_cast<const char*>(w->data) + i * w->stride[0]) : 1.0f;
            dst[i] = g * (dst[i] * inv);
        }
    });
}

void run_rope(exec_context& ex, tensor& node) {
    const tensor& x = *node.src[0];
    const tensor& positions = *node.src[1];
    const rope_params& p = *node.rope;
    const int64_t T = x.shape[0], H = x.n_dims == 3 ? x.shape[1] : 1, half = p.n_dims / 2;
    ex.pool.parallel_for(T, [&](int64_t t0, int64_t t1) {
        std::vector<float> cos_t(static_cast<size_t>(half)), sin_t(static_cast<size_t>(half));
        std::vector<float> row(static_cast<size_t>(p.n_dims));
        for (int64_t t = t0; t < t1; ++t) {
            // The angle is a float product, as in the reference implementation.
            float pos = float(load_i32(positions, t));
            for (int64_t i = 0; i < half; ++i) {
                float angle = pos * p.inv_freq[size_t(i)];
                cos_t[size_t(i)] = float(std::cos(double(angle))) * p.attn_factor;
                sin_t[size_t(i)] = float(std::sin(double(angle))) * p.attn_factor;
            }
            for (int64_t h = 0; h < H; ++h) {
                int64_t r = t * H + h;
                read_row(x, r, row.data());
                float* dst = out_row(node, r);
                for (int64_t i = 0; i < half; ++i) {
                    float a = row[size_t(2 * i)], b = row[size_t(2 * i + 1)];
                    dst[2 * i] = a * cos_t[size_t(i)] - b * sin_t[size_t(i)];
                    dst[2 * i + 1] = a * sin_t[size_t(i)] + b * cos_t[size_t(i)];
                }
            }
        }
    });
}

void softmax_row(float* row, int64_t n, float scale) {
    float mx = -INFINITY;
    for (int64_t j = 0; j < n; ++j) mx = std::max(mx, row[j] * scale);
    double sum = 0.0;
    for (int64_t j = 0; j < n; ++j) {
        row[j] = std::exp(row[j] * scale - mx);
        sum += row[j];
    }
    auto inv = float(1.0 / sum);
    for (int64_t j = 0; j < n; ++j) row[j] *= inv;
}

void run_softmax(exec_context& ex, tensor& node) {
    const tensor& x = *node.src[0];
    const float scale = node.fparams[0];
    const bool causal = node.iparams[0] != 0;
    const int64_t n_past = node.iparams[1];
    const int64_t Tk = inner_dim(node);
    const int64_t Tq = node.n_dims >= 2 ? node.shape[size_t(node.n_dims - 2)] : 1;
    for_rows(ex, node, [&](int64_t r) {
        float* dst = out_row(node, r);
        read_row(x, r, dst);
        int64_t visible = causal ? std::min(Tk, r % Tq + n_past + 1) : Tk;
        softmax_row(dst, visible, scale);
        for (int64_t j = visible; j < Tk; ++j) dst[j] = 0.0f;
    });
}

void run_swiglu(exec_context& ex, tensor& node) {
    const tensor& a = *node.src[0];
    const tensor& b = *node.src[1];
    const int64_t D = inner_dim(node);
    for_rows(ex, node, [&](int64_t r) {
        float* dst = out_row(node, r);
        const char* ap = row_ptr(a, r);
        const char* bp = row_ptr(b, r);
        for (int64_t i = 0; i < D; ++i) {
            float g = load_f32(dtype::f32, ap + i * inner_stride(a));
            float u = load_f32(dtype::f32, bp + i * inner_stride(b));
            dst[i] = g / (1.0f + std::exp(-g)) * u;
        }
    });
}

void run_cpy(exec_context& ex, tensor& node) {
    const tensor& src = *node.src[0];
    const int64_t D = inner_dim(node);
    // node has dst's shape, strides, dtype and (aliased) address.
    for_rows(ex, node, [&](int64_t r) {
        const char* sp = row_ptr(src, r);
        char* dp = row_ptr(node, r);
        for (int64_t i = 0; i < D; ++i)
            store_f32(node.type, dp + i * inner_stride(node),
                      load_f32(src.type, sp + i * inner_stride(src)));
    });
}

void run_contiguous(exec_context& ex, tensor& node) {
    const tensor& a = *node.src[0];
    for_rows(ex, node, [&](int64_t r) { read_row(a, r, out_row(node, r)); });
}

void run_concat(exec_context& ex, tensor& node) {
    const tensor& a = *node.src[0];
    const tensor& b = *node.src[1];
    const int dim = node.iparams[0];
    const int64_t D = inner_dim(node);
    const int64_t split = a.shape[size_t(dim)];
    auto element = [](const tensor& t, const std::array<int64_t, max_dims>& idx, int64_t inner) {
        const char* p = static_cast<const char*>(t.data);
        for (int i = 0; i + 1 < t.n_dims; ++i) p += idx[size_t(i)] * t.stride[size_t(i)];
        return load_f32(t.type, p + inner * inner_stride(t));
    };
    for_rows(ex, node, [&](int64_t r) {
        auto idx = row_index(node, r);
        float* dst = out_row(node, r);
        for (int64_t i = 0; i < D; ++i) {
            auto at = idx;
            int64_t inner = i;
            int64_t& along = dim == node.n_dims - 1 ? inner : at[size_t(dim)];
            if (along < split) {
                dst[i] = element(a, at, inner);
            } else {
                along -= split;
                dst[i] = element(b, at, inner);
            }
        }
    });
}

}  // namespace mgl::cpu
