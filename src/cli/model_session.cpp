#include "cli/model_session.h"

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <new>
#include <sstream>
#include <system_error>

#include "chat/jinja.h"
#include "cli/commands.h"
#include "cli/model_check.h"
#include "mgl-cuda.h"
#include "model/config.h"
#include "model/weight_store.h"
#include "runtime/memory_plan.h"
#include "tokenizer/tokenizer_data.h"
#include "util/output_file.h"

namespace minids::cli {

void add_model_flags(CLI::App& cmd, ModelFlags& f) {
    cmd.add_option("-m,--model", f.model_path,
                   "model file (.mds); without it the embedded demo model is used");
    cmd.add_option("-c,--ctx-size", f.n_ctx, "context size in tokens: prompt plus generated tokens")
        ->capture_default_str()
        ->check(CLI::Range(int64_t(1), int64_t(1) << 24));
    cmd.add_option("-t,--threads", f.n_threads, "CPU threads (0: the number of physical cores)")
        ->capture_default_str()
        ->check(CLI::Range(0, 1024));
    cmd.add_option("--n-gpu-layers", f.n_gpu_layers,
                   "layers to place on the GPU, as in llama.cpp: 0 runs on the CPU; any other "
                   "number means the GPU, with the memory plan deciding placement (also -ngl)")
        ->check(CLI::Range(0, 1 << 20));
    cmd.add_option(
        "--chat-template", f.chat_template,
        "chat template instead of the model's own: deepseek2, deepseek3, chatml or Jinja source "
        "(run sends the prompt as one user message with it)");
    cmd.add_flag("--cpu", f.cpu,
                 "run on the CPU even when a CUDA GPU is present (the GPU is the default when the "
                 "model fits in its free memory)");
    cmd.add_option("--cache-type-k", f.cache_type,
                   "KV cache dtype: f16, bf16 or f32 (default: f16 on the GPU, f32 on the CPU); "
                   "f16 takes the bytes of bf16 with 8x less rounding (docs/fidelity.md)")
        ->check(CLI::IsMember({"f32", "bf16", "f16"}));
    cmd.add_option("--ubatch-size", f.n_ubatch,
                   "prompt tokens evaluated in one graph (longer prompts run in chunks)")
        ->capture_default_str()
        ->check(CLI::Range(int64_t(1), int64_t(1) << 16));
    cmd.add_flag("!--no-cuda-graphs", f.cuda_graphs,
                 "run every decode step eagerly instead of replaying one captured CUDA graph");
    cmd.add_option("--vram-budget", f.vram_budget,
                   "GPU memory the run may use, e.g. 12GiB or 11000MiB (default: free memory "
                   "less 1 GiB); turns on the memory plan: dense weights, KV cache and work memory "
                   "first, then as many expert slots as fit (new, see docs/expert-cache.md)");
    cmd.add_option("--expert-cache-slots", f.expert_cache_slots,
                   "routed experts kept in GPU memory by the expert cache (the rest are read "
                   "over PCIe from a registered copy in host memory as needed; "
                   "MINIDS_EXPERT_STORE=mapped: the registered file mapping; "
                   "MINIDS_EXPERT_STORE=staging: nothing registered, misses copied through "
                   "pinned staging buffers, at least one slot per expert of a layer); turns the "
                   "cache on. On the CPU it only exercises the cache's bookkeeping")
        ->check(CLI::Range(int64_t(0), int64_t(1) << 24));
    cmd.add_option(
           "--expert-cache-policy", f.expert_cache_policy,
           "which expert the cache evicts: lru, lfu or decay (docs/expert-cache-policies.md)")
        ->capture_default_str()
        ->check(CLI::IsMember({"lru", "lfu", "decay"}));
    cmd.add_option("--expert-cache-admit", f.expert_cache_admit,
                   "which misses take a slot: all, or frequency (only an expert the policy "
                   "ranks above its victim; the others are read in place without a copy; "
                   "lfu and decay only)")
        ->capture_default_str()
        ->check(CLI::IsMember({"all", "frequency"}));
    cmd.add_flag("--expert-cache-copy-stream", f.expert_cache_copy_stream,
                 "host fetch: fill the expert cache's slots on a copy stream beside the next "
                 "step instead of before it (a filled slot is used from the first step after "
                 "its copy has landed)");
    cmd.add_option("--expert-cache-fetch", f.expert_cache_fetch,
                   "where misses go: device (copied into slots by the step itself before its "
                   "experts run, so each miss crosses PCIe once; one global pool and admission "
                   "all only), host (read in place by the step, copied into slots after it), or "
                   "auto (device wherever it applies, else host)")
        ->capture_default_str()
        ->check(CLI::IsMember({"auto", "host", "device"}));
    // N|auto into `out` (-1: auto), N from 0 to `most`.
    auto count_or_auto = [](const char* name, int& out, int most = 64) {
        return [name, &out, most](const std::string& v) {
            if (v == "auto") {
                out = -1;
                return;
            }
            int n = -1;
            const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), n);
            if (ec != std::errc() || end != v.data() + v.size() || n < 0 || n > most)
                throw CLI::ValidationError(name, "expected auto or a number of experts from 0 to " +
                                                     std::to_string(most) + ", found '" + v + "'");
            out = n;
        };
    };
    cmd.add_option_function<std::string>(
           "--expert-prefetch", count_or_auto("--expert-prefetch", f.expert_prefetch),
           "device fetch: while a MoE layer's experts run, fill the next MoE layer's experts "
           "among the top N predicted by that layer's router applied to this layer's input "
           "(at most --expert-prefetch-fills of them), their copies queued right behind the "
           "layer's misses so they cross while the layer computes (decode only; at most the "
           "model's experts per token; 0: off). auto, the default: 4 where the copy engines make "
           "the fills (the device fetch from a registered host store on a GPU), else 0. On an "
           "H200 with V2-Lite at 12 GiB, the top 4 with one fill decode +10 % over none; prefetch "
           "costs ~13 % only where every expert is already in a slot (docs/expert-cache.md, "
           "\"Prefetch behind the misses\")")
        ->default_str("auto")
        ->type_name("N|auto");
    cmd.add_option_function<std::string>(
           "--expert-prefetch-fills",
           count_or_auto("--expert-prefetch-fills", f.expert_prefetch_fills),
           "device fetch, with --expert-prefetch: copy at most N of a layer's predicted experts, "
           "the best-ranked ones not already in a slot (0: every one of the top "
           "--expert-prefetch). auto, the default: 1. One copy already keeps the link busy "
           "while the next layer computes; on an H200 with V2-Lite at 12 GiB a second one lost "
           "3 % and no cap on the top 3 lost 3 % (docs/perf.md, thirteenth session)")
        ->default_str("auto")
        ->type_name("N|auto");
    cmd.add_option_function<std::string>(
           "--expert-prompt-stage",
           count_or_auto("--expert-prompt-stage", f.expert_prompt_stage, 1024),
           "device fetch on a GPU, registered host store: each MoE layer of a prompt chunk copies "
           "up to N of the experts it uses that are not in slots into slots the cache lends it "
           "(from a full pool, the policy's lowest ranked, no more than a layer can miss; their "
           "experts are copied back after the chunk), instead of the prompt kernels reading them "
           "over PCIe in place at about "
           "half the copy's rate (0: off). auto, the default: a layer's experts. On an H200 with "
           "V2-Lite at 12 GiB, pp512 2,545 -> 3,315 tok/s, decode unchanged (docs/expert-cache.md, "
           "\"Prefill\")")
        ->default_str("auto")
        ->type_name("N|auto");
    cmd.add_option("--expert-cache-pools", f.expert_cache_pools,
                   "one slot pool for all MoE layers (global) or a fixed share per layer "
                   "(per-layer)")
        ->capture_default_str()
        ->check(CLI::IsMember({"global", "per-layer"}));
}

