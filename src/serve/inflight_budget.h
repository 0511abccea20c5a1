// One budget of request bytes over everything the server holds at once (--max-inflight-bytes):
// a request reserves its declared body size from its headers, before a byte of the body is read,
// and holds it until its answer is sent and its generation is gone (the body, the parsed media,
// the copy broadcast to the ranks all live that long). A request that does not fit is refused at
// once, 429 (413 when it could never fit), so many large uploads at once meet a refusal instead of
// the kernel's out-of-memory killer; memory stays within a few times the budget
// (docs/serve.md, "Bounded memory", measures the factor).
#pragma once

#include <atomic>
#include <cstdint>
#include <optional>

namespace lvx::serve {

class InflightBudget {
 public:
  explicit InflightBudget(int64_t limit) : limit_(limit) {}

  // Bytes held while it lives; moves, never copies.
  class Reservation {
   public:
    Reservation() = default;
    Reservation(Reservation&& o) noexcept : budget_(o.budget_), bytes_(o.bytes_) {
      o.budget_ = nullptr;
    }
    Reservation& operator=(Reservation&& o) noexcept;
    Reservation(const Reservation&) = delete;
    Reservation& operator=(const Reservation&) = delete;
    ~Reservation();
    int64_t bytes() const { return budget_ ? bytes_ : 0; }

   private:
    friend class InflightBudget;
    Reservation(InflightBudget* b, int64_t n) : budget_(b), bytes_(n) {}
    InflightBudget* budget_ = nullptr;
    int64_t bytes_ = 0;
  };

  // `bytes` more when they fit under the limit, else nothing (no partial reservation).
  std::optional<Reservation> reserve(int64_t bytes);
  int64_t held() const { return held_.load(); }
  int64_t limit() const { return limit_; }

 private:
  int64_t limit_;
  std::atomic<int64_t> held_{0};
};

}  // namespace lvx::serve
