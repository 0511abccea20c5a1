#include "models/mllama/vision.h"

#include <cmath>
#include <limits>
#include <string>

#include "models/layers.h"
#include "src/common/error.h"

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

// MllamaPrecomputedAspectRatioEmbedding: x [n, tiles, t, W] + tanh(gate)·table[ar_id] per tile.
at::Tensor add_tile_embedding(const at::Tensor& x, const StateDict& w, const std::string& prefix,
                              const at::Tensor& ar_ids) {
  const int64_t n = x.size(0), tiles = x.size(1), W = x.size(3);
  at::Tensor e =
      at::embedding(param(w, prefix + "embedding.weight"), ar_ids).reshape({n, tiles, 1, W});
  return x + e * param(w, prefix + "gate").tanh();
}

// MllamaVisionEncoderLayer (pre-LN; the global encoder's layers gate both branches by tanh).
at::Tensor encoder_layer(const at::Tensor& x, const StateDict& w, const std::string& p,
                         const VisionConfig& c, const at::Tensor& bias, bool gated) {
  const int64_t n = x.size(0), L = x.size(1), hd = c.hidden / c.heads;
  at::Tensor y = layer_norm(x, w, p + "input_layernorm", c.norm_eps);
  auto heads = [&](const std::string& proj) {
    return linear(y, w, p + "self_attn." + proj, false).view({n, L, c.heads, hd}).transpose(1, 2);
  };
  at::Tensor o = at::scaled_dot_product_attention(heads("q_proj"), heads("k_proj"), heads("v_proj"),
                                                  bias, 0.0, false, 1.0 / std::sqrt(double(hd)));
  o = linear(o.transpose(1, 2).reshape({n, L, c.hidden}), w, p + "self_attn.o_proj", false);
  at::Tensor h = x + (gated ? param(w, p + "gate_attn").tanh() * o : o);
  at::Tensor m = layer_norm(h, w, p + "post_attention_layernorm", c.norm_eps);
  m = linear(activation(linear(m, w, p + "mlp.fc1", true), "gelu"), w, p + "mlp.fc2", true);
  return h + (gated ? param(w, p + "gate_ffn").tanh() * m : m);
}

}  // namespace

at::Tensor encode_images(const StateDict& w, const Config& c, const at::Tensor& pixel_values,
                         const at::Tensor& aspect_ratio_ids, const at::Tensor& aspect_ratio_mask) {
  const VisionConfig& v = c.vision;
  const int64_t tiles = v.max_num_tiles, S = v.image_size, W = v.hidden, P = v.patches(),
                T = v.tokens_per_tile();
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
  const at::Tensor& conv = param(w, kV + "patch_embedding.weight");
  const auto dt = conv.scalar_type();
  if (n == 0) return at::zeros({0, tiles * T, c.text.hidden}, conv.options());
  if (aspect_ratio_ids.device().is_cpu()) {  // the table lookup would fail less clearly
    const int64_t lo = aspect_ratio_ids.min().item<int64_t>(),
                  hi = aspect_ratio_ids.max().item<int64_t>();
    LVX_CHECK(lo >= 0 && hi <= static_cast<int64_t>(v.aspect_ratios.size()),
              "mllama encode_images: aspect_ratio_ids: expected ids in [0, ",
              v.aspect_ratios.size(), "] (0: padding image), got [", lo, ", ", hi, "]");
  }
  const at::Tensor ids = aspect_ratio_ids.to(conv.device(), at::kLong);

  // Patches: conv without bias, [n·tiles, P, W]; pre-tile embedding on the patches only.
  at::Tensor x = at::conv2d(pixel_values.reshape({n * tiles, 3, S, S}).to(conv.options()), conv, {},
                            {v.patch_size, v.patch_size});
  x = x.flatten(2).transpose(1, 2).reshape({n, tiles, P, W});
  x = add_tile_embedding(x, w, kV + "pre_tile_positional_embedding.", ids);
  // Class token first in every tile.
  x = at::cat({param(w, kV + "class_embedding").expand({n, tiles, 1, W}), x}, 2);
  // Gated positional embedding: (1 − tanh g)·shared [T, W] + tanh g·tile table [tiles, T, W].
  const std::string g = kV + "gated_positional_embedding.";
  const at::Tensor gate = param(w, g + "gate").tanh();
  x = x + (1 - gate) * param(w, g + "embedding").view({1, 1, T, W});
  x = x +
      gate * at::embedding(param(w, g + "tile_embedding.weight"), ids).reshape({n, tiles, T, W});
  x = layer_norm(x, w, kV + "layernorm_pre", 1e-5);  // nn.LayerNorm's default eps, as released

  // Pad each tile to a multiple of 8 tokens; a (query, key) pair is masked only when BOTH are
  // padding (a padding tile or a padding token): _prepare_aspect_ratio_attention_mask's outer
  // product, reproduced as is.
  const int64_t pad = (8 - T % 8) % 8, Tp = T + pad, L = tiles * Tp;
  x = at::constant_pad_nd(x, {0, 0, 0, pad}, 0);
  at::Tensor real = aspect_ratio_mask.to(conv.device()).ne(0).view({n, tiles, 1}) &
                    at::arange(Tp, ids.options()).lt(T).view({1, 1, Tp});
  at::Tensor padding = real.logical_not().reshape({n, L, 1}).to(dt);
  at::Tensor bias = (at::matmul(padding, padding.transpose(1, 2)) * lowest(dt)).unsqueeze(1);

  x = x.reshape({n, L, W});
  // hidden_states[k] of the local encoder: the output of layer k, kept for the listed k only.
  std::vector<at::Tensor> inter(v.intermediate_layers.size());
  for (int64_t i = 0; i < v.layers; ++i) {
    x = encoder_layer(x, w, kV + "transformer.layers." + std::to_string(i) + ".", v, bias, false);
    for (size_t j = 0; j < inter.size(); ++j)
      if (v.intermediate_layers[j] == i) inter[j] = x;
  }
  x = layer_norm(x, w, kV + "layernorm_post", 1e-5);
  x = add_tile_embedding(x.reshape({n, tiles, Tp, W}), w, kV + "post_tile_positional_embedding.",
                         ids);
  x = x.reshape({n, L, W});
  for (int64_t i = 0; i < v.global_layers; ++i)
    x = encoder_layer(x, w, kV + "global_transformer.layers." + std::to_string(i) + ".", v, bias,
                      true);

  // [final | intermediates], the intermediates stacked on a last axis and flattened (channel
  // d·k + j: torch.stack(dim=-1).reshape), padding tokens stripped.
  at::Tensor out = x.reshape({n, tiles, Tp, W});
  if (!inter.empty()) out = at::cat({out, at::stack(inter, -1).reshape({n, tiles, Tp, -1})}, -1);
  out = out.narrow(2, 0, T);
  out = out.reshape({n, tiles * T, v.output_dim});
  return linear(out, w, "multi_modal_projector", true);
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
