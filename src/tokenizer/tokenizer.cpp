#include "tokenizer/tokenizer.h"

#include <array>
#include <cstring>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <unordered_map>

#include <xxhash.h>

#include "tokenizer/bpe.h"
#include "tokenizer/byte_level.h"
#include "tokenizer/pre_tokenizer.h"
#include "tokenizer/unicode_regex.h"
#include "util/strict_json.h"

namespace minids {

namespace {

// Pieces longer than this are encoded without the cache (long whitespace runs, minified code):
// they rarely repeat and would crowd it.
constexpr size_t kMaxCachedPieceBytes = 128;
// The cache is dropped and rebuilt when it grows past this many pieces.
constexpr size_t kMaxCachedPieces = size_t{1} << 18;

nlohmann::json read_json_file(const std::filesystem::path& path) {
    try {
        return read_json_file_strict(path);
    } catch (const FileReadError& e) {
        throw TokenizerError(e.what());
    }
}

// Added tokens of one kind, matched leftmost-longest like HF's aho-corasick automaton.
class AddedTokenMatcher {
public:
    void add(const AddedToken& t) {
        by_content_.emplace(t.content, &t);
        const auto first = static_cast<uint8_t>(t.content[0]);
        only_first_byte_ = by_content_.size() == 1 || only_first_byte_ == first ? first : -1;
        first_bytes_[first] = true;
        if (std::find(lengths_.begin(), lengths_.end(), t.content.size()) == lengths_.end()) {
            lengths_.push_back(t.content.size());
            std::sort(lengths_.rbegin(), lengths_.rend());
        }
    }
    bool empty() const { return by_content_.empty(); }

    // The leftmost match at or after `from`, the longest among those starting there.
    const AddedToken* find(std::string_view text, size_t from, ByteSpan& span) const {
        for (size_t i = from; i < text.size(); ++i) {
            if (only_first_byte_ >= 0) {
                // All tokens start with the same byte (DeepSeek's all start with '<'): jump to it.
                const void* hit = std::memchr(text.data() + i, only_first_byte_, text.size() - i);
                if (!hit) return nullptr;
                i = static_cast<const char*>(hit) - text.data();
            } else if (!first_bytes_[static_cast<uint8_t>(text[i])]) {
                continue;
            }
            for (size_t len : lengths_) {
                if (i + len > text.size()) continue;
                auto it = by_content_.find(text.substr(i, len));
                if (it != by_content_.end()) {
                    span = {i, i + len};
                    return it->second;
                }
            }
        }
        return nullptr;
    }

private:
    std::unordered_map<std::string_view, const AddedToken*> by_content_;
    std::vector<size_t> lengths_;  // distinct content lengths, longest first
    std::array<bool, 256> first_bytes_{};
    int only_first_byte_ = -1;  // the first byte every token shares, or -1
};

// Hash for string keys looked up by string_view (no temporary std::string per lookup).
struct StringHash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return XXH3_64bits(s.data(), s.size()); }
};

// A stretch of the input: plain text (token < 0) or one added token.
struct Segment {
    ByteSpan span;
    int32_t token = -1;
};

}  // namespace

struct Tokenizer::Impl {
    ByteLevelMap byte_level;
    AddedTokenMatcher added_raw;         // normalized == false: matched first
    AddedTokenMatcher added_normalized;  // normalized == true: matched in what is left
    PreTokenizer pre_tokenizer;
    BpeModel bpe;
    // Rust regex's \w and \s as HF's single_word / lstrip / rstrip rules use them.
    UnicodeRegex word_char{"[\\p{Alphabetic}\\p{M}\\p{Nd}\\p{Pc}\\x{200C}\\x{200D}]"};
    std::vector<std::string> token_bytes;
    std::vector<bool> special;
    std::unordered_map<std::string_view, int32_t> id_of_text;

    std::mutex encode_mutex;  // guards everything below and the scratch buffers above
    // piece bytes -> (offset, count) of its ids in cached_ids
    std::unordered_map<std::string, std::pair<uint32_t, uint32_t>, StringHash, std::equal_to<>>
        piece_cache;
    std::vector<int32_t> cached_ids;
    std::vector<Segment> segments, refined;
    std::vector<ByteSpan> pieces;
    std::string prefixed;

    explicit Impl(const TokenizerData& d) : pre_tokenizer(d.pre_splits), bpe(d) {}

    bool ends_with_word(std::string_view s) const {
        if (s.empty()) return false;
        size_t begin = 0;
        previous_codepoint(s, s.size(), begin);
        return word_char.matches_at_start(s.substr(begin));
    }
    bool starts_with_word(std::string_view s) const {
        return !s.empty() && word_char.matches_at_start(s);
    }

