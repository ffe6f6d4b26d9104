// The CUDA backend's simple ops: copy/convert (cpy, contiguous, concat), add/mul with
// broadcasting, scale, swiglu, softmax (causal with n_past) and get_rows. Correct for any strides
// up to 4-D, not tuned: these ops are a few small launches per decode step (the heavy ops have
// their kernels in kernels/). Launchers take plain descriptors and a stream and never allocate
// or synchronize, so they can be captured into a CUDA graph.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "mgl.h"

namespace mgl::cuda {

// A tensor seen as 4-D: leading dims of size 1 are prepended, strides in bytes.
struct strided {
    void* data = nullptr;
    dtype type = dtype::f32;
    int64_t shape[4] = {1, 1, 1, 1};
    int64_t stride[4] = {0, 0, 0, 0};
};
strided strided_of(const tensor& t);
// A contiguous f32 tensor of `like`'s shape at `data`.
strided contiguous_f32(const strided& like, void* data);
int64_t element_count(const strided& t);

// Errors found by kernels (a bad id cannot be checked on the host: ids are device data). Lives in
// mapped pinned memory; the backend reads it after synchronizing and throws.
struct device_error {
    int32_t code = 0;  // 0: none; device_error_code
    int32_t unused = 0;
    int64_t value = 0;     // the offending value
    int64_t position = 0;  // where (row)
    int64_t limit = 0;     // the bound it broke
};
enum device_error_code : int32_t { no_error = 0, get_rows_id_out_of_range = 1 };

// dst = convert(src) element by element (same shape; dst f32, f16 or bf16; src any float type).
void copy_convert(const strided& src, const strided& dst, cudaStream_t stream);
// out (contiguous f32, a's shape) = a op b, op add or mul; b has a's shape with dims of size 1
// broadcast (both as 4-D, aligned at the innermost dim, as mgl's constructors check).
void binary(op o, const strided& a, const strided& b, float* out, cudaStream_t stream);
// out = a · s
void scale(const strided& a, float s, float* out, cudaStream_t stream);
// out = silu(a) · b
void swiglu(const strided& a, const strided& b, float* out, cudaStream_t stream);
// Softmax over the innermost dim of x·scale into contiguous out; with causal, row i of each
// [Tq, Tk] matrix sees keys j <= i + n_past (the rest get 0).
void softmax(const strided& x, float* out, float scale, bool causal, int64_t n_past,
             cudaStream_t stream);
// out [T, D] = table[ids[t]] (· scale[ids[t]]); an id outside [0, V) writes NaN and reports
// get_rows_id_out_of_range in *err.
void get_rows(const strided& table, const strided& ids, const float* row_scale, float* out,
              device_error* err, cudaStream_t stream);

}  // namespace mgl::cuda
