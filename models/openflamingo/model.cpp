// OpenFlamingo (models/openflamingo/model.h): shapes, the three decoder kinds and the gated
// cross-attention blocks; the configuration is config.cpp, the vision encoder and the perceiver
// vision.cpp, generation decode.cpp.
#include "models/openflamingo/model.h"

#include <c10/core/GradMode.h>

#include <algorithm>
#include <chrono>
#include <cmath>

#include "models/checkpoint.h"
#include "models/layers.h"
#include "models/lora.h"
#include "models/openflamingo/vision.h"
#include "models/recompute.h"
#include "src/attention/dist_attention.h"
#include "src/common/error.h"

namespace lvx::models {

// A table, not a procedure: every tensor the checkpoint holds and its shape, one line each,
// grouped as the names are (vision tower, perceiver, decoder layers by kind, embeddings). It stays
// one function so that it reads against a checkpoint's tensor listing line for line.
ShapeSpec openflamingo_shapes(const OpenFlamingoConfig& c) {
  ShapeSpec s;
  const int64_t w = c.v_width, g = c.image_size / c.patch_size;
  s[kVis + "conv1.weight"] = {w, 3, c.patch_size, c.patch_size};
  s[kVis + "class_embedding"] = {w};
  s[kVis + "positional_embedding"] = {1 + g * g, w};
  auto ln = [&](const std::string& p, int64_t d, bool bias) {
    s[p + ".weight"] = {d};
    if (bias) s[p + ".bias"] = {d};
  };
  if (c.v_ln_pre) ln(kVis + "ln_pre", w, true);
  if (c.v_tokens_ln_post) ln(kVis + "ln_post", w, true);
  for (int64_t i = 0; i < c.v_layers; ++i) {
    const std::string b = kVis + "transformer.resblocks." + std::to_string(i) + ".";
    ln(b + "ln_1", w, true);
    ln(b + "ln_2", w, true);
    s[b + "attn.in_proj_weight"] = {3 * w, w};
    s[b + "attn.in_proj_bias"] = {3 * w};
    s[b + "attn.out_proj.weight"] = {w, w};
    s[b + "attn.out_proj.bias"] = {w};
    s[b + "mlp.c_fc.weight"] = {c.v_mlp, w};
    s[b + "mlp.c_fc.bias"] = {c.v_mlp};
    s[b + "mlp.c_proj.weight"] = {w, c.v_mlp};
    s[b + "mlp.c_proj.bias"] = {w};
  }
  const int64_t inner = c.p_heads * c.p_dim_head;
  s["perceiver.latents"] = {c.p_latents, w};
  for (int64_t l = 0; l < c.p_depth; ++l) {
    const std::string b = "perceiver.layers." + std::to_string(l) + ".";
    ln(b + "0.norm_media", w, true);
    ln(b + "0.norm_latents", w, true);
    s[b + "0.to_q.weight"] = {inner, w};
    s[b + "0.to_kv.weight"] = {2 * inner, w};
    s[b + "0.to_out.weight"] = {w, inner};
    ln(b + "1.0", w, true);
    s[b + "1.1.weight"] = {c.p_ff, w};
    s[b + "1.3.weight"] = {w, c.p_ff};
  }
  ln("perceiver.norm", w, true);
  const int64_t d = c.hidden, xi = c.x_heads * c.x_dim_head;
  const std::string lm = "lang_encoder.";
  for (int64_t i = 0; i < c.layers; ++i) {
    const std::string b = lm + c.layers_attr + "." + std::to_string(i) + ".";
    if (c.is_cross(i)) {
      const std::string x = b + "gated_cross_attn_layer.";
      s[x + "attn_gate"] = {1};
      s[x + "ff_gate"] = {1};
      ln(x + "attn.norm", d, true);
      s[x + "attn.to_q.weight"] = {xi, d};
      s[x + "attn.to_kv.weight"] = {2 * xi, w};
      s[x + "attn.to_out.weight"] = {d, xi};
      ln(x + "ff.0", d, true);
      s[x + "ff.1.weight"] = {c.x_ff, d};
      s[x + "ff.3.weight"] = {d, c.x_ff};
    }
    const std::string l = b + "decoder_layer.";
    if (c.lm == "gpt_neox") {
      ln(l + "input_layernorm", d, true);
      ln(l + "post_attention_layernorm", d, true);
      s[l + "attention.query_key_value.weight"] = {3 * d, d};
      s[l + "attention.query_key_value.bias"] = {3 * d};
      s[l + "attention.dense.weight"] = {d, d};
      s[l + "attention.dense.bias"] = {d};
      s[l + "mlp.dense_h_to_4h.weight"] = {c.mlp, d};
      s[l + "mlp.dense_h_to_4h.bias"] = {c.mlp};
      s[l + "mlp.dense_4h_to_h.weight"] = {d, c.mlp};
      s[l + "mlp.dense_4h_to_h.bias"] = {d};
    } else if (c.lm == "llama") {
      const int64_t q = c.heads * c.head_dim, kv = c.kv_heads * c.head_dim;
      s[l + "input_layernorm.weight"] = {d};
      s[l + "post_attention_layernorm.weight"] = {d};
      s[l + "self_attn.q_proj.weight"] = {q, d};
      s[l + "self_attn.k_proj.weight"] = {kv, d};
      s[l + "self_attn.v_proj.weight"] = {kv, d};
      s[l + "self_attn.o_proj.weight"] = {d, q};
      s[l + "mlp.gate_proj.weight"] = {c.mlp, d};
      s[l + "mlp.up_proj.weight"] = {c.mlp, d};
      s[l + "mlp.down_proj.weight"] = {d, c.mlp};
    } else {
      ln(l + "norm_1", d, false);
      ln(l + "norm_2", d, false);
      s[l + "attn.Wqkv.weight"] = {3 * d, d};
      s[l + "attn.out_proj.weight"] = {d, d};
      s[l + "ffn.up_proj.weight"] = {c.mlp, d};
      s[l + "ffn.down_proj.weight"] = {d, c.mlp};
    }
  }
  if (c.lm == "gpt_neox") {
    s[lm + "gpt_neox.embed_in.weight"] = {c.vocab, d};
    ln(lm + "gpt_neox.final_layer_norm", d, true);
    s[lm + "embed_out.weight"] = {c.vocab, d};
  } else if (c.lm == "llama") {
    s[lm + "model.embed_tokens.weight"] = {c.vocab, d};
    s[lm + "model.norm.weight"] = {d};
    if (!c.tied) s[lm + "lm_head.weight"] = {c.vocab, d};
  } else {
    s[lm + "transformer.wte.weight"] = {c.vocab, d};
    ln(lm + "transformer.norm_f", d, false);
  }
  return s;
}

OpenFlamingo::OpenFlamingo(const Checkpoint& ck, at::ScalarType dtype, at::Device device)
    : cfg_(openflamingo_config(ck.config, ck.dir + "/config.json")) {
  // open_clip's projection to the contrastive space is not used by OpenFlamingo, nor ln_post
  // when the tokens are taken before it (open_clip <= 2.22, which the releases used).
  std::vector<std::string> unused{kVis + "proj"};
  if (!cfg_.v_tokens_ln_post) unused.push_back(kVis + "ln_post.");
  w_ = select_parameters(ck.tensors, openflamingo_shapes(cfg_), unused, dtype, ck.dir, device);
}

bool OpenFlamingo::trainable(const std::string& name) const { return name.rfind(kVis, 0) != 0; }

const Family& OpenFlamingo::family() const { return openflamingo::family(); }

std::vector<DecoderLayerAttention> OpenFlamingo::layer_attentions() const {
  std::vector<DecoderLayerAttention> a(static_cast<size_t>(cfg_.layers));
  for (int64_t i = 0; i < cfg_.layers; ++i) {
    a[static_cast<size_t>(i)].cross = cfg_.is_cross(i);
    a[static_cast<size_t>(i)].cross_first = true;
  }
  return a;
}

ModelConfig OpenFlamingo::planner_model(const OpenFlamingoConfig& c) {
  ModelConfig m;
  m.name = "openflamingo_" + c.lm;
  m.family = "openflamingo";
  m.dtype = "bf16";
  m.visual_tokens_per_frame = c.p_latents;
  m.visual_feature_dim = c.v_width;
  m.vision = {c.v_width, c.v_layers, c.v_heads, c.v_mlp, c.image_size, c.patch_size};
  for (int64_t i = 0; i < c.layers; ++i) {
    AttentionLayerConfig l;
    l.hidden_size = c.hidden;
    if (c.is_cross(i)) {  // the gated block runs before the decoder layer
      l.kind = LayerKind::kCross;
      l.heads = l.kv_heads = c.x_heads;
      l.head_dim = c.x_dim_head;
      l.mlp_size = c.x_ff;
      l.mask = MaskRule::kMediaImmediate;
      m.layers.push_back(l);
    }
    l.kind = LayerKind::kSelf;
    l.heads = c.heads;
    l.kv_heads = c.kv_heads;
    l.head_dim = c.head_dim;
    l.mlp_size = c.mlp;
    l.mask = MaskRule::kCausal;
    m.layers.push_back(l);
  }
  return m;
}

int64_t alibi_channels(at::ScalarType dtype) {
  return dtype == at::kFloat || dtype == at::kDouble ? 1 : 3;
}

namespace {

// MPT's ALiBi slopes (transformers' build_mpt_alibi_tensor).
at::Tensor alibi_slopes(int64_t heads, double bias_max, const at::TensorOptions& options) {
  const int64_t n2 =
      int64_t{1} << static_cast<int64_t>(std::ceil(std::log2(static_cast<double>(heads))));
  at::Tensor s = 1.0 / at::pow(2.0, at::arange(1, n2 + 1, options.dtype(at::kDouble)) *
                                        (bias_max / static_cast<double>(n2)));
  if (n2 != heads) s = at::cat({s.slice(0, 1, n2, 2), s.slice(0, 0, n2, 2)}).narrow(0, 0, heads);
  return s;
}

// The package's batches carry attention_mask (all ones: lvx runs unpadded samples) and
// images_per_sample (the <image> tokens of each sample): checked when given.
void check_package_inputs(const ModelInputs& in, int64_t media_token_id) {
  check_named_inputs(in, {"attention_mask", "images_per_sample"}, "OpenFlamingo");
  const at::Tensor& ids = in.input_ids;
  if (auto m = in.named.find("attention_mask"); m != in.named.end())
    LVX_CHECK(m->second.sizes() == ids.sizes() && m->second.ne(0).all().item<bool>(),
              "OpenFlamingo: attention_mask must be all ones with input_ids' shape ", ids.sizes(),
              " (lvx runs unpadded samples), got ", m->second.sizes());
  if (auto m = in.named.find("images_per_sample"); m != in.named.end()) {
    const at::Tensor counts = host_ids(ids).eq(media_token_id).sum(1);
    LVX_CHECK(m->second.dim() == 1 && m->second.size(0) == ids.size(0) &&
                  m->second.cpu().to(at::kLong).equal(counts),
              "OpenFlamingo: images_per_sample must be the <image> tokens of each sample ",
              counts.sizes(), ", got ", m->second.sizes());
  }
}

}  // namespace

int64_t OpenFlamingo::decoder_layer_of(const std::string& name) const {
  return layer_number_after(name, "lang_encoder." + cfg_.layers_attr + ".");
}

std::string OpenFlamingo::layer_prefix(int64_t layer) const {
  return "lang_encoder." + cfg_.layers_attr + "." + std::to_string(layer) + ".";
}

const at::Tensor& OpenFlamingo::embedding() const {
  const std::string lm = "lang_encoder.";
  return param(w_, lm + (cfg_.lm == "gpt_neox" ? "gpt_neox.embed_in.weight"
                         : cfg_.lm == "llama"  ? "model.embed_tokens.weight"
                                               : "transformer.wte.weight"));
}

const at::Tensor& OpenFlamingo::lm_head() const {
  if (cfg_.lm == "gpt_neox") return param(w_, "lang_encoder.embed_out.weight");
  if (cfg_.lm == "llama" && !cfg_.tied) return param(w_, "lang_encoder.lm_head.weight");
  return embedding();  // MPT and a tied Llama
}

at::Tensor OpenFlamingo::final_norm(const at::Tensor& x) const {
  if (cfg_.lm == "gpt_neox")
    return layer_norm(x, w_, "lang_encoder.gpt_neox.final_layer_norm", cfg_.eps);
  if (cfg_.lm == "llama") return rms_norm(x, param(w_, "lang_encoder.model.norm.weight"), cfg_.eps);
  return layer_norm(x, w_, "lang_encoder.transformer.norm_f", cfg_.eps);
}

double OpenFlamingo::self_scale() const {
  return 1.0 / std::sqrt(static_cast<double>(cfg_.head_dim));
}

OpenFlamingo::SelfQKV OpenFlamingo::self_qkv(int64_t layer, const at::Tensor& x,
                                             const at::Tensor& positions) const {
  const OpenFlamingoConfig& c = cfg_;
  const std::string l = layer_prefix(layer) + "decoder_layer.";
  const int64_t B = x.size(0), S = x.size(1), hd = c.head_dim;
  if (c.lm == "gpt_neox") {
    // query_key_value: per head its own [q | k | v].
    const RotaryTables rope = rotary_tables(positions, c.rotary_dim, c.rotary_base);
    const auto parts = linear(layer_norm(x, w_, l + "input_layernorm", c.eps), w_,
                              l + "attention.query_key_value", true)
                           .view({B, S, c.heads, 3 * hd})
                           .split(hd, -1);
    return {apply_rotary(parts[0], rope), apply_rotary(parts[1], rope), parts[2]};
  }
  if (c.lm == "llama") {
    const RotaryTables rope = rotary_tables(positions, c.rotary_dim, c.rotary_base);
    const at::Tensor h = rms_norm(x, param(w_, l + "input_layernorm.weight"), c.eps);
    auto proj = [&](const char* name, int64_t heads) {
      return linear(h, w_, l + "self_attn." + name, false).view({B, S, heads, hd});
    };
    return {apply_rotary(proj("q_proj", c.heads), rope),
            apply_rotary(proj("k_proj", c.kv_heads), rope), proj("v_proj", c.kv_heads)};
  }
  // MPT: ALiBi as extra head channels, q' = [q, 1…], k' = [k, slope_h·j/scale split over the
  // channels], v' = [v, 0…]. The attention computes scores in fp32, so the bias is exact but for
  // how its channels are stored: in bf16 one channel would keep 8 significant bits of
  // slope·j/scale (at position 2047 of MPT-7B an error of several logits); the hi/mid/lo split
  // (each channel the rounding of what the ones before left) keeps 24 bits, as fp32 does.
  const auto qkv =
      linear(layer_norm(x, w_, l + "norm_1", c.eps), w_, l + "attn.Wqkv", false).chunk(3, -1);
  auto heads = [&](const at::Tensor& t) { return t.reshape({B, S, c.heads, hd}); };
  const int64_t n = alibi_channels(x.scalar_type());
  // In float64 on the positions' device (the activations'), split into x's dtype there.
  // positions [S], or [B, S] (rows at their own positions: decode_rows).
  const at::Tensor pos = positions.dim() == 1
                             ? positions.view({1, -1, 1, 1})
                             : positions.view({positions.size(0), positions.size(1), 1, 1});
  at::Tensor rest =
      pos.to(at::kDouble) *
      alibi_slopes(c.heads, c.alibi_bias_max, positions.options()).view({1, 1, -1, 1}) /
      self_scale();
  std::vector<at::Tensor> parts;
  for (int64_t i = 0; i < n; ++i) {
    parts.push_back(rest.to(x.scalar_type()));
    rest = rest - parts.back().to(at::kDouble);
  }
  const at::Tensor alibi_k = at::cat(parts, -1).expand({B, S, c.heads, n});
  const at::Tensor one = at::ones({B, S, c.heads, n}, x.options());
  return {at::cat({heads(qkv[0]), one}, -1), at::cat({heads(qkv[1]), alibi_k}, -1),
          at::cat({heads(qkv[2]), at::zeros_like(one)}, -1)};
}

at::Tensor OpenFlamingo::post_attention(int64_t layer, const at::Tensor& x, const at::Tensor& a,
                                        bool remat) const {
  const OpenFlamingoConfig& c = cfg_;
  const std::string l = layer_prefix(layer) + "decoder_layer.";
  // One segment (output projection, residuals, norm, MLP), which --remat recomputes in the
  // backward instead of keeping (never the distributed attention).
  std::vector<at::Tensor> p;
  SegmentFunction post;
  const double eps = c.eps;
  if (c.lm == "gpt_neox") {
    for (const char* n :
         {"attention.dense.weight", "attention.dense.bias", "post_attention_layernorm.weight",
          "post_attention_layernorm.bias", "mlp.dense_h_to_4h.weight", "mlp.dense_h_to_4h.bias",
          "mlp.dense_4h_to_h.weight", "mlp.dense_4h_to_h.bias"})
      p.push_back(param(w_, l + n));
    post = [eps, act = c.act, parallel = c.parallel_residual](const std::vector<at::Tensor>& in,
                                                              const std::vector<at::Tensor>& w) {
      const at::Tensor attn = models::linear(in[1], w[0], w[1]);
      auto mlp = [&](const at::Tensor& t) {
        return models::linear(
            activation(models::linear(at::layer_norm(t, {t.size(-1)}, w[2], w[3], eps), w[4], w[5]),
                       act),
            w[6], w[7]);
      };
      if (parallel) return std::vector<at::Tensor>{in[0] + attn + mlp(in[0])};
      const at::Tensor r = in[0] + attn;
      return std::vector<at::Tensor>{r + mlp(r)};
    };
  } else if (c.lm == "llama") {
    for (const char* n : {"self_attn.o_proj.weight", "post_attention_layernorm.weight",
                          "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"})
      p.push_back(param(w_, l + n));
    post = [eps, act = c.act](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>& w) {
      const at::Tensor r = in[0] + models::linear(in[1], w[0]);
      const at::Tensor h2 = rms_norm(r, w[1], eps);
      return std::vector<at::Tensor>{
          r + models::linear(activation(models::linear(h2, w[2]), act) * models::linear(h2, w[3]),
                             w[4])};
    };
  } else {
    for (const char* n :
         {"attn.out_proj.weight", "norm_2.weight", "ffn.up_proj.weight", "ffn.down_proj.weight"})
      p.push_back(param(w_, l + n));
    post = [eps](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>& w) {
      const at::Tensor r = in[0] + models::linear(in[1], w[0]);
      const at::Tensor h2 = at::layer_norm(r, {r.size(-1)}, w[1], {}, eps);
      return std::vector<at::Tensor>{r + models::linear(at::gelu(models::linear(h2, w[2])), w[3])};
    };
  }
  return remat ? checkpoint_segment(post, {x, a}, p)[0] : post({x, a}, p)[0];
}

at::Tensor OpenFlamingo::cross_query(int64_t layer, const at::Tensor& x) const {
  const std::string g = layer_prefix(layer) + "gated_cross_attn_layer.";
  return linear(layer_norm(x, w_, g + "attn.norm", cfg_.x_eps), w_, g + "attn.to_q", false)
      .view({x.size(0), x.size(1), cfg_.x_heads, cfg_.x_dim_head});
}

std::pair<at::Tensor, at::Tensor> OpenFlamingo::cross_kv(int64_t layer,
                                                         const at::Tensor& media) const {
  const std::string g = layer_prefix(layer) + "gated_cross_attn_layer.";
  const auto kv = linear(media, w_, g + "attn.to_kv", false).chunk(2, -1);
  const std::vector<int64_t> shape{media.size(0), media.size(1), cfg_.x_heads, cfg_.x_dim_head};
  return {kv[0].reshape(shape), kv[1].reshape(shape)};
}

at::Tensor OpenFlamingo::cross_output(int64_t layer, const at::Tensor& x,
                                      const at::Tensor& o) const {
  const std::string g = layer_prefix(layer) + "gated_cross_attn_layer.";
  const at::Tensor y =
      x + linear(o, w_, g + "attn.to_out", false) * at::tanh(param(w_, g + "attn_gate"));
  return y +
         linear(at::gelu(linear(layer_norm(y, w_, g + "ff.0", cfg_.x_eps), w_, g + "ff.1", false)),
                w_, g + "ff.3", false) *
             at::tanh(param(w_, g + "ff_gate"));
}

LocalMedia OpenFlamingo::local_media(const ModelInputs& in, const Parallel& par,
                                     const attention::MediaMask& mm,
                                     const at::TensorOptions& options) const {
  const at::ScalarType dt = options.dtype().toScalarType();
  return encode_local_media(
      mm, in.pixel_values, in.pixels_local, par, cfg_.v_width,
      [&](const at::Tensor& px) { return perceiver(w_, cfg_, clip_tokens(w_, cfg_, px.to(dt))); },
      options, "OpenFlamingo", in.media);
}

ModelOutputs OpenFlamingo::forward(const ModelInputs& in, const Parallel& par) const {
  return run(in, par, nullptr);
}

ModelOutputs OpenFlamingo::run(const ModelInputs& in, const Parallel& par,
                               DecodeCache* cache) const {
  const OpenFlamingoConfig& c = cfg_;
  check_package_inputs(in, c.media_token_id);
  const at::Tensor& ids = in.input_ids;
  const int64_t B = ids.size(0), L = ids.size(1), hd = c.head_dim, T = c.p_latents;
  const at::Tensor& emb = embedding();
  const at::ScalarType dt = emb.scalar_type();
  const TextShard shard = embed_text_shard(ids, emb, par, "OpenFlamingo");
  const at::Tensor& pos = shard.positions;
  at::Tensor x = shard.hidden;

  // Media: OpenFlamingo's rule (most recent image; the <image> token its own); this rank's
  // images through the ViT and the resampler.
  // The media layout on the host (which rank encodes which image), its tensors on x's device.
  const attention::MediaMask mm =
      attention::media_mask(kMediaMaskImmediate, host_ids(ids), c.media_token_id, T);
  const attention::MediaMask mmd = media_mask_on(mm, x.device());
  LocalMedia media;
  const auto encode_start = std::chrono::steady_clock::now();
  if (mm.slots > 0) media = local_media(in, par, mm, x.options());
  const attention::MaskInputs cross_mask{mmd.q_media, mmd.kv_media, {}};
  at::Tensor last_image;  // bool [B, slots_r·T]: this rank's keys of each sample's last image
  if (cache) {
    start_prompt_cache(*cache, c.layers, B, L, encode_start);
    // A generated token sees its sample's last image only (the package's use_cached_media).
    const at::Tensor images = host_ids(ids).eq(c.media_token_id).sum(1).to(x.device());  // [B]
    cache->sees_media = images.gt(0);
    if (mm.slots > 0) {
      const at::Tensor local = mmd.kv_media.index_select(1, media.key_index(T).to(x.device()));
      last_image = local.ge(0) & local.eq((images - 1).unsqueeze(1).to(local.scalar_type()));
    }
  }

  attention::AttentionSpec self_spec =
      self_attention_spec(B, L, c.heads, c.kv_heads, c.head_dim, par);
  if (c.lm == "mpt") self_spec.head_dim = hd + alibi_channels(dt);  // the ALiBi channels
  self_spec.scale = self_scale();
  const attention::AttentionSpec cross_spec =
      cross_attention_spec(B, L, c.x_heads, c.x_heads, c.x_dim_head, mm, par);
  for (int64_t i = 0; i < c.layers; ++i) {
    par.enter_layer(i, x);
    const size_t li = static_cast<size_t>(i);
    const LayerStrategies& st = par.at(li);
    const int64_t lr = x.size(1);
    if (c.is_cross(i) && mm.slots > 0) {
      const auto [k, v] = cross_kv(i, media.features);
      const auto o = attention::dist_attention(cross_query(i, x), k, v, par.pg, st.cross,
                                               cross_spec, cross_mask);
      if (cache) cache->visual[li] = visual_shard(k, v, last_image);
      x = cross_output(i, x, o.o.reshape({B, lr, c.x_heads * c.x_dim_head}));
    }
    const SelfQKV qkv = self_qkv(i, x, pos);
    if (cache) cache->prompt[li] = {qkv.k, qkv.v, {}};
    // The attention's output before the output projection, [B, L_r, H·hd] (MPT: without the
    // ALiBi channel).
    const at::Tensor a = attention::dist_attention(qkv.q, qkv.k, qkv.v, par.pg, st.self, self_spec)
                             .o.narrow(-1, 0, hd)
                             .reshape({B, lr, c.heads * hd});
    x = post_attention(i, x, a, par.remat);
  }
  par.leave_layers(x);
  x = final_norm(x);
  if (cache) return {x, shard.host_positions};
  return {lora_linear(x, lm_head(), c10::nullopt), shard.host_positions};  // LoRA on lm_head too
}

}  // namespace lvx::models
