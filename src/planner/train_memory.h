// The whole memory of one rank in `lvx finetune`: weights, gradients, optimizer state, saved
// activations, the attention working set and the visual features, for a shard stage (ZeRO,
// "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models"), a sequence-parallel
// group size, LoRA ("LoRA: Low-Rank Adaptation of Large Language Models") and the activation
// savers (LV-XAttn §3.2 K/V recomputation, DistFlashAttn §3.3 rematerialization). Pure arithmetic
// over parameter counts and shapes; docs/finetune.md states each term.
//
// The model follows what the runtime holds (src/runtime/finetune_job.cpp, sharded_state.h), with
// e bytes per parameter/activation element (the model dtype), Ψ parameters, Ψt trainable ones,
// n ranks (state sharded over all of them), S ranks per sequence-parallel group, A samples per
// rank per step:
//   weights     e·Ψ (LoRA: the frozen base, and the adapter's Ψt in fp32); stage parameters:
//               e·(Ψ−Ψt−Ψf) + e·(Ψr + b2) + e·Ψf/n + e·2·f_max, with Ψr the trainable
//               parameters outside the decoder layers (the root unit, gathered for the whole
//               sample), b2 = min(2·block, Ψt − Ψr) (the running layer and the next one, or
//               the last layer kept for the backward), Ψf the decoder layers' frozen
//               parameters (a LoRA run's whole base in the layers) sharded 1/n, of which two
//               layers (f_max the largest's) are whole at a time, src/runtime/layer_sharding.h
//   optimizer   12·Ψt fp32 masters and two moments; /n from stage optimizer on
//   gradients   the larger of two moments of a step (the parameters' .grad are views of one
//               flat buffer of e·Ψt, plus its fp32 copy when e != 4: "conv"):
//                 reduction  none: e·Ψt + conv + 4·Ψt/n (the ring's receive buffer, n > 1)
//                            (+4·Ψt accumulator when A > 1); optimizer: e·Ψt + conv (+4·Ψt)
//                            + 4·Ψt/n (the shard, copied out of the flat buffer);
//                            gradients and parameters (layer by layer): e·(Ψr + b2) (the
//                            gradient buffers of the root and of the layers in their backward)
//                            + conv_u + 4·Ψt/n, conv_u = 4·max(Ψr, block) when e != 4 (a unit's
//                            fp32 copy while it is reduced)
//                 update     none: 4·Ψt; optimizer: 4·Ψt/n + e·Ψt gathered; gradients and
//                            parameters: 8·Ψt/n (the gradient shard and AdamW's denominator),
//                            stage 2 then e·max(Ψr, block) (the new values gathered a unit's run
//                            at a time, the shard released)
//   activations saved for the backward, per LM block and text token on this rank (L/S):
//               (4h + 4m)·e (norms, residuals, MLP), remat: h·e (the block input only); per
//               attention layer q, k, v, o and lse; per cross layer x, o, lse and, without
//               recompute, its K/V of this rank's visual tokens; logits (e + 8)·V per token;
//               LoRA (on the activation path, no W_eff): r·e per token per adapted
//               projection (x·Aᵀ), and A, B cast to the compute dtype when e != 4
//   attention   the largest layer's working set: its K/V blocks in flight (two ring buffers) and
//               the fp32 output/gradient accumulators of its queries
//   visual      this rank's visual features y (F·T/S tokens × feature width), kept once, and the
//               vision tower's transient while encoding them (2 hidden + MLP width per token)
// peak = weights + optimizer + activations + attention + visual + gradients (activation memory
// freed in the backward stays with the allocator, glibc's heap or the CUDA caching allocator)
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

#include "src/planner/model_yaml.h"

namespace lvx::planner {

// Parameter counts of a model: exact for a checkpoint directory (runtime::count_parameters),
// estimated from the shapes of a YAML config otherwise (estimate_parameters).
struct ParamCounts {
  int64_t total = 0;
  int64_t trainable = 0;  // under the freeze policy (LoRA: the adapters only)
  int64_t vocab = 0;      // rows of the output projection (logits per token)
  int64_t max_block = 0;  // trainable parameters of the largest decoder layer
  int64_t root = 0;       // trainable parameters outside the decoder layers (embeddings, head, …)
  int64_t layers = 0;     // every parameter of the decoder layers, trainable or not
  int64_t max_layer = 0;  // every parameter of the largest decoder layer
  bool exact = false;
};

// From the shapes: Qwen2-style blocks (q/k/v/o with biases, a gated MLP, two norms), cross
// layers' K/V projections of the visual width, the vision tower, embeddings and an untied head
// of `vocab_size` rows. freeze: vision (all but the vision tower) | cross_only | none.
ParamCounts estimate_parameters(const ModelConfig& m, int64_t vocab_size,
                                const std::string& freeze);
// LoRA adapters of rank r on every projection of every LM block (q, k, v, o, gate, up, down):
// r·(in + out) each.
int64_t lora_parameters(const ModelConfig& m, int64_t r);
// The projections LoRA adapts in each LM block (q, k, v, o, gate, up, down).
constexpr int64_t kLoraProjectionsPerBlock = 7;

struct TrainMemoryOptions {
  std::string shard = "none";  // none | optimizer | gradients | parameters
  int64_t ranks = 1;           // n: the world
  int64_t sp_size = 0;         // S (0: n)
  int64_t lora_r = 0;
  bool recompute = false;
  bool remat = false;
  int64_t grad_accum = 1;
  int64_t elem_bytes = 2;  // e: the model dtype's
  // Device memory the model above does not see and a run cannot use: the CUDA context and the
  // kernels' modules, NCCL's buffers, the caching allocator's fragmentation. A peak fits when it
  // is at most the device less this. Negative: default_reserve_bytes(device).
  double reserve_bytes = -1;
};

// The default reserve: 1.5 GiB (the CUDA context with libtorch's kernels loaded, about 0.5-1 GiB,
// and NCCL's buffers, a few hundred MiB for a few communicators) plus 8 % of the device (the
// caching allocator's fragmentation, typically 5-10 % of what it holds). 0 for no device.
double default_reserve_bytes(double device_bytes);

struct TrainMemory {
  double weights = 0, gradients = 0, optimizer = 0, activations = 0, attention = 0, visual = 0;
  double total = 0;  // the peak, as above
  double device = 0;
  double reserve = 0;  // of the device, unusable (TrainMemoryOptions::reserve_bytes)
  bool fits = true;
};

// Per-rank memory for frames × tokens_per_frame visual tokens and text_tokens of text.
TrainMemory train_memory(const ModelConfig& m, const ParamCounts& params, int64_t frames,
                         int64_t text_tokens, int64_t tokens_per_frame, const TrainMemoryOptions& o,
                         double device_bytes);

nlohmann::json to_json(const TrainMemory& t);
std::string format_memory(const TrainMemory& t);

}  // namespace lvx::planner
