#include "convert/synthetic.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <map>

#include <xxhash.h>

#include "convert/jobs.h"
#include "convert/safetensors.h"
#include "convert/tensor_plan.h"
#include "mds/writer.h"
#include "tokenizer/tokenizer_data.h"

namespace minids::convert {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

// DeepSeek's YaRN settings, shared by V2 and V2-Lite (their config.json files).
YarnScaling deepseek_yarn() {
    YarnScaling y;
    y.factor = 40.0;
    y.original_max_position_embeddings = 4096;
    y.beta_fast = 32.0;
    y.beta_slow = 1.0;
    y.mscale = 0.707;
    y.mscale_all_dim = 0.707;
    return y;
}

// ---- counter-based random numbers: splitmix64 over (key, row, counter) ----

uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

struct RowRng {
    uint64_t state;
    RowRng(uint64_t key, uint64_t row)
        : state(mix64(key ^ mix64(row * 0xd1342543de82ef95ull + 1))) {}
    uint64_t next() {
        state += 0x9e3779b97f4a7c15ull;
        return mix64(state);
    }
    double uniform() { return double(next() >> 11) * 0x1.0p-53; }
};

// Standard normal quantile (Acklam's rational approximation, refined by one Halley step on erfc):
// accurate to ~1e-15, plenty for a lookup table.
double normal_quantile(double p) {
    static const double a[] = {-3.969683028665376e+01, 2.209460984245205e+02,
                               -2.759285104469687e+02, 1.383577518672690e+02,
                               -3.066479806614716e+01, 2.506628277459239e+00};
    static const double b[] = {-5.447609879822406e+01, 1.615858368580409e+02,
                               -1.556989798598866e+02, 6.680131188771972e+01,
                               -1.328068155288572e+01};
    static const double c[] = {-7.784894002430293e-03, -3.223964580411365e-01,
                               -2.400758277161838e+00, -2.549732539343734e+00,
                               4.374664141464968e+00,  2.938163982698783e+00};
    static const double d[] = {7.784695709041462e-03, 3.224671290700398e-01, 2.445134137142996e+00,
                               3.754408661907416e+00};
    double x;
    if (p < 0.02425) {
        double q = std::sqrt(-2 * std::log(p));
        x = (((((c[0] * q + c[1]) * q + c[2]) * q + c[3]) * q + c[4]) * q + c[5]) /
            ((((d[0] * q + d[1]) * q + d[2]) * q + d[3]) * q + 1);
    } else if (p > 1 - 0.02425) {
        double q = std::sqrt(-2 * std::log(1 - p));
        x = -(((((c[0] * q + c[1]) * q + c[2]) * q + c[3]) * q + c[4]) * q + c[5]) /
            ((((d[0] * q + d[1]) * q + d[2]) * q + d[3]) * q + 1);
    } else {
        double q = p - 0.5, r = q * q;
        x = (((((a[0] * r + a[1]) * r + a[2]) * r + a[3]) * r + a[4]) * r + a[5]) * q /
            (((((b[0] * r + b[1]) * r + b[2]) * r + b[3]) * r + b[4]) * r + 1);
    }
    double e = 0.5 * std::erfc(-x / std::sqrt(2.0)) - p;
    double u = e * std::sqrt(2 * M_PI) * std::exp(x * x / 2);
    return x - u / (1 + x * u / 2);
}

// 16 random bits -> one of 65536 equiprobable normal quantiles.
constexpr size_t table_size = 65536;

struct Tables {
    std::vector<double> z;  // quantiles of N(0, 1) at (i + 0.5) / 65536
    // FP8 codes come from 8 random bits each (8 codes per 64-bit draw: the generator's hot loop):
    // 256 equiprobable normal quantiles at (i + 0.5) / 256, scaled so the extremes hit ±448.
    // E4M3 itself has only 256 codes, so a finer table would buy little.
    double z8_max = 0;
    std::vector<uint8_t> e4m3;
    std::map<float, std::vector<uint16_t>> bf16_by_sigma;

