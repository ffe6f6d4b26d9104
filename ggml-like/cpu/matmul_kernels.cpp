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

matmul_rows_fn matmul_kernels::for_type(dtype t) const {
    switch (t) {
        case dtype::f32:
            return f32;
        case dtype::bf16:
            return bf16;
        case dtype::f8_e4m3:
            return f8_e4m3;
        default:
            return nullptr;
    }
}

matmul_cols_fn matmul_kernels::cols_for_type(dtype t) const {
    switch (t) {
        case dtype::f32:
            return cols_f32;
        case dtype::bf16:
            return cols_bf16;
        case dtype::f8_e4m3:
            return cols_f8_e4m3;
        default:
            return nullptr;
    }
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

// ----- AVX2 + FMA + F16C: 8 lanes -----
#define MGL_AVX2 __attribute__((target("avx2,fma,f16c")))

// e4m3 bits s.eeee.mmm placed as f16 bits s.0eeee.mmm0000000 give the same value times 2^-8
// (f16 bias 15 vs e4m3 bias 7), subnormals included. NaN codes are not special-cased: weights are
// produced by saturating conversion and never hold NaN. Getting there in two operations:
// sign-extend the byte to 16 bits and shift left by 7, which puts eeee.mmm in place and the sign
// in bits 15 and 14; clearing bit 14 leaves exactly the f16 pattern.
constexpr float f8_via_f16_rescale = 256.0f;
constexpr short f8_f16_mask = short(0xBFFF);

template <dtype T>
MGL_AVX2 inline __m256 load8(const uint8_t* w, int64_t k) {
    if constexpr (T == dtype::f32) {
        return _mm256_loadu_ps(reinterpret_cast<const float*>(w) + k);
    } else if constexpr (T == dtype::bf16) {
        __m128i h = _mm_loadu_si128(
            reinterpret_cast<const __m128i*>(reinterpret_cast<const uint16_t*>(w) + k));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    } else {
        __m128i b = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + k)));
        return _mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(b, 7), _mm_set1_epi16(f8_f16_mask)));
    }
}

MGL_AVX2 inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// MB rows of x against one weight row; U independent accumulators per row hide FMA latency.
template <dtype T, int MB>
MGL_AVX2 void dot_avx2(const matmul_job& j, const float* x, const uint8_t* w, float* out) {
    constexpr int U = MB == 1 ? 4 : 2;
    __m256 acc[MB][U];
    for (int m = 0; m < MB; ++m)
        for (int u = 0; u < U; ++u) acc[m][u] = _mm256_setzero_ps();
    constexpr int64_t elem = element_bytes<T>;
    int64_t k = 0;
    for (; k + 8 * U <= j.K; k += 8 * U) {
        for (int64_t b = 0; b < 8 * U * elem; b += 64)
            _mm_prefetch(reinterpret_cast<const char*>(w + k * elem + b + prefetch_bytes),
                         _MM_HINT_T0);
#pragma GCC unroll 4
        for (int u = 0; u < U; ++u) {
            __m256 wv = load8<T>(w, k + 8 * u);
#pragma GCC unroll 4
            for (int m = 0; m < MB; ++m)
                acc[m][u] =
                    _mm256_fmadd_ps(_mm256_loadu_ps(x + m * j.x_stride + k + 8 * u), wv, acc[m][u]);
        }
    }
    for (; k + 8 <= j.K; k += 8) {
        __m256 wv = load8<T>(w, k);
        for (int m = 0; m < MB; ++m)
            acc[m][0] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * j.x_stride + k), wv, acc[m][0]);
    }
    for (int m = 0; m < MB; ++m) {
        __m256 s = acc[m][0];
        for (int u = 1; u < U; ++u) s = _mm256_add_ps(s, acc[m][u]);
        float sum = hsum8(s);
        if constexpr (T == dtype::f8_e4m3) sum *= f8_via_f16_rescale;
        for (int64_t kk = k; kk < j.K; ++kk)
            sum += x[m * j.x_stride + kk] * scalar_weight<T>(w, kk);
        out[m] = sum;
    }
}

