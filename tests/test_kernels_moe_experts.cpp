// CUDA MoE expert kernels (moe_experts: the fused decode path and the grouped prefill path)
// against a naive double-precision reference, on experts stored as .mds-style blobs scattered
// over device memory in random order. Bounds: FP32-accumulate paths (decode, grouped without
// tensor cores) 1e-5 relative L2; tensor-core grouped path (x and activations rounded to BF16)
// 1e-2. Outputs and workspaces start NaN-poisoned, so an unwritten element fails the test.
#ifdef MINIDS_HAVE_CUDA
#include <cuda_runtime_api.h>
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "moe.h"
#include "moe_cuda_fixture.h"

using namespace minids;
using kernels::MoePath;
using moe_test::DeviceBuffer;

namespace {

const bool no_gpu = !test::cuda_device_available();

struct Case {
    mgl::dtype type = mgl::dtype::f8_e4m3;
    int64_t E = 16, D = 64, F = 32;
    int k = 4;
    int64_t T = 1;
    bool shared = false;
    mgl::dtype shared_type = mgl::dtype::bf16;
    int64_t shared_F = 64;
    bool residual = false;
    bool in_place = false;    // out is the residual buffer
    int64_t x_pad = 0;        // x row stride = D + x_pad
    bool skew = false;        // expert 0 is every token's first choice
    bool bad_ids = false;     // a few ids outside [0, E)
    int64_t check_every = 1;  // compare tokens t % check_every == 0 (big shapes: a sample)
    MoePath path = MoePath::automatic;
    // Folded RMSNorm (decode path): x is the norm's input; no weight, or a bf16 / f32 weight.
    bool norm = false;
    bool norm_weight = true;
    mgl::dtype norm_w_type = mgl::dtype::bf16;
    kernels::MoeDecodeConfig decode;
    kernels::MoeGroupedConfig grouped;
    uint64_t seed = 1;
    // The decode path in its three parts (moe_decode_part): the shared expert's gate/up on a
    // second stream forked before the routed experts' gate/up and joined before the down launch.
    bool parts = false;

