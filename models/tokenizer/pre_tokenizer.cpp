// Pre-tokenizers; see pre_tokenizer.h.
#include "models/tokenizer/pre_tokenizer.h"

#include <algorithm>
#include <string_view>
#include <utility>

#include "models/tokenizer/byte_level.h"

namespace lvx::models::tokenization {
namespace {

// Offsets of every part of s, matches flagged (tokenizers' Pattern::find_matches).
using Parts = std::vector<std::pair<std::pair<size_t, size_t>, bool>>;

Parts find_parts(const PreTokenizer& p, std::string_view s, const Regex* regex,
                 MatchBudget* budget) {
  Parts parts;
  if (s.empty()) {
    parts.push_back({{0, 0}, false});
    return parts;
  }
  std::vector<std::pair<size_t, size_t>> matches;
  if (regex) {
    regex->find_all(s, budget, &matches);
  } else if (!p.literal.empty()) {
    for (size_t at = s.find(p.literal); at != std::string_view::npos;
         at = s.find(p.literal, at + p.literal.size())) {
      matches.emplace_back(at, at + p.literal.size());
    }
  }
  size_t prev = 0;
  for (const auto& [b, e] : matches) {
    if (prev != b) parts.push_back({{prev, b}, false});
    parts.push_back({{b, e}, true});
    prev = e;
  }
  if (prev != s.size()) parts.push_back({{prev, s.size()}, false});
  return parts;
}

// tokenizers' NormalizedString::split: the parts kept under `behavior`, empty ones dropped.
void split_by(std::string_view s, Parts parts, Behavior behavior, std::vector<std::string>* out) {
  std::vector<std::pair<size_t, size_t>> kept;
  bool previous_match = false;
  switch (behavior) {
    case Behavior::kRemoved:
      for (const auto& [off, is_match] : parts)
        if (!is_match) kept.push_back(off);
      break;
    case Behavior::kIsolated:
      for (const auto& part : parts) kept.push_back(part.first);
      break;
    case Behavior::kContiguous:
      for (const auto& [off, is_match] : parts) {
        if (is_match == previous_match && !kept.empty()) {
          kept.back().second = off.second;
        } else {
          kept.push_back(off);
        }
        previous_match = is_match;
      }
      break;
    case Behavior::kMergedWithPrevious:
      for (const auto& [off, is_match] : parts) {
        if (is_match && !previous_match && !kept.empty()) {
          kept.back().second = off.second;
        } else {
          kept.push_back(off);
        }
        previous_match = is_match;
      }
      break;
    case Behavior::kMergedWithNext:
      for (auto it = parts.rbegin(); it != parts.rend(); ++it) {
        const auto& [off, is_match] = *it;
        if (is_match && !previous_match && !kept.empty()) {
          kept.back().first = off.first;
        } else {
          kept.push_back(off);
        }
        previous_match = is_match;
      }
      std::reverse(kept.begin(), kept.end());
      break;
  }
  for (const auto& [b, e] : kept)
    if (e > b) out->emplace_back(s.substr(b, e - b));
}

Behavior parse_behavior(const Node& n) {
  const std::string b = n.str();
  if (b == "Removed") return Behavior::kRemoved;
  if (b == "Isolated") return Behavior::kIsolated;
  if (b == "MergedWithPrevious") return Behavior::kMergedWithPrevious;
  if (b == "MergedWithNext") return Behavior::kMergedWithNext;
  if (b == "Contiguous") return Behavior::kContiguous;
  n.fail("unsupported split behavior \"" + b +
         "\" (supported: Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous)");
}

}  // namespace

void pre_tokenize(const PreTokenizer& p, const std::vector<std::string>& in, MatchBudget* budget,
                  std::vector<std::string>* out) {
  if (p.kind == PreTokenizer::Kind::kSplit) {
    for (const std::string& s : in) {
      Parts parts = find_parts(p, s, p.regex.get(), budget);
      if (p.invert)
        for (auto& part : parts) part.second = !part.second;
      split_by(s, std::move(parts), p.behavior, out);
    }
    return;
  }
  // ByteLevel: optional prefix space, optional GPT-2 regex split, then bytes → alphabet.
  const ByteAlphabet& alphabet = byte_alphabet();
  std::vector<std::string> words;
  for (const std::string& s : in) {
    std::string w = p.add_prefix_space && (s.empty() || s[0] != ' ') ? " " + s : s;
    if (p.use_regex) {
      Parts parts;
      std::vector<std::pair<size_t, size_t>> matches;
      gpt2_regex().find_all(w, budget, &matches);
      size_t prev = 0;
      for (const auto& [b, e] : matches) {
        if (prev != b) parts.push_back({{prev, b}, false});
        parts.push_back({{b, e}, true});
        prev = e;
      }
      if (prev != w.size()) parts.push_back({{prev, w.size()}, false});
      split_by(w, std::move(parts), Behavior::kIsolated, &words);
    } else if (!w.empty()) {
      words.push_back(std::move(w));
    }
  }
  for (const std::string& w : words) {
    std::string mapped;
    mapped.reserve(w.size() * 2);
    for (unsigned char c : w) mapped += alphabet.byte_to_utf8[c];
    out->push_back(std::move(mapped));
  }
}

void parse_pre_tokenizer(const Node& n, std::vector<PreTokenizer>* out) {
  if (n.is_null()) return;
  const std::string type = n.type();
  PreTokenizer p;
  if (type == "Sequence") {
    n.only_fields({"type", "pretokenizers"});
    const Node list = n.required("pretokenizers");
    list.expect_array();
    for (size_t i = 0; i < list.size(); ++i) parse_pre_tokenizer(list.item(i), out);
    return;
  } else if (type == "ByteLevel") {
    n.only_fields({"type", "add_prefix_space", "trim_offsets", "use_regex"});
    p.kind = PreTokenizer::Kind::kByteLevel;
    p.add_prefix_space = n.required("add_prefix_space").boolean();
    n.required("trim_offsets").boolean();  // offsets only
    p.use_regex = n.flag("use_regex", true);
  } else if (type == "Split") {
    n.only_fields({"type", "pattern", "behavior", "invert"});
    const Node pattern = n.required("pattern");
    pattern.expect_object();
    if (pattern.size() != 1) pattern.fail("expected {\"Regex\": ...} or {\"String\": ...}");
    if (pattern.value().contains("Regex")) {
      const Node re = pattern.child("Regex");
      p.regex = std::make_shared<Regex>(re.str(), re.where());
    } else if (pattern.value().contains("String")) {
      p.literal = pattern.child("String").str();
    } else {
      pattern.fail("unsupported pattern " + pattern.shown() + " (supported: Regex, String)");
    }
    p.behavior = parse_behavior(n.required("behavior"));
    p.invert = n.required("invert").boolean();
  } else {
    n.child("type").fail("unsupported pre-tokenizer \"" + type +
                         "\" (supported: ByteLevel, Split, Sequence)");
  }
  out->push_back(std::move(p));
}

}  // namespace lvx::models::tokenization
