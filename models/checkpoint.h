// Checkpoints in the Hugging Face layout: config.json beside model.safetensors, or beside a
// sharded model.safetensors.index.json and its shards; tensors in bf16, fp16 or fp32. Parameters
// keep the checkpoint's own names (the released models' state-dict keys), so a user's real
// directory loads as downloaded and a missing tensor is named exactly.
#pragma once

#include <ATen/ATen.h>

#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "src/common/safetensors.h"

namespace lvx::models {

// Parameters by checkpoint name.
using StateDict = std::map<std::string, at::Tensor>;
// What a model expects: checkpoint name → shape.
using ShapeSpec = std::map<std::string, std::vector<int64_t>>;

struct Checkpoint {
  std::string dir;
  nlohmann::json config;  // config.json
  StateDict tensors;      // every tensor of the checkpoint, CPU, in its stored dtype
};

// Verifies manifest.json when the directory has one (every file's size and checksum), then reads
// config.json (a checked JSON object) and every tensor. Errors name the directory and the file.
Checkpoint load_checkpoint(const std::string& dir);

// The same directory with every tensor as a `meta` tensor of its stored shape and dtype (no data
// read; each file's header fully validated once), and where each tensor is: `files` maps a
// tensor name to its file's validated header. For loading straight onto a device:
// load_model builds the model on meta (every name, shape and dtype checked as usual), then reads
// the parameters one at a time (read_tensor) onto the device.
struct CheckpointIndex {
  Checkpoint meta;
  std::map<std::string, std::shared_ptr<const SafetensorsHeader>> files;
  // Each file mapped (map_checkpoint_files; nothing read until a tensor is), by its path.
  std::map<std::string, std::shared_ptr<const MappedSafetensors>> mapped;
};
CheckpointIndex load_checkpoint_index(const std::string& dir);
// Maps the index's files (map_safetensors), once the load is known to fit: a private writable
// mapping larger than the machine's memory is refused by the kernel itself.
void map_checkpoint_files(CheckpointIndex& index);
// One tensor of a checkpoint from its file (host memory: that tensor only).
at::Tensor read_tensor(const CheckpointIndex& index, const std::string& name);
// The same tensor in place in the mapped file (src/common/safetensors.h, mapped_tensor): no copy,
// its pages shared with every process that maps the file.
at::Tensor map_tensor(const CheckpointIndex& index, const std::string& name);
// A parameter as a model holds it, from the mapped file: in place when `dtype` is the stored one
// and `device` the CPU, else converted (the mapped pages given back once read). Host memory holds
// the converted tensor only, never a second copy of the weights.
at::Tensor load_parameter(const CheckpointIndex& index, const std::string& name,
                          at::ScalarType dtype, at::Device device);

// The parameters a model needs, converted to `dtype` on `device` (one tensor at a time): every
// tensor of `expected` must be present with its shape, and every other tensor must start with one
// of `unused_prefixes` (tensors of the release that the model does not use, e.g. SigLIP's pooling
// head). One lvx::Error lists every missing, unexpected, mis-shaped and non-floating-point tensor
// (an integer tensor is not a weight), naming `dir`.
StateDict select_parameters(const StateDict& all, const ShapeSpec& expected,
                            const std::vector<std::string>& unused_prefixes, at::ScalarType dtype,
                            const std::string& dir, at::Device device = at::kCPU);

// Writes `tensors` in the layout above (config.json, model.safetensors; or `shards` > 1 files
// model-0000i-of-0000N.safetensors and model.safetensors.index.json). For tests and converters.
void save_checkpoint(const std::string& dir, const nlohmann::json& config, const StateDict& tensors,
                     int shards = 1);

// A parameter by name; an error naming it when absent.
const at::Tensor& param(const StateDict& w, const std::string& name);

// config.json fields with errors naming the file and the field.
int64_t config_int(const nlohmann::json& c, const std::string& field, const std::string& where);
double config_double(const nlohmann::json& c, const std::string& field, const std::string& where);
int64_t config_int_or(const nlohmann::json& c, const std::string& field, int64_t fallback);
// Checked variants: an integer in [lo, hi] (required, or `fallback` when the field is absent or
// null); a finite positive number (eps, rope θ); a string. Errors name the file, the field, the
// expected range and the value.
int64_t config_int_in(const nlohmann::json& c, const std::string& field, const std::string& where,
                      int64_t lo, int64_t hi);
int64_t config_int_in_or(const nlohmann::json& c, const std::string& field,
                         const std::string& where, int64_t lo, int64_t hi, int64_t fallback);
double config_positive_or(const nlohmann::json& c, const std::string& field,
                          const std::string& where, double fallback);
std::string config_string_or(const nlohmann::json& c, const std::string& field,
                             const std::string& where, const std::string& fallback);

// Sane bounds on config.json sizes, checked before anything is sized from them (the tensors'
// shapes bound them further: a checkpoint must hold every tensor the sizes imply). Generous
// beside every released model (Qwen2-72B: 80 layers, width 8192, vocab 152k; ViTs ≤ 1k pixels).
constexpr int64_t kMaxConfigLayers = 1024;
constexpr int64_t kMaxConfigWidth = int64_t{1} << 17;  // hidden, intermediate, head_dim
constexpr int64_t kMaxConfigHeads = 4096;
constexpr int64_t kMaxConfigVocab = int64_t{1} << 24;
constexpr int64_t kMaxConfigImage = 8192;  // pixels per side
double config_double_or(const nlohmann::json& c, const std::string& field, double fallback);

}  // namespace lvx::models
