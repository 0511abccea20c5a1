// ProcessGroup's collectives. all_reduce, all_gather, broadcast and (on NCCL) reduce_scatter run
// on the engines' own algorithms (c10d: Gloo's on CPU tensors, NCCL's on CUDA ones: one kernel with
// NCCL's ring/tree/NVLS algorithms instead of 2(n−1) host-driven steps), waited for like a batch
// of messages (the timeout, the failed rank named, the group failed). Their bytes cannot be
// counted message by message, so each rank counts its share by the formula of the algorithm
// (process_group.h) and marks it formula-counted (ByteCounters::formula_sent / _received).
// all_to_all stays lvx's pairwise exchange of point-to-point messages (Ulysses' algorithm), and on
// Gloo reduce_scatter and all_gather are lvx's rings by default (CollectiveImpl::kAuto: Gloo's own
// measured slower, process_group.h), counted per message. With Options::collectives = kP2P every
// collective runs as lvx's rings of messages (collectives_p2p.cpp), with kEngine none does.
#include <algorithm>
#include <numeric>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include "src/dist/nccl_backend.h"
#include "src/dist/process_group.h"
#include "src/dist/process_group_state.h"

namespace lvx::dist {

namespace {

c10d::ReduceOp to_c10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return c10d::ReduceOp(c10d::ReduceOp::SUM);
    case ReduceOp::kMax:
      return c10d::ReduceOp(c10d::ReduceOp::MAX);
    case ReduceOp::kMin:
      return c10d::ReduceOp(c10d::ReduceOp::MIN);
  }
  return c10d::ReduceOp(c10d::ReduceOp::SUM);
}

using Msgs = std::vector<CountedMessage>;

// The ring's volume for chunk bytes `c` (rank order): in each of the n−1 steps rank r sends chunk
// (r + send_shift − s) to next and receives chunk (r + recv_shift − s) from prev.
void ring_steps(const std::vector<int64_t>& c, int r, int next, int prev, int send_shift,
                int recv_shift, Msgs* out) {
  const int n = static_cast<int>(c.size());
  int64_t sent = 0, received = 0;
  for (int s = 0; s + 1 < n; ++s) {
    sent += c[static_cast<size_t>(((r + send_shift - s) % n + 2 * n) % n)];
    received += c[static_cast<size_t>(((r + recv_shift - s) % n + 2 * n) % n)];
  }
  if (sent) out->push_back({P2POp::kSend, next, sent});
  if (received) out->push_back({P2POp::kRecv, prev, received});
}

// Chunk k of n elements as a ring all-reduce splits them: [n·k/w, n·(k+1)/w), in bytes.
std::vector<int64_t> ring_chunks(int64_t numel, int64_t elem, int w) {
  std::vector<int64_t> c(static_cast<size_t>(w));
  for (int k = 0; k < w; ++k) {
    const auto [b, e] = shard_range(numel, w, k);
    c[static_cast<size_t>(k)] = (e - b) * elem;
  }
  return c;
}

}  // namespace

Msgs ProcessGroup::broadcast_volume(int64_t bytes, int root, bool nccl) const {
  const int n = world_size_, r = rank_;
  Msgs m;
  if (bytes == 0 || n == 1) return m;
  if (nccl) {  // NCCL's ring: the root sends to next, every rank forwards but the one before root
    if ((r + 1) % n != root) m.push_back({P2POp::kSend, (r + 1) % n, bytes});
    if (r != root) m.push_back({P2POp::kRecv, (r - 1 + n) % n, bytes});
    return m;
  }
  // Gloo's binomial tree (gloo/broadcast.cc): virtual rank v = r − root; in step i the ranks
  // with the low i bits clear exchange with the peer that differs in bit i.
  const int v = (r - root + n) % n;
  int dim = 0;
  while ((1 << dim) < n) ++dim;
  int mask = (1 << dim) - 1;
  for (int i = 0; i < dim; ++i) {
    mask ^= 1 << i;
    if ((v & mask) != 0) continue;
    const int vpeer = v ^ (1 << i);
    if (vpeer >= n) continue;
    const int peer = (vpeer + root) % n;
    m.push_back({(v & (1 << i)) == 0 ? P2POp::kSend : P2POp::kRecv, peer, bytes});
  }
  return m;
}

