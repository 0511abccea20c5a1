// CUDA blockwise attention forward: FlashAttention-2 online softmax (Dao 2023, Alg. 1) per
// (query tile, key tile), split over the keys across thread blocks (flash-decoding) so that
// LV-XAttn's shape (few queries, very many keys) fills the GPU, then a log-sum-exp combine
// (NOTES.md §0). bf16/fp16 tiles multiply on tensor cores (WMMA 16x16x16, fp32 accumulate);
// fp32/fp64 inputs use a plain fp32/fp64 smem loop. Same mask semantics and tile skipping as
// the CPU twin (kernels/mask.h). Also defines the CUDA entry of the device table.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>

#include <limits>

#include "kernels/attention_cuda.cuh"
#include "kernels/attention_fused.h"
#include "kernels/attention_gemm.h"
#include "kernels/mask.h"
#include "kernels/registry.h"
#include "src/common/error.h"

namespace lvx::kernels {
namespace {

constexpr int kBQ = 64;  // queries per block
constexpr int kBK = 64;  // keys per tile
constexpr int kThreads = 128;

template <typename T>
struct Tc {  // does T use the tensor-core path?
  static constexpr bool value = false;
};
template <>
struct Tc<__nv_bfloat16> {
  static constexpr bool value = true;
};
template <>
struct Tc<__half> {
  static constexpr bool value = true;
};

// Shared-memory layout of one block; leading dimensions padded against bank conflicts and, for
// WMMA, kept multiples of 8 elements / 32 bytes.
template <typename T, typename A>
struct FwdSmem {
  int ld, ldp, ldo;
  size_t q, k, v, s, p, o, m, l, alpha, bytes;
  static __host__ __device__ size_t align(size_t x) { return (x + 127) / 128 * 128; }
  explicit __host__ __device__ FwdSmem(int d) {
    const bool tc = Tc<T>::value;
    ld = tc ? d + 8 : d + 1;
    ldp = tc ? kBK + 8 : kBK;
    ldo = tc ? d + 4 : d + 1;
    size_t off = 0;
    q = off, off = align(off + sizeof(T) * kBQ * ld);
    k = off, off = align(off + sizeof(T) * kBK * ld);
    v = off, off = align(off + sizeof(T) * kBK * ld);
    s = off, off = align(off + sizeof(A) * kBQ * kBK);
    if (tc) {
      p = off, off = align(off + sizeof(T) * kBQ * ldp);
    } else {
      p = s;  // P overwrites S in place
    }
    o = off, off = align(off + sizeof(A) * kBQ * ldo);
    m = off, off = align(off + sizeof(A) * kBQ);
    l = off, off = align(off + sizeof(A) * kBQ);
    alpha = off, off = align(off + sizeof(A) * kBQ);
    bytes = off;
  }
};

struct FwdArgs {
  const void* q;  // [B, Sq, Hq, D]
  const void* k;  // [B, Skv, Hkv, D]
  const void* v;
  void* o;    // [splits, B, Sq, Hq, D], accumulation dtype, normalized per split
  void* lse;  // [splits, B, Hq, Sq]
  int64_t batch, sq, skv, hq, hkv, d;
  double scale;
  MaskView mask;
  DeviceTileSummaries tiles;
  int splits, kt_per_split;
  unsigned long long* stats;  // [3] total, skipped, full; or null
  bool vec;                   // q/k/v rows are 16-byte aligned: load tiles with uint4
};

template <typename T, typename A>
__device__ A to_acc(T x) {
  return static_cast<A>(x);
}
template <typename T>
__device__ T from_float(float x) {
  return static_cast<T>(x);
}
template <>
__device__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16(x);
}
template <>
__device__ __half from_float<__half>(float x) {
  return __float2half(x);
}

// Copies rows [r0, r0 + n) of head h of a [B, S, H, D] tensor into smem rows of stride ld;
// rows past the end become zeros. With `vec`, 16-byte loads (8 bf16/fp16, 4 fp32, 2 fp64) keep
// many loads in flight: element-wise loads left the kernel latency-bound.
template <typename T>
__device__ void load_tile(T* dst, int ld, const T* src, int64_t b, int64_t r0, int64_t n_rows,
                          int64_t s, int64_t heads, int64_t h, int64_t d, int rows, bool vec) {
  if (vec) {
    constexpr int kPer = 16 / sizeof(T);
    const int vpr = static_cast<int>(d) / kPer;
    const bool vec_store = (ld * sizeof(T)) % 16 == 0;
#pragma unroll 4
    for (int e = threadIdx.x; e < rows * vpr; e += blockDim.x) {
      const int r = e / vpr, c = (e % vpr) * kPer;
      uint4 val = make_uint4(0, 0, 0, 0);
      if (r < n_rows)
        val = *reinterpret_cast<const uint4*>(src + ((b * s + r0 + r) * heads + h) * d + c);
      if (vec_store) {
        *reinterpret_cast<uint4*>(dst + r * ld + c) = val;
      } else {
        const T* parts = reinterpret_cast<const T*>(&val);
        for (int x = 0; x < kPer; ++x) dst[r * ld + c + x] = parts[x];
      }
    }
    return;
  }
  for (int e = threadIdx.x; e < rows * d; e += blockDim.x) {
    const int r = e / d, x = e % d;
    T val = from_float<T>(0.f);
    if (r < n_rows) val = src[((b * s + r0 + r) * heads + h) * d + x];
    dst[r * ld + x] = val;
  }
}

// S = Q·Kᵀ for the tile (unscaled), into s [kBQ][kBK].
template <typename T, typename A>
__device__ void tile_qk(const T* q, const T* k, A* s, int ld, int d) {
  if constexpr (Tc<T>::value) {
    using namespace nvcuda;
    const int w = threadIdx.x / 32;  // warp w: rows 16w..16w+15, all 64 columns
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> c[kBK / 16];
    for (int n = 0; n < kBK / 16; ++n) wmma::fill_fragment(c[n], 0.f);
    for (int kk = 0; kk < d; kk += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a;
      wmma::load_matrix_sync(a, q + 16 * w * ld + kk, ld);
      for (int n = 0; n < kBK / 16; ++n) {
        wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> bf;
        wmma::load_matrix_sync(bf, k + 16 * n * ld + kk, ld);
        wmma::mma_sync(c[n], a, bf, c[n]);
      }
    }
    for (int n = 0; n < kBK / 16; ++n) {
      wmma::store_matrix_sync(s + 16 * w * kBK + 16 * n, c[n], kBK, wmma::mem_row_major);
    }
  } else {
    for (int e = threadIdx.x; e < kBQ * kBK; e += blockDim.x) {
      const int r = e / kBK, c = e % kBK;
      A acc = 0;
      for (int x = 0; x < d; ++x) acc += to_acc<T, A>(q[r * ld + x]) * to_acc<T, A>(k[c * ld + x]);
      s[e] = acc;
    }
  }
}

// O += P·V for the tile, O in smem [kBQ][ldo] (accumulation dtype).
template <typename T, typename A>
__device__ void tile_pv(const T* p, int ldp, const A* p_acc, const T* v, int ld, A* o, int ldo,
                        int d) {
  if constexpr (Tc<T>::value) {
    using namespace nvcuda;
    const int w = threadIdx.x / 32;
    for (int n = 0; n < d / 16; ++n) {
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> c;
      wmma::load_matrix_sync(c, o + 16 * w * ldo + 16 * n, ldo, wmma::mem_row_major);
      for (int kk = 0; kk < kBK; kk += 16) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> bf;
        wmma::load_matrix_sync(a, p + 16 * w * ldp + kk, ldp);
        wmma::load_matrix_sync(bf, v + kk * ld + 16 * n, ld);
        wmma::mma_sync(c, a, bf, c);
      }
      wmma::store_matrix_sync(o + 16 * w * ldo + 16 * n, c, ldo, wmma::mem_row_major);
    }
  } else {
    for (int e = threadIdx.x; e < kBQ * d; e += blockDim.x) {
      const int r = e / d, x = e % d;
      A acc = o[r * ldo + x];
      for (int c = 0; c < kBK; ++c) acc += p_acc[r * kBK + c] * to_acc<T, A>(v[c * ld + x]);
      o[r * ldo + x] = acc;
    }
  }
}

