// The route_fetch fusion at the kernel level: a routing launch that plans the layer's expert fetch
// itself (moe_route or moe_router_route with MoeRoutingParams::fetch, then expert_fetch_copy)
// against the unfused path (the same routing launch, then expert_fetch's plan and copy kernels),
// over many steps of several MoE layers sharing one slot pool, fresh random inputs every step:
// misses, hits, evictions, no victim left, and misses taking this step's earlier arrivals
// (recycling). Everything the fetch writes must be identical: the tables, the slots' keys and
// bytes, the fill log, the arrivals, the id log, the counters, and the routing's ids, weights and
// probs.
#ifdef MINIDS_HAVE_CUDA
#include <cuda_runtime_api.h>
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <limits>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "expert_fetch.h"
#include "moe.h"
#include "moe_cuda_fixture.h"

using namespace minids;
using moe_test::DeviceBuffer;
using moe_test::Rng;

namespace {

const bool no_gpu = !test::cuda_device_available();

// The counters of mgl::expert_fetch_header the host sets before a step (in this order).
constexpr size_t kCounterWords = mgl::expert_fetch_counter_words;

// Everything one path's fetch reads and writes: header, tables, slots and the arrays the header
// points at (the layout of src/runtime/expert_offload_device.cpp does not matter here).
struct FetchWorld {
    int64_t L, E, S, blob, stride, id_stride;
    // The victims, their ranks and the key ranks in one buffer, as ExpertOffload lays them out
    // (a victims-after-the-launch block mirrors that layout).
    DeviceBuffer header, tables, table_addrs, victim_span, slot_keys, fill_log, arrivals, slots,
        homes, id_log;
    std::vector<int64_t> home_addrs;

    // `id_stride`: the id log's ids per layer (a decoded token's k, as the expert cache sets it).
    FetchWorld(int64_t L_, int64_t E_, int64_t S_, int64_t blob_, const DeviceBuffer& home_blobs,
               int64_t id_stride_)
        : L(L_),
          E(E_),
          S(S_),
          blob(blob_),
          stride((blob_ + 255) / 256 * 256),
          id_stride(id_stride_),
          header(sizeof(mgl::expert_fetch_header), 0),
          tables(size_t(L * E) * 8),
          table_addrs(size_t(L) * 8),
          victim_span(span_words(S, L * E_) * 8),
          slot_keys(size_t(S) * 4),
          fill_log(size_t(L * E) * 8),
          arrivals(size_t(L * E) * 4),
          slots(size_t(S * stride)),
          homes(size_t(L * E) * 8),
          id_log(size_t(L * id_stride_) * 4) {
        for (int64_t key = 0; key < L * E; ++key)
            home_addrs.push_back(
                reinterpret_cast<int64_t>(home_blobs.as<uint8_t>() + key * stride));
        homes.upload(home_addrs);
        tables.upload(home_addrs);  // every expert starts home
        std::vector<int64_t> addrs;
        for (int64_t l = 0; l < L; ++l)
            addrs.push_back(reinterpret_cast<int64_t>(tables.as<int64_t>() + l * E));
        table_addrs.upload(addrs);
        slot_keys.upload(std::vector<int32_t>(size_t(S), -1));
        id_log.upload(std::vector<int32_t>(size_t(L * id_stride), -7));  // never an id
        mgl::expert_fetch_header h;
        h.n_layers = L;
        h.n_experts = E;
        h.n_slots = S;
        h.blob_bytes = blob;
        h.slot_base = reinterpret_cast<int64_t>(slots.ptr);
        h.slot_stride = stride;
        h.tables = reinterpret_cast<int64_t>(table_addrs.ptr);
        h.homes = reinterpret_cast<int64_t>(homes.ptr);
        h.victims = reinterpret_cast<int64_t>(victims());
        h.slot_keys = reinterpret_cast<int64_t>(slot_keys.ptr);
        h.fill_log = reinterpret_cast<int64_t>(fill_log.ptr);
        h.victim_ranks = reinterpret_cast<int64_t>(victim_ranks());
        h.key_ranks = reinterpret_cast<int64_t>(key_ranks());
        h.arrivals = reinterpret_cast<int64_t>(arrivals.ptr);
        h.id_log = reinterpret_cast<int64_t>(id_log.ptr);
        h.id_log_stride = id_stride;
        CUDA_CHECK(cudaMemcpy(header.ptr, &h, sizeof h, cudaMemcpyHostToDevice));
    }

