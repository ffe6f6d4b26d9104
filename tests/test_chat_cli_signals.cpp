// Ctrl-C (SIGINT) in run and chat, sent to the real binary: the first one stops the answer being
// generated, one at the prompt exits with 130.
#include <doctest/doctest.h>

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <string>

#include "cli_test_util.h"

using namespace minids::test;

namespace {

// Runs a shell script with $BIN, $MODEL and $DIR set; the script leaves the exit status of the
// minids process in $DIR/status.
CliResult run_script(const std::string& script) {
    TempDir dir;
    const std::string cmd = "BIN=" + shell_quote(minids_binary().string()) +
                            " MODEL=" + shell_quote(cli_converted_fixture().string()) +
                            " MODEL_DEMO=" + shell_quote((models_dir() / "demo.mds").string()) +
                            " DIR=" + shell_quote(dir.path.string()) + " sh -c " +
                            shell_quote(script);
    CliResult r;
    if (std::system(cmd.c_str()) != 0) return r;
    const std::string status = slurp(dir.path / "status");
    r.status = status.empty() ? -1 : std::atoi(status.c_str());
    r.out = slurp(dir.path / "out");
    r.err = slurp(dir.path / "err");
    return r;
}

// Shell: wait (at most ~10 s) until file $1 has text matching $2.
const std::string wait_for =
    R"(wait_for() { for i in $(seq 200); do grep -q "$2" "$1" 2>/dev/null && return 0; sleep 0.05; done; return 1; }; )";

// Runs `"$BIN" ARGS` in the background (stdout to $DIR/out, stderr to $DIR/err), sends it SIGINT
// 0.3 s after it has printed "loaded", and records its exit status.
CliResult run_interrupted(const std::string& args) {
    return run_script(wait_for + "\n        \"$BIN\" " + args + R"( >"$DIR/out" 2>"$DIR/err" &
        pid=$!
        wait_for "$DIR/err" loaded && sleep 0.3
        kill -INT $pid
        wait $pid
        echo $? >"$DIR/status")");
}

}  // namespace

TEST_CASE("signals: Ctrl-C stops minids run's generation, exit 130") {
    // 20000 tokens would take many seconds; the interrupt must end it early.
    CliResult r = run_interrupted(R"(run -m "$MODEL" --ids 0,5,9 -c 30000 -n 20000 --temp 0 -t 1)");
    INFO("stderr: " << r.err);
    CHECK(r.status == 130);
    CHECK(r.err.find("interrupted") != std::string::npos);
}

TEST_CASE("signals: Ctrl-C with the expert cache fetching on the device: exit 130, counters") {
    // The demo model with 24 of its 160 experts in slots: the step fetches misses itself
    // (on the CPU the same bookkeeping as on a GPU); the interrupt lands mid-generation.
    CliResult r = run_interrupted(
        R"(run -m "$MODEL_DEMO" -p "Return the number of" -n 20000 -c 30000 --ignore-eos )"
        R"(--temp 0 -t 1 --expert-cache-slots 24)");
    INFO("stderr: " << r.err);
    CHECK(r.status == 130);
    CHECK(r.err.find("interrupted") != std::string::npos);
    CHECK(r.err.find("misses fetched into slots by the step") != std::string::npos);
    CHECK(r.err.find("expert cache: 24 slots, hit rate") != std::string::npos);
}

TEST_CASE("signals: chat stops the answer at the first Ctrl-C and goes on") {
    // stdin is a fifo the script holds open, so chat waits at its prompt for as long as needed.
    CliResult answer = run_script(wait_for + R"(
        mkfifo "$DIR/in"
        "$BIN" chat -m "$MODEL" -c 30000 -n 20000 --temp 0 -t 1 <"$DIR/in" >"$DIR/out" 2>"$DIR/err" &
        pid=$!
        exec 3>"$DIR/in"
        printf 'Tell me a long story\n' >&3
        wait_for "$DIR/err" loaded && sleep 0.3
        kill -INT $pid
        wait_for "$DIR/err" interrupted
        exec 3>&-
        wait $pid
        echo $? >"$DIR/status")");
    INFO("stderr: " << answer.err);
    CHECK(answer.status == 0);  // the answer stopped, the chat went on until end of input
    CHECK(answer.err.find("interrupted") != std::string::npos);
}

TEST_CASE("signals: Ctrl-C at the chat prompt exits with status 130 (not killed by the signal)") {
    // fork/exec rather than a shell, so that "exited with 130" and "killed by SIGINT" (which a
    // shell also reports as 130) can be told apart.
    TempDir dir;
    const std::string bin = minids_binary().string(), model = cli_converted_fixture().string();
    const auto err_path = dir.path / "err";
    int in_pipe[2];
    REQUIRE(pipe(in_pipe) == 0);
    const pid_t pid = fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
        dup2(in_pipe[0], STDIN_FILENO);
        close(in_pipe[1]);
        const int out = open("/dev/null", O_WRONLY);
        const int err = open(err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
        dup2(out, STDOUT_FILENO);
        dup2(err, STDERR_FILENO);
        execl(bin.c_str(), bin.c_str(), "chat", "-m", model.c_str(), "-t", "1",
              static_cast<char*>(nullptr));
        _exit(127);
    }
    close(in_pipe[0]);
    // Wait until the model is loaded and chat is reading its input.
    for (int i = 0; i < 200 && slurp(err_path).find("loaded") == std::string::npos; ++i)
        usleep(50000);
    usleep(200000);
    kill(pid, SIGINT);
    int status = 0;
    pid_t done = 0;
    for (int i = 0; i < 200 && done == 0; ++i) {
        done = waitpid(pid, &status, WNOHANG);
        if (done == 0) usleep(50000);
    }
    close(in_pipe[1]);  // if it is still running, end of input ends it (and the checks fail)
    if (done == 0) waitpid(pid, &status, 0);
    INFO("stderr: " << slurp(err_path));
    CHECK(WIFEXITED(status));
    CHECK(WEXITSTATUS(status) == 130);
}
