// MLA attention kernels (kernels/mla.h) against a naive double-precision reference: decode and
// prefill launchers, both implementations, every tensor-core block shape, f32, bf16 and f16
// pages, scrambled page tables, page sizes 16, 48 and 64, positions starting at n_past, strided
// queries (laid out as the model's views are, 16-byte aligned or not) and a strided,
// NaN-poisoned output whose gaps must stay untouched; lengths from 1 to 32768 keys and a
// captured graph replayed over changing lengths.
// Bounds, against the reference computed from the same rounded cache values: f32 and f16 pages
// on the CUDA-core kernels 1e-5 relative L2 (f32 math on the stored values); f16 pages on
// tensor cores (q and P rounded to f16, ~8x less than bf16) 2e-3; anything else on tensor cores
// or bf16 pages 1e-2. Every case is checked (a failure names its case) and each test prints its
// worst error per kind.
#ifdef MINIDS_HAVE_CUDA
#include <doctest/doctest.h>

#include <cstdio>
#include <random>
#include <string>
#include <tuple>

#include "fast_divisor.h"
#include "mla.h"
#include "mla_test_util.h"
#include "test_util.h"

using namespace minids;
using kernels::MlaImpl;
using kernels::MlaKernel;

namespace {

const bool no_gpu = !test::cuda_device_available();

struct AttnCase {
    MlaKernel kernel = MlaKernel::decode;
    MlaImpl impl = MlaImpl::automatic;
    int variant = -1;
    mgl::dtype type = mgl::dtype::bf16;
    int64_t r = 512, rope = 64, page_size = 64, T = 1, H = 16, n_past = 0;
    int64_t nope = 24;   // q_pe's offset in the q rows it is a slice of (odd: q_pe unaligned)
    int max_splits = 0;  // 0: mla_attn_default_max_splits
    int min_keys = 0;

