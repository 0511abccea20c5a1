// Sharded training state for `lvx finetune` (parallel.shard), after "ZeRO: Memory Optimizations
// Toward Training Trillion Parameter Models" (Rajbhandari et al., 2020), stages 1 to 3:
//   none       every rank keeps the fp32 gradients, masters and both AdamW moments of every
//              trainable parameter and all-reduces the gradients of each sample (AdamW,
//              optimizer.h);
//   optimizer  (stage 1) each rank keeps the masters and moments of its shard only; the fp32
//              gradients are summed locally over the step's samples and reduce-scattered once per
//              step; after its update each rank's shard of the parameters is all-gathered;
//   gradients  (stage 2) as optimizer, but each sample's gradients are reduce-scattered at once
//              and only this rank's shard is kept (accumulated) across the step's samples;
//   parameters (stage 3, FSDP's FULL_SHARD) as gradients, but the parameters too are kept only as
//              this rank's masters: each decoder layer's are gathered just before it runs and
//              freed after it, gathered again when the backward reaches it, and its gradients
//              reduce-scattered as soon as they are complete (src/runtime/layer_sharding.h).
// The trainable parameters form one flat fp32 vector in name order (FlatLayout); rank r of w owns
// elements dist::shard_range(numel, w, r). Bytes each rank sends per optimizer step, for Ψ
// trainable elements, n ranks, A samples per rank per step, s_p bytes per parameter element:
//   none       A · 2(n−1)/n · 4Ψ           (ring all-reduce of fp32 gradients per sample)
//   optimizer  (n−1)/n · 4Ψ + (n−1)/n · s_pΨ   (one reduce-scatter, one parameter all-gather)
//   gradients  A · (n−1)/n · 4Ψ + (n−1)/n · s_pΨ
//   parameters A · ((n−1)/n · 4Ψ + (n−1)/n · s_p(2Ψ − Ψ_last))
//              (per sample, every unit gathered for the forward and, but for the last layer,
//              which stays, again for the backward; Ψ_last its elements; no gather after the
//              update)
// (plus a few scalars: the loss, the label count and the gradient norm). These are the ring's
// volumes. On Gloo they are the volumes sent (lvx's rings for reduce_scatter and all_gather); NCCL's
// own collectives (src/dist/collectives.cpp) pad shard_range's chunks (at most one element apart)
// to the largest, and gather a layer's run that lies in one or two ranks' shards as a broadcast
// from each owner (its bytes then follow NCCL's chain, process_group.h). Each stage computes
// the same update as `none` elementwise; only the gradient sums (order of additions across ranks
// and samples) and the global norm (the shards' fp32 norms squared and summed in fp64, instead of
// a norm of per-tensor fp32 norms) round differently, so parameters agree with `none` to fp32
// rounding, not bitwise.
//
// Checkpoints: the weights stay one consolidated model.safetensors (parameters are whole on every
// rank after the all-gather); the optimizer state is written by every rank beside it as
// optimizer-RRRRR-of-NNNNN.safetensors (tensors master, exp_avg, exp_avg_sq: the rank's slice;
// metadata begin/end/numel), with the layout in trainer_state.json. Loading takes any rank's
// slice [begin, end) from the files of any world size, or from the consolidated
// optimizer.safetensors of a `none` run, so --resume re-shards when the rank count changes.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "src/dist/process_group.h"
#include "src/runtime/train_config.h"

namespace lvx::runtime {

enum class ShardStage { kNone, kOptimizer, kGradients, kParameters };
// "none" | "optimizer" | "gradients" | "parameters"; errors name `field`.
ShardStage shard_stage_from_string(const std::string& s, const std::string& field);
const char* shard_stage_name(ShardStage s);

// The trainable parameters as one flat vector: names in map order, offsets[i] the first element
// of names[i], offsets.back() the total.
struct FlatLayout {
  std::vector<std::string> names;
  std::vector<int64_t> offsets{0};
  int64_t numel() const { return offsets.back(); }
  nlohmann::json to_json() const;  // [[name, numel], ...]
  static FlatLayout from_json(const nlohmann::json& j, const std::string& where);
  bool operator==(const FlatLayout& o) const { return names == o.names && offsets == o.offsets; }
};
FlatLayout flat_layout(const std::map<std::string, at::Tensor>& trainable);

// The elements [begin, end) of the flat vector of `params` (by layout), as fp32.
at::Tensor flat_slice(const std::map<std::string, at::Tensor>& params, const FlatLayout& layout,
                      int64_t begin, int64_t end);

// AdamW over this rank's shard [begin, end) of the flat vector, same arithmetic per element as
// AdamW::step (optimizer.h).
class ShardedAdamW {
 public:
  ShardedAdamW(TrainConfig::Optimizer opt, TrainConfig::Schedule schedule, FlatLayout layout,
               int world, int rank);
  int64_t begin() const { return begin_; }
  int64_t end() const { return end_; }
  const FlatLayout& layout() const { return layout_; }

