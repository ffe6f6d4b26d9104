// mgl — the minids graph library: tensors, a recorded op graph, and backends that execute it.
//
// This header is the manual. mgl is ggml-shaped but smaller: a tensor is a plain struct (dtype,
// shape, strides, op, sources, data, name); an op constructor only *records* the op; a backend
// executes a finished graph with one switch over ops and says what it supports via supports_op.
//
// Conventions, settled once:
//   * Shapes are written OUTERMOST FIRST, row-major, exactly like PyTorch. A tensor of shape
//     [T, H, D] has D contiguous (stride[2] == element size for a contiguous tensor).
//     There is no hidden reversed dimension order anywhere in mgl.
//   * Strides are in BYTES, one per dimension, same order as the shape.
//   * A linear weight is stored [out, in] exactly as in the checkpoint, and matmul computes
//     y = x · Wᵀ:  x [..., M, K], W [..., N, K]  ->  y [..., M, N].
//   * Compute is FP32. Weights may be F32, BF16, or F8_E4M3 with one F32 scale per output row
//     (W_real[n, k] = e4m3_to_f32(W[n, k]) * scale[n]).
//   * Every op output is F32 unless documented otherwise (moe_topk gives I32).
//
// Worked example (y = rms_norm(x) · Wᵀ on the CPU):
//
//     mgl::context ctx;                                     // owns tensor structs, not data
//     mgl::tensor* x = ctx.new_tensor(mgl::dtype::f32, {4, 64}, "x");
//     mgl::tensor* w = ctx.new_tensor(mgl::dtype::bf16, {32, 64}, "w");
//     mgl::tensor* g = ctx.new_tensor(mgl::dtype::f32, {64}, "norm.weight");
//     w->data = mapped_weight_bytes;  g->data = ...;        // leaves point at caller memory
//     mgl::tensor* y = mgl::matmul(ctx, mgl::rms_norm(ctx, x, g, 1e-6f), w);
//     y->name = "y";
//     auto be = mgl::make_cpu_backend(/*n_threads=*/0);     // 0 = physical cores
//     mgl::graph gr = mgl::build_graph(ctx, {y});           // topological order
//     mgl::buffer_ptr inputs = be->alloc_buffer(mgl::nbytes(*x));
//     mgl::bind(*x, *inputs, 0);  be->upload(*x, host_x, 0, mgl::nbytes(*x));
//     be->allocate(gr);   // places intermediates in one arena, reusing dead buffers
//     be->compute(gr);  be->synchronize();
//     be->download(*y, host_y, 0, mgl::nbytes(*y));
//
// Views (view, reshape, permute, transpose, slice) never copy: they are nodes with op::view that
// alias their source's memory at an offset with new shape/strides. contiguous() copies.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <initializer_list>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

