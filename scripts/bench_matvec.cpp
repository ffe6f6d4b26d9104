// bench_matvec: CPU matrix-vector products (M = 1) through the mgl CPU backend, against the
// machine's measured memory bandwidth.
//
//   build/bench_matvec [-t THREADS] [--reps N] [--pool-mib MIB] [--attention-only]
//
// Bandwidth: a read-only sum over a buffer far larger than the last-level cache, on the same
// number of threads, timed in slices of a size comparable to one matvec. Each shape × dtype cycles
// through enough copies of the weight matrix that every call streams it from memory, not from
// cache. Reported: median time of the repeats after warm-up, GB/s of weight bytes (1 GB = 1e9 B),
// and that rate as a fraction of the bandwidth; the best (fastest) call against the best bandwidth
// slice, and rates per CPU time (process CPU time / threads, which leaves out time spent
// preempted), since on a shared machine wall-clock medians move with the other jobs.
#include <time.h>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "../ggml-like/cpu/thread_pool.h"
#include "mgl.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

using thread_pool_ref = mgl::cpu::thread_pool&;
using clock_type = std::chrono::steady_clock;

double seconds_since(clock_type::time_point t0) {
    return std::chrono::duration<double>(clock_type::now() - t0).count();
}

// CPU time of the whole process (all threads). Threads blocked or preempted do not accumulate
// it, so (CPU time / threads) is the time the work took while it actually ran.
double process_cpu_seconds() {
    timespec ts{};
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return double(ts.tv_sec) + double(ts.tv_nsec) * 1e-9;
}

double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    size_t n = v.size();
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

std::string cpu_model() {
    std::ifstream in("/proc/cpuinfo");
    std::string line;
    while (std::getline(in, line)) {
        if (line.rfind("model name", 0) == 0) {
            auto colon = line.find(':');
            return colon == std::string::npos ? line : line.substr(colon + 2);
        }
    }
    return "unknown";
}

size_t last_level_cache_bytes() {
    for (int index = 4; index >= 0; --index) {
        std::ifstream in("/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(index) +
                         "/size");
        std::string s;
        if (in >> s && !s.empty()) {
            size_t v = std::stoull(s);
            char unit = s.back();
            return unit == 'K' ? v << 10 : unit == 'M' ? v << 20 : v;
        }
    }
    return size_t(64) << 20;
}

#if defined(__x86_64__)
__attribute__((target("avx2"))) uint64_t sum_avx2(const uint8_t* p, size_t n) {
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    size_t i = 0;
    for (; i + 128 <= n; i += 128) {
        a0 = _mm256_add_epi64(a0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i)));
        a1 = _mm256_add_epi64(a1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 32)));
        a2 = _mm256_add_epi64(a2, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 64)));
        a3 = _mm256_add_epi64(a3, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 96)));
    }
    alignas(32) uint64_t lanes[4];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes),
                       _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3)));
    uint64_t s = lanes[0] + lanes[1] + lanes[2] + lanes[3];
    for (; i < n; ++i) s += p[i];
    return s;
}
#endif

uint64_t sum_bytes(const uint8_t* p, size_t n) {
#if defined(__x86_64__)
    if (__builtin_cpu_supports("avx2")) return sum_avx2(p, n);
#endif
    uint64_t s = 0;
    for (size_t i = 0; i < n; i += 8) {
        uint64_t v;
        std::memcpy(&v, p + i, std::min<size_t>(8, n - i));
        s += v;
    }
    return s;
}

// Read-only bandwidth in GB/s over a buffer of `bytes`, read in slices of `slice` bytes (each
// split across the threads) one after another, twice over. The median slice time is used: on a
// machine shared with other jobs, a short burst like one matvec is rarely preempted, while a long
// pass nearly always is, so bursts of matching length keep the comparison fair.
struct rate {
    double median_gbs = 0, best_gbs = 0, cpu_gbs = 0;  // cpu: bytes per (CPU time / threads)
};

rate rates(double bytes, const std::vector<double>& wall,
           const std::vector<double>& cpu_per_thread) {
    return {bytes / median(wall) / 1e9, bytes / *std::min_element(wall.begin(), wall.end()) / 1e9,
            bytes / median(cpu_per_thread) / 1e9};
}

