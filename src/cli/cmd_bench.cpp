// minids bench — placeholder until implemented.
#include <cstdio>

#include "cli/commands.h"

namespace minids::cli {

void add_bench_command(CLI::App& app, int& exit_code) {
    auto* cmd = app.add_subcommand("bench", "(not implemented yet)");
    cmd->callback([&exit_code] {
        std::fprintf(stderr, "minids bench: not implemented yet\n");
        exit_code = exit_failure;
    });
}

}  // namespace minids::cli
