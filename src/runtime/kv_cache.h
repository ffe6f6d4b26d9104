// The paged latent KV cache of MLA (DESIGN.md "The KV cache stores ...").
//
// Per token and layer it holds what the absorbed attention reads: c (the compressed KV after
// kv_a_layernorm, kv_lora_rank values) and k_pe (the rope key after RoPE, qk_rope_head_dim
// values), side by side in one row of `width = kv_lora_rank + rope` values, F32, BF16 or F16.
//
// Memory is a pool of fixed-size pages (page_size tokens each), one pool per layer, all layers
// sharing the same page numbering:
//
//     layer pool      [n_pages, page_size, width]   f32 | bf16 | f16, in one backend buffer
//     page table      [max_pages_per_seq]           i32, logical page p -> physical page
//
// A sequence owns a list of physical pages; position `pos` lives in page table[pos / page_size]
// at row pos % page_size. Pages are taken from a free list as a sequence grows and given back
// when it is truncated or freed, so sequences of different lengths share one pool. The graph
// reads and writes the pool through mgl::kv_store / mgl::mla_attn; this class only does the
// bookkeeping and hands out leaf tensors that alias its memory.
//
// The page tables have a host copy; reserve() and truncate() change it and sync() uploads what
// changed, as its own step before a graph runs (never while one is being recorded), so a
// recorded decode graph that reads the table from backend memory stays valid across steps.
#pragma once

#include <cstdint>
#include <vector>

#include "mgl.h"

namespace minids {

struct KvCacheParams {
    int64_t n_layer = 0;
    int64_t kv_lora_rank = 0;
    int64_t rope_dim = 0;
    int64_t n_ctx = 0;                  // longest sequence, in tokens
    int64_t page_size = 64;             // tokens per page
    int64_t n_pages = 0;                // pool size; 0: enough for one sequence of n_ctx
    int max_sequences = 4;              // page-table slots
    mgl::dtype type = mgl::dtype::f32;  // f32, bf16 or f16 rows
};

class LatentKvCache {
public:
    LatentKvCache(mgl::backend& backend, const KvCacheParams& params);
    LatentKvCache(const LatentKvCache&) = delete;
    LatentKvCache& operator=(const LatentKvCache&) = delete;

    // Sequences are small integers; a fresh one is empty.
    int new_sequence();
    void free_sequence(int seq);
    int64_t length(int seq) const;  // tokens stored
    int64_t n_ctx() const { return params_.n_ctx; }
    int64_t page_size() const { return params_.page_size; }
    int64_t width() const { return params_.kv_lora_rank + params_.rope_dim; }
    int64_t free_pages() const { return int64_t(free_pages_.size()); }
    size_t bytes() const;  // the whole pool over all layers
    mgl::dtype type() const { return params_.type; }
    int64_t max_pages_per_seq() const { return max_pages_per_seq_; }

    // Makes room for positions [length, length + n_new) (takes pages as needed). Throws
    // mgl::error when the sequence would pass n_ctx or the pool runs out: callers check the
    // context limit first and report it to the user.
    void reserve(int seq, int64_t n_new);
    // Marks n_new more positions as written (after the graph that writes them has run).
    void advance(int seq, int64_t n_new);
    // Keeps positions [0, n) and gives back the pages beyond them.
    void truncate(int seq, int64_t n);

    // Leaf tensors aliasing the cache, for graphs in `ctx`. Their addresses never change.
    mgl::tensor* layer_pages(mgl::context& ctx, int64_t layer);
    mgl::tensor* page_table(mgl::context& ctx, int seq);
    // Uploads the sequence's page table if reserve() or truncate() changed it since the last
    // sync; ordered before the next compute on the backend's queue.
    void sync(int seq);

    // Copies the stored row (c then k_pe, `width` floats) of one position, for tests and dumps.
    void read_row(int seq, int64_t layer, int64_t pos, float* out) const;

private:
    struct Sequence {
        bool in_use = false;
        int64_t length = 0;
        std::vector<int32_t> pages;  // physical page per logical page
        bool table_dirty = true;     // host table differs from the uploaded one
    };
    Sequence& sequence(int seq);
    const Sequence& sequence(int seq) const;
    size_t layer_bytes() const;

    mgl::backend& backend_;
    KvCacheParams params_;
    int64_t max_pages_per_seq_ = 0;
    mgl::buffer_ptr pool_;         // n_layer pools back to back
    mgl::buffer_ptr page_tables_;  // one [max_pages_per_seq] i32 table per sequence slot
    mgl::buffer_ptr host_tables_;  // their host copies (pinned for a device backend)
    std::vector<int32_t> free_pages_;
    std::vector<Sequence> seqs_;
};

}  // namespace minids
