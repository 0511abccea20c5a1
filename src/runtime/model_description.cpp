#include "src/runtime/model_description.h"

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "models/mplug_owl3.h"
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
  const std::string type = j.value("model_type", std::string());
  if (type == "mplugowl3") {
    // The planner needs shapes only: both releases run a cross layer beside each hyper layer.
    planner::ModelConfig m = models::MplugOwl3::planner_model(
        models::mplug_owl3_config(j, cfg.string(), /*gated=*/true, /*image_token_id=*/0));
    m.name = fs::path(path).filename().string();
    m.dtype = j.value("torch_dtype", std::string("bfloat16")) == "float32" ? "fp32" : "bf16";
    return m;
  }
  LVX_FAIL(cfg.string(), ": model_type '", type, "' is not supported (supported: mplugowl3)");
}

}  // namespace lvx::runtime
