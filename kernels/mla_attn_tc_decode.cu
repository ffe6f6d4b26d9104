// Tensor-core MLA attention, decode block shapes: 16 query rows (T·H = 16 for V2-Lite at T = 1)
// per block, warps split the keys of a tile for Q·Kᵀ and the 512 output columns for P·V.
#include "mla_attn_tc.cuh"

namespace minids::kernels::mla_detail {
namespace {

using bf16 = __nv_bfloat16;
using f16 = __half;
// TcShape<MT, WM, WN, KT, STAGES, R_PAD>
using D0 = TcShape<1, 1, 4, 64, 2, 512>;  // 128 threads, ~170 KB smem: 1 block/SM
using D0s = TcShape<1, 1, 4, 64, 2, 64>;
using D1 = TcShape<1, 1, 4, 32, 4, 512>;  // smaller tiles, deeper pipeline
using D1s = TcShape<1, 1, 4, 32, 4, 64>;
using D2 = TcShape<1, 1, 8, 64, 2, 512>;  // 256 threads
using D3 = TcShape<1, 1, 4, 32, 2, 512>;  // ~95 KB smem: 2 blocks/SM
using D3s = TcShape<1, 1, 4, 32, 2, 64>;

template <class S, class Small, typename PageT>
constexpr TcInstances instances() {
    return {launch_tc_instance<S, PageT>, launch_tc_instance<Small, PageT>};
}
constexpr TcInstances none{nullptr, nullptr};

// f16 pages: the shapes the defaults pick (item 0, and item 2 for r > 64), so that every f16
// run has its kernel without doubling the build time of the others.
const TcVariant variants[] = {
    {"rows16 warps1x4 keys64 stages2", instances<D0, D0s, bf16>(), instances<D0, D0s, float>(),
     instances<D0, D0s, f16>()},
    {"rows16 warps1x4 keys32 stages4", instances<D1, D1s, bf16>(), none, none},
    {"rows16 warps1x8 keys64 stages2",
     {launch_tc_instance<D2, bf16>, nullptr},
     none,
     {launch_tc_instance<D2, f16>, nullptr}},
    {"rows16 warps1x4 keys32 stages2", instances<D3, D3s, bf16>(), none, none},
};

}  // namespace

TcVariantList tc_decode_variants() {
    return {variants, int(sizeof(variants) / sizeof(variants[0]))};
}

}  // namespace minids::kernels::mla_detail