void ProcessGroup::run_collective(
    const std::string& what, at::Tensor& t, Msgs msgs,
    const std::function<c10::intrusive_ptr<c10d::Work>(c10d::Backend&, at::Tensor&)>& post) {
  check_not_failed(what);
  Work work;
  work.impl_ = std::make_unique<Work::Impl>();
  work.impl_->group = handle_;
  work.impl_->timeout = options_.timeout;
  work.impl_->what = what;
  // CUDA tensors without NCCL (ranks sharing a GPU) go through Gloo on a host copy.
  const bool staged = t.is_cuda() && engine_->stage_cuda();
  at::Tensor on = staged ? t.to(at::kCPU) : t;
  const std::optional<std::string> engine_error = engine_error_of([&] {
    c10::intrusive_ptr<c10d::Work> w = post(engine_->backend_for(on), on);
    Work::Impl::Posted p{w, std::move(msgs), on_nccl(on), {}, {}};
    p.formula = true;
    if (staged) p.staged = on, p.device = t;
    {
      std::lock_guard<std::mutex> lock(engine_->fault_mu);
      engine_->pending[w.get()] = w;
    }
    work.impl_->posted.push_back(std::move(p));
  });
  if (engine_error) fail(what, *engine_error);
  work.wait();
}

at::Tensor ProcessGroup::all_gather(const at::Tensor& input, const std::vector<int64_t>& sizes_in) {
  LVX_CHECK(input.dim() >= 1, "all_gather: input must have at least one dimension");
  std::vector<int64_t> sizes = sizes_in;
  if (sizes.empty()) sizes.assign(world_size_, input.size(0));
  LVX_CHECK(static_cast<int>(sizes.size()) == world_size_, "all_gather: sizes has ", sizes.size(),
            " entries for ", world_size_, " ranks");
  LVX_CHECK(sizes[rank_] == input.size(0), "all_gather: rank ", rank_, " passes ", input.size(0),
            " rows but sizes says ", sizes[rank_]);
  std::vector<int64_t> offset(world_size_ + 1, 0);
  for (int r = 0; r < world_size_; ++r) offset[r + 1] = offset[r] + sizes[r];
  auto shape = input.sizes().vec();
  shape[0] = offset[world_size_];
  at::Tensor out = at::empty(shape, input.options());
  if (world_size_ == 1) return out.copy_(input);
  if (rings_for(input)) {
    out.narrow(0, offset[rank_], sizes[rank_]).copy_(input);
    all_gather_ring(out, offset);
    return out;
  }
  // Bytes of one row (dimension 0) of the output.
  const int64_t row_bytes =
      std::accumulate(shape.begin() + 1, shape.end(), int64_t{1}, std::multiplies<int64_t>()) *
      static_cast<int64_t>(input.element_size());
  const int64_t most = *std::max_element(sizes.begin(), sizes.end());
  const int64_t least = *std::min_element(sizes.begin(), sizes.end());
  if (most - least <= 1) {
    // Even, or as even as shard_range's chunks (one row apart): allgather_into_tensor on chunks
    // padded to the largest, the ring: (n−1) padded chunks sent and received.
    auto padded_shape = shape;
    padded_shape[0] = most * world_size_;
    at::Tensor all = most == least ? out : at::empty(padded_shape, input.options());
    at::Tensor in = input.contiguous();
    if (in.size(0) < most) {  // this rank's chunk, padded with zero rows
      auto s = shape;
      s[0] = most;
      at::Tensor p = at::zeros(s, input.options());
      p.narrow(0, 0, in.size(0)).copy_(in);
      in = p;
    }
    const int64_t chunk = most * row_bytes;
    Msgs m;
    ring_steps(std::vector<int64_t>(world_size_, chunk), rank_, next(), prev(), 0, -1, &m);
    run_collective("all_gather", all, std::move(m), [&](c10d::Backend& e, at::Tensor& o) {
      at::Tensor i = o.is_cuda() == in.is_cuda() ? in : in.to(o.device());
      return e._allgather_base(o, i, c10d::AllgatherOptions{});
    });
    if (most != least)
      for (int r = 0; r < world_size_; ++r)
        out.narrow(0, offset[r], sizes[r]).copy_(all.narrow(0, r * most, sizes[r]));
    return out;
  }
  // Uneven pieces (ZeRO's runs lie in one or two ranks' shards): each owner broadcasts its piece,
  // in rank order; padding them to the largest would send (n−1) times the largest from every
  // rank.
  out.narrow(0, offset[rank_], sizes[rank_]).copy_(input);
  for (int root = 0; root < world_size_; ++root) {
    if (sizes[root] == 0) continue;
    at::Tensor piece = out.narrow(0, offset[root], sizes[root]);  // contiguous rows
    broadcast_engine("all_gather", piece, root);
  }
  return out;
}

