#include "models/checkpoint.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>

#include "src/common/error.h"
#include "src/common/files.h"
#include "src/common/safetensors.h"

namespace lvx::models {

namespace fs = std::filesystem;

Checkpoint load_checkpoint(const std::string& dir) {
  LVX_CHECK(fs::is_directory(dir), dir, ": not a directory (expected a checkpoint directory with ",
            "config.json and model.safetensors)");
  // A checkpoint lvx wrote carries manifest.json (size and checksum of every file): verified
  // whoever loads it (lvx forward, lvx qa, a fine-tuning run's model.path), so one flipped bit
  // is an error naming the file instead of a wrong answer.
  verify_manifest(dir);
  const fs::path cfg = fs::path(dir) / "config.json";
  LVX_CHECK(fs::exists(cfg), dir, ": no config.json");
  Checkpoint c;
  c.dir = dir;
  c.config = read_json_file(cfg.string(), "model config", uint64_t{16} << 20);
  LVX_CHECK(c.config.is_object(), cfg.string(), ": expected a JSON object, got ",
            c.config.type_name());
  c.tensors = load_checkpoint_dir(dir);
  return c;
}

namespace {

// A safetensors header's tensors as meta tensors (the file's full validation is
// load_safetensors', which read_tensor runs on every read).
StateDict header_tensors(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  LVX_CHECK(f.good(), path, ": cannot open");
  unsigned char len[8] = {};
  f.read(reinterpret_cast<char*>(len), 8);
  LVX_CHECK(f.gcount() == 8, path, ": not a safetensors file (shorter than 8 bytes)");
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | len[i];
  LVX_CHECK(n <= (uint64_t{100} << 20), path, ": header length ", n, " is implausible");
  std::string header(n, '\0');
  f.read(header.data(), static_cast<std::streamsize>(n));
  LVX_CHECK(static_cast<uint64_t>(f.gcount()) == n, path, ": short read of its header");
  const nlohmann::json j = nlohmann::json::parse(header, nullptr, /*allow_exceptions=*/false);
  LVX_CHECK(j.is_object(), path, ": header is not a JSON object (not a safetensors file)");
  StateDict out;
  for (const auto& [name, e] : j.items()) {
    if (name == "__metadata__") continue;
    LVX_CHECK(e.is_object() && e.contains("dtype") && e["dtype"].is_string() &&
                  e.contains("shape") && e["shape"].is_array(),
              path, ": tensor '", name, "': expected dtype and shape");
    std::vector<int64_t> shape;
    for (const auto& d : e["shape"]) {
      LVX_CHECK(d.is_number_unsigned(), path, ": tensor '", name, "': bad shape ",
                e["shape"].dump());
      shape.push_back(d.get<int64_t>());
    }
    out[name] = at::empty(
        shape,
        at::TensorOptions().dtype(scalar_type_from_safetensors(e["dtype"])).device(at::kMeta));
  }
  return out;
}

}  // namespace

CheckpointIndex load_checkpoint_index(const std::string& dir) {
  LVX_CHECK(fs::is_directory(dir), dir, ": not a directory (expected a checkpoint directory with ",
            "config.json and model.safetensors)");
  verify_manifest(dir);
  const fs::path cfg = fs::path(dir) / "config.json";
  LVX_CHECK(fs::exists(cfg), dir, ": no config.json");
  CheckpointIndex c;
  c.meta.dir = dir;
  c.meta.config = read_json_file(cfg.string(), "model config", uint64_t{16} << 20);
  LVX_CHECK(c.meta.config.is_object(), cfg.string(), ": expected a JSON object, got ",
            c.meta.config.type_name());
  const fs::path index = fs::path(dir) / "model.safetensors.index.json";
  std::vector<std::string> files;
  if (!fs::exists(index)) {
    LVX_CHECK(fs::exists(fs::path(dir) / "model.safetensors"), dir,
              ": no model.safetensors or model.safetensors.index.json");
    files.push_back("model.safetensors");
  } else {
    const nlohmann::json j = read_json_file(index.string(), "checkpoint index");
    LVX_CHECK(j.is_object() && j.contains("weight_map") && j["weight_map"].is_object(),
              index.string(), ": weight_map: missing or not an object (tensor name -> shard file)");
    for (const auto& [name, file] : j["weight_map"].items()) {
      LVX_CHECK(file.is_string(), index.string(), ": weight_map: '", name,
                "' must name a shard file, got ", file.dump());
      check_name_inside(file.get<std::string>(), index.string());
      if (std::find(files.begin(), files.end(), file.get<std::string>()) == files.end())
        files.push_back(file.get<std::string>());
    }
  }
  for (const std::string& file : files) {
    const std::string path = (fs::path(dir) / file).string();
    const StateDict t = header_tensors(path);
    // The whole header validated once, as a full load would, with its first tensor read.
    if (!t.empty()) load_safetensors(path, {t.begin()->first});
    for (const auto& [name, meta] : t) {
      c.meta.tensors[name] = meta;
      c.files[name] = path;
    }
  }
  return c;
}

at::Tensor read_tensor(const CheckpointIndex& index, const std::string& name) {
  const auto it = index.files.find(name);
  LVX_CHECK(it != index.files.end(), index.meta.dir, ": has no tensor '", name, "'");
  return load_safetensors(it->second, {name}).tensors.at(name);
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