template <typename T, typename A>
__global__ void __launch_bounds__(kThreads) attention_fwd_kernel(FwdArgs args) {
  extern __shared__ __align__(128) unsigned char smem[];
  const FwdSmem<T, A> L(static_cast<int>(args.d));
  T* qs = reinterpret_cast<T*>(smem + L.q);
  T* ks = reinterpret_cast<T*>(smem + L.k);
  T* vs = reinterpret_cast<T*>(smem + L.v);
  A* ss = reinterpret_cast<A*>(smem + L.s);
  T* ps = reinterpret_cast<T*>(smem + L.p);
  A* os = reinterpret_cast<A*>(smem + L.o);
  A* ms = reinterpret_cast<A*>(smem + L.m);
  A* ls = reinterpret_cast<A*>(smem + L.l);
  A* as = reinterpret_cast<A*>(smem + L.alpha);
  const int d = static_cast<int>(args.d);
  const int qt = blockIdx.x;
  const int64_t b = blockIdx.y / args.hq, h = blockIdx.y % args.hq;
  const int split = blockIdx.z;
  const int64_t hk = h / (args.hq / args.hkv);
  const int64_t i0 = int64_t{qt} * kBQ;
  const int64_t tq = args.sq - i0 < kBQ ? args.sq - i0 : kBQ;
  const A neg_inf = -device_inf<A>();

  load_tile(qs, L.ld, static_cast<const T*>(args.q), b, i0, tq, args.sq, args.hq, h, d, kBQ,
            args.vec);
  for (int e = threadIdx.x; e < kBQ * L.ldo; e += blockDim.x) os[e] = 0;
  for (int r = threadIdx.x; r < kBQ; r += blockDim.x) ms[r] = neg_inf, ls[r] = 0;
  const TileSummary qsum = args.tiles.q(b, qt);
  const int n_kt = args.tiles.n_k_tiles;
  const int kt_begin = split * args.kt_per_split;
  const int kt_end = n_kt < kt_begin + args.kt_per_split ? n_kt : kt_begin + args.kt_per_split;
  unsigned long long n_skip = 0, n_full = 0;
  __syncthreads();

  for (int kt = kt_begin; kt < kt_end; ++kt) {
    const auto vis = classify_tile(args.mask.kind, args.mask.rule, qsum, args.tiles.k(b, kt));
    if (vis == TileVisibility::kNone) {
      ++n_skip;
      continue;
    }
    n_full += vis == TileVisibility::kFull;
    const int64_t j0 = int64_t{kt} * kBK;
    const int64_t tk = args.skv - j0 < kBK ? args.skv - j0 : kBK;
    load_tile(ks, L.ld, static_cast<const T*>(args.k), b, j0, tk, args.skv, args.hkv, hk, d, kBK,
              args.vec);
    load_tile(vs, L.ld, static_cast<const T*>(args.v), b, j0, tk, args.skv, args.hkv, hk, d, kBK,
              args.vec);
    __syncthreads();
    tile_qk<T, A>(qs, ks, ss, L.ld, d);
    __syncthreads();
    // Online softmax: two threads per row, 32 columns each; partners are adjacent lanes.
    {
      const int r = threadIdx.x / 2, half = threadIdx.x % 2;
      A* srow = ss + r * kBK;
      A mt = neg_inf;
      for (int c = half * 32; c < half * 32 + 32; ++c) {
        A x = srow[c] * static_cast<A>(args.scale);
        const bool ok = c < tk && r < tq &&
                        (vis == TileVisibility::kFull || args.mask.visible(b, i0 + r, j0 + c));
        x = ok ? x : neg_inf;
        srow[c] = x;
        mt = max(mt, x);
      }
      mt = max(mt, __shfl_xor_sync(0xffffffffu, mt, 1));
      const A m_old = ms[r];
      const A m_new = max(m_old, mt);
      const bool empty = m_new == neg_inf;
      const A alpha = empty ? A(1) : exp(m_old - m_new);
      A sum = 0;
      for (int c = half * 32; c < half * 32 + 32; ++c) {
        const A pv = empty ? A(0) : exp(srow[c] - m_new);
        sum += pv;
        if constexpr (Tc<T>::value) {
          ps[r * L.ldp + c] = from_float<T>(pv);
        } else {
          srow[c] = pv;
        }
      }
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      __syncwarp();
      if (half == 0) {
        ls[r] = alpha * ls[r] + sum;
        ms[r] = m_new;
        as[r] = alpha;
      }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < kBQ * d; e += blockDim.x) {
      const int r = e / d, x = e % d;
      os[r * L.ldo + x] *= as[r];
    }
    __syncthreads();
    tile_pv<T, A>(ps, L.ldp, ss, vs, L.ld, os, L.ldo, d);
    __syncthreads();
  }

  // Normalized partial output and lse for this split (the combine kernel merges splits).
  A* o = static_cast<A*>(args.o) + split * (args.batch * args.sq * args.hq * args.d);
  A* lse = static_cast<A*>(args.lse) + split * (args.batch * args.hq * args.sq);
  for (int e = threadIdx.x; e < tq * d; e += blockDim.x) {
    const int r = e / d, x = e % d;
    const A l = ls[r];
    o[((b * args.sq + i0 + r) * args.hq + h) * d + x] = l > 0 ? os[r * L.ldo + x] / l : A(0);
  }
  for (int r = threadIdx.x; r < tq; r += blockDim.x) {
    lse[(b * args.hq + h) * args.sq + i0 + r] = ls[r] > 0 ? ms[r] + log(ls[r]) : neg_inf;
  }
  if (args.stats != nullptr && threadIdx.x == 0) {
    atomicAdd(args.stats + 0, static_cast<unsigned long long>(kt_end - kt_begin));
    atomicAdd(args.stats + 1, n_skip);
    atomicAdd(args.stats + 2, n_full);
  }
}

