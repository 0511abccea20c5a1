// Blockwise attention on GEMMs (FlashAttention-2's algorithm at key-chunk granularity, NOTES.md
// §0): the CUDA path for bf16/fp16/fp32, where cuBLAS tensor cores do QKᵀ and PV. Scores, the
// running (m, l), O and every gradient accumulator are fp32; only the operands of the second
// GEMMs (P, dS) are rounded to the input dtype, as FlashAttention does. GQA without expanding
// K/V: the query heads of one K/V head are stacked as rows of one GEMM. Chunks with no visible
// key are skipped; fully visible chunks build no mask. Scores of one key chunk are held at a time
// (chunk sized to ~256 MiB), so memory is bounded for any Skv.
// Device-generic (any ATen device); on CPU the GEMMs run in fp32, which is how tests check the
// math here.
#pragma once

#include "kernels/attention.h"

namespace lvx::kernels {

// Which CUDA path serves `dtype`: the GEMM path for bf16/fp16/fp32 unless LVX_CUDA_ATTENTION=kernel
// selects the hand-written kernel (kernels/attention_{fwd,bwd}.cu, which also serves fp64).
bool cuda_uses_gemm_path(at::ScalarType dtype);

AttentionOutput attention_forward_gemm(const at::Tensor& q, const at::Tensor& k,
                                       const at::Tensor& v, double scale,
                                       const AttentionMask& mask, AttentionStats* stats);

AttentionGrads attention_backward_gemm(const at::Tensor& q, const at::Tensor& k,
                                       const at::Tensor& v, const at::Tensor& dout,
                                       const at::Tensor& lse, const at::Tensor& delta,
                                       double scale, const AttentionMask& mask,
                                       AttentionStats* stats);

}  // namespace lvx::kernels
