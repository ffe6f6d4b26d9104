// moe_experts: parameter checks, path choice and workspace size; the paths live in
// moe_decode.cu and moe_grouped.cu.
#include <string>

#include "moe_common.cuh"

namespace minids::kernels {
namespace moe_detail {

namespace {

bool aligned16(int64_t v) { return v % 16 == 0; }
bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

std::string field(const char* name, int64_t v) {
    return std::string(name) + " " + std::to_string(v);
}

}  // namespace

void check_experts_params(const MoeExpertsParams& p) {
    const ExpertLayout& l = p.layout;
    const std::string who = "moe_experts: ";
    if (!p.expert_table || p.n_experts < 1)
        moe_fail(who + "an expert table of at least one expert is required (" +
                 field("n_experts", p.n_experts) + ")");
    if (l.type != mgl::dtype::f32 && l.type != mgl::dtype::bf16 && l.type != mgl::dtype::f8_e4m3)
        moe_fail(who + "expert dtype " + mgl::dtype_name(l.type) +
                 " (supported: f32, bf16, f8_e4m3)");
    if (l.n_embd < 1 || l.n_ff < 1)
        moe_fail(who + "expert shape " + field("n_embd", l.n_embd) + ", " + field("n_ff", l.n_ff));
    const int64_t eb = dtype_bytes(l.type);
    for (int64_t off : {l.gate_offset, l.up_offset, l.down_offset})
        if (off < 0 || off % eb != 0)
            moe_fail(who + "layout offset " + std::to_string(off) +
                     " is negative or not a multiple of the " + std::to_string(eb) +
                     "-byte element");
    if (l.type == mgl::dtype::f8_e4m3) {
        for (int64_t off : {l.gate_scale_offset, l.up_scale_offset, l.down_scale_offset})
            if (off < 0 || off % 4 != 0)
                moe_fail(who +
                         "f8_e4m3 experts need the three scale offsets (4-byte aligned), found " +
                         std::to_string(off));
    }
    if (p.k < 1 || p.k > 32) moe_fail(who + "k must be in [1, 32] (" + field("k", p.k) + ")");
    if (p.rms_norm && p.norm_w && p.norm_w_type != mgl::dtype::bf16 &&
        p.norm_w_type != mgl::dtype::f32)
        moe_fail(who + "norm weight dtype " + mgl::dtype_name(p.norm_w_type) +
                 " (supported: bf16, f32)");
    if (p.n_tokens < 0) moe_fail(who + "negative " + field("n_tokens", p.n_tokens));
    for (int64_t s : {p.x_stride, p.out_stride, p.residual_stride})
        if (s != 0 && s < l.n_embd)
            moe_fail(who + "row stride " + std::to_string(s) + " < n_embd " +
                     std::to_string(l.n_embd));
    const SharedExpertWeights& s = p.shared;
    if (s.gate || s.up || s.down) {
        if (!s.gate || !s.up || !s.down || s.n_ff < 1)
            moe_fail(who + "the shared expert needs gate, up, down and n_ff >= 1 (" +
                     field("n_ff", s.n_ff) + ")");
        if (s.type != mgl::dtype::bf16 && s.type != mgl::dtype::f32)
            moe_fail(who + "shared expert dtype " + mgl::dtype_name(s.type) +
                     " (supported: bf16, f32)");
        const int64_t seb = dtype_bytes(s.type);
        for (const void* ptr : {s.gate, s.up, s.down})
            if (reinterpret_cast<uintptr_t>(ptr) % uintptr_t(seb) != 0)
                moe_fail(who + "shared expert weights not aligned to their element size");
    }
}

bool weights_vec_aligned(const MoeExpertsParams& p) {
    const ExpertLayout& l = p.layout;
    const int64_t eb = dtype_bytes(l.type);
    bool ok = aligned16(l.n_embd * eb) && aligned16(l.n_ff * eb) && aligned16(l.gate_offset) &&
              aligned16(l.up_offset) && aligned16(l.down_offset);
    if (has_shared(p)) {
        const int64_t seb = dtype_bytes(p.shared.type);
        ok = ok && aligned16(l.n_embd * seb) && aligned16(p.shared.n_ff * seb) &&
             aligned16(p.shared.gate) && aligned16(p.shared.up) && aligned16(p.shared.down);
    }
    return ok;
}

}  // namespace moe_detail

using namespace moe_detail;

MoePath moe_resolved_path(const MoeExpertsParams& p) {
    if (p.path != MoePath::automatic) return p.path;
    return p.n_tokens <= p.decode_max_tokens ? MoePath::decode : MoePath::grouped;
}

bool moe_grouped_uses_tensor_cores(const MoeExpertsParams& p) {
    return p.grouped.tensor_cores && grouped_tensor_cores_supported(p);
}

size_t moe_experts_workspace_bytes(const MoeExpertsParams& p) {
    check_experts_params(p);
    return moe_resolved_path(p) == MoePath::decode ? decode_workspace_bytes(p)
                                                   : grouped_workspace_bytes(p);
}

namespace {

// What every launching entry point checks beyond the shapes: the data pointers (which matter only
// for a launch; a workspace query needs shapes alone) and the workspace's alignment.
void check_launch(const MoeExpertsParams& p, const void* workspace, const char* who) {
    check_experts_params(p);
    if (!p.ids || !p.weights || !p.x || !p.out)
        moe_fail(std::string(who) + ": ids, weights, x and out are required");
    if (reinterpret_cast<uintptr_t>(workspace) % 256 != 0)
        moe_fail(std::string(who) + ": workspace must be 256-byte aligned");
}

}  // namespace

void moe_experts(const MoeExpertsParams& p, void* workspace, size_t workspace_bytes,
                 cudaStream_t stream) {
    check_launch(p, workspace, "moe_experts");
    if (moe_resolved_path(p) == MoePath::decode) {
        decode_experts(p, MoeDecodePart::all, workspace, workspace_bytes, stream);
    } else if (p.rms_norm) {
        moe_fail("moe_experts: the folded RMSNorm is supported on the decode path only (" +
                 std::to_string(p.n_tokens) + " tokens take the grouped path)");
    } else {
        grouped_experts(p, workspace, workspace_bytes, stream);
    }
}

void moe_decode_part(const MoeExpertsParams& p, MoeDecodePart part, void* workspace,
                     size_t workspace_bytes, cudaStream_t stream) {
    check_launch(p, workspace, "moe_decode_part");
    if (moe_resolved_path(p) != MoePath::decode)
        moe_fail("moe_decode_part: the parameters take the grouped path (" +
                 std::to_string(p.n_tokens) + " tokens)");
    decode_experts(p, part, workspace, workspace_bytes, stream);
}

void moe_grouped_stage(const MoeExpertsParams& p, MoeGroupedStage stage, void* workspace,
                       size_t workspace_bytes, cudaStream_t stream) {
    check_launch(p, workspace, "moe_grouped_stage");
    if (moe_resolved_path(p) != MoePath::grouped || p.rms_norm)
        moe_fail("moe_grouped_stage: the parameters take the decode path (" +
                 std::to_string(p.n_tokens) + " tokens)");
    grouped_stage(p, stage, workspace, workspace_bytes, stream);
}

}  // namespace minids::kernels