    Tables() : z(table_size), e4m3(256) {
        for (size_t i = 0; i < table_size; ++i)
            z[i] = normal_quantile((double(i) + 0.5) / double(table_size));
        z8_max = normal_quantile(255.5 / 256.0);
        for (size_t i = 0; i < 256; ++i)
            e4m3[i] = mgl::f32_to_e4m3(
                float(normal_quantile((double(i) + 0.5) / 256.0) * mgl::e4m3_max / z8_max));
    }
    const std::vector<uint16_t>& bf16(float sigma) {
        auto it = bf16_by_sigma.find(sigma);
        if (it != bf16_by_sigma.end()) return it->second;
        std::vector<uint16_t> t(table_size);
        for (size_t i = 0; i < table_size; ++i) t[i] = mgl::f32_to_bf16(float(z[i] * sigma));
        return bf16_by_sigma.emplace(sigma, std::move(t)).first->second;
    }
};

float sigma_for(const ExpectedTensor& t) {
    if (t.role == TensorRole::embedding) return 1.0f;
    return float(1.0 / std::sqrt(double(t.shape.back())));
}

// Fills n bf16 values of one row from the row's stream (n may be odd).
void fill_bf16_row(RowRng& rng, const uint16_t* table, uint8_t* dst, size_t n) {
    size_t j = 0;
    for (; j + 4 <= n; j += 4) {
        uint64_t r = rng.next();
        uint16_t v[4] = {table[r & 0xFFFF], table[(r >> 16) & 0xFFFF], table[(r >> 32) & 0xFFFF],
                         table[r >> 48]};
        std::memcpy(dst + 2 * j, v, 8);
    }
    if (j < n) {
        uint64_t r = rng.next();
        for (; j < n; ++j, r >>= 16) {
            uint16_t v = table[r & 0xFFFF];
            std::memcpy(dst + 2 * j, &v, 2);
        }
    }
}

// `table` has 256 entries; one draw gives 8 codes.
void fill_e4m3_row(RowRng& rng, const uint8_t* table, uint8_t* dst, size_t n) {
    size_t j = 0;
    for (; j + 8 <= n; j += 8) {
        uint64_t r = rng.next();
        for (int b = 0; b < 8; ++b) dst[j + size_t(b)] = table[(r >> (8 * b)) & 0xFF];
    }
    if (j < n) {
        uint64_t r = rng.next();
        for (; j < n; ++j, r >>= 8) dst[j] = table[r & 0xFF];
    }
}

uint64_t tensor_key(const std::string& name, uint64_t seed) {
    return XXH3_64bits_withSeed(name.data(), name.size(), seed);
}

}  // namespace

std::vector<std::string> synthetic_presets() { return {"tiny", "v2-lite", "v2"}; }

ModelConfig synthetic_config(const std::string& preset) {
    ModelConfig c;
    c.architecture = "DeepseekV2ForCausalLM";
    c.rope_theta = 10000.0;
    c.rms_norm_eps = 1e-6;
    c.scoring_func = "softmax";
    c.moe_layer_freq = 1;
    c.first_k_dense_replace = 1;
    c.n_shared_experts = 2;
    c.num_experts_per_tok = 6;
    c.qk_nope_head_dim = 128;
    c.qk_rope_head_dim = 64;
    c.v_head_dim = 128;
    c.kv_lora_rank = 512;
    c.vocab_size = 102400;
    c.max_position_embeddings = 163840;
    c.rope_scaling = deepseek_yarn();
    c.tie_word_embeddings = false;
    if (preset == "v2-lite") {  // deepseek-ai/DeepSeek-V2-Lite config.json
        c.hidden_size = 2048;
        c.intermediate_size = 10944;
        c.moe_intermediate_size = 1408;
        c.num_hidden_layers = 27;
        c.num_attention_heads = 16;
        c.q_lora_rank = std::nullopt;
        c.n_routed_experts = 64;
        c.topk_method = "greedy";
        c.n_group = 1;
        c.topk_group = 1;
        c.norm_topk_prob = false;
        c.routed_scaling_factor = 1.0;
    } else if (preset == "v2") {  // deepseek-ai/DeepSeek-V2 config.json
        c.hidden_size = 5120;
        c.intermediate_size = 12288;
        c.moe_intermediate_size = 1536;
        c.num_hidden_layers = 60;
        c.num_attention_heads = 128;
        c.q_lora_rank = 1536;
        c.n_routed_experts = 160;
        c.topk_method = "group_limited_greedy";
        c.n_group = 8;
        c.topk_group = 3;
        c.norm_topk_prob = false;
        c.routed_scaling_factor = 16.0;
    } else if (preset == "tiny") {  // V2's features at toy sizes, for tests and demos
        c.vocab_size = 512;
        c.hidden_size = 64;
        c.intermediate_size = 160;
        c.moe_intermediate_size = 32;
        c.num_hidden_layers = 4;
        c.num_attention_heads = 4;
        c.q_lora_rank = 48;
        c.kv_lora_rank = 32;
        c.qk_nope_head_dim = 16;
        c.qk_rope_head_dim = 8;
        c.v_head_dim = 16;
        c.n_routed_experts = 16;
        c.num_experts_per_tok = 4;
        c.topk_method = "group_limited_greedy";
        c.n_group = 4;
        c.topk_group = 2;
        c.routed_scaling_factor = 2.0;
        c.max_position_embeddings = 4096;
    } else {
        throw InputError("--synthetic: unknown preset \"" + preset +
                         "\" (expected tiny, v2-lite or v2)");
    }
    return c;
}

