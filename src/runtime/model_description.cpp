#include "src/runtime/model_description.h"

#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>

#include "models/model.h"
#include "src/common/error.h"
#include "src/common/files.h"
#include "src/common/safetensors.h"
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

bool has_weight_files(const std::string& dir);

std::string checkpoint_dtype(const std::string& dir) {
  if (fs::is_directory(dir) && has_weight_files(dir)) {
    // The weights' own dtype (config.json's torch_dtype may be absent, or named dtype by newer
    // transformers): the floating dtype that holds the most bytes, from the files' headers.
    std::map<at::ScalarType, uint64_t> bytes;
    for (const auto& [path, names] : checkpoint_shards(dir))
      for (const auto& e : read_safetensors_header(path).entries)
        if (at::isFloatingType(e.type)) bytes[e.type] += e.end - e.begin;
    at::ScalarType best = at::kBFloat16;
    uint64_t most = 0;
    for (const auto& [t, n] : bytes)
      if (n > most) best = t, most = n;
    if (most > 0)
      return best == at::kFloat ? "float32" : best == at::kHalf ? "float16" : "bfloat16";
  }
  const std::string d = planner_model(dir).dtype;
  return d == "fp32" ? "float32" : d == "fp16" ? "float16" : "bfloat16";
}

// Whether `dir` holds weights (any *.safetensors file), rather than config.json alone or with
// its index (model.safetensors.index.json names files that are not downloaded yet).
bool has_weight_files(const std::string& dir) {
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string f = e.path().filename().string();
    if (f.size() > 12 && f.compare(f.size() - 12, 12, ".safetensors") == 0) return true;
  }
  return false;
}

namespace {

// Counts of a model's parameters (built on meta), trainable as `lvx finetune` decides.
planner::ParamCounts counts_of(const models::Model& model, models::StateDict& params,
                               const std::string& freeze, const nlohmann::json& config) {
  planner::ParamCounts p;
  p.exact = true;
  std::map<int64_t, int64_t> blocks, whole;  // decoder layer → trainable / all parameters
  for (const auto& [name, t] : params) {
    p.total += t.numel();
    if (const int64_t l = model.decoder_layer_of(name); l >= 0) {
      whole[l] += t.numel();
      p.layers += t.numel();
    }
    if (!models::trains_under(freeze, model, name)) continue;
    p.trainable += t.numel();
    const int64_t layer = model.decoder_layer_of(name);
    if (layer >= 0)
      blocks[layer] += t.numel();
    else
      p.root += t.numel();
  }
  for (const auto& [b, k] : blocks) p.max_block = std::max(p.max_block, k);
  for (const auto& [b, k] : whole) p.max_layer = std::max(p.max_layer, k);
  for (const nlohmann::json* j : {&config, config.is_object() && config.contains("text_config")
                                               ? &config["text_config"]
                                               : nullptr})
    if (j && j->is_object() && j->contains("vocab_size") && (*j)["vocab_size"].is_number_integer())
      p.vocab = (*j)["vocab_size"].get<int64_t>();
  return p;
}

}  // namespace

planner::ParamCounts count_parameters(const std::string& path, const planner::ModelConfig& m,
                                      const std::string& freeze) {
  if (!fs::is_directory(path)) {
    if (m.config_json.empty()) return planner::estimate_parameters(m, m.vocab_size, freeze);
    // A YAML that names its release's config.json: exact, from the family's shapes.
    const nlohmann::json c = read_json_file(m.config_json, "model config", uint64_t{16} << 20);
    const auto model =
        models::model_from_config(c, m.config_json, fs::path(m.config_json).parent_path());
    return counts_of(*model, model->parameters(), freeze, c);
  }
  // Sized from the weight files' headers when they are there, else from config.json alone.
  const auto model = has_weight_files(path)
                         ? models::load_model(path, at::kFloat, at::Device(at::kMeta))
                         : models::load_model_shapes(path);
  return counts_of(*model, model->parameters(), freeze,
                   read_json_file(path + "/config.json", "model config"));
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
