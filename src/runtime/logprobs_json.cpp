// New tokens' log-probabilities in OpenAI's shape; see logprobs_json.h.
#include "src/runtime/logprobs_json.h"

#include <string>
#include <vector>

#include "src/common/error.h"

namespace lvx::runtime {

namespace {

// A token's own bytes; none for an id the tokenizer does not have (a checkpoint's head often has
// rows past its vocabulary, padded to a multiple of 64 or 128: they still hold probability).
std::string bytes_of(const models::Tokenizer& tok, int64_t id) {
  if (id < 0 || id >= tok.id_limit()) return "";
  try {
    return tok.decode_bytes({id});
  } catch (const Error&) {
    return "";
  }
}

nlohmann::json one(const models::Tokenizer& tok, int64_t id, double logprob) {
  const std::string raw = bytes_of(tok, id);
  std::vector<int> bytes(raw.begin(), raw.end());
  for (int& b : bytes) b &= 0xFF;
  // The text as tokenizers decodes the token alone (invalid UTF-8 as U+FFFD).
  const std::string text = raw.empty() ? "" : tok.decode({id});
  return {{"token", text}, {"logprob", logprob}, {"bytes", bytes}};
}

}  // namespace

nlohmann::json logprob_json(const models::Tokenizer& tok, const TokenLogprobs& t) {
  nlohmann::json j = one(tok, t.token, t.logprob);
  j["top_logprobs"] = nlohmann::json::array();
  for (const auto& [id, lp] : t.top) j["top_logprobs"].push_back(one(tok, id, lp));
  return j;
}

}  // namespace lvx::runtime