    // HF AddedVocabulary::find_matches + split_with_indices over `text` (a span of `full`).
    // With `skip_special`, special tokens are left in the text (HF's split_special_tokens).
    void split_added(const AddedTokenMatcher& matcher, std::string_view full, ByteSpan text,
                     bool skip_special, std::vector<Segment>& out) const {
        const std::string_view s = full.substr(text.begin, text.end - text.begin);
        size_t search = 0, start_offset = 0;
        ByteSpan m;
        while (const AddedToken* t = matcher.find(s, search, m)) {
            search = m.end;
            if (m.begin < start_offset) continue;  // inside what a previous rstrip consumed
            if (skip_special && t->special) continue;
            if (t->single_word) {
                const bool space_before = m.begin == 0 || !ends_with_word(s.substr(0, m.begin));
                const bool space_after = m.end == s.size() || !starts_with_word(s.substr(m.end));
                if (!space_before || !space_after) continue;
            }
            if (t->lstrip) {
                size_t b = m.begin;
                while (b > start_offset) {
                    size_t prev = 0;
                    if (!is_unicode_whitespace(previous_codepoint(s, b, prev))) break;
                    b = prev;
                }
                m.begin = b;
            }
            if (t->rstrip) {
                size_t e = m.end;
                while (e < s.size()) {
                    size_t next = e;
                    if (!is_unicode_whitespace(next_codepoint(s, next))) break;
                    e = next;
                }
                m.end = e;
            }
            if (start_offset < m.begin)
                out.push_back({{text.begin + start_offset, text.begin + m.begin}, -1});
            out.push_back({{text.begin + m.begin, text.begin + m.end}, t->id});
            start_offset = m.end;
        }
        if (start_offset < s.size()) out.push_back({{text.begin + start_offset, text.end}, -1});
    }

    void encode_piece_cached(std::string_view piece, std::vector<int32_t>& out) {
        if (piece.size() > kMaxCachedPieceBytes) {
            bpe.encode_piece(piece, out);
            return;
        }
        auto it = piece_cache.find(piece);
        if (it != piece_cache.end()) {
            out.insert(out.end(), cached_ids.begin() + it->second.first,
                       cached_ids.begin() + it->second.first + it->second.second);
            return;
        }
        const size_t before = out.size();
        bpe.encode_piece(piece, out);
        if (piece_cache.size() >= kMaxCachedPieces) {
            piece_cache.clear();
            cached_ids.clear();
        }
        piece_cache.emplace(std::string(piece), std::pair<uint32_t, uint32_t>(
                                                    static_cast<uint32_t>(cached_ids.size()),
                                                    static_cast<uint32_t>(out.size() - before)));
        cached_ids.insert(cached_ids.end(), out.begin() + before, out.end());
    }

    void encode_text(std::string_view text, bool add_prefix_space, std::vector<int32_t>& out) {
        if (add_prefix_space && !text.empty() && text[0] != ' ') {
            // Built with reserve + append: GCC 12 warns falsely (-Wrestrict) on " " + text here.
            prefixed.clear();
            prefixed.reserve(text.size() + 1);
            prefixed.push_back(' ');
            prefixed.append(text.data(), text.size());
            text = prefixed;
        }
        pre_tokenizer.split(text, pieces);
        for (const ByteSpan p : pieces)
            encode_piece_cached(text.substr(p.begin, p.end - p.begin), out);
    }
};

TokenizerData load_hf_tokenizer(const std::filesystem::path& tokenizer_json) {
    const nlohmann::json tj = read_json_file(tokenizer_json);
    const auto config_path = tokenizer_json.parent_path() / "tokenizer_config.json";
    const nlohmann::json config =
        std::filesystem::exists(config_path) ? read_json_file(config_path) : nlohmann::json();
    return tokenizer_data_from_hf(tj, config);
}

