#include "src/runtime/model_description.h"

#include <filesystem>
#include <nlohmann/json.hpp>

#include "models/model.h"
#include "src/common/error.h"
#include "src/common/files.h"
#include "src/runtime/finetune_job.h"

namespace lvx::runtime {

namespace fs = std::filesystem;
using nlohmann::json;

planner::ModelConfig planner_model(const std::string& path) {
  if (!fs::is_directory(path)) return planner::load_model_config(path);
  const fs::path cfg = fs::path(path) / "config.json";
  LVX_CHECK(fs::exists(cfg), path, ": no config.json (expected a checkpoint directory or a YAML)");
  const nlohmann::json j = read_json_file(cfg.string(), "model config");
  planner::ModelConfig m = models::planner_model_from_config(j, cfg.string());
  m.name = fs::path(path).filename().string();
  return m;
}

void check_model_files(const std::string& model_dir) {
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(model_dir, ec)) {
    const std::string ext = e.path().extension().string();
    if (ext == ".safetensors" || ext == ".json" || ext == ".bin")
      check_regular_file(e.path().string(), "model file");
  }
}

int64_t model_context_length(const std::string& model_dir) {
  const json c =
      read_json_file((fs::path(model_dir) / "config.json").string(), "model config", 64 << 20);
  int64_t best = 0;
  auto scan = [&](const json& o) {
    if (!o.is_object()) return;
    for (const char* k : {"max_position_embeddings", "max_seq_len", "n_positions", "seq_length"})
      if (o.contains(k) && o[k].is_number_integer() && o[k].get<int64_t>() > 0) {
        best = best ? std::min(best, o[k].get<int64_t>()) : o[k].get<int64_t>();
        return;
      }
  };
  scan(c);
  if (best == 0 && c.is_object() && c.contains("text_config")) scan(c["text_config"]);
  return best;
}

std::string checkpoint_dtype(const std::string& dir) {
  const std::string d = planner_model(dir).dtype;
  return d == "fp32" ? "float32" : d == "fp16" ? "float16" : "bfloat16";
}

planner::ParamCounts count_parameters(const std::string& path, const planner::ModelConfig& m,
                                      const std::string& freeze) {
  if (!fs::is_directory(path)) return planner::estimate_parameters(m, m.vocab_size, freeze);
  const auto model = models::load_model(path, at::kFloat, at::Device(at::kMeta));
  planner::ParamCounts p;
  p.exact = true;
  std::map<int64_t, int64_t> blocks, whole;  // decoder layer → trainable / all parameters
  for (const auto& [name, t] : model->parameters()) {
    p.total += t.numel();
    if (const int64_t l = model->decoder_layer_of(name); l >= 0) {
      whole[l] += t.numel();
      p.layers += t.numel();
    }
    if (!models::trains_under(freeze, *model, name)) continue;
    p.trainable += t.numel();
    const int64_t layer = model->decoder_layer_of(name);
    if (layer >= 0)
      blocks[layer] += t.numel();
    else
      p.root += t.numel();
  }
  for (const auto& [b, k] : blocks) p.max_block = std::max(p.max_block, k);
  for (const auto& [b, k] : whole) p.max_layer = std::max(p.max_layer, k);
  const nlohmann::json c = read_json_file(path + "/config.json", "model config");
  for (const nlohmann::json* j :
       {&c, c.is_object() && c.contains("text_config") ? &c["text_config"] : nullptr})
    if (j && j->is_object() && j->contains("vocab_size") && (*j)["vocab_size"].is_number_integer())
      p.vocab = (*j)["vocab_size"].get<int64_t>();
  return p;
}

std::string describe_parameters(const planner::ParamCounts& counts, const std::string& freeze,
                                const planner::ModelConfig& m, int64_t lora_r) {
  std::string s;
  if (counts.vocab == 0)
    s += "note: the model has no vocab_size: the logits' memory is not counted\n";
  s += str("parameters: ", counts.total, " (", counts.trainable, " train under freeze ", freeze,
           counts.exact ? ", counted" : ", estimated", ")");
  if (lora_r > 0)
    s += str("; LoRA r=", lora_r, ": ", planner::lora_parameters(m, lora_r),
             " adapter parameters train");
  return s + "\n";
}

}  // namespace lvx::runtime
