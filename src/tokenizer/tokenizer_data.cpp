// TokenizerData from Hugging Face files and to/from the canonical manifest form.
//
// Only what minids implements is accepted: a byte-level BPE model, an empty (or absent)
// normalizer, and a pre-tokenizer made of Split and ByteLevel steps. Anything else is refused by
// name, so a model whose tokenizer we would silently get wrong never loads.
#include "tokenizer/tokenizer_data.h"

#include <algorithm>
#include <nlohmann/json.hpp>
#include <string_view>
#include <unordered_map>

#include "chat/builtin_templates.h"
#include "tokenizer/byte_level.h"
#include "util/json_fields.h"

namespace minids {

namespace {

using nlohmann::json;

// GPT-2's pre-tokenizer regex: what HF's ByteLevel pre-tokenizer applies when use_regex is true.
constexpr std::string_view kGpt2Regex =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

// DeepSeek-V3's Split regexes (tokenizer.json), used by the synthetic byte tokenizer.
constexpr std::string_view kDeepSeekSplitRegexes[] = {
    "\\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]"
    "+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
};

[[noreturn]] void fail(const std::string& msg) { throw TokenizerError(msg); }

// HF's `type` field of a component, or a clear error when it has none.
std::string component_type(const json& j, const std::string& where) {
    if (!j.is_object() || !j.contains("type") || !j["type"].is_string()) {
        fail("tokenizer.json: " + where + " has no \"type\" string");
    }
    return j["type"].get<std::string>();
}

bool bool_or(const json& obj, const char* key, bool fallback) {
    if (!obj.is_object() || !obj.contains(key) || obj[key].is_null()) return fallback;
    if (!obj[key].is_boolean()) {
        fail(std::string("tokenizer: \"") + key + "\" should be a boolean, found " +
             describe_json(obj[key]));
    }
    return obj[key].get<bool>();
}

// Escapes a literal string so PCRE2 matches it verbatim (HF Split's {"String": ...} pattern).
std::string regex_quote(const std::string& s) {
    std::string out;
    for (char c : s) {
        if (std::string_view("\\^$.|?*+()[]{}").find(c) != std::string_view::npos) out += '\\';
        out += c;
    }
    return out;
}

std::string behavior_from_hf(const std::string& b) {
    if (b == "Isolated") return "isolated";
    if (b == "Removed") return "removed";
    if (b == "MergedWithPrevious") return "merged_with_previous";
    if (b == "MergedWithNext") return "merged_with_next";
    if (b == "Contiguous") return "contiguous";
    fail("tokenizer.json: Split behavior \"" + b + "\" is not one HF defines");
}

bool known_behavior(const std::string& b) {
    return b == "isolated" || b == "removed" || b == "merged_with_previous" ||
           b == "merged_with_next" || b == "contiguous";
}

void add_pre_tokenizer(const json& pt, TokenizerData& d, const std::string& where) {
    const std::string type = component_type(pt, where);
    if (d.byte_level) {
        // minids applies ByteLevel last, to the pieces the Split steps leave.
        fail("tokenizer.json: a \"" + type +
             "\" step after the ByteLevel pre-tokenizer is not supported");
    }
    if (type == "Sequence") {
        if (!pt.contains("pretokenizers") || !pt["pretokenizers"].is_array()) {
            fail("tokenizer.json: " + where + " Sequence has no \"pretokenizers\" array");
        }
        for (const auto& step : pt["pretokenizers"]) add_pre_tokenizer(step, d, where + " step");
    } else if (type == "Split") {
        TokenizerData::Split split;
        const json& pattern = pt.value("pattern", json());
        if (pattern.contains("Regex") && pattern["Regex"].is_string()) {
            split.regex = pattern["Regex"].get<std::string>();
        } else if (pattern.contains("String") && pattern["String"].is_string()) {
            split.regex = regex_quote(pattern["String"].get<std::string>());
        } else {
            fail("tokenizer.json: Split pre-tokenizer has no {\"Regex\"} or {\"String\"} pattern");
        }
        if (!pt.contains("behavior") || !pt["behavior"].is_string()) {
            fail("tokenizer.json: Split pre-tokenizer has no \"behavior\" string");
        }
        split.behavior = behavior_from_hf(pt["behavior"].get<std::string>());
        split.invert = bool_or(pt, "invert", false);
        d.pre_splits.push_back(std::move(split));
    } else if (type == "ByteLevel") {
        d.byte_level = true;
        d.byte_level_add_prefix_space = bool_or(pt, "add_prefix_space", false);
        if (d.byte_level_add_prefix_space && !d.pre_splits.empty()) {
            // HF prepends the space to every piece the Splits made; minids only to whole text.
            fail("tokenizer.json: ByteLevel add_prefix_space after Split steps is not supported");
        }
        if (bool_or(pt, "use_regex", true)) {
            d.pre_splits.push_back({std::string(kGpt2Regex), "isolated", false});
        }
    } else {
        fail("tokenizer.json: pre-tokenizer type \"" + type +
             "\" is not supported (minids supports Sequence, Split and ByteLevel)");
    }
}

void check_normalizer(const json& n) {
    if (n.is_null()) return;
    const std::string type = component_type(n, "normalizer");
    if (type == "Sequence" && n.contains("normalizers") && n["normalizers"].is_array() &&
        n["normalizers"].empty()) {
        return;
    }
    fail("tokenizer.json: normalizer \"" + type +
         "\" is not supported (minids supports none, or an empty Sequence)");
}

void check_decoder(const json& dec) {
    if (dec.is_null()) return;
    const std::string type = component_type(dec, "decoder");
    if (type != "ByteLevel") {
        fail("tokenizer.json: decoder \"" + type +
             "\" is not supported (minids supports ByteLevel)");
    }
}

// tokenizer_config.json's bos_token / eos_token: a string, {"content": ...}, or null.
std::optional<std::string> special_token_content(const json& config, const char* key) {
    if (!config.is_object() || !config.contains(key) || config[key].is_null()) return std::nullopt;
    const json& v = config[key];
    if (v.is_string()) return v.get<std::string>();
    if (v.is_object() && v.contains("content") && v["content"].is_string()) {
        return v["content"].get<std::string>();
    }
    fail(std::string("tokenizer_config.json: \"") + key +
         "\" should be a string or an object with \"content\", found " + describe_json(v));
}

std::optional<int32_t> resolve_token_id(const TokenizerData& d, const std::optional<std::string>& s,
                                        const char* key) {
    if (!s) return std::nullopt;
    for (const auto& t : d.added_tokens) {
        if (t.content == *s) return t.id;
    }
    for (size_t id = 0; id < d.vocab.size(); ++id) {
        if (d.vocab[id] == *s) return static_cast<int32_t>(id);
    }
    fail(std::string("tokenizer_config.json: ") + key + " \"" + *s +
         "\" is neither an added token nor in the vocabulary");
}

std::string chat_template_from_config(const json& config) {
    if (!config.is_object() || !config.contains("chat_template") ||
        config["chat_template"].is_null()) {
        return "";
    }
    const json& ct = config["chat_template"];
    if (ct.is_string()) return ct.get<std::string>();
    if (ct.is_array()) {
        for (const auto& named : ct) {
            if (named.is_object() && named.value("name", "") == "default" &&
                named.contains("template") && named["template"].is_string()) {
                return named["template"].get<std::string>();
            }
        }
        fail("tokenizer_config.json: chat_template is a list without a \"default\" template");
    }
    fail(
        "tokenizer_config.json: chat_template should be a string or a list of named templates, "
        "found " +
        describe_json(ct));
}

void check_ids_in_range(const TokenizerData& d) {
    const auto n = static_cast<int64_t>(d.vocab.size());
    if (n > max_vocab_size)
        fail("tokenizer: expected at most " + std::to_string(max_vocab_size) + " tokens, found " +
             std::to_string(n));
    for (const auto& t : d.added_tokens) {
        if (t.id >= n) {
            fail("tokenizer: added token \"" + t.content + "\" has id " + std::to_string(t.id) +
                 ", outside the vocabulary of " + std::to_string(n));
        }
    }
    if (d.bos_id && *d.bos_id >= n)
        fail("tokenizer: bos id " + std::to_string(*d.bos_id) + " is outside the vocabulary");
    if (d.eos_id && *d.eos_id >= n)
        fail("tokenizer: eos id " + std::to_string(*d.eos_id) + " is outside the vocabulary");
}

}  // namespace

TokenizerData tokenizer_data_from_hf(const json& tokenizer_json, const json& tokenizer_config) {
    if (!tokenizer_json.is_object()) fail("tokenizer.json: the top level should be an object");
    TokenizerData d;
    const json& model = tokenizer_json.value("model", json());
    const std::string model_type = component_type(model, "model");
    if (model_type != "BPE") {
        fail("tokenizer.json: model type \"" + model_type +
             "\" is not supported (minids supports BPE)");
    }
    if (bool_or(model, "byte_fallback", false))
        fail("tokenizer.json: BPE byte_fallback is not supported");
    if (bool_or(model, "ignore_merges", false))
        fail("tokenizer.json: BPE ignore_merges is not supported");
    for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix", "dropout"}) {
        if (model.contains(key) && !model[key].is_null()) {
            fail(std::string("tokenizer.json: BPE \"") + key + "\" is not supported");
        }
    }
    check_normalizer(tokenizer_json.value("normalizer", json()));
    check_decoder(tokenizer_json.value("decoder", json()));

