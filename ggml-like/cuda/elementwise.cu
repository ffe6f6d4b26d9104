// Simple strided kernels for the CUDA backend's small ops (see elementwise.h): one thread per
// output element (grid-stride), or one block per row for softmax and get_rows.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <string>

#include "cuda_check.h"
#include "elementwise.h"
#include "fast_divisor.h"

namespace mgl::cuda {

namespace {

using minids::kernels::FastDivisor;
constexpr int threads = 256;

__device__ __forceinline__ float load(dtype t, const char* p) {
    switch (t) {
        case dtype::f32:
            return *reinterpret_cast<const float*>(p);
        case dtype::f16:
            return __half2float(*reinterpret_cast<const __half*>(p));
        case dtype::bf16:
            return __bfloat162float(*reinterpret_cast<const __nv_bfloat16*>(p));
        case dtype::f8_e4m3: {
            const __half_raw h = __nv_cvt_fp8_to_halfraw(
                __nv_fp8_storage_t(*reinterpret_cast<const uint8_t*>(p)), __NV_E4M3);
            return __half2float(__half(h));
        }
        case dtype::i32:
            return float(*reinterpret_cast<const int32_t*>(p));
        case dtype::i64:
            return float(*reinterpret_cast<const long long*>(p));
    }
    return 0.0f;
}

// Round to nearest even like mgl::f32_to_bf16 / f32_to_f16 (NaN stays NaN).
__device__ __forceinline__ void store(dtype t, char* p, float v) {
    switch (t) {
        case dtype::f16:
            *reinterpret_cast<__half*>(p) = __float2half_rn(v);
            return;
        case dtype::bf16:
            *reinterpret_cast<__nv_bfloat16*>(p) = __float2bfloat16_rn(v);
            return;
        default:
            *reinterpret_cast<float*>(p) = v;
            return;
    }
}

// Byte offset of flat element i (row-major over `shape`) in a tensor with `stride`.
__device__ __forceinline__ int64_t offset_of(const int64_t* shape, const int64_t* stride,
                                             int64_t i) {
    int64_t off = 0;
#pragma unroll
    for (int d = 3; d >= 0; --d) {
        const int64_t idx = i % shape[d];
        i /= shape[d];
        off += idx * stride[d];
    }
    return off;
}

enum class ew_kind : int { copy, add, mul, scale, swiglu };

struct ew_args {
    strided a, b, out;  // one shape (a's); b unused for copy and scale; broadcast dims stride 0
    ew_kind kind;
    float s;
    int64_t n;
    // n < 2^30: the element's index is split once, by 32-bit divisors (a 64-bit division is a
    // ~70-instruction sequence; three tensors x four dims of them made the strided copies of a
    // prompt pass run at 250 GB/s, ncu).
    bool fast = false;
    FastDivisor dim[4] = {};  // a's shape
};

__device__ __forceinline__ void apply(const ew_args& args, int64_t off_a, int64_t off_b,
                                      int64_t off_out) {
    const float x = load(args.a.type, static_cast<const char*>(args.a.data) + off_a);
    float y = x;
    if (args.kind == ew_kind::add || args.kind == ew_kind::mul || args.kind == ew_kind::swiglu) {
        const float b = load(args.b.type, static_cast<const char*>(args.b.data) + off_b);
        if (args.kind == ew_kind::add) {
            y = x + b;
        } else if (args.kind == ew_kind::mul) {
            y = x * b;
        } else {
            y = x / (1.0f + expf(-x)) * b;
        }
    } else if (args.kind == ew_kind::scale) {
        y = x * args.s;
    }
    store(args.out.type, static_cast<char*>(args.out.data) + off_out, y);
}

__device__ __forceinline__ int64_t dot4(const int32_t (&idx)[4], const int64_t* stride) {
    return idx[0] * stride[0] + idx[1] * stride[1] + idx[2] * stride[2] + idx[3] * stride[3];
}

__global__ void elementwise_kernel(const ew_args args) {
    if (args.fast) {
        const int32_t n = int32_t(args.n);
        for (int32_t i = int32_t(blockIdx.x * blockDim.x + threadIdx.x); i < n;
             i += int32_t(gridDim.x * blockDim.x)) {
            int32_t idx[4], rest = i;
#pragma unroll
            for (int d = 3; d >= 1; --d) {
                int32_t q, r;
                args.dim[d].divmod(rest, q, r);
                idx[d] = r;
                rest = q;
            }
            idx[0] = rest;
            apply(args, dot4(idx, args.a.stride), dot4(idx, args.b.stride),
                  dot4(idx, args.out.stride));
        }
        return;
    }
    for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < args.n;
         i += int64_t(gridDim.x) * blockDim.x) {
        apply(args, offset_of(args.a.shape, args.a.stride, i),
              offset_of(args.a.shape, args.b.stride, i),
              offset_of(args.out.shape, args.out.stride, i));
    }
}

void launch(ew_args a, cudaStream_t stream) {
    if (a.n == 0) return;
    a.fast = a.n < (int64_t(1) << 30);
    if (a.fast)
        for (int d = 0; d < 4; ++d) a.dim[d] = FastDivisor(int32_t(a.a.shape[d]));
    const int64_t blocks = std::min<int64_t>((a.n + threads - 1) / threads, int64_t(1) << 20);
    elementwise_kernel<<<unsigned(blocks), threads, 0, stream>>>(a);
    CUDA_CHECK_LAUNCH();
}

void check_same_shape(const strided& a, const strided& b, const char* what) {
    for (int d = 0; d < 4; ++d) {
        MGL_CHECK(
            a.shape[d] == b.shape[d],
            std::string("cuda ") + what + ": operand shapes differ in dim " + std::to_string(d));
    }
}

// b's strides with broadcast dims (size 1 where a is larger) set to 0.
strided broadcast_to(strided b, const strided& a, const char* what) {
    for (int d = 0; d < 4; ++d) {
        MGL_CHECK(b.shape[d] == a.shape[d] || b.shape[d] == 1,
                  std::string("cuda ") + what + ": operand does not broadcast in dim " +
                      std::to_string(d));
        if (b.shape[d] != a.shape[d]) b.stride[d] = 0;
    }
    b.shape[0] = a.shape[0];
    b.shape[1] = a.shape[1];
    b.shape[2] = a.shape[2];
    b.shape[3] = a.shape[3];
    return b;
}

// ---- softmax: one block per row ----
struct softmax_args {
    strided x;
    float* out;
    float scale;
    int causal;
    int64_t n_past;
};

__device__ float block_reduce(float v, bool is_max, float* scratch) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float w = __shfl_xor_sync(0xffffffffu, v, o);
        v = is_max ? fmaxf(v, w) : v + w;
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();  // scratch may still be read by a previous reduction
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = is_max ? -INFINITY : 0.0f;
    for (int w = 0; w < int(blockDim.x) / 32; ++w)
        v = is_max ? fmaxf(v, scratch[w]) : v + scratch[w];
    return v;
}

