// Llama-3.2-Vision (models/mllama/model.h): the forward, its images and the media of a prompt
// prefilled in chunks; generation is decode.cpp.
#include "models/mllama/model.h"

#include <c10/core/GradMode.h>

#include <chrono>
#include <cmath>

#include "models/layers.h"
#include "models/lora.h"
#include "models/mllama/names.h"
#include "models/mllama/vision.h"
#include "models/recompute.h"
#include "src/attention/dist_attention.h"
#include "src/common/error.h"

namespace lvx::models::mllama {

namespace {

// The batch as the processor lays it out, on the host for the layout (ids, masks) and the
// weights' device for the pixels.
struct Images {
  at::Tensor pixel_values;          // [B, images (or this rank's slots), tiles, 3, S, S]
  at::Tensor aspect_ratio_ids;      // int64 [B, images (or slots)]
  at::Tensor aspect_ratio_mask;     // int64 [B, images (or slots), tiles]
  at::Tensor cross_attention_mask;  // int64 [B, L, images, tiles] (host)
  int64_t images = 0;               // image slots per sample
  // Whether pixel_values / the aspect ratio tensors hold only this rank's slots (media_slots,
  // ascending) instead of every slot.
  bool pixels_local = false, ratios_local = false;
};

// The entries of `t` (slots in dimension 1) of this rank's `slots`: all of t when it holds only
// them, else those slots picked out.
at::Tensor rank_slots(const at::Tensor& t, bool local, const std::vector<int64_t>& slots) {
  return local ? t : t.index_select(1, at::tensor(slots, at::kLong).to(t.device()));
}

const at::Tensor* named(const ModelInputs& in, const std::string& name) {
  auto it = in.named.find(name);
  return it == in.named.end() || !it->second.defined() ? nullptr : &it->second;
}

// Images in MllamaProcessor's layout as given: pixel_values [B, images, tiles, 3, S, S] (or this
// rank's slots: pixels_local) with aspect_ratio_ids and aspect_ratio_mask, all checked;
// cross_attention_mask given or derived from the <|image|> tokens of host_ids.
Images processor_images(const Config& c, const ModelInputs& in, const Parallel& par,
                        const at::Tensor& host_ids) {
  const VisionConfig& v = c.vision;
  const int64_t K = v.max_num_tiles, S = v.image_size, B = in.input_ids.size(0);
  const at::Tensor& px = in.pixel_values;
  Images im;
  const at::Tensor* ids = named(in, "aspect_ratio_ids");
  const at::Tensor* mask = named(in, "aspect_ratio_mask");
  LVX_CHECK(px.defined() && px.dim() == 6 && px.size(0) == B && px.size(2) == K &&
                px.size(3) == 3 && px.size(4) == S && px.size(5) == S,
            kName, ": pixel_values must be [", B, ", images, ", K, " (max_num_tiles), 3, ", S, ", ",
            S, "] (MllamaProcessor's layout), got ",
            px.defined() ? str(px.sizes()) : std::string("none"));
  LVX_CHECK(ids != nullptr && mask != nullptr, kName,
            ": pixel_values [B, images, tiles, 3, H, W] needs aspect_ratio_ids and "
            "aspect_ratio_mask");
  im.images = ids->dim() == 2 ? ids->size(1) : -1;
  LVX_CHECK(ids->dim() == 2 && ids->size(0) == B && !at::isFloatingType(ids->scalar_type()), kName,
            ": aspect_ratio_ids must be integer [", B, ", images], got ", ids->scalar_type(), " ",
            ids->sizes());
  LVX_CHECK(mask->dim() == 3 && mask->size(0) == B && mask->size(1) == im.images &&
                mask->size(2) == K && !at::isFloatingType(mask->scalar_type()),
            kName, ": aspect_ratio_mask must be integer [", B, ", ", im.images, ", ", K, "], got ",
            mask->scalar_type(), " ", mask->sizes());
  LVX_CHECK(in.pixels_local || px.size(1) == im.images, kName, ": pixel_values has ", px.size(1),
            " images per sample, aspect_ratio_ids ", im.images);
  im.pixel_values = px;
  if (in.pixels_local) {
    const size_t mine = media_slots(im.images, par.rank(), par.world()).size();
    im.pixels_local = true;
    LVX_CHECK(px.size(1) == static_cast<int64_t>(mine), kName, ": rank ", par.rank(),
              "'s pixel_values (pixels_local) must hold its ", mine, " image slots, got ",
              px.size(1));
  }
  im.aspect_ratio_ids = ids->to(at::kLong);
  im.aspect_ratio_mask = mask->to(at::kLong);
  if (const at::Tensor* cam = named(in, "cross_attention_mask")) {
    LVX_CHECK(cam->dim() == 4 && cam->size(0) == B && cam->size(1) == in.input_ids.size(1) &&
                  cam->size(2) == im.images && cam->size(3) == K,
              kName, ": cross_attention_mask must be [", B, ", ", in.input_ids.size(1), ", ",
              im.images, ", ", K, "], got ", cam->sizes());
    im.cross_attention_mask = cam->cpu();
  } else {
    im.cross_attention_mask = cross_attention_mask_from_ids(
        host_ids, c.image_token_id, im.aspect_ratio_mask.cpu().sum(-1), K, kName);
  }
  return im;
}

// Video frames (pixel_values [N, 3, S, S], in prompt order, or none when in.media's features
// replace them) laid out as MllamaProcessor lays out single-tile images: each sample's slots (this
// rank's with pixels_local) filled in order, the rest padding.
Images frame_images(const Config& c, const ModelInputs& in, const Parallel& par,
                    const at::Tensor& host_ids) {
  const VisionConfig& v = c.vision;
  const int64_t K = v.max_num_tiles, S = v.image_size, B = in.input_ids.size(0);
  const at::Tensor& px = in.pixel_values;
  Images im;
  const at::Tensor counts = (host_ids == c.image_token_id).sum(1);  // images per sample
  im.images = counts.numel() ? counts.max().item<int64_t>() : 0;
  // The slots the frames fill: this rank's (pixels_local) or all of them.
  std::vector<int64_t> filled = media_slots(im.images, par.rank(), par.world());
  if (!in.pixels_local) {
    filled.resize(static_cast<size_t>(im.images));
    for (int64_t s = 0; s < im.images; ++s) filled[static_cast<size_t>(s)] = s;
  }
  const int64_t slots = static_cast<int64_t>(filled.size());
  int64_t expected = 0;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s : filled) expected += s < counts[b].item<int64_t>() ? 1 : 0;
  // Features given (lvx serve's visual cache, ModelInputs::media) replace the frames.
  const bool encoded = in.media != nullptr && in.media->features.defined();
  LVX_CHECK(
      im.images == 0 || encoded ||
          (px.defined() && px.dim() == 4 && px.size(0) == expected && px.size(1) == 3),
      kName, ": input_ids hold ", counts.sum().item<int64_t>(), " <|image|> tokens",
      in.pixels_local ? str(" (", expected, " in rank ", par.rank(), "'s share)") : std::string(),
      " but pixel_values has ", px.defined() ? str(px.sizes()) : std::string("none"),
      " (frames [N, 3, S, S], or [B, images, tiles, 3, S, S] with aspect_ratio_ids and "
      "aspect_ratio_mask)");
  const auto opts = px.defined() ? px.options() : in.input_ids.options().dtype(at::kFloat);
  im.pixel_values = at::zeros({B, slots, K, 3, S, S}, opts);
  im.aspect_ratio_ids = at::zeros({B, slots}, opts.dtype(at::kLong));
  im.aspect_ratio_mask = at::zeros({B, slots, K}, opts.dtype(at::kLong));
  im.aspect_ratio_mask.select(2, 0).fill_(1);  // the processor's padding images: tile 0 set
  im.pixels_local = im.ratios_local = in.pixels_local;
  if (expected > 0 && !encoded) {
    const Tiled t = frames_as_images(c, px);
    int64_t next = 0;
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < slots && filled[static_cast<size_t>(i)] < counts[b].item<int64_t>();
           ++i, ++next) {
        im.pixel_values[b][i].copy_(t.pixel_values[next]);
        im.aspect_ratio_ids[b][i].copy_(t.aspect_ratio_ids[next]);
        im.aspect_ratio_mask[b][i].copy_(t.aspect_ratio_mask[next]);
      }
  }
  im.cross_attention_mask = cross_attention_mask_from_ids(
      host_ids, c.image_token_id, at::ones({B, im.images}, at::kLong), K, kName);
  return im;
}

