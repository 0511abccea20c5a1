// Helpers shared by the local attention kernel tests (tests/test_kernels.cpp,
// tests/test_kernels_merge.cpp, tests/test_kernels_dispatch.cpp): the mask cases, the fp64
// dense reference's visibility and gradients, and the normalized error the gates compare.
#pragma once

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <limits>
#include <ostream>
#include <string>

#include "kernels/attention.h"
#include "tests/reference_mask.h"

namespace lvx::kernels::testing {

inline constexpr double kInf = std::numeric_limits<double>::infinity();

// kMediaSeesAll / kMediaUpToSeesAll: media-immediate / up-to with unmatched_sees_all (queries
// with media −1 see every key, Llama-3.2-Vision) and padding, whole key tiles of it in the last
// sample.
enum class MaskCase {
  kNone,
  kCausal,
  kMediaImmediate,
  kMediaUpTo,
  kPadding,
  kMediaSeesAll,
  kMediaUpToSeesAll
};

inline const char* mask_name(MaskCase m) {
  switch (m) {
    case MaskCase::kNone:
      return "none";
    case MaskCase::kCausal:
      return "causal";
    case MaskCase::kMediaImmediate:
      return "mediaImm";
    case MaskCase::kMediaUpTo:
      return "mediaUpTo";
    case MaskCase::kPadding:
      return "padding";
    case MaskCase::kMediaSeesAll:
      return "mediaSeesAll";
    case MaskCase::kMediaUpToSeesAll:
      return "mediaUpToSeesAll";
  }
  return "?";
}

// Media indices per token: keys come in `n_media` equal runs, a few keys are -1 (seen by
// nobody); queries hold a non-decreasing "most recent media", -1 before the first one.
inline at::Tensor media_keys(int64_t batch, int64_t skv, int64_t n_media) {
  auto idx = (at::arange(skv, at::kLong) * n_media / std::max<int64_t>(skv, 1)).to(at::kInt);
  auto m = idx.unsqueeze(0).repeat({batch, 1});
  if (skv > 3) m.select(1, skv / 3).fill_(-1);
  return m.contiguous();
}

inline at::Tensor media_queries(int64_t batch, int64_t sq, int64_t n_media) {
  auto r = at::randint(-1, n_media, {batch, sq}, at::kInt);
  return std::get<0>(r.sort(1)).contiguous();
}

inline AttentionMask make_mask(MaskCase c, int64_t batch, int64_t sq, int64_t skv) {
  AttentionMask m;
  switch (c) {
    case MaskCase::kNone:
      break;
    case MaskCase::kCausal:
      // Aligned at the end: the last query sees the last key (queries before the first key's
      // position, when Sq > Skv, see nothing).
      m.kind = MaskKind::kCausal;
      m.q_pos = at::arange(sq, at::kLong) + (skv - sq);
      m.k_pos = at::arange(skv, at::kLong);
      break;
    case MaskCase::kMediaImmediate:
    case MaskCase::kMediaUpTo:
      m.kind = MaskKind::kMedia;
      m.media_rule = c == MaskCase::kMediaImmediate ? MediaRule::kImmediate : MediaRule::kUpTo;
      m.q_media = media_queries(batch, sq, 3);
      m.kv_media = media_keys(batch, skv, 3);
      break;
    case MaskCase::kPadding:
      m.kv_valid = at::rand({batch, skv}) > 0.2;
      m.kv_valid.select(0, batch - 1).narrow(0, skv / 2, skv - skv / 2).fill_(false);
      break;
    case MaskCase::kMediaSeesAll:
    case MaskCase::kMediaUpToSeesAll:
      m.kind = MaskKind::kMedia;
      m.media_rule = c == MaskCase::kMediaSeesAll ? MediaRule::kImmediate : MediaRule::kUpTo;
      m.unmatched_sees_all = true;
      m.q_media = media_queries(batch, sq, 3);
      m.kv_media = media_keys(batch, skv, 3);
      m.kv_valid = at::ones({batch, skv}, at::kBool);
      m.kv_valid.select(0, batch - 1).narrow(0, skv / 2, skv - skv / 2).fill_(false);
      break;
  }
  return m;
}

inline void PrintTo(MaskCase m, std::ostream* os) { *os << mask_name(m); }

inline std::string dtype_name(at::ScalarType t) {
  return t == at::kDouble ? "f64" : t == at::kFloat ? "f32" : t == at::kBFloat16 ? "bf16" : "f16";
}

inline double max_abs(const at::Tensor& t) {
  return t.numel() == 0 ? 0.0 : t.abs().max().item<double>();
}

// max |x - ref| over finite entries, normalized by max(1, max |ref|); -inf must match -inf.
// Both sides move to the CPU in fp64 first: the kernel's result may be on a GPU, the fp64
// reference never is.
inline double error(const at::Tensor& x, const at::Tensor& ref) {
  auto a = x.to(at::kCPU, at::kDouble), r = ref.to(at::kCPU, at::kDouble);
  EXPECT_EQ(a.isnan().sum().item<int64_t>(), 0) << "NaN in kernel output";
  auto both_ninf = a.isneginf() & r.isneginf();
  auto diff = at::where(both_ninf, at::zeros_like(a), a - r);
  if (diff.isnan().any().item<bool>() || diff.isinf().any().item<bool>()) return kInf;
  return max_abs(diff) / std::max(1.0, max_abs(at::where(both_ninf, at::zeros_like(r), r)));
}

struct Grads {
  at::Tensor dq, dk, dv;
};

// The independent visibility matrix of p's mask for q [B, Sq, …] and k [B, Skv, …].
inline at::Tensor vis(const AttentionParams& p, const at::Tensor& q, const at::Tensor& k) {
  return lvx::testing::reference_visibility(p.mask, q.size(0), q.size(1), k.size(1));
}

// Gradients of sum(o * dout) through the dense reference, by autograd, in `dtype`.
inline Grads reference_grads(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const at::Tensor& dout, const AttentionParams& p,
                             at::ScalarType dtype) {
  auto qd = q.to(dtype).detach().requires_grad_(true);
  auto kd = k.to(dtype).detach().requires_grad_(true);
  auto vd = v.to(dtype).detach().requires_grad_(true);
  auto ref = attention_reference(qd, kd, vd, vis(p, q, k), p.scale, dtype);
  (ref.o * dout.to(dtype)).sum().backward();
  return {qd.grad(), kd.grad(), vd.grad()};
}

}  // namespace lvx::kernels::testing
