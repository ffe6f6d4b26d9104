// The per-token MLA kernels (kv_store, rope, rms_norm, the fused mla_prep) against naive double
// references, and one decode step (mla_prep + mla_decode) captured once as a CUDA graph and
// replayed at jumping positions with fresh inputs and a remapped page table.
// Bounds: f32 results 1e-6 relative L2 (kv_store: bit-exact, rounding included); bf16 cache rows
// written by mla_prep 4e-3 (one bf16 rounding of the f32 result: 1.7e-3 on these values), f16
// rows 5e-4 (one f16 rounding: 2.1e-4); graph-replayed attention on tensor cores 1e-2.
#ifdef MINIDS_HAVE_CUDA
#include <doctest/doctest.h>

#include <cstdio>
#include <string>

#include "mla.h"
#include "mla_test_util.h"
#include "rms_norm.h"
#include "rope.h"
#include "test_util.h"

using namespace minids;

namespace {

const bool no_gpu = !test::cuda_device_available();

struct Shape {
    int64_t r, rope;
};
const Shape shapes[] = {{32, 8}, {512, 64}, {48, 16}};

// V2-Lite's YaRN settings with mscale != mscale_all_dim, so attn_factor != 1.
mgl::rope_params yarn(int n_dims) {
    return mgl::rope_params_yarn(n_dims, 10000.0f, 40.0f, 4096, 32.0f, 1.0f, 1.0f, 0.707f);
}

// (a, b) rotated by pos·inv_freq[i] (float product, like the kernels), cos/sin in double.
void rope_ref(const mgl::rope_params& rp, int32_t pos, const float* x, double* y) {
    for (int i = 0; i < rp.n_dims / 2; ++i) {
        const double angle = double(float(pos) * rp.inv_freq[size_t(i)]);
        const double c = std::cos(angle) * rp.attn_factor, s = std::sin(angle) * rp.attn_factor;
        const double a = x[2 * i], b = x[2 * i + 1];
        y[2 * i] = a * c - b * s;
        y[2 * i + 1] = a * s + b * c;
    }
}

float load_row_elem(const test::HostCache& c, const std::vector<uint8_t>& bytes, int64_t pos,
                    int64_t i) {
    const uint8_t* p = bytes.data() + c.offset(pos);
    if (c.type == mgl::dtype::f32) {
        float v;
        std::memcpy(&v, p + 4 * i, 4);
        return v;
    }
    uint16_t h;
    std::memcpy(&h, p + 2 * i, 2);
    return c.type == mgl::dtype::f16 ? mgl::f16_to_f32(h) : mgl::bf16_to_f32(h);
}

// One rounding of the f32 rows to the cache's type (relative L2 measured on these tests' values:
// bf16 1.7e-3, f16 2.1e-4).
double cache_row_bound(mgl::dtype type) {
    return type == mgl::dtype::f32 ? 1e-6 : type == mgl::dtype::f16 ? 5e-4 : 4e-3;
}

const mgl::dtype cache_types[] = {mgl::dtype::f32, mgl::dtype::bf16, mgl::dtype::f16};
int cache_type_index(mgl::dtype t) {
    return t == mgl::dtype::f32 ? 0 : t == mgl::dtype::bf16 ? 1 : 2;
}

kernels::MlaCache device_cache(const test::HostCache& c, void* pages, const int32_t* table) {
    return {pages, c.type, c.n_pages, c.page_size, table, c.max_pages, c.r, c.rope};
}

}  // namespace

