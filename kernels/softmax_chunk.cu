// Fused softmax passes of the GEMM attention path (kernels/attention_gemm.cpp) on CUDA: one block
// per row of a key chunk's fp32 scores S [R, C] (unscaled; masked entries −inf).
//   forward:  m' = max(m, scale·max_j S), p_j = exp(scale·S_j − m'), l' = l·e^(m−m') + Σ p_j,
//             alpha = e^(m−m') (to rescale the O accumulator); P written in the GEMM dtype.
//   backward: p_j = exp(scale·S_j − lse) (0 for rows with lse = ±inf), dS_j = p_j·(dP_j − δ);
//             P and dS written in the GEMM dtype.
// Each replaces about eight elementwise ATen passes over S with two reads (forward) or one
// (backward). Rows whose max stays −inf shift by 0, so exp() gives 0, never NaN.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>

#include "kernels/attention_gemm.h"
#include "src/common/error.h"

namespace lvx::kernels {
namespace {

constexpr int kThreads = 256;

template <typename T>
__device__ T to_out(float x);
template <>
__device__ float to_out<float>(float x) { return x; }
template <>
__device__ __nv_bfloat16 to_out<__nv_bfloat16>(float x) { return __float2bfloat16(x); }
template <>
__device__ __half to_out<__half>(float x) { return __float2half(x); }

template <bool kMax>
__device__ float block_reduce(float v) {
  __shared__ float partial[kThreads / 32];
  for (int o = 16; o > 0; o >>= 1) {
    const float other = __shfl_xor_sync(0xffffffff, v, o);
    v = kMax ? fmaxf(v, other) : v + other;
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  v = lane < kThreads / 32 ? partial[lane] : (kMax ? -INFINITY : 0.f);
  if (warp == 0)
    for (int o = 16; o > 0; o >>= 1) {
      const float other = __shfl_xor_sync(0xffffffff, v, o);
      v = kMax ? fmaxf(v, other) : v + other;
    }
  __shared__ float result;
  if (threadIdx.x == 0) result = v;
  __syncthreads();
  return result;
}

template <typename OutT>
__global__ void forward_kernel(const float* __restrict__ s, int64_t cols, float scale,
                               float* __restrict__ m, float* __restrict__ l,
                               float* __restrict__ alpha, OutT* __restrict__ p) {
  const int64_t row = blockIdx.x;
  const float* sr = s + row * cols;
  OutT* pr = p + row * cols;
  float mx = -INFINITY;
  for (int64_t j = threadIdx.x; j < cols; j += kThreads) mx = fmaxf(mx, sr[j]);
  mx = block_reduce<true>(mx) * scale;  // scale > 0: max(scale·S) = scale·max(S)
  const float m_old = m[row];
  const float m_new = fmaxf(m_old, mx);
  const float shift = isinf(m_new) ? 0.f : m_new;
  float sum = 0.f;
  for (int64_t j = threadIdx.x; j < cols; j += kThreads) {
    const float e = expf(sr[j] * scale - shift);
    pr[j] = to_out<OutT>(e);
    sum += e;
  }
  sum = block_reduce<false>(sum);
  if (threadIdx.x == 0) {
    const float a = expf(m_old - shift);
    alpha[row] = a;
    l[row] = l[row] * a + sum;
    m[row] = m_new;
  }
}

template <typename OutT>
__global__ void backward_kernel(const float* __restrict__ s, const float* __restrict__ dp,
                                int64_t cols, float scale, const float* __restrict__ lse,
                                const float* __restrict__ delta, OutT* __restrict__ p,
                                OutT* __restrict__ ds) {
  const int64_t row = blockIdx.x;
  const float L = lse[row], d = delta[row];
  const bool ok = isfinite(L);
  const float* sr = s + row * cols;
  const float* dpr = dp + row * cols;
  for (int64_t j = threadIdx.x; j < cols; j += kThreads) {
    const float e = ok ? expf(sr[j] * scale - L) : 0.f;
    p[row * cols + j] = to_out<OutT>(e);
    ds[row * cols + j] = to_out<OutT>(e * (dpr[j] - d));
  }
}

template <typename F>
void dispatch(at::ScalarType t, F&& f) {
  switch (t) {
    case at::kBFloat16: f(__nv_bfloat16{}); break;
    case at::kHalf: f(__half{}); break;
    case at::kFloat: f(float{}); break;
    default: LVX_FAIL("softmax_chunk: unsupported GEMM dtype ", t);
  }
}

}  // namespace

void softmax_chunk_forward_cuda(const at::Tensor& s, double scale, at::Tensor& m, at::Tensor& l,
                                at::Tensor& alpha, at::Tensor& p) {
  c10::cuda::CUDAGuard guard(s.device());
  const int64_t rows = m.numel(), cols = s.numel() / std::max<int64_t>(rows, 1);
  if (rows == 0 || cols == 0) return;
  auto stream = at::cuda::getCurrentCUDAStream();
  dispatch(p.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    forward_kernel<T><<<rows, kThreads, 0, stream>>>(
        s.data_ptr<float>(), cols, static_cast<float>(scale), m.data_ptr<float>(),
        l.data_ptr<float>(), alpha.data_ptr<float>(), reinterpret_cast<T*>(p.data_ptr()));
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void softmax_chunk_backward_cuda(const at::Tensor& s, const at::Tensor& dp, double scale,
                                 const at::Tensor& lse, const at::Tensor& delta, at::Tensor& p,
                                 at::Tensor& ds) {
  c10::cuda::CUDAGuard guard(s.device());
  const int64_t rows = lse.numel(), cols = s.numel() / std::max<int64_t>(rows, 1);
  if (rows == 0 || cols == 0) return;
  auto stream = at::cuda::getCurrentCUDAStream();
  dispatch(p.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    backward_kernel<T><<<rows, kThreads, 0, stream>>>(
        s.data_ptr<float>(), dp.data_ptr<float>(), cols, static_cast<float>(scale),
        lse.data_ptr<float>(), delta.data_ptr<float>(), reinterpret_cast<T*>(p.data_ptr()),
        reinterpret_cast<T*>(ds.data_ptr()));
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace lvx::kernels
