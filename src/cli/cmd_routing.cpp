// minids routing: statistics of routing traces, the expert-cache simulator, the synthetic
// trace generator and its fit to a recorded trace. Tables go to stdout, messages to stderr.
#include <cstdio>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "cli/model_session.h"
#include "cli/routing_report.h"
#include "routing/prefetch.h"
#include "routing/simulator.h"
#include "routing/synthetic.h"
#include "routing/trace.h"
#include "routing/trace_stats.h"

namespace minids::cli {

using namespace minids::routing;

namespace {

std::vector<std::string> split_list(const std::string& s) {
    std::vector<std::string> out;
    std::stringstream ss(s);
    std::string item;
    while (std::getline(ss, item, ',')) {
        if (!item.empty()) out.push_back(item);
    }
    return out;
}

double parse_number(const std::string& s, const std::string& flag) {
    size_t used = 0;
    double v = 0;
    try {
        v = std::stod(s, &used);
    } catch (const std::exception&) {
        used = 0;
    }
    if (s.empty() || used != s.size())
        throw UserError(flag + ": expected a number, found \"" + s + "\"");
    return v;
}

std::vector<double> parse_numbers(const std::string& s, const std::string& flag) {
    std::vector<double> v;
    for (const auto& item : split_list(s)) v.push_back(parse_number(item, flag));
    if (v.empty()) throw UserError(flag + ": expected a number or a comma-separated list");
    return v;
}

// "208" (slots), "25%" (of all experts), "8/layer" (slots per MoE layer).
int64_t parse_slots(const std::string& s, const RoutingTrace& tr) {
    const int64_t L = tr.shape.n_moe_layers(), all = L * tr.shape.n_experts;
    int64_t n = 0;
    if (s.size() > 1 && s.back() == '%') {
        const double pct = parse_number(s.substr(0, s.size() - 1), "--slots");
        if (!(pct > 0 && pct <= 100)) throw UserError("--slots: a percentage must be in (0, 100]");
        n = std::max<int64_t>(1, int64_t(std::llround(pct / 100.0 * double(all))));
    } else if (s.size() > 6 && s.substr(s.size() - 6) == "/layer") {
        const double per = parse_number(s.substr(0, s.size() - 6), "--slots");
        if (!(per >= 1) || per != std::floor(per))
            throw UserError("--slots: N/layer needs a whole N >= 1");
        n = int64_t(per) * L;
    } else {
        const double v = parse_number(s, "--slots");
        if (!(v >= 1) || v != std::floor(v))
            throw UserError(
                "--slots: expected a whole number of slots >= 1, N% or N/layer, found \"" + s +
                "\"");
        n = int64_t(v);
    }
    if (n > all) {
        throw UserError("--slots " + s + ": " + std::to_string(n) + " slots are more than the " +
                        std::to_string(all) + " experts of the trace");
    }
    return n;
}

std::vector<bool> parse_pools(const std::string& s, bool per_layer_flag) {
    if (per_layer_flag) return {true};
    if (s == "global") return {false};
    if (s == "per-layer") return {true};
    if (s == "both") return {false, true};
    throw UserError("--pools: expected global, per-layer or both, found \"" + s + "\"");
}

RoutingTrace load_selected(const std::string& path, const std::string& tokens) {
    RoutingTrace tr = read_trace(path);
    if (tokens != "all" && tokens != "prefill" && tokens != "decode")
        throw UserError("--tokens: expected all, prefill or decode, found \"" + tokens + "\"");
    tr = select_tokens(tr, tokens);
    if (tr.n_tokens == 0) throw UserError("the trace has no " + tokens + " tokens");
    return tr;
}

struct SweepOptions {
    std::string slots = "10%,25%,50%";
    std::string policies = "lru,lfu,decay,belady";
    std::string pools = "global";
    bool per_layer = false;
    double decay_half_life = 128;
    std::string admit = "all";
    std::string fetch = "host";
    bool decode = false;
    // Prefetch and its timing model (routing sim only): a second table when --prefetch is given.
    std::string predictions, prefetch, layer_us = "50,26", queue = "demand-first";
    uint64_t expert_bytes = 0;  // 0: the trace's
    double link_gbs = TimingModel{}.link_gbs, fetch_us = TimingModel{}.fetch_us;
};

void add_sweep_flags(CLI::App& cmd, SweepOptions& o) {
    cmd.add_option("--slots", o.slots,
                   "cache sizes to simulate, comma-separated: N slots, P% of all experts, or "
                   "N/layer (N slots per MoE layer)")
        ->capture_default_str();
    cmd.add_option("--policy", o.policies,
                   "policies, comma-separated: lru, lfu (counts survive eviction, ties by "
                   "recency), decay (exponentially decayed counts), belady (optimal offline "
                   "bound)")
        ->capture_default_str();
    cmd.add_option("--pools", o.pools,
                   "global (one pool shared by all MoE layers), per-layer (a fixed share of the "
                   "slots per layer) or both")
        ->capture_default_str();
    cmd.add_flag("--per-layer", o.per_layer, "same as --pools per-layer");
    cmd.add_option("--admit", o.admit,
                   "which misses take a slot, comma-separated: all, or frequency (only a miss "
                   "the policy ranks above its victim; the others are used once without being "
                   "cached; shown as policy+admit, belady+admit being the optimum with bypass)")
        ->capture_default_str();
    cmd.add_option("--fetch", o.fetch,
                   "host (the simulator's rules above, the engine's host fetch), device (the "
                   "engine's device fetch: victims fixed before each forward pass, misses "
                   "without one read in place; global pools, online policies, admission all; "
                   "shown as policy@device), both, or staging (the device fetch with the staging "
                   "store's rules: victims for every miss, prompts included, none re-evicted by "
                   "rank; at least one slot per expert of a layer; shown as policy@staging)")
        ->capture_default_str()
        ->check(CLI::IsMember({"host", "device", "both", "staging"}));
    cmd.add_flag("--decode", o.decode,
                 "device fetch: every token its own forward pass, as if the text were decoded "
                 "token by token (by default a recorded prompt chunk is one pass, as in the run)");
    cmd.add_option("--decay-half-life", o.decay_half_life,
                   "decay: a count halves every this many accesses to its layer's experts "
                   "(top-k per token)")
        ->capture_default_str()
        ->check(CLI::PositiveNumber);
}

void add_prefetch_flags(CLI::App& cmd, SweepOptions& o) {
    cmd.add_option("--predictions", o.predictions,
                   "the next layers' experts predicted by their routers, <i2 [T, L, D, k] .npy "
                   "(record_routing_text --predict, routing gen --predictions-out); -1 past the "
                   "last layer");
    cmd.add_option("--prefetch", o.prefetch,
                   "prefetch depths to simulate, comma-separated (0: off): once layer l's router "
                   "has run, the experts predicted for layers l+1..l+D that are not in slots are "
                   "loaded, never evicting layer l's or the predicted layer l+1's; prints a "
                   "second table with prefetches used / wasted, bytes over the link and the "
                   "timing model (depth > 0 needs --predictions, host fetch, online policies)");
    cmd.add_option("--link-gbs", o.link_gbs,
                   "timing model: GB/s of the host-to-GPU link (49: what the engine's device "
                   "fetch measured; 55: the pinned copy peak)")
        ->capture_default_str()
        ->check(CLI::PositiveNumber);
    cmd.add_option("--layer-us", o.layer_us,
                   "timing model: A,M = us per layer of the attention/dense part and of the MoE "
                   "part at full hit (H200 resident V2-Lite decode: 27 x 76 us)")
        ->capture_default_str();
    cmd.add_option("--fetch-us", o.fetch_us,
                   "timing model: us per MoE layer for the fetch's own launches before the "
                   "misses are issued (the engine's every-hit gap)")
        ->capture_default_str()
        ->check(CLI::NonNegativeNumber);
    cmd.add_option("--expert-bytes", o.expert_bytes,
                   "timing model: bytes of one expert in place of the trace's (e.g. 8670208, a "
                   "V2-Lite FP8 expert, to time a small model's routing at V2-Lite's cost)");
    cmd.add_option("--queue", o.queue,
                   "timing model: demand-first (a layer's misses go ahead of prefetches not yet "
                   "started), fifo (they wait behind them) or both")
        ->capture_default_str()
        ->check(CLI::IsMember({"demand-first", "fifo", "both"}));
}

// Each name of a comma-separated flag value through `parse`; a bad or missing one is the
// flag's one-line error.
template <class T>
std::vector<T> parse_names(const std::string& text, T (*parse)(const std::string&),
                           const char* flag, const char* expected) {
    std::vector<T> out;
    for (const auto& name : split_list(text)) {
        try {
            out.push_back(parse(name));
        } catch (const std::invalid_argument& e) {
            throw UserError(std::string(flag) + ": " + e.what());
        }
    }
    if (out.empty()) throw UserError(std::string(flag) + ": expected " + expected);
    return out;
}

// The configurations of a sweep, in table order (pools, slots, admission, policy), not yet run;
// those that cannot work carry the reason in `skipped`.
std::vector<SweepRow> run_sweep_configs(const RoutingTrace& tr, const SweepOptions& o) {
    const std::vector<Policy> policies =
        parse_names(o.policies, parse_policy, "--policy", "at least one policy");
    std::vector<std::pair<std::string, int64_t>> slots;
    for (const auto& s : split_list(o.slots)) slots.emplace_back(s, parse_slots(s, tr));
    if (slots.empty()) throw UserError("--slots: expected at least one cache size");
    const std::vector<Admission> admissions =
        parse_names(o.admit, parse_admission, "--admit", "all, frequency or both");
    std::vector<SweepRow> rows;
    for (bool per_layer : parse_pools(o.pools, o.per_layer)) {
        for (const auto& [label, n] : slots) {
            for (Admission a : admissions) {
                for (Policy p : policies) {
                    SweepRow row;
                    row.slots_label = label;
                    CacheConfig& c = row.result.config;
                    c.policy = p;
                    c.admit = a;
                    c.n_slots = n;
                    c.per_layer = per_layer;
                    c.n_layers = tr.shape.n_moe_layers();
                    c.n_experts = tr.shape.n_experts;
                    c.decay_half_life = o.decay_half_life;
                    try {
                        check_config(c, tr.shape.top_k);
                    } catch (const std::invalid_argument& e) {
                        row.skipped =
                            std::string(e.what()).substr(std::string("expert cache: ").size());
                    }
                    rows.push_back(std::move(row));
                }
            }
        }
    }
    return rows;
}

std::vector<SweepRow> run_sweep(const RoutingTrace& tr, const SweepOptions& o) {
    std::vector<int32_t> next;
    std::vector<SweepRow> rows;
    for (SweepRow& row : run_sweep_configs(tr, o)) {
        if (!row.skipped.empty()) {
            rows.push_back(row);
            continue;
        }
        const CacheConfig c = row.result.config;
        const Policy p = c.policy;
        if (o.fetch == "host" || o.fetch == "both") {
            if (p == Policy::belady && next.empty()) next = next_uses(tr);
            row.result = simulate(tr, c, p == Policy::belady ? &next : nullptr);
            rows.push_back(row);
        }
        // The device fetch: where the engine can run it.
        if (o.fetch != "host" && !c.per_layer && c.admit == Admission::all && policy_is_online(p)) {
            const bool staging = o.fetch == "staging";
            if (staging && c.n_slots < c.n_experts) {
                row.skipped = "the staging store needs " + std::to_string(c.n_experts) + " slots";
            } else {
                row.result = simulate_device_fetch(tr, c, o.decode, staging);
            }
            rows.push_back(std::move(row));
        }
    }
    return rows;
}

std::vector<PrefetchRow> run_prefetch_sweep(const RoutingTrace& tr, const Predictions* pred,
                                            const SweepOptions& o) {
    if (o.fetch != "host")
        throw UserError(
            "--prefetch simulates the host rules (--fetch host); the device fetch's hit rates "
            "match them within 0.001 for lfu and decay (docs/expert-cache-policies.md)");
    std::vector<int32_t> depths;
    for (double d : parse_numbers(o.prefetch, "--prefetch")) {
        if (!(d >= 0) || d != std::floor(d) || d > 4096)
            throw UserError("--prefetch: expected whole depths >= 0");
        if (d > 0 && !pred) throw UserError("--prefetch " + o.prefetch + ": needs --predictions");
        if (d > 0 && int32_t(d) > pred->depth)
            throw UserError("--prefetch " + std::to_string(int32_t(d)) +
                            ": the predictions reach only " + std::to_string(pred->depth) +
                            " layer(s) ahead");
        depths.push_back(int32_t(d));
    }
    const std::vector<double> layer = parse_numbers(o.layer_us, "--layer-us");
    if (layer.size() != 2 || !(layer[0] >= 0) || !(layer[1] >= 0))
        throw UserError("--layer-us: expected A,M (two times in us, >= 0)");
    TimingModel tm;
    tm.link_gbs = o.link_gbs;
    tm.attn_us = layer[0];
    tm.moe_us = layer[1];
    tm.fetch_us = o.fetch_us;
    std::vector<bool> queues;
    if (o.queue != "fifo") queues.push_back(true);
    if (o.queue != "demand-first") queues.push_back(false);
    std::vector<PrefetchRow> rows;
    std::vector<int32_t> next;
    for (const SweepRow& base : run_sweep_configs(tr, o)) {
        for (int32_t d : depths) {
            for (bool demand_first : queues) {
                PrefetchRow row;
                row.slots_label = base.slots_label;
                row.result.sim.config = base.result.config;
                row.result.depth = d;
                row.skipped = base.skipped;
                const CacheConfig& c = base.result.config;
                if (row.skipped.empty() && d > 0 && !policy_is_online(c.policy))
                    row.skipped = "prefetch needs an online policy";
                if (!row.skipped.empty()) {
                    rows.push_back(row);
                    continue;
                }
                tm.demand_first = demand_first;
                if (c.policy == Policy::belady && next.empty()) next = next_uses(tr);
                row.result = simulate_prefetch(tr, c, pred, d, tm,
                                               c.policy == Policy::belady ? &next : nullptr);
                rows.push_back(std::move(row));
            }
        }
    }
    return rows;
}

// Runs body; trace and argument errors are one line and exit code 2.
int guarded(const char* what, const std::function<int()>& body) {
    return run_guarded(what, [&] {
        try {
            return body();
        } catch (const TraceError& e) {
            throw UserError(e.what());
        } catch (const std::invalid_argument& e) {
            throw UserError(e.what());
        }
    });
}

void print(const std::string& s) {
    std::fwrite(s.data(), 1, s.size(), stdout);
    std::fflush(stdout);
}

void add_stats(CLI::App& routing, int& exit_code) {
    struct Opts {
        std::string trace, tokens = "all", format = "md";
    };
    auto o = std::make_shared<Opts>();
    auto* cmd = routing.add_subcommand(
        "stats",
        "per MoE layer: expert popularity, entropy, next-token overlap, reuse "
        "distances, cross-layer predictability");
    cmd->add_option("TRACE", o->trace, "routing trace (.npz)")->required();
    cmd->add_option("--tokens", o->tokens, "which tokens: all, prefill or decode")
        ->capture_default_str();
    cmd->add_option("-o,--output", o->format, "md, json or csv")->capture_default_str();
    cmd->callback([o, &exit_code] {
        exit_code = guarded("routing stats", [&] {
            const ReportFormat f = parse_report_format(o->format);
            const RoutingTrace tr = load_selected(o->trace, o->tokens);
            print(format_stats(tr, compute_stats(tr), f));
            return exit_ok;
        });
    });
}

void add_sim(CLI::App& routing, int& exit_code) {
    struct Opts {
        std::string trace, tokens = "all", format = "md";
        SweepOptions sweep;
    };
    auto o = std::make_shared<Opts>();
    auto* cmd = routing.add_subcommand(
        "sim",
        "simulate the expert cache on a trace: hit rate, misses and bytes per token, per "
        "layer and overall, for each policy and cache size (a sweep table)");
    cmd->add_option("TRACE", o->trace, "routing trace (.npz)")->required();
    add_sweep_flags(*cmd, o->sweep);
    add_prefetch_flags(*cmd, o->sweep);
    cmd->add_option("--tokens", o->tokens, "which tokens: all, prefill or decode")
        ->capture_default_str();
    cmd->add_option("-o,--output", o->format, "md, json or csv")->capture_default_str();
    cmd->callback([o, &exit_code] {
        exit_code = guarded("routing sim", [&] {
            const ReportFormat f = parse_report_format(o->format);
            if (o->sweep.prefetch.empty()) {
                if (!o->sweep.predictions.empty())
                    throw UserError("--predictions: give --prefetch D to use them");
                const RoutingTrace tr = load_selected(o->trace, o->tokens);
                print(format_sweep(tr, run_sweep(tr, o->sweep), f));
                return exit_ok;
            }
            // Predictions are checked against the whole trace, then cut like it.
            const RoutingTrace all = load_selected(o->trace, "all");
            std::unique_ptr<Predictions> pred;
            if (!o->sweep.predictions.empty()) {
                pred = std::make_unique<Predictions>(read_predictions(o->sweep.predictions, all));
                *pred = select_predictions(*pred, all, o->tokens);
            }
            RoutingTrace tr = load_selected(o->trace, o->tokens);
            if (o->sweep.expert_bytes) tr.shape.expert_bytes = o->sweep.expert_bytes;
            print(format_prefetch(tr, run_prefetch_sweep(tr, pred.get(), o->sweep), f));
            return exit_ok;
        });
    });
}

void add_gen(CLI::App& routing, int& exit_code) {
    struct Opts {
        std::string out, preset = "v2-lite", zipf = "0", stickiness = "0", cross = "0";
        int32_t experts = 0, top_k = 0, layers = 0;
        uint64_t expert_bytes = 0;
        int64_t tokens = 10000;
        uint64_t seed = 1;
        double weight_sum = 1.0;
        std::string predict_accuracy, predictions_out;
        int32_t predict_depth = 1;
    };
    auto o = std::make_shared<Opts>();
    auto* cmd = routing.add_subcommand(
        "gen",
        "write a synthetic routing trace: Zipf popularity per layer, stickiness to the "
        "previous token's experts, correlation with the previous layer's experts");
    cmd->add_option("OUT", o->out, "trace file to write (.npz)")->required();
    cmd->add_option("--preset", o->preset,
                    "model shape: v2-lite (64 experts, top-6, 26 MoE layers), v2 (160, top-6, "
                    "59), demo (32, top-4, 5)")
        ->capture_default_str();
    cmd->add_option("--experts", o->experts, "routed experts per layer (overrides the preset)")
        ->check(CLI::Range(1, 65536));
    cmd->add_option("--top-k", o->top_k, "experts per token (overrides the preset)")
        ->check(CLI::Range(1, 65536));
    cmd->add_option("--layers", o->layers, "MoE layers, numbered from 1 (overrides the preset)")
        ->check(CLI::Range(1, 4096));
    cmd->add_option("--expert-bytes", o->expert_bytes,
                    "bytes of one expert (overrides the preset's FP8 size)");
    cmd->add_option("-n,--tokens", o->tokens, "tokens to generate")
        ->capture_default_str()
        ->check(CLI::Range(int64_t(1), int64_t(1) << 32));
    cmd->add_option("--zipf", o->zipf,
                    "popularity skew: Zipf exponent, one value or one per MoE layer (0: uniform)")
        ->capture_default_str();
    cmd->add_option("--stickiness", o->stickiness,
                    "probability that an expert pick reuses one of the previous token's experts "
                    "in the same layer (one value or one per layer)")
        ->capture_default_str();
    cmd->add_option("--cross-layer", o->cross,
                    "probability that a pick is the fixed partner of one of this token's "
                    "experts in the previous MoE layer (one value or one per layer)")
        ->capture_default_str();
    cmd->add_option("-s,--seed", o->seed, "random seed")->capture_default_str();
    cmd->add_option("--weight-sum", o->weight_sum, "sum of a token's k routing weights")
        ->capture_default_str()
        ->check(CLI::PositiveNumber);
    cmd->add_option("--predict-accuracy", o->predict_accuracy,
                    "with --predictions-out: the share of the real experts a prediction keeps, "
                    "one value A (A^d for d layers ahead) or one per depth (the demo model's "
                    "routers: 0.71,0.63,0.61,0.55); the others are random experts outside the "
                    "real set");
    cmd->add_option("--predict-depth", o->predict_depth,
                    "with --predictions-out: layers ahead to predict (D)")
        ->capture_default_str()
        ->check(CLI::Range(1, 4095));
    cmd->add_option("--predictions-out", o->predictions_out,
                    "also write predictions of the next D layers' experts, <i2 [T, L, D, k] .npy "
                    "as record_routing_text --predict writes them (for routing sim --prefetch)");
    cmd->callback([o, &exit_code] {
        exit_code = guarded("routing gen", [&] {
            if (o->predictions_out.empty() != o->predict_accuracy.empty())
                throw UserError("--predict-accuracy and --predictions-out go together");
            SynthParams p;
            p.shape = preset_shape(o->preset);
            if (o->experts) p.shape.n_experts = o->experts;
            if (o->top_k) p.shape.top_k = o->top_k;
            if (o->layers) {
                p.shape.moe_layers.clear();
                for (int32_t l = 1; l <= o->layers; ++l) p.shape.moe_layers.push_back(l);
            }
            if (o->expert_bytes) p.shape.expert_bytes = o->expert_bytes;
            p.n_tokens = o->tokens;
            p.seed = o->seed;
            p.zipf = parse_numbers(o->zipf, "--zipf");
            p.stickiness = parse_numbers(o->stickiness, "--stickiness");
            p.cross_layer = parse_numbers(o->cross, "--cross-layer");
            p.weight_sum = o->weight_sum;
            validate_shape(p.shape, "gen");
            RoutingTrace tr = generate_trace(p);
            tr.extra["preset"] = o->preset;
            Predictions pred;
            if (!o->predictions_out.empty())  // made first: a bad flag writes nothing
                pred = generate_predictions(
                    tr, parse_numbers(o->predict_accuracy, "--predict-accuracy"), o->predict_depth,
                    o->seed);
            write_trace(tr, o->out);
            std::fprintf(
                stderr, "minids routing gen: wrote %lld tokens x %d MoE layers x top-%d to %s\n",
                (long long)tr.n_tokens, tr.shape.n_moe_layers(), tr.shape.top_k, o->out.c_str());
            if (!o->predictions_out.empty()) {
                write_predictions(pred, o->predictions_out);
                std::fprintf(stderr,
                             "minids routing gen: wrote predictions %d layer(s) ahead to %s\n",
                             pred.depth, o->predictions_out.c_str());
            }
            return exit_ok;
        });
    });
}

void add_fit(CLI::App& routing, int& exit_code) {
    struct Opts {
        std::string trace, tokens = "all", format = "md", save;
        int rounds = 10;
        uint64_t seed = 1;
        SweepOptions sweep;
    };
    auto o = std::make_shared<Opts>();
    o->sweep.policies = "lru,lfu,decay,belady";
    o->sweep.pools = "both";
    auto* cmd = routing.add_subcommand(
        "fit",
        "fit the generator's parameters (Zipf skew, stickiness, cross-layer) to a "
        "recorded trace, and compare the hit-rate curves of the recorded and generated "
        "traces");
    cmd->add_option("TRACE", o->trace, "recorded routing trace (.npz)")->required();
    cmd->add_option("--tokens", o->tokens, "which tokens: all, prefill or decode")
        ->capture_default_str();
    cmd->add_option("--rounds", o->rounds, "bisection steps per parameter and pass")
        ->capture_default_str()
        ->check(CLI::Range(1, 40));
    cmd->add_option("-s,--seed", o->seed, "random seed of the generated traces")
        ->capture_default_str();
    cmd->add_option("--save", o->save, "also write the generated trace to this file");
    add_sweep_flags(*cmd, o->sweep);
    cmd->add_option("-o,--output", o->format, "md or json")->capture_default_str();
    cmd->callback([o, &exit_code] {
        exit_code = guarded("routing fit", [&] {
            const ReportFormat f = parse_report_format(o->format);
            if (f == ReportFormat::csv) throw UserError("-o: fit prints md or json");
            const RoutingTrace rec = load_selected(o->trace, o->tokens);
            FitResult fit = fit_trace(rec, o->rounds, o->seed);
            RoutingTrace gen = generate_trace(fit.params);
            if (!o->save.empty()) write_trace(gen, o->save);
            print(format_fit(fit, run_sweep(rec, o->sweep), run_sweep(gen, o->sweep), f));
            return exit_ok;
        });
    });
}

}  // namespace

void add_routing_command(CLI::App& app, int& exit_code) {
    auto* routing =
        app.add_subcommand("routing",
                           "routing traces: stats, expert-cache simulation (sim), synthetic traces "
                           "(gen) and fitting them to recorded ones (fit)");
    routing->require_subcommand(1);
    add_stats(*routing, exit_code);
    add_sim(*routing, exit_code);
    add_gen(*routing, exit_code);
    add_fit(*routing, exit_code);
}

}  // namespace minids::cli