void ProcessGroup::all_reduce(at::Tensor& tensor, ReduceOp op) {
  if (world_size_ == 1) return;
  LVX_CHECK(tensor.is_contiguous(), "all_reduce: tensor must be contiguous");
  if (ring_all_reduce(tensor)) return all_reduce_ring(tensor, op);
  // The ring: reduce-scatter (send chunk r − s, receive r − s − 1) then all-gather (send
  // r + 1 − s, receive r − s): 2(n−1)/n of the bytes each way.
  const auto c = ring_chunks(tensor.numel(), tensor.element_size(), world_size_);
  Msgs m;
  ring_steps(c, rank_, next(), prev(), 0, -1, &m);
  ring_steps(c, rank_, next(), prev(), 1, 0, &m);
  run_collective("all_reduce", tensor, std::move(m), [&](c10d::Backend& e, at::Tensor& t) {
    std::vector<at::Tensor> ts{t};
    c10d::AllreduceOptions o;
    o.reduceOp = to_c10d(op);
    o.timeout = options_.timeout;
    return e.allreduce(ts, o);
  });
}

at::Tensor ProcessGroup::reduce_scatter(at::Tensor& tensor, ReduceOp op) {
  std::vector<int64_t> splits(static_cast<size_t>(world_size_));
  for (int c = 0; c < world_size_; ++c) {
    const auto [b, e] = shard_range(tensor.numel(), world_size_, c);
    splits[static_cast<size_t>(c)] = e - b;
  }
  return reduce_scatter(tensor, splits, op);
}

at::Tensor ProcessGroup::reduce_scatter(at::Tensor& tensor, const std::vector<int64_t>& splits,
                                        ReduceOp op) {
  LVX_CHECK(tensor.dim() == 1 && tensor.is_contiguous(),
            "reduce_scatter: expected a contiguous 1-D tensor, got shape ", tensor.sizes());
  const int64_t n = tensor.numel();
  const int w = world_size_;
  LVX_CHECK(static_cast<int>(splits.size()) == w, "reduce_scatter: splits has ", splits.size(),
            " entries for ", w, " ranks");
  std::vector<int64_t> off(static_cast<size_t>(w) + 1, 0);
  for (int c = 0; c < w; ++c) {
    LVX_CHECK(splits[static_cast<size_t>(c)] >= 0, "reduce_scatter: negative split");
    off[static_cast<size_t>(c) + 1] = off[static_cast<size_t>(c)] + splits[static_cast<size_t>(c)];
  }
  LVX_CHECK(off.back() == n, "reduce_scatter: splits sum to ", off.back(), ", the tensor has ", n,
            " elements");
  if (w == 1) return tensor;
  // Gloo's reduce_scatter is an all-reduce narrowed to each rank's chunk (measured on this
  // wheel, 4 ranks, 67 MB: 403 MB on the wire against the ring's 201 MB), so Gloo keeps lvx's
  // ring unless told otherwise (CollectiveImpl::kEngine).
  const bool engine = !rings_for(tensor);
  if (engine) return reduce_scatter_engine(tensor, splits, off, op);
  return reduce_scatter_ring(tensor, splits, off, op);
}

bool ProcessGroup::rings_for(const at::Tensor& t) const {
  switch (options_.collectives) {
    case CollectiveImpl::kP2P:
      return true;
    case CollectiveImpl::kEngine:
      return false;
    case CollectiveImpl::kAuto:
      break;
  }
  return !on_nccl(t);
}

bool ProcessGroup::ring_all_reduce(const at::Tensor& t) const {
  if (options_.collectives != CollectiveImpl::kAuto)
    return options_.collectives == CollectiveImpl::kP2P;
  return world_size_ == 2 && rings_for(t);
}