// The batch's images as the processor lays them out: given in its layout (named inputs, or
// pixel_values [B, images, tiles, 3, S, S]), else video frames of one tile each.
Images batch_images(const Config& c, const ModelInputs& in, const Parallel& par) {
  check_named_inputs(in, {"aspect_ratio_ids", "aspect_ratio_mask", "cross_attention_mask"}, kName);
  const at::Tensor& px = in.pixel_values;
  const at::Tensor host_ids = in.input_ids.cpu();
  if (!in.named.empty() || (px.defined() && px.dim() == 6))
    return processor_images(c, in, par, host_ids);  // MllamaProcessor's layout
  return frame_images(c, in, par, host_ids);
}

// Whether sharing every image's tiles across the ranks (vision.h encode_tiles) leaves the busiest
// rank fewer tiles to encode than whole images striped over them: one 4-tile image on 2 ranks is
// 2 tiles each instead of 4 on rank 0. Only with every image's pixels on every rank and the tower
// frozen (the key/value gathers carry no gradient); the same answer on every rank.
bool tiles_across_ranks(const Config& cfg, const StateDict& w, const Images& im,
                        const Parallel& par) {
  const int64_t n = par.world(), tiles = cfg.vision.max_num_tiles;
  if (n == 1 || im.images == 0 || im.pixels_local || im.ratios_local) return false;
  if (at::GradMode::is_enabled() && param(w, "vision_model.patch_embedding.weight").requires_grad())
    return false;
  return im.images * ((tiles + n - 1) / n) < ((im.images + n - 1) / n) * tiles;
}

