// Release-shaped random checkpoints: what `lvx init-model` writes, so that every job can be run
// and measured at the sizes users run (mPLUG-Owl3-1B/2B/7B, OpenFlamingo-3B/4B/9B,
// Llama-3.2-11B-Vision) without downloading weights.
//
// From a release's config.json (configs/models/releases/*/config.json, or a user's own), the
// family (models/family.h, Family::release_layout) names every tensor the release's files hold,
// with its shape, and the special tokens its template needs. The writer then fills them with
// random values, tensor by tensor and in pieces, into the Hugging Face layout: sharded
// safetensors (model-0000i-of-0000N.safetensors, at most --max-shard-bytes each, as
// save_pretrained's max_shard_size) with model.safetensors.index.json, config.json,
// tokenizer.json (a byte-level BPE over a list of English words plus the specials) and a
// manifest.json of sizes and checksums. Host memory stays one piece (64 Mi elements) whatever
// the model's size, so the 7B (16 GB in bf16) is written on a 24 GiB machine.
//
// Values (transformers' _init_weights with the config's initializer_range σ, default 0.02):
// matrices, embeddings, class/position embeddings and the Perceiver's latents N(0, σ²); norm
// weights 1 and biases 0; the gates that open a cross layer (mPLUG-Owl3's self_attn.gate,
// Llama-3.2-Vision's cross_attn_*_gate and the vision tower's gates, OpenFlamingo's attn_gate /
// ff_gate) U(0.3, 1): a release's gates are open, and a closed one (transformers' 0) would hide
// the cross layers from every comparison. Each piece is drawn from its own generator seeded by
// (seed, tensor name, piece), so the same seed writes the same bytes whatever the sharding.
//
// Writing is atomic per directory: everything goes to DIR.partial-PID first and is renamed to
// DIR at the end; an error or a kill leaves no half-written DIR (an existing DIR is refused
// unless --force, which replaces it only after the new one is complete).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "models/family.h"

namespace lvx::models {

struct ReleaseInitOptions {
  at::ScalarType dtype = at::kBFloat16;  // every tensor's (the releases ship bf16)
  ReleaseResize resize;                  // fewer layers or a smaller vocabulary (0: as released)
  uint64_t seed = 0;
  uint64_t max_shard_bytes = uint64_t{5} << 30;  // save_pretrained's default max_shard_size "5GB"
  bool force = false;                            // replace an existing output directory
  // Called after each tensor is written (name, bytes written so far, total bytes): progress.
  std::function<void(const std::string&, uint64_t, uint64_t)> progress;
};

// What init-model writes for `config` (`where` names it in errors): the config as written (after
// resize, torch_dtype set to the dtype), every tensor's shape, and the specials.
struct ReleasePlan {
  nlohmann::json config;
  ReleaseLayout layout;
  uint64_t bytes = 0;        // of all tensors in the chosen dtype
  int64_t parameters = 0;    // elements of all tensors
};
ReleasePlan plan_release(const nlohmann::json& config, const ReleaseInitOptions& options,
                         const std::string& where);

// Writes the plan's checkpoint into `dir` (see above). Returns the number of shard files.
int write_release_model(const std::string& dir, const ReleasePlan& plan,
                        const ReleaseInitOptions& options);

// The tokenizer.json init-model writes: a Qwen2-style byte-level BPE whose merges make each
// word of `words` one token (models/init.h, tiny_tokenizer_json), with `specials` at their ids
// (−1: the next id after the words); every id below `embedding_rows`. Errors name the token.
std::string release_tokenizer_json(const std::vector<std::string>& words,
                                   const std::vector<SpecialToken>& specials,
                                   int64_t embedding_rows);
// The English words of that tokenizer: enough for the questions the benchmarks and tests ask.
const std::vector<std::string>& release_tokenizer_words();

// For the families' resize_release: the cross layers of a model cut to `layers` decoder layers,
// as the config lists them (`base` 0 or 1): `wanted` (0-based, each below `layers`) when given,
// else the entries of `list` below `layers`. Keeping none is an error naming `where` and the
// smallest layer count that keeps one.
nlohmann::json layers_kept(const nlohmann::json& list, int64_t layers, int64_t base,
                           const std::vector<int64_t>& wanted, const std::string& where);

}  // namespace lvx::models
