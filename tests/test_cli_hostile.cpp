// The binary under hostile input and hostile conditions (issue 12). For every case: bounded time
// (each run has a timeout; a hang is a kill, status -1), an exit status in 1..127 (never a
// signal), one line on stderr that names what was wrong, and no partial file left anywhere.
// One test case per class; the reproductions from the issue plus cases of the same class.
#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>

#include <nlohmann/json.hpp>

#include "cli_test_util.h"
#include "mds_test_file.h"
#include "tokenizer/tokenizer_data.h"

using namespace minids::test;
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

#if defined(__SANITIZE_ADDRESS__)
constexpr bool kSanitized = true;  // ASan reserves terabytes of address space: no ulimit -v
#else
constexpr bool kSanitized = false;
#endif

// Every file left in `dir` (a failed command must leave none of its own).
std::vector<std::string> files_in(const fs::path& dir) {
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename());
    std::sort(names.begin(), names.end());
    return names;
}

json read_json(const fs::path& p) { return json::parse(std::ifstream(p)); }
void write_json(const fs::path& p, const json& j) { std::ofstream(p) << j.dump(); }

// A copy of the tiny checkpoint whose files a test may edit.
fs::path checkpoint_copy(const fs::path& dir) {
    const fs::path ck = dir / "ck";
    fs::create_directories(ck);
    for (const auto& e : fs::directory_iterator(data_dir() / "tiny-v2-lite"))
        fs::copy_file(e.path(), ck / e.path().filename());
    return ck;
}

std::string demo_model() { return (models_dir() / "demo.mds").string(); }

// A model file whose own chat template is `tmpl` (everything else valid: the byte-level
// tokenizer builds, unlike the test file's own, whose merges are only data for the parser).
fs::path model_with_template(const fs::path& dir, const std::string& tmpl) {
    MdsTestFile f = make_test_mds({.seed = 9, .vocab_size = 260});
    minids::TokenizerData tok = minids::synthetic_byte_tokenizer(260);
    tok.chat_template = tmpl;
    f.manifest["tokenizer"] = minids::tokenizer_data_to_json(tok);
    const fs::path p = dir / "templated.mds";
    f.write(p);
    return p;
}

std::string repeat(const std::string& s, int n) {
    std::string out;
    for (int i = 0; i < n; ++i) out += s;
    return out;
}

}  // namespace

TEST_CASE("hostile: counts and ids read from files are range-checked before use") {
    TempDir dir;
    const fs::path ck = checkpoint_copy(dir.path);
    const json tokenizer = read_json(ck / "tokenizer.json");
    // An added token id at INT32_MAX overflowed `id + 1`; ids near 1e8 allocated gigabytes.
    for (int64_t id : {int64_t(2147483647), int64_t(100000000), int64_t(-1)}) {
        json t = tokenizer;
        t["added_tokens"].push_back({{"id", id},
                                     {"content", "<evil>"},
                                     {"special", true},
                                     {"single_word", false},
                                     {"lstrip", false},
                                     {"rstrip", false},
                                     {"normalized", false}});
        write_json(ck / "tokenizer.json", t);
        check_refused(run_minids({"tokenize", "--tokenizer", (ck / "tokenizer.json").string()},
                                 "hi", {.timeout_s = 30}),
                      "token id");
        check_refused(run_minids({"convert", ck.string(), "-o", (dir.path / "o.mds").string()}, "",
                                 {.timeout_s = 60}),
                      "token id");
        CHECK_FALSE(fs::exists(dir.path / "o.mds"));
        CHECK_FALSE(fs::exists(dir.path / "o.mds.tmp"));
    }
    // Nesting: a merge nested 100,000 deep crashed an error message's dump().
    json t = tokenizer;
    t["model"]["merges"].push_back(0);
    std::string text = t.dump();
    std::string deep = ",";  // built by appending: GCC 12 warns falsely on "," + std::string
    deep += repeat("[", 100000);
    deep += repeat("]", 100000);
    deep += "]";
    text.replace(text.rfind(",0]"), 3, deep);
    std::ofstream(ck / "tokenizer.json") << text;
    check_refused(run_minids({"tokenize", "--tokenizer", (ck / "tokenizer.json").string()}, "hi",
                             {.timeout_s = 30}),
                  "nesting");
    write_json(ck / "tokenizer.json", tokenizer);
    std::ofstream(ck / "config.json")
        << "{\"a\":" + repeat("[", 100000) + repeat("]", 100000) + "}";
    check_refused(run_minids({"convert", ck.string(), "-o", (dir.path / "o.mds").string()}, "",
                             {.timeout_s = 60}),
                  "nesting");
    CHECK(files_in(dir.path) == std::vector<std::string>{"ck"});
}