// Every image's tiles encoded across the ranks, each image's tiles then sent to the rank that
// holds its keys (media_slots: one all-to-all of the vision output, before the projector so that
// fine-tuning's projector gradient stays on that rank) and projected there: [B, slots·T, hidden]
// for this rank's slots `mine`. Every rank calls it.
at::Tensor encode_shared_tiles(const Config& cfg, const StateDict& w, const Images& im,
                               const std::vector<int64_t>& mine, const Parallel& par,
                               const at::TensorOptions& options) {
  const int64_t B = im.pixel_values.size(0), N = im.images, tiles = cfg.vision.max_num_tiles,
                Tt = cfg.vision.tokens_per_tile(), D = cfg.vision.output_dim;
  const int world = par.world();
  const at::Device dev = options.device();
  std::vector<int64_t> counts;  // tiles each rank encodes
  for (int r = 0; r < world; ++r) counts.push_back(tile_share(tiles, r, world).count);
  const int64_t count = counts[static_cast<size_t>(par.rank())];
  const at::Tensor out =
      encode_tiles(w, cfg, im.pixel_values.flatten(0, 1).to(dev, options.dtype().toScalarType()),
                   im.aspect_ratio_ids.flatten().to(dev),
                   im.aspect_ratio_mask.flatten(0, 1).to(dev), par.pg.get())
          .reshape({B, N, count * Tt, D});
  // To rank r: this rank's tiles of r's slots, rows (sample, slot, token).
  std::vector<at::Tensor> send;
  std::vector<int64_t> send_rows, recv_rows;
  const int64_t held = static_cast<int64_t>(mine.size());
  for (int r = 0; r < world; ++r) {
    const at::Tensor theirs = at::tensor(media_slots(N, r, world), at::kLong).to(dev);
    send.push_back(out.index_select(1, theirs).reshape({-1, D}));
    send_rows.push_back(send.back().size(0));
    recv_rows.push_back(B * held * counts[static_cast<size_t>(r)] * Tt);
  }
  const at::Tensor got = par.pg->all_to_all(at::cat(send), send_rows, recv_rows);
  if (held == 0) return at::zeros({B, 0, cfg.text.hidden}, options);
  // From rank r: [B, held, count_r · Tt, D]; rank order is tile order.
  std::vector<at::Tensor> parts;
  int64_t offset = 0;
  for (int r = 0; r < world; ++r) {
    parts.push_back(got.narrow(0, offset, recv_rows[static_cast<size_t>(r)])
                        .reshape({B, held, counts[static_cast<size_t>(r)] * Tt, D}));
    offset += recv_rows[static_cast<size_t>(r)];
  }
  return project(w, at::cat(parts, 2).reshape({B, held * tiles * Tt, D}));
}

