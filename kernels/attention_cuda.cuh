// Shared pieces of the CUDA attention kernels (attention_fwd.cu, attention_bwd.cu,
// merge_states.cu): tile summaries as raw device pointers, the CUDA status check, and the
// entry points the device table registers.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <cuda_runtime.h>

#include "kernels/mask.h"
#include "kernels/registry.h"
#include "src/common/error.h"

// Checks a CUDA runtime status, adding file:line and CUDA's own error string.
#define LVX_CUDA_CHECK(expr)                                                          \
  do {                                                                                \
    const cudaError_t lvx_status_ = (expr);                                           \
    LVX_CHECK(lvx_status_ == cudaSuccess, __FILE__, ":", __LINE__, ": ", #expr, ": ", \
              cudaGetErrorString(lvx_status_));                                       \
  } while (0)

namespace lvx::kernels {

// +infinity in device code (std::numeric_limits is host-only without relaxed constexpr).
template <typename A>
__device__ __forceinline__ A device_inf() {
  return static_cast<A>(__int_as_float(0x7f800000));
}

// PreparedMask's per-tile summaries ([B, n_tiles] each) as device pointers.
struct DeviceTileSummaries {
  int n_q_tiles = 0, n_k_tiles = 0;
  const int64_t *q_lo, *q_hi, *k_lo, *k_hi;
  const bool *q_has_none, *q_all_none, *k_has_none, *k_all_none;
  bool see_all = false;                                  // AttentionMask::unmatched_sees_all
  const bool *k_has_pad = nullptr, *k_all_pad = nullptr;  // set when see_all

  LVX_HOST_DEVICE TileSummary q(int64_t b, int64_t t) const {
    const int64_t i = b * n_q_tiles + t;
    TileSummary s{q_lo[i], q_hi[i], q_has_none[i], q_all_none[i]};
    s.has_all = see_all && s.has_none;
    s.all_all = see_all && s.all_none;
    return s;
  }
  LVX_HOST_DEVICE TileSummary k(int64_t b, int64_t t) const {
    const int64_t i = b * n_k_tiles + t;
    TileSummary s{k_lo[i], k_hi[i], k_has_none[i], k_all_none[i]};
    if (see_all) {
      s.has_pad = k_has_pad[i];
      s.all_pad = k_all_pad[i];
    }
    return s;
  }
};

DeviceTileSummaries device_tile_summaries(const PreparedMask& pm);

// Can a contiguous [B, S, H, D] tensor be read in 16-byte vectors (aligned base, rows of a
// multiple of 16 bytes)?
inline bool rows_aligned16(const at::Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 &&
         (t.size(3) * t.element_size()) % 16 == 0;
}

// Compute capability of q's GPU as major * 10 + minor (what ATen's SDPA checks compare against).
inline int cuda_sm(const at::Tensor& q) {
  const cudaDeviceProp* p = at::cuda::getDeviceProperties(q.device().index());
  return p->major * 10 + p->minor;
}

AttentionOutput attention_forward_cuda(const at::Tensor& q, const at::Tensor& k,
                                       const at::Tensor& v, double scale, const AttentionMask& mask,
                                       AttentionStats* stats);
AttentionGrads attention_backward_cuda(const at::Tensor& q, const at::Tensor& k,
                                       const at::Tensor& v, const at::Tensor& dout,
                                       const at::Tensor& lse, const at::Tensor& delta, double scale,
                                       const AttentionMask& mask, AttentionStats* stats);
void merge_attention_states_cuda(at::Tensor& o_acc, at::Tensor& lse_acc, const at::Tensor& o_new,
                                 const at::Tensor& lse_new);

// Adds the device counters [total, skipped, full] (int64, on the GPU) to *stats (if any).
inline void add_tile_counters(const at::Tensor& counters, AttentionStats* stats) {
  if (stats == nullptr) return;
  auto c = counters.cpu();
  stats->tiles_total += c[0].item<int64_t>();
  stats->tiles_skipped += c[1].item<int64_t>();
  stats->tiles_full += c[2].item<int64_t>();
}

}  // namespace lvx::kernels
