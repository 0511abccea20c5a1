// UTF-8 and Unicode classes; see utf8.h.
#include "models/tokenizer/utf8.h"

#include <unicode/uchar.h>

namespace lvx::models::tokenization {

namespace {

// Length (1-4) of the valid UTF-8 sequence at p[0..n), or 0 with *bad set to the length of the
// maximal invalid subpart there (>= 1): what Rust's from_utf8_lossy replaces by one U+FFFD.
size_t utf8_sequence(const unsigned char* p, size_t n, size_t* bad) {
  const unsigned c = p[0];
  if (c < 0x80) return 1;
  size_t width = 0;
  unsigned lo = 0x80, hi = 0xBF;  // range of the second byte
  if (c >= 0xC2 && c <= 0xDF) {
    width = 2;
  } else if (c >= 0xE0 && c <= 0xEF) {
    width = 3;
    if (c == 0xE0) lo = 0xA0;  // no overlong forms
    if (c == 0xED) hi = 0x9F;  // no surrogates
  } else if (c >= 0xF0 && c <= 0xF4) {
    width = 4;
    if (c == 0xF0) lo = 0x90;  // no overlong forms
    if (c == 0xF4) hi = 0x8F;  // nothing above U+10FFFF
  } else {
    *bad = 1;
    return 0;
  }
  for (size_t k = 1; k < width; ++k) {
    if (k >= n || p[k] < (k == 1 ? lo : 0x80u) || p[k] > (k == 1 ? hi : 0xBFu)) {
      *bad = k;
      return 0;
    }
  }
  return width;
}

}  // namespace

// Byte offset of the first invalid UTF-8 byte, or npos.
size_t first_invalid_utf8(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  size_t bad = 0;
  for (size_t i = 0; i < s.size();) {
    const size_t len = utf8_sequence(p + i, s.size() - i, &bad);
    if (len == 0) return i;
    i += len;
  }
  return std::string_view::npos;
}

// Length of the (valid) UTF-8 character starting at s[i].
size_t char_len(std::string_view s, size_t i) {
  const unsigned c = static_cast<unsigned char>(s[i]);
  return c < 0x80 ? 1 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4;
}

// Code point of the (valid) UTF-8 character at s[i..i+len).
uint32_t code_point(std::string_view s, size_t i, size_t len) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data()) + i;
  if (len == 1) return p[0];
  uint32_t cp = p[0] & (0x7F >> len);
  for (size_t k = 1; k < len; ++k) cp = (cp << 6) | (p[k] & 0x3F);
  return cp;
}

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

// Bytes → valid UTF-8, each maximal invalid subpart replaced by U+FFFD (Rust's from_utf8_lossy).
std::string utf8_lossy(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  size_t bad = 0;
  for (size_t i = 0; i < s.size();) {
    const size_t len = utf8_sequence(p + i, s.size() - i, &bad);
    if (len > 0) {
      out.append(s.data() + i, len);
      i += len;
    } else {
      out += "\xEF\xBF\xBD";
      i += bad;
    }
  }
  return out;
}

// Start of the character that ends at s[end) (s[..end) valid UTF-8, end > 0).
size_t previous_char_start(std::string_view s, size_t end) {
  size_t i = end - 1;
  while (i > 0 && (static_cast<unsigned char>(s[i]) & 0xC0) == 0x80) --i;
  return i;
}

// Rust regex's Unicode \w and \s (tokenizers' added-token checks use the regex crate).
bool is_word_char(uint32_t cp) {
  const auto c = static_cast<UChar32>(cp);
  return u_hasBinaryProperty(c, UCHAR_ALPHABETIC) || u_hasBinaryProperty(c, UCHAR_JOIN_CONTROL) ||
         (U_GET_GC_MASK(c) & (U_GC_M_MASK | U_GC_ND_MASK | U_GC_PC_MASK)) != 0;
}
bool is_white_space(uint32_t cp) {
  return u_hasBinaryProperty(static_cast<UChar32>(cp), UCHAR_WHITE_SPACE);
}

}  // namespace lvx::models::tokenization