    // Vocabulary: token -> id map, laid out by id. Added tokens may have ids past the model's
    // vocabulary (DeepSeek-V3's 818 added tokens do); their content fills those slots.
    if (!model.contains("vocab") || !model["vocab"].is_object())
        fail("tokenizer.json: model has no \"vocab\" object");
    // Ids are checked against max_vocab_size before they size the vocabulary: an id of
    // 2147483647 once overflowed `id + 1`, and ids near 1e8 allocated gigabytes.
    auto token_id = [](const json& id, const std::string& what) -> int64_t {
        if (!id.is_number_integer() || id.get<int64_t>() < 0 ||
            id.get<int64_t>() >= max_vocab_size) {
            fail("tokenizer.json: " + what + ": expected a token id in [0, " +
                 std::to_string(max_vocab_size - 1) + "], found " +
                 (id.is_number_integer() ? id.dump() : describe_json(id)));
        }
        return id.get<int64_t>();
    };
    int64_t n_vocab = 0;
    for (const auto& [token, id] : model["vocab"].items())
        n_vocab = std::max(n_vocab, token_id(id, "vocab entry \"" + token + "\"") + 1);
    const json& added = tokenizer_json.value("added_tokens", json::array());
    if (!added.is_array()) fail("tokenizer.json: \"added_tokens\" should be an array");
    for (const auto& t : added) {
        AddedToken a;
        if (!t.is_object() || !t.contains("id") || !t["id"].is_number_integer() ||
            !t.contains("content") || !t["content"].is_string()) {
            fail("tokenizer.json: an added token lacks an integer \"id\" or a string \"content\"");
        }
        a.id =
            int32_t(token_id(t["id"], "added token \"" + t["content"].get<std::string>() + "\""));
        a.content = t["content"].get<std::string>();
        a.special = bool_or(t, "special", false);
        a.lstrip = bool_or(t, "lstrip", false);
        a.rstrip = bool_or(t, "rstrip", false);
        a.normalized = bool_or(t, "normalized", false);
        a.single_word = bool_or(t, "single_word", false);
        n_vocab = std::max<int64_t>(n_vocab, a.id + 1);
        d.added_tokens.push_back(std::move(a));
    }
    d.vocab.assign(static_cast<size_t>(n_vocab), std::string());
    for (const auto& [token, id] : model["vocab"].items()) {
        std::string& slot = d.vocab[id.get<size_t>()];
        if (!slot.empty())
            fail("tokenizer.json: id " + std::to_string(id.get<int64_t>()) +
                 " appears twice in the vocab");
        slot = token;
    }
    for (const auto& a : d.added_tokens) {
        if (d.vocab[a.id].empty()) d.vocab[a.id] = a.content;
    }