// NCCL's reduce-scatter (one kernel, its ring): rank r sends its partial of chunk r − s − 1 and
// receives that of r − s − 2 in step s; every chunk but its own is sent once.
at::Tensor ProcessGroup::reduce_scatter_engine(at::Tensor& tensor,
                                               const std::vector<int64_t>& splits,
                                               const std::vector<int64_t>& off, ReduceOp op) {
  const int w = world_size_;
  std::vector<int64_t> bytes(static_cast<size_t>(w));
  for (int c = 0; c < w; ++c)
    bytes[static_cast<size_t>(c)] = splits[static_cast<size_t>(c)] * tensor.element_size();
  Msgs m;
  ring_steps(bytes, rank_, next(), prev(), -1, -2, &m);
  at::Tensor mine =
      tensor.narrow(0, off[static_cast<size_t>(rank_)], splits[static_cast<size_t>(rank_)]);
  at::Tensor result = at::empty_like(mine);  // the engine's output must not alias its input
  run_collective("reduce_scatter", result, std::move(m), [&](c10d::Backend& e, at::Tensor& out) {
    std::vector<at::Tensor> ins;
    for (int c = 0; c < w; ++c)
      ins.push_back(tensor.narrow(0, off[static_cast<size_t>(c)], splits[static_cast<size_t>(c)]));
    std::vector<at::Tensor> outs{out};
    std::vector<std::vector<at::Tensor>> in_lists{ins};
    c10d::ReduceScatterOptions o;
    o.reduceOp = to_c10d(op);
    o.timeout = options_.timeout;
    return e.reduce_scatter(outs, in_lists, o);
  });
  mine.copy_(result);
  return mine;
}

at::Tensor ProcessGroup::all_to_all(const at::Tensor& input,
                                    const std::vector<int64_t>& send_splits,
                                    const std::vector<int64_t>& recv_splits) {
  const int w = world_size_;
  LVX_CHECK(static_cast<int>(send_splits.size()) == w && static_cast<int>(recv_splits.size()) == w,
            "all_to_all: send_splits and recv_splits need one entry per rank (", w, "), got ",
            send_splits.size(), " and ", recv_splits.size());
  LVX_CHECK(input.dim() >= 1, "all_to_all: input must have at least one dimension");
  int64_t total_send = std::accumulate(send_splits.begin(), send_splits.end(), int64_t{0});
  LVX_CHECK(total_send == input.size(0), "all_to_all: send_splits sum to ", total_send,
            " but input has ", input.size(0), " rows");
  at::Tensor in = input.contiguous();
  auto shape = in.sizes().vec();
  shape[0] = std::accumulate(recv_splits.begin(), recv_splits.end(), int64_t{0});
  at::Tensor out = at::empty(shape, in.options());
  std::vector<int64_t> soff(w + 1, 0), roff(w + 1, 0);
  for (int r = 0; r < w; ++r) {
    soff[r + 1] = soff[r] + send_splits[r];
    roff[r + 1] = roff[r] + recv_splits[r];
  }
  LVX_CHECK(send_splits[rank_] == recv_splits[rank_], "all_to_all: rank ", rank_, " keeps ",
            send_splits[rank_], " rows for itself but expects to receive ", recv_splits[rank_]);
  out.narrow(0, roff[rank_], recv_splits[rank_])
      .copy_(in.narrow(0, soff[rank_], send_splits[rank_]));
  std::vector<P2POp> ops;
  for (int k = 1; k < w; ++k) {  // pairwise order spreads the load over peers
    int to = (rank_ + k) % w, from = (rank_ - k + w) % w;
    ops.push_back(P2POp::send(in.narrow(0, soff[to], send_splits[to]), to));
    ops.push_back(P2POp::recv(out.narrow(0, roff[from], recv_splits[from]), from));
  }
  batch_isend_irecv(std::move(ops), "all_to_all").wait();
  return out;
}

void ProcessGroup::broadcast(at::Tensor& tensor, int root) {
  LVX_CHECK(root >= 0 && root < world_size_, "broadcast: root ", root, " is outside [0, ",
            world_size_, ")");
  if (world_size_ == 1) return;
  LVX_CHECK(tensor.is_contiguous(), "broadcast: tensor must be contiguous");
  if (options_.collectives == CollectiveImpl::kP2P) return broadcast_star(tensor, root);
  broadcast_engine("broadcast", tensor, root);
}

void ProcessGroup::broadcast_engine(const char* what, at::Tensor& tensor, int root) {
  run_collective(what, tensor, broadcast_volume(nbytes(tensor), root, on_nccl(tensor)),
                 [&](c10d::Backend& e, at::Tensor& t) {
                   std::vector<at::Tensor> ts{t};
                   c10d::BroadcastOptions o;
                   o.rootRank = root;
                   o.timeout = options_.timeout;
                   return e.broadcast(ts, o);
                 });
}

bool ProcessGroup::on_nccl(const at::Tensor& t) const {
  return t.is_cuda() && engine_->nccl != nullptr;
}

}  // namespace lvx::dist
