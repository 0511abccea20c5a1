#include "models/vision.h"

#include <cmath>

#include "models/checkpoint.h"
#include "models/layers.h"
#include "src/common/error.h"

namespace lvx::models {

SiglipConfig siglip_config(const nlohmann::json& v, const std::string& where) {
  const std::string w = where + ": vision_config";
  SiglipConfig c;
  LVX_CHECK(v.is_object(), w, ": expected an object, got ", v.type_name());
  // transformers' SiglipVisionConfig defaults (so400m-style releases set the sizes explicitly).
  // Every size positive and bounded before anything is sized from it.
  c.hidden = config_int_in_or(v, "hidden_size", w, 1, kMaxConfigWidth, 768);
  c.layers = config_int_in_or(v, "num_hidden_layers", w, 1, kMaxConfigLayers, 12);
  c.heads = config_int_in_or(v, "num_attention_heads", w, 1, kMaxConfigHeads, 12);
  c.mlp = config_int_in_or(v, "intermediate_size", w, 1, kMaxConfigWidth, 3072);
  c.image_size = config_int_in_or(v, "image_size", w, 1, kMaxConfigImage, 224);
  c.patch_size = config_int_in_or(v, "patch_size", w, 1, kMaxConfigImage, 16);
  c.channels = config_int_in_or(v, "num_channels", w, 1, 16, 3);
  c.eps = config_positive_or(v, "layer_norm_eps", w, 1e-6);
  c.act = config_string_or(v, "hidden_act", w, c.act);
  check_activation(c.act, w + ": hidden_act");
  LVX_CHECK(c.hidden % c.heads == 0, w,
            ": hidden_size must be a positive multiple of num_attention_heads (", c.hidden, ", ",
            c.heads, ")");
  // SigLIP takes image_size // patch_size patches per side ('valid' convolution): so400m-patch14
  // has 384-pixel images, which 14 does not divide. At least one patch.
  LVX_CHECK(c.image_size >= c.patch_size, w, ": image_size ", c.image_size, " and patch_size ",
            c.patch_size, " give no patch");
  return c;
}

ShapeSpec siglip_shapes(const SiglipConfig& c, const std::string& p, int64_t run_layers) {
  const int64_t h = c.hidden;
  ShapeSpec s{
      {p + "embeddings.patch_embedding.weight", {h, c.channels, c.patch_size, c.patch_size}},
      {p + "embeddings.patch_embedding.bias", {h}},
      {p + "embeddings.position_embedding.weight", {c.tokens(), h}}};
  for (int64_t i = 0; i < run_layers; ++i) {
    const std::string l = p + "encoder.layers." + std::to_string(i) + ".";
    for (const char* n : {"layer_norm1", "layer_norm2"}) {
      s[l + n + ".weight"] = {h};
      s[l + n + ".bias"] = {h};
    }
    for (const char* n : {"q_proj", "k_proj", "v_proj", "out_proj"}) {
      s[l + "self_attn." + n + ".weight"] = {h, h};
      s[l + "self_attn." + n + ".bias"] = {h};
    }
    s[l + "mlp.fc1.weight"] = {c.mlp, h};
    s[l + "mlp.fc1.bias"] = {c.mlp};
    s[l + "mlp.fc2.weight"] = {h, c.mlp};
    s[l + "mlp.fc2.bias"] = {h};
  }
  return s;
}

at::Tensor siglip_forward(const StateDict& w, const std::string& p, const SiglipConfig& c,
                          const at::Tensor& pixel_values, int64_t run_layers) {
  LVX_CHECK(pixel_values.dim() == 4 && pixel_values.size(1) == c.channels &&
                pixel_values.size(2) == c.image_size && pixel_values.size(3) == c.image_size,
            "vision encoder: pixel_values must be [N, ", c.channels, ", ", c.image_size, ", ",
            c.image_size, "], got ", pixel_values.sizes());
  LVX_CHECK(run_layers >= 0 && run_layers <= c.layers, "vision encoder: ", run_layers,
            " layers of ", c.layers);
  const at::Tensor& pw = param(w, p + "embeddings.patch_embedding.weight");
  // 'valid' stride-patch convolution: the last pixels not covered by a whole patch are dropped.
  const std::vector<int64_t> stride{c.patch_size, c.patch_size}, pad{0, 0};
  at::Tensor x = at::conv2d(pixel_values.to(pw.scalar_type()), pw,
                            param(w, p + "embeddings.patch_embedding.bias"), stride,
                            at::IntArrayRef(pad));  // [N, h, g, g]
  x = x.flatten(2).transpose(1, 2);                 // [N, tokens, h]
  x = x + param(w, p + "embeddings.position_embedding.weight");
  const int64_t n = x.size(0), t = x.size(1), hd = c.hidden / c.heads;
  const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
  for (int64_t i = 0; i < run_layers; ++i) {
    const std::string l = p + "encoder.layers." + std::to_string(i) + ".";
    at::Tensor y = layer_norm(x, w, l + "layer_norm1", c.eps);
    auto heads = [&](const char* proj) {
      return linear(y, w, l + "self_attn." + proj, true).view({n, t, c.heads, hd});
    };
    at::Tensor a = local_attention(heads("q_proj"), heads("k_proj"), heads("v_proj"), false, scale);
    x = x + linear(a.reshape({n, t, c.hidden}), w, l + "self_attn.out_proj", true);
    y = layer_norm(x, w, l + "layer_norm2", c.eps);
    x = x + linear(activation(linear(y, w, l + "mlp.fc1", true), c.act), w, l + "mlp.fc2", true);
  }
  return x;
}

}  // namespace lvx::models
