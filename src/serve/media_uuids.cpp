// The videos clients named; see media_uuids.h.
#include "src/serve/media_uuids.h"

namespace lvx::serve {

void MediaUuids::remember(const std::string& scope, const std::string& uuid,
                          const std::string& hash) {
  std::lock_guard<std::mutex> lock(mu_);
  const Key key{scope, uuid};
  if (!hashes_.count(key)) order_.push_back(key);
  hashes_[key] = hash;
  while (hashes_.size() > capacity_) {
    hashes_.erase(order_.front());
    order_.pop_front();
  }
}

std::optional<std::string> MediaUuids::find(const std::string& scope,
                                            const std::string& uuid) const {
  std::lock_guard<std::mutex> lock(mu_);
  const auto it = hashes_.find({scope, uuid});
  if (it == hashes_.end()) return std::nullopt;
  return it->second;
}

size_t MediaUuids::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return hashes_.size();
}

}  // namespace lvx::serve
