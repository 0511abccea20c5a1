// models/tokenizer/tokenizer.h against the `tokenizers` package (and transformers'
// Qwen2TokenizerFast / GPTNeoXTokenizerFast, which the generator checks agree with it):
// tests/reference/make_tokenizers.py trains small byte-level BPE tokenizers configured like
// Qwen2's and GPT-NeoX's (plus a variant covering the other supported options) and writes golden
// ids and decoded texts for multilingual, emoji, whitespace-heavy, NFD, contraction and
// special-token strings. Here: exact ids with and without special tokens, decoded text, decode of
// byte tokens that are not valid UTF-8, the round trip, ~100 KB of text (ids and speed), and the
// errors for invalid UTF-8 and for tokenizer files that do not parse or use what is not supported.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "models/tokenizer/tokenizer.h"
#include "src/common/error.h"
#include "tests/build_paths.h"
#include "tests/model_conformance.h"

using lvx::models::Tokenizer;
using json = nlohmann::json;
namespace fs = std::filesystem;

namespace {

const char* const kNames[] = {"qwen2", "neox", "variant"};

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

void write_file(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

// Printable form of a string for failure messages (JSON escapes).
std::string shown(const std::string& s) { return json(s).dump(); }

std::string shown(const std::vector<int64_t>& ids) { return json(ids).dump(); }

// The generated tokenizers and goldens (tests/model_conformance.h: made once per generator and
// package version, in the test-reference cache).
std::string generate_golden(std::string* log) {
  const std::string script = lvx::testing::source_dir() + "/tests/reference/make_tokenizers.py";
  return lvx::testing::generated(
      "tokenizers", lvx::testing::script_stamp(script),
      [&](const std::string& dir) {
        return lvx::testing::run_command(lvx::testing::configured_python() + " " + script + " " +
                                         dir);
      },
      log);
}

class TokenizerGolden : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (dir_) return;  // once per process, shared by the suites below
    log_ = new std::string;
    dir_ = new std::string(generate_golden(log_));
    if (!dir_->empty()) golden_ = new json(json::parse(read_file(*dir_ + "/golden.json")));
    // Files the tests write (edited tokenizers, CLI input) go to a folder of this process.
    scratch_ =
        new std::string(::testing::TempDir() + "/lvx_tokenizer_" + std::to_string(::getpid()));
    fs::create_directories(*scratch_);
    static const struct RemoveScratch {
      ~RemoveScratch() {
        std::error_code ec;
        fs::remove_all(*scratch_, ec);
      }
    } remove_scratch;
  }
  void SetUp() override {
    ASSERT_NE(golden_, nullptr) << *log_ << "\n(the generator needs tokenizers and transformers "
                                << "from requirements.txt: run setup.sh)";
  }
  static const json& golden(const std::string& name) { return (*golden_)[name]; }
  static Tokenizer load(const std::string& name) {
    return Tokenizer::from_file(*dir_ + "/" + golden(name)["file"].get<std::string>());
  }
  // Token strings of ids, for failure messages.
  static std::string tokens(const Tokenizer& t, const std::vector<int64_t>& ids) {
    std::string s;
    for (int64_t id : ids) s += (s.empty() ? "" : " ") + shown(t.id_to_token(id));
    return s;
  }

  static std::string* dir_;
  static std::string* scratch_;
  static std::string* log_;
  static json* golden_;
};

std::string* TokenizerGolden::dir_ = nullptr;
std::string* TokenizerGolden::scratch_ = nullptr;
std::string* TokenizerGolden::log_ = nullptr;
json* TokenizerGolden::golden_ = nullptr;

