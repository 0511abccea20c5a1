// The training step shared by `lvx forward --backward` and `lvx finetune`: one implementation of
// the loss, its backward and the cross-rank gradient sum (the per-layer strategies come from
// src/runtime/layer_plan.h).
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "models/model.h"
#include "src/dist/process_group.h"

namespace lvx::runtime {

// Which parameters receive gradients (by checkpoint name).
using ParamFilter = std::function<bool(const std::string&)>;

// The backward of one sample without the cross-rank gradient sum (sharded training state and
// data-parallel groups reduce over another group, src/runtime/sharded_state.h): "loss", the mean
// cross-entropy over `pg`'s labels (reduced over `pg` only), and this rank's own gradients of the
// parameters `names` (in that order, one dtype) as one flat fp32 vector. The parameters' .grad
// are views of that one zeroed buffer while the backward runs (autograd accumulates into them in
// place, 0 + g = g exactly), so gradients are held once, already flat; .grad is undefined after.
// No `names`: only the loss and its backward (ZeRO stages 2 and 3 take the gradients layer by
// layer in hooks, src/runtime/layer_sharding.h); flat stays undefined.
struct LocalBackward {
  at::Tensor loss;  // float32 scalar
  at::Tensor flat;  // float32 [Σ numel(names)], not reduced across ranks
};
LocalBackward backward_local(dist::ProcessGroup& pg, models::Model& model,
                             const at::Tensor& all_labels, const models::ModelOutputs& out,
                             const std::vector<std::string>& names);

// The loss backward_local reports, without a backward (evaluation): the mean cross-entropy over
// every rank's labels != −100, identical on every rank. Collective.
double mean_loss(dist::ProcessGroup& pg, const at::Tensor& all_labels,
                 const models::ModelOutputs& out);

// Mean cross-entropy over every rank's labels != −100 (labels int64 [B, L], global, not shifted:
// position t's logits predict labels[t]), its backward, and the gradients of the parameters
// `trains` selects (default: model.trainable) summed across ranks in one flat all-reduce. Returns
// "loss" (float32 scalar) and "grad.<name>" (float32), identical on every rank. Every rank must
// call it (collectives). Parameters that got no gradient here contribute zeros.
std::map<std::string, at::Tensor> backward_step(dist::ProcessGroup& pg, models::Model& model,
                                                const at::Tensor& all_labels,
                                                const models::ModelOutputs& out,
                                                const ParamFilter& trains = nullptr);

}  // namespace lvx::runtime