CLI::Validator finite_in(double lo, double hi) {
    auto text = [](double v) {
        std::ostringstream os;
        os << v;
        return os.str();
    };
    const std::string range = "[" + text(lo) + ", " + text(hi) + "]";
    return CLI::Validator(
        [lo, hi, range, text](std::string& input) -> std::string {
            double v = 0;
            try {
                size_t used = 0;
                v = std::stod(input, &used);
                if (used != input.size()) throw std::invalid_argument(input);
            } catch (const std::exception&) {
                return "expected a number in " + range + ", found \"" + input + "\"";
            }
            if (!std::isfinite(v) || v < lo || v > hi)
                return "expected a finite number in " + range + ", found " + input;
            return {};
        },
        "NUMBER in " + range);
}

void add_sampling_flags(CLI::App& cmd, SamplerParams& p) {
    cmd.add_option("--temp", p.temp, "temperature; 0 picks the most likely token (greedy)")
        ->capture_default_str()
        ->check(finite_in(-1e6, 1e6));
    cmd.add_option("--top-k", p.top_k, "keep the k most likely tokens (0: off)")
        ->capture_default_str();
    cmd.add_option("--top-p", p.top_p,
                   "keep the most likely tokens up to this probability mass (1: off)")
        ->capture_default_str()
        ->check(finite_in(0.0, 1.0));
    cmd.add_option("--min-p", p.min_p,
                   "drop tokens less likely than min-p times the most likely one (0: off)")
        ->capture_default_str()
        ->check(finite_in(0.0, 1.0));
    cmd.add_option("--repeat-penalty", p.repeat_penalty,
                   "penalize tokens seen in the last repeat-last-n (1: off)")
        ->capture_default_str()
        ->check(finite_in(1e-6, 1e6));
    cmd.add_option("--repeat-last-n", p.repeat_last_n,
                   "tokens the repeat penalty looks back on (0: off, -1: context)")
        ->capture_default_str()
        ->check(CLI::Range(-1, 1 << 24));
    // llama.cpp's -1 (and its LLAMA_DEFAULT_SEED, 4294967295) mean a random seed.
    cmd.add_option_function<int64_t>(
           "-s,--seed",
           [&p](int64_t v) {
               p.seed = v < 0 ? SamplerParams::default_seed : static_cast<uint32_t>(v);
           },
           "random seed (-1, the default: a random one, printed at the end)")
        ->check(CLI::Range(int64_t(-1), int64_t(UINT32_MAX)));
}