// This rank's image features [B, slots·T, hidden] (T keys per image): in.media's (lvx serve's
// visual cache) or its slots `mine` encoded (handed back in in.media); undefined when the batch
// has no image. A collective when the tiles are shared across the ranks (tiles_across_ranks).
at::Tensor local_features(const Config& cfg, const StateDict& w, const ModelInputs& in,
                          const Images& im, const CrossMask& cm, const std::vector<int64_t>& mine,
                          const Parallel& par, const at::TensorOptions& options) {
  const int64_t B = in.input_ids.size(0), T = cfg.tokens_per_image(), hidden = cfg.text.hidden;
  const int64_t slots = static_cast<int64_t>(mine.size());
  if (cm.calls.empty()) return at::Tensor();
  if (in.media != nullptr && in.media->features.defined()) {
    // This rank's images encoded before (lvx serve's visual cache): nothing decoded or encoded.
    const LocalMedia& m = *in.media;
    LVX_CHECK(m.slots == mine && m.features.dim() == 3 && m.features.size(0) == B &&
                  m.features.size(1) == slots * T && m.features.size(2) == hidden,
              kName, ": precomputed media features of ", m.slots.size(), " slots ",
              m.features.sizes(), " do not fit rank ", par.rank(), "'s ", slots, " slots of ", B,
              " x ", slots * T, " x ", hidden);
    return m.features;
  }
  at::Tensor features = at::zeros({B, 0, hidden}, options);
  if (tiles_across_ranks(cfg, w, im, par)) {
    features = encode_shared_tiles(cfg, w, im, mine, par, options);
  } else if (slots > 0) {
    const at::Tensor px = rank_slots(im.pixel_values, im.pixels_local, mine);
    auto flat = [&](const at::Tensor& x) {
      std::vector<int64_t> s{B * slots};
      for (int64_t d = 2; d < x.dim(); ++d) s.push_back(x.size(d));
      return x.reshape(s);
    };
    const at::Device dev = options.device();
    const at::Tensor ar_ids = rank_slots(im.aspect_ratio_ids, im.ratios_local, mine).to(dev);
    const at::Tensor ar_mask = rank_slots(im.aspect_ratio_mask, im.ratios_local, mine).to(dev);
    features = encode_images(w, cfg, flat(px.to(dev, options.dtype().toScalarType())), flat(ar_ids),
                             flat(ar_mask))
                   .reshape({B, slots * T, hidden});
  }
  if (in.media != nullptr) *in.media = LocalMedia{features, mine};  // for the cache
  return features;
}

