// Llama-3.2-Vision (Meta, "The Llama 3 Herd of Models", §7), transformers'
// MllamaForConditionalGeneration (model_type "mllama"), distributed as models/parallel.h
// describes:
//   tiled ViT + multi_modal_projector (models/mllama/vision.h) → visual tokens [images,
//   tiles·(patches+1), hidden]; a Llama decoder (RoPE with llama3 scaling, GQA, SwiGLU) whose
//   cross_attention_layers REPLACE a decoder layer by a gated cross-attention block:
//     h += tanh(cross_attn_attn_gate) · o_proj(attn(q_norm(q_proj(norm(h))), k_norm(k_proj(y)),
//          v_proj(y)))
//     h += tanh(cross_attn_mlp_gate) · sees_media · mlp(post_attention_layernorm(h))
//   under the processor's cross_attention_mask (models/mllama/mask.h: rows that see no tile
//   attend to every key, as transformers does, and their MLP branch is zeroed).
// The media unit of the key layout is one image (max_num_tiles · tokens_per_tile keys, padding
// tiles included); each rank encodes only the images whose keys it holds (every sample's slots
// of its share), and keeps those features once for all cross layers (LV-XAttn, "LV-XAttn:
// Distributed Cross-Attention for Long Visual Inputs in Multimodal Large Language Models", §3.2:
// with recompute_cross_kv each cross layer's K/V are recomputed from them in the backward).
//
// Inputs (ModelInputs):
//   - as MllamaProcessor gives them: pixel_values [B, images, tiles, 3, S, S] with named
//     aspect_ratio_ids int64 [B, images], aspect_ratio_mask int64 [B, images, tiles] and
//     optionally cross_attention_mask [B, L, images, tiles] (absent: the processor's rule from
//     input_ids and the images' real tiles); with pixels_local, pixel_values holds only this
//     rank's image slots [B, slots_r, tiles, 3, S, S];
//   - or video frames (lvx qa / finetune): pixel_values [N, 3, S, S], nothing named: each frame
//     one single-tile image (vision.h frames_as_images) in prompt order, samples padded to the
//     largest image count as the processor pads; pixels_local: only this rank's frames.
//   Any other named input is an error naming it.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <vector>

#include "models/checkpoint.h"
#include "models/mllama/config.h"
#include "models/mllama/mask.h"
#include "models/model.h"

namespace lvx::models::mllama {

// The family (models/families.cpp registers it).
const Family& family();

class Mllama : public Model {
 public:
  // Loads and checks the parameters (missing, unexpected or mis-shaped tensors are one error
  // naming them).
  Mllama(const Checkpoint& ck, at::ScalarType dtype, at::Device device = at::kCPU);

  const Config& config() const { return cfg_; }
  const Family& family() const override { return mllama::family(); }
  StateDict& parameters() override { return w_; }
  // Everything but the (frozen) vision model; the projector trains.
  bool trainable(const std::string& name) const override;
  // freeze.policy cross_only: the adapter as the Llama 3 paper trains it with the language model
  // frozen (and torchtune's fusion recipe): every parameter of the cross layers (attention,
  // gates, norms, MLP) and multi_modal_projector; the self layers, embeddings, lm_head and the
  // vision tower stay frozen.
  bool trains_cross_only(const std::string& name) const override;
  int64_t decoder_layers() const override { return cfg_.text.layers; }
  int64_t decoder_layer_of(const std::string& name) const override;
  // A cross layer runs its cross-attention only; every other layer its self-attention only.
  std::vector<DecoderLayerAttention> layer_attentions() const override;
  int64_t media_token_id() const override { return cfg_.image_token_id; }
  int64_t tokens_per_media() const override { return cfg_.tokens_per_image(); }
  ModelConfig planner_model() const override { return mllama::planner_model(cfg_); }

  ModelOutputs forward(const ModelInputs& in, const Parallel& par) const override;
  at::Tensor prefill(const ModelInputs& in, const Parallel& par, DecodeCache& cache) const override;
  at::Tensor decode_step(const at::Tensor& tokens, const Parallel& par,
                         DecodeCache& cache) const override;
  std::vector<CrossCall> decode_cross_calls() const override;
  bool can_extend() const override { return true; }
  at::Tensor extend(const at::Tensor& tokens, const Parallel& par,
                    DecodeCache& cache) const override;
  bool can_prefill_in_chunks() const override { return true; }
  void prefill_media(const ModelInputs& in, const Parallel& par,
                     DecodeCache& cache) const override;
  bool batches_rows() const override { return true; }
  at::Tensor decode_rows(const at::Tensor& tokens, const Parallel& par,
                         const std::vector<DecodeCache*>& caches) const override;

 private:
  ModelOutputs run(const ModelInputs& in, const Parallel& par, DecodeCache* cache) const;
  // o_proj, residual, norm, MLP, residual of self layer i (ctx [B, S, Hq·D]).
  at::Tensor self_block(int64_t layer, const at::Tensor& h, const at::Tensor& ctx,
                        bool remat) const;
  // The gated cross block of layer i after its attention (ctx [B, S, Hq·D]; sees [B, S, 1] in
  // h's dtype: full_text_row_masked_out_mask).
  at::Tensor cross_block(int64_t layer, const at::Tensor& h, const at::Tensor& ctx,
                         const at::Tensor& sees, bool remat) const;
  at::Tensor lm_head() const;

  Config cfg_;
  StateDict w_;
};

}  // namespace lvx::models::mllama
