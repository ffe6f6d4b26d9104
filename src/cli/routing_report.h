// Tables of `minids routing`: statistics, simulator sweeps and fits, as markdown, JSON or CSV.
#pragma once

#include <string>
#include <vector>

#include "routing/prefetch.h"
#include "routing/simulator.h"
#include "routing/synthetic.h"
#include "routing/trace_stats.h"

namespace minids::cli {

enum class ReportFormat { md, json, csv };
ReportFormat parse_report_format(const std::string& s);

// One simulated configuration, or one that could not run (then `skipped` says why).
struct SweepRow {
    routing::SimResult result;
    std::string slots_label;  // as given: "208", "25%", "8/layer"
    std::string skipped;
};

std::string format_stats(const routing::RoutingTrace& trace, const routing::TraceStats& st,
                         ReportFormat f);
std::string format_sweep(const routing::RoutingTrace& trace, const std::vector<SweepRow>& rows,
                         ReportFormat f);

// One configuration of the prefetch sweep (routing sim --prefetch), or one that could not run.
struct PrefetchRow {
    routing::PrefetchResult result;
    std::string slots_label;
    std::string skipped;
};

// The prefetch table: counts per token, used / wasted prefetches, bytes over the link and the
// timing model's decode time, with the model's constants printed above it.
std::string format_prefetch(const routing::RoutingTrace& trace,
                            const std::vector<PrefetchRow>& rows, ReportFormat f);

// The fit: parameters per layer, target vs achieved statistics, and the hit-rate curves of
// the recorded and generated traces side by side (rows of `recorded` and `generated` match).
std::string format_fit(const routing::FitResult& fit, const std::vector<SweepRow>& recorded,
                       const std::vector<SweepRow>& generated, ReportFormat f);

}  // namespace minids::cli
