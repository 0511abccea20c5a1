// The tokenizer: tokenizer.json's parts (models/tokenizer/*.h) put together in tokenizers'
// pipeline; see tokenizer.h for the pipeline and what is supported. The steps follow the
// `tokenizers` crate (0.22) closely enough to give the same ids, including its quirks (an
// rstrip'ed added token can overlap the next one; empty regex matches split text).
#include "models/tokenizer/tokenizer.h"

#include <algorithm>
#include <limits>
#include <nlohmann/json.hpp>
#include <utility>

#include "models/tokenizer/added_tokens.h"
#include "models/tokenizer/bpe.h"
#include "models/tokenizer/decoder.h"
#include "models/tokenizer/json_node.h"
#include "models/tokenizer/normalizer.h"
#include "models/tokenizer/post_processor.h"
#include "models/tokenizer/pre_tokenizer.h"
#include "models/tokenizer/regex.h"
#include "models/tokenizer/utf8.h"
#include "src/common/error.h"
#include "src/common/files.h"

namespace lvx::models {

using namespace tokenization;  // NOLINT(build/namespaces): this file composes its parts

struct Tokenizer::Impl {
  std::string name;
  Bpe model;
  Normalizer normalizer;
  std::vector<PreTokenizer> pre_tokenizers;
  std::vector<PostProcessor> post_processors;
  Decoder decoder;
  AddedTokens added;
  int64_t vocab_size = 0;
  int64_t id_limit = 0;

  const std::string* token(int64_t id) const {
    if (id < 0 || id > std::numeric_limits<int32_t>::max()) return nullptr;
    const auto it = added.by_id.find(static_cast<int32_t>(id));
    if (it != added.by_id.end()) return &added.list[it->second].content;
    if (static_cast<size_t>(id) < model.tokens.size()) return model.tokens[id];
    return nullptr;
  }