TEST_CASE("cuda kv_store writes exactly the rows of positions, rounded" * doctest::skip(no_gpu)) {
    int cases = 0;
    for (mgl::dtype type : cache_types)
        for (int64_t page_size : {16, 64})
            for (int64_t T : {1, 7, 300})
                for (int64_t n_past : {0, 5, 1000, 5000})
                    for (Shape s : shapes) {
                        if (T == 300 && s.r == 512 && n_past != 1000) continue;  // time
                        const uint64_t seed = 1000 + uint64_t(cases++);
                        INFO(test::type_name(type), " pages of ", page_size, ", T ", T, ", n_past ",
                             n_past, ", r ", s.r, " rope ", s.rope);
                        test::HostCache cache = test::make_cache(type, s.r, s.rope, page_size,
                                                                 n_past, seed, n_past + T);
                        // c and k_pe are strided slices of one [T, r + rope + 3] buffer.
                        const int64_t w = cache.width, stride = w + 3;
                        const auto buf = test::random_floats(size_t(T * stride), seed + 1, -4, 4);
                        std::vector<int32_t> pos(static_cast<size_t>(T));
                        for (int64_t t = 0; t < T; ++t) pos[size_t(t)] = int32_t(n_past + t);
                        test::DevBuf<uint8_t> d_pages(cache.bytes);
                        test::DevBuf<int32_t> d_table(cache.table), d_pos(pos);
                        test::DevBuf<float> d_buf(buf);
                        kernels::KvStoreParams p;
                        p.cache = device_cache(cache, d_pages.ptr, d_table.ptr);
                        p.c = d_buf.ptr;
                        p.c_stride = stride;
                        p.k_pe = d_buf.ptr + s.r;
                        p.k_pe_stride = stride;
                        p.positions = d_pos.ptr;
                        p.T = T;
                        kernels::kv_store(p, nullptr);
                        CUDA_CHECK(cudaDeviceSynchronize());
                        for (int64_t t = 0; t < T; ++t)
                            cache.set(n_past + t, &buf[size_t(t * stride)]);
                        const auto got = d_pages.download();
                        int64_t wrong_bytes = 0;
                        for (size_t i = 0; i < got.size(); ++i)
                            wrong_bytes += got[i] != cache.bytes[i];
                        CHECK_MESSAGE(wrong_bytes == 0,
                                      "bytes differing from the expected pool: ", wrong_bytes);
                    }
    MESSAGE("kv_store: " << cases << " cases compared byte for byte");
}

TEST_CASE("cuda rope matches double reference (strided, in place, YaRN)" * doctest::skip(no_gpu)) {
    double worst = 0;
    int cases = 0;
    for (int64_t T : {1, 7, 300})
        for (int64_t H : {1, 16})
            for (int d : {8, 64})
                for (int64_t n_past : {0, 5000})
                    for (bool in_place : {false, true}) {
                        INFO("T ", T, " H ", H, " d ", d, " n_past ", n_past, " in place ",
                             in_place);
                        const mgl::rope_params rp = yarn(d);
                        const int64_t sh = d + 2, st = H * sh + 2;  // gaps between heads and tokens
                        const auto x =
                            test::random_floats(size_t(T * st), 2000 + uint64_t(cases++));
                        std::vector<int32_t> pos(static_cast<size_t>(T));
                        for (int64_t t = 0; t < T; ++t) pos[size_t(t)] = int32_t(n_past + 3 * t);
                        std::vector<double> ref(size_t(T * H * d));
                        for (int64_t t = 0; t < T; ++t)
                            for (int64_t h = 0; h < H; ++h)
                                rope_ref(rp, pos[size_t(t)], &x[size_t(t * st + h * sh)],
                                         &ref[size_t((t * H + h) * d)]);
                        test::DevBuf<float> d_x(x), d_freq(rp.inv_freq);
                        test::DevBuf<float> d_y(std::vector<float>(size_t(T * H * d), NAN));
                        test::DevBuf<int32_t> d_pos(pos);
                        kernels::RopeParams p;
                        p.x = d_x.ptr;
                        p.x_stride_t = st;
                        p.x_stride_h = sh;
                        p.y = in_place ? d_x.ptr : d_y.ptr;
                        p.y_stride_t = in_place ? st : H * d;
                        p.y_stride_h = in_place ? sh : d;
                        p.positions = d_pos.ptr;
                        p.inv_freq = d_freq.ptr;
                        p.attn_factor = rp.attn_factor;
                        p.T = T;
                        p.H = H;
                        p.n_dims = d;
                        kernels::rope(p, nullptr);
                        CUDA_CHECK(cudaDeviceSynchronize());
                        const auto out = in_place ? d_x.download() : d_y.download();
                        std::vector<float> got(ref.size());
                        int64_t gaps_changed = 0;
                        for (int64_t t = 0; t < T; ++t)
                            for (int64_t h = 0; h < H; ++h)
                                for (int64_t i = 0; i < d; ++i)
                                    got[size_t((t * H + h) * d + i)] =
                                        in_place ? out[size_t(t * st + h * sh + i)]
                                                 : out[size_t((t * H + h) * d + i)];
                        if (in_place)
                            for (size_t i = 0; i < x.size(); ++i) {
                                const size_t in_t = i % size_t(st);
                                if (in_t >= size_t(H * sh) || in_t % size_t(sh) >= size_t(d))
                                    gaps_changed += out[i] != x[i];
                            }
                        CHECK(gaps_changed == 0);
                        const double err = test::relative_l2(got, ref);
                        CHECK(err < 1e-6);
                        worst = std::max(worst, err);
                    }
    MESSAGE("rope: " << cases << " cases, worst relative L2 " << worst << " (bound 1e-6)");
}

