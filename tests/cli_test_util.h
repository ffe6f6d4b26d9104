// Running the built minids binary from the tests: arguments, optional stdin text, captured
// stdout/stderr and the exit status.
#pragma once

#include <sys/wait.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <doctest/doctest.h>

#include "test_util.h"

namespace minids::test {

struct CliResult {
    int status = -1;  // exit code, or -1 when the process did not exit normally
    std::string out, err;
};

inline std::string shell_quote(const std::string& s) {
    std::string q = "'";
    for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
    return q + "'";
}

inline std::string slurp(const std::filesystem::path& p) {
    std::ifstream f(p, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(f), {});
}

// Limits for a run of the binary under hostile conditions: a wall-clock timeout (a hang shows as
// a kill, status -1), and optionally ulimit -v (KiB of address space) and -f (512-byte blocks), a
// working directory, and a signal sent after `signal_after_s` seconds (the status is then the
// exit status the binary chose, e.g. 130 or 143).
struct RunLimits {
    int timeout_s = 120;
    long vmem_kib = 0;
    long file_blocks = 0;
    std::filesystem::path cwd{};
    const char* signal = nullptr;  // "TERM", "HUP", "SEGV", ...
    double signal_after_s = 0;
};

inline CliResult run_minids(const std::vector<std::string>& args, const std::string& stdin_text,
                            const RunLimits& limits);

inline CliResult run_minids(const std::vector<std::string>& args,
                            const std::string& stdin_text = {}) {
    TempDir io;
    std::ofstream(io.path / "in", std::ios::binary) << stdin_text;
    std::string cmd = shell_quote(minids_binary().string());
    // Appended piece by piece: GCC 12 warns falsely (-Wrestrict) on "literal" + std::string.
    for (const auto& a : args) {
        cmd.push_back(' ');
        cmd.append(shell_quote(a));
    }
    for (const auto& [redirect, file] :
         {std::pair{" <", "in"}, std::pair{" >", "out"}, std::pair{" 2>", "err"}}) {
        cmd.append(redirect);
        cmd.append(shell_quote((io.path / file).string()));
    }
    const int raw = std::system(cmd.c_str());
    CliResult r;
    r.status = (raw != -1 && WIFEXITED(raw)) ? WEXITSTATUS(raw) : -1;
    r.out = slurp(io.path / "out");
    r.err = slurp(io.path / "err");
    return r;
}

inline CliResult run_minids(const std::vector<std::string>& args, const std::string& stdin_text,
                            const RunLimits& limits) {
    TempDir io;
    std::ofstream(io.path / "in", std::ios::binary) << stdin_text;
    std::string command = shell_quote(minids_binary().string());
    for (const auto& a : args) {
        command.push_back(' ');
        command.append(shell_quote(a));
    }
    std::string script;
    if (!limits.cwd.empty()) script += "cd " + shell_quote(limits.cwd.string()) + " && ";
    if (limits.vmem_kib) script += "ulimit -v " + std::to_string(limits.vmem_kib) + " && ";
    if (limits.file_blocks) script += "ulimit -f " + std::to_string(limits.file_blocks) + " && ";
    // KILL after the timeout: a hang must not pass as a clean exit.
    const std::string timed = "timeout -s KILL " + std::to_string(limits.timeout_s) + " " + command;
    if (limits.signal) {
        script += timed + " & pid=$!; sleep " + std::to_string(limits.signal_after_s) +
                  "; pkill -" + limits.signal + " -P $pid; wait $pid";
    } else {
        script += "exec " + timed;
    }
    std::string cmd = "sh -c " + shell_quote(script);
    for (const auto& [redirect, file] :
         {std::pair{" <", "in"}, std::pair{" >", "out"}, std::pair{" 2>", "err"}}) {
        cmd.append(redirect);
        cmd.append(shell_quote((io.path / file).string()));
    }
    const int raw = std::system(cmd.c_str());
    CliResult r;
    r.status = (raw != -1 && WIFEXITED(raw)) ? WEXITSTATUS(raw) : -1;
    // timeout says 124 (timed out) or 128 + the signal (the child was killed): not clean exits.
    if (!limits.signal && (r.status == 124 || r.status > 128)) r.status = -1;
    r.out = slurp(io.path / "out");
    r.err = slurp(io.path / "err");
    return r;
}

// Token ids as text: "0,5,9" with sep ",", as --ids takes them; with " ", as --print-ids prints.
inline std::string join_ids(const std::vector<int32_t>& ids, const char* sep) {
    std::string s;
    for (size_t i = 0; i < ids.size(); ++i) {
        if (i) s += sep;  // appended piece by piece: GCC 12 warns falsely on "lit" + std::string
        s += std::to_string(ids[i]);
    }
    return s;
}

inline std::vector<std::string> lines_of(const std::string& s) {
    std::vector<std::string> lines;
    size_t start = 0;
    while (start < s.size()) {
        size_t nl = s.find('\n', start);
        if (nl == std::string::npos) nl = s.size();
        lines.push_back(s.substr(start, nl - start));
        start = nl + 1;
    }
    return lines;
}

inline size_t count_lines_containing(const std::string& s, const std::string& needle) {
    size_t n = 0;
    for (const auto& l : lines_of(s)) n += l.find(needle) != std::string::npos;
    return n;
}

// A refusal: status in 1..127 (2 for the user's mistakes), one error line naming `needle`, no
// "internal error", nothing on stdout.
inline void check_refused(const CliResult& r, const std::string& needle, int status = 2) {
    INFO("stderr: " << r.err);
    CHECK(r.status == status);
    CHECK(count_lines_containing(r.err, "error") == 1);
    CHECK(r.err.find(needle) != std::string::npos);
    CHECK(r.err.find("internal error") == std::string::npos);
    CHECK(r.out.empty());
}

// tiny-v2-lite converted with the binary (BF16 experts), once per test run.
inline std::filesystem::path cli_converted_fixture() {
    static TempDir dir;  // test-run cache
    const auto out = dir.path / "tiny-v2-lite.mds";
    if (!std::filesystem::exists(out)) {
        CliResult r = run_minids({"convert", (data_dir() / "tiny-v2-lite").string(), "-o",
                                  out.string(), "--expert-dtype", "bf16"});
        if (r.status != 0) throw std::runtime_error("minids convert failed: " + r.err);
    }
    return out;
}

}  // namespace minids::test
