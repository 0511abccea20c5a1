// The mask rules of kernels/attention.h, written again from their text with plain loops, as the
// independent reference of the kernel and planner tests (the kernels' own mask code is under
// test there, so it cannot be its own reference):
//   none:   every query sees every key;
//   causal: query i sees key j iff k_pos[j] <= q_pos[i];
//   media:  a query or key with media index −1 takes no part; otherwise immediate:
//           kv_media[j] == q_media[i], up-to: kv_media[j] <= q_media[i]; with
//           unmatched_sees_all, a query with media index −1 sees every key instead (keys with
//           media index −1 included);
//   and a key with kv_valid false (padding) is seen by no query.
#pragma once

#include <ATen/ATen.h>

#include "kernels/attention.h"

namespace lvx::testing {

inline at::Tensor reference_visibility(const kernels::AttentionMask& m, int64_t batch, int64_t sq,
                                       int64_t skv) {
  auto cpu = [](const at::Tensor& t, at::ScalarType dt) {
    return t.defined() ? t.to(at::kCPU).to(dt).contiguous() : t;
  };
  const at::Tensor qp = cpu(m.q_pos, at::kLong), kp = cpu(m.k_pos, at::kLong);
  const at::Tensor qm = cpu(m.q_media, at::kLong), km = cpu(m.kv_media, at::kLong);
  const at::Tensor valid = cpu(m.kv_valid, at::kBool);
  at::Tensor vis = at::zeros({batch, sq, skv}, at::kBool);
  bool* out = vis.data_ptr<bool>();
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t i = 0; i < sq; ++i)
      for (int64_t j = 0; j < skv; ++j) {
        bool seen = true;
        if (m.kind == kernels::MaskKind::kCausal) {
          seen = kp.data_ptr<int64_t>()[j] <= qp.data_ptr<int64_t>()[i];
        } else if (m.kind == kernels::MaskKind::kMedia) {
          const int64_t q = qm.data_ptr<int64_t>()[b * sq + i];
          const int64_t k = km.data_ptr<int64_t>()[b * skv + j];
          if (q == -1)
            seen = m.unmatched_sees_all;
          else if (k == -1)
            seen = false;
          else if (m.media_rule == kernels::MediaRule::kImmediate)
            seen = k == q;
          else
            seen = k <= q;
        }
        if (valid.defined() && !valid.data_ptr<bool>()[b * skv + j]) seen = false;
        out[(b * sq + i) * skv + j] = seen;
      }
  return vis;
}

}  // namespace lvx::testing