// Strided rows at an offset, through both kernels: the fast one takes 16-byte aligned rows
// (strides and offset multiples of 4 floats, dim % 4 == 0), the general one everything else.
TEST_CASE("cuda rms_norm: strided rows, f32 / bf16 / no weight, in place" * doctest::skip(no_gpu)) {
    struct Layout {
        int64_t dim, xs, ys, off;  // row strides of x and y (y: when not in place), base offset
    };
    const Layout layouts[] = {
        {512 + 13, 512 + 20, 512 + 18, 0},  // general: dim % 4 != 0
        {512, 516, 520, 0},                 // fast
        {512, 514, 516, 0},                 // general: x stride not a multiple of 4
        {512, 516, 516, 1},                 // general: rows 4 bytes off alignment
        {2048, 2056, 2052, 4},              // fast, rows 16 bytes into the buffers
    };
    const int64_t rows = 6;
    for (const Layout& l : layouts)
        for (int wkind = 0; wkind < 3; ++wkind)
            for (bool in_place : {false, true}) {
                const int64_t dim = l.dim, xs = l.xs, off = l.off, ys = in_place ? xs : l.ys;
                INFO("dim ", dim, ", strides ", xs, " / ", ys, ", offset ", off, ", weight ",
                     (wkind == 0   ? "none"
                      : wkind == 1 ? "bf16"
                                   : "f32"),
                     ", in place ", in_place);
                const auto x = test::random_floats(size_t(off + rows * xs),
                                                   50 + uint64_t(wkind + 3 * dim), -3, 3);
                const auto wf = test::random_floats(size_t(dim), 60 + uint64_t(wkind));
                std::vector<uint16_t> w16(static_cast<size_t>(dim));
                std::vector<double> wd(size_t(dim), 1.0);
                for (size_t i = 0; i < w16.size(); ++i) {
                    w16[i] = mgl::f32_to_bf16(wf[i]);
                    if (wkind == 1) wd[i] = mgl::bf16_to_f32(w16[i]);
                    if (wkind == 2) wd[i] = wf[i];
                }
                std::vector<double> ref(size_t(rows * dim));
                for (int64_t r = 0; r < rows; ++r) {
                    const float* xr = &x[size_t(off + r * xs)];
                    double ss = 0;
                    for (int64_t i = 0; i < dim; ++i) ss += double(xr[i]) * xr[i];
                    const double inv = 1.0 / std::sqrt(ss / double(dim) + 1e-6);
                    for (int64_t i = 0; i < dim; ++i)
                        ref[size_t(r * dim + i)] = wd[size_t(i)] * xr[i] * inv;
                }
                test::DevBuf<float> d_x(x), d_wf(wf);
                test::DevBuf<float> d_y(std::vector<float>(size_t(off + rows * ys), NAN));
                test::DevBuf<uint16_t> d_w16(w16);
                kernels::RmsNormParams p;
                p.x = d_x.ptr + off;
                p.x_stride = xs;
                p.y = (in_place ? d_x.ptr : d_y.ptr) + off;
                p.y_stride = ys;
                p.rows = rows;
                p.dim = dim;
                p.eps = 1e-6f;
                p.w = wkind == 0   ? nullptr
                      : wkind == 1 ? static_cast<const void*>(d_w16.ptr)
                                   : d_wf.ptr;
                p.w_type = wkind == 2 ? mgl::dtype::f32 : mgl::dtype::bf16;
                kernels::rms_norm(p, nullptr);
                CUDA_CHECK(cudaDeviceSynchronize());
                const auto out = in_place ? d_x.download() : d_y.download();
                std::vector<float> got(ref.size());
                // Everything but the rows' first dim elements keeps its value (x's or NaN).
                std::vector<bool> written(out.size(), false);
                for (int64_t r = 0; r < rows; ++r)
                    for (int64_t i = 0; i < dim; ++i) {
                        const size_t at = size_t(off + r * ys + i);
                        got[size_t(r * dim + i)] = out[at];
                        written[at] = true;
                    }
                int64_t gaps_changed = 0;
                for (size_t i = 0; i < out.size(); ++i)
                    if (!written[i])
                        gaps_changed += in_place ? out[i] != x[i] : !std::isnan(out[i]);
                CHECK(gaps_changed == 0);
                CHECK(test::relative_l2(got, ref) < 1e-6);
            }
}

