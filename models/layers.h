// Shared blocks of the model families (vLLM's model_executor/layers, llama.cpp's graph helpers):
// written once as functions of the checkpoint's tensors, composed by each family's model under
// models/<family>/. Plain ATen ops with autograd: every op has a CPU path and runs on CUDA where
// the tensors are.
//
// Shapes: activations are [..., width]; attention inputs [B, S, H, D].
#pragma once

#include <ATen/ATen.h>

#include <string>

#include "models/checkpoint.h"

namespace lvx::models {

// x·Wᵀ (+ b): `prefix.weight` [out, in] and, when `bias`, `prefix.bias` [out]. Every linear of
// every family goes through one of these two, so a LoRA adapter of the weight adds its branch
// on the activation path (models/lora.h, lora_linear).
at::Tensor linear(const at::Tensor& x, const StateDict& w, const std::string& prefix, bool bias);
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight,
                  const c10::optional<at::Tensor>& bias = c10::nullopt);

// RMSNorm (Qwen2, Llama): x / sqrt(mean(x²) + eps) · weight, computed in fp32 and cast back.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
// LayerNorm with `prefix.weight` and, when present, `prefix.bias`.
at::Tensor layer_norm(const at::Tensor& x, const StateDict& w, const std::string& prefix,
                      double eps);

// Activations by their Hugging Face names: "gelu" (exact), "gelu_pytorch_tanh" / "gelu_new" /
// "gelu_fast" (tanh approximation), "silu", "relu", "quick_gelu". Others are an error naming the
// value.
at::Tensor activation(const at::Tensor& x, const std::string& name);
// Refuses a name activation() does not compute, naming `where` (config.json and its field), so
// an unknown hidden_act is an error when the config is read, not at the first forward.
void check_activation(const std::string& name, const std::string& where);

// SwiGLU MLP (Qwen2, Llama): down(silu(gate(x)) ∘ up(x)), no biases.
at::Tensor swiglu_mlp(const at::Tensor& x, const StateDict& w, const std::string& prefix);

// Rotary embedding (rotate-half form, tables in fp32; RoFormer / GPT-NeoX / Qwen2):
// inv_freq_i = theta^(−2i/rot), angles = position · inv_freq over the first `rot` channels
// (rot = head_dim unless partial), cos/sin tables [..., rot] = cat(angles, angles).
struct RotaryTables {
  at::Tensor cos, sin;  // [B or 1, S, rot] fp32
};
// positions: int64 [S] or [B, S] (any integer position; MI-RoPE rotates visual keys at their
// image token's position).
RotaryTables rotary_tables(const at::Tensor& positions, int64_t rot_dim, double theta);
// Rotates the first rot channels of x [B, S, H, D] (the rest pass through); computed in fp32 and
// cast back to x's dtype.
at::Tensor apply_rotary(const at::Tensor& x, const RotaryTables& t);

// Plain local attention (every rank has the whole sequence): x [B, S, H·D] projected by the
// caller; q/k/v [B, S, H, D] with GQA when Hkv < Hq; non-causal unless `causal`. For the vision
// encoders and the Perceiver resampler (per-image attention, never distributed).
at::Tensor local_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           bool causal, double scale);

}  // namespace lvx::models
