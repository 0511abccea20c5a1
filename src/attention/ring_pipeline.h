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
  const char* ahead_what = "";  // names for errors and logs, e.g. "ring forward K/V"
  const char* behind_what = "";
  // compute(owner, block): this rank's work on the travelling block of `owner`; returns its
  // contribution to that block's accumulators (empty: the pass has none).
  std::function<BlockTensors(int owner, const BlockTensors& block)> compute;
  // combine(mine, arrived): folds the accumulators that arrived from prev into mine, in place.
  std::function<void(BlockTensors& mine, const BlockTensors& arrived)> combine;
};

// Runs the pass with `travelling` (this rank's own block, token lengths per `layout`). Returns
// this rank's own block's accumulators after their last hop (empty when the pass has none).
BlockTensors ring_pipeline(dist::ProcessGroup& pg, const Layout& layout, BlockTensors travelling,
                           const RingPass& pass);

// The schedule of ring_pipeline on `rank`: round t computes (stationary, owner (rank − t) mod n);
// the ahead block of the next owner goes out in round t < n−1, and the accumulators of round t's
// block in round t+1. Bytes per token of a block: `ahead_bytes`, `behind_bytes` (0: none).
// `q_travels`: lv_xattn (queries travel), else ring (keys travel).
PassSchedule ring_schedule(const Layout& layout, int rank, bool q_travels,
                           const std::string& ahead_what, int64_t ahead_bytes,
                           const std::string& behind_what, int64_t behind_bytes);

}  // namespace lvx::attention
