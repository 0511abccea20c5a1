#include "models/mplug_owl3/model.h"

#include <c10/core/GradMode.h>

#include <algorithm>
#include <chrono>
#include <cmath>

#include "models/layers.h"
#include "models/recompute.h"
#include "src/attention/dist_attention.h"
#include "src/common/error.h"

namespace lvx::models {

namespace {

const std::string kLm = "language_model.model.";
const std::string kVision = "vision_model.";

std::string layer_prefix(int64_t i) { return kLm + "layers." + std::to_string(i) + "."; }

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

planner::ModelConfig MplugOwl3::planner_model(const MplugOwl3Config& c) {
  planner::ModelConfig m;
  m.name = "mplug_owl3_" + c.variant;
  m.family = "mplug_owl3";
  m.dtype = "bf16";
  m.visual_tokens_per_frame = c.vision.tokens();
  m.visual_feature_dim = c.hidden;  // image_embeds have the LM width
  m.vision = {c.vision.hidden,     c.vision.layers - 1, c.vision.heads, c.vision.mlp,  // layers run
              c.vision.image_size, c.vision.patch_size};
  for (int64_t i = 0; i < c.layers; ++i) {
    planner::AttentionLayerConfig l;
    l.hidden_size = c.hidden;
    l.heads = c.heads;
    l.kv_heads = c.kv_heads;
    l.head_dim = c.head_dim;
    l.mlp_size = c.intermediate;
    l.kind = planner::LayerKind::kSelf;
    l.mask = planner::MaskRule::kCausal;
    m.layers.push_back(l);
    if (c.is_hyper(i)) {  // the same queries against the visual keys, beside the self layer
      l.kind = planner::LayerKind::kCross;
      l.mask = planner::MaskRule::kMediaUpTo;
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
  const at::ScalarType dt = emb.scalar_type();

  // Media: per-token indices under this release's rule; this rank's whole images.
  // The media layout on the host (which rank encodes which image), its tensors on h's device.
  const attention::MediaMask mm =
      attention::media_mask(c.media_rule(), host_ids(ids), c.image_token_id, T);
  const attention::MediaMask mmd = media_mask_on(mm, h.device());
  const int64_t slots = mm.slots;
  LocalVisual vis;
  const auto encode_start = std::chrono::steady_clock::now();
  if (slots > 0) {
    const LocalMedia media = encode_local_media(
        mm, in.pixel_values, in.pixels_local, par, c.hidden,
        [&](const at::Tensor& px) {  // SigLIP hidden_states[-2], then the projector
          const at::Tensor v =
              siglip_forward(w_, kVision, c.vision, px.to(dt), c.vision.layers - 1);
          return linear(at::gelu(linear(v, w_, "vision2text_model.0", true)), w_,
                        "vision2text_model.2", true);
        },
        h.options(), "mPLUG-Owl3", in.media);
    vis.features = media.features;
    // MI-RoPE: every key of image j at its token's index (+1 for 240728/241014).
    const int64_t shift = c.variant == "241101" ? 0 : 1;
    const int64_t S = static_cast<int64_t>(media.slots.size());
    const at::Tensor starts =
        mmd.media_starts.index_select(1, media.slot_index().to(h.device())).clamp_min(0) + shift;
    vis.key_positions = starts.unsqueeze(2).expand({B, S, T}).reshape({B, -1});
    vis.kv_media = mmd.kv_media.index_select(1, media.key_index(T).to(h.device()));
  }
  if (cache) {
    *cache = DecodeCache{};
    cache->encode_seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - encode_start).count();
    cache->prompt.resize(static_cast<size_t>(c.layers));
    cache->visual.resize(static_cast<size_t>(c.layers));
    cache->new_k.resize(static_cast<size_t>(c.layers));
    cache->new_v.resize(static_cast<size_t>(c.layers));
    cache->length = L;
    cache->batch = B;
    // A generated token comes after every image: it sees all of its sample's images.
    cache->sees_media =
        slots > 0 ? (mmd.media_starts >= 0).any(1) : at::zeros({B}, h.options().dtype(at::kBool));
  }

  const RotaryTables rope = rotary_tables(pos, c.head_dim, c.rope_theta);
  const attention::MaskInputs cross_mask{mmd.q_media, mmd.kv_media, {}};
  const at::Tensor sees_image = mmd.q_media.index_select(1, pos).ge(0).unsqueeze(-1);  // [B,L_r,1]
  for (int64_t i = 0; i < c.layers; ++i) {
    par.enter_layer(i, h);
    const std::string l = layer_prefix(i);
    const LayerStrategies& st = par.at(static_cast<size_t>(i));
    const at::Tensor& norm_w = param(w_, l + "input_layernorm.weight");
    const at::Tensor x = rms_norm(h, norm_w, c.rms_eps);
    const int64_t lr = x.size(1);
    at::Tensor q = linear(x, w_, l + "self_attn.q_proj", true).view({B, lr, c.heads, c.head_dim});
    at::Tensor k =
        linear(x, w_, l + "self_attn.k_proj", true).view({B, lr, c.kv_heads, c.head_dim});
    at::Tensor v =
        linear(x, w_, l + "self_attn.v_proj", true).view({B, lr, c.kv_heads, c.head_dim});
    q = apply_rotary(q, rope);
    k = apply_rotary(k, rope);
    if (cache) cache->prompt[static_cast<size_t>(i)] = {k, v, {}};
    const attention::AttentionSpec self_spec =
        self_attention_spec(B, L, c.heads, c.kv_heads, c.head_dim, par);
    const auto self = attention::dist_attention(q, k, v, par.pg, st.self, self_spec);
    at::Tensor ctx = self.o.reshape({B, lr, c.heads * c.head_dim});
    if (c.is_hyper(i) && slots > 0) {
      // The visual K/V of this layer from the shared features: the text's RMSNorm weights,
      // then v_kv_proj with head-major channels (per K/V head: its K block, then its V block),
      // keys rotated by MI-RoPE. Captures by value: with recomputation it runs again in the
      // backward.
      const RotaryTables mi_rope = rotary_tables(vis.key_positions, c.head_dim, c.rope_theta);
      const int64_t hkv = c.kv_heads, d = c.head_dim;
      const double eps = c.rms_eps;
      KVFunction kv_fn = [mi_rope, hkv, d, eps](const at::Tensor& y,
                                                const std::vector<at::Tensor>& p) {
        const at::Tensor kv = models::linear(rms_norm(y, p[0], eps), p[1], p[2])
                                  .view({y.size(0), y.size(1), hkv, 2, d});
        return std::make_pair(apply_rotary(kv.select(3, 0), mi_rope), kv.select(3, 1));
      };
      const std::vector<at::Tensor> kv_params{norm_w, param(w_, l + "self_attn.v_kv_proj.weight"),
                                              param(w_, l + "self_attn.v_kv_proj.bias")};
      const attention::AttentionSpec cross_spec =
          cross_attention_spec(B, L, c.heads, c.kv_heads, c.head_dim, mm, par);
      attention::DistAttentionResult cross;
      if (par.recompute_cross_kv && !cache) {
        cross = cross_attention_recompute(q, vis.features, kv_params, kv_fn, par.pg, st.cross,
                                          cross_spec, cross_mask);
      } else {
        const auto [kv_k, kv_v] = kv_fn(vis.features, kv_params);
        cross = attention::dist_attention(q, kv_k, kv_v, par.pg, st.cross, cross_spec, cross_mask);
        if (cache) cache->visual[static_cast<size_t>(i)] = {kv_k, kv_v, vis.kv_media.ge(0)};
      }
      if (c.variant == "240728") {
        const at::Tensor g = at::sigmoid(param(w_, l + "self_attn.gate"));
        const at::Tensor xo = cross.o.reshape({B, lr, c.heads * c.head_dim});
        ctx = at::where(sees_image, ctx * (1 - g) + xo * g, ctx);
      } else {
        // One softmax over [visual | text] keys = the two partial results merged by their lse.
        const at::Tensor lse = at::logaddexp(self.lse, cross.lse);  // [B, Hq, L_r]
        auto weight = [&](const at::Tensor& part) {
          return at::exp(part - lse).transpose(1, 2).unsqueeze(-1).to(dt);  // [B, L_r, Hq, 1]
        };
        ctx = (self.o * weight(self.lse) + cross.o * weight(cross.lse))
                  .reshape({B, lr, c.heads * c.head_dim});
      }
    }
    // The block after its attention: o_proj, residual, norm, MLP, residual.
    h = post_attention(i, h, ctx, par.remat);
  }
  par.leave_layers(h);
  h = rms_norm(h, param(w_, kLm + "norm.weight"), c.rms_eps);
  if (cache) return {h, shard.host_positions};
  return {at::linear(h, lm_head()), shard.host_positions};
}

const at::Tensor& MplugOwl3::lm_head() const {
  return cfg_.tie_embeddings ? param(w_, kLm + "embed_tokens.weight")
                             : param(w_, "language_model.lm_head.weight");
}

at::Tensor MplugOwl3::prefill(const ModelInputs& in, const Parallel& par,
                              DecodeCache& cache) const {
  c10::AutoGradMode no_grad(false);
  const ModelOutputs out = run(in, par, &cache);
  return last_token_logits(out.logits, out.positions, in.input_ids.size(1), lm_head(), *par.pg);
}

at::Tensor MplugOwl3::decode_step(const at::Tensor& tokens, const Parallel& par,
                                  DecodeCache& cache) const {
  c10::AutoGradMode no_grad(false);
  const MplugOwl3Config& c = cfg_;
  const int64_t B = cache.batch, hq = c.heads, hkv = c.kv_heads, d = c.head_dim;
  LVX_CHECK(tokens.dim() == 1 && tokens.size(0) == B, "decode: expected one token per sample (", B,
            "), got ", tokens.sizes());
  const at::Tensor& emb = param(w_, kLm + "embed_tokens.weight");
  at::Tensor h = at::embedding(emb, tokens.to(emb.device(), at::kLong).unsqueeze(1));  // [B, 1, H]
  const RotaryTables rope = rotary_tables(
      at::full({1}, cache.length, emb.options().dtype(at::kLong)), c.head_dim, c.rope_theta);
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  for (int64_t i = 0; i < c.layers; ++i) {
    const std::string l = layer_prefix(i);
    const size_t li = static_cast<size_t>(i);
    const at::Tensor x = rms_norm(h, param(w_, l + "input_layernorm.weight"), c.rms_eps);
    at::Tensor q = linear(x, w_, l + "self_attn.q_proj", true).view({B, 1, hq, d});
    at::Tensor k = linear(x, w_, l + "self_attn.k_proj", true).view({B, 1, hkv, d});
    const at::Tensor v = linear(x, w_, l + "self_attn.v_proj", true).view({B, 1, hkv, d});
    q = apply_rotary(q, rope);
    k = apply_rotary(k, rope);
    cache.new_k[li].push_back(k);
    cache.new_v[li].push_back(v);
    const at::Tensor q1 = q.squeeze(1);  // [B, Hq, D]
    // This rank's prompt keys (and visual keys), merged over the ranks in one message; the
    // generated tokens' keys are on every rank and join after.
    std::vector<Partial> local{partial_attention(q1, cache.prompt[li].k, cache.prompt[li].v,
                                                 cache.prompt[li].visible, scale)};
    const KVShard& vis = cache.visual[li];
    const bool cross = c.is_hyper(i) && vis.k.defined();
    if (cross) local.push_back(partial_attention(q1, vis.k, vis.v, vis.visible, scale));
    const std::vector<Partial> merged = merge_across_ranks(*par.pg, local);
    const Partial generated =
        partial_attention(q1, at::cat(cache.new_k[li], 1), at::cat(cache.new_v[li], 1), {}, scale);
    const Partial self = merge_partials({merged[0], generated});
    const at::Tensor ctx = decode_mix(i, self, cross ? &merged[1] : nullptr, cache.sees_media);
    h = post_attention(i, h, ctx.reshape({B, 1, hq * d}).to(h.scalar_type()), /*remat=*/false);
  }
  ++cache.length;
  h = rms_norm(h, param(w_, kLm + "norm.weight"), c.rms_eps);
  return at::linear(h.squeeze(1), lm_head()).to(at::kFloat);
}

at::Tensor MplugOwl3::decode_mix(int64_t i, const Partial& self, const Partial* visual,
                                 const at::Tensor& sees_media) const {
  const int64_t B = self.o.size(0), hd = cfg_.heads * cfg_.head_dim;
  if (visual == nullptr) return self.o.reshape({B, hd});
  if (cfg_.variant == "240728") {
    const at::Tensor g =
        at::sigmoid(param(w_, layer_prefix(i) + "self_attn.gate")).to(at::kFloat);
    const at::Tensor xo = visual->o.reshape({B, hd}), so = self.o.reshape({B, hd});
    return at::where(sees_media.unsqueeze(1), so * (1 - g) + xo * g, so);
  }
  return merge_partials({*visual, self}).o.reshape({B, hd});  // one softmax over both
}

namespace {

// Row r's queries q[r] ([T_r, Hq, D]) over its cached prompt keys (visual: its visual keys;
// none where it has none): the rows that hold the same key tensors (questions about one cached
// video) in one shared_partial_attention call, their queries side by side. Row r's partial is
// [T_r, Hq, D] / [T_r, Hq].
std::vector<Partial> shared_partials(const std::vector<at::Tensor>& q,
                                     const std::vector<DecodeCache*>& caches, size_t layer,
                                     bool visual, double scale) {
  std::vector<Partial> out(caches.size());
  std::vector<bool> done(caches.size(), false);
  for (size_t r = 0; r < caches.size(); ++r) {
    const KVShard& kv = visual ? caches[r]->visual[layer] : caches[r]->prompt[layer];
    if (done[r] || !kv.k.defined()) continue;
    std::vector<size_t> group;
    std::vector<at::Tensor> queries;
    for (size_t s = r; s < caches.size(); ++s) {
      const KVShard& o = visual ? caches[s]->visual[layer] : caches[s]->prompt[layer];
      if (!done[s] && o.k.defined() && o.k.is_same(kv.k) && o.v.is_same(kv.v) &&
          o.visible.defined() == kv.visible.defined() &&
          (!kv.visible.defined() || o.visible.is_same(kv.visible))) {
        group.push_back(s);
        queries.push_back(q[s]);
        done[s] = true;
      }
    }
    const Partial p =
        shared_partial_attention(at::cat(queries, 0), kv.k, kv.v, kv.visible, scale);
    for (size_t j = 0, at = 0; j < group.size(); ++j) {
      const int64_t t = q[group[j]].size(0);
      out[group[j]] = {p.o.narrow(0, static_cast<int64_t>(at), t),
                       p.lse.narrow(0, static_cast<int64_t>(at), t)};
      at += static_cast<size_t>(t);
    }
  }
  return out;
}

// T new queries q [B, T, Hq, D] against the generated keys nk/nv [B, before + T, Hkv, D] (the
// tokens before them, then their own), causal: token t sees keys [0, before + t]. One product
// in the accumulation dtype; o [B, T, Hq, D], lse [B, T, Hq].
Partial causal_new_keys(const at::Tensor& q, const at::Tensor& nk, const at::Tensor& nv,
                        int64_t before, double scale) {
  const int64_t B = q.size(0), T = q.size(1), hq = q.size(2), D = q.size(3);
  const int64_t S = nk.size(1), hkv = nk.size(2), g = hq / hkv;
  const auto acc = kernels::accumulation_dtype(q.scalar_type());
  const at::Tensor qq = q.to(acc).view({B, T, hkv, g, D}).permute({0, 2, 3, 1, 4});  // B,Hkv,g,T,D
  const at::Tensor kk = nk.to(acc).permute({0, 2, 3, 1}).unsqueeze(2);  // [B, Hkv, 1, D, S]
  const at::Tensor vv = nv.to(acc).permute({0, 2, 1, 3}).unsqueeze(2);  // [B, Hkv, 1, S, D]
  at::Tensor sc = at::matmul(qq, kk).mul_(scale);                        // [B, Hkv, g, T, S]
  const at::Tensor hidden =  // key s is after token t: s > before + t
      at::arange(S, q.options().dtype(at::kLong)).unsqueeze(0) >
      (at::arange(T, q.options().dtype(at::kLong)) + before).unsqueeze(1);
  sc.masked_fill_(hidden, -std::numeric_limits<double>::infinity());
  const at::Tensor lse = at::logsumexp(sc, -1);                         // [B, Hkv, g, T]
  const at::Tensor o = at::matmul(at::exp(sc - lse.unsqueeze(-1)), vv);  // [B, Hkv, g, T, D]
  return {o.permute({0, 3, 1, 2, 4}).reshape({B, T, hq, D}),
          lse.permute({0, 3, 1, 2}).reshape({B, T, hq})};
}

Partial stack_partials(const std::vector<Partial>& rows) {
  std::vector<at::Tensor> o, lse;
  for (const Partial& p : rows) {
    o.push_back(p.o);
    lse.push_back(p.lse);
  }
  return {at::cat(o, 0), at::cat(lse, 0)};
}

// Every row's query q [R, Hq, D] against its own generated keys (the question's tokens after a
// kept prefix, and the answer so far): each row's keys padded to the longest row's count and the
// padding masked, as one batched product in the accumulation dtype (a few dozen keys per row:
// the kernels' per-row calls would cost more than the arithmetic).
Partial generated_partial(const at::Tensor& q, const std::vector<DecodeCache*>& caches,
                          size_t layer, double scale) {
  std::vector<at::Tensor> k, v;
  int64_t longest = 0;
  for (DecodeCache* kc : caches) {
    k.push_back(at::cat(kc->new_k[layer], 1));
    v.push_back(at::cat(kc->new_v[layer], 1));
    longest = std::max(longest, k.back().size(1));
  }
  if (caches.size() == 1) return partial_attention(q, k[0], v[0], {}, scale);
  const int64_t R = static_cast<int64_t>(caches.size()), hq = q.size(1), D = q.size(2);
  const int64_t hkv = k[0].size(2), g = hq / hkv;
  std::vector<int64_t> lengths;
  for (size_t r = 0; r < caches.size(); ++r) {
    lengths.push_back(k[r].size(1));
    if (k[r].size(1) < longest) {
      k[r] = at::constant_pad_nd(k[r], {0, 0, 0, 0, 0, longest - k[r].size(1)});
      v[r] = at::constant_pad_nd(v[r], {0, 0, 0, 0, 0, longest - v[r].size(1)});
    }
  }
  const auto acc = kernels::accumulation_dtype(q.scalar_type());
  const at::Tensor hidden =  // key t of row r is padding: t >= its length
      at::arange(longest, q.options().dtype(at::kLong)).unsqueeze(0) >=
      at::tensor(lengths, at::kLong).to(q.device()).unsqueeze(1);
  const at::Tensor kk = at::cat(k, 0).to(acc).permute({0, 2, 3, 1});  // [R, Hkv, D, T]
  const at::Tensor vv = at::cat(v, 0).to(acc).permute({0, 2, 1, 3});  // [R, Hkv, T, D]
  at::Tensor sc = at::matmul(q.to(acc).view({R, hkv, g, D}), kk).mul_(scale);  // [R, Hkv, g, T]
  sc.masked_fill_(hidden.view({R, 1, 1, longest}), -std::numeric_limits<double>::infinity());
  const at::Tensor lse = at::logsumexp(sc, -1);  // [R, Hkv, g]
  const at::Tensor o = at::matmul(at::exp(sc - lse.unsqueeze(-1)), vv);
  return {o.reshape({R, hq, D}), lse.reshape({R, hq})};
}

}  // namespace

at::Tensor MplugOwl3::decode_rows(const at::Tensor& tokens, const Parallel& par,
                                  const std::vector<DecodeCache*>& caches) const {
  c10::AutoGradMode no_grad(false);
  const MplugOwl3Config& c = cfg_;
  const int64_t R = static_cast<int64_t>(caches.size()), hq = c.heads, hkv = c.kv_heads,
                d = c.head_dim;
  LVX_CHECK(tokens.dim() == 1 && tokens.size(0) == R, "decode_rows: expected one token per row (",
            R, "), got ", tokens.sizes());
  std::vector<int64_t> lengths;
  for (const DecodeCache* k : caches) {
    LVX_CHECK(k->batch == 1, "decode_rows: each row's cache holds one sample, got ", k->batch);
    lengths.push_back(k->length);
  }
  const at::Tensor& emb = param(w_, kLm + "embed_tokens.weight");
  at::Tensor h = at::embedding(emb, tokens.to(emb.device(), at::kLong).unsqueeze(1));  // [R, 1, H]
  // Each row at its own position: tables [R, 1, rot].
  const RotaryTables rope = rotary_tables(
      at::tensor(lengths, at::kLong).to(emb.device()).unsqueeze(1), c.head_dim, c.rope_theta);
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  for (int64_t i = 0; i < c.layers; ++i) {
    const std::string l = layer_prefix(i);
    const size_t li = static_cast<size_t>(i);
    // The projections and the MLP of every row in one product each (the weights read once).
    const at::Tensor x = rms_norm(h, param(w_, l + "input_layernorm.weight"), c.rms_eps);
    const at::Tensor q =
        apply_rotary(linear(x, w_, l + "self_attn.q_proj", true).view({R, 1, hq, d}), rope);
    const at::Tensor k =
        apply_rotary(linear(x, w_, l + "self_attn.k_proj", true).view({R, 1, hkv, d}), rope);
    const at::Tensor v = linear(x, w_, l + "self_attn.v_proj", true).view({R, 1, hkv, d});
    // Each row's cached keys (its prompt prefix, its video's visual keys): rows that hold the
    // same tensors (questions about one cached video) in one call; every row's partials in one
    // pass-Q message, row by row.
    std::vector<bool> cross(static_cast<size_t>(R));
    for (int64_t r = 0; r < R; ++r) {
      DecodeCache& kc = *caches[static_cast<size_t>(r)];
      kc.new_k[li].push_back(k.narrow(0, r, 1));
      kc.new_v[li].push_back(v.narrow(0, r, 1));
      cross[static_cast<size_t>(r)] = c.is_hyper(i) && kc.visual[li].k.defined();
    }
    const at::Tensor q1 = q.squeeze(1);  // [R, Hq, D]
    std::vector<at::Tensor> per_row;
    for (int64_t r = 0; r < R; ++r) per_row.push_back(q1.narrow(0, r, 1));
    const std::vector<Partial> text = shared_partials(per_row, caches, li, /*visual=*/false, scale);
    const std::vector<Partial> image = shared_partials(per_row, caches, li, /*visual=*/true, scale);
    std::vector<Partial> local;
    for (size_t r = 0; r < static_cast<size_t>(R); ++r) {
      local.push_back(text[r]);
      if (cross[r]) local.push_back(image[r]);
    }
    const std::vector<Partial> merged = merge_across_ranks(*par.pg, local);
    // The rows' merged partials stacked [R, ...]; the generated keys of every row (its question
    // and answer so far, on every rank) in one call, each row's padded to the longest.
    std::vector<Partial> text_r, image_r;
    for (size_t r = 0, at = 0; r < static_cast<size_t>(R); ++r) {
      text_r.push_back(merged[at]);
      if (cross[r]) image_r.push_back(merged[at + 1]);
      at += cross[r] ? 2 : 1;
    }
    const Partial self = merge_partials({stack_partials(text_r), generated_partial(q1, caches, li,
                                                                                   scale)});
    at::Tensor ctx;
    if (image_r.size() == static_cast<size_t>(R) || image_r.empty()) {
      std::vector<at::Tensor> sees;
      for (DecodeCache* kc : caches) sees.push_back(kc->sees_media);
      const Partial image = image_r.empty() ? Partial{} : stack_partials(image_r);
      ctx = decode_mix(i, self, image_r.empty() ? nullptr : &image, at::cat(sees));
    } else {  // rows with and without images: mixed row by row
      std::vector<at::Tensor> rows;
      for (size_t r = 0, k = 0; r < static_cast<size_t>(R); ++r) {
        const auto rr = static_cast<int64_t>(r);
        const Partial own{self.o.narrow(0, rr, 1), self.lse.narrow(0, rr, 1)};
        rows.push_back(decode_mix(i, own, cross[r] ? &image_r[k] : nullptr,
                                  caches[r]->sees_media));
        k += cross[r] ? 1 : 0;
      }
      ctx = at::cat(rows, 0);
    }
    h = post_attention(i, h, ctx.reshape({R, 1, hq * d}).to(h.scalar_type()), /*remat=*/false);
  }
  for (DecodeCache* k : caches) ++k->length;
  h = rms_norm(h, param(w_, kLm + "norm.weight"), c.rms_eps);
  return at::linear(h.squeeze(1), lm_head()).to(at::kFloat);
}

at::Tensor MplugOwl3::extend(const at::Tensor& tokens, const Parallel& par,
                             DecodeCache& cache) const {
  c10::AutoGradMode no_grad(false);
  const MplugOwl3Config& c = cfg_;
  const int64_t B = cache.batch, hq = c.heads, hkv = c.kv_heads, d = c.head_dim, g = hq / hkv;
  LVX_CHECK(tokens.dim() == 2 && tokens.size(0) == B && tokens.size(1) >= 1, "extend: expected [",
            B, ", T >= 1] tokens, got ", tokens.sizes());
  const int64_t T = tokens.size(1);
  const at::Tensor& emb = param(w_, kLm + "embed_tokens.weight");
  at::Tensor h = at::embedding(emb, tokens.to(emb.device(), at::kLong));  // [B, T, H]
  const RotaryTables rope =
      rotary_tables(at::arange(cache.length, cache.length + T, emb.options().dtype(at::kLong)),
                    c.head_dim, c.rope_theta);
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  // The T queries of a row as extra query heads of their K/V head ([B, Hkv·T·g, D]: head
  // j·T·g + t·g + i reads K/V head j under the kernels' GQA mapping), so the cached keys take all
  // of them in one call per rank and one pass-Q message per layer; and back to [B, T, Hq, ·].
  auto fold = [&](const at::Tensor& q) {
    return q.view({B, T, hkv, g, d}).permute({0, 2, 1, 3, 4}).reshape({B, hkv * T * g, d});
  };
  auto unfold = [&](const Partial& p) {
    return Partial{p.o.view({B, hkv, T, g, d}).permute({0, 2, 1, 3, 4}).reshape({B, T, hq, d}),
                   p.lse.view({B, hkv, T, g}).permute({0, 2, 1, 3}).reshape({B, T, hq})};
  };
  for (int64_t i = 0; i < c.layers; ++i) {
    const std::string l = layer_prefix(i);
    const size_t li = static_cast<size_t>(i);
    const at::Tensor x = rms_norm(h, param(w_, l + "input_layernorm.weight"), c.rms_eps);
    at::Tensor q = linear(x, w_, l + "self_attn.q_proj", true).view({B, T, hq, d});
    at::Tensor k = linear(x, w_, l + "self_attn.k_proj", true).view({B, T, hkv, d});
    const at::Tensor v = linear(x, w_, l + "self_attn.v_proj", true).view({B, T, hkv, d});
    q = apply_rotary(q, rope);
    k = apply_rotary(k, rope);
    int64_t before = 0;
    for (const at::Tensor& nk : cache.new_k[li]) before += nk.size(1);
    cache.new_k[li].push_back(k);
    cache.new_v[li].push_back(v);
    const at::Tensor qf = fold(q);
    std::vector<Partial> local{partial_attention(qf, cache.prompt[li].k, cache.prompt[li].v,
                                                 cache.prompt[li].visible, scale)};
    const KVShard& vis = cache.visual[li];
    const bool cross = c.is_hyper(i) && vis.k.defined();
    if (cross) local.push_back(partial_attention(qf, vis.k, vis.v, vis.visible, scale));
    std::vector<Partial> merged = merge_across_ranks(*par.pg, local);
    for (Partial& p : merged) p = unfold(p);
    // The new keys up to each token's own (causal), on every rank: one masked product for the
    // T tokens; then every token's merge and mix at once, the tokens as rows ([B·T, ...]).
    const Partial generated = causal_new_keys(q, at::cat(cache.new_k[li], 1),
                                              at::cat(cache.new_v[li], 1), before, scale);
    auto flat = [&](const Partial& p) {
      return Partial{p.o.reshape({B * T, hq, d}), p.lse.reshape({B * T, hq})};
    };
    const Partial self = merge_partials({flat(merged[0]), flat(generated)});
    const Partial visual = cross ? flat(merged[1]) : Partial{};
    const at::Tensor sees = cache.sees_media.repeat_interleave(T);
    const at::Tensor ctx = decode_mix(i, self, cross ? &visual : nullptr, sees)
                               .view({B, T, hq * d})
                               .to(h.scalar_type());
    h = post_attention(i, h, ctx, /*remat=*/false);
  }
  cache.length += T;
  h = rms_norm(h.select(1, T - 1), param(w_, kLm + "norm.weight"), c.rms_eps);
  return at::linear(h, lm_head()).to(at::kFloat);
}

at::Tensor MplugOwl3::extend_rows(const std::vector<at::Tensor>& tokens, const Parallel& par,
                                  const std::vector<DecodeCache*>& caches) const {
  c10::AutoGradMode no_grad(false);
  const MplugOwl3Config& c = cfg_;
  const size_t R = caches.size();
  const int64_t hq = c.heads, hkv = c.kv_heads, d = c.head_dim;
  LVX_CHECK(tokens.size() == R, "extend_rows: ", tokens.size(), " rows of tokens for ", R,
            " caches");
  // Every row's tokens side by side as one sequence [1, N, H], each at its own positions.
  std::vector<int64_t> lengths, positions;
  for (size_t r = 0; r < R; ++r) {
    LVX_CHECK(caches[r]->batch == 1 && tokens[r].dim() == 1 && tokens[r].size(0) >= 1,
              "extend_rows: one sample and at least one token per row");
    lengths.push_back(tokens[r].size(0));
    for (int64_t t = 0; t < lengths.back(); ++t) positions.push_back(caches[r]->length + t);
  }
  const int64_t N = static_cast<int64_t>(positions.size());
  const at::Tensor& emb = param(w_, kLm + "embed_tokens.weight");
  at::Tensor h = at::embedding(emb, at::cat(tokens).to(emb.device(), at::kLong)).unsqueeze(0);
  const RotaryTables rope = rotary_tables(
      at::tensor(positions, at::kLong).to(emb.device()).unsqueeze(0), c.head_dim, c.rope_theta);
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  for (int64_t i = 0; i < c.layers; ++i) {
    const std::string l = layer_prefix(i);
    const size_t li = static_cast<size_t>(i);
    const at::Tensor x = rms_norm(h, param(w_, l + "input_layernorm.weight"), c.rms_eps);
    const at::Tensor q =
        apply_rotary(linear(x, w_, l + "self_attn.q_proj", true).view({1, N, hq, d}), rope);
    const at::Tensor k =
        apply_rotary(linear(x, w_, l + "self_attn.k_proj", true).view({1, N, hkv, d}), rope);
    const at::Tensor v = linear(x, w_, l + "self_attn.v_proj", true).view({1, N, hkv, d});
    std::vector<at::Tensor> q_r, own;
    std::vector<int64_t> before(R, 0);
    std::vector<bool> cross(R);
    for (size_t r = 0, at = 0; r < R; ++r) {
      DecodeCache& kc = *caches[r];
      const int64_t t = lengths[r], a = static_cast<int64_t>(at);
      for (const at::Tensor& nk : kc.new_k[li]) before[r] += nk.size(1);
      kc.new_k[li].push_back(k.narrow(1, a, t));
      kc.new_v[li].push_back(v.narrow(1, a, t));
      q_r.push_back(q.narrow(1, a, t).squeeze(0));  // [T_r, Hq, D]
      cross[r] = c.is_hyper(i) && kc.visual[li].k.defined();
      at += static_cast<size_t>(t);
    }
    // Every row's text partials as one [N, ...] partial, the visual ones of the rows with images
    // as another: pass-Q merges partials of one shape, so the rows (of different lengths) go
    // side by side; one message when every row has images, two otherwise.
    const std::vector<Partial> text = shared_partials(q_r, caches, li, false, scale);
    const std::vector<Partial> image = shared_partials(q_r, caches, li, true, scale);
    std::vector<Partial> with_images;
    for (size_t r = 0; r < R; ++r)
      if (cross[r]) with_images.push_back(image[r]);
    std::vector<Partial> merged{stack_partials(text)};
    if (with_images.size() == R) {
      merged = merge_across_ranks(*par.pg, {merged[0], stack_partials(with_images)});
    } else {
      merged = merge_across_ranks(*par.pg, merged);
      if (!with_images.empty())
        merged.push_back(merge_across_ranks(*par.pg, {stack_partials(with_images)})[0]);
    }
    std::vector<at::Tensor> ctx;
    for (size_t r = 0, at = 0, at_image = 0; r < R; ++r) {
      DecodeCache& kc = *caches[r];
      const int64_t t = lengths[r];
      const Partial generated =
          causal_new_keys(q_r[r].unsqueeze(0), at::cat(kc.new_k[li], 1), at::cat(kc.new_v[li], 1),
                          before[r], scale);
      auto rows_of = [t](const Partial& p, size_t from) {
        return Partial{p.o.narrow(0, static_cast<int64_t>(from), t),
                       p.lse.narrow(0, static_cast<int64_t>(from), t)};
      };
      const Partial self = merge_partials(
          {rows_of(merged[0], at), {generated.o.squeeze(0), generated.lse.squeeze(0)}});
      const Partial visual = cross[r] ? rows_of(merged[1], at_image) : Partial{};
      ctx.push_back(decode_mix(i, self, cross[r] ? &visual : nullptr,
                               kc.sees_media.expand({t})));
      at += static_cast<size_t>(t);
      if (cross[r]) at_image += static_cast<size_t>(t);
    }
    h = post_attention(i, h, at::cat(ctx, 0).view({1, N, hq * d}).to(h.scalar_type()),
                       /*remat=*/false);
  }
  std::vector<int64_t> last;
  for (size_t r = 0, at = 0; r < R; ++r) {
    caches[r]->length += lengths[r];
    at += static_cast<size_t>(lengths[r]);
    last.push_back(static_cast<int64_t>(at) - 1);
  }
  h = h.squeeze(0).index_select(0, at::tensor(last, at::kLong).to(h.device()));  // [R, H]
  h = rms_norm(h, param(w_, kLm + "norm.weight"), c.rms_eps);
  return at::linear(h, lm_head()).to(at::kFloat);
}

int64_t MplugOwl3::decoder_layer_of(const std::string& name) const {
  return layer_number_after(name, kLm + "layers.");
}

}  // namespace lvx::models