TEST_F(TokenizerGolden, EncodeGivesTheSameIds) {
  for (const char* name : kNames) {
    const Tokenizer t = load(name);
    EXPECT_EQ(t.vocab_size(), golden(name)["vocab_size"].get<int64_t>()) << name;
    int compared = 0;
    for (const json& c : golden(name)["cases"]) {
      const std::string text = c["text"];
      const auto want = c["ids"].get<std::vector<int64_t>>();
      const auto got = t.encode(text);
      EXPECT_EQ(got, want) << name << " " << shown(text) << "\n  lvx:        " << tokens(t, got)
                           << "\n  tokenizers: " << tokens(t, want);
      EXPECT_EQ(t.encode(text, true), c["ids_special"].get<std::vector<int64_t>>())
          << name << " with special tokens: " << shown(text);
      EXPECT_EQ(t.encode(text, false, true), c["ids_split"].get<std::vector<int64_t>>())
          << name << " with special tokens in the text as plain text: " << shown(text);
      ++compared;
    }
    EXPECT_GT(compared, 50) << name;
  }
}

TEST_F(TokenizerGolden, DecodeGivesTheSameText) {
  for (const char* name : kNames) {
    const Tokenizer t = load(name);
    for (const json& c : golden(name)["cases"]) {
      EXPECT_EQ(t.decode(c["ids"].get<std::vector<int64_t>>()), c["decoded"].get<std::string>())
          << name << " " << c["text"].dump();
      EXPECT_EQ(t.decode(c["ids_special"].get<std::vector<int64_t>>(), true),
                c["decoded_skip"].get<std::string>())
          << name << " skipping special tokens: " << c["text"].dump();
    }
    // Byte tokens that do not form valid UTF-8: one U+FFFD per maximal invalid subpart.
    for (const json& c : golden(name)["decode"]) {
      const auto ids = c["ids"].get<std::vector<int64_t>>();
      EXPECT_EQ(t.decode(ids, c["skip"].get<bool>()), c["text"].get<std::string>())
          << name << " " << c["name"] << " " << shown(ids) << " skip " << c["skip"];
    }
  }
}

TEST_F(TokenizerGolden, DecodeOfEncodeIsTheNormalizedText) {
  for (const char* name : {"qwen2", "neox"}) {
    ASSERT_TRUE(golden(name)["roundtrip"].get<bool>());
    const Tokenizer t = load(name);
    for (const json& c : golden(name)["cases"]) {
      const std::string text = c["text"];
      EXPECT_EQ(t.decode(t.encode(text)), c["normalized"].get<std::string>())
          << name << " " << shown(text);
    }
    // NFD input comes back composed (the NFC normalizer), identical to the NFC input's ids.
    EXPECT_EQ(t.encode("Ame\xcc\x81lie"), t.encode("Am\xc3\xa9lie")) << name;
    EXPECT_EQ(t.decode(t.encode("Ame\xcc\x81lie")), "Am\xc3\xa9lie") << name;
  }
}

// decode_bytes (each token's own bytes, for logprobs' "bytes"): token by token they add up to the
// text's UTF-8 exactly, characters cut between tokens included, where decoding each token alone
// gives U+FFFD for a partial character.
TEST_F(TokenizerGolden, EachTokensBytesAddUpToTheText) {
  for (const char* name : {"qwen2", "neox"}) {
    const Tokenizer t = load(name);
    int cut = 0;
    for (const json& c : golden(name)["cases"]) {
      const std::string normalized = c["normalized"];
      std::string joined;
      for (int64_t id : t.encode(normalized)) {
        const std::string own = t.decode_bytes({id});
        joined += own;
        if (t.decode({id}) != own) ++cut;  // not valid UTF-8 alone
      }
      EXPECT_EQ(joined, normalized) << name << " " << shown(normalized);
    }
    EXPECT_GT(cut, 0) << name << ": no case cuts a character between tokens";
  }
}

