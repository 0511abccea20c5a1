#include "src/runtime/model_description.h"

#include <filesystem>
#include <nlohmann/json.hpp>

#include "models/model.h"
#include "src/common/error.h"
#include "src/common/files.h"

namespace lvx::runtime {

planner::ModelConfig planner_model(const std::string& path) {
  namespace fs = std::filesystem;
  if (!fs::is_directory(path)) return planner::load_model_config(path);
  const fs::path cfg = fs::path(path) / "config.json";
  LVX_CHECK(fs::exists(cfg), path, ": no config.json (expected a checkpoint directory or a YAML)");
  const nlohmann::json j = read_json_file(cfg.string(), "model config");
  planner::ModelConfig m = models::planner_model_from_config(j, cfg.string());
  m.name = fs::path(path).filename().string();
  return m;
}

}  // namespace lvx::runtime
