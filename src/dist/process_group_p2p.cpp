// ProcessGroup's point-to-point messages: a batch of sends and receives posted on the engine of
// its tensors (NCCL: one coalesced group call, a multi-node run's inter-node messages on their
// own communicator; Gloo: one request per message, each direction of a pair on its own context),
// CUDA tensors staged through the host where there is no NCCL, and Work's wait, which counts each
// message per peer as it completes and fails the group on an engine error or timeout.
#include <algorithm>
#include <map>
#include <optional>

#include "src/common/error.h"
#include "src/dist/nccl_backend.h"
#include "src/dist/process_group.h"
#include "src/dist/process_group_state.h"

namespace lvx::dist {
namespace {

// The Gloo tag of message number `seq` from rank `from` to rank `to` (both sides compute the same):
// its low bit is the direction, so that each direction has a context of its own (gloo_options).
int gloo_tag(uint32_t base, uint32_t mask, uint32_t seq, int from, int to) {
  return static_cast<int>(base | (((seq << 1) | (from < to ? 0u : 1u)) & mask));
}

}  // namespace

Work::Work() = default;
Work::Work(Work&&) noexcept = default;

Work& Work::operator=(Work&& other) noexcept {
  if (this != &other) {
    if (impl_ && !impl_->done) {
      try {
        wait();
      } catch (...) {
      }
    }
    impl_ = std::move(other.impl_);
  }
  return *this;
}

Work::~Work() {
  if (impl_ && !impl_->done) {
    try {
      wait();  // returns at once when the group has failed
    } catch (...) {
      // A destructor must not throw. A failure found here still fails the group, so the next
      // operation reports it.
    }
  }
}

void Work::wait() {
  if (!impl_ || impl_->done) return;
  impl_->done = true;
  ProcessGroup::Handle& h = *impl_->group;
  ProcessGroup* pg = nullptr;
  {
    std::lock_guard<std::mutex> lock(h.mu);
    pg = h.pg;
    if (pg != nullptr) ++h.waiting;
  }
  if (pg == nullptr) {
    impl_->posted.clear();  // abandoned: never counted
    LVX_FAIL(impl_->what,
             ": waited for after its process group was destroyed (a Work must not outlive its "
             "ProcessGroup); its messages are abandoned");
  }
  struct Leave {
    ProcessGroup::Handle& h;
    ~Leave() {
      {
        std::lock_guard<std::mutex> lock(h.mu);
        --h.waiting;
      }
      h.cv.notify_all();
    }
  } leave{h};
  pg->wait_work(*impl_);
}

void ProcessGroup::wait_work(Work::Impl& w) {
  const auto t0 = std::chrono::steady_clock::now();
  struct AddWait {  // counted on every path out, errors included
    ProcessGroup& pg;
    std::chrono::steady_clock::time_point t0;
    ~AddWait() {
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      std::lock_guard<std::mutex> lock(pg.counters_mu_);
      pg.counters_.wait_seconds += s;
    }
  } add_wait{*this, t0};
  for (auto& p : w.posted) {
    check_not_failed(w.what);  // its requests were aborted: do not wait for them
    bool completed = false;
    try {
      if (p.stream_ordered) {
        nccl_stream_wait(*p.work);  // no host block: the current stream waits on NCCL's
        completed = true;
      } else {
        completed = p.work->wait(w.timeout);
      }
    } catch (const c10::Error& e) {
      fail(w.what, e.what_without_backtrace());
    } catch (const std::exception& e) {
      fail(w.what, e.what());
    }
    if (!completed) {  // aborted while waiting: another request (thread) failed the group
      check_not_failed(w.what);
      fail(w.what, "the request was aborted");
    }
    {
      std::lock_guard<std::mutex> lock(engine_->fault_mu);
      engine_->pending.erase(p.work.get());
    }
    if (p.device.defined()) p.device.copy_(p.staged);
    {
      std::lock_guard<std::mutex> lock(counters_mu_);
      for (const auto& m : p.msgs) {
        (m.kind == P2POp::kSend ? counters_.sent : counters_.received)[m.peer] += m.bytes;
        if (p.formula)
          (m.kind == P2POp::kSend ? counters_.formula_sent : counters_.formula_received) += m.bytes;
      }
    }
  }
  w.posted.clear();
}

namespace {

// The batch's checks, and the name its errors give it ("<what> with rank(s) a,b").
std::string batch_name(const std::vector<P2POp>& ops, const char* what, int rank, int world) {
  std::vector<int> peers;
  for (const auto& op : ops) {
    LVX_CHECK(op.peer >= 0 && op.peer < world, what, ": peer ", op.peer, " is outside [0, ", world,
              ")");
    LVX_CHECK(op.peer != rank, what, ": rank ", rank, " cannot send to or receive from itself");
    LVX_CHECK(op.tensor.is_contiguous(), what, ": tensors must be contiguous");
    peers.push_back(op.peer);
  }
  std::sort(peers.begin(), peers.end());
  peers.erase(std::unique(peers.begin(), peers.end()), peers.end());
  std::string peer_list;
  for (int p : peers) peer_list += str(peer_list.empty() ? "" : ",", p);
  return str(what, " with rank", peers.size() > 1 ? "s " : " ", peer_list);
}

// Host staging (Engine::stage_cuda): the batch of CUDA tensors becomes a Gloo batch of host
// tensors. Returns each host receive buffer's device tensor (copied into when waited for).
std::map<const at::TensorImpl*, at::Tensor> stage_on_host(std::vector<P2POp>& ops) {
  std::map<const at::TensorImpl*, at::Tensor> device_of;
  for (auto& op : ops) {
    if (op.kind == P2POp::kSend) {
      op.tensor = op.tensor.to(at::kCPU);  // synchronous: the data is on the host when it returns
    } else {
      at::Tensor host = at::empty(op.tensor.sizes(), op.tensor.options().device(at::kCPU));
      device_of[host.unsafeGetTensorImpl()] = op.tensor;
      op.tensor = host;
    }
  }
  return device_of;
}

// A multi-node NCCL run's inter-node messages, moved out of `ops`: they form a second group call
// on the inter-node communicator (a pair is inter-node on both sides alike, so both post it there).
std::vector<P2POp> take_inter_node(std::vector<P2POp>& ops, int rank, int node_size) {
  const int node = rank / node_size;
  std::vector<P2POp> intra, inter;
  for (auto& op : ops) (op.peer / node_size == node ? intra : inter).push_back(std::move(op));
  ops = std::move(intra);
  return inter;
}

}  // namespace

void ProcessGroup::Engine::post(Backend& engine, std::vector<P2POp>& batch, bool coalesce, int rank,
                                Work::Impl& work,
                                const std::map<const at::TensorImpl*, at::Tensor>& staged) {
  auto track = [&](c10::intrusive_ptr<c10d::Work> w, std::vector<Work::Impl::Msg> msgs) {
    std::lock_guard<std::mutex> lock(fault_mu);
    pending[w.get()] = w;
    work.posted.push_back({std::move(w), std::move(msgs), /*stream_ordered=*/coalesce, {}, {}});
  };
  bool any = false;
  for (const auto& op : batch) any = any || nbytes(op.tensor) > 0;
  if (!any) return;
  if (coalesce) engine.startCoalescing();
  std::vector<Work::Impl::Msg> coalesced;
  for (auto& op : batch) {
    const int64_t n = nbytes(op.tensor);
    if (n == 0) continue;
    std::vector<at::Tensor> ts{op.tensor};
    const bool send = op.kind == P2POp::kSend;
    auto& seq = send ? send_seq : recv_seq;
    const int tag =
        gloo_tag(tag_base, tag_mask, seq[op.peer]++, send ? rank : op.peer, send ? op.peer : rank);
    auto w = send ? engine.send(ts, op.peer, tag) : engine.recv(ts, op.peer, tag);
    if (coalesce) {
      coalesced.push_back({op.kind, op.peer, n});
      continue;
    }
    track(w, {{op.kind, op.peer, n}});
    auto it = staged.find(op.tensor.unsafeGetTensorImpl());
    if (it != staged.end()) {
      work.posted.back().staged = op.tensor;
      work.posted.back().device = it->second;
    }
  }
  if (coalesce) {
    auto w = engine.endCoalescing();
    if (w) track(w, std::move(coalesced));
  }
}

Work ProcessGroup::batch_isend_irecv(std::vector<P2POp> ops, const char* what) {
  Work work;
  work.impl_ = std::make_unique<Work::Impl>();
  work.impl_->group = handle_;
  work.impl_->timeout = options_.timeout;
  work.impl_->what = batch_name(ops, what, rank_, world_size_);
  if (ops.empty()) return work;
  check_not_failed(work.impl_->what);

  bool any_cuda = false, any_cpu = false;
  for (const auto& op : ops) (op.tensor.is_cuda() ? any_cuda : any_cpu) = true;
  LVX_CHECK(!(any_cuda && any_cpu), what, ": a batch mixes CPU and CUDA tensors");
  std::map<const at::TensorImpl*, at::Tensor> staged;  // host buffer -> device tensor
  if (any_cuda && engine_->stage_cuda()) {
    staged = stage_on_host(ops);
    any_cuda = false;
  }
  Backend& backend = engine_->backend_for(ops.front().tensor);
  std::vector<P2POp> inter_ops;
  if (any_cuda && engine_->nccl_inter) inter_ops = take_inter_node(ops, rank_, engine_->node_size);
  // NCCL: one group call per communicator; Gloo: one request per message (unbound buffers never
  // block). An engine error while posting fails the group, after post_mu is released (the
  // diagnosis takes seconds, and other threads must see the failure rather than wait behind it).
  const std::optional<std::string> engine_error = engine_error_of([&] {
    std::lock_guard<std::mutex> post_lock(engine_->post_mu);
    engine_->post(backend, ops, any_cuda, rank_, *work.impl_, staged);
    if (!inter_ops.empty())
      engine_->post(*engine_->nccl_inter, inter_ops, any_cuda, rank_, *work.impl_, staged);
  });
  if (engine_error) fail(work.impl_->what, *engine_error);
  return work;
}

Work ProcessGroup::ring_exchange(const at::Tensor& send, const at::Tensor& recv, const char* what) {
  if (world_size_ == 1) {
    if (recv.numel()) recv.copy_(send);
    return Work();
  }
  return batch_isend_irecv({P2POp::send(send, next()), P2POp::recv(recv, prev())}, what);
}

}  // namespace lvx::dist
