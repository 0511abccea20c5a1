// GPT-2's byte-level alphabet; see byte_level.h.
#include "models/tokenizer/byte_level.h"

#include "models/tokenizer/utf8.h"

namespace lvx::models::tokenization {

ByteAlphabet::ByteAlphabet() {
  cp_to_byte.fill(-1);
  int extra = 0;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
    const uint32_t cp = printable ? static_cast<uint32_t>(b) : static_cast<uint32_t>(256 + extra++);
    append_utf8(byte_to_utf8[b], cp);
    cp_to_byte[cp] = static_cast<int16_t>(b);
  }
}

const ByteAlphabet& byte_alphabet() {
  static const ByteAlphabet table;
  return table;
}

}  // namespace lvx::models::tokenization
