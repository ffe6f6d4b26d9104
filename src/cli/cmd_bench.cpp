// minids bench: llama-bench's shape. Prompt processing (pp) and text generation (tg) tests at
// optional context depths, repeated after a warm-up, tok/s as mean ± sd, and for tg the floor
// the memory allows: the bytes one decode token must read (active weights + the KV cache at that
// depth) over the measured device bandwidth.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "cli/model_session.h"
#include "cli/routing_flags.h"
#include "mgl-cuda.h"
#include "runtime/interrupt.h"
#include "runtime/session.h"

namespace minids::cli {

namespace {

struct BenchOptions {
    ModelFlags model;
    std::vector<int64_t> n_prompt{512};
    std::vector<int64_t> n_gen{128};
    std::vector<int64_t> depth{0};
    int reps = 5;
    std::string output = "md";
    RoutingFlags routing;
    // The expert cache's sweep: the four phases once per slot count x policy x admission.
    std::vector<int64_t> sweep_slots;
    std::vector<std::string> sweep_policies;
    std::vector<std::string> sweep_admit;
    std::vector<std::string> sweep_fetch;
    std::vector<int> sweep_prefetch;
};

struct BenchRow {
    std::string test;
    int64_t n_prompt = 0, n_gen = 0, depth = 0;
    std::vector<double> tok_s;  // one per repetition
    double mean = 0.0, sd = 0.0;
    double floor_tok_s = 0.0;  // 0: not applicable
};

// One phase of the expert cache's benchmark.
struct PhaseRow {
    std::string phase;
    int64_t slots = 0;
    std::string policy, admit;
    std::string fetch;       // device, host, or host with a copy stream
    int prefetch = 0;        // --expert-prefetch
    int prefetch_fills = 0;  // --expert-prefetch-fills (0: no cap)
    int64_t n_prompt = 0, n_gen = 0;
    double ttft_s = 0.0, tg_tok_s = 0.0;
    double prompt_hit_rate = 0.0, tg_hit_rate = 0.0;
    double mib_filled_per_token = 0.0;  // decode: copies into slots
    double mib_link_per_token = 0.0;    // decode: copies + reads in place over the host link
    double link_floor_tok_s = 0.0;      // the host link's bandwidth / those bytes (0: unknown)
    double prefetched_per_token = 0.0;  // decode: experts prefetched (their bytes are filled)
    double prefetch_used = 0.0;         // of those, the share their layer then read
    // decode: ms per token the MoE layers waited on the device fetch (-1: not timed, host fetch)
    double fetch_wait_ms = -1.0;
    double fetch_wait_share() const {  // of the decode step's time
        return fetch_wait_ms >= 0 && tg_tok_s > 0 ? fetch_wait_ms * tg_tok_s / 1000.0 : -1.0;
    }
};

double seconds_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Bytes one decoded token must read at `depth` cached tokens: every dense weight except the
// embedding table (one row of it), the k routed experts of every MoE layer, the cache rows.
double decode_bytes(const LoadedModel& m, int64_t depth) {
    const ModelConfig& c = m.model->config();
    double bytes = 0.0;
    for (const auto& t : m.file->tensors()) {
        if (t.name == "model.embed_tokens.weight") {
            bytes += double(t.nbytes) / double(c.vocab_size);
            if (c.tie_word_embeddings) bytes += double(t.nbytes);  // it is the lm_head too
        } else {
            bytes += double(t.nbytes);
        }
    }
    bytes += double(m.model->moe_layers().size()) * double(c.num_experts_per_tok) *
             double(m.file->experts().blob_nbytes);
    bytes += double(depth) * double(c.num_hidden_layers) * double(c.kv_cache_width()) *
             double(mgl::dtype_size(m.session_params.kv_type));
    return bytes;
}

std::vector<int32_t> random_tokens(int64_t n, int64_t vocab, uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::uniform_int_distribution<int64_t> dist(0, vocab - 1);
    std::vector<int32_t> v(size_t(std::max<int64_t>(n, 0)));
    for (auto& t : v) t = int32_t(dist(rng));
    return v;
}

void finish(BenchRow& r) {
    double sum = 0.0;
    for (double v : r.tok_s) sum += v;
    r.mean = r.tok_s.empty() ? 0.0 : sum / double(r.tok_s.size());
    double ss = 0.0;
    for (double v : r.tok_s) ss += (v - r.mean) * (v - r.mean);
    r.sd = r.tok_s.size() > 1 ? std::sqrt(ss / double(r.tok_s.size() - 1)) : 0.0;
}

std::string fmt(const char* f, double v) {
    char buf[64];
    std::snprintf(buf, sizeof buf, f, v);
    return buf;
}

// The expert cache's four phases with the cache attached to `session` now.
void run_phases(LoadedModel& m, Session& session, const BenchOptions& o,
                const InterruptHandler& interrupt, double link_gbs, std::vector<PhaseRow>& phases) {
    const ModelConfig& c = m.model->config();
    const int64_t np = std::max<int64_t>(o.n_prompt.front(), 1), ng = o.n_gen.front();
    ExpertOffload& cache = *m.expert_cache;
    const auto& cc = cache.config();
    const size_t first = phases.size();
    for (const auto& [name, cold, reuse] : {std::tuple{"cold, new prompt", true, false},
                                            {"warm, new prompt", false, false},
                                            {"warm, reused prefix", false, true},
                                            {"cold, reused prefix", true, true}}) {
        if (interrupt.requested()) throw UserError("interrupted");
        PhaseRow ph;
        ph.phase = name;
        ph.slots = cc.n_slots;
        ph.policy = routing::policy_name(cc.policy);
        ph.admit = routing::admission_name(cc.admit);
        ph.fetch = cache.uses_device_fetch()  ? "device"
                   : cache.uses_copy_stream() ? "host, copy stream"
                                              : "host";
        // What the decode graph prefetches: none with a replayed trace, whatever the setting.
        ph.prefetch = session.decode_prefetch();
        ph.prefetch_fills = ph.prefetch > 0 ? cache.prefetch_fills() : 0;
        const auto prompt =
            random_tokens(np, c.vocab_size, reuse ? 31 : 29 + (phases.size() - first));
        session.truncate(0);
        // A reused prefix is in the KV cache already: only the prompt's last token is timed.
        if (reuse && np > 1) session.eval_last(std::span(prompt).first(size_t(np - 1)));
        if (cold) cache.reset();
        const OffloadStats before = cache.stats();
        auto t0 = std::chrono::steady_clock::now();
        session.eval_last(reuse ? std::span(prompt).last(1) : std::span(prompt));
        ph.ttft_s = seconds_since(t0);
        const OffloadStats mid = cache.stats();
        const auto gen = random_tokens(ng, c.vocab_size, 37);
        t0 = std::chrono::steady_clock::now();
        for (int64_t i = 0; i < ng; ++i) session.eval_last(std::span(gen).subspan(size_t(i), 1));
        const double s = seconds_since(t0);
        const OffloadStats after = cache.stats();
        ph.n_prompt = reuse ? 1 : np;
        ph.n_gen = ng;
        ph.tg_tok_s = ng > 0 ? double(ng) / s : 0.0;
        const OffloadStats decode = after.since(mid);
        ph.prompt_hit_rate = mid.since(before).hit_rate();
        ph.tg_hit_rate = decode.hit_rate();
        const double per_token = ng > 0 ? 1.0 / double(ng) / 1048576.0 : 0.0;
        ph.mib_filled_per_token = double(decode.bytes_filled) * per_token;
        ph.mib_link_per_token = double(decode.bytes_over_link()) * per_token;
        if (link_gbs > 0.0 && ng > 0 && decode.bytes_over_link() > 0)
            ph.link_floor_tok_s = link_gbs * 1e9 * double(ng) / double(decode.bytes_over_link());
        if (ng > 0) ph.prefetched_per_token = double(decode.prefetches) / double(ng);
        if (decode.prefetches > 0)
            ph.prefetch_used = double(decode.prefetch_used) / double(decode.prefetches);
        if (cache.uses_device_fetch() && std::string(m.backend->name()) != "cpu" && ng > 0)
            ph.fetch_wait_ms = double(decode.fetch_ns) / 1e6 / double(ng);
        std::fprintf(
            stderr,
            "minids bench: expert cache %lld slots %s admit %s fetch %s prefetch %d (fills %d), "
            "%-20s first "
            "token %.3f s, tg %.2f tok/s, hit rate prompt %.3f / decode %.3f, %.1f MiB filled and "
            "%.1f MiB over the link per token, %.2f prefetched per token (%.1f%% used), waiting on "
            "the fetch %s ms per token, host bookkeeping %.1f us per token (%.1f beside the "
            "step)\n",
            (long long)ph.slots, ph.policy.c_str(), ph.admit.c_str(), ph.fetch.c_str(), ph.prefetch,
            ph.prefetch_fills, name, ph.ttft_s, ph.tg_tok_s, ph.prompt_hit_rate, ph.tg_hit_rate,
            ph.mib_filled_per_token, ph.mib_link_per_token, ph.prefetched_per_token,
            100.0 * ph.prefetch_used,
            ph.fetch_wait_ms >= 0 ? fmt("%.3f", ph.fetch_wait_ms).c_str() : "-",
            ng > 0 ? double(decode.host_ns) / 1e3 / double(ng) : 0.0,
            ng > 0 ? double(decode.host_beside_ns) / 1e3 / double(ng) : 0.0);
        phases.push_back(ph);
    }
}

int bench(BenchOptions o) {
    const auto interrupt = std::make_unique<InterruptHandler>();
    // The context each test needs, unless -c asks for more.
    int64_t need = 1;
    for (int64_t d : o.depth)
        for (int64_t p : o.n_prompt) need = std::max(need, d + p);
    for (int64_t d : o.depth)
        for (int64_t n : o.n_gen) need = std::max(need, d + n);
    o.model.n_ctx = std::max(o.model.n_ctx, need);
    if (!o.sweep_slots.empty()) {
        if (o.model.expert_cache_slots >= 0)
            throw UserError(
                "--sweep-slots and --expert-cache-slots both set the slot count; "
                "give one of them");
        // The plan must hold the largest pool of the sweep.
        o.model.expert_cache_slots = *std::max_element(o.sweep_slots.begin(), o.sweep_slots.end());
    }
    const bool sweep_settings = !o.sweep_policies.empty() || !o.sweep_admit.empty() ||
                                !o.sweep_fetch.empty() || !o.sweep_prefetch.empty();
    if (sweep_settings && !o.model.expert_cache_requested())
        throw UserError(
            "--sweep-policies, --sweep-admit, --sweep-fetch and --sweep-prefetch need the expert "
            "cache: add --vram-budget, --expert-cache-slots or --sweep-slots");
    LoadedModel m = load_model(o.model, "bench");
    if (!m.expert_cache && sweep_settings)
        std::fprintf(stderr, "minids bench: every expert fits the budget: no cache to sweep\n");
    const ModelConfig& c = m.model->config();
    const bool gpu = std::string(m.backend->name()) != "cpu";
    const double bandwidth = gpu ? mgl::cuda_copy_bandwidth_gbs() : 0.0;
    if (gpu) std::fprintf(stderr, "minids bench: device copy bandwidth %.0f GB/s\n", bandwidth);

    Session session(*m.model, *m.backend, m.session_params);
    attach_expert_cache(m, session);
    RoutingHooks routing(o.routing, m, "bench");
    routing.install(session);

    std::vector<BenchRow> rows;
    for (int64_t d : o.depth) {
        // The depth's context is prefilled once (untimed) and each repetition truncates back to
        // it, so a repetition measures only its own tokens.
        session.truncate(0);
        if (d > 0) {
            std::fprintf(stderr, "minids bench: prefilling a context of %lld tokens ...\n",
                         (long long)d);
            session.eval_last(random_tokens(d, c.vocab_size, 7));
        }
        const std::string at = d > 0 ? " @ d" + std::to_string(d) : "";
        auto run = [&](const std::string& name, int64_t np, int64_t ng) {
            BenchRow r;
            r.test = name + at;
            r.n_prompt = np;
            r.n_gen = ng;
            r.depth = d;
            for (int rep = -1; rep < o.reps; ++rep) {  // rep -1: warm-up (graph capture etc.)
                if (interrupt->requested()) throw UserError("interrupted");
                // New tokens every repetition: with the expert cache, repeating one sequence
                // repeats its routing, and the slots the previous repetition filled all hit (the
                // 12 GiB plan's tg128 read 194 tok/s that way, against 120 in the phase table).
                const uint64_t seed = 1000 * uint64_t(rep + 2);
                const auto prompt = random_tokens(np, c.vocab_size, seed + 11);
                const auto gen = random_tokens(ng, c.vocab_size, seed + 13);
                session.truncate(d);
                const auto t0 = std::chrono::steady_clock::now();
                if (np > 0) session.eval_last(prompt);
                for (int64_t i = 0; i < ng; ++i)
                    session.eval_last(std::span(gen).subspan(size_t(i), 1));
                const double s = seconds_since(t0);
                if (rep >= 0) r.tok_s.push_back(double(np + ng) / s);
            }
            finish(r);
            if (ng > 0 && np == 0 && bandwidth > 0.0)
                r.floor_tok_s = bandwidth * 1e9 / decode_bytes(m, d + ng / 2);
            std::fprintf(stderr, "minids bench: %-20s %10.2f ± %.2f tok/s\n", r.test.c_str(),
                         r.mean, r.sd);
            if (const std::string ec = expert_cache_summary(m); !ec.empty())
                std::fprintf(stderr, "minids bench: %s (totals so far)\n", ec.c_str());
            rows.push_back(r);
        };
        for (int64_t p : o.n_prompt)
            if (p > 0) run("pp" + std::to_string(p), p, 0);
        for (int64_t n : o.n_gen)
            if (n > 0) run("tg" + std::to_string(n), 0, n);
    }
    // With the expert cache: the four phases of issue 10 (cold or warm slots x a new prompt or a
    // reused prefix), each a prompt (or its last token, the prefix being cached) then n decoded
    // tokens; once for the cache as loaded, or once per setting of the sweep.
    std::vector<PhaseRow> phases;
    if (m.expert_cache && !o.n_prompt.empty() && !o.n_gen.empty()) {
        // The ceiling of the cache's traffic: pinned host-to-device copies.
        const double link_gbs = gpu ? mgl::cuda_host_to_device_bandwidth_gbs() : 0.0;
        if (gpu)
            std::fprintf(stderr, "minids bench: host-to-device bandwidth %.1f GB/s\n", link_gbs);
        routing::CacheConfig base = m.expert_cache->config();
        struct Setting {
            routing::CacheConfig cache;
            std::string fetch;
            int prefetch = 0;
        };
        std::vector<Setting> configs;
        const std::vector<int64_t> slot_list =
            o.sweep_slots.empty() ? std::vector<int64_t>{base.n_slots} : o.sweep_slots;
        const std::vector<std::string> policy_list =
            o.sweep_policies.empty() ? std::vector<std::string>{routing::policy_name(base.policy)}
                                     : o.sweep_policies;
        const std::vector<std::string> admit_list =
            o.sweep_admit.empty() ? std::vector<std::string>{routing::admission_name(base.admit)}
                                  : o.sweep_admit;
        const std::vector<std::string> fetch_list =
            o.sweep_fetch.empty() ? std::vector<std::string>{o.model.expert_cache_fetch}
                                  : o.sweep_fetch;
        const std::vector<int> prefetch_list =
            o.sweep_prefetch.empty() ? std::vector<int>{o.model.expert_prefetch} : o.sweep_prefetch;
        for (int64_t n : slot_list) {
            for (const std::string& p : policy_list) {
                for (const std::string& a : admit_list) {
                    routing::CacheConfig cc = base;
                    cc.admit = routing::parse_admission(a);
                    cc.n_slots =
                        int32_t(std::min<int64_t>(n, int64_t(base.n_layers) * base.n_experts));
                    cc.policy = routing::parse_policy(p);
                    for (const std::string& f : fetch_list) {
                        if (f == "device" && cc.admit != routing::Admission::all) {
                            std::fprintf(stderr,
                                         "minids bench: sweep: the device fetch admits every "
                                         "miss; skipping it with admission %s\n",
                                         a.c_str());
                            continue;
                        }
                        for (int pf : prefetch_list) {
                            if (pf > 0 && f == "host") {
                                std::fprintf(stderr,
                                             "minids bench: sweep: prefetch needs the device "
                                             "fetch; skipping prefetch %d with the host fetch\n",
                                             pf);
                                continue;
                            }
                            configs.push_back({cc, f, pf});
                        }
                    }
                }
            }
        }
        const bool sweeping = !o.sweep_slots.empty() || sweep_settings;
        for (const auto& [cc, fetch, prefetch] : configs) {
            if (sweeping) {
                // A fresh cache per setting: the old one's slots are freed first.
                m.expert_cache.reset();
                ModelFlags flags = o.model;
                flags.expert_cache_fetch = fetch;
                flags.expert_prefetch = prefetch;
                if (fetch == "device") flags.expert_cache_copy_stream = false;
                m.expert_cache = make_expert_cache(m, cc, flags, "bench sweep: ");
                attach_expert_cache(m, session);
            }
            run_phases(m, session, o, *interrupt, link_gbs, phases);
        }
    }
    routing.write();

    const std::string model_name = std::filesystem::path(m.file->path()).filename().string();
    double weight_bytes = 0.0;
    for (const auto& t : m.file->tensors()) weight_bytes += double(t.nbytes);
    weight_bytes += double(m.file->experts().blobs.size()) * double(m.file->experts().blob_nbytes);
    uint64_t params = 0;
    for (const auto& t : m.file->tensors()) {
        uint64_t n = 1;
        for (int64_t s : t.shape) n *= uint64_t(s);
        params += n;
    }
    params += uint64_t(m.file->experts().blobs.size()) * 3 * uint64_t(c.hidden_size) *
              uint64_t(c.moe_intermediate_size);
    const std::string experts =
        m.file->experts().present ? mgl::dtype_name(m.file->experts().dtype) : "-";
    const std::string backend = m.backend->name();

    if (o.output == "json") {
        nlohmann::json out = nlohmann::json::array();
        for (const BenchRow& r : rows) {
            out.push_back({{"model", model_name},
                           {"size_bytes", weight_bytes},
                           {"params", params},
                           {"backend", backend},
                           {"expert_dtype", experts},
                           {"kv_type", mgl::dtype_name(m.session_params.kv_type)},
                           {"test", r.test},
                           {"n_prompt", r.n_prompt},
                           {"n_gen", r.n_gen},
                           {"n_depth", r.depth},
                           {"reps", r.tok_s.size()},
                           {"avg_ts", r.mean},
                           {"stddev_ts", r.sd},
                           {"samples_ts", r.tok_s},
                           {"floor_ts", r.floor_tok_s},
                           {"bandwidth_gbs", bandwidth}});
        }
        for (const PhaseRow& ph : phases) {
            out.push_back({{"model", model_name},
                           {"test", "expert cache: " + ph.phase},
                           {"n_prompt", ph.n_prompt},
                           {"n_gen", ph.n_gen},
                           {"slots", ph.slots},
                           {"policy", ph.policy},
                           {"admit", ph.admit},
                           {"fetch", ph.fetch},
                           {"prefetch", ph.prefetch},
                           {"prefetch_fills", ph.prefetch_fills},
                           {"tg_prefetched_per_token", ph.prefetched_per_token},
                           {"tg_prefetch_used_share", ph.prefetch_used},
                           {"ttft_s", ph.ttft_s},
                           {"tg_ts", ph.tg_tok_s},
                           {"prompt_hit_rate", ph.prompt_hit_rate},
                           {"tg_hit_rate", ph.tg_hit_rate},
                           {"tg_mib_filled_per_token", ph.mib_filled_per_token},
                           {"tg_mib_over_link_per_token", ph.mib_link_per_token},
                           {"tg_link_floor_ts", ph.link_floor_tok_s},
                           {"tg_fetch_wait_ms_per_token", ph.fetch_wait_ms},
                           {"tg_fetch_wait_share", ph.fetch_wait_share()}});
        }
        std::printf("%s\n", out.dump(2).c_str());
    } else if (o.output == "csv") {
        std::printf(
            "model,size_bytes,params,backend,expert_dtype,test,n_prompt,n_gen,n_depth,"
            "avg_ts,stddev_ts,floor_ts\n");
        for (const BenchRow& r : rows) {
            std::printf("%s,%.0f,%llu,%s,%s,%s,%lld,%lld,%lld,%.3f,%.3f,%.3f\n", model_name.c_str(),
                        weight_bytes, (unsigned long long)params, backend.c_str(), experts.c_str(),
                        r.test.c_str(), (long long)r.n_prompt, (long long)r.n_gen,
                        (long long)r.depth, r.mean, r.sd, r.floor_tok_s);
        }
    } else {
        std::printf(
            "| model | size | params | backend | experts | KV | test | t/s | floor t/s | "
            "of floor |\n");
        std::printf("| --- | ---: | ---: | --- | --- | --- | ---: | ---: | ---: | ---: |\n");
        for (const BenchRow& r : rows) {
            const bool floor = r.floor_tok_s > 0.0;
            std::printf("| %s | %.2f GiB | %.2f B | %s | %s | %s | %s | %.2f ± %.2f | %s | %s |\n",
                        model_name.c_str(), weight_bytes / double(1ull << 30), double(params) / 1e9,
                        backend.c_str(), experts.c_str(), mgl::dtype_name(m.session_params.kv_type),
                        r.test.c_str(), r.mean, r.sd,
                        floor ? fmt("%.0f", r.floor_tok_s).c_str() : "-",
                        floor ? fmt("%.0f%%", 100.0 * r.mean / r.floor_tok_s).c_str() : "-");
        }
        if (!phases.empty()) {
            const auto& cc = m.expert_cache->config();
            std::printf("\nexpert cache: %s pool%s\n\n", cc.per_layer ? "per-layer" : "global",
                        cc.per_layer ? "s" : "");
            std::printf(
                "| slots | policy | admit | fetch | prefetch | phase | prompt | first token s | tg "
                "| "
                "tg t/s | link floor t/s | hit rate prompt | hit rate tg | MiB filled / token | "
                "MiB over link / token | prefetched / token (used) | fetch wait ms / token | fetch "
                "wait share |\n");
            std::printf(
                "| ---: | --- | --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | "
                "---: | ---: | ---: | ---: | ---: | ---: |\n");
            for (const PhaseRow& ph : phases) {
                const bool timed = ph.fetch_wait_share() >= 0;
                const std::string prefetched =
                    ph.prefetch > 0 ? fmt("%.2f", ph.prefetched_per_token) + " (" +
                                          fmt("%.0f%%", 100.0 * ph.prefetch_used) + ")"
                                    : "-";
                // "6 (1 fill)": the top 6 predicted, at most 1 copied (--expert-prefetch-fills).
                const std::string prefetch =
                    std::to_string(ph.prefetch) +
                    (ph.prefetch_fills > 0 && ph.prefetch_fills < ph.prefetch
                         ? " (" + std::to_string(ph.prefetch_fills) +
                               (ph.prefetch_fills > 1 ? " fills)" : " fill)")
                         : "");
                std::printf(
                    "| %lld | %s | %s | %s | %s | %s | %lld | %.3f | %lld | %.2f | %s | %.3f | "
                    "%.3f | %.1f | %.1f | %s | %s | %s |\n",
                    (long long)ph.slots, ph.policy.c_str(), ph.admit.c_str(), ph.fetch.c_str(),
                    prefetch.c_str(), ph.phase.c_str(), (long long)ph.n_prompt, ph.ttft_s,
                    (long long)ph.n_gen, ph.tg_tok_s,
                    ph.link_floor_tok_s > 0 ? fmt("%.1f", ph.link_floor_tok_s).c_str() : "-",
                    ph.prompt_hit_rate, ph.tg_hit_rate, ph.mib_filled_per_token,
                    ph.mib_link_per_token, prefetched.c_str(),
                    timed ? fmt("%.3f", ph.fetch_wait_ms).c_str() : "-",
                    timed ? fmt("%.1f%%", 100.0 * ph.fetch_wait_share()).c_str() : "-");
            }
        }
    }
    return exit_ok;
}

}  // namespace

void add_bench_command(CLI::App& app, int& exit_code) {
    auto* cmd = app.add_subcommand(
        "bench",
        "benchmark prompt processing (ppN) and text generation (tgN) like llama-bench: tok/s "
        "mean ± sd over repetitions after a warm-up, with the memory-bandwidth floor for tg");
    auto opts = std::make_shared<BenchOptions>();
    add_model_flags(*cmd, opts->model);
    cmd->add_option("-p,--n-prompt", opts->n_prompt,
                    "prompt lengths to time, comma-separated (0: no pp test)")
        ->delimiter(',')
        ->capture_default_str()
        ->check(CLI::Range(int64_t(0), int64_t(1) << 20));
    cmd->add_option("-n,--n-gen", opts->n_gen,
                    "numbers of tokens to generate, comma-separated (0: no tg test)")
        ->delimiter(',')
        ->capture_default_str()
        ->check(CLI::Range(int64_t(0), int64_t(1) << 20));
    cmd->add_option("-d,--n-depth", opts->depth,
                    "context depths: tokens already in the cache before each test, comma-"
                    "separated")
        ->delimiter(',')
        ->capture_default_str()
        ->check(CLI::Range(int64_t(0), int64_t(1) << 20));
    cmd->add_option("-r,--repetitions", opts->reps, "timed repetitions of each test")
        ->capture_default_str()
        ->check(CLI::Range(1, 1000));
    cmd->add_option("-o,--output", opts->output, "output format: md, json or csv")
        ->capture_default_str()
        ->check(CLI::IsMember({"md", "json", "csv"}));
    cmd->add_option("--sweep-slots", opts->sweep_slots,
                    "expert cache: run the four offload phases once per slot count, comma-"
                    "separated (the memory plan is made for the largest; turns the cache on)")
        ->delimiter(',')
        ->check(CLI::Range(int64_t(1), int64_t(1) << 24));
    cmd->add_option("--sweep-admit", opts->sweep_admit,
                    "expert cache: run the four offload phases once per admission rule, comma-"
                    "separated (all, frequency)")
        ->delimiter(',')
        ->check(CLI::IsMember({"all", "frequency"}));
    cmd->add_option("--sweep-fetch", opts->sweep_fetch,
                    "expert cache: run the four offload phases once per fetch mode, comma-"
                    "separated (host, device; device only with admission all)")
        ->delimiter(',')
        ->check(CLI::IsMember({"host", "device"}));
    cmd->add_option("--sweep-prefetch", opts->sweep_prefetch,
                    "expert cache: run the four offload phases once per --expert-prefetch "
                    "count, comma-separated (0: off; not with the host fetch)")
        ->delimiter(',')
        ->check(CLI::Range(0, 64));
    cmd->add_option("--sweep-policies", opts->sweep_policies,
                    "expert cache: run the four offload phases once per policy, comma-separated "
                    "(lru, lfu, decay)")
        ->delimiter(',')
        ->check(CLI::IsMember({"lru", "lfu", "decay"}));
    add_routing_flags(*cmd, opts->routing);
    cmd->callback(
        [opts, &exit_code] { exit_code = run_guarded("bench", [&] { return bench(*opts); }); });
}

}  // namespace minids::cli
