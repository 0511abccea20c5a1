// Distributed attention as an autograd function: o = dist_attention(q, k, v, …) on this rank's
// shards, differentiable with respect to q, k and v through the strategies' own backward (which
// communicates). Strategies are stateless: what the backward needs is the forward strategy's
// SavedState (for ring strategies the local shards q, k, v, the output and lse; never the
// S_Q × S_KV scores), saved once in the autograd context, so any number of calls (one per layer)
// may run their forwards before their backwards, in any order. A model that recomputes K/V from
// shared visual features (LV-XAttn §3.2) calls this with k, v computed inside its own
// checkpointed region.
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <string>

#include "src/attention/strategy.h"

namespace lvx::attention {

struct DistAttentionResult {
  at::Tensor o;    // [B, Sq_r, Hq, D] in q's dtype, part of the autograd graph (0 where no key)
  at::Tensor lse;  // [B, Hq, Sq_r] accumulation dtype (fp32; fp64 for fp64), differentiable (for
                   // merging partial results by lse);
                   // −inf where the row sees no key (has_keys)
};

// One call's strategies and spec, checked for this rank of `pg`: the backward can start from the
// forward's state, both strategies support the spec on pg's ranks, this rank's q and k shards
// hold the tokens the forward's layouts give it (check_local_shards, messages starting with
// `where`), and node_size comes from the launcher (with_topology). dist_attention and the Python
// operators (python/csrc/ops.cpp) both start here.
struct PreparedCall {
  std::unique_ptr<Strategy> forward, backward;
  AttentionSpec spec;
};
PreparedCall prepare_call(const std::string& where, const dist::ProcessGroup& pg,
                          StrategyChoice choice, const AttentionSpec& spec, const at::Tensor& q,
                          const at::Tensor& k);

// q [B, Sq_r, Hq, D], k/v [B, Skv_r, Hkv, D]: this rank's shards in the strategies' layouts.
// `choice`: one strategy, or a forward+backward pair (can_pair). `mask`: global metadata
// (q_media / kv_media for media masks, kv_valid for padding); shapes are checked by the kernels.
DistAttentionResult dist_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   std::shared_ptr<dist::ProcessGroup> pg, StrategyChoice choice,
                                   const AttentionSpec& spec, const MaskInputs& mask = {});

}  // namespace lvx::attention
