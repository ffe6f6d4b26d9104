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
                   "shown as policy@device) or both")
        ->capture_default_str()
        ->check(CLI::IsMember({"host", "device", "both"}));
    cmd.add_flag("--decode", o.decode,
                 "device fetch: every token its own forward pass, as if the text were decoded "
                 "token by token (by default a recorded prompt chunk is one pass, as in the run)");
    cmd.add_option("--decay-half-life", o.decay_half_life,
                   "decay: a count halves every this many accesses to its layer's experts "
                   "(top-k per token)")
        ->capture_default_str()
        ->check(CLI::PositiveNumber);
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

std::vector<SweepRow> run_sweep(const RoutingTrace& tr, const SweepOptions& o) {
    const std::vector<Policy> policies =
        parse_names(o.policies, parse_policy, "--policy", "at least one policy");
    std::vector<std::pair<std::string, int64_t>> slots;
    for (const auto& s : split_list(o.slots)) slots.emplace_back(s, parse_slots(s, tr));
    if (slots.empty()) throw UserError("--slots: expected at least one cache size");
    const std::vector<Admission> admissions =
        parse_names(o.admit, parse_admission, "--admit", "all, frequency or both");
    std::vector<int32_t> next;
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
                        rows.push_back(row);
                        continue;
                    }
                    if (o.fetch != "device") {
                        if (p == Policy::belady && next.empty()) next = next_uses(tr);
                        row.result = simulate(tr, c, p == Policy::belady ? &next : nullptr);
                        rows.push_back(row);
                    }
                    // The device fetch: where the engine can run it.
                    if (o.fetch != "host" && !per_layer && a == Admission::all &&
                        policy_is_online(p)) {
                        row.result = simulate_device_fetch(tr, c, o.decode);
                        rows.push_back(std::move(row));
                    }
                }
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
    cmd->add_option("--tokens", o->tokens, "which tokens: all, prefill or decode")
        ->capture_default_str();
    cmd->add_option("-o,--output", o->format, "md, json or csv")->capture_default_str();
    cmd->callback([o, &exit_code] {
        exit_code = guarded("routing sim", [&] {
            const ReportFormat f = parse_report_format(o->format);
            const RoutingTrace tr = load_selected(o->trace, o->tokens);
            print(format_sweep(tr, run_sweep(tr, o->sweep), f));
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
    cmd->callback([o, &exit_code] {
        exit_code = guarded("routing gen", [&] {
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
            write_trace(tr, o->out);
            std::fprintf(
                stderr, "minids routing gen: wrote %lld tokens x %d MoE layers x top-%d to %s\n",
                (long long)tr.n_tokens, tr.shape.n_moe_layers(), tr.shape.top_k, o->out.c_str());
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