    bool exact() const {  // f32 math end to end on the stored values
        return (type == mgl::dtype::f32 || type == mgl::dtype::f16) &&
               (impl == MlaImpl::cuda_core ||
                (impl == MlaImpl::automatic && kernel == MlaKernel::decode &&
                 type == mgl::dtype::f32));
    }
    bool f16_tensor_cores() const { return type == mgl::dtype::f16 && !exact(); }
    double bound() const { return exact() ? 1e-5 : f16_tensor_cores() ? 2e-3 : 1e-2; }
    std::string describe() const {
        const char* impl_name = impl == MlaImpl::automatic     ? "auto"
                                : impl == MlaImpl::tensor_core ? "tensor_core"
                                                               : "cuda_core";
        char buf[256];
        std::snprintf(buf, sizeof buf,
                      "%s %s variant %d, %s pages of %lld, r %lld rope %lld, T %lld H %lld "
                      "n_past %lld, max_splits %d min_keys %d nope %lld",
                      kernel == MlaKernel::decode ? "decode" : "prefill", impl_name, variant,
                      test::type_name(type), (long long)page_size, (long long)r, (long long)rope,
                      (long long)T, (long long)H, (long long)n_past, max_splits, min_keys,
                      (long long)nope);
        return buf;
    }
};

// o[t][h] = softmax_s((q_lat·c_s + q_pe·k_pe_s)·scale) · c_s over s <= positions[t].
std::vector<double> reference(const test::HostCache& c, const std::vector<float>& q_lat,
                              const std::vector<float>& q_pe, const std::vector<int32_t>& pos,
                              int64_t T, int64_t H, double scale) {
    const int64_t r = c.r, rope = c.rope, w = c.width;
    std::vector<double> out(size_t(T * H * r));
    test::parallel_for(T * H, [&](int64_t row) {
        const int64_t t = row / H;
        const int64_t n = pos[size_t(t)] + 1;
        const float* ql = &q_lat[size_t(row * r)];
        const float* qp = &q_pe[size_t(row * rope)];
        std::vector<double> s(static_cast<size_t>(n));
        double mx = -INFINITY;
        for (int64_t k = 0; k < n; ++k) {
            const double* kv = &c.rows[size_t(k * w)];
            double acc = 0;
            for (int64_t i = 0; i < r; ++i) acc += double(ql[i]) * kv[i];
            for (int64_t i = 0; i < rope; ++i) acc += double(qp[i]) * kv[r + i];
            s[size_t(k)] = acc * scale;
            mx = std::max(mx, s[size_t(k)]);
        }
        double sum = 0;
        for (auto& v : s) sum += (v = std::exp(v - mx));
        double* o = &out[size_t(row * r)];
        for (int64_t k = 0; k < n; ++k) {
            const double p = s[size_t(k)] / sum;
            const double* kv = &c.rows[size_t(k * w)];
            for (int64_t i = 0; i < r; ++i) o[i] += p * kv[i];
        }
    });
    return out;
}

// Runs one case; returns its relative L2 error (CHECKs inside name the case on failure).
double run_case(const AttnCase& k, uint64_t seed) {
    INFO(k.describe());
    const int64_t T = k.T, H = k.H, r = k.r, rope = k.rope, n_ctx = k.n_past + T;
    const test::HostCache cache = test::make_cache(k.type, r, rope, k.page_size, n_ctx, seed);
    // The model's layouts: q_lat is a [T, H, r] view of an [H, T, r] tensor, q_pe a slice of
    // q [T, H, nope + rope]; out has a 3-element gap after every head (NaN, must stay NaN).
    const int64_t nope = k.nope, qw = nope + rope, ow = r + 3;
    const auto q_lat_ht = test::random_floats(size_t(H * T * r), seed + 1);
    const auto q_full = test::random_floats(size_t(T * H * qw), seed + 2);
    std::vector<float> q_lat(size_t(T * H * r)), q_pe(size_t(T * H * rope));
    for (int64_t t = 0; t < T; ++t)
        for (int64_t h = 0; h < H; ++h) {
            for (int64_t i = 0; i < r; ++i)
                q_lat[size_t((t * H + h) * r + i)] = q_lat_ht[size_t((h * T + t) * r + i)];
            for (int64_t i = 0; i < rope; ++i)
                q_pe[size_t((t * H + h) * rope + i)] = q_full[size_t((t * H + h) * qw + nope + i)];
        }
    std::vector<int32_t> pos(static_cast<size_t>(T));
    for (int64_t t = 0; t < T; ++t) pos[size_t(t)] = int32_t(k.n_past + t);
    const double scale = 0.15;
    const auto ref = reference(cache, q_lat, q_pe, pos, T, H, scale);

    test::DevBuf<uint8_t> d_pages(cache.bytes);
    test::DevBuf<int32_t> d_table(cache.table), d_pos(pos);
    test::DevBuf<float> d_qlat(q_lat_ht), d_qfull(q_full);
    test::DevBuf<float> d_out(std::vector<float>(size_t(T * H * ow), NAN));
    kernels::MlaAttnParams p;
    p.cache = {d_pages.ptr,     k.type, cache.n_pages, cache.page_size, d_table.ptr,
               cache.max_pages, r,      rope};
    p.q_lat = d_qlat.ptr;
    p.q_lat_stride_t = r;
    p.q_lat_stride_h = T * r;
    p.q_pe = d_qfull.ptr + nope;
    p.q_pe_stride_t = H * qw;
    p.q_pe_stride_h = qw;
    p.out = d_out.ptr;
    p.out_stride_t = H * ow;
    p.out_stride_h = ow;
    p.positions = d_pos.ptr;
    p.T = T;
    p.H = H;
    p.scale = float(scale);
    p.max_splits =
        k.max_splits > 0 ? k.max_splits : kernels::mla_attn_default_max_splits(k.kernel, T, H);
    p.min_keys_per_split = k.min_keys;
    p.impl = k.impl;
    p.variant = k.variant;
    const size_t ws_bytes = kernels::mla_attn_workspace_bytes(T, H, r, p.max_splits);
    test::DevBuf<uint8_t> d_ws(std::vector<uint8_t>(ws_bytes, 0xff));  // NaN-ish garbage
    p.workspace = ws_bytes ? d_ws.ptr : nullptr;
    p.workspace_bytes = ws_bytes;
    if (k.kernel == MlaKernel::decode) {
        kernels::mla_decode(p, nullptr);
    } else {
        kernels::mla_prefill(p, nullptr);
    }
    CUDA_CHECK(cudaDeviceSynchronize());
    const auto out = d_out.download();
    std::vector<float> got(size_t(T * H * r));
    int64_t non_finite = 0, gap_written = 0;
    for (int64_t row = 0; row < T * H; ++row) {
        for (int64_t i = 0; i < r; ++i) {
            const float v = out[size_t(row * ow + i)];
            non_finite += !std::isfinite(v);
            got[size_t(row * r + i)] = v;
        }
        for (int64_t i = r; i < ow; ++i) gap_written += !std::isnan(out[size_t(row * ow + i)]);
    }
    CHECK_MESSAGE(non_finite == 0, "non-finite outputs: ", non_finite);
    CHECK_MESSAGE(gap_written == 0, "elements written outside the output rows: ", gap_written);
    const double err = test::relative_l2(got, ref);
    CHECK_MESSAGE(err <= k.bound(), "relative L2 ", err, " > bound ", k.bound());
    return err;
}

// Runs the cases, prints the worst error of the f32-exact ones, of f16 pages on tensor cores and
// of the bf16 / tensor-core rest.
void run_all(const char* what, const std::vector<AttnCase>& cases, uint64_t seed) {
    double worst_exact = 0, worst_f16 = 0, worst_bf16 = 0;
    for (size_t i = 0; i < cases.size(); ++i) {
        const double e = run_case(cases[i], seed + 7 * i);
        double& worst = cases[i].exact()              ? worst_exact
                        : cases[i].f16_tensor_cores() ? worst_f16
                                                      : worst_bf16;
        worst = std::max(worst, e);
    }
    MESSAGE(what << ": " << cases.size() << " cases; worst relative L2: f32 cuda-core "
                 << worst_exact << " (bound 1e-5), f16 tensor-core " << worst_f16
                 << " (bound 2e-3), tensor-core / bf16 " << worst_bf16 << " (bound 1e-2)");
}

const mgl::dtype all_types[] = {mgl::dtype::f32, mgl::dtype::bf16, mgl::dtype::f16};

struct Shape {
    int64_t r, rope;
};
const Shape shapes[] = {{32, 8}, {512, 64}, {48, 16}};

}  // namespace

