#include "cli/routing_report.h"

#include <cmath>
#include <cstdio>
#include <map>
#include <stdexcept>

#include <nlohmann/json.hpp>

namespace minids::cli {

using namespace minids::routing;

namespace {

std::string fmt(const char* f, double v) {
    char b[64];
    std::snprintf(b, sizeof b, f, v);
    return b;
}

std::string pools_name(const CacheConfig& c) { return c.per_layer ? "per-layer" : "global"; }

// The policy as the tables name it: "decay", "decay+admit" with frequency admission,
// "decay@device" for the engine's device fetch and "decay@staging" for it with the staging store.
std::string policy_label(const SimResult& r) {
    const CacheConfig& c = r.config;
    return std::string(policy_name(c.policy)) + (c.admit == Admission::frequency ? "+admit" : "") +
           (r.staging        ? "@staging"
            : r.device_fetch ? "@device"
                             : "");
}

double cached_fraction(const RoutingTrace& tr, int64_t slots) {
    return double(slots) / (double(tr.shape.n_moe_layers()) * tr.shape.n_experts);
}

std::string trace_line(const RoutingTrace& tr) {
    return std::to_string(tr.n_tokens) + " tokens, " + std::to_string(tr.shape.n_moe_layers()) +
           " MoE layers, " + std::to_string(tr.shape.n_experts) + " experts, top-" +
           std::to_string(tr.shape.top_k) + ", " +
           fmt("%.1f", double(tr.shape.expert_bytes) / 1024) + " KiB per expert";
}

nlohmann::json trace_json(const RoutingTrace& tr) {
    return {{"n_tokens", tr.n_tokens},
            {"n_experts", tr.shape.n_experts},
            {"top_k", tr.shape.top_k},
            {"moe_layers", tr.shape.moe_layers},
            {"expert_bytes", tr.shape.expert_bytes},
            {"source", tr.source}};
}

std::string csv_join(const std::vector<std::string>& cells) {
    std::string s;
    for (size_t i = 0; i < cells.size(); ++i) s += (i ? "," : "") + cells[i];
    return s + "\n";
}

std::string md_row(const std::vector<std::string>& cells) {
    std::string s = "|";
    for (const auto& c : cells) s += " " + c + " |";
    return s + "\n";
}

std::string md_rule(size_t n) {
    std::string s = "|";
    for (size_t i = 0; i < n; ++i) s += "---|";
    return s + "\n";
}

// Belady's hit rate for the same pools and slots, when the sweep has it.
const SimResult* belady_for(const std::vector<SweepRow>& rows, const SweepRow& r) {
    for (const auto& o : rows) {
        if (o.skipped.empty() && o.result.config.policy == Policy::belady &&
            o.result.config.admit == Admission::all && !o.result.device_fetch &&
            o.result.config.per_layer == r.result.config.per_layer &&
            o.result.config.n_slots == r.result.config.n_slots)
            return &o.result;
    }
    return nullptr;
}

nlohmann::json row_json(const RoutingTrace& tr, const SweepRow& r) {
    const CacheConfig& c = r.result.config;
    nlohmann::json j = {{"pools", pools_name(c)},
                        {"slots", c.n_slots},
                        {"slots_label", r.slots_label},
                        {"cached_fraction", cached_fraction(tr, c.n_slots)},
                        {"policy", policy_name(c.policy)},
                        {"admit", admission_name(c.admit)},
                        {"fetch", r.result.device_fetch ? "device" : "host"}};
    if (!r.skipped.empty()) {
        j["skipped"] = r.skipped;
        return j;
    }
    if (c.policy == Policy::decay) j["decay_half_life"] = c.decay_half_life;
    j["hit_rate"] = r.result.hit_rate();
    j["hits"] = r.result.hits;
    j["accesses"] = r.result.accesses;
    j["misses_per_token"] = r.result.misses_per_token();
    j["bytes_per_token"] = r.result.bytes_per_token();
    j["fills_per_token"] = r.result.fills_per_token();
    std::vector<double> layers;
    for (size_t l = 0; l < r.result.layer_hits.size(); ++l)
        layers.push_back(r.result.layer_hit_rate(l));
    j["layer_hit_rate"] = layers;
    return j;
}

}  // namespace

ReportFormat parse_report_format(const std::string& s) {
    if (s == "md") return ReportFormat::md;
    if (s == "json") return ReportFormat::json;
    if (s == "csv") return ReportFormat::csv;
    throw std::invalid_argument("-o: expected md, json or csv, found " + s);
}

std::string format_stats(const RoutingTrace& tr, const TraceStats& st, ReportFormat f) {
    const int32_t L = tr.shape.n_moe_layers();
    if (f == ReportFormat::json) {
        nlohmann::json j = {{"trace", trace_json(tr)},
                            {"n_prefill", st.n_prefill},
                            {"n_decode", st.n_decode},
                            {"n_steps", st.n_steps}};
        for (int32_t l = 0; l < L; ++l) {
            const LayerStats& s = st.layers[size_t(l)];
            nlohmann::json hist;
            for (int b = 0; b < n_reuse_buckets; ++b) hist[reuse_bucket_name(b)] = s.reuse_hist[b];
            j["layers"].push_back({{"moe_layer", l},
                                   {"model_layer", tr.shape.moe_layers[size_t(l)]},
                                   {"share_sorted", s.share},
                                   {"entropy_ratio", s.entropy_ratio},
                                   {"experts_50", s.experts_50},
                                   {"experts_90", s.experts_90},
                                   {"overlap_next", s.overlap_next},
                                   {"reuse_within_4", s.reuse_within[0]},
                                   {"reuse_within_16", s.reuse_within[1]},
                                   {"reuse_within_64", s.reuse_within[2]},
                                   {"distinct_per_32", s.distinct_32},
                                   {"cross_layer", s.cross_layer},
                                   {"reuse_distance", hist}});
        }
        return j.dump(2) + "\n";
    }
    std::vector<std::string> head = {"layer",          "max share",       "min share",
                                     "entropy / ln E", "experts 50%/90%", "overlap t->t+1",
                                     "reuse 4/16/64",  "distinct per 32", "cross-layer"};
    for (int b = 0; b < n_reuse_buckets; ++b)
        head.push_back(std::string("dist ") + reuse_bucket_name(b));
    std::vector<std::vector<std::string>> rows;
    for (int32_t l = 0; l < L; ++l) {
        const LayerStats& s = st.layers[size_t(l)];
        std::vector<std::string> r = {
            std::to_string(tr.shape.moe_layers[size_t(l)]),
            fmt("%.4f", s.share.front()),
            fmt("%.4f", s.share.back()),
            fmt("%.3f", s.entropy_ratio),
            std::to_string(s.experts_50) + (f == ReportFormat::csv ? ";" : " / ") +
                std::to_string(s.experts_90),
            fmt("%.3f", s.overlap_next),
            fmt("%.3f", s.reuse_within[0]) + (f == ReportFormat::csv ? ";" : " / ") +
                fmt("%.3f", s.reuse_within[1]) + (f == ReportFormat::csv ? ";" : " / ") +
                fmt("%.3f", s.reuse_within[2]),
            fmt("%.1f", s.distinct_32),
            l == 0 ? "-" : fmt("%.3f", s.cross_layer)};
        for (int b = 0; b < n_reuse_buckets; ++b) r.push_back(fmt("%.3f", s.reuse_hist[b]));
        rows.push_back(r);
    }
    std::string out;
    if (f == ReportFormat::csv) {
        out += csv_join(head);
        for (const auto& r : rows) out += csv_join(r);
        return out;
    }
    out += "Routing trace: " + trace_line(tr) + "; " + std::to_string(st.n_prefill) +
           " prefill and " + std::to_string(st.n_decode) + " decode tokens in " +
           std::to_string(st.n_steps) + " forward passes.\n\n";
    const double E = tr.shape.n_experts, k = tr.shape.top_k;
    out += "Uniform routing would give: share " + fmt("%.4f", 1 / E) +
           ", entropy ratio 1, overlap t->t+1 " + fmt("%.3f", k / E) + ".\n\n";
    head.resize(9);
    out += md_row(head) + md_rule(head.size());
    for (auto r : rows) {
        r.resize(9);
        out += md_row(r);
    }
    out +=
        "\nReuse distance (tokens since the expert was last chosen in its layer), share of "
        "accesses:\n\n";
    std::vector<std::string> h2 = {"layer"};
    for (int b = 0; b < n_reuse_buckets; ++b) h2.push_back(reuse_bucket_name(b));
    out += md_row(h2) + md_rule(h2.size());
    for (const auto& r : rows) {
        std::vector<std::string> c = {r[0]};
        c.insert(c.end(), r.begin() + 9, r.end());
        out += md_row(c);
    }
    return out;
}

std::string format_sweep(const RoutingTrace& tr, const std::vector<SweepRow>& rows,
                         ReportFormat f) {
    const int32_t L = tr.shape.n_moe_layers();
    if (f == ReportFormat::json) {
        nlohmann::json j = {{"trace", trace_json(tr)}, {"results", nlohmann::json::array()}};
        for (const auto& r : rows) j["results"].push_back(row_json(tr, r));
        return j.dump(2) + "\n";
    }
    if (f == ReportFormat::csv) {
        std::vector<std::string> head = {
            "pools",    "slots",           "cached_fraction",  "policy",
            "hit_rate", "belady_hit_rate", "misses_per_token", "bytes_per_token"};
        for (int32_t l = 0; l < L; ++l)
            head.push_back("hit_rate_layer_" + std::to_string(tr.shape.moe_layers[size_t(l)]));
        std::string out = csv_join(head);
        for (const auto& r : rows) {
            const CacheConfig& c = r.result.config;
            std::vector<std::string> cells = {pools_name(c), std::to_string(c.n_slots),
                                              fmt("%.4f", cached_fraction(tr, c.n_slots)),
                                              policy_label(r.result)};
            if (!r.skipped.empty()) {
                cells.resize(head.size(), "");
                out += csv_join(cells);
                continue;
            }
            const SimResult* b = belady_for(rows, r);
            cells.push_back(fmt("%.6f", r.result.hit_rate()));
            cells.push_back(b ? fmt("%.6f", b->hit_rate()) : "");
            cells.push_back(fmt("%.4f", r.result.misses_per_token()));
            cells.push_back(fmt("%.0f", r.result.bytes_per_token()));
            for (int32_t l = 0; l < L; ++l)
                cells.push_back(fmt("%.4f", r.result.layer_hit_rate(size_t(l))));
            out += csv_join(cells);
        }
        return out;
    }
    // Markdown: the hit rates as a pivot (one column per policy), then the details.
    std::string out = "Routing trace: " + trace_line(tr) + ".\n\n";
    std::vector<std::string> policies;
    std::vector<std::pair<std::string, int64_t>> configs;  // (pools, slots) in order
    std::map<std::tuple<std::string, int64_t, std::string>, const SweepRow*> cell;
    for (const auto& r : rows) {
        const CacheConfig& c = r.result.config;
        const std::string p = policy_label(r.result);
        if (std::find(policies.begin(), policies.end(), p) == policies.end()) policies.push_back(p);
        const auto key = std::make_pair(pools_name(c), c.n_slots);
        if (std::find(configs.begin(), configs.end(), key) == configs.end()) configs.push_back(key);
        cell[{key.first, key.second, p}] = &r;
    }
    std::vector<std::string> head = {"pools", "slots", "cached"};
    for (const auto& p : policies) head.push_back(p);
    out += "Hit rate:\n\n" + md_row(head) + md_rule(head.size());
    for (const auto& [pools, slots] : configs) {
        std::vector<std::string> c = {pools, std::to_string(slots),
                                      fmt("%.1f %%", 100 * cached_fraction(tr, slots))};
        for (const auto& p : policies) {
            auto it = cell.find({pools, slots, p});
            if (it == cell.end()) {
                c.push_back("");
            } else if (!it->second->skipped.empty()) {
                c.push_back("n/a");
            } else {
                c.push_back(fmt("%.3f", it->second->result.hit_rate()));
            }
        }
        out += md_row(c);
    }
    std::string notes;
    for (const auto& r : rows) {
        if (r.skipped.empty()) continue;
        const std::string n = "n/a: " + r.skipped + "\n";
        if (notes.find(n) == std::string::npos) notes += n;
    }
    if (!notes.empty()) out += "\n" + notes;

    std::vector<std::string> h2 = {"pools",     "slots",        "policy",      "hit rate",
                                   "vs belady", "misses/token", "fills/token", "MiB/token"};
    for (int32_t l = 0; l < L; ++l) {
        std::string col = "L";  // appended: GCC 12 warns falsely on "lit" + std::string
        col += std::to_string(tr.shape.moe_layers[size_t(l)]);
        h2.push_back(col);
    }
    out += "\nPer configuration (hit rate per MoE layer in the L columns):\n\n" + md_row(h2) +
           md_rule(h2.size());
    for (const auto& r : rows) {
        if (!r.skipped.empty()) continue;
        const CacheConfig& c = r.result.config;
        const SimResult* b = belady_for(rows, r);
        std::vector<std::string> cells = {
            pools_name(c),
            std::to_string(c.n_slots),
            policy_label(r.result),
            fmt("%.3f", r.result.hit_rate()),
            b ? fmt("%+.1f pt", 100 * (r.result.hit_rate() - b->hit_rate())) : "",
            fmt("%.2f", r.result.misses_per_token()),
            fmt("%.2f", r.result.fills_per_token()),
            fmt("%.2f", r.result.bytes_per_token() / (1024.0 * 1024.0))};
        for (int32_t l = 0; l < L; ++l)
            cells.push_back(fmt("%.3f", r.result.layer_hit_rate(size_t(l))));
        out += md_row(cells);
    }
    return out;
}

std::string format_prefetch(const RoutingTrace& tr, const std::vector<PrefetchRow>& rows,
                            ReportFormat f) {
    const double mib = 1024.0 * 1024.0;
    auto queue_name = [](const TimingModel& t) { return t.demand_first ? "demand-first" : "fifo"; };
    auto share = [](int64_t part, int64_t whole) {
        return whole ? double(part) / double(whole) : 0.0;
    };
    if (f == ReportFormat::json) {
        nlohmann::json j = {{"trace", trace_json(tr)}, {"results", nlohmann::json::array()}};
        for (const auto& row : rows) {
            const PrefetchResult& r = row.result;
            const CacheConfig& c = r.sim.config;
            nlohmann::json o = {{"pools", pools_name(c)},
                                {"slots", c.n_slots},
                                {"policy", policy_label(r.sim)},
                                {"prefetch_depth", r.depth}};
            if (!row.skipped.empty()) {
                o["skipped"] = row.skipped;
                j["results"].push_back(o);
                continue;
            }
            o["queue"] = queue_name(r.timing);
            o["link_gbs"] = r.timing.link_gbs;
            o["attn_us"] = r.timing.attn_us;
            o["moe_us"] = r.timing.moe_us;
            o["fetch_us"] = r.timing.fetch_us;
            o["hit_rate"] = r.sim.hit_rate();
            o["demand_misses_per_token"] = r.per_token(double(r.demand_misses));
            o["prefetches_per_token"] = r.per_token(double(r.prefetches));
            o["prefetch_used"] = r.prefetch_used;
            o["prefetch_wasted"] = r.prefetch_wasted;
            o["link_bytes_per_token"] = r.link_bytes_per_token();
            o["ms_per_token"] = r.ms_per_token();
            o["tok_per_s"] = r.tok_per_s();
            o["link_busy_share"] = r.busy_share();
            o["stall_ms_per_token"] = r.per_token(r.stall_us) / 1000.0;
            o["link_time_hidden_share"] = r.hidden_share();
            j["results"].push_back(o);
        }
        return j.dump(2) + "\n";
    }
    const std::vector<std::string> head = {"pools",
                                           "slots",
                                           "policy",
                                           "prefetch",
                                           "queue",
                                           "hit rate",
                                           "demand misses/token",
                                           "prefetches/token",
                                           "used",
                                           "wasted",
                                           "MiB/token over link",
                                           "ms/token",
                                           "tok/s",
                                           "link busy",
                                           "stall ms/token",
                                           "link time hidden"};
    std::string out;
    if (f == ReportFormat::md) {
        out = "Routing trace: " + trace_line(tr) + ".\n\n";
        if (!rows.empty()) {
            const TimingModel& t = rows[0].result.timing;
            out += "Timing model: link " + fmt("%g", t.link_gbs) + " GB/s (" +
                   fmt("%.1f", double(tr.shape.expert_bytes) / (t.link_gbs * 1e3)) +
                   " us per expert), per layer " + fmt("%g", t.attn_us) + " us attention/dense + " +
                   fmt("%g", t.moe_us) + " us MoE at full hit, fetch plan " +
                   fmt("%g", t.fetch_us) +
                   " us per MoE layer; one link, transfers in issue order, not preempted.\n\n";
        }
        out += md_row(head) + md_rule(head.size());
    } else {
        out = csv_join(head);
    }
    for (const auto& row : rows) {
        const PrefetchResult& r = row.result;
        const CacheConfig& c = r.sim.config;
        std::vector<std::string> cells = {pools_name(c), std::to_string(c.n_slots),
                                          policy_label(r.sim), std::to_string(r.depth)};
        if (!row.skipped.empty()) {
            cells.push_back("n/a: " + row.skipped);
            cells.resize(head.size(), "");
            out += f == ReportFormat::md ? md_row(cells) : csv_join(cells);
            continue;
        }
        const int64_t resolved = r.prefetch_used + r.prefetch_wasted;
        cells.push_back(queue_name(r.timing));
        cells.push_back(fmt("%.3f", r.sim.hit_rate()));
        cells.push_back(fmt("%.2f", r.per_token(double(r.demand_misses))));
        cells.push_back(fmt("%.2f", r.per_token(double(r.prefetches))));
        if (f == ReportFormat::md) {
            cells.push_back(fmt("%.0f %%", 100 * share(r.prefetch_used, resolved)));
            cells.push_back(fmt("%.0f %%", 100 * share(r.prefetch_wasted, resolved)));
        } else {
            cells.push_back(std::to_string(r.prefetch_used));
            cells.push_back(std::to_string(r.prefetch_wasted));
        }
        cells.push_back(fmt("%.1f", r.link_bytes_per_token() / mib));
        cells.push_back(fmt("%.3f", r.ms_per_token()));
        cells.push_back(fmt("%.1f", r.tok_per_s()));
        cells.push_back(fmt("%.0f %%", 100 * r.busy_share()));
        cells.push_back(fmt("%.3f", r.per_token(r.stall_us) / 1000.0));
        cells.push_back(fmt("%.0f %%", 100 * r.hidden_share()));
        if (f == ReportFormat::csv) {
            for (size_t i : {size_t(13), size_t(15)}) {  // shares as plain numbers in CSV
                std::string& s = cells[i];
                if (s.size() > 2 && s.substr(s.size() - 2) == " %") s.resize(s.size() - 2);
            }
        }
        out += f == ReportFormat::md ? md_row(cells) : csv_join(cells);
    }
    if (f == ReportFormat::md)
        out +=
            "\n(used / wasted: shares of the prefetched experts that their layer read before "
            "eviction / that were evicted or left unread; link time hidden: 1 - stall / link "
            "busy time.)\n";
    return out;
}

std::string format_fit(const FitResult& fit, const std::vector<SweepRow>& rec,
                       const std::vector<SweepRow>& gen, ReportFormat f) {
    const SynthParams& p = fit.params;
    const int32_t L = p.shape.n_moe_layers();
    double sum_abs = 0, max_abs = 0;
    int n = 0;
    for (size_t i = 0; i < rec.size() && i < gen.size(); ++i) {
        if (!rec[i].skipped.empty() || !gen[i].skipped.empty()) continue;
        const double d = std::abs(rec[i].result.hit_rate() - gen[i].result.hit_rate());
        sum_abs += d;
        max_abs = std::max(max_abs, d);
        ++n;
    }
    const double mean_abs = n ? sum_abs / n : 0;
    auto mean = [](const std::vector<double>& v, size_t from) {
        double s = 0;
        for (size_t i = from; i < v.size(); ++i) s += v[i];
        return v.size() > from ? s / double(v.size() - from) : 0.0;
    };
    if (f == ReportFormat::json) {
        nlohmann::json j;
        j["params"] = {
            {"zipf", p.zipf}, {"stickiness", p.stickiness}, {"cross_layer", p.cross_layer}};
        j["mean"] = {{"zipf", mean(p.zipf, 0)},
                     {"stickiness", mean(p.stickiness, 0)},
                     {"cross_layer", mean(p.cross_layer, 1)}};
        for (int32_t l = 0; l < L; ++l) {
            const LayerStats &a = fit.target.layers[size_t(l)], &b = fit.achieved.layers[size_t(l)];
            j["layers"].push_back({{"target",
                                    {{"entropy_ratio", a.entropy_ratio},
                                     {"overlap_next", a.overlap_next},
                                     {"cross_layer", a.cross_layer},
                                     {"reuse_within_16", a.reuse_within[1]}}},
                                   {"achieved",
                                    {{"entropy_ratio", b.entropy_ratio},
                                     {"overlap_next", b.overlap_next},
                                     {"cross_layer", b.cross_layer},
                                     {"reuse_within_16", b.reuse_within[1]}}}});
        }
        for (size_t i = 0; i < rec.size() && i < gen.size(); ++i) {
            j["hit_rates"].push_back(
                {{"recorded", rec[i].result.hit_rate()},
                 {"generated", gen[i].result.hit_rate()},
                 {"pools", pools_name(rec[i].result.config)},
                 {"slots", rec[i].result.config.n_slots},
                 {"policy", policy_name(rec[i].result.config.policy)},
                 {"skipped", !rec[i].skipped.empty() || !gen[i].skipped.empty()}});
        }
        j["hit_rate_mean_abs_diff"] = mean_abs;
        j["hit_rate_max_abs_diff"] = max_abs;
        return j.dump(2) + "\n";
    }
    std::string out;
    out += "Fitted generator parameters per MoE layer (target: recorded; achieved: generated):\n\n";
    std::vector<std::string> head = {"layer",
                                     "zipf",
                                     "stickiness",
                                     "cross-layer",
                                     "entropy ratio target / achieved",
                                     "overlap t->t+1 target / achieved",
                                     "cross-layer stat target / achieved",
                                     "reuse within 16 target / achieved"};
    out += md_row(head) + md_rule(head.size());
    for (int32_t l = 0; l < L; ++l) {
        const LayerStats &a = fit.target.layers[size_t(l)], &b = fit.achieved.layers[size_t(l)];
        out +=
            md_row({std::to_string(p.shape.moe_layers[size_t(l)]), fmt("%.3f", p.zipf[size_t(l)]),
                    fmt("%.3f", p.stickiness[size_t(l)]), fmt("%.3f", p.cross_layer[size_t(l)]),
                    fmt("%.3f", a.entropy_ratio) + " / " + fmt("%.3f", b.entropy_ratio),
                    fmt("%.3f", a.overlap_next) + " / " + fmt("%.3f", b.overlap_next),
                    l == 0 ? "-" : fmt("%.3f", a.cross_layer) + " / " + fmt("%.3f", b.cross_layer),
                    fmt("%.3f", a.reuse_within[1]) + " / " + fmt("%.3f", b.reuse_within[1])});
    }
    out += "\nMeans: --zipf " + fmt("%.3f", mean(p.zipf, 0)) + " --stickiness " +
           fmt("%.3f", mean(p.stickiness, 0)) + " --cross-layer " +
           fmt("%.3f", mean(p.cross_layer, 1)) + " (cross-layer over layers after the first)\n";
    out += "\nHit rates, recorded / generated:\n\n";
    std::vector<std::string> h2 = {"pools", "slots", "policy", "recorded", "generated", "diff"};
    out += md_row(h2) + md_rule(h2.size());
    for (size_t i = 0; i < rec.size() && i < gen.size(); ++i) {
        const CacheConfig& c = rec[i].result.config;
        if (!rec[i].skipped.empty() || !gen[i].skipped.empty()) {
            out += md_row({pools_name(c), std::to_string(c.n_slots), policy_name(c.policy), "n/a",
                           "n/a", ""});
            continue;
        }
        const double a = rec[i].result.hit_rate(), b = gen[i].result.hit_rate();
        out += md_row({pools_name(c), std::to_string(c.n_slots), policy_name(c.policy),
                       fmt("%.3f", a), fmt("%.3f", b), fmt("%+.1f pt", 100 * (b - a))});
    }
    out += "\nMean |difference| " + fmt("%.1f", 100 * mean_abs) + " points, largest " +
           fmt("%.1f", 100 * max_abs) + " points over " + std::to_string(n) + " configurations.\n";
    return out;
}

}  // namespace minids::cli