bool looks_like_split_flag(std::string_view a) {
    if (a.size() < 3 || a[0] != '-' || !std::isalpha(static_cast<unsigned char>(a[1])))
        return false;
    for (char c : a.substr(1))
        if (!std::isalnum(static_cast<unsigned char>(c)) && c != '-' && c != '_') return false;
    std::string lower(a.substr(1));
    for (char& c : lower) c = char(std::tolower(static_cast<unsigned char>(c)));
    return lower != "inf" && lower != "nan" && lower != "infinity";
}

std::string process_escapes(const std::string& text) {
    std::string out;
    for (size_t i = 0; i < text.size(); ++i) {
        if (text[i] != '\\' || i + 1 == text.size()) {
            out += text[i];
            continue;
        }
        const char c = text[++i];
        switch (c) {
            case 'n':
                out += '\n';
                break;
            case 'r':
                out += '\r';
                break;
            case 't':
                out += '\t';
                break;
            case '\'':
            case '"':
            case '\\':
                out += c;
                break;
            case 'x':
                if (i + 2 < text.size() && std::isxdigit(static_cast<unsigned char>(text[i + 1])) &&
                    std::isxdigit(static_cast<unsigned char>(text[i + 2]))) {
                    out += static_cast<char>(std::stoi(text.substr(i + 1, 2), nullptr, 16));
                    i += 2;
                    break;
                }
                [[fallthrough]];
            default:
                out += '\\';
                out += c;
        }
    }
    return out;
}

namespace {

std::filesystem::path binary_dir() {
    std::error_code ec;
    auto exe = std::filesystem::read_symlink("/proc/self/exe", ec);
    return ec ? std::filesystem::path{} : exe.parent_path();
}

double mib(uint64_t bytes) { return double(bytes) / (1024.0 * 1024.0); }
double gib(uint64_t bytes) { return double(bytes) / (1024.0 * 1024.0 * 1024.0); }

// --expert-cache-fetch auto: the device fetch wherever it applies (one global pool, every miss
// admitted, no copy stream); it measured 17-42 % faster decode than the host fetch at 12 GiB.
bool device_fetch(const ModelFlags& f, const routing::CacheConfig& c) {
    if (f.expert_cache_fetch != "auto") return f.expert_cache_fetch == "device";
    return !c.per_layer && c.admit == routing::Admission::all && !f.expert_cache_copy_stream;
}

}  // namespace

