// Byte-level BPE from tokenizer.json; see tokenizer.h for the pipeline and what is supported. The
// steps follow the `tokenizers` crate (0.22) closely enough to give the same ids, including its
// quirks (an rstrip'ed added token can overlap the next one; empty regex matches split text).
#include "models/tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <unicode/bytestream.h>
#include <unicode/normalizer2.h>
#include <unicode/stringpiece.h>
#include <unicode/uchar.h>

#include <algorithm>
#include <array>
#include <functional>
#include <initializer_list>
#include <limits>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <queue>
#include <string_view>
#include <unordered_map>
#include <utility>

#include "src/common/error.h"
#include "src/common/files.h"

namespace lvx::models {
namespace {

using json = nlohmann::json;

// ---- UTF-8 --------------------------------------------------------------------------------------

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

// ---- byte-level alphabet (GPT-2's bytes_to_unicode) ---------------------------------------------

struct ByteAlphabet {
  std::array<std::string, 256> byte_to_utf8;  // byte → its printable character, UTF-8
  std::array<int16_t, 324> cp_to_byte;        // character → byte, -1 when not in the alphabet

  ByteAlphabet() {
    cp_to_byte.fill(-1);
    int extra = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
      const uint32_t cp =
          printable ? static_cast<uint32_t>(b) : static_cast<uint32_t>(256 + extra++);
      append_utf8(byte_to_utf8[b], cp);
      cp_to_byte[cp] = static_cast<int16_t>(b);
    }
  }
};

const ByteAlphabet& byte_alphabet() {
  static const ByteAlphabet table;
  return table;
}

// ---- regex (PCRE2) ------------------------------------------------------------------------------

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
  // Throws lvx::Error "<context>: regex does not compile in PCRE2: <message> (pattern ...)".
  Regex(const std::string& pattern, const std::string& context)
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
    pcre2_code* re =
        pcre2_compile(reinterpret_cast<PCRE2_SPTR>(translated.data()), translated.size(),
                      PCRE2_UTF | PCRE2_UCP, &code, &offset, nullptr);
    if (!re) {
      LVX_FAIL(context, ": regex does not compile in PCRE2: ", pcre2_message(code), " (pattern ",
               json(pattern).dump(), ")");
    }
    pcre2_jit_compile(re, PCRE2_JIT_COMPLETE);  // when JIT is unavailable pcre2_match interprets
    code_.reset(re, pcre2_code_free);
  }

  // Appends the matches [start, end) in s, with the find_iter semantics of the onig crate: an
  // empty match right where the previous match ended is skipped. s must be valid UTF-8. The work
  // is charged to `budget` (an error naming the pattern once it is spent).
  void find_all(std::string_view s, MatchBudget* budget,
                std::vector<std::pair<size_t, size_t>>* out) const {
    thread_local MatchScratch scratch;
    size_t start = 0;
    bool have_last = false;
    size_t last_end = 0;
    while (start <= s.size()) {
      const int rc = match(s, start, budget, scratch);
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

 private:
  // One pcre2_match from `start`: a match (>= 0) or PCRE2_ERROR_NOMATCH; anything else throws.
  int match(std::string_view s, size_t start, MatchBudget* budget, MatchScratch& scratch) const {
    uint64_t limit = MatchBudget::kFree;
    for (;;) {
      pcre2_set_match_limit(scratch.context, static_cast<uint32_t>(std::min<uint64_t>(
                                                 limit, std::numeric_limits<uint32_t>::max())));
      const int rc = pcre2_match(code_.get(), reinterpret_cast<PCRE2_SPTR>(s.data()), s.size(),
                                 start, PCRE2_NO_UTF_CHECK, scratch.data, scratch.context);
      if (rc >= 0 || rc == PCRE2_ERROR_NOMATCH) return rc;
      if (rc != PCRE2_ERROR_MATCHLIMIT) {
        LVX_FAIL(context_, ": the regex ", json(pattern_).dump(), " failed on a piece of ",
                 s.size(), " bytes: ", pcre2_message(rc));
      }
      if (budget->left == 0) {
        LVX_FAIL(context_, ": the regex ", json(pattern_).dump(), " used up its matching budget (",
                 budget->total, " steps for a text of ", budget->text_bytes,
                 " bytes: ", MatchBudget::kBase, " + ", MatchBudget::kPerByte,
                 " per byte); a pattern that backtracks this much is refused");
      }
      limit = std::min(limit * 8, budget->left);
      budget->left -= limit;  // charged in full, used or not
    }
  }

  std::string pattern_, context_;
  std::shared_ptr<pcre2_code> code_;
};

const char* const kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

const Regex& gpt2_regex() {
  static const Regex re(kGpt2Pattern, "ByteLevel pre-tokenizer");
  return re;
}

// ---- tokenizer.json access with paths in errors -------------------------------------------------

class Node {
 public:
  Node(const json& j, std::string path, const std::string& file)
      : j_(&j), path_(std::move(path)), file_(&file) {}

  [[noreturn]] void fail(const std::string& what) const {
    LVX_FAIL(*file_, ": ", path_.empty() ? std::string("(top level)") : path_, ": ", what);
  }
  const json& value() const { return *j_; }
  std::string where() const { return *file_ + ": " + path_; }
  bool is_null() const { return j_->is_null(); }
  std::string shown() const {  // the value for messages, shortened
    std::string s = j_->dump();
    return s.size() > 80 ? s.substr(0, 77) + "..." : s;
  }

  // The field, or a null node when absent.
  Node child(const std::string& key) const {
    static const json null_value;
    const auto it = j_->find(key);
    return Node(it == j_->end() ? null_value : *it, join(key), *file_);
  }
  Node required(const std::string& key) const {
    Node n = child(key);
    if (!j_->contains(key)) n.fail("missing required field");
    return n;
  }
  Node item(size_t i) const {
    return Node((*j_)[i], path_ + "[" + std::to_string(i) + "]", *file_);
  }
  size_t size() const { return j_->size(); }

  void expect_object() const {
    if (!j_->is_object()) fail("expected an object, got " + shown());
  }
  void expect_array() const {
    if (!j_->is_array()) fail("expected an array, got " + shown());
  }
  std::string str() const {
    if (!j_->is_string()) fail("expected a string, got " + shown());
    return j_->get<std::string>();
  }
  bool boolean() const {
    if (!j_->is_boolean()) fail("expected true or false, got " + shown());
    return j_->get<bool>();
  }
  int64_t integer() const {
    if (!j_->is_number_integer()) fail("expected an integer, got " + shown());
    return j_->get<int64_t>();
  }
  bool flag(const std::string& key, bool absent) const {
    Node n = child(key);
    return n.is_null() ? absent : n.boolean();
  }
  // Every field must be one we read: an unknown one is named, not ignored.
  void only_fields(std::initializer_list<const char*> known) const {
    for (const auto& [key, v] : j_->items()) {
      if (std::find_if(known.begin(), known.end(), [&](const char* k) { return key == k; }) ==
          known.end()) {
        child(key).fail("unsupported field (value " + child(key).shown() + ")");
      }
    }
  }
  std::string type() const {
    expect_object();
    return required("type").str();
  }

 private:
  std::string join(const std::string& key) const { return path_.empty() ? key : path_ + "." + key; }
  const json* j_;
  std::string path_;
  const std::string* file_;
};

// ---- normalizer ---------------------------------------------------------------------------------

struct Normalizer {
  std::vector<const icu::Normalizer2*> steps;

  std::string apply(std::string s) const {
    for (const icu::Normalizer2* n : steps) {
      UErrorCode status = U_ZERO_ERROR;
      const icu::StringPiece in(s.data(), static_cast<int32_t>(s.size()));
      if (n->isNormalizedUTF8(in, status) && U_SUCCESS(status)) continue;
      status = U_ZERO_ERROR;
      std::string out;
      icu::StringByteSink<std::string> sink(&out, static_cast<int32_t>(s.size()));
      n->normalizeUTF8(0, in, sink, nullptr, status);
      LVX_CHECK(U_SUCCESS(status),
                "tokenizer: Unicode normalization failed: ", u_errorName(status));
      s = std::move(out);
    }
    return s;
  }
};

void parse_normalizer(const Node& n, Normalizer* out) {
  if (n.is_null()) return;
  const std::string type = n.type();
  if (type == "Sequence") {
    n.only_fields({"type", "normalizers"});
    const Node list = n.required("normalizers");
    list.expect_array();
    for (size_t i = 0; i < list.size(); ++i) parse_normalizer(list.item(i), out);
    return;
  }
  n.only_fields({"type"});
  UErrorCode status = U_ZERO_ERROR;
  const icu::Normalizer2* norm = nullptr;
  if (type == "NFC") {
    norm = icu::Normalizer2::getNFCInstance(status);
  } else if (type == "NFD") {
    norm = icu::Normalizer2::getNFDInstance(status);
  } else if (type == "NFKC") {
    norm = icu::Normalizer2::getNFKCInstance(status);
  } else if (type == "NFKD") {
    norm = icu::Normalizer2::getNFKDInstance(status);
  } else {
    n.child("type").fail("unsupported normalizer \"" + type +
                         "\" (supported: NFC, NFD, NFKC, NFKD, Sequence)");
  }
  LVX_CHECK(U_SUCCESS(status) && norm, "tokenizer: ICU ", type,
            " normalizer unavailable: ", u_errorName(status));
  out->steps.push_back(norm);
}

// ---- added tokens -------------------------------------------------------------------------------

struct AddedToken {
  std::string content;
  int32_t id = 0;
  bool single_word = false, lstrip = false, rstrip = false, normalized = true, special = false;
};

// A piece of the input: text still to tokenize (id < 0) or an added token.
struct Piece {
  std::string text;
  int32_t id = -1;
};

// Leftmost-longest, non-overlapping matching of the added tokens' contents (as tokenizers'
// aho-corasick with MatchKind::LeftmostLongest), then its find_matches rules.
//
// Linear in the text whatever the number of tokens: an Aho-Corasick automaton over the *reversed*
// contents, run from the text's end to its start, gives at every position the longest content
// that starts there (the deepest accepting state among the current state's suffixes); the split
// then walks the positions left to right, taking the longest match at the first position that
// has one and going on after its end. Building is O(total content bytes * log 256).
class AddedMatcher {
 public:
  void add(std::string pattern, const AddedToken* token) {
    if (pattern.empty()) return;
    patterns_.push_back({std::move(pattern), token});
  }
  void finish() {
    // Reversed contents in sorted order (equal ones: the first added wins, as the file order
    // decides in tokenizers), inserted into a trie whose nodes come out in preorder.
    std::vector<std::pair<std::string, size_t>> rev;
    rev.reserve(patterns_.size());
    for (size_t i = 0; i < patterns_.size(); ++i)
      rev.emplace_back(std::string(patterns_[i].text.rbegin(), patterns_[i].text.rend()), i);
    std::sort(rev.begin(), rev.end());
    struct Edge {
      int32_t parent;
      uint8_t byte;
      int32_t child;
    };
    std::vector<Edge> edges;
    nodes_.assign(1, TrieNode{});
    std::vector<int32_t> path{0};  // the previous content's nodes by depth
    const std::string* prev = nullptr;
    for (const auto& [r, index] : rev) {
      size_t common = 0;
      if (prev) {
        const size_t limit = std::min(prev->size(), r.size());
        while (common < limit && (*prev)[common] == r[common]) ++common;
      }
      path.resize(common + 1);
      for (size_t d = common; d < r.size(); ++d) {
        const auto id = static_cast<int32_t>(nodes_.size());
        LVX_CHECK(nodes_.size() < static_cast<size_t>(std::numeric_limits<int32_t>::max()),
                  "tokenizer: added tokens too long in total");
        TrieNode n;
        n.depth = static_cast<int32_t>(d + 1);
        nodes_.push_back(n);
        edges.push_back({path.back(), static_cast<uint8_t>(r[d]), id});
        path.push_back(id);
      }
      TrieNode& end = nodes_[path.back()];
      if (end.pattern < 0) end.pattern = static_cast<int32_t>(index);
      prev = &r;
    }
    // Children per node, in byte order (edges were made in preorder, so a node's children are in
    // increasing byte order already).
    edge_start_.assign(nodes_.size() + 1, 0);
    for (const Edge& e : edges) ++edge_start_[e.parent + 1];
    for (size_t i = 1; i < edge_start_.size(); ++i) edge_start_[i] += edge_start_[i - 1];
    edge_byte_.resize(edges.size());
    edge_child_.resize(edges.size());
    std::vector<int32_t> fill(edge_start_.begin(), edge_start_.end() - 1);
    for (const Edge& e : edges) {
      const int32_t k = fill[e.parent]++;
      edge_byte_[k] = e.byte;
      edge_child_[k] = e.child;
    }
    edges.clear();
    edges.shrink_to_fit();
    // Failure links breadth first; out = the deepest accepting node among a node's suffixes.
    std::vector<int32_t> queue{0};
    nodes_[0].fail = 0;
    nodes_[0].out = nodes_[0].pattern >= 0 ? 0 : -1;
    for (size_t qi = 0; qi < queue.size(); ++qi) {
      const int32_t u = queue[qi];
      for (int32_t k = edge_start_[u]; k < edge_start_[u + 1]; ++k) {
        const int32_t c = edge_child_[k];
        int32_t f = 0;
        if (u != 0) {
          f = nodes_[u].fail;
          int32_t next = child(f, edge_byte_[k]);
          while (next < 0 && f != 0) {
            f = nodes_[f].fail;
            next = child(f, edge_byte_[k]);
          }
          f = next < 0 ? 0 : next;
        }
        nodes_[c].fail = f;
        nodes_[c].out = nodes_[c].pattern >= 0 ? c : nodes_[f].out;
        queue.push_back(c);
      }
    }
  }
  bool empty() const { return patterns_.empty(); }

  // Splits s into text pieces and added tokens, dropping empty text pieces. With skip_special,
  // matches of special tokens are left in the text (tokenizers' encode_special_tokens: they are
  // still matched, so they hide any other token overlapping them, but not split out).
  void split(const std::string& s, bool skip_special, std::vector<Piece>* out) const {
    if (patterns_.empty()) {
      if (!s.empty()) out->push_back({s, -1});
      return;
    }
    // longest[i]: the accepting node of the longest content starting at s[i], or -1.
    std::vector<int32_t> longest(s.size(), -1);
    int32_t state = 0;
    for (size_t i = s.size(); i-- > 0;) {
      const auto byte = static_cast<uint8_t>(s[i]);
      int32_t next = child(state, byte);
      while (next < 0 && state != 0) {
        state = nodes_[state].fail;
        next = child(state, byte);
      }
      state = next < 0 ? 0 : next;
      longest[i] = nodes_[state].out;
    }
    size_t start_offset = 0;
    for (size_t pos = 0; pos < s.size();) {
      if (longest[pos] < 0) {
        ++pos;
        continue;
      }
      const TrieNode& hit = nodes_[longest[pos]];
      size_t start = pos, stop = pos + static_cast<size_t>(hit.depth);
      pos = stop;  // the next match is searched after this one's own end, as aho-corasick does
      const AddedToken& t = *patterns_[hit.pattern].token;
      if (skip_special && t.special) continue;
      if (t.single_word) {
        const bool space_before =
            start == 0 || !ends_with_word(std::string_view(s).substr(0, start));
        const bool space_after = stop == s.size() || !starts_with_word(s, stop);
        if (!space_before || !space_after) continue;
      }
      if (t.lstrip) start = std::max(leftmost_space_at_end(s, start), start_offset);
      if (t.rstrip) stop = rightmost_space_at_start(s, stop);
      if (start_offset < start) out->push_back({s.substr(start_offset, start - start_offset), -1});
      // stop can pass the next match's start (rstrip): the pieces then overlap, as in tokenizers.
      out->push_back({s.substr(start, stop - start), t.id});
      start_offset = stop;
    }
    if (start_offset < s.size()) out->push_back({s.substr(start_offset), -1});
  }

 private:
  int32_t child(int32_t node, uint8_t byte) const {
    const auto b = edge_byte_.begin() + edge_start_[node];
    const auto e = edge_byte_.begin() + edge_start_[node + 1];
    const auto it = std::lower_bound(b, e, byte);
    return it != e && *it == byte ? edge_child_[it - edge_byte_.begin()] : -1;
  }
  static bool ends_with_word(std::string_view s) {
    const size_t b = previous_char_start(s, s.size());
    return is_word_char(code_point(s, b, s.size() - b));
  }
  static bool starts_with_word(std::string_view s, size_t i) {
    return is_word_char(code_point(s, i, char_len(s, i)));
  }
  static size_t leftmost_space_at_end(std::string_view s, size_t end) {
    while (end > 0) {
      const size_t b = previous_char_start(s, end);
      if (!is_white_space(code_point(s, b, end - b))) break;
      end = b;
    }
    return end;
  }
  static size_t rightmost_space_at_start(std::string_view s, size_t i) {
    while (i < s.size()) {
      const size_t len = char_len(s, i);
      if (!is_white_space(code_point(s, i, len))) break;
      i += len;
    }
    return i;
  }

  struct Pattern {
    std::string text;
    const AddedToken* token;
  };
  struct TrieNode {
    int32_t depth = 0;     // bytes from the root: the length of the content it spells
    int32_t pattern = -1;  // index in patterns_ when a content ends here
    int32_t fail = 0;      // the longest proper suffix that is in the trie
    int32_t out = -1;      // the deepest node with a pattern among this node and its suffixes
  };
  std::vector<Pattern> patterns_;
  std::vector<TrieNode> nodes_;
  std::vector<int32_t> edge_start_;  // node → its children's range in edge_byte_/edge_child_
  std::vector<uint8_t> edge_byte_;
  std::vector<int32_t> edge_child_;
};

// ---- pre-tokenizers -----------------------------------------------------------------------------

enum class Behavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

struct PreTokenizer {
  enum class Kind { kSplit, kByteLevel } kind = Kind::kSplit;
  // Split
  std::shared_ptr<Regex> regex;  // null: literal
  std::string literal;
  Behavior behavior = Behavior::kIsolated;
  bool invert = false;
  // ByteLevel
  bool add_prefix_space = false;
  bool use_regex = true;
};

// Offsets of every part of s, matches flagged (tokenizers' Pattern::find_matches).
using Parts = std::vector<std::pair<std::pair<size_t, size_t>, bool>>;

Parts find_parts(const PreTokenizer& p, std::string_view s, const Regex* regex,
                 MatchBudget* budget) {
  Parts parts;
  if (s.empty()) {
    parts.push_back({{0, 0}, false});
    return parts;
  }
  std::vector<std::pair<size_t, size_t>> matches;
  if (regex) {
    regex->find_all(s, budget, &matches);
  } else if (!p.literal.empty()) {
    for (size_t at = s.find(p.literal); at != std::string_view::npos;
         at = s.find(p.literal, at + p.literal.size())) {
      matches.emplace_back(at, at + p.literal.size());
    }
  }
  size_t prev = 0;
  for (const auto& [b, e] : matches) {
    if (prev != b) parts.push_back({{prev, b}, false});
    parts.push_back({{b, e}, true});
    prev = e;
  }
  if (prev != s.size()) parts.push_back({{prev, s.size()}, false});
  return parts;
}

// tokenizers' NormalizedString::split: the parts kept under `behavior`, empty ones dropped.
void split_by(std::string_view s, Parts parts, Behavior behavior, std::vector<std::string>* out) {
  std::vector<std::pair<size_t, size_t>> kept;
  bool previous_match = false;
  switch (behavior) {
    case Behavior::kRemoved:
      for (const auto& [off, is_match] : parts)
        if (!is_match) kept.push_back(off);
      break;
    case Behavior::kIsolated:
      for (const auto& part : parts) kept.push_back(part.first);
      break;
    case Behavior::kContiguous:
      for (const auto& [off, is_match] : parts) {
        if (is_match == previous_match && !kept.empty()) {
          kept.back().second = off.second;
        } else {
          kept.push_back(off);
        }
        previous_match = is_match;
      }
      break;
    case Behavior::kMergedWithPrevious:
      for (const auto& [off, is_match] : parts) {
        if (is_match && !previous_match && !kept.empty()) {
          kept.back().second = off.second;
        } else {
          kept.push_back(off);
        }
        previous_match = is_match;
      }
      break;
    case Behavior::kMergedWithNext:
      for (auto it = parts.rbegin(); it != parts.rend(); ++it) {
        const auto& [off, is_match] = *it;
        if (is_match && !previous_match && !kept.empty()) {
          kept.back().first = off.first;
        } else {
          kept.push_back(off);
        }
        previous_match = is_match;
      }
      std::reverse(kept.begin(), kept.end());
      break;
  }
  for (const auto& [b, e] : kept)
    if (e > b) out->emplace_back(s.substr(b, e - b));
}

void pre_tokenize(const PreTokenizer& p, const std::vector<std::string>& in, MatchBudget* budget,
                  std::vector<std::string>* out) {
  if (p.kind == PreTokenizer::Kind::kSplit) {
    for (const std::string& s : in) {
      Parts parts = find_parts(p, s, p.regex.get(), budget);
      if (p.invert)
        for (auto& part : parts) part.second = !part.second;
      split_by(s, std::move(parts), p.behavior, out);
    }
    return;
  }
  // ByteLevel: optional prefix space, optional GPT-2 regex split, then bytes → alphabet.
  const ByteAlphabet& alphabet = byte_alphabet();
  std::vector<std::string> words;
  for (const std::string& s : in) {
    std::string w = p.add_prefix_space && (s.empty() || s[0] != ' ') ? " " + s : s;
    if (p.use_regex) {
      Parts parts;
      std::vector<std::pair<size_t, size_t>> matches;
      gpt2_regex().find_all(w, budget, &matches);
      size_t prev = 0;
      for (const auto& [b, e] : matches) {
        if (prev != b) parts.push_back({{prev, b}, false});
        parts.push_back({{b, e}, true});
        prev = e;
      }
      if (prev != w.size()) parts.push_back({{prev, w.size()}, false});
      split_by(w, std::move(parts), Behavior::kIsolated, &words);
    } else if (!w.empty()) {
      words.push_back(std::move(w));
    }
  }
  for (const std::string& w : words) {
    std::string mapped;
    mapped.reserve(w.size() * 2);
    for (unsigned char c : w) mapped += alphabet.byte_to_utf8[c];
    out->push_back(std::move(mapped));
  }
}

Behavior parse_behavior(const Node& n) {
  const std::string b = n.str();
  if (b == "Removed") return Behavior::kRemoved;
  if (b == "Isolated") return Behavior::kIsolated;
  if (b == "MergedWithPrevious") return Behavior::kMergedWithPrevious;
  if (b == "MergedWithNext") return Behavior::kMergedWithNext;
  if (b == "Contiguous") return Behavior::kContiguous;
  n.fail("unsupported split behavior \"" + b +
         "\" (supported: Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous)");
}

void parse_pre_tokenizer(const Node& n, std::vector<PreTokenizer>* out) {
  if (n.is_null()) return;
  const std::string type = n.type();
  PreTokenizer p;
  if (type == "Sequence") {
    n.only_fields({"type", "pretokenizers"});
    const Node list = n.required("pretokenizers");
    list.expect_array();
    for (size_t i = 0; i < list.size(); ++i) parse_pre_tokenizer(list.item(i), out);
    return;
  } else if (type == "ByteLevel") {
    n.only_fields({"type", "add_prefix_space", "trim_offsets", "use_regex"});
    p.kind = PreTokenizer::Kind::kByteLevel;
    p.add_prefix_space = n.required("add_prefix_space").boolean();
    n.required("trim_offsets").boolean();  // offsets only
    p.use_regex = n.flag("use_regex", true);
  } else if (type == "Split") {
    n.only_fields({"type", "pattern", "behavior", "invert"});
    const Node pattern = n.required("pattern");
    pattern.expect_object();
    if (pattern.size() != 1) pattern.fail("expected {\"Regex\": ...} or {\"String\": ...}");
    if (pattern.value().contains("Regex")) {
      const Node re = pattern.child("Regex");
      p.regex = std::make_shared<Regex>(re.str(), re.where());
    } else if (pattern.value().contains("String")) {
      p.literal = pattern.child("String").str();
    } else {
      pattern.fail("unsupported pattern " + pattern.shown() + " (supported: Regex, String)");
    }
    p.behavior = parse_behavior(n.required("behavior"));
    p.invert = n.required("invert").boolean();
  } else {
    n.child("type").fail("unsupported pre-tokenizer \"" + type +
                         "\" (supported: ByteLevel, Split, Sequence)");
  }
  out->push_back(std::move(p));
}

// Ids of model and added tokens stay below this (16,777,216; released vocabularies have up to a
// few hundred thousand): an id from a hostile file cannot make the id tables huge.
constexpr int64_t kMaxTokenId = int64_t{1} << 24;

// ---- BPE model ----------------------------------------------------------------------------------

struct Bpe {
  std::unordered_map<std::string, int32_t> vocab;
  std::vector<const std::string*> tokens;          // id → its key in vocab (null: no such id)
  std::unordered_map<uint32_t, int32_t> char_ids;  // single-character tokens by code point
  struct Merge {
    int32_t rank;
    int32_t id;
  };
  std::unordered_map<uint64_t, Merge> merges;  // (left id, right id) → rank and merged id
  int32_t unk_id = -1;
  bool fuse_unk = false;
  bool ignore_merges = false;

  static uint64_t key(int32_t a, int32_t b) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
  }

  // The cache holds words up to kCacheWordBytes, kCacheEntries of them (then no more are added).
  static constexpr size_t kCacheWordBytes = 256;
  static constexpr size_t kCacheEntries = 200000;
  mutable std::mutex cache_mutex;
  mutable std::unordered_map<std::string, std::vector<int32_t>> cache;

  void tokenize(const std::string& word, std::vector<int64_t>* out) const {
    if (ignore_merges) {
      const auto it = vocab.find(word);
      if (it != vocab.end()) {
        out->push_back(it->second);
        return;
      }
    }
    const bool cacheable = word.size() <= kCacheWordBytes;
    if (cacheable) {
      std::lock_guard<std::mutex> lock(cache_mutex);
      const auto it = cache.find(word);
      if (it != cache.end()) {
        out->insert(out->end(), it->second.begin(), it->second.end());
        return;
      }
    }
    std::vector<int32_t> ids = merge_word(word);
    out->insert(out->end(), ids.begin(), ids.end());
    if (cacheable) {
      std::lock_guard<std::mutex> lock(cache_mutex);
      if (cache.size() < kCacheEntries) cache.emplace(word, std::move(ids));
    }
  }

  // tokenizers' Word::merge_all: symbols are the word's characters; the pair with the lowest merge
  // rank (then the leftmost) is merged until none is left.
  std::vector<int32_t> merge_word(std::string_view w) const {
    struct Symbol {
      int32_t id;
      int32_t prev, next;
      size_t len;  // bytes; 0 once merged into its left neighbour
    };
    std::vector<Symbol> sym;
    sym.reserve(w.size());
    auto add = [&](int32_t id, size_t len) {
      const auto n = static_cast<int32_t>(sym.size());
      if (n > 0) sym.back().next = n;
      sym.push_back({id, n - 1, -1, len});
    };
    int32_t pending_unk_len = 0;
    for (size_t i = 0; i < w.size();) {
      const size_t len = char_len(w, i);
      int32_t id = -1;
      const auto c = char_ids.find(code_point(w, i, len));
      if (c != char_ids.end()) id = c->second;
      if (id >= 0) {
        if (pending_unk_len > 0) add(unk_id, pending_unk_len);
        pending_unk_len = 0;
        add(id, len);
      } else if (unk_id >= 0) {
        if (pending_unk_len > 0 && !fuse_unk) {
          add(unk_id, pending_unk_len);
          pending_unk_len = 0;
        }
        pending_unk_len += static_cast<int32_t>(len);
      }  // else: tokenizers drops a character it has no token for
      i += len;
    }
    if (pending_unk_len > 0) add(unk_id, pending_unk_len);

    struct Candidate {
      int32_t rank, pos, id;
      bool operator>(const Candidate& o) const {
        return rank != o.rank ? rank > o.rank : pos > o.pos;
      }
    };
    std::priority_queue<Candidate, std::vector<Candidate>, std::greater<Candidate>> queue;
    auto consider = [&](int32_t pos) {
      const Symbol& a = sym[pos];
      if (a.next < 0) return;
      const auto m = merges.find(key(a.id, sym[a.next].id));
      if (m != merges.end()) queue.push({m->second.rank, pos, m->second.id});
    };
    for (int32_t i = 0; i + 1 < static_cast<int32_t>(sym.size()); ++i) consider(i);
    while (!queue.empty()) {
      const Candidate top = queue.top();
      queue.pop();
      Symbol& left = sym[top.pos];
      if (left.len == 0 || left.next < 0) continue;
      const Symbol right = sym[left.next];
      // A stale candidate: the pair at pos changed since it was queued.
      const auto m = merges.find(key(left.id, right.id));
      if (m == merges.end() || m->second.id != top.id) continue;
      sym[left.next].len = 0;
      left.id = top.id;
      left.len += right.len;
      left.next = right.next;
      if (right.next >= 0) sym[right.next].prev = top.pos;
      if (left.prev >= 0) consider(left.prev);
      consider(top.pos);
    }
    std::vector<int32_t> ids;
    for (const Symbol& s : sym)
      if (s.len > 0) ids.push_back(s.id);
    return ids;
  }
};

