// Cross-attention with K/V recomputed in the backward (LV-XAttn, Chang & Venkataraman, ICML'25,
// §3.2): every cross-attention layer projects its K/V from the same visual features y, which a
// rank keeps once for all layers. In training this layer then saves only its queries' input,
// its output and the lse (plus references to y and the projection's parameters, which exist
// anyway); its backward recomputes K and V from y, runs the distributed attention backward, and
// differentiates the projection. Without it every cross layer keeps its own K/V (|K| + |V| per
// layer, the largest activations of a long video) until the backward.
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "src/attention/dist_attention.h"

namespace lvx::models {

// K and V ([B, S_r, Hkv, D]) of one layer from the visual features y and the parameters
// `params` (those it differentiates: norm and projection weights).
using KVFunction = std::function<std::pair<at::Tensor, at::Tensor>(
    const at::Tensor& y, const std::vector<at::Tensor>& params)>;

// dist_attention(q, kv(y, params)…) whose backward recomputes K/V. The forward strategy's saved
// form must be attention::SavedForm::kShards (lv_xattn, ring, striped): they save only the local
// shards, which is what makes recomputation possible. Gradients flow to q, y and params.
attention::DistAttentionResult cross_attention_recompute(
    const at::Tensor& q, const at::Tensor& y, const std::vector<at::Tensor>& params, KVFunction kv,
    std::shared_ptr<dist::ProcessGroup> pg, attention::StrategyChoice choice,
    const attention::AttentionSpec& spec, const attention::MaskInputs& mask);

// Rematerialization-aware checkpointing (DistFlashAttn, Li et al., §3.3): a segment of local
// work (here: a block's output projection, residual, norm and MLP) runs without keeping its
// intermediates and is recomputed in the backward. The checkpoint boundary sits at the attention
// output, so the backward never reruns a distributed attention (whose forward costs
// communication): the attention's own saved state (q, k, v, o, lse) is its boundary.
// `fn` maps (inputs, params) to outputs; gradients flow to inputs and params.
using SegmentFunction = std::function<std::vector<at::Tensor>(
    const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& params)>;
std::vector<at::Tensor> checkpoint_segment(SegmentFunction fn,
                                           const std::vector<at::Tensor>& inputs,
                                           const std::vector<at::Tensor>& params);

}  // namespace lvx::models
