// minids info M [--verify] [--json]: what is in an .mds file (config, sizes, tokenizer,
// provenance), and with --verify whether every byte of it is intact.
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <string>

#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "cli/model_check.h"
#include "mds/manifest.h"
#include "mds/reader.h"

namespace minids::cli {

namespace {

struct InfoOptions {
    std::string model;
    bool verify = false;
    bool json = false;
    int threads = 0;
};

std::string human_bytes(uint64_t n) {
    const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    double v = static_cast<double>(n);
    int u = 0;
    while (v >= 1024.0 && u < 4) {
        v /= 1024.0;
        ++u;
    }
    char buf[32];
    std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.2f %s", v, units[u]);
    return buf;
}

struct Sizes {
    uint64_t dense_bytes = 0;
    uint64_t expert_bytes = 0;
    uint64_t bytes_per_expert = 0;
    uint64_t kv_bytes_per_token_bf16 = 0;
    uint64_t kv_bytes_per_token_f32 = 0;
    int64_t n_dense_layers = 0;
    int64_t n_moe_layers = 0;
    size_t n_special = 0;
};

Sizes compute_sizes(const mds::MdsFile& m) {
    Sizes s;
    for (const auto& t : m.tensors()) s.dense_bytes += t.nbytes;
    s.bytes_per_expert = m.experts().blob_nbytes;
    s.expert_bytes = s.bytes_per_expert * m.experts().blobs.size();
    const ModelConfig& c = m.config();
    // The MLA cache holds c (kv_lora_rank) and k_pe (qk_rope_head_dim) per token and layer.
    const uint64_t per_layer = static_cast<uint64_t>(c.kv_cache_width());
    s.kv_bytes_per_token_bf16 = static_cast<uint64_t>(c.num_hidden_layers) * per_layer * 2;
    s.kv_bytes_per_token_f32 = static_cast<uint64_t>(c.num_hidden_layers) * per_layer * 4;
    for (int64_t l = 0; l < c.num_hidden_layers; ++l)
        (c.is_moe_layer(l) ? s.n_moe_layers : s.n_dense_layers)++;
    for (const auto& a : m.tokenizer().added_tokens) s.n_special += a.special;
    return s;
}

nlohmann::json info_json(const mds::MdsFile& m, const Sizes& s) {
    const auto& t = m.tokenizer();
    return {{"file", m.path()},
            {"file_bytes", m.file_size()},
            {"config", m.manifest().at("config")},
            {"sizes",
             {{"dense_bytes", s.dense_bytes},
              {"n_tensors", m.tensors().size()},
              {"expert_bytes", s.expert_bytes},
              {"n_experts", m.experts().blobs.size()},
              {"bytes_per_expert", s.bytes_per_expert},
              {"expert_dtype",
               m.experts().present ? mds::manifest_dtype_name(m.experts().dtype) : "none"},
              {"kv_bytes_per_token_bf16", s.kv_bytes_per_token_bf16},
              {"kv_bytes_per_token_f32", s.kv_bytes_per_token_f32}}},
            {"tokenizer",
             {{"vocab_size", t.vocab.size()},
              {"merges", t.merges.size()},
              {"added_tokens", t.added_tokens.size()},
              {"special_tokens", s.n_special},
              {"has_chat_template", !t.chat_template.empty()},
              {"bos_id", t.bos_id ? nlohmann::json(*t.bos_id) : nlohmann::json(nullptr)},
              {"eos_id", t.eos_id ? nlohmann::json(*t.eos_id) : nlohmann::json(nullptr)}}},
            {"provenance", m.provenance()}};
}

void print_text(const mds::MdsFile& m, const Sizes& s) {
    const ModelConfig& c = m.config();
    const auto& t = m.tokenizer();
    std::printf("file:        %s (%s)\n", m.path().c_str(), human_bytes(m.file_size()).c_str());
    std::printf("model:       %s, %lld layers (%lld dense, %lld MoE), hidden %lld, vocab %lld\n",
                c.architecture.c_str(), (long long)c.num_hidden_layers, (long long)s.n_dense_layers,
                (long long)s.n_moe_layers, (long long)c.hidden_size, (long long)c.vocab_size);
    std::string q = c.q_lora_rank ? std::to_string(*c.q_lora_rank) : "none";
    std::printf(
        "attention:   MLA, %lld heads, q_lora_rank %s, kv_lora_rank %lld, "
        "qk_nope %lld, qk_rope %lld, v %lld\n",
        (long long)c.num_attention_heads, q.c_str(), (long long)c.kv_lora_rank,
        (long long)c.qk_nope_head_dim, (long long)c.qk_rope_head_dim, (long long)c.v_head_dim);
    if (c.n_routed_experts > 0) {
        std::string shared = c.n_shared_experts ? std::to_string(*c.n_shared_experts) : "no";
        std::printf(
            "moe:         %lld routed experts (%lld per token, %s), %s shared, "
            "expert ffn %lld, dense ffn %lld\n",
            (long long)c.n_routed_experts, (long long)c.num_experts_per_tok, c.topk_method.c_str(),
            shared.c_str(), (long long)c.moe_intermediate_size, (long long)c.intermediate_size);
    } else {
        std::printf("mlp:         dense, ffn %lld\n", (long long)c.intermediate_size);
    }
    if (c.rope_scaling)
        std::printf("rope:        theta %g, YaRN factor %g (original context %lld), context %lld\n",
                    c.rope_theta, c.rope_scaling->factor,
                    (long long)c.rope_scaling->original_max_position_embeddings,
                    (long long)c.max_position_embeddings);
    else
        std::printf("rope:        theta %g, context %lld\n", c.rope_theta,
                    (long long)c.max_position_embeddings);
    std::printf("dense:       %s in %zu tensors\n", human_bytes(s.dense_bytes).c_str(),
                m.tensors().size());
    if (m.experts().present)
        std::printf("experts:     %s in %zu blobs of %s (%s), %lld bytes per expert\n",
                    human_bytes(s.expert_bytes).c_str(), m.experts().blobs.size(),
                    human_bytes(s.bytes_per_expert).c_str(),
                    mds::manifest_dtype_name(m.experts().dtype), (long long)s.bytes_per_expert);
    else
        std::printf("experts:     none\n");
    std::printf(
        "kv cache:    %llu bytes/token in BF16, %llu in F32 "
        "(%lld layers x (kv_lora_rank %lld + rope %lld))\n",
        (unsigned long long)s.kv_bytes_per_token_bf16, (unsigned long long)s.kv_bytes_per_token_f32,
        (long long)c.num_hidden_layers, (long long)c.kv_lora_rank, (long long)c.qk_rope_head_dim);
    std::printf("tokenizer:   %zu tokens, %zu merges, %zu added (%zu special), chat template %s\n",
                t.vocab.size(), t.merges.size(), t.added_tokens.size(), s.n_special,
                t.chat_template.empty() ? "no" : "yes");
    std::printf("provenance:");
    for (auto it = m.provenance().begin(); it != m.provenance().end(); ++it) {
        std::string v = it.value().is_string() ? it.value().get<std::string>() : it.value().dump();
        std::printf(" %s=%s", it.key().c_str(), v.c_str());
    }
    std::printf("\n");
}

// A progress bar on stderr, redrawn in place when stderr is a terminal.
void draw_progress(uint64_t done, uint64_t total) {
    const int width = 40;
    const double frac = total ? static_cast<double>(done) / static_cast<double>(total) : 1.0;
    const int filled = static_cast<int>(frac * width);
    std::string bar(static_cast<size_t>(filled), '#');
    bar.resize(width, ' ');
    std::fprintf(stderr, "\rverify [%s] %3d%% %s / %s", bar.c_str(), static_cast<int>(frac * 100),
                 human_bytes(done).c_str(), human_bytes(total).c_str());
    std::fflush(stderr);
}

int run_info(const InfoOptions& o) {
    std::unique_ptr<mds::MdsFile> m;
    try {
        m = mds::MdsFile::open(o.model);
    } catch (const mds::FileError& e) {
        std::fprintf(stderr, "minids info: error: %s\n", e.what());
        return exit_bad_input;
    }
    const Sizes s = compute_sizes(*m);
    nlohmann::json j = o.json ? info_json(*m, s) : nlohmann::json();
    if (!o.json) print_text(*m, s);
    if (!o.verify) {
        if (o.json) std::printf("%s\n", j.dump(2).c_str());
        return exit_ok;
    }

    const bool tty = isatty(STDERR_FILENO);
    auto start = std::chrono::steady_clock::now();
    auto result =
        m->verify(o.threads, tty ? draw_progress : std::function<void(uint64_t, uint64_t)>{});
    // Everything run and chat would refuse: the weights bind, the tokenizer builds, the chat
    // template renders.
    try {
        // Binding on the CPU maps the weights in place; nothing is copied.
        const std::unique_ptr<mgl::backend> cpu = mgl::make_cpu_backend(1);
        open_checked_model(o.model, *cpu);
    } catch (const mds::FileError& e) {
        result.problems.push_back(e.what());
        result.ok = false;
    }
    double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (tty) std::fprintf(stderr, "\n");
    for (const auto& p : result.problems) std::fprintf(stderr, "minids info: %s\n", p.c_str());
    const double gbps = secs > 0 ? static_cast<double>(m->file_size()) / secs / 1e9 : 0.0;
    if (o.json) {
        j["verify"] = {{"ok", result.ok},
                       {"problems", result.problems},
                       {"seconds", secs},
                       {"gb_per_s", gbps}};
        std::printf("%s\n", j.dump(2).c_str());
    } else if (result.ok) {
        std::printf("verify:      OK, %s checked in %.2f s (%.1f GB/s)\n",
                    human_bytes(m->file_size()).c_str(), secs, gbps);
    } else {
        std::printf("verify:      FAILED, %zu problem(s)\n", result.problems.size());
    }
    if (!result.ok) {
        std::fprintf(stderr, "minids info: error: %s is corrupt: %zu problem(s), listed above\n",
                     o.model.c_str(), result.problems.size());
        return exit_bad_input;
    }
    return exit_ok;
}

}  // namespace

void add_info_command(CLI::App& app, int& exit_code) {
    auto opts = std::make_shared<InfoOptions>();
    auto* cmd = app.add_subcommand("info",
                                   "Print an .mds file's config, sizes, tokenizer and "
                                   "provenance; --verify checks every byte");
    cmd->add_option("model", opts->model, "The .mds file")->required();
    cmd->add_flag("--verify", opts->verify,
                  "Check every checksum and that all padding is zero (reads the whole file), and "
                  "everything loading the model checks (weights, tokenizer, chat template)");
    cmd->add_flag("--json", opts->json, "Print JSON instead of text");
    cmd->add_option("--threads", opts->threads, "Threads for --verify (0 = all cores)")
        ->check(CLI::NonNegativeNumber);
    cmd->callback([opts, &exit_code] { exit_code = run_info(*opts); });
}

}  // namespace minids::cli