// A cross layer's K/V from the shared features: k_proj with k_norm (RMSNorm over each head's
// channels), v_proj. By value: with recomputation it runs again in the backward.
KVFunction cross_kv_function(const TextConfig& t) {
  const int64_t Hkv = t.kv_heads, D = t.head_dim;
  const double eps = t.rms_eps;
  return [Hkv, D, eps](const at::Tensor& y, const std::vector<at::Tensor>& p) {
    const int64_t n = y.size(1);
    const at::Tensor k = rms_norm(models::linear(y, p[0]).view({y.size(0), n, Hkv, D}), p[2], eps);
    return std::make_pair(k, models::linear(y, p[1]).view({y.size(0), n, Hkv, D}));
  };
}

std::vector<at::Tensor> cross_kv_params(const StateDict& w, int64_t layer) {
  const std::string l = layer_prefix(layer);
  return {param(w, l + "cross_attn.k_proj.weight"), param(w, l + "cross_attn.v_proj.weight"),
          param(w, l + "cross_attn.k_norm.weight")};
}

// A forward's media: the cross mask on the host (it decides the calls), this rank's image slots
// and their features [B, slots·T, hidden], and each call's mask and spec.
struct ForwardMedia {
  CrossMask cm;
  std::vector<int64_t> mine;
  at::Tensor features;
  std::vector<attention::MaskInputs> call_masks;
  std::vector<attention::AttentionSpec> call_specs;
};

// The batch's images, their cross mask and this rank's whole images encoded (options: the
// activations'), for a prompt of B samples of L tokens.
ForwardMedia forward_media(const Config& cfg, const StateDict& w, const ModelInputs& in,
                           const Parallel& par, const at::TensorOptions& options, int64_t B,
                           int64_t L) {
  const TextConfig& t = cfg.text;
  const Images im = batch_images(cfg, in, par);
  ForwardMedia m;
  m.cm = cross_mask(im.cross_attention_mask, cfg.vision.tokens_per_tile(), kName);
  m.mine = media_slots(im.images, par.rank(), par.world());
  m.features = local_features(cfg, w, in, im, m.cm, m.mine, par, options);
  for (const attention::MediaMask& mm : m.cm.calls) {
    const attention::MediaMask d = media_mask_on(mm, options.device());
    m.call_masks.push_back({d.q_media, d.kv_media, {}});
    m.call_specs.push_back(cross_attention_spec(B, L, t.heads, t.kv_heads, t.head_dim, mm, par));
  }
  return m;
}

// Self layer `layer`'s attention output [B, L_r, Hq·D] of x (the hidden states after the input
// norm), q and k rotated by `rope`; a prefill keeps this rank's K/V in its cache.
at::Tensor self_attention_output(const TextConfig& t, const StateDict& w, int64_t layer,
                                 const at::Tensor& x, const RotaryTables& rope,
                                 const attention::AttentionSpec& spec, const Parallel& par,
                                 DecodeCache* cache) {
  const std::string l = layer_prefix(layer);
  const int64_t B = x.size(0), lr = x.size(1), Hq = t.heads, Hkv = t.kv_heads, D = t.head_dim;
  at::Tensor q = linear(x, w, l + "self_attn.q_proj", false).view({B, lr, Hq, D});
  at::Tensor k = linear(x, w, l + "self_attn.k_proj", false).view({B, lr, Hkv, D});
  const at::Tensor v = linear(x, w, l + "self_attn.v_proj", false).view({B, lr, Hkv, D});
  q = apply_rotary(q, rope);
  k = apply_rotary(k, rope);
  if (cache) cache->prompt[static_cast<size_t>(layer)] = {k, v, {}};
  const auto self =
      attention::dist_attention(q, k, v, par.pg, par.at(static_cast<size_t>(layer)).self, spec);
  return self.o.reshape({B, lr, Hq * D});
}

