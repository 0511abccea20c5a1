// Blockwise attention on GEMMs (FlashAttention-2's algorithm at key-chunk granularity, NOTES.md
// §0): a CUDA path for bf16/fp16/fp32 (LVX_CUDA_ATTENTION=gemm, and the fallback for blocks
// ATen's fused kernels cannot take: kernels/attention_fused.h), where cuBLAS tensor cores do QKᵀ
// and PV. Scores, the
// running (m, l), O and every gradient accumulator are fp32; only the operands of the second
// GEMMs (P, dS) are rounded to the input dtype, as FlashAttention does. GQA without expanding
// K/V: the query heads of one K/V head are stacked as rows of one GEMM. Chunks with no visible
// key are skipped; fully visible chunks build no mask; which is which is decided on the host from
// the mask metadata once per call, so no chunk waits on the device. Scores of one key chunk are
// held at a time (chunk sized to ~256 MiB), so memory is bounded for any Skv. Device-generic (any
// ATen device); on CPU the GEMMs run in fp32, which is how tests check the math here.
#pragma once

#include "kernels/attention.h"

namespace lvx::kernels {

AttentionOutput attention_forward_gemm(const at::Tensor& q, const at::Tensor& k,
                                       const at::Tensor& v, double scale, const AttentionMask& mask,
                                       AttentionStats* stats);

AttentionGrads attention_backward_gemm(const at::Tensor& q, const at::Tensor& k,
                                       const at::Tensor& v, const at::Tensor& dout,
                                       const at::Tensor& lse, const at::Tensor& delta, double scale,
                                       const AttentionMask& mask, AttentionStats* stats);

// The softmax passes of one key chunk, per device (kernels/registry.h's chunk_forward and
// chunk_backward): CPU in ATen ops (attention_gemm.cpp), CUDA fused (kernels/softmax_chunk.cu).
// s [R, C] fp32 unscaled scores (masked entries −inf), contiguous; m, l, alpha, lse, delta [R]
// fp32; p, ds [R, C] in the GEMM dtype (the CPU passes may replace them). Forward updates m and
// l in place and writes alpha = e^(m_old − m_new) and P; backward writes P and dS = P∘(dP − δ),
// P = 0 on rows whose lse is not finite.
void softmax_chunk_forward_cpu(const at::Tensor& s, double scale, at::Tensor& m, at::Tensor& l,
                               at::Tensor& alpha, at::Tensor& p);
void softmax_chunk_backward_cpu(const at::Tensor& s, const at::Tensor& dp, double scale,
                                const at::Tensor& lse, const at::Tensor& delta, at::Tensor& p,
                                at::Tensor& ds);
void softmax_chunk_forward_cuda(const at::Tensor& s, double scale, at::Tensor& m, at::Tensor& l,
                                at::Tensor& alpha, at::Tensor& p);
void softmax_chunk_backward_cuda(const at::Tensor& s, const at::Tensor& dp, double scale,
                                 const at::Tensor& lse, const at::Tensor& delta, at::Tensor& p,
                                 at::Tensor& ds);

}  // namespace lvx::kernels
