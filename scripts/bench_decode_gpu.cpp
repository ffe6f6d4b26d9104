// Decode speed of a model on the CUDA backend under each of the backend's switches, to pick
// defaults from measurements: CUDA graphs on/off, fusions all/none/one at a time, PDL on/off.
//
//   build/bench_decode_gpu MODEL.mds [--steps 64] [--prompt 16] [--depth 0] [--kv bf16|f16|f32]
//                          [--quick]
//
// Per configuration: a fresh backend (weights copied again), a prompt of random tokens (after
// `depth` tokens of context), 8 warm-up decode steps, then `steps` timed steps of one token each
// through Session::eval (the decode graph, inputs uploaded, logits downloaded: what `run` pays).
// Prints tok/s from the median step, the mean, and the checksum of the last logits (configs must
// agree to rounding). --quick runs only the default and the all-off configurations.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "mds/reader.h"
#include "mgl-cuda.h"
#include "model/deepseek2.h"
#include "runtime/session.h"

namespace {

using Clock = std::chrono::steady_clock;

struct config {
    std::string name;
    mgl::cuda_options options;
};

std::vector<config> configs(bool quick) {
    std::vector<config> out;
    mgl::cuda_options all;
    out.push_back({"graphs, all fusions, pdl (default)", all});
    mgl::cuda_options none = all;
    none.graphs = false;
    none.fuse = {false, false, false, false};
    none.pdl = false;
    if (quick) {
        out.push_back({"eager, no fusion, no pdl", none});
        return out;
    }
    mgl::cuda_options eager = all;
    eager.graphs = false;
    out.push_back({"eager, all fusions, pdl", eager});
    mgl::cuda_options unfused = all;
    unfused.fuse = {false, false, false, false};
    out.push_back({"graphs, no fusion, pdl", unfused});
    const char* names[] = {"norm", "residual", "route", "mla_prep"};
    for (int i = 0; i < 4; ++i) {
        mgl::cuda_options o = all;
        bool* flag[] = {&o.fuse.norm, &o.fuse.residual, &o.fuse.route, &o.fuse.mla_prep};
        *flag[i] = false;
        out.push_back({std::string("graphs, all fusions but ") + names[i] + ", pdl", o});
    }
    mgl::cuda_options no_pdl = all;
    no_pdl.pdl = false;
    out.push_back({"graphs, all fusions, no pdl", no_pdl});
    out.push_back({"eager, no fusion, no pdl", none});
    return out;
}

}  // namespace

int main(int argc, char** argv) {
    CLI::App app{"decode speed on the CUDA backend per backend switch"};
    std::string model_path, kv = "bf16";
    int64_t steps = 64, prompt = 16, depth = 0;
    bool quick = false;
    app.add_option("model", model_path, "a .mds model")->required();
    app.add_option("--steps", steps, "timed decode steps");
    app.add_option("--prompt", prompt, "prompt tokens before decoding");
    app.add_option("--depth", depth, "tokens of context before the prompt");
    app.add_option("--kv", kv, "KV cache dtype: bf16, f16 or f32")
        ->check(CLI::IsMember({"bf16", "f16", "f32"}));
    app.add_flag("--quick", quick, "only the default and the all-off configurations");
    CLI11_PARSE(app, argc, argv);
    if (!mgl::cuda_available()) {
        std::fprintf(stderr, "bench_decode_gpu: no CUDA device\n");
        return 1;
    }
    const mgl::cuda_device_info dev = mgl::cuda_info();
    std::printf("device: %s, %d SMs; model %s; depth %lld, prompt %lld, %lld steps, %s KV\n",
                dev.name.c_str(), dev.sm_count, model_path.c_str(), (long long)depth,
                (long long)prompt, (long long)steps, kv.c_str());
    std::printf("| %-40s | %9s | %9s | %9s | %14s |\n", "configuration", "tok/s", "median ms",
                "mean ms", "logits sum");
    std::printf("|%s|%s|%s|%s|%s|\n", std::string(42, '-').c_str(), std::string(11, '-').c_str(),
                std::string(11, '-').c_str(), std::string(11, '-').c_str(),
                std::string(16, '-').c_str());
    auto file = minids::mds::MdsFile::open(model_path);
    for (const config& c : configs(quick)) {
        auto backend = mgl::make_cuda_backend(c.options);
        minids::Deepseek2Model model(*file, *backend);
        const int64_t V = model.config().vocab_size;
        minids::SessionParams sp;
        sp.n_ctx = depth + prompt + steps + 16;
        sp.kv_type = kv == "f32"   ? mgl::dtype::f32
                     : kv == "f16" ? mgl::dtype::f16
                                   : mgl::dtype::bf16;
        minids::Session session(model, *backend, sp);
        std::mt19937 rng(1234);
        auto random_tokens = [&](int64_t n) {
            std::vector<int32_t> t(static_cast<size_t>(n));
            for (auto& id : t) id = int32_t(rng() % uint32_t(V));
            return t;
        };
        if (depth > 0) session.eval(random_tokens(depth));
        session.eval(random_tokens(prompt));
        std::vector<float> logits;
        std::vector<double> ms;
        for (int64_t i = 0; i < steps + 8; ++i) {
            const int32_t token[1] = {int32_t(rng() % uint32_t(V))};
            const auto t0 = Clock::now();
            logits = session.eval(token);
            const double dt = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
            if (i >= 8) ms.push_back(dt);
        }
        std::vector<double> sorted = ms;
        std::sort(sorted.begin(), sorted.end());
        const double median = sorted[sorted.size() / 2];
        double mean = 0, sum = 0;
        for (double v : ms) mean += v / double(ms.size());
        for (float v : logits) sum += double(v);
        std::printf("| %-40s | %9.1f | %9.3f | %9.3f | %14.6g |\n", c.name.c_str(), 1000.0 / median,
                    median, mean, sum);
        std::fflush(stdout);
    }
    return 0;
}
