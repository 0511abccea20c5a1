// Release-shaped random checkpoints (see release_init.h).
#include "models/release_init.h"

#include <ATen/CPUGeneratorImpl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <set>

#include "models/init.h"
#include "models/tokenizer/tokenizer.h"
#include "src/common/error.h"
#include "src/common/safetensors.h"

namespace lvx::models {

namespace fs = std::filesystem;

namespace {

constexpr int64_t kPieceElements = int64_t{64} << 20;  // host memory per piece: 256 MB in fp32

// How a tensor is filled (release_init.h): by its name's last component and its rank.
enum class Fill { kNormal, kOnes, kZeros, kGate };

Fill fill_of(const std::string& name, const std::vector<int64_t>& shape) {
  const std::string leaf = name.substr(name.rfind('.') + 1);
  if (leaf.find("gate") != std::string::npos) return Fill::kGate;  // gate, attn_gate, gate_ffn, …
  if (leaf == "bias" || leaf == "in_proj_bias") return Fill::kZeros;
  if (leaf == "weight" && shape.size() == 1) return Fill::kOnes;  // LayerNorm / RMSNorm scales
  return Fill::kNormal;
}

// One piece's generator: seeded by (seed, name, piece), so a piece's values do not depend on
// what was written before it.
uint64_t piece_seed(uint64_t seed, const std::string& name, int64_t piece) {
  uint64_t h = 1469598103934665603ull ^ seed;  // FNV-1a over the name, then the piece
  for (unsigned char c : name) h = (h ^ c) * 1099511628211ull;
  h = (h ^ static_cast<uint64_t>(piece)) * 1099511628211ull;
  return h ^ (h >> 29);
}

at::Tensor fill_piece(Fill fill, int64_t n, double sigma, at::Generator& gen) {
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  switch (fill) {
    case Fill::kOnes:
      return at::ones({n}, f32);
    case Fill::kZeros:
      return at::zeros({n}, f32);
    case Fill::kGate:
      return at::empty({n}, f32).uniform_(0.3, 1.0, gen);
    case Fill::kNormal:
      break;
  }
  return at::empty({n}, f32).normal_(0.0, sigma, gen);
}

// The tensors of each shard, in name order, none over `max_bytes` unless a single tensor is
// (as save_pretrained shards).
std::vector<std::vector<std::string>> shard_names(const ReleasePlan& plan, uint64_t max_bytes,
                                                  at::ScalarType dtype) {
  std::vector<std::vector<std::string>> shards(1);
  uint64_t in_shard = 0;
  for (const auto& [name, shape] : plan.layout.tensors) {
    const uint64_t n = SafetensorsWriter::nbytes({name, dtype, shape});
    if (in_shard > 0 && in_shard + n > max_bytes) {
      shards.emplace_back();
      in_shard = 0;
    }
    shards.back().push_back(name);
    in_shard += n;
  }
  return shards;
}

void write_text(const fs::path& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f << text;
  f.flush();
  LVX_CHECK(f.good(), path.string(), ": cannot write (disk full?)");
}

std::string shard_file(size_t i, size_t n) {
  char file[64];
  std::snprintf(file, sizeof(file), "model-%05zu-of-%05zu.safetensors", i + 1, n);
  return file;
}

// Writes one shard: each tensor in pieces of at most kPieceElements.
void write_shard(const fs::path& path, const std::vector<std::string>& names,
                 const ReleasePlan& plan, const ReleaseInitOptions& o, double sigma,
                 uint64_t* done) {
  std::vector<SafetensorsWriter::Spec> specs;
  for (const std::string& n : names) specs.push_back({n, o.dtype, plan.layout.tensors.at(n)});
  SafetensorsWriter w(path.string(), specs, {{"format", "pt"}});
  for (const auto& s : specs) {
    int64_t numel = 1;
    for (int64_t d : s.shape) numel *= d;
    const Fill fill = fill_of(s.name, s.shape);
    for (int64_t at = 0, piece = 0; at < numel; at += kPieceElements, ++piece) {
      const int64_t n = std::min(kPieceElements, numel - at);
      at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(piece_seed(o.seed, s.name, piece));
      w.write(fill_piece(fill, n, sigma, gen).to(o.dtype).contiguous());
    }
    *done += SafetensorsWriter::nbytes(s);
    if (o.progress) o.progress(s.name, *done, plan.bytes);
  }
  w.finish();
}

// σ of the normal fills: the config's initializer_range (text_config's for Llama-3.2-Vision),
// transformers' default 0.02 when absent.
double init_sigma(const nlohmann::json& c) {
  for (const nlohmann::json* j : {&c, c.contains("text_config") ? &c["text_config"] : &c})
    if (j->contains("initializer_range") && (*j)["initializer_range"].is_number())
      return (*j)["initializer_range"].get<double>();
  return 0.02;
}

void check_output_dir(const std::string& dir, bool force) {
  LVX_CHECK(!dir.empty(), "init-model: --out is empty");
  LVX_CHECK(!fs::exists(dir) || force, dir,
            ": exists (give --force to replace it once the new checkpoint is complete)");
  LVX_CHECK(!fs::exists(dir) || fs::is_directory(dir), dir, ": exists and is not a directory");
}

}  // namespace

const std::vector<std::string>& release_tokenizer_words() {
  static const std::vector<std::string> words = {
      "the", "a", "an", "is", "are", "was", "were", "what", "which", "who", "where", "when",
      "why", "how", "many", "much", "does", "do", "did", "in", "on", "at", "of", "to", "from",
      "and", "or", "not", "this", "that", "these", "those", "it", "its", "there", "here", "video",
      "image", "frame", "frames", "clip", "scene", "person", "people", "man", "woman", "child",
      "dog", "cat", "car", "ball", "shape", "colour", "color", "red", "green", "blue", "yellow",
      "white", "black", "magenta", "cyan", "grey", "gray", "happening", "happens", "doing",
      "describe", "detail", "first", "last", "next", "before", "after", "during", "end",
      "beginning", "start", "time", "minute", "second", "hour", "long", "short", "left", "right",
      "top", "bottom", "front", "back", "up", "down", "appear", "appears", "appeared", "move",
      "moves", "moving", "walk", "walking", "run", "running", "hold", "holding", "see", "seen",
      "shown", "show", "shows", "count", "number", "one", "two", "three", "four", "five", "yes",
      "no", "answer", "question", "short", "with", "without", "into", "out", "over", "under",
      "by", "for", "as", "be", "has", "have", "had", "can", "could", "would", "should", "will",
      "you", "your", "i", "me", "my", "we", "they", "he", "she", "them", "his", "her", "their",
      "object", "objects", "room", "table", "hand", "hands", "water", "light", "sky", "tree",
      "road", "house", "book", "phone", "screen", "kitchen", "food", "open", "close", "put",
      "take", "picks", "pick", "place", "talk", "talking", "says", "said", "main", "event",
      "events", "summary", "summarize", "action", "actions", "camera", "view", "background",
      "foreground", "most", "more", "less", "same", "different", "again", "only", "all", "some",
      "any", "other", "another", "each", "every", "both", "then", "than", "while", "because",
      "so", "if", "about", "around", "near", "far", "inside", "outside", "between", "along"};
  return words;
}

std::string release_tokenizer_json(const std::vector<std::string>& words,
                                   const std::vector<SpecialToken>& specials,
                                   int64_t embedding_rows) {
  // The words' vocabulary first (specials at −1 follow it), to know which ids it takes.
  const Tokenizer plain = Tokenizer::from_json_string(byte_level_tokenizer_json(words, {}),
                                                      "init-model tokenizer");
  const int64_t vocab = plain.vocab_size();
  std::set<int64_t> fixed;
  for (const SpecialToken& s : specials)
    if (s.id >= 0) {
      LVX_CHECK(s.id >= vocab, "init-model: special token ", s.content, " at id ", s.id,
                " falls inside the tokenizer's ", vocab, " word ids");
      LVX_CHECK(fixed.insert(s.id).second, "init-model: two special tokens at id ", s.id);
    }
  std::vector<SpecialToken> placed;
  int64_t next = vocab;
  for (SpecialToken s : specials) {
    if (s.id < 0) {
      while (fixed.count(next)) ++next;
      s.id = next++;
    }
    LVX_CHECK(s.id < embedding_rows, "init-model: special token ", s.content, " needs id ", s.id,
              " but the model has ", embedding_rows, " embedding rows (a larger --vocab?)");
    placed.push_back(s);
  }
  return byte_level_tokenizer_json(words, placed);
}

nlohmann::json layers_kept(const nlohmann::json& list, int64_t layers, int64_t base,
                           const std::vector<int64_t>& wanted, const std::string& where) {
  nlohmann::json kept = nlohmann::json::array();
  if (!wanted.empty()) {
    for (int64_t i : wanted) {
      LVX_CHECK(i >= 0 && i < layers, where, ": --cross-layers ", i, " is not a layer of the ",
                layers, " kept (0-based)");
      kept.push_back(i + base);
    }
    return kept;
  }
  LVX_CHECK(list.is_array(), where, ": expected a list of layer indices");
  int64_t smallest = -1;
  for (const auto& v : list) {
    LVX_CHECK(v.is_number_integer(), where, ": expected layer indices, got ", v.dump());
    const int64_t i = v.get<int64_t>() - base;  // 0-based
    if (i < layers) kept.push_back(v);
    if (smallest < 0 || i < smallest) smallest = i;
  }
  LVX_CHECK(!kept.empty(), where, ": no cross layer below layer ", layers,
            " (the first is layer ", smallest, ", 0-based): give --layers ", smallest + 1,
            " or more, or --cross-layers");
  return kept;
}

ReleasePlan plan_release(const nlohmann::json& config, const ReleaseInitOptions& o,
                         const std::string& where) {
  LVX_CHECK(o.dtype == at::kBFloat16 || o.dtype == at::kFloat || o.dtype == at::kHalf,
            "init-model: dtype must be bf16, fp16 or fp32");
  const Family& family = family_of_config(config, where);
  ReleasePlan p;
  const ReleaseResize& r = o.resize;
  LVX_CHECK(r.cross_layers.empty() || r.layers > 0, where,
            ": --cross-layers needs --layers (the depth they are placed in)");
  p.config = (r.layers || r.vision_layers || r.vocab)
                 ? family.resize_release(config, r, where)
                 : config;
  p.config["torch_dtype"] = o.dtype == at::kBFloat16 ? "bfloat16"
                            : o.dtype == at::kHalf   ? "float16"
                                                     : "float32";
  p.layout = family.release_layout(p.config, where);
  for (const auto& [name, shape] : p.layout.tensors) {
    p.bytes += SafetensorsWriter::nbytes({name, o.dtype, shape});
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    p.parameters += n;
  }
  return p;
}

int write_release_model(const std::string& dir, const ReleasePlan& plan,
                        const ReleaseInitOptions& o) {
  check_output_dir(dir, o.force);
  const std::string tokenizer = release_tokenizer_json(
      release_tokenizer_words(), plan.layout.specials, plan.layout.embedding_rows);
  const fs::path tmp = dir + ".partial-" + std::to_string(::getpid());
  fs::remove_all(tmp);
  fs::create_directories(tmp);
  try {
    const auto shards = shard_names(plan, o.max_shard_bytes, o.dtype);
    const double sigma = init_sigma(plan.config);
    nlohmann::json index{{"metadata", {{"total_size", plan.bytes}}},
                         {"weight_map", nlohmann::json::object()}};
    uint64_t done = 0;
    for (size_t i = 0; i < shards.size(); ++i) {
      const std::string file = shards.size() == 1 ? "model.safetensors" : shard_file(i, shards.size());
      write_shard(tmp / file, shards[i], plan, o, sigma, &done);
      for (const std::string& n : shards[i]) index["weight_map"][n] = file;
    }
    if (shards.size() > 1) write_text(tmp / "model.safetensors.index.json", index.dump(2) + "\n");
    write_text(tmp / "config.json", plan.config.dump(2) + "\n");
    write_text(tmp / "tokenizer.json", tokenizer);
    if (fs::exists(dir)) fs::remove_all(dir);
    fs::rename(tmp, dir);
    return static_cast<int>(shards.size());
  } catch (...) {
    std::error_code ec;
    fs::remove_all(tmp, ec);
    throw;
  }
}

}  // namespace lvx::models
