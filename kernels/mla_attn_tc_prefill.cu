// Tensor-core MLA attention, prefill block shapes: 32-64 query rows per block (T·H rows, e.g.
// 512 x 16 = 8192 for a V2-Lite prompt, 128 blocks), all attending the same cache rows.
#include "mla_attn_tc.cuh"

namespace minids::kernels::mla_detail {
namespace {

using bf16 = __nv_bfloat16;
// TcShape<MT, WM, WN, KT, STAGES, R_PAD>
using P0 = TcShape<2, 2, 4, 32, 3, 512>;  // 64 rows, 256 threads, ~194 KB smem
using P0s = TcShape<2, 2, 4, 32, 3, 64>;
using P1 = TcShape<1, 4, 2, 32, 3, 512>;  // 64 rows, warps split rows 4 ways, columns 2 ways
using P1s = TcShape<1, 4, 2, 32, 3, 64>;
using P2 = TcShape<1, 2, 4, 32, 3, 512>;  // 32 rows: twice the blocks
using P2s = TcShape<1, 2, 4, 32, 3, 64>;
using P3 = TcShape<2, 2, 4, 32, 2, 512>;  // 64 rows, double buffered

const TcVariant variants[] = {
    {"rows64 warps2x4 mt2 keys32 stages3", launch_tc_instance<P0, bf16>,
     launch_tc_instance<P0s, bf16>, launch_tc_instance<P0, float>, launch_tc_instance<P0s, float>},
    {"rows64 warps4x2 mt1 keys32 stages3", launch_tc_instance<P1, bf16>,
     launch_tc_instance<P1s, bf16>, nullptr, nullptr},
    {"rows32 warps2x4 mt1 keys32 stages3", launch_tc_instance<P2, bf16>,
     launch_tc_instance<P2s, bf16>, nullptr, nullptr},
    {"rows64 warps2x4 mt2 keys32 stages2", launch_tc_instance<P3, bf16>, nullptr, nullptr, nullptr},
};

}  // namespace

TcVariantList tc_prefill_variants() {
    return {variants, int(sizeof(variants) / sizeof(variants[0]))};
}

}  // namespace minids::kernels::mla_detail