TEST_CASE("hostile: chat templates are bounded in depth and work, and checked at load") {
    TempDir dir;
    const std::vector<std::string> templates = {
        "{{ " + repeat("not ", 15000) + "true }}",
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        "{{ " + repeat("-", 20000) + "1 }}",
        "{% set ns = namespace(x='ab') %}{% for i in range(64) %}{% set ns.x = ns.x ~ ns.x %}"
        "{% endfor %}{{ ns.x }}",
    };
    for (const std::string& tmpl : templates) {
        CAPTURE(tmpl.substr(0, 60));
        check_refused(
            run_minids({"run", "-m", demo_model(), "-p", "hi", "-n", "2", "--chat-template", tmpl},
                       "", {.timeout_s = 60}),
            "chat template");
    }
    // The same templates inside a model file: info --verify, run and chat all refuse the file.
    for (const std::string& tmpl :
         {"{{ " + repeat("not ", 300) + "true }}",
          std::string("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
                      "{% endfor %}")}) {
        const std::string model = model_with_template(dir.path, tmpl).string();
        CliResult verify = run_minids({"info", model, "--verify"}, "", {.timeout_s = 60});
        INFO("info stderr: " << verify.err);
        CHECK(verify.status == 2);
        CHECK(verify.err.find("chat_template") != std::string::npos);
        check_refused(
            run_minids({"run", "-m", model, "-p", "hi", "-n", "2"}, "", {.timeout_s = 60}),
            "chat_template");
        check_refused(run_minids({"chat", "-m", model}, "hi\n", {.timeout_s = 60}),
                      "chat_template");
    }
    // A tokenizer_config.json carrying one is refused by convert, before anything is written.
    const fs::path ck = checkpoint_copy(dir.path);
    json cfg = read_json(ck / "tokenizer_config.json");
    cfg["chat_template"] = templates[1];
    write_json(ck / "tokenizer_config.json", cfg);
    check_refused(run_minids({"convert", ck.string(), "-o", (dir.path / "o.mds").string()}, "",
                             {.timeout_s = 60}),
                  "work limit");
    CHECK_FALSE(fs::exists(dir.path / "o.mds"));
    CHECK_FALSE(fs::exists(dir.path / "o.mds.tmp"));
}

TEST_CASE("hostile: threads that cannot be started end the command cleanly" *
          doctest::skip(kSanitized)) {
    TempDir dir;
    // 200 threads' stacks do not fit in 1 GB of address space: this hung in the thread pool.
    // (--cpu: the CPU backend's thread pool is what is tested, also where a GPU is present.)
    CliResult run =
        run_minids({"run", "-m", demo_model(), "--cpu", "-t", "200", "-p", "hi", "-n", "2"}, "",
                   {.timeout_s = 60, .vmem_kib = 1000000});
    check_refused(run, "threads");
    CliResult chat = run_minids({"chat", "-m", demo_model(), "--cpu", "-t", "200"}, "hi\n",
                                {.timeout_s = 60, .vmem_kib = 1000000});
    check_refused(chat, "threads");
    // The converter's workers: "terminate called without an active exception", exit 134 and a
    // leftover t.mds.tmp once.
    CliResult convert =
        run_minids({"convert", "-q", "--synthetic", "tiny", "--threads", "50", "-o", "t.mds"}, "",
                   {.timeout_s = 60, .vmem_kib = 1000000, .cwd = dir.path});
    INFO("stderr: " << convert.err);
    CHECK(convert.status == 1);
    CHECK(convert.err.find("threads") != std::string::npos);
    CHECK(files_in(dir.path).empty());
    // info --verify asked for more threads than can start still verifies (the demo model is
    // small enough for one thread; MdsFile::verify also carries on with the threads it gets).
    CliResult info = run_minids({"info", demo_model(), "--verify", "--threads", "200"}, "",
                                {.timeout_s = 60, .vmem_kib = 1000000});
    INFO("info stderr: " << info.err);
    CHECK(info.status == 0);
}

