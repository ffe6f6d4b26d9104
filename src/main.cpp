// minids: one binary, subcommands (run, chat, convert, bench, info, tokenize, routing).
#include <cstdio>
#include <exception>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "build_commit.h"  // generated: MINIDS_BUILD_COMMIT
#include "cli/commands.h"
#include "util/output_file.h"

int main(int argc, char** argv) {
    // No partial output file survives a signal, a crash or a resource limit.
    minids::install_output_cleanup_handlers();
    CLI::App app{"minids: DeepSeek-V2-family models (MLA + fine-grained MoE) on one GPU or the CPU",
                 "minids"};
    app.set_version_flag("--version", std::string("minids ") + MINIDS_VERSION + " (commit " +
                                          MINIDS_BUILD_COMMIT + ")");
    app.require_subcommand(1);
    int exit_code = minids::cli::exit_ok;
    minids::cli::add_run_command(app, exit_code);
    minids::cli::add_chat_command(app, exit_code);
    minids::cli::add_convert_command(app, exit_code);
    minids::cli::add_bench_command(app, exit_code);
    minids::cli::add_info_command(app, exit_code);
    minids::cli::add_tokenize_command(app, exit_code);
    minids::cli::add_routing_command(app, exit_code);
    // llama.cpp spells some flags with one dash and several letters (-sys, -ngl); CLI11 knows only
    // one-letter short flags and would read "-ngl 99" as "-n gl 99". Those minids implements are
    // renamed to their long form; any other such word is refused rather than split.
    const std::pair<std::string_view, std::string> aliases[] = {{"-sys", "--sys"},
                                                                {"-ngl", "--n-gpu-layers"}};
    std::vector<char*> args(argv, argv + argc);
    for (size_t i = 1; i < args.size(); ++i) {
        const std::string_view a = args[i];
        if (a == "--") break;  // what follows is not flags
        if (!minids::cli::looks_like_split_flag(a)) continue;
        bool renamed = false;
        for (const auto& [from, to] : aliases) {
            if (a == from) {
                args[i] = const_cast<char*>(to.c_str());
                renamed = true;
            }
        }
        if (!renamed) {
            std::fprintf(stderr,
                         "minids: error: unknown flag %s (a flag of several letters takes two "
                         "dashes; to give -%c a value, put a space after it) (see minids --help, "
                         "or minids COMMAND --help)\n",
                         args[i], a[1]);
            return minids::cli::exit_bad_input;
        }
    }
    try {
        app.parse(int(args.size()), args.data());
    } catch (const CLI::ParseError& e) {
        // --help / --version print and exit 0; a wrong flag is one line on stderr and exit 2.
        if (e.get_exit_code() == 0) return app.exit(e);
        std::fprintf(stderr, "minids: error: %s (see minids --help, or minids COMMAND --help)\n",
                     e.what());
        return minids::cli::exit_bad_input;
    } catch (const std::exception& e) {
        std::fprintf(stderr, "minids: error: %s\n", e.what());
        return minids::cli::exit_failure;
    }
    return exit_code;
}