rate measure_bandwidth(thread_pool_ref pool, int n_threads, size_t bytes, size_t slice,
                       uint64_t& checksum) {
    std::vector<uint8_t> buf(bytes);
    for (size_t i = 0; i < bytes; i += 4096) buf[i] = uint8_t(i >> 12);  // touch every page
    std::vector<double> times, cpu_times;
    std::vector<uint64_t> partial(size_t(n_threads), 0);
    for (int pass = 0; pass < 3; ++pass) {
        for (size_t off = 0; off + slice <= bytes; off += slice) {
            double c0 = process_cpu_seconds();
            auto t0 = clock_type::now();
            pool.parallel_for(n_threads, [&](int64_t b, int64_t e) {
                for (int64_t c = b; c < e; ++c) {
                    size_t lo = slice * size_t(c) / size_t(n_threads),
                           hi = slice * size_t(c + 1) / size_t(n_threads);
                    partial[size_t(c)] += sum_bytes(buf.data() + off + lo, hi - lo);
                }
            });
            double dt = seconds_since(t0), dc = process_cpu_seconds() - c0;
            if (pass > 0) {  // the first pass is the warm-up
                times.push_back(dt);
                cpu_times.push_back(dc / n_threads);
            }
        }
    }
    for (uint64_t p : partial) checksum += p;
    return rates(double(slice), times, cpu_times);
}

struct shape {
    int64_t N, K;
    const char* note;
};

// Median wall and per-CPU-time milliseconds of computing graph g `reps` times after a warm-up.
std::pair<double, double> time_graph(mgl::backend& be, mgl::graph& g, int n_threads, int reps) {
    be.allocate(g);
    be.compute(g);
    std::vector<double> wall, cpu;
    for (int r = 0; r < reps; ++r) {
        double c0 = process_cpu_seconds();
        auto t0 = clock_type::now();
        be.compute(g);
        be.synchronize();
        wall.push_back(seconds_since(t0));
        cpu.push_back((process_cpu_seconds() - c0) / n_threads);
    }
    return {median(wall) * 1e3, median(cpu) * 1e3};
}

// The two MLA decode ops that are not plain matvecs, at DeepSeek-V2-Lite shapes: q_nope · W_uk
// with W_uk a transposed view of a bf16 W_kv_b, and absorbed attention over 2048 cached positions.
// Both working sets (4 MiB, 2.4-4.7 MiB) stay in cache between calls here.
void bench_attention_ops(int n_threads, int reps) {
    const int64_t H = 16, nope = 128, v = 128, r = 512, rope = 64, width = r + rope;
    const int64_t page_size = 64, n_ctx = 2048, n_pages = n_ctx / page_size;
    auto be = mgl::make_cpu_backend(n_threads);
    std::mt19937_64 rng(2);
    std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
    auto random_vector = [&](size_t n) {
        std::vector<float> out(n);
        for (auto& f : out) f = dist(rng);
        return out;
    };
    std::printf(
        "\n| decode op (V2-Lite shapes, 1 token) | median ms | ms per CPU time |\n|---|---|---|\n");
    {
        std::vector<uint16_t> kv_b(size_t(H * (nope + v) * r));
        for (auto& b : kv_b) b = mgl::f32_to_bf16(dist(rng));
        auto x = random_vector(size_t(H * nope));
        mgl::context ctx;
        mgl::tensor* w = ctx.new_tensor(mgl::dtype::bf16, {H * (nope + v), r}, "kv_b_proj.weight");
        w->data = kv_b.data();
        mgl::tensor* per_head = mgl::reshape(ctx, w, {H, nope + v, r});
        mgl::tensor* w_uk = mgl::transpose(ctx, mgl::slice(ctx, per_head, 1, 0, nope), 1, 2);
        mgl::tensor* q_nope = ctx.new_tensor(mgl::dtype::f32, {H, 1, nope}, "q_nope");
        q_nope->data = x.data();
        mgl::graph g = mgl::build_graph(ctx, {mgl::matmul(ctx, q_nope, w_uk)});
        auto [wall, cpu] = time_graph(*be, g, n_threads, reps);
        std::printf(
            "| q_lat = q_nope · W_uk (bf16 [16, 512, 128] transposed view) | %.3f | %.3f |\n", wall,
            cpu);
    }
    for (mgl::dtype cache_type : {mgl::dtype::f32, mgl::dtype::bf16}) {
        std::vector<uint8_t> pages_mem(size_t(n_pages * page_size * width) *
                                       mgl::dtype_size(cache_type));
        auto fill = random_vector(size_t(n_pages * page_size * width));
        for (size_t i = 0; i < fill.size(); ++i) {
            if (cache_type == mgl::dtype::f32) {
                std::memcpy(&pages_mem[i * 4], &fill[i], 4);
            } else {
                uint16_t h = mgl::f32_to_bf16(fill[i]);
                std::memcpy(&pages_mem[i * 2], &h, 2);
            }
        }
        std::vector<int32_t> table(static_cast<size_t>(n_pages));
        for (int64_t i = 0; i < n_pages; ++i)
            table[size_t(i)] = int32_t((i * 7) % n_pages);  // 7 ⟂ 32
        auto ql = random_vector(size_t(H * r)), qp = random_vector(size_t(H * rope));
        mgl::context ctx;
        mgl::tensor* pages = ctx.new_tensor(cache_type, {n_pages, page_size, width}, "kv_pages");
        pages->data = pages_mem.data();
        mgl::tensor* pt = ctx.new_tensor(mgl::dtype::i32, {n_pages}, "page_table");
        pt->data = table.data();
        mgl::tensor* q_lat = ctx.new_tensor(mgl::dtype::f32, {1, H, r}, "q_lat");
        q_lat->data = ql.data();
        mgl::tensor* q_pe = ctx.new_tensor(mgl::dtype::f32, {1, H, rope}, "q_pe");
        q_pe->data = qp.data();
        int32_t last_position = int32_t(n_ctx - 1);
        mgl::tensor* pos = ctx.new_tensor(mgl::dtype::i32, {1}, "positions");
        pos->data = &last_position;
        mgl::graph g =
            mgl::build_graph(ctx, {mgl::mla_attn(ctx, q_lat, q_pe, pages, pt, pos, 0.1f)});
        auto [wall, cpu] = time_graph(*be, g, n_threads, reps);
        std::printf("| mla_attn, %lld cached positions, %s cache, 16 heads | %.3f | %.3f |\n",
                    (long long)n_ctx, mgl::dtype_name(cache_type), wall, cpu);
    }
}

}  // namespace