// Cross layer `layer`'s attention output [B, L_r, Hq·D] of x (after the input norm) to this
// rank's image features: one call per family of nested tile sets (mask.h), summed; K/V
// recomputed in the backward under recompute_cross_kv (no cache), else cached in a prefill.
at::Tensor cross_attention_output(const Config& cfg, const StateDict& w, int64_t layer,
                                  const at::Tensor& x, const ForwardMedia& m, const Parallel& par,
                                  DecodeCache* cache) {
  const TextConfig& t = cfg.text;
  const std::string l = layer_prefix(layer);
  const int64_t B = x.size(0), lr = x.size(1), Hq = t.heads, D = t.head_dim;
  const LayerStrategies& st = par.at(static_cast<size_t>(layer));
  // q_norm / k_norm: RMSNorm over each head's channels; K/V from the shared features.
  at::Tensor q = linear(x, w, l + "cross_attn.q_proj", false).view({B, lr, Hq, D});
  q = rms_norm(q, param(w, l + "cross_attn.q_norm.weight"), t.rms_eps);
  const KVFunction kv_fn = cross_kv_function(t);
  const std::vector<at::Tensor> kv_params = cross_kv_params(w, layer);
  // Each row has keys in one call only, and o = 0 in the others, so the attention is their sum.
  at::Tensor o;
  if (par.recompute_cross_kv && !cache) {
    for (size_t c = 0; c < m.cm.calls.size(); ++c) {
      const auto r = cross_attention_recompute(q, m.features, kv_params, kv_fn, par.pg, st.cross,
                                               m.call_specs[c], m.call_masks[c]);
      o = c == 0 ? r.o : o + r.o;
    }
  } else {
    const auto [k, v] = kv_fn(m.features, kv_params);
    for (size_t c = 0; c < m.cm.calls.size(); ++c) {
      const auto r =
          attention::dist_attention(q, k, v, par.pg, st.cross, m.call_specs[c], m.call_masks[c]);
      o = c == 0 ? r.o : o + r.o;
    }
    if (cache) {
      cache->visual[static_cast<size_t>(layer)] = visual_shard(
          k, v,
          m.cm.last_row_keys
              .index_select(1, LocalMedia{{}, m.mine}.key_index(cfg.tokens_per_image()))
              .to(x.device()));
    }
  }
  return o.reshape({B, lr, Hq * D});
}

}  // namespace

Mllama::Mllama(const Checkpoint& ck, at::ScalarType dtype, at::Device device)
    : cfg_(config_from_json(ck.config, ck.dir + "/config.json")) {
  w_ = select_parameters(ck.tensors, shapes(cfg_), {}, dtype, ck.dir, device);
}

bool Mllama::trainable(const std::string& name) const { return name.rfind(kVision, 0) != 0; }

bool Mllama::trains_cross_only(const std::string& name) const {
  if (name.rfind("multi_modal_projector.", 0) == 0) return true;
  const std::string layers = "language_model.model.layers.";
  if (name.rfind(layers, 0) != 0) return false;
  const size_t end = name.find('.', layers.size());
  if (end == std::string::npos || end == layers.size()) return false;
  int64_t layer = 0;
  for (size_t i = layers.size(); i < end; ++i) {
    if (name[i] < '0' || name[i] > '9' || layer > cfg_.text.layers) return false;
    layer = layer * 10 + (name[i] - '0');
  }
  return cfg_.text.is_cross(layer);
}

std::vector<DecoderLayerAttention> Mllama::layer_attentions() const {
  std::vector<DecoderLayerAttention> v;
  for (int64_t i = 0; i < cfg_.text.layers; ++i) {
    const bool cross = cfg_.text.is_cross(i);
    v.push_back({!cross, cross, false});
  }
  return v;
}

