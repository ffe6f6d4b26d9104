#include "cli/model_session.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <system_error>

#include "chat/jinja.h"
#include "cli/commands.h"
#include "mgl-cuda.h"
#include "model/config.h"
#include "tokenizer/tokenizer_data.h"

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
    cmd.add_option(
        "--chat-template", f.chat_template,
        "chat template instead of the model's own: deepseek2, deepseek3, chatml or Jinja source "
        "(run sends the prompt as one user message with it)");
    cmd.add_flag("--cpu", f.cpu,
                 "run on the CPU even when a CUDA GPU is present (the GPU is the default when the "
                 "model fits in its free memory)");
    cmd.add_option("--cache-type-k", f.cache_type,
                   "KV cache dtype: bf16 or f32 (default: bf16 on the GPU, f32 on the CPU)")
        ->check(CLI::IsMember({"f32", "bf16"}));
    cmd.add_option("--ubatch-size", f.n_ubatch,
                   "prompt tokens evaluated in one graph (longer prompts run in chunks)")
        ->capture_default_str()
        ->check(CLI::Range(int64_t(1), int64_t(1) << 16));
    cmd.add_flag("!--no-cuda-graphs", f.cuda_graphs,
                 "run every decode step eagerly instead of replaying one captured CUDA graph");
}

void add_sampling_flags(CLI::App& cmd, SamplerParams& p) {
    cmd.add_option("--temp", p.temp, "temperature; 0 picks the most likely token (greedy)")
        ->capture_default_str();
    cmd.add_option("--top-k", p.top_k, "keep the k most likely tokens (0: off)")
        ->capture_default_str();
    cmd.add_option("--top-p", p.top_p,
                   "keep the most likely tokens up to this probability mass (1: off)")
        ->capture_default_str()
        ->check(CLI::Range(0.0f, 1.0f));
    cmd.add_option("--min-p", p.min_p,
                   "drop tokens less likely than min-p times the most likely one (0: off)")
        ->capture_default_str()
        ->check(CLI::Range(0.0f, 1.0f));
    cmd.add_option("--repeat-penalty", p.repeat_penalty,
                   "penalize tokens seen in the last repeat-last-n (1: off)")
        ->capture_default_str()
        ->check(CLI::PositiveNumber);
    cmd.add_option("--repeat-last-n", p.repeat_last_n,
                   "tokens the repeat penalty looks back on (0: off, -1: context)")
        ->capture_default_str()
        ->check(CLI::Range(-1, 1 << 24));
    cmd.add_option("-s,--seed", p.seed, "random seed (4294967295: a random one)")
        ->capture_default_str();
}

namespace {

std::filesystem::path binary_dir() {
    std::error_code ec;
    auto exe = std::filesystem::read_symlink("/proc/self/exe", ec);
    return ec ? std::filesystem::path{} : exe.parent_path();
}

double mib(uint64_t bytes) { return double(bytes) / (1024.0 * 1024.0); }
double gib(uint64_t bytes) { return double(bytes) / (1024.0 * 1024.0 * 1024.0); }

}  // namespace

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

    // The GPU when there is one and the model fits in its free memory; --cpu forces the CPU.
    const bool gpu = !flags.cpu && mgl::cuda_available();
    SessionParams& sp = m.session_params;
    sp.n_ctx = flags.n_ctx;
    sp.n_ubatch = flags.n_ubatch;
    sp.kv_type = flags.cache_type.empty()     ? (gpu ? mgl::dtype::bf16 : mgl::dtype::f32)
                 : flags.cache_type == "bf16" ? mgl::dtype::bf16
                                              : mgl::dtype::f32;
    const uint64_t kv_bytes = uint64_t(c.num_hidden_layers) * uint64_t(flags.n_ctx) *
                              uint64_t(c.kv_cache_width()) * mgl::dtype_size(sp.kv_type);
    if (gpu) {
        const mgl::cuda_device_info dev = mgl::cuda_info(0);
        uint64_t weights = 0;
        for (const auto& t : m.file->tensors()) weights += t.nbytes;
        weights += uint64_t(m.file->experts().blobs.size()) * m.file->experts().blob_nbytes;
        // Workspaces, graphs, activations and the merged projections: measured well under this.
        const uint64_t work = (uint64_t(1) << 30) + weights / 50;
        const uint64_t need = weights + kv_bytes + work;
        if (need > dev.free_bytes) {
            char msg[512];
            std::snprintf(msg, sizeof msg,
                          "the model needs %.2f GiB of GPU memory (weights %.2f, KV cache %.2f "
                          "for -c %lld, work %.2f) but %s has %.2f GiB free; use --cpu, a smaller "
                          "-c, or a smaller model (an expert cache for models larger than the "
                          "GPU is not built yet)",
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
        m.backend = mgl::make_cpu_backend(flags.n_threads);
    }
    WeightOptions wo;
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
    m.model = std::make_unique<Deepseek2Model>(*m.file, *m.backend, wo);
    m.tokenizer = std::make_unique<Tokenizer>(m.file->tokenizer());
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
                     "minids %s: on the GPU: dense weights %.1f MiB, experts %.1f MiB, expert "
                     "tables %.3f MiB (copied in %.2f s from the %s mapping), KV cache %.1f MiB "
                     "for %lld tokens (%s)\n",
                     command, mib(wp.dense_bytes), mib(wp.expert_bytes), mib(wp.table_bytes),
                     wp.seconds, wp.registered ? "page-locked" : "pageable", mib(kv_bytes),
                     (long long)flags.n_ctx, mgl::dtype_name(sp.kv_type));
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
        std::fprintf(stderr, "minids %s: error: chat template: %s\n", command, e.what());
        return exit_bad_input;
    } catch (const std::exception& e) {
        std::fprintf(stderr, "minids %s: internal error: %s\n", command, e.what());
        return exit_failure;
    }
}

}  // namespace minids::cli