Tokenizer::Tokenizer(TokenizerData data)
    : data_(std::move(data)), impl_(std::make_unique<Impl>(data_)) {
    if (!data_.byte_level || data_.model != "bpe") {
        throw TokenizerError("tokenizer: only byte-level BPE is supported (model \"" + data_.model +
                             "\", byte_level " + (data_.byte_level ? "true" : "false") + ")");
    }
    Impl& im = *impl_;
    const auto n = data_.vocab.size();
    im.special.assign(n, false);
    for (const auto& t : data_.added_tokens) {
        if (t.content.empty())
            throw TokenizerError("tokenizer: added token " + std::to_string(t.id) + " is empty");
        if (t.id < 0 || static_cast<size_t>(t.id) >= n) {
            throw TokenizerError("tokenizer: added token \"" + t.content + "\" has id " +
                                 std::to_string(t.id) + ", outside the vocabulary");
        }
        (t.normalized ? im.added_normalized : im.added_raw).add(t);
        im.special[t.id] = t.special;
    }
    // Bytes of every token, as HF's ByteLevel decoder turns a token into bytes: its byte-level
    // characters mapped back, or, when it holds any other character, its text as it is.
    im.token_bytes.resize(n);
    std::vector<std::string_view> text_of(n);
    for (size_t id = 0; id < n; ++id) text_of[id] = data_.vocab[id];
    for (const auto& t : data_.added_tokens) text_of[t.id] = t.content;
    for (size_t id = 0; id < n; ++id) {
        std::string bytes;
        if (!im.byte_level.decode(text_of[id], bytes)) bytes = text_of[id];
        im.token_bytes[id] = std::move(bytes);
    }
    im.id_of_text.reserve(n);
    for (const auto& t : data_.added_tokens) im.id_of_text.emplace(t.content, t.id);
    for (size_t id = 0; id < n; ++id) {
        if (!data_.vocab[id].empty())
            im.id_of_text.emplace(data_.vocab[id], static_cast<int32_t>(id));
    }
}

Tokenizer::~Tokenizer() = default;

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_special,
                                       bool parse_special) const {
    if (auto bad = find_invalid_utf8(text)) {
        throw TokenizerError("tokenizer: the text is not valid UTF-8 (invalid byte 0x" +
                             [&] {
                                 char buf[8];
                                 std::snprintf(buf, sizeof buf, "%02X",
                                               static_cast<uint8_t>(text[*bad]));
                                 return std::string(buf);
                             }() +
                             " at offset " + std::to_string(*bad) + ")");
    }
    Impl& im = *impl_;
    const std::lock_guard lock(im.encode_mutex);
    std::vector<int32_t> ids;
    ids.reserve(text.size() / 3 + 2);
    if (add_special && data_.add_bos && data_.bos_id) ids.push_back(*data_.bos_id);

    im.segments.clear();
    if (!im.added_raw.empty()) {
        im.split_added(im.added_raw, text, {0, text.size()}, !parse_special, im.segments);
    } else if (!text.empty()) {
        im.segments.push_back({{0, text.size()}, -1});
    }
    if (!im.added_normalized.empty()) {
        im.refined.clear();
        for (const Segment& s : im.segments) {
            if (s.token >= 0) {
                im.refined.push_back(s);
            } else {
                im.split_added(im.added_normalized, text, s.span, !parse_special, im.refined);
            }
        }
        im.segments.swap(im.refined);
    }
    for (const Segment& s : im.segments) {
        if (s.token >= 0) {
            ids.push_back(s.token);
        } else {
            im.encode_text(text.substr(s.span.begin, s.span.end - s.span.begin),
                           data_.byte_level_add_prefix_space, ids);
        }
    }
    if (add_special && data_.add_eos && data_.eos_id) ids.push_back(*data_.eos_id);
    return ids;
}

const std::string& Tokenizer::token_bytes(int32_t id) const {
    static const std::string kNone;
    return id >= 0 && id < n_vocab() ? impl_->token_bytes[id] : kNone;
}

const std::string& Tokenizer::token_text(int32_t id) const {
    static const std::string kNone;
    return id >= 0 && id < n_vocab() ? data_.vocab[id] : kNone;
}

bool Tokenizer::is_special(int32_t id) const {
    return id >= 0 && id < n_vocab() && impl_->special[id];
}

std::optional<int32_t> Tokenizer::find_token(std::string_view text) const {
    auto it = impl_->id_of_text.find(text);
    if (it == impl_->id_of_text.end()) return std::nullopt;
    return it->second;
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special) const {
    std::string bytes;
    for (int32_t id : ids) {
        if (skip_special && is_special(id)) continue;
        bytes += token_bytes(id);
    }
    std::string out;
    out.reserve(bytes.size());
    append_utf8_lossy(bytes, /*final_chunk=*/true, out);
    return out;
}

std::string StreamingDetokenizer::push(int32_t id) {
    const std::string& bytes = tokenizer_.token_bytes(id);
    if (skip_special_ && tokenizer_.is_special(id)) return {};
    pending_ += bytes;
    std::string out;
    const size_t used = append_utf8_lossy(pending_, /*final_chunk=*/false, out);
    pending_.erase(0, used);
    return out;
}

std::string StreamingDetokenizer::flush() {
    std::string out;
    append_utf8_lossy(pending_, /*final_chunk=*/true, out);
    pending_.clear();
    return out;
}

}  // namespace minids
