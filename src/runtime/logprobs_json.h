// New tokens' log-probabilities (runtime/generate.h TokenLogprobs) in OpenAI's shape, what
// `logprobs: true, top_logprobs: N` asks of a chat completion: per token
//   {"token": its text, "logprob": ..., "bytes": [its UTF-8 bytes],
//    "top_logprobs": [{"token", "logprob", "bytes"}, ... N, most likely first]}.
// A token's text is the tokenizer's decoding of it alone: a byte-level token that holds part of
// a character has bytes that are not UTF-8 by themselves (its text shows U+FFFD, its bytes are
// its own: Tokenizer::decode_bytes), so the bytes of the tokens add up to the answer's. An id past the tokenizer's vocabulary (a head padded
// beyond it) has no text: "" and no bytes.
#pragma once

#include <nlohmann/json.hpp>

#include "models/tokenizer/tokenizer.h"
#include "src/runtime/generate.h"

namespace lvx::runtime {

nlohmann::json logprob_json(const models::Tokenizer& tok, const TokenLogprobs& t);

}  // namespace lvx::runtime