TEST_CASE("hostile: no partial output survives a failure, a signal or a limit") {
    TempDir dir;
    // ulimit -f: the converter's output outgrows the limit (SIGXFSZ killed the process once).
    CliResult small = run_minids({"convert", "-q", "--synthetic", "tiny", "-o", "t.mds"}, "",
                                 {.timeout_s = 60, .file_blocks = 100, .cwd = dir.path});
    INFO("stderr: " << small.err);
    CHECK(small.status == 1);
    CHECK(count_lines_containing(small.err, "File too large") == 1);
    CHECK(files_in(dir.path).empty());
    // Signals while a large synthetic model is being written: SIGTERM, SIGHUP, a crash.
    for (const auto& [signal, status, says] :
         {std::tuple{"TERM", 130, "interrupted"}, std::tuple{"HUP", 129, "SIGHUP"},
          std::tuple{"INT", 130, "interrupted"}, std::tuple{"SEGV", 70, "internal error"}}) {
        CAPTURE(signal);
        CliResult r =
            run_minids({"convert", "--synthetic", "v2-lite", "-o", "t.mds"}, "",
                       {.timeout_s = 60, .cwd = dir.path, .signal = signal, .signal_after_s = 1.5});
        INFO("stderr: " << r.err);
        CHECK(r.status == status);
        CHECK(r.err.find(says) != std::string::npos);
        CHECK(files_in(dir.path).empty());
    }
}

TEST_CASE("hostile: outputs are checked before the work and written whole") {
    TempDir dir;
    const std::string model = demo_model();
    const auto args = [&](std::vector<std::string> extra) {
        // --cpu: the file writes are tested; a GPU's driver would also write under ulimit -f.
        std::vector<std::string> a = {"run",   "-m", model, "--cpu",  "-p",
                                      "hello", "-n", "4",   "--temp", "0"};
        a.insert(a.end(), extra.begin(), extra.end());
        return a;
    };
    // Refused before the model loads (the "loading" line never comes).
    for (const auto& [flag, path, says] :
         {std::tuple{"--dump-logits", (dir.path / "no" / "x.npy").string(), "directory"},
          std::tuple{"--dump-logits", dir.path.string(), "found a directory"}}) {
        CliResult r = run_minids(args({flag, path}), "", {.timeout_s = 60});
        check_refused(r, says);
        CHECK(r.err.find("loading") == std::string::npos);
    }
    std::ofstream(dir.path / "a-file") << "x";
    check_refused(
        run_minids(args({"--dump-tensors", (dir.path / "a-file").string()}), "", {.timeout_s = 60}),
        "--dump-tensors");
    // A write that fails half-way (ulimit -f stands in for a full disk) leaves no file.
    fs::remove(dir.path / "a-file");
    CliResult full = run_minids(args({"--dump-logits", "l.npy"}), "",
                                {.timeout_s = 60, .file_blocks = 8, .cwd = dir.path});
    INFO("stderr: " << full.err);
    CHECK(full.status == 1);
    CHECK(count_lines_containing(full.err, "error") == 1);
    CHECK(full.err.find("l.npy: cannot write: File too large") != std::string::npos);
    CHECK(full.err.find("internal error") == std::string::npos);
    CHECK(files_in(dir.path).empty());
    // And written whole when it can be.
    CHECK(run_minids(args({"--dump-logits", "l.npy"}), "", {.timeout_s = 60, .cwd = dir.path})
              .status == 0);
    CHECK(files_in(dir.path) == std::vector<std::string>{"l.npy"});
}

