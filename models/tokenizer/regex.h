// Pre-tokenizer regexes: tokenizer.json's Oniguruma patterns run in PCRE2 (UTF, Unicode properties
// such as \p{L}, lookahead; \s spelled out as Unicode White_Space as Oniguruma has it), with the
// find_iter semantics of the onig crate and a matching budget per encoded text so that a pattern
// that backtracks catastrophically ends in an error. Internal to models/tokenizer/.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace lvx::models::tokenization {

// The regex matching work one encode() may do, in PCRE2's match-limit units (about one
// backtracking step each): a base plus an allowance per input byte, so a pattern that backtracks
// catastrophically (each call just under any per-call limit, thousands of calls) ends in an error
// instead of running for hours. Tokenizers' own patterns need a few steps per byte.
struct MatchBudget {
  static constexpr uint64_t kBase = 10'000'000;  // PCRE2's default limit for one call
  static constexpr uint64_t kPerByte = 1000;
  // A call first runs under kFree steps, not charged (what every ordinary call needs); one that
  // needs more is run again under a limit 8 times larger each time, each attempt charged in full,
  // so what is charged is at most about 9 times what the calls needed.
  static constexpr uint64_t kFree = 10'000;
  explicit MatchBudget(size_t bytes)
      : text_bytes(bytes), total(kBase + kPerByte * bytes), left(total) {}
  uint64_t text_bytes, total, left;
};

class Regex {
 public:
  // Throws lvx::Error "<context>: regex does not compile in PCRE2: <message> (pattern ...)";
  // refuses PCRE2's start-of-pattern options ((*NO_JIT), ...), which no Oniguruma pattern has.
  Regex(const std::string& pattern, const std::string& context);

  // Appends the matches [start, end) in s, with the find_iter semantics of the onig crate: an
  // empty match right where the previous match ended is skipped. s must be valid UTF-8. The work
  // is charged to `budget` (an error naming the pattern once it is spent).
  void find_all(std::string_view s, MatchBudget* budget,
                std::vector<std::pair<size_t, size_t>>* out) const;

  struct Compiled;  // the PCRE2 code (regex.cpp)

 private:
  std::string pattern_, context_;
  std::shared_ptr<const Compiled> code_;
};

// The GPT-2 pattern of the ByteLevel pre-tokenizer with use_regex, compiled once.
const Regex& gpt2_regex();

}  // namespace lvx::models::tokenization
