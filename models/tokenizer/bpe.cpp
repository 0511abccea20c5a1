// The BPE model; see bpe.h.
#include "models/tokenizer/bpe.h"

#include <array>
#include <functional>
#include <queue>
#include <utility>

#include "models/tokenizer/utf8.h"

namespace lvx::models::tokenization {

void Bpe::tokenize(const std::string& word, std::vector<int64_t>* out) const {
  if (ignore_merges) {
    const auto it = vocab.find(word);
    if (it != vocab.end()) {
      out->push_back(it->second);
      return;
    }
  }
  const bool cacheable = word.size() <= kCacheWordBytes;
  if (cacheable) {
    std::lock_guard<std::mutex> lock(cache_mutex);
    const auto it = cache.find(word);
    if (it != cache.end()) {
      out->insert(out->end(), it->second.begin(), it->second.end());
      return;
    }
  }
  std::vector<int32_t> ids = merge_word(word);
  out->insert(out->end(), ids.begin(), ids.end());
  if (cacheable) {
    std::lock_guard<std::mutex> lock(cache_mutex);
    if (cache.size() < kCacheEntries) cache.emplace(word, std::move(ids));
  }
}

std::vector<int32_t> Bpe::merge_word(std::string_view w) const {
  struct Symbol {
    int32_t id;
    int32_t prev, next;
    size_t len;  // bytes; 0 once merged into its left neighbour
  };
  std::vector<Symbol> sym;
  sym.reserve(w.size());
  auto add = [&](int32_t id, size_t len) {
    const auto n = static_cast<int32_t>(sym.size());
    if (n > 0) sym.back().next = n;
    sym.push_back({id, n - 1, -1, len});
  };
  int32_t pending_unk_len = 0;
  for (size_t i = 0; i < w.size();) {
    const size_t len = char_len(w, i);
    int32_t id = -1;
    const auto c = char_ids.find(code_point(w, i, len));
    if (c != char_ids.end()) id = c->second;
    if (id >= 0) {
      if (pending_unk_len > 0) add(unk_id, pending_unk_len);
      pending_unk_len = 0;
      add(id, len);
    } else if (unk_id >= 0) {
      if (pending_unk_len > 0 && !fuse_unk) {
        add(unk_id, pending_unk_len);
        pending_unk_len = 0;
      }
      pending_unk_len += static_cast<int32_t>(len);
    }  // else: tokenizers drops a character it has no token for
    i += len;
  }
  if (pending_unk_len > 0) add(unk_id, pending_unk_len);

  struct Candidate {
    int32_t rank, pos, id;
    bool operator>(const Candidate& o) const {
      return rank != o.rank ? rank > o.rank : pos > o.pos;
    }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<Candidate>> queue;
  auto consider = [&](int32_t pos) {
    const Symbol& a = sym[pos];
    if (a.next < 0) return;
    const auto m = merges.find(key(a.id, sym[a.next].id));
    if (m != merges.end()) queue.push({m->second.rank, pos, m->second.id});
  };
  for (int32_t i = 0; i + 1 < static_cast<int32_t>(sym.size()); ++i) consider(i);
  while (!queue.empty()) {
    const Candidate top = queue.top();
    queue.pop();
    Symbol& left = sym[top.pos];
    if (left.len == 0 || left.next < 0) continue;
    const Symbol right = sym[left.next];
    // A stale candidate: the pair at pos changed since it was queued.
    const auto m = merges.find(key(left.id, right.id));
    if (m == merges.end() || m->second.id != top.id) continue;
    sym[left.next].len = 0;
    left.id = top.id;
    left.len += right.len;
    left.next = right.next;
    if (right.next >= 0) sym[right.next].prev = top.pos;
    if (left.prev >= 0) consider(left.prev);
    consider(top.pos);
  }
  std::vector<int32_t> ids;
  for (const Symbol& s : sym)
    if (s.len > 0) ids.push_back(s.id);
  return ids;
}

namespace {

// The model's type and options: BPE without dropout, subword affixes or byte fallback; fuse_unk
// and ignore_merges are kept.
void parse_bpe_options(const Node& n, Bpe* bpe) {
  const std::string type = n.type();
  if (type != "BPE") {
    n.child("type").fail("unsupported model type \"" + type + "\" (supported: BPE)");
  }
  n.only_fields({"type", "dropout", "unk_token", "continuing_subword_prefix", "end_of_word_suffix",
                 "fuse_unk", "byte_fallback", "ignore_merges", "vocab", "merges"});
  const Node dropout = n.child("dropout");
  if (!dropout.is_null() && (!dropout.value().is_number() || dropout.value().get<double>() != 0)) {
    dropout.fail("BPE dropout " + dropout.shown() + " is not supported (only null or 0)");
  }
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    const Node v = n.child(key);
    if (!v.is_null() && !v.str().empty()) {
      v.fail(std::string(key) + " " + v.shown() + " is not supported (only null or \"\")");
    }
  }
  if (n.flag("byte_fallback", false)) {
    n.child("byte_fallback").fail("byte_fallback true is not supported");
  }
  bpe->fuse_unk = n.flag("fuse_unk", false);
  bpe->ignore_merges = n.flag("ignore_merges", false);
}

// model.vocab: each token's id, in range and its own; a token of one valid UTF-8 character is
// also found by its code point.
void parse_vocab(const Node& vocab, Bpe* bpe) {
  vocab.expect_object();
  bpe->vocab.reserve(vocab.size());
  for (const auto& [token, v] : vocab.value().items()) {
    const Node id_node = vocab.child(token);
    const int64_t id = id_node.integer();
    if (id < 0 || id >= kMaxTokenId) {
      id_node.fail("id " + std::to_string(id) + " of token " + json(token).dump() +
                   " is out of range (ids go from 0 to " + std::to_string(kMaxTokenId - 1) + ")");
    }
    const auto id32 = static_cast<int32_t>(id);
    if (static_cast<size_t>(id) >= bpe->tokens.size()) bpe->tokens.resize(id + 1, nullptr);
    if (bpe->tokens[id]) {
      id_node.fail("id " + std::to_string(id) + " of token " + json(token).dump() +
                   " is also the id of " + json(*bpe->tokens[id]).dump());
    }
    bpe->tokens[id] = &bpe->vocab.emplace(token, id32).first->first;
    const size_t len = token.empty() ? 0 : char_len(token, 0);
    if (!token.empty() && len == token.size() && first_invalid_utf8(token) == std::string::npos) {
      bpe->char_ids[code_point(token, 0, len)] = id32;
    }
  }
}

// One merge's left and right tokens, from "a b" (the older form) or [a, b].
std::pair<std::string, std::string> merge_pair(const Node& m) {
  std::string a, b;
  if (m.value().is_string()) {  // "a b", the older form (Qwen2's file)
    const std::string s = m.str();
    const size_t sp = s.find(' ');
    if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos) {
      m.fail("expected \"<left> <right>\" (two tokens and one space), got " + m.shown());
    }
    a = s.substr(0, sp);
    b = s.substr(sp + 1);
  } else if (m.value().is_array() && m.size() == 2) {  // [a, b], what tokenizers 0.22 writes
    a = m.item(0).str();
    b = m.item(1).str();
  } else {
    m.fail("expected \"<left> <right>\" or [left, right], got " + m.shown());
  }
  return {a, b};
}

// model.merges, ranked by position: both tokens and the merged one must be in the vocab.
void parse_merges(const Node& merges, Bpe* bpe) {
  merges.expect_array();
  bpe->merges.reserve(merges.size());
  for (size_t i = 0; i < merges.size(); ++i) {
    const Node m = merges.item(i);
    const auto [a, b] = merge_pair(m);
    const std::string merged = a + b;
    for (const std::string* t : std::array<const std::string*, 3>{&a, &b, &merged}) {
      if (!bpe->vocab.count(*t)) m.fail("token " + json(*t).dump() + " is not in model.vocab");
    }
    // A repeated pair keeps the later rank, as tokenizers' map does.
    bpe->merges[Bpe::key(bpe->vocab[a], bpe->vocab[b])] = {static_cast<int32_t>(i),
                                                           bpe->vocab[merged]};
  }
}

}  // namespace

void parse_bpe(const Node& n, Bpe* bpe) {
  parse_bpe_options(n, bpe);
  parse_vocab(n.required("vocab"), bpe);

  const Node unk = n.child("unk_token");
  if (!unk.is_null()) {
    const auto it = bpe->vocab.find(unk.str());
    if (it == bpe->vocab.end()) unk.fail("unk_token " + unk.shown() + " is not in model.vocab");
    bpe->unk_id = it->second;
  }

  parse_merges(n.required("merges"), bpe);
}

}  // namespace lvx::models::tokenization
