// minids run: one prompt in, the model's continuation streamed to stdout. Logs, the model
// summary and the speed go to stderr, so stdout carries only the generated text (or ids).
#include <sys/resource.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "chat/chat_template.h"
#include "cli/commands.h"
#include "cli/model_session.h"
#include "cli/routing_flags.h"
#include "runtime/generate.h"
#include "runtime/interrupt.h"
#include "runtime/npy.h"
#include "runtime/session.h"
#include "runtime/stop_strings.h"
#include "util/output_file.h"
#include "util/strict_json.h"

namespace minids::cli {

namespace {

struct RunOptions {
    ModelFlags model;
    SamplerParams sampling;
    std::string prompt;
    std::string prompt_file;
    std::string ids;
    int64_t n_predict = -1;
    bool print_ids = false;
    std::string dump_logits;
    std::string dump_tensors;
    bool no_bos = false;
    bool escape = false;                       // -e
    std::vector<std::string> reverse_prompts;  // -r
    bool ignore_eos = false;
    RoutingFlags routing;
};

std::vector<int32_t> parse_ids(const std::string& text, int64_t vocab) {
    std::vector<int32_t> ids;
    std::stringstream ss(text);
    std::string item;
    while (std::getline(ss, item, ',')) {
        size_t used = 0;
        long long v = 0;
        try {
            v = std::stoll(item, &used);
        } catch (const std::exception&) {
            used = 0;
        }
        while (used < item.size() && item[used] == ' ') ++used;
        if (item.empty() || used != item.size()) {
            throw UserError("--ids: expected comma-separated token ids, found \"" + item + "\"");
        }
        if (v < 0 || v >= vocab) {
            throw UserError("--ids: token id " + std::to_string(v) +
                            " is outside the vocabulary [0, " + std::to_string(vocab) + ")");
        }
        ids.push_back(int32_t(v));
    }
    if (ids.empty()) throw UserError("--ids: expected at least one token id");
    return ids;
}

std::string read_prompt_file(const std::string& path) {
    try {
        return read_file_bytes(path, uint64_t{1} << 30);
    } catch (const FileReadError& e) {
        throw UserError(std::string("-f: ") + e.what());
    }
}

const char* stop_name(StopReason r) {
    switch (r) {
        case StopReason::eos:
            return "end of sequence";
        case StopReason::n_predict:
            return "token limit";
        case StopReason::context_full:
            return "context full";
        case StopReason::callback:
            return "stop string";
        case StopReason::interrupted:
            return "interrupted";
    }
    return "?";
}

// Outputs are checked before any work, so a bad path is not found out after the generation.
void check_output(const char* flag, const std::filesystem::path& path) {
    try {
        check_output_file(path);
    } catch (const OutputError& e) {
        throw UserError(std::string(flag) + ": " + e.what());
    }
}

void check_outputs(const RunOptions& o) {
    if (!o.dump_logits.empty()) check_output("--dump-logits", o.dump_logits);
    if (!o.dump_tensors.empty()) {
        std::error_code ec;
        if (!std::filesystem::is_directory(o.dump_tensors, ec))
            std::filesystem::create_directories(o.dump_tensors, ec);
        if (ec || !std::filesystem::is_directory(o.dump_tensors, ec))
            throw UserError("--dump-tensors: cannot create the directory " + o.dump_tensors +
                            (ec ? ": " + ec.message() : std::string()));
        check_output("--dump-tensors", std::filesystem::path(o.dump_tensors) / "probe.npy");
    }
}

int run(const RunOptions& o) {
    const int n_sources = !o.prompt.empty() + !o.prompt_file.empty() + !o.ids.empty();
    if (n_sources != 1) throw UserError("give exactly one prompt: -p TEXT, -f FILE or --ids 0,5,9");
    check_outputs(o);
    std::string text = o.prompt_file.empty() ? o.prompt : read_prompt_file(o.prompt_file);
    if (o.escape) text = process_escapes(text);
    std::vector<std::string> stops = o.reverse_prompts;
    if (o.escape)
        for (std::string& stop : stops) stop = process_escapes(stop);
    for (const std::string& stop : stops)
        if (stop.empty()) throw UserError("-r: expected a non-empty stop string");
    LoadedModel m = load_model(o.model, "run");
    const ModelConfig& cfg = m.model->config();

    std::vector<int32_t> prompt;
    if (!o.ids.empty()) {
        prompt = parse_ids(o.ids, cfg.vocab_size);
    } else {
        if (!o.model.chat_template.empty()) {
            // The prompt becomes one user message; the template writes BOS itself.
            const Tokenizer& tok = *m.tokenizer;
            std::string source;
            try {
                source = resolve_chat_template(o.model.chat_template, tok.data().chat_template);
            } catch (const ChatTemplateError& e) {
                throw UserError(std::string("--chat-template: ") + e.what());
            }
            const std::string bos = tok.bos_id() ? tok.token_text(*tok.bos_id()) : std::string();
            const std::string eos = tok.eos_id() ? tok.token_text(*tok.eos_id()) : std::string();
            text = render_chat(source, {{"user", text}}, /*add_generation_prompt=*/true, bos, eos);
            prompt = tok.encode(text, /*add_special=*/false, /*parse_special=*/true);
        } else {
            prompt = m.tokenizer->encode(text, /*add_special=*/!o.no_bos);
        }
    }
    if (prompt.empty()) throw UserError("the prompt is empty");
    const int64_t n_prompt = int64_t(prompt.size());
    if (n_prompt > o.model.n_ctx) {
        throw UserError("the prompt has " + std::to_string(n_prompt) +
                        " tokens, more than the context of " + std::to_string(o.model.n_ctx) +
                        " (-c)");
    }
    // -n beyond the room left generates until the context is full, as llama.cpp does.

    Session session(*m.model, *m.backend, m.session_params);
    attach_expert_cache(m, session);
    RoutingHooks routing(o.routing, m, "run");
    routing.install(session);
    Sampler sampler(o.sampling, o.model.n_ctx);
    InterruptHandler interrupt;
    StreamingDetokenizer detok(*m.tokenizer, /*skip_special=*/false);
    StopStringFilter filter(stops);
    std::vector<int32_t> generated;
    bool output_failed = false;  // stdout closed (a pipe whose reader left) or full
    int output_errno = 0;
    auto emit = [&](const std::string& piece) {
        if (piece.empty() || output_failed) return;
        if (std::fwrite(piece.data(), 1, piece.size(), stdout) != piece.size() ||
            std::fflush(stdout) != 0) {
            output_failed = true;
            output_errno = errno;
        }
    };

    GenerateParams gp;
    gp.n_predict = o.n_predict;
    gp.eos_id = m.tokenizer->eos_id() ? m.tokenizer->eos_id()
                                      : std::optional<int32_t>(int32_t(cfg.eos_token_id));
    gp.interrupt = &interrupt;
    gp.ignore_eos = o.ignore_eos;
    // --dump-tensors: every named intermediate of the prompt's forward as DIR/<name>.npy.
    int64_t n_dumped = 0;
    TensorObserver dump_tensor = [&](const mgl::tensor& t, std::span<const float> values) {
        std::vector<int64_t> shape(t.shape.begin(), t.shape.begin() + t.n_dims);
        write_npy_f32((std::filesystem::path(o.dump_tensors) / (t.name + ".npy")).string(), values,
                      shape);
        ++n_dumped;
    };
    if (!o.dump_tensors.empty()) gp.observe_prefill = &dump_tensor;
    std::vector<float> prompt_logits;
    GenerationStats st = generate(
        session, sampler, prompt, gp,
        [&](int32_t id) {
            generated.push_back(id);
            // The text goes through the -r stop strings even with --print-ids.
            const std::string piece = filter.push(detok.push(id));
            if (!o.print_ids) emit(piece);
            return !filter.stopped() && !output_failed;
        },
        o.dump_logits.empty() ? nullptr : &prompt_logits);

    if (o.print_ids) {
        std::string line;
        for (size_t i = 0; i < generated.size(); ++i)
            line += (i ? " " : "") + std::to_string(generated[i]);
        emit(line + "\n");
    } else {
        emit(filter.push(detok.flush()));
        emit(filter.flush());
        if (st.n_gen > 0) emit("\n");
    }
    if (output_failed)
        throw OutputError(std::string("stdout: cannot write the output: ") +
                          std::strerror(output_errno));
    routing.write();
    if (!o.dump_logits.empty()) {
        write_npy_f32(o.dump_logits, prompt_logits, {n_prompt, cfg.vocab_size});
        std::fprintf(stderr, "minids run: wrote logits [%lld, %lld] to %s\n", (long long)n_prompt,
                     (long long)cfg.vocab_size, o.dump_logits.c_str());
    }
    if (!o.dump_tensors.empty()) {
        std::fprintf(stderr, "minids run: wrote %lld named intermediates of the prompt to %s\n",
                     (long long)n_dumped, o.dump_tensors.c_str());
    }
    std::fprintf(
        stderr,
        "minids run: prompt %lld tokens in %.3f s (%.2f tok/s), generated %lld tokens in %.3f s "
        "(%.2f tok/s), stopped: %s, seed %u\n",
        (long long)st.n_prompt, st.prompt_s,
        st.prompt_s > 0 ? double(st.n_prompt) / st.prompt_s : 0.0, (long long)st.n_gen, st.gen_s,
        st.gen_s > 0 ? double(st.n_gen) / st.gen_s : 0.0, stop_name(st.stop), sampler.seed());
    if (const std::string ec = expert_cache_summary(m); !ec.empty())
        std::fprintf(stderr, "minids run: %s\n", ec.c_str());
    // Resident memory includes the pages of the mapped file that were touched (the weights read).
    struct rusage usage {};
    if (getrusage(RUSAGE_SELF, &usage) == 0) {
        std::fprintf(stderr, "minids run: peak resident memory %.1f MiB\n",
                     double(usage.ru_maxrss) / 1024.0);
    }
    return st.stop == StopReason::interrupted ? exit_interrupted : exit_ok;
}

}  // namespace

void add_run_command(CLI::App& app, int& exit_code) {
    auto opts = std::make_shared<RunOptions>();
    auto* cmd = app.add_subcommand(
        "run",
        "one-shot prompt: stream the model's continuation to stdout (logs and speed on stderr)");
    add_model_flags(*cmd, opts->model);
    cmd->add_option("-p,--prompt", opts->prompt, "prompt text (BOS is added unless --no-bos)");
    cmd->add_option("-f,--file", opts->prompt_file, "read the prompt text from a file");
    cmd->add_option("--ids", opts->ids,
                    "prompt as comma-separated token ids, used as given (e.g. 0,5,9)");
    cmd->add_option(
           "-n,--n-predict", opts->n_predict,
           "tokens to generate (-1: until end of sequence or the context is full; 0: prompt only; "
           "more than the context holds: until it is full)")
        ->capture_default_str()
        ->check(CLI::Range(int64_t(-1), int64_t(1) << 24));
    add_sampling_flags(*cmd, opts->sampling);
    cmd->add_flag("--print-ids", opts->print_ids,
                  "print the generated token ids (one line) instead of the text");
    cmd->add_option("--dump-tensors", opts->dump_tensors,
                    "write every named intermediate of the prompt's forward (e.g. q_pe-3, "
                    "kv_cmpr-0, moe_out-1, result_output) as DIR/NAME.npy float32, to compare a "
                    "run layer by layer with a reference");
    cmd->add_option("--dump-logits", opts->dump_logits,
                    "write the float32 logits of every prompt position to this .npy file, shape "
                    "[n_prompt, vocab]");
    cmd->add_flag("--no-bos", opts->no_bos, "do not add the BOS token to a text prompt");
    cmd->add_flag("-e,--escape", opts->escape,
                  "process escapes in -p and -r: \\n \\r \\t \\' \\\" \\\\ \\xHH (as llama.cpp)");
    cmd->add_option("-r,--reverse-prompt", opts->reverse_prompts,
                    "stop when the output would contain this text (not printed); may be given "
                    "more than once")
        ->allow_extra_args(false);
    cmd->add_flag("--ignore-eos", opts->ignore_eos,
                  "never stop at end of sequence: the EOS token is not sampled (as llama.cpp)");
    add_routing_flags(*cmd, opts->routing);
    cmd->callback(
        [opts, &exit_code] { exit_code = run_guarded("run", [&] { return run(*opts); }); });
}

}  // namespace minids::cli