void parse_bpe(const Node& n, Bpe* bpe) {
  const std::string type = n.type();
  if (type != "BPE") {
    n.child("type").fail("unsupported model type \"" + type + "\" (supported: BPE)");
  }
  n.only_fields({"type", "dropout", "unk_token", "continuing_subword_prefix", "end_of_word_suffix",
                 "fuse_unk", "byte_fallback", "ignore_merges", "vocab", "merges"});
  const Node dropout = n.child("dropout");
  if (!dropout.is_null() && (!dropout.value().is_number() || dropout.value().get<double>() != 0)) {
    dropout.fail("BPE dropout " + dropout.shown() + " is not supported (only null or 0)");
  }
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    const Node v = n.child(key);
    if (!v.is_null() && !v.str().empty()) {
      v.fail(std::string(key) + " " + v.shown() + " is not supported (only null or \"\")");
    }
  }
  if (n.flag("byte_fallback", false)) {
    n.child("byte_fallback").fail("byte_fallback true is not supported");
  }
  bpe->fuse_unk = n.flag("fuse_unk", false);
  bpe->ignore_merges = n.flag("ignore_merges", false);

  const Node vocab = n.required("vocab");
  vocab.expect_object();
  bpe->vocab.reserve(vocab.size());
  for (const auto& [token, v] : vocab.value().items()) {
    const Node id_node = vocab.child(token);
    const int64_t id = id_node.integer();
    if (id < 0 || id >= kMaxTokenId) {
      id_node.fail("id " + std::to_string(id) + " of token " + json(token).dump() +
                   " is out of range (ids go from 0 to " + std::to_string(kMaxTokenId - 1) + ")");
    }
    const auto id32 = static_cast<int32_t>(id);
    if (static_cast<size_t>(id) >= bpe->tokens.size()) bpe->tokens.resize(id + 1, nullptr);
    if (bpe->tokens[id]) {
      id_node.fail("id " + std::to_string(id) + " of token " + json(token).dump() +
                   " is also the id of " + json(*bpe->tokens[id]).dump());
    }
    bpe->tokens[id] = &bpe->vocab.emplace(token, id32).first->first;
    const size_t len = token.empty() ? 0 : char_len(token, 0);
    if (!token.empty() && len == token.size() && first_invalid_utf8(token) == std::string::npos) {
      bpe->char_ids[code_point(token, 0, len)] = id32;
    }
  }

  const Node unk = n.child("unk_token");
  if (!unk.is_null()) {
    const auto it = bpe->vocab.find(unk.str());
    if (it == bpe->vocab.end()) unk.fail("unk_token " + unk.shown() + " is not in model.vocab");
    bpe->unk_id = it->second;
  }

  const Node merges = n.required("merges");
  merges.expect_array();
  bpe->merges.reserve(merges.size());
  for (size_t i = 0; i < merges.size(); ++i) {
    const Node m = merges.item(i);
    std::string a, b;
    if (m.value().is_string()) {  // "a b", the older form (Qwen2's file)
      const std::string s = m.str();
      const size_t sp = s.find(' ');
      if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos) {
        m.fail("expected \"<left> <right>\" (two tokens and one space), got " + m.shown());
      }
      a = s.substr(0, sp);
      b = s.substr(sp + 1);
    } else if (m.value().is_array() && m.size() == 2) {  // [a, b], what tokenizers 0.22 writes
      a = m.item(0).str();
      b = m.item(1).str();
    } else {
      m.fail("expected \"<left> <right>\" or [left, right], got " + m.shown());
    }
    const std::string merged = a + b;
    for (const std::string* t : std::array<const std::string*, 3>{&a, &b, &merged}) {
      if (!bpe->vocab.count(*t)) m.fail("token " + json(*t).dump() + " is not in model.vocab");
    }
    // A repeated pair keeps the later rank, as tokenizers' map does.
    bpe->merges[Bpe::key(bpe->vocab[a], bpe->vocab[b])] = {static_cast<int32_t>(i),
                                                           bpe->vocab[merged]};
  }
}

