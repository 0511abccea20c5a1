// OpenFlamingo's ViT and perceiver; see vision.h.
#include "models/openflamingo/vision.h"

#include <cmath>

namespace lvx::models {

at::Tensor clip_tokens(const StateDict& w, const OpenFlamingoConfig& c, const at::Tensor& px) {
  const at::Tensor& conv = param(w, kVis + "conv1.weight");
  const std::vector<int64_t> stride{c.patch_size, c.patch_size};
  at::Tensor x = at::conv2d(px.to(conv.scalar_type()), conv, {}, stride).flatten(2).transpose(1, 2);
  const int64_t n = x.size(0), width = c.v_width, hd = width / c.v_heads;
  x = at::cat({param(w, kVis + "class_embedding").expand({n, 1, width}), x}, 1) +
      param(w, kVis + "positional_embedding");
  if (c.v_ln_pre) x = layer_norm(x, w, kVis + "ln_pre", c.v_eps);
  const std::string act = c.v_act == "gelu_tanh" ? "gelu_pytorch_tanh" : c.v_act;
  for (int64_t i = 0; i < c.v_layers; ++i) {
    const std::string b = kVis + "transformer.resblocks." + std::to_string(i) + ".";
    const at::Tensor h = layer_norm(x, w, b + "ln_1", c.v_eps);
    const auto qkv =
        at::linear(h, param(w, b + "attn.in_proj_weight"), param(w, b + "attn.in_proj_bias"))
            .chunk(3, -1);  // rows q | k | v
    auto heads = [&](const at::Tensor& t) { return t.reshape({n, -1, c.v_heads, hd}); };
    const at::Tensor o = local_attention(heads(qkv[0]), heads(qkv[1]), heads(qkv[2]), false,
                                         1.0 / std::sqrt(static_cast<double>(hd)));
    x = x + linear(o.reshape({n, -1, width}), w, b + "attn.out_proj", true);
    x = x + linear(activation(
                       linear(layer_norm(x, w, b + "ln_2", c.v_eps), w, b + "mlp.c_fc", true), act),
                   w, b + "mlp.c_proj", true);
  }
  if (c.v_tokens_ln_post) x = layer_norm(x, w, kVis + "ln_post", c.v_eps);
  return x.narrow(1, 1, x.size(1) - 1);
}

at::Tensor perceiver(const StateDict& w, const OpenFlamingoConfig& c, const at::Tensor& x) {
  const int64_t n = x.size(0), width = c.v_width, inner = c.p_heads * c.p_dim_head;
  at::Tensor lat = param(w, "perceiver.latents").unsqueeze(0).expand({n, c.p_latents, width});
  auto heads = [&](const at::Tensor& t) {
    return t.reshape({n, t.size(1), c.p_heads, c.p_dim_head});
  };
  for (int64_t l = 0; l < c.p_depth; ++l) {
    const std::string b = "perceiver.layers." + std::to_string(l) + ".";
    const at::Tensor xn = layer_norm(x, w, b + "0.norm_media", c.p_eps);
    const at::Tensor ln = layer_norm(lat, w, b + "0.norm_latents", c.p_eps);
    const at::Tensor q = linear(ln, w, b + "0.to_q", false);
    const auto kv = linear(at::cat({xn, ln}, 1), w, b + "0.to_kv", false).chunk(2, -1);
    const at::Tensor o = local_attention(heads(q), heads(kv[0]), heads(kv[1]), false,
                                         1.0 / std::sqrt(static_cast<double>(c.p_dim_head)));
    lat = linear(o.reshape({n, c.p_latents, inner}), w, b + "0.to_out", false) + lat;
    lat = linear(at::gelu(linear(layer_norm(lat, w, b + "1.0", c.p_eps), w, b + "1.1", false)), w,
                 b + "1.3", false) +
          lat;
  }
  return layer_norm(lat, w, "perceiver.norm", c.p_eps);
}

}  // namespace lvx::models
