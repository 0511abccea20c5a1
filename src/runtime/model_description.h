// One model description for the runtime and the planner: `lvx plan` and `lvx bench-plan` take
// either a planner YAML (configs/models/*.yaml, for models without a checkpoint at hand) or a
// checkpoint directory, whose config.json is turned into the attention layers exactly as the
// runtime runs them (models/*: planner_model), so the two cannot drift apart.
#pragma once

#include <string>

#include "src/planner/model_config.h"
#include "src/planner/train_memory.h"

namespace lvx::runtime {

// `path`: a checkpoint directory with config.json (any supported model_type, models/family.h), or
// a planner YAML file.
planner::ModelConfig planner_model(const std::string& path);

// Parameter counts for the memory plan: a checkpoint directory's exactly (its tensors built on
// the meta device; trainable under `freeze` as lvx finetune decides it; vocab from config.json);
// a YAML's estimated from its shapes (planner::estimate_parameters).
planner::ParamCounts count_parameters(const std::string& path, const planner::ModelConfig& m,
                                      const std::string& freeze);

// What `lvx plan --train` prints before its table: the parameter counts (a note first when the
// model has no vocab_size) and, with LoRA, the adapter's parameters. One text for the command
// and the Python op (lvx.plan), so the two print the same.
std::string describe_parameters(const planner::ParamCounts& counts, const std::string& freeze,
                                const planner::ModelConfig& m, int64_t lora_r);

}  // namespace lvx::runtime