// --expert-prefetch auto where prefetch applies, and --expert-prefetch-fills auto: the best
// measured at 12 GiB on the H200 (docs/perf.md, thirteenth session, warm new prompt, tok/s: the
// top 3 uncapped 131.1-131.4; one fill of the top 3 / 4 / 6 133.9-134.1 / 134.9-135.6 /
// 133.9-134.6; two fills of the top 4 / 6 130.6-131.1 / 123.5-123.6). One copy a layer already
// keeps the link busy through the next layer's compute; a second one only delays that layer's
// misses behind it when it is wrong (the proxy's copies are FIFO).
constexpr int kAutoPrefetch = 4;
constexpr int kAutoPrefetchFills = 1;

// Who copies fills, `kernel` (the fetch's copy kernel) or `engines` (the copy engines, through
// the host's proxy: docs/expert-cache.md), as `var` asks, or `otherwise` when it is unset.
// MINIDS_FETCH_COPY: every fill of a replayed decode step, the layers' own misses too; unset,
// the copy engines where the device fetch reads a registered store on a GPU (they pull host
// memory ~10 % faster than a kernel can: docs/perf.md, tenth session). MINIDS_PREFETCH_COPY:
// the prefetches' fills only (unset: the copy engines where possible too, since on the default
// one-stream schedule a prefetch's copy kernel would run on the step's path).
static bool copy_engines_asked(const char* var, bool otherwise) {
    const char* v = std::getenv(var);
    if (!v || !*v) return otherwise;
    if (std::string(v) == "kernel") return false;
    if (std::string(v) == "engines") return true;
    throw UserError(std::string(var) + ": expected kernel or engines, found '" + v + "'");
}

// MINIDS_VICTIMS: `after-launch` (a replayed decode step's victims are written into pinned host
// memory while it runs, and the previous step's replay runs then too: docs/expert-cache.md
// "Victims after the launch") or `before-launch`; unset, after the launch where the device
// fetch reads a registered store on a GPU.
static bool victims_after_launch_asked(bool possible) {
    const char* v = std::getenv("MINIDS_VICTIMS");
    if (!v || !*v) return possible;
    if (std::string(v) == "before-launch") return false;
    if (std::string(v) == "after-launch") {
        if (!possible)
            throw UserError(
                "MINIDS_VICTIMS=after-launch: needs the device fetch on a GPU reading a "
                "registered host store (not the staging store)");
        return true;
    }
    throw UserError(std::string("MINIDS_VICTIMS: expected after-launch or before-launch, found '") +
                    v + "'");
}

std::unique_ptr<ExpertOffload> make_expert_cache(const LoadedModel& m,
                                                 const routing::CacheConfig& config,
                                                 const ModelFlags& flags,
                                                 const std::string& context) {
    try {
        auto cache = std::make_unique<ExpertOffload>(
            *m.model, *m.backend, config,
            flags.expert_cache_copy_stream ? m.backend->make_transfer_queue() : nullptr,
            device_fetch(flags, config));
        const bool engines = cache->fills_by_engines_possible();
        const bool all_fills = copy_engines_asked("MINIDS_FETCH_COPY", engines);
        // auto: prefetch where its copies can go to the copy engines behind the misses (the
        // only way it measured faster): kAutoPrefetch and kAutoPrefetchFills, above.
        const int prefetch =
            flags.expert_prefetch >= 0 ? flags.expert_prefetch
            : engines ? std::min(kAutoPrefetch, int(m.model->config().num_experts_per_tok))
                      : 0;
        cache->set_prefetch(
            prefetch, all_fills || copy_engines_asked("MINIDS_PREFETCH_COPY", engines), all_fills);
        cache->set_victims_after_launch(victims_after_launch_asked(engines));
        cache->set_prefetch_fills(flags.expert_prefetch_fills >= 0 ? flags.expert_prefetch_fills
                                                                   : kAutoPrefetchFills);
        // The prompt stage where the device fetch reads a registered store on a GPU (a sweep's
        // host fetch cannot lend slots): auto lends as many slots as a layer has experts.
        const int64_t E = m.model->config().n_routed_experts;
        const int64_t stage =
            flags.expert_prompt_stage >= 0 ? std::min<int64_t>(flags.expert_prompt_stage, E) : E;
        if (engines)
            cache->set_prompt_stage(std::min<int64_t>(stage, config.n_slots));
        else if (flags.expert_prompt_stage > 0)
            std::fprintf(
                stderr,
                "minids: --expert-prompt-stage ignored: it needs the device fetch on a GPU "
                "reading a registered host store\n");
        return cache;
    } catch (const std::invalid_argument& e) {  // "expert cache: ..." or "--expert-prefetch: ..."
        throw UserError(context + e.what());
    }
}