// Merges the splits row by row: lse = log Σ_s exp(lse_s), o = Σ_s exp(lse_s − lse)·o_s, with
// empty splits (lse = −inf) weighing zero and an all-empty row giving o = 0, lse = −inf.
template <typename A>
__global__ void combine_splits_kernel(const A* o_part, const A* lse_part, A* o, A* lse, int splits,
                                      int64_t batch, int64_t sq, int64_t hq, int64_t d) {
  const int64_t n = batch * sq * hq * d;
  const int64_t stride_o = n, stride_l = batch * hq * sq;
  for (int64_t e = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; e < n;
       e += int64_t{gridDim.x} * blockDim.x) {
    const int64_t x = e % d, h = (e / d) % hq, i = (e / (d * hq)) % sq, b = e / (d * hq * sq);
    const int64_t row = (b * hq + h) * sq + i;
    A m = -device_inf<A>();
    for (int s = 0; s < splits; ++s) m = max(m, lse_part[s * stride_l + row]);
    if (m == -device_inf<A>()) {
      o[e] = 0;
      if (x == 0) lse[row] = m;
      continue;
    }
    A sum = 0, acc = 0;
    for (int s = 0; s < splits; ++s) {
      const A w = exp(lse_part[s * stride_l + row] - m);
      sum += w;
      acc += w * o_part[s * stride_o + e];
    }
    o[e] = acc / sum;
    if (x == 0) lse[row] = m + log(sum);
  }
}

