// Hugging Face safetensors files: read and write named tensors (the checkpoint and I/O format of
// every lvx command). Format: 8-byte little-endian header length N, N bytes of JSON
// {"name": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, "__metadata__": {..}},
// then the raw little-endian data. Writes are atomic: a temporary file renamed into place, so an
// interrupted write never leaves a partial file under the final name.
#pragma once

#include <ATen/ATen.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

namespace lvx {

struct TensorFile {
  std::map<std::string, at::Tensor> tensors;    // CPU, contiguous
  std::map<std::string, std::string> metadata;  // "__metadata__" (string → string)
};

// A safetensors file mapped into memory (mmap, private and copy-on-write), for loading weights
// without a copy: a tensor of the file's dtype is used in place, so local ranks that load the
// same checkpoint share its pages (the kernel's page cache holds one copy), and a tensor converted
// to another dtype costs only its converted copy. Tensors over the mapping keep it alive.
class MappedSafetensors;
struct SafetensorsHeader;
std::shared_ptr<const MappedSafetensors> map_safetensors(const SafetensorsHeader& header);
// Tensor `name` of a mapped file, in place (CPU, its stored dtype; written pages become this
// process's own). With `populate`, its pages are read in now (MADV_POPULATE_READ), so that a
// load's time is the time to read the files, not the first forward's. A tensor whose offset is
// not a multiple of its element size is copied.
at::Tensor mapped_tensor(const std::shared_ptr<const MappedSafetensors>& file,
                         const std::string& name, bool populate = true);
// Gives back the pages of a mapped tensor that was only read (after converting it): the process
// no longer holds them (they stay in the page cache). Never call it on a tensor written to.
void release_mapped_pages(const at::Tensor& mapped);

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

// Writes one safetensors file tensor by tensor, for files larger than memory (lvx init-model;
// save_safetensors uses it too). The header comes first, from every tensor's name, dtype and
// shape (offsets in the order given); then each tensor's bytes, in that order, in as many
// pieces as the caller likes (write). finish() checks that every byte came, closes and renames
// the file into place; a writer destroyed before finish() removes its temporary file, so an
// interrupted write leaves nothing under `path`.
class SafetensorsWriter {
 public:
  struct Spec {
    std::string name;
    at::ScalarType type;
    std::vector<int64_t> shape;
  };
  SafetensorsWriter(std::string path, std::vector<Spec> tensors,
                    const std::map<std::string, std::string>& metadata = {});
  ~SafetensorsWriter();
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;
  // The next elements of the current tensor: a contiguous CPU tensor of its dtype, at most what
  // remains of it (a piece never spans two tensors).
  void write(const at::Tensor& piece);
  void finish();
  static uint64_t nbytes(const Spec& s);

 private:
  void write_all(const void* data, uint64_t n);
  std::string path_, tmp_;
  std::vector<Spec> specs_;
  size_t current_ = 0;    // the tensor being written
  uint64_t written_ = 0;  // bytes of it so far
  int fd_ = -1;
};

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
