// The rotate-and-accumulate loop shared by ring/striped and lv_xattn, forward and backward
// (LV-XAttn §3.1 eq. (1); BurstAttention Alg. 1 and 2). One side of the attention stays on its
// rank; the other side travels around the ring, one block per round:
//
//   round t on rank r holds the travelling block of rank (r − t) mod n.
//   1. post the block for round t+1 to next / from prev ("ahead"), overlapped with step 2;
//   2. compute with the stationary data and the held block, giving this rank's contribution to
//      the block's accumulators ("behind": partial O and lse, or dQ, or dK and dV), if any;
//   3. add the accumulators that arrived from prev during step 2, and send the sum on to next
//      (also overlapped with the next round); after round n−1 the last hop brings every
//      block's accumulators home.
//
// ring forward has no "behind" accumulators (it merges into its stationary O); the others do.
// ring_schedule() describes exactly these rounds and messages for the cost model and tests.
//
// Double ring (BurstAttention's topology-aware ring; node_size L with 1 < L < n, L | n): the same
// loop, nested. The outer ring joins the ranks with the same local index on the I = n/L nodes;
// each outer step's "compute" is a whole inner ring over the L ranks of this node. So a block
// rotates L − 1 times over the fast intra-node link, then takes one inter-node hop, which is
// posted before the node cycle and overlapped with all L of its rounds. Accumulators follow the
// same path: around the node (then one intra-node hop home, the node's partial sum), then to the
// next node during its cycle, and after the last cycle one inter-node hop home. In round
// t = k·L + m, rank (i, j) (node i, local index j) holds the block of rank
//   ((i − k) mod I)·L + ((j − m) mod L)
// (BurstEngine's partition order). n − 1 hops per block as in the flat ring; I − 1 of them cross
// nodes instead of I·(… every round waits for the slowest hop) in a flat ring spanning nodes.
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <string>
#include <vector>

#include "src/attention/layout.h"
#include "src/attention/strategy.h"
#include "src/dist/process_group.h"

namespace lvx::attention {

// Tensors of one block that travel together; seq_dims[i] is tensor i's token dimension (its
// size is the block owner's shard length).
struct BlockTensors {
  std::vector<at::Tensor> tensors;
  std::vector<int> seq_dims;
  bool empty() const { return tensors.empty(); }
};

struct RingPass {
  std::string ahead_what;  // names for errors and logs, e.g. "ring forward K/V"
  std::string behind_what;
  // compute(owner, block): this rank's work on the travelling block of `owner`; returns its
  // contribution to that block's accumulators (empty: the pass has none).
  std::function<BlockTensors(int owner, const BlockTensors& block)> compute;
  // combine(mine, arrived): folds the accumulators that arrived from prev into mine, in place.
  std::function<void(BlockTensors& mine, const BlockTensors& arrived)> combine;
};

// True when n ranks with node_size ranks per node run the double ring.
bool double_ring(int n, int64_t node_size);

// Runs the pass with `travelling` (this rank's own block, token lengths per `layout`), as a flat
// ring or, across nodes, a double ring. Returns this rank's own block's accumulators after their
// last hop (empty when the pass has none).
BlockTensors ring_pipeline(dist::ProcessGroup& pg, const Layout& layout, BlockTensors travelling,
                           const RingPass& pass, int64_t node_size = 0);

// The schedule of ring_pipeline on `rank`: round t computes (stationary, owner (rank − t) mod n);
// the ahead block of the next owner goes out in round t < n−1, and the accumulators of round t's
// block in round t+1. Bytes per token of a block: `ahead_bytes`, `behind_bytes` (0: none).
// `q_travels`: lv_xattn (queries travel), else ring (keys travel). Across nodes (double_ring),
// the double ring's rounds: each node cycle of L rounds is followed, when there are
// accumulators, by an idle round for their intra-node trip home; inter-node messages span the
// cycle they overlap.
PassSchedule ring_schedule(const Layout& layout, int rank, bool q_travels,
                           const std::string& ahead_what, int64_t ahead_bytes,
                           const std::string& behind_what, int64_t behind_bytes,
                           int64_t node_size = 0);

}  // namespace lvx::attention