TEST_CASE("hostile: user mistakes are user errors, never internal errors") {
    TempDir dir;
    const std::string model = demo_model();
    const std::string d = dir.path.string();
    const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
        {{"run", "-m", d, "-p", "hi"}, "not a file"},
        {{"run", "-m", model, "-f", d}, "found a directory"},
        {{"run", "-m", model, "-f", d + "/missing.txt"}, "No such file"},
        {{"info", d}, "directory"},
        {{"info", d + "/missing.mds"}, "No such file"},
        {{"tokenize", "-m", model, "-f", d}, "directory"},
        {{"tokenize", "--tokenizer", d}, "directory"},
        {{"convert", model, "-o", d + "/x.mds"}, "checkpoint directory"},
        {{"convert", "--synthetic", "tiny", "-o", d}, "found a directory"},
        {{"convert", "--synthetic", "tiny", "-o", d + "/no/x.mds"}, "directory"},
        {{"run", "-m", model, "-p", "hi", "--temp", "nan"}, "--temp"},
        {{"run", "-m", model, "-p", "hi", "--top-p", "inf"}, "--top-p"},
        {{"run", "-m", model, "-p", "hi", "--min-p", "-nan"}, "--min-p"},
        {{"chat", "-m", model, "--repeat-penalty", "inf"}, "--repeat-penalty"},
        {{"run", "-m", model, "-p", "hi", "--temp", "1e999"}, "--temp"},
    };
    for (const auto& [args, says] : cases) {
        CAPTURE(args);
        CliResult r = run_minids(args, "", {.timeout_s = 60});
        INFO("stderr: " << r.err);
        CHECK(r.status == 2);
        CHECK(count_lines_containing(r.err, "error") == 1);
        CHECK(r.err.find(says) != std::string::npos);
        CHECK(r.err.find("internal error") == std::string::npos);
    }
    CHECK(files_in(dir.path).empty());
}

TEST_CASE("hostile: in chat one bad line is refused and the conversation goes on") {
    const std::vector<std::string> args = {"chat", "-m", demo_model(), "-c", "96",
                                           "-n",   "4",  "--temp",     "0"};
    const std::string script =
        "Hello there\n\xff\xfe not UTF-8\n" + repeat("word ", 300) + "\nStill here?\n/help\n";
    CliResult r = run_minids(args, script, {.timeout_s = 120});
    INFO("stderr: " << r.err);
    REQUIRE(r.status == 0);
    CHECK(count_lines_containing(r.err, "this message is not sent") == 2);
    CHECK(count_lines_containing(r.err, "not valid UTF-8") == 1);
    CHECK(count_lines_containing(r.err, "more than the context") == 1);
    CHECK(count_lines_containing(r.err, "answer ") == 2);  // both good lines were answered
    CHECK(r.err.find("/clear forgets the conversation") != std::string::npos);  // /help
}

