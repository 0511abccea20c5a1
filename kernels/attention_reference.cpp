// Dense reference attention: materializes S [B, Hq, Sq, Skv] in the requested dtype. Written
// with plain ATen ops (differentiable, NaN-free for empty rows) so tests can take autograd
// gradients of it; never used on the hot path.
#include <limits>

#include "kernels/attention.h"
#include "src/common/error.h"

namespace lvx::kernels {

AttentionOutput attention_reference(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    const at::Tensor& visible, double scale_arg,
                                    at::ScalarType compute_dtype) {
  LVX_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
            "attention_reference: q, k, v must be 4-D [B, S, H, D]");
  const int64_t batch = q.size(0), sq = q.size(1), hq = q.size(2), d = q.size(3);
  const int64_t skv = k.size(1), hkv = k.size(2);
  LVX_CHECK(hkv > 0 && hq % hkv == 0, "attention_reference: k has ", hkv,
            " heads, which does not divide q's ", hq, " heads");
  LVX_CHECK(
      visible.scalar_type() == at::kBool && visible.sizes() == at::IntArrayRef({batch, sq, skv}),
      "attention_reference: visible must be bool [", batch, ", ", sq, ", ", skv, "], got ",
      visible.scalar_type(), " ", visible.sizes());
  const double scale = scale_arg == 0 ? 1.0 / std::sqrt(static_cast<double>(d)) : scale_arg;
  // [B, H, S, D], K/V expanded over the query-head groups (fine for a reference).
  auto qh = q.to(compute_dtype).transpose(1, 2);
  auto kh = k.to(compute_dtype).repeat_interleave(hq / hkv, 2).transpose(1, 2);
  auto vh = v.to(compute_dtype).repeat_interleave(hq / hkv, 2).transpose(1, 2);
  auto s = at::matmul(qh, kh.transpose(2, 3)) * scale;  // [B, H, Sq, Skv]
  auto vis = visible.to(q.device()).unsqueeze(1);
  auto any = vis.any(-1, /*keepdim=*/true);  // [B, 1, Sq, 1]
  // Empty rows get finite scores (0) so nothing is NaN, then are zeroed by `any`.
  auto s_m = s.masked_fill(vis.logical_not(), -std::numeric_limits<double>::infinity())
                 .masked_fill(any.logical_not(), 0);
  auto lse = at::logsumexp(s_m, -1, /*keepdim=*/true);
  auto p = at::exp(s_m - lse) * any.to(compute_dtype);
  auto o = at::matmul(p, vh).transpose(1, 2).contiguous();  // [B, Sq, H, D]
  auto lse_out = at::where(any.squeeze(-1), lse.squeeze(-1),
                           at::full({}, -std::numeric_limits<double>::infinity(), lse.options()));
  return {o, lse_out.contiguous()};
}

}  // namespace lvx::kernels
