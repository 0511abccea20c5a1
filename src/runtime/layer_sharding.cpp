#include "src/runtime/layer_sharding.h"

#include <ATen/core/grad_mode.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/strides.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <set>
#include <utility>

#include "src/common/error.h"

namespace lvx::runtime {

namespace {

// The buffer's memory goes back to its allocator (CPU: the OS for large blocks; CUDA: the caching
// allocator); every tensor over the storage keeps its shape and sees the memory again once
// allocate_storage refills it (FSDP's _free_storage / _alloc_storage).
void free_storage(const at::Tensor& t) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  s->set_data_ptr_noswap(at::DataPtr(nullptr, s->device()));
  s->set_nbytes(0);
}

void allocate_storage(const at::Tensor& t, size_t nbytes) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  LVX_CHECK(s->allocator() != nullptr,
            "parallel.shard parameters: a unit's storage has no "
            "allocator");
  s->set_data_ptr_noswap(s->allocator()->allocate(nbytes));
  s->set_nbytes(nbytes);
}

// A tensor of `like`'s shape over `buffer`'s storage from element `offset` on (a leaf of its
// own, not a view: writing the buffer never bumps its version).
at::Tensor over_buffer(const at::Tensor& buffer, int64_t offset, const at::Tensor& like) {
  const std::vector<int64_t> sizes = like.sizes().vec();
  at::Tensor p = at::empty({0}, buffer.options());
  p.set_(buffer.storage(), offset, sizes, c10::contiguous_strides(sizes));
  return p;
}

class UnitGradHook final : public torch::autograd::PostAccumulateGradHook {
 public:
  UnitGradHook(LayerSharding* engine, size_t unit) : engine_(engine), unit_(unit) {}
  void operator()(const torch::autograd::Variable&) override { engine_->accumulated(unit_); }

 private:
  LayerSharding* engine_;
  size_t unit_;
};

}  // namespace

LayerSharding::LayerSharding(const std::shared_ptr<dist::ProcessGroup>& world, models::Model& model,
                             const FlatLayout& layout, const ShardedAdamW& opt,
                             const at::Device& device, bool shard_parameters,
                             const FrozenReader& read_frozen)
    : shard_parameters_(shard_parameters),
      device_(device),
      gather_pg_(dist::ProcessGroup::subgroup(world, 0, world->world_size(), "zero-gather")),
      reduce_pg_(dist::ProcessGroup::subgroup(world, 0, world->world_size(), "zero-reduce")),
      model_(model),
      opt_(opt),
      psi_(layout.numel()),
      layers_(model.decoder_layers()) {
  LVX_CHECK(layout.numel() > 0, "parallel.shard parameters: no parameter trains");
  units_.resize(static_cast<size_t>(layers_) + 1);
  models::StateDict& params = model.parameters();
  const at::ScalarType dtype = params.at(layout.names.front()).scalar_type();
  for (size_t i = 0; i < layout.names.size(); ++i) {
    const std::string& name = layout.names[i];
    const int64_t l = model.decoder_layer_of(name);
    LVX_CHECK(l < layers_, "parallel.shard parameters: '", name, "' names layer ", l, " of ",
              layers_);
    Unit& u = units_[l < 0 ? static_cast<size_t>(layers_) : static_cast<size_t>(l)];
    const at::Tensor& p = params.at(name);
    LVX_CHECK(p.scalar_type() == dtype, "parallel.shard parameters: '", name, "' is ",
              p.scalar_type(), ", the other trainable parameters ", dtype);
    const int64_t b = layout.offsets[i], e = layout.offsets[i + 1];
    if (!u.ranges.empty() && u.ranges.back().end == b)
      u.ranges.back().end = e;
    else
      u.ranges.push_back({b, e, u.numel});
    u.names.push_back(name);
    u.global.push_back(b);
    u.local.push_back(u.numel);
    u.numel += e - b;
  }
  if (shard_parameters_) {
    std::set<std::string> trains(layout.names.begin(), layout.names.end());
    for (const auto& [name, t] : params) {
      const int64_t l = model.decoder_layer_of(name);
      if (trains.count(name) || l < 0 || l >= layers_) continue;
      Unit& u = units_[static_cast<size_t>(l)];
      u.frozen_names.push_back(name);
      u.frozen_local.push_back(u.frozen_numel);
      u.frozen_numel += t.numel();
    }
    for (Unit& u : units_)
      if (u.frozen_numel > 0) shard_frozen(u, read_frozen);
  }
  const auto options = at::TensorOptions().dtype(dtype).device(device);
  grad_options_ = options;
  for (size_t k = 0; k < units_.size(); ++k) {
    Unit& u = units_[k];
    if (u.numel == 0) continue;
    if (shard_parameters_) {
      u.buffer = at::empty({u.numel}, options);
      for (size_t j = 0; j < u.names.size(); ++j) {
        at::Tensor& slot = params.at(u.names[j]);
        slot = over_buffer(u.buffer, u.local[j], slot);  // the whole (or meta) one is released
        slot.set_requires_grad(true);
      }
      free_storage(u.buffer);
    }
    for (const std::string& name : u.names)
      torch::autograd::impl::set_post_acc_grad_hooks(params.at(name),
                                                     std::make_unique<UnitGradHook>(this, k));
  }
  for (int64_t l = layers_ - 1; l >= 0; --l) order_.push_back(static_cast<size_t>(l));
  order_.push_back(static_cast<size_t>(layers_));
}

