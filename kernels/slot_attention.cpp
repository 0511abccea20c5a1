// slot_attention's checks and its composite of ATen ops (kernels/slot_attention.h): every device
// but the CPU, where slot_attention_cpu.cpp's loop serves.
#include "kernels/slot_attention.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <limits>

#include "kernels/attention.h"
#include "src/common/error.h"

namespace lvx::kernels {
namespace {

constexpr double kLog2e = 1.4426950408889634;  // log2(e)
constexpr double kLn2 = 0.6931471805599453;    // ln(2)

void check_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                const std::vector<int64_t>& slots, const std::vector<int64_t>& sees, double scale) {
  LVX_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
            "slot_attention: expected q [R, T, Hq, D], k [S, Hkv, C, D], v [S, Hkv, C, Dv], got ",
            q.sizes(), ", ", k.sizes(), ", ", v.sizes());
  const int64_t R = q.size(0), T = q.size(1), S = k.size(0), C = k.size(2);
  LVX_CHECK(k.size(3) == q.size(3) && v.size(0) == S && v.size(1) == k.size(1) && v.size(2) == C,
            "slot_attention: k ", k.sizes(), " and v ", v.sizes(), " do not fit q ", q.sizes());
  LVX_CHECK(k.size(1) > 0 && q.size(2) % k.size(1) == 0, "slot_attention: ", q.size(2),
            " query heads do not share ", k.size(1), " K/V heads evenly");
  LVX_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
            "slot_attention: q, k, v must share a dtype");
  LVX_CHECK(k.device() == q.device() && v.device() == q.device(),
            "slot_attention: q, k, v must be on one device, got ", q.device(), ", ", k.device(),
            ", ", v.device());
  LVX_CHECK(static_cast<int64_t>(slots.size()) == R, "slot_attention: ", slots.size(),
            " slots for ", R, " rows");
  LVX_CHECK(static_cast<int64_t>(sees.size()) == R * T, "slot_attention: ", sees.size(),
            " key counts for ", R, " rows of ", T, " tokens");
  for (int64_t s : slots) LVX_CHECK(s >= 0 && s < S, "slot_attention: slot ", s, " of ", S);
  for (int64_t n : sees)
    LVX_CHECK(n >= 1 && n <= C, "slot_attention: a token sees ", n, " keys of a slot of ", C);
  LVX_CHECK(scale > 0, "slot_attention: scale must be positive, got ", scale);
}

}  // namespace

SlotAttentionOutput slot_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   const std::vector<int64_t>& slots,
                                   const std::vector<int64_t>& sees, double scale) {
  check_args(q, k, v, slots, sees, scale);
  if (q.device().is_cpu())
    return slot_attention_cpu(q.contiguous(), k.contiguous(), v.contiguous(), slots, sees, scale);
  return slot_attention_composite(q, k, v, slots, sees, scale);
}

// The slots gathered and padded to the most keys a token sees, [R, Hkv, K, D]; each (row, K/V
// head) one batch of a bmm with its g query heads' T tokens as rows; the keys a token does not
// see hidden by an additive −inf. Scores in base 2 (scale · log2 e): exp2 is exact 0 at −inf
// on ATen's vectorized CPU path, and the lse goes back to base e. Every token sees its first
// key, so the maximum is finite; a slot's keys past its length are finite (the pool clears a
// reused slot), so 0·V stays 0.
SlotAttentionOutput slot_attention_composite(const at::Tensor& q, const at::Tensor& k,
                                             const at::Tensor& v, const std::vector<int64_t>& slots,
                                             const std::vector<int64_t>& sees, double scale) {
  const int64_t R = q.size(0), T = q.size(1), hq = q.size(2), D = q.size(3);
  const int64_t hkv = k.size(1), g = hq / hkv, Dv = v.size(3);
  const int64_t K = *std::max_element(sees.begin(), sees.end());
  const auto acc = accumulation_dtype(q.scalar_type());
  const at::Device dev = q.device();
  const at::Tensor index = at::tensor(slots, at::kLong).to(dev);
  const at::Tensor kk = k.narrow(2, 0, K).index_select(0, index).to(acc).view({R * hkv, K, D});
  const at::Tensor vv = v.narrow(2, 0, K).index_select(0, index).to(acc).view({R * hkv, K, Dv});
  const at::Tensor qq =
      q.to(acc).view({R, T, hkv, g, D}).permute({0, 2, 3, 1, 4}).reshape({R * hkv, g * T, D});
  const at::Tensor seen = at::tensor(sees, at::kLong).to(dev).view({R, 1, 1, T, 1});
  const at::Tensor hidden = at::arange(K, at::TensorOptions(dev).dtype(at::kLong)) >= seen;
  const at::Tensor bias = at::zeros({R, 1, 1, T, K}, q.options().dtype(acc))
                              .masked_fill_(hidden, -std::numeric_limits<double>::infinity())
                              .expand({R, hkv, g, T, K})
                              .reshape({R * hkv, g * T, K});
  at::Tensor sc = at::baddbmm(bias, qq, kk.transpose(1, 2), /*beta=*/1.0, /*alpha=*/scale * kLog2e);
  at::Tensor lse = sc.amax(-1, /*keepdim=*/true);  // [R·Hkv, g·T, 1], base 2 until the end
  sc.sub_(lse).exp2_();
  const at::Tensor sum = sc.sum(-1, /*keepdim=*/true);
  const at::Tensor o = at::bmm(sc, vv).div_(sum);  // [R·Hkv, g·T, Dv]
  lse.add_(sum.log2()).mul_(kLn2);
  return {o.view({R, hkv, g, T, Dv}).permute({0, 3, 1, 2, 4}).reshape({R, T, hq, Dv}),
          lse.view({R, hkv, g, T}).permute({0, 3, 1, 2}).reshape({R, T, hq})};
}

}  // namespace lvx::kernels
