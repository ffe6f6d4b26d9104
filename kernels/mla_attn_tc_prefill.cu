// Tensor-core MLA attention, prefill block shapes: 32-64 query rows per block (T·H rows, e.g.
// 512 x 16 = 8192 for a V2-Lite prompt, 128 blocks), all attending the same cache rows.
#include "mla_attn_tc.cuh"

namespace minids::kernels::mla_detail {
namespace {

using bf16 = __nv_bfloat16;
using f16 = __half;
// TcShape<MT, WM, WN, KT, STAGES, R_PAD>
using P0 = TcShape<2, 2, 4, 32, 3, 512>;  // 64 rows, 256 threads, ~194 KB smem
using P0s = TcShape<2, 2, 4, 32, 3, 64>;
using P1 = TcShape<1, 4, 2, 32, 3, 512>;  // 64 rows, warps split rows 4 ways, columns 2 ways
using P1s = TcShape<1, 4, 2, 32, 3, 64>;
using P2 = TcShape<1, 2, 4, 32, 3, 512>;  // 32 rows: twice the blocks
using P2s = TcShape<1, 2, 4, 32, 3, 64>;
using P3 = TcShape<2, 2, 4, 32, 2, 512>;  // 64 rows, double buffered

template <class S, class Small, typename PageT>
constexpr TcInstances instances() {
    return {launch_tc_instance<S, PageT>, launch_tc_instance<Small, PageT>};
}
constexpr TcInstances none{nullptr, nullptr};

// f16 pages: the default shape (item 0) only, so that every f16 run has its kernel without
// doubling the build time of the others.
const TcVariant variants[] = {
    {"rows64 warps2x4 mt2 keys32 stages3", instances<P0, P0s, bf16>(), instances<P0, P0s, float>(),
     instances<P0, P0s, f16>()},
    {"rows64 warps4x2 mt1 keys32 stages3", instances<P1, P1s, bf16>(), none, none},
    {"rows32 warps2x4 mt1 keys32 stages3", instances<P2, P2s, bf16>(), none, none},
    {"rows64 warps2x4 mt2 keys32 stages2", {launch_tc_instance<P3, bf16>, nullptr}, none, none},
};

}  // namespace

TcVariantList tc_prefill_variants() {
    return {variants, int(sizeof(variants) / sizeof(variants[0]))};
}

}  // namespace minids::kernels::mla_detail