TEST_CASE("cuda mla decode attention matches double reference" * doctest::skip(no_gpu)) {
    std::vector<AttnCase> cases;
    int n = 0;
    // The decode shape (T = 1, H = 16) over shapes, dtypes, both kernels and cache depths.
    for (Shape s : shapes)
        for (mgl::dtype type : all_types)
            for (MlaImpl impl : {MlaImpl::tensor_core, MlaImpl::cuda_core})
                for (int64_t n_past : {0, 5, 1000, 5000}) {
                    AttnCase c;
                    c.impl = impl;
                    c.type = type;
                    c.r = s.r;
                    c.rope = s.rope;
                    c.n_past = n_past;
                    c.page_size = (n++ % 2) ? 16 : 64;
                    cases.push_back(c);
                }
    // Small T and H (several tokens and heads share a 16-row tile), automatic kernel choice.
    for (int64_t T : {2, 7})
        for (int64_t H : {1, 4, 16})
            for (mgl::dtype type : all_types) {
                AttnCase c;
                c.type = type;
                c.r = 48;
                c.rope = 16;
                c.T = T;
                c.H = H;
                c.n_past = (n++ % 2) ? 5 : 1000;
                c.page_size = (n % 3) ? 16 : 64;
                cases.push_back(c);
            }
    // Larger T through the decode launcher (correct for any T).
    for (int64_t T : {64, 300}) {
        AttnCase c;
        c.r = 32;
        c.rope = 8;
        c.T = T;
        c.H = 4;
        c.n_past = 1000;
        c.page_size = 16;
        cases.push_back(c);
        c.type = mgl::dtype::f32;
        cases.push_back(c);
    }
    run_all("decode", cases, 100);
}

