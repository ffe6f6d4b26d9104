#include "mds_test_file.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <stdexcept>

#include <xxhash.h>

#include "mds/format.h"
#include "model/config.h"
#include "tokenizer/tokenizer_data.h"

namespace minids::test {

using nlohmann::json;

namespace {

constexpr uint64_t align_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

std::string hex16(uint64_t v) {
    char buf[17];
    std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
    return buf;
}

// Random BF16 values in [-1, 1) (top half of the f32 bits; rounding is irrelevant here).
std::vector<uint8_t> random_bf16(size_t n, std::mt19937_64& rng) {
    std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
    std::vector<uint8_t> out(n * 2);
    for (size_t i = 0; i < n; ++i) {
        float f = dist(rng);
        uint32_t bits;
        std::memcpy(&bits, &f, 4);
        uint16_t h = static_cast<uint16_t>(bits >> 16);
        std::memcpy(out.data() + 2 * i, &h, 2);
    }
    return out;
}

// Random E4M3 bytes that are never NaN (0x7f / 0xff).
std::vector<uint8_t> random_e4m3(size_t n, std::mt19937_64& rng) {
    std::vector<uint8_t> out(n);
    for (auto& b : out) {
        b = static_cast<uint8_t>(rng());
        if ((b & 0x7f) == 0x7f) b ^= 0x01;
    }
    return out;
}

std::vector<uint8_t> random_scales(size_t n, std::mt19937_64& rng) {
    std::uniform_real_distribution<float> dist(0.001f, 0.01f);
    std::vector<uint8_t> out(n * 4);
    for (size_t i = 0; i < n; ++i) {
        float f = dist(rng);
        std::memcpy(out.data() + 4 * i, &f, 4);
    }
    return out;
}

ModelConfig test_config(const MdsTestOptions& o) {
    ModelConfig c;
    c.vocab_size = o.vocab_size;
    c.hidden_size = o.hidden_size;
    c.intermediate_size = 40;
    c.moe_intermediate_size = 12;
    c.num_hidden_layers = o.n_layers;
    c.num_attention_heads = 2;
    if (o.q_lora) c.q_lora_rank = 16;
    c.kv_lora_rank = 8;
    c.qk_nope_head_dim = 4;
    c.qk_rope_head_dim = 4;
    c.v_head_dim = 6;
    c.n_routed_experts = o.n_experts;
    if (o.shared_experts) c.n_shared_experts = 1;
    c.num_experts_per_tok = std::min(2, o.n_experts);
    c.first_k_dense_replace = 1;
    c.moe_layer_freq = 1;
    c.n_group = 1;
    c.topk_group = 1;
    c.topk_method = "greedy";
    c.norm_topk_prob = false;
    c.routed_scaling_factor = 1.0;
    c.scoring_func = "softmax";
    c.rms_norm_eps = 1e-6;
    c.rope_theta = 10000.0;
    c.rope_scaling = YarnScaling{40.0, 4096, 32.0, 1.0, 0.707, 0.707};
    c.max_position_embeddings = 163840;
    c.bos_token_id = 32;
    c.eos_token_id = 33;
    c.tie_word_embeddings = false;
    return c;
}

}  // namespace

json test_config_json(const MdsTestOptions& options) {
    return config_to_json(test_config(options));
}

json test_tokenizer_json() {
    TokenizerData t;
    for (int i = 0; i < 29; ++i)
        t.vocab.push_back(std::string(1, static_cast<char>('a' + i % 26)) + std::to_string(i));
    // What the merges make, so the tokenizer builds (info --verify and the loader build it).
    for (const char* merged : {"a0b1", "c2d3", "a0b1c2d3"}) t.vocab.push_back(merged);
    t.vocab.push_back("<|bos|>");
    t.vocab.push_back("<|eos|>");
    t.merges = {"a0 b1", "c2 d3", "a0b1 c2d3"};
    t.added_tokens.push_back({.id = 32, .content = "<|bos|>"});
    t.added_tokens.push_back({.id = 33, .content = "<|eos|>"});
    t.pre_splits.push_back({"\\p{N}{1,3}", "isolated", false});
    t.bos_id = 32;
    t.eos_id = 33;
    t.chat_template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}";
    return tokenizer_data_to_json(t);
}

