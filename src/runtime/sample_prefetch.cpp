// Samples prepared ahead of the step; see sample_prefetch.h.
#include "src/runtime/sample_prefetch.h"

#include <ATen/Parallel.h>
#include <omp.h>

#include <utility>

namespace lvx::runtime {

SamplePrefetch::SamplePrefetch(std::function<LocalSample(int64_t)> make, int64_t first,
                               int64_t stride, int depth, int workers)
    : make_(std::move(make)), next_(first), stride_(stride), taken_(first), depth_(depth) {
  if (depth_ <= 0) return;
  for (int i = 0; i < workers; ++i) workers_.emplace_back([this] { work(); });
}

SamplePrefetch::~SamplePrefetch() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (std::thread& t : workers_) t.join();
}

void SamplePrefetch::work() {
  // One intra-op thread here (OpenMP's count is this thread's own): the step keeps its cores.
  at::internal::lazy_init_num_threads();
  omp_set_num_threads(1);
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    // A sample to start: within `depth` of the one the step takes next.
    cv_.wait(lock, [&] { return stop_ || next_ < taken_ + depth_ * stride_; });
    if (stop_) return;
    const int64_t k = next_;
    next_ += stride_;
    ready_[k] = nullptr;  // in progress
    lock.unlock();
    auto sample = std::make_unique<LocalSample>(make_(k));
    lock.lock();
    ready_[k] = std::move(sample);
    cv_.notify_all();
  }
}

LocalSample SamplePrefetch::take(int64_t k) {
  std::unique_lock<std::mutex> lock(mu_);
  if (workers_.empty() || k != taken_) {  // no workers, or out of order: here and now
    if (k != taken_) {
      // Drop what was prepared for the old order once its workers are done with it.
      cv_.wait(lock, [&] {
        for (const auto& [key, s] : ready_)
          if (!s) return false;
        return true;
      });
      ready_.clear();
      next_ = taken_ = k + stride_;
      cv_.notify_all();
    } else {
      taken_ = next_ = k + stride_;
    }
    lock.unlock();
    return make_(k);
  }
  // In progress, or next for an idle worker (k is within the depth of itself).
  cv_.wait(lock, [&] {
    const auto it = ready_.find(k);
    return it != ready_.end() && it->second != nullptr;
  });
  LocalSample out = std::move(*ready_[k]);
  ready_.erase(k);
  taken_ = k + stride_;
  cv_.notify_all();
  return out;
}

}  // namespace lvx::runtime
