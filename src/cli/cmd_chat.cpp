// minids chat: an interactive REPL over the model's chat template. Each turn re-renders the whole
// conversation, keeps the longest prefix of it that is already in the KV cache and prefills only
// the rest, so a new turn costs only its own tokens.
#include <unistd.h>

#include <cstdio>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <editline/readline.h>

#include "chat/chat_template.h"
#include "cli/commands.h"
#include "cli/model_session.h"
#include "cli/routing_flags.h"
#include "runtime/generate.h"
#include "runtime/interrupt.h"
#include "runtime/session.h"
#include "runtime/stop_strings.h"

namespace minids::cli {

namespace {

struct ChatOptions {
    ModelFlags model;
    SamplerParams sampling;
    std::string system_prompt;
    int64_t n_predict = -1;
    bool escape = false;                       // -e
    std::vector<std::string> reverse_prompts;  // -r
    bool ignore_eos = false;
    RoutingFlags routing;
};

constexpr const char* kHelp =
    "minids chat: /help lists these commands, /clear forgets the conversation, /exit (or Ctrl-D) "
    "quits; a line ending in \\ continues on the next; Ctrl-C stops an answer, a second Ctrl-C "
    "exits";

// Lines from the terminal through libedit (editing, history), or plain lines from a pipe.
class LineReader {
public:
    LineReader() : tty_(isatty(STDIN_FILENO) != 0) {}
    bool tty() const { return tty_; }
    // nullopt at end of input.
    std::optional<std::string> read(const char* prompt) {
        if (tty_) {
            char* line = readline(prompt);
            if (!line) return std::nullopt;
            std::string s(line);
            std::free(line);
            if (!s.empty()) add_history(s.c_str());
            return s;
        }
        std::string s;
        if (!std::getline(std::cin, s)) return std::nullopt;
        return s;
    }

private:
    bool tty_;
};

// One message of user input: lines ending in a backslash continue on the next line.
std::optional<std::string> read_message(LineReader& in) {
    std::string text;
    const char* prompt = "> ";
    for (;;) {
        std::optional<std::string> line = in.read(in.tty() ? prompt : "");
        if (!line) return text.empty() ? std::nullopt : std::optional<std::string>(text);
        if (!line->empty() && line->back() == '\\') {
            line->pop_back();
            text += *line + "\n";
            prompt = "... ";
            continue;
        }
        text += *line;
        return text;
    }
}

// The template's text pieces chat needs besides rendering.
struct ChatFormat {
    std::string source;              // Jinja
    std::string bos_text, eos_text;  // what bos_token / eos_token render as
    std::vector<std::string> stops;  // text that ends an answer besides the EOS id
    // What the template puts between the generation prompt and an assistant message's content
    // (" " for DeepSeek-V2: "Assistant:" vs "Assistant: " + content). The model generates it as
    // part of its answer; stripping it from the stored content makes the re-rendered
    // conversation repeat the generated text exactly, so the answer stays reusable in the cache.
    std::string assistant_lead;
};

std::string token_text_or_empty(const Tokenizer& tok, std::optional<int32_t> id) {
    return id ? tok.token_text(*id) : std::string();
}

std::string trim(std::string s) {
    const char* space = " \t\r\n";
    s.erase(0, std::min(s.size(), s.find_first_not_of(space)));
    s.erase(s.find_last_not_of(space) + 1);
    return s;
}

// A model that does not end its answer with EOS tends to write the next user turn itself. The
// text that opens a user turn is found by rendering a conversation with and without one more
// user message and taking what precedes that message's content ("User:" for DeepSeek-V2).
std::string user_turn_opening(const ChatFormat& f) {
    try {
        const std::vector<ChatMessage> two = {{"user", "Q"}, {"assistant", "A"}};
        std::vector<ChatMessage> three = two;
        three.push_back({"user", "MINIDS_NEXT_USER_TURN"});
        const std::string a = render_chat(f.source, two, false, f.bos_text, f.eos_text);
        const std::string b = render_chat(f.source, three, false, f.bos_text, f.eos_text);
        const size_t at = b.find("MINIDS_NEXT_USER_TURN");
        if (b.compare(0, a.size(), a) != 0 || at == std::string::npos || at < a.size()) return {};
        return trim(b.substr(a.size(), at - a.size()));
    } catch (const std::exception&) {
        return {};  // a template that refuses this conversation simply gets no stop string
    }
}

std::string assistant_lead(const ChatFormat& f) {
    try {
        const std::string a = render_chat(f.source, {{"user", "Q"}}, true, f.bos_text, f.eos_text);
        const std::string b = render_chat(f.source, {{"user", "Q"}, {"assistant", "MINIDS_ANSWER"}},
                                          false, f.bos_text, f.eos_text);
        const size_t at = b.find("MINIDS_ANSWER");
        if (b.compare(0, a.size(), a) != 0 || at == std::string::npos || at < a.size()) return {};
        return b.substr(a.size(), at - a.size());
    } catch (const std::exception&) {
        return {};
    }
}

// The generation prompt itself ("Assistant:"): a model that writes it inside its answer has
// started another answer of its own.
std::string generation_opening(const ChatFormat& f) {
    try {
        const std::string with =
            render_chat(f.source, {{"user", "Q"}}, true, f.bos_text, f.eos_text);
        const std::string without =
            render_chat(f.source, {{"user", "Q"}}, false, f.bos_text, f.eos_text);
        if (with.compare(0, without.size(), without) != 0) return {};
        return trim(with.substr(without.size()));
    } catch (const std::exception&) {
        return {};
    }
}

ChatFormat chat_format(const LoadedModel& m, const std::string& choice,
                       const std::vector<std::string>& extra_stops) {
    ChatFormat f;
    const std::string& own = m.file->tokenizer().chat_template;
    if (choice.empty() && own.empty()) {
        std::fprintf(stderr, "minids chat: the model has no chat template, using deepseek2\n");
        f.source = resolve_chat_template("deepseek2", own);
    } else {
        try {
            f.source = resolve_chat_template(choice, own);
        } catch (const ChatTemplateError& e) {
            throw UserError(std::string("--chat-template: ") + e.what());
        }
    }
    f.bos_text = token_text_or_empty(*m.tokenizer, m.tokenizer->bos_id());
    f.eos_text = token_text_or_empty(*m.tokenizer, m.tokenizer->eos_id());
    if (!f.eos_text.empty()) f.stops.push_back(f.eos_text);
    for (std::string opening : {user_turn_opening(f), generation_opening(f)}) {
        if (!opening.empty()) f.stops.push_back(opening);
    }
    f.assistant_lead = assistant_lead(f);
    f.stops.insert(f.stops.end(), extra_stops.begin(), extra_stops.end());
    return f;
}

// The conversation as the model sees it. The template writes BOS itself: encode without adding
// specials, parsing them in the text. Throws ChatTemplateError (the template refuses the
// conversation) or TokenizerError (text that is not UTF-8).
std::vector<int32_t> conversation_tokens(const ChatFormat& format, const Tokenizer& tok,
                                         const std::vector<ChatMessage>& messages) {
    const std::string prompt =
        render_chat(format.source, messages,
                    /*add_generation_prompt=*/true, format.bos_text, format.eos_text);
    std::vector<int32_t> tokens = tok.encode(prompt, /*add_special=*/false, /*parse_special=*/true);
    if (tok.bos_id() && tok.data().add_bos && (tokens.empty() || tokens.front() != *tok.bos_id()))
        tokens.insert(tokens.begin(), *tok.bos_id());
    return tokens;
}

// Drops the oldest turns (the fixed system prompt stays, the new message too) until the
// conversation leaves `answer_room` tokens of the context free, as llama.cpp's context shift
// keeps the conversation going. Returns the tokens and sets `dropped` to the turns removed.
std::vector<int32_t> fit_conversation(const ChatFormat& format, const Tokenizer& tok,
                                      std::vector<ChatMessage>& messages, size_t n_fixed,
                                      int64_t n_ctx, int64_t answer_room, size_t& dropped) {
    dropped = 0;
    for (;;) {
        std::vector<int32_t> tokens = conversation_tokens(format, tok, messages);
        if (int64_t(tokens.size()) + answer_room <= n_ctx || messages.size() <= n_fixed + 1)
            return tokens;
        // One turn: the oldest user message and what answers it, up to the next user message.
        size_t end = n_fixed + 1;
        while (end + 1 < messages.size() && messages[end].role != "user") ++end;
        messages.erase(messages.begin() + std::ptrdiff_t(n_fixed),
                       messages.begin() + std::ptrdiff_t(end));
        ++dropped;
    }
}

int chat(const ChatOptions& o) {
    std::vector<std::string> stops = o.reverse_prompts;
    std::string system_prompt = o.system_prompt;
    if (o.escape) {
        system_prompt = process_escapes(system_prompt);
        for (std::string& stop : stops) stop = process_escapes(stop);
    }
    for (const std::string& stop : stops)
        if (stop.empty()) throw UserError("-r: expected a non-empty stop string");
    LoadedModel m = load_model(o.model, "chat");
    const ModelConfig& cfg = m.model->config();
    const Tokenizer& tok = *m.tokenizer;
    const ChatFormat format = chat_format(m, o.model.chat_template, stops);
    const int64_t n_ctx = o.model.n_ctx;
    // What an answer may need: -n when given, else a quarter of the context.
    const int64_t answer_room = o.n_predict > 0 ? std::min(o.n_predict, n_ctx / 2) : n_ctx / 4;

    Session session(*m.model, *m.backend, m.session_params);
    attach_expert_cache(m, session);
    RoutingHooks routing(o.routing, m, "chat");  // the trace is written when chat returns
    routing.install(session);
    Sampler sampler(o.sampling, n_ctx);
    InterruptHandler interrupt;
    LineReader in;
    std::vector<ChatMessage> messages;
    if (!system_prompt.empty()) messages.push_back({"system", system_prompt});
    const size_t n_fixed = messages.size();
    const std::optional<int32_t> eos =
        tok.eos_id() ? tok.eos_id() : std::optional<int32_t>(int32_t(cfg.eos_token_id));
    if (in.tty()) std::fprintf(stderr, "%s\n", kHelp);

    for (;;) {
        interrupt.set_at_prompt(true);
        std::optional<std::string> input = read_message(in);
        interrupt.set_at_prompt(false);
        interrupt.clear();
        if (!input || *input == "/exit") return exit_ok;
        if (*input == "/help") {
            std::fprintf(stderr, "%s\n", kHelp);
            continue;
        }
        if (*input == "/clear") {
            messages.resize(n_fixed);
            sampler.reset_history();
            std::fprintf(stderr, "minids chat: conversation cleared\n");
            continue;
        }
        if (input->empty()) continue;

        // One bad line is refused with a message; the conversation goes on.
        messages.push_back({"user", *input});
        const std::vector<ChatMessage> before = messages;
        std::vector<int32_t> tokens;
        size_t dropped = 0;
        try {
            tokens = fit_conversation(format, tok, messages, n_fixed, n_ctx, answer_room, dropped);
        } catch (const TokenizerError& e) {
            std::fprintf(stderr, "minids chat: this message is not sent: %s\n", e.what());
            messages = before;
            messages.pop_back();
            continue;
        } catch (const ChatTemplateError& e) {
            std::fprintf(stderr, "minids chat: this message is not sent: %s\n", e.what());
            messages = before;
            messages.pop_back();
            continue;
        }
        if (int64_t(tokens.size()) >= n_ctx) {
            std::fprintf(
                stderr,
                "minids chat: this message is not sent: with it the conversation needs %zu "
                "tokens even with the older turns dropped, more than the context of %lld "
                "(-c)\n",
                tokens.size(), (long long)n_ctx);
            messages = before;
            messages.pop_back();
            continue;
        }
        if (dropped)
            std::fprintf(
                stderr, "minids chat: the context is full: dropped the oldest %zu turn%s%s\n",
                dropped, dropped == 1 ? "" : "s", n_fixed ? " (the system prompt is kept)" : "");
        // Reuse the cached prefix; at least one token must be evaluated to get logits.
        const int64_t reused =
            std::min<int64_t>(session.common_prefix(tokens), int64_t(tokens.size()) - 1);
        session.truncate(reused);
        std::span<const int32_t> new_tokens = std::span(tokens).subspan(size_t(reused));

        StreamingDetokenizer detok(tok, /*skip_special=*/true);
        StopStringFilter filter(format.stops);
        GenerateParams gp;
        gp.n_predict = o.n_predict;
        gp.eos_id = eos;
        gp.ignore_eos = o.ignore_eos;
        gp.interrupt = &interrupt;
        auto emit = [](const std::string& s) {
            std::fwrite(s.data(), 1, s.size(), stdout);
            std::fflush(stdout);
        };
        GenerationStats st = generate(session, sampler, new_tokens, gp, [&](int32_t id) {
            emit(filter.push(detok.push(id)));
            return !filter.stopped();
        });
        emit(filter.push(detok.flush()));
        emit(filter.flush());
        emit("\n");
        std::string answer = filter.released();
        if (!format.assistant_lead.empty() && answer.starts_with(format.assistant_lead)) {
            answer.erase(0, format.assistant_lead.size());
        }
        messages.push_back({"assistant", answer});
        std::fprintf(
            stderr,
            "[prompt %lld new tokens (%lld reused) %.1f tok/s, answer %lld tokens %.1f tok/s%s]\n",
            (long long)st.n_prompt, (long long)reused,
            st.prompt_s > 0 ? double(st.n_prompt) / st.prompt_s : 0.0, (long long)st.n_gen,
            st.gen_s > 0 ? double(st.n_gen) / st.gen_s : 0.0,
            st.stop == StopReason::interrupted    ? ", interrupted"
            : st.stop == StopReason::context_full ? ", context full"
                                                  : "");
        if (const std::string ec = expert_cache_summary(m); !ec.empty())
            std::fprintf(stderr, "[%s]\n", ec.c_str());
    }
}

}  // namespace

void add_chat_command(CLI::App& app, int& exit_code) {
    auto opts = std::make_shared<ChatOptions>();
    auto* cmd = app.add_subcommand(
        "chat",
        "interactive chat with the model's chat template: /help lists the commands, /clear "
        "forgets the conversation, /exit (or Ctrl-D) quits, a line ending in \\ continues on the "
        "next; Ctrl-C stops an answer, a second Ctrl-C exits. When the context fills, the oldest "
        "turns are dropped (the system prompt is kept)");
    add_model_flags(*cmd, opts->model);
    cmd->add_option("--sys,--system-prompt", opts->system_prompt,
                    "system message at the start of the conversation (also -sys, as in llama.cpp)");
    cmd->add_option("-n,--n-predict", opts->n_predict,
                    "most tokens per answer (-1: until end of sequence)")
        ->capture_default_str()
        ->check(CLI::Range(int64_t(-1), int64_t(1) << 24));
    add_sampling_flags(*cmd, opts->sampling);
    cmd->add_flag("-e,--escape", opts->escape,
                  "process escapes in -sys and -r: \\n \\r \\t \\' \\\" \\\\ \\xHH (as llama.cpp)");
    cmd->add_option("-r,--reverse-prompt", opts->reverse_prompts,
                    "end an answer when it would contain this text (not printed); may be given "
                    "more than once")
        ->allow_extra_args(false);
    cmd->add_flag("--ignore-eos", opts->ignore_eos,
                  "never end an answer at end of sequence: the EOS token is not sampled");
    add_routing_flags(*cmd, opts->routing);
    cmd->callback(
        [opts, &exit_code] { exit_code = run_guarded("chat", [&] { return chat(*opts); }); });
}

}  // namespace minids::cli