MdsTestFile make_test_mds(const MdsTestOptions& o) {
    const ModelConfig c = test_config(o);
    std::mt19937_64 rng(o.seed);
    MdsTestFile f;

    struct Planned {
        std::string name;
        std::vector<int64_t> shape;
        std::vector<uint8_t> bytes;
    };
    std::vector<Planned> tensors;
    auto add = [&](std::string name, std::vector<int64_t> shape) {
        size_t n = 1;
        for (auto d : shape) n *= static_cast<size_t>(d);
        tensors.push_back({std::move(name), std::move(shape), random_bf16(n, rng)});
    };
    const int64_t D = c.hidden_size, H = c.num_attention_heads, V = c.vocab_size;
    add("model.embed_tokens.weight", {V, D});
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
        std::string p = "model.layers." + std::to_string(l) + ".";
        add(p + "input_layernorm.weight", {D});
        if (c.q_lora_rank) {
            add(p + "self_attn.q_a_proj.weight", {*c.q_lora_rank, D});
            add(p + "self_attn.q_a_layernorm.weight", {*c.q_lora_rank});
            add(p + "self_attn.q_b_proj.weight", {H * c.qk_head_dim(), *c.q_lora_rank});
        } else {
            add(p + "self_attn.q_proj.weight", {H * c.qk_head_dim(), D});
        }
        add(p + "self_attn.kv_a_proj_with_mqa.weight", {c.kv_cache_width(), D});
        add(p + "self_attn.kv_a_layernorm.weight", {c.kv_lora_rank});
        add(p + "self_attn.kv_b_proj.weight",
            {H * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank});
        add(p + "self_attn.o_proj.weight", {D, H * c.v_head_dim});
        add(p + "post_attention_layernorm.weight", {D});
        if (c.is_moe_layer(l)) {
            add(p + "mlp.gate.weight", {c.n_routed_experts, D});
            if (c.n_shared_experts) {
                int64_t F = c.moe_intermediate_size * *c.n_shared_experts;
                add(p + "mlp.shared_experts.gate_proj.weight", {F, D});
                add(p + "mlp.shared_experts.up_proj.weight", {F, D});
                add(p + "mlp.shared_experts.down_proj.weight", {D, F});
            }
        } else {
            add(p + "mlp.gate_proj.weight", {c.intermediate_size, D});
            add(p + "mlp.up_proj.weight", {c.intermediate_size, D});
            add(p + "mlp.down_proj.weight", {D, c.intermediate_size});
        }
    }
    add("model.norm.weight", {D});
    add("lm_head.weight", {V, D});

    // Expert blob layout: gate | up | down | scales, each part 256-aligned.
    const int64_t E = c.hidden_size, F = c.moe_intermediate_size;
    const bool fp8 = o.fp8_experts;
    const uint64_t wsize = fp8 ? 1 : 2;
    json layout;
    uint64_t cursor = 0;
    struct Part {
        const char* key;
        std::vector<int64_t> shape;
        bool scale;
        uint64_t offset;
    };
    std::vector<Part> parts = {
        {"gate", {F, E}, false, 0}, {"up", {F, E}, false, 0}, {"down", {E, F}, false, 0}};
    if (fp8) {
        parts.push_back({"gate_scale", {F}, true, 0});
        parts.push_back({"up_scale", {F}, true, 0});
        parts.push_back({"down_scale", {E}, true, 0});
    }
    for (auto& part : parts) {
        cursor = align_up(cursor, mds::mds_expert_part_alignment);
        part.offset = cursor;
        uint64_t n = 1;
        for (auto d : part.shape) n *= static_cast<uint64_t>(d);
        cursor += n * (part.scale ? 4 : wsize);
        layout[part.key] = {{"offset", part.offset},
                            {"dtype", part.scale ? "f32" : (fp8 ? "f8_e4m3" : "bf16")},
                            {"shape", part.shape}};
    }
    const uint64_t blob_nbytes = cursor;
    struct Blob {
        int64_t layer, expert;
        std::vector<uint8_t> bytes;
    };
    std::vector<Blob> blobs;
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
        if (!c.is_moe_layer(l)) continue;
        for (int64_t e = 0; e < c.n_routed_experts; ++e) {
            std::vector<uint8_t> blob(blob_nbytes, 0);
            for (const auto& part : parts) {
                uint64_t n = 1;
                for (auto d : part.shape) n *= static_cast<uint64_t>(d);
                std::vector<uint8_t> b = part.scale ? random_scales(n, rng)
                                         : fp8      ? random_e4m3(n, rng)
                                                    : random_bf16(n, rng);
                std::memcpy(blob.data() + part.offset, b.data(), b.size());
            }
            blobs.push_back({l, e, std::move(blob)});
        }
    }

    // Offsets depend on data_offset, which depends on the manifest's length: place, dump, and
    // repeat until the manifest (plus slack for tests that edit it) fits.
    f.data_offset = mds::mds_alignment;
    for (;;) {
        uint64_t off = f.data_offset;
        json table = json::array();
        f.payloads.clear();
        for (const auto& t : tensors) {
            table.push_back({{"name", t.name},
                             {"dtype", "bf16"},
                             {"shape", t.shape},
                             {"offset", off},
                             {"nbytes", t.bytes.size()},
                             {"xxh3", hex16(XXH3_64bits(t.bytes.data(), t.bytes.size()))}});
            f.payloads.push_back({off, t.bytes});
            off = align_up(off + t.bytes.size(), mds::mds_alignment);
        }
        json blob_table = json::array();
        for (const auto& b : blobs) {
            blob_table.push_back({{"layer", b.layer},
                                  {"expert", b.expert},
                                  {"offset", off},
                                  {"xxh3", hex16(XXH3_64bits(b.bytes.data(), b.bytes.size()))}});
            f.payloads.push_back({off, b.bytes});
            off = align_up(off + b.bytes.size(), mds::mds_alignment);
        }
        f.manifest = {{"format", "minids"},
                      {"version", mds::mds_version},
                      {"config", config_to_json(c)},
                      {"tokenizer", test_tokenizer_json()},
                      {"tensors", table},
                      {"experts",
                       {{"dtype", fp8 ? "f8_e4m3" : "bf16"},
                        {"n_embd", E},
                        {"n_ff", F},
                        {"layout", layout},
                        {"blob_nbytes", blob_nbytes},
                        {"blobs", blob_table}}},
                      {"provenance",
                       {{"tool", "minids test helper"},
                        {"tool_version", "0"},
                        {"source", "tests/mds_test_file.cpp"},
                        {"expert_dtype", fp8 ? "f8_e4m3" : "bf16"},
                        {"synthetic", true},
                        {"seed", o.seed}}}};
        if (blobs.empty()) f.manifest["experts"] = nullptr;  // a dense-only model
        uint64_t need = align_up(sizeof(mds::mds_preamble) + f.manifest.dump().size() + 2048,
                                 mds::mds_alignment);
        if (need <= f.data_offset) break;
        f.data_offset = need;
    }
    return f;
}