TEST_CASE("llama.cpp habits: -s -1, -ngl, no split flags, -e, -r, --ignore-eos, -n, context") {
    const std::string model = demo_model();
    auto run = [&](std::vector<std::string> extra, const std::string& in = {}) {
        std::vector<std::string> a = {"run", "-m", model, "-t", "2"};
        a.insert(a.end(), extra.begin(), extra.end());
        return run_minids(a, in, {.timeout_s = 120});
    };
    CHECK(run({"-p", "hi", "-n", "2", "-s", "-1"}).status == 0);
    CHECK(run({"-p", "hi", "-n", "2", "-ngl", "99"}).status == 0);
    CHECK(run({"-p", "hi", "-n", "2", "--n-gpu-layers", "0"}).status == 0);
    // A multi-letter flag after one dash is refused, not read as -f a / -n 64.
    check_refused(run({"-p", "hi", "-fa"}), "unknown flag -fa");
    check_refused(run({"-p", "hi", "-n64"}), "unknown flag -n64");
    check_refused(run({"-p", "hi", "-ngl", "-5"}), "--n-gpu-layers");

    // -e: the prompt "a\nb" with the escape processed is the text with a real newline.
    auto prompt_tokens = [](const CliResult& r) {
        std::smatch m;
        const std::regex re(R"(prompt (\d+) tokens)");
        return std::regex_search(r.err, m, re) ? std::stoll(m[1]) : -1;
    };
    const CliResult tok = run_minids({"tokenize", "-m", model}, "a\nb\tc");
    const long long expected = long(std::count(tok.out.begin(), tok.out.end(), ',')) + 1;
    CHECK(prompt_tokens(run({"-p", "a\\nb\\tc", "-e", "-n", "0"})) == expected);
    CHECK(prompt_tokens(run({"-p", "a\\nb\\tc", "-n", "0"})) != expected);

    // -r: stops before the first occurrence of the text in what greedy decoding writes.
    const CliResult full = run({"-p", "Return the", "-n", "40", "--temp", "0"});
    REQUIRE(full.status == 0);
    REQUIRE(full.out.size() > 20);
    const std::string stop = full.out.substr(12, 5);
    const CliResult stopped = run({"-p", "Return the", "-n", "40", "--temp", "0", "-r", stop});
    CHECK(stopped.status == 0);
    CHECK(stopped.out == full.out.substr(0, full.out.find(stop)) + "\n");
    CHECK(stopped.err.find("stopped: stop string") != std::string::npos);

    // -n beyond the room left: generates until the context is full.
    const CliResult long_n = run({"-p", "Return the", "-n", "1000", "-c", "32", "--ignore-eos"});
    CHECK(long_n.status == 0);
    CHECK(long_n.err.find("stopped: context full") != std::string::npos);

    // --ignore-eos: a sampled run that ends at EOS goes on without it.
    const json info = json::parse(run_minids({"info", model, "--json"}).out);
    const int eos = info["tokenizer"]["eos_id"].get<int>();
    bool found_eos_run = false;
    for (int seed = 1; seed <= 40 && !found_eos_run; ++seed) {
        const std::vector<std::string> a = {
            "-p", "Hello", "-n", "120", "--temp", "1.5", "--print-ids", "-s", std::to_string(seed)};
        const CliResult plain = run(a);
        if (plain.err.find("stopped: end of sequence") == std::string::npos) continue;
        found_eos_run = true;
        std::vector<std::string> b = a;
        b.push_back("--ignore-eos");
        const CliResult ignoring = run(b);
        CHECK(ignoring.err.find("stopped: token limit") != std::string::npos);
        REQUIRE(lines_of(ignoring.out).size() == 1);
        std::istringstream ids(ignoring.out);
        int n_ids = 0;
        for (int id; ids >> id; ++n_ids) CHECK(id != eos);
        CHECK(n_ids == 120);
    }
    CHECK(found_eos_run);

    // chat: a full context drops the oldest turns (the system prompt stays) and goes on.
    const CliResult chat =
        run_minids({"chat", "-m", model, "-c", "64", "-n", "6", "--temp", "0", "-sys", "Be brief."},
                   "Tell me about arrays\nAnd about numbers\nAnd about "
                   "strings too\nAnd lists\n",
                   {.timeout_s = 120});
    INFO("chat stderr: " << chat.err);
    CHECK(chat.status == 0);
    CHECK(count_lines_containing(chat.err, "answer ") == 4);
    CHECK(chat.err.find("dropped the oldest") != std::string::npos);
    CHECK(chat.err.find("the system prompt is kept") != std::string::npos);
}