template <typename T, typename A>
void launch_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                    const AttentionMask& mask, AttentionStats* stats, AttentionOutput& out) {
  const int64_t batch = q.size(0), sq = q.size(1), hq = q.size(2), d = q.size(3);
  const int64_t skv = k.size(1);
  if constexpr (Tc<T>::value) {
    LVX_CHECK(d % 16 == 0,
              "attention_forward (CUDA, bf16/fp16): head dim must be a multiple "
              "of 16 for the tensor-core path, got ",
              d);
  }
  const FwdSmem<T, A> L(static_cast<int>(d));
  const int dev = q.get_device();
  const auto* prop = at::cuda::getDeviceProperties(dev);
  LVX_CHECK(L.bytes <= prop->sharedMemPerBlockOptin, "attention_forward (CUDA): head dim ", d,
            " needs ", L.bytes, " bytes of shared memory, the device allows ",
            prop->sharedMemPerBlockOptin);
  const PreparedMask pm = prepare_mask(mask, batch, sq, skv, kBQ, kBK, q.device());
  const int n_qt = static_cast<int>(pm.n_q_tiles), n_kt = static_cast<int>(pm.n_k_tiles);
  // Split the keys until the grid covers ~2 waves of the SMs (flash-decoding).
  const int64_t base = int64_t{n_qt} * batch * hq;
  const int64_t want = (2 * prop->multiProcessorCount + base - 1) / base;
  const int splits = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(want, n_kt)));
  const int kt_per_split = (n_kt + splits - 1) / splits;
  const int real_splits = (n_kt + kt_per_split - 1) / kt_per_split;
  auto opts = out.o.options();
  at::Tensor o_part = real_splits == 1 ? out.o : at::empty({real_splits, batch, sq, hq, d}, opts);
  at::Tensor lse_part = real_splits == 1 ? out.lse : at::empty({real_splits, batch, hq, sq}, opts);
  at::Tensor counters;
  if (stats != nullptr) counters = at::zeros({3}, q.options().dtype(at::kLong));

  FwdArgs args{
      q.data_ptr(),
      k.data_ptr(),
      v.data_ptr(),
      o_part.data_ptr(),
      lse_part.data_ptr(),
      batch,
      sq,
      skv,
      hq,
      k.size(2),
      d,
      scale,
      pm.view,
      device_tile_summaries(pm),
      real_splits,
      kt_per_split,
      stats ? reinterpret_cast<unsigned long long*>(counters.data_ptr<int64_t>()) : nullptr,
      rows_aligned16(q) && rows_aligned16(k) && rows_aligned16(v)};
  auto kernel = attention_fwd_kernel<T, A>;
  LVX_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(L.bytes)));
  auto stream = at::cuda::getCurrentCUDAStream(dev);
  dim3 grid(n_qt, static_cast<unsigned>(batch * hq), real_splits);
  kernel<<<grid, kThreads, L.bytes, stream>>>(args);
  LVX_CUDA_CHECK(cudaGetLastError());
  if (real_splits > 1) {
    const int64_t n = batch * sq * hq * d;
    const int blocks = static_cast<int>(std::min<int64_t>((n + 255) / 256, 65535));
    combine_splits_kernel<A><<<blocks, 256, 0, stream>>>(
        o_part.data_ptr<A>(), lse_part.data_ptr<A>(), out.o.data_ptr<A>(), out.lse.data_ptr<A>(),
        real_splits, batch, sq, hq, d);
    LVX_CUDA_CHECK(cudaGetLastError());
  }
  add_tile_counters(counters, stats);
}

}  // namespace

