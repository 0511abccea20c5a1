// The decode price of one question as lvx qa --print-plan shows it: the planner's per-token price
// (src/planner/decode_price.h) at 1 rank and at the run's ranks, decoded on rank 0 alone and on
// every rank, for the checkpoint's decoder, on the run's cluster config.
#pragma once

#include <cstdint>
#include <string>

#include "models/model.h"
#include "src/runtime/layer_plan.h"

namespace lvx::runtime {

// The lines format_decode prints, or one line saying why there is no price (no cluster config,
// or one without memory bandwidth: lvx calibrate measures it). `frames` images of the model's
// visual tokens each, `text_tokens` prompt tokens, on `world` ranks.
std::string decode_price_text(const std::string& model_dir, const models::Model& model,
                              const PlanRequest& request, int64_t frames, int64_t text_tokens,
                              int world);

}  // namespace lvx::runtime