namespace mgl {

// ---------------------------------------------------------------------------------------------
// dtypes and scalar conversions
// ---------------------------------------------------------------------------------------------
// i64 holds addresses (the expert table of moe_experts) and is never a float.
enum class dtype : uint8_t { f32, f16, bf16, f8_e4m3, i32, i64 };

size_t dtype_size(dtype t);       // bytes per element
const char* dtype_name(dtype t);  // "f32", "f16", "bf16", "f8_e4m3", "i32", "i64"
bool dtype_from_name(const std::string& name, dtype& out);  // false if unknown

// BF16: round to nearest, ties to even; NaN stays NaN (quiet).
uint16_t f32_to_bf16(float f);
float bf16_to_f32(uint16_t h);
// IEEE half.
uint16_t f32_to_f16(float f);
float f16_to_f32(uint16_t h);
// FP8 E4M3 per the OCP FP8 spec (bias 7, no infinities, 0x7F/0xFF are NaN, max finite 448):
// round to nearest even, saturate to ±448, NaN stays NaN.
uint8_t f32_to_e4m3(float f);
float e4m3_to_f32(uint8_t v);
constexpr float e4m3_max = 448.0f;

// Convert n elements of `src_type` to f32 (used by get_rows, matmul reference paths, tests).
void to_f32(dtype src_type, const void* src, float* dst, size_t n);

// ---------------------------------------------------------------------------------------------
// ops
// ---------------------------------------------------------------------------------------------
enum class op : uint8_t {
    none,          // leaf: data provided by the caller (weights, inputs, KV pages)
    view,          // alias of src[0] at view_offset with this tensor's shape/strides
    get_rows,      // embedding lookup
    matmul,        // y = x · Wᵀ (W f32/bf16/f8_e4m3 + per-row scale)
    add,           // a + b, b broadcast over a's outer dims
    mul,           // a * b, same broadcasting
    scale,         // a * s
    rms_norm,      // w * x / sqrt(mean(x²) + eps) over the innermost dim
    rope,          // interleaved-pair rotary embedding (YaRN table)
    softmax,       // softmax over innermost dim, optional scale / causal mask with offset
    swiglu,        // silu(a) * b
    moe_topk,      // expert selection (greedy / group-limited greedy) -> I32 ids
    moe_weights,   // routing weights for selected ids
    moe_experts,   // Σ_k w_k · Expert_{id_k}(x) (+ shared expert), experts from an address table
    kv_store,      // write c and k_pe into the paged latent cache at the given positions
    mla_attn,      // absorbed MLA attention over the paged latent cache, causal by position
    cpy,           // copy/convert src[0] into dst layout (src[1]), returns src[1]'s alias
    contiguous,    // copy into a fresh contiguous f32 tensor
    concat,        // concatenate along a dim
    expert_fetch,  // the expert cache's device fetch: misses copied into slots before moe_experts
    expert_prompt_stage,  // a prompt chunk's misses copied into scratch buffers, a table to them
    count
};
const char* op_name(op o);

constexpr int max_dims = 4;
constexpr int max_srcs = 8;

// RoPE parameters, computed once from the model config (see rope_params_yarn / rope_params_plain).
struct rope_params {
    int n_dims = 0;               // rotary dims d (pairs = d/2), the innermost dim of x
    std::vector<float> inv_freq;  // d/2 inverse frequencies
    float attn_factor = 1.0f;     // cos and sin are multiplied by this (YaRN mscale ratio)
};
// Plain RoPE: inv_freq[i] = base^(-2i/d), attn_factor 1.
rope_params rope_params_plain(int n_dims, float base);
// DeepSeek's YaRN (DESIGN.md): ramp between interpolated and extrapolated frequencies,
// attn_factor = mscale(factor, mscale) / mscale(factor, mscale_all_dim).
rope_params rope_params_yarn(int n_dims, float base, float factor, int original_max_pos,
                             float beta_fast, float beta_slow, float mscale, float mscale_all_dim);
// mscale(s, m) = 1 if s <= 1 else 0.1·m·ln(s) + 1
float yarn_mscale(float scale, float m);

enum class topk_method : uint8_t { greedy, group_limited_greedy };
struct moe_route_params {
    int k = 1;  // experts per token
    topk_method method = topk_method::greedy;
    int n_group = 1;                     // group-limited: experts split into n_group equal groups,
    int topk_group = 1;                  // score = group max; keep best topk_group groups
    bool norm_topk_prob = false;         // if true and k > 1: w = s_k / Σ s_k
    float routed_scaling_factor = 1.0f;  // otherwise: w = s_k · routed_scaling_factor
};

// The routed experts of a MoE layer are SwiGLU MLPs, down(silu(gate(x)) * up(x)), with gate/up
// [n_ff, n_embd] and down [n_embd, n_ff] (row-major, [out, in]). Each expert is one blob of
// memory holding its parts at the same byte offsets for every expert (the .mds expert blob, or a
// GPU expert-cache slot holding a copy of one); F32 row scales (gate_scale [n_ff], up_scale [n_ff],
// down_scale [n_embd]) exist only when type == f8_e4m3. Where each blob is, is data: moe_experts
// reads blob addresses from a table tensor, so an expert cache moves experts by rewriting table
// entries, and a recorded graph never holds an expert address.
struct expert_layout {
    dtype type = dtype::bf16;  // f32, bf16 or f8_e4m3
    int64_t n_embd = 0;
    int64_t n_ff = 0;
    uint64_t gate = 0, up = 0, down = 0;                    // byte offsets inside a blob
    uint64_t gate_scale = 0, up_scale = 0, down_scale = 0;  // (f8_e4m3 only)
    uint64_t blob_bytes = 0;                                // bytes of one blob
};
// The shared experts of a MoE layer, one dense SwiGLU MLP: gate/up [n_ff, n_embd], down
// [n_embd, n_ff] (f32 or bf16). All null when the layer has none.
struct shared_expert {
    struct tensor* gate = nullptr;
    struct tensor* up = nullptr;
    struct tensor* down = nullptr;
};

// The state expert_fetch shares with the host that drives an expert cache, at the start of a
// buffer in the executing backend's memory (docs/expert-cache.md, "device fetch"). Addresses
// are in that backend's memory; a key is moe_layer · n_experts + expert.
struct expert_fetch_header {
    // Set by the host before a step; advanced by the step's expert_fetch ops.
    int64_t n_victims = 0;    // victims[0, n_victims) may be filled in this step, in that order
    int64_t next_victim = 0;  // victims taken or skipped so far (the host zeroes it)
    int64_t n_fills = 0;      // entries of fill_log written so far (the host zeroes it)
    int64_t layer_fills = 0;  // the first fill of the layer being fetched
    int64_t recycle = 0;      // 1: a miss may take this step's earlier arrival that ranks lower
    int64_t n_arrivals = 0;   // entries of arrivals written so far (the host zeroes it)
    // Time the step's MoE layers waited on their fetch (a device backend; the host zeroes all
    // three): each layer's plan start to its last copy's end, in ns of the device's global
    // timer. A layer's plan adds the previous layer's interval to fetch_ns, so after the step
    // the total is fetch_ns + (fetch_t1 - fetch_t0).
    int64_t fetch_ns = 0;
    int64_t fetch_t0 = 0, fetch_t1 = 0;
    // Victims after the launch (a device backend, a step launched as one graph: the host
    // replays the previous step while this one runs, docs/expert-cache.md "Victims after the
    // launch"): a fetch that would read the victims, their ranks or the key ranks first waits
    // until the word at victims_ready reaches this number. 0: they were written before the
    // step, nothing waits.
    int64_t victims_wanted = 0;
    // Fixed while the cache exists.
    int64_t n_layers = 0, n_experts = 0, n_slots = 0;
    int64_t blob_bytes = 0;
    int64_t slot_base = 0, slot_stride = 0;  // address of slot 0; bytes from one slot to the next
    int64_t tables = 0;        // [n_layers] i64: the address of each MoE layer's expert table
    int64_t homes = 0;         // [n_layers · n_experts] i64: where each expert lives off the slots
    int64_t victims = 0;       // [n_victims] i32: slots the host offers, best victim first
    int64_t slot_keys = 0;     // [n_slots] i32: the key of each slot's expert, or -1
    int64_t fill_log = 0;      // [n_slots] pairs of i32 (key, slot), in the order they were filled
    int64_t victim_ranks = 0;  // [n_victims] expert_fetch_rank of victims[i] (free: -inf)
    int64_t key_ranks = 0;     // [n_layers · n_experts] expert_fetch_rank a key takes on arrival
    int64_t arrivals = 0;      // [n_slots] i32: slots filled in this step (-1: taken again)
    // [n_layers · id_log_stride] i32, or 0: each layer's fetch copies the ids it read here when
    // they fit (a decoded token's k), so the host downloads a step's routing with the fill log
    // in one copy instead of one per layer.
    int64_t id_log = 0;
    int64_t id_log_stride = 0;
    // Prefetch by the copy engines (a device backend; 0: the fetch's copy kernel copies a
    // prefetch like a miss): the address of an expert_prefetch_ring in host memory the device
    // can write, whose requests a host thread turns into copies on a stream of its own
    // (ExpertOffload's prefetch proxy, docs/expert-cache.md). Kept across steps, never zeroed:
    int64_t proxy_ring = 0;
    int64_t proxy_posted = 0;  // requests the prefetches posted so far (the device advances it)
    int64_t proxy_done = 0;    // requests whose copy has landed (the host's copy stream writes it)
    int64_t proxy_error = 0;   // 1: a fetch gave up waiting for the copies (the proxy is gone)
    // 1: each layer's own fills go to the proxy too, not only the prefetches' (the host sets it
    // with the ring; only fetches being captured post, as for a prefetch).
    int64_t proxy_demand = 0;
    // Victims after the launch (see victims_wanted), kept across steps: the address of a block of
    // pinned host memory (0: off) whose first i64 is the number of the last step whose victims
    // the host has written after it, followed by those victims, their ranks and the key ranks
    // laid out as from `victims` on; the number of the last step whose victims a fetch has
    // copied from there into this buffer; and 1 when a fetch gave up waiting for them (after
    // 2 s; it then filled nothing and its misses were read in place).
    int64_t victims_ready = 0;
    int64_t victims_copied = 0;
    int64_t victims_late = 0;
    // A layer's fetch that leaves its wait to the prefetch right after it (the CUDA backend's
    // one-stream schedule, kernels::ExpertFetchParams::defer_wait): the requests posted up to and
    // including its own fills, which that prefetch waits for after posting its own behind them,
    // and 1 when the layer had fills (its fetch interval then ends at that wait). Written by the
    // fetch before the prefetch reads it, in every step that defers.
    int64_t proxy_wait_mark = 0;
    int64_t proxy_wait_fills = 0;
};
// One prefetch the device asks the host to copy: expert `key` into slot `slot`.
struct expert_prefetch_request {
    int32_t key = 0, slot = 0;
};
// The requests ring: request i (counted from 0 since the cache began) is at i % capacity; the
// device writes the request, then `posted` = i + 1 (release, system scope). The device never
// has more than `capacity` requests unserved (the host sizes the ring for the most a step leaves
// unserved: ExpertOffload::set_prefetch).
struct expert_prefetch_ring {
    int64_t posted = 0;
    int64_t capacity = 0;
    expert_prefetch_request requests[1];  // [capacity]
};
inline constexpr size_t expert_prefetch_ring_bytes(int64_t capacity) {
    return offsetof(expert_prefetch_ring, requests) +
           size_t(capacity) * sizeof(expert_prefetch_request);
}
// The header's words a host sets before every step: the counters, n_victims to victims_wanted.
inline constexpr size_t expert_fetch_counter_words =
    offsetof(expert_fetch_header, n_layers) / sizeof(int64_t);
// A slot's place in the cache policy's eviction order: the lower (priority, then stamp) goes
// first.
struct expert_fetch_rank {
    double priority = 0;
    uint64_t stamp = 0;
};
// Set in a fill-log key by a prefetch (expert_prefetch): the host tells its fills from the
// layer's own. Keys stay below it (n_layers · n_experts < 2^30).
inline constexpr int32_t expert_fetch_prefetched = int32_t(1) << 30;
inline bool ranks_lower(const expert_fetch_rank& a, const expert_fetch_rank& b) {
    return a.priority < b.priority || (a.priority == b.priority && a.stamp < b.stamp);
}

// The stage of a fetch from a host store the device cannot read (the expert cache's staging
// store, docs/expert-cache.md: the experts stay in pageable host memory, nothing registered):
// pinned host memory the device reads and writes (mapped; with unified addressing its host
// address is its device address), laid out as this header, then int64 src[capacity] (the
// sources, expert_stage_sources), then `capacity` buffers of blob_bytes, `stride` apart from
// `buffer_offset` (both multiples of 256). A layer's fetch posts its fills here (n and each
// fill's home), the host copies home -> buffer i (expert_stage_serve), then the device copies
// buffer i -> the fill's slot.
struct expert_stage_header {
    int64_t capacity = 0;       // buffers: the most fills one layer's fetch may post
    int64_t blob_bytes = 0;     // bytes of one expert
    int64_t stride = 0;         // bytes from one buffer to the next
    int64_t buffer_offset = 0;  // bytes from the header to buffer 0
    int64_t n = 0;              // fills the current layer posted, in its fill-log order
};
inline int64_t* expert_stage_sources(expert_stage_header* h) {
    return reinterpret_cast<int64_t*>(h + 1);
}
inline uint8_t* expert_stage_buffer(expert_stage_header* h, int64_t i) {
    return reinterpret_cast<uint8_t*>(h) + h->buffer_offset + i * h->stride;
}
// The header of a stage of `capacity` buffers for experts of `blob_bytes`, and the bytes it
// spans (header, sources and buffers).
expert_stage_header expert_stage_layout(int64_t capacity, int64_t blob_bytes);
size_t expert_stage_bytes(const expert_stage_header& h);
// The host's part of a staged fetch: copies each posted fill's home into its buffer (several
// threads). Makes no backend calls, so a CUDA host node may run it between two kernels.
void expert_stage_serve(expert_stage_header& h);

struct buffer;

struct tensor {
    dtype type = dtype::f32;
    int n_dims = 0;
    std::array<int64_t, max_dims> shape{};   // outermost first; unused dims are 1
    std::array<int64_t, max_dims> stride{};  // bytes, same order as shape
    op op_kind = op::none;
    std::array<tensor*, max_srcs> src{};
    // Op parameters (only the fields the op uses are meaningful).
    std::array<int32_t, 8> iparams{};
    std::array<float, 8> fparams{};
    std::shared_ptr<const rope_params> rope;       // op::rope
    std::shared_ptr<const expert_layout> experts;  // op::moe_experts, op::expert_fetch
    size_t view_offset = 0;                        // op::view: byte offset into src[0]
    void* data = nullptr;   // resolved address (host or device, per the owning backend)
    buffer* buf = nullptr;  // owning buffer, or null for caller memory
    std::string name;

