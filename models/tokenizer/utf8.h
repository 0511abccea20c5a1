// UTF-8 and Unicode character classes for the tokenizer (models/tokenizer/tokenizer.h): validation,
// decoding one character, Rust's from_utf8_lossy, and the \w / \s classes of Rust's regex crate.
// Internal to models/tokenizer/.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace lvx::models::tokenization {

// Byte offset of the first invalid UTF-8 byte, or npos.
size_t first_invalid_utf8(std::string_view s);
// Length of the (valid) UTF-8 character starting at s[i].
size_t char_len(std::string_view s, size_t i);
// Code point of the (valid) UTF-8 character at s[i..i+len).
uint32_t code_point(std::string_view s, size_t i, size_t len);
void append_utf8(std::string& out, uint32_t cp);
// Bytes → valid UTF-8, each maximal invalid subpart replaced by U+FFFD (Rust's from_utf8_lossy).
std::string utf8_lossy(std::string_view s);
// Start of the character that ends at s[end) (s[..end) valid UTF-8, end > 0).
size_t previous_char_start(std::string_view s, size_t end);
// Rust regex's Unicode \w and \s (tokenizers' added-token checks use the regex crate).
bool is_word_char(uint32_t cp);
bool is_white_space(uint32_t cp);

}  // namespace lvx::models::tokenization
