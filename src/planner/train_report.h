// What `lvx plan --train` (and lvx.plan(train=True)) reports beside the attention plan: the whole
// memory of one rank (train_memory.h) and the data-parallel traffic of one optimizer step
// (train_traffic.h), in text and JSON.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "src/planner/planner.h"
#include "src/planner/train_memory.h"
#include "src/planner/train_traffic.h"

namespace lvx::planner {

// Adds "train_memory", "train_traffic" and "fits" (the plan's and the memory's) to `j`; returns
// the text lines.
std::string train_report(const ModelConfig& m, const ParamCounts& counts, const Plan& plan,
                         int64_t frames, int64_t text_tokens, int64_t tokens_per_frame,
                         const TrainMemoryOptions& mo, const ClusterConfig& cluster,
                         nlohmann::json& j);

}  // namespace lvx::planner
