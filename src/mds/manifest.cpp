// The manifest: JSON syntax and types, the tensor table and the expert table against the data
// region, overlaps, and the tensors the config requires (model_tensors.cpp).
#include "mds/manifest.h"

#include <algorithm>
#include <string>
#include <unordered_map>
#include <vector>

#include "mds/manifest_config.h"
#include "mds/model_tensors.h"
#include "util/json_fields.h"
#include "util/strict_json.h"

namespace minids::mds {

using nlohmann::json;

namespace {

// Deepest nesting the manifest may use (its real depth is 4); deeper input is refused while
// parsing, before anything recursive walks it.
constexpr int manifest_max_depth = 16;

FieldReader reader(const std::string& file, std::string path) {
    return FieldReader(file, std::move(path), throw_as<FileError>);
}

json parse_manifest_json(std::string_view text, const std::string& file) {
    try {
        return parse_json_strict(text, manifest_max_depth);
    } catch (const JsonSyntaxError& e) {
        fail(file, "manifest", e.expected, e.found);
    }
}

// Largest single dimension accepted; products are checked for overflow separately.
constexpr int64_t max_shape_dim = int64_t{1} << 40;

std::string shape_string(const std::vector<int64_t>& shape) {
    std::string s = "[";
    for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
    return s + "]";
}

struct Extent {
    uint64_t begin = 0, end = 0;
    std::string what;  // "tensors[3] (model.norm.weight)"
};

// Shape [d0, ..., dn] with 1 <= rank <= 4 and every dim >= 1; returns the byte size of `type`
// elements, with overflow checks.
uint64_t read_shape(const FieldReader& r, const json& obj, mgl::dtype type,
                    std::vector<int64_t>& shape) {
    const json& dims = r.array(obj, "shape");
    if (dims.empty() || dims.size() > static_cast<size_t>(mds_max_dims))
        r.fail(r.field("shape"), "1 to " + std::to_string(mds_max_dims) + " dimensions",
               std::to_string(dims.size()) + " dimensions");
    uint64_t elements = 1;
    shape.clear();
    for (size_t d = 0; d < dims.size(); ++d) {
        std::string name = r.field("shape") + "[" + std::to_string(d) + "]";
        int64_t n = r.as_i64(dims[d], name, 1, max_shape_dim);
        shape.push_back(n);
        if (__builtin_mul_overflow(elements, static_cast<uint64_t>(n), &elements))
            r.fail(r.field("shape"), "an element count below 2^64",
                   shape_string(shape) + "... (the element count overflows)");
    }
    uint64_t bytes = 0;
    if (__builtin_mul_overflow(elements, manifest_dtype_size(type), &bytes))
        r.fail(r.field("shape"), "a byte size below 2^64",
               shape_string(shape) + " of " + manifest_dtype_name(type) + " (the size overflows)");
    return bytes;
}

mgl::dtype read_dtype(const FieldReader& r, const json& obj) {
    const std::string& name = r.string(obj, "dtype");
    mgl::dtype t{};
    if (!dtype_from_manifest_name(name, t))
        r.fail(r.field("dtype"), "one of f32, f16, bf16, f8_e4m3, i32",
               describe_json(obj.at("dtype")));
    return t;
}

// offset: 4096-aligned, [offset, offset + nbytes) inside the data region.
void check_placement(const FieldReader& r, uint64_t offset, uint64_t nbytes,
                     const FileExtent& extent) {
    if (offset % mds_alignment != 0)
        r.fail(r.field("offset"), "a multiple of " + std::to_string(mds_alignment),
               std::to_string(offset));
    if (offset < extent.data_offset)
        r.fail(r.field("offset"),
               "at least data_offset " + std::to_string(extent.data_offset) +
                   " (inside the data region)",
               std::to_string(offset));
    if (nbytes > extent.file_size || offset > extent.file_size - nbytes)
        r.fail(r.field("offset"),
               "the range [offset, offset + " + std::to_string(nbytes) +
                   ") to end within the file of " + std::to_string(extent.file_size) + " bytes",
               std::to_string(offset) +
                   " (past the end: the file is truncated or the offset is wrong)");
}

std::vector<TensorEntry> parse_tensor_table(const json& tensors, const FileExtent& extent,
                                            const std::string& file, std::vector<Extent>& extents) {
    std::vector<TensorEntry> out;
    out.reserve(tensors.size());
    std::unordered_map<std::string, size_t> seen;
    for (size_t i = 0; i < tensors.size(); ++i) {
        const FieldReader r = reader(file, "tensors[" + std::to_string(i) + "]");
        const json& t = tensors[i];
        r.expect_object(t, {"name", "dtype", "shape", "offset", "nbytes", "xxh3"});
        TensorEntry e;
        e.name = r.string(t, "name");
        if (e.name.empty() || e.name.size() > 256)
            r.fail(r.field("name"), "a tensor name of 1 to 256 bytes", describe_json(t["name"]));
        auto [it, inserted] = seen.emplace(e.name, i);
        if (!inserted)
            r.fail(r.field("name"), "a name used by no other tensor",
                   "\"" + e.name + "\", already the name of tensors[" + std::to_string(it->second) +
                       "]");
        e.dtype = read_dtype(r, t);
        uint64_t expected_bytes = read_shape(r, t, e.dtype, e.shape);
        e.nbytes = r.u64(t, "nbytes");
        if (e.nbytes != expected_bytes)
            r.fail(r.field("nbytes"),
                   std::to_string(expected_bytes) + " (shape " + shape_string(e.shape) + " of " +
                       manifest_dtype_name(e.dtype) + ")",
                   std::to_string(e.nbytes));
        e.offset = r.u64(t, "offset");
        check_placement(r, e.offset, e.nbytes, extent);
        e.xxh3 = r.hex64(t, "xxh3");
        extents.push_back({e.offset, e.offset + e.nbytes, r.path() + " (" + e.name + ")"});
        out.push_back(std::move(e));
    }
    return out;
}

ExpertPart read_part(const FieldReader& layout_reader, const json& layout, std::string_view key,
                     mgl::dtype want_type, std::vector<int64_t> want_shape, uint64_t& part_bytes) {
    const FieldReader r = layout_reader.nested(key);
    const json& p = layout_reader.object(layout, key);
    r.expect_object(p, {"offset", "dtype", "shape"});
    ExpertPart part;
    part.offset = r.u64(p, "offset");
    if (part.offset % mds_expert_part_alignment != 0)
        r.fail(r.field("offset"), "a multiple of " + std::to_string(mds_expert_part_alignment),
               std::to_string(part.offset));
    part.dtype = read_dtype(r, p);
    if (part.dtype != want_type)
        r.fail(r.field("dtype"), manifest_dtype_name(want_type), manifest_dtype_name(part.dtype));
    part_bytes = read_shape(r, p, part.dtype, part.shape);
    if (part.shape != want_shape)
        r.fail(r.field("shape"), shape_string(want_shape) + " (from experts.n_embd and n_ff)",
               shape_string(part.shape));
    return part;
}

ExpertTable parse_expert_table(const json& j, const ModelConfig& config, const FileExtent& extent,
                               const std::string& file, std::vector<Extent>& extents) {
    ExpertTable table;
    int64_t n_moe_layers = 0;
    for (int64_t l = 0; l < config.num_hidden_layers; ++l) n_moe_layers += config.is_moe_layer(l);
    if (j.is_null()) {
        if (n_moe_layers > 0)
            fail(file, "experts",
                 "an expert table (the config has " + std::to_string(n_moe_layers) +
                     " MoE layers of " + std::to_string(config.n_routed_experts) + " experts)",
                 "none");
        return table;
    }
    const FieldReader r = reader(file, "experts");
    r.expect_object(j, {"dtype", "n_embd", "n_ff", "layout", "blob_nbytes", "blobs"});
    if (n_moe_layers == 0)
        r.fail("experts", "no expert table (the config has no MoE layers)", "an expert table");
    table.present = true;
    table.dtype = read_dtype(r, j);
    if (table.dtype != mgl::dtype::f8_e4m3 && table.dtype != mgl::dtype::bf16)
        r.fail(r.field("dtype"), "f8_e4m3 or bf16", manifest_dtype_name(table.dtype));
    table.n_embd = r.i64(j, "n_embd", 1, max_shape_dim);
    table.n_ff = r.i64(j, "n_ff", 1, max_shape_dim);
    if (table.n_embd != config.hidden_size)
        r.fail(r.field("n_embd"), std::to_string(config.hidden_size) + " (config.hidden_size)",
               std::to_string(table.n_embd));
    if (table.n_ff != config.moe_intermediate_size)
        r.fail(r.field("n_ff"),
               std::to_string(config.moe_intermediate_size) + " (config.moe_intermediate_size)",
               std::to_string(table.n_ff));
    table.blob_nbytes = r.u64(j, "blob_nbytes");
    if (table.blob_nbytes == 0 || table.blob_nbytes > extent.file_size)
        r.fail(r.field("blob_nbytes"),
               "between 1 and the file size " + std::to_string(extent.file_size),
               std::to_string(table.blob_nbytes));

    // Layout: parts inside the blob, not overlapping.
    const bool fp8 = table.dtype == mgl::dtype::f8_e4m3;
    const json& layout = r.object(j, "layout");
    const FieldReader lr = r.nested("layout");
    if (fp8)
        lr.expect_object(layout, {"gate", "up", "down", "gate_scale", "up_scale", "down_scale"});
    else
        lr.expect_object(layout, {"gate", "up", "down"});
    const int64_t E = table.n_embd, F = table.n_ff;
    struct NamedPart {
        const char* key;
        ExpertPart* part;
        mgl::dtype type;
        std::vector<int64_t> shape;
    };
    std::vector<NamedPart> parts = {{"gate", &table.gate, table.dtype, {F, E}},
                                    {"up", &table.up, table.dtype, {F, E}},
                                    {"down", &table.down, table.dtype, {E, F}}};
    if (fp8) {
        parts.push_back({"gate_scale", &table.gate_scale, mgl::dtype::f32, {F}});
        parts.push_back({"up_scale", &table.up_scale, mgl::dtype::f32, {F}});
        parts.push_back({"down_scale", &table.down_scale, mgl::dtype::f32, {E}});
    }
    std::vector<Extent> part_extents;
    for (auto& np : parts) {
        uint64_t bytes = 0;
        *np.part = read_part(lr, layout, np.key, np.type, np.shape, bytes);
        uint64_t off = np.part->offset;
        if (bytes > table.blob_nbytes || off > table.blob_nbytes - bytes)
            lr.fail(lr.field(np.key) + ".offset",
                    "the part's " + std::to_string(bytes) + " bytes to end within blob_nbytes " +
                        std::to_string(table.blob_nbytes),
                    std::to_string(off));
        part_extents.push_back({off, off + bytes, lr.field(np.key)});
    }
    std::sort(part_extents.begin(), part_extents.end(),
              [](const Extent& a, const Extent& b) { return a.begin < b.begin; });
    for (size_t i = 1; i < part_extents.size(); ++i)
        if (part_extents[i].begin < part_extents[i - 1].end)
            fail(file, part_extents[i].what + ".offset",
                 "a part that does not overlap " + part_extents[i - 1].what + " (which ends at " +
                     std::to_string(part_extents[i - 1].end) + ")",
                 std::to_string(part_extents[i].begin));

    // format.h: blob_nbytes is the layout's extent, so nothing unlisted rides along in a blob.
    uint64_t extent_end = 0;
    for (const auto& e : part_extents) extent_end = std::max(extent_end, e.end);
    if (table.blob_nbytes != extent_end)
        r.fail(r.field("blob_nbytes"),
               std::to_string(extent_end) + " (the end of the layout's last part)",
               std::to_string(table.blob_nbytes));

    // Blobs: every (MoE layer, expert) once, in order, each layer's experts adjacent.
    const json& blobs = r.array(j, "blobs");
    uint64_t expected_count = 0;
    if (__builtin_mul_overflow(static_cast<uint64_t>(n_moe_layers),
                               static_cast<uint64_t>(config.n_routed_experts), &expected_count) ||
        blobs.size() != expected_count)
        r.fail(r.field("blobs"),
               std::to_string(expected_count) + " blobs (" + std::to_string(n_moe_layers) +
                   " MoE layers x " + std::to_string(config.n_routed_experts) + " experts)",
               std::to_string(blobs.size()) + " blobs");
    const uint64_t stride = (table.blob_nbytes + mds_alignment - 1) / mds_alignment * mds_alignment;
    table.blobs.reserve(blobs.size());
    int64_t layer = -1, expert = config.n_routed_experts;  // the (layer, expert) before the first
    for (size_t i = 0; i < blobs.size(); ++i) {
        if (expert + 1 < config.n_routed_experts) {
            ++expert;
        } else {
            expert = 0;
            do ++layer;
            while (!config.is_moe_layer(layer));
        }
        const FieldReader br = r.nested("blobs", i);
        const json& b = blobs[i];
        br.expect_object(b, {"layer", "expert", "offset", "xxh3"});
        ExpertBlob blob;
        blob.layer = br.i64(b, "layer", 0, INT64_MAX);
        blob.expert = br.i64(b, "expert", 0, INT64_MAX);
        if (blob.layer != layer || blob.expert != expert)
            br.fail(
                br.path(),
                "layer " + std::to_string(layer) + " expert " + std::to_string(expert) +
                    " (ordered by MoE layer, then expert)",
                "layer " + std::to_string(blob.layer) + " expert " + std::to_string(blob.expert));
        blob.offset = br.u64(b, "offset");
        check_placement(br, blob.offset, table.blob_nbytes, extent);
        if (expert > 0 && blob.offset != table.blobs.back().offset + stride)
            br.fail(br.field("offset"),
                    std::to_string(table.blobs.back().offset + stride) +
                        " (right after the previous expert of layer " + std::to_string(layer) + ")",
                    std::to_string(blob.offset));
        blob.xxh3 = br.hex64(b, "xxh3");
        extents.push_back({blob.offset, blob.offset + table.blob_nbytes,
                           br.path() + " (layer " + std::to_string(layer) + " expert " +
                               std::to_string(expert) + ")"});
        table.blobs.push_back(blob);
    }
    return table;
}

void check_provenance(const json& j, const std::string& file) {
    const FieldReader r = reader(file, "provenance");
    if (!j.is_object()) r.fail("provenance", "an object", describe_json(j));
    for (auto it = j.begin(); it != j.end(); ++it)
        if (!it.value().is_primitive())
            r.fail(r.field(it.key().substr(0, 64)), "a string, number, boolean or null",
                   describe_json(it.value()));
}

}  // namespace

ParsedManifest parse_manifest(std::string_view text, const FileExtent& extent,
                              const std::string& file) {
    ParsedManifest out;
    out.manifest = parse_manifest_json(text, file);
    const json& m = out.manifest;
    const FieldReader r = reader(file, "");
    if (!m.is_object()) fail(file, "manifest", "an object", describe_json(m));
    r.expect_object(
        m, {"format", "version", "config", "tokenizer", "tensors", "experts", "provenance"});
    if (r.string(m, "format") != "minids")
        r.fail("format", "\"minids\"", describe_json(m["format"]));
    int64_t version = r.i64(m, "version", 0, INT64_MAX);
    if (version != static_cast<int64_t>(mds_version))
        r.fail("version", std::to_string(mds_version) + " (the preamble's version)",
               std::to_string(version));

    out.config = parse_manifest_config(r.required(m, "config"), file);
    out.tokenizer = parse_manifest_tokenizer(r.required(m, "tokenizer"), file);
    if (static_cast<int64_t>(out.tokenizer.vocab.size()) > out.config.vocab_size)
        fail(file, "tokenizer.vocab",
             "at most config.vocab_size (" + std::to_string(out.config.vocab_size) + ") tokens",
             std::to_string(out.tokenizer.vocab.size()) + " tokens");
    for (size_t i = 0; i < out.tokenizer.added_tokens.size(); ++i)
        if (out.tokenizer.added_tokens[i].id >= out.config.vocab_size)
            fail(file, "tokenizer.added_tokens[" + std::to_string(i) + "].id",
                 "an id below config.vocab_size (" + std::to_string(out.config.vocab_size) + ")",
                 std::to_string(out.tokenizer.added_tokens[i].id));
    for (const auto& [key, id] : {std::pair{"tokenizer.bos_id", out.tokenizer.bos_id},
                                  std::pair{"tokenizer.eos_id", out.tokenizer.eos_id}})
        if (id && *id >= out.config.vocab_size)
            fail(file, key,
                 "an id below config.vocab_size (" + std::to_string(out.config.vocab_size) + ")",
                 std::to_string(*id));
    check_provenance(r.required(m, "provenance"), file);

    std::vector<Extent> extents;
    out.tensors = parse_tensor_table(r.array(m, "tensors"), extent, file, extents);
    const json* experts = r.optional(m, "experts");
    static const json null_value;
    out.experts =
        parse_expert_table(experts ? *experts : null_value, out.config, extent, file, extents);

    std::sort(extents.begin(), extents.end(),
              [](const Extent& a, const Extent& b) { return a.begin < b.begin; });
    for (size_t i = 1; i < extents.size(); ++i)
        if (extents[i].begin < extents[i - 1].end)
            fail(file, extents[i].what + ".offset",
                 "a range that does not overlap " + extents[i - 1].what + " (which ends at " +
                     std::to_string(extents[i - 1].end) + ")",
                 std::to_string(extents[i].begin));

    check_model_tensors(out.tensors, out.config, file);
    return out;
}

}  // namespace minids::mds
