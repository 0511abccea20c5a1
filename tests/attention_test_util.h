// The dense closed-form reference of the strategy tests (tests/test_attention.cpp,
// tests/test_attention_autograd.cpp), written independently of kernels/: the visibility matrix
// from the mask rules, attention and its gradient from P, dP, dS, the padding, and the error.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kernels/attention.h"
#include "src/attention/strategy.h"

namespace lvx::attention::testing {

struct Dense {
  at::Tensor o, lse, dq, dk, dv;
};

// visible[b, i, j]: query i sees key j, straight from the mask rules of kernels/attention.h.
// With unmatched_sees_all, a query of media −1 sees every key (padding is removed by the caller).
inline at::Tensor visibility(const AttentionSpec& s, const at::Tensor& q_media,
                             const at::Tensor& kv_media) {
  if (s.mask == kernels::MaskKind::kNone) return at::ones({s.batch, s.sq, s.skv}, at::kBool);
  if (s.mask == kernels::MaskKind::kCausal) {
    auto qp = at::arange(s.sq, at::kLong).view({1, -1, 1}) + (s.skv - s.sq);
    auto kp = at::arange(s.skv, at::kLong).view({1, 1, -1});
    return kp.le(qp).expand({s.batch, s.sq, s.skv}).clone();
  }
  auto qm = q_media.to(at::kLong).unsqueeze(2), km = kv_media.to(at::kLong).unsqueeze(1);
  auto seen = s.media_rule == kernels::MediaRule::kImmediate ? km.eq(qm) : km.le(qm);
  seen = seen & qm.ge(0) & km.ge(0);
  if (s.unmatched_sees_all) seen = seen | qm.lt(0).expand_as(seen);
  return seen;
}

// Dense attention and its gradient in `dt` (float64 = exact reference).
inline Dense dense(const AttentionSpec& s, at::Tensor q, at::Tensor k, at::Tensor v,
                   at::Tensor dout, const at::Tensor& vis, at::ScalarType dt) {
  const int64_t g = s.hq / s.hkv;
  const double scale = 1.0 / std::sqrt(static_cast<double>(s.head_dim));
  q = q.to(dt).permute({0, 2, 1, 3});  // [B, H, S, D]
  k = k.to(dt).repeat_interleave(g, 2).permute({0, 2, 1, 3});
  v = v.to(dt).repeat_interleave(g, 2).permute({0, 2, 1, 3});
  dout = dout.to(dt).permute({0, 2, 1, 3});
  auto m = vis.unsqueeze(1);  // [B, 1, Sq, Skv]
  auto S = at::matmul(q, k.transpose(-1, -2)) * scale;
  S = S.masked_fill(m.logical_not(), -INFINITY);
  auto lse = at::logsumexp(S, -1);  // −inf for empty rows
  auto P = at::exp(S - lse.unsqueeze(-1)).nan_to_num(0.0).masked_fill(m.logical_not(), 0.0);
  auto O = at::matmul(P, v);
  auto dV = at::matmul(P.transpose(-1, -2), dout);
  auto dP = at::matmul(dout, v.transpose(-1, -2));
  auto D = (dout * O).sum(-1, true);
  auto dS = P * (dP - D);
  auto dQ = at::matmul(dS, k) * scale;
  auto dK = at::matmul(dS.transpose(-1, -2), q) * scale;
  auto fold = [&](const at::Tensor& x) {  // [B, Hq, S, D] → [B, S, Hkv, D], summed per group
    return x.view({s.batch, s.hkv, g, x.size(2), s.head_dim}).sum(2).permute({0, 2, 1, 3});
  };
  return {O.permute({0, 2, 1, 3}), lse, dQ.permute({0, 2, 1, 3}), fold(dK), fold(dV)};
}

inline double max_err(const at::Tensor& a, const at::Tensor& ref) {
  auto d = (a.to(at::kDouble) - ref.to(at::kDouble)).abs();
  // −inf lse rows must match exactly; compare them as 0 error only if both are −inf.
  auto both_inf = a.to(at::kDouble).isinf() & ref.isinf() & a.to(at::kDouble).eq(ref);
  d = d.masked_fill(both_inf, 0.0);
  if (d.numel() == 0) return 0;
  return d.isnan().any().item<bool>() ? INFINITY : d.max().item<double>();
}

// Padding: batch row b has its last 3·(b+1) keys invalid (capped below Skv), and in row 1 also
// the first key, so that whole ranks' key shards can be padding.
inline at::Tensor padding_mask(int64_t batch, int64_t skv) {
  auto valid = at::ones({batch, skv}, at::kBool);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t pad = std::min<int64_t>(3 * (b + 1), skv - 1);
    valid[b].narrow(0, skv - pad, pad).fill_(false);
    if (b == 1) valid[b][0] = false;
  }
  return valid;
}

}  // namespace lvx::attention::testing
