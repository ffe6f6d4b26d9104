// Dot-product row kernels. A matrix-vector product is bound by memory bandwidth, so the kernels
// convert weights to f32 in registers right after loading them (bf16: shift into the high half;
// e4m3: rebias into f16 bits and use the hardware f16 -> f32 conversion) and never write a
// converted copy. Up to four x rows share each loaded weight vector (prefill).
#include "matmul_kernels.h"

#include <algorithm>

#if defined(__x86_64__) || defined(__i386__)
// GCC 12's AVX-512 headers build results from deliberately uninitialized vectors and then warn
// about them once inlined (GCC bug 105593); the warning says nothing about this file's code.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#define MGL_GCC_DIAGNOSTIC_PUSHED 1
#endif
#include <cpuid.h>
#include <immintrin.h>
#define MGL_X86 1
#endif

namespace mgl::cpu {

namespace {

// The kernel of a weight dtype among one set's three; null for a dtype without kernels.
template <class Fn>
Fn by_dtype(dtype t, Fn f32, Fn bf16, Fn f8_e4m3) {
    return t == dtype::f32       ? f32
           : t == dtype::bf16    ? bf16
           : t == dtype::f8_e4m3 ? f8_e4m3
                                 : nullptr;
}

}  // namespace

matmul_rows_fn matmul_kernels::for_type(dtype t) const { return by_dtype(t, f32, bf16, f8_e4m3); }

matmul_cols_fn matmul_kernels::cols_for_type(dtype t) const {
    return by_dtype(t, cols_f32, cols_bf16, cols_f8_e4m3);
}

namespace {

// Outputs per block of the transposed (cols) kernels: the accumulators stay in L1.
constexpr int64_t n_block = 256;

// x rows are processed in blocks so a block stays in cache while every weight row streams by.
constexpr int64_t m_block = 32;

// Software prefetch distance for the weight stream, in bytes. FP8 and BF16 rows do several times
// more work per cache line than F32, so the hardware prefetcher alone keeps too few lines in
// flight; prefetching this far ahead raised single-thread streaming rates (see docs/perf.md).
constexpr int64_t prefetch_bytes = 4096;

template <dtype T>
constexpr int64_t element_bytes = T == dtype::f32    ? 4
                                  : T == dtype::bf16 ? 2
                                                     : 1;

template <dtype T>
float scalar_weight(const uint8_t* w, int64_t k) {
    if constexpr (T == dtype::f32) {
        return reinterpret_cast<const float*>(w)[k];
    } else if constexpr (T == dtype::bf16) {
        return bf16_to_f32(reinterpret_cast<const uint16_t*>(w)[k]);
    } else {
        return e4m3_to_f32(w[k]);
    }
}

// ----- scalar reference kernel -----

template <dtype T>
void rows_scalar(const matmul_job& j, int64_t n0, int64_t n1) {
    constexpr int64_t chunk = 256;
    float wbuf[chunk];
    for (int64_t mb = 0; mb < j.M; mb += m_block) {
        int64_t me = std::min(j.M, mb + m_block);
        for (int64_t n = n0; n < n1; ++n) {
            const uint8_t* w = j.w + n * j.w_row_stride;
            float acc[m_block] = {};
            for (int64_t k0 = 0; k0 < j.K; k0 += chunk) {
                int64_t len = std::min(chunk, j.K - k0);
                for (int64_t k = 0; k < len; ++k) wbuf[k] = scalar_weight<T>(w, k0 + k);
                for (int64_t m = mb; m < me; ++m) {
                    const float* x = j.x + m * j.x_stride + k0;
                    float s = 0.0f;
                    for (int64_t k = 0; k < len; ++k) s += x[k] * wbuf[k];
                    acc[m - mb] += s;
                }
            }
            float sc = j.scale ? j.scale[n] : 1.0f;
            for (int64_t m = mb; m < me; ++m) j.y[m * j.y_stride + n] = acc[m - mb] * sc;
        }
    }
}

template <dtype T>
void cols_scalar(const matmul_job& j, int64_t n0, int64_t n1) {
    float acc[n_block];
    for (int64_t m = 0; m < j.M; ++m) {
        const float* x = j.x + m * j.x_stride;
        for (int64_t nb = n0; nb < n1; nb += n_block) {
            const int64_t len = std::min(n_block, n1 - nb);
            std::fill_n(acc, len, 0.0f);
            for (int64_t k = 0; k < j.K; ++k) {
                const uint8_t* w = j.w + k * j.w_row_stride;
                for (int64_t i = 0; i < len; ++i) acc[i] += x[k] * scalar_weight<T>(w, nb + i);
            }
            for (int64_t i = 0; i < len; ++i)
                j.y[m * j.y_stride + nb + i] = acc[i] * (j.scale ? j.scale[nb + i] : 1.0f);
        }
    }
}

#ifdef MGL_X86

// e4m3 bits s.eeee.mmm placed as f16 bits s.0eeee.mmm0000000 give the same value times 2^-8
// (f16 bias 15 vs e4m3 bias 7), subnormals included. NaN codes are not special-cased: weights are
// produced by saturating conversion and never hold NaN. Getting there in two operations:
// sign-extend the byte to 16 bits and shift left by 7, which puts eeee.mmm in place and the sign
// in bits 15 and 14; clearing bit 14 leaves exactly the f16 pattern.
constexpr float f8_via_f16_rescale = 256.0f;
constexpr short f8_f16_mask = short(0xBFFF);

// The SIMD kernels are written once, in matmul_simd.h, over a thin vector abstraction: each
// instruction set below defines its register type, lane count, a handful of operations and the
// bf16 / e4m3 weight loads (the one place the sets really differ), then includes the kernels
// into its own namespace. Every function carries the set's target attribute (MGL_SIMD), so the
// portable build runs each set only where the CPU has it.

// The register type, lane count and the operations whose intrinsics differ between the sets
// only by their prefix.
#define MGL_SIMD_VECTOR(register_type, n_lanes, prefix)                                 \
    using vec = register_type;                                                          \
    constexpr int lanes = n_lanes;                                                      \
    MGL_SIMD inline vec zero() { return prefix##_setzero_ps(); }                        \
    MGL_SIMD inline vec load(const float* p) { return prefix##_loadu_ps(p); }           \
    MGL_SIMD inline vec load_aligned(const float* p) { return prefix##_load_ps(p); }    \
    MGL_SIMD inline void store_aligned(float* p, vec v) { prefix##_store_ps(p, v); }    \
    MGL_SIMD inline vec broadcast(float x) { return prefix##_set1_ps(x); }              \
    MGL_SIMD inline vec fma(vec a, vec b, vec c) { return prefix##_fmadd_ps(a, b, c); } \
    MGL_SIMD inline vec add(vec a, vec b) { return prefix##_add_ps(a, b); }

// ----- AVX2 + FMA + F16C: 8 lanes -----
namespace avx2 {
#define MGL_SIMD __attribute__((target("avx2,fma,f16c")))
MGL_SIMD_VECTOR(__m256, 8, _mm256)
MGL_SIMD inline float hsum(vec v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
// Weights k .. k+7 as f32 (e4m3: times 2^-8, see f8_via_f16_rescale).
MGL_SIMD inline vec load_bf16(const uint16_t* w) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
MGL_SIMD inline vec load_e4m3(const uint8_t* w) {
    __m128i b = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w)));
    return _mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(b, 7), _mm_set1_epi16(f8_f16_mask)));
}
#include "matmul_simd.h"
#undef MGL_SIMD
}  // namespace avx2

// ----- AVX-512 (F + BW + VL): 16 lanes -----
namespace avx512 {
#define MGL_SIMD __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))
MGL_SIMD_VECTOR(__m512, 16, _mm512)
// Through memory: GCC 12's _mm512_reduce_add_ps trips -Wuninitialized inside its own header.
MGL_SIMD inline float hsum(vec v) {
    alignas(64) float lanes_out[16];
    _mm512_store_ps(lanes_out, v);
    float s = 0.0f;
    for (float l : lanes_out) s += l;
    return s;
}
MGL_SIMD inline vec load_bf16(const uint16_t* w) {
    __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
MGL_SIMD inline vec load_e4m3(const uint8_t* w) {
    __m256i b = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
    __m256i h = _mm256_and_si256(_mm256_slli_epi16(b, 7), _mm256_set1_epi16(f8_f16_mask));
    // The zero-masked form: GCC 12 warns about the undefined source of the plain one.
    return _mm512_maskz_cvtph_ps(__mmask16(0xFFFF), h);
}
#include "matmul_simd.h"
#undef MGL_SIMD
}  // namespace avx512

bool cpu_has_f16c() {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;  // clang's __builtin_cpu_supports lacks "f16c"
    return __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & bit_F16C);
}
bool cpu_has_avx2() {
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && cpu_has_f16c();
}
bool cpu_has_avx512() {
    return cpu_has_avx2() && __builtin_cpu_supports("avx512f") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
}

#undef MGL_SIMD_VECTOR

#endif  // MGL_X86

}  // namespace

matmul_kernels scalar_matmul_kernels() {
    return {"scalar",
            rows_scalar<dtype::f32>,
            rows_scalar<dtype::bf16>,
            rows_scalar<dtype::f8_e4m3>,
            cols_scalar<dtype::f32>,
            cols_scalar<dtype::bf16>,
            cols_scalar<dtype::f8_e4m3>};
}

std::vector<matmul_kernels> available_matmul_kernels() {
    std::vector<matmul_kernels> sets{scalar_matmul_kernels()};
#ifdef MGL_X86
    if (cpu_has_avx2()) {
        sets.push_back({"avx2", avx2::rows<dtype::f32>, avx2::rows<dtype::bf16>,
                        avx2::rows<dtype::f8_e4m3>, avx2::cols<dtype::f32>, avx2::cols<dtype::bf16>,
                        avx2::cols<dtype::f8_e4m3>});
    }
    if (cpu_has_avx512()) {
        sets.push_back({"avx512", avx512::rows<dtype::f32>, avx512::rows<dtype::bf16>,
                        avx512::rows<dtype::f8_e4m3>, avx512::cols<dtype::f32>,
                        avx512::cols<dtype::bf16>, avx512::cols<dtype::f8_e4m3>});
    }
#endif
    return sets;
}

matmul_kernels best_matmul_kernels() { return available_matmul_kernels().back(); }

}  // namespace mgl::cpu

#ifdef MGL_GCC_DIAGNOSTIC_PUSHED
#pragma GCC diagnostic pop
#endif
