// Added tokens and their Aho-Corasick matching; see added_tokens.h.
#include "models/tokenizer/added_tokens.h"

#include <algorithm>
#include <limits>
#include <string_view>
#include <utility>

#include "models/tokenizer/utf8.h"
#include "src/common/error.h"

namespace lvx::models::tokenization {
namespace {

bool ends_with_word(std::string_view s) {
  const size_t b = previous_char_start(s, s.size());
  return is_word_char(code_point(s, b, s.size() - b));
}
bool starts_with_word(std::string_view s, size_t i) {
  return is_word_char(code_point(s, i, char_len(s, i)));
}
size_t leftmost_space_at_end(std::string_view s, size_t end) {
  while (end > 0) {
    const size_t b = previous_char_start(s, end);
    if (!is_white_space(code_point(s, b, end - b))) break;
    end = b;
  }
  return end;
}
size_t rightmost_space_at_start(std::string_view s, size_t i) {
  while (i < s.size()) {
    const size_t len = char_len(s, i);
    if (!is_white_space(code_point(s, i, len))) break;
    i += len;
  }
  return i;
}

}  // namespace

void AddedMatcher::finish() {
  // Reversed contents in sorted order (equal ones: the first added wins, as the file order
  // decides in tokenizers), inserted into a trie whose nodes come out in preorder.
  std::vector<std::pair<std::string, size_t>> rev;
  rev.reserve(patterns_.size());
  for (size_t i = 0; i < patterns_.size(); ++i)
    rev.emplace_back(std::string(patterns_[i].text.rbegin(), patterns_[i].text.rend()), i);
  std::sort(rev.begin(), rev.end());
  struct Edge {
    int32_t parent;
    uint8_t byte;
    int32_t child;
  };
  std::vector<Edge> edges;
  nodes_.assign(1, TrieNode{});
  std::vector<int32_t> path{0};  // the previous content's nodes by depth
  const std::string* prev = nullptr;
  for (const auto& [r, index] : rev) {
    size_t common = 0;
    if (prev) {
      const size_t limit = std::min(prev->size(), r.size());
      while (common < limit && (*prev)[common] == r[common]) ++common;
    }
    path.resize(common + 1);
    for (size_t d = common; d < r.size(); ++d) {
      const auto id = static_cast<int32_t>(nodes_.size());
      LVX_CHECK(nodes_.size() < static_cast<size_t>(std::numeric_limits<int32_t>::max()),
                "tokenizer: added tokens too long in total");
      TrieNode n;
      n.depth = static_cast<int32_t>(d + 1);
      nodes_.push_back(n);
      edges.push_back({path.back(), static_cast<uint8_t>(r[d]), id});
      path.push_back(id);
    }
    TrieNode& end = nodes_[path.back()];
    if (end.pattern < 0) end.pattern = static_cast<int32_t>(index);
    prev = &r;
  }
  // Children per node, in byte order (edges were made in preorder, so a node's children are in
  // increasing byte order already).
  edge_start_.assign(nodes_.size() + 1, 0);
  for (const Edge& e : edges) ++edge_start_[e.parent + 1];
  for (size_t i = 1; i < edge_start_.size(); ++i) edge_start_[i] += edge_start_[i - 1];
  edge_byte_.resize(edges.size());
  edge_child_.resize(edges.size());
  std::vector<int32_t> fill(edge_start_.begin(), edge_start_.end() - 1);
  for (const Edge& e : edges) {
    const int32_t k = fill[e.parent]++;
    edge_byte_[k] = e.byte;
    edge_child_[k] = e.child;
  }
  edges.clear();
  edges.shrink_to_fit();
  // Failure links breadth first; out = the deepest accepting node among a node's suffixes.
  std::vector<int32_t> queue{0};
  nodes_[0].fail = 0;
  nodes_[0].out = nodes_[0].pattern >= 0 ? 0 : -1;
  for (size_t qi = 0; qi < queue.size(); ++qi) {
    const int32_t u = queue[qi];
    for (int32_t k = edge_start_[u]; k < edge_start_[u + 1]; ++k) {
      const int32_t c = edge_child_[k];
      int32_t f = 0;
      if (u != 0) {
        f = nodes_[u].fail;
        int32_t next = child(f, edge_byte_[k]);
        while (next < 0 && f != 0) {
          f = nodes_[f].fail;
          next = child(f, edge_byte_[k]);
        }
        f = next < 0 ? 0 : next;
      }
      nodes_[c].fail = f;
      nodes_[c].out = nodes_[c].pattern >= 0 ? c : nodes_[f].out;
      queue.push_back(c);
    }
  }
}

int32_t AddedMatcher::child(int32_t node, uint8_t byte) const {
  const auto b = edge_byte_.begin() + edge_start_[node];
  const auto e = edge_byte_.begin() + edge_start_[node + 1];
  const auto it = std::lower_bound(b, e, byte);
  return it != e && *it == byte ? edge_child_[it - edge_byte_.begin()] : -1;
}

void AddedMatcher::split(const std::string& s, bool skip_special, std::vector<Piece>* out) const {
  if (patterns_.empty()) {
    if (!s.empty()) out->push_back({s, -1});
    return;
  }
  // longest[i]: the accepting node of the longest content starting at s[i], or -1.
  std::vector<int32_t> longest(s.size(), -1);
  int32_t state = 0;
  for (size_t i = s.size(); i-- > 0;) {
    const auto byte = static_cast<uint8_t>(s[i]);
    int32_t next = child(state, byte);
    while (next < 0 && state != 0) {
      state = nodes_[state].fail;
      next = child(state, byte);
    }
    state = next < 0 ? 0 : next;
    longest[i] = nodes_[state].out;
  }
  size_t start_offset = 0;
  for (size_t pos = 0; pos < s.size();) {
    if (longest[pos] < 0) {
      ++pos;
      continue;
    }
    const TrieNode& hit = nodes_[longest[pos]];
    size_t start = pos, stop = pos + static_cast<size_t>(hit.depth);
    pos = stop;  // the next match is searched after this one's own end, as aho-corasick does
    const AddedToken& t = *patterns_[hit.pattern].token;
    if (skip_special && t.special) continue;
    if (t.single_word) {
      const bool space_before = start == 0 || !ends_with_word(std::string_view(s).substr(0, start));
      const bool space_after = stop == s.size() || !starts_with_word(s, stop);
      if (!space_before || !space_after) continue;
    }
    if (t.lstrip) start = std::max(leftmost_space_at_end(s, start), start_offset);
    if (t.rstrip) stop = rightmost_space_at_start(s, stop);
    if (start_offset < start) out->push_back({s.substr(start_offset, start - start_offset), -1});
    // stop can pass the next match's start (rstrip): the pieces then overlap, as in tokenizers.
    out->push_back({s.substr(start, stop - start), t.id});
    start_offset = stop;
  }
  if (start_offset < s.size()) out->push_back({s.substr(start_offset), -1});
}

void parse_added_tokens(const Node& n, const Bpe& model, const Normalizer& normalizer,
                        AddedTokens* out) {
  if (n.is_null()) return;
  n.expect_array();
  const auto model_size = static_cast<int64_t>(model.vocab.size());
  int64_t max_added = -1;  // the largest added id so far
  for (size_t i = 0; i < n.size(); ++i) {
    const Node e = n.item(i);
    e.expect_object();
    e.only_fields({"id", "content", "single_word", "lstrip", "rstrip", "normalized", "special"});
    AddedToken a;
    a.content = e.required("content").str();
    a.single_word = e.required("single_word").boolean();
    a.lstrip = e.required("lstrip").boolean();
    a.rstrip = e.required("rstrip").boolean();
    a.normalized = e.required("normalized").boolean();
    a.special = e.required("special").boolean();
    const int64_t id = e.required("id").integer();
    if (a.content.empty()) e.child("content").fail("empty content");
    if (out->by_content.count(a.content)) {
      e.child("content").fail(json(a.content).dump() + " is listed twice");
    }
    // The id tokenizers gives it when loading (it re-adds the tokens in file order): the model's
    // id for a token already in the vocabulary, else one past the largest added id at or above the
    // vocabulary size, else the vocabulary size.
    int64_t expected = 0;
    const auto in_model = model.vocab.find(a.content);
    if (in_model != model.vocab.end()) {
      expected = in_model->second;
    } else {
      expected = max_added >= 0 && (max_added >= model_size || model_size == 0) ? max_added + 1
                                                                                : model_size;
    }
    if (id != expected) {
      e.child("id").fail("id " + std::to_string(id) + " for " + json(a.content).dump() +
                         ", but tokenizers assigns " + std::to_string(expected) +
                         " (the model's id, or the next id after the vocabulary in file order)");
    }
    if (id >= kMaxTokenId) {
      e.child("id").fail("id " + std::to_string(id) + " for " + json(a.content).dump() +
                         " is out of range (ids go up to " + std::to_string(kMaxTokenId - 1) + ")");
    }
    // tokenizers would give a token outside the vocabulary the id of a model token when the
    // vocabulary has gaps: two tokens for one id, refused.
    if (in_model == model.vocab.end() && static_cast<size_t>(id) < model.tokens.size() &&
        model.tokens[id]) {
      e.child("id").fail("id " + std::to_string(id) + " for " + json(a.content).dump() +
                         " is also the id of model token " + json(*model.tokens[id]).dump());
    }
    a.id = static_cast<int32_t>(id);
    max_added = std::max(max_added, id);
    out->by_content[a.content] = a.id;
    out->list.push_back(std::move(a));
  }
  for (size_t i = 0; i < out->list.size(); ++i) out->by_id[out->list[i].id] = i;
  for (const AddedToken& a : out->list) {
    if (a.normalized) {
      out->normalized_matcher.add(normalizer.apply(a.content), &a);
    } else {
      out->raw_matcher.add(a.content, &a);
    }
  }
  out->raw_matcher.finish();
  out->normalized_matcher.finish();
}

}  // namespace lvx::models::tokenization
