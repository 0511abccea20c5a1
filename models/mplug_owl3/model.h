// mPLUG-Owl3 (Ye et al., "mPLUG-Owl3: Towards Long Image-Sequence Understanding in Multi-Modal
// Large Language Models"), as released on Hugging Face (model_type "mplugowl3"):
//   SigLIP ViT → hidden_states[-2] [N_img, T, Dv] → projector Linear–GELU–Linear → image_embeds
//   [N_img, T, H]; Qwen2 decoder (GQA, RoPE θ from the config, q/k/v bias) whose `hyper_layers`
//   (1-based in config.json) are Hyper Attention Transformer Blocks:
//   - 240728 / 241014 (a `self_attn.gate` tensor in the hyper layers): the block's causal
//     self-attention and, in parallel, a cross-attention of the SAME RoPE-rotated queries to the
//     visual K/V = v_kv_proj(input_layernorm(image_embeds)) (the text's RMSNorm weights, shared;
//     channels head-major: h·2D + {K,V}·D + d), keys rotated by MI-RoPE at their image token's
//     index + 1; text token t sees every image whose token is strictly before t; fused per
//     hidden channel by g = sigmoid(gate): ctx = ctx_self·(1−g) + ctx_cross·g, only for tokens
//     that see an image (the others keep ctx_self);
//   - 241101 (no gate): one softmax over [visual | text] keys (t sees image j from its token
//     on; MI-RoPE at the token's index): computed as two distributed attentions, one per key
//     side with its own strategy, merged by their lse (BurstAttention's blockwise merge, exact,
//     differentiable through lse).
// Distributed as models/parallel.h describes. Parameter names are the release's.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <tuple>
#include <vector>

#include "models/checkpoint.h"
#include "models/layers.h"
#include "models/model.h"
#include "models/parallel.h"
#include "models/vision.h"
#include "src/attention/media_mask.h"
#include "src/common/model_config.h"

namespace lvx::models {

// The media mask rules of the releases (src/attention/media_mask.h states them by meaning), with
// c_in(t) = number of `<|image|>` tokens at positions <= t and c_ex(t) = number at positions < t,
// images numbered 0, 1, ... in token order:
//
//   240728 (also 1B/2B-241014; the separate, gated cross-attention):
//     processor `count = (arange(L)[:, None] > media_starts[None]).sum(1)` (strict `>`), then
//     modeling_hyper_qwen2.py `make_t2v_mask`: `mask = offset_line <= arange(num_images)`
//     where True means MASKED (x_sdpa inverts it).
//     → t sees images j < c_ex(t): all images strictly BEFORE t; the `<|image|>` token does NOT
//       see its own image (only the tokens after it do). q_media = c_ex − 1, kUpTo.
//     Rows with q_media == −1 (no image before them) are skipped by the model: they keep pure
//     self-attention, with no gate mix. The kernel gives them o = 0, lse = −inf; model code
//     must apply the gate only where q_media >= 0. An image whose token is the sample's last
//     token is seen by nobody (the released code leaves it out of the keys, and raises when it
//     is the sample's only image; here its keys are present and invisible: same outputs).
//
//   241101 (fused hyper attention, one softmax over [visual keys | text keys]):
//     modeling_hyper_qwen2.py `t2vmask = ~(arange(q_len)[:, None] < media_starts[None])`,
//     True = attend.
//     → t sees images j with media_starts[j] <= t: all previous images AND the `<|image|>` token
//       sees its own image. q_media = c_in − 1, kUpTo. This is the visual part of the fused
//       mask only; the text part is the usual causal mask.
//
// So on the `<|image|>` token's own row the releases differ by one; after it both see every
// earlier image. MI-RoPE rotates image j's keys at media_starts[j] + 1 (240728/241014) or
// media_starts[j] (241101).
inline constexpr attention::MediaMaskRule kMediaMask240728{attention::MediaSees::kUpToMostRecent,
                                                           /*own_token_included=*/false};
inline constexpr attention::MediaMaskRule kMediaMask241101{attention::MediaSees::kUpToMostRecent,
                                                           /*own_token_included=*/true};

struct MplugOwl3Config {
  std::string variant;  // "240728" (gated; also 241014) or "241101" (fused), from the checkpoint
  int64_t hidden = 0, layers = 0, heads = 0, kv_heads = 0, head_dim = 0, intermediate = 0,
          vocab = 0;
  double rope_theta = 1e6, rms_eps = 1e-6;
  std::string act = "silu";  // hidden_act: the decoder MLP's gate activation
  bool tie_embeddings = false;
  std::vector<int64_t> hyper_layers;  // 0-based decoder layer indices
  SiglipConfig vision;
  int64_t image_token_id = -1;  // `<|image|>` from tokenizer.json's added tokens
  // This release's media mask rule (kMediaMask240728 or kMediaMask241101).
  attention::MediaMaskRule media_rule() const;
  bool is_hyper(int64_t layer) const;
};

// Reads config.json (model_type "mplugowl3") and recognises the release variant from the
// checkpoint's tensors (hyper layers with `self_attn.gate`: 240728/241014; without: 241101).
// Errors name the file and the field.
MplugOwl3Config mplug_owl3_config(const Checkpoint& ck, int64_t image_token_id);
// The same from config.json alone; `gated` says which release (240728/241014: true).
MplugOwl3Config mplug_owl3_config(const nlohmann::json& config, const std::string& where,
                                  bool gated, int64_t image_token_id);
// Every tensor the model reads, by checkpoint name, with its shape.
ShapeSpec mplug_owl3_shapes(const MplugOwl3Config& c);

class MplugOwl3 : public Model {
 public:
  // Loads and checks the parameters (missing, unexpected or mis-shaped tensors are one error
  // naming them; SigLIP's post_layernorm, last layer and pooling head may be present).
  MplugOwl3(const Checkpoint& ck, int64_t image_token_id, at::ScalarType dtype,
            at::Device device = at::kCPU);

