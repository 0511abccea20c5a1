// Rows over their own pool slots (kernels::slot_attention, lvx serve's batched decode steps): the
// CPU loop (its AVX2 form at head dims in multiples of 8, its generic form elsewhere and for
// fp64/bf16) and the composite of ATen ops every other device runs, against an fp64 softmax per
// (row, token, head) over exactly the keys that token sees.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/slot_attention.h"
#include "tests/kernel_test_util.h"

namespace lvx::kernels {
namespace {

using namespace lvx::kernels::testing;

struct SlotCase {
  int64_t rows, tokens, hq, hkv, d, dv;
};

struct Inputs {
  at::Tensor q, k, v;
  std::vector<int64_t> slots, sees;
};

// Rows in scattered slots of a pool of C = 40 positions; token t of row r sees a count of keys
// that covers 1, fewer than 8, not a multiple of 8, and the whole slot.
Inputs make_inputs(const SlotCase& c, at::ScalarType dtype) {
  const int64_t S = c.rows + 3, C = 40;
  Inputs in{at::randn({c.rows, c.tokens, c.hq, c.d}, at::kDouble).to(dtype),
            at::randn({S, c.hkv, C, c.d}, at::kDouble).to(dtype),
            at::randn({S, c.hkv, C, c.dv}, at::kDouble).to(dtype),
            {},
            {}};
  const int64_t counts[] = {1, 5, 19, 40, 33, 8, 27};
  for (int64_t r = 0; r < c.rows; ++r) {
    in.slots.push_back((r * 2 + 1) % S);
    for (int64_t t = 0; t < c.tokens; ++t) in.sees.push_back(counts[(r * 3 + t) % 7]);
  }
  return in;
}

// The fp64 reference: o [R, T, Hq, Dv], lse [R, T, Hq].
SlotAttentionOutput reference(const Inputs& in, double scale) {
  const int64_t R = in.q.size(0), T = in.q.size(1), hq = in.q.size(2), g = hq / in.k.size(1);
  at::Tensor o = at::zeros({R, T, hq, in.v.size(3)}, at::kDouble);
  at::Tensor lse = at::zeros({R, T, hq}, at::kDouble);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < hq; ++h) {
        const int64_t n = in.sees[static_cast<size_t>(r * T + t)],
                      s = in.slots[static_cast<size_t>(r)];
        const at::Tensor k = in.k[s][h / g].narrow(0, 0, n).to(at::kDouble);
        const at::Tensor v = in.v[s][h / g].narrow(0, 0, n).to(at::kDouble);
        const at::Tensor scores = at::mv(k, in.q[r][t][h].to(at::kDouble)) * scale;
        o[r][t][h] = at::mv(v.t(), at::softmax(scores, 0));
        lse[r][t][h] = at::logsumexp(scores, 0);
      }
  return {o, lse};
}

class SlotAttention : public ::testing::TestWithParam<std::tuple<at::ScalarType, int>> {};

const SlotCase kCases[] = {
    {5, 1, 4, 2, 16, 16},    // a decode step's rows (AVX2 form for fp32)
    {3, 4, 6, 3, 20, 12},    // question tokens, head dims off the AVX2 form
    {2, 3, 2, 2, 64, 64},    // a served model's head dim
    {2, 2, 8, 1, 128, 128},  // the largest the AVX2 form takes, one K/V head
};

TEST_P(SlotAttention, LoopAndCompositeEqualTheReference) {
  const auto [dtype, which] = GetParam();
  const SlotCase& c = kCases[which];
  at::manual_seed(31 + which);
  const Inputs in = make_inputs(c, dtype);
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.d));
  const SlotAttentionOutput want = reference(in, scale);
  // fp64 exact up to rounding; fp32 and bf16 (its inputs exactly representable in fp32) compute
  // in fp32: measured at most ~5e-7 against fp64 over these cases.
  const double tol = dtype == at::kDouble ? 1e-12 : 1e-5;
  const SlotAttentionOutput loop = slot_attention(in.q, in.k, in.v, in.slots, in.sees, scale);
  const SlotAttentionOutput comp =
      slot_attention_composite(in.q, in.k, in.v, in.slots, in.sees, scale);
  for (const SlotAttentionOutput* got : {&loop, &comp}) {
    EXPECT_EQ(got->o.scalar_type(), accumulation_dtype(dtype));
    EXPECT_LE(error(got->o, want.o), tol);
    EXPECT_LE(error(got->lse, want.lse), tol);
  }
}

