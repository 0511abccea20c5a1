// Which CPU path runs (FusedDispatch): fp32/bf16/fp16 through ATen's fused attention and the
// shared plan (kernels/attention_fused.h), fp64 through lvx's own kernel; the plan's unmasked,
// media-mask and whole-block cases against the fp64 reference.
#include <gtest/gtest.h>

#include <string>
#include <tuple>
#include <utility>

#include "kernels/attention.h"
#include "kernels/registry.h"
#include "src/common/error.h"
#include "tests/kernel_test_util.h"

namespace lvx::kernels {
namespace {

using namespace lvx::kernels::testing;

// Which path ran: bf16/fp16/fp32 on CPU go through ATen's fused attention (the dispatch the GPU
// uses too), fp64 through lvx's own kernel; the gate sweep of test_kernels.cpp runs both through
// attention_forward/attention_backward, so this pins that its fp32 and bf16 cases are fused.
TEST(FusedDispatch, Fp32AndBf16UseAtenFusedAttentionFp64UsesLvxKernel) {
  if (!cpu_uses_fused_path(at::kFloat)) GTEST_SKIP() << "LVX_CPU_ATTENTION=kernel";
  const int64_t sq = 300, skv = 1500, d = 16;
  for (auto dtype : {at::kFloat, at::kBFloat16, at::kHalf, at::kDouble}) {
    SCOPED_TRACE(dtype_name(dtype));
    auto q = at::randn({1, sq, 4, d}).to(dtype), k = at::randn({1, skv, 2, d}).to(dtype);
    auto v = at::randn({1, skv, 2, d}).to(dtype);
    AttentionParams p;
    p.mask = make_mask(MaskCase::kCausal, 1, sq, skv);
    AttentionStats fs, bs;
    auto out = attention_forward(q, k, v, p, &fs);
    auto g = attention_backward(q, k, v, q, out.lse, attention_delta(q, out.o), p, &bs);
    if (dtype == at::kFloat) {  // key tiles 0-1 are seen by every query: the shared call
      auto exact = attention_reference(q, k, v, vis(p, q, k), p.scale, at::kDouble);
      EXPECT_LE(error(out.o, exact.o), 2e-5);
      EXPECT_LE(error(out.lse, exact.lse), 2e-5);
      auto gx = reference_grads(q, k, v, q, p, at::kDouble);
      EXPECT_LE(error(g.dq, gx.dq), 2e-5);
      EXPECT_LE(error(g.dk, gx.dk), 2e-5);
      EXPECT_LE(error(g.dv, gx.dv), 2e-5);
    }
    if (dtype == at::kDouble) {
      EXPECT_EQ(fs.tiles_fused, 0);
      EXPECT_EQ(bs.tiles_fused, 0);
    } else {
      EXPECT_EQ(fs.tiles_fused + fs.tiles_skipped, fs.tiles_total);
      EXPECT_GT(fs.tiles_fused, 0);
      EXPECT_EQ(bs.tiles_fused, fs.tiles_fused);
      EXPECT_EQ(out.lse.scalar_type(), at::kFloat);
      EXPECT_EQ(out.o.scalar_type(), at::kFloat);
    }
  }
}

// An unmasked block skips the host-side mask preparation (the plan is known): it must plan,
// count and compute exactly as the prepared path does for the same visibility, here an
// all-true key padding (which goes through prepare_mask), at several batch rows, GQA and query
// counts over one and many tiles. Bitwise: both make the same single op calls.
TEST(FusedDispatch, UnmaskedPlanEqualsThePreparedPlanOfAnAllVisibleMask) {
  if (!cpu_uses_fused_path(at::kFloat)) GTEST_SKIP() << "LVX_CPU_ATTENTION=kernel";
  for (auto [batch, sq, hkv] :
       {std::tuple<int64_t, int64_t, int64_t>{1, 100, 4}, {2, 300, 2}, {1, 2 * kCpuQTile + 5, 1}}) {
    SCOPED_TRACE(str("batch ", batch, " sq ", sq, " hkv ", hkv));
    const int64_t skv = 3 * kCpuKTile + 7, d = 16;
    auto q = at::randn({batch, sq, 4, d}), k = at::randn({batch, skv, hkv, d});
    auto v = at::randn({batch, skv, hkv, d}), dout = at::randn({batch, sq, 4, d});
    AttentionParams none, padded;
    padded.mask.kv_valid = at::ones({batch, skv}, at::kBool);
    AttentionStats fn, fp, bn, bp;
    auto on = attention_forward(q, k, v, none, &fn), op = attention_forward(q, k, v, padded, &fp);
    EXPECT_TRUE(at::equal(on.o, op.o));
    EXPECT_TRUE(at::equal(on.lse, op.lse));
    auto gn = attention_backward(q, k, v, dout, on.lse, attention_delta(dout, on.o), none, &bn);
    auto gp = attention_backward(q, k, v, dout, op.lse, attention_delta(dout, op.o), padded, &bp);
    EXPECT_TRUE(at::equal(gn.dq, gp.dq));
    EXPECT_TRUE(at::equal(gn.dk, gp.dk));
    EXPECT_TRUE(at::equal(gn.dv, gp.dv));
    for (auto [a, b] : {std::pair{&fn, &fp}, std::pair{&bn, &bp}}) {
      EXPECT_EQ(a->tiles_total, b->tiles_total);
      EXPECT_EQ(a->tiles_full, b->tiles_full);
      EXPECT_EQ(a->tiles_fused, b->tiles_fused);
      EXPECT_EQ(a->tiles_skipped, 0);
      EXPECT_EQ(b->tiles_skipped, 0);
    }
    EXPECT_EQ(fn.tiles_total, batch * 4 * ((sq + kCpuQTile - 1) / kCpuQTile) * 4);
  }
}

// The fused path's plan on a media mask: runs of full tiles without a mask, masked runs with a
// dense bias, key tiles outside every query tile's range skipped, rows that see nothing
// (q_media -1) o = 0 / lse = -inf; checked against the fp64 reference with a tight fp32 bound.
TEST(FusedDispatch, MediaUpToRunsMergeAndEmptyRowsMatchReference) {
  const int64_t sq = 400, skv = 2600, h = 2, d = 16;
  at::manual_seed(5);
  auto q = at::randn({2, sq, h, d}), k = at::randn({2, skv, h, d}), v = at::randn({2, skv, h, d});
  auto dout = at::randn({2, sq, h, d});
  AttentionParams p;
  p.mask.kind = MaskKind::kMedia;
  p.mask.media_rule = MediaRule::kUpTo;
  // queries: -1 for the first 50, then media 0..3 in runs of 90; keys: media of 700 tokens.
  p.mask.q_media = at::clamp_max(at::floor_divide(at::arange(sq, at::kLong) - 50, 90), 3)
                       .to(at::kInt)
                       .unsqueeze(0)
                       .repeat({2, 1})
                       .contiguous();
  p.mask.kv_media =
      at::floor_divide(at::arange(skv, at::kLong), 700).to(at::kInt).unsqueeze(0).repeat({2, 1});
  AttentionStats st;
  auto out = attention_forward(q, k, v, p, &st);
  auto exact = attention_reference(q, k, v, vis(p, q, k), p.scale, at::kDouble);
  EXPECT_LE(error(out.o, exact.o), 2e-5);
  EXPECT_LE(error(out.lse, exact.lse), 2e-5);
  EXPECT_TRUE(at::equal(out.lse.select(2, 0), at::full({2, h}, -kInf)));
  EXPECT_TRUE(at::equal(out.o.select(1, 0), at::zeros({2, h, d})));
  if (cpu_uses_fused_path(at::kFloat)) {
    EXPECT_GT(st.tiles_fused, 0);
    EXPECT_GT(st.tiles_skipped, 0);
  }
  auto g = attention_backward(q, k, v, dout, out.lse, attention_delta(dout, out.o), p);
  auto gx = reference_grads(q, k, v, dout, p, at::kDouble);
  EXPECT_LE(error(g.dq, gx.dq), 2e-5);
  EXPECT_LE(error(g.dk, gx.dk), 2e-5);
  EXPECT_LE(error(g.dv, gx.dv), 2e-5);
}

// No mask or a top-left causal block: the fused path makes one call for the whole block and
// hands its outputs back without merging; still the fp64 reference's, fwd and bwd. Batch 1 with
// as many K/V heads as query heads; and several batch rows of a few queries with 4 query heads
// per K/V head (decode rows over a video's keys: unmasked, the group's heads folded along the
// sequence in one call; causal, a call per group head).
TEST(FusedDispatch, WholeBlockCallMatchesReference) {
  struct Shape {
    int64_t batch, sq, skv, hq, hkv;
  };
  for (const Shape& sh : {Shape{1, 700, 700, 2, 2}, Shape{3, 5, 700, 8, 2}}) {
    for (MaskCase mc : {MaskCase::kNone, MaskCase::kCausal}) {
      SCOPED_TRACE(std::string(mask_name(mc)) + " batch " + std::to_string(sh.batch));
      at::manual_seed(9);
      const int64_t d = 32;
      auto q = at::randn({sh.batch, sh.sq, sh.hq, d}),
           dout = at::randn({sh.batch, sh.sq, sh.hq, d});
      auto k = at::randn({sh.batch, sh.skv, sh.hkv, d}),
           v = at::randn({sh.batch, sh.skv, sh.hkv, d});
      AttentionParams p;
      p.mask = make_mask(mc, sh.batch, sh.sq, sh.skv);
      AttentionStats st;
      auto out = attention_forward(q, k, v, p, &st);
      auto exact = attention_reference(q, k, v, vis(p, q, k), p.scale, at::kDouble);
      EXPECT_LE(error(out.o, exact.o), 2e-5);
      EXPECT_LE(error(out.lse, exact.lse), 2e-5);
      EXPECT_TRUE(out.o.is_contiguous() && out.lse.is_contiguous());
      auto g = attention_backward(q, k, v, dout, out.lse, attention_delta(dout, out.o), p);
      auto gx = reference_grads(q, k, v, dout, p, at::kDouble);
      EXPECT_LE(error(g.dq, gx.dq), 2e-5);
      EXPECT_LE(error(g.dk, gx.dk), 2e-5);
      EXPECT_LE(error(g.dv, gx.dv), 2e-5);
      EXPECT_TRUE(g.dq.is_contiguous() && g.dk.is_contiguous() && g.dv.is_contiguous());
      if (cpu_uses_fused_path(at::kFloat)) {
        EXPECT_GT(st.tiles_fused, 0);
      }
    }
  }
}

}  // namespace
}  // namespace lvx::kernels
