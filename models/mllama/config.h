// Llama-3.2-Vision (Meta, "The Llama 3 Herd of Models", §7: the image adapter of
// cross-attention layers), transformers' MllamaForConditionalGeneration (model_type "mllama"):
// its configuration as config.json writes it (text_config, vision_config), the tensors a
// checkpoint holds by their on-disk names, Llama 3's RoPE frequencies and the planner's view.
//
//   tiled ViT (local + gated global encoder, MllamaVisionModel) → [final | intermediate layers]
//   → multi_modal_projector Linear → visual tokens [images, tiles·(patches+1), text hidden];
//   Llama decoder whose text_config.cross_attention_layers REPLACE a decoder layer by a gated
//   cross-attention block (no self-attention in it): q/k RMSNorm per head, GQA, no RoPE,
//   h + tanh(cross_attn_attn_gate)·attn, h + tanh(cross_attn_mlp_gate)·mlp.
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "models/checkpoint.h"
#include "src/common/model_config.h"

namespace lvx::models::mllama {

// vision_config (transformers' MllamaVisionConfig; defaults of the release for fields left out).
struct VisionConfig {
  int64_t hidden = 0, layers = 0, global_layers = 0, heads = 0, intermediate = 0, image_size = 0,
          patch_size = 0, max_num_tiles = 0, output_dim = 0;
  double norm_eps = 1e-5;
  std::vector<int64_t> intermediate_layers;           // intermediate_layers_indices, 0-based
  std::vector<std::array<int64_t, 2>> aspect_ratios;  // supported_aspect_ratios; id = index+1
  int64_t patches() const;                            // (image_size / patch_size)^2
  int64_t tokens_per_tile() const;  // patches() + 1 (class token), after stripping the pad-to-8
};

// text_config (transformers' MllamaTextConfig).
struct TextConfig {
  int64_t hidden = 0, layers = 0, heads = 0, kv_heads = 0, head_dim = 0, intermediate = 0,
          vocab = 0;  // vocab: vocab_size; embed_tokens has vocab + 8 rows (the release's padding)
  double rope_theta = 5e5, rms_eps = 1e-5;
  std::string act = "silu";
  // rope_scaling llama3 (factor, low/high freq factor, original max positions); "default": none
  std::string rope_type = "default";
  double rope_factor = 1, low_freq_factor = 1, high_freq_factor = 4;
  int64_t original_max_positions = 8192;
  std::vector<int64_t> cross_layers;  // cross_attention_layers, 0-based decoder layer indices
  bool tie_embeddings = false;
  bool is_cross(int64_t layer) const;
};

struct Config {
  TextConfig text;
  VisionConfig vision;
  int64_t image_token_id = -1;
  int64_t tokens_per_image() const;  // vision.max_num_tiles * vision.tokens_per_tile()
};

// Reads config.json (model_type "mllama"): sizes positive and bounded, heads dividing the
// widths, layer indices in range and distinct, aspect ratios within max_num_tiles. Errors name
// `where` (the file) and the field.
Config config_from_json(const nlohmann::json& config, const std::string& where);

// Every tensor the model reads, by on-disk checkpoint name (the released layout:
// language_model.model.*, language_model.lm_head.weight, vision_model.*,
// multi_modal_projector.*), with its shape. With tie_embeddings, no lm_head.
ShapeSpec shapes(const Config& c);

// RoPE inverse frequencies [head_dim/2] fp32 on o's device: theta^(−2i/head_dim), with the
// llama3 rope_scaling exactly as transformers' _compute_llama3_parameters (long wavelengths
// divided by factor, short kept, smooth interpolation between).
at::Tensor rope_inv_freq(const TextConfig& c, const at::TensorOptions& o);

// The planner's description: decoder layers in execution order, a self layer (causal) for a
// self layer, a cross layer (kMediaImmediate) for a cross layer; the vision tower and the
// visual token count per image (tokens_per_image) and feature width (text hidden: the
// projector's output is what the cross layers read).
ModelConfig planner_model(const Config& c);

}  // namespace lvx::models::mllama
