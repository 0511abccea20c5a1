#include "src/runtime/finetune_lora.h"

#include "models/lora.h"
#include "src/common/error.h"
#include "src/runtime/train_checkpoint.h"

namespace lvx::runtime {

std::unique_ptr<models::Model> with_lora(std::unique_ptr<models::Model> model,
                                         const TrainConfig& cfg, const std::string& ckpt) {
  if (cfg.lora.r <= 0) return model;
  models::LoraConfig lc;
  lc.r = cfg.lora.r;
  lc.alpha = cfg.lora.alpha;
  lc.dropout = cfg.lora.dropout;
  lc.target_modules = cfg.lora.target_modules;
  models::LoraAdapter ad;
  if (ckpt.empty()) {
    ad = models::init_lora(*model, lc, static_cast<uint64_t>(cfg.data.seed), cfg.model.path);
  } else {
    ad = models::load_lora(ckpt, *model);
    // The run's own settings (the file has them too); the targets must be the configured ones.
    const std::vector<std::string> want = models::lora_targets(*model, lc);
    LVX_CHECK(ad.layers.size() == want.size(), ckpt, ": the adapter holds ", ad.layers.size(),
              " LoRA weights, the run's lora.target_modules select ", want.size());
    for (const auto& name : want)
      LVX_CHECK(ad.layers.count(name), ckpt, ": the adapter has no LoRA pair for ", name);
    ad.config = lc;
    ad.base_model = cfg.model.path;
  }
  return std::make_unique<models::LoraModel>(std::move(model), std::move(ad));
}

std::string save_lora_checkpoint(models::Model& model, const TrainConfig& cfg, int64_t step,
                                 const std::map<std::string, at::Tensor>& optimizer,
                                 const nlohmann::json& state,
                                 const std::vector<std::string>& shard_files,
                                 const std::map<std::string, at::Tensor>* whole) {
  auto* lora = dynamic_cast<models::LoraModel*>(&model);
  LVX_CHECK(lora != nullptr, "save_lora_checkpoint: the model has no LoRA adapter");
  // The adapter as it is now: A and B by name (an engine may have replaced the tensors).
  models::LoraAdapter ad = lora->adapter();
  const std::map<std::string, at::Tensor>& source = whole ? *whole : model.parameters();
  for (auto& [name, l] : ad.layers) {
    l.a = source.at(models::lora_a_name(name));
    l.b = source.at(models::lora_b_name(name));
  }
  return save_train_checkpoint(
      cfg.checkpoint.dir, step,
      {{"adapter_config.json", models::adapter_config_json(ad, lora->base()).dump(2) + "\n"}},
      models::adapter_tensors(ad), optimizer, state, cfg.checkpoint.keep, shard_files,
      "adapter_model.safetensors");
}

}  // namespace lvx::runtime