LayerSharding::~LayerSharding() {
  // Tasks still queued (a failed sample) finish or fail by the process groups' timeout.
  for (auto& f : reductions_)
    if (f.valid()) f.wait();
  for (Unit& u : units_)
    if (u.ready.valid()) u.ready.wait();
  models::StateDict& params = model_.parameters();
  for (const Unit& u : units_)
    for (const std::string& name : u.names) {
      auto it = params.find(name);
      if (it != params.end()) torch::autograd::impl::set_post_acc_grad_hooks(it->second, nullptr);
    }
}

void LayerSharding::shard_frozen(Unit& u, const FrozenReader& read) {
  models::StateDict& params = model_.parameters();
  const at::Tensor& first = params.at(u.frozen_names.front());
  const auto options = at::TensorOptions().dtype(first.scalar_type()).device(device_);
  const int n = gather_pg_->world_size();
  const auto [b, e] = dist::shard_range(u.frozen_numel, n, gather_pg_->rank());
  u.frozen_shard = at::empty({e - b}, options);
  at::AutoGradMode no_grad(false);
  for (size_t j = 0; j < u.frozen_names.size(); ++j) {
    const std::string& name = u.frozen_names[j];
    at::Tensor& slot = params.at(name);
    LVX_CHECK(slot.scalar_type() == first.scalar_type(), "parallel.shard parameters: frozen '",
              name, "' is ", slot.scalar_type(), ", the layer's other frozen parameters ",
              first.scalar_type());
    const int64_t lo = std::max(b, u.frozen_local[j]);
    const int64_t hi = std::min(e, u.frozen_local[j] + slot.numel());
    if (hi > lo) {  // this rank's piece of the tensor: read whole (one at a time), cut
      LVX_CHECK(!slot.is_meta() || read, "parallel.shard parameters: '", name,
                "' was not read and no reader was given");
      const at::Tensor whole = slot.is_meta() ? read(name) : slot;
      u.frozen_shard.narrow(0, lo - b, hi - lo)
          .copy_(whole.reshape({-1}).narrow(0, lo - u.frozen_local[j], hi - lo));
    }
  }
  u.frozen_buffer = at::empty({u.frozen_numel}, options);
  for (size_t j = 0; j < u.frozen_names.size(); ++j) {
    at::Tensor& slot = params.at(u.frozen_names[j]);
    slot = over_buffer(u.frozen_buffer, u.frozen_local[j], slot);  // the whole (or meta) one goes
  }
  free_storage(u.frozen_buffer);
}

at::Tensor LayerSharding::gather_frozen(const Unit& u) const {
  const int n = gather_pg_->world_size();
  std::vector<int64_t> sizes;
  for (int q = 0; q < n; ++q) {
    const auto [b, e] = dist::shard_range(u.frozen_numel, n, q);
    sizes.push_back(e - b);
  }
  return gather_pg_->all_gather(u.frozen_shard, sizes);
}

void LayerSharding::request(size_t k) {
  Unit& u = units_[k];
  if (u.gathered) return;
  u.gathered = true;
  if ((u.numel == 0 && u.frozen_numel == 0) || !shard_parameters_) return;
  u.ready = gatherer_.post([this, &u] {
    const c10::DeviceGuard on(device_);  // the device's allocator and streams on this thread
    at::AutoGradMode no_grad(false);
    if (u.numel > 0) {
      allocate_storage(u.buffer, static_cast<size_t>(u.numel) * u.buffer.element_size());
      for (const Range& r : u.ranges)
        u.buffer.narrow(0, r.local, r.end - r.begin).copy_(gather_run(r));
    }
    if (u.frozen_numel > 0) {
      allocate_storage(u.frozen_buffer,
                       static_cast<size_t>(u.frozen_numel) * u.frozen_buffer.element_size());
      u.frozen_buffer.copy_(gather_frozen(u));
    }
  });
}