    // Words of the span: victims (i32, two per word), their ranks, the key ranks.
    static size_t span_words(int64_t n_victims, int64_t n_keys) {
        return size_t((n_victims + 1) / 2 + 2 * n_victims + 2 * n_keys);
    }
    static size_t ranks_at(int64_t n_victims) { return size_t((n_victims + 1) / 2); }
    static size_t keys_at(int64_t n_victims) { return ranks_at(n_victims) + size_t(2 * n_victims); }
    int32_t* victims() const { return victim_span.as<int32_t>(); }
    mgl::expert_fetch_rank* victim_ranks() const {
        return reinterpret_cast<mgl::expert_fetch_rank*>(victim_span.as<int64_t>() + ranks_at(S));
    }
    mgl::expert_fetch_rank* key_ranks() const {
        return reinterpret_cast<mgl::expert_fetch_rank*>(victim_span.as<int64_t>() + keys_at(S));
    }

    // What ExpertOffload::before_step uploads: the victims, their ranks, every key's arrival
    // rank and the zeroed counters.
    void before_step(const std::vector<int32_t>& v, const std::vector<mgl::expert_fetch_rank>& vr,
                     const std::vector<mgl::expert_fetch_rank>& kr, bool recycle) {
        auto up = [](void* dst, const auto& host) {
            if (!host.empty())
                CUDA_CHECK(cudaMemcpy(dst, host.data(), host.size() * sizeof(host[0]),
                                      cudaMemcpyHostToDevice));
        };
        up(victims(), v);
        up(victim_ranks(), vr);
        up(key_ranks(), kr);
        counters(int64_t(v.size()), recycle, 0);
    }
    // The counters alone; `wanted` > 0: the victims and ranks come after the launch
    // (upload_after_launch with the same number).
    void counters(int64_t n_victims, bool recycle, int64_t wanted) {
        std::vector<int64_t> c(kCounterWords, 0);
        c[0] = n_victims;
        c[4] = recycle ? 1 : 0;
        c[offsetof(mgl::expert_fetch_header, victims_wanted) / 8] = wanted;
        CUDA_CHECK(cudaMemcpy(header.ptr, c.data(), kCounterWords * 8, cudaMemcpyHostToDevice));
    }
    // Victims after the launch, as ExpertOffload sets them up: a block of pinned host memory,
    // the ready word then the span's layout, which the step's first plan that misses copies into
    // the span once the word says they are written.
    struct LateBlock {
        void* p = nullptr;
        LateBlock() = default;
        LateBlock(const LateBlock&) = delete;
        LateBlock& operator=(const LateBlock&) = delete;
        ~LateBlock() {
            if (p) (void)cudaFreeHost(p);
        }
    } late;
    int64_t* ready = nullptr;
    void victims_after_launch() {
        const size_t bytes = (1 + span_words(S, L * E)) * 8;
        CUDA_CHECK(cudaHostAlloc(&late.p, bytes, cudaHostAllocDefault));
        std::memset(late.p, 0, bytes);
        ready = static_cast<int64_t*>(late.p);
        mgl::expert_fetch_header h;
        CUDA_CHECK(cudaMemcpy(&h, header.ptr, sizeof h, cudaMemcpyDeviceToHost));
        h.victims_ready = reinterpret_cast<int64_t>(ready);
        CUDA_CHECK(cudaMemcpy(header.ptr, &h, sizeof h, cudaMemcpyHostToDevice));
    }
    // Writes them while the step runs, then step `seq`'s number into the ready word.
    void write_after_launch(const std::vector<int32_t>& v,
                            const std::vector<mgl::expert_fetch_rank>& vr,
                            const std::vector<mgl::expert_fetch_rank>& kr, int64_t seq) {
        int64_t* span = ready + 1;
        std::copy(v.begin(), v.end(), reinterpret_cast<int32_t*>(span));
        std::copy(vr.begin(), vr.end(),
                  reinterpret_cast<mgl::expert_fetch_rank*>(span + ranks_at(S)));
        std::copy(kr.begin(), kr.end(),
                  reinterpret_cast<mgl::expert_fetch_rank*>(span + keys_at(S)));
        std::atomic_ref<int64_t>(*ready).store(seq, std::memory_order_release);
    }
    int64_t victims_late() const {
        mgl::expert_fetch_header h;
        CUDA_CHECK(cudaMemcpy(&h, header.ptr, sizeof h, cudaMemcpyDeviceToHost));
        return h.victims_late;
    }

