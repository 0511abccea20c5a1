// tokenizer.json's pre_tokenizer: Split (a regex or a literal, with tokenizers' five split
// behaviors and invert), ByteLevel (optional prefix space, optional GPT-2 regex split, then bytes
// as GPT-2's alphabet), or a Sequence of these, turning text into the words BPE merges.
// Internal to models/tokenizer/.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "models/tokenizer/json_node.h"
#include "models/tokenizer/regex.h"

namespace lvx::models::tokenization {

enum class Behavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

struct PreTokenizer {
  enum class Kind { kSplit, kByteLevel } kind = Kind::kSplit;
  // Split
  std::shared_ptr<Regex> regex;  // null: literal
  std::string literal;
  Behavior behavior = Behavior::kIsolated;
  bool invert = false;
  // ByteLevel
  bool add_prefix_space = false;
  bool use_regex = true;
};

// Appends the words of every string of `in` (tokenizers' PreTokenizer::pre_tokenize_str, empty
// words dropped). Regex work is charged to `budget`.
void pre_tokenize(const PreTokenizer& p, const std::vector<std::string>& in, MatchBudget* budget,
                  std::vector<std::string>* out);

// Appends the steps of tokenizer.json's "pre_tokenizer" (null: none; a Sequence flattened).
// Errors name the JSON path (a regex PCRE2 cannot compile included).
void parse_pre_tokenizer(const Node& n, std::vector<PreTokenizer>* out);

}  // namespace lvx::models::tokenization