// ---- post-processors ----------------------------------------------------------------------------

struct PostProcessor {
  // TemplateProcessing's "single" template: nullopt for the sequence, else special token ids.
  std::vector<std::optional<std::vector<int64_t>>> single;
};

void parse_template(const Node& pieces, bool is_pair,
                    const std::map<std::string, std::vector<int64_t>>& specials,
                    std::vector<std::optional<std::vector<int64_t>>>* out) {
  pieces.expect_array();
  for (size_t i = 0; i < pieces.size(); ++i) {
    const Node piece = pieces.item(i);
    piece.expect_object();
    if (piece.value().contains("Sequence")) {
      piece.only_fields({"Sequence"});
      const Node seq = piece.child("Sequence");
      seq.expect_object();
      seq.only_fields({"id", "type_id"});
      const std::string id = seq.required("id").str();
      if (id != "A" && !(is_pair && id == "B")) {
        seq.child("id").fail("unsupported sequence id " + seq.child("id").shown() +
                             (is_pair ? " (A or B)" : " (a single template has only A)"));
      }
      seq.required("type_id").integer();
      if (out) out->push_back(std::nullopt);
    } else if (piece.value().contains("SpecialToken")) {
      piece.only_fields({"SpecialToken"});
      const Node sp = piece.child("SpecialToken");
      sp.expect_object();
      sp.only_fields({"id", "type_id"});
      const std::string name = sp.required("id").str();
      const auto it = specials.find(name);
      if (it == specials.end()) {
        sp.child("id").fail("special token " + json(name).dump() +
                            " is not in post_processor.special_tokens");
      }
      sp.required("type_id").integer();
      if (out) out->push_back(it->second);
    } else {
      piece.fail("expected {\"Sequence\": ...} or {\"SpecialToken\": ...}, got " + piece.shown());
    }
  }
}

