// A fixed-capacity blocking queue between the decoder thread and the consumer: the producer
// waits when `capacity` items are queued, so decoded frames never pile up in memory (decord #157
// decoded a whole video ahead of a slow consumer). close() ends the stream; cancel() stops both.
#pragma once

#include <condition_variable>
#include <deque>
#include <mutex>
#include <optional>

namespace lvx::video {

template <typename T>
class BoundedQueue {
 public:
  explicit BoundedQueue(size_t capacity) : capacity_(capacity < 1 ? 1 : capacity) {}

  // Blocks while full. Returns false (and drops the item) once cancelled.
  bool push(T item) {
    std::unique_lock<std::mutex> lock(mu_);
    not_full_.wait(lock, [&] { return cancelled_ || items_.size() < capacity_; });
    if (cancelled_) return false;
    items_.push_back(std::move(item));
    not_empty_.notify_one();
    return true;
  }
  // Blocks while empty. Returns nullopt after close() once drained, or after cancel().
  std::optional<T> pop() {
    std::unique_lock<std::mutex> lock(mu_);
    not_empty_.wait(lock, [&] { return cancelled_ || closed_ || !items_.empty(); });
    if (cancelled_ || items_.empty()) return std::nullopt;
    T item = std::move(items_.front());
    items_.pop_front();
    not_full_.notify_one();
    return item;
  }
  void close() {
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = true;
    not_empty_.notify_all();
  }
  void cancel() {
    std::lock_guard<std::mutex> lock(mu_);
    cancelled_ = true;
    not_empty_.notify_all();
    not_full_.notify_all();
  }
  size_t capacity() const { return capacity_; }

 private:
  const size_t capacity_;
  std::mutex mu_;
  std::condition_variable not_full_, not_empty_;
  std::deque<T> items_;
  bool closed_ = false, cancelled_ = false;
};

}  // namespace lvx::video
