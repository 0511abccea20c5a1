// slot_attention's CPU loop (kernels/slot_attention.h says why it is lvx's own). Three passes over
// a [R·Hkv, g·T, K] score buffer (K: the most keys a token sees; one buffer row per query token
// and head), each task one (row, K/V head) reading that row's slot in place:
//   1. scores q·k · scale · log2 e of the keys each token sees (−inf past them), and each row's
//      maximum;
//   2. exp2(score − maximum), one ATen op over the buffer (its vectorized exp2; −inf gives 0);
//   3. each row's sum, its weighted values, and lse = (maximum + log2 sum) · ln 2.
// Accumulates in float (double for double inputs). Passes 1 and 3 have a generic form (any dtype,
// any head dim) and, for float with head dims in multiples of 8 up to 128, an AVX2/FMA form
// compiled for that target alone and taken where the CPU has it (checked at run time, as ATen
// picks its own kernels per CPU): the build stays portable. At 16 rows, 4 heads of 16 dims and
// ~120 keys a row: ~38 µs a call, against ~85 µs for the generic form and ~200 µs for the
// composite of ATen ops (one thread of this machine's EPYC).
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <utility>

#include "kernels/attention.h"
#include "kernels/slot_attention.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define LVX_SLOT_AVX2 1
#else
#define LVX_SLOT_AVX2 0
#endif

namespace lvx::kernels {
namespace {

constexpr double kLog2e = 1.4426950408889634;  // log2(e)
constexpr double kLn2 = 0.6931471805599453;    // ln(2)

// Sizes of one call.
struct Shape {
  int64_t R, T, hq, D, hkv, g, C, Dv, K;  // K: the score buffer's row length
};

// x · y over n elements in eight independent lanes (a fixed order the compiler vectorizes without
// reassociating), then the lanes pairwise.
template <typename A, typename S>
inline A dot(const S* x, const S* y, int64_t n) {
  A lane[8] = {};
  int64_t d = 0;
  for (; d + 8 <= n; d += 8)
    for (int l = 0; l < 8; ++l) lane[l] += static_cast<A>(x[d + l]) * static_cast<A>(y[d + l]);
  A rest = 0;
  for (; d < n; ++d) rest += static_cast<A>(x[d]) * static_cast<A>(y[d]);
  return rest + (((lane[0] + lane[4]) + (lane[1] + lane[5])) +
                 ((lane[2] + lane[6]) + (lane[3] + lane[7])));
}

// Pass 1 of task (r, hk): its g·T buffer rows (query head hk·g + i / T, token i % T), the slot's
// keys kb ([C, D]); `most` gets each row's maximum.
template <typename A, typename S>
void score_task(const S* q, const S* kb, const int64_t* sees, const Shape& s, int64_t r, int64_t hk,
                A mul, A* sc, A* most) {
  for (int64_t i = 0; i < s.g * s.T; ++i) {
    const int64_t t = i % s.T, h = hk * s.g + i / s.T, n = sees[r * s.T + t];
    const S* x = q + ((r * s.T + t) * s.hq + h) * s.D;
    A* row = sc + i * s.K;
    A top = -std::numeric_limits<A>::infinity();
    for (int64_t j = 0; j < n; ++j) {
      row[j] = dot<A>(x, kb + j * s.D, s.D) * mul;
      top = std::max(top, row[j]);
    }
    std::fill(row + n, row + s.K, -std::numeric_limits<A>::infinity());
    most[i] = top;
  }
}

// Pass 3 of task (r, hk): each buffer row's weights p (exp2'd), summed, over the slot's values vb
// ([C, Dv]) into o and lse at (r, t, h).
template <typename A, typename S>
void weigh_task(const A* p, const A* most, const S* vb, const int64_t* sees, const Shape& s,
                int64_t r, int64_t hk, A* o, A* lse) {
  for (int64_t i = 0; i < s.g * s.T; ++i) {
    const int64_t t = i % s.T, h = hk * s.g + i / s.T, n = sees[r * s.T + t];
    const A* w = p + i * s.K;
    const int64_t at = (r * s.T + t) * s.hq + h;  // (r, t, h) in o's and lse's layout
    A* out = o + at * s.Dv;
    std::fill(out, out + s.Dv, A(0));
    A lane[8] = {};
    int64_t j = 0;
    for (; j + 8 <= n; j += 8)
      for (int l = 0; l < 8; ++l) lane[l] += w[j + l];
    A sum = 0;
    for (; j < n; ++j) sum += w[j];
    sum +=
        ((lane[0] + lane[4]) + (lane[1] + lane[5])) + ((lane[2] + lane[6]) + (lane[3] + lane[7]));
    for (j = 0; j < n; ++j) {
      const S* vj = vb + j * s.Dv;
      for (int64_t d = 0; d < s.Dv; ++d) out[d] += w[j] * static_cast<A>(vj[d]);
    }
    const A inv = A(1) / sum;
    for (int64_t d = 0; d < s.Dv; ++d) out[d] *= inv;
    lse[at] = (most[i] + std::log2(sum)) * static_cast<A>(kLn2);
  }
}

#if LVX_SLOT_AVX2
// Float rows on AVX2 with head dims in multiples of 8 up to 128 (the served families' 64 and 128,
// the tests' 16): the same passes with the accumulators in registers. score_avx2 sums
// eight keys' products at once (one tree of horizontal adds for eight keys, not one each);
// weigh_avx2 keeps a row's output in registers across its keys.
template <int ND>
__attribute__((target("avx2,fma"))) void score_avx2(const float* q, const float* kb,
                                                    const int64_t* sees, const Shape& s, int64_t r,
                                                    int64_t hk, float mul, float* sc, float* most) {
  for (int64_t i = 0; i < s.g * s.T; ++i) {
    const int64_t t = i % s.T, h = hk * s.g + i / s.T, n = sees[r * s.T + t];
    const float* x = q + ((r * s.T + t) * s.hq + h) * s.D;
    __m256 xv[ND];
    for (int d = 0; d < ND; ++d) xv[d] = _mm256_loadu_ps(x + 8 * d);
    float* row = sc + i * s.K;
    __m256 top = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    const __m256 m = _mm256_set1_ps(mul);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
      __m256 a[8];
      for (int u = 0; u < 8; ++u) {
        const float* kj = kb + (j + u) * s.D;
        a[u] = _mm256_mul_ps(xv[0], _mm256_loadu_ps(kj));
        for (int d = 1; d < ND; ++d)
          a[u] = _mm256_fmadd_ps(xv[d], _mm256_loadu_ps(kj + 8 * d), a[u]);
      }
      const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
      const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
      const __m128 lo = _mm_add_ps(_mm256_castps256_ps128(t0), _mm256_extractf128_ps(t0, 1));
      const __m128 hi = _mm_add_ps(_mm256_castps256_ps128(t1), _mm256_extractf128_ps(t1, 1));
      const __m256 eight =
          _mm256_mul_ps(_mm256_insertf128_ps(_mm256_castps128_ps256(lo), hi, 1), m);
      _mm256_storeu_ps(row + j, eight);
      top = _mm256_max_ps(top, eight);
    }
    float best[8];
    _mm256_storeu_ps(best, top);
    float most_i = *std::max_element(best, best + 8);
    for (; j < n; ++j) {
      const float* kj = kb + j * s.D;
      __m256 a = _mm256_mul_ps(xv[0], _mm256_loadu_ps(kj));
      for (int d = 1; d < ND; ++d) a = _mm256_fmadd_ps(xv[d], _mm256_loadu_ps(kj + 8 * d), a);
      float lanes[8];
      _mm256_storeu_ps(lanes, a);
      row[j] = (((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) +
                ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]))) *
               mul;
      most_i = std::max(most_i, row[j]);
    }
    std::fill(row + n, row + s.K, -std::numeric_limits<float>::infinity());
    most[i] = most_i;
  }
}

