#include "models/row_key_pool.h"

#include <ATen/ops/stack.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <utility>

#include "src/common/error.h"

namespace lvx::models {

// ---- RowSlot --------------------------------------------------------------------------------

RowSlot::RowSlot(std::shared_ptr<RowKeyPool> pool, int64_t index)
    : pool_(std::move(pool)), index_(index) {}

RowSlot::RowSlot(const RowSlot& other)
    : pool_(other.pool_), index_(other.pool_ ? other.pool_->copy_of(other.index_) : -1) {}

RowSlot& RowSlot::operator=(const RowSlot& other) {
  if (this != &other) *this = RowSlot(other);
  return *this;
}

RowSlot::RowSlot(RowSlot&& other) noexcept
    : pool_(std::exchange(other.pool_, nullptr)), index_(std::exchange(other.index_, -1)) {}

RowSlot& RowSlot::operator=(RowSlot&& other) noexcept {
  if (this != &other) {
    reset();
    pool_ = std::exchange(other.pool_, nullptr);
    index_ = std::exchange(other.index_, -1);
  }
  return *this;
}

RowSlot::~RowSlot() { reset(); }

void RowSlot::reset() {
  if (pool_) pool_->release(index_);
  pool_ = nullptr;
  index_ = -1;
}

// ---- RowKeyPool -----------------------------------------------------------------------------

RowKeyPool::RowKeyPool(size_t layers)
    : k_(layers), v_(layers), used_(layers), front_(layers), front_of_(layers), stacked_(layers) {}

int64_t RowKeyPool::acquire() {
  std::lock_guard<std::mutex> lock(mu_);
  auto free = std::find(taken_.begin(), taken_.end(), false);
  const auto slot = static_cast<int64_t>(free - taken_.begin());
  if (free == taken_.end()) {
    taken_.push_back(true);
    for (size_t l = 0; l < used_.size(); ++l) {
      used_[l].push_back(0);
      front_[l].push_back(0);
      front_of_[l].emplace_back();
    }
  } else {  // an earlier row's slot: its keys cleared (rows_new_keys reads a slot's padding)
    *free = true;
    for (std::vector<int64_t>& u : used_) u[static_cast<size_t>(slot)] = 0;
    for (std::vector<int64_t>& f : front_) f[static_cast<size_t>(slot)] = 0;
    for (std::vector<at::Tensor>* kv : {&k_, &v_})
      for (at::Tensor& t : *kv)
        if (t.defined()) t[slot].zero_();
  }
  return slot;
}

void RowKeyPool::release(int64_t slot) {
  std::lock_guard<std::mutex> lock(mu_);
  taken_.at(static_cast<size_t>(slot)) = false;
  for (auto& f : front_of_) f[static_cast<size_t>(slot)] = {};  // the prompt's tensors let go
}

int64_t RowKeyPool::copy_of(int64_t slot) {
  const int64_t copy = acquire();
  std::lock_guard<std::mutex> lock(mu_);
  const auto from = static_cast<size_t>(slot), to = static_cast<size_t>(copy);
  for (size_t l = 0; l < k_.size(); ++l) {
    const int64_t n = front_[l][from] + used_[l][from];
    if (n == 0) continue;
    reserve(l, n, k_[l], v_[l]);
    k_[l][copy].narrow(1, 0, n).copy_(k_[l][slot].narrow(1, 0, n));
    v_[l][copy].narrow(1, 0, n).copy_(v_[l][slot].narrow(1, 0, n));
    front_[l][to] = front_[l][from];
    front_of_[l][to] = front_of_[l][from];
    used_[l][to] = used_[l][from];
  }
  return copy;
}

int64_t RowKeyPool::used(size_t layer, int64_t slot) const {
  std::lock_guard<std::mutex> lock(mu_);
  return used_[layer][static_cast<size_t>(slot)];
}

std::pair<int64_t, int64_t> RowKeyPool::capacity(size_t layer) const {
  std::lock_guard<std::mutex> lock(mu_);
  const at::Tensor& k = k_[layer];
  return k.defined() ? std::make_pair(k.size(0), k.size(2))
                     : std::make_pair(int64_t{0}, int64_t{0});
}

void RowKeyPool::reserve(size_t layer, int64_t length, const at::Tensor& k_like,
                         const at::Tensor& v_like) {
  const auto slots = static_cast<int64_t>(taken_.size());
  auto grown = [&](const at::Tensor& old, const at::Tensor& like) {
    const int64_t S = old.defined() ? old.size(0) : 0, C = old.defined() ? old.size(2) : 0;
    if (S >= slots && C >= length) return old;
    // Doubling what is short (a row's next tokens, or the next rows, fit without another
    // copy); what suffices stays as it is.
    const int64_t s2 = S >= slots ? S : std::max(slots, 2 * S);
    const int64_t c2 = C >= length ? C : std::max(length, 2 * C);
    at::Tensor t = at::zeros({s2, like.size(1), c2, like.size(-1)}, like.options());
    if (old.defined()) t.narrow(0, 0, S).narrow(2, 0, C).copy_(old);
    return t;
  };
  k_[layer] = grown(k_[layer], k_like);
  v_[layer] = grown(v_[layer], v_like);
}

void RowKeyPool::append_locked(size_t layer, int64_t slot, const at::Tensor& k,
                               const at::Tensor& v) {
  int64_t& n = used_[layer][static_cast<size_t>(slot)];
  const int64_t T = k.size(0), at = front_[layer][static_cast<size_t>(slot)] + n;
  reserve(layer, at + T, k, v);
  k_[layer][slot].narrow(1, at, T).copy_(k.transpose(0, 1));
  v_[layer][slot].narrow(1, at, T).copy_(v.transpose(0, 1));
  n += T;
}

void RowKeyPool::append(size_t layer, int64_t slot, const at::Tensor& k, const at::Tensor& v) {
  std::lock_guard<std::mutex> lock(mu_);
  append_locked(layer, slot, k, v);
}

void RowKeyPool::append_rows(size_t layer, const std::vector<int64_t>& slots,
                             const std::vector<int64_t>& counts, const at::Tensor& k,
                             const at::Tensor& v) {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<int64_t>& used = used_[layer];
  const std::vector<int64_t>& front = front_[layer];
  int64_t longest = 0;
  for (size_t i = 0; i < slots.size(); ++i) {
    const auto s = static_cast<size_t>(slots[i]);
    longest = std::max(longest, front[s] + used[s] + counts[i]);
  }
  reserve(layer, longest, k, v);
  const int64_t H = k.size(1), C = k_[layer].size(2);
  // Token t of slot s, head h, sits at row (s·H + h)·C + front + used + t of the pool seen as
  // [S·H·C, D].
  std::vector<int64_t> rows;
  for (size_t i = 0; i < slots.size(); ++i) {
    const auto s = static_cast<size_t>(slots[i]);
    int64_t& n = used[s];
    for (int64_t t = 0; t < counts[i]; ++t)
      for (int64_t h = 0; h < H; ++h) rows.push_back((slots[i] * H + h) * C + front[s] + n + t);
    n += counts[i];
  }
  const at::Tensor index = at::tensor(rows, at::kLong).to(k.device());
  k_[layer].view({-1, k.size(2)}).index_copy_(0, index, k.reshape({-1, k.size(2)}));
  v_[layer].view({-1, v.size(2)}).index_copy_(0, index, v.reshape({-1, v.size(2)}));
}

std::pair<at::Tensor, at::Tensor> RowKeyPool::slot_keys(size_t layer, int64_t slot) const {
  std::lock_guard<std::mutex> lock(mu_);
  const int64_t n = used_[layer][static_cast<size_t>(slot)];
  const int64_t f = front_[layer][static_cast<size_t>(slot)];
  auto one = [&](const at::Tensor& t) {
    return t[slot].narrow(1, f, n).transpose(0, 1).unsqueeze(0).contiguous();
  };
  return {one(k_[layer]), one(v_[layer])};
}

std::pair<at::Tensor, at::Tensor> RowKeyPool::layer_keys(size_t layer) const {
  std::lock_guard<std::mutex> lock(mu_);
  LVX_CHECK(k_[layer].defined(), "RowKeyPool: layer ", layer, " holds no keys");
  return {k_[layer], v_[layer]};
}

void RowKeyPool::move_own(size_t layer, int64_t slot, int64_t front) {
  const auto s = static_cast<size_t>(slot);
  const int64_t from = front_[layer][s], n = used_[layer][s];
  if (from == front) return;
  if (n > 0)
    for (at::Tensor* t : {&k_[layer], &v_[layer]})  // overlapping ranges: through a copy
      (*t)[slot].narrow(1, front, n).copy_((*t)[slot].narrow(1, from, n).clone());
  front_[layer][s] = front;
}

void RowKeyPool::set_fronts(size_t layer, const std::vector<int64_t>& slots,
                            const std::vector<std::pair<at::Tensor, at::Tensor>>& fronts) {
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t i = 0; i < slots.size(); ++i) {
    const auto s = static_cast<size_t>(slots[i]);
    auto& held = front_of_[layer][s];
    if (fronts.empty()) {
      if (front_[layer][s] > 0) move_own(layer, slots[i], 0);
      held = {};
      continue;
    }
    const auto& [k, v] = fronts[i];  // [1, P, Hkv, D]
    if (held.first.is_same(k) && held.second.is_same(v)) continue;
    const int64_t P = k.size(1);
    reserve(layer, P + used_[layer][s], k[0], v[0]);
    move_own(layer, slots[i], P);
    k_[layer][slots[i]].narrow(1, 0, P).copy_(k[0].transpose(0, 1));
    v_[layer][slots[i]].narrow(1, 0, P).copy_(v[0].transpose(0, 1));
    held = fronts[i];
  }
}