    int64_t nelements() const;
    bool is_contiguous() const;
    int64_t dim(int i) const { return shape[size_t(i)]; }
};

size_t nbytes(const tensor& t);          // bytes spanned by a contiguous tensor of t's shape/dtype
std::string shape_str(const tensor& t);  // "[4, 64]"

// Owns tensor structs (not their data). Pointers stay valid for the context's lifetime.
class context {
public:
    tensor* new_tensor(dtype type, std::initializer_list<int64_t> shape, std::string name = {});
    tensor* new_tensor(dtype type, std::span<const int64_t> shape, std::string name = {});
    tensor* new_node(op o, dtype type, std::span<const int64_t> shape);  // contiguous strides
    size_t size() const { return tensors_.size(); }
    void clear() { tensors_.clear(); }

private:
    std::deque<tensor> tensors_;
};

// ----- views (no copy) -----
tensor* view(context& c, tensor* a, std::span<const int64_t> shape, std::span<const int64_t> stride,
             size_t byte_offset);
tensor* reshape(context& c, tensor* a,
                std::initializer_list<int64_t> shape);                    // a must be contiguous
tensor* permute(context& c, tensor* a, std::initializer_list<int> axes);  // like torch.permute
tensor* transpose(context& c, tensor* a, int dim0, int dim1);
// Slice [start, start+len) along dim.
tensor* slice(context& c, tensor* a, int dim, int64_t start, int64_t len);

// ----- compute ops -----
// Every op output is a fresh contiguous tensor unless said otherwise; inputs may be strided views.
// Parameter slots each op records (what a backend reads): scale: fparams[0] = s. rms_norm:
// src = {x, w}, fparams[0] = eps. softmax: fparams[0] = scale, iparams = {causal, n_past}.
// matmul: src = {x, w, w_scale}. get_rows: src = {table, ids, table_scale}. moe_topk: iparams =
// {k, method, n_group, topk_group}. moe_weights: iparams = {k, norm_topk_prob}, fparams[0] =
// routed_scaling_factor. moe_experts: src = {x, ids, w, table, shared gate, shared up, shared
// down}, experts (the layout). kv_store: src = {pages, page_table, kv_c, k_pe, positions}.
// mla_attn: src = {q_lat, q_pe, pages, page_table, positions}, fparams[0] = scale.
// cpy: src = {src, dst}. concat: iparams[0] = dim. expert_fetch: src = {table, ids, state,
// stage (or null), protect (or null), after (or null)}, iparams = {layer, prefetch (0/1),
// protect_layer, max_fills}, experts (the layout). expert_prompt_stage: src = {table, ids, state,
// buffers}, iparams[0] = capacity (buffers' size less the count), experts (the layout).
//
// Values that change from one decode step to the next (token ids, positions, the page table, the
// expert table, routing overrides) are always tensors, never op parameters: a graph recorded once
// is then valid for every step, and a backend may replay it (e.g. as a CUDA graph) after the
// caller rewrites those tensors' contents.
// table [V, D] (any float dtype; f8 rows use scale [V] if given) , ids [T] i32 -> [T, D] f32.
// The table may be a strided view. An id outside [0, V) is an error at compute time.
tensor* get_rows(context& c, tensor* table, tensor* ids, tensor* table_scale = nullptr);
// x [..., M, K] f32, w [N, K] or [B, N, K] (f32 | bf16 | f8_e4m3 with w_scale [N] or [B, N])
// -> [..., M, N]. When w has a batch dim, x's dim -3 must equal it. w may be a strided view.
tensor* matmul(context& c, tensor* x, tensor* w, tensor* w_scale = nullptr);
tensor* add(context& c, tensor* a, tensor* b);
tensor* mul(context& c, tensor* a, tensor* b);
tensor* scale(context& c, tensor* a, float s);
// x [..., D], w [D] (f32 | bf16) or null -> [..., D]
tensor* rms_norm(context& c, tensor* x, tensor* w, float eps);
// x [T, H, d] or [T, d] (d == p.n_dims), positions [T] i32. Pairs (2i, 2i+1):
// (a, b) -> (a·cos − b·sin, a·sin + b·cos), angle pos · inv_freq[i], cos/sin · attn_factor.
tensor* rope(context& c, tensor* x, tensor* positions, std::shared_ptr<const rope_params> p);
// Softmax over the innermost dim of x·scale. With causal, x is [..., Tq, Tk] and query i may see
// keys j <= i + n_past (others get probability 0).
tensor* softmax(context& c, tensor* x, float scale = 1.0f, bool causal = false, int n_past = 0);
tensor* swiglu(context& c, tensor* a, tensor* b);
// probs [T, E] f32 -> ids [T, k] i32 (descending by prob; ties: lower id first).
tensor* moe_topk(context& c, tensor* probs, const moe_route_params& p);
// probs [T, E], ids [T, k] -> weights [T, k] f32 per DESIGN.md's weighting rules.
tensor* moe_weights(context& c, tensor* probs, tensor* ids, const moe_route_params& p);
// x [T, D], ids [T, k] i32, w [T, k] f32, table [E] i64 (address of expert e's blob, in memory
// the executing backend reads: host for the CPU, device or registered host memory for CUDA)
// -> [T, D] f32 = Σ_k w · Expert_{ids}(x) + Shared(x). An id outside [0, E) is an error at
// compute time (the CPU checks; kernels clamp nothing and must not be given one).
tensor* moe_experts(context& c, tensor* x, tensor* ids, tensor* w, tensor* table,
                    std::shared_ptr<const expert_layout> layout, shared_expert shared = {});
// The expert cache's device fetch for MoE layer `layer` (its index among the tables of
// `state`, an i64 tensor whose memory starts with an expert_fetch_header). Every distinct
// expert e of ids ([T, k] i32), in increasing order, whose table entry ([E] i64) is its home
// (not a slot) takes a slot: the next victim the host offered that this layer does not read
// (one it reads is passed over for good), unless `recycle` is set and an earlier arrival of
// this step from another layer ranks lower (key_ranks of its expert against victim_ranks of
// the victim), which is then taken instead. The expert's blob is copied from its home into the
// slot, its entry pointed at the slot, the slot's previous expert's entry pointed home (in
// whichever layer's table), (key, slot) appended to the fill log and the slot to the arrivals.
// With no slot to take the entry stays home and moe_experts reads the expert in place. The ids
// are copied to the state's id log when they fit its stride. Returns
// an alias of `table` that moe_experts must take, which orders the fetch before the read.
// With a `stage` (an i64 tensor whose memory starts with an expert_stage_header; the staging
// store) the homes are host addresses the executing device cannot read: every miss must get a
// slot (the host offers enough victims; a miss left home would be a read in place of memory the
// device cannot read), and each fill goes home -> stage buffer i (by the host, in the layer's
// fill order) -> its slot (by the device). At most `capacity` fills per layer.
tensor* expert_fetch(context& c, tensor* table, tensor* ids, tensor* state, int layer,
                     std::shared_ptr<const expert_layout> layout, tensor* stage = nullptr);
// A prefetch (docs/expert-cache.md, "Prefetch"): expert_fetch for MoE layer `layer` on
// predicted `ids` ([T, k] i32), run before that layer's own fetch, with these differences:
// the victims it passes over also hold the experts `protect` ([T, k] i32) of MoE layer
// `protect_layer` (the layer whose expert kernels may run beside it: the CUDA backend runs a
// prefetch on a side stream), no earlier arrival is taken again, the id log is not written, no
// stage (the staging store has none), and each fill's key in the fill log carries
// expert_fetch_prefetched. `after` only orders it (the previous layer's fetch). With
// `max_fills` > 0 it fills at most that many: the first misses in the order of `ids` (a
// prediction's ranks, best first), still in increasing expert order; the other predicted
// experts are passed over as victims all the same. Returns an alias of `table` that the layer's
// own expert_fetch must take.
tensor* expert_prefetch(context& c, tensor* table, tensor* ids, tensor* state, int layer,
                        std::shared_ptr<const expert_layout> layout, tensor* protect,
                        int protect_layer, tensor* after, int max_fills = 0);
inline bool is_expert_prefetch(const tensor& t) {
    return t.op_kind == op::expert_fetch && t.iparams[1] != 0;
}
// The expert cache's prompt stage (docs/expert-cache.md, "Prefill"): a copy of `table` ([E] i64,
// an expert_fetch's result) in which the first n distinct experts of ids ([T, k] i32), in
// increasing order, whose entry is not a slot of `state` (so moe_experts would read them in place
// from host memory) point at buffer i instead, with their blob copied there from the entry's
// address. `buffers` ([1 + capacity] i64, backend memory; its size is the capacity) holds n (at
// most capacity; more is read as capacity) and then the buffers' addresses, written by the
// caller before the step: the
// expert cache lends slots it holds no expert in, or whose expert it copies back after the
// step. The table itself is not written, so the cache's bookkeeping never sees the buffers; the
// next layer's stage (run after this layer's moe_experts) overwrites them. Why: the grouped
// prompt kernels read a host blob at about half the rate a copy moves it.
tensor* expert_prompt_stage(context& c, tensor* table, tensor* ids, tensor* state,
                            std::shared_ptr<const expert_layout> layout, tensor* buffers);

// Paged latent KV cache of one layer: `pages` [n_pages, page_size, kv_lora_rank + rope] f32 (or
// bf16 / f16: stored rounded to nearest even, read back to f32), and
// `page_table` [max_logical_pages] i32 mapping logical page p (positions p·page_size ..) to a
// physical page index. kv_store writes c [T, r] and k_pe [T, rope] of token t at position
// positions[t] ([T] i32) and returns an alias of `pages` that later readers must take as their
// source (this is how the graph orders the write before the read). A position outside the page
// table is an error at compute time.
tensor* kv_store(context& c, tensor* pages, tensor* page_table, tensor* kv_c, tensor* k_pe,
                 tensor* positions);
// Absorbed MLA: q_lat [T, H, r], q_pe [T, H, rope], pages (from kv_store), page_table, positions
// [T] i32. Query t attends to the cache rows s = 0 .. positions[t] (causal):
// score(s) = (q_lat·c_s + q_pe·k_pe_s)·scale, softmax, o_lat = Σ p_s c_s  -> [T, H, r] f32.
tensor* mla_attn(context& c, tensor* q_lat, tensor* q_pe, tensor* pages, tensor* page_table,
                 tensor* positions, float scale);
// Copy src into dst's layout/dtype (f32 -> f32|bf16|f16). Returns an alias of dst.
tensor* cpy(context& c, tensor* src, tensor* dst);
tensor* contiguous(context& c, tensor* a);
tensor* concat(context& c, tensor* a, tensor* b, int dim);

// ---------------------------------------------------------------------------------------------
// graph
// ---------------------------------------------------------------------------------------------
struct arena;
struct graph {
    std::vector<tensor*> nodes;    // execution order (topological; sources before users)
    std::vector<tensor*> leafs;    // op::none tensors reached
    std::vector<tensor*> outputs;  // as given to build_graph; never reused by the allocator
    // Set by the caller when the graph will be computed many times with only the contents of its
    // input tensors changing (a decode step): a backend may then record it once and replay the
    // recording (the CUDA backend captures a CUDA graph). Changing the graph's structure or any
    // tensor's address requires allocate() again, which invalidates recordings.
    bool reusable = false;
    // Unique in the process; renewed by build_graph and every allocate(), so a backend can key
    // what it recorded for a graph by it.
    uint64_t version = 0;
    // Where allocate() placed the intermediates, and that arena's generation at the time: a graph
    // whose arena has grown since is stale and compute() refuses it.
    arena* placed_in = nullptr;
    uint64_t arena_generation = 0;
};
// Depth-first from outputs; each node once; sources in order.
graph build_graph(context& c, std::initializer_list<tensor*> outputs);
graph build_graph(context& c, std::span<tensor* const> outputs);
// The same, with the nodes `first` (and what they need) placed before the rest, in that order:
// a schedule the topological order alone would not give (they are not outputs).
graph build_graph(context& c, std::span<tensor* const> outputs, std::span<tensor* const> first);
uint64_t new_graph_version();

// Plan memory for the graph's intermediates: each non-view node without data gets an offset in
// one arena; a node's memory is released after its last consumer runs and reused by later nodes
// (outputs are kept alive). Returns the arena size. Backends call this inside allocate().
// `also_reads` is for backends that fuse nodes: a pair (node, t) says that when `node`'s step runs
// it also reads t (a fused group runs at the step of its last member, reading the sources of every
// member), so t's memory stays live, and is not reused, until that step.
struct alloc_plan {
    size_t arena_bytes = 0;
    std::vector<std::pair<tensor*, size_t>> offsets;  // node -> byte offset in arena
};
alloc_plan plan_allocation(const graph& g, size_t alignment = 64,
                           std::span<const std::pair<tensor*, tensor*>> also_reads = {});

struct buffer;
// The tensor whose memory t aliases: src[0] for view, kv_store and expert_fetch, src[1] (dst) for
// cpy; else null.
tensor* alias_source(const tensor& t);
// Point every planned node into `arena` and resolve alias nodes (view/kv_store/cpy/expert_fetch) to
// their source's address. Checks that every leaf has data. Backends call this inside allocate().
void apply_plan(graph& g, const alloc_plan& plan, buffer& arena);
// Forget the placements of an earlier apply_plan into `arena` (views and planned nodes), so the
// graph can be planned again.
void clear_plan(graph& g, const buffer* arena);

// ---------------------------------------------------------------------------------------------
// backends
// ---------------------------------------------------------------------------------------------
// Where a buffer's memory is. `host` is ordinary host memory, `pinned_host` host memory that a
// device copies to and from at full speed, `device` memory of an accelerator (its base() is only
// meaningful to that backend's kernels and copies).
enum class memory_kind : uint8_t { host, pinned_host, device };
const char* memory_kind_name(memory_kind k);

// A block of memory owned by a backend.
struct buffer {
    virtual ~buffer() = default;
    virtual void* base() = 0;
    virtual size_t size() const = 0;
    virtual memory_kind kind() const = 0;
};
using buffer_ptr = std::unique_ptr<buffer>;
// Point t at buf + offset (t->data, t->buf).
void bind(tensor& t, buffer& buf, size_t offset);

// Host memory the caller owns (a read-only file mapping, say), registered with a backend so that
// copies from it run at full speed and kernels may read it directly. Unregistered on destruction.
struct host_registration {
    virtual ~host_registration() = default;
    // The address kernels of the backend use for host address p inside the registered range.
    virtual const void* device_address(const void* p) const = 0;
};

// Bulk host -> backend copies queued beside compute() (CUDA: a stream of their own), for
// filling memory that no queued or running graph reads. Copies run in the order queued; fence()
// marks those queued so far and done() says, without waiting, whether a fence has passed.
// Nothing orders these copies with compute(): the caller keeps graphs away from the memory
// until done(fence). Sources must stay valid and unchanged until then.
class transfer_queue {
public:
    virtual ~transfer_queue() = default;
    virtual void copy(void* dst, const void* src, size_t n) = 0;
    virtual uint64_t fence() = 0;
    virtual bool done(uint64_t fence) = 0;
    // Waits for every queued copy.
    virtual void drain() = 0;
    // Queues a write of `value` to the 8-byte word at `word` (backend memory), done once every
    // copy queued before it has landed: a signal that the backend's kernels can poll.
    virtual void signal(int64_t* word, int64_t value) = 0;
};

// Memory for the intermediates of graphs. It only grows: when a larger graph is allocated into
// it, its buffer is replaced and graphs placed in it before become stale (allocate them again).
// A caller that computes graphs alternately (a prefill graph and the decode graph) gives each its
// own arena so neither invalidates the other.
struct arena {
    buffer_ptr buf;
    uint64_t generation = 0;  // bumped whenever buf is replaced
};

class backend {
public:
    virtual ~backend() = default;
    virtual const char* name() const = 0;
    virtual bool supports_op(const tensor& node) const = 0;
    // Where compute() reads and writes tensors. Leaves with no buffer (caller memory) must be
    // readable there: host memory for the CPU backend; device or registered host memory for CUDA.
    virtual memory_kind compute_memory() const = 0;