INSTANTIATE_TEST_SUITE_P(Kernels, SlotAttention,
                         ::testing::Combine(::testing::Values(at::kFloat, at::kDouble,
                                                              at::kBFloat16),
                                            ::testing::Values(0, 1, 2, 3)),
                         [](const auto& info) {
                           return dtype_name(std::get<0>(info.param)) + "_case" +
                                  std::to_string(std::get<1>(info.param));
                         });

// The loop reads each row's slot in place and only the keys each token sees: positions past them
// (another row's keys in a pool, never cleared) may hold anything, NaN included, and other slots
// are never read. The same rows on two threads give the same bits as on one.
TEST(SlotAttentionLoop, ReadsOnlyTheKeysEachTokenSeesOnAnyThreadCount) {
  at::manual_seed(5);
  const SlotCase c{6, 2, 4, 2, 16, 16};
  const Inputs clean = make_inputs(c, at::kFloat);
  Inputs dirty = clean;
  dirty.k = clean.k.clone();
  dirty.v = clean.v.clone();
  const double nan = std::numeric_limits<double>::quiet_NaN();
  for (int64_t s = 0; s < dirty.k.size(0); ++s) {
    int64_t most = 0;  // the most keys any token of slot s's row sees (0: no row reads it)
    for (size_t r = 0; r < dirty.slots.size(); ++r)
      if (dirty.slots[r] == s)
        for (int64_t t = 0; t < c.tokens; ++t)
          most = std::max(most, dirty.sees[r * static_cast<size_t>(c.tokens) + t]);
    dirty.k[s].narrow(1, most, dirty.k.size(2) - most).fill_(nan);
    dirty.v[s].narrow(1, most, dirty.v.size(2) - most).fill_(nan);
  }
  const double scale = 0.25;
  const SlotAttentionOutput want = reference(clean, scale);
  const int threads = at::get_num_threads();
  at::set_num_threads(1);
  const SlotAttentionOutput one =
      slot_attention(dirty.q, dirty.k, dirty.v, dirty.slots, dirty.sees, scale);
  at::set_num_threads(2);
  const SlotAttentionOutput two =
      slot_attention(dirty.q, dirty.k, dirty.v, dirty.slots, dirty.sees, scale);
  at::set_num_threads(threads);
  EXPECT_LE(error(one.o, want.o), 1e-5);
  EXPECT_LE(error(one.lse, want.lse), 1e-5);
  EXPECT_TRUE(at::equal(one.o, two.o));
  EXPECT_TRUE(at::equal(one.lse, two.lse));
}

// Arguments that do not fit are refused with a message naming them.
TEST(SlotAttentionLoop, RefusesArgumentsThatDoNotFit) {
  const Inputs in = make_inputs({2, 1, 4, 2, 16, 16}, at::kFloat);
  auto message = [&](std::vector<int64_t> slots, std::vector<int64_t> sees) {
    try {
      slot_attention(in.q, in.k, in.v, slots, sees, 0.25);
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message({0, 99}, in.sees).find("slot 99"), std::string::npos);
  EXPECT_NE(message(in.slots, {1, 0}).find("sees 0 keys"), std::string::npos);
  EXPECT_NE(message(in.slots, {1, 41}).find("sees 41 keys"), std::string::npos);
  EXPECT_NE(message({0}, in.sees).find("1 slots for 2 rows"), std::string::npos);
  try {
    slot_attention(in.q, in.k.to(at::kMeta), in.v, in.slots, in.sees, 0.25);
    ADD_FAILURE() << "no error for keys on another device";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("one device"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace lvx::kernels