  // fp32 masters of this rank's slice of `params`, zero moments.
  void init(const std::map<std::string, at::Tensor>& params);
  // The same from `read(name)`, each parameter whole in its dtype, asked for one at a time and
  // only for the names this rank's slice overlaps (stage 3 never holds the parameters whole);
  // no `read`: zeros, for load() to fill.
  void init(const std::function<at::Tensor(const std::string&)>& read, const at::Device& device);
  // One step with this rank's shard of the summed, averaged fp32 gradients (clipped here by the
  // global norm, one all-reduce over `pg`), then the updated parameters all-gathered into
  // `params` (cast to their dtype; null for stage 3, which gathers them layer by layer from the
  // masters). Returns the pre-clip norm; a non-finite one throws NonFiniteGradient on every rank
  // before anything changes. Collective over `pg`.
  double step(dist::ProcessGroup& pg, at::Tensor grad_shard,
              std::map<std::string, at::Tensor>* params);
  // This rank's fp32 masters: the flat elements [begin(), end()).
  const at::Tensor& master() const { return master_; }
  // The first parameter (by name) with a non-finite master element on any rank, "" when none.
  // Collective.
  std::string non_finite_master(dist::ProcessGroup& pg) const;
  int64_t steps_done() const { return step_; }
  double last_lr() const { return last_lr_; }

  // master, exp_avg, exp_avg_sq: this rank's slices.
  std::map<std::string, at::Tensor> state_tensors() const;
  // This rank's slice from checkpoint `ckpt` (shard files of any world size, or the
  // consolidated optimizer.safetensors), written with layout `saved`.
  void load(const std::string& ckpt, const FlatLayout& saved, int64_t step);

 private:
  TrainConfig::Optimizer opt_;
  TrainConfig::Schedule schedule_;
  FlatLayout layout_;
  int world_, rank_;
  int64_t begin_ = 0, end_ = 0;
  at::Tensor master_, exp_avg_, exp_avg_sq_;
  int64_t step_ = 0;
  double last_lr_ = 0;
};

// Reduces `part`, this rank's fp32 gradients of the flat elements [offset, offset + part.numel())
// of a layout of `numel` elements, over `pg` onto the ranks whose shards overlap them (one
// reduce_scatter with those splits, `part` its scratch) and adds this rank's piece into `shard`,
// its elements [shard_begin, …). Collective over `pg`; stage 2's buckets and stage 3's layers.
void reduce_into_shard(dist::ProcessGroup& pg, int64_t numel, int64_t offset, at::Tensor& part,
                       at::Tensor& shard, int64_t shard_begin);

// "optimizer-00001-of-00004.safetensors".
std::string optimizer_shard_name(int rank, int world);
// Writes this rank's slice as optimizer_shard_name(rank, world) into `dir` (fsynced).
void save_optimizer_shard(const std::string& dir, const ShardedAdamW& opt, int world, int rank,
                          int64_t step);

// The flat fp32 optimizer state [begin, end) of checkpoint `ckpt` (tensors master, exp_avg,
// exp_avg_sq), from its shard files (trainer_state.json optimizer.world_size) or from its
// consolidated optimizer.safetensors (per-parameter master.<name>, ...), checked against `layout`.
std::map<std::string, at::Tensor> load_flat_optimizer_state(const std::string& ckpt,
                                                            const FlatLayout& layout, int64_t begin,
                                                            int64_t end);

}  // namespace lvx::runtime