void attach_expert_cache(const LoadedModel& m, Session& session) {
    if (!m.expert_cache) return;
    m.expert_cache->attach(session);
}

std::string expert_cache_summary(const LoadedModel& m) {
    if (!m.expert_cache) return "";
    const OffloadStats& st = m.expert_cache->stats();
    char s[320];
    std::snprintf(s, sizeof s,
                  "expert cache: %lld slots, hit rate %.3f (%lld of %lld), %lld fills, %.1f MiB "
                  "copied in, %.1f MiB read in place",
                  (long long)m.expert_cache->config().n_slots, st.hit_rate(), (long long)st.hits,
                  (long long)st.accesses, (long long)st.fills, mib(st.bytes_filled),
                  mib(st.bytes_read_in_place));
    std::string out = s;
    // The device fetch on a GPU times how long the MoE layers waited on their experts.
    if (m.expert_cache->uses_device_fetch() && st.fetch_ns > 0 && st.steps > 0) {
        std::snprintf(s, sizeof s, ", %.1f ms waiting on the fetch (%.3f ms per step)",
                      double(st.fetch_ns) / 1e6, double(st.fetch_ns) / 1e6 / double(st.steps));
        out += s;
    }
    if (st.stage_restores > 0) {
        std::snprintf(s, sizeof s, ", %lld lent slots' experts copied back (%.1f MiB)",
                      (long long)st.stage_restores, mib(st.bytes_restored));
        out += s;
    }
    if (st.prefetches > 0) {
        std::snprintf(s, sizeof s, ", %lld prefetched (%lld used, %lld wasted)",
                      (long long)st.prefetches, (long long)st.prefetch_used,
                      (long long)st.prefetch_wasted());
        out += s;
    }
    // The cache's host work between a step's wait and the next launch (the GPU idles), and
    // the part done while the steps ran (victims after the launch).
    if (st.steps > 0) {
        std::snprintf(s, sizeof s, ", %.1f us of host bookkeeping per step",
                      double(st.host_ns) / 1e3 / double(st.steps));
        out += s;
        if (st.host_beside_ns > 0) {
            std::snprintf(s, sizeof s, " (%.1f more beside the steps)",
                          double(st.host_beside_ns) / 1e3 / double(st.steps));
            out += s;
        }
    }
    return out;
}

std::string resolve_model_path(const std::string& flag, const char* command) {
    if (!flag.empty()) {
        std::error_code ec;
        if (!std::filesystem::is_regular_file(flag, ec)) {
            throw UserError("model file " + flag + " does not exist or is not a file");
        }
        return flag;
    }
    std::vector<std::filesystem::path> candidates = {MINIDS_DEMO_MODEL_DEFAULT};
    if (auto dir = binary_dir(); !dir.empty()) {
        auto next_to_binary = (dir / ".." / "models" / "demo.mds").lexically_normal();
        if (next_to_binary != candidates.front().lexically_normal())
            candidates.push_back(next_to_binary);
    }
    for (const auto& c : candidates) {
        std::error_code ec;
        if (std::filesystem::is_regular_file(c, ec)) {
            std::fprintf(stderr, "minids %s: no -m given, using the demo model %s\n", command,
                         c.lexically_normal().c_str());
            return c.lexically_normal().string();
        }
    }
    throw UserError(
        "no model given (-m) and no demo model at " + candidates.front().string() +
        (candidates.size() > 1 ? " or " + candidates.back().lexically_normal().string() : ""));
}