// `known(id)`: whether the id is a token of the tokenizer (the template's ids must be).
void parse_post_processor(const Node& n, const std::function<bool(int64_t)>& known,
                          std::vector<PostProcessor>* out) {
  if (n.is_null()) return;
  const std::string type = n.type();
  if (type == "Sequence") {
    n.only_fields({"type", "processors"});
    const Node list = n.required("processors");
    list.expect_array();
    for (size_t i = 0; i < list.size(); ++i) parse_post_processor(list.item(i), known, out);
  } else if (type == "ByteLevel") {  // only trims offsets: no ids change
    n.only_fields({"type", "add_prefix_space", "trim_offsets", "use_regex"});
  } else if (type == "TemplateProcessing") {
    n.only_fields({"type", "single", "pair", "special_tokens"});
    std::map<std::string, std::vector<int64_t>> specials;
    const Node st = n.required("special_tokens");
    st.expect_object();
    for (const auto& [name, v] : st.value().items()) {
      const Node s = st.child(name);
      s.expect_object();
      s.only_fields({"id", "ids", "tokens"});
      const Node ids = s.required("ids");
      ids.expect_array();
      std::vector<int64_t> list;
      for (size_t i = 0; i < ids.size(); ++i) {
        const int64_t id = ids.item(i).integer();
        if (!known(id)) {
          ids.item(i).fail("id " + std::to_string(id) + " of special token " + json(name).dump() +
                           " is not in the vocabulary");
        }
        list.push_back(id);
      }
      const Node tokens = s.required("tokens");
      tokens.expect_array();
      if (tokens.size() != ids.size()) s.fail("ids and tokens differ in length");
      specials[name] = std::move(list);
    }
    PostProcessor p;
    parse_template(n.required("single"), false, specials, &p.single);
    if (!n.child("pair").is_null()) parse_template(n.child("pair"), true, specials, nullptr);
    out->push_back(std::move(p));
  } else {
    n.child("type").fail("unsupported post-processor \"" + type +
                         "\" (supported: ByteLevel, TemplateProcessing, Sequence)");
  }
}

}  // namespace

