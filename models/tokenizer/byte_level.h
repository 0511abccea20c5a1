// GPT-2's byte-level alphabet (bytes_to_unicode): every byte as a printable character, used by the
// ByteLevel pre-tokenizer (bytes → characters) and decoder (characters → bytes). Internal to
// models/tokenizer/.
#pragma once

#include <array>
#include <cstdint>
#include <string>

namespace lvx::models::tokenization {

struct ByteAlphabet {
  std::array<std::string, 256> byte_to_utf8;  // byte → its printable character, UTF-8
  std::array<int16_t, 324> cp_to_byte;        // character → byte, -1 when not in the alphabet

  ByteAlphabet();
};

// The one table, built on first use.
const ByteAlphabet& byte_alphabet();

}  // namespace lvx::models::tokenization
