// Pre-tokenizer regexes in PCRE2; see regex.h.
#include "models/tokenizer/regex.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <limits>
#include <nlohmann/json.hpp>

#include "models/tokenizer/utf8.h"
#include "src/common/error.h"

namespace lvx::models::tokenization {

using json = nlohmann::json;

struct Regex::Compiled {
  explicit Compiled(pcre2_code* c) : code(c) {}
  ~Compiled() { pcre2_code_free(code); }
  Compiled(const Compiled&) = delete;
  Compiled& operator=(const Compiled&) = delete;
  pcre2_code* code;
};

namespace {

// tokenizers runs its regexes in Oniguruma, where \s is Unicode White_Space; PCRE2's \s with UCP
// also matches U+180E. \s (and \S outside classes) are spelled out so that both engines agree;
// \S inside a class is left to PCRE2 (a difference on U+180E only).
std::string oniguruma_to_pcre2(const std::string& pattern) {
  const std::string space = "\\t-\\r\\x{85}\\p{Z}";
  std::string out;
  int depth = 0;  // character-class nesting
  for (size_t i = 0; i < pattern.size(); ++i) {
    const char c = pattern[i];
    if (c == '\\' && i + 1 < pattern.size()) {
      const char d = pattern[++i];
      if (d == 's') {
        out += depth > 0 ? space : "[" + space + "]";
      } else if (d == 'S' && depth == 0) {
        out += "[^" + space + "]";
      } else {
        out += c;
        out += d;
      }
      continue;
    }
    out += c;
    if (c == '[') {
      ++depth;
      if (i + 1 < pattern.size() && pattern[i + 1] == '^') out += pattern[++i];
      if (i + 1 < pattern.size() && pattern[i + 1] == ']') out += pattern[++i];  // literal ]
    } else if (c == ']' && depth > 0) {
      --depth;
    }
  }
  return out;
}

std::string pcre2_message(int code) {
  PCRE2_UCHAR buf[256];
  pcre2_get_error_message(code, buf, sizeof(buf));
  return reinterpret_cast<const char*>(buf);
}

// Per-thread match state: match data for the whole-match offsets and a JIT stack large enough for
// long runs (a 1 MB run of spaces matches in one piece).
struct MatchScratch {
  pcre2_match_data* data = nullptr;
  pcre2_match_context* context = nullptr;
  pcre2_jit_stack* stack = nullptr;
  MatchScratch() {
    data = pcre2_match_data_create(1, nullptr);
    context = pcre2_match_context_create(nullptr);
    stack = pcre2_jit_stack_create(32 * 1024, 16 * 1024 * 1024, nullptr);
    LVX_CHECK(data && context && stack, "tokenizer: out of memory for PCRE2 match state");
    pcre2_jit_stack_assign(context, nullptr, stack);
  }
  ~MatchScratch() {
    pcre2_jit_stack_free(stack);
    pcre2_match_context_free(context);
    pcre2_match_data_free(data);
  }
};

// One pcre2_match from `start`: a match (>= 0) or PCRE2_ERROR_NOMATCH; anything else throws.
int match(const pcre2_code* code, const std::string& pattern, const std::string& context,
          std::string_view s, size_t start, MatchBudget* budget, MatchScratch& scratch) {
  uint64_t limit = MatchBudget::kFree;
  for (;;) {
    pcre2_set_match_limit(scratch.context, static_cast<uint32_t>(std::min<uint64_t>(
                                               limit, std::numeric_limits<uint32_t>::max())));
    const int rc = pcre2_match(code, reinterpret_cast<PCRE2_SPTR>(s.data()), s.size(), start,
                               PCRE2_NO_UTF_CHECK, scratch.data, scratch.context);
    if (rc >= 0 || rc == PCRE2_ERROR_NOMATCH) return rc;
    if (rc != PCRE2_ERROR_MATCHLIMIT) {
      LVX_FAIL(context, ": the regex ", json(pattern).dump(), " failed on a piece of ", s.size(),
               " bytes: ", pcre2_message(rc));
    }
    if (budget->left == 0) {
      LVX_FAIL(context, ": the regex ", json(pattern).dump(), " used up its matching budget (",
               budget->total, " steps for a text of ", budget->text_bytes,
               " bytes: ", MatchBudget::kBase, " + ", MatchBudget::kPerByte,
               " per byte); a pattern that backtracks this much is refused");
    }
    limit = std::min(limit * 8, budget->left);
    budget->left -= limit;  // charged in full, used or not
  }
}

const char* const kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

}  // namespace

Regex::Regex(const std::string& pattern, const std::string& context)
    : pattern_(pattern), context_(context) {
  // PCRE2's start-of-pattern options ((*NO_START_OPT), (*NO_JIT), ...) are no Oniguruma syntax,
  // so no tokenizers file has them; they would also switch off the optimizations that keep an
  // unanchored search from rescanning the text at every position (uncounted by match limits).
  if (pattern.rfind("(*", 0) == 0) {
    LVX_FAIL(context, ": PCRE2 start-of-pattern options are not supported (pattern ",
             json(pattern).dump(), ")");
  }
  const std::string translated = oniguruma_to_pcre2(pattern);
  int code = 0;
  PCRE2_SIZE offset = 0;
  pcre2_code* re = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(translated.data()), translated.size(),
                                 PCRE2_UTF | PCRE2_UCP, &code, &offset, nullptr);
  if (!re) {
    LVX_FAIL(context, ": regex does not compile in PCRE2: ", pcre2_message(code), " (pattern ",
             json(pattern).dump(), ")");
  }
  pcre2_jit_compile(re, PCRE2_JIT_COMPLETE);  // when JIT is unavailable pcre2_match interprets
  code_ = std::make_shared<const Compiled>(re);
}

void Regex::find_all(std::string_view s, MatchBudget* budget,
                     std::vector<std::pair<size_t, size_t>>* out) const {
  thread_local MatchScratch scratch;
  size_t start = 0;
  bool have_last = false;
  size_t last_end = 0;
  while (start <= s.size()) {
    const int rc = match(code_->code, pattern_, context_, s, start, budget, scratch);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(scratch.data);
    const size_t b = ov[0], e = ov[1];
    if (b == e && have_last && e == last_end) {
      if (start >= s.size()) break;
      start += char_len(s, start);
      continue;
    }
    out->emplace_back(b, e);
    start = e;
    last_end = e;
    have_last = true;
  }
}

const Regex& gpt2_regex() {
  static const Regex re(kGpt2Pattern, "ByteLevel pre-tokenizer");
  return re;
}

}  // namespace lvx::models::tokenization