    std::string describe() const {
        std::ostringstream s;
        s << mgl::dtype_name(type) << " E=" << E << " D=" << D << " F=" << F << " k=" << k
          << " T=" << T << " shared=" << (shared ? mgl::dtype_name(shared_type) : "none")
          << (shared ? " shared_F=" + std::to_string(shared_F) : "") << " residual=" << residual
          << " in_place=" << in_place << " x_pad=" << x_pad << " skew=" << skew
          << " bad_ids=" << bad_ids << " path=" << int(path) << " unroll=" << decode.unroll
          << " fp8_convert=" << int(decode.fp8_convert) << " gate_up_warps=" << decode.gate_up_warps
          << " down_warps=" << decode.down_warps << " warps_per_row=" << decode.down_warps_per_row
          << " rows_per_warp=" << decode.down_rows_per_warp
          << " gate_up_rows=" << decode.gate_up_rows_per_warp
          << " gate_up_compact=" << decode.gate_up_compact_grid
          << " down_act_in_shared=" << decode.down_act_in_shared
          << " tensor_cores=" << grouped.tensor_cores << " tile_m=" << grouped.tile_m
          << " norm=" << norm
          << " norm_w=" << (norm_weight ? mgl::dtype_name(norm_w_type) : "none");
        return s.str();
    }
};

std::shared_ptr<moe_test::ExpertBank> bank_for(mgl::dtype type, int64_t E, int64_t D, int64_t F) {
    static moe_test::BankCache cache(1000);
    return cache.get(type, E, D, F);
}

// Runs one case; returns the relative L2 error against the reference (checks finiteness) and,
// when `out` is given, the outputs.
double run_case(const Case& c, std::vector<float>* out = nullptr) {
    const auto bank = bank_for(c.type, c.E, c.D, c.F);
    std::unique_ptr<moe_test::SharedExpert> shared;
    if (c.shared)
        shared =
            std::make_unique<moe_test::SharedExpert>(c.shared_type, c.D, c.shared_F, c.seed + 7);
    moe_test::Routing routing(c.T, c.E, c.k, c.seed + 1, c.skew);
    if (c.bad_ids) {
        routing.ids[0] = -1;
        if (c.T > 1) routing.ids[size_t(c.k + c.k - 1)] = int32_t(c.E);
    }
    const int64_t x_stride = c.D + c.x_pad;
    const auto x = test::random_floats(size_t(c.T * x_stride), c.seed + 2);
    const auto residual = test::random_floats(size_t(c.T * c.D), c.seed + 3, -4.0f, 4.0f);

    // The folded norm: the reference sees rms_norm(x) · g computed in double (rounded to f32).
    constexpr float eps = 1e-6f;
    auto g = test::random_floats(size_t(c.D), c.seed + 4, 0.5f, 1.5f);
    std::vector<uint16_t> g_bf16;
    for (float& v : g) {
        g_bf16.push_back(mgl::f32_to_bf16(v));
        if (c.norm_w_type == mgl::dtype::bf16) v = mgl::bf16_to_f32(g_bf16.back());
    }
    std::vector<float> x_ref = x;
    if (c.norm) {
        for (int64_t t = 0; t < c.T; ++t) {
            double ss = 0.0;
            for (int64_t d = 0; d < c.D; ++d)
                ss += double(x[size_t(t * x_stride + d)]) * x[size_t(t * x_stride + d)];
            const double inv = 1.0 / std::sqrt(ss / double(c.D) + eps);
            for (int64_t d = 0; d < c.D; ++d)
                x_ref[size_t(t * x_stride + d)] = float(double(x[size_t(t * x_stride + d)]) * inv *
                                                        (c.norm_weight ? g[size_t(d)] : 1.0f));
        }
    }
    DeviceBuffer dg = c.norm_w_type == mgl::dtype::bf16 ? DeviceBuffer(g_bf16) : DeviceBuffer(g);
    DeviceBuffer dx(x), dids(routing.ids), dw(routing.weights), dres(residual);
    DeviceBuffer dout(size_t(c.T * c.D) * 4);  // NaN-poisoned
    kernels::MoeExpertsParams p;
    p.expert_table = bank->table.as<int64_t>();
    p.n_experts = c.E;
    p.layout = bank->layout;
    p.ids = dids.as<int32_t>();
    p.weights = dw.as<float>();
    p.k = c.k;
    p.x = dx.as<float>();
    p.x_stride = x_stride;
    p.out = c.in_place ? dres.as<float>() : dout.as<float>();
    p.residual = c.residual || c.in_place ? dres.as<float>() : nullptr;
    p.n_tokens = c.T;
    if (shared) p.shared = shared->weights();
    p.path = c.path;
    p.decode = c.decode;
    p.grouped = c.grouped;
    if (c.norm) {
        p.rms_norm = true;
        p.norm_w = c.norm_weight ? dg.ptr : nullptr;
        p.norm_w_type = c.norm_w_type;
        p.norm_eps = eps;
    }
    DeviceBuffer ws(kernels::moe_experts_workspace_bytes(p));  // NaN-poisoned
    if (c.parts) {
        cudaStream_t main_s = nullptr, side_s = nullptr;
        cudaEvent_t fork = nullptr, join = nullptr;
        CUDA_CHECK(cudaStreamCreateWithFlags(&main_s, cudaStreamNonBlocking));
        CUDA_CHECK(cudaStreamCreateWithFlags(&side_s, cudaStreamNonBlocking));
        CUDA_CHECK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
        CUDA_CHECK(cudaEventCreateWithFlags(&join, cudaEventDisableTiming));
        CUDA_CHECK(cudaEventRecord(fork, main_s));
        CUDA_CHECK(cudaStreamWaitEvent(side_s, fork, 0));
        kernels::moe_decode_part(p, kernels::MoeDecodePart::shared_gate_up, ws.ptr, ws.bytes,
                                 side_s);
        kernels::moe_decode_part(p, kernels::MoeDecodePart::routed_gate_up, ws.ptr, ws.bytes,
                                 main_s);
        CUDA_CHECK(cudaEventRecord(join, side_s));
        CUDA_CHECK(cudaStreamWaitEvent(main_s, join, 0));
        kernels::moe_decode_part(p, kernels::MoeDecodePart::down, ws.ptr, ws.bytes, main_s);
        CUDA_CHECK(cudaStreamSynchronize(main_s));
        CUDA_CHECK(cudaEventDestroy(fork));
        CUDA_CHECK(cudaEventDestroy(join));
        CUDA_CHECK(cudaStreamDestroy(main_s));
        CUDA_CHECK(cudaStreamDestroy(side_s));
    } else {
        kernels::moe_experts(p, ws.ptr, ws.bytes, nullptr);
    }
    CUDA_CHECK(cudaDeviceSynchronize());
    const auto got = (c.in_place ? dres : dout).download<float>();
    if (out) *out = got;
    const auto want = moe_test::reference_moe(
        *bank, routing, c.k, x_ref, x_stride, c.T, shared ? &shared->mlp : nullptr,
        c.residual || c.in_place ? &residual : nullptr, c.check_every);
    int64_t non_finite = 0;
    for (float v : got) non_finite += std::isfinite(v) ? 0 : 1;
    INFO(c.describe());
    INFO("non-finite outputs: " << non_finite);
    CHECK(non_finite == 0);
    std::vector<float> got_s;
    std::vector<double> want_s;
    for (int64_t t = 0; t < c.T; t += c.check_every)
        for (int64_t d = 0; d < c.D; ++d) {
            got_s.push_back(got[size_t(t * c.D + d)]);
            want_s.push_back(want[size_t(t * c.D + d)]);
        }
    return test::relative_l2(got_s, want_s);
}

void check_case(const Case& c, double bound) {
    const double err = run_case(c);
    INFO(c.describe());
    INFO("relative L2 " << err << ", bound " << bound);
    CHECK(err < bound);
}

bool uses_tensor_cores(const Case& c) {
    return c.grouped.tensor_cores && c.D % 16 == 0 && c.F % 16 == 0 &&
           (!c.shared || c.shared_F % 16 == 0) && (c.D + c.x_pad) % 4 == 0;
}

const mgl::dtype all_types[] = {mgl::dtype::f8_e4m3, mgl::dtype::bf16, mgl::dtype::f32};

// DeepSeek-V2-Lite's expert shapes (D 2048, n_ff 1408, top-6, a 2816-wide bf16 shared expert,
// residual on) with E blobs to route over.
Case v2_lite_case(mgl::dtype type, int64_t E) {
    Case c;
    c.type = type;
    c.E = E;
    c.D = 2048;
    c.F = 1408;
    c.k = 6;
    c.shared = true;
    c.shared_F = 2816;
    c.residual = true;
    return c;
}

}  // namespace

