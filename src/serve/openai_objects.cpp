// The response objects of both endpoints (openai_api.h): chat.completion and its chunks, and
// their text_completion forms for /v1/completions.
#include "src/serve/openai_api.h"

namespace lvx::serve {

using nlohmann::json;

json usage_json(int64_t prompt_tokens, int64_t completion_tokens) {
  return {{"prompt_tokens", prompt_tokens},
          {"completion_tokens", completion_tokens},
          {"total_tokens", prompt_tokens + completion_tokens}};
}

json completion_json(const std::string& id, int64_t created, const std::string& model,
                     const std::string& content, const std::string& finish_reason,
                     int64_t prompt_tokens, int64_t completion_tokens, const json& logprobs) {
  return {{"id", id},
          {"object", "chat.completion"},
          {"created", created},
          {"model", model},
          {"choices",
           {{{"index", 0},
             {"message", {{"role", "assistant"}, {"content", content}}},
             {"logprobs", logprobs.is_null() ? json() : json{{"content", logprobs}}},
             {"finish_reason", finish_reason}}}},
          {"usage", usage_json(prompt_tokens, completion_tokens)}};
}

json chunk_json(const std::string& id, int64_t created, const std::string& model, const json& delta,
                const json& finish_reason, const json& logprobs, int64_t index) {
  return {{"id", id},
          {"object", "chat.completion.chunk"},
          {"created", created},
          {"model", model},
          {"choices",
           {{{"index", index},
             {"delta", delta},
             {"logprobs", logprobs.is_null() ? json() : json{{"content", logprobs}}},
             {"finish_reason", finish_reason}}}}};
}

json as_text_completion(json j) {
  const bool chunk = j.value("object", "") == "chat.completion.chunk";
  j["object"] = "text_completion";
  for (json& c : j["choices"]) {
    const char* part = chunk ? "delta" : "message";
    std::string text;
    if (c.contains(part) && c[part].contains("content") && c[part]["content"].is_string())
      text = c[part]["content"].get<std::string>();
    c.erase(part);
    c["text"] = text;
    c["logprobs"] = nullptr;
  }
  return j;
}

}  // namespace lvx::serve
