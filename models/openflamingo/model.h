// OpenFlamingo (Awadalla et al., "OpenFlamingo: An Open-Source Framework for Training Large
// Autoregressive Vision-Language Models"; open-flamingo 2.0.1), from the one directory that
// models/openflamingo/convert_openflamingo.py writes out of a release (checkpoint.pt + the base LM
// + the open_clip tower; names are the Flamingo module's own, see docs/openflamingo.md):
//   open_clip ViT (class token, ln_pre, pre-LN blocks, QuickGELU or GELU, ln_post on tokens as
//   recorded by the converter) → token outputs without the class token [N_img, v, W] →
//   Perceiver resampler (latents attend to [media | latents], residual, LayerNorm-GELU FF, final
//   norm) → media [N_img, n_latents, W];
//   decoder (GPT-NeoX: rotary with rotary_pct, optional parallel residual; MPT: ALiBi, no
//   biases, tied embeddings; Llama: RMSNorm, GQA, RoPE, SwiGLU, no biases) with a gated
//   cross-attention block BEFORE each decoder layer listed in cross_attn_layers: x +=
//   tanh(attn_gate)·to_out(attn(LN(x), media)), x += tanh(ff_gate)· FF(x); text token t sees only
//   the most recent image (the `<image>` token its own), tokens before the first image get 0 from
//   the cross-attention.
// Distributed as models/parallel.h describes: each rank runs the ViT and the resampler on its own
// images only. ALiBi runs through every distributed strategy as one extra head dimension
// (q' = [q, 1], k' = [k, slope_h·j/scale], v' = [v, 0]: scale·q'·k' = scale·q·k + slope_h·j,
// which differs from MPT's bias slope_h·(j − i) by a per-row constant, so the softmax is the
// same); in bf16/fp16 three (the bias split hi + mid + lo, fp32's precision: alibi_channels).
// Generation (models/decode.h): prefill is the forward keeping each rank's self K/V (MPT's with
// the ALiBi channel) and its images' visual K/V; a decode step attends by pass-Q, as the
// package's cached generation does: a generated token sees its sample's LAST image only
// (use_cached_media), a sample without images gets 0 from the cross-attention (its gated block
// adds only the FF branch; a batch without any image skips the gated blocks, as the forward
// does). The cross block runs before the decoder layer and feeds it, so a
// layer with one merges twice, one after the other: per rank and token (n−1)·B·x_heads·
// (x_dim_head+1)·4 bytes for the cross-attention and (n−1)·B·heads·(D+1)·4 for the self-
// attention, D = head_dim (MPT: head_dim + alibi_channels). forward, prefill and decode_step share
// one implementation of each layer piece (self q/k/v, the block after the self-attention, the gated
// block's query / visual K/V / output, the final norm and head).
#pragma once

#include <ATen/ATen.h>

#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "models/checkpoint.h"
#include "models/model.h"
#include "models/parallel.h"
#include "src/attention/media_mask.h"