__global__ void softmax_kernel(const softmax_args a) {
    __shared__ float scratch[threads / 32];
    const int64_t row = blockIdx.x;
    const int64_t Tk = a.x.shape[3], Tq = a.x.shape[2];
    const char* in = static_cast<const char*>(a.x.data) +
                     offset_of(a.x.shape, a.x.stride, row * Tk);  // element 0 of the row
    const int64_t step = a.x.stride[3];
    float* out = a.out + row * Tk;
    const int64_t visible = a.causal ? min(Tk, row % Tq + a.n_past + 1) : Tk;
    float mx = -INFINITY;
    for (int64_t j = threadIdx.x; j < visible; j += blockDim.x)
        mx = fmaxf(mx, load(a.x.type, in + j * step) * a.scale);
    mx = block_reduce(mx, true, scratch);
    float sum = 0.0f;
    for (int64_t j = threadIdx.x; j < visible; j += blockDim.x) {
        const float e = expf(load(a.x.type, in + j * step) * a.scale - mx);
        out[j] = e;
        sum += e;
    }
    sum = block_reduce(sum, false, scratch);
    const float inv = 1.0f / sum;
    // Each thread rescales the elements it wrote itself: no barrier needed.
    for (int64_t j = threadIdx.x; j < visible; j += blockDim.x) out[j] *= inv;
    for (int64_t j = visible + threadIdx.x; j < Tk; j += blockDim.x) out[j] = 0.0f;
}

// ---- get_rows: one block per output row ----
struct get_rows_args {
    strided table;  // [1, 1, V, D]
    const char* ids;
    int64_t ids_stride;  // bytes
    const float* scale;
    float* out;
    device_error* err;
};