// ---- the tokenizer ------------------------------------------------------------------------------

struct Tokenizer::Impl {
  std::string name;
  Bpe model;
  Normalizer normalizer;
  std::vector<PreTokenizer> pre_tokenizers;
  std::vector<PostProcessor> post_processors;
  bool byte_level_decoder = false;
  std::vector<AddedToken> added;  // file order
  std::unordered_map<std::string, int32_t> added_by_content;
  std::unordered_map<int32_t, size_t> added_by_id;  // → index in `added`
  AddedMatcher raw_matcher;                         // normalized == false, matched on the input
  AddedMatcher normalized_matcher;  // normalized == true, matched on normalized pieces
  int64_t vocab_size = 0;
  int64_t id_limit = 0;

  const std::string* token(int64_t id) const {
    if (id < 0 || id > std::numeric_limits<int32_t>::max()) return nullptr;
    const auto it = added_by_id.find(static_cast<int32_t>(id));
    if (it != added_by_id.end()) return &added[it->second].content;
    if (static_cast<size_t>(id) < model.tokens.size()) return model.tokens[id];
    return nullptr;
  }

  void tokenize_text(const std::string& text, MatchBudget* budget,
                     std::vector<int64_t>* ids) const {
    std::vector<std::string> words{text}, next;
    for (const PreTokenizer& p : pre_tokenizers) {
      next.clear();
      pre_tokenize(p, words, budget, &next);
      words.swap(next);
    }
    for (const std::string& w : words) model.tokenize(w, ids);
  }
};