  const MplugOwl3Config& config() const { return cfg_; }
  const Family& family() const override;
  StateDict& parameters() override { return w_; }
  // Everything but the (frozen) vision encoder.
  bool trainable(const std::string& name) const override;
  int64_t decoder_layers() const override { return cfg_.layers; }
  int64_t decoder_layer_of(const std::string& name) const override;
  // Every layer a self-attention; a hyper layer also a cross-attention, after it in the
  // planner's order (the same queries, beside the self-attention).
  std::vector<DecoderLayerAttention> layer_attentions() const override;
  int64_t media_token_id() const override { return cfg_.image_token_id; }
  int64_t tokens_per_media() const override { return cfg_.vision.tokens(); }
  // The attention layers as they run, for the planner (one description: derived, not copied).
  ModelConfig planner_model() const override { return planner_model(cfg_); }
  // The same from a configuration alone (lvx plan --model DIR reads config.json, no weights).
  static ModelConfig planner_model(const MplugOwl3Config& c);

  ModelOutputs forward(const ModelInputs& in, const Parallel& par) const override;
  at::Tensor prefill(const ModelInputs& in, const Parallel& par, DecodeCache& cache) const override;
  at::Tensor decode_step(const at::Tensor& tokens, const Parallel& par,
                         DecodeCache& cache) const override;
  std::vector<CrossCall> decode_cross_calls() const override;
  bool can_extend() const override { return true; }
  at::Tensor extend(const at::Tensor& tokens, const Parallel& par,
                    DecodeCache& cache) const override;
  bool can_prefill_in_chunks() const override { return true; }
  void prefill_media(const ModelInputs& in, const Parallel& par, DecodeCache& cache) const override;
  bool batches_rows() const override { return true; }
  at::Tensor extend_rows(const std::vector<at::Tensor>& tokens, const Parallel& par,
                         const std::vector<DecodeCache*>& caches) const override;
  at::Tensor decode_rows(const at::Tensor& tokens, const Parallel& par,
                         const std::vector<DecodeCache*>& caches) const override;

 private:
  // A decode step's attention output of layer i, [B, Hq·D] fp32: the self-attention partial
  // (prompt and generated keys merged) and, in a hyper layer with images, the visual partial,
  // mixed as the variant mixes them (240728: the gate, where the row sees an image; 241101: one
  // softmax over both).
  at::Tensor decode_mix(int64_t i, const Partial& self, const Partial* visual,
                        const at::Tensor& sees_media) const;
  // A decode step's partials of layer li's query q [B, Hq, D] merged over the ranks: the prompt
  // keys' and, where `cross`, the visual keys' (one pass-Q message; under lead decoding, rank 0's
  // whole prompt locally and the visual partial alone: models/lead_decode.h).
  std::vector<Partial> over_ranks(const at::Tensor& q, const DecodeCache& cache, size_t li,
                                  bool cross, const Parallel& par) const;
  // decode_mix row by row, for a batch of rows with and without images (extend_rows).
  at::Tensor mix_rows(int64_t i, const Partial& self, const Partial& image,
                      const std::vector<bool>& cross, const std::vector<int64_t>& lengths,
                      const std::vector<DecodeCache*>& caches) const;
  // Layer i's queries, keys and values of hidden states h [B, L, H] after its input norm, q and k
  // rotated by `rope` ([B, L, Hq | Hkv, D]): what every generation path starts a layer with.
  std::tuple<at::Tensor, at::Tensor, at::Tensor> decode_qkv(int64_t i, const at::Tensor& h,
                                                            const RotaryTables& rope) const;
  // The forward; with a cache (prefill) it also keeps this rank's K/V there and returns the
  // final hidden states (after the norm) instead of logits.
  ModelOutputs run(const ModelInputs& in, const Parallel& par, DecodeCache* cache) const;
  // o_proj, residual, norm, MLP, residual after layer i's attention (ctx [B, S, Hq·D]).
  at::Tensor post_attention(int64_t layer, const at::Tensor& h, const at::Tensor& ctx,
                            bool remat) const;
  const at::Tensor& lm_head() const;

  MplugOwl3Config cfg_;
  StateDict w_;
};

}  // namespace lvx::models

namespace lvx::models::mplug_owl3 {
// The mPLUG-Owl3 family (model_type "mplugowl3"), registered in models/families.cpp.
const Family& family();
}  // namespace lvx::models::mplug_owl3