ConvertStats write_synthetic(const SyntheticOptions& opt) {
    auto t0 = std::chrono::steady_clock::now();
    InterruptScope interrupt_scope;
    const int threads = resolve_threads(opt.threads);
    ModelConfig config = synthetic_config(opt.preset);
    TokenizerData tok = synthetic_byte_tokenizer(config.vocab_size);
    if (tok.bos_id) config.bos_token_id = *tok.bos_id;
    if (tok.eos_id) config.eos_token_id = *tok.eos_id;
    validate_config(config);
    if (!opt.dry_run) check_output_path(opt.out, opt.force);

    mds::MdsWriter w(opt.out, opt.force);
    ModelPlan plan = plan_model(config, opt.expert_dtype, true, w);
    w.set_config(config_to_json(config));
    w.set_tokenizer(tokenizer_data_to_json(tok));
    w.set_provenance({{"tool", "minids convert"},
                      {"tool_version", MINIDS_VERSION},
                      {"source", "synthetic:" + opt.preset},
                      {"expert_dtype", opt.expert_dtype == mgl::dtype::bf16 ? "bf16" : "f8_e4m3"},
                      {"synthetic", true},
                      {"preset", opt.preset},
                      {"seed", opt.seed}});
    w.plan();

    ConvertStats st = ConvertStats::of_plan(w);
    if (opt.dry_run) return st;

    w.open();
    Tables tables;
    Progress progress("generating", st.dense_bytes + st.expert_bytes, opt.progress);

    // Dense tensors: one at a time, rows split across threads, one buffer reused (fresh pages
    // cost a fault and a clear each).
    mds::AlignedBuffer buf;
    for (size_t i = 0; i < plan.n_dense; ++i) {
        throw_if_interrupted();
        const ExpectedTensor& t = plan.tensors[i];
        const size_t id = plan.writer_id[i];
        buf.resize(w.tensor_nbytes(id));
        if (t.role == TensorRole::norm) {
            const uint16_t one = mgl::f32_to_bf16(1.0f);
            for (size_t k = 0; k < buf.size(); k += 2) std::memcpy(buf.data() + k, &one, 2);
        } else {
            const uint16_t* table = tables.bf16(sigma_for(t)).data();
            const uint64_t key = tensor_key(t.name, opt.seed);
            const size_t rows = size_t(t.shape[0]), cols = size_t(t.shape[1]);
            const size_t rows_per_job = std::max<size_t>(1, (size_t(1) << 21) / cols);
            parallel_for((rows + rows_per_job - 1) / rows_per_job, threads, [&](size_t job) {
                for (size_t r = job * rows_per_job; r < std::min(rows, (job + 1) * rows_per_job);
                     ++r) {
                    RowRng rng(key, r);
                    fill_bf16_row(rng, table, buf.data() + r * cols * 2, cols);
                }
            });
        }
        w.write_tensor(id, buf);
        progress.add(buf.size());
    }

    // Experts: one blob per job.
    if (w.n_blobs() > 0) {
        const mds::ExpertLayout& layout = w.expert_layout();
        const bool fp8 = layout.dtype == mgl::dtype::f8_e4m3;
        // σ by fan-in: gate/up read n_embd, down reads n_ff.
        const float sigma_in[3] = {float(1.0 / std::sqrt(double(layout.n_embd))),
                                   float(1.0 / std::sqrt(double(layout.n_embd))),
                                   float(1.0 / std::sqrt(double(layout.n_ff)))};
        const uint16_t* bf16_tables[3] = {tables.bf16(sigma_in[0]).data(),
                                          tables.bf16(sigma_in[1]).data(),
                                          tables.bf16(sigma_in[2]).data()};
        const std::vector<ExpectedTensor>& ts = plan.tensors;
        parallel_for(w.n_blobs(), threads, [&](size_t blob) {
            // One scratch blob per worker thread (thread_local because parallel_for has no
            // per-worker state; a fresh 8.7 MB buffer per blob would pay page faults and clears).
            // The parts overwrite their regions; the padding between them is zeroed here (the
            // buffer may hold another layout's bytes from an earlier call on this thread).
            thread_local mds::AlignedBuffer buf;
            buf.resize(layout.blob_nbytes);
            uint64_t pos = 0;
            for (const auto& p : layout.parts) {  // parts are in increasing offset order
                std::memset(buf.data() + pos, 0, p.offset - pos);
                pos = p.offset + p.nbytes;
            }
            const size_t first = plan.n_dense + 3 * blob;  // this blob's gate, up, down
            for (int part = 0; part < 3; ++part) {
                const ExpectedTensor& t = ts[first + size_t(part)];
                const auto& p = layout.parts[size_t(part)];
                const uint64_t key = tensor_key(t.name, opt.seed);
                const size_t rows = size_t(t.shape[0]), cols = size_t(t.shape[1]);
                for (size_t r = 0; r < rows; ++r) {
                    RowRng rng(key, r);
                    if (fp8) {
                        float scale = float(sigma_in[part] * tables.z8_max / mgl::e4m3_max *
                                            (0.75 + 0.5 * rng.uniform()));
                        std::memcpy(buf.data() + layout.parts[size_t(part) + 3].offset + 4 * r,
                                    &scale, 4);
                        fill_e4m3_row(rng, tables.e4m3.data(), buf.data() + p.offset + r * cols,
                                      cols);
                    } else {
                        fill_bf16_row(rng, bf16_tables[part], buf.data() + p.offset + r * cols * 2,
                                      cols);
                    }
                }
            }
            w.write_blob(blob, buf);
            progress.add(buf.size());
        });
    }
    throw_if_interrupted();
    w.commit();
    progress.finish();
    st.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return st;
}

}  // namespace minids::convert
