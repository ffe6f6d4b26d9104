// minids run — placeholder until implemented.
#include <cstdio>

#include "cli/commands.h"

namespace minids::cli {

void add_run_command(CLI::App& app, int& exit_code) {
    auto* cmd = app.add_subcommand("run", "(not implemented yet)");
    cmd->callback([&exit_code] {
        std::fprintf(stderr, "minids run: not implemented yet\n");
        exit_code = exit_failure;
    });
}

}  // namespace minids::cli
