// kernels::linear (kernels/linear.h says when lvx streams the weights itself, and why).
//
// The streamed loop: the weight rows [0, N) split into one contiguous range per thread
// (at::parallel_for), each row read once, front to back, while it is multiplied with every x row
// (x is a few KB and stays in L1). Per (weight row, x row): two 16-lane fp32 accumulators over
// alternate vectors of the row, then their sum reduced across lanes. The loads are unaligned
// (safetensors offsets are 8-byte aligned, mapped weights are used in place); a row's tail is a
// masked load. AVX-512F for fp32; AVX512-BF16's vdpbf16ps for bf16 (32 bf16 products a
// vector, each pair exact in fp32, added in fp32). Compiled for those targets alone and taken
// where the CPU has them (checked at run time): the build stays portable.
#include <ATen/Parallel.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kernels/linear.h"
#include "src/common/error.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define LVX_LINEAR_AVX512 1
#else
#define LVX_LINEAR_AVX512 0
#endif

namespace lvx::kernels {
namespace {

#if LVX_LINEAR_AVX512

// GCC 12's _mm512_reduce_add_ps extracts halves from an "undefined" vector, which
// -Wuninitialized reports wrongly when it is inlined here.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

// One weight row w [K] against M x rows (x [M, K], row stride K): out[m] = Σ_k w[k]·x[m, k].
template <int M>
__attribute__((target("avx512f"))) void row_f32(const float* w, const float* x, int64_t K,
                                                float* out) {
  __m512 a[M], b[M];
  for (int m = 0; m < M; ++m) a[m] = b[m] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    const __m512 w0 = _mm512_loadu_ps(w + k), w1 = _mm512_loadu_ps(w + k + 16);
    for (int m = 0; m < M; ++m) {
      a[m] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + m * K + k), a[m]);
      b[m] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + m * K + k + 16), b[m]);
    }
  }
  for (; k < K; k += 16) {
    const __mmask16 mask = K - k >= 16 ? __mmask16(0xffff) : __mmask16((1u << (K - k)) - 1);
    const __m512 w0 = _mm512_maskz_loadu_ps(mask, w + k);
    for (int m = 0; m < M; ++m)
      a[m] = _mm512_fmadd_ps(w0, _mm512_maskz_loadu_ps(mask, x + m * K + k), a[m]);
  }
  for (int m = 0; m < M; ++m) out[m] = _mm512_reduce_add_ps(_mm512_add_ps(a[m], b[m]));
}

template <int M>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void row_bf16(const uint16_t* w,
                                                                     const uint16_t* x, int64_t K,
                                                                     float* out) {
  __m512 a[M], b[M];
  for (int m = 0; m < M; ++m) a[m] = b[m] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + k);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + k + 32);
    for (int m = 0; m < M; ++m) {
      a[m] = _mm512_dpbf16_ps(a[m], w0, (__m512bh)_mm512_loadu_si512(x + m * K + k));
      b[m] = _mm512_dpbf16_ps(b[m], w1, (__m512bh)_mm512_loadu_si512(x + m * K + k + 32));
    }
  }
  for (; k < K; k += 32) {  // zeros past the row's end add nothing
    const __mmask32 mask = K - k >= 32 ? __mmask32(0xffffffffu) : __mmask32((1u << (K - k)) - 1);
    const __m512bh w0 = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + k);
    for (int m = 0; m < M; ++m)
      a[m] = _mm512_dpbf16_ps(a[m], w0, (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * K + k));
  }
  for (int m = 0; m < M; ++m) out[m] = _mm512_reduce_add_ps(_mm512_add_ps(a[m], b[m]));
}

#pragma GCC diagnostic pop

// The accumulator, the bias (W's dtype) added in fp32, rounded once to the output's dtype.
template <typename B>
inline void store(float v, const B* bias, int64_t n, float* y) {
  *y = bias ? v + static_cast<float>(bias[n]) : v;
}
template <typename B>
inline void store(float v, const B* bias, int64_t n, at::BFloat16* y) {
  *y = at::BFloat16(bias ? v + static_cast<float>(bias[n]) : v);  // round to nearest even
}

// Rows [n0, n1) of W [N, K] against x [M, K]: y[m, n] (row stride N), plus bias[n] when given.
template <typename T, typename Y, int M>
void rows(const T* w, const T* x, int64_t K, int64_t N, int64_t n0, int64_t n1, const Y* bias,
          Y* y) {
  float out[M];
  for (int64_t n = n0; n < n1; ++n) {
    if constexpr (std::is_same_v<T, float>)
      row_f32<M>(w + n * K, x, K, out);
    else
      row_bf16<M>(w + n * K, x, K, out);
    for (int m = 0; m < M; ++m) store(out[m], bias, n, y + m * N + n);
  }
}