TEST_F(TokenizerGolden, SpecialTokensAndLookups) {
  const Tokenizer qwen = load("qwen2");
  const auto im_start = qwen.token_to_id("<|im_start|>");
  const auto image = qwen.token_to_id("<|image|>");
  ASSERT_TRUE(im_start && image);
  EXPECT_TRUE(qwen.is_special(*image));
  EXPECT_FALSE(qwen.is_special(*qwen.token_to_id("<tool_call>")));
  EXPECT_EQ(qwen.id_to_token(*image), "<|image|>");
  const auto ids = qwen.encode("<|im_start|>user\n<|image|><|image|>What?<|im_end|>");
  ASSERT_GE(ids.size(), 5u);
  EXPECT_EQ(ids[0], *im_start);
  EXPECT_EQ(std::count(ids.begin(), ids.end(), *image), 2);
  EXPECT_EQ(qwen.decode(ids, true), "user\nWhat?");
  EXPECT_FALSE(qwen.token_to_id("<|not a token|>"));
  EXPECT_EQ(qwen.id_limit(), qwen.vocab_size());
  // Byte-level tokens are stored in the GPT-2 alphabet: a space is "Ġ".
  EXPECT_TRUE(qwen.token_to_id("\xc4\xa0"));

  const Tokenizer neox = load("neox");
  EXPECT_EQ(neox.token_to_id("<|endoftext|>"), 0);
  const auto eot = neox.encode("hi", true);
  EXPECT_EQ(eot.back(), 0) << "TemplateProcessing \"$A <|endoftext|>\"";
  EXPECT_EQ(neox.encode("hi", false).size() + 1, eot.size());

  try {
    qwen.id_to_token(qwen.id_limit());
    ADD_FAILURE() << "no error for an unknown id";
  } catch (const lvx::Error& e) {
    EXPECT_NE(std::string(e.what()).find("not in the vocabulary"), std::string::npos) << e.what();
  }
  EXPECT_THROW(qwen.decode({1, -1}), lvx::Error);
  EXPECT_THROW(qwen.decode({qwen.id_limit()}), lvx::Error);
}

TEST_F(TokenizerGolden, InvalidUtf8IsAnError) {
  const Tokenizer t = load("qwen2");
  const std::pair<std::string, size_t> cases[] = {
      {"\xff", 0},                // never valid
      {"abc\xe4\xb8", 3},         // truncated character at the end
      {"ok \xc0\x80", 3},         // overlong NUL
      {"x\xed\xa0\x80y", 1},      // UTF-16 surrogate
      {"\xf4\x90\x80\x80", 0},    // above U+10FFFF
      {"a<|im_start|>\x80", 13},  // after a special token
  };
  for (const auto& [text, offset] : cases) {
    try {
      t.encode(text);
      ADD_FAILURE() << "no error for " << shown(std::vector<int64_t>(text.begin(), text.end()));
    } catch (const lvx::Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("not valid UTF-8 (byte offset " + std::to_string(offset) + " "),
                std::string::npos)
          << msg;
    }
  }
}

// ~100 KB of mixed text: the same ids as tokenizers, from a fresh tokenizer (empty word cache)
// and again warm. (Its speed is measured in benchmarks, never asserted here.)
TEST_F(TokenizerGolden, HundredKilobytesEncodeExactly) {
  const std::string big = read_file(*dir_ + "/big.txt");
  ASSERT_GT(big.size(), 100000u);
  for (const char* name : kNames) {
    const Tokenizer t = load(name);
    const auto ids = t.encode(big);
    const auto again = t.encode(big);
    const auto want = golden(name)["big_ids"].get<std::vector<int64_t>>();
    EXPECT_EQ(ids == want, true) << name << ": " << ids.size() << " ids vs " << want.size();
    EXPECT_EQ(again, ids);
    EXPECT_EQ(t.decode(ids),
              golden(name)["roundtrip"].get<bool>() ? t.decode(want) : t.decode(ids));
  }
}

TEST_F(TokenizerGolden, LongRunsAndThreads) {
  const Tokenizer t = load("qwen2");
  // One 1 MB whitespace run, a 200 KB word and 100 KB of one emoji: nothing fails, text returns.
  for (const std::string& s : {std::string(1 << 20, ' '), std::string(200000, 'a'), [] {
                                 std::string e;
                                 for (int i = 0; i < 25000; ++i) e += "\xf0\x9f\x98\x80";
                                 return e;
                               }()}) {
    EXPECT_EQ(t.decode(t.encode(s)), s);
  }
  // Encode from several threads at once (the word cache is shared).
  const std::string big = read_file(*dir_ + "/big.txt");
  const auto want = t.encode(big);
  std::vector<std::vector<int64_t>> got(4);
  std::vector<std::thread> threads;
  const Tokenizer fresh = load("qwen2");
  for (size_t i = 0; i < got.size(); ++i)
    threads.emplace_back([&, i] { got[i] = fresh.encode(big); });
  for (auto& th : threads) th.join();
  for (const auto& g : got) EXPECT_EQ(g == want, true);
}

