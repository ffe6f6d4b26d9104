// Byte-level BPE (HF `models.BPE` with the ByteLevel pre-tokenizer in front): a piece's bytes
// start as one byte token each, then the pair with the lowest merge rank is merged, leftmost
// first, until no mergeable pair is left (HF's Word::merge_all).
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "tokenizer/tokenizer_data.h"

namespace minids {

class BpeModel {
public:
    explicit BpeModel(const TokenizerData& data);

    // Appends the ids of one pre-tokenized piece (raw bytes). Bytes whose byte-level character is
    // not in the vocabulary are dropped, as HF's BPE does without an unk token.
    // Not thread-safe: scratch buffers live in the object.
    void encode_piece(std::string_view piece, std::vector<int32_t>& out) const;

private:
    struct Merge {
        int32_t rank;
        int32_t merged_id;
    };
    struct Symbol {
        int32_t id;
        int32_t prev;  // index of the previous live symbol, -1 at the start
        int32_t next;  // index of the next live symbol, -1 at the end
    };
    struct Candidate {
        int32_t rank;
        int32_t pos;  // index of the left symbol
        int32_t merged_id;
        // std::priority_queue pops the largest: make the lowest rank, then leftmost, largest.
        bool operator<(const Candidate& o) const {
            return rank != o.rank ? rank > o.rank : pos > o.pos;
        }
    };
    static uint64_t pair_key(int32_t left, int32_t right) {
        return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) |
               static_cast<uint32_t>(right);
    }
    const Merge* find_merge(int32_t left, int32_t right) const {
        auto it = merges_.find(pair_key(left, right));
        return it == merges_.end() ? nullptr : &it->second;
    }
    void push_candidate(int32_t pos) const;

    std::array<int32_t, 256> byte_token_{};  // id of each byte's byte-level token, -1 if absent
    std::unordered_map<uint64_t, Merge> merges_;
    mutable std::vector<Symbol> symbols_;
    mutable std::vector<Candidate> heap_;
};

}  // namespace minids
