#include "src/runtime/model_description.h"

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "models/model.h"
#include "src/common/error.h"

namespace lvx::runtime {

planner::ModelConfig planner_model(const std::string& path) {
  namespace fs = std::filesystem;
  if (!fs::is_directory(path)) return planner::load_model_config(path);
  const fs::path cfg = fs::path(path) / "config.json";
  LVX_CHECK(fs::exists(cfg), path, ": no config.json (expected a checkpoint directory or a YAML)");
  nlohmann::json j;
  try {
    std::ifstream(cfg) >> j;
  } catch (const nlohmann::json::exception& e) {
    LVX_FAIL(cfg.string(), ": not valid JSON: ", e.what());
  }
  planner::ModelConfig m = models::planner_model_from_config(j, cfg.string());
  m.name = fs::path(path).filename().string();
  return m;
}

}  // namespace lvx::runtime