// ---- tokenizer files that do not load -----------------------------------------------------------

class TokenizerFiles : public TokenizerGolden {
 protected:
  // The qwen2 file, edited, written to a new file; returns its path.
  std::string edited(const std::string& tag, const std::function<void(json&)>& edit) {
    json j = json::parse(read_file(*dir_ + "/qwen2/tokenizer.json"));
    edit(j);
    const std::string path = *scratch_ + "/bad_" + tag + ".json";
    write_file(path, j.dump());
    return path;
  }
  // The load error of the edited file ("" if it loaded).
  std::string error_after(const std::string& tag, const std::function<void(json&)>& edit) {
    return error_of(edited(tag, edit));
  }
  static std::string error_of(const std::string& path) {
    try {
      Tokenizer::from_file(path);
    } catch (const lvx::Error& e) {
      return e.what();
    }
    return "";
  }
};

// Every part must appear in the message.
void expect_message(const std::string& msg, std::initializer_list<std::string> parts) {
  ASSERT_FALSE(msg.empty()) << "no error";
  for (const std::string& p : parts)
    EXPECT_NE(msg.find(p), std::string::npos) << "'" << p << "' not in: " << msg;
}

TEST_F(TokenizerFiles, FileThatIsNotJson) {
  const std::string path = *scratch_ + "/corrupt.json";
  write_file(path, "{\"version\": \"1.0\", \"model\": {\"type\": \"BPE\", ");
  expect_message(error_of(path), {path + ": not valid JSON (", "parse error"});
  write_file(path, "");
  expect_message(error_of(path), {path + ": not valid JSON ("});
  // A truncated copy of a real file.
  const std::string real = read_file(*dir_ + "/qwen2/tokenizer.json");
  write_file(path, real.substr(0, real.size() / 2));
  expect_message(error_of(path), {path + ": not valid JSON ("});
  expect_message(error_of(*scratch_ + "/no_such_file.json"),
                 {"tokenizer file '" + *scratch_ + "/no_such_file.json' does not exist"});
  // Not a regular file: refused at once (a FIFO without a writer would block a plain open).
  expect_message(error_of(*scratch_), {"tokenizer file '" + *scratch_ + "' is a directory"});
  const std::string fifo = *scratch_ + "/fifo.json";
  fs::remove(fifo);
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  expect_message(error_of(fifo), {"tokenizer file '" + fifo + "' is a FIFO"});
  // Nesting is bounded while reading (a 100k-deep normalizer list is not built).
  json deep = {{"type", "NFC"}};
  for (int i = 0; i < 100; ++i) deep = {{"type", "Sequence"}, {"normalizers", json::array({deep})}};
  json j = json::parse(real);
  j["normalizer"] = deep;
  write_file(path, j.dump());
  expect_message(error_of(path), {path + ": JSON nested deeper than 64 levels"});
  std::string very_deep = "{\"normalizer\": ";
  for (int i = 0; i < 100000; ++i) very_deep += "{\"type\": \"Sequence\", \"normalizers\": [";
  write_file(path, very_deep);
  expect_message(error_of(path), {"JSON nested deeper than 64 levels"});
}

