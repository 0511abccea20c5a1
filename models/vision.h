// Vision encoders: the SigLIP ViT that mPLUG-Owl3 uses (transformers' SiglipVisionModel, its
// key names under a prefix such as "vision_model."), any width, depth, patch and image size from
// the config, so tiny versions run in tests. A ViT turns each frame into visual tokens; it runs on
// the frames of one rank only (frames are sharded, never gathered).
#pragma once

#include <ATen/ATen.h>

#include <nlohmann/json.hpp>
#include <string>

#include "models/checkpoint.h"

namespace lvx::models {

struct SiglipConfig {
  int64_t hidden = 0, layers = 0, heads = 0, mlp = 0, image_size = 0, patch_size = 0, channels = 3;
  double eps = 1e-6;
  std::string act = "gelu_pytorch_tanh";
  int64_t tokens() const { return (image_size / patch_size) * (image_size / patch_size); }
};

// From a `vision_config` object of config.json (transformers' SiglipVisionConfig defaults for
// fields it leaves out). `where` names the file for errors.
SiglipConfig siglip_config(const nlohmann::json& vision_config, const std::string& where);

// Tensors the encoder reads when it runs `run_layers` encoder layers, under `prefix`
// ("vision_model."): embeddings, those layers. (post_layernorm, later layers and the pooling
// head are not needed; callers list them as unused.)
ShapeSpec siglip_shapes(const SiglipConfig& c, const std::string& prefix, int64_t run_layers);

// pixel_values [N, C, H, W] (already normalized) → the hidden states after `run_layers` encoder
// layers, [N, tokens, hidden]. mPLUG-Owl3 uses hidden_states[-2]: run_layers = layers − 1.
at::Tensor siglip_forward(const StateDict& w, const std::string& prefix, const SiglipConfig& c,
                          const at::Tensor& pixel_values, int64_t run_layers);

}  // namespace lvx::models
