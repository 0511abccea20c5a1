// Which strategy each attention layer of a model runs: the planner's choice for one input (its
// prompt, frames and text length) on a cluster config, or the user's explicit choice. Shared by
// lvx forward, lvx qa and lvx finetune.
#pragma once

#include <ATen/ATen.h>

#include <string>

#include "models/model.h"

namespace lvx::runtime {

struct PlanRequest {
  std::string strategies = "auto";  // auto | S | S_cross,S_self (S may be a pair F+B)
  std::string cluster;              // cluster config for auto (empty: the built-in rule)
  std::string dtype = "fp32";       // fp32 | bf16
  bool train = false;               // the backward counts too
};

// The per-layer choice for `input_ids` (int64 [B, L]; sample 0's prompt is planned) on `world`
// ranks, layouts resolved (models::resolve_layouts); pg is left unset. *plan_text gets the
// planner's table (or the rule used).
models::Parallel plan_layers(const models::Model& model, const at::Tensor& input_ids, int world,
                             const PlanRequest& request, std::string* plan_text);

// "S" for every layer or "S_cross,S_self"; errors name the flag.
models::Parallel explicit_strategies(const std::string& spec, int64_t layers);

// One line: the text layout and each layer's self / cross strategy (with `model`, only the
// attentions each decoder layer has: Model::layer_attentions).
std::string describe(const models::Parallel& p, const models::Model* model = nullptr);

}  // namespace lvx::runtime
