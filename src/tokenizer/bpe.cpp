#include "tokenizer/bpe.h"

#include <algorithm>

#include "tokenizer/byte_level.h"

namespace minids {

BpeModel::BpeModel(const TokenizerData& data) {
    // Token string -> id over the model's tokens. Added tokens are matched before BPE runs, so
    // their ids are left out unless a merge or byte produces the same string.
    std::unordered_map<std::string_view, int32_t> id_of;
    id_of.reserve(data.vocab.size());
    for (size_t id = 0; id < data.vocab.size(); ++id) {
        if (!data.vocab[id].empty()) id_of.emplace(data.vocab[id], static_cast<int32_t>(id));
    }
    const ByteLevelMap bytes;
    for (int b = 0; b < 256; ++b) {
        auto it = id_of.find(bytes.encode_byte(static_cast<uint8_t>(b)));
        byte_token_[b] = it == id_of.end() ? -1 : it->second;
    }
    merges_.reserve(data.merges.size());
    for (size_t rank = 0; rank < data.merges.size(); ++rank) {
        const std::string& m = data.merges[rank];
        const size_t space = m.find(' ');
        if (space == std::string::npos || m.find(' ', space + 1) != std::string::npos) {
            throw TokenizerError("tokenizer: merge " + std::to_string(rank) + " \"" + m +
                                 "\" should be two tokens separated by one space");
        }
        const std::string_view left(m.data(), space);
        const std::string_view right(m.data() + space + 1, m.size() - space - 1);
        const std::string merged = std::string(left) + std::string(right);
        auto l = id_of.find(left), r = id_of.find(right), n = id_of.find(merged);
        if (l == id_of.end() || r == id_of.end() || n == id_of.end()) {
            throw TokenizerError("tokenizer: merge " + std::to_string(rank) + " \"" + m +
                                 "\" uses or makes a token that is not in the vocabulary");
        }
        // A repeated pair keeps its last rank, as HF's HashMap insertion does.
        merges_[pair_key(l->second, r->second)] = {static_cast<int32_t>(rank), n->second};
    }
}

void BpeModel::push_candidate(int32_t pos) const {
    const int32_t next = symbols_[pos].next;
    if (next < 0) return;
    if (const Merge* m = find_merge(symbols_[pos].id, symbols_[next].id)) {
        heap_.push_back({m->rank, pos, m->merged_id});
        std::push_heap(heap_.begin(), heap_.end());
    }
}

void BpeModel::encode_piece(std::string_view piece, std::vector<int32_t>& out) const {
    symbols_.clear();
    for (char c : piece) {
        const int32_t id = byte_token_[static_cast<uint8_t>(c)];
        if (id < 0) continue;
        const auto idx = static_cast<int32_t>(symbols_.size());
        symbols_.push_back({id, idx - 1, -1});
        if (idx > 0) symbols_[idx - 1].next = idx;
    }
    if (symbols_.empty()) return;
    heap_.clear();
    for (int32_t i = 0; i + 1 < static_cast<int32_t>(symbols_.size()); ++i) push_candidate(i);
    while (!heap_.empty()) {
        std::pop_heap(heap_.begin(), heap_.end());
        const Candidate top = heap_.back();
        heap_.pop_back();
        Symbol& left = symbols_[top.pos];
        // Stale candidates: the left symbol was merged away (id -1) or changed, or its right
        // neighbour changed since the candidate was pushed.
        if (left.id < 0 || left.next < 0) continue;
        const Merge* m = find_merge(left.id, symbols_[left.next].id);
        if (!m || m->merged_id != top.merged_id) continue;
        Symbol& right = symbols_[left.next];
        left.id = top.merged_id;
        right.id = -1;
        left.next = right.next;
        if (right.next >= 0) symbols_[right.next].prev = top.pos;
        if (left.prev >= 0) push_candidate(left.prev);
        push_candidate(top.pos);
    }
    for (int32_t i = 0; i >= 0; i = symbols_[i].next) out.push_back(symbols_[i].id);
}

}  // namespace minids
