// The paged latent KV cache: kv_store writes c and k_pe rows, mla_attn runs absorbed MLA attention
// over them. A page table maps logical page p (positions p·page_size ..) to a physical page.
#include <cmath>
#include <vector>

#include "cpu_ops.h"

namespace mgl::cpu {

namespace {

// Address of the cache row of position `pos`, checked against the page table and the pages.
char* cache_row(const tensor& pages, const tensor& page_table, int64_t pos) {
    const int64_t page_size = pages.shape[1];
    MGL_CHECK(pos >= 0 && pos < page_table.shape[0] * page_size,
              "position " + std::to_string(pos) + " is outside the page table's " +
                  std::to_string(page_table.shape[0] * page_size) + " positions");
    int32_t phys = load_i32(page_table, pos / page_size);
    MGL_CHECK(phys >= 0 && phys < pages.shape[0],
              "page table entry " + std::to_string(pos / page_size) + " = " + std::to_string(phys) +
                  " is outside the " + std::to_string(pages.shape[0]) + " pages");
    return static_cast<char*>(pages.data) + phys * pages.stride[0] +
           (pos % page_size) * pages.stride[1];
}

}  // namespace

void run_kv_store(exec_context&, tensor& node) {
    // node aliases the pages (same address, shape, strides and dtype).
    const tensor& page_table = *node.src[1];
    const tensor& kv_c = *node.src[2];
    const tensor& k_pe = *node.src[3];
    const tensor& positions = *node.src[4];
    const int64_t r = kv_c.shape[1], rope = k_pe.shape[1];
    const int64_t es = node.stride[2];
    std::vector<float> row(static_cast<size_t>(r + rope));
    for (int64_t t = 0; t < kv_c.shape[0]; ++t) {
        read_row(kv_c, t, row.data());
        read_row(k_pe, t, row.data() + r);
        char* dst = cache_row(node, page_table, load_i32(positions, t));
        for (int64_t i = 0; i < r + rope; ++i) store_f32(node.type, dst + i * es, row[size_t(i)]);
    }
}

namespace {

// The cache rows a query attends to, one page at a time: [s0, s0 + rows) live in `base`.
template <class Fn>
void for_each_page(const tensor& pages, const tensor& page_table, int64_t n_ctx, Fn fn) {
    const int64_t page_size = pages.shape[1];
    for (int64_t s0 = 0; s0 < n_ctx; s0 += page_size) {
        const uint8_t* base = reinterpret_cast<const uint8_t*>(cache_row(pages, page_table, s0));
        fn(s0, std::min(page_size, n_ctx - s0), base);
    }
}

void softmax_rows(float* scores, int64_t n_rows, int64_t n, float scale) {
    for (int64_t h = 0; h < n_rows; ++h) softmax_row(scores + h * n, n, scale);
}

}  // namespace

void run_mla_attn(exec_context& ex, tensor& node) {
    const tensor& q_lat = *node.src[0];
    const tensor& q_pe = *node.src[1];
    const tensor& pages = *node.src[2];
    const tensor& page_table = *node.src[3];
    const tensor& positions = *node.src[4];
    const float scale = node.fparams[0];
    const int64_t T = q_lat.shape[0], H = q_lat.shape[1], r = q_lat.shape[2], rope = q_pe.shape[2];
    const int64_t width = r + rope, es = pages.stride[2];
    // Cache rows with contiguous elements (always, for pages the runtime allocates) go through
    // the matmul kernels: scores = q · rowsᵀ per page, then o_lat += p · rows[:, :r] per page.
    const matmul_rows_fn score_kernel = ex.kernels.for_type(pages.type);
    const matmul_cols_fn value_kernel = ex.kernels.cols_for_type(pages.type);
    const bool use_kernels = es == int64_t(dtype_size(pages.type)) && score_kernel && value_kernel;
    auto* out = static_cast<float*>(node.data);

    // Work items are (token, head) pairs; a chunk handles runs of heads of one token together so
    // each cache row is read once per run.
    ex.pool.parallel_for(T * H, [&](int64_t i0, int64_t i1) {
        std::vector<float> q, scores, partial, converted(static_cast<size_t>(width));
        for (int64_t i = i0; i < i1;) {
            const int64_t t = i / H, h0 = i % H, nh = std::min(H - h0, i1 - i);
            const int64_t n_ctx = int64_t(load_i32(positions, t)) + 1;
            MGL_CHECK(n_ctx >= 1, "mla_attn: negative position " + std::to_string(n_ctx - 1));
            float* o = out + (t * H + h0) * r;  // nh rows of r, contiguous
            q.resize(static_cast<size_t>(nh * width));
            for (int64_t h = 0; h < nh; ++h) {
                read_row(q_lat, t * H + h0 + h, q.data() + h * width);
                read_row(q_pe, t * H + h0 + h, q.data() + h * width + r);
            }
            scores.resize(static_cast<size_t>(nh * n_ctx));
            std::fill_n(o, nh * r, 0.0f);
            if (use_kernels) {
                matmul_job job;
                job.type = pages.type;
                job.w_row_stride = pages.stride[1];
                job.M = nh;
                for_each_page(pages, page_table, n_ctx,
                              [&](int64_t s0, int64_t rows, const uint8_t* base) {
                                  job.x = q.data();
                                  job.x_stride = width;
                                  job.K = width;
                                  job.w = base;
                                  job.y = scores.data() + s0;
                                  job.y_stride = n_ctx;
                                  score_kernel(job, 0, rows);
                              });
                softmax_rows(scores.data(), nh, n_ctx, scale);
                partial.resize(static_cast<size_t>(nh * r));
                for_each_page(pages, page_table, n_ctx,
                              [&](int64_t s0, int64_t rows, const uint8_t* base) {
                                  job.x = scores.data() + s0;
                                  job.x_stride = n_ctx;
                                  job.K = rows;
                                  job.w = base;
                                  job.y = partial.data();
                                  job.y_stride = r;
                                  value_kernel(job, 0, r);
                                  for (int64_t e = 0; e < nh * r; ++e) o[e] += partial[size_t(e)];
                              });
            } else {
                // Any element stride: one row at a time, converted to f32.
                auto row_at = [&](int64_t s) -> const float* {
                    const char* p = cache_row(pages, page_table, s);
                    for (int64_t e = 0; e < width; ++e)
                        converted[size_t(e)] = load_f32(pages.type, p + e * es);
                    return converted.data();
                };
                for (int64_t s = 0; s < n_ctx; ++s) {
                    const float* kv = row_at(s);
                    for (int64_t h = 0; h < nh; ++h) {
                        const float* qh = q.data() + h * width;
                        float dot = 0.0f;
                        for (int64_t e = 0; e < width; ++e) dot += qh[e] * kv[e];
                        scores[size_t(h * n_ctx + s)] = dot;
                    }
                }
                softmax_rows(scores.data(), nh, n_ctx, scale);
                for (int64_t s = 0; s < n_ctx; ++s) {
                    const float* c = row_at(s);
                    for (int64_t h = 0; h < nh; ++h) {
                        float p = scores[size_t(h * n_ctx + s)];
                        for (int64_t e = 0; e < r; ++e) o[h * r + e] += p * c[e];
                    }
                }
            }
            i += nh;
        }
    });
}

}  // namespace mgl::cpu
