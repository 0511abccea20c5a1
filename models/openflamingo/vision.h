// OpenFlamingo's vision side: open_clip's ViT (its token outputs) and the perceiver resampler,
// each image on its own (the frozen encoder every rank runs over its own images).
#pragma once

#include <ATen/ATen.h>

#include <string>

#include "models/layers.h"
#include "models/openflamingo/model.h"

namespace lvx::models {

// The vision encoder's tensor names' prefix.
inline const std::string kVis = "vision_encoder.";

// open_clip ViT token outputs without the class token: [N, g², W].
at::Tensor clip_tokens(const StateDict& w, const OpenFlamingoConfig& c, const at::Tensor& px);

// Perceiver resampler, each image independently: [N, v, W] → [N, latents, W].
at::Tensor perceiver(const StateDict& w, const OpenFlamingoConfig& c, const at::Tensor& x);

}  // namespace lvx::models