    kernels::ExpertFetchParams params(int64_t layer, const int32_t* ids, int64_t n_ids) const {
        kernels::ExpertFetchParams p;
        p.state = header.as<mgl::expert_fetch_header>();
        p.table = tables.as<int64_t>() + layer * E;
        p.ids = ids;
        p.n_ids = n_ids;
        p.layer = int32_t(layer);
        p.n_experts = int32_t(E);
        p.blob_bytes = blob;
        p.pdl = true;
        return p;
    }

    // The state after a step, addresses made comparable between worlds: a table entry as -1
    // (home) or its slot's index.
    struct Snapshot {
        std::vector<int64_t> counters;  // next_victim, n_fills, n_arrivals
        std::vector<int64_t> entries;
        std::vector<int32_t> slot_keys, fill_log, arrivals, id_log;
        std::vector<uint8_t> slots;
        int64_t bad_entries = 0;  // neither home nor a slot holding that expert's bytes
    };
    Snapshot snapshot(const std::vector<uint8_t>& home_bytes) const {
        Snapshot s;
        mgl::expert_fetch_header h;
        CUDA_CHECK(cudaMemcpy(&h, header.ptr, sizeof h, cudaMemcpyDeviceToHost));
        s.counters = {h.next_victim, h.n_fills, h.n_arrivals};
        const auto t = tables.download<int64_t>();
        s.slot_keys = slot_keys.download<int32_t>();
        s.slots = slots.download<uint8_t>();
        const int64_t base = reinterpret_cast<int64_t>(slots.ptr);
        for (int64_t key = 0; key < L * E; ++key) {
            const int64_t a = t[size_t(key)];
            if (a == home_addrs[size_t(key)]) {
                s.entries.push_back(-1);
                continue;
            }
            const int64_t slot = (a - base) / stride;
            const bool ok = a >= base && (a - base) % stride == 0 && slot < S &&
                            s.slot_keys[size_t(slot)] == key &&
                            std::memcmp(&s.slots[size_t(slot * stride)],
                                        &home_bytes[size_t(key * stride)], size_t(blob)) == 0;
            s.bad_entries += ok ? 0 : 1;
            s.entries.push_back(slot);
        }
        const auto log = fill_log.download<int32_t>();
        s.fill_log.assign(log.begin(), log.begin() + 2 * h.n_fills);
        const auto arr = arrivals.download<int32_t>();
        s.arrivals.assign(arr.begin(), arr.begin() + h.n_arrivals);
        s.id_log = id_log.download<int32_t>();
        return s;
    }
};

// One path's routing outputs for every layer.
struct RouteOut {
    DeviceBuffer logits, probs, ids, weights, ticket;
    RouteOut(int64_t L, int64_t T, int64_t E, int k)
        : logits(size_t(L * T * E) * 4),
          probs(size_t(L * T * E) * 4),
          ids(size_t(L * T * k) * 4),
          weights(size_t(L * T * k) * 4),
          ticket(4, 0) {}
};

struct Config {
    const char* what;
    int64_t E, T;
    bool router;  // moe_router_route (router matmul + routing) instead of moe_route
    mgl::moe_route_params route;
};

mgl::moe_route_params greedy_k(int k) {
    mgl::moe_route_params p;
    p.k = k;
    p.norm_topk_prob = true;
    return p;
}

mgl::moe_route_params grouped_k(int k, int n_group, int topk_group) {
    mgl::moe_route_params p = greedy_k(k);
    p.method = mgl::topk_method::group_limited_greedy;
    p.n_group = n_group;
    p.topk_group = topk_group;
    return p;
}

template <typename T>
int64_t count_differences(const std::vector<T>& a, const std::vector<T>& b) {
    if (a.size() != b.size()) return int64_t(std::max(a.size(), b.size()));
    int64_t n = 0;
    for (size_t i = 0; i < a.size(); ++i) n += std::memcmp(&a[i], &b[i], sizeof(T)) != 0;
    return n;
}

}  // namespace