at::Tensor Mllama::lm_head() const {
  // Tied: the first vocab rows of embed_tokens (it has vocab + 8), taken at each use: load_model
  // replaces the parameters after construction when it loads straight to a device.
  return cfg_.text.tie_embeddings
             ? param(w_, kLm + "embed_tokens.weight").narrow(0, 0, cfg_.text.vocab)
             : param(w_, "language_model.lm_head.weight");
}

ModelOutputs Mllama::forward(const ModelInputs& in, const Parallel& par) const {
  return run(in, par, nullptr);
}

at::Tensor Mllama::self_block(int64_t layer, const at::Tensor& h, const at::Tensor& ctx,
                              bool remat) const {
  const std::string l = layer_prefix(layer);
  const std::vector<at::Tensor> p{
      param(w_, l + "self_attn.o_proj.weight"), param(w_, l + "post_attention_layernorm.weight"),
      param(w_, l + "mlp.gate_proj.weight"), param(w_, l + "mlp.up_proj.weight"),
      param(w_, l + "mlp.down_proj.weight")};
  const double eps = cfg_.text.rms_eps;
  const std::string act = cfg_.text.act;
  auto block = [eps, act](const std::vector<at::Tensor>& in,
                          const std::vector<at::Tensor>& w) -> std::vector<at::Tensor> {
    const at::Tensor a = in[0] + models::linear(in[1], w[0]);
    const at::Tensor x = rms_norm(a, w[1], eps);
    return {a + models::linear(activation(models::linear(x, w[2]), act) * models::linear(x, w[3]),
                               w[4])};
  };
  return remat ? checkpoint_segment(block, {h, ctx}, p)[0] : block({h, ctx}, p)[0];
}

at::Tensor Mllama::cross_block(int64_t layer, const at::Tensor& h, const at::Tensor& ctx,
                               const at::Tensor& sees, bool remat) const {
  const std::string l = layer_prefix(layer);
  const std::vector<at::Tensor> p{param(w_, l + "cross_attn.o_proj.weight"),
                                  param(w_, l + "cross_attn_attn_gate"),
                                  param(w_, l + "post_attention_layernorm.weight"),
                                  param(w_, l + "mlp.gate_proj.weight"),
                                  param(w_, l + "mlp.up_proj.weight"),
                                  param(w_, l + "mlp.down_proj.weight"),
                                  param(w_, l + "cross_attn_mlp_gate")};
  const double eps = cfg_.text.rms_eps;
  const std::string act = cfg_.text.act;
  auto block = [eps, act, sees](const std::vector<at::Tensor>& in,
                                const std::vector<at::Tensor>& w) -> std::vector<at::Tensor> {
    const at::Tensor a = in[0] + w[1].tanh() * models::linear(in[1], w[0]);
    const at::Tensor x = rms_norm(a, w[2], eps);
    const at::Tensor m =
        models::linear(activation(models::linear(x, w[3]), act) * models::linear(x, w[4]), w[5]);
    return {a + w[6].tanh() * (sees * m)};
  };
  return remat ? checkpoint_segment(block, {h, ctx}, p)[0] : block({h, ctx}, p)[0];
}

