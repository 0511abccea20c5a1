// The mask rules and the tiles they decide (kernels/mask.h): mask_matrix and visible_pairs
// against the independent loops of tests/reference_mask.h, tile classification under
// unmatched_sees_all, and the forward and backward skipping exactly the tiles nobody sees.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>

#include "kernels/attention.h"
#include "kernels/mask.h"
#include "kernels/registry.h"
#include "src/common/error.h"
#include "tests/reference_mask.h"

namespace lvx::kernels {
namespace {

// mask_matrix and visible_pairs (the kernels' vectorized forms of the rule) against the
// independent loops, for every mask kind with padding, on random metadata.
TEST(MaskMatrix, MatrixAndPairCountEqualTheIndependentRules) {
  at::manual_seed(7);
  const int64_t b = 2, sq = 23, skv = 41;
  // 6: causal over positions spread wide (visible_pairs sorts instead of counting a histogram)
  for (int kind = 0; kind < 7; ++kind) {  // 4, 5: media with unmatched_sees_all
    AttentionMask m;
    m.kind = kind == 0                ? MaskKind::kNone
             : kind == 1 || kind == 6 ? MaskKind::kCausal
                                      : MaskKind::kMedia;
    m.media_rule = kind == 2 || kind == 4 ? MediaRule::kImmediate : MediaRule::kUpTo;
    m.unmatched_sees_all = kind == 4 || kind == 5;
    m.q_pos = at::randperm(sq, at::kLong);
    m.k_pos = at::randint(0, sq, {skv}, at::kLong);
    if (kind == 6) {
      m.q_pos = m.q_pos * 1000000;
      m.k_pos = m.k_pos * 1000000;
    }
    m.q_media = at::randint(-1, 4, {b, sq}, at::kInt);
    m.kv_media = at::randint(-1, 4, {b, skv}, at::kInt);
    if (m.kind != MaskKind::kCausal) m.q_pos = m.k_pos = at::Tensor();
    if (m.kind != MaskKind::kMedia) m.q_media = m.kv_media = at::Tensor();
    m.kv_valid = at::rand({b, skv}) > 0.2;
    at::Tensor want = lvx::testing::reference_visibility(m, b, sq, skv);
    EXPECT_TRUE(mask_matrix(m, b, sq, skv).equal(want)) << "kind " << kind;
    EXPECT_EQ(visible_pairs(m, b, sq, skv), want.sum().item<int64_t>()) << "kind " << kind;
  }
}

TEST(MaskMatrix, RulesByHand) {
  AttentionMask m;
  m.kind = MaskKind::kMedia;
  m.q_media = at::tensor({-1, 0, 1}, at::kInt).unsqueeze(0);
  m.kv_media = at::tensor({0, 1, -1}, at::kInt).unsqueeze(0);
  m.media_rule = MediaRule::kImmediate;
  auto imm = mask_matrix(m, 1, 3, 3)[0].to(at::kInt);
  EXPECT_TRUE(at::equal(imm, at::tensor({0, 0, 0, 1, 0, 0, 0, 1, 0}, at::kInt).reshape({3, 3})));
  m.media_rule = MediaRule::kUpTo;
  auto upto = mask_matrix(m, 1, 3, 3)[0].to(at::kInt);
  EXPECT_TRUE(at::equal(upto, at::tensor({0, 0, 0, 1, 0, 0, 1, 1, 0}, at::kInt).reshape({3, 3})));
  // unmatched_sees_all: the −1 row sees every key (the −1 key included) but not padding.
  m.media_rule = MediaRule::kImmediate;
  m.unmatched_sees_all = true;
  m.kv_valid = at::tensor({1, 0, 1}, at::kInt).to(at::kBool).unsqueeze(0);
  auto all = mask_matrix(m, 1, 3, 3)[0].to(at::kInt);
  EXPECT_TRUE(at::equal(all, at::tensor({1, 0, 1, 1, 0, 0, 0, 0, 0}, at::kInt).reshape({3, 3})));
  EXPECT_EQ(visible_pairs(m, 1, 3, 3), 3);
  m.kind = MaskKind::kCausal;
  m.q_pos = m.k_pos = at::arange(3, at::kLong);
  EXPECT_THROW(mask_matrix(m, 1, 3, 3), lvx::Error);  // the flag is a media-mask flag
}

// Tile decisions under unmatched_sees_all: a query tile whose every query is unmatched is full
// against a key tile without padding (whatever the keys' media), skipped against an all-padding
// one; a mixed query tile is never skipped where one of its queries sees a real key.
TEST(MaskTiles, UnmatchedSeesAllClassifiesExactly) {
  const int64_t sq = 4, skv = 8;
  AttentionMask m;
  m.kind = MaskKind::kMedia;
  m.unmatched_sees_all = true;
  m.q_media = at::tensor({-1, -1, 0, -1}, at::kInt).unsqueeze(0);
  m.kv_media = at::tensor({-1, 1, 1, -1, 0, 0, 0, 0}, at::kInt).unsqueeze(0);
  m.kv_valid = at::tensor({1, 1, 1, 1, 0, 0, 0, 0}, at::kInt).to(at::kBool).unsqueeze(0);
  const PreparedMask pm = prepare_mask(m, 1, sq, skv, 2, 4, at::kCPU);
  // query tiles {−1, −1}, {0, −1}; key tiles {−1, 1, 1, −1} (no padding), {0 …} (all padding)
  EXPECT_EQ(classify_tile(pm.view.kind, pm.view.rule, pm.q_summary(0, 0), pm.k_summary(0, 0)),
            TileVisibility::kFull);
  EXPECT_EQ(classify_tile(pm.view.kind, pm.view.rule, pm.q_summary(0, 0), pm.k_summary(0, 1)),
            TileVisibility::kNone);
  EXPECT_EQ(classify_tile(pm.view.kind, pm.view.rule, pm.q_summary(0, 1), pm.k_summary(0, 0)),
            TileVisibility::kPartial);
  EXPECT_EQ(classify_tile(pm.view.kind, pm.view.rule, pm.q_summary(0, 1), pm.k_summary(0, 1)),
            TileVisibility::kNone);
  // Without the flag the first query tile sees nothing at all.
  m.unmatched_sees_all = false;
  const PreparedMask off = prepare_mask(m, 1, sq, skv, 2, 4, at::kCPU);
  EXPECT_EQ(classify_tile(off.view.kind, off.view.rule, off.q_summary(0, 0), off.k_summary(0, 0)),
            TileVisibility::kNone);
}

// Tile skipping actually skips: the forward skips exactly the (query tile, key tile) pairs of a
// causal block that have no visible entry, and computes without a mask exactly those fully
// visible (counted from the independent reference mask).
TEST(TileSkipping, CausalSkipsExactlyTheInvisibleTiles) {
  const int64_t sq = 2048, skv = 2048, d = 8;
  auto q = at::randn({1, sq, 1, d}), k = at::randn({1, skv, 1, d}), v = at::randn({1, skv, 1, d});
  AttentionParams p;
  p.mask.kind = MaskKind::kCausal;
  p.mask.q_pos = at::arange(sq, at::kLong);
  p.mask.k_pos = at::arange(skv, at::kLong);
  AttentionStats st;
  attention_forward(q, k, v, p, &st);
  auto visible = lvx::testing::reference_visibility(p.mask, 1, sq, skv)[0];
  int64_t none = 0, full = 0, total = 0;
  for (int64_t i = 0; i < sq; i += kCpuQTile) {
    for (int64_t j = 0; j < skv; j += kCpuKTile) {
      auto t = visible.narrow(0, i, std::min(kCpuQTile, sq - i))
                   .narrow(1, j, std::min(kCpuKTile, skv - j));
      none += !t.any().item<bool>();
      full += t.all().item<bool>();
      ++total;
    }
  }
  EXPECT_EQ(st.tiles_total, total);
  EXPECT_EQ(st.tiles_skipped, none);
  EXPECT_EQ(st.tiles_full, full);
  EXPECT_GT(st.tiles_skipped, total / 3);  // 24 of 64 at 128 x 512 tiles
  AttentionStats bs;
  auto out = attention_forward(q, k, v, p);
  attention_backward(q, k, v, q, out.lse, attention_delta(q, out.o), p, &bs);
  EXPECT_EQ(bs.tiles_skipped, none);
  EXPECT_EQ(bs.tiles_full, full);
}

TEST(TileSkipping, MediaImmediateSkipsOtherMediaTiles) {
  // Two media of 1024 keys each; queries of media 1 never touch media 0's tiles.
  const int64_t sq = 256, skv = 2048, d = 8;
  auto q = at::randn({1, sq, 1, d}), k = at::randn({1, skv, 1, d}), v = at::randn({1, skv, 1, d});
  AttentionParams p;
  p.mask.kind = MaskKind::kMedia;
  p.mask.q_media = at::ones({1, sq}, at::kInt);
  p.mask.kv_media =
      at::floor_divide(at::arange(skv, at::kLong), 1024).to(at::kInt).unsqueeze(0).contiguous();
  AttentionStats st;
  attention_forward(q, k, v, p, &st);
  EXPECT_EQ(st.tiles_total, 2 * 4);
  EXPECT_EQ(st.tiles_skipped, 2 * 2);
  EXPECT_EQ(st.tiles_full, 2 * 2);
}

}  // namespace
}  // namespace lvx::kernels