template <typename T, typename Y>
void rows_any(int64_t M, const T* w, const T* x, int64_t K, int64_t N, int64_t n0, int64_t n1,
              const Y* bias, Y* y) {
  switch (M) {
    case 1: return rows<T, Y, 1>(w, x, K, N, n0, n1, bias, y);
    case 2: return rows<T, Y, 2>(w, x, K, N, n0, n1, bias, y);
    case 3: return rows<T, Y, 3>(w, x, K, N, n0, n1, bias, y);
    case 4: return rows<T, Y, 4>(w, x, K, N, n0, n1, bias, y);
    case 5: return rows<T, Y, 5>(w, x, K, N, n0, n1, bias, y);
    case 6: return rows<T, Y, 6>(w, x, K, N, n0, n1, bias, y);
    case 7: return rows<T, Y, 7>(w, x, K, N, n0, n1, bias, y);
    default: return rows<T, Y, 8>(w, x, K, N, n0, n1, bias, y);
  }
}

bool cpu_has(const char* what) {
  __builtin_cpu_init();  // harmless if done; needed if this runs before libgcc's constructor
  if (std::strcmp(what, "bf16") == 0)
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512bf16");
  return __builtin_cpu_supports("avx512f");
}

#endif  // LVX_LINEAR_AVX512

// LVX_CPU_LINEAR=aten turns the streamed path off (read once).
bool streaming_allowed() {
  static const bool allowed = [] {
    const char* e = std::getenv("LVX_CPU_LINEAR");
    if (e == nullptr || *e == '\0' || std::strcmp(e, "stream") == 0) return true;
    LVX_CHECK(std::strcmp(e, "aten") == 0, "LVX_CPU_LINEAR: expected stream or aten, got '", e,
              "'");
    return false;
  }();
  return allowed;
}

}  // namespace

bool streams_weights(const at::Tensor& x, const at::Tensor& w) {
#if LVX_LINEAR_AVX512
  static const bool f32 = cpu_has("f32"), bf16 = cpu_has("bf16");
  if (!x.defined() || !w.defined() || !x.device().is_cpu() || !w.device().is_cpu()) return false;
  if (w.dim() != 2 || x.dim() < 1 || x.size(-1) != w.size(1) || !w.is_contiguous()) return false;
  const at::ScalarType t = w.scalar_type();
  if (x.scalar_type() != t || !((t == at::kFloat && f32) || (t == at::kBFloat16 && bf16)))
    return false;
  if (x.numel() == 0 || w.size(1) == 0 || x.numel() / x.size(-1) > kStreamedRows) return false;
  if (at::GradMode::is_enabled() && (x.requires_grad() || w.requires_grad())) return false;
  return streaming_allowed();
#else
  (void)x, (void)w;
  return false;
#endif
}

at::Tensor streamed_linear(const at::Tensor& x, const at::Tensor& w,
                           const c10::optional<at::Tensor>& bias) {
  LVX_CHECK(streams_weights(x, w), "streamed_linear: operands it does not take (x ",
            x.scalar_type(), " ", x.sizes(), ", w ", w.scalar_type(), " ", w.sizes(), ")");
#if LVX_LINEAR_AVX512
  const int64_t K = w.size(1), N = w.size(0), M = x.numel() / K;
  const at::Tensor xc = x.reshape({M, K}).contiguous();
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = N;
  at::Tensor y = at::empty(shape, x.options());  // written once, in x's dtype
  at::Tensor b;  // in W's dtype (the output's), as the checkpoint holds it
  if (bias.has_value() && bias->defined()) b = bias->to(x.scalar_type()).contiguous();
  // A grain that gives each thread one contiguous range (at least 16 rows).
  const int64_t grain = std::max<int64_t>(16, (N + at::get_num_threads() - 1) /
                                                  std::max(1, at::get_num_threads()));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    if (w.scalar_type() == at::kFloat)
      rows_any(M, w.data_ptr<float>(), xc.data_ptr<float>(), K, N, n0, n1,
               b.defined() ? b.data_ptr<float>() : nullptr, y.data_ptr<float>());
    else
      rows_any(M, reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()),
               reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>()), K, N, n0, n1,
               b.defined() ? b.data_ptr<at::BFloat16>() : nullptr, y.data_ptr<at::BFloat16>());
  });
  return y;
#else
  (void)bias;
  return {};
#endif
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  if (streams_weights(x, w)) return streamed_linear(x, w, bias);
  return at::linear(x, w, bias);
}

}  // namespace lvx::kernels