    // Merges: "left right" strings or ["left", "right"] pairs.
    if (!model.contains("merges") || !model["merges"].is_array())
        fail("tokenizer.json: model has no \"merges\" array");
    d.merges.reserve(model["merges"].size());
    for (const auto& m : model["merges"]) {
        if (m.is_string()) {
            d.merges.push_back(m.get<std::string>());
        } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
            d.merges.push_back(m[0].get<std::string>() + " " + m[1].get<std::string>());
        } else {
            fail("tokenizer.json: a merge should be \"a b\" or [\"a\", \"b\"], found " +
                 m.dump().substr(0, 64));
        }
    }

    const json& pre = tokenizer_json.value("pre_tokenizer", json());
    d.byte_level = false;
    if (!pre.is_null()) add_pre_tokenizer(pre, d, "pre_tokenizer");
    if (!d.byte_level)
        fail(
            "tokenizer.json: the pre-tokenizer has no ByteLevel step (minids supports byte-level "
            "BPE only)");

    d.bos_id =
        resolve_token_id(d, special_token_content(tokenizer_config, "bos_token"), "bos_token");
    d.eos_id =
        resolve_token_id(d, special_token_content(tokenizer_config, "eos_token"), "eos_token");
    d.add_bos = d.bos_id.has_value() && bool_or(tokenizer_config, "add_bos_token", true);
    d.add_eos = d.eos_id.has_value() && bool_or(tokenizer_config, "add_eos_token", false);
    d.chat_template = chat_template_from_config(tokenizer_config);
    check_ids_in_range(d);
    return d;
}

