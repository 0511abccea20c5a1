#include "src/runtime/visual_cache.h"

namespace lvx::runtime {

int64_t VisualEntry::bytes() const {
  int64_t b = 0;
  for (const at::Tensor* t : {&media.features, &indices, &pts})
    if (t->defined()) b += static_cast<int64_t>(t->nbytes());
  for (const std::string& e : events) b += static_cast<int64_t>(e.size());
  if (prefix) {
    b += static_cast<int64_t>(prefix->ids.size() * sizeof(int64_t) + prefix->plan.size());
    for (const auto* list : {&prefix->state.prompt, &prefix->state.visual})
      for (const models::KVShard& s : *list)
        for (const at::Tensor* t : {&s.k, &s.v, &s.visible})
          if (t->defined()) b += static_cast<int64_t>(t->nbytes());
  }
  return b;
}

std::shared_ptr<const VisualEntry> VisualCache::find(const std::string& key) {
  std::lock_guard<std::mutex> lock(mu_);
  const auto it = index_.find(key);
  if (it == index_.end()) {
    ++stats_.misses;
    return nullptr;
  }
  order_.splice(order_.begin(), order_, it->second);
  ++stats_.hits;
  return it->second->second;
}

bool VisualCache::put(const std::string& key, std::shared_ptr<const VisualEntry> entry) {
  std::lock_guard<std::mutex> lock(mu_);
  const int64_t size = entry->bytes();
  if (const auto it = index_.find(key); it != index_.end()) {
    stats_.bytes -= it->second->second->bytes();
    order_.erase(it->second);
    index_.erase(it);
  }
  if (size > capacity_) {
    stats_.entries = static_cast<int64_t>(order_.size());
    return false;
  }
  while (!order_.empty() && stats_.bytes + size > capacity_) {
    stats_.bytes -= order_.back().second->bytes();
    index_.erase(order_.back().first);
    order_.pop_back();
    ++stats_.evictions;
  }
  order_.emplace_front(key, std::move(entry));
  index_[key] = order_.begin();
  stats_.bytes += size;
  stats_.entries = static_cast<int64_t>(order_.size());
  return true;
}

VisualCacheStats VisualCache::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  VisualCacheStats s = stats_;
  s.capacity = capacity_;
  return s;
}

}  // namespace lvx::runtime
