#include "src/attention/ring_pipeline.h"

#include "src/common/error.h"

namespace lvx::attention {
namespace {

using dist::P2POp;

// One ring of ranks: members in ring order, this rank at `pos`; member i starts with the block
// of rank owners[i].
struct RingPath {
  std::vector<int> members, owners;
  int pos = 0;
  int size() const { return static_cast<int>(members.size()); }
  int next() const { return members[(pos + 1) % size()]; }
  int prev() const { return members[(pos + size() - 1) % size()]; }
};

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

// Posts one hop: `send` to the ring's next, a block of `len` tokens from its prev into *recv.
dist::Work hop(dist::ProcessGroup& pg, const RingPath& ring, const BlockTensors& send, int64_t len,
               BlockTensors* recv, const std::string& what) {
  *recv = empty_block(send, len);
  std::vector<P2POp> ops;
  for (const auto& t : send.tensors) ops.push_back(P2POp::send(t.contiguous(), ring.next()));
  for (const auto& t : recv->tensors) ops.push_back(P2POp::recv(t, ring.prev()));
  return pg.batch_isend_irecv(std::move(ops), what.c_str());
}

// The flat loop over one ring (see the header).
BlockTensors ring_over(dist::ProcessGroup& pg, const RingPath& ring, const Layout& layout,
                       BlockTensors travelling, const RingPass& pass) {
  const int n = ring.size();
  int at = ring.pos;  // ring position whose block is held
  dist::Work behind;  // accumulators of the held block, arriving from prev
  BlockTensors arrived;
  for (int step = 0; step < n; ++step) {
    const int next_at = (at - 1 + n) % n;
    dist::Work ahead;
    BlockTensors next_block;
    if (step + 1 < n)
      ahead = hop(pg, ring, travelling, layout.local_size(ring.owners[next_at]), &next_block,
                  pass.ahead_what);
    BlockTensors mine = pass.compute(ring.owners[at], travelling);
    if (!mine.empty()) {
      if (step > 0) {
        behind.wait();
        pass.combine(mine, arrived);
      }
      if (n == 1) return mine;
      // Send this block's accumulators on (the last hop takes them home) and receive those of
      // the block held next (after the last step: this rank's own, complete).
      const int incoming = step + 1 < n ? next_at : ring.pos;
      behind =
          hop(pg, ring, mine, layout.local_size(ring.owners[incoming]), &arrived, pass.behind_what);
    }
    if (step + 1 < n) {
      ahead.wait();
      travelling = std::move(next_block);
      at = next_at;
    }
  }
  if (behind.valid()) behind.wait();
  return arrived;
}

int mod(int a, int m) { return ((a % m) + m) % m; }

}  // namespace

bool double_ring(int n, int64_t node_size) {
  return node_size > 1 && node_size < n && n % node_size == 0;
}

BlockTensors ring_pipeline(dist::ProcessGroup& pg, const Layout& layout, BlockTensors travelling,
                           const RingPass& pass, int64_t node_size) {
  const int n = pg.world_size(), r = pg.rank();
  if (!double_ring(n, node_size)) {
    RingPath flat;
    for (int i = 0; i < n; ++i) flat.members.push_back(i);
    flat.owners = flat.members;
    flat.pos = r;
    return ring_over(pg, flat, layout, std::move(travelling), pass);
  }
  const int L = static_cast<int>(node_size), I = n / L, i = r / L, j = r % L;
  RingPath outer;
  for (int x = 0; x < I; ++x) outer.members.push_back(x * L + j);
  outer.owners = outer.members;
  outer.pos = i;
  RingPass outer_pass;
  outer_pass.ahead_what = pass.ahead_what + " (inter-node)";
  outer_pass.behind_what = pass.behind_what + " (inter-node)";
  outer_pass.combine = pass.combine;
  outer_pass.compute = [&](int owner, const BlockTensors& block) {
    const int k = mod(i - owner / L, I);  // the node cycle: blocks of node i − k go round
    RingPath inner;
    for (int x = 0; x < L; ++x) {
      inner.members.push_back(i * L + x);
      inner.owners.push_back(mod(i - k, I) * L + x);
    }
    inner.pos = j;
    return ring_over(pg, inner, layout, block, pass);
  };
  return ring_over(pg, outer, layout, std::move(travelling), outer_pass);
}

PassSchedule ring_schedule(const Layout& layout, int rank, bool q_travels,
                           const std::string& ahead_what, int64_t ahead_bytes,
                           const std::string& behind_what, int64_t behind_bytes,
                           int64_t node_size) {
  const int n = layout.world;
  PassSchedule p;
  auto block = [&](int owner) { return q_travels ? Block{owner, rank} : Block{rank, owner}; };
  auto len = [&](int owner) { return layout.local_size(owner); };
  if (!double_ring(n, node_size)) {
    auto owner = [&](int t) { return mod(rank - t, n); };
    for (int t = 0; t < n; ++t) p.rounds.push_back(block(owner(t)));
    if (n == 1) return p;
    const int next = (rank + 1) % n;
    for (int t = 0; t + 1 < n; ++t)
      p.messages.push_back({ahead_what, Message::kRingHop, t, len(owner(t)) * ahead_bytes,
                            len(owner(t + 1)) * ahead_bytes, next});
    if (behind_bytes > 0)
      for (int t = 0; t < n; ++t)  // the block held in round t; the last hop brings mine home
        p.messages.push_back({behind_what, Message::kRingHop, t + 1, len(owner(t)) * behind_bytes,
                              (t + 1 < n ? len(owner(t + 1)) : len(rank)) * behind_bytes, next});
    return p;
  }
  const int L = static_cast<int>(node_size), I = n / L, i = rank / L, j = rank % L;
  auto owner = [&](int k, int m) { return mod(i - k, I) * L + mod(j - m, L); };
  const int inner_next = i * L + (j + 1) % L, outer_next = ((i + 1) % I) * L + j;
  const bool behind = behind_bytes > 0;
  const int cycle = L + (behind ? 1 : 0);  // rounds of a node cycle, with the trip home
  for (int k = 0; k < I; ++k) {
    const int base = k * cycle;
    for (int m = 0; m < L; ++m) p.rounds.push_back(block(owner(k, m)));
    if (behind) p.rounds.push_back(Block::none());
    for (int m = 0; m + 1 < L; ++m)
      p.messages.push_back({ahead_what, Message::kRingHop, base + m, len(owner(k, m)) * ahead_bytes,
                            len(owner(k, m + 1)) * ahead_bytes, inner_next});
    if (behind)
      for (int m = 0; m < L; ++m)
        p.messages.push_back({behind_what, Message::kRingHop, base + m + 1,
                              len(owner(k, m)) * behind_bytes,
                              len(owner(k, m + 1 < L ? m + 1 : 0)) * behind_bytes, inner_next});
    if (k + 1 < I)
      p.messages.push_back({ahead_what + " (inter-node)", Message::kRingHop, base,
                            len(owner(k, 0)) * ahead_bytes, len(owner(k + 1, 0)) * ahead_bytes,
                            outer_next, cycle});
  }
  if (behind)
    for (int k = 0; k < I; ++k) {
      const bool last = k + 1 == I;
      p.messages.push_back({behind_what + " (inter-node)", Message::kRingHop,
                            last ? static_cast<int>(p.rounds.size()) : (k + 1) * cycle,
                            len(owner(k, 0)) * behind_bytes,
                            (last ? len(rank) : len(owner(k + 1, 0))) * behind_bytes, outer_next,
                            last ? 1 : cycle});
    }
  return p;
}

}  // namespace lvx::attention
