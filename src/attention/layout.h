// How a sequence of tokens is split across ranks.
//   contiguous: rank r holds tokens [off_r, off_r + n_r), n_r = ⌊S/W⌋ + (r < S mod W) — lengths
//               that do not divide by W are fine, and S < W leaves some ranks empty.
//   striped:    rank r holds tokens r, r + W, r + 2W, … (Striped Attention, Brandon et al. §3:
//               the permutation is applied once to tokens, positions and targets; causal work is
//               then balanced on every ring round).
// With unit > 1 both split whole blocks of `unit` tokens instead of tokens (e.g. the visual tokens
// of one image, so that each rank encodes whole frames); total must be a multiple of unit.
// Positions are global token indices; the attention mask is expressed through them.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <vector>

namespace lvx::attention {

enum class LayoutKind { kContiguous, kStriped };

struct Layout {
  LayoutKind kind = LayoutKind::kContiguous;
  int64_t total = 0;  // global sequence length
  int world = 1;
  int64_t unit = 1;  // tokens per indivisible block

  int64_t local_size(int rank) const;
  std::vector<int64_t> sizes() const;  // local_size of every rank
  at::Tensor positions(int rank) const;  // int64 [local_size]: global index of each local token
  // Slices `global` (token dimension `dim`) to rank's tokens.
  at::Tensor shard(const at::Tensor& global, int64_t dim, int rank) const;
  // Inverse of shard over all ranks: shards[r] → one tensor in global token order.
  at::Tensor unshard(const std::vector<at::Tensor>& shards, int64_t dim) const;
  // Every rank's positions concatenated in rank order (the order collectives gather shards in).
  at::Tensor gathered_positions() const;
};

}  // namespace lvx::attention
