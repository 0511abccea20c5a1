// Merging partial attention states (merge_attention_states, kernels/attention.h): K/V split into
// blocks, each run with attention_forward and merged from the empty state, equals the unsplit
// forward; hand-made states pin the empty-row (-inf) and +inf conventions.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <tuple>

#include "kernels/attention.h"
#include "tests/kernel_test_util.h"

namespace lvx::kernels {
namespace {

using namespace lvx::kernels::testing;

// Splitting K/V into 2..4 blocks, running each block and merging equals the unsplit forward,
// including blocks in which some rows see nothing (causal, keys past the query).
class MergeSplit : public ::testing::TestWithParam<std::tuple<at::ScalarType, int>> {};

TEST_P(MergeSplit, EqualsUnsplitForward) {
  const auto [dtype, blocks] = GetParam();
  at::manual_seed(11 + blocks);
  const int64_t b = 2, sq = 50, skv = 900, hq = 4, hkv = 2, d = 32;
  auto q = at::randn({b, sq, hq, d}, dtype), k = at::randn({b, skv, hkv, d}, dtype);
  auto v = at::randn({b, skv, hkv, d}, dtype);
  AttentionParams p;
  p.mask.kind = MaskKind::kCausal;
  p.mask.q_pos = at::arange(sq, at::kLong) * 15 + 20;  // spread so every block has empty rows
  p.mask.k_pos = at::arange(skv, at::kLong);
  auto whole = attention_forward(q, k, v, p);
  // Start from the empty state, as a ring accumulator does.
  auto acc = accumulation_dtype(dtype);
  at::Tensor o = at::zeros({b, sq, hq, d}, acc);
  at::Tensor lse = at::full({b, hq, sq}, -kInf, acc);
  int64_t start = 0;
  for (int i = 0; i < blocks; ++i) {
    const int64_t end = i + 1 == blocks ? skv : start + (skv / blocks) + 37 * (i % 2);
    AttentionParams pb = p;
    pb.mask.k_pos = p.mask.k_pos.narrow(0, start, end - start);
    auto part =
        attention_forward(q, k.narrow(1, start, end - start), v.narrow(1, start, end - start), pb);
    merge_attention_states(o, lse, part.o, part.lse);
    start = end;
  }
  const double tol = dtype == at::kDouble ? 1e-12 : 2e-6;
  EXPECT_EQ(o.isnan().sum().item<int64_t>(), 0);
  EXPECT_LE(error(o, whole.o), tol);
  EXPECT_LE(error(lse, whole.lse), tol);
}

INSTANTIATE_TEST_SUITE_P(Blocks, MergeSplit,
                         ::testing::Combine(::testing::Values(at::kFloat, at::kDouble),
                                            ::testing::Values(2, 3, 4)),
                         [](const auto& info) {
                           return dtype_name(std::get<0>(info.param)) + "_" +
                                  std::to_string(std::get<1>(info.param)) + "blocks";
                         });

// Empty rows on either or both sides, and the +inf convention, by hand-made states whose merge
// is known exactly.
TEST(MergeStates, EmptyRowsAndInfinityConventions) {
  // Rows: 0 acc empty(-inf), 1 new empty(-inf), 2 both empty, 3 acc +inf, 4 new +inf,
  //       5 both +inf, 6 both finite and equal, 7 far apart (exp underflows).
  const int64_t rows = 8, d = 3;
  auto o_acc = at::arange(rows * d, at::kFloat).reshape({1, rows, 1, d}) + 1;
  auto o_new = -at::arange(rows * d, at::kFloat).reshape({1, rows, 1, d}) - 1;
  auto la = at::tensor({-kInf, 1.0, -kInf, kInf, 2.0, kInf, 0.5, 0.0}).to(at::kFloat);
  auto ln = at::tensor({3.0, -kInf, -kInf, 2.0, kInf, kInf, 0.5, 200.0}).to(at::kFloat);
  auto o_a0 = o_acc.clone(), o_n0 = o_new.clone();
  auto lse_acc = la.reshape({1, 1, rows}).clone();
  merge_attention_states(o_acc, lse_acc, o_new, ln.reshape({1, 1, rows}));
  auto l = lse_acc.flatten();
  EXPECT_EQ(o_acc.isnan().sum().item<int64_t>(), 0);
  EXPECT_FLOAT_EQ(l[0].item<float>(), 3.0f);
  EXPECT_TRUE(at::equal(o_acc.select(1, 0), o_n0.select(1, 0)));
  EXPECT_FLOAT_EQ(l[1].item<float>(), 1.0f);
  EXPECT_TRUE(at::equal(o_acc.select(1, 1), o_a0.select(1, 1)));
  for (int r : {2, 5}) {
    EXPECT_TRUE(std::isinf(l[r].item<float>()) && l[r].item<float>() < 0) << "row " << r;
    EXPECT_EQ(o_acc.select(1, r).abs().max().item<float>(), 0.0f) << "row " << r;
  }
  EXPECT_FLOAT_EQ(l[3].item<float>(), 2.0f);
  EXPECT_TRUE(at::equal(o_acc.select(1, 3), o_n0.select(1, 3)));
  EXPECT_FLOAT_EQ(l[4].item<float>(), 2.0f);
  EXPECT_TRUE(at::equal(o_acc.select(1, 4), o_a0.select(1, 4)));
  EXPECT_NEAR(l[6].item<float>(), 0.5f + std::log(2.0f), 1e-6);
  EXPECT_TRUE(at::allclose(o_acc.select(1, 6), (o_a0.select(1, 6) + o_n0.select(1, 6)) / 2));
  EXPECT_FLOAT_EQ(l[7].item<float>(), 200.0f);
  EXPECT_TRUE(at::allclose(o_acc.select(1, 7), o_n0.select(1, 7)));
}

}  // namespace
}  // namespace lvx::kernels
