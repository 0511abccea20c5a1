// Model configs (configs/models/*.yaml): the description of a model (src/common/model_config.h)
// read from YAML. Loading is strict: a missing or unknown field is an lvx::Error naming the file
// and the field path. Field reference: docs/planner.md. The description's names are the planner's
// too (planner::ModelConfig, ...).
#pragma once

#include <string>

#include "src/common/model_config.h"

namespace lvx::planner {

using lvx::AttentionLayerConfig;
using lvx::dtype_bytes;
using lvx::LayerKind;
using lvx::mask_rule_from_string;
using lvx::MaskRule;
using lvx::ModelConfig;
using lvx::to_string;
using lvx::VisionEncoderConfig;

// Reads and validates a model config. Errors name the file and field path.
ModelConfig load_model_config(const std::string& path);

}  // namespace lvx::planner
