// The SIMD row and column kernels of matmul_kernels.cpp, written once over the vector width.
// Not a normal header: matmul_kernels.cpp includes it once per instruction set, inside a
// namespace that first defines MGL_SIMD (the set's target attribute), `vec` and `lanes`, the
// operations zero, load, load_aligned, store_aligned, broadcast, fma, add, hsum, and load_bf16 /
// load_e4m3 (`lanes` weights as f32; e4m3 scaled by 2^-8). Everything else it uses (element
// sizes, blocking, scalar_weight) comes from matmul_kernels.cpp.

// Weights k .. k + lanes - 1 of a row as f32.
template <dtype T>
MGL_SIMD inline vec load_weights(const uint8_t* w, int64_t k) {
    if constexpr (T == dtype::f32) return load(reinterpret_cast<const float*>(w) + k);
    if constexpr (T == dtype::bf16) return load_bf16(reinterpret_cast<const uint16_t*>(w) + k);
    if constexpr (T == dtype::f8_e4m3) return load_e4m3(w + k);
}

// MB rows of x against one weight row; U independent accumulators per row hide FMA latency.
template <dtype T, int MB>
MGL_SIMD void dot(const matmul_job& j, const float* x, const uint8_t* w, float* out) {
    constexpr int U = MB == 1 ? 4 : 2;
    vec acc[MB][U];
    for (int m = 0; m < MB; ++m)
        for (int u = 0; u < U; ++u) acc[m][u] = zero();
    constexpr int64_t elem = element_bytes<T>;
    int64_t k = 0;
    for (; k + lanes * U <= j.K; k += lanes * U) {
        for (int64_t b = 0; b < lanes * U * elem; b += 64)
            _mm_prefetch(reinterpret_cast<const char*>(w + k * elem + b + prefetch_bytes),
                         _MM_HINT_T0);
#pragma GCC unroll 4
        for (int u = 0; u < U; ++u) {
            vec wv = load_weights<T>(w, k + lanes * u);
#pragma GCC unroll 4
            for (int m = 0; m < MB; ++m)
                acc[m][u] = fma(load(x + m * j.x_stride + k + lanes * u), wv, acc[m][u]);
        }
    }
    for (; k + lanes <= j.K; k += lanes) {
        vec wv = load_weights<T>(w, k);
        for (int m = 0; m < MB; ++m) acc[m][0] = fma(load(x + m * j.x_stride + k), wv, acc[m][0]);
    }
    for (int m = 0; m < MB; ++m) {
        vec s = acc[m][0];
        for (int u = 1; u < U; ++u) s = add(s, acc[m][u]);
        float sum = hsum(s);
        if constexpr (T == dtype::f8_e4m3) sum *= f8_via_f16_rescale;
        for (int64_t kk = k; kk < j.K; ++kk)
            sum += x[m * j.x_stride + kk] * scalar_weight<T>(w, kk);
        out[m] = sum;
    }
}

template <dtype T>
MGL_SIMD void rows(const matmul_job& j, int64_t n0, int64_t n1) {
    for (int64_t mb = 0; mb < j.M; mb += m_block) {
        int64_t me = std::min(j.M, mb + m_block);
        for (int64_t n = n0; n < n1; ++n) {
            const uint8_t* w = j.w + n * j.w_row_stride;
            float sc = j.scale ? j.scale[n] : 1.0f;
            float r[4];
            int64_t m = mb;
            for (; m + 4 <= me; m += 4) {
                dot<T, 4>(j, j.x + m * j.x_stride, w, r);
                for (int i = 0; i < 4; ++i) j.y[(m + i) * j.y_stride + n] = r[i] * sc;
            }
            int rest = int(me - m);
            if (rest == 3) dot<T, 3>(j, j.x + m * j.x_stride, w, r);
            if (rest == 2) dot<T, 2>(j, j.x + m * j.x_stride, w, r);
            if (rest == 1) dot<T, 1>(j, j.x + m * j.x_stride, w, r);
            for (int i = 0; i < rest; ++i) j.y[(m + i) * j.y_stride + n] = r[i] * sc;
        }
    }
}

template <dtype T>
MGL_SIMD void cols(const matmul_job& j, int64_t n0, int64_t n1) {
    alignas(sizeof(vec)) float acc[n_block];  // aligned loads and stores of whole registers
    // The SIMD loads of e4m3 give value·2^-8; scaling x by 2^8 is exact and undoes it.
    const float simd_x_scale = T == dtype::f8_e4m3 ? f8_via_f16_rescale : 1.0f;
    for (int64_t m = 0; m < j.M; ++m) {
        const float* x = j.x + m * j.x_stride;
        for (int64_t nb = n0; nb < n1; nb += n_block) {
            const int64_t len = std::min(n_block, n1 - nb), nv = len / lanes * lanes;
            std::fill_n(acc, len, 0.0f);
            for (int64_t k = 0; k < j.K; ++k) {
                const uint8_t* w = j.w + k * j.w_row_stride;
                const vec xv = broadcast(x[k] * simd_x_scale);
                for (int64_t i = 0; i < nv; i += lanes)
                    store_aligned(acc + i,
                                  fma(xv, load_weights<T>(w, nb + i), load_aligned(acc + i)));
                for (int64_t i = nv; i < len; ++i) acc[i] += x[k] * scalar_weight<T>(w, nb + i);
            }
            for (int64_t i = 0; i < len; ++i)
                j.y[m * j.y_stride + nb + i] = acc[i] * (j.scale ? j.scale[nb + i] : 1.0f);
        }
    }
}