LoadedModel load_model(const ModelFlags& flags, const char* command) {
    const std::string path = resolve_model_path(flags.model_path, command);
    std::fprintf(stderr, "minids %s: loading %s ...\n", command, path.c_str());
    const auto t0 = std::chrono::steady_clock::now();
    LoadedModel m;
    m.file = mds::MdsFile::open(path);
    const ModelConfig& c = m.file->config();

    // The GPU when there is one and the model fits in its free memory; --cpu (or llama.cpp's
    // -ngl 0) forces the CPU.
    const bool gpu = !flags.cpu && flags.n_gpu_layers.value_or(1) != 0 && mgl::cuda_available();
    SessionParams& sp = m.session_params;
    sp.n_ctx = flags.n_ctx;
    sp.n_ubatch = flags.n_ubatch;
    // F16 on the GPU: BF16's bytes and speed (tg128 487.2 vs 486.0 tok/s on the H200) with an
    // eighth of its rounding (docs/fidelity.md).
    sp.kv_type = flags.cache_type.empty()     ? (gpu ? mgl::dtype::f16 : mgl::dtype::f32)
                 : flags.cache_type == "bf16" ? mgl::dtype::bf16
                 : flags.cache_type == "f16"  ? mgl::dtype::f16
                                              : mgl::dtype::f32;
    const uint64_t kv_per_token =
        uint64_t(c.num_hidden_layers) * uint64_t(c.kv_cache_width()) * mgl::dtype_size(sp.kv_type);
    const uint64_t kv_bytes = kv_per_token * uint64_t(flags.n_ctx);
    WeightOptions wo;
    std::optional<routing::CacheConfig> cache_config;
    const auto& experts = m.file->experts();
    const int64_t n_experts = int64_t(experts.blobs.size());
    routing::CacheConfig cc;
    cc.policy = routing::parse_policy(flags.expert_cache_policy);
    cc.per_layer = flags.expert_cache_pools == "per-layer";
    cc.admit = routing::parse_admission(flags.expert_cache_admit);
    const int64_t n_moe = c.n_routed_experts ? n_experts / c.n_routed_experts : 0;
    const int64_t min_slots = c.num_experts_per_tok * (cc.per_layer ? n_moe : 1);
    uint64_t budget_flag = 0;  // checked here so a bad size is refused on the CPU too
    if (!flags.vram_budget.empty()) {
        try {
            budget_flag = parse_byte_size(flags.vram_budget);
        } catch (const std::invalid_argument& e) {
            throw UserError(std::string("--vram-budget: ") + e.what());
        }
    }
    if (flags.expert_cache_requested() && n_experts == 0)
        throw UserError("the model has no routed experts: there is nothing for an expert cache");
    if (gpu) {
        const mgl::cuda_device_info dev = mgl::cuda_info(0);
        uint64_t dense = 0;
        for (const auto& t : m.file->tensors()) dense += t.nbytes;
        uint64_t weights = dense + uint64_t(n_experts) * experts.blob_nbytes;
        // The CUDA context, workspaces, graphs, activations and the merged projections for
        // `bytes` of weights on the GPU. With 1 GiB + bytes / 50 the 12 GiB plan of V2-Lite
        // (12,280 MiB planned) peaked at 12,042-12,298 MiB by nvidia-smi over five H200 runs,
        // once over the budget: the fixed part is 1.25 GiB since (~31 slots fewer there).
        auto work_for = [](uint64_t bytes) { return (uint64_t(5) << 28) + bytes / 50; };
        const uint64_t work = work_for(weights);
        const uint64_t need = weights + kv_bytes + work;
        if (flags.expert_cache_requested()) {
            const uint64_t gib1 = uint64_t(1) << 30;
            const uint64_t budget = !flags.vram_budget.empty() ? budget_flag
                                    : dev.free_bytes > gib1    ? dev.free_bytes - gib1
                                                               : 0;
            if (budget > dev.free_bytes) {
                char msg[256];
                std::snprintf(msg, sizeof msg,
                              "--vram-budget %s is more than the %.2f GiB %s has free",
                              flags.vram_budget.c_str(), gib(dev.free_bytes), dev.name.c_str());
                throw UserError(msg);
            }
            MemoryPlanInput in;
            in.budget = budget;
            in.dense_bytes = dense;
            in.slot_bytes = ExpertOffload::slot_bytes_for(experts.blob_nbytes);
            in.n_experts = n_experts;
            // MINIDS_EXPERT_STORE=staging (model/weight_store.cpp): the cache then needs a slot
            // for every expert of a layer (runtime/expert_offload.h), so the plan keeps that many.
            const bool staging = expert_store_request() == ExpertStoreRequest::staging;
            in.min_slots = staging ? std::max<int64_t>(min_slots, c.n_routed_experts) : min_slots;
            if (staging)
                in.min_slots_are = "slots the staging store needs (one per expert of a layer)";
            in.kv_bytes_per_token = kv_per_token;
            in.n_ctx = flags.n_ctx;
            in.work_bytes = work_for(dense);
            in.forced_slots = flags.expert_cache_slots;
            const MemoryPlan plan = plan_memory(in);
            if (!plan.fits) throw UserError(plan.refusal);
            std::fprintf(stderr, "minids %s: memory plan on %s:\n%s\n", command, dev.name.c_str(),
                         plan.table(budget).c_str());
            if (!plan.resident || flags.expert_cache_slots >= 0) {
                cc.n_slots = plan.slots;
                cache_config = cc;
                wo.experts_resident = false;
            }
        } else if (need > dev.free_bytes) {
            char msg[512];
            std::snprintf(msg, sizeof msg,
                          "the model needs %.2f GiB of GPU memory (weights %.2f, KV cache %.2f "
                          "for -c %lld, work %.2f) but %s has %.2f GiB free; use --cpu, a smaller "
                          "-c, or --vram-budget to keep only some experts on the GPU (the expert "
                          "cache is new and not yet measured on a GPU)",
                          gib(need), gib(weights), gib(kv_bytes), (long long)flags.n_ctx, gib(work),
                          dev.name.c_str(), gib(dev.free_bytes));
            throw UserError(msg);
        }
        mgl::cuda_options opt;
        opt.graphs = flags.cuda_graphs;
        m.backend = mgl::make_cuda_backend(opt);
        std::fprintf(stderr, "minids %s: GPU %s, %.1f GiB free of %.1f GiB\n", command,
                     dev.name.c_str(), gib(dev.free_bytes), gib(dev.total_bytes));
    } else {
        try {
            m.backend = mgl::make_cpu_backend(flags.n_threads);
        } catch (const std::system_error& e) {  // ulimit -v / -u: not enough for the threads
            throw UserError(std::string(e.what()) + "; use fewer with -t");
        }
        if (flags.expert_cache_slots >= 0) {
            if (flags.expert_cache_slots < min_slots)
                throw UserError("--expert-cache-slots " + std::to_string(flags.expert_cache_slots) +
                                " is fewer than the " + std::to_string(min_slots) +
                                " experts one step reads at once");
            cc.n_slots = std::min<int64_t>(flags.expert_cache_slots, n_experts);
            cache_config = cc;
        }
        if (!flags.vram_budget.empty())
            std::fprintf(stderr,
                         "minids %s: --vram-budget applies to the GPU; ignored on the CPU\n",
                         command);
        // The cache is allocated whole; one that cannot fit in this machine's memory is the
        // flag's fault, said before the allocation fails (or the kernel's OOM killer steps in).
        const uint64_t ram = uint64_t(sysconf(_SC_PHYS_PAGES)) * uint64_t(sysconf(_SC_PAGE_SIZE));
        if (ram > 0 && kv_bytes > ram)
            throw UserError("-c " + std::to_string(flags.n_ctx) + ": the KV cache would need " +
                            std::to_string(kv_bytes >> 20) + " MiB, more than this machine's " +
                            std::to_string(ram >> 20) + " MiB of memory");
    }
    const bool tty = isatty(fileno(stderr));
    double last_report = -1.0;
    wo.progress = [&](uint64_t done, uint64_t all) {
        const double frac = all ? double(done) / double(all) : 1.0;
        if (!tty || (frac - last_report < 0.02 && done < all)) return;
        last_report = frac;
        std::fprintf(stderr, "\rminids %s: copying weights to the GPU: %3.0f%% (%.1f of %.1f GB)",
                     command, 100.0 * frac, double(done) / 1e9, double(all) / 1e9);
        if (done == all) std::fputc('\n', stderr);
    };
    // Every load check (model_check.h): the weights, the tokenizer, the chat template.
    CheckedModel checked = check_model(std::move(m.file), *m.backend, wo);
    m.file = std::move(checked.file);
    m.model = std::move(checked.model);
    m.tokenizer = std::move(checked.tokenizer);
    if (cache_config) {
        m.expert_cache = make_expert_cache(m, *cache_config, flags, "");
        std::fprintf(
            stderr,
            "minids %s: expert cache: %lld of %lld routed experts in slots (%s, %s "
            "pool%s, admitting %s misses%s%s); the others are read over PCIe from host "
            "memory as needed\n",
            command, (long long)cache_config->n_slots, (long long)n_experts,
            flags.expert_cache_policy.c_str(), flags.expert_cache_pools.c_str(),
            cc.per_layer ? "s" : "", cc.admit == routing::Admission::all ? "all" : "frequent",
            flags.expert_cache_copy_stream ? ", fills on a copy stream" : "",
            !m.expert_cache->uses_device_fetch()      ? ""
            : m.expert_cache->fills_by_copy_engines() ? ", misses fetched into slots by the step "
                                                        "(copied by the copy engines)"
                                                      : ", misses fetched into slots by the step");
    }
    const double load_s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const auto& ex = m.file->experts();
    std::fprintf(stderr,
                 "minids %s: %lld layers, hidden %lld, %lld heads, kv_lora_rank %lld, vocab %lld; "
                 "%lld routed experts (%lld active) in %s, %lld shared\n",
                 command, (long long)c.num_hidden_layers, (long long)c.hidden_size,
                 (long long)c.num_attention_heads, (long long)c.kv_lora_rank,
                 (long long)c.vocab_size, (long long)c.n_routed_experts,
                 (long long)c.num_experts_per_tok, ex.present ? mgl::dtype_name(ex.dtype) : "-",
                 (long long)c.n_shared_experts.value_or(0));
    const WeightPlacement& wp = m.model->weights().placement();
    if (wp.copied) {
        std::fprintf(stderr,
                     "minids %s: on the GPU: dense weights %.1f MiB, experts %.1f MiB%s, expert "
                     "tables %.3f MiB (copied in %.2f s %s), KV cache %.1f MiB "
                     "for %lld tokens (%s)\n",
                     command, mib(wp.dense_bytes), mib(wp.expert_bytes),
                     !wp.experts_in_place ? ""
                     : wp.experts_pinned  ? " (in slots; all of them in a registered host copy)"
                     : wp.experts_staged
                         ? " (in slots; all of them in the file, unregistered: every miss fetched "
                           "through pinned staging buffers)"
                         : " (in slots; all of them in the registered file)",
                     mib(wp.table_bytes), wp.seconds,
                     wp.registered ? "from the page-locked mapping"
                     : wp.staged   ? "through pinned staging buffers"
                                   : "from the pageable mapping",
                     mib(kv_bytes), (long long)flags.n_ctx, mgl::dtype_name(sp.kv_type));
    } else {
        std::fprintf(stderr,
                     "minids %s: weights %.1f MiB read from the mapped file, KV cache %.1f MiB "
                     "for %lld tokens (%s)\n",
                     command, mib(m.model->weight_bytes()), mib(kv_bytes), (long long)flags.n_ctx,
                     mgl::dtype_name(sp.kv_type));
    }
    std::fprintf(stderr, "minids %s: backend %s, loaded in %.2f s\n", command, m.backend->name(),
                 load_s);
    return m;
}