template <dtype T>
MGL_AVX2 void rows_avx2(const matmul_job& j, int64_t n0, int64_t n1) {
    for (int64_t mb = 0; mb < j.M; mb += m_block) {
        int64_t me = std::min(j.M, mb + m_block);
        for (int64_t n = n0; n < n1; ++n) {
            const uint8_t* w = j.w + n * j.w_row_stride;
            float sc = j.scale ? j.scale[n] : 1.0f;
            float r[4];
            int64_t m = mb;
            for (; m + 4 <= me; m += 4) {
                dot_avx2<T, 4>(j, j.x + m * j.x_stride, w, r);
                for (int i = 0; i < 4; ++i) j.y[(m + i) * j.y_stride + n] = r[i] * sc;
            }
            int rest = int(me - m);
            if (rest == 3) dot_avx2<T, 3>(j, j.x + m * j.x_stride, w, r);
            if (rest == 2) dot_avx2<T, 2>(j, j.x + m * j.x_stride, w, r);
            if (rest == 1) dot_avx2<T, 1>(j, j.x + m * j.x_stride, w, r);
            for (int i = 0; i < rest; ++i) j.y[(m + i) * j.y_stride + n] = r[i] * sc;
        }
    }
}

template <dtype T>
MGL_AVX2 void cols_avx2(const matmul_job& j, int64_t n0, int64_t n1) {
    alignas(32) float acc[n_block];
    // The SIMD loads of e4m3 give value·2^-8; scaling x by 2^8 is exact and undoes it.
    const float simd_x_scale = T == dtype::f8_e4m3 ? f8_via_f16_rescale : 1.0f;
    for (int64_t m = 0; m < j.M; ++m) {
        const float* x = j.x + m * j.x_stride;
        for (int64_t nb = n0; nb < n1; nb += n_block) {
            const int64_t len = std::min(n_block, n1 - nb), nv = len / 8 * 8;
            std::fill_n(acc, len, 0.0f);
            for (int64_t k = 0; k < j.K; ++k) {
                const uint8_t* w = j.w + k * j.w_row_stride;
                const __m256 xv = _mm256_set1_ps(x[k] * simd_x_scale);
                for (int64_t i = 0; i < nv; i += 8)
                    _mm256_store_ps(
                        acc + i, _mm256_fmadd_ps(xv, load8<T>(w, nb + i), _mm256_load_ps(acc + i)));
                for (int64_t i = nv; i < len; ++i) acc[i] += x[k] * scalar_weight<T>(w, nb + i);
            }
            for (int64_t i = 0; i < len; ++i)
                j.y[m * j.y_stride + nb + i] = acc[i] * (j.scale ? j.scale[nb + i] : 1.0f);
        }
    }
}

// ----- AVX-512 (F + BW + VL): 16 lanes -----
#define MGL_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))

template <dtype T>
MGL_AVX512 inline __m512 load16(const uint8_t* w, int64_t k) {
    if constexpr (T == dtype::f32) {
        return _mm512_loadu_ps(reinterpret_cast<const float*>(w) + k);
    } else if constexpr (T == dtype::bf16) {
        __m256i h = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(reinterpret_cast<const uint16_t*>(w) + k));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    } else {
        __m256i b = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k)));
        __m256i h = _mm256_and_si256(_mm256_slli_epi16(b, 7), _mm256_set1_epi16(f8_f16_mask));
        // The zero-masked form: GCC 12 warns about the undefined source of the plain one.
        return _mm512_maskz_cvtph_ps(__mmask16(0xFFFF), h);
    }
}

// Through memory: GCC 12's _mm512_reduce_add_ps trips -Wuninitialized inside its own header.
MGL_AVX512 inline float hsum16(__m512 v) {
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, v);
    float s = 0.0f;
    for (float l : lanes) s += l;
    return s;
}

template <dtype T, int MB>
MGL_AVX512 void dot_avx512(const matmul_job& j, const float* x, const uint8_t* w, float* out) {
    constexpr int U = MB == 1 ? 4 : 2;
    __m512 acc[MB][U];
    for (int m = 0; m < MB; ++m)
        for (int u = 0; u < U; ++u) acc[m][u] = _mm512_setzero_ps();
    constexpr int64_t elem = element_bytes<T>;
    int64_t k = 0;
    for (; k + 16 * U <= j.K; k += 16 * U) {
        for (int64_t b = 0; b < 16 * U * elem; b += 64)
            _mm_prefetch(reinterpret_cast<const char*>(w + k * elem + b + prefetch_bytes),
                         _MM_HINT_T0);
#pragma GCC unroll 4
        for (int u = 0; u < U; ++u) {
            __m512 wv = load16<T>(w, k + 16 * u);
#pragma GCC unroll 4
            for (int m = 0; m < MB; ++m)
                acc[m][u] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * j.x_stride + k + 16 * u), wv,
                                            acc[m][u]);
        }
    }
    for (; k + 16 <= j.K; k += 16) {
        __m512 wv = load16<T>(w, k);
        for (int m = 0; m < MB; ++m)
            acc[m][0] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * j.x_stride + k), wv, acc[m][0]);
    }
    for (int m = 0; m < MB; ++m) {
        __m512 s = acc[m][0];
        for (int u = 1; u < U; ++u) s = _mm512_add_ps(s, acc[m][u]);
        float sum = hsum16(s);
        if constexpr (T == dtype::f8_e4m3) sum *= f8_via_f16_rescale;
        for (int64_t kk = k; kk < j.K; ++kk)
            sum += x[m * j.x_stride + kk] * scalar_weight<T>(w, kk);
        out[m] = sum;
    }
}