TEST_F(TokenizerFiles, MissingOrMalformedFields) {
  expect_message(error_after("no_vocab", [](json& j) { j["model"].erase("vocab"); }),
                 {"bad_no_vocab.json: model.vocab: missing required field"});
  expect_message(error_after("no_model", [](json& j) { j.erase("model"); }),
                 {"bad_no_model.json: model: missing required field"});
  expect_message(error_after("no_type", [](json& j) { j["model"].erase("type"); }),
                 {"model.type: missing required field"});
  expect_message(error_after("vocab_array", [](json& j) { j["model"]["vocab"] = json::array(); }),
                 {"model.vocab: expected an object, got []"});
  expect_message(
      error_after("merge", [](json& j) { j["model"]["merges"][3] = "zzz_not_a_token q"; }),
      {"model.merges[3]: token \"zzz_not_a_token\" is not in model.vocab"});
  expect_message(error_after("merge3", [](json& j) { j["model"]["merges"][0] = "a b c"; }),
                 {"model.merges[0]: expected \"<left> <right>\""});
  expect_message(error_after("flag", [](json& j) { j["added_tokens"][0]["lstrip"] = "yes"; }),
                 {"added_tokens[0].lstrip: expected true or false, got \"yes\""});
  expect_message(error_after("added_id", [](json& j) { j["added_tokens"][1]["id"] = 5000; }),
                 {"added_tokens[1].id: id 5000 for \"<|im_start|>\", but tokenizers assigns"});
  expect_message(
      error_after(
          "regex",
          [](json& j) { j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "(a"; }),
      {"pre_tokenizer.pretokenizers[0].pattern.Regex: regex does not compile", "\"(a\""});
}

TEST_F(TokenizerFiles, UnsupportedContentIsNamed) {
  expect_message(error_after("wordpiece", [](json& j) { j["model"]["type"] = "WordPiece"; }),
                 {"bad_wordpiece.json: model.type: unsupported model type \"WordPiece\""});
  expect_message(error_after("metaspace",
                             [](json& j) {
                               j["pre_tokenizer"] = {{"type", "Metaspace"}, {"replacement", "_"}};
                             }),
                 {"pre_tokenizer.type: unsupported pre-tokenizer \"Metaspace\""});
  expect_message(error_after("lowercase",
                             [](json& j) {
                               j["normalizer"] = {{"type", "Lowercase"}};
                             }),
                 {"normalizer.type: unsupported normalizer \"Lowercase\""});
  expect_message(error_after("bert",
                             [](json& j) {
                               j["post_processor"] = {{"type", "BertProcessing"}};
                             }),
                 {"post_processor.type: unsupported post-processor \"BertProcessing\""});
  expect_message(error_after("wp_decoder",
                             [](json& j) {
                               j["decoder"] = {{"type", "WordPiece"}};
                             }),
                 {"decoder.type: unsupported decoder \"WordPiece\""});
  expect_message(error_after("fallback", [](json& j) { j["model"]["byte_fallback"] = true; }),
                 {"model.byte_fallback: byte_fallback true is not supported"});
  expect_message(error_after("dropout", [](json& j) { j["model"]["dropout"] = 0.1; }),
                 {"model.dropout: BPE dropout 0.1 is not supported"});
  expect_message(
      error_after("prefix", [](json& j) { j["model"]["continuing_subword_prefix"] = "##"; }),
      {"model.continuing_subword_prefix: continuing_subword_prefix \"##\""});
  expect_message(error_after("truncation",
                             [](json& j) {
                               j["truncation"] = {{"max_length", 512}};
                             }),
                 {"truncation: not supported (must be null)", "512"});
  expect_message(error_after("field", [](json& j) { j["model"]["surprise"] = 7; }),
                 {"model.surprise: unsupported field (value 7)"});
  expect_message(
      error_after("behavior",
                  [](json& j) { j["pre_tokenizer"]["pretokenizers"][0]["behavior"] = "Sideways"; }),
      {"pre_tokenizer.pretokenizers[0].behavior: unsupported split behavior "
       "\"Sideways\""});
}

// Without a decoder, tokenizers joins the token strings with spaces; the ids do not change.
TEST_F(TokenizerFiles, NoDecoderJoinsTokensWithSpaces) {
  const Tokenizer plain = Tokenizer::from_file(edited("no_decoder", [](json& j) {
    j["decoder"] = nullptr;
    j["post_processor"] = nullptr;
  }));
  const Tokenizer qwen = load("qwen2");
  const std::string text = "Hello world<|im_end|>";
  const auto ids = qwen.encode(text);
  EXPECT_EQ(plain.encode(text), ids);
  std::string joined;
  for (int64_t id : ids) joined += (joined.empty() ? "" : " ") + qwen.id_to_token(id);
  EXPECT_EQ(plain.decode(ids), joined);
  EXPECT_NE(joined.find("\xc4\xa0"), std::string::npos) << "byte-level space 'Ġ' kept: " << joined;
}

