#include "cli/model_session.h"

#include <unistd.h>

#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <new>
#include <sstream>
#include <system_error>

#include "chat/jinja.h"
#include "cli/commands.h"
#include "cli/model_check.h"
#include "model/config.h"
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
    try {
        m.backend = mgl::make_cpu_backend(flags.n_threads);
    } catch (const std::system_error& e) {  // ulimit -v / -u: not enough for the threads
        throw UserError(std::string(e.what()) + "; use fewer with -t");
    }
    CheckedModel checked = open_checked_model(path, *m.backend);
    m.file = std::move(checked.file);
    m.model = std::move(checked.model);
    m.tokenizer = std::move(checked.tokenizer);
    const double load_s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

    const ModelConfig& c = m.model->config();
    const uint64_t kv_bytes =
        uint64_t(c.num_hidden_layers) * uint64_t(flags.n_ctx) * uint64_t(c.kv_cache_width()) * 4;
    // The cache is allocated whole; one that cannot fit in this machine's memory is the flag's
    // fault, said before the allocation fails (or the kernel's OOM killer ends the process).
    const uint64_t ram = uint64_t(sysconf(_SC_PHYS_PAGES)) * uint64_t(sysconf(_SC_PAGE_SIZE));
    if (ram > 0 && kv_bytes > ram)
        throw UserError("-c " + std::to_string(flags.n_ctx) + ": the KV cache would need " +
                        std::to_string(kv_bytes >> 20) + " MiB, more than this machine's " +
                        std::to_string(ram >> 20) + " MiB of memory");
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