void LayerSharding::wait_ready(size_t k) {
  Unit& u = units_[k];
  if (u.ready.valid()) u.ready.get();
}

void LayerSharding::gather(size_t k) {
  request(k);
  wait_ready(k);
}

at::Tensor LayerSharding::gather_run(const Range& r) const {
  const int n = gather_pg_->world_size();
  std::vector<int64_t> sizes(static_cast<size_t>(n));
  int64_t mine_b = 0, mine_e = 0;
  for (int q = 0; q < n; ++q) {
    const auto [b, e] = dist::shard_range(psi_, n, q);
    const int64_t lo = std::clamp(b, r.begin, r.end), hi = std::clamp(e, r.begin, r.end);
    sizes[static_cast<size_t>(q)] = hi - lo;
    if (q == gather_pg_->rank()) mine_b = lo, mine_e = hi;
  }
  // This rank's piece of the run (empty where its shard lies elsewhere), in the parameters' dtype.
  const at::Tensor mine =
      opt_.master()
          .narrow(0, mine_e > mine_b ? mine_b - opt_.begin() : 0, mine_e - mine_b)
          .to(grad_options_.dtype());
  return gather_pg_->all_gather(mine, sizes);
}

void LayerSharding::refresh_parameters() {
  LVX_CHECK(!shard_parameters_, "refresh_parameters: stage 3 gathers per layer");
  at::AutoGradMode no_grad(false);
  models::StateDict& params = model_.parameters();
  for (const Unit& u : units_) {
    size_t j = 0;
    for (const Range& r : u.ranges) {
      const at::Tensor run = gather_run(r);  // one run at a time
      for (; j < u.names.size() && u.global[j] < r.end; ++j) {
        at::Tensor p = params.at(u.names[j]).detach();
        p.copy_(run.narrow(0, u.global[j] - r.begin, p.numel()).view(p.sizes()));
      }
    }
  }
}

void LayerSharding::release(size_t k) {
  Unit& u = units_[k];
  if (!u.gathered) return;
  wait_ready(k);
  u.ready = std::shared_future<void>();
  u.gathered = false;
  if (u.numel > 0 && shard_parameters_) free_storage(u.buffer);
  if (u.frozen_numel > 0) free_storage(u.frozen_buffer);
}

void LayerSharding::free_trainable(size_t k) {
  Unit& u = units_[k];
  wait_ready(k);
  if (u.numel > 0 && shard_parameters_) free_storage(u.buffer);
}

void LayerSharding::begin_sample(at::Tensor shard) {
  LVX_CHECK(shard.numel() == opt_.end() - opt_.begin(), "parallel.shard parameters: gradient ",
            "shard has ", shard.numel(), " elements, this rank owns ", opt_.end() - opt_.begin());
  shard_ = std::move(shard);
  next_post_ = 0;
  next_backward_ = layers_ - 1;
  for (Unit& u : units_) u.prepared = u.completed = false;
  // The root unit runs first (embeddings) and last (head): gathered for the whole sample, its
  // gradient buffer ready from the start.
  prepare(static_cast<size_t>(layers_));
}

void LayerSharding::prepare(size_t k) {
  Unit& u = units_[k];
  gather(k);
  u.prepared = true;
  if (u.numel == 0) {
    complete(k);
    return;
  }
  u.grad = at::zeros({u.numel}, grad_options_);
  models::StateDict& params = model_.parameters();
  for (size_t j = 0; j < u.names.size(); ++j) {
    at::Tensor& p = params.at(u.names[j]);
    p.mutable_grad() = u.grad.narrow(0, u.local[j], p.numel()).view(p.sizes());
  }
  u.pending = u.names.size();
}

void LayerSharding::enter_layer(int64_t layer, const at::Tensor& hidden) {
  if (layer > 0) release(static_cast<size_t>(layer - 1));
  request(static_cast<size_t>(layer));
  if (layer + 1 < layers_) request(static_cast<size_t>(layer + 1));  // prefetch
  wait_ready(static_cast<size_t>(layer));
  if (layer > 0 && hidden.requires_grad())
    hidden.register_hook([this, layer](const at::Tensor&) { reach_backward(layer - 1); });
}

void LayerSharding::leave_layers(const at::Tensor& hidden) {
  // The last layer stays gathered: its backward comes first.
  if (hidden.requires_grad())
    hidden.register_hook([this](const at::Tensor&) { reach_backward(layers_ - 1); });
}

