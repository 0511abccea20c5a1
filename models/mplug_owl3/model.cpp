#include "models/mplug_owl3/model.h"

#include <c10/core/GradMode.h>

#include <algorithm>
#include <chrono>
#include <cmath>

#include "models/layers.h"
#include "models/lora.h"
#include "models/mplug_owl3/names.h"
#include "models/recompute.h"
#include "src/attention/dist_attention.h"
#include "src/common/error.h"

namespace lvx::models {

using mplug_owl3_names::kLm;
using mplug_owl3_names::layer_prefix;

namespace {

const std::string kVision = "vision_model.";

}  // namespace

attention::MediaMaskRule MplugOwl3Config::media_rule() const {
  return variant == "241101" ? kMediaMask241101 : kMediaMask240728;
}

bool MplugOwl3Config::is_hyper(int64_t layer) const {
  return std::find(hyper_layers.begin(), hyper_layers.end(), layer) != hyper_layers.end();
}

MplugOwl3Config mplug_owl3_config(const Checkpoint& ck, int64_t image_token_id) {
  // The release variant, from the checkpoint itself: 240728/241014 hyper layers own a gate.
  bool gated = false;
  for (const auto& [name, t] : ck.tensors)
    gated = gated || (name.rfind(kLm + "layers.", 0) == 0 && name.size() > 15 &&
                      name.compare(name.size() - 15, 15, ".self_attn.gate") == 0);
  return mplug_owl3_config(ck.config, ck.dir + "/config.json", gated, image_token_id);
}

MplugOwl3Config mplug_owl3_config(const nlohmann::json& j, const std::string& where, bool gated,
                                  int64_t image_token_id) {
  const std::string type = config_string_or(j, "model_type", where, "");
  LVX_CHECK(type == "mplugowl3", where, ": model_type: expected \"mplugowl3\", got \"", type, "\"");
  MplugOwl3Config c;
  // Every size positive, bounded and consistent before anything is sized from it.
  c.hidden = config_int_in(j, "hidden_size", where, 1, kMaxConfigWidth);
  c.layers = config_int_in(j, "num_hidden_layers", where, 1, kMaxConfigLayers);
  c.heads = config_int_in(j, "num_attention_heads", where, 1, kMaxConfigHeads);
  c.kv_heads = config_int_in_or(j, "num_key_value_heads", where, 1, kMaxConfigHeads, c.heads);
  LVX_CHECK((j.contains("head_dim") && !j["head_dim"].is_null()) || c.hidden % c.heads == 0, where,
            ": hidden_size (", c.hidden, ") must be a multiple of num_attention_heads (", c.heads,
            ") when head_dim is not given");
  c.head_dim = config_int_in_or(j, "head_dim", where, 1, kMaxConfigWidth, c.hidden / c.heads);
  c.intermediate = config_int_in(j, "intermediate_size", where, 1, kMaxConfigWidth);
  c.vocab = config_int_in(j, "vocab_size", where, 1, kMaxConfigVocab);
  c.rope_theta = config_positive_or(j, "rope_theta", where, 1e6);
  c.rms_eps = config_positive_or(j, "rms_norm_eps", where, 1e-6);
  // Qwen2's MLP activation (silu in every release), honoured.
  c.act = config_string_or(j, "hidden_act", where, "silu");
  check_activation(c.act, where + ": hidden_act");
  LVX_CHECK(!j.contains("tie_word_embeddings") || j["tie_word_embeddings"].is_boolean(), where,
            ": tie_word_embeddings: expected true or false, got ", j["tie_word_embeddings"].dump());
  c.tie_embeddings = j.value("tie_word_embeddings", false);
  LVX_CHECK(c.heads % c.kv_heads == 0, where, ": num_attention_heads (", c.heads,
            ") must be a multiple of num_key_value_heads (", c.kv_heads, ")");
  LVX_CHECK(c.head_dim % 2 == 0, where, ": head_dim ", c.head_dim,
            " must be even (rotary embeddings rotate channel pairs)");
  LVX_CHECK(j.value("rope_scaling", nlohmann::json()).is_null(), where,
            ": rope_scaling is not supported");
  LVX_CHECK(j.contains("hyper_layers") && j["hyper_layers"].is_array(), where,
            ": hyper_layers: missing (the 1-based indices of the hyper attention layers)");
  for (const auto& v : j["hyper_layers"]) {
    LVX_CHECK(v.is_number_integer() && v.get<int64_t>() >= 1 && v.get<int64_t>() <= c.layers, where,
              ": hyper_layers: expected 1-based layer indices in [1, ", c.layers, "], got ",
              v.dump());
    c.hyper_layers.push_back(v.get<int64_t>() - 1);
  }
  LVX_CHECK(j.contains("vision_config") && j["vision_config"].is_object(), where,
            ": vision_config: missing");
  c.vision = siglip_config(j["vision_config"], where);
  LVX_CHECK(image_token_id >= 0, where, ": no <|image|> token id (tokenizer.json added_tokens)");
  LVX_CHECK(image_token_id < c.vocab, where, ": the <|image|> token id ", image_token_id,
            " (tokenizer.json) is outside vocab_size ", c.vocab);
  c.image_token_id = image_token_id;
  c.variant = gated ? "240728" : "241101";
  return c;
}

ShapeSpec mplug_owl3_shapes(const MplugOwl3Config& c) {
  const int64_t h = c.hidden, q = c.heads * c.head_dim, kv = c.kv_heads * c.head_dim;
  ShapeSpec s = siglip_shapes(c.vision, kVision, c.vision.layers - 1);
  s["vision2text_model.0.weight"] = {h, c.vision.hidden};
  s["vision2text_model.0.bias"] = {h};
  s["vision2text_model.2.weight"] = {h, h};
  s["vision2text_model.2.bias"] = {h};
  s[kLm + "embed_tokens.weight"] = {c.vocab, h};
  s[kLm + "norm.weight"] = {h};
  if (!c.tie_embeddings) s["language_model.lm_head.weight"] = {c.vocab, h};
  for (int64_t i = 0; i < c.layers; ++i) {
    const std::string l = layer_prefix(i);
    s[l + "self_attn.q_proj.weight"] = {q, h};
    s[l + "self_attn.q_proj.bias"] = {q};
    for (const char* n : {"k_proj", "v_proj"}) {
      s[l + "self_attn." + n + ".weight"] = {kv, h};
      s[l + "self_attn." + n + ".bias"] = {kv};
    }
    s[l + "self_attn.o_proj.weight"] = {h, q};
    s[l + "mlp.gate_proj.weight"] = {c.intermediate, h};
    s[l + "mlp.up_proj.weight"] = {c.intermediate, h};
    s[l + "mlp.down_proj.weight"] = {h, c.intermediate};
    s[l + "input_layernorm.weight"] = {h};
    s[l + "post_attention_layernorm.weight"] = {h};
    if (c.is_hyper(i)) {
      s[l + "self_attn.v_kv_proj.weight"] = {2 * kv, h};
      s[l + "self_attn.v_kv_proj.bias"] = {2 * kv};
      if (c.variant == "240728") s[l + "self_attn.gate"] = {h};
    }
  }
  return s;
}

MplugOwl3::MplugOwl3(const Checkpoint& ck, int64_t image_token_id, at::ScalarType dtype,
                     at::Device device)
    : cfg_(mplug_owl3_config(ck, image_token_id)) {
  const MplugOwl3Config& c = cfg_;
  // Released tensors the model does not use: SigLIP's last layer (hidden_states[-2] is used),
  // post_layernorm and pooling head; a tied lm_head copy.
  std::vector<std::string> unused = {
      kVision + "post_layernorm.", kVision + "head.",
      kVision + "encoder.layers." + std::to_string(c.vision.layers - 1) + "."};
  if (c.tie_embeddings) unused.push_back("language_model.lm_head.");
  w_ = select_parameters(ck.tensors, mplug_owl3_shapes(c), unused, dtype, ck.dir, device);
}

bool MplugOwl3::trainable(const std::string& name) const { return name.rfind(kVision, 0) != 0; }

const Family& MplugOwl3::family() const { return mplug_owl3::family(); }

std::vector<DecoderLayerAttention> MplugOwl3::layer_attentions() const {
  std::vector<DecoderLayerAttention> a(static_cast<size_t>(cfg_.layers));
  for (int64_t i = 0; i < cfg_.layers; ++i) a[static_cast<size_t>(i)].cross = cfg_.is_hyper(i);
  return a;
}

ModelConfig MplugOwl3::planner_model(const MplugOwl3Config& c) {
  ModelConfig m;
  m.name = "mplug_owl3_" + c.variant;
  m.family = "mplug_owl3";
  m.dtype = "bf16";
  m.visual_tokens_per_frame = c.vision.tokens();
  m.visual_feature_dim = c.hidden;  // image_embeds have the LM width
  m.vision = {c.vision.hidden,     c.vision.layers - 1, c.vision.heads, c.vision.mlp,  // layers run
              c.vision.image_size, c.vision.patch_size};
  for (int64_t i = 0; i < c.layers; ++i) {
    AttentionLayerConfig l;
    l.hidden_size = c.hidden;
    l.heads = c.heads;
    l.kv_heads = c.kv_heads;
    l.head_dim = c.head_dim;
    l.mlp_size = c.intermediate;
    l.kind = LayerKind::kSelf;
    l.mask = MaskRule::kCausal;
    m.layers.push_back(l);
    if (c.is_hyper(i)) {  // the same queries against the visual keys, beside the self layer
      l.kind = LayerKind::kCross;
      l.mask = MaskRule::kMediaUpTo;
      m.layers.push_back(l);
    }
  }
  return m;
}

namespace {

// The visual features of this rank's whole images ([B, slots_r·T, H], zero for slots a sample
// does not fill) and MI-RoPE positions of their keys ([B, slots_r·T]).
struct LocalVisual {
  at::Tensor features, key_positions;
  at::Tensor kv_media;  // int32 [B, slots_r·T]: the image of each local key, −1 for padding
};

// This rank's images of the prompt (mask mm on the host, mmd on the weights' device) encoded:
// SigLIP's hidden_states[-2], then the projector (or in.media's features), with the MI-RoPE
// position and the image of every key. No collective.
LocalVisual local_visual(const MplugOwl3Config& c, const StateDict& w, const ModelInputs& in,
                         const Parallel& par, const attention::MediaMask& mm,
                         const attention::MediaMask& mmd, const at::TensorOptions& options) {
  const int64_t B = in.input_ids.size(0), T = c.vision.tokens();
  const at::ScalarType dt = options.dtype().toScalarType();
  const LocalMedia media = encode_local_media(
      mm, in.pixel_values, in.pixels_local, par, c.hidden,
      [&](const at::Tensor& px) {
        const at::Tensor v = siglip_forward(w, kVision, c.vision, px.to(dt), c.vision.layers - 1);
        return linear(at::gelu(linear(v, w, "vision2text_model.0", true)), w, "vision2text_model.2",
                      true);
      },
      options, "mPLUG-Owl3", in.media);
  LocalVisual vis;
  vis.features = media.features;
  // MI-RoPE: every key of image j at its token's index (+1 for 240728/241014).
  const int64_t shift = c.variant == "241101" ? 0 : 1;
  const int64_t S = static_cast<int64_t>(media.slots.size());
  const at::Device dev = options.device();
  const at::Tensor starts =
      mmd.media_starts.index_select(1, media.slot_index().to(dev)).clamp_min(0) + shift;
  vis.key_positions = starts.unsqueeze(2).expand({B, S, T}).reshape({B, -1});
  vis.kv_media = mmd.kv_media.index_select(1, media.key_index(T).to(dev));
  return vis;
}

// Layer `layer`'s visual K/V from the shared features: the text's input RMSNorm weights, then
// v_kv_proj with head-major channels (per K/V head: its K block, then its V block), keys rotated
// by MI-RoPE. Captures by value: with recomputation it runs again in the backward.
KVFunction visual_kv_function(const MplugOwl3Config& c, const LocalVisual& vis) {
  const RotaryTables mi_rope = rotary_tables(vis.key_positions, c.head_dim, c.rope_theta);
  const int64_t hkv = c.kv_heads, d = c.head_dim;
  const double eps = c.rms_eps;
  return [mi_rope, hkv, d, eps](const at::Tensor& y, const std::vector<at::Tensor>& p) {
    const at::Tensor kv =
        models::linear(rms_norm(y, p[0], eps), p[1], p[2]).view({y.size(0), y.size(1), hkv, 2, d});
    return std::make_pair(apply_rotary(kv.select(3, 0), mi_rope), kv.select(3, 1));
  };
}

std::vector<at::Tensor> visual_kv_params(const StateDict& w, int64_t layer) {
  const std::string l = layer_prefix(layer);
  return {param(w, l + "input_layernorm.weight"), param(w, l + "self_attn.v_kv_proj.weight"),
          param(w, l + "self_attn.v_kv_proj.bias")};
}

// What a forward's hyper layers share: this rank's images, the cross-attention's spec and media
// mask, and (prefill) the cached visual shards' mask, one for every cross layer.
struct VisualAttention {
  LocalVisual vis;
  attention::AttentionSpec spec;
  attention::MaskInputs mask;
  at::Tensor visible;
};

// Layer `layer`'s queries [B, L_r, Hq, D], keys and values [B, L_r, Hkv, D] of the hidden states
// h after its input norm, q and k rotated by `rope`.
std::tuple<at::Tensor, at::Tensor, at::Tensor> self_qkv(const MplugOwl3Config& c,
                                                        const StateDict& w, int64_t layer,
                                                        const at::Tensor& h,
                                                        const RotaryTables& rope) {
  const std::string l = layer_prefix(layer);
  const at::Tensor x = rms_norm(h, param(w, l + "input_layernorm.weight"), c.rms_eps);
  const int64_t B = x.size(0), lr = x.size(1);
  at::Tensor q = linear(x, w, l + "self_attn.q_proj", true).view({B, lr, c.heads, c.head_dim});
  at::Tensor k = linear(x, w, l + "self_attn.k_proj", true).view({B, lr, c.kv_heads, c.head_dim});
  at::Tensor v = linear(x, w, l + "self_attn.v_proj", true).view({B, lr, c.kv_heads, c.head_dim});
  q = apply_rotary(q, rope);
  k = apply_rotary(k, rope);
  return {q, k, v};
}

// Hyper layer `layer`'s cross-attention of its queries q to this rank's visual K/V: recomputed in
// the backward under recompute_cross_kv (no cache), else computed once (and cached in a prefill).
attention::DistAttentionResult hyper_cross_attention(const MplugOwl3Config& c, const StateDict& w,
                                                     int64_t layer, const at::Tensor& q,
                                                     const VisualAttention& va, const Parallel& par,
                                                     DecodeCache* cache) {
  const LayerStrategies& st = par.at(static_cast<size_t>(layer));
  const KVFunction kv_fn = visual_kv_function(c, va.vis);
  const std::vector<at::Tensor> kv_params = visual_kv_params(w, layer);
  if (par.recompute_cross_kv && !cache)
    return cross_attention_recompute(q, va.vis.features, kv_params, kv_fn, par.pg, st.cross,
                                     va.spec, va.mask);
  const auto [kv_k, kv_v] = kv_fn(va.vis.features, kv_params);
  attention::DistAttentionResult cross =
      attention::dist_attention(q, kv_k, kv_v, par.pg, st.cross, va.spec, va.mask);
  if (cache) cache->visual[static_cast<size_t>(layer)] = visual_shard(kv_k, kv_v, va.visible);
  return cross;
}

// Hyper layer `layer`'s attention output [B, L_r, Hq·D] from its self part (ctx: self.o in that
// shape) and its cross part, mixed as the variant mixes them: 240728 by the gate where the row
// sees an image (sees_image [B, L_r, 1]), 241101 as one softmax over both.
at::Tensor mix_hyper(const MplugOwl3Config& c, const StateDict& w, int64_t layer,
                     const at::Tensor& ctx, const attention::DistAttentionResult& self,
                     const attention::DistAttentionResult& cross, const at::Tensor& sees_image,
                     at::ScalarType dt) {
  const int64_t B = ctx.size(0), lr = ctx.size(1);
  if (c.variant == "240728") {
    const at::Tensor g = at::sigmoid(param(w, layer_prefix(layer) + "self_attn.gate"));
    const at::Tensor xo = cross.o.reshape({B, lr, c.heads * c.head_dim});
    return at::where(sees_image, ctx * (1 - g) + xo * g, ctx);
  }
  // One softmax over [visual | text] keys = the two partial results merged by their lse.
  const at::Tensor lse = at::logaddexp(self.lse, cross.lse);  // [B, Hq, L_r]
  auto weight = [&](const at::Tensor& part) {
    return at::exp(part - lse).transpose(1, 2).unsqueeze(-1).to(dt);  // [B, L_r, Hq, 1]
  };
  return (self.o * weight(self.lse) + cross.o * weight(cross.lse))
      .reshape({B, lr, c.heads * c.head_dim});
}

}  // namespace

ModelOutputs MplugOwl3::forward(const ModelInputs& in, const Parallel& par) const {
  return run(in, par, nullptr);
}

at::Tensor MplugOwl3::post_attention(int64_t layer, const at::Tensor& h, const at::Tensor& ctx,
                                     bool remat) const {
  const std::string l = layer_prefix(layer);
  const std::vector<at::Tensor> block_params{
      param(w_, l + "self_attn.o_proj.weight"), param(w_, l + "post_attention_layernorm.weight"),
      param(w_, l + "mlp.gate_proj.weight"), param(w_, l + "mlp.up_proj.weight"),
      param(w_, l + "mlp.down_proj.weight")};
  const double eps = cfg_.rms_eps;
  const std::string act = cfg_.act;
  auto block = [eps, act](const std::vector<at::Tensor>& in,
                          const std::vector<at::Tensor>& p) -> std::vector<at::Tensor> {
    const at::Tensor a = in[0] + models::linear(in[1], p[0]);
    const at::Tensor x2 = rms_norm(a, p[1], eps);
    return {a + models::linear(activation(models::linear(x2, p[2]), act) * models::linear(x2, p[3]),
                               p[4])};
  };
  return remat ? checkpoint_segment(block, {h, ctx}, block_params)[0]
               : block({h, ctx}, block_params)[0];
}

ModelOutputs MplugOwl3::run(const ModelInputs& in, const Parallel& par, DecodeCache* cache) const {
  const MplugOwl3Config& c = cfg_;
  const at::Tensor& ids = in.input_ids;
  const at::Tensor& emb = param(w_, kLm + "embed_tokens.weight");
  check_named_inputs(in, {}, "mPLUG-Owl3");
  const TextShard shard = embed_text_shard(ids, emb, par, "mPLUG-Owl3");
  const at::Tensor& pos = shard.positions;
  at::Tensor h = shard.hidden;
  const int64_t B = ids.size(0), L = ids.size(1), T = c.vision.tokens();

  // Media: per-token indices under this release's rule; this rank's whole images.
  // The media layout on the host (which rank encodes which image), its tensors on h's device.
  const attention::MediaMask mm =
      attention::media_mask(c.media_rule(), host_ids(ids), c.image_token_id, T);
  const attention::MediaMask mmd = media_mask_on(mm, h.device());
  const int64_t slots = mm.slots;
  VisualAttention va;
  const auto encode_start = std::chrono::steady_clock::now();
  if (slots > 0) va.vis = local_visual(c, w_, in, par, mm, mmd, h.options());
  if (cache) {
    if (slots > 0) va.visible = shard_visible(va.vis.kv_media.ge(0));
    start_prompt_cache(*cache, c.layers, B, L, encode_start);
    // A generated token comes after every image: it sees all of its sample's images.
    cache->sees_media =
        slots > 0 ? (mmd.media_starts >= 0).any(1) : at::zeros({B}, h.options().dtype(at::kBool));
  }
  va.spec = cross_attention_spec(B, L, c.heads, c.kv_heads, c.head_dim, mm, par);
  va.mask = {mmd.q_media, mmd.kv_media, {}};

  const RotaryTables rope = rotary_tables(pos, c.head_dim, c.rope_theta);
  const at::Tensor sees_image = mmd.q_media.index_select(1, pos).ge(0).unsqueeze(-1);  // [B,L_r,1]
  const attention::AttentionSpec self_spec =
      self_attention_spec(B, L, c.heads, c.kv_heads, c.head_dim, par);
  for (int64_t i = 0; i < c.layers; ++i) {
    par.enter_layer(i, h);
    const auto [q, k, v] = self_qkv(c, w_, i, h, rope);
    if (cache) cache->prompt[static_cast<size_t>(i)] = {k, v, {}};
    const auto self =
        attention::dist_attention(q, k, v, par.pg, par.at(static_cast<size_t>(i)).self, self_spec);
    at::Tensor ctx = self.o.reshape({B, h.size(1), c.heads * c.head_dim});
    if (c.is_hyper(i) && slots > 0) {
      const attention::DistAttentionResult cross =
          hyper_cross_attention(c, w_, i, q, va, par, cache);
      ctx = mix_hyper(c, w_, i, ctx, self, cross, sees_image, emb.scalar_type());
    }
    // The block after its attention: o_proj, residual, norm, MLP, residual.
    h = post_attention(i, h, ctx, par.remat);
  }
  par.leave_layers(h);
  h = rms_norm(h, param(w_, kLm + "norm.weight"), c.rms_eps);
  if (cache) return {h, shard.host_positions};
  return {lora_linear(h, lm_head(), c10::nullopt), shard.host_positions};  // LoRA on lm_head too
}

void MplugOwl3::prefill_media(const ModelInputs& in, const Parallel& par,
                              DecodeCache& cache) const {
  c10::AutoGradMode no_grad(false);
  const MplugOwl3Config& c = cfg_;
  check_named_inputs(in, {}, "mPLUG-Owl3");
  const at::Tensor& emb = param(w_, kLm + "embed_tokens.weight");
  const int64_t B = in.input_ids.size(0), L = in.input_ids.size(1);
  const attention::MediaMask mm = attention::media_mask(c.media_rule(), host_ids(in.input_ids),
                                                        c.image_token_id, c.vision.tokens());
  LVX_CHECK(mm.slots > 0, "prefill_media: the prompt has no image");
  const attention::MediaMask mmd = media_mask_on(mm, emb.device());
  const auto encode_start = std::chrono::steady_clock::now();
  const LocalVisual vis = local_visual(c, w_, in, par, mm, mmd, emb.options());
  cache = chunked_prompt_cache(c.layers, B, c.kv_heads, c.head_dim, emb.options());
  cache.sees_media = (mmd.media_starts >= 0).any(1);
  cache.prompt_media = {{mmd.q_media.narrow(1, 0, L), vis.kv_media, c.media_rule().kernel_rule()}};
  cache.prompt_sees = mmd.q_media.narrow(1, 0, L).ge(0);
  cache.prompt_key_reads = media_key_reads(mm, L);
  const at::Tensor visible = shard_visible(vis.kv_media.ge(0));  // one for every cross layer
  for (int64_t i = 0; i < c.layers; ++i) {
    if (!c.is_hyper(i)) continue;
    const auto [k, v] = visual_kv_function(c, vis)(vis.features, visual_kv_params(w_, i));
    cache.visual[static_cast<size_t>(i)] = visual_shard(k, v, visible);
  }
  cache.encode_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - encode_start).count();
}

const at::Tensor& MplugOwl3::lm_head() const {
  return cfg_.tie_embeddings ? param(w_, kLm + "embed_tokens.weight")
                             : param(w_, "language_model.lm_head.weight");
}

int64_t MplugOwl3::decoder_layer_of(const std::string& name) const {
  return layer_number_after(name, kLm + "layers.");
}

}  // namespace lvx::models