namespace {

// Runs mla_prep for one configuration and checks every output against the reference.
// last_uncached: the last token's position is past the page table, so its row is not stored
// (everything else about it is still computed).
// worst_cache: the worst cache-row error per type (cache_type_index).
void check_prep(mgl::dtype type, Shape s, int64_t T, int64_t H, int64_t n_past, int wkind,
                bool in_place, bool copies, bool last_uncached, uint64_t seed, double& worst_f32,
                double (&worst_cache)[3]) {
    INFO(test::type_name(type), " pages, r ", s.r, " rope ", s.rope, ", T ", T, " H ", H,
         " n_past ", n_past, ", weight ", wkind, ", in place ", in_place, ", copies ", copies,
         ", last uncached ", last_uncached);
    test::HostCache cache = test::make_cache(type, s.r, s.rope, 64, n_past, seed, n_past + T);
    const std::vector<uint8_t> before = cache.bytes;
    const int64_t r = s.r, rope = s.rope, kvs = r + rope + 5, nope = 16, qw = nope + rope;
    const auto kv = test::random_floats(size_t(T * kvs), seed + 1, -3, 3);
    const auto wf = test::random_floats(size_t(r), seed + 2, 0.5f, 1.5f);
    const auto q = test::random_floats(size_t(T * H * qw), seed + 3);
    std::vector<uint16_t> w16(static_cast<size_t>(r));
    std::vector<double> wd(size_t(r), 1.0);
    for (size_t i = 0; i < w16.size(); ++i) {
        w16[i] = mgl::f32_to_bf16(wf[i]);
        if (wkind == 1) wd[i] = mgl::bf16_to_f32(w16[i]);
        if (wkind == 2) wd[i] = wf[i];
    }
    const mgl::rope_params rp = yarn(int(rope));
    std::vector<int32_t> pos(static_cast<size_t>(T));
    for (int64_t t = 0; t < T; ++t) pos[size_t(t)] = int32_t(n_past + t);
    if (last_uncached) pos[size_t(T - 1)] = int32_t(cache.max_pages * cache.page_size + 3);
    const int64_t T_cached = last_uncached ? T - 1 : T;  // tokens whose rows are stored

    // Reference rows [c | k_pe] and roped q_pe.
    std::vector<double> ref_row(size_t(T * (r + rope))), ref_q(size_t(T * H * rope));
    for (int64_t t = 0; t < T; ++t) {
        const float* x = &kv[size_t(t * kvs)];
        double ss = 0;
        for (int64_t i = 0; i < r; ++i) ss += double(x[i]) * x[i];
        const double inv = 1.0 / std::sqrt(ss / double(r) + 1e-6);
        for (int64_t i = 0; i < r; ++i)
            ref_row[size_t(t * (r + rope) + i)] = wd[size_t(i)] * x[i] * inv;
        rope_ref(rp, pos[size_t(t)], x + r, &ref_row[size_t(t * (r + rope) + r)]);
        for (int64_t h = 0; h < H; ++h)
            rope_ref(rp, pos[size_t(t)], &q[size_t((t * H + h) * qw + nope)],
                     &ref_q[size_t((t * H + h) * rope)]);
    }

    test::DevBuf<uint8_t> d_pages(cache.bytes);
    test::DevBuf<int32_t> d_table(cache.table), d_pos(pos);
    test::DevBuf<float> d_kv(kv), d_wf(wf), d_q(q), d_freq(rp.inv_freq);
    test::DevBuf<uint16_t> d_w16(w16);
    test::DevBuf<float> d_qout(std::vector<float>(size_t(T * H * rope), NAN));
    test::DevBuf<float> d_c(std::vector<float>(size_t(T * (r + 1)), NAN));
    test::DevBuf<float> d_k(std::vector<float>(size_t(T * (rope + 1)), NAN));
    kernels::MlaPrepParams p;
    p.cache = device_cache(cache, d_pages.ptr, d_table.ptr);
    p.positions = d_pos.ptr;
    p.T = T;
    p.H = H;
    p.kv = d_kv.ptr;
    p.kv_stride = kvs;
    p.kv_norm_w = wkind == 0   ? nullptr
                  : wkind == 1 ? static_cast<const void*>(d_w16.ptr)
                               : d_wf.ptr;
    p.kv_norm_w_type = wkind == 2 ? mgl::dtype::f32 : mgl::dtype::bf16;
    p.eps = 1e-6f;
    p.inv_freq = d_freq.ptr;
    p.attn_factor = rp.attn_factor;
    p.q_pe_in = d_q.ptr + nope;
    p.q_pe_in_stride_t = H * qw;
    p.q_pe_in_stride_h = qw;
    p.q_pe_out = in_place ? d_q.ptr + nope : d_qout.ptr;
    p.q_pe_out_stride_t = in_place ? H * qw : H * rope;
    p.q_pe_out_stride_h = in_place ? qw : rope;
    if (copies) {
        p.c_out = d_c.ptr;
        p.c_out_stride = r + 1;
        p.k_pe_out = d_k.ptr;
        p.k_pe_out_stride = rope + 1;
    }
    kernels::mla_prep(p, nullptr);
    CUDA_CHECK(cudaDeviceSynchronize());

    // Cache: the T_cached rows close to the reference, every other byte untouched.
    const auto pages = d_pages.download();
    if (T_cached > 0) {
        const std::vector<double> ref_cached(ref_row.begin(),
                                             ref_row.begin() + T_cached * (r + rope));
        std::vector<float> got_rows(ref_cached.size());
        for (int64_t t = 0; t < T_cached; ++t)
            for (int64_t i = 0; i < r + rope; ++i)
                got_rows[size_t(t * (r + rope) + i)] = load_row_elem(cache, pages, n_past + t, i);
        const double cache_err = test::relative_l2(got_rows, ref_cached);
        CHECK(cache_err < cache_row_bound(type));
        double& worst = worst_cache[cache_type_index(type)];
        worst = std::max(worst, cache_err);
    }
    std::vector<bool> written(pages.size(), false);
    for (int64_t t = 0; t < T_cached; ++t) {
        const size_t off = cache.offset(n_past + t);
        for (size_t b = 0; b < size_t(r + rope) * cache.elem(); ++b) written[off + b] = true;
    }
    int64_t stray = 0;
    for (size_t i = 0; i < pages.size(); ++i) stray += !written[i] && pages[i] != before[i];
    CHECK_MESSAGE(stray == 0, "cache bytes changed outside the stored rows: ", stray);

    // q_pe, and the nope part of q untouched.
    const auto q_after = d_q.download();
    const auto q_sep = d_qout.download();
    std::vector<float> got_q(ref_q.size());
    int64_t nope_changed = 0;
    for (int64_t row = 0; row < T * H; ++row) {
        for (int64_t i = 0; i < rope; ++i)
            got_q[size_t(row * rope + i)] =
                in_place ? q_after[size_t(row * qw + nope + i)] : q_sep[size_t(row * rope + i)];
        for (int64_t i = 0; i < nope; ++i)
            nope_changed += q_after[size_t(row * qw + i)] != q[size_t(row * qw + i)];
    }
    CHECK(nope_changed == 0);
    const double q_err = test::relative_l2(got_q, ref_q);
    CHECK(q_err < 1e-6);
    worst_f32 = std::max(worst_f32, q_err);

    if (copies) {
        const auto c_out = d_c.download(), k_out = d_k.download();
        std::vector<float> got(ref_row.size());
        int64_t gaps = 0;
        for (int64_t t = 0; t < T; ++t) {
            for (int64_t i = 0; i < r; ++i)
                got[size_t(t * (r + rope) + i)] = c_out[size_t(t * (r + 1) + i)];
            for (int64_t i = 0; i < rope; ++i)
                got[size_t(t * (r + rope) + r + i)] = k_out[size_t(t * (rope + 1) + i)];
            gaps += !std::isnan(c_out[size_t(t * (r + 1) + r)]) +
                    !std::isnan(k_out[size_t(t * (rope + 1) + rope)]);
        }
        CHECK(gaps == 0);
        const double e = test::relative_l2(got, ref_row);
        CHECK(e < 1e-6);
        worst_f32 = std::max(worst_f32, e);
    }
}

}  // namespace

