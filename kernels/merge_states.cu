// CUDA merge of two partial attention states in pure-LSE form (NOTES.md §0; vLLM
// merge_attn_states): o_acc [B, S, H, D], lse_acc [B, H, S], updated in place from
// (o_new, lse_new). Empty rows (lse -inf, or +inf by the flash-attn convention) weigh zero;
// a row empty on both sides ends with lse = -inf and o = 0.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <limits>

#include "kernels/attention_cuda.cuh"

namespace lvx::kernels {
namespace {

template <typename A>
__global__ void merge_states_kernel(A* o_acc, A* lse_acc, const A* o_new, const A* lse_new,
                                    int64_t batch, int64_t s, int64_t h, int64_t d) {
  const A inf = device_inf<A>();
  const int64_t rows = batch * h * s;
  for (int64_t row = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; row < rows;
       row += int64_t{gridDim.x} * blockDim.x) {
    const int64_t i = row % s, hh = (row / s) % h, b = row / (s * h);
    A* o = o_acc + ((b * s + i) * h + hh) * d;
    const A* on = o_new + ((b * s + i) * h + hh) * d;
    const A a = isinf(lse_acc[row]) ? -inf : lse_acc[row];
    const A n = isinf(lse_new[row]) ? -inf : lse_new[row];
    const A m = a > n ? a : n;
    if (m == -inf) {
      lse_acc[row] = -inf;
      for (int64_t x = 0; x < d; ++x) o[x] = 0;
      continue;
    }
    const A wa = exp(a - m), wn = exp(n - m), sum = wa + wn;
    const A ca = wa / sum, cn = wn / sum;
    lse_acc[row] = m + log(sum);
    if (cn == A(0)) continue;
    for (int64_t x = 0; x < d; ++x) o[x] = (ca == A(0) ? A(0) : o[x] * ca) + on[x] * cn;
  }
}

}  // namespace

void merge_attention_states_cuda(at::Tensor& o_acc, at::Tensor& lse_acc, const at::Tensor& o_new,
                                 const at::Tensor& lse_new) {
  c10::cuda::CUDAGuard guard(o_acc.device());
  const int64_t batch = o_acc.size(0), s = o_acc.size(1), h = o_acc.size(2), d = o_acc.size(3);
  const int64_t rows = batch * h * s;
  if (rows == 0) return;
  const int blocks = static_cast<int>(std::min<int64_t>((rows + 255) / 256, 65535));
  auto stream = at::cuda::getCurrentCUDAStream(o_acc.get_device());
  if (o_acc.scalar_type() == at::kDouble) {
    merge_states_kernel<double><<<blocks, 256, 0, stream>>>(
        o_acc.data_ptr<double>(), lse_acc.data_ptr<double>(), o_new.data_ptr<double>(),
        lse_new.data_ptr<double>(), batch, s, h, d);
  } else {
    merge_states_kernel<float><<<blocks, 256, 0, stream>>>(
        o_acc.data_ptr<float>(), lse_acc.data_ptr<float>(), o_new.data_ptr<float>(),
        lse_new.data_ptr<float>(), batch, s, h, d);
  }
  LVX_CUDA_CHECK(cudaGetLastError());
}

}  // namespace lvx::kernels