TEST_CASE("cuda mla decode attention: split counts and every tensor-core variant" *
          doctest::skip(no_gpu)) {
    std::vector<AttnCase> cases;
    // Fixed grids from 1 to 200 splits, few and many keys per split, including grids far larger
    // than the splits the context needs (idle blocks) and a single split (direct write).
    for (int max_splits : {1, 3, 64, 200})
        for (int min_keys : {16, 1000})
            for (MlaImpl impl : {MlaImpl::tensor_core, MlaImpl::cuda_core, MlaImpl::automatic}) {
                AttnCase c;
                c.impl = impl;
                c.type = impl == MlaImpl::tensor_core ? mgl::dtype::bf16 : mgl::dtype::f32;
                c.n_past = 3000;
                c.T = 2;
                c.max_splits = max_splits;
                c.min_keys = min_keys;
                cases.push_back(c);
            }
    for (int v = 0; v < kernels::mla_attn_variant_count(MlaKernel::decode); ++v)
        for (Shape s : shapes)
            for (int64_t n_past : {0, 1000, 5000}) {
                AttnCase c;
                c.impl = MlaImpl::tensor_core;
                c.variant = v;
                c.r = s.r;
                c.rope = s.rope;
                c.n_past = n_past;
                c.page_size = n_past == 1000 ? 16 : 64;
                cases.push_back(c);
                // f16 pages: built for the default shapes only, item 0 and (r > 64) item 2.
                if (v == 0 || (v == 2 && s.r > 64)) {
                    c.type = mgl::dtype::f16;
                    cases.push_back(c);
                }
            }
    // f16 pages over split grids, both kernels.
    for (int max_splits : {1, 3, 200})
        for (MlaImpl impl : {MlaImpl::tensor_core, MlaImpl::cuda_core}) {
            AttnCase c;
            c.impl = impl;
            c.type = mgl::dtype::f16;
            c.n_past = 3000;
            c.T = 2;
            c.max_splits = max_splits;
            c.min_keys = 16;
            cases.push_back(c);
        }
    run_all("decode splits / variants", cases, 200);
}

// The lengths a decode step sees, from a single key to 32K, on V2-Lite's shape with the default
// kernel choice (bf16 and f16 pages: tensor cores; f32 pages: the CUDA-core kernel), power-of-two
// and odd page sizes. 32768 keys is a full-length cache and a full reference.
TEST_CASE("cuda mla decode attention at 1, 7, 512, 4097 and 32768 keys" * doctest::skip(no_gpu)) {
    std::vector<AttnCase> cases;
    for (int64_t keys : {1, 7, 512, 4097, 32768})
        for (mgl::dtype type : all_types)
            for (int64_t page_size : {16, 64, 48}) {
                if (keys == 32768 && page_size == 48) continue;  // one odd size suffices
                AttnCase c;
                c.type = type;
                c.page_size = page_size;
                c.n_past = keys - 1;
                cases.push_back(c);
            }
    run_all("decode lengths", cases, 300);
}

