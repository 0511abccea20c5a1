#include "src/attention/ring_pipeline.h"

#include "src/common/error.h"

namespace lvx::attention {
namespace {

using dist::P2POp;

// Empty receive buffers shaped like `like`, each with its token dimension set to `len`.
BlockTensors empty_block(const BlockTensors& like, int64_t len) {
  BlockTensors out;
  out.seq_dims = like.seq_dims;
  for (size_t i = 0; i < like.tensors.size(); ++i) {
    auto shape = like.tensors[i].sizes().vec();
    shape[like.seq_dims[i]] = len;
    out.tensors.push_back(at::empty(shape, like.tensors[i].options()));
  }
  return out;
}

// Posts one hop: `send` to next, a block of `len` tokens from prev into *recv.
dist::Work hop(dist::ProcessGroup& pg, const BlockTensors& send, int64_t len, BlockTensors* recv,
               const char* what) {
  *recv = empty_block(send, len);
  std::vector<P2POp> ops;
  for (const auto& t : send.tensors) ops.push_back(P2POp::send(t.contiguous(), pg.next()));
  for (const auto& t : recv->tensors) ops.push_back(P2POp::recv(t, pg.prev()));
  return pg.batch_isend_irecv(std::move(ops), what);
}

}  // namespace

BlockTensors ring_pipeline(dist::ProcessGroup& pg, const Layout& layout, BlockTensors travelling,
                           const RingPass& pass) {
  const int n = pg.world_size(), r = pg.rank();
  int owner = r;
  dist::Work behind;  // accumulators of the held block, arriving from prev
  BlockTensors arrived;
  for (int step = 0; step < n; ++step) {
    const int next_owner = (owner - 1 + n) % n;
    dist::Work ahead;
    BlockTensors next_block;
    if (step + 1 < n)
      ahead = hop(pg, travelling, layout.local_size(next_owner), &next_block, pass.ahead_what);
    BlockTensors mine = pass.compute(owner, travelling);
    if (!mine.empty()) {
      if (step > 0) {
        behind.wait();
        pass.combine(mine, arrived);
      }
      if (n == 1) return mine;
      // Send this block's accumulators on (the last hop takes them home) and receive those of
      // the block held next (after the last step: this rank's own, complete).
      const int incoming = step + 1 < n ? next_owner : r;
      behind = hop(pg, mine, layout.local_size(incoming), &arrived, pass.behind_what);
    }
    if (step + 1 < n) {
      ahead.wait();
      travelling = std::move(next_block);
      owner = next_owner;
    }
  }
  if (behind.valid()) behind.wait();
  return arrived;
}

PassSchedule ring_schedule(const Layout& layout, int rank, bool q_travels,
                           const std::string& ahead_what, int64_t ahead_bytes,
                           const std::string& behind_what, int64_t behind_bytes) {
  const int n = layout.world;
  PassSchedule p;
  for (int t = 0; t < n; ++t) {
    const int owner = ((rank - t) % n + n) % n;
    p.rounds.push_back(q_travels ? Block{owner, rank} : Block{rank, owner});
  }
  if (n == 1) return p;
  auto len = [&](int t) { return layout.local_size(((rank - t) % n + n) % n); };
  for (int t = 0; t + 1 < n; ++t)
    p.messages.push_back(
        {ahead_what, Message::kRingHop, t, len(t) * ahead_bytes, len(t + 1) * ahead_bytes});
  if (behind_bytes > 0)
    for (int t = 0; t < n; ++t)  // the block held in round t; the last hop brings mine home
      p.messages.push_back({behind_what, Message::kRingHop, t + 1, len(t) * behind_bytes,
                            (t + 1 < n ? len(t + 1) : layout.local_size(rank)) * behind_bytes});
  return p;
}

}  // namespace lvx::attention