namespace {

void parse_added_tokens(const Node& n, Tokenizer::Impl* t) {
  if (n.is_null()) return;
  n.expect_array();
  const auto model_size = static_cast<int64_t>(t->model.vocab.size());
  int64_t max_added = -1;  // the largest added id so far
  for (size_t i = 0; i < n.size(); ++i) {
    const Node e = n.item(i);
    e.expect_object();
    e.only_fields({"id", "content", "single_word", "lstrip", "rstrip", "normalized", "special"});
    AddedToken a;
    a.content = e.required("content").str();
    a.single_word = e.required("single_word").boolean();
    a.lstrip = e.required("lstrip").boolean();
    a.rstrip = e.required("rstrip").boolean();
    a.normalized = e.required("normalized").boolean();
    a.special = e.required("special").boolean();
    const int64_t id = e.required("id").integer();
    if (a.content.empty()) e.child("content").fail("empty content");
    if (t->added_by_content.count(a.content)) {
      e.child("content").fail(json(a.content).dump() + " is listed twice");
    }
    // The id tokenizers gives it when loading (it re-adds the tokens in file order): the model's
    // id for a token already in the vocabulary, else one past the largest added id at or above the
    // vocabulary size, else the vocabulary size.
    int64_t expected = 0;
    const auto in_model = t->model.vocab.find(a.content);
    if (in_model != t->model.vocab.end()) {
      expected = in_model->second;
    } else {
      expected = max_added >= 0 && (max_added >= model_size || model_size == 0) ? max_added + 1
                                                                                : model_size;
    }
    if (id != expected) {
      e.child("id").fail("id " + std::to_string(id) + " for " + json(a.content).dump() +
                         ", but tokenizers assigns " + std::to_string(expected) +
                         " (the model's id, or the next id after the vocabulary in file order)");
    }
    if (id >= kMaxTokenId) {
      e.child("id").fail("id " + std::to_string(id) + " for " + json(a.content).dump() +
                         " is out of range (ids go up to " + std::to_string(kMaxTokenId - 1) + ")");
    }
    // tokenizers would give a token outside the vocabulary the id of a model token when the
    // vocabulary has gaps: two tokens for one id, refused.
    if (in_model == t->model.vocab.end() && static_cast<size_t>(id) < t->model.tokens.size() &&
        t->model.tokens[id]) {
      e.child("id").fail("id " + std::to_string(id) + " for " + json(a.content).dump() +
                         " is also the id of model token " + json(*t->model.tokens[id]).dump());
    }
    a.id = static_cast<int32_t>(id);
    max_added = std::max(max_added, id);
    t->added_by_content[a.content] = a.id;
    t->added.push_back(std::move(a));
  }
  for (size_t i = 0; i < t->added.size(); ++i) t->added_by_id[t->added[i].id] = i;
  for (const AddedToken& a : t->added) {
    if (a.normalized) {
      t->normalized_matcher.add(t->normalizer.apply(a.content), &a);
    } else {
      t->raw_matcher.add(a.content, &a);
    }
  }
  t->raw_matcher.finish();
  t->normalized_matcher.finish();
}

void parse_decoder(const Node& n, Tokenizer::Impl* t) {
  if (n.is_null()) return;
  const std::string type = n.type();
  if (type != "ByteLevel") {
    n.child("type").fail("unsupported decoder \"" + type + "\" (supported: ByteLevel)");
  }
  n.only_fields({"type", "add_prefix_space", "trim_offsets", "use_regex"});
  t->byte_level_decoder = true;
}

std::shared_ptr<Tokenizer::Impl> load(const json& root, const std::string& name) {
  auto t = std::make_shared<Tokenizer::Impl>();
  t->name = name;
  const Node r(root, "", t->name);
  r.expect_object();
  r.only_fields({"version", "truncation", "padding", "added_tokens", "normalizer", "pre_tokenizer",
                 "post_processor", "decoder", "model"});
  const Node version = r.child("version");
  if (!version.is_null() && version.str() != "1.0") {
    version.fail("unsupported version " + version.shown() + " (supported: \"1.0\")");
  }
  for (const char* key : {"truncation", "padding"}) {
    const Node v = r.child(key);
    if (!v.is_null()) v.fail("not supported (must be null), got " + v.shown());
  }
  parse_bpe(r.required("model"), &t->model);
  parse_normalizer(r.child("normalizer"), &t->normalizer);
  parse_added_tokens(r.child("added_tokens"), t.get());
  parse_pre_tokenizer(r.child("pre_tokenizer"), &t->pre_tokenizers);
  parse_post_processor(
      r.child("post_processor"), [&](int64_t id) { return t->token(id) != nullptr; },
      &t->post_processors);
  parse_decoder(r.child("decoder"), t.get());

  t->vocab_size = static_cast<int64_t>(t->model.vocab.size());
  t->id_limit = static_cast<int64_t>(t->model.tokens.size());
  for (const AddedToken& a : t->added) {
    if (!t->model.vocab.count(a.content)) ++t->vocab_size;
    t->id_limit = std::max<int64_t>(t->id_limit, int64_t{a.id} + 1);
  }
  return t;
}

}  // namespace