int main(int argc, char** argv) {
    CLI::App app{"CPU matrix-vector benchmark for the mgl CPU backend"};
    int n_threads = 0, reps = 30;
    size_t pool_mib = 0;
    app.add_option("-t,--threads", n_threads, "threads (default: physical cores)");
    app.add_option("--reps", reps, "timed calls per shape and dtype (after warm-up)");
    app.add_option("--pool-mib", pool_mib,
                   "bytes of weight copies cycled per case (default: 3 × LLC, >= 1 GiB)");
    bool attention_only = false;
    app.add_flag("--attention-only", attention_only,
                 "only the MLA decode ops (W_uk view, mla_attn), skipping bandwidth and matvecs");
    CLI11_PARSE(app, argc, argv);
    if (attention_only) {
        bench_attention_ops(n_threads <= 0 ? mgl::physical_cores() : n_threads, reps);
        return 0;
    }
    if (n_threads <= 0) n_threads = mgl::physical_cores();
    const size_t llc = last_level_cache_bytes();
    const size_t pool_bytes =
        pool_mib ? pool_mib << 20 : std::max<size_t>(size_t(1) << 30, 3 * llc);

    std::printf("machine: %s, %d threads, last-level cache %zu MiB, weight pool per case %zu MiB\n",
                cpu_model().c_str(), n_threads, llc >> 20, pool_bytes >> 20);
    uint64_t checksum = 0;
    const size_t bw_bytes = std::max<size_t>(pool_bytes, size_t(2) << 30), bw_slice = size_t(32)
                                                                                      << 20;
    rate bw;
    {
        mgl::cpu::thread_pool pool(n_threads);
        bw = measure_bandwidth(pool, n_threads, bw_bytes, bw_slice, checksum);
    }
    std::printf(
        "memory bandwidth (read-only sum over %zu MiB in %zu MiB slices, %d threads): median %.1f "
        "GB/s, "
        "best %.1f GB/s, per CPU time %.1f GB/s\n\n",
        bw_bytes >> 20, bw_slice >> 20, n_threads, bw.median_gbs, bw.best_gbs, bw.cpu_gbs);

    const shape shapes[] = {{2048, 1408, "expert down"},
                            {1408, 2048, "expert gate/up"},
                            {2048, 3072, ""},
                            {2048, 102400, ""},
                            {102400, 2048, "lm_head"}};
    auto be = mgl::make_cpu_backend(n_threads);
    std::printf(
        "| N x K (out x in) | dtype | weight MB | median ms | GB/s | of bw | best GB/s | of best "
        "bw "
        "| GB/s per CPU time | of bw per CPU time |\n");
    std::printf("|---|---|---|---|---|---|---|---|---|---|\n");
    std::mt19937_64 rng(1);
    for (const shape& s : shapes) {
        for (mgl::dtype t : {mgl::dtype::f32, mgl::dtype::bf16, mgl::dtype::f8_e4m3}) {
            const size_t w_bytes = size_t(s.N * s.K) * mgl::dtype_size(t);
            const size_t copies = std::max<size_t>(2, (pool_bytes + w_bytes - 1) / w_bytes);
            // One random matrix, copied: the values only need to be valid numbers.
            std::vector<uint8_t> pool(w_bytes * copies);
            std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
            for (size_t i = 0; i < size_t(s.N * s.K); ++i) {
                float v = dist(rng);
                uint8_t* p = pool.data() + i * mgl::dtype_size(t);
                if (t == mgl::dtype::f32) std::memcpy(p, &v, 4);
                if (t == mgl::dtype::bf16) {
                    uint16_t h = mgl::f32_to_bf16(v);
                    std::memcpy(p, &h, 2);
                }
                if (t == mgl::dtype::f8_e4m3) *p = mgl::f32_to_e4m3(v * 100.0f);
            }
            for (size_t c = 1; c < copies; ++c)
                std::memcpy(pool.data() + c * w_bytes, pool.data(), w_bytes);
            std::vector<float> x(size_t(s.K)), scale(size_t(s.N), 0.01f);
            for (auto& v : x) v = dist(rng);

            mgl::context ctx;
            std::vector<mgl::graph> graphs;
            mgl::tensor* xt = ctx.new_tensor(mgl::dtype::f32, {1, s.K}, "x");
            xt->data = x.data();
            mgl::tensor* st = ctx.new_tensor(mgl::dtype::f32, {s.N}, "scale");
            st->data = scale.data();
            for (size_t c = 0; c < copies; ++c) {
                mgl::tensor* w = ctx.new_tensor(t, {s.N, s.K}, "w");
                w->data = pool.data() + c * w_bytes;
                mgl::tensor* y = mgl::matmul(ctx, xt, w, t == mgl::dtype::f8_e4m3 ? st : nullptr);
                graphs.push_back(mgl::build_graph(ctx, {y}));
            }
            std::vector<double> times, cpu_times;
            size_t next = 0;
            const int warmup = int(std::max<size_t>(copies, 3));
            for (int r = 0; r < warmup + reps; ++r) {
                mgl::graph& g = graphs[next++ % graphs.size()];
                be->allocate(g);
                double c0 = process_cpu_seconds();
                auto t0 = clock_type::now();
                be->compute(g);
                be->synchronize();
                double dt = seconds_since(t0), dc = process_cpu_seconds() - c0;
                if (r >= warmup) {
                    times.push_back(dt);
                    cpu_times.push_back(dc / n_threads);
                }
                checksum += uint64_t(static_cast<const float*>(g.outputs[0]->data)[0] != 0.0f);
            }
            rate r = rates(double(w_bytes), times, cpu_times);
            std::printf(
                "| %lld x %lld%s%s%s | %s | %.1f | %.3f | %.1f | %.2f | %.1f | %.2f | %.1f | %.2f "
                "|\n",
                (long long)s.N, (long long)s.K, *s.note ? " (" : "", s.note, *s.note ? ")" : "",
                mgl::dtype_name(t), double(w_bytes) / 1e6, median(times) * 1e3, r.median_gbs,
                r.median_gbs / bw.median_gbs, r.best_gbs, r.best_gbs / bw.best_gbs, r.cpu_gbs,
                r.cpu_gbs / bw.cpu_gbs);
            std::fflush(stdout);
        }
    }
    bench_attention_ops(n_threads, reps);
    std::printf("\n(checksum %llu)\n", (unsigned long long)(checksum & 0xFFFF));
    return 0;
}
