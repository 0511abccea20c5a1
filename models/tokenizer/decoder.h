// tokenizer.json's decoder: tokens back to text. ByteLevel maps each character of GPT-2's
// alphabet back to its byte (a token with another character, e.g. an added token with a space,
// is taken as its own UTF-8 bytes) and replaces invalid UTF-8 by U+FFFD as tokenizers does; no
// decoder joins the tokens with spaces, as tokenizers does. Internal to models/tokenizer/.
#pragma once

#include <string>
#include <vector>

#include "models/tokenizer/json_node.h"

namespace lvx::models::tokenization {

struct Decoder {
  bool byte_level = false;  // null decoder: false

  // The text of `tokens` (token strings as stored: byte-level characters, or added contents).
  std::string decode(const std::vector<const std::string*>& tokens) const;
  // The same bytes before invalid UTF-8 is replaced (a token holding part of a character keeps
  // its bytes).
  std::string bytes(const std::vector<const std::string*>& tokens) const;
};

// Reads tokenizer.json's "decoder" (null or ByteLevel). Errors name the JSON path.
void parse_decoder(const Node& n, Decoder* out);

}  // namespace lvx::models::tokenization
