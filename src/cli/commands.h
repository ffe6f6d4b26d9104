// Subcommands of the minids binary. Each lives in its own file and registers itself on the
// CLI11 app; its callback stores the process exit code in `exit_code`.
//
// Exit codes: 0 success; 1 runtime failure; 2 bad input (malformed file, bad flag, context
// overflow); 130 interrupted by Ctrl-C.
#pragma once

#include <string_view>

#include <CLI/CLI.hpp>

namespace minids::cli {

inline constexpr int exit_ok = 0;
inline constexpr int exit_failure = 1;
inline constexpr int exit_bad_input = 2;
inline constexpr int exit_interrupted = 130;

// "-ngl", "-sys", "-xyz": one dash and two or more letters, which CLI11 would split into the
// one-letter flag -x and the value "yz". Negative numbers and -inf / -nan are values, not flags.
bool looks_like_split_flag(std::string_view arg);

void add_run_command(CLI::App& app, int& exit_code);       // cmd_run.cpp
void add_chat_command(CLI::App& app, int& exit_code);      // cmd_chat.cpp
void add_convert_command(CLI::App& app, int& exit_code);   // cmd_convert.cpp
void add_info_command(CLI::App& app, int& exit_code);      // cmd_info.cpp
void add_tokenize_command(CLI::App& app, int& exit_code);  // cmd_tokenize.cpp
void add_bench_command(CLI::App& app, int& exit_code);     // cmd_bench.cpp
void add_routing_command(CLI::App& app, int& exit_code);   // cmd_routing.cpp

}  // namespace minids::cli
