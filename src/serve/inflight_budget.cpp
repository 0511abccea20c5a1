// One budget of request bytes; see inflight_budget.h.
#include "src/serve/inflight_budget.h"

#include <utility>

namespace lvx::serve {

std::optional<InflightBudget::Reservation> InflightBudget::reserve(int64_t bytes) {
  if (bytes <= 0) return Reservation();
  int64_t held = held_.load();
  do {
    if (bytes > limit_ - held) return std::nullopt;
  } while (!held_.compare_exchange_weak(held, held + bytes));
  return Reservation(this, bytes);
}

InflightBudget::Reservation& InflightBudget::Reservation::operator=(Reservation&& o) noexcept {
  if (this != &o) {
    Reservation gone(std::move(*this));  // releases what this held
    budget_ = std::exchange(o.budget_, nullptr);
    bytes_ = o.bytes_;
  }
  return *this;
}

InflightBudget::Reservation::~Reservation() {
  if (budget_ != nullptr) budget_->held_ -= bytes_;
}

}  // namespace lvx::serve