TEST_CASE("cuda mla_prep: rms_norm + rope + kv_store + rope(q_pe) in one launch" *
          doctest::skip(no_gpu)) {
    double worst_f32 = 0, worst_cache[3] = {};
    int cases = 0;
    for (mgl::dtype type : cache_types)
        for (Shape s : shapes)
            for (int64_t T : {1, 7})
                for (int64_t n_past : {0, 5000}) {
                    const int wkind = cases % 3;
                    const bool in_place = cases % 2 == 0, copies = cases % 4 < 2;
                    check_prep(type, s, T, s.r == 512 ? 16 : 4, n_past, wkind, in_place, copies,
                               false, 3000 + uint64_t(cases) * 10, worst_f32, worst_cache);
                    ++cases;
                }
    MESSAGE("mla_prep: " << cases << " cases, worst relative L2: f32 outputs " << worst_f32
                         << " (bound 1e-6), cache rows: f32 " << worst_cache[0]
                         << " (bound 1e-6), bf16 " << worst_cache[1] << " (bound 4e-3), f16 "
                         << worst_cache[2] << " (bound 5e-4)");
}

// The fast kernel's item counts (q_pe pairs per thread 2, 4, 8, 16; c values per thread up to 4),
// odd r and H, a rope whose pairs do not divide the block, and the general kernel (r > 1024, more
// heads than the fast kernel holds); with a token whose position the page table does not map.
TEST_CASE("cuda mla_prep: fast and general kernels over r, rope and H" * doctest::skip(no_gpu)) {
    struct Case {
        Shape s;
        int64_t H;
    };
    const Case cases[] = {
        {{512, 64}, 16},   // fast, 2 q_pe pairs per thread (V2-Lite)
        {{512, 64}, 128},  // fast, 16 (V2)
        {{509, 64}, 13},   // fast, odd r and H: heads 13-15 of the last slots idle
        {{1024, 128}, 7},  // fast, 4 values of c per thread; rope 128: 4 head groups
        {{48, 6}, 200},    // fast, 4: 3 pairs, 85 head groups, thread 255 without a pair
        {{96, 16}, 250},   // fast, 8
        {{1100, 64}, 3},   // general: r > 1024
        {{512, 64}, 129},  // general: 17 q_pe pairs per thread
    };
    double worst_f32 = 0, worst_cache[3] = {};
    int runs = 0;
    for (mgl::dtype type : cache_types)
        for (const Case& c : cases)
            for (int variant = 0; variant < 3; ++variant) {
                // 1 token; 3 tokens; 3 tokens, the last one not stored.
                const int64_t T = variant == 0 ? 1 : 3, n_past = variant == 0 ? 37 : 5000;
                const int wkind = (runs / 3 + variant) % 3;  // every kind in every variant
                const bool in_place = runs % 2 == 0, copies = runs % 4 < 2;
                check_prep(type, c.s, T, c.H, n_past, wkind, in_place, copies, variant == 2,
                           5000 + uint64_t(runs) * 10, worst_f32, worst_cache);
                ++runs;
            }
    MESSAGE("mla_prep paths: " << runs << " runs, worst relative L2: f32 outputs " << worst_f32
                               << " (bound 1e-6), cache rows: f32 " << worst_cache[0]
                               << " (bound 1e-6), bf16 " << worst_cache[1] << " (bound 4e-3), f16 "
                               << worst_cache[2] << " (bound 5e-4)");
}

