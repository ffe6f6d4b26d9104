// minids: one binary, subcommands (run, chat, convert, bench, info, tokenize, routing).
#include <cstdio>
#include <exception>
#include <string>
#include <string_view>
#include <vector>

#include "cli/commands.h"

int main(int argc, char** argv) {
    CLI::App app{"minids: DeepSeek-V2-family models (MLA + fine-grained MoE) on one GPU or the CPU",
                 "minids"};
    app.set_version_flag("--version", std::string("minids ") + MINIDS_VERSION);
    app.require_subcommand(1);
    int exit_code = minids::cli::exit_ok;
    minids::cli::add_run_command(app, exit_code);
    minids::cli::add_chat_command(app, exit_code);
    minids::cli::add_convert_command(app, exit_code);
    minids::cli::add_bench_command(app, exit_code);
    minids::cli::add_info_command(app, exit_code);
    minids::cli::add_tokenize_command(app, exit_code);
    minids::cli::add_routing_command(app, exit_code);
    // llama.cpp spells chat's system prompt "-sys"; CLI11 only knows one-letter short flags.
    std::string sys_flag = "--sys";
    std::vector<char*> args(argv, argv + argc);
    for (char*& a : args) {
        if (std::string_view(a) == "-sys") a = sys_flag.data();
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
