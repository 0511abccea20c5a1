// The top-level fields of a chat-completions request that lvx serve reads (openai_api.h lists
// them), and the answer to any other: a 400 naming it, never silently ignored. Fields that
// OpenAI's API or vLLM accept and lvx does not apply (tools, response_format, penalties,
// logit_bias, best_of, ...) are refused saying what to do instead, and accepted at the neutral
// value clients send as a default (a penalty of 0, tools: [], {"type": "text"}, ...).
#pragma once

#include <nlohmann/json.hpp>

namespace lvx::serve {

// Throws ApiError 400 (param: the field) for the first field refused.
void check_request_fields(const nlohmann::json& body);
// The same for /v1/completions' fields (openai_api.h parse_completion_request).
void check_completion_fields(const nlohmann::json& body);

}  // namespace lvx::serve