TEST_CASE("cuda moe decode: every dtype, shared expert and residual on and off, T 1..3" *
          doctest::skip(no_gpu)) {
    uint64_t seed = 10;
    for (mgl::dtype type : all_types)
        for (bool shared : {false, true})
            for (bool residual : {false, true})
                for (int64_t T : {1, 2, 3}) {
                    Case c;
                    c.type = type;
                    c.shared = shared;
                    c.shared_type = type == mgl::dtype::f32 ? mgl::dtype::f32 : mgl::dtype::bf16;
                    c.residual = residual;
                    c.T = T;
                    c.path = MoePath::decode;
                    c.seed = ++seed;
                    check_case(c, 1e-5);
                }
}

TEST_CASE("cuda moe decode: folded RMSNorm, every dtype and norm weight, T 1..3, both conversions" *
          doctest::skip(no_gpu)) {
    uint64_t seed = 50;
    for (mgl::dtype type : all_types)
        for (int w = 0; w < 3; ++w)  // no weight, bf16, f32
            for (int64_t T : {1, 3}) {
                Case c;
                c.type = type;
                c.shared = true;
                c.shared_type = type == mgl::dtype::f32 ? mgl::dtype::f32 : mgl::dtype::bf16;
                c.residual = true;
                c.T = T;
                c.path = MoePath::decode;
                c.norm = true;
                c.norm_weight = w > 0;
                c.norm_w_type = w == 2 ? mgl::dtype::f32 : mgl::dtype::bf16;
                c.seed = ++seed;
                check_case(c, 1e-5);
                if (type == mgl::dtype::f8_e4m3) {  // the integer FP8 conversion stages x scaled
                    c.decode.fp8_convert = kernels::Fp8Convert::bit_ops;
                    check_case(c, 1e-5);
                }
            }
    // V2-Lite's shapes (D 2048: eight elements of x per thread), odd D (the scalar path).
    Case lite = v2_lite_case(mgl::dtype::f8_e4m3, 64);
    lite.norm = true;
    lite.seed = 77;
    check_case(lite, 1e-5);
    Case odd;
    odd.D = 61;
    odd.F = 27;
    odd.norm = true;
    odd.path = MoePath::decode;
    odd.seed = 78;
    check_case(odd, 1e-5);
    // The grouped path refuses it with one error.
    Case grouped;
    grouped.norm = true;
    grouped.T = 20;
    grouped.path = MoePath::grouped;
    CHECK_THROWS_WITH_AS(run_case(grouped), doctest::Contains("decode path only"), mgl::error);
}