Tokenizer Tokenizer::from_json_string(const std::string& json_text, const std::string& name) {
  // Nesting is bounded while parsing (a 100k-deep normalizer list is refused, not built).
  return Tokenizer(load(parse_json(json_text, name), name));
}

Tokenizer Tokenizer::from_file(const std::string& path) {
  // read_json_file's steps, with errors that start with the path as the others here do: a regular
  // file of at most kMaxJsonBytes (a FIFO or a directory is refused at once), nesting bounded.
  return Tokenizer(load(parse_json(read_file(path, "tokenizer file"), path), path));
}

std::vector<int64_t> Tokenizer::encode(const std::string& utf8, bool add_special_tokens,
                                       bool split_special_tokens) const {
  const Impl& t = *impl_;
  const size_t bad = first_invalid_utf8(utf8);
  LVX_CHECK(bad == std::string::npos, t.name, ": encode: input is not valid UTF-8 (byte offset ",
            bad, " of ", utf8.size(), ")");
  std::vector<int64_t> ids;
  std::vector<Piece> raw, pieces;
  MatchBudget budget(utf8.size());
  t.raw_matcher.split(utf8, split_special_tokens, &raw);
  for (const Piece& r : raw) {
    if (r.id >= 0) {
      ids.push_back(r.id);
      continue;
    }
    pieces.clear();
    t.normalized_matcher.split(t.normalizer.apply(r.text), split_special_tokens, &pieces);
    for (const Piece& p : pieces) {
      if (p.id >= 0) {
        ids.push_back(p.id);
      } else {
        t.tokenize_text(p.text, &budget, &ids);
      }
    }
  }
  if (add_special_tokens) {
    for (const PostProcessor& p : t.post_processors) {
      std::vector<int64_t> out;
      for (const auto& piece : p.single) {
        const std::vector<int64_t>& add = piece ? *piece : ids;
        out.insert(out.end(), add.begin(), add.end());
      }
      ids.swap(out);
    }
  }
  return ids;
}

