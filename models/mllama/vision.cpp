#include "models/mllama/vision.h"

#include <c10/core/GradMode.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "models/layers.h"
#include "src/common/error.h"
#include "src/dist/process_group.h"

namespace lvx::models::mllama {

namespace {

const std::string kV = "vision_model.";

// torch.finfo(dtype).min: the additive mask value transformers uses.
double lowest(at::ScalarType t) {
  switch (t) {
    case at::kDouble:
      return std::numeric_limits<double>::lowest();
    case at::kFloat:
      return std::numeric_limits<float>::lowest();
    case at::kBFloat16:
      return static_cast<double>(std::numeric_limits<c10::BFloat16>::lowest());
    case at::kHalf:
      return static_cast<double>(std::numeric_limits<c10::Half>::lowest());
    default:
      LVX_FAIL("mllama vision: unsupported weight dtype ", c10::toString(t));
  }
}

// MllamaPrecomputedAspectRatioEmbedding: x [n, count, t, W] (tiles [first, first + count)) +
// tanh(gate)·table[ar_id] of those tiles.
at::Tensor add_tile_embedding(const at::Tensor& x, const StateDict& w, const std::string& prefix,
                              const at::Tensor& ar_ids, int64_t tiles, const TileShare& share) {
  const int64_t n = x.size(0), W = x.size(3);
  at::Tensor e = at::embedding(param(w, prefix + "embedding.weight"), ar_ids)
                     .reshape({n, tiles, 1, W})
                     .narrow(1, share.first, share.count);
  return x + e * param(w, prefix + "gate").tanh();
}

// The tiles' tokens [n, Lr, W] of this rank with every other rank's after them in tile order
// (all-gathered along the tokens: rank order is tile order); as they are without a group.
at::Tensor every_tile(const at::Tensor& x, dist::ProcessGroup* pg, int64_t tiles, int64_t Tp) {
  if (pg == nullptr || pg->world_size() == 1) return x;
  std::vector<int64_t> sizes;
  for (int r = 0; r < pg->world_size(); ++r)
    sizes.push_back(tile_share(tiles, r, pg->world_size()).count * Tp);
  return pg->all_gather(x.transpose(0, 1).contiguous(), sizes).transpose(0, 1);
}

// Where the encoder layers' queries and keys sit: the bias over (this rank's tokens, every
// token), the group that holds the other tiles (null: this rank holds them all).
struct Tokens {
  at::Tensor bias;  // [n, 1, Lr, L]
  dist::ProcessGroup* pg = nullptr;
  int64_t tiles = 0, Tp = 0;
};

// MllamaVisionEncoderLayer (pre-LN; the global encoder's layers gate both branches by tanh).
// Queries are this rank's tokens; keys and values every tile's.
at::Tensor encoder_layer(const at::Tensor& x, const StateDict& w, const std::string& p,
                         const VisionConfig& c, const Tokens& t, bool gated) {
  const int64_t n = x.size(0), hd = c.hidden / c.heads;
  at::Tensor y = layer_norm(x, w, p + "input_layernorm", c.norm_eps);
  auto heads = [&](const at::Tensor& z) {
    return z.reshape({n, z.size(1), c.heads, hd}).transpose(1, 2);
  };
  auto proj = [&](const std::string& name) { return linear(y, w, p + "self_attn." + name, false); };
  const at::Tensor k = every_tile(proj("k_proj"), t.pg, t.tiles, t.Tp),
                   v = every_tile(proj("v_proj"), t.pg, t.tiles, t.Tp);
  at::Tensor o = at::scaled_dot_product_attention(heads(proj("q_proj")), heads(k), heads(v), t.bias,
                                                  0.0, false, 1.0 / std::sqrt(double(hd)));
  o = linear(o.transpose(1, 2).reshape({n, x.size(1), c.hidden}), w, p + "self_attn.o_proj", false);
  at::Tensor h = x + (gated ? param(w, p + "gate_attn").tanh() * o : o);
  at::Tensor m = layer_norm(h, w, p + "post_attention_layernorm", c.norm_eps);
  m = linear(activation(linear(m, w, p + "mlp.fc1", true), "gelu"), w, p + "mlp.fc2", true);
  return h + (gated ? param(w, p + "gate_ffn").tanh() * m : m);
}

// Checks the images' tensors against the config; returns n.
int64_t check_images(const VisionConfig& v, const at::Tensor& pixel_values,
                     const at::Tensor& aspect_ratio_ids, const at::Tensor& aspect_ratio_mask) {
  const int64_t tiles = v.max_num_tiles, S = v.image_size;
  LVX_CHECK(pixel_values.dim() == 5 && pixel_values.size(1) == tiles && pixel_values.size(2) == 3 &&
                pixel_values.size(3) == S && pixel_values.size(4) == S,
            "mllama encode_images: pixel_values: expected [n, ", tiles, ", 3, ", S, ", ", S,
            "] (max_num_tiles, image_size), got ", pixel_values.sizes());
  const int64_t n = pixel_values.size(0);
  LVX_CHECK(aspect_ratio_ids.dim() == 1 && aspect_ratio_ids.size(0) == n,
            "mllama encode_images: aspect_ratio_ids: expected [", n, "], got ",
            aspect_ratio_ids.sizes());
  LVX_CHECK(aspect_ratio_mask.dim() == 2 && aspect_ratio_mask.size(0) == n &&
                aspect_ratio_mask.size(1) == tiles,
            "mllama encode_images: aspect_ratio_mask: expected [", n, ", ", tiles, "], got ",
            aspect_ratio_mask.sizes());
  if (n > 0 && aspect_ratio_ids.device().is_cpu()) {  // the table lookup would fail less clearly
    const int64_t lo = aspect_ratio_ids.min().item<int64_t>(),
                  hi = aspect_ratio_ids.max().item<int64_t>();
    LVX_CHECK(lo >= 0 && hi <= static_cast<int64_t>(v.aspect_ratios.size()),
              "mllama encode_images: aspect_ratio_ids: expected ids in [0, ",
              v.aspect_ratios.size(), "] (0: padding image), got [", lo, ", ", hi, "]");
  }
  return n;
}

// The patch embedding of tiles [first, first + count) through layernorm_pre, each tile padded to
// Tp tokens: [n, count · Tp, W].
at::Tensor embed_tiles(const StateDict& w, const VisionConfig& v, const at::Tensor& pixel_values,
                       const at::Tensor& ids, const TileShare& share, int64_t Tp) {
  const int64_t n = pixel_values.size(0), S = v.image_size, W = v.hidden, P = v.patches(),
                T = v.tokens_per_tile(), tiles = v.max_num_tiles, count = share.count;
  const at::Tensor& conv = param(w, kV + "patch_embedding.weight");
  // Patches: conv without bias, [n·count, P, W]; pre-tile embedding on the patches only.
  at::Tensor x = at::conv2d(
      pixel_values.narrow(1, share.first, count).reshape({n * count, 3, S, S}).to(conv.options()),
      conv, {}, {v.patch_size, v.patch_size});
  x = x.flatten(2).transpose(1, 2).reshape({n, count, P, W});
  x = add_tile_embedding(x, w, kV + "pre_tile_positional_embedding.", ids, tiles, share);
  // Class token first in every tile.
  x = at::cat({param(w, kV + "class_embedding").expand({n, count, 1, W}), x}, 2);
  // Gated positional embedding: (1 − tanh g)·shared [T, W] + tanh g·tile table [tiles, T, W].
  const std::string g = kV + "gated_positional_embedding.";
  const at::Tensor gate = param(w, g + "gate").tanh();
  x = x + (1 - gate) * param(w, g + "embedding").view({1, 1, T, W});
  x = x + gate * at::embedding(param(w, g + "tile_embedding.weight"), ids)
                     .reshape({n, tiles, T, W})
                     .narrow(1, share.first, count);
  x = layer_norm(x, w, kV + "layernorm_pre", 1e-5);  // nn.LayerNorm's default eps, as released
  return at::constant_pad_nd(x, {0, 0, 0, Tp - T}, 0).reshape({n, count * Tp, W});
}

// A (query, key) pair is masked only when BOTH are padding (a padding tile or a padding token):
// _prepare_aspect_ratio_attention_mask's outer product, reproduced as is. Queries: this rank's
// tiles; keys: every tile. [n, 1, count · Tp, tiles · Tp].
at::Tensor padding_bias(const at::Tensor& aspect_ratio_mask, const TileShare& share, int64_t T,
                        int64_t Tp, at::ScalarType dt, at::Device device) {
  const int64_t n = aspect_ratio_mask.size(0), tiles = aspect_ratio_mask.size(1);
  const at::Tensor real =
      aspect_ratio_mask.to(device).ne(0).view({n, tiles, 1}) &
      at::arange(Tp, at::TensorOptions().dtype(at::kLong).device(device)).lt(T).view({1, 1, Tp});
  const at::Tensor pad = real.logical_not().to(dt);  // [n, tiles, Tp]
  const at::Tensor q = pad.narrow(1, share.first, share.count).reshape({n, share.count * Tp, 1});
  return (at::matmul(q, pad.reshape({n, 1, tiles * Tp})) * lowest(dt)).unsqueeze(1);
}

}  // namespace

TileShare tile_share(int64_t tiles, int rank, int world) {
  const int64_t each = (tiles + world - 1) / world;
  const int64_t first = std::min<int64_t>(tiles, each * rank);
  return {first, std::min<int64_t>(tiles, first + each) - first};
}

at::Tensor encode_tiles(const StateDict& w, const Config& c, const at::Tensor& pixel_values,
                        const at::Tensor& aspect_ratio_ids, const at::Tensor& aspect_ratio_mask,
                        dist::ProcessGroup* pg) {
  const VisionConfig& v = c.vision;
  const int64_t n = check_images(v, pixel_values, aspect_ratio_ids, aspect_ratio_mask);
  const int64_t tiles = v.max_num_tiles, W = v.hidden, T = v.tokens_per_tile(),
                Tp = T + (8 - T % 8) % 8;  // each tile padded to a multiple of 8 tokens
  const TileShare share =
      pg == nullptr ? TileShare{0, tiles} : tile_share(tiles, pg->rank(), pg->world_size());
  const at::Tensor& conv = param(w, kV + "patch_embedding.weight");
  LVX_CHECK(pg == nullptr || !at::GradMode::is_enabled() || !conv.requires_grad(),
            "mllama encode_tiles: the tiles of an image are encoded across ranks only with the "
            "vision tower frozen (its key/value gathers carry no gradient)");
  if (n == 0) return at::zeros({0, share.count * T, v.output_dim}, conv.options());
  const at::Tensor ids = aspect_ratio_ids.to(conv.device(), at::kLong);

  if (share.count == 0) {  // a rank past the last tile: it takes part in the gathers only
    const at::Tensor none = at::empty({n, 0, W}, conv.options());
    for (int64_t i = 0; i < 2 * (v.layers + v.global_layers); ++i) every_tile(none, pg, tiles, Tp);
    return at::zeros({n, 0, v.output_dim}, conv.options());
  }
  Tokens t{padding_bias(aspect_ratio_mask, share, T, Tp, conv.scalar_type(), conv.device()), pg,
           tiles, Tp};
  at::Tensor x = embed_tiles(w, v, pixel_values, ids, share, Tp);
  // hidden_states[k] of the local encoder: the output of layer k, kept for the listed k only.
  std::vector<at::Tensor> inter(v.intermediate_layers.size());
  for (int64_t i = 0; i < v.layers; ++i) {
    x = encoder_layer(x, w, kV + "transformer.layers." + std::to_string(i) + ".", v, t, false);
    for (size_t j = 0; j < inter.size(); ++j)
      if (v.intermediate_layers[j] == i) inter[j] = x;
  }
  x = layer_norm(x, w, kV + "layernorm_post", 1e-5);
  x = add_tile_embedding(x.reshape({n, share.count, Tp, W}), w,
                         kV + "post_tile_positional_embedding.", ids, tiles, share);
  x = x.reshape({n, share.count * Tp, W});
  for (int64_t i = 0; i < v.global_layers; ++i)
    x = encoder_layer(x, w, kV + "global_transformer.layers." + std::to_string(i) + ".", v, t,
                      true);

  // [final | intermediates], the intermediates stacked on a last axis and flattened (channel
  // d·k + j: torch.stack(dim=-1).reshape), padding tokens stripped.
  at::Tensor out = x.reshape({n, share.count, Tp, W});
  if (!inter.empty())
    out = at::cat({out, at::stack(inter, -1).reshape({n, share.count, Tp, -1})}, -1);
  return out.narrow(2, 0, T).reshape({n, share.count * T, v.output_dim});
}

at::Tensor project(const StateDict& w, const at::Tensor& vision_output) {
  return linear(vision_output, w, "multi_modal_projector", true);
}

at::Tensor encode_images(const StateDict& w, const Config& c, const at::Tensor& pixel_values,
                         const at::Tensor& aspect_ratio_ids, const at::Tensor& aspect_ratio_mask) {
  return project(w, encode_tiles(w, c, pixel_values, aspect_ratio_ids, aspect_ratio_mask, nullptr));
}

Tiled frames_as_images(const Config& c, const at::Tensor& frames) {
  const VisionConfig& v = c.vision;
  const int64_t S = v.image_size, tiles = v.max_num_tiles;
  LVX_CHECK(frames.dim() == 4 && frames.size(1) == 3 && frames.size(2) == S && frames.size(3) == S,
            "mllama frames_as_images: expected frames [F, 3, ", S, ", ", S, "] (image_size), got ",
            frames.sizes());
  int64_t id = -1;
  for (size_t i = 0; i < v.aspect_ratios.size(); ++i)
    if (v.aspect_ratios[i][0] == 1 && v.aspect_ratios[i][1] == 1) id = static_cast<int64_t>(i) + 1;
  LVX_CHECK(id > 0,
            "mllama frames_as_images: supported_aspect_ratios has no [1, 1] (a frame is "
            "one tile)");
  const int64_t F = frames.size(0);
  Tiled t;
  t.pixel_values =
      at::cat({frames.unsqueeze(1), at::zeros({F, tiles - 1, 3, S, S}, frames.options())}, 1);
  const auto i64 = frames.options().dtype(at::kLong);
  t.aspect_ratio_ids = at::full({F}, id, i64);
  t.aspect_ratio_mask = at::zeros({F, tiles}, i64);
  t.aspect_ratio_mask.select(1, 0).fill_(1);
  return t;
}

}  // namespace lvx::models::mllama