TEST_CASE("cuda expert fetch planned by the routing launch: identical to the plan kernel" *
          doctest::skip(no_gpu)) {
    const Config configs[] = {
        {"decode, moe_route", 64, 1, false, greedy_k(6)},
        {"3 tokens in one block, moe_route", 64, 3, false, greedy_k(6)},
        {"6 tokens: route then the plan kernel", 64, 6, false, greedy_k(6)},
        {"160 experts grouped, moe_route", 160, 1, false, grouped_k(6, 8, 3)},
        {"decode, moe_router_route", 64, 1, true, greedy_k(6)},
        {"5 tokens, moe_router_route", 64, 5, true, greedy_k(6)},
        {"160 experts grouped, moe_router_route", 160, 2, true, grouped_k(6, 8, 3)},
    };
    const int64_t L = 4, S = 24, D = 256, n_steps = 48;
    const int64_t blob = 200000 + 48;  // two copy chunks and a tail
    cudaStream_t main_stream, late_kernels;
    CUDA_CHECK(cudaStreamCreateWithFlags(&main_stream, cudaStreamNonBlocking));
    CUDA_CHECK(cudaStreamCreateWithFlags(&late_kernels, cudaStreamNonBlocking));
    uint64_t seed = 900;
    for (const Config& c : configs) {
        const std::string what = c.what;  // doctest prints a char pointer as an address
        CAPTURE(what);
        const int64_t E = c.E, T = c.T;
        const int k = c.route.k;
        const int64_t stride = (blob + 255) / 256 * 256;
        Rng rng(seed += 100);
        std::vector<uint8_t> home_bytes(size_t(L * E * stride));
        for (size_t i = 0; i + 8 <= home_bytes.size(); i += 8) {
            const uint64_t r = rng.next();
            std::memcpy(&home_bytes[i], &r, 8);
        }
        DeviceBuffer home_blobs(home_bytes);
        // `late`: the unfused kernels with the victims in host memory, written after the step's
        // launch, after the host waited a little (the plans that miss wait for them).
        FetchWorld unfused(L, E, S, blob, home_blobs, k), fused(L, E, S, blob, home_blobs, k),
            late(L, E, S, blob, home_blobs, k);
        late.victims_after_launch();
        RouteOut out_u(L, T, E, k), out_f(L, T, E, k), out_l(L, T, E, k);
        // Each layer's hot experts (higher logits on average), so that steps also hit.
        std::vector<std::vector<char>> hot(size_t(L), std::vector<char>(size_t(E), 0));
        for (auto& h : hot)
            for (int i = 0; i < 10; ++i) h[size_t(rng.below(int(E)))] = 1;
        // moe_router_route: fixed router weights per layer, hot rows leaning towards x's mean.
        DeviceBuffer x(size_t(L * T * D) * 4), w(size_t(L * E * D) * 2);
        if (c.router) {
            std::vector<uint16_t> wb(size_t(L * E * D));
            for (int64_t l = 0; l < L; ++l)
                for (int64_t e = 0; e < E; ++e)
                    for (int64_t d = 0; d < D; ++d)
                        wb[size_t((l * E + e) * D + d)] = mgl::f32_to_bf16(
                            rng.uniform(-0.1f, 0.1f) + (hot[size_t(l)][size_t(e)] ? 0.02f : 0.0f));
            w.upload(wb);
        }
        int64_t fills = 0, hits = 0, recycled = 0, steps_out_of_victims = 0;
        for (int64_t step = 0; step < n_steps; ++step) {
            CAPTURE(step);
            const FetchWorld::Snapshot before = unfused.snapshot(home_bytes);
            // Victims: a random number of distinct slots in random order (none at all, or too
            // few for the step's misses, now and then), ranked as the host ranks them (a free
            // slot first); arrival ranks of every key drawn from the same few levels, so misses
            // sometimes prefer this step's earlier arrival.
            std::vector<int32_t> order(static_cast<size_t>(S));
            std::iota(order.begin(), order.end(), 0);
            for (size_t i = order.size(); i > 1; --i)
                std::swap(order[i - 1], order[rng.below(int(i))]);
            const int n_victims = step % 7 == 3 ? 0 : rng.below(int(S) + 1);
            std::vector<int32_t> victims(order.begin(), order.begin() + n_victims);
            std::vector<mgl::expert_fetch_rank> victim_ranks, key_ranks(size_t(L * E));
            for (int32_t v : victims) {
                mgl::expert_fetch_rank r{double(rng.below(4)), uint64_t(rng.below(1000))};
                if (before.slot_keys[size_t(v)] < 0)
                    r = {-std::numeric_limits<double>::infinity(), 0};
                victim_ranks.push_back(r);
            }
            for (auto& r : key_ranks) r = {double(rng.below(4)), uint64_t(rng.below(1000))};
            const bool recycle = rng.below(3) != 0;
            unfused.before_step(victims, victim_ranks, key_ranks, recycle);
            fused.before_step(victims, victim_ranks, key_ranks, recycle);
            const int64_t seq = step + 1;
            late.counters(int64_t(victims.size()), recycle, seq);
            // Fresh inputs for every layer: logits (moe_route) or x (moe_router_route).
            std::vector<float> in(size_t(L * T * (c.router ? D : E)));
            for (int64_t l = 0; l < L; ++l)
                for (int64_t t = 0; t < T; ++t) {
                    if (c.router) {
                        for (int64_t d = 0; d < D; ++d)
                            in[size_t((l * T + t) * D + d)] = rng.uniform(-1.0f, 1.0f) + 0.5f;
                    } else {
                        for (int64_t e = 0; e < E; ++e)
                            in[size_t((l * T + t) * E + e)] =
                                rng.uniform(-2.0f, 2.0f) +
                                (hot[size_t(l)][size_t(e)] ? 2.5f : 0.0f);
                    }
                }
            if (c.router) {
                x.upload(in);
            } else {
                out_u.logits.upload(in);
                out_f.logits.upload(in);
                out_l.logits.upload(in);
            }
            // Each path's layers in order on one stream, every launch dependent (as in the graph);
            // the late path's on a stream of its own, so its plans run before its victims land.
            for (const int path : {2, 0, 1}) {
                const bool fuse = path == 1;
                cudaStream_t stream = path == 2 ? late_kernels : main_stream;
                for (int64_t l = 0; l < L; ++l) {
                    FetchWorld& world = path == 0 ? unfused : path == 1 ? fused : late;
                    RouteOut& o = path == 0 ? out_u : path == 1 ? out_f : out_l;
                    int32_t* ids = o.ids.as<int32_t>() + l * T * k;
                    const kernels::ExpertFetchParams f = world.params(l, ids, T * k);
                    if (c.router) {
                        kernels::MoeRouterRouteParams p;
                        p.x = x.as<float>() + l * T * D;
                        p.n_embd = D;
                        p.w = w.as<uint16_t>() + l * E * D;
                        p.logits = o.logits.as<float>() + l * T * E;
                        p.ticket = o.ticket.as<unsigned int>();
                        p.probs_out = o.probs.as<float>() + l * T * E;
                        p.ids = ids;
                        p.weights = o.weights.as<float>() + l * T * k;
                        p.n_tokens = T;
                        p.n_experts = E;
                        p.route = c.route;
                        p.pdl = true;
                        if (fuse) p.fetch = f;
                        kernels::moe_router_route(p, stream);
                    } else {
                        kernels::MoeRoutingParams r;
                        r.logits = o.logits.as<float>() + l * T * E;
                        r.probs_out = o.probs.as<float>() + l * T * E;
                        r.ids = ids;
                        r.weights = o.weights.as<float>() + l * T * k;
                        r.n_tokens = T;
                        r.n_experts = E;
                        r.route = c.route;
                        r.pdl = true;
                        if (fuse) r.fetch = f;
                        kernels::moe_route(r, stream);
                    }
                    if (fuse)
                        kernels::expert_fetch_copy(f, stream);
                    else
                        kernels::expert_fetch(f, stream);
                }
            }
            // The late path's victims, well after its plans were queued.
            std::this_thread::sleep_for(std::chrono::microseconds(200));
            late.write_after_launch(victims, victim_ranks, key_ranks, seq);
            CUDA_CHECK(cudaStreamSynchronize(main_stream));
            CUDA_CHECK(cudaStreamSynchronize(late_kernels));
            const FetchWorld::Snapshot a = unfused.snapshot(home_bytes),
                                       b = fused.snapshot(home_bytes),
                                       d = late.snapshot(home_bytes);
            CHECK(late.victims_late() == 0);
            CHECK(a.bad_entries == 0);
            // The fused path and the late one wrote what the unfused path wrote.
            for (const auto& [path, x] :
                 {std::pair<std::string, const FetchWorld::Snapshot*>{"fused", &b},
                  {"victims after the launch", &d}}) {
                CAPTURE(path);
                CHECK(count_differences(a.counters, x->counters) == 0);
                CHECK(count_differences(a.entries, x->entries) == 0);
                CHECK(count_differences(a.slot_keys, x->slot_keys) == 0);
                CHECK(count_differences(a.fill_log, x->fill_log) == 0);
                CHECK(count_differences(a.arrivals, x->arrivals) == 0);
                CHECK(count_differences(a.slots, x->slots) == 0);
                CHECK(x->bad_entries == 0);
            }
            CHECK(count_differences(out_u.ids.download<int32_t>(), out_f.ids.download<int32_t>()) ==
                  0);
            CHECK(count_differences(out_u.weights.download<float>(),
                                    out_f.weights.download<float>()) == 0);
            CHECK(count_differences(out_u.probs.download<float>(), out_f.probs.download<float>()) ==
                  0);
            // The id log holds each layer's ids when they fit (a decoded token), and is not
            // touched otherwise.
            const auto ids = out_u.ids.download<int32_t>();
            const auto want_log = T == 1 ? ids : std::vector<int32_t>(size_t(L * k), -7);
            CHECK(count_differences(a.id_log, want_log) == 0);
            CHECK(count_differences(b.id_log, want_log) == 0);
            // What the step did (from the unfused path): fills, recycled arrivals (a slot
            // filled twice in one step), hits (used experts whose entry was a slot at the start).
            for (int64_t l = 0; l < L; ++l) {
                std::vector<char> used(size_t(E), 0);
                for (int64_t i = 0; i < T * k; ++i) used[size_t(ids[size_t(l * T * k + i)])] = 1;
                for (int64_t e = 0; e < E; ++e)
                    hits += used[size_t(e)] && before.entries[size_t(l * E + e)] >= 0;
            }
            const int64_t n_fills = a.counters[1];
            fills += n_fills;
            std::vector<int> filled(size_t(S), 0);
            for (int64_t i = 0; i < n_fills; ++i)
                recycled += ++filled[size_t(a.fill_log[size_t(2 * i + 1)])] > 1;
            steps_out_of_victims += a.counters[0] >= int64_t(victims.size()) ? 1 : 0;
        }
        MESSAGE("expert fetch planned by the routing launch, "
                << what << ": " << n_steps << " steps, " << fills << " fills, " << recycled
                << " recycled, " << hits << " hits");
        CHECK(fills > S);
        CHECK(hits > 0);
        CHECK(recycled > 0);
        CHECK(steps_out_of_victims > 0);
    }
    CUDA_CHECK(cudaStreamDestroy(main_stream));
    CUDA_CHECK(cudaStreamDestroy(late_kernels));
}

