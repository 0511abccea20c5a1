// Distributed attention as an autograd function: o = dist_attention(q, k, v, …) on this rank's
// shards, differentiable with respect to q, k and v through the strategy's own backward (which
// communicates). What is saved for backward: the local shards q, k, v, the fp32 output and lse
// (never the S_Q × S_KV scores). A model that recomputes K/V from shared visual features
// (LV-XAttn §3.2) calls this with k, v computed inside its own checkpointed region.
#pragma once

#include <ATen/ATen.h>

#include <memory>

#include "src/attention/strategy.h"

namespace lvx::attention {

struct DistAttentionResult {
  at::Tensor o;    // [B, Sq_r, Hq, D] in q's dtype, part of the autograd graph
  at::Tensor lse;  // [B, Hq, Sq_r] fp32, no gradient
};

// q [B, Sq_r, Hq, D], k/v [B, Skv_r, Hkv, D]: this rank's shards in the strategy's layouts.
// q_media / kv_media: global int32 metadata for media masks (undefined otherwise).
DistAttentionResult dist_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   std::shared_ptr<dist::ProcessGroup> pg, StrategyKind kind,
                                   const AttentionSpec& spec, const at::Tensor& q_media = {},
                                   const at::Tensor& kv_media = {});

}  // namespace lvx::attention
