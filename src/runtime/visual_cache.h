// The visual cache of one rank (lvx serve): this rank's encoded share of a video's frames, kept
// between questions about the same video. For cross-attention models the visual features do not
// depend on the question, so a repeated question decodes and encodes nothing (the prefill takes
// the features through models::ModelInputs::media).
//
// Keys (src/runtime/qa_job.cpp visual_key) name what the features depend on: the content (XXH3 of
// every frame image, or of the video file: hashed again whenever its inode, size, mtime or ctime
// differ from when it was hashed, so a file changed in place never finds the old entry; a
// caller's video_id is never a key, so no client reaches another's features by naming them),
// plus the sampling (fps or frame count, range),
// the preprocessing, the dtype and the rank's place (rank, world size). Least recently used
// entries go first when the entries' bytes would exceed the capacity; an entry larger than the
// whole capacity is not kept. Thread-safe (the server's metrics read the counters).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "models/decode.h"
#include "models/parallel.h"

namespace lvx::runtime {

struct VisualEntry {
  models::LocalMedia media;         // this rank's encoded slots, on the model's device
  int64_t sampled_total = 0;        // frames sampled over all ranks (the prompt's image count)
  at::Tensor indices, pts;          // this rank's frames: int64 index, float64 seconds (host)
  std::vector<std::string> events;  // the decode report's lines (said again on a hit)
  // The prompt prefix's state on this rank after its prefill (runtime/generate.h: the prompt up
  // to its last image token, which no question changes): its K/V shards, self and visual. It
  // applies to a prompt with the same prefix ids run with the same plan.
  struct Prefix {
    std::vector<int64_t> ids;
    std::string plan;
    models::DecodeCache state;
  };
  std::shared_ptr<const Prefix> prefix;
  // Bytes held: the features, the frame metadata and the prefix's state.
  int64_t bytes() const;
};

struct VisualCacheStats {
  int64_t hits = 0, misses = 0, evictions = 0;
  int64_t bytes = 0, entries = 0;
  int64_t capacity = 0;
};

class VisualCache {
 public:
  explicit VisualCache(int64_t capacity_bytes) : capacity_(capacity_bytes) {}
  bool enabled() const { return capacity_ > 0; }
  // The entry of `key` (made the most recently used), or null; counts a hit or a miss.
  std::shared_ptr<const VisualEntry> find(const std::string& key);
  // Keeps `entry` under `key` (replacing one there), then drops least recently used entries
  // until the bytes fit the capacity. Returns false when the entry alone exceeds it (not kept).
  bool put(const std::string& key, std::shared_ptr<const VisualEntry> entry);
  VisualCacheStats stats() const;

 private:
  using Item = std::pair<std::string, std::shared_ptr<const VisualEntry>>;
  mutable std::mutex mu_;
  int64_t capacity_ = 0;
  std::list<Item> order_;  // most recently used first
  std::unordered_map<std::string, std::list<Item>::iterator> index_;
  VisualCacheStats stats_;
};

}  // namespace lvx::runtime