    // Memory compute() works in (device memory for CUDA).
    virtual buffer_ptr alloc_buffer(size_t bytes) = 0;
    // Host memory the backend copies to and from fastest (pinned for CUDA); base() is a host
    // pointer.
    virtual buffer_ptr alloc_host_buffer(size_t bytes) = 0;
    // Staging kept by a caller across calls: `buf`'s base, reallocated with alloc_host_buffer when
    // it is null or smaller than `bytes`.
    void* host_staging(buffer_ptr& buf, size_t bytes) {
        if (!buf || buf->size() < bytes) buf = alloc_host_buffer(bytes);
        return buf->base();
    }
    // Registers existing host memory [p, p + n); null when the backend or the system refuses (the
    // caller then copies through alloc_host_buffer staging). The CPU backend needs nothing and
    // returns an identity registration.
    virtual std::unique_ptr<host_registration> register_host(const void* p, size_t n,
                                                             bool read_only) = 0;

    // A queue of copies beside compute(). The default copies at once (copy_to_backend), so
    // every fence is done when it is made: right for a backend that computes synchronously.
    virtual std::unique_ptr<transfer_queue> make_transfer_queue();

    // Copies between host memory and a tensor's memory, ordered with compute() in one queue. The
    // blocking forms return when the copy is done. upload_async returns at once: `src` must stay
    // valid and unchanged until the next synchronize() or blocking copy.
    virtual void upload(tensor& t, const void* src, size_t offset, size_t n) = 0;
    virtual void upload_async(tensor& t, const void* src, size_t offset, size_t n) = 0;
    virtual void download(const tensor& t, void* dst, size_t offset, size_t n) = 0;
    // The same, returning at once: `dst` (best an alloc_host_buffer() buffer, else the copy may
    // wait) holds the bytes after the next synchronize(). Several of them cost one wait.
    virtual void download_async(const tensor& t, void* dst, size_t offset, size_t n) {
        download(t, dst, offset, n);
    }
    // Blocking bulk copy from host memory into backend memory (dst inside one of its buffers).
    virtual void copy_to_backend(void* dst, const void* src, size_t n) = 0;
    // The same, returning at once: `src` (best an alloc_host_buffer() buffer) must stay valid and
    // unchanged until the next synchronize().
    virtual void copy_to_backend_async(void* dst, const void* src, size_t n) = 0;

