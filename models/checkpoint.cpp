#include "models/checkpoint.h"

#include <filesystem>
#include <fstream>

#include "src/common/error.h"
#include "src/common/safetensors.h"

namespace lvx::models {

namespace fs = std::filesystem;

Checkpoint load_checkpoint(const std::string& dir) {
  LVX_CHECK(fs::is_directory(dir), dir, ": not a directory (expected a checkpoint directory with ",
            "config.json and model.safetensors)");
  const fs::path cfg = fs::path(dir) / "config.json";
  LVX_CHECK(fs::exists(cfg), dir, ": no config.json");
  Checkpoint c;
  c.dir = dir;
  std::ifstream in(cfg);
  try {
    in >> c.config;
  } catch (const nlohmann::json::exception& e) {
    LVX_FAIL(cfg.string(), ": not valid JSON: ", e.what());
  }
  c.tensors = load_checkpoint_dir(dir);
  return c;
}

StateDict select_parameters(const StateDict& all, const ShapeSpec& expected,
                            const std::vector<std::string>& unused_prefixes, at::ScalarType dtype,
                            const std::string& dir) {
  std::vector<std::string> missing, unexpected, misshaped;
  StateDict out;
  for (const auto& [name, shape] : expected) {
    auto it = all.find(name);
    if (it == all.end()) {
      missing.push_back(name);
    } else if (it->second.sizes() != at::IntArrayRef(shape)) {
      misshaped.push_back(
          str(name, " ", it->second.sizes(), " (expected ", at::IntArrayRef(shape), ")"));
    } else {
      out[name] = it->second.to(dtype).contiguous();
    }
  }
  for (const auto& [name, t] : all) {
    if (expected.count(name)) continue;
    bool known = false;
    for (const auto& p : unused_prefixes) known = known || name.rfind(p, 0) == 0;
    if (!known) unexpected.push_back(name);
  }
  if (missing.empty() && unexpected.empty() && misshaped.empty()) return out;
  auto list = [](const std::vector<std::string>& v) {
    std::string s;
    const size_t show = std::min<size_t>(v.size(), 8);
    for (size_t i = 0; i < show; ++i) s += str(i ? ", " : "", v[i]);
    if (v.size() > show) s += str(", … (", v.size() - show, " more)");
    return s;
  };
  std::string msg = str(dir, ": the checkpoint does not match the model");
  if (!missing.empty()) msg += str("; missing ", missing.size(), ": ", list(missing));
  if (!misshaped.empty()) msg += str("; wrong shape ", misshaped.size(), ": ", list(misshaped));
  if (!unexpected.empty()) msg += str("; unexpected ", unexpected.size(), ": ", list(unexpected));
  LVX_FAIL(msg);
}

void save_checkpoint(const std::string& dir, const nlohmann::json& config, const StateDict& tensors,
                     int shards) {
  fs::create_directories(dir);
  {
    std::ofstream f(fs::path(dir) / "config.json");
    f << config.dump(2) << "\n";
    LVX_CHECK(f.good(), dir, ": cannot write config.json");
  }
  if (shards <= 1) {
    save_safetensors((fs::path(dir) / "model.safetensors").string(), tensors, {{"format", "pt"}});
    return;
  }
  std::vector<StateDict> parts(static_cast<size_t>(shards));
  size_t i = 0;
  for (const auto& [name, t] : tensors) parts[i++ % parts.size()][name] = t;
  nlohmann::json index{{"metadata", {{"total_size", 0}}}, {"weight_map", nlohmann::json::object()}};
  int64_t total = 0;
  for (int s = 0; s < shards; ++s) {
    char file[64];
    std::snprintf(file, sizeof(file), "model-%05d-of-%05d.safetensors", s + 1, shards);
    save_safetensors((fs::path(dir) / file).string(), parts[s], {{"format", "pt"}});
    for (const auto& [name, t] : parts[s]) {
      index["weight_map"][name] = file;
      total += t.numel() * static_cast<int64_t>(t.element_size());
    }
  }
  index["metadata"]["total_size"] = total;
  std::ofstream f(fs::path(dir) / "model.safetensors.index.json");
  f << index.dump(2) << "\n";
}

const at::Tensor& param(const StateDict& w, const std::string& name) {
  auto it = w.find(name);
  LVX_CHECK(it != w.end(), "model parameter '", name, "' is missing");
  return it->second;
}

int64_t config_int(const nlohmann::json& c, const std::string& field, const std::string& where) {
  LVX_CHECK(c.contains(field), where, ": ", field, ": missing");
  LVX_CHECK(c[field].is_number_integer(), where, ": ", field, ": expected an integer, got ",
            c[field].dump());
  return c[field].get<int64_t>();
}

double config_double(const nlohmann::json& c, const std::string& field, const std::string& where) {
  LVX_CHECK(c.contains(field), where, ": ", field, ": missing");
  LVX_CHECK(c[field].is_number(), where, ": ", field, ": expected a number, got ", c[field].dump());
  return c[field].get<double>();
}

int64_t config_int_or(const nlohmann::json& c, const std::string& field, int64_t fallback) {
  return c.contains(field) && c[field].is_number_integer() ? c[field].get<int64_t>() : fallback;
}

double config_double_or(const nlohmann::json& c, const std::string& field, double fallback) {
  return c.contains(field) && c[field].is_number() ? c[field].get<double>() : fallback;
}

}  // namespace lvx::models