  void tokenize_text(const std::string& text, MatchBudget* budget,
                     std::vector<int64_t>* ids) const {
    std::vector<std::string> words{text}, next;
    for (const PreTokenizer& p : pre_tokenizers) {
      next.clear();
      pre_tokenize(p, words, budget, &next);
      words.swap(next);
    }
    for (const std::string& w : words) model.tokenize(w, ids);
  }
};

namespace {

std::shared_ptr<Tokenizer::Impl> load(const json& root, const std::string& name) {
  auto t = std::make_shared<Tokenizer::Impl>();
  t->name = name;
  const Node r(root, "", t->name);
  r.expect_object();
  r.only_fields({"version", "truncation", "padding", "added_tokens", "normalizer", "pre_tokenizer",
                 "post_processor", "decoder", "model"});
  const Node version = r.child("version");
  if (!version.is_null() && version.str() != "1.0") {
    version.fail("unsupported version " + version.shown() + " (supported: \"1.0\")");
  }
  for (const char* key : {"truncation", "padding"}) {
    const Node v = r.child(key);
    if (!v.is_null()) v.fail("not supported (must be null), got " + v.shown());
  }
  parse_bpe(r.required("model"), &t->model);
  parse_normalizer(r.child("normalizer"), &t->normalizer);
  parse_added_tokens(r.child("added_tokens"), t->model, t->normalizer, &t->added);
  parse_pre_tokenizer(r.child("pre_tokenizer"), &t->pre_tokenizers);
  parse_post_processor(
      r.child("post_processor"), [&](int64_t id) { return t->token(id) != nullptr; },
      &t->post_processors);
  parse_decoder(r.child("decoder"), &t->decoder);

  t->vocab_size = static_cast<int64_t>(t->model.vocab.size());
  t->id_limit = static_cast<int64_t>(t->model.tokens.size());
  for (const AddedToken& a : t->added.list) {
    if (!t->model.vocab.count(a.content)) ++t->vocab_size;
    t->id_limit = std::max<int64_t>(t->id_limit, int64_t{a.id} + 1);
  }
  return t;
}

}  // namespace

Tokenizer Tokenizer::from_json_string(const std::string& json_text, const std::string& name) {
  // Nesting is bounded while parsing (a 100k-deep normalizer list is refused, not built).
  return Tokenizer(load(parse_json(json_text, name), name));
}

Tokenizer Tokenizer::from_file(const std::string& path) {
  // read_json_file's steps, with errors that start with the path as the others here do: a regular
  // file of at most kMaxJsonBytes (a FIFO or a directory is refused at once), nesting bounded.
  return Tokenizer(load(parse_json(read_file(path, "tokenizer file"), path), path));
}

std::vector<int64_t> Tokenizer::encode(const std::string& utf8, bool add_special_tokens,
                                       bool split_special_tokens) const {
  const Impl& t = *impl_;
  const size_t bad = first_invalid_utf8(utf8);
  LVX_CHECK(bad == std::string::npos, t.name, ": encode: input is not valid UTF-8 (byte offset ",
            bad, " of ", utf8.size(), ")");
  std::vector<int64_t> ids;
  std::vector<Piece> raw, pieces;
  MatchBudget budget(utf8.size());
  t.added.raw_matcher.split(utf8, split_special_tokens, &raw);
  for (const Piece& r : raw) {
    if (r.id >= 0) {
      ids.push_back(r.id);
      continue;
    }
    pieces.clear();
    t.added.normalized_matcher.split(t.normalizer.apply(r.text), split_special_tokens, &pieces);
    for (const Piece& p : pieces) {
      if (p.id >= 0) {
        ids.push_back(p.id);
      } else {
        t.tokenize_text(p.text, &budget, &ids);
      }
    }
  }
  if (add_special_tokens) {
    for (const PostProcessor& p : t.post_processors) ids = p.apply(ids);
  }
  return ids;
}

std::string Tokenizer::decode(const std::vector<int64_t>& ids, bool skip_special_tokens) const {
  return impl_->decoder.decode(tokens_of(ids, skip_special_tokens));
}

std::string Tokenizer::decode_bytes(const std::vector<int64_t>& ids) const {
  return impl_->decoder.bytes(tokens_of(ids, false));
}

std::vector<const std::string*> Tokenizer::tokens_of(const std::vector<int64_t>& ids,
                                                     bool skip_special_tokens) const {
  const Impl& t = *impl_;
  std::vector<const std::string*> tokens;
  tokens.reserve(ids.size());
  for (int64_t id : ids) {
    const std::string* tok = t.token(id);
    LVX_CHECK(tok != nullptr, t.name, ": decode: id ", id,
              " is not in the vocabulary (ids go up to ", t.id_limit - 1, ")");
    if (skip_special_tokens) {
      const auto it = t.added.by_content.find(*tok);
      if (it != t.added.by_content.end() && t.added.list[t.added.by_id.at(it->second)].special) {
        continue;
      }
    }
    tokens.push_back(tok);
  }
  return tokens;
}

std::optional<int64_t> Tokenizer::token_to_id(const std::string& token) const {
  const auto a = impl_->added.by_content.find(token);
  if (a != impl_->added.by_content.end()) return a->second;
  const auto m = impl_->model.vocab.find(token);
  if (m != impl_->model.vocab.end()) return m->second;
  return std::nullopt;
}

std::string Tokenizer::id_to_token(int64_t id) const {
  const std::string* tok = impl_->token(id);
  LVX_CHECK(tok != nullptr, impl_->name, ": id ", id, " is not in the vocabulary");
  return *tok;
}

bool Tokenizer::is_special(int64_t id) const {
  if (id < 0 || id > std::numeric_limits<int32_t>::max()) return false;
  const auto it = impl_->added.by_id.find(static_cast<int32_t>(id));
  return it != impl_->added.by_id.end() && impl_->added.list[it->second].special;
}

int64_t Tokenizer::vocab_size() const { return impl_->vocab_size; }
int64_t Tokenizer::id_limit() const { return impl_->id_limit; }

}  // namespace lvx::models