TEST_CASE("cuda moe decode in three parts (moe_decode_part): the bits of moe_experts" *
          doctest::skip(no_gpu)) {
    // The shared expert's gate/up on its own stream, then the routed experts' gate/up and the
    // down launch: every dtype, with and without a shared expert, residual and folded norm, T up
    // to the decode path's 8, both launch-1 grids of the one-launch path, V2-Lite's shapes.
    uint64_t seed = 900;
    auto same_bits = [](Case c) {
        std::vector<float> whole, parts;
        c.parts = false;
        const double e_whole = run_case(c, &whole);
        c.parts = true;
        const double e_parts = run_case(c, &parts);
        INFO(c.describe());
        INFO("relative L2: one launch pair " << e_whole << ", three parts " << e_parts);
        CHECK(e_parts < 1e-5);
        REQUIRE(whole.size() == parts.size());
        size_t differ = 0;
        for (size_t i = 0; i < whole.size(); ++i)
            differ += std::memcmp(&whole[i], &parts[i], sizeof(float)) != 0 ? 1 : 0;
        CHECK(differ == 0);
    };
    for (mgl::dtype type : all_types)
        for (bool shared : {false, true})
            for (bool norm : {false, true})
                for (int64_t T : {1, 3, 8}) {
                    Case c;
                    c.type = type;
                    c.shared = shared;
                    c.shared_type = type == mgl::dtype::f32 ? mgl::dtype::f32 : mgl::dtype::bf16;
                    c.residual = true;
                    c.norm = norm;
                    c.T = T;
                    c.path = MoePath::decode;
                    c.seed = ++seed;
                    same_bits(c);
                }
    Case compact_off;
    compact_off.shared = true;
    compact_off.decode.gate_up_compact_grid = false;
    compact_off.path = MoePath::decode;
    compact_off.seed = ++seed;
    same_bits(compact_off);
    Case lite = v2_lite_case(mgl::dtype::f8_e4m3, 64);
    lite.seed = ++seed;
    same_bits(lite);
}

