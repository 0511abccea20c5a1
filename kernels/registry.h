// Per-device implementations of the attention ops. Each device's files fill one entry
// (torchcodec-style registration); kernels/attention.cpp picks the entry by q.device(), so
// callers never see #ifdef LVX_WITH_CUDA. Internal to kernels/.
#pragma once

#include <ATen/ATen.h>

#include "kernels/attention.h"

namespace lvx::kernels {

// CPU tile sizes (queries x keys): 128 x 512 fp32 scores = 256 KiB, one L2-sized tile per
// thread. Tests use them to count the tiles a mask lets the kernels skip.
constexpr int64_t kCpuQTile = 128;
constexpr int64_t kCpuKTile = 512;
// Tiles of the CPU grid that an sq x sk problem spans (per batch row and head).
constexpr int64_t cpu_tiles(int64_t sq, int64_t sk) {
  return ((sq + kCpuQTile - 1) / kCpuQTile) * ((sk + kCpuKTile - 1) / kCpuKTile);
}

// Arguments are already checked and in canonical form (see attention.cpp): q, k, v, dout in
// [B, S, H, D] with the last dim contiguous; lse, delta contiguous [B, Hq, Sq] in the
// accumulation dtype; scale resolved (> 0).
using ForwardFn = AttentionOutput (*)(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                      double scale, const AttentionMask& mask,
                                      AttentionStats* stats);
using BackwardFn = AttentionGrads (*)(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                      const at::Tensor& dout, const at::Tensor& lse,
                                      const at::Tensor& delta, double scale,
                                      const AttentionMask& mask, AttentionStats* stats);
// o_acc/lse_acc contiguous, accumulation dtype; o_new/lse_new the same dtype and shape.
using MergeFn = void (*)(at::Tensor& o_acc, at::Tensor& lse_acc, const at::Tensor& o_new,
                         const at::Tensor& lse_new);

// The GEMM path's softmax passes of one key chunk (kernels/attention_gemm.h).
using ChunkForwardFn = void (*)(const at::Tensor& s, double scale, at::Tensor& m, at::Tensor& l,
                                at::Tensor& alpha, at::Tensor& p);
using ChunkBackwardFn = void (*)(const at::Tensor& s, const at::Tensor& dp, double scale,
                                 const at::Tensor& lse, const at::Tensor& delta, at::Tensor& p,
                                 at::Tensor& ds);

struct AttentionImpl {
  const char* name = nullptr;
  ForwardFn forward = nullptr;
  BackwardFn backward = nullptr;
  MergeFn merge = nullptr;
  ChunkForwardFn chunk_forward = nullptr;  // none on meta (shapes only)
  ChunkBackwardFn chunk_backward = nullptr;
};

// The implementation for a device type, or null when none was compiled in.
const AttentionImpl* find_attention_impl(c10::DeviceType device);

// Filled in by attention_{fwd,bwd}_cpu.cpp / merge_states_cpu.cpp and, with CUDA, by the .cu
// twins (registered from registry.cpp so that static linking keeps them).
AttentionOutput attention_forward_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                      double scale, const AttentionMask& mask,
                                      AttentionStats* stats);
AttentionGrads attention_backward_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                      const at::Tensor& dout, const at::Tensor& lse,
                                      const at::Tensor& delta, double scale,
                                      const AttentionMask& mask, AttentionStats* stats);
void merge_attention_states_cpu(at::Tensor& o_acc, at::Tensor& lse_acc, const at::Tensor& o_new,
                                const at::Tensor& lse_new);
// kernels/attention_fused.cpp: the CPU entry. Each block goes where kernels/cpu_path.h says:
// bf16/fp16/fp32 to the fused plan (kernels/attention_fused.h) on
// at::_scaled_dot_product_flash_attention_for_cpu by default, or to the GEMM path; fp64 (and any
// dtype with LVX_CPU_ATTENTION=kernel) to lvx's own kernels above. cpu_uses_fused_path: whether
// a block of this dtype takes the fused plan when no per-shape choice applies.
bool cpu_uses_fused_path(at::ScalarType dtype);
AttentionOutput attention_forward_dispatch_cpu(const at::Tensor& q, const at::Tensor& k,
                                               const at::Tensor& v, double scale,
                                               const AttentionMask& mask, AttentionStats* stats);
AttentionGrads attention_backward_dispatch_cpu(const at::Tensor& q, const at::Tensor& k,
                                               const at::Tensor& v, const at::Tensor& dout,
                                               const at::Tensor& lse, const at::Tensor& delta,
                                               double scale, const AttentionMask& mask,
                                               AttentionStats* stats);
// CUDA: the same fused plan on ATen's flash / memory-efficient attention by default, lvx's GEMM
// path or hand-written kernels otherwise (cuda_attention_path, kernels/attention_fused.h).
AttentionImpl cuda_attention_impl();  // defined in attention_fwd.cu when LVX_WITH_CUDA
// Shape-only twins for the `meta` device (attention_meta.cpp): the placement check.
AttentionOutput attention_forward_meta(const at::Tensor& q, const at::Tensor& k,
                                       const at::Tensor& v, double scale, const AttentionMask& mask,
                                       AttentionStats* stats);
AttentionGrads attention_backward_meta(const at::Tensor& q, const at::Tensor& k,
                                       const at::Tensor& v, const at::Tensor& dout,
                                       const at::Tensor& lse, const at::Tensor& delta, double scale,
                                       const AttentionMask& mask, AttentionStats* stats);
void merge_attention_states_meta(at::Tensor& o_acc, at::Tensor& lse_acc, const at::Tensor& o_new,
                                 const at::Tensor& lse_new);

}  // namespace lvx::kernels
