#include "models/checkpoint.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <set>

#include "src/common/error.h"
#include "src/common/files.h"
#include "src/common/safetensors.h"

namespace lvx::models {

namespace fs = std::filesystem;

namespace {

// What every load of a checkpoint directory starts with: the directory, its manifest when it has
// one (lvx's checkpoints: verified whoever loads it — lvx forward, lvx qa, a fine-tuning run's
// model.path — so one flipped bit is an error naming the file instead of a wrong answer), and
// config.json as a checked JSON object.
Checkpoint read_checkpoint_config(const std::string& dir) {
  LVX_CHECK(fs::is_directory(dir), dir, ": not a directory (expected a checkpoint directory with ",
            "config.json and model.safetensors)");
  verify_manifest(dir);
  const fs::path cfg = fs::path(dir) / "config.json";
  LVX_CHECK(fs::exists(cfg), dir, ": no config.json");
  Checkpoint c;
  c.dir = dir;
  c.config = read_json_file(cfg.string(), "model config", uint64_t{16} << 20);
  LVX_CHECK(c.config.is_object(), cfg.string(), ": expected a JSON object, got ",
            c.config.type_name());
  return c;
}

}  // namespace

Checkpoint load_checkpoint(const std::string& dir) {
  Checkpoint c = read_checkpoint_config(dir);
  c.tensors = load_checkpoint_dir(dir);
  return c;
}

CheckpointIndex load_checkpoint_index(const std::string& dir) {
  CheckpointIndex c;
  c.meta = read_checkpoint_config(dir);
  for (const auto& [path, names] : checkpoint_shards(dir)) {
    // Each file's whole header validated once, as a full load would.
    auto header = std::make_shared<const SafetensorsHeader>(read_safetensors_header(path));
    const std::set<std::string> assigned(names.begin(), names.end());
    for (const auto& e : header->entries) {
      if (!assigned.empty() && !assigned.count(e.name))
        continue;  // not this shard's, per the index
      c.meta.tensors[e.name] =
          at::empty(e.shape, at::TensorOptions().dtype(e.type).device(at::kMeta));
      c.files[e.name] = header;
    }
  }
  return c;
}

void map_checkpoint_files(CheckpointIndex& index) {
  for (const auto& [name, header] : index.files)
    if (!index.mapped.count(header->path)) index.mapped[header->path] = map_safetensors(*header);
}

at::Tensor map_tensor(const CheckpointIndex& index, const std::string& name) {
  const auto it = index.files.find(name);
  LVX_CHECK(it != index.files.end(), index.meta.dir, ": has no tensor '", name, "'");
  const auto file = index.mapped.find(it->second->path);
  LVX_CHECK(file != index.mapped.end(), it->second->path, ": not mapped (map_checkpoint_files)");
  return mapped_tensor(file->second, name);
}

at::Tensor load_parameter(const CheckpointIndex& index, const std::string& name,
                          at::ScalarType dtype, at::Device device) {
  const at::Tensor mapped = map_tensor(index, name);
  if (device.is_cpu() && mapped.scalar_type() == dtype) return mapped;
  at::Tensor out = mapped.to(device, dtype).contiguous();
  release_mapped_pages(mapped);
  return out;
}

at::Tensor read_tensor(const CheckpointIndex& index, const std::string& name) {
  const auto it = index.files.find(name);
  LVX_CHECK(it != index.files.end(), index.meta.dir, ": has no tensor '", name, "'");
  return read_safetensors_tensor(*it->second, name);
}

StateDict select_parameters(const StateDict& all, const ShapeSpec& expected,
                            const std::vector<std::string>& unused_prefixes, at::ScalarType dtype,
                            const std::string& dir, at::Device device) {
  std::vector<std::string> missing, unexpected, misshaped, mistyped;
  StateDict out;
  for (const auto& [name, shape] : expected) {
    auto it = all.find(name);
    if (it == all.end()) {
      missing.push_back(name);
    } else if (!at::isFloatingType(it->second.scalar_type())) {
      // Integer or boolean tensors are not weights: converting them would run with garbage.
      mistyped.push_back(str(name, " ", it->second.scalar_type()));
    } else if (it->second.sizes() != at::IntArrayRef(shape)) {
      misshaped.push_back(
          str(name, " ", it->second.sizes(), " (expected ", at::IntArrayRef(shape), ")"));
    } else {
      out[name] = it->second.to(device, dtype).contiguous();
    }
  }
  for (const auto& [name, t] : all) {
    if (expected.count(name)) continue;
    bool known = false;
    for (const auto& p : unused_prefixes) known = known || name.rfind(p, 0) == 0;
    if (!known) unexpected.push_back(name);
  }
  if (missing.empty() && unexpected.empty() && misshaped.empty() && mistyped.empty()) return out;
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
  if (!mistyped.empty())
    msg += str("; not floating-point (weights must be F32, F16 or BF16) ", mistyped.size(), ": ",
               list(mistyped));
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

int64_t config_int_in(const nlohmann::json& c, const std::string& field, const std::string& where,
                      int64_t lo, int64_t hi) {
  const int64_t v = config_int(c, field, where);
  LVX_CHECK(v >= lo && v <= hi, where, ": ", field, ": expected an integer in [", lo, ", ", hi,
            "], got ", v);
  return v;
}

int64_t config_int_in_or(const nlohmann::json& c, const std::string& field,
                         const std::string& where, int64_t lo, int64_t hi, int64_t fallback) {
  if (!c.contains(field) || c[field].is_null()) return fallback;
  return config_int_in(c, field, where, lo, hi);
}

double config_positive_or(const nlohmann::json& c, const std::string& field,
                          const std::string& where, double fallback) {
  if (!c.contains(field) || c[field].is_null()) return fallback;
  const double v = config_double(c, field, where);
  LVX_CHECK(std::isfinite(v) && v > 0, where, ": ", field, ": expected a positive number, got ",
            c[field].dump());
  return v;
}

std::string config_string_or(const nlohmann::json& c, const std::string& field,
                             const std::string& where, const std::string& fallback) {
  if (!c.contains(field) || c[field].is_null()) return fallback;
  LVX_CHECK(c[field].is_string(), where, ": ", field, ": expected a string, got ", c[field].dump());
  return c[field].get<std::string>();
}

int64_t config_int_or(const nlohmann::json& c, const std::string& field, int64_t fallback) {
  return c.contains(field) && c[field].is_number_integer() ? c[field].get<int64_t>() : fallback;
}

double config_double_or(const nlohmann::json& c, const std::string& field, double fallback) {
  return c.contains(field) && c[field].is_number() ? c[field].get<double>() : fallback;
}

}  // namespace lvx::models
