// The pipelined grouped MoE GEMM (MoeGroupedKernel::pipelined, kernels/moe_gemm_pipelined.cuh)
// against the staged one (moe_gemm.cuh) on the same device inputs: every output bit equal. Both
// multiply the same BF16 operands (x rounded the same way, e4m3 widened exactly) with one
// m16n8k16 per 16 K values in increasing K order and the same epilogue expressions, so nothing
// may differ. A sample of tokens is also checked against the double reference (relative L2 1e-2,
// the tensor-core bound of test_kernels_moe_experts.cpp). Outputs and workspaces start
// NaN-poisoned, so an unwritten element fails.
#ifdef MINIDS_HAVE_CUDA
#include <cuda_runtime_api.h>
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "moe.h"
#include "moe_cuda_fixture.h"

using namespace minids;
using kernels::MoeGroupedKernel;
using kernels::MoeGroupedStage;
using kernels::MoePath;
using moe_test::DeviceBuffer;

namespace {

const bool no_gpu = !test::cuda_device_available();

struct Case {
    mgl::dtype type = mgl::dtype::f8_e4m3;
    int64_t E = 16, D = 64, F = 48;
    int k = 4;
    int64_t T = 17;
    bool shared = false;
    mgl::dtype shared_type = mgl::dtype::bf16;
    int64_t shared_F = 96;
    int tile_m = 64;
    bool skew = false;     // expert 0 is every token's first choice: several M tiles of one expert
    bool bad_ids = false;  // a few ids outside [0, E)
    int64_t x_pad = 0;     // x row stride = D + x_pad
    int64_t check_every = 1;  // reference for tokens t % check_every == 0; 0: bits only
    uint64_t seed = 1;

    std::string describe() const {
        std::ostringstream s;
        s << mgl::dtype_name(type) << " E=" << E << " D=" << D << " F=" << F << " k=" << k
          << " T=" << T << " shared=" << (shared ? mgl::dtype_name(shared_type) : "none")
          << " shared_F=" << shared_F << " tile_m=" << tile_m << " skew=" << skew
          << " bad_ids=" << bad_ids << " x_pad=" << x_pad;
        return s.str();
    }
};

std::shared_ptr<moe_test::ExpertBank> bank_for(mgl::dtype type, int64_t E, int64_t D, int64_t F) {
    static moe_test::BankCache cache(2000);
    return cache.get(type, E, D, F);
}

// The inputs of one case on the device, and moe_experts' parameters over them.
struct Inputs {
    std::shared_ptr<moe_test::ExpertBank> bank;
    std::unique_ptr<moe_test::SharedExpert> shared;
    moe_test::Routing routing;
    std::vector<float> x, residual;
    DeviceBuffer dx, dids, dw, dres;
    kernels::MoeExpertsParams p;