template <int NV>
__attribute__((target("avx2,fma"))) void weigh_avx2(const float* p, const float* most,
                                                    const float* vb, const int64_t* sees,
                                                    const Shape& s, int64_t r, int64_t hk, float* o,
                                                    float* lse) {
  for (int64_t i = 0; i < s.g * s.T; ++i) {
    const int64_t t = i % s.T, h = hk * s.g + i / s.T, n = sees[r * s.T + t];
    const float* w = p + i * s.K;
    __m256 out[NV];
    for (int d = 0; d < NV; ++d) out[d] = _mm256_setzero_ps();
    __m256 total = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) total = _mm256_add_ps(total, _mm256_loadu_ps(w + j));
    float lanes[8];
    _mm256_storeu_ps(lanes, total);
    float sum = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) +
                ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
    for (; j < n; ++j) sum += w[j];
    for (j = 0; j < n; ++j) {
      const __m256 wj = _mm256_set1_ps(w[j]);
      const float* vj = vb + j * s.Dv;
      for (int d = 0; d < NV; ++d)
        out[d] = _mm256_fmadd_ps(wj, _mm256_loadu_ps(vj + 8 * d), out[d]);
    }
    const int64_t at = (r * s.T + t) * s.hq + h;
    const __m256 inv = _mm256_set1_ps(1.0f / sum);
    for (int d = 0; d < NV; ++d)
      _mm256_storeu_ps(o + at * s.Dv + 8 * d, _mm256_mul_ps(out[d], inv));
    lse[at] = (most[i] + std::log2(sum)) * static_cast<float>(kLn2);
  }
}

