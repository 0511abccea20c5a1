// CUDA blockwise attention backward with the final global lse and delta (FlashAttention-2
// Alg. 2; BurstAttention Alg. 2; NOTES.md §0): one thread block owns one key tile of one K/V
// head, keeps its dK/dV in shared memory across every query tile of the head group, and adds
// dQ into global memory with atomics (as FlashAttention-2 does). Math in the accumulation dtype
// (fp32, fp64 for fp64 inputs) with plain smem loops: correctness first, no tensor cores yet.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <limits>

#include "kernels/attention_cuda.cuh"
#include "kernels/attention_fused.h"
#include "kernels/attention_gemm.h"

namespace lvx::kernels {
namespace {

constexpr int kBQ = 32;
constexpr int kBK = 32;
constexpr int kThreads = 128;

template <typename A>
struct BwdSmem {
  int ld;
  size_t k, v, dk, dv, q, dout, p, ds, lse, delta, bytes;
  static __host__ __device__ size_t take(size_t& off, size_t n) {
    const size_t at = off;
    off += sizeof(A) * n;
    return at;
  }
  explicit __host__ __device__ BwdSmem(int d) {
    ld = d + 1;
    size_t off = 0;
    k = take(off, kBK * ld), v = take(off, kBK * ld);
    dk = take(off, kBK * ld), dv = take(off, kBK * ld);
    q = take(off, kBQ * ld), dout = take(off, kBQ * ld);
    p = take(off, kBQ * kBK), ds = take(off, kBQ * kBK);
    lse = take(off, kBQ), delta = take(off, kBQ);
    bytes = off;
  }
};

struct BwdArgs {
  const void *q, *k, *v, *dout;  // [B, S, H, D] input dtype
  const void *lse, *delta;       // [B, Hq, Sq] accumulation dtype
  void *dq, *dk, *dv;            // accumulation dtype; dq zero-initialized (atomics)
  int64_t batch, sq, skv, hq, hkv, d;
  double scale;
  MaskView mask;
  DeviceTileSummaries tiles;
  unsigned long long* stats;
  bool vec;  // q/k/v/dout rows are 16-byte aligned: load tiles with uint4
};

template <typename A>
__device__ A load_as(const float* p) {
  return static_cast<A>(*p);
}
template <typename A>
__device__ A load_as(const double* p) {
  return static_cast<A>(*p);
}
template <typename A>
__device__ A load_as(const __nv_bfloat16* p) {
  return static_cast<A>(__bfloat162float(*p));
}
template <typename A>
__device__ A load_as(const __half* p) {
  return static_cast<A>(__half2float(*p));
}

template <typename T, typename A>
__device__ void load_rows(A* dst, int ld, const T* src, int64_t b, int64_t r0, int64_t n_rows,
                          int64_t s, int64_t heads, int64_t h, int64_t d, int rows, bool vec) {
  if (vec) {  // 16-byte loads, converted to the accumulation dtype in smem
    constexpr int kPer = 16 / sizeof(T);
    const int vpr = static_cast<int>(d) / kPer;
#pragma unroll 4
    for (int e = threadIdx.x; e < rows * vpr; e += blockDim.x) {
      const int r = e / vpr, c = (e % vpr) * kPer;
      uint4 val = make_uint4(0, 0, 0, 0);
      if (r < n_rows)
        val = *reinterpret_cast<const uint4*>(src + ((b * s + r0 + r) * heads + h) * d + c);
      const T* parts = reinterpret_cast<const T*>(&val);
      for (int x = 0; x < kPer; ++x) dst[r * ld + c + x] = load_as<A>(parts + x);
    }
    return;
  }
  for (int e = threadIdx.x; e < rows * d; e += blockDim.x) {
    const int r = e / d, x = e % d;
    dst[r * ld + x] = r < n_rows ? load_as<A>(src + ((b * s + r0 + r) * heads + h) * d + x) : A(0);
  }
}

// One thread block per (key tile kt, batch x K/V head): dK/dV of the tile over every query tile
// of the head group, dQ added with atomics. Its body stays one function (unlike the CPU kernels)
// so the compiler keeps its tile state in registers; splitting it into __device__ helpers is
// possible but can be checked only on a GPU.
template <typename T, typename A>
__global__ void __launch_bounds__(kThreads) attention_bwd_kernel(BwdArgs args) {
  extern __shared__ __align__(16) unsigned char smem[];
  const BwdSmem<A> L(static_cast<int>(args.d));
  A* ks = reinterpret_cast<A*>(smem + L.k);
  A* vs = reinterpret_cast<A*>(smem + L.v);
  A* dks = reinterpret_cast<A*>(smem + L.dk);
  A* dvs = reinterpret_cast<A*>(smem + L.dv);
  A* qs = reinterpret_cast<A*>(smem + L.q);
  A* dos = reinterpret_cast<A*>(smem + L.dout);
  A* ps = reinterpret_cast<A*>(smem + L.p);
  A* dss = reinterpret_cast<A*>(smem + L.ds);
  A* lses = reinterpret_cast<A*>(smem + L.lse);
  A* deltas = reinterpret_cast<A*>(smem + L.delta);
  const int d = static_cast<int>(args.d), ld = L.ld;
  const int kt = blockIdx.x;
  const int64_t b = blockIdx.y / args.hkv, hk = blockIdx.y % args.hkv;
  const int64_t group = args.hq / args.hkv;
  const int64_t j0 = int64_t{kt} * kBK;
  const int64_t tk = args.skv - j0 < kBK ? args.skv - j0 : kBK;
  const A scale = static_cast<A>(args.scale);
  const A inf = device_inf<A>();
  const A* lse_g = static_cast<const A*>(args.lse);
  const A* delta_g = static_cast<const A*>(args.delta);
  A* dq_g = static_cast<A*>(args.dq);

  load_rows<T, A>(ks, ld, static_cast<const T*>(args.k), b, j0, tk, args.skv, args.hkv, hk, d, kBK,
                  args.vec);
  load_rows<T, A>(vs, ld, static_cast<const T*>(args.v), b, j0, tk, args.skv, args.hkv, hk, d, kBK,
                  args.vec);
  for (int e = threadIdx.x; e < kBK * ld; e += blockDim.x) dks[e] = 0, dvs[e] = 0;
  const TileSummary ksum = args.tiles.k(b, kt);
  unsigned long long n_total = 0, n_skip = 0, n_full = 0;
  __syncthreads();

  for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
    for (int qt = 0; qt < args.tiles.n_q_tiles; ++qt) {
      ++n_total;
      const auto vis = classify_tile(args.mask.kind, args.mask.rule, args.tiles.q(b, qt), ksum);
      if (vis == TileVisibility::kNone) {
        ++n_skip;
        continue;
      }
      n_full += vis == TileVisibility::kFull;
      const int64_t i0 = int64_t{qt} * kBQ;
      const int64_t tq = args.sq - i0 < kBQ ? args.sq - i0 : kBQ;
      load_rows<T, A>(qs, ld, static_cast<const T*>(args.q), b, i0, tq, args.sq, args.hq, h, d, kBQ,
                      args.vec);
      load_rows<T, A>(dos, ld, static_cast<const T*>(args.dout), b, i0, tq, args.sq, args.hq, h, d,
                      kBQ, args.vec);
      for (int r = threadIdx.x; r < kBQ; r += blockDim.x) {
        // lse = -inf (row sees no key anywhere) -> +inf so P = exp(S - inf) = 0, never NaN.
        const A l = r < tq ? lse_g[(b * args.hq + h) * args.sq + i0 + r] : inf;
        lses[r] = l == -inf ? inf : l;
        deltas[r] = r < tq ? delta_g[(b * args.hq + h) * args.sq + i0 + r] : A(0);
      }
      __syncthreads();
      // P and dS for the tile.
      for (int e = threadIdx.x; e < kBQ * kBK; e += blockDim.x) {
        const int r = e / kBK, c = e % kBK;
        const bool ok = r < tq && c < tk &&
                        (vis == TileVisibility::kFull || args.mask.visible(b, i0 + r, j0 + c));
        A p = 0, ds = 0;
        if (ok) {
          A s = 0, dp = 0;
          for (int x = 0; x < d; ++x) {
            s += qs[r * ld + x] * ks[c * ld + x];
            dp += dos[r * ld + x] * vs[c * ld + x];
          }
          p = exp(s * scale - lses[r]);
          ds = p == A(0) ? A(0) : p * (dp - deltas[r]);
        }
        ps[e] = p;
        dss[e] = ds;
      }
      __syncthreads();
      // dV += Pᵀ·dO, dK += scale·dSᵀ·Q (this block owns these rows).
      for (int e = threadIdx.x; e < kBK * d; e += blockDim.x) {
        const int c = e / d, x = e % d;
        A dv = 0, dk = 0;
        for (int r = 0; r < kBQ; ++r) {
          dv += ps[r * kBK + c] * dos[r * ld + x];
          dk += dss[r * kBK + c] * qs[r * ld + x];
        }
        dvs[c * ld + x] += dv;
        dks[c * ld + x] += dk * scale;
      }
      // dQ += scale·dS·K (other blocks add to the same rows: atomics).
      for (int e = threadIdx.x; e < tq * d; e += blockDim.x) {
        const int r = e / d, x = e % d;
        A dq = 0;
        for (int c = 0; c < kBK; ++c) dq += dss[r * kBK + c] * ks[c * ld + x];
        if (dq != A(0))
          atomicAdd(dq_g + ((b * args.sq + i0 + r) * args.hq + h) * d + x, dq * scale);
      }
      __syncthreads();
    }
  }
  A* dk_g = static_cast<A*>(args.dk);
  A* dv_g = static_cast<A*>(args.dv);
  for (int e = threadIdx.x; e < tk * d; e += blockDim.x) {
    const int c = e / d, x = e % d;
    const int64_t at = ((b * args.skv + j0 + c) * args.hkv + hk) * d + x;
    dk_g[at] = dks[c * ld + x];
    dv_g[at] = dvs[c * ld + x];
  }
  if (args.stats != nullptr && threadIdx.x == 0) {
    atomicAdd(args.stats + 0, n_total);
    atomicAdd(args.stats + 1, n_skip);
    atomicAdd(args.stats + 2, n_full);
  }
}

template <typename T, typename A>
void launch_backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const at::Tensor& dout, const at::Tensor& lse, const at::Tensor& delta,
                     double scale, const AttentionMask& mask, AttentionStats* stats,
                     AttentionGrads& g) {
  const int64_t batch = q.size(0), sq = q.size(1), hq = q.size(2), d = q.size(3);
  const int64_t skv = k.size(1), hkv = k.size(2);
  const BwdSmem<A> L(static_cast<int>(d));
  const int dev = q.get_device();
  const auto* prop = at::cuda::getDeviceProperties(dev);
  LVX_CHECK(L.bytes <= prop->sharedMemPerBlockOptin, "attention_backward (CUDA): head dim ", d,
            " needs ", L.bytes, " bytes of shared memory, the device allows ",
            prop->sharedMemPerBlockOptin);
  const PreparedMask pm = prepare_mask(mask, batch, sq, skv, kBQ, kBK, q.device());
  at::Tensor counters;
  if (stats != nullptr) counters = at::zeros({3}, q.options().dtype(at::kLong));
  BwdArgs args{
      q.data_ptr(),
      k.data_ptr(),
      v.data_ptr(),
      dout.data_ptr(),
      lse.data_ptr(),
      delta.data_ptr(),
      g.dq.data_ptr(),
      g.dk.data_ptr(),
      g.dv.data_ptr(),
      batch,
      sq,
      skv,
      hq,
      hkv,
      d,
      scale,
      pm.view,
      device_tile_summaries(pm),
      stats ? reinterpret_cast<unsigned long long*>(counters.data_ptr<int64_t>()) : nullptr,
      rows_aligned16(q) && rows_aligned16(k) && rows_aligned16(v) && rows_aligned16(dout)};
  auto kernel = attention_bwd_kernel<T, A>;
  LVX_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(L.bytes)));
  dim3 grid(static_cast<unsigned>(pm.n_k_tiles), static_cast<unsigned>(batch * hkv));
  kernel<<<grid, kThreads, L.bytes, at::cuda::getCurrentCUDAStream(dev)>>>(args);
  LVX_CUDA_CHECK(cudaGetLastError());
  add_tile_counters(counters, stats);
}

}  // namespace

