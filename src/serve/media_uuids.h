// The videos clients named with vLLM's per-part `uuid` (rank 0): each name, within the API key
// that sent it, stands for the content hash of the video it came with, so a later request under
// the same key may leave the video out and name it. Another key never sees the name (a client
// cannot reach another's video by guessing its uuid), and a name stands for content, never for a
// cache entry: what answers is the visual cache's entry for that content and frame settings, and
// without one the request is refused with a message saying to send the video again.
#pragma once

#include <cstddef>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <utility>

namespace lvx::serve {

class MediaUuids {
 public:
  // At most `capacity` names are kept; the oldest remembered goes first.
  explicit MediaUuids(size_t capacity = 65536) : capacity_(capacity) {}
  // `uuid` under `scope` (the API key's place in the server's list; "" without keys) now names
  // the video whose content hash is `hash` (a name sent again with other bytes moves to them).
  void remember(const std::string& scope, const std::string& uuid, const std::string& hash);
  std::optional<std::string> find(const std::string& scope, const std::string& uuid) const;
  size_t size() const;

 private:
  using Key = std::pair<std::string, std::string>;
  size_t capacity_;
  mutable std::mutex mu_;
  std::map<Key, std::string> hashes_;
  std::deque<Key> order_;  // first remembered first
};

}  // namespace lvx::serve
