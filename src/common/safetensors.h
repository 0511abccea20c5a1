// Hugging Face safetensors files: read and write named tensors (the checkpoint and I/O format of
// every lvx command). Format: 8-byte little-endian header length N, N bytes of JSON
// {"name": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, "__metadata__": {..}},
// then the raw little-endian data. Writes are atomic: a temporary file renamed into place, so an
// interrupted write never leaves a partial file under the final name.
#pragma once

#include <ATen/ATen.h>

#include <map>
#include <string>
#include <vector>

namespace lvx {

struct TensorFile {
  std::map<std::string, at::Tensor> tensors;            // CPU, contiguous
  std::map<std::string, std::string> metadata;          // "__metadata__" (string → string)
};

// Reads every tensor (or only `names`, when given; a missing name is an error naming the file).
TensorFile load_safetensors(const std::string& path, const std::vector<std::string>& names = {});

// Writes tensors (moved to CPU and made contiguous) with optional metadata, atomically.
void save_safetensors(const std::string& path, const std::map<std::string, at::Tensor>& tensors,
                      const std::map<std::string, std::string>& metadata = {});

// Safetensors dtype code ("F32", "BF16", "I64", ...) ↔ ATen scalar type.
std::string safetensors_dtype(at::ScalarType t);
at::ScalarType scalar_type_from_safetensors(const std::string& code);

// Sharded checkpoints: reads model.safetensors.index.json ("weight_map": name → shard file) in
// `dir` and loads every shard, or model.safetensors when there is no index.
std::map<std::string, at::Tensor> load_checkpoint_dir(const std::string& dir);

}  // namespace lvx
