// ProcessGroup's collectives as rings of point-to-point messages, one host-driven step after
// another (Options::collectives = kP2P, LVX_DIST_COLLECTIVES=p2p): the algorithms lvx ran before
// it rode the engines' collectives (collectives.cpp). Kept as the reference bench_comm and
// bench_finetune time the engines against, and as a fallback; reduce_scatter's ring is also
// lvx's default on Gloo (collectives.cpp). Every message is counted as it completes, per peer.
//   all_reduce      ring reduce-scatter, then ring all-gather of the reduced chunks: 2(w−1)
//                   steps, each a send to next and a receive from prev, then an add
//   reduce_scatter  ring: in step s rank r sends its partial of chunk r − s − 1 and adds prev's
//                   partial of chunk r − s − 2
//   all_gather      ring over the pieces as they are (uneven sizes too): in step s rank r
//                   forwards the piece of rank r − s and receives that of r − s − 1
//   broadcast       the root sends to every other rank at once
#include <algorithm>

#include "src/dist/process_group.h"
#include "src/dist/process_group_state.h"

namespace lvx::dist {
namespace {

void reduce_into(at::Tensor dst, const at::Tensor& src, ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      dst.add_(src);
      break;
    case ReduceOp::kMax:
      at::maximum_out(dst, dst, src);
      break;
    case ReduceOp::kMin:
      at::minimum_out(dst, dst, src);
      break;
  }
}

}  // namespace

at::Tensor ProcessGroup::reduce_scatter_ring(at::Tensor& tensor, const std::vector<int64_t>& splits,
                                             const std::vector<int64_t>& off, ReduceOp op) {
  const int w = world_size_;
  auto chunk = [&](int c) {
    return tensor.narrow(0, off[static_cast<size_t>(c)], splits[static_cast<size_t>(c)]);
  };
  at::Tensor tmp = at::empty({*std::max_element(splits.begin(), splits.end())}, tensor.options());
  for (int s = 0; s + 1 < w; ++s) {
    const int send_c = (rank_ - s - 1 + 2 * w) % w;
    const int recv_c = (rank_ - s - 2 + 3 * w) % w;
    at::Tensor dst = chunk(recv_c);
    at::Tensor buf = tmp.narrow(0, 0, dst.numel());
    batch_isend_irecv({P2POp::send(chunk(send_c), next()), P2POp::recv(buf, prev())},
                      "reduce_scatter")
        .wait();
    reduce_into(dst, buf, op);
  }
  return chunk(rank_);
}

void ProcessGroup::all_reduce_ring(at::Tensor& tensor, ReduceOp op) {
  at::Tensor flat = tensor.view({-1});
  const int w = world_size_;
  std::vector<int64_t> off(static_cast<size_t>(w) + 1);
  for (int c = 0; c <= w; ++c) off[static_cast<size_t>(c)] = shard_range(flat.numel(), w, c).first;
  off[static_cast<size_t>(w)] = flat.numel();
  auto chunk = [&](int c) {
    return flat.narrow(0, off[static_cast<size_t>(c)],
                       off[static_cast<size_t>(c) + 1] - off[static_cast<size_t>(c)]);
  };
  at::Tensor tmp = at::empty({flat.numel() / w + 1}, flat.options());
  for (int s = 0; s + 1 < w; ++s) {  // reduce-scatter: rank r ends with chunk r + 1 reduced
    const int send_c = (rank_ - s + w) % w, recv_c = (rank_ - s - 1 + 2 * w) % w;
    at::Tensor dst = chunk(recv_c), buf = tmp.narrow(0, 0, dst.numel());
    batch_isend_irecv({P2POp::send(chunk(send_c), next()), P2POp::recv(buf, prev())},
                      "all_reduce")
        .wait();
    reduce_into(dst, buf, op);
  }
  for (int s = 0; s + 1 < w; ++s) {  // all-gather of the reduced chunks
    const int send_c = (rank_ + 1 - s + w) % w, recv_c = (rank_ - s + w) % w;
    batch_isend_irecv({P2POp::send(chunk(send_c), next()), P2POp::recv(chunk(recv_c), prev())},
                      "all_reduce")
        .wait();
  }
}

void ProcessGroup::all_gather_ring(at::Tensor& out, const std::vector<int64_t>& offset) {
  const int w = world_size_;
  auto piece = [&](int c) {
    return out.narrow(0, offset[static_cast<size_t>(c)],
                      offset[static_cast<size_t>(c) + 1] - offset[static_cast<size_t>(c)]);
  };
  for (int s = 0; s + 1 < w; ++s) {
    const int send_c = (rank_ - s + w) % w, recv_c = (rank_ - s - 1 + 2 * w) % w;
    batch_isend_irecv({P2POp::send(piece(send_c), next()), P2POp::recv(piece(recv_c), prev())},
                      "all_gather")
        .wait();
  }
}

void ProcessGroup::broadcast_star(at::Tensor& tensor, int root) {
  std::vector<P2POp> ops;
  if (rank_ == root) {
    for (int r = 0; r < world_size_; ++r)
      if (r != root) ops.push_back(P2POp::send(tensor, r));
  } else {
    ops.push_back(P2POp::recv(tensor, root));
  }
  batch_isend_irecv(std::move(ops), "broadcast").wait();
}

}  // namespace lvx::dist