// The tensor-core decode kernel around its tile edges (64 keys per tile, 16 rows per block) on
// V2-Lite's shape: every decode variant with bf16 pages, variant 0 with f32 pages (converted on
// load), the default and variant 0 with f16 pages, page sizes 64 (the shift path) and 48
// (division); rows of several tokens in one tile (H = 12) and rows past the end of the last
// tile; q_pe at an offset that is not 16-byte aligned (the scalar Q loads).
TEST_CASE("cuda mla decode attention on tensor cores at 1, 2, 63, 64, 65, 512 and 4096 keys" *
          doctest::skip(no_gpu)) {
    std::vector<AttnCase> cases;
    const int n_variants = kernels::mla_attn_variant_count(MlaKernel::decode);
    for (int64_t keys : {1, 2, 63, 64, 65, 512, 4096}) {
        AttnCase c;
        c.impl = MlaImpl::tensor_core;
        c.n_past = keys - 1;
        for (int v = -1; v < n_variants; ++v) {
            c.variant = v;
            cases.push_back(c);
        }
        c.variant = -1;
        c.page_size = 48;
        cases.push_back(c);
        c.type = mgl::dtype::f32;
        c.variant = 0;
        for (int64_t page_size : {64, 48}) {
            c.page_size = page_size;
            cases.push_back(c);
        }
        c.type = mgl::dtype::f16;
        for (int variant : {-1, 0}) {
            c.variant = variant;
            cases.push_back(c);
        }
    }
    for (mgl::dtype type : all_types)
        for (int64_t keys : {1, 65, 4096})
            for (auto [T, H, nope] :
                 {std::tuple{1, 12, 24}, std::tuple{3, 12, 24}, std::tuple{2, 16, 24},
                  std::tuple{3, 16, 5}, std::tuple{1, 16, 7}}) {
                AttnCase c;
                c.impl = MlaImpl::tensor_core;
                c.type = type;
                c.T = T;
                c.H = H;
                c.nope = nope;
                c.n_past = keys - T;  // the last token sees `keys` keys
                if (c.n_past < 0) continue;
                c.page_size = keys == 65 ? 48 : 64;
                cases.push_back(c);
            }
    run_all("decode tensor cores at tile edges", cases, 500);
}

// One captured graph replayed while the cache length changes between replays (as the decode
// graph is: the length is read from positions[] in device memory). Each replay against its own
// reference; the grid was fixed at capture with the default max_splits.
TEST_CASE("cuda mla decode attention: graph replay with the cache length changed" *
          doctest::skip(no_gpu)) {
    for (mgl::dtype type : all_types) {
        const int64_t H = 16, r = 512, rope = 64, page_size = 64, capacity = 5000;
        const test::HostCache cache = test::make_cache(type, r, rope, page_size, capacity, 41);
        const auto q_lat = test::random_floats(size_t(H * r), 42);
        const auto q_pe = test::random_floats(size_t(H * rope), 43);
        test::DevBuf<uint8_t> d_pages(cache.bytes);
        test::DevBuf<int32_t> d_table(cache.table), d_pos(std::vector<int32_t>{0});
        test::DevBuf<float> d_qlat(q_lat), d_qpe(q_pe);
        test::DevBuf<float> d_out(std::vector<float>(size_t(H * r), NAN));
        kernels::MlaAttnParams p;
        p.cache = {d_pages.ptr,     type, cache.n_pages, cache.page_size, d_table.ptr,
                   cache.max_pages, r,    rope};
        p.q_lat = d_qlat.ptr;
        p.q_lat_stride_t = H * r;
        p.q_lat_stride_h = r;
        p.q_pe = d_qpe.ptr;
        p.q_pe_stride_t = H * rope;
        p.q_pe_stride_h = rope;
        p.out = d_out.ptr;
        p.out_stride_t = H * r;
        p.out_stride_h = r;
        p.positions = d_pos.ptr;
        p.T = 1;
        p.H = H;
        p.scale = 0.15f;
        p.max_splits = kernels::mla_attn_default_max_splits(MlaKernel::decode, 1, H);
        const size_t ws_bytes = kernels::mla_attn_workspace_bytes(1, H, r, p.max_splits);
        test::DevBuf<uint8_t> d_ws(std::vector<uint8_t>(ws_bytes, 0xff));
        p.workspace = ws_bytes ? d_ws.ptr : nullptr;
        p.workspace_bytes = ws_bytes;

        cudaStream_t stream;
        CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
        cudaGraph_t graph;
        cudaGraphExec_t exec;
        CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
        kernels::mla_decode(p, stream);
        CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
        CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
        double worst = 0;
        // Long, short, long again: a replay after a longer one must not see its split count.
        for (int32_t last : {4999, 0, 6, 511, 4096, 63, 4999}) {
            INFO(test::type_name(type) << " pages, keys " << last + 1);
            CUDA_CHECK(cudaMemcpyAsync(d_pos.ptr, &last, 4, cudaMemcpyHostToDevice, stream));
            CUDA_CHECK(cudaGraphLaunch(exec, stream));
            CUDA_CHECK(cudaStreamSynchronize(stream));
            const auto ref = reference(cache, q_lat, q_pe, {last}, 1, H, 0.15);
            const auto got = d_out.download();
            int64_t non_finite = 0;
            for (float v : got) non_finite += !std::isfinite(v);
            CHECK_MESSAGE(non_finite == 0, "non-finite outputs: ", non_finite);
            const double err = test::relative_l2(got, ref);
            const double bound = type == mgl::dtype::f32   ? 1e-5
                                 : type == mgl::dtype::f16 ? 2e-3
                                                           : 1e-2;
            CHECK_MESSAGE(err <= bound, "relative L2 ", err, " > bound ", bound);
            worst = std::max(worst, err);
        }
        MESSAGE("graph replay, " << test::type_name(type) << " pages: worst relative L2 " << worst);
        CUDA_CHECK(cudaGraphExecDestroy(exec));
        CUDA_CHECK(cudaGraphDestroy(graph));
        CUDA_CHECK(cudaStreamDestroy(stream));
    }
}

