// How a model runs across the ranks of a process group (sequence parallelism):
//   - text: every rank holds the tokens of `text_layout` (contiguous, or striped when the plan
//     runs striped ring attention) for every layer; norms, MLPs and projections run on that
//     shard;
//   - frames: the visual keys are split in whole images (attention::AttentionSpec::kv_unit)
//     striped across the ranks (media_layout: rank r holds images r, r + n, r + 2n, …), so each
//     rank decodes, encodes and projects only its own frames and keeps those visual tokens for
//     every cross layer; they are never gathered. Striped, not contiguous: under every family's
//     rule a text token sees the images before it (or its latest one), so with a contiguous
//     split the rank holding the first frames serves nearly every query and the last rank far
//     fewer (the busiest rank did 1.31x the average cross-attention work in LV-XAttn's headline
//     configuration); striped, each rank's keys are seen by about as many queries as any other's;
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
  // A rows step (Model::extend_rows: lvx serve's continuous batching) runs each layer's
  // independent attention calls on two host threads (models/side_by_side.h): the visual keys'
  // beside the prompt's and the rows' own keys'. lvx serve --step-overlap; off elsewhere.
  bool side_by_side = false;
  // The most prompt-key elements (rows × P × Hkv × D, per layer) that the rows of a batched step
  // keep in their key pool's slots, so that their own keys' product reads them too
  // (models/decode.h prompt_front; one rank only). Above it, or at 0, one attention call over the
  // videos' stacked prompt keys and a merge instead.
  int64_t prompt_front_elements = int64_t{1} << 20;

  // Decode steps of a generation stepped alone run on rank 0 (models/lead_decode.h): the other
  // ranks answer only at the cross layers. Set by lvx qa / forward --generate (--decode-ranks
  // one, the default), never by lvx serve's rows. lead_threads > 0: rank 0's intra-op threads
  // for those steps (the cores of every local rank), restored after each.
  bool lead_decode = false;
  int lead_threads = 0;
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

// The media keys' layout: `slots` images of `tokens_per_media` keys per sample, whole images
// striped across `world` ranks (rank r holds slots r, r + world, …). The one rule of the model's
// cross-attention specs, of the frames each rank decodes (video::ShardSpec) and of the planner's
// pricing.
attention::Layout media_layout(int64_t slots, int64_t tokens_per_media, int world);
// The image slots (ascending) that rank `rank` of `world` holds under media_layout.
std::vector<int64_t> media_slots(int64_t slots, int rank, int world);

// This rank's share of the media: whole image slots `slots` (media_slots) of every sample's key
// sequence, encoded here and nowhere else.
struct LocalMedia {
  at::Tensor features;         // [B, slots · tokens_per_media, width]; zero for absent slots
  std::vector<int64_t> slots;  // global slot indices, ascending
  // Host int64 indices of these slots ([S_r]) and of their keys ([S_r · tokens_per_media]), for
  // selecting this rank's part of per-slot and per-key tensors.
  at::Tensor slot_index() const;
  at::Tensor key_index(int64_t tokens_per_media) const;
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
// striped choice (of a self or a cross layer) makes the whole text striped, and is then ring
// attention over that layout (Striped Attention is ring attention over striped tokens; a cross
// layer's keys are striped whole images in any case). Every other strategy takes the layout from
// the attention spec.
Parallel resolve_layouts(Parallel p);

}  // namespace lvx::models