TEST_CASE("cuda moe decode: E x k grid, model shapes, odd shapes, strides, in-place residual" *
          doctest::skip(no_gpu)) {
    uint64_t seed = 100;
    for (int64_t E : {16, 64, 160})
        for (int k : {1, 2, 4, 6, 8}) {
            Case c;
            c.E = E;
            c.k = k;
            c.T = 2;
            c.shared = k % 2 == 0;
            c.seed = ++seed;
            check_case(c, 1e-5);
        }
    Case demo;  // models/demo.mds: D 256, n_ff 80, 32 experts, top-4, 2 shared experts
    demo.E = 32;
    demo.D = 256;
    demo.F = 80;
    demo.shared = true;
    demo.shared_F = 160;
    demo.residual = true;
    for (int64_t T : {1, 3}) {
        demo.T = T;
        check_case(demo, 1e-5);
    }
    for (mgl::dtype type : all_types) {  // unaligned rows: the element-by-element kernels
        Case odd;
        odd.type = type;
        odd.D = 24;
        odd.F = 13;
        odd.E = 7;
        odd.k = 3;
        odd.T = 3;
        odd.shared = true;
        odd.shared_type = mgl::dtype::f32;
        odd.shared_F = 7;
        odd.residual = true;
        odd.x_pad = 1;
        check_case(odd, 1e-5);  // routed rows wider than the shared expert's: compact grid
        odd.decode.gate_up_compact_grid = false;
        check_case(odd, 1e-5);
    }
    Case strided;
    strided.T = 3;
    strided.x_pad = 5;
    strided.in_place = true;
    strided.shared = true;
    check_case(strided, 1e-5);
    Case bad;  // ids outside [0, E) contribute nothing
    bad.T = 3;
    bad.bad_ids = true;
    bad.shared = true;
    check_case(bad, 1e-5);
    Case many;  // the decode path is correct for any T (it is only meant for few)
    many.T = 17;
    many.shared = true;
    many.residual = true;
    many.path = MoePath::decode;
    check_case(many, 1e-5);
}

TEST_CASE("cuda moe decode: V2-Lite shapes (D 2048, n_ff 1408, top-6, shared 2816 bf16)" *
          doctest::skip(no_gpu)) {
    for (mgl::dtype type : {mgl::dtype::f8_e4m3, mgl::dtype::bf16}) {
        Case c = v2_lite_case(type, 8);  // eight blobs route six distinct experts
        for (int64_t T : {1, 4})
            for (int rows : {1, 2, 4}) {  // the default, and every row count of both launches
                c.T = T;
                // Launch 1's grid with and without the blocks that have no rows.
                c.decode.gate_up_compact_grid = T == 1 || rows != 2;
                // Launch 2 with the activations staged in shared memory, and read through L1.
                c.decode.down_act_in_shared = T == 1;
                if (rows != 2) {
                    c.decode.gate_up_rows_per_warp = rows == 4 ? 2 : 1;
                    c.decode.down_rows_per_warp = rows;
                }
                check_case(c, 1e-5);
            }
    }
}

TEST_CASE("cuda moe decode: every kernel configuration gives the same answer" *
          doctest::skip(no_gpu)) {
    Case base;
    base.E = 64;
    base.D = 256;
    base.F = 96;
    base.k = 6;
    base.T = 2;
    base.shared = true;
    base.shared_F = 192;
    base.residual = true;
    for (mgl::dtype type : {mgl::dtype::f8_e4m3, mgl::dtype::bf16})
        for (int unroll : {2, 4, 8})
            for (auto cvt : {kernels::Fp8Convert::hardware, kernels::Fp8Convert::bit_ops})
                for (int wpr : {1, 2, 4, 8})
                    for (int rows : {1, 2, 4}) {  // launch 2: one-row and tiled kernels
                        Case c = base;
                        c.type = type;
                        c.decode.unroll = unroll;
                        c.decode.fp8_convert = cvt;
                        c.decode.down_warps_per_row = wpr;
                        c.decode.down_rows_per_warp = rows;
                        c.decode.gate_up_rows_per_warp = rows == 4 ? 2 : 1;
                        c.decode.gate_up_warps = wpr == 8 ? 16 : 4 * wpr;
                        c.decode.down_warps = wpr == 1 ? 4 : 8;
                        c.decode.gate_up_compact_grid = (unroll + wpr + rows) % 2 == 0;
                        c.decode.down_act_in_shared = (unroll + wpr) % 4 != 0;
                        check_case(c, 1e-5);
                    }
}

