// minids tokenize: print the token ids of a text, with the tokenizer of a model file or of a
// Hugging Face tokenizer.json. `--jsonl` turns it into a batch tool whose output can be compared
// line by line with HF `tokenizers` (`encode(text, add_special_tokens=False).ids`).
#include <cstdio>
#include <fstream>
#include <iostream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>

#include "cli/commands.h"
#include "mds/reader.h"
#include "tokenizer/tokenizer.h"
#include "util/json_fields.h"

namespace minids::cli {

namespace {

struct TokenizeOptions {
    std::string model;
    std::string tokenizer_json;
    std::string input_file;
    bool jsonl = false;
    bool no_bos = false;
    bool bos = false;
    bool show_pieces = false;
};

// One plain sentence for the user, exit code 2.
struct InputError : std::runtime_error {
    using std::runtime_error::runtime_error;
};

std::string read_all(std::istream& in) {
    return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void append_ids_json(const std::vector<int32_t>& ids, std::string& out) {
    out += '[';
    for (size_t i = 0; i < ids.size(); ++i) {
        if (i) out += ", ";
        out += std::to_string(ids[i]);
    }
    out += "]\n";
}

// Each non-empty line is a JSON string; each output line is the JSON array of its ids.
bool write_stdout(const std::string& s) {
    return std::fwrite(s.data(), 1, s.size(), stdout) == s.size();
}

void tokenize_jsonl(const Tokenizer& tok, std::istream& in, bool add_special, std::string& out) {
    std::string line;
    size_t line_no = 0;
    while (std::getline(in, line)) {
        ++line_no;
        if (!line.empty() && line.back() == '\r') line.pop_back();
        if (line.empty()) continue;
        nlohmann::json j;
        try {
            j = nlohmann::json::parse(line);
        } catch (const nlohmann::json::parse_error&) {
            throw InputError("input line " + std::to_string(line_no) +
                             " is not valid JSON (expected a JSON string per line)");
        }
        if (!j.is_string()) {
            throw InputError("input line " + std::to_string(line_no) +
                             ": expected a JSON string, found " + describe_json(j));
        }
        try {
            append_ids_json(tok.encode(j.get_ref<const std::string&>(), add_special), out);
        } catch (const TokenizerError& e) {
            throw InputError("input line " + std::to_string(line_no) + ": " + e.what());
        }
        if (out.size() > (size_t{1} << 20)) {  // keep memory flat on large batches
            if (!write_stdout(out)) throw std::runtime_error("cannot write the output");
            out.clear();
        }
    }
}

int run_tokenize(const TokenizeOptions& opt) {
    const Tokenizer tok(opt.model.empty() ? load_hf_tokenizer(opt.tokenizer_json)
                                          : mds::MdsFile::open(opt.model)->tokenizer());
    std::ifstream file;
    if (!opt.input_file.empty()) {
        file.open(opt.input_file, std::ios::binary);
        if (!file) throw InputError("cannot open input file " + opt.input_file);
    }
    std::istream& in = opt.input_file.empty() ? std::cin : file;
    std::string out;
    if (opt.jsonl) {
        tokenize_jsonl(tok, in, opt.bos, out);
    } else {
        const auto ids = tok.encode(read_all(in), !opt.no_bos);
        if (opt.show_pieces) {
            for (int32_t id : ids) {
                out += std::to_string(id) + "\t" +
                       nlohmann::json(tok.decode(std::span(&id, 1))).dump() + "\n";
            }
        } else {
            append_ids_json(ids, out);
        }
    }
    if (!write_stdout(out) || std::fflush(stdout) != 0) {
        std::fprintf(stderr, "minids tokenize: error: cannot write the output\n");
        return exit_failure;
    }
    return exit_ok;
}

}  // namespace

void add_tokenize_command(CLI::App& app, int& exit_code) {
    auto opt = std::make_shared<TokenizeOptions>();
    auto* cmd = app.add_subcommand(
        "tokenize",
        "Print the token ids of a text (stdin, or -f FILE), as one JSON array, with the tokenizer\n"
        "of a model (-m) or of a Hugging Face tokenizer.json (--tokenizer).\n"
        "The text is used byte for byte: a trailing newline from `echo` is tokenized too.");
    auto* model =
        cmd->add_option("-m,--model", opt->model, "model file (.mds) whose tokenizer to use")
            ->check(CLI::ExistingFile);
    cmd->add_option("--tokenizer", opt->tokenizer_json,
                    "Hugging Face tokenizer.json instead of a model (tokenizer_config.json beside "
                    "it is read when present, for BOS/EOS and add_bos_token)")
        ->check(CLI::ExistingFile)
        ->excludes(model);
    cmd->add_option("-f,--file", opt->input_file, "read the text from FILE instead of stdin")
        ->check(CLI::ExistingFile);
    cmd->add_flag("--jsonl", opt->jsonl,
                  "batch mode: each non-empty input line is a JSON string, each output line the "
                  "JSON array of its ids; no BOS is added (like HF add_special_tokens=False) "
                  "unless --bos is given");
    cmd->add_flag("--no-bos", opt->no_bos,
                  "do not add BOS (plain mode adds it when the tokenizer config asks)");
    cmd->add_flag("--bos", opt->bos, "--jsonl only: add BOS/EOS as the tokenizer config asks");
    cmd->add_flag("--show-pieces", opt->show_pieces,
                  "plain mode: print one `id<TAB>\"text\"` line per token instead of the array");
    cmd->callback([opt, &exit_code] {
        try {
            if (opt->jsonl && (opt->no_bos || opt->show_pieces)) {
                throw InputError("--no-bos and --show-pieces apply to plain mode, not --jsonl");
            }
            if (!opt->jsonl && opt->bos) throw InputError("--bos applies to --jsonl mode only");
            if (opt->model.empty() && opt->tokenizer_json.empty()) {
                throw InputError(
                    "give a model (-m M.mds) or a tokenizer (--tokenizer tokenizer.json)");
            }
            exit_code = run_tokenize(*opt);
        } catch (const InputError& e) {
            std::fprintf(stderr, "minids tokenize: error: %s\n", e.what());
            exit_code = exit_bad_input;
        } catch (const mds::FileError& e) {
            std::fprintf(stderr, "minids tokenize: error: %s\n", e.what());
            exit_code = exit_bad_input;
        } catch (const TokenizerError& e) {
            std::fprintf(stderr, "minids tokenize: error: %s\n", e.what());
            exit_code = exit_bad_input;
        }
    });
}

}  // namespace minids::cli