json tokenizer_data_to_json(const TokenizerData& d) {
    json added = json::array();
    for (const auto& a : d.added_tokens) {
        added.push_back({{"id", a.id},
                         {"content", a.content},
                         {"special", a.special},
                         {"lstrip", a.lstrip},
                         {"rstrip", a.rstrip},
                         {"normalized", a.normalized},
                         {"single_word", a.single_word}});
    }
    json splits = json::array();
    for (const auto& s : d.pre_splits) {
        splits.push_back({{"regex", s.regex}, {"behavior", s.behavior}, {"invert", s.invert}});
    }
    return json{{"model", d.model},
                {"vocab", d.vocab},
                {"merges", d.merges},
                {"added_tokens", added},
                {"pre_splits", splits},
                {"byte_level", d.byte_level},
                {"byte_level_add_prefix_space", d.byte_level_add_prefix_space},
                {"bos_id", d.bos_id ? json(*d.bos_id) : json()},
                {"eos_id", d.eos_id ? json(*d.eos_id) : json()},
                {"add_bos", d.add_bos},
                {"add_eos", d.add_eos},
                {"chat_template", d.chat_template}};
}

TokenizerData tokenizer_data_from_json(const json& j) {
    const FieldReader r("tokenizer manifest", "", throw_as<TokenizerError>,
                        FieldReader::Naming::quoted);
    if (!j.is_object()) r.fail("tokenizer", "an object", describe_json(j));
    r.expect_object(j, {"model", "vocab", "merges", "added_tokens", "pre_splits", "byte_level",
                        "byte_level_add_prefix_space", "bos_id", "eos_id", "add_bos", "add_eos",
                        "chat_template"});
    auto strings = [&](const char* key) {
        const json& arr = r.array(j, key);
        std::vector<std::string> out;
        out.reserve(arr.size());
        for (size_t i = 0; i < arr.size(); ++i)
            out.push_back(r.as_string(arr[i], r.field(key) + "[" + std::to_string(i) + "]"));
        return out;
    };
    TokenizerData d;
    d.model = r.string(j, "model");
    if (d.model != "bpe") r.fail(r.field("model"), "\"bpe\"", describe_json(j["model"]));
    d.vocab = strings("vocab");
    d.merges = strings("merges");
    const json& added = r.array(j, "added_tokens");
    for (size_t i = 0; i < added.size(); ++i) {
        const FieldReader t = r.nested("added_tokens", i);
        t.expect_object(added[i], {"id", "content", "special", "lstrip", "rstrip", "normalized",
                                   "single_word"});
        AddedToken a;
        a.id = int32_t(t.i64(added[i], "id", 0, max_vocab_size - 1));
        a.content = t.string(added[i], "content");
        a.special = t.boolean(added[i], "special");
        a.lstrip = t.boolean(added[i], "lstrip");
        a.rstrip = t.boolean(added[i], "rstrip");
        a.normalized = t.boolean(added[i], "normalized");
        a.single_word = t.boolean(added[i], "single_word");
        if (a.content.empty()) t.fail(t.field("content"), "a non-empty string", "\"\"");
        d.added_tokens.push_back(std::move(a));
    }
    const json& splits = r.array(j, "pre_splits");
    for (size_t i = 0; i < splits.size(); ++i) {
        const FieldReader sr = r.nested("pre_splits", i);
        sr.expect_object(splits[i], {"regex", "behavior", "invert"});
        TokenizerData::Split s;
        s.regex = sr.string(splits[i], "regex");
        s.behavior = sr.string(splits[i], "behavior");
        s.invert = sr.boolean(splits[i], "invert");
        if (!known_behavior(s.behavior))
            sr.fail(sr.field("behavior"),
                    "isolated, removed, merged_with_previous, merged_with_next or contiguous",
                    describe_json(splits[i]["behavior"]));
        d.pre_splits.push_back(std::move(s));
    }
    d.byte_level = r.boolean(j, "byte_level");
    d.byte_level_add_prefix_space = r.boolean(j, "byte_level_add_prefix_space");
    for (auto [key, id] : {std::pair{"bos_id", &d.bos_id}, std::pair{"eos_id", &d.eos_id}}) {
        const std::optional<int64_t> v = r.i64_or_null(j, key, 0, max_vocab_size - 1);
        if (v) *id = int32_t(*v);
    }
    d.add_bos = r.boolean(j, "add_bos");
    d.add_eos = r.boolean(j, "add_eos");
    d.chat_template = r.string(j, "chat_template");
    check_ids_in_range(d);
    return d;
}

