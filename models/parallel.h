// How a model runs across the ranks of a process group (sequence parallelism):
//   - text: every rank holds the tokens of `text_layout` (contiguous, or striped when the plan
//     runs striped ring attention) for every layer; norms, MLPs and projections run on that
//     shard;
//   - frames: the visual keys are split in whole images (attention::AttentionSpec::kv_unit), so
//     each rank decodes, encodes and projects only its own frames and keeps those visual tokens
//     for every cross layer; they are never gathered;
//   - attention layers run the strategy chosen for them (the planner's, or the user's), through
//     attention::dist_attention, forward and backward;
//   - gradients of the (replicated) parameters are summed across ranks after the backward.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "src/attention/layout.h"
#include "src/attention/strategy.h"
#include "src/dist/process_group.h"

namespace lvx::models {

// The strategies of one decoder layer (cross is used by layers that have a cross-attention).
struct LayerStrategies {
  attention::StrategyChoice self{attention::StrategyKind::kRing};
  attention::StrategyChoice cross{attention::StrategyKind::kLvXAttn};
};

struct Parallel {
  std::shared_ptr<dist::ProcessGroup> pg;  // world 1 for a single process
  attention::LayoutKind text_layout = attention::LayoutKind::kContiguous;
  std::vector<LayerStrategies> layers;  // per decoder layer; empty: the defaults above
  // Runs the backward of K/V projections of cross layers by recomputing them from the shared
  // visual features (LV-XAttn §3.2) instead of keeping each layer's K/V.
  bool recompute_cross_kv = false;

  int world() const { return pg->world_size(); }
  int rank() const { return pg->rank(); }
  const LayerStrategies& at(size_t layer) const {
    static const LayerStrategies defaults;
    return layer < layers.size() ? layers[layer] : defaults;
  }
};

// The text layout a set of per-layer choices runs on, and the choices as they run on it: a
// striped self-attention choice makes the whole text striped, and is then ring attention over
// that layout (Striped Attention is ring attention over striped tokens). Every other strategy
// takes the layout from the attention spec.
Parallel resolve_layouts(Parallel p);

}  // namespace lvx::models