TEST_CASE("cuda mla prefill attention matches double reference" * doctest::skip(no_gpu)) {
    std::vector<AttnCase> cases;
    int n = 0;
    auto add = [&](int64_t r, int64_t rope, int64_t T, int64_t H, int64_t n_past) {
        for (mgl::dtype type : all_types) {
            AttnCase c;
            c.kernel = MlaKernel::prefill;
            c.type = type;
            c.r = r;
            c.rope = rope;
            c.T = T;
            c.H = H;
            c.n_past = n_past;
            c.page_size = (n++ % 2) ? 16 : 64;
            cases.push_back(c);
        }
    };
    for (int64_t H : {1, 4, 16})
        for (int64_t n_past : {0, 5, 1000}) add(32, 8, 300, H, n_past);
    add(32, 8, 300, 16, 5000);
    add(48, 16, 64, 16, 5000);
    add(48, 16, 300, 4, 1000);
    add(48, 16, 7, 4, 5);
    add(512, 64, 64, 16, 0);
    add(512, 64, 64, 16, 1000);
    add(512, 64, 300, 4, 5);
    add(512, 64, 300, 1, 1000);
    {  // q_pe not 16-byte aligned (scalar Q loads), pages of 48 rows (no shift)
        AttnCase c;
        c.kernel = MlaKernel::prefill;
        c.T = 100;
        c.H = 16;
        c.n_past = 700;
        c.nope = 5;
        c.page_size = 48;
        cases.push_back(c);
        c.type = mgl::dtype::f32;
        cases.push_back(c);
    }
    // The f32 reference kernel on prefill shapes, over f32 and f16 pages.
    for (auto [T, H, n_past] : {std::tuple{300, 4, 5}, std::tuple{64, 16, 1000}})
        for (mgl::dtype type : {mgl::dtype::f32, mgl::dtype::f16}) {
            AttnCase c;
            c.kernel = MlaKernel::prefill;
            c.impl = MlaImpl::cuda_core;
            c.type = type;
            c.T = T;
            c.H = H;
            c.n_past = n_past;
            cases.push_back(c);
        }
    // Several splits for a prompt (few row tiles, long cache).
    for (int max_splits : {4, 16}) {
        AttnCase c;
        c.kernel = MlaKernel::prefill;
        c.r = 48;
        c.rope = 16;
        c.T = 64;
        c.H = 4;
        c.n_past = 3000;
        c.max_splits = max_splits;
        c.min_keys = 256;
        cases.push_back(c);
    }
    run_all("prefill", cases, 300);
}

