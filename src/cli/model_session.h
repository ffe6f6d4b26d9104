// What `minids run` and `minids chat` share: the model/context/thread flags, the sampling flags
// (llama.cpp's names and defaults), opening the model (or the demo model), and the summary on
// stderr.
#pragma once

#include <memory>
#include <optional>
#include <stdexcept>
#include <string>

#include <CLI/CLI.hpp>

#include "mds/reader.h"
#include "mgl.h"
#include "model/deepseek2.h"
#include "runtime/expert_offload.h"
#include "runtime/sampler.h"
#include "runtime/session.h"
#include "tokenizer/tokenizer.h"

namespace minids::cli {

// A mistake of the user's (bad flag value, missing file, context overflow): one plain sentence,
// exit code 2.
struct UserError : std::runtime_error {
    using std::runtime_error::runtime_error;
};

struct ModelFlags {
    std::string model_path;     // -m; empty: the demo model
    int64_t n_ctx = 4096;       // -c
    int n_threads = 0;          // -t; 0: physical cores
    std::string chat_template;  // --chat-template; empty: the model's own
    bool cpu = false;           // --cpu: run on the CPU even when a GPU is present
    std::string cache_type;     // --cache-type-k: f32 | bf16 | f16 (empty: f16 GPU, f32 CPU)
    int64_t n_ubatch = 512;     // --ubatch-size: most prompt tokens in one graph
    bool cuda_graphs = true;    // --no-cuda-graphs turns the decode-step graph replay off
    // -ngl / --n-gpu-layers, as llama.cpp: 0 runs on the CPU; any other value means the GPU, with
    // the memory plan deciding what is placed where. Unset: the default backend.
    std::optional<int> n_gpu_layers;
    // The expert cache (docs/expert-cache.md). Either flag turns it on: the memory plan then
    // places dense weights, KV cache and work memory within the budget and fills the rest with
    // expert slots (all experts fit: fully resident, no cache).
    std::string vram_budget;          // --vram-budget SIZE (GPU; default: free memory less 1 GiB)
    int64_t expert_cache_slots = -1;  // --expert-cache-slots N (-1: as many as the plan fits)
    std::string expert_cache_policy = "decay";  // --expert-cache-policy lru|lfu|decay
    std::string expert_cache_pools = "global";  // --expert-cache-pools global|per-layer
    std::string expert_cache_admit = "all";     // --expert-cache-admit all|frequency
    bool expert_cache_copy_stream = false;      // --expert-cache-copy-stream
    std::string expert_cache_fetch = "auto";    // --expert-cache-fetch auto|host|device
    int expert_prefetch = -1;                   // --expert-prefetch N, or auto (-1)
    int expert_prefetch_fills = -1;             // --expert-prefetch-fills N, or auto (-1)
    int expert_prompt_stage = -1;               // --expert-prompt-stage N, or auto (-1)
    bool expert_cache_requested() const { return !vram_budget.empty() || expert_cache_slots >= 0; }
};

void add_model_flags(CLI::App& cmd, ModelFlags& flags);
void add_sampling_flags(CLI::App& cmd, SamplerParams& params);

// A validator for floating-point flags: a finite number in [lo, hi] (NaN and infinities are
// refused, and the message says so in one short line).
CLI::Validator finite_in(double lo, double hi);

// llama.cpp's -e: \n, \r, \t, \', \", \\ and \xHH in `text` become the characters they
// name; other backslashes stay as they are.
std::string process_escapes(const std::string& text);

// An opened model, ready to make sessions.
struct LoadedModel {
    SessionParams session_params;  // context, KV cache dtype, ubatch for this backend
    std::unique_ptr<mds::MdsFile> file;
    std::unique_ptr<mgl::backend> backend;  // before the model, which places weights for it
    std::unique_ptr<Deepseek2Model> model;
    std::unique_ptr<Tokenizer> tokenizer;
    std::unique_ptr<ExpertOffload> expert_cache;  // when the plan keeps experts in the mapping
};

// An expert cache over m's model and backend (fills on a copy stream or inside the step, as the
// flags ask); a configuration it refuses is a UserError, `context` put before its message.
std::unique_ptr<ExpertOffload> make_expert_cache(const LoadedModel& m,
                                                 const routing::CacheConfig& config,
                                                 const ModelFlags& flags,
                                                 const std::string& context);
// Gives a session of `m` its expert cache bookkeeping (nothing without a cache).
void attach_expert_cache(const LoadedModel& m, Session& session);
// One line of the cache's counters for stderr ("" without a cache).
std::string expert_cache_summary(const LoadedModel& m);

// -m, or the demo model (MINIDS_DEMO_MODEL_DEFAULT, then ../models/demo.mds next to the binary),
// saying on stderr which one. Throws UserError when there is none.
std::string resolve_model_path(const std::string& flag, const char* command);
// Opens and binds the model, prints the summary (layers, experts, memory) to stderr.
LoadedModel load_model(const ModelFlags& flags, const char* command);

// Runs `body` and maps the errors to exit codes with one line on stderr:
// user errors and malformed files -> 2, anything else -> 1.
int run_guarded(const char* command, const std::function<int()>& body);

}  // namespace minids::cli
