// Decoders; see decoder.h.
#include "models/tokenizer/decoder.h"

#include "models/tokenizer/byte_level.h"
#include "models/tokenizer/utf8.h"

namespace lvx::models::tokenization {

std::string Decoder::decode(const std::vector<const std::string*>& tokens) const {
  return byte_level ? utf8_lossy(bytes(tokens)) : bytes(tokens);
}

std::string Decoder::bytes(const std::vector<const std::string*>& tokens) const {
  std::string out;
  if (!byte_level) {  // tokenizers without a decoder: tokens joined by spaces
    for (size_t i = 0; i < tokens.size(); ++i) {
      if (i) out += ' ';
      out += *tokens[i];
    }
    return out;
  }
  // ByteLevel: each character back to its byte; a token with a character outside the alphabet
  // (e.g. an added token with a space) is taken as its own UTF-8 bytes.
  const ByteAlphabet& alphabet = byte_alphabet();
  std::string bytes, mapped;
  for (const std::string* tok : tokens) {
    mapped.clear();
    bool all_mapped = true;
    for (size_t i = 0; i < tok->size();) {
      const size_t len = char_len(*tok, i);
      const uint32_t cp = code_point(*tok, i, len);
      if (cp >= alphabet.cp_to_byte.size() || alphabet.cp_to_byte[cp] < 0) {
        all_mapped = false;
        break;
      }
      mapped += static_cast<char>(alphabet.cp_to_byte[cp]);
      i += len;
    }
    bytes += all_mapped ? mapped : *tok;
  }
  return bytes;
}

void parse_decoder(const Node& n, Decoder* out) {
  if (n.is_null()) return;
  const std::string type = n.type();
  if (type != "ByteLevel") {
    n.child("type").fail("unsupported decoder \"" + type + "\" (supported: ByteLevel)");
  }
  n.only_fields({"type", "add_prefix_space", "trim_offsets", "use_regex"});
  out->byte_level = true;
}

}  // namespace lvx::models::tokenization
