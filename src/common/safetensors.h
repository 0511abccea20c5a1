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
  std::map<std::string, at::Tensor> tensors;    // CPU, contiguous
  std::map<std::string, std::string> metadata;  // "__metadata__" (string → string)
};

// Reads every tensor (or only `names`, when given; a missing name is an error naming the file).
// The whole header is validated before anything is allocated (read_safetensors_header).
TensorFile load_safetensors(const std::string& path, const std::vector<std::string>& names = {});

// A file's header, validated as a whole: known dtypes, shapes whose byte size cannot overflow and
// equals each span, unique names, offsets sorted, non-overlapping and covering the data exactly.
struct SafetensorsHeader {
  struct Entry {
    std::string name;
    at::ScalarType type;
    std::vector<int64_t> shape;
    uint64_t begin = 0, end = 0;  // byte offsets in the data section
  };
  std::string path;
  uint64_t data_begin = 0;                      // file offset of the data section
  std::vector<Entry> entries;                   // in header order
  std::map<std::string, std::string> metadata;  // "__metadata__"
};
SafetensorsHeader read_safetensors_header(const std::string& path);
// One tensor of a file whose header was read: its bytes only (CPU, contiguous).
at::Tensor read_safetensors_tensor(const SafetensorsHeader& header, const std::string& name);

// Writes tensors (moved to CPU and made contiguous) with optional metadata, atomically.
void save_safetensors(const std::string& path, const std::map<std::string, at::Tensor>& tensors,
                      const std::map<std::string, std::string>& metadata = {});

// Safetensors dtype code ("F32", "BF16", "I64", ...) ↔ ATen scalar type.
std::string safetensors_dtype(at::ScalarType t);
at::ScalarType scalar_type_from_safetensors(const std::string& code);

// The weight files of a checkpoint directory: shard path → the tensor names the index assigns
// to it (model.safetensors.index.json's "weight_map"; shard names must stay inside `dir`), or
// model.safetensors → {} (every tensor) when there is no index.
std::map<std::string, std::vector<std::string>> checkpoint_shards(const std::string& dir);
// Every tensor of checkpoint_shards(dir).
std::map<std::string, at::Tensor> load_checkpoint_dir(const std::string& dir);

}  // namespace lvx
