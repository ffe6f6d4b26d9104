#include "cli/model_session.h"

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <system_error>

#include "chat/jinja.h"
#include "cli/commands.h"
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
    m.backend = mgl::make_cpu_backend(flags.n_threads);
    m.model = std::make_unique<Deepseek2Model>(*m.file, *m.backend);
    m.tokenizer = std::make_unique<Tokenizer>(m.file->tokenizer());
    const double load_s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

    const ModelConfig& c = m.model->config();
    const uint64_t kv_bytes =
        uint64_t(c.num_hidden_layers) * uint64_t(flags.n_ctx) * uint64_t(c.kv_cache_width()) * 4;
    const auto& ex = m.file->experts();
    std::fprintf(stderr,
                 "minids %s: %lld layers, hidden %lld, %lld heads, kv_lora_rank %lld, vocab %lld; "
                 "%lld routed experts (%lld active) in %s, %lld shared\n",
                 command, (long long)c.num_hidden_layers, (long long)c.hidden_size,
                 (long long)c.num_attention_heads, (long long)c.kv_lora_rank,
                 (long long)c.vocab_size, (long long)c.n_routed_experts,
                 (long long)c.num_experts_per_tok, ex.present ? mgl::dtype_name(ex.dtype) : "-",
                 (long long)c.n_shared_experts.value_or(0));
    std::fprintf(stderr,
                 "minids %s: weights %.1f MiB mapped from the file, KV cache %.1f MiB for %lld "
                 "tokens (F32), "
                 "backend %s, loaded in %.2f s\n",
                 command, mib(m.model->weight_bytes()), mib(kv_bytes), (long long)flags.n_ctx,
                 m.backend->name(), load_s);
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