__global__ void get_rows_kernel(const get_rows_args a) {
    const int64_t t = blockIdx.x;
    const int64_t V = a.table.shape[2], D = a.table.shape[3];
    const int32_t id = *reinterpret_cast<const int32_t*>(a.ids + t * a.ids_stride);
    float* out = a.out + t * D;
    if (id < 0 || id >= V) {
        if (threadIdx.x == 0 && a.err &&
            atomicCAS(&a.err->code, 0, get_rows_id_out_of_range) == 0) {
            a.err->value = id;
            a.err->position = t;
            a.err->limit = V;
        }
        for (int64_t i = threadIdx.x; i < D; i += blockDim.x) out[i] = __int_as_float(0x7fc00000);
        return;
    }
    const char* row = static_cast<const char*>(a.table.data) + int64_t(id) * a.table.stride[2];
    const float s = a.scale ? a.scale[id] : 1.0f;
    for (int64_t i = threadIdx.x; i < D; i += blockDim.x)
        out[i] = load(a.table.type, row + i * a.table.stride[3]) * s;
}

}  // namespace

strided strided_of(const tensor& t) {
    MGL_CHECK(t.n_dims <= 4, "cuda backend: more than 4 dims");
    strided s;
    s.data = t.data;
    s.type = t.type;
    const int pad = 4 - t.n_dims;
    for (int d = 0; d < 4; ++d) {
        if (d < pad) {
            s.shape[d] = 1;
            s.stride[d] = 0;
        } else {
            s.shape[d] = t.shape[size_t(d - pad)];
            s.stride[d] = t.stride[size_t(d - pad)];
        }
    }
    return s;
}

strided contiguous_f32(const strided& like, void* data) {
    strided s;
    s.data = data;
    s.type = dtype::f32;
    int64_t step = 4;
    for (int d = 3; d >= 0; --d) {
        s.shape[d] = like.shape[d];
        s.stride[d] = step;
        step *= like.shape[d];
    }
    return s;
}

int64_t element_count(const strided& t) {
    return t.shape[0] * t.shape[1] * t.shape[2] * t.shape[3];
}

void copy_convert(const strided& src, const strided& dst, cudaStream_t stream) {
    check_same_shape(src, dst, "copy");
    MGL_CHECK(dst.type == dtype::f32 || dst.type == dtype::f16 || dst.type == dtype::bf16,
              std::string("cuda copy: destination must be f32, f16 or bf16, found ") +
                  dtype_name(dst.type));
    launch(ew_args{src, src, dst, ew_kind::copy, 1.0f, element_count(dst)}, stream);
}

void binary(op o, const strided& a, const strided& b, float* out, cudaStream_t stream) {
    MGL_CHECK(o == op::add || o == op::mul, "cuda binary: op must be add or mul");
    launch(ew_args{a, broadcast_to(b, a, op_name(o)), contiguous_f32(a, out),
                   o == op::add ? ew_kind::add : ew_kind::mul, 1.0f, element_count(a)},
           stream);
}

void scale(const strided& a, float s, float* out, cudaStream_t stream) {
    launch(ew_args{a, a, contiguous_f32(a, out), ew_kind::scale, s, element_count(a)}, stream);
}

void swiglu(const strided& a, const strided& b, float* out, cudaStream_t stream) {
    check_same_shape(a, b, "swiglu");
    launch(ew_args{a, b, contiguous_f32(a, out), ew_kind::swiglu, 1.0f, element_count(a)}, stream);
}

void softmax(const strided& x, float* out, float scale, bool causal, int64_t n_past,
             cudaStream_t stream) {
    const int64_t rows = x.shape[0] * x.shape[1] * x.shape[2];
    if (rows == 0 || x.shape[3] == 0) return;
    MGL_CHECK(rows <= 0x7fffffff, "cuda softmax: too many rows");
    softmax_kernel<<<unsigned(rows), threads, 0, stream>>>(
        softmax_args{x, out, scale, causal ? 1 : 0, n_past});
    CUDA_CHECK_LAUNCH();
}

void get_rows(const strided& table, const strided& ids, const float* row_scale, float* out,
              device_error* err, cudaStream_t stream) {
    const int64_t T = ids.shape[3];
    if (T == 0 || table.shape[3] == 0) return;
    MGL_CHECK(ids.type == dtype::i32, "cuda get_rows: ids must be i32");
    MGL_CHECK(T <= 0x7fffffff, "cuda get_rows: too many ids");
    get_rows_kernel<<<unsigned(T), threads, 0, stream>>>(get_rows_args{
        table, static_cast<const char*>(ids.data), ids.stride[3], row_scale, out, err});
    CUDA_CHECK_LAUNCH();
}

}  // namespace mgl::cuda
