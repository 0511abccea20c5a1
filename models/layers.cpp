#include "models/layers.h"

#include <cmath>

#include "models/lora.h"
#include "src/common/error.h"

namespace lvx::models {

at::Tensor linear(const at::Tensor& x, const StateDict& w, const std::string& prefix, bool bias) {
  return lora_linear(x, param(w, prefix + ".weight"),
                     bias ? c10::optional<at::Tensor>(param(w, prefix + ".bias")) : c10::nullopt);
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight,
                  const c10::optional<at::Tensor>& bias) {
  return lora_linear(x, weight, bias);
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const at::Tensor x32 = x.to(at::kFloat);
  const at::Tensor r = at::rsqrt(x32.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return weight * (x32 * r).to(x.scalar_type());
}

at::Tensor layer_norm(const at::Tensor& x, const StateDict& w, const std::string& prefix,
                      double eps) {
  const at::Tensor& weight = param(w, prefix + ".weight");
  auto it = w.find(prefix + ".bias");
  return at::layer_norm(x, {x.size(-1)}, weight,
                        it == w.end() ? c10::optional<at::Tensor>() : it->second, eps);
}

namespace {
constexpr const char* kActivations =
    "gelu, gelu_pytorch_tanh, gelu_new, gelu_fast, silu, swish, relu, quick_gelu";
}  // namespace

at::Tensor activation(const at::Tensor& x, const std::string& name) {
  if (name == "gelu") return at::gelu(x);
  if (name == "gelu_pytorch_tanh" || name == "gelu_new" || name == "gelu_fast")
    return at::gelu(x, "tanh");
  if (name == "silu" || name == "swish") return at::silu(x);
  if (name == "relu") return at::relu(x);
  if (name == "quick_gelu") return x * at::sigmoid(1.702 * x);
  LVX_FAIL("activation '", name, "' is not supported (", kActivations, ")");
}

void check_activation(const std::string& name, const std::string& where) {
  for (const char* n : {"gelu", "gelu_pytorch_tanh", "gelu_new", "gelu_fast", "silu", "swish",
                        "relu", "quick_gelu"})
    if (name == n) return;
  LVX_FAIL(where, ": activation '", name, "' is not supported (", kActivations, ")");
}

at::Tensor swiglu_mlp(const at::Tensor& x, const StateDict& w, const std::string& prefix) {
  return linear(at::silu(linear(x, w, prefix + ".gate_proj", false)) *
                    linear(x, w, prefix + ".up_proj", false),
                w, prefix + ".down_proj", false);
}

RotaryTables rotary_tables(const at::Tensor& positions, int64_t rot_dim, double theta) {
  LVX_CHECK(rot_dim > 0 && rot_dim % 2 == 0, "rotary: rotary dimension must be even, got ",
            rot_dim);
  const auto opts = at::TensorOptions().dtype(at::kFloat).device(positions.device());
  // inv_freq as transformers computes it: 1 / theta^(arange(0, rot, 2) / rot), in fp32.
  at::Tensor inv_freq =
      1.0 / at::pow(theta, at::arange(0, rot_dim, 2, opts.dtype(at::kLong)).to(at::kFloat) /
                               static_cast<double>(rot_dim));
  at::Tensor pos = positions.dim() == 1 ? positions.unsqueeze(0) : positions;
  at::Tensor angles = pos.to(at::kFloat).unsqueeze(-1) * inv_freq;  // [B, S, rot/2]
  at::Tensor emb = at::cat({angles, angles}, -1);
  return {emb.cos(), emb.sin()};
}

at::Tensor apply_rotary(const at::Tensor& x, const RotaryTables& t) {
  const int64_t rot = t.cos.size(-1), d = x.size(-1);
  const at::Tensor x32 = x.to(at::kFloat);
  at::Tensor xr = rot == d ? x32 : x32.narrow(-1, 0, rot);
  const at::Tensor cos = t.cos.unsqueeze(2), sin = t.sin.unsqueeze(2);  // [B, S, 1, rot]
  const int64_t half = rot / 2;
  at::Tensor rotated = at::cat({-xr.narrow(-1, half, half), xr.narrow(-1, 0, half)}, -1);
  at::Tensor out = xr * cos + rotated * sin;
  if (rot != d) out = at::cat({out, x32.narrow(-1, rot, d - rot)}, -1);
  return out.to(x.scalar_type());
}

at::Tensor local_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           bool causal, double scale) {
  // GQA through SDPA's enable_gqa: query head h reads K/V head h / (Hq / Hkv), as the kernels
  // map it, without copying K/V per query head.
  at::Tensor o = at::scaled_dot_product_attention(
      q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), /*attn_mask=*/{},
      /*dropout_p=*/0.0, causal, scale, /*enable_gqa=*/q.size(2) != k.size(2));
  return o.transpose(1, 2);  // [B, S, H, D]
}

}  // namespace lvx::models