    explicit Inputs(const Case& c)
        : bank(bank_for(c.type, c.E, c.D, c.F)), routing(c.T, c.E, c.k, c.seed + 1, c.skew) {
        if (c.shared)
            shared = std::make_unique<moe_test::SharedExpert>(c.shared_type, c.D, c.shared_F,
                                                              c.seed + 7);
        if (c.bad_ids) {
            routing.ids[0] = -1;
            if (c.T > 1) routing.ids[size_t(2 * c.k - 1)] = int32_t(c.E);
        }
        x = test::random_floats(size_t(c.T * (c.D + c.x_pad)), c.seed + 2);
        residual = test::random_floats(size_t(c.T * c.D), c.seed + 3, -4.0f, 4.0f);
        dx = DeviceBuffer(x);
        dids = DeviceBuffer(routing.ids);
        dw = DeviceBuffer(routing.weights);
        dres = DeviceBuffer(residual);
        p.expert_table = bank->table.as<int64_t>();
        p.n_experts = c.E;
        p.layout = bank->layout;
        p.ids = dids.as<int32_t>();
        p.weights = dw.as<float>();
        p.k = c.k;
        p.x = dx.as<float>();
        p.x_stride = c.D + c.x_pad;
        p.residual = dres.as<float>();
        p.n_tokens = c.T;
        if (shared) p.shared = shared->weights();
        p.path = MoePath::grouped;
        p.grouped.tile_m = c.tile_m;
    }
};

// out of one moe_experts call with `kernel` (fresh NaN-poisoned output and workspace).
std::vector<float> run_kernel(Inputs& in, MoeGroupedKernel kernel) {
    kernels::MoeExpertsParams p = in.p;
    p.grouped.kernel = kernel;
    DeviceBuffer out(size_t(p.n_tokens * p.layout.n_embd) * 4);
    p.out = out.as<float>();
    DeviceBuffer ws(kernels::moe_experts_workspace_bytes(p));
    kernels::moe_experts(p, ws.ptr, ws.bytes, nullptr);
    CUDA_CHECK(cudaDeviceSynchronize());
    return out.download<float>();
}

// Elements whose bits differ, and the largest absolute difference among them.
struct BitDiff {
    int64_t n = 0;
    double max_abs = 0.0;
};
BitDiff bit_diff(const std::vector<float>& a, const std::vector<float>& b) {
    BitDiff d;
    for (size_t i = 0; i < a.size(); ++i) {
        if (std::memcmp(&a[i], &b[i], sizeof(float)) == 0) continue;
        ++d.n;
        d.max_abs = std::max(d.max_abs, double(std::fabs(a[i] - b[i])));
    }
    return d;
}

void check_case(const Case& c) {
    Inputs in(c);
    const auto staged = run_kernel(in, MoeGroupedKernel::staged);
    const auto pipelined = run_kernel(in, MoeGroupedKernel::pipelined);
    INFO(c.describe());
    int64_t non_finite = 0;
    for (float v : pipelined) non_finite += std::isfinite(v) ? 0 : 1;
    CHECK(non_finite == 0);
    REQUIRE(staged.size() == pipelined.size());
    const BitDiff d = bit_diff(staged, pipelined);
    INFO("elements with other bits: " << d.n << " of " << staged.size() << ", max |diff| "
                                      << d.max_abs);
    CHECK(d.n == 0);
    if (c.check_every == 0) return;
    const auto want =
        moe_test::reference_moe(*in.bank, in.routing, c.k, in.x, c.D + c.x_pad, c.T,
                                in.shared ? &in.shared->mlp : nullptr, &in.residual, c.check_every);
    std::vector<float> got_s;
    std::vector<double> want_s;
    for (int64_t t = 0; t < c.T; t += c.check_every)
        for (int64_t d2 = 0; d2 < c.D; ++d2) {
            got_s.push_back(pipelined[size_t(t * c.D + d2)]);
            want_s.push_back(want[size_t(t * c.D + d2)]);
        }
    const double err = test::relative_l2(got_s, want_s);
    INFO("relative L2 against the double reference " << err);
    CHECK(err < 1e-2);
}

}  // namespace

TEST_CASE("cuda moe pipelined: bits of the staged kernel, every dtype, tile size, T 1..511" *
          doctest::skip(no_gpu)) {
    // E 16, k 4: T 1 leaves 12 experts with no token and 4 with one; skewed routing gives expert 0
    // every token (several M tiles of one expert). D 64 / F 48: every N tile partial, and the
    // down GEMM's only K tile too. f32 experts keep the staged kernel (the shared expert, bf16,
    // runs the pipelined one).
    uint64_t seed = 500;
    for (mgl::dtype type : {mgl::dtype::f8_e4m3, mgl::dtype::bf16, mgl::dtype::f32})
        for (int tile_m : {32, 64, 128})
            for (int64_t T : {1, 2, 3, 17, 200, 511}) {
                Case c;
                c.type = type;
                c.T = T;
                c.tile_m = tile_m;
                c.skew = T % 2 == 1;
                c.shared = T != 2;
                c.check_every = T > 100 ? 7 : 1;
                c.seed = ++seed;
                check_case(c);
            }
}

