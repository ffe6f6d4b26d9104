#include "mds_malformed_cases.h"

#include <cstring>
#include <stdexcept>

#include "mds/format.h"

namespace minids::test {

using nlohmann::json;

namespace {

constexpr size_t off_version = offsetof(mds::mds_preamble, version);
constexpr size_t off_flags = offsetof(mds::mds_preamble, flags);
constexpr size_t off_manifest_len = offsetof(mds::mds_preamble, manifest_len);
constexpr size_t off_data_offset = offsetof(mds::mds_preamble, data_offset);

json& tensor(MdsTestFile& f, const std::string& name) {
    for (auto& t : f.manifest["tensors"])
        if (t["name"] == name) return t;
    throw std::runtime_error("mds_malformed_cases: no tensor " + name);
}

json& blobs(MdsTestFile& f) { return f.manifest["experts"]["blobs"]; }

std::string replace_once(std::string text, const std::string& from, const std::string& to) {
    auto pos = text.find(from);
    if (pos == std::string::npos)
        throw std::runtime_error("mds_malformed_cases: no '" + from + "'");
    return text.replace(pos, from.size(), to);
}

std::vector<uint8_t> truncated(MdsTestFile& f, uint64_t size) {
    auto b = f.bytes();
    b.resize(size);
    return b;
}

// Edits the preamble and keeps its own checksum right, so the field itself is what is judged.
std::vector<uint8_t> preamble_u64(MdsTestFile& f, size_t offset, uint64_t value) {
    auto b = f.bytes();
    put_u64(b, offset, value);
    refresh_preamble_checksum(b);
    return b;
}

std::vector<uint8_t> preamble_u32(MdsTestFile& f, size_t offset, uint32_t value) {
    auto b = f.bytes();
    put_u32(b, offset, value);
    refresh_preamble_checksum(b);
    return b;
}

uint64_t tensor_offset(MdsTestFile& f, const std::string& name) {
    return tensor(f, name)["offset"].get<uint64_t>();
}

// Sets one byte of the serialized file.
std::vector<uint8_t> poke(MdsTestFile& f, uint64_t offset, uint8_t value) {
    auto b = f.bytes();
    b.at(offset) = value;
    return b;
}

using Edit = std::function<void(MdsTestFile&)>;
// A case that edits the manifest and re-serializes it with consistent checksums.
MalformedCase manifest_case(std::string name, Edit edit, std::string expect) {
    return {std::move(name),
            [edit = std::move(edit)](MdsTestFile& f) {
                edit(f);
                return f.bytes();
            },
            std::move(expect), false};
}

const std::string embed = "model.embed_tokens.weight";
const std::string norm = "model.norm.weight";
const std::string q0 = "model.layers.0.self_attn.q_proj.weight";
const std::string gate0 = "model.layers.0.mlp.gate_proj.weight";

}  // namespace

std::vector<MalformedCase> malformed_cases() {
    std::vector<MalformedCase> c;
    // ---- truncation inside each section ----
    c.push_back({"empty", [](MdsTestFile& f) { return truncated(f, 0); }, "preamble"});
    c.push_back(
        {"truncated_preamble", [](MdsTestFile& f) { return truncated(f, 30); }, "preamble"});
    c.push_back({"truncated_manifest", [](MdsTestFile& f) { return truncated(f, 48 + 100); },
                 "manifest_len"});
    c.push_back({"truncated_padding_before_data",
                 [](MdsTestFile& f) { return truncated(f, f.data_offset - 10); }, "data_offset"});
    c.push_back({"truncated_data_mid_page",
                 [](MdsTestFile& f) { return truncated(f, f.data_offset + 4096 + 100); },
                 "file size"});
    c.push_back({"truncated_data_page_boundary",
                 [](MdsTestFile& f) { return truncated(f, f.data_offset + 2 * 4096); },
                 "tensors[2].offset"});
    c.push_back(
        {"truncated_last_blob",
         [](MdsTestFile& f) { return truncated(f, blobs(f).back()["offset"].get<uint64_t>()); },
         "experts.blobs[5].offset"});
    c.push_back({"truncated_last_blob_mid",
                 [](MdsTestFile& f) {
                     return truncated(f, blobs(f).back()["offset"].get<uint64_t>() + 200);
                 },
                 "file size"});
    c.push_back({"trailing_bytes",
                 [](MdsTestFile& f) {
                     auto b = f.bytes();
                     b.resize(b.size() + 7, 0);
                     return b;
                 },
                 "file size"});

    // ---- preamble fields ----
    c.push_back({"bad_magic", [](MdsTestFile& f) { return poke(f, 0, 'm'); }, "magic"});
    c.push_back({"gguf_magic",
                 [](MdsTestFile& f) {
                     auto b = f.bytes();
                     std::memcpy(b.data(), "GGUF\3\0\0\0", 8);
                     return b;
                 },
                 "magic"});
    c.push_back({"future_version", [](MdsTestFile& f) { return preamble_u32(f, off_version, 2); },
                 "written by a newer minids"});
    c.push_back({"version_zero", [](MdsTestFile& f) { return preamble_u32(f, off_version, 0); },
                 "version"});
    c.push_back(
        {"nonzero_flags", [](MdsTestFile& f) { return preamble_u32(f, off_flags, 1); }, "flags"});
    c.push_back(
        {"huge_manifest_len",
         [](MdsTestFile& f) { return preamble_u64(f, off_manifest_len, uint64_t{1} << 40); },
         "manifest_len"});
    c.push_back({"max_manifest_len",
                 [](MdsTestFile& f) { return preamble_u64(f, off_manifest_len, ~uint64_t{0}); },
                 "manifest_len"});
    c.push_back({"zero_manifest_len",
                 [](MdsTestFile& f) { return preamble_u64(f, off_manifest_len, 0); },
                 "manifest_len"});
    c.push_back({"misaligned_data_offset",
                 [](MdsTestFile& f) { return preamble_u64(f, off_data_offset, f.data_offset + 8); },
                 "data_offset"});
    c.push_back({"data_offset_inside_manifest",
                 [](MdsTestFile& f) { return preamble_u64(f, off_data_offset, 0); },
                 "data_offset"});
    c.push_back({"data_offset_past_end",
                 [](MdsTestFile& f) { return preamble_u64(f, off_data_offset, uint64_t{1} << 50); },
                 "data_offset"});
    c.push_back({"preamble_checksum",
                 [](MdsTestFile& f) {
                     auto b = f.bytes();
                     b[off_manifest_len] ^= 1;  // without refreshing preamble_xxh3
                     return b;
                 },
                 "preamble_xxh3"});
    c.push_back({"manifest_checksum",
                 [](MdsTestFile& f) {
                     auto b = f.bytes();
                     b[48 + 20] ^= 0x20;
                     return b;
                 },
                 "manifest_xxh3"});

    // ---- JSON syntax, duplicate keys, types, unknown keys ----
    c.push_back(manifest_case(
        "json_syntax",
        [](MdsTestFile& f) {
            std::string t = f.manifest.dump();
            f.manifest_text = t.substr(0, t.size() - 1);
        },
        "valid JSON"));
    c.push_back(manifest_case(
        "json_bad_utf8",
        [](MdsTestFile& f) {
            f.manifest_text =
                replace_once(f.manifest.dump(), "minids test helper", "minids \xff\xfe helper");
        },
        "valid JSON"));
    c.push_back(manifest_case(
        "duplicate_top_key",
        [](MdsTestFile& f) {
            f.manifest_text = replace_once(f.manifest.dump(), "{", "{\"format\":\"minids\",");
        },
        "\"format\" twice"));
    c.push_back(manifest_case(
        "duplicate_nested_key",
        [](MdsTestFile& f) {
            f.manifest_text = replace_once(f.manifest.dump(), "\"name\":\"model.norm.weight\"",
                                           "\"name\":\"model.norm.weight\",\"nbytes\":48");
        },
        "\"nbytes\" twice"));
    c.push_back(manifest_case(
        "duplicate_config_key",
        [](MdsTestFile& f) {
            f.manifest_text = replace_once(f.manifest.dump(), "\"hidden_size\":24",
                                           "\"hidden_size\":24,\"hidden_size\":32");
        },
        "\"hidden_size\" twice"));
    c.push_back(manifest_case(
        "deep_nesting",
        [](MdsTestFile& f) {
            f.manifest_text =
                replace_once(f.manifest.dump(), "\"tool_version\":\"0\"",
                             "\"tool_version\":" + std::string(900, '[') + std::string(900, ']'));
        },
        "nesting"));
    c.push_back(manifest_case(
        "not_an_object", [](MdsTestFile& f) { f.manifest_text = "[1,2,3]"; }, "manifest"));
    c.push_back(manifest_case(
        "version_string", [](MdsTestFile& f) { f.manifest["version"] = "1"; }, "version"));
    c.push_back(manifest_case(
        "manifest_version_2", [](MdsTestFile& f) { f.manifest["version"] = 2; }, "version"));
    c.push_back(manifest_case(
        "format_name", [](MdsTestFile& f) { f.manifest["format"] = "gguf"; }, "format"));
    c.push_back(manifest_case(
        "unknown_top_key", [](MdsTestFile& f) { f.manifest["extras"] = 1; }, "extras"));
    c.push_back(manifest_case(
        "missing_tokenizer", [](MdsTestFile& f) { f.manifest.erase("tokenizer"); }, "tokenizer"));
    c.push_back(manifest_case(
        "tensors_not_array", [](MdsTestFile& f) { f.manifest["tensors"] = json::object(); },
        "tensors"));
    c.push_back(manifest_case(
        "shape_dim_string", [](MdsTestFile& f) { f.manifest["tensors"][2]["shape"][0] = "96"; },
        "tensors[2].shape[0]"));
    c.push_back(manifest_case(
        "config_float_size", [](MdsTestFile& f) { f.manifest["config"]["hidden_size"] = 24.5; },
        "\"hidden_size\": expected an integer"));
    c.push_back(manifest_case(
        "config_unknown_key", [](MdsTestFile& f) { f.manifest["config"]["hidden_sizes"] = 24; },
        "\"hidden_sizes\""));
    c.push_back(manifest_case(
        "tokenizer_vocab_type", [](MdsTestFile& f) { f.manifest["tokenizer"]["vocab"][3] = 7; },
        "\"vocab\"[3]"));
    c.push_back(manifest_case(
        "tokenizer_added_id_past_vocab",
        [](MdsTestFile& f) { f.manifest["tokenizer"]["added_tokens"][0]["id"] = 40; },
        "added token \"<|bos|>\" has id 40"));
    c.push_back(manifest_case(
        "tokenizer_bos_past_vocab", [](MdsTestFile& f) { f.manifest["tokenizer"]["bos_id"] = 99; },
        "bos id 99"));
    c.push_back(manifest_case(
        "config_topk_method",
        [](MdsTestFile& f) { f.manifest["config"]["topk_method"] = "noaux_tc"; },
        "\"topk_method\": expected"));
    c.push_back(manifest_case(
        "provenance_nested",
        [](MdsTestFile& f) {
            f.manifest["provenance"]["nested"] = json::object({{"a", 1}});
        },
        "provenance.nested"));
    c.push_back(manifest_case(
        "xxh3_not_hex",
        [](MdsTestFile& f) { f.manifest["tensors"][0]["xxh3"] = "0123456789ABCDEF"; },
        "tensors[0].xxh3"));
    c.push_back(manifest_case(
        "tensor_unknown_key",
        [](MdsTestFile& f) { f.manifest["tensors"][1]["stride"] = json::array({1}); },
        "tensors[1].stride"));

    // ---- tensor table: names, dtypes, shapes, sizes, offsets ----
    c.push_back(manifest_case(
        "unknown_dtype", [](MdsTestFile& f) { tensor(f, embed)["dtype"] = "q4_0"; },
        "tensors[0].dtype"));
    c.push_back(manifest_case(
        "rank_5",
        [](MdsTestFile& f) {
            tensor(f, norm)["shape"] = json::array({1, 1, 1, 1, 24});
        },
        "shape"));
    c.push_back(manifest_case(
        "rank_0", [](MdsTestFile& f) { tensor(f, norm)["shape"] = json::array(); }, "shape"));
    c.push_back(manifest_case(
        "zero_dim",
        [](MdsTestFile& f) {
            tensor(f, embed)["shape"] = {40, 0};
        },
        "tensors[0].shape[1]"));
    c.push_back(manifest_case(
        "negative_dim",
        [](MdsTestFile& f) {
            tensor(f, embed)["shape"] = {-40, 24};
        },
        "tensors[0].shape[0]"));
    c.push_back(manifest_case(
        "huge_dim",
        [](MdsTestFile& f) {
            tensor(f, embed)["shape"] = {uint64_t{1} << 62, 24};
        },
        "tensors[0].shape[0]"));
    c.push_back(manifest_case(
        "overflowing_shape",
        [](MdsTestFile& f) {
            tensor(f, embed)["shape"] = {uint64_t{1} << 40, uint64_t{1} << 40, uint64_t{1} << 40};
        },
        "overflows"));
    c.push_back(manifest_case(
        "overflowing_bytes",
        [](MdsTestFile& f) {
            tensor(f, embed)["shape"] = {uint64_t{1} << 32,
                                         uint64_t{1} << 31};  // 2^63 elements x 2
        },
        "size overflows"));
    c.push_back(manifest_case(
        "nbytes_mismatch", [](MdsTestFile& f) { tensor(f, norm)["nbytes"] = 50; }, "nbytes"));
    c.push_back(manifest_case(
        "dtype_shape_mismatch", [](MdsTestFile& f) { tensor(f, norm)["dtype"] = "f32"; },
        "nbytes"));
    c.push_back(manifest_case(
        "huge_nbytes", [](MdsTestFile& f) { tensor(f, norm)["nbytes"] = ~uint64_t{0}; }, "nbytes"));
    c.push_back(manifest_case(
        "misaligned_offset",
        [](MdsTestFile& f) { tensor(f, q0)["offset"] = tensor_offset(f, q0) + 16; },
        "offset: expected a multiple of 4096"));
    c.push_back(manifest_case(
        "offset_past_end", [](MdsTestFile& f) { tensor(f, norm)["offset"] = uint64_t{1} << 40; },
        "past the end"));
    c.push_back(manifest_case(
        "offset_wraps", [](MdsTestFile& f) { tensor(f, norm)["offset"] = ~uint64_t{0} - 4095; },
        "past the end"));
    c.push_back(manifest_case(
        "offset_before_data", [](MdsTestFile& f) { tensor(f, norm)["offset"] = 0; },
        "data_offset"));
    c.push_back(manifest_case(
        "offset_negative", [](MdsTestFile& f) { tensor(f, norm)["offset"] = -4096; }, "offset"));
    c.push_back(manifest_case(
        "overlapping_tensors",
        [](MdsTestFile& f) { tensor(f, q0)["offset"] = tensor_offset(f, embed); }, "overlap"));
    c.push_back(manifest_case(
        "tensor_overlaps_blob",
        [](MdsTestFile& f) { tensor(f, norm)["offset"] = blobs(f)[2]["offset"]; }, "overlap"));
    c.push_back(manifest_case(
        "duplicate_tensor_name",
        [](MdsTestFile& f) { f.manifest["tensors"][5]["name"] = f.manifest["tensors"][4]["name"]; },
        "tensors[5].name"));
    c.push_back(manifest_case(
        "missing_required_tensor",
        [](MdsTestFile& f) {
            auto& t = f.manifest["tensors"];
            for (size_t i = 0; i < t.size(); ++i)
                if (t[i]["name"] == norm) t.erase(i);
        },
        "model.norm.weight"));
    c.push_back(manifest_case(
        "unexpected_tensor",
        [](MdsTestFile& f) {
            json extra = tensor(f, norm);
            extra["name"] = "model.layers.1.mlp.experts.0.gate_proj.weight";
            extra["offset"] = f.payloads.back().offset + 4096;
            f.payloads.push_back({extra["offset"].get<uint64_t>(), std::vector<uint8_t>(48, 1)});
            f.manifest["tensors"].push_back(extra);
        },
        "experts.0.gate_proj"));
    c.push_back(manifest_case(
        "dense_tensor_int_dtype", [](MdsTestFile& f) { tensor(f, norm)["dtype"] = "i32"; },
        "nbytes"));

    // ---- config disagreeing with the tensors ----
    c.push_back(manifest_case(
        "config_intermediate_size",
        [](MdsTestFile& f) { f.manifest["config"]["intermediate_size"] = 41; },
        "model.layers.0.mlp.gate_proj.weight).shape"));
    c.push_back(manifest_case(
        "config_vocab_size", [](MdsTestFile& f) { f.manifest["config"]["vocab_size"] = 41; },
        "model.embed_tokens.weight).shape"));
    c.push_back(manifest_case(
        "config_q_lora_rank", [](MdsTestFile& f) { f.manifest["config"]["q_lora_rank"] = 16; },
        "q_a_proj"));
    c.push_back(manifest_case(
        "config_heads", [](MdsTestFile& f) { f.manifest["config"]["num_attention_heads"] = 3; },
        "q_proj.weight).shape"));
    c.push_back(manifest_case(
        "config_hidden_size", [](MdsTestFile& f) { f.manifest["config"]["hidden_size"] = 25; },
        "experts.n_embd"));
    c.push_back(manifest_case(
        "config_first_dense",
        [](MdsTestFile& f) { f.manifest["config"]["first_k_dense_replace"] = 2; },
        "experts.blobs"));
    c.push_back(manifest_case(
        "config_huge_layers",
        [](MdsTestFile& f) { f.manifest["config"]["num_hidden_layers"] = uint64_t{1} << 40; },
        "\"num_hidden_layers\": expected"));
    c.push_back(manifest_case(
        "config_k_above_experts",
        [](MdsTestFile& f) { f.manifest["config"]["num_experts_per_tok"] = 4; },
        "\"num_experts_per_tok\": expected"));
    c.push_back(manifest_case(
        "config_rope_scaling_type",
        [](MdsTestFile& f) { f.manifest["config"]["rope_scaling"]["factor"] = "40"; },
        "\"factor\": expected a number"));

    // ---- expert table ----
    c.push_back(manifest_case(
        "experts_missing", [](MdsTestFile& f) { f.manifest.erase("experts"); }, "experts"));
    c.push_back(manifest_case(
        "experts_dtype", [](MdsTestFile& f) { f.manifest["experts"]["dtype"] = "f32"; },
        "experts.dtype"));
    c.push_back(manifest_case(
        "experts_blob_missing", [](MdsTestFile& f) { blobs(f).erase(3); }, "experts.blobs"));
    c.push_back(manifest_case(
        "experts_blob_order",
        [](MdsTestFile& f) {
            blobs(f)[1]["expert"] = 2;
            blobs(f)[2]["expert"] = 1;
        },
        "experts.blobs[1]"));
    c.push_back(manifest_case(
        "experts_blob_huge_layer", [](MdsTestFile& f) { blobs(f)[0]["layer"] = uint64_t{1} << 62; },
        "experts.blobs[0]"));
    c.push_back(manifest_case(
        "experts_blob_misaligned",
        [](MdsTestFile& f) { blobs(f)[0]["offset"] = blobs(f)[0]["offset"].get<uint64_t>() + 256; },
        "experts.blobs[0].offset"));
    c.push_back(manifest_case(
        "experts_not_adjacent",
        [](MdsTestFile& f) { std::swap(blobs(f)[0]["offset"], blobs(f)[1]["offset"]); },
        "experts.blobs[1].offset"));
    c.push_back(manifest_case(
        "experts_blobs_overlap_layers",
        [](MdsTestFile& f) {
            for (size_t i = 3; i < 6; ++i) blobs(f)[i]["offset"] = blobs(f)[i - 3]["offset"];
        },
        "overlap"));
    c.push_back(manifest_case(
        "experts_huge_blob_nbytes",
        [](MdsTestFile& f) { f.manifest["experts"]["blob_nbytes"] = uint64_t{1} << 60; },
        "experts.blob_nbytes"));
    c.push_back(manifest_case(
        "experts_blob_nbytes_slack",
        [](MdsTestFile& f) {
            auto& e = f.manifest["experts"];
            e["blob_nbytes"] = e["blob_nbytes"].get<uint64_t>() + 256;
        },
        "experts.blob_nbytes: expected 2144"));
    c.push_back(manifest_case(
        "experts_part_outside_blob",
        [](MdsTestFile& f) {
            auto& e = f.manifest["experts"];
            e["layout"]["down_scale"]["offset"] =
                (e["blob_nbytes"].get<uint64_t>() / 256 + 1) * 256;
        },
        "experts.layout.down_scale.offset"));
    c.push_back(manifest_case(
        "experts_parts_overlap",
        [](MdsTestFile& f) { f.manifest["experts"]["layout"]["up"]["offset"] = 0; }, "overlap"));
    c.push_back(manifest_case(
        "experts_part_misaligned",
        [](MdsTestFile& f) { f.manifest["experts"]["layout"]["up"]["offset"] = 100; },
        "experts.layout.up.offset"));
    c.push_back(manifest_case(
        "experts_part_shape",
        [](MdsTestFile& f) {
            f.manifest["experts"]["layout"]["gate"]["shape"] = {24, 12};
        },
        "experts.layout.gate.shape"));
    c.push_back(manifest_case(
        "experts_part_dtype",
        [](MdsTestFile& f) { f.manifest["experts"]["layout"]["gate_scale"]["dtype"] = "bf16"; },
        "experts.layout.gate_scale.dtype"));
    c.push_back(manifest_case(
        "experts_missing_scale",
        [](MdsTestFile& f) { f.manifest["experts"]["layout"].erase("up_scale"); },
        "experts.layout.up_scale"));
    c.push_back(manifest_case(
        "experts_n_ff", [](MdsTestFile& f) { f.manifest["experts"]["n_ff"] = 13; },
        "experts.n_ff"));

    // ---- data: open() succeeds (it reads no data), verify() must catch these ----
    c.push_back({"tensor_byte_changed",
                 [](MdsTestFile& f) {
                     auto b = f.bytes();
                     b[tensor_offset(f, gate0) + 17] ^= 0x04;
                     return b;
                 },
                 "tensor model.layers.0.mlp.gate_proj.weight: expected checksum", true});
    c.push_back({"blob_byte_changed",
                 [](MdsTestFile& f) {
                     auto b = f.bytes();
                     b[blobs(f)[4]["offset"].get<uint64_t>() + 300] ^= 0x80;
                     return b;
                 },
                 "expert blob layer 2 expert 1", true});
    c.push_back(manifest_case(
        "tensor_checksum_field",
        [](MdsTestFile& f) { tensor(f, norm)["xxh3"] = "0123456789abcdef"; },
        "tensor model.norm.weight: expected checksum"));
    c.back().open_ok = true;
    c.push_back({"padding_after_manifest",
                 [](MdsTestFile& f) { return poke(f, f.data_offset - 1, 1); }, "padding", true});
    c.push_back({"padding_between_tensors",
                 [](MdsTestFile& f) { return poke(f, tensor_offset(f, embed) + 4095, 0x20); },
                 "padding", true});
    c.push_back({"padding_at_end",
                 [](MdsTestFile& f) {
                     auto b = f.bytes();
                     b.back() = 0xff;
                     return b;
                 },
                 "padding", true});
    return c;
}

}  // namespace minids::test