namespace lvx::models {

// OpenFlamingo's media mask rule (src/attention/media_mask.h states rules by meaning), with
// c_in(t) = number of `<image>` tokens at positions <= t, images numbered 0, 1, ... in token
// order. only_attend_immediate_media=True (every released checkpoint), helpers.py
// MaskedCrossAttention.forward: `text_time = media_locations.cumsum(-1)`,
// `media_time = arange(T_img) + 1`, mask `text_time == media_time`; rows with text_time == 0
// get their attention zeroed.
//   → text token t sees only image c_in(t) − 1: the most recent image, and the `<image>` token
//     sees its OWN image. q_media = c_in − 1, kImmediate.
inline constexpr attention::MediaMaskRule kMediaMaskImmediate{attention::MediaSees::kMostRecent,
                                                              /*own_token_included=*/true};
// only_attend_immediate_media=False ("openflamingo-all-previous"): the same code with `>=`.
//   → t sees images 0 .. c_in(t) − 1. q_media = c_in − 1, kUpTo.
//   One deliberate difference: rows before the first image (text_time == 0) have every logit
//   masked and the package does not zero them in this mode, so its softmax spreads uniformly
//   over ALL media keys (later images included). Here they see nothing (output 0), as in the
//   immediate mode.
inline constexpr attention::MediaMaskRule kMediaMaskAllPrevious{
    attention::MediaSees::kUpToMostRecent, /*own_token_included=*/true};

struct OpenFlamingoConfig {
  // Vision (open_clip)
  int64_t v_width = 0, v_layers = 0, v_heads = 0, v_mlp = 0, image_size = 0, patch_size = 0;
  bool v_ln_pre = true, v_tokens_ln_post = true;
  std::string v_act = "gelu";
  double v_eps = 1e-5;
  // Perceiver
  int64_t p_depth = 0, p_heads = 0, p_dim_head = 0, p_latents = 0, p_ff = 0;
  double p_eps = 1e-5;
  // Gated cross-attention
  int64_t x_heads = 0, x_dim_head = 0, x_ff = 0;
  double x_eps = 1e-5;
  std::vector<int64_t> cross_layers;
  // Decoder
  std::string lm;           // gpt_neox | mpt | llama
  std::string layers_attr;  // "gpt_neox.layers" | "transformer.blocks" | "model.layers"
  int64_t hidden = 0, layers = 0, heads = 0, kv_heads = 0, head_dim = 0, mlp = 0, vocab = 0,
          rotary_dim = 0;
  double rotary_base = 10000, eps = 1e-5, alibi_bias_max = 8;
  bool parallel_residual = false, lm_biases = true, tied = false;
  std::string act = "gelu";
  int64_t media_token_id = -1;
  bool is_cross(int64_t layer) const;
  int64_t vision_tokens() const { return (image_size / patch_size) * (image_size / patch_size); }
};

// From the converted directory's config.json; unsupported options (MPT qk_ln, clip_qkv, …) are
// errors naming the field.
OpenFlamingoConfig openflamingo_config(const nlohmann::json& config, const std::string& where);
// MPT's ALiBi channels per head for a model in `dtype`: 1 in fp32 (slope·j/scale exactly);
// 3 in bf16/fp16, the bias split hi + mid + lo so that their sum keeps fp32's 24 bits (one bf16
// channel keeps 8: several logits of error at position 2047).
int64_t alibi_channels(at::ScalarType dtype);
ShapeSpec openflamingo_shapes(const OpenFlamingoConfig& c);

class OpenFlamingo : public Model {
 public:
  OpenFlamingo(const Checkpoint& ck, at::ScalarType dtype, at::Device device = at::kCPU);
  const OpenFlamingoConfig& config() const { return cfg_; }
  const Family& family() const override;
  StateDict& parameters() override { return w_; }
  bool trainable(const std::string& name) const override;  // all but the vision encoder
  int64_t decoder_layers() const override { return cfg_.layers; }
  int64_t decoder_layer_of(const std::string& name) const override;
  // Every layer a self-attention; a layer in cross_attn_layers also a gated cross-attention
  // block, which runs before it.
  std::vector<DecoderLayerAttention> layer_attentions() const override;
  int64_t media_token_id() const override { return cfg_.media_token_id; }
  int64_t tokens_per_media() const override { return cfg_.p_latents; }
  ModelConfig planner_model() const override { return planner_model(cfg_); }
  static ModelConfig planner_model(const OpenFlamingoConfig& c);
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
  // The self-attention's inputs of one decoder layer.
  struct SelfQKV {
    at::Tensor q, k, v;  // [B, S, H, D'] (Llama: k, v with kv_heads); MPT: D' = head_dim +
                         // alibi_channels(dtype)
  };
  // The forward; with a cache (prefill) it also keeps this rank's K/V there and returns the
  // final hidden states (after the norm) instead of logits.
  ModelOutputs run(const ModelInputs& in, const Parallel& par, DecodeCache* cache) const;
  // This rank's images of the prompt (media mask mm) through the ViT and the perceiver (or
  // in.media's features): no collective.
  LocalMedia local_media(const ModelInputs& in, const Parallel& par,
                         const attention::MediaMask& mm, const at::TensorOptions& options) const;
  const at::Tensor& embedding() const;
  const at::Tensor& lm_head() const;
  // q/k/v of decoder layer i from the residual stream x [B, S, W] at global positions [S]:
  // rotary (GPT-NeoX, Llama) or the ALiBi channel (MPT: q' = [q, 1], k' = [k, slope·j/scale],
  // v' = [v, 0]).
  SelfQKV self_qkv(int64_t layer, const at::Tensor& x, const at::Tensor& positions) const;
  // The self-attention's softmax scale (MPT's ALiBi channel is not scaled separately).
  double self_scale() const;
  // Decoder layer i after its self-attention (a: [B, S, H·head_dim], before the output
  // projection): output projection, residual(s), norm, MLP; --remat recomputes it.
  at::Tensor post_attention(int64_t layer, const at::Tensor& x, const at::Tensor& a,
                            bool remat) const;
  // The gated cross-attention block of layer i: its query [B, S, x_heads, x_dim_head] from x,
  // the visual K/V of media features [B, S_v, W_v], and x after the block given the
  // attention's output o [B, S, x_heads·x_dim_head]: x + tanh(attn_gate)·to_out(o), then
  // + tanh(ff_gate)·FF(x).
  at::Tensor cross_query(int64_t layer, const at::Tensor& x) const;
  std::pair<at::Tensor, at::Tensor> cross_kv(int64_t layer, const at::Tensor& media) const;
  at::Tensor cross_output(int64_t layer, const at::Tensor& x, const at::Tensor& o) const;
  // The gated block of layer i over several generations' rows x [R, 1, W] (decode_rows): the
  // rows with images through it, each against its own visual keys (one pass-Q message); the
  // others unchanged.
  at::Tensor cross_rows(int64_t layer, const at::Tensor& x, const Parallel& par,
                        const std::vector<DecodeCache*>& caches) const;
  // The final norm (before the head).
  at::Tensor final_norm(const at::Tensor& x) const;
  std::string layer_prefix(int64_t layer) const;

  OpenFlamingoConfig cfg_;
  StateDict w_;
};

}  // namespace lvx::models

namespace lvx::models::openflamingo {
// The OpenFlamingo family (model_type "openflamingo"), registered in models/families.cpp.
const Family& family();
}  // namespace lvx::models::openflamingo
