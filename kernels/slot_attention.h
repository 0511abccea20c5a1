// Attention of several rows' queries over their own slots of one key pool (lvx serve's batched
// decode steps, models/row_key_pool.h): row r's tokens read only slot slots[r], each token its
// own count of the slot's first keys. This is a decode step's attention over per-row key lengths
// (FlashAttention-2's forward, Dao 2023, Alg. 1, per row; the same softmax as
// kernels/attention.h: lse = log Σ_j exp(S_ij), O = Σ_j exp(S_ij − lse_i)·V_j).
//
// Why lvx's own CPU loop (slot_attention_cpu.cpp): ATen has no attention over per-row key lengths
// on CPU (its varlen flash attention is CUDA-only), so the rows' product was built from ATen ops:
// one gather of the slots padded to the longest, an additive mask, baddbmm, four softmax passes
// and bmm. At 16 rows of lvx serve's benchmark model (2 K/V heads of 16 dims, ~80 keys a row)
// that was ~200 µs a layer, a quarter of a batched decode step: mostly per-op fixed cost and
// MKL packing 32 matrices of 2 x 80. The loop reads the pool in place, each row only its own keys
// (no padding, no mask): ~38 µs (slot_attention_cpu.cpp). Every other device (CUDA, meta) takes
// that composite of ATen ops (slot_attention.cpp), where one batched GEMM is the fast kernel.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace lvx::kernels {

struct SlotAttentionOutput {
  at::Tensor o;    // [R, T, Hq, Dv], accumulation dtype (accumulation_dtype(q))
  at::Tensor lse;  // [R, T, Hq], accumulation dtype, natural log
};

// Row r's T query tokens q[r] ([R, T, Hq, D]) over slot slots[r] of the pool k [S, Hkv, C, D],
// v [S, Hkv, C, Dv] (head-major: a slot's keys of one head are a [C, D] block): token t of row r
// sees the slot's keys [0, sees[r·T + t]), 1 <= sees <= C. Hq % Hkv == 0 (query head h reads K/V
// head h / (Hq / Hkv)). scale > 0 multiplies q·k.
SlotAttentionOutput slot_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   const std::vector<int64_t>& slots,
                                   const std::vector<int64_t>& sees, double scale);

// The CPU loop (slot_attention_cpu.cpp) and the composite of ATen ops every device can run
// (slot_attention.cpp), both on checked, contiguous arguments; tests compare the two.
SlotAttentionOutput slot_attention_cpu(const at::Tensor& q, const at::Tensor& k,
                                       const at::Tensor& v, const std::vector<int64_t>& slots,
                                       const std::vector<int64_t>& sees, double scale);
SlotAttentionOutput slot_attention_composite(const at::Tensor& q, const at::Tensor& k,
                                             const at::Tensor& v, const std::vector<int64_t>& slots,
                                             const std::vector<int64_t>& sees, double scale);

}  // namespace lvx::kernels