// Ids come from the vocabulary: negative, huge, shared or unknown ids are refused naming the token.
TEST_F(TokenizerFiles, IdsAreBoundedByTheVocabulary) {
  expect_message(error_after("negative", [](json& j) { j["model"]["vocab"]["zz_neg"] = -3; }),
                 {"model.vocab.zz_neg: id -3 of token \"zz_neg\" is out of range"});
  expect_message(
      error_after("huge", [](json& j) { j["model"]["vocab"]["zz_huge"] = 2147483647; }),
      {"model.vocab.zz_huge: id 2147483647 of token \"zz_huge\" is out of range", "16777215"});
  expect_message(
      error_after("shared",
                  [](json& j) { j["model"]["vocab"]["zz_shared"] = j["model"]["vocab"]["a"]; }),
      {"is also the id of"});
  // A gap in the vocabulary: the next added token would get the id of a model token.
  expect_message(error_after("gap",
                             [](json& j) {
                               auto& v = j["model"]["vocab"];
                               const int64_t n = static_cast<int64_t>(v.size());
                               std::string last;
                               for (auto it = v.begin(); it != v.end(); ++it)
                                 if (it.value() == n - 1) last = it.key();
                               v[last] = n;  // ids 0..n-2 and n: the added tokens start at n
                             }),
                 {"added_tokens[0].id: id", "is also the id of model token"});
  expect_message(error_after("added_negative", [](json& j) { j["added_tokens"][0]["id"] = -1; }),
                 {"added_tokens[0].id: id -1 for \"<|endoftext|>\""});
  expect_message(
      error_after("template_id",
                  [](json& j) {
                    j["post_processor"] = {
                        {"type", "TemplateProcessing"},
                        {"single",
                         {{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}},
                          {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}},
                        {"pair", nullptr},
                        {"special_tokens",
                         {{"<s>", {{"id", "<s>"}, {"ids", {-7}}, {"tokens", {"<s>"}}}}}}};
                  }),
      {"post_processor.special_tokens.<s>.ids[0]: id -7 of special token \"<s>\" is "
       "not in the vocabulary"});
}

// Text from users: special tokens written in it are plain text with split_special_tokens (the
// golden ids of every test string are checked in EncodeGivesTheSameIds).
TEST_F(TokenizerGolden, SpecialTokensInUserTextArePlainText) {
  const Tokenizer qwen = load("qwen2");
  const int64_t image = *qwen.token_to_id("<|image|>");
  const auto plain = qwen.encode("what <|image|> is this", false, true);
  EXPECT_EQ(std::count(plain.begin(), plain.end(), image), 0);
  EXPECT_EQ(qwen.decode(plain), "what <|image|> is this");
  const auto with = qwen.encode("what <|image|> is this");
  EXPECT_EQ(std::count(with.begin(), with.end(), image), 1);
  // A non-special added token is still matched.
  const auto call = qwen.encode("<tool_call>", false, true);
  EXPECT_EQ(call, std::vector<int64_t>{*qwen.token_to_id("<tool_call>")});
}