int64_t RowKeyPool::front(size_t layer, int64_t slot) const {
  std::lock_guard<std::mutex> lock(mu_);
  return front_[layer][static_cast<size_t>(slot)];
}

std::pair<at::Tensor, at::Tensor> RowKeyPool::stacked_keys(
    size_t layer, const std::vector<std::pair<at::Tensor, at::Tensor>>& sources,
    std::vector<int64_t>& places) {
  std::lock_guard<std::mutex> lock(mu_);
  Stacked& s = stacked_[layer];
  auto place = [&s](const std::pair<at::Tensor, at::Tensor>& src) -> int64_t {
    for (size_t i = 0; i < s.sources.size(); ++i)
      if (s.sources[i].first.is_same(src.first) && s.sources[i].second.is_same(src.second))
        return static_cast<int64_t>(i);
    return -1;
  };
  places.clear();
  bool same = sources.size() == s.sources.size();
  for (const auto& src : sources) {
    places.push_back(place(src));
    same = same && places.back() >= 0;
  }
  if (same) return {s.k, s.v};
  std::vector<at::Tensor> ks, vs;
  places.clear();
  for (const auto& [k, v] : sources) {
    places.push_back(static_cast<int64_t>(ks.size()));
    ks.push_back(k[0]);
    vs.push_back(v[0]);
  }
  s = Stacked{sources, at::stack(ks), at::stack(vs)};
  return {s.k, s.v};
}

size_t RowKeyPool::stacked_sources(size_t layer) const {
  std::lock_guard<std::mutex> lock(mu_);
  return stacked_[layer].sources.size();
}

}  // namespace lvx::models
