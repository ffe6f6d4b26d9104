#include "runtime/memory_plan.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <stdexcept>

namespace minids {

namespace {

double mib(uint64_t b) { return double(b) / double(1 << 20); }

std::string gib_text(uint64_t b) {
    char s[32];
    std::snprintf(s, sizeof s, "%.2f GiB", double(b) / double(1ull << 30));
    return s;
}

}  // namespace

MemoryPlan plan_memory(const MemoryPlanInput& in) {
    MemoryPlan p;
    p.dense = in.dense_bytes;
    p.kv = in.kv_bytes_per_token * uint64_t(std::max<int64_t>(in.n_ctx, 0));
    p.work = in.work_bytes;
    const uint64_t fixed = p.dense + p.kv + p.work;
    const uint64_t room = in.budget > fixed ? in.budget - fixed : 0;
    const int64_t fit = in.slot_bytes ? int64_t(room / in.slot_bytes) : in.n_experts;
    const int64_t want = in.forced_slots >= 0 ? std::min(in.forced_slots, in.n_experts)
                                              : std::min(fit, in.n_experts);
    const int64_t need = std::min(in.min_slots, in.n_experts);
    if (want >= need && want <= fit) {
        p.fits = true;
        p.slots = want;
        p.resident = want == in.n_experts;
        p.experts = uint64_t(want) * in.slot_bytes;
        return p;
    }
    p.slots = want;
    p.experts = uint64_t(std::max(want, need)) * in.slot_bytes;
    if (in.forced_slots >= 0 && in.forced_slots < need) {
        p.refusal = "--expert-cache-slots " + std::to_string(in.forced_slots) +
                    " is fewer than the " + std::to_string(need) + " " + in.min_slots_are;
        return p;
    }
    const uint64_t smallest = fixed + p.experts;
    std::string s = "the plan needs at least " + gib_text(smallest) + " (dense weights " +
                    gib_text(p.dense) + ", KV cache " + gib_text(p.kv) + " for " +
                    std::to_string(in.n_ctx) + " tokens, work " + gib_text(p.work) + ", " +
                    std::to_string(std::max(want, need)) + " expert slots " + gib_text(p.experts) +
                    ") but the budget is " + gib_text(in.budget);
    const uint64_t without_kv = p.dense + p.work + p.experts;
    if (in.kv_bytes_per_token && in.budget > without_kv) {
        const int64_t ctx = int64_t((in.budget - without_kv) / in.kv_bytes_per_token);
        if (ctx > 0) s += "; at most -c " + std::to_string(ctx) + " fits this budget";
    }
    p.refusal = s;
    return p;
}

std::string MemoryPlan::table(uint64_t budget) const {
    char s[640];
    std::snprintf(s, sizeof s,
                  "  %-22s %10.1f MiB\n  %-22s %10.1f MiB\n  %-22s %10.1f MiB\n"
                  "  %-22s %10.1f MiB  (%lld slots%s)\n  %-22s %10.1f MiB of %.1f MiB budget",
                  "dense weights", mib(dense), "KV cache", mib(kv), "work (estimate)", mib(work),
                  "routed experts", mib(experts), (long long)slots,
                  resident ? ", every expert resident" : ", an expert cache", "total", mib(total()),
                  mib(budget));
    return s;
}

uint64_t parse_byte_size(const std::string& text) {
    const auto bad = [&](const std::string& why) {
        return std::invalid_argument("\"" + text + "\" is not a size (" + why +
                                     "; e.g. 12GiB, 11000MiB, 512M)");
    };
    size_t i = 0;
    while (i < text.size() && (std::isdigit(static_cast<unsigned char>(text[i])) || text[i] == '.'))
        ++i;
    if (i == 0) throw bad("no number");
    double value = 0;
    try {
        size_t used = 0;
        value = std::stod(text.substr(0, i), &used);
        if (used != i) throw bad("a malformed number");
    } catch (const std::logic_error&) {
        throw bad("a malformed number");
    }
    std::string unit = text.substr(i);
    while (!unit.empty() && unit.front() == ' ') unit.erase(0, 1);
    std::string u;
    for (char c : unit) u += char(std::tolower(static_cast<unsigned char>(c)));
    double scale = 0;
    if (u.empty() || u == "b") {
        scale = 1;
    } else {
        const std::string prefixes = "kmgt";
        const size_t at = prefixes.find(u[0]);
        if (at == std::string::npos) throw bad("unknown unit \"" + unit + "\"");
        const std::string rest = u.substr(1);
        const double binary = std::pow(1024.0, double(at + 1));
        const double decimal = std::pow(1000.0, double(at + 1));
        if (rest.empty() || rest == "ib") {
            scale = binary;
        } else if (rest == "b") {
            scale = decimal;
        } else {
            throw bad("unknown unit \"" + unit + "\"");
        }
    }
    const double bytes = value * scale;
    if (!std::isfinite(bytes) || bytes > std::ldexp(1.0, 60)) throw bad("too large");
    return uint64_t(bytes);
}

}  // namespace minids