ModelOutputs Mllama::run(const ModelInputs& in, const Parallel& par, DecodeCache* cache) const {
  const TextConfig& t = cfg_.text;
  const at::Tensor& ids = in.input_ids;
  const at::Tensor& emb = param(w_, kLm + "embed_tokens.weight");
  const TextShard shard = embed_text_shard(ids, emb, par, kName);
  at::Tensor h = shard.hidden;
  const int64_t B = ids.size(0), L = ids.size(1);
  const at::ScalarType dt = emb.scalar_type();

  // The media: the mask on the host (it decides the calls), this rank's whole images encoded.
  const auto encode_start = std::chrono::steady_clock::now();
  const ForwardMedia m = forward_media(cfg_, w_, in, par, h.options(), B, L);
  const at::Tensor sees =
      m.cm.sees_media.to(h.device()).index_select(1, shard.positions).unsqueeze(-1).to(dt);
  if (cache) {
    start_prompt_cache(*cache, t.layers, B, L, encode_start);
    cache->sees_media = m.cm.last_row_sees_media.to(h.device());
  }

  const RotaryTables rope =
      llama_rotary(shard.positions, rope_inv_freq(t, emb.options().dtype(at::kFloat)));
  const attention::AttentionSpec self_spec =
      self_attention_spec(B, L, t.heads, t.kv_heads, t.head_dim, par);
  for (int64_t i = 0; i < t.layers; ++i) {
    par.enter_layer(i, h);
    const at::Tensor x =
        rms_norm(h, param(w_, layer_prefix(i) + "input_layernorm.weight"), t.rms_eps);
    if (!t.is_cross(i)) {
      const at::Tensor ctx = self_attention_output(t, w_, i, x, rope, self_spec, par, cache);
      h = self_block(i, h, ctx, par.remat);
    } else if (!m.cm.calls.empty()) {  // no image in the batch: transformers skips the layer
      const at::Tensor ctx = cross_attention_output(cfg_, w_, i, x, m, par, cache);
      h = cross_block(i, h, ctx, sees, par.remat);
    }
  }
  par.leave_layers(h);
  h = rms_norm(h, param(w_, kLm + "norm.weight"), t.rms_eps);
  if (cache) return {h, shard.host_positions};
  return {lora_linear(h, lm_head(), c10::nullopt), shard.host_positions};  // LoRA on lm_head too
}

void Mllama::prefill_media(const ModelInputs& in, const Parallel& par, DecodeCache& cache) const {
  c10::AutoGradMode no_grad(false);
  const TextConfig& t = cfg_.text;
  const at::TensorOptions options = param(w_, kLm + "embed_tokens.weight").options();
  const at::Device dev = options.device();
  const int64_t B = in.input_ids.size(0), L = in.input_ids.size(1), T = cfg_.tokens_per_image();
  const auto encode_start = std::chrono::steady_clock::now();
  const Images im = batch_images(cfg_, in, par);
  const CrossMask cm = cross_mask(im.cross_attention_mask, cfg_.vision.tokens_per_tile(), kName);
  LVX_CHECK(!cm.calls.empty(), "prefill_media: the prompt has no image");
  const std::vector<int64_t> mine = media_slots(im.images, par.rank(), par.world());
  const at::Tensor features = local_features(cfg_, w_, in, im, cm, mine, par, options);
  cache = chunked_prompt_cache(t.layers, B, t.kv_heads, t.head_dim, options);
  cache.sees_media = cm.last_row_sees_media.to(dev);
  // Each call's rows and this rank's keys of it (mask.h): the calls the whole prefill makes.
  const at::Tensor keys = LocalMedia{{}, mine}.key_index(T).to(dev);
  cache.prompt_key_reads = at::zeros({L}, at::kLong);
  for (const attention::MediaMask& mm : cm.calls) {
    const attention::MediaMask d = media_mask_on(mm, dev);
    cache.prompt_media.push_back({d.q_media.narrow(1, 0, L), d.kv_media.index_select(1, keys),
                                  mm.rule, mm.unmatched_sees_all});
    cache.prompt_key_reads += media_key_reads(mm, L);
  }
  cache.prompt_sees = cm.sees_media.to(dev).narrow(1, 0, L);
  const at::Tensor visible = cm.last_row_keys.index_select(1, keys.cpu()).to(dev);
  for (int64_t i = 0; i < t.layers; ++i) {
    if (!t.is_cross(i)) continue;
    const auto [k, v] = cross_kv_function(t)(features, cross_kv_params(w_, i));
    cache.visual[static_cast<size_t>(i)] = visual_shard(k, v, visible);
  }
  cache.encode_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - encode_start).count();
}

int64_t Mllama::decoder_layer_of(const std::string& name) const {
  return layer_number_after(name, kLm + "layers.");
}

}  // namespace lvx::models::mllama