TEST_CASE("cuda mla prefill attention: every tensor-core variant" * doctest::skip(no_gpu)) {
    std::vector<AttnCase> cases;
    for (int v = 0; v < kernels::mla_attn_variant_count(MlaKernel::prefill); ++v) {
        for (auto [r, rope, T, H, n_past] :
             {std::tuple{512, 64, 64, 16, 0}, std::tuple{512, 64, 100, 4, 700},
              std::tuple{48, 16, 300, 4, 1000}, std::tuple{32, 8, 7, 1, 5}}) {
            AttnCase c;
            c.kernel = MlaKernel::prefill;
            c.impl = MlaImpl::tensor_core;
            c.variant = v;
            c.r = r;
            c.rope = rope;
            c.T = T;
            c.H = H;
            c.n_past = n_past;
            c.page_size = n_past == 700 ? 16 : 64;
            cases.push_back(c);
            if (v == 0) {  // f16 pages: built for the default shape only
                c.type = mgl::dtype::f16;
                cases.push_back(c);
            }
        }
    }
    run_all("prefill variants", cases, 400);
}

// The kernels' division by H and by page_size (host side: the same formula in 64-bit).
TEST_CASE("fast divisor matches integer division for 31-bit operands") {
    std::mt19937_64 rng(7);
    std::vector<int32_t> divisors;
    for (int32_t d = 1; d <= 300; ++d) divisors.push_back(d);
    for (int32_t d : {1 << 20, (1 << 20) + 1, 1 << 30, (1 << 30) + 1, INT32_MAX - 1, INT32_MAX})
        divisors.push_back(d);
    for (int i = 0; i < 200; ++i) divisors.push_back(int32_t(1 + rng() % INT32_MAX));
    int64_t wrong = 0;
    for (int32_t d : divisors) {
        const kernels::FastDivisor f(d);
        auto check = [&](int32_t n) {
            int32_t q, r;
            f.divmod(n, q, r);
            wrong += q != n / d || r != n % d;
        };
        for (int32_t n = 0; n < 20000; ++n) check(n);
        for (int32_t k = 1; k < 64; ++k) {  // around multiples of d and the top of the range
            const int64_t m = int64_t(d) * k;
            for (int64_t n = m - 2; n <= m + 2; ++n)
                if (n >= 0 && n <= INT32_MAX) check(int32_t(n));
            check(INT32_MAX - k);
        }
        for (int i = 0; i < 2000; ++i) check(int32_t(rng() % (int64_t(INT32_MAX) + 1)));
    }
    CHECK_MESSAGE(wrong == 0, wrong, " wrong quotients or remainders");
}

TEST_CASE("cuda mla attention rejects bad parameters with a clear error") {
    kernels::MlaAttnParams p;
    CHECK_THROWS_AS(kernels::mla_decode(p, nullptr), mgl::error);  // null pointers
    alignas(16) float dummy[4] = {};
    int32_t table[1] = {0};
    p.cache = {dummy, mgl::dtype::f32, 1, 16, table, 1, 30, 8};  // r = 30: not a multiple of 8
    p.q_lat = p.q_pe = dummy;
    p.out = dummy;
    p.positions = table;
    p.T = p.H = 1;
    CHECK_THROWS_AS(kernels::mla_prefill(p, nullptr), mgl::error);
    p.cache.kv_lora_rank = 32;
    p.max_splits = 8;  // and no workspace
    CHECK_THROWS_AS(kernels::mla_decode(p, nullptr), mgl::error);
    // f16 pages on a tensor-core shape not built for them: an error before any launch.
    p.max_splits = 1;
    p.cache.type = mgl::dtype::f16;
    p.impl = MlaImpl::tensor_core;
    p.variant = 1;
    CHECK_THROWS_WITH_AS(kernels::mla_decode(p, nullptr), doctest::Contains("not built for f16"),
                         mgl::error);
    p.cache.type = mgl::dtype::i32;  // not a page type
    p.variant = -1;
    CHECK_THROWS_WITH_AS(kernels::mla_decode(p, nullptr), doctest::Contains("pages must be"),
                         mgl::error);
    CHECK(kernels::mla_attn_workspace_bytes(1, 16, 512, 1) == 0);
    CHECK(kernels::mla_attn_workspace_bytes(1, 16, 512, 8) >= 8 * 16 * 513 * 4);
}
#endif  // MINIDS_HAVE_CUDA
