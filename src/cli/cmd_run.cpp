// minids run: one prompt in, the model's continuation streamed to stdout. Logs, the model
// summary and the speed go to stderr, so stdout carries only the generated text (or ids).
#include <sys/resource.h>

#include <cstdio>
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

std::string read_text_file(const std::string& path) {
    std::ifstream f(path, std::ios::binary);
    if (!f) throw UserError("cannot read the prompt file " + path);
    return std::string(std::istreambuf_iterator<char>(f), {});
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

int run(const RunOptions& o) {
    const int n_sources = !o.prompt.empty() + !o.prompt_file.empty() + !o.ids.empty();
    if (n_sources != 1) throw UserError("give exactly one prompt: -p TEXT, -f FILE or --ids 0,5,9");
    LoadedModel m = load_model(o.model, "run");
    const ModelConfig& cfg = m.model->config();

    std::vector<int32_t> prompt;
    if (!o.ids.empty()) {
        prompt = parse_ids(o.ids, cfg.vocab_size);
    } else {
        std::string text = o.prompt_file.empty() ? o.prompt : read_text_file(o.prompt_file);
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
    if (o.n_predict > 0 && n_prompt + o.n_predict > o.model.n_ctx) {
        throw UserError("the prompt (" + std::to_string(n_prompt) + " tokens) plus -n " +
                        std::to_string(o.n_predict) + " exceeds the context of " +
                        std::to_string(o.model.n_ctx) + " tokens (-c)");
    }

    SessionParams sp;
    sp.n_ctx = o.model.n_ctx;
    Session session(*m.model, *m.backend, sp);
    RoutingHooks routing(o.routing, m, "run");
    routing.install(session);
    Sampler sampler(o.sampling, o.model.n_ctx);
    InterruptHandler interrupt;
    StreamingDetokenizer detok(*m.tokenizer, /*skip_special=*/false);
    std::vector<int32_t> generated;

    GenerateParams gp;
    gp.n_predict = o.n_predict;
    gp.eos_id = m.tokenizer->eos_id() ? m.tokenizer->eos_id()
                                      : std::optional<int32_t>(int32_t(cfg.eos_token_id));
    gp.interrupt = &interrupt;
    // --dump-tensors: every named intermediate of the prompt's forward as DIR/<name>.npy.
    int64_t n_dumped = 0;
    TensorObserver dump_tensor = [&](const mgl::tensor& t, std::span<const float> values) {
        std::vector<int64_t> shape(t.shape.begin(), t.shape.begin() + t.n_dims);
        write_npy_f32((std::filesystem::path(o.dump_tensors) / (t.name + ".npy")).string(), values,
                      shape);
        ++n_dumped;
    };
    if (!o.dump_tensors.empty()) {
        std::error_code ec;
        std::filesystem::create_directories(o.dump_tensors, ec);
        if (ec || !std::filesystem::is_directory(o.dump_tensors)) {
            throw UserError("--dump-tensors: cannot create the directory " + o.dump_tensors);
        }
        gp.observe_prefill = &dump_tensor;
    }
    std::vector<float> prompt_logits;
    GenerationStats st = generate(
        session, sampler, prompt, gp,
        [&](int32_t id) {
            generated.push_back(id);
            if (!o.print_ids) {
                std::string piece = detok.push(id);
                std::fwrite(piece.data(), 1, piece.size(), stdout);
                std::fflush(stdout);
            }
            return true;
        },
        o.dump_logits.empty() ? nullptr : &prompt_logits);

    if (o.print_ids) {
        std::string line;
        for (size_t i = 0; i < generated.size(); ++i)
            line += (i ? " " : "") + std::to_string(generated[i]);
        std::printf("%s\n", line.c_str());
    } else {
        std::string rest = detok.flush();
        std::fwrite(rest.data(), 1, rest.size(), stdout);
        if (st.n_gen > 0) std::fputc('\n', stdout);
    }
    std::fflush(stdout);
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
           "tokens to generate (-1: until end of sequence or the context is full; 0: prompt only)")
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
    add_routing_flags(*cmd, opts->routing);
    cmd->callback(
        [opts, &exit_code] { exit_code = run_guarded("run", [&] { return run(*opts); }); });
}

}  // namespace minids::cli
