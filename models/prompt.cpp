#include "models/prompt.h"

#include "src/common/error.h"

namespace lvx::models {

int64_t special_token_id(const Tokenizer& tok, const std::string& token) {
  const auto id = tok.token_to_id(token);
  LVX_CHECK(id.has_value(), "the tokenizer has no ", token, " token (needed by the prompt)");
  return *id;
}

void check_prompt_request(const std::string& question, int64_t frames) {
  LVX_CHECK(question.find_first_not_of(" \t\r\n") != std::string::npos, "the question is empty");
  LVX_CHECK(frames >= 0, "a prompt's frame count must be >= 0, got ", frames);
}

void PromptBuilder::add(const std::vector<int64_t>& ids, bool learn) {
  p_.ids.insert(p_.ids.end(), ids.begin(), ids.end());
  for (int64_t id : ids) p_.labels.push_back(learn ? id : -100);
}

void PromptBuilder::text(const std::string& s, bool learn) {
  add(tok_.encode(s, /*add_special_tokens=*/false, /*split_special_tokens=*/true), learn);
}

void PromptBuilder::special(const std::string& token, bool learn) {
  add({special_token_id(tok_, token)}, learn);
}

PromptTokens PromptBuilder::finish() && {
  // Position t predicts token t + 1.
  if (!p_.labels.empty()) {
    p_.labels.erase(p_.labels.begin());
    p_.labels.push_back(-100);
  }
  return std::move(p_);
}

}  // namespace lvx::models
