// libFuzzer target for what minids reads from files it does not trust: the .mds preamble and
// manifest (src/mds/manifest.h), chat templates (src/chat/jinja.h) and Hugging Face
// tokenizer.json files (src/tokenizer/tokenizer_data.h).
//
// Four kinds of input, told apart by how they start:
//   * "JINJA\n" + a template: parsed and rendered on two short conversations, as loading a model
//     checks its template; ChatTemplateError is the expected refusal;
//   * "TOKJSON\n" + a tokenizer.json: parsed strictly, turned into TokenizerData, round-tripped
//     through the manifest form and built into a Tokenizer that encodes a short text;
//     TokenizerError / JsonSyntaxError are the expected refusals;
//   * a whole .mds file ("MINIDS\r\n..."): the checksums in the preamble are recomputed and the
//     size padded to a multiple of 4096 before parsing, so mutations reach the checks behind them;
//   * anything else: the manifest JSON alone, placed as if after a valid preamble in a file with
//     a large data region (parse_manifest reads no data, so the region need not exist).
// For a manifest a FileError is the expected outcome for bad input. Any other exception, a
// crash, a sanitizer report, a leak or a timeout (a hang) is a bug.
#include <cstdint>
#include <cstring>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include <xxhash.h>

#include "chat/chat_template.h"
#include "mds/format.h"
#include "mds/manifest.h"
#include "tokenizer/tokenizer.h"
#include "util/strict_json.h"

namespace {

using namespace minids::mds;

void parse_whole_file(const uint8_t* data, size_t size) {
    std::vector<uint8_t> file(data, data + size);
    file.resize((size + mds_alignment - 1) / mds_alignment * mds_alignment, 0);
    mds_preamble pre;
    std::memcpy(&pre, file.data(), sizeof pre);
    if (pre.manifest_len <= file.size() - sizeof pre) {
        pre.manifest_xxh3 = XXH3_64bits(file.data() + sizeof pre, pre.manifest_len);
        std::memcpy(file.data() + offsetof(mds_preamble, manifest_xxh3), &pre.manifest_xxh3, 8);
    }
    pre.preamble_xxh3 = XXH3_64bits(file.data(), offsetof(mds_preamble, preamble_xxh3));
    std::memcpy(file.data() + offsetof(mds_preamble, preamble_xxh3), &pre.preamble_xxh3, 8);

    const mds_preamble checked = parse_preamble(file.data(), file.size(), "fuzz.mds");
    std::string_view text(reinterpret_cast<const char*>(file.data()) + sizeof checked,
                          checked.manifest_len);
    parse_manifest(text, FileExtent{checked.data_offset, file.size()}, "fuzz.mds");
}

void parse_manifest_only(const uint8_t* data, size_t size) {
    const uint64_t data_offset =
        (sizeof(mds_preamble) + size + mds_alignment - 1) / mds_alignment * mds_alignment;
    std::string_view text(reinterpret_cast<const char*>(data), size);
    parse_manifest(text, FileExtent{data_offset, data_offset + (uint64_t{1} << 32)}, "fuzz.mds");
}

void render_template(std::string_view source) {
    // Parses and renders two conversations within the limits, as loading a model does.
    try {
        minids::check_chat_template(source, "<s>", "</s>");
    } catch (const minids::ChatTemplateError&) {
    }
}

void load_tokenizer(std::string_view text) {
    try {
        const nlohmann::json j = minids::parse_json_strict(text);
        const minids::TokenizerData d = minids::tokenizer_data_from_hf(j, nullptr);
        const minids::TokenizerData back =
            minids::tokenizer_data_from_json(minids::tokenizer_data_to_json(d));
        const minids::Tokenizer tok(back);
        // A short text keeps any backtracking in the file's regexes small.
        tok.decode(tok.encode("Hi there, 42 \xe4\xb8\xad!\n"));
    } catch (const minids::JsonSyntaxError&) {
    } catch (const minids::TokenizerError&) {
    }
}

bool starts_with(const uint8_t* data, size_t size, std::string_view prefix) {
    return size >= prefix.size() && std::memcmp(data, prefix.data(), prefix.size()) == 0;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    const std::string_view text(reinterpret_cast<const char*>(data), size);
    if (starts_with(data, size, "JINJA\n")) {
        render_template(text.substr(6));
        return 0;
    }
    if (starts_with(data, size, "TOKJSON\n")) {
        load_tokenizer(text.substr(8));
        return 0;
    }
    try {
        if (size >= sizeof(mds_preamble) && std::memcmp(data, mds_magic, sizeof mds_magic) == 0)
            parse_whole_file(data, size);
        else
            parse_manifest_only(data, size);
    } catch (const FileError&) {
        // Refused with a message: the intended outcome for malformed input.
    }
    return 0;
}
