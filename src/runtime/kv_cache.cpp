#include "runtime/kv_cache.h"

#include <algorithm>
#include <cstring>
#include <string>

namespace minids {

LatentKvCache::LatentKvCache(mgl::backend& backend, const KvCacheParams& params)
    : backend_(backend), params_(params) {
    MGL_CHECK(params_.n_layer > 0 && params_.kv_lora_rank > 0 && params_.rope_dim > 0,
              "kv cache: layer count and widths must be positive");
    MGL_CHECK(params_.n_ctx > 0 && params_.page_size > 0 && params_.max_sequences > 0,
              "kv cache: n_ctx, page_size and max_sequences must be positive");
    max_pages_per_seq_ = (params_.n_ctx + params_.page_size - 1) / params_.page_size;
    if (params_.n_pages <= 0) params_.n_pages = max_pages_per_seq_;
    MGL_CHECK(params_.n_pages <= INT32_MAX, "kv cache: too many pages");
    MGL_CHECK(params_.type == mgl::dtype::f32 || params_.type == mgl::dtype::bf16 ||
                  params_.type == mgl::dtype::f16,
              std::string("kv cache: rows must be f32, bf16 or f16, got ") +
                  mgl::dtype_name(params_.type));
    pool_ = backend_.alloc_buffer(layer_bytes() * size_t(params_.n_layer));
    const size_t table_bytes =
        size_t(params_.max_sequences) * size_t(max_pages_per_seq_) * sizeof(int32_t);
    page_tables_ = backend_.alloc_buffer(table_bytes);
    host_tables_ = backend_.alloc_host_buffer(table_bytes);
    // Unused entries point at page 0: a valid page, never read below a sequence's length.
    std::memset(host_tables_->base(), 0, table_bytes);
    // Hand out low page numbers first (pop from the back).
    free_pages_.resize(size_t(params_.n_pages));
    for (int64_t i = 0; i < params_.n_pages; ++i)
        free_pages_[size_t(i)] = int32_t(params_.n_pages - 1 - i);
    seqs_.resize(size_t(params_.max_sequences));
}

size_t LatentKvCache::layer_bytes() const {
    return size_t(params_.n_pages) * size_t(params_.page_size) * size_t(width()) *
           mgl::dtype_size(params_.type);
}

size_t LatentKvCache::bytes() const { return layer_bytes() * size_t(params_.n_layer); }

LatentKvCache::Sequence& LatentKvCache::sequence(int seq) {
    MGL_CHECK(seq >= 0 && size_t(seq) < seqs_.size() && seqs_[size_t(seq)].in_use,
              "kv cache: no sequence " + std::to_string(seq));
    return seqs_[size_t(seq)];
}

const LatentKvCache::Sequence& LatentKvCache::sequence(int seq) const {
    MGL_CHECK(seq >= 0 && size_t(seq) < seqs_.size() && seqs_[size_t(seq)].in_use,
              "kv cache: no sequence " + std::to_string(seq));
    return seqs_[size_t(seq)];
}

int LatentKvCache::new_sequence() {
    for (size_t i = 0; i < seqs_.size(); ++i) {
        if (!seqs_[i].in_use) {
            seqs_[i] = Sequence{true, 0, {}, true};
            return int(i);
        }
    }
    mgl::fail(__FILE__, __LINE__,
              "kv cache: all " + std::to_string(seqs_.size()) + " sequence slots in use");
}

void LatentKvCache::free_sequence(int seq) {
    truncate(seq, 0);
    sequence(seq).in_use = false;
}

int64_t LatentKvCache::length(int seq) const { return sequence(seq).length; }

void LatentKvCache::reserve(int seq, int64_t n_new) {
    Sequence& s = sequence(seq);
    MGL_CHECK(n_new >= 0, "kv cache: negative reserve");
    const int64_t end = s.length + n_new;
    MGL_CHECK(end <= params_.n_ctx, "kv cache: " + std::to_string(end) +
                                        " tokens exceed the context of " +
                                        std::to_string(params_.n_ctx));
    const int64_t pages_needed = (end + params_.page_size - 1) / params_.page_size;
    MGL_CHECK(pages_needed - int64_t(s.pages.size()) <= int64_t(free_pages_.size()),
              "kv cache: out of pages (" + std::to_string(free_pages_.size()) + " free)");
    while (int64_t(s.pages.size()) < pages_needed) {
        s.pages.push_back(free_pages_.back());
        free_pages_.pop_back();
        s.table_dirty = true;
    }
}

void LatentKvCache::advance(int seq, int64_t n_new) {
    Sequence& s = sequence(seq);
    MGL_CHECK(n_new >= 0 && (s.length + n_new + params_.page_size - 1) / params_.page_size <=
                                int64_t(s.pages.size()),
              "kv cache: advance past the reserved pages");
    s.length += n_new;
}

void LatentKvCache::truncate(int seq, int64_t n) {
    Sequence& s = sequence(seq);
    MGL_CHECK(n >= 0 && n <= s.length, "kv cache: truncate to " + std::to_string(n) + " of " +
                                           std::to_string(s.length) + " tokens");
    s.length = n;
    const int64_t keep = (n + params_.page_size - 1) / params_.page_size;
    while (int64_t(s.pages.size()) > keep) {
        free_pages_.push_back(s.pages.back());
        s.pages.pop_back();
        s.table_dirty = true;
    }
}

mgl::tensor* LatentKvCache::layer_pages(mgl::context& ctx, int64_t layer) {
    MGL_CHECK(layer >= 0 && layer < params_.n_layer, "kv cache: no layer " + std::to_string(layer));
    mgl::tensor* t = ctx.new_tensor(params_.type, {params_.n_pages, params_.page_size, width()},
                                    "kv_pages-" + std::to_string(layer));
    mgl::bind(*t, *pool_, size_t(layer) * layer_bytes());
    return t;
}

mgl::tensor* LatentKvCache::page_table(mgl::context& ctx, int seq) {
    sequence(seq);
    mgl::tensor* t = ctx.new_tensor(mgl::dtype::i32, {max_pages_per_seq_},
                                    "kv_page_table-" + std::to_string(seq));
    mgl::bind(*t, *page_tables_, size_t(seq) * size_t(max_pages_per_seq_) * sizeof(int32_t));
    return t;
}

void LatentKvCache::sync(int seq) {
    Sequence& s = sequence(seq);
    if (!s.table_dirty) return;
    const size_t n = size_t(max_pages_per_seq_);
    auto* table = static_cast<int32_t*>(host_tables_->base()) + size_t(seq) * n;
    std::fill(table, table + n, 0);
    std::copy(s.pages.begin(), s.pages.end(), table);
    mgl::context ctx;
    mgl::tensor* t = page_table(ctx, seq);
    // The host copy is not touched again before the next sync, after the graph that reads it.
    backend_.upload_async(*t, table, 0, n * sizeof(int32_t));
    s.table_dirty = false;
}

void LatentKvCache::read_row(int seq, int64_t layer, int64_t pos, float* out) const {
    const Sequence& s = sequence(seq);
    MGL_CHECK(pos >= 0 && pos < s.length,
              "kv cache: position " + std::to_string(pos) + " not stored");
    MGL_CHECK(layer >= 0 && layer < params_.n_layer, "kv cache: no layer " + std::to_string(layer));
    const int64_t page = s.pages[size_t(pos / params_.page_size)];
    const size_t row = size_t(page * params_.page_size + pos % params_.page_size);
    mgl::context ctx;
    mgl::tensor* t = ctx.new_tensor(params_.type, {params_.n_pages, params_.page_size, width()});
    mgl::bind(*t, *pool_, size_t(layer) * layer_bytes());
    const size_t es = mgl::dtype_size(params_.type);
    std::vector<uint8_t> raw(size_t(width()) * es);
    backend_.download(*t, raw.data(), row * raw.size(), raw.size());
    mgl::to_f32(params_.type, raw.data(), out, size_t(width()));
}

}  // namespace minids