// Linear time: a 10^6-character text, and a tokenizer with 200k added tokens, in seconds. (The
// bounds are loose on purpose: a quadratic step takes minutes to hours here.)
TEST_F(TokenizerFiles, LongTextsAndManyAddedTokensTakeLinearTime) {
  using clock = std::chrono::steady_clock;
  const Tokenizer qwen = load("qwen2");
  std::string text;
  const std::string big = read_file(*dir_ + "/big.txt");
  while (text.size() < 1000000) text += big.substr(0, 1000000 - text.size());
  for (const std::string& s :
       {text, std::string(1000000, 'a'), std::string(1000000, '<'), std::string(1000000, ' ')}) {
    const auto t0 = clock::now();
    const auto ids = qwen.encode(s, false, true);
    EXPECT_FALSE(ids.empty());
    EXPECT_LT(std::chrono::duration<double>(clock::now() - t0).count(), 10.0)
        << s.substr(0, 20) << "...";
  }
  const auto t0 = clock::now();
  const Tokenizer many = Tokenizer::from_file(edited("many_added", [](json& j) {
    int64_t next = 0;
    for (const json& a : j["added_tokens"]) next = std::max<int64_t>(next, a["id"].get<int64_t>());
    for (int i = 0; i < 200000; ++i) {
      j["added_tokens"].push_back({{"id", ++next},
                                   {"content", "<|extra_" + std::to_string(i) + "|>"},
                                   {"single_word", false},
                                   {"lstrip", false},
                                   {"rstrip", false},
                                   {"normalized", i % 2 == 0},
                                   {"special", i % 3 == 0}});
    }
  }));
  std::string many_text;
  for (int i = 0; i < 20000; ++i) many_text += "hi <|extra_17|> x<|extra_199999|><|extra_ <";
  const auto ids = many.encode(many_text);
  EXPECT_LT(std::chrono::duration<double>(clock::now() - t0).count(), 10.0);
  EXPECT_EQ(std::count(ids.begin(), ids.end(), *many.token_to_id("<|extra_17|>")), 20000);
  EXPECT_EQ(std::count(ids.begin(), ids.end(), *many.token_to_id("<|extra_199999|>")), 20000);
  EXPECT_EQ(many.vocab_size(), qwen.vocab_size() + 200000);
}

// A pre-tokenizer regex that backtracks just under any per-call limit (about 6M steps a call, on
// every character) ends in an error naming it within the text's matching budget.
TEST_F(TokenizerFiles, RegexMatchingHasABudgetPerText) {
  const std::string pattern = "(?:a|a){0,21}x|a";
  const Tokenizer t = Tokenizer::from_file(edited("backtracking", [&](json& j) {
    j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = pattern;
  }));
  const auto t0 = std::chrono::steady_clock::now();
  try {
    t.encode(std::string(46000, 'a'));
    ADD_FAILURE() << "no error";
  } catch (const lvx::Error& e) {
    expect_message(e.what(), {"pre_tokenizer.pretokenizers[0].pattern.Regex: the regex " +
                                  json(pattern).dump() + " used up its matching budget",
                              "46000 bytes"});
  }
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 10.0);
  // Short texts it can do are done.
  EXPECT_EQ(t.decode(t.encode("aaa")), "aaa");
  // PCRE2-only verbs that switch off its search optimizations (no Oniguruma syntax) are refused.
  expect_message(error_after("verb",
                             [](json& j) {
                               j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] =
                                   "(*NO_START_OPT)a*b";
                             }),
                 {"pattern.Regex: PCRE2 start-of-pattern options are not supported"});
}

TEST_F(TokenizerGolden, Cli) {
  const std::string lvx = lvx::testing::binary_dir() + "/lvx";
  if (!fs::exists(lvx)) GTEST_SKIP() << "build the lvx target first";
  const std::string file = *dir_ + "/qwen2/tokenizer.json";
  const Tokenizer t = Tokenizer::from_file(file);
  const std::string text = "Hello 世界 <|image|>!";
  write_file(*scratch_ + "/cli.txt", text);
  std::string out = lvx::testing::run_command(lvx + " tokenize --tokenizer " + file + " --file " +
                                              *scratch_ + "/cli.txt");
  std::string want;
  for (int64_t id : t.encode(text)) want += (want.empty() ? "" : " ") + std::to_string(id);
  EXPECT_EQ(out, want + "\n");
  write_file(*scratch_ + "/cli_ids.txt", want + "\n");
  out = lvx::testing::run_command(lvx + " tokenize --decode --tokenizer " + file + " --file " +
                                  *scratch_ + "/cli_ids.txt");
  EXPECT_EQ(out, text + "\n");
  write_file(*scratch_ + "/cli_corrupt.json", "{\"model\": ");
  out = lvx::testing::run_command(lvx + " tokenize --tokenizer " + *scratch_ + "/cli_corrupt.json" +
                                  " --text x");
  EXPECT_NE(out.find("not valid JSON"), std::string::npos) << out;
  EXPECT_NE(out.find("exit status"), std::string::npos) << out;
}

}  // namespace
