// Which request fields lvx serve reads, and what it answers for the others; see request_fields.h.
#include "src/serve/request_fields.h"

#include <map>
#include <set>
#include <string>

#include "src/serve/openai_api.h"

namespace lvx::serve {

using json = nlohmann::json;

namespace {

// The request fields each endpoint reads (openai_api.h): what both read, and each one's own;
// any other is refused by name rather than ignored.
std::set<std::string> fields_with(std::initializer_list<const char*> own) {
  std::set<std::string> k = {"model",
                             "max_tokens",
                             "temperature",
                             "top_p",
                             "seed",
                             "stop",
                             "stream",
                             "stream_options",
                             "n",
                             "user",
                             "logprobs",
                             "fps",
                             "num_frames",
                             "start",
                             "end",
                             "video_id",
                             "return_prompt_ids",
                             "media_io_kwargs",
                             "mm_processor_kwargs"};
  k.insert(own.begin(), own.end());
  return k;
}

// Fields that OpenAI's API or vLLM accept and lvx serve does not: what to do instead (issue:
// a refusal of what a peer accepts says what to do). A neutral value (a penalty of 0, an empty
// logit_bias, a text response_format, tool_choice "none") is accepted: clients send them as
// defaults.
const char* instead_of(const std::string& key) {
  static const std::map<std::string, const char*> hints = {
      {"tools", "lvx serve has no tool calling: describe the tool's output format in the prompt"},
      {"tool_choice", "lvx serve has no tool calling (\"none\" is accepted)"},
      {"functions", "lvx serve has no function calling: describe the format in the prompt"},
      {"response_format",
       "lvx serve has no constrained decoding ({\"type\": \"text\"} is accepted): ask for the "
       "format in the prompt and check the answer"},
      {"frequency_penalty", "lvx serve applies no penalties: send 0 or leave it out"},
      {"presence_penalty", "lvx serve applies no penalties: send 0 or leave it out"},
      {"repetition_penalty", "lvx serve applies no penalties: send 1 or leave it out"},
      {"logit_bias", "lvx serve applies no logit bias: send {} or leave it out"},
      {"best_of", "send n requests without a seed (each samples afresh) and pick among them"},
      {"audio", "lvx serve answers in text only"},
      {"modalities", "lvx serve answers in text only ([\"text\"] is accepted)"},
  };
  const auto it = hints.find(key);
  return it == hints.end() ? nullptr : it->second;
}

// Whether a field a peer accepts holds its neutral value (what clients send as a default).
bool neutral(const std::string& key, const json& v) {
  if (key == "frequency_penalty" || key == "presence_penalty")
    return v.is_number() && v.get<double>() == 0;
  if (key == "repetition_penalty") return v.is_number() && v.get<double>() == 1;
  if (key == "logit_bias") return v.is_null() || (v.is_object() && v.empty());
  if (key == "tool_choice") return v == "none";
  if (key == "tools" || key == "functions") return v.is_null() || (v.is_array() && v.empty());
  if (key == "response_format")
    return v.is_null() || (v.is_object() && v.size() == 1 && v.value("type", "") == "text");
  if (key == "modalities") return v == json::array({"text"});
  return false;
}

}  // namespace

namespace {

void check_fields(const json& body, const std::set<std::string>& known, const char* supported) {
  for (const auto& [key, value] : body.items()) {
    if (known.count(key)) continue;
    if (const char* hint = instead_of(key)) {
      if (neutral(key, value)) continue;
      throw bad_request("'" + key + "' is not supported: " + hint, key);
    }
    throw bad_request(
        "'" + preview(key) + "' is not supported by lvx serve (supported: " + supported + ")",
        preview(key));
  }
}

}  // namespace

void check_request_fields(const json& body) {
  static const std::set<std::string> known =
      fields_with({"messages", "max_completion_tokens", "top_logprobs"});
  check_fields(body, known,
               "model, messages, max_tokens, max_completion_tokens, temperature, top_p, seed, "
               "stop, stream, stream_options, n, user, logprobs, top_logprobs, fps, num_frames, "
               "start, end, video_id, return_prompt_ids, media_io_kwargs, mm_processor_kwargs");
}

void check_completion_fields(const json& body) {
  static const std::set<std::string> known = fields_with({"prompt", "echo", "suffix"});
  check_fields(body, known,
               "model, prompt, max_tokens, temperature, top_p, seed, stop, stream, "
               "stream_options, n, user, logprobs (0), echo (false), suffix (null), "
               "return_prompt_ids, fps, num_frames, start, end, video_id, media_io_kwargs, "
               "mm_processor_kwargs");
}

}  // namespace lvx::serve
