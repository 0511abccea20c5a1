// Building a family's prompt (models/family.h, Family::prompt): the template's pieces appended in
// order (plain text, the template's own special tokens, the answer), each piece's labels kept
// beside its ids, then the labels shifted to lvx forward's convention. Shared by every family's
// template so that the rules (text never yields a special token; the loss is on the answer) are
// written once.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "models/family.h"
#include "models/tokenizer/tokenizer.h"

namespace lvx::models {

class PromptBuilder {
 public:
  explicit PromptBuilder(const Tokenizer& tok) : tok_(tok) {}

  // Text (the user's question, options and answer among it) never yields a special token: one
  // written in it ("<|image|>") is plain text. `learn`: the tokens are part of the answer.
  void text(const std::string& s, bool learn = false);
  // One of the template's own special tokens, as its id; an error names the token the tokenizer
  // lacks.
  void special(const std::string& token, bool learn = false);
  // Whether the tokenizer has `token` (templates that adapt to the release's vocabulary).
  bool has(const std::string& token) const { return tok_.token_to_id(token).has_value(); }

  // The prompt, labels shifted: position t predicts token t + 1 (the last position −100).
  PromptTokens finish() &&;

 private:
  void add(const std::vector<int64_t>& ids, bool learn);

  const Tokenizer& tok_;
  PromptTokens p_;
};

// The id of the special token `token`; an error names it.
int64_t special_token_id(const Tokenizer& tok, const std::string& token);

// The checks every template makes first: a non-empty question and no negative frame count (0: a
// text-only prompt, lvx serve's chat without a video: the template as its processor renders a
// message without media).
void check_prompt_request(const std::string& question, int64_t frames);

}  // namespace lvx::models