template <dtype T>
MGL_AVX512 void rows_avx512(const matmul_job& j, int64_t n0, int64_t n1) {
    for (int64_t mb = 0; mb < j.M; mb += m_block) {
        int64_t me = std::min(j.M, mb + m_block);
        for (int64_t n = n0; n < n1; ++n) {
            const uint8_t* w = j.w + n * j.w_row_stride;
            float sc = j.scale ? j.scale[n] : 1.0f;
            float r[4];
            int64_t m = mb;
            for (; m + 4 <= me; m += 4) {
                dot_avx512<T, 4>(j, j.x + m * j.x_stride, w, r);
                for (int i = 0; i < 4; ++i) j.y[(m + i) * j.y_stride + n] = r[i] * sc;
            }
            int rest = int(me - m);
            if (rest == 3) dot_avx512<T, 3>(j, j.x + m * j.x_stride, w, r);
            if (rest == 2) dot_avx512<T, 2>(j, j.x + m * j.x_stride, w, r);
            if (rest == 1) dot_avx512<T, 1>(j, j.x + m * j.x_stride, w, r);
            for (int i = 0; i < rest; ++i) j.y[(m + i) * j.y_stride + n] = r[i] * sc;
        }
    }
}

template <dtype T>
MGL_AVX512 void cols_avx512(const matmul_job& j, int64_t n0, int64_t n1) {
    alignas(64) float acc[n_block];
    const float simd_x_scale = T == dtype::f8_e4m3 ? f8_via_f16_rescale : 1.0f;
    for (int64_t m = 0; m < j.M; ++m) {
        const float* x = j.x + m * j.x_stride;
        for (int64_t nb = n0; nb < n1; nb += n_block) {
            const int64_t len = std::min(n_block, n1 - nb), nv = len / 16 * 16;
            std::fill_n(acc, len, 0.0f);
            for (int64_t k = 0; k < j.K; ++k) {
                const uint8_t* w = j.w + k * j.w_row_stride;
                const __m512 xv = _mm512_set1_ps(x[k] * simd_x_scale);
                for (int64_t i = 0; i < nv; i += 16)
                    _mm512_store_ps(acc + i, _mm512_fmadd_ps(xv, load16<T>(w, nb + i),
                                                             _mm512_load_ps(acc + i)));
                for (int64_t i = nv; i < len; ++i) acc[i] += x[k] * scalar_weight<T>(w, nb + i);
            }
            for (int64_t i = 0; i < len; ++i)
                j.y[m * j.y_stride + nb + i] = acc[i] * (j.scale ? j.scale[nb + i] : 1.0f);
        }
    }
}

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
        sets.push_back({"avx2", rows_avx2<dtype::f32>, rows_avx2<dtype::bf16>,
                        rows_avx2<dtype::f8_e4m3>, cols_avx2<dtype::f32>, cols_avx2<dtype::bf16>,
                        cols_avx2<dtype::f8_e4m3>});
    }
    if (cpu_has_avx512()) {
        sets.push_back({"avx512", rows_avx512<dtype::f32>, rows_avx512<dtype::bf16>,
                        rows_avx512<dtype::f8_e4m3>, cols_avx512<dtype::f32>,
                        cols_avx512<dtype::bf16>, cols_avx512<dtype::f8_e4m3>});
    }
#endif
    return sets;
}

matmul_kernels best_matmul_kernels() { return available_matmul_kernels().back(); }

}  // namespace mgl::cpu

#ifdef MGL_GCC_DIAGNOSTIC_PUSHED
#pragma GCC diagnostic pop
#endif