DeviceTileSummaries device_tile_summaries(const PreparedMask& pm) {
  DeviceTileSummaries t;
  t.n_q_tiles = static_cast<int>(pm.n_q_tiles);
  t.n_k_tiles = static_cast<int>(pm.n_k_tiles);
  t.q_lo = pm.q_lo.data_ptr<int64_t>();
  t.q_hi = pm.q_hi.data_ptr<int64_t>();
  t.q_has_none = pm.q_has_none.data_ptr<bool>();
  t.q_all_none = pm.q_all_none.data_ptr<bool>();
  t.k_lo = pm.k_lo.data_ptr<int64_t>();
  t.k_hi = pm.k_hi.data_ptr<int64_t>();
  t.k_has_none = pm.k_has_none.data_ptr<bool>();
  t.k_all_none = pm.k_all_none.data_ptr<bool>();
  t.see_all = pm.view.see_all;
  if (t.see_all) {
    t.k_has_pad = pm.k_has_pad.data_ptr<bool>();
    t.k_all_pad = pm.k_all_pad.data_ptr<bool>();
  }
  return t;
}

AttentionOutput attention_forward_cuda(const at::Tensor& q, const at::Tensor& k,
                                       const at::Tensor& v, double scale, const AttentionMask& mask,
                                       AttentionStats* stats) {
  c10::cuda::CUDAGuard guard(q.device());
  const int sm = cuda_sm(q);
  switch (cuda_attention_path(q, k, v, sm)) {
    case CudaAttentionPath::kFused:
      return attention_forward_fused(cuda_fused_ops(sm, merge_attention_states_cuda), q, k, v,
                                     scale, mask, stats);
    case CudaAttentionPath::kGemm:
      return attention_forward_gemm(q, k, v, scale, mask, stats);
    case CudaAttentionPath::kKernel:
      break;
  }
  const auto acc = accumulation_dtype(q.scalar_type());
  auto opts = q.options().dtype(acc);
  const int64_t batch = q.size(0), sq = q.size(1), hq = q.size(2), d = q.size(3);
  AttentionOutput out{at::empty({batch, sq, hq, d}, opts), at::empty({batch, hq, sq}, opts)};
  if (k.size(1) == 0) {
    out.o.zero_();
    out.lse.fill_(-std::numeric_limits<double>::infinity());
  }
  if (sq == 0 || k.size(1) == 0) return out;
  switch (q.scalar_type()) {
    case at::kBFloat16:
      launch_forward<__nv_bfloat16, float>(q, k, v, scale, mask, stats, out);
      break;
    case at::kHalf:
      launch_forward<__half, float>(q, k, v, scale, mask, stats, out);
      break;
    case at::kFloat:
      launch_forward<float, float>(q, k, v, scale, mask, stats, out);
      break;
    default:
      launch_forward<double, double>(q, k, v, scale, mask, stats, out);
      break;
  }
  return out;
}

AttentionImpl cuda_attention_impl() {
  return {"cuda",
          attention_forward_cuda,
          attention_backward_cuda,
          merge_attention_states_cuda,
          softmax_chunk_forward_cuda,
          softmax_chunk_backward_cuda};
}

}  // namespace lvx::kernels
