// AdamW for fine-tuning, in ATen: fp32 master weights and moments whatever the model's compute
// dtype (bf16 parameters are refreshed from the masters after each step), a linear warm-up then
// cosine decay of the learning rate, and clipping by the global L2 norm of the gradients. The
// arithmetic follows torch.optim.AdamW (single-tensor path, decoupled weight decay) and
// torch.nn.utils.clip_grad_norm_ operation by operation, so results agree with PyTorch to
// rounding (tests/test_runtime_finetune.cpp checks it against PyTorch itself).
#pragma once

#include <ATen/ATen.h>

#include <map>
#include <string>

#include "src/common/error.h"
#include "src/runtime/train_config.h"

namespace lvx::runtime {

// The learning rate of optimizer step `step` (0-based): lr · (step + 1) / warmup_steps during the
// warm-up, then min_lr + (lr − min_lr) · (1 + cos(π · t)) / 2 with
// t = (step − warmup_steps) / max(1, steps − warmup_steps).
double learning_rate(const TrainConfig::Optimizer& o, const TrainConfig::Schedule& s, int64_t step);

// Scales `grads` in place so their global L2 norm is at most max_norm (as clip_grad_norm_: by
// max_norm / (norm + 1e-6), clamped to 1). Returns the norm before clipping. max_norm <= 0:
// only measures.
double clip_grad_norm(std::map<std::string, at::Tensor>& grads, double max_norm);

// AdamW's update of one fp32 tensor in place (torch.optim.AdamW's single-tensor path: decoupled
// weight decay, then the moments, then the bias-corrected step), with `g` already clipped, at
// learning rate `lr`, `step` the 1-based count of this update. The one arithmetic of AdamW and
// ShardedAdamW (src/runtime/sharded_state.h): whole tensors or a rank's flat shard, element for
// element the same operations.
void adamw_update(at::Tensor& master, at::Tensor& exp_avg, at::Tensor& exp_avg_sq,
                  const at::Tensor& g, const TrainConfig::Optimizer& o, double lr, int64_t step);

// A gradient norm that is not finite: AdamW::step throws it before changing anything.
class NonFiniteGradient : public Error {
 public:
  using Error::Error;
};

class AdamW {
 public:
  AdamW(TrainConfig::Optimizer opt, TrainConfig::Schedule schedule);

  // Takes fp32 masters of `params` (by name; the trainable ones) and zero moments.
  void init(const std::map<std::string, at::Tensor>& params);

  // One step with `grads` (fp32, by the same names; clipped here in place): updates the masters
  // and copies them into `params` (cast to their dtype). Returns the pre-clip gradient norm. A
  // non-finite norm throws NonFiniteGradient before anything changes.
  double step(std::map<std::string, at::Tensor>& grads, std::map<std::string, at::Tensor>& params);

  int64_t steps_done() const { return step_; }
  // The first master weight (by name) with a NaN or infinite element, "" when all are finite.
  std::string non_finite_master() const;
  double last_lr() const { return last_lr_; }

  // Masters, moments and the step count, as tensors (master.<n>, exp_avg.<n>, exp_avg_sq.<n>)
  // and metadata; load_state checks that the names match `init`'s, naming `where`.
  std::map<std::string, at::Tensor> state_tensors() const;
  void load_state(const std::map<std::string, at::Tensor>& tensors, int64_t step,
                  const std::string& where);

 private:
  TrainConfig::Optimizer opt_;
  TrainConfig::Schedule schedule_;
  std::map<std::string, at::Tensor> master_, exp_avg_, exp_avg_sq_;
  int64_t step_ = 0;
  double last_lr_ = 0;
};

}  // namespace lvx::runtime