TEST_CASE("cuda expert fetch gives up on victims that never come" * doctest::skip(no_gpu)) {
    // Victims promised for after the launch that the host never sends (it failed): each plan
    // that misses waits 2 s at most (the first; the later ones see the flag and go on), flags
    // victims_late for the host, and fills nothing: its misses stay home, read in place.
    const int64_t L = 3, E = 64, S = 16, blob = 4096;
    std::vector<uint8_t> home_bytes(size_t(L * E * blob), 7);
    DeviceBuffer home_blobs(home_bytes);
    FetchWorld world(L, E, S, blob, home_blobs, 6);
    world.victims_after_launch();
    world.counters(S, false, 1);
    const std::vector<int32_t> ids = {3, 9, 17, 30, 41, 60};
    DeviceBuffer d_ids(ids);
    cudaStream_t stream;
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    const auto t0 = std::chrono::steady_clock::now();
    for (int64_t l = 0; l < L; ++l)
        kernels::expert_fetch(world.params(l, d_ids.as<int32_t>(), 6), stream);
    CUDA_CHECK(cudaStreamSynchronize(stream));
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    CUDA_CHECK(cudaStreamDestroy(stream));
    const FetchWorld::Snapshot snap = world.snapshot(home_bytes);
    CHECK(world.victims_late() == 1);
    CHECK(snap.counters[1] == 0);  // no fills
    CHECK(std::all_of(snap.entries.begin(), snap.entries.end(), [](int64_t e) { return e < 0; }));
    MESSAGE("expert fetch without its victims: gave up after " << s << " s for " << L << " layers");
    CHECK(s >= 1.9);
    CHECK(s < 10.0);
}

