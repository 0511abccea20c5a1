// CPU merge of two partial attention states in pure-LSE form (NOTES.md §0; FlashAttention-2
// rescaling; BurstAttention Alg. 1 lines "m_new, l_i, O_i"): for each row,
//   m = max(lse_a, lse_b), w_x = exp(lse_x - m), lse = m + log(w_a + w_b),
//   o = o_a·w_a/(w_a + w_b) + o_b·w_b/(w_a + w_b).
// Empty rows (lse -inf, or +inf by the flash-attn convention) carry zero weight; a row empty on
// both sides ends with lse = -inf and o = 0.
#include <ATen/Parallel.h>

#include <cmath>
#include <limits>

#include "kernels/registry.h"

namespace lvx::kernels {
namespace {

template <typename T>
void merge_typed(at::Tensor& o_acc, at::Tensor& lse_acc, const at::Tensor& o_new,
                 const at::Tensor& lse_new) {
  const int64_t batch = o_acc.size(0), s = o_acc.size(1), h = o_acc.size(2), d = o_acc.size(3);
  T* oa = o_acc.data_ptr<T>();
  T* la = lse_acc.data_ptr<T>();
  const T* ob = o_new.data_ptr<T>();
  const T* lb = lse_new.data_ptr<T>();
  const T inf = std::numeric_limits<T>::infinity();
  // Rows are indexed like lse: [B, H, S]; o is [B, S, H, D].
  at::parallel_for(0, batch * h * s, 256, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t i = row % s, hh = (row / s) % h, b = row / (s * h);
      T* o = oa + ((b * s + i) * h + hh) * d;
      const T* on = ob + ((b * s + i) * h + hh) * d;
      const T a = std::isinf(la[row]) ? -inf : la[row];  // +inf: empty (flash-attn)
      const T n = std::isinf(lb[row]) ? -inf : lb[row];
      const T m = std::max(a, n);
      if (m == -inf) {
        la[row] = -inf;
        for (int64_t x = 0; x < d; ++x) o[x] = T(0);
        continue;
      }
      const T wa = std::exp(a - m), wn = std::exp(n - m), sum = wa + wn;
      const T ca = wa / sum, cn = wn / sum;
      la[row] = m + std::log(sum);
      if (cn == T(0)) continue;  // nothing new (also keeps o_acc exactly when o_new is junk)
      if (ca == T(0)) {
        for (int64_t x = 0; x < d; ++x) o[x] = on[x];
        continue;
      }
      for (int64_t x = 0; x < d; ++x) o[x] = o[x] * ca + on[x] * cn;
    }
  });
}

}  // namespace

void merge_attention_states_cpu(at::Tensor& o_acc, at::Tensor& lse_acc, const at::Tensor& o_new,
                                const at::Tensor& lse_new) {
  if (o_acc.scalar_type() == at::kDouble) {
    merge_typed<double>(o_acc, lse_acc, o_new, lse_new);
  } else {
    merge_typed<float>(o_acc, lse_acc, o_new, lse_new);
  }
}

}  // namespace lvx::kernels
