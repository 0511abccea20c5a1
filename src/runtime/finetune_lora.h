// LoRA in `lvx finetune` (models/lora.h): the run's `lora:` section turns the model into a
// models::LoraModel whose only trainable parameters are the adapter's A and B, and checkpoints
// into PEFT adapter directories (adapter_config.json, adapter_model.safetensors) beside the
// optimizer state and trainer_state.json, loadable by `lvx qa --adapter` and
// peft.PeftModel.from_pretrained. The base weights stay where model.path says.
#pragma once

#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "models/model.h"
#include "src/runtime/train_config.h"

namespace lvx::runtime {

// `model` as it trains under cfg.lora: unchanged without LoRA (r 0); else wrapped with a fresh
// adapter (PEFT's initialisation drawn from data.seed) or, resuming, checkpoint `ckpt`'s adapter.
std::unique_ptr<models::Model> with_lora(std::unique_ptr<models::Model> model,
                                         const TrainConfig& cfg, const std::string& ckpt);

// The checkpoint of a LoRA run (`model` from with_lora): the adapter in PEFT's layout, with the
// optimizer state and trainer state as save_train_checkpoint writes them (with parallel.shard,
// the ranks' optimizer shard files already written, `shard_files`). A and B come from `whole`
// when given (stage 3: gathered), else from the model's parameters. Returns its path.
std::string save_lora_checkpoint(models::Model& model, const TrainConfig& cfg, int64_t step,
                                 const std::map<std::string, at::Tensor>& optimizer,
                                 const nlohmann::json& state,
                                 const std::vector<std::string>& shard_files = {},
                                 const std::map<std::string, at::Tensor>* whole = nullptr);

}  // namespace lvx::runtime