std::string Tokenizer::decode(const std::vector<int64_t>& ids, bool skip_special_tokens) const {
  const Impl& t = *impl_;
  std::vector<const std::string*> tokens;
  tokens.reserve(ids.size());
  for (int64_t id : ids) {
    const std::string* tok = t.token(id);
    LVX_CHECK(tok != nullptr, t.name, ": decode: id ", id,
              " is not in the vocabulary (ids go up to ", t.id_limit - 1, ")");
    if (skip_special_tokens) {
      const auto it = t.added_by_content.find(*tok);
      if (it != t.added_by_content.end() && t.added[t.added_by_id.at(it->second)].special) continue;
    }
    tokens.push_back(tok);
  }
  std::string out;
  if (!t.byte_level_decoder) {  // tokenizers without a decoder: tokens joined by spaces
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
  return utf8_lossy(bytes);
}

std::optional<int64_t> Tokenizer::token_to_id(const std::string& token) const {
  const auto a = impl_->added_by_content.find(token);
  if (a != impl_->added_by_content.end()) return a->second;
  const auto m = impl_->model.vocab.find(token);
  if (m != impl_->model.vocab.end()) return m->second;
  return std::nullopt;
}

std::string Tokenizer::id_to_token(int64_t id) const {
  const std::string* tok = impl_->token(id);
  LVX_CHECK(tok != nullptr, impl_->name, ": id ", id, " is not in the vocabulary");
  return *tok;
}

bool Tokenizer::is_special(int64_t id) const {
  if (id < 0 || id > std::numeric_limits<int32_t>::max()) return false;
  const auto it = impl_->added_by_id.find(static_cast<int32_t>(id));
  return it != impl_->added_by_id.end() && impl_->added[it->second].special;
}

int64_t Tokenizer::vocab_size() const { return impl_->vocab_size; }
int64_t Tokenizer::id_limit() const { return impl_->id_limit; }

}  // namespace lvx::models