TokenizerData synthetic_byte_tokenizer(int64_t vocab_size) {
    constexpr int64_t n_bytes = 256;
    const char* specials[] = {"<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"};
    if (vocab_size < n_bytes + 3 || vocab_size > INT32_MAX) {
        fail(
            "synthetic tokenizer: vocab_size should be at least 259 (256 bytes + 3 specials), "
            "found " +
            std::to_string(vocab_size));
    }
    TokenizerData d;
    d.vocab.assign(static_cast<size_t>(vocab_size), std::string());
    const ByteLevelMap bytes;
    for (int b = 0; b < n_bytes; ++b) d.vocab[b] = bytes.encode_byte(static_cast<uint8_t>(b));
    for (int i = 0; i < 3; ++i) {
        AddedToken a;
        a.id = static_cast<int32_t>(n_bytes + i);
        a.content = specials[i];
        d.vocab[a.id] = a.content;
        d.added_tokens.push_back(a);
    }
    for (auto regex : kDeepSeekSplitRegexes)
        d.pre_splits.push_back({std::string(regex), "isolated", false});
    d.bos_id = static_cast<int32_t>(n_bytes);
    d.eos_id = static_cast<int32_t>(n_bytes + 1);
    d.add_bos = true;
    d.add_eos = false;
    d.chat_template = std::string(*builtin_chat_template("deepseek2"));
    return d;
}

}  // namespace minids
