// Byte-level BPE tokenizers read from a Hugging Face tokenizer.json (Qwen2 / mPLUG-Owl3, GPT-NeoX /
// MPT / OpenFlamingo), giving the same ids as the `tokenizers` package (0.22) and transformers'
// fast tokenizers. One file per part of tokenizer.json in this folder: utf8, regex (PCRE2),
// normalizer, pre_tokenizer, bpe, added_tokens (Aho-Corasick), post_processor, decoder.
//
// Pipeline of encode(), as tokenizers runs it:
//   1. added tokens with normalized=false are split out of the raw text (leftmost-longest match
//      by an Aho-Corasick automaton, linear in the text whatever the number of tokens; honoring
//      single_word, lstrip and rstrip; with split_special_tokens, special ones stay text);
//   2. each remaining piece is normalized (NFC/NFD/NFKC/NFKD through ICU, or none), then added
//      tokens with normalized=true are split out of it (matched against their normalized form);
//   3. each remaining piece is pre-tokenized (Split with a regex or a literal, ByteLevel with or
//      without the GPT-2 regex, or a Sequence of these) into words; regexes run in PCRE2 with
//      UTF and Unicode properties (\p{L}, \p{N}, lookahead), \s meaning Unicode White_Space as in
//      the Oniguruma engine tokenizers uses;
//   4. each word goes through BPE: merges applied lowest rank first (a heap over the word's pairs),
//      results cached per word;
//   5. with add_special_tokens, the post-processor adds its tokens (TemplateProcessing's "single"
//      template; ByteLevel adds none).
//
// Supported tokenizer.json content (anything else is an lvx::Error naming the file, the JSON path
// and the value; nothing is silently ignored):
//   model          BPE only; vocab; merges as "a b" strings or [a, b] lists; dropout null or 0;
//                  unk_token (with fuse_unk); continuing_subword_prefix / end_of_word_suffix null
//                  or ""; byte_fallback false; ignore_merges.
//   normalizer     null, NFC, NFD, NFKC, NFKD, or a Sequence of these.
//   pre_tokenizer  null, ByteLevel (add_prefix_space, use_regex; trim_offsets only moves offsets),
//                  Split (pattern {"Regex"} or {"String"}, behavior Removed / Isolated /
//                  MergedWithPrevious / MergedWithNext / Contiguous, invert), or a Sequence.
//   post_processor null, ByteLevel, TemplateProcessing ("single" is used; "pair" is checked but
//                  this API encodes single sequences only), or a Sequence of these.
//   decoder        null (tokens joined by " ", as tokenizers does) or ByteLevel.
//   added_tokens   special or not, single_word, lstrip, rstrip, normalized; each id must be the
//                  one tokenizers assigns (the model's id for a token already in the vocabulary,
//                  else the next free id after the vocabulary, in file order).
//   truncation and padding must be null.
//
// Deliberate differences from tokenizers: encode() rejects invalid UTF-8 (tokenizers only takes
// Rust strings, so it never sees any); decode() rejects ids outside the vocabulary (tokenizers
// drops them silently); loading rejects ids of 2^24 or more, an added token given a model
// token's id (a vocabulary with gaps), a post-processor id outside the vocabulary, and regexes
// starting with PCRE2's (*...) options; a regex that backtracks past the matching budget of a
// text is an error. Offsets, pairs, truncation and padding are not provided.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace lvx::models {

class Tokenizer {
 public:
  // Reads and checks a tokenizer.json. Errors name the file and the JSON path: a file that is
  // missing ("does not exist"), not a regular file (a FIFO, a directory), not JSON ("not valid
  // JSON"), nested deeper than 64 levels, lacks a required field, has an unsupported type or field
  // value, an id that is negative, 2^24 or more, used by two tokens, not the one tokenizers
  // assigns to an added token, or not in the vocabulary (a post-processor's special token), or a
  // regex PCRE2 cannot compile.
  static Tokenizer from_file(const std::string& tokenizer_json_path);
  // Same from the JSON text; `name` stands for the file in error messages.
  static Tokenizer from_json_string(const std::string& json_text,
                                    const std::string& name = "<tokenizer.json>");

  // UTF-8 text → ids. add_special_tokens applies the post-processor (e.g. a BOS/EOS template).
  // Added tokens written in the text are recognized; with split_special_tokens those marked
  // special are not, and are tokenized as plain text (tokenizers' encode_special_tokens,
  // transformers' split_special_tokens=True): the mode for text from users, so that "<|image|>"
  // in a question cannot become an image token. Time is O(n log n) in the text's length
  // whatever the number of added tokens; pre-tokenizer regexes get a matching budget per text
  // (an lvx::Error naming the pattern when a pattern backtracks past it). Throws lvx::Error on
  // invalid UTF-8 (naming the byte offset). Thread-safe.
  std::vector<int64_t> encode(const std::string& utf8, bool add_special_tokens = false,
                              bool split_special_tokens = false) const;

  // Ids → text through the decoder. skip_special_tokens drops added tokens marked special (false
  // by default as in transformers' decode; tokenizers' Python binding defaults to true). Byte
  // sequences that are not valid UTF-8 (e.g. a character cut between ids) become U+FFFD, one per
  // maximal invalid subsequence, as tokenizers does. Throws lvx::Error on an unknown id.
  std::string decode(const std::vector<int64_t>& ids, bool skip_special_tokens = false) const;
  // The bytes decode() makes text of, invalid UTF-8 kept as it is (one token's own bytes: a
  // byte-level token may hold part of a character). Throws lvx::Error on an unknown id.
  std::string decode_bytes(const std::vector<int64_t>& ids) const;

  // Token string (as stored: byte-level characters for model tokens, the content for added
  // tokens) ↔ id. Added tokens take precedence. id_to_token throws lvx::Error on an unknown id.
  std::optional<int64_t> token_to_id(const std::string& token) const;
  std::string id_to_token(int64_t id) const;
  // True for added tokens marked special (those skip_special_tokens drops).
  bool is_special(int64_t id) const;

  // Distinct tokens, added tokens included (tokenizers' get_vocab_size(with_added_tokens=true),
  // transformers' len(tokenizer)).
  int64_t vocab_size() const;
  // Largest id + 1 (the embedding rows a model needs); >= vocab_size().
  int64_t id_limit() const;

  struct Impl;

 private:
  explicit Tokenizer(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}
  // The stored token strings of `ids`, special ones dropped when asked; throws on unknown ids.
  std::vector<const std::string*> tokens_of(const std::vector<int64_t>& ids,
                                            bool skip_special_tokens) const;
  std::shared_ptr<const Impl> impl_;
};

}  // namespace lvx::models
