// One model description for the runtime and the planner: `lvx plan` and `lvx bench-plan` take
// either a planner YAML (configs/models/*.yaml, for models without a checkpoint at hand) or a
// checkpoint directory, whose config.json is turned into the attention layers exactly as the
// runtime runs them (models/*: planner_model), so the two cannot drift apart.
#pragma once

#include <string>

#include "src/planner/model_yaml.h"
#include "src/planner/train_memory.h"

namespace lvx::runtime {

// `path`: a checkpoint directory with config.json (any supported model_type, models/family.h), or
// a planner YAML file.
planner::ModelConfig planner_model(const std::string& path);

// Refuses a checkpoint directory holding a FIFO, a directory or a device where a weights, config
// or tokenizer file (*.safetensors, *.json, *.bin) should be: reading one would block or fail
// late. Errors name the file.
void check_model_files(const std::string& model_dir);

// The model's context length from its config.json (max_position_embeddings, max_seq_len,
// n_positions or seq_length, at the top level or in text_config); 0 when it names none.
int64_t model_context_length(const std::string& model_dir);

// The checkpoint's weights' dtype (float32 | float16 | bfloat16): the floating dtype holding the
// most bytes of its safetensors files, or config.json's torch_dtype where there are no weight
// files yet (bfloat16 when absent), for resolve_dtype (src/runtime/device.h).
std::string checkpoint_dtype(const std::string& dir);

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