std::string MdsTestFile::manifest_bytes() const {
    return manifest_text.empty() ? manifest.dump() : manifest_text;
}

std::vector<uint8_t> MdsTestFile::bytes() const {
    const std::string text = manifest_bytes();
    const uint64_t header = sizeof(mds::mds_preamble);
    if (header + text.size() > data_offset)
        throw std::runtime_error(
            "mds_test_file: the edited manifest no longer fits before data_offset");
    uint64_t end = data_offset;
    for (const auto& p : payloads) end = std::max<uint64_t>(end, p.offset + p.bytes.size());
    std::vector<uint8_t> out(align_up(end, mds::mds_alignment), 0);
    mds::mds_preamble pre{};
    std::memcpy(pre.magic, mds::mds_magic, 8);
    pre.version = mds::mds_version;
    pre.flags = 0;
    pre.manifest_len = text.size();
    pre.data_offset = data_offset;
    pre.manifest_xxh3 = XXH3_64bits(text.data(), text.size());
    std::memcpy(out.data(), &pre, sizeof pre);
    refresh_preamble_checksum(out);
    std::memcpy(out.data() + header, text.data(), text.size());
    for (const auto& p : payloads)
        std::memcpy(out.data() + p.offset, p.bytes.data(), p.bytes.size());
    return out;
}

void MdsTestFile::write(const std::filesystem::path& path) const { write_file(path, bytes()); }

void write_file(const std::filesystem::path& path, const std::vector<uint8_t>& bytes) {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(bytes.data()),
              static_cast<std::streamsize>(bytes.size()));
    if (!out) throw std::runtime_error("mds_test_file: cannot write " + path.string());
}

void put_u32(std::vector<uint8_t>& bytes, size_t offset, uint32_t value) {
    std::memcpy(bytes.data() + offset, &value, 4);
}

void put_u64(std::vector<uint8_t>& bytes, size_t offset, uint64_t value) {
    std::memcpy(bytes.data() + offset, &value, 8);
}

uint64_t get_u64(const std::vector<uint8_t>& bytes, size_t offset) {
    uint64_t v;
    std::memcpy(&v, bytes.data() + offset, 8);
    return v;
}

void refresh_preamble_checksum(std::vector<uint8_t>& bytes) {
    put_u64(bytes, offsetof(mds::mds_preamble, preamble_xxh3),
            XXH3_64bits(bytes.data(), offsetof(mds::mds_preamble, preamble_xxh3)));
}

}  // namespace minids::test
