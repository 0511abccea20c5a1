// Tiny random mPLUG-Owl3 checkpoints and their word-level BPE tokenizer (see init.h).
#include "models/init.h"

#include <ATen/CPUGeneratorImpl.h>

#include <cctype>
#include <cmath>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <utility>

#include "models/checkpoint.h"
#include "models/mplug_owl3/model.h"
#include "models/tokenizer/tokenizer.h"
#include "src/common/error.h"

namespace lvx::models {
namespace {

const char* const kSpecials[] = {"<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|image|>"};

// Qwen2's pre-tokenizer regex (as in its released tokenizer.json).
const char* const kQwen2Pattern =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| "
    "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
    "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

std::string utf8(uint32_t cp) {
  std::string s;
  if (cp < 0x80) {
    s += static_cast<char>(cp);
  } else if (cp < 0x800) {
    s += static_cast<char>(0xC0 | (cp >> 6));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    s += static_cast<char>(0xE0 | (cp >> 12));
    s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  }
  return s;
}

// GPT-2's bytes_to_unicode: printable bytes stand for themselves, the others (control
// characters, space, 127–160, 173) for U+0100 onwards in byte order; so ' ' is 'Ġ' (U+0120).
const std::vector<std::string>& byte_symbols() {
  static const std::vector<std::string> table = [] {
    std::vector<std::string> t(256);
    uint32_t next = 256;
    for (uint32_t b = 0; b < 256; ++b) {
      const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || b >= 174;
      t[b] = utf8(printable ? b : next++);
    }
    return t;
  }();
  return table;
}

using Merges = std::map<std::pair<std::string, std::string>, int64_t>;  // pair → rank

// BPE as tokenizers applies it: repeatedly merge the lowest-ranked adjacent pair (leftmost on a
// tie) until no pair has a merge.
std::vector<std::string> bpe(std::vector<std::string> symbols, const Merges& merges) {
  while (symbols.size() > 1) {
    int64_t best_rank = -1;
    size_t best = 0;
    for (size_t i = 0; i + 1 < symbols.size(); ++i) {
      auto it = merges.find({symbols[i], symbols[i + 1]});
      if (it != merges.end() && (best_rank < 0 || it->second < best_rank)) {
        best_rank = it->second;
        best = i;
      }
    }
    if (best_rank < 0) break;
    symbols[best] += symbols[best + 1];
    symbols.erase(symbols.begin() + static_cast<std::ptrdiff_t>(best) + 1);
  }
  return symbols;
}

at::Tensor init_tensor(const std::string& name, const std::vector<int64_t>& shape,
                       at::Generator& gen) {
  const std::string leaf = name.substr(name.rfind('.') + 1);
  auto ends_with = [&](const std::string& s) {
    return name.size() >= s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0;
  };
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  if (leaf == "gate" || leaf == "bias") return at::zeros(shape, f32);
  if (name.find("norm") != std::string::npos) return at::ones(shape, f32);  // RMSNorm/LayerNorm
  if (ends_with("embed_tokens.weight")) return at::randn(shape, gen, f32);
  if (ends_with("position_embedding.weight")) return at::randn(shape, gen, f32) * 0.02;
  LVX_CHECK(shape.size() >= 2, "tiny model init: no rule for tensor '", name, "'");
  int64_t fan_in = 1;  // Linear [out, in], Conv2d [out, in, kh, kw]
  for (size_t i = 1; i < shape.size(); ++i) fan_in *= shape[i];
  return at::randn(shape, gen, f32) / std::sqrt(static_cast<double>(fan_in));
}

}  // namespace

std::string tiny_tokenizer_json(const std::vector<std::string>& words) {
  std::vector<SpecialToken> specials;
  for (const char* c : kSpecials) specials.push_back({c, -1});
  return byte_level_tokenizer_json(words, specials);
}

std::string byte_level_tokenizer_json(const std::vector<std::string>& words,
                                      const std::vector<SpecialToken>& specials) {
  const std::vector<std::string>& bytes = byte_symbols();
  nlohmann::ordered_json vocab = nlohmann::ordered_json::object();
  for (int b = 0; b < 256; ++b) vocab[bytes[b]] = b;
  Merges merges;
  std::vector<std::string> merge_list;
  for (const std::string& w : words) {
    LVX_CHECK(!w.empty(), "tokenizer words: an empty word");
    for (unsigned char ch : w)
      LVX_CHECK(std::isalpha(ch) || ch >= 0x80, "tokenizer words: '", w,
                "' has a character that is not a letter; the pre-tokenizer would split it");
    for (const std::string& form : {w, " " + w}) {
      std::vector<std::string> symbols;
      for (unsigned char ch : form) symbols.push_back(bytes[ch]);
      // New merges rank after all earlier ones: a word already one token has no pair left, so
      // nothing added here can change how it encodes.
      for (symbols = bpe(symbols, merges); symbols.size() > 1; symbols = bpe(symbols, merges)) {
        const std::string merged = symbols[0] + symbols[1];
        merges.emplace(std::make_pair(symbols[0], symbols[1]),
                       static_cast<int64_t>(merge_list.size()));
        merge_list.push_back(symbols[0] + " " + symbols[1]);
        if (!vocab.contains(merged)) vocab[merged] = static_cast<int64_t>(vocab.size());
      }
    }
  }
  nlohmann::ordered_json added = nlohmann::ordered_json::array();
  int64_t id = static_cast<int64_t>(vocab.size());
  for (const SpecialToken& s : specials)
    added.push_back({{"id", s.id >= 0 ? s.id : id++},
                     {"content", s.content},
                     {"single_word", false},
                     {"lstrip", false},
                     {"rstrip", false},
                     {"normalized", false},
                     {"special", true}});
  const nlohmann::ordered_json byte_level = {{"type", "ByteLevel"},
                                             {"add_prefix_space", false},
                                             {"trim_offsets", false},
                                             {"use_regex", false}};
  nlohmann::ordered_json tok = {{"version", "1.0"},
                                {"truncation", nullptr},
                                {"padding", nullptr},
                                {"added_tokens", added},
                                {"normalizer", {{"type", "NFC"}}},
                                {"pre_tokenizer",
                                 {{"type", "Sequence"},
                                  {"pretokenizers",
                                   {{{"type", "Split"},
                                     {"pattern", {{"Regex", kQwen2Pattern}}},
                                     {"behavior", "Isolated"},
                                     {"invert", false}},
                                    byte_level}}}},
                                {"post_processor", byte_level},
                                {"decoder", byte_level},
                                {"model",
                                 {{"type", "BPE"},
                                  {"dropout", nullptr},
                                  {"unk_token", nullptr},
                                  {"continuing_subword_prefix", ""},
                                  {"end_of_word_suffix", ""},
                                  {"fuse_unk", false},
                                  {"byte_fallback", false},
                                  {"ignore_merges", false},
                                  {"vocab", vocab},
                                  {"merges", merge_list}}}};
  return tok.dump(2) + "\n";
}

void write_tiny_mplug_owl3(const std::string& dir, const TinyModelSpec& s) {
  const char* w = "tiny model spec: ";
  LVX_CHECK(s.variant == "240728" || s.variant == "241101", w,
            "variant must be \"240728\" or \"241101\", got \"", s.variant, "\"");
  LVX_CHECK(s.hidden > 0 && s.heads > 0 && s.hidden % s.heads == 0, w, "hidden (", s.hidden,
            ") must be a positive multiple of heads (", s.heads, ")");
  LVX_CHECK((s.hidden / s.heads) % 2 == 0, w, "head dimension hidden/heads (", s.hidden / s.heads,
            ") must be even for rotary embeddings");
  LVX_CHECK(s.vision_layers >= 2, w, "vision_layers must be >= 2 (hidden_states[-2] is used), got ",
            s.vision_layers);
  LVX_CHECK(s.image_size % s.patch_size == 0 && s.patch_size > 0, w, "image_size (", s.image_size,
            ") must be a multiple of patch_size (", s.patch_size, ")");
  LVX_CHECK(!s.hyper_layers.empty(), w, "hyper_layers: at least one (1-based) hyper layer");

  const std::string tokenizer = tiny_tokenizer_json(s.words);
  // Ids from lvx's own reader of what we wrote: the file is checked, and the ids are its ids.
  const Tokenizer tok = Tokenizer::from_json_string(tokenizer, dir + "/tokenizer.json");
  const int64_t image_id = *tok.token_to_id("<|image|>");

  nlohmann::json vision = {{"hidden_size", s.vision_hidden},
                           {"image_size", s.image_size},
                           {"intermediate_size", s.vision_mlp},
                           {"model_type", "siglip_vision_model"},
                           {"num_attention_heads", s.vision_heads},
                           {"num_hidden_layers", s.vision_layers},
                           {"patch_size", s.patch_size}};
  nlohmann::json config = {{"architectures", nlohmann::json::array({"mPLUGOwl3Model"})},
                           {"attention_dropout", 0.0},
                           {"bos_token_id", *tok.token_to_id("<|endoftext|>")},
                           {"eos_token_id", *tok.token_to_id("<|im_end|>")},
                           {"hidden_act", "silu"},
                           {"hidden_size", s.hidden},
                           {"hyper_layers", s.hyper_layers},
                           {"initializer_range", 0.02},
                           {"intermediate_size", s.intermediate},
                           {"max_position_embeddings", 32768},
                           {"max_window_layers", s.layers},
                           {"model_type", "mplugowl3"},
                           {"num_attention_heads", s.heads},
                           {"num_hidden_layers", s.layers},
                           {"num_key_value_heads", s.kv_heads},
                           {"rms_norm_eps", s.rms_eps},
                           {"rope_theta", s.rope_theta},
                           {"sliding_window", 32768},
                           {"tie_word_embeddings", false},
                           {"torch_dtype", "float32"},
                           {"use_cache", true},
                           {"use_sliding_window", false},
                           {"vision_config", vision},
                           {"vocab_size", tok.vocab_size()}};
  // The loader's own reading of the config gives the tensor list: what we write is what it reads.
  const MplugOwl3Config cfg = mplug_owl3_config(config, dir + "/config.json",
                                                /*gated=*/s.variant == "240728", image_id);
  const ShapeSpec shapes = mplug_owl3_shapes(cfg);
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(s.seed);
  StateDict tensors;
  for (const auto& [name, shape] : shapes) tensors[name] = init_tensor(name, shape, gen);  // sorted
  save_checkpoint(dir, config, tensors);
  const std::string path = dir + "/tokenizer.json";
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f << tokenizer;
  f.flush();
  LVX_CHECK(f.good(), path, ": cannot write");
}

std::string default_demo_family() { return "mplugowl3"; }

namespace {

void check_tiny_family(const std::string& model_type) {
  LVX_CHECK(model_type == default_demo_family(), "tiny model: no tiny writer for model_type '",
            model_type, "' (one exists for: ", default_demo_family(), ")");
}

}  // namespace

void write_tiny_model(const std::string& model_type, const std::string& dir,
                      const TinyModelSpec& spec) {
  check_tiny_family(model_type);
  write_tiny_mplug_owl3(dir, spec);
}

std::string describe_tiny_model(const std::string& model_type, const TinyModelSpec& s) {
  check_tiny_family(model_type);
  LVX_CHECK(!s.hyper_layers.empty() && s.patch_size > 0, "tiny model spec: hyper_layers must ",
            "not be empty and patch_size > 0");
  const int64_t grid = s.image_size / s.patch_size;
  return str("tiny mPLUG-Owl3 (", s.variant, "), random init: LM hidden ", s.hidden, ", ", s.layers,
             " layers (hyper layer: ", s.hyper_layers[0] - 1, "), ", s.heads, " heads / ",
             s.kv_heads, " K/V heads; SigLIP ", s.image_size, " px, patch ", s.patch_size, " -> ",
             grid * grid, " visual tokens per frame");
}

}  // namespace lvx::models
