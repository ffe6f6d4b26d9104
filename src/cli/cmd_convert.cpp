// minids convert HF_DIR -o OUT.mds [--expert-dtype fp8|bf16] [--threads N] [--force]
// minids convert --synthetic tiny|v2-lite|v2 -o OUT.mds [--seed S] [--dry-run] ...
#include <cstdio>
#include <memory>
#include <new>
#include <string>
#include <system_error>

#include "cli/commands.h"
#include "convert/convert.h"
#include "convert/jobs.h"
#include "convert/safetensors.h"
#include "convert/synthetic.h"
#include "mds/writer.h"

namespace minids::cli {
namespace {

struct ConvertArgs {
    std::string hf_dir;
    std::string out;
    std::string expert_dtype = "fp8";
    std::string synthetic;
    uint64_t seed = 0;
    int threads = 0;
    bool force = false;
    bool dry_run = false;
    bool quiet = false;
};

void print_stats(const char* what, const std::string& out, const convert::ConvertStats& st,
                 bool dry_run) {
    std::fprintf(stderr, "%s %s: %.3f GB (%zu dense tensors, %.3f GB; %zu expert blobs, %.3f GB)%s",
                 what, out.c_str(), double(st.file_size) / 1e9, st.n_tensors,
                 double(st.dense_bytes) / 1e9, st.n_blobs, double(st.expert_bytes) / 1e9,
                 dry_run ? "\n" : "");
    if (!dry_run)
        std::fprintf(stderr, " in %.2f s, %.2f GB/s\n", st.seconds,
                     st.seconds > 0 ? double(st.file_size) / 1e9 / st.seconds : 0.0);
}

int run_convert(const ConvertArgs& a) {
    mgl::dtype expert_dtype{};
    if (!convert::parse_expert_dtype(a.expert_dtype, expert_dtype)) {
        std::fprintf(stderr,
                     "minids convert: error: --expert-dtype: expected fp8 or bf16, found \"%s\"\n",
                     a.expert_dtype.c_str());
        return exit_bad_input;
    }
    if (a.synthetic.empty() == a.hf_dir.empty()) {
        std::fprintf(
            stderr,
            "minids convert: error: expected either HF_DIR or --synthetic PRESET (exactly one)\n");
        return exit_bad_input;
    }
    if (a.threads < 0) {
        std::fprintf(
            stderr,
            "minids convert: error: --threads: expected 0 (all) or a positive count, found %d\n",
            a.threads);
        return exit_bad_input;
    }
    if (a.out.empty() && !a.dry_run) {
        std::fprintf(stderr, "minids convert: error: expected an output file (-o OUT.mds)\n");
        return exit_bad_input;
    }
    try {
        if (!a.synthetic.empty()) {
            convert::SyntheticOptions o;
            o.preset = a.synthetic;
            o.seed = a.seed;
            o.out = a.out.empty() ? std::string("(dry run)") : a.out;
            o.expert_dtype = expert_dtype;
            o.threads = a.threads;
            o.force = a.force;
            o.progress = !a.quiet;
            o.dry_run = a.dry_run;
            convert::ConvertStats st = convert::write_synthetic(o);
            print_stats(a.dry_run ? "would write" : "wrote", o.out.string(), st, a.dry_run);
        } else {
            if (a.dry_run) {
                std::fprintf(
                    stderr,
                    "minids convert: error: --dry-run is only supported with --synthetic\n");
                return exit_bad_input;
            }
            convert::ConvertOptions o;
            o.hf_dir = a.hf_dir;
            o.out = a.out;
            o.expert_dtype = expert_dtype;
            o.threads = a.threads;
            o.force = a.force;
            o.progress = !a.quiet;
            convert::ConvertStats st = convert::convert_checkpoint(o);
            print_stats("wrote", a.out, st, false);
        }
    } catch (const convert::Interrupted&) {
        std::fprintf(stderr, "\nminids convert: interrupted; no output written\n");
        return exit_interrupted;
    } catch (const convert::InputError& e) {
        std::fprintf(stderr, "minids convert: error: %s\n", e.what());
        return exit_bad_input;
    } catch (const mds::WriterError& e) {
        std::fprintf(stderr, "minids convert: error: %s\n", e.what());
        return exit_failure;
    } catch (const std::bad_alloc&) {  // resource limits: one line, no output left behind
        std::fprintf(stderr, "minids convert: error: out of memory (fewer --threads need less)\n");
        return exit_failure;
    } catch (const std::system_error& e) {
        std::fprintf(stderr, "minids convert: error: %s\n", e.what());
        return exit_failure;
    }
    return exit_ok;
}

}  // namespace

void add_convert_command(CLI::App& app, int& exit_code) {
    auto args = std::make_shared<ConvertArgs>();
    auto* cmd = app.add_subcommand(
        "convert", "Convert a Hugging Face checkpoint (or a synthetic preset) to .mds");
    cmd->add_option(
        "HF_DIR", args->hf_dir,
        "checkpoint directory: config.json, model.safetensors or model-*.safetensors + index, "
        "tokenizer.json, tokenizer_config.json");
    cmd->add_option("-o,--output", args->out,
                    "output .mds file (written as OUT.tmp, renamed on success)");
    cmd->add_option("--expert-dtype", args->expert_dtype,
                    "routed expert storage: fp8 (E4M3 + row scales) or bf16")
        ->capture_default_str();
    cmd->add_option(
           "--threads", args->threads,
           "worker threads (0: twice the hardware threads, so computing overlaps the writes)")
        ->capture_default_str();
    cmd->add_flag("--force", args->force, "overwrite an existing output file");
    cmd->add_option("--synthetic", args->synthetic,
                    "write random weights of a preset's exact shapes: tiny, v2-lite, v2");
    cmd->add_option("--seed", args->seed, "random seed for --synthetic")->capture_default_str();
    cmd->add_flag("--dry-run", args->dry_run,
                  "with --synthetic: plan the layout and print sizes, write nothing");
    cmd->add_flag("-q,--quiet", args->quiet, "no progress line");
    cmd->callback([args, &exit_code] { exit_code = run_convert(*args); });
}

}  // namespace minids::cli
