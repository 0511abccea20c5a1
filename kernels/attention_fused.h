// Local attention on ATen's fused kernels, one plan for every device (issue 21, "Local attention
// on ATen's fused kernels"). Internal to kernels/.
//
// The plan (attention_fused.cpp; FlashAttention-2 tiling, Dao 2023, Alg. 1/2, at the granularity
// of lvx's 128 x 512 tiles): per batch row and query tile, key tiles are classified none /
// partial / full from the per-tile min/max summaries of kernels/mask.h on the host (no .item());
// maximal runs of full tiles become one call without a mask, runs of partial tiles one call with
// an additive −inf mask (or is_causal when the run is exactly top-left causal), tiles outside the
// visible range are skipped, query tiles with equal runs share one call. The calls' results merge
// in fp32 (pure-LSE merge, NOTES.md §0). GQA, per block or piece, on K/V views (never copied):
// grouped K/V heads where the table takes them (flash); else, without a causal order among the
// queries, each K/V head's g query heads folded along the sequence into one call (a bias
// repeated per folded head); else one call per query head of a group. Backward: the ops derive
// delta = rowsum(dO ∘ O) from the O they are given; lvx's backward gets delta, so it passes O' = dO
// · delta / |dO|² (rowsum(dO ∘ O') = delta; O' = 0 where dO = 0), rounded once to the input dtype
// like an op's own O.
//
// Only the op calls differ per device, behind FusedOps:
//   CPU  at::_scaled_dot_product_flash_attention_for_cpu (+ _backward): every call.
//   CUDA at::_scaled_dot_product_flash_attention (+ _backward): bf16/fp16 calls without a mask
//        (causal only when square: ATen's flash is causal from the bottom right);
//        at::_scaled_dot_product_efficient_attention (+ _backward): fp32 calls, masked calls
//        (attn_bias), non-square causal calls (top-left), and bf16/fp16 where flash is not built
//        for the GPU. cuda_fused_kernel() is that choice, a pure function tests pin on CPU.
#pragma once

#include <ATen/ATen.h>

#include <tuple>

#include "kernels/attention.h"
#include "kernels/registry.h"

namespace lvx::kernels {

// One call of a fused op: queries [1, H, n, D] and keys/values [1, H, m, D], strided views of
// lvx's [B, S, H, D] tensors with the last dim contiguous, in the input dtype; where the table
// takes grouped heads (FusedOps::grouped), keys/values may have H / g heads, query head h
// reading K/V head h / g (lvx's GQA layout).
struct FusedCall {
  at::Tensor q, k, v;
  bool causal = false;  // top-left causal: query r sees key c iff c <= r (no bias then)
  at::Tensor bias;      // additive mask [1, 1, n, m], 0 / −inf, in q's dtype; or undefined.
                        // Row stride a multiple of FusedOps::bias_align.
  at::Tensor rows;      // with a bias: [1, 1, n] bool, the row sees some key of the call
  double scale = 0;     // softmax scale (> 0)
};

struct FusedOps;
// o [1, H, n, D] in the input dtype; lse [1, H, n] natural log (fp32 on every device). A row that
// sees no key (possible only with a bias) may come back with any lse: the plan sets it to −inf
// from FusedCall::rows; its o must be finite.
using FusedForwardFn = std::tuple<at::Tensor, at::Tensor> (*)(const FusedOps& ops,
                                                              const FusedCall& call);
// dq [1, H, n, D], dk and dv [1, H, m, D] in the input dtype, from dout and out = O' [1, H, n, D]
// (input dtype) and lse [1, H, n] fp32 contiguous (+inf for rows that see no key anywhere).
using FusedBackwardFn = std::tuple<at::Tensor, at::Tensor, at::Tensor> (*)(const FusedOps& ops,
                                                                           const FusedCall& call,
                                                                           const at::Tensor& dout,
                                                                           const at::Tensor& out,
                                                                           const at::Tensor& lse);

// The device table of the fused path.
struct FusedOps {
  const char* name = nullptr;
  FusedForwardFn forward = nullptr;
  FusedBackwardFn backward = nullptr;
  MergeFn merge = nullptr;  // the device's merge_attention_states
  int64_t bias_align = 1;   // rows of a bias start at multiples of this many elements
  int sm = 0;               // CUDA: compute capability as major * 10 + minor; 0 elsewhere
  // Whether a call may have fewer K/V heads than query heads (one call for a whole GQA block
  // instead of one per query head of each group); nullptr: never. CUDA: when flash serves the
  // call (flash_api.cpp mha_fwd/mha_bwd take num_heads_k dividing num_heads and return dK, dV
  // summed over each group); the memory-efficient kernel needs equal heads.
  bool (*grouped)(const FusedOps& ops, const FusedCall& call) = nullptr;
};

// The shared plan through `ops`. Same contract as the device table's ForwardFn / BackwardFn
// (kernels/registry.h): q, k, v, dout [B, S, H, D] contiguous in bf16/fp16/fp32, lse and delta
// [B, Hq, Sq] fp32; outputs fp32. The mask's metadata may sit on any device.
AttentionOutput attention_forward_fused(const FusedOps& ops, const at::Tensor& q,
                                        const at::Tensor& k, const at::Tensor& v, double scale,
                                        const AttentionMask& mask, AttentionStats* stats);
AttentionGrads attention_backward_fused(const FusedOps& ops, const at::Tensor& q,
                                        const at::Tensor& k, const at::Tensor& v,
                                        const at::Tensor& dout, const at::Tensor& lse,
                                        const at::Tensor& delta, double scale,
                                        const AttentionMask& mask, AttentionStats* stats);

// ---- CPU ------------------------------------------------------------------------------------
const FusedOps& cpu_fused_ops();

// ---- CUDA (attention_fused_cuda.cpp: dispatcher ops only, compiled in every build) -----------
enum class FusedKernel { kFlash, kEfficient };
const char* fused_kernel_name(FusedKernel k);

// Which ATen CUDA kernel serves a call of `dtype` with n queries and m keys on a GPU of compute
// capability `sm`, head dim `d`: flash for bf16/fp16 without a bias (causal only when n == m)
// where ATen builds flash for the GPU, else memory-efficient.
FusedKernel cuda_fused_kernel(at::ScalarType dtype, bool causal, bool has_bias, int64_t n,
                              int64_t m, int64_t d, int sm);

// Why the fused path cannot take this block on CUDA (the GEMM path then does), or nullptr when
// it can. Every constraint ATen states for the memory-efficient kernel (which serves any call
// flash cannot), each with where ATen states it.
const char* cuda_fused_unsupported(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   int sm);

// Which CUDA path serves a block (LVX_CUDA_ATTENTION: unset or "fused" = the fused plan where
// cuda_fused_unsupported allows, else the GEMM path; "gemm" = lvx's GEMM path
// (attention_gemm.cpp); "kernel" = lvx's hand-written kernels (attention_{fwd,bwd}.cu)). fp64
// and empty blocks always take the hand-written kernels.
enum class CudaAttentionPath { kFused, kGemm, kKernel };
CudaAttentionPath cuda_attention_path(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                      int sm);

// The CUDA table for a GPU of compute capability `sm`; `merge` is merge_attention_states_cuda
// (passed in: this file is compiled without the CUDA objects).
FusedOps cuda_fused_ops(int sm, MergeFn merge);
// FusedOps::grouped of the CUDA table: flash serves the call.
bool cuda_takes_grouped_heads(const FusedOps& ops, const FusedCall& call);

}  // namespace lvx::kernels