TEST_CASE("cuda moe pipelined: bits of the staged kernel, k and expert counts, odd widths" *
          doctest::skip(no_gpu)) {
    uint64_t seed = 600;
    for (mgl::dtype type : {mgl::dtype::f8_e4m3, mgl::dtype::bf16}) {
        for (int k : {1, 2, 6, 8})
            for (int64_t E : {8, 64, 160}) {
                Case c;
                c.type = type;
                c.E = E;
                c.k = k;
                c.D = 128;
                c.F = 96;
                c.T = 101;
                c.shared = k % 2 == 0;
                c.shared_F = 192;
                c.check_every = 5;
                c.seed = ++seed;
                check_case(c);
            }
        // Widths that are not multiples of the tiles: n_ff 80 (the demo model: a partial N tile
        // in gate/up, a partial K tile in down), 208; n_embd 272 (partial K tiles in gate/up, a
        // partial N tile in down); a shared expert of 160 and 2816.
        for (auto [D, F, shared_F] :
             {std::array<int64_t, 3>{256, 80, 160}, std::array<int64_t, 3>{272, 208, 2816}}) {
            Case c;
            c.type = type;
            c.E = 32;
            c.D = D;
            c.F = F;
            c.k = 6;
            c.T = 77;
            c.shared = true;
            c.shared_F = shared_F;
            c.check_every = 3;
            c.seed = ++seed;
            check_case(c);
        }
    }
    Case bad;  // ids outside [0, E) contribute nothing
    bad.T = 40;
    bad.bad_ids = true;
    check_case(bad);
    Case strided;  // x rows padded by 4 floats: still 16-byte aligned, tensor cores
    strided.T = 40;
    strided.x_pad = 4;
    strided.shared = true;
    check_case(strided);
    Case odd;  // unaligned shapes: both requests fall back to the FP32 kernels
    odd.D = 24;
    odd.F = 13;
    odd.E = 7;
    odd.k = 3;
    odd.T = 33;
    odd.x_pad = 1;
    check_case(odd);
}

TEST_CASE("cuda moe pipelined: bits of the staged kernel, V2-Lite shapes" * doctest::skip(no_gpu)) {
    // D 2048, n_ff 1408, top-6, a 2816-wide bf16 shared expert; 16 blobs, so 128 tokens give ~48
    // rows per expert as 512 tokens do over 64 experts, and 511 tokens ~190 (3 M tiles).
    for (mgl::dtype type : {mgl::dtype::f8_e4m3, mgl::dtype::bf16})
        for (int64_t T : {128, 511}) {
            Case c;
            c.type = type;
            c.E = 16;
            c.D = 2048;
            c.F = 1408;
            c.k = 6;
            c.T = T;
            c.shared = true;
            c.shared_F = 2816;
            c.check_every = T == 128 ? 16 : 0;
            c.seed = 700 + uint64_t(T);
            check_case(c);
        }
}

TEST_CASE("cuda moe pipelined: captured in a CUDA graph, and stage by stage" *
          doctest::skip(no_gpu)) {
    Case c;
    c.E = 32;
    c.D = 256;
    c.F = 80;
    c.k = 6;
    c.T = 96;
    c.shared = true;
    c.shared_F = 160;
    Inputs in(c);
    const auto want = run_kernel(in, MoeGroupedKernel::pipelined);

    kernels::MoeExpertsParams p = in.p;
    p.grouped.kernel = MoeGroupedKernel::pipelined;
    DeviceBuffer out(size_t(c.T * c.D) * 4);
    p.out = out.as<float>();
    DeviceBuffer ws(kernels::moe_experts_workspace_bytes(p));
    cudaStream_t stream;
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    // The launcher neither allocates nor synchronizes: capture succeeds, the replay gives the bits
    // of the eager call.
    cudaGraph_t graph;
    CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    kernels::moe_experts(p, ws.ptr, ws.bytes, stream);
    CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    cudaGraphExec_t exec;
    CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    CUDA_CHECK(cudaGraphLaunch(exec, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
    CHECK(bit_diff(want, out.download<float>()).n == 0);
    CUDA_CHECK(cudaGraphExecDestroy(exec));
    CUDA_CHECK(cudaGraphDestroy(graph));

    // Each stage re-run alone on the workspace the full call left recomputes the same output
    // (what bench_moe_cuda relies on to time one kernel at a time).
    CUDA_CHECK(cudaMemset(out.ptr, 0xff, out.bytes));
    for (MoeGroupedStage s :
         {MoeGroupedStage::x_to_bf16, MoeGroupedStage::gate_up, MoeGroupedStage::down,
          MoeGroupedStage::shared_gate_up, MoeGroupedStage::shared_down, MoeGroupedStage::combine})
        kernels::moe_grouped_stage(p, s, ws.ptr, ws.bytes, stream);
    CUDA_CHECK(cudaStreamSynchronize(stream));
    CHECK(bit_diff(want, out.download<float>()).n == 0);
    CUDA_CHECK(cudaStreamDestroy(stream));

    kernels::MoeExpertsParams decode = p;  // few tokens take the decode path: refused
    decode.n_tokens = 1;
    decode.path = MoePath::automatic;
    CHECK_THROWS_AS(
        kernels::moe_grouped_stage(decode, MoeGroupedStage::gate_up, ws.ptr, ws.bytes, nullptr),
        mgl::error);
}
#endif  // MINIDS_HAVE_CUDA
