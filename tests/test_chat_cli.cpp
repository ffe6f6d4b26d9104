// minids chat with scripted stdin (not a terminal): turns, KV reuse across turns, /clear, /exit,
// multi-line input and end of input. The terminal path is checked by scripts/check_chat_tty.sh.
#include <doctest/doctest.h>

#include <regex>

#include "cli_test_util.h"

using namespace minids::test;

namespace {

struct TurnStats {
    long long new_tokens = 0, reused = 0, answer = 0;
};

// The "[prompt N new tokens (R reused) ..., answer A tokens ...]" line printed after each answer.
std::vector<TurnStats> turn_stats(const std::string& err) {
    std::vector<TurnStats> turns;
    std::regex re(R"(\[prompt (\d+) new tokens \((\d+) reused\).*answer (\d+) tokens)");
    for (const auto& line : lines_of(err)) {
        std::smatch m;
        if (std::regex_search(line, m, re))
            turns.push_back({std::stoll(m[1]), std::stoll(m[2]), std::stoll(m[3])});
    }
    return turns;
}

std::vector<std::string> chat_args() {
    return {"chat", "-m", cli_converted_fixture().string(), "--temp", "0", "-n", "6", "-t", "2"};
}

}  // namespace

TEST_CASE("chat cli: two turns reuse the cache, /clear starts over, /exit quits") {
    const std::string script =
        "Hello there\nTell me more \\\nabout it\n/clear\nAgain\n/exit\nnot read\n";
    CliResult r = run_minids(chat_args(), script);
    INFO("stderr: " << r.err);
    INFO("stdout: " << r.out);
    REQUIRE(r.status == 0);
    std::vector<TurnStats> t = turn_stats(r.err);
    REQUIRE(t.size() == 3);  // "not read" after /exit is not answered
    CHECK(t[0].reused == 0);
    // Turn 2 does not prefill the first prompt again. (The first answer is reused too when its
    // re-rendered text tokenizes as generated; a random tiny model does not promise that.)
    CHECK(t[1].reused >= t[0].new_tokens);
    // After /clear the conversation restarts: only the template's opening can be shared.
    CHECK(t[2].reused < t[1].reused);
    for (const auto& turn : t) CHECK(turn.answer <= 6);
    CHECK(lines_of(r.out).size() >= 3);

    CliResult again = run_minids(chat_args(), script);
    CHECK(again.out == r.out);  // greedy: the same conversation gives the same answers
}

TEST_CASE("chat cli: end of input exits 0, a system prompt is accepted") {
    const std::vector<std::string> args = chat_args();
    CliResult plain = run_minids(args, "Hi\n");
    REQUIRE(turn_stats(plain.err).size() == 1);
    for (const char* flag : {"-sys", "--sys", "--system-prompt"}) {
        std::vector<std::string> with_sys = args;
        with_sys.insert(with_sys.end(), {flag, "You are terse."});
        CliResult r = run_minids(with_sys, "Hi\n");
        INFO(flag << " stderr: " << r.err);
        CHECK(r.status == 0);
        REQUIRE(turn_stats(r.err).size() == 1);
        CHECK(turn_stats(r.err)[0].new_tokens >
              turn_stats(plain.err)[0].new_tokens + 3);  // the system text is in
    }
    CliResult empty = run_minids(chat_args(), "");
    CHECK(empty.status == 0);
    CHECK(turn_stats(empty.err).empty());
}

TEST_CASE("chat cli: a missing model and a bad template name exit 2") {
    CliResult r = run_minids({"chat", "-m", "/nonexistent/model.mds"}, "Hi\n");
    CHECK(r.status == 2);
    CliResult t = run_minids(
        {"chat", "-m", cli_converted_fixture().string(), "--chat-template", "nope"}, "Hi\n");
    INFO("stderr: " << t.err);
    CHECK(t.status == 2);
    CHECK(t.err.find("nope") != std::string::npos);
}
