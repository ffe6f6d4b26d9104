// The CPU backend's op implementations (one function per op) and the strided-access helpers they
// share. Every op writes a contiguous output and reads inputs through their strides.
#pragma once

#include <algorithm>
#include <cstring>

#include "matmul_kernels.h"
#include "mgl.h"
#include "thread_pool.h"

namespace mgl::cpu {

struct exec_context {
    thread_pool& pool;
    const matmul_kernels& kernels;
};

void run_get_rows(exec_context& ex, tensor& node);
void run_matmul(exec_context& ex, tensor& node);
void run_add_mul(exec_context& ex, tensor& node);
void run_scale(exec_context& ex, tensor& node);
void run_rms_norm(exec_context& ex, tensor& node);
void run_rope(exec_context& ex, tensor& node);
void run_softmax(exec_context& ex, tensor& node);
void run_swiglu(exec_context& ex, tensor& node);
void run_moe_topk(exec_context& ex, tensor& node);
void run_moe_weights(exec_context& ex, tensor& node);
void run_moe_experts(exec_context& ex, tensor& node);
void run_expert_fetch(exec_context& ex, tensor& node);
void run_expert_prompt_stage(exec_context& ex, tensor& node);
void run_kv_store(exec_context& ex, tensor& node);
void run_mla_attn(exec_context& ex, tensor& node);
void run_cpy(exec_context& ex, tensor& node);
void run_contiguous(exec_context& ex, tensor& node);
void run_concat(exec_context& ex, tensor& node);

// row[0, n) <- softmax(scale · row), in place: the max subtracted first, the sum in double. The
// softmax op and the MLA attention's scores both use it.
void softmax_row(float* row, int64_t n, float scale);

// y[m, n0..n1) for a contiguous-K weight, split over the pool's threads by output rows.
void matmul_parallel(exec_context& ex, const matmul_job& job, int64_t N);

// ----- strided access -----

inline float load_f32(dtype t, const char* p) {
    switch (t) {
        case dtype::f32: {
            float v;
            std::memcpy(&v, p, sizeof v);
            return v;
        }
        case dtype::f16: {
            uint16_t h;
            std::memcpy(&h, p, sizeof h);
            return f16_to_f32(h);
        }
        case dtype::bf16: {
            uint16_t h;
            std::memcpy(&h, p, sizeof h);
            return bf16_to_f32(h);
        }
        case dtype::f8_e4m3:
            return e4m3_to_f32(uint8_t(*p));
        case dtype::i32: {
            int32_t v;
            std::memcpy(&v, p, sizeof v);
            return float(v);
        }
        case dtype::i64: {
            int64_t v;
            std::memcpy(&v, p, sizeof v);
            return float(v);
        }
    }
    return 0.0f;
}

inline void store_f32(dtype t, char* p, float v) {
    switch (t) {
        case dtype::f32:
            std::memcpy(p, &v, sizeof v);
            return;
        case dtype::f16: {
            uint16_t h = f32_to_f16(v);
            std::memcpy(p, &h, sizeof h);
            return;
        }
        case dtype::bf16: {
            uint16_t h = f32_to_bf16(v);
            std::memcpy(p, &h, sizeof h);
            return;
        }
        case dtype::f8_e4m3:
            *reinterpret_cast<uint8_t*>(p) = f32_to_e4m3(v);
            return;
        case dtype::i32: {
            auto i = int32_t(v);
            std::memcpy(p, &i, sizeof i);
            return;
        }
        case dtype::i64: {
            auto i = int64_t(v);
            std::memcpy(p, &i, sizeof i);
            return;
        }
    }
}

inline int32_t load_i32(const tensor& t, int64_t i) {
    int32_t v;
    std::memcpy(&v, static_cast<const char*>(t.data) + i * t.stride[0], sizeof v);
    return v;
}

inline int64_t inner_dim(const tensor& t) { return t.n_dims ? t.shape[size_t(t.n_dims - 1)] : 1; }
inline int64_t inner_stride(const tensor& t) {
    return t.n_dims ? t.stride[size_t(t.n_dims - 1)] : int64_t(dtype_size(t.type));
}
inline int64_t n_rows(const tensor& t) {
    int64_t d = inner_dim(t);
    return d ? t.nelements() / d : 0;
}

// Start of row `row` (rows counted over every dim but the innermost, row-major).
inline const char* row_ptr(const tensor& t, int64_t row) {
    const char* p = static_cast<const char*>(t.data);
    for (int i = t.n_dims - 2; i >= 0; --i) {
        int64_t d = t.shape[size_t(i)];
        p += (row % d) * t.stride[size_t(i)];
        row /= d;
    }
    return p;
}
inline char* row_ptr(tensor& t, int64_t row) {
    return const_cast<char*>(row_ptr(static_cast<const tensor&>(t), row));
}

// Reads row `row` of t as f32 into dst (inner_dim(t) values).
inline void read_row(const tensor& t, int64_t row, float* dst) {
    const char* p = row_ptr(t, row);
    int64_t n = inner_dim(t), s = inner_stride(t);
    if (t.type == dtype::f32 && s == 4) {
        std::memcpy(dst, p, size_t(n) * 4);
        return;
    }
    for (int64_t i = 0; i < n; ++i) dst[i] = load_f32(t.type, p + i * s);
}

// Rows per parallel chunk so that each chunk has at least ~16k elements of work.
inline int64_t rows_per_chunk(int64_t row_len) {
    return std::max<int64_t>(1, 16384 / std::max<int64_t>(row_len, 1));
}

}  // namespace mgl::cpu