AttentionGrads attention_backward_cuda(const at::Tensor& q, const at::Tensor& k,
                                       const at::Tensor& v, const at::Tensor& dout,
                                       const at::Tensor& lse, const at::Tensor& delta, double scale,
                                       const AttentionMask& mask, AttentionStats* stats) {
  c10::cuda::CUDAGuard guard(q.device());
  const int sm = cuda_sm(q);
  switch (cuda_attention_path(q, k, v, sm)) {
    case CudaAttentionPath::kFused:
      return attention_backward_fused(cuda_fused_ops(sm, merge_attention_states_cuda), q, k, v,
                                      dout, lse, delta, scale, mask, stats);
    case CudaAttentionPath::kGemm:
      return attention_backward_gemm(q, k, v, dout, lse, delta, scale, mask, stats);
    case CudaAttentionPath::kKernel:
      break;
  }
  const auto acc = accumulation_dtype(q.scalar_type());
  AttentionGrads g{at::zeros(q.sizes(), q.options().dtype(acc)),
                   at::zeros(k.sizes(), k.options().dtype(acc)),
                   at::zeros(v.sizes(), v.options().dtype(acc))};
  if (q.size(1) == 0 || k.size(1) == 0) return g;
  switch (q.scalar_type()) {
    case at::kBFloat16:
      launch_backward<__nv_bfloat16, float>(q, k, v, dout, lse, delta, scale, mask, stats, g);
      break;
    case at::kHalf:
      launch_backward<__half, float>(q, k, v, dout, lse, delta, scale, mask, stats, g);
      break;
    case at::kFloat:
      launch_backward<float, float>(q, k, v, dout, lse, delta, scale, mask, stats, g);
      break;
    default:
      launch_backward<double, double>(q, k, v, dout, lse, delta, scale, mask, stats, g);
      break;
  }
  return g;
}

}  // namespace lvx::kernels
