// Added tokens (tokenizer.json's added_tokens): their ids as tokenizers assigns them, and splitting
// a text around them: leftmost-longest, non-overlapping matching by an Aho-Corasick automaton (as
// tokenizers' aho-corasick with MatchKind::LeftmostLongest) with tokenizers' single_word, lstrip
// and rstrip rules. Internal to models/tokenizer/.
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "models/tokenizer/bpe.h"
#include "models/tokenizer/json_node.h"
#include "models/tokenizer/normalizer.h"

namespace lvx::models::tokenization {

struct AddedToken {
  std::string content;
  int32_t id = 0;
  bool single_word = false, lstrip = false, rstrip = false, normalized = true, special = false;
};

// A piece of the input: text still to tokenize (id < 0) or an added token.
struct Piece {
  std::string text;
  int32_t id = -1;
};

// Leftmost-longest, non-overlapping matching of the added tokens' contents (as tokenizers'
// aho-corasick with MatchKind::LeftmostLongest), then its find_matches rules.
//
// Linear in the text whatever the number of tokens: an Aho-Corasick automaton over the *reversed*
// contents, run from the text's end to its start, gives at every position the longest content
// that starts there (the deepest accepting state among the current state's suffixes); the split
// then walks the positions left to right, taking the longest match at the first position that
// has one and going on after its end. Building is O(total content bytes * log 256).
class AddedMatcher {
 public:
  void add(std::string pattern, const AddedToken* token) {
    if (pattern.empty()) return;
    patterns_.push_back({std::move(pattern), token});
  }
  // Builds the automaton over the contents added so far; call once, before split().
  void finish();
  bool empty() const { return patterns_.empty(); }

  // Splits s into text pieces and added tokens, dropping empty text pieces. With skip_special,
  // matches of special tokens are left in the text (tokenizers' encode_special_tokens: they are
  // still matched, so they hide any other token overlapping them, but not split out).
  void split(const std::string& s, bool skip_special, std::vector<Piece>* out) const;

 private:
  // The child of `node` by `byte`, or -1.
  int32_t child(int32_t node, uint8_t byte) const;

  struct Pattern {
    std::string text;
    const AddedToken* token;
  };
  struct TrieNode {
    int32_t depth = 0;     // bytes from the root: the length of the content it spells
    int32_t pattern = -1;  // index in patterns_ when a content ends here
    int32_t fail = 0;      // the longest proper suffix that is in the trie
    int32_t out = -1;      // the deepest node with a pattern among this node and its suffixes
  };
  std::vector<Pattern> patterns_;
  std::vector<TrieNode> nodes_;
  std::vector<int32_t> edge_start_;  // node → its children's range in edge_byte_/edge_child_
  std::vector<uint8_t> edge_byte_;
  std::vector<int32_t> edge_child_;
};

// The added tokens of a tokenizer. The matchers point into `list`: built in place, never copied.
struct AddedTokens {
  AddedTokens() = default;
  AddedTokens(const AddedTokens&) = delete;
  AddedTokens& operator=(const AddedTokens&) = delete;

  std::vector<AddedToken> list;  // file order
  std::unordered_map<std::string, int32_t> by_content;
  std::unordered_map<int32_t, size_t> by_id;  // → index in `list`
  AddedMatcher raw_matcher;                   // normalized == false, matched on the input
  AddedMatcher normalized_matcher;            // normalized == true, matched on normalized pieces
};

// Reads tokenizer.json's "added_tokens" (null: none) into `out` and builds its matchers. Each id
// must be the one tokenizers assigns: the model's id for a content already in its vocabulary,
// else the next free id after the vocabulary in file order; ids of kMaxTokenId or more and an id
// shared with a model token are refused. Errors name the JSON path.
void parse_added_tokens(const Node& n, const Bpe& model, const Normalizer& normalizer,
                        AddedTokens* out);

}  // namespace lvx::models::tokenization
