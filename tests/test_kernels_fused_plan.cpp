// The fused path's shared plan (kernels/attention_fused.h) driven through a fake device table
// that records every call and computes it with a dense fp64 reference written here. It pins, on
// CPU, what the CUDA table does with each call (CUDA itself cannot run here):
//   - which key ranges are called, with no mask / is_causal / an additive bias, and that the
//     calls cover every visible (query, key) pair exactly once per query head, that no call but
//     an is_causal one (whose kernel skips them itself) spans a tile with no visible entry, and
//     that each bias equals the independent reference mask;
//   - which ATen kernel the CUDA table would take per call (cuda_fused_kernel): bf16/fp16
//     full -> flash, fp32 full -> memory-efficient, bias -> memory-efficient, causal square
//     bf16 -> flash, non-square causal -> memory-efficient;
//   - that the recorded calls' results, merged by the plan, equal the fp64 reference (forward
//     and, through the O' trick, backward) within fp32 round-off (2e-5, as the CPU gate), or
//     bf16/fp16's (3e-2);
//   - that a GQA piece flash serves is one grouped call (K/V with fewer heads); one another
//     kernel serves, without a causal order among its queries (unmasked or with a bias), one
//     call with each group's query heads folded along the sequence (the bias repeated per head);
//     causal pieces one call per query head of each group.
// Also the CUDA constraints predicate (cuda_fused_unsupported), one case per constraint.
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "kernels/attention.h"
#include "kernels/attention_fused.h"
#include "kernels/registry.h"
#include "tests/reference_mask.h"

