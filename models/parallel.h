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

#include <ATen/ATen.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "src/attention/layout.h"
#include "src/attention/media_mask.h"
#include "src/attention/strategy.h"
#include "src/dist/process_group.h"

namespace lvx::models {

// The strategies of one decoder layer (cross is used by layers that have a cross-attention).
struct LayerStrategies {
  attention::StrategyChoice self{attention::StrategyKind::kRing};
  attention::StrategyChoice cross{attention::StrategyKind::kLvXAttn};
};

// What runs around each decoder layer. Every family's decoder loop calls enter_layer(i, hidden)
// before layer i (hidden: its input) and leave_layers(hidden) after the last one (hidden: the
// last layer's output), also for a layer it then skips. ZeRO stage 3 (src/runtime/
// layer_sharding.h) gathers a layer's parameters there, frees the previous layer's, and hooks the
// hidden states' gradients to gather them again for the backward.
class LayerHooks {
 public:
  virtual ~LayerHooks() = default;
  virtual void enter_layer(int64_t layer, const at::Tensor& hidden) = 0;
  virtual void leave_layers(const at::Tensor& hidden) = 0;
};

struct Parallel {
  std::shared_ptr<dist::ProcessGroup> pg;  // world 1 for a single process
  attention::LayoutKind text_layout = attention::LayoutKind::kContiguous;
  std::vector<LayerStrategies> layers;  // per decoder layer; empty: the defaults above
  // Runs the backward of K/V projections of cross layers by recomputing them from the shared
  // visual features (LV-XAttn §3.2) instead of keeping each layer's K/V.
  bool recompute_cross_kv = false;
  // Rematerialization-aware checkpointing of the decoder blocks (DistFlashAttn §3.3): each
  // block's output projection, residual, norm and MLP are recomputed in the backward from the
  // block input and the attention output, which the attention keeps anyway.
  bool remat = false;

  LayerHooks* hooks = nullptr;  // null: nothing runs around the layers

  void enter_layer(int64_t layer, const at::Tensor& hidden) const {
    if (hooks != nullptr) hooks->enter_layer(layer, hidden);
  }
  void leave_layers(const at::Tensor& hidden) const {
    if (hooks != nullptr) hooks->leave_layers(hidden);
  }
  int world() const { return pg->world_size(); }
  int rank() const { return pg->rank(); }
  const LayerStrategies& at(size_t layer) const {
    static const LayerStrategies defaults;
    return layer < layers.size() ? layers[layer] : defaults;
  }
};

// This rank's share of the media: whole image slots [first_slot, first_slot + slots) of every
// sample's key sequence (the key layout is contiguous in units of tokens_per_media), encoded
// here and nowhere else.
struct LocalMedia {
  at::Tensor features;  // [B, slots · tokens_per_media, width]; zero for slots a sample lacks
  int64_t first_slot = 0, slots = 0;
};

// Picks this rank's images out of pixel_values (every image of the batch, in prompt order:
// sample 0's, then sample 1's, …; their number must equal the media tokens of input_ids, as `mm`
// counts them; with `local`, only this rank's images, in the same order), runs `encode`
// ([n, C, H, W] → [n, tokens_per_media, width]) on them only, and places them in their slots.
// Errors name the counts that disagree.
//
// `media` (ModelInputs::media, the visual cache of lvx serve): null, encode as above; holding
// features, those are this rank's share already encoded (their slots must be the layout's) and
// are returned as they are: nothing is encoded and pixel_values is not read; empty, encode and
// also leave the result in it.
LocalMedia encode_local_media(const attention::MediaMask& mm, const at::Tensor& pixel_values,
                              bool local, const Parallel& par, int64_t width,
                              const std::function<at::Tensor(const at::Tensor&)>& encode,
                              const at::TensorOptions& options, const std::string& model,
                              LocalMedia* media = nullptr);

// This rank's text: the global index of each of its tokens ([L_r]; `positions` on the
// embedding's device, `host_positions` on the host) and their embeddings ([B, L_r, width]).
// Checks input_ids (int64 [B, L]), naming `model`.
struct TextShard {
  at::Tensor positions, hidden, host_positions;
};
TextShard embed_text_shard(const at::Tensor& input_ids, const at::Tensor& embedding,
                           const Parallel& par, const std::string& model);

// The media layout is computed on the host from host_ids(input_ids) (it decides which rank
// encodes which image, with host reads); media_mask_on moves its tensors to the device where they
// meet activations (the attention's mask inputs, MI-RoPE positions, gates).
at::Tensor host_ids(const at::Tensor& input_ids);
attention::MediaMask media_mask_on(const attention::MediaMask& mm, at::Device device);

// The causal self-attention over the text, in the text layout.
attention::AttentionSpec self_attention_spec(int64_t batch, int64_t length, int64_t heads,
                                             int64_t kv_heads, int64_t head_dim,
                                             const Parallel& par);
// A cross-attention of the text to the media keys of `mm` (whole images of tokens_per_media
// keys, contiguous), under mm's rule.
attention::AttentionSpec cross_attention_spec(int64_t batch, int64_t length, int64_t heads,
                                              int64_t kv_heads, int64_t head_dim,
                                              const attention::MediaMask& mm, const Parallel& par);

// The text layout a set of per-layer choices runs on, and the choices as they run on it: a
// striped self-attention choice makes the whole text striped, and is then ring attention over
// that layout (Striped Attention is ring attention over striped tokens). Every other strategy
// takes the layout from the attention spec.
Parallel resolve_layouts(Parallel p);

}  // namespace lvx::models
