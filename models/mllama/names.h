// Llama-3.2-Vision's names and rotary tables that its files share (model.cpp: the forward and
// the media; decode.cpp: generation).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>

#include "models/layers.h"

namespace lvx::models::mllama {

inline const std::string kLm = "language_model.model.";
inline const std::string kVision = "vision_model.";
inline const std::string kName = "Llama-3.2-Vision";

inline std::string layer_prefix(int64_t i) { return kLm + "layers." + std::to_string(i) + "."; }

// Llama's rotary tables at `positions` (int64 [S]; or [B, S], rows at their own positions) from
// the llama3-scaled inverse frequencies: [1, S, D] (or [B, S, D]).
inline RotaryTables llama_rotary(const at::Tensor& positions, const at::Tensor& inv_freq) {
  const at::Tensor angles = positions.to(at::kFloat).unsqueeze(-1) * inv_freq;  // [.., S, D/2]
  at::Tensor both = at::cat({angles, angles}, -1);
  if (positions.dim() == 1) both = both.unsqueeze(0);
  return {both.cos(), both.sin()};
}

}  // namespace lvx::models::mllama
