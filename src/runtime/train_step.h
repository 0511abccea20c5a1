// The training step shared by `lvx forward --backward` and `lvx finetune`: one implementation of
// the loss, its backward and the cross-rank gradient sum, and of how a job picks the per-layer
// attention strategies (explicit or the planner's).
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <map>
#include <string>

#include "models/model.h"
#include "src/dist/process_group.h"

namespace lvx::runtime {

// Which parameters receive gradients (by checkpoint name).
using ParamFilter = std::function<bool(const std::string&)>;

// Mean cross-entropy over every rank's labels != −100 (labels int64 [B, L], global, not shifted:
// position t's logits predict labels[t]), its backward, and the gradients of the parameters
// `trains` selects (default: model.trainable) summed across ranks in one flat all-reduce. Returns
// "loss" (float32 scalar) and "grad.<name>" (float32), identical on every rank. Every rank must
// call it (collectives). Parameters that got no gradient here contribute zeros.
std::map<std::string, at::Tensor> backward_step(dist::ProcessGroup& pg, models::Model& model,
                                                const at::Tensor& all_labels,
                                                const models::ModelOutputs& out,
                                                const ParamFilter& trains = nullptr);

// --strategies "S" for every attention layer, or "S_cross,S_self"; S may be a pair F+B.
models::Parallel explicit_strategies(const std::string& spec, int64_t layers);

// "auto": the planner's per-layer choice for this prompt (its media marks and length) on the
// cluster config; without one, lv_xattn for cross layers and ring for self layers. *plan_text
// gets the plan's table.
models::Parallel planned_strategies(const std::string& cluster, const std::string& dtype,
                                    bool train, const models::Model& model,
                                    const at::Tensor& input_ids, int world, std::string* plan_text);

// One line per layer: the text layout and each layer's strategies (for agreement checks).
std::string describe(const models::Parallel& p);

}  // namespace lvx::runtime