namespace lvx::kernels {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr int kFakeSm = 90;  // the fake table stands for an H100

// One recorded call: the box of batch rows [b, b + nb), queries [i0, i0 + n), keys [j0, j0 + m),
// query head gi of each K/V group (h heads per call), and what the CUDA table would do with it.
// A folded call (each K/V head's g query heads side by side along its sequence: a copy of q, not
// a view) holds every query head of rows [i0, i0 + n); its bias, if any, repeats the box's mask
// once per query head of the group ([1, 1, g·n, m]).
struct Call {
  bool backward;
  int64_t b, nb, i0, n, j0, m, gi, h;
  bool folded;
  bool causal;
  at::Tensor bias;  // [1, 1, n, m] ([1, 1, g·n, m] folded) or undefined
  at::ScalarType dtype;
  FusedKernel kernel;
  bool kv_aliases_input;  // K/V are views of the caller's tensors (GQA without copies)
};

struct Recorder {
  at::Tensor q, k;  // the block's inputs, [B, S, H, D] contiguous
  std::vector<Call> calls;
};
Recorder* g_rec = nullptr;

int64_t elem_offset(const at::Tensor& view, const at::Tensor& base) {
  return (static_cast<const char*>(view.data_ptr()) - static_cast<const char*>(base.data_ptr())) /
         base.element_size();
}

// A folded call's offset in q as if it were a view: its first row is query head 0 of the row
// (b, i0) it starts at, found by value (the inputs are random: exactly one row matches).
int64_t folded_offset(const at::Tensor& cq, const at::Tensor& q) {
  const at::Tensor hit = q.select(2, 0).eq(cq[0][0][0]).all(-1).nonzero();  // [matches, 2]
  EXPECT_EQ(hit.size(0), 1) << "a folded call's first row is not one query row of the block";
  if (hit.size(0) == 0) return 0;
  const int64_t b = hit[0][0].item<int64_t>(), i0 = hit[0][1].item<int64_t>();
  return (b * q.size(1) + i0) * q.size(2) * q.size(3);
}

void record(const FusedOps& ops, const FusedCall& c, bool backward) {
  const at::Tensor& q = g_rec->q;
  const at::Tensor& k = g_rec->k;
  const int64_t sq = q.size(1), hq = q.size(2), d = q.size(3), skv = k.size(1), hkv = k.size(2);
  const bool folded = !c.q.storage().is_alias_of(q.storage());
  const int64_t qo = folded ? folded_offset(c.q, q) : elem_offset(c.q, q), ko = elem_offset(c.k, k);
  Call r{backward,
         qo / (sq * hq * d),
         c.q.size(0),
         qo % (sq * hq * d) / (hq * d),
         folded ? c.q.size(2) / (hq / c.q.size(1)) : c.q.size(2),
         ko % (skv * hkv * d) / (hkv * d),
         c.k.size(2),
         qo % (hq * d) / d,
         c.q.size(1),
         folded,
         c.causal,
         c.bias,
         c.q.scalar_type(),
         cuda_fused_kernel(c.q.scalar_type(), c.causal, c.bias.defined(), c.q.size(2), c.k.size(2),
                           d, ops.sm),
         c.k.storage().is_alias_of(k.storage())};
  g_rec->calls.push_back(r);
}

// A call's K/V with one head per query head: grouped calls (fewer K/V heads, FusedOps::grouped)
// read K/V head h / g for query head h.
at::Tensor per_query_head(const FusedCall& c, const at::Tensor& kv) {
  const int64_t g = c.q.size(1) / kv.size(1);
  return g == 1 ? kv : kv.repeat_interleave(g, 1);
}

// Dense fp64 scores of a call, masked entries −inf: top-left causal (key c > query r) or bias.
at::Tensor scores(const FusedCall& c) {
  at::Tensor s =
      at::matmul(c.q.to(at::kDouble), per_query_head(c, c.k).to(at::kDouble).transpose(-1, -2)) *
      c.scale;
  if (c.causal) {
    s = s.masked_fill(at::ones({s.size(2), s.size(3)}, at::kBool).triu(1), -kInf);
  }
  if (c.bias.defined()) s = s + c.bias.to(at::kDouble);
  return s;
}

std::tuple<at::Tensor, at::Tensor> fake_forward(const FusedOps& ops, const FusedCall& c) {
  record(ops, c, false);
  const at::Tensor s = scores(c);
  const at::Tensor lse = at::logsumexp(s, -1);  // −inf for a row that sees nothing here
  const at::Tensor p = at::exp(s - lse.unsqueeze(-1)).nan_to_num(0);
  return {at::matmul(p, per_query_head(c, c.v).to(at::kDouble)).to(c.q.scalar_type()),
          lse.to(at::kFloat)};
}

// What the ATen ops compute from (dout, out, lse): P = exp(S − lse), delta = rowsum(dO ∘ out).
std::tuple<at::Tensor, at::Tensor, at::Tensor> fake_backward(const FusedOps& ops,
                                                             const FusedCall& c,
                                                             const at::Tensor& dout,
                                                             const at::Tensor& out,
                                                             const at::Tensor& lse) {
  record(ops, c, true);
  const at::Tensor p = at::exp(scores(c) - lse.to(at::kDouble).unsqueeze(-1)).nan_to_num(0);
  const at::Tensor d_o = dout.to(at::kDouble), v = per_query_head(c, c.v).to(at::kDouble);
  const at::Tensor delta = (d_o * out.to(at::kDouble)).sum(-1, true);
  const at::Tensor ds = p * (at::matmul(d_o, v.transpose(-1, -2)) - delta);
  const auto t = c.q.scalar_type();
  // Grouped: dK and dV of each K/V head summed over its group's query heads (as flash's mha_bwd).
  const int64_t hkv = c.k.size(1), g = c.q.size(1) / hkv;
  auto per_kv_head = [&](const at::Tensor& x) {
    return g == 1 ? x : x.view({x.size(0), hkv, g, x.size(2), x.size(3)}).sum(2);
  };
  return {(at::matmul(ds, per_query_head(c, c.k).to(at::kDouble)) * c.scale).to(t),
          per_kv_head(at::matmul(ds.transpose(-1, -2), c.q.to(at::kDouble)) * c.scale).to(t),
          per_kv_head(at::matmul(p.transpose(-1, -2), d_o)).to(t)};
}

// Rows of a bias start at multiples of 16 elements, as on CUDA.
// Grouped K/V heads where the CUDA table takes them (flash).
const FusedOps kFake{"fake", fake_forward, fake_backward,           merge_attention_states_cpu,
                     16,     kFakeSm,      cuda_takes_grouped_heads};

struct Grads {
  at::Tensor dq, dk, dv;
};

// Dense fp64 reference through autograd (the reference of tests/kernel_test_util.h).
Grads reference_grads(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const at::Tensor& dout, const at::Tensor& visible) {
  auto qd = q.to(at::kDouble).detach().requires_grad_(true);
  auto kd = k.to(at::kDouble).detach().requires_grad_(true);
  auto vd = v.to(at::kDouble).detach().requires_grad_(true);
  auto ref = attention_reference(qd, kd, vd, visible, 0, at::kDouble);
  (ref.o * dout.to(at::kDouble)).sum().backward();
  return {qd.grad(), kd.grad(), vd.grad()};
}

// max |x − ref| over entries, −inf matching −inf, normalized by max(1, max |ref|).
double error(const at::Tensor& x, const at::Tensor& ref) {
  auto a = x.to(at::kDouble), r = ref.to(at::kDouble);
  auto both = a.isneginf() & r.isneginf();
  auto diff = at::where(both, at::zeros_like(a), a - r);
  if (!diff.isfinite().all().item<bool>()) return kInf;
  const double scale =
      std::max(1.0, at::where(both, at::zeros_like(r), r).abs().max().item<double>());
  return diff.abs().max().item<double>() / scale;
}

struct Block {
  int64_t batch, sq, skv, hq, hkv, d;
  AttentionMask mask;
};

// The recorded forward calls against the reference visibility `vis` [B, Sq, Skv]: every box is
// what its mask says, every visible pair is covered once per query head, and no empty tile is
// called except inside an is_causal call (the ATen kernels skip those tiles themselves).
void check_coverage(const Block& blk, const std::vector<Call>& calls, const at::Tensor& vis) {
  const int64_t g = blk.hq / blk.hkv;
  std::vector<at::Tensor> cov(g);
  std::vector<at::Tensor> spanned(g);  // pairs inside a call without is_causal
  for (int64_t gi = 0; gi < g; ++gi) {
    cov[gi] = at::zeros({blk.batch, blk.sq, blk.skv}, at::kInt);
    spanned[gi] = at::zeros({blk.batch, blk.sq, blk.skv}, at::kBool);
  }
  for (const Call& c : calls) {
    if (c.backward) continue;
    SCOPED_TRACE("call b" + std::to_string(c.b) + " q[" + std::to_string(c.i0) + "+" +
                 std::to_string(c.n) + ") k[" + std::to_string(c.j0) + "+" + std::to_string(c.m) +
                 ") head " + std::to_string(c.gi));
    // One call per query head of each group, one grouped call for every head (flash), or one
    // folded call for every head (without a causal order among its queries).
    const bool grouped = g > 1 && c.h == blk.hq;
    if (c.folded) {
      EXPECT_TRUE(g > 1 && c.h == blk.hkv && !c.causal);
      EXPECT_EQ(c.gi, 0);
    } else if (grouped) {
      EXPECT_EQ(c.kernel, FusedKernel::kFlash) << "only flash takes grouped K/V heads";
      EXPECT_EQ(c.gi, 0);
    } else {
      EXPECT_EQ(c.h, blk.hkv);
    }
    EXPECT_TRUE(c.kv_aliases_input) << "K/V were copied";
    ASSERT_LT(c.gi, g);
    const at::Tensor box = vis.narrow(0, c.b, c.nb).narrow(1, c.i0, c.n).narrow(2, c.j0, c.m);
    if (c.bias.defined()) {
      EXPECT_FALSE(c.causal);
      EXPECT_EQ(c.bias.scalar_type(), c.dtype);
      EXPECT_EQ(c.bias.stride(2) % 16, 0) << "bias rows must start at multiples of 16";
      EXPECT_EQ(c.nb, 1);
      const int64_t copies = c.folded ? g : 1;  // one per folded query head
      ASSERT_EQ(c.bias.size(2), copies * c.n);
      for (int64_t i = 0; i < copies; ++i) {
        const at::Tensor bi = c.bias[0][0].narrow(0, i * c.n, c.n);
        EXPECT_TRUE(at::equal(bi.eq(0), box[0])) << "bias differs from the reference mask";
        EXPECT_TRUE(at::equal(bi.isneginf(), box[0].logical_not()));
      }
    } else if (c.causal) {
      EXPECT_TRUE(at::equal(box, at::ones({c.n, c.m}, at::kBool).tril().expand({c.nb, c.n, c.m})));
    } else {
      EXPECT_TRUE(box.all().item<bool>()) << "a call without a mask covers an invisible pair";
    }
    const bool every_head = grouped || c.folded;
    for (int64_t gi = every_head ? 0 : c.gi; gi < (every_head ? g : c.gi + 1); ++gi) {
      cov[gi].narrow(0, c.b, c.nb).narrow(1, c.i0, c.n).narrow(2, c.j0, c.m).add_(1);
      if (!c.causal)
        spanned[gi].narrow(0, c.b, c.nb).narrow(1, c.i0, c.n).narrow(2, c.j0, c.m).fill_(true);
    }
  }
  for (int64_t gi = 0; gi < g; ++gi) {
    EXPECT_TRUE(
        at::equal(cov[gi].masked_select(vis), at::ones({vis.sum().item<int64_t>()}, at::kInt)))
        << "head " << gi << ": some visible pair is not covered exactly once";
    for (int64_t b = 0; b < blk.batch; ++b) {
      for (int64_t i = 0; i < blk.sq; i += kCpuQTile) {
        for (int64_t j = 0; j < blk.skv; j += kCpuKTile) {
          const int64_t n = std::min(kCpuQTile, blk.sq - i), m = std::min(kCpuKTile, blk.skv - j);
          if (vis[b].narrow(0, i, n).narrow(1, j, m).any().item<bool>()) continue;
          EXPECT_FALSE(spanned[gi][b].narrow(0, i, n).narrow(1, j, m).any().item<bool>())
              << "empty tile (b" << b << ", q" << i << ", k" << j << ") was called";
        }
      }
    }
  }
}

// Runs the block through the fake table in `dtype`; returns the recorded calls. In fp32 also
// gates o, lse, dq, dk, dv against the fp64 reference.
std::vector<Call> run_block(const Block& blk, at::ScalarType dtype, uint64_t seed) {
  at::manual_seed(seed);
  const at::Tensor q = at::randn({blk.batch, blk.sq, blk.hq, blk.d}).to(dtype);
  const at::Tensor k = at::randn({blk.batch, blk.skv, blk.hkv, blk.d}).to(dtype);
  const at::Tensor v = at::randn({blk.batch, blk.skv, blk.hkv, blk.d}).to(dtype);
  const at::Tensor dout = at::randn({blk.batch, blk.sq, blk.hq, blk.d}).to(dtype);
  const double scale = 1.0 / std::sqrt(static_cast<double>(blk.d));
  Recorder rec{q, k, {}};
  g_rec = &rec;
  AttentionStats st;
  auto out = attention_forward_fused(kFake, q, k, v, scale, blk.mask, &st);
  auto delta = attention_delta(dout, out.o);
  auto g = attention_backward_fused(kFake, q, k, v, dout, out.lse, delta, scale, blk.mask, nullptr);
  g_rec = nullptr;
  const at::Tensor vis = lvx::testing::reference_visibility(blk.mask, blk.batch, blk.sq, blk.skv);
  check_coverage(blk, rec.calls, vis);
  // The backward makes the forward's calls again (one plan for both).
  std::vector<std::string> fwd, bwd;
  for (const Call& c : rec.calls) {
    (c.backward ? bwd : fwd)
        .push_back(std::to_string(c.b) + "+" + std::to_string(c.nb) + (c.folded ? "f" : "") + ":" +
                   std::to_string(c.i0) + "+" + std::to_string(c.n) + "x" + std::to_string(c.j0) +
                   "+" + std::to_string(c.m) + "/" + std::to_string(c.gi) + (c.causal ? "c" : "") +
                   (c.bias.defined() ? "b" : ""));
  }
  EXPECT_EQ(fwd, bwd);
  EXPECT_EQ(st.tiles_fused + st.tiles_skipped, st.tiles_total);
  // The stats name the kernel of every forward call, as the CUDA table chooses it.
  int64_t flash = 0, efficient = 0;
  for (const Call& c : rec.calls)
    if (!c.backward) ++(c.kernel == FusedKernel::kFlash ? flash : efficient);
  EXPECT_EQ(st.calls_flash, flash);
  EXPECT_EQ(st.calls_efficient, efficient);
  // fp32 within its round-off; bf16/fp16 within theirs (each call's inputs and outputs are
  // rounded; a wrong head or key range is off by O(1)).
  const double tol = dtype == at::kFloat ? 2e-5 : 3e-2;
  auto exact = attention_reference(q, k, v, vis, scale, at::kDouble);
  EXPECT_LE(error(out.o, exact.o), tol);
  EXPECT_LE(error(out.lse, exact.lse), tol);
  auto gx = reference_grads(q, k, v, dout, vis);
  EXPECT_LE(error(g.dq, gx.dq), tol);
  EXPECT_LE(error(g.dk, gx.dk), tol);
  EXPECT_LE(error(g.dv, gx.dv), tol);
  return rec.calls;
}

AttentionMask causal(int64_t sq, int64_t skv) {  // aligned at the end, as a ring's last block
  AttentionMask m;
  m.kind = MaskKind::kCausal;
  m.q_pos = at::arange(sq, at::kLong) + (skv - sq);
  m.k_pos = at::arange(skv, at::kLong);
  return m;
}

// A square causal block (a ring's diagonal) with GQA: one is_causal call per query head of a
// group; bf16/fp16 take flash (square), fp32 the memory-efficient kernel.
// A square causal block (a ring's diagonal) with GQA: fp32 takes the memory-efficient kernel,
// one is_causal call per query head of a group (it needs equal heads); bf16/fp16 take flash, one
// call over all 4 query heads and the 2 K/V heads (flash reads K/V head h / 2 for query head h and
// sums dK, dV over each group).
TEST(FusedPlan, CausalSquareGqaIsOneCausalCallPerGroupHeadOrOneGroupedFlashCall) {
  const Block blk{1, 700, 700, 4, 2, 16, causal(700, 700)};
  for (auto dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    SCOPED_TRACE(c10::toString(dtype));
    const auto calls = run_block(blk, dtype, 11);
    const bool flash = dtype != at::kFloat;
    ASSERT_EQ(calls.size(), flash ? 2u : 4u);  // forward and backward, per group head or grouped
    for (const Call& c : calls) {
      EXPECT_TRUE(c.causal && !c.bias.defined() && c.n == 700 && c.m == 700);
      EXPECT_EQ(c.h, flash ? 4 : 2);
      EXPECT_EQ(c.kernel, flash ? FusedKernel::kFlash : FusedKernel::kEfficient)
          << fused_kernel_name(c.kernel);
    }
  }
}

// An unmasked GQA block of several batch rows and few queries (lvx serve's decode rows over a
// video's keys), and one whose padding mask hides nothing: one call for the whole block forward
// and one backward. fp32 (memory-efficient on CUDA, flash on CPU: neither takes fewer K/V heads)
// folds each K/V head's 4 query heads along the sequence; bf16 takes flash's grouped heads.
// A mask that hides a key makes one folded call per batch row, forward and backward (the bias
// repeated per folded head).
TEST(FusedPlan, UnmaskedGqaBlockIsOneCallFoldedOrGrouped) {
  Block blk{3, 5, 700, 8, 2, 16, {}};
  for (const bool padded : {false, true}) {
    if (padded) blk.mask.kv_valid = at::ones({3, 700}, at::kBool);
    for (auto dtype : {at::kFloat, at::kBFloat16}) {
      SCOPED_TRACE(std::string(c10::toString(dtype)) + (padded ? " all-valid mask" : " no mask"));
      const auto calls = run_block(blk, dtype, 17);
      ASSERT_EQ(calls.size(), 2u);
      for (const Call& c : calls) {
        EXPECT_EQ(c.nb, 3);
        EXPECT_EQ(c.n, 5);
        EXPECT_EQ(c.m, 700);
        EXPECT_EQ(c.folded, dtype == at::kFloat);
        EXPECT_EQ(c.h, dtype == at::kFloat ? 2 : 8);
      }
    }
  }
  at::manual_seed(18);
  blk.mask.kv_valid = at::rand({3, 700}) > 0.2;
  const auto calls = run_block(blk, at::kFloat, 19);
  EXPECT_EQ(calls.size(), 2u * 3);  // forward and backward, per batch row
  for (const Call& c : calls) EXPECT_TRUE(c.nb == 1 && c.folded && c.h == 2);
}

// Causal with Sq < Skv, aligned at the end: the keys every query sees are one call without a
// mask for every query head (flash with grouped K/V heads for bf16/fp16, memory-efficient with
// the heads folded for fp32), the diagonal part calls with a bias (memory-efficient).
TEST(FusedPlan, CausalEndAlignedFullRunWithoutMaskAndDiagonalWithBias) {
  const Block blk{1, 300, 1500, 4, 2, 16, causal(300, 1500)};
  for (auto dtype : {at::kFloat, at::kBFloat16}) {
    SCOPED_TRACE(c10::toString(dtype));
    const auto calls = run_block(blk, dtype, 12);
    int full = 0, masked = 0;
    for (const Call& c : calls) {
      if (c.backward) continue;
      if (!c.bias.defined() && !c.causal) {
        ++full;
        EXPECT_EQ(c.n, 300);  // every query at once
        EXPECT_EQ(c.j0, 0);
        EXPECT_EQ(c.m, 2 * kCpuKTile);
        EXPECT_EQ(c.kernel, dtype == at::kFloat ? FusedKernel::kEfficient : FusedKernel::kFlash);
      } else {
        ++masked;
        EXPECT_TRUE(c.bias.defined());
        EXPECT_EQ(c.kernel, FusedKernel::kEfficient);
      }
    }
    EXPECT_EQ(full, 1);  // every query head at once
    EXPECT_GT(masked, 0);
  }
}

// Media up-to with rows that see nothing (q_media −1) and key tiles nobody in a query tile sees:
// no call touches an empty tile, empty rows end with o = 0 and lse = −inf.
TEST(FusedPlan, MediaMaskSkipsEmptyTilesAndMergesToReference) {
  const int64_t sq = 400, skv = 2600;
  Block blk{2, sq, skv, 2, 2, 16, {}};
  blk.mask.kind = MaskKind::kMedia;
  blk.mask.media_rule = MediaRule::kUpTo;
  blk.mask.q_media = at::clamp_max(at::floor_divide(at::arange(sq, at::kLong) - 50, 90), 3)
                         .to(at::kInt)
                         .unsqueeze(0)
                         .repeat({2, 1})
                         .contiguous();
  blk.mask.kv_media =
      at::floor_divide(at::arange(skv, at::kLong), 700).to(at::kInt).unsqueeze(0).repeat({2, 1});
  for (auto dtype : {at::kFloat, at::kBFloat16}) {
    SCOPED_TRACE(c10::toString(dtype));
    const auto calls = run_block(blk, dtype, 13);
    bool any_full = false, any_bias = false;
    for (const Call& c : calls) {
      if (c.bias.defined()) {
        any_bias = true;
        EXPECT_EQ(c.kernel, FusedKernel::kEfficient);
      } else if (!c.causal) {
        any_full = true;
        EXPECT_EQ(c.kernel, dtype == at::kFloat ? FusedKernel::kEfficient : FusedKernel::kFlash);
      }
    }
    EXPECT_TRUE(any_full && any_bias);
  }
  // The rows before the first media: nothing visible.
  Recorder rec;
  at::manual_seed(14);
  auto q = at::randn({2, sq, 2, 16}), k = at::randn({2, skv, 2, 16}),
       v = at::randn({2, skv, 2, 16});
  rec.q = q;
  rec.k = k;
  g_rec = &rec;
  auto out = attention_forward_fused(kFake, q, k, v, 0.25, blk.mask, nullptr);
  g_rec = nullptr;
  EXPECT_TRUE(at::equal(out.lse.narrow(2, 0, 50), at::full({2, 2, 50}, -kInf)));
  EXPECT_TRUE(at::equal(out.o.narrow(1, 0, 50), at::zeros({2, 50, 2, 16})));
}

// GQA (4 query heads per K/V head) with padding and a media-immediate mask: each box is one
// call, the group's query heads folded along the sequence, on views of K/V, and the merge is the
// reference's (run_block's checks); the backward makes the same calls.
TEST(FusedPlan, GqaMediaImmediateWithPaddingFoldsEachGroupsHeadsOnKvViews) {
  const int64_t sq = 260, skv = 1300;
  Block blk{2, sq, skv, 8, 2, 16, {}};
  blk.mask.kind = MaskKind::kMedia;
  blk.mask.media_rule = MediaRule::kImmediate;
  at::manual_seed(15);
  blk.mask.q_media = std::get<0>(at::randint(-1, 3, {2, sq}, at::kInt).sort(1)).contiguous();
  blk.mask.kv_media =
      (at::arange(skv, at::kLong) * 3 / skv).to(at::kInt).unsqueeze(0).repeat({2, 1});
  blk.mask.kv_valid = at::rand({2, skv}) > 0.1;
  const auto calls = run_block(blk, at::kFloat, 16);
  int forward = 0;
  for (const Call& c : calls) {
    forward += !c.backward;
    EXPECT_TRUE(c.folded && c.gi == 0 && c.h == 2);
  }
  EXPECT_GT(forward, 0);
}

// ---- the CUDA table's choices, without a GPU ------------------------------------------------
TEST(FusedCudaChoice, KernelPerCallFollowsAtenConstraints) {
  using K = FusedKernel;
  // bf16/fp16 without a mask: flash on sm80-121; fp32: memory-efficient.
  EXPECT_EQ(cuda_fused_kernel(at::kBFloat16, false, false, 100, 900, 128, 90), K::kFlash);
  EXPECT_EQ(cuda_fused_kernel(at::kHalf, false, false, 100, 900, 128, 80), K::kFlash);
  EXPECT_EQ(cuda_fused_kernel(at::kFloat, false, false, 100, 900, 128, 90), K::kEfficient);
  // a bias: memory-efficient; causal: flash only when square (its causal is bottom-right).
  EXPECT_EQ(cuda_fused_kernel(at::kBFloat16, false, true, 100, 900, 128, 90), K::kEfficient);
  EXPECT_EQ(cuda_fused_kernel(at::kBFloat16, true, false, 512, 512, 128, 90), K::kFlash);
  EXPECT_EQ(cuda_fused_kernel(at::kBFloat16, true, false, 300, 512, 128, 90), K::kEfficient);
  // flash is not built below sm80; head dim > 192 fails its backward on sm86-89 and sm120.
  EXPECT_EQ(cuda_fused_kernel(at::kHalf, false, false, 100, 900, 128, 75), K::kEfficient);
  EXPECT_EQ(cuda_fused_kernel(at::kBFloat16, false, false, 100, 900, 256, 86), K::kEfficient);
  EXPECT_EQ(cuda_fused_kernel(at::kBFloat16, false, false, 100, 900, 256, 90), K::kFlash);
  EXPECT_EQ(cuda_fused_kernel(at::kBFloat16, false, false, 100, 900, 192, 89), K::kFlash);
}

TEST(FusedCudaChoice, UnsupportedBlocksFallBackWithAReason) {
  auto t = [](at::ScalarType dt, int64_t d) { return at::zeros({1, 16, 2, d}, dt); };
  const auto q = t(at::kBFloat16, 64);
  EXPECT_EQ(cuda_fused_unsupported(q, q, q, 90), nullptr);
  EXPECT_EQ(cuda_fused_unsupported(t(at::kFloat, 64), t(at::kFloat, 64), t(at::kFloat, 64), 75),
            nullptr);
  const auto d64 = t(at::kDouble, 64);
  EXPECT_NE(cuda_fused_unsupported(d64, d64, d64, 90), nullptr);  // fp64: lvx's kernels
  EXPECT_NE(cuda_fused_unsupported(q, q, q, 75), nullptr);        // bf16 below sm80
  EXPECT_NE(cuda_fused_unsupported(q, q, q, 37), nullptr);        // below sm50
  const auto d12 = t(at::kHalf, 12);
  EXPECT_NE(cuda_fused_unsupported(d12, d12, d12, 90), nullptr);  // head dim % 8
  const auto d264 = t(at::kHalf, 264);
  EXPECT_NE(cuda_fused_unsupported(d264, d264, d264, 90), nullptr);  // head dim > 256
  // One element past an aligned base: not 16-byte aligned.
  const auto off =
      at::zeros({1 + 16 * 2 * 64}, at::kBFloat16).narrow(0, 1, 16 * 2 * 64).view({1, 16, 2, 64});
  EXPECT_NE(cuda_fused_unsupported(off, q, q, 90), nullptr);
}

}  // namespace
}  // namespace lvx::kernels
