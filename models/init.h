// Tiny randomly initialised checkpoints to train from scratch (lvx demo fine-tunes one on the
// synthetic task of tools/synthetic_task.h): an mPLUG-Owl3 directory in the released
// Hugging Face layout that load_model() accepts — config.json, model.safetensors (fp32) and a
// tokenizer.json written here, a Qwen2-style byte-level BPE whose merges make each word of a
// given list one token.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "models/family.h"

namespace lvx::models {

struct TinyModelSpec {
  // Language model (Qwen2 decoder).
  int64_t hidden = 64, layers = 2, heads = 4, kv_heads = 2, intermediate = 128;
  // 1-BASED decoder layer indices, as config.json's "hyper_layers" holds them: {1} makes the
  // first layer a hyper layer, so the second can work on what it read from the images.
  std::vector<int64_t> hyper_layers = {1};
  double rope_theta = 1e6, rms_eps = 1e-6;
  // "240728" (gated hyper layers; also 241014) or "241101" (one softmax, no gate).
  std::string variant = "240728";
  // SigLIP vision tower. mPLUG-Owl3 reads hidden_states[-2]: vision_layers - 1 layers run, so
  // vision_layers >= 2 (the last layer is not written: the loader does not need it).
  int64_t image_size = 32, patch_size = 8, vision_hidden = 32, vision_layers = 2, vision_heads = 2,
          vision_mlp = 64;
  // Words that get one token each, both alone and after a space ("red" and " red"): letters only
  // (a word with digits or punctuation is split by the pre-tokenizer before BPE sees it).
  std::vector<std::string> words;
  uint64_t seed = 0;
};

// Writes config.json, model.safetensors and tokenizer.json into `dir` (created if missing;
// existing files of those names are replaced). The same spec gives bit-identical files.
//
// Initialisation, chosen to train quickly from scratch rather than to copy transformers' std
// 0.02 (which, at these widths, shrinks every Linear's output to ~0.16 of its input, so the
// visual signal reaching the logits through projector, v_kv_proj, o_proj and lm_head starts
// ~1e-3 small and so do its gradients):
//   Linear / conv weights   N(0, 1/fan_in): unit-variance activations through every layer
//   token embeddings        N(0, 1): the residual stream starts at the scale the blocks add
//   position embeddings     N(0, 0.02²): small beside the patch content, so each vision token
//                           (the tower stays frozen in fine-tuning) mostly says what it shows
//   biases 0, norm weights 1
//   self_attn.gate          0, as the release initialises it: sigmoid(0) = ½ mixes self- and
//                           cross-attention equally, so both paths get gradient from the start
// Throws lvx::Error naming the field for an invalid spec and the file for an I/O error.
void write_tiny_mplug_owl3(const std::string& dir, const TinyModelSpec& spec);

// The tiny model lvx demo trains, named here only: its family's model_type ("mplugowl3"), what
// write_tiny_model writes.
std::string default_demo_family();
// Writes the tiny model of `model_type` (the families with a tiny writer: default_demo_family())
// into `dir`; another type is an error naming it and the ones that have one.
void write_tiny_model(const std::string& model_type, const std::string& dir,
                      const TinyModelSpec& spec);
// One line for people: what write_tiny_model(model_type, ...) writes for `spec` ("tiny
// mPLUG-Owl3 (240728), random init: LM hidden 64, 2 layers (hyper layer: 0), ...").
std::string describe_tiny_model(const std::string& model_type, const TinyModelSpec& spec);

// The tokenizer.json text of the tokenizer above: Qwen2's normalizer (NFC), pre-tokenizer
// (Split by Qwen2's regex, Isolated; then ByteLevel without regex), ByteLevel post-processor and
// decoder; BPE vocabulary = the 256 byte symbols (ids 0–255 in byte order), then one token per
// merge; merges built word by word so that each word and its space-prefixed form ("Ġword")
// encodes to one token whatever the other words are; then the special tokens <|endoftext|>,
// <|im_start|>, <|im_end|>, <|image|> (ids right after the vocabulary, as in Qwen2).
std::string tiny_tokenizer_json(const std::vector<std::string>& words);
// The same tokenizer with `specials` in place of those four, each at its id or (id −1) at the
// next id after the vocabulary, in order (the caller keeps fixed ids clear of the vocabulary).
std::string byte_level_tokenizer_json(const std::vector<std::string>& words,
                                      const std::vector<SpecialToken>& specials);

}  // namespace lvx::models