TEST_CASE("cuda mla decode step replayed from one captured graph follows positions" *
          doctest::skip(no_gpu)) {
    const int64_t r = 512, rope = 64, H = 16, nope = 128, qw = nope + rope, capacity = 4096;
    test::HostCache cache = test::make_cache(mgl::dtype::bf16, r, rope, 64, capacity, 77);
    const mgl::rope_params rp = yarn(int(rope));
    const auto wf = test::random_floats(size_t(r), 78, 0.5f, 1.5f);
    test::DevBuf<uint8_t> d_pages(cache.bytes);
    test::DevBuf<int32_t> d_table(cache.table), d_pos(std::vector<int32_t>{0});
    test::DevBuf<float> d_w(wf), d_freq(rp.inv_freq);
    test::DevBuf<float> d_kv(std::vector<float>(size_t(r + rope), 0.f));
    test::DevBuf<float> d_q(std::vector<float>(size_t(H * qw), 0.f));
    test::DevBuf<float> d_qlat(std::vector<float>(size_t(H * r), 0.f));
    test::DevBuf<float> d_out(std::vector<float>(size_t(H * r), NAN));

    kernels::MlaPrepParams prep;
    prep.cache = device_cache(cache, d_pages.ptr, d_table.ptr);
    prep.positions = d_pos.ptr;
    prep.T = 1;
    prep.H = H;
    prep.kv = d_kv.ptr;
    prep.kv_stride = r + rope;
    prep.kv_norm_w = d_w.ptr;
    prep.kv_norm_w_type = mgl::dtype::f32;
    prep.inv_freq = d_freq.ptr;
    prep.attn_factor = rp.attn_factor;
    prep.q_pe_in = prep.q_pe_out = d_q.ptr + nope;
    prep.q_pe_in_stride_t = prep.q_pe_out_stride_t = H * qw;
    prep.q_pe_in_stride_h = prep.q_pe_out_stride_h = qw;
    kernels::MlaAttnParams at;
    at.cache = prep.cache;
    at.q_lat = d_qlat.ptr;
    at.q_lat_stride_t = H * r;
    at.q_lat_stride_h = r;
    at.q_pe = d_q.ptr + nope;
    at.q_pe_stride_t = H * qw;
    at.q_pe_stride_h = qw;
    at.out = d_out.ptr;
    at.out_stride_t = H * r;
    at.out_stride_h = r;
    at.positions = d_pos.ptr;
    at.T = 1;
    at.H = H;
    at.scale = 0.1f;
    at.max_splits = kernels::mla_attn_default_max_splits(kernels::MlaKernel::decode, 1, H);
    test::DevBuf<uint8_t> d_ws(
        std::vector<uint8_t>(kernels::mla_attn_workspace_bytes(1, H, r, at.max_splits) + 1, 0));
    at.workspace = d_ws.ptr;
    at.workspace_bytes = d_ws.n;

    cudaStream_t stream;
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    kernels::mla_prep(prep, stream);
    kernels::mla_decode(at, stream);
    CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));

    double worst = 0;
    int step = 0;
    for (int32_t pos : {0, 1, 63, 64, 65, 700, 2047, 4095, 3000, 17}) {
        INFO("step ", step, " position ", pos);
        if (step == 5) {
            // Move logical page 3 to a spare physical page: the graph must follow the table.
            const int32_t spare = [&] {
                std::vector<bool> used(size_t(cache.n_pages), false);
                for (int32_t p : cache.table) used[size_t(p)] = true;
                for (int32_t p = 0; p < cache.n_pages; ++p)
                    if (!used[size_t(p)]) return p;
                return int32_t(-1);
            }();
            REQUIRE(spare >= 0);
            const size_t page_bytes = size_t(cache.page_size * cache.width) * cache.elem();
            std::memcpy(&cache.bytes[size_t(spare) * page_bytes],
                        &cache.bytes[size_t(cache.table[3]) * page_bytes], page_bytes);
            cache.table[3] = spare;
            d_pages.upload(cache.bytes);  // same size: same device address, as the graph needs
            d_table.upload(cache.table);
        }
        const auto kv = test::random_floats(size_t(r + rope), 500 + uint64_t(step), -2, 2);
        const auto q = test::random_floats(size_t(H * qw), 600 + uint64_t(step));
        const auto q_lat = test::random_floats(size_t(H * r), 700 + uint64_t(step));
        d_kv.upload(kv);
        d_q.upload(q);
        d_qlat.upload(q_lat);
        d_pos.upload(std::vector<int32_t>{pos});
        CUDA_CHECK(cudaGraphLaunch(exec, stream));
        CUDA_CHECK(cudaStreamSynchronize(stream));

        // The stored row must be the reference's (bf16-rounded); use the stored values from here.
        const auto pages = d_pages.download();
        cache.bytes = pages;
        std::vector<double> ref_row(size_t(r + rope));
        double ss = 0;
        for (int64_t i = 0; i < r; ++i) ss += double(kv[size_t(i)]) * kv[size_t(i)];
        const double inv = 1.0 / std::sqrt(ss / double(r) + 1e-6);
        for (int64_t i = 0; i < r; ++i) ref_row[size_t(i)] = wf[size_t(i)] * kv[size_t(i)] * inv;
        rope_ref(rp, pos, &kv[size_t(r)], &ref_row[size_t(r)]);
        std::vector<float> stored(size_t(r + rope));
        for (int64_t i = 0; i < r + rope; ++i) {
            stored[size_t(i)] = load_row_elem(cache, pages, pos, i);
            cache.rows[size_t(pos * cache.width + i)] = stored[size_t(i)];
        }
        CHECK(test::relative_l2(stored, ref_row) < 4e-3);

        std::vector<float> q_pe(size_t(H * rope));
        std::vector<double> qd(static_cast<size_t>(rope));
        for (int64_t h = 0; h < H; ++h) {
            rope_ref(rp, pos, &q[size_t(h * qw + nope)], qd.data());
            for (int64_t i = 0; i < rope; ++i) q_pe[size_t(h * rope + i)] = float(qd[size_t(i)]);
        }
        std::vector<double> ref(size_t(H * r));
        test::parallel_for(H, [&](int64_t h) {
            std::vector<double> s(size_t(pos + 1));
            double mx = -INFINITY;
            for (int64_t k = 0; k <= pos; ++k) {
                const double* row = &cache.rows[size_t(k * cache.width)];
                double acc = 0;
                for (int64_t i = 0; i < r; ++i) acc += double(q_lat[size_t(h * r + i)]) * row[i];
                for (int64_t i = 0; i < rope; ++i)
                    acc += double(q_pe[size_t(h * rope + i)]) * row[r + i];
                s[size_t(k)] = acc * 0.1;
                mx = std::max(mx, s[size_t(k)]);
            }
            double sum = 0;
            for (auto& v : s) sum += (v = std::exp(v - mx));
            for (int64_t k = 0; k <= pos; ++k)
                for (int64_t i = 0; i < r; ++i)
                    ref[size_t(h * r + i)] +=
                        s[size_t(k)] / sum * cache.rows[size_t(k * cache.width + i)];
        });
        const double err = test::relative_l2(d_out.download(), ref);
        CHECK(err < 1e-2);
        worst = std::max(worst, err);
        ++step;
    }
    MESSAGE("graph replay: " << step << " steps, worst relative L2 " << worst << " (bound 1e-2)");
    CUDA_CHECK(cudaGraphExecDestroy(exec));
    CUDA_CHECK(cudaGraphDestroy(graph));
    CUDA_CHECK(cudaStreamDestroy(stream));
}
#endif  // MINIDS_HAVE_CUDA