    // Places the graph's intermediates in `a` (growing it if needed), resolves view addresses and
    // checks every leaf has memory. A graph must be allocated before compute().
    virtual void allocate(graph& g, arena& a) = 0;
    // Same, in the backend's own arena, for one-off graphs: a graph placed there is stale after
    // the next allocate() that grows it.
    void allocate(graph& g) { allocate(g, own_arena_); }
    // Runs the graph; may return before it is done (CUDA). Results are ready after synchronize()
    // or a blocking download.
    virtual void compute(graph& g) = 0;
    // Whether compute(g) would queue the whole graph at once, before any of it runs (CUDA: a
    // recorded graph's replay, or its capture and launch), so the host may still write, after
    // compute() returns, inputs its kernels wait for. False: the host queues kernel by kernel (and
    // may block between them) or runs them itself.
    virtual bool launches_whole(const graph&) const { return false; }
    virtual void synchronize() = 0;

protected:
    // Shared by backends: refuse a graph whose arena grew after it was allocated.
    static void check_not_stale(const graph& g);

private:
    arena own_arena_;
};

// The CPU backend is the readable reference: each op is a plain loop over rows, split across a
// thread pool the backend owns (static chunks, the caller's thread works too). matmul streams
// weights through SIMD row kernels chosen at run time (AVX-512, AVX2+FMA+F16C, or scalar), so a
// portable build is still fast. Leaves may point at any host memory, an mmapped file included.
// n_threads <= 0: number of physical cores.
std::unique_ptr<backend> make_cpu_backend(int n_threads = 0);
int physical_cores();

// Internal faults (never user errors): throw mgl::error with file:line.
struct error : std::runtime_error {
    using std::runtime_error::runtime_error;
};
[[noreturn]] void fail(const char* file, int line, const std::string& msg);
#define MGL_CHECK(cond, msg)                                 \
    do {                                                     \
        if (!(cond)) ::mgl::fail(__FILE__, __LINE__, (msg)); \
    } while (0)

}  // namespace mgl
