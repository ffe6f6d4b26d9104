#include "tokenizer/pre_tokenizer.h"

namespace minids {

namespace {

// Mirrors HF's SplitDelimiterBehavior handling in normalizer.rs: `marked` covers the whole piece
// with (span, is_match) in order; the result are the sub-pieces to keep.
template <typename Behavior>
void apply_behavior(Behavior behavior, const std::vector<std::pair<ByteSpan, bool>>& marked,
                    std::vector<ByteSpan>& out) {
    const size_t first = out.size();
    switch (behavior) {
        case Behavior::isolated:
            for (const auto& [span, is_match] : marked) out.push_back(span);
            break;
        case Behavior::removed:
            for (const auto& [span, is_match] : marked) {
                if (!is_match) out.push_back(span);
            }
            break;
        case Behavior::merged_with_previous: {
            bool previous_match = false;
            for (const auto& [span, is_match] : marked) {
                if (is_match && !previous_match && out.size() > first) {
                    out.back().end = span.end;
                } else {
                    out.push_back(span);
                }
                previous_match = is_match;
            }
            break;
        }
        case Behavior::merged_with_next: {
            // HF folds from the back: a match is glued onto the piece after it.
            bool previous_match = false;
            std::vector<ByteSpan> reversed;
            for (auto it = marked.rbegin(); it != marked.rend(); ++it) {
                if (it->second && !previous_match && !reversed.empty()) {
                    reversed.back().begin = it->first.begin;
                } else {
                    reversed.push_back(it->first);
                }
                previous_match = it->second;
            }
            out.insert(out.end(), reversed.rbegin(), reversed.rend());
            break;
        }
        case Behavior::contiguous: {
            bool previous_match = false;
            for (const auto& [span, is_match] : marked) {
                if (is_match == previous_match && out.size() > first) {
                    out.back().end = span.end;
                } else {
                    out.push_back(span);
                }
                previous_match = is_match;
            }
            break;
        }
    }
}

}  // namespace

PreTokenizer::PreTokenizer(const std::vector<TokenizerData::Split>& splits) {
    for (const auto& s : splits) {
        Behavior b;
        if (s.behavior == "isolated") {
            b = Behavior::isolated;
        } else if (s.behavior == "removed") {
            b = Behavior::removed;
        } else if (s.behavior == "merged_with_previous") {
            b = Behavior::merged_with_previous;
        } else if (s.behavior == "merged_with_next") {
            b = Behavior::merged_with_next;
        } else if (s.behavior == "contiguous") {
            b = Behavior::contiguous;
        } else {
            throw TokenizerError("tokenizer: Split behavior \"" + s.behavior + "\" is unknown");
        }
        steps_.push_back({UnicodeRegex(s.regex), b, s.invert});
    }
}

void PreTokenizer::split(std::string_view text, std::vector<ByteSpan>& pieces) const {
    pieces.clear();
    if (text.empty()) return;
    pieces.push_back({0, text.size()});
    for (const auto& step : steps_) {
        next_pieces_.clear();
        for (const ByteSpan piece : pieces) {
            const std::string_view sub = text.substr(piece.begin, piece.end - piece.begin);
            step.regex.find_all(sub, matches_);
            // Pattern::find_matches in HF: gaps and matches covering the piece, in order.
            marked_.clear();
            size_t prev = 0;
            for (const ByteSpan m : matches_) {
                if (prev != m.begin)
                    marked_.push_back({{piece.begin + prev, piece.begin + m.begin}, step.invert});
                marked_.push_back({{piece.begin + m.begin, piece.begin + m.end}, !step.invert});
                prev = m.end;
            }
            if (prev != sub.size())
                marked_.push_back({{piece.begin + prev, piece.end}, step.invert});
            const size_t before = next_pieces_.size();
            apply_behavior(step.behavior, marked_, next_pieces_);
            // Drop the empty pieces an empty match can leave.
            size_t w = before;
            for (size_t r = before; r < next_pieces_.size(); ++r) {
                if (next_pieces_[r].begin != next_pieces_[r].end)
                    next_pieces_[w++] = next_pieces_[r];
            }
            next_pieces_.resize(w);
        }
        pieces.swap(next_pieces_);
    }
}

}  // namespace minids
