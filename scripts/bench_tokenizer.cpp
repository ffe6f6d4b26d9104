// Tokenizer encoding speed: MB/s on one core, median of repeats after a warm-up.
//
//   build/bench_tokenizer [--tokenizer tokenizer.json] [--mb N] [--repeats R] [TEXT_FILE...]
//
// The corpus is the given text files (default: docs/*.md and the texts of every
// tests/data/**/tokenizer.reference.json, from the current directory), concatenated and repeated
// up to N MB. Each repeat builds a fresh Tokenizer, so the piece cache starts empty and the first
// copy of the text pays for BPE; the "unique" line encodes the text once with no repetition.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "tokenizer/byte_level.h"
#include "tokenizer/tokenizer.h"

namespace fs = std::filesystem;

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
    return std::chrono::duration<double>(Clock::now() - t0).count();
}

double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

std::string read_file(const fs::path& p) {
    std::ifstream f(p, std::ios::binary);
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
}

std::vector<fs::path> default_sources() {
    std::vector<fs::path> out;
    if (fs::is_directory("docs")) {
        for (const auto& e : fs::directory_iterator("docs")) {
            if (e.path().extension() == ".md") out.push_back(e.path());
        }
    }
    if (fs::is_directory("tests/data")) {
        for (const auto& e : fs::recursive_directory_iterator("tests/data")) {
            if (e.path().filename() == "tokenizer.reference.json") out.push_back(e.path());
        }
    }
    std::sort(out.begin(), out.end());
    return out;
}

std::string text_of(const fs::path& p) {
    const std::string raw = read_file(p);
    if (p.filename() != "tokenizer.reference.json") return raw;
    std::string joined;
    for (const auto& r : nlohmann::json::parse(raw)) joined += r["text"].get<std::string>() + "\n";
    return joined;
}

}  // namespace

int main(int argc, char** argv) {
    CLI::App app{"Tokenizer encoding speed (MB/s, one core)", "bench_tokenizer"};
    std::string tokenizer_path = "tests/data/tokenizers/deepseek-v3/tokenizer.json";
    double corpus_mb = 4.0;
    int repeats = 5;
    std::vector<std::string> files;
    app.add_option("--tokenizer", tokenizer_path, "HF tokenizer.json")->capture_default_str();
    app.add_option("--mb", corpus_mb, "corpus size in MB (the text is repeated)")
        ->capture_default_str();
    app.add_option("--repeats", repeats, "timed repeats (after one warm-up)")
        ->capture_default_str();
    app.add_option("files", files, "text files (default: docs/*.md and the reference texts)");
    CLI11_PARSE(app, argc, argv);

    try {
        std::vector<fs::path> sources(files.begin(), files.end());
        if (sources.empty()) sources = default_sources();
        std::string unique;
        for (const auto& p : sources) {
            std::string t = text_of(p);
            if (minids::find_invalid_utf8(t)) {
                std::fprintf(stderr, "skipping %s: not valid UTF-8\n", p.string().c_str());
                continue;
            }
            unique += t;
        }
        if (unique.empty()) {
            std::fprintf(stderr,
                         "bench_tokenizer: no text to encode (run from the repository root or give "
                         "files)\n");
            return 2;
        }
        std::string corpus;
        const auto target = static_cast<size_t>(corpus_mb * 1e6);
        while (corpus.size() < target) corpus += unique;

        std::vector<double> load_s;
        for (int i = 0; i < 3; ++i) {
            const auto t0 = Clock::now();
            minids::Tokenizer tok(minids::load_hf_tokenizer(tokenizer_path));
            load_s.push_back(seconds_since(t0));
        }

        auto encode_fresh = [&](const std::string& text, size_t& n_ids) {
            minids::Tokenizer tok(minids::load_hf_tokenizer(tokenizer_path));
            const auto t0 = Clock::now();
            n_ids = tok.encode(text, false).size();
            return seconds_since(t0);
        };
        size_t n_ids = 0, n_unique_ids = 0;
        encode_fresh(corpus, n_ids);  // warm-up
        std::vector<double> corpus_s, unique_s;
        for (int i = 0; i < repeats; ++i) {
            corpus_s.push_back(encode_fresh(corpus, n_ids));
            unique_s.push_back(encode_fresh(unique, n_unique_ids));
        }
        std::printf("tokenizer: %s\n", tokenizer_path.c_str());
        std::printf("load (tokenizer.json + config -> Tokenizer): %.3f s (median of 3)\n",
                    median(load_s));
        std::printf(
            "corpus: %.2f MB (%zu bytes of unique text from %zu files, repeated), %zu ids, %.2f "
            "bytes/id\n",
            corpus.size() / 1e6, unique.size(), sources.size(), n_ids,
            static_cast<double>(corpus.size()) / static_cast<double>(n_ids));
        std::printf("encode corpus: %.1f MB/s (median of %d; min %.1f, max %.1f)\n",
                    corpus.size() / 1e6 / median(corpus_s), repeats,
                    corpus.size() / 1e6 / *std::max_element(corpus_s.begin(), corpus_s.end()),
                    corpus.size() / 1e6 / *std::min_element(corpus_s.begin(), corpus_s.end()));
        std::printf("encode unique text once, cold cache: %.1f MB/s (median of %d)\n",
                    unique.size() / 1e6 / median(unique_s), repeats);
    } catch (const std::exception& e) {
        std::fprintf(stderr, "bench_tokenizer: %s\n", e.what());
        return 1;
    }
    return 0;
}