TEST_CASE(
    "cuda routing with an expert fetch refuses a fetch of other ids before touching the "
    "device") {
    alignas(16) static float logits[64];
    static int32_t ids[6], other[6];
    static float weights[6];
    static mgl::expert_fetch_header state;
    static int64_t table[64];
    kernels::MoeRoutingParams r;
    r.logits = logits;
    r.ids = ids;
    r.weights = weights;
    r.n_tokens = 1;
    r.n_experts = 64;
    r.route = greedy_k(6);
    r.fetch.state = &state;
    r.fetch.table = table;
    r.fetch.ids = other;  // not the routing's ids
    r.fetch.n_ids = 6;
    r.fetch.n_experts = 64;
    r.fetch.blob_bytes = 1024;
    CHECK_THROWS_AS(kernels::moe_route(r, nullptr), mgl::error);
    r.fetch.ids = ids;
    r.fetch.n_ids = 5;  // not T·k
    CHECK_THROWS_AS(kernels::moe_route(r, nullptr), mgl::error);
    r.fetch.n_ids = 6;
    r.fetch.n_experts = 32;  // a table of other experts
    CHECK_THROWS_AS(kernels::moe_route(r, nullptr), mgl::error);
    kernels::ExpertFetchParams f = r.fetch;
    f.n_experts = 2000;  // above the plan's limit
    CHECK_THROWS_AS(kernels::expert_fetch_copy(f, nullptr), mgl::error);
}

#endif  // MINIDS_HAVE_CUDA