void LayerSharding::reach_backward(int64_t layer) {
  // The backward has passed every layer above `layer`: their frozen parameters can go.
  for (int64_t l = layer + 1; l < layers_; ++l)
    if (units_[static_cast<size_t>(l)].frozen_numel > 0 && units_[static_cast<size_t>(l)].completed)
      release(static_cast<size_t>(l));
  for (; next_backward_ >= layer && next_backward_ >= 0; --next_backward_)
    prepare(static_cast<size_t>(next_backward_));
  if (next_backward_ >= 0) request(static_cast<size_t>(next_backward_));  // prefetch
}

void LayerSharding::accumulated(size_t k) {
  Unit& u = units_[k];
  if (!u.prepared || u.completed || u.pending == 0) return;
  if (--u.pending == 0) complete(k);
}

void LayerSharding::complete(size_t k) {
  Unit& u = units_[k];
  u.completed = true;
  models::StateDict& params = model_.parameters();
  for (const std::string& name : u.names) params.at(name).mutable_grad() = at::Tensor();
  // A unit with frozen parameters stays gathered until the backward has passed its layer
  // (reach_backward); only its trainable buffer goes now.
  if (k != static_cast<size_t>(layers_)) {
    if (u.frozen_numel > 0)
      free_trainable(k);
    else
      release(k);
  }
  post_ready();
}

void LayerSharding::post_ready() {
  while (next_post_ < order_.size() && units_[order_[next_post_]].completed) {
    Unit& u = units_[order_[next_post_++]];
    if (u.numel == 0) continue;
    at::Tensor g = std::move(u.grad);  // every unit is prepared before it completes
    u.grad = at::Tensor();
    reductions_.push_back(reducer_.post([this, &u, g]() mutable {
      const c10::DeviceGuard on(device_);
      at::AutoGradMode no_grad(false);
      at::Tensor g32 = g.to(at::kFloat);
      g = at::Tensor();
      for (const Range& r : u.ranges) {
        at::Tensor part = g32.narrow(0, r.local, r.end - r.begin);
        reduce_into_shard(*reduce_pg_, psi_, r.begin, part, shard_, opt_.begin());
      }
    }));
  }
}

void LayerSharding::end_sample() {
  // Layers the backward never reached are gathered too, so every rank runs the same gathers.
  reach_backward(0);
  for (size_t k : order_)
    if (!units_[k].completed) complete(k);
  std::vector<std::shared_future<void>> done = std::move(reductions_);
  reductions_.clear();
  for (auto& f : done) f.get();  // rethrows a reduction's error
  for (size_t k = 0; k < units_.size(); ++k) release(k);
  shard_ = at::Tensor();
}

void LayerSharding::begin_forward_only() { gather(static_cast<size_t>(layers_)); }

void LayerSharding::end_forward_only() {
  for (size_t k = 0; k < units_.size(); ++k) release(k);
}

std::map<std::string, at::Tensor> LayerSharding::consolidated(int root) {
  LVX_CHECK(shard_parameters_, "consolidated: the parameters are whole (stage 2)");
  std::map<std::string, at::Tensor> out;
  models::StateDict& params = model_.parameters();
  for (size_t k = 0; k < units_.size(); ++k) {
    gather(k);
    if (gather_pg_->rank() == root) {
      for (const std::string& name : units_[k].names)
        out[name] = params.at(name).detach().to(at::kCPU).clone();
      for (const std::string& name : units_[k].frozen_names)
        out[name] = params.at(name).detach().to(at::kCPU).clone();
    }
    release(k);
  }
  return out;
}

int64_t LayerSharding::bytes_sent() const {
  return (gather_pg_ ? gather_pg_->counters_snapshot().total_sent() : 0) +
         reduce_pg_->counters_snapshot().total_sent();
}

// ---- TaskThread ---------------------------------------------------------------------------------

TaskThread::TaskThread() {
  thread_ = std::thread([this] {
    for (;;) {
      std::packaged_task<void()> task;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [this] { return stopping_ || !tasks_.empty(); });
        if (tasks_.empty()) return;  // stopping, nothing left
        task = std::move(tasks_.front());
        tasks_.pop_front();
      }
      task();  // its error goes to its future
    }
  });
}

TaskThread::~TaskThread() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

std::shared_future<void> TaskThread::post(std::function<void()> task) {
  std::packaged_task<void()> t(std::move(task));
  std::shared_future<void> f = t.get_future().share();
  {
    std::lock_guard<std::mutex> lock(mu_);
    tasks_.push_back(std::move(t));
  }
  cv_.notify_all();
  return f;
}

}  // namespace lvx::runtime