int run_guarded(const char* command, const std::function<int()>& body) {
    try {
        return body();
    } catch (const UserError& e) {
        std::fprintf(stderr, "minids %s: error: %s\n", command, e.what());
        return exit_bad_input;
    } catch (const mds::FileError& e) {
        std::fprintf(stderr, "minids %s: error: %s\n", command, e.what());
        return exit_bad_input;
    } catch (const ConfigError& e) {
        std::fprintf(stderr, "minids %s: error: %s\n", command, e.what());
        return exit_bad_input;
    } catch (const TokenizerError& e) {
        std::fprintf(stderr, "minids %s: error: %s\n", command, e.what());
        return exit_bad_input;
    } catch (const ChatTemplateError& e) {  // the template refused the conversation
        std::fprintf(stderr, "minids %s: error: %s\n", command, e.what());
        return exit_bad_input;
    } catch (const OutputError& e) {  // a file could not be written (disk full, ulimit -f)
        std::fprintf(stderr, "minids %s: error: %s\n", command, e.what());
        return exit_failure;
    } catch (const std::bad_alloc&) {  // a resource limit, not a bug
        std::fprintf(stderr,
                     "minids %s: error: out of memory (a smaller context, -c, needs less)\n",
                     command);
        return exit_failure;
    } catch (const std::system_error& e) {  // the system refused: threads, files, memory maps
        std::fprintf(stderr, "minids %s: error: %s\n", command, e.what());
        return exit_failure;
    } catch (const std::exception& e) {
        std::fprintf(stderr, "minids %s: internal error: %s\n", command, e.what());
        return exit_failure;
    }
}

}  // namespace minids::cli
