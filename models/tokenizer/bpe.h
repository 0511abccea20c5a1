// tokenizer.json's BPE model: the vocabulary, the merges by rank, and tokenizers' Word::merge_all
// over a word's characters (lowest rank first, then leftmost, through a heap), with unk_token /
// fuse_unk and ignore_merges, and a per-word cache. Internal to models/tokenizer/.
#pragma once

#include <cstdint>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "models/tokenizer/json_node.h"

namespace lvx::models::tokenization {

// Ids of model and added tokens stay below this (16,777,216; released vocabularies have up to a
// few hundred thousand): an id from a hostile file cannot make the id tables huge.
constexpr int64_t kMaxTokenId = int64_t{1} << 24;

struct Bpe {
  std::unordered_map<std::string, int32_t> vocab;
  std::vector<const std::string*> tokens;          // id → its key in vocab (null: no such id)
  std::unordered_map<uint32_t, int32_t> char_ids;  // single-character tokens by code point
  struct Merge {
    int32_t rank;
    int32_t id;
  };
  std::unordered_map<uint64_t, Merge> merges;  // (left id, right id) → rank and merged id
  int32_t unk_id = -1;
  bool fuse_unk = false;
  bool ignore_merges = false;

  static uint64_t key(int32_t a, int32_t b) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
  }

  // The cache holds words up to kCacheWordBytes, kCacheEntries of them (then no more are added).
  static constexpr size_t kCacheWordBytes = 256;
  static constexpr size_t kCacheEntries = 200000;
  mutable std::mutex cache_mutex;
  mutable std::unordered_map<std::string, std::vector<int32_t>> cache;

  // Appends the ids of one pre-tokenized word. Thread-safe (the cache has a mutex).
  void tokenize(const std::string& word, std::vector<int64_t>* out) const;

  // tokenizers' Word::merge_all: symbols are the word's characters; the pair with the lowest merge
  // rank (then the leftmost) is merged until none is left.
  std::vector<int32_t> merge_word(std::string_view w) const;
};

// Reads tokenizer.json's "model" (BPE only). Errors name the JSON path: an unsupported option, an
// id out of [0, kMaxTokenId) or used twice, a merge whose tokens are not in the vocabulary.
void parse_bpe(const Node& n, Bpe* bpe);

}  // namespace lvx::models::tokenization