// of(std::integral_constant<int, n>) for n in 1..16.
template <typename Fn, typename Of, int... N>
Fn table_of(int n, Of of, std::integer_sequence<int, N...>) {
  Fn fns[] = {of(std::integral_constant<int, N + 1>{})...};
  return fns[n - 1];
}
template <typename Fn, typename Of>
Fn table(int64_t n, Of of) {
  return table_of<Fn>(static_cast<int>(n), of, std::make_integer_sequence<int, 16>{});
}

using ScoreFn = void (*)(const float*, const float*, const int64_t*, const Shape&, int64_t, int64_t,
                         float, float*, float*);
using WeighFn = void (*)(const float*, const float*, const float*, const int64_t*, const Shape&,
                         int64_t, int64_t, float*, float*);

// The AVX2 passes for float rows whose head dims they take (multiples of 8 up to 128), on a CPU
// with AVX2 and FMA; else none (the generic passes serve).
std::pair<ScoreFn, WeighFn> avx2_passes(const Shape& s) {
  static const bool cpu = [] {
    __builtin_cpu_init();  // harmless if done; needed if this runs before libgcc's constructor
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }();
  if (!cpu || s.D % 8 != 0 || s.Dv % 8 != 0 || s.D > 128 || s.Dv > 128) return {nullptr, nullptr};
  return {
      table<ScoreFn>(s.D / 8, [](auto n) -> ScoreFn { return score_avx2<decltype(n)::value>; }),
      table<WeighFn>(s.Dv / 8, [](auto n) -> WeighFn { return weigh_avx2<decltype(n)::value>; })};
}
#endif

template <typename S>
void slot_attention_typed(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const std::vector<int64_t>& slots, const std::vector<int64_t>& sees,
                          double scale, const Shape& s, at::Tensor& o, at::Tensor& lse) {
  using A = at::opmath_type<S>;
  at::Tensor sc = at::empty({s.R * s.hkv, s.g * s.T, s.K}, o.options());
  at::Tensor most = at::empty({s.R * s.hkv, s.g * s.T, 1}, o.options());
  const S *qp = q.const_data_ptr<S>(), *kp = k.const_data_ptr<S>(), *vp = v.const_data_ptr<S>();
  A *scp = sc.mutable_data_ptr<A>(), *mp = most.mutable_data_ptr<A>();
  const int64_t rows = s.g * s.T;
  // A task's work is about g·T·K·(D + Dv) multiply-adds: tasks in chunks of ~32k of them.
  const int64_t grain =
      std::max<int64_t>(1, 32768 / std::max<int64_t>(1, rows * s.K * (s.D + s.Dv)));
  auto block = [&](int64_t task) {  // the task's slot block: (slot, hk) of [C, D]
    return slots[static_cast<size_t>(task / s.hkv)] * s.hkv + task % s.hkv;
  };
  const A mul = static_cast<A>(scale * kLog2e);
  auto score = score_task<A, S>;
  auto weigh = weigh_task<A, S>;
#if LVX_SLOT_AVX2
  if constexpr (std::is_same_v<S, float>) {
    const auto [fast_score, fast_weigh] = avx2_passes(s);
    if (fast_score != nullptr) {
      score = fast_score;
      weigh = fast_weigh;
    }
  }
#endif
  at::parallel_for(0, s.R * s.hkv, grain, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task)
      score(qp, kp + block(task) * s.C * s.D, sees.data(), s, task / s.hkv, task % s.hkv, mul,
            scp + task * rows * s.K, mp + task * rows);
  });
  sc.sub_(most).exp2_();
  A *op = o.mutable_data_ptr<A>(), *lp = lse.mutable_data_ptr<A>();
  at::parallel_for(0, s.R * s.hkv, grain, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task)
      weigh(scp + task * rows * s.K, mp + task * rows, vp + block(task) * s.C * s.Dv, sees.data(),
            s, task / s.hkv, task % s.hkv, op, lp);
  });
}

}  // namespace

SlotAttentionOutput slot_attention_cpu(const at::Tensor& q, const at::Tensor& k,
                                       const at::Tensor& v, const std::vector<int64_t>& slots,
                                       const std::vector<int64_t>& sees, double scale) {
  const Shape s{q.size(0), q.size(1), q.size(2),
                q.size(3), k.size(1), q.size(2) / k.size(1),
                k.size(2), v.size(3), *std::max_element(sees.begin(), sees.end())};
  const auto acc = accumulation_dtype(q.scalar_type());
  at::Tensor o = at::empty({s.R, s.T, s.hq, s.Dv}, q.options().dtype(acc));
  at::Tensor lse = at::empty({s.R, s.T, s.hq}, q.options().dtype(acc));
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, q.scalar_type(), "slot_attention_cpu",
      [&] { slot_attention_typed<scalar_t>(q, k, v, slots, sees, scale, s, o, lse); });
  return {o, lse};
}

}  // namespace lvx::kernels