TEST_CASE("cuda moe grouped: tensor cores and the FP32 kernels, every dtype, T 17 and 512" *
          doctest::skip(no_gpu)) {
    uint64_t seed = 300;
    for (mgl::dtype type : all_types)
        for (bool tc : {true, false})
            for (int64_t T : {17, 512}) {
                Case c;
                c.type = type;
                c.E = 64;
                c.D = 128;
                c.F = 96;
                c.k = 6;
                c.T = T;
                c.shared = true;
                c.shared_type = type == mgl::dtype::f32 ? mgl::dtype::f32 : mgl::dtype::bf16;
                c.shared_F = 192;
                c.residual = true;
                c.path = MoePath::grouped;
                c.grouped.tensor_cores = tc;
                c.seed = ++seed;
                REQUIRE(uses_tensor_cores(c) == tc);
                check_case(c, tc ? 1e-2 : 1e-5);
            }
}

TEST_CASE("cuda moe grouped: tile sizes, skewed routing, few tokens, odd shapes, bad ids" *
          doctest::skip(no_gpu)) {
    uint64_t seed = 400;
    for (int tile_m : {32, 64, 128})
        for (bool skew : {false, true})
            for (int64_t T : {1, 2, 3, 17, 200}) {
                Case c;
                c.E = 16;
                c.D = 64;
                c.F = 32;
                c.k = 4;
                c.T = T;
                c.skew = skew;  // expert 0 gets all T tokens: several M tiles of one expert
                c.shared = T % 2 == 1;
                c.residual = true;
                c.path = MoePath::grouped;
                c.grouped.tile_m = tile_m;
                c.seed = ++seed;
                check_case(c, 1e-2);
            }
    for (int k : {1, 2, 8}) {
        Case c;
        c.E = 160;
        c.D = 64;
        c.F = 48;
        c.k = k;
        c.T = 100;
        c.path = MoePath::grouped;
        check_case(c, 1e-2);
    }
    for (bool tc : {true, false}) {
        Case demo;  // demo model shapes: D 256, n_ff 80 (a partial K tile in the down GEMM)
        demo.E = 32;
        demo.D = 256;
        demo.F = 80;
        demo.T = 64;
        demo.shared = true;
        demo.shared_F = 160;
        demo.residual = true;
        demo.in_place = true;
        demo.path = MoePath::grouped;
        demo.grouped.tensor_cores = tc;
        check_case(demo, tc ? 1e-2 : 1e-5);
    }
    for (mgl::dtype type : all_types) {  // unaligned: the FP32 kernels even when TC is asked
        Case odd;
        odd.type = type;
        odd.D = 24;
        odd.F = 13;
        odd.E = 7;
        odd.k = 3;
        odd.T = 33;
        odd.shared = true;
        odd.shared_type = mgl::dtype::f32;
        odd.shared_F = 7;
        odd.residual = true;
        odd.x_pad = 1;
        odd.path = MoePath::grouped;
        check_case(odd, 1e-5);
    }
    Case bad;
    bad.T = 40;
    bad.bad_ids = true;
    bad.path = MoePath::grouped;
    check_case(bad, 1e-2);
    Case strided;  // x rows padded by 4 floats: still 16-byte aligned, tensor cores
    strided.T = 40;
    strided.x_pad = 4;
    strided.path = MoePath::grouped;
    REQUIRE(uses_tensor_cores(strided));
    check_case(strided, 1e-2);
}

TEST_CASE("cuda moe grouped: V2-Lite shapes (D 2048, n_ff 1408, top-6, shared 2816)" *
          doctest::skip(no_gpu)) {
    // 16 blobs and 128 tokens: ~48 rows per expert as with 64 experts and 512 tokens; the
    // double reference is computed for every 8th token.
    for (mgl::dtype type : {mgl::dtype::f8_e4m3, mgl::dtype::bf16}) {
        Case c = v2_lite_case(type, 16);
        c.T = 128;
        c.path = MoePath::grouped;
        c.check_every = 8;
        check_case(c, 1e-2);
    }
}
#endif  // MINIDS_HAVE_CUDA
